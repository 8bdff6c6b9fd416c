//! Mixture-of-experts FFN layer (GShard / Switch / ST-MoE / Mixtral / DeepSeekMoE) as one
//! paired kernel, [`moe_forward`] / [`moe_backward`], built from explicit steps:
//!
//! ```text
//! router   logits[N, E] = x · Wrᵀ ; probs = softmax(logits) ; top-k (ties → lower expert id)
//!          gate[t, j] = probs[t, idx[t, j]]  (÷ Σ_j of them when `renormalize`: Mixtral's
//!          "softmax over the top-k logits" is the same number)
//! assign   token-assignments (t, j) in token order, then rank order, take the next slot of
//!          their expert; those past `capacity` are dropped (contribute zero)
//! dispatch xe[R, C]: kept assignments gathered into one packed buffer, expert e's rows at
//!          offsets[e]..offsets[e+1] (this is what expert parallelism will all-to-all)
//! experts  per expert: gu = xe·w_guᵀ [·, 2F] ; h = silu(gate)·up [·, F] ; eo = h·w2ᵀ [·, C]
//! combine  y[t] = Σ_shared s(x_t) + Σ_{j kept} gate[t, j] · eo[slot[t, j]]
//! losses   aux = E · Σ_e f_e · P_e (Switch), z = mean_t logsumexp(logits_t)² (ST-MoE)
//! ```
//!
//! Extra shape letters: `N` tokens (`B·T`), `E` routed experts, `K` experts per token, `F` the
//! expert's intermediate size, `S` shared (always-on, DeepSeekMoE) experts, `R ≤ N·K` kept
//! token-assignments. Fine-grained experts are simply more, smaller experts.
//!
//! **Weight layout.** One expert is `3·F·C` floats: `[w_gu: 2F×C | w2: C×F]`, where `w_gu`'s rows
//! `0..F` are Mixtral's `w1` (gate) and rows `F..2F` its `w3` (up) — so one gemm produces the
//! fused `[gate | up]` row that [`crate::llama::swiglu_forward`] reads — and `w2` is the down
//! projection. Experts are concatenated, expert `e` at `e·3FC`: `experts_w[E, 3FC]`. HF Mixtral:
//! `block_sparse_moe.experts.{e}.{w1, w3, w2}.weight` concatenated in that order; the router
//! `router_w[E, C]` is `block_sparse_moe.gate.weight`. Shared experts use the same per-expert
//! layout: `shared_w[S, 3FC]`.
//!
//! **Capacity.** `capacity = ceil(capacity_factor · N · K / E)` (see [`MoeDims::capacity`]);
//! `capacity_factor <= 0` means dropless (an expert takes every token routed to it).
//! Dropping happens after the gates are computed, so a dropped assignment does not change the
//! other gates of its token (GShard / Switch; the residual outside the layer carries it).
//!
//! **Losses.** `f_e = count_e / (N·K)` — the fraction of token-assignments (before dropping)
//! routed to `e` — and `P_e = mean_t probs[t, e]`, so uniform routing gives `aux = 1`. (HF's
//! `load_balancing_loss_func` divides the counts by `N` only: its value is `K ×` this one.)
//! Top-k selection and `f_e` are constants for the gradient (standard); the gradient flows
//! through the gates (including their renormalisation), `P_e` and `logsumexp` into the router.
//! Under data or expert parallelism a [`MoeExchange`] sums `f_e`'s counts, `P_e`'s sums and `N`
//! over the *routing group* (every rank of the batch), so the load-balancing loss is the
//! batch's, exactly as one rank computes it (global-batch balancing); capacity stays per rank.
//! The z-loss is a mean over tokens and needs no group.
//!
//! Forward overwrites `y` and the cache; backward accumulates into every gradient. Every
//! reduction has a fixed order: tokens and packed rows are independent rayon items, per-token
//! sums over the `K` selected experts run in rank order, the loss sums run sequentially, and
//! gemm splits output tiles, never an inner sum, so results do not depend on the thread count
//! (checked bit for bit, 1 vs 3 threads, in the tests).
//!
//! **Threads.** Experts run one after another, each product on the whole pool (as every large
//! matmul here). One rayon task per expert with single-threaded gemms was tried too: no faster
//! at `N=1024, C=768, F=1024, E=8, K=2` on 2 threads, and it serialises a hot expert and idles
//! cores once expert parallelism leaves a rank only `E/ep` local experts.
//!
//! **Expert parallelism** (GShard; DeepSpeed-MoE). With a [`MoeExchange`] over `P` ranks, this
//! rank holds only experts `rank·E/P .. (rank+1)·E/P` (`experts_w` is `[E/P, 3FC]`) but still
//! routes its own tokens over all `E`. The packed `xe` is already grouped by destination (the
//! experts of rank `d` are contiguous), so after a count exchange one variable all-to-all
//! sends each owner its rows; the owner reorders what it received from source-major to
//! expert-major (expert `j`'s rows: source 0's, then source 1's, …), runs its experts, reorders
//! back, and a second all-to-all returns the outputs into `eo` in the original packed order, so
//! the combine is unchanged. Backward mirrors it: `d(eo)` rows go to the owners, `d(xe)` rows
//! come back. Rows travel unchanged and an expert's per-row arithmetic does not depend on
//! which rows share its product, so each rank's outputs and input gradients are bit for bit
//! those of its own tokens through all `E` experts on one rank (`parallel`'s tests); against
//! one rank holding the whole batch they agree to rounding (the router product then has more
//! rows, and the gemm crate picks kernels by shape). When the sources hold consecutive slices
//! of a batch an expert sees its rows in the whole batch's order.

use crate::llama::{swiglu_backward, swiglu_forward};
use crate::matmul::{gemm, Threads, View};
use rayon::prelude::*;

/// Marks a dropped token-assignment in [`MoeCache::slot`].
pub const DROPPED: u32 = u32::MAX;

