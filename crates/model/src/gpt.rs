//! The GPT-2 decoder (Radford et al. 2019; nanoGPT's `model.py`), pre-LayerNorm:
//!
//! ```text
//! x = drop(wte[tokens] + wpe[pos])          pos = 0..T, or per token (packed documents)
//! for each block:  x = x + drop(attn(ln_1(x)));  x = x + drop(mlp(ln_2(x)))
//! logits = ln_f(x) · headᵀ;   loss = mean cross-entropy(logits, targets)
//! ```
//!
//! A row may pack several documents ([`Docs`]): attention then never crosses a document
//! boundary and positions (`wpe`, rope) may restart per document.
//!
//! Forward keeps every activation backward needs, in buffers sized once per `(B, T)` — or,
//! under a [`Recompute`] policy, only part of them (each block's input, for `Full`), and
//! backward re-runs the rest of each block's forward, block by block, into one shared set.
//! Backward walks the same steps in reverse, accumulating parameter gradients into `grads`
//! (one flat buffer with the parameter layout), so gradient accumulation over micro-batches
//! is a matter of not zeroing `grads` between them.

use crate::config::{Arch, GateAct, GptConfig};
use crate::lora::{Lora, Site};
use tensor::moe::{moe_backward, moe_forward, MoeCache, MoeExchange, MoeGrads, MoeInputs, MoeLossWeights, MoeStats};
use crate::layout::{gpt_layout, BlockParams, GptParams, Init, ParamLayout};
use crate::units::{Access, CpHooks, Local, TpHooks, UnitStore};
use std::cell::RefCell;
use std::ops::Range;
use tensor::attention::AttnDims;
use tensor::classifier::{chunk_rows, lm_head_crossentropy, lm_head_crossentropy_vocab_parallel, Dloss, HeadDims};
use tensor::ops::{dropout_backward_rows, dropout_inplace_rows, Chunks, RowMap};
use tensor::flash::{flash_attention_backward_docs, flash_attention_forward_docs, flash_gqa_backward_docs, flash_gqa_forward_docs};
use tensor::llama::{qk_rmsnorm_backward, qk_rmsnorm_forward, rmsnorm_backward, rmsnorm_forward, rope_backward, rope_backward_pos, rope_forward, rope_forward_pos, swiglu_backward_into, swiglu_forward, GqaDims};
use tensor::rng::mix64;
use tensor::*;

/// Targets equal to this are ignored by the loss (PyTorch's default `ignore_index`).
pub const IGNORE_INDEX: i32 = -100;

/// The documents packed into a batch's rows, per token of the flat `[B, T]`: `start[b·T + i]`
/// is the index within row `b` of the first token of token `i`'s document (non-decreasing along
/// a row, `start[i] ≤ i`), `pos[b·T + i]` its position id, which rope or GPT-2's `wpe` use
/// instead of `i` (`i − start[i]` when positions restart per document, `i` when not; any value
/// below `block_size`). Attention (FlashAttention's tile loops, see `tensor::flash`) never
/// crosses a document boundary: query `i` attends keys `start[i] ..= i` (within its sliding
/// window, if any).
#[derive(Clone, Copy, Debug)]
pub struct Docs<'a> {
    pub start: &'a [u32], // [B, T] (empty only inside a context-parallel part: plain causal rows)
    pub pos: &'a [u32],   // [B, T]
}

impl Docs<'_> {
    /// Panics, naming the token, unless the layout fits `[B, T]` and `block_size`.
    pub(crate) fn check(&self, b: usize, t: usize, block_size: usize) {
        assert!(self.start.len() == b * t && self.pos.len() == b * t, "docs.start ({}) and docs.pos ({}) must have B·T = {} entries", self.start.len(), self.pos.len(), b * t);
        for (k, (&s, &p)) in self.start.iter().zip(self.pos).enumerate() {
            let (row, i) = (k / t, k % t);
            assert!((p as usize) < block_size, "docs.pos of token {i} in row {row} is {p}, not below block_size {block_size}");
            let prev = if i == 0 { 0 } else { self.start[k - 1] };
            assert!(s as usize <= i && s >= prev, "docs.start of token {i} in row {row} is {s}: starts must satisfy start[i] <= i and be non-decreasing along a row");
        }
    }
}

/// What a forward pass is for.
#[derive(Clone, Copy, Debug)]
pub enum Pass {
    /// Loss only: no dropout, no gradients touched.
    Eval,
    /// Training: dropout masks from `dropout_seed`; the mean loss's gradient is scaled by
    /// `loss_scale` (1/grad_accum). The fused LM head accumulates its weight gradient here, in
    /// forward; `backward` does the rest.
    Train { dropout_seed: u64, loss_scale: f32 },
}

/// Activation recomputation, the one definition in `plan::policy`. Here: `Selective` keeps
/// everything but the attention core's outputs (the attention output and its log-sum-exp) and
/// backward re-runs the attention core (FlashAttention's forward) from the kept q|k|v into one
/// shared set (with FlashAttention the core keeps no `T×T` scores anyway, so this saves `C`
/// floats per token and layer of `None`'s `16C`). `Full` keeps only each block's input (the
/// residual stream entering it) and the final norm's; backward re-runs each block's forward from
/// its saved input into one shared set of block buffers, then differentiates it. The same kernels
/// run in the same order on the same inputs, and dropout masks are counter-based, so the loss and
/// every gradient are bit-identical to `None` (for `Selective` too); the price is one more block
/// forward per step (less the MLP output projection, whose result backward does not read). LoRA
/// adapters keep their `x·Aᵀ` per layer and site, so re-running re-saves the same values; the
/// MoE routing statistics reported are those of the forward pass.
pub use plan::policy::Recompute;

/// The number format tensors are stored in (mixed precision; Micikevicius et al. 2018), the one
/// definition in `plan::policy`: the parameters the passes read (the optimizer keeps fp32 master
/// weights and rounds them into the working copy), every stored activation and activation
/// gradient are rounded to it ([`storage`]), while matmuls and reductions accumulate in fp32 and
/// weight gradients accumulate in fp32 (Megatron's main gradients). `Fp8` stores in bf16 and
/// casts each block matmul's inputs to FP8 (E4M3 for activations and weights, E5M2 for
/// gradients) with per-tensor delayed scaling ([`Fp8State`]). Simulated on CPU: the buffers stay
/// `f32`, the values are exactly the format's.
pub use plan::policy::Precision;
pub use plan::policy::BaseQuant;

/// The storage format of parameters, activations and their gradients when training in `p`.
pub fn storage(p: Precision) -> Option<tensor::precision::Format> {
    use tensor::precision::Format;
    match p {
        Precision::Fp32 => None,
        Precision::Bf16 | Precision::Fp8 => Some(Format::Bf16),
        Precision::Fp16 => Some(Format::Fp16),
    }
}

/// The arithmetic of the block projections and the LM head when training in `p`: bf16 products
/// (fp32 accumulation) for bf16 where the CPU has BF16 instructions; fp32 for fp16 (these CPUs
/// have no fp16 products), for FP8 (whose scaled casts are not bf16 values) and for bf16
/// without BF16 instructions — there every product input but the head's logit gradient is
/// already a stored, rounded bf16 value, so fp32 products over them are the bf16 products
/// (converted on pack) without the conversion pass, which measured 0.80× fp32's speed here.
pub fn arith(p: Precision) -> tensor::matmul::Arith {
    match p {
        Precision::Bf16 if tensor::bf16::path() == tensor::bf16::Path::Avx512Bf16 => tensor::matmul::Arith::Bf16,
        _ => tensor::matmul::Arith::F32,
    }
}

/// Block matmuls: q|k|v, attention output, MLP up (and gate), MLP down.
const FP8_SITES: usize = 4;

/// FP8 delayed scaling (Transformer Engine's recipe, as FP8-LM uses it): every block matmul's
/// input, weight and output gradient has a per-tensor scale `amax / fmt_max`, where `amax` is the
/// largest magnitude over the last `len` steps' history (the current tensor's own amax while the
/// history is empty). A step's amaxes are collected in `pending` (a recomputation sees the same
/// tensors, so it records the same values), reduced over the data-parallel ranks by the caller
/// and appended by [`Gpt::fp8_commit`]: the scales are the same on every rank and for every
/// micro-batch of a step.
#[derive(Clone, Debug)]
pub struct Fp8State {
    hist: Vec<std::collections::VecDeque<f32>>,
    pending: Vec<f32>,
    len: usize,
    scratch: [Vec<f32>; 3],
}

impl Fp8State {
    pub fn new(n_layer: usize, len: usize) -> Fp8State {
        let k = n_layer * FP8_SITES * 3;
        Fp8State { hist: vec![std::collections::VecDeque::new(); k], pending: vec![0.0; k], len: len.max(1), scratch: Default::default() }
    }

    fn slot(l: usize, site: usize, role: usize) -> usize {
        (l * FP8_SITES + site) * 3 + role
    }

    /// Casts `x` (tensor `slot`) to `fmt` into scratch buffer `k`, recording its amax.
    /// `whole` turns a shard's amax into the whole tensor's (tensor parallelism: the max over
    /// the shards; a collective, needed only before the first step has filled the history).
    fn cast(&mut self, slot: usize, k: usize, x: &[f32], fmt: tensor::precision::Format, whole: &dyn Fn(f32) -> f32) -> &[f32] {
        let scale = |amax: f32| if amax > 0.0 && amax.is_finite() { amax / fmt.max() } else { 1.0 };
        let buf = &mut self.scratch[k];
        buf.resize(x.len(), 0.0);
        // Delayed scaling: the scale comes from the history, and this tensor's amax (for the
        // history) from the same pass as the cast; with no history yet, from this tensor.
        let a = if self.hist[slot].is_empty() {
            let a = whole(tensor::precision::amax(x));
            tensor::precision::quantize_into(buf, x, fmt, scale(a));
            a
        } else {
            let h = self.hist[slot].iter().copied().fold(0.0f32, f32::max);
            tensor::precision::quantize_into(buf, x, fmt, scale(h))
        };
        self.pending[slot] = self.pending[slot].max(a);
        &self.scratch[k]
    }

    /// This step's amaxes (to be reduced over data-parallel ranks, elementwise max).
    pub fn pending_mut(&mut self) -> &mut [f32] {
        &mut self.pending
    }

    /// Appends the step's amaxes to the histories and clears them.
    pub fn commit(&mut self) {
        for (h, p) in self.hist.iter_mut().zip(self.pending.iter_mut()) {
            h.push_back(std::mem::take(p));
            while h.len() > self.len {
                h.pop_front();
            }
        }
    }

    /// The histories, for checkpoints.
    pub fn history(&self) -> Vec<Vec<f32>> {
        self.hist.iter().map(|h| h.iter().copied().collect()).collect()
    }

    pub fn set_history(&mut self, h: &[Vec<f32>]) {
        for (d, s) in self.hist.iter_mut().zip(h) {
            *d = s.iter().copied().collect();
        }
    }

    /// The histories of tensor slots `[first_layer · k, …)` of a whole model's `whole` (a
    /// pipeline stage's layers, `k` slots per layer).
    pub fn set_history_from_layer(&mut self, whole: &[Vec<f32>], first_layer: usize) {
        let k = FP8_SITES * 3;
        self.set_history(&whole[(first_layer * k).min(whole.len())..]);
    }
}

/// The activations of one block for one `(B, T)` that [`Recompute::Selective`] keeps: the norms'
/// outputs and statistics and the residual between the branches. The block's input and output
/// live in `Acts::xs`; the branch outputs (projection after dropout), which backward never
/// reads, in the one `Acts::branch`.
struct BlockKept {
    ln_1: Vec<f32>,      // [B, T, C]
    ln_1_mean: Vec<f32>, // [B, T]
    ln_1_rstd: Vec<f32>, // [B, T]
    res_2: Vec<f32>,     // [B, T, C]  x + attn branch
    ln_2: Vec<f32>,
    ln_2_mean: Vec<f32>,
    ln_2_rstd: Vec<f32>,
}

/// The attention core's outputs — what [`Recompute::Selective`] recomputes (into one shared
/// set) from the kept q|k|v.
struct AttnCore {
    atty: Vec<f32>,  // [B, T, C]
    state: Vec<f32>, // lse [B, NH, T]: FlashAttention (MHA for GPT-2, GQA for LLaMA) keeps no T×T matrix
}

/// A block's attention internals and MLP hidden activations, which `Full` recomputes in
/// backward into one shared set.
struct BlockInner {
    qkv: Vec<f32>,       // [B, T, (NH + 2·NKV)·HS]  (LLaMA: q and k after the rotary embedding)
    /// Empty under [`Recompute::Selective`] (the shared [`Acts::core`] is used).
    core: AttnCore,
    fch: Vec<f32>,       // [B, T, F] (GPT-2) or [B, T, 2F] (LLaMA: gate | up)
    fch_gelu: Vec<f32>,  // [B, T, F]  after GELU or SwiGLU
    moe: Option<MoeCache>, // routing, dispatch and expert activations of an MoE layer
    /// Sequence parallel: the norms' outputs gathered along the sequence, `[B, T, C]` (the
    /// column-parallel products' inputs); empty otherwise.
    ln_1_full: Vec<f32>,
    ln_2_full: Vec<f32>,
    /// Qwen3's per-head norms (`qk_norm`): their inputs `[q: N·NH·HS | k: N·NKV·HS]` and
    /// `rstd` `[q: N·NH | k: N·NKV]`; empty otherwise.
    qk_pre: Vec<f32>,
    qk_rstd: Vec<f32>,
    /// Norms after the branches (`model.block_norms = post | sandwich`): their inputs, the
    /// attention branch's then the MLP's (`[2, B, T, C]`, rows of the residual stream), and
    /// their `rstd` (`[2, B, T]`); empty otherwise.
    post_in: Vec<f32>,
    post_rstd: Vec<f32>,
    /// Multi-head latent attention's front end (empty without it).
    mla: crate::mla::MlaActs,
}

impl BlockKept {
    /// The buffers holding values rounded to the storage format, and the fp32 statistics.
    fn parts(&mut self) -> ([&mut Vec<f32>; 3], [&mut Vec<f32>; 4]) {
        ([&mut self.ln_1, &mut self.res_2, &mut self.ln_2], [&mut self.ln_1_mean, &mut self.ln_1_rstd, &mut self.ln_2_mean, &mut self.ln_2_rstd])
    }
}

impl BlockInner {
    /// As [`BlockKept::parts`] (an MoE layer's cache is stashed on its own, see [`Stash::put`]).
    fn parts(&mut self) -> ([&mut Vec<f32>; 13], [&mut Vec<f32>; 5]) {
        let ([m0, m1, m2, m3, m4], [s0, s1]) = self.mla.parts();
        (
            [&mut self.qkv, &mut self.core.atty, &mut self.fch, &mut self.fch_gelu, &mut self.ln_1_full, &mut self.ln_2_full, &mut self.qk_pre, &mut self.post_in, m0, m1, m2, m3, m4],
            [&mut self.core.state, &mut self.qk_rstd, &mut self.post_rstd, s0, s1],
        )
    }
}

/// How a block's kept activations are stored between its forward and backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StashFormat {
    /// As 16 bits (bf16 or fp16 training): lossless, the values are already rounded to it.
    Half(tensor::precision::Format),
    /// Compressed to `bits`-bit integers per group with scales (`tensor::quant`), rounded to
    /// the nearest code or stochastically: lossy.
    Int { bits: u32, stochastic: bool },
}

