//! The training data: loading a run's corpora, checking them against the model, and drawing
//! the global batch's rows — one seeded draw per step, in a fixed order, so every layout sees
//! the same sequences, and a loader state small enough for the checkpoint, so a resumed run
//! draws exactly what the uninterrupted one would have.
//!
//! Rows are drawn one of two ways (`data.packing`): `windows`, nanoGPT's random windows of
//! `T + 1` tokens of the stream; or `documents`, whole documents packed into rows of `T`
//! tokens in a seeded order per epoch, a document longer than a row cut into row-sized
//! pieces, and the rest of a row that the next document does not fit padded (ignored). A packed
//! row carries each token's document start and position, so attention stays inside documents
//! and no token predicts across a boundary. With several sources (`data.sources`), each row
//! comes from source `i` with probability `weight_i / Σ weight`.

use crate::config::{Packing, RunConfig};
use crate::error::{user, Result};
use data::{DocOpts, Split, Tokenizer, TokenizerChoice};
use crate::checkpoint::{Cursor, LoaderState};
use crate::step::RowBuf;
use model::gpt::IGNORE_INDEX;
use std::path::PathBuf;
use tensor::Rng;

/// One corpus of the run.
#[derive(Debug, Clone)]
pub struct Source {
    pub name: String,
    pub weight: f64,
    pub train: Split,
    pub val: Split,
}

/// The run's corpora (one unless `data.sources` mixes several) and their tokenizer.
#[derive(Debug, Clone)]
pub struct TrainData {
    pub sources: Vec<Source>,
    pub tokenizer: Tokenizer,
    pub description: String,
    pub files: Vec<PathBuf>,
    /// GRPO's prompts (its sources' splits are then empty).
    pub prompts: Option<super::grpo::Prompts>,
}

impl TrainData {
    /// The first source's validation split (what `kiln eval` of a run reads).
    pub fn val(&self) -> &Split {
        &self.sources[0].val
    }

    /// Bytes of tokens held in memory (not memory-mapped).
    pub fn in_memory_bytes(&self) -> u64 {
        let mem = |s: &Split| if s.tokens.is_mapped() { 0 } else { 4 * s.len() as u64 * (1 + s.mask.is_some() as u64) };
        self.sources.iter().map(|s| mem(&s.train) + mem(&s.val)).sum()
    }
}

pub fn doc_opts(cfg: &RunConfig) -> DocOpts {
    DocOpts { text_field: cfg.data.text_field.clone(), format: cfg.data.format.0 }
}

/// Loads the training data for `cfg` (its paths or sources, or the Rust books) with `tokenizer`
/// when the run already has one (resume), else the configured tokenizer spec. Every source
/// after the first uses the first one's tokenizer.
pub fn load_data(cfg: &RunConfig, tokenizer: Option<Tokenizer>) -> Result<TrainData> {
    let (frac, opts) = (cfg.data.val_fraction, doc_opts(cfg));
    if opts.format == data::DocFormat::Prompt {
        let (prompts, tokenizer, files) = super::grpo::load_prompts(cfg, tokenizer)?;
        let empty = Split::plain(data::Tokens::from_vec(Vec::new()));
        let description = format!("{} ({} training and {} held-out prompts; {})", cfg.data.paths.join(", "), prompts.train.len(), prompts.val.len(), tokenizer.describe());
        let source = Source { name: cfg.data.paths.join(", "), weight: 1.0, train: empty.clone(), val: empty };
        return Ok(TrainData { sources: vec![source], tokenizer, description, files, prompts: Some(prompts) });
    }
    let choice = |t: Option<Tokenizer>| match t {
        Some(t) => TokenizerChoice::Given(t),
        None => TokenizerChoice::Spec(&cfg.data.tokenizer),
    };
    let specs: Vec<(String, f64)> = if cfg.data.sources.is_empty() {
        vec![(cfg.data.paths.join(", "), 1.0)]
    } else {
        cfg.data.sources.iter().map(|s| (s.path.clone(), s.weight)).collect()
    };
    let mut sources = Vec::new();
    let (mut tok, mut files, mut descs) = (tokenizer, Vec::new(), Vec::new());
    for (i, (name, weight)) in specs.into_iter().enumerate() {
        let ds = if cfg.data.paths.is_empty() && cfg.data.sources.is_empty() {
            if opts.format.masked() {
                return user(format!("data.format = \"{}\" needs --data: jsonl or parquet files of chats or prompt/completion pairs", opts.format.name()));
            }
            data::load_default_corpus(choice(tok.take()), frac)?
        } else {
            let paths: Vec<PathBuf> = if cfg.data.sources.is_empty() { cfg.data.paths.iter().map(PathBuf::from).collect() } else { vec![PathBuf::from(&name)] };
            if opts.format == data::DocFormat::Preference {
                pair_split(data::load_docs(&paths, choice(tok.take()), 0.0, &opts)?, frac, &name)?
            } else {
                data::load_docs(&paths, choice(tok.take()), frac, &opts)?
            }
        };
        tok = Some(ds.tokenizer.clone());
        files.extend(ds.files.iter().cloned());
        descs.push(if cfg.data.sources.is_empty() { ds.description.clone() } else { format!("source {i} ({name}, weight {weight}): {}", ds.description) });
        sources.push(Source { name, weight, train: ds.train, val: ds.val });
    }
    Ok(TrainData { sources, tokenizer: tok.expect("at least one source"), description: descs.join("; "), files, prompts: None })
}

