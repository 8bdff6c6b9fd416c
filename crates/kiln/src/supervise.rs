//! `kiln train --supervise`: runs training as a child process and restarts it from the newest
//! valid checkpoint when it crashes (any exit but 0, 2 or an interrupt) or hangs (no heartbeat
//! — the `heartbeat` file the trainer rewrites every step — for `--heartbeat-timeout` seconds,
//! or for 120 s before the first one while it starts up),
//! up to `--max-restarts` times. Each event is a `"kind": "fault"` line in `metrics.jsonl`.
//! With in-process ranks the process is the failure unit: all ranks restart together.

use crate::error::{KilnError, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

/// How long a training process may take to send its first heartbeat.
const STARTUP_GRACE: Duration = Duration::from_secs(120);

pub struct Supervise {
    pub max_restarts: u32,
    pub heartbeat_timeout: Duration,
}

/// The arguments of `kiln train` without the supervisor's own flags, and the run directory
/// (`--out`, chosen here when absent so every restart uses the same one).
fn child_args(argv: &[String], preset: Option<&str>) -> (Vec<String>, PathBuf) {
    let mut out = Vec::new();
    let mut dir = None;
    let mut it = argv.iter().peekable();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--supervise" => {}
            "--max-restarts" | "--heartbeat-timeout" => {
                it.next();
            }
            s if s.starts_with("--max-restarts=") || s.starts_with("--heartbeat-timeout=") => {}
            "--out" => {
                dir = it.next().map(PathBuf::from);
            }
            s if s.starts_with("--out=") => dir = Some(PathBuf::from(&s[6..])),
            _ => out.push(a.clone()),
        }
    }
    let dir = dir.unwrap_or_else(|| crate::run::default_run_dir(preset.unwrap_or("tiny")));
    (out, dir)
}

fn heartbeat(run_dir: &Path) -> Option<(SystemTime, u64)> {
    let p = run_dir.join("heartbeat");
    let t = std::fs::metadata(&p).and_then(|m| m.modified()).ok()?;
    let step = std::fs::read_to_string(&p).ok().and_then(|s| s.trim().parse().ok())?;
    Some((t, step))
}

fn log_fault(run_dir: &Path, line: serde_json::Value) {
    match crate::obs::MetricsWriter::open(run_dir, None) {
        Ok(mut m) => {
            if let Err(e) = m.log(&line) {
                eprintln!("supervisor: cannot log to metrics.jsonl: {e}");
            }
        }
        Err(e) => eprintln!("supervisor: cannot open metrics.jsonl: {e}"),
    }
}

/// `argv` is the `train` subcommand's arguments as given (after `train`).
pub fn run(argv: &[String], preset: Option<&str>, sv: &Supervise, stop: &AtomicBool) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| KilnError::Internal(format!("cannot find the kiln executable: {e}")))?;
    let (args, run_dir) = child_args(argv, preset);
    let resumed = argv.iter().any(|a| a == "--resume");
    // The supervisor owns the run directory; its workers train under its lock.
    let _lock = crate::run::lock(&run_dir)?;
    let mut restarts = 0u32;
    loop {
        let mut cmd = Command::new(&exe);
        cmd.env(crate::run::LOCK_HELD_ENV, std::process::id().to_string());
        cmd.arg("train").args(&args).arg("--out").arg(&run_dir);
        // Resume once the run exists (a process killed before writing its config starts over).
        if (restarts > 0 || resumed) && run_dir.join("config.toml").exists() && !args.iter().any(|a| a == "--resume") {
            cmd.arg("--resume");
        }
        let started = Instant::now();
        let before = heartbeat(&run_dir).map(|h| h.0);
        let mut step = 0u64;
        let mut child: Child = cmd.spawn().map_err(|e| KilnError::Internal(format!("cannot start the training process: {e}")))?;
        eprintln!("supervisor: training process {} started{}", child.id(), if restarts > 0 { format!(" (restart {restarts} of {})", sv.max_restarts) } else { String::new() });
        // Wait for it to exit, or to stop beating.
        let outcome = loop {
            if let Some(status) = child.try_wait().map_err(|e| KilnError::Internal(format!("waiting for the training process: {e}")))? {
                break Ok(status);
            }
            let beat = heartbeat(&run_dir).filter(|h| Some(h.0) != before);
            if let Some((_, s)) = beat {
                step = step.max(s);
            }
            // Until its first heartbeat a process is starting up (loading data, measuring the
            // matmul peak): it gets at least STARTUP_GRACE.
            let (quiet_for, limit) = match beat {
                Some((t, _)) => (t.elapsed().unwrap_or_default(), sv.heartbeat_timeout),
                None => (started.elapsed(), sv.heartbeat_timeout.max(STARTUP_GRACE)),
            };
            if quiet_for > limit && !stop.load(Ordering::SeqCst) {
                let _ = child.kill();
                let _ = child.wait();
                break Err(quiet_for);
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        if let Some((_, s)) = heartbeat(&run_dir).filter(|h| Some(h.0) != before) {
            step = step.max(s);
        }
        let (event, detail) = match outcome {
            Ok(s) if s.success() => return Ok(()),
            // A user error (bad config, data, checkpoint) will not go away by restarting.
            Ok(s) if s.code() == Some(2) => return Err(KilnError::User(format!("training stopped with a user error (exit 2) in {}", run_dir.display()))),
            Ok(_) if stop.load(Ordering::SeqCst) => return Err(KilnError::Internal("interrupted".into())),
            Ok(s) => ("worker_crashed", describe(&s)),
            Err(q) => ("worker_hung", format!("no heartbeat for {:.1} s", q.as_secs_f64())),
        };
        restarts += 1;
        let give_up = restarts > sv.max_restarts;
        eprintln!("supervisor: training process {event} at step {step} ({detail}){}", if give_up { "; no restarts left" } else { "; restarting from the newest valid checkpoint" });
        log_fault(&run_dir, serde_json::json!({"kind": "fault", "step": step, "event": event, "detail": detail, "restart": restarts, "gave_up": give_up}));
        if give_up {
            return Err(KilnError::Internal(format!("training failed {} times ({event} at step {step}: {detail}); the newest valid checkpoint in {} is intact", restarts, run_dir.display())));
        }
    }
}

fn describe(s: &std::process::ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = s.signal() {
            return format!("killed by signal {sig}");
        }
    }
    format!("exit code {}", s.code().unwrap_or(-1))
}
