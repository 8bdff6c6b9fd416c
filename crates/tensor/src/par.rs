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
