//! Packed documents ([`model::Docs`]): a row A|B|C of three documents gives each token the loss
//! and each parameter the gradient of A, B and C run on their own (GPT-2 with learned positions,
//! LLaMA with GQA and rope), with positions restarting per document or running on; recomputation
//! reuses the forward's layout bit for bit.

use model::config::Arch;
use model::gpt::{Recompute, IGNORE_INDEX};
use model::{Docs, Gpt, GptConfig, Pass};

const LENS: [usize; 3] = [5, 7, 4];
const T: usize = 16;

fn gpt2() -> GptConfig {
    GptConfig::gpt2((2, 2, 8), T, 12, true, 0.0, true)
}

fn llama() -> GptConfig {
    GptConfig { arch: Arch::Llama, n_head: 4, n_kv_head: 2, ffn_hidden: 12, tied_embeddings: false, bias: false, ..GptConfig::gpt2((2, 4, 8), T, 12, false, 0.0, false) }
}

/// A model with weights larger than the 0.02 init, so every path carries signal.
fn build(cfg: GptConfig, recompute: Recompute) -> Gpt {
    let mut m = Gpt::new(cfg, 11, 3);
    let mut rng = tensor::Rng::new(4);
    for spec in m.layout.params.clone() {
        let x = &mut m.params[spec.range()];
        match spec.init {
            model::Init::Normal(_) => rng.fill_normal(x, 0.3),
            _ => x.iter_mut().for_each(|v| *v += 0.1 * rng.normal() as f32),
        }
    }
    m.recompute = recompute;
    m
}

/// Tokens of a row of documents of `lens` and targets predicting the next token within each
/// document (ignored at a document's last token), with the row's document starts.
fn packed(lens: &[usize], k: u32) -> (Vec<u32>, Vec<i32>, Vec<u32>) {
    let n: usize = lens.iter().sum();
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 7 + i * i + k * 3) % 11).collect();
    let (mut targets, mut start) = (Vec::new(), Vec::new());
    let mut t0 = 0;
    for &len in lens {
        for j in 0..len {
            targets.push(if j + 1 < len { tokens[t0 + j + 1] as i32 } else { IGNORE_INDEX });
            start.push(t0 as u32);
        }
        t0 += len;
    }
    (tokens, targets, start)
}

fn counted(targets: &[i32]) -> usize {
    targets.iter().filter(|&&x| x != IGNORE_INDEX).count()
}

/// Largest `|a − b| / (1 + |b|)`.
fn max_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0.0, f32::max)
}

/// The packed row against its documents run one by one: the gradient of the packed row's mean
/// loss over its `N` counted targets, and the separate runs' gradients summed, each run's loss
/// scaled by its share `n_i / N` of the targets (so each counted token weighs `1/N` in both).
fn assert_packed_equals_separate(cfg: GptConfig, reset: bool) {
    let (tokens, targets, start) = packed(&LENS, 0);
    let pos: Vec<u32> = (0..T as u32).map(|i| if reset { i - start[i as usize] } else { i }).collect();
    let total = counted(&targets);
    let train = |n: usize| Pass::Train { dropout_seed: 0, loss_scale: n as f32 / total as f32 };
    let mut m = build(cfg.clone(), Recompute::None);
    m.zero_grad();
    m.forward_docs(&tokens, &targets, Docs { start: &start, pos: &pos }, 1, T, train(counted(&targets)));
    m.backward();
    let (losses, grads) = (m.losses().to_vec(), m.grads.clone());
    let mut s = build(cfg, Recompute::None);
    s.zero_grad();
    let mut t0 = 0;
    for &n in &LENS {
        let (x, y) = (&tokens[t0..t0 + n], &targets[t0..t0 + n]);
        if reset {
            s.forward(x, y, 1, n, train(counted(y)));
        } else {
            // Positions run on from the document's place in the row.
            let p: Vec<u32> = (t0..t0 + n).map(|i| i as u32).collect();
            s.forward_docs(x, y, Docs { start: &vec![0; n], pos: &p }, 1, n, train(counted(y)));
        }
        let e = max_err(&losses[t0..t0 + n], s.losses());
        assert!(e < 1e-6, "{:?} reset={reset}: losses of the document at {t0}+{n} differ by {e}", s.cfg.arch);
        s.backward();
        t0 += n;
    }
    for spec in &m.layout.params {
        let r = spec.range();
        let e = max_err(&grads[r.clone()], &s.grads[r.clone()]);
        // The same per-token contributions, summed in another order (one product over the
        // row's 16 tokens against three of 5, 7 and 4, added); a gradient crossing a document
        // boundary would be off by ~1e-2.
        assert!(e < 1e-6, "{:?} reset={reset}: gradient of {} differs by {e}", s.cfg.arch, spec.name);
        assert!(s.grads[r].iter().any(|&g| g != 0.0), "gradient of {} is zero", spec.name);
    }
}

