//! Expert parallelism: an MoE layer whose experts are spread over `P` in-process ranks
//! (`tensor::moe` through `parallel::ep::EpComm`) against the whole layer on one rank, bit for
//! bit where the arithmetic is the same; capacity (dropping) per rank; the all-to-all byte
//! counts against the formula; `all_to_all_v` itself; and shard/unshard of a model by name.

use model::layout::gpt_layout;
use model::GptConfig;
use parallel::ep::{self, EpComm};
use parallel::{run_ranks, Comm, Op};
use tensor::moe::*;
use tensor::Rng;

fn randn(seed: u64, n: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0.0; n];
    Rng::new(seed).fill_normal(&mut v, std);
    v
}

/// One layer's inputs for `n` tokens.
struct Layer {
    x: Vec<f32>,
    dy: Vec<f32>,
    router: Vec<f32>,
    experts: Vec<f32>,
    shared: Vec<f32>,
}

impl Layer {
    fn random(d: &MoeDims, seed: u64) -> Layer {
        Layer {
            x: randn(seed, d.n * d.c, 1.0),
            dy: randn(seed + 1, d.n * d.c, 1.0),
            router: randn(seed + 2, d.router_size(), 0.7),
            experts: randn(seed + 3, d.experts_size(), 0.4),
            shared: randn(seed + 4, d.shared_size(), 0.4),
        }
    }
}

/// Forward and backward outputs of one rank.
#[derive(Clone, Debug)]
struct Out {
    y: Vec<f32>,
    dx: Vec<f32>,
    drouter: Vec<f32>,
    dexperts: Vec<f32>,
    dshared: Vec<f32>,
    stats: MoeStats,
    /// (bytes sent, received) by all-to-alls during forward and backward.
    a2a: (u64, u64),
}

/// Forward + backward of tokens `x`, `dy` (`d.n` of them) with `experts` (all, or this rank's
/// block with `ep`).
fn pass(d: &MoeDims, x: &[f32], dy: &[f32], l: &Layer, experts: &[f32], z: f32, mut ep: Option<&mut EpComm>) -> Out {
    let mut cache = MoeCache::new(*d);
    let mut y = vec![0.0; d.n * d.c];
    let stats = moe_forward(&mut y, &mut cache, MoeInputs { x, router_w: &l.router, experts_w: experts, shared_w: &l.shared, router_bias: &[] }, d, MoeLossWeights { aux: 0.0, z }, ep.as_deref_mut().map(|e| e as &mut dyn MoeExchange));
    let (mut dx, mut drouter, mut dexperts, mut dshared) = (vec![0.0; x.len()], vec![0.0; l.router.len()], vec![0.0; experts.len()], vec![0.0; l.shared.len()]);
    moe_backward(MoeGrads { dx: &mut dx, drouter_w: &mut drouter, dexperts_w: &mut dexperts, dshared_w: &mut dshared }, dy, &mut cache, MoeInputs { x, router_w: &l.router, experts_w: experts, shared_w: &l.shared, router_bias: &[] }, d, MoeLossWeights { aux: 0.0, z }, ep.map(|e| e as &mut dyn MoeExchange));
    Out { y, dx, drouter, dexperts, dshared, stats, a2a: (0, 0) }
}

/// Every rank's pass over its `n` tokens (rank `r`: tokens `r·n..`) with its block of experts.
fn sharded(d: &MoeDims, l: &Layer, p: usize, z: f32) -> Vec<Out> {
    let (n, c, es) = (d.n, d.c, d.expert_size());
    let el = d.e / p;
    run_ranks(p, |world| {
        let r = world.rank();
        let mut ex = EpComm { comm: world.split(&(0..p).collect::<Vec<_>>()), batch: None };
        let counters = world.counters();
        let before = counters.snapshot();
        let rows = r * n * c..(r + 1) * n * c;
        let mut o = pass(d, &l.x[rows.clone()], &l.dy[rows], l, &l.experts[r * el * es..(r + 1) * el * es], z, Some(&mut ex));
        let (_, s, rcv) = counters.snapshot().since(&before).get(Op::AllToAll);
        o.a2a = (s, rcv);
        o
    })
}

fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * scale, "{what}[{i}]: {x} vs {y}");
    }
}

/// Sums `f(out)` over ranks.
fn sum(outs: &[Out], f: impl Fn(&Out) -> &Vec<f32>) -> Vec<f32> {
    let mut s = f(&outs[0]).clone();
    for o in &outs[1..] {
        for (a, b) in s.iter_mut().zip(f(o)) {
            *a += b;
        }
    }
    s
}

#[test]
fn ep_sharded_moe_layer_matches_the_whole_layer() {
    // (P ranks, E experts, K, shared experts)
    for (p, e, k, s) in [(4, 8, 2, 0), (2, 4, 2, 0), (2, 4, 2, 1), (4, 4, 1, 1)] {
        let n = 12;
        let local = MoeDims { n, c: 8, f: 6, e, k, n_shared: s, capacity_factor: 0.0, renormalize: true, scoring: Default::default(), gate_scale: 1.0 };
        let whole_d = MoeDims { n: p * n, ..local };
        let l = Layer::random(&whole_d, 17 + p as u64);
        // The z-loss is a mean over tokens: each rank weighs its own by 1/P (exact: P is a power
        // of two). The aux loss is per routing group by definition, so it is left out here.
        let z = 0.5;
        let one = pass(&whole_d, &l.x, &l.dy, &l, &l.experts, z, None);
        let outs = sharded(&local, &l, p, z / p as f32);
        // Each rank's tokens through every expert locally: the same routing arithmetic (the
        // router's product has the same shape), so the exchange must reproduce it exactly.
        let per_rank: Vec<Out> = (0..p).map(|r| {
            let tok = r * n * local.c..(r + 1) * n * local.c;
            pass(&local, &l.x[tok.clone()], &l.dy[tok], &l, &l.experts, z / p as f32, None)
        }).collect();
        let es = whole_d.expert_size();
        let el = e / p;
        for (r, (o, q)) in outs.iter().zip(&per_rank).enumerate() {
            let tok = r * n * local.c..(r + 1) * n * local.c;
            let what = format!("p {p} e {e} k {k} rank {r}");
            // Rows travel and come back unchanged, and an expert's per-row arithmetic does not
            // depend on which other rows share its product: outputs and input gradients bit for
            // bit; the router's and shared experts' gradients too (this rank's tokens only).
            assert_eq!(o.y, q.y, "{what}: y");
            assert_eq!(o.dx, q.dx, "{what}: dx");
            assert_eq!(o.drouter, q.drouter, "{what}: router gradient");
            assert_eq!(o.dshared, q.dshared, "{what}: shared gradient");
            assert_eq!(o.stats.dropped_fraction, 0.0);
            // Against the whole layer over all P·N tokens: its router product has P× the rows
            // (the gemm crate may pick other kernels, last-bit differences), so close.
            close(&o.y, &one.y[tok.clone()], 1e-5, &format!("{what}: y vs whole"));
            close(&o.dx, &one.dx[tok], 1e-5, &format!("{what}: dx vs whole"));
            // This rank's experts saw every rank's rows: the whole layer's gradient.
            close(&o.dexperts, &one.dexperts[r * el * es..(r + 1) * el * es], 1e-5, &format!("{what}: expert gradients vs whole"));
        }
        // Replicated parameters: each rank's gradient covers its tokens; their sum is the whole
        // layer's (summed in another order: close, not equal).
        close(&sum(&outs, |o| &o.drouter), &one.drouter, 1e-5, "router gradient");
        close(&sum(&outs, |o| &o.dshared), &one.dshared, 1e-5, "shared gradient");
        // Rows that crossed: every rank sent what the others received.
        let sent: usize = outs.iter().map(|o| o.stats.ep_rows_sent).sum();
        let recv: usize = outs.iter().map(|o| o.stats.ep_rows_received).sum();
        assert_eq!(sent, recv);
        assert!(sent > 0);
        for o in &outs {
            // Bytes: counts ((P−1)·E/P u32s), then four row all-to-alls of C floats a row — the
            // dispatch and d(eo) send this rank's rows for other experts, the two returns send
            // back what it received.
            let c = local.c as u64;
            let rows = (o.stats.ep_rows_sent + o.stats.ep_rows_received) as u64;
            let want = 4 * ((p - 1) * el) as u64 + 2 * 4 * c * rows;
            assert_eq!(o.a2a.0, want, "p {p}: all-to-all bytes sent");
            let want_recv = 4 * ((p - 1) * el) as u64 + 2 * 4 * c * rows;
            assert_eq!(o.a2a.1, want_recv, "p {p}: all-to-all bytes received");
        }
    }
}

