//! Data parallelism with overlapped bucketed gradient reduction, and ZeRO stages 1–3
//! (Rajbhandari et al., SC20), applied to the model through its units ([`UnitStore`]).
//!
//! Every rank holds a replica (or, with ZeRO, a shard) and runs forward and backward on its
//! part of the global batch. Gradients are summed over ranks: the loss gradient of each rank
//! is already scaled by `1/(global token count)`, so the sum is the global-batch gradient.
//!
//! - **Stage 0** (plain DP): full parameters, gradients and AdamW moments on every rank. During
//!   the last micro-batch's backward, gradients are all-reduced in buckets of consecutive units
//!   (`bucket_elems` elements or more, built from the last unit backward), each launched on the
//!   communication thread as soon as backward has released all its units.
//! - **Stage 1**: moments for this rank's shard only; the buckets are reduce-scattered instead,
//!   each rank updates its shard of the (fp32, hence master) parameters, and the parameters are
//!   all-gathered after the update.
//! - **Stage 2**: also no full gradient buffer: each unit's gradients go to a unit-sized buffer
//!   that is reduce-scattered into this rank's gradient shard when backward releases the unit,
//!   then freed. Gradients are reduced at every micro-batch (as DeepSpeed does), since a full
//!   buffer to accumulate into is exactly what this stage does not keep.
//! - **Stage 3**: also only a parameter shard: each unit is all-gathered just before forward or
//!   backward needs it, with the next unit's gather launched at the same time (prefetch), and
//!   freed when released.
//!
//! Shards: unit `u` of length `L` is split into `n` chunks of `c = ⌈L/n⌉` (the last ones
//! padded with zeros); rank `r` owns chunk `r` of every unit, and its shard is the
//! concatenation of its chunks in unit order. The same shards serve every stage, so the
//! optimizer touches the same elements in the same order whatever the stage, and stages 1–3
//! reproduce stage 0 bit for bit at the same `n`.
//!
//! **Expert parallelism** ([`DataParallel::new_ep`], stage 0): the group is the whole
//! `dp × ep` group, but the flat ranges of the routed experts (which differ across the ep
//! axis) are reduced and broadcast over their own communicator, the ranks holding the same
//! experts, and counted in the gradient norm once per ep rank.
//!
//! Deterministic gradient norm: `Σ_u Σ_r Σ_{i ∈ chunk(u, r)} g_i²`, each chunk's partial
//! summed in f64 by `tensor::sum_squares`, then in (unit, rank) order — the same value on every
//! rank and at every stage.

use crate::comm::Comm;
use crate::worker::CommWorker;
use model::{Access, Gpt, UnitStore};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tensor::par::SyncPtr;

/// A communicator shared between the store and its communication thread's jobs.
type SharedComm = Arc<Mutex<Box<dyn Comm>>>;

/// [`DataParallel::quantize_base`]'s source of each frozen tensor's fp32 values.
type BaseFill<'a> = &'a mut dyn FnMut(&model::ParamSpec, &mut [f32]);

/// Default bucket size: PyTorch DDP's 25 MiB of fp32 gradients.
pub const DEFAULT_BUCKET_ELEMS: usize = 25 * 1024 * 1024 / 4;

/// A contiguous run of elements this rank updates: `flat` in the full layout, `shard` in the
/// optimizer-state buffers (equal to `flat` at stage 0, where the moments are full-size).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub flat: Range<usize>,
    pub shard: Range<usize>,
}

/// The per-unit sharding of the flat layout over `n` ranks.
#[derive(Clone, Debug)]
pub struct Shards {
    pub n: usize,
    pub rank: usize,
    pub units: Vec<Range<usize>>,
    /// Chunk length of each unit.
    pub chunk: Vec<usize>,
    /// Offset of each unit's chunk in a shard.
    pub offset: Vec<usize>,
    /// Shard length (padded).
    pub len: usize,
}

impl Shards {
    pub fn new(units: &[Range<usize>], n: usize, rank: usize) -> Shards {
        let chunk: Vec<usize> = units.iter().map(|u| u.len().div_ceil(n)).collect();
        let mut offset = Vec::with_capacity(units.len());
        let mut len = 0;
        for c in &chunk {
            offset.push(len);
            len += c;
        }
        Shards { n, rank, units: units.to_vec(), chunk, offset, len }
    }

    /// Rank `r`'s real (unpadded) elements of unit `u`, relative to the unit's start.
    pub fn own(&self, u: usize, r: usize) -> Range<usize> {
        let (c, l) = (self.chunk[u], self.units[u].len());
        (r * c).min(l)..((r + 1) * c).min(l)
    }

    /// This rank's pieces (one per unit with elements on this rank), with shard positions.
    pub fn pieces(&self) -> Vec<Piece> {
        (0..self.units.len())
            .filter_map(|u| {
                let o = self.own(u, self.rank);
                let s = self.units[u].start;
                (!o.is_empty()).then(|| Piece { flat: s + o.start..s + o.end, shard: self.offset[u]..self.offset[u] + o.len() })
            })
            .collect()
    }

    /// This rank's shard of a full buffer.
    pub fn take(&self, full: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; self.len];
        for p in self.pieces() {
            out[p.shard].copy_from_slice(&full[p.flat]);
        }
        out
    }

    /// Puts rank `r`'s shard `shard` into `full` at its positions.
    fn scatter_rank(&self, r: usize, shard: &[f32], full: &mut [f32]) {
        for (u, range) in self.units.iter().enumerate() {
            let o = self.own(u, r);
            full[range.start + o.start..range.start + o.end].copy_from_slice(&shard[self.offset[u]..self.offset[u] + o.len()]);
        }
    }
}

/// What a step's gradient reduction cost and how much of it backward hid.
#[derive(Clone, Copy, Debug, Default)]
pub struct Overlap {
    /// Time the communication thread spent in the step's collectives.
    pub comm: Duration,
    /// Time between the end of backward and the end of the last reduction (not hidden).
    pub exposed: Duration,
}

