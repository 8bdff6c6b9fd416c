//! GRPO (Shao et al. 2024): group-relative advantages and the clipped policy-gradient loss
//! per completion token, with the k3 estimate of the KL divergence to a reference model, as
//! TRL's `GRPOTrainer` computes them; and Dr. GRPO's (Liu et al. 2025) unbiased form.
//!
//! A prompt's `G` completions form a group. Each completion's reward `r` becomes an advantage
//! `A = r − mean(group)`, divided by the group's standard deviation (+ 1e-4) unless the rewards
//! are left unscaled (Dr. GRPO). Per completion token, with `ρ = exp(logp − logp_old)`:
//!
//! `loss = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A) + β·(exp(ref − logp) − (ref − logp) − 1)`,
//!
//! whose gradient with respect to `logp` is `−ρ·A` where the unclipped term is the smaller (0
//! where the clipped one is, and clipping binds) plus `β·(1 − exp(ref − logp))`. The caller
//! weighs each token's loss by how its objective averages them ([`Aggregation`]).

/// How token losses become the step's loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Aggregation {
    /// GRPO's: each completion's mean token loss, then the mean over completions.
    Sequence,
    /// Dr. GRPO's: the sum of every token loss over `completions × max completion length`.
    Constant,
}

/// GRPO's hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GrpoCfg {
    /// The clip range below and above 1 of the policy ratio.
    pub eps_low: f64,
    pub eps_high: f64,
    /// The KL penalty's weight (0: no reference model is read).
    pub beta: f64,
}

/// One completion token's log-probabilities: the policy's now, when its completion was sampled
/// (`old`), and the reference's; and its completion's advantage.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TokenLogps {
    pub logp: f64,
    pub old: f64,
    pub reference: f64,
    pub advantage: f64,
}

/// What a token's loss is made of, for the step's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TokenTerms {
    pub loss: f64,
    /// The k3 estimate of KL(policy ‖ reference) at the token.
    pub kl: f64,
    /// The ratio was clipped below (with a negative advantage) or above (with a positive one).
    pub clipped_low: bool,
    pub clipped_high: bool,
}

/// Group-relative advantages of `rewards`, groups of `group` consecutive completions:
/// `r − mean`, divided by the group's (unbiased, as `torch.std`) standard deviation + 1e-4 when
/// `scale`.
pub fn group_advantages(rewards: &[f64], group: usize, scale: bool) -> Vec<f64> {
    assert!(group > 0 && rewards.len().is_multiple_of(group), "{} rewards in groups of {group}", rewards.len());
    rewards
        .chunks(group)
        .flat_map(|g| {
            let mean = g.iter().sum::<f64>() / g.len() as f64;
            let var = if g.len() > 1 { g.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (g.len() - 1) as f64 } else { 0.0 };
            let div = if scale { var.sqrt() + 1e-4 } else { 1.0 };
            g.iter().map(move |r| (r - mean) / div)
        })
        .collect()
}

fn ratio_and_clip(t: &TokenLogps, cfg: &GrpoCfg) -> (f64, f64) {
    let rho = (t.logp - t.old).exp();
    (rho, rho.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high))
}

/// Each token's loss and its parts.
pub fn grpo_token_forward(out: &mut [TokenTerms], tokens: &[TokenLogps], cfg: &GrpoCfg) {
    assert_eq!(out.len(), tokens.len());
    for (o, t) in out.iter_mut().zip(tokens) {
        let (rho, clipped) = ratio_and_clip(t, cfg);
        let a = t.advantage;
        let d = t.reference - t.logp;
        let kl = if cfg.beta != 0.0 { d.exp() - d - 1.0 } else { 0.0 };
        *o = TokenTerms {
            loss: -(rho * a).min(clipped * a) + cfg.beta * kl,
            kl,
            clipped_low: rho < 1.0 - cfg.eps_low && a < 0.0,
            clipped_high: rho > 1.0 + cfg.eps_high && a > 0.0,
        };
    }
}

/// Accumulates `dlogp[N]`, the gradient of `Σ dloss·loss` with respect to each token's
/// log-probability under the policy.
pub fn grpo_token_backward(dlogp: &mut [f64], dloss: &[f64], tokens: &[TokenLogps], cfg: &GrpoCfg) {
    assert!(dlogp.len() == tokens.len() && dloss.len() == tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        let (rho, clipped) = ratio_and_clip(t, cfg);
        let a = t.advantage;
        // Where both terms are equal (ρ inside the clip range) both carry ρ·A's gradient.
        let policy = if rho * a <= clipped * a || rho == clipped { -rho * a } else { 0.0 };
        let kl = if cfg.beta != 0.0 { cfg.beta * (1.0 - (t.reference - t.logp).exp()) } else { 0.0 };
        dlogp[i] += dloss[i] * (policy + kl);
    }
}
