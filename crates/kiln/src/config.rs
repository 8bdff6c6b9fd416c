//! Run configuration in two stages: a raw table of dotted keys (preset defaults, then a TOML
//! file, then `--set KEY=VALUE` overrides, each checked against the known keys and their
//! types), then a resolved, validated [`RunConfig`] (`RunConfig::resolve`). Errors name the key
//! and, for files, the path.

use crate::error::{user, KilnError, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// `gpt2` (LayerNorm, learned positions, GELU) or `llama` (RMSNorm, RoPE, SwiGLU, GQA).
    #[serde(default = "default_arch")]
    pub arch: String,
    pub n_layer: usize,
    pub n_head: usize,
    /// Key/value heads for grouped-query attention (llama); 0 = n_head.
    #[serde(default)]
    pub n_kv_head: usize,
    pub n_embd: usize,
    /// MLP width; 0 = 4·n_embd (gpt2) or 8/3·n_embd rounded up to a multiple of 64 (llama).
    #[serde(default)]
    pub ffn_hidden: usize,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_eps")]
    pub norm_eps: f64,
    pub block_size: usize,
    /// 0 = from the tokenizer (rounded up to a multiple of 64 above 256 tokens: 50257 → 50304).
    pub vocab_size: usize,
    pub bias: bool,
    pub dropout: f64,
    pub tied_embeddings: bool,
    /// A Hugging Face GPT-2 directory to start from ("" = fresh initialisation). Its
    /// `config.json` fixes the shape keys above; its weights replace the initialisation.
    #[serde(default)]
    pub init_from: String,
    /// Mixture of experts (llama arch): routed experts per layer, 0 = dense MLP; `ffn_hidden`
    /// is then each expert's width.
    #[serde(default)]
    pub n_expert: usize,
    #[serde(default = "default_top_k")]
    pub top_k: usize,
    /// Always-on shared experts (DeepSeekMoE).
    #[serde(default)]
    pub n_shared_expert: usize,
    /// Expert capacity factor; 0 = dropless.
    #[serde(default)]
    pub capacity_factor: f64,
    /// Weight of the Switch load-balancing loss.
    #[serde(default = "default_aux")]
    pub moe_aux_weight: f64,
    /// Weight of the ST-MoE router z-loss.
    #[serde(default = "default_z")]
    pub moe_z_weight: f64,
    /// Activation recomputation: `none`, `selective` (Korthikanti et al.: re-run the attention
    /// core) or `full` (keep block inputs only). Results are bit-identical to `none`.
    #[serde(default = "default_recompute")]
    pub recompute: String,
    /// With `full`: recompute every k-th layer only (1 = all), keeping the others' activations.
    #[serde(default = "one")]
    pub recompute_every: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    /// Sequences per optimizer step (the global batch), split into `grad_accum` micro-batches.
    pub batch_size: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    /// Length of the cosine decay from `lr` to `min_lr`; 0 = `max_steps`. Changing
    /// `max_steps` (e.g. `--max-steps`) does not change the schedule when this is set.
    pub lr_decay_steps: u64,
    pub max_steps: u64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global gradient-norm clip; 0 disables.
    pub grad_clip: f64,
    pub seed: u64,
    /// Worker threads; 0 = all cores.
    pub threads: usize,
    /// Progress/metrics line every this many steps.
    pub log_interval: u64,
    /// Storage precision: `fp32`, or mixed precision `bf16` / `fp16` (parameters, activations
    /// and activation gradients rounded to it, fp32 master weights, moments and weight-gradient
    /// accumulation; simulated on CPU — the buffers stay f32).
    #[serde(default = "fp32")]
    pub precision: String,
    /// fp16: the initial dynamic loss scale, and the overflow-free updates after which it doubles.
    #[serde(default = "loss_scale_init")]
    pub loss_scale: f64,
    #[serde(default = "loss_scale_window")]
    pub loss_scale_window: u64,
    /// fp8: steps of amax history behind each tensor's delayed scale.
    #[serde(default = "fp8_history")]
    pub fp8_amax_history: usize,
}

fn fp8_history() -> usize {
    16
}

fn fp32() -> String {
    "fp32".into()
}

fn loss_scale_init() -> f64 {
    65536.0
}

