//! bfloat16 matrix products with fp32 accumulation: `dst (+)= alpha · lhs · rhs` where both
//! inputs are rounded to bf16 (round to nearest, ties to even) and every product and sum is
//! fp32 — what PyTorch's CPU autocast and a tensor core compute.
//!
//! Inputs are strided views over `f32` or bf16 (`u16`) buffers; they are converted while being
//! packed, so a caller never makes a bf16 copy. Three paths, chosen at run time:
//!
//! - **`avx512_bf16`**: a 6×64 register-tiled micro-kernel on `vdpbf16ps` (two bf16 products
//!   summed into each fp32 lane per instruction: twice the arithmetic of an fp32 FMA), BLIS
//!   blocking (a `KC × NR` panel of the right operand stays near the core, an `MC × KC` block of
//!   the left one in L2, a `KC × NC` block of the right one in L3).
//! - **fallback** (no BF16 instructions): blocks of both operands converted to bf16-rounded
//!   `f32` while copied into scratch, then the fp32 product of [`crate::matmul`] (AVX-512F/AVX2
//!   through `gemm`); same values up to the order of fp32 additions.
//!
//! The instruction is used only where it is faster than fp32 FMAs ([`path`]): some CPUs have
//! it at a quarter of the FMA's instruction rate.
//!
//! AMX tiles are not used (no AMX machine to test on); see docs/status.md.
//!
//! Each output element is computed by one thread in a fixed order over `k`, so results do not
//! depend on the thread count.

use crate::matmul::{split_blocks, Threads};

/// f32 → bf16 bits, round to nearest even; NaN stays a (quiet) NaN. Branch-free (a select), so
/// loops over it vectorise.
#[inline(always)]
pub fn to_bf16(x: f32) -> u16 {
    (rounded_bits(x) >> 16) as u16
}

/// `x` rounded to bf16 as f32 bits (low half zero): nearest even, a NaN quieted (never `x`'s
/// own bits for a NaN, so rounding a slice in place stays a plain vector store). What
/// [`to_bf16`] and `precision::round` share.
#[inline(always)]
pub(crate) fn rounded_bits(x: f32) -> u32 {
    let b = x.to_bits();
    let r = b.wrapping_add(0x7FFF + ((b >> 16) & 1));
    let nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    (if nan { b | 0x0040_0000 } else { r }) & 0xFFFF_0000
}

/// bf16 bits → f32 (exact).
#[inline(always)]
pub fn from_bf16(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// An element a bf16 product can read: `f32` (rounded on the way in) or bf16 bits.
pub trait Elem: Copy + Send + Sync + 'static {
    fn bf16(self) -> u16;
    /// The value as the product sees it (rounded to bf16), in f32.
    fn rounded(self) -> f32 {
        from_bf16(self.bf16())
    }
}

impl Elem for f32 {
    #[inline(always)]
    fn bf16(self) -> u16 {
        to_bf16(self)
    }
}

impl Elem for u16 {
    #[inline(always)]
    fn bf16(self) -> u16 {
        self
    }
}

/// A strided matrix view over `f32` or bf16 elements: element (i, j) lives at
/// `data[off + i·rs + j·cs]` (as [`crate::matmul::View`]).
#[derive(Clone, Copy)]
pub struct Mat<'a, E> {
    pub data: &'a [E],
    pub off: usize,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, E: Elem> Mat<'a, E> {
    /// A dense row-major `rows × cols` matrix.
    pub fn rows(data: &'a [E], rows: usize, cols: usize) -> Mat<'a, E> {
        Mat { data, off: 0, rows, cols, rs: cols, cs: 1 }
    }
    /// The transpose (no copy).
    pub fn t(self) -> Mat<'a, E> {
        Mat { rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs, ..self }
    }
    pub(crate) fn check(&self) {
        if self.rows > 0 && self.cols > 0 {
            let last = self.off + (self.rows - 1) * self.rs + (self.cols - 1) * self.cs;
            assert!(last < self.data.len(), "matrix view out of bounds");
        }
    }
    #[inline(always)]
    fn at(&self, i: usize, j: usize) -> E {
        self.data[self.off + i * self.rs + j * self.cs]
    }
    pub(crate) fn sub_rows(self, a: usize, b: usize) -> Self {
        Mat { off: self.off + a * self.rs, rows: b - a, ..self }
    }
    pub(crate) fn sub_cols(self, a: usize, b: usize) -> Self {
        Mat { off: self.off + a * self.cs, cols: b - a, ..self }
    }
}

