//! Pipeline schedules: every task runs once, dependencies hold, and the simulated bubble is the
//! published one with equal-cost stages.

use parallel::pp::{Kind, Schedule};

#[test]
fn every_schedule_runs_each_pass_once_in_dependency_order() {
    for (kind, v) in [(Kind::Gpipe, 1), (Kind::OneFOneB, 1), (Kind::Interleaved, 2), (Kind::Interleaved, 3)] {
        for p in [1, 2, 4] {
            for m in [4, 8, 12] {
                let s = Schedule::new(kind, p, m, v).unwrap();
                for r in 0..p {
                    let mut t = s.tasks(r);
                    assert_eq!(t.len(), 2 * m * v, "{kind:?} p {p} m {m}");
                    t.sort_by_key(|x| (x.forward, x.mb, x.chunk));
                    t.dedup();
                    assert_eq!(t.len(), 2 * m * v, "{kind:?}: a task twice");
                }
                let tl = s.simulate(1.0, 2.0);
                // A stage's forward of a micro-batch ends before the next stage's starts.
                for r in 1..p {
                    for &(t, start, _) in &tl[r] {
                        if t.forward && t.chunk == 0 {
                            let prev = tl[r - 1].iter().find(|x| x.0 == t).unwrap();
                            assert!(prev.2 <= start);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn simulated_bubbles_match_the_formulas() {
    for (kind, v) in [(Kind::Gpipe, 1), (Kind::OneFOneB, 1), (Kind::Interleaved, 2)] {
        for m in [4, 8, 16] {
            let s = Schedule::new(kind, 4, m, v).unwrap();
            let b = s.bubble(1.0 / v as f64, 2.0 / v as f64);
            let worst = b.iter().fold(0.0f64, |a, &x| a.max(x));
            assert!((worst - s.ideal_bubble()).abs() < 1e-9, "{kind:?} m {m}: {b:?} vs {}", s.ideal_bubble());
        }
    }
}

#[test]
fn one_f_one_b_bounds_activations_by_stages_gpipe_by_micro_batches() {
    for m in [4, 8, 16] {
        let g = Schedule::new(Kind::Gpipe, 4, m, 1).unwrap();
        let f = Schedule::new(Kind::OneFOneB, 4, m, 1).unwrap();
        assert_eq!(g.peak_in_flight(0), m);
        assert_eq!(f.peak_in_flight(0), 4);
        assert_eq!(f.peak_in_flight(3), 1);
    }
    assert!(Schedule::new(Kind::Interleaved, 4, 6, 2).is_err());
    assert!(Schedule::new(Kind::OneFOneB, 4, 6, 2).is_err());
}

mod stages {
    use model::config::Arch;
    use model::{Gpt, GptConfig, Pass};
    use parallel::pp::{cut, paste, split_layers, stage_config};

    /// The whole model and the same model cut into stages of `counts` layers, one micro-batch
    /// through both (activations handed forward, their gradients backward): the loss and every
    /// gradient agree bit for bit (a tied embedding's two gradients summed).
    fn stages_match_whole(cfg: GptConfig, counts: &[usize]) {
        let (b, t) = (2, 6);
        let mut whole = Gpt::new(cfg.clone(), cfg.vocab_size, 7);
        let tokens: Vec<u32> = (0..b * t).map(|i| (i * 5 % cfg.vocab_size) as u32).collect();
        let targets: Vec<i32> = (0..b * t).map(|i| ((i * 3 + 1) % cfg.vocab_size) as i32).collect();
        let pass = Pass::Train { dropout_seed: 11, loss_scale: 0.5 };
        whole.zero_grad();
        let loss = whole.forward(&tokens, &targets, b, t, pass);
        whole.backward();

        let ranges = split_layers(cfg.n_layer, counts.len(), counts, 1.0, 0.0).unwrap();
        let mut st: Vec<Gpt> = ranges.iter().map(|r| {
            let mut s = Gpt::zeroed(stage_config(&cfg, r.clone()), cfg.vocab_size);
            s.params = cut(&whole.layout, &whole.params, &s.layout);
            s
        }).collect();
        let k = st.len();
        let mut stage_loss = 0.0;
        for i in 0..k {
            if i > 0 {
                let x = st[i - 1].stage_output().to_vec();
                st[i].stage_input_mut(b, t).copy_from_slice(&x);
            }
            stage_loss = st[i].forward(&tokens, &targets, b, t, pass);
        }
        assert_eq!(stage_loss.to_bits(), loss.to_bits());
        for i in (0..k).rev() {
            if i + 1 < k {
                let g = st[i + 1].stage_input_grad().to_vec();
                st[i].stage_output_grad_mut().copy_from_slice(&g);
            }
            st[i].backward();
        }
        // Each stage's gradients, by name; the tied embedding's copies added.
        let mut grads = vec![0.0f32; whole.layout.total];
        for s in &st {
            for q in &s.layout.params {
                let p = whole.layout.get(&q.name).unwrap();
                for (d, g) in grads[p.range()].iter_mut().zip(&s.grads[q.range()]) {
                    *d += *g;
                }
            }
        }
        for p in &whole.layout.params {
            let (a, e) = (&grads[p.range()], &whole.grads[p.range()]);
            if p.name.ends_with("wte.weight") && cfg.tied_embeddings {
                // The whole model adds a repeated token's embedding gradients onto the head's
                // (H + e₁) + e₂; the stages add H + (e₁ + e₂): equal up to rounding.
                for (x, y) in a.iter().zip(e) {
                    assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{}: {x} vs {y}", p.name);
                }
                continue;
            }
            let bad = a.iter().zip(e).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
            assert_eq!(bad, 0, "{}: {bad} gradients differ", p.name);
        }
        // And the parameters go back whole.
        let mut back = vec![0.0; whole.layout.total];
        for s in &st {
            paste(&whole.layout, &mut back, &s.layout, &s.params);
        }
        assert_eq!(back, whole.params);
    }

    #[test]
    fn gpt2_stages_with_tied_head_and_dropout_match_the_whole_model() {
        let cfg = GptConfig::gpt2((4, 2, 8), 8, 11, true, 0.1, true);
        stages_match_whole(cfg.clone(), &[1, 2, 1]);
        stages_match_whole(cfg, &[2, 2]);
    }

    #[test]
    fn llama_and_moe_stages_match_the_whole_model() {
        let llama = GptConfig { arch: Arch::Llama, n_head: 4, n_kv_head: 2, ffn_hidden: 12, bias: false, tied_embeddings: false, ..GptConfig::gpt2((3, 4, 8), 8, 13, false, 0.1, false) };
        stages_match_whole(llama.clone(), &[1, 1, 1]);
        let moe = GptConfig { n_expert: 4, top_k: 2, n_shared_expert: 1, ffn_hidden: 6, ..llama };
        stages_match_whole(moe, &[2, 1]);
    }

    #[test]
    fn layers_are_balanced_by_cost_or_split_as_listed() {
        // Equal blocks, free head: as even as possible, earlier stages take the extra layer.
        assert_eq!(split_layers(10, 4, &[], 1.0, 0.0).unwrap(), vec![0..3, 3..6, 6..8, 8..10]);
        // A head worth two blocks: the last stage takes fewer layers.
        let r = split_layers(12, 4, &[], 1.0, 2.0).unwrap();
        let cost: Vec<f64> = r.iter().map(|x| x.len() as f64 + if x.end == 12 { 2.0 } else { 0.0 }).collect();
        assert!(cost.iter().cloned().fold(0.0, f64::max) <= 4.0, "{r:?}");
        assert_eq!(split_layers(6, 3, &[1, 3, 2], 1.0, 0.0).unwrap(), vec![0..1, 1..4, 4..6]);
        let e = split_layers(6, 3, &[1, 3], 1.0, 0.0).unwrap_err();
        assert!(e.contains("parallel.pp_layers") && e.contains("3 positive layer counts"), "{e}");
        let e = split_layers(2, 3, &[], 1.0, 0.0).unwrap_err();
        assert!(e.contains("3 pipeline stages need at least 3 layers"), "{e}");
    }
}
