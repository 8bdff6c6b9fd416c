//! Integration tests for the kernels: one binary, modules per concern.
mod bf16;
mod common;
mod docs;
mod gradcheck;
mod grpo;
mod kernels;
mod llama;
mod moe;
mod optim;
mod flash;
mod precision;
mod preference;
mod quant;
mod ring;