fn loss_scale_window() -> u64 {
    1000
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalSection {
    /// Evaluate on the held-out split every this many steps (0 = only at the end).
    pub interval: u64,
    /// Batches of non-overlapping windows per evaluation (0 = the whole split).
    pub iters: usize,
    /// Sequences per evaluation batch (0 = the training micro-batch).
    pub batch_size: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Save every this many steps (0 = only at the end).
    pub interval: u64,
    /// Valid checkpoints kept (older ones are removed after a newer one is safely written).
    pub keep: usize,
    /// Also keep every checkpoint whose step is a multiple of this (0 = none).
    #[serde(default)]
    pub keep_every: u64,
    /// Write checkpoints on a background thread while training continues.
    #[serde(default = "yes")]
    pub background: bool,
    /// Mean time between failures, seconds: when positive the interval is chosen automatically,
    /// `sqrt(2 · cost · MTBF)` (Young 1974, Daly 2006) from each checkpoint's measured cost, the
    /// first at `interval` (or step 10). 0 = the fixed `interval`.
    #[serde(default)]
    pub mtbf_s: f64,
    /// In-memory checkpoints (Gemini): every this many steps (0 = off) each rank snapshots
    /// its state into its memory and a copy into the next rank's, and a failed rank is
    /// restored from there without reading disk. Disk checkpoints are kept in memory too.
    /// Needs at least two in-process ranks.
    #[serde(default)]
    pub memory_interval: u64,
}

fn yes() -> bool {
    true
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// `byte`, `char`, `gpt2`, or a tokenizer JSON file.
    pub tokenizer: String,
    /// Files or directories; empty = the Rust books of the local Rust install.
    pub paths: Vec<String>,
    pub val_fraction: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SampleSection {
    /// Tokens generated at the end of training (0 = none).
    pub tokens: usize,
    pub prompt: String,
    pub temperature: f64,
    pub top_k: usize,
}

// Defaults for keys added after the first release, so run directories written before them
// still load (a saved config.toml is read back on --resume, eval, generate and export).
fn default_arch() -> String {
    "gpt2".into()
}
fn default_theta() -> f64 {
    10000.0
}
fn default_eps() -> f64 {
    1e-5
}
fn default_recompute() -> String {
    "none".into()
}
fn default_top_k() -> usize {
    2
}
fn default_aux() -> f64 {
    0.01
}
fn default_z() -> f64 {
    0.001
}

/// LoRA fine-tuning (Hu et al. 2021): off while `rank` is 0.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraSection {
    pub rank: usize,
    pub alpha: f64,
    /// Any of q, k, v, o, gate, up, down.
    pub targets: Vec<String>,
}

/// Data parallelism and ZeRO (`parallel` crate). Changing these changes speed and memory,
/// not the result: `train.batch_size` stays the global batch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelSection {
    /// Data-parallel ranks. With `backend = "inproc"`, one thread per rank in this process;
    /// with `"mpi"`, must equal the number of MPI processes (0 = take it from MPI).
    pub dp: usize,
    /// ZeRO stage: 0 (plain data parallel), 1 (optimizer state sharded), 2 (+ gradients),
    /// 3 (+ parameters).
    pub zero: usize,
    /// Tensor-parallel ranks (Megatron column/row split of attention heads and MLP columns);
    /// the world is `dp × tp` ranks.
    #[serde(default = "one")]
    pub tp: usize,
    /// Expert-parallel ranks: each MoE layer's routed experts spread over them, the batch split
    /// over `dp × ep` (see `parallel::ep`); the world is `pp × dp × ep × tp` ranks.
    #[serde(default = "one")]
    pub ep: usize,
    /// `inproc` or `mpi` (a build with `--features mpi`, run under `mpirun`).
    pub backend: String,
    /// Gradient all-reduce bucket size in MiB (stages 0 and 1).
    pub bucket_mb: f64,
    /// With `tp > 1`: sequence parallelism (Korthikanti et al.): norms, dropout and the
    /// residual stream split along the sequence over the tensor-parallel ranks.
    #[serde(default)]
    pub sequence_parallel: bool,
    /// Pipeline stages (consecutive layers each; the world is `pp × dp × tp` ranks). The
    /// step's micro-batches are `train.grad_accum` (`--micro-batches`).
    #[serde(default = "one")]
    pub pp: usize,
    /// Pipeline schedule: `gpipe`, `1f1b` or `interleaved`.
    #[serde(default = "one_f_one_b")]
    pub schedule: String,
    /// Model chunks per pipeline rank (`interleaved` only).
    #[serde(default = "one")]
    pub virtual_stages: usize,
    /// Layers per pipeline stage (`pp × virtual_stages` counts, adding up to `model.n_layer`);
    /// empty: balanced by cost (the last stage also pays for the head).
    #[serde(default)]
    pub pp_layers: Vec<usize>,
    /// Record each rank's pipeline tasks per step in `RUN/pipeline/rank-R.jsonl`: `off`,
    /// `wall` (as they ran), or `device` (also compute one task at a time across the process,
    /// so each task's time is uncontended; for measuring schedules on a machine with fewer
    /// cores than ranks; needs dp = tp = 1).
    #[serde(default = "off")]
    pub pp_trace: String,
}

fn one_f_one_b() -> String {
    "1f1b".into()
}

fn off() -> String {
    "off".into()
}

fn one() -> usize {
    1
}

