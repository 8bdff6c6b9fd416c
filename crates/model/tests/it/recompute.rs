//! Activation recomputation: `Recompute::Full` keeps only each block's input and
//! re-runs the block in backward, `Selective` (Korthikanti et al.) keeps all but the attention
//! core's outputs and recomputes those; the loss and every gradient must be bit-identical to
//! `Recompute::None`, and what is recomputed must exist once instead of `n_layer` times.

use model::config::Arch;
use model::gpt::{Recompute, IGNORE_INDEX};
use model::lora::Lora;
use model::{Gpt, GptConfig, Pass};

fn gpt2(n_layer: usize, dropout: f32, bias: bool, tied: bool) -> GptConfig {
    GptConfig::gpt2((n_layer, 4, 16), 8, 13, bias, dropout, tied)
}

fn llama(n_layer: usize, n_kv_head: usize, dropout: f32) -> GptConfig {
    GptConfig { arch: Arch::Llama, n_head: 4, n_kv_head, ffn_hidden: 24, tied_embeddings: false, bias: false, ..GptConfig::gpt2((n_layer, 4, 16), 8, 13, false, dropout, false) }
}

fn moe(n_shared: usize, capacity: f32, dropout: f32) -> GptConfig {
    GptConfig { n_expert: 4, top_k: 2, n_shared_expert: n_shared, capacity_factor: capacity, ffn_hidden: 12, moe_aux_weight: 0.3, moe_z_weight: 0.05, ..llama(3, 2, dropout) }
}

/// Two micro-batches `[3, 8]` with an ignored target, deterministic in `k`.
fn batch(k: u32) -> (Vec<u32>, Vec<i32>) {
    let tokens: Vec<u32> = (0..24u32).map(|i| (i * 7 + k * 5 + i * i) % 11).collect();
    let mut targets: Vec<i32> = (0..24u32).map(|i| ((i * 3 + k + 1) % 11) as i32).collect();
    targets[5] = IGNORE_INDEX;
    (tokens, targets)
}

fn lora_targets(arch: Arch, moe: bool) -> Vec<String> {
    let t: &[&str] = match (arch, moe) {
        (_, true) => &["q", "k", "v", "o"],
        (Arch::Llama, false) => &["q", "k", "v", "o", "gate", "up", "down"],
        (Arch::Gpt2, false) => &["q", "k", "v", "o", "up", "down"],
    };
    t.iter().map(|s| s.to_string()).collect()
}

fn build(cfg: &GptConfig, lora: bool, recompute: Recompute) -> Gpt {
    let mut m = Gpt::new(cfg.clone(), 11, 3);
    // Larger weights than the 0.02 init so every path (and every router choice) carries signal.
    let mut rng = tensor::Rng::new(4);
    for spec in m.layout.params.clone() {
        let x = &mut m.params[spec.range()];
        match spec.init {
            model::Init::Normal(_) => rng.fill_normal(x, 0.3),
            _ => x.iter_mut().for_each(|v| *v += 0.1 * rng.normal() as f32),
        }
    }
    if lora {
        let mut lo = Lora::new(cfg, 2, 4.0, &lora_targets(cfg.arch, cfg.is_moe()), 1).unwrap();
        tensor::Rng::new(9).fill_normal(&mut lo.params, 0.3);
        m.lora = Some(lo);
    }
    m.recompute = recompute;
    m
}

/// Everything a training step produces: per micro-batch the loss bits and MoE loss bits, then
/// the accumulated base and LoRA gradients' bits.
fn run_step(m: &mut Gpt) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    m.zero_grad();
    let mut losses = Vec::new();
    for k in 0..2 {
        let (tokens, targets) = batch(k);
        let loss = m.forward(&tokens, &targets, 3, 8, Pass::Train { dropout_seed: 100 + k as u64, loss_scale: 0.5 });
        losses.push(loss.to_bits());
        losses.extend(m.moe_stats().iter().map(|s| s.loss.to_bits()));
        m.backward();
    }
    let g = m.grads.iter().map(|x| x.to_bits()).collect();
    let lg = m.lora.as_ref().map_or(Vec::new(), |lo| lo.grads.iter().map(|x| x.to_bits()).collect());
    (losses, g, lg)
}

