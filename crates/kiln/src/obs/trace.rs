//! `kiln train --profile N`: the spans of N training steps written as a Chrome trace-event
//! file (`trace.json`, the JSON format chrome://tracing and Perfetto open): one complete event
//! (`"ph": "X"`) per span, with the rank as `pid` and the recording thread as `tid`, and
//! metadata events naming them. With in-process ranks every rank's thread and communication
//! thread appear under that rank; the kernel threads they share under a process of their own. Spans: each step and its data loading, forward, backward
//! (per micro-batch), optimizer, evaluation and checkpoint; each block's forward and backward
//! (with its layer); every kernel.

use serde_json::{json, Value};
use std::path::Path;
use tensor::profile::Span;

/// Which trace process a thread belongs to: rank `r` for `rank{r}` and `comm{r}` (its
/// communication thread), the shared kernel thread pool (`pool`, for in-process ranks, whose
/// kernels share rayon's threads) for `rayon*` threads, and `rank` otherwise (the process's
/// own thread: the single rank, or this MPI process's rank).
fn process_of(name: &str, rank: usize, pool: usize) -> usize {
    for p in ["rank", "comm"] {
        if let Some(r) = name.strip_prefix(p).and_then(|r| r.parse::<usize>().ok()) {
            return r;
        }
    }
    if name.starts_with("rayon") {
        pool
    } else {
        rank
    }
}

/// The trace-event document for `spans` recorded in a process whose own rank is `rank`, with
/// the recording threads' names `names` (`tensor::profile::thread_names`).
pub fn trace_json(spans: &[Span], names: &[(u64, String)], rank: usize) -> Value {
    let mut events: Vec<Value> = Vec::with_capacity(spans.len() + 8);
    let mut tids: Vec<u64> = spans.iter().map(|s| s.tid).collect();
    tids.sort_unstable();
    tids.dedup();
    let name_of = |t: u64| names.iter().find(|(i, _)| *i == t).map(|(_, n)| n.clone()).filter(|n| !n.is_empty()).unwrap_or_else(|| format!("thread {t}"));
    let ranks = tids.iter().map(|&t| process_of(&name_of(t), rank, usize::MAX)).filter(|&p| p != usize::MAX).max().unwrap_or(rank);
    let pool = ranks + 1;
    let pid = |t: u64| process_of(&name_of(t), rank, pool);
    let mut pids: Vec<usize> = tids.iter().map(|&t| pid(t)).collect();
    pids.sort_unstable();
    pids.dedup();
    for p in &pids {
        let label = if *p == pool { "kernel thread pool".to_string() } else { format!("rank {p}") };
        events.push(json!({"name": "process_name", "ph": "M", "pid": p, "args": {"name": label}}));
    }
    for &t in &tids {
        events.push(json!({"name": "thread_name", "ph": "M", "pid": pid(t), "tid": t, "args": {"name": name_of(t)}}));
    }
    for s in spans {
        let mut e = json!({"name": s.name, "cat": "kiln", "ph": "X", "ts": s.start_us, "dur": s.dur_us, "pid": pid(s.tid), "tid": s.tid});
        if let Some(l) = s.layer {
            e["args"] = json!({"layer": l});
        }
        events.push(e);
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

/// Writes `trace.json` into `run_dir`.
pub fn write_trace(run_dir: &Path, spans: &[Span], rank: usize) -> Result<(), String> {
    let path = run_dir.join("trace.json");
    let text = serde_json::to_string(&trace_json(spans, &tensor::profile::thread_names(), rank)).expect("trace serializes");
    crate::util::write_atomic(&path, text.as_bytes()).map_err(|e| e.to_string())
}
