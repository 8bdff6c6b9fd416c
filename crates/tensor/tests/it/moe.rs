//! Mixture-of-experts layer (`tensor::moe`): finite-difference gradients of
//! `L = ⟨y, w⟩ + aux_weight·aux + z_weight·z` (dropless and dropping, with and without
//! renormalisation and shared experts), a naive per-token f64 reference, E = 1 against a dense
//! SwiGLU MLP, capacity/drop bookkeeping on a crafted routing, the aux and z losses by hand,
//! determinism across thread counts, accumulation, and the `mixtral-tiny` transformers fixture.

use tensor::llama::*;
use tensor::moe::*;
use tensor::*;
use crate::common::*;

/// `MoeDims` from its sizes `[N, C, F, E, K, S]` and routing policy.
fn dims([n, c, f, e, k, n_shared]: [usize; 6], capacity_factor: f32, renormalize: bool) -> MoeDims {
    MoeDims { n, c, f, e, k, n_shared, capacity_factor, renormalize, scoring: Default::default(), gate_scale: 1.0 }
}

struct Weights {
    x: Vec<f32>,
    router: Vec<f32>,
    experts: Vec<f32>,
    shared: Vec<f32>,
}

impl Weights {
    fn random(d: &MoeDims, rng: &mut Rng) -> Weights {
        Weights {
            x: randn(rng, d.n * d.c, 1.0),
            router: randn(rng, d.router_size(), 0.7),
            experts: randn(rng, d.experts_size(), 0.4),
            shared: randn(rng, d.shared_size(), 0.4),
        }
    }
    fn inputs(&self) -> MoeInputs<'_> {
        MoeInputs { x: &self.x, router_w: &self.router, experts_w: &self.experts, shared_w: &self.shared, router_bias: &[] }
    }
}

/// Smallest gap, over tokens, between the K-th and (K+1)-th largest router logit.
fn routing_margin(d: &MoeDims, x: &[f32], router: &[f32]) -> f32 {
    let mut m = f32::INFINITY;
    if d.k == d.e {
        return m;
    }
    for t in 0..d.n {
        let mut l: Vec<f32> = (0..d.e).map(|e| dot(&x[t * d.c..(t + 1) * d.c], &router[e * d.c..(e + 1) * d.c]) as f32).collect();
        l.sort_by(|a, b| b.total_cmp(a));
        m = m.min(l[d.k - 1] - l[d.k]);
    }
    m
}

/// Random weights whose routing has no near-tie (finite differences never flip a selection).
fn untied(d: &MoeDims, seed: u64) -> Weights {
    for s in 0..1000 {
        let w = Weights::random(d, &mut Rng::new(seed + 7919 * s));
        if routing_margin(d, &w.x, &w.router) > 0.15 {
            return w;
        }
    }
    panic!("no untied routing found");
}

fn forward(d: &MoeDims, w: &Weights, aux_w: f32, z_w: f32) -> (Vec<f32>, MoeStats, MoeCache) {
    let mut cache = MoeCache::new(*d);
    let mut y = vec![f32::NAN; d.n * d.c];
    let st = moe_forward(&mut y, &mut cache, w.inputs(), d, MoeLossWeights { aux: aux_w, z: z_w }, None);
    (y, st, cache)
}

struct Grads {
    x: Vec<f32>,
    router: Vec<f32>,
    experts: Vec<f32>,
    shared: Vec<f32>,
}

impl Grads {
    fn views(&mut self) -> MoeGrads<'_> {
        MoeGrads { dx: &mut self.x, drouter_w: &mut self.router, dexperts_w: &mut self.experts, dshared_w: &mut self.shared }
    }
}

fn backward(d: &MoeDims, w: &Weights, dy: &[f32], cache: &mut MoeCache, aux_w: f32, z_w: f32) -> Grads {
    let mut g = Grads {
        x: vec![0.0; w.x.len()],
        router: vec![0.0; w.router.len()],
        experts: vec![0.0; w.experts.len()],
        shared: vec![0.0; w.shared.len()],
    };
    moe_backward(g.views(), dy, cache, w.inputs(), d, MoeLossWeights { aux: aux_w, z: z_w }, None);
    g
}

