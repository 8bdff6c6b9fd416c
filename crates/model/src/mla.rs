//! Multi-head latent attention (DeepSeek-V2/V3's MLA) as a front end to the ordinary attention
//! core: q comes from a normed low-rank latent (or one projection), keys and values are
//! up-projected per head from a normed key/value latent, and one rotary key is shared by every
//! head. The projections are laid out in kiln's fused `[q | k | v]` row of `NH` heads of `HS =
//! qk_nope + qk_rope` each (`NKV = NH`), so the flash kernels, RoPE, context parallelism and
//! decoding run unchanged:
//!
//! - each head's q and k put their rotary dimensions first (`[rope | nope]`: kiln's partial
//!   rotary turns a head's first `R` dimensions), in transformers' rotate-half pairing (an
//!   interleaved checkpoint's `(2i, 2i+1)` pairs reordered to `(i, i + R/2)`, which transformers
//!   does too before rotating);
//! - the shared rotary key is copied into every head's k, and backward sums the heads' gradients;
//! - each head's value is `V ≤ HS` wide, zero-padded to `HS` for the core; the output projection
//!   reads the first `V` of each head's output.
//!
//! Parameters keep transformers' names and row order, so import and export are by name.

use crate::layout::MlaParams;
use tensor::llama::{rmsnorm_backward, rmsnorm_forward};
use tensor::matmul::{matmul_backward_as, matmul_forward_as, Arith};

/// The epsilon of MLA's latent norms: transformers builds `q_a_layernorm` and `kv_a_layernorm`
/// with RMSNorm's default, not the config's `rms_norm_eps`.
pub(crate) const NORM_EPS: f32 = 1e-6;

/// MLA's shapes for `n` tokens.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MlaDims {
    pub n: usize,
    pub c: usize,
    pub nh: usize,
    /// q·k's head width `qk_nope + qk_rope`.
    pub hs: usize,
    /// the rotary dimensions `qk_rope`
    pub rot: usize,
    /// the value head width
    pub v: usize,
    /// q's latent width (0: one projection)
    pub qr: usize,
    /// the key/value latent width
    pub kvr: usize,
    pub interleave: bool,
}

impl MlaDims {
    pub fn of(cfg: &crate::GptConfig, n: usize) -> MlaDims {
        MlaDims {
            n, c: cfg.n_embd, nh: cfg.n_head, hs: cfg.head_size(), rot: cfg.rotary_dim, v: cfg.v_head_dim,
            qr: cfg.q_lora_rank, kvr: cfg.kv_lora_rank, interleave: cfg.rope_interleave,
        }
    }

    fn nope(&self) -> usize {
        self.hs - self.rot
    }

    /// One head's rows of `kv_b_proj`: its k without rotation, then its value.
    fn kvb_head(&self) -> usize {
        self.nope() + self.v
    }

    /// Transformers' position of kiln's rotary dimension `j` of a head.
    fn rope_src(&self, j: usize) -> usize {
        match self.interleave {
            false => j,
            true if j < self.rot / 2 => 2 * j,
            true => 2 * (j - self.rot / 2) + 1,
        }
    }
}

/// What backward reads of one block's MLA front end (empty buffers without MLA).
#[derive(Default)]
pub(crate) struct MlaActs {
    /// `[N, QR]` q's latent, and normed (empty without `q_lora_rank`), its `rstd` `[N]`
    cq: Vec<f32>,
    cqn: Vec<f32>,
    cq_rstd: Vec<f32>,
    /// `[N, KVR]` the key/value latent, and normed, its `rstd` `[N]`
    kvl: Vec<f32>,
    kvn: Vec<f32>,
    kv_rstd: Vec<f32>,
    /// `[N, NH·V]` the heads' values after attention: the output projection's input
    pub o_in: Vec<f32>,
}

impl MlaActs {
    pub fn new(d: Option<MlaDims>) -> MlaActs {
        let Some(d) = d else { return MlaActs::default() };
        let z = |k: usize| vec![0.0f32; k];
        MlaActs {
            cq: z(d.n * d.qr), cqn: z(d.n * d.qr), cq_rstd: z(if d.qr > 0 { d.n } else { 0 }),
            kvl: z(d.n * d.kvr), kvn: z(d.n * d.kvr), kv_rstd: z(d.n), o_in: z(d.n * d.nh * d.v),
        }
    }

