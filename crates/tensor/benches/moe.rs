//! Forward + backward time of the mixture-of-experts layer (E = 8, K = 2, F = 1024, capacity
//! factor 1.25, N = 1024 tokens of C = 768) against a dense SwiGLU MLP of the same active size
//! (F' = K·F). Prints one JSON object per line.
//!
//! `cargo bench -p tensor --bench moe` (threads: `RAYON_NUM_THREADS`, default 2; repetitions,
//! best taken: `MOE_REPS`, default 10).

use std::time::Instant;
use tensor::llama::{swiglu_backward, swiglu_forward};
use tensor::moe::*;
use tensor::*;

fn randn(rng: &mut Rng, n: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0.0; n];
    rng.fill_normal(&mut v, std);
    v
}

fn main() {
    let threads: usize = std::env::var("RAYON_NUM_THREADS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().unwrap();
    let reps: usize = std::env::var("MOE_REPS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    let (n, c, f, e, k) = (1024, 768, 1024, 8, 2);
    let d = MoeDims { n, c, f, e, k, n_shared: 0, capacity_factor: 1.25, renormalize: true, scoring: Default::default(), gate_scale: 1.0 };
    let mut rng = Rng::new(60);
    let (x, router, experts) = (randn(&mut rng, n * c, 1.0), randn(&mut rng, d.router_size(), 0.7), randn(&mut rng, d.experts_size(), 0.4));
    let dy = randn(&mut Rng::new(61), n * c, 1.0);
    let mut cache = MoeCache::new(d);
    let mut y = vec![0.0; n * c];
    let (mut gx, mut grouter, mut gexperts) = (vec![0.0; n * c], vec![0.0; d.router_size()], vec![0.0; d.experts_size()]);
    // Dense SwiGLU of the same active size: F' = K·F.
    let fd = k * f;
    let mut rng = Rng::new(62);
    let (wgu, w2) = (randn(&mut rng, 2 * fd * c, 0.02), randn(&mut rng, c * fd, 0.02));
    let (mut gu, mut h, mut out) = (vec![0.0; n * 2 * fd], vec![0.0; n * fd], vec![0.0; n * c]);
    let (mut dx, mut dwgu, mut dw2, mut dh, mut dgu) = (vec![0.0; n * c], vec![0.0; 2 * fd * c], vec![0.0; c * fd], vec![0.0; n * fd], vec![0.0; n * 2 * fd]);
    // Best of `reps` after one warm-up, the four timings interleaved so other load on the
    // machine hits all alike.
    let mut best = [f64::INFINITY; 4];
    let mut stats = None;
    for rep in 0..=reps {
        let mut time = |i: usize, f: &mut dyn FnMut()| {
            let t0 = Instant::now();
            f();
            if rep > 0 {
                best[i] = best[i].min(t0.elapsed().as_secs_f64());
            }
        };
        time(0, &mut || stats = Some(moe_forward(&mut y, &mut cache, MoeInputs { x: &x, router_w: &router, experts_w: &experts, shared_w: &[], router_bias: &[] }, &d, MoeLossWeights { aux: 0.01, z: 0.001 }, None)));
        time(1, &mut || moe_backward(MoeGrads { dx: &mut gx, drouter_w: &mut grouter, dexperts_w: &mut gexperts, dshared_w: &mut [] }, &dy, &mut cache, MoeInputs { x: &x, router_w: &router, experts_w: &experts, shared_w: &[], router_bias: &[] }, &d, MoeLossWeights { aux: 0.01, z: 0.001 }, None));
        time(2, &mut || {
            matmul_forward(&mut gu, &x, &wgu, None, n, c, 2 * fd);
            swiglu_forward(&mut h, &gu, fd);
            matmul_forward(&mut out, &h, &w2, None, n, fd, c);
        });
        time(3, &mut || {
            dh.fill(0.0);
            matmul_backward((&mut dh, &mut dw2, None), &dy, &h, &w2, n, fd, c);
            dgu.fill(0.0);
            swiglu_backward(&mut dgu, &dh, &gu, fd);
            matmul_backward((&mut dx, &mut dwgu, None), &dgu, &x, &wgu, n, c, 2 * fd);
        });
    }
    let st = stats.unwrap();
    // Forward is 2·N·K·C·3F flops, backward twice that.
    let gflops = |s: f64, mult: f64| mult * 2.0 * (n * k * c * 3 * f) as f64 / s / 1e9;
    println!("{{\"counts\":{:?},\"dropped_fraction\":{},\"threads\":{threads},\"reps\":{reps}}}", st.counts, st.dropped_fraction);
    let names = ["moe_forward (E=8, K=2, F=1024, cf=1.25)", "moe_backward", "dense swiglu forward (F=2048)", "dense swiglu backward"];
    for (i, name) in names.iter().enumerate() {
        println!("{{\"kernel\":\"{name}\",\"ms\":{:.3},\"GFLOP/s\":{:.1}}}", best[i] * 1e3, gflops(best[i], if i % 2 == 0 { 1.0 } else { 2.0 }));
    }
    println!("{{\"moe_over_dense_forward\":{:.3},\"moe_over_dense_backward\":{:.3}}}", best[0] / best[2], best[1] / best[3]);
}
