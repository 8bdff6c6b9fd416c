//! Real Hugging Face models in and out through the binary: a bf16 Qwen2 with its own
//! tokenizer.json, `train.seq_len`, an honest `--init-from`, the loss over the model's whole
//! vocabulary, and exports that carry the tokenizer and side files.

use crate::common::*;
use std::fs;
use std::path::{Path, PathBuf};

#[test]
fn qwen2_fine_tunes_with_its_own_tokenizer_and_exports_everything() {
    let fx = fixture("fixtures/qwen2-tiny");
    let text = fixture("data/tinyshakespeare.txt");
    let d = scratch("qwen2");
    let data = d.join("shakespeare.txt");
    fs::write(&data, &fs::read_to_string(&text).unwrap()[..60_000]).unwrap();
    let out = d.join("run");
    let o = kiln(&["train", "--init-from", fx.to_str().unwrap(), "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(),
        "--seq-len", "32", "--set", "train.batch_size=2", "--max-steps", "3", "--set", "eval.iters=1", "--set", "sample.tokens=4",
        "--set", "model.dropout=0.0", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let cfg = fs::read_to_string(out.join("config.toml")).unwrap();
    // The base's shape, its whole vocabulary in the loss, the sequence length asked for.
    for want in ["qkv_bias = true", "vocab_size = 151936", "loss_vocab = 151936", "block_size = 128", "seq_len = 32", "tied_embeddings = true"] {
        assert!(cfg.contains(want), "{want} missing: {cfg}");
    }
    // The resolved config names the tokenizer that ran (the base model's), so replaying it
    // tokenizes the same way.
    let named: toml::Value = toml::from_str(&cfg).unwrap();
    assert_eq!(named["data"]["tokenizer"].as_str(), fx.to_str(), "{cfg}");
    // The run keeps the model's Hugging Face tokenizer under its own name.
    let tok = fs::read_to_string(out.join("tokenizer.json")).unwrap();
    assert_eq!(tok.trim_end(), fs::read_to_string(fx.join("tokenizer.json")).unwrap().trim_end());
    // Export in bf16: weights, tokenizer, the source's tokenizer_config (chat template) and generation config.
    let exp = d.join("export");
    let o = kiln(&["export", "--run", out.to_str().unwrap(), "--out", exp.to_str().unwrap(), "--dtype", "bf16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        assert!(exp.join(f).exists(), "{f}");
    }
    let tc = fs::read_to_string(exp.join("tokenizer_config.json")).unwrap();
    assert!(tc.contains("chat_template"), "{tc}");
    let cj: serde_json::Value = serde_json::from_str(&fs::read_to_string(exp.join("config.json")).unwrap()).unwrap();
    assert_eq!((cj["architectures"][0].as_str(), cj["dtype"].as_str()), (Some("Qwen2ForCausalLM"), Some("bfloat16")));
    // The export evaluates like the run, on the same text through the same tokenizer, over the whole vocabulary.
    let held = d.join("held.txt");
    fs::write(&held, &fs::read_to_string(&text).unwrap()[100_000..103_000]).unwrap();
    let data = held;
    let a = kiln(&["eval", "--run", out.to_str().unwrap(), "--data", data.to_str().unwrap(), "--seq-len", "32"]);
    let e32 = d.join("export32");
    assert!(kiln(&["export", "--run", out.to_str().unwrap(), "--out", e32.to_str().unwrap()]).status.success());
    let b = kiln(&["eval", "--checkpoint", e32.to_str().unwrap(), "--data", data.to_str().unwrap(), "--seq-len", "32"]);
    assert!(a.status.success() && b.status.success(), "{} {}", stderr(&a), stderr(&b));
    let va: serde_json::Value = serde_json::from_str(stdout(&a).trim()).unwrap();
    let vb: serde_json::Value = serde_json::from_str(stdout(&b).trim()).unwrap();
    assert_eq!(va["val_loss"], vb["val_loss"]);
    // Sharded: a 1 MB limit splits the 10 MB of weights, with an index; it loads back the same.
    let sh = d.join("sharded");
    let o = kiln(&["export", "--checkpoint", e32.to_str().unwrap(), "--out", sh.to_str().unwrap(), "--max-shard-size", "1MB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(sh.join("model.safetensors.index.json").exists() && !sh.join("model.safetensors").exists());
    let c = kiln(&["eval", "--checkpoint", sh.to_str().unwrap(), "--data", data.to_str().unwrap(), "--seq-len", "32"]);
    let vc: serde_json::Value = serde_json::from_str(stdout(&c).trim()).unwrap();
    assert_eq!(vb["val_loss"], vc["val_loss"]);
}

#[test]
fn init_from_is_honest_about_the_base_models_settings() {
    let fx = fixture("fixtures/gpt2-tiny");
    let d = scratch("honest");
    let data = corpus(&d);
    let base = ["train", "--init-from", fx.to_str().unwrap(), "--data", data.to_str().unwrap(), "--set", "data.tokenizer=char",
        "--set", "train.batch_size=2", "--max-steps", "2", "--set", "eval.iters=1", "--set", "sample.tokens=0", "--quiet"];
    let run = |extra: &[&str], name: &str| {
        let out = d.join(name);
        let mut a = base.to_vec();
        a.extend_from_slice(&["--out", out.to_str().unwrap()]);
        a.extend_from_slice(extra);
        (kiln(&a), out)
    };
    // A shape key set to something else than the base: refused, naming the key; nothing written.
    let (o, out) = run(&["--set", "model.n_embd=32"], "shape");
    assert_user_error(&o, &["model.n_embd = 32", "model.n_embd = 64", "--init-from"]);
    assert!(!out.exists());
    let (o, _) = run(&["--set", "model.block_size=32"], "block");
    assert_user_error(&o, &["model.block_size", "train.seq_len"]);
    // The same value as the base is fine; a sequence longer than its positions is not.
    let (o, _) = run(&["--set", "model.n_embd=64", "--seq-len", "65"], "long");
    assert_user_error(&o, &["train.seq_len (65)", "model.block_size (64)"]);
    // A setting the base does not fix applies, and config.toml records what ran.
    let (o, out) = run(&["--set", "model.n_embd=64", "--seq-len", "16"], "ok");
    assert!(o.status.success(), "{}", stderr(&o));
    let cfg = fs::read_to_string(out.join("config.toml")).unwrap();
    assert!(cfg.contains("seq_len = 16") && cfg.contains("loss_vocab = 101"), "{cfg}");
}

#[test]
fn bad_hugging_face_configs_are_refused_by_key() {
    let d = scratch("hfbad");
    let data = corpus(&d);
    let fx = fixture("fixtures/llama31-tiny");
    let bad = d.join("mrope");
    fs::create_dir_all(&bad).unwrap();
    for f in ["model.safetensors", "generation_config.json"] {
        fs::copy(fx.join(f), bad.join(f)).unwrap();
    }
    let cfg = fs::read_to_string(fx.join("config.json")).unwrap().replace("\"llama3\"", "\"mrope\"");
    fs::write(bad.join("config.json"), cfg).unwrap();
    let out = d.join("run");
    let o = kiln(&["train", "--init-from", bad.to_str().unwrap(), "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--quiet"]);
    assert_user_error(&o, &["config.json", "mrope", "rope_parameters"]);
    assert!(!out.exists());
    // A dtype kiln cannot read: the tensor and the dtype are named.
    let cfg = fs::read_to_string(fx.join("config.json")).unwrap();
    fs::write(bad.join("config.json"), cfg).unwrap();
    let st = fs::read(fx.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(st[8..8 + header_len].to_vec()).unwrap();
    let mut patched = st.clone();
    let h2 = header.replacen("\"BF16\"", "\"I16\" ", 1);
    assert_eq!(h2.len(), header.len());
    patched[8..8 + header_len].copy_from_slice(h2.as_bytes());
    fs::write(bad.join("model.safetensors"), patched).unwrap();
    let o = kiln(&["eval", "--checkpoint", bad.to_str().unwrap(), "--data", data.to_str().unwrap()]);
    assert_user_error(&o, &["model.safetensors", "I16"]);
}

#[test]
fn eval_of_a_token_file_of_exactly_one_window() {
    let fx = fixture("fixtures/llama31-tiny");
    let d = scratch("onewindow");
    // 25 tokens: one window of 24 + 1, ids below the model's 211-row vocabulary, no tokenizer.
    let toks: Vec<u16> = (0..25u16).map(|i| (i * 7) % 211).collect();
    let f = d.join("tokens.bin");
    fs::write(&f, toks.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let o = kiln(&["eval", "--checkpoint", fx.to_str().unwrap(), "--data", f.to_str().unwrap(), "--seq-len", "24"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!((v["tokens"].as_u64(), v["loss_vocab"].as_u64()), (Some(24), Some(211)));
    // An id the model has no row for is refused, naming the file.
    fs::write(&f, [5u16, 300, 7].iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let o = kiln(&["eval", "--checkpoint", fx.to_str().unwrap(), "--data", f.to_str().unwrap(), "--seq-len", "1"]);
    assert_user_error(&o, &[f.to_str().unwrap(), "300", "211"]);
}

#[test]
fn bad_export_flags_are_refused_before_anything_is_written() {
    let fx = fixture("fixtures/gpt2-tiny");
    let d = scratch("badexport");
    let out = d.join("out");
    let c = fx.to_str().unwrap();
    let o = out.to_str().unwrap();
    assert_user_error(&kiln(&["export", "--checkpoint", c, "--out", o, "--dtype", "fp8"]), &["--dtype", "fp8"]);
    assert_user_error(&kiln(&["export", "--checkpoint", c, "--out", o, "--max-shard-size", "lots"]), &["--max-shard-size"]);
    assert_user_error(&kiln(&["export", "--checkpoint", c, "--out", o, "--format", "peft"]), &["--format peft", "--run"]);
    assert!(!out.exists());
}

/// A fixture of the model crate through the binary: `--init-from` trains 3 steps at 24
/// positions, and the run and its export evaluate alike (both at 4 rows a batch: `eval --run`
/// takes the run's, `--checkpoint` 4; an MoE layer's expert products group a batch's tokens,
/// so their bits depend on it). Returns the run's `[model]` keys, the
/// export's directory and the scratch directory holding it.
fn trains_exports_and_evaluates_alike(name: &str) -> (toml::Value, PathBuf, Scratch) {
    let fx = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures").join(name);
    let d = scratch(name);
    let data = corpus(&d);
    let out = d.join("run");
    let o = kiln(&["train", "--init-from", fx.to_str().unwrap(), "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(),
        "--set", "data.tokenizer=char", "--set", "train.batch_size=4", "--seq-len", "24", "--max-steps", "3", "--set", "eval.iters=1",
        "--set", "sample.tokens=0", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let cfg: toml::Value = toml::from_str(&fs::read_to_string(out.join("config.toml")).unwrap()).unwrap();
    let exp = d.join("export");
    assert!(kiln(&["export", "--run", out.to_str().unwrap(), "--out", exp.to_str().unwrap()]).status.success());
    let a = kiln(&["eval", "--run", out.to_str().unwrap(), "--data", data.to_str().unwrap(), "--seq-len", "24"]);
    let b = kiln(&["eval", "--checkpoint", exp.to_str().unwrap(), "--data", data.to_str().unwrap(), "--seq-len", "24"]);
    assert!(a.status.success() && b.status.success(), "{} {}", stderr(&a), stderr(&b));
    let va: serde_json::Value = serde_json::from_str(stdout(&a).trim()).unwrap();
    let vb: serde_json::Value = serde_json::from_str(stdout(&b).trim()).unwrap();
    assert_eq!(va["val_loss"], vb["val_loss"]);
    (cfg["model"].clone(), exp, d)
}

fn exported_config(exp: &Path) -> serde_json::Value {
    serde_json::from_str(&fs::read_to_string(exp.join("config.json")).unwrap()).unwrap()
}

/// A YaRN model (the model crate's qwen2-yarn fixture): `--init-from` sets
/// `model.rope_scaling = "yarn"` and its keys, and the export has YaRN in `rope_parameters`.
#[test]
fn yarn_model_trains_and_exports_its_rope_scaling() {
    let (m, exp, _d) = trains_exports_and_evaluates_alike("qwen2-yarn");
    assert_eq!((m["rope_scaling"].as_str(), m["rope_factor"].as_float(), m["rope_original_max_positions"].as_integer()), (Some("yarn"), Some(4.0), Some(8)));
    let af = m["rope_attention_factor"].as_float().unwrap();
    assert!((af - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-6, "{af}");
    let cj = exported_config(&exp);
    assert_eq!(cj["rope_parameters"]["rope_type"], "yarn", "{cj}");
}

/// A Qwen3 and a Qwen3-MoE (the model crate's qwen3-tiny and qwen3-moe-tiny fixtures):
/// `--init-from` sets `model.qk_norm` (and the experts), and the exports are Qwen3 / Qwen3-MoE
/// again with their per-head norms and Qwen3-MoE's expert names.
#[test]
fn qwen3_models_train_and_export_as_qwen3() {
    for (fixture, arch, tensor) in [
        ("qwen3-tiny", "Qwen3ForCausalLM", "model.layers.1.self_attn.k_norm.weight"),
        ("qwen3-moe-tiny", "Qwen3MoeForCausalLM", "model.layers.1.mlp.experts.3.down_proj.weight"),
    ] {
        let (m, exp, _d) = trains_exports_and_evaluates_alike(fixture);
        assert_eq!((m["qk_norm"].as_bool(), m["head_dim"].as_integer()), (Some(true), Some(12)));
        let cj = exported_config(&exp);
        assert_eq!(cj["architectures"][0].as_str(), Some(arch), "{cj}");
        let st = fs::read(exp.join("model.safetensors")).unwrap();
        let names = safetensors::SafeTensors::deserialize(&st).unwrap().names().into_iter().map(String::from).collect::<Vec<_>>();
        assert!(names.iter().any(|n| n == tensor), "{names:?}");
    }
}

/// A SmolLM3 (the model crate's smollm3-tiny fixture): `--init-from` sets `model.nope_layers`,
/// the run trains, and its export is SmolLM3 again with its `no_rope_layers` and an explicit
/// `pad_token_id` (absent, SmolLM3Config would read 128004).
#[test]
fn smollm3_model_trains_and_exports_as_smollm3() {
    let (m, exp, _d) = trains_exports_and_evaluates_alike("smollm3-tiny");
    assert_eq!(m["nope_layers"].as_array().map(|a| a.iter().map(|v| v.as_integer().unwrap()).collect::<Vec<_>>()), Some(vec![3]));
    let cj = exported_config(&exp);
    assert_eq!(cj["architectures"][0].as_str(), Some("SmolLM3ForCausalLM"), "{cj}");
    assert_eq!(cj["no_rope_layers"], serde_json::json!([1, 1, 1, 0]));
    assert!(cj["pad_token_id"].is_null(), "{cj}");
}

/// A Gemma 3 text model (the model crate's gemma3-tiny fixture): `--init-from` sets the
/// sandwich norms, GeGLU, the `1 + w` norms, the embedding scale, `query_pre_attn_scalar` and
/// the local rotary base, the run trains, its export is Gemma 3 again (per-layer-type rotary
/// parameters, its layer types).
#[test]
fn gemma3_model_trains_and_exports_as_gemma3() {
    let (m, exp, _d) = trains_exports_and_evaluates_alike("gemma3-tiny");
    assert_eq!((m["block_norms"].as_str(), m["gate_act"].as_str(), m["norm_offset"].as_bool(), m["embed_scale"].as_bool()), (Some("sandwich"), Some("gelu_tanh"), Some(true), Some(true)));
    assert_eq!((m["query_pre_attn_scalar"].as_integer(), m["rope_local_theta"].as_float()), (Some(12), Some(1e4)));
    let cj = exported_config(&exp);
    assert_eq!(cj["architectures"][0].as_str(), Some("Gemma3ForCausalLM"), "{cj}");
    assert_eq!(cj["layer_types"], serde_json::json!(["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]));
    assert_eq!(cj["rope_parameters"]["sliding_attention"]["rope_theta"].as_f64(), Some(1e4), "{cj}");
    assert_eq!(cj["rope_parameters"]["full_attention"]["rope_type"].as_str(), Some("linear"), "{cj}");
}

/// A Gemma 2 (the model crate's gemma2-tiny fixture): `--init-from` sets Gemma's block
/// without q/k norms and both soft-caps, the run trains, and its export is Gemma 2 again with
/// its caps and layer types.
#[test]
fn gemma2_model_trains_and_exports_as_gemma2() {
    let (m, exp, _d) = trains_exports_and_evaluates_alike("gemma2-tiny");
    assert_eq!((m["qk_norm"].as_bool(), m["attn_softcap"].as_float(), m["final_softcap"].as_float()), (Some(false), Some(2.0), Some(3.0)));
    let cj = exported_config(&exp);
    assert_eq!(cj["architectures"][0].as_str(), Some("Gemma2ForCausalLM"), "{cj}");
    assert_eq!((cj["attn_logit_softcapping"].as_f64(), cj["final_logit_softcapping"].as_f64()), (Some(2.0), Some(3.0)), "{cj}");
    assert_eq!(cj["layer_types"], serde_json::json!(["sliding_attention", "full_attention", "sliding_attention"]));
}

/// A DeepSeek-V3 whose every layer is dense (the model crate's deepseek-v3-dense-tiny fixture):
/// `--init-from` sets multi-head latent attention's keys, the run trains, and its export is
/// DeepSeek-V3 again; LoRA and fp8 are refused by name, each in one line
/// with exit code 2 and nothing written.
#[test]
fn deepseek_v3_dense_model_trains_and_exports_as_deepseek_v3() {
    let (m, exp, d) = trains_exports_and_evaluates_alike("deepseek-v3-dense-tiny");
    assert_eq!((m["kv_lora_rank"].as_integer(), m["q_lora_rank"].as_integer(), m["v_head_dim"].as_integer(), m["rope_interleave"].as_bool()), (Some(12), Some(16), Some(6), Some(true)));
    let cj = exported_config(&exp);
    assert_eq!((cj["architectures"][0].as_str(), cj["kv_lora_rank"].as_u64(), cj["first_k_dense_replace"].as_u64()), (Some("DeepseekV3ForCausalLM"), Some(12), Some(3)), "{cj}");
    let fx = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/deepseek-v3-dense-tiny");
    let data = corpus(&d);
    for (args, want) in [
        (&["--set", "lora.rank=4"][..], "multi-head latent attention"),
        (&["--set", "train.precision=fp8"], "model.kv_lora_rank"),
    ] {
        let out = d.join("refused");
        let o = kiln(&[&["train", "--init-from", fx.to_str().unwrap(), "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--set", "data.tokenizer=char", "--seq-len", "24", "--max-steps", "1"][..], args].concat());
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want) && stderr(&o).trim().lines().count() == 1, "{args:?}: {}", stderr(&o));
        assert!(!out.exists(), "{args:?} wrote {}", out.display());
    }
}

/// A DeepSeek-V3 with a dense layer before routed ones (the model crate's deepseek-v3-moe-tiny
/// fixture): `--init-from` sets the sigmoid router's keys, the run trains, and its export is
/// DeepSeek-V3 again (its expert names, the dense layer's width, the correction bias as read: no
/// gradient moved it); with `model.moe_bias_rate` the bias moves by the rate every step.
#[test]
fn deepseek_v3_moe_model_trains_and_exports_as_deepseek_v3() {
    let (m, exp, _d) = trains_exports_and_evaluates_alike("deepseek-v3-moe-tiny");
    assert_eq!((m["moe_router"].as_str(), m["moe_groups"].as_integer(), m["moe_topk_groups"].as_integer(), m["moe_gate_scale"].as_float()), (Some("sigmoid"), Some(4), Some(2), Some(2.5)));
    let cj = exported_config(&exp);
    assert_eq!((cj["first_k_dense_replace"].as_u64(), cj["n_routed_experts"].as_u64(), cj["n_group"].as_u64(), cj["intermediate_size"].as_u64()), (Some(1), Some(8), Some(4), Some(64)), "{cj}");
    let fx = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/deepseek-v3-moe-tiny");
    let read = |dir: &Path, name: &str| {
        let bytes = fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor(name).unwrap();
        let f: Vec<f32> = match t.dtype() {
            safetensors::Dtype::BF16 => t.data().chunks(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)).collect(),
            _ => t.data().chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        };
        f
    };
    let name = "model.layers.1.mlp.gate.e_score_correction_bias";
    assert_eq!(read(&exp, name), read(&fx, name));
    // Loss-free balancing (`model.moe_bias_rate`): 3 steps move every bias by ±rate a step
    // (an odd multiple of the rate, at most 3), against its expert's load.
    let d = scratch("dsv3-bias");
    let (data, out, exp) = (corpus(&d), d.join("run"), d.join("export"));
    let o = kiln(&["train", "--init-from", fx.to_str().unwrap(), "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(),
        "--set", "data.tokenizer=char", "--set", "train.batch_size=4", "--seq-len", "24", "--max-steps", "3", "--set", "model.moe_bias_rate=0.001",
        "--set", "sample.tokens=0", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(kiln(&["export", "--run", out.to_str().unwrap(), "--out", exp.to_str().unwrap()]).status.success());
    for l in [1, 2] {
        let name = format!("model.layers.{l}.mlp.gate.e_score_correction_bias");
        let (before, after) = (read(&fx, &name), read(&exp, &name));
        for (b, a) in before.iter().zip(&after) {
            let k = (a - b) / 0.001;
            assert!((k - k.round()).abs() < 1e-2 && (k.round() as i64).abs() % 2 == 1 && k.abs() < 3.5, "layer {l}: moved by {k} steps");
        }
    }
}

/// An OLMo 2 (the model crate's olmo2-tiny fixture): `--init-from` sets `model.block_norms =
/// post` and the whole-width q/k norms, the run trains, and its export is OLMo 2 again with its
/// `pad_token_id`; tensor parallelism is refused by name (each q/k norm spans every head).
#[test]
fn olmo2_model_trains_and_exports_as_olmo2() {
    let (m, exp, _d) = trains_exports_and_evaluates_alike("olmo2-tiny");
    assert_eq!((m["block_norms"].as_str(), m["qk_norm"].as_bool(), m["qk_norm_whole"].as_bool()), (Some("post"), Some(true), Some(true)));
    let cj = exported_config(&exp);
    assert_eq!(cj["architectures"][0].as_str(), Some("Olmo2ForCausalLM"), "{cj}");
    assert_eq!(cj["pad_token_id"].as_u64(), Some(1), "{cj}");
    let fx = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/olmo2-tiny");
    let cfg = model::hf::read_config(&fx).unwrap().0;
    let e = parallel::tp::local_config(&cfg, 2, 0, false).unwrap_err();
    assert!(e.contains("model.qk_norm_whole") && e.contains("parallel.tp = 2"), "{e}");
}

/// A Phi-3 with LongRoPE (the model crate's phi3-longrope fixture): `--init-from` sets
/// `model.fused_proj` and the `longrope` keys with both factor lists, the run trains at 24
/// positions (the long factors), and its export is Phi-3 again (fused tensors, `rope_parameters`
/// longrope).
#[test]
fn phi3_longrope_model_trains_and_exports_as_phi3() {
    let (m, exp, _d) = trains_exports_and_evaluates_alike("phi3-longrope");
    assert_eq!((m["rope_scaling"].as_str(), m["fused_proj"].as_bool(), m["rope_original_max_positions"].as_integer()), (Some("longrope"), Some(true), Some(8)));
    let long: Vec<f64> = m["rope_long_factor"].as_array().unwrap().iter().map(|v| v.as_float().unwrap()).collect();
    assert_eq!(long, [1.0, 1.4f32 as f64, 3.5, 9.0]);
    let cj = exported_config(&exp);
    assert_eq!((cj["architectures"][0].as_str(), cj["rope_parameters"]["rope_type"].as_str()), (Some("Phi3ForCausalLM"), Some("longrope")), "{cj}");
    let st = fs::read(exp.join("model.safetensors")).unwrap();
    let names = safetensors::SafeTensors::deserialize(&st).unwrap().names().into_iter().map(String::from).collect::<Vec<_>>();
    assert!(names.iter().any(|n| n.ends_with("qkv_proj.weight")) && !names.iter().any(|n| n.ends_with("q_proj.weight")), "{names:?}");
    // Phi-4-mini's form: a partial rotary factor (model.rotary_dim) and a tied head.
    let (m4, exp4, _d4) = trains_exports_and_evaluates_alike("phi4mini-partial");
    assert_eq!((m4["rotary_dim"].as_integer(), m4["tied_embeddings"].as_bool()), (Some(6), Some(true)));
    assert_eq!(exported_config(&exp4)["partial_rotary_factor"].as_f64(), Some(0.75));
    // A LoRA run's adapters have no PEFT form on Phi-3's fused projections: refused, naming them.
    let fx = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/phi3-longrope");
    let d = scratch("phi3-lora");
    let (data, lora) = (corpus(&d), d.join("lora"));
    let o = kiln(&["train", "--init-from", fx.to_str().unwrap(), "--data", data.to_str().unwrap(), "--out", lora.to_str().unwrap(), "--set", "data.tokenizer=char",
        "--lora-rank", "2", "--seq-len", "8", "--max-steps", "1", "--set", "eval.iters=1", "--set", "sample.tokens=0", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = d.join("peft");
    assert_user_error(&kiln(&["export", "--run", lora.to_str().unwrap(), "--out", out.to_str().unwrap(), "--format", "peft"]), &["--format peft", "qkv_proj", "--merge"]);
    assert!(!out.exists());
}

/// A fine-tune of a base model with no preset named starts from the `finetune` preset, not
/// `tiny`'s schedule: named so, its cosine decay over the run (to 0), and LoRA's usual
/// learning rate of 1e-4 accepted (tiny's `min_lr` of 2e-4 would refuse it).
#[test]
fn a_fine_tune_without_a_preset_gets_fine_tuning_defaults() {
    let fx = fixture("fixtures/llama-tiny");
    let d = scratch("finetune-defaults");
    let data = corpus(&d);
    let out = d.join("run");
    let o = kiln(&["train", "--init-from", fx.to_str().unwrap(), "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--set", "data.tokenizer=char",
        "--lora-rank", "2", "--set", "train.lr=1e-4", "--seq-len", "16", "--max-steps", "6", "--set", "train.log_interval=1", "--set", "eval.iters=1", "--set", "sample.tokens=0", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let cfg: toml::Value = toml::from_str(&fs::read_to_string(out.join("config.toml")).unwrap()).unwrap();
    assert_eq!(cfg["preset"].as_str(), Some("finetune"), "{cfg}");
    assert_eq!((cfg["train"]["warmup_steps"].as_integer(), cfg["train"]["lr_decay_steps"].as_integer(), cfg["train"]["min_lr"].as_float()), (Some(0), Some(0), Some(0.0)));
    let lrs: Vec<f64> = fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "train").map(|v| v["lr"].as_f64().unwrap()).collect();
    assert_eq!(lrs.len(), 6);
    assert!((lrs[0] - 1e-4).abs() < 1e-12 && lrs.windows(2).all(|w| w[1] < w[0]) && lrs[5] < 1e-5, "{lrs:?}");
    // Without --out its directory is named after the preset it ran.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["train", "--init-from", fx.to_str().unwrap(), "--data", data.to_str().unwrap(), "--set", "data.tokenizer=char", "--seq-len", "16", "--max-steps", "1", "--set", "eval.iters=1", "--set", "sample.tokens=0", "--quiet"])
        .current_dir(&*d)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let names: Vec<String> = fs::read_dir(d.join("runs")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.len() == 1 && names[0].starts_with("finetune-"), "{names:?}");
}
