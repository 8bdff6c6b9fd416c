//! The decoder on a GPU (feature `device`): [`DeviceGpt`] holds a whole model's parameters,
//! gradients and activations in device buffers and runs [`crate::Gpt`]'s forward and backward
//! with the `device` crate's kernels, step for step as the CPU runs them: the same block
//! (`x = x + drop(attn(norm_1(x))); x = x + drop(mlp(norm_2(x)))`), the same dropout sites and
//! masks, the same fused head. Per pass only the token ids and targets go to the device.
//!
//! It covers a whole model on one device: GPT-2, LLaMA and mixture-of-experts families, in fp32
//! or with 16-bit working weights, and LoRA or QLoRA over a frozen base ([`frozen`]); as a
//! data-parallel rank under ZeRO-2/3 its gradients (and weights) are a shard, each unit's
//! reduced (and gathered) through its group as the passes reach it ([`zero`]). A part of a
//! model runs with the host model's hooks lent to it: a tensor/sequence-parallel part
//! ([`split`]), a pipeline stage ([`stage`]), an expert-parallel part ([`experts`]), a
//! context-parallel part ([`context`]). [`DeviceGpt::new`] refuses the rest by name
//! ([`unsupported`]).

mod context;
mod experts;
mod frozen;
mod split;
mod stage;
mod zero;

pub use stage::DeviceActs;
pub use zero::{ShardLayout, Zero, ZeroGroup};

use crate::config::Arch;
use crate::generate::Feed;
use crate::gpt::{Pass, IGNORE_INDEX};
use crate::layout::{GptParams, MoeParams};
use crate::lora::Site;
use frozen::Frozen;
use crate::{Gpt, GptConfig};
use device::{At, Buf, DType, Gemm, Gpu, MatSpec, RopePos, Seed};
use std::sync::Arc;
use tensor::classifier::HeadDims;
use tensor::llama::GqaDims;
use tensor::matmul::Arith;
use tensor::ops::RowMap;

/// Where a pass's loss weight sits in [`DeviceGpt::scalars`] (after the optimizer's slots).
pub const LOSS_WEIGHT: usize = device::slot::OPTIM;
/// Where a training pass's dropout seed sits (two words, low first): the kernels derive each
/// site's seed from it on the device.
pub const DROPOUT_SEED: usize = LOSS_WEIGHT + 1;
/// Slots of [`DeviceGpt::scalars`].
pub const SCALARS: usize = DROPOUT_SEED + 2;

/// One block's activations, kept from forward for backward.
struct LayerActs {
    ln_1: Buf,
    ln_1_mean: Buf,
    ln_1_rstd: Buf,
    qkv: Buf,
    atty: Buf,
    lse: Buf,
    res_2: Buf,
    ln_2: Buf,
    ln_2_mean: Buf,
    ln_2_rstd: Buf,
    fch: Buf,
    fch_act: Buf,
    moe: Option<MoeActs>,
}

/// An MoE layer's activations (`tensor::moe`'s names): the router's logits and routing, the
/// dispatched rows and each routed expert's `[gate | up]`, activation and output over its packed
/// rows (upper bound `N·K`), the shared experts' over every token. (Its routing statistics are
/// the layer's own in [`Acts::moe_stats`], whichever set its activations are in.)
struct MoeActs {
    logits: Buf,
    routing: device::Routing,
    xe: Buf,
    gu: Buf,
    h: Buf,
    eo: Buf,
    sgu: Vec<Buf>,
    sh: Vec<Buf>,
    /// An expert-parallel part's received rows ([`experts`]).
    ep: Option<experts::EpActs>,
}

/// An MoE layer's backward scratch, shared by the layers.
struct MoeScratch {
    deo: Buf,
    dh: Buf,
    dgu: Buf,
    dgate: Buf,
    dlogits: Buf,
    aux_coef: Buf,
    /// An expert-parallel part's received rows' gradients.
    dl: Option<Buf>,
}

/// The element counts of an MoE layer's buffers ([`MoeActs`], then [`MoeScratch`]'s once).
fn moe_sizes(cfg: &GptConfig, n: usize) -> (Vec<usize>, Vec<usize>) {
    let (c, f, e, k, s) = (cfg.n_embd, cfg.ffn_hidden, cfg.n_expert, cfg.top_k, cfg.n_shared_expert);
    let nk = n * k;
    let mut acts = vec![n * e, n * e, n, nk, nk, nk, nk, e + 1, e, nk * c, nk * 2 * f, nk * f, nk * c];
    acts.extend(std::iter::repeat_n(n * 2 * f, s).chain(std::iter::repeat_n(n * f, s)));
    // An expert-parallel part's received rows, which its experts' scratch must hold too.
    let (ep, dl) = experts::ep_sizes(cfg, n);
    acts.extend(&ep);
    let rows = experts::ep_shape(cfg, n).map_or(0, |s| s.rows).max(nk).max(n);
    let mut scratch = vec![nk * c, rows * f, rows * 2 * f, nk, n * e, e];
    scratch.extend(dl);
    (acts, scratch)
}

impl MoeActs {
    fn new(g: &Gpu, cfg: &GptConfig, n: usize) -> MoeActs {
        let (c, f, e, k, s) = (cfg.n_embd, cfg.ffn_hidden, cfg.n_expert, cfg.top_k, cfg.n_shared_expert);
        MoeActs {
            logits: g.zeros(n * e),
            routing: g.routing(n, e, k),
            xe: g.zeros(n * k * c),
            gu: g.zeros(n * k * 2 * f),
            h: g.zeros(n * k * f),
            eo: g.zeros(n * k * c),
            sgu: (0..s).map(|_| g.zeros(n * 2 * f)).collect(),
            sh: (0..s).map(|_| g.zeros(n * f)).collect(),
            ep: experts::EpActs::new(g, cfg, n),
        }
    }
}

impl MoeScratch {
    fn new(g: &Gpu, cfg: &GptConfig, n: usize) -> MoeScratch {
        let (_, z) = moe_sizes(cfg, n);
        let dl = z.get(6).map(|&len| g.zeros(len));
        MoeScratch { deo: g.zeros(z[0]), dh: g.zeros(z[1]), dgu: g.zeros(z[2]), dgate: g.zeros(z[3]), dlogits: g.zeros(z[4]), aux_coef: g.zeros(z[5]), dl }
    }
}

/// The elements of a context-parallel part's packed keys and values over `n` rows.
fn ring_len(cfg: &GptConfig, n: usize) -> usize {
    let nkv = match cfg.arch {
        Arch::Gpt2 => cfg.n_head,
        Arch::Llama => cfg.n_kv_head,
    };
    2 * n * nkv * cfg.head_size()
}

/// A pass's buffers for `(B, T)`: the residual stream between blocks, each block's kept
/// activations, the head's, and backward's scratch.
struct Acts {
    b: usize,
    t: usize,
    xs: Vec<Buf>,
    /// The blocks' activation sets ([`Acts::layer`]): one for each block that keeps its own, and
    /// one shared by the blocks full recomputation re-runs in backward.
    layers: Vec<LayerActs>,
    keep: Keep,
    /// Selective recomputation: the attention core's outputs (`atty`, `lse`), shared by every
    /// block (whose own are empty) and re-run in backward.
    core: Option<(Buf, Buf)>,
    /// Each MoE layer's routing statistics from the last forward, `[Σ_t probs (E) | Σ_t lse² |
    /// counts (E, u32) | kept rows (u32)]`.
    moe_stats: Vec<Buf>,
    /// Each MoE layer's rows sent to and received from other expert-parallel parts in the
    /// last forward.
    ep_rows: Vec<std::cell::Cell<(usize, usize)>>,
    ln_f: Buf,
    ln_f_mean: Buf,
    ln_f_rstd: Buf,
    dln_f: Buf,
    losses: Buf,
    tokens: Buf,
    targets: Buf,
    /// Packed documents: each token's document start and position (`[B, T]`, u32).
    starts: Buf,
    pos: Buf,
    head_scratch: Buf,
    /// A vocabulary-parallel head's per-row statistics of a chunk (empty otherwise).
    head_stats: Buf,
    /// Sequence parallelism: whole-sequence rows `[B, T, C]` (a row-parallel product's partial
    /// sums before they are reduce-scattered, a gathered output gradient, a column-parallel
    /// input's gradient before it is reduce-scattered), and this part's rows of a norm's output
    /// before they are gathered; both empty otherwise.
    full: Buf,
    local: Buf,
    branch: Buf,
    dres: Buf,
    dbranch: Buf,
    dln: Buf,
    datty: Buf,
    dqkv: Buf,
    dfch: Buf,
    dfch_act: Buf,
    /// FlashAttention-2's `D` in backward.
    dd: Buf,
    /// An MoE layer's input gradient over the whole sequence under sequence parallelism.
    full_grad: Option<Buf>,
    /// A context-parallel part's ring: the block of keys and values it holds, packed
    /// `[B, T, 2·NKV·HS]`, and their gradients' accumulator ([`context`]).
    ring: Option<(Buf, Buf)>,
    moe: Option<MoeScratch>,
}

/// The residual stream's rows of a pass over `n` rows: this part's share of every sequence's
/// positions under sequence parallelism, else all of them.
fn local_rows(cfg: &GptConfig, n: usize) -> usize {
    cfg.place.seq.map_or(n, |s| n / s.count)
}

/// Which activations a pass keeps (`Gpt`'s recomputation, on the device): the set each block
/// writes (`slot`; under full recomputation of every `k`-th block those blocks share set 0 and
/// re-run their forward into it in backward, the others keep their own), and under selective
/// recomputation one shared attention core.
#[derive(Clone, Debug, PartialEq)]
struct Keep {
    slot: Vec<usize>,
    recomputed: Vec<bool>,
    sets: usize,
    selective: bool,
}

