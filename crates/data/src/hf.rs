//! Hugging Face tokenizers: any `tokenizer.json` (byte-level BPE as GPT-2, Llama 3 and Qwen2 use;
//! SentencePiece-style BPE with byte fallback as Llama 2 and Mistral; WordPiece; Unigram) with
//! its added and special tokens, through the `tokenizers` crate; and training a GPT-2-style
//! byte-level BPE that transformers' `AutoTokenizer` loads.

use std::path::Path;
use std::sync::Arc;

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

use crate::error::DataError;
use crate::template::ChatTemplate;

/// Token ids and each token's byte range `(start, end)` in the encoded text.
type IdsOffsets = (Vec<u32>, Vec<(usize, usize)>);

/// A loaded `tokenizer.json`: the tokenizer, and the JSON it came from (written back verbatim,
/// so an export carries exactly the file the user brought).
#[derive(Clone)]
pub struct HfTokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    json: Arc<str>,
    vocab: usize,
    config: TokConfig,
}

/// The file beside `tokenizer.json` that names its special tokens and chat template.
pub const HF_TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// Where transformers (from 4.43) saves the chat template, beside `tokenizer_config.json`: when
/// present it is the template, whatever the config's `chat_template` says.
pub const HF_CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// What a `tokenizer_config.json` says about documents: the BOS a document starts with (when
/// `add_bos_token`), the EOS it ends with, and the chat template. Without the file, the EOS is
/// the first special token among the usual end-of-text names.
#[derive(Clone, Debug, Default)]
pub struct TokConfig {
    /// The file's text, written back verbatim beside `tokenizer.json`.
    pub json: Option<Arc<str>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    pub template: Option<ChatTemplate>,
    /// The template's source when it came from [`HF_CHAT_TEMPLATE_FILE`] (written back there).
    pub template_file: Option<Arc<str>>,
}

/// End-of-text tokens, by the names models use, when no config names one.
const EOS_NAMES: [&str; 5] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>"];

impl HfTokenizer {
    /// Parses a `tokenizer.json`; `origin` names the file in errors.
    pub fn from_json(json: &str, origin: &Path) -> Result<HfTokenizer, DataError> {
        // The tokenizers crate panics on some malformed files (a decoder that is not an object:
        // found by fuzzing, fuzz/regressions/tokenizer/): a panic is the file's error too.
        let parsed = std::panic::catch_unwind(|| json.parse::<tokenizers::Tokenizer>())
            .map_err(|_| DataError::at(origin, "not a Hugging Face tokenizer.json: the tokenizers crate cannot read it (malformed component)"))?;
        let inner = parsed.map_err(|e: tokenizers::Error| DataError::at(origin, format!("not a Hugging Face tokenizer.json: {}", one_line(&e.to_string()))))?;
        Ok(HfTokenizer::wrap(inner, json.trim_end().into()))
    }

    fn wrap(inner: tokenizers::Tokenizer, json: Arc<str>) -> HfTokenizer {
        // Ids run from 0 to the largest id of the model's vocabulary or the added tokens.
        let added = inner.get_added_tokens_decoder().keys().map(|&id| id as usize + 1).max().unwrap_or(0);
        let vocab = inner.get_vocab_size(false).max(added);
        let mut t = HfTokenizer { inner: Arc::new(inner), json, vocab, config: TokConfig::default() };
        t.config.eos = EOS_NAMES.iter().find_map(|n| t.special_id(n));
        t
    }

    fn special_id(&self, name: &str) -> Option<u32> {
        self.special_tokens().into_iter().find(|(_, s)| s == name).map(|(id, _)| id)
    }

    /// This tokenizer with the `tokenizer_config.json` text `json` (`origin` names it in errors):
    /// its `bos_token`, `eos_token`, `add_bos_token` and `chat_template` (a string, or a list of
    /// `{name, template}` of which `default` is taken).
    pub fn with_config(self, json: &str, origin: &Path) -> Result<HfTokenizer, DataError> {
        self.with_config_and_template(json, origin, None)
    }

