//! ZeRO stages 2 and 3 on a device (DeepSpeed's partitioned gradients and parameters, FSDP's
//! per-unit gathers): the layout's units ([`crate::ParamLayout::units`]) are cut into one
//! chunk per rank, as the CPU's data-parallel store cuts them, and this rank keeps its chunks
//! (its *shard*) on the device.
//!
//! - Stage 2: the whole weights stay resident; each unit's gradients go into a buffer of their
//!   own while backward runs through the unit, and when it leaves the unit they are summed over
//!   the group and this rank's chunk is added to its gradient shard; the unit's buffer is freed.
//! - Stage 3: the weights too live as the shard (fp32, the optimizer's master weights); a pass
//!   gathers each unit before it runs it (in the passes' type) and frees it after, backward
//!   gathering it again. The embeddings and the final unit (which hold the head) stay
//!   gathered from the forward through the backward.
//!
//! The collectives are the group's ([`ZeroGroup`]), staged through host memory on its own
//! time: gathers run a unit ahead of the passes, reductions behind backward. Every rank
//! runs the same passes over the same units, so every rank calls the same collectives in the
//! same order.

use super::DeviceGpt;
use device::{Buf, DType, Gpu};
use std::ops::Range;
use std::sync::Arc;

/// The host collectives a sharded device model stages its unit traffic through (the
/// data-parallel group's). Each returns at once and runs on the group's own time (a
/// communication thread), so the device goes on with the next unit meanwhile: a unit's gather
/// is started a unit ahead of its passes (FSDP's prefetch), its gradients' reduce-scatter as
/// backward leaves it (DDP's overlap). Every rank starts the same collectives in the same order.
pub trait ZeroGroup: Send {
    /// How many shards the group holds (its members).
    fn members(&self) -> usize;
    /// Starts gathering every rank's `mine` (equal lengths), concatenated in rank order, as
    /// `tag`.
    fn start_all_gather(&mut self, tag: usize, mine: Vec<f32>);
    /// The gather started as `tag`, waited for.
    fn gathered(&mut self, tag: usize) -> Vec<f32>;
    /// Starts summing `full` (`members()` equal chunks) over the group, in rank order, this
    /// rank's chunk of the sum kept as `tag`.
    fn start_reduce_scatter(&mut self, tag: usize, full: Vec<f32>);
    /// Waits for every reduce-scatter started: their tags and this rank's chunks, in the order
    /// they were started.
    fn reduced(&mut self) -> Vec<(usize, Vec<f32>)>;
}

/// How the layout is cut: unit `u` (`units[u]`) in chunks of `chunk[u]` elements (the last
/// rank's padded), this rank's at `offset[u]` of a shard of `len` (the CPU store's `Shards`).
#[derive(Clone, Debug)]
pub struct ShardLayout {
    pub rank: usize,
    pub units: Vec<Range<usize>>,
    pub chunk: Vec<usize>,
    pub offset: Vec<usize>,
    pub len: usize,
}

impl ShardLayout {
    /// This rank's real elements of unit `u`, relative to the unit's start.
    pub fn own(&self, u: usize) -> Range<usize> {
        let (c, l) = (self.chunk[u], self.units[u].len());
        (self.rank * c).min(l)..((self.rank + 1) * c).min(l)
    }

    /// The unit holding flat element `off`.
    pub fn unit_of(&self, off: usize) -> usize {
        self.units.partition_point(|u| u.end <= off).min(self.units.len() - 1)
    }
}

/// A gathered unit: its fp32 weights and, under mixed precision, the copy the passes read.
struct Unit {
    f32: Buf,
    work: Option<Buf>,
}

/// A device model's ZeRO state (see the module docs).
pub struct Zero {
    pub stage: u8,
    pub layout: ShardLayout,
    group: Box<dyn ZeroGroup>,
    /// Stage 3: this rank's fp32 weights, `layout.len` (its pieces at their shard positions).
    pub params: Option<Buf>,
    /// This rank's gradient shard, summed over the group and the step's micro-batches.
    pub grads: Buf,
    /// Stage 3: the units gathered now.
    gathered: Vec<Option<Unit>>,
    /// Stage 3: the units whose gather is on its way.
    fetching: Vec<bool>,
    /// The units' gradients while backward runs through them.
    unit_grads: Vec<Option<Buf>>,
    /// The passes' type under mixed precision.
    work: Option<DType>,
}

