//! `kiln train --profile N`: the spans of N training steps written as a Chrome trace-event
//! file (`trace.json`, the JSON format chrome://tracing and Perfetto open): one complete event
//! (`"ph": "X"`) per span, with the rank as `pid` and the recording thread as `tid`, and
//! metadata events naming them. Spans: each step and its data loading, forward, backward
//! (per micro-batch), optimizer, evaluation and checkpoint; each block's forward and backward
//! (with its layer); every kernel.

use serde_json::{json, Value};
use std::path::Path;
use tensor::profile::Span;

/// The trace-event document for `spans` recorded on `rank`.
pub fn trace_json(spans: &[Span], rank: usize) -> Value {
    let mut events: Vec<Value> = Vec::with_capacity(spans.len() + 4);
    events.push(json!({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": format!("rank {rank}")}}));
    let mut tids: Vec<u64> = spans.iter().map(|s| s.tid).collect();
    tids.sort_unstable();
    tids.dedup();
    for t in &tids {
        events.push(json!({"name": "thread_name", "ph": "M", "pid": rank, "tid": t, "args": {"name": format!("thread {t}")}}));
    }
    for s in spans {
        let mut e = json!({"name": s.name, "cat": "kiln", "ph": "X", "ts": s.start_us, "dur": s.dur_us, "pid": rank, "tid": s.tid});
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
    let text = serde_json::to_string(&trace_json(spans, rank)).expect("trace serializes");
    crate::run::write_atomic(&path, text.as_bytes()).map_err(|e| e.to_string())
}