/// Stored activations (16-bit training or activation compression, without full
/// recomputation): every block computes in one fp32 working set (slot 0 of `Acts::kept` /
/// `Acts::inner`) and, after its forward, leaves its activations here — the bulk ones as 16
/// bits or compressed codes, the norms' and attention's fp32 statistics as they are — to be
/// put back before its backward. 16 bits are lossless (the values are already rounded to the
/// format), so a run is bit for bit the run without it; compressed codes are not.
struct Stash {
    fmt: StashFormat,
    /// Per layer: the 16-bit values, or the compressed codes and their group scales (each part
    /// compressed on its own), and the fp32 statistics, in [`BlockKept::parts`] then
    /// [`BlockInner::parts`] order.
    half: Vec<Vec<u16>>,
    codes: Vec<Vec<u8>>,
    scales: Vec<Vec<f32>>,
    full: Vec<Vec<f32>>,
    /// Compressed formats also keep each block's input (the residual stream entering it) as
    /// codes and scales; the stream then runs through two fp32 buffers (`Acts::xs`).
    res_codes: Vec<Vec<u8>>,
    res_scales: Vec<Vec<f32>>,
    /// Mixture-of-experts layers (compressed formats only): per layer its routing state,
    /// exact, and the expert activations backward reads as codes and scales (their sizes
    /// follow each step's routing).
    moe: Vec<MoeStash>,
}

/// One MoE layer's share of a [`Stash`].
struct MoeStash {
    routing: tensor::moe::MoeRouting,
    codes: Vec<u8>,
    scales: Vec<f32>,
}

impl MoeStash {
    /// Room for a layer with every token-assignment kept (what the memory plan counts; a
    /// step that keeps more rows on an expert owner grows it).
    fn with_room(cache: &MoeCache, bits: u32) -> MoeStash {
        let mut routing = tensor::moe::MoeRouting::default();
        cache.save_routing(&mut routing);
        let lens = MoeCache::kept_lens(&cache.dims);
        let codes = lens.iter().map(|&n| n.div_ceil(if bits == 4 { 2 } else { 1 })).sum();
        let scales = lens.iter().map(|&n| n.div_ceil(tensor::quant::ACT_GROUP)).sum();
        MoeStash { routing, codes: vec![0; codes], scales: zeros(scales) }
    }

    fn bytes(&self) -> usize {
        self.routing.bytes() + self.codes.capacity() + 4 * self.scales.capacity()
    }
}

impl Stash {
    fn new(fmt: StashFormat, layers: usize, k: &mut BlockKept, i: &mut BlockInner) -> Stash {
        let (kh, kf) = k.parts();
        let (ih, if_) = i.parts();
        let lens: Vec<usize> = kh.iter().chain(ih.iter()).map(|v| v.len()).collect();
        let nf: usize = kf.iter().map(|v| v.len()).sum::<usize>() + if_.iter().map(|v| v.len()).sum::<usize>();
        let (nh, nc, ns) = match fmt {
            StashFormat::Half(_) => (lens.iter().sum(), 0, 0),
            StashFormat::Int { bits, .. } => (0, lens.iter().map(|&n| n.div_ceil(if bits == 4 { 2 } else { 1 })).sum(), lens.iter().map(|&n| n.div_ceil(tensor::quant::ACT_GROUP)).sum()),
        };
        let per = |n: usize| -> Vec<usize> { if n == 0 { Vec::new() } else { vec![n; layers] } };
        Stash {
            fmt,
            half: per(nh).into_iter().map(|n| vec![0; n]).collect(),
            codes: per(nc).into_iter().map(|n| vec![0; n]).collect(),
            scales: per(ns).into_iter().map(zeros).collect(),
            full: (0..layers).map(|_| zeros(nf)).collect(),
            res_codes: Vec::new(),
            res_scales: Vec::new(),
            moe: match (&i.moe, fmt) {
                (Some(cache), StashFormat::Int { bits, .. }) => (0..layers).map(|_| MoeStash::with_room(cache, bits)).collect(),
                _ => Vec::new(),
            },
        }
    }

    /// Room for every block's input of `n` floats, compressed (compressed formats only).
    fn with_residual(mut self, layers: usize, n: usize) -> Stash {
        if let StashFormat::Int { bits, .. } = self.fmt {
            self.res_codes = (0..layers).map(|_| vec![0; n.div_ceil(if bits == 4 { 2 } else { 1 })]).collect();
            self.res_scales = (0..layers).map(|_| zeros(n.div_ceil(tensor::quant::ACT_GROUP))).collect();
        }
        self
    }

    /// Whether block inputs are kept here (the residual stream then runs through two buffers).
    fn keeps_inputs(&self) -> bool {
        !self.res_codes.is_empty()
    }

    /// Block `l`'s input → its codes.
    fn put_input(&mut self, l: usize, x: &[f32], seed: u64) {
        if let StashFormat::Int { bits, stochastic } = self.fmt {
            let stream = stochastic.then(|| mix64(seed ^ mix64((l as u64) << 8 | 0xFF)));
            tensor::quant::compress_groups(&mut self.res_codes[l], &mut self.res_scales[l], x, bits, stream);
        }
    }

    /// Block `l`'s input, expanded into `x`.
    fn take_input(&self, l: usize, x: &mut [f32]) {
        if let StashFormat::Int { bits, .. } = self.fmt {
            tensor::quant::decompress_groups(x, &self.res_codes[l], &self.res_scales[l], bits);
        }
    }

    /// Layer `l`'s working set → its storage (`seed`: stochastic rounding's stream).
    fn put(&mut self, l: usize, k: &mut BlockKept, i: &mut BlockInner, seed: u64) {
        let _p = tensor::profile::scope("stash_put");
        let (kh, kf) = k.parts();
        let (ih, if_) = i.parts();
        match self.fmt {
            StashFormat::Half(fmt) => {
                let mut h = &mut self.half[l][..];
                for v in kh.into_iter().chain(ih) {
                    let (dst, rest) = h.split_at_mut(v.len());
                    tensor::precision::pack16(dst, v, fmt);
                    h = rest;
                }
            }
            StashFormat::Int { bits, stochastic } => {
                let (mut c, mut s) = (&mut self.codes[l][..], &mut self.scales[l][..]);
                for (part, v) in kh.into_iter().chain(ih).enumerate() {
                    let (dc, rc) = c.split_at_mut(v.len().div_ceil(if bits == 4 { 2 } else { 1 }));
                    let (ds, rs) = s.split_at_mut(v.len().div_ceil(tensor::quant::ACT_GROUP));
                    let stream = stochastic.then(|| mix64(seed ^ mix64(((l as u64) << 8 | part as u64).wrapping_add(0xAC7C_0DE5))));
                    tensor::quant::compress_groups(dc, ds, v, bits, stream);
                    (c, s) = (rc, rs);
                }
            }
        }
        let mut f = &mut self.full[l][..];
        for v in kf.into_iter().chain(if_) {
            let (dst, rest) = f.split_at_mut(v.len());
            dst.copy_from_slice(v);
            f = rest;
        }
        if let (Some(cache), StashFormat::Int { bits, stochastic }) = (i.moe.as_mut(), self.fmt) {
            let st = &mut self.moe[l];
            cache.save_routing(&mut st.routing);
            let parts = cache.kept_activations();
            let code_len = |n: usize| n.div_ceil(if bits == 4 { 2 } else { 1 });
            st.codes.resize(parts.iter().map(|v| code_len(v.len())).sum(), 0);
            st.scales.resize(parts.iter().map(|v| v.len().div_ceil(tensor::quant::ACT_GROUP)).sum(), 0.0);
            let (mut c, mut s) = (&mut st.codes[..], &mut st.scales[..]);
            for (part, v) in parts.into_iter().enumerate() {
                let (dc, rc) = c.split_at_mut(code_len(v.len()));
                let (ds, rs) = s.split_at_mut(v.len().div_ceil(tensor::quant::ACT_GROUP));
                let stream = stochastic.then(|| mix64(seed ^ mix64(((l as u64) << 8 | (0x80 + part) as u64).wrapping_add(0xAC7C_0DE5))));
                tensor::quant::compress_groups(dc, ds, v, bits, stream);
                (c, s) = (rc, rs);
            }
        }
    }

    /// Layer `l`'s storage → the working set.
    fn take(&self, l: usize, k: &mut BlockKept, i: &mut BlockInner) {
        let _p = tensor::profile::scope("stash_take");
        let (kh, kf) = k.parts();
        let (ih, if_) = i.parts();
        match self.fmt {
            StashFormat::Half(fmt) => {
                let mut h = &self.half[l][..];
                for v in kh.into_iter().chain(ih) {
                    let (src, rest) = h.split_at(v.len());
                    tensor::precision::unpack16(v, src, fmt);
                    h = rest;
                }
            }
            StashFormat::Int { bits, .. } => {
                let (mut c, mut s) = (&self.codes[l][..], &self.scales[l][..]);
                for v in kh.into_iter().chain(ih) {
                    let (sc, rc) = c.split_at(v.len().div_ceil(if bits == 4 { 2 } else { 1 }));
                    let (ss, rs) = s.split_at(v.len().div_ceil(tensor::quant::ACT_GROUP));
                    tensor::quant::decompress_groups(v, sc, ss, bits);
                    (c, s) = (rc, rs);
                }
            }
        }
        let mut f = &self.full[l][..];
        for v in kf.into_iter().chain(if_) {
            let (src, rest) = f.split_at(v.len());
            v.copy_from_slice(src);
            f = rest;
        }
        if let (Some(cache), StashFormat::Int { bits, .. }) = (i.moe.as_mut(), self.fmt) {
            let st = &self.moe[l];
            cache.restore_routing(&st.routing);
            let (mut c, mut s) = (&st.codes[..], &st.scales[..]);
            for v in cache.kept_activations() {
                let (sc, rc) = c.split_at(v.len().div_ceil(if bits == 4 { 2 } else { 1 }));
                let (ss, rs) = s.split_at(v.len().div_ceil(tensor::quant::ACT_GROUP));
                tensor::quant::decompress_groups(v, sc, ss, bits);
                (c, s) = (rc, rs);
            }
        }
    }

    fn bytes(&self) -> usize {
        self.half.iter().map(|v| v.len() * 2).sum::<usize>()
            + self.codes.iter().map(|v| v.len()).sum::<usize>()
            + self.scales.iter().map(|v| v.len() * 4).sum::<usize>()
            + self.full.iter().map(|v| v.len() * 4).sum::<usize>()
            + self.res_codes.iter().map(|v| v.len()).sum::<usize>()
            + self.res_scales.iter().map(|v| v.len() * 4).sum::<usize>()
            + self.moe.iter().map(MoeStash::bytes).sum::<usize>()
    }
}

struct Acts {
    b: usize,
    t: usize,
    /// The pass's length as transformers' rotary update sees it (its largest position + 1 over
    /// the whole rows, under context parallelism too), which picks LongRoPE's tables.
    span: usize,
    /// The policy these buffers were laid out for (with `Full`, every `every`-th layer).
    recompute: Recompute,
    every: usize,
    /// Each block's `kept` / `inner` slot (the recomputed blocks share slot 0), and whether
    /// backward re-runs the block.
    slot: Vec<usize>,
    recomputed: Vec<bool>,
    /// The residual stream between blocks, `L + 1` of `[B, T, C]`: `xs[0]` the (dropped-out)
    /// embedding, `xs[l + 1]` block `l`'s output (`res_3`); `xs[L]` feeds the final norm. When
    /// the stash keeps the block inputs compressed, two buffers in turn: block `l` reads
    /// `xs[l % 2]` and writes `xs[(l + 1) % 2]` ([`Acts::x_index`]), and backward expands its
    /// input into `x_work`.
    xs: Vec<Vec<f32>>,
    x_work: Vec<f32>,
    /// Kept block activations: one per layer, except one shared with `Recompute::Full`.
    kept: Vec<BlockKept>,
    /// Attention internals and MLP hidden activations: one per layer with `Recompute::None` and
    /// `Selective`, else one shared.
    inner: Vec<BlockInner>,
    /// `Selective`: the attention core's outputs, shared by all layers (empty otherwise).
    core: AttnCore,
    /// 16-bit storage of every block's activations ([`Stash`]); then every block shares slot 0.
    stash: Option<Stash>,
    /// A branch's output (attention or MLP projection, after dropout) before its residual add,
    /// `[B, T, C]`: forward-only, so one for all blocks and both branches.
    branch: Vec<f32>,
    /// Sequence parallel: a whole-sequence `[B, T, C]` scratch (the embedding's and the
    /// row-parallel products' partial sums before their reduce-scatter, the final norm's
    /// gathered output for the head) and the head's input gradient before its reduce-scatter.
    /// Empty otherwise. Everything else `[B, T, ·]` in the residual stream then holds this
    /// shard's `T/t` positions.
    full: Vec<f32>,
    dln_f_full: Vec<f32>,
    ln_f: Vec<f32>,
    ln_f_mean: Vec<f32>,
    ln_f_rstd: Vec<f32>,
    dln_f: Vec<f32>,        // [B, T, C]  loss gradient w.r.t. ln_f's output (from the fused head)
    head_scratch: Vec<f32>, // [R, Vp]    one chunk of logits
    losses: Vec<f32>,       // [B, T]
    tokens: Vec<u32>,
    targets: Vec<i32>,
    /// The forward's [`Docs`] (`[B, T]` each; empty without documents), for backward and its
    /// recomputation: a pipeline runs other micro-batches' forwards in between.
    doc_start: Vec<u32>,
    doc_pos: Vec<u32>,
    count: usize,
    dropout_seed: u64,
    /// The dropout probability of the last forward (0 for `Pass::Eval`).
    p_drop: f32,
    /// The gradient scale of the last training forward (the MoE losses' weights use it).
    loss_scale: f32,
    /// Routing statistics of each MoE layer in the last forward.
    moe_stats: Vec<MoeStats>,
}

impl Acts {
    /// The buffer of `xs` holding the residual stream entering block `l` (`l = L`: the last
    /// block's output).
    fn x_index(&self, l: usize) -> usize {
        if self.x_work.is_empty() { l } else { l % 2 }
    }

    /// The `kept` and `inner` slot of block `l`: its own, or the shared one.
    fn slots(&self) -> (impl Fn(usize) -> usize, impl Fn(usize) -> usize) {
        let (a, b) = (self.slot.clone(), self.slot.clone());
        (move |l| a[l], move |l| b[l])
    }
}

/// Gradient scratch for activations, reused across blocks during backward.
struct GradScratch {
    dres: Vec<f32>,     // [B, T, C]  gradient of the residual stream
    dln: Vec<f32>,      // [B, T, C]
    dbranch: Vec<f32>,  // [B, T, C]  branch output before dropout
    datty: Vec<f32>,    // [B, T, C]
    dqkv: Vec<f32>,     // [B, T, (NH + 2·NKV)·HS]
    dfch: Vec<f32>,     // [B, T, F or 2F]
    dfch_gelu: Vec<f32>,
    /// Sequence parallel (`[B, T, C]`, else empty): a row-parallel product's output gradient
    /// gathered along the sequence, and a column-parallel product's input gradient before its
    /// reduce-scatter.
    dfull: Vec<f32>,
    dln_full: Vec<f32>,
    /// Norms after the branches: the gradient of a norm's input (`[B, T, C]`, else empty).
    dpost: Vec<f32>,
    /// Multi-head latent attention's scratch (empty without it).
    mla: crate::mla::MlaGrads,
}