/// Which bf16 product path this machine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// `vdpbf16ps` (AVX512_BF16).
    Avx512Bf16,
    /// Converted to bf16-rounded fp32 while packing, then fp32 FMAs.
    Fp32Fallback,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::Avx512Bf16 => "avx512_bf16 (vdpbf16ps, fp32 accumulation)",
            Path::Fp32Fallback => "fp32 fallback (bf16 inputs converted on pack, fp32 FMA)",
        }
    }
}

/// Why [`path`] is what it is.
#[derive(Clone, Debug)]
pub struct Choice {
    pub path: Path,
    /// What decided it, in a few words.
    pub why: &'static str,
}

impl Choice {
    /// One line: the path and why.
    pub fn describe(&self) -> String {
        format!("{} ({})", self.path.name(), self.why)
    }
}

/// The CPU's vendor string (`GenuineIntel`, `AuthenticAMD`, …; empty off x86-64).
pub fn vendor() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID leaf 0 exists on every x86-64 CPU.
        let r = std::arch::x86_64::__cpuid(0);
        let b: Vec<u8> = [r.ebx, r.edx, r.ecx].iter().flat_map(|w| w.to_le_bytes()).collect();
        return String::from_utf8_lossy(&b).into_owned();
    }
    #[allow(unreachable_code)]
    String::new()
}

/// The path [`gemm_bf16`] takes here: `vdpbf16ps` where the CPU has AVX512_BF16 and runs it
/// faster than fp32 FMAs, else the fallback. The instruction exists where it is not faster: on
/// AMD Zen 4 bf16 products ran 1.8× its fp32 peak (`kiln bench --peak`); on the
/// Intel Xeon measured here (Emerald Rapids, family 6 model 207) 0.5–0.8×, where it would make
/// bf16 training slower than fp32. The choice orders a product's additions, so it is made from
/// the CPU's vendor, not from a timing that a busy machine could flip: Intel's AVX512_BF16
/// takes the fallback. `KILN_BF16_PATH=fallback` or `=avx512_bf16` forces one (to test and
/// measure both on one machine).
pub fn path() -> Path {
    choice().path
}

/// [`path`] with its reason, decided once per process.
pub fn choice() -> &'static Choice {
    static CHOICE: std::sync::OnceLock<Choice> = std::sync::OnceLock::new();
    CHOICE.get_or_init(|| {
        let has = available_paths().contains(&Path::Avx512Bf16);
        let forced = std::env::var("KILN_BF16_PATH").ok();
        let (path, why) = match (forced.as_deref(), has) {
            (Some("fallback"), _) => (Path::Fp32Fallback, "forced by KILN_BF16_PATH=fallback"),
            (Some("avx512_bf16"), true) => (Path::Avx512Bf16, "forced by KILN_BF16_PATH=avx512_bf16"),
            (_, false) => (Path::Fp32Fallback, "no AVX512_BF16 on this CPU"),
            _ if vendor() == "GenuineIntel" => (Path::Fp32Fallback, "Intel's vdpbf16ps is no faster than its fp32 FMAs"),
            _ => (Path::Avx512Bf16, "AVX512_BF16"),
        };
        Choice { path, why }
    })
}

/// `vdpbf16ps`'s arithmetic rate over fp32 FMA's on this core (best of three short timed runs
/// each); 0 without AVX512_BF16.
pub fn dot_over_fma() -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16") && std::is_x86_feature_detected!("fma") {
        // Both loops run about 2 ms here (the FMA's four times as many iterations), alternating,
        // the best of five each: the AVX-512 clock settles and a noisy neighbour's slice falls out.
        const ITERS: usize = 100_000;
        let time = |f: &dyn Fn() -> f32| {
            let t = std::time::Instant::now();
            std::hint::black_box(f());
            t.elapsed().as_secs_f64()
        };
        let (mut dot, mut fma) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..5 {
            // Safety: the features were checked above.
            dot = dot.min(time(&|| unsafe { avx512::dot_chains(ITERS) }));
            fma = fma.min(time(&|| unsafe { avx512::fma_chains(4 * ITERS) }) / 4.0);
        }
        // A `vdpbf16ps` does two products per lane, an FMA one.
        return 2.0 * fma / dot;
    }
    0.0
}

