//! The training loop: config → data → model → steps (micro-batches, clipping, AdamW, schedule)
//! with periodic evaluation, metrics, checkpoints, Ctrl-C handling, and a sample at the end.
//!
//! Determinism: the batch sampler is one seeded RNG drawn in a fixed order for the *global*
//! batch; dropout masks are keyed by `(seed, step, micro-step)`; every kernel reduces in a fixed
//! order. A run is a pure function of its config, so a resumed run (which restores the sampler
//! state, parameters and moments) continues bit for bit.

use crate::checkpoint::{self, TrainState};
use crate::config::{self, Raw, RunConfig, STRUCTURAL_KEYS};
use crate::error::{io_err, user, KilnError, Result};
use crate::presets;
use crate::progress::{fmt_duration, Progress, StepInfo};
use crate::run::{self, ckpt_dir, write_atomic};
use data::{Dataset, Tokenizer, Tokens};
use parallel::Comm;
use model::gpt::IGNORE_INDEX;
use model::{Gpt, Pass, Sampler};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tensor::rng::mix64;
use crate::step::{hardware_flops_per_token, model_flops_per_token, train_step, trainable, trainable_layout, Chunk, Optimizer, StepOut};
use tensor::Rng;

#[derive(Clone, Debug, Default)]
pub struct TrainArgs {
    pub preset: Option<String>,
    pub config: Option<PathBuf>,
    pub data: Vec<PathBuf>,
    pub out: Option<PathBuf>,
    pub set: Vec<String>,
    pub max_steps: Option<u64>,
    pub resume: bool,
    pub seed: Option<u64>,
    pub init_from: Option<PathBuf>,
    pub lora_rank: Option<usize>,
    pub lora_alpha: Option<f64>,
    pub lora_targets: Option<String>,
    /// Record a trace of this many steps into `trace.json`.
    pub profile: Option<u64>,
    pub dp: Option<usize>,
    pub zero: Option<usize>,
    pub tp: Option<usize>,
    /// Expert-parallel ranks (`parallel.ep`).
    pub ep: Option<usize>,
    /// Pipeline flags: `parallel.pp`, `train.grad_accum` (the micro-batches),
    /// `parallel.schedule`, `parallel.virtual_stages`, `parallel.pp_layers` (comma-separated),
    /// `parallel.pp_trace`.
    pub pp: Option<usize>,
    pub sequence_parallel: bool,
    pub micro_batches: Option<usize>,
    pub schedule: Option<String>,
    pub virtual_stages: Option<usize>,
    pub pp_layers: Option<String>,
    pub pp_trace: Option<String>,
    pub offload: Option<String>,
    pub backend: Option<String>,
    pub quiet: bool,
}

pub struct Summary {
    pub run_dir: PathBuf,
    pub step: u64,
    pub val_loss: Option<f64>,
    pub interrupted: bool,
}

/// Builds the raw config from a base and the user's overrides, in order: file, `--set`,
/// then the dedicated flags (`--data`, `--max-steps`, `--seed`).
pub(crate) fn layered(base: &RunConfig, args: &TrainArgs) -> Result<RunConfig> {
    let mut raw: Raw = base.to_raw();
    if let Some(p) = &args.config {
        config::apply_file(&mut raw, p)?;
    }
    for kv in &args.set {
        config::apply_set(&mut raw, kv)?;
    }
    if !args.data.is_empty() {
        let paths = args.data.iter().map(|p| toml::Value::String(p.display().to_string())).collect();
        raw.insert("data.paths".into(), toml::Value::Array(paths));
    }
    if let Some(n) = args.max_steps {
        raw.insert("train.max_steps".into(), toml::Value::Integer(n as i64));
    }
    if let Some(s) = args.seed {
        raw.insert("train.seed".into(), toml::Value::Integer(s as i64));
    }
    if let Some(p) = &args.init_from {
        raw.insert("model.init_from".into(), toml::Value::String(p.display().to_string()));
    }
    if let Some(d) = args.dp {
        raw.insert("parallel.dp".into(), toml::Value::Integer(d as i64));
    }
    if let Some(z) = args.zero {
        raw.insert("parallel.zero".into(), toml::Value::Integer(z as i64));
    }
    if let Some(o) = &args.offload {
        raw.insert("memory.offload".into(), toml::Value::String(o.clone()));
    }
    if let Some(t) = args.tp {
        raw.insert("parallel.tp".into(), toml::Value::Integer(t as i64));
    }
    if args.sequence_parallel {
        raw.insert("parallel.sequence_parallel".into(), toml::Value::Boolean(true));
    }
    let int = |x: usize| toml::Value::Integer(x as i64);
    for (key, v) in [("parallel.pp", args.pp), ("parallel.ep", args.ep), ("train.grad_accum", args.micro_batches), ("parallel.virtual_stages", args.virtual_stages)] {
        if let Some(v) = v {
            raw.insert(key.into(), int(v));
        }
    }
    for (key, v) in [("parallel.schedule", &args.schedule), ("parallel.pp_trace", &args.pp_trace)] {
        if let Some(v) = v {
            raw.insert(key.into(), toml::Value::String(v.clone()));
        }
    }
    if let Some(l) = &args.pp_layers {
        let mut list = Vec::new();
        for x in l.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            let n: usize = x.parse().map_err(|_| KilnError::User(format!("--pp-layers: `{x}` is not a layer count (expected e.g. 3,3,2)")))?;
            list.push(int(n));
        }
        raw.insert("parallel.pp_layers".into(), toml::Value::Array(list));
    }
    if let Some(b) = &args.backend {
        raw.insert("parallel.backend".into(), toml::Value::String(b.clone()));
    }
    if let Some(r) = args.lora_rank {
        raw.insert("lora.rank".into(), toml::Value::Integer(r as i64));
    }
    if let Some(a) = args.lora_alpha {
        raw.insert("lora.alpha".into(), toml::Value::Float(a));
    }
    if let Some(t) = &args.lora_targets {
        let list = t.split(',').map(|s| toml::Value::String(s.trim().to_string())).filter(|v| v.as_str() != Some("")).collect();
        raw.insert("lora.targets".into(), toml::Value::Array(list));
    }
    RunConfig::resolve(&raw)
}

/// Loads the training data for `cfg` (its paths, or the Rust books) with `tokenizer` when the
/// run already has one (resume), else the configured tokenizer spec.
pub fn load_data(cfg: &RunConfig, tokenizer: Option<Tokenizer>) -> Result<Dataset> {
    let frac = cfg.data.val_fraction;
    if cfg.data.paths.is_empty() {
        let (text, files) = data::default_corpus()?;
        let tok = match tokenizer {
            Some(t) => t,
            None => Tokenizer::from_spec(&cfg.data.tokenizer, Some(&text))?,
        };
        let ids = tok.encode(&text);
        let n_train = ((ids.len() as f64) * (1.0 - frac)) as usize;
        let description = format!("the Rust books ({} files, {} tokens, {} tokenizer, vocab {})", files.len(), ids.len(), tok.kind(), tok.vocab_size());
        return Ok(Dataset { val: Tokens::from_vec(ids[n_train..].to_vec()), train: Tokens::from_vec(ids[..n_train].to_vec()), tokenizer: tok, description, files, skipped: 0 });
    }
    let paths: Vec<PathBuf> = cfg.data.paths.iter().map(PathBuf::from).collect();
    Ok(match tokenizer {
        Some(t) => data::load_with(&paths, t, frac)?,
        None => data::load(&paths, &cfg.data.tokenizer, frac)?,
    })
}

fn data_name(cfg: &RunConfig) -> String {
    if cfg.data.paths.is_empty() { "the default corpus".into() } else { cfg.data.paths.join(", ") }
}

