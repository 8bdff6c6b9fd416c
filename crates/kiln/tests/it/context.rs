//! Context parallelism (`kiln train --cp N`): ring attention and Ulysses, contiguous and
//! zig-zag chunks, against one rank — GPT-2 and LLaMA (GQA, a sliding window) blocks, dropout
//! on, packed documents, composed with tensor/sequence parallelism and with data × pipeline
//! parallelism — and the bytes each moves, against the formulas of `parallel::cp`.

use crate::common::*;
use std::path::Path;

/// A model whose 4 heads split 2 and 4 ways, 20 steps with dropout, evaluation at 10 and 20.
const CP: &[&str] = &[
    "--max-steps", "20", "--set", "model.n_layer=2", "--set", "model.n_head=4", "--set", "model.n_embd=32", "--set", "model.block_size=32",
    "--set", "model.dropout=0.1", "--set", "eval.interval=10", "--set", "checkpoint.interval=0", "--set", "sample.tokens=0",
];
const LLAMA: &[&str] = &["--set", "model.arch=llama", "--set", "model.bias=false", "--set", "model.n_kv_head=2", "--set", "model.sliding_window=6", "--set", "model.window_layers=[1]"];
/// Attention sinks: the first 2 positions stay visible beyond the window.
const SINKS: &[&str] = &["--set", "model.attn_sinks=2"];

fn run(data: &Path, out: &Path, extra: &[&str]) {
    let o = train(data, out, &[CP, extra].concat());
    assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
}

fn lines(run: &Path, kind: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).filter(|v| v["kind"] == kind).collect()
}

/// Per-step train losses within `tol` relative of the reference's, and the held-out losses.
fn assert_matches(a: &Path, reference: &Path, what: &str) {
    let (x, y) = (losses(a), losses(reference));
    assert_eq!(x.len(), 20, "{what}");
    assert_eq!(x.len(), y.len(), "{what}");
    for ((s, p), (_, q)) in x.iter().zip(&y) {
        assert!(((p - q) / q).abs() <= 1e-5, "{what} step {s}: loss {p} vs one rank {q}");
    }
    let val = |r: &Path| lines(r, "eval").iter().map(|v| v["val_loss"].as_f64().unwrap()).collect::<Vec<_>>();
    let (va, vb) = (val(a), val(reference));
    assert_eq!(va.len(), 2, "{what}: two evaluations");
    for (p, q) in va.iter().zip(&vb) {
        assert!(((p - q) / q).abs() <= 1e-5, "{what}: val loss {p} vs one rank {q}");
    }
}

/// Bytes one rank sends per step, from step 3's line: `(send_recv, all_to_all)`.
fn sent(run: &Path) -> (f64, f64) {
    let line = &lines(run, "train")[2];
    let op = |k: &str| line[format!("comm_bytes_sent_{k}")].as_f64().unwrap_or(0.0);
    (op("send_recv"), op("all_to_all"))
}

/// `parallel::cp`'s formulas for an MHA model of `layers` layers, `c` channels, `nh` heads, a
/// micro-batch of `rows` sequences of `t`, on `n` ranks, per step: ring — `(n−1)` key/value
/// blocks forward, `(n−1) + n` (their gradients travel home) backward, a block
/// `rows·(t/n)·2c` floats; Ulysses — `(n−1)` chunks per all-to-all: q|k|v and the output
/// forward, q|k|v, the output gradient, `D` and `dq|dk|dv` backward, each chunk the rank's
/// `rows·(t/n)` positions of the receiver's heads.
fn formula(ring: bool, n: f64, layers: f64, rows: f64, t: f64, c: f64, nh: f64) -> f64 {
    let tl = t / n;
    if ring {
        let kv = rows * tl * 2.0 * c * 4.0;
        return layers * (3.0 * n - 2.0) * kv;
    }
    let (hq, hs) = (nh / n, c / nh);
    let chunk = |w: f64| (n - 1.0) * rows * tl * w * 4.0;
    let (qkv, o, d) = (chunk(3.0 * hq * hs), chunk(hq * hs), chunk(hq));
    layers * (qkv + o + qkv + o + d + qkv)
}