#[test]
fn ep_capacity_drops_per_rank_as_independent_routing_groups() {
    // With a capacity, each rank's routing is its own group (capacity from its own N tokens),
    // exactly as a data-parallel rank's: the ep-sharded layer equals P independent whole
    // layers over each rank's tokens, and differs from one layer over all P·N tokens.
    let (p, n) = (2, 16);
    let local = MoeDims { n, c: 8, f: 6, e: 4, k: 2, n_shared: 0, capacity_factor: 0.75, renormalize: true, scoring: Default::default(), gate_scale: 1.0 };
    let whole_d = MoeDims { n: p * n, ..local };
    let l = Layer::random(&whole_d, 5);
    let outs = sharded(&local, &l, p, 0.0);
    let per_rank: Vec<Out> = (0..p).map(|r| {
        let tok = r * n * local.c..(r + 1) * n * local.c;
        pass(&local, &l.x[tok.clone()], &l.dy[tok], &l, &l.experts, 0.0, None)
    }).collect();
    let (es, el) = (local.expert_size(), local.e / p);
    for (r, (o, q)) in outs.iter().zip(&per_rank).enumerate() {
        assert!(o.stats.dropped_fraction > 0.0, "the capacity drops something");
        assert_eq!(o.stats.dropped_fraction, q.stats.dropped_fraction);
        assert_eq!(o.y, q.y, "rank {r}: y");
        assert_eq!(o.dx, q.dx, "rank {r}: dx");
        // Rank r's experts collect the kept rows of every rank.
        let mut want = vec![0.0f32; el * es];
        for q in &per_rank {
            for (w, g) in want.iter_mut().zip(&q.dexperts[r * el * es..(r + 1) * el * es]) {
                *w += g;
            }
        }
        close(&o.dexperts, &want, 1e-5, "expert gradients");
    }
    let one = pass(&whole_d, &l.x, &l.dy, &l, &l.experts, 0.0, None);
    let mean_drop = outs.iter().map(|o| o.stats.dropped_fraction).sum::<f32>() / p as f32;
    let y: Vec<f32> = outs.iter().flat_map(|o| o.y.clone()).collect();
    assert!(mean_drop != one.stats.dropped_fraction || y != one.y, "per-rank capacity should differ from one routing group over all tokens");
}

