//! Byte-level BPE: GPT-2-style pre-splitting, deterministic training, rank-based encoding.
//!
//! Training (as in GPT-2 / HF `tokenizers`): split the text into words once and count them;
//! then repeatedly merge the most frequent adjacent pair over the unique words, keeping pair
//! counts up to date incrementally (only the words containing the merged pair are touched).
//! Ties go to the lowest pair `(a, b)`, so the result depends only on the text and vocab size.
//! Merges never cross word boundaries. Token ids: 0..256 are bytes, 256 + i is merge i,
//! specials (if any) come after the merges.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::error::DataError;
use crate::tokenizer::Tokenizer;

/// The name of the pre-split pattern, stored in the tokenizer JSON.
pub(crate) const PATTERN_NAME: &str = "gpt2";

/// Longest piece [`pre_split`] emits; longer runs (a line of `=====`) are cut at char boundaries
/// so encoding stays linear. Training and encoding use the same split, so this is consistent.
pub const MAX_PIECE_BYTES: usize = 256;

/// FxHash (rustc's hasher): fast for the integer and short-string keys used here.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.write_u64(u64::from_le_bytes(c.try_into().unwrap()));
        }
        let mut last = 0u64;
        for (i, &b) in chunks.remainder().iter().enumerate() {
            last |= (b as u64) << (8 * i);
        }
        self.write_u64(last ^ bytes.len() as u64);
    }
    fn write_u8(&mut self, i: u8) {
        self.write_u64(i as u64)
    }
    fn write_u32(&mut self, i: u32) {
        self.write_u64(i as u64)
    }
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64)
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(5) ^ i).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

#[inline]
fn pair_key(a: u32, b: u32) -> u64 {
    ((a as u64) << 32) | b as u64
}

