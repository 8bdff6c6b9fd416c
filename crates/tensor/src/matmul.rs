//! Matrix products through the `gemm` crate (pure-Rust, runtime-dispatched SIMD, rayon threads).
//! Strides make every transpose free: no transposed copy is ever made.

use rayon::prelude::*;

/// A strided f32 matrix view: element (i, j) lives at `data[off + i·rs + j·cs]`; `t()` is the
/// transpose, free.
pub type View<'a> = crate::bf16::Mat<'a, f32>;

/// The arithmetic of a product: fp32, or bf16-rounded inputs with fp32 accumulation
/// ([`crate::bf16`]: `vdpbf16ps` where the CPU has it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Arith {
    #[default]
    F32,
    Bf16,
}

/// [`gemm`] in the given arithmetic.
pub fn gemm_as(arith: Arith, dst: &mut [f32], accumulate: bool, lhs: View, rhs: View, alpha: f32, threads: Threads) {
    match arith {
        Arith::F32 => gemm(dst, accumulate, lhs, rhs, alpha, threads),
        Arith::Bf16 => crate::bf16::gemm_bf16(dst, accumulate, lhs, rhs, alpha, threads),
    }
}

/// [`gemm_raw`] in the given arithmetic.
///
/// # Safety
/// As [`gemm_raw`].
pub unsafe fn gemm_raw_as(arith: Arith, dst: (*mut f32, usize), accumulate: bool, lhs: View, rhs: View, alpha: f32, threads: Threads) {
    match arith {
        Arith::F32 => gemm_raw(dst, accumulate, lhs, rhs, alpha, threads),
        Arith::Bf16 => crate::bf16::gemm_bf16_raw(dst, accumulate, lhs, rhs, alpha, threads),
    }
}

/// How many threads one product may use: all of rayon's pool, or one when already inside a
/// parallel task (attention heads; each of a small linear backward's two products in a pool of
/// two), so matmul and elementwise threads never oversubscribe.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    All,
    One,
}

/// `dst = (accumulate ? dst : 0) + alpha · lhs · rhs`, with `dst = (dst_ptr, dst_rs)` a strided
/// `m × n` region at `dst_ptr` (row stride `dst_rs`, column stride 1) that the caller
/// guarantees is valid and not aliased by `lhs` or `rhs`.
///
/// # Safety
/// `dst_ptr` must point to a region covering `(m-1)·dst_rs + n` floats that no one else reads or
/// writes during the call.
pub unsafe fn gemm_raw((dst_ptr, dst_rs): (*mut f32, usize), accumulate: bool, lhs: View, rhs: View, alpha: f32, threads: Threads) {
    assert_eq!(lhs.cols, rhs.rows, "inner dimensions differ");
    lhs.check();
    rhs.check();
    let one = |d: *mut f32, rows: (usize, usize), cols: (usize, usize)| {
        gemm_one(d, dst_rs, accumulate, lhs.sub_rows(rows.0, rows.1), rhs.sub_cols(cols.0, cols.1), alpha);
    };
    split_blocks((dst_ptr, dst_rs), accumulate, (lhs.rows, rhs.cols, lhs.cols), threads, &one);
}

