//! Elastic data parallelism and straggler detection.
//!
//! **Resizing.** A rank lost for good takes its whole data-parallel replica with it (a tensor-,
//! pipeline-, expert- or context-parallel group cannot run without a member), so the run goes on
//! with `⌊live ranks / (pp·tp·ep·cp)⌋` replicas, re-formed from the live ranks at the same inner
//! layout, between `faults.elastic_min` and `faults.elastic_max`. The global batch
//! (`train.batch_size` sequences per step, drawn by the same sampler) stays what it was; the
//! accumulation changes instead: [`layout_for`] picks the fewest micro-batches for which every
//! replica's share of a micro-batch is whole and at most `faults.elastic_rows` sequences (the
//! starting layout's share, so a rank's activations never outgrow what it was planned for).
//!
//! **Stragglers.** Each rank's step compute time is its step's wall time less the time it spent
//! blocked on other ranks (`parallel::Counters::wait_s`). [`Stragglers`] flags a rank whose median
//! compute over the last `faults.straggler_steps` steps exceeds the median rank's by
//! `faults.straggler_ratio`, once per episode.

use crate::config::RunConfig;
use crate::error::{user, Result};

/// `RUN/slot-up-S`: rank S's host has started (an elastic MPI world's roll call, which the
/// supervisor takes after each launch).
pub const SLOT_BEAT: &str = "slot-up-";

/// A data-parallel layout: replicas and micro-batches per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub dp: usize,
    pub grad_accum: usize,
}

/// The sequences per replica per micro-batch a resize may not exceed: `faults.elastic_rows`, or
/// (0) the run's own layout's.
pub fn rows_cap(cfg: &RunConfig) -> usize {
    match cfg.faults.elastic_rows {
        0 => cfg.micro_batch() / (cfg.parallel.dp * cfg.parallel.ep).max(1),
        r => r,
    }
}

/// The fewest micro-batches with which `dp` replicas split `cfg`'s global batch: the
/// micro-batch divides evenly over the `dp × ep` ranks that split it, each taking at most
/// [`rows_cap`] sequences, and the interleaved schedule's micro-batches divide by `pp`.
pub fn accumulation(cfg: &RunConfig, dp: usize) -> Option<usize> {
    let (b, ep, pp) = (cfg.train.batch_size, cfg.parallel.ep, cfg.parallel.pp);
    let interleaved = cfg.parallel.schedule == parallel::pp::Kind::Interleaved;
    let cap = rows_cap(cfg);
    (1..=b).find(|&a| {
        let mb = b / a;
        b % a == 0 && mb % (dp * ep) == 0 && mb / (dp * ep) <= cap && (!interleaved || a % pp == 0)
    })
}

/// The largest layout `live` ranks can run, within `--elastic MIN:MAX`: an error naming the
/// constraint when none is.
pub fn layout_for(cfg: &RunConfig, live: usize) -> Result<Layout> {
    let f = &cfg.faults;
    let per = cfg.parallel.per_dp();
    let most = (live / per).min(f.elastic_max);
    let mut refused = None;
    for dp in (f.elastic_min.max(1)..=most).rev() {
        if let Some(grad_accum) = accumulation(cfg, dp) {
            // The rest of the config must hold at that size too (in-memory checkpoints need a
            // peer, compression data parallelism).
            match resized(cfg, Layout { dp, grad_accum }).validate() {
                Ok(()) => return Ok(Layout { dp, grad_accum }),
                Err(e) => refused = refused.or(Some(format!(" (dp {dp}: {e})"))),
            }
        }
    }
    let inner = if per > 1 { format!(" (a replica is pp × tp × ep × cp = {per} ranks)") } else { String::new() };
    user(format!(
        "elastic: {live} live rank(s) hold {} data-parallel replica(s){inner}, and no layout from {} down to the minimum {} (--elastic {}:{}) splits train.batch_size = {} evenly with at most {} sequence(s) per rank per micro-batch (faults.elastic_rows){}",
        live / per, most, f.elastic_min, f.elastic_min, f.elastic_max, cfg.train.batch_size, rows_cap(cfg), refused.unwrap_or_default()
    ))
}

