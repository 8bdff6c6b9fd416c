//! `kiln train --supervise`: runs training as a child process and restarts it from the newest
//! valid checkpoint when it crashes (any exit but 0, 2 or an interrupt) or hangs (no heartbeat
//! — the `heartbeat` file the trainer rewrites every step — for `--heartbeat-timeout` seconds,
//! or for 120 s before the first one while it starts up),
//! up to `--max-restarts` times. Each event is a `"kind": "fault"` line in `metrics.jsonl`.
//! With in-process ranks the process is the failure unit: all ranks restart together.
//!
//! Under MPI (`parallel.backend = mpi`) the supervisor launches the world itself
//! (`--launcher … -n N kiln train`). Elastic (`--elastic MIN:MAX`): after a failure it relaunches
//! the same world and waits `faults.rejoin_timeout_s` for every rank's host to report
//! (`RUN/slot-up-S`); the ranks that do not are lost for good, and the world is relaunched
//! without them at the largest layout the others can run (`train::elastic`), resumed from the
//! newest valid checkpoint. A worker that exits with [`EXIT_REGROW`] stopped at a checkpoint for
//! lost ranks to rejoin: the full world is relaunched.

use crate::error::{KilnError, Result};
use std::path::Path;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

/// How long a training process may take to send its first heartbeat.
const STARTUP_GRACE: Duration = Duration::from_secs(120);

pub struct Supervise {
    pub max_restarts: u32,
    pub heartbeat_timeout: Duration,
    /// The MPI launcher and its options (`mpirun`).
    pub launcher: Vec<String>,
}

/// An elastic MPI worker's exit code when it stopped at a checkpoint for lost ranks to rejoin
/// (BSD's `EX_TEMPFAIL`).
pub const EXIT_REGROW: i32 = 75;

use crate::train::elastic::{Layout, Ranks, SLOT_BEAT};

/// The arguments of `kiln train` without the supervisor's own flags and `--out` (the workers
/// get the resolved run directory).
fn child_args(argv: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = argv.iter().peekable();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--supervise" => {}
            "--max-restarts" | "--heartbeat-timeout" | "--launcher" | "--out" => {
                it.next();
            }
            s if ["--max-restarts=", "--heartbeat-timeout=", "--launcher=", "--out="].iter().any(|p| s.starts_with(p)) => {}
            _ => out.push(a.clone()),
        }
    }
    out
}

/// `args` less the flags `drop` (with their values, as `--flag V` or `--flag=V`).
fn without(args: &[String], drop: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if drop.contains(&a.as_str()) {
            it.next();
        } else if !drop.iter().any(|d| a.starts_with(&format!("{d}="))) {
            out.push(a.clone());
        }
    }
    out
}

fn heartbeat(run_dir: &Path) -> Option<(SystemTime, u64)> {
    let p = run_dir.join("heartbeat");
    let t = std::fs::metadata(&p).and_then(|m| m.modified()).ok()?;
    let step = std::fs::read_to_string(&p).ok().and_then(|s| s.trim().parse().ok())?;
    Some((t, step))
}

fn log_fault(run_dir: &Path, line: serde_json::Value) {
    if let Err(e) = crate::obs::append_line(run_dir, &line) {
        eprintln!("supervisor: cannot log to metrics.jsonl: {e}");
    }
}

/// The run's config at the world's current layout: the one its worker saved (resolved once, at
/// its start, with the layout this supervisor gave it), or (a world that never got as far as
/// saving it) the command's at `layout`. The command line is not read again.
fn current(run_dir: &Path, cfg0: &crate::config::RunConfig, layout: Layout) -> Result<crate::config::RunConfig> {
    let saved = run_dir.join("config.toml");
    if saved.exists() {
        crate::config::RunConfig::load(&saved)
    } else {
        Ok(crate::train::elastic::resized(cfg0, layout))
    }
}

