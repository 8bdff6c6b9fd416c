//! Tensor parallelism (Megatron-LM: Shoeybi et al. 2019), applied by parameter name.
//!
//! A rank of a `tp`-way group holds a *shard*: a model whose config counts only its own
//! attention heads, key/value heads and MLP columns (`GptConfig::tp`), with the same layout
//! names. [`PLAN`] says how each whole-model parameter is cut: column-parallel products
//! (q|k|v, the MLP's up and gate) keep their rows for this rank's heads or columns,
//! row-parallel products (attention output, MLP down) keep the matching input columns, and
//! everything else (embeddings, norms, the head, the row-parallel biases) is replicated. The
//! model sums the partial results at its two branch boundaries through [`TpComm`] (Megatron's
//! conjugate `f`/`g`: all-reduce of the row-parallel outputs in forward, of the
//! column-parallel inputs' gradients in backward): four all-reduces of `[B·T, C]` per layer
//! and micro-batch, `8·b·s·h·(t−1)/t` elements sent per rank in a ring.
//!
//! Replicated parameters get identical gradients on every rank (their inputs and output
//! gradients are the full, summed tensors), so they stay identical with no extra traffic; the
//! global gradient norm counts them once ([`replicated_ranges`]).
//!
//! Not split: mixture-of-experts layers (expert parallelism's job) and the vocabulary (the
//! embedding and output head are replicated; no vocab-parallel cross-entropy yet).

use crate::comm::Comm;
use model::layout::ParamLayout;
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
    ("self_attn.o_proj.weight", Split::Cols),
    ("mlp.gate_proj.weight", Split::Rows { groups: 1 }),
    ("mlp.up_proj.weight", Split::Rows { groups: 1 }),
    ("mlp.down_proj.weight", Split::Cols),
];

pub fn split_of(name: &str) -> Split {
    PLAN.iter().find(|(suffix, _)| name.ends_with(suffix)).map_or(Split::Replicated, |p| p.1)
}

/// The config of one shard of `cfg` over `tp` ranks; the error names the key that does not
/// divide.
pub fn local_config(cfg: &GptConfig, tp: usize) -> Result<GptConfig, String> {
    assert_eq!(cfg.tp, 1, "local_config of a shard");
    if cfg.is_moe() {
        return Err(format!("parallel.tp = {tp}: tensor parallelism does not split mixture-of-experts layers (model.n_expert = {}); that is expert parallelism", cfg.n_expert));
    }
    for (key, v) in [("model.n_head", cfg.n_head), ("model.n_kv_head", cfg.n_kv_head), ("model.ffn_hidden", cfg.ffn_hidden)] {
        if v % tp != 0 {
            return Err(format!("parallel.tp = {tp} does not divide {key} = {v}"));
        }
    }
    Ok(GptConfig { n_head: cfg.n_head / tp, n_kv_head: cfg.n_kv_head / tp, ffn_hidden: cfg.ffn_hidden / tp, tp, ..cfg.clone() })
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
    }
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

/// The model's tensor-parallel hooks over the `tp` group.
pub struct TpComm {
    pub comm: Box<dyn Comm>,
    /// Channels per row (`n_embd`), for bias handling.
    pub c: usize,
}

impl model::TpHooks for TpComm {
    fn reduce_output(&mut self, out: &mut [f32], bias: Option<&[f32]>) {
        let _span = tensor::profile::scope("tp all_reduce");
        // Every shard added the (replicated) bias; keep rank 0's.
        if let (Some(b), true) = (bias, self.comm.rank() != 0) {
            for row in out.chunks_mut(self.c) {
                for (x, y) in row.iter_mut().zip(b) {
                    *x -= *y;
                }
            }
        }
        self.comm.all_reduce_sum(out);
    }

    fn reduce_input_grad(&mut self, dx: &mut [f32]) {
        let _span = tensor::profile::scope("tp all_reduce");
        self.comm.all_reduce_sum(dx);
    }
}

/// Every rank's `local` buffer, gathered (`out[r]` is rank `r`'s).
pub fn gather(comm: &dyn Comm, local: &[f32]) -> Vec<Vec<f32>> {
    let n = comm.size();
    let mut all = vec![0f32; n * local.len()];
    comm.all_gather(local, &mut all);
    all.chunks(local.len().max(1)).map(|c| c.to_vec()).take(n).collect()
}