fn gradcheck(d: MoeDims, seed: u64, aux_w: f32, z_w: f32) -> MoeStats {
    let w = untied(&d, seed);
    let dy = randn(&mut Rng::new(seed ^ 0xabc), d.n * d.c, 1.0);
    let loss = |w: &Weights| {
        let (y, st, _) = forward(&d, w, aux_w, z_w);
        dot(&y, &dy) + aux_w as f64 * st.aux_loss as f64 + z_w as f64 * st.z_loss as f64
    };
    let (_, st, mut cache) = forward(&d, &w, aux_w, z_w);
    let g = backward(&d, &w, &dy, &mut cache, aux_w, z_w);
    let tag = format!("moe(k={}, cf={}, renorm={}, S={})", d.k, d.capacity_factor, d.renormalize, d.n_shared);
    check(&format!("{tag}.dx"), &w.x, &g.x, |v| loss(&Weights { x: v.to_vec(), ..clone(&w) }));
    check(&format!("{tag}.drouter"), &w.router, &g.router, |v| loss(&Weights { router: v.to_vec(), ..clone(&w) }));
    check(&format!("{tag}.dexperts"), &w.experts, &g.experts, |v| loss(&Weights { experts: v.to_vec(), ..clone(&w) }));
    if d.n_shared > 0 {
        check(&format!("{tag}.dshared"), &w.shared, &g.shared, |v| loss(&Weights { shared: v.to_vec(), ..clone(&w) }));
    }
    st
}

fn clone(w: &Weights) -> Weights {
    Weights { x: w.x.clone(), router: w.router.clone(), experts: w.experts.clone(), shared: w.shared.clone() }
}

#[test]
fn gradients_dropless_topk_renormalized_with_shared_expert() {
    let st = gradcheck(dims([7, 8, 5, 4, 2, 1], 0.0, true), 1, 0.3, 0.2);
    assert_eq!(st.dropped_fraction, 0.0);
}

#[test]
fn gradients_switch_top1_raw_gate() {
    gradcheck(dims([9, 6, 4, 3, 1, 0], 0.0, false), 2, 0.5, 0.1);
}

#[test]
fn gradients_topk_without_renormalization() {
    gradcheck(dims([6, 6, 4, 5, 3, 0], 0.0, false), 3, 0.2, 0.3);
}

#[test]
fn gradients_with_dropped_tokens() {
    // capacity = ceil(0.5·12·2/4) = 3 slots per expert for 24 assignments: some must drop.
    let d = dims([12, 6, 4, 4, 2, 1], 0.5, true);
    assert_eq!(d.capacity(), 3);
    let st = gradcheck(d, 4, 0.4, 0.2);
    assert!(st.dropped_fraction > 0.0, "no token dropped: {st:?}");
    // and without renormalisation or shared experts, aux-weighted only.
    gradcheck(dims([12, 6, 4, 4, 2, 0], 0.75, false), 5, 1.0, 0.0);
}

// ---------------------------------------------------------------------------------------------
// Naive f64 reference: every selected expert computed for every token, one at a time.

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// One SwiGLU expert `w2 · (silu(w1·x) ⊙ w3·x)` in f64 from its `[w1 | w3 | w2]` block.
fn expert_ref(w: &[f32], x: &[f32], c: usize, f: usize) -> Vec<f64> {
    let (w1, w3, w2) = (&w[..f * c], &w[f * c..2 * f * c], &w[2 * f * c..]);
    let h: Vec<f64> = (0..f).map(|i| silu(dot(&w1[i * c..(i + 1) * c], x)) * dot(&w3[i * c..(i + 1) * c], x)).collect();
    (0..c).map(|o| (0..f).map(|i| w2[o * f + i] as f64 * h[i]).sum()).collect()
}

