//! LLaMA-family kernels (`tensor::llama`): finite-difference gradient checks, reference values,
//! rotary-embedding identities, GQA against the multi-head kernel, accumulation, and the
//! `llama-tiny` transformers fixture's logits reproduced from these kernels.

use tensor::attention::AttnDims;
use tensor::llama::*;
use tensor::*;
use crate::common::*;

// ---------------------------------------------------------------------------------------------
// RMSNorm

#[test]
fn rmsnorm_gradients() {
    let (n, c) = (5, 12);
    let mut rng = Rng::new(21);
    let inp = randn(&mut rng, n * c, 1.0);
    let w = randn(&mut rng, c, 1.0);
    let dout = randn(&mut rng, n * c, 1.0);
    let fwd = |inp: &[f32], w: &[f32]| {
        let (mut out, mut r) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut out, &mut r, inp, w, 1e-5, c);
        dot(&out, &dout)
    };
    let (mut out, mut r) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_forward(&mut out, &mut r, &inp, &w, 1e-5, c);
    let (mut di, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
    rmsnorm_backward(&mut di, &mut dw, &dout, &inp, &w, &r, c);
    check("rmsnorm.dinp", &inp, &di, |x| fwd(x, &w));
    check("rmsnorm.dweight", &w, &dw, |x| fwd(&inp, x));
}

/// Qwen3's per-head norms: finite differences through the q and k heads of a fused row (the v
/// columns untouched), over more tokens than one reduction block; each head equals
/// [`rmsnorm_forward`] of that head alone.
#[test]
fn head_rmsnorm_gradients() {
    let (n, nh, nkv, hs) = (70, 3, 1, 4);
    let w = (nh + 2 * nkv) * hs;
    let mut rng = Rng::new(23);
    let qkv = randn(&mut rng, n * w, 1.0);
    let wqk = randn(&mut rng, 2 * hs, 1.0); // q_norm | k_norm
    let dout = randn(&mut rng, n * w, 1.0);
    let fwd = |qkv: &[f32], wqk: &[f32]| {
        let mut x = qkv.to_vec();
        let (mut pre, mut r) = (vec![0.0; n * (nh + nkv) * hs], vec![0.0; n * (nh + nkv)]);
        qk_rmsnorm_forward(&mut x, &mut pre, &mut r, wqk, 1e-6, (nh, nkv, hs));
        (x, pre, r)
    };
    let (x, pre, r) = fwd(&qkv, &wqk);
    for t in 0..n {
        for h in 0..nh + nkv {
            let (o, wt) = if h < nh { (h * hs, &wqk[..hs]) } else { (h * hs, &wqk[hs..]) };
            let (mut one, mut rs) = (vec![0.0; hs], [0.0f32]);
            rmsnorm_forward(&mut one, &mut rs, &qkv[t * w + o..t * w + o + hs], wt, 1e-6, hs);
            assert_eq!(&x[t * w + o..t * w + o + hs], &one[..], "token {t} head {h}");
        }
        assert_eq!(&x[t * w + (nh + nkv) * hs..(t + 1) * w], &qkv[t * w + (nh + nkv) * hs..(t + 1) * w], "v of token {t}");
    }
    let (mut d, mut dw) = (dout.clone(), vec![0.0; 2 * hs]);
    qk_rmsnorm_backward(&mut d, &mut dw, &pre, &wqk, &r, (nh, nkv, hs));
    check("head_rmsnorm.dqkv", &qkv, &d, |q| dot(&fwd(q, &wqk).0, &dout));
    check("head_rmsnorm.dq_weight", &wqk[..hs], &dw[..hs], |x| dot(&fwd(&qkv, &[x, &wqk[hs..]].concat()).0, &dout));
    check("head_rmsnorm.dk_weight", &wqk[hs..], &dw[hs..], |x| dot(&fwd(&qkv, &[&wqk[..hs], x].concat()).0, &dout));
}