impl Overlap {
    /// Fraction of the reduction time hidden behind backward.
    pub fn hidden_fraction(&self) -> f64 {
        let c = self.comm.as_secs_f64();
        if c <= 0.0 {
            return 0.0;
        }
        (1.0 - self.exposed.as_secs_f64() / c).clamp(0.0, 1.0)
    }
}

/// Bytes held per rank for model state: parameters, gradients, and (counted by the caller,
/// who owns the optimizer) optimizer state.
#[derive(Clone, Copy, Debug, Default)]
pub struct StateBytes {
    pub params: usize,
    pub grads: usize,
    /// Most bytes held at once by transient unit buffers (ZeRO-3's gathered units, ZeRO-2/3's
    /// unit gradient buffers) during the last step.
    pub peak_transient: usize,
}

/// The routed experts' flat ranges and the group of ranks that hold the same experts (see
/// [`DataParallel::new_ep`]). The communicator is only ever used on the communication thread
/// (the mutex makes it shareable with the jobs; it is never contended).
struct Experts {
    ranges: Vec<Range<usize>>,
    comm: SharedComm,
    /// This rank's position in that group: rank 0 of each counts its experts in the norm.
    rank: usize,
}

/// Where [`DataParallel::start_reduce`] leaves its sums: each flat range with its values.
pub type Reduced = Arc<Mutex<Vec<(Range<usize>, Vec<f32>)>>>;

pub struct DataParallel {
    pub zero: u8,
    experts: Option<Experts>,
    pub shards: Shards,
    worker: CommWorker,
    /// LoRA: the base is frozen, its gradients are never reduced.
    frozen: bool,
    /// Buckets (stage 0/1) as unit lists in backward order; `bucket_of[u]`; units still to be
    /// released in each bucket this micro-batch.
    buckets: Vec<Vec<usize>>,
    bucket_of: Vec<usize>,
    remaining: Vec<usize>,
    /// Reduce the gradients of this micro-batch (the last of a step; every one at stage 2/3).
    sync: bool,
    /// No gradient reduction at all (1-bit Adam's compression stage: each rank keeps its own
    /// gradients, and the optimizer communicates the momentum instead).
    local: bool,
    /// Full parameters (stages 0–2; empty at stage 3).
    params: Vec<f32>,
    /// Full gradients (stages 0–1; empty at stages 2–3), reached only through `grads_ptr`
    /// while a pass runs, since the communication thread reduces released units concurrently.
    grads: Vec<f32>,
    grads_ptr: SyncPtr,
    /// This rank's parameter shard (stage 3).
    shard_params: Vec<f32>,
    /// This rank's reduced gradient shard (stages 2–3), written by the communication thread.
    shard_grads: Vec<f32>,
    shard_grads_ptr: SyncPtr,
    /// Stage 3: gathered units (with the ticket of their gather).
    gathered: Vec<Option<(u64, Vec<f32>)>>,
    /// Stages 2–3: unit gradient buffers (padded to `n` chunks).
    unit_grads: Vec<Option<Vec<f32>>>,
    transient: usize,
    peak_transient: usize,
    backward_started: bool,
    busy_at_start: Duration,
    /// QLoRA: the frozen base, quantized (then `params` and `grads` are empty; the model
    /// shares it, to read its matrices), with each acquired unit's fp32 tensors packed; and
    /// with any frozen base (LoRA; then `grads` is empty) each unit's gradient scratch (the
    /// base's gradients are never used, but the passes write norm and bias gradients).
    base: Option<std::sync::Arc<model::qbase::QuantBase>>,
    packed: Vec<Option<Vec<f32>>>,
    /// ZeRO++ (stage 3): its switches, the node and cross-node groups (rank order as in
    /// [`crate::zeropp`]), and hpZ's secondary partition of each unit gathered in forward (with
    /// the ticket of that gather).
    zpp: crate::zeropp::ZeroPp,
    zcomms: Option<(SharedComm, SharedComm)>,
    secondary: Vec<Option<(u64, Vec<f32>)>>,
    base_grads: Vec<Option<Vec<f32>>>,
}

/// `len` elements at `p + off`. (A function, so closures capture the whole `SyncPtr`.)
///
/// # Safety
/// The caller guarantees the region is valid and not accessed by anyone else meanwhile.
unsafe fn region<'a>(p: SyncPtr, off: usize, len: usize) -> &'a mut [f32] {
    std::slice::from_raw_parts_mut(p.0.add(off), len)
}

/// The transformer layer of unit `u` (units `1..=L` are the blocks), for trace spans.
fn layer_of(shards: &Shards, u: usize) -> Option<usize> {
    (u >= 1 && u + 1 < shards.units.len()).then(|| u - 1)
}

/// Calls `f(range, comm)` for the runs of `all` in order: `comm` is the experts' communicator
/// (locked) on their ranges, `None` (the store's own) elsewhere; one call for `all` without
/// experts. A run on a single-rank communicator is skipped (its collectives are the identity).
fn for_split(all: Range<usize>, experts: Option<&(Vec<Range<usize>>, SharedComm)>, mut f: impl FnMut(Range<usize>, Option<&dyn Comm>)) {
    let Some((ranges, ec)) = experts else {
        return f(all, None);
    };
    let ec = ec.lock().unwrap_or_else(|e| e.into_inner());
    let mut at = all.start;
    for r in ranges.iter().filter(|r| r.end > all.start && r.start < all.end) {
        let (a, b) = (r.start.max(all.start), r.end.min(all.end));
        if a > at {
            f(at..a, None);
        }
        if ec.size() > 1 {
            f(a..b, Some(&**ec));
        }
        at = b;
    }
    if at < all.end {
        f(at..all.end, None);
    }
}

fn padded(x: &[f32], n: usize, c: usize) -> std::borrow::Cow<'_, [f32]> {
    if x.len() == n * c {
        std::borrow::Cow::Borrowed(x)
    } else {
        let mut v = vec![0.0; n * c];
        v[..x.len()].copy_from_slice(x);
        std::borrow::Cow::Owned(v)
    }
}