/// `dst = (accumulate ? dst : 0) + alpha · bf16(lhs) · bf16(rhs)`, fp32 accumulation, with the
/// destination `(dst_ptr, dst_rs)` a strided `m × n` region at `dst_ptr` (row stride `dst_rs`,
/// column stride 1).
///
/// # Safety
/// As [`crate::matmul::gemm_raw`]: `dst_ptr` covers `(m-1)·dst_rs + n` floats that no one else
/// reads or writes during the call.
pub unsafe fn gemm_bf16_raw<A: Elem, B: Elem>(dst: (*mut f32, usize), accumulate: bool, lhs: Mat<A>, rhs: Mat<B>, alpha: f32, threads: Threads) {
    gemm_bf16_raw_on(path(), dst, accumulate, lhs, rhs, alpha, threads)
}

/// [`gemm_bf16_raw`] on the given path.
///
/// # Safety
/// As [`gemm_bf16_raw`], and `on` is this machine's [`path`] or the fallback.
unsafe fn gemm_bf16_raw_on<A: Elem, B: Elem>(on: Path, (dst_ptr, dst_rs): (*mut f32, usize), accumulate: bool, lhs: Mat<A>, rhs: Mat<B>, alpha: f32, threads: Threads) {
    assert_eq!(lhs.cols, rhs.rows, "inner dimensions differ");
    lhs.check();
    rhs.check();
    let one = |d: *mut f32, rows: (usize, usize), cols: (usize, usize)| {
        let (l, r) = (lhs.sub_rows(rows.0, rows.1), rhs.sub_cols(cols.0, cols.1));
        match on {
            #[cfg(target_arch = "x86_64")]
            Path::Avx512Bf16 => avx512::gemm(d, dst_rs, accumulate, l, r, alpha),
            _ => fallback(d, dst_rs, accumulate, l, r, alpha),
        }
    };
    split_blocks((dst_ptr, dst_rs), accumulate, (lhs.rows, rhs.cols, lhs.cols), threads, &one);
}

/// Safe form of [`gemm_bf16_raw`] for a dense row-major destination `dst[m × n]`.
pub fn gemm_bf16<A: Elem, B: Elem>(dst: &mut [f32], accumulate: bool, lhs: Mat<A>, rhs: Mat<B>, alpha: f32, threads: Threads) {
    gemm_bf16_on(path(), dst, accumulate, lhs, rhs, alpha, threads)
}

/// The paths this machine can run: the fallback, and `vdpbf16ps` where the CPU has it (even
/// when `KILN_BF16_PATH` forces the fallback), for tests that check each.
pub fn available_paths() -> Vec<Path> {
    let mut v = vec![Path::Fp32Fallback];
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16") {
        v.push(Path::Avx512Bf16);
    }
    v
}

/// [`gemm_bf16`] on a path of [`available_paths`] (panics on another).
pub fn gemm_bf16_on<A: Elem, B: Elem>(on: Path, dst: &mut [f32], accumulate: bool, lhs: Mat<A>, rhs: Mat<B>, alpha: f32, threads: Threads) {
    assert_eq!(dst.len(), lhs.rows * rhs.cols, "destination size");
    assert!(on == path() || available_paths().contains(&on), "bf16 path {on:?} is not available here");
    unsafe { gemm_bf16_raw_on(on, (dst.as_mut_ptr(), rhs.cols), accumulate, lhs, rhs, alpha, threads) }
}

/// The fallback: blocks of both operands rounded to bf16 into dense fp32 scratch (at most
/// `MB × KB + KB × NB` floats, whatever the product's size), each pair of blocks one
/// single-threaded fp32 product accumulating in k order.
unsafe fn fallback<A: Elem, B: Elem>(dst: *mut f32, dst_rs: usize, accumulate: bool, lhs: Mat<A>, rhs: Mat<B>, alpha: f32) {
    use crate::matmul::View;
    const MB: usize = 512;
    const KB: usize = 512;
    const NB: usize = 4096;
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    let mut a = crate::par::pooled(MB.min(m) * KB.min(k));
    let mut b = crate::par::pooled(KB.min(k) * NB.min(n));
    for i0 in (0..m).step_by(MB) {
        let mb = MB.min(m - i0);
        for j0 in (0..n).step_by(NB) {
            let nb = NB.min(n - j0);
            for k0 in (0..k).step_by(KB) {
                let kb = KB.min(k - k0);
                round_block(&mut a[..mb * kb], &lhs, i0, mb, k0, kb);
                round_block(&mut b[..kb * nb], &rhs, k0, kb, j0, nb);
                let acc = accumulate || k0 > 0;
                crate::matmul::gemm_raw((dst.add(i0 * dst_rs + j0), dst_rs), acc, View::rows(&a[..mb * kb], mb, kb), View::rows(&b[..kb * nb], kb, nb), alpha, Threads::One);
            }
        }
    }
}

