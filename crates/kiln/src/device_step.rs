//! Training on a GPU (`train.device = vulkan[:N]`): one rank whose model, gradients and AdamW
//! moments stay on the device ([`model::device::DeviceGpt`]). Per step the batch's ids and
//! targets go up and the loss sums and the gradient norm come back; everything else stays. The
//! step is [`crate::step::train_step`]'s for one rank: the micro-batches' forward and backward
//! with the same dropout seeds and loss weights, the global norm, the same vetoes, clipping,
//! and AdamW over the same decay groups. Evaluation runs on the device too. The host's copy of
//! the state (the chunks' parameters and moments) is brought up to date only when something
//! reads it: a checkpoint, the sample at the end ([`DeviceRun::pull`]). A rank of an
//! interleaved pipeline holds several model chunks (virtual stages), each a [`DevicePart`] on
//! the rank's one device.

use crate::config::RunConfig;
use crate::device::DeviceArg;
use crate::error::{user, KilnError, Result};
use crate::step::{dropout_seed, Chunk, Master, Pipeline, RowBuf, StepOut};
use device::{slot, Buf, Gpu};
use model::device::DeviceGpt;
use model::Pass;
use std::ops::Range;
use std::sync::Arc;

/// The device side of a run: this rank's model chunks on its device.
pub struct DeviceRun {
    gpu: Arc<Gpu>,
    /// One per model chunk the rank holds (the host's `Chunk`s, in order).
    parts: Vec<DevicePart>,
    /// The last step's MoE routing statistics (its last micro-batch's, as the CPU's).
    moe_stats: Vec<tensor::moe::MoeStats>,
    /// `sum_squares`' partial sums, and each micro-batch's loss sum (then the norm's parts).
    partials: Buf,
    sums: Buf,
}

/// One model chunk on the device: its model, AdamW's moments and how it updates them.
struct DevicePart {
    model: DeviceGpt,
    m: Buf,
    v: Buf,
    /// The layout's ranges with whether weight decay applies (the host optimizer's).
    segments: Vec<(Range<usize>, bool)>,
    /// The host's copy is older than the device's.
    stale: bool,
    /// ZeRO: the layout's pieces this rank updates (its moments are their shard); `None`:
    /// every parameter.
    pieces: Option<Vec<parallel::Piece>>,
    /// The ZeRO stage the device runs (0 on one rank and under LoRA).
    zero: u8,
    /// `parallel.nccl` on a CUDA device: the data-parallel group's communicator on the device.
    #[cfg(feature = "cuda")]
    nccl: Option<device::nccl::Nccl>,
}

/// The data-parallel group, on a communicator of its own with a thread of its own, as a device
/// model's ZeRO-2/3 group: its collectives run there while the rank's device computes.
struct HostGroup {
    worker: parallel::CommWorker,
    /// Gathers on their way: their tickets and where they land.
    gathers: std::collections::HashMap<usize, (u64, Landed)>,
    /// Reduce-scatters' results, in the order they were started.
    sums: Arc<std::sync::Mutex<Vec<Tagged>>>,
}

type Landed = Arc<std::sync::Mutex<Vec<f32>>>;
/// A unit's chunk of a sum.
type Tagged = (usize, Vec<f32>);

impl HostGroup {
    fn new(comm: Box<dyn parallel::Comm>) -> HostGroup {
        HostGroup { worker: parallel::CommWorker::spawn(comm), gathers: Default::default(), sums: Default::default() }
    }
}

impl model::device::ZeroGroup for HostGroup {
    fn members(&self) -> usize {
        self.worker.size()
    }

    fn start_all_gather(&mut self, tag: usize, mine: Vec<f32>) {
        let out: Landed = Default::default();
        let land = out.clone();
        let ticket = self.worker.submit("all_gather unit", Some(tag), move |c| {
            let mut all = vec![0.0; mine.len() * c.size()];
            c.all_gather(&mine, &mut all);
            *land.lock().unwrap_or_else(|e| e.into_inner()) = all;
        });
        assert!(self.gathers.insert(tag, (ticket, out)).is_none(), "unit {tag} gathered twice at once");
    }

    fn gathered(&mut self, tag: usize) -> Vec<f32> {
        let (ticket, out) = self.gathers.remove(&tag).unwrap_or_else(|| panic!("unit {tag} taken before its gather started"));
        self.worker.wait(ticket);
        let all = std::mem::take(&mut *out.lock().unwrap_or_else(|e| e.into_inner()));
        all
    }

    fn start_reduce_scatter(&mut self, tag: usize, full: Vec<f32>) {
        let sums = self.sums.clone();
        self.worker.submit("reduce_scatter unit", Some(tag), move |c| {
            let mut mine = vec![0.0; full.len() / c.size()];
            c.reduce_scatter_sum(&full, &mut mine);
            sums.lock().unwrap_or_else(|e| e.into_inner()).push((tag, mine));
        });
    }