impl DataParallel {
    /// Takes over `model`'s parameters and gradients (its own buffers are left empty: passes go
    /// through this store) and shards them for `zero`. `comm` should be a communicator of its
    /// own (e.g. a `split` of the data-parallel group): it moves to the communication thread.
    /// Rank 0's parameters are broadcast first, so every replica starts identical.
    pub fn new(comm: Box<dyn Comm>, model: &mut Gpt, zero: u8, bucket_elems: usize) -> DataParallel {
        Self::with_experts(comm, None, model, zero, bucket_elems)
    }

    /// [`DataParallel::new`] for an expert-parallel shard: `comm` is the whole `dp × ep` group
    /// (every parameter outside `expert_ranges` is reduced over it), `expert_comm` the ranks of
    /// it that hold the same experts (the data-parallel group; size 1 when dp = 1), over which
    /// the ranges of the routed experts are broadcast, reduced, and counted once in the norm.
    /// Stage 0 only (ZeRO's per-unit shards would cut across the expert ranges).
    pub fn new_ep(comm: Box<dyn Comm>, expert_comm: Box<dyn Comm>, expert_ranges: Vec<Range<usize>>, model: &mut Gpt, bucket_elems: usize) -> DataParallel {
        let rank = expert_comm.rank();
        let experts = Experts { ranges: expert_ranges, comm: Arc::new(Mutex::new(expert_comm)), rank };
        Self::with_experts(comm, Some(experts), model, 0, bucket_elems)
    }

    fn with_experts(comm: Box<dyn Comm>, experts: Option<Experts>, model: &mut Gpt, zero: u8, bucket_elems: usize) -> DataParallel {
        assert!(zero <= 3, "ZeRO stage {zero} does not exist (0, 1, 2 or 3)");
        assert!(experts.is_none() || zero == 0, "expert parallelism needs ZeRO stage 0");
        let frozen = model.lora.is_some();
        assert!(!(frozen && zero > 0), "ZeRO with LoRA adapters is not supported (the adapters are small: use zero = 0)");
        let (n, rank) = (comm.size(), comm.rank());
        let shards = Shards::new(&model.units, n, rank);
        let mut worker = CommWorker::spawn(comm);
        let mut params = std::mem::take(&mut model.params);
        let mut grads = std::mem::take(&mut model.grads);
        if frozen {
            // A frozen base's gradients are never used: the passes get a scratch per unit.
            grads = Vec::new();
        }
        if n > 1 || experts.is_some() {
            let p = SyncPtr(params.as_mut_ptr());
            let len = params.len();
            let ex = experts.as_ref().map(|e| (e.ranges.clone(), e.comm.clone()));
            worker.run("broadcast params", move |c| {
                for_split(0..len, ex.as_ref(), |r, on| on.unwrap_or(c).broadcast(unsafe { region(p, r.start, r.len()) }, 0));
            });
        }
        let u = shards.units.len();
        let (mut shard_params, mut shard_grads) = (Vec::new(), Vec::new());
        if zero >= 2 {
            grads = Vec::new();
            shard_grads = vec![0.0; shards.len];
        }
        if zero == 3 {
            shard_params = shards.take(&params);
            params = Vec::new();
        }
        // Buckets: consecutive units in backward order, closed once they hold bucket_elems.
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut size = usize::MAX;
        for uu in (0..u).rev() {
            if size >= bucket_elems {
                buckets.push(Vec::new());
                size = 0;
            }
            buckets.last_mut().unwrap().push(uu);
            size += shards.units[uu].len();
        }
        let mut bucket_of = vec![0; u];
        for (b, us) in buckets.iter().enumerate() {
            for &x in us {
                bucket_of[x] = b;
            }
        }
        let remaining = buckets.iter().map(|b| b.len()).collect();
        let grads_ptr = SyncPtr(grads.as_mut_ptr());
        let shard_grads_ptr = SyncPtr(shard_grads.as_mut_ptr());
        DataParallel {
            zero, experts, shards, worker, frozen, buckets, bucket_of, remaining, sync: true, local: false,
            params, grads, grads_ptr, shard_params, shard_grads, shard_grads_ptr,
            gathered: (0..u).map(|_| None).collect(),
            unit_grads: (0..u).map(|_| None).collect(),
            transient: 0, peak_transient: 0, backward_started: false, busy_at_start: Duration::ZERO,
            base: None, packed: (0..u).map(|_| None).collect(), base_grads: (0..u).map(|_| None).collect(),
            zpp: Default::default(), zcomms: None, secondary: (0..u).map(|_| None).collect(),
        }
    }

    /// ZeRO++ from now on (stage 3, `z.node` dividing the data-parallel degree): makes the
    /// node and cross-node groups (collective over the data-parallel group).
    pub fn set_zeropp(&mut self, z: crate::zeropp::ZeroPp) {
        if !z.any() {
            return;
        }
        let (n, me, g) = (self.shards.n, self.shards.rank, z.node);
        assert!(self.zero == 3 && g >= 1 && n % g == 0, "ZeRO++ needs ZeRO-3 and a node size dividing the data-parallel degree ({g} of {n})");
        let node: Vec<usize> = (me / g * g..me / g * g + g).collect();
        let cross: Vec<usize> = (0..n / g).map(|b| b * g + me % g).collect();
        let (a, b) = self.worker.run("split zeropp", move |c| (c.split(&node), c.split(&cross)));
        self.zcomms = Some((Arc::new(Mutex::new(a)), Arc::new(Mutex::new(b))));
        self.zpp = z;
    }

