//! Elementwise and row-wise kernels: embedding, LayerNorm, GELU, residual, dropout, softmax
//! cross-entropy. Forward overwrites, backward accumulates (see the crate docs).

use crate::par::{row_blocks_reduce, rows_per_block, ELEMS};
use crate::rng::hash_uniform;
use crate::simd;
use rayon::prelude::*;

// ---------------------------------------------------------------------------------------------
// Token + position embedding

/// `out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]` (wpe optional: rotary models have none).
pub fn embedding_forward(
    out: &mut [f32],        // [B, T, C]
    tokens: &[u32],         // [B, T]
    wte: &[f32],            // [Vp, C]
    wpe: Option<&[f32]>,    // [maxT, C]
    t: usize,
    c: usize,
) {
    let vp = wte.len() / c;
    assert!(tokens.iter().all(|&x| (x as usize) < vp), "token outside the vocabulary of {vp}");
    embedding_forward_rows(out, tokens, (wte, wpe), None, t, c, 0..vp);
}

/// Backward of [`embedding_forward`]. Accumulates into `dwte` and `dwpe`.
/// `dwte` rows are scattered in token order (one sequential pass, deterministic); `dwpe` is
/// parallel over positions.
pub fn embedding_backward(
    dwte: &mut [f32],            // [Vp, C]
    dwpe: Option<&mut [f32]>,    // [maxT, C]
    dout: &[f32],                // [B, T, C]
    tokens: &[u32],              // [B, T]
    t: usize,
    c: usize,
) {
    let vp = dwte.len() / c;
    assert!(tokens.iter().all(|&x| (x as usize) < vp), "token outside the vocabulary of {vp}");
    embedding_backward_rows((dwte, dwpe), dout, tokens, None, t, c, 0..vp);
}

/// `dwpe[p] += Σ dout[i]` over the tokens `i` at position `p` (`pos[i]`, or `i mod T`: then
/// `Σ_b dout[b, p]`), parallel over positions, each position's sum in ascending token order
/// (batch order), so the result depends neither on the thread count nor on `pos` being given
/// when it equals `i mod T`.
fn position_backward(dwpe: &mut [f32], dout: &[f32], pos: Option<&[u32]>, t: usize, c: usize) {
    let add = |w: &mut [f32], i: usize| {
        for (w, d) in w.iter_mut().zip(&dout[i * c..(i + 1) * c]) {
            *w += d;
        }
    };
    let n = dout.len() / c;
    let Some(pos) = pos else {
        dwpe[..t * c].par_chunks_mut(c).enumerate().for_each(|(p, w)| (p..n).step_by(t).for_each(|i| add(w, i)));
        return;
    };
    // The tokens grouped by position, ascending within each group (a counting sort).
    let max_t = dwpe.len() / c;
    let mut first = vec![0usize; max_t + 1];
    for &p in pos {
        first[p as usize + 1] += 1;
    }
    for k in 0..max_t {
        first[k + 1] += first[k];
    }
    let (mut next, mut order) = (first.clone(), vec![0usize; n]);
    for (i, &p) in pos.iter().enumerate() {
        order[next[p as usize]] = i;
        next[p as usize] += 1;
    }
    dwpe.par_chunks_mut(c).enumerate().for_each(|(p, w)| order[first[p]..first[p + 1]].iter().for_each(|&i| add(w, i)));
}

/// Explicit positions are one per token and index the positions table.
fn check_positions(pos: Option<&[u32]>, n: usize, wpe_rows: usize) {
    if let Some(pos) = pos {
        assert_eq!(pos.len(), n, "positions must be [B, T]");
        assert!(pos.iter().all(|&p| (p as usize) < wpe_rows), "a position is not below the positions table's {wpe_rows} rows");
    }
}

