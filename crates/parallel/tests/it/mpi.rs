//! The MPI backend under `mpirun` (feature `mpi`; needs OpenMPI's `mpirun` on PATH): runs the
//! `kiln-mpi-selftest` binary on 2 and 4 ranks, and its planted failures.
#![cfg(feature = "mpi")]

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// mpirun jobs run one at a time (the ranks poll; two jobs at once would fight for the cores).
static JOBS: Mutex<()> = Mutex::new(());

/// Exit code of a self-test rank that caught the planted failure.
const PLANTED: i32 = 17;

struct Run {
    code: Option<i32>,
    out: String,
    secs: f64,
}

/// `mpirun -n N kiln-mpi-selftest MODE` with `KILN_COMM_TIMEOUT_S=timeout_s`; killed after 60 s.
fn mpirun(n: usize, mode: &str, timeout_s: u32) -> Run {
    let _job = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let start = Instant::now();
    let mut child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-n", &n.to_string(), "-x", "KILN_COMM_TIMEOUT_S", "-x", "RUST_BACKTRACE"])
        .arg(env!("CARGO_BIN_EXE_kiln-mpi-selftest"))
        .arg(mode)
        .env("KILN_COMM_TIMEOUT_S", timeout_s.to_string())
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run mpirun (install openmpi-bin)");
    // Drain both pipes on threads so a chatty job cannot block on a full pipe.
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = format!("{}{}", t_out.join().unwrap(), t_err.join().unwrap());
    Run { code: status.code(), out, secs: start.elapsed().as_secs_f64() }
}

/// The `file:line:col` sites of the self-test binary named in `text`, deduplicated.
fn selftest_sites(text: &str) -> Vec<String> {
    let key = "kiln-mpi-selftest.rs:";
    let mut sites: Vec<String> = text
        .match_indices(key)
        .map(|(i, _)| {
            let rest = &text[i + key.len()..];
            let end = rest.find(|c: char| !(c.is_ascii_digit() || c == ':')).unwrap_or(rest.len());
            format!("{key}{}", &rest[..end])
        })
        .collect();
    sites.sort();
    sites.dedup();
    sites
}

fn caught_line(run: &Run, rank: usize) -> String {
    let prefix = format!("kiln-mpi-selftest: rank {rank} caught: ");
    run.out
        .lines()
        .find_map(|l| l.strip_prefix(&prefix).map(str::to_string))
        .unwrap_or_else(|| panic!("rank {rank} did not report the planted failure:\n{}", run.out))
}

fn check_passes(n: usize) {
    let run = mpirun(n, "check", 60);
    assert_eq!(run.code, Some(0), "self-test on {n} ranks failed after {:.1}s:\n{}", run.secs, run.out);
    for r in 0..n {
        assert!(run.out.contains(&format!("rank {r} of {n}: all checks passed")), "rank {r} did not pass:\n{}", run.out);
    }
}

#[test]
fn mpi_selftest_passes_on_2_ranks() {
    check_passes(2);
}

#[test]
fn mpi_selftest_passes_on_4_ranks() {
    check_passes(4);
}

#[test]
fn mpi_selftest_passes_on_3_ranks() {
    check_passes(3);
}

#[test]
fn mpi_mismatch_names_ranks_sequence_number_and_both_sites() {
    let run = mpirun(4, "mismatch", 60);
    assert_eq!(run.code, Some(PLANTED), "expected exit {PLANTED}:\n{}", run.out);
    assert!(run.secs < 30.0, "mismatch took {:.1}s", run.secs);
    let msg = caught_line(&run, 0);
    assert!(msg.starts_with("collective mismatch on group 0 (world ranks [0, 1, 2, 3]) at sequence number 3: "), "{msg}");
    assert!(msg.contains("rank 0 called #3 all_reduce_sum(f32 × 8) at "), "{msg}");
    assert!(msg.contains("rank 1 called #3 all_gather(f32 × 8 → 32) at "), "{msg}");
    assert!(msg.contains("rank 3 called #3 all_reduce_sum(f32 × 8) at "), "{msg}");
    let sites = selftest_sites(&msg);
    assert_eq!(sites.len(), 2, "expected both call sites in {msg}");
    // Every rank panics with the same text.
    assert_eq!(caught_line(&run, 1), msg);
}

#[test]
fn mpi_missing_rank_times_out_naming_it() {
    let run = mpirun(4, "timeout", 2);
    assert_eq!(run.code, Some(PLANTED), "expected exit {PLANTED}:\n{}", run.out);
    assert!(run.secs < 30.0, "timeout took {:.1}s", run.secs);
    let msg = caught_line(&run, 0);
    assert!(msg.starts_with("collective all_reduce_sum timed out after 2."), "{msg}");
    assert!(msg.contains("on rank 0 of group 0 (world ranks [0, 1, 2, 3]): ranks [1] (world ranks [1]) have not arrived; arrived: [rank 0 in all_reduce_sum of #3 all_reduce_sum(f32 × 8) at "), "{msg}");
    assert!(msg.contains("rank 2 in all_reduce_sum of #3") && msg.contains("rank 3 in all_reduce_sum of #3"), "{msg}");
    assert_eq!(selftest_sites(&msg).len(), 1, "{msg}");
}

#[test]
fn mpi_split_that_does_not_partition_fails_on_every_rank() {
    let run = mpirun(3, "badsplit", 60);
    assert_eq!(run.code, Some(PLANTED), "expected exit {PLANTED}:\n{}", run.out);
    let want = "split on group 0 (world ranks [0, 1, 2]): groups do not partition the parent: rank 0 asked for [0, 1] but rank 1 asked for [1]";
    assert_eq!(caught_line(&run, 0), want);
    assert_eq!(caught_line(&run, 2), want);
}

#[test]
fn mpi_dead_rank_ends_the_job_naming_it() {
    for (mode, text) in [("die", "Process name: [["), ("abort", "mpirun noticed that process rank 1 ")] {
        let run = mpirun(4, mode, 60);
        assert!(run.code.is_some_and(|c| c != 0), "{mode}: job should fail:\n{}", run.out);
        assert!(run.secs < 30.0, "{mode}: took {:.1}s", run.secs);
        assert!(run.out.contains(text), "{mode}: mpirun did not name the rank:\n{}", run.out);
        if mode == "die" {
            assert!(run.out.contains(",1]\n  Exit code:    101"), "{mode}: expected rank 1 with exit code 101:\n{}", run.out);
        }
        assert!(!run.out.contains("returned although rank 1 died"), "{}", run.out);
    }
}
