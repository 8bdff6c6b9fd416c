//! Integration tests for the kiln binary: one test binary, modules per concern.

/// No test allocates 1 GiB at once in this process; the fuzz replay (`fuzz.rs`) relies on it:
/// a target that does aborts the run with a message.
#[global_allocator]
static ALLOC: kiln::fuzz::Capped = kiln::fuzz::Capped;

mod architecture;
mod bench;
mod common;
mod context;
mod device;
mod errors;
mod expert;
mod fuzz;
mod grpo;
mod hf_models;
mod memory;
mod obs;
mod optim;
mod parallel;
mod preference;
mod reliability;
mod rewards;
mod sft;
mod tokenizers;
mod training;