fn assert_bit_identical(cfg: GptConfig, lora: bool) {
    let mut none = build(&cfg, lora, Recompute::None);
    let a = run_step(&mut none);
    assert!(a.1.iter().any(|&x| x != 0), "gradients are all zero");
    assert!(!lora || a.2.iter().any(|&x| x != 0), "LoRA gradients are all zero");
    // Full recomputation of every layer, and of every 2nd (the others keep their activations).
    for (policy, every) in [(Recompute::Selective, 1), (Recompute::Full, 1), (Recompute::Full, 2)] {
        let mut m = build(&cfg, lora, policy);
        m.recompute_every = every;
        let b = run_step(&mut m);
        assert_eq!(a.0, b.0, "{policy:?} every {every}: losses differ");
        for spec in &none.layout.params {
            let r = spec.range();
            assert_eq!(a.1[r.clone()], b.1[r], "{policy:?}: gradient of {} differs", spec.name);
        }
        if lora {
            for spec in &none.lora.as_ref().unwrap().layout.params {
                let r = spec.range();
                assert_eq!(a.2[r.clone()], b.2[r], "{policy:?}: LoRA gradient of {} differs", spec.name);
            }
        }
        // Switching the policy on a live model re-lays the buffers and changes nothing.
        (m.recompute, m.recompute_every) = (Recompute::None, 1);
        assert_eq!(run_step(&mut m), a, "{policy:?} then None");
    }
    none.recompute = Recompute::Full;
    assert_eq!(run_step(&mut none), a, "None then Full");
}

#[test]
fn recompute_is_bit_identical_gpt2_with_dropout() {
    assert_bit_identical(gpt2(3, 0.2, true, true), false);
    assert_bit_identical(gpt2(3, 0.1, false, false), false);
}

#[test]
fn recompute_is_bit_identical_llama_gqa() {
    assert_bit_identical(llama(3, 2, 0.0), false);
    assert_bit_identical(llama(3, 1, 0.2), false);
}

/// OLMo 2's norms after the branches (with its whole-width q/k norms) and Gemma's sandwich
/// norms: what backward reads of them (each branch's output before its norm) is kept or
/// recomputed like the rest, dense and MoE.
#[test]
fn recompute_is_bit_identical_with_norms_after_the_branches() {
    use model::config::BlockNorms;
    let olmo2 = GptConfig { block_norms: BlockNorms::Post, qk_norm: true, qk_norm_whole: true, ..llama(3, 2, 0.2) };
    assert_bit_identical(olmo2.clone(), false);
    assert_bit_identical(GptConfig { block_norms: BlockNorms::Sandwich, ..llama(3, 1, 0.1) }, false);
    assert_bit_identical(GptConfig { block_norms: BlockNorms::Post, ..moe(1, 1.0, 0.1) }, false);
    assert_bit_identical(olmo2, true);
    use model::config::GateAct;
    let gemma3 = GptConfig {
        block_norms: BlockNorms::Sandwich, gate_act: GateAct::GeluTanh, norm_offset: true, embed_scale: true, query_pre_attn_scalar: 5, qk_norm: true,
        sliding_window: 4, window_layers: vec![0, 1], rope_local_theta: 100.0, ..llama(3, 2, 0.1)
    };
    assert_bit_identical(gemma3, false);
}

