//! The regimes published runs show appear in the predictions.

use plan::cli::{estimate_cmd, ClusterArgs, LayoutArgs, ModelArgs};
use plan::cost::{collective_latency, group_link, reduce_scatter_time};
use plan::hardware::{Cluster, HardwareCatalog};
use plan::search::{search, Constraints};

fn h100(gpus: u64) -> Cluster {
    Cluster::new(&HardwareCatalog::builtin(), "h100-sxm", gpus, None).unwrap()
}

/// Model TFLOP/s per GPU of the best plan under `c`.
fn tflops(m: &plan::models::ModelShape, cl: &Cluster, batch: u64, seq: u64, c: &Constraints) -> f64 {
    let r = search(m, cl, batch, seq, c).unwrap();
    let e = r.plans.first().or(r.smallest_unfit.as_ref()).unwrap();
    e.model_tflops_per_gpu
}

/// Data-parallel ZeRO-3 (FSDP FULL_SHARD) at a fixed global batch on a low-bandwidth fabric (one 100 Gb/s NIC per
/// node of 8 A100s, the ZeRO++ paper's setting): every added GPU shrinks the batch per GPU, hence the micro-batch,
/// while each GPU still gathers every parameter twice and reduce-scatters every gradient once per micro-batch, so the
/// collectives stop hiding behind compute and per-GPU throughput falls (ZeRO++ §1; llm-foundry's small per-GPU
/// batches).
#[test]
fn dp_only_zero3_throughput_falls_with_gpu_count_at_fixed_batch() {
    let m = plan::models::find_model("llama2-13b", &[]).unwrap();
    let mut cat = HardwareCatalog::builtin();
    let acc = cat.accelerators.iter_mut().find(|a| a.name == "a100-80gb").unwrap();
    (acc.node.inter, acc.node.nics_per_node) = ("eth-100g".into(), 1);
    let setup = plan::setup::Setup::preset("fsdp").unwrap();
    let c = Constraints {
        tp: Some(1),
        pp: Some(1),
        cp: Some(1),
        zero: Some(3),
        recompute: Some(plan::policy::Recompute::Full),
        precision: setup.precision,
        attention: setup.attention,
        overlap_dp: Some(true),
        fp32_grads: Some(false),
        ..Default::default()
    };
    let gpus = [32u64, 64, 128, 256];
    let t: Vec<f64> = gpus
        .iter()
        .map(|&n| tflops(&m, &Cluster::new(&cat, "a100-80gb", n, None).unwrap(), 256, 2048, &c))
        .collect();
    for w in t.windows(2) {
        assert!(w[1] < w[0], "per-GPU TFLOP/s must fall as the batch of 256 spreads: {t:?}");
    }
    eprintln!("zero-3 per-GPU TFLOP/s at 32/64/128/256 GPUs: {t:?}");
    assert!(t[3] < 0.7 * t[0], "at one sequence per GPU ZeRO-3's gathers are exposed: {t:?}");
}

/// Strong scaling at a fixed batch (MegaScale Table 2, Megatron-LM README): more data-parallel pipelines
/// means fewer micro-batches each, a larger bubble share and relatively more gradient traffic, so per-GPU
/// throughput (the scaling efficiency) falls.
#[test]
fn strong_scaling_efficiency_falls_at_fixed_batch() {
    let m = plan::models::ModelShape::gpt("gpt-175b", 96, 12288, 96, 51200, 2048).unwrap();
    let setup = plan::setup::Setup::preset("megatron-2024").unwrap();
    let c = Constraints {
        tp: Some(8),
        pp: Some(8),
        cp: Some(1),
        virtual_stages: Some(6),
        micro_batch: Some(1),
        recompute: Some(plan::policy::Recompute::Selective),
        precision: setup.precision,
        attention: setup.attention,
        overlap_dp: Some(true),
        overlap_comm: Some(true),
        fp32_grads: Some(true),
        zero: setup.zero,
        uneven_pipeline: Some(true),
        ..Default::default()
    };
    let gpus = [512u64, 1024, 2048, 3072];
    let t: Vec<f64> = gpus.iter().map(|&n| tflops(&m, &h100(n), 768, 2048, &c)).collect();
    for w in t.windows(2) {
        assert!(w[1] < w[0], "strong scaling at batch 768: {t:?}");
    }
    eprintln!("strong scaling per-GPU TFLOP/s at 512/1024/2048/3072 GPUs: {t:?}");
    assert!(t[3] < 0.9 * t[0], "efficiency at 6x the GPUs: {t:?}");
}

