//! Hugging Face interoperability: `config.json` + `model.safetensors` (one file, or shards
//! listed in `model.safetensors.index.json`; F32, BF16 or F16) for `GPT2LMHeadModel`,
//! `LlamaForCausalLM` (with `linear` / `llama3` / `yarn` / `longrope` / `dynamic` rope scaling), `Qwen2ForCausalLM`,
//! `Qwen3ForCausalLM` (per-head q and k norms), `Qwen3MoeForCausalLM` (and routed experts),
//! `MistralForCausalLM` (sliding-window attention),
//! `MixtralForCausalLM`, `Phi3ForCausalLM`, `SmolLM3ForCausalLM` (NoPE layers),
//! `Olmo2ForCausalLM` (norms after the branches, whole-width q/k norms), `Gemma2ForCausalLM`
//! and `Gemma3ForCausalLM` (text: sandwich norms scaling by `1 + w`, GeGLU, scaled embeddings,
//! soft-capped logits, local and global layers, Gemma 3's with their own rotary bases) and
//! `DeepseekV3ForCausalLM` (multi-head latent attention; every layer dense so far), in and out.
//! kiln's layout uses HF's parameter names, so import and export are by name; Phi-3's fused
//! `qkv_proj` and `gate_up_proj` are the concatenations of parameters kiln's layout holds
//! adjacent in the same order (`fused_of`).
//!
//! HF GPT-2 stores its four projection matrices as `Conv1D`, `[in, out]`; kiln stores every
//! Linear as `[out, in]`, so those four are transposed on the way in and out. LLaMA's Linears
//! are `[out, in]` already. A tied head has no tensor of its own; an untied one is
//! `lm_head.weight`.

use crate::config::{longrope_attention_factor, yarn_mscale, Arch, BlockNorms, GateAct, GptConfig, RopeScaling};
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

/// A `config.json`'s model class (its first `architectures` entry; empty when none).
fn arch_of(cfg: &Value) -> &str {
    cfg.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str).unwrap_or("")
}

/// The kiln config of an HF `config.json`.
pub fn hf_config(cfg: &Value, origin: &Path) -> Result<GptConfig, String> {
    let arch = arch_of(cfg);
    match arch {
        "GPT2LMHeadModel" => gpt2_config(cfg, origin),
        "LlamaForCausalLM" => llama_config(cfg, origin, false),
        // Qwen2: LLaMA with biases on q, k and v; Qwen3: with per-head q and k norms instead.
        // Their window applies from layer `max_window_layers` on, when `use_sliding_window`.
        "Qwen2ForCausalLM" | "Qwen3ForCausalLM" => {
            let qwen3 = arch == "Qwen3ForCausalLM";
            let mut c = llama_config(cfg, origin, !qwen3)?;
            c.qk_norm = qwen3;
            if cfg.get("use_sliding_window").and_then(Value::as_bool).unwrap_or(false) {
                let from = cfg.get("max_window_layers").and_then(Value::as_u64).map_or(0, |m| m as usize);
                windows(&mut c, cfg, origin, from)?;
            }
            Ok(c)
        }
        // Phi-3: LLaMA with q|k|v and gate|up each stored as one tensor, a window on every
        // layer when `sliding_window` is below the context.
        "Phi3ForCausalLM" => {
            let mut c = llama_config(cfg, origin, false)?;
            c.fused_proj = true;
            // Phi3Config's pad_token_id defaults to 32000 when the file has none.
            if cfg.get("pad_token_id").is_none() && c.vocab_size > 32000 {
                c.pad_token_id = Some(32000);
            }
            windows(&mut c, cfg, origin, 0)?;
            Ok(c)
        }
        "MistralForCausalLM" => {
            let mut c = llama_config(cfg, origin, false)?;
            windows(&mut c, cfg, origin, 0)?;
            Ok(c)
        }
        // SmolLM3: LLaMA whose layers with `no_rope_layers[l] = 0` have no rotary embedding
        // (by default every `no_rope_layer_interval`-th, 4), the window on `layer_types`' sliding
        // layers when `use_sliding_window`.
        "SmolLM3ForCausalLM" => {
            let mut c = llama_config(cfg, origin, false)?;
            let uses: Vec<bool> = match cfg.get("no_rope_layers").and_then(Value::as_array) {
                Some(a) => a.iter().map(|x| x.as_u64() != Some(0)).collect(),
                None => {
                    let every = cfg.get("no_rope_layer_interval").and_then(Value::as_u64).unwrap_or(4).max(1) as usize;
                    (0..c.n_layer).map(|l| (l + 1) % every != 0).collect()
                }
            };
            if uses.len() != c.n_layer {
                return Err(format!("{}: `no_rope_layers` has {} entries for {} layers", origin.display(), uses.len(), c.n_layer));
            }
            c.nope_layers = (0..c.n_layer).filter(|&l| !uses[l]).collect();
            // SmolLM3Config's pad_token_id defaults to 128004 when the file has none.
            if cfg.get("pad_token_id").is_none() && c.vocab_size > 128004 {
                c.pad_token_id = Some(128004);
            }
            if cfg.get("use_sliding_window").and_then(Value::as_bool).unwrap_or(false) {
                windows(&mut c, cfg, origin, 0)?;
            }
            c.validate().map_err(|e| format!("{}: {e}", origin.display()))?;
            Ok(c)
        }
        // Qwen3-MoE: Qwen3's attention, every layer's MLP routed experts with Mixtral's routing
        // (softmax, top-k, the top-k weights renormalised: `norm_topk_prob`).
        "Qwen3MoeForCausalLM" => {
            let mut c = llama_config(cfg, origin, false)?;
            c.qk_norm = true;
            if cfg.get("norm_topk_prob").and_then(Value::as_bool) != Some(true) {
                return Err(format!("{}: `norm_topk_prob` must be true (kiln renormalises the top-k routing weights, as Mixtral)", origin.display()));
            }
            let sparse_step = cfg.get("decoder_sparse_step").and_then(Value::as_u64).unwrap_or(1);
            let dense = cfg.get("mlp_only_layers").and_then(Value::as_array).is_some_and(|a| !a.is_empty());
            if sparse_step != 1 || dense {
                return Err(format!("{}: `decoder_sparse_step` = {sparse_step} / `mlp_only_layers` dense layers are not supported (every layer routed)", origin.display()));
            }
            let experts = cfg.get("num_experts").or_else(|| cfg.get("num_local_experts")).and_then(Value::as_u64);
            c.n_expert = experts.ok_or_else(|| format!("{}: missing or invalid `num_experts`", origin.display()))? as usize;
            c.ffn_hidden = get_usize(cfg, "moe_intermediate_size", origin)?;
            moe_routing(&mut c, cfg, origin)?;
            // transformers' Qwen3-MoE windows every layer under `use_sliding_window`.
            if cfg.get("use_sliding_window").and_then(Value::as_bool).unwrap_or(false) {
                windows(&mut c, cfg, origin, 0)?;
            }
            c.validate().map_err(|e| format!("{}: {e}", origin.display()))?;
            Ok(c)
        }
        // OLMo 2: LLaMA with each branch's norm after it (before the residual add) and q and k
        // each normed over all heads at once; Olmo2Config's defaults where the file has none
        // (`pad_token_id` 1, `rms_norm_eps` 1e-5).
        "DeepseekV3ForCausalLM" => deepseek_v3_config(cfg, origin),
        "Gemma2ForCausalLM" => gemma_config(cfg, origin, 2),
        "Gemma3ForCausalLM" => gemma_config(cfg, origin, 3),
        "Olmo2ForCausalLM" => {
            let mut c = llama_config(cfg, origin, false)?;
            (c.qk_norm, c.qk_norm_whole, c.block_norms) = (true, true, BlockNorms::Post);
            if cfg.get("pad_token_id").is_none() && c.vocab_size > 1 {
                c.pad_token_id = Some(1);
            }
            c.norm_eps = get_f32(cfg, "rms_norm_eps", 1e-5);
            c.validate().map_err(|e| format!("{}: {e}", origin.display()))?;
            Ok(c)
        }
        "MixtralForCausalLM" => {
            let mut c = llama_config(cfg, origin, false)?;
            c.n_expert = get_usize(cfg, "num_local_experts", origin)?;
            moe_routing(&mut c, cfg, origin)?;
            c.validate().map_err(|e| format!("{}: {e}", origin.display()))?;
            Ok(c)
        }
        _ => Err(format!("{}: architecture `{arch}` is not supported for import (supported: GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM, SmolLM3ForCausalLM, Olmo2ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, DeepseekV3ForCausalLM)", origin.display())),
    }
}

