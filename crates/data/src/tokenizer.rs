//! The tokenizer enum: kiln's own `byte`, `char` and `gpt2` (tiktoken's r50k_base), and any
//! Hugging Face `tokenizer.json` ([`HfTokenizer`]: a model's own, or a byte-level BPE trained
//! with `bpe:N`).
//!
//! Every tokenizer serialises to JSON, so a run directory, a checkpoint or a prepared dataset
//! stores the exact tokenizer it was built with: a Hugging Face tokenizer as its
//! `tokenizer.json`, kiln's own kinds as a self-describing object (`{"kind":"char","chars":"..."}`)
//! in `kiln-tokenizer.json` ([`Tokenizer::file_name`]), so no file named `tokenizer.json` is
//! ever in a format transformers cannot read.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::DataError;
use crate::hf::HfTokenizer;

/// GPT-2's vocabulary size: 50000 merges + 256 bytes + `<|endoftext|>`.
pub const GPT2_VOCAB: usize = 50257;

/// Character-level vocabulary: the sorted unique characters of a corpus (nanoGPT's
/// `shakespeare_char/prepare.py`: `chars = sorted(list(set(data)))`).
#[derive(Clone, PartialEq, Eq)]
pub struct CharVocab {
    chars: Vec<char>,
    index: HashMap<char, u32>,
}

impl CharVocab {
    /// Sorted unique characters of `text` (by code point, as Python sorts strings).
    pub fn from_text(text: &str) -> CharVocab {
        let mut seen = std::collections::BTreeSet::new();
        for c in text.chars() {
            seen.insert(c);
        }
        CharVocab::from_chars(seen.into_iter().collect())
    }

    fn from_chars(chars: Vec<char>) -> CharVocab {
        let index = chars.iter().enumerate().map(|(i, &c)| (c, i as u32)).collect();
        CharVocab { chars, index }
    }

    pub fn chars(&self) -> &[char] {
        &self.chars
    }

    pub fn id(&self, c: char) -> Option<u32> {
        self.index.get(&c).copied()
    }

    /// The first character of `text` that is not in the vocabulary, with its byte offset.
    pub fn first_unknown(&self, text: &str) -> Option<(usize, char)> {
        text.char_indices().find(|(_, c)| !self.index.contains_key(c))
    }
}

impl fmt::Debug for CharVocab {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CharVocab({} chars)", self.chars.len())
    }
}

/// GPT-2's BPE (tiktoken's `r50k_base`, embedded in tiktoken-rs), built once per process.
#[derive(Clone)]
pub struct Gpt2 {
    bpe: &'static tiktoken_rs::CoreBPE,
}

impl Gpt2 {
    pub fn new() -> Gpt2 {
        Gpt2 { bpe: tiktoken_rs::r50k_base_singleton() }
    }

    pub fn core(&self) -> &'static tiktoken_rs::CoreBPE {
        self.bpe
    }
    /// The byte-level vocabulary (each token's bytes through [`byte_chars`], id = rank) and
    /// merges of the r50k ranks, as transformers' `TikTokenConverter` builds them: for each
    /// token in rank order, every split into two tokens, ordered by the ranks of the left then
    /// the right part.
    fn hf_vocab_and_merges(&self) -> (Vec<(String, u32)>, Vec<[String; 2]>) {
        let n = GPT2_VOCAB as u32 - 1;
        let tokens: Vec<Vec<u8>> = (0..n).map(|r| self.bpe.decode_bytes(&[r]).expect("every r50k rank decodes")).collect();
        let rank: HashMap<&[u8], u32> = tokens.iter().enumerate().map(|(r, t)| (&t[..], r as u32)).collect();
        let chars = byte_chars();
        let s = |b: &[u8]| -> String { b.iter().map(|&x| chars[x as usize]).collect() };
        let mut merges = Vec::new();
        for t in &tokens {
            let mut local: Vec<(u32, u32, usize)> = (1..t.len()).filter_map(|i| Some((*rank.get(&t[..i])?, *rank.get(&t[i..])?, i))).collect();
            local.sort_unstable();
            merges.extend(local.into_iter().map(|(_, _, i)| [s(&t[..i]), s(&t[i..])]));
        }
        (tokens.iter().enumerate().map(|(r, t)| (s(t), r as u32)).collect(), merges)
    }
}

