//! Checkpoint requests from the training loop: when one is due (every `checkpoint.interval`
//! steps, or — `checkpoint.mtbf_s` — at the Young/Daly interval from its measured cost; at the
//! last step and on Ctrl-C; in memory every `checkpoint.memory_interval` steps), what it holds
//! (whole tensors, gathered from the parts, or this rank's slice of each), and its hand-off to
//! the background writer.

use super::rank::Rank;
use crate::checkpoint::{self, ReplicaStore, TrainState};
use crate::config::RunConfig;
use crate::error::Result;
use crate::run::ckpt_dir;
use crate::step::{Chunk, Master};
use model::ParamLayout;
use parallel::apply::Applied;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// A run's checkpointing state.
pub(super) struct Checkpoints {
    pub writer: checkpoint::Writer,
    /// What a checkpoint holds: the whole model's layout, or the adapters' alone (LoRA).
    layout: ParamLayout,
    tokenizer_json: String,
    /// Every step's duration (the automatic interval takes the recent median).
    pub step_times: Vec<f64>,
    auto_interval: Option<u64>,
    /// With `checkpoint.mtbf_s`: the step of the next disk checkpoint.
    auto_next: Option<u64>,
    replicas: Option<Arc<ReplicaStore>>,
}

impl Checkpoints {
    /// `layout`: what a checkpoint holds (the whole model's layout, or the adapters').
    pub fn new(cfg: &RunConfig, run_dir: &Path, replicas: Option<&Arc<ReplicaStore>>, rank: usize, step: u64, layout: ParamLayout, tokenizer_json: String) -> Checkpoints {
        let c = &cfg.checkpoint;
        // The first automatic checkpoint comes at checkpoint.interval (or step 10) to measure
        // the cost.
        let auto_next = (c.mtbf_s > 0.0).then(|| step + if c.interval > 0 { c.interval } else { 10 });
        if let k @ 1.. = cfg.faults.kill_in_write_step {
            *checkpoint::KILL_IN_WRITE.lock().unwrap() = Some((k, run_dir.join(format!("faults-fired-kill-in-write-step{k}"))));
        }
        let mut writer = checkpoint::Writer::new(ckpt_dir(run_dir), c.keep, c.keep_every, c.background);
        if let Some(st) = replicas {
            writer = writer.with_replicas(st.clone(), rank);
        }
        Checkpoints { writer, layout, tokenizer_json, step_times: Vec::new(), auto_interval: None, auto_next, replicas: replicas.cloned() }
    }
}

/// After step `r.step`: a disk checkpoint or an in-memory snapshot if one is due (collective:
/// every rank decides the same). Whether a disk checkpoint was taken.
pub(super) fn request(r: &mut Rank) -> Result<bool> {
    let (cfg, step, world) = (r.cfg, r.step, r.world);
    let last = step == cfg.train.max_steps;
    let every = |k: u64| k > 0 && step % k == 0;
    let due = match r.ckpt.auto_next {
        Some(n) => step >= n,
        None => every(cfg.checkpoint.interval),
    };
    let to_disk = due || last || r.interrupted;
    // An in-memory snapshot between disk checkpoints waits for no disk write: while one is
    // still in flight on any rank, every rank skips it.
    let in_memory = !to_disk && r.ckpt.replicas.is_some() && every(cfg.checkpoint.memory_interval) && {
        let busy = r.ckpt.writer.writing_to_disk() as u8 as f64;
        let busy = if world > 1 { parallel::comm::sum_f64(r.comm, busy) } else { busy };
        if busy > 0.0 {
            r.log(serde_json::json!({"kind": "checkpoint", "step": step, "disk": false, "skipped": "a disk write is in flight"}))?;
        }
        busy == 0.0
    };
    if to_disk || in_memory {
        save(r, to_disk, last)?;
        if let Some(next) = r.ckpt.auto_next.as_mut().filter(|_| to_disk) {
            // Every rank takes rank 0's choice (the checkpoint is collective).
            let i = r.ckpt.auto_interval.unwrap_or(0);
            let i = if world > 1 { parallel::comm::sum_f64(r.comm, i as f64) as u64 } else { i };
            *next = step + i.max(1);
        }
    }
    Ok(to_disk)
}

