//! Run directories: layout, creation, and loading a finished or interrupted run back
//! (for `--resume`, `kiln eval`, `kiln generate`).
//!
//! ```text
//! RUN/config.toml        the fully resolved config
//! RUN/tokenizer.json     the tokenizer (char vocabularies live here), with its tokenizer_config.json
//! RUN/metrics.jsonl      one JSON object per line ("kind": "train" | "eval")
//! RUN/checkpoints/step-NNNNNNNN/
//! RUN/sample.txt         text generated at the end of training
//! ```

use crate::checkpoint;
use crate::config::RunConfig;
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
    if run.config.lora.rank > 0 {
        let mut m = load_base(Path::new(&run.config.model.init_from))?;
        m.real_vocab = vocab;
        let l = &run.config.lora;
        let mut lo = model::lora::Lora::new(&m.cfg, l.rank, l.alpha as f32, &l.targets, 0).map_err(KilnError::User)?;
        let layout = lo.layout.clone();
        checkpoint::read_into(&run.ckpt.model, "", &layout, &mut lo.params, &origin)?;
        lo.merge_into(&mut m.params, &m.views);
        return Ok(m);
    }
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
    model::hf::import_hf(path).map_err(KilnError::User)
}

/// A plain copy of `m` with its LoRA adapters (if any) folded into the weights.
pub fn merged(m: &model::Gpt) -> model::Gpt {
    let mut out = model::Gpt::zeroed(m.cfg.clone(), m.real_vocab);
    out.params.copy_from_slice(&m.params);
    if let Some(lo) = &m.lora {
        lo.merge_into(&mut out.params, &out.views);
    }
    out
}