impl Zero {
    /// Stage `stage` (2 or 3) over `layout`: the gradient shard zeroed and, at stage 3, the
    /// weight shard `shard` uploaded.
    pub fn new(gpu: &Gpu, stage: u8, layout: ShardLayout, group: Box<dyn ZeroGroup>, shard: Option<&[f32]>, work: Option<DType>) -> Result<Zero, String> {
        assert!(matches!(stage, 2 | 3) && shard.is_some() == (stage == 3), "ZeRO on a device: stage 2, or 3 with its weight shard");
        let alloc = |n| gpu.alloc(n, DType::F32).map_err(|e| e.0);
        let params = match shard {
            Some(s) => {
                let b = alloc(layout.len)?;
                gpu.write(&b, s);
                Some(b)
            }
            None => None,
        };
        let grads = alloc(layout.len)?;
        gpu.clear(&grads);
        let n = layout.units.len();
        Ok(Zero { stage, layout, group, params, grads, gathered: (0..n).map(|_| None).collect(), fetching: vec![false; n], unit_grads: (0..n).map(|_| None).collect(), work })
    }

    /// The weights the passes read at flat element `off`: its gathered unit and the offset in
    /// it (stage 3), else `None` (the model's own buffer).
    pub(super) fn weight(&self, off: usize) -> Option<(&Buf, usize)> {
        self.gathered_at(off).map(|(unit, at)| (unit.work.as_ref().unwrap_or(&unit.f32), at))
    }

    /// Stage 3: the fp32 weights of flat element `off`, in its gathered unit.
    pub(super) fn weight_f32(&self, off: usize) -> Option<(&Buf, usize)> {
        self.gathered_at(off).map(|(unit, at)| (&unit.f32, at))
    }

    /// Stage 3: the gathered unit holding flat element `off`, and the element's offset in it.
    fn gathered_at(&self, off: usize) -> Option<(&Unit, usize)> {
        if self.stage < 3 {
            return None;
        }
        let u = self.layout.unit_of(off);
        let unit = self.gathered[u].as_ref().unwrap_or_else(|| panic!("ZeRO-3: unit {u} used before it was gathered"));
        Some((unit, off - self.layout.units[u].start))
    }

    /// The gradient buffer of flat element `off` while backward runs through its unit.
    pub(super) fn grad(&self, off: usize) -> (&Buf, usize) {
        let u = self.layout.unit_of(off);
        let g = self.unit_grads[u].as_ref().unwrap_or_else(|| panic!("ZeRO: unit {u}'s gradients used before backward reached it"));
        (g, off - self.layout.units[u].start)
    }

    /// Stage 3: starts gathering unit `u` from the group's shards (collective), unless it is
    /// gathered or on its way; [`Zero::gather`] takes it.
    pub(super) fn prefetch(&mut self, gpu: &Gpu, u: usize) {
        if self.stage < 3 || u >= self.gathered.len() || self.gathered[u].is_some() || self.fetching[u] {
            return;
        }
        let (c, at) = (self.layout.chunk[u], self.layout.offset[u]);
        let shard = self.params.as_ref().expect("the stage-3 weight shard");
        self.group.start_all_gather(u, gpu.download_f32(shard, at, c));
        self.fetching[u] = true;
    }

    /// Stage 3: gathers unit `u` (collective), if it is not: its prefetched weights, or
    /// fetched now.
    pub(super) fn gather(&mut self, gpu: &Gpu, u: usize) {
        if self.stage < 3 || self.gathered[u].is_some() {
            return;
        }
        self.prefetch(gpu, u);
        self.fetching[u] = false;
        let all = self.group.gathered(u);
        let len = self.layout.units[u].len();
        let f32 = gpu.alloc(len, DType::F32).expect("a gathered unit (the plan counts it)");
        gpu.write(&f32, &all[..len]);
        let work = self.work.map(|d| {
            let w = gpu.alloc(len, d).expect("a gathered unit's working copy (the plan counts it)");
            gpu.cast(&w, &f32).expect("equal lengths");
            w
        });
        self.gathered[u] = Some(Unit { f32, work });
    }

    /// Stage 3: frees unit `u`'s gathered weights.
    pub(super) fn release(&mut self, u: usize) {
        self.gathered[u] = None;
    }

    /// Frees every gathered unit (and any prefetched one, taken first).
    pub(super) fn release_all(&mut self) {
        for u in 0..self.fetching.len() {
            if std::mem::take(&mut self.fetching[u]) {
                self.group.gathered(u);
            }
        }
        self.gathered.iter_mut().for_each(|g| *g = None);
    }

    /// A zeroed gradient buffer for unit `u`, if it has none (backward reaches the unit).
    pub(super) fn open_grads(&mut self, gpu: &Gpu, u: usize) {
        if self.unit_grads[u].is_none() {
            self.unit_grads[u] = Some(gpu.zeros(self.layout.units[u].len()));
        }
    }

    /// Backward is done with unit `u`: its gradients' sum over the group started (collective),
    /// the unit's buffer freed; [`Zero::reduce_rest`] adds this rank's chunk to the shard.
    pub(super) fn reduce(&mut self, gpu: &Gpu, u: usize) {
        let (c, n) = (self.layout.chunk[u], self.group.members());
        let mut full = gpu.download(&self.unit_grads[u].take().expect("a unit backward reached"));
        full.resize(c * n, 0.0);
        self.group.start_reduce_scatter(u, full);
    }

