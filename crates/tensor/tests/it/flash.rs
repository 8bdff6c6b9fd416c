//! FlashAttention-2 kernels (`tensor::flash`) against the materialised references
//! (`tensor::attention`, and `tensor::llama`'s GQA): outputs, log-sum-exp, gradients (with and
//! without dropout), finite differences, determinism across thread counts and schedules,
//! accumulation; GQA with `NKV == NH` against the MHA kernel bit for bit.

use tensor::attention::AttnDims;
use tensor::flash::*;
use tensor::llama::{gqa_attention_backward, gqa_attention_forward, GqaDims};
use tensor::*;
use crate::common::*;

fn dims(b: usize, t: usize, nh: usize, hs: usize) -> AttnDims {
    AttnDims { b, t, c: nh * hs, nh, ..Default::default() }
}

fn flash_fwd(qkv: &[f32], d: &AttnDims, p: f32, seed: u64, tiles: Tiles) -> (Vec<f32>, Vec<f32>) {
    let (mut o, mut l) = (vec![f32::NAN; d.b * d.t * d.c], vec![f32::NAN; d.b * d.nh * d.t]);
    flash_attention_forward_tiled(&mut o, &mut l, qkv, d, AttnDropout { p, seed }, tiles);
    (o, l)
}

fn flash_bwd(dout: &[f32], qkv: &[f32], d: &AttnDims, p: f32, seed: u64, tiles: Tiles, sched: Schedule) -> Vec<f32> {
    let (o, l) = flash_fwd(qkv, d, p, seed, tiles);
    let mut dqkv = vec![0.0; qkv.len()];
    flash_attention_backward_with(&mut dqkv, dout, qkv, &o, &l, d, BwdOpts { dropout: AttnDropout { p, seed }, tiles, schedule: sched });
    dqkv
}

fn reference(qkv: &[f32], dout: &[f32], d: &AttnDims, p: f32, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let (mut o, mut a) = (vec![0.0; d.b * d.t * d.c], vec![0.0; d.b * d.nh * d.t * d.t]);
    attention_forward(&mut o, &mut a, qkv, d, AttnDropout { p, seed });
    let mut dqkv = vec![0.0; qkv.len()];
    attention_backward(&mut dqkv, dout, qkv, &a, d, AttnDropout { p, seed });
    (o, dqkv)
}

/// `lse[b,h,i] = ln Σ_{j≤i} exp(q_i·k_j/√HS)` in f64, from the scores the reference forms.
fn reference_lse(qkv: &[f32], d: &AttnDims) -> Vec<f32> {
    let (t, c, nh) = (d.t, d.c, d.nh);
    let hs = c / nh;
    let scale = 1.0 / (hs as f64).sqrt();
    let mut out = vec![0.0; d.b * nh * t];
    for b in 0..d.b {
        for h in 0..nh {
            for i in 0..t {
                let q = &qkv[(b * t + i) * 3 * c + h * hs..][..hs];
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        let k = &qkv[(b * t + j) * 3 * c + c + h * hs..][..hs];
                        dot(q, k) * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s.iter().map(|x| (x - m).exp()).sum();
                out[(b * nh + h) * t + i] = (m + sum.ln()) as f32;
            }
        }
    }
    out
}

const TS: [usize; 5] = [1, 7, 64, 65, 130];
const HSS: [usize; 3] = [8, 16, 64];

#[test]
fn forward_matches_reference() {
    for &t in &TS {
        for &hs in &HSS {
            for &p in &[0.0f32, 0.2] {
                let d = dims(2, t, 3, hs);
                let mut rng = Rng::new(t as u64 * 1000 + hs as u64);
                let qkv = randn(&mut rng, d.b * t * 3 * d.c, 1.0);
                let (o, l) = flash_fwd(&qkv, &d, p, 77, Tiles::default());
                let mut ro = vec![0.0; o.len()];
                let mut att = vec![0.0; d.b * d.nh * t * t];
                attention_forward(&mut ro, &mut att, &qkv, &d, AttnDropout { p, seed: 77 });
                let (eo, el) = (max_err(&o, &ro), max_err(&l, &reference_lse(&qkv, &d)));
                assert!(eo < 1e-5, "out T={t} HS={hs} p={p}: err {eo}");
                assert!(el < 1e-5, "lse T={t} HS={hs} p={p}: err {el}");
            }
        }
    }
}

#[test]
fn backward_matches_reference() {
    for &t in &TS {
        for &hs in &HSS {
            for &p in &[0.0f32, 0.2] {
                let d = dims(2, t, 3, hs);
                let mut rng = Rng::new(t as u64 * 1000 + hs as u64 + 1);
                let qkv = randn(&mut rng, d.b * t * 3 * d.c, 1.0);
                let dout = randn(&mut rng, d.b * t * d.c, 1.0);
                let g = flash_bwd(&dout, &qkv, &d, p, 91, Tiles::default(), Schedule::Auto);
                let (_, rg) = reference(&qkv, &dout, &d, p, 91);
                let e = max_err(&g, &rg);
                assert!(e < 1e-5, "dqkv T={t} HS={hs} p={p}: err {e}");
            }
        }
    }
}

