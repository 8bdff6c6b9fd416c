//! The command line. Every user mistake ends as a one-line `error: …` and exit code 2.

use crate::error::{user, KilnError, Result};
use crate::run;
use crate::util::init_threads;
use crate::train::{self, TrainArgs};
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
    /// Print the memory plan of the run `kiln train` would start with the same flags: per-rank
    /// bytes for parameters, gradients, optimizer state, activations by component, temporary
    /// and communication buffers; exit 2 if it exceeds --memory-limit.
    Memory(MemoryCli),
    /// Generate text from a run's newest valid checkpoint.
    Generate(GenerateCli),
    /// Evaluate a run's newest valid checkpoint; prints one JSON object.
    Eval(EvalCli),
    /// Time training steps on synthetic tokens (JSON), or measure the matmul peak with --peak.
    Bench(BenchCli),
    /// Plan a training run: memory, step time, MFU; search parallel layouts; validate.
    #[command(subcommand)]
    Plan(crate::cmd_plan::PlanCmd),
    /// Plot loss, learning rate and throughput of one or more runs into a PNG.
    Plot(crate::obs::cmd::PlotArgs),
    /// List run directories with their config differences and val losses.
    Runs(crate::obs::cmd::RunsArgs),
    /// Report this machine, the build's backends and the default corpus; non-zero if a default run cannot start.
    Doctor,
    /// Export a run's newest valid checkpoint (Hugging Face format).
    Export(ExportCli),
    /// Print a pipeline schedule as a timeline (one row per stage), with its bubble.
    PpSchedule(PpScheduleCli),
    /// Checkpoints: inspect (manifest and layout-independent SHA-256 digests as JSON).
    #[command(subcommand)]
    Checkpoint(CheckpointCmd),
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
    /// Start from a base model: a kiln run directory or a Hugging Face directory
    /// (GPT2LMHeadModel / LlamaForCausalLM: config.json + model.safetensors).
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Fine-tune LoRA adapters of this rank on a frozen --init-from base.
    #[arg(long)]
    lora_rank: Option<usize>,
    #[arg(long)]
    lora_alpha: Option<f64>,
    /// Comma-separated: q,k,v,o,gate,up,down
    #[arg(long)]
    lora_targets: Option<String>,
    /// Record a Chrome trace (trace.json in the run directory) of the first N steps.
    #[arg(long, value_name = "STEPS")]
    profile: Option<u64>,
    /// Data-parallel ranks (parallel.dp): threads of this process, or with --backend mpi the
    /// mpirun processes (0 = all of them).
    #[arg(long)]
    dp: Option<usize>,
    /// ZeRO stage 0-3 (parallel.zero).
    #[arg(long)]
    zero: Option<usize>,
    /// Tensor-parallel ranks (parallel.tp).
    #[arg(long)]
    tp: Option<usize>,
    /// Expert-parallel ranks (parallel.ep): each MoE layer's experts spread over them.
    #[arg(long)]
    ep: Option<usize>,
    /// Sequence parallelism within the tensor-parallel group (parallel.sequence_parallel).
    #[arg(long)]
    sequence_parallel: bool,
    /// Storage precision: fp32, bf16, fp16 or fp8 (train.precision).
    #[arg(long)]
    precision: Option<String>,
    /// Activation recomputation: none, selective or full (model.recompute).
    #[arg(long)]
    recompute: Option<String>,
    /// With --recompute full: every K-th layer only (model.recompute_every).
    #[arg(long, value_name = "K")]
    recompute_every: Option<usize>,
    /// Pipeline stages (parallel.pp).
    #[arg(long)]
    pp: Option<usize>,
    /// Micro-batches per step, the pipeline's (train.grad_accum).
    #[arg(long)]
    micro_batches: Option<usize>,
    /// Pipeline schedule: gpipe, 1f1b or interleaved (parallel.schedule).
    #[arg(long)]
    schedule: Option<String>,
    /// Model chunks per pipeline rank, interleaved schedule (parallel.virtual_stages).
    #[arg(long = "virtual")]
    virtual_stages: Option<usize>,
    /// Layers per pipeline stage, comma-separated (parallel.pp_layers; default: balanced).
    #[arg(long)]
    pp_layers: Option<String>,
    /// Record pipeline tasks per rank: off, wall or device (parallel.pp_trace).
    #[arg(long)]
    pp_trace: Option<String>,
    /// none or optimizer: AdamW moments in memory-mapped files (memory.offload).
    #[arg(long)]
    offload: Option<String>,
    /// inproc or mpi (parallel.backend).
    #[arg(long)]
    backend: Option<String>,
    /// Run training as a child process and restart it from the newest valid checkpoint when it
    /// crashes or stops sending heartbeats.
    #[arg(long)]
    supervise: bool,
    /// With --supervise: restarts before giving up.
    #[arg(long, default_value_t = 3)]
    max_restarts: u32,
    /// With --supervise: seconds without a heartbeat (one per step) after which the training
    /// process counts as hung and is killed.
    #[arg(long, default_value_t = 300.0)]
    heartbeat_timeout: f64,
    /// No progress output.
    #[arg(long)]
    quiet: bool,
    /// Refuse to start when the memory plan needs more than SIZE per rank (memory.limit):
    /// bytes, or e.g. 2GiB, 1500MB; 0 = no limit.
    #[arg(long, value_name = "SIZE")]
    memory_limit: Option<String>,
}

