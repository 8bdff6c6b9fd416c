//! Progress display: an `indicatif` bar on a terminal, plain lines every `log_interval` steps
//! otherwise (CI logs), nothing with `--quiet`.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::Instant;

pub struct Progress {
    bar: Option<ProgressBar>,
    plain: bool,
    total: u64,
    start_step: u64,
    started: Instant,
}

pub struct StepInfo {
    pub step: u64,
    pub loss: f32,
    pub lr: f64,
    pub tokens_per_sec: f64,
    pub mfu: f64,
    /// The fraction of the batch's tokens that carried loss, shown when below 1 (SFT masks,
    /// packed documents).
    pub loss_fraction: f64,
}

pub fn fmt_duration(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    if s >= 3600 { format!("{}h{:02}m", s / 3600, (s % 3600) / 60) } else if s >= 60 { format!("{}m{:02}s", s / 60, s % 60) } else { format!("{s}s") }
}

impl Progress {
    pub fn new(start_step: u64, total: u64, quiet: bool) -> Progress {
        let tty = std::io::stderr().is_terminal();
        let bar = (!quiet && tty).then(|| {
            let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            b.set_style(
                ProgressStyle::with_template("{bar:30.cyan/blue} step {pos}/{len} {msg} ETA {eta}")
                    .unwrap()
                    .progress_chars("=> "),
            );
            b.set_position(start_step);
            b
        });
        Progress { bar, plain: !quiet && !tty, total, start_step, started: Instant::now() }
    }

    pub fn step(&self, info: &StepInfo, log_now: bool) {
        let mut msg = format!("| loss {:.4} | lr {:.2e} | {:.0} tok/s | MFU {:.1}%", info.loss, info.lr, info.tokens_per_sec, 100.0 * info.mfu);
        if info.loss_fraction < 1.0 {
            msg += &format!(" | loss on {:.1}% of tokens", 100.0 * info.loss_fraction);
        }
        if let Some(b) = &self.bar {
            b.set_position(info.step);
            b.set_message(msg);
        } else if self.plain && log_now {
            let done = (info.step - self.start_step) as f64;
            let per = self.started.elapsed().as_secs_f64() / done.max(1.0);
            let eta = per * (self.total - info.step) as f64;
            eprintln!("step {}/{} {msg} | ETA {}", info.step, self.total, fmt_duration(eta));
        }
    }

    /// Prints a line without breaking the bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(b) => b.println(line),
            None if self.plain => eprintln!("{line}"),
            None => {}
        }
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
