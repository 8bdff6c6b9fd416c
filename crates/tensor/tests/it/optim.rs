//! The optimizers beyond AdamW against their definitions: Lion's step, Muon's momentum, and the
//! Newton–Schulz iteration against the scalar polynomial it applies to each singular value.

use tensor::optim::{lion_update, muon_adjusted_lr, muon_apply, muon_momentum, newton_schulz, Lion, MuonAdjust, NewtonSchulz};
use tensor::Rng;

#[test]
fn lion_moves_each_weight_by_the_sign_of_the_interpolated_momentum() {
    let mut p = vec![1.0f32, -2.0, 0.5, 3.0];
    let g = vec![0.5f32, -0.25, 0.0, -1.0];
    let mut m = vec![0.0f32, 0.0, 0.0, 2.0];
    let h = Lion { lr: 0.1, beta1: 0.9, beta2: 0.99, weight_decay: 0.5 };
    lion_update(&mut p, &g, &mut m, &h);
    let decay = 1.0 - 0.1 * 0.5;
    // signs of 0.9·m + 0.1·g: +, −, 0 (no move), + (the momentum outweighs the gradient).
    let want = [1.0 * decay - 0.1, -2.0 * decay + 0.1, 0.5 * decay, 3.0 * decay - 0.1];
    for (a, b) in p.iter().zip(want) {
        assert!((a - b).abs() < 1e-6, "{p:?} vs {want:?}");
    }
    let want_m = [0.005, -0.0025, 0.0, 2.0 * 0.99 - 0.01];
    for (a, b) in m.iter().zip(want_m) {
        assert!((a - b).abs() < 1e-6, "{m:?}");
    }
}

#[test]
fn muon_momentum_is_an_average_with_a_nesterov_look_ahead() {
    let g = vec![1.0f32, -2.0];
    let (mut buf, mut out) = (vec![0.5f32, 0.5], vec![0.0f32; 2]);
    muon_momentum(&g, &mut buf, &mut out, 0.9, true);
    // buf = 0.9·buf + 0.1·g; out = 0.1·g + 0.9·buf
    let b = [0.9 * 0.5 + 0.1, 0.9 * 0.5 - 0.2];
    assert!((buf[0] - b[0]).abs() < 1e-6 && (buf[1] - b[1]).abs() < 1e-6, "{buf:?}");
    assert!((out[0] - (0.1 + 0.9 * b[0])).abs() < 1e-6 && (out[1] - (-0.2 + 0.9 * b[1])).abs() < 1e-6, "{out:?}");
    muon_momentum(&g, &mut buf, &mut out, 0.9, false);
    assert_eq!(out, buf);
}

/// A random `n × n` orthogonal matrix (Gram–Schmidt on normal columns), row-major.
fn orthogonal(n: usize, rng: &mut Rng) -> Vec<f64> {
    let mut q = vec![0.0f64; n * n];
    for j in 0..n {
        let mut v: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
        for k in 0..j {
            let d: f64 = (0..n).map(|i| v[i] * q[i * n + k]).sum();
            (0..n).for_each(|i| v[i] -= d * q[i * n + k]);
        }
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        (0..n).for_each(|i| q[i * n + j] = v[i] / norm);
    }
    q
}

/// `U · diag(s) · Vᵀ` for `U` `r × r`, `V` `c × c` (the first `r` columns of `V`).
fn compose(u: &[f64], s: &[f64], v: &[f64], r: usize, c: usize) -> Vec<f64> {
    let mut x = vec![0.0f64; r * c];
    for i in 0..r {
        for j in 0..c {
            x[i * c + j] = (0..r).map(|k| u[i * r + k] * s[k] * v[j * c + k]).sum();
        }
    }
    x
}