impl TrainCli {
    /// The trainer's arguments (shared by `kiln train` and `kiln memory`). `--memory-limit`
    /// becomes the last `--set memory.limit=…`, so it wins over the config file and `--set`.
    fn args(&self) -> TrainArgs {
        let mut set = self.set.clone();
        if let Some(p) = &self.precision {
            set.push(format!("train.precision={}", toml::Value::String(p.clone())));
        }
        if let Some(r) = &self.recompute {
            set.push(format!("model.recompute={}", toml::Value::String(r.clone())));
        }
        if let Some(k) = self.recompute_every {
            set.push(format!("model.recompute_every={k}"));
        }
        if let Some(l) = &self.memory_limit {
            set.push(format!("memory.limit={}", toml::Value::String(l.clone())));
        }
        TrainArgs { preset: self.preset.clone(), config: self.config.clone(), data: self.data.clone(), out: self.out.clone(), set, max_steps: self.max_steps, resume: self.resume, seed: self.seed, init_from: self.init_from.clone(), lora_rank: self.lora_rank, lora_alpha: self.lora_alpha, lora_targets: self.lora_targets.clone(), profile: self.profile, dp: self.dp, zero: self.zero, tp: self.tp, ep: self.ep, pp: self.pp, sequence_parallel: self.sequence_parallel, micro_batches: self.micro_batches, schedule: self.schedule.clone(), virtual_stages: self.virtual_stages, pp_layers: self.pp_layers.clone(), pp_trace: self.pp_trace.clone(), offload: self.offload.clone(), backend: self.backend.clone(), quiet: self.quiet }
    }
}

#[derive(Args)]
struct MemoryCli {
    #[command(flatten)]
    train: TrainCli,
    /// Print the plan as one JSON object.
    #[arg(long)]
    json: bool,
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

/// Which model to load: a kiln run directory or a Hugging Face directory.
#[derive(Args)]
#[group(required = true, multiple = false)]
struct Source {
    /// A kiln run directory (its newest valid checkpoint).
    #[arg(long)]
    run: Option<PathBuf>,
    /// A Hugging Face GPT-2 directory (config.json + model.safetensors).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
}

#[derive(Args)]
struct GenerateCli {
    #[command(flatten)]
    source: Source,
    /// Tokenizer for --checkpoint (byte, char, gpt2, or a JSON file); default gpt2.
    #[arg(long)]
    tokenizer: Option<String>,
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
    #[command(flatten)]
    source: Source,
    /// Evaluate on all of these files (required with --checkpoint; with --run the default is
    /// the run's validation split).
    #[arg(long)]
    data: Vec<PathBuf>,
    /// Window length: non-overlapping windows of N+1 tokens (default the model's context).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Tokenizer for --checkpoint (byte, char, gpt2, or a JSON file); default gpt2.
    #[arg(long)]
    tokenizer: Option<String>,
}

#[derive(Args)]
struct PpScheduleCli {
    /// Pipeline stages (ranks).
    #[arg(long)]
    pp: usize,
    #[arg(long)]
    micro_batches: usize,
    /// gpipe, 1f1b or interleaved.
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Model chunks per rank (interleaved).
    #[arg(long, default_value_t = 1)]
    r#virtual: usize,
    /// Backward time over forward time.
    #[arg(long, default_value_t = 2.0)]
    backward_ratio: f64,
    /// Print JSON (per-rank idle/busy, peak in flight, the formula) instead of the timeline.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum CheckpointCmd {
    /// Print a checkpoint's manifest as JSON: step, params_sha256, optimizer_sha256, files,
    /// tensors. PATH is a checkpoint directory, or a run directory (its newest valid one).
    Inspect { path: PathBuf },
    /// Rewrite a checkpoint (or a run's newest valid one) under OUT/step-N as one file per
    /// kind (--shards 1) or N per-rank parts; any layout loads either. For Hugging Face
    /// safetensors use `kiln export`.
    Convert {
        path: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 1)]
        shards: usize,
    },
}

