//! GRPO: advantages and clipping on hand-computed groups, the gradient by finite differences.

use tensor::grpo::{group_advantages, grpo_token_backward, grpo_token_forward, GrpoCfg, TokenLogps, TokenTerms};

#[test]
fn advantages_are_group_relative() {
    // Two groups of 4: rewards 1, 0, 0, 1 (mean 0.5, unbiased std √(1/3)) and all equal.
    let r = [1.0, 0.0, 0.0, 1.0, 0.7, 0.7, 0.7, 0.7];
    let a = group_advantages(&r, 4, true);
    let s = (1.0f64 / 3.0).sqrt() + 1e-4;
    let want = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0, 0.0, 0.0];
    for (x, y) in a.iter().zip(want) {
        assert!((x - y).abs() < 1e-12, "{a:?}");
    }
    // Dr. GRPO: not scaled.
    assert_eq!(group_advantages(&r, 4, false), vec![0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]);
    // A group of one has nothing to compare with.
    assert_eq!(group_advantages(&[3.0], 1, true), vec![0.0]);
}

#[test]
fn the_ratio_is_clipped_where_it_would_gain_past_the_range() {
    let cfg = GrpoCfg { eps_low: 0.2, eps_high: 0.28, beta: 0.0 };
    let tok = |ratio: f64, advantage: f64| TokenLogps { logp: ratio.ln(), old: 0.0, reference: 0.0, advantage };
    let cases = [
        // (ratio, advantage, loss, clipped low, clipped high, dloss/dlogp)
        (1.0, 2.0, -2.0, false, false, -2.0),
        (1.5, 2.0, -1.28 * 2.0, false, true, 0.0),  // above 1 + ε_high with A > 0: clipped, no gradient
        (1.5, -2.0, 3.0, false, false, 3.0),        // above with A < 0: the unclipped term is the smaller
        (0.5, -2.0, 0.8 * 2.0, true, false, 0.0),   // below 1 − ε_low with A < 0: clipped
        (0.5, 2.0, -1.0, false, false, -1.0),       // below with A > 0: unclipped
    ];
    for (ratio, a, loss, low, high, grad) in cases {
        let t = [tok(ratio, a)];
        let mut out = [TokenTerms::default()];
        grpo_token_forward(&mut out, &t, &cfg);
        assert!((out[0].loss - loss).abs() < 1e-12, "ratio {ratio} A {a}: {:?}", out[0]);
        assert_eq!((out[0].clipped_low, out[0].clipped_high), (low, high), "ratio {ratio} A {a}");
        let mut d = [0.0];
        grpo_token_backward(&mut d, &[1.0], &t, &cfg);
        assert!((d[0] - grad).abs() < 1e-12, "ratio {ratio} A {a}: {}", d[0]);
    }
    // The k3 KL: exp(d) − d − 1 with d = ref − logp, 0 where they agree.
    let cfg = GrpoCfg { beta: 0.04, ..cfg };
    let t = [TokenLogps { logp: -1.0, old: -1.0, reference: -1.5, advantage: 0.0 }, TokenLogps { logp: -2.0, old: -2.0, reference: -2.0, advantage: 0.0 }];
    let mut out = [TokenTerms::default(); 2];
    grpo_token_forward(&mut out, &t, &cfg);
    let d = -0.5f64;
    assert!((out[0].kl - (d.exp() - d - 1.0)).abs() < 1e-15 && out[1].kl == 0.0, "{out:?}");
    assert!((out[0].loss - 0.04 * out[0].kl).abs() < 1e-15);
}

#[test]
fn gradients_match_finite_differences() {
    let cfg = GrpoCfg { eps_low: 0.2, eps_high: 0.2, beta: 0.1 };
    // Ratios inside and outside the range, both signs of advantage.
    let toks: Vec<TokenLogps> = [(0.05, 1.3, -0.4), (-0.1, -0.7, 0.3), (0.4, 0.9, -1.1), (-0.5, -1.2, -0.2), (0.3, -0.8, 0.6)]
        .iter()
        .map(|&(shift, advantage, refd)| TokenLogps { logp: -1.0 + shift, old: -1.0, reference: -1.0 + refd, advantage })
        .collect();
    let w = [1.0, 0.5, -2.0, 0.25, 1.5];
    let total = |t: &[TokenLogps]| {
        let mut out = vec![TokenTerms::default(); t.len()];
        grpo_token_forward(&mut out, t, &cfg);
        out.iter().zip(w).map(|(o, w)| o.loss * w).sum::<f64>()
    };
    let mut d = vec![0.0; toks.len()];
    grpo_token_backward(&mut d, &w, &toks, &cfg);
    for i in 0..toks.len() {
        let h = 1e-6;
        let at = |e: f64| {
            let mut t = toks.clone();
            t[i].logp += e;
            total(&t)
        };
        let fd = (at(h) - at(-h)) / (2.0 * h);
        assert!((fd - d[i]).abs() < 1e-6 * (1.0 + fd.abs()), "token {i}: {} vs {fd}", d[i]);
    }
}