/// `(y, aux, z)` of the dropless layer, as HF Mixtral computes it plus shared experts.
fn moe_ref(d: &MoeDims, w: &Weights) -> (Vec<f32>, f64, f64) {
    let (c, f, e, k, es) = (d.c, d.f, d.e, d.k, d.expert_size());
    let mut y = vec![0.0f32; d.n * c];
    let (mut counts, mut psum, mut z) = (vec![0usize; e], vec![0.0f64; e], 0.0f64);
    for t in 0..d.n {
        let xt = &w.x[t * c..(t + 1) * c];
        let logits: Vec<f64> = (0..e).map(|ex| dot(xt, &w.router[ex * c..(ex + 1) * c])).collect();
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = logits.iter().map(|l| (l - m).exp()).sum();
        let p: Vec<f64> = logits.iter().map(|l| (l - m).exp() / s).collect();
        z += (m + s.ln()).powi(2);
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let sel = &order[..k];
        let norm: f64 = if d.renormalize { sel.iter().map(|&i| p[i]).sum() } else { 1.0 };
        let mut acc = vec![0.0f64; c];
        for &ex in sel {
            counts[ex] += 1;
            let o = expert_ref(&w.experts[ex * es..(ex + 1) * es], xt, c, f);
            for j in 0..c {
                acc[j] += p[ex] / norm * o[j];
            }
        }
        for sidx in 0..d.n_shared {
            let o = expert_ref(&w.shared[sidx * es..(sidx + 1) * es], xt, c, f);
            for j in 0..c {
                acc[j] += o[j];
            }
        }
        for ex in 0..e {
            psum[ex] += p[ex];
        }
        for j in 0..c {
            y[t * c + j] = acc[j] as f32;
        }
    }
    let aux = e as f64 * (0..e).map(|ex| counts[ex] as f64 / (d.n * k) as f64 * psum[ex] / d.n as f64).sum::<f64>();
    (y, aux, z / d.n as f64)
}

#[test]
fn dropless_matches_per_token_reference() {
    for (d, seed) in [(dims([37, 16, 12, 6, 3, 2], 0.0, true), 11), (dims([40, 12, 8, 8, 2, 0], 0.0, false), 12), (dims([33, 8, 6, 4, 1, 1], 0.0, false), 13)] {
        let w = untied(&d, seed);
        let (y, st, cache) = forward(&d, &w, 0.01, 0.001);
        let (want, aux, z) = moe_ref(&d, &w);
        let err = max_err(&y, &want);
        assert!(err < 1e-5, "{d:?}: max error {err}");
        assert!((st.aux_loss as f64 - aux).abs() < 1e-5 * aux, "aux {} vs {aux}", st.aux_loss);
        assert!((st.z_loss as f64 - z).abs() < 1e-5 * z, "z {} vs {z}", st.z_loss);
        assert!((st.loss - (0.01 * st.aux_loss + 0.001 * st.z_loss)).abs() < 1e-7);
        assert_eq!(st.dropped_fraction, 0.0);
        assert_eq!(st.counts.iter().sum::<usize>(), d.n * d.k);
        assert_eq!(cache.rows(), d.n * d.k);
    }
}

// ---------------------------------------------------------------------------------------------
// E = 1, K = 1: the layer is a dense SwiGLU MLP (gate = softmax over one logit = 1).

#[test]
fn single_expert_is_a_swiglu_mlp() {
    for renormalize in [false, true] {
        let d = dims([10, 8, 6, 1, 1, 0], 0.0, renormalize);
        let w = Weights::random(&d, &mut Rng::new(20));
        let (n, c, f) = (d.n, d.c, d.f);
        let (wgu, w2) = w.experts.split_at(2 * f * c);
        let (mut gu, mut h, mut want) = (vec![0.0; n * 2 * f], vec![0.0; n * f], vec![0.0; n * c]);
        matmul_forward(&mut gu, &w.x, wgu, None, n, c, 2 * f);
        swiglu_forward(&mut h, &gu, f);
        matmul_forward(&mut want, &h, w2, None, n, f, c);
        let (y, st, mut cache) = forward(&d, &w, 0.0, 0.0);
        assert!(max_err(&y, &want) < 1e-6, "renorm={renormalize}: {}", max_err(&y, &want));
        assert!((st.aux_loss - 1.0).abs() < 1e-6, "aux {}", st.aux_loss);

        let dy = randn(&mut Rng::new(21), n * c, 1.0);
        let g = backward(&d, &w, &dy, &mut cache, 0.0, 0.0);
        let (mut dx, mut dwgu, mut dw2) = (vec![0.0; n * c], vec![0.0; 2 * f * c], vec![0.0; c * f]);
        let (mut dh, mut dgu) = (vec![0.0; n * f], vec![0.0; n * 2 * f]);
        matmul_backward((&mut dh, &mut dw2, None), &dy, &h, w2, n, f, c);
        swiglu_backward(&mut dgu, &dh, &gu, f);
        matmul_backward((&mut dx, &mut dwgu, None), &dgu, &w.x, wgu, n, c, 2 * f);
        assert!(max_err(&g.x, &dx) < 1e-5, "dx");
        assert!(max_err(&g.experts, &[dwgu, dw2].concat()) < 1e-5, "dexperts");
        assert!(g.router.iter().all(|v| v.abs() < 1e-6), "router gradient with one expert");
    }
}

