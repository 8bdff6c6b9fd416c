//! Weight quantization for frozen base models (QLoRA, Dettmers et al. 2023, "QLoRA: Efficient
//! Finetuning of Quantized LLMs"): 4-bit NormalFloat (NF4) in blocks of 64 with double
//! quantization of the block scales, and int8 per output channel as the simpler option.
//!
//! NF4 (the paper's §3, as bitsandbytes' `create_normal_map(offset = 0.9677083)` builds it): the
//! values are quantiles of N(0, 1) — 8 at probabilities `linspace(offset, 0.5, 9)[..8]` for the
//! positive half, 7 at `linspace(offset, 0.5, 8)[..7]` negated for the negative half, and an
//! exact zero — normalised by the largest, so they span [-1, 1]. A block of 64 weights is stored
//! as its absolute maximum `c` and, per weight, the index of the codebook value nearest `w / c`
//! (two indices per byte, the first in the high nibble). Double quantization (§3, "Double
//! Quantization") stores the block maxima themselves in 8 bits: their mean is subtracted, and each
//! run of 256 is scaled so its largest magnitude maps to 448 and rounded to FP8 E4M3, with one
//! f32 scale per run. Bytes per weight: `0.5 + 1/64 + 4/(64·256)` ≈ 0.5159 (4.127 bits), against
//! `0.5 + 4/64` = 0.5625 without.
//!
//! Dequantization is by block, so a matmul can dequantize a tile of rows at a time.

use crate::precision::{round, Format};

/// Weights per NF4 block (the paper's block size for the first quantization).
pub const NF4_BLOCK: usize = 64;
/// First-level scales per double-quantization block (the paper's 256).
pub const SCALE_BLOCK: usize = 256;
/// The offset bitsandbytes' NF4 map starts its quantiles at: `(1 - 1/(2·15) + 1 - 1/(2·16)) / 2`.
pub const NF4_OFFSET: f64 = 0.9677083;

/// The NF4 codebook as the QLoRA paper and bitsandbytes publish it (ascending; index 7 is 0).
#[allow(clippy::excessive_precision)]
pub const NF4: [f32; 16] = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
];

/// The standard normal CDF, from the Maclaurin series of erf (converges fast for the |x| ≤ 3
/// the codebook needs; exact to f64 rounding there).
fn normal_cdf(x: f64) -> f64 {
    let z = x / std::f64::consts::SQRT_2;
    let (mut term, mut sum, mut n) = (z, z, 0.0);
    while term.abs() > 1e-18 * sum.abs().max(1e-300) {
        n += 1.0;
        term *= -z * z / n;
        sum += term / (2.0 * n + 1.0);
    }
    0.5 * (1.0 + 2.0 / std::f64::consts::PI.sqrt() * sum)
}

/// The standard normal quantile of `p` in (0.0013, 0.9987), by bisection on [`normal_cdf`].
fn normal_ppf(p: f64) -> f64 {
    let (mut lo, mut hi) = (-3.0f64, 3.0f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if normal_cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// The NF4 codebook computed from its definition (see the module doc); equals [`NF4`].
pub fn nf4_codebook() -> [f32; 16] {
    // The probabilities as torch.linspace gives them in f32 (bitsandbytes builds the map with
    // torch's default dtype: the published values carry that rounding), each quantile rounded
    // to f32, then the sorted values divided by the largest in f32.
    let lin = |n: usize, i: usize| -> f32 {
        let (a, b) = (NF4_OFFSET as f32, 0.5f32);
        let step = (b - a) / (n - 1) as f32;
        if i < n / 2 { a + step * i as f32 } else { b - step * (n - 1 - i) as f32 }
    };
    let mut v: Vec<f32> = (0..8).map(|i| normal_ppf(lin(9, i) as f64) as f32).collect();
    v.extend((0..7).map(|i| -normal_ppf(lin(8, i) as f64) as f32));
    v.push(0.0);
    v.sort_by(f32::total_cmp);
    let max = v[15];
    std::array::from_fn(|i| v[i] / max)
}

/// Midpoints between consecutive codebook values: a value's code is how many lie below it.
fn midpoints() -> [f32; 15] {
    std::array::from_fn(|i| (NF4[i] + NF4[i + 1]) * 0.5)
}

/// The NF4 code of `x` (already divided by its block's maximum): the nearest codebook value,
/// the upper one at an exact midpoint.
#[inline]
fn nf4_code(x: f32, mids: &[f32; 15]) -> u8 {
    mids.iter().filter(|&&m| m < x).count() as u8
}

/// A block's maximum magnitude, 1 for an all-zero block (its codes are then all 0.0's).
fn block_absmax(x: &[f32]) -> f32 {
    let m = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if m > 0.0 { m } else { 1.0 }
}

/// The block maxima, in f32 or double-quantized.
#[derive(Clone, Debug, PartialEq)]
pub enum Absmax {
    F32(Vec<f32>),
    /// `c = e4m3(code)·scale[run] + mean`, `run = block / 256`.
    Double { codes: Vec<u8>, scales: Vec<f32>, mean: f32 },
}

/// An NF4-quantized tensor of `len` weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Nf4 {
    pub len: usize,
    /// Two codes per byte, the first in the high nibble.
    pub codes: Vec<u8>,
    pub absmax: Absmax,
}

/// FP8 E4M3 bits of a value exact in E4M3 (what [`round`] gives).
fn e4m3_bits(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a == 0.0 {
        return sign;
    }
    let e = a.log2().floor() as i32;
    if e < -6 {
        // Subnormal: m·2^-9.
        return sign | (a * 512.0) as u8;
    }
    let m = ((a / 2f32.powi(e) - 1.0) * 8.0) as u8;
    sign | (((e + 7) as u8) << 3) | m
}

/// The value of E4M3 bits (no NaN codes are produced here).
fn e4m3_value(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((b >> 3) & 0xF) as i32, (b & 7) as f32);
    sign * if e == 0 { m / 512.0 } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) }
}

