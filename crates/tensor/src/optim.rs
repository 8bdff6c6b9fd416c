//! The optimizer update and the reductions used for gradient clipping.

use crate::par::ELEMS;
use rayon::prelude::*;

/// AdamW hyper-parameters for one update (Loshchilov & Hutter; PyTorch's `torch.optim.AdamW`).
#[derive(Clone, Copy, Debug)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based step count, for bias correction.
    pub t: u64,
}

/// One AdamW step over a slice of parameters with their gradients and moments:
/// `p -= lr·wd·p` (decoupled decay), `m = β1·m + (1-β1)·g`, `v = β2·v + (1-β2)·g²`,
/// `p -= lr · m̂ / (√v̂ + ε)`.
pub fn adamw_update(params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamW) {
    let _p = crate::profile::scope("adamw_update");
    adam_pieces(params, None, grads, (m, v), h, h.t, true);
}

/// [`adamw_update`] on bf16-split master weights ([`crate::precision::split_bf16`]): `work`,
/// the working weights the passes read, and `low`, the master weights' low halves. Each chunk
/// is joined into fp32, updated exactly as [`adamw_update`] updates fp32 weights, and split
/// again, so the master weights follow the fp32 update bit for bit.
pub fn adamw_update_split(work: &mut [f32], low: &mut [u16], grads: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamW) {
    let _p = crate::profile::scope("adamw_update");
    adam_pieces(work, Some(low), grads, (m, v), h, h.t, true);
}

/// `f` on the fp32 master weights of one chunk of split ones (at most [`ELEMS`]), joined into
/// `buf` (a task's, reused across its chunks) and split back after.
fn on_joined(buf: &mut Vec<f32>, work: &mut [f32], low: &mut [u16], f: impl FnOnce(&mut [f32])) {
    buf.resize(ELEMS, 0.0);
    let x = &mut buf[..work.len()];
    crate::precision::join_bf16_chunk(x, work, low);
    f(x);
    crate::precision::split_bf16_chunk(work, low, x);
}

/// An AdamW step's scalars, `[lr/(1 − β1^t), 1/√(1 − β2^var_updates), 1 − lr·wd]`, computed in
/// f64 and rounded once: what every element's update multiplies by (a device's update reads
/// the same three numbers).
pub fn adamw_scalars(h: &AdamW, var_updates: u64) -> [f32; 3] {
    let bc1 = 1.0 - (h.beta1 as f64).powi(h.t as i32);
    let bc2 = 1.0 - (h.beta2 as f64).powi(var_updates as i32);
    [(h.lr as f64 / bc1) as f32, (1.0 / bc2.sqrt()) as f32, 1.0 - h.lr * h.weight_decay]
}

/// The step's scalars of [`adam_chunk`]: `lr/(1 − β1^t)`, `1/√(1 − β2^var_updates)`,
/// `1 − lr·wd`, and whether the variance takes this step's gradient.
#[derive(Clone, Copy)]
struct Coefs {
    step: f32,
    rbc2: f32,
    decay: f32,
    update_v: bool,
}

/// [`adamw_update`] and [`zeroone_update`]: the variance's bias correction counts
/// `var_updates` updates, and with `update_v` false the variance stays as it was.
/// With `low`, `params` are split master weights ([`adamw_update_split`]).
fn adam_pieces(params: &mut [f32], low: Option<&mut [u16]>, grads: &[f32], (m, v): (&mut [f32], &mut [f32]), h: &AdamW, var_updates: u64, update_v: bool) {
    let [step, rbc2, decay] = adamw_scalars(h, var_updates);
    let c = Coefs { step, rbc2, decay, update_v };
    let gmv = grads.par_chunks(ELEMS).zip(m.par_chunks_mut(ELEMS).zip(v.par_chunks_mut(ELEMS)));
    match low {
        None => params.par_chunks_mut(ELEMS).zip(gmv).for_each(|(p, (g, (m, v)))| adam_chunk(p, g, m, v, h, c)),
        Some(low) => {
            assert_eq!(low.len(), params.len());
            params.par_chunks_mut(ELEMS).zip(low.par_chunks_mut(ELEMS)).zip(gmv).for_each_init(Vec::new, |buf, ((p, lo), (g, (m, v)))| on_joined(buf, p, lo, |x| adam_chunk(x, g, m, v, h, c)))
        }
    }
}

crate::multiversion! {
    /// One chunk of [`adam_pieces`] (vectorised square roots and divisions: the small models'
    /// optimizer step is compute-bound).
    fn adam_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamW, c: Coefs) {
        let n = p.len().min(g.len()).min(m.len()).min(v.len());
        for i in 0..n {
            let gi = g[i];
            m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * gi;
            if c.update_v {
                v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * gi * gi;
            }
            let denom = v[i].sqrt() * c.rbc2 + h.eps;
            p[i] = p[i] * c.decay - c.step * m[i] / denom;
        }
    }
}

