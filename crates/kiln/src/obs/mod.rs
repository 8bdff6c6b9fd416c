//! Observability: TensorBoard event files beside `metrics.jsonl`, training-curve plots,
//! `kiln doctor` and `kiln runs`. Nothing here changes a run; it only records and reports.
//!
//! - [`MetricsWriter`]: the one writer of `metrics.jsonl`, also writing each line's numbers
//!   to a TensorBoard event file (`tfevents`, format implemented here, no TensorFlow).
//! - [`plot_runs`] / [`write_loss_png`]: PNG curves (plotters, embedded font).
//! - [`doctor`]: machine, build and corpus report.
//! - [`list_runs`]: a table of run directories and the config keys that differ.
//! - [`trace`]: the Chrome trace-event file of `kiln train --profile N`.
//! - [`cmd`]: clap argument types and printing entry points for the CLI.

pub mod cmd;
pub mod doctor;
pub mod plot;
pub mod runs;
pub mod tfevents;
pub mod trace;

pub use doctor::{doctor, doctor_with};
pub use plot::{plot_runs, write_loss_png};
pub use runs::list_runs;
pub use tfevents::MetricsWriter;

/// Appends one line to `run_dir/metrics.jsonl` (and its event file) from outside a run's own
/// writer: the supervisor's and the in-process restarts' fault lines.
pub fn append_line(run_dir: &std::path::Path, line: &serde_json::Value) -> Result<(), String> {
    MetricsWriter::open(run_dir, None)?.log(line)
}
