//! Integration tests for the kernels: one binary, modules per concern.
mod common;
mod gradcheck;
mod kernels;
mod llama;
mod moe;
mod flash;
mod precision;