    /// [`HfTokenizer::with_config`] with the chat template of a [`HF_CHAT_TEMPLATE_FILE`]
    /// (`(source, its path)`), which takes the place of the config's `chat_template`, as in
    /// transformers.
    pub fn with_config_and_template(mut self, json: &str, origin: &Path, file: Option<(&str, &Path)>) -> Result<HfTokenizer, DataError> {
        let v: serde_json::Value = serde_json::from_str(json).map_err(|e| DataError::at(origin, format!("not valid JSON: {e}")))?;
        let token = |key: &str| -> Result<Option<(String, u32)>, DataError> {
            let name = match &v[key] {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Object(o) => match o.get("content") {
                    Some(serde_json::Value::String(s)) => s.clone(),
                    _ => return Err(DataError::at(origin, format!("`{key}` has no string \"content\""))),
                },
                serde_json::Value::Null => return Ok(None),
                x => return Err(DataError::at(origin, format!("`{key}` is {x}, not a token string"))),
            };
            let id = self.token_to_id(&name).ok_or_else(|| DataError::at(origin, format!("`{key}` is {name:?}, which is not in the tokenizer's vocabulary")))?;
            Ok(Some((name, id)))
        };
        let (bos, eos) = (token("bos_token")?, token("eos_token")?);
        let add_bos = match &v["add_bos_token"] {
            serde_json::Value::Bool(b) => *b,
            serde_json::Value::Null => false,
            x => return Err(DataError::at(origin, format!("`add_bos_token` is {x}, not true or false"))),
        };
        if add_bos && bos.is_none() {
            return Err(DataError::at(origin, "`add_bos_token` is true but there is no `bos_token`"));
        }
        let source = match (&v["chat_template"], file) {
            (_, Some((src, _))) => Some(src.to_string()),
            (serde_json::Value::String(s), None) => Some(s.clone()),
            (serde_json::Value::Array(list), None) => list.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str()).map(str::to_string),
            _ => None,
        };
        let name = |t: &Option<(String, u32)>| t.as_ref().map_or(String::new(), |(n, _)| n.clone());
        let at = file.map_or(origin, |f| f.1);
        let template = match source {
            Some(src) => Some(ChatTemplate::new(&src, &name(&bos), &name(&eos)).map_err(|e| DataError::at(at, e))?),
            None => None,
        };
        self.config = TokConfig {
            json: Some(json.trim_end().into()),
            bos: bos.map(|b| b.1),
            eos: eos.map(|e| e.1).or(self.config.eos),
            add_bos,
            template,
            template_file: file.map(|f| f.0.into()),
        };
        Ok(self)
    }

    pub fn config(&self) -> &TokConfig {
        &self.config
    }

    /// The `tokenizer.json` text.
    pub fn json(&self) -> &str {
        &self.json
    }

    /// One more than the largest id (the rows an embedding needs).
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The model type (`BPE`, `WordPiece`, `Unigram`, `WordLevel`).
    pub fn model_type(&self) -> &'static str {
        use tokenizers::ModelWrapper as M;
        match self.inner.get_model() {
            M::BPE(_) => "BPE",
            M::WordPiece(_) => "WordPiece",
            M::WordLevel(_) => "WordLevel",
            M::Unigram(_) => "Unigram",
        }
    }

    /// `text`'s ids without the special tokens a post-processor would add (`add_special_tokens
    /// = False`); special-token text in `text` (`<|endoftext|>`) becomes its id.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        self.inner
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| DataError::new(format!("tokenizer cannot encode the text: {}", one_line(&e.to_string()))))
    }

    /// `text`'s ids with the special tokens its post-processor adds (a Llama 3 BOS), and each
    /// token's byte range in `text` (when `offsets`).
    pub fn encode_full(&self, text: &str, special: bool) -> Result<IdsOffsets, DataError> {
        self.inner
            .encode(text, special)
            .map(|e| (e.get_ids().to_vec(), e.get_offsets().to_vec()))
            .map_err(|e| DataError::new(format!("tokenizer cannot encode the text: {}", one_line(&e.to_string()))))
    }

    /// `text`'s ids with the special tokens its post-processor adds, without computing offsets
    /// (the fast path for pretraining documents).
    pub fn encode_ids(&self, text: &str, special: bool) -> Result<Vec<u32>, DataError> {
        self.inner
            .encode_fast(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| DataError::new(format!("tokenizer cannot encode the text: {}", one_line(&e.to_string()))))
    }

    /// Decodes `ids`, special tokens included; an id outside the vocabulary becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_with(ids, false)
    }

    /// [`HfTokenizer::decode`], with `skip_special` leaving the special tokens out
    /// (transformers' `skip_special_tokens=True`).
    pub fn decode_with(&self, ids: &[u32], skip_special: bool) -> String {
        let known = |id: u32| (id as usize) < self.vocab && self.inner.id_to_token(id).is_some();
        let mut out = String::new();
        for (i, run) in ids.split(|&id| !known(id)).enumerate() {
            if i > 0 {
                out.push(char::REPLACEMENT_CHARACTER);
            }
            if !run.is_empty() {
                out.push_str(&self.inner.decode(run, skip_special).unwrap_or_else(|_| char::REPLACEMENT_CHARACTER.to_string()));
            }
        }
        out
    }

    /// The id of `token` (a vocabulary entry or an added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The special added tokens, by id.
    pub fn special_tokens(&self) -> Vec<(u32, String)> {
        let mut v: Vec<(u32, String)> =
            self.inner.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, t)| (id, t.content)).collect();
        v.sort();
        v
    }
}