impl Default for Gpt2 {
    fn default() -> Self {
        Gpt2::new()
    }
}

impl fmt::Debug for Gpt2 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Gpt2(r50k_base)")
    }
}

/// The parts of a `tokenizer.json` that [`Tokenizer::to_hf`] fills for kiln's own kinds (a BPE
/// model in every case).
struct HfForm {
    vocab: Vec<(String, u32)>,
    merges: Vec<[String; 2]>,
    pre: serde_json::Value,
    decoder: serde_json::Value,
    added: Vec<(u32, &'static str)>,
    ignore_merges: bool,
}

/// GPT-2's pre-tokenizer split (as transformers writes it for r50k: tiktoken's pattern without
/// possessive quantifiers, which the `tokenizers` regex engine lacks).
const GPT2_SPLIT: &str = r"'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The byte-level pre-tokenizer and decoder (bytes as GPT-2's printable characters,
/// [`byte_chars`]), without GPT-2's own split.
fn byte_level() -> serde_json::Value {
    serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false})
}

/// GPT-2's byte → character map (`bytes_to_unicode` of openai/gpt-2's `encoder.py`): printable
/// Latin-1 bytes are themselves, the other 68 become U+0100 onwards in byte order.
pub fn byte_chars() -> [char; 256] {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut out = ['\0'; 256];
    let mut n = 0;
    for b in 0..=255u8 {
        out[b as usize] = if printable(b) {
            b as char
        } else {
            n += 1;
            char::from_u32(255 + n).expect("U+0100..U+0143 are characters")
        };
    }
    out
}

#[derive(Clone, Debug)]
pub enum Tokenizer {
    /// UTF-8 bytes, vocab 256.
    Byte,
    /// One id per character of a fixed vocabulary.
    Char(CharVocab),
    /// GPT-2's BPE, vocab 50257; `<|endoftext|>` in the text encodes to 50256.
    Gpt2(Gpt2),
    /// A Hugging Face `tokenizer.json`.
    Hf(HfTokenizer),
}

/// The file a Hugging Face tokenizer is stored in (and read from in a model directory).
pub const HF_TOKENIZER_FILE: &str = "tokenizer.json";
/// The file kiln's own tokenizer kinds are stored in.
pub const KILN_TOKENIZER_FILE: &str = "kiln-tokenizer.json";

impl PartialEq for Tokenizer {
    fn eq(&self, other: &Tokenizer) -> bool {
        match (self, other) {
            (Tokenizer::Byte, Tokenizer::Byte) | (Tokenizer::Gpt2(_), Tokenizer::Gpt2(_)) => true,
            (Tokenizer::Char(a), Tokenizer::Char(b)) => a == b,
            (Tokenizer::Hf(a), Tokenizer::Hf(b)) => a == b,
            _ => false,
        }
    }
}

/// The JSON form, tagged by `kind`.
#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
enum TokenizerJson {
    Byte,
    Char { chars: String },
    Gpt2,
}

