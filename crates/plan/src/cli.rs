//! The `kiln plan` commands as plain structs (raw flags) and functions that return the text to print.
//! The flags are declared here once: with the `clap` feature (which `kiln` turns on) the structs are clap
//! `Args` that `crates/kiln/src/cmd_plan.rs` flattens into its subcommands; without it the crate needs no clap.

use std::fmt::Write as _;

use crate::cost::{Attention, Estimate, Recompute};
use crate::hardware::{Cluster, HardwareCatalog, Precision};
use crate::policy::Names;
use crate::models::{find_model, parse_models, Mlp, ModelShape, RawModel};
use crate::schedule::{self, Kind};
use crate::search::{explain, mesh_name, search, Constraints, SearchResult};
use crate::validate::{parse_table, validate, Report};
use crate::PlanError;

/// Model flags: `--model NAME|FILE` or an inline shape.
#[derive(Clone, Debug, Default)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct ModelArgs {
    /// Catalogue name (e.g. llama3-70b, megatron-1t) or a model JSON file.
    #[cfg_attr(feature = "clap", arg(long))]
    pub model: Option<String>,
    /// Extra model catalogue entries (JSON: {"models":[...]}).
    #[cfg_attr(feature = "clap", arg(long))]
    pub models_file: Option<String>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub layers: Option<u64>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub hidden: Option<u64>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub heads: Option<u64>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub kv_heads: Option<u64>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub ffn_hidden: Option<u64>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub vocab: Option<u64>,
    /// gelu|swiglu
    #[cfg_attr(feature = "clap", arg(long))]
    pub mlp: Option<String>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub experts: Option<u64>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub top_k: Option<u64>,
    /// Linear/LayerNorm biases (true|false; overrides the catalogue entry).
    #[cfg_attr(feature = "clap", arg(long))]
    pub biases: Option<bool>,
    /// Dropout (true|false; overrides the catalogue entry; kiln's presets use none).
    #[cfg_attr(feature = "clap", arg(long))]
    pub dropout: Option<bool>,
}

/// Cluster flags.
#[derive(Clone, Debug, Default)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct ClusterArgs {
    /// Accelerator name (a100-80gb, h100-sxm, h200, b200, mi300x, tpu-v4, ...) or a JSON file such as the
    /// cpu-local file `kiln bench --peak` writes.
    #[cfg_attr(feature = "clap", arg(long))]
    pub gpu: String,
    #[cfg_attr(feature = "clap", arg(long))]
    pub gpus: u64,
    #[cfg_attr(feature = "clap", arg(long))]
    pub gpus_per_node: Option<u64>,
    /// The link between nodes (a catalogue link name, e.g. eth-100g), instead of the accelerator's own.
    #[cfg_attr(feature = "clap", arg(long))]
    pub inter_link: Option<String>,
    /// NICs per node with --inter-link (default: the accelerator's).
    #[cfg_attr(feature = "clap", arg(long))]
    pub nics_per_node: Option<u64>,
    /// Extra hardware catalogue entries (JSON: {"accelerators":[...],"links":[...]}) or a cpu-local file.
    #[cfg_attr(feature = "clap", arg(long))]
    pub hardware_file: Option<String>,
}

