//! `kiln train`: config → data → ranks → each rank's run ([`rank`]: set-up, the loop, the
//! finish) with periodic evaluation, metrics, checkpoints, Ctrl-C handling, and a sample at the
//! end. The loop's parts live beside it: the step's data ([`data`]), evaluation ([`eval`]),
//! faults ([`faults`]), metrics lines ([`metrics`]) and checkpoint requests ([`ckpt`]).
//!
//! Determinism: the batch sampler is one seeded RNG drawn in a fixed order for the *global*
//! batch; dropout masks are keyed by `(seed, step, micro-step)`; every kernel reduces in a fixed
//! order. A run is a pure function of its config, so a resumed run (which restores the sampler
//! state, parameters and moments) continues bit for bit.

mod ckpt;
mod data;
pub(crate) mod elastic;
mod eval;
mod faults;
pub(crate) mod grpo;
mod metrics;
pub(crate) mod prefs;
mod rank;

pub use self::data::{doc_opts, fill_rows, load_data, Loader, Piece, Row, Source, TrainData};
pub use crate::checkpoint::{Cursor, LoaderState};
pub use crate::step::RowBuf;
pub use self::eval::{eval_sums, evaluate, EvalBatches};
#[cfg(feature = "vulkan")]
pub use self::eval::evaluate_on_device;
pub use crate::config::TrainArgs;

use self::data::check_data_fits;
use self::rank::Rank;
use crate::checkpoint;
use crate::config::{layered, Backend, RunConfig, STRUCTURAL_KEYS};
use crate::error::{user, KilnError, Result};
use crate::presets;
use crate::run::{self, ckpt_dir};
use ::data::Tokenizer;
use parallel::Comm;
use model::{Gpt, Sampler};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

pub struct Summary {
    pub run_dir: PathBuf,
    pub step: u64,
    pub val_loss: Option<f64>,
    pub interrupted: bool,
    /// Stopped at a checkpoint for an elastic resize (ranks came back): not the run's end.
    pub regrow: bool,
}

/// The structural keys on which two configs differ.
fn incompatible(a: &RunConfig, b: &RunConfig) -> Vec<String> {
    let (ra, rb) = (a.to_raw(), b.to_raw());
    STRUCTURAL_KEYS
        .iter()
        .filter(|k| ra.get(**k) != rb.get(**k))
        .map(|k| format!("{k} = {} in the run, {} now", ra.get(*k).map_or("-".into(), |v| v.to_string()), rb.get(*k).map_or("-".into(), |v| v.to_string())))
        .collect()
}


/// A `kiln train` command resolved once, at its edge ([`resolve`]): the run's config (the
/// preset's or the saved run's, the config file, `--set`, the dedicated flags), its run
/// directory and its lock, whether it resumes, and the keys the user set. The trainer, the
/// supervisor and an elastic resize take this, never the raw arguments again.
pub struct Resolved {
    pub args: TrainArgs,
    pub cfg: RunConfig,
    pub run_dir: PathBuf,
    pub resume: bool,
    pub explicit: std::collections::BTreeSet<String>,
    /// One writer per run directory, held from before anything in it was read.
    _lock: run::RunLock,
}

