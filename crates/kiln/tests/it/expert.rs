//! Expert parallelism through `kiln train --ep N` (in-process ranks): per-step losses against
//! one rank, the checkpoint holding the whole model, the all-to-all bytes against their
//! formula, and the configuration errors.

use crate::common::*;
use std::path::Path;

/// A 2-layer MoE model (4 experts, top-2, one shared expert), 8 sequences per step, dropless.
const MOE: &[&str] = &[
    "--set", "model.arch=llama", "--set", "model.n_layer=2", "--set", "model.tied_embeddings=false", "--set", "model.n_expert=4",
    "--set", "model.top_k=2", "--set", "model.n_shared_expert=1", "--set", "model.ffn_hidden=16", "--set", "model.capacity_factor=0",
    "--set", "train.batch_size=8", "--set", "sample.tokens=0", "--set", "checkpoint.interval=0", "--max-steps", "8",
];

fn run(data: &Path, out: &Path, extra: &[&str]) {
    let o = train(data, out, &[MOE, extra].concat());
    assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
}

fn train_lines(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).filter(|v| v["kind"] == "train").collect()
}

#[test]
fn expert_parallel_runs_match_one_rank() {
    let d = scratch("ep-equiv");
    let data = corpus(&d);
    let one = d.join("one");
    run(&data, &one, &[]);
    let base = losses(&one);
    assert_eq!(base.len(), 8);
    for (name, layout, p) in [("ep2", &["--ep", "2"][..], 2u64), ("ep4", &["--ep", "4"][..], 4), ("dp2ep2", &["--dp", "2", "--ep", "2"][..], 2), ("pp2ep2", &["--pp", "2", "--ep", "2", "--micro-batches", "2"][..], 2)] {
        let out = d.join(name);
        run(&data, &out, layout);
        for ((s, a), (_, b)) in losses(&out).iter().zip(&base) {
            assert!(((a - b) / b).abs() <= 1e-5, "{name} step {s}: loss {a} vs one rank {b}");
        }
        // The checkpoint holds the whole model (every expert): it evaluates on one rank.
        let e = kiln(&["eval", "--run", out.to_str().unwrap()]);
        assert!(e.status.success(), "{name}: {}", stderr(&e));
        // Rank 0's all-to-all bytes: per layer, the counts ((p−1)·E/p u32s), then four row
        // all-to-alls of C = 16 floats a row — the dispatch and backward's d(eo) send the rows
        // routed to other ranks' experts, the two returns the rows received from them.
        if name.starts_with("pp") {
            // Rank 0 holds only the first stage's layer: its bytes are not this formula's.
            continue;
        }
        for line in train_lines(&out) {
            let g = |k: &str| line[k].as_u64().unwrap_or_else(|| panic!("{k} missing: {line}"));
            let want = 2 * 4 * 16 * (g("moe_ep_rows_sent") + g("moe_ep_rows_received")) + 2 * 4 * (p - 1) * 4 / p;
            assert_eq!(g("comm_bytes_sent_all_to_all"), want, "{name}: {line}");
        }
    }
}

#[test]
fn expert_parallel_errors_name_the_key() {
    let d = scratch("ep-errors");
    let data = corpus(&d);
    let out = d.join("run");
    for (extra, needle) in [
        (&["--ep", "3"][..], "parallel.ep = 3 does not divide model.n_expert = 4"),
        (&["--ep", "0"][..], "parallel.ep must be positive"),
        (&["--ep", "2", "--set", "model.n_expert=0"][..], "parallel.ep = 2 needs a mixture-of-experts model (model.n_expert > 0"),
        (&["--ep", "2", "--zero", "1"][..], "parallel.ep = 2 with parallel.zero = 1"),
        (&["--ep", "4", "--dp", "3"][..], "parallel.dp = 3 × parallel.ep = 4 = 12 ranks split the batch"),
        (&["--ep", "4", "--set", "train.batch_size=6"][..], "parallel.dp = 1 × parallel.ep = 4 = 4 ranks split the batch"),
    ] {
        let o = train(&data, &out, &[MOE, extra].concat());
        assert_user_error(&o, &[needle]);
        assert!(!out.exists(), "{extra:?}: a bad config must not create the run directory");
    }
    // With --init-from the layout is checked against the base's model, not the preset's: a
    // Mixtral base splits over two expert-parallel ranks; a dense base is refused, writing nothing.
    let mixtral = fixture("fixtures/mixtral-tiny");
    let dense = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/qwen3-tiny");
    let run = |base: &std::path::Path, out: &std::path::Path| {
        kiln(&["train", "--init-from", base.to_str().unwrap(), "--ep", "2", "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--set", "data.tokenizer=char",
            "--seq-len", "16", "--max-steps", "1", "--set", "eval.iters=1", "--set", "sample.tokens=0", "--quiet"])
    };
    let o = run(&mixtral, &out);
    assert!(o.status.success(), "{}", stderr(&o));
    let out2 = d.join("dense");
    let o = run(&dense, &out2);
    assert_user_error(&o, &["parallel.ep = 2 needs a mixture-of-experts model"]);
    assert!(!out2.exists());
    // The pipeline too: the base's 2 layers, not the preset's, bound the stages.
    let o = kiln(&["train", "--init-from", dense.to_str().unwrap(), "--pp", "3", "--data", data.to_str().unwrap(), "--out", out2.to_str().unwrap(), "--quiet"]);
    assert_user_error(&o, &["3 pipeline stages need at least 3 layers, the model has 2"]);
    assert!(!out2.exists());
}