    /// The units backward has not reduced yet (the embeddings and the final unit, which it
    /// leaves last) reduced in layout order; then every unit's chunk of the sums added to the
    /// gradient shard, in the order they were started.
    pub(super) fn reduce_rest(&mut self, gpu: &Gpu) {
        for u in 0..self.layout.units.len() {
            if self.unit_grads[u].is_some() {
                self.reduce(gpu, u);
            }
        }
        for (u, mine) in self.group.reduced() {
            let (c, at) = (self.layout.chunk[u], self.layout.offset[u]);
            let old = gpu.download_f32(&self.grads, at, c);
            let sum: Vec<f32> = old.iter().zip(&mine).map(|(&o, &m)| o + m).collect();
            gpu.write_f32(&self.grads, at, &sum);
        }
    }

    /// This rank's fp32 weights in the whole layout's positions (zero elsewhere): stage 3's
    /// shard spread out (what the host's copy of this rank's pieces is refreshed from).
    pub fn spread_shard(&self, gpu: &Gpu, total: usize) -> Vec<f32> {
        let shard = gpu.download(self.params.as_ref().expect("the stage-3 weight shard"));
        let mut out = vec![0.0; total];
        for u in 0..self.layout.units.len() {
            let (o, s) = (self.layout.own(u), self.layout.units[u].start);
            let at = self.layout.offset[u];
            out[s + o.start..s + o.end].copy_from_slice(&shard[at..at + o.len()]);
        }
        out
    }
}

impl DeviceGpt {
    /// `m` on `gpu` under ZeRO stage `stage` (2 or 3) over `group`, cut as `layout`: at stage 2
    /// its weights uploaded whole, at stage 3 only this rank's pieces of them (`m.params` holds
    /// at least those); the gradients as the shard. LoRA trains at stage 0 only.
    pub fn with_zero(gpu: Arc<Gpu>, m: &crate::Gpt, stage: u8, layout: ShardLayout, group: Box<dyn ZeroGroup>) -> Result<DeviceGpt, String> {
        if let Some(why) = super::unsupported(m) {
            return Err(why);
        }
        if m.lora.is_some() {
            return Err("LoRA adapters train at ZeRO stage 0 (parallel.zero = 0)".into());
        }
        let work = super::working_type(m.precision);
        let (params, zero) = if stage == 3 {
            let mut shard = vec![0.0; layout.len];
            for u in 0..layout.units.len() {
                let (o, s, at) = (layout.own(u), layout.units[u].start, layout.offset[u]);
                shard[at..at + o.len()].copy_from_slice(&m.params[s + o.start..s + o.end]);
            }
            (gpu.zeros(1), Zero::new(&gpu, 3, layout, group, Some(&shard), work)?)
        } else {
            let p = gpu.alloc(m.params.len(), DType::F32).map_err(|e| e.0)?;
            gpu.write(&p, &m.params);
            (p, Zero::new(&gpu, 2, layout, group, None, None)?)
        };
        let work = (stage == 2).then_some(work).flatten().map(|d| gpu.alloc(m.params.len(), d)).transpose().map_err(|e| e.0)?;
        let mut dev = DeviceGpt::assemble(gpu.clone(), m, (m.views.clone(), params, work, gpu.zeros(1)), None);
        dev.zero = Some(zero);
        dev.refresh_working();
        Ok(dev)
    }

    /// The model's ZeRO state, if it is sharded.
    pub fn zero(&self) -> Option<&Zero> {
        self.zero.as_ref()
    }

    /// Gathers unit `u` (ZeRO-3).
    pub(super) fn gather_unit(&mut self, u: usize) {
        if let Some(z) = self.zero.as_mut() {
            z.gather(&self.gpu, u);
        }
    }

    /// Starts gathering unit `u`, the one after the unit the passes run next (ZeRO-3).
    pub(super) fn prefetch_unit(&mut self, u: usize) {
        if let Some(z) = self.zero.as_mut() {
            z.prefetch(&self.gpu, u);
        }
    }

    /// Frees unit `u`'s gathered weights (ZeRO-3).
    pub(super) fn release_unit(&mut self, u: usize) {
        if let Some(z) = self.zero.as_mut() {
            z.release(u);
        }
    }

    /// Gives unit `u` a gradient buffer (ZeRO-2/3, as backward reaches it).
    pub(super) fn open_grads(&mut self, u: usize) {
        if let Some(z) = self.zero.as_mut() {
            z.open_grads(&self.gpu, u);
        }
    }

    /// Reduces unit `u`'s gradients into the shard (ZeRO-2/3, as backward leaves it).
    pub(super) fn reduce_unit(&mut self, u: usize) {
        if let Some(z) = self.zero.as_mut() {
            z.reduce(&self.gpu, u);
        }
    }
}