/// The collectives of expert parallelism, supplied by the caller (this crate knows nothing of
/// ranks): the routed experts are spread over `size()` ranks in contiguous blocks, rank `r`
/// holding experts `r·E/size .. (r+1)·E/size`. Every rank of the group calls both methods the
/// same number of times, in the same order.
pub trait MoeExchange {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// All-to-all of `k = send.len() / size` counts per peer: `recv[r·k .. (r+1)·k]` receives
    /// rank `r`'s `send[rank·k .. (rank+1)·k]`.
    fn exchange_counts(&mut self, send: &[usize], recv: &mut [usize]);
    /// Sums routing statistics (`f64`s, elementwise, in rank order) over the *routing group*:
    /// every rank whose tokens belong to the same batch (the data-parallel × expert-parallel
    /// ranks, a superset of this group), so that the load-balancing loss is the batch's, as on
    /// one rank. The identity when the batch is this rank's alone.
    fn sum_routing(&mut self, stats: &mut [f64]);
    /// Variable all-to-all of rows of `c` floats: `send` holds `send_rows[d]` rows for each
    /// rank `d` in rank order; `recv` receives `recv_rows[s]` rows from each rank `s` in rank
    /// order (`recv_rows[s]` is what rank `s` has in its `send_rows[rank]`).
    fn exchange_rows(&mut self, send: &[f32], send_rows: &[usize], recv: &mut [f32], recv_rows: &[usize], c: usize);
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeDims {
    /// tokens `N`
    pub n: usize,
    /// channels `C`
    pub c: usize,
    /// expert intermediate size `F` (shared experts use the same)
    pub f: usize,
    /// routed experts `E`
    pub e: usize,
    /// experts per token `K` (`1 ≤ K ≤ E`)
    pub k: usize,
    /// shared always-on experts `S` (DeepSeekMoE); 0 for Switch / Mixtral
    pub n_shared: usize,
    /// `capacity = ceil(capacity_factor·N·K/E)`; `<= 0` is dropless
    pub capacity_factor: f32,
    /// divide the K selected probabilities by their sum (Mixtral); Switch (K = 1) uses the raw one
    pub renormalize: bool,
    /// how the router scores the experts
    pub scoring: Scoring,
    /// the gates' factor after renormalising (DeepSeek-V3's `routed_scaling_factor`; 1 else)
    pub gate_scale: f32,
}

/// How the router scores and picks experts: Mixtral's softmax over every expert and top-k, or
/// DeepSeek-V3's sigmoid per expert with group-limited selection: the `E` experts in `groups`
/// groups, each group scored by the sum of its two best biased scores, the token's experts the
/// top-k among its `topk_groups` best groups by `sigmoid(logit) + bias` (the router's
/// correction bias, [`MoeInputs::router_bias`], steering the choice only); the gates are the
/// unbiased sigmoids. The sigmoid router has no z-loss (its `lse` is still the logits'
/// logsumexp, for statistics).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Scoring {
    #[default]
    Softmax,
    Sigmoid { groups: usize, topk_groups: usize },
}

impl MoeDims {
    /// Floats in one expert's weights: `[w_gu: 2F×C | w2: C×F]`.
    pub fn expert_size(&self) -> usize {
        3 * self.f * self.c
    }
    /// Floats in `experts_w`, `E · 3FC`.
    pub fn experts_size(&self) -> usize {
        self.e * self.expert_size()
    }
    /// Floats in `shared_w`, `S · 3FC`.
    pub fn shared_size(&self) -> usize {
        self.n_shared * self.expert_size()
    }
    /// Floats in `router_w`, `E · C`.
    pub fn router_size(&self) -> usize {
        self.e * self.c
    }
    /// Token slots per expert: `ceil(capacity_factor·N·K/E)`, or `N` (every token could pick
    /// the expert, at most once) when dropless. The product is shrunk by a relative 1e-6 before
    /// the ceiling, so an f32 factor such as 1.1 (really 1.100000024) times 10 gives 11, not 12.
    pub fn capacity(&self) -> usize {
        if self.capacity_factor > 0.0 {
            let x = self.capacity_factor as f64 * (self.n * self.k) as f64 / self.e as f64;
            ((x * (1.0 - 1e-6)).ceil() as usize).clamp(1, self.n)
        } else {
            self.n
        }
    }
    fn check(&self) {
        assert!(self.n > 0 && self.c > 0 && self.f > 0 && self.e > 0, "empty MoE dims {self:?}");
        assert!(self.k >= 1 && self.k <= self.e, "need 1 <= K <= E, got {self:?}");
        if let Scoring::Sigmoid { groups, topk_groups } = self.scoring {
            let ok = groups > 0 && self.e.is_multiple_of(groups) && (1..=groups).contains(&topk_groups) && self.k <= topk_groups * (self.e / groups);
            assert!(ok, "sigmoid routing needs groups dividing E and K within its top groups' experts, got {self:?}");
        }
        assert!((self.n * self.k) < DROPPED as usize, "too many token-assignments");
    }
}

/// What [`moe_forward`] reads and [`moe_backward`] differentiates: the tokens and the three
/// weight blocks (their layouts in the module docs).
#[derive(Clone, Copy, Debug)]
pub struct MoeInputs<'a> {
    /// tokens                                          [N, C]
    pub x: &'a [f32],
    /// router                                          [E, C]
    pub router_w: &'a [f32],
    /// this rank's routed experts (all `E` without expert parallelism)   [E/P, 3FC]
    pub experts_w: &'a [f32],
    /// shared experts                                  [S, 3FC]
    pub shared_w: &'a [f32],
    /// the sigmoid router's correction bias, added to the scores for the choice only
    /// (DeepSeek-V3's `e_score_correction_bias`)      [E] or empty
    pub router_bias: &'a [f32],
}

/// The gradients of [`MoeInputs`], field for field; [`moe_backward`] accumulates into them.
#[derive(Debug)]
pub struct MoeGrads<'a> {
    pub dx: &'a mut [f32],
    pub drouter_w: &'a mut [f32],
    pub dexperts_w: &'a mut [f32],
    pub dshared_w: &'a mut [f32],
}

/// The weights of the routing losses in the objective: `aux·aux_loss + z·z_loss`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MoeLossWeights {
    pub aux: f32,
    pub z: f32,
}

/// Routing statistics of one forward call.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeStats {
    /// `E · Σ_e f_e · P_e` (1.0 when perfectly uniform), unweighted
    pub aux_loss: f32,
    /// `mean_t logsumexp(logits_t)²`, unweighted
    pub z_loss: f32,
    /// `aux_weight·aux_loss + z_weight·z_loss`: the term to add to the training loss
    pub loss: f32,
    /// token-assignments routed to each expert, before dropping   [E]
    pub counts: Vec<usize>,
    /// dropped token-assignments / `N·K`
    pub dropped_fraction: f32,
    /// largest `counts[e]`
    pub max_load: usize,
    /// mean of `counts`, `N·K/E`
    pub mean_load: f32,
    /// Expert parallelism: kept rows this rank sent to other ranks' experts, and rows it
    /// received from other ranks for its own (the dispatch all-to-all and backward's d(eo)
    /// all-to-all send the first, the two return all-to-alls the second: a rank sends
    /// `4·C·(2·sent + 2·received)` bytes of rows per layer and micro-batch); 0 without it.
    pub ep_rows_sent: usize,
    pub ep_rows_received: usize,
}

/// Everything forward saves for backward plus backward's scratch, allocated once for one
/// [`MoeDims`] and reused every step.
pub struct MoeCache {
    pub dims: MoeDims,
    /// router logits                                  [N, E]
    pub logits: Vec<f32>,
    /// softmax of the logits                          [N, E]
    pub probs: Vec<f32>,
    /// logsumexp of each logits row                   [N]
    pub lse: Vec<f32>,
    /// selected experts in rank order                 [N, K]
    pub idx: Vec<u32>,
    /// gate weights of the selected experts           [N, K]
    pub gates: Vec<f32>,
    /// index map token-assignment → packed row, or [`DROPPED`]   [N, K]
    pub slot: Vec<u32>,
    /// index map packed row → token                   [R] (of N·K allocated)
    pub row_token: Vec<u32>,
    /// expert e's packed rows are `offsets[e]..offsets[e+1]`; `offsets[E] = R`   [E + 1]
    pub offsets: Vec<usize>,
    /// token-assignments per expert, before dropping  [E]
    pub counts: Vec<usize>,
    /// load-balancing statistics of the routing group: per expert its token-assignments, then
    /// its Σ_t probs, then the token count (this rank's alone without a group)   [2E + 1]
    pub route: Vec<f64>,
    /// dispatched tokens                              [R, C]
    pub xe: Vec<f32>,
    /// expert pre-activations `[gate | up]`           [R, 2F]
    pub gu: Vec<f32>,
    /// expert activations                             [R, F]
    pub h: Vec<f32>,
    /// expert outputs (before gating)                 [R, C]
    pub eo: Vec<f32>,
    /// shared experts' pre-activations                [S, N, 2F]
    pub sgu: Vec<f32>,
    /// shared experts' activations                    [S, N, F]
    pub sh: Vec<f32>,
    /// Expert parallelism only (empty otherwise), on this rank as an expert owner:
    pub ep: EpCache,
    // backward scratch
    deo: Vec<f32>,    // [R, C]   d(expert output), then d(dispatched tokens)
    dh: Vec<f32>,     // [R, F]   (also [N, F] for the shared experts)
    dgu: Vec<f32>,    // [R, 2F]  (also [N, 2F])
    dgate: Vec<f32>,  // [N, K]
    dlogits: Vec<f32>, // [N, E]
}

