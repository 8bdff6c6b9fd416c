//! Low-precision number formats, simulated on `f32` buffers: each value is rounded to the
//! nearest value the format can hold (round to nearest, ties to even), the way a device stores
//! it. Used by mixed-precision training (bf16, fp16) and FP8 matmul inputs (E4M3 forward, E5M2
//! gradients; Micikevicius et al. 2022, "FP8 Formats for Deep Learning"). On this CPU the
//! arithmetic stays `f32` (matmuls accumulate in `f32`, as tensor cores do); what is simulated
//! is every rounding a device would apply when it stores a tensor in the format.

use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// bfloat16: 8 exponent bits, 7 mantissa bits; f32's range.
    Bf16,
    /// IEEE half: 5 exponent bits, 10 mantissa bits; largest 65504, beyond which values
    /// overflow to infinity (what fp16 loss scaling watches for).
    Fp16,
    /// FP8 E4M3 (OCP "fn"): 3 mantissa bits, largest 448; saturating.
    E4m3,
    /// FP8 E5M2: 2 mantissa bits, largest 57344; saturating.
    E5m2,
}

impl Format {
    /// (mantissa bits, smallest normal exponent, largest finite value, overflow to infinity)
    fn spec(self) -> (i32, i32, f32, bool) {
        match self {
            Format::Bf16 => (7, -126, f32::from_bits(0x7F7F_0000), true),
            Format::Fp16 => (10, -14, 65504.0, true),
            Format::E4m3 => (3, -6, 448.0, false),
            Format::E5m2 => (2, -14, 57344.0, false),
        }
    }

    /// The largest finite value.
    pub fn max(self) -> f32 {
        self.spec().2
    }
}

