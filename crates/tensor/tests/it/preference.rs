//! The preference losses: values against hand-computed pairs, gradients by finite differences.

use tensor::preference::{pair_loss_backward, pair_loss_forward, PairCfg, PairLogps, PairLoss};

fn pairs() -> Vec<PairLogps> {
    vec![
        PairLogps { chosen: -12.5, rejected: -14.0, ref_chosen: -13.0, ref_rejected: -13.25 },
        PairLogps { chosen: -3.0, rejected: -2.0, ref_chosen: -2.5, ref_rejected: -2.75 },
        PairLogps { chosen: -40.0, rejected: -80.0, ref_chosen: -41.0, ref_rejected: -60.0 },
    ]
}

fn cfgs() -> Vec<PairCfg> {
    let c = |loss, beta, label_smoothing, gamma| PairCfg { loss, beta, label_smoothing, gamma };
    vec![c(PairLoss::Dpo, 0.1, 0.0, 0.0), c(PairLoss::Dpo, 0.5, 0.2, 0.0), c(PairLoss::Ipo, 0.1, 0.0, 0.0), c(PairLoss::Simpo, 2.0, 0.0, 0.5), c(PairLoss::Simpo, 2.5, 0.1, 1.4)]
}

#[test]
fn losses_equal_hand_computed_pairs() {
    let softplus = |x: f64| (1.0 + x.exp()).ln();
    let p = pairs()[0];
    let mut l = [0.0];
    // DPO, β = 0.1: h = (−12.5 + 13) − (−14 + 13.25) = 1.25, loss = softplus(−0.125).
    pair_loss_forward(&mut l, &[p], &cfgs()[0]);
    assert!((l[0] - softplus(-0.125)).abs() < 1e-15, "{}", l[0]);
    // cDPO, β = 0.5, ε = 0.2: z = 0.625, loss = 0.8·softplus(−z) + 0.2·softplus(z).
    pair_loss_forward(&mut l, &[p], &cfgs()[1]);
    assert!((l[0] - (0.8 * softplus(-0.625) + 0.2 * softplus(0.625))).abs() < 1e-15, "{}", l[0]);
    // IPO, β = 0.1: (1.25 − 5)².
    pair_loss_forward(&mut l, &[p], &cfgs()[2]);
    assert!((l[0] - 3.75f64.powi(2)).abs() < 1e-12, "{}", l[0]);
    // SimPO, β = 2, γ = 0.5: z = 2·1.5 − 0.5 = 2.5; the reference plays no part.
    pair_loss_forward(&mut l, &[PairLogps { ref_chosen: 99.0, ..p }], &cfgs()[3]);
    assert!((l[0] - softplus(-2.5)).abs() < 1e-15, "{}", l[0]);
    // A very confident pair neither overflows nor loses its gradient to rounding.
    let far = PairLogps { chosen: -1.0, rejected: -9000.0, ref_chosen: -1.0, ref_rejected: -1.0 };
    pair_loss_forward(&mut l, &[far], &cfgs()[0]);
    assert!(l[0].is_finite() && l[0] < 1e-300, "{}", l[0]);
    let far = PairLogps { chosen: -9000.0, rejected: -1.0, ref_chosen: -1.0, ref_rejected: -1.0 };
    pair_loss_forward(&mut l, &[far], &cfgs()[0]);
    assert!((l[0] - 899.9).abs() < 1e-9, "{}", l[0]);
}

#[test]
fn gradients_match_finite_differences() {
    let ps = pairs();
    let dl = [1.0, -0.5, 2.0];
    let total = |ps: &[PairLogps], cfg: &PairCfg| {
        let mut l = vec![0.0; ps.len()];
        pair_loss_forward(&mut l, ps, cfg);
        l.iter().zip(dl).map(|(a, b)| a * b).sum::<f64>()
    };
    for cfg in cfgs() {
        let (mut dc, mut dr) = (vec![0.5; 3], vec![-0.25; 3]);
        pair_loss_backward(&mut dc, &mut dr, &dl, &ps, &cfg);
        for i in 0..ps.len() {
            for (side, got) in [(0, dc[i] - 0.5), (1, dr[i] + 0.25)] {
                let h = 1e-5;
                let at = |d: f64| {
                    let mut q = ps.clone();
                    if side == 0 { q[i].chosen += d } else { q[i].rejected += d }
                    total(&q, &cfg)
                };
                let fd = (at(h) - at(-h)) / (2.0 * h);
                assert!((fd - got).abs() <= 1e-7 * (1.0 + fd.abs()), "{cfg:?} pair {i} side {side}: {got} vs {fd}");
            }
        }
        // The reference is frozen: moving it changes the loss, but no gradient goes to it.
        if cfg.loss.uses_reference() {
            let mut q = ps.clone();
            q[0].ref_chosen += 0.5;
            assert_ne!(total(&q, &cfg), total(&ps, &cfg));
        }
    }
}