/// Resolves `kiln train`'s arguments: everything is checked before anything is written. (A
/// fine-tune with no preset named runs under `finetune`, and its directory says so.)
pub fn resolve(args: &TrainArgs) -> Result<Resolved> {
    let preset_name = args.preset.clone().unwrap_or_else(|| presets::resolve(args).map_or_else(|_| "tiny".into(), |c| c.preset));
    let run_dir = match (&args.out, args.resume) {
        (Some(d), _) => d.clone(),
        (None, true) => run::latest_run(args.preset.as_deref())?,
        (None, false) => run::default_run_dir(&preset_name),
    };
    let saved_cfg_path = run_dir.join("config.toml");
    let lock = run::lock(&run_dir)?;
    let cfg = if args.resume {
        if !saved_cfg_path.exists() {
            return user(format!("--resume: {} is not a kiln run directory (no config.toml)", run_dir.display()));
        }
        let saved = RunConfig::load(&saved_cfg_path)?;
        let cfg = layered(&saved, &TrainArgs { preset: None, ..args.clone() })?;
        if let Some(p) = &args.preset {
            if p != &saved.preset {
                return user(format!("--resume: {} was made with preset `{}`, not `{p}`", run_dir.display(), saved.preset));
            }
        }
        if saved.optim.name != cfg.optim.name {
            use plan::policy::Names;
            return user(format!("--resume: {} holds {} state, which optim.name = {} cannot continue from (one optimizer's state does not load into another)", run_dir.display(), saved.optim.name.name(), cfg.optim.name.name()));
        }
        let diff = incompatible(&saved, &cfg);
        if !diff.is_empty() {
            return user(format!("--resume: {} has an incompatible config: {}", run_dir.display(), diff.join("; ")));
        }
        cfg
    } else {
        let cfg = presets::resolve(args)?;
        if saved_cfg_path.exists() || !checkpoint::list(&ckpt_dir(&run_dir)).is_empty() {
            return user(format!("{} already holds a run: pass --resume to continue it, or choose another --out", run_dir.display()));
        }
        cfg
    };
    let explicit = crate::config::user_keys(args)?;
    Ok(Resolved { args: args.clone(), cfg, run_dir, resume: args.resume, explicit, _lock: lock })
}

/// Runs a resolved `kiln train`. A numerical-fault rollback restarts it from the newest valid
/// checkpoint (at most 10 times), skipping the batches the rollback marked, with the config the
/// run saved.
pub fn train(mut r: Resolved, stop: &AtomicBool) -> Result<Summary> {
    for _ in 0..10 {
        match train_once(&r, stop) {
            Err(KilnError::Rollback(msg, run_dir)) => {
                if checkpoint::list(&ckpt_dir(&run_dir)).is_empty() {
                    return Err(KilnError::Internal(format!("{msg}, but {} has no checkpoint to roll back to", run_dir.display())));
                }
                eprintln!("{msg}: rolling back to the newest valid checkpoint");
                r.cfg = RunConfig::load(&run_dir.join("config.toml"))?;
                r.resume = true;
                (r.args.resume, r.args.out, r.args.preset) = (true, Some(run_dir), None);
            }
            res => return res,
        }
    }
    Err(KilnError::Internal("rolled back 10 times: giving up".into()))
}

/// A base model's own tokenizer, the default when the run starts from one and `data.tokenizer`
/// was not given (`kiln train` and `kiln memory` alike).
pub fn base_tokenizer(cfg: &RunConfig, explicit: &std::collections::BTreeSet<String>) -> Result<Option<Tokenizer>> {
    if cfg.model.init_from.is_empty() || explicit.contains("data.tokenizer") {
        return Ok(None);
    }
    Ok(Tokenizer::find_in(Path::new(&cfg.model.init_from))?)
}

