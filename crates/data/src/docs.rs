//! Documents: reading a corpus file as a stream of documents. Plain text is one document per
//! file; `.jsonl` (also `.jsonl.gz`, `.jsonl.zst`) one per line; `.parquet` one per row (a
//! Hugging Face datasets `data/*.parquet` directory is a directory of such files). What a
//! document holds depends on the [`DocFormat`]: a text field, a chat (`messages`), or a
//! `prompt`/`completion` pair. Files are read in batches, so a corpus is never held in memory.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::Value;

use crate::error::DataError;

/// What a document is made of (`data.format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DocFormat {
    /// Pretraining text: every token carries loss.
    #[default]
    Text,
    /// `messages: [{role, content}, ...]`, rendered by the tokenizer's chat template; the loss
    /// is on the assistant turns only.
    Chat,
    /// `prompt` and `completion` strings; the loss is on the completion (and the EOS) only.
    PromptCompletion,
    /// Preference pairs in TRL's form: `chosen` and `rejected` completions of one `prompt`, as
    /// strings (with a `prompt` string) or as chat messages (with a `prompt` of messages, or
    /// without one: the messages the two conversations share are the prompt). Each becomes
    /// two documents, chosen then rejected, with loss on the completion only.
    Preference,
    /// Prompts to complete (reinforcement learning): a `prompt` string or messages, and the
    /// row's other fields (a reference answer) for the rewards. Not tokenized into a stream.
    Prompt,
}

impl DocFormat {
    pub const NAMES: [(&'static str, DocFormat); 5] =
        [("text", DocFormat::Text), ("chat", DocFormat::Chat), ("prompt_completion", DocFormat::PromptCompletion), ("preference", DocFormat::Preference), ("prompt", DocFormat::Prompt)];

    pub fn name(self) -> &'static str {
        DocFormat::NAMES.iter().find(|(_, f)| *f == self).map(|(n, _)| *n).expect("every format is named")
    }

    pub fn from_name(s: &str) -> Option<DocFormat> {
        DocFormat::NAMES.iter().find(|(n, _)| *n == s).map(|(_, f)| *f)
    }

    /// Whether documents of this format carry a loss mask (supervised fine-tuning).
    pub fn masked(self) -> bool {
        self != DocFormat::Text
    }
}

/// How documents are read from structured files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DocOpts {
    /// The JSON field / parquet column holding a text document (`data.text_field`).
    pub text_field: String,
    pub format: DocFormat,
}

impl Default for DocOpts {
    fn default() -> DocOpts {
        DocOpts { text_field: "text".into(), format: DocFormat::Text }
    }
}

/// One document, as read.
#[derive(Clone, Debug, PartialEq)]
pub enum Doc {
    Text(String),
    /// The `messages` array (each an object with string `role` and `content`, other fields kept
    /// for the template).
    Chat(Value),
    Pair { prompt: String, completion: String },
    /// A chat whose loss is on the assistant turns from message `from` on (a preference
    /// completion after its prompt's messages).
    ChatFrom { messages: Value, from: usize },
    /// A preference pair: two documents of one prompt, the chosen and the rejected completion.
    Preference { chosen: Box<Doc>, rejected: Box<Doc> },
    /// A prompt to complete: its row, whose `prompt` is a string or a list of messages.
    Prompt(Value),
}

