//! The command line. Every user mistake ends as a one-line `error: …` and exit code 2.

use crate::error::{user, KilnError, Result};
use crate::run;
use crate::trainer::{self, TrainArgs};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Parser)]
#[command(name = "kiln", version, about = "kiln: an LLM training system")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train a model (default: the `tiny` preset on the Rust books of the local Rust install).
    Train(TrainCli),
    /// Generate text from a run's newest valid checkpoint.
    Generate(GenerateCli),
    /// Evaluate a run's newest valid checkpoint; prints one JSON object.
    Eval(EvalCli),
    /// Time training steps on synthetic tokens (JSON), or measure the matmul peak with --peak.
    Bench(BenchCli),
    /// Plan a training run: memory, step time, MFU; search parallel layouts; validate.
    #[command(subcommand)]
    Plan(crate::cmd_plan::PlanCmd),
    /// Data preparation.
    #[command(subcommand)]
    Data(DataCmd),
    /// Tokenizers.
    #[command(subcommand)]
    Tokenizer(TokenizerCmd),
}

#[derive(Args)]
struct TrainCli {
    /// tiny (default), shakespeare-char, gpt2-124m
    #[arg(long)]
    preset: Option<String>,
    /// A TOML file of config keys (sections [model], [train], [eval], [checkpoint], [data], [sample]).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Text files, directories, .bin/.npy token files, or a `kiln data prepare` directory.
    #[arg(long)]
    data: Vec<PathBuf>,
    /// Run directory (default runs/<preset>-<time>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Override a config key: --set train.lr=3e-4
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    #[arg(long)]
    max_steps: Option<u64>,
    /// Continue the run in --out (or the newest under runs/) from its newest valid checkpoint.
    #[arg(long)]
    resume: bool,
    #[arg(long)]
    seed: Option<u64>,
    /// No progress output.
    #[arg(long)]
    quiet: bool,
}

#[derive(Args)]
struct BenchCli {
    #[arg(long)]
    preset: Option<String>,
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Timed steps (after the warm-up).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Threads (default: RAYON_NUM_THREADS or all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Print the JSON on one line (default: pretty-printed).
    #[arg(long)]
    json: bool,
    /// Measure the fp32 matmul peak instead.
    #[arg(long)]
    peak: bool,
    /// Add per-kernel time per step.
    #[arg(long)]
    breakdown: bool,
}

#[derive(Args)]
struct GenerateCli {
    #[arg(long)]
    run: PathBuf,
    #[arg(long, default_value = "")]
    prompt: String,
    #[arg(long, default_value_t = 200)]
    max_new_tokens: usize,
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    #[arg(long, default_value_t = 200)]
    top_k: usize,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
}

#[derive(Args)]
struct EvalCli {
    #[arg(long)]
    run: PathBuf,
    /// Evaluate on all of these files instead of the run's validation split.
    #[arg(long)]
    data: Vec<PathBuf>,
}

#[derive(Subcommand)]
enum DataCmd {
    /// Tokenize inputs into memory-mapped token shards with a train/val split.
    Prepare {
        #[arg(long, required = true)]
        input: Vec<PathBuf>,
        /// byte, char, gpt2, or a tokenizer JSON file
        #[arg(long, default_value = "byte")]
        tokenizer: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0.1)]
        val_fraction: f64,
    },
}

#[derive(Subcommand)]
enum TokenizerCmd {
    /// Train a byte-level BPE tokenizer on a corpus.
    Train {
        #[arg(long, required = true)]
        input: Vec<PathBuf>,
        #[arg(long, default_value_t = 4096)]
        vocab_size: usize,
        #[arg(long)]
        out: PathBuf,
    },
}

/// Parses the arguments, runs the command, and returns the exit code.
pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    match dispatch(cli.cmd) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
    }
}

/// Sizes the one rayon pool: `n` threads, or with 0 `RAYON_NUM_THREADS` / all cores. Only the
/// first call in a process has an effect.
pub fn init_threads(n: usize) {
    let mut b = rayon::ThreadPoolBuilder::new();
    if n > 0 {
        b = b.num_threads(n);
    }
    let _ = b.build_global();
}