impl Tokenizer {
    /// `spec`: `"byte"` | `"char"` | `"gpt2"` | `"bpe:N"` | a tokenizer file (a Hugging Face
    /// `tokenizer.json`, or kiln's own JSON) | a directory holding one (a Hugging Face model, a
    /// prepared dataset, a run directory). `char` builds its vocabulary from `corpus`, and
    /// `bpe:N` trains a byte-level BPE of vocab `N` on it ([`crate::train_bpe`]); both fail
    /// without one.
    pub fn from_spec(spec: &str, corpus: Option<&str>) -> Result<Tokenizer, DataError> {
        match spec {
            "byte" => Ok(Tokenizer::Byte),
            "gpt2" => Ok(Tokenizer::Gpt2(Gpt2::new())),
            "char" => match corpus {
                Some(text) if !text.is_empty() => Ok(Tokenizer::Char(CharVocab::from_text(text))),
                Some(_) => Err(DataError::new("tokenizer \"char\": the corpus text is empty, so there is no vocabulary to build")),
                None => Err(DataError::new("tokenizer \"char\" needs the corpus text to build its vocabulary (token files cannot provide it)")),
            },
            _ if spec.starts_with("bpe:") => {
                let n = Tokenizer::bpe_spec_vocab(spec)?;
                match corpus {
                    Some(text) if !text.is_empty() => crate::hf::train_bpe(text, n, &["<|endoftext|>"]).map(Tokenizer::Hf),
                    _ => Err(DataError::new(format!("tokenizer \"{spec}\" trains on the corpus text, and there is none"))),
                }
            }
            path => {
                let p = Path::new(path);
                if p.is_dir() {
                    Tokenizer::find_in(p)?.ok_or_else(|| DataError::at(p, format!("holds no tokenizer ({HF_TOKENIZER_FILE} or {KILN_TOKENIZER_FILE})")))
                } else if p.is_file() {
                    Tokenizer::load(p)
                } else {
                    Err(DataError::new(format!(
                        "unknown tokenizer \"{path}\": expected byte, char, gpt2, bpe:N, or a tokenizer.json file or a directory holding one (no such file)"
                    )))
                }
            }
        }
    }

    /// Whether `spec` builds its vocabulary from the corpus text (`char`, `bpe:N`).
    pub fn spec_needs_corpus(spec: &str) -> bool {
        spec == "char" || spec.starts_with("bpe:")
    }

    /// `N` of a `bpe:N` spec.
    fn bpe_spec_vocab(spec: &str) -> Result<usize, DataError> {
        let n = spec.strip_prefix("bpe:").unwrap_or(spec);
        n.parse::<usize>().map_err(|_| {
            DataError::new(format!("tokenizer \"{spec}\": {n:?} is not a vocab size (write e.g. bpe:4096)"))
        })
    }

    /// Whether this tokenizer is what the corpus-built `spec` (`char`, `bpe:N`) would describe.
    pub(crate) fn matches_corpus_spec(&self, spec: &str) -> bool {
        match self {
            Tokenizer::Char(_) => spec == "char",
            Tokenizer::Hf(_) => Tokenizer::bpe_spec_vocab(spec).is_ok_and(|n| n == self.vocab_size()),
            _ => false,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Byte => 256,
            Tokenizer::Char(v) => v.chars.len(),
            Tokenizer::Gpt2(_) => GPT2_VOCAB,
            Tokenizer::Hf(h) => h.vocab_size(),
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Tokenizer::Byte => "byte",
            Tokenizer::Char(_) => "char",
            Tokenizer::Gpt2(_) => "gpt2",
            Tokenizer::Hf(_) => "hf",
        }
    }