/// DeepSeek-V3 (`DeepseekV3ForCausalLM`): LLaMA's blocks with multi-head latent attention
/// (`kv_lora_rank`, `q_lora_rank` (null: one q projection), `qk_nope_head_dim`,
/// `qk_rope_head_dim`, `v_head_dim`, `rope_interleave`). transformers' `head_dim` in such a file
/// is the rotary width and is not read. Routed experts from layer `first_k_dense_replace` on
/// ([`deepseek_v3_experts`]); rope scaling under latent attention is refused by name.
fn deepseek_v3_config(cfg: &Value, origin: &Path) -> Result<GptConfig, String> {
    let n_layer = get_usize(cfg, "num_hidden_layers", origin)?;
    let first_moe = cfg.get("first_k_dense_replace").and_then(Value::as_u64).map_or(3, |v| v as usize);
    let routed = cfg.get("n_routed_experts").and_then(Value::as_u64).unwrap_or(256) as usize;
    let mut flat = cfg.clone();
    let o = flat.as_object_mut().ok_or_else(|| format!("{}: not a JSON object", origin.display()))?;
    o.remove("head_dim");
    o.remove("partial_rotary_factor");
    let mut c = llama_config(&flat, origin, false)?;
    if c.rope_scaling.is_some() {
        return Err(format!("{}: rope scaling with multi-head latent attention (DeepSeek's YaRN softmax scale) is not supported yet", origin.display()));
    }
    let (nope, rope) = (get_usize(cfg, "qk_nope_head_dim", origin)?, get_usize(cfg, "qk_rope_head_dim", origin)?);
    (c.head_dim, c.rotary_dim, c.n_kv_head) = (nope + rope, rope, c.n_head);
    c.v_head_dim = get_usize(cfg, "v_head_dim", origin)?;
    c.kv_lora_rank = get_usize(cfg, "kv_lora_rank", origin)?;
    c.q_lora_rank = cfg.get("q_lora_rank").and_then(Value::as_u64).map_or(0, |q| q as usize);
    c.rope_interleave = cfg.get("rope_interleave").and_then(Value::as_bool).unwrap_or(true);
    if routed > 0 && first_moe < n_layer {
        // The dense layers before the routed ones keep `intermediate_size`.
        c.dense_ffn_hidden = if first_moe > 0 { c.ffn_hidden } else { 0 };
        c.moe_first_layer = first_moe;
        deepseek_v3_experts(&mut c, cfg, routed, origin)?;
    }
    c.validate().map_err(|e| format!("{}: {e}", origin.display()))?;
    Ok(c)
}

/// DeepSeek-V3's routed experts (from layer `first_k_dense_replace` on): the sigmoid router over `n_group` groups (a
/// token's experts from its `topk_group` best), `num_experts_per_tok` of `n_routed_experts`
/// experts of `moe_intermediate_size`, the gates renormalised (`norm_topk_prob`) and scaled by
/// `routed_scaling_factor`, dropless, beside `n_shared_experts` (at most one) shared expert.
fn deepseek_v3_experts(c: &mut GptConfig, cfg: &Value, routed: usize, origin: &Path) -> Result<(), String> {
    let num = |k: &str, default: f64| cfg.get(k).and_then(Value::as_f64).unwrap_or(default);
    if cfg.get("norm_topk_prob").and_then(Value::as_bool) == Some(false) {
        return Err(format!("{}: `norm_topk_prob` = false is not supported (kiln renormalises the top-k gates)", origin.display()));
    }
    // Its one shared MLP `n_shared_experts · moe_intermediate_size` wide is kiln's that many
    // shared experts (hidden units split in order: the same function).
    let shared = num("n_shared_experts", 1.0) as usize;
    c.n_expert = routed;
    c.top_k = num("num_experts_per_tok", 8.0) as usize;
    c.ffn_hidden = get_usize(cfg, "moe_intermediate_size", origin)?;
    c.n_shared_expert = shared;
    (c.capacity_factor, c.moe_aux_weight, c.moe_z_weight) = (0.0, 0.0, 0.0);
    c.moe_router = crate::config::MoeRouter::Sigmoid;
    (c.moe_groups, c.moe_topk_groups) = (num("n_group", 1.0) as usize, num("topk_group", 1.0) as usize);
    c.moe_gate_scale = num("routed_scaling_factor", 2.5) as f32;
    Ok(())
}

/// DeepSeek-V3's `config.json` for a model with latent attention, every layer dense.
fn deepseek_v3_export(c: &GptConfig) -> Result<Value, String> {
    let routed = c.is_moe() && is_deepseek_moe(c) && c.capacity_factor <= 0.0 && c.moe_aux_weight == 0.0;
    if (c.is_moe() && !routed) || c.sliding_window > 0 || !c.nope_layers.is_empty() || c.rope_scaling.is_some() || c.block_norms != BlockNorms::Pre || c.attn_sinks > 0 {
        return Err("export: multi-head latent attention has a Hugging Face form only as DeepSeek-V3's, every layer dense or routed by its sigmoid router (dropless, at most one shared expert), without a window, NoPE layers, rope scaling or norms after the branches".into());
    }
    let mut v = json!({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
        "hidden_size": c.n_embd, "intermediate_size": c.dense_hidden(), "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head, "num_key_value_heads": c.n_head,
        "kv_lora_rank": c.kv_lora_rank, "q_lora_rank": if c.q_lora_rank > 0 { Value::from(c.q_lora_rank) } else { Value::Null },
        "qk_nope_head_dim": c.head_size() - c.rotary_dim, "qk_rope_head_dim": c.rotary_dim, "v_head_dim": c.v_head_dim,
        "rope_interleave": c.rope_interleave, "first_k_dense_replace": c.n_layer, "n_routed_experts": 0, "n_shared_experts": 0,
        "max_position_embeddings": c.block_size, "vocab_size": c.vocab_size, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta, "rope_parameters": rope_parameters(c),
        "tie_word_embeddings": c.tied_embeddings, "attention_bias": false, "attention_dropout": 0.0,
        "pad_token_id": c.pad_token_id, "dtype": "float32",
    });
    if c.is_moe() {
        let o = v.as_object_mut().unwrap();
        for (k, x) in [
            ("first_k_dense_replace", Value::from(c.moe_first_layer)), ("n_routed_experts", c.n_expert.into()), ("n_shared_experts", c.n_shared_expert.into()),
            ("moe_intermediate_size", c.ffn_hidden.into()), ("num_experts_per_tok", c.top_k.into()), ("n_group", c.moe_groups.into()),
            ("topk_group", c.moe_topk_groups.into()), ("routed_scaling_factor", c.moe_gate_scale.into()), ("norm_topk_prob", true.into()),
        ] {
            o.insert(k.into(), x);
        }
    }
    Ok(v)
}

/// Gemma 2 and Gemma 3's text model (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`): LLaMA's layout
/// with sandwich norms that scale by `1 + w`, GeGLU, embeddings times `√C` (a tied head by
/// default), logits scaled by `query_pre_attn_scalar^-½` and soft-capped (Gemma 2's defaults 50
/// and 30, Gemma 3's none), and sliding-window layers (`layer_types`, or every layer but each
/// `sliding_window_pattern`-th: 2 for Gemma 2, 6 for Gemma 3). Gemma 3 adds per-head q/k norms
/// and its local layers' own rotary base: transformers 5's per-layer-type `rope_parameters` or
/// the older `rope_theta`, `rope_local_base_freq` and `rope_scaling`. The configs' defaults
/// where the file has none; bidirectional attention is refused by name.
fn gemma_config(cfg: &Value, origin: &Path, version: u8) -> Result<GptConfig, String> {
    let act = cfg.get("hidden_activation").or_else(|| cfg.get("hidden_act")).and_then(Value::as_str).unwrap_or("gelu_pytorch_tanh");
    if act != "gelu_pytorch_tanh" {
        return Err(format!("{}: hidden_activation `{act}` is not supported (Gemma's GeGLU uses gelu_pytorch_tanh)", origin.display()));
    }
    if cfg.get("use_bidirectional_attention").and_then(Value::as_bool) == Some(true) {
        return Err(format!("{}: `use_bidirectional_attention` = true is not supported (kiln trains causal decoders)", origin.display()));
    }
    // LLaMA's reader on a copy: the global layers' rotary parameters where it looks for them,
    // the tied head by default, the layer types listed.
    let mut flat = cfg.clone();
    let o = flat.as_object_mut().ok_or_else(|| format!("{}: not a JSON object", origin.display()))?;
    o.remove("hidden_act");
    let local = if version == 3 { Some(gemma3_rope(cfg, o, origin)?) } else { None };
    o.entry("tie_word_embeddings").or_insert(true.into());
    o.entry("sliding_window").or_insert(4096.into());
    if !o.contains_key("layer_types") {
        let n = get_usize(cfg, "num_hidden_layers", origin)?.min(MAX_LISTED_LAYERS);
        let every = cfg.get("sliding_window_pattern").and_then(Value::as_u64).unwrap_or(if version == 2 { 2 } else { 6 }).max(1) as usize;
        o.insert("layer_types".into(), (0..n).map(|l| if (l + 1) % every == 0 { "full_attention" } else { "sliding_attention" }).collect::<Vec<_>>().into());
    }
    let mut c = llama_config(&flat, origin, false)?;
    (c.block_norms, c.gate_act, c.norm_offset, c.embed_scale, c.qk_norm) = (BlockNorms::Sandwich, GateAct::GeluTanh, true, true, version == 3);
    let qpas = cfg.get("query_pre_attn_scalar").and_then(Value::as_u64).map_or(256, |q| q as usize);
    c.query_pre_attn_scalar = if qpas == c.head_size() { 0 } else { qpas };
    // Soft-caps: a number, or null for none; absent, the class's default.
    let cap = |key: &str, default: f32| match cfg.get(key) {
        None => Ok(default),
        Some(Value::Null) => Ok(0.0),
        Some(v) => v.as_f64().map(|x| x as f32).filter(|x| *x > 0.0 && x.is_finite()).ok_or_else(|| format!("{}: `{key}` = {v} is not a positive cap (or null)", origin.display())),
    };
    let (attn, last) = if version == 2 { (50.0, 30.0) } else { (0.0, 0.0) };
    (c.attn_softcap, c.final_softcap) = (cap("attn_logit_softcapping", attn)?, cap("final_logit_softcapping", last)?);
    if cfg.get("pad_token_id").is_none() && c.vocab_size > 0 {
        c.pad_token_id = Some(0);
    }
    c.norm_eps = get_f32(cfg, "rms_norm_eps", 1e-6);
    windows(&mut c, &flat, origin, 0)?;
    let types = flat["layer_types"].as_array().cloned().unwrap_or_default();
    let sliding = types.iter().any(|t| t == "sliding_attention");
    if sliding && c.sliding_window == 0 {
        // A window as wide as the context: every position visible, the layers still local.
        if types.len() != c.n_layer {
            return Err(format!("{}: `layer_types` lists {} layers, but `num_hidden_layers` is {}", origin.display(), types.len(), c.n_layer));
        }
        c.sliding_window = c.block_size;
        c.window_layers = (0..c.n_layer).filter(|&l| types[l] == "sliding_attention").collect();
        if c.window_layers.len() == c.n_layer {
            c.window_layers.clear();
        }
    }
    if let Some(local) = local.filter(|&l| sliding && (l as f32 != c.rope_theta || c.rope_scaling.is_some())) {
        c.rope_local_theta = local as f32;
    }
    c.validate().map_err(|e| format!("{}: {e}", origin.display()))?;
    Ok(c)
}

