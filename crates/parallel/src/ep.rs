//! Expert parallelism (GShard: Lepikhin et al. 2020; DeepSpeed-MoE: Rajbhandari et al. 2022),
//! applied by parameter name.
//!
//! The routed experts of every MoE layer are spread over the `ep` ranks of an expert-parallel
//! group: rank `r` holds experts `r·E/ep .. (r+1)·E/ep`. A rank's *shard* is a model whose
//! config says which block it holds (`Placement::experts`), laid out with the experts' whole-model
//! names (`model.layers.{i}.block_sparse_moe.experts.{e}.*`), so [`shard`] and [`unshard`] are
//! copies by name and a checkpoint keeps holding the whole model. Everything else — router,
//! shared experts, attention, norms, embeddings — is replicated.
//!
//! The ep axis also splits the batch (like data parallelism): each rank routes its own tokens
//! over all `E` experts, and `tensor::moe` sends the dispatched rows to the experts' owners
//! through [`EpComm`] (a count exchange, then a variable all-to-all — no capacity padding on
//! the wire, so the bytes are the rows actually kept) and takes the outputs back with a second
//! one; backward mirrors it. Per MoE layer and micro-batch a rank sends
//! `4·C·(R − R_own)` bytes in each of the four row all-to-alls, `R` its kept token-assignments
//! and `R_own` those routed to its own experts (`≈ 4·C·R·(ep−1)/ep` with balanced routing),
//! plus `4·(ep−1)·E/ep` bytes of counts in forward.
//!
//! The load-balancing loss is the batch's: each MoE layer sums its routing statistics over
//! the `dp × ep` ranks (`EpComm::batch`), so every layout computes one rank's loss and
//! gradients; a token's capacity slot is still decided on its own rank (a routing group per
//! rank, as in GShard).
//!
//! Gradients: the non-expert parameters are all-reduced over the whole `dp × ep` group (they
//! saw different data), an expert's gradient already sums every token of its ep group (the
//! owner ran them all) and is reduced only over the ranks holding the same experts — the
//! data-parallel group, none at `dp = 1` (see `DataParallel::new_ep`).

use crate::comm::Comm;
use model::layout::{gpt_layout, ParamLayout};
use model::GptConfig;
use std::collections::HashMap;
use std::ops::Range;

/// Part of a routed expert's parameter name (`…block_sparse_moe.experts.{e}.w1.weight`); the
/// shared experts (`shared_experts`) and the router (`gate`) do not match.
const EXPERT: &str = ".block_sparse_moe.experts.";

/// The config of rank `rank`'s shard of `cfg` over `ep` ranks; the error names the key that
/// does not fit.
pub fn local_config(cfg: &GptConfig, ep: usize, rank: usize) -> Result<GptConfig, String> {
    assert!(cfg.place.experts.is_none(), "local_config of a shard");
    if !cfg.is_moe() {
        return Err(format!("parallel.ep = {ep} needs a mixture-of-experts model (model.n_expert > 0, e.g. --preset moe-tiny); this model is dense"));
    }
    if !cfg.n_expert.is_multiple_of(ep) {
        return Err(format!("parallel.ep = {ep} does not divide model.n_expert = {}", cfg.n_expert));
    }
    assert!(rank < ep);
    let el = cfg.n_expert / ep;
    let mut local = cfg.clone();
    local.place.experts = Some(rank * el..(rank + 1) * el);
    Ok(local)
}

/// The layout of rank `rank`'s shard, for a shard config `local` of any rank of the group.
pub fn layout_of(local: &GptConfig, rank: usize) -> ParamLayout {
    let el = local.place.experts.as_ref().expect("an expert-parallel shard config").len();
    let mut cfg = local.clone();
    cfg.place.experts = Some(rank * el..(rank + 1) * el);
    gpt_layout(&cfg).0
}