    /// Encodes `text` (no special tokens added; special-token text such as `<|endoftext|>`
    /// becomes its id). For `char`, characters outside the vocabulary are dropped (use
    /// [`CharVocab::first_unknown`] to check first). kiln's own kinds encode any text; a
    /// Hugging Face tokenizer can fail (say, a WordPiece model without an unknown token).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        Ok(match self {
            Tokenizer::Byte => text.bytes().map(u32::from).collect(),
            Tokenizer::Char(v) => text.chars().filter_map(|c| v.id(c)).collect(),
            Tokenizer::Gpt2(g) => g.bpe.encode_with_special_tokens(text),
            Tokenizer::Hf(h) => h.encode(text)?,
        })
    }

    /// [`Tokenizer::decode`] without the special tokens (a Hugging Face tokenizer's, GPT-2's
    /// `<|endoftext|>`; kiln's byte and char vocabularies have none).
    pub fn decode_skipping_special(&self, ids: &[u32]) -> String {
        match self {
            Tokenizer::Hf(h) => h.decode_with(ids, true),
            Tokenizer::Gpt2(_) => self.decode(&ids.iter().copied().filter(|&i| Some(i) != self.eos_id()).collect::<Vec<_>>()),
            _ => self.decode(ids),
        }
    }

    /// Decodes `ids`; invalid UTF-8 and unknown ids become U+FFFD. Never panics.
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Tokenizer::Byte => {
                let mut bytes = Vec::with_capacity(ids.len());
                let mut out = String::new();
                for &id in ids {
                    if id < 256 {
                        bytes.push(id as u8);
                    } else {
                        out.push_str(&String::from_utf8_lossy(&bytes));
                        bytes.clear();
                        out.push(char::REPLACEMENT_CHARACTER);
                    }
                }
                out.push_str(&String::from_utf8_lossy(&bytes));
                out
            }
            Tokenizer::Char(v) => ids
                .iter()
                .map(|&id| v.chars.get(id as usize).copied().unwrap_or(char::REPLACEMENT_CHARACTER))
                .collect(),
            Tokenizer::Gpt2(g) => {
                if let Ok(b) = g.bpe.decode_bytes(ids) {
                    return String::from_utf8_lossy(&b).into_owned();
                }
                // Some id is unknown: go token by token.
                let mut bytes = Vec::with_capacity(ids.len() * 4);
                let mut out = String::new();
                for &id in ids {
                    match g.bpe.decode_bytes(&[id]) {
                        Ok(b) => bytes.extend_from_slice(&b),
                        Err(_) => {
                            out.push_str(&String::from_utf8_lossy(&bytes));
                            bytes.clear();
                            out.push(char::REPLACEMENT_CHARACTER);
                        }
                    }
                }
                out.push_str(&String::from_utf8_lossy(&bytes));
                out
            }
            Tokenizer::Hf(h) => h.decode(ids),
        }
    }

    /// The Hugging Face form of this tokenizer (what `kiln export` writes as `tokenizer.json`),
    /// giving the same ids for every text and decoding them to the same string:
    /// - `byte`: a byte-level BPE without merges, each byte's id its value;
    /// - `char`: a BPE over the vocabulary's characters without merges or pre-tokenizer (a
    ///   character outside the vocabulary is dropped, as `encode` drops it), decoded by `Fuse`;
    /// - `gpt2`: tiktoken's r50k ranks as a byte-level BPE, converted as transformers'
    ///   `TikTokenConverter` does (every split of a token into two tokens is a merge, ordered by
    ///   the token's rank), with GPT-2's split pattern and `<|endoftext|>` as a special token.
    pub fn to_hf(&self) -> HfTokenizer {
        let f = match self {
            Tokenizer::Hf(h) => return h.clone(),
            Tokenizer::Byte => {
                let map = byte_chars();
                HfForm {
                    vocab: (0..=255u8).map(|b| (map[b as usize].to_string(), b as u32)).collect(),
                    merges: Vec::new(),
                    pre: byte_level(),
                    decoder: byte_level(),
                    added: Vec::new(),
                    ignore_merges: false,
                }
            }
            Tokenizer::Char(v) => HfForm {
                vocab: v.chars.iter().enumerate().map(|(i, c)| (c.to_string(), i as u32)).collect(),
                merges: Vec::new(),
                pre: serde_json::Value::Null,
                decoder: serde_json::json!({"type": "Fuse"}),
                added: Vec::new(),
                ignore_merges: false,
            },
            Tokenizer::Gpt2(g) => {
                let (vocab, merges) = g.hf_vocab_and_merges();
                HfForm {
                    vocab,
                    merges,
                    pre: serde_json::json!({"type": "Sequence", "pretokenizers": [
                        {"type": "Split", "pattern": {"Regex": GPT2_SPLIT}, "behavior": "Isolated", "invert": false},
                        byte_level(),
                    ]}),
                    decoder: serde_json::json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
                    added: vec![(GPT2_VOCAB as u32 - 1, "<|endoftext|>")],
                    ignore_merges: true,
                }
            }
        };
        let HfForm { vocab, merges, pre, decoder, added, ignore_merges } = f;
        let vocab: serde_json::Map<String, serde_json::Value> = vocab.into_iter().map(|(k, id)| (k, id.into())).collect();
        let added: Vec<serde_json::Value> = added
            .into_iter()
            .map(|(id, t)| serde_json::json!({"id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
            .collect();
        let j = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
            "pre_tokenizer": pre, "post_processor": null, "decoder": decoder,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
        });
        let json = serde_json::to_string(&j).expect("tokenizer JSON serialisation cannot fail");
        HfTokenizer::from_json(&json, Path::new("<kiln's tokenizer in Hugging Face form>")).expect("kiln writes a tokenizer.json the tokenizers crate reads")
    }

    /// The JSON form: a Hugging Face tokenizer's `tokenizer.json`, or kiln's self-describing
    /// `{"kind":"byte"}`, `{"kind":"gpt2"}`, `{"kind":"char","chars":"..."}`.
    pub fn to_json(&self) -> String {
        let j = match self {
            Tokenizer::Hf(h) => return h.json().to_string(),
            Tokenizer::Byte => TokenizerJson::Byte,
            Tokenizer::Gpt2(_) => TokenizerJson::Gpt2,
            Tokenizer::Char(v) => TokenizerJson::Char { chars: v.chars.iter().collect() },
        };
        serde_json::to_string(&j).expect("tokenizer JSON serialisation cannot fail")
    }

    /// The file name [`Tokenizer::save_in`] uses: [`HF_TOKENIZER_FILE`] for a Hugging Face
    /// tokenizer, [`KILN_TOKENIZER_FILE`] for kiln's own kinds.
    pub fn file_name(&self) -> &'static str {
        match self {
            Tokenizer::Hf(_) => HF_TOKENIZER_FILE,
            _ => KILN_TOKENIZER_FILE,
        }
    }

    /// [`Tokenizer::file_name`] of the tokenizer whose [`Tokenizer::to_json`] is `json`, without
    /// parsing it (kiln's own form always begins with its `"kind"` tag).
    pub fn file_name_of_json(json: &str) -> &'static str {
        if json.starts_with("{\"kind\"") { KILN_TOKENIZER_FILE } else { HF_TOKENIZER_FILE }
    }

    /// Parses either JSON form of [`Tokenizer::to_json`] (told apart by kiln's leading `"kind"`);
    /// `origin` names the source in errors.
    pub fn from_json(s: &str, origin: &Path) -> Result<Tokenizer, DataError> {
        if Tokenizer::file_name_of_json(s) == HF_TOKENIZER_FILE {
            // Parsed once, by `tokenizers` (a model's file can be megabytes).
            return HfTokenizer::from_json(s, origin).map(Tokenizer::Hf);
        }
        let v: serde_json::Value = serde_json::from_str(s).map_err(|e| DataError::at(origin, format!("not valid JSON: {e}")))?;
        let j: TokenizerJson = serde_json::from_value(v).map_err(|e| DataError::at(origin, format!("not a kiln tokenizer JSON: {e}")))?;
        match j {
            TokenizerJson::Byte => Ok(Tokenizer::Byte),
            TokenizerJson::Gpt2 => Ok(Tokenizer::Gpt2(Gpt2::new())),
            TokenizerJson::Char { chars } => {
                let list: Vec<char> = chars.chars().collect();
                if list.is_empty() {
                    return Err(DataError::at(origin, "char tokenizer has an empty \"chars\""));
                }
                let mut seen = std::collections::HashSet::new();
                for &c in &list {
                    if !seen.insert(c) {
                        return Err(DataError::at(origin, format!("char tokenizer lists {c:?} twice in \"chars\"")));
                    }
                }
                Ok(Tokenizer::Char(CharVocab::from_chars(list)))
            }
        }
    }

    /// Writes the tokenizer to `path`.
    pub fn save(&self, path: &Path) -> Result<(), DataError> {
        let mut text = self.to_json();
        if !text.ends_with('\n') {
            text.push('\n');
        }
        std::fs::write(path, text).map_err(|e| DataError::io(path, "cannot write tokenizer", e))
    }

    /// Writes the tokenizer into directory `dir` under [`Tokenizer::file_name`]; returns the path.
    /// (A Hugging Face tokenizer's `tokenizer_config.json` beside it, when it came with one.)
    pub fn save_in(&self, dir: &Path) -> Result<std::path::PathBuf, DataError> {
        let path = dir.join(self.file_name());
        self.save(&path)?;
        if let Tokenizer::Hf(h) = self {
            if let Some(json) = &h.config().json {
                let p = dir.join(crate::hf::HF_TOKENIZER_CONFIG_FILE);
                std::fs::write(&p, format!("{json}\n")).map_err(|e| DataError::io(&p, "cannot write", e))?;
            }
            if let Some(t) = &h.config().template_file {
                let p = dir.join(crate::hf::HF_CHAT_TEMPLATE_FILE);
                std::fs::write(&p, &**t).map_err(|e| DataError::io(&p, "cannot write", e))?;
            }
        }
        Ok(path)
    }

    /// Reads a tokenizer file; a Hugging Face one with the `tokenizer_config.json` beside it, when
    /// there is one (its BOS/EOS and chat template).
    pub fn load(path: &Path) -> Result<Tokenizer, DataError> {
        let s = std::fs::read_to_string(path).map_err(|e| DataError::io(path, "cannot read tokenizer", e))?;
        Tokenizer::from_json(&s, path)?.with_config_in(path.parent().unwrap_or(Path::new(".")))
    }

    /// A Hugging Face tokenizer with the `tokenizer_config.json` of `dir` and its
    /// `chat_template.jinja` (which takes the place of the config's template), when there are.
    pub fn with_config_in(self, dir: &Path) -> Result<Tokenizer, DataError> {
        let cfg = dir.join(crate::hf::HF_TOKENIZER_CONFIG_FILE);
        let jinja = dir.join(crate::hf::HF_CHAT_TEMPLATE_FILE);
        match self {
            Tokenizer::Hf(h) if cfg.is_file() || jinja.is_file() => {
                let text = if cfg.is_file() { std::fs::read_to_string(&cfg).map_err(|e| DataError::io(&cfg, "cannot read", e))? } else { "{}".to_string() };
                let template = if jinja.is_file() { Some(std::fs::read_to_string(&jinja).map_err(|e| DataError::io(&jinja, "cannot read", e))?) } else { None };
                h.with_config_and_template(&text, &cfg, template.as_deref().map(|t| (t, jinja.as_path()))).map(Tokenizer::Hf)
            }
            t => Ok(t),
        }
    }

    /// The `tokenizer_config.json` text a Hugging Face tokenizer came with.
    pub fn config_json(&self) -> Option<&str> {
        match self {
            Tokenizer::Hf(h) => h.config().json.as_deref(),
            _ => None,
        }
    }

    /// The `chat_template.jinja` text a Hugging Face tokenizer came with.
    pub fn chat_template_file(&self) -> Option<&str> {
        match self {
            Tokenizer::Hf(h) => h.config().template_file.as_deref(),
            _ => None,
        }
    }

    /// The tokenizer stored in directory `dir`: its `tokenizer.json` (a Hugging Face model's, or
    /// kiln's own format as run directories before `kiln-tokenizer.json` stored it), else its
    /// `kiln-tokenizer.json`; `None` when it has neither.
    pub fn find_in(dir: &Path) -> Result<Option<Tokenizer>, DataError> {
        for name in [HF_TOKENIZER_FILE, KILN_TOKENIZER_FILE] {
            let p = dir.join(name);
            if p.is_file() {
                return Tokenizer::load(&p).map(Some);
            }
        }
        Ok(None)
    }

    /// `"char, vocab 65"`: for descriptions and error messages.
    pub fn describe(&self) -> String {
        format!("{}, vocab {}", self.kind(), self.vocab_size())
    }
}

