//! The commands that use a trained model: `kiln generate`, `kiln eval`, `kiln export`.

use crate::error::{user, KilnError, Result};
use crate::run;
use crate::train;
use crate::util::init_threads;
use clap::Args;
use std::path::{Path, PathBuf};

/// Which model to load: a kiln run directory or a Hugging Face directory.
#[derive(Args)]
#[group(required = true, multiple = false)]
pub struct Source {
    /// A kiln run directory (its newest valid checkpoint).
    #[arg(long)]
    pub run: Option<PathBuf>,
    /// A Hugging Face model directory (config.json + safetensors, and its tokenizer.json).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
}

#[derive(Args)]
pub struct GenerateCli {
    #[command(flatten)]
    pub source: Source,
    /// Tokenizer for --checkpoint: byte, char, gpt2, a tokenizer.json, or a directory holding
    /// one (default: the checkpoint directory's own tokenizer.json, else gpt2).
    #[arg(long)]
    pub tokenizer: Option<String>,
    #[arg(long, default_value = "")]
    pub prompt: String,
    #[arg(long, default_value_t = 200)]
    pub max_new_tokens: usize,
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    #[arg(long, default_value_t = 200)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Nucleus sampling: draw from the most likely tokens whose probability reaches P (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Divide a token's logit by this once it has appeared (multiply when negative); 1: off.
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// The prompt is the user's message: the tokenizer's chat template is applied, with the
    /// assistant's generation prompt, and only the reply is printed.
    #[arg(long)]
    pub chat: bool,
    /// With --chat: a system message before the user's.
    #[arg(long)]
    pub system: Option<String>,
    /// Stop once the new text contains this (repeatable); the text is cut before it.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Leave special tokens (EOS, chat markers) out of the printed text.
    #[arg(long)]
    pub skip_special_tokens: bool,
    /// Print only the new text, not the prompt.
    #[arg(long)]
    pub completion_only: bool,
    /// Keep generating past the model's EOS tokens (generation_config.json's `eos_token_id`, an
    /// id or a list, and the tokenizer's EOS), which otherwise end the reply.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Where the kernels run: cpu (default), vulkan[:N] or cuda[:N].
    #[arg(long, default_value = "cpu", value_name = "cpu|vulkan[:N]|cuda[:N]")]
    pub device: crate::device::DeviceArg,
}

#[derive(Args)]
pub struct EvalCli {
    #[command(flatten)]
    pub source: Source,
    /// Evaluate on all of these files (required with --checkpoint; with --run the default is
    /// the run's validation split).
    #[arg(long)]
    pub data: Vec<PathBuf>,
    /// Window length: non-overlapping windows of N+1 tokens (default the model's context).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Tokenizer for --checkpoint: byte, char, gpt2, a tokenizer.json, or a directory holding
    /// one (default: the checkpoint directory's own tokenizer.json, else gpt2).
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// What the --data documents are: text, chat or prompt_completion (loss on the assistant
    /// turns / completions only); default the run's data.format, else text.
    #[arg(long)]
    pub format: Option<String>,
    /// windows or documents (each document in its own segment of a packed row); default the
    /// run's data.packing, else windows.
    #[arg(long)]
    pub packing: Option<String>,
    /// With --packing documents: positions restart in every document.
    #[arg(long)]
    pub reset_positions: bool,
    /// Where the kernels run: cpu (default), vulkan[:N] or cuda[:N].
    #[arg(long, default_value = "cpu", value_name = "cpu|vulkan[:N]|cuda[:N]")]
    pub device: crate::device::DeviceArg,
}

#[derive(Args)]
pub struct ExportCli {
    #[command(flatten)]
    pub source: Source,
    /// `hf`: a Hugging Face model directory (config.json, safetensors, tokenizer.json,
    /// tokenizer_config.json, generation_config.json); `peft`: a LoRA run's adapters as PEFT
    /// loads them onto the base (adapter_config.json, adapter_model.safetensors).
    #[arg(long, default_value = "hf")]
    pub format: String,
    #[arg(long)]
    pub out: PathBuf,
    /// Fold a LoRA run's adapters into the base weights (needed for --format hf of a LoRA run).
    #[arg(long)]
    pub merge: bool,
    /// Weight dtype: fp32, bf16 or fp16 (rounded to nearest even).
    #[arg(long, default_value = "fp32")]
    pub dtype: String,
    /// Shard the weights above this size (e.g. 5GB, 500MB), with a model.safetensors.index.json.
    #[arg(long, default_value = "5GB")]
    pub max_shard_size: String,
}