/// Gemma 3's rotary parameters: puts the global layers' where [`llama_config`] reads them (in
/// `o`, a copy of `cfg`) and returns the local layers' base (plain RoPE).
fn gemma3_rope(cfg: &Value, o: &mut serde_json::Map<String, Value>, origin: &Path) -> Result<f64, String> {
    let per_type = cfg.get("rope_parameters").filter(|r| r.get("full_attention").is_some() || r.get("sliding_attention").is_some());
    Ok(match per_type {
        Some(r) => {
            o.insert("rope_parameters".into(), r.get("full_attention").cloned().unwrap_or_else(|| json!({"rope_type": "default", "rope_theta": 1e6})));
            let l = r.get("sliding_attention");
            if l.and_then(|l| l.get("rope_type")).and_then(Value::as_str).is_some_and(|t| t != "default") {
                return Err(format!("{}: `rope_parameters.sliding_attention` must be plain RoPE (rope_type default)", origin.display()));
            }
            l.and_then(|l| l.get("rope_theta")).and_then(Value::as_f64).unwrap_or(1e4)
        }
        None => {
            o.entry("rope_theta").or_insert(1e6.into());
            cfg.get("rope_local_base_freq").and_then(Value::as_f64).unwrap_or(1e4)
        }
    })
}

/// Mixtral's and Qwen3-MoE's routing: top `num_experts_per_tok`, without capacity (dropless);
/// their aux coefficient multiplies a loss K times kiln's (see tensor::moe), so the weight is
/// scaled to match. transformers adds that loss only with `output_router_logits` (false in their
/// own configs); `--set model.moe_aux_weight` turns it on.
fn moe_routing(c: &mut GptConfig, cfg: &Value, origin: &Path) -> Result<(), String> {
    c.top_k = get_usize(cfg, "num_experts_per_tok", origin)?;
    c.capacity_factor = 0.0;
    let aux = cfg.get("output_router_logits").and_then(Value::as_bool).unwrap_or(false);
    c.moe_aux_weight = if aux { get_f32(cfg, "router_aux_loss_coef", 0.001) * c.top_k as f32 } else { 0.0 };
    c.moe_z_weight = 0.0;
    Ok(())
}

/// The sliding window of `cfg` and the layers it applies to: per `layer_types`
/// (`"sliding_attention"` / `"full_attention"`, transformers' per-layer form) when the config
/// has it, else from layer `from` on (Mistral: 0, every layer; Qwen2: `max_window_layers`). A
/// window no shorter than the context changes nothing, and is dropped.
fn windows(c: &mut GptConfig, cfg: &Value, origin: &Path, from: usize) -> Result<(), String> {
    let w = cfg.get("sliding_window").and_then(Value::as_u64).map_or(0, |w| w as usize);
    if w == 0 || w >= c.block_size {
        return Ok(());
    }
    let types = cfg.get("layer_types").and_then(Value::as_array);
    if types.is_none() && from == 0 {
        // Every layer: the plain form.
        c.sliding_window = w;
        return Ok(());
    }
    let layers: Vec<usize> = match types {
        Some(types) => {
            if types.len() != c.n_layer {
                return Err(format!("{}: `layer_types` lists {} layers, but `num_hidden_layers` is {}", origin.display(), types.len(), c.n_layer));
            }
            let mut v = Vec::new();
            for (l, t) in types.iter().enumerate() {
                match t.as_str() {
                    Some("sliding_attention") => v.push(l),
                    Some("full_attention") => {}
                    _ => return Err(format!("{}: `layer_types`[{l}] = {t} is not `sliding_attention` or `full_attention`", origin.display())),
                }
            }
            v
        }
        None if from >= c.n_layer => Vec::new(),
        // Listed one by one: a (hostile) config's layer count must not size the list.
        None if c.n_layer > MAX_LISTED_LAYERS => {
            return Err(format!("{}: `num_hidden_layers` = {} with a sliding window from layer {from} on: more layers than kiln lists ({MAX_LISTED_LAYERS})", origin.display(), c.n_layer));
        }
        None => (from..c.n_layer).collect(),
    };
    if layers.is_empty() {
        return Ok(());
    }
    c.sliding_window = w;
    // Every layer windowed is the plain form (an empty list).
    c.window_layers = if layers.len() == c.n_layer { Vec::new() } else { layers };
    Ok(())
}

/// The most layers a per-layer window list is built for.
const MAX_LISTED_LAYERS: usize = 1 << 16;

fn get_f32(cfg: &Value, key: &str, default: f32) -> f32 {
    cfg.get(key).and_then(Value::as_f64).map_or(default, |v| v as f32)
}

/// A LLaMA-family config (`qkv_bias`: Qwen2's q/k/v biases).
fn llama_config(cfg: &Value, origin: &Path, qkv_bias: bool) -> Result<GptConfig, String> {
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
    // transformers' head_dim; kiln keeps 0 when it is hidden_size / num_attention_heads.
    let head_dim = match cfg.get("head_dim").and_then(Value::as_u64) {
        Some(hd) if (hd as usize).checked_mul(n_head) != Some(n_embd) => hd as usize,
        _ => 0,
    };
    let (theta, rope_scaling) = rope_of(cfg, origin)?;
    // transformers turns the first `int(head_dim · partial_rotary_factor)` dimensions of a head
    // (the factor at the top level or in `rope_parameters`).
    let hs = if head_dim > 0 { head_dim } else { n_embd / n_head.max(1) };
    let partial = cfg.get("partial_rotary_factor").or_else(|| cfg.get("rope_parameters").and_then(|r| r.get("partial_rotary_factor"))).filter(|v| !v.is_null());
    let rotary_dim = match partial {
        None => 0,
        Some(f) => {
            let f = f.as_f64().filter(|f| *f > 0.0 && *f <= 1.0).ok_or_else(|| format!("{}: `partial_rotary_factor` = {f} is not in (0, 1]", origin.display()))?;
            let rot = (hs as f64 * f) as usize;
            // Of the classes kiln reads, only Phi-3's passes the unturned dimensions through.
            let phi3 = arch_of(cfg) == "Phi3ForCausalLM";
            if rot < hs && (!phi3 || rot == 0) {
                return Err(format!("{}: `partial_rotary_factor` = {f} turns {rot} of {hs} dimensions: supported for Phi3ForCausalLM only, and on at least one pair", origin.display()));
            }
            if rot == hs { 0 } else { rot }
        }
    };
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
        rope_scaling,
        qkv_bias,
        // The embedding's `padding_idx` (a row of the vocabulary; `null` or absent: none; a
        // negative one counts from the end, as `nn.Embedding` takes it).
        pad_token_id: match cfg.get("pad_token_id").filter(|v| !v.is_null()) {
            None => None,
            Some(v) => {
                let bad = || format!("{}: `pad_token_id` = {v} is not a token id", origin.display());
                let p = v.as_i64().ok_or_else(bad)?;
                let vocab = get_usize(cfg, "vocab_size", origin)? as i64;
                Some(usize::try_from(if p < 0 { vocab + p } else { p }).map_err(|_| bad())?)
            }
        },
        head_dim,
        rotary_dim,
        norm_eps: get_f32(cfg, "rms_norm_eps", 1e-6),
        ..GptConfig::gpt2((1, 1, 1), 1, 1, false, 0.0, false)
    };
    c.validate().map_err(|e| format!("{}: {e}", origin.display()))?;
    Ok(c)
}

