use model::gpt::{Recompute, IGNORE_INDEX};
use model::config::Arch;
use model::{Gpt, GptConfig, Pass, Sampler};

fn train(seed: u64) -> Pass {
    Pass::Train { dropout_seed: seed, loss_scale: 1.0 }
}

fn tiny(bias: bool, dropout: f32, tied: bool) -> GptConfig {
    GptConfig::gpt2((2, 2, 8), 6, 12, bias, dropout, tied)
}

fn tiny_llama(n_kv_head: usize, dropout: f32) -> GptConfig {
    GptConfig { arch: Arch::Llama, n_head: 4, n_kv_head, ffn_hidden: 12, tied_embeddings: false, bias: false, ..GptConfig::gpt2((2, 4, 8), 6, 12, false, dropout, false) }
}

fn batch() -> (Vec<u32>, Vec<i32>) {
    let tokens = vec![1, 4, 2, 9, 3, 3, 0, 7, 5, 1, 10, 2];
    let targets = vec![4, 2, 9, 3, 3, IGNORE_INDEX, 7, 5, 1, 10, 2, 6];
    (tokens, targets)
}

/// The training objective: the mean cross-entropy plus the MoE router losses (weighted).
fn objective(m: &mut Gpt, tokens: &[u32], targets: &[i32], seed: u64) -> f64 {
    let ce = m.forward(tokens, targets, 2, 6, train(seed)) as f64;
    ce + m.moe_stats().iter().map(|s| s.loss as f64).sum::<f64>()
}

/// Whole-model finite-difference check: every parameter tensor gets a few probes.
fn model_gradcheck(cfg: GptConfig) {
    model_gradcheck_with(cfg, Recompute::None);
}

fn model_gradcheck_with(cfg: GptConfig, recompute: Recompute) {
    let (tokens, targets) = batch();
    let mut m = Gpt::new(cfg, 11, 3);
    m.recompute = recompute;
    // Larger weights than the 0.02 init so every path carries signal; norms stay near 1.
    let mut rng = tensor::Rng::new(4);
    for spec in m.layout.params.clone() {
        let x = &mut m.params[spec.range()];
        match spec.init {
            model::Init::Normal(_) => rng.fill_normal(x, 0.3),
            _ => x.iter_mut().for_each(|v| *v += 0.1 * rng.normal() as f32),
        }
    }
    let seed = 77;
    m.zero_grad();
    m.forward(&tokens, &targets, 2, 6, train(seed));
    m.backward();
    let grads = m.grads.clone();
    let eps = 3e-3f32;
    let specs = m.layout.params.clone();
    for spec in &specs {
        let r = spec.range();
        for probe in 0..3 {
            let i = r.start + (probe * 7919) % r.len();
            let orig = m.params[i];
            m.params[i] = orig + eps;
            let lp = objective(&mut m, &tokens, &targets, seed);
            m.params[i] = orig - eps;
            let lm = objective(&mut m, &tokens, &targets, seed);
            m.params[i] = orig;
            let num = (lp - lm) / (2.0 * eps as f64);
            let a = grads[i] as f64;
            let err = (num - a).abs() / num.abs().max(a.abs()).max(2e-2);
            assert!(err < 5e-2, "{}[{}]: numeric {num} analytic {a}", spec.name, i - r.start);
        }
    }
}

#[test]
fn gradients_match_finite_differences_gpt2_style() {
    model_gradcheck(tiny(true, 0.0, true));
}

#[test]
fn gradients_match_finite_differences_no_bias_untied_with_dropout() {
    model_gradcheck(tiny(false, 0.2, false));
}

#[test]
fn gradients_match_finite_differences_llama_gqa() {
    model_gradcheck(tiny_llama(2, 0.0));
}

#[test]
fn gradients_match_finite_differences_llama_mqa_with_dropout() {
    model_gradcheck(tiny_llama(1, 0.2));
}

/// Qwen3's per-head q and k norms (their weights probed like every other parameter), with
/// full recomputation re-running them too.
#[test]
fn gradients_match_finite_differences_qk_norm() {
    let cfg = GptConfig { qk_norm: true, ..tiny_llama(2, 0.0) };
    model_gradcheck(cfg.clone());
    model_gradcheck_with(cfg, Recompute::Full);
}

