//! A preference objective's parts outside the step: the reference model's log-probabilities,
//! the pairs' rows' checks, and the held-out pairs' evaluation.
//!
//! The reference is the model the run starts from (with LoRA: the frozen base, its adapters
//! still zero), so its log-probabilities are measured once, before the first step, over every
//! pair of every split, without dropout, and kept in `RUN/reference_logps.json`: no second copy
//! of the weights is held, and a resumed run reads them back rather than measuring its trained
//! weights. Every rank measures every document (each rank's forwards are the same, which
//! ZeRO-3's collective forward needs); a document's rows are those the step trains on.

use super::data::{fill_rows, pair_row, Row, Source, TrainData};
use crate::config::RunConfig;
use crate::error::{user, KilnError, Result};
use crate::step::{Chunk, RowBuf};
use data::Split;
use model::pairs::{PairRows, PairStats};
use model::Pass;
use std::path::Path;

/// The file in the run directory.
pub const REFERENCE_FILE: &str = "reference_logps.json";

/// Each source's reference log-probabilities, per document of its training and held-out splits
/// (pair `i`'s chosen at `2i`, rejected at `2i + 1`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct References {
    pub train: Vec<Vec<f64>>,
    pub val: Vec<Vec<f64>>,
    /// The held-out pairs' preference accuracy under the reference (the model the run starts
    /// from): the fraction whose chosen completion it finds likelier, by the loss's measure.
    pub val_accuracy: Option<f64>,
}