/// The rotary base and scaling: transformers 5's `rope_parameters` (`rope_theta`, `rope_type`
/// and its factors), or the older top-level `rope_theta` with `rope_scaling` (`type` or
/// `rope_type`). Supported types: `default`, `linear`, `llama3`, `yarn`, `longrope`, `dynamic`; others are
/// refused by name.
fn rope_of(cfg: &Value, origin: &Path) -> Result<(f32, Option<RopeScaling>), String> {
    let params = cfg.get("rope_parameters").filter(|v| v.is_object());
    let scaling = cfg.get("rope_scaling").filter(|v| v.is_object());

    let theta = params.and_then(|r| r.get("rope_theta")).and_then(Value::as_f64).map_or(get_f32(cfg, "rope_theta", 10000.0), |v| v as f32);
    let Some(r) = scaling.or(params) else { return Ok((theta, None)) };
    let key = if scaling.is_some() { "rope_scaling" } else { "rope_parameters" };
    let ty = r.get("rope_type").or_else(|| r.get("type")).and_then(Value::as_str).unwrap_or("default");
    // Phi3Config reads its older names `su` and `yarn` as LongRoPE.
    let phi3 = arch_of(cfg) == "Phi3ForCausalLM";
    let ty = if phi3 && (ty == "su" || ty == "yarn") { "longrope" } else { ty };
    let num = |k: &str| r.get(k).and_then(Value::as_f64).map(|v| v as f32).ok_or_else(|| format!("{}: `{key}.{k}` is missing or not a number", origin.display()));
    let scaling = match ty {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: num("factor")? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
        }),
        "yarn" => Some(yarn_of(cfg, r, key, origin)?),
        "longrope" => Some(longrope_of(cfg, r, key, origin)?),
        // transformers' original context for dynamic NTK is max_position_embeddings.
        "dynamic" => Some(RopeScaling::Dynamic {
            factor: num("factor")?,
            original_max_position_embeddings: cfg.get("max_position_embeddings").and_then(Value::as_u64).unwrap_or(0) as usize,
        }),
        other => {
            return Err(format!("{}: `{key}` type `{other}` is not supported (supported: default, linear, llama3, yarn, longrope, dynamic)", origin.display()));
        }
    };
    Ok((theta, scaling))
}

/// YaRN's parameters as transformers resolves them: `original_max_position_embeddings` from the
/// config's top level (Phi-3's), else the rope dictionary, else `max_position_embeddings`;
/// `factor` if given, else the ratio of the two lengths; `beta_fast` / `beta_slow` 32 / 1 when
/// absent or zero; `attention_factor` if given, else `0.1·ln(factor) + 1` (YaRN's mscale), or
/// with both `mscale` and `mscale_all_dim` (DeepSeek's) the ratio of the two mscales.
fn yarn_of(cfg: &Value, r: &Value, key: &str, origin: &Path) -> Result<RopeScaling, String> {
    let max_pos = cfg.get("max_position_embeddings").and_then(Value::as_f64);
    let opt = |k: &str| r.get(k).filter(|v| !v.is_null());
    let num = |k: &str| opt(k).map(|v| v.as_f64().ok_or_else(|| format!("{}: `{key}.{k}` is not a number", origin.display()))).transpose();
    let orig = original_context(cfg, r, key, origin)?;
    let factor = match num("factor")? {
        Some(f) => f,
        None => max_pos.ok_or_else(|| format!("{}: `{key}.factor` is missing and there is no max_position_embeddings to derive it", origin.display()))? / orig,
    };
    let attention_factor = match num("attention_factor")? {
        Some(a) => a,
        None => match (num("mscale")?.filter(|m| *m != 0.0), num("mscale_all_dim")?.filter(|m| *m != 0.0)) {
            (Some(m), Some(all)) => yarn_mscale(factor, m) / yarn_mscale(factor, all),
            _ => yarn_mscale(factor, 1.0),
        },
    };
    let beta = |k: &str, default: f64| -> Result<f32, String> { Ok(num(k)?.filter(|b| *b != 0.0).unwrap_or(default) as f32) };
    let truncate = match opt("truncate") {
        None => true,
        Some(v) => v.as_bool().ok_or_else(|| format!("{}: `{key}.truncate` is not true or false", origin.display()))?,
    };
    Ok(RopeScaling::Yarn {
        factor: factor as f32,
        original_max_position_embeddings: orig as usize,
        beta_fast: beta("beta_fast", 32.0)?,
        beta_slow: beta("beta_slow", 1.0)?,
        attention_factor: attention_factor as f32,
        truncate,
    })
}

/// The original context of YaRN or LongRoPE as transformers resolves it: the config's top level
/// (Phi-3's), else the rope dictionary's, else `max_position_embeddings`.
fn original_context(cfg: &Value, r: &Value, key: &str, origin: &Path) -> Result<f64, String> {
    let at = |v: &Value, k: &str| v.get(k).filter(|v| !v.is_null()).map(|v| v.as_f64().ok_or_else(|| format!("{}: `{k}` is not a number", origin.display())));
    match at(cfg, "original_max_position_embeddings").or_else(|| at(r, "original_max_position_embeddings")) {
        Some(o) => o,
        None => cfg
            .get("max_position_embeddings")
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("{}: `{key}` needs original_max_position_embeddings (or max_position_embeddings)", origin.display())),
    }
}

/// LongRoPE's parameters as transformers resolves them (`_compute_longrope_parameters`): the two
/// factor lists, the original context ([`original_context`]), and `attention_factor` if given,
/// else `sqrt(1 + ln(factor) / ln(original))` with `factor` the dictionary's or the ratio of
/// `max_position_embeddings` to the original context.
fn longrope_of(cfg: &Value, r: &Value, key: &str, origin: &Path) -> Result<RopeScaling, String> {
    let list = |k: &str| -> Result<Vec<f32>, String> {
        let bad = || format!("{}: `{key}.{k}` is missing or not a list of numbers", origin.display());
        r.get(k).and_then(Value::as_array).ok_or_else(bad)?.iter().map(|v| v.as_f64().map(|x| x as f32).ok_or_else(bad)).collect()
    };
    let orig = original_context(cfg, r, key, origin)?;
    let num = |k: &str| r.get(k).filter(|v| !v.is_null()).map(|v| v.as_f64().ok_or_else(|| format!("{}: `{key}.{k}` is not a number", origin.display()))).transpose();
    let factor = match num("factor")? {
        Some(f) => f,
        None => cfg.get("max_position_embeddings").and_then(Value::as_f64).unwrap_or(orig) / orig,
    };
    let attention_factor = num("attention_factor")?.unwrap_or_else(|| longrope_attention_factor(factor, orig as usize));
    Ok(RopeScaling::LongRope {
        short_factor: list("short_factor")?,
        long_factor: list("long_factor")?,
        original_max_position_embeddings: orig as usize,
        attention_factor: attention_factor as f32,
    })
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
    let mut c = GptConfig::gpt2((get_usize(cfg, "n_layer", origin)?, get_usize(cfg, "n_head", origin)?, n_embd), get_usize(cfg, "n_positions", origin)?, get_usize(cfg, "vocab_size", origin)?, true, 0.0, cfg.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(true));
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
        let mut files = Vec::new();
        for f in map.values() {
            // A shard is a file of this directory: no paths out of it.
            match f.as_str() {
                Some(name) if !name.is_empty() && !name.contains(['/', '\\']) && name != ".." => files.push(dir.join(name)),
                _ => return Err(format!("{}: weight_map entry {f} is not a file name in this directory", index.display())),
            }
        }
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

/// An HF directory's `config.json`: the kiln config it resolves to, and the JSON itself. Reads
/// nothing else, so a caller can size the model before `import_hf` allocates it.
pub fn read_config(dir: &Path) -> Result<(GptConfig, Value), String> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: invalid JSON: {e}", cfg_path.display()))?;
    Ok((hf_config(&v, &cfg_path)?, v))
}

/// Qwen3-MoE's name of a kiln MoE parameter (Mixtral's names in kiln's layout): the router
/// `mlp.gate`, expert `e`'s `w1` / `w3` / `w2` as `mlp.experts.e.gate_proj` / `up_proj` /
/// `down_proj`.
fn qwen3_moe_name(name: &str) -> Option<String> {
    let (stem, rest) = name.split_once("block_sparse_moe.")?;
    if rest == "gate.weight" {
        return Some(format!("{stem}mlp.gate.weight"));
    }
    let (e, w) = rest.strip_prefix("experts.")?.split_once('.')?;
    let hf = match w {
        "w1.weight" => "gate_proj",
        "w3.weight" => "up_proj",
        "w2.weight" => "down_proj",
        _ => return None,
    };
    Some(format!("{stem}mlp.experts.{e}.{hf}.weight"))
}

