//! Tensor parallelism (Megatron-LM: Shoeybi et al. 2019), applied by parameter name.
//!
//! A rank of a `tp`-way group holds a *shard*: a model whose config counts only its own
//! attention heads, key/value heads and MLP columns (its `GptConfig::place`), with the same layout
//! names. [`PLAN`] says how each whole-model parameter is cut: column-parallel products
//! (q|k|v, the MLP's up and gate) keep their rows for this rank's heads or columns,
//! row-parallel products (attention output, MLP down) keep the matching input columns, and
//! everything else (position embeddings, norms, the row-parallel biases) is replicated. The
//! model sums the partial results at its two branch boundaries through [`TpComm`] (Megatron's
//! conjugate `f`/`g`: all-reduce of the row-parallel outputs in forward, of the
//! column-parallel inputs' gradients in backward): four all-reduces of `[B·T, C]` per layer
//! and micro-batch, `8·b·s·h·(t−1)/t` elements sent per rank in a ring, plus two for the
//! vocab-parallel embedding (forward) and head (its input gradient).
//!
//! Replicated parameters get identical gradients on every rank (their inputs and output
//! gradients are the full, summed tensors), so they stay identical with no extra traffic; the
//! global gradient norm counts them once ([`replicated_ranges`]). The exceptions are summed over
//! the group before the update ([`partial_gradient_ranges`]): per-head norms (each shard sees
//! its heads) and, with sequence parallelism, the norms (each shard sees its positions).
//!
//! The vocabulary is split too (Megatron's vocab-parallel embedding and cross-entropy): each
//! rank holds rows `r·V/t ..` of the token embedding and head; the embedding's partial
//! lookups are summed (`g`), the head's logits stay split, and the loss combines per-row
//! log-sum-exps across ranks (`tensor::classifier::lm_head_crossentropy_vocab_parallel`), so
//! no rank ever holds `[N, V]` logits. Not split: mixture-of-experts layers (expert
//! parallelism's job): every rank holds the router and experts whole and runs the layer on
//! every token (under sequence parallelism the sequence gathered first and the rank's positions
//! kept after), so their gradients are the same on every rank (replicated), and the routing
//! statistics are the data-parallel group's, as without tensor parallelism.

use crate::comm::Comm;
use model::layout::ParamLayout;
use model::config::{Part, SeqSlice};
use model::GptConfig;
use std::ops::Range;

/// How one parameter is cut across the tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds all of it.
    Replicated,
    /// Dimension 0 (output rows) split, in `groups` equal groups each split `tp` ways (GPT-2's
    /// fused q|k|v has 3 groups: each rank keeps its heads' rows of q, of k and of v).
    Rows { groups: usize },
    /// Dimension 1 (input columns) split `tp` ways.
    Cols,
    /// The vocabulary's rows: each rank holds `⌈V/tp⌉` (the last ranks' tails zero padding,
    /// never looked up or predicted), so any vocabulary splits and the whole model's layout
    /// does not depend on the tensor-parallel degree.
    Vocab,
}

/// The plan, by parameter-name suffix (the first match wins; unmatched names are replicated).
pub const PLAN: &[(&str, Split)] = &[
    ("attn.c_attn.weight", Split::Rows { groups: 3 }),
    ("attn.c_attn.bias", Split::Rows { groups: 3 }),
    ("attn.c_proj.weight", Split::Cols),
    ("mlp.c_fc.weight", Split::Rows { groups: 1 }),
    ("mlp.c_fc.bias", Split::Rows { groups: 1 }),
    ("mlp.c_proj.weight", Split::Cols),
    ("self_attn.q_proj.weight", Split::Rows { groups: 1 }),
    ("self_attn.k_proj.weight", Split::Rows { groups: 1 }),
    ("self_attn.v_proj.weight", Split::Rows { groups: 1 }),
    ("self_attn.q_proj.bias", Split::Rows { groups: 1 }),
    ("self_attn.k_proj.bias", Split::Rows { groups: 1 }),
    ("self_attn.v_proj.bias", Split::Rows { groups: 1 }),
    ("self_attn.o_proj.weight", Split::Cols),
    // Latent attention's per-head up-projections (its latents are replicated).
    ("self_attn.q_b_proj.weight", Split::Rows { groups: 1 }),
    ("self_attn.kv_b_proj.weight", Split::Rows { groups: 1 }),
    ("mlp.gate_proj.weight", Split::Rows { groups: 1 }),
    ("mlp.up_proj.weight", Split::Rows { groups: 1 }),
    ("mlp.down_proj.weight", Split::Cols),
    // Vocab-parallel embedding and head: each rank holds a slice of the (padded) vocabulary.
    ("transformer.wte.weight", Split::Vocab),
    ("model.embed_tokens.weight", Split::Vocab),
    ("lm_head.weight", Split::Vocab),
];