#[test]
fn newton_schulz_applies_its_quintic_to_each_singular_value() {
    let (r, c) = (6, 11);
    let mut rng = Rng::new(5);
    let (u, v) = (orthogonal(r, &mut rng), orthogonal(c, &mut rng));
    let s = [3.0, 2.0, 1.0, 0.5, 0.2, 0.05];
    let x = compose(&u, &s, &v, r, c);
    let ns = NewtonSchulz { bf16: false, ..NewtonSchulz::default() };
    // Each singular value goes through the same scalar map: σ/‖X‖_F, then σ ← aσ + bσ³ + cσ⁵.
    let fro = s.iter().map(|a| a * a).sum::<f64>().sqrt();
    let [a, b, cc] = ns.coefs.map(|k| k as f64);
    let f: Vec<f64> = s.iter().map(|&x| (0..ns.steps).fold(x / fro, |y, _| a * y + b * y.powi(3) + cc * y.powi(5))).collect();
    let want = compose(&u, &f, &v, r, c);
    let mut got: Vec<f32> = x.iter().map(|&a| a as f32).collect();
    newton_schulz(&mut got, (r, c), &ns);
    for (g, w) in got.iter().zip(&want) {
        assert!((*g as f64 - w).abs() < 2e-5, "{g} vs {w}");
    }
    // Every singular value lands near 1 (the iteration's point), far from 0.05 or 3.
    assert!(f.iter().all(|&y| (0.5..1.3).contains(&y)), "{f:?}");
    // A tall matrix is its transpose's result, transposed.
    let mut tall: Vec<f32> = (0..c * r).map(|k| x[(k % r) * c + k / r] as f32).collect();
    newton_schulz(&mut tall, (c, r), &ns);
    for k in 0..c * r {
        assert!((tall[k] - got[(k % r) * c + k / r]).abs() < 1e-6);
    }
    // In bf16 (as torch.optim.Muon runs it), within bf16's precision of the fp32 result.
    let mut half: Vec<f32> = x.iter().map(|&a| a as f32).collect();
    newton_schulz(&mut half, (r, c), &NewtonSchulz::default());
    let err = half.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(err > 0.0 && err < 0.05, "bf16 against fp32: {err}");
    assert!(half.iter().all(|&a| tensor::bf16::from_bf16(tensor::bf16::to_bf16(a)) == a), "bf16 result holds bf16 values");
}

#[test]
fn muon_learning_rate_adjustments_follow_their_definitions() {
    let lr = 0.02;
    assert_eq!(muon_adjusted_lr(lr, MuonAdjust::Original, (768, 3072)), lr);
    assert!((muon_adjusted_lr(lr, MuonAdjust::Original, (3072, 768)) - 2.0 * lr).abs() < 1e-12);
    assert!((muon_adjusted_lr(lr, MuonAdjust::MatchRmsAdamw, (768, 3072)) - 0.2 * lr * 3072f64.sqrt()).abs() < 1e-12);
    assert!((muon_adjusted_lr(lr, MuonAdjust::SpectralUnclamped, (768, 3072)) - 0.5 * lr).abs() < 1e-12);
    let mut p = vec![2.0f32, -1.0];
    muon_apply(&mut p, &[1.0, -1.0], 0.1, 0.5);
    assert_eq!(p, vec![0.9, -0.4]);
}

mod lean {
    use tensor::lean::{adamw_update_lean, dequantize, quantize, round_stochastic, Draws, LeanMoments, Moment, BLOCK};
    use tensor::{adamw_update, AdamW, Rng};

    /// Values over many orders of magnitude, some zero, in blocks of different scales.
    fn spread(n: usize, rng: &mut Rng, signed: bool) -> Vec<f32> {
        (0..n).map(|i| {
            let x = (rng.normal() as f32) * 10f32.powi(-(((i / 7) % 9) as i32)) * if i % BLOCK < 3 { 100.0 } else { 1.0 };
            let x = if signed { x } else { x * x };
            if i % 13 == 0 { 0.0 } else { x }
        }).collect()
    }

    #[test]
    fn eight_bit_moments_round_trip_exactly_and_keep_relative_precision() {
        let mut rng = Rng::new(3);
        for (which, signed, binades, step) in [(Moment::First, true, 15, 8.0), (Moment::Second, false, 15, 16.0)] {
            let n = 3 * BLOCK + 17;
            let x = spread(n, &mut rng, signed);
            let (mut c, mut s) = (vec![0u8; n], vec![0.0f32; n.div_ceil(BLOCK)]);
            quantize(which, &x, &mut c, &mut s);
            let mut y = vec![0.0f32; n];
            dequantize(which, &c, &s, &mut y);
            for (b, (xs, ys)) in x.chunks(BLOCK).zip(y.chunks(BLOCK)).enumerate() {
                assert_eq!(s[b], xs.iter().fold(0.0f32, |a, &v| a.max(v.abs())), "the scale is the block's largest magnitude");
                for (&a, &q) in xs.iter().zip(ys) {
                    assert!(a == 0.0 || q != 0.0 || signed, "a second moment never becomes 0");
                    assert!(a.signum() == q.signum() || q == 0.0, "the sign is kept: {a} → {q}");
                    if a.abs() >= s[b] * 2f32.powi(-binades) {
                        assert!((q - a).abs() <= a.abs() / (2.0 * step) * 1.0001, "{which:?}: {a} → {q} (scale {})", s[b]);
                    }
                }
            }
            // Dequantized values quantize back to the same codes and scales: state saved in
            // fp32 loads back bit for bit.
            let (mut c2, mut s2) = (vec![0u8; n], vec![0.0f32; s.len()]);
            quantize(which, &y, &mut c2, &mut s2);
            assert_eq!((c2, s2), (c, s), "{which:?} round trip");
        }
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        let x = 1.0f32 + 1.0 / 512.0; // a quarter of the way from 1 to the next bf16 value
        let mut rng = Rng::new(9);
        let n = 40_000;
        let mean: f64 = (0..n).map(|_| tensor::bf16::from_bf16(round_stochastic(x, rng.next_u64() as u32)) as f64).sum::<f64>() / n as f64;
        assert!((mean - x as f64).abs() < 2e-4, "{mean} vs {x}");
        assert_eq!(round_stochastic(2.0, 0xFFFF), tensor::bf16::to_bf16(2.0), "a bf16 value stays");
    }

