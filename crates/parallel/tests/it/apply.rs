//! `parallel::apply::parallelize` against one rank, in-crate (in-process ranks): the parts'
//! loss and gradients (reduced over data-parallel ranks, gathered from tensor-parallel shards
//! with `Applied::gather_whole`) equal the whole model's.

use model::{Gpt, GptConfig, Pass};
use parallel::apply::{parallelize, Strategy};
use parallel::run_ranks;

const B: usize = 4;
const T: usize = 8;
const V: usize = 32;

fn cfg() -> GptConfig {
    GptConfig::gpt2((2, 4, 16), T, V, true, 0.0, true)
}

fn batch() -> (Vec<u32>, Vec<i32>) {
    let x: Vec<u32> = (0..B * T).map(|i| ((i * 7 + 3) % V) as u32).collect();
    let y: Vec<i32> = (0..B * T).map(|i| ((i * 5 + 1) % V) as i32).collect();
    (x, y)
}

#[allow(clippy::single_range_in_vec_init)] // `stages`: one stage holding layers 0..2
fn strategy(dp: usize, tp: usize, sequence_parallel: bool) -> Strategy {
    Strategy {
        pp: 1, dp, ep: 1, tp, cp: 1, cp_mode: Default::default(), cp_zigzag: true, virtual_stages: 1, stages: vec![0..2], sequence_parallel, zero: 0, bucket_elems: 1 << 20, micro_batch: B,
        recompute: Default::default(), recompute_every: 1, precision: Default::default(), fp8_amax_history: 1, act_compression: Default::default(), zeropp: Default::default(),
    }
}

/// A Qwen3-style llama: per-head q and k norms (weights away from one), GQA 4:2.
fn qk_norm_cfg() -> GptConfig {
    GptConfig { arch: model::config::Arch::Llama, qk_norm: true, n_kv_head: 2, ffn_hidden: 24, ..GptConfig::gpt2((2, 4, 16), T, V, false, 0.0, false) }
}

/// The model every rank starts from: `cfg`'s, seed 7, per-head norm weights drawn away from one.
fn model(cfg: GptConfig) -> Gpt {
    let mut m = Gpt::new(cfg, V, 7);
    let mut rng = tensor::Rng::new(9);
    for p in m.layout.params.clone().iter().filter(|p| p.name.ends_with("_norm.weight")) {
        m.params[p.range()].iter_mut().for_each(|w| *w += 0.5 * rng.normal() as f32);
    }
    m
}

/// The whole model's loss and gradients on one rank.
fn one_rank() -> (f32, Vec<f32>) {
    one_rank_of(cfg())
}

fn one_rank_of(cfg: GptConfig) -> (f32, Vec<f32>) {
    let (x, y) = batch();
    let mut m = model(cfg);
    let loss = m.forward(&x, &y, B, T, Pass::Train { dropout_seed: 1, loss_scale: 1.0 });
    m.backward();
    (loss, m.grads.clone())
}

/// Every rank's (loss of its rows, whole-model gradients) under `s`.
fn parts(s: Strategy) -> Vec<(f32, Vec<f32>)> {
    parts_of(cfg(), s)
}

fn parts_of(cfg: GptConfig, s: Strategy) -> Vec<(f32, Vec<f32>)> {
    let world = s.dp * s.tp * s.cp;
    run_ranks(world, |comm| {
        let (x, y) = batch();
        let (mut parts, applied) = parallelize(model(cfg.clone()), &s, comm).unwrap();
        let part = &mut parts[0];
        let (dp, rank) = (applied.groups.dp_size, applied.groups.dp_rank);
        let rows = B / dp;
        let r = rank * rows * T..(rank + 1) * rows * T;
        // Each data-parallel (and context-parallel) rank's share of the mean loss's gradient
        // (equal target counts).
        let pass = Pass::Train { dropout_seed: 1, loss_scale: 1.0 / (dp * s.cp) as f32 };
        let loss = part.model.forward_with(&mut part.dp, &x[r.clone()], &y[r], None, (rows, T), pass);
        part.dp.begin_micro(true);
        part.model.backward_with(&mut part.dp);
        part.dp.finish_backward();
        let mut grads = vec![0.0; part.model.layout.total];
        part.dp.for_each_piece(|p, _, g| grads[p.flat.clone()].copy_from_slice(g));
        // Per-head norms, and with sequence parallelism the norms, leave their gradients partial
        // per shard: the step sums them over the tensor-parallel group (kiln's
        // `step::train_step`), as here.
        for r in &part.seq_partial {
            applied.groups.tp.all_reduce_sum(&mut grads[r.clone()]);
        }
        (loss, applied.gather_whole(vec![grads]))
    })
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!((a - b).abs() <= tol * scale, "{what}: element {i}: {a} vs {b} (scale {scale})");
    }
}

