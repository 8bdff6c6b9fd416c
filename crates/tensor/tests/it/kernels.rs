//! Behavioural tests of kernels beyond gradients: the decode path, the optimizer, the RNG.

use tensor::*;
use tensor::attention::AttnDims;
use tensor::llama::GqaDims;

#[test]
fn decode_attention_matches_full_attention_last_row() {
    let dims = AttnDims { b: 1, t: 7, c: 8, nh: 2, ..Default::default() };
    let mut rng = Rng::new(11);
    let mut qkv = vec![0.0; 7 * 24];
    rng.fill_normal(&mut qkv, 1.0);
    let (mut o, mut a) = (vec![0.0; 7 * 8], vec![0.0; 2 * 49]);
    attention_forward(&mut o, &mut a, &qkv, &dims, AttnDropout::NONE);
    let (mut k, mut v) = (vec![], vec![]);
    for t in 0..7 {
        k.extend_from_slice(&qkv[t * 24 + 8..t * 24 + 16]);
        v.extend_from_slice(&qkv[t * 24 + 16..t * 24 + 24]);
    }
    let mut out = vec![0.0; 8];
    attention_decode(&mut out, &qkv[6 * 24..6 * 24 + 8], &k, &v, &GqaDims { b: 1, t: 7, nh: 2, nkv: 2, hs: 4, ..Default::default() });
    for (x, y) in out.iter().zip(&o[48..56]) {
        assert!((x - y).abs() < 1e-5);
    }
}

#[test]
fn adamw_matches_hand_computed_step() {
    // One step from m = v = 0: update = lr·g/(|g| + eps) ≈ lr·sign(g), plus decay lr·wd·p.
    let mut p = vec![1.0f32, -2.0];
    let g = vec![0.5f32, -0.25];
    let (mut m, mut v) = (vec![0.0; 2], vec![0.0; 2]);
    let h = AdamW { lr: 0.1, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 1 };
    adamw_update(&mut p, &g, &mut m, &mut v, &h);
    assert!((p[0] - (1.0 * (1.0 - 0.01) - 0.1)).abs() < 1e-6, "{}", p[0]);
    assert!((p[1] - (-2.0 * (1.0 - 0.01) + 0.1)).abs() < 1e-6, "{}", p[1]);
    assert!((m[0] - 0.05).abs() < 1e-7 && (v[0] - 0.05 * 0.25).abs() < 1e-7);
}

/// 0/1 Adam's local steps keep the parameters as `anchor·Π(1 − lr·wd) − moves`; over several
/// steps with changing learning rates that is AdamW with the variance frozen (the momentum from
/// each step's gradient, decoupled decay included), step for step.
#[test]
fn zeroone_local_steps_are_frozen_variance_adamw_steps() {
    let n = 37;
    let mut rng = Rng::new(7);
    let anchor: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    let v: Vec<f32> = (0..n).map(|_| (rng.normal() as f32).powi(2) * 1e-2 + 1e-4).collect();
    let m0: Vec<f32> = (0..n).map(|_| rng.normal() as f32 * 0.1).collect();
    let (mut m_ref, mut m) = (m0.clone(), m0);
    let (mut p_ref, mut p, mut acc) = (anchor.clone(), anchor.clone(), vec![0.0f32; n]);
    let (var_updates, mut decay) = (12, 1.0f64);
    let rbc2 = (1.0 / (1.0 - (0.99f32 as f64).powi(var_updates as i32)).sqrt()) as f32;
    for k in 0..5u64 {
        let g: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
        let h = AdamW { lr: 0.01 * (k + 1) as f32, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1, t: 20 + k };
        m_ref.iter_mut().zip(&g).for_each(|(m, &g)| *m = h.beta1 * *m + (1.0 - h.beta1) * g);
        tensor::optim::adam_frozen_update(&mut p_ref, None, &m_ref, &v, &h, rbc2);
        decay *= 1.0 - (h.lr * h.weight_decay) as f64;
        tensor::optim::zeroone_local(&mut p, &g, (&mut m, &v), (&mut acc, &anchor), &h, var_updates, decay as f32);
        assert_eq!(m, m_ref, "step {k}: the momentum");
        for i in 0..n {
            assert!((p[i] - p_ref[i]).abs() <= 2e-6 * (1.0 + p_ref[i].abs()), "step {k}, element {i}: {} vs {}", p[i], p_ref[i]);
        }
    }
    // The moves carry no decay term: with zero gradients and momentum the parameters only decay.
    let (mut m, mut acc, mut q) = (vec![0.0f32; n], vec![0.0f32; n], anchor.clone());
    let h = AdamW { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1, t: 30 };
    tensor::optim::zeroone_local(&mut q, &vec![0.0; n], (&mut m, &v), (&mut acc, &anchor), &h, var_updates, 0.99);
    assert!(acc.iter().all(|&a| a == 0.0));
    assert!(q.iter().zip(&anchor).all(|(q, a)| *q == a * 0.99));
}

