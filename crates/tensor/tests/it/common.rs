//! Helpers shared by the kernel tests: random buffers and the finite-difference check.

use tensor::Rng;

pub fn randn(rng: &mut Rng, n: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0.0; n];
    rng.fill_normal(&mut v, std);
    v
}

pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// Compares `analytic` with central differences of `loss` w.r.t. `x` on every (or, for large
/// inputs, a sample of) element; fails on a relative error above 2% or when every checked
/// gradient is zero (a check that cannot fail checks nothing).
pub fn check(name: &str, x: &[f32], analytic: &[f32], loss: impl Fn(&[f32]) -> f64) {
    assert_eq!(x.len(), analytic.len());
    let eps = 1e-2f32;
    let stride = (x.len() / 97).max(1);
    let mut xp = x.to_vec();
    let mut nonzero = 0;
    for i in (0..x.len()).step_by(stride) {
        let orig = xp[i];
        xp[i] = orig + eps;
        let lp = loss(&xp);
        xp[i] = orig - eps;
        let lm = loss(&xp);
        xp[i] = orig;
        let num = (lp - lm) / (2.0 * eps as f64);
        let a = analytic[i] as f64;
        let err = (num - a).abs() / (num.abs().max(a.abs()).max(1e-1));
        assert!(err.is_finite() && err < 2e-2, "{name}[{i}]: numeric {num} vs analytic {a} (rel err {err})");
        nonzero += (a.abs() > 1e-6) as usize;
    }
    assert!(nonzero > 0, "{name}: every checked gradient is zero");
}

/// Largest `|a − b| / (1 + |b|)`.
pub fn max_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0.0, f32::max)
}