impl Nf4 {
    /// Quantizes `x` in blocks of [`NF4_BLOCK`] (the last may be shorter), double-quantizing
    /// the block maxima when `double`.
    pub fn quantize(x: &[f32], double: bool) -> Nf4 {
        let mids = midpoints();
        let blocks: Vec<&[f32]> = x.chunks(NF4_BLOCK).collect();
        let maxima: Vec<f32> = blocks.iter().map(|b| block_absmax(b)).collect();
        let absmax = if double { double_quantize(&maxima) } else { Absmax::F32(maxima) };
        // Codes against the maxima as dequantization will see them.
        let mut q = Nf4 { len: x.len(), codes: vec![0; x.len().div_ceil(2)], absmax };
        for (bi, b) in blocks.iter().enumerate() {
            let c = q.block_max(bi);
            for (j, &w) in b.iter().enumerate() {
                let i = bi * NF4_BLOCK + j;
                let code = nf4_code(w / c, &mids);
                q.codes[i / 2] |= if i.is_multiple_of(2) { code << 4 } else { code };
            }
        }
        q
    }

    /// Block `b`'s maximum, as dequantization uses it.
    pub fn block_max(&self, b: usize) -> f32 {
        match &self.absmax {
            Absmax::F32(m) => m[b],
            Absmax::Double { codes, scales, mean } => e4m3_value(codes[b]) * scales[b / SCALE_BLOCK] + mean,
        }
    }

    /// The code of weight `i` (an index into [`NF4`]).
    #[inline]
    pub fn code(&self, i: usize) -> u8 {
        let b = self.codes[i / 2];
        if i.is_multiple_of(2) { b >> 4 } else { b & 0xF }
    }

    /// Weights `start .. start + out.len()` dequantized into `out`; `start` is a multiple of
    /// [`NF4_BLOCK`] (a tile of whole blocks).
    pub fn dequantize_into(&self, out: &mut [f32], start: usize) {
        assert!(start.is_multiple_of(NF4_BLOCK) && start + out.len() <= self.len, "NF4 tile {start}+{} of {}", out.len(), self.len);
        for (k, chunk) in out.chunks_mut(NF4_BLOCK).enumerate() {
            let b = start / NF4_BLOCK + k;
            let c = self.block_max(b);
            for (j, o) in chunk.iter_mut().enumerate() {
                *o = NF4[self.code(b * NF4_BLOCK + j) as usize] * c;
            }
        }
    }

    /// Every weight, dequantized.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len];
        self.dequantize_into(&mut out, 0);
        out
    }

    /// Bytes held: the codes and the block maxima (with their own scales and mean).
    pub fn bytes(&self) -> usize {
        self.codes.len()
            + match &self.absmax {
                Absmax::F32(m) => 4 * m.len(),
                Absmax::Double { codes, scales, .. } => codes.len() + 4 * scales.len() + 4,
            }
    }
}

