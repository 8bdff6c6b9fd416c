//! The language-model head fused with softmax cross-entropy, over chunks of rows, so the full
//! `[N, Vp]` logits (and their gradient) are never held at once: only one `[R, Vp]` chunk.
//!
//! For each chunk of `R` rows: `logits = inp · weightᵀ` (gemm), a row softmax over the first
//! `V` columns, the loss at the target, and — when gradients are wanted — the logit gradient
//! `dloss·(p − onehot)` in place, then `dinp = dlogits · weight` and
//! `dweight += dlogitsᵀ · inp`. Forward and backward are one kernel here because the logits'
//! gradient needs nothing but the logits themselves: keeping them until a separate backward
//! would mean holding all of them, which is what this kernel exists to avoid.

use crate::matmul::{gemm_as, Arith, Threads, View};
use crate::simd;
use rayon::prelude::*;

/// The head's shape: `weight` holds rows `offset .. offset + vp` of the whole head (`offset` is
/// 0 unless the vocabulary is split over ranks), of which the first `v` are real tokens and the
/// rest padding; targets equal to `ignore_index` count for nothing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HeadDims {
    /// channels `C`
    pub c: usize,
    /// real vocabulary rows of `weight`: `V` (vocab-parallel: this rank's)
    pub v: usize,
    /// rows of `weight`: `Vp` (vocab-parallel: this rank's slice)
    pub vp: usize,
    /// the whole head's row index of `weight`'s first row
    pub offset: usize,
    /// the target of rows that count for nothing (loss 0, no gradient)
    pub ignore_index: i32,
    /// the products' arithmetic (bf16 training: bf16 inputs, fp32 logits and gradients)
    pub arith: Arith,
    /// soft-capping of the logits, `z ↦ cap·tanh(z / cap)` before the softmax (Gemma 2's
    /// `final_logit_softcapping`); 0 = none
    pub softcap: f32,
}

/// `z ← cap·tanh(z / cap)` over `logits` (a head's logits outside the fused kernel: evaluation
/// and decoding); nothing with `cap` 0.
pub fn softcap_logits(logits: &mut [f32], cap: f32) {
    if cap > 0.0 {
        logits.par_iter_mut().for_each(|z| *z = cap * (*z / cap).tanh());
    }
}

/// Soft-caps a row's logits in place (`z ← cap·tanh(z / cap)`) and returns them as they are
/// then, for [`softcap_grad`]; `None` without a cap.
fn softcap_row(row: &mut [f32], cap: f32) -> Option<crate::par::PoolBuf> {
    if cap <= 0.0 {
        return None;
    }
    row.iter_mut().for_each(|z| *z = cap * (*z / cap).tanh());
    let mut kept = crate::par::pooled(row.len());
    kept.copy_from_slice(row);
    Some(kept)
}

/// The gradient with respect to the capped logits `capped` → with respect to the raw ones:
/// `g ← g·(1 − (z_capped / cap)²)`.
fn softcap_grad(g: &mut [f32], capped: Option<&crate::par::PoolBuf>, cap: f32) {
    if let Some(zc) = capped {
        for (g, z) in g.iter_mut().zip(zc.iter()) {
            let t = z / cap;
            *g *= 1.0 - t * t;
        }
    }
}

/// The weight of each counted row's loss in the gradient: one for every row (a mean's
/// `loss_scale / count`), or one per row (`[N]`: a sequence objective's per-token weights, such
/// as a preference loss's).
#[derive(Clone, Copy, Debug)]
pub enum Dloss<'a> {
    All(f32),
    Rows(&'a [f32]),
}

impl Dloss<'_> {
    fn at(self, row: usize) -> f32 {
        match self {
            Dloss::All(d) => d,
            Dloss::Rows(w) => w[row],
        }
    }
}

/// Rows per chunk: as many as fit in about 8M floats (32 MB) of logits, at least one; 32M
/// (128 MB) with bf16 products, where every chunk packs the head's whole weight into bf16 panels
/// again (with 166-row chunks of GPT-2's 50304 × 768 head that packing cost a quarter of the
/// head's time).
pub fn chunk_rows(n: usize, vp: usize, arith: Arith) -> usize {
    let budget = match arith {
        Arith::F32 => 8 << 20,
        Arith::Bf16 => 32 << 20,
    };
    (budget / vp.max(1)).clamp(1, n.max(1))
}

