//! The memory plan: what one rank of a run will hold, computed from its resolved config before
//! anything is allocated (`kiln memory`, the table printed before step 0, `memory.limit`).
//!
//! It counts what kiln *allocates*, buffer by buffer, not a textbook formula: the parameter,
//! gradient and moment buffers as `parallel::DataParallel` keeps them for the ZeRO stage (with
//! `Shards`' padding), the activation buffers as `Gpt::ensure_acts` lays them out for the
//! recomputation policy (checked against `Gpt::activation_bytes` in `tests/it/memory.rs`),
//! backward's gradient scratch (`GradScratch`), the MoE caches (`tensor::moe::MoeCache`), the
//! head's chunk of logits (`tensor::classifier::chunk_rows`), ZeRO-2/3's transient unit buffers
//! (by replaying the acquire/release sequence of a step against the store's rules), the
//! data-parallel communication temporaries, LoRA's adapters, and the checkpoint snapshot.
//!
//! Bytes per element are an [`ElementBytes`], so bf16 / fp16 / fp8 storage only adds a
//! constant; kiln trains in fp32 today.
//!
//! Not modelled (each at most a few MiB): per-thread kernel scratch pools, gemm's packing
//! buffers, the tokenizer, thread stacks, allocator slack; with `memory.offload = optimizer`
//! the moments' pages being updated (4 MiB of each at a time, mapped file pages, not heap).

pub mod guard;
pub mod track;

use crate::config::{RunConfig, StateForm};
use crate::error::{user, KilnError, Result};
use model::gpt::Recompute;
use model::{Access, GptConfig};
use plan::policy::Names;
use serde_json::json;

/// Bytes per element of each kind of buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ElementBytes {
    pub name: &'static str,
    pub param: usize,
    pub grad: usize,
    /// Stored activations between forward and backward (2: the 16-bit stash, `Gpt::stash16`;
    /// working buffers, statistics and scratch are fp32 either way).
    pub act: usize,
    /// Each AdamW moment.
    pub optim: usize,
    /// The master weights' bytes kept beside lower-precision parameters (0 when the parameters
    /// are the master copy; 2 for bf16's split master weights, `step::Master::Low`; an
    /// offloaded master is whole fp32, 4, in its file).
    pub master: usize,
    /// The products' arithmetic (bf16 products chunk the LM head in larger row blocks).
    pub arith: tensor::matmul::Arith,
    /// Activation compression's code bits (`memory.activation_compression`): the stored
    /// activations are then `tensor::quant::compressed_bytes` each, whatever `act` says.
    pub compress: Option<u32>,
}

/// Everything in fp32, the parameters are their own master copy.
pub const FP32: ElementBytes = ElementBytes { name: "fp32", param: 4, grad: 4, act: 4, optim: 4, master: 0, arith: tensor::matmul::Arith::F32, compress: None };

/// bf16 / fp16 (and FP8, which stores in bf16): activations stored in 16 bits between forward
/// and backward, fp32 working parameters (rounded to the format) with fp32 master weights beside
/// them, fp32 gradients and moments.
pub const MIXED_16: ElementBytes = ElementBytes { name: "fp16 (16-bit stored activations, fp32 master weights)", param: 4, grad: 4, act: 2, optim: 4, master: 4, arith: tensor::matmul::Arith::F32, compress: None };

/// bf16: [`MIXED_16`] with bf16 products (fp32 products on a CPU without BF16 instructions:
/// [`ElementBytes::of`] says which) and the fp32 master weights split: the working weight and
/// 16 low bits beside it.
pub const BF16: ElementBytes = ElementBytes { name: "bf16 (16-bit stored activations, bf16 products, fp32 master weights as working weights + low halves)", arith: tensor::matmul::Arith::Bf16, master: 2, ..MIXED_16 };

/// FP8: [`MIXED_16`] (it stores in bf16, so its master weights split as bf16's; its products
/// are fp32 over scaled FP8 values).
pub const FP8: ElementBytes = ElementBytes { name: "fp8 (E4M3/E5M2 products, bf16 stored activations, fp32 master weights as working weights + low halves)", master: 2, ..MIXED_16 };

impl ElementBytes {
    /// The bytes per element kiln allocates when it trains in `p` (`train.precision`): [`FP32`], or for every
    /// lower format [`MIXED_16`].
    pub fn of(p: model::gpt::Precision) -> ElementBytes {
        match p {
            model::gpt::Precision::Fp32 => FP32,
            model::gpt::Precision::Bf16 => ElementBytes { arith: model::gpt::arith(p), ..BF16 },
            model::gpt::Precision::Fp16 => MIXED_16,
            model::gpt::Precision::Fp8 => FP8,
        }
    }
}

/// Where a row's bytes sit in a rank's timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Held across steps (allocated at start-up or in the first step, then reused).
    Held,
    /// Held only at a moment of the step (the most held at once).
    Step,
    /// Held during evaluation instead of the training activations.
    Eval,
    /// Held while a checkpoint is taken.
    Checkpoint,
}

/// What a row holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Parameters,
    Gradients,
    Optimizer,
    Activations,
    Temporary,
    Communication,
    Other,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Parameters => "parameters",
            Kind::Gradients => "gradients",
            Kind::Optimizer => "optimizer state",
            Kind::Activations => "activations",
            Kind::Temporary => "temporary",
            Kind::Communication => "communication",
            Kind::Other => "other",
        }
    }

    /// The tracking allocator's category these bytes are charged to in a training run.
    pub fn tracked(self) -> track::Category {
        match self {
            Kind::Parameters => track::Category::Params,
            Kind::Gradients => track::Category::Grads,
            Kind::Optimizer => track::Category::Optimizer,
            Kind::Activations => track::Category::Activations,
            Kind::Temporary | Kind::Communication | Kind::Other => track::Category::Other,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub kind: Kind,
    pub phase: Phase,
    pub name: &'static str,
    pub bytes: u64,
    pub detail: String,
}

/// One rank's plan, plus what its process adds.
#[derive(Clone, Debug)]
pub struct MemoryPlan {
    pub precision: ElementBytes,
    /// Per rank (every rank of a run holds the same, up to rank 0's checkpoint duties, which
    /// are counted).
    pub rows: Vec<Row>,
    /// The most one rank holds during a training step before the first checkpoint.
    pub step_peak: u64,
    /// The most one rank holds during evaluation.
    pub eval_peak: u64,
    /// The most one rank holds while a checkpoint is taken.
    pub checkpoint_peak: u64,
    /// Starting from a Hugging Face directory (`--init-from`, not QLoRA, which reads tensor by
    /// tensor): the model's fp32 weights and its largest weight file, read whole; 0 otherwise.
    pub load_peak: u64,
    /// The run's per-rank peak: the largest of the three, with the checkpoint snapshot's
    /// buffers, which are kept for reuse from the first checkpoint on.
    pub total: u64,
    /// Ranks that share one process (in-process ranks are threads; MPI ranks are processes).
    pub ranks_per_process: usize,
    /// With in-process pipeline ranks (different stages): the sums of their totals and of
    /// their step peaks.
    pub ranks_sum: Option<(u64, u64)>,
    /// Token streams held in memory (memory-mapped shards are not), once per process.
    pub data_bytes: u64,
    /// `memory.limit` in bytes (0 = none).
    pub limit: u64,
    /// A line naming the layout, for the table's title.
    pub layout: String,
}

/// The activation buffers of one `(B, T)` set, by component, in bytes (what
/// `Gpt::activation_bytes` reports after `Gpt::reserve_activations(b, t)`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Activations {
    /// The residual stream between blocks (`L + 1` of `[B, T, C]`), the kept residual between
    /// each block's branches, and the one branch buffer.
    pub residual: u64,
    /// q|k|v, the attention output and FlashAttention's log-sum-exp (no `T×T` matrix).
    pub attention: u64,
    /// The MLP's hidden activations (GELU / SwiGLU input and output), or the MoE layers'
    /// routing, dispatch, expert activations and backward scratch.
    pub mlp: u64,
    /// The norms' outputs and statistics (each block's two, and the final norm).
    pub norms: u64,
    /// The head: one chunk of logits and the gradient of the final norm's output.
    pub head: u64,
    /// Per-position losses, tokens and targets.
    pub losses: u64,
}

