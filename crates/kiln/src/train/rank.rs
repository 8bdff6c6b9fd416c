//! One rank's training run, top to bottom: [`Rank::setup`] (the model, resumed state, this
//! rank's parts of it through `parallel::apply::parallelize`, the optimizer, the run
//! directory), then [`Rank::run`]'s loop — a step, its faults, its metrics line, evaluation,
//! the checkpoint request — and [`Rank::finish`] (the whole model again, the plot, a sample).
//!
//! Rank 0 owns the run directory, metrics, progress, checkpoints and the sample; every rank
//! computes, and every collective runs on every rank in the same order.

use super::ckpt::Checkpoints;
use super::data::{Loader, Row};
use crate::step::RowBuf;
use super::eval::{eval_sums, eval_sums_pipeline, EvalBatches};
use super::faults::{Faults, Verdict};
use super::metrics::{add_comm, add_memory, add_moe_stats};
use crate::util::reset_peak_rss;
use super::{sample_text, Ctx, Summary};
use crate::checkpoint::{self, Loaded, ReplicaStore};
use crate::config::{PpTrace, RunConfig};
use plan::policy::Names;
use crate::error::{io_err, KilnError, Result};
use crate::progress::{fmt_duration, Progress, StepInfo};
use crate::run::{self, ckpt_dir};
use crate::util::write_atomic;
use crate::step::{hardware_flops_per_token, model_flops_per_token, train_step, trainable, trainable_layout, Chunk, LossScaler, Moments, Optimizer, PipeTrace, Pipeline, StepOut};
use super::data::TrainData;
use model::gpt::Recompute;
use model::Gpt;
use parallel::apply::Applied;
use parallel::Comm;
use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tensor::rng::mix64;
use tensor::Rng;

/// Everything one rank's run holds between steps.
pub(super) struct Rank<'a> {
    /// First, so it drops first: its writer joins a copy in flight, which may still be reading
    /// the chunks' live buffers (`checkpoint::Source::Live`), before the chunks are freed.
    pub ckpt: Checkpoints,
    /// `train.device`: the step runs on a GPU, the chunk holds the host's copy of its state.
    #[cfg(feature = "vulkan")]
    device: Option<crate::device_step::DeviceRun>,
    pub cfg: &'a RunConfig,
    pub ds: &'a TrainData,
    pub run_dir: &'a Path,
    pub comm: &'a dyn Comm,
    stop: &'a AtomicBool,
    quiet: bool,
    pub rank: usize,
    pub world: usize,
    pub lead: bool,
    /// Each rank's original number (`faults.fail_ranks`, `faults.slow_ranks` and the reports
    /// name these): after an elastic resize the live ranks are renumbered.
    slots: Vec<usize>,
    /// Elastic growth: lost ranks are back from this step; the next disk checkpoint takes them in.
    grow_at: Option<u64>,
    /// This rank's last step's compute seconds (what `faults.slow_factor` stretches).
    last_compute_s: f64,
    /// Rank 0's straggler detector.
    stragglers: super::elastic::Stragglers,
    /// This rank's model chunks (behind their data-parallel stores, with their optimizers) and
    /// how they were cut from the whole model.
    pub chunks: Vec<Chunk>,
    pub applied: Applied,
    /// Sequences per data-parallel rank per micro-batch, and the sequence length.
    rows: usize,
    t: usize,
    sched: parallel::pp::Schedule,
    /// The first and last pipeline stages share a tied embedding.
    tied: bool,
    pipe_trace: Option<PipeTrace>,
    sampler: Rng,
    /// Draws each step's rows (its cursors are checkpointed with the sampler).
    pub loader: Loader<'a>,
    /// A preference objective: the reference model's log-probabilities of every pair.
    refs: Option<super::prefs::References>,
    /// GRPO: its rewards, the model that samples (the current weights), the batch of completions.
    grpo: Option<GrpoState>,
    pub step: u64,
    pub tokens_seen: u64,
    elapsed_prev: f64,
    started: Instant,
    /// Training time at the end of the last step, over every resumed part of the run.
    pub elapsed_s: f64,
    /// fp16's dynamic loss scale (restored with the checkpoint).
    pub scaler: Option<LossScaler>,
    flops_per_token: f64,
    hw_flops_per_token: f64,
    /// The matmul peak MFU is stated against (rank 0's measurement).
    peak: f64,
    recompute: Recompute,
    pub metrics: Option<crate::obs::MetricsWriter>,
    progress: Progress,
    last_val: Option<f64>,
    pub interrupted: bool,
    trace_until: Option<u64>,
    profile: Option<u64>,
    faults: Faults,
}

/// GRPO's state between steps.
struct GrpoState {
    rewards: crate::reward::Rewards,
    /// A whole copy of the weights the completions are sampled with, refreshed before sampling.
    policy: Gpt,
    /// With a KL term (`grpo.beta` > 0): the model the run started from.
    reference: Option<Gpt>,
    rollout: Option<super::grpo::Rollout>,
}

/// GRPO: the sampling model's weights made the current ones, whole (with LoRA: the base with the
/// adapters merged into it). Collective where the weights are split (ZeRO-3, tensor, pipeline
/// and expert parallelism).
fn refresh(st: &mut GrpoState, chunks: &mut [Chunk], applied: &Applied) {
    match (chunks[0].model.lora.as_ref(), st.reference.as_ref()) {
        (Some(lo), Some(base)) => {
            st.policy.params.clone_from(&base.params);
            lo.merge_into(&mut st.policy.params, &st.policy.views);
        }
        _ => st.policy.params = whole_params(chunks, applied),
    }
}

/// The whole model's current weights, from every rank's chunks (collective).
fn whole_params(chunks: &mut [Chunk], applied: &Applied) -> Vec<f32> {
    let bufs: Vec<Vec<f32>> = chunks.iter_mut().map(|ch| ch.dp.full_params()).collect();
    if applied.is_part() { applied.gather_whole(bufs) } else { bufs.into_iter().next().expect("a chunk") }
}

/// What one step measured, for its metrics line and progress.
struct Measured {
    out: StepOut,
    lr: f64,
    comm_bytes: parallel::CommTotals,
    bubble: Option<f64>,
    /// Context parallelism: `[compute s, wait s, blocks, skipped, pairs]` of each cp rank.
    cp_times: Option<Vec<f64>>,
    /// Every rank's `[compute s, wait s]` this step (several ranks).
    rank_times: Option<Vec<f64>>,
}