/// Layout flags; `None` = choose the best feasible value.
#[derive(Clone, Debug, Default)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct LayoutArgs {
    #[cfg_attr(feature = "clap", arg(long))]
    pub tp: Option<u64>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub pp: Option<u64>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub dp: Option<u64>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub cp: Option<u64>,
    /// Context-parallel attention: ring or ulysses (default: both searched)
    #[cfg_attr(feature = "clap", arg(long))]
    pub cp_mode: Option<String>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub ep: Option<u64>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub global_batch: u64,
    /// Sequence length (default: the model's).
    #[cfg_attr(feature = "clap", arg(long))]
    pub seq: Option<u64>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub micro_batch: Option<u64>,
    /// gpipe|1f1b|interleaved
    #[cfg_attr(feature = "clap", arg(long))]
    pub schedule: Option<String>,
    #[cfg_attr(feature = "clap", arg(long))]
    pub virtual_stages: Option<u64>,
    /// none|selective|full
    #[cfg_attr(feature = "clap", arg(long))]
    pub recompute: Option<String>,
    /// Sequence parallelism (bare flag = true; omitted = choose).
    #[cfg_attr(feature = "clap", arg(long, num_args = 0..=1, default_missing_value = "true"))]
    pub sequence_parallel: Option<bool>,
    /// 0|1|2|3
    #[cfg_attr(feature = "clap", arg(long))]
    pub zero: Option<u8>,
    /// bf16|fp16|fp8|fp32
    #[cfg_attr(feature = "clap", arg(long))]
    pub precision: Option<String>,
    /// unfused|flash
    #[cfg_attr(feature = "clap", arg(long))]
    pub attention: Option<String>,
    /// Overlap DP gradient reduction with backward (default true).
    #[cfg_attr(feature = "clap", arg(long = "dp-overlap", value_name = "DP_OVERLAP"))]
    pub overlap_dp: Option<bool>,
    /// Overlap TP backward collectives and interleaved-pipeline p2p with compute (default true).
    #[cfg_attr(feature = "clap", arg(long = "comm-overlap", value_name = "COMM_OVERLAP"))]
    pub overlap_comm: Option<bool>,
    /// Keep and reduce gradients in fp32 (default true).
    #[cfg_attr(feature = "clap", arg(long))]
    pub fp32_grads: Option<bool>,
    /// The optimizer: adamw|lion|muon|adafactor (default adamw): its state bytes, and Muon's iteration.
    #[cfg_attr(feature = "clap", arg(long))]
    pub optimizer: Option<String>,
    /// AdamW's state: fp32|bf16|int8 (default fp32).
    #[cfg_attr(feature = "clap", arg(long))]
    pub optim_state: Option<String>,
    /// Data-parallel compression: none|onebit_adam|powersgd|zero_one_adam (after its warm-up; default none).
    #[cfg_attr(feature = "clap", arg(long))]
    pub compression: Option<String>,
    /// PowerSGD's rank (default 4).
    #[cfg_attr(feature = "clap", arg(long))]
    pub powersgd_rank: Option<u64>,
    /// ZeRO++ on ZeRO-3: int8 parameter gathers, hierarchical int4 gradient reduce-scatter,
    /// backward gathers inside a node (default false).
    #[cfg_attr(feature = "clap", arg(long))]
    pub zeropp: Option<bool>,
    /// Software setup preset: kiln|megatron-2021|megatron-2022|megatron-deepspeed|megatron-2023|megatron-2024|deepspeed-zero|fsdp
    /// (default kiln); the flags above override its fields.
    #[cfg_attr(feature = "clap", arg(long))]
    pub setup: Option<String>,
}

fn read_file(path: &str, what: &str) -> Result<String, PlanError> {
    std::fs::read_to_string(path).map_err(|e| PlanError(format!("{what} {path}: cannot read: {e}")))
}

fn looks_like_file(s: &str) -> bool {
    s.ends_with(".json") || s.contains('/') || std::path::Path::new(s).exists()
}

/// Resolve the model flags.
pub fn resolve_model(a: &ModelArgs) -> Result<ModelShape, PlanError> {
    let mut m = resolve_model_shape(a)?;
    // Overrides that also apply to a catalogue model (`--model gpt2-124m --vocab 50304 --dropout false`).
    if let Some(v) = a.vocab {
        m.vocab = v;
    }
    if let Some(b) = a.biases {
        m.biases = b;
    }
    if let Some(d) = a.dropout {
        m.dropout = d;
    }
    Ok(m)
}

fn resolve_model_shape(a: &ModelArgs) -> Result<ModelShape, PlanError> {
    let extra = match &a.models_file {
        Some(p) => parse_models(&read_file(p, "--models-file")?, p)?,
        None => vec![],
    };
    let inline = a.layers.is_some() || a.hidden.is_some() || a.heads.is_some();
    match (&a.model, inline) {
        (Some(_), true) => Err(PlanError("--model and --layers/--hidden/--heads are exclusive".into())),
        (Some(name), false) if looks_like_file(name) => {
            // A Hugging Face model directory: its config.json.
            let dir_cfg = std::path::Path::new(name).join("config.json");
            let name = &if std::path::Path::new(name).is_dir() { dir_cfg.display().to_string() } else { name.clone() };
            let models = parse_models(&read_file(name, "--model")?, name)?;
            match models.len() {
                1 => Ok(models.into_iter().next().unwrap()),
                n => Err(PlanError(format!(
                    "--model {name}: file holds {n} models; pass one, or use --models-file and --model NAME"
                ))),
            }
        }
        (Some(name), false) => find_model(name, &extra),
        (None, true) => {
            let need = |v: Option<u64>, f: &str| v.ok_or_else(|| PlanError(format!("{f} is required without --model")));
            RawModel {
                name: "custom".into(),
                layers: need(a.layers, "--layers")?,
                hidden: need(a.hidden, "--hidden")?,
                heads: need(a.heads, "--heads")?,
                kv_heads: a.kv_heads,
                ffn_hidden: a.ffn_hidden,
                vocab: need(a.vocab, "--vocab")?,
                mlp: a.mlp.as_deref().map(Mlp::parse).transpose()?,
                experts: a.experts,
                top_k: a.top_k,
                biases: a.biases,
                dropout: a.dropout,
                ..Default::default()
            }
            .resolve()
        }
        (None, false) => Err(PlanError(
            "give --model NAME|FILE or --layers --hidden --heads --vocab".into(),
        )),
    }
}