pub struct Gpt {
    pub cfg: GptConfig,
    pub layout: ParamLayout,
    pub views: GptParams,
    /// The layout's units ([`GptParams::units`]) and the views rebased to them, which passes
    /// index the slices a [`UnitStore`] hands out with.
    pub units: Vec<std::ops::Range<usize>>,
    unit_views: GptParams,
    /// Tokens the loss may predict (the tokenizer's vocabulary, ≤ `cfg.vocab_size`).
    pub real_vocab: usize,
    pub params: Vec<f32>,
    pub grads: Vec<f32>,
    /// Rotary tables (LLaMA only).
    pub(crate) rope: Option<RopeTables>,
    /// LoRA adapters; when present the base parameters are frozen (no gradients computed for
    /// its matrices) and only the adapters train.
    pub lora: Option<Lora>,
    /// The collectives of a part of the whole model (see [`Hooks`]); none for a whole model.
    pub hooks: Hooks,
    /// Activation recomputation policy (default [`Recompute::None`]); takes effect at the next
    /// forward.
    pub recompute: Recompute,
    /// With `Recompute::Full`: recompute every this-many-th layer (by whole-model index; 1 =
    /// all), keeping the others' activations.
    pub recompute_every: usize,
    /// 16-bit activation storage when training in bf16, fp16 or FP8 without full
    /// recomputation ([`Gpt::stash_format`]; default on). Off, the same values stay in fp32
    /// buffers — bit for bit the same run, twice the activation memory.
    pub stash16: bool,
    /// Activation compression (`memory.activation_compression`): the kept activations stored
    /// as 8- or 4-bit codes per group ([`StashFormat::Int`]), with this rounding (MoE layers:
    /// their experts' activations too); without full recomputation. Takes precedence over
    /// 16-bit storage.
    pub act_compression: (plan::policy::ActCompression, plan::policy::ActRounding),
    /// Storage precision of activations and their gradients (the caller keeps the parameters
    /// rounded to it).
    pub precision: Precision,
    /// FP8 scaling state (with `Precision::Fp8`).
    pub fp8: Option<std::cell::RefCell<Fp8State>>,
    /// QLoRA: the frozen base, quantized ([`Gpt::set_quantized_base`]); the projections read
    /// its matrices, the store hands out the rest packed.
    base: Option<std::sync::Arc<crate::qbase::QuantBase>>,
    acts: Option<Acts>,
    scratch: Option<GradScratch>,
    /// A preference objective ([`crate::pairs`]): the head weighs each row's tokens by its
    /// pair's gradient instead of taking the mean token loss. The caller sets each
    /// micro-batch's reference log-probabilities before its forward.
    pub pairs: Option<crate::pairs::PairRows>,
    /// A policy-gradient objective ([`crate::policy`], GRPO): each completion's tokens weighed
    /// by its advantage and the clipped ratio. The caller sets each micro-batch's advantages.
    pub policy: Option<crate::policy::PolicyRows>,
}

/// The collectives a part of the whole model calls (implemented by `parallel`): where it sits
/// is its config's [`crate::Placement`]; these move the partial results.
#[derive(Default)]
pub struct Hooks {
    /// A tensor-parallel part (`place.heads` set): sums the parts' partial results at the
    /// branch boundaries, and gathers or scatters along the sequence under sequence
    /// parallelism.
    pub tensor: Option<Box<dyn TpHooks>>,
    /// An expert-parallel part (`place.experts` set), or a data-parallel MoE model: moves each
    /// MoE layer's dispatched rows to the experts' owners and back, and sums the routing
    /// statistics over the ranks that split the batch.
    pub experts: Option<Box<dyn MoeExchange + Send>>,
    /// A context-parallel part (`place.context` set): attention over the other parts' keys.
    pub context: Option<Box<dyn CpHooks>>,
}

/// The factor of the sigmoid router's balancing signal in its bias's gradient slot (2⁻⁴⁰): far
/// below any gradient's square in the step's norm, far above underflow after fp16's unscaling.
pub const BIAS_SIGNAL_SCALE: f32 = 1.0 / (1u64 << 40) as f32;

fn zeros(n: usize) -> Vec<f32> {
    vec![0.0; n]
}

/// The mask stream of dropout site number `site` (see [`DropSite`]) from the step's seed.
fn site_seed(seed: u64, site: u64) -> u64 {
    mix64(seed ^ mix64(site.wrapping_add(0xD1B5_4A32_D192_ED03)))
}

/// One micro-batch's forward activations, taken out of a model so that another micro-batch
/// can run forward meanwhile (pipeline schedules keep several in flight), and put back before
/// its backward. Opaque: only the model reads it.
pub struct Activations(Acts);

impl Activations {
    /// Bytes these activations hold (see [`Gpt::activation_bytes`]).
    pub fn bytes(&self) -> usize {
        acts_bytes(&self.0)
    }
}

/// Parameter `p`'s initial values into `dst`, drawing from `rng`: [`Gpt::new`] calls it for
/// every parameter in layout order from `Rng::new(seed)`, so a caller that does the same (a
/// quantized base built tensor by tensor) gets the same weights without the full buffer.
pub fn init_tensor(rng: &mut Rng, p: &crate::layout::ParamSpec, dst: &mut [f32]) {
    match p.init {
        Init::Normal(std) => rng.fill_normal(dst, std),
        Init::Zeros => dst.fill(0.0),
        Init::Ones => dst.fill(1.0),
    }
}

/// The LM head's weights and targets for one pass over `[B, T]` rows.
struct Head<'h> {
    w: &'h [f32],
    /// the head's gradient (empty: none to compute)
    dw: &'h mut [f32],
    targets: &'h [i32],
    b: usize,
    t: usize,
}

impl Head<'_> {
    /// The fused head over the final norm's output: every row's loss into `a.losses`, and with
    /// `dloss` the input gradient (`a.dln_f`) and the head's (`dw`). A vocabulary-parallel part
    /// holds rows `first ..` of the head, for every position: under sequence parallelism the
    /// final norm's output is gathered first and the head's input gradient reduce-scattered back
    /// to this part's positions.
    fn run(&mut self, a: &mut Acts, tp: Option<&mut (dyn TpHooks + 'static)>, cfg: &GptConfig, (v, precision): (usize, Precision), dloss: Option<Dloss>) {
        let (c, vp, (b, t)) = (cfg.n_embd, cfg.vocab_size, (self.b, self.t));
        let arith = arith(precision);
        match (tp, cfg.place.vocab) {
            (Some(h), Some(rows)) => {
                let off = rows.first;
                let v_local = v.saturating_sub(off).min(vp);
                let sp = cfg.place.seq.is_some();
                if sp {
                    h.gather_seq(&a.ln_f, &mut a.full, b, t);
                }
                let (x, dx) = if sp { (&a.full[..], &mut a.dln_f_full[..]) } else { (&a.ln_f[..], &mut a.dln_f[..]) };
                let grads = dloss.map(|d| (dx, &mut *self.dw, d));
                let dims = HeadDims { c, v: v_local, vp, offset: off, ignore_index: IGNORE_INDEX, arith, softcap: cfg.final_softcap };
                lm_head_crossentropy_vocab_parallel(&mut a.losses, grads, x, self.w, self.targets, &mut a.head_scratch, &dims, &mut |x| h.all_gather(x));
                // `f` backward at the head's input: the vocabulary slices' partial sums.
                match (dloss.is_some(), sp) {
                    (true, true) => h.scatter_seq(&mut a.dln_f_full, &mut a.dln_f, None, b, t),
                    (true, false) => h.reduce_input_grad(&mut a.dln_f),
                    _ => {}
                }
            }
            _ => {
                let grads = dloss.map(|d| (&mut a.dln_f[..], &mut *self.dw, d));
                let dims = HeadDims { c, v, vp, offset: 0, ignore_index: IGNORE_INDEX, arith, softcap: cfg.final_softcap };
                lm_head_crossentropy(&mut a.losses, grads, &a.ln_f, self.w, self.targets, &mut a.head_scratch, &dims);
            }
        }
    }
}

impl Gpt {
    /// A freshly initialised model (GPT-2 initialisation, see `layout`), deterministic in `seed`.
    pub fn new(cfg: GptConfig, real_vocab: usize, seed: u64) -> Gpt {
        let mut m = Gpt::zeroed(cfg, real_vocab);
        let mut rng = Rng::new(seed);
        for p in &m.layout.params {
            init_tensor(&mut rng, p, &mut m.params[p.range()]);
        }
        // transformers' `_init_weights` zeroes the `padding_idx` row of a fresh embedding.
        if let (Some(pad), true, None) = (m.cfg.pad_token_id, m.cfg.has_embedding_unit(), m.cfg.place.vocab) {
            let c = m.cfg.n_embd;
            let wte = m.views.wte.clone();
            m.params[wte.start + pad * c..wte.start + (pad + 1) * c].fill(0.0);
        }
        m
    }

    /// A model with all-zero parameters, to be filled from a checkpoint.
    pub fn zeroed(cfg: GptConfig, real_vocab: usize) -> Gpt {
        let mut m = Gpt::zeroed_frozen(cfg, real_vocab);
        m.grads = zeros(m.layout.total);
        m
    }

    /// [`Gpt::zeroed`] without gradient buffers: a base whose weights stay frozen (LoRA's,
    /// QLoRA's), whose store never reads gradients of them.
    pub fn zeroed_frozen(cfg: GptConfig, real_vocab: usize) -> Gpt {
        assert!(real_vocab <= cfg.place.vocab.map_or(cfg.vocab_size, |v| v.total), "real vocabulary {real_vocab} exceeds the (padded) vocabulary");
        let (layout, views) = gpt_layout(&cfg);
        let n = layout.total;
        let rope = (cfg.arch == Arch::Llama).then(|| RopeTables::new(&cfg));
        let units = views.units(n);
        let unit_views = views.rebased(n);
        Gpt { cfg, layout, views, units, unit_views, real_vocab, params: zeros(n), grads: Vec::new(), rope, lora: None, hooks: Hooks::default(), recompute: Recompute::None, recompute_every: 1, stash16: true, act_compression: Default::default(), precision: Precision::Fp32, fp8: None, base: None, acts: None, scratch: None, pairs: None, policy: None }
    }

    pub fn num_params(&self) -> usize {
        self.layout.total
    }

    pub fn zero_grad(&mut self) {
        tensor::par::zero(&mut self.grads);
        if let Some(lo) = self.lora.as_mut() {
            lo.grads.fill(0.0);
        }
    }

    /// QLoRA: from now on the block projections read their matrices from `base` (dequantized
    /// a tile at a time inside each product), and passes index units with the base's compact
    /// views — the store must hand out [`QuantBase::compact_unit`]s, as `DataParallel` does
    /// once it holds the same base.
    ///
    /// [`QuantBase::compact_unit`]: crate::qbase::QuantBase::compact_unit
    pub fn set_quantized_base(&mut self, base: std::sync::Arc<crate::qbase::QuantBase>) {
        self.unit_views = base.compact_views(&self.views.rebased(self.layout.total));
        self.base = Some(base);
    }

    /// QLoRA's quantized base, when [`Gpt::set_quantized_base`] gave one.
    pub fn quantized_base(&self) -> Option<&std::sync::Arc<crate::qbase::QuantBase>> {
        self.base.as_ref()
    }

    /// The format a block's kept activations are stored in between forward and backward:
    /// compressed codes under [`Gpt::act_compression`], else 16 bits when training in a 16-bit
    /// precision (unless [`Gpt::stash16`] is off, or the layers are mixtures of experts, whose
    /// expert activations are fp32); none under full recomputation (which keeps only block
    /// inputs).
    pub fn stash_format(&self) -> Option<StashFormat> {
        if self.recompute == Recompute::Full {
            return None;
        }
        let (compression, rounding) = self.act_compression;
        if let Some(bits) = compression.bits() {
            return Some(StashFormat::Int { bits, stochastic: rounding == plan::policy::ActRounding::Stochastic });
        }
        storage(self.precision).filter(|_| self.stash16 && !self.cfg.is_moe()).map(StashFormat::Half)
    }

    fn ensure_acts(&mut self, b: usize, t: usize) {
        let stash_fmt = self.stash_format();
        if self.acts.as_ref().is_some_and(|a| a.b == b && a.t == t && a.recompute == self.recompute && a.every == self.recompute_every && a.stash.as_ref().map(|s| s.fmt) == stash_fmt) {
            return;
        }
        let (c, nh, vp) = (self.cfg.n_embd, self.cfg.n_head, self.cfg.vocab_size);
        let (qw, fw, f) = (self.cfg.qkv_width(), self.cfg.dense_fc_width(), self.cfg.dense_hidden());
        let aw = self.cfg.attn_width();
        let state = b * nh * t; // flash lse, both architectures
        let n = b * t;
        // Rows of the residual stream on this shard (all of them, or under sequence
        // parallelism its positions of each sequence), and of the whole-sequence scratch.
        let (nl, nf) = match self.cfg.place.seq {
            Some(s) => (b * s.positions(t).len(), n),
            None => (n, 0),
        };
        let hn = if self.cfg.has_head() { n } else { 0 };
        let hl = if self.cfg.has_head() { nl } else { 0 };
        let moe = self.cfg.is_moe();
        // An MoE layer keeps its activations in its MoeCache; the dense MLP buffers stay empty
        // unless dense layers precede the routed ones (then every set has both: sets are shared
        // between layers under recomputation and stashing).
        let (fw, f) = if moe && self.cfg.dense_layers() == 0 { (0, 0) } else { (fw, f) };
        let cfg = &self.cfg;
        // Selective recomputation keeps everything but the attention core's outputs.
        let own_core = self.recompute != Recompute::Selective;
        let (qk_in, qk_groups) = if cfg.qk_norm { (n * (cfg.n_head + cfg.n_kv_head) * cfg.head_size(), n * cfg.qk_norm_groups()) } else { (0, 0) };
        let post = if cfg.block_norms.post() { 2 * nl } else { 0 };
        let kept = || BlockKept {
            ln_1: zeros(nl * c), ln_1_mean: zeros(nl), ln_1_rstd: zeros(nl), res_2: zeros(nl * c),
            ln_2: zeros(nl * c), ln_2_mean: zeros(nl), ln_2_rstd: zeros(nl),
        };
        let inner = || BlockInner {
            qkv: zeros(n * qw), core: if own_core { AttnCore { atty: zeros(n * aw), state: zeros(state) } } else { AttnCore { atty: Vec::new(), state: Vec::new() } },
            fch: zeros(n * fw), fch_gelu: zeros(n * f),
            moe: moe.then(|| MoeCache::new(cfg.moe_dims(n))),
            ln_1_full: zeros(nf * c), ln_2_full: zeros(nf * c),
            qk_pre: zeros(qk_in), qk_rstd: zeros(qk_groups),
            post_in: zeros(post * c), post_rstd: zeros(post),
            mla: crate::mla::MlaActs::new(cfg.is_mla().then(|| crate::mla::MlaDims::of(cfg, n))),
        };
        let l = self.cfg.n_layer;
        // Full recomputation of every k-th layer (k = 1: all): those layers share one set,
        // the others keep their own.
        let every = self.recompute_every.max(1);
        let recomputed: Vec<bool> = (0..l).map(|i| self.recompute == Recompute::Full && (self.cfg.first_layer() + i).is_multiple_of(every)).collect();
        let mut slot = vec![0; l];
        let mut next = usize::from(recomputed.iter().any(|&r| r));
        for (i, r) in recomputed.iter().enumerate() {
            if !r {
                slot[i] = next;
                next += 1;
            }
        }
        // 16-bit storage: every block computes in slot 0 and stashes.
        if stash_fmt.is_some() {
            next = 1;
            slot.fill(0);
        }
        let (n_kept, n_inner) = (next, next);
        // Drop the old buffers before allocating the new ones (peak memory).
        self.acts = None;
        let (mut kept, mut inner): (Vec<BlockKept>, Vec<BlockInner>) = ((0..n_kept).map(|_| kept()).collect(), (0..n_inner).map(|_| inner()).collect());
        let stash = stash_fmt.map(|f| Stash::new(f, l, &mut kept[0], &mut inner[0]).with_residual(l, nl * c));
        let ping = stash.as_ref().is_some_and(Stash::keeps_inputs);
        self.acts = Some(Acts {
            b, t,
            recompute: self.recompute,
            every,
            slot,
            recomputed,
            xs: (0..if ping { 2 } else { self.cfg.n_layer + 1 }).map(|_| zeros(nl * c)).collect(),
            x_work: if ping { zeros(nl * c) } else { Vec::new() },
            kept,
            inner,
            stash,
            core: if own_core { AttnCore { atty: Vec::new(), state: Vec::new() } } else { AttnCore { atty: zeros(n * aw), state: zeros(state) } },
            branch: zeros(nl * c),
            full: zeros(nf * c),
            dln_f_full: zeros(if self.cfg.has_head() { nf * c } else { 0 }),
            // The final norm and the head's buffers only where the head is (pipeline stages).
            ln_f: zeros(hl * c), ln_f_mean: zeros(hl), ln_f_rstd: zeros(hl),
            dln_f: zeros(hl * c), head_scratch: zeros(chunk_rows(hn, vp, arith(self.precision)) * vp), losses: zeros(n),
            tokens: vec![0; n], targets: vec![0; n], doc_start: Vec::new(), doc_pos: Vec::new(), count: 0, dropout_seed: 0, p_drop: 0.0, loss_scale: 1.0, moe_stats: Vec::new(), span: t,
        });
        self.scratch = None;
    }