#[test]
fn small_and_unequal_tiles_match_reference() {
    // Many tiles per head, rectangular tiles, tiles wider than T: exercises the diagonal
    // masking, empty rows within a crossing tile and the trimmed last tiles.
    let tiles = [(4, 3), (3, 5), (8, 8), (16, 4), (1, 1), (200, 200)];
    for &(br, bc) in &tiles {
        for &p in &[0.0f32, 0.3] {
            let d = dims(2, 23, 2, 8);
            let mut rng = Rng::new(br as u64 * 31 + bc as u64);
            let qkv = randn(&mut rng, d.b * d.t * 3 * d.c, 1.5);
            let dout = randn(&mut rng, d.b * d.t * d.c, 1.0);
            let tl = Tiles { br, bc };
            let (o, l) = flash_fwd(&qkv, &d, p, 5, tl);
            let (ro, rg) = reference(&qkv, &dout, &d, p, 5);
            assert!(max_err(&o, &ro) < 1e-5, "out tiles {br}x{bc} p={p}");
            assert!(max_err(&l, &reference_lse(&qkv, &d)) < 1e-5, "lse tiles {br}x{bc}");
            for sched in [Schedule::PerHead, Schedule::TwoPass] {
                let g = flash_bwd(&dout, &qkv, &d, p, 5, tl, sched);
                let e = max_err(&g, &rg);
                assert!(e < 1e-5, "dqkv tiles {br}x{bc} p={p} {sched:?}: err {e}");
            }
        }
    }
}

fn flash_gradcheck(dropout: f32, tiles: Tiles) {
    let d = AttnDims { b: 2, t: 5, c: 8, nh: 2, ..Default::default() };
    let mut rng = Rng::new(9);
    let qkv = randn(&mut rng, d.b * d.t * 3 * d.c, 1.0);
    let dout = randn(&mut rng, d.b * d.t * d.c, 1.0);
    let seed = 5;
    let fwd = |x: &[f32]| dot(&flash_fwd(x, &d, dropout, seed, tiles).0, &dout);
    let g = flash_bwd(&dout, &qkv, &d, dropout, seed, tiles, Schedule::Auto);
    check(&format!("flash(dropout={dropout}, {tiles:?}).dqkv"), &qkv, &g, fwd);
}

#[test]
fn flash_gradients() {
    flash_gradcheck(0.0, Tiles::default());
    flash_gradcheck(0.0, Tiles { br: 2, bc: 3 });
}

#[test]
fn flash_gradients_with_dropout() {
    flash_gradcheck(0.25, Tiles::default());
    flash_gradcheck(0.25, Tiles { br: 2, bc: 3 });
}

fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
}

#[test]
fn deterministic_across_thread_counts_and_schedules() {
    // (B, NH) = (2, 3): 6 heads, `Auto` runs per head on 1 and 3 threads; (1, 2) on 3 threads
    // runs the two-pass schedule, on 1 thread per head: results must still agree bit for bit.
    for &(b, nh, p) in &[(2usize, 3usize, 0.0f32), (2, 3, 0.2), (1, 2, 0.0), (1, 2, 0.2)] {
        let d = dims(b, 130, nh, 16);
        let mut rng = Rng::new(3);
        let qkv = randn(&mut rng, b * d.t * 3 * d.c, 1.0);
        let dout = randn(&mut rng, b * d.t * d.c, 1.0);
        let run = || {
            let (mut o, mut l) = (vec![0.0; b * d.t * d.c], vec![0.0; b * nh * d.t]);
            flash_attention_forward(&mut o, &mut l, &qkv, &d, AttnDropout { p, seed: 8 });
            let mut g = vec![0.0; qkv.len()];
            flash_attention_backward(&mut g, &dout, &qkv, &o, &l, &d, AttnDropout { p, seed: 8 });
            (o, l, g)
        };
        let one = in_pool(1, run);
        let three = in_pool(3, run);
        assert!(one == three, "B={b} NH={nh} p={p}: 1 vs 3 threads differ");
        for sched in [Schedule::PerHead, Schedule::TwoPass] {
            let g = in_pool(3, || flash_bwd(&dout, &qkv, &d, p, 8, Tiles::default(), sched));
            assert!(g == one.2, "B={b} NH={nh} p={p}: {sched:?} differs");
        }
    }
}

#[test]
fn backward_accumulates() {
    let d = dims(2, 65, 3, 16);
    let mut rng = Rng::new(4);
    let qkv = randn(&mut rng, d.b * d.t * 3 * d.c, 1.0);
    let dout = randn(&mut rng, d.b * d.t * d.c, 1.0);
    for p in [0.0f32, 0.2] {
        let (o, l) = flash_fwd(&qkv, &d, p, 2, Tiles::default());
        let mut g = vec![0.0; qkv.len()];
        flash_attention_backward(&mut g, &dout, &qkv, &o, &l, &d, AttnDropout { p, seed: 2 });
        let once = g.clone();
        flash_attention_backward(&mut g, &dout, &qkv, &o, &l, &d, AttnDropout { p, seed: 2 });
        let twice: Vec<f32> = once.iter().map(|x| 2.0 * x).collect();
        assert!(max_err(&g, &twice) < 1e-6, "p={p}: second call did not add");
        assert!(once.iter().any(|&x| x != 0.0));
    }
}