/// Resolve the cluster flags.
pub fn resolve_cluster(a: &ClusterArgs) -> Result<Cluster, PlanError> {
    let mut cat = HardwareCatalog::builtin();
    if let Some(p) = &a.hardware_file {
        cat.extend(HardwareCatalog::parse_extra(&read_file(p, "--hardware-file")?, p)?);
    }
    let mut name = a.gpu.clone();
    if looks_like_file(&a.gpu) && !cat.accelerators.iter().any(|x| x.name == a.gpu) {
        let extra = HardwareCatalog::parse_extra(&read_file(&a.gpu, "--gpu")?, &a.gpu)?;
        if extra.accelerators.len() != 1 {
            return Err(PlanError(format!(
                "--gpu {}: file must hold exactly one accelerator",
                a.gpu
            )));
        }
        name = extra.accelerators[0].name.clone();
        cat.extend(extra);
    }
    if a.inter_link.is_some() || a.nics_per_node.is_some() {
        if let Some(l) = &a.inter_link {
            cat.link(l)?;
        }
        let acc = cat.accelerators.iter_mut().find(|x| x.name == name).ok_or_else(|| PlanError(format!("--gpu {name}: not in the catalogue")))?;
        if let Some(l) = &a.inter_link {
            acc.node.inter = l.clone();
        }
        if let Some(n) = a.nics_per_node {
            if n == 0 {
                return Err(PlanError("--nics-per-node must be at least 1".into()));
            }
            acc.node.nics_per_node = n;
        }
    }
    Cluster::new(&cat, &name, a.gpus, a.gpus_per_node)
}

/// Resolve the layout flags into constraints, the global batch and the sequence length.
pub fn resolve_layout(a: &LayoutArgs, model: &ModelShape) -> Result<(Constraints, u64, u64), PlanError> {
    let mut c = Constraints {
        tp: a.tp,
        pp: a.pp,
        dp: a.dp,
        cp: a.cp,
        cp_mode: a.cp_mode.as_deref().map(|v| crate::policy::CpMode::parse(v).map_err(|e| PlanError(format!("--cp-mode {e}")))).transpose()?,
        ep: a.ep,
        micro_batch: a.micro_batch,
        schedule: match (&a.schedule, a.virtual_stages) {
            (Some(s), _) => Some(schedule::parse_flag(s)?),
            (None, Some(v)) if v > 1 => Some(Kind::Interleaved),
            _ => None,
        },
        virtual_stages: a.virtual_stages,
        recompute: a.recompute.as_deref().map(|v| Recompute::parse(v).map_err(|e| PlanError(format!("--recompute {e}")))).transpose()?,
        sequence_parallel: a.sequence_parallel,
        zero: a.zero,
        precision: a.precision.as_deref().map(|v| Precision::parse(v).map_err(|e| PlanError(format!("--precision {e}")))).transpose()?,
        attention: a.attention.as_deref().map(Attention::parse).transpose()?,
        overlap_dp: a.overlap_dp,
        overlap_comm: a.overlap_comm,
        fp32_grads: a.fp32_grads,
        optimizer: a.optimizer.as_deref().map(|v| <crate::policy::OptimName as crate::policy::Names>::parse(v).map_err(|e| PlanError(format!("--optimizer {e}")))).transpose()?,
        optim_state: a.optim_state.as_deref().map(|v| <crate::policy::StateForm as crate::policy::Names>::parse(v).map_err(|e| PlanError(format!("--optim-state {e}")))).transpose()?,
        compression: a.compression.as_deref().map(|v| crate::policy::Compression::parse(v).map_err(|e| PlanError(format!("--compression {e}")))).transpose()?,
        powersgd_rank: a.powersgd_rank,
        zeropp: a.zeropp,
        uneven_pipeline: None,
        pp_blocking_p2p: None,
    };
    let setup = crate::setup::Setup::preset(a.setup.as_deref().unwrap_or("kiln"))?;
    c.precision = c.precision.or(setup.precision);
    c.attention = c.attention.or(setup.attention);
    c.overlap_dp = c.overlap_dp.or(Some(setup.overlap_dp));
    c.overlap_comm = c.overlap_comm.or(Some(setup.overlap_comm));
    c.fp32_grads = c.fp32_grads.or(Some(setup.fp32_grads));
    c.zero = c.zero.or(setup.zero);
    c.recompute = c.recompute.or(setup.recompute);
    c.sequence_parallel = c.sequence_parallel.or(setup.sequence_parallel);
    c.uneven_pipeline = Some(setup.uneven_pipeline);
    c.pp_blocking_p2p = Some(setup.pp_blocking_p2p);
    if let Some(z) = a.zero {
        if z > 3 {
            return Err(PlanError(format!("--zero {z}: expected 0|1|2|3")));
        }
    }
    Ok((c, a.global_batch, a.seq.unwrap_or(model.seq)))
}