impl MoeCache {
    pub fn new(dims: MoeDims) -> MoeCache {
        dims.check();
        let MoeDims { n, c, f, e, k, n_shared: s, .. } = dims;
        let r = n * k;
        let big = r.max(n);
        MoeCache {
            dims,
            logits: vec![0.0; n * e],
            probs: vec![0.0; n * e],
            lse: vec![0.0; n],
            idx: vec![0; n * k],
            gates: vec![0.0; n * k],
            slot: vec![DROPPED; n * k],
            row_token: vec![0; r],
            offsets: vec![0; e + 1],
            counts: vec![0; e],
            route: Vec::with_capacity(2 * e + 1),
            xe: vec![0.0; r * c],
            gu: vec![0.0; r * 2 * f],
            h: vec![0.0; r * f],
            eo: vec![0.0; r * c],
            sgu: vec![0.0; s * n * 2 * f],
            sh: vec![0.0; s * n * f],
            ep: EpCache::default(),
            deo: vec![0.0; r * c],
            dh: vec![0.0; big * f],
            dgu: vec![0.0; big * 2 * f],
            dgate: vec![0.0; n * k],
            dlogits: vec![0.0; n * e],
        }
    }
    /// Kept token-assignments `R` of the last forward.
    pub fn rows(&self) -> usize {
        self.offsets[self.dims.e]
    }
}

/// A layer's routing state saved out of a [`MoeCache`] that several layers share as their
/// working set (activation compression keeps one layer's buffers in fp32 and the others'
/// activations compressed): the small index maps and statistics, exact.
#[derive(Default)]
pub struct MoeRouting {
    logits: Vec<f32>,
    probs: Vec<f32>,
    lse: Vec<f32>,
    idx: Vec<u32>,
    gates: Vec<f32>,
    slot: Vec<u32>,
    row_token: Vec<u32>,
    offsets: Vec<usize>,
    counts: Vec<usize>,
    route: Vec<f64>,
    send: Vec<usize>,
    recv: Vec<usize>,
}

impl MoeRouting {
    pub fn bytes(&self) -> usize {
        4 * (self.logits.len() + self.probs.len() + self.lse.len() + self.idx.len() + self.gates.len() + self.slot.len() + self.row_token.len())
            + 8 * (self.offsets.len() + self.counts.len() + self.route.len() + self.send.len() + self.recv.len())
    }
}

impl MoeCache {
    /// Copies the last forward's routing state into `out` (its allocations reused).
    pub fn save_routing(&self, out: &mut MoeRouting) {
        out.logits.clone_from(&self.logits);
        out.probs.clone_from(&self.probs);
        out.lse.clone_from(&self.lse);
        out.idx.clone_from(&self.idx);
        out.gates.clone_from(&self.gates);
        out.slot.clone_from(&self.slot);
        out.row_token.clone_from(&self.row_token);
        out.offsets.clone_from(&self.offsets);
        out.counts.clone_from(&self.counts);
        out.route.clone_from(&self.route);
        out.send.clone_from(&self.ep.send);
        out.recv.clone_from(&self.ep.recv);
    }

    /// Puts a saved routing state back (before the layer's backward).
    pub fn restore_routing(&mut self, from: &MoeRouting) {
        self.logits.clone_from(&from.logits);
        self.probs.clone_from(&from.probs);
        self.lse.clone_from(&from.lse);
        self.idx.clone_from(&from.idx);
        self.gates.clone_from(&from.gates);
        self.slot.clone_from(&from.slot);
        self.row_token.clone_from(&from.row_token);
        self.offsets.clone_from(&from.offsets);
        self.counts.clone_from(&from.counts);
        self.route.clone_from(&from.route);
        self.ep.send.clone_from(&from.send);
        self.ep.recv.clone_from(&from.recv);
    }

    /// The lengths of [`MoeCache::kept_activations`] with every token-assignment kept
    /// (`R = N·K` rows, or `R` rows received by an expert owner).
    pub fn kept_lens(dims: &MoeDims) -> [usize; 6] {
        let MoeDims { n, c, f, k, n_shared: s, .. } = *dims;
        let r = n * k;
        [r * c, s * n * 2 * f, s * n * f, r * c, r * 2 * f, r * f]
    }

    /// The activations [`moe_backward`] reads, at the lengths the last forward (or the routing
    /// restored) gives them: the expert outputs and the shared experts' activations, and the
    /// routed experts' inputs and activations — on this rank's experts' owners' buffers under
    /// expert parallelism, else the local ones.
    pub fn kept_activations(&mut self) -> [&mut [f32]; 6] {
        let MoeDims { c, f, .. } = self.dims;
        let rows = self.rows();
        let ep = &mut self.ep;
        let rl = ep.rows();
        let (eo, sgu, sh) = (&mut self.eo[..rows * c], &mut self.sgu[..], &mut self.sh[..]);
        if !ep.recv.is_empty() {
            [eo, sgu, sh, &mut ep.xl[..rl * c], &mut ep.gul[..rl * 2 * f], &mut ep.hl[..rl * f]]
        } else {
            [eo, sgu, sh, &mut self.xe[..rows * c], &mut self.gu[..rows * 2 * f], &mut self.h[..rows * f]]
        }
    }
}

/// What an expert owner keeps from an expert-parallel forward (`P` ranks, `El = E/P` local
/// experts, `Rl` rows received), grown to the largest `Rl` seen and reused.
#[derive(Default)]
pub struct EpCache {
    /// Rows this rank sent to rank `d` for its local expert `j`          [P, El]
    pub send: Vec<usize>,
    /// Rows this rank received from rank `s` for its local expert `j`    [P, El]
    pub recv: Vec<usize>,
    /// Received rows, expert-major (expert `j`: source 0's rows, then source 1's, …)   [Rl, C]
    pub xl: Vec<f32>,
    /// Local experts' pre-activations `[gate | up]`                      [Rl, 2F]
    pub gul: Vec<f32>,
    /// Local experts' activations                                        [Rl, F]
    pub hl: Vec<f32>,
    /// Local experts' outputs                                            [Rl, C]
    pub eol: Vec<f32>,
    /// Source-major staging for the all-to-alls                          [max(R, Rl), C]
    buf: Vec<f32>,
    /// Backward: d(local outputs), then d(received rows), expert-major   [Rl, C]
    dl: Vec<f32>,
}

impl EpCache {
    /// Rows received, `Rl`.
    pub fn rows(&self) -> usize {
        self.recv.iter().sum()
    }

