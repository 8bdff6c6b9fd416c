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

/// Lion hyper-parameters (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms";
/// `lion-pytorch`'s `Lion`).
#[derive(Clone, Copy, Debug)]
pub struct Lion {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub weight_decay: f32,
}

/// One Lion step: `p = p·(1 − lr·wd)`, `p −= lr · sign(β1·m + (1−β1)·g)` (the sign of 0 is 0),
/// `m = β2·m + (1−β2)·g`. One moment, and every element moves by exactly `lr` (or not at all).
pub fn lion_update(params: &mut [f32], grads: &[f32], m: &mut [f32], h: &Lion) {
    let _p = crate::profile::scope("lion_update");
    let decay = 1.0 - h.lr * h.weight_decay;
    params.par_chunks_mut(ELEMS).zip(grads.par_chunks(ELEMS).zip(m.par_chunks_mut(ELEMS))).for_each(|(p, (g, m))| {
        for ((p, &g), m) in p.iter_mut().zip(g).zip(m.iter_mut()) {
            let u = *m * h.beta1 + g * (1.0 - h.beta1);
            let s = if u > 0.0 { 1.0 } else if u < 0.0 { -1.0 } else { 0.0 };
            *p = *p * decay - h.lr * s;
            *m = *m * h.beta2 + g * (1.0 - h.beta2);
        }
    });
}

/// `start + w·(end − start)` as PyTorch's `lerp` computes it (from the nearer end, so `w = 1`
/// gives `end` exactly).
#[inline(always)]
fn lerp(start: f32, end: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        start + w * (end - start)
    } else {
        end - (end - start) * (1.0 - w)
    }
}

/// Muon's momentum on a run of elements (elementwise, so any shard of a matrix does its own):
/// `buf = lerp(buf, g, 1 − μ)` (an average, as `torch.optim.Muon` keeps it) and the update the
/// iteration orthogonalises, `out = lerp(g, buf, μ)` with Nesterov, else `buf`.
pub fn muon_momentum(grads: &[f32], buf: &mut [f32], out: &mut [f32], momentum: f32, nesterov: bool) {
    let w = (1.0 - momentum as f64) as f32;
    buf.par_chunks_mut(ELEMS).zip(grads.par_chunks(ELEMS).zip(out.par_chunks_mut(ELEMS))).for_each(|(b, (g, o))| {
        for ((b, &g), o) in b.iter_mut().zip(g).zip(o.iter_mut()) {
            *b = lerp(*b, g, w);
            *o = if nesterov { lerp(g, *b, momentum) } else { *b };
        }
    });
}

/// The Newton–Schulz iteration's settings: `steps` quintic steps with coefficients `(a, b, c)`
/// (Jordan et al.'s 3.4445, −4.7750, 2.0315), the norm's floor `eps`, and whether it runs in
/// bf16 as `torch.optim.Muon` does (every product's inputs bf16, accumulated in fp32 and rounded
/// to bf16; the normalisation too) or in fp32.
#[derive(Clone, Copy, Debug)]
pub struct NewtonSchulz {
    pub steps: usize,
    pub coefs: [f32; 3],
    pub eps: f32,
    pub bf16: bool,
}

impl Default for NewtonSchulz {
    fn default() -> Self {
        NewtonSchulz { steps: 5, coefs: [3.4445, -4.7750, 2.0315], eps: 1e-7, bf16: true }
    }
}