/// [`embedding_forward`] with the vocabulary split over ranks (Megatron-LM's vocab-parallel
/// embedding): `wte` holds rows `rows.start .. rows.end` of the whole table. A token in the
/// range gets its embedding (plus the position's); any other token gets 0 — another rank
/// writes it — so the sum over ranks is the whole embedding, exactly (adding zeros).
/// Token `i` of the flat `[B, T]` takes position `pos[i]` when given (packed documents whose
/// positions restart), else `i mod T`: `out[i] = wte[tokens[i]] + wpe[pos[i]]`.
// Eight arguments: embedding_forward's six, the vocabulary rows and the optional positions.
pub fn embedding_forward_rows(
    out: &mut [f32],          // [B, T, C]
    tokens: &[u32],           // [B, T]
    (wte, wpe): (&[f32], Option<&[f32]>), // the tables: [rows, C], [maxT, C]
    pos: Option<&[u32]>,      // [B, T]  each token's position (< maxT); None: i mod T
    t: usize,
    c: usize,
    rows: std::ops::Range<usize>,
) {
    let _p = crate::profile::scope("embedding_forward");
    assert_eq!(out.len(), tokens.len() * c);
    assert_eq!(wte.len(), rows.len() * c);
    if let Some(p) = wpe {
        check_positions(pos, tokens.len(), p.len() / c);
    }
    out.par_chunks_mut(c).enumerate().for_each(|(i, o)| {
        let tok = tokens[i] as usize;
        if !rows.contains(&tok) {
            o.fill(0.0);
            return;
        }
        let e = &wte[(tok - rows.start) * c..(tok - rows.start + 1) * c];
        match wpe {
            Some(p) => {
                let pos = pos.map_or(i % t, |p| p[i] as usize);
                for ((o, e), p) in o.iter_mut().zip(e).zip(&p[pos * c..(pos + 1) * c]) {
                    *o = e + p;
                }
            }
            None => o.copy_from_slice(e),
        }
    });
}

