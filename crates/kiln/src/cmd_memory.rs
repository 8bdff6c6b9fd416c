//! `kiln memory`: the memory plan of a run, before it runs.

use crate::cmd_train::TrainCli;
use crate::config::TrainArgs;
use clap::Args;
use crate::error::{user, Result};
use crate::memory::plan_run;
use model::GptConfig;

/// `kiln memory`: the plan of the run `kiln train` would start with the same flags.
pub fn cmd(args: &TrainArgs, as_json: bool) -> Result<()> {
    if args.resume {
        return user("kiln memory plans a new run: for an existing one pass --config RUN/config.toml (its resolved config) instead of --resume");
    }
    let mut cfg = crate::presets::resolve(args)?;
    // A base model fixes the shape (and the vocabulary), as in `kiln train --init-from`.
    let base = (!cfg.model.init_from.is_empty()).then(|| crate::run::base_config(std::path::Path::new(&cfg.model.init_from))).transpose()?;
    let tokenizer = crate::train::base_tokenizer(&cfg, &crate::config::user_keys(args)?)?;
    let ds = crate::train::load_data(&cfg, tokenizer)?;
    let gpt = match base {
        Some(b) => {
            cfg.model.block_size = b.block_size;
            // The layout against the base's model, as `kiln train` checks it.
            let mut based = cfg.clone();
            crate::config::set_model_shape(&mut based.model, &b);
            based.validate_against_base()?;
            GptConfig { dropout: cfg.model.dropout as f32, ..b }
        }
        None => cfg.gpt_config(ds.tokenizer.vocab_size()),
    };
    // Sizes too large to plan at all are refused first; a plan is printed, then refused if it
    // exceeds memory.limit (or, without one, what this machine has available).
    let budget = crate::memory::check_sizes(&cfg, &gpt, ds.in_memory_bytes())?;
    let plan = plan_run(&cfg, &gpt, ds.in_memory_bytes())?;
    // A device run: what it allocates on the device, refused past memory.device_limit or the
    // adapter's largest buffer (as `kiln train --device` refuses it).
    let device = device_plan(&cfg, &gpt)?;
    if as_json {
        let mut v = plan.to_json();
        if let Some(d) = &device {
            v["device"] = serde_json::json!({"device": d.device, "total_bytes": d.total_bytes, "largest_buffer_bytes": d.largest_bytes, "limit_bytes": cfg.device_memory_limit()});
        }
        println!("{v}");
    } else {
        print!("{}", plan.table());
        if let Some(d) = &device {
            println!("device {}: {}", d.device, d.figures);
        }
    }
    plan.check_budget(&budget)
}

/// A device run's plan on its device.
struct DevicePlanned {
    device: String,
    total_bytes: u64,
    largest_bytes: u64,
    figures: String,
}

/// The device plan of a `train.device` run; `None` on the CPU.
#[cfg(feature = "vulkan")]
fn device_plan(cfg: &crate::config::RunConfig, gpt: &GptConfig) -> Result<Option<DevicePlanned>> {
    let d: crate::device::DeviceArg = cfg.train.device.parse().map_err(crate::error::KilnError::User)?;
    let Some(gpu) = crate::device::open(d)? else { return Ok(None) };
    // A rank's device holds its part: the first pipeline rank's chunks (the most micro-batches
    // in flight; an interleaved schedule's virtual stages 0, P, 2P, …), the first
    // tensor-parallel part's (the largest vocabulary share), an expert-parallel part's block of
    // experts, a context-parallel part's positions.
    let p = &cfg.parallel;
    let stages = match p.pp {
        1 => vec![gpt.clone()],
        pp => {
            let layers = cfg.stage_layers(gpt.vocab_size)?;
            (0..p.virtual_stages).map(|c| parallel::pp::stage_config(gpt, layers[c * pp].clone())).collect()
        }
    };
    let mut parts = Vec::new();
    for stage in stages {
        let part = if p.tp > 1 { parallel::tp::local_config(&stage, p.tp, 0, p.sequence_parallel).map_err(crate::error::KilnError::User)? } else { stage };
        let mut part = if p.ep > 1 { parallel::ep::local_config(&part, p.ep, 0).map_err(crate::error::KilnError::User)? } else { part };
        if p.cp > 1 {
            part.place.context = Some(model::config::ContextSlice { index: 0, count: p.cp, zigzag: p.cp_balance == plan::policy::CpBalance::Zigzag });
        }
        let params = model::layout::gpt_layout(&part).0.total;
        parts.push((part, params));
    }
    let refs: Vec<(&GptConfig, usize)> = parts.iter().map(|(c, n)| (c, *n)).collect();
    let (p, figures) = crate::device_step::check_plan(&gpu, d, cfg, &refs)?;
    Ok(Some(DevicePlanned { device: format!("{d} ({})", gpu.info.name), total_bytes: p.total_bytes, largest_bytes: p.largest_bytes, figures }))
}

#[cfg(not(feature = "vulkan"))]
fn device_plan(cfg: &crate::config::RunConfig, _: &GptConfig) -> Result<Option<DevicePlanned>> {
    match cfg.train.device.as_str() {
        "cpu" => Ok(None),
        d => user(format!("train.device = {d}: this kiln was built without the device backend (rebuild with the default features, or `--features vulkan`)")),
    }
}

#[derive(Args)]
pub struct MemoryCli {
    #[command(flatten)]
    pub train: TrainCli,
    /// Print the plan as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Runs `kiln memory`.
pub fn run(m: MemoryCli) -> Result<()> {
            if m.train.supervise {
                return user("kiln memory: --supervise applies to `kiln train` only");
            }
            crate::cmd_memory::cmd(&m.train.args()?, m.json)
        }