#[test]
fn all_to_all_v_moves_variable_blocks_and_counts_their_bytes() {
    let p = 3;
    // Rank r sends (r + j + 1) elements to rank j, valued 100·r + j.
    let outs = run_ranks(p, |c| {
        let r = c.rank();
        let send: Vec<usize> = (0..p).map(|j| r + j + 1).collect();
        let recv: Vec<usize> = (0..p).map(|s| s + r + 1).collect();
        let input: Vec<f32> = (0..p).flat_map(|j| vec![(100 * r + j) as f32; r + j + 1]).collect();
        let mut out = vec![0.0; recv.iter().sum()];
        let before = c.counters().snapshot();
        c.all_to_all_v(&input, &send, &mut out, &recv);
        (out, c.counters().snapshot().since(&before).get(Op::AllToAll))
    });
    for (r, (out, (calls, sent, recv))) in outs.iter().enumerate() {
        let want: Vec<f32> = (0..p).flat_map(|s| vec![(100 * s + r) as f32; s + r + 1]).collect();
        assert_eq!(out, &want, "rank {r}");
        assert_eq!(*calls, 1);
        let others = |f: &dyn Fn(usize) -> usize| (0..p).filter(|&j| j != r).map(f).sum::<usize>() as u64 * 4;
        assert_eq!(*sent, others(&|j| r + j + 1));
        assert_eq!(*recv, others(&|s| s + r + 1));
    }
}

#[test]
fn ep_shards_hold_their_experts_by_name_and_unshard_to_the_whole() {
    let mut cfg = GptConfig::gpt2((2, 2, 16), 8, 32, false, 0.0, false);
    cfg.arch = model::config::Arch::Llama;
    (cfg.n_expert, cfg.top_k, cfg.n_shared_expert, cfg.ffn_hidden) = (4, 2, 1, 8);
    let (full, _) = gpt_layout(&cfg);
    let whole: Vec<f32> = (0..full.total).map(|i| i as f32).collect();
    let p = 2;
    let locals: Vec<_> = (0..p).map(|r| gpt_layout(&ep::local_config(&cfg, p, r).unwrap()).0).collect();
    let shards: Vec<Vec<f32>> = locals.iter().map(|l| ep::shard(&full, &whole, l)).collect();
    for (r, l) in locals.iter().enumerate() {
        let names: Vec<&str> = l.params.iter().map(|q| q.name.as_str()).filter(|n| n.contains(".experts.")).collect();
        let first = names.iter().filter(|n| n.starts_with("model.layers.0.") && n.ends_with("w1.weight")).copied().collect::<Vec<_>>();
        assert_eq!(first, (2 * r..2 * r + 2).map(|e| format!("model.layers.0.block_sparse_moe.experts.{e}.w1.weight")).collect::<Vec<_>>());
        // Only the routed experts are split: the router and the shared expert stay whole.
        assert!(l.params.iter().any(|q| q.name.ends_with("gate.weight") && q.shape == vec![4, 16]));
        assert!(l.params.iter().any(|q| q.name.contains("shared_experts.0")));
        assert_eq!(ep::expert_ranges(l).iter().map(|x| x.len()).sum::<usize>(), 2 * 2 * 3 * 8 * 16, "two layers × two experts");
    }
    let refs: Vec<&[f32]> = shards.iter().map(|s| &s[..]).collect();
    assert_eq!(ep::unshard(&full, &refs, &locals), whole);
    let names = |l: &model::ParamLayout| l.params.iter().map(|q| (q.name.clone(), q.offset)).collect::<Vec<_>>();
    assert_eq!(names(&ep::layout_of(&ep::local_config(&cfg, p, 0).unwrap(), 1)), names(&locals[1]));
    // The errors name the key.
    let e = ep::local_config(&cfg, 3, 0).unwrap_err();
    assert!(e.contains("parallel.ep = 3 does not divide model.n_expert = 4"), "{e}");
    cfg.n_expert = 0;
    let e = ep::local_config(&cfg, 2, 0).unwrap_err();
    assert!(e.contains("model.n_expert > 0"), "{e}");
}

