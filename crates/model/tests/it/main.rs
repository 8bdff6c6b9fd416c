//! Integration tests for the model crate.
mod gpt;
mod hf;
mod lora;
mod recompute;
