//! Datasets: gather inputs (text, `.bin`, `.npy`, `.tok` shards, directories, prepared
//! directories), pick the tokenizer, tokenize, split into train/val; and `prepare`, which
//! writes a dataset as shards plus its tokenizer.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::DataError;
use crate::shard::{check_ids, is_shard, read_bin, read_shard, write_shard_tokens};
use crate::tokenizer::Tokenizer;
use crate::tokens::Tokens;

/// Train and validation token streams, the tokenizer that produced them, and what they came from.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub train: Tokens,
    pub val: Tokens,
    pub tokenizer: Tokenizer,
    /// e.g. `"3 files, 1115394 tokens (char, vocab 65)"`.
    pub description: String,
    /// The files the tokens came from, in stream order.
    pub files: Vec<PathBuf>,
    /// Files found in directories but skipped (empty or not UTF-8 text).
    pub skipped: usize,
}

/// What [`prepare`] wrote.
#[derive(Debug, Clone)]
pub struct PrepareReport {
    pub out: PathBuf,
    pub files: Vec<PathBuf>,
    pub skipped: usize,
    pub train_tokens: usize,
    pub val_tokens: usize,
    pub tokenizer: &'static str,
    pub vocab_size: usize,
    pub description: String,
}

/// The file name of a prepared directory's metadata (its presence marks the directory).
pub const META_FILE: &str = "meta.json";
pub const TRAIN_FILE: &str = "train.tok";
pub const VAL_FILE: &str = "val.tok";
const META_FORMAT: &str = "kiln-prepared";

enum Item {
    Text { path: PathBuf, text: String },
    TokenFile { path: PathBuf, tokens: Tokens },
    /// A directory bringing its own split: a prepared dir (with its tokenizer) or train.bin + val.bin.
    Split { dir: PathBuf, train: Tokens, val: Tokens, tokenizer: Option<Tokenizer>, files: Vec<PathBuf> },
}

enum Choice<'a> {
    Spec(&'a str),
    Given(Tokenizer),
}

/// Loads `paths` (any mix of text files, directories, `.bin`, `.npy`, `.tok` shards, or one
/// prepared directory) with tokenizer `tokenizer_spec`: `byte`, `char`, `gpt2`, `bpe:N`
/// (trained on the text), a tokenizer JSON path, or `auto` (a prepared directory's own
/// tokenizer; else `byte` for text and `gpt2` for token files, nanoGPT's convention). The first `1 - val_fraction` of the stream
/// is train, the rest val, unless the source brings its own split.
pub fn load(paths: &[PathBuf], tokenizer_spec: &str, val_fraction: f64) -> Result<Dataset, DataError> {
    load_impl(paths, Choice::Spec(tokenizer_spec), val_fraction)
}

/// [`load`] with an already-built tokenizer (a run's stored `tokenizer.json`).
pub fn load_with(paths: &[PathBuf], tokenizer: Tokenizer, val_fraction: f64) -> Result<Dataset, DataError> {
    load_impl(paths, Choice::Given(tokenizer), val_fraction)
}

fn check_fraction(val_fraction: f64) -> Result<(), DataError> {
    if !(0.0..1.0).contains(&val_fraction) {
        return Err(DataError::new(format!("val_fraction {val_fraction} must be at least 0 and below 1")));
    }
    Ok(())
}

