//! The data crate's one integration-test binary.

// `&[p.clone()]` reads better than `std::slice::from_ref(&p)` in tests.
#![allow(clippy::cloned_ref_to_slice_refs)]

mod bpe;
mod corpus;
mod dataset;
mod files;
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

/// tinyshakespeare from the shared folder, or `None` (with a note) when it is not there.
pub fn shakespeare() -> Option<String> {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data/tinyshakespeare.txt");
    match std::fs::read_to_string(p) {
        Ok(s) => Some(s),
        Err(e) => {
            eprintln!("note: skipping, {p} not readable: {e}");
            None
        }
    }
}

pub fn shakespeare_path() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data/tinyshakespeare.txt"))
}

/// Some English text for training when tinyshakespeare is missing: deterministic, varied.
pub fn sample_text(bytes: usize) -> String {
    if let Some(s) = shakespeare() {
        let mut end = bytes.min(s.len());
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        return s[..end].to_string();
    }
    let words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "runs", "away", "from", "it's", "42", "times,", "again!"];
    let mut out = String::new();
    let mut x: u64 = 12345;
    while out.len() < bytes {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        out.push_str(words[(x >> 33) as usize % words.len()]);
        out.push(if (x >> 20).is_multiple_of(11) { '\n' } else { ' ' });
    }
    out
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
