//! Read-only token storage: an owned `Vec<u32>` or a memory-mapped little-endian u16/u32 array.
//! Cloning and slicing are cheap (shared backing, view ranges).

use std::fmt;
use std::sync::Arc;

use memmap2::Mmap;

#[derive(Clone)]
enum Backing {
    Owned(Arc<Vec<u32>>),
    /// `width` bytes per token (1, 2 or 4), little endian, starting at byte `offset` of the map
    /// (width 1: a loss mask).
    Mapped { map: Arc<Mmap>, offset: usize, width: usize },
}

/// A read-only sequence of token ids.
#[derive(Clone)]
pub struct Tokens {
    backing: Backing,
    start: usize,
    len: usize,
}

impl Tokens {
    pub fn from_vec(v: Vec<u32>) -> Tokens {
        let len = v.len();
        Tokens { backing: Backing::Owned(Arc::new(v)), start: 0, len }
    }

    /// `len` tokens of `width` (2 or 4) bytes at `offset` in `map`. The caller has checked the size.
    pub(crate) fn mapped(map: Arc<Mmap>, offset: usize, width: usize, len: usize) -> Tokens {
        assert!(width == 1 || width == 2 || width == 4, "token width must be 1, 2 or 4, got {width}");
        assert!(offset + width * len <= map.len(), "mapped token range exceeds the file");
        Tokens { backing: Backing::Mapped { map, offset, width }, start: 0, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the tokens are memory-mapped from a file (rather than held in memory).
    pub fn is_mapped(&self) -> bool {
        matches!(self.backing, Backing::Mapped { .. })
    }

    /// Token `i`. Panics if `i >= len()`.
    #[inline]
    pub fn get(&self, i: usize) -> u32 {
        assert!(i < self.len, "token index {i} out of range for {} tokens", self.len);
        let j = self.start + i;
        match &self.backing {
            Backing::Owned(v) => v[j],
            Backing::Mapped { map, offset, width: 1 } => map[offset + j] as u32,
            Backing::Mapped { map, offset, width: 2 } => {
                let o = offset + 2 * j;
                u16::from_le_bytes([map[o], map[o + 1]]) as u32
            }
            Backing::Mapped { map, offset, .. } => {
                let o = offset + 4 * j;
                u32::from_le_bytes(map[o..o + 4].try_into().unwrap())
            }
        }
    }

    /// Copies tokens `start .. start + out.len()` into `out`. Panics if the range exceeds `len()`.
    pub fn copy_to(&self, start: usize, out: &mut [u32]) {
        assert!(
            start.checked_add(out.len()).is_some_and(|e| e <= self.len),
            "token range {start}..{} out of range for {} tokens",
            start + out.len(),
            self.len
        );
        let j = self.start + start;
        match &self.backing {
            Backing::Owned(v) => out.copy_from_slice(&v[j..j + out.len()]),
            Backing::Mapped { map, offset, width: 1 } => {
                let n = out.len();
                for (o, &b) in out.iter_mut().zip(&map[offset + j..offset + j + n]) {
                    *o = b as u32;
                }
            }
            Backing::Mapped { map, offset, width: 2 } => {
                let bytes = &map[offset + 2 * j..offset + 2 * (j + out.len())];
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = u16::from_le_bytes([b[0], b[1]]) as u32;
                }
            }
            Backing::Mapped { map, offset, .. } => {
                let bytes = &map[offset + 4 * j..offset + 4 * (j + out.len())];
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
    }

    /// All tokens as a vector (copies).
    pub fn to_vec(&self) -> Vec<u32> {
        let mut v = vec![0; self.len];
        self.copy_to(0, &mut v);
        v
    }

    /// A view of tokens `start .. end` sharing the backing storage.
    pub fn slice(&self, start: usize, end: usize) -> Tokens {
        assert!(start <= end && end <= self.len, "token slice {start}..{end} out of range for {} tokens", self.len);
        Tokens { backing: self.backing.clone(), start: self.start + start, len: end - start }
    }

    /// `(self[..n], self[n..])`, sharing storage.
    pub fn split_at(&self, n: usize) -> (Tokens, Tokens) {
        (self.slice(0, n), self.slice(n, self.len))
    }

    /// The first token `>= limit`, as `(index, id)`, scanning in chunks.
    pub fn find_at_or_above(&self, limit: u64) -> Option<(usize, u32)> {
        const CHUNK: usize = 1 << 16;
        let mut buf = vec![0u32; CHUNK.min(self.len)];
        let mut i = 0;
        while i < self.len {
            let n = CHUNK.min(self.len - i);
            self.copy_to(i, &mut buf[..n]);
            if let Some(k) = buf[..n].iter().position(|&t| t as u64 >= limit) {
                return Some((i + k, buf[k]));
            }
            i += n;
        }
        None
    }

    /// Largest id (`None` when empty).
    pub fn max_id(&self) -> Option<u32> {
        const CHUNK: usize = 1 << 16;
        let mut buf = vec![0u32; CHUNK.min(self.len)];
        let mut best = None;
        let mut i = 0;
        while i < self.len {
            let n = CHUNK.min(self.len - i);
            self.copy_to(i, &mut buf[..n]);
            let m = buf[..n].iter().copied().max();
            best = best.max(m);
            i += n;
        }
        best
    }
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.backing {
            Backing::Owned(_) => "in memory",
            Backing::Mapped { width: 1, .. } => "mapped u8",
            Backing::Mapped { width: 2, .. } => "mapped u16",
            Backing::Mapped { .. } => "mapped u32",
        };
        write!(f, "Tokens({} tokens, {kind})", self.len)
    }
}

impl PartialEq for Tokens {
    fn eq(&self, other: &Tokens) -> bool {
        self.len == other.len && (0..self.len).all(|i| self.get(i) == other.get(i))
    }
}