impl Keep {
    fn new(cfg: &GptConfig, recompute: crate::Recompute, every: usize) -> Keep {
        let every = every.max(1);
        let recomputed: Vec<bool> = (0..cfg.n_layer).map(|i| recompute == crate::Recompute::Full && (cfg.first_layer() + i).is_multiple_of(every)).collect();
        let mut slot = vec![0; cfg.n_layer];
        let mut next = usize::from(recomputed.iter().any(|&r| r));
        for (s, &r) in slot.iter_mut().zip(&recomputed) {
            if !r {
                *s = next;
                next += 1;
            }
        }
        Keep { slot, recomputed, sets: next, selective: recompute == crate::Recompute::Selective }
    }
}

impl Acts {
    /// Block `l`'s activations.
    fn layer(&self, l: usize) -> &LayerActs {
        &self.layers[self.keep.slot[l]]
    }

    /// Block `l`'s attention core outputs, `(atty, lse)`: its own, or the shared ones.
    fn core(&self, l: usize) -> (&Buf, &Buf) {
        match &self.core {
            Some((atty, lse)) => (atty, lse),
            None => (&self.layer(l).atty, &self.layer(l).lse),
        }
    }

    /// The elements of each buffer [`Acts::new`] allocates, in order (`u32` ids included).
    fn lens(cfg: &GptConfig, (b, t): (usize, usize), head_rows: usize, keep: &Keep) -> Vec<usize> {
        let (n, c, nh) = (b * t, cfg.n_embd, cfg.n_head);
        let nl = local_rows(cfg, n);
        let (fc, act) = if cfg.is_moe() { (0, 0) } else { (n * cfg.fc_width(), n * cfg.ffn_hidden) };
        let (atty, lse) = (n * cfg.attn_width(), b * nh * t);
        let own = if keep.selective { (0, 0) } else { (atty, lse) };
        let layer = [n * c, nl, nl, n * cfg.qkv_width(), own.0, own.1, nl * c, n * c, nl, nl, fc, act];
        let mut v: Vec<usize> = (0..=cfg.n_layer).map(|_| nl * c).collect();
        let (moe, scratch) = moe_sizes(cfg, n);
        for _ in 0..keep.sets {
            v.extend(layer);
            if cfg.is_moe() {
                v.extend(&moe);
            }
        }
        if keep.selective {
            v.extend([atty, lse]);
        }
        if cfg.is_moe() {
            v.extend(std::iter::repeat_n(2 * cfg.n_expert + 2, cfg.n_layer));
            v.extend(scratch);
        }
        let sp = if nl < n { (n * c, nl * c) } else { (0, 0) };
        let stats = if cfg.place.vocab.is_some() { 2 * head_rows } else { 0 };
        v.extend([n * c, nl, nl, nl * c, n, n, n, n, n, head_rows * cfg.vocab_size, stats, sp.0, sp.1, nl * c, nl * c, nl * c, nl * c, n * cfg.attn_width(), n * cfg.qkv_width(), fc, act, b * nh * t]);
        if cfg.place.context.is_some() {
            v.extend([ring_len(cfg, n); 2]);
        }
        if cfg.is_moe() && nl < n {
            v.push(n * c);
        }
        v
    }

    fn new(g: &Gpu, cfg: &GptConfig, (b, t): (usize, usize), keep: Keep) -> Acts {
        let (n, c, nh) = (b * t, cfg.n_embd, cfg.n_head);
        let nl = local_rows(cfg, n);
        let z = |len: usize| g.zeros(len);
        let own = if keep.selective { (0, 0) } else { (n * cfg.attn_width(), b * nh * t) };
        let layer = |_| LayerActs {
            ln_1: z(n * c),
            ln_1_mean: z(nl),
            ln_1_rstd: z(nl),
            qkv: z(n * cfg.qkv_width()),
            atty: z(own.0),
            lse: z(own.1),
            res_2: z(nl * c),
            ln_2: z(n * c),
            ln_2_mean: z(nl),
            ln_2_rstd: z(nl),
            fch: z(if cfg.is_moe() { 0 } else { n * cfg.fc_width() }),
            fch_act: z(if cfg.is_moe() { 0 } else { n * cfg.ffn_hidden }),
            moe: cfg.is_moe().then(|| MoeActs::new(g, cfg, n)),
        };
        let head_rows = g.head_rows(n, cfg.vocab_size);
        Acts {
            b,
            t,
            xs: (0..=cfg.n_layer).map(|_| z(nl * c)).collect(),
            layers: (0..keep.sets).map(layer).collect(),
            core: keep.selective.then(|| (z(n * cfg.attn_width()), z(b * nh * t))),
            moe_stats: (0..if cfg.is_moe() { cfg.n_layer } else { 0 }).map(|_| z(2 * cfg.n_expert + 2)).collect(),
            ep_rows: (0..cfg.n_layer).map(|_| Default::default()).collect(),
            keep,
            ln_f: z(n * c),
            ln_f_mean: z(nl),
            ln_f_rstd: z(nl),
            dln_f: z(nl * c),
            losses: z(n),
            tokens: g.zeros_of(n, DType::U32),
            targets: g.zeros_of(n, DType::U32),
            starts: g.zeros_of(n, DType::U32),
            pos: g.zeros_of(n, DType::U32),
            head_scratch: z(head_rows * cfg.vocab_size),
            head_stats: z(if cfg.place.vocab.is_some() { 2 * head_rows } else { 0 }),
            full: z(if nl < n { n * c } else { 0 }),
            local: z(if nl < n { nl * c } else { 0 }),
            branch: z(nl * c),
            dres: z(nl * c),
            dbranch: z(nl * c),
            dln: z(nl * c),
            datty: z(n * cfg.attn_width()),
            dqkv: z(n * cfg.qkv_width()),
            dfch: z(if cfg.is_moe() { 0 } else { n * cfg.fc_width() }),
            dfch_act: z(if cfg.is_moe() { 0 } else { n * cfg.ffn_hidden }),
            dd: z(b * nh * t),
            full_grad: (cfg.is_moe() && nl < n).then(|| z(n * c)),
            ring: cfg.place.context.map(|_| (z(ring_len(cfg, n)), z(ring_len(cfg, n)))),
            moe: cfg.is_moe().then(|| MoeScratch::new(g, cfg, n)),
        }
    }
}

/// A whole model resident on a device: parameters and gradients in [`crate::ParamLayout`]'s
/// flat order (so a checkpoint is a download), activations for one `(B, T)` at a time.
pub struct DeviceGpt {
    pub gpu: Arc<Gpu>,
    pub cfg: GptConfig,
    views: GptParams,
    real_vocab: usize,
    /// The fp32 (master) weights.
    pub params: Buf,
    /// Mixed precision: the weights the passes read, `params` rounded to bf16 or f16 after
    /// every update ([`DeviceGpt::refresh_working`]); `None` in fp32.
    work: Option<Buf>,
    pub grads: Buf,
    /// The step's scalars: `device::slot`'s, then [`LOSS_WEIGHT`].
    pub scalars: Buf,
    rope: Option<(Buf, Buf)>,
    acts: Option<Acts>,
    /// The last training pass's dropout `(p, seed)`, targets counted, and whether it trained.
    drop: (f32, u64),
    count: usize,
    /// Whether the last pass ran over packed documents (`Acts::starts`, `Acts::pos`).
    docs: bool,
    /// The recomputation policy (`Gpt::recompute`, `Gpt::recompute_every`): [`Keep`].
    recompute: (crate::Recompute, usize),
    /// The last training pass's loss scale (the MoE losses' weights take it too).
    loss_scale: f32,
    /// Reductions' partial sums.
    parts: Buf,
    /// Decoding's logits `[Vp]` (allocated by the first decoded token).
    logits: Option<Buf>,
    /// LoRA: the adapters over a frozen base (`params` then holds the base, read-only, in the
    /// passes' type or, under QLoRA, its fp32 tensors packed beside the quantized matrices).
    frozen: Option<Frozen>,
    /// ZeRO-2/3 over a data-parallel group ([`zero`]): the gradients (and at stage 3 the
    /// weights) held as this member's shard.
    zero: Option<Zero>,
    /// A tensor-parallel part's hooks ([`split`]), lent by the host model while it trains.
    tensor: std::cell::RefCell<Option<Box<dyn crate::units::TpHooks>>>,
    /// The MoE exchange ([`experts`]), lent by the host model while it trains: an
    /// expert-parallel part's way to its experts' owners, and the routing group's statistics.
    experts: std::cell::RefCell<Option<Box<dyn tensor::moe::MoeExchange + Send>>>,
    /// A context-parallel part's hooks ([`context`]), lent by the host model while it trains.
    context: std::cell::RefCell<Option<Box<dyn crate::units::CpHooks>>>,
    /// The layout's units (`Gpt::units`): embeddings, each block, the final norm and head.
    units: Vec<std::ops::Range<usize>>,
}

/// Keys and values of every layer on the device, `[L, block_size, NKV·HS]` each: what
/// [`DeviceGpt::generate`] decodes against.
pub struct DeviceKvCache {
    k: Buf,
    v: Buf,
    pub len: usize,
}

