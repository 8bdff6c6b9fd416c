//! Hugging Face interoperability: `config.json` + `model.safetensors` (one file, or shards
//! listed in `model.safetensors.index.json`) for `GPT2LMHeadModel` and `LlamaForCausalLM`, in
//! and out. kiln's layout uses HF's parameter names, so import and export are by name.
//!
//! HF GPT-2 stores its four projection matrices as `Conv1D`, `[in, out]`; kiln stores every
//! Linear as `[out, in]`, so those four are transposed on the way in and out. LLaMA's Linears
//! are `[out, in]` already. A tied head has no tensor of its own; an untied one is
//! `lm_head.weight`.

use crate::config::{Arch, GptConfig};
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

/// The kiln config of an HF `config.json`.
pub fn hf_config(cfg: &Value, origin: &Path) -> Result<GptConfig, String> {
    let arch = cfg.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str).unwrap_or("");
    match arch {
        "GPT2LMHeadModel" => gpt2_config(cfg, origin),
        "LlamaForCausalLM" => llama_config(cfg, origin),
        "MixtralForCausalLM" => {
            let mut c = llama_config(cfg, origin)?;
            c.n_expert = get_usize(cfg, "num_local_experts", origin)?;
            c.top_k = get_usize(cfg, "num_experts_per_tok", origin)?;
            // HF Mixtral routes without capacity (dropless); its aux coefficient multiplies a
            // loss K times kiln's (see tensor::moe), so the weight is scaled to match.
            c.capacity_factor = 0.0;
            c.moe_aux_weight = get_f32(cfg, "router_aux_loss_coef", 0.001) * c.top_k as f32;
            c.moe_z_weight = 0.0;
            c.validate().map_err(|e| format!("{}: {e}", origin.display()))?;
            Ok(c)
        }
        _ => Err(format!("{}: architecture `{arch}` is not supported for import (supported: GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM)", origin.display())),
    }
}

fn get_f32(cfg: &Value, key: &str, default: f32) -> f32 {
    cfg.get(key).and_then(Value::as_f64).map_or(default, |v| v as f32)
}

fn llama_config(cfg: &Value, origin: &Path) -> Result<GptConfig, String> {
    let act = cfg.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
    if act != "silu" {
        return Err(format!("{}: hidden_act `{act}` is not supported (LLaMA's SwiGLU uses silu)", origin.display()));
    }
    for key in ["attention_bias", "mlp_bias"] {
        if cfg.get(key).and_then(Value::as_bool).unwrap_or(false) {
            return Err(format!("{}: `{key}` = true is not supported (kiln's LLaMA has no biases)", origin.display()));
        }
    }
    let n_embd = get_usize(cfg, "hidden_size", origin)?;
    let n_head = get_usize(cfg, "num_attention_heads", origin)?;
    if let Some(hd) = cfg.get("head_dim").and_then(Value::as_u64) {
        if hd as usize * n_head != n_embd {
            return Err(format!("{}: head_dim {hd} × num_attention_heads {n_head} ≠ hidden_size {n_embd}; kiln needs them equal", origin.display()));
        }
    }
    // transformers ≥ 4.5x nests the base in `rope_parameters`; older files have `rope_theta`.
    let theta = cfg.get("rope_parameters").and_then(|r| r.get("rope_theta")).and_then(Value::as_f64).map_or(get_f32(cfg, "rope_theta", 10000.0), |v| v as f32);
    let rope_type = cfg.get("rope_parameters").and_then(|r| r.get("rope_type")).and_then(Value::as_str).unwrap_or("default");
    if rope_type != "default" || cfg.get("rope_scaling").is_some_and(|v| !v.is_null()) {
        return Err(format!("{}: rope scaling `{rope_type}` is not supported (plain RoPE only)", origin.display()));
    }
    let c = GptConfig {
        arch: Arch::Llama,
        n_layer: get_usize(cfg, "num_hidden_layers", origin)?,
        n_head,
        n_kv_head: cfg.get("num_key_value_heads").and_then(Value::as_u64).map_or(n_head, |v| v as usize),
        n_embd,
        ffn_hidden: get_usize(cfg, "intermediate_size", origin)?,
        block_size: get_usize(cfg, "max_position_embeddings", origin)?,
        vocab_size: get_usize(cfg, "vocab_size", origin)?,
        bias: false,
        dropout: 0.0,
        tied_embeddings: cfg.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
        rope_theta: theta,
        norm_eps: get_f32(cfg, "rms_norm_eps", 1e-6),
        ..GptConfig::gpt2(1, 1, 1, 1, 1, false, 0.0, false)
    };
    c.validate().map_err(|e| format!("{}: {e}", origin.display()))?;
    Ok(c)
}

