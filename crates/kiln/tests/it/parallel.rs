//! Data parallel and ZeRO through `kiln train --dp N --zero Z` (in-process ranks): every
//! strategy against one rank.

use crate::common::*;
use std::path::Path;

/// A small model with gradient accumulation (8 sequences per step, 2 micro-batches of 4, so 1,
/// 2 or 4 ranks split each micro-batch).
const DP: &[&str] = &["--set", "train.batch_size=8", "--set", "train.grad_accum=2", "--set", "sample.tokens=0", "--set", "checkpoint.interval=0"];

fn run_dp(data: &Path, out: &Path, dp: usize, zero: usize, extra: &[&str]) -> std::process::Output {
    let (dp, zero) = (dp.to_string(), zero.to_string());
    let steps = if extra.contains(&"--max-steps") { vec![] } else { vec!["--max-steps", "8"] };
    let mut args = [steps, vec!["--dp", &dp, "--zero", &zero]].concat();
    args.extend_from_slice(DP);
    args.extend_from_slice(extra);
    let o = train(data, out, &args);
    assert!(o.status.success(), "dp {dp} zero {zero}: {}", stderr(&o));
    o
}

fn train_lines(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "train")
        .collect()
}

/// A run's train losses by step ([`losses`]) and its final checkpoint's digests
/// ([`final_checkpoint`]).
type LossesAndDigests = (Vec<(u64, f64)>, (String, String));