/// The double quantization of block maxima `m`: mean removed, runs of [`SCALE_BLOCK`] scaled to
/// E4M3's ±448 and rounded to it.
fn double_quantize(m: &[f32]) -> Absmax {
    let mean = (m.iter().map(|&x| x as f64).sum::<f64>() / m.len().max(1) as f64) as f32;
    let mut codes = Vec::with_capacity(m.len());
    let mut scales = Vec::with_capacity(m.len().div_ceil(SCALE_BLOCK));
    for run in m.chunks(SCALE_BLOCK) {
        let amax = run.iter().fold(0f32, |a, &x| a.max((x - mean).abs()));
        let s = if amax > 0.0 { amax / Format::E4m3.max() } else { 1.0 };
        scales.push(s);
        codes.extend(run.iter().map(|&x| e4m3_bits(round((x - mean) / s, Format::E4m3))));
    }
    Absmax::Double { codes, scales, mean }
}

/// An int8-quantized `[rows, cols]` matrix: per row (output channel) `w ≈ code·scale[row]`,
/// `scale = max |w| / 127`, codes rounded to nearest (ties to even).
#[derive(Clone, Debug, PartialEq)]
pub struct Int8Rows {
    pub rows: usize,
    pub cols: usize,
    pub codes: Vec<i8>,
    pub scales: Vec<f32>,
}

impl Int8Rows {
    pub fn quantize(x: &[f32], rows: usize, cols: usize) -> Int8Rows {
        assert_eq!(x.len(), rows * cols, "int8 quantize: {} values for [{rows}, {cols}]", x.len());
        let mut codes = Vec::with_capacity(x.len());
        let mut scales = Vec::with_capacity(rows);
        for r in x.chunks(cols.max(1)).take(rows) {
            let s = block_absmax(r) / 127.0;
            scales.push(s);
            codes.extend(r.iter().map(|&w| (w / s).round_ties_even().clamp(-127.0, 127.0) as i8));
        }
        Int8Rows { rows, cols, codes, scales }
    }

    /// Rows `r0 .. r0 + out.len() / cols` dequantized into `out`.
    pub fn dequantize_rows(&self, out: &mut [f32], r0: usize) {
        for (k, o) in out.chunks_mut(self.cols).enumerate() {
            let (s, base) = (self.scales[r0 + k], (r0 + k) * self.cols);
            for (j, v) in o.iter_mut().enumerate() {
                *v = self.codes[base + j] as f32 * s;
            }
        }
    }

    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.scales.len()
    }
}

/// One quantized tensor, flat.
#[derive(Clone, Copy)]
pub enum QPart<'a> {
    Nf4(&'a Nf4),
    Int8(&'a Int8Rows),
}

impl QPart<'_> {
    pub fn len(&self) -> usize {
        match self {
            QPart::Nf4(q) => q.len,
            QPart::Int8(q) => q.codes.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `start .. start + out.len()` dequantized into `out` (any start).
    fn decode(&self, out: &mut [f32], start: usize) {
        assert!(start + out.len() <= self.len(), "quantized range {start}+{} of {}", out.len(), self.len());
        match self {
            QPart::Nf4(q) => {
                let mut i = start;
                let mut rest = &mut out[..];
                while !rest.is_empty() {
                    let b = i / NF4_BLOCK;
                    let n = ((b + 1) * NF4_BLOCK - i).min(rest.len());
                    let c = q.block_max(b);
                    let (now, later) = rest.split_at_mut(n);
                    for (j, o) in now.iter_mut().enumerate() {
                        *o = NF4[q.code(i + j) as usize] * c;
                    }
                    (i, rest) = (i + n, later);
                }
            }
            QPart::Int8(q) => {
                // Row by row: one scale per run.
                let (mut i, mut rest) = (start, &mut out[..]);
                while !rest.is_empty() {
                    let r = i / q.cols;
                    let n = ((r + 1) * q.cols - i).min(rest.len());
                    let s = q.scales[r];
                    let (now, later) = rest.split_at_mut(n);
                    now.iter_mut().zip(&q.codes[i..i + n]).for_each(|(o, &c)| *o = c as f32 * s);
                    (i, rest) = (i + n, later);
                }
            }
        }
    }
}

/// A quantized `[rows, cols]` weight matrix (row-major) as a product reads it: one tensor, or
/// several stacked along the rows (LLaMA's q|k|v and gate|up projections are separate tensors
/// quantized on their own) — row-major, that is their flat concatenation.
#[derive(Clone)]
pub struct QMat<'a> {
    pub parts: Vec<QPart<'a>>,
}

impl QMat<'_> {
    /// Weights `start .. start + out.len()` of the flat row-major matrix, dequantized into
    /// `out` (any start: a tile's part of a row).
    pub fn decode(&self, mut out: &mut [f32], mut start: usize) {
        for p in &self.parts {
            if out.is_empty() {
                return;
            }
            let n = p.len();
            if start >= n {
                start -= n;
                continue;
            }
            let k = (n - start).min(out.len());
            let (now, later) = out.split_at_mut(k);
            p.decode(now, start);
            (out, start) = (later, 0);
        }
        assert!(out.is_empty(), "quantized matrix range past its end");
    }
}

