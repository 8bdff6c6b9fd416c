//! HF GPT-2 import/export against the `transformers` fixtures in ../shared/fixtures.

use model::gpt::IGNORE_INDEX;
use model::hf::{export_hf, import_hf};
use model::Pass;
use std::path::{Path, PathBuf};

/// A `../shared/fixtures` directory (or one of this crate's own, `tests/fixtures`); a missing one
/// fails the test, naming its path.
fn fixture(name: &str) -> PathBuf {
    let own = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    if own.exists() {
        return own;
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures").join(name);
    assert!(p.exists(), "fixture {} not found", p.display());
    p
}

fn tokens(dir: &Path) -> Vec<Vec<u32>> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("tokens.json")).unwrap()).unwrap();
    v["input_ids"].as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()).collect()
}

fn expected_logits(dir: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    (t.shape().to_vec(), t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

#[test]
fn gpt2_fixture_logits_and_loss_match_transformers() {
    fixture_matches("gpt2-tiny");
}

#[test]
fn llama_fixture_logits_and_loss_match_transformers() {
    fixture_matches("llama-tiny");
}

#[test]
fn mixtral_fixture_logits_and_loss_match_transformers() {
    fixture_matches("mixtral-tiny");
}

/// bf16 weights, q/k/v biases, a tied head and the 151936-row vocabulary.
#[test]
fn qwen2_fixture_logits_and_loss_match_transformers() {
    fixture_matches("qwen2-tiny");
}

/// bf16 weights and Llama 3.1's `llama3` rope scaling (transformers 5's `rope_parameters`).
#[test]
fn llama31_fixture_logits_and_loss_match_transformers() {
    fixture_matches("llama31-tiny");
}

/// bf16 weights, multi-query attention and a sliding window of 8 over 24 positions.
#[test]
fn mistral_fixture_logits_and_loss_match_transformers() {
    fixture_matches("mistral-tiny");
}

/// A sliding window on some layers only: Qwen2's `use_sliding_window` with `max_window_layers`
/// 1 of 3 (tests/fixtures/qwen2-layer-windows, made by its make.py with transformers), q/k/v
/// biases, GQA; the export writes Qwen2's form back (and `layer_types`).
#[test]
fn per_layer_sliding_windows_match_transformers() {
    fixture_matches("qwen2-layer-windows");
    export_reimport("qwen2-layer-windows");
    let mut m = import_hf(&fixture("qwen2-layer-windows")).unwrap();
    assert_eq!((m.cfg.sliding_window, m.cfg.window_layers.clone()), (6, vec![1, 2]));
    assert_eq!((0..3).map(|l| m.cfg.window_of(l)).collect::<Vec<_>>(), [0, 6, 6]);
    // KV-cached decoding sees each layer's window too.
    decode_matches_forward(&mut m, &tokens(&fixture("qwen2-layer-windows"))[0]);
}

/// YaRN rope scaling (tests/fixtures/qwen2-yarn, made by its make.py with transformers): a
/// Qwen2 whose config gives `rope_scaling` in the older form Qwen2.5's model cards show (factor 4
/// over an original 8 positions, 24-token rows), matching transformers' logits and loss, with
/// KV-cached decoding and export (as `rope_parameters`) giving the same model back; and the
/// inverse frequencies and attention factor of a DeepSeek-style parameter set (mscale,
/// mscale_all_dim, beta_fast, beta_slow, truncate false) equal to transformers'.
#[test]
fn yarn_rope_scaling_matches_transformers() {
    fixture_matches("qwen2-yarn");
    export_reimport("qwen2-yarn");
    let mut m = import_hf(&fixture("qwen2-yarn")).unwrap();
    assert!(matches!(m.cfg.rope_scaling, Some(model::config::RopeScaling::Yarn { factor: 4.0, original_max_position_embeddings: 8, truncate: true, .. })), "{:?}", m.cfg.rope_scaling);
    decode_matches_forward(&mut m, &tokens(&fixture("qwen2-yarn"))[1]);
    let ej: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("qwen2-yarn").join("expected.json")).unwrap()).unwrap();
    let ds = &ej["deepseek_style"];
    let cfg = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_parameters": ds["rope_parameters"],
    });
    let c = model::hf::hf_config(&cfg, Path::new("deepseek-style")).unwrap();
    assert_eq!(c.head_size(), ds["head_dim"].as_u64().unwrap() as usize);
    let want: Vec<f64> = ds["inv_freq"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let got = c.rope_inv_freq();
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(((*g as f64 - w) / w).abs() <= 2.0 * f32::EPSILON as f64, "inv_freq[{i}] {g} vs transformers {w}");
    }
    let a = c.rope_scaling.unwrap().attention_factor();
    assert!((a as f64 - ds["attention_factor"].as_f64().unwrap()).abs() <= 1e-6, "attention factor {a} vs {}", ds["attention_factor"]);
}