/// The final checkpoint's layout-independent digests (parameters, optimizer state); with
/// several ranks it is written in per-rank parts.
fn final_checkpoint(run: &Path) -> (String, String) {
    let dir = run.join("checkpoints/step-00000008");
    let o = kiln(&["checkpoint", "inspect", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    (v["params_sha256"].as_str().unwrap().to_string(), v["optimizer_sha256"].as_str().unwrap().to_string())
}

#[test]
fn every_dp_and_zero_stage_matches_one_rank() {
    let d = scratch("dp-equiv");
    let data = corpus(&d);
    // Dropout on: each rank draws the masks of its own sequences of the global batch.
    let drop = ["--set", "model.dropout=0.1"];
    let one = d.join("dp1z0");
    run_dp(&data, &one, 1, 0, &drop);
    let base = losses(&one);
    assert_eq!(base.len(), 8);
    for dp in [1, 2, 4] {
        // Stages 0–1 accumulate micro-batches in one full gradient buffer, stages 2–3 reduce
        // each micro-batch and add the reduced shards: the same order within each pair.
        let mut first: [Option<LossesAndDigests>; 2] = [None, None];
        for zero in 0..=3 {
            let out = d.join(format!("dp{dp}z{zero}"));
            if !(dp == 1 && zero == 0) {
                run_dp(&data, &out, dp, zero, &drop);
            }
            let ls = losses(&out);
            for ((s, a), (_, b)) in ls.iter().zip(&base) {
                assert!(((a - b) / b).abs() <= 1e-6, "dp {dp} zero {zero} step {s}: loss {a} vs one rank {b}");
            }
            // At one dp degree the reduction order is the same at every stage: bit-identical
            // losses, parameters and moments.
            let ck = final_checkpoint(&out);
            match &first[zero / 2] {
                None => first[zero / 2] = Some((ls, ck)),
                Some((l0, c0)) => {
                    assert_eq!(&ls, l0, "dp {dp}: zero {zero} losses differ from zero {}", zero - 1);
                    assert!(ck == *c0, "dp {dp}: zero {zero} final checkpoint differs from zero {}", zero - 1);
                }
            }
        }
    }
}

#[test]
fn a_checkpoint_of_a_sharded_run_resumes_on_any_layout() {
    // Checkpoints hold full tensors, so a ZeRO-3 run on 4 ranks resumes on 1 rank (and back)
    // and continues as the uninterrupted run does.
    let d = scratch("dp-reshard");
    let data = corpus(&d);
    let straight = d.join("straight");
    run_dp(&data, &straight, 1, 0, &[]);
    let split = d.join("split");
    run_dp(&data, &split, 4, 3, &["--max-steps", "4", "--set", "checkpoint.interval=4"]);
    // Each of the 4 ranks wrote its part of every tensor.
    for r in 0..4 {
        for kind in ["model", "optimizer"] {
            assert!(split.join(format!("checkpoints/step-00000004/{kind}-{r:05}-of-00004.safetensors")).exists());
        }
    }
    let o = train(&data, &split, &[&["--resume", "--max-steps", "8", "--dp", "2", "--zero", "1"], DP].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let (a, b) = (losses(&straight), losses(&split));
    assert_eq!(a.len(), b.len());
    for ((s, x), (_, y)) in a.iter().zip(&b) {
        assert!(((x - y) / y).abs() <= 1e-6, "step {s}: {x} vs {y}");
    }
}

#[test]
fn communication_volume_and_memory_follow_theory() {
    let d = scratch("dp-volume");
    let data = corpus(&d);
    let n = 4.0;
    let mut psi = 0.0;
    let mut first = None;
    for zero in 0..=3 {
        let out = d.join(format!("z{zero}"));
        run_dp(&data, &out, 4, zero, &["--set", "train.grad_accum=1", "--set", "train.batch_size=4"]);
        let line = &train_lines(&out)[3];
        let get = |k: &str| line[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {line}"));
        if zero == 0 {
            psi = get("mem_params_bytes") / 4.0;
        }
        // Bytes sent per step: a ring all-reduce moves 2(N−1)/N of the gradient bytes; ZeRO-1/2
        // the same (reduce-scatter + all-gather); ZeRO-3 1.5× (two gathers + a reduce-scatter).
        let ring = 2.0 * (n - 1.0) / n * 4.0 * psi;
        let theory = if zero == 3 { 1.5 * ring } else { ring };
        let sent = get("comm_bytes_sent");
        assert!((sent / theory - 1.0).abs() < 0.05, "zero {zero}: sent {sent} vs theory {theory}");
        // Per collective: stage 0 all-reduces; 1–2 reduce-scatter gradients and all-gather
        // parameters (half each); 3 all-gathers twice as much as it reduce-scatters.
        let op = |k: &str| line[format!("comm_bytes_sent_{k}")].as_f64().unwrap_or(0.0);
        let (ar, rs, ag) = (op("all_reduce"), op("reduce_scatter"), op("all_gather"));
        match zero {
            0 => assert!((ar / ring - 1.0).abs() < 0.05, "{line}"),
            1 | 2 => assert!((rs / (ring / 2.0) - 1.0).abs() < 0.05 && (ag / (ring / 2.0) - 1.0).abs() < 0.05, "{line}"),
            _ => assert!((rs / (ring / 2.0) - 1.0).abs() < 0.05 && (ag / ring - 1.0).abs() < 0.05, "{line}"),
        }
        // Model-state bytes per rank (fp32): 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N.
        let held = get("mem_params_bytes") + get("mem_grads_bytes") + get("mem_optim_bytes");
        let formula = match zero {
            0 => 16.0 * psi,
            1 => 8.0 * psi + 8.0 * psi / n,
            2 => 4.0 * psi + 12.0 * psi / n,
            _ => 16.0 * psi / n,
        };
        assert!((held / formula - 1.0).abs() < 0.10, "zero {zero}: held {held} vs formula {formula}");
        let hidden = get("comm_hidden_fraction");
        assert!((0.0..=1.0).contains(&hidden), "{hidden}");
        // Without accumulation every stage reduces in the same order: bit-identical results.
        let ck = final_checkpoint(&out);
        match &first {
            None => first = Some(ck),
            Some(c0) => assert!(ck == *c0, "zero {zero} final checkpoint differs from zero 0 (no accumulation)"),
        }
    }
}

#[test]
fn bad_parallel_settings_are_user_errors() {
    let d = scratch("dp-bad");
    let data = corpus(&d);
    let o = train(&data, &d.join("a"), &["--dp", "3"]);
    assert_user_error(&o, &["parallel.dp = 3 does not divide the micro-batch", "train.batch_size 4"]);
    let o = train(&data, &d.join("b"), &["--zero", "4"]);
    assert_user_error(&o, &["parallel.zero must be 0, 1, 2 or 3, got 4"]);
    let o = train(&data, &d.join("c"), &["--backend", "nccl"]);
    assert_user_error(&o, &["parallel.backend must be inproc or mpi, got `nccl`"]);
    let o = train(&data, &d.join("e"), &["--dp", "0"]);
    assert_user_error(&o, &["parallel.dp must be positive"]);
    #[cfg(not(feature = "mpi"))]
    {
        let o = train(&data, &d.join("f"), &["--backend", "mpi"]);
        assert_user_error(&o, &["built without MPI support", "--features mpi"]);
    }
    for x in ["a", "b", "c", "e"] {
        assert!(!d.join(x).exists(), "a bad config must not create the run directory {x}");
    }
}

/// `mpirun -n N kiln train --backend mpi`: one process per rank gives what N in-process ranks
/// give, bit for bit (the MPI backend sums in the same rank order; each process gets the same
/// thread count as the in-process pool, since the matmul tiling follows the thread count).
#[cfg(feature = "mpi")]
#[test]
fn mpi_processes_match_in_process_ranks() {
    let d = scratch("dp-mpi");
    let data = corpus(&d);
    // (processes, dp, tp, zero, more): plain dp, ZeRO-3, a composed dp 2 × tp 2 layout, and
    // context parallelism (ring attention's point-to-point blocks) beside dp.
    for (n, dp, tp, zero, more) in [(2, 2, 1, 0, &[][..]), (4, 4, 1, 3, &[]), (4, 2, 2, 1, &[]), (4, 2, 1, 0, &["--cp", "2", "--set", "model.dropout=0.1"])] {
        let tp_args: Vec<&str> = if tp > 1 { [&["--tp", "2"], TP].concat() } else { more.to_vec() };
        let inproc = d.join(format!("inproc{n}-tp{tp}{}", more.join("")));
        run_dp(&data, &inproc, dp, zero, &tp_args);
        let mpi = d.join(format!("mpi{n}-tp{tp}{}", more.join("")));
        let mut args: Vec<String> = ["--allow-run-as-root", "--oversubscribe", "-n", &n.to_string(), env!("CARGO_BIN_EXE_kiln"), "train", "--data"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend([data.display().to_string(), "--out".into(), mpi.display().to_string(), "--backend".into(), "mpi".into(), "--dp".into(), "0".into(), "--zero".into(), zero.to_string(), "--max-steps".into(), "8".into()]);
        args.extend(SMALL.iter().chain(DP).chain(&tp_args).map(|s| s.to_string()));
        let o = std::process::Command::new("mpirun").args(&args).env("RAYON_NUM_THREADS", "2").output().expect("mpirun (install openmpi-bin)");
        assert!(o.status.success(), "mpirun -n {n}: {}", stderr(&o));
        assert_eq!(losses(&mpi), losses(&inproc), "mpi {n} ranks zero {zero}");
        assert!(final_checkpoint(&mpi) == final_checkpoint(&inproc), "mpi {n}: final checkpoint differs from in-process");
    }
    // A composed pipeline × tensor-parallel layout: 2 stages × 2 shards on 4 processes.
    let pp_args: Vec<&str> = [&["--pp", "2", "--tp", "2", "--micro-batches", "2", "--schedule", "1f1b", "--set", "model.n_layer=2"][..], TP].concat();
    let inproc = d.join("inproc-pp2-tp2");
    run_dp(&data, &inproc, 1, 0, &pp_args);
    let mpi = d.join("mpi-pp2-tp2");
    let mut args: Vec<String> = ["--allow-run-as-root", "--oversubscribe", "-n", "4", env!("CARGO_BIN_EXE_kiln"), "train", "--data"].iter().map(|s| s.to_string()).collect();
    args.extend([data.display().to_string(), "--out".into(), mpi.display().to_string(), "--backend".into(), "mpi".into(), "--dp".into(), "0".into(), "--max-steps".into(), "8".into()]);
    args.extend(SMALL.iter().chain(DP).chain(&pp_args).map(|s| s.to_string()));
    let o = std::process::Command::new("mpirun").args(&args).env("RAYON_NUM_THREADS", "2").output().expect("mpirun");
    assert!(o.status.success(), "mpirun pp2 × tp2: {}", stderr(&o));
    assert_eq!(losses(&mpi), losses(&inproc), "mpi pp2 × tp2");
    assert!(final_checkpoint(&mpi) == final_checkpoint(&inproc), "mpi pp2 × tp2: final checkpoint differs from in-process");
    // A world size that does not match --dp is a user error on every rank.
    let o = std::process::Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-n", "2", env!("CARGO_BIN_EXE_kiln"), "train", "--data", data.to_str().unwrap(), "--out"])
        .arg(d.join("bad"))
        .args(["--backend", "mpi", "--dp", "4", "--quiet"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("parallel.dp = 4 but mpirun started 2 processes"), "{}", stderr(&o));
    assert!(!d.join("bad").exists());
}

#[test]
fn a_two_rank_trace_shows_both_ranks_compute_and_communication() {
    let d = scratch("dp-trace");
    let data = corpus(&d);
    let out = d.join("run");
    // Small buckets, so gradients are reduced in several buckets during backward.
    let o = train(&data, &out, &["--max-steps", "4", "--profile", "2", "--dp", "2", "--zero", "0", "--set", "parallel.bucket_mb=0.001"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("trace.json")).unwrap()).unwrap();
    let ev = v["traceEvents"].as_array().unwrap();
    let spans: Vec<&serde_json::Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
    for e in &spans {
        assert!(e["name"].is_string() && e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() >= 0.0, "{e}");
        assert!(e["pid"].is_u64() && e["tid"].is_u64(), "{e}");
    }
    let meta = |kind: &str, name: &str| ev.iter().any(|e| e["ph"] == "M" && e["name"] == kind && e["args"]["name"] == name);
    for r in 0..2u64 {
        assert!(meta("process_name", &format!("rank {r}")), "process of rank {r}");
        assert!(meta("thread_name", &format!("rank{r}")) && meta("thread_name", &format!("comm{r}")), "threads of rank {r}");
        let on = |n: &str| spans.iter().filter(|e| e["pid"] == r && e["name"] == n).count();
        assert_eq!(on("step"), 2, "rank {r}: two traced steps");
        for n in ["forward", "backward", "block_backward", "all_reduce bucket", "optimizer"] {
            assert!(on(n) >= 2, "rank {r}: {n} spans: {}", on(n));
        }
    }
    // At least one bucket's reduction starts before that rank's backward ends (overlap).
    let ends: Vec<f64> = spans.iter().filter(|e| e["pid"] == 0 && e["name"] == "backward").map(|e| e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap()).collect();
    let starts: Vec<f64> = spans.iter().filter(|e| e["pid"] == 0 && e["name"] == "all_reduce bucket").map(|e| e["ts"].as_f64().unwrap()).collect();
    assert!(starts.iter().any(|s| ends.iter().any(|e| s < e && e - s < 1e6)), "no reduction overlaps backward");
}

/// Tensor parallel needs whole heads per rank: 4 heads of 4 channels. Dropout on: every mask
/// (attention probabilities by whole-model head, residual branches by whole-model row) is the
/// one a single rank draws.
const TP: &[&str] = &["--set", "model.n_head=4", "--set", "model.dropout=0.1"];

#[test]
fn tensor_parallel_matches_one_rank_for_gpt2_and_llama() {
    let d = scratch("tp-equiv");
    let data = corpus(&d);
    for arch in [&["--set", "model.arch=gpt2", "--set", "model.bias=true"][..], &["--set", "model.arch=llama", "--set", "model.bias=false", "--set", "model.n_kv_head=2", "--set", "model.tied_embeddings=false"][..]] {
        let name = arch[1].replace(['=', '.'], "-");
        let extra = [TP, arch].concat();
        let one = d.join(format!("{name}-one"));
        run_dp(&data, &one, 1, 0, &extra);
        let base = losses(&one);
        let sample = std::fs::read_to_string(one.join("sample.txt")).ok();
        let layouts: &[(&str, &str, &str)] = if arch[1].ends_with("llama") { &[("1", "2", "0")] } else { &[("1", "2", "0"), ("1", "4", "0"), ("2", "2", "1")] };
        for (dp, tp, zero) in layouts {
            let out = d.join(format!("{name}-dp{dp}-tp{tp}-z{zero}"));
            let o = train(&data, &out, &[&["--max-steps", "8", "--dp", dp, "--tp", tp, "--zero", zero], DP, &extra].concat());
            assert!(o.status.success(), "{name} dp {dp} tp {tp}: {}", stderr(&o));
            let ls = losses(&out);
            assert_eq!(ls.len(), base.len());
            for ((s, a), (_, b)) in ls.iter().zip(&base) {
                assert!(((a - b) / b).abs() <= 1e-5, "{name} dp {dp} tp {tp} step {s}: loss {a} vs one rank {b}");
            }
            let g = |r: &Path| train_lines(r).last().unwrap()["grad_norm"].as_f64().unwrap();
            assert!((g(&out) / g(&one) - 1.0).abs() < 1e-5, "{name} dp {dp} tp {tp}: grad norm {} vs {}", g(&out), g(&one));
            // The checkpoint holds the whole model: it loads as one.
            let e = kiln(&["eval", "--run", out.to_str().unwrap()]);
            assert!(e.status.success(), "{}", stderr(&e));
            assert_eq!(std::fs::read_to_string(out.join("sample.txt")).ok(), sample);
        }
    }
}

#[test]
fn tensor_parallel_volume_follows_megatron() {
    // Four all-reduces of [b·s, h] per layer and micro-batch, 8·b·s·h·(t−1)/t elements sent,
    // plus two for the vocab-parallel embedding (forward) and head (input gradient); the
    // cross-entropy's per-row exchange is a small all-gather.
    let d = scratch("tp-volume");
    let data = corpus(&d);
    for tp in [2.0f64, 4.0] {
        let out = d.join(format!("tp{tp}"));
        let t = format!("{tp}");
        // b·s·h = 8192 elements: above the communicator's small-message threshold (4096), where
        // it runs the ring algorithm.
        run_dp(&data, &out, 1, 0, &[&["--tp", &t], TP, &["--set", "model.n_layer=2", "--set", "train.grad_accum=1", "--set", "model.n_embd=64"]].concat());
        let (b, s, h, layers) = (8.0, 16.0, 64.0, 2.0);
        let theory = (8.0 * layers + 4.0) * b * s * h * (tp - 1.0) / tp * 4.0;
        let line = &train_lines(&out)[2];
        let ar = line["comm_bytes_sent_all_reduce"].as_f64().unwrap();
        assert!((ar / theory - 1.0).abs() < 1e-9, "tp {tp}: all-reduce bytes {ar} vs {theory}");
        let sent = line["comm_bytes_sent"].as_f64().unwrap();
        assert!((sent / theory - 1.0).abs() < 0.05, "tp {tp}: sent {sent} vs {theory}");
    }
}

#[test]
fn bad_tensor_parallel_settings_are_user_errors() {
    let d = scratch("tp-bad");
    let data = corpus(&d);
    let o = train(&data, &d.join("a"), &["--tp", "3"]);
    assert_user_error(&o, &["parallel.tp = 3 does not divide model.n_head = 2"]);
    let o = train(&data, &d.join("c"), &["--tp", "0"]);
    assert_user_error(&o, &["parallel.tp must be positive"]);
    for x in ["a", "c"] {
        assert!(!d.join(x).exists());
    }
}

#[test]
fn a_dp2_tp2_checkpoint_resumes_on_one_rank() {
    let d = scratch("tp-reshard");
    let data = corpus(&d);
    let straight = d.join("straight");
    run_dp(&data, &straight, 1, 0, TP);
    let split = d.join("split");
    let o = train(&data, &split, &[&["--max-steps", "4", "--dp", "2", "--tp", "2", "--zero", "1"], DP, TP, &["--set", "checkpoint.interval=4"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    // The run's config says dp 2 × tp 2: resume it on one rank.
    let o = train(&data, &split, &[&["--resume", "--max-steps", "8", "--dp", "1", "--tp", "1", "--zero", "0"], DP, TP].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let (a, b) = (losses(&straight), losses(&split));
    assert_eq!(a.len(), b.len());
    for ((s, x), (_, y)) in a.iter().zip(&b) {
        assert!(((x - y) / y).abs() <= 1e-6, "step {s}: {x} vs {y}");
    }
}

#[test]
fn pp_schedule_prints_the_timeline_and_its_bubble() {
    let o = kiln(&["pp-schedule", "--pp", "4", "--micro-batches", "8", "--schedule", "interleaved", "--virtual", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert_eq!(out.lines().filter(|l| l.starts_with("rank ")).count(), 4, "{out}");
    assert!(out.contains("idle/busy 0.188") && out.contains("formula (p−1)/(v·m) = 0.188"), "{out}");
    let o = kiln(&["pp-schedule", "--pp", "4", "--micro-batches", "16", "--schedule", "gpipe", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["peak_in_flight"][0], 16);
    assert!((v["bubble"][0].as_f64().unwrap() - 3.0 / 16.0).abs() < 1e-9);
    let o = kiln(&["pp-schedule", "--pp", "4", "--micro-batches", "6", "--schedule", "interleaved", "--virtual", "2"]);
    assert_user_error(&o, &["needs micro-batches (6) divisible by the pipeline degree (4)"]);
    let o = kiln(&["pp-schedule", "--pp", "4", "--micro-batches", "6", "--schedule", "zigzag"]);
    assert_user_error(&o, &["schedule must be gpipe, 1f1b or interleaved"]);
}

/// MoE runs under data parallelism (ZeRO-3) and tensor parallelism (with sequence parallelism,
/// and dp2 × tp2), and LoRA under data parallelism, match one rank.
#[test]
fn moe_and_lora_runs_match_one_rank_under_data_parallel() {
    let d = scratch("dp-moe-lora");
    let data = corpus(&d);
    // Mixture of experts (the routing statistics and router losses ride along), ZeRO-3.
    let moe = ["--set", "model.arch=llama", "--set", "model.bias=false", "--set", "model.n_expert=4", "--set", "model.top_k=2", "--set", "model.ffn_hidden=16", "--set", "model.n_head=4", "--set", "model.n_kv_head=2"];
    let one = d.join("moe1");
    run_dp(&data, &one, 1, 0, &moe);
    let two = d.join("moe2");
    run_dp(&data, &two, 2, 3, &moe);
    for ((s, a), (_, b)) in losses(&one).iter().zip(&losses(&two)) {
        assert!(((a - b) / b).abs() <= 1e-5, "moe step {s}: {a} vs {b}");
    }
    // Tensor parallelism, with and without sequence parallelism: the experts whole on every
    // rank, the layer over every token.
    for (name, tp) in [("moe-tp2", &["--tp", "2"][..]), ("moe-tp2-sp", &["--tp", "2", "--sequence-parallel"]), ("moe-dp2-tp2", &["--tp", "2", "--dp", "2"])] {
        let out = d.join(name);
        let o = train(&data, &out, &[&["--max-steps", "8"], DP, &moe[..], tp].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        assert_close(&out, &one, 1e-5, name);
    }
    // LoRA adapters on a trained base: the adapters' gradients are all-reduced.
    let base = d.join("base");
    run_dp(&data, &base, 1, 0, &[]);
    let lora = |name: &str, dp: &str| {
        let out = d.join(name);
        let o = train(&data, &out, &[&["--init-from", base.to_str().unwrap(), "--lora-rank", "2", "--max-steps", "6", "--dp", dp], DP].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        losses(&out)
    };
    let (a, b) = (lora("lora1", "1"), lora("lora2", "2"));
    assert_eq!(a.len(), 6);
    for ((s, x), (_, y)) in a.iter().zip(&b) {
        assert!(((x - y) / y).abs() <= 1e-5, "lora step {s}: {x} vs {y}");
    }
}

/// Pipelines: 4 layers, 8 sequences per step in 4 micro-batches of 2, dropout on.
const PP: &[&str] = &[
    "--set", "model.n_layer=4", "--set", "train.batch_size=8", "--micro-batches", "4", "--set", "model.dropout=0.1",
    "--set", "sample.tokens=0", "--set", "checkpoint.interval=0",
];

fn run_pp(data: &Path, out: &Path, args: &[&str]) {
    let steps: &[&str] = if args.contains(&"--max-steps") { &[] } else { &["--max-steps", "6"] };
    let o = train(data, out, &[PP, steps, args].concat());
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
}

fn assert_close(a: &Path, b: &Path, tol: f64, what: &str) {
    let (x, y) = (losses(a), losses(b));
    assert_eq!(x.len(), y.len(), "{what}");
    for ((s, p), (_, q)) in x.iter().zip(&y) {
        assert!(((p - q) / q).abs() <= tol, "{what} step {s}: loss {p} vs one rank {q}");
    }
    let g = |r: &Path| train_lines(r).last().unwrap()["grad_norm"].as_f64().unwrap();
    assert!((g(a) / g(b) - 1.0).abs() < tol, "{what}: grad norm {} vs {}", g(a), g(b));
}

#[test]
fn every_pipeline_schedule_matches_one_rank() {
    let d = scratch("pp-equiv");
    let data = corpus(&d);
    for (name, arch) in [
        ("gpt2", &["--set", "model.arch=gpt2"][..]),
        ("llama", &["--set", "model.arch=llama", "--set", "model.n_kv_head=1", "--set", "model.tied_embeddings=false"][..]),
        ("moe", &["--set", "model.arch=llama", "--set", "model.tied_embeddings=false", "--set", "model.n_expert=4", "--set", "model.top_k=2", "--set", "model.n_shared_expert=1"][..]),
    ] {
        let one = d.join(format!("{name}-one"));
        run_pp(&data, &one, arch);
        let layouts: &[&[&str]] = if name == "gpt2" {
            &[&["--pp", "2", "--schedule", "gpipe"], &["--pp", "2", "--schedule", "1f1b"], &["--pp", "2", "--schedule", "interleaved", "--virtual", "2"], &["--pp", "4", "--schedule", "1f1b"], &["--pp", "3", "--pp-layers", "1,2,1"]]
        } else {
            &[&["--pp", "2", "--schedule", "1f1b"]]
        };
        for l in layouts {
            let out = d.join(format!("{name}-{}", l.join("").replace("--", "-")));
            run_pp(&data, &out, &[arch, l].concat());
            assert_close(&out, &one, 1e-5, &format!("{name} {l:?}"));
            // The checkpoint holds the whole model: it evaluates as one.
            let e = kiln(&["eval", "--run", out.to_str().unwrap()]);
            assert!(e.status.success(), "{}", stderr(&e));
        }
    }
}

/// OLMo 2's blocks (norms after the branches, whole-width q/k norms) under ZeRO-3 data
/// parallelism, a 1F1B pipeline and ring context parallelism, and Gemma 3's (sandwich norms
/// scaling by `1 + w`, GeGLU, scaled embeddings under a tied head, local and global layers with
/// their own rotary bases) under those and tensor parallelism with sequence parallelism (the
/// norms' gradients partial per shard, the embedding vocabulary-parallel), and Gemma 2's
/// soft-capped logits under tensor parallelism (the vocabulary-parallel head) and ring and
/// Ulysses context parallelism, DeepSeek's multi-head latent attention under ZeRO-3, a
/// pipeline, both context parallelisms and tensor parallelism over its heads (with and without
/// sequence parallelism), and DeepSeek-V3's sigmoid-routed experts (with latent
/// attention, and on their own under tensor parallelism) under expert, data and pipeline
/// parallelism, each against one rank with dropout on.
#[test]
fn norms_after_the_branches_match_one_rank_on_every_layout() {
    let d = scratch("post-norm-layouts");
    let data = corpus(&d);
    let llama: &[&str] = &["--set", "model.arch=llama", "--set", "model.n_head=2", "--set", "model.n_kv_head=2", "--set", "model.tied_embeddings=false"];
    let olmo2: &[&str] = &["--set", "model.block_norms=post", "--set", "model.qk_norm=true", "--set", "model.qk_norm_whole=true"];
    let gemma3: &[&str] = &[
        "--set", "model.block_norms=sandwich", "--set", "model.gate_act=gelu_tanh", "--set", "model.norm_offset=true", "--set", "model.embed_scale=true",
        "--set", "model.qk_norm=true", "--set", "model.query_pre_attn_scalar=12", "--set", "model.sliding_window=5", "--set", "model.window_layers=[0, 1, 3]",
        "--set", "model.rope_local_theta=100", "--set", "model.tied_embeddings=true",
    ];
    // DeepSeek's multi-head latent attention (q's latent, interleaved rotary pairs).
    let mla: &[&str] = &[
        "--set", "model.head_dim=12", "--set", "model.rotary_dim=4", "--set", "model.v_head_dim=6",
        "--set", "model.kv_lora_rank=12", "--set", "model.q_lora_rank=16", "--set", "model.rope_interleave=true",
    ];
    // DeepSeek-V3's routed experts after a dense layer: the sigmoid router over groups, scaled
    // gates, a shared expert, the correction bias moved every step by the step's loads (summed
    // over the micro-batches and ranks, so every layout moves it alike).
    let sigmoid: &[&str] = &[
        "--set", "model.n_expert=8", "--set", "model.top_k=2", "--set", "model.n_shared_expert=1", "--set", "model.ffn_hidden=16",
        "--set", "model.moe_router=sigmoid", "--set", "model.moe_groups=4", "--set", "model.moe_topk_groups=2", "--set", "model.moe_gate_scale=2.5",
        "--set", "model.moe_aux_weight=0", "--set", "model.moe_z_weight=0", "--set", "model.moe_first_layer=1", "--set", "model.dense_ffn_hidden=32",
        "--set", "model.moe_bias_rate=0.01",
    ];
    // Gemma 2's soft-capped attention and output logits (on Gemma 3's block: the caps bind).
    let gemma2: &[&str] = &["--set", "model.attn_softcap=0.9", "--set", "model.final_softcap=1.5"];
    for (name, norms, layouts) in [
        ("olmo2", olmo2, &[&["--dp", "2", "--zero", "3"][..], &["--pp", "2", "--schedule", "1f1b"], &["--cp", "2"]][..]),
        ("gemma3", gemma3, &[&["--tp", "2", "--sequence-parallel"][..], &["--pp", "2", "--schedule", "1f1b"], &["--cp", "2"], &["--dp", "2", "--zero", "3"]]),
        ("gemma2", &[gemma3, gemma2].concat(), &[&["--tp", "2"][..], &["--cp", "2"], &["--cp", "2", "--cp-mode", "ulysses"]]),
        ("mla", mla, &[&["--dp", "2", "--zero", "3"][..], &["--pp", "2", "--schedule", "1f1b"], &["--cp", "2"], &["--cp", "2", "--cp-mode", "ulysses"], &["--tp", "2"], &["--tp", "2", "--sequence-parallel"]]),
        ("deepseek-v3", &[mla, sigmoid].concat(), &[&["--ep", "2"][..], &["--dp", "2", "--zero", "1"], &["--pp", "2", "--schedule", "1f1b"], &["--tp", "2", "--sequence-parallel"]]),
        ("sigmoid-router", sigmoid, &[&["--tp", "2", "--sequence-parallel"][..], &["--ep", "2"], &["--dp", "2", "--zero", "2"]]),
    ] {
        let one = d.join(format!("{name}-one"));
        run_pp(&data, &one, &[llama, norms].concat());
        for l in layouts {
            let out = d.join(format!("{name}-{}", l.join("").replace("--", "-")));
            run_pp(&data, &out, &[llama, norms, l].concat());
            assert_close(&out, &one, 1e-5, &format!("{name} {l:?}"));
        }
    }
}

#[test]
fn dp2_tp2_pp2_on_eight_ranks_matches_one_rank() {
    let d = scratch("pp-composed");
    let data = corpus(&d);
    let one = d.join("one");
    run_pp(&data, &one, &[TP, &["--set", "model.dropout=0"]].concat());
    for (zero, sched) in [("1", "1f1b"), ("3", "interleaved")] {
        let out = d.join(format!("z{zero}-{sched}"));
        let mut args = vec!["--dp", "2", "--tp", "2", "--pp", "2", "--zero", zero, "--schedule", sched, "--set", "model.dropout=0"];
        if sched == "interleaved" {
            args.extend(["--virtual", "2"]);
        }
        run_pp(&data, &out, &[TP, &args].concat());
        assert_close(&out, &one, 1e-5, &format!("dp2 tp2 pp2 zero {zero} {sched}"));
    }
}

#[test]
fn a_pipeline_checkpoint_resumes_on_one_rank() {
    let d = scratch("pp-reshard");
    let data = corpus(&d);
    let straight = d.join("straight");
    run_pp(&data, &straight, &["--set", "model.dropout=0"]);
    let split = d.join("split");
    run_pp(&data, &split, &["--pp", "2", "--tp", "2", "--set", "model.dropout=0", "--set", "checkpoint.interval=3", "--max-steps", "3"]);
    let o = train(&data, &split, &[PP, &["--resume", "--max-steps", "6", "--pp", "1", "--tp", "1", "--set", "model.dropout=0"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_close(&split, &straight, 1e-6, "pp2 tp2 → one rank");
}

#[test]
fn pipeline_trace_memory_and_volume_follow_the_schedule() {
    let d = scratch("pp-trace");
    let data = corpus(&d);
    let (p, m) = (2usize, 4usize);
    let mut peak = Vec::new();
    for sched in ["gpipe", "1f1b"] {
        let out = d.join(sched);
        run_pp(&data, &out, &["--pp", "2", "--schedule", sched, "--pp-trace", "device"]);
        let steps: Vec<serde_json::Value> = std::fs::read_to_string(out.join("pipeline/rank-000.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(steps.len(), 6);
        let s = &steps[5];
        let tasks = s["tasks"].as_array().unwrap();
        assert_eq!(tasks.len(), 2 * m, "{s}");
        // Device clock: tasks in order, never overlapping, and idle at least the fill and drain.
        let mut end = 0.0;
        for t in tasks {
            let (a, b) = (t["dev_start"].as_f64().unwrap(), t["dev_end"].as_f64().unwrap());
            assert!(a >= end && b > a, "{t}");
            end = b;
        }
        let bubble = s["bubble"].as_f64().unwrap();
        assert!(bubble >= 0.0 && bubble.is_finite(), "{s}");
        // Stage 0 holds every micro-batch under GPipe, at most p under 1F1B.
        let in_flight = s["peak_in_flight"].as_u64().unwrap() as usize;
        assert_eq!(in_flight, if sched == "gpipe" { m } else { p }, "{sched}");
        peak.push(s["peak_activation_bytes"].as_f64().unwrap());
        // Bytes sent by stage 0 per step: one [b, s, h] activation per micro-batch (b = 2
        // sequences, s = 16, h = 16), exactly, and (tracing) each one's 8-byte clock stamp.
        let line = &train_lines(&out)[5];
        assert_eq!(line["comm_bytes_sent_send_recv"].as_f64().unwrap(), (m * (2 * 16 * 16 * 4 + 8)) as f64, "{line}");
        assert_eq!(line["pp_peak_in_flight"].as_u64().unwrap() as usize, in_flight);
    }
    assert!((peak[0] / peak[1] - (m / p) as f64).abs() < 1e-9, "GPipe holds m/p times 1F1B's activations: {peak:?}");
}

#[test]
fn bad_pipeline_settings_are_user_errors() {
    let d = scratch("pp-bad");
    let data = corpus(&d);
    let cases: &[(&[&str], &[&str])] = &[
        (&["--pp", "0"], &["parallel.pp must be positive"]),
        (&["--pp", "3"], &["3 pipeline stages need at least 3 layers", "model.n_layer"]),
        (&["--pp", "2", "--set", "model.n_layer=4", "--pp-layers", "1,2"], &["parallel.pp_layers = [1, 2]", "adding up to model.n_layer = 4"]),
        (&["--pp", "2", "--set", "model.n_layer=2", "--pp-layers", "1,x"], &["--pp-layers: `x` is not a layer count"]),
        (&["--pp", "2", "--set", "model.n_layer=2", "--virtual", "2"], &["--virtual 2 needs the interleaved schedule"]),
        (&["--pp", "2", "--set", "model.n_layer=4", "--schedule", "interleaved", "--virtual", "2", "--set", "train.batch_size=6", "--micro-batches", "3"], &["micro-batches (3) divisible by the pipeline degree (2)"]),
        (&["--pp", "2", "--set", "model.n_layer=2", "--schedule", "zigzag"], &["parallel.schedule", "gpipe, 1f1b or interleaved, got `zigzag`"]),
        (&["--pp", "2", "--set", "model.n_layer=2", "--dp", "2", "--pp-trace", "device"], &["parallel.pp_trace = device", "parallel.dp = 1"]),
        (&["--pp", "2", "--set", "model.n_layer=2", "--pp-trace", "gpu"], &["parallel.pp_trace must be off, wall or device"]),
    ];
    for (i, (args, needles)) in cases.iter().enumerate() {
        let out = d.join(format!("c{i}"));
        let o = train(&data, &out, args);
        assert_user_error(&o, needles);
        assert!(!out.exists(), "a bad config must not create the run directory ({args:?})");
    }
}

#[test]
fn sequence_parallel_matches_one_rank_and_moves_what_tensor_parallel_moves() {
    let d = scratch("sp-equiv");
    let data = corpus(&d);
    let one = d.join("one");
    let shape = ["--set", "model.n_layer=2", "--set", "model.n_embd=64", "--set", "train.grad_accum=1"];
    run_dp(&data, &one, 1, 0, &[TP, &shape].concat());
    // Two micro-batches draw other dropout masks than one: the pipeline is compared with one
    // rank accumulating two.
    let one2 = d.join("one-accum2");
    run_dp(&data, &one2, 1, 0, &[TP, &shape, &["--set", "train.grad_accum=2"]].concat());
    for (tp, extra) in [("2", &[][..]), ("4", &[][..]), ("2", &["--pp", "2", "--micro-batches", "2", "--set", "train.grad_accum=2"][..]), ("2", &["--dp", "2", "--zero", "2"][..])] {
        let out = d.join(format!("sp-tp{tp}-{}", extra.join("")));
        let o = train(&data, &out, &[&["--max-steps", "8", "--tp", tp, "--sequence-parallel"], DP, TP, &shape, extra].concat());
        assert!(o.status.success(), "tp {tp} {extra:?}: {}", stderr(&o));
        let reference = if extra.contains(&"--pp") { &one2 } else { &one };
        assert_close(&out, reference, 1e-5, &format!("sequence parallel tp {tp} {extra:?}"));
        if extra.is_empty() {
            // The all-reduces become reduce-scatters and all-gathers of the same bytes: per layer
            // 4 of each of [b·s, h]·(t−1)/t (2 forward, 2 backward), plus one each for the
            // embedding and the head.
            let t: f64 = tp.parse().unwrap();
            let (b, s, h, layers) = (8.0, 16.0, 64.0, 2.0);
            let unit = b * s * h * (t - 1.0) / t * 4.0;
            let line = &train_lines(&out)[2];
            let op = |k: &str| line[format!("comm_bytes_sent_{k}")].as_f64().unwrap_or(0.0);
            assert!((op("reduce_scatter") / ((4.0 * layers + 2.0) * unit) - 1.0).abs() < 1e-9, "tp {tp}: {line}");
            assert!((op("all_gather") / ((4.0 * layers + 2.0) * unit) - 1.0).abs() < 0.02, "tp {tp}: {line}");
            // Left as an all-reduce: the norms' gradients (2 per layer and the final one, of h
            // each, no biases), summed over the shards — 320 floats, below the communicator's
            // small-message threshold, where each rank sends its buffer to the t − 1 others.
            let norms = (2.0 * layers + 1.0) * h * 4.0 * (t - 1.0);
            assert_eq!(op("all_reduce"), norms, "tp {tp}: {line}");
        }
    }
    let o = train(&data, &d.join("bad1"), &["--sequence-parallel"]);
    assert_user_error(&o, &["parallel.sequence_parallel needs tensor parallelism"]);
    let o = train(&data, &d.join("bad2"), &[&["--tp", "2", "--sequence-parallel", "--set", "model.block_size=15"], TP].concat());
    assert_user_error(&o, &["parallel.tp = 2 does not divide the sequence length train.seq_len = 15"]);
    assert!(!d.join("bad1").exists() && !d.join("bad2").exists());
}

/// Communication compression. 1-bit Adam (`parallel.compression = onebit_adam`):
/// after the warm-up, a step's data-parallel traffic is the momentum's signs (about 32× fewer
/// bytes than the gradients' all-reduce, as the planner models it). PowerSGD (`powersgd`): the
/// gradient matrices travel as rank-2 factors. 0/1 Adam (`zero_one_adam`): its 1-bit steps and
/// syncs send a fraction of a variance step's bytes and its local steps next to nothing. Each
/// compressor's state is checkpointed (0/1 Adam's with each rank's own parameters and
/// momentum), so a
/// resumed run continues bit for bit, in process and under MPI (which equals the in-process run).
#[test]
fn compressed_data_parallel_sends_fewer_bytes_and_resumes_exactly() {
    let d = scratch("onebit");
    let data = corpus(&d);
    // 0/1 Adam: warm-up 3, then variance steps at 4, 5, 7, 9 with 1-bit gradients at 6 and 8,
    // local steps from 10 syncing at 10, 11, 13, 17 (step 12, where it resumes, is unsynced:
    // each rank has its own parameters and momentum).
    let zeroone = ["--set", "parallel.compression=zero_one_adam", "--set", "parallel.compression_warmup=3", "--set", "parallel.zeroone.var_freeze_step=9", "--set", "parallel.zeroone.var_update_scaler=2", "--set", "parallel.zeroone.local_step_scaler=2", "--set", "parallel.zeroone.local_step_clipper=4"];
    for (name, how) in [("onebit", &["--set", "parallel.compression=onebit_adam", "--set", "parallel.compression_warmup=5"][..]), ("powersgd", &["--set", "parallel.compression=powersgd", "--set", "parallel.powersgd_rank=2", "--set", "parallel.compression_warmup=5"]), ("zeroone", &zeroone)] {
        let ob = [&["--set", "train.batch_size=8", "--set", "sample.tokens=0", "--dp", "4"][..], how].concat();
        let run = |out: &Path, extra: &[&str]| {
            let o = train(&data, out, &[&ob[..], extra].concat());
            assert!(o.status.success(), "{name}: {}", stderr(&o));
        };
        let straight = d.join(format!("{name}-straight"));
        run(&straight, &["--max-steps", "20", "--set", "checkpoint.interval=0"]);
        let lines = train_lines(&straight);
        let bytes = |s: usize| lines[s - 1]["comm_bytes_sent"].as_u64().unwrap();
        assert!(lines.iter().all(|l| l["loss"].as_f64().unwrap().is_finite()), "{name}");
        if name == "onebit" {
            assert!(bytes(3) > 20 * bytes(10), "warm-up step {} bytes, compressed step {}", bytes(3), bytes(10));
            // The planner's model of the compressed traffic is what the counters measure
            // (the all-gathers also carry the step's few scalar reductions: loss, counts, norm).
            let l = &lines[9];
            let psi = l["mem_params_bytes"].as_f64().unwrap() / 4.0;
            let op = |k: &str| l[format!("comm_bytes_sent_{k}")].as_f64().unwrap_or(0.0);
            let phase = 3.0 / 4.0 * plan::cost::onebit_buffer_bytes(psi, 4);
            assert_eq!(op("all_to_all"), phase, "{l}");
            assert!(op("all_gather") >= phase && op("all_gather") <= phase + 128.0, "{l}");
        } else if name == "zeroone" {
            // A 1-bit gradient step and a sync send about 32× fewer bytes than a variance step;
            // an unsynced local step sends only the step's scalar reductions.
            for s in [6, 8, 10, 13] {
                assert!(bytes(2) > 20 * bytes(s), "variance step {} bytes, step {s} {}", bytes(2), bytes(s));
            }
            assert!(bytes(7) > bytes(2) / 2, "variance step 7 sends in full: {} vs {}", bytes(7), bytes(2));
            // A sync is 1-bit Adam's exchange, as the planner charges it (every 16th step in
            // its steady state, `plan::cost::ZEROONE_SYNC_INTERVAL`).
            let l = &lines[12];
            let psi = l["mem_params_bytes"].as_f64().unwrap() / 4.0;
            assert_eq!(l["comm_bytes_sent_all_to_all"].as_f64().unwrap(), 3.0 / 4.0 * plan::cost::onebit_buffer_bytes(psi, 4), "{l}");
            for s in [12, 14, 15, 16] {
                assert!(bytes(s) == bytes(12) && bytes(s) <= 128 && bytes(10) > 8 * bytes(s), "sync {} bytes, local step {s} {}", bytes(10), bytes(s));
            }
            // The schedule's first local step skipped (a non-finite loss): the next one takes
            // the anchor. (An anchor never taken leaves the parameters at minus the moves, near
            // zero: a uniform prediction, the loss of step 1.)
            let vetoed = d.join("zeroone-vetoed");
            run(&vetoed, &["--max-steps", "12", "--set", "checkpoint.interval=0", "--set", "faults.inject_nan_steps=[10]"]);
            let a = losses(&vetoed);
            assert_eq!(a.iter().map(|l| l.0).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12]);
            assert!(a[10].1 < a[0].1 - 0.2, "after a vetoed first local step: step 12 loss {} against step 1 {}", a[10].1, a[0].1);
        } else {
            assert!(bytes(3) > 2 * bytes(10), "{name}: warm-up step {} bytes, compressed step {}", bytes(3), bytes(10));
        }
        // Resumed from the checkpoint of step 12 (past the warm-up: the state matters).
        let resumed = d.join(format!("{name}-resumed"));
        run(&resumed, &["--max-steps", "12", "--set", "checkpoint.interval=12"]);
        run(&resumed, &["--resume", "--max-steps", "20", "--set", "checkpoint.interval=0"]);
        assert_eq!(losses(&resumed), losses(&straight), "{name}: resumed with its state, bit for bit");
        // Under MPI, resumed there too.
        let mpi = d.join(format!("{name}-mpi"));
        for extra in [&["--max-steps", "12", "--set", "checkpoint.interval=12"][..], &["--resume", "--max-steps", "20", "--set", "checkpoint.interval=0"]] {
            let mut args: Vec<&str> = vec!["--allow-run-as-root", "--oversubscribe", "-n", "4", env!("CARGO_BIN_EXE_kiln"), "train", "--data", data.to_str().unwrap(), "--out", mpi.to_str().unwrap(), "--backend", "mpi"];
            args.extend(SMALL.iter().chain(&ob).chain(extra));
            let o = std::process::Command::new("mpirun").args(&args).env("RAYON_NUM_THREADS", "2").output().expect("mpirun");
            assert!(o.status.success(), "{name}: {}", stderr(&o));
        }
        assert_eq!(losses(&mpi), losses(&straight), "{name}: MPI equals in process");
    }
    let ob = ["--set", "train.batch_size=8", "--set", "sample.tokens=0", "--dp", "4", "--set", "parallel.compression=onebit_adam"];
    for (extra, needle) in [
        (&["--zero", "1"][..], "needs parallel.zero = 0"),
        (&["--set", "parallel.compression_warmup=0"], "compression_warmup must be at least 1"),
        (&["--set", "parallel.compression=twobit"], "parallel.compression"),
        (&["--set", "parallel.compression=powersgd", "--set", "parallel.powersgd_rank=0"], "parallel.powersgd_rank must be at least 1"),
        (&["--set", "parallel.compression=zero_one_adam", "--set", "parallel.zeroone.local_step_clipper=0"], "parallel.zeroone.local_step_clipper must be at least 1"),
        (&["--set", "parallel.compression=zero_one_adam", "--set", "parallel.zeroone.var_freeze_step=50"], "parallel.zeroone.var_freeze_step = 50 is before parallel.compression_warmup = 100"),
        (&["--set", "parallel.compression=zero_one_adam", "--precision", "bf16"], "zero_one_adam needs train.precision = fp32"),
    ] {
        assert_user_error(&train(&data, &d.join("bad"), &[&ob[..], extra].concat()), &[needle]);
        assert!(!d.join("bad").exists());
    }
    assert_user_error(&train(&data, &d.join("bad"), &["--set", "parallel.compression=onebit_adam"]), &["needs parallel.dp > 1"]);
}

/// ZeRO++ (`parallel.zeropp`) on ZeRO-3 over dp 4 as two nodes of two: qwZ + qgZ
/// send at least 3.5× fewer bytes than ZeRO-3 and train close to it; hpZ changes no value (its
/// backward gathers the forward's values from the node) and sends fewer bytes still; resume is
/// exact (ZeRO++ keeps no state across steps); MPI equals in process; bad settings are refused.
#[test]
fn zeropp_cuts_zero3_traffic_and_resumes_exactly() {
    let d = scratch("zeropp");
    let data = corpus(&d);
    let base = ["--set", "train.batch_size=8", "--set", "sample.tokens=0", "--dp", "4", "--zero", "3", "--set", "checkpoint.interval=0"];
    let zpp = ["--set", "parallel.zeropp.qwz=true", "--set", "parallel.zeropp.qgz=true", "--set", "parallel.zeropp.node_size=2"];
    let run = |name: &str, extra: &[&str]| -> std::path::PathBuf {
        let out = d.join(name);
        let o = train(&data, &out, &[&base[..], extra].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        out
    };
    let zero3 = run("zero3", &["--max-steps", "10"]);
    let q = run("qwz-qgz", &[&zpp[..], &["--max-steps", "10"]].concat());
    let h = run("hpz", &[&zpp[..], &["--set", "parallel.zeropp.hpz=true", "--max-steps", "10"]].concat());
    let bytes = |p: &std::path::Path| train_lines(p)[5]["comm_bytes_sent"].as_f64().unwrap();
    let (b3, bq, bh) = (bytes(&zero3), bytes(&q), bytes(&h));
    assert!(b3 >= 3.5 * bq, "ZeRO-3 {b3} bytes vs qwZ + qgZ {bq}");
    assert!(bh < bq, "hpZ {bh} bytes vs {bq}");
    assert_eq!(losses(&h), losses(&q), "hpZ gathers the forward's values");
    // The planner's model of ZeRO++'s traffic is what the counters measure (a training step's
    // gathers, the backward's inside the node, and the two all-to-alls; within the units'
    // padding, the packets' rounding and the step's scalar reductions), on a larger model.
    let wide = ["--set", "model.n_layer=2", "--set", "model.n_embd=64", "--set", "model.n_head=4", "--set", "parallel.zeropp.hpz=true", "--max-steps", "2"];
    let l = &train_lines(&run("wide", &[&zpp[..], &wide].concat()))[1];
    let psi = 4.0 * l["mem_params_bytes"].as_f64().unwrap() / 4.0;
    let z = plan::cost::zeropp_bytes(psi, 4, 2);
    let op = |k: &str| l[format!("comm_bytes_sent_{k}")].as_f64().unwrap_or(0.0);
    let (gather, a2a) = (0.75 * z.gather + 0.5 * z.gather, 0.5 * z.grad_node + 0.5 * z.grad_cross);
    assert!((op("all_gather") / gather - 1.0).abs() < 0.05, "all-gather {} bytes, planned {gather}: {l}", op("all_gather"));
    assert!((op("all_to_all") / a2a - 1.0).abs() < 0.05, "all-to-all {} bytes, planned {a2a}: {l}", op("all_to_all"));
    for ((s, a), (_, b)) in losses(&q).iter().zip(&losses(&zero3)) {
        assert!(((a - b) / b).abs() < 0.02, "step {s}: ZeRO++ {a} vs ZeRO-3 {b}");
    }
    // Resumed from step 6.
    let hz = [&zpp[..], &["--set", "parallel.zeropp.hpz=true"]].concat();
    let resumed = d.join("resumed");
    for extra in [&["--max-steps", "6", "--set", "checkpoint.interval=6"][..], &["--resume", "--max-steps", "10"]] {
        let o = train(&data, &resumed, &[&base[..], &hz, extra].concat());
        assert!(o.status.success(), "{}", stderr(&o));
    }
    assert_eq!(losses(&resumed), losses(&h), "resumed, bit for bit");
    // Under MPI.
    let mpi = d.join("mpi");
    let mut args: Vec<&str> = vec!["--allow-run-as-root", "--oversubscribe", "-n", "4", env!("CARGO_BIN_EXE_kiln"), "train", "--data", data.to_str().unwrap(), "--out", mpi.to_str().unwrap(), "--backend", "mpi", "--max-steps", "10"];
    args.extend(SMALL.iter().chain(&base).chain(&hz));
    let o = std::process::Command::new("mpirun").args(&args).env("RAYON_NUM_THREADS", "2").output().expect("mpirun");
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(losses(&mpi), losses(&h), "MPI equals in process");
    for (extra, needle) in [
        (&["--zero", "2"][..], "needs parallel.zero = 3"),
        (&["--zero", "3", "--set", "parallel.zeropp.node_size=3"], "node_size = 3 does not divide parallel.dp = 4"),
        (&["--zero", "3", "--set", "parallel.zeropp.qgz_bits=2"], "qgz_bits must be 4 or 8"),
        (&["--zero", "3", "--elastic", "2:4"], "--elastic with parallel.zeropp.node_size = 2"),
    ] {
        assert_user_error(&train(&data, &d.join("bad"), &[&["--dp", "4"][..], &zpp, extra].concat()), &[needle]);
        assert!(!d.join("bad").exists());
    }
}