#[test]
fn context_parallel_matches_one_rank() {
    let d = scratch("cp-equiv");
    let data = corpus(&d);
    // GPT-2: ring and Ulysses, 2 and 4 ranks, zig-zag and contiguous chunks.
    let one = d.join("gpt2-one");
    run(&data, &one, &[]);
    for (cp, mode, balance) in [("2", "ring", "zigzag"), ("4", "ring", "none"), ("2", "ulysses", "zigzag"), ("4", "ulysses", "none")] {
        let out = d.join(format!("gpt2-cp{cp}-{mode}-{balance}"));
        run(&data, &out, &["--cp", cp, "--cp-mode", mode, "--cp-balance", balance]);
        assert_matches(&out, &one, &format!("gpt2 cp {cp} {mode} {balance}"));
        let n: f64 = cp.parse().unwrap();
        let want = formula(mode == "ring", n, 2.0, 4.0, 32.0, 32.0, 4.0);
        let (p2p, a2a) = sent(&out);
        assert_eq!(if mode == "ring" { (p2p, a2a) } else { (a2a, p2p) }, (want, 0.0), "gpt2 cp {cp} {mode}: bytes per step");
        // Zig-zag chunks give every rank the same attention work (visible score pairs); with
        // contiguous chunks causal attention costs the last ring rank most. (Ulysses splits
        // heads: balanced either way.)
        let line = &lines(&out, "train")[2];
        let skew = line["cp_pairs_max_over_mean"].as_f64().unwrap();
        match (mode, balance) {
            ("ring", "none") => assert!(skew > 1.5, "gpt2 cp {cp} ring, contiguous: work skew {skew}"),
            _ => assert_eq!(skew, 1.0, "gpt2 cp {cp} {mode} {balance}: work skew"),
        }
    }
    // LLaMA with grouped-query attention (2 kv heads: split 2 ways, shared by pairs of 4
    // Ulysses ranks) and a 6-token sliding window on its second layer (there most ring blocks of
    // 4 ranks are skipped; the first attends to every earlier position).
    let one = d.join("llama-one");
    run(&data, &one, LLAMA);
    for extra in [&["--cp", "2", "--cp-balance", "none"][..], &["--cp", "4"], &["--cp", "4", "--cp-mode", "ulysses"], &["--cp", "2", "--tp", "2", "--sequence-parallel"]] {
        let out = d.join(format!("llama{}", extra.join("")));
        run(&data, &out, &[LLAMA, extra].concat());
        assert_matches(&out, &one, &format!("llama {extra:?}"));
    }
    // With attention sinks no ring block is skipped for the window (a far block may hold a
    // document's first keys): the kernel skips the tiles no query sees.
    let one = d.join("llama-sinks-one");
    run(&data, &one, &[LLAMA, SINKS].concat());
    for extra in [&["--cp", "4"][..], &["--cp", "2", "--cp-mode", "ulysses"]] {
        let out = d.join(format!("llama-sinks{}", extra.join("")));
        run(&data, &out, &[LLAMA, SINKS, extra].concat());
        assert_matches(&out, &one, &format!("llama with sinks {extra:?}"));
    }
    // A mixture-of-experts model (dropless routing): the load-balancing statistics are summed
    // over the ranks that hold the sequence's positions, as over data-parallel ranks.
    let moe = ["--set", "model.arch=llama", "--set", "model.bias=false", "--set", "model.n_expert=4", "--set", "model.top_k=2"];
    let one = d.join("moe-one");
    run(&data, &one, &moe);
    let out = d.join("moe-cp2");
    run(&data, &out, &[&moe[..], &["--cp", "2"]].concat());
    assert_matches(&out, &one, "MoE cp 2");
    // Data parallel × pipeline × context parallel on 8 in-process ranks, against one rank
    // accumulating the same two micro-batches.
    let acc = ["--set", "train.batch_size=8", "--micro-batches", "2"];
    let one = d.join("gpt2-one-accum2");
    run(&data, &one, &acc);
    let out = d.join("gpt2-dp2-pp2-cp2");
    run(&data, &out, &[&acc[..], &["--dp", "2", "--pp", "2", "--cp", "2", "--zero", "1"]].concat());
    assert_matches(&out, &one, "dp 2 × pp 2 × cp 2");
    // Packed documents (positions restarting per document): attention never crosses a
    // document, whichever rank holds its keys.
    let docs = d.join("docs.jsonl");
    let words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"];
    let mut text = String::new();
    for i in 0..400usize {
        let n = 1 + (i * 7919) % 9;
        let doc: Vec<&str> = (0..n).map(|k| words[(i * 31 + k * 17) % words.len()]).collect();
        text.push_str(&serde_json::json!({ "text": doc.join(" ") }).to_string());
        text.push('\n');
    }
    std::fs::write(&docs, text).unwrap();
    let packed = [&["--packing", "documents", "--reset-positions"][..], LLAMA].concat();
    let one = d.join("docs-one");
    run(&docs, &one, &packed);
    for mode in ["ring", "ulysses"] {
        let out = d.join(format!("docs-cp2-{mode}"));
        run(&docs, &out, &[&packed[..], &["--cp", "2", "--cp-mode", mode]].concat());
        assert_matches(&out, &one, &format!("packed documents cp 2 {mode}"));
    }
}