/// Runs an `m × n × k` product into `(dst_ptr, dst_rs)` as single-threaded blocks:
/// `one(dst, rows, cols)` computes the destination block `rows × cols` whose first element is
/// at `dst`. Small products, and any
/// with [`Threads::One`], are one block; an empty one does nothing, and one with `k = 0` only
/// zeroes the destination (unless it accumulates).
///
/// The output is split into one block per thread along its longer side: measured faster here
/// than gemm's own threading (which splits small-M weight-gradient products poorly), and every
/// output element is still computed by one call with the same k order, so the split only
/// depends on the thread count.
///
/// # Safety
/// As [`gemm_raw`]; `one` must write only its own block.
pub(crate) unsafe fn split_blocks((dst_ptr, dst_rs): (*mut f32, usize), accumulate: bool, (m, n, k): (usize, usize, usize), threads: Threads, one: &(dyn Fn(*mut f32, (usize, usize), (usize, usize)) + Sync)) {
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
        one(dst_ptr, (0, m), (0, n));
        return;
    }
    let (split_rows, len) = if m >= n { (true, m) } else { (false, n) };
    let parts = t.min(len.div_ceil(16)).max(1);
    let dst = crate::par::SyncPtr(dst_ptr);
    (0..parts).into_par_iter().for_each(|i| {
        // Whole-wrapper capture: edition 2021 would otherwise capture only the raw pointer field (not Send/Sync).
        #[allow(clippy::redundant_locals)]
        let dst = dst;
        let (a, b) = (len * i / parts, len * (i + 1) / parts);
        if a == b {
            return;
        }
        // Safety: block i writes rows (or columns) a..b of the destination, disjoint from the
        // other blocks'.
        unsafe {
            if split_rows {
                one(dst.0.add(a * dst_rs), (a, b), (0, n));
            } else {
                one(dst.0.add(a), (0, m), (a, b));
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
    unsafe { gemm_raw((dst.as_mut_ptr(), rhs.cols), accumulate, lhs, rhs, alpha, threads) }
}

/// Linear layer, PyTorch layout (weights `[OC, C]`):
/// `out[BT, OC] = inp[BT, C] · weight[OC, C]ᵀ + bias[OC]`. Overwrites `out`.
pub fn matmul_forward(out: &mut [f32], inp: &[f32], weight: &[f32], bias: Option<&[f32]>, bt: usize, c: usize, oc: usize) {
    matmul_forward_as(Arith::F32, out, inp, weight, bias, (bt, c, oc))
}

/// [`matmul_forward`] in the given arithmetic, its shape `(bt, c, oc)`.
pub fn matmul_forward_as(
    arith: Arith,
    out: &mut [f32],         // [BT, OC]
    inp: &[f32],             // [BT, C]
    weight: &[f32],          // [OC, C]
    bias: Option<&[f32]>,    // [OC]
    (bt, c, oc): (usize, usize, usize),
) {
    let _p = crate::profile::scope("matmul_forward");
    assert_eq!(out.len(), bt * oc);
    assert_eq!(inp.len(), bt * c);
    assert_eq!(weight.len(), oc * c);
    let accumulate = bias_rows(out, bias, oc);
    gemm_as(arith, out, accumulate, View::rows(inp, bt, c), View::rows(weight, oc, c).t(), 1.0, Threads::All);
}

/// A linear layer's output before its product: every row of `out` (`[·, OC]`) the bias, and
/// then the product accumulates (`true`); without a bias nothing (it overwrites).
pub(crate) fn bias_rows(out: &mut [f32], bias: Option<&[f32]>, oc: usize) -> bool {
    match bias {
        Some(b) => {
            assert_eq!(b.len(), oc);
            out.par_chunks_mut(oc).for_each(|row| row.copy_from_slice(b));
            true
        }
        None => false,
    }
}

/// The gradients a linear layer's backward writes: `(dinp [BT, C], dweight [OC, C], dbias
/// [OC])`.
pub type LinearGrads<'a> = (&'a mut [f32], &'a mut [f32], Option<&'a mut [f32]>);

/// Backward of [`matmul_forward`]. Accumulates into the gradients `(dinp, dweight, dbias)`.
pub fn matmul_backward(grads: LinearGrads, dout: &[f32], inp: &[f32], weight: &[f32], bt: usize, c: usize, oc: usize) {
    matmul_backward_as(Arith::F32, grads, dout, inp, weight, (bt, c, oc))
}

/// [`matmul_backward`] in the given arithmetic (the bias gradient is an fp32 sum either way),
/// its shape `(bt, c, oc)`.
pub fn matmul_backward_as(
    arith: Arith,
    grads: LinearGrads,
    dout: &[f32],                 // [BT, OC]
    inp: &[f32],                  // [BT, C]
    weight: &[f32],               // [OC, C]
    shape: (usize, usize, usize),
) {
    matmul_backward_with(arith, true, grads, dout, inp, weight, shape)
}

/// [`matmul_backward_as`] overwriting `dinp` (`dinp = dout · weight`) for a caller that would
/// zero it first; the weight's and bias's gradients still accumulate.
pub fn matmul_backward_into_as(arith: Arith, grads: LinearGrads, dout: &[f32], inp: &[f32], weight: &[f32], shape: (usize, usize, usize)) {
    matmul_backward_with(arith, false, grads, dout, inp, weight, shape)
}

fn matmul_backward_with(arith: Arith, accumulate: bool, (dinp, dweight, dbias): LinearGrads, dout: &[f32], inp: &[f32], weight: &[f32], (bt, c, oc): (usize, usize, usize)) {
    let _p = crate::profile::scope("matmul_backward");
    assert_eq!(dout.len(), bt * oc);
    // The two products are independent and equally large: run them side by side, each on the
    // whole pool (work stealing balances them), instead of one after the other, so small
    // products (few tiles each) still keep every core busy. Each gemm splits only output
    // tiles, so the results do not depend on the scheduling. With two threads and small
    // products, each takes one thread whole (they are equally large): 2% faster per layer at
    // shakespeare-char's shapes (under 2^26 multiply-adds each) than both split over the pool,
    // 2% slower at GPT-2 124M's (2^29 and more).
    let small = bt * c * oc < 1 << 27;
    let each = if rayon::current_num_threads() == 2 && small { Threads::One } else { Threads::All };
    rayon::join(
        // dinp (+)= dout · weight
        || gemm_as(arith, dinp, accumulate, View::rows(dout, bt, oc), View::rows(weight, oc, c), 1.0, each),
        || {
            // dweight += doutᵀ · inp
            gemm_as(arith, dweight, true, View::rows(dout, bt, oc).t(), View::rows(inp, bt, c), 1.0, each);
            if let Some(db) = dbias {
                bias_backward(db, dout, bt, oc);
            }
        },
    );
}

/// The input gradient alone, `dinp += dout · weight` (for frozen weights: LoRA's base).
pub fn matmul_backward_input(dinp: &mut [f32], dout: &[f32], weight: &[f32], bt: usize, c: usize, oc: usize) {
    matmul_backward_input_as(Arith::F32, dinp, dout, weight, bt, c, oc)
}

/// [`matmul_backward_input`] in the given arithmetic.
pub fn matmul_backward_input_as(
    arith: Arith,
    dinp: &mut [f32],   // [BT, C]
    dout: &[f32],       // [BT, OC]
    weight: &[f32],     // [OC, C]
    bt: usize,
    c: usize,
    oc: usize,
) {
    let _p = crate::profile::scope("matmul_backward");
    gemm_as(arith, dinp, true, View::rows(dout, bt, oc), View::rows(weight, oc, c), 1.0, Threads::All);
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