impl<'a> Rank<'a> {
    /// One rank's set-up, from `resume_from` (a checkpoint, or in-memory snapshots) when given;
    /// with `replicas`, snapshots are also kept in memory.
    pub fn setup(ctx: &'a Ctx, comm: &'a dyn Comm, stop: &'a AtomicBool, replicas: Option<&Arc<ReplicaStore>>, resume_from: Option<&Loaded>) -> Result<Rank<'a>> {
        let (args, cfg, ds) = (ctx.args, &ctx.cfg, ctx.ds);
        let run_dir = &ctx.run_dir;
        let (rank, world) = (comm.rank(), comm.size());
        let lead = rank == 0;
        let (t, mb) = (cfg.seq_len(), cfg.micro_batch());
        let (tpn, ppn, vn, epn, cpn) = (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.virtual_stages, cfg.parallel.ep, cfg.parallel.cp);
        let stages = cfg.stage_layers(ds.tokenizer.vocab_size())?;
        let strategy = parallel::apply::Strategy {
            pp: ppn, dp: world / cfg.parallel.per_dp(), ep: epn, tp: tpn, virtual_stages: vn, stages: stages.clone(),
            cp: cpn, cp_mode: cfg.parallel.cp_mode, cp_zigzag: cfg.parallel.cp_balance == plan::policy::CpBalance::Zigzag,
            sequence_parallel: cfg.parallel.sequence_parallel, zero: cfg.parallel.zero as u8,
            bucket_elems: ((cfg.parallel.bucket_mb * 1024.0 * 1024.0 / 4.0) as usize).max(1),
            micro_batch: mb, recompute: cfg.model.recompute, recompute_every: cfg.model.recompute_every,
            precision: cfg.train.precision, fp8_amax_history: cfg.train.fp8_amax_history,
            act_compression: (cfg.memory.activation_compression, cfg.memory.activation_rounding),
            zeropp: cfg.parallel.zeropp.resolve(world / cfg.parallel.per_dp()),
        };
        let mut model = whole_model(ctx, lead, stages.len() > 1)?;
        let (n, n_train) = (model.num_params(), trainable_layout(&model).total);
        // MFU is stated against the same peak `kiln bench --peak` reports for the run's arithmetic
        // (bf16 products for bf16 training; one rank's share of
        // the machine's cores is what in-process ranks split, so the peak is the machine's), for
        // the whole model's FLOPs.
        let peak = if lead { crate::bench::peak_flops(ctx.cfg.train.precision) } else { f64::NAN };
        let (flops_per_token, hw_flops_per_token, recompute) = (model_flops_per_token(&model, t), hardware_flops_per_token(&model, t), model.recompute);
        let mut resumed = resume_from.map(|l| read_resumed(l, &mut model)).transpose()?;
        // This rank's chunks: its pipeline stages' layers (the whole model without a pipeline),
        // each cut to this rank's tensor- or expert-parallel shard, behind its data-parallel
        // store (`parallel::apply`); the moments are cut the same way.
        let (parts, applied) = parallel::apply::parallelize(model, &strategy, comm).map_err(KilnError::User)?;
        let moments: Vec<Option<(Vec<f32>, Vec<f32>)>> = match resumed.as_mut().map(|r| std::mem::take(&mut r.moments)) {
            Some((m, v)) => applied.cut(m).into_iter().zip(applied.cut(v)).map(Some).collect(),
            None => parts.iter().map(|_| None).collect(),
        };
        let mut chunks = Vec::new();
        for (c, (part, mv)) in parts.into_iter().zip(moments).enumerate() {
            let offload = (cfg.memory.offload == crate::config::Offload::Optimizer).then(|| run_dir.join("offload").join(if vn > 1 { format!("rank{rank}-chunk{c}") } else { format!("rank{rank}") }));
            chunks.push(chunk(part, mv, resume_from, cfg, offload.as_deref())?);
        }
        if cfg.lora.quantize_base != model::BaseQuant::None {
            for ch in chunks.iter_mut() {
                quantize_base(cfg, ch)?;
            }
        }
        // Communication compression past its warm-up: this rank's state, as the checkpoint
        // left it (a checkpoint of another data-parallel degree restarts it).
        // (A checkpoint of the warm-up's last step has none yet: the state starts at zero.)
        if let (Some(l), true) = (resume_from, crate::step::compressing(cfg, resumed.as_ref().map_or(0, |r| r.step).saturating_sub(1))) {
            let ch = &mut chunks[0];
            let (len, n, me) = (ch.opt.m.len(), ch.dp.n(), ch.dp.rank());
            let st = crate::step::CompressionState::new(cfg, &ch.model.layout, len, n, me);
            ch.opt.compression = Some(st.clone());
            let row_len = ch.opt.compression_row_len().unwrap_or(0);
            match checkpoint::read_row(&l.optim, checkpoint::COMPRESSION_STATE, me, n, row_len) {
                Some(row) => {
                    ch.opt.restore_compression(st, &row);
                    // 0/1 Adam's local steps leave each rank its own parameters.
                    let (opt, mut own) = (&ch.opt, false);
                    ch.dp.for_each_piece(|piece, params, _| own |= opt.zeroone_local_params(params, piece, cfg));
                    if own {
                        ch.dp.after_update();
                    }
                }
                None if lead => eprintln!("{}: no {} state for {n} data-parallel ranks: it restarts from zero", l.dir.display(), cfg.parallel.compression.name()),
                None => {}
            }
        }
        // memory: charge the model state to its tracking categories.
        chunks.iter_mut().for_each(|ch| crate::memory::attribute(&ch.model, &mut ch.dp, &ch.opt));
        let step = resumed.as_ref().map_or(0, |r| r.step);
        #[cfg(feature = "vulkan")]
        let device = match cfg.train.device.parse::<crate::device::DeviceArg>().map_err(KilnError::User)? {
            crate::device::DeviceArg::Cpu => None,
            // Each rank its own device: rank r takes device N + r (modulo the devices found).
            d => Some(crate::device_step::DeviceRun::new(crate::device::for_rank(d, rank), cfg, &mut chunks)?),
        };
        // A device's MFU is against the device's measured matmul peak.
        #[cfg(feature = "vulkan")]
        let peak = device.as_ref().map_or(peak, |d| d.peak_flops());
        let metrics = if lead { Some(open_run_dir(ctx, step, args.resume || replicas.is_some() || ctx.restarted)?) } else { None };
        let groups = &applied.groups;
        let tied = applied.whole.tied_embeddings && ppn > 1 && groups.tie.size() > 1;
        let rows = mb / groups.dp_size;
        let sched = parallel::pp::Schedule::new(cfg.parallel.schedule, ppn, cfg.train.grad_accum, vn).map_err(KilnError::User)?;
        let pipe_trace = (cfg.parallel.pp_trace != PpTrace::Off).then(|| PipeTrace { tasks: Vec::new(), exclusive: cfg.parallel.pp_trace == PpTrace::Device });
        if pipe_trace.is_some() {
            let dir = run_dir.join("pipeline");
            fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
        }
        // Checkpoints hold the whole model (or the adapters alone).
        let layout = chunks[0].model.lora.as_ref().map_or(&applied.full_layout, |lo| &lo.layout).clone();
        let ckpt = Checkpoints::new(cfg, run_dir, replicas, rank, step, layout, ds.tokenizer.to_json());
        let (scaler, sampler) = match &resumed {
            Some(r) => (r.scaler.or_else(|| fresh_scaler(cfg)), Rng::from_state(r.sampler)),
            None => (fresh_scaler(cfg), Rng::new(mix64(cfg.train.seed ^ 0x5EED_DA7A))),
        };
        let mut r = Rank {
            #[cfg(feature = "vulkan")]
            device,
            loader: Loader::new(cfg, ds, resumed.as_ref().and_then(|r| r.loader.clone())),
            cfg, ds, run_dir, comm, stop, quiet: args.quiet, rank, world, lead, chunks, applied, rows, t, sched, tied, pipe_trace, sampler, step,
            slots: if ctx.slots.len() == world { ctx.slots.clone() } else { (0..world).collect() }, grow_at: ctx.grow_at, last_compute_s: 0.0,
            stragglers: super::elastic::Stragglers::new(cfg, world),
            tokens_seen: resumed.as_ref().map_or(0, |r| r.tokens_seen), elapsed_prev: resumed.as_ref().map_or(0.0, |r| r.elapsed_s), started: Instant::now(), elapsed_s: 0.0,
            scaler, flops_per_token, hw_flops_per_token, peak, recompute, metrics,
            progress: Progress::new(step, cfg.train.max_steps, args.quiet || !lead),
            last_val: None, interrupted: false, trace_until: None, profile: args.profile, faults: Faults::new(&cfg.faults, run_dir), ckpt, refs: None, grpo: None,
        };
        r.announce(n, n_train, resume_from)?;
        r.log_startup(ctx.base_load)?;
        r.start_pairs(resumed.is_some() || resume_from.is_some())?;
        r.start_grpo()?;
        r.started = Instant::now();
        crate::util::release_freed_memory();
        reset_peak_rss();
        crate::memory::track::reset_peaks();
        r.start_trace();
        Ok(r)
    }

    /// What the start-up held at most, counted by the allocator: everything since the base's
    /// load, and the load itself (`base_load`, which the memory plan's load phase bounds).
    fn log_startup(&mut self, base_load: Option<u64>) -> Result<()> {
        if !crate::memory::track::active() || !self.lead {
            return Ok(());
        }
        let mut line = serde_json::json!({"kind": "memory", "step": self.step, "startup_tracked_peak_bytes": crate::memory::track::peaks().0});
        if let Some(b) = base_load {
            line["base_load_tracked_peak_bytes"] = b.into();
        }
        self.log(line)
    }

    /// The last step's MoE routing statistics (the device's, on a device run).
    fn moe_stats(&self) -> &[tensor::moe::MoeStats] {
        #[cfg(feature = "vulkan")]
        if let Some(d) = &self.device {
            return d.moe_stats();
        }
        self.chunks[0].model.moe_stats()
    }

    /// A device run: brings the host's copy of the training state up to the device's (before
    /// anything reads it: a checkpoint, the sample).
    pub fn pull_from_device(&mut self) {
        #[cfg(feature = "vulkan")]
        if let Some(d) = self.device.as_mut() {
            d.pull(&mut self.chunks);
        }
    }

    /// A line on the console (rank 0, unless quiet).
    pub fn say(&self, s: &str) {
        if !self.quiet && self.lead {
            self.progress.println(s);
        }
    }

    /// A line in `metrics.jsonl` (rank 0's).
    pub fn log(&mut self, line: serde_json::Value) -> Result<()> {
        match self.metrics.as_mut() {
            Some(m) => m.log(&line).map_err(KilnError::User),
            None => Ok(()),
        }
    }

    /// The run's first lines: the model, the layout, the memory plan, the pipeline, the resume.
    fn announce(&mut self, n: usize, n_train: usize, resume_from: Option<&Loaded>) -> Result<()> {
        let (cfg, ds) = (self.cfg, self.ds);
        self.say(&format!(
            "kiln: {} | {:.2}M parameters{} | {} | run dir {}",
            cfg.preset, n as f64 / 1e6,
            if n_train < n { format!(" ({:.3}M trainable, {:.2}%: LoRA rank {})", n_train as f64 / 1e6, 100.0 * n_train as f64 / n as f64, cfg.lora.rank) } else { String::new() },
            ds.description, self.run_dir.display()
        ));
        let p = &cfg.parallel;
        if self.world > 1 {
            let cp = if p.cp > 1 { format!(" × cp {} ({}, {})", p.cp, p.cp_mode.name(), p.cp_balance.name()) } else { String::new() };
            self.say(&format!("parallel: {} ranks ({}): pp {} × dp {} × ep {}{cp} × tp {}, ZeRO stage {}, {} sequences per data-parallel rank per micro-batch", self.world, p.backend.name(), p.pp, self.applied.groups.dp_size / p.ep, p.ep, p.tp, p.zero, self.rows));
        }
        // memory: the plan, before step 0.
        self.say(crate::memory::plan_run(cfg, &self.applied.whole, ds.in_memory_bytes())?.table().trim_end());
        if self.applied.stages.len() > 1 {
            let layers: Vec<usize> = self.applied.stages.iter().map(|r| r.len()).collect();
            self.say(&format!("pipeline: {} schedule, {} micro-batches, {} chunk(s) per rank; layers per stage {layers:?}", p.schedule.name(), cfg.train.grad_accum, p.virtual_stages));
        }
        #[cfg(feature = "vulkan")]
        if let Some(d) = &self.device {
            self.say(&format!("device: {} (model, gradients and AdamW moments resident)", d.describe()));
        }
        if let Some(l) = resume_from {
            self.say(&format!("resuming from {} (step {})", l.dir.display(), self.step));
            // Where the run continues from (after a failure: the work lost is the steps done past it).
            self.log(serde_json::json!({"kind": "resume", "step": self.step, "from": l.dir.display().to_string()}))?;
        }
        Ok(())
    }

    /// `--profile N`: trace the next N steps.
    fn start_trace(&mut self) {
        self.trace_until = self.profile.map(|n| self.step + n);
        if self.trace_until.is_some() {
            if self.lead {
                tensor::profile::trace(true);
            }
            // The other ranks start their first traced step only once rank 0 has turned tracing on.
            if self.world > 1 {
                parallel::comm::sum_f64(self.comm, 0.0);
            }
        }
    }

    /// The training loop, to `train.max_steps` or a Ctrl-C.
    pub fn run(mut self) -> Result<Summary> {
        while self.step < self.cfg.train.max_steps {
            self.faults.injected_failure(self.slots[self.rank], self.step + 1)?;
            let t0 = Instant::now();
            let step_span = tensor::profile::scope("step");
            let m = self.train_one()?;
            self.step += 1;
            drop(step_span);
            self.after_step(m, t0)?;
            let on_disk = super::ckpt::request(&mut self)?;
            self.end_trace()?;
            if self.interrupted {
                break;
            }
            // Elastic growth: ranks that came back join at this checkpoint (every rank decides
            // the same from the config and the step).
            if on_disk && self.grow_at.is_some_and(|g| self.step >= g) && self.step < self.cfg.train.max_steps {
                self.progress.finish();
                self.ckpt.writer.finish()?;
                return Ok(Summary { run_dir: self.run_dir.to_path_buf(), step: self.step, val_loss: self.last_val, interrupted: false, regrow: true });
            }
        }
        self.finish()
    }

    /// Appends step `self.step + 1`'s windows to `RUN/batches.jsonl` (`train.record_batches`).
    fn record_batch(&self, rows: &[Row]) -> Result<()> {
        use std::io::Write;
        let rollout = self.grpo.as_ref().and_then(|g| g.rollout.as_ref());
        let n = rollout.map_or(rows.len(), |r| r.rows.len());
        let mut b = RowBuf::new(n, self.t, self.loader.packed());
        match rollout {
            // GRPO: the completions, with their advantages.
            Some(r) => super::grpo::fill(r, 0..n, self.t, &mut b),
            None => self.loader.fill(rows, &mut b),
        }
        let t = self.t;
        let list = |v: &[u32]| -> Vec<Vec<u32>> { v.chunks(t).map(|c| c.to_vec()).collect() };
        let mut line = serde_json::json!({"step": self.step + 1, "lr": self.cfg.lr_at(self.step), "inputs": list(&b.x), "targets": b.y.chunks(t).collect::<Vec<_>>()});
        if rollout.is_some() {
            line["advantages"] = serde_json::json!(b.advantages);
        }
        if self.loader.packed() {
            line["doc_start"] = serde_json::json!(list(&b.start));
            line["positions"] = serde_json::json!(list(&b.pos));
        }
        let path = self.run_dir.join("batches.jsonl");
        let line = line.to_string() + "\n";
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path).map_err(|e| io_err(&path, e))?;
        f.write_all(line.as_bytes()).map_err(|e| io_err(&path, e))
    }

