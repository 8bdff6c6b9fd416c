//! Finite-difference gradient checks for every backward kernel. Each kernel's output is reduced
//! to a scalar `L = Σ out·w` with random `w`; the analytic gradient (backward with `dout = w`)
//! is compared with central differences on every (or a sample of) input element.

use tensor::*;
use tensor::attention::AttnDims;
use crate::common::*;

#[test]
fn matmul_gradients() {
    let (bt, c, oc) = (6, 5, 7);
    let mut rng = Rng::new(1);
    let inp = randn(&mut rng, bt * c, 1.0);
    let w = randn(&mut rng, oc * c, 1.0);
    let b = randn(&mut rng, oc, 1.0);
    let dout = randn(&mut rng, bt * oc, 1.0);
    let fwd = |inp: &[f32], w: &[f32], b: &[f32]| {
        let mut out = vec![0.0; bt * oc];
        matmul_forward(&mut out, inp, w, Some(b), bt, c, oc);
        dot(&out, &dout)
    };
    let (mut di, mut dw, mut db) = (vec![0.0; bt * c], vec![0.0; oc * c], vec![0.0; oc]);
    matmul_backward((&mut di, &mut dw, Some(&mut db)), &dout, &inp, &w, bt, c, oc);
    check("matmul.dinp", &inp, &di, |x| fwd(x, &w, &b));
    check("matmul.dweight", &w, &dw, |x| fwd(&inp, x, &b));
    check("matmul.dbias", &b, &db, |x| fwd(&inp, &w, x));
}

#[test]
fn matmul_large_matches_naive() {
    // Large enough that gemm runs multi-threaded; checked against a plain reference product.
    let (bt, c, oc) = (64, 96, 80);
    let mut rng = Rng::new(2);
    let inp = randn(&mut rng, bt * c, 1.0);
    let w = randn(&mut rng, oc * c, 1.0);
    let mut out = vec![0.0; bt * oc];
    matmul_forward(&mut out, &inp, &w, None, bt, c, oc);
    for i in 0..bt {
        for j in 0..oc {
            let r: f32 = (0..c).map(|k| inp[i * c + k] * w[j * c + k]).sum();
            assert!((r - out[i * oc + j]).abs() < 1e-3);
        }
    }
}

