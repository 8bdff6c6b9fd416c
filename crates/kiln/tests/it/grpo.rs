//! GRPO through `kiln train --objective grpo`: a reward the model can earn rises, the step and
//! evaluation lines carry its figures, every layout reproduces one rank, a resumed run continues bit for bit (one batch of
//! completions per step, and with `grpo.iterations = 2` from a batch boundary), and bad prompt
//! rows and settings are refused in one line. Advantages and clipping are checked on
//! hand-computed groups in the tensor crate, the rewards in `rewards.rs`.

use crate::common::*;
use std::path::{Path, PathBuf};

fn prompts(dir: &Path) -> PathBuf {
    let s: String = (0..40).map(|i| format!("{{\"prompt\": \"{}+{}=\", \"answer\": \"{}\"}}\n", i % 7, i % 5, i % 7 + i % 5)).collect();
    let p = dir.join("prompts.jsonl");
    std::fs::write(&p, s).unwrap();
    p
}

fn lines(run: &Path, kind: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).filter(|v| v["kind"] == kind).collect()
}

/// A reward for completions that start with "7": something a random model sometimes does and
/// can learn to do always.
const BASE: &[&str] = &[
    "--objective", "grpo", "--tokenizer", "char", "--set", "train.batch_size=16", "--set", "grpo.group=4", "--set", "grpo.max_new_tokens=3",
    "--set", "grpo.rewards=[\"format:7.*\"]", "--set", "train.lr=1e-2", "--set", "train.warmup_steps=0", "--set", "model.dropout=0.0",
    "--set", "grpo.eval_prompts=4", "--set", "sample.tokens=0",
];

