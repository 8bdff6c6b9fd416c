//! A split's storage: its tokens, its document boundaries and (SFT) its loss mask, held in
//! memory or streamed to memory-mapped files as documents arrive.
//!
//! Beside a shard `train.tok` ([`crate::shard`]), a prepared directory holds `train.docs` and,
//! for supervised fine-tuning, `train.mask`. Both share the shard's 32-byte header layout, all
//! little endian: magic (8 bytes: `b"KILNDOC\0"` / `b"KILNMSK\0"`), version u32 = 1, element
//! width u32 (8 / 1), element count u64, a u32 that is 0, reserved u32 = 0; then the elements.
//! `train.docs` holds `n + 1` u64 offsets: document `i` is tokens `docs[i] .. docs[i + 1]`, the
//! first is 0 and the last the token count. `train.mask` holds one byte per token, 1 where the
//! token carries loss as a prediction target.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::DataError;
use crate::shard::{map_file, HEADER_BYTES, MAGIC, VERSION};
use crate::tokenizer::Encoded;
use crate::tokens::Tokens;

pub const DOCS_MAGIC: &[u8; 8] = b"KILNDOC\0";
pub const MASK_MAGIC: &[u8; 8] = b"KILNMSK\0";

/// Document boundaries of a token stream.
#[derive(Clone)]
pub struct DocIndex {
    backing: DocBacking,
    /// Entries (documents + 1).
    n: usize,
}

#[derive(Clone)]
enum DocBacking {
    Owned(Arc<Vec<u64>>),
    Mapped(Arc<Mmap>),
}

impl DocIndex {
    /// From offsets `0 = s[0] <= s[1] <= ... <= s[n]`.
    pub fn from_starts(starts: Vec<u64>) -> DocIndex {
        assert!(starts.first() == Some(&0), "document offsets start at 0");
        let n = starts.len();
        DocIndex { backing: DocBacking::Owned(Arc::new(starts)), n }
    }

    /// One document of `len` tokens (a token file brings no boundaries).
    pub fn single(len: usize) -> DocIndex {
        DocIndex::from_starts(if len == 0 { vec![0] } else { vec![0, len as u64] })
    }

    /// The number of documents.
    pub fn len(&self) -> usize {
        self.n - 1
    }

    pub fn is_empty(&self) -> bool {
        self.n <= 1
    }

    #[inline]
    fn at(&self, i: usize) -> u64 {
        match &self.backing {
            DocBacking::Owned(v) => v[i],
            DocBacking::Mapped(m) => {
                let o = HEADER_BYTES + 8 * i;
                u64::from_le_bytes(m[o..o + 8].try_into().unwrap())
            }
        }
    }

    /// Document `i`'s tokens.
    pub fn range(&self, i: usize) -> Range<usize> {
        assert!(i < self.len(), "document {i} out of range for {} documents", self.len());
        self.at(i) as usize..self.at(i + 1) as usize
    }

    /// The document holding token `t`.
    pub fn doc_of(&self, t: usize) -> usize {
        let (mut lo, mut hi) = (0, self.len());
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if self.at(mid) as usize <= t {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// The offsets as a vector (copies).
    pub fn to_vec(&self) -> Vec<u64> {
        (0..self.n).map(|i| self.at(i)).collect()
    }
}

impl std::fmt::Debug for DocIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DocIndex({} documents)", self.len())
    }
}

impl PartialEq for DocIndex {
    fn eq(&self, other: &DocIndex) -> bool {
        self.n == other.n && (0..self.n).all(|i| self.at(i) == other.at(i))
    }
}

/// One split of a dataset: tokens, document boundaries, and the loss mask (SFT).
#[derive(Clone, Debug, PartialEq)]
pub struct Split {
    pub tokens: Tokens,
    pub docs: DocIndex,
    /// One 0/1 per token ([`Encoded::mask`]); `None`: every token carries loss.
    pub mask: Option<Tokens>,
}

