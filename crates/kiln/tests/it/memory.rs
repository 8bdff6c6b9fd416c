//! The memory plan: its activation figures against the model's own buffers, the
//! `kiln memory` command, and the plan against what a run's tracking allocator measures.

use crate::common::*;
use kiln::memory::{activation_set, activation_set_every, ElementBytes, FP32};
use model::gpt::Recompute;
use model::{Gpt, GptConfig};

const POLICIES: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

/// `activation_set` against `Gpt::reserve_activations` + `activation_bytes` (no forward needed).
fn check(name: &str, cfg: &GptConfig, shapes: &[(usize, usize)]) {
    for &(b, t) in shapes {
        // fp32, and bf16 with its 16-bit activation storage.
        for precision in [model::Precision::Fp32, model::Precision::Bf16, model::Precision::Fp16] {
            let bytes = ElementBytes::of(precision);
            for r in POLICIES {
                let mut m = Gpt::zeroed(cfg.clone(), cfg.vocab_size.min(256));
                (m.recompute, m.precision) = (r, precision);
                m.reserve_activations(b, t);
                let planned = activation_set(cfg, b, t, r, &bytes).total();
                assert_eq!(planned as usize, m.activation_bytes(), "{name} B {b} T {t} {r:?} {precision:?}");
            }
        }
        // Activation compression: the kept activations as 8- or 4-bit codes with group scales.
        for compression in [plan::policy::ActCompression::Int8, plan::policy::ActCompression::Int4] {
            let bytes = ElementBytes { compress: compression.bits(), ..FP32 };
            for r in POLICIES {
                let mut m = Gpt::zeroed(cfg.clone(), cfg.vocab_size.min(256));
                (m.recompute, m.act_compression) = (r, (compression, Default::default()));
                m.reserve_activations(b, t);
                let planned = activation_set(cfg, b, t, r, &bytes).total();
                assert_eq!(planned as usize, m.activation_bytes(), "{name} B {b} T {t} {r:?} {compression:?}");
            }
        }
        for every in [2, 3] {
            let mut m = Gpt::zeroed(cfg.clone(), cfg.vocab_size.min(256));
            (m.recompute, m.recompute_every) = (Recompute::Full, every);
            m.reserve_activations(b, t);
            let planned = activation_set_every(cfg, b, t, Recompute::Full, every, &FP32).total();
            assert_eq!(planned as usize, m.activation_bytes(), "{name} B {b} T {t} full every {every}");
        }
    }
}