fn load_impl(paths: &[PathBuf], choice: Choice, val_fraction: f64) -> Result<Dataset, DataError> {
    check_fraction(val_fraction)?;
    if paths.is_empty() {
        return Err(DataError::new("no data paths given"));
    }
    let mut items = Vec::new();
    let mut skipped = 0;
    for p in paths {
        gather(p, &mut items, &mut skipped)?;
    }
    let shown = show_paths(paths);
    if items.is_empty() {
        return Err(DataError::new(format!(
            "{shown}: no tokens (no files with text or tokens; {skipped} empty or non-UTF-8 files skipped)"
        )));
    }
    if let Some(dir) = items.iter().find_map(|i| match i {
        Item::Split { dir, .. } => Some(dir),
        _ => None,
    }) {
        if items.len() > 1 {
            return Err(DataError::at(
                dir,
                "this directory brings its own train/val split and cannot be combined with other inputs",
            ));
        }
    }
    let tokenizer = resolve_tokenizer(choice, &items)?;
    let vocab = tokenizer.vocab_size();
    let whose = format!("the vocab size of tokenizer {}", tokenizer.kind());

    if let Some(Item::Split { dir, train, val, files, tokenizer: own }) = items.first() {
        if own.is_none() {
            // (A prepared dir's shards were checked against their header vocab, which equals its tokenizer's.)
            check_ids(&dir.join(file_name(files, 0)), train, vocab, &whose)?;
            check_ids(&dir.join(file_name(files, 1)), val, vocab, &whose)?;
        }
        let total = train.len() + val.len();
        if total == 0 {
            return Err(DataError::at(dir, "no tokens (both splits are empty)"));
        }
        let description = format!(
            "{} files, {total} tokens ({}); own split {}/{}",
            files.len(),
            tokenizer.describe(),
            train.len(),
            val.len()
        );
        return Ok(Dataset {
            train: train.clone(),
            val: val.clone(),
            tokenizer,
            description,
            files: files.clone(),
            skipped,
        });
    }

    let mut files = Vec::new();
    let all: Tokens = if let [Item::TokenFile { path, tokens }] = items.as_slice() {
        // One token file: keep it memory-mapped, split by views.
        check_ids(path, tokens, vocab, &whose)?;
        files.push(path.clone());
        tokens.clone()
    } else {
        let mut out: Vec<u32> = Vec::new();
        let mut pending = String::new();
        let flush = |pending: &mut String, out: &mut Vec<u32>| -> Result<(), DataError> {
            if !pending.is_empty() {
                out.extend(tokenizer.encode(pending)?);
                pending.clear();
            }
            Ok(())
        };
        for item in &items {
            match item {
                Item::Text { path, text } => {
                    if let Tokenizer::Char(v) = &tokenizer {
                        if let Some((at, c)) = v.first_unknown(text) {
                            return Err(DataError::at(
                                path,
                                format!(
                                    "character {c:?} at byte {at} is not in the char tokenizer's vocabulary ({} chars)",
                                    v.chars().len()
                                ),
                            ));
                        }
                    }
                    if !pending.is_empty() {
                        if let Tokenizer::Char(v) = &tokenizer {
                            if v.id('\n').is_none() {
                                return Err(DataError::at(
                                    path,
                                    "the char tokenizer has no '\\n', which joins this file to the previous one",
                                ));
                            }
                        }
                        pending.push_str("\n\n");
                    }
                    pending.push_str(text);
                    files.push(path.clone());
                }
                Item::TokenFile { path, tokens } => {
                    check_ids(path, tokens, vocab, &whose)?;
                    flush(&mut pending, &mut out)?;
                    out.extend(tokens.to_vec());
                    files.push(path.clone());
                }
                Item::Split { .. } => unreachable!("a split directory is the only item"),
            }
        }
        flush(&mut pending, &mut out)?;
        Tokens::from_vec(out)
    };
    if all.is_empty() {
        return Err(DataError::new(format!("{shown}: no tokens after tokenizing")));
    }
    let n = all.len();
    let n_train = ((n as f64) * (1.0 - val_fraction)) as usize; // nanoGPT: data[:int(n*0.9)]
    let (train, val) = all.split_at(n_train.min(n));
    let mut description = format!(
        "{} file{}, {n} tokens ({})",
        files.len(),
        if files.len() == 1 { "" } else { "s" },
        tokenizer.describe()
    );
    if skipped > 0 {
        description += &format!("; {skipped} empty or non-UTF-8 files skipped");
    }
    Ok(Dataset { train, val, tokenizer, description, files, skipped })
}

