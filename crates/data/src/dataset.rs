//! Datasets: gather inputs (text, `.bin`, `.npy`, `.tok` shards, directories, prepared
//! directories), pick the tokenizer, tokenize, split into train/val; and `prepare`, which
//! writes a dataset as shards plus its tokenizer.

use std::fs;
use std::path::{Path, PathBuf};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::docs::{read_docs, Doc, DocOpts, FileKind};
use crate::error::DataError;
use crate::shard::{check_ids, is_shard, read_bin, read_shard};
use crate::store::{read_docs_file, read_mask_file, DocIndex, Split, SplitSink};
use crate::tokenizer::{Encoded, Tokenizer};
use crate::tokens::Tokens;

/// Train and validation splits, the tokenizer that produced them, and what they came from.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub train: Split,
    pub val: Split,
    pub tokenizer: Tokenizer,
    /// e.g. `"3 files, 120 documents, 1115394 tokens (char, vocab 65)"`.
    pub description: String,
    /// The files the tokens came from, in stream order.
    pub files: Vec<PathBuf>,
    /// Files found in directories but skipped (empty, not UTF-8 text, or plain text beside
    /// jsonl/parquet files).
    pub skipped: usize,
}

/// What [`prepare`] wrote.
#[derive(Debug, Clone)]
pub struct PrepareReport {
    pub out: PathBuf,
    pub files: Vec<PathBuf>,
    pub skipped: usize,
    pub documents: usize,
    pub train_tokens: usize,
    pub val_tokens: usize,
    pub tokenizer: &'static str,
    pub vocab_size: usize,
    pub description: String,
}

/// How far [`prepare_with`] has come: documents tokenized, input bytes read of the total.
#[derive(Debug, Clone, Copy, Default)]
pub struct Progress {
    pub docs: u64,
    pub bytes: u64,
    pub total_bytes: u64,
}

/// The file name of a prepared directory's metadata (its presence marks the directory).
pub const META_FILE: &str = "meta.json";

/// A prepared directory's `meta.json`, parsed; `None` for anything else.
fn read_meta(dir: &Path) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(dir.join(META_FILE)).ok()?).ok()
}

/// The documents a prepared directory was made from (its `meta.json`'s count).
fn meta_documents(dir: &Path) -> Option<usize> {
    read_meta(dir)?["documents"].as_u64().map(|d| d as usize)
}

/// The document format a prepared directory (`kiln data prepare`) was made from (its
/// `meta.json`'s `data_format`); `None` for anything else.
pub fn prepared_format(dir: &Path) -> Option<crate::DocFormat> {
    crate::DocFormat::from_name(read_meta(dir)?["data_format"].as_str()?)
}
const META_FORMAT: &str = "kiln-prepared";
const META_VERSION: u64 = 2;

#[allow(clippy::large_enum_variant)] // a few per load, short-lived: boxing would buy nothing
enum Item {
    /// Text, jsonl or parquet: read when tokenized.
    Docs { path: PathBuf },
    TokenFile { path: PathBuf, tokens: Tokens },
    /// A directory bringing its own split: a prepared dir (with its tokenizer) or train.bin + val.bin.
    Split { dir: PathBuf, train: Split, val: Split, tokenizer: Option<Tokenizer>, files: Vec<PathBuf> },
}

/// Which tokenizer a load uses.
pub enum TokenizerChoice<'a> {
    /// A spec ([`Tokenizer::from_spec`], or `auto`).
    Spec(&'a str),
    /// An already-built tokenizer (a run's stored one).
    Given(Tokenizer),
}
use TokenizerChoice as Choice;

/// Loads `paths` (any mix of text, jsonl(.gz/.zst) and parquet files, directories, `.bin`,
/// `.npy`, `.tok` shards, or one prepared directory) with tokenizer `tokenizer_spec`: `byte`,
/// `char`, `gpt2`, `bpe:N` (trained on the text), a tokenizer JSON path, or `auto` (a prepared
/// directory's own tokenizer; else `byte` for text and `gpt2` for token files, nanoGPT's
/// convention). Each document is tokenized on its own ([`Tokenizer::encode_doc`]); the first
/// `1 - val_fraction` of the stream is train, the rest val, unless the source brings its own split.
pub fn load(paths: &[PathBuf], tokenizer_spec: &str, val_fraction: f64) -> Result<Dataset, DataError> {
    load_docs(paths, Choice::Spec(tokenizer_spec), val_fraction, &DocOpts::default())
}