/// Phi-3 with LongRoPE (tests/fixtures/phi3-longrope, made by its make.py with transformers):
/// fused `qkv_proj` / `gate_up_proj` tensors, Phi-3.5's config form (top-level
/// `original_max_position_embeddings` 8, short and long factors), a window of 16. Rows of 24
/// tokens (the long factors) match transformers' logits and loss, their first 6 tokens alone
/// (the short factors) its logits of that pass; the export writes Phi-3's fused tensors back
/// bit for bit; decoding switches to the long tables where transformers' generation would.
#[test]
fn phi3_longrope_matches_transformers() {
    fixture_matches("phi3-longrope");
    export_reimport("phi3-longrope");
    let dir = fixture("phi3-longrope");
    let mut m = import_hf(&dir).unwrap();
    assert!(m.cfg.fused_proj && m.cfg.sliding_window == 16, "{:?}", m.cfg);
    let Some(model::config::RopeScaling::LongRope { original_max_position_embeddings: 8, attention_factor, .. }) = m.cfg.rope_scaling.clone() else {
        panic!("{:?}", m.cfg.rope_scaling)
    };
    // transformers' default: sqrt(1 + ln(32 / 8) / ln 8).
    assert!((attention_factor as f64 - (1.0 + 4f64.ln() / 8f64.ln()).sqrt()).abs() < 1e-6, "{attention_factor}");
    let rows = tokens(&dir);
    let short: Vec<u32> = rows.iter().flat_map(|r| r[..6].iter().copied()).collect();
    let got = m.forward_logits(&short, rows.len(), 6);
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits_short").unwrap();
    assert_eq!(t.shape(), [rows.len(), 6, m.cfg.vocab_size]);
    let want: Vec<f32> = t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(err <= 1e-4, "short pass: max |logit error| {err}");
    // Token-by-token decoding of the first 6 tokens is a pass of ≤ 8 positions at every step
    // (the short tables, as transformers' generation): it gives the short pass's logits.
    let mut cache = m.new_cache();
    let vp = m.cfg.vocab_size;
    for (i, &tok) in rows[0][..6].iter().enumerate() {
        let step = m.decode_step(&mut cache, tok);
        let err = step.iter().zip(&got[i * vp..(i + 1) * vp]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(err < 1e-4, "decode position {i}: {err}");
    }
    // A config whose heads do not fit the fused tensor is refused, naming it and both shapes.
    let bad = std::env::temp_dir().join(format!("kiln-phi3-bad-{}", std::process::id()));
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::copy(dir.join("model.safetensors"), bad.join("model.safetensors")).unwrap();
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap().replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 4");
    std::fs::write(bad.join("config.json"), cfg).unwrap();
    let e = import_hf(&bad).err().expect("4 key/value heads do not fit");
    assert!(e.contains("self_attn.qkv_proj.weight") && e.contains("[64, 32]") && e.contains("[96, 32]"), "{e}");
    let _ = std::fs::remove_dir_all(&bad);
    // Phi3Config's older rope type names `su` and `yarn` are LongRoPE; a negative pad id counts
    // from the end of the vocabulary, as nn.Embedding takes it.
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    for ty in ["su", "yarn"] {
        v["rope_scaling"]["type"] = ty.into();
        v["pad_token_id"] = (-1).into();
        let c = model::hf::hf_config(&v, &dir.join("config.json")).unwrap();
        assert_eq!((c.rope_scaling.as_ref(), c.pad_token_id), (m.cfg.rope_scaling.as_ref(), Some(100)), "{ty}");
    }
    // The fused tensors are read by name through the one-at-a-time reader too (QLoRA's path).
    let r = model::hf::TensorReader::open(&dir).unwrap();
    for p in &m.layout.params {
        let mut dst = vec![0.0f32; p.shape.iter().product()];
        r.read_into(&p.name, &p.shape, &mut dst).unwrap();
        assert!(dst.iter().zip(&m.params[p.range()]).all(|(a, b)| a.to_bits() == b.to_bits()), "{}", p.name);
    }
}

/// Qwen3 (tests/fixtures/qwen3-tiny, made by its make.py with transformers): RMSNorm over each
/// head of q and k before the rotary embedding (weights away from one), head_dim 12 over hidden
/// 32, GQA 4:2, a tied head; logits and loss match transformers, the export writes Qwen3 back bit
/// for bit, and KV-cached decoding agrees with the full forward.
#[test]
fn qwen3_fixture_logits_and_loss_match_transformers() {
    fixture_matches("qwen3-tiny");
    export_reimport("qwen3-tiny");
    let dir = fixture("qwen3-tiny");
    let mut m = import_hf(&dir).unwrap();
    assert!(m.cfg.qk_norm && m.cfg.tied_embeddings && m.cfg.head_size() == 12, "{:?}", m.cfg);
    decode_matches_forward(&mut m, &tokens(&dir)[0]);
}

/// SmolLM3 (tests/fixtures/smollm3-tiny, made by its make.py with transformers): LLaMA whose
/// fourth layer has no rotary embedding (`no_rope_layers` [1, 1, 1, 0]); logits and loss match
/// transformers, the export writes SmolLM3 back bit for bit with its `no_rope_layers`, KV-cached
/// decoding agrees with the forward, and the default interval reads as the list; the gradient of
/// a NoPE layer is checked by finite differences in `gpt.rs`.
#[test]
fn smollm3_fixture_logits_and_loss_match_transformers() {
    fixture_matches("smollm3-tiny");
    export_reimport("smollm3-tiny");
    let dir = fixture("smollm3-tiny");
    let mut m = import_hf(&dir).unwrap();
    assert_eq!(m.cfg.nope_layers, vec![3], "{:?}", m.cfg);
    decode_matches_forward(&mut m, &tokens(&dir)[0]);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("no_rope_layers");
    v["no_rope_layer_interval"] = 2.into();
    assert_eq!(model::hf::hf_config(&v, &dir.join("config.json")).unwrap().nope_layers, vec![1, 3]);
    v["no_rope_layers"] = serde_json::json!([1, 0]);
    let e = model::hf::hf_config(&v, &dir.join("config.json")).unwrap_err();
    assert!(e.contains("no_rope_layers") && e.contains("2 entries for 4 layers"), "{e}");
}

/// Gemma 3's text model (tests/fixtures/gemma3-tiny, made by its make.py with transformers):
/// sandwich norms scaling by `1 + w` (every norm weight off 0), GeGLU, embeddings times `√C`
/// under a tied head, `query_pre_attn_scalar` 12 with heads of 8, three sliding layers (window
/// 5) with the local base beside a global layer with linear rope scaling; logits and loss match
/// transformers, the export writes Gemma 3 back bit for bit, KV-cached decoding agrees with the
/// forward, and the older config form (`rope_theta`, `rope_local_base_freq`, `rope_scaling`,
/// `sliding_window_pattern`) reads the same model. Bidirectional attention is refused by name.
#[test]
fn gemma3_fixture_logits_and_loss_match_transformers() {
    use model::config::{BlockNorms, GateAct};
    fixture_matches("gemma3-tiny");
    export_reimport("gemma3-tiny");
    let dir = fixture("gemma3-tiny");
    let mut m = import_hf(&dir).unwrap();
    let c = m.cfg.clone();
    assert!(c.block_norms == BlockNorms::Sandwich && c.gate_act == GateAct::GeluTanh && c.norm_offset && c.embed_scale && c.qk_norm && c.tied_embeddings, "{c:?}");
    assert_eq!((c.query_pre_attn_scalar, c.sliding_window, c.window_layers.clone(), c.rope_local_theta, c.rope_theta, c.pad_token_id), (12, 5, vec![0, 1, 3], 1e4, 1e6, Some(0)));
    decode_matches_forward(&mut m, &tokens(&dir)[0]);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let o = v.as_object_mut().unwrap();
    o.remove("rope_parameters");
    o.remove("layer_types");
    o.insert("rope_theta".into(), 1e6.into());
    o.insert("rope_local_base_freq".into(), 1e4.into());
    o.insert("rope_scaling".into(), serde_json::json!({"rope_type": "linear", "factor": 4.0}));
    o.insert("sliding_window_pattern".into(), 3.into());
    let old = model::hf::hf_config(&v, &dir.join("config.json")).unwrap();
    assert_eq!(old, model::GptConfig { window_layers: vec![0, 1, 3], ..c.clone() });
    v["use_bidirectional_attention"] = true.into();
    let e = model::hf::hf_config(&v, &dir.join("config.json")).unwrap_err();
    assert!(e.contains("use_bidirectional_attention"), "{e}");
}

/// Gemma 2 (tests/fixtures/gemma2-tiny, made by its make.py with transformers): Gemma's block
/// without q/k norms, its attention logits (cap 2) and output logits (cap 3) soft-capped, the
/// default alternation of sliding and global layers; logits and loss match transformers, the
/// export writes Gemma 2 back bit for bit, KV-cached decoding agrees with the forward, a file
/// without the caps reads Gemma2Config's defaults (50, 30) and a null cap as none.
#[test]
fn gemma2_fixture_logits_and_loss_match_transformers() {
    fixture_matches("gemma2-tiny");
    export_reimport("gemma2-tiny");
    let dir = fixture("gemma2-tiny");
    let mut m = import_hf(&dir).unwrap();
    let c = m.cfg.clone();
    assert!(!c.qk_norm && c.norm_offset && c.embed_scale && c.rope_local_theta == 0.0, "{c:?}");
    assert_eq!((c.attn_softcap, c.final_softcap, c.sliding_window, c.window_layers.clone(), c.query_pre_attn_scalar), (2.0, 3.0, 5, vec![0, 2], 12));
    decode_matches_forward(&mut m, &tokens(&dir)[0]);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let o = v.as_object_mut().unwrap();
    o.remove("attn_logit_softcapping");
    o.insert("final_logit_softcapping".into(), serde_json::Value::Null);
    let c = model::hf::hf_config(&v, &dir.join("config.json")).unwrap();
    assert_eq!((c.attn_softcap, c.final_softcap), (50.0, 0.0));
    v["attn_logit_softcapping"] = (-1.0).into();
    let e = model::hf::hf_config(&v, &dir.join("config.json")).unwrap_err();
    assert!(e.contains("attn_logit_softcapping"), "{e}");
}

/// DeepSeek-V3 with every layer dense (tests/fixtures/deepseek-v3-dense-tiny, made by its
/// make.py with transformers): multi-head latent attention with q's latent, interleaved rotary
/// dimensions, values narrower than q·k; logits and loss match transformers, the export writes
/// DeepSeek-V3 back bit for bit, decoding over the compressed (latent) KV cache agrees with the
/// forward and greedy generation through it with generation without a cache, the cache holds
/// the bytes MLA promises, and transformers' `head_dim` (the rotary width) is not read.
#[test]
fn deepseek_v3_dense_fixture_logits_and_loss_match_transformers() {
    fixture_matches("deepseek-v3-dense-tiny");
    export_reimport("deepseek-v3-dense-tiny");
    let dir = fixture("deepseek-v3-dense-tiny");
    let mut m = import_hf(&dir).unwrap();
    let c = m.cfg.clone();
    assert_eq!((c.kv_lora_rank, c.q_lora_rank, c.head_size(), c.rotary_dim, c.v_head_dim, c.rope_interleave, c.o_width()), (12, 16, 12, 4, 6, true, 24));
    decode_matches_forward(&mut m, &tokens(&dir)[0]);
    // The compressed cache: KVR + R floats per layer and position, against the 2·NH·HS each
    // head's keys and values would take (measured on the cache itself).
    let cache = m.new_cache();
    assert_eq!(cache.bytes(), 4 * c.n_layer * c.block_size * (12 + 4));
    assert_eq!(cache.bytes(), 4 * c.kv_cache_floats(), "the memory plan's count");
    assert_eq!(cache.bytes() * 6, 4 * c.n_layer * c.block_size * 2 * c.n_head * c.head_size(), "a sixth of the per-head cache");
    // Greedy generation through it equals generation without a cache (a full forward per token).
    let prompt = &tokens(&dir)[0][..5];
    let got = m.generate(prompt, 12, &model::Sampler::new(0.0, 0, 1));
    let mut seq = prompt.to_vec();
    for _ in 0..12 {
        let logits = m.forward_logits(&seq, 1, seq.len());
        let last = &logits[(seq.len() - 1) * c.vocab_size..seq.len() * c.vocab_size];
        let best = (0..c.vocab_size).fold(0, |b, j| if last[j] > last[b] { j } else { b });
        seq.push(best as u32);
    }
    assert_eq!(got, seq[5..].to_vec());
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    // The same file with routed experts from layer 1 on reads as DeepSeek-V3's mixed stack.
    v["first_k_dense_replace"] = 1.into();
    (v["num_experts_per_tok"], v["n_group"], v["topk_group"]) = (2.into(), 2.into(), 1.into());
    let mixed = model::hf::hf_config(&v, &dir.join("config.json")).unwrap();
    assert_eq!((mixed.moe_first_layer, mixed.dense_ffn_hidden, mixed.ffn_hidden, mixed.n_expert), (1, 64, 16, 4));
}

/// DeepSeek-V3 (tests/fixtures/deepseek-v3-moe-tiny, made by its make.py with transformers): a
/// dense layer before two routed ones, latent attention, 8 experts in 4 groups under the
/// sigmoid router (2 groups, 2 experts, a random correction bias, gates scaled by 2.5) beside a
/// shared expert; logits and loss match transformers, the export writes DeepSeek-V3's names back
/// bit for bit, KV-cached decoding agrees with the forward; gates left unnormalised are refused
/// by name.
#[test]
fn deepseek_v3_moe_fixture_logits_and_loss_match_transformers() {
    use model::config::MoeRouter;
    fixture_matches("deepseek-v3-moe-tiny");
    export_reimport("deepseek-v3-moe-tiny");
    let dir = fixture("deepseek-v3-moe-tiny");
    let mut m = import_hf(&dir).unwrap();
    let c = m.cfg.clone();
    assert_eq!((c.n_expert, c.top_k, c.n_shared_expert, c.ffn_hidden, c.moe_router, c.moe_groups, c.moe_topk_groups, c.moe_gate_scale), (8, 2, 1, 16, MoeRouter::Sigmoid, 4, 2, 2.5));
    assert_eq!((c.moe_first_layer, c.dense_ffn_hidden), (1, 64));
    let bias = m.layout.get("model.layers.1.block_sparse_moe.gate.e_score_correction_bias").unwrap().range();
    assert!(m.params[bias].iter().any(|&b| b != 0.0), "the correction bias is read");
    decode_matches_forward(&mut m, &tokens(&dir)[0]);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    v["norm_topk_prob"] = false.into();
    let e = model::hf::hf_config(&v, &dir.join("config.json")).unwrap_err();
    assert!(e.contains("norm_topk_prob"), "{e}");
}

/// A Moonlight-shaped DeepSeek-V3 (tests/fixtures/moonlight-tiny, made by its make.py with
/// transformers): one q projection (no q latent), one expert group, and two shared experts stored
/// as one shared MLP twice as wide (its gate and up rows, its down columns, split into kiln's two
/// shared experts and joined back on export); logits and loss match transformers, the export is
/// bit for bit, KV-cached decoding agrees with the forward.
#[test]
fn moonlight_shaped_fixture_logits_and_loss_match_transformers() {
    fixture_matches("moonlight-tiny");
    export_reimport("moonlight-tiny");
    let dir = fixture("moonlight-tiny");
    let mut m = import_hf(&dir).unwrap();
    let c = m.cfg.clone();
    assert_eq!((c.q_lora_rank, c.n_shared_expert, c.moe_groups, c.moe_first_layer), (0, 2, 1, 1));
    decode_matches_forward(&mut m, &tokens(&dir)[0]);
}

/// OLMo 2 (tests/fixtures/olmo2-tiny, made by its make.py with transformers): each branch's
/// RMSNorm after the branch and q and k normed over all heads at once, every norm weight off 1;
/// logits and loss match transformers, the export writes OLMo 2 back bit for bit (with its
/// `pad_token_id`), KV-cached decoding agrees with the forward, and a file without
/// `pad_token_id` or `rms_norm_eps` reads Olmo2Config's defaults; the gradients are checked by
/// finite differences in `gpt.rs`.
#[test]
fn olmo2_fixture_logits_and_loss_match_transformers() {
    use model::config::BlockNorms;
    fixture_matches("olmo2-tiny");
    export_reimport("olmo2-tiny");
    let dir = fixture("olmo2-tiny");
    let mut m = import_hf(&dir).unwrap();
    let c = &m.cfg;
    assert!(c.block_norms == BlockNorms::Post && c.qk_norm && c.qk_norm_whole && c.pad_token_id == Some(1), "{c:?}");
    assert_eq!(m.layout.get("model.layers.0.self_attn.q_norm.weight").unwrap().shape, vec![32]);
    assert_eq!(m.layout.get("model.layers.0.self_attn.k_norm.weight").unwrap().shape, vec![16]);
    assert!(m.layout.get("model.layers.0.input_layernorm.weight").is_none());
    decode_matches_forward(&mut m, &tokens(&dir)[0]);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let o = v.as_object_mut().unwrap();
    o.remove("pad_token_id");
    o.remove("rms_norm_eps");
    let c = model::hf::hf_config(&v, &dir.join("config.json")).unwrap();
    assert_eq!((c.pad_token_id, c.norm_eps), (Some(1), 1e-5));
}

/// Qwen3-MoE (tests/fixtures/qwen3-moe-tiny, made by its make.py with transformers): Qwen3's
/// per-head norms with every layer's MLP 4 routed experts (top 2, renormalised), read from and
/// written back to Qwen3-MoE's tensor names; logits and loss match transformers, the export is
/// bit for bit, KV-cached decoding agrees with the forward. Dense layers mixed in are refused.
#[test]
fn qwen3_moe_fixture_logits_and_loss_match_transformers() {
    fixture_matches("qwen3-moe-tiny");
    export_reimport("qwen3-moe-tiny");
    let dir = fixture("qwen3-moe-tiny");
    let mut m = import_hf(&dir).unwrap();
    assert!(m.cfg.qk_norm && m.cfg.n_expert == 4 && m.cfg.top_k == 2 && m.cfg.ffn_hidden == 24 && m.cfg.moe_aux_weight == 0.0, "{:?}", m.cfg);
    decode_matches_forward(&mut m, &tokens(&dir)[0]);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    v["mlp_only_layers"] = serde_json::json!([1]);
    let e = model::hf::hf_config(&v, &dir.join("config.json")).unwrap_err();
    assert!(e.contains("mlp_only_layers"), "{e}");
}

/// A partial rotary factor (tests/fixtures/phi4mini-partial, made by its make.py with
/// transformers): Phi-4-mini's form, `Phi3ForCausalLM` with `partial_rotary_factor` 0.75 (6 of 8
/// dimensions turned), LongRoPE with 3 factors, a tied head; logits, loss and the inverse
/// frequencies match transformers, export and decoding agree.
#[test]
fn partial_rotary_factor_matches_transformers() {
    fixture_matches("phi4mini-partial");
    export_reimport("phi4mini-partial");
    let dir = fixture("phi4mini-partial");
    let mut m = import_hf(&dir).unwrap();
    assert_eq!((m.cfg.rotary_dim, m.cfg.head_size(), m.cfg.tied_embeddings), (6, 8, true));
    let ej: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let want: Vec<f32> = ej["inv_freq"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
    assert_eq!(m.cfg.rope_inv_freq_for(true), want);
    decode_matches_forward(&mut m, &tokens(&dir)[0][..8]);
    // Only Phi-3's class passes unturned dimensions through: elsewhere the factor is refused on
    // import, and a llama-family model with model.rotary_dim is refused on export.
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("qwen3-tiny").join("config.json")).unwrap()).unwrap();
    v["partial_rotary_factor"] = 0.5.into();
    let e = model::hf::hf_config(&v, Path::new("qwen3/config.json")).unwrap_err();
    assert!(e.contains("partial_rotary_factor") && e.contains("Phi3ForCausalLM"), "{e}");
    let llama = model::Gpt::zeroed(model::GptConfig { fused_proj: false, ..m.cfg.clone() }, 101);
    let e = export_hf(&llama, &std::env::temp_dir().join(format!("kiln-partial-{}", std::process::id()))).unwrap_err();
    assert!(e.contains("model.rotary_dim"), "{e}");
}

