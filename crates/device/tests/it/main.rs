//! The conformance suite: every device kernel against its CPU twin in `tensor`, on shapes that
//! are multiples of no tile size, on the first Vulkan adapter (lavapipe in CI; a GPU where there
//! is one). It fails, naming what to install, where there is no adapter.
//!
//! Tolerances are the backend's contract, as max |device − CPU| over max |CPU|: 1e-5 for fp32,
//! 1e-2 where the inputs are bf16 or f16.
mod attention;
mod buffers;
mod common;
#[cfg(feature = "cuda")]
mod cuda;
mod matmul;
mod ops;
mod train_ops;