pub fn split_of(name: &str) -> Split {
    PLAN.iter().find(|(suffix, _)| name.ends_with(suffix)).map_or(Split::Replicated, |p| p.1)
}

/// The config of rank `rank`'s shard of `cfg` over `tp` ranks (its heads, MLP columns and
/// vocabulary rows, and with `sequence_parallel` its slice of every sequence, in its
/// [`model::Placement`]); the error names the key that does not divide.
pub fn local_config(cfg: &GptConfig, tp: usize, rank: usize, sequence_parallel: bool) -> Result<GptConfig, String> {
    assert!(cfg.place.heads.is_none(), "local_config of a shard");
    assert!(rank < tp);
    if cfg.qk_norm_whole && tp > 1 {
        return Err(format!("parallel.tp = {tp} with whole-width q/k norms (model.qk_norm_whole, OLMo 2) is not supported: each norm spans every head, which the parts split; use data, pipeline or context parallelism"));
    }
    // Mixture-of-experts layers are not split: their experts are whole on every rank.
    let ffn = if cfg.is_moe() { 1 } else { tp };
    for (key, v, by) in [("model.n_head", cfg.n_head, tp), ("model.n_kv_head", cfg.n_kv_head, tp), ("model.ffn_hidden", cfg.ffn_hidden, ffn), ("model.dense_ffn_hidden", cfg.dense_ffn_hidden, tp)] {
        if v % by != 0 {
            return Err(format!("parallel.tp = {tp} does not divide {key} = {v}"));
        }
    }
    let (heads, vocab) = (cfg.n_head / tp, cfg.vocab_size.div_ceil(tp));
    let mut place = cfg.place.clone();
    place.heads = Some(Part { first: rank * heads, total: cfg.n_head });
    place.vocab = Some(Part { first: rank * vocab, total: vocab * tp });
    place.seq = sequence_parallel.then_some(SeqSlice { index: rank, count: tp });
    // Dense layers before the routed ones split their MLP columns like a dense model's.
    Ok(GptConfig { n_head: heads, n_kv_head: cfg.n_kv_head / tp, ffn_hidden: cfg.ffn_hidden / ffn, dense_ffn_hidden: cfg.dense_ffn_hidden / tp, vocab_size: vocab, place, ..cfg.clone() })
}

/// Rows × columns of a parameter (a vector is one column).
fn dims(shape: &[usize]) -> (usize, usize) {
    match shape {
        [r] => (*r, 1),
        [r, c] => (*r, *c),
        _ => (shape.iter().product(), 1),
    }
}

/// Calls `f(local offset, whole offset, len)` for every contiguous run of a parameter that
/// rank `rank` of `tp` holds (offsets relative to the parameter's start in each layout).
fn runs(split: Split, shape: &[usize], rank: usize, tp: usize, mut f: impl FnMut(usize, usize, usize)) {
    let (r, c) = dims(shape);
    match split {
        Split::Replicated => f(0, 0, r * c),
        Split::Rows { groups } => {
            let (per_group, local) = (r / groups, r / groups / tp);
            for g in 0..groups {
                f(g * local * c, (g * per_group + rank * local) * c, local * c);
            }
        }
        Split::Cols => {
            let lc = c / tp;
            for row in 0..r {
                f(row * lc, row * c + rank * lc, lc);
            }
        }
        Split::Vocab => {
            let lr = r.div_ceil(tp);
            let (a, b) = ((rank * lr).min(r), ((rank + 1) * lr).min(r));
            f(0, a * c, (b - a) * c);
        }
    }
}