/// OLMo 2's blocks (norms after the branches, q and k normed over all heads at once) and
/// Gemma's sandwich norms, through the whole model, with full and selective recomputation.
#[test]
fn gradients_match_finite_differences_norms_after_the_branches() {
    use model::config::BlockNorms;
    let olmo2 = GptConfig { block_norms: BlockNorms::Post, qk_norm: true, qk_norm_whole: true, ..tiny_llama(2, 0.0) };
    model_gradcheck(olmo2.clone());
    model_gradcheck_with(olmo2, Recompute::Full);
    let sandwich = GptConfig { block_norms: BlockNorms::Sandwich, ..tiny_llama(1, 0.0) };
    model_gradcheck(sandwich.clone());
    model_gradcheck_with(sandwich, Recompute::Selective);
}

/// Gemma 3's block through the whole model: sandwich norms scaling by `1 + w`, GeGLU, per-head
/// q/k norms, embeddings times `√C` under a tied head, logits scaled by a
/// `query_pre_attn_scalar` and soft-capped (Gemma 2's attention and output caps), a
/// sliding-window layer with its own rotary base beside a global
/// one (heads of 4, so the bases differ); with dropout, and with full recomputation.
#[test]
fn gradients_match_finite_differences_gemma3_block() {
    let cfg = gemma3_like(0.1);
    model_gradcheck(cfg.clone());
    model_gradcheck_with(cfg, Recompute::Full);
}

fn gemma3_like(dropout: f32) -> GptConfig {
    use model::config::{BlockNorms, GateAct};
    GptConfig {
        block_norms: BlockNorms::Sandwich, gate_act: GateAct::GeluTanh, norm_offset: true, embed_scale: true, query_pre_attn_scalar: 7, qk_norm: true,
        sliding_window: 3, window_layers: vec![0], rope_local_theta: 100.0, tied_embeddings: true, n_head: 2, attn_softcap: 0.8, final_softcap: 1.5, ..tiny_llama(1, dropout)
    }
}