/// Backward of [`embedding_forward_rows`] for this rank's rows: `dwte` (`[rows, C]`)
/// accumulates the gradients of the tokens in `rows`; `dwpe` every position's (the positions
/// table is replicated, and `dout` is the whole gradient on every rank), at positions `pos`
/// (or `i mod T`) as forward. Accumulates; deterministic (see `position_backward`).
pub fn embedding_backward_rows(
    (dwte, dwpe): (&mut [f32], Option<&mut [f32]>), // the tables' gradients: [rows, C], [maxT, C]
    dout: &[f32],                // [B, T, C]
    tokens: &[u32],              // [B, T]
    pos: Option<&[u32]>,         // [B, T]  as forward's
    t: usize,
    c: usize,
    rows: std::ops::Range<usize>,
) {
    let _p = crate::profile::scope("embedding_backward");
    for (i, &tok) in tokens.iter().enumerate() {
        let tok = tok as usize;
        if !rows.contains(&tok) {
            continue;
        }
        let d = &dout[i * c..(i + 1) * c];
        for (w, d) in dwte[(tok - rows.start) * c..(tok - rows.start + 1) * c].iter_mut().zip(d) {
            *w += d;
        }
    }
    if let Some(dwpe) = dwpe {
        check_positions(pos, tokens.len(), dwpe.len() / c);
        position_backward(dwpe, dout, pos, t, c);
    }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm

pub const LN_EPS: f32 = 1e-5;

/// `out = (inp - mean) · rstd · weight + bias` per row; saves `mean` and `rstd` for backward.
pub fn layernorm_forward(
    out: &mut [f32],       // [N, C]
    mean: &mut [f32],      // [N]
    rstd: &mut [f32],      // [N]
    inp: &[f32],           // [N, C]
    weight: &[f32],        // [C]
    bias: Option<&[f32]>,  // [C]
    c: usize,
) {
    let _p = crate::profile::scope("layernorm_forward");
    let rows = rows_per_block(c);
    out.par_chunks_mut(rows * c)
        .zip(mean.par_chunks_mut(rows).zip(rstd.par_chunks_mut(rows)))
        .enumerate()
        .for_each(|(bi, (o, (m, s)))| {
            let r0 = bi * rows;
            layernorm_rows(o, m, s, &inp[r0 * c..r0 * c + o.len()], weight, bias);
        });
}

crate::multiversion! {
    fn layernorm_rows(o: &mut [f32], m: &mut [f32], s: &mut [f32], x: &[f32], weight: &[f32], bias: Option<&[f32]>) {
        let c = weight.len();
        for (r, (m, s)) in m.iter_mut().zip(s.iter_mut()).enumerate() {
            layernorm_row(&mut o[r * c..(r + 1) * c], m, s, &x[r * c..(r + 1) * c], weight, bias);
        }
    }
}

#[inline(always)]
fn layernorm_row(o: &mut [f32], m: &mut f32, s: &mut f32, x: &[f32], weight: &[f32], bias: Option<&[f32]>) {
    let c = x.len();
    let mu = simd::sum_by([x], |[x]| x) / c as f32;
    let var = simd::sum_by([x], |[x]| (x - mu) * (x - mu)) / c as f32;
    let rs = 1.0 / (var + LN_EPS).sqrt();
    match bias {
        Some(b) => {
            for j in 0..c {
                o[j] = (x[j] - mu) * rs * weight[j] + b[j];
            }
        }
        None => {
            for j in 0..c {
                o[j] = (x[j] - mu) * rs * weight[j];
            }
        }
    }
    *m = mu;
    *s = rs;
}

/// Backward of [`layernorm_forward`]. Accumulates into `dinp`, `dweight`, `dbias`.
// Nine arguments, kept: llm.c's `layernorm_backward` signature, the example the kernel
// conventions are written from.
pub fn layernorm_backward(
    (dinp, dweight, dbias): (&mut [f32], &mut [f32], Option<&mut [f32]>), // [N, C], [C], [C]
    dout: &[f32],                // [N, C]
    inp: &[f32],                 // [N, C]
    weight: &[f32],              // [C]
    (mean, rstd): (&[f32], &[f32]), // [N], [N]
    c: usize,
) {
    let _p = crate::profile::scope("layernorm_backward");
    assert_eq!(dinp.len(), mean.len() * c);
    // One pass per block of rows: the input gradients, and the weight (and bias) gradient's
    // partial sums.
    let mut acc: Vec<&mut [f32]> = std::iter::once(dweight).chain(dbias).collect();
    row_blocks_reduce(dinp, c, &mut acc, |r0, di, part| {
        let r1 = r0 + di.len() / c;
        let (pw, pb) = part.split_at_mut(c);
        layernorm_backward_rows((di, pw, pb), &dout[r0 * c..r1 * c], &inp[r0 * c..r1 * c], weight, (&mean[r0..r1], &rstd[r0..r1]));
    });
}

crate::multiversion! {
    /// Rows `mean.len()` of the layer norm's backward: `di += …`, and the rows' weight gradient
    /// `Σ_r norm·d` into `pw` and bias gradient `Σ_r d` into `pb` (when not empty), rows in
    /// order.
    fn layernorm_backward_rows(grads: (&mut [f32], &mut [f32], &mut [f32]), d: &[f32], x: &[f32], weight: &[f32], stats: (&[f32], &[f32])) {
        let ((di, pw, pb), (mean, rstd)) = (grads, stats);
        let c = weight.len();
        for (r, (&mu, &rs)) in mean.iter().zip(rstd).enumerate() {
            let (d, x, di) = (&d[r * c..(r + 1) * c], &x[r * c..(r + 1) * c], &mut di[r * c..(r + 1) * c]);
            let dnorm_mean = simd::sum_by([weight, d], |[w, d]| w * d) / c as f32;
            let dnorm_norm_mean = simd::sum_by([weight, d, x], |[w, d, x]| w * d * (x - mu) * rs) / c as f32;
            for j in 0..c {
                let norm = (x[j] - mu) * rs;
                di[j] += (weight[j] * d[j] - dnorm_mean - norm * dnorm_norm_mean) * rs;
            }
            for j in 0..c {
                pw[j] += (x[j] - mu) * rs * d[j];
            }
            for (a, d) in pb.iter_mut().zip(d) {
                *a += d;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// GELU, tanh approximation (GPT-2): 0.5·x·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³),
// computed as x·σ(2u) = x / (1 + e^{−2u}) (1 + tanh u = 2σ(2u)): one exp and one division, and
// no cancellation in 1 + tanh u where u ≪ 0.

const GELU_K: f32 = 0.797_884_6; // √(2/π)

pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    let _p = crate::profile::scope("gelu_forward");
    assert_eq!(out.len(), inp.len());
    out.par_chunks_mut(ELEMS).zip(inp.par_chunks(ELEMS)).for_each(|(o, x)| gelu_forward_chunk(o, x));
}

crate::multiversion! {
    fn gelu_forward_chunk(o: &mut [f32], x: &[f32]) {
        simd::exp_blocks(x, gelu_exp_arg, |i0, len, x, e| {
            let o = &mut o[i0..i0 + len];
            for l in 0..len {
                o[l] = x[l] / (1.0 + e[l]);
            }
        });
    }
}

/// −2u, GELU's argument of `exp`: u = √(2/π)·(x + 0.044715·x³).
#[inline(always)]
fn gelu_exp_arg(x: f32) -> f32 {
    // −2K·x·(1 + 0.044715·x²), the constants folded: three operations.
    x * (x * x).mul_add(-2.0 * GELU_K * 0.044715, -2.0 * GELU_K)
}

/// `dinp += GELU'(inp) ⊙ dout` (accumulates into `dinp`). Outputs, then the output gradient,
/// then the forward's input, as every backward kernel.
pub fn gelu_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32]) {
    gelu_backward_with(dinp, dout, inp, true)
}

/// [`gelu_backward`] overwriting `dinp` (`dinp = GELU'(inp) ⊙ dout`), for a caller that would
/// zero it first: no zero fill, no read of `dinp`.
pub fn gelu_backward_into(dinp: &mut [f32], dout: &[f32], inp: &[f32]) {
    gelu_backward_with(dinp, dout, inp, false)
}

fn gelu_backward_with(dinp: &mut [f32], dout: &[f32], inp: &[f32], accumulate: bool) {
    let _p = crate::profile::scope("gelu_backward");
    assert!(dinp.len() == inp.len() && dout.len() == inp.len());
    dinp.par_chunks_mut(ELEMS)
        .zip(inp.par_chunks(ELEMS).zip(dout.par_chunks(ELEMS)))
        .for_each(|(di, (x, d))| gelu_backward_chunk(di, x, d, accumulate));
}

crate::multiversion! {
    fn gelu_backward_chunk(di: &mut [f32], x: &[f32], d: &[f32], accumulate: bool) {
        simd::exp_blocks(x, gelu_exp_arg, |i0, len, x, e| {
            let (di, d) = (&mut di[i0..i0 + len], &d[i0..i0 + len]);
            for l in 0..len {
                // With s = σ(2u): GELU' = s + 2x·s(1−s)·du/dx (as 0.5(1 + tanh u) + 0.5x·sech²u·du/dx).
                // du/dx·2 = 2K·(1 + 3·0.044715·x²), the constants folded.
                let (x, s) = (x[l], 1.0 / (1.0 + e[l]));
                let du2 = (x * x).mul_add(2.0 * GELU_K * 3.0 * 0.044715, 2.0 * GELU_K);
                let g = (x * (s - s * s)).mul_add(du2, s) * d[l];
                di[l] = if accumulate { di[l] + g } else { g };
            }
        });
    }
}

// ---------------------------------------------------------------------------------------------
// GeGLU (Gemma's gated MLP): out = GELU(gate) ⊙ up, GELU the tanh approximation above.

/// `out[N, F] = GELU(gate) ⊙ up` from `gu[N, 2F]` (gate in columns `0..F`, up in `F..2F`), as
/// transformers' `act_fn(gate_proj(x)) * up_proj(x)` with `gelu_pytorch_tanh`.
pub fn geglu_forward(out: &mut [f32], gu: &[f32], f: usize) {
    let _p = crate::profile::scope("geglu_forward");
    assert!(f > 0 && gu.len() == 2 * out.len());
    let rows = (ELEMS / f).max(1);
    out.par_chunks_mut(f * rows).zip(gu.par_chunks(2 * f * rows)).for_each(|(o, g)| {
        for (o, g) in o.chunks_mut(f).zip(g.chunks(2 * f)) {
            geglu_row(o, &g[..f], &g[f..]);
        }
    });
}

crate::multiversion! {
    fn geglu_row(o: &mut [f32], g: &[f32], u: &[f32]) {
        simd::exp_blocks(g, gelu_exp_arg, |i0, len, g, e| {
            let (o, u) = (&mut o[i0..i0 + len], &u[i0..i0 + len]);
            for l in 0..len {
                o[l] = g[l] / (1.0 + e[l]) * u[l];
            }
        });
    }
}

/// Backward of [`geglu_forward`], overwriting `dgu[N, 2F]`: `dgate = dout·up·GELU'(gate)`,
/// `dup = dout·GELU(gate)`.
pub fn geglu_backward_into(dgu: &mut [f32], dout: &[f32], gu: &[f32], f: usize) {
    let _p = crate::profile::scope("geglu_backward");
    assert!(f > 0 && gu.len() == 2 * dout.len() && dgu.len() == gu.len());
    let rows = (ELEMS / f).max(1);
    dgu.par_chunks_mut(2 * f * rows).zip(dout.par_chunks(f * rows).zip(gu.par_chunks(2 * f * rows))).for_each(|(dg, (d, g))| {
        for (dg, (d, g)) in dg.chunks_mut(2 * f).zip(d.chunks(f).zip(g.chunks(2 * f))) {
            let (dgate, dup) = dg.split_at_mut(f);
            geglu_backward_row(dgate, dup, d, &g[..f], &g[f..]);
        }
    });
}

crate::multiversion! {
    fn geglu_backward_row(dgate: &mut [f32], dup: &mut [f32], d: &[f32], g: &[f32], u: &[f32]) {
        simd::exp_blocks(g, gelu_exp_arg, |i0, len, g, e| {
            let (dgate, dup) = (&mut dgate[i0..i0 + len], &mut dup[i0..i0 + len]);
            let (d, u) = (&d[i0..i0 + len], &u[i0..i0 + len]);
            for l in 0..len {
                // As gelu_backward_chunk: GELU' = s + 2x·s(1−s)·du/dx with s = σ(2u).
                let (x, s) = (g[l], 1.0 / (1.0 + e[l]));
                let du2 = (x * x).mul_add(2.0 * GELU_K * 3.0 * 0.044715, 2.0 * GELU_K);
                dgate[l] = (x * (s - s * s)).mul_add(du2, s) * d[l] * u[l];
                dup[l] = x * s * d[l];
            }
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Residual

/// `out = a + b`.
pub fn residual_forward(out: &mut [f32], a: &[f32], b: &[f32]) {
    let _p = crate::profile::scope("residual_forward");
    out.par_chunks_mut(ELEMS)
        .zip(a.par_chunks(ELEMS).zip(b.par_chunks(ELEMS)))
        .for_each(|(o, (a, b))| {
            for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        });
}

/// Accumulates `dout` into both `da` and `db`.
pub fn residual_backward(da: &mut [f32], db: &mut [f32], dout: &[f32]) {
    add_into(da, dout);
    add_into(db, dout);
}

/// `acc += x`.
pub fn add_into(acc: &mut [f32], x: &[f32]) {
    assert_eq!(acc.len(), x.len());
    acc.par_chunks_mut(ELEMS).zip(x.par_chunks(ELEMS)).for_each(|(a, x)| {
        for (a, x) in a.iter_mut().zip(x) {
            *a += x;
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Dropout (inverted, counter-based mask: element i is kept iff hash(seed, i) ≥ p)

#[inline]
pub fn dropout_keep(seed: u64, index: u64, p: f32) -> bool {
    hash_uniform(seed, index) >= p
}

/// `out[i] = keep(i) ? inp[i] / (1 - p) : 0`. With `p == 0` this is a copy.
pub fn dropout_forward(out: &mut [f32], inp: &[f32], p: f32, seed: u64) {
    let _p = crate::profile::scope("dropout_forward");
    assert!((0.0..1.0).contains(&p), "dropout p must be in [0, 1)");
    let scale = 1.0 / (1.0 - p);
    out.par_chunks_mut(ELEMS).zip(inp.par_chunks(ELEMS)).enumerate().for_each(|(ci, (o, x))| {
        let base = (ci * ELEMS) as u64;
        for (j, (o, x)) in o.iter_mut().zip(x).enumerate() {
            *o = if p == 0.0 || dropout_keep(seed, base + j as u64, p) { x * scale } else { 0.0 };
        }
    });
}

/// Where a buffer's rows sit in the whole `[B, T, ·]` tensor: local row `b·t_local + j` is
/// global row `b·t + at(offset + j)` (a sequence-parallel shard holds positions
/// `offset .. offset + t_local` of every sequence; the whole tensor has `t_local = t`), where
/// `at` is the identity, or under context parallelism the part's positions ([`Chunks`]).
/// Dropout masks are drawn by global element index, so a shard drops exactly what the whole
/// model does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowMap {
    pub t_local: usize,
    pub t: usize,
    pub offset: usize,
    /// The first sequence's index in the global batch (a data-parallel rank's share).
    pub b0: usize,
    /// A context-parallel part's positions (`None`: position `i` is `i`).
    pub chunks: Option<Chunks>,
}

/// A context-parallel part's positions of a sequence: index `i < len` is position `first + i`,
/// a later one `second + i − len` (one contiguous chunk never reaches the second).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunks {
    pub len: usize,
    pub first: usize,
    pub second: usize,
}

impl Chunks {
    #[inline]
    pub fn at(&self, i: usize) -> usize {
        if i < self.len { self.first + i } else { self.second + i - self.len }
    }
}

impl RowMap {
    /// The whole tensor: every row is its own.
    pub fn whole(t: usize) -> RowMap {
        RowMap { t_local: t, t, offset: 0, b0: 0, chunks: None }
    }

    pub fn global(&self, row: usize) -> usize {
        let i = self.offset + row % self.t_local;
        (self.b0 + row / self.t_local) * self.t + self.chunks.map_or(i, |c| c.at(i))
    }
}

/// In-place dropout over rows of `c` elements laid out as `map` says: `x = keep ? x / (1 − p) : 0`
/// where element `(row, k)` uses the mask of global element `map.global(row)·c + k`. With
/// [`RowMap::whole`] this is [`dropout_forward`] in place (the same mask, so
/// [`dropout_backward`] applies too).
pub fn dropout_inplace_rows(x: &mut [f32], p: f32, seed: u64, c: usize, map: RowMap) {
    let _p = crate::profile::scope("dropout_inplace");
    assert!((0.0..1.0).contains(&p), "dropout p must be in [0, 1)");
    if p == 0.0 {
        return;
    }
    let scale = 1.0 / (1.0 - p);
    x.par_chunks_mut(c).enumerate().for_each(|(row, x)| {
        let base = (map.global(row) * c) as u64;
        for (j, x) in x.iter_mut().enumerate() {
            *x = if dropout_keep(seed, base + j as u64, p) { *x * scale } else { 0.0 };
        }
    });
}

/// Backward of [`dropout_inplace_rows`]: accumulates into `dinp`.
pub fn dropout_backward_rows(dinp: &mut [f32], dout: &[f32], p: f32, seed: u64, c: usize, map: RowMap) {
    let _p = crate::profile::scope("dropout_backward");
    let scale = 1.0 / (1.0 - p);
    dinp.par_chunks_mut(c).zip(dout.par_chunks(c)).enumerate().for_each(|(row, (di, d))| {
        let base = (map.global(row) * c) as u64;
        for (j, (di, d)) in di.iter_mut().zip(d).enumerate() {
            if p == 0.0 || dropout_keep(seed, base + j as u64, p) {
                *di += d * scale;
            }
        }
    });
}

/// Accumulates into `dinp`, regenerating the mask from `seed`.
pub fn dropout_backward(dinp: &mut [f32], dout: &[f32], p: f32, seed: u64) {
    let _p = crate::profile::scope("dropout_backward");
    let scale = 1.0 / (1.0 - p);
    dinp.par_chunks_mut(ELEMS).zip(dout.par_chunks(ELEMS)).enumerate().for_each(|(ci, (di, d))| {
        let base = (ci * ELEMS) as u64;
        for (j, (di, d)) in di.iter_mut().zip(d).enumerate() {
            if p == 0.0 || dropout_keep(seed, base + j as u64, p) {
                *di += d * scale;
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Softmax cross-entropy with ignore-index, over the first `V` of `Vp` padded logits.

/// Writes `probs = softmax(logits[:, :V])` (padded columns get 0) and `losses[i] = -ln p[target]`
/// (0 where `targets[i] == ignore_index`). Returns the number of counted (not ignored) rows.
pub fn crossentropy_forward(
    losses: &mut [f32],   // [N]
    probs: &mut [f32],    // [N, Vp]
    logits: &[f32],       // [N, Vp]
    targets: &[i32],      // [N]
    v: usize,
    vp: usize,
    ignore_index: i32,
) -> usize {
    let _p = crate::profile::scope("crossentropy_forward");
    softmax_forward(probs, logits, v, vp);
    losses.par_iter_mut().enumerate().for_each(|(i, l)| {
        let tgt = targets[i];
        *l = if tgt == ignore_index {
            0.0
        } else {
            assert!((tgt as usize) < v, "target {tgt} out of vocabulary {v}");
            -(probs[i * vp + tgt as usize].max(f32::MIN_POSITIVE)).ln()
        };
    });
    targets.iter().filter(|&&t| t != ignore_index).count()
}

/// Row softmax over the first `V` columns of `Vp`; padded columns get 0. Overwrites `probs`.
pub fn softmax_forward(probs: &mut [f32], logits: &[f32], v: usize, vp: usize) {
    probs.par_chunks_mut(vp).enumerate().for_each(|(i, p)| {
        let x = &logits[i * vp..i * vp + v];
        let max = x.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a));
        let mut sum = 0.0f32;
        for j in 0..v {
            let e = simd::exp(x[j] - max);
            p[j] = e;
            sum += e;
        }
        let inv = 1.0 / sum;
        for pj in p[..v].iter_mut() {
            *pj *= inv;
        }
        for pj in p[v..].iter_mut() {
            *pj = 0.0;
        }
    });
}

/// `dlogits[i] += dlosses[i] · (probs[i] - onehot(target))`, rows with `ignore_index` untouched.
/// `dloss` is the same for every row (1/count for a mean loss).
pub fn crossentropy_backward(
    dlogits: &mut [f32],  // [N, Vp]
    probs: &[f32],        // [N, Vp]
    targets: &[i32],      // [N]
    dloss: f32,
    v: usize,
    vp: usize,
    ignore_index: i32,
) {
    let _p = crate::profile::scope("crossentropy_backward");
    dlogits.par_chunks_mut(vp).enumerate().for_each(|(i, dl)| {
        let tgt = targets[i];
        if tgt == ignore_index {
            return;
        }
        let p = &probs[i * vp..(i + 1) * vp];
        for j in 0..v {
            dl[j] += dloss * p[j];
        }
        dl[tgt as usize] -= dloss;
    });
}