    /// One optimizer step over the global batch (or, for a batch a rollback marked, only its
    /// draw, so the sampler stays in step with the uninterrupted run).
    fn train_one(&mut self) -> Result<Measured> {
        let (cfg, t, rows) = (self.cfg, self.t, self.rows);
        let lr = cfg.lr_at(self.step);
        let rows_all = if self.grpo.is_some() {
            self.roll_out()?;
            Vec::new()
        } else {
            self.loader.draw(&mut self.sampler, cfg.train.batch_size)
        };
        if cfg.train.record_batches && self.lead {
            self.record_batch(&rows_all)?;
        }
        let counters = self.comm.counters();
        let before = counters.snapshot();
        let (t0, wait0) = (Instant::now(), counters.wait_s());
        // Debug: a slow rank (`faults.slow_ranks`) stretches its compute by `faults.slow_factor`.
        let f = &cfg.faults;
        if f.slow_factor > 1.0 && f.slow_ranks.contains(&self.slots[self.rank]) {
            std::thread::sleep(std::time::Duration::from_secs_f64((f.slow_factor - 1.0) * self.last_compute_s));
        }
        parallel::cp::take_times();
        // memory: the activation buffers, allocated under their tracking category (a no-op once they fit).
        self.chunks.iter_mut().for_each(|ch| crate::memory::track::scope(crate::memory::track::Category::Activations, || ch.model.reserve_activations(rows, t)));
        let out = if self.faults.marked.contains(&(self.step + 1)) {
            StepOut { loss: f32::NAN, grad_norm: f64::NAN, overlap: Default::default(), skipped: Some("batch marked by a rollback"), peak_activation_bytes: 0, peak_in_flight: 0, loss_tokens: 0.0, pairs: None, policy: None }
        } else {
            let groups = &self.applied.groups;
            let (mb, dp_rank) = (cfg.micro_batch(), groups.dp_rank);
            let gate = self.ckpt.writer.gate();
            let wait_for_snapshot = || gate.wait();
            let mut pipe = Pipeline {
                sched: self.sched.clone(),
                rank: groups.pp_rank,
                comm: (cfg.parallel.pp > 1).then_some(&*groups.pp),
                tp: (cfg.parallel.tp > 1).then_some(&*groups.tp),
                tie: self.tied.then_some(&*groups.tie),
                trace: self.pipe_trace.as_mut(),
                before_update: Some(&wait_for_snapshot),
                scaler: self.scaler.as_mut(),
            };
            let faults = &self.faults;
            let (loader, refs, sources) = (&self.loader, &self.refs, &self.ds.sources);
            let rollout = self.grpo.as_ref().and_then(|g| g.rollout.as_ref());
            let fill = |micro: usize, b: &mut RowBuf| {
                let first = micro * mb + dp_rank * rows;
                if let Some(r) = rollout {
                    // (This rank's completions only.)
                    return super::grpo::fill(r, micro * rows..(micro + 1) * rows, t, b);
                }
                loader.fill(&rows_all[first..first + rows], b);
                if let Some(r) = refs {
                    super::prefs::fill_reference(sources, &r.train, &rows_all[first..first + rows], false, b);
                }
            };
            #[cfg(feature = "vulkan")]
            if let Some(d) = self.device.as_mut() {
                d.step(&mut self.chunks, cfg, (self.step, rows), fill, |loss, _| faults.spike(loss), &pipe)?
            } else {
                train_step(&mut self.chunks, &mut pipe, cfg, self.step, fill, |loss, _| faults.spike(loss))
            }
            #[cfg(not(feature = "vulkan"))]
            train_step(&mut self.chunks, &mut pipe, cfg, self.step, fill, |loss, _| faults.spike(loss))
        };
        let comm_bytes = counters.snapshot().since(&before);
        // This rank's compute: the step less the time it waited for others.
        let wait_s = counters.wait_s() - wait0;
        let compute_s = (t0.elapsed().as_secs_f64() - wait_s).max(0.0);
        // (What the slowing stretches is the compute without it.)
        self.last_compute_s = compute_s / if f.slow_ranks.contains(&self.slots[self.rank]) { f.slow_factor } else { 1.0 };
        let rank_times = (self.world > 1).then(|| parallel::comm::all_gather_f64(self.comm, &[compute_s, wait_s]));
        // Every context-parallel rank's attention compute and waits, for rank 0's line.
        let cp_times = (cfg.parallel.cp > 1).then(|| {
            let t = parallel::cp::take_times();
            parallel::comm::all_gather_f64(&*self.applied.groups.cp, &[t.compute_s, t.wait_s, t.blocks as f64, t.skipped as f64, t.pairs as f64])
        });
        // The update waited for a background checkpoint still copying the training state.
        let blocked = self.ckpt.writer.gate().take_waited();
        if blocked > 0.0 {
            self.log(serde_json::json!({"kind": "checkpoint", "step": self.step + 1, "update_blocked_s": blocked}))?;
        }
        let bubble = self.pipeline_trace(&out)?;
        Ok(Measured { out, lr, comm_bytes, bubble, cp_times, rank_times })
    }