impl Doc {
    /// The document's own text (for building a `char` / `bpe:N` vocabulary from the corpus).
    pub fn text(&self) -> String {
        match self {
            Doc::Text(t) => t.clone(),
            Doc::Pair { prompt, completion } => format!("{prompt}{completion}"),
            Doc::Chat(m) | Doc::ChatFrom { messages: m, .. } => m.as_array().map(|a| a.iter().filter_map(|x| x["content"].as_str()).collect::<Vec<_>>().join("\n")).unwrap_or_default(),
            Doc::Preference { chosen, rejected } => format!("{}\n{}", chosen.text(), rejected.text()),
            Doc::Prompt(row) => row["prompt"].as_str().map(str::to_string).unwrap_or_else(|| row["prompt"].to_string()),
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        match self {
            Doc::Text(t) => t.len(),
            Doc::Pair { prompt, completion } => prompt.len() + completion.len(),
            Doc::Chat(m) | Doc::ChatFrom { messages: m, .. } => m.to_string().len(),
            Doc::Preference { chosen, rejected } => chosen.bytes() + rejected.bytes(),
            Doc::Prompt(row) => row.to_string().len(),
        }
    }
}

/// The kind of a corpus file, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    Text,
    Jsonl(Compression),
    Parquet,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl FileKind {
    pub fn of(path: &Path) -> FileKind {
        let name = path.file_name().map(|n| n.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
        if name.ends_with(".jsonl") || name.ends_with(".ndjson") {
            FileKind::Jsonl(Compression::None)
        } else if name.ends_with(".jsonl.gz") || name.ends_with(".ndjson.gz") {
            FileKind::Jsonl(Compression::Gzip)
        } else if name.ends_with(".jsonl.zst") || name.ends_with(".ndjson.zst") {
            FileKind::Jsonl(Compression::Zstd)
        } else if name.ends_with(".parquet") {
            FileKind::Parquet
        } else {
            FileKind::Text
        }
    }
}

/// Counts the bytes read from a file (for progress: MB/s and ETA over the input's size on disk).
pub(crate) struct Counting<R> {
    inner: R,
    read: Arc<AtomicU64>,
}

pub(crate) type CountingFile = Counting<File>;

impl<R> Counting<R> {
    /// The reader and its counter, for readers that count by other means (parquet: row groups).
    pub(crate) fn into_parts(self) -> (R, Arc<AtomicU64>) {
        (self.inner, self.read)
    }
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Documents per batch handed to the callback, and the text bytes that end a batch early.
pub const BATCH_DOCS: usize = 1024;
pub const BATCH_BYTES: usize = 2 << 20;

/// Reads the documents of `path` in batches of up to [`BATCH_DOCS`] documents (or about
/// [`BATCH_BYTES`] of text), calling `f` with each batch in file order; `read` counts the file
/// bytes consumed. An error names the file and the line (jsonl) or row (parquet).
pub fn read_docs(path: &Path, opts: &DocOpts, read: &Arc<AtomicU64>, f: &mut dyn FnMut(Vec<Doc>) -> Result<(), DataError>) -> Result<(), DataError> {
    let open = || -> Result<Counting<File>, DataError> {
        let file = File::open(path).map_err(|e| DataError::io(path, "cannot open", e))?;
        Ok(Counting { inner: file, read: read.clone() })
    };
    match FileKind::of(path) {
        FileKind::Text => {
            if opts.format != DocFormat::Text {
                return Err(DataError::at(path, format!("data.format = \"{}\" needs .jsonl or .parquet files, not plain text", opts.format.name())));
            }
            let mut bytes = Vec::new();
            open()?.read_to_end(&mut bytes).map_err(|e| DataError::io(path, "cannot read", e))?;
            let text = String::from_utf8(bytes).map_err(|e| {
                DataError::at(path, format!("not UTF-8 text (invalid byte at offset {}); token files must end in .bin, .npy or .tok", e.utf8_error().valid_up_to()))
            })?;
            f(vec![Doc::Text(text)])
        }
        FileKind::Jsonl(c) => {
            let raw = open()?;
            let reader: Box<dyn Read> = match c {
                Compression::None => Box::new(raw),
                Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(raw)),
                Compression::Zstd => Box::new(zstd::stream::read::Decoder::new(raw).map_err(|e| DataError::io(path, "cannot start zstd decoding", e))?),
            };
            read_jsonl(path, BufReader::with_capacity(1 << 20, reader), opts, f)
        }
        FileKind::Parquet => crate::parquet::read_parquet(path, open()?, opts, f),
    }
}

fn read_jsonl(path: &Path, mut r: impl BufRead, opts: &DocOpts, f: &mut dyn FnMut(Vec<Doc>) -> Result<(), DataError>) -> Result<(), DataError> {
    let mut line = Vec::new();
    let mut batch = Vec::new();
    let mut bytes = 0;
    let mut n = 0u64;
    loop {
        line.clear();
        let got = r.read_until(b'\n', &mut line).map_err(|e| DataError::io(path, &format!("cannot read line {}", n + 1), e))?;
        if got == 0 {
            break;
        }
        n += 1;
        let s = std::str::from_utf8(&line).map_err(|e| DataError::at(path, format!("line {n}: not UTF-8 (invalid byte at column {})", e.valid_up_to() + 1)))?;
        let s = s.trim();
        if s.is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(s).map_err(|e| DataError::at(path, format!("line {n}: not valid JSON: {e}")))?;
        let doc = doc_of(&v, opts).map_err(|m| DataError::at(path, format!("line {n}: {m}")))?;
        bytes += doc.bytes();
        batch.push(doc);
        if batch.len() >= BATCH_DOCS || bytes >= BATCH_BYTES {
            f(std::mem::take(&mut batch))?;
            bytes = 0;
        }
    }
    if !batch.is_empty() {
        f(batch)?;
    }
    Ok(())
}

/// A JSON name for a value's type, for error messages.
fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn string_field(v: &Value, key: &str) -> Result<String, String> {
    let Some(obj) = v.as_object() else { return Err(format!("is {}, not a JSON object", kind_of(v))) };
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(x) => Err(format!("field `{key}` is {}, not a string", kind_of(x))),
        None => {
            let keys: Vec<&str> = obj.keys().map(|k| k.as_str()).take(8).collect();
            let hint = if obj.contains_key("messages") || obj.contains_key("conversations") {
                "a chat: pass --format chat (data.format = \"chat\")"
            } else if obj.contains_key("prompt") && obj.contains_key("completion") {
                "prompt/completion pairs: pass --format prompt_completion"
            } else {
                "set data.text_field or data.format"
            };
            Err(format!("no field `{key}` (fields: {}); {hint}", if keys.is_empty() { "none".into() } else { keys.join(", ") }))
        }
    }
}

/// ShareGPT's `conversations: [{from, value}, ...]` as `messages: [{role, content}, ...]`:
/// `human` is the user, `gpt` the assistant (`system`, `user` and `assistant` as they are).
fn sharegpt(c: &Value) -> Result<Value, String> {
    let list = c.as_array().ok_or_else(|| format!("field `conversations` is {}, not an array", kind_of(c)))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, turn) in list.iter().enumerate() {
        let field = |key: &str| match turn.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(x) => Err(format!("conversations[{i}].{key} is {}, not a string", kind_of(x))),
            None => Err(format!("conversations[{i}] has no `{key}`")),
        };
        let role = match field("from")?.as_str() {
            "human" | "user" => "user",
            "gpt" | "assistant" => "assistant",
            "system" => "system",
            other => return Err(format!("conversations[{i}].from is {other:?}: expected human, gpt or system")),
        };
        out.push(serde_json::json!({"role": role, "content": field("value")?}));
    }
    Ok(Value::Array(out))
}