    /// 60 steps on random gradients: compact moments follow fp32 AdamW closely (their rounding
    /// noise, not a drift), bf16 weights with stochastic rounding too, and a run cut into two
    /// calls at its positions is the same run.
    #[test]
    fn adamw_on_compact_state_tracks_fp32_adamw() {
        let n = 2 * BLOCK + 40;
        let mut rng = Rng::new(1);
        let p0: Vec<f32> = (0..n).map(|_| rng.normal() as f32 * 0.1).collect();
        let grads: Vec<Vec<f32>> = (0..60).map(|k| (0..n).map(|i| (rng.normal() as f32) * 0.01 * (1.0 + (i % 5) as f32) + 1e-3 * (k % 3) as f32).collect()).collect();
        let h = |t: u64| AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1, t };
        let mut reference = p0.clone();
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        for (k, g) in grads.iter().enumerate() {
            adamw_update(&mut reference, g, &mut m, &mut v, &h(k as u64 + 1));
        }
        let moved = reference.iter().zip(&p0).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        for (form, round_params) in [("bf16", false), ("bf16 weights", true), ("int8", false)] {
            let mut p = p0.clone();
            if round_params {
                p.iter_mut().for_each(|x| *x = tensor::bf16::from_bf16(tensor::bf16::to_bf16(*x)));
            }
            let (mut mb, mut vb) = (vec![0u16; n], vec![0u16; n]);
            let (mut mc, mut vc, mut ms, mut vs) = (vec![0u8; n], vec![0u8; n], vec![0.0f32; n.div_ceil(BLOCK)], vec![0.0f32; n.div_ceil(BLOCK)]);
            for (k, g) in grads.iter().enumerate() {
                let st = if form == "int8" { LeanMoments::Int8 { m: (&mut mc, &mut ms), v: (&mut vc, &mut vs) } } else { LeanMoments::Bf16 { m: &mut mb, v: &mut vb } };
                adamw_update_lean(&mut p, g, st, &h(k as u64 + 1), Draws { seed: 5, at: 0, round_params });
            }
            let err = p.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            let rms = |x: &mut dyn Iterator<Item = f32>| (x.map(|a| (a as f64).powi(2)).sum::<f64>() / n as f64).sqrt();
            let (e2, m2) = (rms(&mut p.iter().zip(&reference).map(|(a, b)| a - b)), rms(&mut reference.iter().zip(&p0).map(|(a, b)| a - b)));
            // Measured: bf16 moments 0.5% (RMS), bf16 weights 2.5%, 8-bit moments 4.9%.
            let bound = match form { "bf16" => 0.01, "bf16 weights" => 0.04, _ => 0.07 };
            assert!(e2 < bound * m2 && err < 0.1 * moved, "{form}: {e2} (RMS) against a move of {m2}; largest {err} of {moved}");
            if round_params {
                assert!(p.iter().all(|&x| tensor::bf16::from_bf16(tensor::bf16::to_bf16(x)) == x), "bf16 weights stay bf16");
            }
        }
        // bf16: one call over the run, or two calls at their positions, give the same bits.
        let run = |cut: usize| {
            let mut p = p0.clone();
            let (mut mb, mut vb) = (vec![0u16; n], vec![0u16; n]);
            for (k, g) in grads.iter().take(5).enumerate() {
                let (p1, p2) = p.split_at_mut(cut);
                let (m1, m2) = mb.split_at_mut(cut);
                let (v1, v2) = vb.split_at_mut(cut);
                adamw_update_lean(p1, &g[..cut], LeanMoments::Bf16 { m: m1, v: v1 }, &h(k as u64 + 1), Draws { seed: 5, at: 0, round_params: true });
                adamw_update_lean(p2, &g[cut..], LeanMoments::Bf16 { m: m2, v: v2 }, &h(k as u64 + 1), Draws { seed: 5, at: cut as u64, round_params: true });
            }
            (p, mb, vb)
        };
        assert_eq!(run(n), run(123));
    }
}