// ---------------------------------------------------------------------------------------------
// Capacity, drops and the losses on crafted routings.

/// Router `Wr = 4·I` (C = E) and tokens `x_t = one-hot(route[t])` (+ `second` at a second
/// expert for top-2), so token t's logits are `[4·x_t]`.
fn crafted(route: &[usize], second: Option<&[usize]>, e: usize) -> (Vec<f32>, Vec<f32>) {
    let mut x = vec![0.0; route.len() * e];
    for (t, &r) in route.iter().enumerate() {
        x[t * e + r] = 1.0;
        if let Some(s) = second {
            x[t * e + s[t]] = 0.5;
        }
    }
    let mut wr = vec![0.0; e * e];
    for i in 0..e {
        wr[i * e + i] = 4.0;
    }
    (x, wr)
}

#[test]
fn capacity_counts_drops_in_token_order() {
    // top-1, E = 4, N = 8, capacity = ceil(1.0·8·1/4) = 2.
    let route = [0, 0, 1, 0, 0, 2, 1, 0];
    let (x, router) = crafted(&route, None, 4);
    let d = dims([8, 4, 3, 4, 1, 0], 1.0, false);
    assert_eq!(d.capacity(), 2);
    let mut rng = Rng::new(30);
    let w = Weights { x, router, experts: randn(&mut rng, d.experts_size(), 0.5), shared: vec![] };
    let (y, st, cache) = forward(&d, &w, 0.0, 0.0);
    assert_eq!(st.counts, vec![5, 2, 1, 0]);
    assert_eq!(st.max_load, 5);
    assert_eq!(st.mean_load, 2.0);
    assert!((st.dropped_fraction - 3.0 / 8.0).abs() < 1e-7, "{}", st.dropped_fraction);
    // Expert 0 keeps tokens 0 and 1; tokens 3, 4 and 7 (later in token order) are dropped.
    assert_eq!(cache.offsets, vec![0, 2, 4, 5, 5]);
    assert_eq!(&cache.row_token[..5], &[0, 1, 2, 6, 5]);
    assert_eq!(cache.slot, vec![0, 1, 2, DROPPED, DROPPED, 4, 3, DROPPED]);
    for t in [3, 4, 7] {
        assert!(y[t * 4..(t + 1) * 4].iter().all(|&v| v == 0.0), "dropped token {t} has output");
    }
    // kept tokens equal the dropless layer's output
    let (yd, std, _) = forward(&MoeDims { capacity_factor: 0.0, ..d }, &w, 0.0, 0.0);
    assert_eq!(std.dropped_fraction, 0.0);
    for t in [0, 1, 2, 5, 6] {
        assert!(max_err(&y[t * 4..(t + 1) * 4], &yd[t * 4..(t + 1) * 4]) < 1e-6, "kept token {t}");
    }

    // top-2: first choices [0, 0, 0, 1], second [1, 1, 2, 0]; capacity = ceil(0.5·4·2/3) = 2.
    // Assignments in token order then rank: (0:e0)(0:e1)(1:e0)(1:e1)(2:e0 dropped)(2:e2)
    // (3:e1 dropped)(3:e0 dropped).
    let (x, router) = crafted(&[0, 0, 0, 1], Some(&[1, 1, 2, 0]), 3);
    let d = dims([4, 3, 2, 3, 2, 0], 0.5, true);
    assert_eq!(d.capacity(), 2);
    let w = Weights { x, router, experts: randn(&mut rng, d.experts_size(), 0.5), shared: vec![] };
    let (_, st, cache) = forward(&d, &w, 0.0, 0.0);
    assert_eq!(st.counts, vec![4, 3, 1]);
    assert_eq!(cache.idx, vec![0, 1, 0, 1, 0, 2, 1, 0]);
    assert_eq!(cache.slot, vec![0, 2, 1, 3, DROPPED, 4, DROPPED, DROPPED]);
    assert!((st.dropped_fraction - 3.0 / 8.0).abs() < 1e-7);
}

