//! Gradient checks and reference values for the LLaMA-family kernels (being written).