/// One checkpoint (to disk, or only into memory): the snapshot of the training state handed to
/// the writer, rank 0's report of it.
fn save(r: &mut Rank, to_disk: bool, last: bool) -> Result<()> {
    let _p = tensor::profile::scope("checkpoint");
    r.pull_from_device();
    let ck0 = Instant::now();
    let (cfg, step, rank, world, lead) = (r.cfg, r.step, r.rank, r.world, r.lead);
    let done_at_end = r.interrupted || last;
    let pipelined = r.applied.stages.len() > 1;
    let fp8_hist = if pipelined && r.chunks[0].model.fp8.is_some() {
        Some(r.applied.fp8_histories(&r.chunks.iter().map(|c| &c.model).collect::<Vec<_>>()))
    } else {
        r.chunks[0].model.fp8.as_ref().map(|s| s.borrow().history())
    };
    // With several ranks and whole-model weights, every rank writes its slice of every tensor
    // (a LoRA run's tiny adapters are written whole by rank 0).
    let sharded = world > 1 && r.chunks[0].model.lora.is_none();
    let writes = lead || sharded;
    if !writes {
        // A LoRA run's other ranks: rank 0 writes the adapters whole (nothing to gather).
        return Ok(());
    }
    let part = if sharded {
        // Rank 0 empties the shared temporary directory before anyone writes into it.
        let tmp = if lead && to_disk { Some(checkpoint::prepare_sharded(&ckpt_dir(r.run_dir), step)?) } else { None };
        if to_disk {
            parallel::comm::sum_f64(r.comm, 0.0);
        }
        let mut shapes: std::collections::BTreeMap<String, Vec<usize>> = r.ckpt.layout.params.iter().flat_map(|p| ["", "exp_avg.", "exp_avg_sq."].map(|pre| (format!("{pre}{}", p.name), p.shape.clone()))).collect();
        if let Some(k) = r.chunks[0].opt.compression_row_len() {
            shapes.insert(checkpoint::COMPRESSION_STATE.to_string(), vec![world, k]);
        }
        Some(checkpoint::Part { rank, world, tmp: tmp.unwrap_or_else(|| ckpt_dir(r.run_dir).join(format!(".tmp-step-{step:08}-sharded"))), shapes })
    } else {
        None
    };
    let state = TrainState { step, sampler_rng: r.sampler_state(), tokens_seen: r.tokens_seen, elapsed_s: r.elapsed_s, config: cfg.to_toml(), loss_scale: r.scaler, fp8_amax: fp8_hist, loader: r.loader.has_cursors().then(|| r.loader.state().clone()) };
    // The writer copies all of each tensor, or this rank's part of it, into the previous
    // snapshot's buffers — from the live training buffers when this rank holds them (the next
    // update waits for the copy at the writer's gate), else from the gathers.
    let snap = {
        let compression = r.chunks[0].opt.compression_row();
        let sources = whole_state(&mut r.chunks, &r.applied, cfg.parallel.zero > 0);
        checkpoint::Job { part, state, layout: r.ckpt.layout.clone(), sources, compression, tokenizer_json: r.ckpt.tokenizer_json.clone(), to_disk }
    };
    if !lead {
        r.ckpt.writer.submit(snap)?;
        if done_at_end {
            r.ckpt.writer.finish()?;
        }
        return Ok(());
    }
    let snapshot_s = ck0.elapsed().as_secs_f64();
    let done = r.ckpt.writer.submit(snap)?;
    if cfg.checkpoint.mtbf_s > 0.0 && to_disk {
        // Young/Daly: the interval that minimises expected lost plus checkpointing time is
        // sqrt(2 · cost · MTBF); the cost to training is the snapshot (plus the write when it
        // is not in the background).
        let write = if cfg.checkpoint.background { 0.0 } else { done.as_ref().map_or(0.0, |d| d.write_s) };
        let times = &r.ckpt.step_times;
        let mut recent = times[times.len().saturating_sub(20)..].to_vec();
        recent.sort_by(f64::total_cmp);
        let step_s = recent.get(recent.len() / 2).copied().unwrap_or(1.0).max(1e-9);
        r.ckpt.auto_interval = Some(((2.0 * (snapshot_s + write) * cfg.checkpoint.mtbf_s).sqrt() / step_s).round().max(1.0) as u64);
    }
    // At the end, the write just submitted finishes too: both are reported.
    let mut done: Vec<checkpoint::Saved> = done.into_iter().collect();
    if done_at_end {
        done.extend(r.ckpt.writer.finish()?);
    }
    let mut line = serde_json::json!({"kind": "checkpoint", "step": step, "snapshot_s": snapshot_s, "background": cfg.checkpoint.background, "disk": to_disk});
    if let Some(st) = &r.ckpt.replicas {
        line["memory_held_bytes"] = st.held_bytes(rank).into();
    }
    if let Some(i) = r.ckpt.auto_interval {
        line["next_interval"] = i.into();
    }
    r.log(line)?;
    for d in &done {
        r.log(serde_json::json!({"kind": "checkpoint", "step": d.step, "write_s": d.write_s}))?;
    }
    if let (Some(d), true) = (done.last(), done_at_end) {
        r.say(&format!("checkpoint saved: {}", d.dir.display()));
    }
    Ok(())
}

