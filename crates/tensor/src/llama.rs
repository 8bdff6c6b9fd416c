//! LLaMA-family kernels, matching Hugging Face `transformers`' `LlamaForCausalLM` math:
//! RMSNorm, rotary position embeddings (the `rotate_half` convention, not interleaved), the
//! SwiGLU activation and materialised grouped-query attention (GQA).
//!
//! Extra shape letters: `N` rows (`B·T`), `NKV` key/value heads (`NH` a multiple of it), `F` the
//! MLP's intermediate size, `W = (NH + 2·NKV)·HS` the width of one token's fused qkv row,
//! laid out `[q: NH·HS | k: NKV·HS | v: NKV·HS]` (HF's `q_proj`, `k_proj`, `v_proj` weights
//! concatenated by rows give this layout from one matmul). With `NKV == NH` it is exactly the
//! `[B, T, 3C]` layout of `crate::attention`.
//!
//! Forward functions overwrite their outputs; backward functions accumulate (`+=`) into their
//! gradients — except the rotary pair, which rotates its buffer *in place* (see [`rope_forward`]).

use crate::matmul::{gemm_raw, Threads, View};
use crate::par::{row_blocks_reduce, rows_per_block, SyncPtr, ELEMS};
use crate::simd;
use rayon::prelude::*;

// ---------------------------------------------------------------------------------------------
// RMSNorm (HF `LlamaRMSNorm`, in fp32): out = weight · (x · rsqrt(mean(x²) + eps))

/// `out = weight · (inp · rstd)` per row with `rstd = 1/√(mean(inp²) + eps)`; saves `rstd`.
pub fn rmsnorm_forward(
    out: &mut [f32],     // [N, C]
    rstd: &mut [f32],    // [N]
    inp: &[f32],         // [N, C]
    weight: &[f32],      // [C]
    eps: f32,
    c: usize,
) {
    let _p = crate::profile::scope("rmsnorm_forward");
    assert_eq!(weight.len(), c);
    assert_eq!(inp.len(), rstd.len() * c);
    assert_eq!(out.len(), inp.len());
    let rows = rows_per_block(c);
    out.par_chunks_mut(rows * c).zip(rstd.par_chunks_mut(rows)).enumerate().for_each(|(bi, (o, s))| {
        let r0 = bi * rows;
        rmsnorm_rows(o, s, &inp[r0 * c..r0 * c + o.len()], weight, eps)
    });
}

crate::multiversion! {
    fn rmsnorm_rows(o: &mut [f32], s: &mut [f32], x: &[f32], weight: &[f32], eps: f32) {
        let c = weight.len();
        for (r, s) in s.iter_mut().enumerate() {
            let (o, x) = (&mut o[r * c..(r + 1) * c], &x[r * c..(r + 1) * c]);
            let ms = simd::sum_by([x], |[x]| x * x) / c as f32;
            let rs = 1.0 / (ms + eps).sqrt();
            // HF order: `hidden * rsqrt(var + eps)`, then `weight * hidden`.
            for j in 0..c {
                o[j] = weight[j] * (x[j] * rs);
            }
            *s = rs;
        }
    }
}

/// Backward of [`rmsnorm_forward`]. Accumulates into `dinp` and `dweight`.
/// With `n = x·rstd`: `dx = rstd·(w·d − n·mean(w·d·n))`, `dw = Σ_rows d·n`.
pub fn rmsnorm_backward(
    dinp: &mut [f32],      // [N, C]
    dweight: &mut [f32],   // [C]
    dout: &[f32],          // [N, C]
    inp: &[f32],           // [N, C]
    weight: &[f32],        // [C]
    rstd: &[f32],          // [N]
    c: usize,
) {
    let _p = crate::profile::scope("rmsnorm_backward");
    let n = rstd.len();
    assert_eq!(inp.len(), n * c);
    assert_eq!(dout.len(), n * c);
    assert_eq!(dinp.len(), n * c);
    // One pass per block of rows: the input gradients and the weight gradient's partial sums.
    row_blocks_reduce(dinp, c, &mut [dweight], |r0, di, pw| {
        let r1 = r0 + di.len() / c;
        rmsnorm_backward_rows(di, pw, &dout[r0 * c..r1 * c], &inp[r0 * c..r1 * c], weight, &rstd[r0..r1]);
    });
}