    /// The bulk buffers (stored in the activation format) and the fp32 statistics.
    pub fn parts(&mut self) -> ([&mut Vec<f32>; 5], [&mut Vec<f32>; 2]) {
        ([&mut self.cq, &mut self.cqn, &mut self.kvl, &mut self.kvn, &mut self.o_in], [&mut self.cq_rstd, &mut self.kv_rstd])
    }

    /// The normed key/value latent `[N, KVR]` (what the compressed KV cache keeps).
    pub fn kvn(&self) -> &[f32] {
        &self.kvn
    }

    pub fn bytes(&self) -> usize {
        4 * [&self.cq, &self.cqn, &self.cq_rstd, &self.kvl, &self.kvn, &self.kv_rstd, &self.o_in].iter().map(|v| v.len()).sum::<usize>()
    }
}

/// Backward's MLA scratch (one set for all blocks; empty without MLA).
#[derive(Default)]
pub(crate) struct MlaGrads {
    dq: Vec<f32>,   // [N, NH·HS] q in transformers' order
    dkvb: Vec<f32>, // [N, NH·(nope + V)]
    dlat: Vec<f32>, // [N, KVR + R] kv_a_proj_with_mqa's output
    dkvl: Vec<f32>, // [N, KVR]
    dcq: Vec<f32>,  // [N, QR]
    dcqn: Vec<f32>, // [N, QR]
    pub do_in: Vec<f32>, // [N, NH·V]
}

impl MlaGrads {
    pub fn new(d: Option<MlaDims>) -> MlaGrads {
        let Some(d) = d else { return MlaGrads::default() };
        let z = |k: usize| vec![0.0f32; k];
        MlaGrads {
            dq: z(d.n * d.nh * d.hs), dkvb: z(d.n * d.nh * d.kvb_head()), dlat: z(d.n * (d.kvr + d.rot)), dkvl: z(d.n * d.kvr),
            dcq: z(d.n * d.qr), dcqn: z(d.n * d.qr), do_in: z(d.n * d.nh * d.v),
        }
    }
}

/// Elements of [`MlaActs`] and [`MlaGrads`] for `d` (bulk, statistics, scratch): what the
/// memory plan counts.
pub fn mla_elements(cfg: &crate::GptConfig, n: usize) -> (usize, usize, usize) {
    if !cfg.is_mla() {
        return (0, 0, 0);
    }
    let d = MlaDims::of(cfg, n);
    let bulk = n * (2 * d.qr + 2 * d.kvr + d.nh * d.v);
    let stats = if d.qr > 0 { 2 * n } else { n };
    let scratch = n * (d.nh * d.hs + d.nh * d.kvb_head() + d.kvr + d.rot + d.kvr + 2 * d.qr + d.nh * d.v);
    (bulk, stats, scratch)
}

/// One block's MLA weights (its unit's slices), and the arithmetic of its products.
pub(crate) struct MlaWeights<'w> {
    pub unit: &'w [f32],
    pub p: &'w MlaParams,
    pub arith: Arith,
}

impl MlaWeights<'_> {
    fn w(&self, r: &std::ops::Range<usize>) -> &[f32] {
        &self.unit[r.clone()]
    }
}

/// The front end's forward from the attention's input `x` `[N, C]`: `qkv` `[N, 3·NH·HS]`
/// (before RoPE) and what backward reads into `a`. `norm_w` gives a norm's weight as the
/// kernels take it.
pub(crate) fn mla_forward(qkv: &mut [f32], a: &mut MlaActs, x: &[f32], w: &MlaWeights, d: &MlaDims) {
    let MlaDims { n, c, nh, hs, rot, qr, kvr, .. } = *d;
    let mut q = tensor::par::pooled(n * nh * hs);
    if qr > 0 {
        matmul_forward_as(w.arith, &mut a.cq, x, w.w(&w.p.q_a), None, (n, c, qr));
        rmsnorm_forward(&mut a.cqn, &mut a.cq_rstd, &a.cq, w.w(&w.p.q_a_norm), NORM_EPS, qr);
        matmul_forward_as(w.arith, &mut q, &a.cqn, w.w(&w.p.q_b), None, (n, qr, nh * hs));
    } else {
        matmul_forward_as(w.arith, &mut q, x, w.w(&w.p.q_b), None, (n, c, nh * hs));
    }
    let mut lat = tensor::par::pooled(n * (kvr + rot));
    matmul_forward_as(w.arith, &mut lat, x, w.w(&w.p.kv_a), None, (n, c, kvr + rot));
    for (dst, src) in a.kvl.chunks_mut(kvr).zip(lat.chunks(kvr + rot)) {
        dst.copy_from_slice(&src[..kvr]);
    }
    rmsnorm_forward(&mut a.kvn, &mut a.kv_rstd, &a.kvl, w.w(&w.p.kv_norm), NORM_EPS, kvr);
    let mut kvb = tensor::par::pooled(n * nh * d.kvb_head());
    matmul_forward_as(w.arith, &mut kvb, &a.kvn, w.w(&w.p.kv_b), None, (n, kvr, nh * d.kvb_head()));
    assemble(qkv, (&q, &lat, &kvb), d);
}