    /// Forward pass over `tokens[B, T]` with `targets[B, T]` (`IGNORE_INDEX` to skip a
    /// position). Returns the mean loss over counted targets.
    pub fn forward(&mut self, tokens: &[u32], targets: &[i32], b: usize, t: usize, pass: Pass) -> f32 {
        self.forward_local(tokens, targets, None, b, t, pass)
    }

    /// [`Gpt::forward`] over rows of packed documents ([`Docs`]); the following backward uses
    /// the same layout.
    pub fn forward_docs(&mut self, tokens: &[u32], targets: &[i32], docs: Docs, b: usize, t: usize, pass: Pass) -> f32 {
        self.forward_local(tokens, targets, Some(docs), b, t, pass)
    }

    fn forward_local(&mut self, tokens: &[u32], targets: &[i32], docs: Option<Docs>, b: usize, t: usize, pass: Pass) -> f32 {
        let (params, mut grads, units) = (std::mem::take(&mut self.params), std::mem::take(&mut self.grads), std::mem::take(&mut self.units));
        let loss = self.forward_with(&mut Local { params: &params, grads: &mut grads, units: &units }, tokens, targets, docs, (b, t), pass);
        (self.params, self.grads, self.units) = (params, grads, units);
        loss
    }

    /// [`Gpt::forward`] (with `docs`: [`Gpt::forward_docs`]) reaching the parameters (and the
    /// head's gradients) through `store`; the model's own `params` and `grads` are not touched.
    /// The document layout is kept with the activations for the backward.
    ///
    /// A context-parallel part (`place.context`) is given the whole rows and runs on its
    /// positions of them: its activations, losses and `stage_*` buffers are `[B, T/cp, ·]`.
    pub fn forward_with(&mut self, store: &mut dyn UnitStore, tokens: &[u32], targets: &[i32], docs: Option<Docs>, (b, t): (usize, usize), pass: Pass) -> f32 {
        // transformers picks LongRoPE's tables by the whole rows' largest position + 1.
        let span = pass_len(&docs, t);
        let Some(cx) = self.cfg.place.context else {
            return self.forward_rows(store, tokens, targets, docs, (b, t, span), pass);
        };
        assert!(tokens.len() == b * t && targets.len() == b * t, "tokens and targets must be [B, T]");
        if let Some(d) = &docs {
            d.check(b, t, self.cfg.block_size);
        }
        // This part's rows, each with its global position and (global) document start; plain
        // causal rows have positions and no starts (the attention's masks are by position).
        let (tk, tg) = (cx.rows(tokens, b, t), cx.rows(targets, b, t));
        // A policy objective's per-position log-probabilities: this part's positions of them.
        if let Some(p) = self.policy.as_mut() {
            for v in [&mut p.old, &mut p.reference].into_iter().filter(|v| !v.is_empty()) {
                *v = cx.rows(v, b, t);
            }
        }
        let (start, pos) = match docs {
            Some(d) => (cx.rows(d.start, b, t), cx.rows(d.pos, b, t)),
            None => {
                let p: Vec<u32> = cx.positions(t).into_iter().map(|p| p as u32).collect();
                (Vec::new(), (0..b).flat_map(|_| p.iter().copied()).collect())
            }
        };
        self.forward_rows(store, &tk, &tg, Some(Docs { start: &start, pos: &pos }), (b, t / cx.count, span), pass)
    }

    /// [`Gpt::forward_with`] on rows this part holds whole (under context parallelism, its
    /// positions, `docs` then in global positions), `[B, T]`, `span` the whole rows' pass length
    /// ([`Acts::span`]).
    fn forward_rows(&mut self, store: &mut dyn UnitStore, tokens: &[u32], targets: &[i32], docs: Option<Docs>, (b, t, span): (usize, usize, usize), pass: Pass) -> f32 {
        assert_eq!(targets.len(), b * t);
        let (p_drop, seed, loss_scale) = match pass {
            Pass::Eval => (0.0, 0, None),
            Pass::Train { dropout_seed, loss_scale } => (self.cfg.dropout, dropout_seed, Some(loss_scale)),
        };
        let hu = self.unit_views.head_unit();
        let head_access = Access::Head { train: loss_scale.is_some() };
        let head = self.cfg.has_head();
        self.trunk_forward(store, tokens, docs, (b, t, span), (Dropout { p: p_drop, seed }, loss_scale.is_some()), head.then_some((hu, head_access)));
        let a = self.acts.as_mut().unwrap();
        a.loss_scale = loss_scale.unwrap_or(1.0);
        a.targets.copy_from_slice(targets);
        let count = targets.iter().filter(|&&x| x != IGNORE_INDEX).count();
        a.count = count;
        if !head {
            // A pipeline stage before the last: its output is `stage_output()`.
            a.losses.fill(0.0);
            return 0.0;
        }
        // logits = ln_f(x) · headᵀ ; loss — fused, in row chunks (and its gradient, when training)
        let r = self.unit_views.lm_head.clone();
        // A frozen base (LoRA) has no head gradient to compute: the store may hand out none.
        let frozen = self.lora.is_some();
        let (w, dw) = store.acquire(hu, head_access, None);
        let dw: &mut [f32] = if frozen || loss_scale.is_none() { &mut [] } else { &mut dw[r.clone()] };
        let mut head = Head { w: &w[r], dw, targets, b, t };
        let seq: Option<&mut dyn crate::pairs::RowObjective> = match (self.pairs.as_mut(), self.policy.as_mut()) {
            (Some(p), _) => Some(p),
            (None, Some(p)) => Some(p),
            (None, None) => None,
        };
        let mean = match seq {
            // A sequence objective: every row's token losses first, then the gradient the
            // objective gives each token.
            Some(obj) => {
                let a = self.acts.as_mut().unwrap();
                head.run(a, self.hooks.tensor.as_deref_mut(), &self.cfg, (self.real_vocab, self.precision), None);
                let cp = &mut self.hooks.context;
                let mean = obj.measure(&a.losses, targets, IGNORE_INDEX, (b, t), &mut |x| if let Some(h) = cp.as_deref_mut() { h.sum_over_parts(x) });
                if let Some(s) = loss_scale {
                    let weights = obj.token_weights(targets, IGNORE_INDEX, (b, t), s as f64);
                    head.run(a, self.hooks.tensor.as_deref_mut(), &self.cfg, (self.real_vocab, self.precision), Some(Dloss::Rows(&weights)));
                }
                mean as f32
            }
            None => {
                let a = self.acts.as_mut().unwrap();
                let scale = loss_scale.filter(|_| count > 0).map(|s| Dloss::All(s / count as f32));
                head.run(a, self.hooks.tensor.as_deref_mut(), &self.cfg, (self.real_vocab, self.precision), scale);
                if count == 0 { 0.0 } else { (a.losses.iter().map(|&x| x as f64).sum::<f64>() / count as f64) as f32 }
            }
        };
        store.release(hu, head_access);
        mean
    }

    /// Full logits `[B, T, Vp]` for `tokens` (evaluation mode). Materialises every logit: for
    /// inference and tests, not for training.
    pub fn forward_logits(&mut self, tokens: &[u32], b: usize, t: usize) -> Vec<f32> {
        let (params, mut grads, units) = (std::mem::take(&mut self.params), std::mem::take(&mut self.grads), std::mem::take(&mut self.units));
        self.trunk_forward(&mut Local { params: &params, grads: &mut grads, units: &units }, tokens, None, (b, t, t), (Dropout { p: 0.0, seed: 0 }, false), None);
        (self.params, self.grads, self.units) = (params, grads, units);
        let (c, vp) = (self.cfg.n_embd, self.cfg.vocab_size);
        let mut logits = vec![0.0; b * t * vp];
        let a = self.acts.as_ref().unwrap();
        matmul_forward(&mut logits, &a.ln_f, &self.params[self.views.lm_head.clone()], None, b * t, c, vp);
        tensor::classifier::softcap_logits(&mut logits, self.cfg.final_softcap);
        logits
    }

    /// Embedding, blocks and the final norm; leaves `ln_f` in the activations. `then` is the
    /// unit the caller acquires next (the head), for the store's prefetch. `docs` is kept in the
    /// activations. `train`: a training pass (an evaluation's blocks stash nothing: no backward
    /// reads them), with its dropout `drop`; the rows' shape `(b, t, span)` as
    /// [`Gpt::forward_rows`]'.
    fn trunk_forward(&mut self, store: &mut dyn UnitStore, tokens: &[u32], docs: Option<Docs>, (b, t, span): (usize, usize, usize), (drop, train): (Dropout, bool), then: Option<(usize, Access)>) {
        assert!(t <= self.cfg.block_size, "sequence length {t} exceeds block_size");
        assert_eq!(tokens.len(), b * t);
        if let Some(d) = docs.as_ref().filter(|_| self.cfg.place.context.is_none()) {
            d.check(b, t, self.cfg.block_size);
        }
        self.ensure_acts(b, t);
        let c = self.cfg.n_embd;
        let pv = &self.unit_views;
        let last = pv.blocks.len() + 1;
        let a = self.acts.as_mut().unwrap();
        a.tokens.copy_from_slice(tokens);
        a.doc_start.clear();
        a.doc_pos.clear();
        if let Some(d) = &docs {
            a.doc_start.extend_from_slice(d.start);
            a.doc_pos.extend_from_slice(d.pos);
        }
        a.dropout_seed = drop.seed;
        a.p_drop = drop.p;
        a.span = span;
        a.moe_stats.clear();
        let ops = Ops {
            cfg: &self.cfg, rope: self.rope.as_ref().map(|r| r.for_pass(span)), rope_local: self.rope.as_ref().and_then(RopeTables::local), b, t, docs, drop, loss_scale: a.loss_scale,
            tp: RefCell::new(self.hooks.tensor.as_deref_mut()), ep: RefCell::new(self.hooks.experts.as_deref_mut()), cp: RefCell::new(self.hooks.context.as_deref_mut()), lora: RefCell::new(self.lora.as_mut()),
            store: storage(self.precision), arith: arith(self.precision), fp8: self.fp8.as_ref(), b0: self.cfg.place.batch_offset, base: self.base.as_deref(),
        };

        // A later pipeline stage starts from the activations put in `xs[0]` (`stage_input_mut`).
        if self.cfg.has_embed() {
            let (w, _) = store.acquire(0, Access::Forward, Some((1, Access::Forward)));
            let wpe = pv.wpe.as_ref().map(|r| &w[r.clone()]);
            let pos = docs.map(|d| d.pos);
            match ops.vocab_rows() {
                // Vocab-parallel: this shard's rows' lookups, summed over the shards (`g`).
                // Under sequence parallelism, reduce-scattered to this shard's positions (the
                // lookups cover the whole sequence, so do the positions).
                Some(rows) if ops.sp() => {
                    embedding_forward_rows(&mut a.full, tokens, (&w[pv.wte.clone()], wpe), pos, t, c, rows);
                    ops.scatter_seq(&mut a.full, &mut a.xs[0], None);
                }
                Some(rows) => {
                    embedding_forward_rows(&mut a.xs[0], tokens, (&w[pv.wte.clone()], wpe), pos, t, c, rows);
                    ops.tp_reduce_output(&mut a.xs[0], None);
                }
                None if pos.is_some() => {
                    let vp = self.cfg.vocab_size;
                    assert!(tokens.iter().all(|&x| (x as usize) < vp), "token outside the vocabulary of {vp}");
                    embedding_forward_rows(&mut a.xs[0], tokens, (&w[pv.wte.clone()], wpe), pos, t, c, 0..vp);
                }
                None => embedding_forward(&mut a.xs[0], tokens, &w[pv.wte.clone()], wpe, t, c),
            }
            store.release(0, Access::Forward);
            if let Some(s) = self.cfg.embed_multiplier() {
                tensor::par::scale(&mut a.xs[0], s);
            }
            ops.dropout(&mut a.xs[0], DropSite::Embedding);
        }
        ops.store(&mut a.xs[0]);
        let (kl, il) = a.slots();
        for (l, bp) in pv.blocks.iter().enumerate() {
            let (i, o) = (a.x_index(l), a.x_index(l + 1));
            let (inp, out) = if i < o {
                let (lo, hi) = a.xs.split_at_mut(o);
                (&lo[i], &mut hi[0])
            } else {
                let (lo, hi) = a.xs.split_at_mut(i);
                (&hi[0], &mut lo[o])
            };
            let _span = tensor::profile::layer_scope("block_forward", l);
            let (w, _) = store.acquire(l + 1, Access::Forward, Some((l + 2, Access::Forward)));
            let acts = BlockActs { k: &mut a.kept[kl(l)], i: &mut a.inner[il(l)], shared: &mut a.core };
            if let Some(st) = block_forward(&Block { ops: &ops, l, w, bp }, inp, acts, &mut a.branch, &mut a.full, Some(out)) {
                a.moe_stats.push(st);
            }
            // (An evaluation's activations are never read back: nothing is stashed.)
            if let Some(st) = a.stash.as_mut().filter(|_| train) {
                st.put(l, &mut a.kept[0], &mut a.inner[0], a.dropout_seed);
                if st.keeps_inputs() {
                    // The next block overwrites this one's input buffer: backward gets it back
                    // from its codes.
                    st.put_input(l, inp, a.dropout_seed);
                }
            }
            store.release(l + 1, Access::Forward);
        }
        if !self.cfg.has_head() {
            return;
        }
        let x: &[f32] = &a.xs[a.x_index(self.cfg.n_layer)];
        let (w, _) = store.acquire(last, Access::Forward, then);
        ops.norm_forward(&mut a.ln_f, &mut a.ln_f_mean, &mut a.ln_f_rstd, x, &w[pv.ln_f_w.clone()], pv.ln_f_b.as_ref().map(|r| &w[r.clone()]));
        ops.store(&mut a.ln_f);
        store.release(last, Access::Forward);
    }

    /// Backward pass of the last `forward` (which must have been a `Pass::Train`: the head's
    /// gradient and `dln_f` come from it). Accumulates into `grads`.
    pub fn backward(&mut self) {
        let (params, mut grads, units) = (std::mem::take(&mut self.params), std::mem::take(&mut self.grads), std::mem::take(&mut self.units));
        self.backward_with(&mut Local { params: &params, grads: &mut grads, units: &units });
        (self.params, self.grads, self.units) = (params, grads, units);
    }

