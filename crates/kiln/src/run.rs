//! Run directories: layout, creation, and loading a finished or interrupted run back
//! (for `--resume`, `kiln eval`, `kiln generate`).
//!
//! ```text
//! RUN/config.toml        the fully resolved config
//! RUN/tokenizer.json     the tokenizer (char vocabularies live here), with its tokenizer_config.json
//! RUN/metrics.jsonl      one JSON object per line ("kind": "train" | "eval")
//! RUN/checkpoints/step-NNNNNNNN/
//! RUN/sample.txt         text generated at the end of training
//! RUN/lock               flock-ed by the one process training in the run ({"pid", "since"})
//! ```

use crate::checkpoint;
use crate::config::RunConfig;
use crate::memory::guard;
use crate::error::{user, KilnError, Result};
use std::fs;
use std::path::{Path, PathBuf};

pub fn ckpt_dir(run: &Path) -> PathBuf {
    run.join("checkpoints")
}

/// `runs/<preset>-YYYYMMDD-HHMMSS` in UTC.
pub fn default_run_dir(preset: &str) -> PathBuf {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = (secs / 86400, secs % 86400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    PathBuf::from("runs").join(format!("{preset}-{y:04}{m:02}{d:02}-{:02}{:02}{:02}", rem / 3600, (rem % 3600) / 60, rem % 60))
}

/// The most recently modified run directory under `runs/` (for `--resume` without `--out`),
/// preferring runs of `preset` when given.
pub fn latest_run(preset: Option<&str>) -> Result<PathBuf> {
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    if let Ok(rd) = fs::read_dir("runs") {
        for e in rd.flatten() {
            let p = e.path();
            if !p.join("config.toml").exists() {
                continue;
            }
            if let Some(pr) = preset {
                if !e.file_name().to_string_lossy().starts_with(&format!("{pr}-")) {
                    continue;
                }
            }
            let t = e.metadata().and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH);
            if best.as_ref().is_none_or(|(bt, _)| t > *bt) {
                best = Some((t, p));
            }
        }
    }
    best.map(|(_, p)| p).ok_or_else(|| KilnError::User("--resume: no run directory under runs/ to resume; pass --out DIR".into()))
}

/// A run directory read back: its config, tokenizer and newest valid checkpoint.
pub struct SavedRun {
    pub dir: PathBuf,
    pub config: RunConfig,
    pub ckpt: checkpoint::Loaded,
    pub tokenizer: data::Tokenizer,
}

pub fn load_run(dir: &Path) -> Result<SavedRun> {
    let cfg_path = dir.join("config.toml");
    if !cfg_path.exists() {
        return user(format!("{}: not a kiln run directory (no config.toml)", dir.display()));
    }
    let config = RunConfig::load(&cfg_path)?;
    let ckpt = checkpoint::latest_valid(&ckpt_dir(dir))?;
    let tokenizer = data::Tokenizer::from_json(&ckpt.tokenizer_json, &ckpt.dir.join(data::Tokenizer::file_name_of_json(&ckpt.tokenizer_json)))?.with_config_in(dir)?;
    Ok(SavedRun { dir: dir.to_path_buf(), config, ckpt, tokenizer })
}

/// Rebuilds the model of a saved run with the checkpoint's parameters. A LoRA run's
/// checkpoint holds only its adapters: they are loaded over its base (`model.init_from`) and
/// merged, so the result is a plain model.
pub fn load_model(run: &SavedRun) -> Result<model::Gpt> {
    let vocab = run.config.loss_vocab(run.tokenizer.vocab_size());
    let cfg = run.config.gpt_config(run.tokenizer.vocab_size());
    let origin = run.ckpt.dir.join("model.safetensors");
    // A run directory whose parts disagree (found by fuzzing): more predicted tokens than rows.
    if vocab > cfg.vocab_size {
        return user(format!(
            "{}: the model predicts {vocab} tokens (its tokenizer, or model.loss_vocab) but has {} vocabulary rows (model.vocab_size in {})",
            run.dir.display(), cfg.vocab_size, run.dir.join("config.toml").display()
        ));
    }
    if run.config.lora.rank > 0 {
        let mut m = load_base(Path::new(&run.config.model.init_from))?;
        m.real_vocab = vocab;
        // A QLoRA run trained against the dequantized base: merge into that.
        let layout = m.layout.clone();
        model::qbase::round_trip(&layout, &mut m.params, run.config.lora.quantize_base);
        let l = &run.config.lora;
        let mut lo = model::lora::Lora::new(&m.cfg, l.rank, l.alpha as f32, &l.targets, 0).map_err(KilnError::User)?;
        let layout = lo.layout.clone();
        checkpoint::read_into(&run.ckpt.model, "", &layout, &mut lo.params, &origin)?;
        lo.merge_into(&mut m.params, &m.views);
        return Ok(m);
    }
    let cause = format!("{}: {}", run.dir.join("config.toml").display(), guard::shape_keys(&cfg));
    guard::Budget::of(0).check(&format!("loading {}", run.ckpt.dir.display()), guard::weight_bytes(&cfg) * 2, &cause)?;
    let mut m = model::Gpt::zeroed(cfg, vocab);
    let layout = m.layout.clone();
    checkpoint::read_into(&run.ckpt.model, "", &layout, &mut m.params, &origin)?;
    Ok(m)
}