fn train_once(r: &Resolved, stop: &AtomicBool) -> Result<Summary> {
    let (args, run_dir, explicit) = (&r.args, r.run_dir.clone(), &r.explicit);
    let saved_cfg_path = run_dir.join("config.toml");
    let mut cfg = r.cfg.clone();
    // A run killed before its first checkpoint starts again from step 0 (a supervisor's
    // restart); one whose checkpoints all fail verification is an error.
    let resume_from = match r.resume && !checkpoint::list(&ckpt_dir(&run_dir)).is_empty() {
        true => Some(checkpoint::latest_valid(&ckpt_dir(&run_dir))?),
        false => {
            if r.resume {
                eprintln!("{}: no checkpoint yet: starting from step 0", run_dir.display());
            }
            None
        }
    };
    // A base model's config fixes the model's shape.
    // What loading the base holds at most, counted by the allocator (its own bytes: the peak
    // over what was live before it).
    let before = crate::memory::track::current().0;
    crate::memory::track::reset_peaks();
    let init = adopt_init(&mut cfg, explicit, resume_from.is_some())?;
    let base_load = init.as_ref().map(|_| crate::memory::track::peaks().0.saturating_sub(before) as u64);

    crate::util::init_threads(cfg.train.threads);
    parallel::cp::set_device_clock(cfg.parallel.cp_clock == crate::config::CpClock::Device);

    // 2. Data.
    // A resumed run keeps its tokenizer; a run started from another kiln run keeps that run's
    // (its token ids are what the base model knows).
    // A base model's own tokenizer is the default; --tokenizer (data.tokenizer) overrides it.
    let tokenizer = match &resume_from {
        Some(l) => Some(Tokenizer::from_json(&l.tokenizer_json, &l.dir.join(Tokenizer::file_name_of_json(&l.tokenizer_json)))?.with_config_in(&run_dir)?),
        None => base_tokenizer(&cfg, explicit)?,
    };
    // The resolved config names the tokenizer that ran: the base model's, when it was taken
    // (replaying `config.toml` then tokenizes the same way).
    if resume_from.is_none() && tokenizer.is_some() && !explicit.contains("data.tokenizer") && Path::new(&cfg.model.init_from).join("tokenizer.json").is_file() {
        cfg.data.tokenizer = cfg.model.init_from.clone();
    }
    // Prepared data records the format it was made from: the resolved config says it, so `kiln
    // eval --run` and a replay read documents the same way.
    if resume_from.is_none() && !explicit.contains("data.format") {
        adopt_prepared_format(&mut cfg);
    }
    let ds = load_data(&cfg, tokenizer)?;
    check_data_fits(&mut cfg, &ds, explicit)?;
    if cfg.train.objective.pairs().is_some() {
        prefs::check_pairs_fit(&cfg, &ds)?;
    }
    let gcfg = cfg.gpt_config(ds.tokenizer.vocab_size());
    cfg.model.vocab_size = gcfg.vocab_size;
    if cfg.train.device != "cpu" {
        #[cfg(feature = "vulkan")]
        if let Some(why) = crate::device_step::refusal(&cfg).or_else(|| model::device::unsupported_config(&gcfg)) {
            return user(why);
        }
        #[cfg(not(feature = "vulkan"))]
        return user(format!("train.device = {}: this kiln was built without the device backend (rebuild with the default features, or `--features vulkan`)", cfg.train.device));
    }
    // memory: refuse a run whose plan exceeds memory.limit or the memory available, before
    // anything is written.
    crate::memory::plan_checked(&cfg, &gcfg, ds.in_memory_bytes())?;

    // 3. The ranks: this process alone, threads in it, or MPI processes.
    let world = cfg.parallel.world(cfg.parallel.dp);
    if cfg.faults.elastic_min > 0 {
        // The per-rank share a resize may not exceed is fixed now, and saved with the run.
        cfg.faults.elastic_rows = elastic::rows_cap(&cfg);
    }
    let mut ctx = Ctx { args, cfg, ds: &ds, run_dir, saved_cfg_path, resume_from, init: std::sync::Mutex::new(init), base_load, slots: Vec::new(), grow_at: None, restarted: false };
    match ctx.cfg.parallel.backend {
        Backend::Mpi => run_mpi(&mut ctx, stop),
        _ if world == 1 && ctx.cfg.faults.elastic_max <= 1 => {
            let comm = parallel::InProcess::world(1).pop().unwrap();
            run_rank(&ctx, &comm, stop, None, ctx.resume_from.as_ref())
        }
        _ => run_inproc(&mut ctx, world, stop),
    }
}

/// Starting from a base model (a kiln run or a Hugging Face directory): its config fixes the
/// model's shape (`cfg` adopts it, keys the user set in `explicit` kept). A resumed full
/// fine-tune reloads everything from its checkpoint (`resumed`); a LoRA run always needs its
/// base. Also settles `train.seq_len` and checks the layout against the base's model.
fn adopt_init(cfg: &mut RunConfig, explicit: &std::collections::BTreeSet<String>, resumed: bool) -> Result<Option<Gpt>> {
    let init = if !cfg.model.init_from.is_empty() && (!resumed || cfg.lora.rank > 0) {
        let base_dir = Path::new(&cfg.model.init_from);
        let hf = !base_dir.join("config.toml").exists();
        // QLoRA from a Hugging Face directory: the shape now, the weights later, read tensor by
        // tensor straight into the quantized store (`rank::quantize_base`), so the fp32 base
        // never exists whole.
        let m = if hf && cfg.lora.quantize_base != model::BaseQuant::None {
            run::hf_shell(base_dir)?
        } else if cfg.lora.rank > 0 {
            run::load_frozen_base(base_dir)?
        } else {
            run::load_base(base_dir)?
        };
        let from = cfg.model.init_from.clone();
        *cfg = crate::config::adopt_base(cfg, &m.cfg, hf, explicit, &from)?;
        // A base's context can be 131072 positions: train at most 1024 unless told.
        if cfg.train.seq_len == 0 {
            cfg.train.seq_len = cfg.model.block_size.min(1024);
        }
        Some(m)
    } else {
        None
    };
    if cfg.train.seq_len == 0 {
        cfg.train.seq_len = cfg.model.block_size;
    }
    // The layout against the base's model (`validate` could not know it), for a new run and a
    // resumed one alike.
    if !cfg.model.init_from.is_empty() {
        cfg.validate_against_base()?;
    }
    Ok(init)
}

