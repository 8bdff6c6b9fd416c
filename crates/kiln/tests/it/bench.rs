//! `kiln bench`: the JSON it prints. Timings are not asserted — they are measured by
//! the bench itself — only that every field is present and consistent.

use crate::common::*;

#[test]
fn bench_prints_the_documented_json() {
    let o = kiln(&["bench", "--preset", "shakespeare-char", "--set", "model.vocab_size=65", "--set", "model.n_layer=1", "--steps", "3", "--warmup", "1", "--json", "--breakdown"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    for k in ["tokens_per_sec", "model_flops_per_step", "achieved_gflops", "mfu", "peak_rss_bytes", "threads", "config", "peak_gflops"] {
        assert!(v.get(k).is_some(), "missing {k}: {v}");
    }
    let ms = &v["step_ms"];
    let (min, med, max) = (ms["min"].as_f64().unwrap(), ms["median"].as_f64().unwrap(), ms["max"].as_f64().unwrap());
    assert!(0.0 < min && min <= med && med <= max);
    // PaLM appendix B: (6N + 12·L·C·T)·B·T with N excluding the position embedding.
    let n: f64 = 65.0 * 128.0 + 12.0 * 128.0 * 128.0 + 2.0 * 128.0 + 128.0;
    let want = (6.0 * n + 12.0 * 128.0 * 64.0) * 12.0 * 64.0;
    assert!((v["model_flops_per_step"].as_f64().unwrap() - want).abs() < 1.0, "{v}");
    let ops: Vec<&str> = v["breakdown"].as_array().unwrap().iter().map(|r| r["op"].as_str().unwrap()).collect();
    assert!(ops.contains(&"matmul_forward") && ops.contains(&"lm_head_crossentropy"), "{ops:?}");
}

#[test]
fn bench_peak_and_bad_bench_input() {
    let o = kiln(&["bench", "--peak", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert!(v["peak_gflops"].as_f64().unwrap() > 1.0);
    assert!(v["products"].as_array().unwrap().len() >= 4);
    // The bf16 products on this machine's path.
    assert!(v["bf16_peak_gflops"].as_f64().unwrap() > 1.0, "{v}");
    assert_eq!(v["bf16_products"].as_array().unwrap().len(), v["products"].as_array().unwrap().len());
    let path = v["bf16_path"].as_str().unwrap();
    assert!(path.starts_with("avx512_bf16") || path.starts_with("fp32 fallback"), "{path}");
    let o = kiln(&["bench", "--preset", "shakespeare-char"]);
    assert_user_error(&o, &["model.vocab_size"]);
    let o = kiln(&["bench", "--set", "train.nope=1"]);
    assert_user_error(&o, &["train.nope"]);
}

/// A cached matmul peak far below what the machine does (measured on a busy machine, say):
/// training never prints an MFU above 100 % (the step's rate becomes the peak, and a `peak`
/// line says so), and `kiln bench` measures it again, replacing the cached figure.
#[test]
fn a_stale_peak_never_gives_an_mfu_above_100_percent() {
    let dir = scratch("stale-peak");
    let cache = dir.join("cache");
    let data = corpus(&dir);
    let run = |out: &str, steps: &str| {
        let out = dir.join(out);
        let args = ["train", "--preset", "shakespeare-char", "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--max-steps", steps,
            "--set", "model.n_layer=1", "--set", "train.batch_size=2", "--set", "model.block_size=32", "--set", "train.log_interval=1", "--set", "eval.interval=0", "--set", "sample.tokens=0", "--quiet"];
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).env("KILN_CACHE_DIR", &cache).env("RAYON_NUM_THREADS", "2").output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    };
    run("fresh", "1");
    // Every cached figure made stale: a thousandth of a GFLOP/s.
    let path = cache.join("peak.json");
    let mut all: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for (_, e) in all.as_object_mut().unwrap().iter_mut() {
        e["peak_gflops"] = serde_json::json!(0.001);
    }
    std::fs::write(&path, all.to_string()).unwrap();
    run("stale", "3");
    let text = std::fs::read_to_string(dir.join("stale/metrics.jsonl")).unwrap();
    let mfus: Vec<f64> = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).filter(|j| j["kind"] == "train").map(|j| j["mfu"].as_f64().unwrap()).collect();
    assert_eq!(mfus.len(), 3);
    assert!(mfus.iter().all(|&m| m > 0.0 && m <= 1.0), "MFU above 100 % against a stale peak: {mfus:?}");
    assert!(text.lines().any(|l| l.contains("\"kind\":\"peak\"") && l.contains("stale_peak_gflops")), "no peak line: {text}");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["bench", "--preset", "shakespeare-char", "--set", "model.vocab_size=65", "--set", "model.n_layer=1", "--steps", "2", "--warmup", "1", "--json"])
        .env("KILN_CACHE_DIR", &cache)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert!(v["mfu"].as_f64().unwrap() <= 1.0, "{v}");
    let fresh: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(fresh.as_object().unwrap().values().any(|e| e["peak_gflops"].as_f64().unwrap() > 0.001), "kiln bench did not replace the stale figure: {fresh}");
}
