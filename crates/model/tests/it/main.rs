//! Integration tests for the model crate.
#[cfg(feature = "device")]
mod device;
mod docs;
mod gpt;
mod hf;
mod lora;
mod recompute;