#[test]
fn a_shard_drops_what_the_whole_model_drops_for_its_heads_and_sequences() {
    // Whole: 2 sequences, 4 heads. Shard: sequence 1 (b0 = 1) and heads 2..4 (head0 = 2 of
    // heads = 4), as a data-parallel rank holding a tensor-parallel slice would see them.
    let (t, hs, p) = (24, 4, 0.3);
    let whole = dims(2, t, 4, hs);
    let shard = AttnDims { b0: 1, head0: 2, heads: 4, ..dims(1, t, 2, hs) };
    let mut rng = Rng::new(31);
    let qkv = randn(&mut rng, whole.b * t * 3 * whole.c, 1.0);
    let dout = randn(&mut rng, whole.b * t * whole.c, 1.0);
    // Rows of sequence 1, columns of heads 2..4 in each of the `parts` blocks of `width`.
    let cut = |x: &[f32], parts: usize, width: usize| -> Vec<f32> {
        (0..t).flat_map(|i| (0..parts).flat_map(move |k| (2 * hs..4 * hs).map(move |j| (t + i) * parts * width + k * width + j))).map(|ix| x[ix]).collect()
    };
    let (o, _) = flash_fwd(&qkv, &whole, p, 9, Tiles::default());
    let (os, _) = flash_fwd(&cut(&qkv, 3, whole.c), &shard, p, 9, Tiles::default());
    assert_eq!(os, cut(&o, 1, whole.c), "forward");
    let g = flash_bwd(&dout, &qkv, &whole, p, 9, Tiles::default(), Schedule::Auto);
    let gs = flash_bwd(&cut(&dout, 1, whole.c), &cut(&qkv, 3, whole.c), &shard, p, 9, Tiles::default(), Schedule::Auto);
    assert_eq!(gs, cut(&g, 3, whole.c), "backward");
    // The reference kernels key their masks the same way.
    let (ro, rg) = reference(&cut(&qkv, 3, whole.c), &cut(&dout, 1, whole.c), &shard, p, 9);
    assert!(max_err(&ro, &os) < 1e-5 && max_err(&rg, &gs) < 1e-4);
}

#[test]
fn dropout_changes_output_and_seed_matters() {
    let d = dims(1, 40, 2, 8);
    let mut rng = Rng::new(6);
    let qkv = randn(&mut rng, d.t * 3 * d.c, 1.0);
    let (a, la) = flash_fwd(&qkv, &d, 0.0, 1, Tiles::default());
    let (b, lb) = flash_fwd(&qkv, &d, 0.5, 1, Tiles::default());
    let (c, _) = flash_fwd(&qkv, &d, 0.5, 2, Tiles::default());
    assert!(a != b && b != c);
    // lse is that of the undropped scores.
    assert_eq!(la, lb);
}

#[test]
fn long_sequence_matches_direct_rows() {
    // T = 3000: the reference would hold a 9M-float [T, T] block per head; flash needs only
    // tiles. Spot-check rows against a direct f64 softmax over all their keys.
    let d = dims(1, 3000, 2, 8);
    let (t, c, hs) = (d.t, d.c, 8);
    let mut rng = Rng::new(12);
    let qkv = randn(&mut rng, t * 3 * c, 1.0);
    let (o, l) = flash_fwd(&qkv, &d, 0.0, 0, Tiles::default());
    for h in 0..2 {
        for &i in &[0usize, 1, 63, 64, 1500, 2999] {
            let q = &qkv[i * 3 * c + h * hs..][..hs];
            let s: Vec<f64> = (0..=i).map(|j| dot(q, &qkv[j * 3 * c + c + h * hs..][..hs]) / (hs as f64).sqrt()).collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            assert!(((m + z.ln()) as f32 - l[h * t + i]).abs() < 1e-4, "lse row {i}");
            for e in 0..hs {
                let r: f64 = (0..=i).map(|j| (s[j] - m).exp() / z * qkv[j * 3 * c + 2 * c + h * hs + e] as f64).sum();
                assert!((r as f32 - o[i * c + h * hs + e]).abs() < 1e-5 * (1.0 + r.abs() as f32), "out row {i}");
            }
        }
    }
    let dout = randn(&mut rng, t * c, 1.0);
    let mut g = vec![0.0; qkv.len()];
    flash_attention_backward(&mut g, &dout, &qkv, &o, &l, &d, AttnDropout { p: 0.1, seed: 0 });
    assert!(g.iter().all(|x| x.is_finite()));
}

// ---------------------------------------------------------------------------------------------
// Grouped-query attention

const SCHEDULES: [Schedule; 4] = [Schedule::Auto, Schedule::PerHead, Schedule::TwoPass, Schedule::PerQueryHead];