#[test]
fn capacity_formula() {
    // ceil(cf·N·K/E); f32 factors that are not exact binary fractions still land on the integer.
    assert_eq!(dims([1024, 8, 8, 8, 2, 0], 1.25, true).capacity(), 320);
    assert_eq!(dims([40, 8, 8, 8, 2, 0], 1.1, true).capacity(), 11);
    assert_eq!(dims([40, 8, 8, 8, 2, 0], 1.2, true).capacity(), 12);
    assert_eq!(dims([41, 8, 8, 8, 2, 0], 1.0, true).capacity(), 11);
    assert_eq!(dims([8, 8, 8, 64, 1, 0], 1.0, true).capacity(), 1);
    assert_eq!(dims([10, 8, 8, 2, 2, 0], 4.0, true).capacity(), 10, "at most N");
    assert_eq!(dims([10, 8, 8, 2, 2, 0], 0.0, true).capacity(), 10, "dropless");
}

#[test]
fn aux_loss_is_one_for_uniform_routing_and_z_loss_by_hand() {
    // Token t goes to expert t % E with logits 4·one-hot: f_e = P_e = 1/E by symmetry.
    let (e, n) = (4, 12);
    let route: Vec<usize> = (0..n).map(|t| t % e).collect();
    let (x, router) = crafted(&route, None, e);
    let d = dims([n, e, 3, e, 1, 0], 0.0, false);
    let w = Weights { x, router, experts: vec![0.1; d.experts_size()], shared: vec![] };
    let (_, st, _) = forward(&d, &w, 0.0, 0.0);
    assert_eq!(st.counts, vec![3; 4]);
    assert!((st.aux_loss - 1.0).abs() < 1e-6, "aux {}", st.aux_loss);
    // every row's logits are [4, 0, 0, 0] up to order: lse = ln(e⁴ + 3)
    let lse = (4f64.exp() + 3.0).ln();
    assert!((st.z_loss as f64 - lse * lse).abs() < 1e-5, "z {} vs {}", st.z_loss, lse * lse);

    // All tokens to expert 0: f = [1, 0, 0, 0], P_0 = e⁴/(e⁴+3) → aux = E·P_0.
    let (x, router) = crafted(&vec![0; n], None, e);
    let w = Weights { x, router, ..w };
    let (_, st, _) = forward(&d, &w, 0.0, 0.0);
    let p0 = 4f64.exp() / (4f64.exp() + 3.0);
    assert!((st.aux_loss as f64 - 4.0 * p0).abs() < 1e-5, "aux {} vs {}", st.aux_loss, 4.0 * p0);
    assert_eq!(st.max_load, n);

    // Zero router: logits 0, lse = ln E, z = ln²E; probs uniform so aux = 1 whatever the
    // (tie-broken → expert 0) routing.
    let w = Weights { router: vec![0.0; e * e], ..w };
    let (_, st, _) = forward(&d, &w, 0.0, 0.0);
    assert!((st.z_loss as f64 - (e as f64).ln().powi(2)).abs() < 1e-6);
    assert_eq!(st.counts, vec![n, 0, 0, 0], "ties go to the lower expert id");
}

// ---------------------------------------------------------------------------------------------
// Determinism and accumulation

fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
}

#[test]
fn deterministic_across_thread_counts() {
    for cf in [0.0f32, 1.25] {
        // Big enough that each expert's gemms split across threads.
        let d = dims([400, 64, 96, 8, 2, 1], cf, true);
        let w = Weights::random(&d, &mut Rng::new(40));
        let dy = randn(&mut Rng::new(41), d.n * d.c, 1.0);
        let run = || {
            let (y, st, mut cache) = forward(&d, &w, 0.01, 0.001);
            let g = backward(&d, &w, &dy, &mut cache, 0.01, 0.001);
            (y, st, g.x, g.router, g.experts, g.shared)
        };
        let one = in_pool(1, run);
        let three = in_pool(3, run);
        assert!(one == three, "cf={cf}: 1 vs 3 threads differ");
        if cf > 0.0 {
            assert!(one.1.dropped_fraction > 0.0);
        }
    }
}