/// The fused `[q | k | v]` rows from transformers' q, latent (its rotary key at `KVR..`) and
/// per-head up-projection (see the module's layout).
fn assemble(qkv: &mut [f32], (q, lat, kvb): (&[f32], &[f32], &[f32]), d: &MlaDims) {
    let MlaDims { nh, hs, rot, v, kvr, .. } = *d;
    let (nope, kh, w) = (d.nope(), d.kvb_head(), 3 * nh * hs);
    for t in 0..d.n {
        let row = &mut qkv[t * w..(t + 1) * w];
        let krot = &lat[t * (kvr + rot) + kvr..(t + 1) * (kvr + rot)];
        for h in 0..nh {
            let qh = &q[(t * nh + h) * hs..(t * nh + h + 1) * hs];
            let kv = &kvb[(t * nh + h) * kh..(t * nh + h + 1) * kh];
            let (qo, ko, vo) = (h * hs, (nh + h) * hs, (2 * nh + h) * hs);
            for j in 0..rot {
                row[qo + j] = qh[nope + d.rope_src(j)];
                row[ko + j] = krot[d.rope_src(j)];
            }
            row[qo + rot..qo + hs].copy_from_slice(&qh[..nope]);
            row[ko + rot..ko + hs].copy_from_slice(&kv[..nope]);
            row[vo..vo + v].copy_from_slice(&kv[nope..]);
            row[vo + v..vo + hs].fill(0.0);
        }
    }
}

/// Every head's keys and values `[T, NH·HS]` each (values zero-padded) from the compressed cache
/// `lat` `[T, KVR + R]`: the normed latents up-projected by `kv_b` (`kv_b_proj`), the rotated
/// shared key copied into every head (`d.n` = T).
pub(crate) fn expand_cache(lat: &[f32], kv_b: &[f32], d: &MlaDims) -> (Vec<f32>, Vec<f32>) {
    let MlaDims { n: t, nh, hs, rot, v, kvr, .. } = *d;
    let (nope, kh) = (d.nope(), d.kvb_head());
    let kvn: Vec<f32> = lat.chunks(kvr + rot).flat_map(|row| row[..kvr].iter().copied()).collect();
    let mut kvb = vec![0.0f32; t * nh * kh];
    tensor::matmul::matmul_forward(&mut kvb, &kvn, kv_b, None, t, kvr, nh * kh);
    let (mut k, mut vv) = (vec![0.0f32; t * nh * hs], vec![0.0f32; t * nh * hs]);
    for j in 0..t {
        let krot = &lat[j * (kvr + rot) + kvr..(j + 1) * (kvr + rot)];
        for h in 0..nh {
            let src = &kvb[(j * nh + h) * kh..(j * nh + h + 1) * kh];
            let o = (j * nh + h) * hs;
            k[o..o + rot].copy_from_slice(krot);
            k[o + rot..o + hs].copy_from_slice(&src[..nope]);
            vv[o..o + v].copy_from_slice(&src[nope..]);
        }
    }
    (k, vv)
}

/// The heads' values from the core's output `atty` `[N, NH·HS]` into `o_in` `[N, NH·V]`.
pub(crate) fn compact_heads(o_in: &mut [f32], atty: &[f32], d: &MlaDims) {
    let (hs, v) = (d.hs, d.v);
    for (o, a) in o_in.chunks_mut(v).zip(atty.chunks(hs)) {
        o.copy_from_slice(&a[..v]);
    }
}