/// Checks the data against the model: enough tokens for one window in each split, and a
/// model vocabulary that covers the tokenizer's.
fn check_data_fits(cfg: &RunConfig, ds: &Dataset) -> Result<()> {
    let bs = cfg.model.block_size;
    for (split, toks) in [("training", &ds.train), ("validation", &ds.val)] {
        if toks.len() <= bs + 1 {
            return user(format!(
                "model.block_size ({bs}) is larger than the {split} split of {} ({} tokens): use a smaller block_size or more data",
                data_name(cfg), toks.len()
            ));
        }
    }
    if cfg.model.vocab_size != 0 && cfg.model.vocab_size < ds.tokenizer.vocab_size() {
        return user(format!("model.vocab_size ({}) is smaller than the {} tokenizer's vocabulary ({})", cfg.model.vocab_size, ds.tokenizer.kind(), ds.tokenizer.vocab_size()));
    }
    Ok(())
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

/// Draws the sequence start offsets of one global batch.
fn sample_offsets(rng: &mut Rng, n_tokens: usize, t: usize, count: usize) -> Vec<usize> {
    (0..count).map(|_| rng.below((n_tokens - t) as u64) as usize).collect()
}

fn fill_windows(toks: &Tokens, offsets: &[usize], t: usize, x: &mut [u32], y: &mut [i32]) {
    let mut buf = vec![0u32; t + 1];
    for (i, &o) in offsets.iter().enumerate() {
        toks.copy_to(o, &mut buf);
        x[i * t..(i + 1) * t].copy_from_slice(&buf[..t]);
        for j in 0..t {
            y[i * t + j] = buf[j + 1] as i32;
        }
    }
}

/// Which evaluation batches a rank runs: non-overlapping windows of `t` tokens of the split,
/// `batch` windows at a time, at most `max_batches` batches (0 = all); rank `rank` of `ranks`
/// takes batches `rank, rank + ranks, …` (every rank runs the same number of forwards,
/// padding with fully ignored batches, since ZeRO-3's forward is collective).
#[derive(Clone, Copy, Debug)]
pub struct EvalBatches {
    pub t: usize,
    pub batch: usize,
    pub max_batches: usize,
    pub rank: usize,
    pub ranks: usize,
}

/// Mean loss over the evaluation windows of the split (see [`EvalBatches`], one rank).
/// Returns (loss, tokens counted).
pub fn evaluate(m: &mut Gpt, toks: &Tokens, t: usize, batch: usize, max_batches: usize) -> (f64, usize) {
    let (sum, count) = eval_sums(m, None, toks, EvalBatches { t, batch, max_batches, rank: 0, ranks: 1 });
    (sum / count.max(1) as f64, count)
}

/// This rank's share of [`evaluate`]. Returns (sum of losses, tokens counted), to be summed over
/// ranks.
pub fn eval_sums(m: &mut Gpt, mut store: Option<&mut dyn model::UnitStore>, toks: &Tokens, eb: EvalBatches) -> (f64, usize) {
    eval_batches(toks, eb, |x, y| {
        match store.as_deref_mut() {
            Some(s) => m.forward_with(s, x, y, eb.batch, eb.t, Pass::Eval),
            None => m.forward(x, y, eb.batch, eb.t, Pass::Eval),
        };
        m.losses().iter().map(|&l| l as f64).sum::<f64>()
    })
}

/// [`eval_sums`] through a pipeline: each batch runs forward through every virtual stage in
/// turn (this rank's chunks `c` are stages `c·p + me`), activations passed on; the losses
/// come out of the last stage, whose ranks alone return a nonzero sum.
fn eval_sums_pipeline(chunks: &mut [Chunk], pp: &dyn Comm, me: usize, toks: &Tokens, eb: EvalBatches) -> (f64, usize) {
    let (p, v) = (pp.size(), chunks.len());
    let (batch, t) = (eb.batch, eb.t);
    eval_batches(toks, eb, |x, y| {
        let mut sum = 0.0;
        for vs in (0..p * v).filter(|vs| vs % p == me) {
            let ch = &mut chunks[vs / p];
            if vs > 0 {
                pp.recv(ch.model.stage_input_mut(batch, t), (vs - 1) % p, (1 << 20) + vs as u32);
            }
            ch.model.forward_with(&mut ch.dp, x, y, batch, t, Pass::Eval);
            if vs + 1 < p * v {
                pp.send(ch.model.stage_output(), (vs + 1) % p, (1 << 20) + vs as u32 + 1);
            } else {
                sum = ch.model.losses().iter().map(|&l| l as f64).sum::<f64>();
            }
        }
        sum
    })
}

/// The evaluation batches `eb` of `toks`, each given to `forward` (which returns its sum of
/// losses). Returns (sum of losses, tokens counted).
fn eval_batches(toks: &Tokens, eb: EvalBatches, mut forward: impl FnMut(&[u32], &[i32]) -> f64) -> (f64, usize) {
    let EvalBatches { t, batch, max_batches, rank, ranks: n } = eb;
    let n_windows = (toks.len() - 1) / t;
    let mut offsets: Vec<usize> = (0..n_windows).map(|k| k * t).collect();
    if max_batches > 0 {
        offsets.truncate(max_batches * batch);
    }
    let batches: Vec<&[usize]> = offsets.chunks(batch).collect();
    let rounds = batches.len().div_ceil(n);
    let (mut x, mut y) = (vec![0u32; batch * t], vec![0i32; batch * t]);
    let (mut sum, mut count) = (0.0f64, 0usize);
    for k in 0..rounds {
        let chunk: &[usize] = batches.get(k * n + rank).copied().unwrap_or(&[]);
        x.fill(0);
        y.fill(IGNORE_INDEX);
        fill_windows(toks, chunk, t, &mut x, &mut y);
        sum += forward(&x, &y);
        count += chunk.len() * t;
    }
    (sum, count)
}

/// This process's peak resident set (`VmHWM`) since [`reset_peak_rss`], in bytes (Linux).
fn peak_rss() -> Option<u64> {
    let s = fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = s.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

/// Restarts the peak-resident-set count (Linux `clear_refs` 5), so the training loop's peak is
/// not the start-up's (the matmul peak probe's large products).
fn reset_peak_rss() {
    let _ = fs::write("/proc/self/clear_refs", "5");
}

/// The steps whose batches a rollback marked as offending (`RUN/skipped_steps.json`).
fn load_skips(run_dir: &Path) -> std::collections::BTreeSet<u64> {
    fs::read(run_dir.join("skipped_steps.json")).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
}

/// Runs `kiln train`. A numerical-fault rollback restarts it from the newest valid checkpoint
/// (at most 10 times), skipping the batches the rollback marked.
pub fn train(args: &TrainArgs, stop: &AtomicBool) -> Result<Summary> {
    let mut a = args.clone();
    for _ in 0..10 {
        match train_once(&a, stop) {
            Err(KilnError::Rollback(msg, run_dir)) => {
                if checkpoint::list(&ckpt_dir(&run_dir)).is_empty() {
                    return Err(KilnError::Internal(format!("{msg}, but {} has no checkpoint to roll back to", run_dir.display())));
                }
                eprintln!("{msg}: rolling back to the newest valid checkpoint");
                (a.resume, a.out, a.preset) = (true, Some(run_dir), None);
            }
            r => return r,
        }
    }
    Err(KilnError::Internal("rolled back 10 times: giving up".into()))
}

fn train_once(args: &TrainArgs, stop: &AtomicBool) -> Result<Summary> {
    // 1. Config and run directory: everything is checked before anything is written.
    let preset_name = args.preset.clone().unwrap_or_else(|| "tiny".into());
    let run_dir = match (&args.out, args.resume) {
        (Some(d), _) => d.clone(),
        (None, true) => run::latest_run(args.preset.as_deref())?,
        (None, false) => run::default_run_dir(&preset_name),
    };
    let saved_cfg_path = run_dir.join("config.toml");
    let mut resume_from = None;
    let mut cfg = if args.resume {
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
        let diff = incompatible(&saved, &cfg);
        if !diff.is_empty() {
            return user(format!("--resume: {} has an incompatible config: {}", run_dir.display(), diff.join("; ")));
        }
        // A run killed before its first checkpoint starts again from step 0 (a supervisor's
        // restart); one whose checkpoints all fail verification is an error.
        if checkpoint::list(&ckpt_dir(&run_dir)).is_empty() {
            eprintln!("{}: no checkpoint yet: starting from step 0", run_dir.display());
        } else {
            resume_from = Some(checkpoint::latest_valid(&ckpt_dir(&run_dir))?);
        }
        cfg
    } else {
        let cfg = layered(&presets::preset(&preset_name)?, args)?;
        if saved_cfg_path.exists() || !checkpoint::list(&ckpt_dir(&run_dir)).is_empty() {
            return user(format!("{} already holds a run: pass --resume to continue it, or choose another --out", run_dir.display()));
        }
        cfg
    };
    // Starting from a base model (a kiln run or a Hugging Face directory): its config fixes the
    // model's shape. A resumed full fine-tune reloads everything from its checkpoint; a LoRA
    // run always needs its base.
    let init = if !cfg.model.init_from.is_empty() && (resume_from.is_none() || cfg.lora.rank > 0) {
        let m = run::load_base(Path::new(&cfg.model.init_from))?;
        let (mc, hc) = (&mut cfg.model, &m.cfg);
        (mc.n_expert, mc.top_k, mc.n_shared_expert) = (hc.n_expert, hc.top_k, hc.n_shared_expert);
        mc.arch = if hc.arch == model::config::Arch::Llama { "llama".into() } else { "gpt2".into() };
        (mc.n_layer, mc.n_head, mc.n_kv_head, mc.n_embd, mc.ffn_hidden, mc.block_size, mc.vocab_size, mc.bias, mc.tied_embeddings) =
            (hc.n_layer, hc.n_head, hc.n_kv_head, hc.n_embd, hc.ffn_hidden, hc.block_size, hc.vocab_size, hc.bias, hc.tied_embeddings);
        (mc.rope_theta, mc.norm_eps) = (hc.rope_theta as f64, hc.norm_eps as f64);
        Some(m)
    } else {
        None
    };

    crate::cli::init_threads(cfg.train.threads);

    // 2. Data.
    // A resumed run keeps its tokenizer; a run started from another kiln run keeps that run's
    // (its token ids are what the base model knows).
    let base_tok = Path::new(&cfg.model.init_from).join("tokenizer.json");
    let tokenizer = match &resume_from {
        Some(l) => Some(Tokenizer::from_json(&l.tokenizer_json, &l.dir.join("tokenizer.json"))?),
        None if !cfg.model.init_from.is_empty() && base_tok.exists() => Some(Tokenizer::load(&base_tok)?),
        None => None,
    };
    let ds = load_data(&cfg, tokenizer)?;
    check_data_fits(&cfg, &ds)?;
    let gcfg = cfg.gpt_config(ds.tokenizer.vocab_size());
    cfg.model.vocab_size = gcfg.vocab_size;
    // memory: refuse a run whose plan exceeds memory.limit, before anything is written (issue 7).
    crate::memory::plan_run(&cfg, &gcfg, &ds)?.check_limit()?;

    // 3. The ranks: this process alone, threads in it, or MPI processes.
    let world = cfg.parallel.dp * cfg.parallel.ep * cfg.parallel.tp * cfg.parallel.pp;
    let ctx = Ctx { args, cfg, ds: &ds, run_dir, saved_cfg_path, resume_from, init: std::sync::Mutex::new(init) };
    match ctx.cfg.parallel.backend.as_str() {
        "mpi" => run_mpi(&ctx, stop),
        _ if world == 1 => {
            let comm = parallel::InProcess::world(1).pop().unwrap();
            run_rank(&ctx, &comm, stop, None, ctx.resume_from.as_ref())
        }
        _ => run_inproc(&ctx, world, stop),
    }
}

/// Everything a rank needs from the set-up (shared by the in-process ranks).
struct Ctx<'a> {
    args: &'a TrainArgs,
    cfg: RunConfig,
    ds: &'a Dataset,
    run_dir: PathBuf,
    saved_cfg_path: PathBuf,
    resume_from: Option<checkpoint::Loaded>,
    /// The base model (`model.init_from`), for rank 0; the others receive its weights.
    init: std::sync::Mutex<Option<Gpt>>,
}

/// `world` ranks as threads of this process. A rank that fails makes the others' collectives
/// abort; the first failure is returned (a user error keeps its exit code). With in-memory
/// checkpoints (`checkpoint.memory_interval`), a failed run restarts here, every rank from
/// the newest step whose parts are all still in memory (a failed rank's from its peer's),
/// else from the newest valid checkpoint on disk, up to `faults.max_rank_restarts` times.
fn run_inproc(ctx: &Ctx, world: usize, stop: &AtomicBool) -> Result<Summary> {
    let store = (ctx.cfg.checkpoint.memory_interval > 0).then(|| checkpoint::ReplicaStore::new(world));
    let mut restored: Option<checkpoint::Loaded> = None;
    let mut restarts = 0;
    loop {
        let resume = restored.as_ref().or(ctx.resume_from.as_ref());
        let failed: std::sync::Mutex<Option<KilnError>> = std::sync::Mutex::new(None);
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            parallel::run_ranks(world, |c| {
                match run_rank(ctx, c, stop, store.as_ref(), resume) {
                    Ok(s) => s,
                    Err(e) => {
                        let msg = e.to_string();
                        // A failed rank's memory is gone (its writer has finished: dropped).
                        if let (KilnError::RankFailed { rank, .. }, Some(st)) = (&e, &store) {
                            st.lose(*rank);
                        }
                        failed.lock().unwrap().get_or_insert(e);
                        panic!("rank {} stopped: {msg}", c.rank());
                    }
                }
            })
        }));
        let err = match (failed.into_inner().unwrap(), res) {
            (None, Ok(mut v)) => return Ok(v.swap_remove(0)),
            (Some(e), _) => e,
            (None, Err(p)) => {
                let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                KilnError::Internal(format!("a data-parallel rank failed: {msg}"))
            }
        };
        // User errors and rollbacks are not rank failures; without in-memory checkpoints a
        // failure ends the process (a supervisor restarts it from disk).
        let (Some(st), KilnError::Internal(_) | KilnError::RankFailed { .. }) = (&store, &err) else { return Err(err) };
        if stop.load(Ordering::SeqCst) {
            return Err(err);
        }
        restarts += 1;
        let give_up = restarts > ctx.cfg.faults.max_rank_restarts;
        let step = match &err {
            KilnError::RankFailed { step, .. } => *step,
            _ => fs::read_to_string(ctx.run_dir.join("heartbeat")).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0),
        };
        let rank = if let KilnError::RankFailed { rank, .. } = &err { serde_json::json!(rank) } else { serde_json::Value::Null };
        eprintln!("{err}{}", if give_up { ": no restarts left" } else { ": restarting the ranks" });
        let log = |line: serde_json::Value| match crate::obs::MetricsWriter::open(&ctx.run_dir, None) {
            Ok(mut m) => m.log(&line).map_err(KilnError::User),
            Err(e) => Err(KilnError::User(e)),
        };
        log(serde_json::json!({"kind": "fault", "step": step, "event": "rank_failed", "rank": rank, "detail": err.to_string(), "restart": restarts, "gave_up": give_up}))?;
        if give_up {
            return Err(KilnError::Internal(format!("ranks failed {restarts} times, the last: {err}")));
        }
        let t0 = Instant::now();
        let (from, why) = match st.restore() {
            Ok(l) => {
                restored = Some(l);
                ("memory", None)
            }
            Err(why) => {
                let dir = ckpt_dir(&ctx.run_dir);
                restored = if checkpoint::list(&dir).is_empty() { None } else { Some(checkpoint::latest_valid(&dir)?) };
                ("disk", Some(why))
            }
        };
        let at = restored.as_ref().map_or(0, |l| l.state.step);
        eprintln!("restoring every rank from {} at step {at}{}", if from == "memory" { "in-memory snapshots" } else { "disk" }, why.as_ref().map_or(String::new(), |w| format!(" ({w})")));
        let mut line = serde_json::json!({"kind": "fault", "step": step, "event": "restored", "from": from, "restored_step": at, "lost_steps": step.saturating_sub(at + 1), "restore_s": t0.elapsed().as_secs_f64()});
        if let Some(w) = why {
            line["why_not_memory"] = w.into();
        }
        log(line)?;
        // A LoRA run needs its base model again.
        if ctx.cfg.lora.rank > 0 {
            *ctx.init.lock().unwrap() = Some(run::load_base(Path::new(&ctx.cfg.model.init_from))?);
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_ctx: &Ctx, _stop: &AtomicBool) -> Result<Summary> {
    user("parallel.backend = mpi: this kiln was built without MPI support; rebuild with `cargo build --release --features mpi` (needs OpenMPI: apt-get install libopenmpi-dev openmpi-bin libclang-dev clang) and run it under mpirun")
}