    fn reduced(&mut self) -> Vec<(usize, Vec<f32>)> {
        self.worker.wait_all();
        std::mem::take(&mut *self.sums.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// What the config asks that the device cannot do yet, by key; checked before anything runs.
pub fn refusal(cfg: &RunConfig) -> Option<String> {
    let p = &cfg.parallel;
    let d = &cfg.train.device;
    if p.ep > 1 && p.nccl {
        return Some(format!("train.device = {d}: parallel.nccl reduces every gradient over the whole group, not the routed experts over their own (parallel.ep = {}); set parallel.nccl = false", p.ep));
    }
    if p.ep > 1 && cfg.lora.rank > 0 {
        return Some(format!("train.device = {d}: LoRA adapters on an expert-parallel part do not run on devices yet (parallel.ep = {})", p.ep));
    }
    if p.pp > 1 && cfg.lora.rank > 0 {
        return Some(format!("train.device = {d}: LoRA adapters on a pipeline stage do not run on devices yet (parallel.pp = {})", p.pp));
    }
    if p.tp > 1 && cfg.lora.rank > 0 {
        return Some(format!("train.device = {d}: LoRA adapters on a tensor-parallel part do not run on devices yet (parallel.tp = {})", p.tp));
    }
    if !matches!(cfg.optim.name, crate::config::OptimName::AdamW | crate::config::OptimName::Lion) {
        return Some(format!("train.device = {d}: the device runs AdamW and Lion, not optim.name = {}, yet; use train.device = cpu", plan::policy::Names::name(cfg.optim.name)));
    }
    let why = if cfg.train.precision == model::Precision::Fp8 {
        "FP8 storage (train.precision = fp8)"
    } else if cfg.memory.offload != crate::config::Offload::None {
        "optimizer offload (memory.offload)"
    } else if cfg.parallel.compression != crate::config::Compression::None {
        "communication compression (parallel.compression)"
    } else {
        return None;
    };
    Some(format!("train.device = {d}: the device does not run {why} yet; use train.device = cpu"))
}


impl DeviceRun {
    /// Opens the device, checks the run's device plan against what it may allocate
    /// ([`check_plan`]), and uploads each chunk's parameters and moments.
    pub fn new(d: DeviceArg, cfg: &RunConfig, chunks: &mut [Chunk]) -> Result<DeviceRun> {
        let gpu = match crate::device::open(d)? {
            Some(g) => Arc::new(g),
            None => return Err(KilnError::Internal("a device run on the CPU".into())),
        };
        let configs: Vec<(&model::GptConfig, usize)> = chunks.iter().map(|ch| (&ch.model.cfg, ch.model.layout.total)).collect();
        check_plan(&gpu, d, cfg, &configs)?;
        let parts = chunks.iter_mut().map(|ch| DevicePart::new(&gpu, d, cfg, ch)).collect::<Result<Vec<_>>>()?;
        let (partials, sums) = (gpu.zeros(Gpu::parts_len()), gpu.zeros(slot::OPTIM + 2 * 64));
        Ok(DeviceRun { gpu, parts, moe_stats: Vec::new(), partials, sums })
    }

    /// The adapter's one-line description.
    pub fn describe(&self) -> String {
        self.gpu.info.describe()
    }

    /// The last step's MoE routing statistics.
    pub fn moe_stats(&self) -> &[tensor::moe::MoeStats] {
        &self.moe_stats
    }

    /// Host↔device bytes so far.
    pub fn traffic(&self) -> device::Traffic {
        self.gpu.traffic()
    }

    /// The device's fp32 matmul rate (GFLOP/s ·1e9), measured now: the MFU denominator.
    pub fn peak_flops(&self) -> f64 {
        self.gpu.measure_peak_flops(1024, 3)
    }

    /// One optimizer step (see the module docs); `fill` draws micro-batch `k`'s rows (this
    /// rank's share under data parallelism, whose groups `chunks[c].dp` reduce the gradients
    /// through the host). A part's passes call the host model's hooks (lent for the step); a
    /// pipeline stage runs its tasks of `pipe`'s schedule, the activations and their gradients
    /// sent between the stages through the host; `pipe`'s groups sum the gradient norm's parts.
    pub fn step(&mut self, chunks: &mut [Chunk], cfg: &RunConfig, (step, rows): (u64, usize), fill: impl FnMut(usize, &mut RowBuf), veto: impl FnMut(f32, f64) -> Option<&'static str>, pipe: &Pipeline) -> Result<StepOut> {
        self.swap_hooks(chunks);
        let out = self.step_lent(chunks, cfg, (step, rows), fill, veto, pipe);
        self.swap_hooks(chunks);
        out
    }

    /// Runs `f` on the resident models (one per chunk) with the host models' hooks lent (a
    /// device run's evaluation).
    pub fn with_hooks<R>(&mut self, chunks: &mut [Chunk], f: impl FnOnce(&mut [&mut DeviceGpt]) -> R) -> R {
        self.swap_hooks(chunks);
        let mut models: Vec<&mut DeviceGpt> = self.parts.iter_mut().map(|p| &mut p.model).collect();
        let out = f(&mut models);
        self.swap_hooks(chunks);
        out
    }

    /// Lends the host models' tensor-parallel, expert and context-parallel hooks to the device
    /// models, or takes them back.
    fn swap_hooks(&mut self, chunks: &mut [Chunk]) {
        for (p, ch) in self.parts.iter_mut().zip(chunks) {
            p.model.swap_tensor_hooks(&mut ch.model.hooks.tensor);
            p.model.swap_expert_hooks(&mut ch.model.hooks.experts);
            p.model.swap_context_hooks(&mut ch.model.hooks.context);
        }
    }

    fn step_lent(&mut self, chunks: &mut [Chunk], cfg: &RunConfig, (step, rows): (u64, usize), mut fill: impl FnMut(usize, &mut RowBuf), mut veto: impl FnMut(f32, f64) -> Option<&'static str>, pipe: &Pipeline) -> Result<StepOut> {
        let (g, t, m) = (self.gpu.clone(), cfg.seq_len(), cfg.train.grad_accum);
        if m > 64 {
            return user(format!("train.device: at most 64 micro-batches a step (train.grad_accum = {m})"));
        }
        self.parts.iter_mut().for_each(|p| p.model.zero_grad());
        let packed = cfg.data.packing == crate::config::Packing::Documents;
        let batches: Vec<RowBuf> = (0..m).map(|micro| {
            let mut b = RowBuf::new(rows, t, packed);
            fill(micro, &mut b);
            b
        }).collect();
        // (A context-parallel part counts the targets at its positions.)
        let counted = |y: &[i32]| y.iter().filter(|&&y| y != model::gpt::IGNORE_INDEX).count() as f64;
        let context = chunks[0].model.cfg.place.context;
        let counts: Vec<f64> = batches.iter().map(|b| context.map_or_else(|| counted(&b.y), |cx| counted(&cx.rows(&b.y, rows, t)))).collect();
        // Each micro-batch's loss is its mean over the whole group's targets, as on the CPU.
        let dpn = chunks[0].dp.n();
        let global = if dpn > 1 { chunks[0].dp.all_reduce_f64(&counts) } else { counts.clone() };
        let pass = |micro: usize| {
            let loss_scale = if global[micro] > 0.0 { (counts[micro] / global[micro] / m as f64) as f32 } else { 0.0 };
            Pass::Train { dropout_seed: dropout_seed(cfg.train.seed, step, micro), loss_scale }
        };
        // Whether the first chunk's gradient sum overlapped its last backward.
        let mut reduced = false;
        match pipe.comm {
            Some(pp) => self.pipeline_tasks((pipe, pp), &batches, (rows, t), &pass),
            None => {
                let overlap = self.parts[0].overlaps(&chunks[0]);
                let (part, ch) = (&mut self.parts[0], &mut chunks[0]);
                for (micro, b) in batches.iter().enumerate() {
                    part.model.forward_docs(&b.x, &b.y, b.docs(), rows, t, pass(micro));
                    part.model.loss_sum_into((&self.sums, slot::OPTIM + micro), &self.partials, false);
                    // An MoE model's load-balancing statistics are the group's (the CPU's exchange).
                    match overlap && micro + 1 == m {
                        true => part.backward_reducing(&g, ch),
                        false => part.model.backward(),
                    }
                }
                reduced = overlap;
            }
        }
        for (p, ch) in self.parts.iter().zip(chunks.iter_mut()).skip(reduced as usize) {
            p.reduce_grads(&g, ch);
        }
        self.grad_norm(chunks, pipe);
        for p in &self.parts {
            g.clip_scale(&p.model.scalars, cfg.train.grad_clip as f32);
        }
        g.copy_words(&self.sums, slot::NORM, &self.parts[0].model.scalars, slot::NORM, 1);
        // The loss sums and the norm: the step's only download on one device.
        let back = g.download_words(&self.sums, 0, slot::OPTIM + m);
        let f = |i: usize| f32::from_bits(back[i]) as f64;
        let mut sums: Vec<f64> = (0..m).flat_map(|k| [f(slot::OPTIM + k), counts[k]]).collect();
        if dpn > 1 {
            sums = chunks[0].dp.all_reduce_f64(&sums);
        }
        if let Some(pp) = pipe.comm {
            // The losses are the last stage's.
            let p = pipe.sched.p;
            sums = parallel::comm::all_gather_f64(pp, &sums)[(p - 1) * 2 * m..].to_vec();
        }
        let loss = ((0..m).map(|k| if sums[2 * k + 1] > 0.0 { sums[2 * k] / sums[2 * k + 1] } else { 0.0 }).sum::<f64>() / m as f64) as f32;
        let norm = f(slot::NORM);
        if self.parts[0].model.cfg.is_moe() {
            self.moe_stats = self.parts[0].model.moe_stats();
        }
        let out = |skipped| StepOut { loss, grad_norm: norm, overlap: Default::default(), skipped, peak_activation_bytes: 0, peak_in_flight: 0, loss_tokens: global.iter().sum(), pairs: None, policy: None };
        if !(loss.is_finite() && norm.is_finite()) {
            return Ok(out(Some("non-finite loss or gradient norm")));
        }
        if let Some(why) = veto(loss, norm) {
            return Ok(out(Some(why)));
        }
        for (p, ch) in self.parts.iter_mut().zip(chunks.iter_mut()) {
            p.update(ch, cfg, step, &g);
            p.stale = true;
        }
        Ok(out(None))
    }

    /// The squared global gradient norm into every part's `SUMSQ` slot: on one device of one
    /// chunk the sum of squares stays there; a part of a model ([`DevicePart::norm_parts`])
    /// sums its parts over the tensor-parallel group, then the chunks, then the pipeline's
    /// stages; under ZeRO-2/3 each rank's shards' squares are summed over the data-parallel
    /// group last.
    fn grad_norm(&self, chunks: &mut [Chunk], pipe: &Pipeline) {
        let g = &self.gpu;
        let whole = pipe.tp.is_none() && pipe.comm.is_none() && chunks[0].dp.experts().is_none();
        if whole {
            let p = &self.parts[0];
            let grads = p.model.trainable().1;
            g.sum_squares((&p.model.scalars, slot::SUMSQ), grads.at(0), grads.len(), &self.partials, false);
            if p.zero >= 2 {
                // Each rank holds its shard's squares: the group's sum.
                let mine = f32::from_bits(g.download_words(&p.model.scalars, slot::SUMSQ, 1)[0]) as f64;
                let all = chunks[0].dp.all_reduce_f64(&[mine])[0] as f32;
                g.write_words(&p.model.scalars, slot::SUMSQ, &[all.to_bits()]);
            }
            return;
        }
        let (mut own, mut repl) = (0.0, 0.0);
        for (c, (p, ch)) in self.parts.iter().zip(chunks.iter_mut()).enumerate() {
            let (o, r) = p.norm_parts(g, ch, pipe, (c, (&self.sums, &self.partials)));
            (own, repl) = (own + o, repl + r);
        }
        let mut sq = pipe.tp.map_or(own, |tp| parallel::comm::sum_f64(tp, own)) + repl;
        if let Some(pp) = pipe.comm {
            sq = parallel::comm::sum_f64(pp, sq);
        }
        if self.parts[0].zero >= 2 {
            // Each rank holds its shards' squares: the group's sum.
            sq = chunks[0].dp.all_reduce_f64(&[sq as f32 as f64])[0];
        }
        for p in &self.parts {
            g.write_words(&p.model.scalars, slot::SUMSQ, &[(sq as f32).to_bits()]);
        }
    }

    /// A pipeline stage's tasks of the schedule (an interleaved schedule's across the rank's
    /// chunks, chunk `c` being virtual stage `c·P + rank`): each forward's input received from
    /// the previous virtual stage and its output sent on, each backward's output gradient
    /// received from the next and its input gradient sent back, through the host; each
    /// micro-batch's activations kept from its forward to its backward. The last virtual stage
    /// sums each micro-batch's losses on the device.
    fn pipeline_tasks(&mut self, (pipe, pp): (&Pipeline, &dyn parallel::Comm), batches: &[RowBuf], (rows, t): (usize, usize), pass: &dyn Fn(usize) -> Pass) {
        let (p, me, m, v) = (pipe.sched.p, pipe.rank, pipe.sched.m, self.parts.len());
        let last_vs = p * v - 1;
        type Held = Vec<Option<model::device::DeviceActs>>;
        let (mut live, mut free): (Vec<Held>, Vec<Vec<model::device::DeviceActs>>) = ((0..v).map(|_| (0..m).map(|_| None).collect()).collect(), (0..v).map(|_| Vec::new()).collect());
        // Messages between virtual stages: activations across boundary `b` (after virtual stage
        // `b`) and, in backward, their gradient.
        let tag = |boundary: usize, backward: bool| (2 << 20) + 2 * boundary as u32 + backward as u32;
        for task in pipe.sched.tasks(me) {
            let (c, b) = (task.chunk, &batches[task.mb]);
            let vs = c * p + me;
            let model = &mut self.parts[c].model;
            let width = model.stage_width(rows, t);
            if task.forward {
                if let Some(a) = free[c].pop() {
                    model.put_activations(a);
                }
                if vs > 0 {
                    let mut x = vec![0.0; width];
                    pp.recv(&mut x, (vs - 1) % p, tag(vs - 1, false));
                    model.set_stage_input(&x, rows, t);
                }
                model.forward_docs(&b.x, &b.y, b.docs(), rows, t, pass(task.mb));
                if vs == last_vs {
                    model.loss_sum_into((&self.sums, slot::OPTIM + task.mb), &self.partials, false);
                } else {
                    pp.send(&model.stage_output(), (vs + 1) % p, tag(vs, false));
                }
                live[c][task.mb] = model.take_activations();
            } else {
                model.put_activations(live[c][task.mb].take().expect("forward before backward"));
                if vs < last_vs {
                    let mut d = vec![0.0; width];
                    pp.recv(&mut d, (vs + 1) % p, tag(vs, true));
                    model.set_stage_output_grad(&d);
                }
                model.backward();
                if vs > 0 {
                    pp.send(&model.stage_input_grad(), (vs - 1) % p, tag(vs - 1, true));
                }
                free[c].extend(model.take_activations());
            }
        }
        // Each model keeps its last micro-batch's activations (its routing statistics).
        for (part, f) in self.parts.iter_mut().zip(&mut free) {
            if let Some(a) = f.pop() {
                part.model.put_activations(a);
            }
        }
        if me + 1 < p {
            for k in 0..m {
                self.gpu.write_words(&self.sums, slot::OPTIM + k, &[0]);
            }
        }
    }

    /// Brings the host's copy of the state (each chunk's parameters, or LoRA's adapters, and
    /// the AdamW moments) up to the device's, when it is older: before a checkpoint or the
    /// sample.
    pub fn pull(&mut self, chunks: &mut [Chunk]) {
        for (p, ch) in self.parts.iter_mut().zip(chunks) {
            p.pull(&self.gpu, ch);
        }
    }
}

impl DevicePart {
    /// Uploads the chunk's parameters (as the passes read them) and moments.
    fn new(gpu: &Arc<Gpu>, d: DeviceArg, cfg: &RunConfig, ch: &mut Chunk) -> Result<DevicePart> {
        let mut host = model::Gpt::zeroed(ch.model.cfg.clone(), ch.model.real_vocab);
        host.precision = ch.model.precision;
        host.recompute = ch.model.recompute;
        host.recompute_every = ch.model.recompute_every;
        host.lora = ch.model.lora.clone();
        // QLoRA's base goes up as it is held, quantized; any other base or model in fp32.
        match ch.model.quantized_base() {
            Some(q) => host.set_quantized_base(q.clone()),
            None => host.params = host_master(ch),
        }
        let zero = if ch.dp.n() > 1 && ch.model.lora.is_none() { cfg.parallel.zero as u8 } else { 0 };
        if matches!(zero, 1 | 2) {
            // ZeRO-1/2: each rank holds its shard's master weights; the group's make the whole.
            let mine = ch.dp.shards.take(&host.params);
            host.params = ch.dp.gather_shards_owned(mine);
        }
        let model = match zero {
            2 | 3 => {
                let sh = &ch.dp.shards;
                let layout = model::device::ShardLayout { rank: sh.rank, units: sh.units.clone(), chunk: sh.chunk.clone(), offset: sh.offset.clone(), len: sh.len };
                let group = Box::new(HostGroup::new(ch.dp.split_group()));
                DeviceGpt::with_zero(gpu.clone(), &host, zero, layout, group)
            }
            _ => DeviceGpt::new(gpu.clone(), &host),
        };
        let model = model.map_err(|e| KilnError::User(format!("train.device = {d}: {e}; use train.device = cpu")))?;
        let alloc = |len| gpu.alloc(len, device::DType::F32).map_err(|e| KilnError::User(format!("train.device = {d}: {e}")));
        // (Lion keeps no second moment: one element stands in for it.)
        let (m, v) = (alloc(ch.opt.m.len())?, alloc(ch.opt.v.len().max(1))?);
        gpu.write(&m, &ch.opt.m);
        if !ch.opt.v.is_empty() {
            gpu.write(&v, &ch.opt.v);
        }
        let pieces = (zero > 0).then(|| ch.dp.pieces());
        #[cfg(feature = "cuda")]
        let nccl = match cfg.parallel.nccl && ch.dp.n() > 1 {
            true => Some(nccl_group(gpu, ch).map_err(|e| KilnError::User(format!("parallel.nccl = true: {}", e.0)))?),
            false => None,
        };
        Ok(DevicePart {
            model, m, v, segments: ch.opt.decay_groups().to_vec(), stale: false, pieces, zero,
            #[cfg(feature = "cuda")]
            nccl,
        })
    }

    /// Whether the step's gradient sum overlaps its last backward
    /// ([`DevicePart::backward_reducing`]): a data-parallel rank of a whole model whose
    /// gradients are whole (ZeRO 0 or 1), summed through the host.
    fn overlaps(&self, ch: &Chunk) -> bool {
        #[cfg(feature = "cuda")]
        if self.nccl.is_some() {
            return false;
        }
        ch.dp.n() > 1 && self.zero < 2 && self.model.zero().is_none() && ch.model.lora.is_none() && ch.model.cfg.place.stage.is_none()
    }

    /// The last micro-batch's backward with the group's gradient sum overlapping it: each unit's
    /// gradients, as backward finishes them, start their all-reduce on the data-parallel group's
    /// communication thread while the device goes on (the CPU store's bucketed overlap); the
    /// sums are written back when backward is done. The same sums as [`DevicePart::reduce_grads`].
    fn backward_reducing(&mut self, g: &Gpu, ch: &mut Chunk) {
        let done = Arc::new(std::sync::Mutex::new(Vec::new()));
        let dp = &mut ch.dp;
        self.model.backward_handing(&mut |r, grads| dp.start_reduce(r, grads, done.clone()));
        dp.wait_reductions();
        let grads = self.model.trainable().1;
        for (r, sum) in done.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            g.write_f32(grads, r.start, &sum);
        }
    }

    /// The data-parallel group's gradient sum, staged through the host (summed in rank order;
    /// the routed experts' over the ranks holding the same experts), or through NCCL on the
    /// device; ZeRO-2/3 reduced each unit's into the shard as backward left it.
    fn reduce_grads(&self, g: &Gpu, ch: &mut Chunk) {
        if ch.dp.n() == 1 || self.zero >= 2 {
            return;
        }
        let grads = self.model.trainable().1;
        #[cfg(feature = "cuda")]
        if let Some(n) = &self.nccl {
            return n.all_reduce_sum(grads.at(0), grads.len());
        }
        let mut host = g.download(grads);
        ch.dp.all_reduce_flat(&mut host);
        g.write(grads, &host);
    }

    /// AdamW over the decay groups, the gradients scaled by the clipping factor on the device.
    /// Under ZeRO each rank updates the pieces whose moments it holds (a shard of the layout);
    /// at stages 1 and 2 the group's updated parameters are gathered through the host, as
    /// `DataParallel`'s `after_update` gathers them on the CPU, and at stage 3 the next pass
    /// gathers them unit by unit.
    fn update(&self, ch: &mut Chunk, cfg: &RunConfig, step: u64, g: &Gpu) {
        let tc = &cfg.train;
        let lr = cfg.lr_at(step) as f32;
        let h = tensor::AdamW { lr, beta1: tc.beta1 as f32, beta2: tc.beta2 as f32, eps: tc.eps as f32, weight_decay: tc.weight_decay as f32, t: step + 1 };
        let lion = (cfg.optim.name == crate::config::OptimName::Lion).then_some(tensor::optim::Lion { lr, beta1: h.beta1, beta2: h.beta2, weight_decay: h.weight_decay });
        match &lion {
            Some(l) => g.set_lion_scalars(&self.model.scalars, l),
            None => g.set_adamw_scalars(&self.model.scalars, &h),
        }
        let (params, grads) = self.model.trainable();
        let state = (params, grads, &self.m, &self.v);
        let run = |o: device::Offsets, n: usize, decay: bool| match &lion {
            Some(l) => g.lion_update_at((params, grads, &self.m), o, n, l, decay, &self.model.scalars),
            None => g.adamw_update_at(state, o, n, &h, decay, &self.model.scalars),
        };
        let Some(pieces) = &self.pieces else {
            for (r, decay) in &self.segments {
                run(device::Offsets { params: r.start, grads: r.start, moments: r.start }, r.len(), *decay);
            }
            return self.model.refresh_working();
        };
        for p in pieces {
            for (r, decay) in &self.segments {
                let (a, b) = (r.start.max(p.flat.start), r.end.min(p.flat.end));
                if a < b {
                    let s = p.shard.start + a - p.flat.start;
                    // ZeRO-1: the whole layout's gradients; 2: the shard's; 3: the weights' too.
                    run(device::Offsets { params: if self.zero == 3 { s } else { a }, grads: if self.zero >= 2 { s } else { a }, moments: s }, b - a, *decay);
                }
            }
        }
        if self.zero == 3 {
            // The next pass gathers the updated shards unit by unit.
            return;
        }
        let mine = ch.dp.shards.take(&g.download(params));
        g.write(params, &ch.dp.gather_shards_owned(mine));
        self.model.refresh_working();
    }

    /// Chunk `c`'s squared gradient norm as `(own, replicated)`: a tensor-parallel part's own
    /// parameters' squares (for the caller to sum over its group) and those every part holds
    /// whole (`ch.replicated`, identical on every part: counted once), the partial gradients
    /// (`ch.seq_partial`) summed over the group first; a tied embedding's two copies (on the
    /// first and last virtual stages, summed first) counted once; an expert-parallel part's
    /// routed experts summed over the data-parallel group from the first rank of each set
    /// holding the same experts, as the CPU's store counts them. `scratch`: the step's sums
    /// buffer and `sum_squares`' partials.
    fn norm_parts(&self, g: &Gpu, ch: &mut Chunk, pipe: &Pipeline, (c, (sums, partials)): (usize, (&Buf, &Buf))) -> (f64, f64) {
        let grads = self.model.trainable().1;
        if let Some(tp) = pipe.tp {
            // Sequence parallelism: each part's norms saw its positions.
            self.sum_over(g, &self.positions(&ch.seq_partial), tp);
        }
        let (p, v) = (pipe.sched.p, pipe.sched.v);
        let vs = c * p + pipe.rank;
        let last = vs + 1 == p * v;
        let tied = (p * v > 1 && self.model.cfg.tied_embeddings && (vs == 0 || last)).then(|| ch.model.units[0].clone());
        if let (Some(tie), Some(unit)) = (pipe.tie, &tied) {
            self.sum_over(g, &self.positions(std::slice::from_ref(unit)), tie);
        }
        // The last stage's copy of a tied embedding is the first stage's.
        let skip: Vec<_> = tied.filter(|_| last && vs != 0).into_iter().collect();
        let repl = match pipe.tp {
            Some(_) => ch.replicated.clone(),
            None => Vec::new(),
        };
        let (experts, first) = ch.dp.experts().map_or((Vec::new(), false), |(r, first)| (r.to_vec(), first));
        let own = self.positions(&complement(&[&repl[..], &skip, &experts].concat(), ch.model.layout.total));
        let repl = self.positions(&repl.iter().flat_map(|r| complement_within(r, &skip)).collect::<Vec<_>>());
        let mine = if first { self.positions(&experts) } else { Vec::new() };
        let at = slot::OPTIM + 64;
        for (k, ranges) in [own, repl, mine].iter().enumerate() {
            g.write_words(sums, at + k, &[0]);
            for r in ranges.iter().filter(|r| !r.is_empty()) {
                g.sum_squares((sums, at + k), grads.at(r.start), r.len(), partials, true);
            }
        }
        let w = g.download_words(sums, at, 3);
        let (own, repl, mine) = (f32::from_bits(w[0]) as f64, f32::from_bits(w[1]) as f64, f32::from_bits(w[2]) as f64);
        let experts = if experts.is_empty() { 0.0 } else { ch.dp.all_reduce_f64(&[mine])[0] };
        (own, repl + experts)
    }

    /// Where the gradients of the layout's `flat` ranges sit on the device: the ranges
    /// themselves, or under ZeRO-2/3 the parts of them in this rank's pieces, at their shard
    /// positions.
    fn positions(&self, flat: &[Range<usize>]) -> Vec<Range<usize>> {
        let pieces = match &self.pieces {
            Some(p) if self.zero >= 2 => p,
            _ => return flat.iter().filter(|r| !r.is_empty()).cloned().collect(),
        };
        let mut out = Vec::new();
        for r in flat {
            for p in pieces {
                let (a, b) = (r.start.max(p.flat.start), r.end.min(p.flat.end));
                if a < b {
                    out.push(p.shard.start + a - p.flat.start..p.shard.start + b - p.flat.start);
                }
            }
        }
        out
    }

    /// The gradients at `ranges` summed over `comm` (through the host), every member's the sum.
    fn sum_over(&self, g: &Gpu, ranges: &[Range<usize>], comm: &dyn parallel::Comm) {
        if ranges.is_empty() {
            return;
        }
        let grads = self.model.trainable().1;
        let mut buf: Vec<f32> = ranges.iter().flat_map(|r| g.download_f32(grads, r.start, r.len())).collect();
        comm.all_reduce_sum(&mut buf);
        let mut at = 0;
        for r in ranges {
            g.write_f32(grads, r.start, &buf[at..at + r.len()]);
            at += r.len();
        }
    }

    /// Brings the host's copy of the chunk's state up to the device's, when it is older.
    fn pull(&mut self, gpu: &Gpu, ch: &mut Chunk) {
        if !self.stale {
            return;
        }
        let w = match self.model.zero().filter(|z| z.stage == 3) {
            Some(z) => z.spread_shard(gpu, ch.model.layout.total),
            None => self.model.download_trainable(),
        };
        match ch.model.lora.as_mut() {
            Some(lo) => lo.params.copy_from_slice(&w),
            None => put_master(ch, &w),
        }
        ch.opt.m.copy_from_slice(&gpu.download(&self.m));
        if !ch.opt.v.is_empty() {
            ch.opt.v.copy_from_slice(&gpu.download(&self.v));
        }
        self.stale = false;
    }
}

/// The data-parallel group's NCCL communicator on `gpu` (collective over `ch.dp`): its first
/// member's unique id goes to the others through the host group.
#[cfg(feature = "cuda")]
fn nccl_group(gpu: &Gpu, ch: &mut Chunk) -> std::result::Result<device::nccl::Nccl, device::DeviceError> {
    let (rank, n) = (ch.dp.rank(), ch.dp.n());
    let mine = match rank {
        0 => device::nccl::unique_id(),
        _ => Ok([0; device::nccl::ID_BYTES]),
    };
    // Every member learns whether the first could make it, so all fail together.
    let words: Vec<f64> = match &mine {
        Ok(id) => std::iter::once(1.0).chain(id.chunks(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)).collect(),
        Err(_) => vec![0.0; 1 + device::nccl::ID_BYTES / 4],
    };
    let all = ch.dp.all_gather_f64(&words);
    mine.as_ref().map_err(Clone::clone)?;
    if all[0] != 1.0 {
        return Err(device::DeviceError("the group's first member could not make its NCCL id".into()));
    }
    let mut id = [0u8; device::nccl::ID_BYTES];
    for (k, w) in all[1..words.len()].iter().enumerate() {
        id[4 * k..4 * k + 4].copy_from_slice(&(*w as u32).to_le_bytes());
    }
    device::nccl::Nccl::new(gpu, id, rank, n)
}

/// The runs of `r` outside `skip`.
fn complement_within(r: &std::ops::Range<usize>, skip: &[std::ops::Range<usize>]) -> Vec<std::ops::Range<usize>> {
    complement(skip, r.end).into_iter().filter_map(|c| {
        let (a, b) = (c.start.max(r.start), c.end.min(r.end));
        (a < b).then_some(a..b)
    }).collect()
}

/// The runs of `0..len` outside `ranges`.
fn complement(ranges: &[std::ops::Range<usize>], len: usize) -> Vec<std::ops::Range<usize>> {
    let mut sorted = ranges.to_vec();
    sorted.sort_by_key(|r| r.start);
    let (mut out, mut at) = (Vec::new(), 0);
    for r in sorted {
        if r.start > at {
            out.push(at..r.start);
        }
        at = at.max(r.end);
    }
    if at < len {
        out.push(at..len);
    }
    out
}

/// Refuses, before anything is allocated on the device, a run whose device plan (parameters,
/// gradients, AdamW's moments, one micro-batch's activations; under LoRA the frozen base and the
/// adapters' state) exceeds `memory.device_limit`, or whose largest buffer exceeds the adapter's;
/// the message gives the plan's figures. Returns the plan and a line of its figures (`kiln
/// memory --device` prints both).
/// `parts` are the rank's model chunks' configs and parameter counts (an interleaved
/// pipeline's several).
pub fn check_plan(gpu: &Gpu, d: DeviceArg, cfg: &RunConfig, parts: &[(&model::GptConfig, usize)]) -> Result<(model::device::DevicePlan, String)> {
    // A data- or expert-parallel rank's share of each micro-batch, a context-parallel part's
    // positions of each sequence.
    let rows = (cfg.micro_batch() / (cfg.parallel.dp * cfg.parallel.ep).max(1)).max(1);
    let t = cfg.seq_len() / parts[0].0.place.context.map_or(1, |cx| cx.count);
    let mut what = String::new();
    let mut p: Option<model::device::DevicePlan> = None;
    for &part in parts {
        let (q, w) = part_plan(gpu, cfg, part, (rows, t))?;
        p = Some(match p {
            None => {
                what = w;
                q
            }
            Some(p) => model::device::DevicePlan {
                params: p.params + q.params,
                trainable: p.trainable + q.trainable,
                total_bytes: p.total_bytes + q.total_bytes,
                largest_bytes: p.largest_bytes.max(q.largest_bytes),
                activation_bytes: p.activation_bytes.max(q.activation_bytes),
            },
        });
    }
    let mut p = p.expect("a model chunk");
    // A pipeline's first stage keeps the most micro-batches' activations in flight (each
    // chunk's model holds one set).
    let pc = &cfg.parallel;
    let sets = match pc.pp {
        1 => 1,
        pp => parallel::pp::Schedule::new(pc.schedule, pp, cfg.train.grad_accum, pc.virtual_stages).map_or(1, |s| s.peak_in_flight(0)),
    };
    p.total_bytes += (sets as u64).saturating_sub(parts.len() as u64) * p.activation_bytes;
    if pc.cp > 1 && pc.cp_mode == plan::policy::CpMode::Ulysses {
        p.total_bytes += ulysses_staging(parts[0].0, pc.cp, rows * t * pc.cp);
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let flight = if sets > 1 { format!(", {sets} micro-batches in flight") } else { String::new() };
    let chunks = if parts.len() > 1 { format!(" for each of {} model chunks", parts.len()) } else { String::new() };
    let figures = format!("the run needs {:.1} MiB on the device ({what}{chunks} and the activations of {rows} × {t} tokens{flight}), its largest buffer {:.1} MiB", mib(p.total_bytes), mib(p.largest_bytes));
    let limit = cfg.device_memory_limit();
    if limit > 0 && p.total_bytes > limit {
        return user(format!("train.device = {d}: {figures}: over memory.device_limit = {} ({:.1} MiB)", cfg.memory.device_limit, mib(limit)));
    }
    if p.largest_bytes > gpu.info.max_buffer {
        return user(format!("train.device = {d}: {figures}: over {}'s largest buffer, {:.1} MiB", gpu.info.name, mib(gpu.info.max_buffer)));
    }
    Ok((p, figures))
}

/// The bytes Ulysses stages on a context-parallel part's device for a layer's backward (its
/// largest moment), over `n` positions of `cp` parts: the exchanged q|k|v of the part's heads
/// and their gradient, the output's gradient, the log-sum-exps and `D`.
fn ulysses_staging(gpt: &model::GptConfig, cp: usize, n: usize) -> u64 {
    let (nh, hs) = (gpt.n_head, gpt.head_size());
    let nkv = match gpt.arch {
        model::config::Arch::Gpt2 => nh,
        model::config::Arch::Llama => gpt.n_kv_head,
    };
    let (hq, group) = (nh / cp, nh / nkv);
    // A part's kv heads: those its query heads share (`parallel::cp`'s split).
    let hkv = (0..cp).map(|c| ((c + 1) * hq - 1) / group - c * hq / group + 1).max().unwrap_or(1);
    let (qkv, out, lse) = (n * (hq + 2 * hkv) * hs, n * hq * hs, n * hq);
    4 * (2 * qkv + out + 2 * lse) as u64
}

/// One model chunk's device plan at `(rows, t)`, and a line of what its weights are.
fn part_plan(gpu: &Gpu, cfg: &RunConfig, (gpt, params): (&model::GptConfig, usize), (rows, t): (usize, usize)) -> Result<(model::device::DevicePlan, String)> {
    // The optimizer's state buffers: AdamW's two moments, or Lion's one.
    let (extra, state) = if cfg.optim.name == crate::config::OptimName::Lion { (1, "Lion's moment") } else { (2, "AdamW's two moments") };
    let (weights, what) = if cfg.lora.rank > 0 {
        let l = &cfg.lora;
        let layout = model::layout::gpt_layout(gpt).0;
        let lora = model::lora::Lora::new(gpt, l.rank, l.alpha as f32, &l.targets, cfg.train.seed).map_err(KilnError::User)?;
        let w = model::device::Weights::lora(&layout, &lora, cfg.train.precision, l.quantize_base);
        let base = match l.quantize_base {
            model::BaseQuant::None => format!("frozen, {}", plan::policy::Names::name(cfg.train.precision)),
            q => format!("frozen, {}", plan::policy::Names::name(q)),
        };
        (w, format!("a base of {params} parameters ({base}) and {} adapter parameters × {} buffers of fp32 (weights, gradients, {state})", lora.params.len(), 2 + extra))
    } else if cfg.parallel.dp > 1 && cfg.parallel.zero >= 1 {
        let (stage, n) = (cfg.parallel.zero as u8, cfg.parallel.dp);
        let units = model::layout::gpt_layout(gpt).1.units(params);
        let shard: usize = units.iter().map(|u| u.len().div_ceil(n)).sum();
        let largest = units.iter().map(|u| u.len()).max().unwrap_or(0);
        let ends = (units[0].len(), units[units.len() - 1].len());
        let what = match stage {
            3 => format!("ZeRO-3: a shard of {shard} of {params} parameters × {} buffers of fp32 (weights, gradients, {state}), units of up to {largest} gathered", 2 + extra),
            1 => format!("ZeRO-1: {params} parameters × 2 buffers of fp32 (weights, gradients) and a shard of {shard} × {extra} ({state})"),
            _ => format!("ZeRO-2: {params} parameters of fp32 weights and a shard of {shard} × {} buffers (gradients, {state})", 1 + extra),
        };
        (model::device::Weights::Zero { stage, params, shard, units: (largest, ends.0, ends.1) }, what)
    } else {
        (model::device::Weights::Full { params }, format!("{params} parameters × {} buffers of fp32 (weights, gradients, {state})", 2 + extra))
    };
    Ok((model::device::plan(gpu, gpt, weights, (rows, t), extra, (cfg.train.precision, cfg.model.recompute, cfg.model.recompute_every)), what))
}

/// The chunk's fp32 weights in layout order where its pieces lie (one rank, or ZeRO 0: the
/// whole layout; ZeRO-1: its shard's, zero elsewhere): the parameters, or under mixed precision
/// the master weights (bf16's joined from the working weights and their low halves).
fn host_master(ch: &mut Chunk) -> Vec<f32> {
    let mut out = vec![0.0; ch.model.layout.total];
    let master = &ch.opt.master;
    ch.dp.for_each_piece(|piece, p, _| {
        let (o, s) = (&mut out[piece.flat.clone()], piece.shard.clone());
        match master {
            Some(Master::Low(low)) => tensor::precision::join_bf16_into(o, p, &low[s]),
            Some(Master::F32(mw)) => o.copy_from_slice(&mw[s]),
            None => o.copy_from_slice(p),
        }
    });
    out
}

/// The inverse of [`host_master`]: the chunk's state from fp32 weights (the working weights
/// rounded from them under mixed precision, as the CPU optimizer leaves them).
fn put_master(ch: &mut Chunk, w: &[f32]) {
    let (master, round) = (&mut ch.opt.master, ch.opt.round);
    ch.dp.for_each_piece(|piece, p, _| {
        let (x, s) = (&w[piece.flat.clone()], piece.shard.clone());
        p.copy_from_slice(x);
        match (master.as_mut(), round) {
            (Some(Master::Low(low)), _) => tensor::precision::split_bf16_in_place(p, &mut low[s]),
            (Some(Master::F32(mw)), Some(fmt)) => {
                mw[s].copy_from_slice(x);
                tensor::precision::master_round_into(p, x, fmt);
            }
            _ => {}
        }
    });
    ch.dp.after_update();
}

#[cfg(test)]
mod tests {
    use super::HostGroup;
    use model::device::ZeroGroup;
    use std::sync::mpsc;

    /// A device rank's ZeRO collectives do not wait for the group: rank 0 starts its gather and
    /// reduce-scatter and goes on before rank 1 has started its own (a blocking collective
    /// would hang here), and the results, taken later, are the group's.
    #[test]
    fn zero_collectives_return_before_the_group_meets() {
        let mut comms = parallel::InProcess::world(2).into_iter();
        let (first, second) = (comms.next().unwrap(), comms.next().unwrap());
        let (go, wait) = mpsc::channel::<()>();
        let peer = std::thread::spawn(move || {
            let mut g = HostGroup::new(Box::new(second));
            wait.recv().unwrap();
            g.start_all_gather(5, vec![3.0, 4.0]);
            g.start_reduce_scatter(5, vec![10.0, 20.0, 30.0, 40.0]);
            (g.gathered(5), g.reduced())
        });
        let mut g = HostGroup::new(Box::new(first));
        g.start_all_gather(5, vec![1.0, 2.0]);
        g.start_reduce_scatter(5, vec![1.0, 2.0, 3.0, 4.0]);
        // Rank 1 starts only now, after rank 0 has returned from both.
        go.send(()).unwrap();
        assert_eq!(g.gathered(5), vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(g.reduced(), vec![(5, vec![11.0, 22.0])]);
        let (all, sums) = peer.join().unwrap();
        assert_eq!(all, vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(sums, vec![(5, vec![33.0, 44.0])]);
    }
}
