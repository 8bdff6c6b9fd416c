//! The crate's one error type: a single line that names the file, key or value at fault.

use std::fmt;
use std::path::Path;

/// Every fallible function of this crate returns this. The message is one line and names the
/// path or value at fault, e.g. `data/x.npy: unsupported dtype '<f4' (expected <u2, <u4, <i4, <i8 or <u8)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataError(pub String);

impl DataError {
    pub fn new(msg: impl Into<String>) -> DataError {
        DataError(msg.into())
    }

    /// `"{path}: {msg}"`.
    pub fn at(path: &Path, msg: impl fmt::Display) -> DataError {
        DataError(format!("{}: {}", path.display(), msg))
    }

    /// `"{path}: {what}: {io error}"`.
    pub fn io(path: &Path, what: &str, err: std::io::Error) -> DataError {
        DataError(format!("{}: {}: {}", path.display(), what, err))
    }

    pub fn message(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DataError {}