/// Memory tiers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemorySection {
    /// `none`, or `optimizer`: AdamW's moments in memory-mapped files under the run directory
    /// (`offload/`), streamed through the update in chunks (ZeRO-Infinity's NVMe tier).
    pub offload: String,
    /// The most one rank may hold, as planned before step 0 (`kiln memory`): a number of bytes
    /// or a size such as `2GiB` or `1500MB`; `0` = no limit. A run whose plan exceeds it is
    /// refused before anything is written.
    #[serde(default = "no_limit")]
    pub limit: String,
}

fn no_limit() -> String {
    "0".into()
}

/// String keys that also take a plain integer (a number of bytes).
const SIZE_KEYS: &[&str] = &["memory.limit"];

impl Default for MemorySection {
    fn default() -> Self {
        MemorySection { offload: "none".into(), limit: no_limit() }
    }
}

/// Numerical faults: what a step with a non-finite or spiking loss does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSection {
    /// Skip the update of a step whose loss or gradient norm is not finite (else stop).
    pub skip_nonfinite: bool,
    /// Skip the update of a step whose loss is more than this many standard deviations above
    /// the mean of the last `spike_window` applied steps (0 = off).
    pub spike_zscore: f64,
    pub spike_window: usize,
    /// After this many consecutive skipped updates, roll back to the newest valid checkpoint
    /// and skip those steps' batches on the way forward (0 = stop instead).
    pub max_consecutive_skips: usize,
    /// Debug: poison the gradient with NaN at these steps (1-based).
    pub inject_nan_steps: Vec<u64>,
    /// Debug: these ranks fail (lose their state and memory) at the start of step
    /// `fail_step` (1-based; 0 = never), once per run.
    #[serde(default)]
    pub fail_ranks: Vec<usize>,
    #[serde(default)]
    pub fail_step: u64,
    /// Debug: SIGKILL this process in the middle of writing the checkpoint of this step
    /// (0 = never), once per run.
    #[serde(default)]
    pub kill_in_write_step: u64,
    /// In-process restarts after a rank fails (from in-memory snapshots, else from disk)
    /// before the run gives up.
    #[serde(default = "three")]
    pub max_rank_restarts: u32,
}

fn three() -> u32 {
    3
}

impl Default for FaultSection {
    fn default() -> Self {
        FaultSection { skip_nonfinite: true, spike_zscore: 0.0, spike_window: 50, max_consecutive_skips: 3, inject_nan_steps: vec![], fail_ranks: vec![], fail_step: 0, kill_in_write_step: 0, max_rank_restarts: 3 }
    }
}

impl Default for ParallelSection {
    fn default() -> Self {
        ParallelSection { dp: 1, zero: 0, tp: 1, ep: 1, backend: "inproc".into(), bucket_mb: 25.0, sequence_parallel: false, pp: 1, schedule: one_f_one_b(), virtual_stages: 1, pp_layers: Vec::new(), pp_trace: off() }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub preset: String,
    pub model: ModelSection,
    pub train: TrainSection,
    pub eval: EvalSection,
    pub checkpoint: CheckpointSection,
    pub data: DataSection,
    pub sample: SampleSection,
    #[serde(default)]
    pub lora: LoraSection,
    #[serde(default)]
    pub parallel: ParallelSection,
    #[serde(default)]
    pub faults: FaultSection,
    #[serde(default)]
    pub memory: MemorySection,
}

/// A flat map of dotted keys to TOML values.
pub type Raw = BTreeMap<String, toml::Value>;

pub fn flatten(prefix: &str, table: &toml::Table, out: &mut Raw) {
    for (k, v) in table {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match v {
            toml::Value::Table(t) => flatten(&key, t, out),
            _ => {
                out.insert(key, v.clone());
            }
        }
    }
}

fn unflatten(raw: &Raw) -> toml::Table {
    let mut root = toml::Table::new();
    for (key, v) in raw {
        let mut t = &mut root;
        let parts: Vec<&str> = key.split('.').collect();
        for p in &parts[..parts.len() - 1] {
            t = t.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new())).as_table_mut().unwrap();
        }
        t.insert(parts[parts.len() - 1].to_string(), v.clone());
    }
    root
}

fn type_name(v: &toml::Value) -> &'static str {
    match v {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a number",
        toml::Value::Boolean(_) => "true or false",
        toml::Value::Array(_) => "a list",
        toml::Value::Table(_) => "a table",
        toml::Value::Datetime(_) => "a date",
    }
}

