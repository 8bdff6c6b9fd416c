//! kiln's data crate: tokenizers (byte, char, GPT-2, any Hugging Face `tokenizer.json`, trained byte-level BPE), token storage
//! (in memory or memory-mapped), dataset loading from text / `.bin` / `.npy` / prepared shard
//! directories, `prepare`, and the default corpus (the Rust books shipped with rustup).
//!
//! Architecture invariant: nothing here knows about models, tensors or ranks; a dataset is two
//! read-only token streams plus the tokenizer that produced them.

mod corpus;
mod dataset;
mod docs;
mod error;
mod hf;
mod npy;
mod parquet;
pub mod shard;
pub mod store;
mod template;
mod tokenizer;
mod tokens;

pub use docs::{read_docs, Doc, DocFormat, DocOpts, FileKind};
pub use hf::{train_bpe, HfTokenizer, TokConfig, HF_CHAT_TEMPLATE_FILE, HF_TOKENIZER_CONFIG_FILE};
pub use store::{DocIndex, Split};
pub use template::ChatTemplate;
pub use corpus::{default_corpus, default_corpus_files, strip_html, DEFAULT_BOOKS};
pub use dataset::{is_token_file, prepared_format, load, load_default_corpus, load_docs, load_token_files, load_with, prepare, prepare_with, split_at_document, Dataset, PrepareReport, Progress, TokenizerChoice};
pub use error::DataError;
pub use npy::read_npy;
pub use shard::{read_bin, read_shard, write_bin, write_shard, write_shard_tokens};
pub use tokenizer::{CharVocab, Encoded, Gpt2, Tokenizer, HF_TOKENIZER_FILE, KILN_TOKENIZER_FILE, SEPARATOR};
pub use tokens::Tokens;