/// The whole `[rows, cols]` matrix of a parameter cut as `split`, from every rank's part
/// (`parts[r]`, each `local` rows × columns), in the whole model's element order; and its shape.
pub fn assemble(split: Split, local: (usize, usize), parts: &[&[f32]]) -> (Vec<f32>, (usize, usize)) {
    assert!(matches!(split, Split::Rows { .. } | Split::Cols), "assemble: {split:?} is not a matrix split");
    let tp = parts.len();
    let whole = whole_shape(split, local, tp);
    let mut out = vec![0.0; whole.0 * whole.1];
    for (rank, part) in parts.iter().enumerate() {
        runs(split, &[whole.0, whole.1], rank, tp, |lo, wo, n| out[wo..wo + n].copy_from_slice(&part[lo..lo + n]));
    }
    (out, whole)
}

/// The whole `[rows, cols]` shape of a matrix whose parts over `tp` ranks are `local`: rows or
/// columns times `tp` as `split` cuts them (a replicated or vocabulary-split one as it is).
pub fn whole_shape(split: Split, local: (usize, usize), tp: usize) -> (usize, usize) {
    match split {
        Split::Rows { .. } => (local.0 * tp, local.1),
        Split::Cols => (local.0, local.1 * tp),
        Split::Replicated | Split::Vocab => local,
    }
}

/// Rank `rank`'s part of a whole `[rows, cols]` matrix cut as `split` over `tp` ranks, into
/// `out` (what [`assemble`] took from it).
pub fn part_of(split: Split, whole: (usize, usize), m: &[f32], (rank, tp): (usize, usize), out: &mut [f32]) {
    runs(split, &[whole.0, whole.1], rank, tp, |lo, wo, n| out[lo..lo + n].copy_from_slice(&m[wo..wo + n]));
}

/// Rank `rank`'s shard (laid out as `local`) of the whole-model buffer `whole` (laid out as
/// `full`).
pub fn shard(full: &ParamLayout, whole: &[f32], local: &ParamLayout, rank: usize, tp: usize) -> Vec<f32> {
    assert_eq!(full.params.len(), local.params.len());
    let mut out = vec![0.0; local.total];
    for (p, q) in full.params.iter().zip(&local.params) {
        debug_assert_eq!(p.name, q.name);
        runs(split_of(&p.name), &p.shape, rank, tp, |lo, wo, n| out[q.offset + lo..q.offset + lo + n].copy_from_slice(&whole[p.offset + wo..p.offset + wo + n]));
    }
    out
}

/// The whole-model buffer from every rank's shard (`shards[r]`, laid out as `local`).
pub fn unshard(full: &ParamLayout, shards: &[&[f32]], local: &ParamLayout) -> Vec<f32> {
    let tp = shards.len();
    let mut out = vec![0.0; full.total];
    for (p, q) in full.params.iter().zip(&local.params) {
        for (rank, s) in shards.iter().enumerate() {
            runs(split_of(&p.name), &p.shape, rank, tp, |lo, wo, n| out[p.offset + wo..p.offset + wo + n].copy_from_slice(&s[q.offset + lo..q.offset + lo + n]));
        }
    }
    out
}

/// The ranges of a shard's layout that every rank holds whole.
pub fn replicated_ranges(local: &ParamLayout) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for p in local.params.iter().filter(|p| split_of(&p.name) == Split::Replicated) {
        match out.last_mut() {
            Some(r) if r.end == p.offset => r.end = p.offset + p.len(),
            _ => out.push(p.range()),
        }
    }
    out
}

/// Norm parameters, by name suffix: under sequence parallelism each shard sees only its
/// positions, so their gradients are partial sums over the tensor-parallel group.
pub const SEQUENCE_PARALLEL_PARAMS: &[&str] = &[
    "ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "ln_f.weight", "ln_f.bias",
    "input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight", "model.norm.weight",
];

/// Per-head norm parameters (Qwen3's `q_norm`, `k_norm`) and latent attention's latents, by name
/// suffix: replicated, but each shard normalises (or up-projects) only its own heads, so their
/// gradients are partial sums over the tensor-parallel group with or without sequence
/// parallelism.
pub const PER_HEAD_PARAMS: &[&str] = &[
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    // Latent attention's replicated latents: each shard's heads' share of their gradients.
    "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
];

