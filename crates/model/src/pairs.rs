//! A preference objective over a micro-batch's rows: rows `2i` and `2i + 1` hold pair `i`'s
//! chosen and rejected sequences (prompt then completion, the prompt's targets ignored), so a
//! row's log-probability is minus the sum of its counted token losses.
//!
//! The head runs twice when training with it: once for every row's token losses (no gradient),
//! from which [`PairRows::measure`] takes each pair's loss, then with each token's loss weighted
//! by its pair's gradient ([`PairRows::token_weights`]): `∂L/∂lossₜ = −∂L/∂π_row` (÷ the row's
//! counted tokens where the loss averages). The `[N, V]` logits still never exist.

use tensor::preference::{pair_loss_backward, pair_loss_forward, PairCfg, PairLogps};

/// A sequence objective over a micro-batch's rows, which needs every row's token losses before
/// any gradient: the head measures them first ([`RowObjective::measure`]), then runs with each
/// token's loss weighed as the objective says ([`RowObjective::token_weights`]).
pub trait RowObjective {
    /// Takes the token losses `[B, T]` (0 at ignored targets); returns the micro-batch's mean
    /// loss per unit (a pair, a completion). `sum_rows` sums per-row partial sums over the parts
    /// that hold a row's positions between them (context parallelism; the identity otherwise).
    fn measure(&mut self, token_losses: &[f32], targets: &[i32], ignore: i32, bt: (usize, usize), sum_rows: &mut dyn FnMut(&mut [f64])) -> f64;
    /// Each token's weight in the head's gradient when the micro-batch's loss weighs
    /// `loss_scale` (spread evenly over its units).
    fn token_weights(&self, targets: &[i32], ignore: i32, bt: (usize, usize), loss_scale: f64) -> Vec<f32>;
}

impl RowObjective for PairRows {
    fn measure(&mut self, token_losses: &[f32], targets: &[i32], ignore: i32, bt: (usize, usize), sum_rows: &mut dyn FnMut(&mut [f64])) -> f64 {
        PairRows::measure_parts(self, token_losses, targets, ignore, bt, sum_rows)
    }

    fn token_weights(&self, targets: &[i32], ignore: i32, (b, t): (usize, usize), loss_scale: f64) -> Vec<f32> {
        PairRows::token_weights(self, targets, ignore, (b, t), loss_scale / (b / 2).max(1) as f64)
    }
}

/// The sums a step reports over its pairs (summed over micro-batches and ranks, then divided by
/// `pairs`): the numbers TRL's users read.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PairStats {
    pub pairs: f64,
    pub loss: f64,
    pub reward_chosen: f64,
    pub reward_rejected: f64,
    /// pairs whose chosen reward exceeds the rejected one (TRL's `rewards/accuracies`: 0 while
    /// the policy is the reference)
    pub correct: f64,
    pub logps_chosen: f64,
    pub logps_rejected: f64,
    /// pairs whose chosen completion the policy finds likelier than the rejected one (by the
    /// loss's measure: summed, or averaged over tokens): the model's own preference
    pub prefers: f64,
}

impl PairStats {
    pub const LEN: usize = 8;

    pub fn to_array(self) -> [f64; Self::LEN] {
        [self.pairs, self.loss, self.reward_chosen, self.reward_rejected, self.correct, self.logps_chosen, self.logps_rejected, self.prefers]
    }

    pub fn from_array(a: [f64; Self::LEN]) -> PairStats {
        PairStats { pairs: a[0], loss: a[1], reward_chosen: a[2], reward_rejected: a[3], correct: a[4], logps_chosen: a[5], logps_rejected: a[6], prefers: a[7] }
    }

    pub fn add(&mut self, o: &PairStats) {
        let (mut a, b) = (self.to_array(), o.to_array());
        for (x, y) in a.iter_mut().zip(b) {
            *x += y;
        }
        *self = PairStats::from_array(a);
    }
}

/// One micro-batch's pairs: what the caller sets (the loss, the reference's log-probabilities)
/// and what a forward measures.
#[derive(Clone, Debug)]
pub struct PairRows {
    pub cfg: PairCfg,
    /// Each row's reference log-probability, summed over its counted tokens (0 without a
    /// reference: SimPO).
    pub reference: Vec<f64>,
    /// After a forward: each row's log-probability (summed) and counted tokens.
    pub logps: Vec<f64>,
    pub lens: Vec<usize>,
    /// After a forward: each pair's loss.
    pub losses: Vec<f64>,
}

impl PairRows {
    pub fn new(cfg: PairCfg) -> PairRows {
        PairRows { cfg, reference: Vec::new(), logps: Vec::new(), lens: Vec::new(), losses: Vec::new() }
    }