/// A preference set's splits: its pairs (documents `2i`, `2i + 1`) cut whole, the last
/// `val_fraction` of them held out (at least one where the fraction is not 0). A prepared set
/// that brings its own split must split between pairs.
fn pair_split(mut ds: data::Dataset, frac: f64, name: &str) -> Result<data::Dataset> {
    if ds.val.is_empty() {
        let pairs = ds.train.docs.len() / 2;
        let held = if frac > 0.0 { ((pairs as f64 * frac).ceil() as usize).max(1) } else { 0 };
        if pairs < held + 1 {
            return user(format!("{name}: {pairs} preference pairs leave none to train on after data.val_fraction = {frac} holds {held} out"));
        }
        (ds.train, ds.val) = data::split_at_document(&ds.train, 2 * (pairs - held));
    }
    for (which, s) in [("training", &ds.train), ("validation", &ds.val)] {
        if s.docs.len() % 2 != 0 || s.mask.is_none() {
            return user(format!("{name}: the {which} split holds {} documents, not whole preference pairs (prepare preference rows with --val-fraction 0; kiln holds pairs out itself)", s.docs.len()));
        }
    }
    ds.description = format!("{} ({} training and {} held-out preference pairs)", ds.description, ds.train.docs.len() / 2, ds.val.docs.len() / 2);
    Ok(ds)
}

fn data_name(cfg: &RunConfig, s: &Source) -> String {
    if cfg.data.paths.is_empty() && cfg.data.sources.is_empty() { "the default corpus".into() } else { s.name.clone() }
}

