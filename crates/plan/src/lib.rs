//! kiln's planner: predict memory, step time and MFU of a transformer on a cluster, and search the parallel
//! layout. Pure functions of configs: no kernels, no I/O except reading the user files the CLI names.
//!
//! - [`hardware`]: accelerator and interconnect catalogues (`catalog/hardware.json`), the `cpu-local` bench file.
//! - [`models`]: `ModelShape` and the model catalogue (`catalog/models.json`).
//! - [`cost`]: FLOPs, memory, communication and time (every formula cites its source).
//! - [`policy`]: the storage precision and recomputation policies, shared by every crate.
//! - [`schedule`]: the pipeline schedule kinds, shared with `parallel::pp`.
//! - [`search`]: enumerate, prune, rank layouts.
//! - [`setup`]: the software setup presets (`--setup`) estimate and validate share.
//! - [`validate`]: predicted vs published runs.
//! - [`cli`]: the `kiln plan` subcommands as plain structs, compile-checked here, which are also the clap flags
//!   `kiln`'s `cmd_plan.rs` flattens (feature `clap`).

pub mod cli;
pub mod cost;
pub mod hardware;
pub mod models;
pub mod policy;
pub mod schedule;
pub mod search;
pub mod setup;
pub mod validate;

pub use cost::palm_flops_per_token;

/// A user-facing planner error; the message names the flag, file or value at fault.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanError(pub String);

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PlanError {}