/// A document's tokens, and which of them carry loss.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    /// `mask[i] = 1` when token `i` carries loss as a prediction target (SFT: assistant and
    /// completion tokens); `None`: every token does.
    pub mask: Option<Vec<u8>>,
}

/// What separates documents when the tokenizer has no end-of-text token (`byte`, `char`): the
/// text kiln always joined files with.
pub const SEPARATOR: &str = "\n\n";

impl Tokenizer {
    /// The end-of-text token a document ends with: GPT-2's `<|endoftext|>`, a Hugging Face
    /// tokenizer's `eos_token`; `None` for `byte` and `char`.
    pub fn eos_id(&self) -> Option<u32> {
        match self {
            Tokenizer::Gpt2(_) => Some(GPT2_VOCAB as u32 - 1),
            Tokenizer::Hf(h) => h.config().eos,
            _ => None,
        }
    }

    /// The BOS a document starts with, when the tokenizer's config adds one.
    pub fn bos_id(&self) -> Option<u32> {
        match self {
            Tokenizer::Hf(h) if h.config().add_bos => h.config().bos,
            _ => None,
        }
    }

    /// Tokenizes one document on its own. Text and prompt/completion documents get the
    /// tokenizer's BOS (when its config adds one, or its post-processor does) and EOS; with no
    /// EOS (`byte`, `char`) a document after the first starts with [`SEPARATOR`] instead, so the
    /// stream is the files joined as before. A chat is exactly `apply_chat_template`'s ids (the
    /// template writes its own BOS and end-of-turn tokens), with loss on the assistant turns;
    /// prompt/completion is `prompt`'s ids then `completion`'s, with loss on the completion and
    /// the EOS.
    pub fn encode_doc(&self, doc: &crate::docs::Doc, first: bool) -> Result<Encoded, DataError> {
        use crate::docs::Doc;
        let (bos, eos) = (self.bos_id(), self.eos_id());
        let sep = |ids: &mut Vec<u32>, mask: Option<&mut Vec<u8>>| -> Result<(), DataError> {
            if eos.is_none() && !first {
                let s = self.encode(SEPARATOR)?;
                if let Some(m) = mask {
                    m.extend(std::iter::repeat_n(0, s.len()));
                }
                ids.extend(s);
            }
            Ok(())
        };
        let body = |text: &str| -> Result<Vec<u32>, DataError> {
            let mut ids = match self {
                Tokenizer::Hf(h) => h.encode_ids(text, true)?,
                _ => self.encode(text)?,
            };
            if let Some(b) = bos {
                if ids.first() != Some(&b) {
                    ids.insert(0, b);
                }
            }
            Ok(ids)
        };
        match doc {
            Doc::Text(text) => {
                let mut ids = Vec::new();
                sep(&mut ids, None)?;
                ids.extend(body(text)?);
                if let Some(e) = eos {
                    if ids.last() != Some(&e) {
                        ids.push(e);
                    }
                }
                Ok(Encoded { ids, mask: None })
            }
            Doc::Pair { prompt, completion } => {
                let (mut ids, mut mask) = (Vec::new(), Vec::new());
                sep(&mut ids, Some(&mut mask))?;
                let p = body(prompt)?;
                mask.extend(std::iter::repeat_n(0, p.len()));
                ids.extend(p);
                let c = self.encode(completion)?;
                mask.extend(std::iter::repeat_n(1, c.len()));
                ids.extend(c);
                if let Some(e) = eos {
                    ids.push(e);
                    mask.push(1);
                }
                Ok(Encoded { ids, mask: Some(mask) })
            }
            Doc::Preference { .. } => Err(DataError::new("a preference pair is two documents: encode it with encode_docs")),
            Doc::Prompt(row) => Err(DataError::new(format!("a prompt row is not a document to train on (data.format = \"prompt\" is for train.objective = \"grpo\"): {}", crate::docs::Doc::Prompt(row.clone()).text()))),
            Doc::Chat(messages) | Doc::ChatFrom { messages, .. } => {
                let from = if let Doc::ChatFrom { from, .. } = doc { *from } else { 0 };
                let Tokenizer::Hf(h) = self else {
                    return Err(DataError::new(format!("data.format = \"chat\" needs a Hugging Face tokenizer with a chat_template, not {}", self.kind())));
                };
                let t = h.config().template.as_ref().ok_or_else(|| DataError::new("data.format = \"chat\": the tokenizer has no chat template (neither chat_template.jinja nor tokenizer_config.json's chat_template)"))?;
                let (text, spans) = t.render_spans_from(messages, from).map_err(DataError::new)?;
                let (ids, offsets) = h.encode_full(&text, false)?;
                let mask = offsets.iter().map(|&(s, e)| spans.iter().any(|r| s < r.end && e > r.start) as u8).collect();
                Ok(Encoded { ids, mask: Some(mask) })
            }
        }
    }