fn dispatch(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Train(a) => {
            let args = TrainArgs { preset: a.preset, config: a.config, data: a.data, out: a.out, set: a.set, max_steps: a.max_steps, resume: a.resume, seed: a.seed, quiet: a.quiet };
            let stop = Arc::new(AtomicBool::new(false));
            let s2 = stop.clone();
            let _ = ctrlc::set_handler(move || {
                if s2.swap(true, Ordering::SeqCst) {
                    eprintln!("\nsecond interrupt: exiting without saving");
                    std::process::exit(130);
                }
                eprintln!("\ninterrupt: finishing this step, then saving a checkpoint (Ctrl-C again to abort)");
            });
            trainer::train(&args, &stop).map(|_| ())
        }
        Cmd::Plan(p) => crate::cmd_plan::run(p).map_err(KilnError::User),
        Cmd::Bench(b) => {
            init_threads(b.threads.unwrap_or(0));
            let v = if b.peak {
                crate::bench::peak()
            } else {
                crate::bench::bench(&crate::bench::BenchArgs { preset: b.preset, config: b.config, set: b.set, steps: b.steps, warmup: b.warmup, breakdown: b.breakdown })?
            };
            println!("{}", if b.json { v.to_string() } else { serde_json::to_string_pretty(&v).unwrap() });
            Ok(())
        }
        Cmd::Generate(g) => {
            init_threads(0);
            let r = run::load_run(&g.run)?;
            let m = run::load_model(&r)?;
            let text = trainer::sample_text(&m, &r.tokenizer, &g.prompt, g.max_new_tokens, g.temperature, g.top_k, g.seed);
            println!("{text}");
            Ok(())
        }
        Cmd::Eval(e) => {
            init_threads(0);
            let r = run::load_run(&e.run)?;
            let mut m = run::load_model(&r)?;
            let t = r.config.model.block_size;
            let (toks, what) = if e.data.is_empty() {
                let ds = trainer::load_data(&r.config, Some(r.tokenizer.clone()))?;
                (ds.val, "validation split".to_string())
            } else {
                let ds = data::load_with(&e.data, r.tokenizer.clone(), 0.5)?;
                // Evaluate on everything given: the two halves, train then val, back to back.
                let mut all = vec![0u32; ds.train.len() + ds.val.len()];
                ds.train.copy_to(0, &mut all[..ds.train.len()]);
                ds.val.copy_to(0, &mut all[ds.train.len()..]);
                (data::Tokens::from_vec(all), e.data.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))
            };
            if toks.len() <= t + 1 {
                return user(format!("{what}: {} tokens, fewer than one window of model.block_size ({t}) + 1", toks.len()));
            }
            let (vl, n) = trainer::evaluate(&mut m, &toks, t, r.config.micro_batch(), 0);
            let out = serde_json::json!({"val_loss": vl, "tokens": n, "step": r.ckpt.state.step, "checkpoint": r.ckpt.dir.display().to_string(), "data": what});
            println!("{out}");
            Ok(())
        }
        Cmd::Data(DataCmd::Prepare { input, tokenizer, out, val_fraction }) => {
            let rep = data::prepare(&input, &tokenizer, &out, val_fraction)?;
            println!("{}", rep.description);
            Ok(())
        }
        Cmd::Tokenizer(TokenizerCmd::Train { input, vocab_size, out }) => {
            let mut text = String::new();
            for p in &input {
                let s = std::fs::read_to_string(p).map_err(|e| KilnError::User(format!("{}: cannot read: {e}", p.display())))?;
                text.push_str(&s);
                text.push_str("\n\n");
            }
            let tok = data::train_bpe(&text, vocab_size)?;
            tok.save(&out)?;
            println!("trained a byte-level BPE tokenizer with {} tokens on {} bytes: {}", tok.vocab_size(), text.len(), out.display());
            Ok(())
        }
    }
}