/// An elastic run's ranks by original number: those in the world (by current rank) and those
/// out of it (lost for good, or spares a broken replica left). Both the in-process restarts
/// and the MPI supervisor resize through it.
#[derive(Clone, Debug, Default)]
pub struct Ranks {
    pub live: Vec<usize>,
    pub out: Vec<usize>,
}

impl Ranks {
    pub fn new(world: usize) -> Ranks {
        Ranks { live: (0..world).collect(), out: Vec::new() }
    }

    /// `gone` leave for good; the live ranks re-form at the largest layout they can run, and
    /// those beyond it wait out of the world as spares.
    pub fn lose(&mut self, cfg: &RunConfig, gone: &[usize]) -> Result<Layout> {
        self.live.retain(|s| !gone.contains(s));
        self.out.extend(gone);
        self.refit(cfg)
    }

    /// Every rank out of the world comes back (in its old place); returns them.
    pub fn rejoin(&mut self, cfg: &RunConfig) -> Result<(Vec<usize>, Layout)> {
        let back = std::mem::take(&mut self.out);
        self.live.extend(&back);
        self.live.sort_unstable();
        Ok((back, self.refit(cfg)?))
    }

    fn refit(&mut self, cfg: &RunConfig) -> Result<Layout> {
        let layout = layout_for(cfg, self.live.len())?;
        let spare = self.live.split_off(cfg.parallel.world(layout.dp));
        self.out.extend(spare);
        Ok(layout)
    }
}

/// `cfg` at `layout` (the data-parallel degree and the accumulation), its rows cap fixed.
pub fn resized(cfg: &RunConfig, layout: Layout) -> RunConfig {
    let mut c = cfg.clone();
    c.faults.elastic_rows = rows_cap(cfg);
    c.parallel.dp = layout.dp;
    c.train.grad_accum = layout.grad_accum;
    c
}

/// Straggler detection over the ranks' step compute times (rank 0 keeps it). A rank's
/// compute is the median of its last `faults.straggler_steps` steps (one noisy step on a
/// shared machine is not a straggler), compared with the median of those medians.
pub struct Stragglers {
    ratio: f64,
    steps: usize,
    /// Per rank: its recent compute times, oldest first, and whether it has been reported
    /// (until its ratio falls back under halfway between 1 and the threshold).
    recent: Vec<(std::collections::VecDeque<f64>, bool)>,
}

/// A straggler found: its rank, its median compute over the window against the median rank's.
#[derive(Debug, PartialEq)]
pub struct Straggler {
    pub rank: usize,
    pub ratio: f64,
    pub steps: u64,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { 0.5 * (v[n / 2 - 1] + v[n / 2]) }
}

impl Stragglers {
    pub fn new(cfg: &RunConfig, world: usize) -> Stragglers {
        Stragglers { ratio: cfg.faults.straggler_ratio, steps: cfg.faults.straggler_steps.max(1) as usize, recent: vec![(Default::default(), false); world] }
    }