#[test]
fn context_parallel_shapes_it_cannot_split_and_sinks_without_a_window_are_refused() {
    let d = scratch("cp-errors");
    let data = corpus(&d);
    for (extra, needle) in [
        (&["--cp", "3"][..], "train.seq_len = 16 does not split into 2 × parallel.cp = 6 zig-zag chunks"),
        (&["--cp", "3", "--cp-balance", "none"], "train.seq_len = 16 does not split into parallel.cp = 3 chunks"),
        (&["--cp", "4", "--cp-mode", "ulysses"], "parallel.cp_mode = ulysses needs the attention heads of each tensor-parallel rank (2) divisible by parallel.cp = 4"),
        (&["--cp", "0"], "parallel.cp must be positive, got 0"),
        (&["--cp", "2", "--cp-mode", "stripes"], "parallel.cp_mode"),
        (&["--set", "model.attn_sinks=2"], "model.attn_sinks = 2 needs a sliding window (model.sliding_window)"),
    ] {
        let out = d.join("bad");
        let o = train(&data, &out, extra);
        assert_user_error(&o, &[needle]);
        assert!(!out.exists(), "{extra:?}: a refused config must not create the run directory");
    }
}

#[test]
fn context_parallel_divides_activations_and_the_plan_predicts_what_it_holds() {
    let d = scratch("cp-memory");
    let data = corpus(&d);
    // LLaMA-shaped (GQA, SwiGLU, RMSNorm), one sequence of 2048 positions.
    let shape: Vec<String> = ["model.arch=llama", "model.bias=false", "model.n_layer=4", "model.n_head=8", "model.n_kv_head=2", "model.n_embd=256", "model.block_size=2048", "train.batch_size=1", "eval.iters=1", "eval.interval=0", "checkpoint.interval=0", "sample.tokens=0"]
        .iter()
        .flat_map(|kv| ["--set".to_string(), kv.to_string()])
        .collect();
    let shape: Vec<&str> = shape.iter().map(String::as_str).collect();
    let plan = |extra: &[&str]| -> serde_json::Value {
        let o = kiln(&[&["memory", "--data", data.to_str().unwrap(), "--json"][..], &shape, extra].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str(&stdout(&o)).unwrap()
    };
    let rows = |v: &serde_json::Value, f: &dyn Fn(&serde_json::Value) -> bool| v["rows"].as_array().unwrap().iter().filter(|r| f(r)).map(|r| r["bytes"].as_u64().unwrap()).sum::<u64>();
    let one = plan(&[]);
    let one_acts = rows(&one, &|r| r["kind"] == "activations");
    for mode in ["ring", "ulysses"] {
        let p = plan(&["--cp", "4", "--cp-mode", mode]);
        // A rank's activations and its attention exchange buffers, against one rank's.
        let mine = rows(&p, &|r| r["kind"] == "activations" || r["name"] == "context-parallel exchange");
        let ratio = mine as f64 / one_acts as f64;
        assert!(ratio <= 0.3, "cp 4 {mode}: {mine} bytes per rank vs {one_acts} on one rank ({ratio:.3})");
        assert!(rows(&p, &|r| r["name"] == "context-parallel exchange") > 0, "cp 4 {mode}: the exchange is planned");
    }
    // The tracked allocator's peak over a step of 4 in-process ranks, against the plan.
    let ring = plan(&["--cp", "4"]);
    let out = d.join("cp4");
    let o = kiln(&[&["train", "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--quiet", "--max-steps", "1", "--cp", "4"][..], &shape].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let last = lines(&out, "train").pop().unwrap();
    let tracked = last["mem_tracked_peak_bytes"].as_f64().unwrap();
    let planned = ring["ranks_per_process"].as_f64().unwrap() * ring["step_peak_bytes"].as_f64().unwrap() + ring["data_bytes"].as_f64().unwrap();
    let err = (planned - tracked).abs() / tracked;
    assert!(err < 0.05, "cp 4: planned {planned} vs tracked peak {tracked} ({:.1}%)", 100.0 * err);
    // A limit between the two: one rank is refused before it writes anything, four train.
    let limit = ((one["total_bytes"].as_u64().unwrap() + ring["total_bytes"].as_u64().unwrap()) / 2).to_string();
    let refused = d.join("one-limited");
    let o = kiln(&[&["train", "--data", data.to_str().unwrap(), "--out", refused.to_str().unwrap(), "--quiet", "--max-steps", "1", "--memory-limit", &limit][..], &shape].concat());
    assert_user_error(&o, &["memory.limit"]);
    assert!(!refused.exists());
    let o = kiln(&[&["train", "--data", data.to_str().unwrap(), "--out", d.join("cp4-limited").to_str().unwrap(), "--quiet", "--max-steps", "1", "--cp", "4", "--memory-limit", &limit][..], &shape].concat());
    assert!(o.status.success(), "cp 4 under --memory-limit {limit}: {}", stderr(&o));
}