/// The document a JSON object (a jsonl line, a parquet row) holds under `opts`; the error is
/// the message without its location.
pub(crate) fn doc_of(v: &Value, opts: &DocOpts) -> Result<Doc, String> {
    match opts.format {
        DocFormat::Text => string_field(v, &opts.text_field).map(Doc::Text),
        DocFormat::PromptCompletion => Ok(Doc::Pair { prompt: string_field(v, "prompt")?, completion: string_field(v, "completion")? }),
        DocFormat::Chat => {
            let Some(obj) = v.as_object() else { return Err(format!("is {}, not a JSON object", kind_of(v))) };
            let shared;
            let m = match (obj.get("messages"), obj.get("conversations")) {
                (Some(m), _) => m,
                (None, Some(c)) => {
                    shared = sharegpt(c)?;
                    &shared
                }
                (None, None) => {
                    let keys: Vec<&str> = obj.keys().map(|k| k.as_str()).take(8).collect();
                    return Err(format!("no field `messages` (a chat needs messages: [{{role, content}}, ...], or ShareGPT's conversations: [{{from, value}}, ...]; fields: {})", if keys.is_empty() { "none".into() } else { keys.join(", ") }));
                }
            };
            let list = messages(m, "messages")?;
            if !list.iter().any(|m| m["role"] == "assistant") {
                return Err("no message has role \"assistant\", so nothing would carry loss".into());
            }
            Ok(Doc::Chat(m.clone()))
        }
        DocFormat::Preference => preference_of(v),
        DocFormat::Prompt => {
            match v.get("prompt") {
                Some(Value::String(p)) if p.is_empty() => return Err("field `prompt` is empty".into()),
                Some(Value::String(_)) => {}
                Some(m @ Value::Array(_)) => {
                    messages(m, "prompt")?;
                }
                Some(x) => return Err(format!("field `prompt` is {}, not a string or a list of messages", kind_of(x))),
                None => return Err(string_field(v, "prompt").unwrap_err()),
            }
            Ok(Doc::Prompt(v.clone()))
        }
    }
}