impl Split {
    /// Tokens with no boundaries inside and no mask.
    pub fn plain(tokens: Tokens) -> Split {
        let docs = DocIndex::single(tokens.len());
        Split { tokens, docs, mask: None }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// Writes an array file: the 32-byte header (count patched at the end), then elements.
pub(crate) struct ArrayWriter {
    path: PathBuf,
    w: BufWriter<File>,
    magic: [u8; 8],
    width: usize,
    extra: u32,
    count: u64,
}

impl ArrayWriter {
    pub(crate) fn create(path: &Path, magic: &[u8; 8], width: usize, extra: u32) -> Result<ArrayWriter, DataError> {
        let f = File::create(path).map_err(|e| DataError::io(path, "cannot create", e))?;
        let mut a = ArrayWriter { path: path.to_path_buf(), w: BufWriter::with_capacity(1 << 20, f), magic: *magic, width, extra, count: 0 };
        let h = a.header();
        a.w.write_all(&h).map_err(|e| DataError::io(path, "cannot write", e))?;
        Ok(a)
    }

    fn header(&self) -> Vec<u8> {
        let mut h = Vec::with_capacity(HEADER_BYTES);
        h.extend_from_slice(&self.magic);
        h.extend_from_slice(&VERSION.to_le_bytes());
        h.extend_from_slice(&(self.width as u32).to_le_bytes());
        h.extend_from_slice(&self.count.to_le_bytes());
        h.extend_from_slice(&self.extra.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h
    }

    pub(crate) fn push(&mut self, values: impl Iterator<Item = u64>) -> Result<(), DataError> {
        let mut buf = Vec::with_capacity(4096);
        for v in values {
            match self.width {
                1 => buf.push(v as u8),
                2 => buf.extend_from_slice(&(v as u16).to_le_bytes()),
                4 => buf.extend_from_slice(&(v as u32).to_le_bytes()),
                _ => buf.extend_from_slice(&v.to_le_bytes()),
            }
            self.count += 1;
        }
        self.w.write_all(&buf).map_err(|e| DataError::io(&self.path, "cannot write", e))
    }

    /// Appends `bytes`, which hold `count` elements already in the file's encoding.
    fn push_raw(&mut self, bytes: &[u8], count: u64) -> Result<(), DataError> {
        self.count += count;
        self.w.write_all(bytes).map_err(|e| DataError::io(&self.path, "cannot write", e))
    }

    /// Patches the header's count and closes the file.
    pub(crate) fn finish(self) -> Result<PathBuf, DataError> {
        let h = self.header();
        let path = self.path;
        let mut f = self.w.into_inner().map_err(|e| DataError::io(&path, "cannot write", e.into_error()))?;
        f.seek(SeekFrom::Start(0)).and_then(|_| f.write_all(&h)).and_then(|_| f.sync_data()).map_err(|e| DataError::io(&path, "cannot write", e))?;
        Ok(path)
    }
}

/// Maps an array file written by [`ArrayWriter`], checking magic, version, width, the zero
/// fields and the size: returns the map, element count and the `extra` field.
pub(crate) fn map_array(path: &Path, magic: &[u8; 8], widths: &[usize], what: &str) -> Result<(Arc<Mmap>, usize, usize, u32), DataError> {
    let map = map_file(path)?;
    if map.len() < HEADER_BYTES {
        return Err(DataError::at(path, format!("truncated {what}: {} bytes, shorter than the {HEADER_BYTES}-byte header", map.len())));
    }
    if &map[0..8] != magic {
        return Err(DataError::at(path, format!("not a kiln {what} (bad magic, expected {:?})", String::from_utf8_lossy(magic))));
    }
    let u32_at = |o: usize| u32::from_le_bytes(map[o..o + 4].try_into().unwrap());
    if u32_at(8) != VERSION {
        return Err(DataError::at(path, format!("{what} format version {} is not supported (expected {VERSION})", u32_at(8))));
    }
    let width = u32_at(12) as usize;
    if !widths.contains(&width) {
        return Err(DataError::at(path, format!("{what} dtype {width} (bytes per element) is not supported (expected {widths:?})")));
    }
    if u32_at(28) != 0 {
        return Err(DataError::at(path, format!("{what} reserved field is {}, expected 0", u32_at(28))));
    }
    let count = u64::from_le_bytes(map[16..24].try_into().unwrap());
    let expected = count.checked_mul(width as u64).and_then(|b| b.checked_add(HEADER_BYTES as u64));
    if expected != Some(map.len() as u64) {
        let exp = expected.map(|e| e.to_string()).unwrap_or_else(|| "an impossible number of".into());
        let kind = if expected.is_some_and(|e| e > map.len() as u64) { format!("truncated {what}") } else { format!("{what} size mismatch") };
        return Err(DataError::at(path, format!("{kind}: header says {count} elements of {width} bytes, so {exp} bytes expected, but the file has {} bytes", map.len())));
    }
    let extra = u32_at(24);
    Ok((map, count as usize, width, extra))
}

/// Reads `path` (a `.docs` file) for a split of `tokens` tokens.
pub(crate) fn read_docs_file(path: &Path, tokens: usize) -> Result<DocIndex, DataError> {
    let (map, n, _, _) = map_array(path, DOCS_MAGIC, &[8], "document index")?;
    let idx = DocIndex { backing: DocBacking::Mapped(map), n };
    if n == 0 || idx.at(0) != 0 || idx.at(n - 1) != tokens as u64 {
        return Err(DataError::at(path, format!("document offsets must run from 0 to the split's {tokens} tokens")));
    }
    if let Some(i) = (1..n).find(|&i| idx.at(i) < idx.at(i - 1)) {
        return Err(DataError::at(path, format!("document offset {i} ({}) is below the one before it ({})", idx.at(i), idx.at(i - 1))));
    }
    Ok(idx)
}

/// Reads `path` (a `.mask` file) for a split of `tokens` tokens.
pub(crate) fn read_mask_file(path: &Path, tokens: usize) -> Result<Tokens, DataError> {
    let (map, n, _, _) = map_array(path, MASK_MAGIC, &[1], "loss mask")?;
    if n != tokens {
        return Err(DataError::at(path, format!("holds {n} mask bytes for a split of {tokens} tokens")));
    }
    let mask = Tokens::mapped(map, HEADER_BYTES, 1, n);
    if let Some((i, v)) = mask.find_at_or_above(2) {
        return Err(DataError::at(path, format!("mask byte {i} is {v}, not 0 or 1")));
    }
    Ok(mask)
}

/// A split being built, document by document: in memory, or streamed to files.
pub(crate) enum SplitSink {
    Memory { ids: Vec<u32>, starts: Vec<u64>, mask: Option<Vec<u32>> },
    Files { tok: ArrayWriter, docs: ArrayWriter, mask: Option<ArrayWriter>, tokens: u64 },
}

impl SplitSink {
    pub(crate) fn memory(masked: bool) -> SplitSink {
        SplitSink::Memory { ids: Vec::new(), starts: vec![0], mask: masked.then(Vec::new) }
    }

    /// Files `{stem}.tok`, `{stem}.docs` and (masked) `{stem}.mask` in `dir`.
    pub(crate) fn files(dir: &Path, stem: &str, vocab: usize, masked: bool) -> Result<SplitSink, DataError> {
        if vocab == 0 || vocab > u32::MAX as usize {
            return Err(DataError::at(dir, format!("cannot write a shard with vocab size {vocab}")));
        }
        let width = if vocab <= 1 << 16 { 2 } else { 4 };
        let tok = ArrayWriter::create(&dir.join(format!("{stem}.tok")), MAGIC, width, vocab as u32)?;
        let mut docs = ArrayWriter::create(&dir.join(format!("{stem}.docs")), DOCS_MAGIC, 8, 0)?;
        docs.push(std::iter::once(0))?;
        let mask = if masked { Some(ArrayWriter::create(&dir.join(format!("{stem}.mask")), MASK_MAGIC, 1, 0)?) } else { None };
        Ok(SplitSink::Files { tok, docs, mask, tokens: 0 })
    }

    pub(crate) fn push(&mut self, e: &Encoded) -> Result<(), DataError> {
        if e.ids.is_empty() {
            return Ok(());
        }
        let ones = || std::iter::repeat_n(1u8, e.ids.len());
        match self {
            SplitSink::Memory { ids, starts, mask } => {
                ids.extend_from_slice(&e.ids);
                starts.push(ids.len() as u64);
                if let Some(m) = mask {
                    match &e.mask {
                        Some(v) => m.extend(v.iter().map(|&x| x as u32)),
                        None => m.extend(ones().map(u32::from)),
                    }
                }
            }
            SplitSink::Files { tok, docs, mask, tokens } => {
                tok.push(e.ids.iter().map(|&x| x as u64))?;
                *tokens += e.ids.len() as u64;
                docs.push(std::iter::once(*tokens))?;
                if let Some(m) = mask {
                    match &e.mask {
                        Some(v) => m.push(v.iter().map(|&x| x as u64))?,
                        None => m.push(ones().map(u64::from))?,
                    }
                }
            }
        }
        Ok(())
    }

    /// Closes a file sink: its token and document counts (nothing is read back).
    pub(crate) fn close(self) -> Result<(usize, usize), DataError> {
        match self {
            SplitSink::Files { tok, docs, mask, tokens } => {
                let n_docs = docs.count as usize - 1;
                tok.finish()?;
                docs.finish()?;
                mask.map(|m| m.finish()).transpose()?;
                Ok((tokens as usize, n_docs))
            }
            SplitSink::Memory { .. } => Err(DataError::new("internal: an in-memory sink is finished, not closed")),
        }
    }

    /// The in-memory split (a file sink is [`SplitSink::close`]d, then cut by [`cut_files`]).
    pub(crate) fn finish(self) -> Result<Split, DataError> {
        match self {
            SplitSink::Memory { ids, starts, mask } => {
                Ok(Split { tokens: Tokens::from_vec(ids), docs: DocIndex::from_starts(starts), mask: mask.map(Tokens::from_vec) })
            }
            SplitSink::Files { .. } => Err(DataError::new("internal: a file sink is closed, not finished")),
        }
    }
}

/// Cuts the file set `{stem}.*` in `dir` (a stream of `n` tokens) at token `cut` into `train.*`
/// (the first `cut` tokens) and `val.*` (the rest), a document the cut falls inside becoming
/// one on each side. The tail is copied by buffered reads and the head truncated in place, so
/// no more than a buffer of the stream is ever resident.
pub(crate) fn cut_files(dir: &Path, stem: &str, n: u64, cut: u64, masked: bool) -> Result<(), DataError> {
    use std::io::{BufReader, Read};
    let mut arrays: Vec<(&str, &[u8; 8])> = vec![("tok", MAGIC)];
    if masked {
        arrays.push(("mask", MASK_MAGIC));
    }
    for (ext, magic) in arrays {
        let from = dir.join(format!("{stem}.{ext}"));
        let io = |e| DataError::io(&from, "cannot cut", e);
        let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&from).map_err(io)?;
        let mut h = [0u8; HEADER_BYTES];
        f.read_exact(&mut h).map_err(io)?;
        let width = u32::from_le_bytes(h[12..16].try_into().unwrap()) as u64;
        let extra = u32::from_le_bytes(h[24..28].try_into().unwrap());
        let mut val = ArrayWriter::create(&dir.join(format!("val.{ext}")), magic, width as usize, extra)?;
        f.seek(SeekFrom::Start(HEADER_BYTES as u64 + cut * width)).map_err(io)?;
        let mut left = (n - cut) * width;
        let mut buf = vec![0u8; 1 << 20];
        while left > 0 {
            let k = left.min(buf.len() as u64) as usize;
            f.read_exact(&mut buf[..k]).map_err(io)?;
            val.push_raw(&buf[..k], k as u64 / width)?;
            left -= k as u64;
        }
        val.finish()?;
        f.set_len(HEADER_BYTES as u64 + cut * width).map_err(io)?;
        f.seek(SeekFrom::Start(16)).and_then(|_| f.write_all(&cut.to_le_bytes())).and_then(|_| f.sync_data()).map_err(io)?;
        drop(f);
        let to = dir.join(format!("train.{ext}"));
        std::fs::rename(&from, &to).map_err(|e| DataError::io(&to, "cannot write", e))?;
    }
    let from = dir.join(format!("{stem}.docs"));
    let io = |e| DataError::io(&from, "cannot cut", e);
    let mut r = BufReader::with_capacity(1 << 20, File::open(&from).map_err(io)?);
    let mut h = [0u8; HEADER_BYTES];
    r.read_exact(&mut h).map_err(io)?;
    let count = u64::from_le_bytes(h[16..24].try_into().unwrap());
    let mut train = ArrayWriter::create(&dir.join("train.docs"), DOCS_MAGIC, 8, 0)?;
    let mut val = ArrayWriter::create(&dir.join("val.docs"), DOCS_MAGIC, 8, 0)?;
    val.push(std::iter::once(0))?;
    let mut e = [0u8; 8];
    for _ in 0..count {
        r.read_exact(&mut e).map_err(io)?;
        let s = u64::from_le_bytes(e);
        if s < cut || s == 0 {
            train.push(std::iter::once(s))?;
        }
        if s > cut {
            val.push(std::iter::once(s - cut))?;
        }
    }
    if cut > 0 {
        train.push(std::iter::once(cut))?;
    }
    train.finish()?;
    val.finish()?;
    std::fs::remove_file(&from).map_err(io)
}
