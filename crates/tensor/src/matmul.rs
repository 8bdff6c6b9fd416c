//! Matrix products through the `gemm` crate (pure-Rust, runtime-dispatched SIMD, rayon threads).
//! Strides make every transpose free: no transposed copy is ever made.

use rayon::prelude::*;

/// A strided matrix view: element (i, j) lives at `data[off + i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub data: &'a [f32],
    pub off: usize,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> View<'a> {
    /// A dense row-major `rows × cols` matrix.
    pub fn rows(data: &'a [f32], rows: usize, cols: usize) -> View<'a> {
        View { data, off: 0, rows, cols, rs: cols, cs: 1 }
    }
    /// The transpose of this view (no copy).
    pub fn t(self) -> View<'a> {
        View { rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs, ..self }
    }
    fn check(&self) {
        if self.rows > 0 && self.cols > 0 {
            let last = self.off + (self.rows - 1) * self.rs + (self.cols - 1) * self.cs;
            assert!(last < self.data.len(), "matrix view out of bounds");
        }
    }
}

/// How many threads one product may use: all of rayon's pool, or one when already inside a
/// parallel task (attention heads), so matmul and elementwise threads never oversubscribe.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    All,
    One,
}

/// `dst = (accumulate ? dst : 0) + alpha · lhs · rhs`, with `dst` a strided `m × n` region at
/// `dst_ptr` (row stride `dst_rs`, column stride 1) that the caller guarantees is valid and not
/// aliased by `lhs` or `rhs`.
///
/// # Safety
/// `dst_ptr` must point to a region covering `(m-1)·dst_rs + n` floats that no one else reads or
/// writes during the call.
pub unsafe fn gemm_raw(dst_ptr: *mut f32, dst_rs: usize, accumulate: bool, lhs: View, rhs: View, alpha: f32, threads: Threads) {
    assert_eq!(lhs.cols, rhs.rows, "inner dimensions differ");
    lhs.check();
    rhs.check();
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                std::ptr::write_bytes(dst_ptr.add(i * dst_rs), 0, n);
            }
        }
        return;
    }
    let t = rayon::current_num_threads();
    if threads == Threads::One || t <= 1 || (m * n * k) < (1 << 15) {
        gemm_one(dst_ptr, dst_rs, accumulate, lhs, rhs, alpha);
        return;
    }
    // Split the output into one block per thread along its longer side and run each block as
    // a single-threaded product: measured faster here than gemm's own threading (which splits
    // small-M weight-gradient products poorly), and every output element is still computed by
    // one call with the same k order, so the split only depends on the thread count.
    let (split_rows, len) = if m >= n { (true, m) } else { (false, n) };
    let parts = t.min(len.div_ceil(16)).max(1);
    let dst = crate::par::SyncPtr(dst_ptr);
    (0..parts).into_par_iter().for_each(|i| {
        let dst = dst;
        let (a, b) = (len * i / parts, len * (i + 1) / parts);
        if a == b {
            return;
        }
        // Safety: block i writes rows (or columns) a..b of the destination, disjoint from the
        // other blocks'.
        unsafe {
            if split_rows {
                let l = View { off: lhs.off + a * lhs.rs, rows: b - a, ..lhs };
                gemm_one(dst.0.add(a * dst_rs), dst_rs, accumulate, l, rhs, alpha);
            } else {
                let r = View { off: rhs.off + a * rhs.cs, cols: b - a, ..rhs };
                gemm_one(dst.0.add(a), dst_rs, accumulate, lhs, r, alpha);
            }
        }
    });
}

/// One single-threaded gemm call (see [`gemm_raw`] for the contract).
unsafe fn gemm_one(dst_ptr: *mut f32, dst_rs: usize, accumulate: bool, lhs: View, rhs: View, alpha: f32) {
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    gemm::gemm(
        m, n, k,
        dst_ptr, 1, dst_rs as isize, accumulate,
        lhs.data.as_ptr().add(lhs.off), lhs.cs as isize, lhs.rs as isize,
        rhs.data.as_ptr().add(rhs.off), rhs.cs as isize, rhs.rs as isize,
        1.0, alpha, false, false, false, gemm::Parallelism::None,
    );
}

/// Safe form of [`gemm_raw`] for a dense row-major destination `dst[m × n]`.
pub fn gemm(dst: &mut [f32], accumulate: bool, lhs: View, rhs: View, alpha: f32, threads: Threads) {
    assert_eq!(dst.len(), lhs.rows * rhs.cols, "destination size");
    unsafe { gemm_raw(dst.as_mut_ptr(), rhs.cols, accumulate, lhs, rhs, alpha, threads) }
}

