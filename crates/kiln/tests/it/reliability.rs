//! Faults: numerical (skip, roll back), killed and hung workers under --supervise, damaged
//! checkpoints, a full disk. No valid checkpoint is ever damaged.

use crate::common::*;
use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn lines_of(run: &Path, kind: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == kind)
        .collect()
}

fn digests(run: &Path) -> (String, String, u64) {
    let o = kiln(&["checkpoint", "inspect", run.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    (v["params_sha256"].as_str().unwrap().into(), v["optimizer_sha256"].as_str().unwrap().into(), v["step"].as_u64().unwrap())
}

#[test]
fn a_nan_gradient_skips_its_update_and_repeated_ones_roll_back() {
    let d = scratch("nan");
    let data = corpus(&d);
    let base = ["--max-steps", "12", "--set", "checkpoint.interval=4", "--set", "sample.tokens=0"];
    // One poisoned step: its update is skipped, the run goes on and logs the event.
    let one = d.join("one");
    let o = train(&data, &one, &[&base[..], &["--set", "faults.inject_nan_steps=[3]"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let f = lines_of(&one, "fault");
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!((f[0]["step"].as_u64(), f[0]["event"].as_str()), (Some(3), Some("update_skipped")));
    assert!(losses(&one).iter().all(|(s, l)| *s != 3 && l.is_finite()));
    // Three in a row (steps 6–8): roll back to step 4, skip those batches, finish.
    let three = d.join("three");
    let o = train(&data, &three, &[&base[..], &["--set", "faults.inject_nan_steps=[6,7,8]"]].concat());
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("rolling back"), "{err}");
    let events: Vec<String> = lines_of(&three, "fault").iter().map(|v| format!("{}@{}", v["event"].as_str().unwrap(), v["step"])).collect();
    assert!(events.contains(&"rollback@8".to_string()), "{events:?}");
    let steps: Vec<u64> = losses(&three).iter().map(|x| x.0).collect();
    assert_eq!(steps, vec![1, 2, 3, 4, 5, 9, 10, 11, 12]);
    // Steps after the skipped batches train on the same batches as a run that never saw them:
    // the sampler stays in step, so step 9's batch is the uninterrupted run's step 9 batch.
    let (p, _, s) = digests(&three);
    assert_eq!(s, 12);
    assert_ne!(p, digests(&one).0);
    // Without skipping, a non-finite step stops the run with the last checkpoint intact.
    let stopped = d.join("stopped");
    let o = train(&data, &stopped, &[&base[..], &["--set", "faults.inject_nan_steps=[6]", "--set", "faults.skip_nonfinite=false"]].concat());
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("at step 6: stopping"), "{}", stderr(&o));
    assert_eq!(digests(&stopped).2, 4);
}

#[test]
fn checkpoints_written_in_the_background_equal_synchronous_ones() {
    let d = scratch("async-ckpt");
    let data = corpus(&d);
    let run = |name: &str, bg: &str| {
        let out = d.join(name);
        let o = train(&data, &out, &["--max-steps", "12", "--set", "checkpoint.interval=2", "--set", "checkpoint.keep=2", "--set", "checkpoint.keep_every=4", "--set", &format!("checkpoint.background={bg}")]);
        assert!(o.status.success(), "{}", stderr(&o));
        out
    };
    let (a, b) = (run("bg", "true"), run("fg", "false"));
    assert_eq!(digests(&a), digests(&b));
    assert_eq!(losses(&a), losses(&b));
    // Retention: the newest two, plus every 4th step.
    let mut kept: Vec<String> = std::fs::read_dir(a.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    kept.sort();
    assert_eq!(kept, ["step-00000004", "step-00000008", "step-00000010", "step-00000012"]);
    let ck = lines_of(&a, "checkpoint");
    assert!(ck.iter().any(|v| v["snapshot_s"].is_number()) && ck.iter().any(|v| v["write_s"].is_number()), "{ck:?}");
}

/// `kiln train --supervise` over `args`; kills the training process with SIGKILL once the
/// heartbeat reaches each of `kill_at`'s steps (after its delay in ms); returns the
/// supervisor's output.
fn supervised(args: &[&str], run: &Path, kill_at: &[(u64, u64)]) -> std::process::Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for l in std::io::BufReader::new(err).lines().map_while(|l| l.ok()) {
            let _ = tx.send(l.clone());
            all.push_str(&l);
            all.push('\n');
        }
        all
    });
    let mut pid = None;
    let t0 = Instant::now();
    for &(at, delay_ms) in kill_at {
        loop {
            assert!(t0.elapsed() < Duration::from_secs(240), "supervised run stalled before step {at}");
            while let Ok(l) = rx.try_recv() {
                if let Some(p) = l.strip_prefix("supervisor: training process ").and_then(|r| r.split(' ').next()).and_then(|p| p.parse::<u32>().ok()) {
                    pid = Some(p);
                }
            }
            let beat = std::fs::read_to_string(run.join("heartbeat")).ok().and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0);
            if beat >= at && pid.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(delay_ms));
        let st = Command::new("kill").args(["-9", &pid.take().unwrap().to_string()]).status().unwrap();
        assert!(st.success());
    }
    let status = child.wait().unwrap();
    let stderr = reader.join().unwrap();
    std::process::Output { status, stdout: Vec::new(), stderr: stderr.into_bytes() }
}