    /// [`Gpt::backward`] through `store`: units are acquired in reverse order and each is
    /// released as soon as its gradients are complete (the embeddings' last).
    pub fn backward_with(&mut self, store: &mut dyn UnitStore) {
        self.ensure_scratch();
        let a = self.acts.as_mut().expect("backward before forward");
        let (b, t) = (a.b, a.t);
        let c = self.cfg.n_embd;
        let g = self.scratch.as_mut().unwrap();
        let pv = &self.unit_views;
        let last = pv.blocks.len() + 1;
        let bwd = Access::Backward { params: true };
        // The forward's document layout, for the attention (and rope) backward and recomputation.
        let docs = (!a.doc_pos.is_empty()).then_some(Docs { start: &a.doc_start, pos: &a.doc_pos });
        let ops = Ops {
            cfg: &self.cfg, rope: self.rope.as_ref().map(|r| r.for_pass(a.span)), rope_local: self.rope.as_ref().and_then(RopeTables::local), b, t, docs, drop: Dropout { p: a.p_drop, seed: a.dropout_seed }, loss_scale: a.loss_scale,
            tp: RefCell::new(self.hooks.tensor.as_deref_mut()), ep: RefCell::new(self.hooks.experts.as_deref_mut()), cp: RefCell::new(self.hooks.context.as_deref_mut()), lora: RefCell::new(self.lora.as_mut()),
            store: storage(self.precision), arith: arith(self.precision), fp8: self.fp8.as_ref(), b0: self.cfg.place.batch_offset, base: self.base.as_deref(),
        };
        // Every unit is acquired and released even when no target counted (the gradients are
        // then zero): a store's collectives must run the same on every rank.
        let skip = a.count == 0;
        // The head and the loss were differentiated in forward (fused): start from d ln_f — or,
        // on a pipeline stage before the last, from the output gradient the caller put in
        // `stage_output_grad_mut()`.
        let head = self.cfg.has_head();
        if head {
            tensor::par::zero(&mut g.dres);
        }
        let x_last: &[f32] = &a.xs[a.x_index(self.cfg.n_layer)];
        let (w, dw) = store.acquire(last, bwd, Some((last - 1, bwd)));
        if !skip && head {
            let (dlnf_w, dlnf_b) = split_two(dw, &pv.ln_f_w, &pv.ln_f_b);
            ops.store(&mut a.dln_f);
            ops.norm_backward(&mut g.dres, (dlnf_w, dlnf_b), &a.dln_f, x_last, &w[pv.ln_f_w.clone()], (&a.ln_f_mean, &a.ln_f_rstd));
            ops.store(&mut g.dres);
        }
        store.release(last, bwd);

        let (kl, il) = a.slots();
        for (l, bp) in pv.blocks.iter().enumerate().rev() {
            let next = if l == 0 { (0, Access::Backward { params: false }) } else { (l, bwd) };
            let (w, dw) = store.acquire(l + 1, bwd, Some(next));
            if !skip {
                if let Some(st) = &a.stash {
                    st.take(l, &mut a.kept[0], &mut a.inner[0]);
                    if st.keeps_inputs() {
                        st.take_input(l, &mut a.x_work);
                    }
                }
                let x: &[f32] = if a.x_work.is_empty() { &a.xs[l] } else { &a.x_work };
                let blk = Block { ops: &ops, l, w, bp };
                // Re-run what forward did not keep, from what it kept (same kernels, same masks).
                match a.recompute {
                    Recompute::Selective => {
                        let _span = tensor::profile::layer_scope("block_recompute", l);
                        blk.attn_core(&a.inner[il(l)].qkv, &mut a.core);
                    }
                    Recompute::Full if a.recomputed[l] => {
                        let _span = tensor::profile::layer_scope("block_recompute", l);
                        let acts = BlockActs { k: &mut a.kept[kl(l)], i: &mut a.inner[il(l)], shared: &mut a.core };
                        block_forward(&blk, x, acts, &mut a.branch, &mut a.full, None);
                    }
                    _ => {}
                }
                let _span = tensor::profile::layer_scope("block_backward", l);
                block_backward(&blk, dw, x, BlockActs { k: &mut a.kept[kl(l)], i: &mut a.inner[il(l)], shared: &mut a.core }, g);
            }
            store.release(l + 1, bwd);
        }
        // x = drop(wte[tokens] + wpe)
        let emb = Access::Backward { params: false };
        let (_, dw) = store.acquire(0, emb, None);
        // A later pipeline stage leaves its input's gradient in `dres` (`stage_input_grad`). A
        // frozen base (LoRA) has no embedding gradient to compute.
        if !skip && self.cfg.has_embed() && ops.lora.borrow().is_none() {
            if let Some(s) = self.cfg.embed_multiplier() {
                // The stream's gradient is not read again: the lookup's is `√C` times it.
                tensor::par::scale(&mut g.dres, s);
            }
            let demb = ops.dropout_grad(&mut g.dbranch, &g.dres, DropSite::Embedding);
            // Under sequence parallelism the embedding's output was reduce-scattered: gather.
            let demb = ops.row_parallel_grad(demb, &mut g.dfull);
            let (dwte, dwpe) = match &pv.wpe {
                Some(wpe) => {
                    let (dwte, dwpe) = split_pair(dw, &pv.wte, wpe);
                    (dwte, Some(dwpe))
                }
                None => (&mut dw[pv.wte.clone()], None),
            };
            let pos = docs.map(|d| d.pos);
            match (ops.vocab_rows(), self.cfg.pad_token_id) {
                // transformers' `padding_idx`: the pad token's row gets no gradient from the
                // lookup (the rows on either side of it accumulate as usual; llama: no `dwpe`).
                (rows, Some(pad)) => {
                    let rows = rows.unwrap_or(0..self.cfg.vocab_size);
                    let cut = pad.clamp(rows.start, rows.end);
                    let (below, above) = dwte.split_at_mut((cut - rows.start) * c);
                    embedding_backward_rows((below, None), demb, &a.tokens, pos, t, c, rows.start..cut);
                    let skip = if rows.contains(&pad) { c } else { 0 };
                    embedding_backward_rows((&mut above[skip..], dwpe), demb, &a.tokens, pos, t, c, cut + skip / c..rows.end);
                }
                (Some(rows), None) => embedding_backward_rows((dwte, dwpe), demb, &a.tokens, pos, t, c, rows),
                (None, None) if pos.is_some() => embedding_backward_rows((dwte, dwpe), demb, &a.tokens, pos, t, c, 0..self.cfg.vocab_size),
                (None, None) => embedding_backward(dwte, dwpe, demb, &a.tokens, t, c),
            }
        }
        store.release(0, emb);
    }

    /// Allocates the activation buffers for `(B, T)` under the current [`Recompute`] policy, as
    /// the next forward would (a no-op when they already fit).
    pub fn reserve_activations(&mut self, b: usize, t: usize) {
        // A context-parallel part holds its T/cp positions of each row.
        let t = self.cfg.place.context.map_or(t, |cx| t / cx.count);
        self.ensure_acts(b, t);
    }

    /// Bytes held by the forward activation buffers (0 before the first forward or
    /// [`Gpt::reserve_activations`]): the residual stream between blocks, the block activations
    /// (with their MoE caches, backward scratch included), the branch buffer, the final norm,
    /// the head's logits chunk and `dln_f`, losses, tokens, targets and the document layout. Not counted: backward's
    /// gradient scratch (one set, shared by all blocks in every policy) and LoRA's saved `x·Aᵀ`
    /// (`[B·T, r]` per adapter).
    pub fn activation_bytes(&self) -> usize {
        self.acts.as_ref().map_or(0, acts_bytes)
    }

    /// Takes the last forward's activations out of the model (the next forward allocates a
    /// fresh set, or reuses one given back with [`Gpt::put_activations`]).
    pub fn take_activations(&mut self) -> Option<Activations> {
        self.acts.take().map(Activations)
    }

    /// Puts a micro-batch's activations back, for its backward (or for reuse by a forward of
    /// the same shape).
    pub fn put_activations(&mut self, a: Activations) {
        self.acts = Some(a.0);
    }

    /// Pipeline stage without the embedding: the buffer of its input activations `[B, T, C]`
    /// for the next forward at `(B, T)` (write the previous stage's output here).
    pub fn stage_input_mut(&mut self, b: usize, t: usize) -> &mut [f32] {
        // A context-parallel part holds its T/cp positions of each row.
        let t = self.cfg.place.context.map_or(t, |cx| t / cx.count);
        self.ensure_acts(b, t);
        &mut self.acts.as_mut().unwrap().xs[0]
    }

    /// Pipeline stage without the head: its output activations `[B, T, C]` from the last
    /// forward (the next stage's input).
    pub fn stage_output(&self) -> &[f32] {
        let a = self.acts.as_ref().expect("forward first");
        &a.xs[a.x_index(self.cfg.n_layer)]
    }

    /// Pipeline stage without the head: the buffer for the gradient of its output, to be
    /// filled before [`Gpt::backward_with`] (the next stage's input gradient).
    pub fn stage_output_grad_mut(&mut self) -> &mut [f32] {
        self.ensure_scratch();
        &mut self.scratch.as_mut().unwrap().dres
    }

    /// Pipeline stage without the embedding: the gradient of its input after the last
    /// backward (for the previous stage).
    pub fn stage_input_grad(&self) -> &[f32] {
        &self.scratch.as_ref().expect("backward first").dres
    }

    /// Backward's gradient scratch, for the current activations' `(B, T)`.
    fn ensure_scratch(&mut self) {
        let a = self.acts.as_ref().expect("backward before forward");
        let n = a.b * a.t;
        let c = self.cfg.n_embd;
        let (nl, nf) = match self.cfg.place.seq {
            Some(s) => (a.b * s.positions(a.t).len(), n),
            None => (n, 0),
        };
        if self.scratch.as_ref().is_some_and(|g| g.dres.len() == nl * c && g.dqkv.len() == n * self.cfg.qkv_width()) {
            return;
        }
        let (qw, fw, f) = (self.cfg.qkv_width(), self.cfg.dense_fc_width(), self.cfg.dense_hidden());
        self.scratch = None;
        self.scratch = Some(GradScratch {
            dres: zeros(nl * c), dln: zeros(nl * c), dbranch: zeros(nl * c), datty: zeros(n * self.cfg.attn_width()),
            dqkv: zeros(n * qw), dfch: zeros(n * fw), dfch_gelu: zeros(n * f), dfull: zeros(nf * c), dln_full: zeros(nf * c),
            dpost: zeros(if self.cfg.block_norms.post() { nl * c } else { 0 }),
            mla: crate::mla::MlaGrads::new(self.cfg.is_mla().then(|| crate::mla::MlaDims::of(&self.cfg, n))),
        });
    }

    /// FP8: folds the step's amaxes (after the caller reduced `fp8.pending_mut()` over the
    /// data-parallel ranks) into the scaling histories.
    pub fn fp8_commit(&mut self) {
        if let Some(st) = self.fp8.as_mut() {
            st.get_mut().commit();
        }
    }

    /// Routing statistics of each MoE layer in the last forward (empty for dense models).
    pub fn moe_stats(&self) -> &[MoeStats] {
        self.acts.as_ref().map_or(&[], |a| &a.moe_stats)
    }

    /// The targets the last forward counted (not `IGNORE_INDEX`; a context-parallel part's:
    /// at its positions).
    pub fn counted(&self) -> usize {
        self.acts.as_ref().map_or(0, |a| a.count)
    }

    /// Per-position losses of the last forward (0 at ignored positions).
    pub fn losses(&self) -> &[f32] {
        &self.acts.as_ref().expect("forward first").losses
    }

}

/// Bytes held by one set of forward activations (see [`Gpt::activation_bytes`]).
fn acts_bytes(a: &Acts) -> usize {
    let f4 = std::mem::size_of::<f32>();
    let v = |x: &Vec<f32>| x.len() * f4;
    let moe_bytes = |m: &MoeCache| {
        let tensor::moe::MoeDims { n, f, e, k, c, .. } = m.dims;
        let r = n * k;
        let big = r.max(n);
        let public = (m.logits.len() + m.probs.len() + m.lse.len() + m.gates.len() + m.xe.len() + m.gu.len() + m.h.len() + m.eo.len() + m.sgu.len() + m.sh.len()) * f4
            + (m.idx.len() + m.slot.len() + m.row_token.len()) * 4
            + (m.offsets.len() + m.counts.len()) * std::mem::size_of::<usize>();
        // The private backward scratch, sized as `MoeCache::new` sizes it.
        public + (r * c + big * f + big * 2 * f + n * k + n * e) * f4
    };
    let kept = |k: &BlockKept| [&k.ln_1, &k.ln_1_mean, &k.ln_1_rstd, &k.res_2, &k.ln_2, &k.ln_2_mean, &k.ln_2_rstd].iter().map(|x| v(x)).sum::<usize>();
    let inner = |i: &BlockInner| {
        [&i.qkv, &i.core.atty, &i.core.state, &i.fch, &i.fch_gelu, &i.ln_1_full, &i.ln_2_full, &i.qk_pre, &i.qk_rstd, &i.post_in, &i.post_rstd].iter().map(|x| v(x)).sum::<usize>()
            + i.mla.bytes()
            + i.moe.as_ref().map_or(0, moe_bytes)
    };
    a.xs.iter().map(v).sum::<usize>() + v(&a.x_work)
        + a.kept.iter().map(kept).sum::<usize>()
        + a.inner.iter().map(inner).sum::<usize>()
        + v(&a.core.atty)
        + v(&a.core.state)
        + a.stash.as_ref().map_or(0, Stash::bytes)
        + v(&a.branch)
        + v(&a.full)
        + v(&a.dln_f_full)
        + [&a.ln_f, &a.ln_f_mean, &a.ln_f_rstd, &a.dln_f, &a.head_scratch, &a.losses].iter().map(|x| v(x)).sum::<usize>()
        + a.tokens.len() * 4
        + a.targets.len() * 4
        + (a.doc_start.len() + a.doc_pos.len()) * 4
}

/// Where dropout applies. Each site draws its own mask stream from the step's seed, numbered
/// in the whole model (0 the embedding, then three per block) so that a pipeline stage draws
/// the masks the whole model draws.
#[derive(Clone, Copy, Debug)]
enum DropSite {
    Embedding,
    /// Layer `l`'s attention probabilities.
    AttnProbs(usize),
    /// Layer `l`'s attention branch, before its residual add.
    AttnResidual(usize),
    /// Layer `l`'s MLP branch, before its residual add.
    MlpResidual(usize),
}

impl DropSite {
    /// The layer (this part's numbering) an attention site belongs to.
    fn layer(self) -> usize {
        match self {
            DropSite::AttnProbs(l) | DropSite::AttnResidual(l) | DropSite::MlpResidual(l) => l,
            DropSite::Embedding => unreachable!("attention sites belong to a layer"),
        }
    }
}

/// A pass's dropout: the probability (0 for evaluation) and the step's seed.
#[derive(Clone, Copy, Debug)]
struct Dropout {
    p: f32,
    seed: u64,
}

/// A pass's per-block context: the layer, its weights (the unit's slice, indexed by `bp`) and
/// the pass's operators.
struct Block<'o, 'a> {
    ops: &'o Ops<'a>,
    l: usize,
    w: &'o [f32],
    bp: &'o BlockParams,
}