    /// Bytes held (the buffers as grown so far).
    pub fn bytes(&self) -> usize {
        4 * (self.xl.len() + self.gul.len() + self.hl.len() + self.eol.len() + self.buf.len() + self.dl.len()) + 8 * (self.send.len() + self.recv.len())
    }
}

/// Grows `v` to at least `len` elements.
fn grow(v: &mut Vec<f32>, len: usize) {
    if v.len() < len {
        v.resize(len, 0.0);
    }
}

/// The row runs `(source-major start, expert-major start, len)` of an owner's received rows,
/// `recv[s·el + j]` rows from source `s` for local expert `j` (also what a device's expert
/// parallelism permutes its staged rows by).
pub fn ep_runs(recv: &[usize], p: usize, el: usize) -> Vec<(usize, usize, usize)> {
    let per_expert: Vec<usize> = (0..el).map(|j| (0..p).map(|s| recv[s * el + j]).sum()).collect();
    let mut expert_start = vec![0usize; el];
    for j in 1..el {
        expert_start[j] = expert_start[j - 1] + per_expert[j - 1];
    }
    let mut runs = Vec::with_capacity(p * el);
    let mut src = 0;
    for s in 0..p {
        for j in 0..el {
            let len = recv[s * el + j];
            runs.push((src, expert_start[j], len));
            expert_start[j] += len;
            src += len;
        }
    }
    runs
}

/// Copies rows along `runs` (see [`ep_runs`]): source-major `from` into expert-major `to` when
/// `to_expert`, else back.
pub fn ep_permute(to: &mut [f32], from: &[f32], runs: &[(usize, usize, usize)], c: usize, to_expert: bool) {
    for &(s, e, len) in runs {
        let (a, b) = if to_expert { (e, s) } else { (s, e) };
        to[a * c..(a + len) * c].copy_from_slice(&from[b * c..(b + len) * c]);
    }
}

/// Rows per peer from per-(peer, local expert) counts `[P, El]`.
pub fn per_peer(counts: &[usize], el: usize) -> Vec<usize> {
    counts.chunks(el).map(|c| c.iter().sum()).collect()
}

/// Expert-major row offsets of the local experts `[El + 1]`.
pub fn local_offsets(recv: &[usize], p: usize, el: usize) -> Vec<usize> {
    let mut o = vec![0usize; el + 1];
    for j in 0..el {
        o[j + 1] = o[j] + (0..p).map(|s| recv[s * el + j]).sum::<usize>();
    }
    o
}

/// One expert's weights `(w_gu [2F, C], w2 [C, F])` from its `3FC` block.
fn expert_views(w: &[f32], c: usize, f: usize) -> (&[f32], &[f32]) {
    w.split_at(2 * f * c)
}

// ---------------------------------------------------------------------------------------------
// Forward

/// The MoE layer: `y = Σ_shared s(x) + Σ_selected gate·expert(x)`. Overwrites `y` and `cache`;
/// returns the routing losses (see the module docs) and statistics. With `ep` the routed
/// experts are spread over its ranks and `inp.experts_w` holds this rank's `E/P` of them (see
/// the module docs); collective over `ep`'s group.
pub fn moe_forward(
    y: &mut [f32],           // [N, C]
    cache: &mut MoeCache,
    inp: MoeInputs,          // x [N, C], router_w [E, C], experts_w [E/P, 3FC], shared_w [S, 3FC]
    dims: &MoeDims,
    loss: MoeLossWeights,
    ep: Option<&mut dyn MoeExchange>,
) -> MoeStats {
    let _p = crate::profile::scope("moe_forward");
    let MoeInputs { x, router_w, experts_w, shared_w, router_bias } = inp;
    let MoeLossWeights { aux: aux_weight, z: z_weight } = loss;
    assert_eq!(*dims, cache.dims, "MoeCache built for other dims");
    let MoeDims { n, c, f, e, k, n_shared: s, .. } = *dims;
    assert!(router_bias.is_empty() || router_bias.len() == e, "one router bias per expert");
    assert_eq!(y.len(), n * c);
    assert_eq!(x.len(), n * c);
    assert_eq!(router_w.len(), dims.router_size());
    assert_eq!(experts_w.len(), dims.experts_size() / ep_size(&ep, e));
    assert_eq!(shared_w.len(), dims.shared_size());
    let es = dims.expert_size();

    // Router: logits = x · Wrᵀ, then per token softmax, logsumexp, top-k and gates.
    gemm(&mut cache.logits, false, View::rows(x, n, c), View::rows(router_w, e, c).t(), 1.0, Threads::All);
    moe_route_with(MoeRoute { probs: &mut cache.probs, lse: &mut cache.lse, idx: &mut cache.idx, gates: &mut cache.gates }, &cache.logits, router_bias, dims);

    // Assign slots (sequential, O(N·K): the index maps never depend on threads).
    moe_assign(&mut cache.slot, &mut cache.row_token, &mut cache.offsets, &mut cache.counts, &cache.idx, k, dims.capacity());
    let rows = cache.rows();

    // The load-balancing statistics, summed sequentially in f64: per expert its
    // token-assignments and Σ_t probs, and the token count — over the routing group when
    // there is one (see the module docs).
    let mut ep = ep;
    let st = &mut cache.route;
    st.clear();
    st.extend(cache.counts.iter().map(|&x| x as f64));
    st.extend((0..e).map(|ex| (0..n).map(|t| cache.probs[t * e + ex] as f64).sum::<f64>()));
    st.push(n as f64);
    if let Some(ex) = ep.as_deref_mut() {
        ex.sum_routing(st);
    }

    // Dispatch: gather the kept tokens into the packed per-expert buffer.
    moe_dispatch(&mut cache.xe[..rows * c], x, &cache.row_token[..rows], c);

    // Routed experts in order, each product on the whole pool (see the module docs); under
    // expert parallelism on their owners, the rows sent there and the outputs back.
    let (ep_rows_sent, ep_rows_received) = match ep {
        Some(ex) if ex.size() > 1 => ep_experts_forward(cache, experts_w, ex, rows),
        _ => {
            experts_forward(&mut cache.eo, &mut cache.gu, &mut cache.h, &cache.xe, &cache.offsets, experts_w, dims);
            (0, 0)
        }
    };

    // Shared experts over all tokens, summed into y in order; then the routed combine.
    for si in 0..s {
        let (wgu, w2) = expert_views(&shared_w[si * es..(si + 1) * es], c, f);
        let sgu = &mut cache.sgu[si * n * 2 * f..(si + 1) * n * 2 * f];
        let sh = &mut cache.sh[si * n * f..(si + 1) * n * f];
        gemm(sgu, false, View::rows(x, n, c), View::rows(wgu, 2 * f, c).t(), 1.0, Threads::All);
        swiglu_forward(sh, sgu, f);
        gemm(y, si > 0, View::rows(sh, n, f), View::rows(w2, c, f).t(), 1.0, Threads::All);
    }
    moe_combine(y, &cache.eo[..rows * c], &cache.gates, &cache.slot, s > 0, c, k);

    // Losses: `f_e·P_e` from the (routing group's) statistics.
    let (route, nt) = (&cache.route, cache.route[2 * e]);
    let mut aux = 0.0f64;
    for ex in 0..e {
        let pe: f64 = route[e + ex] / nt;
        aux += route[ex] / (nt * k as f64) * pe;
    }
    let aux = (aux * e as f64) as f32;
    let z = (cache.lse.iter().map(|&l| l as f64 * l as f64).sum::<f64>() / n as f64) as f32;
    let max_load = cache.counts.iter().copied().max().unwrap_or(0);
    MoeStats {
        aux_loss: aux,
        z_loss: z,
        loss: aux_weight * aux + z_weight * z,
        counts: cache.counts.clone(),
        dropped_fraction: (n * k - rows) as f32 / (n * k) as f32,
        max_load,
        mean_load: (n * k) as f32 / e as f32,
        ep_rows_sent,
        ep_rows_received,
    }
}

