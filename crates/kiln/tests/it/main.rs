//! Integration tests for the kiln binary: one test binary, modules per concern.
mod architecture;
mod bench;
mod common;
mod errors;
mod expert;
mod hf_models;
mod memory;
mod obs;
mod parallel;
mod reliability;
mod sft;
mod tokenizers;
mod training;
