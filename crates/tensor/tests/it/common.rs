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

/// A `../shared/fixtures` directory; a missing one fails the test, naming its path.
pub fn fixture(name: &str) -> std::path::PathBuf {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures").join(name);
    assert!(p.exists(), "fixture {} not found", p.display());
    p
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

/// The `input_ids` of a fixture's `tokens.json`, flattened, with (B, T).
pub fn fixture_tokens(dir: &std::path::Path) -> (Vec<u32>, usize, usize) {
    let toks = std::fs::read_to_string(dir.join("tokens.json")).unwrap();
    let body = &toks[toks.find("[[").unwrap() + 1..toks.rfind("]]").unwrap() + 1];
    let rows: Vec<Vec<u32>> = body
        .split(']')
        .filter(|r| r.contains('['))
        .map(|r| r[r.find('[').unwrap() + 1..].split(',').map(|x| x.trim().parse().unwrap()).collect())
        .collect();
    let (b, t) = (rows.len(), rows[0].len());
    (rows.concat(), b, t)
}

/// One LLaMA-family attention sub-block from HF weights, straight from the kernels:
/// `x = x + o_proj(attn(rope(qkv_proj(rmsnorm(x)))))` for layer `l` (rms eps 1e-5).
pub fn hf_attention_residual(x: &mut [f32], st: &SafeTensors, l: usize, d: &tensor::llama::GqaDims, cos: &[f32], sin: &[f32]) {
    use tensor::llama::*;
    use tensor::*;
    let tensor::llama::GqaDims { b, t, nh, nkv, hs, .. } = *d;
    let (n, c, w) = (b * t, nh * hs, d.qkv_width());
    let p = |s: &str, shape: &[usize]| st.get(&format!("model.layers.{l}.{s}"), shape);
    let (mut h, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    let (mut qkv, mut att, mut y) = (vec![0.0; n * w], vec![0.0; b * nh * t * t], vec![0.0; n * c]);
    rmsnorm_forward(&mut h, &mut rstd, x, &p("input_layernorm.weight", &[c]), 1e-5, c);
    let wqkv = [p("self_attn.q_proj.weight", &[nh * hs, c]), p("self_attn.k_proj.weight", &[nkv * hs, c]), p("self_attn.v_proj.weight", &[nkv * hs, c])].concat();
    matmul_forward(&mut qkv, &h, &wqkv, None, n, c, w);
    rope_forward(&mut qkv, cos, sin, d, 0);
    gqa_attention_forward(&mut y, &mut att, &qkv, d);
    matmul_forward(&mut h, &y, &p("self_attn.o_proj.weight", &[c, c]), None, n, c, c);
    add_into(x, &h);
}

/// Final RMSNorm and untied head over `x[B·T, C]` (its shape `(B, T, C, V)`), compared with the
/// fixture's logits (max |error| ≤ 1e-4).
pub fn assert_fixture_logits(name: &str, dir: &std::path::Path, st: &SafeTensors, x: &[f32], (b, t, c, v): (usize, usize, usize, usize)) {
    use tensor::llama::rmsnorm_forward;
    use tensor::matmul_forward;
    let n = b * t;
    let (mut h, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_forward(&mut h, &mut rstd, x, &st.get("model.norm.weight", &[c]), 1e-5, c);
    let mut logits = vec![0.0; n * v];
    matmul_forward(&mut logits, &h, &st.get("lm_head.weight", &[v, c]), None, n, c, v);
    let want = SafeTensors::open(&dir.join("expected.safetensors")).get("logits", &[b, t, v]);
    let err = logits.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    eprintln!("{name}: max |logit error| {err} over {} logits", want.len());
    assert!(err <= 1e-4, "max |logit error| {err}");
}
