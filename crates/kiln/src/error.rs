//! The one error type a user can meet. `User` errors (bad config, data, checkpoint, flags)
//! exit with code 2; `Internal` ones (an I/O failure mid-run) with code 1. Messages are one
//! line and name the file, key or value at fault.

use std::fmt;

#[derive(Debug)]
pub enum KilnError {
    User(String),
    Internal(String),
    /// Training must restart from the newest valid checkpoint of `run_dir` (numerical-fault
    /// rollback).
    Rollback(String, std::path::PathBuf),
    /// A rank failed (`faults.fail_ranks`): its state and memory are gone.
    RankFailed { rank: usize, step: u64 },
}

impl KilnError {
    pub fn exit_code(&self) -> i32 {
        match self {
            KilnError::User(_) => 2,
            KilnError::Internal(_) | KilnError::Rollback(..) | KilnError::RankFailed { .. } => 1,
        }
    }
}

impl fmt::Display for KilnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KilnError::User(m) | KilnError::Internal(m) | KilnError::Rollback(m, _) => f.write_str(m),
            KilnError::RankFailed { rank, step } => write!(f, "rank {rank} failed at step {step} (injected: faults.fail_ranks)"),
        }
    }
}

impl std::error::Error for KilnError {}

impl From<data::DataError> for KilnError {
    fn from(e: data::DataError) -> Self {
        KilnError::User(e.to_string())
    }
}

/// Shorthand for a user error.
pub fn user<T>(msg: impl Into<String>) -> Result<T, KilnError> {
    Err(KilnError::User(msg.into()))
}

/// Wraps an I/O error with the path it concerns.
pub fn io_err(path: &std::path::Path, e: std::io::Error) -> KilnError {
    KilnError::Internal(format!("{}: {e}", path.display()))
}

pub type Result<T, E = KilnError> = std::result::Result<T, E>;