    /// QLoRA: holds the frozen base quantized as `kind` from now on, built tensor by tensor by
    /// `fill` (see [`model::qbase::QuantBase::build`]; `None`: from the parameters this store
    /// holds), and frees the fp32 parameters and gradients; returns the base, which the model
    /// must be given (`Gpt::set_quantized_base`) before its next pass through this store.
    /// LoRA runs at ZeRO stage 0 only.
    pub fn quantize_base(&mut self, m: &model::Gpt, kind: model::BaseQuant, fill: Option<BaseFill<'_>>) -> std::sync::Arc<model::qbase::QuantBase> {
        assert!(self.frozen && self.zero == 0 && self.experts.is_none(), "a quantized base needs LoRA (a frozen base) at ZeRO stage 0 without experts");
        self.worker.wait_all();
        let params = std::mem::take(&mut self.params);
        let base = match fill {
            Some(f) => model::qbase::QuantBase::build(&m.layout, &m.views, &self.shards.units, kind, f),
            None => model::qbase::QuantBase::build(&m.layout, &m.views, &self.shards.units, kind, |p, dst| dst.copy_from_slice(&params[p.range()])),
        };
        drop(params);
        self.grads = Vec::new();
        self.grads_ptr = SyncPtr(self.grads.as_mut_ptr());
        let base = std::sync::Arc::new(base);
        self.base = Some(base.clone());
        base
    }

    /// The quantized base, if this store holds one.
    pub fn quantized_base(&self) -> Option<&model::qbase::QuantBase> {
        self.base.as_deref()
    }

    pub fn n(&self) -> usize {
        self.shards.n
    }

    pub fn rank(&self) -> usize {
        self.shards.rank
    }

    /// Length of the optimizer-state buffers (moments): the full layout at stage 0, the shard
    /// above.
    pub fn moments_len(&self) -> usize {
        if self.zero == 0 { self.shards.units.last().map_or(0, |u| u.end) } else { self.shards.len }
    }

    /// The pieces this rank updates (at stage 0 every unit, with `shard == flat`).
    pub fn pieces(&self) -> Vec<Piece> {
        if self.zero == 0 {
            self.shards.units.iter().filter(|u| !u.is_empty()).map(|u| Piece { flat: u.clone(), shard: u.clone() }).collect()
        } else {
            self.shards.pieces()
        }
    }

    /// Whether this micro-batch's gradients are reduced (stages 0–1 reduce only on the last
    /// micro-batch of a step; stages 2–3 always).
    pub fn begin_micro(&mut self, last: bool) {
        self.sync = !self.local && (last || self.zero >= 2);
        self.grads_ptr = SyncPtr(self.grads.as_mut_ptr());
        self.shard_grads_ptr = SyncPtr(self.shard_grads.as_mut_ptr());
        self.remaining = self.buckets.iter().map(|b| b.len()).collect();
        self.backward_started = false;
    }

    /// With `local`, this step's gradients stay on each rank unreduced (stage 0 only): the
    /// sum over ranks is still the global batch's gradient.
    pub fn set_local(&mut self, local: bool) {
        assert!(!local || self.zero == 0, "local gradients need ZeRO stage 0");
        self.local = local;
    }

    /// Clears the gradient accumulators for a new step.
    pub fn zero_grad(&mut self) {
        self.worker.wait_all();
        tensor::par::zero(&mut self.grads);
        tensor::par::zero(&mut self.shard_grads);
        self.peak_transient = 0;
        self.busy_at_start = self.worker.busy();
    }

    /// Waits for the step's reductions; returns how much of them backward hid.
    pub fn finish_backward(&mut self) -> Overlap {
        let end = Instant::now();
        self.worker.wait_all();
        let exposed = end.elapsed();
        Overlap { comm: self.worker.busy() - self.busy_at_start, exposed }
    }

    /// Runs `f` with each piece's parameters and (reduced) gradients.
    pub fn for_each_piece(&mut self, mut f: impl FnMut(&Piece, &mut [f32], &mut [f32])) {
        self.worker.wait_all();
        if self.base.is_some() {
            // A quantized base has no fp32 pieces (and, frozen, is never updated).
            return;
        }
        for p in self.pieces() {
            let (params, grads): (&mut [f32], &mut [f32]) = match self.zero {
                0 if self.frozen => (&mut self.params[p.flat.clone()], &mut []),
                0 | 1 => (&mut self.params[p.flat.clone()], &mut self.grads[p.flat.clone()]),
                2 => (&mut self.params[p.flat.clone()], &mut self.shard_grads[p.shard.clone()]),
                _ => (&mut self.shard_params[p.shard.clone()], &mut self.shard_grads[p.shard.clone()]),
            };
            f(&p, params, grads);
        }
    }

    /// This rank's reduced gradients of unit `u`: the whole unit at stage 0, the elements it
    /// owns above (the same positions on every replica of the same layout).
    pub fn unit_grads_mut(&mut self, u: usize) -> &mut [f32] {
        self.worker.wait_all();
        let range = self.shards.units[u].clone();
        let own = self.shards.own(u, self.shards.rank);
        match self.zero {
            0 => &mut self.grads[range],
            1 => &mut self.grads[range.start + own.start..range.start + own.end],
            _ => {
                let off = self.shards.offset[u];
                &mut self.shard_grads[off..off + own.len()]
            }
        }
    }

    /// The global gradient norm (collective).
    pub fn grad_norm(&mut self) -> f64 {
        let (a, b) = self.grad_sq_split(&[], &[]);
        (a + b).sqrt()
    }

    /// The squared gradient norm over the data-parallel group, split into the part outside
    /// `replicated` (flat ranges) and the part inside (collective), leaving out the elements
    /// in `skip` (a copy counted elsewhere, e.g. a pipeline's tied embedding on its last
    /// stage). Each (unit, rank) chunk's partials are taken in flat order and summed in
    /// (unit, rank) order.
    pub fn grad_sq_split(&mut self, replicated: &[Range<usize>], skip: &[Range<usize>]) -> (f64, f64) {
        if self.experts.is_some() {
            self.worker.wait_all();
            return self.grad_sq_experts(replicated, skip);
        }
        self.grad_sq_plain(replicated, skip)
    }

