//! `kiln bench`: the JSON it prints (issue 3). Timings are not asserted — they are measured by
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
    // The bf16 products on this machine's path (issue 20).
    assert!(v["bf16_peak_gflops"].as_f64().unwrap() > 1.0, "{v}");
    assert_eq!(v["bf16_products"].as_array().unwrap().len(), v["products"].as_array().unwrap().len());
    let path = v["bf16_path"].as_str().unwrap();
    assert!(path.starts_with("avx512_bf16") || path.starts_with("fp32 fallback"), "{path}");
    let o = kiln(&["bench", "--preset", "shakespeare-char"]);
    assert_user_error(&o, &["model.vocab_size"]);
    let o = kiln(&["bench", "--set", "train.nope=1"]);
    assert_user_error(&o, &["train.nope"]);
}