/// Ranks the routed experts are spread over (1 without expert parallelism); they must divide
/// `E` evenly.
fn ep_size(ep: &Option<&mut dyn MoeExchange>, e: usize) -> usize {
    let p = ep.as_ref().map_or(1, |x| x.size());
    assert!(p > 0 && e.is_multiple_of(p), "{p} expert-parallel ranks do not split {e} experts evenly");
    p
}

/// Experts `0..El` over their packed rows (`offsets[j]..offsets[j+1]`, `[El + 1]`), in order.
fn experts_forward(
    eo: &mut [f32],        // [R, C]
    gu: &mut [f32],        // [R, 2F]
    h: &mut [f32],         // [R, F]
    xe: &[f32],            // [R, C]
    offsets: &[usize],     // [El + 1]
    experts_w: &[f32],     // [El, 3FC]
    dims: &MoeDims,
) {
    let MoeDims { c, f, .. } = *dims;
    let es = 3 * f * c;
    for ex in 0..offsets.len() - 1 {
        let (r0, r1) = (offsets[ex], offsets[ex + 1]);
        expert_forward(&mut eo[r0 * c..r1 * c], &mut gu[r0 * 2 * f..r1 * 2 * f], &mut h[r0 * f..r1 * f], &xe[r0 * c..r1 * c], &experts_w[ex * es..(ex + 1) * es], c, f);
    }
}

/// The expert-parallel middle of [`moe_forward`]: counts, then `xe`'s rows to their owners,
/// this rank's experts on what it received, and the outputs back into `eo` (packed order).
/// Returns the rows sent to and received from other ranks.
fn ep_experts_forward(cache: &mut MoeCache, experts_w: &[f32], ex: &mut dyn MoeExchange, rows: usize) -> (usize, usize) {
    let dims = cache.dims;
    let MoeDims { c, f, e, .. } = dims;
    let p = ex.size();
    let el = e / p;
    let MoeCache { offsets, xe, eo, ep, .. } = cache;
    ep.send = (0..e).map(|j| offsets[j + 1] - offsets[j]).collect();
    ep.recv = vec![0; e];
    ex.exchange_counts(&ep.send, &mut ep.recv);
    let (send_rows, recv_rows) = (per_peer(&ep.send, el), per_peer(&ep.recv, el));
    let rl = ep.rows();
    grow(&mut ep.buf, rl.max(rows) * c);
    for (v, w) in [(&mut ep.xl, c), (&mut ep.gul, 2 * f), (&mut ep.hl, f), (&mut ep.eol, c)] {
        grow(v, rl * w);
    }
    ex.exchange_rows(&xe[..rows * c], &send_rows, &mut ep.buf[..rl * c], &recv_rows, c);
    let runs = ep_runs(&ep.recv, p, el);
    ep_permute(&mut ep.xl, &ep.buf, &runs, c, true);
    let lo = local_offsets(&ep.recv, p, el);
    experts_forward(&mut ep.eol, &mut ep.gul, &mut ep.hl, &ep.xl, &lo, experts_w, &dims);
    ep_permute(&mut ep.buf, &ep.eol, &runs, c, false);
    ex.exchange_rows(&ep.buf[..rl * c], &recv_rows, &mut eo[..rows * c], &send_rows, c);
    (rows - send_rows[ex.rank()], rl - recv_rows[ex.rank()])
}

/// The router's outputs per token: softmax, logsumexp, the top-k experts and their gates.
pub struct MoeRoute<'a> {
    pub probs: &'a mut [f32],  // [N, E]
    pub lse: &'a mut [f32],    // [N]
    pub idx: &'a mut [u32],    // [N, K]
    pub gates: &'a mut [f32],  // [N, K]
}

/// Routing from the router's `logits[N, E]`: per token the softmax, its logsumexp, the top-k
/// experts (ties → lower id, by logit) and their gates (renormalised over the k when
/// `renormalize`). Overwrites every output.
pub fn moe_route(out: MoeRoute, logits: &[f32], e: usize, renormalize: bool) {
    let dims = MoeDims { n: 1, c: 1, f: 1, e, k: 1, n_shared: 0, capacity_factor: 0.0, renormalize, scoring: Scoring::Softmax, gate_scale: 1.0 };
    moe_route_with(out, logits, &[], &dims);
}

/// [`moe_route`] by `dims`' scoring, renormalisation and gate scale (`router_bias`: the
/// sigmoid router's correction bias, or empty).
pub fn moe_route_with(out: MoeRoute, logits: &[f32], router_bias: &[f32], dims: &MoeDims) {
    let (e, k) = (dims.e, out.idx.len() / out.lse.len().max(1));
    out.probs
        .par_chunks_mut(e)
        .zip(out.lse.par_iter_mut())
        .zip(out.idx.par_chunks_mut(k).zip(out.gates.par_chunks_mut(k)))
        .zip(logits.par_chunks(e))
        .with_min_len(64)
        .for_each(|(((p, lse), (idx, g)), l)| {
            match dims.scoring {
                Scoring::Softmax => route_row(p, lse, idx, g, l, dims.renormalize),
                Scoring::Sigmoid { groups, topk_groups } => sigmoid_route_row((p, lse, idx, g), l, router_bias, (groups, topk_groups), dims.renormalize),
            }
            if dims.gate_scale != 1.0 {
                g.iter_mut().for_each(|g| *g *= dims.gate_scale);
            }
        });
}

/// DeepSeek-V3's routing of one token (see [`Scoring::Sigmoid`]): sigmoid scores, the logits'
/// logsumexp, the group-limited top-k of the biased scores (ties → lower group, lower id) and
/// the unbiased gates, renormalised as transformers does (`÷ (Σ + 1e-20)`).
fn sigmoid_route_row((p, lse, idx, g): (&mut [f32], &mut f32, &mut [u32], &mut [f32]), l: &[f32], bias: &[f32], (groups, topk_groups): (usize, usize), renormalize: bool) {
    let e = l.len();
    for (p, &v) in p.iter_mut().zip(l) {
        *p = 1.0 / (1.0 + (-v).exp());
    }
    let max = l.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    *lse = max + l.iter().map(|&v| (v - max).exp()).sum::<f32>().ln();
    let choice: Vec<f32> = (0..e).map(|x| p[x] + bias.get(x).copied().unwrap_or(0.0)).collect();
    let gs = e / groups;
    // Each group's score: the sum of its two best choices (its one, in groups of one).
    let score: Vec<f32> = choice
        .chunks(gs)
        .map(|c| {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &v in c {
                if v > a {
                    (a, b) = (v, a);
                } else if v > b {
                    b = v;
                }
            }
            if gs == 1 { a } else { a + b }
        })
        .collect();
    let mut allowed = vec![false; groups];
    for _ in 0..topk_groups {
        let best = (0..groups).filter(|&gi| !allowed[gi]).fold(usize::MAX, |b, gi| if b == usize::MAX || score[gi] > score[b] { gi } else { b });
        allowed[best] = true;
    }
    for j in 0..idx.len() {
        let best = (0..e).filter(|&x| allowed[x / gs] && !idx[..j].contains(&(x as u32))).fold(usize::MAX, |b, x| if b == usize::MAX || choice[x] > choice[b] { x } else { b });
        idx[j] = best as u32;
        g[j] = p[best];
    }
    if renormalize {
        let s = g.iter().sum::<f32>() + 1e-20;
        for g in g.iter_mut() {
            *g /= s;
        }
    }
}