/// Kills the process group `pgid` (a launcher and every rank it started).
fn kill_group(child: &mut Child) {
    unsafe {
        libc::kill(-(child.id() as i32), libc::SIGKILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// `argv` is the `train` subcommand's arguments as given (after `train`), handed on to the
/// workers; `resolved` the same resolved once (its config, its run directory, whose lock it
/// holds for the workers).
pub fn run(argv: &[String], resolved: &crate::train::Resolved, sv: &Supervise, stop: &AtomicBool) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| KilnError::Internal(format!("cannot find the kiln executable: {e}")))?;
    let args = child_args(argv);
    let (run_dir, resumed, cfg0) = (resolved.run_dir.clone(), resolved.resume, resolved.cfg.clone());
    let mpi = cfg0.parallel.backend == crate::config::Backend::Mpi;
    let elastic = cfg0.faults.elastic_min > 0;
    // An elastic MPI world's layout is the supervisor's to give.
    let args = if mpi && elastic { without(&args, &["--dp", "--micro-batches"]) } else { args };
    if mpi && cfg0.parallel.dp == 0 {
        return crate::error::user("kiln train --supervise with parallel.backend = mpi launches the world itself: give its size with --dp N");
    }
    if mpi && sv.launcher.is_empty() {
        return crate::error::user("--launcher is empty: give the MPI launcher, e.g. --launcher mpirun");
    }
    // The supervisor owns the run directory (`resolved` holds its lock); its workers train
    // under it.
    let mut restarts = 0u32;
    let mut launched = false;
    let mut world = World {
        pool: Ranks::new(cfg0.parallel.world(cfg0.parallel.dp)),
        layout: Layout { dp: cfg0.parallel.dp, grad_accum: cfg0.train.grad_accum },
        failed_at: 0,
    };
    loop {
        let mut cmd = if mpi {
            let mut c = Command::new(&sv.launcher[0]);
            c.args(&sv.launcher[1..]).arg("-n").arg(world.pool.live.len().to_string()).arg(&exe);
            // Its own process group, so a hung world is killed whole.
            std::os::unix::process::CommandExt::process_group(&mut c, 0);
            c
        } else {
            Command::new(&exe)
        };
        cmd.env(crate::run::LOCK_HELD_ENV, std::process::id().to_string());
        cmd.arg("train").args(&args).arg("--out").arg(&run_dir);
        // Resume once the run exists (a process killed before writing its config starts over).
        if (launched || resumed) && run_dir.join("config.toml").exists() && !args.iter().any(|a| a == "--resume") {
            cmd.arg("--resume");
        }
        if mpi && elastic {
            world.args(&mut cmd);
            for s in 0..cfg0.parallel.world(cfg0.faults.elastic_max) {
                let _ = std::fs::remove_file(run_dir.join(format!("{SLOT_BEAT}{s}")));
            }
        }
        let started = Instant::now();
        let before = heartbeat(&run_dir).map(|h| h.0);
        let mut step = 0u64;
        let mut child: Child = cmd.spawn().map_err(|e| KilnError::Internal(format!("cannot start the training process: {e}")))?;
        launched = true;
        eprintln!("supervisor: training process {} started{}", child.id(), if restarts > 0 { format!(" (restart {restarts} of {})", sv.max_restarts) } else { String::new() });
        let watch = Watch { run_dir: &run_dir, mpi, stop, heartbeat_timeout: sv.heartbeat_timeout, rejoin_timeout_s: cfg0.faults.rejoin_timeout_s };
        let outcome = watch.wait(&mut child, (mpi && elastic).then_some(&world.pool.live[..]), (started, before), &mut step)?;
        if let Some((_, s)) = heartbeat(&run_dir).filter(|h| Some(h.0) != before) {
            step = step.max(s);
        }
        let (event, detail) = match outcome {
            Ok(s) if s.success() => return Ok(()),
            Ok(s) if mpi && elastic && s.code() == Some(EXIT_REGROW) => {
                world.regrow(&current(&run_dir, &cfg0, world.layout)?, &run_dir, step)?;
                continue;
            }
            Err(Absent::Ranks(missing)) => {
                world.shrink(&current(&run_dir, &cfg0, world.layout)?, &run_dir, step, &missing)?;
                continue;
            }
            // A user error (bad config, data, checkpoint) will not go away by restarting.
            Ok(s) if s.code() == Some(2) => return Err(KilnError::User(format!("training stopped with a user error (exit 2) in {}", run_dir.display()))),
            Ok(_) if stop.load(Ordering::SeqCst) => return Err(KilnError::Internal("interrupted".into())),
            Ok(s) => ("worker_crashed", describe(&s)),
            Err(Absent::Heartbeat(q)) => ("worker_hung", format!("no heartbeat for {:.1} s", q.as_secs_f64())),
        };
        restarts += 1;
        world.failed_at = step;
        let give_up = restarts > sv.max_restarts;
        eprintln!("supervisor: training process {event} at step {step} ({detail}){}", if give_up { "; no restarts left" } else { "; restarting from the newest valid checkpoint" });
        log_fault(&run_dir, serde_json::json!({"kind": "fault", "step": step, "event": event, "detail": detail, "restart": restarts, "gave_up": give_up}));
        if give_up {
            return Err(KilnError::Internal(format!("training failed {} times ({event} at step {step}: {detail}); the newest valid checkpoint in {} is intact", restarts, run_dir.display())));
        }
    }
}

/// What the supervisor watches a worker by.
struct Watch<'a> {
    run_dir: &'a Path,
    mpi: bool,
    stop: &'a AtomicBool,
    heartbeat_timeout: Duration,
    rejoin_timeout_s: f64,
}

