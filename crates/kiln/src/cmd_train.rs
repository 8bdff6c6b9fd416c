//! `kiln train`: its flags, Ctrl-C handling, and the supervised mode.

use crate::config::TrainArgs;
use crate::error::{user, Result};
use clap::Args;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Args)]
pub struct TrainCli {
    /// tiny (default), shakespeare-char, gpt2-124m
    #[arg(long)]
    pub preset: Option<String>,
    /// A TOML file of config keys (sections [model], [train], [eval], [checkpoint], [data], [sample]).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Text files, directories, .bin/.npy token files, or a `kiln data prepare` directory.
    #[arg(long)]
    pub data: Vec<PathBuf>,
    /// Run directory (default runs/<preset>-<time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Override a config key: --set train.lr=3e-4
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Continue the run in --out (or the newest under runs/) from its newest valid checkpoint.
    #[arg(long)]
    pub resume: bool,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Start from a base model: a kiln run directory or a Hugging Face directory
    /// (GPT2LMHeadModel / LlamaForCausalLM: config.json + model.safetensors).
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// Fine-tune LoRA adapters of this rank on a frozen --init-from base.
    #[arg(long)]
    pub lora_rank: Option<usize>,
    #[arg(long)]
    pub lora_alpha: Option<f64>,
    /// Comma-separated: q,k,v,o,gate,up,down
    #[arg(long)]
    pub lora_targets: Option<String>,
    /// Record a Chrome trace (trace.json in the run directory) of the first N steps.
    #[arg(long, value_name = "STEPS")]
    pub profile: Option<u64>,
    /// Data-parallel ranks (parallel.dp): threads of this process, or with --backend mpi the
    /// mpirun processes (0 = all of them).
    #[arg(long)]
    pub dp: Option<usize>,
    /// ZeRO stage 0-3 (parallel.zero).
    #[arg(long)]
    pub zero: Option<usize>,
    /// Tensor-parallel ranks (parallel.tp).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Expert-parallel ranks (parallel.ep): each MoE layer's experts spread over them.
    #[arg(long)]
    pub ep: Option<usize>,
    /// Sequence parallelism within the tensor-parallel group (parallel.sequence_parallel).
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Storage precision: fp32, bf16, fp16 or fp8 (train.precision).
    #[arg(long)]
    pub precision: Option<String>,
    /// Activation recomputation: none, selective or full (model.recompute).
    #[arg(long)]
    pub recompute: Option<String>,
    /// With --recompute full: every K-th layer only (model.recompute_every).
    #[arg(long, value_name = "K")]
    pub recompute_every: Option<usize>,
    /// Pipeline stages (parallel.pp).
    #[arg(long)]
    pub pp: Option<usize>,
    /// Micro-batches per step, the pipeline's (train.grad_accum).
    #[arg(long)]
    pub micro_batches: Option<usize>,
    /// Pipeline schedule: gpipe, 1f1b or interleaved (parallel.schedule).
    #[arg(long)]
    pub schedule: Option<String>,
    /// Model chunks per pipeline rank, interleaved schedule (parallel.virtual_stages).
    #[arg(long = "virtual")]
    pub virtual_stages: Option<usize>,
    /// Layers per pipeline stage, comma-separated (parallel.pp_layers; default: balanced).
    #[arg(long)]
    pub pp_layers: Option<String>,
    /// Record pipeline tasks per rank: off, wall or device (parallel.pp_trace).
    #[arg(long)]
    pub pp_trace: Option<String>,
    /// none or optimizer: AdamW moments in memory-mapped files (memory.offload).
    #[arg(long)]
    pub offload: Option<String>,
    /// inproc or mpi (parallel.backend).
    #[arg(long)]
    pub backend: Option<String>,
    /// Run training as a child process and restart it from the newest valid checkpoint when it
    /// crashes or stops sending heartbeats.
    #[arg(long)]
    pub supervise: bool,
    /// With --supervise: restarts before giving up.
    #[arg(long, default_value_t = 3)]
    pub max_restarts: u32,
    /// With --supervise: seconds without a heartbeat (one per step) after which the training
    /// process counts as hung and is killed.
    #[arg(long, default_value_t = 300.0)]
    pub heartbeat_timeout: f64,
    /// No progress output.
    #[arg(long)]
    pub quiet: bool,
    /// Refuse to start when the memory plan needs more than SIZE per rank (memory.limit):
    /// bytes, or e.g. 2GiB, 1500MB; 0 = no limit.
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
}

impl TrainCli {
    /// The trainer's arguments (shared by `kiln train` and `kiln memory`). `--memory-limit`
    /// becomes the last `--set memory.limit=…`, so it wins over the config file and `--set`.
    pub fn args(&self) -> TrainArgs {
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

/// Runs `kiln train` (or, with `--supervise`, a supervisor that restarts it).
pub fn run(a: TrainCli) -> Result<()> {
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
            crate::train::train(&args, &stop).map(|_| ())
        }