/// Checks the data against the model: a training length within the model's positions, enough
/// tokens for one window (`train.seq_len + 1` tokens) in each split, a model vocabulary that
/// covers the tokenizer's, and a loss vocabulary between the two.
pub(super) fn check_data_fits(cfg: &mut RunConfig, ds: &TrainData, explicit: &std::collections::BTreeSet<String>) -> Result<()> {
    let (t, bs) = (cfg.seq_len(), cfg.model.block_size);
    if t > bs {
        return user(format!("train.seq_len ({t}) exceeds the model's positions, model.block_size ({bs})"));
    }
    if cfg.eval.seq_len > bs {
        return user(format!("eval.seq_len ({}) exceeds the model's positions, model.block_size ({bs})", cfg.eval.seq_len));
    }
    // A validation split shorter than a training window is evaluated in windows of what it
    // holds (unless eval.seq_len was set), and the run says so.
    let shortest = ds.sources.iter().map(|s| s.val.len()).min().unwrap_or(0);
    if !explicit.contains("eval.seq_len") && cfg.eval.seq_len == 0 && shortest < t + 1 && shortest >= 2 {
        cfg.eval.seq_len = shortest - 1;
        eprintln!("note: the validation split holds {shortest} tokens, less than a window of train.seq_len + 1 = {}: evaluating in windows of {} (eval.seq_len)", t + 1, shortest - 1);
    }
    let te = if cfg.eval.seq_len == 0 { t } else { cfg.eval.seq_len };
    // Preference pairs are rows of their own (cut at the row's length), not windows.
    let post_training = cfg.train.objective != crate::config::Objective::Lm;
    for s in ds.sources.iter().filter(|_| !post_training) {
        for (split, sp, t) in [("training", &s.train, t), ("validation", &s.val, te)] {
            if sp.len() < t + 1 {
                return user(format!(
                    "train.seq_len ({t}) needs windows of {} tokens, but the {split} split of {} has {}: use a shorter --seq-len or more data",
                    t + 1, data_name(cfg, s), sp.len()
                ));
            }
        }
    }
    let vocab = ds.tokenizer.vocab_size();
    if cfg.model.vocab_size != 0 && cfg.model.vocab_size < vocab {
        return user(format!("model.vocab_size ({}) is smaller than the {} tokenizer's vocabulary ({vocab})", cfg.model.vocab_size, ds.tokenizer.kind()));
    }
    let lv = cfg.model.loss_vocab;
    if lv != 0 && (lv < vocab || (cfg.model.vocab_size != 0 && lv > cfg.model.vocab_size)) {
        return user(format!("model.loss_vocab ({lv}) must lie between the tokenizer's vocabulary ({vocab}) and model.vocab_size ({})", cfg.model.vocab_size));
    }
    Ok(())
}

/// `len` tokens of source `src` from token `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub src: usize,
    pub start: usize,
    pub len: usize,
}

/// How one row is made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Row {
    /// Tokens `offset ..= offset + T` of source `src`'s training split.
    Window { src: usize, offset: usize },
    /// Documents (or pieces of one) back to back, the rest padding.
    Packed(Vec<Piece>),
}

/// Draws rows from a run's training splits (see the module comment).
pub struct Loader<'a> {
    sources: &'a [Source],
    packing: Packing,
    /// A preference objective: rows are pairs of documents, chosen then rejected.
    pairs: bool,
    reset_positions: bool,
    t: usize,
    seed: u64,
    state: LoaderState,
    /// Each source's document order for its current epoch.
    orders: Vec<(u64, Vec<u32>)>,
}