impl Watch<'_> {
    /// Waits for `child` (started at `started`, the heartbeat then `before`) to exit, to stop
    /// beating, or, for an elastic MPI world whose live ranks are `live`, to leave ranks
    /// unreported; the highest step its heartbeats reached goes into `step`.
    fn wait(&self, child: &mut Child, live: Option<&[usize]>, (started, before): (Instant, Option<SystemTime>), step: &mut u64) -> Result<std::result::Result<std::process::ExitStatus, Absent>> {
        // An elastic MPI world's every rank reports within faults.rejoin_timeout_s, or those
        // that do not are lost.
        let mut roll_call = live.is_some();
        // The roll call's clock starts at the first rank's report (every rank loads the data and
        // plans its memory first); with none, after the start-up grace.
        let mut first_report: Option<Instant> = None;
        let mut forwarded = false;
        Ok(loop {
            if let Some(status) = child.try_wait().map_err(|e| KilnError::Internal(format!("waiting for the training process: {e}")))? {
                break Ok(status);
            }
            // Ctrl-C: the launcher has its own process group, so pass it on (once).
            if self.mpi && !forwarded && self.stop.load(Ordering::SeqCst) {
                unsafe {
                    libc::kill(-(child.id() as i32), libc::SIGINT);
                }
                forwarded = true;
            }
            if roll_call {
                let live = live.unwrap_or_default();
                let missing: Vec<usize> = live.iter().copied().filter(|s| !self.run_dir.join(format!("{SLOT_BEAT}{s}")).exists()).collect();
                if missing.len() < live.len() {
                    first_report.get_or_insert_with(Instant::now);
                }
                let waited = first_report.map_or(started.elapsed().as_secs_f64() - STARTUP_GRACE.as_secs_f64(), |t| t.elapsed().as_secs_f64());
                if missing.is_empty() {
                    roll_call = false;
                } else if waited > self.rejoin_timeout_s {
                    kill_group(child);
                    break Err(Absent::Ranks(missing));
                }
            }
            let beat = heartbeat(self.run_dir).filter(|h| Some(h.0) != before);
            if let Some((_, s)) = beat {
                *step = (*step).max(s);
            }
            // Until its first heartbeat a process is starting up (loading data, measuring the
            // matmul peak): it gets at least STARTUP_GRACE.
            let (quiet_for, limit) = match beat {
                Some((t, _)) => (t.elapsed().unwrap_or_default(), self.heartbeat_timeout),
                None => (started.elapsed(), self.heartbeat_timeout.max(STARTUP_GRACE)),
            };
            if quiet_for > limit && !self.stop.load(Ordering::SeqCst) {
                if self.mpi {
                    kill_group(child);
                } else {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                break Err(Absent::Heartbeat(quiet_for));
            }
            std::thread::sleep(Duration::from_millis(200));
        })
    }
}

