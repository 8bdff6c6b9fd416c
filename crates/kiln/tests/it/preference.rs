//! Preference optimisation through `kiln train --objective`: DPO at dp 2 (ZeRO-1), tp 2, pp 2 and
//! cp 2 (ring and Ulysses) reproduces one rank with dropout on, a resumed run continues bit for bit from the reference
//! log-probabilities it measured at its start, the step and evaluation lines carry TRL's
//! figures, and bad rows and layouts it does not run are refused in one line. The losses are
//! checked against hand-computed pairs and finite differences in the tensor crate, and against
//! transformers step for step by `bench/compare_hf.py --objective`.

use crate::common::*;
use std::path::{Path, PathBuf};

/// Addition facts: the right sum chosen over a wrong one.
fn pairs(dir: &Path) -> PathBuf {
    let mut s = String::new();
    let mut x: u64 = 7;
    for _ in 0..48 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let (a, b, off) = ((x >> 33) % 10, (x >> 40) % 10, 1 + (x >> 50) % 5);
        s.push_str(&format!("{{\"prompt\": \"{a}+{b}=\", \"chosen\": \"{}.\", \"rejected\": \"{}.\"}}\n", a + b, a + b + off));
    }
    let p = dir.join("pairs.jsonl");
    std::fs::write(&p, s).unwrap();
    p
}

fn lines(run: &Path, kind: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).filter(|v| v["kind"] == kind).collect()
}

const BASE: &[&str] = &["--objective", "dpo", "--set", "model.dropout=0.1", "--set", "train.batch_size=8", "--set", "train.lr=3e-3", "--set", "preference.beta=0.5"];