    /// One step's compute seconds per rank; the ranks that have just become stragglers.
    pub fn observe(&mut self, compute_s: &[f64]) -> Vec<Straggler> {
        if self.ratio <= 0.0 || compute_s.len() < 2 {
            return Vec::new();
        }
        for (q, &c) in self.recent.iter_mut().zip(compute_s) {
            q.0.push_back(c);
            if q.0.len() > self.steps {
                q.0.pop_front();
            }
        }
        if self.recent[0].0.len() < self.steps {
            return Vec::new();
        }
        let mine: Vec<f64> = self.recent.iter().map(|q| median(&mut q.0.iter().copied().collect::<Vec<_>>())).collect();
        let typical = median(&mut mine.clone()).max(1e-12);
        let mut found = Vec::new();
        for (r, (m, q)) in mine.iter().zip(self.recent.iter_mut()).enumerate() {
            let ratio = m / typical;
            if ratio > self.ratio && !q.1 {
                q.1 = true;
                found.push(Straggler { rank: r, ratio, steps: self.steps as u64 });
            } else if ratio <= 1.0 + 0.5 * (self.ratio - 1.0) {
                // Recovered (with hysteresis: a rank hovering at the threshold is one episode).
                q.1 = false;
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_slow_for_the_set_steps_is_named_once_per_episode() {
        let mut cfg = RunConfig::default();
        (cfg.faults.straggler_ratio, cfg.faults.straggler_steps) = (1.3, 3);
        let mut s = Stragglers::new(&cfg, 4);
        let slow = [1.0, 1.05, 1.5, 0.95];
        assert!(s.observe(&slow).is_empty());
        // One noisy step of another rank inside the window does not hide the slow one.
        assert!(s.observe(&[1.0, 1.05, 1.2, 0.95]).is_empty());
        let f = s.observe(&slow);
        assert_eq!(f.len(), 1);
        assert_eq!((f[0].rank, f[0].steps), (2, 3));
        assert!((f[0].ratio - 1.5 / 1.025).abs() < 1e-9, "{f:?}");
        assert!(s.observe(&slow).is_empty(), "reported once per episode");
        // A single slow step of rank 1 is not a straggler.
        assert!(s.observe(&[1.0, 3.0, 1.5, 1.0]).is_empty());
        // Rank 2 recovers, then slows again: a new episode, once most of the window is slow.
        for _ in 0..3 {
            assert!(s.observe(&[1.0; 4]).is_empty());
        }
        assert!(s.observe(&slow).is_empty());
        assert_eq!(s.observe(&slow).len(), 1);
    }

    #[test]
    fn a_shrunk_layout_keeps_the_global_batch_with_more_micro_batches() {
        let mut cfg = RunConfig::default();
        (cfg.train.batch_size, cfg.train.grad_accum, cfg.parallel.dp) = (12, 1, 4);
        (cfg.faults.elastic_min, cfg.faults.elastic_max) = (2, 4);
        // 3 rows per rank at dp 4; dp 3 needs 12 = 3 · rows · A with rows ≤ 3: A = 2, 2 rows.
        assert_eq!(layout_for(&cfg, 3).unwrap(), Layout { dp: 3, grad_accum: 2 });
        let shrunk = resized(&cfg, Layout { dp: 3, grad_accum: 2 });
        assert_eq!(shrunk.faults.elastic_rows, 3);
        // Back at four ranks the starting layout returns (its cap was kept).
        assert_eq!(layout_for(&shrunk, 4).unwrap(), Layout { dp: 4, grad_accum: 1 });
        // Beyond MAX the extra ranks wait; below MIN it is an error naming the constraint.
        assert_eq!(layout_for(&shrunk, 9).unwrap().dp, 4);
        let e = layout_for(&shrunk, 1).unwrap_err().to_string();
        assert!(e.contains("minimum 2") && e.contains("train.batch_size = 12"), "{e}");
        // A batch that 3 ranks cannot split falls back to 2.
        cfg.train.batch_size = 8;
        assert_eq!(layout_for(&cfg, 3).unwrap(), Layout { dp: 2, grad_accum: 2 });
        // In-memory checkpoints need a peer: one rank left is no layout, and the error says why.
        let mut mem = cfg.clone();
        (mem.checkpoint.memory_interval, mem.faults.elastic_min, mem.train.batch_size) = (2, 1, 8);
        let e = layout_for(&mem, 1).unwrap_err().to_string();
        assert!(e.contains("checkpoint.memory_interval"), "{e}");
        // A replica of tp 2 needs two live ranks.
        (cfg.parallel.tp, cfg.train.batch_size) = (2, 12);
        assert_eq!(layout_for(&cfg, 7).unwrap().dp, 3);
    }
}