/// Output columns per dequantized tile of a quantized product.
pub const QTILE: usize = 128;

/// `dst[m × n] (+)= lhs[m × k] · rhs` (`(k, n)`) where the right operand is produced a tile of [`QTILE`]
/// columns at a time: `fill(scratch, j0, nb)` dequantizes columns `j0..j0+nb` into
/// `scratch` (`k · nb` floats), stored `[nb, k]` when `transposed`, else `[k, nb]`. Tiles run in parallel,
/// each a single-threaded product over the whole `k`, so an output element's additions do not
/// depend on the tiling or the thread count; at most one tile per thread exists in fp32.
fn tiled(arith: crate::matmul::Arith, dst: &mut [f32], accumulate: bool, lhs: crate::matmul::View, (k, n): (usize, usize), transposed: bool, fill: &(dyn Fn(&mut [f32], usize, usize) + Sync)) {
    use crate::matmul::View;
    use rayon::prelude::*;
    let m = lhs.rows;
    assert_eq!(lhs.cols, k, "inner dimensions differ");
    assert_eq!(dst.len(), m * n, "destination size");
    let ptr = crate::par::SyncPtr(dst.as_mut_ptr());
    (0..n.div_ceil(QTILE)).into_par_iter().for_each(|t| {
        // Whole-wrapper capture: edition 2021 would otherwise capture only the raw pointer field (not Send/Sync).
        #[allow(clippy::redundant_locals)]
        let ptr = ptr;
        let (j0, nb) = (t * QTILE, QTILE.min(n - t * QTILE));
        let mut scratch = crate::par::pooled(k * nb);
        fill(&mut scratch, j0, nb);
        let rhs = if transposed { View::rows(&scratch, nb, k).t() } else { View::rows(&scratch, k, nb) };
        // SAFETY: tile t writes columns j0..j0+nb of every row, disjoint from the others'.
        unsafe { crate::matmul::gemm_raw_as(arith, (ptr.0.add(j0), n), accumulate, lhs, rhs, 1.0, crate::matmul::Threads::One) }
    });
}

/// A linear layer over a quantized weight (QLoRA's base product): `out[BT, OC] = inp[BT, C] ·
/// deq(W)ᵀ (+ bias)`, `W` `[OC, C]`, dequantized [`QTILE`] rows at a time inside the product
/// — the same values as [`crate::matmul::matmul_forward_as`] over the dequantized matrix,
/// without it ever existing whole; with `round`, each tile rounded to that format first (a
/// bf16 base), its shape `(bt, c, oc)`. Overwrites `out`.
pub fn qmatmul_forward(arith: crate::matmul::Arith, round: Option<Format>, out: &mut [f32], inp: &[f32], w: &QMat, bias: Option<&[f32]>, (bt, c, oc): (usize, usize, usize)) {
    let _p = crate::profile::scope("qmatmul_forward");
    assert_eq!(inp.len(), bt * c);
    let accumulate = crate::matmul::bias_rows(out, bias, oc);
    // Tile = rows j0..j0+nb of W, contiguous: [nb, C], read transposed.
    let fill = |s: &mut [f32], j0: usize, nb: usize| {
        w.decode(&mut s[..nb * c], j0 * c);
        if let Some(f) = round {
            crate::precision::round_slice(&mut s[..nb * c], f);
        }
    };
    tiled(arith, out, accumulate, crate::matmul::View::rows(inp, bt, c), (c, oc), true, &fill);
}

/// The input gradient through a quantized frozen weight: `dinp[BT, C] += dout[BT, OC] ·
/// deq(W)`, `W` `[OC, C]` dequantized [`QTILE`] columns at a time; the shape `(bt, c, oc)`.
pub fn qmatmul_backward_input(arith: crate::matmul::Arith, round: Option<Format>, dinp: &mut [f32], dout: &[f32], w: &QMat, (bt, c, oc): (usize, usize, usize)) {
    let _p = crate::profile::scope("qmatmul_backward");
    assert_eq!(dout.len(), bt * oc);
    // Tile = columns j0..j0+nb of every row of W: [OC, nb].
    let fill = |s: &mut [f32], j0: usize, nb: usize| {
        for r in 0..oc {
            w.decode(&mut s[r * nb..(r + 1) * nb], r * c + j0);
        }
        if let Some(f) = round {
            crate::precision::round_slice(&mut s[..oc * nb], f);
        }
    };
    tiled(arith, dinp, true, crate::matmul::View::rows(dout, bt, oc), (oc, c), false, &fill);
}