    fn grad_sq_plain(&mut self, replicated: &[Range<usize>], skip: &[Range<usize>]) -> (f64, f64) {
        self.worker.wait_all();
        let (n, u) = (self.shards.n, self.shards.units.len());
        // parts[2·(u·n + r) + {0, 1}]: chunk (u, r)'s sums of squares outside / inside.
        let mut parts = vec![0f64; 2 * u * n];
        let chunk_sq = |g: &[f32], flat: usize| -> (f64, f64) {
            let (mut a, mut b) = (0.0, 0.0);
            let mut i = 0;
            let within = |set: &[Range<usize>], at: usize| set.iter().find(|r| r.start <= at && at < r.end).map(|r| r.end);
            while i < g.len() {
                let at = flat + i;
                let (inside, skipped) = (within(replicated, at), within(skip, at));
                // The run of elements in the same class as `at`: up to the next boundary.
                let next = [inside, skipped]
                    .into_iter()
                    .flatten()
                    .chain(replicated.iter().chain(skip).map(|r| r.start).filter(|&s| s > at))
                    .min()
                    .unwrap_or(usize::MAX);
                let j = (next - flat).min(g.len());
                if skipped.is_none() {
                    let sq = tensor::sum_squares(&g[i..j]);
                    if inside.is_some() { b += sq } else { a += sq }
                }
                i = j;
            }
            (a, b)
        };
        if self.zero == 0 {
            for uu in 0..u {
                for r in 0..n {
                    let o = self.shards.own(uu, r);
                    let s = self.shards.units[uu].start;
                    let (a, b) = chunk_sq(&self.grads[s + o.start..s + o.end], s + o.start);
                    parts[2 * (uu * n + r)] = a;
                    parts[2 * (uu * n + r) + 1] = b;
                }
            }
        } else {
            let mut mine = Vec::with_capacity(2 * u);
            for uu in 0..u {
                let o = self.shards.own(uu, self.shards.rank);
                let s = self.shards.units[uu].start;
                let (a, b) = if self.zero == 1 {
                    chunk_sq(&self.grads[s + o.start..s + o.end], s + o.start)
                } else {
                    let off = self.shards.offset[uu];
                    chunk_sq(&self.shard_grads[off..off + o.len()], s + o.start)
                };
                mine.push(a);
                mine.push(b);
            }
            let all = self.all_gather_f64(&mine);
            for r in 0..n {
                for uu in 0..u {
                    parts[2 * (uu * n + r)] = all[r * 2 * u + 2 * uu];
                    parts[2 * (uu * n + r) + 1] = all[r * 2 * u + 2 * uu + 1];
                }
            }
        }
        let a = parts.iter().step_by(2).sum::<f64>();
        let b = parts.iter().skip(1).step_by(2).sum::<f64>();
        (a, b)
    }

    /// [`DataParallel::grad_sq_split`] with the routed experts (stage 0): the first part also
    /// holds every expert's squares once — each rank's own (in flat order), summed over the
    /// group in rank order from the first rank of each set holding the same experts.
    fn grad_sq_experts(&mut self, replicated: &[Range<usize>], skip: &[Range<usize>]) -> (f64, f64) {
        let (ranges, first) = {
            let e = self.experts.as_ref().unwrap();
            (e.ranges.clone(), e.rank == 0)
        };
        let skip_all: Vec<Range<usize>> = skip.iter().cloned().chain(ranges.iter().cloned()).collect();
        let (a, b) = self.grad_sq_plain(replicated, &skip_all);
        let mine: f64 = if first { ranges.iter().map(|r| tensor::sum_squares(&self.grads[r.clone()])).sum() } else { 0.0 };
        let all = self.all_gather_f64(&[mine]);
        (a + all.iter().fold(0.0, |s, x| s + x), b)
    }

    /// `out[r·k .. (r+1)·k] = x_r` for `k = x.len()`, exactly (on the communication thread).
    pub fn all_gather_f64(&mut self, x: &[f64]) -> Vec<f64> {
        if self.shards.n == 1 {
            return x.to_vec();
        }
        let x = x.to_vec();
        self.worker.run("all_gather f64", move |c| crate::comm::all_gather_f64(c, &x))
    }

    /// `Σ_r x_r` elementwise in rank order, exactly as a sequential f64 sum (collective).
    pub fn all_reduce_f64(&mut self, x: &[f64]) -> Vec<f64> {
        let all = self.all_gather_f64(x);
        let k = x.len();
        (0..k).map(|i| (0..self.shards.n).fold(0.0, |acc, r| acc + all[r * k + i])).collect()
    }

    /// Scales the gradients this rank updates by `s` (clipping).
    pub fn scale_grads(&mut self, s: f32) {
        self.for_each_piece(|_, _, g| tensor::scale_in_place(g, s));
    }

    /// After the optimizer updated this rank's pieces: stages 1–2 all-gather the parameters.
    pub fn after_update(&mut self) {
        // hpZ's secondary partitions hold the parameters before the update.
        self.drop_secondary();
        self.backward_started = false;
        if self.zero == 0 || self.zero == 3 || self.shards.n == 1 {
            return;
        }
        let p = SyncPtr(self.params.as_mut_ptr());
        for (u, range) in self.shards.units.clone().into_iter().enumerate() {
            let c = self.shards.chunk[u];
            let own = self.shards.own(u, self.shards.rank);
            let mut mine = vec![0.0; c];
            mine[..own.len()].copy_from_slice(&self.params[range.start + own.start..range.start + own.end]);
            self.worker.submit("all_gather params", layer_of(&self.shards, u), move |comm| {
                let n = comm.size();
                let mut out = vec![0.0; n * c];
                comm.all_gather(&mine, &mut out);
                // SAFETY: the compute thread does not touch the parameters until wait_all.
                unsafe { region(p, range.start, range.len()) }.copy_from_slice(&out[..range.len()]);
            });
        }
        self.worker.wait_all();
    }

    /// The full parameters this rank holds (stages 0–2).
    pub fn local_params(&mut self) -> &[f32] {
        assert!(self.zero < 3, "ZeRO-3 holds no full parameters: use full_params");
        assert!(self.base.is_none(), "a quantized base holds no fp32 parameters: use full_params");
        self.worker.wait_all();
        &self.params
    }

    /// The full parameters copied into `out` (its allocation reused); stages 0–2 only.
    pub fn copy_params_into(&mut self, mut out: Vec<f32>) -> Vec<f32> {
        assert!(self.zero < 3, "ZeRO-3 holds no full parameters: use full_params");
        if let Some(b) = &self.base {
            out.clear();
            out.extend_from_slice(&b.dequantize_all());
            return out;
        }
        self.worker.wait_all();
        out.clear();
        out.extend_from_slice(&self.params);
        out
    }

