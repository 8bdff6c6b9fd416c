//! Pipeline schedules (GPipe: Huang et al. 2019; 1F1B / PipeDream-Flush: Narayanan et al.
//! 2019/2021; interleaved 1F1B: Narayanan et al. SC21), as data: the order in which each stage
//! runs the forward and backward passes of each micro-batch, and a simulator that turns the
//! order into a timeline with the dependencies of a pipeline (a forward needs the previous
//! stage's forward of the same micro-batch, a backward the next stage's backward).
//!
//! With `v` virtual stages per rank (interleaved), rank `s` holds model chunks `s, s + p, …,
//! s + (v−1)·p` of the `p·v` chunk pipeline.

use std::fmt::Write;

/// Which schedule: defined once, in the planner (`plan::schedule::Kind`, whose bubble and memory formulas
/// take it too), with its parsing from `parallel.schedule` / `--schedule` and its name.
pub use plan::schedule::Kind;

/// One unit of work on a stage: forward or backward of micro-batch `mb` through the rank's
/// model chunk `chunk` (0 unless interleaved).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Task {
    pub forward: bool,
    pub mb: usize,
    pub chunk: usize,
}

#[derive(Clone, Debug)]
pub struct Schedule {
    pub kind: Kind,
    /// Pipeline ranks.
    pub p: usize,
    /// Micro-batches per step.
    pub m: usize,
    /// Model chunks per rank (1 unless interleaved).
    pub v: usize,
}

impl Schedule {
    pub fn new(kind: Kind, p: usize, m: usize, v: usize) -> Result<Schedule, String> {
        if p == 0 || m == 0 || v == 0 {
            return Err(format!("pipeline degree, micro-batches and virtual stages must be positive (got {p}, {m}, {v})"));
        }
        match kind {
            Kind::Interleaved if !m.is_multiple_of(p) => Err(format!("the interleaved schedule needs micro-batches ({m}) divisible by the pipeline degree ({p})")),
            Kind::Gpipe | Kind::OneFOneB if v != 1 => Err(format!("--virtual {v} needs the interleaved schedule")),
            _ => Ok(Schedule { kind, p, m, v }),
        }
    }

    /// The tasks of rank `s`, in the order it runs them.
    pub fn tasks(&self, s: usize) -> Vec<Task> {
        let (p, m, v) = (self.p, self.m, self.v);
        let f = |mb, chunk| Task { forward: true, mb, chunk };
        let b = |mb, chunk| Task { forward: false, mb, chunk };
        match self.kind {
            Kind::Gpipe => (0..m).map(|i| f(i, 0)).chain((0..m).map(|i| b(i, 0))).collect(),
            Kind::OneFOneB => {
                let warm = (p - s - 1).min(m);
                let mut out: Vec<Task> = (0..warm).map(|i| f(i, 0)).collect();
                for i in 0..m - warm {
                    out.push(f(warm + i, 0));
                    out.push(b(i, 0));
                }
                out.extend((m - warm..m).map(|i| b(i, 0)));
                out
            }
            Kind::Interleaved => {
                // Megatron-LM's order: micro-batches in groups of p, cycling through the chunks
                // (forward: chunk 0 first; backward: the last chunk first).
                let total = m * v;
                let fwd = |k: usize| f((k / (p * v)) * p + k % p, (k / p) % v);
                let bwd = |k: usize| b((k / (p * v)) * p + k % p, v - 1 - (k / p) % v);
                let warm = ((p - s - 1) * 2 + (v - 1) * p).min(total);
                let mut out: Vec<Task> = (0..warm).map(fwd).collect();
                for i in 0..total - warm {
                    out.push(fwd(warm + i));
                    out.push(bwd(i));
                }
                out.extend((total - warm..total).map(bwd));
                out
            }
        }
    }

    /// Peak number of micro-batches whose activations rank `s` holds at once (forwards done,
    /// backwards not yet), counted per chunk.
    pub fn peak_in_flight(&self, s: usize) -> usize {
        let mut live: i64 = 0;
        let mut peak = 0;
        for t in self.tasks(s) {
            live += if t.forward { 1 } else { -1 };
            peak = peak.max(live);
        }
        peak as usize
    }

