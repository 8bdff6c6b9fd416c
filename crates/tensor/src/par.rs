//! Small helpers for deterministic multi-threading.

use rayon::prelude::*;

/// A raw pointer that may be shared between rayon tasks which write *disjoint* elements.
/// Every use states why the writes cannot overlap.
#[derive(Clone, Copy)]
pub struct SyncPtr(pub *mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

/// Rows per chunk for column reductions (bias and norm-weight gradients). A constant, so the
/// order of additions never depends on the thread count.
pub const REDUCE_ROWS: usize = 64;

/// `acc[j] += Σ_r f(r)[j]` over `rows` rows of width `width`, where `f(r, out)` *adds* row r's
/// contribution into `out`. Partial sums over fixed chunks of rows are combined in chunk order.
pub fn column_reduce<F>(acc: &mut [f32], rows: usize, width: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    assert_eq!(acc.len(), width);
    let n_chunks = rows.div_ceil(REDUCE_ROWS);
    if n_chunks == 0 {
        return;
    }
    // The partial sums live in a buffer kept per calling thread: after the first step of a
    // run nothing is allocated here. (Callers are top-level kernels, never rayon tasks, so the
    // buffer is never borrowed twice.)
    thread_local! {
        static PARTIAL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    PARTIAL.with(|cell| {
        let mut partial = cell.borrow_mut();
        partial.clear();
        partial.resize(n_chunks * width, 0.0);
        partial.par_chunks_mut(width).enumerate().for_each(|(ci, part)| {
            let end = ((ci + 1) * REDUCE_ROWS).min(rows);
            for r in ci * REDUCE_ROWS..end {
                f(r, part);
            }
        });
        for part in partial.chunks(width) {
            for (a, p) in acc.iter_mut().zip(part) {
                *a += *p;
            }
        }
    });
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
/// a visible share of a step).
pub fn zero(x: &mut [f32]) {
    x.par_chunks_mut(ELEMS * 16).for_each(|c| c.fill(0.0));
}