#[cfg(feature = "mpi")]
fn run_mpi(ctx: &Ctx, stop: &AtomicBool) -> Result<Summary> {
    let world = parallel::mpi::init().map_err(KilnError::User)?;
    let comm = world.world();
    let n = comm.size();
    let (tp, pp, ep) = (ctx.cfg.parallel.tp, ctx.cfg.parallel.pp, ctx.cfg.parallel.ep);
    let dp = ctx.cfg.parallel.dp;
    let other = tp * pp * ep;
    if n % other != 0 || (dp != 0 && dp * other != n) {
        let want = if dp == 0 { format!("a multiple of parallel.tp × parallel.pp × parallel.ep = {other}") } else { format!("pp {pp} × dp {dp} × ep {ep} × tp {tp} = {}", dp * other) };
        return user(format!("parallel.dp = {dp} but mpirun started {n} processes, not {want}: pass --dp {} (or --dp 0 to take the MPI world size)", n / other.max(1)));
    }
    ctx.cfg.check_dp(n / other)?;
    // Every process has checked the run directory before rank 0 creates it.
    comm.barrier();
    let out = run_rank(ctx, &comm, stop, None, ctx.resume_from.as_ref());
    drop(comm);
    drop(world);
    out
}

/// One rank's training run, from `resume_from` (a checkpoint, or in-memory snapshots) when
/// given. Rank 0 owns the run directory, metrics, progress, checkpoints and the sample; every
/// rank computes. With `replicas`, snapshots are also kept in memory.
fn run_rank(ctx: &Ctx, comm: &dyn parallel::Comm, stop: &AtomicBool, replicas: Option<&std::sync::Arc<checkpoint::ReplicaStore>>, resume_from: Option<&checkpoint::Loaded>) -> Result<Summary> {
    let (args, cfg, ds) = (ctx.args, &ctx.cfg, ctx.ds);
    let (run_dir, saved_cfg_path) = (&ctx.run_dir, &ctx.saved_cfg_path);
    let (rank, world) = (comm.rank(), comm.size());
    let lead = rank == 0;
    let counters = comm.counters();
    let gcfg = cfg.gpt_config(ds.tokenizer.vocab_size());
    let t = cfg.model.block_size;
    let mb = cfg.micro_batch();
    let (tpn, ppn, vn, epn) = (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.virtual_stages, cfg.parallel.ep);
    let dpn = world / (tpn * ppn * epn);
    let zero = cfg.parallel.zero as u8;
    let stages = cfg.stage_layers(ds.tokenizer.vocab_size())?;
    let pipelined = stages.len() > 1;
    let strategy = parallel::apply::Strategy {
        pp: ppn, dp: dpn, ep: epn, tp: tpn, virtual_stages: vn, stages: stages.clone(),
        sequence_parallel: cfg.parallel.sequence_parallel, zero,
        bucket_elems: ((cfg.parallel.bucket_mb * 1024.0 * 1024.0 / 4.0) as usize).max(1),
        micro_batch: mb, recompute: cfg.recompute(), recompute_every: cfg.model.recompute_every,
        precision: cfg.precision(), fp8_amax_history: cfg.train.fp8_amax_history,
    };

    // Model, optimizer state, sampler.
    let init = if lead { ctx.init.lock().unwrap().take() } else { None };
    let mut model = match init {
        Some(mut m) => {
            m.cfg.dropout = gcfg.dropout;
            m.real_vocab = ds.tokenizer.vocab_size();
            m
        }
        // Tensor-parallel and pipeline ranks each cut their part from the base.
        None if !cfg.model.init_from.is_empty() && (tpn > 1 || pipelined || epn > 1) => {
            let mut m = run::load_base(Path::new(&cfg.model.init_from))?;
            m.cfg.dropout = gcfg.dropout;
            m.real_vocab = ds.tokenizer.vocab_size();
            m
        }
        // Other ranks receive rank 0's weights when the data-parallel store starts.
        None if !cfg.model.init_from.is_empty() => Gpt::zeroed(gcfg, ds.tokenizer.vocab_size()),
        None => Gpt::new(gcfg, ds.tokenizer.vocab_size(), cfg.train.seed),
    };
    model.recompute = cfg.recompute();
    model.recompute_every = cfg.model.recompute_every;
    if cfg.lora.rank > 0 {
        let l = &cfg.lora;
        model.lora = Some(model::lora::Lora::new(&model.cfg, l.rank, l.alpha as f32, &l.targets, cfg.train.seed).map_err(KilnError::User)?);
    }
    let n = model.num_params();
    let n_train = trainable_layout(&model).total;
    // MFU is stated against the same peak `kiln bench --peak` reports (one rank's share of the
    // machine's cores is what in-process ranks split, so the peak is the machine's), for the
    // whole model's FLOPs.
    let peak = if lead { crate::bench::peak_flops() } else { f64::NAN };
    let flops_per_token = model_flops_per_token(&model);
    let hw_flops_per_token = hardware_flops_per_token(&model);
    let mut sampler = Rng::new(mix64(cfg.train.seed ^ 0x5EED_DA7A));
    let (mut step, mut tokens_seen, mut elapsed_prev) = (0u64, 0u64, 0.0f64);
    let mut moments = None;
    // fp16's loss scale (restored with the checkpoint).
    let mut scaler = (cfg.precision() == model::gpt::Precision::Fp16).then_some(crate::step::LossScaler { scale: cfg.train.loss_scale, good: 0, window: cfg.train.loss_scale_window });
    if let Some(l) = resume_from {
        let layout = trainable_layout(&model).clone();
        checkpoint::read_into(&l.model, "", &layout, trainable(&mut model).0, &l.dir.join("model.safetensors"))?;
        let (mut m, mut v) = (vec![0.0; layout.total], vec![0.0; layout.total]);
        checkpoint::read_into(&l.optim, "exp_avg.", &layout, &mut m, &l.dir.join("optimizer.safetensors"))?;
        checkpoint::read_into(&l.optim, "exp_avg_sq.", &layout, &mut v, &l.dir.join("optimizer.safetensors"))?;
        moments = Some((m, v));
        scaler = l.state.loss_scale.or(scaler);
        sampler = Rng::from_state(l.state.sampler_rng);
        step = l.state.step;
        tokens_seen = l.state.tokens_seen;
        elapsed_prev = l.state.elapsed_s;
    }
    // This rank's chunks: its pipeline stages' layers (the whole model without a pipeline),
    // each cut to this rank's tensor- or expert-parallel shard, behind its data-parallel store
    // (`parallel::apply`); the moments are cut the same way.
    let recompute = model.recompute;
    let (parts, applied) = parallel::apply::parallelize(model, &strategy, comm).map_err(KilnError::User)?;
    let moments: Vec<Option<(Vec<f32>, Vec<f32>)>> = match moments {
        Some((m, v)) => applied.cut(m).into_iter().zip(applied.cut(v)).map(Some).collect(),
        None => parts.iter().map(|_| None).collect(),
    };
    let groups = &applied.groups;
    let (dp_rank, pp_rank) = (groups.dp_rank, groups.pp_rank);
    let (tp_comm, pp_comm, tie_comm) = (&*groups.tp, &*groups.pp, &*groups.tie);
    // `dpn` below: the ranks that split the batch (dp × ep).
    let dpn = groups.dp_size;
    let rows = mb / dpn;
    let (whole_cfg, full_layout) = (applied.whole.clone(), applied.full_layout.clone());
    let mut chunks: Vec<Chunk> = Vec::new();
    for (c, (part, mv)) in parts.into_iter().zip(moments).enumerate() {
        let parallel::apply::Part { model: m, mut dp, replicated, seq_partial } = part;
        let mut opt = if m.lora.is_some() { Optimizer::new(trainable_layout(&m)) } else { Optimizer::with_len(&m.layout, dp.moments_len()) };
        if let Some((mm, vv)) = mv {
            let sharded = m.lora.is_none() && zero > 0;
            let (mm, vv) = if sharded { (dp.shards.take(&mm), dp.shards.take(&vv)) } else { (mm, vv) };
            (opt.m, opt.v) = (crate::step::Moments::Mem(mm), crate::step::Moments::Mem(vv));
        }
        // Mixed precision: the fp32 weights (fresh or from the checkpoint) become the master
        // copy and the working parameters are rounded.
        if let Some(fmt) = m.precision.storage() {
            opt.mixed(&mut dp, fmt);
        }
        if let (Some(st), Some(h)) = (m.fp8.as_ref(), resume_from.and_then(|l| l.state.fp8_amax.as_ref())) {
            // The checkpoint holds the whole model's histories; a stage takes its layers'.
            st.borrow_mut().set_history_from_layer(h, m.cfg.first_layer());
        }
        if cfg.memory.offload == "optimizer" {
            let dir = run_dir.join("offload").join(if vn > 1 { format!("rank{rank}-chunk{c}") } else { format!("rank{rank}") });
            opt.offload(&dir).map_err(|e| io_err(&dir, e))?;
        }
        chunks.push(Chunk { model: m, dp, opt, replicated, seq_partial, pool: Vec::new() });
    }
    // memory: charge the model state to its tracking categories (issue 7).
    chunks.iter_mut().for_each(|ch| crate::memory::attribute(&ch.model, &mut ch.dp, &ch.opt));
    // The run directory.
    let tok_json = ds.tokenizer.to_json();
    let mut metrics = None;
    if lead {
        fs::create_dir_all(ckpt_dir(run_dir)).map_err(|e| io_err(run_dir, e))?;
        for p in checkpoint::remove_partial(&ckpt_dir(run_dir)) {
            eprintln!("removed a partial checkpoint a stopped writer left: {}", p.display());
        }
        write_atomic(saved_cfg_path, cfg.to_toml().as_bytes())?;
        write_atomic(&run_dir.join("tokenizer.json"), tok_json.as_bytes())?;
        // metrics.jsonl and TensorBoard event files; a resumed run drops the lines past its checkpoint.
        metrics = Some(crate::obs::MetricsWriter::open(run_dir, (args.resume || replicas.is_some()).then_some(step)).map_err(KilnError::User)?);
    }


    let max_steps = cfg.train.max_steps;
    let progress = Progress::new(step, max_steps, args.quiet || !lead);
    let say = |s: &str| if !args.quiet && lead { progress.println(s) };
    say(&format!(
        "kiln: {} | {:.2}M parameters{} | {} | run dir {}",
        cfg.preset, n as f64 / 1e6,
        if n_train < n { format!(" ({:.3}M trainable, {:.2}%: LoRA rank {})", n_train as f64 / 1e6, 100.0 * n_train as f64 / n as f64, cfg.lora.rank) } else { String::new() },
        ds.description, run_dir.display()
    ));
    if world > 1 {
        say(&format!("parallel: {world} ranks ({}): pp {ppn} × dp {} × ep {epn} × tp {tpn}, ZeRO stage {zero}, {rows} sequences per data-parallel rank per micro-batch", cfg.parallel.backend, dpn / epn));
    }
    // memory: the plan, before step 0 (issue 7).
    say(crate::memory::plan_run(cfg, &whole_cfg, ds)?.table().trim_end());
    if pipelined {
        let layers: Vec<usize> = stages.iter().map(|r| r.len()).collect();
        say(&format!("pipeline: {} schedule, {} micro-batches, {vn} chunk(s) per rank; layers per stage {layers:?}", cfg.parallel.schedule, cfg.train.grad_accum));
    }
    if let Some(l) = resume_from {
        say(&format!("resuming from {} (step {step})", l.dir.display()));
        // Where the run continues from (after a failure: the work lost is the steps done past it).
        if let Some(m) = metrics.as_mut() {
            m.log(&serde_json::json!({"kind": "resume", "step": step, "from": l.dir.display().to_string()})).map_err(KilnError::User)?;
        }
    }

    let started = Instant::now();
    let sched = parallel::pp::Schedule::new(parallel::pp::Kind::parse(&cfg.parallel.schedule).map_err(KilnError::User)?, ppn, cfg.train.grad_accum, vn).map_err(KilnError::User)?;
    let tied = whole_cfg.tied_embeddings && ppn > 1 && tie_comm.size() > 1;
    let mut pipe_trace = (cfg.parallel.pp_trace != "off").then(|| crate::step::PipeTrace { tasks: Vec::new(), exclusive: cfg.parallel.pp_trace == "device" });
    if pipe_trace.is_some() {
        let dir = run_dir.join("pipeline");
        fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
    }
    let mut last_val = None;
    let mut interrupted = false;
    // Checkpoints hold the whole model (or the adapters alone).
    let layout = chunks[0].model.lora.as_ref().map_or(&full_layout, |lo| &lo.layout).clone();

    reset_peak_rss();
    crate::memory::track::reset_peaks();
    let mut trace_until = args.profile.map(|n| step + n);
    if trace_until.is_some() {
        if lead {
            tensor::profile::trace(true);
        }
        // The other ranks start their first traced step only once rank 0 has turned tracing on.
        if world > 1 {
            parallel::comm::sum_f64(comm, 0.0);
        }
    }
    // Checkpoint interval: fixed, or (checkpoint.mtbf_s) chosen after each checkpoint from its
    // measured cost; the first comes at checkpoint.interval (or step 10) to measure it.
    let mut step_times: Vec<f64> = Vec::new();
    let mut auto_interval: Option<u64> = None;
    let mut auto_next = (cfg.checkpoint.mtbf_s > 0.0).then(|| step + if cfg.checkpoint.interval > 0 { cfg.checkpoint.interval } else { 10 });
    if let k @ 1.. = cfg.faults.kill_in_write_step {
        *checkpoint::KILL_IN_WRITE.lock().unwrap() = Some((k, run_dir.join(format!("faults-fired-kill-in-write-step{k}"))));
    }
    let mut writer = checkpoint::Writer::new(ckpt_dir(run_dir), cfg.checkpoint.keep, cfg.checkpoint.keep_every, cfg.checkpoint.background);
    if let Some(st) = replicas {
        writer = writer.with_replicas(st.clone(), rank);
    }
    let gate = writer.gate();
    let wait_for_snapshot = || gate.wait();
    // Numerical faults: batches a rollback marked, the recent applied losses (for spikes), and
    // the run of consecutive skipped updates.
    let marked = load_skips(run_dir);
    let fc = &cfg.faults;
    let mut recent: std::collections::VecDeque<f64> = std::collections::VecDeque::new();
    let mut skipped_run: Vec<u64> = Vec::new();
    while step < max_steps {
        // faults.fail_ranks: this rank fails here, once per run (a marker file remembers it).
        if fc.fail_step == step + 1 && fc.fail_ranks.contains(&rank) {
            let marker = run_dir.join(format!("faults-fired-rank{rank}-step{}", step + 1));
            if run::fire_once(&marker) {
                return Err(KilnError::RankFailed { rank, step: step + 1 });
            }
        }
        let t0 = Instant::now();
        let step_span = tensor::profile::scope("step");
        let lr = cfg.lr_at(step);
        let offsets = sample_offsets(&mut sampler, ds.train.len(), t, cfg.train.batch_size);
        let before = counters.snapshot();
        // memory: the activation buffers, allocated under their tracking category (a no-op once they fit).
        chunks.iter_mut().for_each(|ch| crate::memory::track::scope(crate::memory::track::Category::Activations, || ch.model.reserve_activations(rows, t)));
        let out = if marked.contains(&(step + 1)) {
            // Drawn (the sampler stays in step with the uninterrupted run) but not trained on.
            StepOut { loss: f32::NAN, grad_norm: f64::NAN, overlap: Default::default(), skipped: Some("batch marked by a rollback"), peak_activation_bytes: 0, peak_in_flight: 0 }
        } else {
            let spike = |loss: f32, _: f64| -> Option<&'static str> {
                if fc.spike_zscore <= 0.0 || recent.len() < fc.spike_window.max(2) {
                    return None;
                }
                let n = recent.len() as f64;
                let mean = recent.iter().sum::<f64>() / n;
                let sd = (recent.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0)).sqrt();
                ((loss as f64 - mean) > fc.spike_zscore * sd.max(1e-12)).then_some("loss spike")
            };
            let mut pipe = crate::step::Pipeline {
                sched: sched.clone(),
                rank: pp_rank,
                comm: (ppn > 1).then_some(&*pp_comm),
                tp: (tpn > 1).then_some(&*tp_comm),
                tie: tied.then_some(&*tie_comm),
                trace: pipe_trace.as_mut(),
                before_update: Some(&wait_for_snapshot),
                scaler: scaler.as_mut(),
            };
            train_step(&mut chunks, &mut pipe, cfg, step, |micro, x, y| {
                let first = micro * mb + dp_rank * rows;
                fill_windows(&ds.train, &offsets[first..first + rows], t, x, y);
            }, spike)
        };
        let comm_bytes = counters.snapshot().since(&before);
        let loss = out.loss;
        // The update waited for a background checkpoint still copying the training state.
        let blocked = gate.take_waited();
        if let (Some(m), true) = (metrics.as_mut(), blocked > 0.0) {
            m.log(&serde_json::json!({"kind": "checkpoint", "step": step + 1, "update_blocked_s": blocked})).map_err(KilnError::User)?;
        }
        // The pipeline trace: this rank's tasks, and the bubble against the step's makespan
        // over every stage (collective over the pipeline group).
        let mut bubble = None;
        if let Some(tr) = pipe_trace.as_mut().filter(|_| out.peak_in_flight > 0) {
            let end = if ppn > 1 { parallel::comm::all_gather_f64(&*pp_comm, &[tr.dev_end()]).into_iter().fold(0.0, f64::max) } else { tr.dev_end() };
            let b = tr.bubble(end);
            bubble = Some(b);
            let line = serde_json::json!({
                "step": step + 1, "rank": rank, "pp_rank": pp_rank, "schedule": cfg.parallel.schedule, "pp": ppn, "micro_batches": sched.m, "virtual_stages": vn,
                "clock": cfg.parallel.pp_trace, "bubble": b, "makespan_s": end,
                "peak_activation_bytes": out.peak_activation_bytes, "peak_in_flight": out.peak_in_flight, "tasks": tr.tasks,
            });
            let path = run_dir.join("pipeline").join(format!("rank-{rank:03}.jsonl"));
            let mut f = fs::OpenOptions::new().create(true).append(true).open(&path).map_err(|e| io_err(&path, e))?;
            use std::io::Write;
            writeln!(f, "{line}").map_err(|e| io_err(&path, e))?;
        }
        if out.skipped == Some(crate::step::FP16_OVERFLOW) {
            // fp16 loss scaling at work: not a fault of the run, never a reason to roll back.
            if let (Some(m), Some(sc)) = (metrics.as_mut(), &scaler) {
                m.log(&serde_json::json!({"kind": "fault", "step": step + 1, "event": "loss_scale_backoff", "loss_scale": sc.scale})).map_err(KilnError::User)?;
            }
        } else if let Some(why) = out.skipped {
            if why.starts_with("non-finite") && !fc.skip_nonfinite {
                return Err(KilnError::Internal(format!("loss is {loss}, gradient norm {} at step {}: stopping (the last checkpoint is intact)", out.grad_norm, step + 1)));
            }
            let step = step + 1;
            if let Some(metrics) = metrics.as_mut() {
                let f = |x: f64| if x.is_finite() { serde_json::json!(x) } else { serde_json::json!(x.to_string()) };
                let line = serde_json::json!({"kind": "fault", "step": step, "event": "update_skipped", "reason": why, "loss": f(loss as f64), "grad_norm": f(out.grad_norm)});
                metrics.log(&line).map_err(KilnError::User)?;
            }
            say(&format!("step {step}: update skipped ({why})"));
            if !marked.contains(&step) {
                skipped_run.push(step);
                if fc.max_consecutive_skips > 0 && skipped_run.len() >= fc.max_consecutive_skips {
                    if lead {
                        let mut all = marked.clone();
                        all.extend(skipped_run.iter().copied());
                        write_atomic(&run_dir.join("skipped_steps.json"), serde_json::to_string(&all).unwrap().as_bytes())?;
                        if let Some(metrics) = metrics.as_mut() {
                            metrics.log(&serde_json::json!({"kind": "fault", "step": step, "event": "rollback", "skip_steps": skipped_run})).map_err(KilnError::User)?;
                        }
                    }
                    return Err(KilnError::Rollback(format!("{} consecutive updates skipped (steps {skipped_run:?})", skipped_run.len()), run_dir.clone()));
                }
            }
        } else {
            skipped_run.clear();
            recent.push_back(loss as f64);
            if recent.len() > fc.spike_window.max(2) {
                recent.pop_front();
            }
        }
        step += 1;
        drop(step_span);
        let step_tokens = (cfg.train.batch_size * t) as u64;
        tokens_seen += step_tokens;
        let dt = t0.elapsed().as_secs_f64();
        let tps = step_tokens as f64 / dt;
        let mfu = flops_per_token * tps / peak;
        let elapsed = elapsed_prev + started.elapsed().as_secs_f64();
        // Every rank stops at the same step: any rank's Ctrl-C stops them all.
        let stop_here = stop.load(Ordering::SeqCst) as u8 as f64;
        interrupted = if world > 1 { parallel::comm::sum_f64(comm, stop_here) > 0.0 } else { stop_here > 0.0 };
        if let (Some(metrics), None) = (metrics.as_mut(), out.skipped) {
            let mut line = serde_json::json!({
                "kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": out.grad_norm,
                "tokens_per_sec": tps, "mfu": mfu, "elapsed_s": elapsed,
            });
            if recompute != model::gpt::Recompute::None {
                line["hfu"] = (hw_flops_per_token * tps / peak).into();
            }
            add_moe_stats(&mut line, chunks[0].model.moe_stats());
            if let Some(b) = bubble {
                line["pp_bubble"] = b.into();
            }
            if world > 1 {
                line["comm_bytes_sent"] = comm_bytes.bytes_sent().into();
                line["comm_bytes_recv"] = comm_bytes.bytes_recv().into();
                // And per collective, as the communicator counts them.
                for op in parallel::OPS {
                    let (calls, sent, _) = comm_bytes.get(op);
                    if calls > 0 {
                        line[format!("comm_bytes_sent_{}", op.name())] = sent.into();
                        line[format!("comm_calls_{}", op.name())] = calls.into();
                    }
                }
                line["comm_s"] = out.overlap.comm.as_secs_f64().into();
                line["comm_exposed_s"] = out.overlap.exposed.as_secs_f64().into();
                line["comm_hidden_fraction"] = out.overlap.hidden_fraction().into();
            }
            let (mut params_b, mut grads_b, mut transient_b, mut optim) = (0, 0, 0, 0);
            for ch in &chunks {
                let sb = ch.dp.state_bytes();
                let lora = ch.model.lora.as_ref().map_or(0, |lo| lo.params.len() * 4);
                (params_b, grads_b, transient_b) = (params_b + sb.params + lora, grads_b + sb.grads + lora, transient_b + sb.peak_transient);
                optim += (ch.opt.m.len() + ch.opt.v.len()) * 4;
            }
            line["mem_params_bytes"] = params_b.into();
            line["mem_grads_bytes"] = grads_b.into();
            let offloaded = matches!(chunks[0].opt.m, crate::step::Moments::File { .. });
            line["mem_optim_bytes"] = (if offloaded { 0 } else { optim }).into();
            if offloaded {
                line["mem_optim_offloaded_bytes"] = optim.into();
            }
            if let Some(hwm) = peak_rss() {
                line["mem_rss_peak_bytes"] = hwm.into();
            }
            line["mem_activations_bytes"] = out.peak_activation_bytes.into();
            if pipelined {
                line["pp_peak_in_flight"] = out.peak_in_flight.into();
            }
            line["mem_transient_peak_bytes"] = transient_b.into();
            crate::memory::track::log_peaks(&mut line);
            metrics.log(&line).map_err(KilnError::User)?;
        }
        if lead {
            // For `kiln train --supervise`: proof of life, with the step reached.
            // (Renamed into place, so a reader never sees a half-written file; not synced: a
            // heartbeat only matters while this process lives.)
            let hb = run_dir.join("heartbeat");
            let _ = fs::write(hb.with_extension("tmp"), step.to_string()).and_then(|_| fs::rename(hb.with_extension("tmp"), &hb));
        }
        let log_now = step % cfg.train.log_interval.max(1) == 0 || step == max_steps;
        if out.skipped.is_none() {
            progress.step(&StepInfo { step, loss, lr, tokens_per_sec: tps, mfu }, log_now);
        }

        let last = step == max_steps;
        let every = |k: u64| k > 0 && step % k == 0;
        if every(cfg.eval.interval) || last {
            let _p = tensor::profile::scope("eval");
            let eb = if cfg.eval.batch_size == 0 { mb } else { cfg.eval.batch_size };
            chunks.iter_mut().for_each(|ch| crate::memory::track::scope(crate::memory::track::Category::Activations, || ch.model.reserve_activations(eb, t)));
            let batches = EvalBatches { t, batch: eb, max_batches: cfg.eval.iters, rank: dp_rank, ranks: dpn };
            let (sum, count) = if pipelined {
                eval_sums_pipeline(&mut chunks, &*pp_comm, pp_rank, &ds.val, batches)
            } else {
                let ch = &mut chunks[0];
                eval_sums(&mut ch.model, Some(&mut ch.dp), &ds.val, batches)
            };
            let (sum, count) = if dpn > 1 {
                let r = chunks[vn - 1].dp.all_reduce_f64(&[sum, count as f64]);
                (r[0], r[1] as usize)
            } else {
                (sum, count)
            };
            // The losses are the last stage's.
            let sum = if ppn > 1 { parallel::comm::all_gather_f64(&*pp_comm, &[sum])[ppn - 1] } else { sum };
            let vl = sum / count.max(1) as f64;
            last_val = Some(vl);
            if let Some(metrics) = metrics.as_mut() {
                metrics.log(&serde_json::json!({"kind": "eval", "step": step, "val_loss": vl})).map_err(KilnError::User)?;
            }
            say(&format!("step {step}: train loss {loss:.4}, val loss {vl:.4}"));
        }
        step_times.push(dt);
        let due = match auto_next {
            Some(n) => step >= n,
            None => every(cfg.checkpoint.interval),
        };
        let to_disk = due || last || interrupted;
        // An in-memory snapshot between disk checkpoints waits for no disk write: while one is
        // still in flight on any rank, every rank skips it.
        let in_memory = !to_disk && replicas.is_some() && every(cfg.checkpoint.memory_interval) && {
            let busy = writer.writing_to_disk() as u8 as f64;
            let busy = if world > 1 { parallel::comm::sum_f64(comm, busy) } else { busy };
            if busy > 0.0 {
                if let Some(m) = metrics.as_mut() {
                    m.log(&serde_json::json!({"kind": "checkpoint", "step": step, "disk": false, "skipped": "a disk write is in flight"})).map_err(KilnError::User)?;
                }
            }
            busy == 0.0
        };
        if to_disk || in_memory {
            let _p = tensor::profile::scope("checkpoint");
            let ck0 = Instant::now();
            // With several ranks and whole-model weights, every rank writes its slice of every
            // tensor (a LoRA run's tiny adapters are written whole by rank 0).
            let fp8_hist = if pipelined && chunks[0].model.fp8.is_some() {
                Some(applied.fp8_histories(&chunks.iter().map(|c| &c.model).collect::<Vec<_>>()))
            } else {
                chunks[0].model.fp8.as_ref().map(|s| s.borrow().history())
            };
            let sharded = world > 1 && chunks[0].model.lora.is_none();
            let writes = lead || sharded;
            let plain = tpn == 1 && zero == 0 && !pipelined && epn == 1;
            // The whole parameters and moments: borrowed when this rank holds them, else gathered
            // from the shards, the tensor-parallel ranks and the pipeline stages (collective).
            use std::borrow::Cow;
            let lora = chunks[0].model.lora.is_some();
            let (fp, fm, fv): (Cow<[f32]>, Cow<[f32]>, Cow<[f32]>) = if lora || plain {
                let ch = &mut chunks[0];
                // Mixed precision checkpoints the fp32 master weights.
                let p = match (&ch.model.lora, &ch.opt.master) {
                    (Some(lo), _) => &lo.params[..],
                    (None, Some(mw)) => &mw[..],
                    (None, None) => ch.dp.local_params(),
                };
                (Cow::Borrowed(p), Cow::Borrowed(&ch.opt.m[..]), Cow::Borrowed(&ch.opt.v[..]))
            } else {
                let (mut ps, mut ms, mut vs) = (Vec::new(), Vec::new(), Vec::new());
                for ch in chunks.iter_mut() {
                    ps.push(match &ch.opt.master {
                        Some(mw) if zero > 0 => ch.dp.gather_shards(&mw[..]),
                        Some(mw) => mw.to_vec(),
                        None => ch.dp.full_params(),
                    });
                    let (m, v) = if zero > 0 { (ch.dp.gather_shards(&ch.opt.m), ch.dp.gather_shards(&ch.opt.v)) } else { (ch.opt.m.to_vec(), ch.opt.v.to_vec()) };
                    ms.push(m);
                    vs.push(v);
                }
                let w = |bufs| applied.gather_whole(bufs);
                (Cow::Owned(w(ps)), Cow::Owned(w(ms)), Cow::Owned(w(vs)))
            };
            let part = if sharded {
                // Rank 0 empties the shared temporary directory before anyone writes into it.
                let tmp = if lead && to_disk { Some(checkpoint::prepare_sharded(&ckpt_dir(run_dir), step)?) } else { None };
                if to_disk {
                    parallel::comm::sum_f64(comm, 0.0);
                }
                let shapes = layout.params.iter().flat_map(|p| ["", "exp_avg.", "exp_avg_sq."].map(|pre| (format!("{pre}{}", p.name), p.shape.clone()))).collect();
                Some(checkpoint::Part { rank, world, tmp: tmp.unwrap_or_else(|| ckpt_dir(run_dir).join(format!(".tmp-step-{step:08}-sharded"))), shapes })
            } else {
                None
            };
            // The writer copies all of each tensor, or this rank's part of it, into the previous
            // snapshot's buffers — from the live training buffers when this rank holds them
            // (the next update waits for the copy at the writer's gate), else from the gathers.
            let snap = writes.then(|| {
                let src = |c: Cow<[f32]>| match c {
                    Cow::Borrowed(x) => checkpoint::Source::live(x),
                    Cow::Owned(v) => checkpoint::Source::Owned(v),
                };
                let state = TrainState { step, sampler_rng: sampler.state(), tokens_seen, elapsed_s: elapsed, config: cfg.to_toml(), loss_scale: scaler, fp8_amax: fp8_hist.clone() };
                checkpoint::Job { part: part.clone(), state, layout: layout.clone(), sources: [src(fp), src(fm), src(fv)], tokenizer_json: tok_json.clone(), to_disk }
            });
            if !lead {
                if let Some(snap) = snap {
                    writer.submit(snap)?;
                    if interrupted || last {
                        writer.finish()?;
                    }
                }
            } else if let Some(snap) = snap {
                let snapshot_s = ck0.elapsed().as_secs_f64();
                let done = writer.submit(snap)?;
                if cfg.checkpoint.mtbf_s > 0.0 && to_disk {
                    // Young/Daly: the interval that minimises expected lost plus checkpointing
                    // time is sqrt(2 · cost · MTBF); the cost to training is the snapshot
                    // (plus the write when it is not in the background).
                    let write = if cfg.checkpoint.background { 0.0 } else { done.as_ref().map_or(0.0, |d| d.write_s) };
                    let mut recent = step_times[step_times.len().saturating_sub(20)..].to_vec();
                    recent.sort_by(f64::total_cmp);
                    let step_s = recent.get(recent.len() / 2).copied().unwrap_or(1.0).max(1e-9);
                    let interval = ((2.0 * (snapshot_s + write) * cfg.checkpoint.mtbf_s).sqrt() / step_s).round().max(1.0) as u64;
                    auto_interval = Some(interval);
                }
                // At the end, the write just submitted finishes too: both are reported.
                let mut done: Vec<checkpoint::Saved> = done.into_iter().collect();
                if interrupted || last {
                    done.extend(writer.finish()?);
                }
                if let Some(m) = metrics.as_mut() {
                    let mut line = serde_json::json!({"kind": "checkpoint", "step": step, "snapshot_s": snapshot_s, "background": cfg.checkpoint.background, "disk": to_disk});
                    if let Some(st) = replicas {
                        line["memory_held_bytes"] = st.held_bytes(rank).into();
                    }
                    if let Some(i) = auto_interval {
                        line["next_interval"] = i.into();
                    }
                    m.log(&line).map_err(KilnError::User)?;
                    for d in &done {
                        m.log(&serde_json::json!({"kind": "checkpoint", "step": d.step, "write_s": d.write_s})).map_err(KilnError::User)?;
                    }
                }
                if let (Some(d), true) = (done.last(), interrupted || last) {
                    say(&format!("checkpoint saved: {}", d.dir.display()));
                }
            }
            if let Some(next) = auto_next.as_mut().filter(|_| to_disk) {
                // Every rank takes rank 0's choice (the checkpoint is collective).
                let i = if world > 1 { parallel::comm::sum_f64(comm, auto_interval.unwrap_or(0) as f64) as u64 } else { auto_interval.unwrap_or(0) };
                *next = step + i.max(1);
            }
        }
        if lead && trace_until.is_some_and(|u| step >= u || step == max_steps || interrupted) {
            trace_until = None;
            tensor::profile::trace(false);
            crate::obs::trace::write_trace(run_dir, &tensor::profile::take_trace(), 0).map_err(KilnError::Internal)?;
            say(&format!("trace of steps {}..={step}: {}", step + 1 - args.profile.unwrap().min(step), run_dir.join("trace.json").display()));
        }
        if interrupted {
            break;
        }
    }
    progress.finish();
    writer.finish()?;
    let mut bufs = Vec::new();
    for Chunk { mut model, dp, .. } in chunks {
        dp.restore(&mut model);
        bufs.push(model);
    }
    let model = if applied.is_part() {
        // The whole model again, for the sample.
        let mut full = Gpt::zeroed(cfg.gpt_config(ds.tokenizer.vocab_size()), bufs[0].real_vocab);
        let params = bufs.iter_mut().map(|m| std::mem::take(&mut m.params)).collect();
        full.params = applied.gather_whole(params);
        full
    } else {
        bufs.pop().unwrap()
    };
    if !lead {
        return Ok(Summary { run_dir: run_dir.clone(), step, val_loss: last_val, interrupted });
    }
    if let Err(e) = crate::obs::write_loss_png(run_dir) {
        eprintln!("warning: loss.png: {e}");
    }
    let total = started.elapsed().as_secs_f64();
    if interrupted {
        eprintln!("interrupted: stopped cleanly at step {step}; continue with: kiln train --resume --out {}", run_dir.display());
    } else if !args.quiet {
        eprintln!("trained to step {step} in {}", fmt_duration(total));
    }

    // 4. A sample of what the model learned.
    if !interrupted && cfg.sample.tokens > 0 {
        let plain;
        let sampler_model = if model.lora.is_some() {
            plain = run::merged(&model);
            &plain
        } else {
            &model
        };
        let text = sample_text(sampler_model, &ds.tokenizer, &cfg.sample.prompt, cfg.sample.tokens, cfg.sample.temperature as f32, cfg.sample.top_k, cfg.train.seed);
        write_atomic(&run_dir.join("sample.txt"), text.as_bytes())?;
        // The sample is the run's product, so it goes to stdout even with --quiet.
        println!("--- sample (step {step}) ---\n{text}\n---");
    }
    Ok(Summary { run_dir: run_dir.clone(), step, val_loss: last_val, interrupted })
}