#[test]
fn layernorm_gradients() {
    let (n, c) = (5, 8);
    let mut rng = Rng::new(3);
    let inp = randn(&mut rng, n * c, 1.0);
    let w = randn(&mut rng, c, 1.0);
    let b = randn(&mut rng, c, 1.0);
    let dout = randn(&mut rng, n * c, 1.0);
    let fwd = |inp: &[f32], w: &[f32], b: &[f32]| {
        let (mut out, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut out, &mut m, &mut r, inp, w, Some(b), c);
        dot(&out, &dout)
    };
    let (mut out, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    layernorm_forward(&mut out, &mut m, &mut r, &inp, &w, Some(&b), c);
    let (mut di, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
    layernorm_backward((&mut di, &mut dw, Some(&mut db)), &dout, &inp, &w, (&m, &r), c);
    check("layernorm.dinp", &inp, &di, |x| fwd(x, &w, &b));
    check("layernorm.dweight", &w, &dw, |x| fwd(&inp, x, &b));
    check("layernorm.dbias", &b, &db, |x| fwd(&inp, &w, x));
}

#[test]
fn gelu_gradients() {
    let mut rng = Rng::new(4);
    let inp = randn(&mut rng, 50, 2.0);
    let dout = randn(&mut rng, 50, 1.0);
    let mut di = vec![0.0; 50];
    gelu_backward(&mut di, &dout, &inp);
    check("gelu.dinp", &inp, &di, |x| {
        let mut o = vec![0.0; x.len()];
        gelu_forward(&mut o, x);
        dot(&o, &dout)
    });
}

#[test]
fn gelu_matches_reference_values() {
    // torch.nn.functional.gelu(x, approximate="tanh") at x = -1, 0, 1, 2.
    let x = [-1.0f32, 0.0, 1.0, 2.0];
    let want = [-0.158_808, 0.0, 0.841_192, 1.954_598];
    let mut o = [0.0; 4];
    gelu_forward(&mut o, &x);
    for (a, b) in o.iter().zip(want) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
}

#[test]
fn residual_gradients() {
    let mut rng = Rng::new(5);
    let a = randn(&mut rng, 20, 1.0);
    let b = randn(&mut rng, 20, 1.0);
    let dout = randn(&mut rng, 20, 1.0);
    let (mut da, mut db) = (vec![0.0; 20], vec![0.0; 20]);
    residual_backward(&mut da, &mut db, &dout);
    let f = |a: &[f32], b: &[f32]| {
        let mut o = vec![0.0; 20];
        residual_forward(&mut o, a, b);
        dot(&o, &dout)
    };
    check("residual.da", &a, &da, |x| f(x, &b));
    check("residual.db", &b, &db, |x| f(&a, x));
}

#[test]
fn embedding_gradients() {
    let (b, t, c, v) = (2, 3, 4, 5);
    let tokens = [1u32, 3, 1, 0, 4, 1];
    let mut rng = Rng::new(6);
    let wte = randn(&mut rng, v * c, 1.0);
    let wpe = randn(&mut rng, t * c, 1.0);
    let dout = randn(&mut rng, b * t * c, 1.0);
    let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
    embedding_backward(&mut dwte, Some(&mut dwpe), &dout, &tokens, t, c);
    let f = |wte: &[f32], wpe: &[f32]| {
        let mut o = vec![0.0; b * t * c];
        embedding_forward(&mut o, &tokens, wte, Some(wpe), t, c);
        dot(&o, &dout)
    };
    check("embedding.dwte", &wte, &dwte, |x| f(x, &wpe));
    check("embedding.dwpe", &wpe, &dwpe, |x| f(&wte, x));
}

#[test]
fn dropout_gradients_and_statistics() {
    let n = 4000;
    let mut rng = Rng::new(7);
    let inp = randn(&mut rng, n, 1.0);
    let dout = randn(&mut rng, n, 1.0);
    let (p, seed) = (0.3, 99);
    let mut di = vec![0.0; n];
    dropout_backward(&mut di, &dout, p, seed);
    check("dropout.dinp", &inp, &di, |x| {
        let mut o = vec![0.0; n];
        dropout_forward(&mut o, x, p, seed);
        dot(&o, &dout)
    });
    let mut o = vec![0.0; n];
    dropout_forward(&mut o, &inp, p, seed);
    let dropped = o.iter().filter(|&&x| x == 0.0).count() as f32 / n as f32;
    assert!((dropped - p).abs() < 0.03, "dropped fraction {dropped}");
    // Same seed, same mask; another seed, another mask.
    let mut o2 = vec![0.0; n];
    dropout_forward(&mut o2, &inp, p, seed);
    assert_eq!(o, o2);
    dropout_forward(&mut o2, &inp, p, seed + 1);
    assert_ne!(o, o2);
}

#[test]
fn crossentropy_gradients_with_ignore_index() {
    let (n, v, vp) = (4, 6, 8);
    let mut rng = Rng::new(8);
    let logits = randn(&mut rng, n * vp, 1.0);
    let targets = [2i32, -100, 5, 0];
    let loss = |lg: &[f32]| {
        let (mut l, mut p) = (vec![0.0; n], vec![0.0; n * vp]);
        let cnt = crossentropy_forward(&mut l, &mut p, lg, &targets, v, vp, -100);
        l.iter().map(|&x| x as f64).sum::<f64>() / cnt as f64
    };
    let (mut l, mut p) = (vec![0.0; n], vec![0.0; n * vp]);
    let cnt = crossentropy_forward(&mut l, &mut p, &logits, &targets, v, vp, -100);
    assert_eq!(cnt, 3);
    assert_eq!(l[1], 0.0);
    let mut dl = vec![0.0; n * vp];
    crossentropy_backward(&mut dl, &p, &targets, 1.0 / cnt as f32, v, vp, -100);
    check("crossentropy.dlogits", &logits, &dl, loss);
    // Padded columns and ignored rows get no gradient.
    assert!(dl[vp..2 * vp].iter().all(|&x| x == 0.0));
    assert!(dl[v..vp].iter().all(|&x| x == 0.0));
}

fn attention_check(dropout: f32) {
    let dims = AttnDims { b: 2, t: 5, c: 8, nh: 2, ..Default::default() };
    let (b, t, c, nh) = (dims.b, dims.t, dims.c, dims.nh);
    let mut rng = Rng::new(9);
    let qkv = randn(&mut rng, b * t * 3 * c, 1.0);
    let dout = randn(&mut rng, b * t * c, 1.0);
    let seed = 5;
    let fwd = |x: &[f32]| {
        let (mut o, mut a) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
        attention_forward(&mut o, &mut a, x, &dims, AttnDropout { p: dropout, seed });
        dot(&o, &dout)
    };
    let (mut o, mut a) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
    attention_forward(&mut o, &mut a, &qkv, &dims, AttnDropout { p: dropout, seed });
    let mut dqkv = vec![0.0; qkv.len()];
    attention_backward(&mut dqkv, &dout, &qkv, &a, &dims, AttnDropout { p: dropout, seed });
    check(&format!("attention(dropout={dropout}).dqkv"), &qkv, &dqkv, fwd);
}

#[test]
fn attention_gradients() {
    attention_check(0.0);
}

#[test]
fn attention_gradients_with_dropout() {
    attention_check(0.25);
}

#[test]
fn attention_is_causal() {
    // Changing a future token's k/v must not change earlier outputs.
    let dims = AttnDims { b: 1, t: 6, c: 4, nh: 2, ..Default::default() };
    let mut rng = Rng::new(10);
    let mut qkv = randn(&mut rng, 6 * 12, 1.0);
    let (mut o1, mut a) = (vec![0.0; 24], vec![0.0; 2 * 36]);
    attention_forward(&mut o1, &mut a, &qkv, &dims, AttnDropout::NONE);
    for j in 4..12 {
        qkv[5 * 12 + j] += 1.0;
    }
    let mut o2 = vec![0.0; 24];
    attention_forward(&mut o2, &mut a, &qkv, &dims, AttnDropout::NONE);
    assert_eq!(o1[..20], o2[..20]);
    assert_ne!(o1[20..], o2[20..]);
}

#[test]
fn fused_lm_head_matches_unfused_and_finite_differences() {
    use tensor::classifier::{lm_head_crossentropy, HeadDims};
    // Vp = 5000 > the 8M-float chunk budget / n? No: force several chunks with many rows.
    let (n, c, v, vp) = (2100, 6, 3990, 4000);
    let mut rng = Rng::new(13);
    let inp = randn(&mut rng, n * c, 1.0);
    let w = randn(&mut rng, vp * c, 0.5);
    let targets: Vec<i32> = (0..n).map(|i| if i % 17 == 3 { -100 } else { (i * 7919 % v) as i32 }).collect();
    let rows = tensor::classifier::chunk_rows(n, vp, Default::default());
    assert!(rows < n, "the test must cross chunk boundaries");
    let mut scratch = vec![0.0; rows * vp];
    let (mut losses, mut dinp, mut dw) = (vec![0.0; n], vec![0.0; n * c], vec![0.0; vp * c]);
    let cnt = lm_head_crossentropy(&mut losses, Some((&mut dinp, &mut dw, tensor::classifier::Dloss::All(0.5))), &inp, &w, &targets, &mut scratch, &HeadDims { c, v, vp, offset: 0, ignore_index: -100, arith: Default::default(), softcap: 0.0 });
    // Unfused reference: matmul, cross-entropy forward and backward, matmul backward.
    let mut logits = vec![0.0; n * vp];
    matmul_forward(&mut logits, &inp, &w, None, n, c, vp);
    let (mut l2, mut probs) = (vec![0.0; n], vec![0.0; n * vp]);
    let cnt2 = crossentropy_forward(&mut l2, &mut probs, &logits, &targets, v, vp, -100);
    assert_eq!(cnt, cnt2);
    let mut dlogits = vec![0.0; n * vp];
    crossentropy_backward(&mut dlogits, &probs, &targets, 0.5, v, vp, -100);
    let (mut di2, mut dw2) = (vec![0.0; n * c], vec![0.0; vp * c]);
    matmul_backward((&mut di2, &mut dw2, None), &dlogits, &inp, &w, n, c, vp);
    let close = |a: &[f32], b: &[f32], what: &str| {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{what}[{i}]: {x} vs {y}");
        }
    };
    close(&losses, &l2, "losses");
    close(&dinp, &di2, "dinp");
    close(&dw, &dw2, "dweight");
    // Without gradients: same losses, nothing else touched.
    let mut l3 = vec![0.0; n];
    lm_head_crossentropy(&mut l3, None, &inp, &w, &targets, &mut scratch, &HeadDims { c, v, vp, offset: 0, ignore_index: -100, arith: Default::default(), softcap: 0.0 });
    assert_eq!(l3, losses);
}

#[test]
fn fused_lm_head_gradients() {
    use tensor::classifier::{lm_head_crossentropy, HeadDims};
    let (n, c, v, vp) = (5, 4, 6, 8);
    let mut rng = Rng::new(14);
    let inp = randn(&mut rng, n * c, 1.0);
    let w = randn(&mut rng, vp * c, 1.0);
    let targets = [1i32, 5, -100, 0, 3];
    let mut scratch = vec![0.0; n * vp];
    let loss = |x: &[f32], w: &[f32]| {
        let mut l = vec![0.0; n];
        let mut s = vec![0.0; n * vp];
        lm_head_crossentropy(&mut l, None, x, w, &targets, &mut s, &HeadDims { c, v, vp, offset: 0, ignore_index: -100, arith: Default::default(), softcap: 0.0 });
        l.iter().map(|&a| a as f64).sum::<f64>()
    };
    let (mut losses, mut dinp, mut dw) = (vec![0.0; n], vec![0.0; n * c], vec![0.0; vp * c]);
    lm_head_crossentropy(&mut losses, Some((&mut dinp, &mut dw, tensor::classifier::Dloss::All(1.0))), &inp, &w, &targets, &mut scratch, &HeadDims { c, v, vp, offset: 0, ignore_index: -100, arith: Default::default(), softcap: 0.0 });
    check("lm_head.dinp", &inp, &dinp, |x| loss(x, &w));
    check("lm_head.dweight", &w, &dw, |x| loss(&inp, x));
    assert!(dw[v * c..].iter().all(|&g| g == 0.0), "padded rows get no gradient");
}

/// A weight per row (a sequence objective's): the gradient of `Σ wᵢ·lossᵢ`, by finite
/// differences; and the vocabulary-parallel head over two slices gives the same losses and
/// (summed) input gradients, and each slice its rows of the weight gradient.
#[test]
fn fused_lm_head_weighs_each_row() {
    head_weighs_each_row(0.0);
}

/// [`fused_lm_head_weighs_each_row`] with soft-capped logits (Gemma 2's final cap): the loss
/// is the cross-entropy of `cap·tanh(z / cap)`, computed directly for one row, the gradients
/// match finite differences, and the vocabulary-parallel head agrees.
#[test]
fn soft_capped_lm_head_weighs_each_row() {
    head_weighs_each_row(1.5);
}

fn head_weighs_each_row(softcap: f32) {
    use tensor::classifier::{lm_head_crossentropy, lm_head_crossentropy_vocab_parallel, Dloss, HeadDims};
    let (n, c, v, vp) = (5, 4, 6, 8);
    let mut rng = Rng::new(15);
    let inp = randn(&mut rng, n * c, 1.0);
    let w = randn(&mut rng, vp * c, 1.0);
    let targets = [1i32, 5, -100, 0, 3];
    let rw = [0.5f32, -1.25, 9.0, 0.0, 2.0];
    let dims = HeadDims { c, v, vp, offset: 0, ignore_index: -100, arith: Default::default(), softcap };
    let loss = |x: &[f32], w: &[f32]| {
        let (mut l, mut s) = (vec![0.0; n], vec![0.0; n * vp]);
        lm_head_crossentropy(&mut l, None, x, w, &targets, &mut s, &dims);
        l.iter().zip(rw).map(|(&a, b)| a as f64 * b as f64).sum::<f64>()
    };
    let (mut losses, mut dinp, mut dw, mut scratch) = (vec![0.0; n], vec![0.0; n * c], vec![0.0; vp * c], vec![0.0; n * vp]);
    lm_head_crossentropy(&mut losses, Some((&mut dinp, &mut dw, Dloss::Rows(&rw))), &inp, &w, &targets, &mut scratch, &dims);
    if softcap > 0.0 {
        // Row 0 directly: log-softmax of the capped logits at its target.
        let z: Vec<f64> = (0..v).map(|j| (0..c).map(|k| inp[k] as f64 * w[j * c + k] as f64).sum::<f64>()).map(|z| softcap as f64 * (z / softcap as f64).tanh()).collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        assert!((losses[0] as f64 - (lse - z[targets[0] as usize])).abs() < 1e-5, "capped loss {} vs {}", losses[0], lse - z[targets[0] as usize]);
    }
    check("lm_head.dinp (row weights)", &inp, &dinp, |x| loss(x, &w));
    check("lm_head.dweight (row weights)", &w, &dw, |x| loss(&inp, x));
    // Two vocabulary slices of 4 rows (the second holding the 2 real rows 4, 5 and 2 padding).
    let slices = [(0usize, 4usize), (4, 2)];
    let mut parts = Vec::new();
    let mut mine_all: Vec<Vec<f32>> = vec![Vec::new(); 2];
    for pass in 0..2 {
        parts.clear();
        for (k, &(off, real)) in slices.iter().enumerate() {
            let d = HeadDims { c, v: real, vp: 4, offset: off, ignore_index: -100, arith: Default::default(), softcap };
            let (mut l, mut di, mut dwk, mut s) = (vec![0.0; n], vec![0.0; n * c], vec![0.0; 4 * c], vec![0.0; n * 4]);
            let others = mine_all.clone();
            lm_head_crossentropy_vocab_parallel(&mut l, Some((&mut di, &mut dwk, Dloss::Rows(&rw))), &inp, &w[off * c..(off + 4) * c], &targets, &mut s, &d, &mut |m| {
                // Rank order: each slice's [lse | target logit]; the first pass learns them.
                let mut all = Vec::new();
                for (j, o) in others.iter().enumerate() {
                    all.extend(if j == k || o.is_empty() { m.to_vec() } else { o.clone() });
                }
                mine_all[k] = m.to_vec();
                all
            });
            parts.push((l, di, dwk));
        }
        if pass == 0 {
            continue;
        }
        for (k, (l, _, dwk)) in parts.iter().enumerate() {
            for (i, (a, b)) in l.iter().zip(&losses).enumerate() {
                assert!((a - b).abs() < 1e-5, "slice {k} loss {i}: {a} vs {b}");
            }
            let off = slices[k].0;
            for (i, (a, b)) in dwk.iter().zip(&dw[off * c..(off + 4) * c]).enumerate() {
                assert!((a - b).abs() < 1e-5, "slice {k} dweight {i}: {a} vs {b}");
            }
        }
        for (i, d) in dinp.iter().enumerate() {
            let s = parts[0].1[i] + parts[1].1[i];
            assert!((s - d).abs() < 1e-5, "dinp {i}: {s} vs {d}");
        }
    }
}

/// `simd::exp` and `simd::exp_lanes` (the blocked form with fused multiply-adds that GELU and
/// SwiGLU use; each lane checked in a different position of the block).
#[test]
fn fast_exp_is_accurate() {
    let lanes = |x: f32| {
        let mut v = [0.5f32; tensor::simd::LANES];
        let l = x.to_bits() as usize % tensor::simd::LANES;
        v[l] = x;
        tensor::simd::exp_lanes(&mut v);
        v[l]
    };
    for exp in [tensor::simd::exp as fn(f32) -> f32, lanes] {
        for i in -2000..2000 {
            let x = i as f32 * 0.04;
            let (e, te) = (exp(x), x.exp());
            assert!((e - te).abs() <= 3e-7 * te.max(f32::MIN_POSITIVE), "exp({x}) = {e} vs {te}");
        }
        // The ends of the clamped range (2^n from the rounding's bits: n = -126 and 127), ties of
        // x·log2 e, NaN through, and what lies beyond the clamp.
        for x in [-87.3f32, 88.3, -87.0, 88.0, 0.5 * std::f32::consts::LN_2, -1.5 * std::f32::consts::LN_2, 0.0, -0.0] {
            let (e, te) = (exp(x), (x as f64).exp());
            assert!(((e as f64 - te) / te).abs() <= 3e-7, "exp({x}) = {e} vs {te}");
        }
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-1e4) > 0.0 && exp(-1e4) < 1e-37);
        assert!(exp(f32::INFINITY).is_finite() && exp(1e4) > 1e38);
    }
}
