//! Parallelism for kiln, applied to a model by parameter name, never woven into model code.
//!
//! This crate holds the validated device mesh every strategy shares, the communicator (`Comm`,
//! with its in-process backend: one thread per rank; MPI behind the `mpi` feature), the
//! per-rank communication thread, and data parallelism with ZeRO-1/2/3 (`dp`), which reaches
//! the model only through its units (`model::UnitStore`). Tensor / sequence parallel, pipeline
//! schedules and expert parallel (`ep`) are applied by parameter name as well.
//!
//! Architecture invariant: at world size 1 every strategy is the identity, and on N ranks the
//! loss and gradients match one rank.

pub mod apply;
pub mod comm;
pub mod compress;
pub mod cp;
pub mod dp;
pub mod ep;
pub mod mesh;
pub mod pp;
pub mod tp;
pub mod worker;
pub mod zeropp;
#[cfg(feature = "mpi")]
pub mod mpi;
pub use comm::{mesh_group, run_ranks, run_ranks_with_timeout, Comm, CommTotals, Counters, InProcess, InProcessComm, Op, Signature, OPS};
pub use mesh::{Axis, DeviceMesh};
pub use dp::{DataParallel, Overlap, Piece, Shards, StateBytes};
pub use worker::CommWorker;