impl Activations {
    pub fn total(&self) -> u64 {
        self.residual + self.attention + self.mlp + self.norms + self.head + self.losses
    }

    fn times(self, k: u64) -> Activations {
        Activations { residual: self.residual * k, attention: self.attention * k, mlp: self.mlp * k, norms: self.norms * k, head: self.head * k, losses: self.losses * k }
    }
}

/// The activation buffers `Gpt::ensure_acts` allocates for a model `cfg` (this rank's: a
/// tensor-parallel shard, a pipeline stage's layers) at `(b, t)` under `recompute`, for one
/// micro-batch. A pipeline stage holds one such set per micro-batch in flight.
pub fn activation_set(cfg: &GptConfig, b: usize, t: usize, recompute: Recompute, p: &ElementBytes) -> Activations {
    activation_set_every(cfg, b, t, recompute, 1, p)
}

/// [`activation_set`] with `Full` recomputation of every `every`-th layer only (by whole-model
/// index; the others keep their sets).
pub fn activation_set_every(cfg: &GptConfig, b: usize, t: usize, recompute: Recompute, every: usize, p: &ElementBytes) -> Activations {
    let (c, nh, vp) = (cfg.n_embd, cfg.n_head, cfg.vocab_size);
    let (qw, aw) = (cfg.qkv_width(), cfg.attn_width());
    let n = b * t;
    // Sequence parallel: the residual stream and norms hold this shard's T/tp positions; the
    // gathered norm outputs and one whole-sequence scratch are extra.
    let (nl, nf) = match cfg.place.seq {
        Some(s) => (b * s.positions(t).len(), n),
        None => (n, 0),
    };
    let head = cfg.has_head();
    let (hn, hl) = if head { (n, nl) } else { (0, 0) };
    let l = cfg.n_layer;
    // Sets per layer: kept (norms, residual), inner (q|k|v, MLP hidden), attention core.
    let recomputed = (0..l).filter(|i| (cfg.first_layer() + i).is_multiple_of(every.max(1))).count();
    let own = l - recomputed + usize::from(recomputed > 0);
    let (n_kept, n_inner, n_core) = match recompute {
        Recompute::None => (l, l, l),
        Recompute::Selective => (l, l, 1),
        Recompute::Full => (own, own, own),
    };
    // The stash (`Gpt::stash_format`): each layer's rounded activations in `p.act` bytes, or
    // compressed (each tensor in its own groups), plus one fp32 working set; the fp32
    // statistics per layer plus the working set.
    // (MoE layers: only compressed, their routing state exact and their experts'
    // activations as codes, sized for every assignment kept.)
    let stash = recompute != Recompute::Full && (p.compress.is_some() || (p.act < 4 && !cfg.is_moe()));
    let f = |elems: usize| elems as u64 * 4;
    let stored = |e: usize| match p.compress {
        Some(bits) => tensor::quant::compressed_bytes(e, bits) as u64,
        None => p.act as u64 * e as u64,
    };
    let bulk = |sets: usize, e: usize| if stash { sets as u64 * stored(e) + f(e) } else { sets as u64 * f(e) };
    let stat = |sets: usize, e: usize| if stash { (sets as u64 + 1) * f(e) } else { sets as u64 * f(e) };
    // Dense layers before the routed ones: every set holds the dense buffers too.
    let dense = bulk(n_inner, n * cfg.dense_fc_width()) + bulk(n_inner, n * cfg.dense_hidden());
    let mlp_inner = match (cfg.is_moe(), stash) {
        (true, true) => moe_cache_bytes(cfg, n) + l as u64 * moe_stash_bytes(cfg, n, &stored),
        (true, false) => n_inner as u64 * moe_cache_bytes(cfg, n),
        _ => dense,
    } + if cfg.is_moe() && cfg.dense_layers() > 0 { dense } else { 0 };
    let qk_in = n * (cfg.n_head + cfg.n_kv_head) * cfg.head_size();
    // DeepSeek's latent attention keeps its latents (normed and not) and the heads' values.
    let (mla_bulk, mla_stats, _) = model::mla::mla_elements(cfg, n);
    let mla = if cfg.is_mla() { bulk(n_inner, mla_bulk) + stat(n_inner, mla_stats) } else { 0 };
    // Norms after the branches keep both branches' outputs and their rstd.
    let post = if cfg.block_norms.post() { bulk(n_inner, 2 * nl * c) + stat(n_inner, 2 * nl) } else { 0 };
    let core = match recompute {
        // One shared fp32 set, recomputed per layer.
        Recompute::Selective => f(n * aw + b * nh * t),
        _ => bulk(n_core, n * aw) + stat(n_core, b * nh * t),
    };
    Activations {
        // Compressed stashes keep each block's input as codes, the stream in two buffers and one
        // to expand an input into for backward.
        residual: match (stash, p.compress) {
            (true, Some(bits)) => f(3 * nl * c) + l as u64 * tensor::quant::compressed_bytes(nl * c, bits) as u64,
            _ => f((l + 1) * nl * c),
        } + bulk(n_kept, nl * c) + f(nl * c) + f(nf * c),
        // Qwen3's per-head norms keep their inputs (rounded like q|k|v) and an fp32 rstd per head
        // (OLMo 2's whole-width ones two per token).
        attention: bulk(n_inner, n * qw) + core + if cfg.qk_norm { bulk(n_inner, qk_in) + stat(n_inner, n * cfg.qk_norm_groups()) } else { 0 } + mla,
        mlp: mlp_inner,
        norms: 2 * bulk(n_kept, nl * c) + stat(n_kept, 4 * nl) + f(hl * c + 2 * hl) + 2 * bulk(n_inner, nf * c) + post,
        head: f(hl * c) + f(if head { nf * c } else { 0 }) + f(tensor::classifier::chunk_rows(hn, vp, p.arith) * vp),
        // losses are fp32; tokens (u32) and targets (i32) are 4 bytes
        losses: f(n) + 8 * n as u64,
    }
}

/// One MoE layer's cache (`tensor::moe::MoeCache::new`): forward's saved tensors and
/// backward's scratch, with `R = N·K` rows allocated for the kept token-assignments.
fn moe_cache_bytes(cfg: &GptConfig, n: usize) -> u64 {
    let tensor::moe::MoeDims { c, f, e, k, n_shared: s, .. } = cfg.moe_dims(n);
    let (r, big) = (n * k, (n * k).max(n));
    let floats = 2 * n * e + n + n * k + r * c + r * 2 * f + r * f + r * c + s * n * 2 * f + s * n * f  // logits, probs, lse, gates, xe, gu, h, eo, sgu, sh
        + r * c + big * f + big * 2 * f + n * k + n * e; // deo, dh, dgu, dgate, dlogits
    let u32s = n * k + n * k + r; // idx, slot, row_token
    let usizes = (e + 1) + e; // offsets, counts
    floats as u64 * 4 + u32s as u64 * 4 + (usizes * std::mem::size_of::<usize>()) as u64
}

/// One MoE layer's share of a compressed stash (`Gpt`'s `MoeStash`): its routing state exact
/// (`tensor::moe::MoeRouting`) and what `MoeCache::kept_activations` returns, each part
/// `stored`, room for every token-assignment kept (`R = N·K` rows: a capacity that drops some
/// leaves room unused; an expert owner that receives more than `R` rows grows it, and its
/// 2E exchange counts are not counted).
fn moe_stash_bytes(cfg: &GptConfig, n: usize, stored: &dyn Fn(usize) -> u64) -> u64 {
    let dims = cfg.moe_dims(n);
    let tensor::moe::MoeDims { e, k, .. } = dims;
    let r = n * k;
    // logits, probs, lse, idx, gates, slot, row_token; offsets, counts, route
    let routing = 4 * (2 * n * e + n + n * k + n * k + n * k + r) + 8 * ((e + 1) + e);
    routing as u64 + tensor::moe::MoeCache::kept_lens(&dims).iter().map(|&x| stored(x)).sum::<u64>()
}