#[test]
fn planned_activations_equal_the_models_buffers_for_every_policy() {
    // GPT-2: biases, tied head, a vocabulary large enough that the head runs in several chunks.
    let gpt2 = GptConfig::gpt2((3, 4, 64), 64, 70000, true, 0.0, true);
    check("gpt2", &gpt2, &[(2, 64), (3, 17)]);
    // LLaMA: grouped-query attention, SwiGLU, untied head.
    let mut llama = GptConfig::gpt2((2, 4, 64), 32, 300, false, 0.0, false);
    (llama.arch, llama.n_kv_head, llama.ffn_hidden) = (model::config::Arch::Llama, 2, GptConfig::llama_ffn(64));
    check("llama", &llama, &[(2, 32), (1, 5)]);
    // Qwen3's per-head q and k norms keep their inputs and statistics.
    check("qwen3", &GptConfig { qk_norm: true, head_dim: 24, ..llama.clone() }, &[(2, 32)]);
    // OLMo 2's norms after the branches keep their inputs; its whole-width q/k norms two rstd
    // a token; Gemma's sandwich norms both.
    let olmo2 = GptConfig { qk_norm: true, qk_norm_whole: true, block_norms: model::config::BlockNorms::Post, ..llama.clone() };
    check("olmo2", &olmo2, &[(2, 32), (1, 5)]);
    check("sandwich", &GptConfig { block_norms: model::config::BlockNorms::Sandwich, ..llama.clone() }, &[(2, 32)]);
    // DeepSeek's latent attention: the latents and the heads' values, with and without q's latent.
    let mla = GptConfig { n_kv_head: 4, head_dim: 24, rotary_dim: 8, v_head_dim: 16, kv_lora_rank: 12, q_lora_rank: 10, ..llama.clone() };
    check("mla", &mla, &[(2, 32), (1, 5)]);
    check("mla without q latent", &GptConfig { q_lora_rank: 0, ..mla.clone() }, &[(2, 32)]);
    check("mla sp shard", &parallel::tp::local_config(&mla, 2, 0, true).unwrap(), &[(2, 16)]);
    // DeepSeek-V3's shape: a dense layer before routed ones (every set holds both).
    let dsv3 = GptConfig { n_expert: 4, top_k: 2, n_shared_expert: 1, ffn_hidden: 24, moe_first_layer: 1, dense_ffn_hidden: 40, moe_aux_weight: 0.0, moe_z_weight: 0.0, moe_router: model::config::MoeRouter::Sigmoid, ..mla };
    check("deepseek-v3", &dsv3, &[(2, 32)]);
    check("olmo2 sp shard", &parallel::tp::local_config(&GptConfig { qk_norm: false, qk_norm_whole: false, ..olmo2.clone() }, 2, 0, true).unwrap(), &[(2, 16)]);
    // MoE: routed and shared experts, with and without a capacity limit.
    let mut moe = llama.clone();
    (moe.n_expert, moe.top_k, moe.n_shared_expert, moe.ffn_hidden, moe.capacity_factor) = (4, 2, 1, 48, 1.25);
    check("moe", &moe, &[(2, 32)]);
    moe.capacity_factor = 0.0;
    check("moe dropless", &moe, &[(1, 7)]);
    // A tensor-parallel shard and pipeline stages (no head on the first, no embedding on the last).
    check("tp shard", &parallel::tp::local_config(&llama, 2, 0, false).unwrap(), &[(2, 16)]);
    // Sequence parallel: the residual stream holds T/tp positions, the norms' outputs gathered.
    let sp = parallel::tp::local_config(&gpt2, 2, 0, true).unwrap();
    check("sp shard", &sp, &[(2, 16)]);
    let whole = GptConfig::gpt2((4, 4, 32), 16, 256, true, 0.0, false);
    check("first stage", &parallel::pp::stage_config(&whole, 0..2), &[(2, 16)]);
    check("last stage", &parallel::pp::stage_config(&whole, 2..4), &[(2, 16)]);
}

#[test]
fn recomputation_shrinks_the_plan_as_the_policies_say() {
    // GPT-2 124M at B 4, T 1024: per layer `none` keeps 16 C floats per token (plus statistics
    // and the log-sum-exp), `selective` 4 C, `full` C; the rest is shared by all layers.
    let cfg = GptConfig::gpt2_124m();
    let a = |r| activation_set(&cfg, 4, 1024, r, &FP32);
    let (none, sel, full) = (a(Recompute::None), a(Recompute::Selective), a(Recompute::Full));
    assert!(none.total() > sel.total() && sel.total() > full.total());
    let per_layer = |x: u64, y: u64| (x - y) as f64 / 11.0; // the difference of 12 layers' sets vs one
    let n = 4.0 * 1024.0;
    // none − full = 11 sets of (ln_1, res_2, ln_2, qkv, atty, fch, fch_gelu) = 15 C per token, plus stats and lse.
    let d = per_layer(none.total(), full.total()) / (4.0 * n * 768.0);
    assert!((15.0..15.1).contains(&d), "none − full per layer: {d} C floats per token");
}

