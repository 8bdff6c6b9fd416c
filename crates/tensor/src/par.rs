//! Small helpers for deterministic multi-threading.

use rayon::prelude::*;

/// A raw pointer that may be shared between rayon tasks which write *disjoint* elements.
/// Every use states why the writes cannot overlap.
#[derive(Clone, Copy)]
pub struct SyncPtr(pub *mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

/// Rows per block for column reductions (norm-weight gradients): each block sums its rows in
/// order from zero, then the blocks' sums are added in block order. A constant, so the order of
/// additions never depends on the thread count.
pub const REDUCE_ROWS: usize = 64;

/// A row-wise kernel with column reductions, in blocks of [`REDUCE_ROWS`] rows of width `c`:
/// `f(r0, out_rows, partial)` handles rows `r0 ..` (its block of `out`) and adds those rows'
/// contributions to each of `acc`'s reductions into `partial` (`acc.len()` zeroed `c`-wide
/// slices, back to back); blocks run in parallel, then each block's partials are added to
/// `acc` in block order, so the sums do not depend on the thread count.
pub fn row_blocks_reduce<F>(out: &mut [f32], c: usize, acc: &mut [&mut [f32]], f: F)
where
    F: Fn(usize, &mut [f32], &mut [f32]) + Sync,
{
    let width = c * acc.len();
    let mut partial = pooled(out.len().div_ceil(c).div_ceil(REDUCE_ROWS) * width);
    out.par_chunks_mut(REDUCE_ROWS * c).zip(partial.par_chunks_mut(width)).enumerate().for_each(|(bi, (o, part))| f(bi * REDUCE_ROWS, o, part));
    for part in partial.chunks(width) {
        for (a, p) in acc.iter_mut().zip(part.chunks(c)) {
            for (a, p) in a.iter_mut().zip(p) {
                *a += *p;
            }
        }
    }
}

/// Rows per block of a row-wise kernel over rows of width `c`: about [`ELEMS`] elements, so one
/// task (and one ISA dispatch) handles many short rows.
pub fn rows_per_block(c: usize) -> usize {
    (ELEMS / c.max(1)).max(1)
}

/// Elements per chunk for elementwise parallel loops.
pub const ELEMS: usize = 1 << 14;

thread_local! {
    static POOL: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A zeroed `f32` buffer taken from this thread's pool, returned to the pool of whichever
/// thread drops it. Kernels use it for per-task scratch so that, after the first step of a
/// run, their scratch costs no allocation.
#[derive(Default)]
pub struct PoolBuf {
    v: Vec<f32>,
}

/// A zeroed buffer of `n` floats (see [`PoolBuf`]).
pub fn pooled(n: usize) -> PoolBuf {
    let mut v = POOL.with(|p| {
        let mut p = p.borrow_mut();
        // The smallest pooled buffer that is large enough, else any (it grows once).
        let best = p.iter().enumerate().filter(|(_, b)| b.capacity() >= n).min_by_key(|(_, b)| b.capacity()).map(|(i, _)| i);
        match best {
            Some(i) => p.swap_remove(i),
            None => p.pop().unwrap_or_default(),
        }
    });
    v.clear();
    v.resize(n, 0.0);
    PoolBuf { v }
}

impl std::ops::Deref for PoolBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.v
    }
}

impl std::ops::DerefMut for PoolBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.v
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.v);
        if v.capacity() > 0 {
            let _ = POOL.try_with(|p| p.borrow_mut().push(v));
        }
    }
}

/// `x.fill(0.0)` over the pool (gradient buffers are hundreds of MB: one thread's memset was
/// a visible share of a step; a small model's accumulated activation gradients, ~100K–400K
/// floats, split too), in 256 KiB pieces.
pub fn zero(x: &mut [f32]) {
    x.par_chunks_mut(ELEMS * 4).for_each(|c| c.fill(0.0));
}

/// `x *= s` elementwise over the pool.
pub fn scale(x: &mut [f32], s: f32) {
    x.par_chunks_mut(ELEMS).for_each(|c| c.iter_mut().for_each(|v| *v *= s));
}