/// What the device model cannot run yet of a model shaped `cfg`, by name; `None` when it can.
pub fn unsupported_config(cfg: &GptConfig) -> Option<String> {
    let why = if cfg.qk_norm {
        "q/k norms (model.qk_norm)"
    } else if cfg.block_norms != crate::config::BlockNorms::Pre {
        "norms after the branches (model.block_norms)"
    } else if cfg.gate_act != crate::config::GateAct::Silu {
        "GeGLU MLPs (model.gate_act)"
    } else if cfg.norm_offset || cfg.embed_scale || cfg.query_pre_attn_scalar > 0 || cfg.rope_local_theta != 0.0 {
        "Gemma's norms, embedding scale, attention scale or local rotary base (model.norm_offset, model.embed_scale, model.query_pre_attn_scalar, model.rope_local_theta)"
    } else if cfg.attn_softcap != 0.0 || cfg.final_softcap != 0.0 {
        "soft-capped logits (model.attn_softcap, model.final_softcap)"
    } else if cfg.is_mla() {
        "multi-head latent attention (model.kv_lora_rank)"
    } else if cfg.moe_first_layer > 0 {
        "dense layers before the routed ones (model.moe_first_layer)"
    } else if cfg.moe_router != crate::config::MoeRouter::Softmax || cfg.moe_gate_scale != 1.0 {
        "the sigmoid router or a gate scale (model.moe_router, model.moe_gate_scale)"
    } else if cfg.attn_sinks > 0 {
        "attention sinks (model.attn_sinks)"
    } else if cfg.pad_token_id.is_some() {
        "a padding token's frozen embedding row (model.pad_token_id)"
    } else if cfg.head_size() > device::MAX_HEAD_SIZE {
        "heads larger than 128"
    } else if cfg.rope_scaling.as_ref().and_then(|r| r.long_after()).is_some_and(|n| cfg.block_size > n) {
        "LongRoPE's second table"
    } else {
        return None;
    };
    Some(format!("the device does not run {why} yet"))
}

/// [`unsupported_config`], and what the model itself holds: FP8 storage; LoRA under fp16.
pub fn unsupported(m: &Gpt) -> Option<String> {
    if m.lora.is_some() && m.precision == crate::Precision::Fp16 {
        return Some("the device does not run LoRA adapters in fp16 (train.precision = fp16)".into());
    }
    if m.precision == crate::Precision::Fp8 {
        return Some("the device does not run FP8 storage (train.precision = fp8) yet".into());
    }
    if m.lora.is_some() && m.cfg.place.heads.is_some() {
        return Some("the device does not run LoRA adapters on a tensor-parallel part yet".into());
    }
    unsupported_config(&m.cfg)
}

/// The type of the weights the passes read under `p` (`None`: the fp32 weights themselves).
fn working_type(p: crate::Precision) -> Option<DType> {
    match p {
        crate::Precision::Bf16 => Some(DType::Bf16),
        crate::Precision::Fp16 => Some(DType::F16),
        _ => None,
    }
}

/// What a device model allocates: its largest buffer and the total, in bytes, for `(B, T)`
/// with `extra` more buffers the size of the trainable parameters (an optimizer's moments).
#[derive(Clone, Copy, Debug)]
pub struct DevicePlan {
    pub params: usize,
    /// The parameters that train (the adapters' under LoRA), or this rank's shard of them
    /// (ZeRO-2/3).
    pub trainable: usize,
    pub total_bytes: u64,
    pub largest_bytes: u64,
    /// Of `total_bytes`, one pass's activations (what each more micro-batch a pipeline
    /// schedule keeps in flight adds).
    pub activation_bytes: u64,
}

/// The weights a device model holds, for [`plan`]: every parameter training, or LoRA's
/// adapters over a frozen base.
#[derive(Clone, Copy, Debug)]
pub enum Weights {
    Full { params: usize },
    Lora {
        params: usize,
        /// The adapters' parameters, their count and rank.
        adapters: (usize, usize, usize),
        /// The base on the device: the passes' type, or quantized (NF4 or int8 codes, scales,
        /// and the fp32 tensors beside them).
        base_bytes: u64,
        quantized: bool,
    },
    /// ZeRO-1, 2 or 3 ([`zero`]): the moments (from stage 2 the gradients, at stage 3 the
    /// weights) as a shard of `shard` elements; `units` the largest unit's elements and those of the embeddings'
    /// and final units (held from the forward's head through the backward).
    Zero { stage: u8, params: usize, shard: usize, units: (usize, usize, usize) },
}

impl Weights {
    /// LoRA's weights for `lora` over a base of `layout` stored as the passes read it, or
    /// quantized as `quant`.
    pub fn lora(layout: &crate::ParamLayout, lora: &crate::lora::Lora, precision: crate::Precision, quant: crate::BaseQuant) -> Weights {
        let params = layout.total;
        let base_bytes = match quant {
            crate::BaseQuant::None if precision == crate::Precision::Bf16 => 4 * params.div_ceil(2) as u64,
            crate::BaseQuant::None => 4 * params as u64,
            q => crate::qbase::planned_bytes(layout, q) as u64,
        };
        Weights::Lora { params, adapters: (lora.params.len(), lora.adapters.len(), lora.rank), base_bytes, quantized: quant != crate::BaseQuant::None }
    }
}

/// [`DevicePlan`] of a model shaped `cfg` holding `weights` on `gpu`: the parameters and
/// gradients that train and `extra` more buffers of their size (and the 16-bit working copy
/// under mixed precision), or LoRA's frozen base and adapters; the activations and scratch of
/// one `(B, T)` pass (one block's under full recomputation).
pub fn plan(gpu: &Gpu, cfg: &GptConfig, weights: Weights, (b, t): (usize, usize), extra: usize, policy: (crate::Precision, crate::Recompute, usize)) -> DevicePlan {
    let (precision, recompute, every) = policy;
    let mut sizes = Acts::lens(cfg, (b, t), gpu.head_rows(b * t, cfg.vocab_size), &Keep::new(cfg, recompute, every));
    let bytes = |n: usize| (n.max(1) * 4) as u64;
    let activation_bytes = sizes.iter().map(|&n| bytes(n)).sum();
    let (params, trainable, base) = match weights {
        Weights::Full { params } => {
            sizes.extend(std::iter::repeat_n(params, 2 + extra));
            if matches!(precision, crate::Precision::Bf16 | crate::Precision::Fp16) {
                sizes.push(params.div_ceil(2));
            }
            (params, params, 0)
        }
        Weights::Zero { stage: 1, params, shard, .. } => {
            // ZeRO-1: the whole weights and gradients, the moments' shard.
            sizes.extend([params, params]);
            sizes.extend(std::iter::repeat_n(shard, extra));
            if matches!(precision, crate::Precision::Bf16 | crate::Precision::Fp16) {
                sizes.push(params.div_ceil(2));
            }
            (params, params, 0)
        }
        Weights::Zero { stage, params, shard, units: (largest, first, last) } => {
            let half = matches!(precision, crate::Precision::Bf16 | crate::Precision::Fp16);
            // The shard's gradients and moments; at stage 2 the whole weights, at stage 3 the
            // weights' shard and at most three units gathered (fp32 and the passes' copy).
            sizes.extend(std::iter::repeat_n(shard, 1 + extra));
            let held = [largest, first, last];
            if stage == 3 {
                sizes.push(shard);
                sizes.extend(held);
                if half {
                    sizes.extend(held.map(|n| n.div_ceil(2)));
                }
            } else {
                sizes.push(params);
                if half {
                    sizes.push(params.div_ceil(2));
                }
            }
            // Backward's unit gradient buffers (at most three at once).
            sizes.extend(held);
            (params, shard, 0)
        }
        Weights::Lora { params, adapters, base_bytes, quantized } => {
            let deq = if quantized { frozen::largest_matrix(cfg) } else { 0 };
            sizes.extend(frozen::buffer_lens(adapters, b * t, deq, cfg.n_embd));
            sizes.extend(std::iter::repeat_n(adapters.0, extra));
            if quantized && precision == crate::Precision::Bf16 {
                sizes.push(deq.div_ceil(2));
            }
            (params, adapters.0, base_bytes)
        }
    };
    sizes.extend([Gpu::parts_len(), SCALARS]);
    let largest = sizes.iter().map(|&n| bytes(n)).max().unwrap_or(0);
    DevicePlan { params, trainable, total_bytes: base + sizes.iter().map(|&n| bytes(n)).sum::<u64>(), largest_bytes: largest.max(base.min(4 * params as u64)), activation_bytes }
}

impl DeviceGpt {
    /// `m`'s parameters uploaded to `gpu`, gradients zeroed; refuses what the device cannot run
    /// ([`unsupported`]).
    pub fn new(gpu: Arc<Gpu>, m: &Gpt) -> Result<DeviceGpt, String> {
        if let Some(why) = unsupported(m) {
            return Err(why);
        }
        if let Some(lo) = &m.lora {
            return DeviceGpt::new_frozen(gpu, m, lo);
        }
        let params = gpu.alloc(m.params.len(), DType::F32).map_err(|e| e.0)?;
        gpu.write(&params, &m.params);
        let grads = gpu.alloc(m.params.len(), DType::F32).map_err(|e| e.0)?;
        let work = working_type(m.precision).map(|d| gpu.alloc(m.params.len(), d)).transpose().map_err(|e| e.0)?;
        let dev = DeviceGpt::assemble(gpu, m, (m.views.clone(), params, work, grads), None);
        dev.refresh_working();
        Ok(dev)
    }

    /// LoRA: `m`'s base uploaded read-only in the passes' type (QLoRA: its fp32 tensors packed
    /// unit by unit, `QuantBase::compact_unit`, and the quantized matrices as they are held),
    /// the adapters beside it.
    fn new_frozen(gpu: Arc<Gpu>, m: &Gpt, lora: &crate::lora::Lora) -> Result<DeviceGpt, String> {
        let bf16 = m.precision == crate::Precision::Bf16;
        let dtype = if bf16 { DType::Bf16 } else { DType::F32 };
        let (host, views) = match m.quantized_base() {
            Some(q) => {
                let mut offs = vec![0];
                for u in 0..m.units.len() {
                    offs.push(offs[u] + q.compact_len(u));
                }
                let mut host = vec![0.0; offs[m.units.len()]];
                for u in 0..m.units.len() {
                    q.compact_unit(u, &mut host[offs[u]..offs[u + 1]]);
                }
                let views = q.compact_views(&m.views.rebased(m.layout.total)).map_units(|r, u| if r.is_empty() { r.clone() } else { r.start + offs[u]..r.end + offs[u] });
                (std::borrow::Cow::Owned(host), views)
            }
            None => (std::borrow::Cow::Borrowed(&m.params[..]), m.views.clone()),
        };
        let params = gpu.alloc(host.len(), dtype).map_err(|e| e.0)?;
        gpu.write(&params, &host);
        let frozen = Frozen::new(&gpu, lora, m.quantized_base().map(|q| &**q), (m.cfg.n_layer, m.cfg.n_embd), bf16)?;
        let grads = gpu.zeros(1);
        Ok(DeviceGpt::assemble(gpu, m, (views, params, None, grads), Some(frozen)))
    }