/// Whether `cfg`'s Hugging Face form is Qwen3-MoE's (per-head norms and experts).
/// Whether `cfg`'s experts are stored under DeepSeek-V3's names (its sigmoid router).
fn is_deepseek_moe(cfg: &GptConfig) -> bool {
    cfg.moe_router == crate::config::MoeRouter::Sigmoid
}

/// Under several shared experts, where DeepSeek-V3 keeps kiln's shared expert `s`'s projection
/// `name`: the one shared MLP (`S·F` wide) tensor's name, `s`, and kiln's projection (`w1`,
/// `w3`: rows of gate_proj, up_proj; `w2`: columns of down_proj).
fn deepseek_shared_of(cfg: &GptConfig, name: &str) -> Option<(String, usize, &'static str)> {
    if cfg.n_shared_expert < 2 {
        return None;
    }
    let (stem, rest) = name.split_once("block_sparse_moe.shared_experts.")?;
    let (s, w) = rest.split_once('.')?;
    let (hf, w) = match w {
        "w1.weight" => ("gate_proj", "w1.weight"),
        "w3.weight" => ("up_proj", "w3.weight"),
        "w2.weight" => ("down_proj", "w2.weight"),
        _ => return None,
    };
    Some((format!("{stem}mlp.shared_experts.{hf}.weight"), s.parse().ok()?, w))
}

/// DeepSeek-V3's name for a kiln MoE parameter (Mixtral's names in kiln's layout): the router
/// and its correction bias under `mlp.gate`, the routed experts' projections, and the one shared
/// expert as `mlp.shared_experts`.
fn deepseek_moe_name(name: &str) -> Option<String> {
    // The router and routed experts as Qwen3-MoE names them; then the bias and the shared one.
    if let Some(n) = qwen3_moe_name(name) {
        return Some(n);
    }
    let (stem, rest) = name.split_once("block_sparse_moe.")?;
    if rest.starts_with("gate.") {
        return Some(format!("{stem}mlp.{rest}"));
    }
    // The one shared expert's projections, named as routed expert 0's without the index.
    let n = qwen3_moe_name(&format!("{stem}block_sparse_moe.experts.0.{}", rest.strip_prefix("shared_experts.0.")?))?;
    Some(n.replace("mlp.experts.0.", "mlp.shared_experts."))
}

fn is_qwen3_moe(cfg: &GptConfig) -> bool {
    cfg.qk_norm && cfg.is_moe()
}

/// Where a Hugging Face file of a model `cfg` stores kiln parameter `name` (`rows` rows) when
/// not under its own name: the stored tensor's name, and the first row and row count of that
/// tensor — Phi-3's q|k|v in `qkv_proj` and gate|up in `gate_up_proj`, or Qwen3-MoE's names for
/// the experts and router (the whole tensor).
fn stored_of(cfg: &GptConfig, name: &str, rows: usize) -> Option<(String, usize, usize)> {
    if is_qwen3_moe(cfg) {
        return qwen3_moe_name(name).map(|n| (n, 0, rows));
    }
    if is_deepseek_moe(cfg) {
        if let Some((hf, s, w)) = deepseek_shared_of(cfg, name) {
            // gate and up: rows `s·F..` of the one shared MLP (down's columns: `read_into`).
            return (w != "w2.weight").then_some((hf, s * cfg.ffn_hidden, cfg.n_shared_expert * cfg.ffn_hidden));
        }
        return deepseek_moe_name(name).map(|n| (n, 0, rows));
    }
    fused_of(cfg, name)
}

/// Where Phi-3 stores kiln parameter `name` (`[rows, cols]`): its fused tensor's name, and the
/// first row and row count of that tensor (q|k|v in `qkv_proj`, gate|up in `gate_up_proj`).
fn fused_of(cfg: &GptConfig, name: &str) -> Option<(String, usize, usize)> {
    if !cfg.fused_proj {
        return None;
    }
    let (q, kv, f) = (cfg.n_head * cfg.head_size(), cfg.n_kv_head * cfg.head_size(), cfg.ffn_hidden);
    let parts = [
        ("self_attn.q_proj.weight", "self_attn.qkv_proj.weight", 0, q + 2 * kv),
        ("self_attn.k_proj.weight", "self_attn.qkv_proj.weight", q, q + 2 * kv),
        ("self_attn.v_proj.weight", "self_attn.qkv_proj.weight", q + kv, q + 2 * kv),
        ("mlp.gate_proj.weight", "mlp.gate_up_proj.weight", 0, 2 * f),
        ("mlp.up_proj.weight", "mlp.gate_up_proj.weight", f, 2 * f),
    ];
    parts.iter().find_map(|&(own, fused, first, rows)| name.strip_suffix(own).map(|stem| (format!("{stem}{fused}"), first, rows)))
}

/// Parameter `p` (kiln's `[out, in]`) in fp32 into `dst` from tensor `t`, stored under `name` as
/// `p` itself (GPT-2's Conv1D matrices transposed) or, with `fused`, as rows `first..` of a
/// Phi-3 tensor of `rows` rows.
fn fill(dst: &mut [f32], t: &TensorView, name: &str, p: (&str, &[usize]), fused: Option<(usize, usize)>, origin: &Path) -> Result<(), String> {
    let (pname, shape) = p;
    let want: Vec<usize> = match fused {
        Some((_, rows)) => vec![rows, shape[1]],
        None if is_conv1d(pname) => vec![shape[1], shape[0]],
        None => shape.to_vec(),
    };
    if t.shape() != want.as_slice() {
        return Err(format!("{}: tensor `{name}` has shape {:?}, expected {want:?}", origin.display(), t.shape()));
    }
    let src = to_f32(t).map_err(|e| format!("{}: tensor `{name}`: {e}", origin.display()))?;
    match fused {
        Some((first, _)) => dst.copy_from_slice(&src[first * shape[1]..(first + shape[0]) * shape[1]]),
        None if is_conv1d(pname) => transpose(dst, &src, want[0], want[1]),
        None => dst.copy_from_slice(&src),
    }
    Ok(())
}

/// Loads an HF directory into a kiln model. Every kiln parameter must be present with the
/// right shape; tensors kiln does not use (e.g. `attn.bias` masks, rotary caches) are ignored.
/// The weights are read tensor by tensor ([`TensorReader`]): beside the model's fp32
/// parameters, at most one tensor's bytes and its fp32 values exist at a time
/// ([`TensorReader::scratch_bytes`]), never a weight file whole.
pub fn import_hf(dir: &Path) -> Result<Gpt, String> {
    let mut m = import_hf_frozen(dir)?;
    m.grads = vec![0.0; m.layout.total];
    Ok(m)
}

/// [`import_hf`] without gradient buffers ([`Gpt::zeroed_frozen`]): a base LoRA adapts.
pub fn import_hf_frozen(dir: &Path) -> Result<Gpt, String> {
    let (cfg, _) = read_config(dir)?;
    let vocab = cfg.vocab_size;
    let mut m = Gpt::zeroed_frozen(cfg, vocab);
    let reader = TensorReader::open(dir)?;
    for p in &m.layout.params {
        reader.read_into(&p.name, &p.shape, &mut m.params[p.range()])?;
    }
    Ok(m)
}

/// Reads an HF directory's tensors one at a time, by name, without loading a weight file
/// whole: each file's safetensors header is parsed once, then a tensor's bytes are read at its
/// offset (what a quantized base is built from, so only one tensor exists in fp32 at a time).
pub struct TensorReader {
    /// name → (file, dtype, shape, byte range in the file)
    tensors: BTreeMap<String, (PathBuf, Dtype, Vec<usize>, std::ops::Range<u64>)>,
    /// The directory's config, where it has one kiln reads (it says whether tensors are fused).
    cfg: Option<GptConfig>,
    /// The directory, named in errors.
    dir: PathBuf,
}