// ---------------------------------------------------------------------------------------------
// Activation compression (GACT, Liu et al. 2022; Mesa, Pan et al. 2021): a tensor saved for
// backward is kept as `bits`-bit integers in groups of [`ACT_GROUP`] consecutive elements, each
// group with an fp32 scale `absmax / (2^(bits−1) − 1)`, and expanded back before backward.

/// Elements per activation-compression group.
pub const ACT_GROUP: usize = 64;

/// Bytes of `n` elements compressed to `bits` (8 or 4) bits: the codes and one f32 scale per
/// group.
pub fn compressed_bytes(n: usize, bits: u32) -> usize {
    n.div_ceil(if bits == 4 { 2 } else { 1 }) + 4 * n.div_ceil(ACT_GROUP)
}

/// Compresses `x` into `codes` (`n` bytes for 8 bits; two 4-bit codes per byte, low nibble
/// first) and `scales` (one per group): symmetric, `q = round(x / s)` clamped to
/// `±(2^(bits−1) − 1)`. Nearest rounding, or with `stochastic = Some(seed)` unbiased stochastic
/// rounding (`floor(x/s + u)`, `u` uniform from a counter-based hash of `(seed, element)`, so a
/// run is deterministic). A group of zeros gets scale 0.
pub fn compress_groups(codes: &mut [u8], scales: &mut [f32], x: &[f32], bits: u32, stochastic: Option<u64>) {
    let _p = crate::profile::scope("compress_activations");
    assert!(bits == 8 || bits == 4, "activation compression is 8 or 4 bits");
    let per_byte = if bits == 4 { 2 } else { 1 };
    assert_eq!(codes.len(), x.len().div_ceil(per_byte));
    assert_eq!(scales.len(), x.len().div_ceil(ACT_GROUP));
    let qmax = ((1i32 << (bits - 1)) - 1) as f32;
    let group_bytes = ACT_GROUP / per_byte;
    use rayon::prelude::*;
    codes.par_chunks_mut(group_bytes).zip(scales.par_iter_mut()).zip(x.par_chunks(ACT_GROUP)).enumerate().for_each(|(gi, ((c, s), x))| {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        *s = amax / qmax;
        let inv = if amax > 0.0 { qmax / amax } else { 0.0 };
        let q = |j: usize, v: f32| -> i32 {
            let y = v * inv;
            let r = match stochastic {
                None => y.round(),
                Some(seed) => {
                    let h = crate::rng::mix64(seed ^ crate::rng::mix64((gi * ACT_GROUP + j) as u64));
                    (y + (h >> 40) as f32 / (1u64 << 24) as f32).floor()
                }
            };
            r.clamp(-qmax, qmax) as i32
        };
        if bits == 8 {
            for (j, (c, &v)) in c.iter_mut().zip(x).enumerate() {
                *c = q(j, v) as i8 as u8;
            }
        } else {
            for (k, c) in c.iter_mut().enumerate() {
                let lo = x.get(2 * k).map_or(0, |&v| q(2 * k, v)) & 0xF;
                let hi = x.get(2 * k + 1).map_or(0, |&v| q(2 * k + 1, v)) & 0xF;
                *c = (lo | (hi << 4)) as u8;
            }
        }
    });
}

/// Expands [`compress_groups`]'s codes and scales into `out` (`q · s`).
pub fn decompress_groups(out: &mut [f32], codes: &[u8], scales: &[f32], bits: u32) {
    let _p = crate::profile::scope("decompress_activations");
    let per_byte = if bits == 4 { 2 } else { 1 };
    assert_eq!(codes.len(), out.len().div_ceil(per_byte));
    assert_eq!(scales.len(), out.len().div_ceil(ACT_GROUP));
    use rayon::prelude::*;
    out.par_chunks_mut(ACT_GROUP).zip(codes.par_chunks(ACT_GROUP / per_byte)).zip(scales.par_iter()).for_each(|((o, c), &s)| {
        if bits == 8 {
            for (o, &c) in o.iter_mut().zip(c) {
                *o = (c as i8) as f32 * s;
            }
        } else {
            for (j, o) in o.iter_mut().enumerate() {
                let nib = (c[j / 2] >> (4 * (j % 2))) & 0xF;
                // Sign-extend the nibble.
                *o = (((nib << 4) as i8) >> 4) as f32 * s;
            }
        }
    });
}