/// DeepSeek's multi-head latent attention: its latents and values are kept or recomputed like
/// the rest, dense and MoE.
#[test]
fn recompute_is_bit_identical_with_latent_attention() {
    let mla = GptConfig { n_kv_head: 4, head_dim: 6, rotary_dim: 2, v_head_dim: 4, kv_lora_rank: 5, q_lora_rank: 3, rope_interleave: true, ..llama(3, 4, 0.1) };
    assert_bit_identical(mla.clone(), false);
    assert_bit_identical(GptConfig { n_expert: 4, top_k: 2, n_shared_expert: 1, ffn_hidden: 12, ..mla.clone() }, false);
    // DeepSeek-V3's shape: a dense layer before routed ones (the sets shared between them hold
    // both kinds of buffers), the sigmoid router with scaled gates.
    let dsv3 = GptConfig {
        n_expert: 4, top_k: 2, n_shared_expert: 1, ffn_hidden: 12, moe_first_layer: 1, dense_ffn_hidden: 20, moe_router: model::config::MoeRouter::Sigmoid,
        moe_groups: 2, moe_topk_groups: 1, moe_gate_scale: 2.5, moe_aux_weight: 0.0, moe_z_weight: 0.0, ..mla
    };
    assert_bit_identical(dsv3, false);
}

#[test]
fn recompute_is_bit_identical_moe() {
    assert_bit_identical(moe(0, 0.0, 0.0), false); // dropless
    assert_bit_identical(moe(1, 1.0, 0.1), false); // shared expert, capacity drops tokens
}

#[test]
fn recompute_is_bit_identical_lora() {
    assert_bit_identical(gpt2(3, 0.2, true, true), true);
    assert_bit_identical(llama(3, 2, 0.1), true);
    assert_bit_identical(moe(1, 0.0, 0.0), true);
}

#[test]
fn recompute_eval_and_logits_match() {
    let cfg = gpt2(3, 0.2, true, false);
    let mut none = build(&cfg, false, Recompute::None);
    let (tokens, targets) = batch(0);
    let loss = none.forward(&tokens, &targets, 3, 8, Pass::Eval).to_bits();
    let a: Vec<u32> = none.forward_logits(&tokens, 3, 8).iter().map(|x| x.to_bits()).collect();
    for policy in [Recompute::Selective, Recompute::Full] {
        let mut m = build(&cfg, false, policy);
        assert_eq!(m.forward(&tokens, &targets, 3, 8, Pass::Eval).to_bits(), loss);
        let b: Vec<u32> = m.forward_logits(&tokens, 3, 8).iter().map(|x| x.to_bits()).collect();
        assert_eq!(a, b);
    }
}

#[test]
fn recompute_keeps_block_activations_once() {
    let cfg = GptConfig::gpt2((8, 4, 64), 32, 65, true, 0.0, true);
    let mut m = Gpt::new(cfg, 65, 1);
    assert_eq!(m.activation_bytes(), 0);
    let mut bytes = Vec::new();
    for policy in [Recompute::None, Recompute::Selective, Recompute::Full] {
        m.recompute = policy;
        m.reserve_activations(4, 32);
        bytes.push(m.activation_bytes());
    }
    let [none, selective, full] = bytes[..] else { unreachable!() };
    // Full on every 2nd of the 8 layers: those 4 share one set, the other 4 keep theirs.
    m.recompute = Recompute::Full;
    m.recompute_every = 2;
    m.reserve_activations(4, 32);
    let half = m.activation_bytes();
    assert!(full < half && half < none, "{full} {half} {none}");
    assert!((full as f64) < 0.4 * none as f64, "full {full} none {none}");
    assert!(full < selective && selective < none, "{bytes:?}");
    // Per block every policy keeps the block's output (C per token). The norm outputs ln_1,
    // ln_2 and the residual res_2 (3C) with the norms' mean and rstd (4), qkv (3C) and the MLP
    // hidden fch (4C), gelu (4C) are per block except under Full; the attention core's output
    // atty (C) and lse (NH) are per block only under None.
    let (n, c, nh) = (4 * 32, 64, 4);
    let kept = (3 * n * c + 4 * n) * 4;
    let core = (n * c + nh * n) * 4;
    let rest = 11 * n * c * 4;
    assert_eq!(none - selective, 7 * core);
    assert_eq!(selective - full, 7 * (kept + rest));
}