fn gqa_flash_fwd(qkv: &[f32], d: &GqaDims, p: f32, seed: u64, tiles: Tiles) -> (Vec<f32>, Vec<f32>) {
    let (mut o, mut l) = (vec![f32::NAN; d.b * d.t * d.c()], vec![f32::NAN; d.b * d.nh * d.t]);
    flash_gqa_forward_tiled(&mut o, &mut l, qkv, d, AttnDropout { p, seed }, tiles);
    (o, l)
}

fn gqa_flash_bwd(dout: &[f32], qkv: &[f32], d: &GqaDims, p: f32, seed: u64, tiles: Tiles, sched: Schedule) -> Vec<f32> {
    let (o, l) = gqa_flash_fwd(qkv, d, p, seed, tiles);
    let mut dqkv = vec![0.0; qkv.len()];
    flash_gqa_backward_with(&mut dqkv, dout, qkv, &o, &l, d, BwdOpts { dropout: AttnDropout { p, seed }, tiles, schedule: sched });
    dqkv
}

fn gqa_reference(qkv: &[f32], dout: &[f32], d: &GqaDims) -> (Vec<f32>, Vec<f32>) {
    let (mut o, mut a) = (vec![0.0; d.b * d.t * d.c()], vec![0.0; d.b * d.nh * d.t * d.t]);
    gqa_attention_forward(&mut o, &mut a, qkv, d);
    let mut dqkv = vec![0.0; qkv.len()];
    gqa_attention_backward(&mut dqkv, dout, qkv, &a, d);
    (o, dqkv)
}

/// The MHA `[B, T, 3C]` qkv with each query head's kv head copied into its slot.
fn expand_kv(qkv: &[f32], d: &GqaDims) -> Vec<f32> {
    let (w, c, hs, group) = (d.qkv_width(), d.c(), d.hs, d.group());
    let mut e = vec![0.0; d.b * d.t * 3 * c];
    for r in 0..d.b * d.t {
        let (src, dst) = (&qkv[r * w..(r + 1) * w], &mut e[r * 3 * c..(r + 1) * 3 * c]);
        dst[..c].copy_from_slice(&src[..c]);
        for h in 0..d.nh {
            let g = h / group;
            dst[c + h * hs..c + (h + 1) * hs].copy_from_slice(&src[(d.nh + g) * hs..(d.nh + g + 1) * hs]);
            dst[2 * c + h * hs..2 * c + (h + 1) * hs]
                .copy_from_slice(&src[(d.nh + d.nkv + g) * hs..(d.nh + d.nkv + g + 1) * hs]);
        }
    }
    e
}

/// Gradient w.r.t. the expanded qkv folded back: a kv head's dk, dv sum over its group.
fn fold_kv(de: &[f32], d: &GqaDims) -> Vec<f32> {
    let (w, c, hs, group) = (d.qkv_width(), d.c(), d.hs, d.group());
    let mut g = vec![0.0; d.b * d.t * w];
    for r in 0..d.b * d.t {
        let (src, dst) = (&de[r * 3 * c..(r + 1) * 3 * c], &mut g[r * w..(r + 1) * w]);
        dst[..c].copy_from_slice(&src[..c]);
        for h in 0..d.nh {
            let kv = h / group;
            for e in 0..hs {
                dst[(d.nh + kv) * hs + e] += src[c + h * hs + e];
                dst[(d.nh + d.nkv + kv) * hs + e] += src[2 * c + h * hs + e];
            }
        }
    }
    g
}

/// `lse` in f64 via the expanded MHA layout.
fn gqa_reference_lse(qkv: &[f32], d: &GqaDims) -> Vec<f32> {
    reference_lse(&expand_kv(qkv, d), &AttnDims { b: d.b, t: d.t, c: d.c(), nh: d.nh, ..Default::default() })
}

fn gqa(b: usize, t: usize, nh: usize, nkv: usize, hs: usize) -> GqaDims {
    GqaDims { b, t, nh, nkv, hs, ..Default::default() }
}

#[test]
fn gqa_matches_materialised_reference() {
    for &t in &[1usize, 7, 65, 130] {
        for &hs in &[8usize, 16] {
            for &nkv in &[1usize, 2, 4] {
                let d = gqa(2, t, 4, nkv, hs);
                let mut rng = Rng::new(t as u64 * 100 + hs as u64 * 10 + nkv as u64);
                let qkv = randn(&mut rng, d.b * t * d.qkv_width(), 1.0);
                let dout = randn(&mut rng, d.b * t * d.c(), 1.0);
                let (o, l) = gqa_flash_fwd(&qkv, &d, 0.0, 0, Tiles::default());
                let (ro, rg) = gqa_reference(&qkv, &dout, &d);
                let (eo, el) = (max_err(&o, &ro), max_err(&l, &gqa_reference_lse(&qkv, &d)));
                assert!(eo < 1e-5, "out {d:?}: err {eo}");
                assert!(el < 1e-5, "lse {d:?}: err {el}");
                for sched in SCHEDULES {
                    let g = gqa_flash_bwd(&dout, &qkv, &d, 0.0, 0, Tiles::default(), sched);
                    let e = max_err(&g, &rg);
                    assert!(e < 1e-5, "dqkv {d:?} {sched:?}: err {e}");
                }
            }
        }
    }
}