#[inline]
fn unpack(k: u64) -> (u32, u32) {
    ((k >> 32) as u32, k as u32)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

#[inline]
fn class(c: char) -> Class {
    if c.is_alphabetic() {
        Class::Letter
    } else if c.is_numeric() {
        Class::Number
    } else if c.is_whitespace() {
        Class::Space
    } else {
        Class::Other
    }
}

/// Splits `text` into words with (a hand-written equivalent of) GPT-2's pattern
/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`:
/// contractions, letter runs, digit runs and punctuation runs, each keeping one leading space;
/// whitespace runs leave their last space to the next word. Pieces longer than
/// [`MAX_PIECE_BYTES`] are cut. The pieces concatenate back to `text` exactly.
pub fn pre_split<'a>(text: &'a str, mut f: impl FnMut(&'a str)) {
    let bytes = text.as_bytes();
    let n = bytes.len();
    let mut i = 0;
    let char_at = |i: usize| text[i..].chars().next().unwrap();
    // End of the run of `cls` chars starting at byte `j`.
    let run_end = |mut j: usize, cls: Class| {
        while j < n {
            let c = char_at(j);
            if class(c) != cls {
                break;
            }
            j += c.len_utf8();
        }
        j
    };
    while i < n {
        let c = char_at(i);
        let mut end;
        // Contractions.
        if c == '\'' && i + 1 < n {
            let rest = &bytes[i + 1..];
            let m = if rest.starts_with(b"re") || rest.starts_with(b"ve") || rest.starts_with(b"ll") {
                3
            } else if matches!(rest[0], b's' | b't' | b'm' | b'd') {
                2
            } else {
                0
            };
            if m > 0 {
                emit(text, i, i + m, &mut f);
                i += m;
                continue;
            }
        }
        let cls = class(c);
        if cls == Class::Space {
            // ` ?X+` with X a non-space class.
            if c == ' ' && i + 1 < n {
                let d = char_at(i + 1);
                let dc = class(d);
                if dc != Class::Space {
                    end = run_end(i + 1, dc);
                    emit(text, i, end, &mut f);
                    i = end;
                    continue;
                }
            }
            end = run_end(i, Class::Space);
            if end < n {
                // `\s+(?!\S)`: leave the last whitespace char for the next word.
                let last = text[..end].chars().next_back().unwrap();
                if end - last.len_utf8() > i {
                    end -= last.len_utf8();
                }
            }
        } else {
            end = run_end(i, cls);
        }
        emit(text, i, end, &mut f);
        i = end;
    }
}

#[inline]
fn emit<'a>(text: &'a str, mut start: usize, end: usize, f: &mut impl FnMut(&'a str)) {
    while end - start > MAX_PIECE_BYTES {
        let mut cut = start + MAX_PIECE_BYTES;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        f(&text[start..cut]);
        start = cut;
    }
    f(&text[start..end]);
}

/// A trained byte-level BPE tokenizer.
#[derive(Clone)]
pub struct Bpe {
    merges: Vec<(u32, u32)>,
    ranks: FxMap<u64, u32>,
    /// Bytes of every non-special id.
    pieces: Vec<Vec<u8>>,
    specials: Vec<String>,
}

impl PartialEq for Bpe {
    fn eq(&self, other: &Bpe) -> bool {
        self.merges == other.merges && self.specials == other.specials
    }
}

impl std::fmt::Debug for Bpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bpe({} merges, {} specials)", self.merges.len(), self.specials.len())
    }
}

impl Bpe {
    /// Builds from merges (merge `i` creates id `256 + i` and may only use ids below that) and
    /// special tokens. The error message says which merge or special is wrong.
    pub fn from_parts(merges: Vec<(u32, u32)>, specials: Vec<String>) -> Result<Bpe, String> {
        let mut pieces: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        let mut ranks = FxMap::default();
        for (i, &(a, b)) in merges.iter().enumerate() {
            let next = 256 + i as u32;
            if a >= next || b >= next {
                return Err(format!("merge {i} is [{a}, {b}] but may only use ids below {next}"));
            }
            if ranks.insert(pair_key(a, b), i as u32).is_some() {
                return Err(format!("merge {i} [{a}, {b}] appears twice"));
            }
            let mut p = pieces[a as usize].clone();
            p.extend_from_slice(&pieces[b as usize]);
            pieces.push(p);
        }
        for (i, s) in specials.iter().enumerate() {
            if s.is_empty() {
                return Err(format!("special token {i} is empty"));
            }
            if specials[..i].contains(s) {
                return Err(format!("special token {s:?} appears twice"));
            }
        }
        Ok(Bpe { merges, ranks, pieces, specials })
    }

    pub fn merges(&self) -> &[(u32, u32)] {
        &self.merges
    }

    pub fn specials(&self) -> &[String] {
        &self.specials
    }

    pub fn vocab_size(&self) -> usize {
        256 + self.merges.len() + self.specials.len()
    }

    /// Id of a special token such as `<|endoftext|>`.
    pub fn special_id(&self, s: &str) -> Option<u32> {
        self.specials.iter().position(|x| x == s).map(|i| (256 + self.merges.len() + i) as u32)
    }

    /// The bytes of token `id` (`None` for specials and unknown ids).
    pub fn piece(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize).map(|v| v.as_slice())
    }

    /// Encodes `text`; special-token strings in the text become their ids. Words are cached
    /// for the duration of the call.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut cache: FxMap<&str, Vec<u32>> = FxMap::default();
        let mut rest = text;
        loop {
            // Earliest special token occurrence (longest wins at the same position).
            let mut next: Option<(usize, usize)> = None;
            for (k, s) in self.specials.iter().enumerate() {
                if let Some(p) = rest.find(s.as_str()) {
                    let better = match next {
                        None => true,
                        Some((q, j)) => p < q || (p == q && s.len() > self.specials[j].len()),
                    };
                    if better {
                        next = Some((p, k));
                    }
                }
            }
            let (plain, after) = match next {
                Some((p, _)) => (&rest[..p], Some(p)),
                None => (rest, None),
            };
            pre_split(plain, |w| {
                if let Some(ids) = cache.get(w) {
                    out.extend_from_slice(ids);
                } else {
                    let ids = self.encode_word(w.as_bytes());
                    out.extend_from_slice(&ids);
                    cache.insert(w, ids);
                }
            });
            match (after, next) {
                (Some(p), Some((_, k))) => {
                    out.push((256 + self.merges.len() + k) as u32);
                    rest = &rest[p + self.specials[k].len()..];
                }
                _ => break,
            }
        }
        out
    }

    /// Applies merges by rank (lowest first) to one word's bytes.
    fn encode_word(&self, word: &[u8]) -> Vec<u32> {
        let mut syms: Vec<u32> = word.iter().map(|&b| b as u32).collect();
        loop {
            let mut best: Option<(u32, usize)> = None;
            for i in 0..syms.len().saturating_sub(1) {
                if let Some(&r) = self.ranks.get(&pair_key(syms[i], syms[i + 1])) {
                    if best.is_none_or(|(br, _)| r < br) {
                        best = Some((r, i));
                    }
                }
            }
            let Some((rank, first)) = best else { break };
            let (a, b) = self.merges[rank as usize];
            let new_id = 256 + rank;
            let mut w = first;
            let mut r = first;
            while r < syms.len() {
                if r + 1 < syms.len() && syms[r] == a && syms[r + 1] == b {
                    syms[w] = new_id;
                    r += 2;
                } else {
                    syms[w] = syms[r];
                    r += 1;
                }
                w += 1;
            }
            syms.truncate(w);
        }
        syms
    }

    /// Lossy decode: invalid UTF-8 and unknown ids become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut out = String::new();
        let n_plain = self.pieces.len();
        for &id in ids {
            let i = id as usize;
            if i < n_plain {
                bytes.extend_from_slice(&self.pieces[i]);
            } else if let Some(s) = self.specials.get(i - n_plain) {
                bytes.extend_from_slice(s.as_bytes());
            } else {
                out.push_str(&String::from_utf8_lossy(&bytes));
                bytes.clear();
                out.push(char::REPLACEMENT_CHARACTER);
            }
        }
        out.push_str(&String::from_utf8_lossy(&bytes));
        out
    }
}

/// Trains a byte-level BPE with `vocab_size - 256` merges (stops early, with a smaller vocab,
/// if the text runs out of pairs). See the module docs for the algorithm.
pub fn train_bpe(text: &str, vocab_size: usize) -> Result<Tokenizer, DataError> {
    train_bpe_with_specials(text, vocab_size, &[])
}

/// [`train_bpe`] plus special tokens (e.g. `<|endoftext|>`), which count towards `vocab_size`
/// and take the last ids. Special strings in `text` are excluded from training.
pub fn train_bpe_with_specials(text: &str, vocab_size: usize, specials: &[&str]) -> Result<Tokenizer, DataError> {
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
    let n_merges = vocab_size - min;

    // 1. Word frequencies (specials removed from the text first).
    let mut counts: FxMap<&str, u64> = FxMap::default();
    let mut segments: Vec<&str> = vec![text];
    for s in specials {
        segments = segments.iter().flat_map(|p| p.split(s)).collect();
    }
    for seg in segments {
        pre_split(seg, |w| *counts.entry(w).or_insert(0) += 1);
    }
    let mut uniq: Vec<(&str, u64)> = counts.into_iter().collect();
    uniq.sort_unstable(); // determinism of the internal order (results do not depend on it)
    let mut words: Vec<Vec<u32>> = uniq.iter().map(|(w, _)| w.bytes().map(u32::from).collect()).collect();
    let freqs: Vec<i64> = uniq.iter().map(|&(_, c)| c as i64).collect();
    drop(uniq);

    // 2. Initial pair counts and where each pair occurs.
    let mut pair_counts: FxMap<u64, i64> = FxMap::default();
    let mut where_: FxMap<u64, Vec<u32>> = FxMap::default();
    for (wi, w) in words.iter().enumerate() {
        for p in w.windows(2) {
            let k = pair_key(p[0], p[1]);
            *pair_counts.entry(k).or_insert(0) += freqs[wi];
            let list = where_.entry(k).or_default();
            if list.last() != Some(&(wi as u32)) {
                list.push(wi as u32);
            }
        }
    }
    let mut heap: BinaryHeap<(i64, Reverse<u64>)> = pair_counts.iter().map(|(&k, &c)| (c, Reverse(k))).collect();

    // 3. Merge loop.
    let mut merges: Vec<(u32, u32)> = Vec::with_capacity(n_merges);
    let mut changed: Vec<u64> = Vec::new();
    while merges.len() < n_merges {
        let Some((c, Reverse(k))) = heap.pop() else { break };
        if c <= 0 || pair_counts.get(&k) != Some(&c) {
            continue; // stale entry
        }
        let (a, b) = unpack(k);
        let new_id = 256 + merges.len() as u32;
        merges.push((a, b));
        let mut ws = where_.remove(&k).unwrap_or_default();
        ws.sort_unstable();
        ws.dedup();
        changed.clear();
        for &wi in &ws {
            let w = &mut words[wi as usize];
            if !w.windows(2).any(|p| p[0] == a && p[1] == b) {
                continue;
            }
            let f = freqs[wi as usize];
            for p in w.windows(2) {
                let q = pair_key(p[0], p[1]);
                *pair_counts.get_mut(&q).unwrap() -= f;
                changed.push(q);
            }
            let mut dst = 0;
            let mut src = 0;
            while src < w.len() {
                if src + 1 < w.len() && w[src] == a && w[src + 1] == b {
                    w[dst] = new_id;
                    src += 2;
                } else {
                    w[dst] = w[src];
                    src += 1;
                }
                dst += 1;
            }
            w.truncate(dst);
            for p in w.windows(2) {
                let q = pair_key(p[0], p[1]);
                *pair_counts.entry(q).or_insert(0) += f;
                changed.push(q);
                if p[0] == new_id || p[1] == new_id {
                    let list = where_.entry(q).or_default();
                    if list.last() != Some(&wi) {
                        list.push(wi);
                    }
                }
            }
        }
        changed.sort_unstable();
        changed.dedup();
        for &q in &changed {
            let c = pair_counts[&q];
            if c > 0 {
                heap.push((c, Reverse(q)));
            } else {
                pair_counts.remove(&q);
                where_.remove(&q);
            }
        }
        pair_counts.remove(&k);
    }
    let specials = specials.iter().map(|s| s.to_string()).collect();
    let bpe = Bpe::from_parts(merges, specials).map_err(DataError::new)?;
    Ok(Tokenizer::Bpe(bpe))
}