#[test]
fn packed_documents_equal_separate_runs_gpt2() {
    assert_packed_equals_separate(gpt2(), true);
    assert_packed_equals_separate(gpt2(), false);
}

#[test]
fn packed_documents_equal_separate_runs_llama_gqa() {
    assert_packed_equals_separate(llama(), true);
    assert_packed_equals_separate(llama(), false);
}

/// Losses and gradients (bits) of a training step on two packed rows, [5, 7, 4] and [9, 7].
fn docs_step(cfg: &GptConfig, recompute: Recompute) -> (Vec<u32>, Vec<u32>) {
    let mut m = build(cfg.clone(), recompute);
    let (mut tokens, mut targets, mut start) = packed(&LENS, 0);
    let (x, y, s) = packed(&[9, 7], 1);
    tokens.extend(x);
    targets.extend(y);
    start.extend(s);
    let pos: Vec<u32> = start.iter().enumerate().map(|(i, &s)| (i % T) as u32 - s).collect();
    m.zero_grad();
    m.forward_docs(&tokens, &targets, Docs { start: &start, pos: &pos }, 2, T, Pass::Train { dropout_seed: 5, loss_scale: 0.5 });
    let losses = m.losses().iter().map(|x| x.to_bits()).collect();
    m.backward();
    (losses, m.grads.iter().map(|x| x.to_bits()).collect())
}

#[test]
fn recompute_with_documents_is_bit_identical() {
    for cfg in [GptConfig { dropout: 0.1, ..gpt2() }, GptConfig { dropout: 0.1, ..llama() }] {
        let none = docs_step(&cfg, Recompute::None);
        for policy in [Recompute::Full, Recompute::Selective] {
            assert!(docs_step(&cfg, policy) == none, "{:?} {policy:?}: losses or gradients differ", cfg.arch);
        }
    }
}

#[test]
fn backward_uses_the_layout_kept_with_its_activations() {
    // A pipeline runs several micro-batches' forwards before their backwards: a forward without
    // documents in between must not change the first one's backward.
    let cfg = llama();
    let (tokens, targets, start) = packed(&LENS, 0);
    let pos: Vec<u32> = (0..T as u32).map(|i| i - start[i as usize]).collect();
    let pass = Pass::Train { dropout_seed: 0, loss_scale: 1.0 };
    let mut want = build(cfg.clone(), Recompute::Full);
    want.zero_grad();
    want.forward_docs(&tokens, &targets, Docs { start: &start, pos: &pos }, 1, T, pass);
    let bytes = want.activation_bytes();
    want.backward();
    let mut m = build(cfg, Recompute::Full);
    m.zero_grad();
    m.forward_docs(&tokens, &targets, Docs { start: &start, pos: &pos }, 1, T, pass);
    assert_eq!(m.activation_bytes(), bytes);
    let first = m.take_activations().unwrap();
    m.forward(&tokens, &targets, 1, T, Pass::Eval);
    assert_eq!(m.activation_bytes() + 2 * T * 4, bytes, "the layout is counted in the activations");
    m.put_activations(first);
    m.backward();
    assert!(m.grads == want.grads);
}

#[test]
#[should_panic(expected = "not below block_size")]
fn positions_past_block_size_are_refused() {
    let mut m = build(gpt2(), Recompute::None);
    let (tokens, targets, start) = packed(&LENS, 0);
    let mut pos: Vec<u32> = (0..T as u32).collect();
    pos[3] = T as u32;
    m.forward_docs(&tokens, &targets, Docs { start: &start, pos: &pos }, 1, T, Pass::Eval);
}