#[test]
fn data_parallel_parts_match_one_rank() {
    let (loss, grads) = one_rank();
    let out = parts(strategy(2, 1, false));
    let mean = out.iter().map(|(l, _)| *l).sum::<f32>() / out.len() as f32;
    assert!((mean - loss).abs() <= 1e-6 * loss.abs(), "{mean} vs {loss}");
    for (r, (_, g)) in out.iter().enumerate() {
        assert_close(&format!("dp rank {r}"), g, &grads, 1e-6);
    }
}

#[test]
fn tensor_and_sequence_parallel_parts_match_one_rank() {
    let (loss, grads) = one_rank();
    for sp in [false, true] {
        let out = parts(strategy(1, 2, sp));
        for (r, (l, g)) in out.iter().enumerate() {
            assert!((l - loss).abs() <= 1e-5 * loss.abs(), "tp rank {r} (sp {sp}): {l} vs {loss}");
            assert_close(&format!("tp rank {r} (sp {sp})"), g, &grads, 1e-5);
        }
    }
}

/// Qwen3's per-head q and k norms under tensor parallelism (each shard normalises its own
/// heads and holds a partial gradient of the shared weights), with and without sequence
/// parallelism, and under context parallelism.
#[test]
fn per_head_norms_split_by_tensor_and_context_parallelism_match_one_rank() {
    let (loss, grads) = one_rank_of(qk_norm_cfg());
    for (tp, cp, sp) in [(2, 1, false), (2, 1, true), (1, 2, false)] {
        let out = parts_of(qk_norm_cfg(), Strategy { cp, ..strategy(1, tp, sp) });
        let mean = out.iter().map(|(l, _)| *l).sum::<f32>() / out.len() as f32;
        assert!((mean - loss).abs() <= 1e-5 * loss.abs(), "tp {tp} cp {cp} sp {sp}: {mean} vs {loss}");
        for (r, (_, g)) in out.iter().enumerate() {
            assert_close(&format!("tp {tp} cp {cp} sp {sp} rank {r}"), g, &grads, 1e-5);
        }
    }
}

/// LongRoPE under context parallelism: the whole rows (8 positions) are longer than the
/// original context (4) but each part's chunk is not, and every part still rotates with the
/// long tables, as one rank does.
#[test]
fn longrope_tables_follow_the_whole_rows_under_context_parallelism() {
    let scaling = model::config::RopeScaling::LongRope { short_factor: vec![1.0, 1.5], long_factor: vec![2.0, 7.0], original_max_position_embeddings: 4, attention_factor: 1.2 };
    let cfg = GptConfig { rope_scaling: Some(scaling), ..qk_norm_cfg() };
    let (loss, grads) = one_rank_of(cfg.clone());
    for zigzag in [false, true] {
        let out = parts_of(cfg.clone(), Strategy { cp: 2, cp_zigzag: zigzag, ..strategy(1, 1, false) });
        let mean = out.iter().map(|(l, _)| *l).sum::<f32>() / out.len() as f32;
        assert!((mean - loss).abs() <= 1e-5 * loss.abs(), "zigzag {zigzag}: {mean} vs {loss}");
        for (r, (_, g)) in out.iter().enumerate() {
            assert_close(&format!("zigzag {zigzag} rank {r}"), g, &grads, 1e-5);
        }
    }
}

#[test]
fn context_parallel_parts_match_one_rank() {
    let (loss, grads) = one_rank();
    for (cp, cp_mode, cp_zigzag) in [(2, plan::policy::CpMode::Ring, true), (4, plan::policy::CpMode::Ring, false), (2, plan::policy::CpMode::Ulysses, true)] {
        let out = parts(Strategy { cp, cp_mode, cp_zigzag, ..strategy(1, 1, false) });
        // Each rank's loss is its positions' mean; their mean is the whole model's.
        let mean = out.iter().map(|(l, _)| *l).sum::<f32>() / out.len() as f32;
        assert!((mean - loss).abs() <= 1e-5 * loss.abs(), "cp {cp} {cp_mode:?}: {mean} vs {loss}");
        for (r, (_, g)) in out.iter().enumerate() {
            assert_close(&format!("cp {cp} {cp_mode:?} rank {r}"), g, &grads, 1e-5);
        }
    }
}

#[test]
fn at_degree_one_parallelize_is_the_identity() {
    let (loss, grads) = one_rank();
    let out = parts(strategy(1, 1, false));
    assert_eq!(out[0].0.to_bits(), loss.to_bits());
    assert_eq!(out[0].1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), grads.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
}
