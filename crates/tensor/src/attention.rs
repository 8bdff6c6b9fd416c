//! Causal multi-head self-attention over a fused `qkv` buffer (`[B, T, 3C]`: q, k, v, each
//! `NH` heads of `HS` channels). One rayon task per (batch, head); inside a task the three
//! products run through gemm single-threaded, so threads never oversubscribe.
//!
//! This version keeps the post-softmax probabilities `att[B, NH, T, T]` for backward (the llm.c
//! layout). Attention-probability dropout ([`AttnDropout`]) uses a counter-based mask keyed by
//! `(seed, ((b·NH + h)·T + i)·T + j)` and is regenerated in backward.

use crate::llama::GqaDims;
use crate::matmul::{gemm_raw, View, Threads};
use crate::ops::dropout_keep;
use crate::par::SyncPtr;
use rayon::prelude::*;

/// Attention-probability dropout: probability `p` in `[0, 1)` (0 = none) and the seed of its
/// counter-based mask. The same value goes to a forward and its backward, which regenerates the
/// mask. Shared by this module's kernels and [`crate::flash`]'s.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttnDropout {
    pub p: f32,
    pub seed: u64,
}

impl AttnDropout {
    /// No dropout.
    pub const NONE: AttnDropout = AttnDropout { p: 0.0, seed: 0 };
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttnDims {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
    /// As [`crate::llama::GqaDims::head0`] / `heads`: a tensor-parallel shard's place among the
    /// whole model's heads, for the dropout mask (0, 0 = not a shard).
    pub head0: usize,
    pub heads: usize,
    /// As `GqaDims::b0`.
    pub b0: usize,
}

impl AttnDims {
    /// The MHA shape as the GQA shape with one query head per kv head: the layouts coincide.
    pub fn as_gqa(&self) -> GqaDims {
        assert!(self.nh > 0 && self.c.is_multiple_of(self.nh), "C must be a multiple of NH");
        GqaDims { b: self.b, t: self.t, nh: self.nh, nkv: self.nh, hs: self.c / self.nh, head0: self.head0, heads: self.heads, b0: self.b0, window: 0, sinks: 0, rotary: 0, scale: 0.0, softcap: 0.0 }
    }

    /// The whole-model `(batch, head)` index of `bh = b·NH + h` (`GqaDims::mask_bh`).
    fn mask_bh(&self, bh: usize) -> usize {
        self.as_gqa().mask_bh(bh)
    }