#[test]
fn memory_command_prints_the_plan_and_json() {
    let d = scratch("memory-cmd");
    let data = corpus(&d);
    let base = ["memory", "--data", data.to_str().unwrap(), "--set", "model.n_layer=2", "--set", "model.n_embd=32", "--set", "model.n_head=2", "--set", "model.block_size=16"];
    let o = kiln(&base);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = stdout(&o);
    for needle in ["memory plan (per rank)", "parameters", "optimizer state", "activations · attention", "total per rank"] {
        assert!(table.contains(needle), "table should show `{needle}`:\n{table}");
    }
    let mut args = base.to_vec();
    args.extend(["--json", "--dp", "2", "--zero", "3"]);
    let o = kiln(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    // The parameters row is this rank's ZeRO-3 shard: half of the model, padded per unit.
    let cfg = kiln::config::RunConfig::resolve(&{
        let mut raw = kiln::presets::preset("tiny").unwrap().to_raw();
        for kv in ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16"] {
            kiln::config::apply_set(&mut raw, kv).unwrap();
        }
        raw
    })
    .unwrap();
    let m = Gpt::zeroed(cfg.gpt_config(256), 256);
    let shard: usize = m.units.iter().map(|u| u.len().div_ceil(2)).sum();
    let row = |name: &str| v["rows"].as_array().unwrap().iter().find(|r| r["name"] == name).unwrap_or_else(|| panic!("no row {name}: {v}")).clone();
    assert_eq!(row("parameters")["bytes"].as_u64().unwrap() as usize, 4 * shard);
    assert_eq!(row("AdamW m, v")["bytes"].as_u64().unwrap() as usize, 8 * shard);
    assert!(row("ZeRO unit buffers")["bytes"].as_u64().unwrap() > 0);
    assert_eq!(v["ranks_per_process"], 2);
    assert!(v["total_bytes"].as_u64().unwrap() >= v["step_peak_bytes"].as_u64().unwrap());
}

/// Held to the machine's available memory, a plan needs `HEADROOM_PERCENT` over itself: a
/// budget just above the plan refuses the run (naming the headroom), one above the plan and its
/// headroom lets it through; an explicit `memory.limit` is held to the plan alone.
#[test]
fn the_machine_budget_keeps_headroom_over_the_plan() {
    use kiln::memory::{guard, HEADROOM_PERCENT};
    let cfg = kiln::config::RunConfig::resolve(&kiln::presets::preset("tiny").unwrap().to_raw()).unwrap();
    let plan = kiln::memory::plan_run(&cfg, &cfg.gpt_config(256), 0).unwrap();
    let need = plan.process_total();
    guard::cap(need + need / 100);
    let err = plan.check_budget(&guard::Budget::of(0)).unwrap_err().to_string();
    assert!(err.contains(&format!("{HEADROOM_PERCENT} % headroom")) && err.contains("refused before allocating"), "{err}");
    guard::cap(need + need * (HEADROOM_PERCENT + 1) / 100);
    plan.check_budget(&guard::Budget::of(0)).unwrap();
    guard::cap(0);
}