/// Five distinct steps in 25..=285, at least 25 apart, and a delay of 0–4 ms after each, from
/// `seed` (printed, so a failure can be replayed).
fn random_kills(seed: u64) -> Vec<(u64, u64)> {
    let mut x = seed | 1;
    let mut next = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    loop {
        let mut steps: Vec<u64> = (0..5).map(|_| 25 + next(261)).collect();
        steps.sort();
        if steps.windows(2).all(|w| w[1] >= w[0] + 25) {
            return steps.into_iter().map(|s| (s, next(5))).collect();
        }
    }
}

#[test]
fn a_supervised_run_killed_five_times_ends_bit_identical() {
    let d = scratch("supervise");
    let data = corpus(&d);
    // Synchronous checkpoints every 20 steps: a step's checkpoint is on disk before the next
    // step starts, so no failure may lose more than 20 steps.
    let common = ["--data", data.to_str().unwrap(), "--max-steps", "300", "--set", "checkpoint.interval=20", "--set", "checkpoint.background=false", "--set", "eval.interval=100", "--set", "sample.tokens=0"];
    let straight = d.join("straight");
    let o = kiln(&[&["train", "--out", straight.to_str().unwrap()], SMALL, &common[..]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let sup = d.join("sup");
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let kills = random_kills(seed);
    eprintln!("SIGKILL after steps (and ms) {kills:?}: seed {seed}");
    let kill_at: Vec<u64> = kills.iter().map(|k| k.0).collect();
    let o = supervised(&[&["train", "--supervise", "--max-restarts", "6", "--heartbeat-timeout", "60", "--out", sup.to_str().unwrap()], SMALL, &common[..]].concat(), &sup, &kills);
    let err = stderr(&o);
    assert!(o.status.success(), "seed {seed}: {err}");
    assert_eq!(digests(&sup), digests(&straight), "seed {seed}: parameters and optimizer state after 5 SIGKILLs");
    let faults = lines_of(&sup, "fault");
    let resumes = lines_of(&sup, "resume");
    assert_eq!((faults.len(), resumes.len()), (5, 5), "seed {seed}: {faults:?} {resumes:?}");
    let lost: Vec<(u64, u64)> = faults.iter().zip(&resumes).map(|(f, r)| (f["step"].as_u64().unwrap(), r["step"].as_u64().unwrap())).collect();
    eprintln!("(killed after step, resumed from step): {lost:?}");
    for ((f, r), at) in faults.iter().zip(&resumes).zip(kill_at) {
        assert_eq!(f["event"], "worker_crashed");
        let (step, from) = (f["step"].as_u64().unwrap(), r["step"].as_u64().unwrap());
        assert!(step >= at && step < at + 20, "seed {seed}: killed at heartbeat {step}, asked {at}");
        // Lost work per failure ≤ the checkpoint interval.
        assert!(from % 20 == 0 && from <= step && step - from <= 20, "seed {seed}: killed after step {step}, resumed from {from}");
    }
    assert_eq!(losses(&sup), losses(&straight));
}

#[test]
fn a_worker_killed_in_the_middle_of_a_checkpoint_write_restarts_from_the_one_before() {
    let d = scratch("kill-in-write");
    let data = corpus(&d);
    let common = ["--data", data.to_str().unwrap(), "--max-steps", "40", "--set", "checkpoint.interval=10", "--set", "sample.tokens=0"];
    let straight = d.join("straight");
    let o = kiln(&[&["train", "--out", straight.to_str().unwrap()], SMALL, &common[..]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    // The background write of step 20 dies with the process after the tensor files, before
    // the manifest: step 10's checkpoint is the newest valid one.
    let sup = d.join("sup");
    let o = kiln(&[&["train", "--supervise", "--max-restarts", "2", "--out", sup.to_str().unwrap()], SMALL, &common[..], &["--set", "faults.kill_in_write_step=20"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let faults = lines_of(&sup, "fault");
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!(faults[0]["detail"], "killed by signal 9", "{faults:?}");
    assert_eq!(lines_of(&sup, "resume").iter().map(|r| r["step"].as_u64().unwrap()).collect::<Vec<_>>(), [10]);
    assert_eq!(digests(&sup), digests(&straight));
    // The dead writer's partial directory was cleared away when the run restarted.
    let left: Vec<String> = std::fs::read_dir(sup.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with('.')).collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_hung_worker_is_killed_and_restarted() {
    let d = scratch("hang");
    let data = corpus(&d);
    let out = d.join("run");
    // SIGSTOP freezes the worker (a hang): the supervisor sees no heartbeat, kills, restarts.
    let args = [&["train", "--supervise", "--max-restarts", "2", "--heartbeat-timeout", "8", "--out", out.to_str().unwrap(), "--data", data.to_str().unwrap(), "--max-steps", "60", "--set", "checkpoint.interval=10", "--set", "sample.tokens=0"][..], SMALL].concat();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln")).args(&args).stderr(Stdio::piped()).spawn().unwrap();
    let err = child.stderr.take().unwrap();
    let mut lines = std::io::BufReader::new(err).lines();
    let first = lines.next().unwrap().unwrap();
    let pid: u32 = first.strip_prefix("supervisor: training process ").and_then(|r| r.split(' ').next()).unwrap().parse().unwrap();
    let t0 = Instant::now();
    while std::fs::read_to_string(out.join("heartbeat")).ok().and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0) < 15 {
        assert!(t0.elapsed() < Duration::from_secs(120));
        std::thread::sleep(Duration::from_millis(5));
    }
    Command::new("kill").args(["-STOP", &pid.to_string()]).status().unwrap();
    let rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    let status = child.wait().unwrap();
    assert!(status.success(), "{rest:?}");
    assert!(rest.iter().any(|l| l.contains("worker_hung")), "{rest:?}");
    let f = lines_of(&out, "fault");
    assert_eq!(f.len(), 1);
    assert_eq!(f[0]["event"], "worker_hung");
    assert_eq!(losses(&out).last().unwrap().0, 60);
}

#[test]
fn a_full_disk_during_a_checkpoint_write_damages_nothing() {
    let d = scratch("full-disk");
    let data = corpus(&d);
    let out = d.join("run");
    let o = train(&data, &out, &["--max-steps", "5", "--set", "checkpoint.interval=5", "--set", "sample.tokens=0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = digests(&out);
    // A file-size limit below a checkpoint's size stands in for a full disk: the next write
    // fails (EFBIG), the run stops with an error, and step 5's checkpoint still verifies.
    let script = format!(
        "ulimit -f 40; trap '' XFSZ; exec {} train --resume --out {} --data {} --max-steps 10 --set checkpoint.interval=10 --set sample.tokens=0 {}",
        env!("CARGO_BIN_EXE_kiln"),
        out.display(),
        data.display(),
        SMALL.iter().map(|s| format!("'{s}'")).collect::<Vec<_>>().join(" ")
    );
    let o = Command::new("sh").args(["-c", &script]).output().unwrap();
    let err = stderr(&o);
    assert!(!o.status.success(), "the write should have failed: {err}");
    assert!(err.contains("File too large") || err.contains("No space") || err.contains("too large"), "{err}");
    assert_eq!(digests(&out), before, "the newest valid checkpoint is still step 5's, intact");
    // No partial checkpoint is ever visible as one.
    let visible: Vec<String> = std::fs::read_dir(out.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with("step-")).collect();
    assert_eq!(visible, ["step-00000005"]);
}

#[test]
fn a_checkpoint_without_its_manifest_is_skipped() {
    let d = scratch("no-manifest");
    let data = corpus(&d);
    let out = d.join("run");
    let o = train(&data, &out, &["--max-steps", "10", "--set", "checkpoint.interval=5", "--set", "sample.tokens=0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_file(out.join("checkpoints/step-00000010/manifest.json")).unwrap();
    let o = kiln(&["checkpoint", "inspect", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("step-00000005"), "{}", stdout(&o));
    assert!(stderr(&o).contains("step-00000010") && stderr(&o).contains("manifest"), "{}", stderr(&o));
    let o = kiln(&["checkpoint", "inspect", out.join("checkpoints/step-00000010").to_str().unwrap()]);
    assert_user_error(&o, &["neither a checkpoint"]);
}

#[test]
fn the_automatic_interval_follows_young_daly_from_measured_costs() {
    let d = scratch("auto-interval");
    let data = corpus(&d);
    let out = d.join("run");
    let o = train(&data, &out, &["--max-steps", "60", "--set", "checkpoint.interval=5", "--set", "checkpoint.mtbf_s=2", "--set", "checkpoint.keep=100", "--set", "sample.tokens=0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let taken: Vec<(u64, Option<u64>)> = lines_of(&out, "checkpoint").iter().filter(|v| v["snapshot_s"].is_number()).map(|v| (v["step"].as_u64().unwrap(), v["next_interval"].as_u64())).collect();
    assert_eq!(taken[0].0, 5, "the first checkpoint measures the cost: {taken:?}");
    for w in taken.windows(2) {
        let (step, next) = (w[0].0, w[0].1.expect("each checkpoint chooses the next interval"));
        assert!(next >= 1);
        assert!(w[1].0 == step + next || w[1].0 == 60, "{taken:?}");
    }
    let o = train(&data, &d.join("bad"), &["--set", "checkpoint.mtbf_s=-1"]);
    assert_user_error(&o, &["checkpoint.mtbf_s must be a non-negative number"]);
}

#[test]
fn convert_between_one_file_and_parts_keeps_the_digests() {
    let d = scratch("convert");
    let data = corpus(&d);
    let out = d.join("run");
    let o = train(&data, &out, &["--max-steps", "5", "--set", "checkpoint.interval=5", "--set", "sample.tokens=0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = digests(&out);
    let parts = d.join("parts");
    let o = kiln(&["checkpoint", "convert", out.to_str().unwrap(), "--out", parts.to_str().unwrap(), "--shards", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(parts.join("step-00000005/model-00002-of-00003.safetensors").exists());
    assert_eq!(digests(&parts.join("step-00000005")), want);
    let back = d.join("back");
    let o = kiln(&["checkpoint", "convert", parts.join("step-00000005").to_str().unwrap(), "--out", back.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(back.join("step-00000005/model.safetensors").exists());
    assert_eq!(digests(&back.join("step-00000005")), want);
    let o = kiln(&["checkpoint", "convert", out.to_str().unwrap(), "--out", back.to_str().unwrap()]);
    assert_user_error(&o, &["already holds a checkpoint of step 5"]);
}

#[test]
fn direct_io_checkpoints_of_any_size_read_back_exactly() {
    // Tensor sizes that leave every kind of partial last block (direct I/O writes whole 4 KiB
    // blocks and cuts the file to its length), one spanning several 4 MiB staging buffers.
    use kiln::checkpoint::{save, verify_and_load, Tensors, TrainState};
    let d = scratch("direct");
    let sizes = [1usize, 3, 1023, 1024, 1025, (1 << 20) + 7, 3 << 20];
    let bufs: Vec<Vec<f32>> = sizes.iter().enumerate().map(|(k, &n)| (0..n).map(|i| (i as f32 * 0.37 + k as f32).sin()).collect()).collect();
    let t = |pre: &str| Tensors { items: bufs.iter().enumerate().map(|(k, b)| (format!("{pre}t{k}"), vec![b.len()], &b[..])).collect() };
    let state = TrainState { step: 7, sampler_rng: [1, 2, 3, 4], tokens_seen: 9, elapsed_s: 1.5, config: String::new(), loss_scale: None, fp8_amax: None, loader: None };
    let dir = save(&d.join("checkpoints"), &state, &t(""), &t("exp_avg."), "{}").unwrap();
    let l = verify_and_load(&dir).unwrap();
    assert_eq!(l.state, state);
    for (bytes, pre) in [(&l.model, ""), (&l.optim, "exp_avg.")] {
        let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
        for (k, b) in bufs.iter().enumerate() {
            let got: Vec<f32> = st.tensor(&format!("{pre}t{k}")).unwrap().data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            assert_eq!(&got, b, "tensor {pre}t{k} of {} elements", b.len());
        }
    }
    // The file is exactly its safetensors length (no block padding left behind).
    let len = std::fs::metadata(dir.join("model.safetensors")).unwrap().len();
    assert_eq!(len as usize, l.model.len());
    assert_ne!(len % 4096, 0, "the test should end in a partial block");
}

#[test]
fn a_failed_rank_restores_from_its_peers_memory_or_from_disk_when_the_peer_is_gone_too() {
    let d = scratch("gemini");
    let data = corpus(&d);
    let run = |name: &str, extra: &[&str]| {
        let out = d.join(name);
        let o = train(&data, &out, &[&["--max-steps", "16", "--set", "sample.tokens=0"][..], extra].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        out
    };
    let faults = |run: &Path| -> Vec<(String, serde_json::Value)> { lines_of(run, "fault").into_iter().map(|f| (f["event"].as_str().unwrap().to_string(), f)).collect() };
    let checkpoints = |run: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(run.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    for layout in [&["--set", "parallel.dp=2"][..], &["--set", "parallel.tp=2"][..]] {
        let tag = layout[1].replace(['.', '='], "-");
        let whole = run(&format!("whole-{tag}"), &[layout, &["--set", "checkpoint.interval=0"]].concat());
        // In memory every 4 steps, on disk only at the end: rank 1 fails at the start of step
        // 11 and every rank comes back at step 8 from memory (rank 1's part from rank 0's).
        let mem = run(&format!("mem-{tag}"), &[layout, &["--set", "checkpoint.interval=0", "--set", "checkpoint.memory_interval=4", "--set", "faults.fail_ranks=[1]", "--set", "faults.fail_step=11"]].concat());
        let f = faults(&mem);
        assert_eq!(f.len(), 2, "{f:?}");
        assert_eq!((f[0].0.as_str(), f[0].1["rank"].as_u64(), f[0].1["step"].as_u64()), ("rank_failed", Some(1), Some(11)), "{f:?}");
        assert_eq!((f[1].0.as_str(), f[1].1["from"].as_str(), f[1].1["restored_step"].as_u64(), f[1].1["lost_steps"].as_u64()), ("restored", Some("memory"), Some(8), Some(2)), "{f:?}");
        assert_eq!(checkpoints(&mem), ["step-00000016"], "nothing but the final checkpoint was ever on disk");
        assert_eq!(digests(&mem), digests(&whole), "{tag}: restored from memory, the run ends where the uninterrupted one does");
        assert_eq!(losses(&mem), losses(&whole));
    }
    // Of four ranks, 1 and its peer 2 fail: rank 1's copy went with rank 2, so the restore
    // falls back to the disk checkpoint of step 8.
    let whole = run("whole-dp4", &["--set", "parallel.dp=4", "--set", "checkpoint.interval=0"]);
    let both = run("both", &["--set", "parallel.dp=4", "--set", "checkpoint.interval=4", "--set", "checkpoint.memory_interval=2", "--set", "faults.fail_ranks=[1, 2]", "--set", "faults.fail_step=11"]);
    let f = faults(&both);
    assert_eq!(f[0].1["ranks"], serde_json::json!([1, 2]), "both injected ranks count as failed: {f:?}");
    assert_eq!((f[1].0.as_str(), f[1].1["from"].as_str(), f[1].1["restored_step"].as_u64()), ("restored", Some("disk"), Some(8)), "{f:?}");
    assert!(f[1].1["why_not_memory"].as_str().unwrap().contains("rank 1's snapshot is in neither its memory nor its peer's (rank 2)"), "{f:?}");
    assert_eq!(digests(&both), digests(&whole));
    // In-memory checkpoints need a peer.
    let o = train(&data, &d.join("alone"), &["--set", "checkpoint.memory_interval=4"]);
    assert_user_error(&o, &["checkpoint.memory_interval = 4 needs at least two in-process ranks"]);
    let o = train(&data, &d.join("nobody"), &["--set", "parallel.dp=2", "--set", "faults.fail_ranks=[2]", "--set", "faults.fail_step=3"]);
    assert_user_error(&o, &["faults.fail_ranks names rank 2, but the run has 2 rank(s)"]);
}

#[test]
fn a_live_run_directory_has_one_writer_and_read_only_commands_still_work() {
    let d = scratch("lock");
    let data = corpus(&d);
    let (full, live) = (d.join("full"), d.join("live"));
    let args = |out: &Path, extra: &[&str]| -> Vec<String> {
        let base = ["train", "--out", out.to_str().unwrap(), "--data", data.to_str().unwrap()];
        let every_step: &[&str] = &["--set", "checkpoint.interval=1", "--set", "sample.tokens=0"];
        base.iter().chain(SMALL).chain(every_step).chain(extra).map(|s| s.to_string()).collect()
    };
    let run = |v: Vec<String>| kiln(&v.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(run(args(&full, &["--max-steps", "30"])).status.success());
    // A run writing a checkpoint every step, frozen (SIGSTOP) once it is under way.
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln")).args(args(&live, &["--max-steps", "100000"])).stderr(Stdio::null()).spawn().unwrap();
    let pid = child.id().to_string();
    let t0 = Instant::now();
    while std::fs::read_to_string(live.join("heartbeat")).ok().and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0) < 5 {
        assert!(t0.elapsed() < Duration::from_secs(120));
        std::thread::sleep(Duration::from_millis(2));
    }
    Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    let lines_before = std::fs::read_to_string(live.join("metrics.jsonl")).unwrap();
    // A second writer, new or resuming, is refused at once and writes nothing.
    for extra in [&["--max-steps", "30"][..], &["--resume", "--max-steps", "30"]] {
        let t = Instant::now();
        let o = run(args(&live, extra));
        assert!(t.elapsed() < Duration::from_secs(1), "took {:?}", t.elapsed());
        eprintln!("refused in {:?}", t.elapsed());
        assert_user_error(&o, &[live.to_str().unwrap(), "in use by process", &pid]);
    }
    assert_eq!(std::fs::read_to_string(live.join("metrics.jsonl")).unwrap(), lines_before);
    // Read-only commands work on the live run, on complete checkpoints only.
    let o = kiln(&["checkpoint", "inspect", live.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = kiln(&["eval", "--run", live.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = kiln(&["runs", d.to_str().unwrap()]);
    assert!(stdout(&o).contains(&format!("live (live, pid {pid})")), "{}", stdout(&o));
    // Killed, its lock goes with it: --resume takes the directory over and continues exactly.
    Command::new("kill").args(["-KILL", &pid]).status().unwrap();
    child.wait().unwrap();
    let o = run(args(&live, &["--resume", "--max-steps", "30"]));
    assert!(o.status.success(), "{}", stderr(&o));
    let bits = |r: &Path| losses(r).into_iter().map(|(s, l)| (s, l.to_bits())).collect::<Vec<_>>();
    assert_eq!(bits(&live), bits(&full));
    assert!(!stdout(&kiln(&["runs", d.to_str().unwrap()])).contains("(live"));
    let dup: Vec<String> = std::fs::read_dir(live.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.contains(".1")).collect();
    assert!(dup.is_empty(), "{dup:?}");
}

/// Elastic data parallelism: of four ranks, rank 1 is lost for good at step 11 and
/// the run goes on with three from the in-memory snapshot of step 8, at the same global batch
/// (two micro-batches of two sequences per rank); rank 1 is back from step 20 and rejoins at
/// the checkpoint of step 24. Each stretch equals a run resumed at that layout from the same
/// state, bit for bit. A slowed rank is named as a straggler.
#[test]
fn an_elastic_run_shrinks_past_a_lost_rank_grows_back_and_names_a_straggler() {
    let d = scratch("elastic");
    let data = corpus(&d);
    let batch = ["--set", "train.batch_size=12", "--set", "sample.tokens=0", "--set", "checkpoint.interval=8"];
    let run = |out: &Path, extra: &[&str]| {
        let o = train(&data, out, &[&batch[..], extra].concat());
        assert!(o.status.success(), "{}: {}", out.display(), stderr(&o));
    };
    let el = d.join("elastic");
    let lose = ["--dp", "4", "--elastic", "3:4", "--set", "checkpoint.memory_interval=4", "--set", "faults.fail_ranks=[1]", "--set", "faults.fail_step=11", "--set", "faults.fail_permanent=true"];
    run(&el, &[&lose[..], &["--max-steps", "30", "--set", "faults.rejoin_step=20"]].concat());
    let f: Vec<serde_json::Value> = lines_of(&el, "fault");
    let events: Vec<&str> = f.iter().map(|v| v["event"].as_str().unwrap()).collect();
    assert_eq!(events, ["rank_lost", "world_resized", "rank_rejoined", "world_resized"], "{f:?}");
    assert_eq!((f[0]["rank"].as_u64(), f[0]["step"].as_u64()), (Some(1), Some(11)));
    let r = &f[1];
    assert_eq!((r["from"].as_u64(), r["to"].as_u64(), r["grad_accum_to"].as_u64(), r["restored_step"].as_u64(), r["lost_steps"].as_u64(), r["from_state"].as_str()), (Some(4), Some(3), Some(2), Some(8), Some(2), Some("memory")), "{r}");
    assert!(r["lost_steps"].as_u64().unwrap() < 4, "at most the in-memory snapshot interval is lost");
    assert_eq!((f[2]["ranks"].clone(), f[2]["step"].as_u64()), (serde_json::json!([1]), Some(24)));
    assert_eq!((f[3]["from"].as_u64(), f[3]["to"].as_u64(), f[3]["grad_accum_to"].as_u64(), f[3]["restored_step"].as_u64()), (Some(3), Some(4), Some(1), Some(24)), "{}", f[3]);
    // The same stretches as plain resumes: dp 4 to step 8, dp 3 (2 micro-batches) to 24, dp 4 to 30.
    let re = d.join("resumed");
    run(&re, &["--dp", "4", "--max-steps", "8"]);
    run(&re, &["--resume", "--dp", "3", "--micro-batches", "2", "--max-steps", "24"]);
    run(&re, &["--resume", "--dp", "4", "--micro-batches", "1", "--max-steps", "30"]);
    assert_eq!(losses(&el), losses(&re), "the elastic run's losses equal the resumed runs' bit for bit");
    assert_eq!(losses(&el).len(), 30);
    assert_eq!(digests(&el), digests(&re));
    // Under MPI the supervisor launches the four processes; rank 1's crash takes the world
    // down, its host does not answer the relaunch (8 s), and three processes go on from the
    // disk checkpoint of step 8; at step 24 the worker exits for rank 1 to rejoin and four go
    // on: the in-process run's losses, bit for bit.
    let mpi = d.join("mpi");
    let mut args = vec!["train", "--supervise", "--launcher", "mpirun --allow-run-as-root --oversubscribe", "--backend", "mpi", "--data", data.to_str().unwrap(), "--out", mpi.to_str().unwrap()];
    args.extend(SMALL);
    args.extend(batch);
    args.extend(["--dp", "4", "--elastic", "3:4", "--max-steps", "30", "--set", "faults.fail_ranks=[1]", "--set", "faults.fail_step=11", "--set", "faults.fail_permanent=true", "--set", "faults.rejoin_step=20", "--set", "faults.rejoin_timeout_s=8"]);
    let o = Command::new(env!("CARGO_BIN_EXE_kiln")).args(&args).env("RAYON_NUM_THREADS", "2").output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let f = lines_of(&mpi, "fault");
    let events: Vec<&str> = f.iter().map(|v| v["event"].as_str().unwrap()).collect();
    assert_eq!(events, ["worker_crashed", "rank_lost", "world_resized", "rank_rejoined", "world_resized"], "{f:?}");
    assert_eq!((f[2]["to"].as_u64(), f[2]["restored_step"].as_u64(), f[2]["lost_steps"].as_u64()), (Some(3), Some(8), Some(2)), "{}", f[2]);
    assert_eq!(losses(&mpi), losses(&el), "MPI elastic equals in-process elastic");
    assert_eq!(digests(&mpi), digests(&el));
    let o = kiln(&["runs", d.to_str().unwrap()]);
    assert!(stdout(&o).contains("events: elastic: rank 1 lost at step 11; 4 → 3 ranks at step 11 (from step 8, 2 steps lost); ranks [1] rejoined at step 24"), "{}", stdout(&o));
    // The highest-numbered rank lost: the shrunk world no longer has that number, and the
    // run goes on.
    let last = d.join("last");
    run(&last, &["--dp", "4", "--elastic", "3:4", "--max-steps", "6", "--set", "faults.fail_ranks=[3]", "--set", "faults.fail_step=3", "--set", "faults.fail_permanent=true"]);
    assert_eq!(losses(&last).len(), 6);
    // A tensor-parallel replica that loses a member is dropped whole: dp 2 × tp 2 goes on as
    // dp 1 × tp 2 (its live rank waits as a spare).
    let tp = d.join("tp");
    run(&tp, &["--dp", "2", "--tp", "2", "--set", "model.n_head=4", "--elastic", "1:2", "--max-steps", "8", "--set", "faults.fail_ranks=[3]", "--set", "faults.fail_step=6", "--set", "faults.fail_permanent=true"]);
    let r = lines_of(&tp, "fault").into_iter().find(|v| v["event"] == "world_resized").unwrap();
    assert_eq!((r["from"].as_u64(), r["to"].as_u64(), r["dp_to"].as_u64()), (Some(4), Some(2), Some(1)), "{r}");
    assert_eq!(losses(&tp).len(), 8);
    // Lost for good without elasticity, or below the minimum: the run stops, naming why.
    for (extra, needle) in [
        (&["--dp", "4", "--set", "faults.fail_ranks=[1]", "--set", "faults.fail_step=3", "--set", "faults.fail_permanent=true", "--set", "checkpoint.memory_interval=2"][..], "the run is not elastic (--elastic MIN:MAX)"),
        (&["--dp", "4", "--elastic", "4:4", "--set", "faults.fail_ranks=[1]", "--set", "faults.fail_step=3", "--set", "faults.fail_permanent=true"], "rank 1 lost for good at step 3: elastic: 3 live rank(s) hold 3 data-parallel replica(s), and no layout from 3 down to the minimum 4"),
    ] {
        let o = train(&data, &d.join("stops"), &[&batch[..], extra, &["--max-steps", "6"]].concat());
        assert!(!o.status.success() && stderr(&o).contains(needle), "{}", stderr(&o));
        std::fs::remove_dir_all(d.join("stops")).unwrap();
    }
    for (extra, needle) in [(&["--elastic", "0:2"][..], "--elastic: `0:2`"), (&["--dp", "4", "--elastic", "1:2"], "parallel.dp = 4 is outside it")] {
        assert_user_error(&train(&data, &d.join("bad"), &[&batch[..], extra].concat()), &[needle]);
        assert!(!d.join("bad").exists());
    }
    // A rank whose compute takes 3× as long is named within the window (5 steps).
    let slow = d.join("slow");
    run(&slow, &["--dp", "2", "--max-steps", "12", "--set", "faults.straggler_ratio=1.3", "--set", "faults.straggler_steps=5", "--set", "faults.slow_ranks=[1]", "--set", "faults.slow_factor=3"]);
    let s = lines_of(&slow, "fault");
    assert!(s.iter().any(|v| v["event"] == "straggler" && v["rank"] == 1 && v["step"].as_u64().unwrap() <= 10), "{s:?}");
    assert!(s.iter().all(|v| v["rank"] == 1), "only the slowed rank: {s:?}");
    let line = &lines_of(&slow, "train")[0];
    assert_eq!(line["rank_compute_s"].as_array().unwrap().len(), 2, "{line}");
}