    /// The pipeline trace: this rank's tasks, and the bubble against the step's makespan over
    /// every stage (collective over the pipeline group).
    fn pipeline_trace(&mut self, out: &StepOut) -> Result<Option<f64>> {
        let Some(tr) = self.pipe_trace.as_mut().filter(|_| out.peak_in_flight > 0) else { return Ok(None) };
        let (cfg, pp) = (self.cfg, &*self.applied.groups.pp);
        let end = if cfg.parallel.pp > 1 { parallel::comm::all_gather_f64(pp, &[tr.dev_end()]).into_iter().fold(0.0, f64::max) } else { tr.dev_end() };
        let b = tr.bubble(end);
        let line = serde_json::json!({
            "step": self.step + 1, "rank": self.rank, "pp_rank": self.applied.groups.pp_rank, "schedule": cfg.parallel.schedule.name(), "pp": cfg.parallel.pp, "micro_batches": self.sched.m, "virtual_stages": cfg.parallel.virtual_stages,
            "clock": cfg.parallel.pp_trace.name(), "bubble": b, "makespan_s": end,
            "peak_activation_bytes": out.peak_activation_bytes, "peak_in_flight": out.peak_in_flight, "tasks": tr.tasks,
        });
        let path = self.run_dir.join("pipeline").join(format!("rank-{:03}.jsonl", self.rank));
        let mut f = fs::OpenOptions::new().create(true).append(true).open(&path).map_err(|e| io_err(&path, e))?;
        use std::io::Write;
        writeln!(f, "{line}").map_err(|e| io_err(&path, e))?;
        Ok(Some(b))
    }