/// OLMo 2's whole-width q and k norms: every q head of a token normalised as one vector (and
/// the k heads as another), equal to [`rmsnorm_forward`] over those columns; finite
/// differences through both and their weights.
#[test]
fn whole_width_qk_rmsnorm_gradients() {
    let (n, nh, nkv, hs) = (70, 3, 1, 4);
    let w = (nh + 2 * nkv) * hs;
    let mut rng = Rng::new(29);
    let qkv = randn(&mut rng, n * w, 1.0);
    let wqk = randn(&mut rng, (nh + nkv) * hs, 1.0); // q_norm [NH·HS] | k_norm [NKV·HS]
    let dout = randn(&mut rng, n * w, 1.0);
    let fwd = |qkv: &[f32], wqk: &[f32]| {
        let mut x = qkv.to_vec();
        let (mut pre, mut r) = (vec![0.0; n * (nh + nkv) * hs], vec![0.0; 2 * n]);
        qk_rmsnorm_forward(&mut x, &mut pre, &mut r, wqk, 1e-6, (nh, nkv, hs));
        (x, pre, r)
    };
    let (x, pre, r) = fwd(&qkv, &wqk);
    let qw = nh * hs;
    for t in 0..n {
        for (o, wt) in [(0, &wqk[..qw]), (qw, &wqk[qw..])] {
            let (mut one, mut rs) = (vec![0.0; wt.len()], [0.0f32]);
            rmsnorm_forward(&mut one, &mut rs, &qkv[t * w + o..t * w + o + wt.len()], wt, 1e-6, wt.len());
            assert_eq!(&x[t * w + o..t * w + o + wt.len()], &one[..], "token {t} at column {o}");
        }
        assert_eq!(&x[t * w + (nh + nkv) * hs..(t + 1) * w], &qkv[t * w + (nh + nkv) * hs..(t + 1) * w], "v of token {t}");
    }
    let (mut d, mut dw) = (dout.clone(), vec![0.0; wqk.len()]);
    qk_rmsnorm_backward(&mut d, &mut dw, &pre, &wqk, &r, (nh, nkv, hs));
    check("whole_qk_rmsnorm.dqkv", &qkv, &d, |q| dot(&fwd(q, &wqk).0, &dout));
    check("whole_qk_rmsnorm.dweight", &wqk, &dw, |x| dot(&fwd(&qkv, x).0, &dout));
}

