//! Hugging Face interoperability for GPT-2: `config.json` + `model.safetensors` (one file, or
//! shards listed in `model.safetensors.index.json`) for `GPT2LMHeadModel`, in and out.
//!
//! HF GPT-2 stores its four projection matrices as `Conv1D`, `[in, out]`; kiln stores every
//! Linear as `[out, in]`, so those four are transposed on the way in and out. Names are
//! otherwise identical (`transformer.h.0.attn.c_attn.weight`, …); the tied head has no tensor
//! of its own, an untied one is `lm_head.weight`.

use crate::config::GptConfig;
use crate::gpt::Gpt;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Parameters stored transposed by HF's `Conv1D`.
fn is_conv1d(name: &str) -> bool {
    ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"].iter().any(|s| name.ends_with(s))
}

fn get_usize(cfg: &Value, key: &str, origin: &Path) -> Result<usize, String> {
    cfg.get(key).and_then(Value::as_u64).map(|v| v as usize).ok_or_else(|| format!("{}: missing or invalid `{key}`", origin.display()))
}

/// The kiln config of an HF `GPT2LMHeadModel` `config.json`.
pub fn gpt2_config(cfg: &Value, origin: &Path) -> Result<GptConfig, String> {
    let arch = cfg.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str).unwrap_or("");
    if arch != "GPT2LMHeadModel" {
        return Err(format!("{}: architecture `{arch}` is not supported for import (supported: GPT2LMHeadModel)", origin.display()));
    }
    let act = cfg.get("activation_function").and_then(Value::as_str).unwrap_or("gelu_new");
    if act != "gelu_new" && act != "gelu_pytorch_tanh" {
        return Err(format!("{}: activation_function `{act}` is not supported (kiln's GPT-2 uses the tanh GELU, `gelu_new`)", origin.display()));
    }
    let n_embd = get_usize(cfg, "n_embd", origin)?;
    if let Some(inner) = cfg.get("n_inner").and_then(Value::as_u64) {
        if inner as usize != 4 * n_embd {
            return Err(format!("{}: n_inner {inner} is not 4·n_embd; kiln's GPT-2 MLP is 4·n_embd wide", origin.display()));
        }
    }
    let c = GptConfig {
        n_layer: get_usize(cfg, "n_layer", origin)?,
        n_head: get_usize(cfg, "n_head", origin)?,
        n_embd,
        block_size: get_usize(cfg, "n_positions", origin)?,
        vocab_size: get_usize(cfg, "vocab_size", origin)?,
        bias: true,
        dropout: 0.0,
        tied_embeddings: cfg.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(true),
    };
    c.validate().map_err(|e| format!("{}: {e}", origin.display()))?;
    Ok(c)
}

/// The safetensors files of an HF directory: the index's shards, or `model.safetensors`.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| format!("{}: {e}", index.display()))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", index.display()))?;
        let map = v.get("weight_map").and_then(Value::as_object).ok_or_else(|| format!("{}: no weight_map", index.display()))?;
        let mut files: Vec<PathBuf> = map.values().filter_map(Value::as_str).map(|f| dir.join(f)).collect();
        files.sort();
        files.dedup();
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        Ok(vec![single])
    } else {
        Err(format!("{}: no model.safetensors or model.safetensors.index.json", dir.display()))
    }
}

/// Loads an HF GPT-2 directory into a kiln model. Every kiln parameter must be present with
/// the right shape; tensors kiln does not use (e.g. `attn.bias` masks) are ignored.
pub fn import_gpt2(dir: &Path) -> Result<Gpt, String> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: invalid JSON: {e}", cfg_path.display()))?;
    let cfg = gpt2_config(&v, &cfg_path)?;
    let vocab = cfg.vocab_size;
    let mut m = Gpt::zeroed(cfg, vocab);
    let mut found = vec![false; m.layout.params.len()];
    for file in weight_files(dir)? {
        let bytes = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| format!("{}: {e}", file.display()))?;
        for (i, p) in m.layout.params.iter().enumerate() {
            let Ok(t) = st.tensor(&p.name) else { continue };
            let want: Vec<usize> = if is_conv1d(&p.name) { vec![p.shape[1], p.shape[0]] } else { p.shape.clone() };
            if t.dtype() != Dtype::F32 || t.shape() != want.as_slice() {
                return Err(format!("{}: tensor `{}` is {:?} {:?}, expected F32 {:?}", file.display(), p.name, t.dtype(), t.shape(), want));
            }
            let src: Vec<f32> = t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            let dst = &mut m.params[p.range()];
            if is_conv1d(&p.name) {
                transpose(dst, &src, want[0], want[1]);
            } else {
                dst.copy_from_slice(&src);
            }
            found[i] = true;
        }
    }
    if let Some(i) = found.iter().position(|f| !f) {
        return Err(format!("{}: checkpoint has no tensor `{}`", dir.display(), m.layout.params[i].name));
    }
    Ok(m)
}

/// `dst[cols, rows] = srcᵀ` for `src[rows, cols]`.
fn transpose(dst: &mut [f32], src: &[f32], rows: usize, cols: usize) {
    for r in 0..rows {
        for c in 0..cols {
            dst[c * rows + r] = src[r * cols + c];
        }
    }
}

/// Writes `config.json` and `model.safetensors` in HF's GPT-2 format into `dir`.
pub fn export_gpt2(m: &Gpt, dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let c = &m.cfg;
    let config = json!({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "n_positions": c.block_size, "n_ctx": c.block_size,
        "n_inner": null, "vocab_size": c.vocab_size, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": c.tied_embeddings,
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "scale_attn_weights": true,
        "bos_token_id": 50256, "eos_token_id": 50256, "dtype": "float32",
    });
    if !c.bias {
        return Err("export: HF GPT-2 always has biases; this model has model.bias = false".into());
    }
    let mut data: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
    for p in &m.layout.params {
        let src = &m.params[p.range()];
        let (shape, vals) = if is_conv1d(&p.name) {
            let mut t = vec![0.0f32; src.len()];
            transpose(&mut t, src, p.shape[0], p.shape[1]);
            (vec![p.shape[1], p.shape[0]], t)
        } else {
            (p.shape.clone(), src.to_vec())
        };
        data.insert(p.name.clone(), (shape, vals.iter().flat_map(|x| x.to_le_bytes()).collect()));
    }
    let views: Vec<(String, TensorView)> =
        data.iter().map(|(n, (s, b))| (n.clone(), TensorView::new(Dtype::F32, s.clone(), b).expect("shape matches"))).collect();
    let meta = Some(std::collections::HashMap::from([("format".to_string(), "pt".to_string())]));
    let bytes = safetensors::tensor::serialize(views, meta).map_err(|e| format!("export: {e}"))?;
    let write = |name: &str, b: &[u8]| std::fs::write(dir.join(name), b).map_err(|e| format!("{}: {e}", dir.join(name).display()));
    write("model.safetensors", &bytes)?;
    write("config.json", serde_json::to_string_pretty(&config).unwrap().as_bytes())?;
    Ok(())
}