/// One block's activations for a pass (see [`Acts`]): its kept and inner sets, and the
/// attention core's outputs shared by every layer under selective recomputation.
struct BlockActs<'a> {
    k: &'a mut BlockKept,
    i: &'a mut BlockInner,
    shared: &'a mut AttnCore,
}

/// One of a block's projections, `y = x·Wᵀ (+ b)` plus the LoRA adapters at its site. The site
/// names its adapters and its FP8 scaling slots; under FP8 its inputs are cast first (E4M3 in
/// forward, the output gradient E5M2 in backward) and it accumulates in fp32.
struct Linear<'o, 'a> {
    ops: &'o Ops<'a>,
    l: usize,
    site: Site,
    /// The unit's parameters, and this projection's weight `[n_out, n_in]` and bias in it.
    unit: &'o [f32],
    w: Range<usize>,
    /// The weight when QLoRA's base holds it quantized (then `w` is empty).
    q: Option<tensor::quant::QMat<'o>>,
    b: Option<Range<usize>>,
    n_in: usize,
    n_out: usize,
}

/// The tensor a cast belongs to, for its FP8 scaling slot (and its scratch buffer).
#[derive(Clone, Copy)]
enum Fp8Role {
    Input = 0,
    Weight = 1,
    Grad = 2,
}

impl Linear<'_, '_> {
    /// The FP8 scaling slot of this projection's `role` tensor.
    fn fp8_slot(&self, role: Fp8Role) -> usize {
        Fp8State::slot(self.l, self.site as usize, role as usize)
    }

    /// `out[N, n_out] = x[N, n_in]·Wᵀ (+ b) + LoRA(x)`, overwriting `out`.
    fn forward(&self, out: &mut [f32], x: &[f32]) {
        let ops = self.ops;
        let (n, w, b) = (ops.b * ops.t, &self.unit[self.w.clone()], self.b.as_ref().map(|r| &self.unit[r.clone()]));
        match (ops.fp8, self.q.as_ref()) {
            (_, Some(q)) => tensor::quant::qmatmul_forward(ops.arith, ops.store, out, x, q, b, (n, self.n_in, self.n_out)),
            (Some(st), None) => {
                use tensor::precision::Format::E4m3;
                let whole = |a: f32| ops.amax_over_shards(a);
                let mut st = st.borrow_mut();
                let xq = st.cast(self.fp8_slot(Fp8Role::Input), Fp8Role::Input as usize, x, E4m3, &whole).as_ptr();
                let wq = st.cast(self.fp8_slot(Fp8Role::Weight), Fp8Role::Weight as usize, w, E4m3, &whole);
                // SAFETY: scratch buffers 0 and 1 are distinct and not resized until the next cast.
                let xq = unsafe { std::slice::from_raw_parts(xq, x.len()) };
                tensor::matmul::matmul_forward_as(ops.arith, out, xq, wq, b, (n, self.n_in, self.n_out));
            }
            (None, None) => tensor::matmul::matmul_forward_as(ops.arith, out, x, w, b, (n, self.n_in, self.n_out)),
        }
        if let Some(lo) = ops.lora.borrow_mut().as_deref_mut() {
            lo.forward(self.l, self.site, out, x, n, self.n_out);
        }
    }

    /// The backward of [`Linear::forward`]: writes `dinp[N, n_in]` (overwriting it), and
    /// accumulates the adapters' gradients and, unless the base weights are frozen (LoRA), the
    /// weight's and bias's in the unit's gradients `dunit`. Under FP8 the inputs are re-cast as forward cast them (the same
    /// scales within a step).
    fn backward(&self, dinp: &mut [f32], dunit: &mut [f32], dout: &[f32], x: &[f32]) {
        let ops = self.ops;
        let (n, c, oc) = (ops.b * ops.t, self.n_in, self.n_out);
        let w = &self.unit[self.w.clone()];
        let (dw, db) = split_two(dunit, &self.w, &self.b);
        let frozen = ops.lora.borrow().is_some();
        let mut st = ops.fp8.map(|s| s.borrow_mut());
        let (xq, wq, gq) = match st.as_mut() {
            Some(st) => {
                use tensor::precision::Format::{E4m3, E5m2};
                let whole = |a: f32| ops.amax_over_shards(a);
                let xq = st.cast(self.fp8_slot(Fp8Role::Input), Fp8Role::Input as usize, x, E4m3, &whole).as_ptr();
                let wq = st.cast(self.fp8_slot(Fp8Role::Weight), Fp8Role::Weight as usize, w, E4m3, &whole).as_ptr();
                let gq = st.cast(self.fp8_slot(Fp8Role::Grad), Fp8Role::Grad as usize, dout, E5m2, &whole).as_ptr();
                // SAFETY: the three scratch buffers are distinct and not resized until the next
                // cast, which comes after the products below.
                unsafe { (std::slice::from_raw_parts(xq, x.len()), std::slice::from_raw_parts(wq, w.len()), std::slice::from_raw_parts(gq, dout.len())) }
            }
            None => (x, w, dout),
        };
        if self.q.is_some() || frozen {
            // Their input-gradient products accumulate.
            tensor::par::zero(dinp);
        }
        if let Some(q) = &self.q {
            tensor::quant::qmatmul_backward_input(ops.arith, ops.store, dinp, gq, q, (n, c, oc));
        } else if frozen {
            tensor::matmul::matmul_backward_input_as(ops.arith, dinp, gq, wq, n, c, oc);
        } else {
            tensor::matmul::matmul_backward_into_as(ops.arith, (dinp, dw, db), gq, xq, wq, (n, c, oc));
        }
        drop(st);
        if let Some(lo) = ops.lora.borrow_mut().as_deref_mut() {
            lo.backward((self.l, self.site), dinp, dout, x, n, oc);
        }
    }

    /// A column-parallel projection (its output columns this shard's heads or MLP columns):
    /// from the norm's output `local`, gathered along the sequence into `full` first under
    /// sequence parallelism; the output rounded to the storage precision.
    fn forward_column(&self, out: &mut [f32], local: &[f32], full: &mut [f32]) {
        let x = self.ops.column_input(local, full);
        self.forward(out, x);
        self.ops.store(out);
    }

    /// A row-parallel projection into the branch: this shard's partial sum summed over the
    /// shards (or reduce-scattered along the sequence, through the whole-sequence `full`).
    fn forward_row(&self, branch: &mut [f32], full: &mut [f32], x: &[f32]) {
        let bias = self.b.as_ref().map(|r| &self.unit[r.clone()]);
        self.ops.row_parallel(branch, full, bias, |y| self.forward(y, x));
    }

    /// The backward of [`Linear::forward_column`]: the input's gradient summed over the shards
    /// (or reduce-scattered along the sequence) into `dln`, accumulating the parameters'.
    /// `x` is the input forward used (gathered under sequence parallelism).
    fn backward_column(&self, dln: &mut [f32], dfull: &mut [f32], dunit: &mut [f32], dout: &[f32], x: &[f32]) {
        self.ops.column_input_grad(dln, dfull, |d| self.backward(d, dunit, dout, x));
    }

    /// The backward of [`Linear::forward_row`]: `dinp` (overwritten) from the branch's
    /// gradient, gathered along the sequence first under sequence parallelism; rounded to the
    /// storage precision.
    fn backward_row(&self, dinp: &mut [f32], dfull: &mut [f32], dunit: &mut [f32], dbranch: &[f32], x: &[f32]) {
        let d = self.ops.row_parallel_grad(dbranch, dfull);
        self.backward(dinp, dunit, d, x);
        self.ops.store(dinp);
    }
}

impl<'o, 'a> Block<'o, 'a> {
    /// The projection at `site`.
    fn linear(&self, site: Site) -> Linear<'o, 'a> {
        let (cfg, bp) = (self.ops.cfg, self.bp);
        let c = cfg.n_embd;
        let (w, b, n_in, n_out) = match site {
            Site::Qkv => (&bp.c_attn_w, &bp.c_attn_b, c, cfg.qkv_width()),
            Site::AttnProj => (&bp.attn_proj_w, &bp.attn_proj_b, cfg.o_width(), c),
            Site::Fc => (&bp.c_fc_w, &bp.c_fc_b, c, cfg.dense_fc_width()),
            Site::MlpProj => (&bp.mlp_proj_w, &bp.mlp_proj_b, cfg.dense_hidden(), c),
        };
        let q = self.ops.base.and_then(|qb| qb.matrix(self.l, site));
        Linear { ops: self.ops, l: self.l, site, unit: self.w, w: w.clone(), q, b: b.clone(), n_in, n_out }
    }

    /// A norm's weight and bias.
    fn norm(&self, w: &Range<usize>, b: &Option<Range<usize>>) -> (&'o [f32], Option<&'o [f32]>) {
        (&self.w[w.clone()], b.as_ref().map(|r| &self.w[r.clone()]))
    }

    /// The norm before a branch into `out` (its statistics beside it), rounded to the storage
    /// format; a copy of `x` when the block has none there (an empty weight range).
    fn pre_norm_forward(&self, w: &Range<usize>, b: &Option<Range<usize>>, x: &[f32], (out, mean, rstd): (&mut [f32], &mut [f32], &mut [f32])) {
        if w.is_empty() {
            out.copy_from_slice(x);
        } else {
            let (w, b) = self.norm(w, b);
            self.ops.norm_forward(out, mean, rstd, x, w, b);
        }
        self.ops.store(out);
    }

    /// The backward of [`Block::pre_norm_forward`]: the gradient `dout` of its output adds its
    /// input's into `dinp` (the residual stream's), the weight's into the unit's `dw`.
    fn pre_norm_backward(&self, (w, b): (&Range<usize>, &Option<Range<usize>>), dinp: &mut [f32], dw: &mut [f32], dout: &[f32], (x, mean, rstd): (&[f32], &[f32], &[f32])) {
        if w.is_empty() {
            for (d, g) in dinp.iter_mut().zip(dout) {
                *d += g;
            }
            return;
        }
        let dwb = split_two(dw, w, b);
        self.ops.norm_backward(dinp, dwb, dout, x, &self.w[w.clone()], (mean, rstd));
    }

    /// The norm after branch `which` (0 attention, 1 MLP), in place on its output `branch`:
    /// the input kept (rounded to the storage format) with its `rstd` in `i.post_in`.
    fn post_norm_forward(&self, w: &Option<Range<usize>>, which: usize, branch: &mut [f32], i: &mut BlockInner) {
        let Some(w) = w else { return };
        let n = branch.len();
        let (inp, rstd) = (&mut i.post_in[which * n..(which + 1) * n], &mut i.post_rstd[which * n / self.ops.cfg.n_embd..(which + 1) * n / self.ops.cfg.n_embd]);
        inp.copy_from_slice(branch);
        self.ops.store(inp);
        self.ops.norm_forward(branch, &mut [], rstd, inp, &self.w[w.clone()], None);
    }

    /// The backward of [`Block::post_norm_forward`]: from the gradient `d` of its output, its
    /// input's into `dpost` (returned), the weight's into the unit's `dw`; `d` itself without
    /// the norm.
    fn post_norm_backward<'g>(&self, w: &Option<Range<usize>>, which: usize, (d, dpost): (&'g [f32], &'g mut [f32]), dw: &mut [f32], i: &BlockInner) -> &'g [f32] {
        let Some(w) = w else { return d };
        let n = d.len();
        let c = self.ops.cfg.n_embd;
        tensor::par::zero(dpost);
        self.ops.norm_backward(dpost, (&mut dw[w.clone()], None), d, &i.post_in[which * n..(which + 1) * n], &self.w[w.clone()], (&[], &i.post_rstd[which * n / c..(which + 1) * n / c]));
        self.ops.store(dpost);
        dpost
    }

    /// The attention's input from the kept `ln_1`: `qkv = ln_1·Wᵀ (+ LoRA)` (LLaMA: q and k then
    /// rotated).
    fn qkv_forward(&self, k: &BlockKept, i: &mut BlockInner) {
        if let Some(m) = &self.bp.mla {
            // DeepSeek's latent attention, column-parallel over the heads like q|k|v: a
            // tensor-parallel part computes the (replicated) latents and its heads' q, k, v, from
            // the norm's output gathered along the sequence under sequence parallelism.
            let ops = self.ops;
            let w = crate::mla::MlaWeights { unit: self.w, p: m, arith: ops.arith };
            let x = ops.column_input(&k.ln_1, &mut i.ln_1_full);
            crate::mla::mla_forward(&mut i.qkv, &mut i.mla, x, &w, &crate::mla::MlaDims::of(ops.cfg, ops.b * ops.t));
            // The latents rounded as they are kept (the heads' values when the core has run).
            let ([cq, cqn, kvl, kvn, _], _) = i.mla.parts();
            [cq, cqn, kvl, kvn].into_iter().for_each(|v| ops.store(v));
            ops.store(&mut i.qkv);
        } else {
            self.linear(Site::Qkv).forward_column(&mut i.qkv, &k.ln_1, &mut i.ln_1_full);
        }
        if let Some(r) = &self.bp.qk_norm_w {
            let cfg = self.ops.cfg;
            qk_rmsnorm_forward(&mut i.qkv, &mut i.qk_pre, &mut i.qk_rstd, &self.ops.norm_weight(&self.w[r.clone()]), cfg.norm_eps, (cfg.n_head, cfg.n_kv_head, cfg.head_size()));
        }
        if self.ops.rope_forward(&mut i.qkv, self.l) {
            // The rotated q and k are what is kept: stored in the format too.
            self.ops.store(&mut i.qkv);
        }
    }

    /// The attention core: attention over the kept (rotated) q|k|v into `core`'s output and
    /// log-sum-exp — what selective recomputation re-runs.
    fn attn_core(&self, qkv: &[f32], core: &mut AttnCore) {
        self.ops.attn_forward(&mut core.atty, &mut core.state, qkv, DropSite::AttnProbs(self.l));
        self.ops.store(&mut core.atty);
    }

    /// The MLP from the kept `ln_2`: its hidden activations, and with `proj` its output (before
    /// dropout) in `branch`. An MoE layer always writes its output (the combine is part of its
    /// forward). Without `proj` the dense output projection and its LoRA adapter are skipped:
    /// backward reads neither the output nor anything the adapter saves there (its `x·Aᵀ` is
    /// kept per layer in the adapter from forward).
    fn mlp_forward(&self, k: &BlockKept, i: &mut BlockInner, branch: &mut [f32], full: &mut [f32], proj: bool) -> Option<MoeStats> {
        let ops = self.ops;
        if let (Some(mp), Some(cache)) = (&self.bp.moe, i.moe.as_mut()) {
            // A tensor-parallel part holds the experts whole and runs the layer on every token
            // (under sequence parallelism: the sequence gathered, its positions kept after).
            let (cfg, w) = (ops.cfg, self.w);
            let x = ops.column_input(&k.ln_2, &mut i.ln_2_full);
            let mut ep = ops.ep.borrow_mut();
            let inp = MoeInputs { x, router_w: &w[mp.router.clone()], experts_w: &w[mp.experts.clone()], shared_w: &w[mp.shared.clone()], router_bias: &w[mp.router_bias.clone()] };
            let loss = MoeLossWeights { aux: cfg.moe_aux_weight, z: cfg.moe_z_weight };
            let y = if ops.sp() { &mut *full } else { &mut *branch };
            let stats = moe_forward(y, cache, inp, &cfg.moe_dims(ops.b * ops.t), loss, ep.as_deref_mut().map(|h| h as &mut dyn MoeExchange));
            if ops.sp() {
                ops.take_seq(full, branch);
            }
            return Some(stats);
        }
        self.linear(Site::Fc).forward_column(&mut i.fch, &k.ln_2, &mut i.ln_2_full);
        ops.act_forward(&mut i.fch_gelu, &i.fch);
        ops.store(&mut i.fch_gelu);
        if proj {
            self.linear(Site::MlpProj).forward_row(branch, full, &i.fch_gelu);
        }
        None
    }

