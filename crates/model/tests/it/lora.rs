//! LoRA adapters: gradients, the frozen base, and merging.

use model::config::Arch;
use model::lora::Lora;
use model::{Gpt, GptConfig, Pass};

fn cfgs() -> Vec<GptConfig> {
    let g = GptConfig::gpt2((2, 2, 8), 6, 12, true, 0.0, true);
    let l = GptConfig { arch: Arch::Llama, n_head: 4, n_kv_head: 2, ffn_hidden: 12, bias: false, tied_embeddings: false, ..GptConfig::gpt2((2, 4, 8), 6, 12, false, 0.0, false) };
    vec![g, l]
}

fn targets(arch: Arch) -> Vec<String> {
    let t: &[&str] = if arch == Arch::Llama { &["q", "k", "v", "o", "gate", "up", "down"] } else { &["q", "k", "v", "o", "up", "down"] };
    t.iter().map(|s| s.to_string()).collect()
}

fn batch() -> (Vec<u32>, Vec<i32>) {
    (vec![1, 4, 2, 9, 3, 3, 0, 7, 5, 1, 10, 2], vec![4, 2, 9, 3, 3, 5, 7, 5, 1, 10, 2, 6])
}

fn with_adapters(cfg: GptConfig) -> Gpt {
    let mut m = Gpt::new(cfg.clone(), 11, 3);
    let mut lo = Lora::new(&cfg, 2, 4.0, &targets(cfg.arch), 1).unwrap();
    // Non-zero B so every path carries gradient.
    let mut rng = tensor::Rng::new(9);
    rng.fill_normal(&mut lo.params, 0.3);
    m.lora = Some(lo);
    m
}

#[test]
fn adapter_gradients_match_finite_differences_and_base_gets_none() {
    for cfg in cfgs() {
        let mut m = with_adapters(cfg);
        let (x, y) = batch();
        let pass = Pass::Train { dropout_seed: 0, loss_scale: 1.0 };
        m.zero_grad();
        m.forward(&x, &y, 2, 6, pass);
        m.backward();
        let g = m.lora.as_ref().unwrap().grads.clone();
        let n = g.len();
        let eps = 3e-3f32;
        for i in (0..n).step_by((n / 40).max(1)) {
            let orig = m.lora.as_ref().unwrap().params[i];
            m.lora.as_mut().unwrap().params[i] = orig + eps;
            let lp = m.forward(&x, &y, 2, 6, Pass::Eval) as f64;
            m.lora.as_mut().unwrap().params[i] = orig - eps;
            let lm = m.forward(&x, &y, 2, 6, Pass::Eval) as f64;
            m.lora.as_mut().unwrap().params[i] = orig;
            let num = (lp - lm) / (2.0 * eps as f64);
            let err = (num - g[i] as f64).abs() / num.abs().max((g[i] as f64).abs()).max(2e-2);
            assert!(err < 5e-2, "{:?} adapter param {i}: numeric {num} analytic {}", m.cfg.arch, g[i]);
        }
        // Frozen base: no gradient reaches its matrices.
        let qkv = &m.views.blocks[0].c_attn_w;
        assert!(m.grads[qkv.clone()].iter().all(|&v| v == 0.0));
    }
}

#[test]
fn merged_weights_equal_base_plus_scaled_ba() {
    for cfg in cfgs() {
        let mut m = with_adapters(cfg.clone());
        let (x, _) = batch();
        let with = m.forward_logits(&x, 2, 6);
        let lo = m.lora.take().unwrap();
        let base = m.params.clone();
        lo.merge_into(&mut m.params, &m.views);
        let merged = m.forward_logits(&x, 2, 6);
        for (a, b) in with.iter().zip(&merged) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
        // W' - W = scale·B·A on the adapter rows, computed directly for one adapter.
        let ad = &lo.adapters[0];
        let w = &m.views.blocks[ad.layer].c_attn_w;
        let (r, din) = (lo.rank, ad.d_in);
        for row in ad.rows.clone().take(3) {
            for col in 0..din {
                let mut ba = 0.0f32;
                for k in 0..r {
                    ba += lo.params[ad.b.start + (row - ad.rows.start) * r + k] * lo.params[ad.a.start + k * din + col];
                }
                let i = w.start + row * din + col;
                assert!((m.params[i] - base[i] - lo.scale() * ba).abs() < 1e-6);
            }
        }
    }
}

#[test]
fn bad_targets_are_named() {
    let g = GptConfig::gpt2((2, 2, 8), 6, 12, true, 0.0, true);
    let e = Lora::new(&g, 2, 4.0, &["gate".to_string()], 0).err().unwrap();
    assert!(e.contains("`gate`") && e.contains("gpt2"), "{e}");
    let e = Lora::new(&g, 2, 4.0, &["qq".to_string()], 0).err().unwrap();
    assert!(e.contains("unknown lora target `qq`") && e.contains("all-linear"), "{e}");
}