/// Runs `kiln generate`.
pub fn generate(g: GenerateCli) -> Result<()> {
            // A device that is not there is refused before the model is read.
            let gpu = crate::device::open(g.device)?;
            init_threads(0);
            check_sampling(&g)?;
            let (m, tok, run) = load_source(&g.source, g.tokenizer.as_deref(), true)?;
            let tok = tok.expect("a tokenizer was asked for");
            let ids = prompt_ids(&g, &tok)?;
            let home = run.as_ref().map_or_else(|| g.source.checkpoint.clone(), |r| Some(PathBuf::from(&r.config.model.init_from)));
            let stop_ids = if g.ignore_eos { Vec::new() } else { eos_ids(home.as_deref(), &tok)? };
            let sampler = model::Sampler { temperature: g.temperature, top_k: g.top_k, seed: g.seed, top_p: g.top_p, repetition_penalty: g.repetition_penalty, stop_ids };
            let decode = |ids: &[u32]| if g.skip_special_tokens { tok.decode_skipping_special(ids) } else { tok.decode(ids) };
            let mut stop = |out: &[u32]| !g.stop.is_empty() && { let t = decode(out); g.stop.iter().any(|s| t.contains(s.as_str())) };
            let mut out = match gpu {
                None => m.generate_until(&ids, g.max_new_tokens, &sampler, &mut stop),
                #[cfg(feature = "vulkan")]
                Some(gpu) => {
                    // The KV cache on the device; only each step's logits come back.
                    let mut dev = model::device::DeviceGpt::new(std::sync::Arc::new(gpu), &m).map_err(|e| crate::error::KilnError::User(format!("kiln generate --device {}: {e}; pass --device cpu", g.device)))?;
                    dev.generate_until(&ids, g.max_new_tokens, &sampler, &mut stop)
                }
                #[cfg(not(feature = "vulkan"))]
                Some(never) => match never {},
            };
            // The EOS that ended the reply is not part of it.
            if out.last().is_some_and(|t| sampler.stop_ids.contains(t)) {
                out.pop();
            }
            let mut text = decode(&out);
            if let Some(cut) = g.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
                text.truncate(cut);
            }
            if !(g.chat || g.completion_only) {
                text = decode(&ids) + &text;
            }
            println!("{text}");
            Ok(())
        }

/// `kiln generate`'s sampling flags, checked before anything is read.
fn check_sampling(g: &GenerateCli) -> Result<()> {
    if !(g.temperature >= 0.0 && g.temperature.is_finite()) {
        return user(format!("--temperature {}: must be 0 (greedy) or more", g.temperature));
    }
    if !(g.top_p > 0.0 && g.top_p <= 1.0) {
        return user(format!("--top-p {}: must be in (0, 1]", g.top_p));
    }
    if !(g.repetition_penalty > 0.0 && g.repetition_penalty.is_finite()) {
        return user(format!("--repetition-penalty {}: must be positive", g.repetition_penalty));
    }
    if g.system.is_some() && !g.chat {
        return user("--system needs --chat");
    }
    Ok(())
}

/// The prompt's ids: the text, or with --chat the tokenizer's chat template over the system and
/// user messages with the assistant's generation prompt (`apply_chat_template(…,
/// add_generation_prompt=True)`).
fn prompt_ids(g: &GenerateCli, tok: &data::Tokenizer) -> Result<Vec<u32>> {
    if !g.chat {
        return Ok(tok.encode(&g.prompt)?);
    }
    let data::Tokenizer::Hf(h) = tok else {
        return user(format!("--chat needs a Hugging Face tokenizer with a chat template, not {}", tok.kind()));
    };
    let t = h.config().template.as_ref().ok_or_else(|| crate::error::KilnError::User("--chat: the tokenizer has no chat template (neither chat_template.jinja nor tokenizer_config.json's chat_template)".into()))?;
    let mut messages = Vec::new();
    if let Some(s) = &g.system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    messages.push(serde_json::json!({"role": "user", "content": g.prompt}));
    let text = t.render(&messages, true).map_err(|e| crate::error::KilnError::User(format!("--chat: {e}")))?;
    Ok(tok.encode(&text)?)
}

