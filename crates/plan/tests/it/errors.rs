//! Error paths: each message names the value at fault.

use plan::cli::{estimate_cmd, validate_cmd, ClusterArgs, LayoutArgs, ModelArgs};

fn gpt() -> ModelArgs {
    ModelArgs {
        model: Some("megatron-7.5b".into()),
        ..Default::default()
    }
}

fn cluster(gpu: &str, n: u64) -> ClusterArgs {
    ClusterArgs {
        gpu: gpu.into(),
        gpus: n,
        ..Default::default()
    }
}

#[test]
fn unknown_gpu_is_named() {
    let e = estimate_cmd(
        &gpt(),
        &cluster("v100-nope", 8),
        &LayoutArgs {
            global_batch: 64,
            ..Default::default()
        },
        false,
    )
    .unwrap_err();
    assert!(e.0.contains("--gpu") && e.0.contains("v100-nope"), "{e}");
}

#[test]
fn tp_not_dividing_heads_is_named() {
    let l = LayoutArgs {
        tp: Some(3),
        global_batch: 64,
        ..Default::default()
    };
    let e = estimate_cmd(&gpt(), &cluster("a100-80gb", 24), &l, false).unwrap_err();
    assert!(e.0.contains("--tp 3") && e.0.contains("heads 32"), "{e}");
}

#[test]
fn degrees_not_multiplying_to_gpus_are_named() {
    let l = LayoutArgs {
        tp: Some(4),
        pp: Some(2),
        dp: Some(2),
        cp: Some(1),
        global_batch: 64,
        ..Default::default()
    };
    let e = estimate_cmd(&gpt(), &cluster("a100-80gb", 32), &l, false).unwrap_err();
    assert!(e.0.contains("= 16") && e.0.contains("--gpus 32"), "{e}");
}

#[test]
fn unknown_model_is_named() {
    let m = ModelArgs {
        model: Some("gpt-17".into()),
        ..Default::default()
    };
    let e = estimate_cmd(
        &m,
        &cluster("a100-80gb", 8),
        &LayoutArgs {
            global_batch: 8,
            ..Default::default()
        },
        false,
    )
    .unwrap_err();
    assert!(e.0.contains("gpt-17"), "{e}");
}

#[test]
fn bad_table_files_are_named() {
    let e = validate_cmd("/nonexistent/runs.csv", None, false).unwrap_err();
    assert!(e.0.contains("/nonexistent/runs.csv"), "{e}");
    let dir = std::env::temp_dir().join(format!("plan-err-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("bad.csv");
    std::fs::write(
        &f,
        "params,heads,hidden,layers,TP,PP,GPUs,global_batch\n1.7,24,2304,24,1,1,32,512\n",
    )
    .unwrap();
    let e = validate_cmd(f.to_str().unwrap(), None, false).unwrap_err();
    assert!(e.0.contains("bad.csv") && e.0.contains("tflops_per_gpu"), "{e}");
    std::fs::write(
        &f,
        "params,heads,hidden,layers,TP,PP,GPUs,global_batch,tflops_per_gpu\n1.7,24,2304,x24,1,1,32,512,137\n",
    )
    .unwrap();
    let e = validate_cmd(f.to_str().unwrap(), None, false).unwrap_err();
    assert!(e.0.contains("layers") && e.0.contains("x24"), "{e}");
    std::fs::write(&f, "[{\"params\": 1.7}").unwrap();
    let e = validate_cmd(f.to_str().unwrap(), None, false).unwrap_err();
    assert!(e.0.contains("bad.csv") && e.0.contains("JSON"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn layout_that_does_not_fit_is_reported_not_hidden() {
    // 7.5B on one GPU with no sharding: 120 GB of model state on an 80 GB part.
    let l = LayoutArgs {
        tp: Some(1),
        pp: Some(1),
        dp: Some(1),
        zero: Some(0),
        global_batch: 8,
        ..Default::default()
    };
    let j = estimate_cmd(&gpt(), &cluster("a100-80gb", 1), &l, true).unwrap();
    let v: serde_json::Value = serde_json::from_str(&j).unwrap();
    assert_eq!(v["fits"], false);
}

#[test]
fn unknown_schedule_is_named_and_names_read_back() {
    let l = LayoutArgs {
        pp: Some(2),
        schedule: Some("zigzag".into()),
        global_batch: 64,
        ..Default::default()
    };
    let e = estimate_cmd(&gpt(), &cluster("a100-80gb", 8), &l, false).unwrap_err();
    assert!(e.0.contains("--schedule") && e.0.contains("zigzag") && e.0.contains("gpipe, 1f1b or interleaved"), "{e}");
    // The one definition `parallel::pp` re-exports: every name parses back; the planner's spellings too.
    use plan::policy::Names;
    use plan::schedule::Kind;
    for k in [Kind::Gpipe, Kind::OneFOneB, Kind::Interleaved] {
        assert_eq!(Kind::parse(k.name()), Ok(k));
    }
    assert_eq!(Kind::parse("Interleaved-1F1B"), Ok(Kind::Interleaved));
}

#[test]
fn impossible_virtual_stages_name_the_layers() {
    // megatron-7.5b has 36 layers: 4 stages x 5 chunks cannot split them.
    let l = LayoutArgs { global_batch: 64, tp: Some(2), pp: Some(4), virtual_stages: Some(5), ..Default::default() };
    let e = estimate_cmd(&gpt(), &cluster("a100-80gb", 64), &l, false).unwrap_err().to_string();
    assert!(e.contains("--pp 4 x --virtual-stages 5 = 20 chunks do not divide the model's 36 layers"), "{e}");
    let l = LayoutArgs { global_batch: 64, pp: Some(1), virtual_stages: Some(2), ..Default::default() };
    let e = estimate_cmd(&gpt(), &cluster("a100-80gb", 64), &l, false).unwrap_err().to_string();
    assert!(e.contains("--virtual-stages 2 needs --pp > 1"), "{e}");
    // A setup with uneven chunks takes 4 x 5 over 36 layers, but not more chunks than layers.
    let l = LayoutArgs { global_batch: 64, tp: Some(2), pp: Some(4), virtual_stages: Some(10), setup: Some("megatron-2024".into()), ..Default::default() };
    let e = estimate_cmd(&gpt(), &cluster("a100-80gb", 64), &l, false).unwrap_err().to_string();
    assert!(e.contains("--pp 4 x --virtual-stages 10 = 40 chunks but the model has only 36 layers"), "{e}");
    let l = LayoutArgs { global_batch: 64, tp: Some(2), pp: Some(4), virtual_stages: Some(5), setup: Some("megatron-2024".into()), ..Default::default() };
    assert!(estimate_cmd(&gpt(), &cluster("a100-80gb", 64), &l, false).is_ok());
}

/// A batch that cannot split is named as such, with the degrees that make the data-parallel size.
#[test]
fn batch_not_splitting_names_the_degrees() {
    let l = LayoutArgs { global_batch: 60, tp: Some(2), pp: Some(4), ..Default::default() };
    let e = estimate_cmd(&gpt(), &cluster("a100-80gb", 64), &l, false).unwrap_err().to_string();
    assert!(e.contains("--global-batch 60 is not a multiple of the data-parallel degree 8"), "{e}");
    let l = LayoutArgs { global_batch: 64, tp: Some(2), pp: Some(4), micro_batch: Some(3), ..Default::default() };
    let e = estimate_cmd(&gpt(), &cluster("a100-80gb", 64), &l, false).unwrap_err().to_string();
    assert!(e.contains("--global-batch 64 is not a multiple of --dp 8 x --micro-batch 3"), "{e}");
}