/// PEFT's module names and `all-linear` name the same adapters as kiln's names.
#[test]
fn peft_module_names_and_all_linear_expand_to_kiln_targets() {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    for cfg in cfgs() {
        let all = model::lora::expand_targets(&cfg, &s(&["all-linear"])).unwrap();
        assert_eq!(all, targets(cfg.arch), "{:?}", cfg.arch);
        let a = Lora::new(&cfg, 2, 4.0, &s(&["q_proj", "v_proj", "q"]), 1).unwrap();
        let b = Lora::new(&cfg, 2, 4.0, &s(&["q", "v"]), 1).unwrap();
        assert_eq!(a.layout.params.iter().map(|p| &p.name).collect::<Vec<_>>(), b.layout.params.iter().map(|p| &p.name).collect::<Vec<_>>());
        assert_eq!(a.params, b.params);
    }
    let g = &cfgs()[0];
    assert_eq!(model::lora::expand_targets(g, &s(&["c_attn", "c_fc"])).unwrap(), s(&["q", "k", "v", "up"]));
}

/// A store handing out QLoRA's compact units (`QuantBase::compact_unit`), as `DataParallel`
/// does, with a gradient scratch per unit.
struct Compact {
    params: Vec<Vec<f32>>,
    grads: Vec<Vec<f32>>,
}

impl model::UnitStore for Compact {
    fn acquire(&mut self, u: usize, access: model::Access, _next: Option<(usize, model::Access)>) -> (&[f32], &mut [f32]) {
        (&self.params[u], if access.grads() { &mut self.grads[u] } else { &mut [] })
    }
    fn release(&mut self, _u: usize, _access: model::Access) {}
}

/// QLoRA: a model whose projections read NF4 or int8 matrices from its quantized
/// base (dequantized a tile at a time inside each product) and whose store hands out compact
/// units gives, bit for bit, the loss and adapter gradients of the same LoRA model over the
/// dequantized weights — GPT-2 (biases, tied head) and LLaMA with q/k/v biases (Qwen2's: the
/// fused q|k|v bias view spans three fp32 tensors).
#[test]
fn a_quantized_base_gives_the_dequantized_bases_losses_and_gradients() {
    use model::qbase::{round_trip, QuantBase};
    let g = GptConfig::gpt2((2, 2, 64), 6, 12, true, 0.0, true);
    let l = GptConfig { arch: Arch::Llama, n_head: 4, n_kv_head: 2, ffn_hidden: 96, bias: false, qkv_bias: true, tied_embeddings: false, ..GptConfig::gpt2((2, 4, 64), 6, 12, false, 0.0, false) };
    let (tokens, targets_) = batch();
    for cfg in [g, l] {
        for kind in [model::BaseQuant::Nf4, model::BaseQuant::Int8] {
            let lora = || {
                let mut lo = Lora::new(&cfg, 2, 4.0, &targets(cfg.arch), 1).unwrap();
                tensor::Rng::new(9).fill_normal(&mut lo.params, 0.3);
                lo
            };
            let mut plain = Gpt::new(cfg.clone(), 12, 3);
            let base = QuantBase::build(&plain.layout, &plain.views, &plain.units, kind, |p, dst| dst.copy_from_slice(&plain.params[p.range()]));
            let base = std::sync::Arc::new(base);
            let layout = plain.layout.clone();
            round_trip(&layout, &mut plain.params, kind);
            plain.lora = Some(lora());
            let want = plain.forward(&tokens, &targets_, 2, 6, Pass::Train { dropout_seed: 1, loss_scale: 1.0 });
            plain.backward();
            let mut q = Gpt::zeroed(cfg.clone(), 12);
            q.lora = Some(lora());
            q.set_quantized_base(base.clone());
            let n = q.units.len();
            let mut store = Compact {
                params: (0..n).map(|u| { let mut v = vec![0.0; base.compact_len(u)]; base.compact_unit(u, &mut v); v }).collect(),
                grads: (0..n).map(|u| vec![0.0; base.grad_len(u)]).collect(),
            };
            q.lora.as_mut().unwrap().grads.fill(0.0);
            let got = q.forward_with(&mut store, &tokens, &targets_, None, (2, 6), Pass::Train { dropout_seed: 1, loss_scale: 1.0 });
            q.backward_with(&mut store);
            assert_eq!(got.to_bits(), want.to_bits(), "{:?} {kind:?}: loss", cfg.arch);
            assert_eq!(q.lora.as_ref().unwrap().grads, plain.lora.as_ref().unwrap().grads, "{:?} {kind:?}: adapter gradients", cfg.arch);
            // The packed units hold only what no projection reads quantized.
            let packed: usize = (0..n).map(|u| base.compact_len(u)).sum();
            assert!(packed < layout.total / 2, "{packed} of {} packed", layout.total);
        }
    }
}