/// Gemma's features each change the model (none is silently ignored), and KV-cached decoding
/// equals the forward with all of them.
#[test]
fn gemma3_features_each_change_the_logits_and_decoding_follows_the_forward() {
    let base = gemma3_like(0.0);
    let (tokens, _) = batch();
    let logits = |cfg: GptConfig| {
        // The same weights whatever the variant's init (norms near 0.5: `1 + w` is far from `w`).
        let mut m = Gpt::new(cfg, 11, 3);
        let mut rng = tensor::Rng::new(4);
        for spec in m.layout.params.clone() {
            let x = &mut m.params[spec.range()];
            match spec.init {
                model::Init::Normal(_) => rng.fill_normal(x, 0.3),
                _ => x.iter_mut().for_each(|v| *v = 0.5 + 0.1 * rng.normal() as f32),
            }
        }
        let l = m.forward_logits(&tokens[..6], 1, 6);
        let mut cache = m.new_cache();
        for (i, &tok) in tokens[..6].iter().enumerate() {
            let step = m.decode_step(&mut cache, tok);
            let err = step.iter().zip(&l[i * 12..(i + 1) * 12]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(err < 1e-5, "position {i}: {err}");
        }
        l
    };
    let want = logits(base.clone());
    for (name, cfg) in [
        ("gate_act", GptConfig { gate_act: model::config::GateAct::Silu, ..base.clone() }),
        ("norm_offset", GptConfig { norm_offset: false, ..base.clone() }),
        ("embed_scale", GptConfig { embed_scale: false, ..base.clone() }),
        ("query_pre_attn_scalar", GptConfig { query_pre_attn_scalar: 0, ..base.clone() }),
        ("rope_local_theta", GptConfig { rope_local_theta: 0.0, ..base.clone() }),
        ("attn_softcap", GptConfig { attn_softcap: 0.0, ..base.clone() }),
        ("final_softcap", GptConfig { final_softcap: 0.0, ..base.clone() }),
    ] {
        let got = logits(cfg);
        let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(diff > 1e-4, "{name} changed nothing ({diff})");
    }
}

/// DeepSeek's multi-head latent attention: q from a normed latent (or one projection), keys
/// and values up-projected per head from a normed latent, a rotary key shared by the heads
/// (interleaved pairs too), values narrower than q·k; through the whole model, with full and
/// selective recomputation, and KV-cached decoding equal to the forward.
#[test]
fn gradients_match_finite_differences_latent_attention() {
    for (q_lora_rank, rope_interleave) in [(3, true), (0, false)] {
        let cfg = mla_like(q_lora_rank, rope_interleave);
        model_gradcheck(cfg.clone());
        model_gradcheck_with(cfg.clone(), Recompute::Full);
        model_gradcheck_with(cfg.clone(), Recompute::Selective);
        let mut m = Gpt::new(cfg, 11, 3);
        let mut rng = tensor::Rng::new(4);
        for spec in m.layout.params.clone() {
            if let model::Init::Normal(_) = spec.init {
                rng.fill_normal(&mut m.params[spec.range()], 0.3);
            }
        }
        let (tokens, _) = batch();
        let l = m.forward_logits(&tokens[..6], 1, 6);
        let mut cache = m.new_cache();
        for (i, &tok) in tokens[..6].iter().enumerate() {
            let step = m.decode_step(&mut cache, tok);
            let err = step.iter().zip(&l[i * 12..(i + 1) * 12]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(err < 1e-5, "q_lora_rank {q_lora_rank}: position {i}: {err}");
        }
    }
}

/// DeepSeek-V3's block through the whole model: a dense layer before a routed one (sigmoid
/// router over groups, scaled gates, a shared expert), under latent attention; with full
/// recomputation sharing one set between the two kinds of layers.
#[test]
fn gradients_match_finite_differences_dense_then_routed_layers() {
    let cfg = GptConfig {
        n_expert: 4, top_k: 2, n_shared_expert: 1, ffn_hidden: 6, moe_first_layer: 1, dense_ffn_hidden: 10, moe_router: model::config::MoeRouter::Sigmoid,
        moe_groups: 2, moe_topk_groups: 1, moe_gate_scale: 2.5, moe_aux_weight: 0.0, moe_z_weight: 0.0, dropout: 0.0, ..mla_like(3, true)
    };
    let m = Gpt::new(cfg.clone(), 11, 3);
    assert!(m.layout.get("model.layers.0.mlp.gate_proj.weight").is_some_and(|p| p.shape == vec![10, 8]));
    assert!(m.layout.get("model.layers.1.block_sparse_moe.gate.e_score_correction_bias").is_some());
    assert_eq!(m.num_params() as u128, cfg.param_count());
    model_gradcheck(cfg.clone());
    model_gradcheck_with(cfg, Recompute::Full);
}

fn mla_like(q_lora_rank: usize, rope_interleave: bool) -> GptConfig {
    GptConfig { n_head: 2, n_kv_head: 2, head_dim: 8, rotary_dim: 4, v_head_dim: 6, kv_lora_rank: 5, q_lora_rank, rope_interleave, ..tiny_llama(2, 0.1) }
}

/// A partial rotary embedding (2 of each head's 4 dimensions), through the whole model.
#[test]
fn gradients_match_finite_differences_partial_rotary() {
    model_gradcheck(GptConfig { n_head: 2, rotary_dim: 2, ..tiny_llama(1, 0.0) });
}

/// A layer without a rotary embedding (SmolLM3's NoPE) beside one with it, through the whole
/// model, with full recomputation too.
#[test]
fn gradients_match_finite_differences_nope_layer() {
    let cfg = GptConfig { nope_layers: vec![1], ..tiny_llama(2, 0.0) };
    model_gradcheck(cfg.clone());
    model_gradcheck_with(cfg, Recompute::Full);
}

#[test]
fn llama_decode_logits_match_full_forward() {
    let mut m = Gpt::new(tiny_llama(2, 0.0), 12, 5);
    assert_decode_matches_forward(&mut m, 1);
}

#[test]
fn initial_loss_is_near_uniform() {
    let cfg = GptConfig::gpt2((2, 2, 32), 6, 64, true, 0.0, true);
    let mut m = Gpt::new(cfg, 50, 1);
    let (tokens, targets) = batch();
    let loss = m.forward(&tokens, &targets, 2, 6, Pass::Eval);
    assert!((loss - (50f32).ln()).abs() < 0.1, "loss {loss}");
}

#[test]
fn layout_uses_hf_names_and_gpt2_init() {
    let cfg = GptConfig::gpt2_124m();
    let m = Gpt::new(GptConfig { n_layer: 2, ..cfg.clone() }, 50257, 0);
    let names: Vec<&str> = m.layout.params.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names[0], "transformer.wte.weight");
    assert!(names.contains(&"transformer.h.1.mlp.c_proj.weight"));
    assert!(names.contains(&"transformer.ln_f.bias"));
    assert!(!names.contains(&"lm_head.weight"), "tied head has no separate parameter");
    // residual projections are scaled by 1/sqrt(2·n_layer)
    let std_of = |name: &str| {
        let p = m.layout.get(name).unwrap();
        let x = &m.params[p.range()];
        (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
    };
    assert!((std_of("transformer.h.0.attn.c_attn.weight") - 0.02).abs() < 0.001);
    assert!((std_of("transformer.h.0.attn.c_proj.weight") - 0.01).abs() < 0.001);
    // GPT-2 124M has 124,475,904 parameters with the padded 50304 vocabulary (tied).
    let (full, _) = model::layout::gpt_layout(&cfg);
    assert_eq!(full.total, 124_475_904);
}

/// KV-cached decoding of sequence `row` of the batch, token by token, gives the logits of the
/// full forward pass (vocabulary 12).
fn assert_decode_matches_forward(m: &mut Gpt, row: usize) {
    let (tokens, _) = batch();
    let full = m.forward_logits(&tokens, 2, 6)[row * 6 * 12..(row + 1) * 6 * 12].to_vec();
    let mut cache = m.new_cache();
    for (t, &tok) in tokens[row * 6..(row + 1) * 6].iter().enumerate() {
        let lg = m.decode_step(&mut cache, tok);
        for j in 0..12 {
            assert!((lg[j] - full[t * 12 + j]).abs() < 1e-4, "t={t} j={j}");
        }
    }
}

#[test]
fn decode_logits_match_full_forward() {
    let cfg = tiny(true, 0.0, false);
    let mut m = Gpt::new(cfg, 12, 5);
    assert_decode_matches_forward(&mut m, 0);
}

#[test]
fn generation_is_deterministic_and_handles_long_outputs() {
    let m = Gpt::new(tiny(true, 0.0, true), 11, 5);
    let s = Sampler::new(1.0, 5, 9);
    let a = m.generate(&[1, 2], 20, &s); // past block_size 6: the cache is rebuilt
    let b = m.generate(&[1, 2], 20, &s);
    assert_eq!(a, b);
    assert_eq!(a.len(), 20);
    assert!(a.iter().all(|&t| t < 11), "only real vocabulary is sampled");
    let c = m.generate(&[1, 2], 20, &Sampler { seed: 10, ..s.clone() });
    assert_ne!(a, c);
}

/// The sampling loop's processors, as transformers' generate applies them: the repetition
/// penalty on every token seen (prompt included), nucleus sampling's smallest set reaching
/// `top_p`, and a stop id ending the reply (itself the last token).
#[test]
fn repetition_penalty_top_p_and_stop_ids_follow_transformers() {
    use model::generate::{sample, sampling_loop, Feed};
    let fixed = |logits: Vec<f32>| move |f: Feed| if matches!(f, Feed::Logits) { logits.clone() } else { Vec::new() };
    let greedy = Sampler { repetition_penalty: 2.0, ..Sampler::new(0.0, 0, 1) };
    // Logits 1.0, 0.9, -1: token 0 once seen scores 0.5 (< 0.9), then both seen: 0.5 > 0.45.
    let out = sampling_loop(&[2], 3, (&greedy, &mut |_| false), (8, 3), fixed(vec![1.0, 0.9, -1.0]));
    assert_eq!(out, [0, 1, 0]);
    // A seen negative logit is multiplied: -0.1 → -0.2 loses to -0.15.
    let out = sampling_loop(&[0], 1, (&greedy, &mut |_| false), (8, 2), fixed(vec![-0.1, -0.15]));
    assert_eq!(out, [1]);
    // Probabilities ≈ 0.64, 0.24, 0.09, 0.03: top_p 0.5 keeps the first alone, 0.8 the first two.
    let mut rng = tensor::Rng::new(3);
    let logits = [3.0, 2.0, 1.0, 0.0];
    for (p, allowed) in [(0.5f32, 1u32), (0.8, 2), (1.0, 4)] {
        let s = Sampler { top_p: p, ..Sampler::new(1.0, 0, 1) };
        let drawn: std::collections::BTreeSet<u32> = (0..400).map(|_| sample(&logits, &s, &mut rng)).collect();
        assert_eq!(drawn.len() as u32, allowed, "top_p {p}: {drawn:?}");
        assert!(drawn.iter().all(|&t| t < allowed), "top_p {p}: {drawn:?}");
    }
    // A stop id ends the reply after it; a stop callback after the tokens it saw.
    let stop = Sampler { stop_ids: vec![1], ..greedy.clone() };
    assert_eq!(sampling_loop(&[2], 5, (&stop, &mut |_| false), (8, 3), fixed(vec![1.0, 0.9, -1.0])), [0, 1]);
    let plain = Sampler::new(0.0, 0, 1);
    assert_eq!(sampling_loop(&[2], 5, (&plain, &mut |o| o.len() == 2), (8, 3), fixed(vec![1.0, 0.9, -1.0])), [0, 0]);
}

#[test]
fn config_validation_names_the_key() {
    let mut cfg = tiny(true, 0.0, true);
    cfg.n_embd = 9;
    assert!(cfg.validate().unwrap_err().contains("model.n_embd"));
    cfg.n_embd = 8;
    cfg.n_layer = 0;
    assert!(cfg.validate().unwrap_err().contains("model.n_layer"));
    let mut l = tiny_llama(2, 0.0);
    l.n_kv_head = 3;
    assert!(l.validate().unwrap_err().contains("model.n_kv_head (3)"));
    let mut g = tiny(true, 0.0, true);
    g.n_kv_head = 1;
    assert!(g.validate().unwrap_err().contains("arch gpt2"));
}

fn tiny_moe(n_shared: usize, capacity: f32) -> GptConfig {
    GptConfig { n_expert: 4, top_k: 2, n_shared_expert: n_shared, capacity_factor: capacity, ffn_hidden: 6, ..tiny_llama(2, 0.0) }
}

// The load-balancing loss counts tokens per expert, a step function of the parameters: a probe
// that flips one token's top-k changes it by a jump that finite differences turn into a
// spurious slope. So the router losses are checked where these probes flip nothing, and the
// kernel-level tests (tensor/tests/it/moe.rs) check every combination on tie-free inputs.
#[test]
fn gradients_match_finite_differences_moe_dropless_with_shared_expert() {
    model_gradcheck(GptConfig { moe_aux_weight: 0.0, moe_z_weight: 0.0, ..tiny_moe(1, 0.0) });
}

#[test]
fn gradients_match_finite_differences_moe_router_losses() {
    model_gradcheck(GptConfig { moe_aux_weight: 0.5, moe_z_weight: 0.1, ..tiny_moe(0, 0.0) });
}

#[test]
fn moe_decode_logits_match_full_forward_and_stats_are_reported() {
    let mut m = Gpt::new(tiny_moe(0, 0.0), 12, 5);
    assert_decode_matches_forward(&mut m, 0);
    let (tokens, targets) = batch();
    m.forward(&tokens, &targets, 2, 6, Pass::Eval);
    let st = m.moe_stats();
    assert_eq!(st.len(), 2, "one per layer");
    assert_eq!(st[0].counts.iter().sum::<usize>(), 12 * 2, "every token routed to top_k experts");
    assert_eq!(st[0].dropped_fraction, 0.0, "dropless");
    let e = GptConfig { top_k: 5, ..tiny_moe(0, 0.0) }.validate().unwrap_err();
    assert!(e.contains("model.top_k (5)") && e.contains("model.n_expert (4)"), "{e}");
}

// The same checks with activation recomputation (backward re-runs each block).
#[test]
fn gradients_match_finite_differences_with_recompute() {
    model_gradcheck_with(tiny(false, 0.2, false), Recompute::Full);
    model_gradcheck_with(tiny(true, 0.2, true), Recompute::Selective);
    model_gradcheck_with(tiny_llama(2, 0.2), Recompute::Full);
    // The MoE configurations of the checks above (see the note on router losses there).
    model_gradcheck_with(GptConfig { moe_aux_weight: 0.0, moe_z_weight: 0.0, ..tiny_moe(1, 0.0) }, Recompute::Full);
    model_gradcheck_with(GptConfig { moe_aux_weight: 0.5, moe_z_weight: 0.1, ..tiny_moe(0, 0.0) }, Recompute::Full);
}

/// `param_count` (sizes only, no layout: what memory checks use before allocating) equals the
/// layout's total for every family, and saturates instead of overflowing.
#[test]
fn param_count_equals_the_layout_and_never_overflows() {
    let mut cfgs = vec![tiny(true, 0.0, true), tiny(false, 0.0, false), tiny_llama(2, 0.0), tiny_llama(1, 0.0), tiny_moe(1, 1.25), tiny_moe(0, 0.0)];
    cfgs.push(GptConfig { qkv_bias: true, ..tiny_llama(2, 0.0) });
    cfgs.push(GptConfig { head_dim: 6, ..tiny_llama(2, 0.0) });
    cfgs.push(GptConfig { tied_embeddings: true, ..tiny_llama(4, 0.0) });
    for cfg in cfgs {
        let m = Gpt::zeroed(cfg.clone(), cfg.vocab_size);
        assert_eq!(cfg.param_count(), m.layout.total as u128, "{cfg:?}");
    }
    let huge = GptConfig { n_embd: usize::MAX / 2, n_head: 1, ffn_hidden: usize::MAX / 2, ..tiny(true, 0.0, false) };
    assert_eq!(huge.param_count(), u128::MAX);
    let e = huge.validate().unwrap_err();
    assert!(e.contains("overflow") && e.contains("model.n_embd"), "{e}");
}

/// transformers' `padding_idx`: with `pad_token_id` set, the pad token's embedding row gets no
/// gradient from the lookup (token 3 appears twice in the batch); every other gradient is the
/// same bits as without it.
#[test]
fn pad_token_row_gets_no_lookup_gradient() {
    let (tokens, targets) = batch();
    let grads = |pad: Option<usize>| {
        // The same weights either way (a fresh padded model's pad row would be zero).
        let mut m = Gpt::new(GptConfig { pad_token_id: pad, ..tiny_llama(2, 0.0) }, 12, 3);
        m.params = Gpt::new(tiny_llama(2, 0.0), 12, 3).params;
        m.zero_grad();
        m.forward(&tokens, &targets, 2, 6, train(1));
        m.backward();
        let wte = m.layout.get("model.embed_tokens.weight").unwrap().range();
        (m.grads.clone(), wte)
    };
    let (plain, wte) = grads(None);
    let (padded, _) = grads(Some(3));
    let c = 8;
    let row = wte.start + 3 * c..wte.start + 4 * c;
    assert!(plain[row.clone()].iter().any(|g| *g != 0.0));
    assert!(padded[row.clone()].iter().all(|g| *g == 0.0));
    // A fresh model's pad row is zero (transformers' init), the rest as drawn.
    let (a, b) = (Gpt::new(tiny_llama(2, 0.0), 12, 3), Gpt::new(GptConfig { pad_token_id: Some(3), ..tiny_llama(2, 0.0) }, 12, 3));
    assert!(b.params[row.clone()].iter().all(|w| *w == 0.0) && a.params[row.clone()].iter().any(|w| *w != 0.0));
    assert!(a.params.iter().zip(&b.params).enumerate().all(|(i, (x, y))| row.contains(&i) || x == y));
    for (i, (a, b)) in plain.iter().zip(&padded).enumerate() {
        if !row.contains(&i) {
            assert_eq!(a.to_bits(), b.to_bits(), "gradient {i}");
        }
    }
}

/// A group of completions decoded together (one prompt, its keys and values shared, each step's
/// tokens as rows of one batch) samples what each would alone: greedy completions equal, and
/// sampled ones each deterministic in its seed and stopped where its stop says, for GPT-2 and
/// LLaMA (RoPE, GQA).
#[test]
fn a_group_decoded_together_samples_as_each_alone() {
    for llama in [false, true] {
        let cfg = if llama { tiny_llama(2, 0.0) } else { tiny(true, 0.0, false) };
        let m = Gpt::new(cfg, 11, 7);
        let prompt = [3u32, 1];
        let samplers: Vec<Sampler> = (0..4).map(|k| Sampler::new(if k == 0 { 0.0 } else { 1.0 }, 0, 100 + k)).collect();
        let alone: Vec<Vec<u32>> = samplers.iter().map(|s| m.generate(&prompt, 4, s)).collect();
        let together = m.generate_group(&prompt, 4, &samplers, &mut |_, _| false);
        assert_eq!(together, alone, "llama {llama}");
        // A stop after its second token ends row 2 there, and only row 2.
        let stopped = m.generate_group(&prompt, 4, &samplers, &mut |i, out| i == 2 && out.len() == 2);
        assert_eq!(stopped[2], alone[2][..2].to_vec());
        assert_eq!((stopped[1].clone(), stopped[3].clone()), (alone[1].clone(), alone[3].clone()));
        // Two prompts of one length, two completions each, all decoded together.
        let other = [5u32, 9];
        let two = m.generate_groups(&[&prompt, &other], 4, &samplers, &mut |_, _| false);
        let each: Vec<Vec<u32>> = samplers.iter().enumerate().map(|(i, s)| m.generate(if i < 2 { &prompt } else { &other }, 4, s)).collect();
        assert_eq!(two, each, "llama {llama}");
    }
}
