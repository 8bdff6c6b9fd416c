//! kiln's CPU kernels: paired `<op>_forward` / `<op>_backward` free functions over flat `f32`
//! buffers (the llm.c convention), plus the seeded RNG and the optimizer update.
//!
//! Shape letters, used in every shape comment:
//! `B` batch, `T` time (sequence), `C` channels, `OC` output channels, `NH` heads, `HS` head size
//! (`C = NH·HS`), `V` vocabulary (real), `Vp` padded vocabulary, `L` layers.
//!
//! Conventions: outputs first, then inputs, then dims. Forward functions *overwrite* their
//! outputs. Backward functions *accumulate* (`+=`) into every gradient they write, so the caller
//! zeroes gradient buffers once per step and gradient accumulation is free. Every reduction runs
//! in a fixed order over fixed-size chunks, so results do not depend on thread timing.

pub mod attention;
pub mod bf16;
pub mod classifier;
pub mod flash;
pub mod grpo;
pub mod lean;
pub mod llama;
pub mod matmul;
pub mod moe;
pub mod ops;
pub mod optim;
pub mod par;
pub mod precision;
pub mod preference;
pub mod profile;
pub mod quant;
pub mod rng;
pub mod simd;

pub use attention::{attention_backward, attention_decode, attention_forward, attention_forward_docs, AttnDims, AttnDropout};
pub use matmul::{matmul_backward, matmul_forward};
pub use ops::*;
pub use optim::{adamw_update, scale_in_place, sum_squares, AdamW};
pub use rng::Rng;