    /// The pairs' inputs to the loss: summed, or averaged over each row's counted tokens.
    pub fn pairs(&self) -> Vec<PairLogps> {
        let avg = self.cfg.loss.averaged();
        let at = |x: f64, r: usize| if avg { x / self.lens[r].max(1) as f64 } else { x };
        (0..self.lens.len() / 2)
            .map(|i| {
                let (c, r) = (2 * i, 2 * i + 1);
                PairLogps { chosen: at(self.logps[c], c), rejected: at(self.logps[r], r), ref_chosen: at(self.reference[c], c), ref_rejected: at(self.reference[r], r) }
            })
            .collect()
    }

    /// Reads each row's log-probability from the token losses `[B, T]` (0 at ignored targets)
    /// and computes each pair's loss; returns their mean.
    /// `sum_rows` sums the row sums of the parts that hold each row's positions between them
    /// (context parallelism; the identity otherwise).
    pub fn measure_parts(&mut self, token_losses: &[f32], targets: &[i32], ignore: i32, (b, t): (usize, usize), sum_rows: &mut dyn FnMut(&mut [f64])) -> f64 {
        assert!(b.is_multiple_of(2), "a preference micro-batch holds whole pairs: {b} rows");
        assert_eq!(self.reference.len(), b, "one reference log-probability per row");
        let (logps, lens) = row_logps(token_losses, targets, ignore, (b, t));
        let mut both: Vec<f64> = logps.into_iter().chain(lens.iter().map(|&n| n as f64)).collect();
        sum_rows(&mut both);
        self.lens = both[b..].iter().map(|&n| n as usize).collect();
        both.truncate(b);
        self.logps = both;
        let pairs = self.pairs();
        self.losses = vec![0.0; pairs.len()];
        pair_loss_forward(&mut self.losses, &pairs, &self.cfg);
        self.losses.iter().sum::<f64>() / self.losses.len().max(1) as f64
    }

    /// Each token's weight in the head's gradient when pair `i`'s loss weighs `scale`.
    pub fn token_weights(&self, targets: &[i32], ignore: i32, (b, t): (usize, usize), scale: f64) -> Vec<f32> {
        let pairs = self.pairs();
        let n = pairs.len();
        let (mut dc, mut dr) = (vec![0.0; n], vec![0.0; n]);
        pair_loss_backward(&mut dc, &mut dr, &vec![scale; n], &pairs, &self.cfg);
        let avg = self.cfg.loss.averaged();
        let mut w = vec![0.0f32; b * t];
        for row in 0..b {
            let d = if row % 2 == 0 { dc[row / 2] } else { dr[row / 2] };
            // loss = −log p, so ∂L/∂loss = −∂L/∂logp
            let per = -d / if avg { self.lens[row].max(1) as f64 } else { 1.0 };
            for j in row * t..(row + 1) * t {
                if targets[j] != ignore {
                    w[j] = per as f32;
                }
            }
        }
        w
    }

    /// The last forward's sums over this micro-batch's pairs (rows with no target on either
    /// side are padding, not a pair).
    pub fn stats(&self) -> PairStats {
        let mut s = PairStats::default();
        for (i, p) in self.pairs().iter().enumerate().filter(|(i, _)| self.lens[2 * i] + self.lens[2 * i + 1] > 0) {
            let (rc, rr) = self.cfg.rewards(p);
            let (lc, lr) = (self.logps[2 * i], self.logps[2 * i + 1]);
            let one = PairStats { pairs: 1.0, loss: self.losses[i], reward_chosen: rc, reward_rejected: rr, correct: (rc > rr) as u8 as f64, logps_chosen: lc, logps_rejected: lr, prefers: (p.chosen > p.rejected) as u8 as f64 };
            s.add(&one);
        }
        s
    }
}

/// Each row's log-probability (minus its counted token losses, summed in order in f64) and its
/// counted tokens.
pub fn row_logps(token_losses: &[f32], targets: &[i32], ignore: i32, (b, t): (usize, usize)) -> (Vec<f64>, Vec<usize>) {
    assert!(token_losses.len() == b * t && targets.len() == b * t);
    (0..b)
        .map(|r| {
            let span = r * t..(r + 1) * t;
            let lp = -token_losses[span.clone()].iter().zip(&targets[span.clone()]).filter(|(_, &y)| y != ignore).map(|(&l, _)| l as f64).sum::<f64>();
            (lp, targets[span].iter().filter(|&&y| y != ignore).count())
        })
        .unzip()
}