    /// After step `self.step`: its faults, the Ctrl-C vote, its metrics line, the heartbeat,
    /// progress and evaluation.
    fn after_step(&mut self, m: Measured, t0: Instant) -> Result<()> {
        let step = self.step;
        let verdict = {
            let (faults, metrics, progress) = (&mut self.faults, &mut self.metrics, &self.progress);
            let mut log = |line: serde_json::Value| metrics.as_mut().map_or(Ok(()), |w| w.log(&line).map_err(KilnError::User));
            let (quiet, lead) = (self.quiet, self.lead);
            faults.record(step, &m.out, lead, &mut log, &|s| if !quiet && lead { progress.println(s) })?
        };
        if let (Verdict::LossScaleBackoff, Some(sc)) = (&verdict, self.scaler) {
            // fp16 loss scaling at work: not a fault of the run, never a reason to roll back.
            self.log(serde_json::json!({"kind": "fault", "step": step, "event": "loss_scale_backoff", "loss_scale": sc.scale}))?;
        }
        let step_tokens = (self.cfg.train.batch_size * self.t) as u64;
        self.tokens_seen += step_tokens;
        let dt = t0.elapsed().as_secs_f64();
        let tps = step_tokens as f64 / dt;
        // A peak this step beat is out of date (measured on a busy machine): the step's rate is
        // the best this machine is known to do, and becomes the peak (measuring again here would
        // stall the step and allocate its products' buffers mid-run).
        let rate = self.flops_per_token * tps;
        if rate > self.peak && rate.is_finite() {
            self.log(serde_json::json!({"kind": "peak", "step": step, "stale_peak_gflops": self.peak / 1e9, "peak_gflops": rate / 1e9}))?;
            self.peak = rate;
        }
        let mfu = rate / self.peak;
        self.elapsed_s = self.elapsed_prev + self.started.elapsed().as_secs_f64();
        // Every rank stops at the same step: any rank's Ctrl-C stops them all.
        let stop_here = self.stop.load(Ordering::SeqCst) as u8 as f64;
        self.interrupted = if self.world > 1 { parallel::comm::sum_f64(self.comm, stop_here) > 0.0 } else { stop_here > 0.0 };
        if m.out.skipped.is_none() && self.metrics.is_some() {
            let line = self.train_line(&m, tps, mfu);
            self.log(line)?;
        }
        if let (Some(t), true) = (&m.rank_times, self.lead) {
            let compute: Vec<f64> = t.chunks(2).map(|c| c[0]).collect();
            for s in self.stragglers.observe(&compute) {
                let rank = self.slots[s.rank];
                self.log(serde_json::json!({"kind": "fault", "step": step, "event": "straggler", "rank": rank, "ratio": s.ratio, "steps": s.steps, "compute_s": compute[s.rank]}))?;
                self.say(&format!("step {step}: rank {rank} is a straggler: its compute took {:.2}× the median rank's for {} steps", s.ratio, s.steps));
            }
        }
        if self.lead {
            // For `kiln train --supervise`: proof of life, with the step reached.
            // (Renamed into place, so a reader never sees a half-written file; not synced: a
            // heartbeat only matters while this process lives.)
            let hb = self.run_dir.join("heartbeat");
            let _ = fs::write(hb.with_extension("tmp"), step.to_string()).and_then(|_| fs::rename(hb.with_extension("tmp"), &hb));
        }
        let max_steps = self.cfg.train.max_steps;
        let log_now = step.is_multiple_of(self.cfg.train.log_interval.max(1)) || step == max_steps;
        if m.out.skipped.is_none() {
            let loss_fraction = m.out.loss_tokens / step_tokens as f64;
            self.progress.step(&StepInfo { step, loss: m.out.loss, lr: m.lr, tokens_per_sec: tps, mfu, loss_fraction }, log_now);
        }
        let every = |k: u64| k > 0 && step.is_multiple_of(k);
        if every(self.cfg.eval.interval) || step == max_steps {
            self.evaluate(m.out.loss)?;
        }
        self.ckpt.step_times.push(dt);
        Ok(())
    }

    /// The step's `"kind": "train"` line.
    fn train_line(&self, m: &Measured, tps: f64, mfu: f64) -> serde_json::Value {
        let out = &m.out;
        let elapsed = self.elapsed_s;
        let mut line = serde_json::json!({
            "kind": "train", "step": self.step, "loss": out.loss, "lr": m.lr, "grad_norm": out.grad_norm,
            "tokens_per_sec": tps, "mfu": mfu, "elapsed_s": elapsed,
            "loss_fraction": out.loss_tokens / (self.cfg.train.batch_size * self.t) as f64,
        });
        if self.recompute != Recompute::None {
            line["hfu"] = (self.hw_flops_per_token * tps / self.peak).into();
        }
        add_moe_stats(&mut line, self.moe_stats());
        if let Some(st) = &out.pairs {
            super::metrics::add_pairs(&mut line, st, "");
        }
        if let (Some(st), Some(r)) = (&out.policy, self.grpo.as_ref().and_then(|g| g.rollout.as_ref())) {
            super::metrics::add_policy(&mut line, st, &r.figures);
        }
        if let Some(b) = m.bubble {
            line["pp_bubble"] = b.into();
        }
        if self.world > 1 {
            add_comm(&mut line, &m.comm_bytes, out);
        }
        if let Some(t) = &m.cp_times {
            super::metrics::add_cp(&mut line, t);
        }
        if let Some(t) = &m.rank_times {
            line["rank_compute_s"] = t.chunks(2).map(|c| c[0]).collect::<Vec<_>>().into();
            line["rank_wait_s"] = t.chunks(2).map(|c| c[1]).collect::<Vec<_>>().into();
        }
        add_memory(&mut line, &self.chunks, out, self.applied.stages.len() > 1);
        line
    }

    /// The batch sampler's state (the data cursor), for checkpoints.
    pub fn sampler_state(&self) -> [u64; 4] {
        self.sampler.state()
    }

    /// A preference objective: every chunk's model measures pairs, and the reference's
    /// log-probabilities are read back or measured before the first step.
    fn start_pairs(&mut self, resumed: bool) -> Result<()> {
        let Some(pc) = self.cfg.pair_cfg() else { return Ok(()) };
        if !self.rows.is_multiple_of(2) {
            return crate::error::user(format!("train.objective = \"{}\": each rank's micro-batch holds whole pairs, but it has {} rows: make train.batch_size / (train.grad_accum · data-parallel ranks) even", self.cfg.train.objective.name(), self.rows));
        }
        for ch in self.chunks.iter_mut() {
            ch.model.pairs = Some(model::pairs::PairRows::new(pc));
        }
        let (rows, t) = (self.rows, self.t);
        self.chunks.iter_mut().for_each(|ch| crate::memory::track::scope(crate::memory::track::Category::Activations, || ch.model.reserve_activations(rows, t)));
        let groups = &self.applied.groups;
        let pp = (self.cfg.parallel.pp > 1).then_some((&*groups.pp, groups.pp_rank));
        let mut st = super::prefs::Stages::Ranks { chunks: &mut self.chunks, pp };
        let refs = super::prefs::references(self.cfg, &self.ds.sources, &mut st, (self.run_dir, self.lead, resumed), rows)?;
        if let (Some(acc), false) = (refs.val_accuracy, resumed) {
            self.log(serde_json::json!({"kind": "reference", "step": self.step, "val_preference_accuracy": acc}))?;
            self.say(&format!("reference: held-out preference accuracy {:.1}% before training", 100.0 * acc));
        }
        self.refs = Some(refs);
        Ok(())
    }

    /// GRPO: every chunk's model measures completions, and a fresh run's held-out reward
    /// before the first step.
    fn start_grpo(&mut self) -> Result<()> {
        if self.cfg.train.objective != crate::config::Objective::Grpo {
            return Ok(());
        }
        let c = &self.cfg.grpo;
        let gc = tensor::grpo::GrpoCfg { eps_low: c.epsilon, eps_high: c.epsilon_high, beta: c.beta };
        let agg = c.loss.aggregation();
        for ch in self.chunks.iter_mut() {
            let mut rows = model::policy::PolicyRows::new(gc, agg, c.max_new_tokens);
            rows.parts = self.cfg.parallel.cp;
            ch.model.policy = Some(rows);
        }
        let rewards = crate::reward::Rewards::new(&c.rewards, &c.reward_weights, &c.answer_pattern)?;
        let (whole, real_vocab) = (self.cfg.gpt_config(self.ds.tokenizer.vocab_size()), self.chunks[0].model.real_vocab);
        let policy = crate::memory::track::scope(crate::memory::track::Category::Params, || Gpt::zeroed_frozen(whole.clone(), real_vocab));
        self.grpo = Some(GrpoState { rewards, policy, reference: None, rollout: None });
        // With LoRA the base is frozen: it is the reference, its adapters switched off.
        let lora = self.chunks[0].model.lora.is_some();
        if c.beta > 0.0 || lora {
            // The reference: the weights the first step starts from (a resumed run makes them
            // again; with LoRA, the frozen base as it is).
            let reference = if self.step == 0 || lora {
                let mut r = crate::memory::track::scope(crate::memory::track::Category::Params, || Gpt::zeroed_frozen(whole, real_vocab));
                r.params = whole_params(&mut self.chunks, &self.applied);
                r
            } else {
                super::grpo::initial_model(self.cfg, self.ds, real_vocab)?
            };
            self.grpo.as_mut().expect("set").reference = Some(reference);
        }
        if self.step == 0 {
            self.evaluate_grpo()?;
        }
        Ok(())
    }