/// [`load`] with an already-built tokenizer (a run's stored `tokenizer.json`).
pub fn load_with(paths: &[PathBuf], tokenizer: Tokenizer, val_fraction: f64) -> Result<Dataset, DataError> {
    load_docs(paths, Choice::Given(tokenizer), val_fraction, &DocOpts::default())
}

fn check_fraction(val_fraction: f64) -> Result<(), DataError> {
    if !(0.0..1.0).contains(&val_fraction) {
        return Err(DataError::new(format!("val_fraction {val_fraction} must be at least 0 and below 1")));
    }
    Ok(())
}

/// The inputs of `paths`, checked, with the tokenizer resolved.
fn resolve_inputs(paths: &[PathBuf], choice: Choice, opts: &DocOpts) -> Result<(Vec<Item>, Tokenizer, usize), DataError> {
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
    if opts.format.masked() {
        if let Some(p) = items.iter().find_map(|i| match i {
            Item::TokenFile { path, .. } => Some(path),
            _ => None,
        }) {
            return Err(DataError::at(p, format!("is a token file, but data.format = \"{}\" needs jsonl or parquet documents", opts.format.name())));
        }
    }
    let tokenizer = resolve_tokenizer(choice, &items, opts)?;
    Ok((items, tokenizer, skipped))
}

/// [`load`] / [`load_with`] with the document options (`data.text_field`, `data.format`).
pub fn load_docs(paths: &[PathBuf], choice: Choice, val_fraction: f64, opts: &DocOpts) -> Result<Dataset, DataError> {
    check_fraction(val_fraction)?;
    let (items, tokenizer, skipped) = resolve_inputs(paths, choice, opts)?;
    let shown = show_paths(paths);
    let vocab = tokenizer.vocab_size();
    let whose = format!("the vocab size of tokenizer {}", tokenizer.kind());

    if let Some(Item::Split { dir, train, val, files, tokenizer: own }) = items.first() {
        if own.is_none() {
            // (A prepared dir's shards were checked against their header vocab, which equals its tokenizer's.)
            check_ids(&dir.join(file_name(files, 0)), &train.tokens, vocab, &whose)?;
            check_ids(&dir.join(file_name(files, 1)), &val.tokens, vocab, &whose)?;
        }
        let total = train.len() + val.len();
        if total == 0 {
            return Err(DataError::at(dir, "no tokens (both splits are empty)"));
        }
        // A document the split cut in two is one document (prepared sets record their count).
        let documents = meta_documents(dir).unwrap_or(train.docs.len() + val.docs.len());
        let description = format!(
            "{} files, {documents} documents, {total} tokens ({}); own split {}/{}",
            files.len(),
            tokenizer.describe(),
            train.len(),
            val.len()
        );
        return Ok(Dataset { train: train.clone(), val: val.clone(), tokenizer, description, files: files.clone(), skipped });
    }

    let mut files = Vec::new();
    let all = if let [Item::TokenFile { path, tokens }] = items.as_slice() {
        // One token file: keep it memory-mapped, split by views.
        check_ids(path, tokens, vocab, &whose)?;
        files.push(path.clone());
        Split::plain(tokens.clone())
    } else {
        let mut sink = SplitSink::memory(opts.format.masked());
        stream(&items, &tokenizer, opts, &mut sink, &mut files, &mut |_| {})?;
        sink.finish()?
    };
    if all.is_empty() {
        return Err(DataError::new(format!("{shown}: no tokens after tokenizing")));
    }
    let n = all.len();
    let (train, val) = split_views(&all, n_train(n, val_fraction));
    let description = describe(&files, all.docs.len(), n, &tokenizer, skipped);
    Ok(Dataset { train, val, tokenizer, description, files, skipped })
}