/// The backward of [`compact_heads`]: `datty` (overwritten) from `do_in`, zero in the padding.
pub(crate) fn expand_heads(datty: &mut [f32], do_in: &[f32], d: &MlaDims) {
    let (hs, v) = (d.hs, d.v);
    for (a, o) in datty.chunks_mut(hs).zip(do_in.chunks(v)) {
        a[..v].copy_from_slice(o);
        a[v..].fill(0.0);
    }
}

/// The front end's backward from `dqkv` (after RoPE's backward): `dx` `[N, C]` overwritten with
/// the input's gradient, the parameters' gradients accumulated in the unit's `dw`.
pub(crate) fn mla_backward(dx: &mut [f32], dw: &mut [f32], dqkv: &[f32], (a, x): (&MlaActs, &[f32]), w: &MlaWeights, d: &MlaDims, g: &mut MlaGrads) {
    let MlaDims { n, c, nh, hs, rot, qr, kvr, .. } = *d;
    let p = w.p;
    disassemble((&mut g.dq, &mut g.dlat, &mut g.dkvb), dqkv, d);
    // kvb = kvn · kv_bᵀ ; kvn = rmsnorm(kvl) ; [kvl | krot] = x · kv_aᵀ
    tensor::par::zero(&mut g.dkvl);
    let mut dkvn = tensor::par::pooled(n * kvr);
    matmul_backward_as(w.arith, (&mut dkvn, &mut dw[p.kv_b.clone()], None), &g.dkvb, &a.kvn, w.w(&p.kv_b), (n, kvr, nh * d.kvb_head()));
    rmsnorm_backward(&mut g.dkvl, &mut dw[p.kv_norm.clone()], &dkvn, &a.kvl, w.w(&p.kv_norm), &a.kv_rstd, kvr);
    for (dst, src) in g.dlat.chunks_mut(kvr + rot).zip(g.dkvl.chunks(kvr)) {
        dst[..kvr].copy_from_slice(src);
    }
    tensor::par::zero(dx);
    matmul_backward_as(w.arith, (&mut *dx, &mut dw[p.kv_a.clone()], None), &g.dlat, x, w.w(&p.kv_a), (n, c, kvr + rot));
    if qr > 0 {
        tensor::par::zero(&mut g.dcqn);
        tensor::par::zero(&mut g.dcq);
        matmul_backward_as(w.arith, (&mut g.dcqn, &mut dw[p.q_b.clone()], None), &g.dq, &a.cqn, w.w(&p.q_b), (n, qr, nh * hs));
        rmsnorm_backward(&mut g.dcq, &mut dw[p.q_a_norm.clone()], &g.dcqn, &a.cq, w.w(&p.q_a_norm), &a.cq_rstd, qr);
        matmul_backward_as(w.arith, (dx, &mut dw[p.q_a.clone()], None), &g.dcq, x, w.w(&p.q_a), (n, c, qr));
    } else {
        matmul_backward_as(w.arith, (dx, &mut dw[p.q_b.clone()], None), &g.dq, x, w.w(&p.q_b), (n, c, nh * hs));
    }
}

/// The backward of [`assemble`]: transformers' q gradient, the latent's rotary-key gradient
/// (summed over the heads in order; its first `KVR` columns left for the norm), the
/// up-projection's.
fn disassemble((dq, dlat, dkvb): (&mut [f32], &mut [f32], &mut [f32]), dqkv: &[f32], d: &MlaDims) {
    let MlaDims { nh, hs, rot, v, kvr, .. } = *d;
    let (nope, kh, w) = (d.nope(), d.kvb_head(), 3 * nh * hs);
    for t in 0..d.n {
        let row = &dqkv[t * w..(t + 1) * w];
        let krot = &mut dlat[t * (kvr + rot) + kvr..(t + 1) * (kvr + rot)];
        krot.fill(0.0);
        for h in 0..nh {
            let qh = &mut dq[(t * nh + h) * hs..(t * nh + h + 1) * hs];
            let kv = &mut dkvb[(t * nh + h) * kh..(t * nh + h + 1) * kh];
            let (qo, ko, vo) = (h * hs, (nh + h) * hs, (2 * nh + h) * hs);
            for j in 0..rot {
                qh[nope + d.rope_src(j)] = row[qo + j];
                krot[d.rope_src(j)] += row[ko + j];
            }
            qh[..nope].copy_from_slice(&row[qo + rot..qo + hs]);
            kv[..nope].copy_from_slice(&row[ko + rot..ko + hs]);
            kv[nope..].copy_from_slice(&row[vo..vo + v]);
        }
    }
}