    /// GRPO: the sampling model's weights made the current ones ([`refresh`]).
    fn refresh_policy(&mut self) -> &mut GrpoState {
        let st = self.grpo.as_mut().expect("a GRPO run");
        refresh(st, &mut self.chunks, &self.applied);
        st
    }

    /// GRPO: the batch of completions this step trains on, sampled anew at the first step of
    /// each `grpo.iterations` (with `μ > 1`, their sampling-time log-probabilities measured).
    fn roll_out(&mut self) -> Result<()> {
        let (step, mu) = (self.step, self.cfg.grpo.iterations as u64);
        if self.grpo.as_ref().and_then(|g| g.rollout.as_ref()).is_some_and(|r| step < r.step + mu && step >= r.step) {
            return Ok(());
        }
        let (cfg, ds, t, rows) = (self.cfg, self.ds, self.t, self.rows);
        let (rank, ranks) = (self.applied.groups.dp_rank, self.applied.groups.dp_size);
        let st = self.grpo.as_mut().expect("a GRPO run");
        refresh(st, &mut self.chunks, &self.applied);
        let dp = &mut self.chunks[0].dp;
        let share = super::grpo::Share { rank, ranks, rows, gather: &mut |x| if ranks > 1 { dp.all_gather_f64(x) } else { x.to_vec() } };
        let mut r = super::grpo::rollout(&st.policy, cfg, ds, &st.rewards, (step, share))?;
        if mu > 1 {
            r.old_logps = super::grpo::logps(&mut st.policy, &r, t, rows);
        }
        if let Some(reference) = st.reference.as_mut().filter(|_| cfg.grpo.beta > 0.0) {
            r.ref_logps = super::grpo::logps(reference, &r, t, rows);
        }
        st.rollout = Some(r);
        Ok(())
    }

    /// GRPO: the held-out prompts completed greedily by the current weights, scored.
    fn evaluate_grpo(&mut self) -> Result<()> {
        let (cfg, ds, step) = (self.cfg, self.ds, self.step);
        let st = self.refresh_policy();
        let (reward, first) = super::grpo::held_out_reward(&st.policy, cfg, ds, &st.rewards)?;
        let name = cfg.grpo.rewards[0].split(':').next().unwrap_or("reward").to_string();
        self.log(serde_json::json!({"kind": "eval", "step": step, "val_reward": reward, format!("val_reward_{name}"): first}))?;
        self.say(&format!("step {step}: held-out reward {reward:.4} ({name} {:.1}%)", 100.0 * first));
        Ok(())
    }

    /// The held-out pairs' loss, rewards and accuracy (collective over every rank).
    fn evaluate_pairs(&mut self, train_loss: f32) -> Result<()> {
        let (cfg, groups) = (self.cfg, &self.applied.groups);
        let eb = if cfg.eval.batch_size == 0 { self.rows } else { cfg.eval.batch_size + cfg.eval.batch_size % 2 };
        let refs = self.refs.as_ref().expect("measured at the start");
        let t = self.t;
        self.chunks.iter_mut().for_each(|ch| crate::memory::track::scope(crate::memory::track::Category::Activations, || ch.model.reserve_activations(eb, t)));
        let pp = (cfg.parallel.pp > 1).then_some((&*groups.pp, groups.pp_rank));
        let mut stages = super::prefs::Stages::Ranks { chunks: &mut self.chunks, pp };
        let mut st = super::prefs::eval_pairs(&mut stages, &self.ds.sources, refs, t, (eb, cfg.eval.iters), (groups.dp_rank, groups.dp_size));
        if self.chunks[0].dp.n() > 1 {
            // (Over the store's group, whose context-parallel ranks measured the same pairs.)
            let sums: [f64; model::pairs::PairStats::LEN] = self.chunks[0].dp.all_reduce_f64(&st.to_array()).try_into().expect("one sum per field");
            st = model::pairs::PairStats::from_array(sums.map(|x| x / cfg.parallel.cp as f64));
        }
        if st.pairs == 0.0 {
            return Ok(());
        }
        let vl = st.loss / st.pairs;
        self.last_val = Some(vl);
        let mut line = serde_json::json!({"kind": "eval", "step": self.step, "val_loss": vl});
        super::metrics::add_pairs(&mut line, &st, "val_");
        self.log(line)?;
        self.say(&format!("step {}: train loss {train_loss:.4}, val loss {vl:.4}, val preference accuracy {:.1}%", self.step, 100.0 * st.correct / st.pairs));
        Ok(())
    }

    /// The held-out loss (collective over every rank).
    fn evaluate(&mut self, train_loss: f32) -> Result<()> {
        let _p = tensor::profile::scope("eval");
        let cfg = self.cfg;
        if cfg.train.objective.pairs().is_some() {
            return self.evaluate_pairs(train_loss);
        }
        if self.grpo.is_some() {
            return self.evaluate_grpo();
        }
        let t = if cfg.eval.seq_len == 0 { self.t } else { cfg.eval.seq_len };
        let eb = if cfg.eval.batch_size == 0 { cfg.micro_batch() } else { cfg.eval.batch_size };
        let groups = &self.applied.groups;
        let (dpn, ppn) = (groups.dp_size, cfg.parallel.pp);
        let packed = self.loader.packed();
        let batches = EvalBatches { t, batch: eb, max_batches: cfg.eval.iters, rank: groups.dp_rank, ranks: dpn, packed, reset_positions: cfg.data.reset_positions };
        // A device run evaluates on the device: nothing is pulled to the host.
        #[cfg(feature = "vulkan")]
        if let Some(d) = self.device.as_mut() {
            let (mut sum, mut count) = (0.0, 0);
            let (pp, me) = (&*groups.pp, groups.pp_rank);
            for s in &self.ds.sources {
                let (a, b) = d.with_hooks(&mut self.chunks, |models| match ppn {
                    1 => super::eval::eval_sums_on_device(models[0], &s.val, batches),
                    _ => super::eval::eval_sums_pipeline_on_device(models, pp, me, &s.val, batches),
                });
                (sum, count) = (sum + a, count + b);
            }
            // Data parallel: each rank evaluated its share of the batches (and a
            // context-parallel part its positions of them): summed over the store's group.
            if self.chunks[0].dp.n() > 1 {
                let all = self.chunks[0].dp.all_reduce_f64(&[sum, count as f64]);
                (sum, count) = (all[0], all[1] as usize);
            }
            // The losses are the last stage's.
            let sum = if ppn > 1 { parallel::comm::all_gather_f64(pp, &[sum])[ppn - 1] } else { sum };
            return self.log_eval(train_loss, sum / count.max(1) as f64);
        }
        self.chunks.iter_mut().for_each(|ch| crate::memory::track::scope(crate::memory::track::Category::Activations, || ch.model.reserve_activations(eb, t)));
        // Every source's held-out split, each up to eval.iters batches.
        let (mut sum, mut count) = (0.0, 0);
        for s in &self.ds.sources {
            let (a, b) = if self.applied.stages.len() > 1 {
                eval_sums_pipeline(&mut self.chunks, &*groups.pp, groups.pp_rank, &s.val, batches)
            } else {
                let ch = &mut self.chunks[0];
                eval_sums(&mut ch.model, Some(&mut ch.dp), &s.val, batches)
            };
            (sum, count) = (sum + a, count + b);
        }
        // Over the store's group: the data-parallel ranks and, each with its positions, the
        // context-parallel ones.
        let (sum, count) = if self.chunks[0].dp.n() > 1 {
            let r = self.chunks[cfg.parallel.virtual_stages - 1].dp.all_reduce_f64(&[sum, count as f64]);
            (r[0], r[1] as usize)
        } else {
            (sum, count)
        };
        // The losses are the last stage's.
        let sum = if ppn > 1 { parallel::comm::all_gather_f64(&*groups.pp, &[sum])[ppn - 1] } else { sum };
        self.log_eval(train_loss, sum / count.max(1) as f64)
    }

