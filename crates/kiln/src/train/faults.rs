//! Faults during training: injected ones (a rank failing at a step, for the reliability tests)
//! and numerical ones — a skipped update (non-finite loss or gradient, a loss spike, an fp16
//! overflow), and after `faults.max_consecutive_skips` of them in a row a rollback to the newest
//! valid checkpoint that skips the offending batches.

use crate::config::FaultSection;
use crate::error::{KilnError, Result};
use crate::util::{fire_once, write_atomic};
use crate::step::StepOut;
use std::collections::{BTreeSet, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};

/// The numerical-fault state of a run: the batches a rollback marked, the recent applied losses
/// (for spikes) and the run of consecutive skipped updates.
pub(super) struct Faults {
    cfg: FaultSection,
    run_dir: PathBuf,
    /// Steps whose batches a rollback marked (`RUN/skipped_steps.json`): drawn, not trained on.
    pub marked: BTreeSet<u64>,
    recent: VecDeque<f64>,
    skipped_run: Vec<u64>,
}

/// What happened to a step's update, for the caller to log.
pub(super) enum Verdict {
    Applied,
    /// fp16 loss scaling backed off (not a fault of the run).
    LossScaleBackoff,
    /// The update was skipped (logged and said).
    Skipped,
}

impl Faults {
    pub fn new(cfg: &FaultSection, run_dir: &Path) -> Faults {
        let marked = fs::read(run_dir.join("skipped_steps.json")).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        Faults { cfg: cfg.clone(), run_dir: run_dir.to_path_buf(), marked, recent: VecDeque::new(), skipped_run: Vec::new() }
    }

    /// `faults.fail_ranks`: rank `rank` fails at the start of step `next`, once per run (a
    /// marker file remembers it).
    pub fn injected_failure(&self, rank: usize, next: u64) -> Result<()> {
        if self.cfg.fail_step == next && self.cfg.fail_ranks.contains(&rank) {
            let marker = self.run_dir.join(format!("faults-fired-rank{rank}-step{next}"));
            if fire_once(&marker) {
                return Err(KilnError::RankFailed { rank, step: next });
            }
        }
        Ok(())
    }

    /// `faults.fail_ranks` fail together at `faults.fail_step`: when one of them has failed at
    /// `step`, all of them count as failed, even those the first failure stopped before they
    /// reached that step's start (their markers are set, so none fails again after the
    /// restore). The ranks, by original number.
    pub fn failed_together(cfg: &FaultSection, run_dir: &Path, step: u64) -> Vec<usize> {
        if cfg.fail_step != step {
            return Vec::new();
        }
        for r in &cfg.fail_ranks {
            fire_once(&run_dir.join(format!("faults-fired-rank{r}-step{step}")));
        }
        cfg.fail_ranks.clone()
    }

    /// The loss-spike veto: a loss more than `faults.spike_zscore` standard deviations above
    /// the recent applied losses' mean.
    pub fn spike(&self, loss: f32) -> Option<&'static str> {
        let fc = &self.cfg;
        if fc.spike_zscore <= 0.0 || self.recent.len() < fc.spike_window.max(2) {
            return None;
        }
        let n = self.recent.len() as f64;
        let mean = self.recent.iter().sum::<f64>() / n;
        let sd = (self.recent.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0)).sqrt();
        ((loss as f64 - mean) > fc.spike_zscore * sd.max(1e-12)).then_some("loss spike")
    }

    /// Records step `step`'s outcome. Errors stop the run: a non-finite loss without
    /// `faults.skip_nonfinite`, or too many consecutive skips (a rollback; the lead rank `lead`
    /// writes the batches to skip). Events go to `log` (metrics lines) and `say` (the console).
    pub fn record(&mut self, step: u64, out: &StepOut, lead: bool, log: &mut dyn FnMut(serde_json::Value) -> Result<()>, say: &dyn Fn(&str)) -> Result<Verdict> {
        let (loss, grad_norm) = (out.loss, out.grad_norm);
        let Some(why) = out.skipped else {
            self.skipped_run.clear();
            self.recent.push_back(loss as f64);
            if self.recent.len() > self.cfg.spike_window.max(2) {
                self.recent.pop_front();
            }
            return Ok(Verdict::Applied);
        };
        if why == crate::step::FP16_OVERFLOW {
            return Ok(Verdict::LossScaleBackoff);
        }
        if why.starts_with("non-finite") && !self.cfg.skip_nonfinite {
            return Err(KilnError::Internal(format!("loss is {loss}, gradient norm {grad_norm} at step {step}: stopping (the last checkpoint is intact)")));
        }
        let f = |x: f64| if x.is_finite() { serde_json::json!(x) } else { serde_json::json!(x.to_string()) };
        log(serde_json::json!({"kind": "fault", "step": step, "event": "update_skipped", "reason": why, "loss": f(loss as f64), "grad_norm": f(grad_norm)}))?;
        say(&format!("step {step}: update skipped ({why})"));
        if !self.marked.contains(&step) {
            self.skipped_run.push(step);
            if self.cfg.max_consecutive_skips > 0 && self.skipped_run.len() >= self.cfg.max_consecutive_skips {
                if lead {
                    let mut all = self.marked.clone();
                    all.extend(self.skipped_run.iter().copied());
                    write_atomic(&self.run_dir.join("skipped_steps.json"), serde_json::to_string(&all).unwrap().as_bytes())?;
                    log(serde_json::json!({"kind": "fault", "step": step, "event": "rollback", "skip_steps": self.skipped_run}))?;
                }
                return Err(KilnError::Rollback(format!("{} consecutive updates skipped (steps {:?})", self.skipped_run.len(), self.skipped_run), self.run_dir.clone()));
            }
        }
        Ok(Verdict::Skipped)
    }
}