/// Softmax, logsumexp, top-k (ties → lower id, by logit) and gates of one token.
fn route_row(p: &mut [f32], lse: &mut f32, idx: &mut [u32], g: &mut [f32], l: &[f32], renormalize: bool) {
    let max = l.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0f32;
    for (p, &v) in p.iter_mut().zip(l) {
        *p = (v - max).exp();
        sum += *p;
    }
    let inv = 1.0 / sum;
    for p in p.iter_mut() {
        *p *= inv;
    }
    *lse = max + sum.ln();
    for j in 0..idx.len() {
        let mut best = usize::MAX;
        for (ex, &v) in l.iter().enumerate() {
            if idx[..j].contains(&(ex as u32)) {
                continue;
            }
            if best == usize::MAX || v > l[best] {
                best = ex;
            }
        }
        idx[j] = best as u32;
        g[j] = p[best];
    }
    if renormalize {
        let s: f32 = g.iter().sum();
        for g in g.iter_mut() {
            *g /= s;
        }
    }
}

/// Assignment: token-assignments `(t, j)` in token order, then rank order, take the next slot
/// of expert `idx[t, j]`; past `capacity` they are [`DROPPED`]. Writes the index maps
/// `slot[t, j]` (packed row or DROPPED) and `row_token[r]`, the packed layout `offsets` and the
/// pre-drop `counts`; returns the kept count `R`. Overwrites its outputs.
pub fn moe_assign(
    slot: &mut [u32],        // [N, K]
    row_token: &mut [u32],   // [≥ R]
    offsets: &mut [usize],   // [E + 1]
    counts: &mut [usize],    // [E]
    idx: &[u32],             // [N, K]
    k: usize,
    capacity: usize,
) -> usize {
    let e = counts.len();
    assert_eq!(offsets.len(), e + 1);
    assert_eq!(slot.len(), idx.len());
    counts.fill(0);
    for (sl, &ex) in slot.iter_mut().zip(idx) {
        let ex = ex as usize;
        // Provisionally the position within the expert; made a packed row below.
        *sl = if counts[ex] < capacity { counts[ex] as u32 } else { DROPPED };
        counts[ex] += 1;
    }
    offsets[0] = 0;
    for ex in 0..e {
        offsets[ex + 1] = offsets[ex] + counts[ex].min(capacity);
    }
    for (i, sl) in slot.iter_mut().enumerate() {
        if *sl != DROPPED {
            let row = offsets[idx[i] as usize] + *sl as usize;
            *sl = row as u32;
            row_token[row] = (i / k) as u32;
        }
    }
    offsets[e]
}

/// Dispatch: `xe[r] = x[row_token[r]]`. Overwrites `xe`.
pub fn moe_dispatch(
    xe: &mut [f32],        // [R, C]
    x: &[f32],             // [N, C]
    row_token: &[u32],     // [R]
    c: usize,
) {
    assert_eq!(xe.len(), row_token.len() * c);
    xe.par_chunks_mut(c).zip(row_token.par_iter()).with_min_len(16).for_each(|(o, &t)| {
        let t = t as usize;
        o.copy_from_slice(&x[t * c..(t + 1) * c]);
    });
}

/// Combine: `y[t] (=|+=) Σ_{j kept} gate[t, j] · eo[slot[t, j]]`, over j in rank order
/// (overwrites `y` unless `accumulate`).
pub fn moe_combine(
    y: &mut [f32],     // [N, C]
    eo: &[f32],        // [R, C]
    gates: &[f32],     // [N, K]
    slot: &[u32],      // [N, K]
    accumulate: bool,
    c: usize,
    k: usize,
) {
    y.par_chunks_mut(c).enumerate().with_min_len(16).for_each(|(t, yr)| {
        if !accumulate {
            yr.fill(0.0);
        }
        for j in 0..k {
            let r = slot[t * k + j];
            if r != DROPPED {
                let r = r as usize;
                axpy(yr, gates[t * k + j], &eo[r * c..(r + 1) * c]);
            }
        }
    });
}

/// Backward of [`moe_combine`] (without accumulation): `dgate[t, j] = ⟨dy[t], eo[slot[t, j]]⟩`
/// (0 for a dropped assignment) and `deo[r] = gate[t, j]·dy[t]` for the assignment `(t, j)`
/// that row `r` holds. Overwrites both.
pub fn moe_combine_backward(
    grads: (&mut [f32], &mut [f32]),  // dgate [N, K], deo [R, C]
    dy: &[f32],                       // [N, C]
    eo: &[f32],                       // [R, C]
    gates: &[f32],                    // [N, K]
    slot: &[u32],                     // [N, K]
    row_token: &[u32],                // [≥ R]
    (c, k): (usize, usize),           // the width, the experts per token
) {
    let (dgate, deo) = grads;
    dgate.par_chunks_mut(k).enumerate().with_min_len(16).for_each(|(t, dg)| {
        for j in 0..k {
            let r = slot[t * k + j];
            dg[j] = if r == DROPPED { 0.0 } else { dot(&dy[t * c..(t + 1) * c], &eo[r as usize * c..(r as usize + 1) * c]) };
        }
    });
    deo.par_chunks_mut(c).enumerate().with_min_len(16).for_each(|(r, d)| {
        let t = row_token[r] as usize;
        // the rank j of row r within its token
        let j = (0..k).find(|&j| slot[t * k + j] == r as u32).unwrap();
        let g = gates[t * k + j];
        for (d, &v) in d.iter_mut().zip(&dy[t * c..(t + 1) * c]) {
            *d = g * v;
        }
    });
}

/// Backward of [`moe_dispatch`]: `dx[t] += Σ_j dxe[slot[t, j]]` over the kept assignments, in
/// rank order.
pub fn moe_dispatch_backward(
    dx: &mut [f32],     // [N, C]
    dxe: &[f32],        // [R, C]
    slot: &[u32],       // [N, K]
    c: usize,
    k: usize,
) {
    dx.par_chunks_mut(c).enumerate().with_min_len(16).for_each(|(t, d)| {
        for j in 0..k {
            let r = slot[t * k + j];
            if r != DROPPED {
                axpy(d, 1.0, &dxe[r as usize * c..(r as usize + 1) * c]);
            }
        }
    });

}

