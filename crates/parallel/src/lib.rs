//! Parallelism for kiln, applied to a model by parameter name, never woven into model code.
//!
//! Today this crate holds the validated device mesh every strategy will share. The
//! communicator backends, data parallel / ZeRO, tensor / sequence parallel, pipeline schedules
//! and expert parallel attach here (see ARCHITECTURE.md); none of them is implemented yet.
//!
//! Architecture invariant: at world size 1 every strategy is the identity, and on N ranks the
//! loss and gradients match one rank.

pub mod mesh;
pub use mesh::{Axis, DeviceMesh};