    /// A prompt to continue: a string as a prompt/completion document's prompt is encoded (BOS,
    /// then its tokens), or chat messages rendered with the generation prompt.
    pub fn encode_prompt(&self, prompt: &serde_json::Value) -> Result<Vec<u32>, DataError> {
        if let Some(text) = prompt.as_str() {
            let mut ids = match self {
                Tokenizer::Hf(h) => h.encode_ids(text, true)?,
                _ => self.encode(text)?,
            };
            if let Some(b) = self.bos_id() {
                if ids.first() != Some(&b) {
                    ids.insert(0, b);
                }
            }
            return Ok(ids);
        }
        let Tokenizer::Hf(h) = self else {
            return Err(DataError::new(format!("a prompt of chat messages needs a Hugging Face tokenizer with a chat_template, not {}", self.kind())));
        };
        let t = h.config().template.as_ref().ok_or_else(|| DataError::new("a prompt of chat messages: the tokenizer has no chat template"))?;
        let list = prompt.as_array().ok_or_else(|| DataError::new("a prompt is a string or a list of messages"))?;
        let text = t.render(list, true).map_err(DataError::new)?;
        Ok(h.encode_full(&text, false)?.0)
    }

    /// The documents `doc` stands for, encoded ([`Tokenizer::encode_doc`]): one, or a preference
    /// pair's two, chosen then rejected, each a sequence of its own (no separator before it),
    /// each with at least one token that carries loss.
    pub fn encode_docs(&self, doc: &crate::docs::Doc, first: bool) -> Result<Vec<Encoded>, DataError> {
        let crate::docs::Doc::Preference { chosen, rejected } = doc else { return Ok(vec![self.encode_doc(doc, first)?]) };
        let mut out = Vec::with_capacity(2);
        for (side, d) in [("chosen", chosen), ("rejected", rejected)] {
            let e = self.encode_doc(d, true)?;
            if !e.mask.as_ref().is_some_and(|m| m.contains(&1)) {
                return Err(DataError::new(format!("the {side} completion encodes to no token that carries loss")));
            }
            out.push(e);
        }
        Ok(out)
    }
}