/// The whole parameters and moments (mixed precision: the fp32 master weights; LoRA: the
/// adapters): borrowed when this rank holds them, else gathered from the ZeRO shards, the
/// tensor- and expert-parallel ranks and the pipeline stages (collective).
/// The live buffers are read by the checkpoint writer behind its gate (`checkpoint::Source`).
fn whole_state(chunks: &mut [Chunk], applied: &Applied, zero: bool) -> [checkpoint::Source; 3] {
    use checkpoint::Source;
    let plain = !zero && !applied.is_part();
    if chunks[0].model.lora.is_some() || plain {
        let ch = &mut chunks[0];
        let p = match (&ch.model.lora, &ch.opt.master) {
            (Some(lo), _) => Source::live(&lo.params),
            (None, Some(Master::F32(mw))) => Source::live(mw),
            (None, Some(Master::Low(low))) => Source::live_split(ch.dp.local_params(), low),
            (None, None) => Source::live(ch.dp.local_params()),
        };
        return match &ch.opt.lean {
            // Converted as the snapshot copies it (no fp32 copy of the state beside it).
            Some(l) => [p, Source::LiveLean(l.view(false)), Source::LiveLean(l.view(true))],
            // Adafactor's statistics, expanded to the layout's second moment as the snapshot
            // is taken.
            None if ch.opt.factored.is_some() => [p, Source::Zeros, Source::Owned(ch.opt.moments_f32().1)],
            // Muon's compact second moment, expanded likewise.
            None if ch.opt.v_is_compact() => [p, Source::live(&ch.opt.m), Source::Owned(ch.opt.v_f32())],
            None if ch.opt.v.is_empty() => [p, Source::live(&ch.opt.m), Source::Zeros],
            None => [p, Source::live(&ch.opt.m), Source::live(&ch.opt.v)],
        };
    }
    let (mut ps, mut ms, mut vs) = (Vec::new(), Vec::new(), Vec::new());
    for ch in chunks.iter_mut() {
        ps.push(match &ch.opt.master {
            Some(mw) if zero => {
                let shard = mw.whole(&mut ch.dp);
                ch.dp.gather_shards_owned(shard)
            }
            Some(mw) => mw.whole(&mut ch.dp),
            None => ch.dp.full_params(),
        });
        let (m, v) = match (ch.opt.lean_moments_f32(), zero) {
            (Some((m, v)), true) => (ch.dp.gather_shards_owned(m), ch.dp.gather_shards_owned(v)),
            (Some(mv), false) => mv,
            (None, true) => {
                let (m, v) = ch.opt.moments_f32();
                (ch.dp.gather_shards_owned(m), ch.dp.gather_shards_owned(v))
            }
            (None, false) => ch.opt.moments_f32(),
        };
        ms.push(m);
        vs.push(v);
    }
    let w = |bufs| Source::Owned(applied.gather_whole(bufs));
    [w(ps), w(ms), w(vs)]
}