/// Linear layer, PyTorch layout (weights `[OC, C]`):
/// `out[BT, OC] = inp[BT, C] · weight[OC, C]ᵀ + bias[OC]`. Overwrites `out`.
pub fn matmul_forward(
    out: &mut [f32],         // [BT, OC]
    inp: &[f32],             // [BT, C]
    weight: &[f32],          // [OC, C]
    bias: Option<&[f32]>,    // [OC]
    bt: usize,
    c: usize,
    oc: usize,
) {
    let _p = crate::profile::scope("matmul_forward");
    assert_eq!(out.len(), bt * oc);
    assert_eq!(inp.len(), bt * c);
    assert_eq!(weight.len(), oc * c);
    let accumulate = match bias {
        Some(b) => {
            assert_eq!(b.len(), oc);
            out.par_chunks_mut(oc).for_each(|row| row.copy_from_slice(b));
            true
        }
        None => false,
    };
    gemm(out, accumulate, View::rows(inp, bt, c), View::rows(weight, oc, c).t(), 1.0, Threads::All);
}

/// Backward of [`matmul_forward`]. Accumulates into `dinp`, `dweight` and `dbias`.
pub fn matmul_backward(
    dinp: &mut [f32],             // [BT, C]
    dweight: &mut [f32],          // [OC, C]
    dbias: Option<&mut [f32]>,    // [OC]
    dout: &[f32],                 // [BT, OC]
    inp: &[f32],                  // [BT, C]
    weight: &[f32],               // [OC, C]
    bt: usize,
    c: usize,
    oc: usize,
) {
    let _p = crate::profile::scope("matmul_backward");
    assert_eq!(dout.len(), bt * oc);
    // The two products are independent and equally large: run them side by side, each on the
    // whole pool (work stealing balances them), instead of one after the other, so small
    // products (few tiles each) still keep every core busy. Each gemm splits only output
    // tiles, so the results do not depend on the scheduling.
    rayon::join(
        // dinp += dout · weight
        || gemm(dinp, true, View::rows(dout, bt, oc), View::rows(weight, oc, c), 1.0, Threads::All),
        || {
            // dweight += doutᵀ · inp
            gemm(dweight, true, View::rows(dout, bt, oc).t(), View::rows(inp, bt, c), 1.0, Threads::All);
            if let Some(db) = dbias {
                bias_backward(db, dout, bt, oc);
            }
        },
    );
}

/// The input gradient alone, `dinp += dout · weight` (for frozen weights: LoRA's base).
pub fn matmul_backward_input(
    dinp: &mut [f32],   // [BT, C]
    dout: &[f32],       // [BT, OC]
    weight: &[f32],     // [OC, C]
    bt: usize,
    c: usize,
    oc: usize,
) {
    let _p = crate::profile::scope("matmul_backward");
    gemm(dinp, true, View::rows(dout, bt, oc), View::rows(weight, oc, c), 1.0, Threads::All);
}

/// `dbias[OC] += Σ_rows dout[BT, OC]`. Parallel over blocks of columns; each column is summed
/// over rows in order, so the result is independent of the thread count.
pub fn bias_backward(dbias: &mut [f32], dout: &[f32], bt: usize, oc: usize) {
    assert_eq!(dbias.len(), oc);
    const COLS: usize = 256;
    dbias.par_chunks_mut(COLS).enumerate().for_each(|(bi, db)| {
        let j0 = bi * COLS;
        for r in 0..bt {
            let row = &dout[r * oc + j0..r * oc + j0 + db.len()];
            for (a, x) in db.iter_mut().zip(row) {
                *a += *x;
            }
        }
    });
}

/// Measures this machine's fp32 matmul peak in FLOP/s with the same gemm path training uses
/// (all threads): the best of `reps` square `n × n × n` products, `2n³` FLOPs each.
pub fn measure_peak_flops(n: usize, reps: usize) -> f64 {
    let a: Vec<f32> = (0..n * n).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
    let b: Vec<f32> = (0..n * n).map(|i| ((i % 5) as f32 - 2.0) * 0.1).collect();
    let mut c = vec![0.0f32; n * n];
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t0 = std::time::Instant::now();
        gemm(&mut c, false, View::rows(&a, n, n), View::rows(&b, n, n), 1.0, Threads::All);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(&c);
    2.0 * (n as f64).powi(3) / best
}
