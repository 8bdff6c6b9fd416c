//! Parallelism for kiln, applied to a model by parameter name, never woven into model code.
//!
//! Today this crate holds the validated device mesh every strategy will share and the
//! communicator (`Comm`, with its in-process backend: one thread per rank). Data parallel /
//! ZeRO, tensor / sequence parallel, pipeline schedules and expert parallel attach here (see
//! ARCHITECTURE.md); none of them is implemented yet.
//!
//! Architecture invariant: at world size 1 every strategy is the identity, and on N ranks the
//! loss and gradients match one rank.

pub mod comm;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
pub use comm::{mesh_group, run_ranks, run_ranks_with_timeout, Comm, CommTotals, Counters, InProcess, InProcessComm, Op, Signature, OPS};
pub use mesh::{Axis, DeviceMesh};