/// `data.format` as the prepared data records it, when every path was prepared from the same
/// format.
fn adopt_prepared_format(cfg: &mut RunConfig) {
    let dirs: Vec<&str> = cfg.data.paths.iter().map(String::as_str).chain(cfg.data.sources.iter().map(|s| s.path.as_str())).collect();
    let formats: Vec<Option<::data::DocFormat>> = dirs.iter().map(|d| ::data::prepared_format(Path::new(d))).collect();
    if let Some(Some(f)) = formats.first().filter(|_| formats.windows(2).all(|w| w[0] == w[1])) {
        cfg.data.format = crate::config::Format(*f);
    }
}

/// Everything a rank needs from the set-up (shared by the in-process ranks).
pub(crate) struct Ctx<'a> {
    args: &'a TrainArgs,
    cfg: RunConfig,
    ds: &'a TrainData,
    run_dir: PathBuf,
    saved_cfg_path: PathBuf,
    resume_from: Option<checkpoint::Loaded>,
    /// The base model (`model.init_from`), for rank 0; the others receive its weights.
    init: std::sync::Mutex<Option<Gpt>>,
    /// Each rank's original number, by rank (empty: the ranks are their own): an elastic
    /// resize renumbers the live ranks.
    slots: Vec<usize>,
    /// Elastic growth: the step from which lost ranks are back (`faults.rejoin_step`).
    grow_at: Option<u64>,
    /// A restart in process (after a failure or a resize): the metrics past the restored step
    /// are dropped, even when it starts over from step 0.
    restarted: bool,
    /// The bytes loading the base held at most (the counting allocator's, when it is installed).
    pub(crate) base_load: Option<u64>,
}

