//! Built-in presets. Each is a complete config; files and `--set` override its keys.

use crate::config::*;
use crate::error::{user, Result};

pub const PRESETS: &[&str] = &[
    "tiny", "shakespeare-char", "llama-tiny", "moe-tiny", "gpt2-124m", "finetune",
    // config-only shapes of published models (for `kiln bench` shapes, the planner and memory
    // estimates; far too large to train on a CPU)
    "llama2-7b", "llama3-8b", "mixtral-8x7b", "deepseek-v2-lite",
];

/// A published LLaMA-family shape (config only): `(n_layer, n_embd, n_head, n_kv_head, ffn)`.
fn llama_shape(c: &mut RunConfig, (n_layer, n_embd, n_head, n_kv_head, ffn): (usize, usize, usize, usize, usize), block: usize, vocab: usize, theta: f64) {
    c.model = ModelSection {
        arch: model::config::Arch::Llama, n_layer, n_head, n_kv_head, n_embd, ffn_hidden: ffn, rope_theta: theta,
        block_size: block, vocab_size: vocab, bias: false, dropout: 0.0, tied_embeddings: false, ..c.model.clone()
    };
    c.train.batch_size = 1;
    c.data.tokenizer = "byte".into();
}

/// The config `args` ask for over its preset: `--preset`'s, or by default `tiny`, or
/// `finetune` when the run starts from a base model (`--init-from`, however it was given) and no
/// preset was named.
pub fn resolve(args: &TrainArgs) -> Result<RunConfig> {
    let tiny = preset(args.preset.as_deref().unwrap_or("tiny"))?;
    let raw = layered_raw(&tiny, args)?;
    let base = raw.get("model.init_from").and_then(|v| v.as_str()).is_some_and(|s| !s.is_empty());
    if args.preset.is_none() && base {
        return layered(&preset("finetune")?, args);
    }
    RunConfig::resolve(&raw)
}

pub fn preset(name: &str) -> Result<RunConfig> {
    let mut c = RunConfig { preset: name.to_string(), ..Default::default() };
    match name {
        // The default: a byte-level model on the Rust books, about 1.5 minutes on 2 cores.
        "tiny" => {
            c.model = ModelSection { n_layer: 4, n_head: 4, n_embd: 128, block_size: 128, ..c.model };
            c.train.batch_size = 16;
            c.train.lr = 2e-3;
            c.train.min_lr = 2e-4;
            c.train.max_steps = 2000;
            c.train.lr_decay_steps = 2000;
            c.eval.interval = 500;
            c.checkpoint.interval = 1000;
            c.sample.prompt = "The ".into();
        }
        // Fine-tuning a base model (`--init-from`, whose config gives the shape): the default
        // when a base is given and no preset is named. A constant learning rate after no
        // warm-up, as transformers' Trainer defaults to a linear decay to 0: here a cosine
        // decay to 0 over the run (lr_decay_steps 0 = max_steps), at LoRA's usual rate.
        "finetune" => {
            c.train.lr = 1e-4;
            c.train.min_lr = 0.0;
            c.train.warmup_steps = 0;
            c.train.lr_decay_steps = 0;
            c.train.batch_size = 8;
            c.model.dropout = 0.0;
            // The end-of-run sample is greedy (after a chat fine-tune: a held-out prompt's reply).
            c.sample.temperature = 0.0;
        }
        // nanoGPT's config/train_shakespeare_char.py with its README's CPU settings
        // (block 64, batch 12, 4 layers, 4 heads, 128 channels, no dropout, 2000 iterations).
        "shakespeare-char" => {
            c.model = ModelSection { n_layer: 4, n_head: 4, n_embd: 128, block_size: 64, vocab_size: 0, bias: false, dropout: 0.0, tied_embeddings: true, ..c.model };
            c.train.batch_size = 12;
            c.train.lr = 1e-3;
            c.train.min_lr = 1e-4;
            c.train.warmup_steps = 100;
            c.train.max_steps = 2000;
            c.train.lr_decay_steps = 2000;
            c.train.beta2 = 0.99;
            c.eval.interval = 250;
            c.eval.iters = 0;
            c.data.tokenizer = "char".into();
            c.sample.tokens = 500;
        }
        // A LLaMA-style twin of shakespeare-char with the same training settings and about the
        // same parameter count: RMSNorm, RoPE, SwiGLU (hidden 341 ≈ 8/3·128, so the MLP has the
        // GELU MLP's 8·C² weights), GQA with 2 kv heads, untied head.
        "llama-tiny" => {
            c = preset("shakespeare-char")?;
            c.preset = name.to_string();
            c.model.arch = model::config::Arch::Llama;
            c.model.n_kv_head = 2;
            c.model.ffn_hidden = 341;
            c.model.tied_embeddings = false;
            c.model.norm_eps = 1e-6;
        }
        // llama-tiny's MLP split into 8 SwiGLU experts of width 170, 2 per token (Mixtral's
        // top-2 routing): the same active parameters per token (2·170 ≈ 341), 8× the MLP
        // parameters in total. Capacity factor 1.25 (GShard/Switch), load-balancing loss 0.01.
        "moe-tiny" => {
            c = preset("llama-tiny")?;
            c.preset = name.to_string();
            c.model.n_expert = 8;
            c.model.top_k = 2;
            c.model.ffn_hidden = 170;
            c.model.capacity_factor = 1.25;
        }
        // GPT-2 small (124M) with the real GPT-2 BPE (nanoGPT's train_gpt2.py hyper-parameters,
        // with a CPU-sized batch and schedule).
        "gpt2-124m" => {
            c.model = ModelSection { n_layer: 12, n_head: 12, n_embd: 768, block_size: 1024, vocab_size: 0, bias: true, dropout: 0.0, tied_embeddings: true, ..c.model };
            c.train.batch_size = 4;
            c.train.lr = 6e-4;
            c.train.min_lr = 6e-5;
            c.train.warmup_steps = 100;
            c.train.max_steps = 1000;
            c.train.lr_decay_steps = 1000;
            c.train.beta2 = 0.95;
            c.eval.interval = 200;
            c.eval.iters = 10;
            c.checkpoint.interval = 200;
            c.data.tokenizer = "gpt2".into();
            c.sample.prompt = "The ".into();
        }
        // Touvron et al. 2023 (Llama 2), Table 1 / the HF config.
        "llama2-7b" => llama_shape(&mut c, (32, 4096, 32, 32, 11008), 4096, 32000, 10000.0),
        // Meta Llama 3 8B (HF config): GQA with 8 kv heads, rope base 500000.
        "llama3-8b" => llama_shape(&mut c, (32, 4096, 32, 8, 14336), 8192, 128256, 500000.0),
        // Jiang et al. 2024 (Mixtral of Experts): 8 experts, top-2.
        "mixtral-8x7b" => {
            llama_shape(&mut c, (32, 4096, 32, 8, 14336), 32768, 32000, 1e6);
            (c.model.n_expert, c.model.top_k) = (8, 2);
        }
        // DeepSeek-V2-Lite-style MoE (DeepSeek-AI 2024): 64 fine-grained routed experts, top-6,
        // 2 shared. Its multi-head latent attention is modelled as plain multi-head attention.
        "deepseek-v2-lite" => {
            llama_shape(&mut c, (27, 2048, 16, 16, 1408), 4096, 102400, 10000.0);
            (c.model.n_expert, c.model.top_k, c.model.n_shared_expert) = (64, 6, 2);
        }
        _ => return user(format!("unknown preset `{name}` (known: {})", PRESETS.join(", "))),
    }
    Ok(c)
}