/// A base model to start from: a kiln run directory (its newest valid checkpoint) or a
/// Hugging Face directory.
pub fn load_base(path: &Path) -> Result<model::Gpt> {
    if path.join("config.toml").exists() {
        let r = load_run(path)?;
        return load_model(&r);
    }
    import_hf(path)
}

/// [`load_base`] without gradient buffers, for a base LoRA adapts (frozen: its store never
/// reads them), so loading it holds only its weights and one tensor's scratch.
pub fn load_frozen_base(path: &Path) -> Result<model::Gpt> {
    if path.join("config.toml").exists() {
        let mut m = load_base(path)?;
        m.grads = Vec::new();
        return Ok(m);
    }
    import_hf_as(path, true)
}

/// A base model's config: a Hugging Face directory's from its `config.json` alone (nothing
/// else is read: planning a 70B base reads no weights), a kiln run's from its model.
pub fn base_config(path: &Path) -> Result<model::GptConfig> {
    if path.join("config.toml").exists() {
        return Ok(load_base(path)?.cfg);
    }
    Ok(model::hf::read_config(path).map_err(KilnError::User)?.0)
}

/// A Hugging Face directory's model with untouched zero parameters (its shape, checked against
/// the memory available for the quantized base's working set): for a QLoRA run, which reads the
/// weights itself, tensor by tensor.
pub fn hf_shell(dir: &Path) -> Result<model::Gpt> {
    let (g, v) = model::hf::read_config(dir).map_err(KilnError::User)?;
    let cause = guard::hf_shape_keys(&g, &v, &dir.join("config.json"));
    guard::Budget::of(0).check(&format!("loading {}", dir.display()), guard::weight_bytes(&g) / 4, &cause)?;
    let vocab = g.vocab_size;
    Ok(model::Gpt::zeroed_frozen(g, vocab))
}

/// Loads a Hugging Face directory, once its config shows the model fits: its fp32 weights, with
/// one tensor at a time read and widened beside them, then its gradient buffers.
pub fn import_hf(dir: &Path) -> Result<model::Gpt> {
    import_hf_as(dir, false)
}

/// [`import_hf`], or (`frozen`) without gradient buffers, each checked against the memory
/// available first.
fn import_hf_as(dir: &Path, frozen: bool) -> Result<model::Gpt> {
    let (g, v) = model::hf::read_config(dir).map_err(KilnError::User)?;
    let scratch = model::hf::TensorReader::open(dir).map_err(KilnError::User)?.scratch_bytes() as u128;
    let cause = guard::hf_shape_keys(&g, &v, &dir.join("config.json"));
    let peak = guard::load_bytes(guard::weight_bytes(&g), scratch, frozen);
    guard::Budget::of(0).check(&format!("loading {}", dir.display()), peak, &cause)?;
    match frozen {
        true => model::hf::import_hf_frozen(dir),
        false => model::hf::import_hf(dir),
    }
    .map_err(KilnError::User)
}

/// `m` with its LoRA adapters (if any) folded into its weights, in place.
pub fn merged(mut m: model::Gpt) -> model::Gpt {
    if let Some(lo) = m.lora.take() {
        lo.merge_into(&mut m.params, &m.views);
    }
    m
}

/// The lock file whose `flock` marks a run directory's one writer.
pub const LOCK_FILE: &str = "lock";
/// Set by a supervisor for its worker: the supervisor's PID, which holds the run's lock for it.
pub const LOCK_HELD_ENV: &str = "KILN_RUN_LOCK_HELD_BY";

