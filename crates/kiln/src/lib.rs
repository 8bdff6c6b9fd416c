//! kiln: the trainer, data plumbing, checkpoints, metrics and the CLI. No kernel code lives
//! here: everything numeric is a call into `tensor` through `model`.

pub mod bench;
#[cfg(feature = "vulkan")]
pub mod bench_kernels;
pub mod checkpoint;
pub mod cmd_bench;
pub mod cmd_checkpoint;
pub mod cmd_data;
pub mod cmd_memory;
pub mod cmd_model;
pub mod cmd_plan;
pub mod cmd_train;
pub mod cli;
pub mod config;
pub mod device;
#[cfg(feature = "vulkan")]
pub mod device_step;
pub mod error;
pub mod export;
pub mod fuzz;
pub mod memory;
pub mod obs;
pub mod presets;
pub mod progress;
pub mod reward;
pub mod run;
pub mod step;
pub mod supervise;
pub mod train;
pub mod util;
