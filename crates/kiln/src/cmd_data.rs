//! `kiln data prepare | inspect` and `kiln tokenizer train | encode | decode`.

use crate::error::{KilnError, Result};
use clap::Subcommand;
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum DataCmd {
    /// Tokenize text, jsonl(.gz/.zst) or parquet documents in parallel into memory-mapped
    /// token shards with document boundaries (and SFT loss masks) and a train/val split.
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
        /// The JSON field / parquet column holding a text document.
        #[arg(long, default_value = "text")]
        text_field: String,
        /// text, chat (`messages`, rendered by the tokenizer's chat template) or
        /// prompt_completion.
        #[arg(long, default_value = "text")]
        format: String,
        /// No progress bar.
        #[arg(long)]
        quiet: bool,
    },
    /// Print a prepared directory's first documents' ids, one {"doc", "split", "ids"} JSON line
    /// each (with "loss_mask" when it has one).
    Inspect {
        dir: PathBuf,
        #[arg(long, default_value_t = 3)]
        docs: usize,
        /// train or val.
        #[arg(long, default_value = "train")]
        split: String,
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
        DataCmd::Prepare { input, tokenizer, out, val_fraction, text_field, format, quiet } => {
            let format = <crate::config::Format as plan::policy::Names>::parse(&format).map_err(|m| KilnError::User(format!("--format: {m}")))?.0;
            let opts = data::DocOpts { text_field, format };
            let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
                let b = indicatif::ProgressBar::new(0);
                b.set_style(indicatif::ProgressStyle::with_template("{bar:30.cyan/blue} {bytes}/{total_bytes} {binary_bytes_per_sec} | {msg} | ETA {eta}").unwrap().progress_chars("=> "));
                b
            });
            let started = std::time::Instant::now();
            let mut last = 0.0;
            let rep = data::prepare_with(&input, &tokenizer, &out, val_fraction, &opts, &mut |p| {
                match &bar {
                    Some(b) => {
                        b.set_length(p.total_bytes);
                        b.set_position(p.bytes);
                        b.set_message(format!("{} documents", p.docs));
                    }
                    None if !quiet => {
                        // Not a terminal: a plain line every 10 s.
                        let s = started.elapsed().as_secs_f64();
                        if s - last >= 10.0 {
                            last = s;
                            let rate = p.bytes as f64 / s.max(1e-9);
                            let eta = (p.total_bytes.saturating_sub(p.bytes)) as f64 / rate.max(1.0);
                            eprintln!("prepare: {} documents, {:.1} MB of {:.1} MB, {:.1} MB/s, ETA {}", p.docs, p.bytes as f64 / 1e6, p.total_bytes as f64 / 1e6, rate / 1e6, crate::progress::fmt_duration(eta));
                        }
                    }
                    None => {}
                }
            });
            if let Some(b) = &bar {
                b.finish_and_clear();
            }
            let rep = rep?;
            let s = started.elapsed().as_secs_f64();
            println!("{} -> {} ({} train / {} val tokens, {:.1} s)", rep.description, rep.out.display(), rep.train_tokens, rep.val_tokens, s);
            Ok(())
        }
        DataCmd::Inspect { dir, docs, split } => {
            let ds = data::load_docs(std::slice::from_ref(&dir), data::TokenizerChoice::Spec("auto"), 0.0, &data::DocOpts::default())?;
            let s = match split.as_str() {
                "train" => &ds.train,
                "val" => &ds.val,
                x => return Err(KilnError::User(format!("--split must be train or val, got `{x}`"))),
            };
            for d in 0..docs.min(s.docs.len()) {
                let r = s.docs.range(d);
                let mut ids = vec![0u32; r.len()];
                s.tokens.copy_to(r.start, &mut ids);
                let mut line = serde_json::json!({"doc": d, "split": split, "ids": ids});
                if let Some(m) = &s.mask {
                    let mut v = vec![0u32; r.len()];
                    m.copy_to(r.start, &mut v);
                    line["loss_mask"] = serde_json::json!(v);
                }
                println!("{line}");
            }
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