/// `world` ranks as threads of this process. A rank that fails makes the others' collectives
/// abort; the first failure is returned (a user error keeps its exit code). With in-memory
/// checkpoints (`checkpoint.memory_interval`), a failed run restarts here, every rank from
/// the newest step whose parts are all still in memory (a failed rank's from its peer's),
/// else from the newest valid checkpoint on disk, up to `faults.max_rank_restarts` times.
/// Elastic (`faults.elastic_min` > 0): a rank lost for good (`faults.fail_permanent`) is left
/// out and the live ranks go on at the largest layout they can run ([`elastic::layout_for`]);
/// lost ranks that come back (`faults.rejoin_step`) rejoin at the next disk checkpoint.
fn run_inproc(ctx: &mut Ctx, world: usize, stop: &AtomicBool) -> Result<Summary> {
    let mut world = world;
    let mut store = (ctx.cfg.checkpoint.memory_interval > 0).then(|| checkpoint::ReplicaStore::new(world));
    let mut restored: Option<checkpoint::Loaded> = None;
    let mut restarts = 0;
    // Original rank numbers: live (by current rank) and out of the world.
    let mut pool = elastic::Ranks::new(world);
    ctx.slots = pool.live.clone();
    let log = |run_dir: &Path, line: serde_json::Value| crate::obs::append_line(run_dir, &line).map_err(KilnError::User);
    loop {
        let resume = restored.as_ref().or(ctx.resume_from.as_ref());
        let failed: std::sync::Mutex<Option<KilnError>> = std::sync::Mutex::new(None);
        let res = {
            let ctx = &*ctx;
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                parallel::run_ranks(world, |c| {
                    match run_rank(ctx, c, stop, store.as_ref(), resume) {
                        Ok(s) => s,
                        Err(e) => {
                            let msg = e.to_string();
                            // A failed rank's memory is gone (its writer has finished: dropped).
                            if let (KilnError::RankFailed { .. }, Some(st)) = (&e, &store) {
                                st.lose(c.rank());
                            }
                            failed.lock().unwrap().get_or_insert(e);
                            panic!("rank {} stopped: {msg}", c.rank());
                        }
                    }
                })
            }))
        };
        let err = match (failed.into_inner().unwrap(), res) {
            (None, Ok(mut v)) => {
                let s = v.swap_remove(0);
                if !s.regrow {
                    return Ok(s);
                }
                // Lost ranks are back: every rank resumes from the checkpoint just written,
                // at the layout the ranks now live can run.
                let (back, layout) = pool.rejoin(&ctx.cfg)?;
                let to = pool.live.len();
                log(&ctx.run_dir, serde_json::json!({"kind": "fault", "step": s.step, "event": "rank_rejoined", "ranks": back}))?;
                resize(ctx, layout, world, s.step, s.step, 0.0, "disk")?;
                eprintln!("ranks {back:?} rejoined: {world} → {to} ranks (dp {}, {} micro-batches) from the checkpoint of step {}", layout.dp, layout.grad_accum, s.step);
                ctx.slots = pool.live.clone();
                ctx.grow_at = None;
                world = to;
                store = store.map(|_| checkpoint::ReplicaStore::new(world));
                restored = Some(checkpoint::latest_valid(&ckpt_dir(&ctx.run_dir))?);
                reload_base(ctx)?;
                ctx.restarted = true;
                continue;
            }
            (Some(e), _) => e,
            (None, Err(p)) => {
                let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                KilnError::Internal(format!("a data-parallel rank failed: {msg}"))
            }
        };
        let permanent = ctx.cfg.faults.fail_permanent && matches!(err, KilnError::RankFailed { .. });
        let elastic = ctx.cfg.faults.elastic_min > 0;
        // User errors and rollbacks are not rank failures; without in-memory checkpoints a
        // failure ends the process (a supervisor restarts it from disk), unless the run is
        // elastic (it goes on without the lost rank, from disk).
        let recoverable = matches!(err, KilnError::Internal(_) | KilnError::RankFailed { .. }) && (store.is_some() || (elastic && permanent));
        if !recoverable || stop.load(Ordering::SeqCst) {
            return Err(err);
        }
        if permanent && !elastic {
            return Err(KilnError::Internal(format!("{err}, for good (faults.fail_permanent), and the run is not elastic (--elastic MIN:MAX): stopping; the newest valid checkpoint is intact")));
        }
        restarts += 1;
        let give_up = restarts > ctx.cfg.faults.max_rank_restarts;
        let (step, together) = record_failure(ctx, &err, permanent, (restarts, give_up))?;
        if give_up {
            return Err(KilnError::Internal(format!("ranks failed {restarts} times, the last: {err}")));
        }
        if let Some(st) = &store {
            for s in &together {
                if let Some(i) = ctx.slots.iter().position(|x| x == s) {
                    st.lose(i);
                }
            }
        }
        let t0 = Instant::now();
        let (from, why);
        (restored, from, why) = restore_point(store.as_deref(), &ctx.run_dir)?;
        let at = restored.as_ref().map_or(0, |l| l.state.step);
        if permanent {
            let KilnError::RankFailed { rank, .. } = err else { unreachable!() };
            let gone: Vec<usize> = ctx.slots.iter().copied().filter(|s| *s == rank || together.contains(s)).collect();
            let layout = pool.lose(&ctx.cfg, &gone).map_err(|e| KilnError::User(format!("rank {rank} lost for good at step {step}: {e}")))?;
            ctx.slots = pool.live.clone();
            let to = pool.live.len();
            eprintln!("elastic: {world} → {to} ranks (dp {}, {} micro-batches per step) from {from} at step {at}", layout.dp, layout.grad_accum);
            resize(ctx, layout, world, step, at, t0.elapsed().as_secs_f64(), from)?;
            world = to;
            store = store.map(|_| checkpoint::ReplicaStore::new(world));
            let f = &ctx.cfg.faults;
            ctx.grow_at = (f.rejoin_step > 0 && layout.dp < f.elastic_max).then_some(f.rejoin_step);
        } else {
            eprintln!("restoring every rank from {} at step {at}{}", if from == "memory" { "in-memory snapshots" } else { "disk" }, why.as_ref().map_or(String::new(), |w| format!(" ({w})")));
            let mut line = serde_json::json!({"kind": "fault", "step": step, "event": "restored", "from": from, "restored_step": at, "lost_steps": step.saturating_sub(at + 1), "restore_s": t0.elapsed().as_secs_f64()});
            if let Some(w) = why {
                line["why_not_memory"] = w.into();
            }
            log(&ctx.run_dir, line)?;
        }
        reload_base(ctx)?;
        ctx.restarted = true;
    }
}

