//! `kiln plan search` for a 70B LLaMA on 64 H100s answers in under 10 s
//! (measured here in whatever profile the tests build in; it takes well under a second).

#[test]
fn llama_70b_on_64_h100_searches_fast() {
    let m = plan::cli::ModelArgs {
        model: Some("llama3-70b".into()),
        ..Default::default()
    };
    let c = plan::cli::ClusterArgs {
        gpu: "h100-sxm".into(),
        gpus: 64,
        ..Default::default()
    };
    let l = plan::cli::LayoutArgs {
        global_batch: 512,
        seq: Some(8192),
        ..Default::default()
    };
    let t0 = std::time::Instant::now();
    let out = plan::cli::search_cmd(&m, &c, &l, 5, false).unwrap();
    let dt = t0.elapsed().as_secs_f64();
    println!("{out}searched in {dt:.3} s");
    assert!(dt < 10.0, "{dt} s");
    assert!(out.contains("why:"));
    // The JSON estimate has the documented keys.
    let j = plan::cli::estimate_cmd(&m, &c, &l, true).unwrap();
    let v: serde_json::Value = serde_json::from_str(&j).unwrap();
    for k in [
        "step_time_s",
        "model_tflops_per_gpu",
        "mfu",
        "memory_bytes_per_gpu",
        "fits",
        "breakdown",
        "chosen",
    ] {
        assert!(v.get(k).is_some(), "missing {k}");
    }
    assert_eq!(v["fits"], true);
}

#[test]
fn cpu_local_bench_file_is_an_accelerator() {
    let dir = std::env::temp_dir().join(format!("plan-cpu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("cpu-local.json");
    std::fs::write(
        &f,
        r#"{"name":"cpu-local","peak_flops_fp32":1.5e11,"mem_bytes":8.0e9,"mem_bw":2.0e10}"#,
    )
    .unwrap();
    let m = plan::cli::ModelArgs {
        model: Some("gpt3-125m".into()),
        ..Default::default()
    };
    let c = plan::cli::ClusterArgs {
        gpu: f.to_string_lossy().into(),
        gpus: 1,
        ..Default::default()
    };
    let l = plan::cli::LayoutArgs {
        global_batch: 8,
        seq: Some(1024),
        ..Default::default()
    };
    let j = plan::cli::estimate_cmd(&m, &c, &l, true).unwrap();
    let v: serde_json::Value = serde_json::from_str(&j).unwrap();
    assert_eq!(v["chosen"]["precision"], "fp32");
    let t = v["step_time_s"].as_f64().unwrap();
    // 6·N·tokens at 150 GFLOP/s is ~41 s for 124M params and 8k tokens (+ attention); memory-bound work adds to it.
    assert!(t > 40.0 && t < 120.0, "{t}");
    std::fs::remove_dir_all(&dir).ok();
}