fn params_text(p: u64) -> String {
    let p = p as f64;
    if p >= 1e9 {
        format!("{:.2}B", p / 1e9)
    } else {
        format!("{:.1}M", p / 1e6)
    }
}

fn gib(b: f64) -> f64 {
    b / (1u64 << 30) as f64
}

fn run_search(
    m: &ModelArgs,
    c: &ClusterArgs,
    l: &LayoutArgs,
) -> Result<(ModelShape, Cluster, SearchResult), PlanError> {
    let model = resolve_model(m)?;
    let cluster = resolve_cluster(c)?;
    let (cons, b, s) = resolve_layout(l, &model)?;
    let r = search(&model, &cluster, b, s, &cons)?;
    Ok((model, cluster, r))
}

fn layout_line(e: &Estimate) -> String {
    let l = &e.chosen;
    let mut s = format!("{} b{}", mesh_name(l), l.micro_batch);
    if l.pp > 1 {
        s += &format!(" {}", l.schedule.name());
        if l.virtual_stages > 1 {
            s += &format!(" v{}", l.virtual_stages);
        }
    }
    s += &format!(" rc:{}", l.recompute.name());
    if l.sequence_parallel {
        s += " sp";
    }
    if l.zero > 0 {
        s += &format!(" zero{}", l.zero);
    }
    s
}

fn estimate_text(model: &ModelShape, cl: &Cluster, e: &Estimate) -> String {
    let b = &e.breakdown;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "model {} ({} params), {} x {}",
        model.name,
        params_text(model.params(e.chosen.seq)),
        cl.gpus,
        cl.acc.name
    );
    let _ = writeln!(o, "layout      {}  ({} micro-batches)", layout_line(e), b.micro_batches);
    if e.step_time_s < 1.0 {
        let _ = writeln!(o, "step time   {:.1} ms", e.step_time_s * 1e3);
    } else {
        let _ = writeln!(o, "step time   {:.3} s", e.step_time_s);
    }
    let _ = writeln!(
        o,
        "throughput  {:.1} model TFLOP/s per GPU, MFU {:.1}%  ({:.1} hardware TFLOP/s incl. recompute)",
        e.model_tflops_per_gpu,
        e.mfu * 100.0,
        b.hardware_tflops_per_gpu
    );
    let _ = writeln!(
        o,
        "memory      {:.1} GiB of {:.1} GiB per GPU: {}",
        gib(e.memory_bytes_per_gpu),
        gib(cl.acc.mem_bytes),
        if e.fits { "fits" } else { "DOES NOT FIT" }
    );
    let m = &b.memory;
    let _ = writeln!(
        o,
        "            weights {:.1}, grads {:.1}, optimizer {:.1}, activations {:.1}, logits {:.1}, reserved {:.1} GiB",
        gib(m.weights),
        gib(m.gradients),
        gib(m.optimizer),
        gib(m.activations),
        gib(m.logits),
        gib(m.reserved)
    );
    let _ = writeln!(
        o,
        "time        GEMM {:.3}, attention {:.3}, memory-bound {:.3}, recompute {:.3}",
        b.compute_gemm_s, b.compute_attention_s, b.compute_elementwise_s, b.recompute_s
    );
    let _ = writeln!(
        o,
        "            TP {:.3}, CP {:.3}, EP {:.3}, PP p2p {:.3}, bubble {:.3}, DP exposed {:.3} (of {:.3}), overlap contention {:.3}, optimizer {:.3} s",
        b.tp_comm_s, b.cp_comm_s, b.ep_comm_s, b.pp_p2p_s, b.pp_bubble_s, b.dp_comm_exposed_s, b.dp_comm_total_s, b.overlap_contention_s, b.optimizer_s
    );
    let _ = writeln!(
        o,
        "DP traffic  {:.1} MB sent per GPU per step ({}), over {} between nodes",
        b.dp_bytes_per_gpu / 1e6,
        match e.chosen.compression {
            crate::policy::Compression::None if e.chosen.zeropp => "ZeRO++: int8 parameter gathers, the backward's inside the node, int4 gradients".to_string(),
            crate::policy::Compression::None => "gradients".to_string(),
            crate::policy::Compression::OnebitAdam => "1-bit Adam momentum, after its warm-up".to_string(),
            crate::policy::Compression::PowerSgd => format!("PowerSGD rank-{} factors", e.chosen.powersgd_rank),
            crate::policy::Compression::ZerooneAdam => "0/1 Adam's 1-bit sync every 16 steps, past its variance freeze".to_string(),
        },
        cl.inter.name
    );
    o
}