#[test]
fn gqa_small_tiles_match_materialised_reference() {
    for &(br, bc) in &[(4usize, 3usize), (3, 5), (1, 1), (200, 200)] {
        for &nkv in &[1usize, 3, 6] {
            let d = gqa(2, 23, 6, nkv, 8);
            let mut rng = Rng::new(br as u64 * 31 + bc as u64 + nkv as u64);
            let qkv = randn(&mut rng, d.b * d.t * d.qkv_width(), 1.5);
            let dout = randn(&mut rng, d.b * d.t * d.c(), 1.0);
            let tl = Tiles { br, bc };
            let (o, _) = gqa_flash_fwd(&qkv, &d, 0.0, 0, tl);
            let (ro, rg) = gqa_reference(&qkv, &dout, &d);
            assert!(max_err(&o, &ro) < 1e-5, "out tiles {br}x{bc} NKV={nkv}");
            for sched in SCHEDULES {
                let e = max_err(&gqa_flash_bwd(&dout, &qkv, &d, 0.0, 0, tl, sched), &rg);
                assert!(e < 1e-5, "dqkv tiles {br}x{bc} NKV={nkv} {sched:?}: err {e}");
            }
        }
    }
}

#[test]
fn gqa_with_dropout_matches_expanded_mha_reference() {
    // GQA is MHA on a qkv whose kv heads are copied to every query head of their group, with
    // the kv gradients summed back over the group; the dropout mask is indexed by query head,
    // so this holds with dropout on too.
    for &(t, nkv, p) in &[(7usize, 1usize, 0.2f32), (65, 2, 0.2), (130, 2, 0.3), (33, 4, 0.1)] {
        let d = gqa(2, t, 4, nkv, 16);
        let md = AttnDims { b: d.b, t, c: d.c(), nh: d.nh, ..Default::default() };
        let mut rng = Rng::new(t as u64 + nkv as u64 * 7);
        let qkv = randn(&mut rng, d.b * t * d.qkv_width(), 1.0);
        let dout = randn(&mut rng, d.b * t * d.c(), 1.0);
        let (o, _) = gqa_flash_fwd(&qkv, &d, p, 13, Tiles::default());
        let (ro, rge) = reference(&expand_kv(&qkv, &d), &dout, &md, p, 13);
        assert!(max_err(&o, &ro) < 1e-5, "out T={t} NKV={nkv} p={p}");
        let rg = fold_kv(&rge, &d);
        for sched in SCHEDULES {
            let e = max_err(&gqa_flash_bwd(&dout, &qkv, &d, p, 13, Tiles::default(), sched), &rg);
            assert!(e < 1e-5, "dqkv T={t} NKV={nkv} p={p} {sched:?}: err {e}");
        }
    }
}

#[test]
fn gqa_with_nkv_equal_nh_is_the_mha_kernel_bit_for_bit() {
    // Same layout, same code: outputs, lse and gradients identical, dropout included, and the
    // backward accumulates onto a nonzero dqkv the same way.
    for &(t, p, tiles) in &[
        (65usize, 0.0f32, Tiles::default()),
        (130, 0.2, Tiles::default()),
        (23, 0.3, Tiles { br: 4, bc: 3 }),
        (1, 0.0, Tiles::default()),
    ] {
        let d = gqa(2, t, 3, 3, 16);
        let md = AttnDims { b: 2, t, c: 48, nh: 3, ..Default::default() };
        let mut rng = Rng::new(t as u64);
        let qkv = randn(&mut rng, d.b * t * d.qkv_width(), 1.0);
        let dout = randn(&mut rng, d.b * t * d.c(), 1.0);
        let init = randn(&mut rng, qkv.len(), 1.0);
        let (o, l) = gqa_flash_fwd(&qkv, &d, p, 21, tiles);
        let (mo, ml) = flash_fwd(&qkv, &md, p, 21, tiles);
        assert!(o == mo && l == ml, "forward T={t} p={p}");
        for sched in SCHEDULES {
            let (mut g, mut mg) = (init.clone(), init.clone());
            flash_gqa_backward_with(&mut g, &dout, &qkv, &o, &l, &d, BwdOpts { dropout: AttnDropout { p, seed: 21 }, tiles, schedule: sched });
            flash_attention_backward_with(&mut mg, &dout, &qkv, &mo, &ml, &md, BwdOpts { dropout: AttnDropout { p, seed: 21 }, tiles, schedule: sched });
            assert!(g == mg, "backward T={t} p={p} {sched:?}");
        }
        // The public entry points too.
        let (mut o2, mut l2) = (vec![0.0; o.len()], vec![0.0; l.len()]);
        flash_gqa_forward(&mut o2, &mut l2, &qkv, &d, AttnDropout { p, seed: 21 });
        let (mut mo2, mut ml2) = (vec![0.0; o.len()], vec![0.0; l.len()]);
        flash_attention_forward(&mut mo2, &mut ml2, &qkv, &md, AttnDropout { p, seed: 21 });
        assert!(o2 == mo2 && l2 == ml2);
        let (mut g, mut mg) = (init.clone(), init.clone());
        flash_gqa_backward(&mut g, &dout, &qkv, &o2, &l2, &d, AttnDropout { p, seed: 21 });
        flash_attention_backward(&mut mg, &dout, &qkv, &mo2, &ml2, &md, AttnDropout { p, seed: 21 });
        assert!(g == mg);
    }
}