#[derive(Args)]
struct ExportCli {
    #[command(flatten)]
    source: Source,
    /// Output format; `hf` (Hugging Face GPT2LMHeadModel) is the one supported.
    #[arg(long, default_value = "hf")]
    format: String,
    #[arg(long)]
    out: PathBuf,
    /// Fold a LoRA run's adapters into the base weights (required for LoRA runs).
    #[arg(long)]
    merge: bool,
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

fn dispatch(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Train(a) => {
            let args = a.args();
            let stop = Arc::new(AtomicBool::new(false));
            let s2 = stop.clone();
            let _ = ctrlc::set_handler(move || {
                if s2.swap(true, Ordering::SeqCst) {
                    eprintln!("\nsecond interrupt: exiting without saving");
                    std::process::exit(130);
                }
                eprintln!("\ninterrupt: finishing this step, then saving a checkpoint (Ctrl-C again to abort)");
            });
            if a.supervise {
                let argv: Vec<String> = std::env::args().skip_while(|x| x != "train").skip(1).collect();
                if !(a.heartbeat_timeout > 0.0) {
                    return user(format!("--heartbeat-timeout must be positive, got {}", a.heartbeat_timeout));
                }
                let sv = crate::supervise::Supervise { max_restarts: a.max_restarts, heartbeat_timeout: std::time::Duration::from_secs_f64(a.heartbeat_timeout) };
                return crate::supervise::run(&argv, args.preset.as_deref(), &sv, &stop);
            }
            train::train(&args, &stop).map(|_| ())
        }
        Cmd::Memory(m) => {
            if m.train.supervise {
                return user("kiln memory: --supervise applies to `kiln train` only");
            }
            crate::cmd_memory::cmd(&m.train.args(), m.json)
        }
        Cmd::Plot(a) => crate::obs::cmd::plot(&a).map_err(KilnError::User),
        Cmd::Runs(a) => crate::obs::cmd::runs(&a).map_err(KilnError::User),
        Cmd::Doctor => {
            init_threads(0);
            crate::obs::cmd::doctor().map_err(KilnError::User)
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
            let (m, tok, _) = load_source(&g.source, g.tokenizer.as_deref())?;
            let text = train::sample_text(&m, &tok, &g.prompt, g.max_new_tokens, g.temperature, g.top_k, g.seed);
            println!("{text}");
            Ok(())
        }
        Cmd::Eval(e) => {
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
        Cmd::PpSchedule(a) => {
            let kind = parallel::pp::Kind::parse(&a.schedule).map_err(KilnError::User)?;
            let sch = parallel::pp::Schedule::new(kind, a.pp, a.micro_batches, a.r#virtual).map_err(KilnError::User)?;
            if !(a.backward_ratio > 0.0) {
                return user(format!("--backward-ratio must be positive, got {}", a.backward_ratio));
            }
            let tb = a.backward_ratio;
            // The interleaved chunks are 1/v of a stage: their passes take 1/v as long.
            let (tf, tb) = (1.0 / a.r#virtual as f64, tb / a.r#virtual as f64);
            if a.json {
                let v = serde_json::json!({
                    "schedule": a.schedule, "pp": a.pp, "micro_batches": a.micro_batches, "virtual": a.r#virtual,
                    "bubble": sch.bubble(tf, tb), "formula": sch.ideal_bubble(),
                    "peak_in_flight": (0..a.pp).map(|s| sch.peak_in_flight(s)).collect::<Vec<_>>(),
                });
                println!("{v}");
            } else {
                print!("{}", sch.render(tf, tb));
            }
            Ok(())
        }
        Cmd::Checkpoint(CheckpointCmd::Convert { path, out, shards }) => {
            let dir = crate::cmd_checkpoint::convert(&path, &out, shards)?;
            println!("wrote {}", dir.display());
            Ok(())
        }
        Cmd::Checkpoint(CheckpointCmd::Inspect { path }) => {
            println!("{}", serde_json::to_string_pretty(&crate::cmd_checkpoint::inspect(&path)?).unwrap());
            Ok(())
        }
        Cmd::Export(x) => {
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

/// Loads the model (and tokenizer) for `generate` / `eval` from a run or an HF directory.
fn load_source(src: &Source, tokenizer: Option<&str>) -> Result<(model::Gpt, data::Tokenizer, Option<run::SavedRun>)> {
    if let Some(dir) = &src.run {
        let r = run::load_run(dir)?;
        let m = run::load_model(&r)?;
        return Ok((m, r.tokenizer.clone(), Some(r)));
    }
    let dir = src.checkpoint.as_ref().expect("clap requires --run or --checkpoint");
    let mut m = model::hf::import_hf(dir).map_err(KilnError::User)?;
    let tok = data::Tokenizer::from_spec(tokenizer.unwrap_or("gpt2"), None)?;
    if tok.vocab_size() > m.cfg.vocab_size {
        return user(format!("{}: the {} tokenizer has {} tokens but the model only {}; pass --tokenizer", dir.display(), tok.kind(), tok.vocab_size(), m.cfg.vocab_size));
    }
    m.real_vocab = tok.vocab_size();
    Ok((m, tok, None))
}