/// Backward's gradient scratch (`GradScratch`): one set for all blocks, sized by the dense
/// widths even for an MoE model (whose layer keeps its own scratch in its cache).
pub fn grad_scratch(cfg: &GptConfig, n: usize) -> u64 {
    let post = if cfg.block_norms.post() { n * cfg.n_embd } else { 0 };
    let elems = 3 * n * cfg.n_embd + n * cfg.attn_width() + n * cfg.qkv_width() + n * cfg.dense_fc_width() + n * cfg.dense_hidden() + post + model::mla::mla_elements(cfg, n).2;
    elems as u64 * 4
}

/// The elements ZeRO-2/3's transient unit buffers hold at most at once during a step (forward
/// and, when `train`, backward), replaying the unit accesses a pass makes against
/// `DataParallel`'s rules: stage 3 gathers a unit (padded to `n` chunks) on acquire, with the
/// pass's next unit as prefetch, and frees it on release; stages 2–3 give each unit acquired
/// for gradients (the head already in forward) a padded gradient buffer, handed to the
/// communication thread on its backward release, where it lives until its reduce-scatter
/// (with a chunk of output) is done — counted here until the next acquire.
fn zero_transient(padded: &[usize], chunk: &[usize], zero: usize, head_unit: usize, train: bool) -> usize {
    struct Replay<'a> {
        p: &'a [usize],
        chunk: &'a [usize],
        zero: usize,
        gathered: Vec<bool>,
        grads: Vec<bool>,
        live: usize,
        in_flight: usize,
        peak: usize,
    }
    impl Replay<'_> {
        fn take(&mut self, x: usize) {
            self.live += x;
            self.peak = self.peak.max(self.live + self.in_flight);
        }
        fn gather(&mut self, u: usize) {
            if !self.gathered[u] {
                self.gathered[u] = true;
                self.take(self.p[u]);
            }
        }
        fn acquire(&mut self, u: usize, a: Access, next: Option<(usize, Access)>) {
            if self.zero == 3 {
                if a.params() {
                    self.gather(u);
                }
                if let Some((nu, _)) = next.filter(|(_, na)| na.params()) {
                    self.gather(nu);
                }
            }
            if a.grads() && self.zero >= 2 && !self.grads[u] {
                self.grads[u] = true;
                self.take(self.p[u]);
            }
            self.in_flight = 0;
        }
        fn release(&mut self, u: usize, a: Access) {
            if self.zero == 3 && a.params() && self.gathered[u] {
                self.gathered[u] = false;
                self.live -= self.p[u];
            }
            if matches!(a, Access::Backward { .. }) && self.zero >= 2 && self.grads[u] {
                self.grads[u] = false;
                self.live -= self.p[u];
                self.in_flight = self.p[u] + self.chunk[u];
            }
        }
    }
    if zero < 2 {
        return 0;
    }
    let units = padded.len();
    let (last, hu) = (units - 1, head_unit);
    let mut r = Replay { p: padded, chunk, zero, gathered: vec![false; units], grads: vec![false; units], live: 0, in_flight: 0, peak: 0 };
    let (fwd, bwd) = (Access::Forward, Access::Backward { params: true });
    // Gpt::forward_with: the embeddings, the blocks, the final norm, then the fused head.
    for u in 0..last {
        r.acquire(u, fwd, Some((u + 1, fwd)));
        r.release(u, fwd);
    }
    let head = Access::Head { train };
    r.acquire(last, fwd, Some((hu, head)));
    r.release(last, fwd);
    r.acquire(hu, head, None);
    r.release(hu, head);
    if train {
        // Gpt::backward_with: the final norm, the blocks in reverse, the embeddings' gradients.
        r.acquire(last, bwd, Some((last - 1, bwd)));
        r.release(last, bwd);
        for u in (1..last).rev() {
            let next = if u == 1 { (0, Access::Backward { params: false }) } else { (u - 1, bwd) };
            r.acquire(u, bwd, Some(next));
            r.release(u, bwd);
        }
        let emb = Access::Backward { params: false };
        r.acquire(0, emb, None);
        r.release(0, emb);
    }
    r.peak
}

/// The plan for `cfg` with `gpt` the whole model's config (its vocabulary resolved), and
/// `data_bytes` the token streams the process holds in memory. Errors are the user's (a
/// tensor-parallel degree that does not divide the heads, bad LoRA targets).
pub fn plan(cfg: &RunConfig, gpt: &GptConfig, data_bytes: u64) -> Result<MemoryPlan> {
    let mut p = plan_rank(cfg, gpt, data_bytes, 0)?;
    let par = &cfg.parallel;
    if par.pp > 1 && par.backend != crate::config::Backend::Mpi {
        // In-process pipeline ranks hold different stages: the process holds each stage's plan
        // once per (dp × ep × tp) rank of it.
        let per_stage = (par.dp.max(1) * par.tp * par.ep * par.cp) as u64;
        let (mut total, mut step) = (0, 0);
        for s in 0..par.pp {
            let r = plan_rank(cfg, gpt, data_bytes, s)?;
            (total, step) = (total + r.total, step + r.step_peak);
        }
        p.ranks_sum = Some((per_stage * total, per_stage * step));
    }
    Ok(p)
}

/// What one rank holds, as `kiln train` builds it: its part of the model (with a pipeline,
/// stage `s`'s layers, then its tensor-parallel shard), the layout's units and their ZeRO
/// shards, the LoRA adapters, and the step's shapes.
struct RankShape {
    p: ElementBytes,
    local: GptConfig,
    stages: Vec<std::ops::Range<usize>>,
    /// Activation sets held at once: one, or the schedule's peak on this stage.
    in_flight: usize,
    /// Model chunks on this rank (interleaved: v copies of the first one's state).
    chunks: usize,
    total: usize,
    /// The whole model (every stage and shard).
    whole: GptConfig,
    units: Vec<std::ops::Range<usize>>,
    shards: parallel::Shards,
    padded: Vec<usize>,
    head_unit: usize,
    lora: Option<model::lora::Lora>,
    rows: usize,
    /// Positions of each sequence this rank holds: `train.seq_len`, or over `parallel.cp`.
    t: usize,
    n: usize,
}

impl RankShape {
    fn new(cfg: &RunConfig, gpt: &GptConfig, s: usize) -> Result<RankShape> {
        let p = ElementBytes { compress: cfg.memory.activation_compression.bits(), ..ElementBytes::of(cfg.train.precision) };
        let par = &cfg.parallel;
        let (dp, tp) = (par.dp.max(1), par.tp);
        // With a pipeline: rank 0's stage (its layers, the embeddings; the stage that keeps the
        // most micro-batches in flight), then its tensor-parallel shard.
        let stages = cfg.stage_layers(gpt.vocab_size)?;
        let (v, sched) = (par.virtual_stages, par.schedule);
        let stage = if stages.len() > 1 { parallel::pp::stage_config(gpt, stages[s].clone()) } else { gpt.clone() };
        let local = if tp > 1 { parallel::tp::local_config(&stage, tp, 0, par.sequence_parallel).map_err(KilnError::User)? } else { stage };
        // 1F1B: p, GPipe: m; interleaved counts each chunk's sets, planned at the first chunk's size.
        let in_flight = if stages.len() > 1 { parallel::pp::Schedule::new(sched, par.pp, cfg.train.grad_accum, v).map_err(KilnError::User)?.peak_in_flight(s) } else { 1 };
        let chunks = if stages.len() > 1 { v } else { 1 };
        let (layout, views) = model::layout::gpt_layout(&local);
        let total = layout.total;
        let units = views.units(total);
        let shards = parallel::Shards::new(&units, dp, 0);
        let padded: Vec<usize> = shards.chunk.iter().map(|c| c * dp).collect();
        let lora = if cfg.lora.rank > 0 {
            let l = &cfg.lora;
            Some(model::lora::Lora::new(&local, l.rank, l.alpha as f32, &l.targets, 0).map_err(KilnError::User)?)
        } else {
            None
        };
        let rows = cfg.micro_batch() / dp;
        let t = cfg.seq_len() / par.cp.max(1);
        let n = rows * t;
        let whole = gpt.clone();
        Ok(RankShape { p, local, stages, in_flight, chunks, total, whole, units, shards, padded, head_unit: views.head_unit(), lora, rows, t, n })
    }
}