#[test]
fn rmsnorm_matches_f64_reference() {
    // Enough rows (> par::REDUCE_ROWS) that the weight gradient crosses reduction chunks.
    let (n, c, eps) = (130, 37, 1e-6f32);
    let mut rng = Rng::new(22);
    let inp = randn(&mut rng, n * c, 3.0);
    let w = randn(&mut rng, c, 1.0);
    let (mut out, mut rstd) = (vec![f32::NAN; n * c], vec![f32::NAN; n]);
    rmsnorm_forward(&mut out, &mut rstd, &inp, &w, eps, c);
    for r in 0..n {
        let x = &inp[r * c..(r + 1) * c];
        let ms = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / c as f64;
        let rs = 1.0 / (ms + eps as f64).sqrt();
        assert!(((rstd[r] as f64 - rs) / rs).abs() < 1e-6, "rstd[{r}] {} vs {rs}", rstd[r]);
        for j in 0..c {
            let want = x[j] as f64 * rs * w[j] as f64;
            let got = out[r * c + j] as f64;
            assert!((got - want).abs() <= 1e-6 * (1.0 + want.abs()), "out[{r},{j}] {got} vs {want}");
        }
    }
    // Hand values: x = [1, 2, 3, 4], w = 1, eps = 0 → rms = √7.5.
    let (mut o, mut s) = ([0.0f32; 4], [0.0f32; 1]);
    rmsnorm_forward(&mut o, &mut s, &[1.0, 2.0, 3.0, 4.0], &[1.0; 4], 0.0, 4);
    let want = [0.365_148_4, 0.730_296_7, 1.095_445_1, 1.460_593_5];
    for (a, b) in o.iter().zip(want) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
    // Weight gradient against a direct f64 sum over all rows.
    let dout = randn(&mut rng, n * c, 1.0);
    let (mut di, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
    rmsnorm_backward(&mut di, &mut dw, &dout, &inp, &w, &rstd, c);
    for j in 0..c {
        let want: f64 = (0..n).map(|r| dout[r * c + j] as f64 * inp[r * c + j] as f64 * rstd[r] as f64).sum();
        assert!((dw[j] as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()), "dweight[{j}] {} vs {want}", dw[j]);
    }
}

// ---------------------------------------------------------------------------------------------
// Rotary embeddings

struct Rope {
    b: usize,
    t: usize,
    nh: usize,
    nkv: usize,
    hs: usize,
}

impl Rope {
    fn w(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hs
    }
    fn dims(&self) -> GqaDims {
        GqaDims { b: self.b, t: self.t, nh: self.nh, nkv: self.nkv, hs: self.hs, ..Default::default() }
    }
    fn fwd(&self, x: &mut [f32], cs: &(Vec<f32>, Vec<f32>), off: usize) {
        rope_forward(x, &cs.0, &cs.1, &self.dims(), off);
    }
    fn bwd(&self, x: &mut [f32], cs: &(Vec<f32>, Vec<f32>), off: usize) {
        rope_backward(x, &cs.0, &cs.1, &self.dims(), off);
    }
}

#[test]
fn rope_gradients() {
    let r = Rope { b: 2, t: 5, nh: 4, nkv: 2, hs: 6 };
    let cs = rope_table(10_000.0, r.hs, 16);
    let mut rng = Rng::new(23);
    let qkv = randn(&mut rng, r.b * r.t * r.w(), 1.0);
    let dout = randn(&mut rng, qkv.len(), 1.0);
    for off in [0, 3] {
        let mut g = dout.clone();
        r.bwd(&mut g, &cs, off);
        check(&format!("rope(offset={off}).dqkv"), &qkv, &g, |x| {
            let mut y = x.to_vec();
            r.fwd(&mut y, &cs, off);
            dot(&y, &dout)
        });
    }
}

/// Partial rotary (Phi-4-mini's factor 0.75): the first 6 of 8 dimensions of every q and k head
/// turn exactly as a 6-wide head would; the last 2 and all of v pass through; finite
/// differences check the backward.
#[test]
fn partial_rotary_turns_the_first_dimensions_only() {
    let (b, t, nh, nkv, hs, rot) = (2, 5, 2, 1, 8, 6);
    let w = (nh + 2 * nkv) * hs;
    let dims = GqaDims { b, t, nh, nkv, hs, rotary: rot, ..Default::default() };
    let cs = rope_table(10_000.0, rot, 16);
    let mut rng = Rng::new(25);
    let qkv = randn(&mut rng, b * t * w, 1.0);
    let mut x = qkv.clone();
    rope_forward(&mut x, &cs.0, &cs.1, &dims, 2);
    // The same rows cut to 6-wide heads, rotated whole.
    let narrow = GqaDims { hs: rot, rotary: 0, ..dims };
    let wn = (nh + 2 * nkv) * rot;
    let mut y: Vec<f32> = qkv.chunks(hs).flat_map(|h| h[..rot].to_vec()).collect();
    rope_forward(&mut y, &cs.0, &cs.1, &narrow, 2);
    for (k, head) in x.chunks(hs).enumerate() {
        assert_eq!(&head[..rot], &y[k * rot..(k + 1) * rot], "head {k}");
        assert_eq!(&head[rot..], &qkv[k * hs + rot..(k + 1) * hs], "head {k}: the unrotated part");
    }
    assert_eq!(y.len(), b * t * wn);
    let dout = randn(&mut rng, qkv.len(), 1.0);
    let mut g = dout.clone();
    rope_backward(&mut g, &cs.0, &cs.1, &dims, 2);
    check("rope(partial).dqkv", &qkv, &g, |q| {
        let mut z = q.to_vec();
        rope_forward(&mut z, &cs.0, &cs.1, &dims, 2);
        dot(&z, &dout)
    });
}

#[test]
fn rope_inverse_is_identity_and_v_is_untouched() {
    let r = Rope { b: 2, t: 9, nh: 4, nkv: 1, hs: 8 };
    let cs = rope_table(10_000.0, r.hs, 32);
    let mut rng = Rng::new(24);
    let x0 = randn(&mut rng, r.b * r.t * r.w(), 1.0);
    let mut x = x0.clone();
    r.fwd(&mut x, &cs, 7);
    assert!(max_err(&x, &x0) > 1e-2, "rotation must change q and k");
    for row in 0..r.b * r.t {
        let v = (r.nh + r.nkv) * r.hs;
        assert_eq!(x[row * r.w() + v..(row + 1) * r.w()], x0[row * r.w() + v..(row + 1) * r.w()], "v changed");
    }
    // The norm of every head is preserved (a rotation).
    for (a, b) in x.chunks(r.hs).zip(x0.chunks(r.hs)) {
        let (na, nb) = (dot(a, a), dot(b, b));
        assert!((na - nb).abs() < 1e-5 * (1.0 + nb), "{na} vs {nb}");
    }
    r.bwd(&mut x, &cs, 7);
    assert!(max_err(&x, &x0) < 1e-6, "inverse rotation: {}", max_err(&x, &x0));
}

#[test]
fn rope_at_position_zero_is_identity() {
    let r = Rope { b: 1, t: 1, nh: 2, nkv: 2, hs: 16 };
    let cs = rope_table(500_000.0, r.hs, 4);
    let mut rng = Rng::new(25);
    let x0 = randn(&mut rng, r.w(), 1.0);
    let mut x = x0.clone();
    r.fwd(&mut x, &cs, 0);
    assert_eq!(x, x0);
    // ...and the table row 0 is exactly (1, 0).
    assert!(cs.0[..8].iter().all(|&c| c == 1.0) && cs.1[..8].iter().all(|&s| s == 0.0));
}

#[test]
fn rope_dot_products_depend_only_on_relative_position() {
    // q at position m, k at position n: q·k after rotation depends on m − n only.
    let (t, hs) = (48, 16);
    let r = Rope { b: 1, t, nh: 2, nkv: 1, hs };
    let cs = rope_table(10_000.0, hs, t);
    let mut rng = Rng::new(26);
    let unit = |rng: &mut Rng| {
        let v = randn(rng, hs, 1.0);
        let n = dot(&v, &v).sqrt() as f32;
        v.into_iter().map(|x| x / n).collect::<Vec<_>>()
    };
    let (q, k) = (unit(&mut rng), unit(&mut rng));
    let mut x = vec![0.0; t * r.w()];
    for row in 0..t {
        // query head 1 and the kv head's k carry the same vectors at every position.
        x[row * r.w() + hs..row * r.w() + 2 * hs].copy_from_slice(&q);
        x[row * r.w() + 2 * hs..row * r.w() + 3 * hs].copy_from_slice(&k);
    }
    r.fwd(&mut x, &cs, 0);
    let qk = |m: usize, n: usize| {
        dot(&x[m * r.w() + hs..m * r.w() + 2 * hs], &x[n * r.w() + 2 * hs..n * r.w() + 3 * hs])
    };
    let mut spread = 0.0f64;
    for (m, n) in [(5usize, 2usize), (9, 9), (3, 11), (20, 1)] {
        let base = qk(m, n);
        for s in [1, 7, 25] {
            let d = (qk(m + s, n + s) - base).abs();
            assert!(d < 1e-5, "q·k at ({m},{n}) shifted by {s}: {} vs {base}", qk(m + s, n + s));
            spread = spread.max((qk(m, n) - qk(m + s, n)).abs());
        }
    }
    assert!(spread > 1e-2, "dot products must depend on the relative position");
}

#[test]
fn rope_pos_offset_matches_full_sequence_rows() {
    let full = Rope { b: 1, t: 12, nh: 4, nkv: 2, hs: 8 };
    let cs = rope_table(10_000.0, full.hs, 12);
    let w = full.w();
    let mut rng = Rng::new(27);
    let x0 = randn(&mut rng, full.t * w, 1.0);
    let mut xf = x0.clone();
    full.fwd(&mut xf, &cs, 0);
    // One decoding step per row, and a chunk of three rows at once.
    let one = Rope { t: 1, ..full };
    for p in 0..full.t {
        let mut row = x0[p * w..(p + 1) * w].to_vec();
        one.fwd(&mut row, &cs, p);
        assert_eq!(row, xf[p * w..(p + 1) * w], "row {p}");
    }
    let three = Rope { t: 3, ..full };
    let mut rows = x0[5 * w..8 * w].to_vec();
    three.fwd(&mut rows, &cs, 5);
    assert_eq!(rows, xf[5 * w..8 * w]);
}

#[test]
fn rope_table_matches_hf_formula() {
    let (theta, hs, max_t) = (10_000.0f32, 16, 64);
    let (cos, sin) = rope_table(theta, hs, max_t);
    assert_eq!(cos.len(), max_t * hs / 2);
    // Pair 1 at position 1: angle 10000^(-2/16) = 10^(-1/2).
    assert!((cos[8 + 1] - 0.316_227_77f32.cos()).abs() < 1e-6);
    assert!((sin[8 + 1] - 0.316_227_77f32.sin()).abs() < 1e-6);
    assert!((cos[8] - 1f32.cos()).abs() < 1e-7 && (sin[8] - 1f32.sin()).abs() < 1e-7);
    // Against exact (f64) math: within the fp32 angle rounding HF also has.
    for p in 0..max_t {
        for i in 0..hs / 2 {
            let a = p as f64 * (theta as f64).powf(-((2 * i) as f64) / hs as f64);
            let tol = 1e-6 + p as f64 * 3e-7;
            assert!((cos[p * 8 + i] as f64 - a.cos()).abs() < tol, "cos[{p},{i}]");
            assert!((sin[p * 8 + i] as f64 - a.sin()).abs() < tol, "sin[{p},{i}]");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

#[test]
fn silu_gradients_and_values() {
    let mut rng = Rng::new(29);
    let x = randn(&mut rng, 101, 2.0);
    let dout = randn(&mut rng, 101, 1.0);
    let mut dx = vec![0.0; 101];
    silu_backward(&mut dx, &dout, &x);
    check("silu.dx", &x, &dx, |x| {
        let mut o = vec![0.0; x.len()];
        silu_forward(&mut o, x);
        dot(&o, &dout)
    });
    // torch: F.silu([-2, 0, 1, 3])
    let mut o = [0.0; 4];
    silu_forward(&mut o, &[-2.0, 0.0, 1.0, 3.0]);
    for (a, b) in o.iter().zip([-0.238_405_84, 0.0, 0.731_058_6, 2.857_722_5]) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
}

#[test]
fn swiglu_gradients() {
    let (n, f) = (3, 37); // a row is one block of 32 lanes and a tail
    let mut rng = Rng::new(28);
    let gu = randn(&mut rng, n * 2 * f, 2.0);
    let dout = randn(&mut rng, n * f, 1.0);
    let mut dgu = vec![0.0; gu.len()];
    swiglu_backward(&mut dgu, &dout, &gu, f);
    check("swiglu.dgu", &gu, &dgu, |x| {
        let mut o = vec![0.0; n * f];
        swiglu_forward(&mut o, x, f);
        dot(&o, &dout)
    });
}

/// Gemma's GeGLU: finite differences through gate and up, and torch's
/// `F.gelu(g, approximate="tanh") * u` values.
#[test]
fn geglu_gradients_and_reference_values() {
    let (n, f) = (3, 37);
    let mut rng = Rng::new(31);
    let gu = randn(&mut rng, n * 2 * f, 2.0);
    let dout = randn(&mut rng, n * f, 1.0);
    let mut dgu = vec![f32::NAN; gu.len()];
    tensor::ops::geglu_backward_into(&mut dgu, &dout, &gu, f);
    check("geglu.dgu", &gu, &dgu, |x| {
        let mut o = vec![0.0; n * f];
        tensor::ops::geglu_forward(&mut o, x, f);
        dot(&o, &dout)
    });
    let gu = [-2.0f32, 0.0, 1.0, 3.0, 1.5, 2.0, -1.0, 0.5];
    let mut o = [0.0; 4];
    tensor::ops::geglu_forward(&mut o, &gu, 4);
    for (a, b) in o.iter().zip([-0.068_103_43, 0.0, -0.841_192, 1.498_181_3]) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
}

#[test]
fn swiglu_matches_reference_values() {
    // torch: F.silu(g) * u for g = [-2, 0, 1, 3], u = [1.5, 2, -1, 0.5]; one row, F = 4.
    let gu = [-2.0f32, 0.0, 1.0, 3.0, 1.5, 2.0, -1.0, 0.5];
    let want = [-0.238_405_84 * 1.5, 0.0, -0.731_058_6, 2.857_722_5 * 0.5];
    let mut o = [0.0; 4];
    swiglu_forward(&mut o, &gu, 4);
    for (a, b) in o.iter().zip(want) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
    // Large |g| stays finite: silu(−100) ≈ 0, silu(100) = 100.
    let mut o = [0.0; 2];
    swiglu_forward(&mut o, &[-100.0, 100.0, 1.0, 1.0], 2);
    assert!(o[0].abs() < 1e-30 && (o[1] - 100.0).abs() < 1e-4, "{o:?}");
}

// ---------------------------------------------------------------------------------------------
// Grouped-query attention

fn gqa_fwd(qkv: &[f32], d: &GqaDims) -> (Vec<f32>, Vec<f32>) {
    let (mut o, mut a) = (vec![f32::NAN; d.b * d.t * d.c()], vec![f32::NAN; d.b * d.nh * d.t * d.t]);
    gqa_attention_forward(&mut o, &mut a, qkv, d);
    (o, a)
}

fn gqa_check(d: GqaDims, seed: u64) {
    let mut rng = Rng::new(seed);
    let qkv = randn(&mut rng, d.b * d.t * d.qkv_width(), 1.0);
    let dout = randn(&mut rng, d.b * d.t * d.c(), 1.0);
    let (_, a) = gqa_fwd(&qkv, &d);
    let mut dqkv = vec![0.0; qkv.len()];
    gqa_attention_backward(&mut dqkv, &dout, &qkv, &a, &d);
    check(&format!("gqa_attention({d:?}).dqkv"), &qkv, &dqkv, |x| dot(&gqa_fwd(x, &d).0, &dout));
}

#[test]
fn gqa_attention_gradients() {
    gqa_check(GqaDims { b: 2, t: 5, nh: 4, nkv: 2, hs: 3, ..Default::default() }, 29); // groups of two
    gqa_check(GqaDims { b: 1, t: 6, nh: 3, nkv: 1, hs: 4, ..Default::default() }, 30); // multi-query
    gqa_check(GqaDims { b: 2, t: 4, nh: 2, nkv: 2, hs: 4, ..Default::default() }, 31); // multi-head
    gqa_check(GqaDims { b: 1, t: 7, nh: 2, nkv: 1, hs: 4, window: 3, ..Default::default() }, 32); // sliding window
}

#[test]
fn gqa_with_nkv_equal_nh_matches_attention_kernel() {
    let d = GqaDims { b: 2, t: 7, nh: 3, nkv: 3, hs: 4, ..Default::default() };
    let ad = AttnDims { b: d.b, t: d.t, c: d.c(), nh: d.nh, ..Default::default() };
    let mut rng = Rng::new(32);
    let qkv = randn(&mut rng, d.b * d.t * 3 * d.c(), 1.0);
    let dout = randn(&mut rng, d.b * d.t * d.c(), 1.0);
    let (o, a) = gqa_fwd(&qkv, &d);
    let (mut o2, mut a2) = (vec![0.0; o.len()], vec![0.0; a.len()]);
    attention_forward(&mut o2, &mut a2, &qkv, &ad, AttnDropout::NONE);
    assert!(max_err(&o, &o2) < 1e-6 && max_err(&a, &a2) < 1e-6, "out {} att {}", max_err(&o, &o2), max_err(&a, &a2));
    let (mut dq, mut dq2) = (vec![0.0; qkv.len()], vec![0.0; qkv.len()]);
    gqa_attention_backward(&mut dq, &dout, &qkv, &a, &d);
    attention_backward(&mut dq2, &dout, &qkv, &a2, &ad, AttnDropout::NONE);
    assert!(max_err(&dq, &dq2) < 1e-5, "dqkv {}", max_err(&dq, &dq2));
}

#[test]
fn gqa_matches_multi_head_attention_with_repeated_kv() {
    // HF's `repeat_kv`: expand each kv head to its group, run plain MHA; the kv gradients of
    // GQA are the sums of the expanded ones over each group.
    let d = GqaDims { b: 2, t: 6, nh: 6, nkv: 2, hs: 4, ..Default::default() };
    let (c, w, hs, group) = (d.c(), d.qkv_width(), d.hs, d.group());
    let ad = AttnDims { b: d.b, t: d.t, c, nh: d.nh, ..Default::default() };
    let mut rng = Rng::new(33);
    let qkv = randn(&mut rng, d.b * d.t * w, 1.0);
    let dout = randn(&mut rng, d.b * d.t * c, 1.0);
    let rows = d.b * d.t;
    let mut big = vec![0.0; rows * 3 * c];
    for r in 0..rows {
        let (src, dst) = (&qkv[r * w..(r + 1) * w], &mut big[r * 3 * c..(r + 1) * 3 * c]);
        dst[..c].copy_from_slice(&src[..c]);
        for h in 0..d.nh {
            let g = h / group;
            dst[c + h * hs..c + (h + 1) * hs].copy_from_slice(&src[c + g * hs..c + (g + 1) * hs]);
            let v = c + d.nkv * hs;
            dst[2 * c + h * hs..2 * c + (h + 1) * hs].copy_from_slice(&src[v + g * hs..v + (g + 1) * hs]);
        }
    }
    let (o, a) = gqa_fwd(&qkv, &d);
    let (mut o2, mut a2) = (vec![0.0; o.len()], vec![0.0; a.len()]);
    attention_forward(&mut o2, &mut a2, &big, &ad, AttnDropout::NONE);
    assert!(max_err(&o, &o2) < 1e-6, "out {}", max_err(&o, &o2));
    let (mut dq, mut dbig) = (vec![0.0; qkv.len()], vec![0.0; big.len()]);
    gqa_attention_backward(&mut dq, &dout, &qkv, &a, &d);
    attention_backward(&mut dbig, &dout, &big, &a2, &ad, AttnDropout::NONE);
    let mut want = vec![0.0; qkv.len()];
    for r in 0..rows {
        let (src, dst) = (&dbig[r * 3 * c..(r + 1) * 3 * c], &mut want[r * w..(r + 1) * w]);
        dst[..c].copy_from_slice(&src[..c]);
        for h in 0..d.nh {
            let g = h / group;
            for j in 0..hs {
                dst[c + g * hs + j] += src[c + h * hs + j];
                dst[c + d.nkv * hs + g * hs + j] += src[2 * c + h * hs + j];
            }
        }
    }
    assert!(max_err(&dq, &want) < 1e-5, "dqkv {}", max_err(&dq, &want));
}

#[test]
fn gqa_attention_is_causal() {
    let d = GqaDims { b: 1, t: 6, nh: 4, nkv: 2, hs: 2, ..Default::default() };
    let w = d.qkv_width();
    let mut rng = Rng::new(34);
    let mut qkv = randn(&mut rng, d.t * w, 1.0);
    let (o1, _) = gqa_fwd(&qkv, &d);
    for j in d.c()..w {
        qkv[5 * w + j] += 1.0; // the last token's k and v
    }
    let (o2, _) = gqa_fwd(&qkv, &d);
    let c = d.c();
    assert_eq!(o1[..5 * c], o2[..5 * c]);
    assert_ne!(o1[5 * c..], o2[5 * c..]);
}

#[test]
fn gqa_backward_is_deterministic_across_thread_counts() {
    let d = GqaDims { b: 3, t: 33, nh: 8, nkv: 2, hs: 8, ..Default::default() };
    let mut rng = Rng::new(35);
    let qkv = randn(&mut rng, d.b * d.t * d.qkv_width(), 1.0);
    let dout = randn(&mut rng, d.b * d.t * d.c(), 1.0);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let (o, a) = gqa_fwd(&qkv, &d);
            let mut dq = vec![0.0; qkv.len()];
            gqa_attention_backward(&mut dq, &dout, &qkv, &a, &d);
            (o, dq)
        })
    };
    assert_eq!(run(1), run(3));
}

// ---------------------------------------------------------------------------------------------
// Backward accumulates (never overwrites)

#[test]
fn backward_kernels_accumulate() {
    let mut rng = Rng::new(36);
    let twice = |f: &dyn Fn(&mut [f32]), n: usize, what: &str| {
        let mut once = vec![0.0; n];
        f(&mut once);
        let mut pre = vec![0.5; n];
        f(&mut pre);
        for (p, o) in pre.iter().zip(&once) {
            assert!((p - (o + 0.5)).abs() < 1e-5, "{what}: {p} vs {o} + 0.5");
        }
    };
    // RMSNorm
    let (n, c) = (70, 8);
    let inp = randn(&mut rng, n * c, 1.0);
    let w = randn(&mut rng, c, 1.0);
    let dout = randn(&mut rng, n * c, 1.0);
    let (mut out, mut rs) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_forward(&mut out, &mut rs, &inp, &w, 1e-5, c);
    twice(&|g| rmsnorm_backward(g, &mut vec![0.0; c], &dout, &inp, &w, &rs, c), n * c, "rmsnorm.dinp");
    twice(&|g| rmsnorm_backward(&mut vec![0.0; n * c], g, &dout, &inp, &w, &rs, c), c, "rmsnorm.dweight");
    // SwiGLU
    let (n, f) = (3, 5);
    let gu = randn(&mut rng, n * 2 * f, 1.0);
    let dout = randn(&mut rng, n * f, 1.0);
    twice(&|g| swiglu_backward(g, &dout, &gu, f), gu.len(), "swiglu.dgu");
    // GQA
    let d = GqaDims { b: 1, t: 4, nh: 4, nkv: 2, hs: 2, ..Default::default() };
    let qkv = randn(&mut rng, d.t * d.qkv_width(), 1.0);
    let dout = randn(&mut rng, d.t * d.c(), 1.0);
    let (_, a) = gqa_fwd(&qkv, &d);
    twice(&|g| gqa_attention_backward(g, &dout, &qkv, &a, &d), qkv.len(), "gqa.dqkv");
}

// ---------------------------------------------------------------------------------------------
// The transformers `llama-tiny` fixture: logits from these kernels (plus embedding and matmul)

#[test]
fn llama_tiny_fixture_logits_match_transformers() {
    let dir = fixture("llama-tiny");
    // config.json: hidden 64, 4 heads of 16, 2 kv heads, intermediate 172, 2 layers,
    // rms_norm_eps 1e-5, rope_theta 10000, vocab 103, untied lm_head.
    let (c, nh, nkv, hs, f, layers, v) = (64, 4, 2, 16, 172, 2, 103);
    let st = SafeTensors::open(&dir.join("model.safetensors"));
    let (tokens, b, t) = fixture_tokens(&dir);
    let n = b * t;
    let d = GqaDims { b, t, nh, nkv, hs, ..Default::default() };
    let (cos, sin) = rope_table(10_000.0, hs, t);

    let mut x = vec![0.0; n * c];
    embedding_forward(&mut x, &tokens, &st.get("model.embed_tokens.weight", &[v, c]), None, t, c);
    let (mut h, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    let (mut gu, mut m) = (vec![0.0; n * 2 * f], vec![0.0; n * f]);
    for l in 0..layers {
        let p = |s: &str, shape: &[usize]| st.get(&format!("model.layers.{l}.{s}"), shape);
        hf_attention_residual(&mut x, &st, l, &d, &cos, &sin);
        // x = x + down_proj(silu(gate_proj(norm(x))) · up_proj(norm(x)))
        rmsnorm_forward(&mut h, &mut rstd, &x, &p("post_attention_layernorm.weight", &[c]), 1e-5, c);
        let wgu = [p("mlp.gate_proj.weight", &[f, c]), p("mlp.up_proj.weight", &[f, c])].concat();
        matmul_forward(&mut gu, &h, &wgu, None, n, c, 2 * f);
        swiglu_forward(&mut m, &gu, f);
        matmul_forward(&mut h, &m, &p("mlp.down_proj.weight", &[c, f]), None, n, f, c);
        add_into(&mut x, &h);
    }
    assert_fixture_logits("llama-tiny", &dir, &st, &x, (b, t, c, v));
}
