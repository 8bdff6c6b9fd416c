//! Token files: kiln shards (`.tok`) and nanoGPT's raw `.bin`.
//!
//! **Shard format** (`train.tok`, `val.tok` written by `prepare`), all little endian:
//!
//! | bytes  | field                                             |
//! | ------ | ------------------------------------------------- |
//! | 0..8   | magic `b"KILNTOK\0"`                              |
//! | 8..12  | format version, u32 = 1                           |
//! | 12..16 | dtype, u32: 2 = u16 tokens, 4 = u32 tokens        |
//! | 16..24 | token count, u64                                  |
//! | 24..28 | vocab size, u32 (every token id is below it)      |
//! | 28..32 | reserved, u32 = 0                                 |
//! | 32..   | the tokens (u16 when vocab size <= 65536)         |
//!
//! Shards are read by memory map; the header, the file size and (once, at load) every id are checked.
//!
//! **`.bin`** (nanoGPT): a bare array of little-endian u16 token ids, no header.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::DataError;
use crate::tokens::Tokens;

pub const MAGIC: &[u8; 8] = b"KILNTOK\0";
pub const VERSION: u32 = 1;
pub const HEADER_BYTES: usize = 32;

/// Memory-maps `path` (which must be a non-empty regular file).
pub(crate) fn map_file(path: &Path) -> Result<Arc<Mmap>, DataError> {
    let file = File::open(path).map_err(|e| DataError::io(path, "cannot open", e))?;
    let len = file.metadata().map_err(|e| DataError::io(path, "cannot stat", e))?.len();
    if len == 0 {
        return Err(DataError::at(path, "file is empty (no tokens)"));
    }
    // SAFETY: the map is read-only; kiln never writes to token files while training reads them.
    // A file truncated by another process under us would fault, as with any mmap reader.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, "cannot memory-map", e))?;
    Ok(Arc::new(map))
}

fn write_tokens(w: &mut impl Write, tokens: &Tokens, width: usize) -> std::io::Result<()> {
    const CHUNK: usize = 1 << 14;
    let mut buf = Vec::with_capacity(CHUNK * width);
    let mut ids = vec![0u32; CHUNK];
    let mut start = 0;
    while start < tokens.len() {
        let n = CHUNK.min(tokens.len() - start);
        tokens.copy_to(start, &mut ids[..n]);
        start += n;
        buf.clear();
        for &t in &ids[..n] {
            if width == 2 {
                buf.extend_from_slice(&(t as u16).to_le_bytes());
            } else {
                buf.extend_from_slice(&t.to_le_bytes());
            }
        }
        w.write_all(&buf)?;
    }
    Ok(())
}

/// Writes a shard of `tokens` (every id must be below `vocab_size`).
pub fn write_shard(path: &Path, tokens: &[u32], vocab_size: usize) -> Result<(), DataError> {
    write_shard_tokens(path, &Tokens::from_vec(tokens.to_vec()), vocab_size)
}

/// [`write_shard`] for [`Tokens`] (streams memory-mapped tokens without copying them all).
pub fn write_shard_tokens(path: &Path, tokens: &Tokens, vocab_size: usize) -> Result<(), DataError> {
    if vocab_size == 0 || vocab_size > u32::MAX as usize {
        return Err(DataError::at(path, format!("cannot write a shard with vocab size {vocab_size}")));
    }
    if let Some((i, t)) = tokens.find_at_or_above(vocab_size as u64) {
        return Err(DataError::at(path, format!("token {t} at index {i} is not below the vocab size {vocab_size}")));
    }
    let width: usize = if vocab_size <= 1 << 16 { 2 } else { 4 };
    let f = File::create(path).map_err(|e| DataError::io(path, "cannot create", e))?;
    let mut w = BufWriter::new(f);
    let mut header = Vec::with_capacity(HEADER_BYTES);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&(width as u32).to_le_bytes());
    header.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    header.extend_from_slice(&(vocab_size as u32).to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());
    let res = w.write_all(&header).and_then(|_| write_tokens(&mut w, tokens, width)).and_then(|_| w.flush());
    drop(w);
    res.map_err(|e| DataError::io(path, "cannot write shard", e))
}

/// Whether `path` starts with the shard magic.
pub(crate) fn is_shard(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 8];
    File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && &magic == MAGIC
}

/// Reads a shard by memory map: returns its tokens and the vocab size in its header. Checks
/// the magic, version, dtype, reserved field, the file size against the count, and every id.
pub fn read_shard(path: &Path) -> Result<(Tokens, usize), DataError> {
    let (map, count, width, vocab) = crate::store::map_array(path, MAGIC, &[2, 4], "token shard")?;
    if vocab == 0 {
        return Err(DataError::at(path, "shard header has vocab size 0"));
    }
    let tokens = Tokens::mapped(map, HEADER_BYTES, width, count);
    check_ids(path, &tokens, vocab as usize, "the vocab size in its header")?;
    Ok((tokens, vocab as usize))
}

/// Error if any id is `>= vocab`, naming the file, the index and the id.
pub(crate) fn check_ids(path: &Path, tokens: &Tokens, vocab: usize, whose: &str) -> Result<(), DataError> {
    match tokens.find_at_or_above(vocab as u64) {
        Some((i, t)) => Err(DataError::at(path, format!("token at index {i} is {t}, not below {whose} ({vocab})"))),
        None => Ok(()),
    }
}

/// Reads a nanoGPT `.bin` (raw little-endian u16) by memory map.
pub fn read_bin(path: &Path) -> Result<Tokens, DataError> {
    let map = map_file(path)?;
    if map.len() % 2 != 0 {
        return Err(DataError::at(
            path,
            format!("size {} bytes is odd: a .bin token file holds little-endian u16 ids (2 bytes each)", map.len()),
        ));
    }
    let n = map.len() / 2;
    Ok(Tokens::mapped(map, 0, 2, n))
}

/// Writes a nanoGPT `.bin` (raw little-endian u16); every id must be below 65536.
pub fn write_bin(path: &Path, tokens: &[u32]) -> Result<(), DataError> {
    if let Some((i, &t)) = tokens.iter().enumerate().find(|(_, &t)| t > u16::MAX as u32) {
        return Err(DataError::at(path, format!("token {t} at index {i} does not fit the u16 .bin format")));
    }
    let f = File::create(path).map_err(|e| DataError::io(path, "cannot create", e))?;
    let mut w = BufWriter::new(f);
    write_tokens(&mut w, &Tokens::from_vec(tokens.to_vec()), 2).and_then(|_| w.flush()).map_err(|e| DataError::io(path, "cannot write", e))
}