    /// The MLP's backward from `dout` (the gradient of its output): `g.dln` (zeroed here) gets
    /// the gradient of its input `ln_2`, `dw` the parameters'.
    fn mlp_backward(&self, dw: &mut [f32], dout: &[f32], k: &BlockKept, i: &mut BlockInner, g: &mut MlpGrads) {
        let ops = self.ops;
        if let (Some(mp), Some(cache)) = (&self.bp.moe, i.moe.as_mut()) {
            // The router's losses join the objective with the same scale as the main loss.
            let (cfg, w) = (ops.cfg, self.w);
            let (aux, z) = (cfg.moe_aux_weight * ops.loss_scale, cfg.moe_z_weight * ops.loss_scale);
            // The sigmoid router's correction bias (between the router and the experts) gets no
            // gradient.
            let (dr, rest_w) = dw[mp.router.start..mp.shared.end].split_at_mut(mp.router.len());
            let (de, ds) = rest_w[mp.router_bias.len()..].split_at_mut(mp.experts.len());
            let mut ep = ops.ep.borrow_mut();
            // Under sequence parallelism the whole sequence's (see `mlp_forward`).
            let (x, dy): (&[f32], &[f32]) = if ops.sp() { (&i.ln_2_full, ops.row_parallel_grad(dout, g.dfull)) } else { (&k.ln_2, dout) };
            let dx = if ops.sp() { &mut *g.dln_full } else { &mut *g.dln };
            tensor::par::zero(dx);
            let grads = MoeGrads { dx, drouter_w: dr, dexperts_w: de, dshared_w: ds };
            let inp = MoeInputs { x, router_w: &w[mp.router.clone()], experts_w: &w[mp.experts.clone()], shared_w: &w[mp.shared.clone()], router_bias: &w[mp.router_bias.clone()] };
            moe_backward(grads, dy, cache, inp, &cfg.moe_dims(ops.b * ops.t), MoeLossWeights { aux, z }, ep.as_deref_mut().map(|h| h as &mut dyn MoeExchange));
            if cfg.moe_bias_rate > 0.0 {
                // Loss-free balancing's signal in the bias's gradient slot: each expert's
                // token-assignments over their mean, summed over the micro-batches and ranks like
                // a gradient (the optimizer moves the bias by the rate against its sign), scaled
                // far below every gradient so the step's norm never sees it.
                let d = cfg.moe_dims(ops.b * ops.t);
                let mean = (d.n * d.k) as f32 / d.e as f32;
                for (g, &cnt) in dw[mp.router_bias.clone()].iter_mut().zip(&cache.counts) {
                    *g += (cnt as f32 - mean) * BIAS_SIGNAL_SCALE;
                }
            }
            if ops.sp() {
                ops.take_seq(g.dln_full, g.dln);
            }
            return;
        }
        self.linear(Site::MlpProj).backward_row(g.dfch_gelu, g.dfull, dw, dout, &i.fch_gelu);
        ops.act_backward(g.dfch, g.dfch_gelu, &i.fch);
        ops.store(g.dfch);
        let x: &[f32] = if ops.sp() { &i.ln_2_full } else { &k.ln_2 };
        self.linear(Site::Fc).backward_column(g.dln, g.dln_full, dw, g.dfch, x);
    }
}

/// Backward scratch the MLP's backward writes (borrowed from [`GradScratch`]).
struct MlpGrads<'a> {
    dln: &'a mut [f32],
    dln_full: &'a mut [f32],
    dfull: &'a mut [f32],
    dfch: &'a mut [f32],
    dfch_gelu: &'a mut [f32],
}

/// One block's forward from its input `x[B, T, C]` into its activations, returning the MoE
/// layer's routing statistics:
/// `res_2 = x + drop(post_1(attn(norm_1(x))));  out = res_2 + drop(post_2(mlp(norm_2(res_2))))`,
/// where the norms before the branches (`norm_1`, `norm_2`) or after them (`post_1`, `post_2`)
/// are the identity when the block has none (`model.block_norms`). `branch` and `full` are
/// forward scratch. With `out` `None` (the recomputation in backward) the tail that backward
/// never reads — the dense MLP's output projection, its dropout and the residual add — is
/// skipped (not the projection when a norm follows it: backward reads its input).
fn block_forward(blk: &Block, x: &[f32], acts: BlockActs, branch: &mut [f32], full: &mut [f32], out: Option<&mut [f32]>) -> Option<MoeStats> {
    let (ops, bp, l) = (blk.ops, blk.bp, blk.l);
    let BlockActs { k, i, shared } = acts;
    // res_2 = x + drop(post_1(attn(norm_1(x))))
    blk.pre_norm_forward(&bp.ln_1_w, &bp.ln_1_b, x, (&mut k.ln_1, &mut k.ln_1_mean, &mut k.ln_1_rstd));
    blk.qkv_forward(k, i);
    let core = if i.core.atty.is_empty() { shared } else { &mut i.core };
    blk.attn_core(&i.qkv, core);
    let o_in: &[f32] = if bp.mla.is_some() {
        crate::mla::compact_heads(&mut i.mla.o_in, &core.atty, &crate::mla::MlaDims::of(ops.cfg, ops.b * ops.t));
        ops.store(&mut i.mla.o_in);
        &i.mla.o_in
    } else {
        &core.atty
    };
    blk.linear(Site::AttnProj).forward_row(branch, full, o_in);
    blk.post_norm_forward(&bp.post_1_w, 0, branch, i);
    ops.dropout(branch, DropSite::AttnResidual(l));
    residual_forward(&mut k.res_2, x, branch);
    ops.store(&mut k.res_2);
    // out = res_2 + drop(post_2(mlp(norm_2(res_2))))
    blk.pre_norm_forward(&bp.ln_2_w, &bp.ln_2_b, &k.res_2, (&mut k.ln_2, &mut k.ln_2_mean, &mut k.ln_2_rstd));
    let stats = blk.mlp_forward(k, i, branch, full, out.is_some() || bp.post_2_w.is_some());
    blk.post_norm_forward(&bp.post_2_w, 1, branch, i);
    if let Some(out) = out {
        ops.dropout(branch, DropSite::MlpResidual(l));
        residual_forward(out, &k.res_2, branch);
        ops.store(out);
    }
    stats
}

/// One block's backward, [`block_forward`]'s steps in reverse: `g.dres` holds the gradient of
/// the block's output and leaves holding its input's, and the block's parameter gradients
/// accumulate into `dw` (the unit's):
/// `d res_2 = d out + norm_2ᵀ(mlpᵀ(dropᵀ(d out)));  d x = d res_2 + norm_1ᵀ(attnᵀ(dropᵀ(d res_2)))`.
fn block_backward(blk: &Block, dw: &mut [f32], x: &[f32], acts: BlockActs, g: &mut GradScratch) {
    let (ops, bp, l) = (blk.ops, blk.bp, blk.l);
    let BlockActs { k, i, shared } = acts;
    // MLP branch: out = res_2 + drop(post_2(mlp(ln_2))); d res_2 = d out (straight through) + ln_2ᵀ(…)
    let dmlp = ops.dropout_grad(&mut g.dbranch, &g.dres, DropSite::MlpResidual(l));
    let dmlp = blk.post_norm_backward(&bp.post_2_w, 1, (dmlp, &mut g.dpost), dw, i);
    let mut mg = MlpGrads { dln: &mut g.dln, dln_full: &mut g.dln_full, dfull: &mut g.dfull, dfch: &mut g.dfch, dfch_gelu: &mut g.dfch_gelu };
    blk.mlp_backward(dw, dmlp, k, i, &mut mg);
    ops.store(&mut g.dln);
    blk.pre_norm_backward((&bp.ln_2_w, &bp.ln_2_b), &mut g.dres, dw, &g.dln, (&k.res_2, &k.ln_2_mean, &k.ln_2_rstd));
    ops.store(&mut g.dres);
    // Attention branch: res_2 = x + drop(post_1(attn(ln_1))); d x = d res_2 + ln_1ᵀ(…)
    let dattn = ops.dropout_grad(&mut g.dbranch, &g.dres, DropSite::AttnResidual(l));
    let dattn = blk.post_norm_backward(&bp.post_1_w, 0, (dattn, &mut g.dpost), dw, i);
    let core: &AttnCore = if i.core.atty.is_empty() { shared } else { &i.core };
    if bp.mla.is_some() {
        blk.linear(Site::AttnProj).backward_row(&mut g.mla.do_in, &mut g.dfull, dw, dattn, &i.mla.o_in);
        crate::mla::expand_heads(&mut g.datty, &g.mla.do_in, &crate::mla::MlaDims::of(ops.cfg, ops.b * ops.t));
    } else {
        blk.linear(Site::AttnProj).backward_row(&mut g.datty, &mut g.dfull, dw, dattn, &core.atty);
    }
    tensor::par::zero(&mut g.dqkv);
    ops.attn_backward(&mut g.dqkv, &g.datty, &i.qkv, &core.atty, &core.state, DropSite::AttnProbs(l));
    if let Some(r) = &bp.qk_norm_w {
        // Qwen3's per-head norms: d(normed q, k) → d(projected q, k), in place.
        let cfg = ops.cfg;
        qk_rmsnorm_backward(&mut g.dqkv, &mut dw[r.clone()], &i.qk_pre, &ops.norm_weight(&blk.w[r.clone()]), &i.qk_rstd, (cfg.n_head, cfg.n_kv_head, cfg.head_size()));
    }
    ops.store(&mut g.dqkv);
    let xin: &[f32] = if ops.sp() { &i.ln_1_full } else { &k.ln_1 };
    match &bp.mla {
        Some(m) => {
            // The input's gradient summed over the parts (reduce-scattered under sequence
            // parallelism), as a column-parallel product's.
            let w = crate::mla::MlaWeights { unit: blk.w, p: m, arith: ops.arith };
            let d = crate::mla::MlaDims::of(ops.cfg, ops.b * ops.t);
            let mg = &mut g.mla;
            ops.column_input_grad(&mut g.dln, &mut g.dln_full, |dx| crate::mla::mla_backward(dx, dw, &g.dqkv, (&i.mla, xin), &w, &d, mg));
        }
        None => blk.linear(Site::Qkv).backward_column(&mut g.dln, &mut g.dln_full, dw, &g.dqkv, xin),
    }
    ops.store(&mut g.dln);
    blk.pre_norm_backward((&bp.ln_1_w, &bp.ln_1_b), &mut g.dres, dw, &g.dln, (x, &k.ln_1_mean, &k.ln_1_rstd));
    ops.store(&mut g.dres);
}

/// Disjoint mutable views of a weight and its optional bias in the gradient buffer.
fn split_two<'a>(g: &'a mut [f32], w: &std::ops::Range<usize>, b: &Option<std::ops::Range<usize>>) -> (&'a mut [f32], Option<&'a mut [f32]>) {
    match b {
        None => (&mut g[w.clone()], None),
        Some(b) => {
            let (x, y) = split_pair(g, w, b);
            (x, Some(y))
        }
    }
}

/// Two disjoint ranges of one buffer, mutably.
fn split_pair<'a>(g: &'a mut [f32], r1: &std::ops::Range<usize>, r2: &std::ops::Range<usize>) -> (&'a mut [f32], &'a mut [f32]) {
    assert!(r1.end <= r2.start || r2.end <= r1.start, "overlapping parameter views");
    if r1.end <= r2.start {
        let (lo, hi) = g.split_at_mut(r2.start);
        (&mut lo[r1.clone()], &mut hi[..r2.len()])
    } else {
        let (lo, hi) = g.split_at_mut(r1.start);
        (&mut hi[..r1.len()], &mut lo[r2.clone()])
    }
}

/// A model's rotary tables `(cos, sin)`, `[block_size, HS/2]` each: one pair, or with LongRoPE
/// a second pair for passes longer than its original context.
pub(crate) struct RopeTables {
    short: CosSin,
    /// `(original context, tables)`, built only when `block_size` exceeds that context.
    long: Option<(usize, CosSin)>,
    /// The sliding-window layers' own tables (`GptConfig::rope_local_theta`, Gemma 3).
    local: Option<CosSin>,
}

/// Rotary tables `(cos, sin)`, `[block_size, HS/2]` each.
type CosSin = (Vec<f32>, Vec<f32>);

impl RopeTables {
    fn new(cfg: &GptConfig) -> RopeTables {
        let after = cfg.rope_scaling.as_ref().and_then(|r| r.long_after()).filter(|&n| cfg.block_size > n);
        RopeTables { short: cfg.rope_tables(false), long: after.map(|n| (n, cfg.rope_tables(true))), local: cfg.rope_local_tables() }
    }

    /// The sliding-window layers' tables when their base differs (any pass length).
    pub(crate) fn local(&self) -> Option<&CosSin> {
        self.local.as_ref()
    }

    /// The tables of a pass over `len` positions (transformers picks LongRoPE's set per pass,
    /// by its largest position + 1).
    pub(crate) fn for_pass(&self, len: usize) -> &CosSin {
        match &self.long {
            Some((after, t)) if len > *after => t,
            _ => &self.short,
        }
    }
}

/// A pass's length as transformers' rotary update sees it: its largest position + 1 (`t`
/// unless packed documents restart their positions), over the whole rows.
fn pass_len(docs: &Option<Docs>, t: usize) -> usize {
    docs.as_ref().and_then(|d| d.pos.iter().max()).map_or(t, |&p| p as usize + 1)
}

/// The operators whose kernels depend on the architecture: normalisation, attention (with the
/// rotary embedding for LLaMA) and the MLP activation. Thin dispatch, so the block above reads
/// the same for every family.
pub(crate) struct Ops<'a> {
    pub cfg: &'a GptConfig,
    pub rope: Option<&'a (Vec<f32>, Vec<f32>)>,
    /// The sliding-window layers' rotary tables when their base differs (Gemma 3).
    pub rope_local: Option<&'a (Vec<f32>, Vec<f32>)>,
    pub b: usize,
    pub t: usize,
    /// The pass's packed documents (`None`: one document per row, positions `0..T`).
    docs: Option<Docs<'a>>,
    /// The pass's dropout.
    drop: Dropout,
    /// The training pass's loss-gradient scale (the MoE router losses' weights use it).
    loss_scale: f32,
    /// The LoRA adapters (then the base weights are frozen).
    lora: RefCell<Option<&'a mut Lora>>,
    /// The tensor-parallel hooks of a shard (`None` for a whole model).
    pub tp: RefCell<Option<&'a mut (dyn TpHooks + 'static)>>,
    /// The expert-parallel exchange of a shard (`None`: every expert is local).
    pub ep: RefCell<Option<&'a mut (dyn MoeExchange + Send + 'static)>>,
    /// The context-parallel attention of a part (`None`: every position is local).
    pub cp: RefCell<Option<&'a mut (dyn CpHooks + 'static)>>,
    /// Where stored activations and gradients are rounded to (mixed precision).
    pub store: Option<tensor::precision::Format>,
    /// The block projections' arithmetic ([`arith`]).
    pub arith: tensor::matmul::Arith,
    /// FP8 matmul inputs' scaling state.
    pub fp8: Option<&'a std::cell::RefCell<Fp8State>>,
    /// [`crate::Placement::batch_offset`].
    pub b0: usize,
    /// QLoRA's quantized base, whose matrices the projections read.
    base: Option<&'a crate::qbase::QuantBase>,
}