impl TensorReader {
    pub fn open(dir: &Path) -> Result<TensorReader, String> {
        use std::io::Read;
        let mut tensors = BTreeMap::new();
        for file in weight_files(dir)? {
            let bad = |e: String| format!("{}: {e}", file.display());
            let mut f = std::fs::File::open(&file).map_err(|e| bad(e.to_string()))?;
            let size = f.metadata().map_err(|e| bad(e.to_string()))?.len();
            let mut n = [0u8; 8];
            f.read_exact(&mut n).map_err(|e| bad(format!("no safetensors header: {e}")))?;
            let n = u64::from_le_bytes(n);
            if n > size.saturating_sub(8) || n > 100 << 20 {
                return Err(bad(format!("safetensors header of {n} bytes does not fit the file's {size}")));
            }
            let mut head = vec![0u8; n as usize];
            f.read_exact(&mut head).map_err(|e| bad(e.to_string()))?;
            // The header alone (safetensors' own parser wants the whole file in memory).
            let meta: BTreeMap<String, Value> = serde_json::from_slice(&head).map_err(|e| bad(format!("safetensors header: {e}")))?;
            let start = 8 + n;
            for (name, info) in meta.iter().filter(|(k, _)| *k != "__metadata__") {
                let dtype = match info.get("dtype").and_then(Value::as_str) {
                    Some("F32") => Dtype::F32,
                    Some("BF16") => Dtype::BF16,
                    Some("F16") => Dtype::F16,
                    other => return Err(bad(format!("tensor `{name}`: dtype {other:?} is not supported (F32, BF16 or F16)"))),
                };
                let nums = |k: &str| -> Option<Vec<u64>> { info.get(k)?.as_array()?.iter().map(Value::as_u64).collect() };
                let (Some(shape), Some(off)) = (nums("shape"), nums("data_offsets")) else {
                    return Err(bad(format!("tensor `{name}`: no shape or data_offsets")));
                };
                let elems = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
                let width = if dtype == Dtype::F32 { 4 } else { 2 };
                let (a, b) = match off[..] {
                    [a, b] if a <= b && elems.and_then(|e| e.checked_mul(width)) == Some(b - a) => (start + a, start + b),
                    _ => return Err(bad(format!("tensor `{name}`: data_offsets {off:?} do not hold shape {shape:?}"))),
                };
                if b > size {
                    return Err(bad(format!("tensor `{name}` runs past the end of the file")));
                }
                tensors.insert(name.to_string(), (file.clone(), dtype, shape.iter().map(|&d| d as usize).collect(), a..b));
            }
        }
        Ok(TensorReader { tensors, cfg: read_config(dir).ok().map(|(c, _)| c), dir: dir.to_path_buf() })
    }

    /// The most bytes [`TensorReader::read_into`] holds besides its destination: the largest
    /// tensor's stored bytes and their fp32 values.
    pub fn scratch_bytes(&self) -> u64 {
        self.tensors.values().map(|(_, _, shape, range)| (range.end - range.start) + 4 * shape.iter().product::<usize>() as u64).max().unwrap_or(0)
    }

    /// Parameter `name` of kiln's layout (shape `shape`, kiln's `[out, in]`) in fp32 into `dst`:
    /// converted from the file's dtype and, for GPT-2's Conv1D matrices, transposed.
    /// (Phi-3's rows of its fused `qkv_proj` / `gate_up_proj`.)
    pub fn read_into(&self, name: &str, shape: &[usize], dst: &mut [f32]) -> Result<(), String> {
        if let Some((c, (hf, s, _))) = self.cfg.as_ref().and_then(|c| deepseek_shared_of(c, name).filter(|x| x.2 == "w2.weight").map(|x| (c, x))) {
            // DeepSeek-V3's shared MLP down-projection `[C, S·F]`: shared expert `s`'s columns.
            let (rows, f) = (shape[0], shape[1]);
            let mut whole = vec![0.0f32; rows * f * c.n_shared_expert];
            self.read_into(&hf, &[rows, f * c.n_shared_expert], &mut whole)?;
            for (d, w) in dst.chunks_mut(f).zip(whole.chunks(f * c.n_shared_expert)) {
                d.copy_from_slice(&w[s * f..(s + 1) * f]);
            }
            return Ok(());
        }
        use std::os::unix::fs::FileExt;
        let (stored, fused) = match self.cfg.as_ref().and_then(|c| stored_of(c, name, shape[0])) {
            // A whole tensor under another name (Qwen3-MoE's, DeepSeek-V3's) reads as itself.
            Some((f, 0, rows)) if rows == shape[0] => (f, None),
            Some((f, first, rows)) => (f, Some((first, rows))),
            None => (name.to_string(), None),
        };
        let (file, dtype, have, range) = self.tensors.get(&stored).ok_or_else(|| format!("{}: checkpoint has no tensor `{stored}`", self.dir.display()))?;
        let mut bytes = vec![0u8; (range.end - range.start) as usize];
        let f = std::fs::File::open(file).map_err(|e| format!("{}: {e}", file.display()))?;
        f.read_exact_at(&mut bytes, range.start).map_err(|e| format!("{}: {e}", file.display()))?;
        let view = TensorView::new(*dtype, have.clone(), &bytes).map_err(|e| format!("{}: tensor `{stored}`: {e}", file.display()))?;
        fill(dst, &view, &stored, (name, shape), fused, file)
    }
}

/// Little-endian f32 bytes stored as `dtype` (bf16 / f16 rounded to nearest even; F32 as is).
pub fn narrow(f32_bytes: &[u8], dtype: Dtype) -> Vec<u8> {
    let vals = f32_bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    match dtype {
        Dtype::BF16 => vals.flat_map(|x| half::bf16::from_f32(x).to_le_bytes()).collect(),
        Dtype::F16 => vals.flat_map(|x| half::f16::from_f32(x).to_le_bytes()).collect(),
        _ => f32_bytes.to_vec(),
    }
}

/// A tensor's values as f32: F32 as stored, BF16 and F16 widened exactly.
fn to_f32(t: &TensorView) -> Result<Vec<f32>, String> {
    let d = t.data();
    let halves = || d.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    Ok(match t.dtype() {
        Dtype::F32 => d.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::BF16 => halves().map(|h| half::bf16::from_bits(h).to_f32()).collect(),
        Dtype::F16 => halves().map(|h| half::f16::from_bits(h).to_f32()).collect(),
        other => return Err(format!("dtype {other:?} is not supported (F32, BF16 or F16)")),
    })
}

/// `dst[cols, rows] = srcᵀ` for `src[rows, cols]`.
fn transpose(dst: &mut [f32], src: &[f32], rows: usize, cols: usize) {
    for r in 0..rows {
        for c in 0..cols {
            dst[c * rows + r] = src[r * cols + c];
        }
    }
}

/// How [`export_hf_with`] stores the weights.
#[derive(Clone, Copy, Debug)]
pub struct ExportOpts {
    /// `F32`, `BF16` (round to nearest even) or `F16`.
    pub dtype: Dtype,
    /// Above this many bytes of tensors, the weights go into shards
    /// `model-0000K-of-0000N.safetensors` with a `model.safetensors.index.json`, as
    /// `save_pretrained(max_shard_size=…)` writes them.
    pub max_shard_bytes: u64,
}

impl Default for ExportOpts {
    fn default() -> Self {
        ExportOpts { dtype: Dtype::F32, max_shard_bytes: 5_000_000_000 }
    }
}

/// [`export_hf_with`] in f32, unsharded up to 5 GB.
pub fn export_hf(m: &Gpt, dir: &Path) -> Result<(), String> {
    export_hf_with(m, dir, ExportOpts::default())
}

/// Writes `config.json` and the weights in HF's format (`GPT2LMHeadModel`, `LlamaForCausalLM`,
/// `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, `MistralForCausalLM`,
/// `MixtralForCausalLM` or `Phi3ForCausalLM`) into `dir`.
pub fn export_hf_with(m: &Gpt, dir: &Path, opts: ExportOpts) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut config = export_config(&m.cfg)?;
    let dtype_name = match opts.dtype {
        Dtype::F32 => "float32",
        Dtype::BF16 => "bfloat16",
        Dtype::F16 => "float16",
        other => return Err(format!("export: dtype {other:?} is not supported (F32, BF16 or F16)")),
    };
    config["dtype"] = dtype_name.into();
    write_weights(dir, export_tensors(m), opts)?;
    let path = dir.join("config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).map_err(|e| format!("{}: {e}", path.display()))
}

/// Writes `data` (f32 bytes) in `opts.dtype` as `model.safetensors`, or as shards with an index
/// above `opts.max_shard_bytes` (removing the other form's stale file).
fn write_weights(dir: &Path, data: BTreeMap<String, (Vec<usize>, Vec<u8>)>, opts: ExportOpts) -> Result<(), String> {
    // Each tensor in the chosen dtype, then packed into shards in name order.
    let data: BTreeMap<String, (Vec<usize>, Vec<u8>)> = data.into_iter().map(|(n, (shape, b))| (n, (shape, narrow(&b, opts.dtype)))).collect();
    let mut shards: Vec<Vec<&String>> = vec![Vec::new()];
    let mut size = 0u64;
    for (name, (_, b)) in &data {
        if size > 0 && size + b.len() as u64 > opts.max_shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        size += b.len() as u64;
        shards.last_mut().unwrap().push(name);
    }
    let meta = Some(std::collections::HashMap::from([("format".to_string(), "pt".to_string())]));
    let write = |name: &str, b: &[u8]| std::fs::write(dir.join(name), b).map_err(|e| format!("{}: {e}", dir.join(name).display()));
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (k, names) in shards.iter().enumerate() {
        let file = if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", k + 1) };
        let views: Vec<(String, TensorView)> =
            names.iter().map(|&nm| (nm.clone(), TensorView::new(opts.dtype, data[nm].0.clone(), &data[nm].1).expect("shape matches"))).collect();
        let bytes = safetensors::tensor::serialize(views, meta.clone()).map_err(|e| format!("export: {e}"))?;
        write(&file, &bytes)?;
        for &nm in names {
            weight_map.insert(nm.clone(), file.clone().into());
        }
    }
    let stale = ["model.safetensors", "model.safetensors.index.json"];
    if n > 1 {
        let total: usize = data.values().map(|(_, b)| b.len()).sum();
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        write("model.safetensors.index.json", serde_json::to_string_pretty(&index).unwrap().as_bytes())?;
        let _ = std::fs::remove_file(dir.join(stale[0]));
    } else {
        let _ = std::fs::remove_file(dir.join(stale[1]));
    }
    Ok(())
}