/// Sets `key` to `value` in `raw`, which must already hold the key (from the defaults);
/// integers are accepted where numbers are expected. `origin` says where the value came from.
pub fn set_key(raw: &mut Raw, key: &str, value: toml::Value, origin: &str) -> Result<()> {
    let Some(old) = raw.get(key) else {
        let mut near: Vec<&String> = raw.keys().filter(|k| k.split('.').next_back() == key.split('.').next_back()).collect();
        near.truncate(3);
        let hint = if near.is_empty() { String::new() } else { format!(" (did you mean {}?)", near.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")) };
        return user(format!("{origin}: unknown config key `{key}`{hint}"));
    };
    let value = match (old, value) {
        (toml::Value::Float(_), toml::Value::Integer(i)) => toml::Value::Float(i as f64),
        (toml::Value::String(_), toml::Value::Integer(i)) if SIZE_KEYS.contains(&key) && i >= 0 => toml::Value::String(i.to_string()),
        (o, v) if std::mem::discriminant(o) == std::mem::discriminant(&v) => v,
        (o, v) => return user(format!("{origin}: config key `{key}` must be {}, got {} ({v})", type_name(o), type_name(&v))),
    };
    if let toml::Value::Integer(i) = value {
        if i < 0 {
            return user(format!("{origin}: config key `{key}` must not be negative, got {i}"));
        }
    }
    raw.insert(key.to_string(), value);
    Ok(())
}

/// Applies a TOML file's keys over `raw`.
pub fn apply_file(raw: &mut Raw, path: &Path) -> Result<()> {
    let text = std::fs::read_to_string(path).or_else(|e| user(format!("{}: cannot read config: {e}", path.display())))?;
    let table: toml::Table = toml::from_str(&text).or_else(|e| user(format!("{}: invalid TOML: {}", path.display(), one_line(&e.to_string()))))?;
    let mut flat = Raw::new();
    flatten("", &table, &mut flat);
    for (k, v) in flat {
        set_key(raw, &k, v, &path.display().to_string())?;
    }
    Ok(())
}

/// Applies one `--set KEY=VALUE`. VALUE is read as TOML (`3`, `1e-3`, `true`, `"x"`), and as
/// a plain string when it is not valid TOML.
pub fn apply_set(raw: &mut Raw, kv: &str) -> Result<()> {
    let Some((k, v)) = kv.split_once('=') else {
        return user(format!("--set `{kv}`: expected KEY=VALUE"));
    };
    let (k, v) = (k.trim(), v.trim());
    let value = match toml::from_str::<toml::Table>(&format!("v = {v}")) {
        Ok(mut t) => t.remove("v").unwrap(),
        Err(_) => toml::Value::String(v.to_string()),
    };
    set_key(raw, k, value, "--set")
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl RunConfig {
    /// Builds and validates the config from the raw table.
    pub fn resolve(raw: &Raw) -> Result<RunConfig> {
        let cfg: RunConfig = toml::Value::Table(unflatten(raw))
            .try_into()
            .or_else(|e: toml::de::Error| user(format!("config: {}", one_line(&e.to_string()))))?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn to_raw(&self) -> Raw {
        let table = toml::Table::try_from(self).expect("config serializes");
        let mut raw = Raw::new();
        flatten("", &table, &mut raw);
        raw
    }

    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("config serializes")
    }

    /// Reads a resolved `config.toml` (as written into a run directory).
    pub fn load(path: &Path) -> Result<RunConfig> {
        let text = std::fs::read_to_string(path).or_else(|e| user(format!("{}: cannot read: {e}", path.display())))?;
        let cfg: RunConfig = toml::from_str(&text).or_else(|e| user(format!("{}: {}", path.display(), one_line(&e.to_string()))))?;
        cfg.validate().map_err(|e| crate::error::KilnError::User(format!("{}: {e}", path.display())))?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        self.validate_model()?;
        self.validate_train()?;
        self.validate_data_and_checkpoints()?;
        self.validate_precision_and_memory()?;
        self.validate_parallel()?;
        self.validate_pipeline()
    }

    /// The model section (and the decoder config it resolves to).
    fn validate_model(&self) -> Result<()> {
        let m = &self.model;
        if m.arch != "gpt2" && m.arch != "llama" {
            return user(format!("model.arch must be `gpt2` or `llama`, got `{}`", m.arch));
        }
        if !["none", "selective", "full"].contains(&m.recompute.as_str()) {
            return user(format!("model.recompute must be `none`, `selective` or `full`, got `{}`", m.recompute));
        }
        if m.recompute_every == 0 || (m.recompute_every > 1 && m.recompute != "full") {
            return user(format!("model.recompute_every must be positive and applies to model.recompute = full (got {} with `{}`)", m.recompute_every, m.recompute));
        }
        if m.arch == "llama" && m.bias {
            return user("model.bias must be false for model.arch = llama (LLaMA has no biases)");
        }
        self.gpt_config(m.vocab_size.max(1)).validate().or_else(user)?;
        Ok(())
    }

    /// The training hyperparameters.
    fn validate_train(&self) -> Result<()> {
        let t = &self.train;
        let positive = [("train.batch_size", t.batch_size as f64), ("train.grad_accum", t.grad_accum as f64), ("train.max_steps", t.max_steps as f64), ("train.lr", t.lr)];
        for (k, v) in positive {
            if !(v > 0.0) {
                return user(format!("{k} must be positive, got {v}"));
            }
        }
        if t.batch_size % t.grad_accum != 0 {
            return user(format!("train.batch_size ({}) must be divisible by train.grad_accum ({})", t.batch_size, t.grad_accum));
        }
        let nonneg = [("train.min_lr", t.min_lr), ("train.weight_decay", t.weight_decay), ("train.grad_clip", t.grad_clip), ("train.eps", t.eps), ("sample.temperature", self.sample.temperature)];
        for (k, v) in nonneg {
            if !(v >= 0.0) || !v.is_finite() {
                return user(format!("{k} must be a non-negative number, got {v}"));
            }
        }
        for (k, v) in [("train.beta1", t.beta1), ("train.beta2", t.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return user(format!("{k} must be in [0, 1), got {v}"));
            }
        }
        if t.min_lr > t.lr {
            return user(format!("train.min_lr ({}) must not exceed train.lr ({})", t.min_lr, t.lr));
        }
        Ok(())
    }

    /// The data split, LoRA's base, checkpoint retention and intervals.
    fn validate_data_and_checkpoints(&self) -> Result<()> {
        if !(self.data.val_fraction > 0.0 && self.data.val_fraction < 1.0) {
            return user(format!("data.val_fraction must be in (0, 1), got {}", self.data.val_fraction));
        }
        if self.lora.rank > 0 && self.model.init_from.is_empty() {
            return user("lora.rank needs a base model to adapt: pass --init-from (a kiln run directory or a Hugging Face directory)");
        }
        if self.checkpoint.keep == 0 {
            return user("checkpoint.keep must be positive, got 0");
        }
        if !(self.checkpoint.mtbf_s >= 0.0 && self.checkpoint.mtbf_s.is_finite()) {
            return user(format!("checkpoint.mtbf_s must be a non-negative number of seconds, got {}", self.checkpoint.mtbf_s));
        }
        Ok(())
    }

    /// Mixed precision, fp16 loss scaling, offload and the memory limit.
    fn validate_precision_and_memory(&self) -> Result<()> {
        let t = &self.train;
        if !["fp32", "bf16", "fp16", "fp8"].contains(&t.precision.as_str()) {
            return user(format!("train.precision must be fp32, bf16, fp16 or fp8, got `{}`", t.precision));
        }
        if t.fp8_amax_history == 0 {
            return user("train.fp8_amax_history must be positive, got 0");
        }
        if !(t.loss_scale >= 1.0 && t.loss_scale.is_finite()) || t.loss_scale_window == 0 {
            return user(format!("train.loss_scale must be a finite number ≥ 1 and train.loss_scale_window positive, got {} and {}", t.loss_scale, t.loss_scale_window));
        }
        if t.precision != "fp32" && self.lora.rank > 0 {
            return user(format!("train.precision = {} with LoRA is not supported: the adapters train in fp32", t.precision));
        }
        if self.memory.offload != "none" && self.memory.offload != "optimizer" {
            return user(format!("memory.offload must be `none` or `optimizer`, got `{}`", self.memory.offload));
        }
        crate::util::parse_size(&self.memory.limit).map_err(|e| crate::error::KilnError::User(format!("memory.limit: {e}")))?;
        Ok(())
    }

    /// The parallel layout: backend, degrees, ZeRO, tensor, expert and sequence parallelism, in-memory checkpoints and injected rank failures.
    fn validate_parallel(&self) -> Result<()> {
        let p = &self.parallel;
        if p.backend != "inproc" && p.backend != "mpi" {
            return user(format!("parallel.backend must be `inproc` or `mpi`, got `{}`", p.backend));
        }
        let world = p.dp * p.tp * p.pp * p.ep;
        if self.checkpoint.memory_interval > 0 && (p.backend == "mpi" || world < 2) {
            return user(format!(
                "checkpoint.memory_interval = {} needs at least two in-process ranks (a peer to keep each rank's copy), got parallel.backend = {} with {world} rank(s): under MPI a failed rank takes the whole job, and the peers' memory, with it",
                self.checkpoint.memory_interval, p.backend
            ));
        }
        if let Some(r) = self.faults.fail_ranks.iter().find(|&&r| p.backend != "mpi" && r >= world) {
            return user(format!("faults.fail_ranks names rank {r}, but the run has {world} rank(s)"));
        }
        if p.dp == 0 && p.backend != "mpi" {
            return user("parallel.dp must be positive, got 0 (0 means `all MPI processes` and needs parallel.backend = mpi)");
        }
        if p.zero > 3 {
            return user(format!("parallel.zero must be 0, 1, 2 or 3, got {}", p.zero));
        }
        if p.tp == 0 {
            return user("parallel.tp must be positive, got 0");
        }
        if p.tp > 1 && self.lora.rank > 0 {
            return user(format!("parallel.tp = {} with LoRA is not supported: the adapters are tiny; use data parallelism (parallel.dp)", p.tp));
        }
        if p.tp > 1 {
            let g = self.gpt_config(256);
            parallel::tp::local_config(&g, p.tp, 0, false).map_err(crate::error::KilnError::User)?;
        }
        if p.ep == 0 {
            return user("parallel.ep must be positive, got 0");
        }
        if p.ep > 1 {
            parallel::ep::local_config(&self.gpt_config(256), p.ep, 0).map_err(crate::error::KilnError::User)?;
            if p.zero > 0 {
                return user(format!("parallel.ep = {} with parallel.zero = {}: ZeRO stages 1-3 are not supported with expert parallelism (their per-unit shards would cut across the expert blocks); use parallel.zero = 0", p.ep, p.zero));
            }
            if self.lora.rank > 0 {
                return user(format!("parallel.ep = {} with LoRA is not supported: the adapters are tiny; use data parallelism (parallel.dp)", p.ep));
            }
        }
        if p.zero > 0 && self.lora.rank > 0 {
            return user(format!("parallel.zero = {} with LoRA: the adapters are tiny and the base is frozen; use parallel.zero = 0", p.zero));
        }
        if !(p.bucket_mb > 0.0) {
            return user(format!("parallel.bucket_mb must be positive, got {}", p.bucket_mb));
        }
        if p.dp > 0 {
            self.check_dp(p.dp)?;
        }
        if p.sequence_parallel && p.tp < 2 {
            return user(format!("parallel.sequence_parallel needs tensor parallelism (parallel.tp > 1, got {})", p.tp));
        }
        if p.sequence_parallel && self.model.block_size % p.tp != 0 {
            return user(format!("parallel.sequence_parallel: parallel.tp = {} does not divide the sequence length model.block_size = {}", p.tp, self.model.block_size));
        }
        Ok(())
    }

    /// The pipeline: stages, virtual stages, the schedule, the layer split, the trace.
    fn validate_pipeline(&self) -> Result<()> {
        let (p, t) = (&self.parallel, &self.train);
        if p.pp == 0 {
            return user("parallel.pp must be positive, got 0");
        }
        if p.virtual_stages == 0 {
            return user("parallel.virtual_stages must be positive, got 0");
        }
        let kind = parallel::pp::Kind::parse(&p.schedule).map_err(|e| crate::error::KilnError::User(format!("parallel.schedule: {e}")))?;
        parallel::pp::Schedule::new(kind, p.pp, t.grad_accum, p.virtual_stages).map_err(|e| crate::error::KilnError::User(format!("parallel.schedule = {}: {e} (micro-batches are train.grad_accum, --micro-batches)", p.schedule)))?;
        self.stage_layers(256)?;
        if p.pp > 1 && self.lora.rank > 0 {
            return user(format!("parallel.pp = {} with LoRA is not supported: the adapters are tiny; use data parallelism (parallel.dp)", p.pp));
        }
        if !["off", "wall", "device"].contains(&p.pp_trace.as_str()) {
            return user(format!("parallel.pp_trace must be `off`, `wall` or `device`, got `{}`", p.pp_trace));
        }
        if p.pp_trace == "device" && (p.dp != 1 || p.tp != 1 || p.ep != 1) {
            return user(format!("parallel.pp_trace = device serialises compute across ranks, which needs parallel.dp = 1, parallel.tp = 1 and parallel.ep = 1 (got dp {} × tp {} × ep {}); use `wall`", p.dp, p.tp, p.ep));
        }
        Ok(())
    }

    /// The model config for a tokenizer vocabulary of `vocab` tokens.
    pub fn gpt_config(&self, vocab: usize) -> model::GptConfig {
        let m = &self.model;
        let arch = if m.arch == "llama" { model::config::Arch::Llama } else { model::config::Arch::Gpt2 };
        model::GptConfig {
            arch,
            n_layer: m.n_layer,
            n_head: m.n_head,
            n_kv_head: if m.n_kv_head == 0 { m.n_head } else { m.n_kv_head },
            n_embd: m.n_embd,
            ffn_hidden: match (m.ffn_hidden, arch) {
                (0, model::config::Arch::Gpt2) => 4 * m.n_embd,
                (0, model::config::Arch::Llama) => model::GptConfig::llama_ffn(m.n_embd),
                (f, _) => f,
            },
            block_size: m.block_size,
            vocab_size: if m.vocab_size == 0 { padded_vocab(vocab) } else { m.vocab_size },
            bias: m.bias,
            dropout: m.dropout as f32,
            tied_embeddings: m.tied_embeddings,
            rope_theta: m.rope_theta as f32,
            norm_eps: m.norm_eps as f32,
            n_expert: m.n_expert,
            top_k: m.top_k,
            n_shared_expert: m.n_shared_expert,
            capacity_factor: m.capacity_factor as f32,
            moe_aux_weight: m.moe_aux_weight as f32,
            moe_z_weight: m.moe_z_weight as f32,
            place: model::Placement::default(),
        }
    }

    pub fn micro_batch(&self) -> usize {
        self.train.batch_size / self.train.grad_accum
    }

    pub fn lr_decay_steps(&self) -> u64 {
        if self.train.lr_decay_steps == 0 { self.train.max_steps } else { self.train.lr_decay_steps }
    }

    /// Learning rate at 0-based step `it`: linear warmup, then cosine decay to `min_lr` over
    /// `lr_decay_steps`, then `min_lr` (nanoGPT's `get_lr`).
    pub fn lr_at(&self, it: u64) -> f64 {
        let t = &self.train;
        if it < t.warmup_steps {
            return t.lr * (it + 1) as f64 / (t.warmup_steps + 1) as f64;
        }
        let decay = self.lr_decay_steps();
        if it > decay {
            return t.min_lr;
        }
        let span = (decay - t.warmup_steps).max(1) as f64;
        let ratio = (it - t.warmup_steps) as f64 / span;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        t.min_lr + coeff * (t.lr - t.min_lr)
    }
}

/// Model vocabulary for a tokenizer of `vocab` tokens: exact up to 256, else rounded up to a
/// multiple of 64 (Karpathy's 50257 → 50304, which speeds the LM-head matmul).
pub fn padded_vocab(vocab: usize) -> usize {
    if vocab <= 256 { vocab } else { vocab.div_ceil(64) * 64 }
}

/// Keys that fix the shape of the model or the meaning of its tokens: a run resumed with a
/// different value for any of them cannot continue from its checkpoint.
pub const STRUCTURAL_KEYS: &[&str] = &[
    "model.arch", "model.n_layer", "model.n_head", "model.n_kv_head", "model.n_embd", "model.ffn_hidden", "model.block_size",
    "model.vocab_size", "model.bias", "model.tied_embeddings", "model.rope_theta", "model.norm_eps", "model.init_from",
    "model.n_expert", "model.top_k", "model.n_shared_expert",
    "lora.rank", "lora.targets", "data.tokenizer", "data.paths", "data.val_fraction",
];

impl RunConfig {
    /// Checks that `dp` data-parallel ranks (times `parallel.ep`: expert-parallel ranks split
    /// the batch too) can split the global batch: each micro-batch's sequences divide evenly
    /// among them.
    pub fn check_dp(&self, dp: usize) -> Result<()> {
        let mb = self.micro_batch();
        let ep = self.parallel.ep;
        if ep > 1 && mb % (dp * ep) != 0 {
            return user(format!(
                "parallel.dp = {dp} × parallel.ep = {ep} = {} ranks split the batch, but they do not divide the micro-batch: train.batch_size {} / train.grad_accum {} = {mb} sequences per micro-batch",
                dp * ep, self.train.batch_size, self.train.grad_accum
            ));
        }
        if mb % dp != 0 {
            return user(format!(
                "parallel.dp = {dp} does not divide the micro-batch: train.batch_size {} / train.grad_accum {} = {mb} sequences per micro-batch must split evenly over {dp} ranks",
                self.train.batch_size, self.train.grad_accum
            ));
        }
        Ok(())
    }

    /// The pipeline's virtual stages as layer ranges (`parallel.pp × parallel.virtual_stages`
    /// of them): as `parallel.pp_layers` lists, or balanced by cost (a block's FLOPs per
    /// token, and the head's on the last stage).
    /// `vocab` is the tokenizer's vocabulary size (the head's cost).
    pub fn stage_layers(&self, vocab: usize) -> Result<Vec<std::ops::Range<usize>>> {
        let p = &self.parallel;
        let g = self.gpt_config(vocab);
        let k = p.pp * p.virtual_stages;
        let c = g.n_embd as f64;
        // Per token: a block's matmuls (2 FLOPs per weight, forward) and attention; the head's V·C.
        let layer = 2.0 * (c * g.qkv_width() as f64 + g.attn_width() as f64 * c + g.fc_width() as f64 * c + g.ffn_hidden as f64 * c) + 4.0 * c * g.block_size as f64;
        let head = 2.0 * c * g.vocab_size as f64;
        parallel::pp::split_layers(g.n_layer, k, &p.pp_layers, layer, head).map_err(crate::error::KilnError::User)
    }

    /// `memory.limit` in bytes (0 = none); checked by `validate`.
    pub fn memory_limit(&self) -> u64 {
        crate::util::parse_size(&self.memory.limit).unwrap_or(0)
    }

    /// The storage precision of `train.precision`.
    pub fn precision(&self) -> model::gpt::Precision {
        match self.train.precision.as_str() {
            "bf16" => model::gpt::Precision::Bf16,
            "fp16" => model::gpt::Precision::Fp16,
            "fp8" => model::gpt::Precision::Fp8,
            _ => model::gpt::Precision::Fp32,
        }
    }

    /// The activation recomputation policy of `model.recompute`.
    pub fn recompute(&self) -> model::gpt::Recompute {
        match self.model.recompute.as_str() {
            "full" => model::gpt::Recompute::Full,
            "selective" => model::gpt::Recompute::Selective,
            _ => model::gpt::Recompute::None,
        }
    }
}

/// The user's overrides of `kiln train` (and `kiln memory`): the dedicated flags, layered over
/// a preset or a saved run's config by [`layered`].
#[derive(Clone, Debug, Default)]
pub struct TrainArgs {
    pub preset: Option<String>,
    pub config: Option<PathBuf>,
    pub data: Vec<PathBuf>,
    pub out: Option<PathBuf>,
    pub set: Vec<String>,
    pub max_steps: Option<u64>,
    pub resume: bool,
    pub seed: Option<u64>,
    pub init_from: Option<PathBuf>,
    pub lora_rank: Option<usize>,
    pub lora_alpha: Option<f64>,
    pub lora_targets: Option<String>,
    /// Record a trace of this many steps into `trace.json`.
    pub profile: Option<u64>,
    pub dp: Option<usize>,
    pub zero: Option<usize>,
    pub tp: Option<usize>,
    /// Expert-parallel ranks (`parallel.ep`).
    pub ep: Option<usize>,
    /// Pipeline flags: `parallel.pp`, `train.grad_accum` (the micro-batches),
    /// `parallel.schedule`, `parallel.virtual_stages`, `parallel.pp_layers` (comma-separated),
    /// `parallel.pp_trace`.
    pub pp: Option<usize>,
    pub sequence_parallel: bool,
    pub micro_batches: Option<usize>,
    pub schedule: Option<String>,
    pub virtual_stages: Option<usize>,
    pub pp_layers: Option<String>,
    pub pp_trace: Option<String>,
    pub offload: Option<String>,
    pub backend: Option<String>,
    pub quiet: bool,
}

/// Builds the raw config from a base and the user's overrides, in order: file, `--set`,
/// then the dedicated flags (`--data`, `--max-steps`, `--seed`).
pub fn layered(base: &RunConfig, args: &TrainArgs) -> Result<RunConfig> {
    let mut raw: Raw = base.to_raw();
    if let Some(p) = &args.config {
        apply_file(&mut raw, p)?;
    }
    for kv in &args.set {
        apply_set(&mut raw, kv)?;
    }
    if !args.data.is_empty() {
        let paths = args.data.iter().map(|p| toml::Value::String(p.display().to_string())).collect();
        raw.insert("data.paths".into(), toml::Value::Array(paths));
    }
    if let Some(n) = args.max_steps {
        raw.insert("train.max_steps".into(), toml::Value::Integer(n as i64));
    }
    if let Some(s) = args.seed {
        raw.insert("train.seed".into(), toml::Value::Integer(s as i64));
    }
    if let Some(p) = &args.init_from {
        raw.insert("model.init_from".into(), toml::Value::String(p.display().to_string()));
    }
    if let Some(d) = args.dp {
        raw.insert("parallel.dp".into(), toml::Value::Integer(d as i64));
    }
    if let Some(z) = args.zero {
        raw.insert("parallel.zero".into(), toml::Value::Integer(z as i64));
    }
    if let Some(o) = &args.offload {
        raw.insert("memory.offload".into(), toml::Value::String(o.clone()));
    }
    if let Some(t) = args.tp {
        raw.insert("parallel.tp".into(), toml::Value::Integer(t as i64));
    }
    if args.sequence_parallel {
        raw.insert("parallel.sequence_parallel".into(), toml::Value::Boolean(true));
    }
    let int = |x: usize| toml::Value::Integer(x as i64);
    for (key, v) in [("parallel.pp", args.pp), ("parallel.ep", args.ep), ("train.grad_accum", args.micro_batches), ("parallel.virtual_stages", args.virtual_stages)] {
        if let Some(v) = v {
            raw.insert(key.into(), int(v));
        }
    }
    for (key, v) in [("parallel.schedule", &args.schedule), ("parallel.pp_trace", &args.pp_trace)] {
        if let Some(v) = v {
            raw.insert(key.into(), toml::Value::String(v.clone()));
        }
    }
    if let Some(l) = &args.pp_layers {
        let mut list = Vec::new();
        for x in l.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            let n: usize = x.parse().map_err(|_| KilnError::User(format!("--pp-layers: `{x}` is not a layer count (expected e.g. 3,3,2)")))?;
            list.push(int(n));
        }
        raw.insert("parallel.pp_layers".into(), toml::Value::Array(list));
    }
    if let Some(b) = &args.backend {
        raw.insert("parallel.backend".into(), toml::Value::String(b.clone()));
    }
    if let Some(r) = args.lora_rank {
        raw.insert("lora.rank".into(), toml::Value::Integer(r as i64));
    }
    if let Some(a) = args.lora_alpha {
        raw.insert("lora.alpha".into(), toml::Value::Float(a));
    }
    if let Some(t) = &args.lora_targets {
        let list = t.split(',').map(|s| toml::Value::String(s.trim().to_string())).filter(|v| v.as_str() != Some("")).collect();
        raw.insert("lora.targets".into(), toml::Value::Array(list));
    }
    RunConfig::resolve(&raw)
}
