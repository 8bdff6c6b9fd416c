//! Every bad input named by the foundation issue (#2): a one-line error naming the key, value
//! or path, exit code 2, and nothing written or broken.

use crate::common::*;
use std::fs;

#[test]
fn unknown_config_key_from_set_and_from_file() {
    let d = scratch("unknown-key");
    let data = corpus(&d);
    let out = d.join("run");
    let o = train(&data, &out, &["--set", "model.n_layers=2"]);
    assert_user_error(&o, &["model.n_layers", "unknown config key"]);
    let cfg = d.join("bad.toml");
    fs::write(&cfg, "[train]\nlearning_rate = 0.1\n").unwrap();
    let o = train(&data, &out, &["--config", cfg.to_str().unwrap()]);
    assert_user_error(&o, &["train.learning_rate", "bad.toml"]);
    assert!(!out.exists(), "a bad config must not create the run directory");
}

#[test]
fn wrong_value_types_and_invalid_toml() {
    let d = scratch("types");
    let data = corpus(&d);
    let out = d.join("run");
    assert_user_error(&train(&data, &out, &["--set", "train.lr=fast"]), &["train.lr", "a number"]);
    let cfg = d.join("broken.toml");
    fs::write(&cfg, "[model\nn_layer = 2\n").unwrap();
    assert_user_error(&train(&data, &out, &["--config", cfg.to_str().unwrap()]), &["broken.toml", "invalid TOML"]);
    assert_user_error(&kiln(&["train", "--preset", "huge", "--out", out.to_str().unwrap()]), &["unknown preset `huge`"]);
    assert!(!out.exists());
}

#[test]
fn n_embd_not_divisible_by_n_head() {
    let d = scratch("divisible");
    let data = corpus(&d);
    let o = train(&data, &d.join("run"), &["--set", "model.n_embd=18", "--set", "model.n_head=4"]);
    assert_user_error(&o, &["model.n_embd (18)", "model.n_head (4)"]);
}

#[test]
fn zero_and_negative_sizes() {
    let d = scratch("sizes");
    let data = corpus(&d);
    let out = d.join("run");
    assert_user_error(&train(&data, &out, &["--set", "model.n_layer=0"]), &["model.n_layer must be positive"]);
    assert_user_error(&train(&data, &out, &["--set", "train.batch_size=-4"]), &["train.batch_size", "negative"]);
    assert_user_error(&train(&data, &out, &["--set", "model.block_size=0"]), &["model.block_size must be positive"]);
    assert_user_error(&train(&data, &out, &["--set", "train.batch_size=6", "--set", "train.grad_accum=4"]), &["train.batch_size (6)", "train.grad_accum (4)"]);
    assert!(!out.exists());
}

#[test]
fn sequence_longer_than_the_data() {
    let d = scratch("block");
    let data = d.join("small.txt");
    // Shorter than one training window (a short validation split alone is evaluated in shorter
    // windows).
    fs::write(&data, "a short text.").unwrap();
    let out = d.join("run");
    let o = train(&data, &out, &[]);
    assert_user_error(&o, &["train.seq_len (16)", "17 tokens", "training split", "small.txt"]);
    assert!(!out.exists());
}

#[test]
fn missing_and_empty_data_files() {
    let d = scratch("missing");
    let out = d.join("run");
    let missing = d.join("nope.txt");
    assert_user_error(&train(&missing, &out, &[]), &["nope.txt"]);
    let empty = d.join("empty.txt");
    fs::write(&empty, "").unwrap();
    assert_user_error(&train(&empty, &out, &[]), &["empty.txt"]);
    assert!(!out.exists());
}

#[test]
fn token_id_beyond_vocabulary_in_a_token_file() {
    let d = scratch("vocab");
    let bin = d.join("tokens.bin");
    let mut bytes = Vec::new();
    for i in 0..5000u16 {
        bytes.extend_from_slice(&(if i == 1234 { 300u16 } else { i % 200 }).to_le_bytes());
    }
    fs::write(&bin, bytes).unwrap();
    let o = train(&bin, &d.join("run"), &["--set", "data.tokenizer=byte"]);
    assert_user_error(&o, &["tokens.bin", "300"]);
}

