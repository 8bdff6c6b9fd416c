//! AdamW on compact state: the moments in bf16 with stochastic rounding, or in 8 bits each,
//! block-wise (Dettmers et al. 2022): each block of [`BLOCK`] elements holds its largest
//! magnitude as an fp32 scale, and each element its value over the scale on a logarithmic
//! grid, the sign kept for the first moment — a float of 3 fraction bits (the second moment's:
//! 4) and an exponent clamped to 15 binades below the scale, so small values keep their
//! relative precision. And the weights themselves in bf16, updated with
//! stochastic rounding, in place of fp32 master weights.
//!
//! Stochastic rounding draws its bits from `(seed, step, element)` by a counter-based hash of
//! the element's position in the whole model's layout, so a run is reproducible and does not
//! depend on how the layout is cut; the 8-bit second moment rounds stochastically too after
//! each update (to nearest, its slowly moving average, a 1% step at β2 = 0.99 against a grid
//! 3% apart, would never move; the first moment, 10% a step at β1 = 0.9, rounds to nearest,
//! which adds less noise). Dequantizing a block and quantizing
//! it again gives the same codes and scale, so state written out in fp32 (a checkpoint) loads
//! back exactly.

use crate::optim::{adamw_scalars, AdamW};
use crate::par::ELEMS;
use crate::rng::mix64;
use rayon::prelude::*;

/// Elements per 8-bit block (one fp32 scale each).
pub const BLOCK: usize = 256;

/// `x` rounded to bf16 bits, up with probability equal to the dropped fraction (`r`'s low 16
/// bits decide): unbiased. Infinities and NaN round to nearest.
#[inline(always)]
pub fn round_stochastic(x: f32, r: u32) -> u16 {
    let b = x.to_bits();
    if b & 0x7F80_0000 == 0x7F80_0000 {
        return crate::bf16::to_bf16(x);
    }
    (b.wrapping_add(r & 0xFFFF) >> 16) as u16
}

