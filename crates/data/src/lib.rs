//! kiln's data crate: tokenizers (byte, char, GPT-2, trained byte-level BPE), token storage
//! (in memory or memory-mapped), dataset loading from text / `.bin` / `.npy` / prepared shard
//! directories, `prepare`, and the default corpus (the Rust books shipped with rustup).
//!
//! Architecture invariant: nothing here knows about models, tensors or ranks; a dataset is two
//! read-only token streams plus the tokenizer that produced them.

mod bpe;
mod corpus;
mod dataset;
mod error;
mod npy;
pub mod shard;
mod tokenizer;
mod tokens;

pub use bpe::{pre_split, train_bpe, train_bpe_with_specials, Bpe, MAX_PIECE_BYTES};
pub use corpus::{default_corpus, default_corpus_files, strip_html, DEFAULT_BOOKS};
pub use dataset::{load, load_with, prepare, Dataset, PrepareReport};
pub use error::DataError;
pub use npy::read_npy;
pub use shard::{read_bin, read_shard, write_bin, write_shard, write_shard_tokens};
pub use tokenizer::{CharVocab, Gpt2, Tokenizer};
pub use tokens::Tokens;