/// The Rust books ([`crate::default_corpus_files`]), each book one document (HTML stripped),
/// tokenized and split as [`load_docs`] does. A corpus-built tokenizer (`char`, `bpe:N`) is
/// built on the books joined with [`crate::SEPARATOR`].
pub fn load_default_corpus(choice: Choice, val_fraction: f64) -> Result<Dataset, DataError> {
    check_fraction(val_fraction)?;
    let files = crate::default_corpus_files()?;
    let mut docs = Vec::new();
    for f in &files {
        let bytes = fs::read(f).map_err(|e| DataError::io(f, "cannot read", e))?;
        docs.push(Doc::Text(crate::strip_html(&String::from_utf8_lossy(&bytes)).trim().to_string()));
    }
    let tokenizer = match choice {
        Choice::Given(t) => t,
        Choice::Spec(spec) => {
            let joined: Vec<String> = docs.iter().map(|d| d.text()).collect();
            Tokenizer::from_spec(if spec == "auto" { "byte" } else { spec }, Some(&joined.join(crate::tokenizer::SEPARATOR)))?
        }
    };
    let mut sink = SplitSink::memory(false);
    for (i, d) in docs.iter().enumerate() {
        if let Tokenizer::Char(v) = &tokenizer {
            check_chars(&files[i], v, &d.text(), i > 0)?;
        }
        sink.push(&tokenizer.encode_doc(d, i == 0).map_err(|e| DataError::at(&files[i], e))?)?;
    }
    let all = sink.finish()?;
    let n = all.len();
    let (train, val) = split_views(&all, n_train(n, val_fraction));
    let description = format!("the Rust books ({} files, {n} tokens, {} tokenizer, vocab {})", files.len(), tokenizer.kind(), tokenizer.vocab_size());
    Ok(Dataset { train, val, tokenizer, description, files, skipped: 0 })
}

/// nanoGPT's split point: `data[:int(n*0.9)]`.
fn n_train(n: usize, val_fraction: f64) -> usize {
    (((n as f64) * (1.0 - val_fraction)) as usize).min(n)
}

fn describe(files: &[PathBuf], docs: usize, n: usize, tokenizer: &Tokenizer, skipped: usize) -> String {
    let mut d = format!(
        "{} file{}, {docs} document{}, {n} tokens ({})",
        files.len(),
        if files.len() == 1 { "" } else { "s" },
        if docs == 1 { "" } else { "s" },
        tokenizer.describe()
    );
    if skipped > 0 {
        d += &format!("; {skipped} files skipped (empty, not UTF-8, or plain text beside jsonl/parquet)");
    }
    d
}

/// `all` cut at token `cut` into two splits sharing its storage; a document the cut falls
/// inside becomes one document on each side.
/// `all` cut before its document `d` (`d` = its document count: all of it, then nothing):
/// views, no copy. A preference set splits this way, at a pair's start.
pub fn split_at_document(all: &Split, d: usize) -> (Split, Split) {
    let cut = if d >= all.docs.len() { all.len() } else { all.docs.range(d).start };
    split_views(all, cut)
}

fn split_views(all: &Split, cut: usize) -> (Split, Split) {
    let n = all.len();
    let (a, b) = all.tokens.split_at(cut);
    let starts = all.docs.to_vec();
    let mut left: Vec<u64> = starts.iter().copied().filter(|&s| (s as usize) < cut).collect();
    if cut > 0 || left.is_empty() {
        left.push(cut as u64);
    }
    if left.first() != Some(&0) {
        left.insert(0, 0);
    }
    left.dedup();
    let mut right: Vec<u64> = vec![0];
    right.extend(starts.iter().filter(|&&s| s as usize > cut && (s as usize) <= n).map(|&s| s - cut as u64));
    right.dedup();
    let mask = all.mask.as_ref().map(|m| m.split_at(cut));
    (
        Split { tokens: a, docs: DocIndex::from_starts(left), mask: mask.as_ref().map(|m| m.0.clone()) },
        Split { tokens: b, docs: DocIndex::from_starts(right), mask: mask.map(|m| m.1) },
    )
}