/// 16-bit activation storage: bf16 and fp16 training with the stash gives the run
/// without it bit for bit (the stored values are already rounded to the format), under every
/// policy it applies to, while the stored activations take about half the bytes.
#[test]
fn sixteen_bit_activation_storage_is_lossless_and_halves_the_stored_activations() {
    use model::gpt::Precision;
    let olmo2 = GptConfig { block_norms: model::config::BlockNorms::Post, qk_norm: true, qk_norm_whole: true, ..llama(3, 2, 0.1) };
    let mla = GptConfig { n_kv_head: 4, head_dim: 6, rotary_dim: 2, v_head_dim: 4, kv_lora_rank: 5, q_lora_rank: 3, ..llama(3, 4, 0.1) };
    for cfg in [gpt2(3, 0.2, true, true), llama(3, 2, 0.1), olmo2, mla] {
        for precision in [Precision::Bf16, Precision::Fp16] {
            for policy in [Recompute::None, Recompute::Selective] {
                let mut off = build(&cfg, false, policy);
                (off.precision, off.stash16) = (precision, false);
                let a = run_step(&mut off);
                let mut on = build(&cfg, false, policy);
                on.precision = precision;
                assert!(on.stash_format().is_some());
                let b = run_step(&mut on);
                assert_eq!(a, b, "{:?} {precision:?} {policy:?}: the stash changed the run", cfg.arch);
                // A larger shape, where the per-layer activations dominate the fixed buffers.
                let (mut big_off, mut big_on) = (Gpt::zeroed(GptConfig::gpt2((6, 4, 64), 64, 50, true, 0.0, true), 50), Gpt::zeroed(GptConfig::gpt2((6, 4, 64), 64, 50, true, 0.0, true), 50));
                (big_off.precision, big_off.stash16, big_off.recompute) = (precision, false, policy);
                (big_on.precision, big_on.recompute) = (precision, policy);
                big_off.reserve_activations(4, 64);
                big_on.reserve_activations(4, 64);
                let ratio = big_on.activation_bytes() as f64 / big_off.activation_bytes() as f64;
                assert!(ratio < 0.75, "{precision:?} {policy:?}: stored activations {ratio:.2} of fp32");
            }
        }
    }
}

/// Activation compression on dense and mixture-of-experts layers (routed and
/// shared experts, with and without a capacity): int8 codes leave the loss of the same
/// forward exact and every gradient within a few percent of the uncompressed step's, int4
/// further; so every tensor backward reads is put back (one left stale — another layer's —
/// is far off), under both policies that keep activations.
#[test]
fn compressed_activations_give_close_gradients_for_dense_and_moe_layers() {
    let rel = |a: &[u32], b: &[u32]| {
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (&x, &y) in a.iter().zip(b) {
            let (x, y) = (f32::from_bits(x) as f64, f32::from_bits(y) as f64);
            num += (x - y) * (x - y);
            den += y * y;
        }
        (num / den).sqrt()
    };
    for (name, cfg) in [("llama", llama(3, 2, 0.0)), ("moe", moe(1, 0.0, 0.0)), ("moe capacity", moe(0, 1.0, 0.0))] {
        for policy in [Recompute::None, Recompute::Selective] {
            let exact = run_step(&mut build(&cfg, false, policy));
            for (compression, tol) in [(plan::policy::ActCompression::Int8, 0.03), (plan::policy::ActCompression::Int4, 0.6)] {
                let mut m = build(&cfg, false, policy);
                m.act_compression = (compression, Default::default());
                let got = run_step(&mut m);
                // The first micro-batch's forward sees nothing compressed yet.
                assert_eq!(got.0[0], exact.0[0], "{name} {policy:?} {compression:?}: first forward");
                let e = rel(&got.1, &exact.1);
                assert!(e < tol, "{name} {policy:?} {compression:?}: gradients off by {e:.4} (relative L2)");
            }
        }
    }
}