fn gqa_gradcheck(dropout: f32, tiles: Tiles, nkv: usize) {
    let d = gqa(2, 5, 4, nkv, 4);
    let mut rng = Rng::new(19 + nkv as u64);
    let qkv = randn(&mut rng, d.b * d.t * d.qkv_width(), 1.0);
    let dout = randn(&mut rng, d.b * d.t * d.c(), 1.0);
    let fwd = |x: &[f32]| dot(&gqa_flash_fwd(x, &d, dropout, 5, tiles).0, &dout);
    let g = gqa_flash_bwd(&dout, &qkv, &d, dropout, 5, tiles, Schedule::Auto);
    check(&format!("flash_gqa(NKV={nkv}, dropout={dropout}, {tiles:?}).dqkv"), &qkv, &g, fwd);
}

#[test]
fn gqa_gradients() {
    for nkv in [1, 2] {
        gqa_gradcheck(0.0, Tiles::default(), nkv);
        gqa_gradcheck(0.0, Tiles { br: 2, bc: 3 }, nkv);
        gqa_gradcheck(0.25, Tiles::default(), nkv);
        gqa_gradcheck(0.25, Tiles { br: 2, bc: 3 }, nkv);
    }
}

#[test]
fn gqa_deterministic_across_thread_counts_and_schedules() {
    // B·NKV = 2: on 3 threads `Auto` splits beyond kv heads (per query head with partials, or
    // key tiles within a kv head), on 1 thread one task per kv head; (2, 6, 3): 6 kv tasks, per
    // kv head on both; every schedule explicitly, on 3 threads, against 1 thread's result.
    for &(b, nh, nkv, p) in &[(1usize, 4usize, 2usize, 0.0f32), (1, 4, 2, 0.2), (2, 6, 3, 0.0), (1, 4, 1, 0.2)] {
        let d = gqa(b, 130, nh, nkv, 16);
        let mut rng = Rng::new(3 + nkv as u64);
        let qkv = randn(&mut rng, b * d.t * d.qkv_width(), 1.0);
        let dout = randn(&mut rng, b * d.t * d.c(), 1.0);
        let run = || {
            let (mut o, mut l) = (vec![0.0; b * d.t * d.c()], vec![0.0; b * nh * d.t]);
            flash_gqa_forward(&mut o, &mut l, &qkv, &d, AttnDropout { p, seed: 8 });
            let mut g = vec![0.0; qkv.len()];
            flash_gqa_backward(&mut g, &dout, &qkv, &o, &l, &d, AttnDropout { p, seed: 8 });
            (o, l, g)
        };
        let one = in_pool(1, run);
        let three = in_pool(3, run);
        assert!(one == three, "{d:?} p={p}: 1 vs 3 threads differ");
        for sched in SCHEDULES {
            let g = in_pool(3, || gqa_flash_bwd(&dout, &qkv, &d, p, 8, Tiles::default(), sched));
            assert!(g == one.2, "{d:?} p={p}: {sched:?} differs");
        }
    }
}

#[test]
fn gqa_backward_accumulates() {
    let d = gqa(2, 65, 4, 2, 16);
    let mut rng = Rng::new(40);
    let qkv = randn(&mut rng, d.b * d.t * d.qkv_width(), 1.0);
    let dout = randn(&mut rng, d.b * d.t * d.c(), 1.0);
    for p in [0.0f32, 0.2] {
        let (o, l) = gqa_flash_fwd(&qkv, &d, p, 2, Tiles::default());
        let mut g = vec![0.0; qkv.len()];
        flash_gqa_backward(&mut g, &dout, &qkv, &o, &l, &d, AttnDropout { p, seed: 2 });
        let once = g.clone();
        flash_gqa_backward(&mut g, &dout, &qkv, &o, &l, &d, AttnDropout { p, seed: 2 });
        let twice: Vec<f32> = once.iter().map(|x| 2.0 * x).collect();
        assert!(max_err(&g, &twice) < 1e-6, "p={p}: second call did not add");
        assert!(once.iter().any(|&x| x != 0.0));
    }
}