/// The ranges of a shard's layout whose gradients are partial over the tensor-parallel group,
/// to be summed before the update: the per-head norms', and with sequence parallelism (`sp`)
/// the norms'.
pub fn partial_gradient_ranges(local: &ParamLayout, sp: bool) -> Vec<Range<usize>> {
    let partial = |name: &str| PER_HEAD_PARAMS.iter().any(|s| name.ends_with(s)) || (sp && SEQUENCE_PARALLEL_PARAMS.iter().any(|s| name.ends_with(s)));
    local.params.iter().filter(|p| partial(&p.name)).map(|p| p.range()).collect()
}

/// The model's tensor-parallel hooks over the `tp` group.
pub struct TpComm {
    pub comm: Box<dyn Comm>,
    /// Channels per row (`n_embd`), for bias handling.
    pub c: usize,
}

impl TpComm {
    /// Every shard added the (replicated) bias to its partial sum; keep rank 0's.
    fn unbias(&self, out: &mut [f32], bias: Option<&[f32]>) {
        if let (Some(b), true) = (bias, self.comm.rank() != 0) {
            for row in out.chunks_mut(self.c) {
                for (x, y) in row.iter_mut().zip(b) {
                    *x -= *y;
                }
            }
        }
    }
}

/// Row offsets of the sequence-parallel layout: `[B, T, C]` as `[t ranks][B][T/t]` chunks of
/// `c`, calling `f(whole row, rank-major row)` for every row.
fn seq_rows(b: usize, t: usize, tp: usize, mut f: impl FnMut(usize, usize)) {
    let tl = t / tp;
    for r in 0..tp {
        for bi in 0..b {
            for j in 0..tl {
                f(bi * t + r * tl + j, (r * b + bi) * tl + j);
            }
        }
    }
}

impl model::TpHooks for TpComm {
    fn reduce_output(&mut self, out: &mut [f32], bias: Option<&[f32]>) {
        let _span = tensor::profile::scope("tp all_reduce");
        self.unbias(out, bias);
        self.comm.all_reduce_sum(out);
    }

    fn gather_seq(&mut self, local: &[f32], full: &mut [f32], b: usize, t: usize) {
        let _span = tensor::profile::scope("sp all_gather");
        let (c, tp) = (self.c, self.comm.size());
        let mut all = vec![0.0f32; full.len()];
        self.comm.all_gather(local, &mut all);
        seq_rows(b, t, tp, |w, m| full[w * c..(w + 1) * c].copy_from_slice(&all[m * c..(m + 1) * c]));
    }

    fn scatter_seq(&mut self, full: &mut [f32], local: &mut [f32], bias: Option<&[f32]>, b: usize, t: usize) {
        let _span = tensor::profile::scope("sp reduce_scatter");
        let (c, tp) = (self.c, self.comm.size());
        self.unbias(full, bias);
        let mut ranked = vec![0.0f32; full.len()];
        seq_rows(b, t, tp, |w, m| ranked[m * c..(m + 1) * c].copy_from_slice(&full[w * c..(w + 1) * c]));
        self.comm.reduce_scatter_sum(&ranked, local);
    }

    fn reduce_input_grad(&mut self, dx: &mut [f32]) {
        let _span = tensor::profile::scope("tp all_reduce");
        self.comm.all_reduce_sum(dx);
    }

    fn all_gather(&mut self, x: &[f32]) -> Vec<f32> {
        let _span = tensor::profile::scope("tp all_gather");
        let mut out = vec![0.0; x.len() * self.comm.size()];
        self.comm.all_gather(x, &mut out);
        out
    }
}

/// Every rank's `local` buffer, gathered (`out[r]` is rank `r`'s).
pub fn gather(comm: &dyn Comm, local: &[f32]) -> Vec<Vec<f32>> {
    let n = comm.size();
    let mut all = vec![0f32; n * local.len()];
    comm.all_gather(local, &mut all);
    all.chunks(local.len().max(1)).map(|c| c.to_vec()).take(n).collect()
}