    /// The evaluation's line and console message.
    fn log_eval(&mut self, train_loss: f32, vl: f64) -> Result<()> {
        self.last_val = Some(vl);
        let step = self.step;
        self.log(serde_json::json!({"kind": "eval", "step": step, "val_loss": vl}))?;
        self.say(&format!("step {step}: train loss {train_loss:.4}, val loss {vl:.4}"));
        Ok(())
    }

    /// `--profile`: the trace of the traced steps, once they are done.
    fn end_trace(&mut self) -> Result<()> {
        let step = self.step;
        if self.lead && self.trace_until.is_some_and(|u| step >= u || step == self.cfg.train.max_steps || self.interrupted) {
            self.trace_until = None;
            tensor::profile::trace(false);
            crate::obs::trace::write_trace(self.run_dir, &tensor::profile::take_trace(), 0).map_err(KilnError::Internal)?;
            self.say(&format!("trace of steps {}..={step}: {}", step + 1 - self.profile.unwrap().min(step), self.run_dir.join("trace.json").display()));
        }
        Ok(())
    }

    /// After the loop: the last checkpoint write, the whole model again (for the sample), the
    /// loss plot and a sample of what the model learned.
    fn finish(mut self) -> Result<Summary> {
        self.pull_from_device();
        self.progress.finish();
        self.ckpt.writer.finish()?;
        let (step, interrupted, last_val) = (self.step, self.interrupted, self.last_val);
        let summary = |run_dir: &Path| Summary { run_dir: run_dir.to_path_buf(), step, val_loss: last_val, interrupted, regrow: false };
        let (cfg, ds) = (self.cfg, self.ds);
        // The whole model, for the sample (none without one: a quantized base is not dequantized
        // whole, a store's weights not copied).
        let wanted = cfg.sample.tokens > 0 && !interrupted;
        // (Decided by the config alone: every rank takes part in the gathers, or none.)
        let model = if cfg.sample.tokens == 0 || (interrupted && cfg.lora.quantize_base != model::BaseQuant::None) {
            None
        } else {
            let mut bufs = Vec::new();
            for Chunk { mut model, dp, .. } in std::mem::take(&mut self.chunks) {
                dp.restore(&mut model);
                bufs.push(model);
            }
            Some(if self.applied.is_part() {
                let mut full = Gpt::zeroed(cfg.gpt_config(ds.tokenizer.vocab_size()), bufs[0].real_vocab);
                let params = bufs.iter_mut().map(|m| std::mem::take(&mut m.params)).collect();
                full.params = self.applied.gather_whole(params);
                full
            } else {
                bufs.pop().unwrap()
            })
        };
        if !self.lead {
            return Ok(summary(self.run_dir));
        }
        if let Err(e) = crate::obs::write_loss_png(self.run_dir) {
            eprintln!("warning: loss.png: {e}");
        }
        let total = self.started.elapsed().as_secs_f64();
        if interrupted {
            eprintln!("interrupted: stopped cleanly at step {step}; continue with: kiln train --resume --out {}", self.run_dir.display());
        } else if !self.quiet {
            eprintln!("trained to step {step} in {}", fmt_duration(total));
        }
        if let Some(model) = model.filter(|_| wanted) {
            let sampler_model = &run::merged(model);
            let (temperature, top_k, seed) = (cfg.sample.temperature as f32, cfg.sample.top_k, cfg.train.seed);
            let text = match held_out_prompt(ds.val()) {
                // After a supervised fine-tune: a held-out conversation's prompt (through its
                // template), the reply until the EOS.
                Some(prompt) => {
                    let sampler = model::Sampler { stop_ids: ds.tokenizer.eos_id().into_iter().collect(), ..model::Sampler::new(temperature, top_k, seed) };
                    let out = sampler_model.generate(&prompt, cfg.sample.tokens, &sampler);
                    ds.tokenizer.decode(&prompt) + &ds.tokenizer.decode(&out)
                }
                None => sample_text(sampler_model, &ds.tokenizer, &cfg.sample.prompt, cfg.sample.tokens, temperature, top_k, seed)?,
            };
            write_atomic(&self.run_dir.join("sample.txt"), text.as_bytes())?;
            // The sample is the run's product, so it goes to stdout even with --quiet.
            println!("--- sample (step {step}) ---\n{text}\n---");
        }
        Ok(summary(self.run_dir))
    }
}

/// The prompt of a held-out document under a loss mask (chat or prompt/completion data): its
/// tokens before the first that carries loss — a conversation's turns up to the assistant's
/// reply, its generation prompt included. The split's first document may begin mid-way (where
/// the split was cut), so the second is taken when there is one. `None` without a mask.
fn held_out_prompt(val: &::data::Split) -> Option<Vec<u32>> {
    let mask = val.mask.as_ref()?;
    (1..val.docs.len()).chain([0]).find_map(|d| {
        let r = val.docs.range(d);
        let first = r.clone().find(|&i| mask.get(i) != 0)?;
        (first > r.start).then(|| (r.start..first).map(|i| val.tokens.get(i)).collect())
    })
}

/// The whole model this rank starts from: a fresh initialisation, or the base model
/// (`model.init_from`: rank 0's copy, which the others receive when the data-parallel store
/// starts, unless each rank cuts its own part of it), with recomputation and LoRA adapters.
fn whole_model(ctx: &Ctx, lead: bool, pipelined: bool) -> Result<Gpt> {
    let (cfg, ds) = (&ctx.cfg, ctx.ds);
    let gcfg = cfg.gpt_config(ds.tokenizer.vocab_size());
    let init = if lead { ctx.init.lock().unwrap().take() } else { None };
    let real_vocab = cfg.loss_vocab(ds.tokenizer.vocab_size());
    let from_base = |mut m: Gpt| {
        // The run's training settings over the base's file (which has none of them).
        (m.cfg.dropout, m.cfg.moe_bias_rate) = (gcfg.dropout, gcfg.moe_bias_rate);
        m.real_vocab = real_vocab;
        m
    };
    let mut model = match init {
        Some(m) => from_base(m),
        // Tensor-parallel, expert-parallel and pipeline ranks each cut their part from the base.
        None if !cfg.model.init_from.is_empty() && (cfg.parallel.tp > 1 || pipelined || cfg.parallel.ep > 1) => from_base(run::load_base(Path::new(&cfg.model.init_from))?),
        // Other ranks receive rank 0's weights when the data-parallel store starts.
        None if !cfg.model.init_from.is_empty() => Gpt::zeroed(gcfg.clone(), real_vocab),
        None => Gpt::new(gcfg.clone(), real_vocab, cfg.train.seed),
    };
    model.recompute = cfg.model.recompute;
    model.recompute_every = cfg.model.recompute_every;
    if cfg.lora.rank > 0 {
        let l = &cfg.lora;
        model.lora = Some(model::lora::Lora::new(&model.cfg, l.rank, l.alpha as f32, &l.targets, cfg.train.seed).map_err(KilnError::User)?);
    }
    Ok(model)
}