#[test]
fn grpo_raises_a_reward_and_resumes_bit_exactly() {
    let d = scratch("grpo");
    let data = prompts(&d);
    let run = d.join("learn");
    let o = train(&data, &run, &[BASE, &["--max-steps", "30", "--set", "eval.interval=30"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let steps = lines(&run, "train");
    let reward = |r: &[serde_json::Value]| r.iter().map(|l| l["reward"].as_f64().unwrap()).sum::<f64>() / r.len() as f64;
    let (early, late) = (reward(&steps[..5]), reward(&steps[25..]));
    assert!(late > early + 0.3, "the reward rises: {early} over the first 5 steps, {late} over the last 5");
    for k in ["reward", "reward_std", "reward_format", "kl", "clip_fraction", "completion_length", "completion_length_max", "rollout_tokens_per_sec"] {
        assert!(steps[29][k].as_f64().is_some_and(f64::is_finite), "{k} in {}", steps[29]);
    }
    let evals = lines(&run, "eval");
    assert_eq!(evals.iter().map(|e| e["step"].as_u64().unwrap()).collect::<Vec<_>>(), vec![0, 30], "{evals:?}");
    assert!(evals[1]["val_reward"].as_f64().unwrap() >= evals[0]["val_reward"].as_f64().unwrap());
    // `kiln eval --run` completes the held-out prompts as the run's last evaluation did.
    let o = kiln(&["eval", "--run", run.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ev: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!((ev["val_reward"].as_f64(), ev["objective"].as_str()), (evals[1]["val_reward"].as_f64(), Some("grpo")), "{ev}");
    let bits = |r: &Path| losses(r).iter().map(|&(s, l)| (s, l.to_bits())).collect::<Vec<_>>();
    // With a KL term the reference is the starting model: a resumed run makes it again.
    let cases: [(&str, &[&str]); 3] = [("mu1", &[]), ("mu2", &["--set", "grpo.iterations=2"]), ("kl", &["--set", "grpo.beta=0.04", "--set", "grpo.loss=dr_grpo"])];
    // Every layout reproduces one rank: data-parallel ranks (ZeRO-1 and ZeRO-3) each sampling
    // and training on whole groups of their own, tensor, pipeline and context parallelism
    // sampling from the whole weights gathered.
    let one = d.join("one");
    let args = [BASE, &["--set", "eval.interval=0", "--set", "grpo.iterations=2", "--set", "model.n_layer=2", "--micro-batches", "2", "--max-steps", "6"]].concat();
    assert!(train(&data, &one, &args).status.success());
    let layouts: [(&str, &[&str]); 5] = [
        ("dp2-zero1", &["--dp", "2", "--zero", "1"]),
        ("dp2-zero3", &["--dp", "2", "--zero", "3"]),
        ("tp2", &["--tp", "2"]),
        ("pp2", &["--pp", "2"]),
        ("cp2", &["--cp", "2"]),
    ];
    for (name, layout) in layouts {
        let run = d.join(name);
        let o = train(&data, &run, &[&args[..], layout].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        for ((s, a), (_, b)) in losses(&run).iter().zip(&losses(&one)) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1e-2), "{name} step {s}: {a} vs one rank {b}");
        }
        let (ra, rb) = (lines(&run, "train"), lines(&one, "train"));
        for (a, b) in ra.iter().zip(&rb) {
            assert_eq!(a["reward"], b["reward"], "{name}: the same completions");
            let (ga, gb) = (a["grad_norm"].as_f64().unwrap(), b["grad_norm"].as_f64().unwrap());
            assert!((ga - gb).abs() <= 1e-5 * gb.max(1e-6), "{name}: grad norm {ga} vs {gb}");
            let (ka, kb) = (a["clip_fraction"].as_f64().unwrap(), b["clip_fraction"].as_f64().unwrap());
            assert!((ka - kb).abs() <= 1e-9, "{name}: clip fraction {ka} vs {kb}");
        }
    }
    for (name, extra) in cases {
        let (full, split) = (d.join(format!("{name}-full")), d.join(format!("{name}-split")));
        let args = [BASE, extra, &["--set", "eval.interval=0", "--set", "checkpoint.interval=4"]].concat();
        assert!(train(&data, &full, &[&args[..], &["--max-steps", "8"]].concat()).status.success());
        assert!(train(&data, &split, &[&args[..], &["--max-steps", "4"]].concat()).status.success());
        let o = train(&data, &split, &[&args[..], &["--resume", "--max-steps", "8"]].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        assert_eq!(bits(&full), bits(&split), "{name}: resumed at step 4");
        if name == "kl" {
            let kl = lines(&full, "train")[7]["kl"].as_f64().unwrap();
            assert!(kl > 0.0, "the policy moved away from the reference: kl {kl}");
        }
    }
}

/// GRPO over LoRA adapters: completions sampled with the adapters merged into the base, the base
/// (adapters off) the reference; the reward rises and a resume is bit for bit.
#[test]
fn grpo_trains_lora_adapters_against_their_base() {
    let d = scratch("grpo-lora");
    let data = prompts(&d);
    let text = d.join("sums.txt");
    std::fs::write(&text, (0..400).map(|i| format!("{}+{}={}\n", i % 7, i % 5, i % 7 + i % 5)).collect::<String>()).unwrap();
    let base = d.join("base");
    assert!(train(&text, &base, &["--tokenizer", "char", "--max-steps", "20", "--set", "sample.tokens=0"]).status.success());
    let args = [BASE, &["--init-from", base.to_str().unwrap(), "--lora-rank", "4", "--lora-targets", "all-linear", "--set", "grpo.beta=0.04", "--set", "eval.interval=0", "--set", "checkpoint.interval=5"]].concat();
    let (full, split) = (d.join("full"), d.join("split"));
    let o = train(&data, &full, &[&args[..], &["--max-steps", "30"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let steps = lines(&full, "train");
    let reward = |r: &[serde_json::Value]| r.iter().map(|l| l["reward"].as_f64().unwrap()).sum::<f64>() / r.len() as f64;
    let (early, late) = (reward(&steps[..5]), reward(&steps[25..]));
    assert!(late > early, "the reward rises: {early} over the first 5 steps, {late} over the last 5");
    assert!(steps[29]["kl"].as_f64().unwrap() > 0.0, "{}", steps[29]);
    assert!(train(&data, &split, &[&args[..], &["--max-steps", "5"]].concat()).status.success());
    let o = train(&data, &split, &[&args[..], &["--resume", "--max-steps", "30"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let bits = |r: &Path| losses(r).iter().map(|&(s, l)| (s, l.to_bits())).collect::<Vec<_>>();
    assert_eq!(bits(&full), bits(&split), "resumed at step 5");
}

#[test]
fn bad_prompt_rows_and_settings_are_refused() {
    let d = scratch("grpo-errors");
    let data = prompts(&d);
    let bad = d.join("bad.jsonl");
    std::fs::write(&bad, "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": \"1+2=\"}\n").unwrap();
    assert_user_error(&train(&bad, &d.join("a"), &[BASE, &["--max-steps", "2"]].concat()), &["bad.jsonl", "row 2", "no field `answer`"]);
    std::fs::write(&bad, "{\"prompt\": 5, \"answer\": \"2\"}\n").unwrap();
    assert_user_error(&train(&bad, &d.join("b"), &[BASE, &["--max-steps", "2"]].concat()), &["bad.jsonl", "line 1", "`prompt` is a number"]);
    let cases: [(&[&str], &[&str]); 5] = [
        (&["--set", "grpo.group=3"], &["grpo.group (3)", "divide train.batch_size (16)"]),
        (&["--tp", "2", "--lora-rank", "4", "--init-from", "gpt2"], &["LoRA", "parallel.tp = 2"]),
        (&["--set", "grpo.top_p=0"], &["grpo.top_p", "(0, 1]"]),
        (&["--set", "grpo.rewards=[\"exactly\"]"], &["grpo.rewards", "`exactly` is not a reward"]),
        (&["--set", "grpo.loss=ppo"], &["grpo.loss", "ppo"]),
    ];
    for (k, (extra, needles)) in cases.iter().enumerate() {
        assert_user_error(&train(&data, &d.join(format!("case{k}")), &[BASE, extra, &["--max-steps", "2"]].concat()), needles);
    }
    // The memory plan counts the sampling weights (and the reference's with a KL term) and the
    // group's caches, so an oversized run is refused before it allocates them.
    let plan = |extra: &[&str]| {
        let mut args = vec!["memory", "--data", data.to_str().unwrap()];
        args.extend_from_slice(SMALL);
        args.extend_from_slice(BASE);
        args.extend_from_slice(extra);
        let o = kiln(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o) + &stderr(&o)
    };
    let (plain, kl) = (plan(&[]), plan(&["--set", "grpo.beta=0.04"]));
    assert!(plain.contains("GRPO sampling weights") && plain.contains("GRPO rollout caches") && !plain.contains("GRPO reference weights"), "{plain}");
    assert!(kl.contains("GRPO reference weights"), "{kl}");
}