impl<'a> Ops<'a> {
    /// The operators of single-token decoding on a whole model (no dropout, no precision).
    pub(crate) fn decode(cfg: &'a GptConfig, rope: Option<&'a (Vec<f32>, Vec<f32>)>, rope_local: Option<&'a (Vec<f32>, Vec<f32>)>) -> Ops<'a> {
        Ops {
            cfg, rope, rope_local, b: 1, t: 1, docs: None, drop: Dropout { p: 0.0, seed: 0 }, loss_scale: 1.0,
            tp: RefCell::new(None), ep: RefCell::new(None), cp: RefCell::new(None), lora: RefCell::new(None), store: None, arith: Default::default(), fp8: None, b0: 0, base: None,
        }
    }

    /// The mask seed of a dropout site, numbered in the whole model: 0 the embedding, then
    /// three per block (attention probabilities, attention residual, MLP residual).
    fn site_seed(&self, site: DropSite) -> u64 {
        let block = |l: usize| 1 + 3 * (self.cfg.first_layer() + l) as u64;
        let n = match site {
            DropSite::Embedding => 0,
            DropSite::AttnProbs(l) => block(l),
            DropSite::AttnResidual(l) => block(l) + 1,
            DropSite::MlpResidual(l) => block(l) + 2,
        };
        site_seed(self.drop.seed, n)
    }

    /// Dropout at `site` on the residual stream's rows `x`, in place.
    fn dropout(&self, x: &mut [f32], site: DropSite) {
        if self.drop.p > 0.0 {
            dropout_inplace_rows(x, self.drop.p, self.site_seed(site), self.cfg.n_embd, self.row_map());
        }
    }

    /// The gradient through dropout at `site`: `dout` itself without dropout, else the masked
    /// copy written into `buf`.
    fn dropout_grad<'x>(&self, buf: &'x mut [f32], dout: &'x [f32], site: DropSite) -> &'x [f32] {
        if self.drop.p == 0.0 {
            return dout;
        }
        buf.fill(0.0);
        dropout_backward_rows(buf, dout, self.drop.p, self.site_seed(site), self.cfg.n_embd, self.row_map());
        buf
    }

    /// The largest of the tensor-parallel shards' `a` (`a` without tensor parallelism).
    fn amax_over_shards(&self, a: f32) -> f32 {
        match self.tp.borrow_mut().as_mut() {
            Some(h) => h.all_gather(&[a]).into_iter().fold(a, |m, x| if m.is_nan() || x.is_nan() { f32::NAN } else { m.max(x) }),
            _ => a,
        }
    }

    /// Rounds a stored activation (or activation gradient) to the storage precision.
    fn store(&self, x: &mut [f32]) {
        if let Some(f) = self.store {
            tensor::precision::round_slice(x, f);
        }
    }

    /// Sequence parallelism: this shard holds `T/t` positions of the residual stream.
    fn sp(&self) -> bool {
        self.cfg.place.seq.is_some() && self.tp.borrow().is_some()
    }

    /// Where the residual stream's rows sit in the whole `[B, T]` (for dropout masks).
    /// Under context parallelism `t` is the part's rows per sequence, of `t·cp` positions.
    fn row_map(&self) -> RowMap {
        let (t, chunks) = match self.cfg.place.context {
            Some(cx) => {
                let tg = self.t * cx.count;
                let ch = cx.chunks(tg);
                (tg, Some(Chunks { len: ch[0].1, first: ch[0].0, second: ch.get(1).map_or(0, |c| c.0) }))
            }
            None => (self.t, None),
        };
        match self.cfg.place.seq {
            Some(s) => {
                let p = s.positions(self.t);
                RowMap { t_local: p.len(), t, offset: p.start, b0: self.b0, chunks }
            }
            None => RowMap { t_local: self.t, t, offset: 0, b0: self.b0, chunks },
        }
    }

    /// Sequence parallel: `local` gathered along the sequence into `full`.
    fn gather_seq(&self, local: &[f32], full: &mut [f32]) {
        self.tp.borrow_mut().as_mut().expect("sequence parallel needs tensor-parallel hooks").gather_seq(local, full, self.b, self.t);
    }

    /// Sequence parallel: the partial sums in `full` reduce-scattered into this shard's `local`.
    fn scatter_seq(&self, full: &mut [f32], local: &mut [f32], bias: Option<&[f32]>) {
        self.tp.borrow_mut().as_mut().expect("sequence parallel needs tensor-parallel hooks").scatter_seq(full, local, bias, self.b, self.t);
    }

    /// Sequence parallel: this shard's positions of `full` (`[B, T, C]`, the same on every
    /// shard) into `local`.
    fn take_seq(&self, full: &[f32], local: &mut [f32]) {
        let p = self.cfg.place.seq.expect("sequence parallel").positions(self.t);
        let c = full.len() / (self.b * self.t);
        for bi in 0..self.b {
            local[bi * p.len() * c..(bi + 1) * p.len() * c].copy_from_slice(&full[(bi * self.t + p.start) * c..(bi * self.t + p.end) * c]);
        }
    }

    /// A column-parallel product's input: the norm's output `local` itself, or under sequence
    /// parallelism gathered into `full` (Megatron-SP's `g`).
    fn column_input<'x>(&self, local: &'x [f32], full: &'x mut [f32]) -> &'x [f32] {
        if self.sp() {
            self.gather_seq(local, full);
            full
        } else {
            local
        }
    }

    /// A row-parallel product into the branch: `product` writes this shard's partial sum, into
    /// `branch` (then all-reduced, `g`) or under sequence parallelism into the whole-sequence
    /// `full` (then reduce-scattered into `branch`, `ḡ`). Without tensor parallelism: just
    /// `product(branch)`.
    fn row_parallel(&self, branch: &mut [f32], full: &mut [f32], bias: Option<&[f32]>, product: impl FnOnce(&mut [f32])) {
        if self.sp() {
            product(full);
            self.scatter_seq(full, branch, bias);
        } else {
            product(branch);
            self.tp_reduce_output(branch, bias);
        }
    }

    /// A row-parallel product's output gradient: `d` itself, or under sequence parallelism
    /// gathered along the sequence into `full` (the backward of the reduce-scatter).
    fn row_parallel_grad<'x>(&self, d: &'x [f32], full: &'x mut [f32]) -> &'x [f32] {
        self.column_input(d, full)
    }

    /// A column-parallel product's input gradient, computed by `product` (which overwrites its
    /// buffer): summed over the shards into `dln` (all-reduce), or under sequence parallelism
    /// reduce-scattered from the whole-sequence `dfull` into `dln` (this shard's positions).
    fn column_input_grad(&self, dln: &mut [f32], dfull: &mut [f32], product: impl FnOnce(&mut [f32])) {
        if self.sp() {
            product(dfull);
            self.scatter_seq(dfull, dln, None);
        } else {
            product(dln);
            self.tp_reduce_input_grad(dln);
        }
    }

    /// A tensor-parallel shard's rows of the (padded) vocabulary; `None` for a whole model.
    fn vocab_rows(&self) -> Option<std::ops::Range<usize>> {
        self.cfg.place.vocab.map(|v| v.first..v.first + self.cfg.vocab_size)
    }

    /// Megatron's `g`: sums a row-parallel product's partial outputs over the shards.
    fn tp_reduce_output(&self, out: &mut [f32], bias: Option<&[f32]>) {
        if let Some(h) = self.tp.borrow_mut().as_mut() {
            h.reduce_output(out, bias);
        }
    }

    /// Megatron's `f` backward: sums a column-parallel product's input gradients.
    fn tp_reduce_input_grad(&self, dx: &mut [f32]) {
        if let Some(h) = self.tp.borrow_mut().as_mut() {
            h.reduce_input_grad(dx);
        }
    }

    pub(crate) fn norm_forward(&self, out: &mut [f32], mean: &mut [f32], rstd: &mut [f32], x: &[f32], w: &[f32], bias: Option<&[f32]>) {
        let c = self.cfg.n_embd;
        let w = &self.norm_weight(w)[..];
        match self.cfg.arch {
            Arch::Gpt2 => layernorm_forward(out, mean, rstd, x, w, bias, c),
            Arch::Llama => rmsnorm_forward(out, rstd, x, w, self.cfg.norm_eps, c),
        }
    }

    /// `(dw, db)`: the weight's and bias's gradients; `(mean, rstd)`: the forward's statistics.
    fn norm_backward(&self, dinp: &mut [f32], (dw, db): (&mut [f32], Option<&mut [f32]>), dout: &[f32], x: &[f32], w: &[f32], (mean, rstd): (&[f32], &[f32])) {
        let c = self.cfg.n_embd;
        let w = &self.norm_weight(w)[..];
        match self.cfg.arch {
            Arch::Gpt2 => layernorm_backward((dinp, dw, db), dout, x, w, (mean, rstd), c),
            Arch::Llama => rmsnorm_backward(dinp, dw, dout, x, w, rstd, c),
        }
    }

    /// The attention dims of this part (the window of the whole model's first layer: RoPE and
    /// shapes need no more; [`Ops::gqa_at`] is a layer's).
    fn gqa(&self) -> GqaDims {
        self.gqa_at(0)
    }

    /// [`Ops::gqa`] for this part's layer `l`, with that layer's sliding window.
    fn gqa_at(&self, l: usize) -> GqaDims {
        let (head0, heads) = self.mask_heads();
        let window = self.cfg.window_of(self.cfg.first_layer() + l);
        GqaDims { b: self.b, t: self.t, nh: self.cfg.n_head, nkv: self.cfg.n_kv_head, hs: self.cfg.head_size(), head0, heads, b0: self.b0, window, sinks: self.cfg.attn_sinks, rotary: self.cfg.rotary_dim, scale: self.cfg.attn_scale(), softcap: self.cfg.attn_softcap }
    }

    /// A tensor-parallel shard's first head and the whole model's head count ((0, 0) without
    /// tensor parallelism): attention dropout masks are drawn by whole-model head, so every
    /// shard drops what one rank would for the same heads.
    fn mask_heads(&self) -> (usize, usize) {
        self.cfg.place.heads.map_or((0, 0), |h| (h.first, h.total))
    }

    /// LLaMA: the rotary embedding of q and k in place (nothing for GPT-2 or a NoPE layer), at
    /// positions `0..T` or the documents' `pos`, in this part's layer `l`; whether anything was
    /// rotated.
    fn rope_forward(&self, qkv: &mut [f32], l: usize) -> bool {
        if self.cfg.rope_at(self.cfg.first_layer() + l) {
            let (cos, sin) = self.rope_of(l);
            match self.docs {
                Some(d) => rope_forward_pos(qkv, cos, sin, &self.gqa(), d.pos),
                None => rope_forward(qkv, cos, sin, &self.gqa(), 0),
            }
            return true;
        }
        false
    }

    /// The rotary tables of this part's layer `l`: the sliding-window layers' own (Gemma 3's
    /// local base) where they differ, else the pass's.
    pub(crate) fn rope_of(&self, l: usize) -> &'a (Vec<f32>, Vec<f32>) {
        match self.rope_local {
            Some(t) if self.cfg.window_of(self.cfg.first_layer() + l) > 0 => t,
            _ => self.rope.expect("llama has rotary tables"),
        }
    }

    /// A norm's weight as the kernels take it: `1 + w` under `norm_offset` (Gemma, in fp32 as
    /// transformers adds it), else `w`.
    pub(crate) fn norm_weight<'w>(&self, w: &'w [f32]) -> std::borrow::Cow<'w, [f32]> {
        if self.cfg.norm_offset { w.iter().map(|x| 1.0 + x).collect::<Vec<f32>>().into() } else { w.into() }
    }

    /// The documents' per-token starts for the attention kernels (empty: none).
    fn doc_starts(&self) -> &'a [u32] {
        self.docs.map_or(&[], |d| d.start)
    }

    /// This part's attention dims as GQA (MHA is `NKV = NH`).
    fn attn_gqa(&self, l: usize) -> GqaDims {
        match self.cfg.arch {
            Arch::Gpt2 => self.mha().as_gqa(),
            Arch::Llama => self.gqa_at(l),
        }
    }

    fn mha(&self) -> AttnDims {
        let (head0, heads) = self.mask_heads();
        AttnDims { b: self.b, t: self.t, c: self.cfg.attn_width(), nh: self.cfg.n_head, head0, heads, b0: self.b0 }
    }

    fn attn_forward(&self, out: &mut [f32], state: &mut [f32], qkv: &[f32], site: DropSite) {
        let (cfg, drop, l) = (self.cfg, AttnDropout { p: self.drop.p, seed: self.site_seed(site) }, site.layer());
        if let Some(h) = self.cp.borrow_mut().as_mut() {
            return h.attention_forward(out, state, qkv, &self.attn_gqa(l), self.doc_starts(), drop);
        }
        match cfg.arch {
            Arch::Gpt2 => flash_attention_forward_docs(out, state, qkv, &self.mha(), self.doc_starts(), drop),
            Arch::Llama => flash_gqa_forward_docs(out, state, qkv, &self.gqa_at(l), self.doc_starts(), drop),
        }
    }

    /// Accumulates into `dqkv` (with respect to the un-rotated q and k for LLaMA).
    fn attn_backward(&self, dqkv: &mut [f32], dout: &[f32], qkv: &[f32], out: &[f32], state: &[f32], site: DropSite) {
        let (cfg, drop, l) = (self.cfg, AttnDropout { p: self.drop.p, seed: self.site_seed(site) }, site.layer());
        let mut cp = self.cp.borrow_mut();
        match cfg.arch {
            Arch::Gpt2 => match cp.as_mut() {
                Some(h) => h.attention_backward(dqkv, dout, (qkv, out, state), &self.attn_gqa(l), self.doc_starts(), drop),
                None => flash_attention_backward_docs(dqkv, dout, (qkv, out, state), &self.mha(), self.doc_starts(), drop),
            },
            Arch::Llama => {
                // dqkv is zero on entry (the caller clears it), so the in-place inverse rotation
                // after the accumulation is still an accumulation into zero.
                match cp.as_mut() {
                    Some(h) => h.attention_backward(dqkv, dout, (qkv, out, state), &self.gqa_at(l), self.doc_starts(), drop),
                    None => flash_gqa_backward_docs(dqkv, dout, (qkv, out, state), &self.gqa_at(l), self.doc_starts(), drop),
                }
                if cfg.rope_at(cfg.first_layer() + l) {
                    let (cos, sin) = self.rope_of(l);
                    match self.docs {
                        Some(d) => rope_backward_pos(dqkv, cos, sin, &self.gqa(), d.pos),
                        None => rope_backward(dqkv, cos, sin, &self.gqa(), 0),
                    }
                }
            }
        }
    }

    pub(crate) fn act_forward(&self, out: &mut [f32], fch: &[f32]) {
        match (self.cfg.arch, self.cfg.gate_act) {
            (Arch::Gpt2, _) => gelu_forward(out, fch),
            (Arch::Llama, GateAct::Silu) => swiglu_forward(out, fch, self.cfg.dense_hidden()),
            (Arch::Llama, GateAct::GeluTanh) => tensor::ops::geglu_forward(out, fch, self.cfg.dense_hidden()),
        }
    }

    /// The activation's backward, overwriting `dfch`.
    fn act_backward(&self, dfch: &mut [f32], dout: &[f32], fch: &[f32]) {
        match (self.cfg.arch, self.cfg.gate_act) {
            (Arch::Gpt2, _) => gelu_backward_into(dfch, dout, fch),
            (Arch::Llama, GateAct::Silu) => swiglu_backward_into(dfch, dout, fch, self.cfg.dense_hidden()),
            (Arch::Llama, GateAct::GeluTanh) => tensor::ops::geglu_backward_into(dfch, dout, fch, self.cfg.dense_hidden()),
        }
    }
}