#[test]
fn dpo_layouts_reproduce_one_rank_and_resume_bit_exactly() {
    let d = scratch("dpo-layouts");
    let data = pairs(&d);
    let one = d.join("one");
    let o = train(&data, &one, &[BASE, &["--max-steps", "10"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let base = losses(&one);
    // The reference is the starting model: the first step's pairs are about even (exactly
    // without dropout: `bench/compare_hf.py --objective dpo` starts at ln 2).
    assert!((base[0].1 - std::f64::consts::LN_2).abs() < 0.05, "{base:?}");
    assert!(base[9].1 < base[0].1, "DPO lowers its loss: {base:?}");
    let step = &lines(&one, "train")[9];
    for k in ["rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen", "logps_rejected"] {
        assert!(step[k].as_f64().is_some_and(f64::is_finite), "{k} in {step}");
    }
    assert!(step["rewards_margin"].as_f64().unwrap() > 0.0, "{step}");
    let eval = lines(&one, "eval");
    assert!(!eval.is_empty() && eval[0]["val_rewards_accuracy"].as_f64().is_some(), "{eval:?}");
    assert!(one.join("reference_logps.json").exists());
    // `kiln eval --run` reports the held-out pairs as the run's last evaluation did.
    let o = kiln(&["eval", "--run", one.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ev: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let last = eval.last().unwrap();
    for k in ["val_loss", "val_rewards_accuracy", "val_preference_accuracy", "val_rewards_margin"] {
        let (a, b) = (ev[k].as_f64().unwrap(), last[k].as_f64().unwrap());
        assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{k}: kiln eval {a}, the run's {b}");
    }
    let reference = lines(&one, "reference");
    assert!(reference.len() == 1 && reference[0]["val_preference_accuracy"].as_f64().is_some_and(|a| (0.0..=1.0).contains(&a)), "{reference:?}");
    assert!(step["preference_accuracy"].as_f64().is_some(), "{step}");
    // Context parallelism: each rank holds some positions of every row; a row's log-probability
    // is the sum of the parts'.
    let layouts: [(&str, &[&str]); 4] = [
        ("dp2-zero1", &["--dp", "2", "--zero", "1"]),
        ("tp2", &["--tp", "2", "--set", "model.n_head=2"]),
        ("cp2", &["--cp", "2"]),
        ("cp2-ulysses", &["--cp", "2", "--cp-mode", "ulysses"]),
    ];
    for (name, layout) in layouts {
        let run = d.join(name);
        let o = train(&data, &run, &[BASE, layout, &["--max-steps", "10"]].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        for ((s, a), (_, b)) in losses(&run).iter().zip(&base) {
            assert!(((a - b) / b).abs() <= 1e-5, "{name} step {s}: {a} vs one rank {b}");
        }
    }
    // A pipeline of two stages (each of one layer), interleaved too: the last stage measures the
    // pairs, every stage takes part in measuring the reference.
    let deep = [BASE, &["--set", "model.n_layer=2", "--micro-batches", "2", "--max-steps", "6"]].concat();
    let one2 = d.join("one-2-layers");
    assert!(train(&data, &one2, &deep).status.success());
    let base2 = losses(&one2);
    for (name, layout) in [("pp2", &["--pp", "2"][..]), ("pp2-dp2", &["--pp", "2", "--dp", "2"][..])] {
        let run = d.join(name);
        let o = train(&data, &run, &[&deep[..], layout].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        for ((s, a), (_, b)) in losses(&run).iter().zip(&base2) {
            assert!(((a - b) / b).abs() <= 1e-5, "{name} step {s}: {a} vs one rank {b}");
        }
        let ev = lines(&run, "eval");
        assert_eq!(ev.last().unwrap()["val_rewards_accuracy"], lines(&one2, "eval").last().unwrap()["val_rewards_accuracy"], "{name}");
    }
    // Resumed at step 5: the reference comes back from the run directory, not the trained weights.
    let split = d.join("split");
    assert!(train(&data, &split, &[BASE, &["--max-steps", "5"]].concat()).status.success());
    let o = train(&data, &split, &[BASE, &["--resume", "--max-steps", "10"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let bits = |r: &Path| losses(r).iter().map(|&(s, l)| (s, l.to_bits())).collect::<Vec<_>>();
    assert_eq!(bits(&one), bits(&split), "resumed at step 5");
    std::fs::remove_file(split.join("reference_logps.json")).unwrap();
    let o = train(&data, &split, &[BASE, &["--resume", "--max-steps", "12"]].concat());
    assert_user_error(&o, &["reference_logps.json", "missing"]);
}

#[test]
fn bad_preference_rows_and_unsupported_layouts_are_refused() {
    let d = scratch("dpo-errors");
    let data = pairs(&d);
    let bad = d.join("bad.jsonl");
    let good = std::fs::read_to_string(&data).unwrap();
    let first = good.lines().next().unwrap();
    std::fs::write(&bad, format!("{first}\n{{\"prompt\": \"1+1=\", \"chosen\": \"\", \"rejected\": \"3.\"}}\n")).unwrap();
    let o = train(&bad, &d.join("bad"), &[BASE, &["--max-steps", "2"]].concat());
    assert_user_error(&o, &["bad.jsonl", "line 2", "`chosen` is empty"]);
    assert!(!d.join("bad").join("metrics.jsonl").exists(), "nothing written");
    std::fs::write(&bad, format!("{first}\n{{\"prompt\": \"1+1=\", \"chosen\": \"2.\"}}\n")).unwrap();
    assert_user_error(&train(&bad, &d.join("bad"), &[BASE, &["--max-steps", "2"]].concat()), &["bad.jsonl", "line 2", "no field `rejected`"]);
    let cases: [(&[&str], &[&str]); 5] = [
        (&["--set", "train.batch_size=6", "--dp", "2"], &["whole pairs", "3 rows"]),
        (&["--device", "vulkan"], &["does not run on a device"]),
        (&["--format", "chat"], &["data.format must be \"preference\"", "chat"]),
        (&["--set", "preference.beta=0"], &["preference.beta"]),
        (&["--seq-len", "4", "--set", "data.tokenizer=byte"], &["no chosen completion token", "train.seq_len = 4"]),
    ];
    for (k, (extra, needles)) in cases.iter().enumerate() {
        let out = d.join(format!("case{k}"));
        assert_user_error(&train(&data, &out, &[BASE, extra, &["--max-steps", "2"]].concat()), needles);
    }
    // Preference rows without a preference objective.
    assert_user_error(&train(&data, &d.join("lm"), &["--format", "preference", "--max-steps", "2"]), &["needs a preference objective"]);
}