crate::multiversion! {
    /// `y += a · x`.
    fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        for (y, x) in y.iter_mut().zip(x) {
            *y += a * x;
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    crate::simd::sum_by([a, &b[..a.len()]], |[a, b]| a * b)
}

/// One SwiGLU expert over its `M` tokens: `gu = xe·w_guᵀ`, `h = silu(gate)·up`, `eo = h·w2ᵀ`.
fn expert_forward(
    eo: &mut [f32],   // [M, C]
    gu: &mut [f32],   // [M, 2F]
    h: &mut [f32],    // [M, F]
    xe: &[f32],       // [M, C]
    w: &[f32],        // [3FC]
    c: usize,
    f: usize,
) {
    let m = xe.len() / c;
    if m == 0 {
        return;
    }
    let (wgu, w2) = expert_views(w, c, f);
    gemm(gu, false, View::rows(xe, m, c), View::rows(wgu, 2 * f, c).t(), 1.0, Threads::All);
    swiglu_forward(h, gu, f);
    gemm(eo, false, View::rows(h, m, f), View::rows(w2, c, f).t(), 1.0, Threads::All);
}

// ---------------------------------------------------------------------------------------------
// Backward

/// Backward of [`moe_forward`] for the total `L = ⟨dy, y⟩ + loss.aux·aux + loss.z·z`.
/// Accumulates into every field of `grads`; `cache` must hold the forward of the same inputs
/// (its scratch is overwritten). With `ep` (the forward's group), `dexperts_w` and `experts_w`
/// are this rank's experts, whose gradient collects the rows every rank of the group sent
/// them; collective over `ep`'s group.
pub fn moe_backward(
    grads: MoeGrads,         // dx [N, C], drouter_w [E, C], dexperts_w [E/P, 3FC], dshared_w [S, 3FC]
    dy: &[f32],              // [N, C]
    cache: &mut MoeCache,
    inp: MoeInputs,          // x [N, C], router_w [E, C], experts_w [E/P, 3FC], shared_w [S, 3FC]
    dims: &MoeDims,
    loss: MoeLossWeights,
    ep: Option<&mut dyn MoeExchange>,
) {
    let _p = crate::profile::scope("moe_backward");
    let MoeGrads { dx, drouter_w, dexperts_w, dshared_w } = grads;
    let MoeInputs { x, router_w, experts_w, shared_w, .. } = inp;
    let MoeLossWeights { aux: aux_weight, z: z_weight } = loss;
    assert_eq!(*dims, cache.dims, "MoeCache built for other dims");
    let MoeDims { n, c, f, e, k, n_shared: s, .. } = *dims;
    assert_eq!(dx.len(), n * c);
    assert_eq!(dy.len(), n * c);
    assert_eq!(x.len(), n * c);
    assert_eq!(drouter_w.len(), dims.router_size());
    assert_eq!(router_w.len(), dims.router_size());
    let p = ep_size(&ep, e);
    assert_eq!(dexperts_w.len(), dims.experts_size() / p);
    assert_eq!(experts_w.len(), dims.experts_size() / p);
    assert_eq!(dshared_w.len(), dims.shared_size());
    assert_eq!(shared_w.len(), dims.shared_size());
    let es = dims.expert_size();
    let rows = cache.rows();
    let MoeCache { probs, lse, idx, gates, slot, row_token, offsets, route, xe, gu, h, eo, sgu, sh, ep: epc, deo, dh, dgu, dgate, dlogits, .. } = cache;

    moe_combine_backward((dgate, &mut deo[..rows * c]), dy, &eo[..rows * c], gates, slot, row_token, (c, k));

    // Routed experts' backward in order; `deo` is replaced by d(dispatched tokens). Under
    // expert parallelism the d(eo) rows go to the experts' owners and d(xe) rows come back.
    match ep {
        Some(ex) if p > 1 => {
            let el = e / p;
            let (send_rows, recv_rows) = (per_peer(&epc.send, el), per_peer(&epc.recv, el));
            let rl = epc.rows();
            grow(&mut epc.dl, rl * c);
            grow(dh, rl * f);
            grow(dgu, rl * 2 * f);
            ex.exchange_rows(&deo[..rows * c], &send_rows, &mut epc.buf[..rl * c], &recv_rows, c);
            let runs = ep_runs(&epc.recv, p, el);
            ep_permute(&mut epc.dl, &epc.buf, &runs, c, true);
            let lo = local_offsets(&epc.recv, p, el);
            let acts = ExpertActs { xe: &epc.xl, gu: &epc.gul, h: &epc.hl };
            experts_backward(ExpertGrads { deo: &mut epc.dl, dh, dgu }, dexperts_w, acts, &lo, experts_w, dims);
            ep_permute(&mut epc.buf, &epc.dl, &runs, c, false);
            ex.exchange_rows(&epc.buf[..rl * c], &recv_rows, &mut deo[..rows * c], &send_rows, c);
        }
        _ => experts_backward(ExpertGrads { deo, dh, dgu }, dexperts_w, ExpertActs { xe, gu, h }, offsets, experts_w, dims),
    }
    moe_dispatch_backward(dx, &deo[..rows * c], slot, c, k);

    // Shared experts, in order.
    for si in 0..s {
        let w = &shared_w[si * es..(si + 1) * es];
        let dw = &mut dshared_w[si * es..(si + 1) * es];
        let sgu = &sgu[si * n * 2 * f..(si + 1) * n * 2 * f];
        let sh = &sh[si * n * f..(si + 1) * n * f];
        let (dh, dgu) = (&mut dh[..n * f], &mut dgu[..n * 2 * f]);
        let (wgu, w2) = expert_views(w, c, f);
        let (dwgu, dw2) = dw.split_at_mut(2 * f * c);
        gemm(dh, false, View::rows(dy, n, c), View::rows(w2, c, f), 1.0, Threads::All);
        gemm(dw2, true, View::rows(dy, n, c).t(), View::rows(sh, n, f), 1.0, Threads::All);
        dgu.fill(0.0);
        swiglu_backward(dgu, dh, sgu, f);
        gemm(dwgu, true, View::rows(dgu, n, 2 * f).t(), View::rows(x, n, c), 1.0, Threads::All);
        gemm(dx, true, View::rows(dgu, n, 2 * f), View::rows(wgu, 2 * f, c), 1.0, Threads::All);
    }

    // Router: gates (with renormalisation), aux and z losses → d(logits) → dx, dWr.
    // d(aux_weight·aux)/d(probs[t, e]) = aux_weight·E·f_e / N with f_e the routing group's
    // (`route`). Over a group, `aux_weight` arrives scaled by this rank's share of the batch's
    // loss (`N / N_group` when every target counts), so dividing by the local `N` gives the
    // one-rank coefficient `aux_weight·E·f_e / N_group`.
    let nt = route[2 * e];
    let aux_coef: Vec<f32> =
        route[..e].iter().map(|&cnt| (aux_weight as f64 * e as f64 * cnt / ((nt * k as f64) * n as f64)) as f32).collect();
    let z_coef = 2.0 * z_weight / n as f32;
    moe_router_backward_with(dlogits, (probs, lse, idx, gates), dgate, (&aux_coef, z_coef), dims);
    gemm(dx, true, View::rows(dlogits, n, e), View::rows(router_w, e, c), 1.0, Threads::All);
    gemm(drouter_w, true, View::rows(dlogits, n, e).t(), View::rows(x, n, c), 1.0, Threads::All);
}

/// The router's backward from the gates' gradient `dgate[N, K]` to the logits': through the
/// gates (and their renormalisation), the load-balancing loss (`aux_coef[e]`, the gradient of
/// the weighted aux loss with respect to `probs[t, e]`) and the z-loss (`z_coef·lse[t]·p`), then
/// the softmax. Overwrites `dlogits[N, E]`.
pub fn moe_router_backward(
    dlogits: &mut [f32],                          // [N, E]
    route: (&[f32], &[f32], &[u32], &[f32]),      // probs [N, E], lse [N], idx [N, K], gates [N, K]
    dgate: &[f32],                                // [N, K]
    coefs: (&[f32], f32),                         // [E], z
    e: usize,
    renormalize: bool,
) {
    let dims = MoeDims { n: 1, c: 1, f: 1, e, k: 1, n_shared: 0, capacity_factor: 0.0, renormalize, scoring: Scoring::Softmax, gate_scale: 1.0 };
    moe_router_backward_with(dlogits, route, dgate, coefs, &dims);
}

/// [`moe_router_backward`] by `dims`' scoring, renormalisation and gate scale `s`: with
/// `g_j = s·p_j / S`, `dp_i = (s·dg_i − Σ_j dg_j·g_j) / S`; the sigmoid router's
/// `d(logit) = dp·p·(1 − p)` (its `S` has transformers' 1e-20; it has no z-loss).
pub fn moe_router_backward_with(
    dlogits: &mut [f32],
    (probs, lse, idx, gates): (&[f32], &[f32], &[u32], &[f32]),
    dgate: &[f32],
    (aux_coef, z_coef): (&[f32], f32),
    dims: &MoeDims,
) {
    let (e, s) = (dims.e, dims.gate_scale);
    let sigmoid = matches!(dims.scoring, Scoring::Sigmoid { .. });
    let k = idx.len() / lse.len().max(1);
    dlogits.par_chunks_mut(e).enumerate().with_min_len(64).for_each(|(t, dl)| {
        let p = &probs[t * e..(t + 1) * e];
        let (ix, g, dg) = (&idx[t * k..(t + 1) * k], &gates[t * k..(t + 1) * k], &dgate[t * k..(t + 1) * k]);
        // dl holds d(probs) first.
        dl.copy_from_slice(aux_coef);
        if dims.renormalize {
            let ssum: f32 = ix.iter().map(|&i| p[i as usize]).sum::<f32>() + if sigmoid { 1e-20 } else { 0.0 };
            let gd: f32 = dg.iter().zip(g).map(|(a, b)| a * b).sum();
            for j in 0..k {
                dl[ix[j] as usize] += (s * dg[j] - gd) / ssum;
            }
        } else {
            for j in 0..k {
                dl[ix[j] as usize] += s * dg[j];
            }
        }
        if sigmoid {
            for (d, &p) in dl.iter_mut().zip(p) {
                *d *= p * (1.0 - p);
            }
            return;
        }
        // softmax backward, plus z: d(lse²)/d(logit) = 2·lse·p
        let pd: f32 = p.iter().zip(dl.iter()).map(|(a, b)| a * b).sum();
        let zc = z_coef * lse[t];
        for (d, &p) in dl.iter_mut().zip(p) {
            *d = p * (*d - pd) + zc * p;
        }
    });
}

/// What forward saved of the experts over `M` packed rows: their inputs and activations.
#[derive(Clone, Copy)]
struct ExpertActs<'a> {
    xe: &'a [f32],  // [M, C]   dispatched tokens
    gu: &'a [f32],  // [M, 2F]  pre-activations [gate | up]
    h: &'a [f32],   // [M, F]   activations
}