    /// Runs the schedule with every chunk's forward taking `tf` and backward `tb` (time units)
    /// and no communication cost: each task starts once its rank is free and its dependency is
    /// done. Returns, per rank, the tasks with their start and end times.
    pub fn simulate(&self, tf: f64, tb: f64) -> Vec<Vec<(Task, f64, f64)>> {
        let (p, m, v) = (self.p, self.m, self.v);
        let lists: Vec<Vec<Task>> = (0..p).map(|s| self.tasks(s)).collect();
        // Finish times by (virtual stage = chunk·p + rank, micro-batch), forward and backward.
        let vs = p * v;
        let mut done_f = vec![f64::NAN; vs * m];
        let mut done_b = vec![f64::NAN; vs * m];
        let mut next = vec![0usize; p];
        let mut free = vec![0f64; p];
        let mut out: Vec<Vec<(Task, f64, f64)>> = vec![Vec::new(); p];
        let total: usize = lists.iter().map(|l| l.len()).sum();
        let mut placed = 0;
        while placed < total {
            let mut progressed = false;
            for s in 0..p {
                while let Some(&t) = lists[s].get(next[s]) {
                    let stage = t.chunk * p + s;
                    let dep = if t.forward {
                        if stage == 0 { Some(0.0) } else { Some(done_f[(stage - 1) * m + t.mb]).filter(|x| !x.is_nan()) }
                    } else {
                        let own = done_f[stage * m + t.mb];
                        let later = if stage + 1 == vs { Some(own) } else { Some(done_b[(stage + 1) * m + t.mb]).filter(|x| !x.is_nan()) };
                        later.filter(|_| !own.is_nan())
                    };
                    let Some(ready) = dep else { break };
                    let start = ready.max(free[s]);
                    let end = start + if t.forward { tf } else { tb };
                    free[s] = end;
                    if t.forward { done_f[stage * m + t.mb] = end } else { done_b[stage * m + t.mb] = end }
                    out[s].push((t, start, end));
                    next[s] += 1;
                    placed += 1;
                    progressed = true;
                }
            }
            assert!(progressed, "schedule deadlocks");
        }
        out
    }

    /// Idle time over busy time on each rank between the step's start and end, from
    /// [`Schedule::simulate`] (the bubble as Narayanan et al. state it: `(p−1)/m` for GPipe and
    /// 1F1B, `(p−1)/(v·m)` interleaved).
    pub fn bubble(&self, tf: f64, tb: f64) -> Vec<f64> {
        let tl = self.simulate(tf, tb);
        let end = tl.iter().flat_map(|r| r.iter().map(|x| x.2)).fold(0.0, f64::max);
        tl.iter().map(|r| {
            let busy: f64 = r.iter().map(|x| x.2 - x.1).sum();
            (end - busy) / busy
        }).collect()
    }

    /// The formula's bubble.
    pub fn ideal_bubble(&self) -> f64 {
        (self.p - 1) as f64 / (self.v * self.m) as f64
    }