/// Sliding-window attention (Mistral): the flash kernel against the materialised reference
/// with the same window, over tile shapes that put the window's edge inside, across and
/// between tiles, every backward schedule; a window at least T long is plain causal attention,
/// bit for bit.
#[test]
fn sliding_window_matches_materialised_reference() {
    for &(t, window) in &[(24usize, 8usize), (23, 1), (23, 5), (65, 16), (40, 39)] {
        for &(br, bc) in &[(4usize, 3usize), (8, 8), (64, 64), (1, 7)] {
            for &nkv in &[1usize, 2] {
                let d = GqaDims { window, ..gqa(2, t, 4, nkv, 8) };
                let mut rng = Rng::new(t as u64 * 7 + window as u64 + br as u64 * 13 + nkv as u64);
                let qkv = randn(&mut rng, d.b * t * d.qkv_width(), 1.5);
                let dout = randn(&mut rng, d.b * t * d.c(), 1.0);
                let tl = Tiles { br, bc };
                let (o, _) = gqa_flash_fwd(&qkv, &d, 0.0, 0, tl);
                let (ro, rg) = gqa_reference(&qkv, &dout, &d);
                let eo = max_err(&o, &ro);
                assert!(eo < 1e-5, "out T={t} W={window} tiles {br}x{bc} NKV={nkv}: err {eo}");
                for sched in SCHEDULES {
                    let e = max_err(&gqa_flash_bwd(&dout, &qkv, &d, 0.0, 0, tl, sched), &rg);
                    assert!(e < 1e-5, "dqkv T={t} W={window} tiles {br}x{bc} NKV={nkv} {sched:?}: err {e}");
                }
            }
        }
    }
    // The window changes the answer, and one of at least T positions does not.
    let d = gqa(1, 20, 2, 1, 8);
    let mut rng = Rng::new(77);
    let qkv = randn(&mut rng, d.t * d.qkv_width(), 1.0);
    let plain = gqa_flash_fwd(&qkv, &d, 0.0, 0, Tiles::default());
    assert_eq!(plain, gqa_flash_fwd(&qkv, &GqaDims { window: 20, ..d }, 0.0, 0, Tiles::default()));
    assert_ne!(plain.0, gqa_flash_fwd(&qkv, &GqaDims { window: 4, ..d }, 0.0, 0, Tiles::default()).0);
}

/// Finite differences through the windowed flash kernel, with and without dropout.
#[test]
fn sliding_window_gradients() {
    for &(p, tiles) in &[(0.0f32, Tiles { br: 2, bc: 3 }), (0.25, Tiles { br: 3, bc: 2 }), (0.25, Tiles::default())] {
        let d = GqaDims { window: 3, ..gqa(1, 7, 2, 1, 4) };
        let mut rng = Rng::new(19);
        let qkv = randn(&mut rng, d.b * d.t * d.qkv_width(), 1.0);
        let dout = randn(&mut rng, d.b * d.t * d.c(), 1.0);
        let fwd = |x: &[f32]| dot(&gqa_flash_fwd(x, &d, p, 5, tiles).0, &dout);
        let g = gqa_flash_bwd(&dout, &qkv, &d, p, 5, tiles, Schedule::Auto);
        check(&format!("flash window 3 (dropout={p}, {tiles:?}).dqkv"), &qkv, &g, fwd);
    }
}

/// Rows of `T` tokens packed with documents of the given lengths: each token's document start.
fn starts_of(t: usize, lens: &[usize]) -> Vec<u32> {
    let mut s = Vec::new();
    let mut at = 0;
    for &n in lens {
        s.extend(std::iter::repeat_n(at as u32, n));
        at += n;
    }
    assert_eq!(s.len(), t);
    s
}

/// Attention sinks (the first keys of a query's document stay visible beyond its sliding
/// window) against the materialised reference, with and without packed documents, every tile
/// shape and backward schedule.
#[test]
fn attention_sinks_match_materialised_reference() {
    for &(t, window, sinks, docs) in &[(24usize, 8usize, 2usize, &[][..]), (23, 5, 4, &[][..]), (65, 16, 3, &[][..]), (40, 6, 1, &[10, 25, 5][..]), (30, 4, 10, &[3, 27][..]), (33, 2, 3, &[33][..])] {
        for &(br, bc) in &[(4usize, 3usize), (8, 8), (64, 64), (1, 7)] {
            for &nkv in &[1usize, 2] {
                let d = GqaDims { window, sinks, ..gqa(2, t, 4, nkv, 8) };
                let starts: Vec<u32> = if docs.is_empty() { Vec::new() } else { [starts_of(t, docs), starts_of(t, docs)].concat() };
                let mut rng = Rng::new(t as u64 * 7 + sinks as u64 + br as u64 * 13 + nkv as u64);
                let qkv = randn(&mut rng, d.b * t * d.qkv_width(), 1.5);
                let dout = randn(&mut rng, d.b * t * d.c(), 1.0);
                let tl = Tiles { br, bc };
                let (mut o, mut l) = (vec![0.0; d.b * t * d.c()], vec![0.0; d.b * d.nh * t]);
                flash_gqa_forward_docs_tiled(&mut o, &mut l, &qkv, &d, &starts, AttnDropout::default(), tl);
                let (mut ro, mut att) = (vec![0.0; o.len()], vec![0.0; d.b * d.nh * t * t]);
                tensor::llama::gqa_attention_forward_docs(&mut ro, &mut att, &qkv, &d, &starts);
                let mut rg = vec![0.0; qkv.len()];
                gqa_attention_backward(&mut rg, &dout, &qkv, &att, &d);
                let what = format!("T={t} W={window} S={sinks} docs {docs:?} tiles {br}x{bc} NKV={nkv}");
                assert!(max_err(&o, &ro) < 1e-5, "out {what}: err {}", max_err(&o, &ro));
                for sched in SCHEDULES {
                    let mut g = vec![0.0; qkv.len()];
                    flash_gqa_backward_docs_with(&mut g, &dout, (&qkv, &o, &l), &d, &starts, BwdOpts { tiles: tl, schedule: sched, ..Default::default() });
                    assert!(max_err(&g, &rg) < 1e-5, "dqkv {what} {sched:?}: err {}", max_err(&g, &rg));
                }
            }
        }
    }
    // Sinks change a windowed answer; without a window (every key visible) they change nothing.
    let d = GqaDims { window: 4, ..gqa(1, 20, 2, 1, 8) };
    let mut rng = Rng::new(78);
    let qkv = randn(&mut rng, d.t * d.qkv_width(), 1.0);
    assert_ne!(gqa_flash_fwd(&qkv, &d, 0.0, 0, Tiles::default()).0, gqa_flash_fwd(&qkv, &GqaDims { sinks: 2, ..d }, 0.0, 0, Tiles::default()).0);
    let plain = GqaDims { window: 0, ..d };
    assert_eq!(gqa_flash_fwd(&qkv, &plain, 0.0, 0, Tiles::default()), gqa_flash_fwd(&qkv, &GqaDims { sinks: 2, ..plain }, 0.0, 0, Tiles::default()));
}

