//! `kiln data prepare` and `kiln tokenizer train`.

use crate::error::{KilnError, Result};
use clap::Subcommand;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum DataCmd {
    /// Tokenize inputs into memory-mapped token shards with a train/val split.
    Prepare {
        #[arg(long, required = true)]
        input: Vec<PathBuf>,
        /// byte, char, gpt2, or a tokenizer JSON file
        #[arg(long, default_value = "byte")]
        tokenizer: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0.1)]
        val_fraction: f64,
    },
}

#[derive(Subcommand)]
pub enum TokenizerCmd {
    /// Train a byte-level BPE tokenizer on a corpus.
    Train {
        #[arg(long, required = true)]
        input: Vec<PathBuf>,
        #[arg(long, default_value_t = 4096)]
        vocab_size: usize,
        #[arg(long)]
        out: PathBuf,
    },
}

/// Runs `kiln data …`.
pub fn data_cmd(cmd: DataCmd) -> Result<()> {
    match cmd {
        DataCmd::Prepare { input, tokenizer, out, val_fraction } => {
            let rep = data::prepare(&input, &tokenizer, &out, val_fraction)?;
            println!("{}", rep.description);
            Ok(())
        }
    }
}

/// Runs `kiln tokenizer …`.
pub fn tokenizer_cmd(cmd: TokenizerCmd) -> Result<()> {
    match cmd {
        TokenizerCmd::Train { input, vocab_size, out } => {
            let mut text = String::new();
            for p in &input {
                let s = std::fs::read_to_string(p).map_err(|e| KilnError::User(format!("{}: cannot read: {e}", p.display())))?;
                text.push_str(&s);
                text.push_str("\n\n");
            }
            let tok = data::train_bpe(&text, vocab_size)?;
            tok.save(&out)?;
            println!("trained a byte-level BPE tokenizer with {} tokens on {} bytes: {}", tok.vocab_size(), text.len(), out.display());
            Ok(())
        }
    }
}