#[test]
fn backward_accumulates_and_cache_is_reusable() {
    let d = dims([20, 8, 6, 4, 2, 1], 1.0, true);
    let w = Weights::random(&d, &mut Rng::new(50));
    let dy = randn(&mut Rng::new(51), d.n * d.c, 1.0);
    let (y0, _, mut cache) = forward(&d, &w, 0.1, 0.1);
    let g1 = backward(&d, &w, &dy, &mut cache, 0.1, 0.1);
    // A forward on other inputs, then the original again into the same cache.
    let other = Weights::random(&d, &mut Rng::new(52));
    let mut y = vec![0.0; y0.len()];
    moe_forward(&mut y, &mut cache, other.inputs(), &d, MoeLossWeights { aux: 0.1, z: 0.1 }, None);
    moe_forward(&mut y, &mut cache, w.inputs(), &d, MoeLossWeights { aux: 0.1, z: 0.1 }, None);
    assert_eq!(y, y0);
    let mut g = backward(&d, &w, &dy, &mut cache, 0.1, 0.1);
    moe_backward(g.views(), &dy, &mut cache, w.inputs(), &d, MoeLossWeights { aux: 0.1, z: 0.1 }, None);
    for (name, a, b) in [("dx", &g.x, &g1.x), ("drouter", &g.router, &g1.router), ("dexperts", &g.experts, &g1.experts), ("dshared", &g.shared, &g1.shared)] {
        let twice: Vec<f32> = b.iter().map(|v| 2.0 * v).collect();
        assert!(max_err(a, &twice) < 1e-6, "{name} does not accumulate");
    }
}

// ---------------------------------------------------------------------------------------------
// The transformers `mixtral-tiny` fixture (4 experts, top-2, renormalised).

#[test]
fn mixtral_tiny_fixture_logits_match_transformers() {
    let dir = fixture("mixtral-tiny");
    // config.json: hidden 64, 4 heads of 16, 2 kv heads, intermediate 96, 2 layers, 4 local
    // experts, 2 per token, rms_norm_eps 1e-5, rope_theta 10000, vocab 97, untied lm_head.
    let (c, nh, nkv, hs, f, layers, v, e, k) = (64, 4, 2, 16, 96, 2, 97, 4, 2);
    let st = SafeTensors::open(&dir.join("model.safetensors"));
    let (tokens, b, t) = fixture_tokens(&dir);
    let n = b * t;
    let gd = GqaDims { b, t, nh, nkv, hs, ..Default::default() };
    let (cos, sin) = rope_table(10_000.0, hs, t);
    let md = MoeDims { n, c, f, e, k, n_shared: 0, capacity_factor: 0.0, renormalize: true, scoring: Default::default(), gate_scale: 1.0 };
    let mut cache = MoeCache::new(md);

    let mut x = vec![0.0; n * c];
    embedding_forward(&mut x, &tokens, &st.get("model.embed_tokens.weight", &[v, c]), None, t, c);
    let (mut h, mut rstd, mut y) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n * c]);
    for l in 0..layers {
        let p = |s: &str, shape: &[usize]| st.get(&format!("model.layers.{l}.{s}"), shape);
        hf_attention_residual(&mut x, &st, l, &gd, &cos, &sin);
        // x = x + moe(norm(x)); experts_w per expert = [w1 | w3 | w2].
        rmsnorm_forward(&mut h, &mut rstd, &x, &p("post_attention_layernorm.weight", &[c]), 1e-5, c);
        let experts: Vec<f32> = (0..e)
            .flat_map(|ex| {
                let q = |m: &str, shape: &[usize]| p(&format!("block_sparse_moe.experts.{ex}.{m}.weight"), shape);
                [q("w1", &[f, c]), q("w3", &[f, c]), q("w2", &[c, f])].concat()
            })
            .collect();
        let router = p("block_sparse_moe.gate.weight", &[e, c]);
        let stats = moe_forward(&mut y, &mut cache, MoeInputs { x: &h, router_w: &router, experts_w: &experts, shared_w: &[], router_bias: &[] }, &md, MoeLossWeights::default(), None);
        eprintln!("mixtral-tiny layer {l}: counts {:?}, aux {}", stats.counts, stats.aux_loss);
        add_into(&mut x, &y);
    }
    assert_fixture_logits("mixtral-tiny", &dir, &st, &x, (b, t, c, v));
}

