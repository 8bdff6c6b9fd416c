//! What `kiln export` writes beside the weights: the tokenizer and the Hugging Face side files
//! (`tokenizer_config.json`, `generation_config.json`), and a LoRA run's adapters in PEFT's
//! format.

use crate::error::{io_err, user, KilnError, Result};
use crate::run::SavedRun;
use serde_json::json;
use std::path::Path;

/// Writes the tokenizer (`tokenizer.json`: kiln's own kinds in their Hugging Face form), its
/// `tokenizer_config.json` and a `generation_config.json` into `out`: the source directory's
/// own side files when `side` (the base model or the imported checkpoint) has them, else ones
/// made from the tokenizer's special tokens. Returns a note for the user on what was left out.
pub fn side_files(m: &model::Gpt, tok: Option<&data::Tokenizer>, side: Option<&Path>, out: &Path) -> Result<String> {
    let copy = |name: &str| -> Result<bool> {
        match side.map(|d| d.join(name)).filter(|p| p.is_file()) {
            Some(src) => std::fs::copy(&src, out.join(name)).map(|_| true).map_err(|e| io_err(&out.join(name), e)),
            None => Ok(false),
        }
    };
    let write = |name: &str, v: &serde_json::Value| {
        let p = out.join(name);
        std::fs::write(&p, serde_json::to_string_pretty(v).expect("json") + "\n").map_err(|e| io_err(&p, e))
    };
    // kiln's own byte, char and GPT-2 tokenizers go out in their Hugging Face form.
    let Some(h) = tok.map(data::Tokenizer::to_hf) else {
        if !copy("generation_config.json")? {
            write("generation_config.json", &json!({"_from_model_config": true}))?;
        }
        return Ok(" (no tokenizer.json: the run has no tokenizer)".to_string());
    };
    // (With its chat template: `chat_template.jinja` when it came in one.)
    data::Tokenizer::Hf(h.clone()).save_in(out)?;
    copy(data::HF_CHAT_TEMPLATE_FILE)?;
    // Special tokens by their usual names.
    let specials: Vec<String> = h.special_tokens().into_iter().map(|(_, t)| t).collect();
    let find = |names: &[&str]| names.iter().find(|n| specials.iter().any(|s| s == *n)).map(|s| s.to_string());
    let bos = find(&["<s>", "<|begin_of_text|>", "<|endoftext|>"]);
    let eos = find(&["</s>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>"]);
    if !copy("tokenizer_config.json")? {
        let mut cfg = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": m.cfg.block_size,
            "clean_up_tokenization_spaces": false,
        });
        for (key, v) in [("bos_token", &bos), ("eos_token", &eos), ("unk_token", &find(&["<unk>"]))] {
            if let Some(t) = v {
                cfg[key] = t.clone().into();
            }
        }
        write("tokenizer_config.json", &cfg)?;
    }
    let id = |t: &Option<String>| t.as_deref().and_then(|t| h.token_to_id(t));
    // GPT-2's config.json names 50256 (its own `<|endoftext|>`); with another tokenizer the ids
    // are that tokenizer's, or none (a byte or char vocabulary has no such token).
    let cfg_path = out.join("config.json");
    if let Ok(text) = std::fs::read_to_string(&cfg_path) {
        let mut c: serde_json::Value = serde_json::from_str(&text).map_err(|e| KilnError::User(format!("{}: {e}", cfg_path.display())))?;
        // The tokenizer's own ids, named even where the model's config had none (transformers'
        // generate reads them there).
        let (b, e) = (h.config().bos.or(id(&bos)), h.config().eos.or(id(&eos)));
        if c.get("bos_token_id").is_some() || c.get("eos_token_id").is_some() || b.is_some() || e.is_some() {
            c["bos_token_id"] = b.into();
            c["eos_token_id"] = e.into();
            write("config.json", &c)?;
        }
    }
    if !copy("generation_config.json")? {
        let mut g = json!({"_from_model_config": true});
        if let Some(b) = id(&bos) {
            g["bos_token_id"] = b.into();
        }
        if let Some(e) = id(&eos) {
            g["eos_token_id"] = e.into();
        }
        write("generation_config.json", &g)?;
    }
    Ok(String::new())
}