/// A run directory's ownership: an exclusive `flock` on `RUN/lock`, held for as long as this
/// value lives and released by the kernel when the process dies (a crash leaves no stale lock).
/// The file names its holder (`{"pid", "since"}`) for the refusal message. Dropped without a
/// run started in it, a directory this lock created is removed again.
pub struct RunLock {
    _file: Option<fs::File>,
    dir: PathBuf,
    created: bool,
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let only_lock = fs::read_dir(&self.dir).map(|d| d.flatten().all(|e| e.file_name() == LOCK_FILE)).unwrap_or(false);
        if self.created && only_lock {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

fn flock(f: &fs::File, op: i32) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a file descriptor this process owns.
    unsafe { libc::flock(f.as_raw_fd(), op | libc::LOCK_NB) == 0 }
}

/// Who holds `dir`'s lock, if anyone: `(pid, since)` from the lock file, when it is locked.
pub fn holder(dir: &Path) -> Option<(u64, String)> {
    let f = fs::File::open(dir.join(LOCK_FILE)).ok()?;
    if flock(&f, libc::LOCK_SH) {
        flock(&f, libc::LOCK_UN);
        return None;
    }
    let v: serde_json::Value = fs::read_to_string(dir.join(LOCK_FILE)).ok().and_then(|s| serde_json::from_str(&s).ok()).unwrap_or_default();
    Some((v["pid"].as_u64().unwrap_or(0), v["since"].as_str().unwrap_or("?").to_string()))
}

/// Whether process `pid` is this process's parent, or its parent's (under `mpirun` a
/// supervisor's workers are its grandchildren or further down), up the chain in `/proc`.
fn is_ancestor(pid: u32) -> bool {
    let mut p = std::os::unix::process::parent_id();
    for _ in 0..8 {
        if p == pid {
            return true;
        }
        // /proc/P/stat: "P (comm) S PPID ...": the parent follows the closing parenthesis.
        let Some(ppid) = fs::read_to_string(format!("/proc/{p}/stat")).ok().and_then(|s| s.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1).and_then(|x| x.parse().ok()))) else { return false };
        if ppid <= 1 {
            return false;
        }
        p = ppid;
    }
    false
}

/// Takes `dir` for this process (creating it), or refuses: "DIR is in use by process PID (since
/// TIME, step N)". A supervisor's worker (the supervisor's PID in [`LOCK_HELD_ENV`]) works under
/// its parent's lock, and MPI ranks other than 0 under rank 0's.
pub fn lock(dir: &Path) -> Result<RunLock> {
    // MPI ranks other than 0 write nothing in the run directory: rank 0 holds it for them.
    let mpi_rank = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"].iter().find_map(|k| std::env::var(k).ok());
    if mpi_rank.is_some_and(|r| r.trim() != "0") {
        return Ok(RunLock { _file: None, dir: dir.to_path_buf(), created: false });
    }
    if let Ok(pid) = std::env::var(LOCK_HELD_ENV) {
        if pid.parse::<u32>().is_ok_and(is_ancestor) {
            return Ok(RunLock { _file: None, dir: dir.to_path_buf(), created: false });
        }
    }
    let created = !dir.exists();
    fs::create_dir_all(dir).map_err(|e| crate::error::io_err(dir, e))?;
    let path = dir.join(LOCK_FILE);
    let f = fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(|e| crate::error::io_err(&path, e))?;
    if !flock(&f, libc::LOCK_EX) {
        let (pid, since) = holder(dir).unwrap_or((0, "?".into()));
        let step = fs::read_to_string(dir.join("heartbeat")).ok().map(|s| s.trim().to_string()).unwrap_or_else(|| "0".into());
        return user(format!("{} is in use by process {pid} (since {since}, step {step}): one training process per run directory", dir.display()));
    }
    let since = default_run_dir("").file_name().map(|n| n.to_string_lossy().trim_start_matches('-').to_string()).unwrap_or_default();
    let me = serde_json::json!({"pid": std::process::id(), "since": since}).to_string() + "\n";
    use std::io::Write;
    f.set_len(0).and_then(|_| (&f).write_all(me.as_bytes())).map_err(|e| crate::error::io_err(&path, e))?;
    crate::memory::track::note_run_dir(dir, &path, created);
    Ok(RunLock { _file: Some(f), dir: dir.to_path_buf(), created })
}
