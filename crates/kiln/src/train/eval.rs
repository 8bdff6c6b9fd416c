//! Evaluation on the held-out split: every rank runs the same number of forwards (ZeRO-3's
//! forward is collective), a pipeline passes activations stage to stage, and the sums are
//! combined over the ranks that split the batch.

use super::data::fill_windows;
use crate::step::Chunk;
use data::Tokens;
use model::gpt::IGNORE_INDEX;
use model::{Gpt, Pass};
use parallel::Comm;

/// Which evaluation batches a rank runs: non-overlapping windows of `t` tokens of the split,
/// `batch` windows at a time, at most `max_batches` batches (0 = all); rank `rank` of `ranks`
/// takes batches `rank, rank + ranks, …` (every rank runs the same number of forwards,
/// padding with fully ignored batches, since ZeRO-3's forward is collective).
#[derive(Clone, Copy, Debug)]
pub struct EvalBatches {
    pub t: usize,
    pub batch: usize,
    pub max_batches: usize,
    pub rank: usize,
    pub ranks: usize,
}

/// Mean loss over the evaluation windows of the split (see [`EvalBatches`], one rank).
/// Returns (loss, tokens counted).
pub fn evaluate(m: &mut Gpt, toks: &Tokens, t: usize, batch: usize, max_batches: usize) -> (f64, usize) {
    let (sum, count) = eval_sums(m, None, toks, EvalBatches { t, batch, max_batches, rank: 0, ranks: 1 });
    (sum / count.max(1) as f64, count)
}

/// This rank's share of [`evaluate`]. Returns (sum of losses, tokens counted), to be summed over
/// ranks.
pub fn eval_sums(m: &mut Gpt, mut store: Option<&mut dyn model::UnitStore>, toks: &Tokens, eb: EvalBatches) -> (f64, usize) {
    eval_batches(toks, eb, |x, y| {
        match store.as_deref_mut() {
            Some(s) => m.forward_with(s, x, y, None, eb.batch, eb.t, Pass::Eval),
            None => m.forward(x, y, eb.batch, eb.t, Pass::Eval),
        };
        m.losses().iter().map(|&l| l as f64).sum::<f64>()
    })
}

/// [`eval_sums`] through a pipeline: each batch runs forward through every virtual stage in
/// turn (this rank's chunks `c` are stages `c·p + me`), activations passed on; the losses
/// come out of the last stage, whose ranks alone return a nonzero sum.
pub(super) fn eval_sums_pipeline(chunks: &mut [Chunk], pp: &dyn Comm, me: usize, toks: &Tokens, eb: EvalBatches) -> (f64, usize) {
    let (p, v) = (pp.size(), chunks.len());
    let (batch, t) = (eb.batch, eb.t);
    eval_batches(toks, eb, |x, y| {
        let mut sum = 0.0;
        for vs in (0..p * v).filter(|vs| vs % p == me) {
            let ch = &mut chunks[vs / p];
            if vs > 0 {
                pp.recv(ch.model.stage_input_mut(batch, t), (vs - 1) % p, (1 << 20) + vs as u32);
            }
            ch.model.forward_with(&mut ch.dp, x, y, None, batch, t, Pass::Eval);
            if vs + 1 < p * v {
                pp.send(ch.model.stage_output(), (vs + 1) % p, (1 << 20) + vs as u32 + 1);
            } else {
                sum = ch.model.losses().iter().map(|&l| l as f64).sum::<f64>();
            }
        }
        sum
    })
}

/// The evaluation batches `eb` of `toks`, each given to `forward` (which returns its sum of
/// losses). Returns (sum of losses, tokens counted).
fn eval_batches(toks: &Tokens, eb: EvalBatches, mut forward: impl FnMut(&[u32], &[i32]) -> f64) -> (f64, usize) {
    let EvalBatches { t, batch, max_batches, rank, ranks: n } = eb;
    let n_windows = (toks.len() - 1) / t;
    let mut offsets: Vec<usize> = (0..n_windows).map(|k| k * t).collect();
    if max_batches > 0 {
        offsets.truncate(max_batches * batch);
    }
    let batches: Vec<&[usize]> = offsets.chunks(batch).collect();
    let rounds = batches.len().div_ceil(n);
    let (mut x, mut y) = (vec![0u32; batch * t], vec![0i32; batch * t]);
    let (mut sum, mut count) = (0.0f64, 0usize);
    for k in 0..rounds {
        let chunk: &[usize] = batches.get(k * n + rank).copied().unwrap_or(&[]);
        x.fill(0);
        y.fill(IGNORE_INDEX);
        fill_windows(toks, chunk, t, &mut x, &mut y);
        sum += forward(&x, &y);
        count += chunk.len() * t;
    }
    (sum, count)
}
