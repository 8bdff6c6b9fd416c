//! Evaluation on the held-out split: every rank runs the same number of forwards (ZeRO-3's
//! forward is collective), a pipeline passes activations stage to stage, and the sums are
//! combined over the ranks that split the batch. The rows are the split's non-overlapping
//! windows or, with packed documents, its documents packed in order; targets the loss mask
//! excludes are not counted.

use super::data::{eval_rows, fill_rows};
use crate::step::RowBuf;
use crate::step::Chunk;
use data::Split;
use model::{Gpt, Pass};
use parallel::Comm;

/// Which evaluation batches a rank runs: rows of `t` tokens of the split ([`eval_rows`]),
/// `batch` rows at a time, at most `max_batches` batches (0 = all); rank `rank` of `ranks`
/// takes batches `rank, rank + ranks, …` (every rank runs the same number of forwards,
/// padding with fully ignored batches, since ZeRO-3's forward is collective).
#[derive(Clone, Copy, Debug)]
pub struct EvalBatches {
    pub t: usize,
    pub batch: usize,
    pub max_batches: usize,
    pub rank: usize,
    pub ranks: usize,
    /// Packed documents (`data.packing = "documents"`), positions restarting per document.
    pub packed: bool,
    pub reset_positions: bool,
}

impl EvalBatches {
    /// One rank's batches of plain windows.
    pub fn windows(t: usize, batch: usize, max_batches: usize) -> EvalBatches {
        EvalBatches { t, batch, max_batches, rank: 0, ranks: 1, packed: false, reset_positions: false }
    }
}

/// Mean loss over the evaluation rows of the split (see [`EvalBatches`], one rank).
/// Returns (loss, targets counted).
pub fn evaluate(m: &mut Gpt, split: &Split, eb: EvalBatches) -> (f64, usize) {
    let (sum, count) = eval_sums(m, None, split, eb);
    (sum / count.max(1) as f64, count)
}

/// [`evaluate`] on a GPU (`kiln eval --device`): each batch's forward on the device, its
/// per-position losses downloaded.
#[cfg(feature = "vulkan")]
pub fn evaluate_on_device(m: &mut model::device::DeviceGpt, split: &Split, eb: EvalBatches) -> crate::error::Result<(f64, usize)> {
    let (sum, count) = eval_sums_on_device(m, split, eb);
    Ok((sum / count.max(1) as f64, count))
}

/// [`eval_sums`] on a GPU: (sum of losses, targets counted).
#[cfg(feature = "vulkan")]
pub fn eval_sums_on_device(m: &mut model::device::DeviceGpt, split: &Split, eb: EvalBatches) -> (f64, usize) {
    eval_batches(split, eb, |b| {
        let count = m.forward_docs(&b.x, &b.y, b.docs(), eb.batch, eb.t, Pass::Eval);
        (m.losses().iter().map(|&l| l as f64).sum::<f64>(), count)
    })
}

/// [`eval_sums_pipeline`] on a device, the rank's model chunks in `models` (chunk `c` virtual
/// stage `c·P + me`): each batch runs forward through the virtual stages in turn, the
/// activations sent on through the host; the last stage's ranks alone return a nonzero sum.
#[cfg(feature = "vulkan")]
pub fn eval_sums_pipeline_on_device(models: &mut [&mut model::device::DeviceGpt], pp: &dyn Comm, me: usize, split: &Split, eb: EvalBatches) -> (f64, usize) {
    let (p, v, batch, t) = (pp.size(), models.len(), eb.batch, eb.t);
    eval_batches(split, eb, |b| {
        let (mut sum, mut count) = (0.0, 0);
        for vs in (0..p * v).filter(|vs| vs % p == me) {
            let m = &mut *models[vs / p];
            if vs > 0 {
                let mut x = vec![0.0; m.stage_width(batch, t)];
                pp.recv(&mut x, (vs - 1) % p, (1 << 20) + vs as u32);
                m.set_stage_input(&x, batch, t);
            }
            count = m.forward_docs(&b.x, &b.y, b.docs(), batch, t, Pass::Eval);
            if vs + 1 < p * v {
                pp.send(&m.stage_output(), (vs + 1) % p, (1 << 20) + vs as u32 + 1);
            } else {
                sum = m.losses().iter().map(|&l| l as f64).sum::<f64>();
            }
        }
        (sum, count)
    })
}

/// This rank's share of [`evaluate`]. Returns (sum of losses, targets counted), to be summed
/// over ranks.
pub fn eval_sums(m: &mut Gpt, mut store: Option<&mut dyn model::UnitStore>, split: &Split, eb: EvalBatches) -> (f64, usize) {
    eval_batches(split, eb, |b| {
        match store.as_deref_mut() {
            Some(s) => m.forward_with(s, &b.x, &b.y, b.docs(), (eb.batch, eb.t), Pass::Eval),
            None => match b.docs() {
                Some(d) => m.forward_docs(&b.x, &b.y, d, eb.batch, eb.t, Pass::Eval),
                None => m.forward(&b.x, &b.y, eb.batch, eb.t, Pass::Eval),
            },
        };
        (m.losses().iter().map(|&l| l as f64).sum::<f64>(), m.counted())
    })
}

/// [`eval_sums`] through a pipeline: each batch runs forward through every virtual stage in
/// turn (this rank's chunks `c` are stages `c·p + me`), activations passed on; the losses
/// come out of the last stage, whose ranks alone return a nonzero sum.
pub(super) fn eval_sums_pipeline(chunks: &mut [Chunk], pp: &dyn Comm, me: usize, split: &Split, eb: EvalBatches) -> (f64, usize) {
    let (p, v) = (pp.size(), chunks.len());
    let (batch, t) = (eb.batch, eb.t);
    eval_batches(split, eb, |b| {
        let (mut sum, mut count) = (0.0, 0);
        for vs in (0..p * v).filter(|vs| vs % p == me) {
            let ch = &mut chunks[vs / p];
            if vs > 0 {
                pp.recv(ch.model.stage_input_mut(batch, t), (vs - 1) % p, (1 << 20) + vs as u32);
            }
            ch.model.forward_with(&mut ch.dp, &b.x, &b.y, b.docs(), (batch, t), Pass::Eval);
            count = ch.model.counted();
            if vs + 1 < p * v {
                pp.send(ch.model.stage_output(), (vs + 1) % p, (1 << 20) + vs as u32 + 1);
            } else {
                sum = ch.model.losses().iter().map(|&l| l as f64).sum::<f64>();
            }
        }
        (sum, count)
    })
}

/// The evaluation batches `eb` of `split`, each given to `forward` (which returns its sum of
/// losses and the targets the model counted: a context-parallel part counts its positions').
/// Returns (sum of losses, targets counted).
fn eval_batches(split: &Split, eb: EvalBatches, mut forward: impl FnMut(&RowBuf) -> (f64, usize)) -> (f64, usize) {
    let EvalBatches { t, batch, max_batches, rank, ranks: n, packed, reset_positions } = eb;
    let rows = eval_rows(split, t, packed, max_batches * batch);
    let batches: Vec<&[super::data::Row]> = rows.chunks(batch).collect();
    let rounds = batches.len().div_ceil(n);
    let (mut sum, mut count) = (0.0f64, 0usize);
    for k in 0..rounds {
        let chunk = batches.get(k * n + rank).copied().unwrap_or(&[]);
        let mut b = RowBuf::new(batch, t, packed);
        fill_rows(&[split], chunk, t, reset_positions, &mut b);
        let (s, c) = forward(&b);
        (sum, count) = (sum + s, count + c);
    }
    (sum, count)
}