/// The key of step `t`'s draws (one hash a step).
fn step_key(seed: u64, t: u64) -> u64 {
    seed ^ mix64(t.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// 48 random bits for element `pos` under a step's `key` (three 16-bit draws): one hash.
#[inline(always)]
fn draws(key: u64, pos: u64) -> u64 {
    mix64(key ^ pos)
}

/// One of the two 8-bit grids: `binades` binades below 1 at `bits` fraction bits each, and 1.
#[derive(Clone, Copy)]
struct Grid {
    binades: u32,
    bits: u32,
    signed: bool,
}

/// The first moment: a sign, then 15 binades of 3 fraction bits (about 6% apart).
const M_GRID: Grid = Grid { binades: 15, bits: 3, signed: true };
/// The second moment: 15 binades of 4 fraction bits (about 3% apart, so its square root 1.5%).
const V_GRID: Grid = Grid { binades: 15, bits: 4, signed: false };

impl Grid {
    /// The code of `y` in `[-1, 1]` (`[0, 1]` unsigned): without `draw`, the nearest grid
    /// value (ties to even); with it, one of the two around it, the upper with probability
    /// equal to the distance from the lower (unbiased, so a slowly moving average is not held
    /// in place by rounding); a grid value stays itself either way. A magnitude below the
    /// grid's smallest goes to 0 or that smallest, likewise (unsigned: never to 0 unless `y`
    /// is, so a second moment never divides by nothing).
    #[inline(always)]
    fn encode(self, y: f32, draw: Option<u32>) -> u8 {
        let a = y.abs();
        if a == 0.0 {
            return 0;
        }
        let lowest = -(self.binades as i32);
        let smallest = f32::from_bits(((127 + lowest) as u32) << 23);
        if a < smallest {
            let up = match draw {
                Some(r) => (r & 0xFFFF) as f32 * (1.0 / 65536.0) * smallest < a,
                None => a >= smallest * 0.5,
            };
            let mag = u8::from(up || !self.signed);
            return mag | if self.signed && y < 0.0 && mag != 0 { 0x80 } else { 0 };
        }
        let (b, drop) = (a.to_bits(), 23 - self.bits);
        let add = match draw {
            Some(r) => ((r & 0xFFFF) << 16) >> (32 - drop),
            None => (1 << (drop - 1)) - 1 + ((b >> drop) & 1),
        };
        let r = b.wrapping_add(add) & !((1 << drop) - 1);
        let e = (r >> 23) as i32 - 127; // ≤ 0
        let mag = if e < lowest {
            1
        } else {
            1 + (((e - lowest) as u32) << self.bits) + ((r >> drop) & ((1 << self.bits) - 1))
        };
        (mag as u8) | if self.signed && y < 0.0 && mag != 0 { 0x80 } else { 0 }
    }

    /// The grid value of `code`.
    #[inline(always)]
    fn decode(self, code: u8) -> f32 {
        let (neg, mag) = if self.signed { (code & 0x80 != 0, (code & 0x7F) as u32) } else { (false, code as u32) };
        if mag == 0 {
            return 0.0;
        }
        let k = mag - 1;
        let e = (k >> self.bits) as i32 - self.binades as i32;
        let y = f32::from_bits((((127 + e) as u32) << 23) | ((k & ((1 << self.bits) - 1)) << (23 - self.bits)));
        if neg {
            -y
        } else {
            y
        }
    }
}

/// Quantizes one block `x` into `codes` and returns its scale (the largest magnitude); with
/// `draws`, each element rounds stochastically with its draw.
fn quantize_block(g: Grid, x: &[f32], codes: &mut [u8], draws: Option<&[u32]>) -> f32 {
    let s = x.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
    if s == 0.0 || !s.is_finite() {
        codes.iter_mut().zip(x).for_each(|(c, &v)| *c = if s == 0.0 { 0 } else { g.encode(v.signum(), None) });
        return s;
    }
    match draws {
        Some(d) => codes.iter_mut().zip(x).zip(d).for_each(|((c, &v), &r)| *c = g.encode(v / s, Some(r))),
        None => codes.iter_mut().zip(x).for_each(|(c, &v)| *c = g.encode(v / s, None)),
    }
    s
}

fn dequantize_block(g: Grid, codes: &[u8], s: f32, x: &mut [f32]) {
    x.iter_mut().zip(codes).for_each(|(x, &c)| *x = g.decode(c) * s);
}

/// Which moment a buffer holds (its grid).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moment {
    First,
    Second,
}

impl Moment {
    fn grid(self) -> Grid {
        match self {
            Moment::First => M_GRID,
            Moment::Second => V_GRID,
        }
    }
}

/// Quantizes `x` into 8-bit `codes` and per-block `scales` (blocks from `x`'s start).
pub fn quantize(which: Moment, x: &[f32], codes: &mut [u8], scales: &mut [f32]) {
    let g = which.grid();
    assert!(codes.len() == x.len() && scales.len() == x.len().div_ceil(BLOCK), "quantize: shapes");
    x.par_chunks(BLOCK).zip(codes.par_chunks_mut(BLOCK)).zip(scales.par_iter_mut()).for_each(|((x, c), s)| *s = quantize_block(g, x, c, None));
}

/// The fp32 values of 8-bit `codes` with their block `scales`.
pub fn dequantize(which: Moment, codes: &[u8], scales: &[f32], x: &mut [f32]) {
    let g = which.grid();
    assert!(codes.len() == x.len() && scales.len() == x.len().div_ceil(BLOCK), "dequantize: shapes");
    x.par_chunks_mut(BLOCK).zip(codes.par_chunks(BLOCK)).zip(scales.par_iter()).for_each(|((x, c), &s)| dequantize_block(g, c, s, x));
}

/// AdamW's moments in a compact form, for one run of elements.
pub enum LeanMoments<'a> {
    /// bf16 bits, stochastically rounded after each update.
    Bf16 { m: &'a mut [u16], v: &'a mut [u16] },
    /// 8-bit codes with per-block scales (blocks from the run's start).
    Int8 { m: (&'a mut [u8], &'a mut [f32]), v: (&'a mut [u8], &'a mut [f32]) },
}

