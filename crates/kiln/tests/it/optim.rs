//! The optimizers beyond AdamW through `kiln train`: Lion, Muon and Adafactor resume bit for bit
//! (Muon under bf16 master weights, Adafactor at dp 2 × pp 2), Muon's layouts and Adafactor's
//! reproduce one rank, AdamW's compact state resumes bit for bit, and what they do not combine
//! with is refused in one line. Their kernels are checked against their definitions in the
//! tensor crate, and against lion-pytorch and torch.optim.Muon by `bench/compare_hf.py`.

use crate::common::*;
use std::path::Path;

/// The last train line of a run's metrics.
fn train_line(run: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).rfind(|v| v["kind"] == "train").unwrap()
}

fn loss_bits(run: &Path) -> Vec<(u64, u64)> {
    losses(run).iter().map(|&(s, l)| (s, l.to_bits())).collect()
}

#[test]
fn lion_muon_and_adafactor_resume_bit_exactly_and_refuse_another_optimizers_state() {
    let d = scratch("optim-resume");
    let data = corpus(&d);
    let cases: [(&str, &[&str]); 3] = [
        ("lion", &["--set", "train.lr=1e-3", "--dp", "2", "--zero", "1"]),
        ("muon", &["--set", "train.precision=bf16", "--set", "optim.muon_adjust_lr=match_rms_adamw"]),
        ("adafactor", &["--set", "train.lr=0.1", "--dp", "2", "--pp", "2", "--micro-batches", "2"]),
    ];
    for (name, extra) in cases {
        let (full, split) = (d.join(format!("{name}-full")), d.join(format!("{name}-split")));
        let set = format!("optim.name={name}");
        let base = [&["--set", &set, "--set", "model.dropout=0.1", "--set", "model.n_layer=2"][..], extra].concat();
        let o = train(&data, &full, &[&base[..], &["--max-steps", "10"]].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        assert!(train(&data, &split, &[&base[..], &["--max-steps", "5"]].concat()).status.success());
        let o = train(&data, &split, &[&base[..], &["--resume", "--max-steps", "10"]].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        assert_eq!(loss_bits(&full), loss_bits(&split), "{name}: resumed at step 5");
        let (first, last) = (losses(&full)[0].1, losses(&full)[9].1);
        assert!(last < first - 0.1, "{name} trains: {first} → {last}");
        if name != "lion" {
            // Adafactor: statistics a row and a column long per matrix, not two moments. Muon:
            // no second moment for its matrices.
            let adamw = d.join(format!("{name}-as-adamw"));
            let args: Vec<&str> = base.iter().map(|&a| if a == set.as_str() { "optim.name=adamw" } else { a }).collect();
            assert!(train(&data, &adamw, &[&args[..], &["--max-steps", "1"]].concat()).status.success());
            let bytes = |r: &Path| train_line(r)["mem_optim_bytes"].as_f64().unwrap();
            let most = if name == "adafactor" { 0.25 } else { 0.9 };
            assert!(bytes(&full) < most * bytes(&adamw), "{name}: {} bytes against AdamW's {}", bytes(&full), bytes(&adamw));
        }
        if name == "lion" {
            // One state: half AdamW's bytes.
            let adamw = d.join("lion-as-adamw");
            let args: Vec<&str> = base.iter().map(|&a| if a == set.as_str() { "optim.name=adamw" } else { a }).collect();
            assert!(train(&data, &adamw, &[&args[..], &["--max-steps", "1"]].concat()).status.success());
            let bytes = |r: &Path| train_line(r)["mem_optim_bytes"].as_f64().unwrap();
            assert_eq!(2.0 * bytes(&full), bytes(&adamw), "Lion holds one moment");
        }
        let o = train(&data, &split, &[&base[..], &["--resume", "--max-steps", "12", "--set", "optim.name=adamw"]].concat());
        assert_user_error(&o, &[&format!("holds {name} state"), "optim.name = adamw"]);
        assert_eq!(losses(&split).len(), 10, "the refused resume wrote nothing");
    }
}

/// AdamW on compact state: bf16 moments with bf16 weights as their own master copy, and 8-bit
/// moments under ZeRO-1, resume bit for bit, follow fp32 state closely, and hold less.
#[test]
fn compact_adamw_state_resumes_bit_exactly_and_holds_less() {
    let d = scratch("optim-lean");
    let data = corpus(&d);
    let base = ["--set", "model.dropout=0.1", "--set", "model.n_layer=2", "--set", "train.precision=bf16"];
    let fp32 = d.join("fp32");
    assert!(train(&data, &fp32, &[&base[..], &["--max-steps", "10"]].concat()).status.success());
    let optim_bytes = |run: &Path| train_line(run)["mem_optim_bytes"].as_f64().unwrap();
    for (form, layout, ratio) in [("bf16", &[][..], 0.5), ("int8", &["--dp", "2", "--zero", "1"][..], 0.26)] {
        let set = format!("optim.state={form}");
        let args = [&base[..], &["--set", &set], layout].concat();
        let (full, split) = (d.join(format!("{form}-full")), d.join(format!("{form}-split")));
        let o = train(&data, &full, &[&args[..], &["--max-steps", "10"]].concat());
        assert!(o.status.success(), "{form}: {}", stderr(&o));
        assert!(train(&data, &split, &[&args[..], &["--max-steps", "5"]].concat()).status.success());
        let o = train(&data, &split, &[&args[..], &["--resume", "--max-steps", "10"]].concat());
        assert!(o.status.success(), "{form}: {}", stderr(&o));
        assert_eq!(loss_bits(&full), loss_bits(&split), "{form}: resumed at step 5");
        for ((s, a), (_, b)) in losses(&full).iter().zip(&losses(&fp32)) {
            assert!(((a - b) / b).abs() < 2e-3, "{form} step {s}: {a} vs fp32 state {b}");
        }
        // (ZeRO-1's rank holds half the moments.)
        let held = optim_bytes(&full) * if layout.is_empty() { 1.0 } else { 2.0 };
        assert!(held <= ratio * optim_bytes(&fp32) + 16384.0, "{form}: {held} bytes of optimizer state against fp32's {}", optim_bytes(&fp32));
    }
}

/// Distributed Muon (ZeRO and tensor parallelism gather each matrix for its owner) and Muon on
/// whole matrices (data-parallel replicas, pipeline stages) against one rank. In fp32: a bf16
/// Newton–Schulz iteration turns the last-bit differences of gradients summed in another order
/// into bf16-sized ones (about 1e-5 of the loss here).
#[test]
fn muon_on_every_layout_reproduces_one_rank() {
    let d = scratch("optim-muon-layouts");
    let data = corpus(&d);
    let base = ["--set", "optim.name=muon", "--set", "optim.muon_ns_precision=fp32", "--set", "model.n_layer=2", "--set", "train.batch_size=8", "--micro-batches", "2", "--max-steps", "6", "--set", "model.dropout=0.1", "--set", "checkpoint.interval=0", "--set", "sample.tokens=0"];
    let one = d.join("one");
    assert!(train(&data, &one, &base).status.success());
    let layouts: [&[&str]; 8] = [
        &["--dp", "2"],
        &["--pp", "2"],
        &["--dp", "2", "--pp", "2"],
        &["--dp", "2", "--zero", "1"],
        &["--dp", "2", "--zero", "2"],
        &["--dp", "2", "--zero", "3"],
        &["--tp", "2", "--sequence-parallel"],
        &["--dp", "2", "--zero", "3", "--tp", "2"],
    ];
    for layout in layouts {
        let out = d.join(layout.concat().replace('-', ""));
        let o = train(&data, &out, &[&base[..], layout].concat());
        assert!(o.status.success(), "{layout:?}: {}", stderr(&o));
        assert_eq!(losses(&out).len(), 6);
        for ((s, a), (_, b)) in losses(&out).iter().zip(&losses(&one)) {
            assert!(((a - b) / b).abs() <= 1e-6, "{layout:?} step {s}: {a} vs one rank {b}");
        }
    }
    // Adafactor: its per-tensor statistics on data-parallel replicas and pipeline stages.
    let ada: Vec<&str> = base.iter().map(|&a| if a == "optim.name=muon" { "optim.name=adafactor" } else { a }).collect();
    let ada_one = d.join("adafactor-one");
    assert!(train(&data, &ada_one, &ada).status.success());
    for layout in [&["--dp", "2"][..], &["--pp", "2"]] {
        let out = d.join(format!("adafactor{}", layout.concat().replace('-', "")));
        let o = train(&data, &out, &[&ada[..], layout].concat());
        assert!(o.status.success(), "adafactor {layout:?}: {}", stderr(&o));
        for ((s, a), (_, b)) in losses(&out).iter().zip(&losses(&ada_one)) {
            assert!(((a - b) / b).abs() <= 1e-6, "adafactor {layout:?} step {s}: {a} vs one rank {b}");
        }
    }
    // A ZeRO-3 checkpoint of distributed Muon's momenta continues on one rank.
    let split = d.join("zero3-then-one");
    let three: Vec<&str> = base.iter().map(|&a| if a == "6" { "3" } else { a }).collect();
    let o = train(&data, &split, &[&three[..], &["--dp", "2", "--zero", "3", "--tp", "2", "--set", "checkpoint.interval=3"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let o = train(&data, &split, &[&base[..], &["--resume"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    for ((s, a), (_, b)) in losses(&split).iter().zip(&losses(&one)) {
        assert!(((a - b) / b).abs() <= 1e-6, "resumed on one rank, step {s}: {a} vs {b}");
    }
    assert_eq!(losses(&split).len(), 6);
    // A mixture of experts: the experts whole on every tensor-parallel rank (one owner's result
    // summed over the group), or a block of them per expert-parallel rank.
    let moe = ["--set", "model.arch=llama", "--set", "model.n_expert=4", "--set", "model.top_k=2", "--set", "model.ffn_hidden=16", "--set", "model.n_head=4", "--set", "model.n_kv_head=2"];
    let one = d.join("moe-one");
    assert!(train(&data, &one, &[&base[..], &moe].concat()).status.success());
    for layout in [&["--ep", "2"][..], &["--dp", "2", "--zero", "3", "--tp", "2"]] {
        let out = d.join(format!("moe{}", layout.concat().replace('-', "")));
        let o = train(&data, &out, &[&base[..], &moe, layout].concat());
        assert!(o.status.success(), "moe {layout:?}: {}", stderr(&o));
        for ((s, a), (_, b)) in losses(&out).iter().zip(&losses(&one)) {
            assert!(((a - b) / b).abs() <= 1e-6, "moe {layout:?} step {s}: {a} vs one rank {b}");
        }
    }
}

#[test]
fn optimizer_keys_and_combinations_are_refused_in_one_line() {
    let d = scratch("optim-refusals");
    let data = corpus(&d);
    let cases: [(&[&str], &[&str]); 10] = [
        (&["--set", "optim.name=adafactor", "--tp", "2"], &["optim.name = adafactor", "parallel.tp = 2"]),
        (&["--set", "optim.name=adafactor", "--set", "optim.adafactor_d=0"], &["optim.adafactor_d must be positive"]),
        (&["--set", "optim.name=lion", "--set", "optim.state=int8"], &["optim.state = int8", "optim.name = lion"]),
        (&["--set", "optim.state=bf16", "--offload", "optimizer"], &["optim.state = bf16", "memory.offload"]),
        (&["--set", "optim.state=fp8"], &["optim.state", "fp32, bf16 or int8", "fp8"]),
        (&["--set", "optim.name=sgd"], &["optim.name", "adamw, lion, muon or adafactor", "sgd"]),
        (&["--set", "optim.name=muon", "--set", "optim.muon_ns_steps=0"], &["optim.muon_ns_steps"]),
        (&["--set", "optim.name=muon", "--set", "optim.muon_momentum=1"], &["optim.muon_momentum"]),
        (&["--set", "optim.name=muon", "--tp", "2", "--lora-rank", "4"], &["optim.name = muon", "parallel.tp = 2"]),
        (&["--set", "optim.name=lion", "--dp", "2", "--set", "parallel.compression=onebit_adam"], &["onebit_adam", "optim.name = adamw", "lion"]),
    ];
    for (i, (args, needles)) in cases.iter().enumerate() {
        let out = d.join(format!("r{i}"));
        assert_user_error(&train(&data, &out, args), needles);
        assert!(!out.exists(), "{args:?}: nothing is written");
    }
    let o = kiln(&["memory", "--data", data.to_str().unwrap(), "--set", "optim.name=muon"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = stdout(&o);
    assert!(table.contains("Muon momentum, AdamW m, v") && table.contains("Newton–Schulz buffers"), "{table}");
}
