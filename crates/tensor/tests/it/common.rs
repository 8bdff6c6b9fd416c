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

/// A `../shared/fixtures` directory, or `None` (with a note) where it is absent.
pub fn fixture(name: &str) -> Option<std::path::PathBuf> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures").join(name);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipped: fixture {} not found", p.display());
        None
    }
}

/// F32 tensors of a safetensors file, by name with their expected shape.
pub struct SafeTensors {
    bytes: Vec<u8>,
}

impl SafeTensors {
    pub fn open(path: &std::path::Path) -> SafeTensors {
        SafeTensors { bytes: std::fs::read(path).unwrap() }
    }

    pub fn get(&self, name: &str, shape: &[usize]) -> Vec<f32> {
        let st = safetensors::SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap_or_else(|_| panic!("no tensor {name}"));
        assert_eq!(t.shape(), shape, "{name} shape");
        t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }
}