/// Collective latency over very many ranks: with one rank per node NCCL's PAT all-gather / reduce-scatter takes
/// ⌈log₂n⌉ network steps, not n − 1, so 16× the ranks costs a few more steps, not 16× the latency; with 8 ranks per
/// node only the node-crossing steps pay the network latency.
#[test]
fn large_n_collective_latency_is_not_linear() {
    let cl = h100(16384 * 8);
    let one_per_node = |n: u64| group_link(&cl, n, 8);
    let (small, big) = (collective_latency(one_per_node(1024)), collective_latency(one_per_node(16384)));
    assert!(big < 2.0 * small, "16x ranks: {small} s -> {big} s");
    assert!(big > small, "still grows: {small} s -> {big} s");
    // A tiny message is latency-bound: time grows like log n.
    let t = |n: u64| reduce_scatter_time(one_per_node(n), 1024.0);
    assert!(t(16384) / t(64) < 3.0, "{} vs {}", t(16384), t(64));
    // 8 ranks per node: n/8 network steps and 7n/8 NVLink steps, cheaper than n network steps.
    let full = group_link(&cl, 4096, 1);
    assert!(full.ranks_per_node == 8.0 && full.inter_node);
    assert!(collective_latency(full) < 0.6 * 4095.0 * full.latency, "{}", collective_latency(full));
}

/// `kiln plan estimate` says which software it assumed, in text and JSON, and `--setup` changes it; explicit flags
/// override the preset.
#[test]
fn estimate_prints_and_reports_its_setup() {
    let m = ModelArgs { model: Some("llama2-7b".into()), ..Default::default() };
    let c = ClusterArgs { gpu: "a100-80gb".into(), gpus: 16, ..Default::default() };
    let l = |setup: Option<&str>, precision: Option<&str>| LayoutArgs {
        global_batch: 64,
        setup: setup.map(String::from),
        precision: precision.map(String::from),
        ..Default::default()
    };
    let text = estimate_cmd(&m, &c, &l(Some("megatron-2021"), None), false).unwrap();
    assert!(text.contains("setup       megatron-2021: precision fp16, attention unfused, DP overlap off"), "{text}");
    let j: serde_json::Value = serde_json::from_str(&estimate_cmd(&m, &c, &l(Some("megatron-2021"), Some("bf16")), true).unwrap()).unwrap();
    assert_eq!(j["setup"]["name"], "megatron-2021");
    assert_eq!(j["setup"]["precision"], "bf16", "the flag overrides the preset");
    assert_eq!(j["setup"]["attention"], "unfused");
    assert_eq!(j["setup"]["overlap_dp"], false);
    let k: serde_json::Value = serde_json::from_str(&estimate_cmd(&m, &c, &l(None, None), true).unwrap()).unwrap();
    assert_eq!(k["setup"]["name"], "kiln");
    assert_eq!(k["setup"]["overlap_dp"], true);
    assert!(estimate_cmd(&m, &c, &l(Some("megatron-1999"), None), false).unwrap_err().0.contains("--setup"));
}