/// What of `c` has no Hugging Face form kiln writes: the export's refusal, naming it.
fn export_refusal(c: &GptConfig) -> Result<(), String> {
    let gemma_feature = c.norm_offset || c.embed_scale || c.gate_act != GateAct::Silu || c.query_pre_attn_scalar > 0 || c.rope_local_theta != 0.0 || c.block_norms == BlockNorms::Sandwich;
    if gemma_feature || c.attn_softcap != 0.0 || c.final_softcap != 0.0 {
        let plain = !c.is_moe() && !c.qkv_bias && !c.fused_proj && c.nope_layers.is_empty() && c.attn_sinks == 0;
        if gemma_version(c).is_none() || !plain {
            return Err("export: Gemma's features (sandwich norms, 1 + w norms, GeGLU, scaled embeddings, query_pre_attn_scalar, soft-caps, a local rotary base) have a Hugging Face form only together, as Gemma 2's or Gemma 3's: dense, without q/k/v biases, fused projections, NoPE layers or attention sinks; Gemma 3's with per-head q/k norms, Gemma 2's without them or a local rotary base".into());
        }
        return Ok(());
    }
    if c.n_shared_expert > 0 && !is_deepseek_moe(c) {
        return Err("export: shared experts have no Hugging Face Mixtral equivalent (DeepSeek-V3's, under its sigmoid router)".into());
    }
    if !c.window_layers.is_empty() {
        // Qwen2 windows a suffix of the layers; layer_types says any set, but only for the
        // classes that read it.
        let from = c.window_layers[0];
        let suffix = c.window_layers.iter().copied().eq(from..c.n_layer);
        if !(c.qkv_bias || c.qk_norm) || !suffix || is_qwen3_moe(c) {
            return Err(format!("export: a sliding window on some layers (model.window_layers = {:?}) has a Hugging Face form only as Qwen2's (q/k/v biases, the window from one layer to the last)", c.window_layers));
        }
    }
    if !c.nope_layers.is_empty() && (c.is_moe() || c.qkv_bias || c.qk_norm || c.fused_proj || c.sliding_window > 0) {
        return Err(format!("export: layers without a rotary embedding (model.nope_layers = {:?}) have a Hugging Face form only as SmolLM3's: dense, without q/k/v biases, q/k norms, fused projections or a window", c.nope_layers));
    }
    let olmo2 = c.block_norms == BlockNorms::Post && c.qk_norm_whole;
    if (c.block_norms != BlockNorms::Pre || c.qk_norm_whole) && (!olmo2 || c.is_moe() || c.qkv_bias || c.fused_proj || c.sliding_window > 0 || !c.nope_layers.is_empty()) {
        return Err(format!("export: model.block_norms = {} with model.qk_norm_whole = {} has a Hugging Face form only as OLMo 2's: norms after the branches, whole-width q/k norms, dense, without q/k/v biases, fused projections, a window or NoPE layers", plan::policy::Names::name(c.block_norms), c.qk_norm_whole));
    }
    if c.attn_sinks > 0 {
        return Err(format!("export: attention sinks (model.attn_sinks = {}) have no Hugging Face equivalent: transformers' sliding window would drop them", c.attn_sinks));
    }
    if c.arch == Arch::Llama {
        if c.qkv_bias && c.is_moe() {
            return Err("export: q/k/v biases with experts have no Hugging Face equivalent".into());
        }
        if c.sliding_window > 0 && c.is_moe() && !c.qk_norm {
            return Err("export: a sliding window with experts has no Hugging Face equivalent kiln writes".into());
        }
        if c.qk_norm && (c.qkv_bias || c.fused_proj) {
            return Err("export: per-head q/k norms (model.qk_norm) have a Hugging Face form only as Qwen3's and Qwen3-MoE's: no q/k/v biases or fused projections".into());
        }
    }
    Ok(())
}

/// Which Gemma block `c` is, if any: 3 with per-head q/k norms, 2 without them or a local
/// rotary base; `None` unless every feature the two share is on.
fn gemma_version(c: &GptConfig) -> Option<u8> {
    let shared = c.block_norms == BlockNorms::Sandwich && c.gate_act == GateAct::GeluTanh && c.norm_offset && c.embed_scale && !c.qk_norm_whole;
    match (shared, c.qk_norm) {
        (true, true) => Some(3),
        (true, false) if c.rope_local_theta == 0.0 => Some(2),
        _ => None,
    }
}

/// Gemma 2's or 3's `config.json` for `c` (see [`gemma_config`]): the layer types, the
/// soft-caps (null for none), an explicit `pad_token_id`; Gemma 3's rotary parameters per layer
/// type.
fn gemma_export(c: &GptConfig, version: u8) -> Value {
    let global = rope_parameters(c);
    let local = if c.rope_local_theta > 0.0 { json!({"rope_type": "default", "rope_theta": c.rope_local_theta}) } else { global.clone() };
    let types: Vec<&str> = (0..c.n_layer).map(|l| if c.window_of(l) > 0 { "sliding_attention" } else { "full_attention" }).collect();
    let (arch, ty, rope) = match version {
        2 => ("Gemma2ForCausalLM", "gemma2", global),
        _ => ("Gemma3ForCausalLM", "gemma3_text", json!({"full_attention": global, "sliding_attention": local})),
    };
    let cap = |x: f32| if x > 0.0 { Value::from(x) } else { Value::Null };
    json!({
        "architectures": [arch], "model_type": ty, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": c.n_embd, "intermediate_size": c.ffn_hidden, "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head, "head_dim": c.head_size(),
        "max_position_embeddings": c.block_size, "vocab_size": c.vocab_size, "rms_norm_eps": c.norm_eps,
        "rope_parameters": rope, "layer_types": types,
        "sliding_window": if c.sliding_window > 0 { c.sliding_window } else { c.block_size },
        "query_pre_attn_scalar": if c.query_pre_attn_scalar > 0 { c.query_pre_attn_scalar } else { c.head_size() },
        "attn_logit_softcapping": cap(c.attn_softcap), "final_logit_softcapping": cap(c.final_softcap), "use_bidirectional_attention": false,
        "tie_word_embeddings": c.tied_embeddings, "attention_bias": false, "attention_dropout": 0.0,
        "pad_token_id": c.pad_token_id, "dtype": "float32",
    })
}

