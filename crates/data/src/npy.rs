//! `.npy` token arrays: 1-D, C order, dtype `<u2`, `<u4` (memory-mapped) or `<i4`, `<i8`, `<u8`
//! (converted to u32 in memory; negative or >= 2^32 ids are errors). The header is parsed here
//! (format versions 1.0, 2.0 and 3.0: magic `\x93NUMPY`, version, header length, a Python dict
//! literal with `descr`, `fortran_order` and `shape`).

use std::path::Path;

use crate::error::DataError;
use crate::shard::map_file;
use crate::tokens::Tokens;

struct Header {
    descr: String,
    fortran: bool,
    shape: Vec<u64>,
    data_offset: usize,
}

fn bad(path: &Path, msg: impl std::fmt::Display) -> DataError {
    DataError::at(path, format!("bad .npy header: {msg}"))
}

fn parse_header(path: &Path, b: &[u8]) -> Result<Header, DataError> {
    if b.len() < 10 || &b[0..6] != b"\x93NUMPY" {
        return Err(bad(path, "missing the \\x93NUMPY magic"));
    }
    let major = b[6];
    let (len, start) = match major {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        2 | 3 => {
            if b.len() < 12 {
                return Err(bad(path, "file ends inside the header"));
            }
            (u32::from_le_bytes(b[8..12].try_into().unwrap()) as usize, 12)
        }
        v => return Err(bad(path, format!("format version {v}.{} is not supported (expected 1, 2 or 3)", b[7]))),
    };
    if start + len > b.len() {
        return Err(bad(path, format!("header length {len} runs past the end of the file ({} bytes)", b.len())));
    }
    let text = std::str::from_utf8(&b[start..start + len]).map_err(|_| bad(path, "header is not text"))?;
    let value_after = |key: &str| -> Result<&str, DataError> {
        let pat_sq = format!("'{key}'");
        let pat_dq = format!("\"{key}\"");
        let at = text.find(&pat_sq).or_else(|| text.find(&pat_dq)).ok_or_else(|| bad(path, format!("no '{key}' key in {}", text.trim())))?;
        let rest = text[at + key.len() + 2..].trim_start();
        let rest = rest.strip_prefix(':').ok_or_else(|| bad(path, format!("no ':' after '{key}'")))?;
        Ok(rest.trim_start())
    };
    let d = value_after("descr")?;
    let q = d.chars().next().filter(|&c| c == '\'' || c == '"').ok_or_else(|| bad(path, "'descr' is not a string"))?;
    let end = d[1..].find(q).ok_or_else(|| bad(path, "unterminated 'descr' string"))?;
    let descr = d[1..1 + end].to_string();
    let f = value_after("fortran_order")?;
    let fortran = if f.starts_with("True") {
        true
    } else if f.starts_with("False") {
        false
    } else {
        return Err(bad(path, "'fortran_order' is neither True nor False"));
    };
    let s = value_after("shape")?;
    let s = s.strip_prefix('(').ok_or_else(|| bad(path, "'shape' is not a tuple"))?;
    let close = s.find(')').ok_or_else(|| bad(path, "unterminated 'shape' tuple"))?;
    let mut shape = Vec::new();
    for part in s[..close].split(',') {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        let part = part.trim_end_matches('L'); // Python 2 longs
        shape.push(part.parse::<u64>().map_err(|_| bad(path, format!("shape entry {part:?} is not a number")))?);
    }
    Ok(Header { descr, fortran, shape, data_offset: start + len })
}

/// Reads a `.npy` token array (see the module docs for what is accepted).
pub fn read_npy(path: &Path) -> Result<Tokens, DataError> {
    let map = map_file(path)?;
    let h = parse_header(path, &map)?;
    let width = match h.descr.as_str() {
        "<u2" => 2,
        "<u4" | "<i4" => 4,
        "<i8" | "<u8" => 8,
        other => {
            return Err(DataError::at(
                path,
                format!("unsupported .npy dtype '{other}' (expected one of <u2, <u4, <i4, <i8, <u8)"),
            ))
        }
    };
    if h.fortran {
        return Err(DataError::at(path, "unsupported .npy layout: fortran_order is True (expected C order)"));
    }
    if h.shape.len() != 1 {
        return Err(DataError::at(
            path,
            format!("unsupported .npy shape {:?}: token arrays must be 1-D", h.shape),
        ));
    }
    let n = h.shape[0];
    if n == 0 {
        return Err(DataError::at(path, "the .npy array is empty (no tokens)"));
    }
    let have = (map.len() - h.data_offset) as u64;
    let need = n.checked_mul(width as u64);
    if need != Some(have) {
        let what = if need.is_none_or(|x| x > have) { "truncated .npy" } else { ".npy size mismatch" };
        return Err(DataError::at(
            path,
            format!(
                "{what}: shape ({n},) of '{}' needs {} data bytes but the file has {have} after the header",
                h.descr,
                need.map(|x| x.to_string()).unwrap_or_else(|| "too many".into())
            ),
        ));
    }
    let n = n as usize;
    let data = &map[h.data_offset..];
    match h.descr.as_str() {
        "<u2" | "<u4" => {
            let off = h.data_offset;
            Ok(Tokens::mapped(map.clone(), off, width, n))
        }
        d => {
            let mut out = Vec::with_capacity(n);
            for (i, c) in data.chunks_exact(width).enumerate() {
                let v: i128 = match d {
                    "<i4" => i32::from_le_bytes(c.try_into().unwrap()) as i128,
                    "<i8" => i64::from_le_bytes(c.try_into().unwrap()) as i128,
                    _ => u64::from_le_bytes(c.try_into().unwrap()) as i128,
                };
                if v < 0 || v > u32::MAX as i128 {
                    return Err(DataError::at(path, format!("token at index {i} is {v}, not a valid token id")));
                }
                out.push(v as u32);
            }
            Ok(Tokens::from_vec(out))
        }
    }
}