fn file_name(files: &[PathBuf], i: usize) -> String {
    files.get(i).and_then(|f| f.file_name()).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
}

fn show_paths(paths: &[PathBuf]) -> String {
    let v: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    v.join(", ")
}

fn resolve_tokenizer(choice: Choice, items: &[Item]) -> Result<Tokenizer, DataError> {
    let prepared = items.iter().find_map(|i| match i {
        Item::Split { dir, tokenizer: Some(t), .. } => Some((dir, t)),
        _ => None,
    });
    let first_token_path = items.iter().find_map(|i| match i {
        Item::TokenFile { path, .. } => Some(path.clone()),
        Item::Split { dir, tokenizer: None, .. } => Some(dir.clone()),
        _ => None,
    });
    let disagree = |dir: &Path, have: &Tokenizer, given: &str| {
        DataError::at(
            &dir.join(have.file_name()),
            format!(
                "this prepared dataset uses tokenizer {} ({}), but tokenizer {given} was given",
                have.kind(),
                have.describe()
            ),
        )
    };
    match choice {
        Choice::Given(t) => {
            if let Some((dir, have)) = prepared {
                if *have != t {
                    return Err(disagree(dir, have, &format!("{} ({})", t.kind(), t.describe())));
                }
            }
            Ok(t)
        }
        Choice::Spec("auto") => Ok(match prepared {
            Some((_, t)) => t.clone(),
            None if items.iter().any(|i| matches!(i, Item::Text { .. })) => Tokenizer::Byte,
            None => Tokenizer::from_spec("gpt2", None)?,
        }),
        Choice::Spec(spec) if Tokenizer::spec_needs_corpus(spec) => {
            if let Some((dir, have)) = prepared {
                return if have.matches_corpus_spec(spec) { Ok(have.clone()) } else { Err(disagree(dir, have, &format!("{spec:?}"))) };
            }
            if let Some(p) = first_token_path {
                return Err(DataError::at(
                    &p,
                    format!("is a token file, but tokenizer {spec:?} builds its vocabulary from text; give text files, or a tokenizer JSON file"),
                ));
            }
            // Exactly the text stream that will be encoded (files joined with blank lines).
            let texts: Vec<&str> = items
                .iter()
                .filter_map(|i| match i {
                    Item::Text { text, .. } => Some(text.as_str()),
                    _ => None,
                })
                .collect();
            Tokenizer::from_spec(spec, Some(&texts.join("\n\n")))
        }
        Choice::Spec(spec) => {
            let t = Tokenizer::from_spec(spec, None)?;
            if let Some((dir, have)) = prepared {
                if *have != t {
                    return Err(disagree(dir, have, &format!("{spec:?}")));
                }
            }
            Ok(t)
        }
    }
}

fn gather(p: &Path, items: &mut Vec<Item>, skipped: &mut usize) -> Result<(), DataError> {
    let meta = fs::metadata(p).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => DataError::at(p, "no such file or directory"),
        _ => DataError::io(p, "cannot read", e),
    })?;
    if meta.is_dir() {
        if p.join(META_FILE).is_file() {
            items.push(read_prepared(p)?);
        } else if p.join("train.bin").is_file() && p.join("val.bin").is_file() {
            let (t, v) = (p.join("train.bin"), p.join("val.bin"));
            items.push(Item::Split {
                dir: p.to_path_buf(),
                train: read_bin(&t)?,
                val: read_bin(&v)?,
                tokenizer: None,
                files: vec![t, v],
            });
        } else {
            let mut files = Vec::new();
            walk(p, &mut files, 0)?;
            for f in files {
                if let Some(item) = read_file(&f, false)? {
                    items.push(item);
                } else {
                    *skipped += 1;
                }
            }
        }
    } else if let Some(item) = read_file(p, true)? {
        items.push(item);
    }
    Ok(())
}