    /// The full parameters (collective at stage 3, where they are gathered).
    pub fn full_params(&mut self) -> Vec<f32> {
        if let Some(b) = &self.base {
            return b.dequantize_all();
        }
        if self.zero < 3 {
            self.worker.wait_all();
            return self.params.clone();
        }
        self.gather_shards(&self.shard_params.clone())
    }

    /// The full buffer whose shards the ranks hold in `shard` (collective).
    pub fn gather_shards(&mut self, shard: &[f32]) -> Vec<f32> {
        self.gather_shards_owned(shard.to_vec())
    }

    /// [`DataParallel::gather_shards`] of a shard the caller hands over (no copy of it).
    pub fn gather_shards_owned(&mut self, mine: Vec<f32>) -> Vec<f32> {
        let shards = self.shards.clone();
        let total = shards.units.last().map_or(0, |u| u.end);
        let all = self.worker.run("all_gather shards", move |c| {
            let mut out = vec![0f32; mine.len() * c.size()];
            c.all_gather(&mine, &mut out);
            out
        });
        let mut full = vec![0.0; total];
        for r in 0..shards.n {
            shards.scatter_rank(r, &all[r * shards.len..(r + 1) * shards.len], &mut full);
        }
        full
    }

    /// A communicator of its own over this store's group, in the same rank order (collective):
    /// for a caller that stages the group's traffic itself (a device model's ZeRO-2/3 units).
    pub fn split_group(&mut self) -> Box<dyn Comm> {
        self.worker.run("split group", |c| c.split(&(0..c.size()).collect::<Vec<_>>()))
    }

    /// Gives `model` back full parameters and gradient buffers (collective), ending the
    /// parallel run.
    pub fn restore(mut self, model: &mut Gpt) {
        // The store's own buffer is handed over, not copied, where it is whole.
        let p = match (&self.base, self.zero < 3) {
            (None, true) => {
                self.worker.wait_all();
                std::mem::take(&mut self.params)
            }
            _ => self.full_params(),
        };
        let n = p.len();
        model.params = p;
        model.grads = vec![0.0; n];
    }

    /// All-reduces (sums) a whole gradient buffer held outside the store, as the store reduces
    /// its own at stage 0: the routed experts' ranges over the ranks holding the same experts,
    /// everything else over the group (a device's gradients, staged through the host).
    /// Collective.
    pub fn all_reduce_flat(&mut self, grads: &mut [f32]) {
        let ex = self.experts.as_ref().map(|e| (e.ranges.clone(), e.comm.clone()));
        self.reduce_outside("all_reduce grads", grads, ex);
    }

    /// Sums `grads` over the group on the communication thread (`experts`' ranges over their
    /// own communicator).
    fn reduce_outside(&mut self, name: &'static str, grads: &mut [f32], experts: Option<(Vec<Range<usize>>, SharedComm)>) {
        if self.shards.n == 1 {
            return;
        }
        let p = SyncPtr(grads.as_mut_ptr());
        let len = grads.len();
        // SAFETY: `grads` is borrowed mutably until the job is waited for, below.
        self.worker.run(name, move |c| {
            for_split(0..len, experts.as_ref(), |r, on| on.unwrap_or(c).all_reduce_sum(unsafe { region(p, r.start, r.len()) }));
        });
    }

    /// Starts summing `grads`, the layout's flat range `range` of a gradient buffer held
    /// outside the store, over the group on the communication thread, as
    /// [`DataParallel::all_reduce_flat`] sums it (the routed experts' parts over their own
    /// ranks), and returns at once: the caller's compute goes on meanwhile (a device's backward
    /// of the next units). The sum lands in `done` with its range; [`DataParallel::wait_reductions`]
    /// waits for every one started. Collective, in the same order on every rank.
    pub fn start_reduce(&mut self, range: Range<usize>, grads: Vec<f32>, done: Reduced) {
        let ex = self.experts.as_ref().map(|e| (e.ranges.clone(), e.comm.clone()));
        let single = self.shards.n == 1;
        self.worker.submit("all_reduce unit", None, move |c| {
            let mut g = grads;
            if !single {
                let at = range.start;
                for_split(range.clone(), ex.as_ref(), |r, on| on.unwrap_or(c).all_reduce_sum(&mut g[r.start - at..r.end - at]));
            }
            done.lock().unwrap_or_else(|e| e.into_inner()).push((range, g));
        });
    }

    /// Waits for every reduction [`DataParallel::start_reduce`] started.
    pub fn wait_reductions(&self) {
        self.worker.wait_all();
    }

    /// An expert-parallel store's routed-expert ranges, and whether this rank is the first of
    /// the ranks holding the same experts (the one that counts them in the norm); `None`
    /// without expert parallelism.
    pub fn experts(&self) -> Option<(&[Range<usize>], bool)> {
        self.experts.as_ref().map(|e| (&e.ranges[..], e.rank == 0))
    }

    /// All-reduces the LoRA adapters' gradients (the base is frozen).
    pub fn reduce_adapters(&mut self, grads: &mut [f32]) {
        self.reduce_outside("all_reduce adapters", grads, None);
    }

    pub fn state_bytes(&self) -> StateBytes {
        let f = std::mem::size_of::<f32>();
        StateBytes {
            params: (self.params.len() + self.shard_params.len()) * f + self.base.as_ref().map_or(0, |b| b.bytes()),
            grads: (self.grads.len() + self.shard_grads.len()) * f,
            peak_transient: self.peak_transient * f,
        }
    }

