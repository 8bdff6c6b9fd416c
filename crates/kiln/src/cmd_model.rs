//! The commands that use a trained model: `kiln generate`, `kiln eval`, `kiln export`.

use crate::error::{user, KilnError, Result};
use crate::run;
use crate::train;
use crate::util::init_threads;
use clap::Args;
use std::path::PathBuf;

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
}

#[derive(Args)]
pub struct ExportCli {
    #[command(flatten)]
    pub source: Source,
    /// Output format; `hf` (Hugging Face GPT2LMHeadModel) is the one supported.
    #[arg(long, default_value = "hf")]
    pub format: String,
    #[arg(long)]
    pub out: PathBuf,
    /// Fold a LoRA run's adapters into the base weights (required for LoRA runs).
    #[arg(long)]
    pub merge: bool,
}

/// Runs `kiln generate`.
pub fn generate(g: GenerateCli) -> Result<()> {
            init_threads(0);
            let (m, tok, _) = load_source(&g.source, g.tokenizer.as_deref())?;
            let text = train::sample_text(&m, &tok, &g.prompt, g.max_new_tokens, g.temperature, g.top_k, g.seed)?;
            println!("{text}");
            Ok(())
        }

/// Runs `kiln eval`.
pub fn eval(e: EvalCli) -> Result<()> {
            init_threads(0);
            let (mut m, tok, run) = load_source(&e.source, e.tokenizer.as_deref())?;
            let t = e.seq_len.unwrap_or(m.cfg.block_size);
            if t == 0 || t > m.cfg.block_size {
                return user(format!("--seq-len {t}: must be between 1 and the model's context ({})", m.cfg.block_size));
            }
            let (toks, what) = match (&run, e.data.is_empty()) {
                (Some(r), true) => (train::load_data(&r.config, Some(tok.clone()))?.val, "validation split".to_string()),
                (None, true) => return user("eval --checkpoint needs --data FILE"),
                (_, false) => {
                    let ds = data::load_with(&e.data, tok.clone(), 0.5)?;
                    // Evaluate on everything given: the two halves, back to back.
                    let mut all = vec![0u32; ds.train.len() + ds.val.len()];
                    ds.train.copy_to(0, &mut all[..ds.train.len()]);
                    ds.val.copy_to(0, &mut all[ds.train.len()..]);
                    (data::Tokens::from_vec(all), e.data.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))
                }
            };
            if toks.len() <= t + 1 {
                return user(format!("{what}: {} tokens, fewer than one window of {t} + 1", toks.len()));
            }
            let batch = run.as_ref().map_or(4, |r| r.config.micro_batch());
            let (vl, n) = train::evaluate(&mut m, &toks, t, batch, 0);
            let mut out = serde_json::json!({"val_loss": vl, "tokens": n, "seq_len": t, "data": what});
            if let Some(r) = &run {
                out["step"] = r.ckpt.state.step.into();
                out["checkpoint"] = r.ckpt.dir.display().to_string().into();
            }
            println!("{out}");
            Ok(())
        }

/// Runs `kiln export`.
pub fn export(x: ExportCli) -> Result<()> {
            if x.format != "hf" {
                return user(format!("--format `{}`: supported formats: hf", x.format));
            }
            let (m, from) = match (&x.source.run, &x.source.checkpoint) {
                (Some(dir), _) => {
                    let r = run::load_run(dir)?;
                    if r.config.lora.rank > 0 && !x.merge {
                        return user(format!("{} trained LoRA adapters: pass --merge to fold them into the base weights", dir.display()));
                    }
                    (run::load_model(&r)?, format!("{} (step {})", r.ckpt.dir.display(), r.ckpt.state.step))
                }
                (None, Some(dir)) => (model::hf::import_hf(dir).map_err(KilnError::User)?, dir.display().to_string()),
                (None, None) => unreachable!("clap requires --run or --checkpoint"),
            };
            model::hf::export_hf(&m, &x.out).map_err(KilnError::User)?;
            println!("exported {from} to {}", x.out.display());
            Ok(())
        }

/// Loads the model (and tokenizer) for `generate` / `eval` from a run or an HF directory.
fn load_source(src: &Source, tokenizer: Option<&str>) -> Result<(model::Gpt, data::Tokenizer, Option<run::SavedRun>)> {
    if let Some(dir) = &src.run {
        let r = run::load_run(dir)?;
        let m = run::load_model(&r)?;
        return Ok((m, r.tokenizer.clone(), Some(r)));
    }
    let dir = src.checkpoint.as_ref().expect("clap requires --run or --checkpoint");
    let mut m = model::hf::import_hf(dir).map_err(KilnError::User)?;
    // --tokenizer, else the directory's own tokenizer.json, else GPT-2's.
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
    m.real_vocab = tok.vocab_size();
    Ok((m, tok, None))
}