/// `kiln plan estimate`.
pub fn estimate_cmd(m: &ModelArgs, c: &ClusterArgs, l: &LayoutArgs, json: bool) -> Result<String, PlanError> {
    let (model, cluster, r) = run_search(m, c, l)?;
    let e = match r.plans.first() {
        Some(e) => e.clone(),
        None => r
            .smallest_unfit
            .clone()
            .ok_or_else(|| PlanError("no valid layout".into()))?,
    };
    let setup = crate::setup::Setup::of_layout(&crate::setup::Setup::preset(l.setup.as_deref().unwrap_or("kiln"))?, &e.chosen);
    if json {
        let mut v = serde_json::to_value(&e).map_err(|x| PlanError(x.to_string()))?;
        v["setup"] = serde_json::to_value(&setup).map_err(|x| PlanError(x.to_string()))?;
        return serde_json::to_string_pretty(&v).map_err(|x| PlanError(x.to_string()));
    }
    Ok(format!("{}setup       {}\n", estimate_text(&model, &cluster, &e), setup.describe()))
}

/// `kiln plan search`: the top `top` plans as a table and why the best wins.
pub fn search_cmd(m: &ModelArgs, c: &ClusterArgs, l: &LayoutArgs, top: usize, json: bool) -> Result<String, PlanError> {
    let t0 = std::time::Instant::now();
    let (model, cluster, r) = run_search(m, c, l)?;
    if r.plans.is_empty() {
        let need = r
            .smallest_unfit
            .as_ref()
            .map(|e| gib(e.memory_bytes_per_gpu))
            .unwrap_or(f64::NAN);
        return Err(PlanError(format!(
            "no layout fits: the smallest of {} needs {need:.1} GiB per GPU, {} has {:.1} GiB",
            r.evaluated,
            cluster.acc.name,
            gib(cluster.acc.mem_bytes)
        )));
    }
    if json {
        let v = serde_json::json!({
            "plans": r.plans.iter().take(top).collect::<Vec<_>>(),
            "evaluated": r.evaluated,
            "pruned_unfit": r.pruned_unfit,
        });
        return serde_json::to_string_pretty(&v).map_err(|x| PlanError(x.to_string()));
    }
    let mut o = String::new();
    let _ = writeln!(
        o,
        "model {} ({} params) on {} x {} ({} per node), global batch {}, seq {}",
        model.name,
        params_text(model.params(r.plans[0].chosen.seq)),
        cluster.gpus,
        cluster.acc.name,
        cluster.gpus_per_node,
        l.global_batch,
        r.plans[0].chosen.seq
    );
    let _ = writeln!(
        o,
        "{} layouts evaluated, {} pruned (do not fit), {} meshes fit; searched in {:.2} s",
        r.evaluated,
        r.pruned_unfit,
        r.plans.len(),
        t0.elapsed().as_secs_f64()
    );
    let _ = writeln!(
        o,
        "{:>3} {:<48} {:>8} {:>7} {:>5} {:>7} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6}",
        "#",
        "layout",
        "step s",
        "TFLOP/s",
        "MFU%",
        "compute",
        "TP",
        "CP",
        "EP",
        "PP p2p",
        "bubble",
        "DP",
        "optim",
        "GiB"
    );
    for (i, e) in r.plans.iter().take(top).enumerate() {
        let b = &e.breakdown;
        let compute = b.compute_gemm_s + b.compute_attention_s + b.compute_elementwise_s + b.recompute_s;
        let _ = writeln!(
            o,
            "{:>3} {:<48} {:>8.3} {:>7.1} {:>5.1} {:>7.3} {:>6.3} {:>6.3} {:>6.3} {:>6.3} {:>6.3} {:>6.3} {:>6.3} {:>6.1}",
            i + 1,
            layout_line(e),
            e.step_time_s,
            e.model_tflops_per_gpu,
            e.mfu * 100.0,
            compute,
            b.tp_comm_s,
            b.cp_comm_s,
            b.ep_comm_s,
            b.pp_p2p_s,
            b.pp_bubble_s,
            b.dp_comm_exposed_s + b.overlap_contention_s,
            b.optimizer_s,
            gib(e.memory_bytes_per_gpu)
        );
    }
    let _ = writeln!(
        o,
        "(seconds per iteration on the slowest pipeline stage; compute includes recomputation; DP = exposed part + the compute its hidden part slows)"
    );
    if r.plans.len() > 1 {
        let _ = writeln!(o, "why: {}", explain(&r.plans[0], &r.plans[1]));
    } else {
        let _ = writeln!(o, "why: the only mesh that fits");
    }
    Ok(o)
}

