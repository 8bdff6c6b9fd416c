//! The data crate's one integration-test binary.

// `&[p.clone()]` reads better than `std::slice::from_ref(&p)` in tests.
#![allow(clippy::cloned_ref_to_slice_refs)]

mod bpe;
mod corpus;
mod dataset;
mod docs;
mod files;
mod hf_tokenizers;
mod tokenizer;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh, empty directory under the system temp dir, unique per call and process.
pub fn temp_dir(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("kiln-data-{}-{tag}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// tinyshakespeare from the shared folder; a missing one fails the test, naming its path.
pub fn shakespeare() -> String {
    let p = shakespeare_path();
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("fixture {} not readable: {e}", p.display()))
}

pub fn shakespeare_path() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data/tinyshakespeare.txt"))
}

/// The Rust books of the toolchain (`data::default_corpus`); where they are missing the test
/// fails with the paths looked at (`rustup component add rust-docs` installs them).
pub fn rust_books() -> (String, Vec<PathBuf>) {
    data::default_corpus().unwrap_or_else(|e| panic!("fixture missing: {e}"))
}

/// At most the first `bytes` of `s`, cut back to a char boundary.
pub fn prefix(s: &str, bytes: usize) -> &str {
    let mut end = bytes.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The first `bytes` of tinyshakespeare: English text for training.
pub fn sample_text(bytes: usize) -> String {
    prefix(&shakespeare(), bytes).to_string()
}

/// Asserts that `err`'s message mentions `needle` (usually a path) and returns the message.
#[track_caller]
pub fn assert_names(err: data::DataError, needle: &str) -> String {
    let msg = err.to_string();
    assert!(msg.contains(needle), "error message {msg:?} does not name {needle:?}");
    assert!(!msg.contains('\n'), "error message {msg:?} is not one line");
    msg
}

/// The trainer shares these across threads.
#[test]
fn types_are_send_and_sync() {
    fn check<T: Send + Sync + Clone>() {}
    check::<data::Tokenizer>();
    check::<data::Tokens>();
    check::<data::Dataset>();
    check::<data::DataError>();
}
