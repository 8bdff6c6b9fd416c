//! `kiln checkpoint inspect PATH`: a checkpoint's manifest as JSON, with SHA-256 digests of the
//! logical parameter set and optimizer state. Checkpoints hold whole tensors whatever layout
//! (`--dp`, `--tp`, `--zero`) wrote them, so equal digests mean equal training state across
//! layouts.

use crate::checkpoint::{self, Loaded};
use crate::error::{user, KilnError, Result};
use crate::run::ckpt_dir;
use sha2::{Digest, Sha256};
use std::path::Path;
use clap::Subcommand;
use std::path::PathBuf;

/// The newest valid checkpoint of a run directory, or the checkpoint directory itself.
pub fn resolve(path: &Path) -> Result<Loaded> {
    if path.join("manifest.json").exists() {
        return checkpoint::verify_and_load(path);
    }
    if path.join("config.toml").exists() || path.join("checkpoints").is_dir() {
        return checkpoint::latest_valid(&ckpt_dir(path));
    }
    user(format!("{}: neither a checkpoint (no manifest.json) nor a run directory (no config.toml)", path.display()))
}

/// SHA-256 over every tensor of a safetensors file whose name passes `keep`, in name order:
/// the name, a NUL, the shape (u64 little-endian each), then the data. Independent of file
/// layout and header formatting.
pub fn digest(bytes: &[u8], keep: impl Fn(&str) -> bool, origin: &Path) -> Result<(String, Vec<serde_json::Value>)> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| KilnError::User(format!("{}: {e}", origin.display())))?;
    let mut names: Vec<String> = st.names().into_iter().filter(|n| keep(n)).map(|n| n.to_string()).collect();
    names.sort();
    let mut h = Sha256::new();
    let mut list = Vec::new();
    for n in &names {
        let t = st.tensor(n).map_err(|e| KilnError::User(format!("{}: {n}: {e}", origin.display())))?;
        h.update(n.as_bytes());
        h.update([0u8]);
        for d in t.shape() {
            h.update((*d as u64).to_le_bytes());
        }
        h.update(t.data());
        list.push(serde_json::json!({"name": n, "shape": t.shape(), "dtype": format!("{:?}", t.dtype())}));
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((hex, list))
}

pub fn inspect(path: &Path) -> Result<serde_json::Value> {
    let l = resolve(path)?;
    let (params, tensors) = digest(&l.model, |_| true, &l.dir.join("model.safetensors"))?;
    let (optim, _) = digest(&l.optim, |_| true, &l.dir.join("optimizer.safetensors"))?;
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(l.dir.join("manifest.json")).map_err(|e| KilnError::User(format!("{}: {e}", l.dir.display())))?).unwrap_or_default();
    Ok(serde_json::json!({
        "dir": l.dir.display().to_string(),
        "step": l.state.step,
        "tokens_seen": l.state.tokens_seen,
        "elapsed_s": l.state.elapsed_s,
        "params_sha256": params,
        "optimizer_sha256": optim,
        "valid": true,
        "files": manifest["files"],
        "tensors": tensors,
    }))
}

/// A decoded tensor: its name, shape and data.
type NamedTensor = (String, Vec<usize>, Vec<f32>);

/// Every tensor of a safetensors buffer, decoded: (name, shape, data), in name order.
fn tensors_of(bytes: &[u8], origin: &Path) -> Result<Vec<NamedTensor>> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| KilnError::User(format!("{}: {e}", origin.display())))?;
    let mut names: Vec<String> = st.names().into_iter().map(|n| n.to_string()).collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let t = st.tensor(&n).map_err(|e| KilnError::User(format!("{}: {n}: {e}", origin.display())))?;
            let data = t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            Ok((n, t.shape().to_vec(), data))
        })
        .collect()
}

/// `kiln checkpoint convert PATH --out DIR --shards N`: the checkpoint (or a run's newest
/// valid one) rewritten under `DIR/step-NNNNNNNN` as one file per kind (`N` = 1) or `N`
/// per-rank parts, verified on the way in and readable by any layout. Returns the new
/// directory.
pub fn convert(path: &Path, out: &Path, shards: usize) -> Result<std::path::PathBuf> {
    if shards == 0 {
        return user("--shards must be positive, got 0");
    }
    let l = resolve(path)?;
    if crate::checkpoint::list(out).iter().any(|(s, _)| *s == l.state.step) {
        return user(format!("{} already holds a checkpoint of step {}", out.display(), l.state.step));
    }
    let model = tensors_of(&l.model, &l.dir)?;
    let optim = tensors_of(&l.optim, &l.dir)?;
    fn view(ts: &[(String, Vec<usize>, Vec<f32>)], part: Option<(usize, usize)>) -> crate::checkpoint::Tensors<'_> {
        crate::checkpoint::Tensors {
        items: ts
            .iter()
            .map(|(n, s, d)| match part {
                None => (n.clone(), s.clone(), &d[..]),
                Some((r, k)) => {
                    let range = crate::checkpoint::part_range(d.len(), r, k);
                    (n.clone(), vec![range.len()], &d[range])
                }
            })
            .collect(),
        }
    }
    std::fs::create_dir_all(out).map_err(|e| crate::error::io_err(out, e))?;
    if shards == 1 {
        return crate::checkpoint::save(out, &l.state, &view(&model, None), &view(&optim, None), &l.tokenizer_json);
    }
    let tmp = crate::checkpoint::prepare_sharded(out, l.state.step)?;
    let shapes = model.iter().chain(&optim).map(|(n, s, _)| (n.clone(), s.clone())).collect();
    // Ranks 1.. first: rank 0 finishes the checkpoint once every part is in.
    let mut dir = None;
    for r in (0..shards).rev() {
        let part = crate::checkpoint::Part { rank: r, world: shards, tmp: tmp.clone(), shapes: std::collections::BTreeMap::clone(&shapes) };
        dir = crate::checkpoint::save_part(out, &part, &l.state, &view(&model, Some((r, shards))), &view(&optim, Some((r, shards))), &l.tokenizer_json)?;
    }
    Ok(dir.expect("rank 0 returns the directory"))
}

#[derive(Subcommand)]
pub enum CheckpointCmd {
    /// Print a checkpoint's manifest as JSON: step, params_sha256, optimizer_sha256, files,
    /// tensors. PATH is a checkpoint directory, or a run directory (its newest valid one).
    Inspect { path: PathBuf },
    /// Rewrite a checkpoint (or a run's newest valid one) under OUT/step-N as one file per
    /// kind (--shards 1) or N per-rank parts; any layout loads either. For Hugging Face
    /// safetensors use `kiln export`.
    Convert {
        path: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 1)]
        shards: usize,
    },
}

/// Runs `kiln checkpoint …`.
pub fn run(cmd: CheckpointCmd) -> Result<()> {
    match cmd {
        CheckpointCmd::Convert { path, out, shards } => {
            let dir = crate::cmd_checkpoint::convert(&path, &out, shards)?;
            println!("wrote {}", dir.display());
            Ok(())
        }
        CheckpointCmd::Inspect { path } => {
            println!("{}", serde_json::to_string_pretty(&crate::cmd_checkpoint::inspect(&path)?).unwrap());
            Ok(())
        }
    }
}