#[test]
fn corrupted_checkpoints_are_detected_skipped_and_never_touched() {
    let d = scratch("corrupt");
    let data = corpus(&d);
    let out = d.join("run");
    let o = train(&data, &out, &["--max-steps", "10"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ck = out.join("checkpoints");
    let newest = ck.join("step-00000010");
    let older = ck.join("step-00000005");
    assert!(newest.exists() && older.exists());
    // Corrupt one byte of the newest model file: resume must fall back to step 5.
    let mf = newest.join("model.safetensors");
    let mut bytes = fs::read(&mf).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x55;
    fs::write(&mf, &bytes).unwrap();
    let o = train(&data, &out, &["--resume", "--max-steps", "12"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("step-00000010") && err.contains("checksum"), "warning names the bad checkpoint: {err}");
    assert_eq!(fs::read(&mf).unwrap(), bytes, "the corrupt checkpoint is left as it was");
    // Resumed from step 5: steps 6..12 were re-run and step 10's new checkpoint did not overwrite the bad one.
    assert!(ck.join("step-00000010.1").exists());
    // Truncate every checkpoint: resume stops with exit 2 naming them.
    for (_, dir) in kiln_list(&ck) {
        let f = dir.join("optimizer.safetensors");
        let b = fs::read(&f).unwrap();
        fs::write(&f, &b[..b.len() / 2]).unwrap();
    }
    let o = train(&data, &out, &["--resume", "--max-steps", "20"]);
    assert_user_error(&o, &["no valid checkpoint", "step-00000012", "truncated"]);
    assert!(ck.join("step-00000010").exists(), "nothing deleted");
}

fn kiln_list(ck: &std::path::Path) -> Vec<(String, std::path::PathBuf)> {
    fs::read_dir(ck).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with("step-")).map(|e| (e.file_name().to_string_lossy().into_owned(), e.path())).collect()
}

#[test]
fn resume_with_incompatible_config_and_into_existing_run() {
    let d = scratch("incompat");
    let data = corpus(&d);
    let out = d.join("run");
    assert!(train(&data, &out, &["--max-steps", "5"]).status.success());
    let o = train(&data, &out, &["--resume", "--set", "model.n_embd=32"]);
    assert_user_error(&o, &["incompatible config", "model.n_embd = 16 in the run, 32 now"]);
    // A new run into an existing run directory is refused rather than overwriting it.
    let o = train(&data, &out, &[]);
    assert_user_error(&o, &["already holds a run", "--resume"]);
    let o = kiln(&["train", "--resume", "--out", d.join("nothing").to_str().unwrap()]);
    assert_user_error(&o, &["not a kiln run directory"]);
}

#[test]
fn eval_and_generate_on_a_missing_run() {
    let d = scratch("norun");
    let o = kiln(&["eval", "--run", d.join("x").to_str().unwrap()]);
    assert_user_error(&o, &["not a kiln run directory"]);
    let o = kiln(&["generate", "--run", d.join("x").to_str().unwrap()]);
    assert_user_error(&o, &["not a kiln run directory"]);
}

#[test]
fn model_family_config_errors_name_the_key() {
    // Bad input: n_head not divisible by n_kv_head, top_k beyond the experts.
    let d = scratch("family");
    let data = corpus(&d);
    let out = d.join("run");
    let llama = ["--set", "model.arch=llama", "--set", "model.n_head=4", "--set", "model.n_embd=16"];
    let mut a = llama.to_vec();
    a.extend(["--set", "model.n_kv_head=3"]);
    assert_user_error(&train(&data, &out, &a), &["model.n_head (4)", "model.n_kv_head (3)"]);
    let mut a = llama.to_vec();
    a.extend(["--set", "model.n_expert=4", "--set", "model.top_k=5"]);
    assert_user_error(&train(&data, &out, &a), &["model.top_k (5)", "model.n_expert (4)"]);
    assert_user_error(&train(&data, &out, &["--set", "model.arch=mamba"]), &["model.arch", "mamba"]);
    // LongRoPE needs one factor per rotary frequency (head width 4 / 2 = 2), each positive;
    // Phi-3's fused form has no q/k/v biases.
    let mut a = llama.to_vec();
    a.extend(["--set", "model.rope_scaling=longrope", "--set", "model.rope_short_factor=[1.0, 2.0, 3.0]", "--set", "model.rope_long_factor=[1.0, 2.0]"]);
    assert_user_error(&train(&data, &out, &a), &["model.rope_short_factor", "3 factors", "= 2"]);
    let mut a = llama.to_vec();
    a.extend(["--set", "model.rope_scaling=longrope", "--set", "model.rope_short_factor=[1.0, 2.0]", "--set", "model.rope_long_factor=[1.0, -2.0]"]);
    assert_user_error(&train(&data, &out, &a), &["model.rope_long_factor", "-2"]);
    let mut a = llama.to_vec();
    a.extend(["--set", "model.fused_proj=true", "--set", "model.qkv_bias=true"]);
    assert_user_error(&train(&data, &out, &a), &["model.fused_proj"]);
    assert!(!out.exists());
}

#[test]
fn published_shapes_resolve() {
    // The config-only presets are valid configs (benched here with one layer and a short context).
    for p in ["llama2-7b", "llama3-8b", "mixtral-8x7b", "deepseek-v2-lite"] {
        let o = kiln(&["bench", "--preset", p, "--set", "model.n_layer=1", "--set", "model.block_size=8", "--set", "model.n_embd=64",
            "--set", "model.n_head=4", "--set", &format!("model.n_kv_head={}", if p == "llama2-7b" || p == "deepseek-v2-lite" { 4 } else { 2 }),
            "--set", "model.ffn_hidden=32", "--set", "model.vocab_size=512", "--steps", "1", "--warmup", "0", "--json"]);
        assert!(o.status.success(), "{p}: {}", stderr(&o));
    }
}

/// A run whose memory plan exceeds `memory.limit` is refused before anything is
/// written, with the plan as the error; bad sizes name the key.
#[test]
fn memory_limit_refuses_the_run_with_the_plan() {
    let d = scratch("memory-limit");
    let data = corpus(&d);
    let out = d.join("run");
    let o = train(&data, &out, &["--memory-limit", "100KB"]);
    assert_user_error(&o, &["memory.limit = 97.7 KiB", "memory plan (per rank)", "activations · attention", "total per rank"]);
    // A number of bytes through --set, and the same limit from a config file.
    assert_user_error(&train(&data, &out, &["--set", "memory.limit=1000"]), &["memory.limit", "1000 B"]);
    let cfg = d.join("limit.toml");
    fs::write(&cfg, "[memory]\nlimit = \"0.25MiB\"\n").unwrap();
    assert_user_error(&train(&data, &out, &["--config", cfg.to_str().unwrap()]), &["memory.limit", "256.0 KiB"]);
    assert!(!out.exists(), "a refused run must not create the run directory");
    // Sizes that do not parse name the key and the value.
    assert_user_error(&train(&data, &out, &["--memory-limit", "2XB"]), &["memory.limit", "unknown unit `XB`"]);
    assert_user_error(&train(&data, &out, &["--memory-limit", "lots"]), &["memory.limit", "`lots` is not a size"]);
    assert!(!out.exists());
    // A generous limit trains; `kiln memory` refuses the same way, and plans new runs only.
    let o = train(&data, &out, &["--memory-limit", "4GiB", "--max-steps", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mem = |extra: &[&str]| {
        let mut a = vec!["memory", "--data", data.to_str().unwrap()];
        a.extend_from_slice(extra);
        kiln(&a)
    };
    assert_user_error(&mem(&["--memory-limit", "1MB"]), &["memory.limit", "total per rank"]);
    assert_user_error(&mem(&["--resume", "--out", out.to_str().unwrap()]), &["kiln memory plans a new run", "--config"]);
    assert_user_error(&mem(&["--supervise"]), &["--supervise applies to `kiln train` only"]);
}

#[test]
fn recompute_flags_are_checked() {
    let d = scratch("recompute-flags");
    let data = corpus(&d);
    let o = train(&data, &d.join("a"), &["--recompute", "sometimes"]);
    assert_user_error(&o, &["model.recompute must be none, selective or full, got `sometimes`"]);
    let o = train(&data, &d.join("b"), &["--recompute", "selective", "--recompute-every", "2"]);
    assert_user_error(&o, &["model.recompute_every must be positive and applies to model.recompute = full"]);
    assert!(!d.join("a").exists() && !d.join("b").exists());
    // Full recomputation of every 2nd layer trains (and matches no recomputation bit for bit:
    // tests/it/recompute.rs in the model crate).
    let o = train(&data, &d.join("c"), &["--recompute", "full", "--recompute-every", "2", "--set", "model.n_layer=4", "--max-steps", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Models and batches larger than the machine are refused from their sizes before
/// anything large is allocated — one line naming the key and the bytes needed vs available,
/// exit 2, nothing written, a small peak RSS (the three cases the issue reported, and every
/// other command that builds a model).
#[test]
fn oversized_configs_are_refused_before_allocating() {
    let dir = scratch("oversized");
    let data = corpus(&dir);
    let fx = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/qwen2-tiny");
    let hf = dir.join("hf");
    fs::create_dir_all(&hf).unwrap();
    fs::copy(fx.join("model.safetensors"), hf.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&fs::read_to_string(fx.join("config.json")).unwrap()).unwrap();
    cfg["num_hidden_layers"] = 1_000_000_000u64.into();
    fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    let (hf, data, out) = (hf.to_str().unwrap(), data.to_str().unwrap(), dir.join("out"));
    let o = out.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["eval", "--checkpoint", hf], "num_hidden_layers = 1000000000"),
        (&["generate", "--checkpoint", hf, "--prompt", "x"], "num_hidden_layers = 1000000000"),
        (&["export", "--checkpoint", hf, "--out", o], "num_hidden_layers = 1000000000"),
        (&["train", "--data", data, "--out", o, "--set", "model.n_embd=100000000", "--set", "model.n_head=1"], "model.n_embd = 100000000"),
        (&["train", "--data", data, "--out", o, "--set", "model.n_layer=100000"], "model.n_layer = 100000"),
        (&["train", "--data", data, "--out", o, "--set", "train.batch_size=10000000000"], "train.batch_size"),
        (&["memory", "--data", data, "--set", "model.n_layer=100000"], "model.n_layer = 100000"),
        (&["bench", "--steps", "1", "--set", "model.n_layer=100000"], "model.n_layer = 100000"),
    ];
    for (args, key) in cases {
        let (code, _, err, rss_kib, took) = kiln_measured(args, &dir);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: not one line: {err}");
        assert!(err.contains(key) && err.contains("more than the") && err.contains("available") && err.contains("refused before allocating"), "{args:?}: {err}");
        assert!(rss_kib < 100 * 1024, "{args:?}: peak RSS {rss_kib} KiB");
        assert!(took < std::time::Duration::from_secs(30), "{args:?}: took {took:?}");
        assert!(!out.exists(), "{args:?} wrote {}", out.display());
    }
    // Sizes that overflow 64-bit arithmetic are errors, not wraps.
    let (code, _, err, _, _) = kiln_measured(&["train", "--data", data, "--out", o, "--set", "model.n_embd=1000000000000", "--set", "model.n_head=1"], &dir);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("overflow") && err.contains("model.n_embd = 1000000000000"), "{err}");
    // An allocation the system still refuses (a memory.limit far above the machine; weights of
    // 190 TB exceed even the 128 TiB address space, whatever the overcommit policy) ends with
    // one line and exit 1, no abort and no backtrace; the run directory it made, holding only
    // its lock, is gone, and one that was there before keeps a note of what happened.
    let oom = ["train", "--data", data, "--out", o, "--memory-limit", "1000000TB", "--set", "model.n_layer=1", "--set", "model.n_embd=2000000", "--set", "model.n_head=1"];
    let (code, _, err, _, _) = kiln_measured(&oom, &dir);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("kiln: out of memory: the system refused") && !err.contains("backtrace"), "{err}");
    assert!(!out.exists(), "an out-of-memory run left {}", out.display());
    std::fs::create_dir_all(&out).unwrap();
    let (code, _, err, _, _) = kiln_measured(&oom, &dir);
    assert_eq!(code, 1, "{err}");
    let note = std::fs::read_to_string(out.join("out_of_memory.txt")).unwrap_or_default();
    assert!(note.starts_with("kiln: out of memory: the system refused") && note.trim_end() == err.trim_end(), "{note:?} against {err:?}");
}

/// A closed stdout (`kiln … | head`) ends kiln quietly (SIGPIPE), not with a panic.
#[test]
fn a_closed_stdout_is_not_a_panic() {
    use std::os::unix::process::ExitStatusExt;
    let mut args = vec!["tokenizer", "encode", "--tokenizer", "byte"];
    let texts = vec!["x".repeat(4000); 200];
    for t in &texts {
        args.extend(["--text", t.as_str()]);
    }
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked") && !err.contains("Broken pipe"), "{err}");
    assert!(out.status.signal() == Some(libc::SIGPIPE) || out.status.success(), "{:?}: {err}", out.status);
}