#[test]
fn routing_statistics_over_the_batch_give_the_whole_layers_load_balancing_loss() {
    // The aux loss is f_e·P_e of a routing group: per rank it is not the batch's, but with the
    // statistics summed over the batch's ranks (`EpComm::batch`) each rank's loss value and its
    // tokens' gradients are the whole layer's (aux weight scaled by the rank's share 1/P, as
    // the trainer scales its losses).
    let (p, n, aux) = (2usize, 12usize, 0.5f32);
    let local = MoeDims { n, c: 8, f: 6, e: 4, k: 2, n_shared: 0, capacity_factor: 0.0, renormalize: true, scoring: Default::default(), gate_scale: 1.0 };
    let whole_d = MoeDims { n: p * n, ..local };
    let l = Layer::random(&whole_d, 41);
    let run = |batch: bool| {
        run_ranks(p, |world| {
            let r = world.rank();
            let all: Vec<usize> = (0..p).collect();
            let mut ex = EpComm { comm: world.split(&all), batch: batch.then(|| world.split(&all)) };
            let tok = r * n * local.c..(r + 1) * n * local.c;
            let el = local.e / p;
            let es = local.expert_size();
            let mut cache = MoeCache::new(local);
            let mut y = vec![0.0; n * local.c];
            let experts = &l.experts[r * el * es..(r + 1) * el * es];
            let st = moe_forward(&mut y, &mut cache, MoeInputs { x: &l.x[tok.clone()], router_w: &l.router, experts_w: experts, shared_w: &l.shared, router_bias: &[] }, &local, MoeLossWeights { aux: aux / p as f32, z: 0.0 }, Some(&mut ex));
            let (mut dx, mut dr, mut de, mut ds) = (vec![0.0; n * local.c], vec![0.0; l.router.len()], vec![0.0; experts.len()], vec![0.0; 0]);
            moe_backward(MoeGrads { dx: &mut dx, drouter_w: &mut dr, dexperts_w: &mut de, dshared_w: &mut ds }, &l.dy[tok.clone()], &mut cache, MoeInputs { x: &l.x[tok], router_w: &l.router, experts_w: experts, shared_w: &l.shared, router_bias: &[] }, &local, MoeLossWeights { aux: aux / p as f32, z: 0.0 }, Some(&mut ex));
            (st.aux_loss, dx, dr)
        })
    };
    let mut cache = MoeCache::new(whole_d);
    let mut y = vec![0.0; p * n * local.c];
    let st = moe_forward(&mut y, &mut cache, MoeInputs { x: &l.x, router_w: &l.router, experts_w: &l.experts, shared_w: &l.shared, router_bias: &[] }, &whole_d, MoeLossWeights { aux, z: 0.0 }, None);
    let (mut dx, mut dr, mut de, mut ds) = (vec![0.0; l.x.len()], vec![0.0; l.router.len()], vec![0.0; l.experts.len()], vec![0.0; 0]);
    moe_backward(MoeGrads { dx: &mut dx, drouter_w: &mut dr, dexperts_w: &mut de, dshared_w: &mut ds }, &l.dy, &mut cache, MoeInputs { x: &l.x, router_w: &l.router, experts_w: &l.experts, shared_w: &l.shared, router_bias: &[] }, &whole_d, MoeLossWeights { aux, z: 0.0 }, None);
    let grouped = run(true);
    let mut drouter = vec![0.0f32; dr.len()];
    for (r, (a, g, d)) in grouped.iter().enumerate() {
        assert!((a - st.aux_loss).abs() <= 1e-6 * st.aux_loss, "rank {r}: aux {a} vs whole {}", st.aux_loss);
        close(g, &dx[r * n * local.c..(r + 1) * n * local.c], 1e-5, "dx with the batch's statistics");
        drouter.iter_mut().zip(d).for_each(|(s, x)| *s += x);
    }
    close(&drouter, &dr, 1e-5, "router gradient with the batch's statistics");
    // Without the group each rank balances its own tokens: another loss.
    let alone = run(false);
    assert!(alone.iter().any(|(a, _, _)| (a - st.aux_loss).abs() > 1e-4), "per-rank aux should differ from the batch's");
}