/// The plan's rows, in order.
struct Rows(Vec<Row>);

impl Rows {
    fn add(&mut self, kind: Kind, phase: Phase, name: &'static str, bytes: u64, detail: String) {
        self.0.push(Row { kind, phase, name, bytes, detail });
    }
}

fn b4(elems: usize, bytes: usize) -> u64 {
    (elems * bytes) as u64
}

/// The optimizer state row's name, and what its detail adds, for `optim.name`.
fn optimizer_state_names(o: crate::config::OptimName) -> (&'static str, &'static str) {
    use crate::config::OptimName;
    match o {
        OptimName::AdamW => ("AdamW m, v", ""),
        OptimName::Lion => ("Lion m", ": Lion's momentum (its one state)"),
        OptimName::Muon => ("Muon momentum, AdamW m, v", ": every element's momentum, and the second moment of the parameters AdamW updates"),
        OptimName::Adafactor => ("Adafactor statistics", ": each matrix's row and column averages and each vector's second moment, back to back"),
    }
}

/// The optimizer's state: its moments (or Lion's one, Muon's momentum and AdamW's second
/// moment, Adafactor's statistics), compact or offloaded, for `moments` elements per chunk.
fn optimizer_rows(out: &mut Rows, cfg: &RunConfig, r: &RankShape, (moments, chunks): (usize, usize)) {
    let (held, optim) = (Phase::Held, b4(2 * moments * chunks, r.p.optim));
    let offload = cfg.memory.offload == crate::config::Offload::Optimizer;
    let (name, what) = optimizer_state_names(cfg.optim.name);
    match cfg.optim.state {
        _ if offload => out.add(Kind::Optimizer, held, name, 0, format!("{} in memory-mapped files under the run directory (memory.offload), streamed through the update in 4 MiB chunks", fmt_bytes(optim))),
        StateForm::Fp32 if cfg.optim.name == crate::config::OptimName::Lion => out.add(Kind::Optimizer, held, name, optim / 2, format!("{moments} elements{what}")),
        StateForm::Fp32 if cfg.optim.name == crate::config::OptimName::Muon => {
            // The momentum of every element; the second moment of AdamW's alone.
            let layout = r.lora.as_ref().map_or_else(|| model::layout::gpt_layout(&r.local).0, |lo| lo.layout.clone());
            let rest: usize = layout.params.iter().filter(|q| !crate::step::muon_matrix(q)).map(|q| q.len()).sum();
            let v = (moments as f64 * rest as f64 / layout.total.max(1) as f64).ceil() as usize;
            out.add(Kind::Optimizer, held, name, b4((moments + v) * chunks, 4), format!("{moments} + {v} elements{what}"))
        }
        StateForm::Fp32 if cfg.optim.name == crate::config::OptimName::Adafactor => {
            let n = match &r.lora {
                Some(lo) => adafactor_statistics(&lo.layout),
                None => adafactor_statistics(&model::layout::gpt_layout(&r.local).0) * chunks,
            };
            out.add(Kind::Optimizer, held, name, b4(n, 4), format!("{n} elements{what}"))
        }
        StateForm::Fp32 => out.add(Kind::Optimizer, held, name, optim, format!("2 × {moments} elements{what}")),
        StateForm::Bf16 => out.add(Kind::Optimizer, held, "AdamW m, v (bf16)", b4(2 * moments * chunks, 2), format!("2 × {moments} bf16 elements, rounded stochastically")),
        // One 8-bit code an element, one fp32 scale per block of 256 (and per update run).
        StateForm::Int8 => out.add(Kind::Optimizer, held, "AdamW m, v (8-bit)", (2 * moments * chunks + 8 * (moments / tensor::lean::BLOCK + 64) * chunks) as u64, format!("2 × {moments} codes and an fp32 scale per 256")),
    }
}

/// Model state, as `DataParallel` keeps it: parameters, gradients, adapters, moments, master
/// weights.
fn model_state_rows(out: &mut Rows, cfg: &RunConfig, r: &RankShape, s: usize) {
    let (p, total, chunks, held) = (&r.p, r.total, r.chunks, Phase::Held);
    let (zero, tp) = (cfg.parallel.zero, cfg.parallel.tp);
    let (pe, ge) = (if zero == 3 { r.shards.len } else { total }, if zero >= 2 { r.shards.len } else { total });
    let sharded = |e: usize| if e == total { format!("{e} elements") } else { format!("{e} elements: this rank's ZeRO shard of {total} (padded)") };
    let tp_note = if tp > 1 { format!(", a tensor-parallel shard (1/{tp} of the heads and MLP columns)") } else { String::new() };
    let pp_note = if chunks > 1 { format!(", × {chunks} model chunks") } else if r.stages.len() > 1 { format!(", pipeline stage {s} (layers {:?})", r.stages[s]) } else { String::new() };
    let quant = cfg.lora.quantize_base;
    if quant != model::BaseQuant::None {
        // QLoRA: the base's matrices quantized, the rest fp32; a pass holds one unit's fp32
        // tensors packed, with a gradient scratch for them, and each thread one dequantized
        // tile of a matrix inside a product (model::qbase, tensor::quant::qmatmul_forward).
        let (layout, _) = model::layout::gpt_layout(&r.local);
        let bytes = model::qbase::planned_bytes(&layout, quant) as u64;
        out.add(Kind::Parameters, held, "parameters (quantized base)", bytes, format!("{total} elements, the blocks' matrices as {} (lora.quantize_base), the rest fp32", plan::policy::Names::name(quant)));
        // Per unit: its packed elements, and its gradient scratch (none for the embeddings,
        // the final norm's for the head's unit: a frozen model computes no gradient there).
        let last = r.units.len() - 1;
        let packed = |u: usize, only: &dyn Fn(&model::ParamSpec) -> bool| -> usize {
            let ru = &r.units[u];
            layout.params.iter().filter(|p| ru.start <= p.range().start && p.range().end <= ru.end && !model::qbase::read_quantized(p) && only(p)).map(|p| p.len()).sum()
        };
        let (unit, with_grads) = (0..=last)
            .map(|u| {
                let n = packed(u, &|_| true);
                let g = match u {
                    0 => 0,
                    u if u == last => packed(u, &|p| !p.decay),
                    _ => n,
                };
                (n, n + g)
            })
            .fold((0, 0), |(a, b), (n, ng)| (a.max(n), b.max(ng)));
        out.add(Kind::Temporary, held, "a unit's packed tensors and their gradient scratch", b4(with_grads, 4), format!("the largest unit (packed) {unit} elements; with its gradient scratch {with_grads}"));
        let k = r.local.n_embd.max(r.local.ffn_hidden).max(r.local.qkv_width());
        let threads = rayon::current_num_threads();
        out.add(Kind::Temporary, held, "dequantized tiles", b4(threads * k * tensor::quant::QTILE, 4), format!("{threads} threads × one {k} × {} tile of a quantized matrix", tensor::quant::QTILE));
    } else {
        out.add(Kind::Parameters, held, "parameters", b4(pe * chunks, p.param), format!("{}{tp_note}{pp_note}", sharded(pe)));
        if r.lora.is_some() {
            // A frozen base: a gradient scratch per unit (none for the embeddings), one at a time.
            let unit = r.units.iter().skip(1).map(|u| u.len()).max().unwrap_or(0);
            out.add(Kind::Temporary, held, "a unit's gradient scratch (frozen base)", b4(unit, 4), format!("the largest unit's, {unit} elements: the passes write its norms' and biases' gradients, nothing reads them"));
        } else {
            out.add(Kind::Gradients, held, "gradients", b4(ge * chunks, p.grad), sharded(ge));
        }
    }
    let moments = match &r.lora {
        Some(lo) => lo.layout.total,
        None if zero == 0 => total,
        None => r.shards.len,
    };
    if let Some(lo) = &r.lora {
        out.add(Kind::Parameters, held, "LoRA adapters", b4(lo.layout.total, p.param), format!("{} adapters of rank {}", lo.adapters.len(), lo.rank));
        out.add(Kind::Gradients, held, "LoRA adapter gradients", b4(lo.layout.total, p.grad), String::new());
    }
    let offload = cfg.memory.offload == crate::config::Offload::Optimizer;
    let form = cfg.optim.state;
    optimizer_rows(out, cfg, r, (moments, chunks));
    muon_rows(out, cfg, r, moments);
    grpo_rows(out, cfg, r);
    // LoRA rounds its frozen base once and keeps no master weights; bf16 state under bf16
    // weights keeps none either (the weights are their own master copy).
    let own_master = form == StateForm::Bf16 && cfg.train.precision == model::Precision::Bf16;
    if p.master > 0 && r.lora.is_none() && !own_master {
        if offload {
            out.add(Kind::Optimizer, held, "master weights (offloaded)", 0, format!("{} of fp32 in a memory-mapped file beside the moments", fmt_bytes(b4(moments * chunks, 4))));
        } else {
            let note = if p.master == 2 { "fp32 as the bf16 working weights and these low 16 bits" } else { "" };
            out.add(Kind::Optimizer, held, "master weights", b4(moments * chunks, p.master), note.to_string());
        }
    }
    if cfg.parallel.compression == crate::config::Compression::PowerSgd {
        // PowerSGD (parallel::compress::PowerSgd): the error and Q held; in the step the
        // gradient's copy, the first all-reduce (the Ps and the uncompressed tensors) and the
        // largest matrix's reconstruction.
        let (layout, _) = model::layout::gpt_layout(&r.local);
        let tensors = parallel::compress::PowerSgd::tensors(&layout);
        let (err, q, pbuf) = parallel::compress::PowerSgd::sizes(&tensors, cfg.parallel.powersgd_rank);
        let biggest = layout.params.iter().filter(|q| q.shape.len() == 2).map(|q| q.len()).max().unwrap_or(0);
        out.add(Kind::Optimizer, held, "PowerSGD error feedback and Q", b4(err + q, 4), format!("error {err} + Q {q} elements (parallel.compression, rank {})", cfg.parallel.powersgd_rank));
        out.add(Kind::Temporary, Phase::Step, "PowerSGD buffers", b4(moments + pbuf + biggest, 4), format!("the gradient's copy, {pbuf} elements all-reduced with the Ps, one matrix's reconstruction"));
    }
    if cfg.parallel.compression == crate::config::Compression::OnebitAdam {
        // 1-bit Adam (parallel::compress): the error feedback, and in the update the rank's
        // momentum before its compressed average.
        let n = cfg.parallel.dp.max(1);
        let state = parallel::compress::OneBit::state_len(moments, n);
        out.add(Kind::Optimizer, held, "1-bit Adam error feedback", b4(state, 4), format!("worker error {moments} + server error {} elements (parallel.compression)", state - moments));
        out.add(Kind::Temporary, Phase::Step, "1-bit Adam momentum", b4(moments, 4), "this rank's momentum, averaged compressed in the update".into());
    }
    if cfg.parallel.compression == crate::config::Compression::ZerooneAdam {
        // 0/1 Adam (step::zeroone_step): the error feedback, the anchor and the accumulated
        // moves; in the update the rank's scaled gradient and, at a sync, the moves to average.
        let n = cfg.parallel.dp.max(1);
        let state = crate::step::ZeroOneState::state_len(moments, n);
        out.add(Kind::Optimizer, held, "0/1 Adam state", b4(state, 4), format!("error feedback {} + anchor {moments} + accumulated moves {moments} elements (parallel.compression)", parallel::compress::OneBit::state_len(moments, n)));
        out.add(Kind::Temporary, Phase::Step, "0/1 Adam buffers", b4(2 * moments, 4), "this rank's scaled gradient, and at a sync its moves in momentum units".into());
    }
}