/// Dynamic NTK rope scaling (tests/fixtures/llama-dynamic, made by its make.py with
/// transformers): in passes up to `max_position_embeddings` transformers keeps plain RoPE's
/// frequencies, and so does kiln (whose context may not exceed that length); logits, loss and the
/// frequencies transformers used match, and the export writes `dynamic` back.
#[test]
fn dynamic_rope_scaling_matches_transformers() {
    fixture_matches("llama-dynamic");
    export_reimport("llama-dynamic");
    let dir = fixture("llama-dynamic");
    let m = import_hf(&dir).unwrap();
    assert_eq!(m.cfg.rope_scaling, Some(model::config::RopeScaling::Dynamic { factor: 2.0, original_max_position_embeddings: 32 }));
    let ej: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let want: Vec<f32> = ej["inv_freq_after_forward"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
    assert_eq!(m.cfg.rope_inv_freq(), want);
    // A context past the original length is refused, naming both keys.
    let e = model::GptConfig { block_size: 33, ..m.cfg.clone() }.validate().unwrap_err();
    assert!(e.contains("model.block_size = 33") && e.contains("model.rope_original_max_positions = 32"), "{e}");
}

/// KV-cached decoding of `row`, token by token, gives the full forward's logits.
fn decode_matches_forward(m: &mut model::Gpt, row: &[u32]) {
    let full = m.forward_logits(row, 1, row.len());
    let mut cache = m.new_cache();
    let vp = m.cfg.vocab_size;
    for (i, &tok) in row.iter().enumerate() {
        let step = m.decode_step(&mut cache, tok);
        let err = step.iter().zip(&full[i * vp..(i + 1) * vp]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(err < 1e-4, "position {i}: max |logit difference| {err}");
    }
}

/// head_dim 12 with hidden_size 32 and 4 heads (tests/fixtures/llama-head-dim, made by its
/// make.py with transformers).
#[test]
fn head_dim_other_than_hidden_over_heads_matches_transformers() {
    fixture_matches("llama-head-dim");
    export_reimport("llama-head-dim");
    let mut m = import_hf(&fixture("llama-head-dim")).unwrap();
    assert_eq!((m.cfg.head_size(), m.cfg.attn_width()), (12, 48));
    // Decoding with the KV cache agrees with the full forward.
    decode_matches_forward(&mut m, &tokens(&fixture("llama-head-dim"))[0]);
}

#[test]
fn qwen2_llama31_mistral_export_reimport_is_bit_identical() {
    export_reimport("qwen2-tiny");
    export_reimport("llama31-tiny");
    export_reimport("mistral-tiny");
}

/// The older config form (`rope_scaling` beside a top-level `rope_theta`, as many Hub
/// checkpoints still have) reads the same as `rope_parameters`; unknown rope types are refused.
#[test]
fn rope_scaling_config_forms() {
    let dir = fixture("llama31-tiny");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let origin = dir.join("config.json");
    let new = model::hf::hf_config(&v, &origin).unwrap();
    assert!(matches!(new.rope_scaling, Some(model::config::RopeScaling::Llama3 { factor: 8.0, original_max_position_embeddings: 16, .. })), "{:?}", new.rope_scaling);
    let mut old = v.clone();
    let params = old.as_object_mut().unwrap().remove("rope_parameters").unwrap();
    old["rope_theta"] = params["rope_theta"].clone();
    let mut scaling = params.clone();
    scaling.as_object_mut().unwrap().remove("rope_theta");
    old["rope_scaling"] = scaling;
    assert_eq!(model::hf::hf_config(&old, &origin).unwrap(), new);
    old["rope_scaling"]["rope_type"] = "mrope".into();
    let e = model::hf::hf_config(&old, &origin).unwrap_err();
    assert!(e.contains("mrope") && e.contains("rope_scaling") && e.contains("config.json"), "{e}");
    // Linear scaling divides every frequency by its factor.
    let mut lin = new.clone();
    lin.rope_scaling = Some(model::config::RopeScaling::Linear { factor: 4.0 });
    let plain = model::GptConfig { rope_scaling: None, ..new.clone() }.rope_inv_freq();
    assert!(lin.rope_inv_freq().iter().zip(&plain).all(|(a, b)| *a == b / 4.0));
}

/// transformers trains Mixtral with its load-balancing loss only under `output_router_logits`
/// (false in the fixture, as in Mixtral's own configs): the import follows, and the export's
/// flag says whether the model has one.
#[test]
fn mixtral_export_reimport_is_bit_identical() {
    export_reimport("mixtral-tiny");
    let dir = fixture("mixtral-tiny");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let origin = dir.join("config.json");
    assert_eq!(model::hf::hf_config(&v, &origin).unwrap().moe_aux_weight, 0.0);
    v["output_router_logits"] = true.into();
    let c = model::hf::hf_config(&v, &origin).unwrap();
    assert_eq!(c.moe_aux_weight, v["router_aux_loss_coef"].as_f64().unwrap() as f32 * c.top_k as f32);
    let m = model::Gpt::zeroed(c, 32);
    let out = std::env::temp_dir().join(format!("kiln-mixtral-aux-{}", std::process::id()));
    export_hf(&m, &out).unwrap();
    assert_eq!(import_hf(&out).unwrap().cfg, m.cfg);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn llama_export_reimport_is_bit_identical() {
    export_reimport("llama-tiny");
}

fn fixture_matches(name: &str) {
    let dir = fixture(name);
    let mut m = import_hf(&dir).unwrap();
    let rows = tokens(&dir);
    let (b, t) = (rows.len(), rows[0].len());
    let flat: Vec<u32> = rows.concat();
    let logits = m.forward_logits(&flat, b, t);
    let (shape, want) = expected_logits(&dir);
    assert_eq!(shape, vec![b, t, m.cfg.vocab_size]);
    let max_err = logits.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(max_err <= 1e-4, "max |logit error| {max_err}");
    // Loss: logits at position t predict token t+1, over all 2 × 23 positions.
    let mut targets = vec![IGNORE_INDEX; b * t];
    for (bi, r) in rows.iter().enumerate() {
        for j in 0..t - 1 {
            targets[bi * t + j] = r[j + 1] as i32;
        }
    }
    let loss = m.forward(&flat, &targets, b, t, Pass::Eval);
    let ej: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let want_loss = ej["loss"].as_f64().unwrap() as f32;
    assert!(((loss - want_loss) / want_loss).abs() <= 1e-5, "loss {loss} vs {want_loss}");
    eprintln!("{name}: max |logit error| {max_err:.2e}, loss {loss} vs {want_loss}");
}

#[test]
fn gpt2_export_reimport_is_bit_identical() {
    export_reimport("gpt2-tiny");
}

fn export_reimport(name: &str) {
    let dir = fixture(name);
    let m = import_hf(&dir).unwrap();
    let out = std::env::temp_dir().join(format!("kiln-hf-export-{name}-{}", std::process::id()));
    export_hf(&m, &out).unwrap();
    let back = import_hf(&out).unwrap();
    assert_eq!(m.cfg, back.cfg);
    assert!(m.params.iter().zip(&back.params).all(|(a, b)| a.to_bits() == b.to_bits()));
    // The exported weights file holds exactly the tensors of the original (same names, shapes, bytes).
    let a = std::fs::read(dir.join("model.safetensors")).unwrap();
    let b = std::fs::read(out.join("model.safetensors")).unwrap();
    let (sa, sb) = (safetensors::SafeTensors::deserialize(&a).unwrap(), safetensors::SafeTensors::deserialize(&b).unwrap());
    let mut na = sa.names();
    let mut nb = sb.names();
    na.sort();
    nb.sort();
    assert_eq!(na, nb);
    for n in na {
        let (ta, tb) = (sa.tensor(n).unwrap(), sb.tensor(n).unwrap());
        if ta.dtype() == safetensors::Dtype::F32 {
            assert_eq!(ta.data(), tb.data(), "{n}");
        } else {
            // A 16-bit original exported as f32: every value widened exactly.
            let wide: Vec<u8> = ta.data().chunks_exact(2).flat_map(|h| {
                let h = u16::from_le_bytes([h[0], h[1]]);
                let x = if ta.dtype() == safetensors::Dtype::BF16 { f32::from_bits((h as u32) << 16) } else { panic!("{n}: {:?}", ta.dtype()) };
                x.to_le_bytes()
            }).collect();
            assert_eq!(wide, tb.data(), "{n}");
        }
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn import_errors_name_the_problem() {
    let gdir = fixture("gpt2-tiny");
    let tmp = std::env::temp_dir().join(format!("kiln-hf-bad-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let cfg = std::fs::read_to_string(gdir.join("config.json")).unwrap().replace("GPT2LMHeadModel", "FalconForCausalLM");
    std::fs::write(tmp.join("config.json"), cfg).unwrap();
    let e = import_hf(&tmp).err().unwrap();
    assert!(e.contains("FalconForCausalLM") && e.contains("config.json"), "{e}");
    std::fs::copy(gdir.join("config.json"), tmp.join("config.json")).unwrap();
    let e = import_hf(&tmp).err().unwrap();
    assert!(e.contains("no model.safetensors"), "{e}");
    // A config whose shapes disagree with the weights: the tensor is named.
    let cfg = std::fs::read_to_string(gdir.join("config.json")).unwrap().replace("\"n_embd\": 64", "\"n_embd\": 32");
    std::fs::write(tmp.join("config.json"), cfg).unwrap();
    std::fs::copy(gdir.join("model.safetensors"), tmp.join("model.safetensors")).unwrap();
    let e = import_hf(&tmp).err().unwrap();
    assert!(e.contains("transformer.") && e.contains("shape"), "{e}");
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn bias_free_gpt2_exports_with_zero_biases_and_same_logits() {
    let cfg = model::GptConfig::gpt2((2, 2, 8), 6, 12, false, 0.0, true);
    let mut m = model::Gpt::new(cfg, 12, 1);
    let out = std::env::temp_dir().join(format!("kiln-hf-nobias-{}", std::process::id()));
    export_hf(&m, &out).unwrap();
    let mut back = import_hf(&out).unwrap();
    assert!(back.cfg.bias);
    let x: Vec<u32> = (0..12).map(|i| i % 12).collect();
    let (a, b) = (m.forward_logits(&x, 2, 6), back.forward_logits(&x, 2, 6));
    assert!(a.iter().zip(&b).all(|(p, q)| (p - q).abs() < 1e-6));
    let _ = std::fs::remove_dir_all(&out);
}

/// Decoding with the KV cache sees the same sliding window as the full forward: the logits of
/// every position of the Mistral fixture (24 positions, window 8) agree.
#[test]
fn sliding_window_decode_matches_forward() {
    let dir = fixture("mistral-tiny");
    let mut m = import_hf(&dir).unwrap();
    assert_eq!(m.cfg.sliding_window, 8);
    let row = tokens(&dir)[0].clone();
    let t = row.len();
    // With attention sinks too (the first 3 positions beyond the window), whose logits differ.
    let plain = m.forward_logits(&row, 1, t);
    for sinks in [0, 3] {
        m.cfg.attn_sinks = sinks;
        let full = m.forward_logits(&row, 1, t);
        assert_eq!(sinks == 0, full == plain, "sinks {sinks} change the logits past the window");
        let vp = m.cfg.vocab_size;
        let mut cache = m.new_cache();
        for (i, &tok) in row.iter().enumerate() {
            let step = m.decode_step(&mut cache, tok);
            let err = step.iter().zip(&full[i * vp..(i + 1) * vp]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(err < 1e-4, "sinks {sinks} position {i}: max |logit difference| {err}");
        }
    }
}