/// A rank failure's `fault` line in the metrics: the step it failed at, and every rank
/// injected to fail there with it, which are returned (`restarts` so far, and whether the run
/// gives up).
fn record_failure(ctx: &Ctx, err: &KilnError, permanent: bool, (restarts, give_up): (u32, bool)) -> Result<(u64, Vec<usize>)> {
    let step = match err {
        KilnError::RankFailed { step, .. } => *step,
        _ => fs::read_to_string(ctx.run_dir.join("heartbeat")).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0),
    };
    let rank = if let KilnError::RankFailed { rank, .. } = err { serde_json::json!(rank) } else { serde_json::Value::Null };
    eprintln!("{err}{}", if give_up { ": no restarts left" } else if permanent { ": lost for good, going on without it" } else { ": restarting the ranks" });
    // Every rank injected to fail at this step has failed (and lost its memory), whether or
    // not it reached the step before the first failure stopped the world.
    let together = match err {
        KilnError::RankFailed { step, .. } => faults::Faults::failed_together(&ctx.cfg.faults, &ctx.run_dir, *step),
        _ => Vec::new(),
    };
    let mut ranks: Vec<usize> = together.clone();
    if let KilnError::RankFailed { rank, .. } = err {
        ranks.push(*rank);
    }
    ranks.sort_unstable();
    ranks.dedup();
    let event = if permanent { "rank_lost" } else { "rank_failed" };
    crate::obs::append_line(&ctx.run_dir, &serde_json::json!({"kind": "fault", "step": step, "event": event, "rank": rank, "ranks": ranks, "detail": err.to_string(), "restart": restarts, "gave_up": give_up})).map_err(KilnError::User)?;
    Ok((step, together))
}

/// Where the ranks restart from: the in-memory snapshots (`store`), else the newest valid
/// checkpoint on disk (none: step 0), with where, and why not from memory.
fn restore_point(store: Option<&checkpoint::ReplicaStore>, run_dir: &Path) -> Result<(Option<checkpoint::Loaded>, &'static str, Option<String>)> {
    match store.map(|st| st.restore()) {
        Some(Ok(l)) => Ok((Some(l), "memory", None)),
        other => {
            let dir = ckpt_dir(run_dir);
            let restored = if checkpoint::list(&dir).is_empty() { None } else { Some(checkpoint::latest_valid(&dir)?) };
            Ok((restored, "disk", other.and_then(|r| r.err())))
        }
    }
}

/// An elastic resize: `ctx`'s config at `layout`, and its `world_resized` line (`step`: where
/// the old world stopped; `at`: the state the new one starts from).
fn resize(ctx: &mut Ctx, layout: elastic::Layout, from: usize, step: u64, at: u64, restore_s: f64, source: &str) -> Result<()> {
    let old = (ctx.cfg.parallel.dp, ctx.cfg.train.grad_accum);
    ctx.cfg = elastic::resized(&ctx.cfg, layout);
    ctx.cfg.validate()?;
    let line = serde_json::json!({
        "kind": "fault", "step": step, "event": "world_resized", "from": from, "to": ctx.cfg.parallel.world(layout.dp),
        "dp_from": old.0, "dp_to": layout.dp, "grad_accum_from": old.1, "grad_accum_to": layout.grad_accum,
        "restored_step": at, "lost_steps": step.saturating_sub(at + 1), "from_state": source, "restore_s": restore_s,
    });
    crate::obs::append_line(&ctx.run_dir, &line).map_err(KilnError::User)
}