fn gpt2_config(cfg: &Value, origin: &Path) -> Result<GptConfig, String> {
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
    let mut c = GptConfig::gpt2(
        get_usize(cfg, "n_layer", origin)?,
        get_usize(cfg, "n_head", origin)?,
        n_embd,
        get_usize(cfg, "n_positions", origin)?,
        get_usize(cfg, "vocab_size", origin)?,
        true,
        0.0,
        cfg.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(true),
    );
    c.norm_eps = get_f32(cfg, "layer_norm_epsilon", 1e-5);
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

/// Loads an HF directory into a kiln model. Every kiln parameter must be present with the
/// right shape; tensors kiln does not use (e.g. `attn.bias` masks, rotary caches) are ignored.
pub fn import_hf(dir: &Path) -> Result<Gpt, String> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: invalid JSON: {e}", cfg_path.display()))?;
    let cfg = hf_config(&v, &cfg_path)?;
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

/// Writes `config.json` and `model.safetensors` in HF's format (`GPT2LMHeadModel` or
/// `LlamaForCausalLM`) into `dir`.
pub fn export_hf(m: &Gpt, dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let c = &m.cfg;
    if c.n_shared_expert > 0 {
        return Err("export: shared experts have no Hugging Face Mixtral equivalent".into());
    }
    let config = if c.arch == Arch::Llama {
        let (arch, ty) = if c.is_moe() { ("MixtralForCausalLM", "mixtral") } else { ("LlamaForCausalLM", "llama") };
        let mut v = json!({
            "architectures": [arch], "model_type": ty, "hidden_act": "silu",
            "hidden_size": c.n_embd, "intermediate_size": c.ffn_hidden, "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head, "head_dim": c.head_size(),
            "max_position_embeddings": c.block_size, "vocab_size": c.vocab_size, "rms_norm_eps": c.norm_eps,
            "rope_theta": c.rope_theta, "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": c.tied_embeddings, "attention_bias": false, "mlp_bias": false,
            "attention_dropout": 0.0, "dtype": "float32",
        });
        if c.is_moe() {
            v["num_local_experts"] = c.n_expert.into();
            v["num_experts_per_tok"] = c.top_k.into();
            v["router_aux_loss_coef"] = (c.moe_aux_weight / c.top_k as f32).into();
            v["output_router_logits"] = false.into();
        }
        v
    } else {
        json!({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "n_positions": c.block_size, "n_ctx": c.block_size,
        "n_inner": null, "vocab_size": c.vocab_size, "layer_norm_epsilon": c.norm_eps, "tie_word_embeddings": c.tied_embeddings,
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "scale_attn_weights": true,
        "bos_token_id": 50256, "eos_token_id": 50256, "dtype": "float32",
        })
    };
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
    // HF's GPT-2 always has biases: a bias-free model is exactly one whose biases are zero.
    if c.arch == Arch::Gpt2 && !c.bias {
        let zeros = |n: usize| (vec![n], vec![0u8; 4 * n]);
        let (cc, f) = (c.n_embd, c.ffn_hidden);
        for l in 0..c.n_layer {
            for (name, n) in [("ln_1", cc), ("attn.c_attn", 3 * cc), ("attn.c_proj", cc), ("ln_2", cc), ("mlp.c_fc", f), ("mlp.c_proj", cc)] {
                data.insert(format!("transformer.h.{l}.{name}.bias"), zeros(n));
            }
        }
        data.insert("transformer.ln_f.bias".into(), zeros(cc));
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