/// Muon's step buffers: the Newton–Schulz iteration on the largest matrix, and distributed
/// Muon's gathers (`step::muon`).
fn muon_rows(out: &mut Rows, cfg: &RunConfig, r: &RankShape, moments: usize) {
    let zero = cfg.parallel.zero;
    if cfg.optim.name == crate::config::OptimName::Muon {
        // tensor::optim::newton_schulz on the largest matrix: its momentum update, the working
        // copy and the next iterate (and the transposed result), and two Gram-sized matrices.
        let (layout, _) = model::layout::gpt_layout(&r.local);
        let (rc, rr) = layout.params.iter().filter(|q| q.shape.len() == 2 && q.decay).map(|q| (q.len(), q.shape[0].min(q.shape[1]).pow(2))).max().unwrap_or((0, 0));
        let tp = cfg.parallel.tp.max(1);
        out.add(Kind::Temporary, Phase::Step, "Newton–Schulz buffers", b4(4 * rc * tp + 2 * rr * tp * tp, 4), format!("the largest Muon matrix's update, iterates and result ({} elements each, whole over tensor parallelism) and two Gram matrices", rc * tp));
        if (zero > 0 && cfg.parallel.dp > 1) || tp > 1 {
            // step::muon: the momentum and the results laid out like the moments; a unit's
            // gathered updates and results, and over tensor parallelism its parts from every
            // rank and the whole matrices' results.
            let unit = r.padded.iter().copied().max().unwrap_or(0);
            out.add(Kind::Temporary, Phase::Step, "distributed Muon buffers", b4(2 * moments + 2 * unit + 2 * tp * unit, 4), format!("2 × {moments} elements beside the moments, and a unit's gathers ({unit} elements, ×{tp} over tensor parallelism)"));
        }
    }
}

/// Adafactor's statistics for `layout`'s tensors: rows + columns per matrix, a vector's length
/// (`step::Optimizer::factor`).
fn adafactor_statistics(layout: &model::ParamLayout) -> usize {
    layout.params.iter().filter(|p| !p.is_empty()).map(|p| match p.shape[..] {
        [r, c] if r > 1 && c > 1 => r + c,
        _ => p.len(),
    }).sum()
}

/// GRPO's sampling: the whole weights the completions are sampled with (and a reference copy
/// with a KL term or LoRA), and one prompt's group decoded together: a KV cache per completion
/// and the prompt's, and each row's scratch and logits.
fn grpo_rows(out: &mut Rows, cfg: &RunConfig, r: &RankShape) {
    if cfg.train.objective != crate::config::Objective::Grpo {
        return;
    }
    // (Sampling holds the whole model on every rank, whatever the layout.)
    let (c, g) = (&r.whole, cfg.grpo.group);
    let total = model::layout::gpt_layout(c).0.total;
    out.add(Kind::Parameters, Phase::Held, "GRPO sampling weights", b4(total, 4), format!("{total} elements: a whole fp32 copy of the current weights (with LoRA, the adapters merged), refreshed before each batch of completions"));
    if cfg.grpo.beta > 0.0 || cfg.lora.rank > 0 {
        out.add(Kind::Parameters, Phase::Held, "GRPO reference weights", b4(total, 4), format!("{total} elements: the starting weights (with LoRA, the base), for the KL term and the merge"));
    }
    let cache = c.kv_cache_floats();
    let row = 4 * c.n_embd + c.qkv_width() + c.attn_width() + c.fc_width() + c.ffn_hidden + 2 * c.vocab_size + (c.n_head + c.n_kv_head) * (c.head_size() + 1);
    // At most this rank's whole share of the step's completions (its prompts of one length).
    let n = (cfg.train.batch_size / cfg.parallel.dp.max(1)).max(g);
    out.add(Kind::Temporary, Phase::Step, "GRPO rollout caches", b4((n + 1) * cache + n * row, 4), format!("up to {n} completions decoded together (groups of {g}): {} KV caches of {cache} elements, {n} rows of scratch and logits", n + 1));
}