    fn assemble(gpu: Arc<Gpu>, m: &Gpt, (views, params, work, grads): (GptParams, Buf, Option<Buf>, Buf), frozen: Option<Frozen>) -> DeviceGpt {
        let rope = m.rope.as_ref().map(|r| {
            let (cos, sin) = r.for_pass(0);
            (gpu.upload(cos), gpu.upload(sin))
        });
        let (scalars, parts) = (gpu.zeros(SCALARS), gpu.zeros(Gpu::parts_len()));
        DeviceGpt { cfg: m.cfg.clone(), views, real_vocab: m.real_vocab, params, work, grads, scalars, rope, acts: None, drop: (0.0, 0), count: 0, loss_scale: 1.0, parts, logits: None, docs: false, recompute: (m.recompute, m.recompute_every), frozen, zero: None, tensor: Default::default(), experts: Default::default(), context: Default::default(), units: m.units.clone(), gpu }
    }

    /// The parameters that train and their gradients: every parameter, or LoRA's adapters;
    /// under ZeRO the gradient shard, beside the whole weights (stage 2) or their shard (3).
    pub fn trainable(&self) -> (&Buf, &Buf) {
        match (&self.frozen, &self.zero) {
            (Some(f), _) => (&f.params, &f.grads),
            (None, Some(z)) => (z.params.as_ref().unwrap_or(&self.params), &z.grads),
            (None, None) => (&self.params, &self.grads),
        }
    }

    /// The parameters that train, downloaded (the whole model's, or the adapters').
    pub fn download_trainable(&self) -> Vec<f32> {
        self.gpu.download(self.trainable().0)
    }

    /// Overwrites the parameters that train (a resumed checkpoint's).
    pub fn upload_trainable(&self, params: &[f32]) {
        self.gpu.write(self.trainable().0, params);
        self.refresh_working();
    }

    /// Overwrites the device parameters with `params` (a resumed checkpoint's; the base under
    /// LoRA, in the passes' type).
    pub fn upload_params(&self, params: &[f32]) {
        self.gpu.write(&self.params, params);
        self.refresh_working();
    }

    /// Mixed precision: the working weights rounded from the fp32 weights again (after an
    /// update), on the device; nothing in fp32.
    pub fn refresh_working(&self) {
        if let Some(w) = &self.work {
            self.gpu.cast(w, &self.params).expect("the working copy has the weights' length");
        }
    }

    /// The weights the passes read: the working copy under mixed precision, else the fp32 ones.
    fn w(&self) -> &Buf {
        self.work.as_ref().unwrap_or(&self.params)
    }

    /// Where the passes read flat weight element `off`: its gathered unit under ZeRO-3
    /// ([`zero`]), else the model's weights.
    fn wb(&self, off: usize) -> (&Buf, usize) {
        self.zero.as_ref().and_then(|z| z.weight(off)).unwrap_or((self.w(), off))
    }