#[test]
fn rng_is_reproducible_and_restorable() {
    let mut a = Rng::new(42);
    let xs: Vec<u64> = (0..5).map(|_| a.next_u64()).collect();
    let state = a.state();
    let next = a.next_u64();
    let mut b = Rng::new(42);
    let ys: Vec<u64> = (0..5).map(|_| b.next_u64()).collect();
    assert_eq!(xs, ys);
    assert_eq!(Rng::from_state(state).next_u64(), next);
    // below() is in range and roughly uniform.
    let mut counts = [0usize; 4];
    for _ in 0..4000 {
        counts[a.below(4) as usize] += 1;
    }
    assert!(counts.iter().all(|&c| (900..1100).contains(&c)), "{counts:?}");
    // normal() has mean ≈ 0 and variance ≈ 1.
    let n: Vec<f64> = (0..20000).map(|_| a.normal()).collect();
    let mean = n.iter().sum::<f64>() / n.len() as f64;
    let var = n.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n.len() as f64;
    assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "{mean} {var}");
}

#[test]
fn reductions_are_thread_count_independent() {
    let mut rng = Rng::new(12);
    let mut x = vec![0.0f32; 100_000];
    rng.fill_normal(&mut x, 1.0);
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let three = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    let s1 = one.install(|| sum_squares(&x));
    let s3 = three.install(|| sum_squares(&x));
    assert_eq!(s1.to_bits(), s3.to_bits());
    let (n, c) = (300, 16);
    let dout: Vec<f32> = x[..n * c].to_vec();
    let run = |pool: &rayon::ThreadPool| {
        let mut db = vec![0.0; c];
        pool.install(|| tensor::matmul::bias_backward(&mut db, &dout, n, c));
        let mut dw = vec![0.0; c];
        let (mut di, m, r) = (vec![0.0; n * c], vec![0.1; n], vec![1.0; n]);
        pool.install(|| layernorm_backward((&mut di, &mut dw, None), &dout, &dout, &vec![1.0; c], (&m, &r), c));
        (db, dw)
    };
    assert_eq!(run(&one), run(&three));
}

#[test]
fn pooled_scratch_is_reused_not_reallocated() {
    // A buffer returned to the pool is handed out again (same allocation), zeroed.
    let ptr = {
        let mut a = tensor::par::pooled(1000);
        a[3] = 7.0;
        a.as_ptr()
    };
    let b = tensor::par::pooled(900);
    assert_eq!(b.as_ptr(), ptr);
    assert!(b.iter().all(|&x| x == 0.0));
    assert_eq!(b.len(), 900);
}

/// The overwriting backwards (`gelu_backward_into`, `swiglu_backward_into`,
/// `matmul_backward_into_as`) give, over a buffer of garbage, exactly what the accumulating
/// ones give over zeros, bit for bit; the weight gradient still accumulates.
#[test]
fn overwriting_backwards_equal_accumulating_into_zeros() {
    let mut rng = Rng::new(5);
    let (n, f) = (37, 24);
    let mut x = vec![0.0; n * 2 * f];
    let mut d = vec![0.0; n * 2 * f];
    rng.fill_normal(&mut x, 1.5);
    rng.fill_normal(&mut d, 1.0);
    let garbage = |len: usize| (0..len).map(|i| if i % 3 == 0 { f32::NAN } else { 1e30 }).collect::<Vec<f32>>();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let (mut acc, mut over) = (vec![0.0; n * f], garbage(n * f));
    gelu_backward(&mut acc, &d[..n * f], &x[..n * f]);
    gelu_backward_into(&mut over, &d[..n * f], &x[..n * f]);
    assert_eq!(bits(&acc), bits(&over), "gelu");
    let (mut acc, mut over) = (vec![0.0; n * 2 * f], garbage(n * 2 * f));
    tensor::llama::swiglu_backward(&mut acc, &d[..n * f], &x, f);
    tensor::llama::swiglu_backward_into(&mut over, &d[..n * f], &x, f);
    assert_eq!(bits(&acc), bits(&over), "swiglu");
    let (bt, c, oc) = (70, 48, 40);
    let (mut inp, mut w, mut dout) = (vec![0.0; bt * c], vec![0.0; oc * c], vec![0.0; bt * oc]);
    rng.fill_normal(&mut inp, 1.0);
    rng.fill_normal(&mut w, 0.5);
    rng.fill_normal(&mut dout, 1.0);
    for arith in [tensor::matmul::Arith::F32, tensor::matmul::Arith::Bf16] {
        let (mut di_a, mut dw_a, mut db_a) = (vec![0.0; bt * c], vec![0.25; oc * c], vec![0.5; oc]);
        let (mut di_o, mut dw_o, mut db_o) = (garbage(bt * c), vec![0.25; oc * c], vec![0.5; oc]);
        tensor::matmul::matmul_backward_as(arith, (&mut di_a, &mut dw_a, Some(&mut db_a)), &dout, &inp, &w, (bt, c, oc));
        tensor::matmul::matmul_backward_into_as(arith, (&mut di_o, &mut dw_o, Some(&mut db_o)), &dout, &inp, &w, (bt, c, oc));
        assert_eq!((bits(&di_a), bits(&dw_a), bits(&db_a)), (bits(&di_o), bits(&dw_o), bits(&db_o)), "{arith:?}");
        assert!(dw_o.iter().any(|&v| v != 0.25) && db_o[0] != 0.5);
    }
}
