//! `kiln checkpoint inspect PATH`: a checkpoint's manifest as JSON, with SHA-256 digests of the
//! logical parameter set and optimizer state. Checkpoints hold whole tensors whatever layout
//! (`--dp`, `--tp`, `--zero`) wrote them, so equal digests mean equal training state across
//! layouts.

use crate::checkpoint::{self, Loaded};
use crate::error::{user, KilnError, Result};
use crate::run::ckpt_dir;
use sha2::{Digest, Sha256};
use std::path::Path;

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