/// Writes `losses[N]` (0 at ignored rows) and returns the number of counted rows. With
/// `grads = Some((dinp, dweight, dloss))`, also overwrites `dinp[N, C]` with the input gradient
/// and accumulates `dweight[Vp, C]`, where `dloss` is the weight of each counted row's loss
/// (`loss_scale / count` for a mean, or one per row). `scratch` holds one chunk of logits: at least
/// `chunk_rows(N, Vp, dims.arith) · Vp` floats. The whole head: `dims.offset` is 0.
pub fn lm_head_crossentropy(
    losses: &mut [f32],                                  // [N]
    grads: Option<(&mut [f32], &mut [f32], Dloss)>,      // dinp [N, C], dweight [Vp, C], dloss
    inp: &[f32],                                         // [N, C]
    weight: &[f32],                                      // [Vp, C]
    targets: &[i32],                                     // [N]
    scratch: &mut [f32],                                 // [R, Vp]
    dims: &HeadDims,
) -> usize {
    let _p = crate::profile::scope("lm_head_crossentropy");
    let HeadDims { c, v, vp, offset, ignore_index, .. } = *dims;
    assert_eq!(offset, 0, "a vocabulary slice needs lm_head_crossentropy_vocab_parallel");
    let n = targets.len();
    assert_eq!(inp.len(), n * c);
    assert_eq!(weight.len(), vp * c);
    let r = chunk_rows(n, vp, dims.arith);
    assert!(scratch.len() >= r * vp, "scratch too small");
    if let Some((_, _, Dloss::Rows(w))) = &grads {
        assert_eq!(w.len(), n, "one loss weight per row");
    }
    let mut grads = grads;
    for r0 in (0..n).step_by(r) {
        let rows = r.min(n - r0);
        let lg = &mut scratch[..rows * vp];
        let x = &inp[r0 * c..(r0 + rows) * c];
        gemm_as(dims.arith, lg, false, View::rows(x, rows, c), View::rows(weight, vp, c).t(), 1.0, Threads::All);
        let dloss = grads.as_ref().map(|g| g.2);
        let tg = &targets[r0..r0 + rows];
        lg.par_chunks_mut(vp).zip(losses[r0..r0 + rows].par_iter_mut()).zip(tg.par_iter()).enumerate().for_each(|(i, ((row, loss), &tgt))| {
            let capped = softcap_row(&mut row[..v], dims.softcap);
            softmax_row(row, v);
            if tgt == ignore_index {
                *loss = 0.0;
                row.fill(0.0);
                return;
            }
            assert!((tgt as usize) < v, "target {tgt} out of vocabulary {v}");
            *loss = -(row[tgt as usize].max(f32::MIN_POSITIVE)).ln();
            if let Some(d) = dloss.map(|d| d.at(r0 + i)) {
                for p in row[..v].iter_mut() {
                    *p *= d;
                }
                row[tgt as usize] -= d;
                softcap_grad(&mut row[..v], capped.as_ref(), dims.softcap);
            }
        });
        if let Some((dinp, dweight, _)) = grads.as_mut() {
            chunk_grads(&mut dinp[r0 * c..(r0 + rows) * c], dweight, lg, x, weight, rows, dims);
        }
    }
    targets.iter().filter(|&&t| t != ignore_index).count()
}

/// One chunk's backward through the head: `dinp = dlogits · weight` (overwritten) and
/// `dweight += dlogitsᵀ · inp`, with `dlogits` `[rows, Vp]`; an empty `dweight` skips the
/// weight's gradient (a frozen head: LoRA).
fn chunk_grads(dinp: &mut [f32], dweight: &mut [f32], dlogits: &[f32], inp: &[f32], weight: &[f32], rows: usize, dims: &HeadDims) {
    let HeadDims { c, vp, .. } = *dims;
    let dl = View::rows(dlogits, rows, vp);
    gemm_as(dims.arith, dinp, false, dl, View::rows(weight, vp, c), 1.0, Threads::All);
    if !dweight.is_empty() {
        gemm_as(dims.arith, dweight, true, dl.t(), View::rows(inp, rows, c), 1.0, Threads::All);
    }
}

/// In-place softmax over the first `v` entries of `row`; the rest (padding) become 0.
fn softmax_row(row: &mut [f32], v: usize) {
    let max = row[..v].iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a));
    let sum = exp_sub_sum(&mut row[..v], max);
    let inv = 1.0 / sum;
    for p in row[..v].iter_mut() {
        *p *= inv;
    }
    row[v..].fill(0.0);
}

crate::multiversion! {
    /// `x = exp(x - max)` in place; returns the sum.
    fn exp_sub_sum_into(x: &mut [f32], max: f32, out: &mut f32) {
        // Eight running sums (a fixed order, so still deterministic) let the loop vectorise.
        let mut acc = [0.0f32; 8];
        let mut chunks = x.chunks_exact_mut(8);
        for ch in &mut chunks {
            for (a, s) in ch.iter_mut().zip(acc.iter_mut()) {
                *a = simd::exp(*a - max);
                *s += *a;
            }
        }
        let mut tail = 0.0f32;
        for a in chunks.into_remainder() {
            *a = simd::exp(*a - max);
            tail += *a;
        }
        *out = acc.iter().sum::<f32>() + tail;
    }
}

fn exp_sub_sum(x: &mut [f32], max: f32) -> f32 {
    let mut s = 0.0;
    exp_sub_sum_into(x, max, &mut s);
    s
}