#[test]
fn tracked_peaks_are_logged_and_the_plan_predicts_them() {
    let d = scratch("memory-tracked");
    let data = corpus(&d);
    // One run (each start-up measures the matmul peak, which dominates a test's time): two
    // in-process ranks under ZeRO-2, so the ZeRO replay and the per-process sum are exercised;
    // scripts/check_memory.sh covers the other layouts.
    for (name, extra) in [("zero2-dp2", &["--dp", "2", "--zero", "2"][..])] {
        let out = d.join(name);
        let mut args = vec!["train", "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--max-steps", "1", "--quiet"];
        // Large enough that what the plan leaves out (gemm's packing buffers, kernel scratch
        // pools: about 2 MB here) is well under its tolerance.
        let shape = ["model.n_layer=2", "model.n_embd=256", "model.n_head=4", "model.block_size=128", "train.batch_size=8", "eval.iters=1", "eval.batch_size=4", "checkpoint.interval=0", "sample.tokens=0"];
        for kv in shape {
            args.extend(["--set", kv]);
        }
        args.extend_from_slice(extra);
        let o = kiln(&args);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let last: serde_json::Value = lines.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).rfind(|v| v["kind"] == "train").unwrap();
        let tracked = last["mem_tracked_peak_bytes"].as_f64().unwrap();
        for c in ["params", "grads", "optimizer", "activations", "other"] {
            assert!(last[format!("mem_tracked_peak_{c}_bytes")].as_u64().is_some(), "{name}: no {c} peak in {last}");
        }
        // The plan of the same run: its ranks' step peak and the data, against the allocator.
        let mut margs = args.clone();
        margs[0] = "memory";
        margs.retain(|a| *a != "--quiet");
        let pos = margs.iter().position(|a| *a == "--out").unwrap();
        margs.drain(pos..pos + 2);
        margs.push("--json");
        let p: serde_json::Value = serde_json::from_str(&stdout(&kiln(&margs))).unwrap();
        let ranks = p["ranks_per_process"].as_u64().unwrap();
        // The tracker counts the process: every in-process rank's parameters.
        assert_eq!(last["mem_tracked_peak_params_bytes"].as_u64().unwrap(), ranks * last["mem_params_bytes"].as_u64().unwrap(), "{name}: {last}");
        let planned = ranks as f64 * p["step_peak_bytes"].as_f64().unwrap() + p["data_bytes"].as_f64().unwrap();
        let err = (planned - tracked).abs() / tracked;
        assert!(err < 0.10, "{name}: planned {planned} vs tracked peak {tracked} ({:.1}%)", 100.0 * err);
    }
}

#[test]
fn sizes_parse_with_decimal_and_binary_units() {
    use kiln::util::parse_size;
    assert_eq!(parse_size("0"), Ok(0));
    assert_eq!(parse_size("1500MB"), Ok(1_500_000_000));
    assert_eq!(parse_size("2GiB"), Ok(2 << 30));
    assert_eq!(parse_size("1.5 kib"), Ok(1536));
    assert_eq!(parse_size("123"), Ok(123));
    assert!(parse_size("2 XB").unwrap_err().contains("unknown unit `XB`"));
    assert!(parse_size("GiB").unwrap_err().contains("not a size"));
    assert!(parse_size("1.2.3MB").unwrap_err().contains("not a size"));
}

