//! Integration tests for the model crate.
mod docs;
mod gpt;
mod hf;
mod lora;
mod recompute;