/// `kiln plan validate --table FILE` (or the built-in Table 1 when `table` is "table1").
pub fn validate_cmd(table: &str, hardware_file: Option<&str>, json: bool) -> Result<String, PlanError> {
    let text = if table == "narayanan2021" || table == "table1" {
        crate::validate::NARAYANAN_TABLE1.to_string()
    } else {
        read_file(table, "--table")?
    };
    let rows = parse_table(&text, table)?;
    let mut cat = HardwareCatalog::builtin();
    if let Some(p) = hardware_file {
        cat.extend(HardwareCatalog::parse_extra(&read_file(p, "--hardware-file")?, p)?);
    }
    let rep = validate(&rows, &cat, table)?;
    if json {
        return serde_json::to_string_pretty(&rep).map_err(|x| PlanError(x.to_string()));
    }
    Ok(report_text(&rep))
}

pub fn report_text(rep: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<10} {:>3} {:>3} {:>5} {:>10} {:>10} {:>8}  chosen",
        "run", "TP", "PP", "GPUs", "published", "predicted", "error"
    );
    let split = |r: &crate::validate::RowResult| r.split.as_deref().map_or(String::new(), |s| format!("  [{s}]"));
    for r in &rep.rows {
        let l = &r.chosen;
        let _ = writeln!(
            o,
            "{:<10} {:>3} {:>3} {:>5} {:>10.1} {:>10.1} {:>+7.1}%  b{} v{}{}{}",
            r.name,
            r.tp,
            r.pp,
            r.gpus,
            r.published_tflops,
            r.predicted_tflops,
            r.error_pct,
            l.micro_batch,
            l.virtual_stages,
            if r.fits { "" } else { " (does not fit)" },
            split(r)
        );
    }
    let _ = writeln!(
        o,
        "mean absolute percentage error {:.2}%, worst {:.2}% ({})",
        rep.mape_pct, rep.worst_pct, rep.worst_row
    );
    for h in &rep.halves {
        let _ = writeln!(
            o,
            "{:<8} {} rows: MAPE {:.2}%, worst {:.2}% ({}){}",
            h.split,
            h.rows,
            h.mape_pct,
            h.worst_pct,
            h.worst_row,
            if h.split == "fit" {
                "  (constants may be fitted on these: narayanan2021, and row k mod 3 == 1 of each other source)"
            } else {
                "  (kept out of every fit)"
            }
        );
    }
    if !rep.skipped.is_empty() {
        let _ = writeln!(o, "skipped {} rows kiln cannot evaluate:", rep.skipped.len());
        for (n, why) in &rep.skipped {
            let _ = writeln!(o, "  {n}: {why}");
        }
    }
    o
}