/// Refuses a preference set whose rows, cut at `train.seq_len` tokens, leave a completion no
/// target: its log-probability would be empty.
pub(crate) fn check_pairs_fit(cfg: &RunConfig, ds: &TrainData) -> Result<()> {
    let t = cfg.seq_len();
    for s in &ds.sources {
        for (which, split) in [("training", &s.train), ("held-out", &s.val)] {
            let Some(mask) = &split.mask else { continue };
            let mut m = vec![0u32; t + 1];
            for d in 0..split.docs.len() {
                let r = split.docs.range(d);
                let n = r.len().min(t);
                mask.copy_to(r.start, &mut m[..n]);
                if !m[1..n].contains(&1) {
                    let side = if d % 2 == 0 { "chosen" } else { "rejected" };
                    return user(format!(
                        "{}: {which} preference pair {} has no {side} completion token within train.seq_len = {t} tokens (its sequence holds {}): raise --seq-len or shorten the prompt",
                        s.name, d / 2 + 1, r.len()
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The model pairs are measured with: this rank's part of a training run (its chunks, and with a
/// pipeline its group and stage: chunk `c` is virtual stage `c·P + me`), or a whole model of its
/// own (`kiln eval`).
pub(crate) enum Stages<'c> {
    Ranks { chunks: &'c mut [Chunk], pp: Option<(&'c dyn parallel::Comm, usize)> },
    Whole(&'c mut model::Gpt),
}

impl Stages<'_> {
    /// One batch's forward in eval mode through every stage, activations passed on; the last
    /// stage's measured pairs where this rank holds it.
    fn forward(&mut self, b: &RowBuf, (batch, t): (usize, usize)) -> Option<PairRows> {
        let (chunks, pp) = match self {
            Stages::Whole(m) => {
                m.pairs.as_mut().expect("a preference objective's model").reference = b.reference.clone();
                m.forward(&b.x, &b.y, batch, t, Pass::Eval);
                return m.pairs.clone();
            }
            Stages::Ranks { chunks, pp } => (chunks, *pp),
        };
        let Some((pp, me)) = pp else {
            let ch = &mut chunks[0];
            ch.model.pairs.as_mut().expect("a preference objective's model").reference = b.reference.clone();
            ch.model.forward_with(&mut ch.dp, &b.x, &b.y, None, (batch, t), Pass::Eval);
            return ch.model.pairs.clone();
        };
        let (p, v) = (pp.size(), chunks.len());
        let mut out = None;
        for vs in (0..p * v).filter(|vs| vs % p == me) {
            let ch = &mut chunks[vs / p];
            if vs > 0 {
                pp.recv(ch.model.stage_input_mut(batch, t), (vs - 1) % p, (2 << 20) + vs as u32);
            }
            ch.model.pairs.as_mut().expect("a preference objective's model").reference = b.reference.clone();
            ch.model.forward_with(&mut ch.dp, &b.x, &b.y, None, (batch, t), Pass::Eval);
            if vs + 1 < p * v {
                pp.send(ch.model.stage_output(), (vs + 1) % p, (2 << 20) + vs as u32 + 1);
            } else {
                out = ch.model.pairs.clone();
            }
        }
        out
    }

    /// `x` as the pipeline's last stage has it (the identity without a pipeline).
    fn as_last_stage_has(&self, x: Vec<f64>) -> Vec<f64> {
        match self {
            Stages::Ranks { pp: Some((pp, _)), .. } => {
                let n = x.len();
                let all = parallel::comm::all_gather_f64(*pp, &x);
                all[(pp.size() - 1) * n..].to_vec()
            }
            _ => x,
        }
    }
}

/// `kiln eval` of a preference run: its held-out pairs' sums under `m` (a whole model), against
/// the reference log-probabilities the run measured at its start.
pub(crate) fn eval_run_pairs(m: &mut model::Gpt, cfg: &RunConfig, ds: &TrainData, run_dir: &Path) -> Result<PairStats> {
    let pc = cfg.pair_cfg().expect("a preference run");
    let refs = references(cfg, &ds.sources, &mut Stages::Whole(m), (run_dir, false, true), 2)?;
    m.pairs = Some(PairRows::new(pc));
    let (t, batch) = (cfg.seq_len(), cfg.micro_batch() / cfg.parallel.dp.max(1));
    Ok(eval_pairs(&mut Stages::Whole(m), &ds.sources, &refs, t, (batch.max(2), 0), (0, 1)))
}

/// Each document's log-probability under the model as it is (eval mode), `batch` documents at a
/// time, each a row of its own cut at `t` tokens; and over the pairs, how many the model prefers
/// the chosen side of.
fn measure(st: &mut Stages, split: &Split, t: usize, batch: usize) -> (Vec<f64>, f64) {
    let n = split.docs.len();
    let (mut out, mut prefers) = (vec![0.0; n], 0.0);
    for first in (0..n).step_by(batch) {
        let rows: Vec<Row> = (first..(first + batch).min(n)).map(|d| pair_row(split, 0, d, t)).collect();
        let mut b = RowBuf::new(batch, t, false);
        fill_rows(&[split], &rows, t, false, &mut b);
        b.reference = vec![0.0; batch];
        if let Some(p) = st.forward(&b, (batch, t)) {
            out[first..first + rows.len()].copy_from_slice(&p.logps[..rows.len()]);
            prefers += p.stats().prefers;
        }
    }
    out.push(prefers);
    let mut all = st.as_last_stage_has(out);
    let prefers = all.pop().expect("pushed");
    (all, prefers)
}

/// The run's reference log-probabilities: read from the run directory when it has them (a
/// resumed run), else measured on `ch` now and (by the lead rank) written there. SimPO has no
/// reference: zeros.
pub(super) fn references(cfg: &RunConfig, sources: &[Source], st: &mut Stages, (run_dir, lead, resumed): (&Path, bool, bool), batch: usize) -> Result<References> {
    let path = run_dir.join(REFERENCE_FILE);
    let zeros = |f: &dyn Fn(&Source) -> usize| sources.iter().map(|s| vec![0.0; f(s)]).collect::<Vec<_>>();
    let pc = cfg.pair_cfg().expect("a preference objective");
    if !pc.loss.uses_reference() {
        return Ok(References { train: zeros(&|s| s.train.docs.len()), val: zeros(&|s| s.val.docs.len()), val_accuracy: None });
    }
    if path.exists() {
        let text = std::fs::read_to_string(&path).map_err(|e| KilnError::User(format!("{}: cannot read: {e}", path.display())))?;
        let r: References = serde_json::from_str(&text).map_err(|e| KilnError::User(format!("{}: not the reference log-probabilities kiln writes: {e}", path.display())))?;
        let fits = r.train.len() == sources.len() && sources.iter().enumerate().all(|(i, s)| r.train[i].len() == s.train.docs.len() && r.val[i].len() == s.val.docs.len());
        if !fits {
            return user(format!("{}: its pairs are not this run's data's (was the data changed?)", path.display()));
        }
        return Ok(r);
    }
    if resumed {
        return user(format!("{}: missing; a resumed preference run needs the reference log-probabilities its first start measured", path.display()));
    }
    let t = cfg.seq_len();
    let val: Vec<(Vec<f64>, f64)> = sources.iter().map(|s| measure(st, &s.val, t, batch)).collect();
    let pairs = sources.iter().map(|s| s.val.docs.len() / 2).sum::<usize>();
    let r = References {
        train: sources.iter().map(|s| measure(st, &s.train, t, batch).0).collect(),
        val_accuracy: (pairs > 0).then(|| val.iter().map(|v| v.1).sum::<f64>() / pairs as f64),
        val: val.into_iter().map(|v| v.0).collect(),
    };
    if lead {
        crate::util::write_atomic(&path, serde_json::to_string(&r).expect("numbers serialize").as_bytes())?;
    }
    Ok(r)
}

/// Writes `rows`' reference log-probabilities (their documents' in `refs`) into `buf`.
pub(super) fn fill_reference(sources: &[Source], refs: &[Vec<f64>], rows: &[Row], val: bool, buf: &mut RowBuf) {
    buf.reference = rows.iter().map(|row| match row {
        Row::Packed(p) if p.len() == 1 => {
            let split = if val { &sources[p[0].src].val } else { &sources[p[0].src].train };
            refs[p[0].src][split.docs.doc_of(p[0].start)]
        }
        _ => unreachable!("a preference row is one document"),
    }).collect();
}

/// This rank's share of the held-out pairs' sums: `batch` rows (pairs of them) at a time, batch
/// `k` on rank `k mod ranks`, every rank running the same number of forwards, at most
/// `max_batches` batches (0 = all).
/// Summed over the data-parallel ranks by the caller; with a pipeline, every stage returns the
/// last stage's sums.
pub(super) fn eval_pairs(st: &mut Stages, sources: &[Source], refs: &References, t: usize, (batch, max_batches): (usize, usize), (rank, ranks): (usize, usize)) -> PairStats {
    let mut sum = PairStats::default();
    let splits: Vec<&Split> = sources.iter().map(|s| &s.val).collect();
    for (src, s) in sources.iter().enumerate() {
        let n = s.val.docs.len();
        let mut batches: Vec<Vec<Row>> = (0..n).step_by(batch).map(|first| (first..(first + batch).min(n)).map(|d| pair_row(&s.val, src, d, t)).collect()).collect();
        if max_batches > 0 {
            batches.truncate(max_batches);
        }
        for k in 0..batches.len().div_ceil(ranks) {
            let rows = batches.get(k * ranks + rank).map_or(&[][..], |b| &b[..]);
            let mut b = RowBuf::new(batch, t, false);
            fill_rows(&splits, rows, t, false, &mut b);
            fill_reference(sources, &refs.val, rows, true, &mut b);
            b.reference.resize(batch, 0.0);
            if let Some(p) = st.forward(&b, (batch, t)) {
                sum.add(&p.stats());
            }
        }
    }
    PairStats::from_array(st.as_last_stage_has(sum.to_array().to_vec()).try_into().expect("one sum per field"))
}