#[test]
fn the_plan_knows_pipeline_stages_and_their_micro_batches_in_flight() {
    // Stage 0 of a 2-stage pipeline over 4 layers, 4 micro-batches: GPipe holds all 4 activation
    // sets, 1F1B at most 2 — planned, and measured by the run itself.
    let d = scratch("memory-pp");
    let data = corpus(&d);
    for (sched, sets) in [("gpipe", 4), ("1f1b", 2)] {
        let shape = ["--set", "model.n_layer=4", "--set", "train.batch_size=8", "--micro-batches", "4", "--pp", "2", "--schedule", sched];
        let o = kiln(&[&["memory", "--data", data.to_str().unwrap(), "--json"][..], SMALL_MEMORY, &shape].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        let planned: u64 = v["rows"].as_array().unwrap().iter().filter(|r| r["kind"] == "activations").map(|r| r["bytes"].as_u64().unwrap()).sum();
        assert!(v["layout"].as_str().unwrap().contains(&format!("{sets} micro-batch activation sets in flight")), "{v}");
        let out = d.join(sched);
        let o = train(&data, &out, &[&shape[..], &["--max-steps", "2", "--pp-trace", "wall", "--set", "sample.tokens=0"]].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        let line: serde_json::Value = serde_json::from_str(std::fs::read_to_string(out.join("pipeline/rank-000.jsonl")).unwrap().lines().last().unwrap()).unwrap();
        assert_eq!(line["peak_in_flight"].as_u64().unwrap(), sets);
        assert_eq!(line["peak_activation_bytes"].as_u64().unwrap(), planned, "{sched}: planned {planned} vs measured {line}");
    }
}

/// `kiln memory` with `SMALL`'s model (the flags `train` gets from `common::train`).
const SMALL_MEMORY: &[&str] = &["--set", "model.n_layer=1", "--set", "model.n_head=2", "--set", "model.n_embd=16", "--set", "model.block_size=16", "--set", "train.batch_size=4"];

/// Activation compression (`memory.activation_compression`): int8 and int4 kept activations
/// train close to the uncompressed run and hold fewer activation bytes; stochastic rounding is
/// deterministic from the seed; it composes with tensor, context, pipeline, data (ZeRO-3) and
/// expert parallelism, mixture-of-experts layers and selective recomputation; full
/// recomputation is refused by name.
#[test]
fn activation_compression_trains_close_to_uncompressed_and_holds_less() {
    let d = scratch("act-compression");
    let data = corpus(&d);
    let shape = ["--max-steps", "12", "--set", "model.n_layer=2", "--set", "model.n_head=4", "--set", "model.n_embd=64", "--set", "model.block_size=64", "--set", "model.dropout=0.1", "--set", "eval.interval=12", "--set", "checkpoint.interval=0", "--set", "sample.tokens=0"];
    let run = |name: &str, extra: &[&str]| -> (f64, u64) {
        let out = d.join(name);
        let o = train(&data, &out, &[&shape[..], extra].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let val = lines.iter().rfind(|v| v["kind"] == "eval").unwrap()["val_loss"].as_f64().unwrap();
        let acts = lines.iter().rfind(|v| v["kind"] == "train").unwrap()["mem_activations_bytes"].as_u64().unwrap();
        (val, acts)
    };
    let (v0, a0) = run("none", &[]);
    for (name, extra, tol) in [
        ("int8", &["--set", "memory.activation_compression=int8"][..], 1e-4),
        ("int4", &["--set", "memory.activation_compression=int4"], 1e-3),
        ("int8-stochastic", &["--set", "memory.activation_compression=int8", "--set", "memory.activation_rounding=stochastic"], 1e-4),
        ("int8-tp2-cp2-selective", &["--set", "memory.activation_compression=int8", "--tp", "2", "--cp", "2", "--set", "model.recompute=selective"], 1e-4),
        ("int8-pp2-dp2-zero3", &["--set", "memory.activation_compression=int8", "--pp", "2", "--dp", "2", "--zero", "3"], 1e-4),
    ] {
        let (v, a) = run(name, extra);
        assert!(((v - v0) / v0).abs() < tol, "{name}: val loss {v} vs uncompressed {v0}");
        assert!(a < a0, "{name}: {a} activation bytes vs {a0}");
        if name == "int8-stochastic" {
            assert_eq!(run("int8-stochastic-again", extra).0, v, "stochastic rounding is deterministic from the seed");
        }
    }
    // Mixture-of-experts layers: the routing kept exact, the experts' activations compressed,
    // on one rank and with the experts split over two (expert parallelism).
    let moe = ["--set", "model.arch=llama", "--set", "model.n_expert=4", "--set", "model.n_kv_head=2", "--set", "model.dropout=0"];
    let (m0, ma0) = run("moe-none", &moe);
    for (name, extra) in [("moe-int8", &["--set", "memory.activation_compression=int8"][..]), ("moe-int8-ep2", &["--set", "memory.activation_compression=int8", "--ep", "2"])] {
        let (v, a) = run(name, &[&moe[..], extra].concat());
        // (Looser than the dense layers': compression noise flips some routing choices.)
        assert!(((v - m0) / m0).abs() < 3e-3, "{name}: val loss {v} vs uncompressed {m0}");
        assert!(a < ma0, "{name}: {a} activation bytes vs {ma0}");
    }
    for (extra, needle) in [
        (&["--set", "memory.activation_compression=int8", "--recompute", "full"][..], "needs model.recompute = none or selective"),
        (&["--set", "memory.activation_compression=int2"], "memory.activation_compression"),
    ] {
        let out = d.join("bad");
        assert_user_error(&train(&data, &out, extra), &[needle]);
        assert!(!out.exists());
    }
}