/// Tokenizes every item into `sink` in stream order: documents in parallel, a batch at a time.
fn stream(
    items: &[Item],
    tok: &Tokenizer,
    opts: &DocOpts,
    sink: &mut SplitSink,
    files: &mut Vec<PathBuf>,
    progress: &mut dyn FnMut(Progress),
) -> Result<(), DataError> {
    use rayon::prelude::*;
    let read = Arc::new(AtomicU64::new(0));
    let total_bytes: u64 = items.iter().map(|i| match i {
        Item::Docs { path } => fs::metadata(path).map(|m| m.len()).unwrap_or(0),
        _ => 0,
    }).sum();
    let vocab = tok.vocab_size();
    let whose = format!("the vocab size of tokenizer {}", tok.kind());
    let mut docs = 0u64;
    for item in items {
        match item {
            Item::Docs { path } => {
                // One thread reads and parses the next batch while the pool encodes this one.
                let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<Doc>>(1);
                let consumed: Result<(), DataError> = std::thread::scope(|s| {
                    let reader = s.spawn(|| {
                        let tx = tx;
                        read_docs(path, opts, &read, &mut |batch| tx.send(batch).map_err(|_| DataError::new("stopped")))
                    });
                    let mut in_file = 0u64;
                    let mut consume = || -> Result<(), DataError> {
                        for batch in rx.iter() {
                            if let Tokenizer::Char(v) = tok {
                                for d in &batch {
                                    check_chars(path, v, &d.text(), docs > 0)?;
                                }
                            }
                            let first = docs;
                            let enc: Vec<Result<Vec<Encoded>, DataError>> =
                                batch.par_iter().enumerate().map(|(k, d)| tok.encode_docs(d, first + k as u64 == 0)).collect();
                            let what = if opts.format == crate::DocFormat::Preference { "row" } else { "document" };
                            for e in enc {
                                in_file += 1;
                                for e in e.map_err(|e| DataError::at(path, format!("{what} {in_file}: {e}")))? {
                                    sink.push(&e)?;
                                    docs += 1;
                                }
                            }
                            progress(Progress { docs, bytes: read.load(Ordering::Relaxed), total_bytes });
                        }
                        Ok(())
                    };
                    let mine = consume();
                    // (Dropping the receiver stops a reader that is still sending.)
                    drop(rx);
                    let theirs = reader.join().expect("the document reader does not panic");
                    mine.and(theirs)
                });
                consumed?;
                files.push(path.clone());
            }
            Item::TokenFile { path, tokens } => {
                check_ids(path, tokens, vocab, &whose)?;
                sink.push(&Encoded { ids: tokens.to_vec(), mask: None })?;
                docs += 1;
                files.push(path.clone());
            }
            Item::Split { .. } => unreachable!("a split directory is the only item"),
        }
    }
    Ok(())
}

/// A `char` tokenizer must know every character (and `\n` when it joins documents).
fn check_chars(path: &Path, v: &crate::tokenizer::CharVocab, text: &str, joined: bool) -> Result<(), DataError> {
    if let Some((at, c)) = v.first_unknown(text) {
        return Err(DataError::at(path, format!("character {c:?} at byte {at} is not in the char tokenizer's vocabulary ({} chars)", v.chars().len())));
    }
    if joined && v.id('\n').is_none() {
        return Err(DataError::at(path, "the char tokenizer has no '\\n', which joins this file to the previous one"));
    }
    Ok(())
}

fn file_name(files: &[PathBuf], i: usize) -> String {
    files.get(i).and_then(|f| f.file_name()).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
}

fn show_paths(paths: &[PathBuf]) -> String {
    let v: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    v.join(", ")
}