/// MoE routing figures of the last micro-batch, summed or worst over layers: the router
/// losses, the dropped-token fraction, max/mean tokens per expert, and per-expert load.
fn add_moe_stats(line: &mut serde_json::Value, stats: &[tensor::moe::MoeStats]) {
    if stats.is_empty() {
        return;
    }
    let aux: f32 = stats.iter().map(|s| s.aux_loss).sum::<f32>() / stats.len() as f32;
    let z: f32 = stats.iter().map(|s| s.z_loss).sum::<f32>() / stats.len() as f32;
    let dropped: f32 = stats.iter().map(|s| s.dropped_fraction).sum::<f32>() / stats.len() as f32;
    let imbalance = stats.iter().map(|s| s.max_load as f32 / s.mean_load.max(1e-9)).fold(0.0f32, f32::max);
    let e = stats[0].counts.len();
    let load: Vec<usize> = (0..e).map(|i| stats.iter().map(|s| s.counts[i]).sum()).collect();
    line["moe_aux_loss"] = aux.into();
    line["moe_z_loss"] = z.into();
    line["moe_dropped_fraction"] = dropped.into();
    line["moe_max_over_mean_load"] = imbalance.into();
    line["moe_expert_load"] = load.into();
    let (sent, received): (usize, usize) = (stats.iter().map(|s| s.ep_rows_sent).sum(), stats.iter().map(|s| s.ep_rows_received).sum());
    if sent + received > 0 {
        // Expert parallelism: rows this rank sent to other ranks' experts and received for its
        // own, over the layers (see `tensor::moe::MoeStats`).
        line["moe_ep_rows_sent"] = sent.into();
        line["moe_ep_rows_received"] = received.into();
    }
}


/// Prompt plus generated continuation, decoded.
pub fn sample_text(model: &Gpt, tok: &Tokenizer, prompt: &str, n: usize, temperature: f32, top_k: usize, seed: u64) -> String {
    let ids = tok.encode(prompt);
    let out = model.generate(&ids, n, &Sampler { temperature, top_k, seed });
    let mut all = ids;
    all.extend(out);
    tok.decode(&all)
}