/// [`lm_head_crossentropy`] with the vocabulary split over ranks (Megatron-LM's
/// vocab-parallel cross-entropy): `weight` holds rows `offset .. offset + vl` of the whole
/// head, of which the first `v_local` are real tokens (the rest padding): `dims` is
/// `HeadDims { v: v_local, vp: vl, offset, .. }`. Per chunk of rows,
/// each rank computes its logits, its log-sum-exp over its columns and its target logit (0
/// where another rank owns the target); `gather` all-gathers `[lse | target logit]` of the
/// chunk's rows across the ranks (rank order), and every rank combines them into the global
/// log-sum-exp `m + ln Σ_r exp(lse_r − m)` and target logit, so `loss = lse − z_target`.
/// Gradients: `dlogits = dloss·(exp(z − lse) − onehot)` on this rank's columns; `dweight`
/// (this rank's rows) accumulates, `dinp` is overwritten with this rank's *partial* input
/// gradient, which the caller sums over the ranks. The `[N, V]` logits never exist anywhere.
// Eight arguments, kept: `lm_head_crossentropy`'s seven and the collective; no two of them
// belong together (outputs, gradients, input, weight, targets, scratch, dims, communicator).
#[allow(clippy::too_many_arguments)]
pub fn lm_head_crossentropy_vocab_parallel(
    losses: &mut [f32],                                  // [N]
    grads: Option<(&mut [f32], &mut [f32], Dloss)>,      // dinp [N, C] (partial), dweight [vl, C], dloss
    inp: &[f32],                                         // [N, C]
    weight: &[f32],                                      // [vl, C]
    targets: &[i32],                                     // [N], global ids
    scratch: &mut [f32],                                 // [R, vl]
    dims: &HeadDims,
    gather: &mut dyn FnMut(&[f32]) -> Vec<f32>,
) -> usize {
    let _p = crate::profile::scope("lm_head_crossentropy_vocab_parallel");
    let HeadDims { c, v: v_local, vp: vl, offset, ignore_index, .. } = *dims;
    let n = targets.len();
    assert_eq!(inp.len(), n * c);
    assert_eq!(weight.len(), vl * c);
    assert!(v_local <= vl);
    let r = chunk_rows(n, vl, dims.arith);
    assert!(scratch.len() >= r * vl, "scratch too small");
    let mut grads = grads;
    if let Some((_, _, Dloss::Rows(w))) = &grads {
        assert_eq!(w.len(), n, "one loss weight per row");
    }
    let owned = |tgt: i32| tgt != ignore_index && (offset..offset + v_local).contains(&(tgt as usize));
    for r0 in (0..n).step_by(r) {
        let rows = r.min(n - r0);
        let lg = &mut scratch[..rows * vl];
        let x = &inp[r0 * c..(r0 + rows) * c];
        gemm_as(dims.arith, lg, false, View::rows(x, rows, c), View::rows(weight, vl, c).t(), 1.0, Threads::All);
        let tg = &targets[r0..r0 + rows];
        // This rank's [lse | target logit] per row (of the capped logits, each row's kept).
        let capped: Vec<Option<crate::par::PoolBuf>> = lg.chunks_mut(vl).map(|row| softcap_row(&mut row[..v_local], dims.softcap)).collect();
        let mut mine = vec![0.0f32; 2 * rows];
        for (i, row) in lg.chunks(vl).enumerate() {
            let max = row[..v_local].iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a));
            let sum: f64 = row[..v_local].iter().map(|&z| ((z - max) as f64).exp()).sum();
            mine[i] = if v_local == 0 { f32::NEG_INFINITY } else { max + (sum as f32).ln() };
            mine[rows + i] = if owned(tg[i]) { row[tg[i] as usize - offset] } else { 0.0 };
        }
        let all = gather(&mine);
        let ranks = all.len() / (2 * rows);
        let dloss = grads.as_ref().map(|g| g.2);
        lg.par_chunks_mut(vl).zip(losses[r0..r0 + rows].par_iter_mut()).enumerate().for_each(|(i, (row, loss))| {
            let tgt = tg[i];
            let part = |k: usize, j: usize| all[k * 2 * rows + j * rows + i];
            let m = (0..ranks).map(|k| part(k, 0)).fold(f32::NEG_INFINITY, f32::max);
            let lse = m + (0..ranks).map(|k| ((part(k, 0) - m) as f64).exp()).sum::<f64>().ln() as f32;
            if tgt == ignore_index {
                *loss = 0.0;
                row.fill(0.0);
                return;
            }
            let zt = (0..ranks).map(|k| part(k, 1)).sum::<f32>();
            *loss = lse - zt;
            match dloss.map(|d| d.at(r0 + i)) {
                Some(d) => {
                    for z in row[..v_local].iter_mut() {
                        *z = d * simd::exp(*z - lse);
                    }
                    row[v_local..].fill(0.0);
                    if owned(tgt) {
                        row[tgt as usize - offset] -= d;
                    }
                    softcap_grad(&mut row[..v_local], capped[i].as_ref(), dims.softcap);
                }
                None => row.fill(0.0),
            }
        });
        if let Some((dinp, dweight, _)) = grads.as_mut() {
            chunk_grads(&mut dinp[r0 * c..(r0 + rows) * c], dweight, lg, x, weight, rows, dims);
        }
    }
    targets.iter().filter(|&&t| t != ignore_index).count()
}