/// Where the run's random draws come from: the run's seed and the layout position of its first
/// element; with `round_params`, the weights are bf16 (their own master copy) and round
/// stochastically too.
#[derive(Clone, Copy, Debug)]
pub struct Draws {
    pub seed: u64,
    pub at: u64,
    pub round_params: bool,
}

/// One AdamW step (as [`crate::adamw_update`]: decoupled decay, bias corrections, computed in
/// fp32) on compact moments: each element's moments are read out of their form, updated, and
/// stored back, rounded stochastically (bf16) or quantized block by block (8 bits).
pub fn adamw_update_lean(params: &mut [f32], grads: &[f32], st: LeanMoments, h: &AdamW, d: Draws) {
    let _p = crate::profile::scope("adamw_update_lean");
    let [step, rbc2, decay] = adamw_scalars(h, h.t);
    let key = step_key(d.seed, h.t);
    let one = move |p: &mut f32, g: f32, m: &mut f32, v: &mut f32| {
        *m = h.beta1 * *m + (1.0 - h.beta1) * g;
        *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
        *p = *p * decay - step * *m / (v.sqrt() * rbc2 + h.eps);
    };
    let round_p = move |p: &mut f32, r: u64| {
        if d.round_params {
            *p = crate::bf16::from_bf16(round_stochastic(*p, (r >> 32) as u32));
        }
    };
    match st {
        LeanMoments::Bf16 { m, v } => {
            let n = params.len();
            assert!(grads.len() == n && m.len() == n && v.len() == n, "adamw_update_lean: shapes");
            params.par_chunks_mut(ELEMS).zip(grads.par_chunks(ELEMS)).zip(m.par_chunks_mut(ELEMS).zip(v.par_chunks_mut(ELEMS))).enumerate().for_each(|(c, ((p, g), (m, v)))| {
                for i in 0..p.len() {
                    let (mut mi, mut vi) = (crate::bf16::from_bf16(m[i]), crate::bf16::from_bf16(v[i]));
                    one(&mut p[i], g[i], &mut mi, &mut vi);
                    let r = draws(key, d.at + (c * ELEMS + i) as u64);
                    m[i] = round_stochastic(mi, r as u32);
                    v[i] = round_stochastic(vi, (r >> 16) as u32);
                    round_p(&mut p[i], r);
                }
            });
        }
        LeanMoments::Int8 { m: (mc, ms), v: (vc, vs) } => {
            let n = params.len();
            assert!(grads.len() == n && mc.len() == n && vc.len() == n && ms.len() == n.div_ceil(BLOCK) && vs.len() == ms.len(), "adamw_update_lean: shapes");
            let blocks = params.par_chunks_mut(BLOCK).zip(grads.par_chunks(BLOCK)).zip(mc.par_chunks_mut(BLOCK).zip(vc.par_chunks_mut(BLOCK))).zip(ms.par_iter_mut().zip(vs.par_iter_mut()));
            blocks.enumerate().for_each(|(b, (((p, g), (mc, vc)), (ms, vs)))| {
                let (mut mf, mut vf) = ([0.0f32; BLOCK], [0.0f32; BLOCK]);
                let mut rv = [0u32; BLOCK];
                let k = p.len();
                dequantize_block(M_GRID, mc, *ms, &mut mf[..k]);
                dequantize_block(V_GRID, vc, *vs, &mut vf[..k]);
                for i in 0..k {
                    one(&mut p[i], g[i], &mut mf[i], &mut vf[i]);
                    let r = draws(key, d.at + (b * BLOCK + i) as u64);
                    rv[i] = (r >> 16) as u32;
                    round_p(&mut p[i], r);
                }
                *ms = quantize_block(M_GRID, &mf[..k], mc, None);
                *vs = quantize_block(V_GRID, &vf[..k], vc, Some(&rv[..k]));
            });
        }
    }
}