/// Orthogonalises the `rows × cols` matrix `x` in place: `x / ‖x‖_F`, then `steps` times
/// `X = a·X + (b·A + c·A²)·X` with `A = X·Xᵀ`, on the wide orientation (a tall matrix is
/// transposed first and back after, so `A` is the smaller Gram matrix). The result is close to
/// `U·Vᵀ` of `x = U·S·Vᵀ` (singular values within about 0.7..1.2, not exactly 1).
pub fn newton_schulz(x: &mut [f32], (rows, cols): (usize, usize), ns: &NewtonSchulz) {
    use crate::matmul::{gemm, Threads, View};
    let _p = crate::profile::scope("newton_schulz");
    assert_eq!(x.len(), rows * cols, "newton_schulz: shape");
    let tall = rows > cols;
    let (r, c) = if tall { (cols, rows) } else { (rows, cols) };
    let mut w = if tall { transposed(x, rows, cols) } else { x.to_vec() };
    let round = |v: &mut [f32]| {
        if ns.bf16 {
            crate::precision::round_slice(v, crate::precision::Format::Bf16)
        }
    };
    round(&mut w);
    let mut norm = sum_squares(&w).sqrt() as f32;
    if ns.bf16 {
        norm = crate::bf16::from_bf16(crate::bf16::to_bf16(norm));
    }
    let norm = norm.max(ns.eps);
    w.par_chunks_mut(ELEMS).for_each(|c| c.iter_mut().for_each(|a| *a /= norm));
    round(&mut w);
    let [ca, cb, cc] = ns.coefs;
    let (mut a, mut b, mut next) = (vec![0.0f32; r * r], vec![0.0f32; r * r], vec![0.0f32; r * c]);
    for _ in 0..ns.steps {
        let wv = View::rows(&w, r, c);
        gemm(&mut a, false, wv, wv.t(), 1.0, Threads::All);
        round(&mut a);
        b.iter_mut().zip(&a).for_each(|(b, &a)| *b = cb * a);
        let av = View::rows(&a, r, r);
        gemm(&mut b, true, av, av, cc, Threads::All);
        round(&mut b);
        next.iter_mut().zip(&w).for_each(|(n, &w)| *n = ca * w);
        gemm(&mut next, true, View::rows(&b, r, r), wv, 1.0, Threads::All);
        round(&mut next);
        std::mem::swap(&mut w, &mut next);
    }
    if tall {
        x.copy_from_slice(&transposed(&w, r, c));
    } else {
        x.copy_from_slice(&w);
    }
}

/// The `cols × rows` transpose of a row-major `rows × cols` matrix.
fn transposed(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; x.len()];
    t.par_chunks_mut(rows.max(1)).enumerate().for_each(|(j, col)| col.iter_mut().enumerate().for_each(|(i, o)| *o = x[i * cols + j]));
    t
}

/// Muon's parameter update from the orthogonalised `o`: `p = p·decay − lr·o`, `decay` being
/// `1 − lr·wd` at the group's unadjusted learning rate and `lr` the adjusted one.
pub fn muon_apply(params: &mut [f32], o: &[f32], lr: f32, decay: f32) {
    params.par_chunks_mut(ELEMS).zip(o.par_chunks(ELEMS)).for_each(|(p, o)| p.iter_mut().zip(o).for_each(|(p, &o)| *p = *p * decay - lr * o));
}

/// How Muon scales its learning rate for an `[out, in]` matrix `(a, b)`: `original` (Jordan:
/// `√max(1, a/b)`), `match_rms_adamw` (Moonlight: `0.2·√max(a, b)`, so AdamW's learning rate
/// and weight decay carry over) or `spectral_unclamped` (Bernstein: `√(a/b)`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MuonAdjust {
    #[default]
    Original,
    MatchRmsAdamw,
    SpectralUnclamped,
}

/// Muon's learning rate for an `[a, b]` matrix at the group's rate `lr`, computed in f64 as
/// `torch.optim.Muon` computes it.
pub fn muon_adjusted_lr(lr: f64, adjust: MuonAdjust, (a, b): (usize, usize)) -> f64 {
    let (a, b) = (a as f64, b as f64);
    lr * match adjust {
        MuonAdjust::Original => (a / b).max(1.0).sqrt(),
        MuonAdjust::MatchRmsAdamw => 0.2 * a.max(b).sqrt(),
        MuonAdjust::SpectralUnclamped => (a / b).sqrt(),
    }
}

