//! `--device`: parsing, the refusals (a device that is not there; what does not run on a device
//! yet), `kiln doctor`'s GPU lines, `kiln bench --kernels`, and training on the device against
//! the CPU (losses step for step, checkpoints moving between the two) on the first adapter
//! (lavapipe in CI).
use crate::common::{assert_user_error, corpus, fixture, kiln, scratch, stderr, stdout};
use std::collections::BTreeMap;
use std::path::Path;

#[test]
fn device_flags_are_checked_and_refusals_are_one_line_with_exit_2() {
    let dir = scratch("device-flags");
    let data = corpus(&dir);
    let out = dir.join("run");
    let base = ["train", "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--max-steps", "1"];
    for (device, says) in [
        ("gpu", "expected cpu, vulkan, vulkan:N, cuda or cuda:N, got `gpu`"),
        ("vulkan:99", "--device vulkan:99: no such adapter; found vulkan:0 "),
        ("vulkan", "the device does not run FP8 storage (train.precision = fp8) yet"),
    ] {
        let o = kiln(&[&base[..], &["--precision", "fp8", "--device", device]].concat());
        assert_eq!(o.status.code(), Some(2), "--device {device}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "--device {device}: {}", stderr(&o));
        assert!(!out.exists(), "--device {device} wrote a run directory");
    }
    // NCCL's collectives are for CUDA devices.
    let o = kiln(&[&base[..], &["--device", "vulkan", "--dp", "2", "--set", "parallel.nccl=true"]].concat());
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("parallel.nccl = true: NCCL runs on CUDA devices (train.device = vulkan"), "{}", stderr(&o));
    assert!(!out.exists(), "a refused NCCL run wrote its run directory");
    let o = kiln(&[&base[..], &["--set", "parallel.nccl=true"]].concat());
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("parallel.nccl = true: NCCL runs on CUDA devices (train.device = cpu)"), "{}", stderr(&o));
    // CUDA where the NVIDIA driver is missing (or the backend is not built): one line naming
    // what is missing, exit 2, nothing written. (Where `kiln doctor` lists a CUDA device, the
    // run gets past the device check.)
    let doctor = stdout(&kiln(&["doctor"]));
    let has_cuda = doctor.lines().any(|l| l.starts_with("cuda:") && l.contains("compute capability"));
    for cmd in [&["train", "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--max-steps", "1", "--device", "cuda:0"][..], &["bench", "--kernels", "--device", "cuda", "--steps", "1"]] {
        let o = kiln(cmd);
        let says = if cfg!(feature = "cuda") { "--device cuda:0: no CUDA driver: libcuda.so.1 (the NVIDIA driver) could not be opened" } else { "built without the CUDA backend" };
        if has_cuda {
            assert!(!stderr(&o).contains(says), "{cmd:?}: {}", stderr(&o));
        } else {
            assert_eq!(o.status.code(), Some(2), "{cmd:?}: {}", stderr(&o));
            assert!(stderr(&o).contains(says) && stderr(&o).lines().count() == 1, "{cmd:?}: {}", stderr(&o));
        }
    }
    assert!(!out.exists(), "a refused CUDA run wrote its run directory");
    assert!(doctor.lines().any(|l| l.starts_with("cuda:")), "{doctor}");
    // A run larger than the device may hold is refused with the plan, before it allocates.
    let o = kiln(&[&base[..], &["--device", "vulkan", "--set", "memory.device_limit=1MiB"]].concat());
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("MiB on the device") && stderr(&o).contains("over memory.device_limit = 1MiB"), "{}", stderr(&o));
    assert!(!out.exists(), "a refused device run wrote its run directory");
    // `kiln memory --device` plans the device too, and refuses past the device's limit.
    let o = kiln(&["memory", "--data", data.to_str().unwrap(), "--device", "vulkan", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert!(v["device"]["total_bytes"].as_u64().unwrap() > v["device"]["largest_buffer_bytes"].as_u64().unwrap(), "{v}");
    // Under ZeRO a rank's device holds its shard of the moments (1), of the gradients too (2),
    // and of the weights with the units it gathers (3).
    let planned = |zero: &str| {
        let o = kiln(&["memory", "--data", data.to_str().unwrap(), "--device", "vulkan", "--dp", "2", "--zero", zero, "--json"]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        v["device"]["total_bytes"].as_u64().unwrap()
    };
    let stages: Vec<u64> = ["0", "1", "2", "3"].map(planned).to_vec();
    assert!(stages.windows(2).all(|w| w[1] < w[0]), "ZeRO 0 to 3 plan {stages:?} bytes on each device");
    let o = kiln(&["memory", "--data", data.to_str().unwrap(), "--device", "vulkan", "--set", "memory.device_limit=1MiB"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("over memory.device_limit"), "{}", stderr(&o));
    // eval and generate refuse a missing adapter before reading anything.
    for cmd in ["eval", "generate"] {
        let o = kiln(&[cmd, "--run", out.to_str().unwrap(), "--device", "vulkan:99"]);
        assert_eq!(o.status.code(), Some(2), "{cmd}: {}", stderr(&o));
        assert!(stderr(&o).contains("--device vulkan:99: no such adapter"), "{cmd}: {}", stderr(&o));
    }
    // No Vulkan driver at all: the line names what to install.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["bench", "--kernels", "--device", "vulkan"])
        .env("VK_DRIVER_FILES", dir.join("none.json"))
        .env("VK_ICD_FILENAMES", dir.join("none.json"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("no Vulkan adapter found") && stderr(&o).contains("mesa-vulkan-drivers"), "{}", stderr(&o));
}

#[test]
fn doctor_lists_gpus_and_the_kernel_bench_runs_on_the_device() {
    let o = kiln(&["doctor"]);
    assert!(stdout(&o).contains("gpus:     vulkan:0  "), "{}", stdout(&o));
    let o = kiln(&["bench", "--kernels", "--device", "vulkan", "--steps", "1", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let rows = v["kernels"].as_array().unwrap();
    assert!(rows.len() >= 5);
    for r in rows {
        assert!(r["device_rate"].as_f64().unwrap() > 0.0 && r["cpu_rate"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["max_err_over_max_ref"].as_f64().unwrap() <= 1e-2, "{r}");
    }
    // Training steps on the device: only the batch's ids and targets go up, the loss and the
    // norm come back (within 1 KiB of the batch), MFU against the device's own peak.
    let o = kiln(&["bench", "--preset", "llama-tiny", "--set", "model.vocab_size=65", "--set", "train.batch_size=4", "--set", "model.block_size=64", "--set", "model.dropout=0.1", "--steps", "2", "--warmup", "1", "--device", "vulkan", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let batch = v["batch_bytes_per_step"].as_u64().unwrap();
    assert_eq!(batch, 2 * 4 * 4 * 64);
    for b in v["host_device_bytes_per_step"].as_array().unwrap() {
        let b = b.as_u64().unwrap();
        assert!(b >= batch && b <= batch + 1024, "{b} bytes a step for a {batch}-byte batch: {v}");
    }
    let mfu = v["mfu"].as_f64().unwrap();
    assert!(mfu > 0.0 && mfu <= 1.0, "{v}");
}

/// Each logged step's loss in a run's metrics.
fn losses(run: &Path) -> BTreeMap<u64, f64> {
    lines(run, "train", "loss")
}

/// `key` of each `kind` line in a run's metrics, by step.
fn lines(run: &Path, kind: &str, key: &str) -> BTreeMap<u64, f64> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|j| j["kind"] == kind)
        .map(|j| (j["step"].as_u64().unwrap(), j[key].as_f64().unwrap()))
        .collect()
}

/// Trains `preset` to `steps` on `device` into `out` (resuming it with `resume`): batch 4 of
/// 64 tokens, dropout 0.1, every step logged.
fn train(preset: &str, out: &Path, steps: u64, device: &str, resume: bool) {
    train_in(preset, out, steps, device, resume, "fp32");
}

fn train_in(preset: &str, out: &Path, steps: u64, device: &str, resume: bool, precision: &str) {
    let data = fixture("data/tinyshakespeare.txt");
    let steps = steps.to_string();
    let mut args = vec!["train", "--preset", preset, "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--max-steps", &steps, "--device", device, "--precision", precision, "--quiet"];
    args.extend(["--set", "train.batch_size=4", "--set", "model.block_size=64", "--set", "model.dropout=0.1", "--set", "train.log_interval=1", "--set", "eval.interval=0", "--set", "eval.iters=2", "--set", "sample.tokens=0"]);
    if resume {
        args.push("--resume");
    }
    let o = kiln(&args);
    assert_eq!(o.status.code(), Some(0), "{preset} on {device}: {}", stderr(&o));
}

/// The largest relative difference between the two runs' losses at `steps`.
fn worst(a: &BTreeMap<u64, f64>, b: &BTreeMap<u64, f64>, steps: std::ops::RangeInclusive<u64>) -> f64 {
    steps.map(|s| ((a[&s] - b[&s]) / a[&s]).abs()).fold(0.0, f64::max)
}

#[test]
fn training_on_the_device_follows_the_cpu_and_checkpoints_move_between_them() {
    let dir = scratch("device-train");
    for preset in ["shakespeare-char", "llama-tiny", "moe-tiny"] {
        let (cpu, dev) = (dir.join(format!("{preset}-cpu")), dir.join(format!("{preset}-vulkan")));
        train(preset, &cpu, 30, "cpu", false);
        train(preset, &dev, 30, "vulkan", false);
        let (a, b) = (losses(&cpu), losses(&dev));
        let e = worst(&a, &b, 1..=30);
        assert!(e <= 1e-4, "{preset}: the device's losses differ from the CPU's by {e:e}");
        // The last step's evaluation ran on the device: the CPU's validation loss.
        let (vc, vd) = (lines(&cpu, "eval", "val_loss"), lines(&dev, "eval", "val_loss"));
        assert!(!vd.is_empty() && worst(&vc, &vd, 30..=30) <= 1e-4, "{preset}: validation losses {vd:?} against {vc:?}");
        if preset == "llama-tiny" {
            // 16-bit working weights on the device (fp32 master weights, moments, gradients).
            let half = dir.join("llama-tiny-vulkan-bf16");
            train_in(preset, &half, 30, "vulkan", false, "bf16");
            let e = worst(&b, &losses(&half), 1..=30);
            assert!(e <= 2e-2, "llama-tiny in bf16 on the device: losses differ from fp32's by {e:e}");
        }
        if preset != "shakespeare-char" {
            continue;
        }
        // `kiln eval --device` on the device run's checkpoint gives the CPU's loss.
        let text = dir.join("eval.txt");
        std::fs::write(&text, &std::fs::read_to_string(fixture("data/tinyshakespeare.txt")).unwrap()[..6_000]).unwrap();
        let eval = |device: &str| {
            let o = kiln(&["eval", "--run", dev.to_str().unwrap(), "--data", text.to_str().unwrap(), "--device", device]);
            assert_eq!(o.status.code(), Some(0), "eval on {device}: {}", stderr(&o));
            serde_json::from_str::<serde_json::Value>(&stdout(&o)).unwrap()["val_loss"].as_f64().unwrap()
        };
        let (ec, ed) = (eval("cpu"), eval("vulkan"));
        assert!(((ec - ed) / ec).abs() <= 1e-5, "eval: {ed} on the device against {ec} on the CPU");
        // A device checkpoint at step 20 continues on the CPU, and the reverse.
        for (first, then) in [("vulkan", "cpu"), ("cpu", "vulkan")] {
            let run = dir.join(format!("{first}-then-{then}"));
            train(preset, &run, 20, first, false);
            train(preset, &run, 30, then, true);
            let e = worst(&a, &losses(&run), 21..=30);
            assert!(e <= 1e-4, "{first} to step 20, then {then}: losses differ from the CPU run's by {e:e}");
        }
    }
}

/// `kiln generate --device vulkan` (the KV cache on the device) gives the CPU's greedy tokens
/// on a Hugging Face fixture.
#[test]
fn generation_on_the_device_gives_the_cpu_tokens() {
    let model = fixture("fixtures/qwen2-tiny");
    let run = |device: &str| {
        let o = kiln(&["generate", "--checkpoint", model.to_str().unwrap(), "--prompt", "Hello there", "--temperature", "0", "--max-new-tokens", "24", "--device", device]);
        assert_eq!(o.status.code(), Some(0), "{device}: {}", stderr(&o));
        stdout(&o)
    };
    let (cpu, dev) = (run("cpu"), run("vulkan"));
    assert!(cpu.len() > "Hello there".len() + 10, "{cpu}");
    assert_eq!(dev, cpu);
}

/// LoRA and QLoRA on the device over a Hugging Face fixture: the adapters' losses follow the
/// CPU's step for step (the frozen base resident; under QLoRA its NF4 or int8 codes dequantized
/// on the device), for a dense LLaMA, GPT-2's fused projections and a mixture of experts; a
/// device checkpoint of the adapters resumes on the CPU; bf16 QLoRA stays near the CPU's bf16.
#[test]
fn lora_and_qlora_on_the_device_follow_the_cpu() {
    let dir = scratch("device-lora");
    let text = dir.join("text.txt");
    std::fs::write(&text, &std::fs::read_to_string(fixture("data/tinyshakespeare.txt")).unwrap()[..20_000]).unwrap();
    let run = |name: &str, fx: &str, device: &str, extra: &[&str]| -> BTreeMap<u64, f64> {
        let (out, fx) = (dir.join(name), fixture(&format!("fixtures/{fx}")));
        let mut args = vec!["train", "--init-from", fx.to_str().unwrap(), "--data", text.to_str().unwrap(), "--out", out.to_str().unwrap(), "--tokenizer", "char", "--lora-rank", "4", "--seq-len", "32", "--device", device, "--quiet"];
        // (A schedule of fixed length: a run stopped at step 5 and resumed to 10 follows it.)
        args.extend(["--set", "train.batch_size=2", "--set", "model.dropout=0.1", "--set", "train.log_interval=1", "--set", "eval.interval=0", "--set", "eval.iters=1", "--set", "sample.tokens=0", "--set", "checkpoint.interval=5", "--set", "train.lr_decay_steps=10"]);
        args.extend(extra);
        let o = kiln(&args);
        assert_eq!(o.status.code(), Some(0), "{name}: {}", stderr(&o));
        losses(&out)
    };
    let ten = ["--max-steps", "10"];
    for (fx, targets) in [("llama31-tiny", "q,v,down"), ("gpt2-tiny", "q,k,v,up,down"), ("mixtral-tiny", "q,v,o")] {
        let lora = [&ten[..], &["--lora-targets", targets]].concat();
        let (a, b) = (run(&format!("{fx}-cpu"), fx, "cpu", &lora), run(&format!("{fx}-vulkan"), fx, "vulkan", &lora));
        assert_eq!(b.len(), 10);
        let e = worst(&a, &b, 1..=10);
        assert!(e <= 1e-4, "LoRA on {fx}: the device's losses differ from the CPU's by {e:e}");
    }
    for q in ["nf4", "int8"] {
        let args = [&ten[..], &["--lora-targets", "q,v,down", "--quantize-base", q]].concat();
        let (a, b) = (run(&format!("q{q}-cpu"), "llama31-tiny", "cpu", &args), run(&format!("q{q}-vulkan"), "llama31-tiny", "vulkan", &args));
        let e = worst(&a, &b, 1..=10);
        assert!(e <= 1e-3, "QLoRA ({q}): the device's losses differ from the CPU's by {e:e}");
        if q != "nf4" {
            continue;
        }
        // The adapters saved on the device at step 5 continue on the CPU.
        let five = [&["--max-steps", "5"][..], &args[2..]].concat();
        run("resumed", "llama31-tiny", "vulkan", &five);
        let c = run("resumed", "llama31-tiny", "cpu", &[&args[..], &["--resume"]].concat());
        let e = worst(&a, &c, 6..=10);
        assert!(e <= 1e-4, "QLoRA from a device checkpoint at step 5 on the CPU: {e:e}");
        let half = [&args[..], &["--precision", "bf16"]].concat();
        let (hc, hd) = (run("qbf16-cpu", "llama31-tiny", "cpu", &half), run("qbf16-vulkan", "llama31-tiny", "vulkan", &half));
        let e = worst(&hc, &hd, 1..=10);
        assert!(e <= 2e-2 && hd != b, "bf16 QLoRA: the device's losses differ from the CPU's by {e:e}");
    }
}

/// `scripts/gpu_check.sh --dry-run`: every step of the GPU machine's prepared check (the kernel
/// check from inside the binary, CPU against device training in fp32 and bf16, the layouts one
/// device hosts against one rank, the GPT-2 bench beside PyTorch's) runs on lavapipe at tiny
/// shapes and writes its JSON summary.
#[test]
fn the_gpu_check_script_runs_dry_on_the_vulkan_device() {
    let dir = scratch("gpu-check");
    let out = dir.join("summary.json");
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gpu_check.sh");
    let data = fixture("data/tinyshakespeare.txt");
    let o = std::process::Command::new(&script)
        .args(["--dry-run", "--kiln", env!("CARGO_BIN_EXE_kiln"), "--out", out.to_str().unwrap(), "--data", data.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(v["ok"], true, "{v:#}");
    assert_eq!((v["dry_run"].as_bool(), v["device"].as_str()), (Some(true), Some("vulkan")));
    assert!(v["check_kernels"]["kernels"].as_u64().unwrap() >= 20, "{v:#}");
    let sc = &v["shakespeare_char"];
    assert!(sc["fp32_vs_cpu_max_rel"].as_f64().unwrap() <= 1e-4 && sc["runs"]["dev-bf16"]["steps"] == 10, "{sc:#}");
    assert!(v["gpt2_kiln"]["tokens_per_sec"].as_f64().unwrap() > 0.0, "{v:#}");
    for layout in ["dp2-zero3", "tp2-sp", "pp2-1f1b", "cp2-ring"] {
        assert_eq!(v["layouts_on_one_device"][layout]["within_1e-4"], true, "{layout}: {v:#}");
    }
    // PyTorch is reported, or reported absent.
    let t = &v["gpt2_pytorch"];
    assert!(t["absent"].is_string() || t["eager_bf16"]["tokens_per_sec"].as_f64().is_some(), "{t:#}");
    assert!(v["doctor"].as_array().unwrap().iter().any(|l| l.as_str().unwrap().starts_with("cuda:")), "{v:#}");
}

/// Data parallelism on devices: two ranks, each on its own logical device (lavapipe has one
/// adapter; each rank opens its own device on it), reduce their gradients through the host and
/// reproduce the one-device run — `llama-tiny`, and `moe-tiny` (dropless, its load-balancing
/// statistics summed over the group as on the CPU) — under ZeRO-1 (each rank's moments a
/// shard, the updated parameters gathered, the gradients' all-reduce started unit by unit as
/// backward finishes each) and ZeRO-3 (weights and gradients sharded, each unit gathered for its
/// passes); ZeRO-2 and 3 device checkpoints resume at another stage on the
/// devices and at dp1 on the CPU.
#[test]
fn data_parallel_on_devices_reproduces_one_device() {
    let dir = scratch("device-dp");
    let data = fixture("data/tinyshakespeare.txt");
    let run = |preset: &str, out: &Path, steps: u64, device: &str, (dp, zero): (&str, &str), resume: bool| {
        let steps = steps.to_string();
        let mut args = vec!["train", "--preset", preset, "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--max-steps", &steps, "--device", device, "--dp", dp, "--zero", zero, "--quiet"];
        args.extend(["--set", "train.batch_size=4", "--set", "model.block_size=64", "--set", "model.dropout=0.1", "--set", "model.capacity_factor=0", "--set", "train.log_interval=1"]);
        args.extend(["--set", "eval.interval=10", "--set", "eval.iters=2", "--set", "sample.tokens=0", "--set", "checkpoint.interval=10"]);
        if resume {
            args.push("--resume");
        }
        let o = kiln(&args);
        assert_eq!(o.status.code(), Some(0), "{preset} dp {dp} on {device}: {}", stderr(&o));
    };
    for preset in ["llama-tiny", "moe-tiny"] {
        let one = dir.join(format!("{preset}-dp1"));
        run(preset, &one, 20, "vulkan", ("1", "0"), false);
        for zero in ["1", "3"] {
            let two = dir.join(format!("{preset}-dp2-zero{zero}"));
            run(preset, &two, 20, "vulkan", ("2", zero), false);
            let e = worst(&losses(&one), &losses(&two), 1..=20);
            assert!(e <= 1e-5, "{preset}: dp2 ZeRO-{zero} on two devices differs from one device by {e:e}");
            let (v1, v2) = (lines(&one, "eval", "val_loss"), lines(&two, "eval", "val_loss"));
            assert!(v2.len() == 2 && worst(&v1, &v2, 20..=20) <= 1e-5, "{preset} ZeRO-{zero}: validation {v2:?} against {v1:?}");
            if zero == "1" {
                // The gradients are summed unit by unit as backward finishes them (the embeddings,
                // each block, the head), overlapping the rest of backward.
                let calls = lines(&two, "train", "comm_calls_all_reduce");
                assert!(calls.len() == 20 && calls.values().all(|&c| c >= 4.0), "{preset}: all-reduces a step {calls:?}");
            }
        }
        if preset == "llama-tiny" {
            // A ZeRO-2 device run's step-10 checkpoint continues at ZeRO-3 on the devices, and
            // a ZeRO-3 one's on the CPU at dp1.
            for (zero, then) in [("2", ("vulkan", ("2", "3"))), ("3", ("cpu", ("1", "0")))] {
                let resumed = dir.join(format!("zero{zero}-then-{}", then.0));
                run(preset, &resumed, 10, "vulkan", ("2", zero), false);
                run(preset, &resumed, 20, then.0, then.1, true);
                let e = worst(&losses(&one), &losses(&resumed), 1..=20);
                assert!(e <= 1e-5, "dp2 ZeRO-{zero} on devices to step 10, then {:?} on {}: {e:e}", then.1, then.0);
            }
        }
    }
}

/// `kiln train` of `preset` for `steps` on tinyshakespeare (batch 4 × 64, dropout 0.1, two
/// layers, dropless experts, an evaluation and a checkpoint every 10 steps; `llama-tiny`'s MLP
/// widened to 344 columns, which split in two) under `layout`'s flags; it must succeed.
fn train_layout(out: &Path, (preset, steps): (&str, u64), device: &str, layout: &[&str], resume: bool) {
    let data = fixture("data/tinyshakespeare.txt");
    let steps = steps.to_string();
    let mut args = vec!["train", "--preset", preset, "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--max-steps", &steps, "--device", device, "--quiet"];
    args.extend(["--set", "train.batch_size=4", "--set", "model.block_size=64", "--set", "model.dropout=0.1", "--set", "model.n_layer=2", "--set", "train.log_interval=1"]);
    args.extend(["--set", "eval.interval=10", "--set", "eval.iters=2", "--set", "sample.tokens=0", "--set", "checkpoint.interval=10", "--set", "model.capacity_factor=0"]);
    if preset == "llama-tiny" {
        args.extend(["--set", "model.ffn_hidden=344"]);
    }
    // (The layout's flags last: they may set what the defaults above set.)
    args.extend(layout);
    if resume {
        args.push("--resume");
    }
    let o = kiln(&args);
    assert_eq!(o.status.code(), Some(0), "{preset} {layout:?} on {device}: {}", stderr(&o));
}

/// A test's `kiln train` of (preset, run directory, steps, device, layout flags, resume).
type Run = dyn Fn(&str, &Path, u64, &str, &[&str], bool);

/// `preset` under `layout` on devices to step 10 (`run`), continued at dp 1 on the CPU to step
/// 20, gives the one-device run's (`one`) losses.
fn continues_on_the_cpu(run: &Run, (preset, one): (&str, &Path), out: &Path, layout: &[&str]) {
    run(preset, out, 10, "vulkan", layout, false);
    run(preset, out, 20, "cpu", &[], true);
    let e = worst(&losses(one), &losses(out), 1..=20);
    assert!(e <= 1e-5, "{preset} {layout:?} on devices to step 10, then dp 1 on the CPU: {e:e}");
}

/// Tensor parallelism on devices (Megatron's heads, MLP columns and vocabulary rows per part,
/// the partial sums staged through the host): `llama-tiny` at tp 2, with and without sequence
/// parallelism, reproduces one device over 20 steps, GPT-2's `shakespeare-char` (biases, a tied
/// head, attention dropout by whole-model head) and dropless `moe-tiny` (its experts whole on
/// every part, the layer over the gathered sequence) with sequence parallelism over 10; dp2 × tp2 on
/// four devices too, and its step-10 checkpoint continues at dp 1 on the CPU with the
/// one-device losses; so does ZeRO-3 over dp 2 of tp-2 parts with sequence parallelism.
#[test]
fn tensor_parallel_on_devices_reproduces_one_device() {
    let dir = scratch("device-tp");
    let run = |preset: &str, out: &Path, steps: u64, device: &str, layout: &[&str], resume: bool| train_layout(out, (preset, steps), device, layout, resume);
    #[rustfmt::skip]
    let cases: [(&str, u64, &[&[&str]]); 3] = [
        ("llama-tiny", 20, &[&["--tp", "2"], &["--tp", "2", "--sequence-parallel"]]),
        ("shakespeare-char", 10, &[&["--tp", "2", "--sequence-parallel"]]),
        ("moe-tiny", 10, &[&["--tp", "2", "--sequence-parallel"]]),
    ];
    for (preset, steps, layouts) in cases {
        let one = dir.join(format!("{preset}-one"));
        run(preset, &one, steps, "vulkan", &[], false);
        for layout in layouts {
            let two = dir.join(format!("{preset}-{}", layout.join("")));
            run(preset, &two, steps, "vulkan", layout, false);
            let e = worst(&losses(&one), &losses(&two), 1..=steps);
            assert!(e <= 1e-5, "{preset} {layout:?} on two devices differs from one device by {e:e}");
            let (v1, v2) = (lines(&one, "eval", "val_loss"), lines(&two, "eval", "val_loss"));
            assert!(!v2.is_empty() && worst(&v1, &v2, steps..=steps) <= 1e-5, "{preset} {layout:?}: validation {v2:?} against {v1:?}");
        }
    }
    let one = dir.join("llama-tiny-one");
    continues_on_the_cpu(&run, ("llama-tiny", &one), &dir.join("dp2-tp2-then-cpu"), &["--dp", "2", "--tp", "2", "--zero", "1"]);
    // FSDP with tensor and sequence parallelism: ZeRO-3 over dp 2 of tp-2 parts.
    let fsdp = dir.join("zero3-tp2-sp");
    run("llama-tiny", &fsdp, 10, "vulkan", &["--dp", "2", "--tp", "2", "--sequence-parallel", "--zero", "3"], false);
    let e = worst(&losses(&one), &losses(&fsdp), 1..=10);
    assert!(e <= 1e-5, "dp2 ZeRO-3 × tp2 with SP on four devices differs from one device by {e:e}");
}

/// Pipeline parallelism on devices (one stage per rank, its activations and their gradients
/// sent between the devices through the host, each micro-batch's activations kept on the
/// device from its forward to its backward): at pp 2 over four micro-batches, `llama-tiny`
/// under 1F1B reproduces one device over 20 steps, dropless `moe-tiny` under 1F1B and GPT-2's
/// `shakespeare-char` (its head tied to the first stage's embedding) under GPipe over 10; tp2 ×
/// pp2 on four devices too, whose step-10 checkpoint continues at dp 1 on the CPU, and pp2 ×
/// dp2 under ZeRO-3; and interleaved 1F1B, two model chunks a rank.
#[test]
fn pipeline_parallel_on_devices_reproduces_one_device() {
    let dir = scratch("device-pp");
    let run = |preset: &str, out: &Path, steps: u64, device: &str, layout: &[&str], resume: bool| train_layout(out, (preset, steps), device, &[layout, &["--set", "train.grad_accum=4"]].concat(), resume);
    for (preset, steps, schedule) in [("llama-tiny", 20, "1f1b"), ("moe-tiny", 10, "1f1b"), ("shakespeare-char", 10, "gpipe")] {
        let (one, two) = (dir.join(format!("{preset}-one")), dir.join(format!("{preset}-pp2")));
        run(preset, &one, steps, "vulkan", &[], false);
        run(preset, &two, steps, "vulkan", &["--pp", "2", "--schedule", schedule], false);
        let e = worst(&losses(&one), &losses(&two), 1..=steps);
        assert!(e <= 1e-5, "{preset}: pp2 {schedule} on two devices differs from one device by {e:e}");
        let (v1, v2) = (lines(&one, "eval", "val_loss"), lines(&two, "eval", "val_loss"));
        assert!(!v2.is_empty() && worst(&v1, &v2, 10..=10) <= 1e-5, "{preset} pp2: validation {v2:?} against {v1:?}");
    }
    continues_on_the_cpu(&run, ("llama-tiny", &dir.join("llama-tiny-one")), &dir.join("tp2-pp2-then-cpu"), &["--tp", "2", "--pp", "2"]);
    // pp2 × dp2 under ZeRO-3, the tied head's copies sharded alike on the first and last stage.
    let eight = ["--set", "train.batch_size=8"];
    let (one, sharded) = (dir.join("char-batch8"), dir.join("char-pp2-dp2-zero3"));
    run("shakespeare-char", &one, 10, "vulkan", &eight, false);
    run("shakespeare-char", &sharded, 10, "vulkan", &[&eight[..], &["--pp", "2", "--dp", "2", "--zero", "3"]].concat(), false);
    let e = worst(&losses(&one), &losses(&sharded), 1..=10);
    assert!(e <= 1e-5, "pp2 × dp2 ZeRO-3 on four devices differs from one device by {e:e}");
    // Interleaved 1F1B: two model chunks a rank on its one device (four virtual stages of a
    // four-layer model), GPT-2's tied head on the last virtual stage; the interleaved run's
    // step-10 checkpoint continues at dp 1 on the CPU.
    let four = ["--set", "model.n_layer=4"];
    let interleaved = [&four[..], &["--pp", "2", "--schedule", "interleaved", "--virtual", "2"]].concat();
    for (preset, steps) in [("llama-tiny", 13), ("shakespeare-char", 10)] {
        let (one, int) = (dir.join(format!("{preset}-4-one")), dir.join(format!("{preset}-interleaved")));
        run(preset, &one, steps, "vulkan", &four, false);
        run(preset, &int, 10, "vulkan", &interleaved, false);
        if steps > 10 {
            run(preset, &int, steps, "cpu", &four, true);
        }
        let e = worst(&losses(&one), &losses(&int), 1..=steps);
        assert!(e <= 1e-5, "{preset}: pp2 interleaved (two chunks a rank) on two devices differs from one device by {e:e}");
    }
}

/// Expert parallelism on devices (each rank holds half of `moe-tiny`'s routed experts and routes
/// its own tokens over all of them; the dispatched rows go to their experts' owners and the
/// outputs come back through the host, and again in backward; the experts' gradients are
/// reduced over the ranks holding the same experts, everything else over the whole group):
/// dropless `moe-tiny` at ep 2 reproduces one device over 20 steps, with its validation losses
/// and the CPU's expert-parallel row counts; dp2 × ep2 on four devices too, and
/// the ep-2 run's step-10 checkpoint continues at dp 1 on the CPU. With capacity (each rank's
/// own tokens compete for its slots, as on the CPU) ep 2 on devices equals ep 2 on the CPU.
#[test]
fn expert_parallel_on_devices_reproduces_one_device() {
    let dir = scratch("device-ep");
    let run = |preset: &str, out: &Path, steps: u64, device: &str, layout: &[&str], resume: bool| train_layout(out, (preset, steps), device, layout, resume);
    let (one, two) = (dir.join("one"), dir.join("ep2"));
    run("moe-tiny", &one, 20, "vulkan", &[], false);
    run("moe-tiny", &two, 20, "vulkan", &["--ep", "2"], false);
    let e = worst(&losses(&one), &losses(&two), 1..=20);
    assert!(e <= 1e-5, "moe-tiny ep2 on two devices differs from one device by {e:e}");
    let (v1, v2) = (lines(&one, "eval", "val_loss"), lines(&two, "eval", "val_loss"));
    assert!(v2.len() == 2 && worst(&v1, &v2, 10..=10).max(worst(&v1, &v2, 20..=20)) <= 1e-5, "ep2: validation {v2:?} against {v1:?}");
    let cpu = dir.join("ep2-cpu");
    run("moe-tiny", &cpu, 3, "cpu", &["--ep", "2"], false);
    for key in ["moe_ep_rows_sent", "moe_ep_rows_received"] {
        let (d, c) = (lines(&two, "train", key), lines(&cpu, "train", key));
        assert!(c.len() == 3 && c.iter().all(|(k, v)| *v > 0.0 && d.get(k) == Some(v)), "{key}: {d:?} on devices, {c:?} on the CPU");
    }
    // dp2 × ep2 on four devices (eight sequences a step, two a rank).
    let eight = ["--set", "train.batch_size=8"];
    let (base, parted) = (dir.join("batch8-one"), dir.join("dp2-ep2"));
    run("moe-tiny", &base, 6, "vulkan", &eight, false);
    run("moe-tiny", &parted, 6, "vulkan", &[&eight[..], &["--dp", "2", "--ep", "2"]].concat(), false);
    let e = worst(&losses(&base), &losses(&parted), 1..=6);
    assert!(e <= 1e-5, "moe-tiny dp2 × ep2 on four devices differs from one device by {e:e}");
    continues_on_the_cpu(&run, ("moe-tiny", &one), &dir.join("ep2-then-cpu"), &["--ep", "2"]);
    let capped = ["--ep", "2", "--set", "model.capacity_factor=1.0"];
    let (dev, cpu) = (dir.join("capped-dev"), dir.join("capped-cpu"));
    run("moe-tiny", &dev, 5, "vulkan", &capped, false);
    run("moe-tiny", &cpu, 5, "cpu", &capped, false);
    let e = worst(&losses(&cpu), &losses(&dev), 1..=5);
    let dropped = lines(&dev, "train", "moe_dropped_fraction");
    assert!(e <= 1e-5 && dropped.values().any(|&d| d > 0.0), "ep2 with capacity on devices against the CPU: {e:e}, dropped {dropped:?}");
}

/// Context parallelism on devices as a ring (each rank holds its zig-zag chunks of every
/// sequence; the keys and values pass around the ring through the host while the device's block
/// kernels attend each query chunk to them, merging through the running log-sum-exp, and again
/// with their gradients' accumulator in backward): `llama-tiny` at cp 2 reproduces one device
/// over 20 steps with its validation losses, dropless `moe-tiny` over 10, GPT-2's
/// `shakespeare-char` (its position table read at global positions) and `llama-tiny` in one
/// contiguous chunk each, with a sliding window over packed documents, over 6; dp2 × cp2 on
/// four devices over 4 too, and the cp-2 run's step-10 checkpoint continues at dp 1 on the CPU. Ulysses (`--cp-mode ulysses`) too: GPT-2 over packed documents over 6 steps.
#[test]
fn context_parallel_on_devices_reproduces_one_device() {
    let dir = scratch("device-cp");
    let run = |preset: &str, out: &Path, steps: u64, device: &str, layout: &[&str], resume: bool| train_layout(out, (preset, steps), device, layout, resume);
    let same = |preset: &str, steps: u64, base: &[&str], layout: &[&str]| {
        let name = format!("{preset}-{}", [base, layout].concat().join(""));
        let (one, parted) = (dir.join(format!("{name}-one")), dir.join(&name));
        run(preset, &one, steps, "vulkan", base, false);
        run(preset, &parted, steps, "vulkan", &[base, layout].concat(), false);
        let e = worst(&losses(&one), &losses(&parted), 1..=steps);
        assert!(e <= 1e-5, "{preset} {base:?} {layout:?} on devices differs from one device by {e:e}");
        (one, parted)
    };
    let mut llama = dir.join("unset");
    for (preset, steps) in [("llama-tiny", 20), ("moe-tiny", 10)] {
        let (one, two) = same(preset, steps, &[], &["--cp", "2"]);
        let (v1, v2) = (lines(&one, "eval", "val_loss"), lines(&two, "eval", "val_loss"));
        assert!(!v2.is_empty() && worst(&v1, &v2, 10..=10) <= 1e-5, "{preset} cp2: validation {v2:?} against {v1:?}");
        if preset == "llama-tiny" {
            llama = one;
        }
    }
    same("shakespeare-char", 6, &[], &["--cp", "2"]);
    same("llama-tiny", 6, &["--set", "model.sliding_window=20", "--set", "data.packing=documents"], &["--cp", "2", "--cp-balance", "none"]);
    same("llama-tiny", 4, &["--set", "train.batch_size=8"], &["--cp", "2", "--dp", "2"]);
    continues_on_the_cpu(&run, ("llama-tiny", &llama), &dir.join("cp2-then-cpu"), &["--cp", "2"]);
    // Ulysses: the all-to-alls through the host around the device's whole-sequence kernel
    // over each rank's heads.
    same("shakespeare-char", 6, &["--set", "data.packing=documents"], &["--cp", "2", "--cp-mode", "ulysses"]);
    // The device plan counts Ulysses' staging beside the ring's blocks.
    let data = fixture("data/tinyshakespeare.txt");
    let planned = |mode: &str| {
        let o = kiln(&["memory", "--preset", "llama-tiny", "--data", data.to_str().unwrap(), "--device", "vulkan", "--cp", "2", "--cp-mode", mode, "--json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str::<serde_json::Value>(stdout(&o).trim()).unwrap()["device"]["total_bytes"].as_u64().unwrap()
    };
    assert!(planned("ulysses") > planned("ring"), "Ulysses' staging is planned");
}

/// `mpirun -n 2 kiln train --backend mpi --device vulkan`: one process per rank, each on its own
/// device, gives what two in-process ranks on devices give, under data parallelism, tensor
/// parallelism with sequence parallelism (its hooks over MPI, staged through the host), a
/// two-stage pipeline, expert parallelism (`moe-tiny`) and a context-parallel ring.
#[cfg(feature = "mpi")]
#[test]
fn mpi_processes_on_devices_match_in_process_ranks() {
    let dir = scratch("device-mpi");
    let data = fixture("data/tinyshakespeare.txt");
    let common = ["--data", data.to_str().unwrap(), "--max-steps", "6", "--device", "vulkan", "--quiet", "--set", "train.batch_size=4", "--set", "model.block_size=64", "--set", "model.dropout=0.1", "--set", "model.ffn_hidden=344", "--set", "train.log_interval=1", "--set", "eval.interval=0", "--set", "eval.iters=2", "--set", "sample.tokens=0"];
    let llama = ["--preset", "llama-tiny"];
    #[rustfmt::skip]
    let cases = [
        ("dp", &["--dp", "2"][..]), ("tp", &["--tp", "2", "--sequence-parallel"][..]), ("pp", &["--pp", "2", "--set", "train.grad_accum=2"][..]),
        ("ep", &["--ep", "2", "--preset", "moe-tiny"][..]), ("cp", &["--cp", "2"][..]),
    ];
    for (name, layout) in cases {
        let layout = if layout.contains(&"--preset") { layout.to_vec() } else { [layout, &llama].concat() };
        let layout = &layout[..];
        let inproc = dir.join(format!("{name}-inproc"));
        let o = kiln(&[&["train", "--out", inproc.to_str().unwrap()][..], layout, &common].concat());
        assert_eq!(o.status.code(), Some(0), "{name}: {}", stderr(&o));
        let mpi = dir.join(format!("{name}-mpi"));
        // (Under MPI the data-parallel degree follows from the world: what the others leave.)
        let layout: Vec<&str> = if name == "dp" { [&llama[..], &["--dp", "0"]].concat() } else { [layout, &["--dp", "0"]].concat() };
        let o = std::process::Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-n", "2", env!("CARGO_BIN_EXE_kiln"), "train", "--out", mpi.to_str().unwrap(), "--backend", "mpi"])
            .args(&layout)
            .args(common)
            .env("RAYON_NUM_THREADS", "1")
            .output()
            .expect("mpirun (install openmpi-bin)");
        assert!(o.status.success(), "{name}: mpirun -n 2 on devices: {}", stderr(&o));
        let (a, b) = (losses(&inproc), losses(&mpi));
        assert_eq!(a.len(), 6);
        let e = worst(&a, &b, 1..=6);
        assert!(e <= 1e-6, "{name}: two processes on devices differ from two in-process ranks by {e:e}");
    }
}

/// Lion on the device (`Gpu::lion_update_at`, one moment): on one device and at dp 2 under
/// ZeRO-1 (the moment a shard per rank) it follows the CPU's Lion; Muon is refused there by name.
#[test]
fn lion_on_the_device_follows_the_cpu() {
    let dir = scratch("device-lion");
    let data = fixture("data/tinyshakespeare.txt");
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let mut args = vec!["train", "--preset", "llama-tiny", "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--max-steps", "10", "--quiet"];
        args.extend(["--set", "optim.name=lion", "--set", "train.lr=3e-4", "--set", "train.batch_size=4", "--set", "model.block_size=64", "--set", "model.dropout=0.1", "--set", "train.log_interval=1", "--set", "eval.interval=0", "--set", "eval.iters=2", "--set", "sample.tokens=0"]);
        args.extend_from_slice(extra);
        let o = kiln(&args);
        assert_eq!(o.status.code(), Some(0), "{name}: {}", stderr(&o));
        losses(&out)
    };
    let cpu = run("cpu", &["--device", "cpu"]);
    for (name, extra) in [("vulkan", &["--device", "vulkan"][..]), ("vulkan-dp2-zero1", &["--device", "vulkan", "--dp", "2", "--zero", "1"])] {
        let e = worst(&cpu, &run(name, extra), 1..=10);
        assert!(e <= 1e-4, "{name}: Lion's losses differ from the CPU's by {e:e}");
    }
    let out = dir.join("muon");
    let o = kiln(&["train", "--preset", "llama-tiny", "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--device", "vulkan", "--set", "optim.name=muon", "--quiet"]);
    assert_user_error(&o, &["train.device = vulkan", "optim.name = muon"]);
}