    /// A text timeline: one row per rank, one column per time unit (the shorter of `tf`, `tb`):
    /// micro-batch k's forward as the k-th letter in upper case, its backward in lower case,
    /// idle time as `.`; then each rank's idle/busy ratio and peak micro-batches in flight.
    pub fn render(&self, tf: f64, tb: f64) -> String {
        let tl = self.simulate(tf, tb);
        let unit = tf.min(tb);
        let end = tl.iter().flat_map(|r| r.iter().map(|x| x.2)).fold(0.0, f64::max);
        let cols = (end / unit).round() as usize;
        let glyph = |t: &Task| {
            let c = (b'a' + (t.mb % 26) as u8) as char;
            if t.forward { c.to_ascii_uppercase() } else { c }
        };
        let mut s = String::new();
        let _ = writeln!(s, "{:?} schedule, p = {}, m = {}, v = {}: micro-batch 0, 1, … as A, B, … forward and a, b, … backward, idle = .", self.kind, self.p, self.m, self.v);
        let bubbles = self.bubble(tf, tb);
        for (r, row) in tl.iter().enumerate() {
            let mut line = vec!['.'; cols];
            for (t, a, b) in row {
                let (a, b) = ((a / unit).round() as usize, (b / unit).round() as usize);
                for c in line.iter_mut().take(b).skip(a) {
                    *c = glyph(t);
                }
            }
            let chunks: String = if self.v > 1 { format!(" chunks {:?}", (0..self.v).map(|c| c * self.p + r).collect::<Vec<_>>()) } else { String::new() };
            let _ = writeln!(s, "rank {r:>2} |{}| idle/busy {:.3}, peak {} micro-batches in flight{chunks}", line.iter().collect::<String>(), bubbles[r], self.peak_in_flight(r));
        }
        let _ = writeln!(s, "bubble (idle/busy, every rank): {:.3}; formula (p−1)/(v·m) = {:.3}", bubbles.iter().fold(0.0f64, |a, &b| a.max(b)), self.ideal_bubble());
        s
    }
}

/// How `n_layer` blocks are split into `k` consecutive stages: `explicit` layer counts (which
/// must add up), or else balanced so that the costliest stage is as cheap as possible, each
/// block costing `layer_cost` and the last stage also `head_cost` (the output head and loss;
/// GPT-2 124M's head is worth about two blocks). Every stage gets at least one block. The
/// error names `parallel.pp_layers`.
pub fn split_layers(n_layer: usize, k: usize, explicit: &[usize], layer_cost: f64, head_cost: f64) -> Result<Vec<std::ops::Range<usize>>, String> {
    if k > n_layer {
        return Err(format!("{k} pipeline stages need at least {k} layers, the model has {n_layer} (model.n_layer)"));
    }
    let counts: Vec<usize> = if !explicit.is_empty() {
        if explicit.len() != k || explicit.contains(&0) || explicit.iter().sum::<usize>() != n_layer {
            return Err(format!(
                "parallel.pp_layers = {explicit:?} must list {k} positive layer counts (pp × virtual stages) adding up to model.n_layer = {n_layer}"
            ));
        }
        explicit.to_vec()
    } else if k == 1 {
        vec![n_layer]
    } else if n_layer > 4096 {
        // Beyond any real model's depth the O(k·L²) search below would take minutes (the config
        // is then refused by the memory check anyway): an even split, extra layers first.
        (0..k).map(|j| n_layer / k + usize::from(j < n_layer % k)).collect()
    } else {
        // Minimise the largest stage cost over contiguous splits, then the sum of squared
        // stage costs (so the remainder spreads out); O(k·L²), L is small.
        let cost = |a: usize, b: usize| (b - a) as f64 * layer_cost + if b == n_layer { head_cost } else { 0.0 };
        let inf = (f64::INFINITY, f64::INFINITY);
        // best[j][i]: the best (largest, sum of squares) splitting the first i layers into j stages.
        let mut best = vec![vec![inf; n_layer + 1]; k + 1];
        let mut from = vec![vec![0usize; n_layer + 1]; k + 1];
        best[0][0] = (0.0, 0.0);
        for j in 1..=k {
            for i in j..=n_layer {
                for a in (j - 1)..i {
                    let (m, q) = best[j - 1][a];
                    let c = cost(a, i);
                    let cand = (m.max(c), q + c * c);
                    // Ties go to the later cut: earlier stages take the extra layer.
                    if cand.0 < best[j][i].0 || (cand.0 == best[j][i].0 && cand.1 <= best[j][i].1) {
                        best[j][i] = cand;
                        from[j][i] = a;
                    }
                }
            }
        }
        let mut cuts = vec![n_layer];
        let mut i = n_layer;
        for j in (1..=k).rev() {
            i = from[j][i];
            cuts.push(i);
        }
        cuts.reverse();
        cuts.windows(2).map(|w| w[1] - w[0]).collect()
    };
    let mut start = 0;
    Ok(counts
        .iter()
        .map(|&c| {
            let r = start..start + c;
            start += c;
            r
        })
        .collect())
}