/// An elastic MPI world across launches: its ranks, its layout, and the step it last reached
/// before it failed.
struct World {
    pool: Ranks,
    layout: Layout,
    failed_at: u64,
}

impl World {
    /// The worker's layout and ranks, for the next launch.
    fn args(&self, cmd: &mut Command) {
        let list = |v: &[usize]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
        cmd.args(["--dp", &self.layout.dp.to_string(), "--micro-batches", &self.layout.grad_accum.to_string(), "--elastic-slots", &list(&self.pool.live)]);
        if !self.pool.out.is_empty() {
            cmd.args(["--elastic-lost", &list(&self.pool.out)]);
        }
    }

    /// The worker stopped at the checkpoint of `step` for lost ranks to rejoin (those that
    /// answer the next roll call stay): the full world.
    fn regrow(&mut self, cfg: &crate::config::RunConfig, run_dir: &Path, step: u64) -> Result<()> {
        let from = self.pool.live.len();
        let (back, layout) = self.pool.rejoin(cfg)?;
        self.layout = layout;
        let to = self.pool.live.len();
        log_fault(run_dir, serde_json::json!({"kind": "fault", "step": step, "event": "rank_rejoined", "ranks": back}));
        log_fault(run_dir, serde_json::json!({"kind": "fault", "step": step, "event": "world_resized", "from": from, "to": to, "dp_to": layout.dp, "grad_accum_to": layout.grad_accum, "restored_step": step, "lost_steps": 0, "from_state": "disk"}));
        eprintln!("supervisor: ranks {back:?} rejoin at the checkpoint of step {step}: relaunching {to} ranks");
        Ok(())
    }

    /// Ranks `missing` did not answer the roll call: lost for good; relaunch without them,
    /// from the newest valid checkpoint.
    fn shrink(&mut self, cfg: &crate::config::RunConfig, run_dir: &Path, step: u64, missing: &[usize]) -> Result<()> {
        let from = self.pool.live.len();
        self.layout = self.pool.lose(cfg, missing).map_err(|e| KilnError::User(format!("ranks {missing:?} lost for good: {e}")))?;
        let layout = self.layout;
        let ck = crate::checkpoint::latest_valid(&crate::run::ckpt_dir(run_dir)).ok().map_or(0, |l| l.state.step);
        let failed_at = self.failed_at.max(step).max(ck);
        for r in missing {
            log_fault(run_dir, serde_json::json!({"kind": "fault", "step": failed_at, "event": "rank_lost", "rank": r, "ranks": missing, "detail": format!("no report within faults.rejoin_timeout_s = {} s", cfg.faults.rejoin_timeout_s)}));
        }
        log_fault(run_dir, serde_json::json!({"kind": "fault", "step": failed_at, "event": "world_resized", "from": from, "to": self.pool.live.len(), "dp_from": cfg.parallel.dp, "dp_to": layout.dp, "grad_accum_from": cfg.train.grad_accum, "grad_accum_to": layout.grad_accum, "restored_step": ck, "lost_steps": failed_at.saturating_sub(ck), "from_state": "disk"}));
        eprintln!("supervisor: ranks {missing:?} did not come back within {} s: relaunching {} ranks (dp {}, {} micro-batches) from step {ck}", cfg.faults.rejoin_timeout_s, self.pool.live.len(), layout.dp, layout.grad_accum);
        Ok(())
    }
}

/// Why a worker was stopped: no heartbeat for so long, or ranks missing from the roll call.
enum Absent {
    Heartbeat(Duration),
    Ranks(Vec<usize>),
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