/// PEFT's module name of each kiln LoRA target.
fn peft_module(target: &str) -> Option<&'static str> {
    Some(match target {
        "q" => "q_proj",
        "k" => "k_proj",
        "v" => "v_proj",
        "o" => "o_proj",
        "gate" => "gate_proj",
        "up" => "up_proj",
        "down" => "down_proj",
        _ => return None,
    })
}

/// Writes a LoRA run's adapters as PEFT saves them (`adapter_config.json`,
/// `adapter_model.safetensors` with `base_model.model.<module>.lora_A/B.weight` tensors), for
/// `PeftModel.from_pretrained(base, out)` on the run's base model.
pub fn peft(r: &SavedRun, out: &Path, dtype: safetensors::Dtype) -> Result<()> {
    let c = &r.config;
    if c.lora.rank == 0 {
        return user(format!("{}: not a LoRA run (lora.rank = 0): export it with --format hf", r.dir.display()));
    }
    let gcfg = c.gpt_config(r.tokenizer.vocab_size());
    if gcfg.fused_proj {
        return user("--format peft: Phi-3's q, k and v (and gate and up) are one Linear each (qkv_proj, gate_up_proj), which has no per-projection PEFT module; export --format hf --merge");
    }
    if gcfg.arch != model::config::Arch::Llama {
        return user("--format peft: GPT-2's q, k and v share one Conv1D (c_attn), which has no per-projection PEFT module; export --format hf --merge");
    }
    let mut lo = model::lora::Lora::new(&gcfg, c.lora.rank, c.lora.alpha as f32, &c.lora.targets, 0).map_err(KilnError::User)?;
    let layout = lo.layout.clone();
    crate::checkpoint::read_into(&r.ckpt.model, "", &layout, &mut lo.params, &r.ckpt.dir.join("model.safetensors"))?;
    let targets = model::lora::expand_targets(&gcfg, &c.lora.targets).map_err(KilnError::User)?;
    let modules: Vec<&str> = targets.iter().filter_map(|t| peft_module(t)).collect();
    std::fs::create_dir_all(out).map_err(|e| io_err(out, e))?;
    let mut data = Vec::new();
    for p in &layout.params {
        let f32_bytes: Vec<u8> = lo.params[p.range()].iter().flat_map(|x| x.to_le_bytes()).collect();
        let bytes = model::hf::narrow(&f32_bytes, dtype);
        data.push((format!("base_model.model.{}", p.name), p.shape.clone(), bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> =
        data.iter().map(|(n, s, b)| (n.clone(), safetensors::tensor::TensorView::new(dtype, s.clone(), b).expect("shape matches"))).collect();
    let meta = Some(std::collections::HashMap::from([("format".to_string(), "pt".to_string())]));
    let bytes = safetensors::tensor::serialize(views, meta).map_err(|e| KilnError::Internal(format!("peft export: {e}")))?;
    let path = out.join("adapter_model.safetensors");
    std::fs::write(&path, bytes).map_err(|e| io_err(&path, e))?;
    let cfg = json!({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": c.model.init_from,
        "r": c.lora.rank, "lora_alpha": c.lora.alpha, "lora_dropout": 0.0, "target_modules": modules,
        "bias": "none", "fan_in_fan_out": false, "inference_mode": true, "init_lora_weights": true,
        "use_rslora": false, "use_dora": false, "modules_to_save": null, "layers_to_transform": null,
        "rank_pattern": {}, "alpha_pattern": {},
    });
    let path = out.join("adapter_config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).expect("json") + "\n").map_err(|e| io_err(&path, e))?;
    // The tokenizer beside the adapters, as a fine-tune's output directory holds it (with its
    // chat template), so `AutoTokenizer.from_pretrained(out)` works.
    if let data::Tokenizer::Hf(h) = &r.tokenizer {
        data::Tokenizer::Hf(h.clone()).save_in(out)?;
    }
    Ok(())
}