/// Adafactor's hyper-parameters for one step (Shazeer & Stern 2018, as `torch.optim.Adafactor`:
/// no first moment, a relative step size `min(lr, 1/√t)` times the parameter's RMS (at least
/// `eps2`), the second moment's rate `1 − β2_t = t^beta2_decay`, and updates clipped to RMS `d`).
#[derive(Clone, Copy, Debug)]
pub struct Adafactor {
    pub lr: f64,
    pub beta2_decay: f64,
    pub eps1: f32,
    pub eps2: f64,
    pub d: f64,
    pub weight_decay: f64,
    /// 1-based step count.
    pub t: u64,
}

/// One Adafactor step of one parameter tensor `p` of `shape` (`(rows, cols)`; a vector is
/// `(n, 1)` and is not factored). `state` holds the second moment: a matrix's row and column
/// averages of `g²` (`rows + cols` elements, rows first), a vector's `g²` (`n`). A matrix's
/// estimate is `row_i · col_j / mean(row)`; the update `g / √max(estimate, eps1²)`, scaled down
/// to RMS `d` if above, steps by `max(eps2, RMS(p)) · min(lr, 1/√t)`.
pub fn adafactor_update(p: &mut [f32], g: &[f32], state: &mut [f32], (rows, cols): (usize, usize), h: &Adafactor) {
    let _p = crate::profile::scope("adafactor_update");
    let n = p.len();
    assert!(g.len() == n && rows * cols == n, "adafactor_update: shapes");
    let t = h.t as f64;
    let w = t.powf(h.beta2_decay) as f32;
    let rho = h.lr.min(1.0 / t.sqrt());
    let alpha = h.eps2.max((sum_squares(p) / n as f64).sqrt()) * rho;
    if h.weight_decay != 0.0 {
        scale_in_place(p, (1.0 - h.lr * h.weight_decay) as f32);
    }
    let floor = h.eps1 * h.eps1;
    let mut u = vec![0.0f32; n];
    if cols > 1 {
        assert_eq!(state.len(), rows + cols, "adafactor_update: factored state");
        let (row, col) = state.split_at_mut(rows);
        for (i, r) in row.iter_mut().enumerate() {
            let mean = sum_squares(&g[i * cols..(i + 1) * cols]).sqrt() as f32;
            *r = lerp(*r, mean * mean / cols as f32, w);
        }
        let mut sums = vec![0.0f64; cols];
        g.chunks(cols).for_each(|gr| sums.iter_mut().zip(gr).for_each(|(s, &x)| *s += (x as f64) * (x as f64)));
        for (c, s) in col.iter_mut().zip(&sums) {
            let norm = s.sqrt() as f32;
            *c = lerp(*c, norm * norm / rows as f32, w);
        }
        let mean_row = (row.iter().map(|&x| x as f64).sum::<f64>() / rows as f64) as f32;
        let mean_row = mean_row.max(h.eps1);
        u.par_chunks_mut(cols).zip(g.par_chunks(cols)).zip(row.par_iter()).for_each(|((u, g), &r)| {
            for ((u, &g), &c) in u.iter_mut().zip(g).zip(col.iter()) {
                *u = g / ((r * c / mean_row).max(floor)).sqrt();
            }
        });
    } else {
        assert_eq!(state.len(), n, "adafactor_update: vector state");
        for ((s, &gi), u) in state.iter_mut().zip(g).zip(u.iter_mut()) {
            *s = lerp(*s, gi * gi, w);
            *u = gi / s.max(floor).sqrt();
        }
    }
    let denom = 1.0f64.max((sum_squares(&u) / n as f64).sqrt() / h.d);
    let step = (alpha / denom) as f32;
    p.par_chunks_mut(ELEMS).zip(u.par_chunks(ELEMS)).for_each(|(p, u)| p.iter_mut().zip(u).for_each(|(p, &u)| *p -= step * u));
}