/// `out[rows × cols]` (dense) = `m[r0.., c0..]` rounded to bf16, read along its contiguous
/// direction.
fn round_block<E: Elem>(out: &mut [f32], m: &Mat<E>, r0: usize, rows: usize, c0: usize, cols: usize) {
    if m.cs == 1 {
        for i in 0..rows {
            out[i * cols..(i + 1) * cols].iter_mut().enumerate().for_each(|(j, v)| *v = m.at(r0 + i, c0 + j).rounded());
        }
    } else {
        for j in 0..cols {
            for i in 0..rows {
                out[i * cols + j] = m.at(r0 + i, c0 + j).rounded();
            }
        }
    }
}

/// Measures this machine's bf16 matmul peak in FLOP/s (all threads, bf16 inputs): the best of
/// `reps` square `n × n × n` products.
pub fn measure_peak_flops(n: usize, reps: usize) -> f64 {
    let a: Vec<u16> = (0..n * n).map(|i| to_bf16(((i % 7) as f32 - 3.0) * 0.1)).collect();
    let b: Vec<u16> = (0..n * n).map(|i| to_bf16(((i % 5) as f32 - 2.0) * 0.1)).collect();
    let mut c = vec![0.0f32; n * n];
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t0 = std::time::Instant::now();
        gemm_bf16(&mut c, false, Mat::rows(&a, n, n), Mat::rows(&b, n, n), 1.0, Threads::All);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(&c);
    2.0 * (n as f64).powi(3) / best
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Elem, Mat};
    use std::arch::x86_64::*;

    /// Rows and columns of the register tile: 6 × 4 zmm accumulators (24 of the 32 registers),
    /// four right-operand loads and six broadcasts per 24 `vdpbf16ps` (measured on Zen 4 against
    /// 12 × 32, 8 × 48, 5 × 80 and 4 × 96: the fewest loads per product wins).
    pub const MR: usize = 6;
    pub const NR: usize = 64;
    /// `k` per block (even): a `KC × NR` bf16 panel of the right operand is 48 KB (L1 and L2);
    /// longer blocks store the tile less often (256 and 512 measured slower).
    const KC: usize = 384;
    /// Rows per left block: `MC × KC` bf16 is 54 KB (L2).
    const MC: usize = 12 * MR;
    /// Columns per right block: `KC × NC` bf16 is 3 MB (L3).
    const NC: usize = 64 * NR;

    thread_local! {
        static PACK: std::cell::RefCell<(Vec<u32>, Vec<u32>, Vec<u32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
    }

    /// `(lo, hi)` as one u32 pair (low half first), the order `vdpbf16ps` multiplies.
    #[inline(always)]
    fn pair<E: Elem>(lo: E, hi: E) -> u32 {
        lo.bf16() as u32 | ((hi.bf16() as u32) << 16)
    }

    /// `out[x] = pair(s0[x], s1[x])`: two contiguous source rows interleaved.
    #[inline(always)]
    fn interleave<E: Elem>(out: &mut [u32], s0: &[E], s1: &[E]) {
        let n = out.len().min(s0.len()).min(s1.len());
        let full = if std::mem::size_of::<E>() == 4 { n / 16 * 16 } else { 0 };
        // f32 sources, 16 at a time: both rows converted by one instruction, then their halves
        // interleaved by one permute (LLVM's vectorisation of the scalar form is 3× slower).
        if full > 0 {
            let mut idx = [0i16; 32];
            for (i, x) in idx.iter_mut().enumerate() {
                *x = ((i % 2) * 16 + i / 2) as i16;
            }
            // Safety: 16 elements from x < full ≤ each slice's length; the caller enabled
            // avx512bf16 and avx512bw; f32 is the only 4-byte `Elem`.
            unsafe {
                let idx = _mm512_loadu_si512(idx.as_ptr() as *const _);
                let (a, b) = (s0.as_ptr() as *const f32, s1.as_ptr() as *const f32);
                for x in (0..full).step_by(16) {
                    let h: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(b.add(x)), _mm512_loadu_ps(a.add(x))));
                    _mm512_storeu_si512(out.as_mut_ptr().add(x) as *mut _, _mm512_permutexvar_epi16(idx, h));
                }
            }
        }
        for ((o, &a), &b) in out[full..n].iter_mut().zip(&s0[full..n]).zip(&s1[full..n]) {
            *o = pair(a, b);
        }
    }

    /// Packs a `rows × kc` block of `m` (rows from `i0`, k from `k0`) as panels of `w` rows:
    /// panel `ip`, pair `p`, row `r` at `out[(ip·kp + p)·w + r]` holds `(M[i][k], M[i][k+1])`,
    /// zero past the edges. The left operand packs with `w = MR`; the right one, transposed,
    /// with `w = NR`.
    #[inline(always)]
    fn pack<E: Elem>(out: &mut [u32], row: &mut Vec<u32>, m: &Mat<E>, (i0, rows): (usize, usize), (k0, kc): (usize, usize), w: usize) {
        let kp = kc.div_ceil(2);
        let panels = rows.div_ceil(w);
        let even = kc / 2;
        if m.rs == 1 {
            // Rows are contiguous along i: interleave two k's, reading each source row segment
            // once, whole (reading it panel by panel strides by the row length, which maps
            // every read of a panel to the same cache sets when it is a multiple of 4 KB).
            // The whole segment is interleaved into one row of pairs first (vectorised even
            // for the left operand's 6-row panels), then copied out panel by panel. (No
            // closure here: intrinsics inside one are not compiled with the caller's features.)
            row.resize(rows, 0);
            {
                for p in 0..kp {
                    let k = k0 + 2 * p;
                    let s0 = &m.data[m.off + i0 + k * m.cs..][..rows];
                    match (2 * p + 1 < kc).then(|| &m.data[m.off + i0 + (k + 1) * m.cs..][..rows]) {
                        Some(s1) => interleave(&mut row[..], s0, s1),
                        None => row.iter_mut().zip(s0).for_each(|(o, &x)| *o = x.bf16() as u32),
                    }
                    for ip in 0..panels {
                        let h = w.min(rows - ip * w);
                        let d = &mut out[(ip * kp + p) * w..][..w];
                        d[..h].copy_from_slice(&row[ip * w..ip * w + h]);
                        d[h..].fill(0);
                    }
                }
            }
            return;
        }
        for ip in 0..panels {
            let o = &mut out[ip * kp * w..(ip + 1) * kp * w];
            let h = w.min(rows - ip * w);
            let base = i0 + ip * w;
            // Full panels of rows contiguous along k: 16 × 16 blocks of pairs, transposed in
            // registers (a scalar u32 store per pair cost as much as the product of a short
            // left operand: the LM head's chunks, every forward's weight).
            let fast = if m.cs == 1 && w.is_multiple_of(16) && h == w { even / 16 * 16 } else { 0 };
            if fast > 0 {
                for r0 in (0..w).step_by(16) {
                    let row = m.off + (base + r0) * m.rs + k0;
                    for p0 in (0..fast).step_by(16) {
                        // Safety: rows base + r0 .. + 16 and k0 + 2·p0 .. + 32 are inside the
                        // view (checked by the caller); the 16 stores are inside this panel.
                        unsafe { block16(o.as_mut_ptr().add(p0 * w + r0), w, m.data.as_ptr().add(row + 2 * p0), m.rs) };
                    }
                }
            }
            // Narrow panels (the left operand's MR rows) of rows contiguous along k: 16 pairs
            // of a row converted at once, then spread.
            let narrow = if m.cs == 1 && fast == 0 { even / 16 * 16 } else { 0 };
            if narrow > 0 {
                let mut tmp = [0u32; 16];
                for r in 0..h {
                    let row = m.off + (base + r) * m.rs + k0;
                    for p0 in (0..narrow).step_by(16) {
                        // Safety: k0 + 2·p0 + 32 ≤ k0 + kc, inside the view.
                        unsafe { _mm512_storeu_si512(tmp.as_mut_ptr() as *mut _, pairs16(m.data.as_ptr().add(row + 2 * p0))) };
                        for (q, &x) in tmp.iter().enumerate() {
                            o[(p0 + q) * w + r] = x;
                        }
                    }
                }
            }
            let fast = fast.max(narrow);
            // Each row's pairs: contiguous along k when cs = 1.
            for r in 0..h {
                let row = m.off + (base + r) * m.rs + k0 * m.cs;
                if m.cs == 1 {
                    let src = &m.data[row..row + kc];
                    for (p, two) in src.chunks_exact(2).enumerate().skip(fast) {
                        o[p * w + r] = pair(two[0], two[1]);
                    }
                } else {
                    for p in 0..even {
                        o[p * w + r] = pair(m.data[row + 2 * p * m.cs], m.data[row + (2 * p + 1) * m.cs]);
                    }
                }
                if kc % 2 == 1 {
                    o[even * w + r] = m.data[row + (kc - 1) * m.cs].bf16() as u32;
                }
            }
            for r in h..w {
                for p in 0..kp {
                    o[p * w + r] = 0;
                }
            }
        }
    }

    /// 16 consecutive pairs at `p` (32 elements) as u32 lanes, low half first.
    #[inline(always)]
    unsafe fn pairs16<E: Elem>(p: *const E) -> __m512i {
        if std::mem::size_of::<E>() == 4 {
            // f32 (the only 4-byte `Elem`): RNE conversion, in order.
            let p = p as *const f32;
            std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p.add(16)), _mm512_loadu_ps(p)))
        } else {
            _mm512_loadu_si512(p as *const _)
        }
    }

    /// `out[q·w + r] = pair q of row r` for 16 rows `src + r·rs` and 16 pairs.
    #[inline(always)]
    unsafe fn block16<E: Elem>(out: *mut u32, w: usize, src: *const E, rs: usize) {
        let mut v = [_mm512_setzero_si512(); 16];
        for (r, x) in v.iter_mut().enumerate() {
            *x = pairs16(src.add(r * rs));
        }
        // Butterfly transpose: at block size s, rows i and i + s swap their off-diagonal
        // s-blocks (lane l of a pair's index vector takes a[..] below 16, b[.. − 16] above).
        for s in [8usize, 4, 2, 1] {
            let mut lo = [0i32; 16];
            let mut hi = [0i32; 16];
            for l in 0..16 {
                let top = l & s == 0;
                lo[l] = if top { l as i32 } else { (16 + l - s) as i32 };
                hi[l] = if top { (l + s) as i32 } else { (16 + l) as i32 };
            }
            let (lo, hi) = (_mm512_loadu_si512(lo.as_ptr() as *const _), _mm512_loadu_si512(hi.as_ptr() as *const _));
            for i in 0..16 {
                if i & s == 0 {
                    let (a, b) = (v[i], v[i + s]);
                    v[i] = _mm512_permutex2var_epi32(a, lo, b);
                    v[i + s] = _mm512_permutex2var_epi32(a, hi, b);
                }
            }
        }
        for (q, x) in v.iter().enumerate() {
            _mm512_storeu_si512(out.add(q * w) as *mut _, *x);
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    unsafe fn pack_a<E: Elem>(out: &mut [u32], row: &mut Vec<u32>, a: &Mat<E>, i0: usize, mc: usize, k0: usize, kc: usize) {
        pack(out, row, a, (i0, mc), (k0, kc), MR)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    unsafe fn pack_b<E: Elem>(out: &mut [u32], row: &mut Vec<u32>, b: &Mat<E>, k0: usize, kc: usize, j0: usize, nc: usize) {
        pack(out, row, &b.t(), (j0, nc), (k0, kc), NR)
    }

    /// One single-threaded product (see [`super::gemm_bf16_raw`] for the contract).
    pub unsafe fn gemm<A: Elem, B: Elem>(dst: *mut f32, dst_rs: usize, accumulate: bool, lhs: Mat<A>, rhs: Mat<B>, alpha: f32) {
        PACK.with(|cell| {
            let mut bufs = cell.borrow_mut();
            let (pa, pb, row) = &mut *bufs;
            // Safety: the caller checked the features (`super::path`).
            unsafe { drive((pa, pb, row), (dst, dst_rs), accumulate, lhs, rhs, alpha) }
        });
    }

    /// The blocked loops of [`gemm`], compiled with the kernel's features (so the packers'
    /// intrinsics inline: inside the thread-local's closure they were calls).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    unsafe fn drive<A: Elem, B: Elem>((pa, pb, row): (&mut Vec<u32>, &mut Vec<u32>, &mut Vec<u32>), (dst, dst_rs): (*mut f32, usize), accumulate: bool, lhs: Mat<A>, rhs: Mat<B>, alpha: f32) {
        let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
        let kcap = KC.min(k).div_ceil(2);
        pa.resize(kcap * MC.min(m).div_ceil(MR) * MR, 0);
        pb.resize(kcap * NC.min(n).div_ceil(NR) * NR, 0);
        let mut tile = [0.0f32; MR * NR];
        for j0 in (0..n).step_by(NC) {
            let nc = NC.min(n - j0);
            for k0 in (0..k).step_by(KC) {
                let kc = KC.min(k - k0);
                let kp = kc.div_ceil(2);
                // The first k block overwrites unless the caller accumulates.
                let add = accumulate || k0 > 0;
                pack_b(pb, row, &rhs, k0, kc, j0, nc);
                for i0 in (0..m).step_by(MC) {
                    let mc = MC.min(m - i0);
                    pack_a(pa, row, &lhs, i0, mc, k0, kc);
                    for jp in 0..nc.div_ceil(NR) {
                        let w = NR.min(nc - jp * NR);
                        let bp = pb.as_ptr().add(jp * kp * NR);
                        for ip in 0..mc.div_ceil(MR) {
                            let h = MR.min(mc - ip * MR);
                            let ap = pa.as_ptr().add(ip * kp * MR);
                            let c = dst.add((i0 + ip * MR) * dst_rs + j0 + jp * NR);
                            if h == MR && w == NR {
                                kernel(kp, ap, bp, c, dst_rs, add, alpha);
                            } else {
                                // An edge tile: computed whole into scratch, the valid part added.
                                kernel(kp, ap, bp, tile.as_mut_ptr(), NR, false, alpha);
                                for r in 0..h {
                                    for j in 0..w {
                                        let d = c.add(r * dst_rs + j);
                                        *d = if add { *d + tile[r * NR + j] } else { tile[r * NR + j] };
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Independent accumulators in the rate measurements: more than latency × throughput.
    const CHAINS: usize = 24;

    /// `iters × CHAINS` independent `vdpbf16ps` (see [`super::dot_over_fma`]).
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dot_chains(iters: usize) -> f32 {
        let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(std::hint::black_box(0x3F80_3F80)));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_dpbf16_ps(*v, x, x);
            }
        }
        acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }

    /// `iters × CHAINS` independent `vfmadd…ps` on zmm registers.
    #[target_feature(enable = "avx512f,fma")]
    pub unsafe fn fma_chains(iters: usize) -> f32 {
        let x = _mm512_set1_ps(std::hint::black_box(1.0));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(x, x, *v);
            }
        }
        acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }

    /// The register tile: `C[MR × NR] (+)= alpha · Σ_p A_p ⊗ B_p` over `kp` packed pairs.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn kernel(kp: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize, add: bool, alpha: f32) {
        const NV: usize = NR / 16;
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        let (mut a, mut b) = (a, b);
        for _ in 0..kp {
            let mut bv: [__m512bh; NV] = std::mem::zeroed();
            for (h, v) in bv.iter_mut().enumerate() {
                *v = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.add(16 * h) as *const _));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(r) as i32));
                for (h, v) in row.iter_mut().enumerate() {
                    *v = _mm512_dpbf16_ps(*v, av, bv[h]);
                }
            }
            a = a.add(MR);
            b = b.add(NR);
        }
        let al = _mm512_set1_ps(alpha);
        for (r, row) in acc.iter().enumerate() {
            let p = c.add(r * ldc);
            for (h, v) in row.iter().enumerate() {
                let q = p.add(16 * h);
                let v = _mm512_mul_ps(*v, al);
                let v = if add { _mm512_add_ps(_mm512_loadu_ps(q), v) } else { v };
                _mm512_storeu_ps(q, v);
            }
        }
    }
}