/// Activations (one set per micro-batch in flight) and the backward scratch; returns the sets'
/// bytes.
fn activation_rows(out: &mut Rows, cfg: &RunConfig, r: &RankShape) -> Activations {
    let (local, p, rows, n, held) = (&r.local, &r.p, r.rows, r.n, Phase::Held);
    let (t, recompute, par) = (r.t, cfg.model.recompute, &cfg.parallel);
    let acts = activation_set_every(local, rows, t, recompute, cfg.model.recompute_every, p).times(r.in_flight as u64);
    let policy = match recompute {
        Recompute::None => "every block's",
        Recompute::Selective => "kept per block; attention and MLP internals in one shared set",
        Recompute::Full => "block inputs only; one shared set for the block being recomputed",
    };
    let shape = if par.cp > 1 { format!("B {rows} × T {t} (this rank's positions of {}, parallel.cp = {})", cfg.seq_len(), par.cp) } else { format!("B {rows} × T {t}") };
    out.add(Kind::Activations, held, "residual stream", acts.residual, format!("{shape}; {} + 1 block boundaries", local.n_layer));
    out.add(Kind::Activations, held, "attention", acts.attention, format!("q|k|v, output, log-sum-exp ({policy})"));
    out.add(Kind::Activations, held, if local.is_moe() { "MoE layers" } else { "MLP" }, acts.mlp, if local.is_moe() { format!("routing, dispatch, experts, backward scratch ({policy})") } else { format!("hidden activations ({policy})") });
    out.add(Kind::Activations, held, "norms", acts.norms, "outputs and statistics".into());
    out.add(Kind::Activations, held, "head (logits chunk)", acts.head, format!("{} rows × {} logits at a time, and d ln_f", tensor::classifier::chunk_rows(n, local.vocab_size, p.arith), local.vocab_size));
    out.add(Kind::Activations, held, "losses, tokens", acts.losses, String::new());
    out.add(Kind::Temporary, held, "backward gradient scratch", grad_scratch(local, n), "one set shared by every block".into());
    if let Some(lo) = &r.lora {
        out.add(Kind::Temporary, held, "LoRA saved x·Aᵀ", b4((lo.adapters.len() + 1) * n * lo.rank, 4), "[B·T, r] per adapter, and one for its gradient".into());
    }
    let rope = if local.arch == model::config::Arch::Llama { 2 * local.block_size * (local.rotary_size() / 2) } else { 0 };
    // The batch's whole rows (a context-parallel rank picks its positions, with their position
    // ids, out of them).
    let batch = 2 * rows * cfg.seq_len() + if par.cp > 1 { 3 * n } else { 0 };
    out.add(Kind::Other, held, "token batch, rotary tables", b4(batch, 4) + b4(rope, 4), String::new());
    if par.cp > 1 {
        let docs = cfg.data.packing == crate::config::Packing::Documents;
        let x = parallel::cp::exchange_floats((local.n_head, local.n_kv_head, local.head_size()), rows, t, par.cp, par.cp_mode, docs);
        let what = match par.cp_mode {
            plan::policy::CpMode::Ring => "ring attention: the held and the arriving key/value blocks and their gradients",
            plan::policy::CpMode::Ulysses => "Ulysses: an all-to-all's send, receive and reassembled q|k|v",
        };
        out.add(Kind::Communication, held, "context-parallel exchange", b4(x, 4), format!("{what}, during a layer's attention"));
    }
    acts
}

/// What a step holds for a moment: ZeRO's unit buffers, the data-parallel communication
/// buffers.
fn step_rows(out: &mut Rows, cfg: &RunConfig, r: &RankShape) {
    let (dp, zero, p) = (cfg.parallel.dp.max(1), cfg.parallel.zero, &r.p);
    let (chunk, padded, units, shards) = (&r.shards.chunk, &r.padded, &r.units, &r.shards);
    let zt = zero_transient(padded, chunk, zero, r.head_unit, true);
    if zero >= 2 {
        let what = if zero == 3 { "gathered units (with the prefetched next) and unit gradient buffers" } else { "unit gradient buffers" };
        out.add(Kind::Temporary, Phase::Step, "ZeRO unit buffers", b4(zt, p.param.max(p.grad)), format!("{what}, at most at once"));
    }
    let z = cfg.parallel.zeropp.resolve(dp);
    if zero == 3 && z.any() && dp > 1 {
        // ZeRO++ (parallel::zeropp): hpZ keeps 1/G of every unit gathered in forward until its
        // backward (as int8 packets with qwZ); each quantized collective holds its packets.
        let words = |c: usize| if z.qwz { parallel::zeropp::packet_words(c, 8) } else { c };
        if z.hpz {
            let held: usize = chunk.iter().map(|&c| dp / z.node * words(c)).sum();
            out.add(Kind::Temporary, Phase::Step, "hpZ secondary partitions", b4(held, 4), format!("1/{} of every unit (node size {}), {}", z.node, z.node, if z.qwz { "int8 packets" } else { "fp32" }));
        }
        let c = chunk.iter().copied().max().unwrap_or(0);
        let gather = if z.qwz { 2 * dp * words(c) } else { 0 };
        let reduce = z.qgz.map_or(0, |bits| 2 * z.node * parallel::zeropp::packet_words(dp / z.node * c, bits) + 2 * (dp / z.node) * c);
        out.add(Kind::Temporary, Phase::Step, "ZeRO++ packets", b4(gather.max(reduce), 4), "the largest unit's quantized all-gather or reduce-scatter buffers".into());
    }
    let max_pad = padded.iter().copied().max().unwrap_or(0);
    let comm = if dp == 1 {
        0
    } else {
        match zero {
            // The bucket all-reduce works in place (the in-process backend through a stack block).
            0 => 0,
            // Each bucketed unit's reduce-scatter pads a copy to `dp` chunks; after the update
            // every unit's chunk is copied out and gathered into a padded unit.
            1 => {
                let rs = (0..units.len()).map(|u| if units[u].len() == padded[u] { chunk[u] } else { padded[u] + chunk[u] }).max().unwrap_or(0);
                rs.max(shards.len + max_pad)
            }
            2 => shards.len + max_pad,
            _ => 0,
        }
    };
    if dp > 1 {
        let what = match zero {
            0 => "the bucket all-reduce runs in place".to_string(),
            1 | 2 => format!("the parameter all-gather after the update: {} chunk copies and one padded unit", shards.len),
            _ => "gathers land in the ZeRO unit buffers".to_string(),
        };
        out.add(Kind::Communication, Phase::Step, "data-parallel buffers", b4(comm, p.param), what);
    }
}

/// Evaluation: a batch of eval.batch_size sequences (default the micro-batch) per rank.
/// Returns (its activations when they replace the training set's, the extra bytes).
fn eval_rows(out: &mut Rows, cfg: &RunConfig, r: &RankShape) -> (Option<u64>, u64) {
    let (t, mb, zero, p) = (r.t, cfg.micro_batch(), cfg.parallel.zero, &r.p);
    let eb = if cfg.eval.batch_size == 0 { mb } else { cfg.eval.batch_size };
    let realloc = eb != r.rows;
    let eval_acts = realloc.then(|| activation_set_every(&r.local, eb, t, cfg.model.recompute, cfg.model.recompute_every, p).total());
    let eval_zero = zero_transient(&r.padded, &r.shards.chunk, zero, r.head_unit, false);
    let eval_extra = b4(2 * eb * cfg.seq_len(), 4) + if zero == 3 { b4(eval_zero, p.param) } else { 0 };
    if let Some(a) = eval_acts {
        out.add(Kind::Activations, Phase::Eval, "evaluation activations", a, format!("B {eb} × T {t} (eval.batch_size), in place of the training set and scratch"));
    }
    out.add(Kind::Other, Phase::Eval, "evaluation batch, gathers", eval_extra, String::new());
    (eval_acts, eval_extra)
}

