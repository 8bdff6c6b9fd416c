//! Time of the LLaMA-family kernels on N = 1024 tokens of C = 768 (SwiGLU hidden 2048; RoPE
//! and materialised GQA attention with 12 heads of 64 and 4 kv heads, T = 1024), with the
//! multi-head attention kernel for comparison. Prints one JSON object per line: best of 5
//! after a warm-up, and the bandwidth its bytes moved give (memory-bound kernels only).
//!
//! `cargo bench -p tensor --bench llama` (threads: `RAYON_NUM_THREADS`, default 2).

use std::time::Instant;
use tensor::attention::AttnDims;
use tensor::llama::*;
use tensor::*;

fn randn(rng: &mut Rng, n: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0.0; n];
    rng.fill_normal(&mut v, std);
    v
}

/// Best of 5 runs of `f` after one warm-up; `bytes` moved per run (0: not memory-bound).
fn time(name: &str, bytes: usize, mut f: impl FnMut()) {
    f();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t0 = Instant::now();
        f();
        best = best.min(t0.elapsed().as_secs_f64());
    }
    if bytes > 0 {
        println!("{{\"kernel\":\"{name}\",\"ms\":{:.3},\"GB/s\":{:.1}}}", best * 1e3, bytes as f64 / best / 1e9);
    } else {
        println!("{{\"kernel\":\"{name}\",\"ms\":{:.3}}}", best * 1e3);
    }
}

fn main() {
    let threads: usize = std::env::var("RAYON_NUM_THREADS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().unwrap();
    let (n, c, f) = (1024, 768, 2048);
    let mut rng = Rng::new(40);
    let x = randn(&mut rng, n * c, 1.0);
    let wt = randn(&mut rng, c, 1.0);
    let (mut out, mut rs) = (vec![0.0; n * c], vec![0.0; n]);
    time("rmsnorm_forward", 8 * n * c, || rmsnorm_forward(&mut out, &mut rs, &x, &wt, 1e-5, c));
    let (mut di, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
    time("rmsnorm_backward", 16 * n * c, || rmsnorm_backward(&mut di, &mut dw, &x, &x, &wt, &rs, c));
    let gu = randn(&mut rng, n * 2 * f, 1.0);
    let mut h = vec![0.0; n * f];
    time("swiglu_forward", 12 * n * f, || swiglu_forward(&mut h, &gu, f));
    let mut dgu = vec![0.0; n * 2 * f];
    time("swiglu_backward", 28 * n * f, || swiglu_backward(&mut dgu, &h, &gu, f));
    // T = 1024, 12 heads of 64, 4 kv heads (GQA groups of 3).
    let d = GqaDims { b: 1, t: n, nh: 12, nkv: 4, hs: 64, ..Default::default() };
    let (cos, sin) = rope_table(10_000.0, d.hs, d.t);
    let mut qkv = randn(&mut rng, n * d.qkv_width(), 1.0);
    let rot = 8 * n * (d.nh + d.nkv) * d.hs;
    time("rope_forward", rot, || rope_forward(&mut qkv, &cos, &sin, &d, 0));
    time("rope_backward", rot, || rope_backward(&mut qkv, &cos, &sin, &d, 0));
    let (mut o, mut a) = (vec![0.0; n * d.c()], vec![0.0; d.nh * n * n]);
    time("gqa_attention_forward", 0, || gqa_attention_forward(&mut o, &mut a, &qkv, &d));
    let mut dq = vec![0.0; qkv.len()];
    time("gqa_attention_backward", 0, || gqa_attention_backward(&mut dq, &o, &qkv, &a, &d));
    let ad = AttnDims { b: 1, t: n, c: 768, nh: 12, ..Default::default() };
    let qkv3 = randn(&mut rng, n * 3 * 768, 1.0);
    time("attention_forward (MHA, for comparison)", 0, || attention_forward(&mut o, &mut a, &qkv3, &ad, AttnDropout::NONE));
}
