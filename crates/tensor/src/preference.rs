//! Preference-optimisation losses over pairs of sequence log-probabilities: DPO (Rafailov et
//! al. 2023, the sigmoid loss, with cDPO's label smoothing), IPO (Azar et al. 2023) and SimPO
//! (Meng et al. 2024, reference-free), each as TRL computes it.
//!
//! A pair is a chosen and a rejected completion of one prompt. Its inputs are the policy's
//! log-probabilities of each completion, `πc` and `πr`, and the reference model's, `ρc` and
//! `ρr`: summed over the completion's tokens for DPO, averaged over them for IPO and SimPO
//! ([`PairLoss::averaged`]; the caller divides). With `h = (πc − ρc) − (πr − ρr)`:
//!
//! - DPO: `z = β·h`, `loss = −(1 − ε)·log σ(z) − ε·log σ(−z)`;
//! - IPO: `loss = (h − 1/(2β))²`;
//! - SimPO: `z = β·(πc − πr) − γ`, `loss = −(1 − ε)·log σ(z) − ε·log σ(−z)`.
//!
//! The forward writes each pair's loss; the backward accumulates `dπc` and `dπr` from each
//! pair's loss gradient (the reference gets none: it is frozen). The arithmetic is f64 per
//! pair, so the losses are as exact as the log-probabilities they are given.

/// Which preference loss (`train.objective`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PairLoss {
    Dpo,
    Ipo,
    Simpo,
}

impl PairLoss {
    /// Whether the loss takes a completion's mean token log-probability rather than its sum.
    pub fn averaged(self) -> bool {
        self != PairLoss::Dpo
    }

    /// Whether the loss reads a reference model's log-probabilities.
    pub fn uses_reference(self) -> bool {
        self != PairLoss::Simpo
    }
}

/// A preference loss and its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PairCfg {
    pub loss: PairLoss,
    /// `β`: the strength of the implicit KL penalty (DPO, IPO) or the reward scale (SimPO).
    pub beta: f64,
    /// `ε`: the probability that a pair's labels are flipped (cDPO); DPO and SimPO only.
    pub label_smoothing: f64,
    /// `γ`: SimPO's target reward margin.
    pub gamma: f64,
}

/// One pair's log-probabilities: the policy's and the reference's, chosen and rejected.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PairLogps {
    pub chosen: f64,
    pub rejected: f64,
    pub ref_chosen: f64,
    pub ref_rejected: f64,
}

/// `log σ(x)`, without overflow for either sign.
fn log_sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        -(-x).exp().ln_1p()
    } else {
        x - x.exp().ln_1p()
    }
}

fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

impl PairCfg {
    /// The pair's argument `z` (DPO, SimPO) or `h − 1/(2β)` (IPO), and its derivatives with
    /// respect to `πc` and `πr`.
    fn argument(&self, p: &PairLogps) -> (f64, f64, f64) {
        let b = self.beta;
        match self.loss {
            PairLoss::Dpo => (b * ((p.chosen - p.ref_chosen) - (p.rejected - p.ref_rejected)), b, -b),
            PairLoss::Ipo => ((p.chosen - p.ref_chosen) - (p.rejected - p.ref_rejected) - 0.5 / b, 1.0, -1.0),
            PairLoss::Simpo => (b * (p.chosen - p.rejected) - self.gamma, b, -b),
        }
    }

    /// The pair's loss and its derivative with respect to its argument.
    fn loss_and_slope(&self, a: f64) -> (f64, f64) {
        let e = self.label_smoothing;
        match self.loss {
            PairLoss::Ipo => (a * a, 2.0 * a),
            PairLoss::Dpo | PairLoss::Simpo => (-(1.0 - e) * log_sigmoid(a) - e * log_sigmoid(-a), -(1.0 - e) * sigmoid(-a) + e * sigmoid(a)),
        }
    }

    /// The implicit rewards `(chosen, rejected)` TRL reports: `β·(π − ρ)` with a reference,
    /// `β·π` for SimPO.
    pub fn rewards(&self, p: &PairLogps) -> (f64, f64) {
        match self.loss {
            PairLoss::Simpo => (self.beta * p.chosen, self.beta * p.rejected),
            _ => (self.beta * (p.chosen - p.ref_chosen), self.beta * (p.rejected - p.ref_rejected)),
        }
    }
}

/// Writes each pair's loss into `losses[P]`.
pub fn pair_loss_forward(losses: &mut [f64], pairs: &[PairLogps], cfg: &PairCfg) {
    assert_eq!(losses.len(), pairs.len());
    for (l, p) in losses.iter_mut().zip(pairs) {
        *l = cfg.loss_and_slope(cfg.argument(p).0).0;
    }
}

/// Accumulates `dchosen[P]` and `drejected[P]` (the gradients of the policy's log-probabilities)
/// from `dlosses[P]`, the weight of each pair's loss.
pub fn pair_loss_backward(dchosen: &mut [f64], drejected: &mut [f64], dlosses: &[f64], pairs: &[PairLogps], cfg: &PairCfg) {
    assert!(dchosen.len() == pairs.len() && drejected.len() == pairs.len() && dlosses.len() == pairs.len());
    for (i, p) in pairs.iter().enumerate() {
        let (a, dc, dr) = cfg.argument(p);
        let slope = cfg.loss_and_slope(a).1 * dlosses[i];
        dchosen[i] += slope * dc;
        drejected[i] += slope * dr;
    }
}