/// Checkpoints: rank 0 (and every rank when the run is sharded over ranks) copies the
/// trainable parameters and both moments into snapshot buffers, kept for the next one; with
/// ZeRO or tensor parallelism the whole tensors are first gathered on every rank. Returns (the
/// snapshot's elements, how many are kept, the gathers' elements).
fn checkpoint_rows(out: &mut Rows, cfg: &RunConfig, gpt: &GptConfig, r: &RankShape) -> (usize, usize, usize) {
    let par = &cfg.parallel;
    let (dp, tp, zero, p) = (par.dp.max(1), par.tp, par.zero, &r.p);
    let world = par.world(dp);
    let lora_run = r.lora.is_some();
    let (whole_layout, _) = model::layout::gpt_layout(gpt);
    let parts = world > 1 && !lora_run;
    let snap = match &r.lora {
        Some(lo) => 3 * lo.layout.total,
        None if parts => 3 * whole_layout.params.iter().map(|q| crate::checkpoint::part_range(q.len(), 0, world).len()).sum::<usize>(),
        None => 3 * whole_layout.total,
    };
    // 1-bit Adam: each rank's error feedback too.
    let snap = snap + match par.compression {
        crate::config::Compression::OnebitAdam => parallel::compress::OneBit::state_len(whole_layout.total, dp),
        // Its row also carries the rank's momentum.
        crate::config::Compression::ZerooneAdam => crate::step::ZeroOneState::state_len(whole_layout.total, dp) + whole_layout.total,
        crate::config::Compression::PowerSgd => {
            let tensors = parallel::compress::PowerSgd::tensors(&whole_layout);
            let (err, q, _) = parallel::compress::PowerSgd::sizes(&tensors, par.powersgd_rank);
            err + q
        }
        crate::config::Compression::None => 0,
    };
    let snapshots = if cfg.checkpoint.memory_interval > 0 { 3 } else { 1 };
    out.add(Kind::Other, Phase::Checkpoint, "checkpoint snapshot", snapshots as u64 * b4(snap, p.param), format!("parameters and both moments{}; kept from the first checkpoint on{}", if parts { format!(", this rank's 1/{world} part") } else { String::new() }, if cfg.checkpoint.memory_interval > 0 { " (×3 with in-memory checkpoints: latest, previous, the peer's copy)" } else { "" }));
    let plain = tp == 1 && zero == 0;
    let gather = if lora_run || plain {
        0
    } else {
        let one = if zero > 0 { r.shards.len * (dp + 1) } else { 0 } + if tp > 1 { tp * r.total } else { 0 };
        3 * whole_layout.total + one
    };
    if gather > 0 {
        out.add(Kind::Communication, Phase::Checkpoint, "checkpoint gathers", b4(gather, p.param), "whole parameters and moments, gathered from the shards".into());
    }
    (snap, snapshots, gather)
}

/// The plan of pipeline rank `s` (with no pipeline, every rank's).
fn plan_rank(cfg: &RunConfig, gpt: &GptConfig, data_bytes: u64, s: usize) -> Result<MemoryPlan> {
    let r = RankShape::new(cfg, gpt, s)?;
    let p = r.p;
    let par = &cfg.parallel;
    let (dp, tp, pp, zero) = (par.dp.max(1), par.tp, par.pp, par.zero);
    let world = par.world(dp);
    let mut out = Rows(Vec::new());
    model_state_rows(&mut out, cfg, &r, s);
    let acts = activation_rows(&mut out, cfg, &r);
    step_rows(&mut out, cfg, &r);
    let (eval_acts, eval_extra) = eval_rows(&mut out, cfg, &r);
    let (snap, snapshots, gather) = checkpoint_rows(&mut out, cfg, gpt, &r);
    let out = out.0;

    let sum = |f: &dyn Fn(&Row) -> bool| out.iter().filter(|r| f(r)).map(|r| r.bytes).sum::<u64>();
    let held_bytes = sum(&|r| r.phase == Phase::Held);
    // The step's transients come at different moments (ZeRO-2's unit buffers are gone by the
    // time the parameters are gathered after the update): the largest, not their sum.
    let step_peak = held_bytes + out.iter().filter(|r| r.phase == Phase::Step).map(|r| r.bytes).max().unwrap_or(0);
    let scratch = grad_scratch(&r.local, r.n);
    let eval_peak = match eval_acts {
        Some(a) => held_bytes - acts.total() - scratch + a,
        None => held_bytes,
    } + eval_extra;
    let snapshot = b4(snap, p.param);
    let checkpoint_peak = held_bytes + snapshots as u64 * snapshot + b4(gather, p.param);
    // Snapshot buffers are kept for the next checkpoint: from a checkpoint before the last step
    // on, steps and evaluations hold them too.
    let ck = &cfg.checkpoint;
    let mid_run = (ck.interval > 0 && ck.interval < cfg.train.max_steps) || ck.mtbf_s > 0.0;
    // In-memory checkpoints keep three: the latest (this rank's in-memory copy), the one
    // before (the next snapshot's buffers) and the previous rank's copy.
    let kept = if mid_run || ck.memory_interval > 0 { snapshots as u64 * snapshot } else { 0 };
    let (whole_layout, _) = model::layout::gpt_layout(gpt);
    let base = std::path::Path::new(&cfg.model.init_from);
    let hf = !cfg.model.init_from.is_empty() && !base.join("config.toml").exists() && cfg.lora.quantize_base == model::BaseQuant::None;
    let load_peak = match hf {
        true => guard::load_bytes(4 * whole_layout.total as u128, model::hf::TensorReader::open(base).map_or(0, |r| r.scratch_bytes()) as u128, cfg.lora.rank > 0) as u64,
        false => 0,
    };
    let total_peak = (step_peak + kept).max(eval_peak + kept).max(checkpoint_peak).max(load_peak);
    let layout_line = format!(
        "{} | {} layers, {} params{} | dp {dp} × tp {tp}{}{}, ZeRO {zero} | recompute {} | micro-batch {} × {} per rank | {}{}",
        cfg.preset, gpt.n_layer, fmt_count(whole_layout.total), if r.lora.is_some() { " (LoRA)" } else { "" },
        if par.cp > 1 { format!(" × cp {} ({}, {})", par.cp, plan::policy::Names::name(par.cp_mode), plan::policy::Names::name(par.cp_balance)) } else { String::new() },
        if pp > 1 { format!(" × pp {pp} (rank {s}: stage layers {:?}, {} micro-batch activation sets in flight, {})", r.stages[s], r.in_flight, par.schedule.name()) } else { String::new() }, cfg.model.recompute.name(), r.rows, r.t, p.name,
        if cfg.memory.offload == crate::config::Offload::Optimizer { " | optimizer offloaded" } else { "" },
    );
    let ranks_per_process = if par.backend == crate::config::Backend::Mpi { 1 } else { world };
    Ok(MemoryPlan { precision: p, rows: out, step_peak, eval_peak, checkpoint_peak, load_peak, total: total_peak, ranks_per_process, ranks_sum: None, data_bytes, limit: cfg.memory_limit(), layout: layout_line })
}

/// The plan of a training run: the model as `kiln train` builds it (its vocabulary from the
/// tokenizer) and the `data_bytes` of tokens it holds in memory (`TrainData::in_memory_bytes`).
pub fn plan_run(cfg: &RunConfig, gpt: &GptConfig, data_bytes: u64) -> Result<MemoryPlan> {
    plan(cfg, gpt, data_bytes)
}

/// Refuses (exit 2) a config too large even to plan — building its layout would itself
/// exhaust memory — from its sizes alone: the fp32 weights and one batch's residual stream
/// through every layer, spread over the ranks, are a floor under any plan. Against the
/// machine's available memory for this process's ranks and data, or a `memory.limit` above it
/// per rank (a smaller limit is left to the plan, whose refusal prints the table). Returns the
/// budget the plan is held to.
pub fn check_sizes(cfg: &RunConfig, gpt: &GptConfig, data_bytes: u64) -> Result<guard::Budget> {
    let budget = guard::Budget::of(cfg.memory_limit());
    let machine = if budget.explicit { guard::Budget::of(0) } else { budget.clone() };
    let par = &cfg.parallel;
    let world = par.world(par.dp.max(1)) as u128;
    let in_process = if par.backend == crate::config::Backend::Mpi { 1 } else { world };
    let floor = (guard::weight_bytes(gpt) + guard::activation_floor(gpt, cfg.micro_batch(), cfg.seq_len())) / world;
    let cause = format!("{}; one batch of {} rows × {} positions: train.batch_size / train.grad_accum, train.seq_len", guard::shape_keys(gpt), cfg.micro_batch(), cfg.seq_len());
    if budget.explicit && budget.bytes > machine.bytes {
        budget.check("one rank of this run (its weights and activations alone)", floor, &cause)?;
    } else {
        machine.check("this run (its weights and activations alone)", floor * in_process + data_bytes as u128, &cause)?;
    }
    Ok(budget)
}