crate::multiversion! {
    /// Rows `rstd.len()`: `di += …`, and `pw += Σ_r d·x·rstd`, rows in order.
    fn rmsnorm_backward_rows(di: &mut [f32], pw: &mut [f32], d: &[f32], x: &[f32], weight: &[f32], rstd: &[f32]) {
        let c = weight.len();
        for (r, &rs) in rstd.iter().enumerate() {
            let (di, d, x) = (&mut di[r * c..(r + 1) * c], &d[r * c..(r + 1) * c], &x[r * c..(r + 1) * c]);
            // mean(w·d·n) with n = x·rs
            let m = simd::sum_by([weight, d, x], |[w, d, x]| w * d * x) * rs / c as f32;
            for j in 0..c {
                di[j] += rs * (weight[j] * d[j] - x[j] * rs * m);
            }
            for j in 0..c {
                pw[j] += d[j] * x[j] * rs;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Per-head RMSNorm (Qwen3's `q_norm` / `k_norm`): RMSNorm over each head vector of q and of k.

/// In every token's fused `[W]` row of `qkv`, each of the `NH` q heads is RMS-normalised with
/// `weight[..HS]` and each of the `NKV` k heads with `weight[HS..]`, in place,
/// `x ↦ w · (x · rstd)` (HF `Qwen3RMSNorm` on `q_proj(x).view(…, HS)`, likewise k); v is
/// untouched. With a whole-width `weight` (`[NH·HS | NKV·HS]`, OLMo 2's `q_norm` / `k_norm`)
/// all of a token's q heads are normalised as one vector, and its k heads as another. Saves the
/// inputs in `pre` (`[q: N·NH·HS | k: N·NKV·HS]`) and the `rstd`s in `rstd` (per head
/// `[q: N·NH | k: N·NKV]`, whole-width `[q: N | k: N]`).
pub fn qk_rmsnorm_forward(
    qkv: &mut [f32],  // [N, W]
    pre: &mut [f32],  // [N·(NH + NKV)·HS]
    rstd: &mut [f32], // [N·(NH + NKV)] or [2·N]
    weight: &[f32],   // [2·HS] or [(NH + NKV)·HS]: q_norm | k_norm
    eps: f32,
    (nh, nkv, hs): (usize, usize, usize),
) {
    let QkSplit { w, n, q_rows: (wq, hq), k_rows: (wk, hk) } = QkSplit::of(weight.len(), pre.len(), (nh, nkv, hs));
    let (pq, pk) = pre.split_at_mut(n * nh * hs);
    let (rq, rk) = rstd.split_at_mut(n * hq);
    head_rmsnorm_forward(qkv, pq, rq, &weight[..wq], eps, (w, 0, hq));
    head_rmsnorm_forward(qkv, pk, rk, &weight[wq..wq + wk], eps, (w, nh * hs, hk));
}

/// Backward of [`qk_rmsnorm_forward`]: the gradient with respect to the normalised q and k
/// heads in `dqkv` becomes, in place, the gradient with respect to their inputs; the weights'
/// gradient accumulates into `dweight` (shaped as `weight`).
pub fn qk_rmsnorm_backward(
    dqkv: &mut [f32],    // [N, W]
    dweight: &mut [f32], // as weight
    pre: &[f32],
    weight: &[f32],
    rstd: &[f32],
    (nh, nkv, hs): (usize, usize, usize),
) {
    let QkSplit { w, n, q_rows: (wq, hq), k_rows: (_, hk) } = QkSplit::of(weight.len(), pre.len(), (nh, nkv, hs));
    let (pq, pk) = pre.split_at(n * nh * hs);
    let (rq, rk) = rstd.split_at(n * hq);
    let (dwq, dwk) = dweight.split_at_mut(wq);
    head_rmsnorm_backward(dqkv, dwq, pq, &weight[..wq], rq, (w, 0, hq));
    head_rmsnorm_backward(dqkv, dwk, pk, &weight[wq..], rk, (w, nh * hs, hk));
}

/// How [`qk_rmsnorm_forward`] cuts its buffers: the fused row's width, the tokens, and for q
/// and for k the norm's width and the vectors normalised per token.
struct QkSplit {
    w: usize,
    n: usize,
    q_rows: (usize, usize),
    k_rows: (usize, usize),
}

impl QkSplit {
    fn of(weight: usize, pre: usize, (nh, nkv, hs): (usize, usize, usize)) -> QkSplit {
        let whole = weight == (nh + nkv) * hs && weight != 2 * hs;
        assert!(whole || weight == 2 * hs, "q/k norm weights of {weight} for {nh} + {nkv} heads of {hs}");
        let (q_rows, k_rows) = if whole { ((nh * hs, 1), (nkv * hs, 1)) } else { ((hs, nh), (hs, nkv)) };
        QkSplit { w: (nh + 2 * nkv) * hs, n: pre / ((nh + nkv) * hs), q_rows, k_rows }
    }
}

/// In every token's `[W]` row of `qkv`, the `heads` head vectors of width `HS = weight.len()`
/// starting at column `off` are RMS-normalised in place; their inputs are saved in `pre`
/// (`[N, heads·HS]`) and each head's `rstd` in `rstd` (`[N, heads]`).
fn head_rmsnorm_forward(
    qkv: &mut [f32],  // [N, W]
    pre: &mut [f32],  // [N, heads·HS]
    rstd: &mut [f32], // [N, heads]
    weight: &[f32],   // [HS]
    eps: f32,
    (w, off, heads): (usize, usize, usize), // the row width, the first head's column, the heads
) {
    let _p = crate::profile::scope("head_rmsnorm_forward");
    let hw = heads * weight.len();
    let n = qkv.len() / w;
    assert!(off + hw <= w && qkv.len() == n * w && pre.len() == n * hw && rstd.len() == n * heads);
    let rows = rows_per_block(w);
    qkv.par_chunks_mut(rows * w).zip(pre.par_chunks_mut(rows * hw)).zip(rstd.par_chunks_mut(rows * heads)).for_each(|((q, p), s)| {
        for ((row, p), s) in q.chunks_mut(w).zip(p.chunks_mut(hw)).zip(s.chunks_mut(heads)) {
            let seg = &mut row[off..off + hw];
            p.copy_from_slice(seg);
            rmsnorm_rows(seg, s, p, weight, eps);
        }
    });
}

/// Backward of [`head_rmsnorm_forward`]: the gradient with respect to the normalised heads in
/// `dqkv`'s columns `off..off + heads·HS` becomes, in place, the gradient with respect to their
/// inputs; the weight's gradient accumulates into `dweight`, summed in blocks of
/// [`crate::par::REDUCE_ROWS`] tokens in order (the same sums at any thread count).
fn head_rmsnorm_backward(
    dqkv: &mut [f32],    // [N, W]
    dweight: &mut [f32], // [HS]
    pre: &[f32],         // [N, heads·HS]
    weight: &[f32],      // [HS]
    rstd: &[f32],        // [N, heads]
    (w, off, heads): (usize, usize, usize), // as forward's
) {
    let _p = crate::profile::scope("head_rmsnorm_backward");
    let hs = weight.len();
    let hw = heads * hs;
    let n = dqkv.len() / w;
    assert!(off + hw <= w && dqkv.len() == n * w && pre.len() == n * hw && rstd.len() == n * heads && dweight.len() == hs);
    let rows = crate::par::REDUCE_ROWS;
    let mut partial = crate::par::pooled(n.div_ceil(rows) * hs);
    dqkv.par_chunks_mut(rows * w).zip(partial.par_chunks_mut(hs)).enumerate().for_each(|(bi, (block, pw))| {
        let mut d = crate::par::pooled(hw);
        for (k, row) in block.chunks_mut(w).enumerate() {
            let t = bi * rows + k;
            let seg = &mut row[off..off + hw];
            d.copy_from_slice(seg);
            seg.fill(0.0);
            rmsnorm_backward_rows(seg, pw, &d, &pre[t * hw..(t + 1) * hw], weight, &rstd[t * heads..(t + 1) * heads]);
        }
    });
    for p in partial.chunks(hs) {
        for (a, b) in dweight.iter_mut().zip(p) {
            *a += *b;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Rotary position embeddings, HF convention: for pair i < HS/2 of a head,
// (x_i, x_{i+HS/2}) ↦ (x_i·cos − x_{i+HS/2}·sin, x_{i+HS/2}·cos + x_i·sin), angle = pos·inv_freq_i.

/// RoPE's inverse frequencies `θ^(−2i/HS)`, `i < HS/2`, computed as HF's
/// `LlamaRotaryEmbedding` (default rope type) does in fp32:
/// `inv_freq = 1.0 / (θ ** (arange(0, HS, 2).float() / HS))` (the power evaluated in f64 and
/// rounded, so each entry is within an ulp of torch's). Rope scaling rescales these.
pub fn rope_inv_freq(theta: f32, hs: usize) -> Vec<f32> {
    rope_pos_freq(theta, hs).into_iter().map(|p| 1.0f32 / p).collect()
}

/// `θ^(2i/HS)`, `i < HS/2`, in fp32 (what [`rope_inv_freq`] inverts; YaRN also divides
/// `factor ×` these).
pub fn rope_pos_freq(theta: f32, hs: usize) -> Vec<f32> {
    assert!(hs.is_multiple_of(2), "rotary head size must be even");
    (0..hs / 2).map(|i| (theta as f64).powf(((2 * i) as f32 / hs as f32) as f64) as f32).collect()
}

/// Tables `(cos, sin)`, each `[max_t, HS/2]`: entry `(p, i)` is the cos / sin of
/// `p · inv_freq_i`, as HF computes them: `freqs = pos.float() · inv_freq` in fp32, then cos /
/// sin of that fp32 angle (evaluated in f64 and rounded). An f64 angle would be more "exact" but
/// would drift from HF by up to `pos · 2⁻²⁴` radians at long context.
pub fn rope_table_from(inv_freq: &[f32], max_t: usize) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let (mut cos, mut sin) = (vec![0.0f32; max_t * half], vec![0.0f32; max_t * half]);
    for p in 0..max_t {
        for (i, &f) in inv_freq.iter().enumerate() {
            let angle = (p as f32 * f) as f64;
            cos[p * half + i] = angle.cos() as f32;
            sin[p * half + i] = angle.sin() as f32;
        }
    }
    (cos, sin)
}

/// [`rope_table_from`] of the plain [`rope_inv_freq`]: entry `(p, i)` is the cos / sin of
/// `p · θ^(−2i/HS)`.
pub fn rope_table(theta: f32, hs: usize, max_t: usize) -> (Vec<f32>, Vec<f32>) {
    rope_table_from(&rope_inv_freq(theta, hs), max_t)
}

/// Rotates the q and k heads of every token of `qkv` in place, token `(b, t)` by position
/// `pos_offset + t` (`pos_offset > 0` when decoding with a KV cache). v is untouched. Reads
/// `B, T, NH, NKV, HS` of `dims` (not the dropout placement).
/// "Forward overwrites": the rotated values replace the inputs.
pub fn rope_forward(
    qkv: &mut [f32],   // [B, T, W]
    cos: &[f32],       // [maxT, HS/2]
    sin: &[f32],       // [maxT, HS/2]
    dims: &GqaDims,
    pos_offset: usize,
) {
    let _p = crate::profile::scope("rope_forward");
    rope_apply(qkv, cos, sin, dims, Positions::Offset(pos_offset), false);
}

/// [`rope_forward`] with explicit positions: token `(b, t)` rotated by position `pos[b·T + t]`
/// (packed documents whose positions restart, or any ids below the table's `maxT`). In place.
pub fn rope_forward_pos(
    qkv: &mut [f32],   // [B, T, W]
    cos: &[f32],       // [maxT, HS/2]
    sin: &[f32],       // [maxT, HS/2]
    dims: &GqaDims,
    pos: &[u32],       // [B, T]  position id of each token, < maxT
) {
    let _p = crate::profile::scope("rope_forward");
    rope_apply(qkv, cos, sin, dims, Positions::Ids(pos), false);
}

/// Backward of [`rope_forward`], in place: `dqkv` holds the gradient with respect to the
/// *rotated* q and k (and v) and is replaced by the gradient with respect to the unrotated
/// ones — the inverse (transposed) rotation, since the map is linear and orthogonal. Not an
/// accumulation: call it on the finished `dqkv` of attention's backward, before the qkv matmul's.
pub fn rope_backward(
    dqkv: &mut [f32],  // [B, T, W]
    cos: &[f32],       // [maxT, HS/2]
    sin: &[f32],       // [maxT, HS/2]
    dims: &GqaDims,
    pos_offset: usize,
) {
    let _p = crate::profile::scope("rope_backward");
    rope_apply(dqkv, cos, sin, dims, Positions::Offset(pos_offset), true);
}

/// Backward of [`rope_forward_pos`] (the same `pos`), in place as [`rope_backward`].
pub fn rope_backward_pos(
    dqkv: &mut [f32],  // [B, T, W]
    cos: &[f32],       // [maxT, HS/2]
    sin: &[f32],       // [maxT, HS/2]
    dims: &GqaDims,
    pos: &[u32],       // [B, T]
) {
    let _p = crate::profile::scope("rope_backward");
    rope_apply(dqkv, cos, sin, dims, Positions::Ids(pos), true);
}

/// Where each token's rotation angle comes from.
#[derive(Clone, Copy)]
enum Positions<'a> {
    /// Token `(b, t)` at `offset + t`.
    Offset(usize),
    /// Token `(b, t)` at `ids[b·T + t]`.
    Ids(&'a [u32]),
}

fn rope_apply(
    x: &mut [f32],     // [B, T, W]
    cos: &[f32],       // [maxT, HS/2]
    sin: &[f32],       // [maxT, HS/2]
    dims: &GqaDims,
    positions: Positions,
    inverse: bool,
) {
    let GqaDims { b, t, nh, nkv, hs, rotary, .. } = *dims;
    let rot = if rotary == 0 { hs } else { rotary };
    assert!(rot.is_multiple_of(2) && rot <= hs, "rotary dimensions must be even and at most the head size");
    let half = rot / 2;
    let w = (nh + 2 * nkv) * hs;
    assert_eq!(x.len(), b * t * w);
    assert_eq!(cos.len(), sin.len());
    match positions {
        Positions::Offset(off) => assert!((off + t) * half <= cos.len(), "rope table shorter than pos_offset + T"),
        Positions::Ids(ids) => {
            assert_eq!(ids.len(), b * t, "rope positions must be [B, T]");
            let max_t = cos.len() / half.max(1);
            assert!(ids.iter().all(|&p| (p as usize) < max_t), "a rope position is not below the table's {max_t} rows");
        }
    }
    // Rows of about ELEMS/4 floats per task: a row alone is too little work to schedule.
    let rows_per_task = (ELEMS / 4 / w.max(1)).max(1);
    x.par_chunks_mut(w * rows_per_task).enumerate().for_each(|(ci, rows)| {
        for (k, row) in rows.chunks_mut(w).enumerate() {
            let r = ci * rows_per_task + k;
            let pos = match positions {
                Positions::Offset(off) => off + r % t,
                Positions::Ids(ids) => ids[r] as usize,
            };
            let (c, s) = (&cos[pos * half..(pos + 1) * half], &sin[pos * half..(pos + 1) * half]);
            // q and k heads are contiguous: the first NH + NKV heads of the row.
            rope_row(&mut row[..(nh + nkv) * hs], c, s, hs, rot, inverse);
        }
    });
}

crate::multiversion! {
    /// Each `hs`-wide head's first `rot` dimensions turned (HF's partial rotary: `q[..., :rot]`,
    /// the rest passed through).
    fn rope_row(x: &mut [f32], c: &[f32], s: &[f32], hs: usize, rot: usize, inverse: bool) {
        let half = rot / 2;
        for head in x.chunks_exact_mut(hs) {
            let (x1, x2) = head[..rot].split_at_mut(half);
            if inverse {
                for i in 0..half {
                    let (a, b) = (x1[i], x2[i]);
                    x1[i] = a * c[i] + b * s[i];
                    x2[i] = b * c[i] - a * s[i];
                }
            } else {
                // HF: x·cos + rotate_half(x)·sin, rotate_half(x) = (−x2, x1).
                for i in 0..half {
                    let (a, b) = (x1[i], x2[i]);
                    x1[i] = a * c[i] - b * s[i];
                    x2[i] = b * c[i] + a * s[i];
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// SiLU: silu(x) = x·σ(x), elementwise (SwiGLU's gate activation, alone).

/// `out = inp·σ(inp)`. Overwrites `out`.
pub fn silu_forward(out: &mut [f32], inp: &[f32]) {
    let _p = crate::profile::scope("silu_forward");
    assert_eq!(out.len(), inp.len());
    out.par_chunks_mut(ELEMS).zip(inp.par_chunks(ELEMS)).for_each(|(o, x)| {
        for (o, &x) in o.iter_mut().zip(x) {
            *o = x / (1.0 + (-x).exp());
        }
    });
}

/// Backward of [`silu_forward`]: `dinp += dout·σ(x)·(1 + x·(1 − σ(x)))`.
pub fn silu_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32]) {
    let _p = crate::profile::scope("silu_backward");
    assert!(dinp.len() == inp.len() && dout.len() == inp.len());
    dinp.par_chunks_mut(ELEMS).zip(inp.par_chunks(ELEMS).zip(dout.par_chunks(ELEMS))).for_each(|(di, (x, d))| {
        for ((di, &x), &d) in di.iter_mut().zip(x).zip(d) {
            let s = 1.0 / (1.0 + (-x).exp());
            *di += d * s * (1.0 + x * (1.0 - s));
        }
    });
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: h = silu(gate) ⊙ up, silu(x) = x·sigmoid(x), over a fused [gate | up] buffer.

/// `out[n, j] = silu(gu[n, j]) · gu[n, F + j]`. Overwrites `out`.
pub fn swiglu_forward(
    out: &mut [f32],   // [N, F]
    gu: &[f32],        // [N, 2F]  gate in columns 0..F, up in F..2F
    f: usize,
) {
    let _p = crate::profile::scope("swiglu_forward");
    assert!(f > 0);
    assert_eq!(gu.len(), 2 * out.len());
    let rows = (ELEMS / f.max(1)).max(1);
    out.par_chunks_mut(f * rows).zip(gu.par_chunks(2 * f * rows)).for_each(|(o, g)| {
        for (o, g) in o.chunks_mut(f).zip(g.chunks(2 * f)) {
            swiglu_row(o, &g[..f], &g[f..]);
        }
    });
}

crate::multiversion! {
    fn swiglu_row(o: &mut [f32], g: &[f32], u: &[f32]) {
        simd::exp_blocks(g, |x| -x, |i0, len, g, e| {
            let (o, u) = (&mut o[i0..i0 + len], &u[i0..i0 + len]);
            for l in 0..len {
                o[l] = g[l] / (1.0 + e[l]) * u[l];
            }
        });
    }
}

/// Backward of [`swiglu_forward`]. Accumulates into `dgu`:
/// `dgate += dout·up·σ(g)·(1 + g·(1 − σ(g)))`, `dup += dout·silu(g)`.
pub fn swiglu_backward(
    dgu: &mut [f32],   // [N, 2F]
    dout: &[f32],      // [N, F]
    gu: &[f32],        // [N, 2F]
    f: usize,
) {
    swiglu_backward_with(dgu, dout, gu, f, true)
}

/// [`swiglu_backward`] overwriting `dgu`, for a caller that would zero it first.
pub fn swiglu_backward_into(dgu: &mut [f32], dout: &[f32], gu: &[f32], f: usize) {
    swiglu_backward_with(dgu, dout, gu, f, false)
}

fn swiglu_backward_with(dgu: &mut [f32], dout: &[f32], gu: &[f32], f: usize, accumulate: bool) {
    let _p = crate::profile::scope("swiglu_backward");
    assert!(f > 0);
    assert_eq!(gu.len(), 2 * dout.len());
    assert_eq!(dgu.len(), gu.len());
    let rows = (ELEMS / f.max(1)).max(1);
    dgu.par_chunks_mut(2 * f * rows)
        .zip(dout.par_chunks(f * rows).zip(gu.par_chunks(2 * f * rows)))
        .for_each(|(dg, (d, g))| {
            for (dg, (d, g)) in dg.chunks_mut(2 * f).zip(d.chunks(f).zip(g.chunks(2 * f))) {
                let (dgate, dup) = dg.split_at_mut(f);
                swiglu_backward_row(dgate, dup, d, &g[..f], &g[f..], accumulate);
            }
        });
}

crate::multiversion! {
    fn swiglu_backward_row(dgate: &mut [f32], dup: &mut [f32], d: &[f32], g: &[f32], u: &[f32], accumulate: bool) {
        simd::exp_blocks(g, |x| -x, |i0, len, g, e| {
            let (dgate, dup) = (&mut dgate[i0..i0 + len], &mut dup[i0..i0 + len]);
            let (d, u) = (&d[i0..i0 + len], &u[i0..i0 + len]);
            for l in 0..len {
                let (x, sig) = (g[l], 1.0 / (1.0 + e[l]));
                let (dg, du) = (d[l] * u[l] * sig * (1.0 + x * (1.0 - sig)), d[l] * x * sig);
                (dgate[l], dup[l]) = if accumulate { (dgate[l] + dg, dup[l] + du) } else { (dg, du) };
            }
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Grouped-query attention (materialised reference): query head h reads kv head h / (NH/NKV).

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GqaDims {
    pub b: usize,
    pub t: usize,
    pub nh: usize,
    pub nkv: usize,
    pub hs: usize,
    /// A tensor-parallel shard's first head in the whole model, and the whole model's head
    /// count (0 = `nh`: not a shard). Attention dropout masks are drawn by whole-model head, so a
    /// shard drops exactly what the whole model drops for its heads.
    pub head0: usize,
    pub heads: usize,
    /// The first sequence's index in the global batch (a data-parallel rank's share), for the
    /// dropout mask too.
    pub b0: usize,
    /// Sliding-window attention (Mistral): query `i` sees keys `i+1-window ..= i`; 0 = every
    /// earlier key (plain causal).
    pub window: usize,
    /// Attention sinks under a sliding window (StreamingLLM, Xiao et al. 2023): the first
    /// `sinks` positions of a query's document stay visible however far back they are; 0 = none.
    pub sinks: usize,
    /// Dimensions of each head the rotary embedding turns (the first `rotary`; a partial rotary
    /// factor below 1, as Phi-4-mini's 0.75); 0 = all `hs`.
    pub rotary: usize,
    /// The logits' scale when not `1/√HS` (Gemma's `query_pre_attn_scalar^-½`); 0 = `1/√HS`.
    pub scale: f32,
    /// Soft-capping of the scaled logits, `s ↦ cap·tanh(s / cap)` before the softmax (Gemma
    /// 2's `attn_logit_softcapping`); 0 = none. Only the flash kernels and decoding apply it.
    pub softcap: f32,
}

impl GqaDims {
    /// The factor `q·k` is scaled by: `scale`, or `1/√HS`.
    #[inline]
    pub fn logit_scale(&self) -> f32 {
        if self.scale > 0.0 { self.scale } else { 1.0 / (self.hs as f32).sqrt() }
    }

    /// The first key query `i` attends to: `i + 1 - window` under a sliding window, else 0.
    #[inline]
    pub fn first_key(&self, i: usize) -> usize {
        if self.window == 0 { 0 } else { (i + 1).saturating_sub(self.window) }
    }

    /// The end of the sink keys of query `i` whose document starts at `start`: it sees
    /// `start .. sink_end` besides its window (empty without sinks or without a window; never
    /// past the window's first key).
    #[inline]
    pub fn sink_end(&self, i: usize, start: usize) -> usize {
        if self.sinks == 0 || self.window == 0 { start } else { (start + self.sinks).min(self.first_key(i).max(start)) }
    }

    /// The whole-model, whole-batch `(batch, head)` index of this shard's `bh = b·NH + h`,
    /// which keys the dropout mask.
    pub fn mask_bh(&self, bh: usize) -> usize {
        let heads = if self.heads == 0 { self.nh } else { self.heads };
        (self.b0 + bh / self.nh) * heads + self.head0 + bh % self.nh
    }

    /// Query heads per kv head, `NH / NKV`.
    pub fn group(&self) -> usize {
        assert!(self.nkv > 0 && self.nh.is_multiple_of(self.nkv), "NH must be a multiple of NKV");
        self.nh / self.nkv
    }
    /// `C = NH·HS`, the width of the attention output.
    pub fn c(&self) -> usize {
        self.nh * self.hs
    }
    /// `W = (NH + 2·NKV)·HS`, the width of one token's qkv row.
    pub fn qkv_width(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hs
    }
    /// Column offsets within a qkv row of query head `h`, and of kv head `g`'s k and v.
    fn q_off(&self, h: usize) -> usize {
        h * self.hs
    }
    fn k_off(&self, g: usize) -> usize {
        (self.nh + g) * self.hs
    }
    fn v_off(&self, g: usize) -> usize {
        (self.nh + self.nkv + g) * self.hs
    }
}

/// `out[b,t,h·HS..] = Σ_j softmax_j(q_h·k_gᵀ/√HS, causal)·v_g` with `g = h / (NH/NKV)`, over
/// keys `j ≤ t` (and `j > t - window` under a sliding window; its backward needs nothing more,
/// since the probabilities outside are 0).
/// Overwrites `out` and `att`. One rayon task per (batch, head), gemm single-threaded inside.
pub fn gqa_attention_forward(
    out: &mut [f32],   // [B, T, C]        C = NH·HS
    att: &mut [f32],   // [B, NH, T, T]    softmax probabilities
    qkv: &[f32],       // [B, T, W]
    dims: &GqaDims,
) {
    gqa_attention_forward_docs(out, att, qkv, dims, &[]);
}

/// [`gqa_attention_forward`] over packed documents (see [`crate::flash`]): query `i` of row `b`
/// attends keys `max(first_key(i), start[b·T + i]) ..= i` only. [`gqa_attention_backward`] needs
/// nothing more (the probabilities outside are 0). An empty `starts` is
/// [`gqa_attention_forward`]. Overwrites `out` and `att`.
pub fn gqa_attention_forward_docs(
    out: &mut [f32],   // [B, T, C]
    att: &mut [f32],   // [B, NH, T, T]
    qkv: &[f32],       // [B, T, W]
    dims: &GqaDims,
    starts: &[u32],    // [B, T] or empty: each token's document start within its row
) {
    let _p = crate::profile::scope("gqa_attention_forward");
    crate::flash::check_starts(starts, dims.b, dims.t);
    let GqaDims { b, t, nh, hs, .. } = *dims;
    let (c, w, group) = (dims.c(), dims.qkv_width(), dims.group());
    assert_eq!(out.len(), b * t * c);
    assert_eq!(att.len(), b * nh * t * t);
    assert_eq!(qkv.len(), b * t * w);
    let scale = dims.logit_scale();
    let outp = SyncPtr(out.as_mut_ptr());
    att.par_chunks_mut(t * t).enumerate().for_each(|(bh, a)| {
        #[allow(clippy::redundant_locals)] // capture the whole (Send) SyncPtr, not its field
        let outp = outp;
        let (bi, h) = (bh / nh, bh % nh);
        let g = h / group;
        let base = bi * t * w;
        let q = View { data: qkv, off: base + dims.q_off(h), rows: t, cols: hs, rs: w, cs: 1 };
        let k = View { off: base + dims.k_off(g), ..q };
        let v = View { off: base + dims.v_off(g), ..q };
        // S = q·kᵀ·scale   [T, T]
        unsafe { gemm_raw((a.as_mut_ptr(), t), false, q, k.t(), scale, Threads::One) };
        let starts = if starts.is_empty() { &[][..] } else { &starts[bi * t..(bi + 1) * t] };
        for i in 0..t {
            let start = starts.get(i).map_or(0, |&s| s as usize);
            let lo = dims.first_key(i).max(start);
            let row = &mut a[i * t..(i + 1) * t];
            // Sinks: keys start..sink_end stay, as scores shifted out of the way of the
            // window's softmax and shifted back (the reference materialises the mask).
            let sink = start..dims.sink_end(i, start);
            if sink.is_empty() {
                causal_softmax_row(row, lo, i);
            } else {
                masked_softmax_row(row, &[sink, lo..i + 1]);
            }
        }
        // Safety: task (bi, h) writes only rows of batch bi, columns h·HS..(h+1)·HS of `out`.
        let dst = unsafe { outp.0.add(bi * t * c + h * hs) };
        unsafe { gemm_raw((dst, c), false, View::rows(a, t, t), v, 1.0, Threads::One) };
    });
}

crate::multiversion! {
    /// Softmax over `row[lo..=i]`; the rest (the future, and keys before a sliding window) is
    /// set to 0.
    fn causal_softmax_row(row: &mut [f32], lo: usize, i: usize) {
        let (live, future) = row.split_at_mut(i + 1);
        let (before, live) = live.split_at_mut(lo);
        before.fill(0.0);
        let max = live.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        for x in live.iter_mut() {
            *x = simd::exp(*x - max);
        }
        let inv = 1.0 / simd::sum_by([live], |[v]| v);
        for x in live.iter_mut() {
            *x *= inv;
        }
        future.fill(0.0);
    }
}

/// Softmax over the keys in `ranges` of `row`; every other entry is set to 0.
fn masked_softmax_row(row: &mut [f32], ranges: &[std::ops::Range<usize>]) {
    let keep = |j: usize| ranges.iter().any(|r| r.contains(&j));
    let max = (0..row.len()).filter(|&j| keep(j)).fold(f32::NEG_INFINITY, |m, j| m.max(row[j]));
    let mut sum = 0.0;
    for (j, x) in row.iter_mut().enumerate() {
        *x = if keep(j) { (*x - max).exp() } else { 0.0 };
        sum += *x;
    }
    row.iter_mut().for_each(|x| *x /= sum);
}

crate::multiversion! {
    /// Softmax backward on one causal row: `ds = p ∘ (dp − Σ_j p·dp)` in place of `dp`.
    fn causal_softmax_backward_row(ds: &mut [f32], p: &[f32], i: usize) {
        let (live, future) = ds.split_at_mut(i + 1);
        let dot = simd::sum_by([&p[..live.len()], live], |[p, v]| p * v);
        for (d, &p) in live.iter_mut().zip(p) {
            *d = p * (*d - dot);
        }
        future.fill(0.0);
    }
}

/// Backward of [`gqa_attention_forward`]. Accumulates into `dqkv`. One rayon task per
/// (batch, kv head): it walks the group's query heads in ascending order, so each kv head's
/// `dk`, `dv` sum over its heads in a fixed order and no two tasks write the same element.
pub fn gqa_attention_backward(
    dqkv: &mut [f32],  // [B, T, W]
    dout: &[f32],      // [B, T, C]
    qkv: &[f32],       // [B, T, W]
    att: &[f32],       // [B, NH, T, T]
    dims: &GqaDims,
) {
    let _p = crate::profile::scope("gqa_attention_backward");
    let GqaDims { b, t, nh, nkv, hs, .. } = *dims;
    let (c, w, group) = (dims.c(), dims.qkv_width(), dims.group());
    assert_eq!(dqkv.len(), b * t * w);
    assert_eq!(qkv.len(), b * t * w);
    assert_eq!(dout.len(), b * t * c);
    assert_eq!(att.len(), b * nh * t * t);
    let scale = dims.logit_scale();
    let dp = SyncPtr(dqkv.as_mut_ptr());
    (0..b * nkv).into_par_iter().for_each(|bg| {
        #[allow(clippy::redundant_locals)] // capture the whole (Send) SyncPtr, not its field
        let dp = dp;
        let (bi, g) = (bg / nkv, bg % nkv);
        let base = bi * t * w;
        let kv = View { data: qkv, off: base + dims.k_off(g), rows: t, cols: hs, rs: w, cs: 1 };
        let (k, v) = (kv, View { off: base + dims.v_off(g), ..kv });
        // Safety: task (bi, g) writes only rows of batch bi, in the k and v columns of kv
        // head g and the q columns of heads g·group..(g+1)·group.
        let (dk, dv) = unsafe { (dp.0.add(base + dims.k_off(g)), dp.0.add(base + dims.v_off(g))) };
        let mut ds = vec![0.0f32; t * t];
        for h in g * group..(g + 1) * group {
            let p = &att[(bi * nh + h) * t * t..(bi * nh + h + 1) * t * t];
            let q = View { off: base + dims.q_off(h), ..kv };
            let d_o = View { data: dout, off: bi * t * c + h * hs, rows: t, cols: hs, rs: c, cs: 1 };
            let dq = unsafe { dp.0.add(base + dims.q_off(h)) };
            // dv += pᵀ · dout
            unsafe { gemm_raw((dv, w), true, View::rows(p, t, t).t(), d_o, 1.0, Threads::One) };
            // dp = dout · vᵀ   [T, T], then the softmax backward in place
            unsafe { gemm_raw((ds.as_mut_ptr(), t), false, d_o, v.t(), 1.0, Threads::One) };
            for i in 0..t {
                causal_softmax_backward_row(&mut ds[i * t..(i + 1) * t], &p[i * t..(i + 1) * t], i);
            }
            let dsv = View::rows(&ds, t, t);
            // dq += ds · k · scale ; dk += dsᵀ · q · scale
            unsafe { gemm_raw((dq, w), true, dsv, k, scale, Threads::One) };
            unsafe { gemm_raw((dk, w), true, dsv.t(), q, scale, Threads::One) };
        }
    });
}