/// A LoRA run needs its base model again after a restart.
fn reload_base(ctx: &Ctx) -> Result<()> {
    if ctx.cfg.lora.rank > 0 {
        *ctx.init.lock().unwrap() = Some(run::load_frozen_base(Path::new(&ctx.cfg.model.init_from))?);
    }
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_ctx: &mut Ctx, _stop: &AtomicBool) -> Result<Summary> {
    user("parallel.backend = mpi: this kiln was built without MPI support; rebuild with `cargo build --release --features mpi` (needs OpenMPI: apt-get install libopenmpi-dev openmpi-bin libclang-dev clang) and run it under mpirun")
}

#[cfg(feature = "mpi")]
fn run_mpi(ctx: &mut Ctx, stop: &AtomicBool) -> Result<Summary> {
    let world = parallel::mpi::init().map_err(KilnError::User)?;
    let comm = world.world();
    let n = comm.size();
    let (tp, pp, ep, cp) = (ctx.cfg.parallel.tp, ctx.cfg.parallel.pp, ctx.cfg.parallel.ep, ctx.cfg.parallel.cp);
    let dp = ctx.cfg.parallel.dp;
    let other = ctx.cfg.parallel.per_dp();
    if n % other != 0 || (dp != 0 && dp * other != n) {
        let want = if dp == 0 { format!("a multiple of parallel.tp × parallel.pp × parallel.ep × parallel.cp = {other}") } else { format!("pp {pp} × dp {dp} × ep {ep} × cp {cp} × tp {tp} = {}", dp * other) };
        return user(format!("parallel.dp = {dp} but mpirun started {n} processes, not {want}: pass --dp {} (or --dp 0 to take the MPI world size)", n / other.max(1)));
    }
    ctx.cfg.check_dp(n / other)?;
    let me = comm.rank();
    if !ctx.args.slots.is_empty() {
        if ctx.args.slots.len() != n {
            return Err(KilnError::Internal(format!("--elastic-slots lists {} ranks, but mpirun started {n}", ctx.args.slots.len())));
        }
        ctx.slots = ctx.args.slots.clone();
        let f = &ctx.cfg.faults;
        // Growth only brings back ranks that were lost.
        ctx.grow_at = (f.elastic_min > 0 && f.rejoin_step > 0 && n / other < f.elastic_max && !ctx.args.lost.is_empty()).then_some(f.rejoin_step);
        let slot = ctx.slots[me];
        // Debug (`faults.fail_permanent`): a failed rank's host never answers again (until
        // `faults.rejoin_step`): its process joins no collective, so the others wait.
        let fired = ctx.run_dir.join(format!("faults-fired-rank{slot}-step{}", f.fail_step)).exists();
        let at = ctx.resume_from.as_ref().map_or(0, |l| l.state.step);
        if f.fail_permanent && f.fail_ranks.contains(&slot) && fired && (f.rejoin_step == 0 || at < f.rejoin_step) {
            loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        }
        // For the supervisor: this rank's host is up.
        crate::util::write_atomic(&ctx.run_dir.join(format!("{}{slot}", elastic::SLOT_BEAT)), b"up")?;
    }
    // Every process has checked the run directory before rank 0 creates it.
    comm.barrier();
    let out = run_rank(ctx, &comm, stop, None, ctx.resume_from.as_ref());
    if let Err(e @ KilnError::RankFailed { .. }) = &out {
        // An injected failure is a crash: the process goes without finalizing MPI (which would
        // wait for the others), and the launcher takes the world down.
        eprintln!("{e}");
        std::process::exit(1);
    }
    drop(comm);
    drop(world);
    out
}

/// One rank's training run, from `resume_from` (a checkpoint, or in-memory snapshots) when
/// given; with `replicas`, snapshots are also kept in memory.
fn run_rank(ctx: &Ctx, comm: &dyn parallel::Comm, stop: &AtomicBool, replicas: Option<&std::sync::Arc<checkpoint::ReplicaStore>>, resume_from: Option<&checkpoint::Loaded>) -> Result<Summary> {
    Rank::setup(ctx, comm, stop, replicas, resume_from)?.run()
}

/// Prompt plus generated continuation, decoded.
pub fn sample_text(model: &Gpt, tok: &Tokenizer, prompt: &str, n: usize, temperature: f32, top_k: usize, seed: u64) -> Result<String> {
    let ids = tok.encode(prompt)?;
    let out = model.generate(&ids, n, &Sampler::new(temperature, top_k, seed));
    let mut all = ids;
    all.extend(out);
    Ok(tok.decode(&all))
}