/// DeepSeek-V3's router (`Scoring::Sigmoid`): 8 experts in 4 groups, the token's 2 experts from
/// its 2 best groups (each scored by its two best biased sigmoids), a correction bias steering
/// the choice only, gates renormalised and scaled by 2.5, one shared expert. The layer equals a
/// per-token f64 reference of transformers' `DeepseekV3TopkRouter` + `DeepseekV3MoE`, and its
/// gradients match finite differences (the bias has none: it never reaches the output but
/// through the choice).
#[test]
fn sigmoid_group_limited_routing_matches_reference_and_finite_differences() {
    let d = MoeDims { scoring: Scoring::Sigmoid { groups: 4, topk_groups: 2 }, gate_scale: 2.5, ..dims([9, 6, 4, 8, 2, 1], 0.0, true) };
    let bias: Vec<f32> = (0..8).map(|i| 0.05 * i as f32 - 0.2).collect();
    let route = |w: &Weights, t: usize| -> (Vec<usize>, Vec<f64>, f64) {
        let xt = &w.x[t * d.c..(t + 1) * d.c];
        let p: Vec<f64> = (0..8).map(|ex| 1.0 / (1.0 + (-dot(xt, &w.router[ex * d.c..(ex + 1) * d.c])).exp())).collect();
        let ch: Vec<f64> = (0..8).map(|ex| p[ex] + bias[ex] as f64).collect();
        let gs: Vec<f64> = (0..4).map(|g| ch[2 * g] + ch[2 * g + 1]).collect();
        let mut go: Vec<usize> = (0..4).collect();
        go.sort_by(|&a, &b| gs[b].total_cmp(&gs[a]));
        let mut cand: Vec<usize> = (0..8).filter(|x| go[..2].contains(&(x / 2))).collect();
        cand.sort_by(|&a, &b| ch[b].total_cmp(&ch[a]));
        // The margins finite differences must not cross: group and expert choice.
        let margin = (gs[go[1]] - gs[go[2]]).min(ch[cand[1]] - ch[cand[2]]);
        (cand[..2].to_vec(), p, margin)
    };
    let w = (0..2000)
        .map(|s| Weights::random(&d, &mut Rng::new(91 + 7919 * s)))
        .find(|w| (0..d.n).all(|t| route(w, t).2 > 0.02))
        .expect("no untied routing");
    fn inputs<'a>(w: &'a Weights, bias: &'a [f32]) -> MoeInputs<'a> {
        MoeInputs { router_bias: bias, ..w.inputs() }
    }
    let run = |w: &Weights| {
        let mut cache = MoeCache::new(d);
        let mut y = vec![f32::NAN; d.n * d.c];
        moe_forward(&mut y, &mut cache, inputs(w, &bias), &d, MoeLossWeights::default(), None);
        (y, cache)
    };
    let (y, mut cache) = run(&w);
    let es = d.expert_size();
    for t in 0..d.n {
        let xt = &w.x[t * d.c..(t + 1) * d.c];
        let (sel, p, _) = route(&w, t);
        let norm: f64 = sel.iter().map(|&i| p[i]).sum::<f64>() + 1e-20;
        let mut want = expert_ref(&w.shared[..es], xt, d.c, d.f);
        for &ex in &sel {
            let o = expert_ref(&w.experts[ex * es..(ex + 1) * es], xt, d.c, d.f);
            for j in 0..d.c {
                want[j] += 2.5 * p[ex] / norm * o[j];
            }
        }
        let err = (0..d.c).map(|j| (y[t * d.c + j] as f64 - want[j]).abs()).fold(0.0, f64::max);
        assert!(err < 1e-5, "token {t}: {err}");
        let mut got: Vec<usize> = cache.idx[t * 2..t * 2 + 2].iter().map(|&i| i as usize).collect();
        got.sort();
        let mut sel = sel;
        sel.sort();
        assert_eq!(got, sel, "token {t}'s experts");
    }
    let dy = randn(&mut Rng::new(5), d.n * d.c, 1.0);
    let mut g = Grads { x: vec![0.0; w.x.len()], router: vec![0.0; w.router.len()], experts: vec![0.0; w.experts.len()], shared: vec![0.0; w.shared.len()] };
    moe_backward(g.views(), &dy, &mut cache, inputs(&w, &bias), &d, MoeLossWeights::default(), None);
    let loss = |w: &Weights| dot(&run(w).0, &dy);
    check("sigmoid moe.dx", &w.x, &g.x, |v| loss(&Weights { x: v.to_vec(), ..clone(&w) }));
    check("sigmoid moe.drouter", &w.router, &g.router, |v| loss(&Weights { router: v.to_vec(), ..clone(&w) }));
    check("sigmoid moe.dexperts", &w.experts, &g.experts, |v| loss(&Weights { experts: v.to_vec(), ..clone(&w) }));
    check("sigmoid moe.dshared", &w.shared, &g.shared, |v| loss(&Weights { shared: v.to_vec(), ..clone(&w) }));
}