/// The `config.json` of a model of config `c` (the class its features need).
fn export_config(c: &GptConfig) -> Result<Value, String> {
    export_refusal(c)?;
    if let Some(version) = gemma_version(c) {
        return Ok(gemma_export(c, version));
    }
    if c.is_mla() {
        return deepseek_v3_export(c);
    }
    Ok(if c.arch == Arch::Llama {
        let (arch, ty) = match (c.is_moe(), c.qkv_bias, c.sliding_window > 0) {
            _ if c.block_norms == BlockNorms::Post => ("Olmo2ForCausalLM", "olmo2"),
            _ if c.fused_proj => ("Phi3ForCausalLM", "phi3"),
            _ if !c.nope_layers.is_empty() => ("SmolLM3ForCausalLM", "smollm3"),
            _ if is_qwen3_moe(c) => ("Qwen3MoeForCausalLM", "qwen3_moe"),
            _ if c.qk_norm => ("Qwen3ForCausalLM", "qwen3"),
            (true, _, _) => ("MixtralForCausalLM", "mixtral"),
            (false, true, _) => ("Qwen2ForCausalLM", "qwen2"),
            (false, false, true) => ("MistralForCausalLM", "mistral"),
            (false, false, false) => ("LlamaForCausalLM", "llama"),
        };
        let rope = rope_parameters(c);
        let mut v = json!({
            "architectures": [arch], "model_type": ty, "hidden_act": "silu",
            "hidden_size": c.n_embd, "intermediate_size": c.ffn_hidden, "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head, "head_dim": c.head_size(),
            "max_position_embeddings": c.block_size, "vocab_size": c.vocab_size, "rms_norm_eps": c.norm_eps,
            "rope_theta": c.rope_theta, "rope_parameters": rope,
            "tie_word_embeddings": c.tied_embeddings, "attention_bias": false, "mlp_bias": false,
            "attention_dropout": 0.0, "dtype": "float32",
        });
        if c.sliding_window > 0 {
            let o = v.as_object_mut().unwrap();
            o.remove("attention_bias");
            o.remove("mlp_bias");
            o.insert("sliding_window".into(), c.sliding_window.into());
        }
        if c.fused_proj {
            // Phi-3's class has neither bias key; no window is `null` there.
            let o = v.as_object_mut().unwrap();
            o.remove("attention_bias");
            o.remove("mlp_bias");
            o.insert("sliding_window".into(), if c.sliding_window > 0 { c.sliding_window.into() } else { Value::Null });
            o.insert("resid_pdrop".into(), 0.0.into());
            o.insert("embd_pdrop".into(), 0.0.into());
            // An absent pad_token_id would read as Phi3Config's default, 32000.
            o.insert("pad_token_id".into(), c.pad_token_id.map_or(Value::Null, Value::from));
            // Phi3Config's top-level original context (default 4096) overrides the rope
            // dictionary's, so it is written there too.
            if let Some(orig) = rope.get("original_max_position_embeddings") {
                o.insert("original_max_position_embeddings".into(), orig.clone());
            }
        }
        if c.block_norms == BlockNorms::Post {
            // An absent pad_token_id would read as Olmo2Config's default, 1.
            let o = v.as_object_mut().unwrap();
            o.remove("mlp_bias");
            o.insert("pad_token_id".into(), c.pad_token_id.map_or(Value::Null, Value::from));
        } else if c.qkv_bias || c.qk_norm {
            // Qwen2's biases and Qwen3's norms are implied by the class (Qwen2 has no
            // attention_bias key; Qwen3's false is its default). The window applies from
            // `max_window_layers` on.
            let o = v.as_object_mut().unwrap();
            o.remove("attention_bias");
            o.remove("mlp_bias");
            o.insert("use_sliding_window".into(), (c.sliding_window > 0).into());
            if c.sliding_window > 0 {
                let from = c.window_layers.first().copied().unwrap_or(0);
                o.insert("max_window_layers".into(), from.into());
            }
        }
        if let Some(pad) = c.pad_token_id {
            v["pad_token_id"] = pad.into();
        }
        if !c.nope_layers.is_empty() {
            let uses: Vec<u8> = (0..c.n_layer).map(|l| c.rope_at(l) as u8).collect();
            v["no_rope_layers"] = uses.into();
            v["use_sliding_window"] = false.into();
            // An absent pad_token_id would read as SmolLM3Config's default, 128004.
            v["pad_token_id"] = c.pad_token_id.map_or(Value::Null, Value::from);
        }
        if c.rotary_dim > 0 {
            // transformers turns int(head_dim · factor) dimensions, in Phi-3's class only.
            let f = c.rotary_dim as f64 / c.head_size() as f64;
            if !c.fused_proj || (c.head_size() as f64 * f) as usize != c.rotary_dim {
                return Err(format!("export: a partial rotary embedding (model.rotary_dim = {} of {}) has a Hugging Face form only as Phi-3's, with a factor that gives it back", c.rotary_dim, c.head_size()));
            }
            v["partial_rotary_factor"] = f.into();
            v["rope_parameters"]["partial_rotary_factor"] = f.into();
        }
        if c.sliding_window > 0 {
            // transformers' per-layer form, which the classes read before their own rule.
            let types: Vec<&str> = (0..c.n_layer).map(|l| if c.window_of(l) > 0 { "sliding_attention" } else { "full_attention" }).collect();
            v["layer_types"] = types.into();
        }
        if c.is_moe() {
            moe_keys(c, &mut v);
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
    })
}

/// `config.json`'s `rope_parameters` (transformers 5's form) for `c`'s RoPE and its scaling.
fn rope_parameters(c: &GptConfig) -> Value {
    let mut rope = json!({"rope_theta": c.rope_theta, "rope_type": "default"});
    match &c.rope_scaling {
        None => {}
        Some(RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings, attention_factor }) => {
            rope = json!({"rope_theta": c.rope_theta, "rope_type": "longrope", "short_factor": short_factor, "long_factor": long_factor,
                "original_max_position_embeddings": original_max_position_embeddings, "attention_factor": attention_factor});
        }
        &Some(RopeScaling::Linear { factor }) => rope = json!({"rope_theta": c.rope_theta, "rope_type": "linear", "factor": factor}),
        &Some(RopeScaling::Dynamic { factor, .. }) => rope = json!({"rope_theta": c.rope_theta, "rope_type": "dynamic", "factor": factor}),
        &Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
            rope = json!({"rope_theta": c.rope_theta, "rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor, "original_max_position_embeddings": original_max_position_embeddings});
        }
        &Some(RopeScaling::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, attention_factor, truncate }) => {
            rope = json!({"rope_theta": c.rope_theta, "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original_max_position_embeddings,
                "beta_fast": beta_fast, "beta_slow": beta_slow, "attention_factor": attention_factor, "truncate": truncate});
        }
    }
    rope
}

/// A mixture of experts' keys in `config.json`: Mixtral's, and Qwen3-MoE's besides.
fn moe_keys(c: &GptConfig, v: &mut Value) {
    v["num_local_experts"] = c.n_expert.into();
    v["num_experts_per_tok"] = c.top_k.into();
    // transformers adds the aux loss in training only with output_router_logits.
    v["router_aux_loss_coef"] = (if c.moe_aux_weight > 0.0 { c.moe_aux_weight / c.top_k as f32 } else { 0.001 }).into();
    v["output_router_logits"] = (c.moe_aux_weight > 0.0).into();
    if is_qwen3_moe(c) {
        // Every layer routed, Mixtral's renormalised top-k; `num_experts` as Qwen's own
        // configs (and readers before transformers 5) name it.
        v["num_experts"] = c.n_expert.into();
        v["moe_intermediate_size"] = c.ffn_hidden.into();
        v["norm_topk_prob"] = true.into();
        v["decoder_sparse_step"] = 1.into();
        v["mlp_only_layers"] = json!([]);
    }
}

/// DeepSeek-V3's one shared MLP from kiln's several shared experts (`S > 1`): gate and up their
/// rows in order, down its columns (see [`deepseek_shared_of`]).
fn merge_shared_experts(c: &GptConfig, data: &mut BTreeMap<String, (Vec<usize>, Vec<u8>)>) {
    let (s_n, f) = (c.n_shared_expert, c.ffn_hidden);
    if s_n < 2 {
        return;
    }
    let stems: Vec<String> = data.keys().filter_map(|n| n.strip_suffix("block_sparse_moe.shared_experts.0.w1.weight").map(String::from)).collect();
    for stem in stems {
        let take = |data: &mut BTreeMap<String, (Vec<usize>, Vec<u8>)>, s: usize, w: &str| data.remove(&format!("{stem}block_sparse_moe.shared_experts.{s}.{w}")).expect("every shared expert").1;
        for (w, hf) in [("w1.weight", "gate_proj"), ("w3.weight", "up_proj")] {
            let bytes: Vec<u8> = (0..s_n).flat_map(|s| take(data, s, w)).collect();
            data.insert(format!("{stem}mlp.shared_experts.{hf}.weight"), (vec![s_n * f, c.n_embd], bytes));
        }
        let downs: Vec<Vec<u8>> = (0..s_n).map(|s| take(data, s, "w2.weight")).collect();
        let mut bytes = Vec::with_capacity(4 * c.n_embd * s_n * f);
        for r in 0..c.n_embd {
            for d in &downs {
                bytes.extend_from_slice(&d[4 * r * f..4 * (r + 1) * f]);
            }
        }
        data.insert(format!("{stem}mlp.shared_experts.down_proj.weight"), (vec![c.n_embd, s_n * f], bytes));
    }
}

/// Every tensor of `m` under its HF name, as little-endian f32 bytes with its HF shape.
fn export_tensors(m: &Gpt) -> BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    let c = &m.cfg;
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
    // Phi-3: q|k|v and gate|up as one tensor each, their rows in that order (kiln's layout
    // holds them adjacent in the same order).
    if c.fused_proj {
        let names: Vec<String> = data.keys().filter(|n| n.ends_with("self_attn.q_proj.weight") || n.ends_with("mlp.gate_proj.weight")).cloned().collect();
        for name in names {
            let (stem, parts, fused) = match name.strip_suffix("self_attn.q_proj.weight") {
                Some(stem) => (stem.to_string(), &["q_proj", "k_proj", "v_proj"][..], "self_attn.qkv_proj.weight"),
                None => (name.strip_suffix("mlp.gate_proj.weight").unwrap().to_string(), &["gate_proj", "up_proj"][..], "mlp.gate_up_proj.weight"),
            };
            let dir = if parts.len() == 3 { "self_attn" } else { "mlp" };
            let (mut rows, mut cols, mut bytes) = (0, 0, Vec::new());
            for part in parts {
                let (shape, b) = data.remove(&format!("{stem}{dir}.{part}.weight")).expect("adjacent projections");
                (rows, cols) = (rows + shape[0], shape[1]);
                bytes.extend(b);
            }
            data.insert(format!("{stem}{fused}"), (vec![rows, cols], bytes));
        }
    }
    if is_qwen3_moe(c) {
        data = data.into_iter().map(|(n, t)| (qwen3_moe_name(&n).unwrap_or(n), t)).collect();
    }
    if is_deepseek_moe(c) {
        merge_shared_experts(c, &mut data);
        data = data.into_iter().map(|(n, t)| (deepseek_moe_name(&n).unwrap_or(n), t)).collect();
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
    data
}