    /// Runs a collective on the communication thread (for the caller's own scalars).
    pub fn run<T: Send + 'static>(&mut self, name: &'static str, f: impl FnOnce(&dyn Comm) -> T + Send + 'static) -> T {
        self.worker.run(name, f)
    }

    fn track(&mut self, delta: isize) {
        self.transient = (self.transient as isize + delta) as usize;
        self.peak_transient = self.peak_transient.max(self.transient);
    }

    /// Stage 3: starts gathering unit `u` unless it is gathered or on its way.
    fn start_gather(&mut self, u: usize) {
        if self.gathered[u].is_some() {
            return;
        }
        let (n, c) = (self.shards.n, self.shards.chunk[u]);
        let off = self.shards.offset[u];
        let mut buf = vec![0.0f32; n * c];
        self.track((n * c) as isize);
        if self.zpp.any() {
            return self.start_gather_zeropp(u, buf);
        }
        let out = SyncPtr(buf.as_mut_ptr());
        let input = SyncPtr(self.shard_params[off..off + c].as_ptr() as *mut f32);
        // SAFETY: the shard is read-only during passes; `buf` is not read before the ticket is
        // waited for, and its heap storage does not move when the Vec is moved.
        let t = self.worker.submit("all_gather unit", layer_of(&self.shards, u), move |comm| unsafe {
            comm.all_gather(region(input, 0, c), region(out, 0, n * c))
        });
        self.gathered[u] = Some((t, buf));
    }

    /// hpZ: forgets every secondary partition (the parameters changed).
    fn drop_secondary(&mut self) {
        for u in 0..self.secondary.len() {
            if let Some((t, v)) = self.secondary[u].take() {
                self.worker.wait(t);
                self.track(-(v.len() as isize));
            }
        }
    }

    /// [`DataParallel::start_gather`] under ZeRO++: in backward with hpZ, from the node's
    /// secondary partition (kept by the forward gather); else from every rank (qwZ: as int8
    /// packets), keeping this rank's secondary share when hpZ is on.
    fn start_gather_zeropp(&mut self, u: usize, mut buf: Vec<f32>) {
        let (n, c, off) = (self.shards.n, self.shards.chunk[u], self.shards.offset[u]);
        let z = self.zpp;
        let (node, _) = self.zcomms.clone().expect("ZeRO++ groups");
        let (g, me) = (z.node, self.shards.rank);
        let out = SyncPtr(buf.as_mut_ptr());
        let input = SyncPtr(self.shard_params[off..off + c].as_ptr() as *mut f32);
        // The secondary share: this rank's 1/G of the gathered unit (as packets with qwZ).
        let (per, words) = (n / g * c, if z.qwz { n / g * crate::zeropp::packet_words(c, 8) } else { n / g * c });
        if z.hpz && self.backward_started {
            if let Some((t0, sec)) = self.secondary[u].take() {
                self.worker.wait(t0);
                let sec_ptr = SyncPtr(sec.as_ptr() as *mut f32);
                let qwz = z.qwz;
                // SAFETY: `sec` moves into the job (its heap storage stays put); `buf` as in
                // `start_gather`.
                let t = self.worker.submit("all_gather unit (node)", layer_of(&self.shards, u), move |_| unsafe {
                    let node = node.lock().unwrap();
                    if qwz {
                        let mut packets = vec![0.0f32; g * words];
                        node.all_gather(region(sec_ptr, 0, words), &mut packets);
                        crate::zeropp::dequantize_packets(&packets, c, 8, region(out, 0, n * c));
                    } else {
                        node.all_gather(region(sec_ptr, 0, words), region(out, 0, n * c));
                    }
                    drop(sec);
                });
                self.track(-(words as isize));
                self.gathered[u] = Some((t, buf));
                return;
            }
        }
        let mut sec = if z.hpz && !self.backward_started { Some(vec![0.0f32; words]) } else { None };
        if sec.is_some() {
            self.track(words as isize);
        }
        let sec_ptr = sec.as_mut().map(|v| SyncPtr(v.as_mut_ptr()));
        let (qwz, local) = (z.qwz, me % g);
        // SAFETY: as in `start_gather`; `sec` is not read before the ticket is waited for.
        let t = self.worker.submit("all_gather unit", layer_of(&self.shards, u), move |comm| unsafe {
            let full = region(out, 0, n * c);
            if qwz {
                let w = crate::zeropp::packet_words(c, 8);
                let mut packets = vec![0.0f32; n * w];
                crate::zeropp::all_gather_quantized(comm, region(input, 0, c), &mut packets, full);
                if let Some(s) = sec_ptr {
                    region(s, 0, words).copy_from_slice(&packets[local * words..(local + 1) * words]);
                }
            } else {
                comm.all_gather(region(input, 0, c), full);
                if let Some(s) = sec_ptr {
                    region(s, 0, words).copy_from_slice(&full[local * per..(local + 1) * per]);
                }
            }
        });
        if let Some(v) = sec {
            if let Some((t_old, old)) = self.secondary[u].replace((t, v)) {
                // (The gather that filled it was waited for by its pass; waiting again is free.)
                self.worker.wait(t_old);
                self.track(-(old.len() as isize));
            }
        }
        self.gathered[u] = Some((t, buf));
    }

    /// A unit's gradients are final for this micro-batch: reduce them if this micro-batch syncs.
    fn unit_done(&mut self, u: usize) {
        if self.frozen || !self.sync {
            return;
        }
        let n = self.shards.n;
        if self.zero >= 2 {
            let buf = self.unit_grads[u].take().expect("unit gradients acquired");
            let c = self.shards.chunk[u];
            let out = SyncPtr(unsafe { self.shard_grads_ptr.0.add(self.shards.offset[u]) });
            let len = buf.len();
            let qgz = self.zpp.qgz.zip(self.zcomms.clone());
            self.worker.submit("reduce_scatter unit", layer_of(&self.shards, u), move |comm| {
                let mut tmp = vec![0.0; c];
                match &qgz {
                    Some((bits, (node, cross))) => crate::zeropp::reduce_scatter_quantized(&**node.lock().unwrap(), &**cross.lock().unwrap(), &buf, &mut tmp, *bits),
                    None => comm.reduce_scatter_sum(&buf, &mut tmp),
                }
                // SAFETY: only this thread writes the gradient shard during a pass.
                let dst = unsafe { region(out, 0, c) };
                for (d, x) in dst.iter_mut().zip(&tmp) {
                    *d += *x;
                }
                drop(buf);
            });
            self.track(-(len as isize));
            return;
        }
        let b = self.bucket_of[u];
        self.remaining[b] -= 1;
        if self.remaining[b] > 0 || (n == 1 && self.experts.is_none()) {
            return;
        }
        let units: Vec<Range<usize>> = self.buckets[b].iter().map(|&x| self.shards.units[x].clone()).collect();
        let g = self.grads_ptr;
        if self.zero == 0 {
            let lo = units.iter().map(|r| r.start).min().unwrap();
            let hi = units.iter().map(|r| r.end).max().unwrap();
            let ex = self.experts.as_ref().map(|e| (e.ranges.clone(), e.comm.clone()));
            // SAFETY: backward has released every unit of the bucket and never touches them again
            // this micro-batch; the units are disjoint from those backward still writes.
            self.worker.submit("all_reduce bucket", layer_of(&self.shards, self.buckets[b][0]), move |comm| {
                for_split(lo..hi, ex.as_ref(), |r, on| on.unwrap_or(comm).all_reduce_sum(unsafe { region(g, r.start, r.len()) }));
            });
        } else {
            let shards = self.shards.clone();
            let idx = self.buckets[b].clone();
            self.worker.submit("reduce_scatter bucket", layer_of(&self.shards, idx[0]), move |comm| {
                for &x in &idx {
                    let (r, c) = (&shards.units[x], shards.chunk[x]);
                    // SAFETY: as above.
                    let unit = unsafe { region(g, r.start, r.len()) };
                    let input = padded(unit, shards.n, c);
                    let mut tmp = vec![0.0; c];
                    comm.reduce_scatter_sum(&input, &mut tmp);
                    drop(input);
                    let o = shards.own(x, shards.rank);
                    unit[o.clone()].copy_from_slice(&tmp[..o.len()]);
                }
            });
        }
    }
}