/// A catalogue row and `kiln plan estimate` with the row's layout and setup as flags predict the same step:
/// estimate and validate share one setup, so they cannot disagree silently.
#[test]
fn validate_and_estimate_agree_on_a_row() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/catalog/published_runs.csv");
    let json: serde_json::Value = serde_json::from_str(&plan::cli::validate_cmd(path, None, true).unwrap()).unwrap();
    let row = json["rows"].as_array().unwrap().iter().find(|r| r["name"] == "megatron_h100_70b_768").unwrap();
    let ch = &row["chosen"];
    let m = ModelArgs {
        layers: Some(84),
        hidden: Some(8192),
        heads: Some(64),
        vocab: Some(131072),
        ..Default::default()
    };
    let c = ClusterArgs { gpu: "h100-sxm".into(), gpus: 768, ..Default::default() };
    let l = LayoutArgs {
        global_batch: 384,
        seq: Some(4096),
        setup: Some("megatron-2024".into()),
        tp: Some(8),
        pp: Some(2),
        cp: Some(1),
        micro_batch: ch["micro_batch"].as_u64(),
        virtual_stages: ch["virtual_stages"].as_u64(),
        recompute: ch["recompute"].as_str().map(String::from),
        sequence_parallel: ch["sequence_parallel"].as_bool(),
        ..Default::default()
    };
    let e: serde_json::Value = serde_json::from_str(&estimate_cmd(&m, &c, &l, true).unwrap()).unwrap();
    let (a, b) = (e["step_time_s"].as_f64().unwrap(), row["step_time_s"].as_f64().unwrap());
    assert!((a - b).abs() < 1e-9 * b, "estimate {a} s vs validate {b} s");
    assert_eq!(e["setup"], row["setup"]);
}

/// MPT on llm-foundry, H100, 128 → 512 GPUs at a fixed batch per GPU: FSDP issues one all-gather and one
/// reduce-scatter per wrapped block, each paying the ring latency across the nodes, so the hidden traffic grows with
/// the ranks even though the bytes per GPU do not, and the compute under it slows (`OVERLAP_CONTENTION`): weak
/// scaling loses per-GPU throughput. The charge is exactly the constant times the hidden part.
#[test]
fn fsdp_weak_scaling_loses_throughput_through_per_unit_collective_latency() {
    // MPT-7B (llm-foundry `mpt-7b.yaml`): 32 layers, d 4096, 32 heads, vocab 50368; 6 sequences of 2048 per GPU.
    let m = plan::models::ModelShape::gpt("mpt-7b", 32, 4096, 32, 50368, 2048).unwrap();
    let setup = plan::setup::Setup::preset("fsdp").unwrap();
    let est = |gpus: u64| {
        let c = Constraints {
            tp: Some(1),
            pp: Some(1),
            cp: Some(1),
            micro_batch: Some(6),
            zero: Some(3),
            recompute: Some(plan::policy::Recompute::None),
            precision: setup.precision,
            attention: setup.attention,
            overlap_dp: Some(true),
            fp32_grads: Some(false),
            ..Default::default()
        };
        let r = search(&m, &h100(gpus), 6 * gpus, 2048, &c).unwrap();
        r.plans.first().or(r.smallest_unfit.as_ref()).unwrap().clone()
    };
    let (e128, e512) = (est(128), est(512));
    let (b128, b512) = (&e128.breakdown, &e512.breakdown);
    // Same bytes per GPU, more latency: 3 collectives × 32 units per micro-batch.
    let lat = |n: u64| collective_latency(group_link(&h100(n), n, 1));
    let extra = 96.0 * (lat(512) - lat(128));
    assert!(extra > 0.1, "per-unit latency across 64 vs 16 nodes: {extra} s");
    let grown = b512.dp_comm_total_s - b128.dp_comm_total_s;
    assert!((grown - extra).abs() < 0.02 * extra, "ZeRO-3 traffic grows by the units' latency: {grown} vs {extra}");
    for b in [b128, b512] {
        let hidden = b.dp_comm_total_s - b.dp_comm_exposed_s;
        assert!((b.overlap_contention_s - plan::cost::OVERLAP_CONTENTION * hidden).abs() < 1e-12);
    }
    assert!(e512.model_tflops_per_gpu < 0.97 * e128.model_tflops_per_gpu, "{} vs {}", e512.model_tflops_per_gpu, e128.model_tflops_per_gpu);
}
