//! `kiln plan estimate|search|validate`: flag parsing and printing only. All logic lives in the `plan` crate
//! (`plan::cli` holds the same arguments as plain structs and returns the text to print).

use std::io::Write;

use clap::{Args, Subcommand};

#[derive(Subcommand, Debug)]
pub enum PlanCmd {
    /// Predict step time, TFLOP/s, MFU and memory of one layout (omitted flags: best feasible value).
    Estimate(EstimateArgs),
    /// Enumerate layouts, drop those that do not fit, rank the rest by step time.
    Search(SearchArgs),
    /// Predicted vs published throughput for a table of runs (CSV or JSON).
    Validate(ValidateArgs),
}

#[derive(Args, Debug, Clone)]
pub struct ModelFlags {
    /// Catalogue name (e.g. llama3-70b, megatron-1t) or a model JSON file.
    #[arg(long)]
    pub model: Option<String>,
    /// Extra model catalogue entries (JSON: {"models":[...]}).
    #[arg(long)]
    pub models_file: Option<String>,
    #[arg(long)]
    pub layers: Option<u64>,
    #[arg(long)]
    pub hidden: Option<u64>,
    #[arg(long)]
    pub heads: Option<u64>,
    #[arg(long)]
    pub kv_heads: Option<u64>,
    #[arg(long)]
    pub ffn_hidden: Option<u64>,
    #[arg(long)]
    pub vocab: Option<u64>,
    /// gelu|swiglu
    #[arg(long)]
    pub mlp: Option<String>,
    #[arg(long)]
    pub experts: Option<u64>,
    #[arg(long)]
    pub top_k: Option<u64>,
}

#[derive(Args, Debug, Clone)]
pub struct ClusterFlags {
    /// Accelerator name (a100-80gb, h100-sxm, h200, b200, mi300x, tpu-v4, ...) or a JSON file such as the
    /// cpu-local file `kiln bench --peak` writes.
    #[arg(long)]
    pub gpu: String,
    #[arg(long)]
    pub gpus: u64,
    #[arg(long)]
    pub gpus_per_node: Option<u64>,
    /// Extra hardware catalogue entries (JSON: {"accelerators":[...],"links":[...]}) or a cpu-local file.
    #[arg(long)]
    pub hardware_file: Option<String>,
}

#[derive(Args, Debug, Clone)]
pub struct LayoutFlags {
    #[arg(long)]
    pub tp: Option<u64>,
    #[arg(long)]
    pub pp: Option<u64>,
    #[arg(long)]
    pub dp: Option<u64>,
    #[arg(long)]
    pub cp: Option<u64>,
    #[arg(long)]
    pub ep: Option<u64>,
    #[arg(long)]
    pub global_batch: u64,
    /// Sequence length (default: the model's).
    #[arg(long)]
    pub seq: Option<u64>,
    #[arg(long)]
    pub micro_batch: Option<u64>,
    /// gpipe|1f1b|interleaved
    #[arg(long)]
    pub schedule: Option<String>,
    #[arg(long)]
    pub virtual_stages: Option<u64>,
    /// none|selective|full
    #[arg(long)]
    pub recompute: Option<String>,
    /// Sequence parallelism (bare flag = true; omitted = choose).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub sequence_parallel: Option<bool>,
    /// 0|1|2|3
    #[arg(long)]
    pub zero: Option<u8>,
    /// bf16|fp16|fp8|fp32
    #[arg(long)]
    pub precision: Option<String>,
    /// unfused|flash
    #[arg(long)]
    pub attention: Option<String>,
    /// Overlap DP gradient reduction with backward (default true).
    #[arg(long)]
    pub dp_overlap: Option<bool>,
    /// Overlap TP backward collectives and interleaved-pipeline p2p with compute (default true).
    #[arg(long)]
    pub comm_overlap: Option<bool>,
    /// Keep and reduce gradients in fp32 (default true).
    #[arg(long)]
    pub fp32_grads: Option<bool>,
}

#[derive(Args, Debug, Clone)]
pub struct EstimateArgs {
    #[command(flatten)]
    pub model: ModelFlags,
    #[command(flatten)]
    pub cluster: ClusterFlags,
    #[command(flatten)]
    pub layout: LayoutFlags,
    /// Print {"step_time_s","model_tflops_per_gpu","mfu","memory_bytes_per_gpu","fits","breakdown","chosen"}.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct SearchArgs {
    #[command(flatten)]
    pub model: ModelFlags,
    #[command(flatten)]
    pub cluster: ClusterFlags,
    #[command(flatten)]
    pub layout: LayoutFlags,
    /// How many plans to print.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct ValidateArgs {
    /// CSV or JSON table of published runs; `table1` = the built-in Narayanan et al. 2021 Table 1.
    #[arg(long)]
    pub table: String,
    #[arg(long)]
    pub hardware_file: Option<String>,
    #[arg(long)]
    pub json: bool,
}

fn model_args(f: &ModelFlags) -> plan::cli::ModelArgs {
    plan::cli::ModelArgs {
        model: f.model.clone(),
        models_file: f.models_file.clone(),
        layers: f.layers,
        hidden: f.hidden,
        heads: f.heads,
        kv_heads: f.kv_heads,
        ffn_hidden: f.ffn_hidden,
        vocab: f.vocab,
        mlp: f.mlp.clone(),
        experts: f.experts,
        top_k: f.top_k,
    }
}

fn cluster_args(f: &ClusterFlags) -> plan::cli::ClusterArgs {
    plan::cli::ClusterArgs {
        gpu: f.gpu.clone(),
        gpus: f.gpus,
        gpus_per_node: f.gpus_per_node,
        hardware_file: f.hardware_file.clone(),
    }
}

fn layout_args(f: &LayoutFlags) -> plan::cli::LayoutArgs {
    plan::cli::LayoutArgs {
        tp: f.tp,
        pp: f.pp,
        dp: f.dp,
        cp: f.cp,
        ep: f.ep,
        global_batch: f.global_batch,
        seq: f.seq,
        micro_batch: f.micro_batch,
        schedule: f.schedule.clone(),
        virtual_stages: f.virtual_stages,
        recompute: f.recompute.clone(),
        sequence_parallel: f.sequence_parallel,
        zero: f.zero,
        precision: f.precision.clone(),
        attention: f.attention.clone(),
        overlap_dp: f.dp_overlap,
        overlap_comm: f.comm_overlap,
        fp32_grads: f.fp32_grads,
    }
}

/// Run a `kiln plan` subcommand; an error is one line naming the flag, file or value at fault.
pub fn run(cmd: PlanCmd) -> Result<(), String> {
    let out = match &cmd {
        PlanCmd::Estimate(a) => plan::cli::estimate_cmd(
            &model_args(&a.model),
            &cluster_args(&a.cluster),
            &layout_args(&a.layout),
            a.json,
        ),
        PlanCmd::Search(a) => plan::cli::search_cmd(
            &model_args(&a.model),
            &cluster_args(&a.cluster),
            &layout_args(&a.layout),
            a.top,
            a.json,
        ),
        PlanCmd::Validate(a) => plan::cli::validate_cmd(&a.table, a.hardware_file.as_deref(), a.json),
    }
    .map_err(|e| format!("kiln plan: {e}"))?;
    // A closed pipe (`kiln plan search | head`) is not an error worth a panic.
    let mut stdout = std::io::stdout().lock();
    let nl = if out.ends_with('\n') { "" } else { "\n" };
    let _ = write!(stdout, "{out}{nl}");
    Ok(())
}
