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