impl<'a> ExpertActs<'a> {
    /// Packed rows `r0..r1`.
    fn rows(self, r0: usize, r1: usize, c: usize, f: usize) -> ExpertActs<'a> {
        ExpertActs { xe: &self.xe[r0 * c..r1 * c], gu: &self.gu[r0 * 2 * f..r1 * 2 * f], h: &self.h[r0 * f..r1 * f] }
    }
}

/// The experts' backward buffers over `M` packed rows: `deo` holds d(output) on entry and
/// d(xe) on return; `dh`, `dgu` are scratch.
struct ExpertGrads<'a> {
    deo: &'a mut [f32],  // [M, C]
    dh: &'a mut [f32],   // [≥ M, F]
    dgu: &'a mut [f32],  // [≥ M, 2F]
}

/// Backward of [`experts_forward`]: accumulates into `dexperts_w`; replaces `g.deo` (d(output)
/// in) with d(xe) (out). `g.dh`, `g.dgu` are scratch of at least `R` rows.
fn experts_backward(
    g: ExpertGrads,         // deo [R, C], dh [≥ R, F], dgu [≥ R, 2F]
    dexperts_w: &mut [f32], // [El, 3FC]
    acts: ExpertActs,       // xe [R, C], gu [R, 2F], h [R, F]
    offsets: &[usize],      // [El + 1]
    experts_w: &[f32],      // [El, 3FC]
    dims: &MoeDims,
) {
    let MoeDims { c, f, .. } = *dims;
    let ExpertGrads { deo, dh, dgu } = g;
    let es = 3 * f * c;
    for ex in 0..offsets.len() - 1 {
        let (r0, r1) = (offsets[ex], offsets[ex + 1]);
        expert_backward(
            ExpertGrads { deo: &mut deo[r0 * c..r1 * c], dh: &mut dh[r0 * f..r1 * f], dgu: &mut dgu[r0 * 2 * f..r1 * 2 * f] },
            &mut dexperts_w[ex * es..(ex + 1) * es],
            acts.rows(r0, r1, c, f),
            &experts_w[ex * es..(ex + 1) * es],
            c,
            f,
        );
    }
}

/// Backward of [`expert_forward`]: accumulates into `dw`; replaces `g.deo` (d(output) in) with
/// d(xe) (out). `g.dh`, `g.dgu` are scratch.
fn expert_backward(
    g: ExpertGrads,   // deo [M, C] (in: d(eo); out: d(xe)), dh [M, F], dgu [M, 2F]
    dw: &mut [f32],   // [3FC]
    acts: ExpertActs, // xe [M, C], gu [M, 2F], h [M, F]
    w: &[f32],        // [3FC]
    c: usize,
    f: usize,
) {
    let ExpertGrads { deo, dh, dgu } = g;
    let ExpertActs { xe, gu, h } = acts;
    let m = xe.len() / c;
    if m == 0 {
        return;
    }
    let (wgu, w2) = expert_views(w, c, f);
    let (dwgu, dw2) = dw.split_at_mut(2 * f * c);
    // dh = deo · w2 ; dw2 += deoᵀ · h
    gemm(dh, false, View::rows(deo, m, c), View::rows(w2, c, f), 1.0, Threads::All);
    gemm(dw2, true, View::rows(deo, m, c).t(), View::rows(h, m, f), 1.0, Threads::All);
    dgu.fill(0.0);
    swiglu_backward(dgu, dh, gu, f);
    // dw_gu += dguᵀ · xe ; dxe = dgu · w_gu (into deo, no longer needed)
    gemm(dwgu, true, View::rows(dgu, m, 2 * f).t(), View::rows(xe, m, c), 1.0, Threads::All);
    gemm(deo, false, View::rows(dgu, m, 2 * f), View::rows(wgu, 2 * f, c), 1.0, Threads::All);
}
