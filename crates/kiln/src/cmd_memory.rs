//! `kiln memory`: the memory plan of a run, before it runs (issue 7).

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
    let name = args.preset.clone().unwrap_or_else(|| "tiny".into());
    let mut cfg = crate::config::layered(&crate::presets::preset(&name)?, args)?;
    // A base model fixes the shape (and the vocabulary), as in `kiln train --init-from`.
    let base = (!cfg.model.init_from.is_empty()).then(|| crate::run::load_base(std::path::Path::new(&cfg.model.init_from))).transpose()?;
    let ds = crate::train::load_data(&cfg, None)?;
    let gpt = match base {
        Some(m) => {
            cfg.model.block_size = m.cfg.block_size;
            // The layout against the base's model, as `kiln train` checks it.
            let mut based = cfg.clone();
            crate::config::set_model_shape(&mut based.model, &m.cfg);
            based.validate_against_base()?;
            GptConfig { dropout: cfg.model.dropout as f32, ..m.cfg }
        }
        None => cfg.gpt_config(ds.tokenizer.vocab_size()),
    };
    // Sizes too large to plan at all are refused first; a plan is printed, then refused if it
    // exceeds memory.limit (or, without one, what this machine has available).
    let budget = crate::memory::check_sizes(&cfg, &gpt, ds.in_memory_bytes())?;
    let plan = plan_run(&cfg, &gpt, ds.in_memory_bytes())?;
    if as_json {
        println!("{}", plan.to_json());
    } else {
        print!("{}", plan.table());
    }
    plan.check_budget(&budget)
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