/// 1-bit Adam's update in its compression stage (Tang et al. 2021): the momentum `m` is given
/// (the ranks' compressed average) and the variance `v` frozen, with its bias correction
/// `rbc2 = 1/√(1 − β2^t_freeze)`: `p = p·(1 − lr·wd) − lr/(1 − β1^t) · m / (√v·rbc2 + ε)`.
/// With `low`, `params` are split master weights (as in [`adamw_update_split`]).
pub fn adam_frozen_update(params: &mut [f32], low: Option<&mut [u16]>, m: &[f32], v: &[f32], h: &AdamW, rbc2: f32) {
    let _p = crate::profile::scope("adam_frozen_update");
    let step = (h.lr as f64 / (1.0 - (h.beta1 as f64).powi(h.t as i32))) as f32;
    let decay = 1.0 - h.lr * h.weight_decay;
    let chunk = |p: &mut [f32], m: &[f32], v: &[f32]| {
        for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
            *p = *p * decay - step * m / (v.sqrt() * rbc2 + h.eps);
        }
    };
    let mv = m.par_chunks(ELEMS).zip(v.par_chunks(ELEMS));
    match low {
        None => params.par_chunks_mut(ELEMS).zip(mv).for_each(|(p, (m, v))| chunk(p, m, v)),
        Some(low) => {
            assert_eq!(low.len(), params.len());
            params.par_chunks_mut(ELEMS).zip(low.par_chunks_mut(ELEMS)).zip(mv).for_each_init(Vec::new, |buf, ((p, lo), (m, v))| on_joined(buf, p, lo, |x| chunk(x, m, v)))
        }
    }
}

/// 0/1 Adam's update on the ranks' averaged gradient `g` (Lu et al. 2023): `m = β1·m + (1−β1)·g`;
/// with `update_v`, `v = β2·v + (1−β2)·g²` (else `v` as it was); `p = p·(1 − lr·wd) −
/// lr/(1 − β1^t) · m / (√v·rbc2 + ε)`, where `rbc2 = 1/√(1 − β2^var_updates)` counts the
/// variance's own updates. With `update_v` at every step it is [`adamw_update`].
pub fn zeroone_update(params: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamW, var_updates: u64, update_v: bool) {
    let _p = crate::profile::scope("zeroone_update");
    adam_pieces(params, None, g, (m, v), h, var_updates, update_v);
}

/// 0/1 Adam's local step on this rank's own gradient `g`, the variance `v` frozen: `m = β1·m +
/// (1−β1)·g`; the moves decay and grow, `acc = acc·(1 − lr·wd) + lr/(1 − β1^t) · m / (√v·rbc2 +
/// ε)`, and `p = anchor·decay − acc`, where `decay` is the product of the factors `1 − lr·wd`
/// since the anchor was taken, this step's included. That is AdamW's step `p·(1 − lr·wd) − …`
/// exactly, with the decay kept out of the moves (so out of the momentum a sync rebuilds from
/// them); a checkpoint of `anchor`, `acc` and `decay` restores the parameters bit for bit.
pub fn zeroone_local(params: &mut [f32], g: &[f32], (m, v): (&mut [f32], &[f32]), (acc, anchor): (&mut [f32], &[f32]), h: &AdamW, var_updates: u64, decay: f32) {
    let _p = crate::profile::scope("zeroone_local");
    let step = (h.lr as f64 / (1.0 - (h.beta1 as f64).powi(h.t as i32))) as f32;
    let rbc2 = (1.0 / (1.0 - (h.beta2 as f64).powi(var_updates as i32)).sqrt()) as f32;
    let keep = 1.0 - h.lr * h.weight_decay;
    params.par_chunks_mut(ELEMS).zip(g.par_chunks(ELEMS).zip(m.par_chunks_mut(ELEMS))).zip(v.par_chunks(ELEMS).zip(acc.par_chunks_mut(ELEMS).zip(anchor.par_chunks(ELEMS)))).for_each(|((p, (g, m)), (v, (acc, anchor)))| {
        for i in 0..p.len() {
            m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * g[i];
            acc[i] = acc[i] * keep + step * m[i] / (v[i].sqrt() * rbc2 + h.eps);
            p[i] = anchor[i] * decay - acc[i];
        }
    });
}

/// `Σ x²` in f64, over fixed chunks combined in order (deterministic).
pub fn sum_squares(x: &[f32]) -> f64 {
    // Partials per fixed chunk, in a buffer kept per calling thread (a top-level kernel, never a
    // rayon task), so after the first step nothing is allocated here.
    thread_local! {
        static PARTS: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    PARTS.with(|cell| {
        let mut parts = cell.borrow_mut();
        parts.clear();
        parts.resize(x.len().div_ceil(ELEMS), 0.0);
        parts.par_iter_mut().zip(x.par_chunks(ELEMS)).for_each(|(p, c)| sum_squares_chunk(c, p));
        parts.iter().sum()
    })
}

crate::multiversion! {
    /// `Σ x²` of one chunk in f64: eight running sums (a fixed order, so deterministic) that
    /// vectorise, combined pairwise.
    fn sum_squares_chunk(c: &[f32], out: &mut f64) {
        let mut acc = [0.0f64; 8];
        let mut it = c.chunks_exact(8);
        for ch in &mut it {
            for (a, &x) in acc.iter_mut().zip(ch) {
                *a += (x as f64) * (x as f64);
            }
        }
        let tail: f64 = it.remainder().iter().map(|&a| (a as f64) * (a as f64)).sum();
        *out = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
    }
}

pub fn scale_in_place(x: &mut [f32], s: f32) {
    x.par_chunks_mut(ELEMS).for_each(|c| c.iter_mut().for_each(|a| *a *= s));
}
