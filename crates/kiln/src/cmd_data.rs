//! `kiln data prepare` and `kiln tokenizer train | encode | decode`.

use crate::error::{KilnError, Result};
use clap::Subcommand;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum DataCmd {
    /// Tokenize inputs into memory-mapped token shards with a train/val split.
    Prepare {
        #[arg(long, required = true)]
        input: Vec<PathBuf>,
        /// byte, char, gpt2, bpe:N (trained on the input), a Hugging Face tokenizer.json or a
        /// directory holding one
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
    /// Train a byte-level BPE (GPT-2's pre-tokenizer, `<|endoftext|>` as id 0) on text files and
    /// write it as a Hugging Face tokenizer.json.
    Train {
        #[arg(long, required = true)]
        input: Vec<PathBuf>,
        #[arg(long, default_value_t = 4096)]
        vocab_size: usize,
        #[arg(long)]
        out: PathBuf,
    },
    /// Print the ids of each text: one {"ids": [...]} line per --text / --file, in order.
    Encode {
        /// byte, char (needs --file: its vocabulary), gpt2, a tokenizer.json or a directory holding one.
        #[arg(long)]
        tokenizer: String,
        #[command(flatten)]
        input: TextInput,
    },
    /// Print the text of each list of ids: one {"text": "..."} line per --ids, in order.
    Decode {
        #[arg(long)]
        tokenizer: String,
        /// Comma- or space-separated ids, or a JSON list (`[1, 2]`, `{"ids": [1, 2]}`).
        #[arg(long, required = true)]
        ids: Vec<String>,
    },
}

#[derive(clap::Args)]
#[group(required = true, multiple = true)]
pub struct TextInput {
    #[arg(long)]
    text: Vec<String>,
    /// A UTF-8 file, encoded as a whole (after every --text).
    #[arg(long)]
    file: Vec<PathBuf>,
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
                text.push_str(&read_text(p)?);
                text.push_str("\n\n");
            }
            let tok = data::train_bpe(&text, vocab_size, &["<|endoftext|>"])?;
            let tok = data::Tokenizer::Hf(tok);
            tok.save(&out)?;
            println!("trained a byte-level BPE tokenizer with {} tokens on {} bytes: {}", tok.vocab_size(), text.len(), out.display());
            Ok(())
        }
        TokenizerCmd::Encode { tokenizer, input } => {
            let mut texts = input.text;
            for p in &input.file {
                texts.push(read_text(p)?);
            }
            // `char` builds its vocabulary from what it is asked to encode.
            let tok = data::Tokenizer::from_spec(&tokenizer, Some(&texts.concat()))?;
            for t in &texts {
                println!("{}", serde_json::json!({ "ids": tok.encode(t)? }));
            }
            Ok(())
        }
        TokenizerCmd::Decode { tokenizer, ids } => {
            let lists = ids.iter().map(|s| parse_ids(s)).collect::<Result<Vec<_>>>()?;
            let tok = data::Tokenizer::from_spec(&tokenizer, None)?;
            for l in &lists {
                println!("{}", serde_json::json!({ "text": tok.decode(l) }));
            }
            Ok(())
        }
    }
}

fn read_text(p: &std::path::Path) -> Result<String> {
    std::fs::read_to_string(p).map_err(|e| KilnError::User(format!("{}: cannot read as UTF-8 text: {e}", p.display())))
}

/// `--ids`: `1,2 3`, `[1, 2]` or `{"ids": [1, 2]}`.
fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let bad = |x: &str| KilnError::User(format!("--ids: `{x}` is not a token id (expected e.g. 15496,995 or [15496, 995])"));
    let t = s.trim();
    if t.starts_with('[') || t.starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(t).map_err(|_| bad(t))?;
        let list = v.get("ids").unwrap_or(&v).as_array().ok_or_else(|| bad(t))?;
        return list.iter().map(|x| x.as_u64().filter(|&n| n <= u32::MAX as u64).map(|n| n as u32).ok_or_else(|| bad(&x.to_string()))).collect();
    }
    t.split(|c: char| c == ',' || c.is_whitespace()).filter(|x| !x.is_empty()).map(|x| x.parse::<u32>().map_err(|_| bad(x))).collect()
}