/// QLoRA: the chunk's frozen base, quantized in its store. From a Hugging Face directory every
/// rank reads the tensors itself, one at a time (the model holds untouched zeros: `run::hf_shell`);
/// from a kiln run, the fp32 base this rank holds (rank 0's, broadcast) is quantized.
fn quantize_base(cfg: &RunConfig, ch: &mut Chunk) -> Result<()> {
    let dir = Path::new(&cfg.model.init_from);
    if dir.join("config.toml").exists() {
        let base = ch.dp.quantize_base(&ch.model, cfg.lora.quantize_base, None);
        ch.model.set_quantized_base(base);
        return Ok(());
    }
    let reader = model::hf::TensorReader::open(dir).map_err(KilnError::User)?;
    let mut failed = None;
    // bf16 LoRA trains over a bf16 base: each tensor rounded before it is quantized (as
    // `chunk` rounds a base it holds).
    let round = model::gpt::storage(cfg.train.precision);
    let mut fill = |p: &model::ParamSpec, dst: &mut [f32]| {
        if let Err(e) = reader.read_into(&p.name, &p.shape, dst) {
            failed.get_or_insert(e);
        }
        if let Some(fmt) = round {
            tensor::precision::round_slice(dst, fmt);
        }
    };
    let base = ch.dp.quantize_base(&ch.model, cfg.lora.quantize_base, Some(&mut fill));
    ch.model.set_quantized_base(base);
    failed.map_or(Ok(()), |e| Err(KilnError::User(e)))
}

/// What a resumed run restores besides the parameters (which go straight into the model).
struct Resumed {
    moments: (Vec<f32>, Vec<f32>),
    scaler: Option<LossScaler>,
    sampler: [u64; 4],
    loader: Option<crate::checkpoint::LoaderState>,
    step: u64,
    tokens_seen: u64,
    elapsed_s: f64,
}

/// Reads checkpoint `l` into `model`'s trainable parameters and returns the rest of its state:
/// the moments (laid out as the trainable parameters), the loss scale, the sampler, the counters.
fn read_resumed(l: &Loaded, model: &mut Gpt) -> Result<Resumed> {
    let layout = trainable_layout(model).clone();
    checkpoint::read_into(&l.model, "", &layout, trainable(model).0, &l.dir.join("model.safetensors"))?;
    let (mut m, mut v) = (vec![0.0; layout.total], vec![0.0; layout.total]);
    checkpoint::read_into(&l.optim, "exp_avg.", &layout, &mut m, &l.dir.join("optimizer.safetensors"))?;
    checkpoint::read_into(&l.optim, "exp_avg_sq.", &layout, &mut v, &l.dir.join("optimizer.safetensors"))?;
    let st = &l.state;
    Ok(Resumed { moments: (m, v), scaler: st.loss_scale, sampler: st.sampler_rng, loader: st.loader.clone(), step: st.step, tokens_seen: st.tokens_seen, elapsed_s: st.elapsed_s })
}

/// fp16's dynamic loss scaler, fresh from the config.
fn fresh_scaler(cfg: &RunConfig) -> Option<LossScaler> {
    (cfg.train.precision == model::gpt::Precision::Fp16).then_some(LossScaler { scale: cfg.train.loss_scale, good: 0, window: cfg.train.loss_scale_window })
}

/// A chunk from its part: the optimizer (its moments from the checkpoint, sharded for ZeRO),
/// mixed precision's master copy, compact optimizer state, FP8's resumed histories, offload.
fn chunk(part: parallel::apply::Part, moments: Option<(Vec<f32>, Vec<f32>)>, resume_from: Option<&Loaded>, cfg: &RunConfig, offload: Option<&Path>) -> Result<Chunk> {
    let parallel::apply::Part { model: m, mut dp, replicated, seq_partial } = part;
    let zero = cfg.parallel.zero > 0;
    let mut opt = if m.lora.is_some() { Optimizer::new(trainable_layout(&m)) } else { Optimizer::with_len(&m.layout, dp.moments_len()) };
    let loaded = moments.is_some();
    if let Some((mm, vv)) = moments {
        let sharded = m.lora.is_none() && zero;
        let (mm, vv) = if sharded { (dp.shards.take(&mm), dp.shards.take(&vv)) } else { (mm, vv) };
        (opt.m, opt.v) = (Moments::Mem(mm), Moments::Mem(vv));
    }
    if cfg.optim.name == crate::config::OptimName::Lion {
        opt.keep_only_first_moment();
    }
    let whole = || vec![parallel::Piece { flat: 0..opt.m.len(), shard: 0..opt.m.len() }];
    let pieces = if m.lora.is_some() { whole() } else { dp.pieces() };
    match cfg.optim.name {
        crate::config::OptimName::Adafactor => opt.factor(&pieces),
        crate::config::OptimName::Muon => opt.compact_v(&pieces),
        _ => {}
    }
    // Mixed precision: the fp32 weights (fresh or from the checkpoint) become the master copy
    // and the working parameters are rounded.
    // With LoRA (bf16 only) the frozen base is what is rounded, once; the adapters stay fp32.
    match (model::gpt::storage(m.precision), m.lora.is_some()) {
        (Some(fmt), false) => opt.mixed(&mut dp, fmt),
        (Some(fmt), true) => {
            dp.for_each_piece(|_, params, _| tensor::precision::round_slice(params, fmt));
            dp.after_update();
        }
        (None, _) => {}
    }
    if cfg.optim.state != crate::config::StateForm::Fp32 {
        let pieces = if m.lora.is_some() { vec![parallel::Piece { flat: 0..opt.m.len(), shard: 0..opt.m.len() }] } else { dp.pieces() };
        opt.make_lean(cfg.optim.state, &pieces, (cfg.train.seed, loaded));
        crate::util::release_freed_memory();
    }
    if let (Some(st), Some(h)) = (m.fp8.as_ref(), resume_from.and_then(|l| l.state.fp8_amax.as_ref())) {
        // The checkpoint holds the whole model's histories; a stage takes its layers'.
        st.borrow_mut().set_history_from_layer(h, m.cfg.first_layer());
    }
    if let Some(dir) = offload {
        opt.offload(dir, &mut dp).map_err(|e| io_err(dir, e))?;
    }
    Ok(Chunk { model: m, dp, opt, replicated, seq_partial, pool: Vec::new() })
}

/// Rank 0's run directory: checkpoints (partial ones a dead writer left removed), the resolved
/// config, the tokenizer, and the metrics writer (a resumed run drops the lines past `step`).
fn open_run_dir(ctx: &Ctx, step: u64, resumed: bool) -> Result<crate::obs::MetricsWriter> {
    let (run_dir, cfg) = (&ctx.run_dir, &ctx.cfg);
    fs::create_dir_all(ckpt_dir(run_dir)).map_err(|e| io_err(run_dir, e))?;
    for p in checkpoint::remove_partial(&ckpt_dir(run_dir)) {
        eprintln!("removed a partial checkpoint a stopped writer left: {}", p.display());
    }
    write_atomic(&ctx.saved_cfg_path, cfg.to_toml().as_bytes())?;
    write_atomic(&run_dir.join(ctx.ds.tokenizer.file_name()), ctx.ds.tokenizer.to_json().as_bytes())?;
    // Its BOS/EOS and chat template: a resumed run tokenizes its documents as this one did.
    if let Some(c) = ctx.ds.tokenizer.config_json() {
        write_atomic(&run_dir.join(data::HF_TOKENIZER_CONFIG_FILE), format!("{c}\n").as_bytes())?;
    }
    if let Some(t) = ctx.ds.tokenizer.chat_template_file() {
        write_atomic(&run_dir.join(data::HF_CHAT_TEMPLATE_FILE), t.as_bytes())?;
    }
    crate::obs::MetricsWriter::open(run_dir, resumed.then_some(step)).map_err(KilnError::User)
}