/// 2^k as an `f32` (k ≥ −149), exactly.
fn pow2(k: i32) -> f32 {
    if k >= -126 {
        f32::from_bits(((k + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (k + 149))
    }
}

/// `y` rounded to an integer, to nearest even (|y| < 2^22): 1.5·2^23 has ulp 1, so the sum
/// rounds in hardware (no libm `roundeven` call on baseline x86-64).
#[inline]
fn rne_int(y: f32) -> f32 {
    const C: f32 = 12_582_912.0;
    (y + C) - C
}

/// `x` rounded to `fmt` (NaN and infinities pass through; overflow saturates to the largest
/// value for the FP8 formats and becomes infinity for bf16 and fp16).
#[inline]
pub fn round(x: f32, fmt: Format) -> f32 {
    if fmt == Format::Bf16 {
        // The bf16 products' own conversion: nearest even, a NaN quieted (not `x` itself: see
        // `nonfinite`).
        return f32::from_bits(crate::bf16::rounded_bits(x));
    }
    if fmt == Format::Fp16 {
        // Branch-free (selects only), so slices of it vectorise.
        let b = x.to_bits();
        let e = (b >> 23) & 0xFF;
        // The normal range: nearest even on f32's upper 19 bits (10 mantissa bits kept).
        let n = f32::from_bits(b.wrapping_add(0xFFF + ((b >> 13) & 1)) & !0x1FFF);
        let n = if n.abs() > 65504.0 { f32::INFINITY.copysign(x) } else { n };
        // Subnormal fp16: multiples of 2^-24, which is the ulp of f32 values in [0.5, 1):
        // adding and subtracting 0.75 rounds to them, to nearest even, in hardware (the sign
        // put back keeps −0 and values that round to zero negative).
        let s = ((x + 0.75) - 0.75).copysign(x);
        let r = if e >= 127 - 14 { n } else { s };
        // NaN and infinities pass through.
        return if e == 0xFF { nonfinite(x) } else { r };
    }
    // Zeros come through the arithmetic below with their sign; NaN and infinities pass.
    let (m, emin, max, inf) = fmt.spec();
    let a = x.abs();
    let e = (((a.to_bits() >> 23) as i32) - 127).max(emin);
    // a / q and the product back are exact: q is a power of two and a / q < 2^(m+1).
    let q = pow2(e - m);
    let r = rne_int(a * pow2(m - e)) * q;
    let r = if r > max { if inf { f32::INFINITY } else { max } } else { r };
    if x.is_finite() { r.copysign(x) } else { nonfinite(x) }
}

/// A NaN or infinity `x` passed through (a NaN quieted) as a value the compiler cannot prove to
/// be `x`: a lane that keeps `x` itself makes rounding a slice in place a masked store
/// (`vmaskmovps`), slow on AMD (the bf16 loop took 3.5x as long on Zen 3).
#[inline(always)]
fn nonfinite(x: f32) -> f32 {
    let b = x.to_bits();
    f32::from_bits(b | ((((b & 0x007F_FFFF) != 0) as u32) << 22))
}

/// `$body` with `$f` bound to `fmt` as a constant, one copy per format (each vectorises).
macro_rules! per_format {
    ($fmt:expr, $f:ident => $body:expr) => {
        match $fmt {
            Format::Bf16 => {
                const $f: Format = Format::Bf16;
                $body
            }
            Format::Fp16 => {
                const $f: Format = Format::Fp16;
                $body
            }
            Format::E4m3 => {
                const $f: Format = Format::E4m3;
                $body
            }
            Format::E5m2 => {
                const $f: Format = Format::E5m2;
                $body
            }
        }
    };
}

crate::multiversion! {
    fn round_chunk(c: &mut [f32], fmt: Format) {
        per_format!(fmt, F => c.iter_mut().for_each(|v| *v = round(*v, F)))
    }
}

/// A running amax in eight lanes (selects and ors only, so loops over it vectorise): the
/// largest magnitude seen and whether any value was NaN.
#[derive(Clone, Copy)]
struct Amax {
    m: [f32; 8],
    nan: [bool; 8],
}

impl Amax {
    const ZERO: Amax = Amax { m: [0.0; 8], nan: [false; 8] };

    #[inline(always)]
    fn add(&mut self, l: usize, v: f32) {
        let a = v.abs();
        self.m[l] = if a > self.m[l] { a } else { self.m[l] };
        self.nan[l] |= v.is_nan();
    }

    fn lanes(&self) -> (f32, bool) {
        (self.m.iter().copied().fold(0.0, f32::max), self.nan.iter().any(|&n| n))
    }
}

/// Chunks' `(amax, any NaN)` combined: NaN if any chunk saw one.
fn combine(parts: impl ParallelIterator<Item = (f32, bool)>) -> f32 {
    let (m, nan) = parts.reduce(|| (0.0, false), |a, b| (a.0.max(b.0), a.1 | b.1));
    if nan { f32::NAN } else { m }
}

crate::multiversion! {
    /// `o = round(x · inv, fmt) · scale`, and (into `out`) the amax of `x` as [`amax_chunk`].
    fn quantize_chunk(o: &mut [f32], x: &[f32], fmt: Format, inv: f32, scale: f32, out: &mut (f32, bool)) {
        *out = per_format!(fmt, F => {
            let mut a = Amax::ZERO;
            let mut oi = o.chunks_exact_mut(8);
            let mut xi = x.chunks_exact(8);
            for (oc, xc) in (&mut oi).zip(&mut xi) {
                for l in 0..8 {
                    oc[l] = round(xc[l] * inv, F) * scale;
                    a.add(l, xc[l]);
                }
            }
            for (o, &v) in oi.into_remainder().iter_mut().zip(xi.remainder()) {
                *o = round(v * inv, F) * scale;
                a.add(0, v);
            }
            a.lanes()
        });
    }
}

crate::multiversion! {
    fn round_into_chunk(o: &mut [f32], x: &[f32], fmt: Format) {
        per_format!(fmt, F => o.iter_mut().zip(x).for_each(|(o, &v)| *o = round(v, F)))
    }
}

/// `out[i] = round(x[i], fmt)` (mixed precision's working weights from the master weights).
pub fn round_into(out: &mut [f32], x: &[f32], fmt: Format) {
    let _p = crate::profile::scope("round_precision");
    assert_eq!(out.len(), x.len());
    out.par_chunks_mut(1 << 14).zip(x.par_chunks(1 << 14)).for_each(|(o, x)| round_into_chunk(o, x, fmt));
}

/// Mixed precision's working weights from fp32 master weights `x`: [`round`], except that bf16
/// rounds ties away from zero ([`split_bf16`]'s working half), so a run gives the same weights
/// whether its master weights are whole fp32 or split.
pub fn master_round_into(out: &mut [f32], x: &[f32], fmt: Format) {
    if fmt != Format::Bf16 {
        return round_into(out, x, fmt);
    }
    let _p = crate::profile::scope("round_precision");
    assert_eq!(out.len(), x.len());
    out.par_chunks_mut(1 << 14).zip(x.par_chunks(1 << 14)).for_each(|(o, x)| split_work_chunk(o, x));
}

/// An fp32 master weight `x` as its bf16 working weight `w` (a bf16 value, held in the fp32
/// parameters the passes read) and `x`'s low 16 bits: 2 bytes of master state beside the
/// working weight instead of 4, and [`join_bf16`] gives `x` back bit for bit. `w` is `x`
/// rounded to nearest with ties away from zero: `x`'s upper half is `w`'s when the low half is
/// below 0x8000 and one less (in magnitude) when it is not. With ties to even the tie 0x8000
/// would come from two upper halves. NaN stays a NaN (its payload is not kept).
#[inline(always)]
pub fn split_bf16(x: f32) -> (f32, u16) {
    let b = x.to_bits();
    let lo = b as u16;
    let up = (b >> 16).wrapping_add((lo >> 15) as u32);
    let hi = if x.is_nan() { (b >> 16) | 0x40 } else { up };
    (f32::from_bits(hi << 16), lo)
}

/// The inverse of [`split_bf16`]: the fp32 master weight of working weight `w` and low half `lo`.
#[inline(always)]
pub fn join_bf16(w: f32, lo: u16) -> f32 {
    let hi = (w.to_bits() >> 16).wrapping_sub((lo >> 15) as u32);
    f32::from_bits((hi << 16) | lo as u32)
}

crate::multiversion! {
    fn split_work_chunk(w: &mut [f32], x: &[f32]) {
        w.iter_mut().zip(x).for_each(|(w, &x)| *w = split_bf16(x).0)
    }
}

crate::multiversion! {
    /// `(w[i], lo[i]) = split_bf16(x[i])` over one chunk.
    pub fn split_bf16_chunk(w: &mut [f32], lo: &mut [u16], x: &[f32]) {
        w.iter_mut().zip(lo.iter_mut()).zip(x).for_each(|((w, lo), &x)| (*w, *lo) = split_bf16(x))
    }
}

crate::multiversion! {
    /// `x[i] = join_bf16(w[i], lo[i])` over one chunk.
    pub fn join_bf16_chunk(x: &mut [f32], w: &[f32], lo: &[u16]) {
        x.iter_mut().zip(w).zip(lo).for_each(|((x, &w), &lo)| *x = join_bf16(w, lo))
    }
}

crate::multiversion! {
    fn split_in_place_chunk(w: &mut [f32], lo: &mut [u16]) {
        w.iter_mut().zip(lo.iter_mut()).for_each(|(w, lo)| (*w, *lo) = split_bf16(*w))
    }
}

/// [`split_bf16`] in place: `w` holds the fp32 master weights on entry and their working
/// weights on return, `lo` their low halves.
pub fn split_bf16_in_place(w: &mut [f32], lo: &mut [u16]) {
    assert_eq!(w.len(), lo.len());
    w.par_chunks_mut(1 << 14).zip(lo.par_chunks_mut(1 << 14)).for_each(|(w, lo)| split_in_place_chunk(w, lo));
}

/// The fp32 master weights of split pairs: `x` from `(w, lo)`.
pub fn join_bf16_into(x: &mut [f32], w: &[f32], lo: &[u16]) {
    assert!(w.len() == x.len() && lo.len() == x.len());
    x.par_chunks_mut(1 << 14).zip(w.par_chunks(1 << 14)).zip(lo.par_chunks(1 << 14)).for_each(|((x, w), lo)| join_bf16_chunk(x, w, lo));
}

/// Rounds every element of `x` to `fmt`, in place.
pub fn round_slice(x: &mut [f32], fmt: Format) {
    let _p = crate::profile::scope("round_precision");
    x.par_chunks_mut(1 << 14).for_each(|c| round_chunk(c, fmt));
}

/// `out = round(x / scale, fmt) · scale`: `x` cast to an FP8 format with a per-tensor scale
/// (the scale maps the tensor's range onto the format's), and back. Returns [`amax`] of `x`,
/// found in the same pass.
pub fn quantize_into(out: &mut [f32], x: &[f32], fmt: Format, scale: f32) -> f32 {
    let _p = crate::profile::scope("quantize_fp8");
    let inv = 1.0 / scale;
    combine(out.par_chunks_mut(1 << 14).zip(x.par_chunks(1 << 14)).map(|(o, x)| {
        let mut r = (0.0, false);
        quantize_chunk(o, x, fmt, inv, scale, &mut r);
        r
    }))
}

crate::multiversion! {
    /// The largest magnitude in `c` and whether any element is NaN.
    fn amax_chunk(c: &[f32], out: &mut (f32, bool)) {
        let mut a = Amax::ZERO;
        let mut it = c.chunks_exact(8);
        for ch in &mut it {
            #[allow(clippy::needless_range_loop)] // lanes 0..8 by constant index, kept as written for the vectoriser
            for l in 0..8 {
                a.add(l, ch[l]);
            }
        }
        for &v in it.remainder() {
            a.add(0, v);
        }
        *out = a.lanes();
    }
}

/// The largest magnitude in `x` (0 for an empty slice; NaN if any element is NaN).
pub fn amax(x: &[f32]) -> f32 {
    let _p = crate::profile::scope("amax");
    combine(x.par_chunks(1 << 14).map(|c| {
        let mut r = (0.0, false);
        amax_chunk(c, &mut r);
        r
    }))
}

/// f32 → fp16 bits for a value `fmt`-exact in fp16 (what [`round`] to [`Format::Fp16`] gives):
/// normal and subnormal values, ±0, ±∞ and NaN, all without rounding.
#[inline(always)]
fn fp16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let e = ((b >> 23) & 0xFF) as i32;
    let a = f32::from_bits(b & 0x7FFF_FFFF);
    // Normal: rebias the exponent, keep the top 10 mantissa bits. Subnormal (|x| < 2^-14):
    // an integer count of 2^-24.
    let normal = ((((e - 127 + 15) as u32) << 10) | ((b >> 13) & 0x3FF)) as u16;
    // a·2^24 is an integer below 1024 here; added to 2^23 it sits in the low mantissa bits
    // (no float-to-int `as`, which saturates lane by lane and kept the loop scalar).
    let sub = ((a * 16_777_216.0 + 8_388_608.0).to_bits().wrapping_sub(0x4B00_0000) & 0x3FF) as u16;
    let special = if a.is_nan() { 0x7E00 } else { 0x7C00 };
    sign | if e == 0xFF { special } else if e >= 127 - 14 { normal } else { sub }
}

/// fp16 bits → f32 (exact).
#[inline(always)]
fn fp16_value(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let e = ((h >> 10) & 0x1F) as u32;
    let m = (h & 0x3FF) as u32;
    let normal = f32::from_bits(sign | ((e + 127 - 15) << 23) | (m << 13));
    let sub = f32::from_bits(sign | ((m as i32) as f32 * (1.0 / 16_777_216.0)).to_bits());
    let special = f32::from_bits(sign | 0x7F80_0000 | (m << 13));
    if e == 0x1F { special } else if e == 0 { sub } else { normal }
}

/// The 16 bits of `x`, a value exact in `fmt` (bf16 or fp16: what [`round`] gives), without
/// rounding.
#[inline(always)]
pub fn to_bits16(x: f32, fmt: Format) -> u16 {
    match fmt {
        Format::Fp16 => fp16_bits(x),
        _ => (x.to_bits() >> 16) as u16,
    }
}

/// The value of 16 bits in `fmt` (bf16 or fp16), exactly.
#[inline(always)]
pub fn from_bits16(h: u16, fmt: Format) -> f32 {
    match fmt {
        Format::Fp16 => fp16_value(h),
        _ => f32::from_bits((h as u32) << 16),
    }
}

crate::multiversion! {
    fn pack16_chunk(o: &mut [u16], x: &[f32], fp16: bool) {
        if fp16 {
            o.iter_mut().zip(x).for_each(|(o, &x)| *o = to_bits16(x, Format::Fp16));
        } else {
            o.iter_mut().zip(x).for_each(|(o, &x)| *o = to_bits16(x, Format::Bf16));
        }
    }
}

crate::multiversion! {
    fn unpack16_chunk(o: &mut [f32], h: &[u16], fp16: bool) {
        if fp16 {
            o.iter_mut().zip(h).for_each(|(o, &h)| *o = from_bits16(h, Format::Fp16));
        } else {
            o.iter_mut().zip(h).for_each(|(o, &h)| *o = from_bits16(h, Format::Bf16));
        }
    }
}

/// Stores `x` (every element exact in `fmt`, bf16 or fp16) as 16 bits: `out[i] = bits(x[i])`.
/// Lossless: [`unpack16`] gives `x` back bit for bit.
pub fn pack16(out: &mut [u16], x: &[f32], fmt: Format) {
    let _p = crate::profile::scope("pack16");
    assert_eq!(out.len(), x.len());
    let fp16 = fmt == Format::Fp16;
    out.par_chunks_mut(1 << 14).zip(x.par_chunks(1 << 14)).for_each(|(o, x)| pack16_chunk(o, x, fp16));
}

/// The inverse of [`pack16`].
pub fn unpack16(out: &mut [f32], h: &[u16], fmt: Format) {
    let _p = crate::profile::scope("unpack16");
    assert_eq!(out.len(), h.len());
    let fp16 = fmt == Format::Fp16;
    out.par_chunks_mut(1 << 14).zip(h.par_chunks(1 << 14)).for_each(|(o, h)| unpack16_chunk(o, h, fp16));
}