/// Headroom over the plan when it is held to the machine's available memory (not to an explicit
/// `memory.limit`): what the plan does not count (the allocator's slack, the program and its
/// libraries, thread stacks) is a few percent of a large run's peak RSS; a 620M-parameter
/// LLaMA run planned at 22.6 GiB, let through at 22.9 GiB available, was killed for memory.
pub const HEADROOM_PERCENT: u64 = 5;

/// The plan of a run, refused (exit 2) when it exceeds what the process may use:
/// `memory.limit` per rank when set, else the machine's available memory for this process's
/// ranks and data. Sizes are checked first ([`check_sizes`]).
pub fn plan_checked(cfg: &RunConfig, gpt: &GptConfig, data_bytes: u64) -> Result<MemoryPlan> {
    let budget = check_sizes(cfg, gpt, data_bytes)?;
    let plan = plan_run(cfg, gpt, data_bytes)?;
    plan.check_budget(&budget)?;
    Ok(plan)
}

impl MemoryPlan {
    /// Refuses the plan past `budget`: per rank against `memory.limit` (with the table), else
    /// the process's ranks and data, with [`HEADROOM_PERCENT`] over the plan, against the memory
    /// available.
    pub fn check_budget(&self, budget: &guard::Budget) -> Result<()> {
        if budget.explicit {
            return self.check_limit();
        }
        let cause = format!(
            "the memory plan: {} rank(s) of {} each, data {}, and {} % headroom for what it does not count; `kiln memory` prints it",
            self.ranks_per_process,
            fmt_bytes(self.total),
            fmt_bytes(self.data_bytes),
            HEADROOM_PERCENT
        );
        budget.check("this run", self.process_total() as u128 * (100 + HEADROOM_PERCENT) as u128 / 100, &cause)
    }

    /// What the process holds: its ranks and the data once.
    pub fn process_total(&self) -> u64 {
        self.ranks_sum.map_or(self.ranks_per_process as u64 * self.total, |s| s.0) + self.data_bytes
    }

    /// The process's ranks' step peaks together, with the data.
    pub fn process_step_peak(&self) -> u64 {
        self.ranks_sum.map_or(self.ranks_per_process as u64 * self.step_peak, |s| s.1) + self.data_bytes
    }

    /// The per-rank table, one line per row, then the peaks.
    pub fn table(&self) -> String {
        let mut s = format!("memory plan (per rank): {}\n", self.layout);
        let phase = |p: Phase| match p {
            Phase::Held => "",
            Phase::Step => " [step]",
            Phase::Eval => " [eval]",
            Phase::Checkpoint => " [checkpoint]",
        };
        for r in &self.rows {
            let label = if r.name == r.kind.name() { format!("{}{}", r.name, phase(r.phase)) } else { format!("{} · {}{}", r.kind.name(), r.name, phase(r.phase)) };
            let detail = if r.detail.is_empty() { String::new() } else { format!("  {}", r.detail) };
            s.push_str(&format!("  {label:<52} {:>11}{detail}\n", fmt_bytes(r.bytes)));
        }
        let line = |s: &mut String, what: &str, b: u64| s.push_str(&format!("  {what:<52} {:>11}\n", fmt_bytes(b)));
        line(&mut s, "peak of a training step", self.step_peak);
        line(&mut s, "peak of an evaluation", self.eval_peak);
        line(&mut s, "peak of a checkpoint", self.checkpoint_peak);
        if self.load_peak > 0 {
            line(&mut s, "peak of loading the base (weights + its largest tensor read and widened, or + gradients)", self.load_peak);
        }
        line(&mut s, "total per rank (the run's peak)", self.total);
        if self.ranks_per_process > 1 || self.data_bytes > 0 {
            line(&mut s, &format!("process: {} rank(s) + data in memory ({})", self.ranks_per_process, fmt_bytes(self.data_bytes)), self.process_total());
        }
        if self.limit > 0 {
            line(&mut s, "memory.limit", self.limit);
        }
        s
    }

    pub fn to_json(&self) -> serde_json::Value {
        let rows: Vec<serde_json::Value> = self
            .rows
            .iter()
            .map(|r| {
                let phase = format!("{:?}", r.phase).to_lowercase();
                json!({"kind": r.kind.name(), "name": r.name, "phase": phase, "bytes": r.bytes, "tracked_as": r.kind.tracked().name(), "detail": r.detail})
            })
            .collect();
        json!({
            "layout": self.layout, "precision": self.precision.name, "rows": rows,
            "step_peak_bytes": self.step_peak, "eval_peak_bytes": self.eval_peak, "checkpoint_peak_bytes": self.checkpoint_peak, "load_peak_bytes": self.load_peak,
            "total_bytes": self.total, "ranks_per_process": self.ranks_per_process, "data_bytes": self.data_bytes,
            "process_total_bytes": self.process_total(), "process_step_peak_bytes": self.process_step_peak(), "limit_bytes": self.limit,
        })
    }

    /// A user error when the per-rank total exceeds `memory.limit` (with the table).
    pub fn check_limit(&self) -> Result<()> {
        if self.limit > 0 && self.total > self.limit {
            return user(format!(
                "the memory plan needs {} per rank, more than memory.limit = {}: lower the batch, recompute (model.recompute), shard (parallel.zero, parallel.dp, parallel.tp) or offload (memory.offload)\n{}",
                fmt_bytes(self.total), fmt_bytes(self.limit), self.table().trim_end()
            ));
        }
        Ok(())
    }
}

/// `1.23 GiB`, `456.7 MiB`, `12.0 KiB`, `512 B`.
pub fn fmt_bytes(b: u64) -> String {
    let x = b as f64;
    let k = 1024.0;
    if x >= k * k * k {
        format!("{:.2} GiB", x / (k * k * k))
    } else if x >= k * k {
        format!("{:.1} MiB", x / (k * k))
    } else if x >= k {
        format!("{:.1} KiB", x / k)
    } else {
        format!("{b} B")
    }
}

fn fmt_count(n: usize) -> String {
    if n >= 1_000_000 { format!("{:.2}M", n as f64 / 1e6) } else { format!("{n}") }
}

/// Moves the trainer's model-state buffers to their tracking categories (parameters,
/// gradients, moments), once the data-parallel store holds them: they were allocated before
/// their owners were known (the model's constructor allocates both its buffers).
pub fn attribute(model: &model::Gpt, dp: &mut parallel::DataParallel, opt: &crate::step::Optimizer) {
    use track::{retag_raw, retag_vec, Category};
    if !track::active() {
        return;
    }
    let (zero, len) = (dp.zero, dp.shards.len);
    let total = dp.shards.units.last().map_or(0, |u| u.end);
    let mut first = true;
    dp.for_each_piece(|piece, params, grads| {
        if !std::mem::take(&mut first) {
            return;
        }
        // A piece's slices start `flat.start` into the full buffers, `shard.start` into shards.
        let base = |s: &[f32], sharded: bool| s.as_ptr().wrapping_sub(if sharded { piece.shard.start } else { piece.flat.start }) as *const u8;
        // SAFETY: each base is the start of the store's buffer of that many elements.
        unsafe {
            retag_raw(base(params, zero == 3), 4 * if zero == 3 { len } else { total }, Category::Params);
            // (A frozen base, LoRA, holds no gradient buffer.)
            if !grads.is_empty() {
                retag_raw(base(grads, zero >= 2), 4 * if zero >= 2 { len } else { total }, Category::Grads);
            }
        }
    });
    if let Some(lo) = &model.lora {
        retag_vec(&lo.params, Category::Params);
        retag_vec(&lo.grads, Category::Grads);
    }
    for (ptr, bytes) in opt.lean_buffers() {
        // SAFETY: each is a live Vec's allocation.
        unsafe { retag_raw(ptr, bytes, Category::Optimizer) };
    }
    for m in [&opt.m, &opt.v] {
        if let crate::step::Moments::Mem(v) = m {
            retag_vec(v, Category::Optimizer);
        }
    }
    if let Some(f) = &opt.factored {
        retag_vec(&f.state, Category::Optimizer);
    }
}