/// The messages of field `key`: a non-empty array of objects with string `role` and `content`.
fn messages<'v>(m: &'v Value, key: &str) -> Result<&'v [Value], String> {
    let list = m.as_array().ok_or_else(|| format!("field `{key}` is {}, not an array", kind_of(m)))?;
    if list.is_empty() {
        return Err(format!("field `{key}` is empty"));
    }
    for (i, msg) in list.iter().enumerate() {
        for k in ["role", "content"] {
            match msg.get(k) {
                Some(Value::String(_)) => {}
                Some(x) => return Err(format!("{key}[{i}].{k} is {}, not a string", kind_of(x))),
                None => return Err(format!("{key}[{i}] has no `{k}`")),
            }
        }
    }
    Ok(list)
}

/// A preference row (TRL's format): `chosen` and `rejected` as strings with a `prompt` string,
/// or as messages, after a `prompt` of messages or (an implicit prompt) sharing their first
/// messages, the prompt.
fn preference_of(v: &Value) -> Result<Doc, String> {
    let Some(obj) = v.as_object() else { return Err(format!("is {}, not a JSON object", kind_of(v))) };
    let field = |key: &str| {
        obj.get(key).ok_or_else(|| {
            let keys: Vec<&str> = obj.keys().map(|k| k.as_str()).take(8).collect();
            format!("no field `{key}` (a preference row needs chosen and rejected, and a prompt; fields: {})", if keys.is_empty() { "none".into() } else { keys.join(", ") })
        })
    };
    let (chosen, rejected) = (field("chosen")?, field("rejected")?);
    match (chosen, rejected) {
        (Value::String(c), Value::String(r)) => {
            let prompt = string_field(v, "prompt")?;
            for (key, text) in [("chosen", c), ("rejected", r)] {
                if text.is_empty() {
                    return Err(format!("field `{key}` is empty"));
                }
            }
            let pair = |completion: &String| Box::new(Doc::Pair { prompt: prompt.clone(), completion: completion.clone() });
            Ok(Doc::Preference { chosen: pair(c), rejected: pair(r) })
        }
        (Value::Array(_), Value::Array(_)) => {
            let (c, r) = (messages(chosen, "chosen")?, messages(rejected, "rejected")?);
            let (prompt, c, r) = match obj.get("prompt") {
                Some(p) => (messages(p, "prompt")?.to_vec(), c, r),
                // The implicit prompt: the messages both conversations begin with.
                None => {
                    let n = c.iter().zip(r).take_while(|(a, b)| a == b).count();
                    (c[..n].to_vec(), &c[n..], &r[n..])
                }
            };
            let side = |key: &str, tail: &[Value]| -> Result<Box<Doc>, String> {
                if !tail.iter().any(|m| m["role"] == "assistant") {
                    return Err(format!("field `{key}` has no assistant message after the prompt, so nothing would carry loss"));
                }
                let all: Vec<Value> = prompt.iter().chain(tail).cloned().collect();
                Ok(Box::new(Doc::ChatFrom { messages: Value::Array(all), from: prompt.len() }))
            };
            Ok(Doc::Preference { chosen: side("chosen", c)?, rejected: side("rejected", r)? })
        }
        (c, r) => Err(format!("fields `chosen` and `rejected` are {} and {}: both strings, or both arrays of messages", kind_of(c), kind_of(r))),
    }
}