impl PartialEq for HfTokenizer {
    /// The same tokenizer: the same file, or files that parse to the same tokenizer.
    fn eq(&self, other: &HfTokenizer) -> bool {
        self.vocab == other.vocab && (self.json == other.json || self.inner.to_string(false).ok() == other.inner.to_string(false).ok())
    }
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HfTokenizer({}, vocab {})", self.model_type(), self.vocab)
    }
}

/// Trains a byte-level BPE (GPT-2's pre-tokenizer and decoder; ids: `specials` first, as the
/// `tokenizers` trainer orders them, then the 256 byte symbols, then the merges) of at most
/// `vocab_size` ids on `text`. Special strings in `text`
/// are kept out of the merges. The result is deterministic and loads in transformers.
pub fn train_bpe(text: &str, vocab_size: usize, specials: &[&str]) -> Result<HfTokenizer, DataError> {
    let min = 256 + specials.len();
    if vocab_size < min {
        return Err(DataError::new(format!(
            "bpe vocab size {vocab_size} is too small: it must be at least {min} (256 bytes + {} specials)",
            specials.len()
        )));
    }
    if vocab_size > u32::MAX as usize / 2 {
        return Err(DataError::new(format!("bpe vocab size {vocab_size} is too large")));
    }
    if text.is_empty() {
        return Err(DataError::new("bpe training text is empty"));
    }
    let mut tok = tokenizers::Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.with_post_processor(Some(ByteLevel::new(false, true, true)));
    let specials: Vec<AddedToken> = specials.iter().map(|s| AddedToken::from(s.to_string(), true)).collect();
    // Before training, so special strings in the text stay out of the merges.
    tok.add_special_tokens(specials.clone()).map_err(|e| DataError::new(format!("bpe special tokens: {e}")))?;
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(0)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    // Paragraphs as training sequences: the pre-tokenizer splits words within each.
    tok.train(&mut trainer, text.split_inclusive("\n\n")).map_err(|e| DataError::new(format!("bpe training failed: {e}")))?;
    let json = tok.to_string(true).map_err(|e| DataError::new(format!("cannot serialise the trained tokenizer: {e}")))?;
    Ok(HfTokenizer::wrap(tok, json.into()))
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}