impl<'a> Loader<'a> {
    pub fn new(cfg: &RunConfig, data: &'a TrainData, state: Option<LoaderState>) -> Loader<'a> {
        let n = data.sources.len();
        let state = state.filter(|s| s.cursors.len() == n).unwrap_or(LoaderState { cursors: vec![Cursor::default(); n] });
        Loader {
            sources: &data.sources, packing: cfg.data.packing, pairs: cfg.train.objective.pairs().is_some(), reset_positions: cfg.data.reset_positions, t: cfg.seq_len(),
            seed: cfg.train.seed, state, orders: vec![(u64::MAX, Vec::new()); n],
        }
    }

    pub fn state(&self) -> &LoaderState {
        &self.state
    }

    /// Whether the loader keeps cursors a checkpoint must hold (packed documents, pairs).
    pub fn has_cursors(&self) -> bool {
        self.packing == Packing::Documents || self.pairs
    }

    /// Whether rows carry document starts and positions (packed documents; a preference pair's
    /// rows are one document each, from position 0, and need none).
    pub fn packed(&self) -> bool {
        self.packing == Packing::Documents && !self.pairs
    }

    /// The source of the next row: by weight (no draw with one source, so a single-corpus run
    /// draws exactly as before sources existed).
    fn pick(&self, rng: &mut Rng) -> usize {
        if self.sources.len() == 1 {
            return 0;
        }
        let total: f64 = self.sources.iter().map(|s| s.weight).sum();
        let mut u = rng.uniform() * total;
        for (i, s) in self.sources.iter().enumerate() {
            if u < s.weight {
                return i;
            }
            u -= s.weight;
        }
        self.sources.len() - 1
    }

    /// The global batch's `count` rows (a preference objective: `count / 2` pairs, each its
    /// chosen row then its rejected one).
    pub fn draw(&mut self, rng: &mut Rng, count: usize) -> Vec<Row> {
        if self.pairs {
            return (0..count / 2).flat_map(|_| {
                let src = self.pick(rng);
                self.pair(src)
            }).collect();
        }
        (0..count).map(|_| {
            let src = self.pick(rng);
            match self.packing {
                Packing::Windows => Row::Window { src, offset: rng.below((self.sources[src].train.len() - self.t) as u64) as usize },
                Packing::Documents => Row::Packed(self.pack(src)),
            }
        }).collect()
    }

    /// The next pair of source `src` (in a seeded order per epoch): its two rows.
    fn pair(&mut self, src: usize) -> [Row; 2] {
        let c = self.state.cursors[src];
        let split = &self.sources[src].train;
        let n = split.docs.len() as u64 / 2;
        let p = self.doc(src, c.epoch, c.next);
        let cur = &mut self.state.cursors[src];
        cur.next += 1;
        if cur.next == n {
            (cur.epoch, cur.next) = (cur.epoch + 1, 0);
        }
        let split = &self.sources[src].train;
        [0, 1].map(|side| pair_row(split, src, 2 * p + side, self.t))
    }

    /// Document `k` of source `src`'s order for `epoch` (a seeded shuffle per epoch; of its
    /// pairs under a preference objective).
    fn doc(&mut self, src: usize, epoch: u64, k: u64) -> usize {
        if self.orders[src].0 != epoch {
            let n = self.sources[src].train.docs.len() / if self.pairs { 2 } else { 1 };
            let mut order: Vec<u32> = (0..n as u32).collect();
            let mut r = Rng::new(tensor::rng::mix64(self.seed ^ tensor::rng::mix64(((src as u64) << 32) ^ epoch ^ 0x5eed_d0c5)));
            for i in (1..n).rev() {
                order.swap(i, r.below(i as u64 + 1) as usize);
            }
            self.orders[src] = (epoch, order);
        }
        self.orders[src].1[k as usize] as usize
    }

    /// One row of whole documents from source `src`'s stream.
    fn pack(&mut self, src: usize) -> Vec<Piece> {
        let (t, n_docs) = (self.t, self.sources[src].train.docs.len() as u64);
        let mut pieces = Vec::new();
        let mut used = 0;
        loop {
            let c = self.state.cursors[src];
            let d = self.doc(src, c.epoch, c.next);
            let r = self.sources[src].train.docs.range(d);
            let rest = r.len() - c.offset as usize;
            let advance = |c: &mut Cursor| {
                c.next += 1;
                c.offset = 0;
                if c.next == n_docs {
                    (c.epoch, c.next) = (c.epoch + 1, 0);
                }
            };
            if rest <= t - used {
                if rest > 0 {
                    pieces.push(Piece { src, start: r.start + c.offset as usize, len: rest });
                }
                used += rest;
                advance(&mut self.state.cursors[src]);
                if used == t {
                    break;
                }
            } else if used == 0 {
                // Longer than a row: a row's worth now, the rest in the next rows.
                pieces.push(Piece { src, start: r.start + c.offset as usize, len: t });
                self.state.cursors[src].offset += t as u64;
                break;
            } else {
                break;
            }
        }
        pieces
    }

    /// Writes `rows` of the training splits into `buf` ([`fill_rows`]).
    pub fn fill(&self, rows: &[Row], buf: &mut RowBuf) {
        let splits: Vec<&Split> = self.sources.iter().map(|s| &s.train).collect();
        fill_rows(&splits, rows, self.t, self.reset_positions, buf);
    }
}

/// Document `d` of `split` as a row of its own: its first `t` tokens, then padding.
pub(super) fn pair_row(split: &Split, src: usize, d: usize, t: usize) -> Row {
    let r = split.docs.range(d);
    Row::Packed(vec![Piece { src, start: r.start, len: r.len().min(t) }])
}

/// Writes `rows` (their sources indexing `splits`) into `buf`, row `i` at `i·T`: inputs,
/// targets (ignored where the loss mask says so, at each piece's last token, and on padding)
/// and, when `buf` has room for them, the document starts and positions (restarting per
/// document with `reset_positions`).
pub fn fill_rows(splits: &[&Split], rows: &[Row], t: usize, reset_positions: bool, buf: &mut RowBuf) {
    let mut tmp = vec![0u32; t + 1];
    let mut mask = vec![1u32; t + 1];
    for (i, row) in rows.iter().enumerate() {
        let (x, y) = (&mut buf.x[i * t..(i + 1) * t], &mut buf.y[i * t..(i + 1) * t]);
        match row {
            Row::Window { src, offset } => {
                let s = splits[*src];
                s.tokens.copy_to(*offset, &mut tmp);
                if let Some(m) = &s.mask {
                    m.copy_to(*offset, &mut mask);
                }
                x.copy_from_slice(&tmp[..t]);
                for j in 0..t {
                    y[j] = if mask[j + 1] == 0 { IGNORE_INDEX } else { tmp[j + 1] as i32 };
                }
            }
            Row::Packed(pieces) => {
                let packed = !buf.start.is_empty();
                let mut k = 0;
                for p in pieces {
                    let s = splits[p.src];
                    s.tokens.copy_to(p.start, &mut x[k..k + p.len]);
                    if let Some(m) = &s.mask {
                        m.copy_to(p.start, &mut mask[..p.len]);
                    }
                    for j in 0..p.len {
                        y[k + j] = if j + 1 == p.len || (s.mask.is_some() && mask[j + 1] == 0) { IGNORE_INDEX } else { x[k + j + 1] as i32 };
                        if packed {
                            buf.start[i * t + k + j] = k as u32;
                            buf.pos[i * t + k + j] = if reset_positions { j } else { k + j } as u32;
                        }
                    }
                    k += p.len;
                }
                // Padding: its own segment, never a target.
                for j in k..t {
                    x[j] = 0;
                    y[j] = IGNORE_INDEX;
                    if packed {
                        buf.start[i * t + j] = k as u32;
                        buf.pos[i * t + j] = if reset_positions { j - k } else { j } as u32;
                    }
                }
            }
        }
    }
}

/// The evaluation rows of a split: non-overlapping windows, or (`packed`) its documents packed
/// in order, at most `max_rows` (0 = all).
pub(super) fn eval_rows(split: &Split, t: usize, packed: bool, max_rows: usize) -> Vec<Row> {
    let mut rows = Vec::new();
    match if packed { Packing::Documents } else { Packing::Windows } {
        Packing::Windows => {
            let n = (split.len() - 1) / t;
            rows.extend((0..n).map(|k| Row::Window { src: 0, offset: k * t }));
        }
        Packing::Documents => {
            let (mut d, mut off, mut cur, mut used) = (0, 0, Vec::new(), 0);
            while d < split.docs.len() {
                let r = split.docs.range(d);
                let rest = r.len() - off;
                if rest <= t - used {
                    cur.push(Piece { src: 0, start: r.start + off, len: rest });
                    (used, d, off) = (used + rest, d + 1, 0);
                } else if used == 0 {
                    cur.push(Piece { src: 0, start: r.start + off, len: t });
                    (used, off) = (t, off + t);
                } else {
                    used = t;
                }
                if used == t {
                    rows.push(Row::Packed(std::mem::take(&mut cur)));
                    used = 0;
                }
                if max_rows > 0 && rows.len() >= max_rows {
                    break;
                }
            }
            if !cur.is_empty() {
                rows.push(Row::Packed(cur));
            }
        }
    }
    if max_rows > 0 {
        rows.truncate(max_rows);
    }
    rows
}