impl DataParallel {
    /// [`UnitStore::acquire`] with a quantized base: the unit's fp32 tensors packed (once per
    /// acquisition; the model reads its matrices from the base), and a zeroed gradient scratch
    /// the passes may write and nothing reads (as far as a frozen model writes,
    /// `QuantBase::grad_len`).
    fn acquire_quantized(&mut self, u: usize, access: Access) -> (&[f32], &mut [f32]) {
        let base = self.base.clone().unwrap();
        let len = base.compact_len(u);
        if access.params() && self.packed[u].is_none() {
            let mut buf = vec![0.0; len];
            base.compact_unit(u, &mut buf);
            self.packed[u] = Some(buf);
            self.track(len as isize);
        }
        let grads_len = base.grad_len(u);
        if access.grads() && self.base_grads[u].is_none() {
            self.base_grads[u] = Some(vec![0.0; grads_len]);
            self.track(grads_len as isize);
        }
        let params: &[f32] = if access.params() { self.packed[u].as_ref().unwrap() } else { &[] };
        let grads: &mut [f32] = if access.grads() { self.base_grads[u].as_mut().unwrap() } else { &mut [] };
        (params, grads)
    }

    fn release_quantized(&mut self, u: usize, access: Access) {
        if access.params() {
            if let Some(b) = self.packed[u].take() {
                self.track(-(b.len() as isize));
            }
        }
        if matches!(access, Access::Backward { .. }) {
            if let Some(b) = self.base_grads[u].take() {
                self.track(-(b.len() as isize));
            }
        }
    }
}

impl UnitStore for DataParallel {
    fn acquire(&mut self, u: usize, access: Access, next: Option<(usize, Access)>) -> (&[f32], &mut [f32]) {
        if self.base.is_some() {
            return self.acquire_quantized(u, access);
        }
        if matches!(access, Access::Backward { .. }) && !self.backward_started {
            self.backward_started = true;
        }
        let range = self.shards.units[u].clone();
        if self.zero == 3 {
            if access.params() {
                self.start_gather(u);
            }
            if let Some((nu, na)) = next {
                if na.params() {
                    self.start_gather(nu);
                }
            }
        }
        if access.grads() && self.frozen && self.base_grads[u].is_none() {
            // LoRA: a scratch per unit the passes write (norms, biases) and nothing reads;
            // none for the embeddings, whose gradient a frozen model does not compute.
            let len = if u == 0 { 0 } else { range.len() };
            self.base_grads[u] = Some(vec![0.0; len]);
            self.track(len as isize);
        }
        if access.grads() && self.zero >= 2 && self.unit_grads[u].is_none() {
            let len = self.shards.n * self.shards.chunk[u];
            self.unit_grads[u] = Some(vec![0.0; len]);
            self.track(len as isize);
        }
        let params: &[f32] = match (self.zero, access.params()) {
            (_, false) => &[],
            (3, true) => {
                let (t, buf) = self.gathered[u].as_ref().unwrap();
                self.worker.wait(*t);
                &buf[..range.len()]
            }
            _ => &self.params[range.clone()],
        };
        let grads: &mut [f32] = if !access.grads() {
            &mut []
        } else if self.frozen {
            self.base_grads[u].as_mut().unwrap()
        } else if self.zero >= 2 {
            &mut self.unit_grads[u].as_mut().unwrap()[..range.len()]
        } else {
            // SAFETY: unit `u` is not being reduced (its bucket launches only after backward
            // released it, and it is not acquired again in this micro-batch).
            unsafe { std::slice::from_raw_parts_mut(self.grads_ptr.0.add(range.start), range.len()) }
        };
        (params, grads)
    }

    fn release(&mut self, u: usize, access: Access) {
        if self.base.is_some() {
            return self.release_quantized(u, access);
        }
        if self.zero == 3 && access.params() {
            if let Some((t, buf)) = self.gathered[u].take() {
                self.worker.wait(t);
                self.track(-(buf.len() as isize));
            }
        }
        if matches!(access, Access::Backward { .. }) {
            if let Some(b) = self.base_grads[u].take() {
                self.track(-(b.len() as isize));
            }
            self.unit_done(u);
        }
    }
}