/// The config of the pipeline stage holding blocks `layers` of `whole` (embedding on the
/// first stage, final norm and head on the last).
pub fn stage_config(whole: &model::GptConfig, layers: std::ops::Range<usize>) -> model::GptConfig {
    assert!(whole.place.stage.is_none(), "stage_config of a stage");
    let stage = model::config::Stage { first_layer: layers.start, total_layers: whole.n_layer, embed: layers.start == 0, head: layers.end == whole.n_layer };
    let mut cfg = model::GptConfig { n_layer: layers.len(), ..whole.clone() };
    cfg.place.stage = Some(stage);
    cfg
}

/// A stage's parameters (laid out as `stage`) cut by name from the whole model's `whole`
/// (laid out as `full`). Tensors keep their whole-model names, so this is a lookup.
pub fn cut(full: &model::ParamLayout, whole: &[f32], stage: &model::ParamLayout) -> Vec<f32> {
    let mut out = vec![0.0; stage.total];
    for q in &stage.params {
        let p = full.get(&q.name).unwrap_or_else(|| panic!("stage parameter {} is not in the whole model", q.name));
        out[q.range()].copy_from_slice(&whole[p.range()]);
    }
    out
}

/// Writes a stage's parameters back into the whole model's buffer by name (the inverse of
/// [`cut`]; a tied embedding on the last stage writes the same values as the first stage's).
pub fn paste(full: &model::ParamLayout, whole: &mut [f32], stage: &model::ParamLayout, params: &[f32]) {
    for q in &stage.params {
        let p = full.get(&q.name).unwrap_or_else(|| panic!("stage parameter {} is not in the whole model", q.name));
        whole[p.range()].copy_from_slice(&params[q.range()]);
    }
}

/// The whole model's buffer (laid out as `gpt_layout(whole)`) on every rank of the pipeline
/// group `comm`, from each rank's chunks: `mine[c]` holds virtual stage `c·p + rank`'s
/// parameters (or any per-parameter buffer, e.g. an optimizer moment) laid out as that stage,
/// `stages` every virtual stage's layers. Collective over `comm` (an all-gather, each rank's
/// chunks zero-padded to the longest rank's). A tied embedding is taken from the first stage.
pub fn gather_whole(comm: &dyn crate::Comm, whole: &model::GptConfig, stages: &[std::ops::Range<usize>], mine: &[&[f32]]) -> Vec<f32> {
    let p = comm.size();
    let v = stages.len() / p;
    assert_eq!(mine.len(), v, "one buffer per chunk");
    let (full, _) = model::layout::gpt_layout(whole);
    let layouts: Vec<model::ParamLayout> = stages.iter().map(|r| model::layout::gpt_layout(&stage_config(whole, r.clone())).0).collect();
    let rank_len = |r: usize| (0..v).map(|c| layouts[c * p + r].total).sum::<usize>();
    let width = (0..p).map(rank_len).max().unwrap_or(0);
    let mut send = vec![0.0f32; width];
    let mut at = 0;
    for (c, buf) in mine.iter().enumerate() {
        assert_eq!(buf.len(), layouts[c * p + comm.rank()].total);
        send[at..at + buf.len()].copy_from_slice(buf);
        at += buf.len();
    }
    let mut all = vec![0.0f32; width * p];
    comm.all_gather(&send, &mut all);
    let mut out = vec![0.0f32; full.total];
    // Later stages first, so the first stage's embedding is the one that stays.
    for vs in (0..stages.len()).rev() {
        let (r, c) = (vs % p, vs / p);
        let off = r * width + (0..c).map(|k| layouts[k * p + r].total).sum::<usize>();
        paste(&full, &mut out, &layouts[vs], &all[off..off + layouts[vs].total]);
    }
    out
}