fn resolve_tokenizer(choice: Choice, items: &[Item], opts: &DocOpts) -> Result<Tokenizer, DataError> {
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
            None if items.iter().any(|i| matches!(i, Item::Docs { .. })) => Tokenizer::Byte,
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
            // The documents' text, joined with blank lines (all of it read: a corpus-built
            // vocabulary needs the whole corpus).
            let mut texts = String::new();
            let read = Arc::new(AtomicU64::new(0));
            for i in items {
                if let Item::Docs { path } = i {
                    read_docs(path, opts, &read, &mut |batch| {
                        for d in batch {
                            if !texts.is_empty() {
                                texts.push_str(crate::tokenizer::SEPARATOR);
                            }
                            texts.push_str(&d.text());
                        }
                        Ok(())
                    })?;
                }
            }
            Tokenizer::from_spec(spec, Some(&texts))
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
                train: Split::plain(read_bin(&t)?),
                val: Split::plain(read_bin(&v)?),
                tokenizer: None,
                files: vec![t, v],
            });
        } else {
            let mut files = Vec::new();
            walk(p, &mut files, 0)?;
            // A dataset directory (Hugging Face's data/*.parquet beside a README): only its
            // structured files are documents.
            let structured = files.iter().any(|f| FileKind::of(f) != FileKind::Text);
            for f in files {
                if structured && FileKind::of(&f) == FileKind::Text && !is_token_file(&f) {
                    *skipped += 1;
                } else if let Some(item) = read_file(&f, false)? {
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
/// when empty or, for plain text, not UTF-8: `Ok(None)`). Text is checked here and read again
/// when tokenized, so no file stays in memory.
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
    if FileKind::of(path) == FileKind::Text {
        let bytes = fs::read(path).map_err(|e| DataError::io(path, "cannot read", e))?;
        if let Err(e) = std::str::from_utf8(&bytes) {
            if !explicit {
                return Ok(None);
            }
            return Err(DataError::at(
                path,
                format!("not UTF-8 text (invalid byte at offset {}); token files must end in .bin, .npy or .tok", e.valid_up_to()),
            ));
        }
    }
    Ok(Some(Item::Docs { path: path.to_path_buf() }))
}

fn read_prepared(dir: &Path) -> Result<Item, DataError> {
    let meta_path = dir.join(META_FILE);
    let s = fs::read_to_string(&meta_path).map_err(|e| DataError::io(&meta_path, "cannot read", e))?;
    let meta: serde_json::Value =
        serde_json::from_str(&s).map_err(|e| DataError::at(&meta_path, format!("not valid JSON: {e}")))?;
    if meta.get("format").and_then(|v| v.as_str()) != Some(META_FORMAT) {
        return Err(DataError::at(&meta_path, format!("\"format\" is not \"{META_FORMAT}\": not written by `kiln data prepare`")));
    }
    let version = meta.get("version").and_then(|v| v.as_u64());
    if !matches!(version, Some(1) | Some(META_VERSION)) {
        return Err(DataError::at(&meta_path, format!("\"version\" is {:?}, expected 1 or {META_VERSION}", meta.get("version"))));
    }
    let tokenizer = Tokenizer::find_in(dir)?.ok_or_else(|| DataError::at(dir, "prepared directory holds no tokenizer (tokenizer.json or kiln-tokenizer.json)"))?;
    let masked = meta.get("loss_mask").and_then(|v| v.as_bool()).unwrap_or(false);
    let mut splits = Vec::new();
    let mut files = Vec::new();
    for (stem, key) in [("train", "train_tokens"), ("val", "val_tokens")] {
        let path = dir.join(format!("{stem}.tok"));
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
        files.push(path);
        let split = if version == Some(1) {
            Split::plain(tokens)
        } else {
            let n = tokens.len();
            let docs = read_docs_file(&dir.join(format!("{stem}.docs")), n)?;
            let mask = if masked { Some(read_mask_file(&dir.join(format!("{stem}.mask")), n)?) } else { None };
            Split { tokens, docs, mask }
        };
        splits.push(split);
    }
    let val = splits.pop().unwrap();
    let train = splits.pop().unwrap();
    Ok(Item::Split { dir: dir.to_path_buf(), train, val, tokenizer: Some(tokenizer), files })
}

/// `kiln data prepare` with default options and no progress: see [`prepare_with`].
pub fn prepare(inputs: &[PathBuf], tokenizer_spec: &str, out: &Path, val_fraction: f64) -> Result<PrepareReport, DataError> {
    prepare_with(inputs, tokenizer_spec, out, val_fraction, &DocOpts::default(), &mut |_| {})
}

/// `kiln data prepare`: tokenizes `inputs` as [`load_docs`] does, in parallel, streaming into
/// `{train,val}.{tok,docs}` (and `.mask` for SFT formats), the tokenizer (`tokenizer.json` and
/// its `tokenizer_config.json`, or `kiln-tokenizer.json`) and `meta.json`. The corpus is never
/// held in memory: the stream goes to one file set, and its last `val_fraction` is then copied
/// out. Everything is written into a staging directory beside `out` that replaces `out` only
/// when complete, so a failure leaves `out` as it was (an existing `out` must be empty or a
/// prepared dataset). `progress` hears after every batch.
pub fn prepare_with(
    inputs: &[PathBuf],
    tokenizer_spec: &str,
    out: &Path,
    val_fraction: f64,
    opts: &DocOpts,
    progress: &mut dyn FnMut(Progress),
) -> Result<PrepareReport, DataError> {
    check_fraction(val_fraction)?;
    if let Ok(o) = out.canonicalize() {
        for i in inputs {
            let Ok(c) = i.canonicalize() else { continue };
            if c == o || c.starts_with(&o) {
                return Err(DataError::at(out, "the output directory is also an input"));
            }
        }
    }
    if out.exists() {
        let empty = fs::read_dir(out).map(|mut d| d.next().is_none()).unwrap_or(false);
        if !out.is_dir() || !(empty || out.join(META_FILE).is_file()) {
            return Err(DataError::at(out, "exists and is not a prepared dataset directory; give a new or empty --out"));
        }
    }
    let (items, tokenizer, skipped) = resolve_inputs(inputs, Choice::Spec(tokenizer_spec), opts)?;
    if let Some(Item::Split { dir, .. }) = items.first() {
        return Err(DataError::at(dir, "is already split (a prepared or train.bin/val.bin directory); prepare reads text, jsonl, parquet or token files"));
    }
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "prepared".into());
    let stage = out.with_file_name(format!(".{name}.kiln-prepare-{}", std::process::id()));
    let _ = fs::remove_dir_all(&stage);
    fs::create_dir_all(&stage).map_err(|e| DataError::io(&stage, "cannot create directory", e))?;
    let result = prepare_into(&stage, items, tokenizer, skipped, val_fraction, opts, progress).and_then(|mut rep| {
        let old = out.with_file_name(format!(".{name}.kiln-replaced-{}", std::process::id()));
        let had = out.exists();
        if had {
            fs::rename(out, &old).map_err(|e| DataError::io(out, "cannot replace", e))?;
        }
        fs::rename(&stage, out).map_err(|e| DataError::io(out, "cannot move the prepared dataset into place", e))?;
        if had {
            let _ = fs::remove_dir_all(&old);
        }
        rep.out = out.to_path_buf();
        Ok(rep)
    });
    if result.is_err() {
        let _ = fs::remove_dir_all(&stage);
    }
    result
}

fn prepare_into(
    out: &Path,
    items: Vec<Item>,
    tokenizer: Tokenizer,
    skipped: usize,
    val_fraction: f64,
    opts: &DocOpts,
    progress: &mut dyn FnMut(Progress),
) -> Result<PrepareReport, DataError> {
    let meta_path = out.join(META_FILE);
    let vocab = tokenizer.vocab_size();
    let masked = opts.format.masked();
    let mut sink = SplitSink::files(out, "all", vocab, masked)?;
    let mut files = Vec::new();
    stream(&items, &tokenizer, opts, &mut sink, &mut files, progress)?;
    let (n, docs) = sink.close()?;
    if n == 0 {
        return Err(DataError::new(format!("{}: no tokens after tokenizing", show_paths(&files))));
    }
    // The stream's tail becomes val: copied out by buffered reads and cut off train (no map of
    // the stream, so resident memory stays a batch's).
    crate::store::cut_files(out, "all", n as u64, n_train(n, val_fraction) as u64, masked)?;
    let (train_tokens, val_tokens) = (n_train(n, val_fraction), n - n_train(n, val_fraction));
    let description = describe(&files, docs, n, &tokenizer, skipped);
    tokenizer.save_in(out)?;
    let meta = serde_json::json!({
        "format": META_FORMAT,
        "version": META_VERSION,
        "tokenizer": tokenizer.kind(),
        "vocab_size": vocab,
        "val_fraction": val_fraction,
        "train_tokens": train_tokens,
        "val_tokens": val_tokens,
        "documents": docs,
        "data_format": opts.format.name(),
        "text_field": opts.text_field,
        "loss_mask": masked,
        "eos": tokenizer.eos_id(),
        "bos": tokenizer.bos_id(),
        "sources": files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "skipped": skipped,
        "description": description,
    });
    let text = serde_json::to_string_pretty(&meta).expect("meta JSON") + "\n";
    fs::write(&meta_path, text).map_err(|e| DataError::io(&meta_path, "cannot write", e))?;
    Ok(PrepareReport {
        out: out.to_path_buf(),
        files,
        skipped,
        documents: docs,
        train_tokens,
        val_tokens,
        tokenizer: tokenizer.kind(),
        vocab_size: vocab,
        description,
    })
}