/// All non-hidden files under `dir`, sorted by path; a prepared directory inside is an error.
fn walk(dir: &Path, out: &mut Vec<PathBuf>, depth: usize) -> Result<(), DataError> {
    if depth > 64 {
        return Err(DataError::at(dir, "directories nested more than 64 deep (a symlink loop?)"));
    }
    let rd = fs::read_dir(dir).map_err(|e| DataError::io(dir, "cannot list directory", e))?;
    let mut entries = Vec::new();
    for e in rd {
        let e = e.map_err(|e| DataError::io(dir, "cannot list directory", e))?;
        if e.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        entries.push(e.path());
    }
    entries.sort();
    for path in entries {
        let md = fs::metadata(&path).map_err(|e| DataError::io(&path, "cannot read", e))?;
        if md.is_dir() {
            if path.join(META_FILE).is_file() {
                return Err(DataError::at(
                    &path,
                    format!("is a prepared dataset directory inside {}; pass it on its own", dir.display()),
                ));
            }
            walk(&path, out, depth + 1)?;
        } else if md.is_file() {
            out.push(path);
        }
    }
    Ok(())
}

/// Whether `path` names a token file (`.bin`, `.npy`, `.tok` or a kiln shard) rather than text.
pub fn is_token_file(path: &Path) -> bool {
    let ext = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
    matches!(ext.as_str(), "bin" | "npy" | "tok") || (path.is_file() && is_shard(path))
}

/// The tokens of `paths` (token files, see [`is_token_file`]), back to back, every id checked
/// below `vocab` (`whose` names it in the error: "the model's vocabulary"). No tokenizer is
/// involved.
pub fn load_token_files(paths: &[PathBuf], vocab: usize, whose: &str) -> Result<Tokens, DataError> {
    let mut all: Vec<u32> = Vec::new();
    for p in paths {
        match read_file(p, true)? {
            Some(Item::TokenFile { path, tokens }) => {
                check_ids(&path, &tokens, vocab, whose)?;
                let start = all.len();
                all.resize(start + tokens.len(), 0);
                tokens.copy_to(0, &mut all[start..]);
            }
            _ => return Err(DataError::at(p, "not a token file (.bin, .npy or .tok)")),
        }
    }
    Ok(Tokens::from_vec(all))
}

/// One file. `explicit`: named by the user (errors) rather than found in a directory (skipped
/// when empty or not UTF-8: `Ok(None)`).
fn read_file(path: &Path, explicit: bool) -> Result<Option<Item>, DataError> {
    let ext = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
    let len = fs::metadata(path).map_err(|e| DataError::io(path, "cannot read", e))?.len();
    if len == 0 {
        return if explicit { Err(DataError::at(path, "file is empty")) } else { Ok(None) };
    }
    let tokens = match ext.as_str() {
        "bin" => Some(read_bin(path)?),
        "npy" => Some(crate::npy::read_npy(path)?),
        _ if ext == "tok" || is_shard(path) => Some(read_shard(path)?.0),
        _ => None,
    };
    if let Some(tokens) = tokens {
        return Ok(Some(Item::TokenFile { path: path.to_path_buf(), tokens }));
    }
    let bytes = fs::read(path).map_err(|e| DataError::io(path, "cannot read", e))?;
    match String::from_utf8(bytes) {
        Ok(text) => Ok(Some(Item::Text { path: path.to_path_buf(), text })),
        Err(e) if explicit => Err(DataError::at(
            path,
            format!(
                "not UTF-8 text (invalid byte at offset {}); token files must end in .bin, .npy or .tok",
                e.utf8_error().valid_up_to()
            ),
        )),
        Err(_) => Ok(None),
    }
}