/// Finite differences through sinks and a window, with dropout.
#[test]
fn attention_sink_gradients() {
    for &(p, tiles) in &[(0.0f32, Tiles { br: 2, bc: 3 }), (0.25, Tiles { br: 3, bc: 2 }), (0.25, Tiles::default())] {
        let d = GqaDims { window: 3, sinks: 2, ..gqa(1, 9, 2, 1, 4) };
        let mut rng = Rng::new(23);
        let qkv = randn(&mut rng, d.b * d.t * d.qkv_width(), 1.0);
        let dout = randn(&mut rng, d.b * d.t * d.c(), 1.0);
        let fwd = |x: &[f32]| dot(&gqa_flash_fwd(x, &d, p, 5, tiles).0, &dout);
        let g = gqa_flash_bwd(&dout, &qkv, &d, p, 5, tiles, Schedule::Auto);
        check(&format!("flash window 3 sinks 2 (dropout={p}, {tiles:?}).dqkv"), &qkv, &g, fwd);
    }
}

/// Gemma 2's soft-capped attention logits with Gemma's scale: the flash forward equals a direct
/// f64 `softmax(cap·tanh(q·k·scale / cap))·v` under a sliding window, and its gradients match
/// finite differences over default and small tiles, with dropout too, every schedule alike.
#[test]
fn softcapped_logits_match_direct_rows_and_finite_differences() {
    let d = GqaDims { softcap: 0.7, scale: 0.9, window: 4, ..gqa(2, 9, 4, 2, 4) };
    let (w, hs, c, group) = (d.qkv_width(), d.hs, d.c(), d.nh / d.nkv);
    let mut rng = Rng::new(41);
    let qkv = randn(&mut rng, d.b * d.t * w, 1.5);
    let (o, _) = gqa_flash_fwd(&qkv, &d, 0.0, 0, Tiles { br: 2, bc: 3 });
    let (cap, scale) = (d.softcap as f64, d.scale as f64);
    let at = |b: usize, i: usize, col: usize| &qkv[(b * d.t + i) * w + col..(b * d.t + i) * w + col + hs];
    let dot64 = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>();
    for b in 0..d.b {
        for h in 0..d.nh {
            let (kc, vc) = ((d.nh + h / group) * hs, (d.nh + d.nkv + h / group) * hs);
            for i in 0..d.t {
                let keys: Vec<usize> = (d.first_key(i)..=i).collect();
                let s: Vec<f64> = keys.iter().map(|&j| cap * (dot64(at(b, i, h * hs), at(b, j, kc)) * scale / cap).tanh()).collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for e in 0..hs {
                    let want: f64 = keys.iter().zip(&s).map(|(&j, x)| (x - m).exp() / z * at(b, j, vc)[e] as f64).sum();
                    let got = o[(b * d.t + i) * c + h * hs + e] as f64;
                    assert!((got - want).abs() < 1e-5, "b {b} h {h} i {i} e {e}: {got} vs {want}");
                }
            }
        }
    }
    let dout = randn(&mut rng, d.b * d.t * c, 1.0);
    for (p, tiles) in [(0.0, Tiles::default()), (0.0, Tiles { br: 2, bc: 3 }), (0.25, Tiles { br: 2, bc: 3 })] {
        let fwd = |x: &[f32]| dot(&gqa_flash_fwd(x, &d, p, 5, tiles).0, &dout);
        let g = gqa_flash_bwd(&dout, &qkv, &d, p, 5, tiles, Schedule::Auto);
        check(&format!("softcapped flash (dropout {p}, {tiles:?}).dqkv"), &qkv, &g, fwd);
        for sched in SCHEDULES {
            assert_eq!(gqa_flash_bwd(&dout, &qkv, &d, p, 5, tiles, sched), g, "{sched:?}");
        }
    }
}