/// The shard laid out as `local` of the whole-model buffer `whole` (laid out as `full`):
/// every parameter of `local`, copied by name.
pub fn shard(full: &ParamLayout, whole: &[f32], local: &ParamLayout) -> Vec<f32> {
    let by_name: HashMap<&str, Range<usize>> = full.params.iter().map(|p| (p.name.as_str(), p.range())).collect();
    let mut out = vec![0.0; local.total];
    for q in &local.params {
        let r = by_name.get(q.name.as_str()).unwrap_or_else(|| panic!("{} is not in the whole model", q.name));
        out[q.range()].copy_from_slice(&whole[r.clone()]);
    }
    out
}

/// The whole-model buffer (laid out as `full`) from every rank's shard (`shards[r]`, laid out as
/// `locals[r]`): each parameter from the shards that hold it (replicated ones are identical).
pub fn unshard(full: &ParamLayout, shards: &[&[f32]], locals: &[ParamLayout]) -> Vec<f32> {
    let by_name: HashMap<&str, Range<usize>> = full.params.iter().map(|p| (p.name.as_str(), p.range())).collect();
    let mut out = vec![0.0; full.total];
    let mut seen = vec![false; full.params.len()];
    let index: HashMap<&str, usize> = full.params.iter().enumerate().map(|(i, p)| (p.name.as_str(), i)).collect();
    for (s, l) in shards.iter().zip(locals) {
        for q in &l.params {
            let i = index[q.name.as_str()];
            if !seen[i] {
                seen[i] = true;
                out[by_name[q.name.as_str()].clone()].copy_from_slice(&s[q.range()]);
            }
        }
    }
    assert!(seen.iter().all(|&x| x), "the shards do not cover the whole model");
    out
}

/// The flat ranges of `layout` holding routed experts (contiguous runs merged): the
/// parameters that differ across an expert-parallel group.
pub fn expert_ranges(layout: &ParamLayout) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for p in layout.params.iter().filter(|p| p.name.contains(EXPERT)) {
        match out.last_mut() {
            Some(r) if r.end == p.offset => r.end = p.offset + p.len(),
            _ => out.push(p.range()),
        }
    }
    out
}

/// The model's expert-parallel exchange over the ep group (a [`tensor::moe::MoeExchange`]):
/// counts travel as `u32` bit patterns in an equal-chunk all-to-all, rows in
/// [`Comm::all_to_all_v`], and the routing statistics are summed over `batch`, every rank of
/// the batch (`dp × ep`; `None`: this rank's own tokens are the routing group). A data-parallel
/// MoE run without expert parallelism uses one too, with a single-rank `comm`, for the
/// statistics alone.
pub struct EpComm {
    pub comm: Box<dyn Comm>,
    pub batch: Option<Box<dyn Comm>>,
}

impl tensor::moe::MoeExchange for EpComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.size()
    }

    fn exchange_counts(&mut self, send: &[usize], recv: &mut [usize]) {
        let _span = tensor::profile::scope("ep all_to_all counts");
        let bits: Vec<f32> = send.iter().map(|&x| f32::from_bits(u32::try_from(x).expect("row count fits u32"))).collect();
        let mut out = vec![0f32; bits.len()];
        self.comm.all_to_all(&bits, &mut out);
        for (r, x) in recv.iter_mut().zip(&out) {
            *r = x.to_bits() as usize;
        }
    }

    fn sum_routing(&mut self, stats: &mut [f64]) {
        if let Some(b) = self.batch.as_deref().filter(|b| b.size() > 1) {
            let _span = tensor::profile::scope("moe routing all_gather");
            let all = crate::comm::all_gather_f64(b, stats);
            let k = stats.len();
            for (i, s) in stats.iter_mut().enumerate() {
                *s = (0..b.size()).fold(0.0, |acc, r| acc + all[r * k + i]);
            }
        }
    }

    fn exchange_rows(&mut self, send: &[f32], send_rows: &[usize], recv: &mut [f32], recv_rows: &[usize], c: usize) {
        let _span = tensor::profile::scope("ep all_to_all");
        let elems = |rows: &[usize]| -> Vec<usize> { rows.iter().map(|&r| r * c).collect() };
        self.comm.all_to_all_v(send, &elems(send_rows), recv, &elems(recv_rows));
    }
}