    fn hs(&self) -> usize {
        assert_eq!(self.c % self.nh, 0);
        self.c / self.nh
    }
}

/// `out[b,t,h·HS..] = Σ_j dropout(softmax_j(q·kᵀ/√HS, causal))·v_j`. Overwrites `out` and `att`.
pub fn attention_forward(
    out: &mut [f32],   // [B, T, C]
    att: &mut [f32],   // [B, NH, T, T]  softmax probabilities (before dropout)
    qkv: &[f32],       // [B, T, 3C]
    dims: &AttnDims,
    dropout: AttnDropout,
) {
    attention_forward_docs(out, att, qkv, dims, &[], dropout);
}

/// [`attention_forward`] over packed documents (see [`crate::flash`]): query `i` of row `b`
/// attends keys `start[b·T + i] ..= i` only; [`attention_backward`] needs nothing more (the
/// probabilities outside are 0). An empty `starts` is [`attention_forward`]. Overwrites `out`
/// and `att`.
pub fn attention_forward_docs(
    out: &mut [f32],   // [B, T, C]
    att: &mut [f32],   // [B, NH, T, T]  softmax probabilities (before dropout)
    qkv: &[f32],       // [B, T, 3C]
    dims: &AttnDims,
    starts: &[u32],    // [B, T] or empty: each token's document start within its row
    dropout: AttnDropout,
) {
    let _p = crate::profile::scope("attention_forward");
    crate::flash::check_starts(starts, dims.b, dims.t);
    let AttnDropout { p: dropout, seed } = dropout;
    let AttnDims { b, t, c, nh, .. } = *dims;
    let hs = dims.hs();
    assert_eq!(out.len(), b * t * c);
    assert_eq!(att.len(), b * nh * t * t);
    assert_eq!(qkv.len(), b * t * 3 * c);
    let scale = 1.0 / (hs as f32).sqrt();
    let outp = SyncPtr(out.as_mut_ptr());
    att.par_chunks_mut(t * t).enumerate().for_each(|(bh, a)| {
        // Whole-wrapper capture: edition 2021 would otherwise capture only the raw pointer field (not Send/Sync).
        #[allow(clippy::redundant_locals)]
        let outp = outp;
        let (bi, h) = (bh / nh, bh % nh);
        let base = bi * t * 3 * c;
        let q = View { data: qkv, off: base + h * hs, rows: t, cols: hs, rs: 3 * c, cs: 1 };
        let k = View { off: base + c + h * hs, ..q };
        let v = View { off: base + 2 * c + h * hs, ..q };
        // S = q·kᵀ·scale   [T, T]
        unsafe { gemm_raw((a.as_mut_ptr(), t), false, q, k.t(), scale, Threads::One) };
        for i in 0..t {
            let lo = if starts.is_empty() { 0 } else { starts[bi * t + i] as usize };
            let row = &mut a[i * t..(i + 1) * t];
            row[..lo].fill(0.0);
            let live = &mut row[lo..=i];
            let max = live.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let mut sum = 0.0f32;
            for x in live.iter_mut() {
                *x = crate::simd::exp(*x - max);
                sum += *x;
            }
            let inv = 1.0 / sum;
            for x in live.iter_mut() {
                *x *= inv;
            }
            for x in row[i + 1..].iter_mut() {
                *x = 0.0;
            }
        }
        let o_off = bi * t * c + h * hs;
        // Safety: task (bi, h) writes only rows of batch bi, columns h·HS..(h+1)·HS of `out`.
        let dst = unsafe { outp.0.add(o_off) };
        if dropout > 0.0 {
            let mut pd = a.to_vec();
            apply_att_dropout(&mut pd, dims.mask_bh(bh), t, dropout, seed);
            let p = View::rows(&pd, t, t);
            unsafe { gemm_raw((dst, c), false, p, v, 1.0, Threads::One) };
        } else {
            let p = View::rows(a, t, t);
            unsafe { gemm_raw((dst, c), false, p, v, 1.0, Threads::One) };
        }
    });
}

fn apply_att_dropout(p: &mut [f32], bh: usize, t: usize, dropout: f32, seed: u64) {
    let scale = 1.0 / (1.0 - dropout);
    let base = (bh * t * t) as u64;
    for (idx, x) in p.iter_mut().enumerate() {
        *x = if dropout_keep(seed, base + idx as u64, dropout) { *x * scale } else { 0.0 };
    }
}

/// Backward of [`attention_forward`]. Accumulates into `dqkv`.
pub fn attention_backward(
    dqkv: &mut [f32],  // [B, T, 3C]
    dout: &[f32],      // [B, T, C]
    qkv: &[f32],       // [B, T, 3C]
    att: &[f32],       // [B, NH, T, T]
    dims: &AttnDims,
    dropout: AttnDropout,
) {
    let _p = crate::profile::scope("attention_backward");
    let AttnDropout { p: dropout, seed } = dropout;
    let AttnDims { b, t, c, nh, .. } = *dims;
    let hs = dims.hs();
    assert_eq!(dqkv.len(), b * t * 3 * c);
    let scale = 1.0 / (hs as f32).sqrt();
    let dp = SyncPtr(dqkv.as_mut_ptr());
    (0..b * nh).into_par_iter().for_each(|bh| {
        // Whole-wrapper capture: edition 2021 would otherwise capture only the raw pointer field (not Send/Sync).
        #[allow(clippy::redundant_locals)]
        let dp = dp;
        let (bi, h) = (bh / nh, bh % nh);
        let base = bi * t * 3 * c;
        let p = &att[bh * t * t..(bh + 1) * t * t];
        let q = View { data: qkv, off: base + h * hs, rows: t, cols: hs, rs: 3 * c, cs: 1 };
        let k = View { off: base + c + h * hs, ..q };
        let v = View { off: base + 2 * c + h * hs, ..q };
        let d_o = View { data: dout, off: bi * t * c + h * hs, rows: t, cols: hs, rs: c, cs: 1 };
        let mut pd_buf;
        let pd: &[f32] = if dropout > 0.0 {
            pd_buf = p.to_vec();
            apply_att_dropout(&mut pd_buf, dims.mask_bh(bh), t, dropout, seed);
            &pd_buf
        } else {
            p
        };
        // Safety: task (bi, h) writes only rows of batch bi, the q/k/v columns of head h.
        let (dq, dk, dv) = unsafe {
            let r = dp.0.add(base + h * hs);
            (r, r.add(c), r.add(2 * c))
        };
        // dv += pdᵀ · dout
        unsafe { gemm_raw((dv, 3 * c), true, View::rows(pd, t, t).t(), d_o, 1.0, Threads::One) };
        // dpd = dout · vᵀ   [T, T]
        let mut ds = vec![0.0f32; t * t];
        unsafe { gemm_raw((ds.as_mut_ptr(), t), false, d_o, v.t(), 1.0, Threads::One) };
        if dropout > 0.0 {
            let sc = 1.0 / (1.0 - dropout);
            let base = (dims.mask_bh(bh) * t * t) as u64;
            for (idx, x) in ds.iter_mut().enumerate() {
                *x = if dropout_keep(seed, base + idx as u64, dropout) { *x * sc } else { 0.0 };
            }
        }
        // softmax backward: ds = p ∘ (dp − Σ_j p·dp), causal part only.
        for i in 0..t {
            let pr = &p[i * t..(i + 1) * t];
            let dr = &mut ds[i * t..(i + 1) * t];
            let dot: f32 = pr[..=i].iter().zip(&dr[..=i]).map(|(a, b)| a * b).sum();
            for j in 0..=i {
                dr[j] = pr[j] * (dr[j] - dot);
            }
            for x in dr[i + 1..].iter_mut() {
                *x = 0.0;
            }
        }
        let dsv = View::rows(&ds, t, t);
        // dq += ds · k · scale ; dk += dsᵀ · q · scale
        unsafe { gemm_raw((dq, 3 * c), true, dsv, k, scale, Threads::One) };
        unsafe { gemm_raw((dk, 3 * c), true, dsv.t(), q, scale, Threads::One) };
    });
}

/// One decoding step with a KV cache: query `q[NH·HS]` for position `T - 1` attends over
/// the cached keys and values of positions `0..T` (the last `window` of them under a sliding
/// window, and the first `sinks`) (`T = dims.t`, one sequence: `dims.b` and the
/// dropout placement are unused); query head `h` reads kv head `h / (NH/NKV)` (grouped-query
/// attention; `NKV == NH` is plain multi-head). Overwrites `out`.
pub fn attention_decode(
    out: &mut [f32],      // [NH·HS]
    q: &[f32],            // [NH·HS]
    k_cache: &[f32],      // [T, NKV·HS]
    v_cache: &[f32],      // [T, NKV·HS]
    dims: &GqaDims,
) {
    let GqaDims { t: t_cur, nh, nkv, hs, .. } = *dims;
    let kw = nkv * hs;
    let group = nh / nkv;
    let scale = dims.logit_scale();
    // Under a sliding window only the last `window` positions are seen, and the sinks.
    let lo = dims.first_key(t_cur - 1);
    let keys: Vec<usize> = (0..dims.sink_end(t_cur - 1, 0)).chain(lo..t_cur).collect();
    let mut w = vec![0.0f32; keys.len()];
    for h in 0..nh {
        let kh = h / group;
        let qh = &q[h * hs..(h + 1) * hs];
        let mut max = f32::NEG_INFINITY;
        for (&j, wj) in keys.iter().zip(w.iter_mut()) {
            let kj = &k_cache[j * kw + kh * hs..j * kw + (kh + 1) * hs];
            *wj = qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
            if dims.softcap > 0.0 {
                *wj = dims.softcap * (*wj / dims.softcap).tanh();
            }
            max = max.max(*wj);
        }
        let mut sum = 0.0;
        for wj in w.iter_mut() {
            *wj = (*wj - max).exp();
            sum += *wj;
        }
        let oh = &mut out[h * hs..(h + 1) * hs];
        oh.fill(0.0);
        for (&j, wj) in keys.iter().zip(&w) {
            let vj = &v_cache[j * kw + kh * hs..j * kw + (kh + 1) * hs];
            let a = wj / sum;
            for (o, v) in oh.iter_mut().zip(vj) {
                *o += a * v;
            }
        }
    }
}
