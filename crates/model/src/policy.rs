//! A policy-gradient objective over a micro-batch's rows (GRPO): each row is a prompt and one
//! sampled completion, the prompt's targets ignored, so each counted token's log-probability is
//! minus its token loss. Each token's loss is `tensor::grpo`'s (the clipped ratio against the
//! log-probability when the completion was sampled, its completion's advantage, the k3 KL to a
//! reference); a completion's loss is their mean (GRPO) or their sum over the longest completion
//! allowed (Dr. GRPO), and the micro-batch's loss the mean over its completions.

use crate::pairs::RowObjective;
use tensor::grpo::{grpo_token_backward, grpo_token_forward, Aggregation, GrpoCfg, TokenLogps, TokenTerms};

/// The sums a step reports over its completions (summed over micro-batches and ranks).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PolicyStats {
    pub completions: f64,
    pub loss: f64,
    pub tokens: f64,
    pub kl: f64,
    pub clipped_low: f64,
    pub clipped_high: f64,
}

impl PolicyStats {
    pub const LEN: usize = 6;

    pub fn to_array(self) -> [f64; Self::LEN] {
        [self.completions, self.loss, self.tokens, self.kl, self.clipped_low, self.clipped_high]
    }

    pub fn from_array(a: [f64; Self::LEN]) -> PolicyStats {
        PolicyStats { completions: a[0], loss: a[1], tokens: a[2], kl: a[3], clipped_low: a[4], clipped_high: a[5] }
    }

    pub fn add(&mut self, o: &PolicyStats) {
        let (mut a, b) = (self.to_array(), o.to_array());
        for (x, y) in a.iter_mut().zip(b) {
            *x += y;
        }
        *self = PolicyStats::from_array(a);
    }
}

/// One micro-batch's completions: what the caller sets and what a forward measures.
#[derive(Clone, Debug)]
pub struct PolicyRows {
    pub cfg: GrpoCfg,
    pub aggregation: Aggregation,
    /// The longest completion allowed (Dr. GRPO's constant).
    pub max_new: usize,
    /// The parts that hold a row's positions between them (context parallelism; 1): each part
    /// counts its share of a completion.
    pub parts: usize,
    /// Each row's advantage.
    pub advantages: Vec<f64>,
    /// Each position's log-probability when its completion was sampled (`[B, T]`; empty: the
    /// current policy's, so the ratio is 1), and the reference's (empty without a KL term).
    pub old: Vec<f32>,
    pub reference: Vec<f32>,
    /// After a forward: each position's terms (`[B, T]`, default at ignored targets) and each
    /// row's counted tokens.
    pub terms: Vec<TokenTerms>,
    pub lens: Vec<usize>,
    tokens: Vec<TokenLogps>,
}

impl PolicyRows {
    pub fn new(cfg: GrpoCfg, aggregation: Aggregation, max_new: usize) -> PolicyRows {
        PolicyRows { cfg, aggregation, max_new, parts: 1, advantages: Vec::new(), old: Vec::new(), reference: Vec::new(), terms: Vec::new(), lens: Vec::new(), tokens: Vec::new() }
    }

    /// What a row's token losses are divided by.
    fn divisor(&self, row: usize) -> f64 {
        match self.aggregation {
            Aggregation::Sequence => self.lens[row].max(1) as f64,
            Aggregation::Constant => self.max_new.max(1) as f64,
        }
    }

    /// The last forward's sums over this micro-batch's completions (rows with no target are
    /// padding).
    pub fn stats(&self) -> PolicyStats {
        let mut s = PolicyStats::default();
        // (The rows this part holds: under context parallelism, its positions of each.)
        let t = self.terms.len() / self.lens.len().max(1);
        for (row, &len) in self.lens.iter().enumerate().filter(|(_, &l)| l > 0) {
            let terms = &self.terms[row * t..(row + 1) * t];
            let counted = |f: &dyn Fn(&TokenTerms) -> f64| terms.iter().map(f).sum::<f64>();
            s.add(&PolicyStats {
                completions: 1.0 / self.parts.max(1) as f64,
                loss: counted(&|x| x.loss) / self.divisor(row),
                tokens: len as f64 / self.parts.max(1) as f64,
                kl: counted(&|x| x.kl),
                clipped_low: counted(&|x| x.clipped_low as u8 as f64),
                clipped_high: counted(&|x| x.clipped_high as u8 as f64),
            });
        }
        s
    }
}

impl RowObjective for PolicyRows {
    fn measure(&mut self, token_losses: &[f32], targets: &[i32], ignore: i32, (b, t): (usize, usize), sum_rows: &mut dyn FnMut(&mut [f64])) -> f64 {
        assert_eq!(self.advantages.len(), b, "one advantage per row");
        let n = b * t;
        assert!(self.old.is_empty() || self.old.len() == n, "old log-probabilities are [B, T]");
        assert!(self.reference.is_empty() || self.reference.len() == n, "reference log-probabilities are [B, T]");
        self.tokens = (0..n)
            .map(|i| {
                let logp = -(token_losses[i] as f64);
                let at = |v: &[f32]| v.get(i).map_or(logp, |&x| x as f64);
                TokenLogps { logp, old: at(&self.old), reference: at(&self.reference), advantage: self.advantages[i / t] }
            })
            .collect();
        let mut terms = vec![TokenTerms::default(); n];
        grpo_token_forward(&mut terms, &self.tokens, &self.cfg);
        for (term, &y) in terms.iter_mut().zip(targets) {
            if y == ignore {
                *term = TokenTerms::default();
            }
        }
        self.terms = terms;
        // Each row's counted tokens, over every part that holds some of its positions.
        let mut lens: Vec<f64> = (0..b).map(|r| targets[r * t..(r + 1) * t].iter().filter(|&&y| y != ignore).count() as f64).collect();
        sum_rows(&mut lens);
        self.lens = lens.into_iter().map(|n| n as usize).collect();
        let s = self.stats();
        s.loss / s.completions.max(1.0)
    }

    fn token_weights(&self, targets: &[i32], ignore: i32, (b, t): (usize, usize), loss_scale: f64) -> Vec<f32> {
        let per_row = loss_scale / b.max(1) as f64;
        let dloss: Vec<f64> = (0..b * t).map(|i| if targets[i] == ignore { 0.0 } else { per_row / self.divisor(i / t) }).collect();
        let mut dlogp = vec![0.0; b * t];
        grpo_token_backward(&mut dlogp, &dloss, &self.tokens, &self.cfg);
        // loss = −log p at each token, so ∂L/∂loss = −∂L/∂logp.
        dlogp.iter().map(|&d| (-d) as f32).collect()
    }
}
