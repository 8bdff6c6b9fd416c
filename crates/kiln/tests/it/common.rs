use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).env("RAYON_NUM_THREADS", "2").output().expect("run kiln")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A fresh, empty scratch directory for one test, removed when the test passes (kept for a
/// look when it fails).
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

pub fn scratch(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("kiln-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

/// About 40 KB of varied English-like text.
pub fn corpus(dir: &Path) -> PathBuf {
    let words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "then", "runs", "far", "away", "from", "home", "while", "birds", "sing"];
    let mut s = String::new();
    let mut x: u64 = 12345;
    for i in 0..8000 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        s.push_str(words[(x >> 33) as usize % words.len()]);
        s.push(if i % 11 == 10 { '\n' } else { ' ' });
    }
    let p = dir.join("corpus.txt");
    std::fs::write(&p, s).unwrap();
    p
}

/// Flags for a small, fast model.
pub const SMALL: &[&str] = &[
    "--set", "model.n_layer=1", "--set", "model.n_head=2", "--set", "model.n_embd=16", "--set", "model.block_size=16",
    "--set", "train.batch_size=4", "--set", "train.warmup_steps=2", "--set", "train.lr_decay_steps=40",
    "--set", "eval.interval=5", "--set", "eval.iters=2", "--set", "checkpoint.interval=5", "--set", "sample.tokens=20", "--quiet",
    // In-process ranks time-share two cores: no straggler reports unless a test asks.
    "--set", "faults.straggler_ratio=0",
];

/// `kiln train` on the small model with extra args; returns the output.
pub fn train(data: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap()];
    args.extend_from_slice(SMALL);
    args.extend_from_slice(extra);
    kiln(&args)
}

/// The train losses from a run's metrics.jsonl, by step.
pub fn losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "train")
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

/// Asserts a user error: exit code 2 and every `needle` in stderr.
pub fn assert_user_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "expected exit 2, stderr: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr should mention `{n}`: {err}");
    }
    assert!(!err.contains("panicked"), "a user error must not panic: {err}");
}

/// Spawns `cmd` and waits for it: its exit status word and `ru_maxrss` (KiB, from wait4).
fn wait_measured(mut cmd: Command) -> (i32, u64) {
    #[allow(clippy::zombie_processes)] // reaped by the wait4 below, which also gives its rusage
    let child = cmd.spawn().expect("spawn");
    let (mut status, mut usage) = (0i32, unsafe { std::mem::zeroed::<libc::rusage>() });
    // SAFETY: waits for the child this function spawned; `usage` is written by the kernel.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as i32, "wait4");
    (status, usage.ru_maxrss as u64)
}

/// `kiln args` with its peak resident set (KiB: `ru_maxrss` of this child from wait4, less what
/// a trivial child spawned beside it reports — Linux carries the spawning test process's own
/// resident set into a child's `ru_maxrss` at exec, and the test process grows as other tests
/// run) and wall time.
pub fn kiln_measured(args: &[&str], scratch: &Path) -> (i32, String, String, u64, std::time::Duration) {
    use std::os::unix::process::ExitStatusExt;
    let (out, err) = (scratch.join("measured.stdout"), scratch.join("measured.stderr"));
    let baseline = || wait_measured(Command::new("true")).1;
    let before = baseline();
    let t0 = std::time::Instant::now();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.args(args).env("RAYON_NUM_THREADS", "2").stdout(std::fs::File::create(&out).unwrap()).stderr(std::fs::File::create(&err).unwrap());
    let (status, rss) = wait_measured(cmd);
    let took = t0.elapsed();
    let inherited = before.max(baseline());
    let code = std::process::ExitStatus::from_raw(status).code().unwrap_or(-1);
    (code, std::fs::read_to_string(&out).unwrap(), std::fs::read_to_string(&err).unwrap(), rss.saturating_sub(inherited), took)
}

/// A path under `../shared` (e.g. `fixtures/mixtral-tiny`); a missing one fails the test, naming it.
pub fn fixture(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared").join(name);
    assert!(p.exists(), "fixture {} not found", p.display());
    p
}