/// The ids that end a reply: `generation_config.json`'s `eos_token_id` (an id or a list) in
/// the model's directory, and the tokenizer's EOS.
fn eos_ids(dir: Option<&Path>, tok: &data::Tokenizer) -> Result<Vec<u32>> {
    let mut ids: Vec<u32> = tok.eos_id().into_iter().collect();
    if let Some(p) = dir.map(|d| d.join("generation_config.json")).filter(|p| p.is_file()) {
        let text = std::fs::read_to_string(&p).map_err(|e| crate::error::io_err(&p, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| crate::error::KilnError::User(format!("{}: not valid JSON: {e}", p.display())))?;
        let bad = || crate::error::KilnError::User(format!("{}: `eos_token_id` must be a token id or a list of them", p.display()));
        match &v["eos_token_id"] {
            serde_json::Value::Null => {}
            serde_json::Value::Array(a) => {
                for x in a {
                    ids.push(x.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(bad)?);
                }
            }
            x => ids.push(x.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(bad)?),
        }
    }
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

/// Runs `kiln eval`.
pub fn eval(e: EvalCli) -> Result<()> {
    // A device that is not there is refused before the model is read.
    let gpu = crate::device::open(e.device)?;
    init_threads(0);
    // Token files need no tokenizer: their ids are checked against the model's vocabulary.
    let token_files = !e.data.is_empty() && e.data.iter().all(|p| data::is_token_file(p));
    let (mut m, tok, run) = load_source(&e.source, e.tokenizer.as_deref(), !token_files)?;
    if let Some(t) = e.seq_len.filter(|&t| t == 0 || t > m.cfg.block_size) {
        return user(format!("--seq-len {t}: must be between 1 and the model's context ({})", m.cfg.block_size));
    }
    // A post-training run's own held-out figures: its pairs' or its prompts' (without --data).
    if let (Some(r), true, Some(tok), None) = (&run, e.data.is_empty(), &tok, &gpu) {
        if r.config.train.objective != crate::config::Objective::Lm {
            return eval_post_training(m, r, tok);
        }
    }
    // The run's documents, packing and loss masks, unless --format says otherwise.
    let mut dcfg = run.as_ref().map_or_else(crate::config::RunConfig::default, |r| r.config.clone());
    if let Some(f) = &e.format {
        dcfg.data.format = <crate::config::Format as plan::policy::Names>::parse(f).map_err(|m| crate::error::KilnError::User(format!("--format: {m}")))?;
    }
    if let Some(p) = &e.packing {
        dcfg.data.packing = <crate::config::Packing as plan::policy::Names>::parse(p).map_err(|m| crate::error::KilnError::User(format!("--packing: {m}")))?;
    }
    if e.reset_positions {
        if dcfg.data.packing != crate::config::Packing::Documents {
            return user("--reset-positions needs --packing documents");
        }
        dcfg.data.reset_positions = true;
    }
    let (toks, what) = match (&run, e.data.is_empty(), &tok) {
        (Some(r), true, Some(tok)) => (train::load_data(&r.config, Some(tok.clone()))?.val().clone(), "validation split".to_string()),
        (_, true, _) => return user("eval --checkpoint needs --data FILE"),
        (_, false, None) => (data::Split::plain(data::load_token_files(&e.data, m.cfg.vocab_size, "the model's vocabulary")?), names(&e.data)),
        // Everything given is evaluated.
        (_, false, Some(tok)) => (data::load_docs(&e.data, data::TokenizerChoice::Given(tok.clone()), 0.0, &train::doc_opts(&dcfg))?.train, names(&e.data)),
    };
    let packed = dcfg.data.packing == crate::config::Packing::Documents;
    // The window: --seq-len, the run's, or sized to the data (its longest document packed, its
    // whole stream in windows), never past the model's context.
    let t = e.seq_len.or(run.as_ref().map(|r| r.config.seq_len())).unwrap_or_else(|| {
        let need = if packed { (0..toks.docs.len()).map(|d| toks.docs.range(d).len()).max().unwrap_or(0) } else { toks.len().saturating_sub(1) };
        need.clamp(1, m.cfg.block_size)
    });
    let batch = run.as_ref().map_or(4, |r| r.config.micro_batch());
    // What the pass will hold, refused before it is allocated when the machine has less.
    let acts = crate::memory::activation_set(&m.cfg, batch, t, model::Recompute::None, &crate::memory::ElementBytes::of(model::Precision::Fp32)).total();
    let need = crate::memory::guard::weight_bytes(&m.cfg) + acts as u128;
    crate::memory::guard::Budget::of(0).check("kiln eval", need, &format!("windows of {t} tokens (--seq-len), {batch} at a time"))?;
    // One window is t + 1 tokens (t inputs, each predicting the next); packed rows are padded.
    if packed && toks.len() < 2 {
        return user(format!("{what}: {} tokens, nothing to predict", toks.len()));
    }
    if !packed && toks.len() < t + 1 {
        return user(format!("{what}: {} tokens, fewer than one window of {t} + 1", toks.len()));
    }
    let eb = train::EvalBatches { packed, reset_positions: dcfg.data.reset_positions, ..train::EvalBatches::windows(t, batch, 0) };
    let (vl, n) = match gpu {
        None => train::evaluate(&mut m, &toks, eb),
        #[cfg(feature = "vulkan")]
        Some(gpu) => {
            let mut dev = model::device::DeviceGpt::new(std::sync::Arc::new(gpu), &m).map_err(|err| KilnError::User(format!("kiln eval --device {}: {err}; pass --device cpu", e.device)))?;
            train::evaluate_on_device(&mut dev, &toks, eb)?
        }
        #[cfg(not(feature = "vulkan"))]
        Some(never) => match never {},
    };
    let mut out = serde_json::json!({"val_loss": vl, "tokens": n, "seq_len": t, "data": what, "loss_vocab": m.real_vocab});
    if let Some(r) = &run {
        out["step"] = r.ckpt.state.step.into();
        out["checkpoint"] = r.ckpt.dir.display().to_string().into();
    }
    println!("{out}");
    Ok(())
}

/// `kiln eval --run` of a preference run: its held-out pairs' loss, rewards and accuracies
/// against the reference it measured; of a GRPO run: its held-out prompts completed greedily and
/// scored.
fn eval_post_training(m: model::Gpt, r: &run::SavedRun, tok: &data::Tokenizer) -> Result<()> {
    let cfg = &r.config;
    let ds = train::load_data(cfg, Some(tok.clone()))?;
    let mut out = match cfg.train.objective {
        crate::config::Objective::Grpo => {
            let rewards = crate::reward::Rewards::new(&cfg.grpo.rewards, &cfg.grpo.reward_weights, &cfg.grpo.answer_pattern)?;
            // (Sampling reads the weights alone: LoRA's adapters merged into them.)
            let (reward, first) = train::grpo::held_out_reward(&run::merged(m), cfg, &ds, &rewards)?;
            let name = cfg.grpo.rewards[0].split(':').next().unwrap_or("reward").to_string();
            serde_json::json!({"val_reward": reward, format!("val_reward_{name}"): first, "prompts": ds.prompts.as_ref().map_or(0, |p| p.val.len().min(if cfg.grpo.eval_prompts == 0 { usize::MAX } else { cfg.grpo.eval_prompts }))})
        }
        _ => {
            let mut m = m;
            let st = train::prefs::eval_run_pairs(&mut m, cfg, &ds, &r.dir)?;
            let n = st.pairs.max(1.0);
            serde_json::json!({"val_loss": st.loss / n, "pairs": st.pairs, "val_rewards_accuracy": st.correct / n, "val_preference_accuracy": st.prefers / n, "val_rewards_margin": (st.reward_chosen - st.reward_rejected) / n})
        }
    };
    out["objective"] = plan::policy::Names::name(cfg.train.objective).into();
    out["step"] = r.ckpt.state.step.into();
    out["checkpoint"] = r.ckpt.dir.display().to_string().into();
    println!("{out}");
    Ok(())
}

fn names(paths: &[PathBuf]) -> String {
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// Runs `kiln export`.
pub fn export(x: ExportCli) -> Result<()> {
    let dtype = match x.dtype.as_str() {
        "fp32" => safetensors::Dtype::F32,
        "bf16" => safetensors::Dtype::BF16,
        "fp16" => safetensors::Dtype::F16,
        other => return user(format!("--dtype `{other}`: expected fp32, bf16 or fp16")),
    };
    let max_shard_bytes = crate::util::parse_size(&x.max_shard_size).map_err(|e| KilnError::User(format!("--max-shard-size: {e}")))?;
    if max_shard_bytes == 0 {
        return user("--max-shard-size must be positive");
    }
    if x.format == "peft" {
        let dir = x.source.run.as_ref().ok_or_else(|| KilnError::User("--format peft exports a LoRA run's adapters: pass --run".into()))?;
        let r = run::load_run(dir)?;
        crate::export::peft(&r, &x.out, dtype)?;
        println!("exported the LoRA adapters of {} (step {}) for PEFT to {}", r.ckpt.dir.display(), r.ckpt.state.step, x.out.display());
        return Ok(());
    }
    if x.format != "hf" {
        return user(format!("--format `{}`: supported formats: hf, peft", x.format));
    }
    // The model, its tokenizer, and the directory that may hold its Hugging Face side files.
    let (m, tok, side, from) = match (&x.source.run, &x.source.checkpoint) {
        (Some(dir), _) => {
            let r = run::load_run(dir)?;
            if r.config.lora.rank > 0 && !x.merge {
                return user(format!("{} trained LoRA adapters: pass --merge to fold them into the base weights, or --format peft", dir.display()));
            }
            let side = (!r.config.model.init_from.is_empty()).then(|| PathBuf::from(&r.config.model.init_from));
            (run::load_model(&r)?, Some(r.tokenizer.clone()), side, format!("{} (step {})", r.ckpt.dir.display(), r.ckpt.state.step))
        }
        (None, Some(dir)) => {
            let m = run::import_hf(dir)?;
            (m, data::Tokenizer::find_in(dir)?, Some(dir.clone()), dir.display().to_string())
        }
        (None, None) => unreachable!("clap requires --run or --checkpoint"),
    };
    model::hf::export_hf_with(&m, &x.out, model::hf::ExportOpts { dtype, max_shard_bytes }).map_err(KilnError::User)?;
    let note = crate::export::side_files(&m, tok.as_ref(), side.as_deref(), &x.out)?;
    println!("exported {from} to {}{note}", x.out.display());
    Ok(())
}

/// Loads the model (and tokenizer) for `generate` / `eval` from a run or an HF directory. A
/// Hugging Face model's loss covers its whole vocabulary, as transformers computes it; its
/// tokenizer (`--tokenizer`, else the directory's own tokenizer.json, else GPT-2's) is resolved
/// only when `need_tokenizer`.
fn load_source(src: &Source, tokenizer: Option<&str>, need_tokenizer: bool) -> Result<(model::Gpt, Option<data::Tokenizer>, Option<run::SavedRun>)> {
    if let Some(dir) = &src.run {
        let r = run::load_run(dir)?;
        let m = run::load_model(&r)?;
        return Ok((m, Some(r.tokenizer.clone()), Some(r)));
    }
    let dir = src.checkpoint.as_ref().expect("clap requires --run or --checkpoint");
    let m = run::import_hf(dir)?;
    if !need_tokenizer {
        return Ok((m, None, None));
    }
    let tok = match tokenizer {
        Some(spec) => data::Tokenizer::from_spec(spec, None)?,
        None => match data::Tokenizer::find_in(dir)? {
            Some(t) => t,
            None => data::Tokenizer::from_spec("gpt2", None)?,
        },
    };
    if tok.vocab_size() > m.cfg.vocab_size {
        return user(format!("{}: the {} tokenizer has {} tokens but the model only {}; pass --tokenizer", dir.display(), tok.kind(), tok.vocab_size(), m.cfg.vocab_size));
    }
    Ok((m, Some(tok), None))
}