    fn wt(&self, off: usize) -> At<'_> {
        let (b, o) = self.wb(off);
        b.at(o)
    }

    /// A row-major weight matrix of `cols` columns at flat element `off` (transposed with `t`).
    fn wm(&self, off: usize, cols: usize, t: bool) -> (&Buf, MatSpec) {
        let (b, o) = self.wb(off);
        let m = MatSpec::rows(o, cols);
        (b, if t { m.t() } else { m })
    }

    /// Where backward accumulates flat gradient element `off`: its unit's buffer under ZeRO-2/3,
    /// else the model's gradients.
    fn gb(&self, off: usize) -> (&Buf, usize) {
        match &self.zero {
            Some(z) => z.grad(off),
            None => (&self.grads, off),
        }
    }

    fn gt(&self, off: usize) -> At<'_> {
        let (b, o) = self.gb(off);
        b.at(o)
    }

    fn gm(&self, off: usize, cols: usize) -> (&Buf, MatSpec) {
        let (b, o) = self.gb(off);
        (b, MatSpec::rows(o, cols))
    }

    /// The parameters, downloaded.
    pub fn download_params(&self) -> Vec<f32> {
        self.gpu.download(&self.params)
    }

    /// Zeroes the gradients (of what trains).
    pub fn zero_grad(&self) {
        self.gpu.clear(self.trainable().1);
    }

    fn acts(&mut self, b: usize, t: usize) -> &mut Acts {
        if self.acts.as_ref().is_none_or(|a| a.b != b || a.t != t) {
            self.acts = Some(Acts::new(&self.gpu, &self.cfg, (b, t), Keep::new(&self.cfg, self.recompute.0, self.recompute.1)));
        }
        if let Some(f) = self.frozen.as_mut() {
            f.ensure_rows(&self.gpu, b * t);
        }
        self.acts.as_mut().unwrap()
    }

    /// The forward pass over `tokens` `[B, T]` with `targets` (`IGNORE_INDEX` counts for
    /// nothing): [`crate::Gpt::forward`] on the device. Writes each position's loss on the
    /// device ([`DeviceGpt::loss_sum_into`]) and, training, the head's weight gradient and
    /// `d ln_f` (the loss weight `loss_scale / count` is written to [`LOSS_WEIGHT`]). Returns
    /// the targets counted.
    pub fn forward(&mut self, tokens: &[u32], targets: &[i32], b: usize, t: usize, pass: Pass) -> usize {
        self.forward_docs(tokens, targets, None, b, t, pass)
    }

    /// [`DeviceGpt::forward`] over rows of packed documents (`crate::Gpt::forward_docs`): each
    /// token's document start bounds its attention, and its position turns RoPE and indexes
    /// GPT-2's position table. The following backward uses the same layout.
    pub fn forward_docs(&mut self, tokens: &[u32], targets: &[i32], docs: Option<crate::Docs>, b: usize, t: usize, pass: Pass) -> usize {
        if let Some(d) = &docs {
            d.check(b, t, self.cfg.block_size);
        }
        match self.cfg.place.context {
            Some(_) => self.forward_context(tokens, targets, docs, b, t, pass),
            None => self.forward_rows(tokens, targets, docs, b, t, pass),
        }
    }

    /// [`DeviceGpt::forward_docs`] on rows the model holds whole (a context-parallel part's
    /// positions, `docs` then in global positions).
    fn forward_rows(&mut self, tokens: &[u32], targets: &[i32], docs: Option<crate::Docs>, b: usize, t: usize, pass: Pass) -> usize {
        assert_eq!(self.is_part(), self.tensor.borrow().is_some(), "a tensor-parallel part runs with its hooks lent (DeviceGpt::swap_tensor_hooks)");
        assert!(t <= self.cfg.block_size && tokens.len() == b * t && targets.len() == b * t, "forward: tokens and targets must be [B, T], T ≤ block_size");
        let vp = self.cfg.vocab_size;
        let whole = self.cfg.place.vocab.map_or(vp, |v| v.total);
        assert!(tokens.iter().all(|&x| (x as usize) < whole), "token outside the vocabulary of {whole}");
        let (p, seed, loss_scale) = match pass {
            Pass::Eval => (0.0, 0, None),
            Pass::Train { dropout_seed, loss_scale } => (self.cfg.dropout, dropout_seed, Some(loss_scale)),
        };
        self.drop = (p, seed);
        self.loss_scale = loss_scale.unwrap_or(1.0);
        let count = targets.iter().filter(|&&x| x != IGNORE_INDEX).count();
        self.count = count;
        let weight = match loss_scale {
            Some(s) if count > 0 => Some(s / count as f32),
            // Under ZeRO-2/3 every rank runs backward (its collectives), with zero gradients.
            Some(_) if self.zero.is_some() => Some(0.0),
            _ => None,
        };
        let g = self.gpu.clone();
        if let Some(w) = weight {
            g.write_words(&self.scalars, LOSS_WEIGHT, &[w.to_bits()]);
        }
        if p > 0.0 {
            g.write_words(&self.scalars, DROPOUT_SEED, &[seed as u32, (seed >> 32) as u32]);
        }
        self.acts(b, t);
        let a = self.acts.take().unwrap();
        g.write_words(&a.tokens, 0, tokens);
        let tg: Vec<u32> = targets.iter().map(|&x| x as u32).collect();
        g.write_words(&a.targets, 0, &tg);
        self.docs = docs.is_some();
        if let Some(d) = &docs {
            g.write_words(&a.starts, 0, d.start);
            g.write_words(&a.pos, 0, d.pos);
        }
        self.gather_unit(0);
        // A later pipeline stage starts from the activations put in `xs[0]`
        // ([`DeviceGpt::set_stage_input`]).
        if self.cfg.has_embed() {
            self.embed(&a);
        }
        for l in 0..self.cfg.n_layer {
            self.gather_unit(l + 1);
            // ZeRO-3: the next unit's gather runs while this one computes.
            self.prefetch_unit(l + 2);
            self.block_forward(l, &a);
            self.release_unit(l + 1);
        }
        if self.cfg.has_head() {
            self.head_forward(&a, weight);
        } else {
            // A stage before the last: its output is `xs[L]` ([`DeviceGpt::stage_output`]).
            g.clear(&a.losses);
        }
        if weight.is_none() {
            // Evaluation: nothing stays gathered (training keeps the embeddings and the final
            // unit, which hold the head, for backward).
            self.zero.as_mut().map(Zero::release_all);
        }
        self.acts = Some(a);
        count
    }

    /// The final norm and the fused head with its loss (and, with `weight`, the head's
    /// gradients and `d ln_f`).
    fn head_forward(&mut self, a: &Acts, weight: Option<f32>) {
        let (g, vp) = (self.gpu.clone(), self.cfg.vocab_size);
        self.gather_unit(self.cfg.n_layer + 1);
        let (ln_f_w, ln_f_b, head) = (self.views.ln_f_w.clone(), self.views.ln_f_b.clone(), self.views.lm_head.start);
        let x = &a.xs[self.cfg.n_layer];
        self.norm_gathered((&a.ln_f, &a.ln_f_mean, &a.ln_f_rstd), x, (&ln_f_w, &ln_f_b), a);
        let dims = HeadDims { c: self.cfg.n_embd, v: self.real_vocab, vp, offset: 0, ignore_index: IGNORE_INDEX, arith: Arith::F32, softcap: 0.0 };
        if weight.is_some() {
            // The head's weight gradient is backward's first.
            self.open_grads(self.cfg.n_layer + 1);
            self.open_grads(0);
        }
        // Under sequence parallelism the head's input gradient is whole-sequence first.
        let dx = if self.sp() { &a.full } else { &a.dln_f };
        let grads = weight.map(|_| (dx, self.frozen.is_none().then(|| self.gt(head)), (&self.scalars, LOSS_WEIGHT)));
        match self.cfg.place.vocab {
            // A vocabulary-parallel part: its rows of the head, the rows' log-sum-exps
            // combined over the parts, and the head's input gradient summed over them.
            Some(rows) => {
                let dims = HeadDims { v: self.real_vocab.saturating_sub(rows.first).min(vp), offset: rows.first, ..dims };
                g.lm_head_crossentropy_vocab_parallel(&a.losses, grads, &a.ln_f, self.wt(head), &a.targets, (&a.head_scratch, &a.head_stats), &dims, &mut |x| self.all_gather_parts(x));
                if weight.is_some() {
                    self.column_input_grad(&a.dln_f, a);
                }
            }
            None => g.lm_head_crossentropy(&a.losses, grads, &a.ln_f, self.wt(head), &a.targets, &a.head_scratch, &dims),
        }
    }

    /// `out[at] (=|+=) Σ` of the last forward's per-position losses, on the device.
    pub fn loss_sum_into(&self, out: (&Buf, usize), parts: &Buf, accumulate: bool) {
        let a = self.acts.as_ref().expect("forward first");
        self.gpu.sum(out, a.losses.at(0), a.b * a.t, parts, accumulate);
    }

    /// The per-position losses of the last forward, downloaded.
    pub fn losses(&self) -> Vec<f32> {
        self.gpu.download(&self.acts.as_ref().expect("forward first").losses)
    }

    /// The pass's rows in the global batch (a data-parallel rank's share starts at its offset):
    /// dropout masks are drawn by global sequence, as on the CPU.
    /// Under sequence parallelism the residual stream holds this part's positions of each.
    /// A context-parallel part's rows are its chunks of sequences `count` times as long.
    fn row_map(&self, a: &Acts) -> RowMap {
        let (t, chunks) = match self.cfg.place.context {
            Some(cx) => {
                let ch = cx.chunks(a.t * cx.count);
                (a.t * cx.count, Some(tensor::ops::Chunks { len: ch[0].1, first: ch[0].0, second: ch.get(1).map_or(0, |c| c.0) }))
            }
            None => (a.t, None),
        };
        let whole = RowMap { b0: self.cfg.place.batch_offset, t, chunks, ..RowMap::whole(a.t) };
        match self.cfg.place.seq {
            Some(s) => {
                let p = s.positions(a.t);
                RowMap { t_local: p.len(), offset: p.start, ..whole }
            }
            None => whole,
        }
    }

    /// Where the pass's tokens sit for RoPE: `0..T` in every row, or the documents' positions.
    fn positions<'s>(&self, a: &'s Acts) -> RopePos<'s> {
        if self.docs {
            RopePos::Ids(&a.pos)
        } else {
            RopePos::Offset(0)
        }
    }

    /// Block `l`'s first dropout site in the whole model's numbering (a pipeline stage's
    /// blocks draw what the whole model's draw there).
    fn block_site(&self, l: usize) -> u64 {
        1 + 3 * (self.cfg.first_layer() + l) as u64
    }

    /// Dropout site `site`'s mask seed, derived on the device from the pass's (the CPU model's
    /// numbering: 0 the embedding, then three per block).
    fn seed(&self, site: u64) -> Seed<'_> {
        Seed { buf: &self.scalars, at: DROPOUT_SEED, site: Some(site as u32) }
    }

    /// Dropout at site `site` on the residual stream's rows, in place.
    fn dropout(&self, x: &Buf, site: u64, a: &Acts) {
        let p = self.drop.0;
        if p > 0.0 {
            self.gpu.dropout_inplace_rows_seeded(x, p, self.seed(site), self.cfg.n_embd, self.row_map(a));
        }
    }

    /// The gradient through dropout at site `n`: `dout` itself without dropout, else the masked
    /// copy in `buf`.
    fn dropout_grad<'x>(&self, buf: &'x Buf, dout: &'x Buf, site: u64, a: &Acts) -> &'x Buf {
        let p = self.drop.0;
        if p == 0.0 {
            return dout;
        }
        self.gpu.clear(buf);
        self.gpu.dropout_backward_rows_seeded(buf, dout, p, self.seed(site), self.cfg.n_embd, self.row_map(a));
        buf
    }

    fn embed(&self, a: &Acts) {
        let v = &self.views;
        let wpe = v.wpe.as_ref().map(|r| self.wt(r.start));
        // A vocabulary-parallel part's lookups are partial: summed over the parts (`g`), or
        // under sequence parallelism reduce-scattered to this part's positions.
        let out = if self.sp() { &a.full } else { &a.xs[0] };
        self.gpu.embedding_forward_pos(out, &a.tokens, (self.wt(v.wte.start), wpe), self.docs.then_some(&a.pos), (a.t, self.cfg.n_embd), self.vocab_rows());
        self.row_parallel_out(&a.xs[0], None, a);
        self.dropout(&a.xs[0], 0, a);
    }

    fn norm_forward(&self, out: (&Buf, &Buf, &Buf), x: &Buf, w: &std::ops::Range<usize>, b: &Option<std::ops::Range<usize>>) {
        let (o, mean, rstd) = out;
        let (w, b) = (self.wt(w.start), b.as_ref().map(|r| self.wt(r.start)));
        match self.cfg.arch {
            Arch::Gpt2 => self.gpu.layernorm_forward(o, (mean, rstd), x, w, b, self.cfg.n_embd),
            Arch::Llama => self.gpu.rmsnorm_forward(o, rstd, x, w, self.cfg.norm_eps, self.cfg.n_embd),
        }
    }

    /// A norm whose output feeds column-parallel products: written into `out.0` whole, or
    /// under sequence parallelism this part's rows gathered along the sequence into it.
    fn norm_gathered(&self, (o, mean, rstd): (&Buf, &Buf, &Buf), x: &Buf, (w, b): (&std::ops::Range<usize>, &Option<std::ops::Range<usize>>), a: &Acts) {
        if !self.sp() {
            return self.norm_forward((o, mean, rstd), x, w, b);
        }
        self.norm_forward((&a.local, mean, rstd), x, w, b);
        self.gather_seq(&a.local, o, a);
    }

    /// Where a row-parallel product (or a vocabulary-parallel lookup) writes: `out` itself,
    /// or under sequence parallelism the whole-sequence rows.
    fn row_parallel_dst<'x>(&self, out: &'x Buf, a: &'x Acts) -> &'x Buf {
        if self.sp() {
            &a.full
        } else {
            out
        }
    }

    /// After a row-parallel product into [`DeviceGpt::row_parallel_dst`]: the parts' partial
    /// sums into `out` (all-reduced, `g`; or reduce-scattered to this part's positions), the
    /// bias at `bias` counted once. Nothing for a whole model.
    fn row_parallel_out(&self, out: &Buf, bias: Option<&std::ops::Range<usize>>, a: &Acts) {
        if self.sp() {
            self.scatter_seq(&a.full, out, bias, a);
        } else {
            self.reduce_output(out, bias);
        }
    }

    /// A row-parallel product's output gradient: `d` itself, or under sequence parallelism
    /// gathered along the sequence (the reduce-scatter's backward).
    fn row_parallel_grad<'x>(&self, d: &'x Buf, a: &'x Acts) -> &'x Buf {
        if !self.sp() {
            return d;
        }
        self.gather_seq(d, &a.full, a);
        &a.full
    }

    /// Where a column-parallel product's input gradient is written: `dln`, or under sequence
    /// parallelism the whole-sequence rows.
    fn column_grad_dst<'x>(&self, dln: &'x Buf, a: &'x Acts) -> &'x Buf {
        self.row_parallel_dst(dln, a)
    }

    /// After [`DeviceGpt::column_grad_dst`]: the parts' shares summed into `dln` (`f`'s
    /// backward; reduce-scattered to this part's positions under sequence parallelism).
    fn column_input_grad(&self, dln: &Buf, a: &Acts) {
        if self.sp() {
            self.scatter_seq(&a.full, dln, None, a);
        } else {
            self.reduce_input_grad(dln);
        }
    }

    /// `dinp += normᵀ(dout)`, the norm's parameters' gradients accumulated.
    /// A frozen base's norms write theirs where nobody reads them.
    fn norm_backward(&self, dinp: &Buf, dout: &Buf, x: &Buf, stats: (&Buf, &Buf), (w, b): (&std::ops::Range<usize>, &Option<std::ops::Range<usize>>)) {
        let (dw, db) = match &self.frozen {
            Some(f) => (f.norm_grads.at(0), b.as_ref().map(|_| f.norm_grads.at(self.cfg.n_embd))),
            None => (self.gt(w.start), b.as_ref().map(|r| self.gt(r.start))),
        };
        let w = self.wt(w.start);
        match self.cfg.arch {
            Arch::Gpt2 => self.gpu.layernorm_backward((dinp, dw, db), dout, x, w, stats, self.cfg.n_embd),
            Arch::Llama => self.gpu.rmsnorm_backward((dinp, dw), dout, x, w, stats.1, self.cfg.n_embd),
        }
    }

    /// Layer `l`'s attention dims (MHA is `NKV = NH`).
    fn gqa(&self, l: usize, a: &Acts) -> GqaDims {
        let cfg = &self.cfg;
        let (nkv, window) = match cfg.arch {
            Arch::Gpt2 => (cfg.n_head, 0),
            Arch::Llama => (cfg.n_kv_head, cfg.window_of(l)),
        };
        // A tensor-parallel part draws attention dropout by whole-model head.
        let (head0, heads) = cfg.place.heads.map_or((0, 0), |h| (h.first, h.total));
        GqaDims { b: a.b, t: a.t, nh: cfg.n_head, nkv, hs: cfg.head_size(), window, rotary: cfg.rotary_dim, b0: cfg.place.batch_offset, head0, heads, ..Default::default() }
    }

    /// Layer `l`'s projection at `site`: its weight's and bias's ranges.
    fn proj(&self, l: usize, site: Site) -> (&std::ops::Range<usize>, &Option<std::ops::Range<usize>>) {
        let bp = &self.views.blocks[l];
        match site {
            Site::Qkv => (&bp.c_attn_w, &bp.c_attn_b),
            Site::AttnProj => (&bp.attn_proj_w, &bp.attn_proj_b),
            Site::Fc => (&bp.c_fc_w, &bp.c_fc_b),
            Site::MlpProj => (&bp.mlp_proj_w, &bp.mlp_proj_b),
        }
    }

    /// The weight a projection's product reads: a view of the weights, or under QLoRA its
    /// matrix dequantized into the scratch now.
    fn proj_weight(&self, l: usize, site: Site) -> At<'_> {
        self.frozen.as_ref().and_then(|f| f.dequantized(&self.gpu, l, site)).unwrap_or_else(|| self.wt(self.proj(l, site).0.start))
    }

    /// `y = x·Wᵀ (+ b)` for layer `l`'s projection at `site` (with its LoRA adapters').
    fn linear(&self, y: &Buf, x: &Buf, (l, site): (usize, Site), (n_in, n_out): (usize, usize), a: &Acts) {
        let bias = self.proj(l, site).1.as_ref().map(|r| self.wt(r.start));
        let n = a.b * a.t;
        self.gpu.matmul_forward(y, x, self.proj_weight(l, site), bias, (n, n_in, n_out));
        if let Some(f) = &self.frozen {
            f.forward(&self.gpu, (l, site), y, x, n, n_out);
        }
    }

    /// The backward of [`DeviceGpt::linear`]: `dx` overwritten, the weight's and bias's
    /// gradients accumulated (the adapters' alone over a frozen base).
    fn linear_backward(&self, dx: &Buf, dy: &Buf, x: &Buf, (l, site): (usize, Site), (n_in, n_out): (usize, usize), a: &Acts) {
        let n = a.b * a.t;
        let w = self.proj_weight(l, site);
        let Some(f) = &self.frozen else {
            let (wr, b) = self.proj(l, site);
            let db = b.as_ref().map(|r| self.gt(r.start));
            return self.gpu.matmul_backward_into((dx, self.gt(wr.start), db), dy, x, w, (n, n_in, n_out));
        };
        self.gpu.gemm(Gemm::new(n, n_in, n_out), (dx, MatSpec::rows(0, n_in)), (dy, MatSpec::rows(0, n_out)), (w.buf, MatSpec::rows(w.off, n_in)), None);
        f.backward(&self.gpu, (l, site), dx, dy, x, (n, n_out));
    }

    fn block_forward(&self, l: usize, a: &Acts) {
        let (g, cfg, bp) = (&*self.gpu, &self.cfg, &self.views.blocks[l]);
        let (la, x, out) = (a.layer(l), &a.xs[l], &a.xs[l + 1]);
        let c = cfg.n_embd;
        let p = self.drop.0;
        let site = self.block_site(l);
        // res_2 = x + drop(attn(norm_1(x)))
        self.norm_gathered((&la.ln_1, &la.ln_1_mean, &la.ln_1_rstd), x, (&bp.ln_1_w, &bp.ln_1_b), a);
        self.linear(&la.qkv, &la.ln_1, (l, Site::Qkv), (c, cfg.qkv_width()), a);
        let d = self.gqa(l, a);
        if let Some((cos, sin)) = self.rope.as_ref().filter(|_| self.cfg.rope_at(self.cfg.first_layer() + l)) {
            g.rope(&la.qkv, (cos, sin), &d, self.positions(a), false);
        }
        let (atty, lse) = a.core(l);
        self.attention_forward((atty, lse), &la.qkv, &d, a, (p, self.seed(site)));
        self.linear(self.row_parallel_dst(&a.branch, a), atty, (l, Site::AttnProj), (cfg.attn_width(), c), a);
        self.row_parallel_out(&a.branch, self.proj(l, Site::AttnProj).1.as_ref(), a);
        self.dropout(&a.branch, site + 1, a);
        g.residual_forward(&la.res_2, x, &a.branch);
        // out = res_2 + drop(mlp(norm_2(res_2)))
        self.norm_gathered((&la.ln_2, &la.ln_2_mean, &la.ln_2_rstd), &la.res_2, (&bp.ln_2_w, &bp.ln_2_b), a);
        self.mlp_forward(l, la, a);
        self.dropout(&a.branch, site + 2, a);
        g.residual_forward(out, &la.res_2, &a.branch);
    }

    /// The MLP from `ln_2` into `a.branch`: dense, or the MoE layer.
    fn mlp_forward(&self, l: usize, la: &LayerActs, a: &Acts) {
        let (g, cfg, c, bp) = (&*self.gpu, &self.cfg, self.cfg.n_embd, &self.views.blocks[l]);
        if let (Some(mp), Some(ma)) = (&bp.moe, &la.moe) {
            // A tensor-parallel part holds the experts whole and runs the layer on every token
            // (under sequence parallelism on `ln_2` gathered, its positions kept after).
            let rows = self.moe_forward(mp, (ma, &a.moe_stats[l]), &la.ln_2, self.row_parallel_dst(&a.branch, a));
            if self.sp() {
                self.take_seq(&a.full, &a.branch, a);
            }
            return a.ep_rows[l].set(rows);
        }
        self.linear(&la.fch, &la.ln_2, (l, Site::Fc), (c, cfg.fc_width()), a);
        match cfg.arch {
            Arch::Gpt2 => g.gelu_forward(&la.fch_act, &la.fch),
            Arch::Llama => g.swiglu_forward(&la.fch_act, &la.fch, cfg.ffn_hidden),
        }
        self.linear(self.row_parallel_dst(&a.branch, a), &la.fch_act, (l, Site::MlpProj), (cfg.ffn_hidden, c), a);
        self.row_parallel_out(&a.branch, self.proj(l, Site::MlpProj).1.as_ref(), a);
    }

    /// The backward of the last training forward: [`crate::Gpt::backward`] on the device.
    /// Accumulates into [`DeviceGpt::grads`]. With the host model's MoE exchange lent
    /// ([`DeviceGpt::swap_expert_hooks`]) each MoE layer's routing statistics are summed over
    /// the ranks that split the batch, so the load-balancing loss is the whole batch's, as on
    /// the CPU (its counts staged through the host, one small download a layer).
    pub fn backward(&mut self) {
        self.backward_into(None);
    }

    /// [`DeviceGpt::backward`] handing each unit's gradients (its flat range of the layout,
    /// downloaded) to `sink` as soon as backward is done with the unit, the last unit first and
    /// the embeddings last: a data-parallel run starts reducing them while the device goes on
    /// with the earlier units (the CPU's bucketed overlap, staged through the host). A whole
    /// model's gradients, not a ZeRO-2/3 shard's or LoRA's adapters'.
    pub fn backward_handing(&mut self, sink: &mut dyn FnMut(std::ops::Range<usize>, Vec<f32>)) {
        assert!(self.zero.is_none() && self.frozen.is_none() && self.cfg.has_head() && self.cfg.has_embed(), "backward_handing: a whole model's gradients");
        self.backward_into(Some(sink));
    }

    /// Unit `u`'s gradients to `sink`, when there is one.
    fn hand(&self, sink: &mut Option<&mut dyn FnMut(std::ops::Range<usize>, Vec<f32>)>, u: usize) {
        if let Some(s) = sink.as_deref_mut() {
            let r = self.units[u].clone();
            s(r.clone(), self.gpu.download_f32(&self.grads, r.start, r.len()));
        }
    }

    fn backward_into(&mut self, mut sink: Option<&mut dyn FnMut(std::ops::Range<usize>, Vec<f32>)>) {
        let a = self.acts.take().expect("backward before forward");
        if self.count == 0 && self.zero.is_none() {
            (0..self.units.len()).rev().for_each(|u| self.hand(&mut sink, u));
            self.acts = Some(a);
            return;
        }
        let (g, n_layer) = (self.gpu.clone(), self.cfg.n_layer);
        // A stage before the last starts from its output's gradient, put in `dres`
        // ([`DeviceGpt::set_stage_output_grad`]).
        if self.cfg.has_head() {
            g.clear(&a.dres);
            let stats = (&a.ln_f_mean, &a.ln_f_rstd);
            let (ln_f_w, ln_f_b) = (self.views.ln_f_w.clone(), self.views.ln_f_b.clone());
            self.norm_backward(&a.dres, &a.dln_f, &a.xs[n_layer], stats, (&ln_f_w, &ln_f_b));
            self.hand(&mut sink, n_layer + 1);
        }
        for l in (0..n_layer).rev() {
            self.gather_unit(l + 1);
            self.prefetch_unit(l);
            self.open_grads(l + 1);
            self.block_backward(l, &a);
            self.release_unit(l + 1);
            self.reduce_unit(l + 1);
            self.hand(&mut sink, l + 1);
        }
        // A later stage leaves its input's gradient in `dres` ([`DeviceGpt::stage_input_grad`]).
        if self.frozen.is_none() && self.cfg.has_embed() {
            // (A first pipeline stage's embeddings get their gradient buffer here.)
            self.open_grads(0);
            let v = &self.views;
            let demb = self.dropout_grad(&a.dbranch, &a.dres, 0, &a);
            // Under sequence parallelism the lookups were reduce-scattered: gathered back.
            let demb = self.row_parallel_grad(demb, &a);
            let c = self.cfg.n_embd;
            let dwpe = v.wpe.as_ref().map(|r| self.gt(r.start));
            let pos = v.wpe.as_ref().filter(|_| self.docs).map(|r| (&a.pos, r.len() / c));
            g.embedding_backward_pos((self.gt(v.wte.start), dwpe), demb, &a.tokens, pos, (a.t, c), self.vocab_rows());
            self.hand(&mut sink, 0);
        }
        if let Some(z) = self.zero.as_mut() {
            z.release_all();
            z.reduce_rest(&g);
        }
        self.acts = Some(a);
    }

    fn block_backward(&self, l: usize, a: &Acts) {
        let bp = &self.views.blocks[l];
        if a.keep.recomputed[l] {
            // Full recomputation: re-run the block's forward from its kept input, the same
            // kernels and masks, into the shared set.
            self.block_forward(l, a);
        } else if a.keep.selective {
            // Selective: re-run the attention core from the kept q|k|v into the shared set.
            let (atty, lse) = a.core(l);
            self.attention_forward((atty, lse), &a.layer(l).qkv, &self.gqa(l, a), a, (self.drop.0, self.seed(self.block_site(l))));
        }
        let (g, cfg, la) = (&*self.gpu, &self.cfg, a.layer(l));
        let c = cfg.n_embd;
        let site = self.block_site(l);
        // d res_2 = d out + norm_2ᵀ(mlpᵀ(dropᵀ(d out)))
        let dmlp = self.dropout_grad(&a.dbranch, &a.dres, site + 2, a);
        match (&bp.moe, &la.moe, &a.moe) {
            (Some(mp), Some(ma), Some(ms)) => {
                let aux = self.aux_coef(ma, (&a.moe_stats[l], &ms.aux_coef));
                // Under sequence parallelism over the whole sequence (see `mlp_forward`).
                let dx = a.full_grad.as_ref().unwrap_or(&a.dln);
                self.moe_backward(mp, (ma, ms), self.row_parallel_grad(dmlp, a), &la.ln_2, dx, aux);
                if self.sp() {
                    self.take_seq(dx, &a.dln, a);
                }
            }
            _ => {
                self.linear_backward(&a.dfch_act, self.row_parallel_grad(dmlp, a), &la.fch_act, (l, Site::MlpProj), (cfg.ffn_hidden, c), a);
                match cfg.arch {
                    Arch::Gpt2 => g.gelu_backward_into(&a.dfch, &a.dfch_act, &la.fch),
                    Arch::Llama => g.swiglu_backward(&a.dfch, &a.dfch_act, &la.fch, cfg.ffn_hidden, false),
                }
                self.linear_backward(self.column_grad_dst(&a.dln, a), &a.dfch, &la.ln_2, (l, Site::Fc), (c, cfg.fc_width()), a);
                self.column_input_grad(&a.dln, a);
            }
        }
        self.norm_backward(&a.dres, &a.dln, &la.res_2, (&la.ln_2_mean, &la.ln_2_rstd), (&bp.ln_2_w, &bp.ln_2_b));
        // d x = d res_2 + norm_1ᵀ(attnᵀ(dropᵀ(d res_2)))
        let dattn = self.dropout_grad(&a.dbranch, &a.dres, site + 1, a);
        let (atty, lse) = a.core(l);
        self.linear_backward(&a.datty, self.row_parallel_grad(dattn, a), atty, (l, Site::AttnProj), (cfg.attn_width(), c), a);
        g.clear(&a.dqkv);
        let d = self.gqa(l, a);
        self.attention_backward((&a.dqkv, &a.dd), &a.datty, (&la.qkv, atty, lse), &d, a, (self.drop.0, self.seed(site)));
        if let Some((cos, sin)) = self.rope.as_ref().filter(|_| self.cfg.rope_at(self.cfg.first_layer() + l)) {
            g.rope(&a.dqkv, (cos, sin), &d, self.positions(a), true);
        }
        self.linear_backward(self.column_grad_dst(&a.dln, a), &a.dqkv, &la.ln_1, (l, Site::Qkv), (c, cfg.qkv_width()), a);
        self.column_input_grad(&a.dln, a);
        self.norm_backward(&a.dres, &a.dln, &a.xs[l], (&la.ln_1_mean, &la.ln_1_rstd), (&bp.ln_1_w, &bp.ln_1_b));
    }

    /// An MoE layer's forward from `x` (`ln_2`) into `y`: `tensor::moe::moe_forward` on the
    /// device: the router, top-k routing with capacity, dispatch, each routed expert over its
    /// packed rows (the counts stay on the device), the shared experts, the combine; and the
    /// routing statistics. Returns the rows sent to and received from other expert-parallel
    /// parts.
    fn moe_forward(&self, mp: &MoeParams, (ma, stats): (&MoeActs, &Buf), x: &Buf, y: &Buf) -> (usize, usize) {
        let (g, cfg) = (&*self.gpu, &self.cfg);
        let (c, f, e) = (cfg.n_embd, cfg.ffn_hidden, cfg.n_expert);
        let r = &ma.routing;
        let n = r.n;
        let dims = cfg.moe_dims(n);
        g.matmul_forward(&ma.logits, x, self.wt(mp.router.start), None, (n, c, e));
        g.moe_route(r, &ma.logits, dims.renormalize, dims.capacity());
        g.moe_dispatch(&ma.xe, x, r, c);
        let exchanged = self.routed_forward(mp, ma);
        let es = 3 * f * c;
        for (si, (sgu, sh)) in ma.sgu.iter().zip(&ma.sh).enumerate() {
            let w = mp.shared.start + si * es;
            g.matmul_forward(sgu, x, self.wt(w), None, (n, c, 2 * f));
            g.swiglu_forward(sh, sgu, f);
            let acc = Gemm { accumulate: si > 0, ..Gemm::new(n, c, f) };
            g.gemm(acc, (y, MatSpec::rows(0, c)), (sh, MatSpec::rows(0, f)), self.wm(w + 2 * f * c, f, true), None);
        }
        g.moe_combine(y, &ma.eo, r, c, !ma.sgu.is_empty());
        // Statistics: Σ_t probs per expert (a column sum) and Σ_t lse².
        g.clear(stats);
        g.bias_backward(stats.at(0), &r.probs, n, e);
        g.sum_squares((stats, e), r.lse.at(0), n, &self.parts, false);
        g.copy_words(stats, e + 1, &r.counts, 0, e);
        g.copy_words(stats, 2 * e + 1, &r.offsets, e, 1);
        exchanged
    }

    /// The backward of [`DeviceGpt::moe_forward`] from `dy` into `dx` (overwritten), the
    /// router's, experts' and shared experts' gradients accumulated: `tensor::moe::moe_backward`
    /// on the device, with the load-balancing and z losses weighted by the pass's loss scale.
    /// The load-balancing loss's gradient coefficients `aux_weight·E·f_e / N` into `coef`: on
    /// the device from this rank's counts, or with the MoE exchange lent from the routing
    /// group's (this layer's `stats` downloaded, summed over the group as `tensor::moe` sums its
    /// route statistics, the coefficients written back). Returns whether they were written
    /// (else the kernel computes them in backward).
    fn aux_coef(&self, ma: &MoeActs, (stats, coef): (&Buf, &Buf)) -> bool {
        let mut hooks = self.experts.borrow_mut();
        let Some(group) = hooks.as_deref_mut() else { return false };
        let (e, k, n) = (self.cfg.n_expert, ma.routing.k, ma.routing.n);
        let st = self.gpu.download_words(stats, 0, 2 * e + 2);
        let mut route: Vec<f64> = st[e + 1..2 * e + 1].iter().map(|&c| c as f64).collect();
        route.extend(st[..e].iter().map(|&b| f32::from_bits(b) as f64));
        route.push(n as f64);
        group.sum_routing(&mut route);
        let (w, nt) = (self.cfg.moe_aux_weight * self.loss_scale, route[2 * e]);
        let c: Vec<u32> = route[..e].iter().map(|&cnt| ((w as f64 * e as f64 * cnt / ((nt * k as f64) * n as f64)) as f32).to_bits()).collect();
        self.gpu.write_words(coef, 0, &c);
        true
    }

    fn moe_backward(&self, mp: &MoeParams, (ma, ms): (&MoeActs, &MoeScratch), dy: &Buf, x: &Buf, dx: &Buf, aux_written: bool) {
        let (g, cfg) = (&*self.gpu, &self.cfg);
        let (c, f, e) = (cfg.n_embd, cfg.ffn_hidden, cfg.n_expert);
        let r = &ma.routing;
        let n = r.n;
        let es = 3 * f * c;
        let rows = |cols: usize| MatSpec::rows(0, cols);
        // A frozen base (LoRA) computes no weight gradients.
        let train = self.frozen.is_none();
        g.moe_combine_backward((&ms.dgate, &ms.deo), dy, &ma.eo, r, c);
        self.routed_backward(mp, (ma, ms), train);
        g.clear(dx);
        g.moe_dispatch_backward(dx, &ms.deo, r, c);
        for (si, (sgu, sh)) in ma.sgu.iter().zip(&ma.sh).enumerate() {
            let w = mp.shared.start + si * es;
            g.gemm(Gemm::new(n, f, c), (&ms.dh, rows(f)), (dy, rows(c)), self.wm(w + 2 * f * c, f, false), None);
            if train {
                g.gemm(Gemm::new(c, f, n).acc(), self.gm(w + 2 * f * c, f), (dy, rows(c).t()), (sh, rows(f)), None);
            }
            g.swiglu_backward(&ms.dgu, &ms.dh, sgu, f, false);
            if train {
                g.gemm(Gemm::new(2 * f, c, n).acc(), self.gm(w, c), (&ms.dgu, rows(2 * f).t()), (x, rows(c)), None);
            }
            g.gemm(Gemm::new(n, c, 2 * f).acc(), (dx, rows(c)), (&ms.dgu, rows(2 * f)), self.wm(w, c, false), None);
        }
        // The router: the gates' gradient, the aux and z losses (weighted as the main loss).
        if !aux_written {
            g.moe_aux_coef(&ms.aux_coef, r, cfg.moe_aux_weight * self.loss_scale);
        }
        let z_coef = 2.0 * (cfg.moe_z_weight * self.loss_scale) / n as f32;
        g.moe_router_backward(&ms.dlogits, r, &ms.dgate, &ms.aux_coef, z_coef, cfg.moe_dims(n).renormalize);
        let wr = mp.router.start;
        g.gemm(Gemm::new(n, c, e).acc(), (dx, rows(c)), (&ms.dlogits, rows(e)), self.wm(wr, c, false), None);
        if train {
            g.gemm(Gemm::new(e, c, n).acc(), self.gm(wr, c), (&ms.dlogits, rows(e).t()), (x, rows(c)), None);
        }
    }

    /// Each MoE layer's routing statistics from the last forward (`tensor::moe::MoeStats`):
    /// every layer's `2E + 2` words gathered on the device into one download. With the MoE
    /// exchange lent, the load-balancing loss is the routing group's (as `tensor::moe` reports
    /// it), the rest this rank's (collective over the group).
    pub fn moe_stats(&self) -> Vec<tensor::moe::MoeStats> {
        let Some(a) = self.acts.as_ref() else { return Vec::new() };
        let mut group = self.experts.borrow_mut();
        let cfg = &self.cfg;
        let layers = &a.moe_stats;
        let w = 2 * cfg.n_expert + 2;
        let all = self.gpu.zeros(layers.len() * w);
        for (i, stats) in layers.iter().enumerate() {
            self.gpu.copy_words(&all, i * w, stats, 0, w);
        }
        let words = self.gpu.download_words(&all, 0, layers.len() * w);
        let (n, e, k) = (a.b * a.t, cfg.n_expert, cfg.top_k);
        words.chunks(w).zip(&a.ep_rows).map(|(st, ep)| {
            let counts: Vec<usize> = st[e + 1..2 * e + 1].iter().map(|&c| c as usize).collect();
            let kept = st[2 * e + 1] as usize;
            let st: Vec<f32> = st[..=e].iter().map(|&b| f32::from_bits(b)).collect();
            let mut route: Vec<f64> = counts.iter().map(|&c| c as f64).chain(st[..e].iter().map(|&p| p as f64)).chain([n as f64]).collect();
            if let Some(gr) = group.as_deref_mut() {
                gr.sum_routing(&mut route);
            }
            let nt = route[2 * e];
            let aux = (0..e).map(|x| route[x] / (nt * k as f64) * (route[e + x] / nt)).sum::<f64>() * e as f64;
            let z = st[e] as f64 / n as f64;
            let (aux, z) = (aux as f32, z as f32);
            tensor::moe::MoeStats {
                aux_loss: aux,
                z_loss: z,
                loss: cfg.moe_aux_weight * aux + cfg.moe_z_weight * z,
                max_load: counts.iter().copied().max().unwrap_or(0),
                mean_load: (n * k) as f32 / e as f32,
                dropped_fraction: (n * k - kept) as f32 / (n * k) as f32,
                counts,
                ep_rows_sent: ep.get().0,
                ep_rows_received: ep.get().1,
            }
        }).collect()
    }

    /// An empty KV cache for [`DeviceGpt::decode_step`].
    pub fn new_cache(&self) -> DeviceKvCache {
        let n = self.cfg.n_layer * self.cfg.block_size * self.cfg.n_kv_head * self.cfg.head_size();
        DeviceKvCache { k: self.gpu.zeros(n), v: self.gpu.zeros(n), len: 0 }
    }

    /// Feeds one token at position `cache.len`, appends its keys and values to the cache on the
    /// device, and returns the logits `[Vp]` for the next token: `Gpt::decode_step` on the
    /// device (the logits are the only download).
    pub fn decode_step(&mut self, cache: &mut DeviceKvCache, token: u32) -> Vec<f32> {
        self.decode_into(cache, token);
        self.gpu.download(self.logits.as_ref().expect("decoded"))
    }

    fn decode_into(&mut self, cache: &mut DeviceKvCache, token: u32) {
        let (c, bs, vp) = (self.cfg.n_embd, self.cfg.block_size, self.cfg.vocab_size);
        assert!(cache.len < bs, "KV cache full");
        assert!((token as usize) < vp, "token outside the vocabulary of {vp}");
        let pos = cache.len;
        self.drop = (0.0, 0);
        self.docs = false;
        if self.logits.is_none() {
            self.logits = Some(self.gpu.zeros(vp));
        }
        self.acts(1, 1);
        let (g, a, v) = (&*self.gpu, self.acts.as_ref().unwrap(), &self.views);
        g.write_words(&a.tokens, 0, &[token]);
        let wpe = v.wpe.as_ref().map(|r| self.wt(r.start + pos * c));
        g.embedding_forward(&a.xs[0], &a.tokens, self.wt(v.wte.start), wpe, 1, c);
        for l in 0..self.cfg.n_layer {
            self.decode_block(l, a, cache);
        }
        let x = &a.xs[self.cfg.n_layer];
        self.norm_forward((&a.ln_f, &a.ln_f_mean, &a.ln_f_rstd), x, &v.ln_f_w, &v.ln_f_b);
        g.matmul_forward(self.logits.as_ref().unwrap(), &a.ln_f, self.wt(v.lm_head.start), None, (1, c, vp));
        cache.len += 1;
    }

    /// One block of [`DeviceGpt::decode_step`]: the token's keys and values into the cache,
    /// attention over the cache, the MLP.
    fn decode_block(&self, l: usize, a: &Acts, cache: &DeviceKvCache) {
        let (g, cfg, bp) = (&*self.gpu, &self.cfg, &self.views.blocks[l]);
        let (la, x, out) = (a.layer(l), &a.xs[l], &a.xs[l + 1]);
        let (c, pos) = (cfg.n_embd, cache.len);
        let (qc, kw) = (cfg.n_head * cfg.head_size(), cfg.n_kv_head * cfg.head_size());
        self.norm_forward((&la.ln_1, &la.ln_1_mean, &la.ln_1_rstd), x, &bp.ln_1_w, &bp.ln_1_b);
        self.linear(&la.qkv, &la.ln_1, (l, Site::Qkv), (c, cfg.qkv_width()), a);
        let d = self.gqa(l, a);
        if let Some((cos, sin)) = self.rope.as_ref().filter(|_| self.cfg.rope_at(self.cfg.first_layer() + l)) {
            g.rope(&la.qkv, (cos, sin), &d, RopePos::Offset(pos), false);
        }
        let at = l * cfg.block_size * kw;
        g.copy_words(&cache.k, at + pos * kw, &la.qkv, qc, kw);
        g.copy_words(&cache.v, at + pos * kw, &la.qkv, qc + kw, kw);
        g.attention_decode(&la.atty, &la.qkv, (&cache.k, &cache.v), at, &GqaDims { t: pos + 1, ..d });
        self.linear(&a.branch, &la.atty, (l, Site::AttnProj), (cfg.attn_width(), c), a);
        g.residual_forward(&la.res_2, x, &a.branch);
        self.norm_forward((&la.ln_2, &la.ln_2_mean, &la.ln_2_rstd), &la.res_2, &bp.ln_2_w, &bp.ln_2_b);
        self.mlp_forward(l, la, a);
        g.residual_forward(out, &la.res_2, &a.branch);
    }

    /// Continues `prompt` by `max_new` tokens with the KV cache on the device: `Gpt::generate`
    /// (the same sampling loop and cache rebuild), only each step's logits downloaded.
    pub fn generate(&mut self, prompt: &[u32], max_new: usize, sampler: &crate::Sampler) -> Vec<u32> {
        self.generate_until(prompt, max_new, sampler, &mut |_| false)
    }

    /// [`DeviceGpt::generate`], stopping early once `stop(new tokens so far)` says so.
    pub fn generate_until(&mut self, prompt: &[u32], max_new: usize, sampler: &crate::Sampler, stop: &mut dyn FnMut(&[u32]) -> bool) -> Vec<u32> {
        let mut cache = self.new_cache();
        let (bs, real_vocab) = (self.cfg.block_size, self.real_vocab);
        crate::generate::sampling_loop(prompt, max_new, (sampler, stop), (bs, real_vocab), |feed| {
            match feed {
                Feed::Reset => cache.len = 0,
                Feed::Token { token, .. } => self.decode_into(&mut cache, token),
                Feed::Logits => return self.gpu.download(self.logits.as_ref().expect("a token was fed")),
            }
            Vec::new()
        })
    }

    /// The view of parameter range `r` in the gradients.
    pub fn grad_at(&self, r: &std::ops::Range<usize>) -> At<'_> {
        assert!(self.zero.is_none(), "grad_at: a ZeRO-2/3 model holds its gradients as a shard");
        self.grads.at(r.start)
    }
}
