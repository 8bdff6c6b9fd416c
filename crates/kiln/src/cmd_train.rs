//! `kiln train`: its flags, Ctrl-C handling, and the supervised mode.

use crate::config::{Flag, TrainArgs};
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
    /// Text, jsonl(.gz/.zst) or parquet files, directories, .bin/.npy token files, or a `kiln
    /// data prepare` directory.
    #[arg(long)]
    pub data: Vec<PathBuf>,
    /// What the documents are: text, chat, prompt_completion, preference or prompt (data.format).
    #[arg(long)]
    pub format: Option<String>,
    /// What the step minimises: lm, or a preference loss over chosen/rejected pairs: dpo, ipo
    /// or simpo (the [preference] keys set beta and the rest), or grpo: reinforcement learning
    /// with verifiable rewards over sampled completions (the [grpo] keys) (train.objective).
    #[arg(long)]
    pub objective: Option<String>,
    /// windows or documents (data.packing): whole documents packed into rows, attention kept
    /// inside each.
    #[arg(long)]
    pub packing: Option<String>,
    /// Positions restart in every packed document (data.reset_positions).
    #[arg(long)]
    pub reset_positions: bool,
    /// byte, char, gpt2, bpe:N (trained on the data), a Hugging Face tokenizer.json or a
    /// directory holding one (data.tokenizer; with --init-from a model's own is the default).
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// Run directory (default runs/<preset>-<time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Override a config key: --set train.lr=3e-4
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Tokens per training sequence (train.seq_len; default the model's positions, at most
    /// 1024 for an --init-from model).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Continue the run in --out (or the newest under runs/) from its newest valid checkpoint.
    #[arg(long)]
    pub resume: bool,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Where the kernels run: cpu (default), vulkan[:N] or cuda[:N] (`kiln doctor` lists the GPUs).
    #[arg(long, value_name = "cpu|vulkan[:N]|cuda[:N]")]
    pub device: Option<crate::device::DeviceArg>,
    /// Start from a base model: a kiln run directory or a Hugging Face directory
    /// (GPT2LMHeadModel / LlamaForCausalLM: config.json + model.safetensors).
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// Fine-tune LoRA adapters of this rank on a frozen --init-from base.
    #[arg(long)]
    pub lora_rank: Option<usize>,
    #[arg(long)]
    pub lora_alpha: Option<f64>,
    /// Comma-separated projections to adapt: q,k,v,o,gate,up,down, PEFT's module names
    /// (q_proj, …, down_proj) or all-linear [default: q,v]
    #[arg(long)]
    pub lora_targets: Option<String>,
    /// QLoRA: store the frozen base's matrices as nf4 or int8 (lora.quantize_base)
    #[arg(long, value_name = "none|nf4|int8")]
    pub quantize_base: Option<String>,
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
    /// Context-parallel ranks (parallel.cp): every sequence split along its positions.
    #[arg(long)]
    pub cp: Option<usize>,
    /// Context-parallel attention (parallel.cp_mode): ring or ulysses.
    #[arg(long, value_name = "MODE")]
    pub cp_mode: Option<String>,
    /// Context-parallel chunks (parallel.cp_balance): zigzag or none.
    #[arg(long, value_name = "BALANCE")]
    pub cp_balance: Option<String>,
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
    /// Elastic data parallelism, MIN:MAX data-parallel replicas (faults.elastic_min,
    /// faults.elastic_max): a rank lost for good shrinks the run, a returning one grows it back.
    #[arg(long, value_name = "MIN:MAX")]
    pub elastic: Option<String>,
    /// Set by an elastic supervisor for its MPI workers: each rank's original number.
    #[arg(long, hide = true, value_delimiter = ',')]
    pub elastic_slots: Vec<usize>,
    /// Set by an elastic supervisor: the ranks lost for good (they may come back).
    #[arg(long, hide = true, value_delimiter = ',')]
    pub elastic_lost: Vec<usize>,
    /// With --supervise and --backend mpi: the MPI launcher and its options, split at spaces
    /// (the supervisor runs `LAUNCHER -n N kiln train …`).
    #[arg(long, default_value = "mpirun")]
    pub launcher: String,
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
    /// The trainer's arguments (shared by `kiln train` and `kiln memory`).
    pub fn args(&self) -> Result<TrainArgs> {
        Ok(TrainArgs {
            preset: self.preset.clone(), config: self.config.clone(), out: self.out.clone(), set: self.set.clone(), flags: self.flags()?,
            resume: self.resume, profile: self.profile, quiet: self.quiet, slots: self.elastic_slots.clone(), lost: self.elastic_lost.clone(),
        })
    }

    /// Every flag that sets a config key, in one table: the flag, its key, its value (if given).
    fn flags(&self) -> Result<Vec<Flag>> {
        use toml::Value as V;
        let int = |x: Option<usize>| x.map(|x| V::Integer(x as i64));
        let long = |x: Option<u64>| x.map(|x| V::Integer(x as i64));
        let text = |x: &Option<String>| x.clone().map(V::String);
        let path = |x: &Option<PathBuf>| x.as_ref().map(|p| V::String(p.display().to_string()));
        let items = |x: &str| x.split(',').map(str::trim).filter(|x| !x.is_empty()).map(str::to_string).collect::<Vec<_>>();
        let layers = match &self.pp_layers {
            Some(l) => Some(V::Array(
                items(l).iter().map(|x| x.parse::<i64>().map(V::Integer).or_else(|_| user(format!("--pp-layers: `{x}` is not a layer count (expected e.g. 3,3,2)")))).collect::<Result<_>>()?,
            )),
            None => None,
        };
        let elastic = match &self.elastic {
            Some(e) => match e.split_once(':').map(|(a, b)| (a.trim().parse::<usize>(), b.trim().parse::<usize>())) {
                Some((Ok(lo), Ok(hi))) if lo >= 1 && lo <= hi => (Some(V::Integer(lo as i64)), Some(V::Integer(hi as i64))),
                _ => return user(format!("--elastic: `{e}` is not MIN:MAX data-parallel replicas with 1 ≤ MIN ≤ MAX (e.g. 2:4)")),
            },
            None => (None, None),
        };
        let table: [(&'static str, &'static str, Option<V>); 37] = [
            ("--data", "data.paths", (!self.data.is_empty()).then(|| V::Array(self.data.iter().map(|p| V::String(p.display().to_string())).collect()))),
            ("--tokenizer", "data.tokenizer", text(&self.tokenizer)),
            ("--format", "data.format", text(&self.format)),
            ("--objective", "train.objective", text(&self.objective)),
            ("--packing", "data.packing", text(&self.packing)),
            ("--reset-positions", "data.reset_positions", self.reset_positions.then_some(V::Boolean(true))),
            ("--max-steps", "train.max_steps", long(self.max_steps)),
            ("--seq-len", "train.seq_len", int(self.seq_len)),
            ("--seed", "train.seed", long(self.seed)),
            ("--precision", "train.precision", text(&self.precision)),
            ("--device", "train.device", self.device.map(|d| V::String(d.to_string()))),
            ("--micro-batches", "train.grad_accum", int(self.micro_batches)),
            ("--init-from", "model.init_from", path(&self.init_from)),
            ("--recompute", "model.recompute", text(&self.recompute)),
            ("--recompute-every", "model.recompute_every", int(self.recompute_every)),
            ("--lora-rank", "lora.rank", int(self.lora_rank)),
            ("--lora-alpha", "lora.alpha", self.lora_alpha.map(V::Float)),
            ("--quantize-base", "lora.quantize_base", text(&self.quantize_base)),
            ("--lora-targets", "lora.targets", self.lora_targets.as_deref().map(|t| V::Array(items(t).into_iter().map(V::String).collect()))),
            ("--dp", "parallel.dp", int(self.dp)),
            ("--zero", "parallel.zero", int(self.zero)),
            ("--tp", "parallel.tp", int(self.tp)),
            ("--ep", "parallel.ep", int(self.ep)),
            ("--sequence-parallel", "parallel.sequence_parallel", self.sequence_parallel.then_some(V::Boolean(true))),
            ("--cp", "parallel.cp", int(self.cp)),
            ("--cp-mode", "parallel.cp_mode", text(&self.cp_mode)),
            ("--cp-balance", "parallel.cp_balance", text(&self.cp_balance)),
            ("--pp", "parallel.pp", int(self.pp)),
            ("--schedule", "parallel.schedule", text(&self.schedule)),
            ("--virtual", "parallel.virtual_stages", int(self.virtual_stages)),
            ("--pp-layers", "parallel.pp_layers", layers),
            ("--pp-trace", "parallel.pp_trace", text(&self.pp_trace)),
            ("--backend", "parallel.backend", text(&self.backend)),
            ("--offload", "memory.offload", text(&self.offload)),
            ("--memory-limit", "memory.limit", text(&self.memory_limit)),
            ("--elastic", "faults.elastic_min", elastic.0),
            ("--elastic", "faults.elastic_max", elastic.1),
        ];
        Ok(table.into_iter().filter_map(|(flag, key, v)| v.map(|value| Flag { flag, key, value })).collect())
    }
}

/// Runs `kiln train` (or, with `--supervise`, a supervisor that restarts it).
pub fn run(a: TrainCli) -> Result<()> {
            // A device that is not there is refused before anything is written.
            if let Some(d) = a.device {
                crate::device::open(d)?;
            }
            // The command resolved once, here: the trainer and the supervisor take it.
            let resolved = crate::train::resolve(&a.args()?)?;
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
                #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN timeout must be refused too
                if !(a.heartbeat_timeout > 0.0) {
                    return user(format!("--heartbeat-timeout must be positive, got {}", a.heartbeat_timeout));
                }
                let sv = crate::supervise::Supervise { max_restarts: a.max_restarts, heartbeat_timeout: std::time::Duration::from_secs_f64(a.heartbeat_timeout), launcher: a.launcher.split_whitespace().map(str::to_string).collect() };
                return crate::supervise::run(&argv, &resolved, &sv, &stop);
            }
            let s = crate::train::train(resolved, &stop)?;
            if s.regrow {
                // An elastic MPI worker stopped at a checkpoint for lost ranks to rejoin: its
                // supervisor relaunches the larger world.
                std::process::exit(crate::supervise::EXIT_REGROW);
            }
            Ok(())
        }