fn read_prepared(dir: &Path) -> Result<Item, DataError> {
    let meta_path = dir.join(META_FILE);
    let s = fs::read_to_string(&meta_path).map_err(|e| DataError::io(&meta_path, "cannot read", e))?;
    let meta: serde_json::Value =
        serde_json::from_str(&s).map_err(|e| DataError::at(&meta_path, format!("not valid JSON: {e}")))?;
    if meta.get("format").and_then(|v| v.as_str()) != Some(META_FORMAT) {
        return Err(DataError::at(&meta_path, format!("\"format\" is not \"{META_FORMAT}\": not written by `kiln data prepare`")));
    }
    if meta.get("version").and_then(|v| v.as_u64()) != Some(1) {
        return Err(DataError::at(&meta_path, format!("\"version\" is {:?}, expected 1", meta.get("version"))));
    }
    let tokenizer = Tokenizer::find_in(dir)?.ok_or_else(|| DataError::at(dir, "prepared directory holds no tokenizer (tokenizer.json or kiln-tokenizer.json)"))?;
    let mut splits = Vec::new();
    for (name, key) in [(TRAIN_FILE, "train_tokens"), (VAL_FILE, "val_tokens")] {
        let path = dir.join(name);
        let (tokens, vocab) = read_shard(&path)?;
        if vocab != tokenizer.vocab_size() {
            return Err(DataError::at(
                &path,
                format!("shard vocab size {vocab} differs from {}'s {}", tokenizer.file_name(), tokenizer.describe()),
            ));
        }
        if let Some(n) = meta.get(key).and_then(|v| v.as_u64()) {
            if n != tokens.len() as u64 {
                return Err(DataError::at(&path, format!("holds {} tokens but {META_FILE} says {key} = {n}", tokens.len())));
            }
        }
        splits.push((path, tokens));
    }
    let (val_path, val) = splits.pop().unwrap();
    let (train_path, train) = splits.pop().unwrap();
    Ok(Item::Split { dir: dir.to_path_buf(), train, val, tokenizer: Some(tokenizer), files: vec![train_path, val_path] })
}

/// `kiln data prepare`: loads `inputs` as [`load`] does and writes `out/train.tok`,
/// `out/val.tok` (shards), the tokenizer (`tokenizer.json` for a Hugging Face one, else
/// `kiln-tokenizer.json`) and `out/meta.json`.
pub fn prepare(inputs: &[PathBuf], tokenizer_spec: &str, out: &Path, val_fraction: f64) -> Result<PrepareReport, DataError> {
    if let Ok(o) = out.canonicalize() {
        for i in inputs {
            let Ok(c) = i.canonicalize() else { continue };
            let ours = [TRAIN_FILE, VAL_FILE, META_FILE, crate::HF_TOKENIZER_FILE, crate::KILN_TOKENIZER_FILE].map(|f| o.join(f));
            if c == o || ours.contains(&c) {
                return Err(DataError::at(out, "the output directory is also an input"));
            }
        }
    }
    let ds = load(inputs, tokenizer_spec, val_fraction)?;
    fs::create_dir_all(out).map_err(|e| DataError::io(out, "cannot create directory", e))?;
    let vocab = ds.tokenizer.vocab_size();
    write_shard_tokens(&out.join(TRAIN_FILE), &ds.train, vocab)?;
    write_shard_tokens(&out.join(VAL_FILE), &ds.val, vocab)?;
    ds.tokenizer.save_in(out)?;
    let meta = serde_json::json!({
        "format": META_FORMAT,
        "version": 1,
        "tokenizer": ds.tokenizer.kind(),
        "vocab_size": vocab,
        "val_fraction": val_fraction,
        "train_tokens": ds.train.len(),
        "val_tokens": ds.val.len(),
        "sources": ds.files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "skipped": ds.skipped,
        "description": ds.description,
    });
    let meta_path = out.join(META_FILE);
    let text = serde_json::to_string_pretty(&meta).expect("meta JSON") + "\n";
    fs::write(&meta_path, text).map_err(|e| DataError::io(&meta_path, "cannot write", e))?;
    Ok(PrepareReport {
        out: out.to_path_buf(),
        files: ds.files,
        skipped: ds.skipped,
        train_tokens: ds.train.len(),
        val_tokens: ds.val.len(),
        tokenizer: ds.tokenizer.kind(),
        vocab_size: vocab,
        description: ds.description,
    })
}
