//! Supervised fine-tuning and packed, mixed data through the binary: the chat loss on
//! qwen2-tiny against transformers (`tests/fixtures/sft/make.py`), a 200-step SFT run that
//! lowers its held-out loss, and a packed run mixing two prompt/completion sources that resumes
//! exactly.

use crate::common::*;
use std::fs;
use std::path::{Path, PathBuf};

fn shared(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared").join(name);
    assert!(p.exists(), "fixture {} not found", p.display());
    p
}

fn here(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(name)
}

fn eval_json(o: &std::process::Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", stderr(o));
    serde_json::from_str(stdout(o).trim()).unwrap()
}

#[test]
fn chat_loss_on_qwen2_equals_transformers_with_labels_outside_assistant_turns_ignored() {
    let fx = shared("fixtures/qwen2-tiny");
    let chats = here("../data/tests/fixtures/docs/chat.jsonl");
    let want: serde_json::Value = serde_json::from_str(&fs::read_to_string(here("tests/fixtures/sft/expected.json")).unwrap()).unwrap();
    // Rows of 128 tokens hold all three chats; each in its own segment, positions from 0: as
    // transformers runs them one by one.
    let eval = |extra: &[&str]| {
        let mut args = vec!["eval", "--checkpoint", fx.to_str().unwrap(), "--data", chats.to_str().unwrap(), "--format", "chat", "--packing", "documents", "--seq-len", "128"];
        args.extend_from_slice(extra);
        eval_json(&kiln(&args))
    };
    let v = eval(&["--reset-positions"]);
    assert_eq!(v["tokens"].as_u64(), want["targets"].as_u64(), "{v}");
    let (got, hf) = (v["val_loss"].as_f64().unwrap(), want["loss"].as_f64().unwrap());
    assert!((got - hf).abs() <= 1e-5 * hf.abs(), "kiln {got} vs transformers {hf}");
    // RoPE sees only position differences, so inside document masks positions running on
    // through the row give the same loss (to rounding); the masks are what matter.
    let w = eval(&[]);
    assert!((w["val_loss"].as_f64().unwrap() - hf).abs() <= 1e-5 * hf.abs(), "{w}");
    // Without --seq-len the windows are sized to the data (its longest chat, packed), not the
    // model's whole context: the same loss.
    let sized = eval_json(&kiln(&["eval", "--checkpoint", fx.to_str().unwrap(), "--data", chats.to_str().unwrap(), "--format", "chat", "--packing", "documents", "--reset-positions"]));
    let t = sized["seq_len"].as_u64().unwrap();
    assert!(t < 128 && t > 10, "{sized}");
    assert!((sized["val_loss"].as_f64().unwrap() - hf).abs() <= 1e-5 * hf.abs(), "{sized}");
}

/// `n` chats of sums (`op` "plus") or differences, deterministic.
fn chats(path: &Path, n: usize, op: &str, seed: u64) {
    let mut x = seed;
    let mut s = String::new();
    for _ in 0..n {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let (a, b) = ((x >> 40) % 20, (x >> 50) % 20);
        let r = if op == "plus" { a + b } else { a.max(b) - a.min(b) };
        let (a, b) = if op == "plus" { (a, b) } else { (a.max(b), a.min(b)) };
        let m = serde_json::json!({"messages": [{"role": "user", "content": format!("What is {a} {op} {b}?")}, {"role": "assistant", "content": format!("{a} {op} {b} is {r}.")}]});
        s += &format!("{m}\n");
    }
    fs::write(path, s).unwrap();
}

#[test]
fn a_packed_sft_run_on_qwen2_lowers_its_held_out_loss() {
    let fx = shared("fixtures/qwen2-tiny");
    let d = scratch("sft-qwen2");
    let data = d.join("chats.jsonl");
    chats(&data, 400, "plus", 7);
    let prep = d.join("prep");
    let o = kiln(&["data", "prepare", "--input", data.to_str().unwrap(), "--tokenizer", fx.to_str().unwrap(), "--format", "chat", "--out", prep.to_str().unwrap(), "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let held = d.join("held.jsonl");
    chats(&held, 40, "plus", 99);
    let held_eval = |src: &str, what: &str| {
        let v = eval_json(&kiln(&["eval", src, what, "--data", held.to_str().unwrap(), "--format", "chat", "--packing", "documents", "--reset-positions", "--seq-len", "64"]));
        v["val_loss"].as_f64().unwrap()
    };
    let before = held_eval("--checkpoint", fx.to_str().unwrap());
    let out = d.join("run");
    let o = kiln(&["train", "--init-from", fx.to_str().unwrap(), "--data", prep.to_str().unwrap(), "--out", out.to_str().unwrap(),
        "--packing", "documents", "--reset-positions", "--seq-len", "64", "--max-steps", "200", "--set", "train.batch_size=2",
        "--set", "train.lr=1e-3", "--set", "eval.interval=200", "--set", "sample.tokens=0", "--set", "checkpoint.interval=200", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let train: Vec<&serde_json::Value> = lines.iter().filter(|v| v["kind"] == "train").collect();
    // Loss on the answers only: well under all the tokens.
    let frac = train[0]["loss_fraction"].as_f64().unwrap();
    assert!(frac > 0.1 && frac < 0.6, "loss fraction {frac}");
    let last_val = lines.iter().rev().find(|v| v["kind"] == "eval").unwrap()["val_loss"].as_f64().unwrap();
    let after = held_eval("--run", out.to_str().unwrap());
    assert!(after < 0.5 * before, "held-out loss on the answers {before} -> {after}");
    // kiln eval --run reads the run's split with its masks and packing: the run's own last eval.
    let v = eval_json(&kiln(&["eval", "--run", out.to_str().unwrap()]));
    assert!((v["val_loss"].as_f64().unwrap() - last_val).abs() < 1e-4, "{v} vs {last_val}");
}

#[test]
fn a_mixed_packed_run_resumed_midway_logs_the_same_losses() {
    let d = scratch("mix-resume");
    let (a, b) = (d.join("a.jsonl"), d.join("b.jsonl"));
    let pair = |q: &str, r: &str| serde_json::json!({"prompt": q, "completion": r}).to_string() + "\n";
    fs::write(&a, (0..300).map(|i| pair(&format!("count {i}:"), &format!(" {} {} {}", i, i + 1, i + 2))).collect::<String>()).unwrap();
    fs::write(&b, (0..200).map(|i| pair(&format!("echo {}", "ab".repeat(i % 7 + 1)), &format!(" {}", "ab".repeat(i % 7 + 1)))).collect::<String>()).unwrap();
    let cfg = d.join("mix.toml");
    fs::write(&cfg, format!(
        "[data]\nformat = \"prompt_completion\"\npacking = \"documents\"\nreset_positions = true\nsources = [{{ path = \"{}\", weight = 0.7 }}, {{ path = \"{}\", weight = 0.3 }}]\n",
        a.display(), b.display()
    )).unwrap();
    let run = |out: &Path, extra: &[&str]| {
        let mut args = vec!["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()];
        args.extend_from_slice(SMALL);
        args.extend_from_slice(&["--set", "model.block_size=32", "--seq-len", "32"]);
        args.extend_from_slice(extra);
        let o = kiln(&args);
        assert!(o.status.success(), "{}", stderr(&o));
    };
    let (full, split) = (d.join("full"), d.join("split"));
    run(&full, &["--max-steps", "20"]);
    run(&split, &["--max-steps", "10"]);
    run(&split, &["--resume", "--max-steps", "20"]);
    let (lf, ls) = (losses(&full), losses(&split));
    assert_eq!(lf.len(), 20);
    assert_eq!(lf.iter().map(|x| (x.0, x.1.to_bits())).collect::<Vec<_>>(), ls.iter().map(|x| (x.0, x.1.to_bits())).collect::<Vec<_>>());
    // The checkpoint carries the loader's cursors.
    let st: serde_json::Value = serde_json::from_str(&fs::read_to_string(split.join("checkpoints/step-00000010/state.json")).unwrap()).unwrap();
    assert_eq!(st["loader"]["cursors"].as_array().map(|c| c.len()), Some(2), "{st}");
}

/// Two synthetic sources of documents of varied lengths.
fn two_sources(weights: [f64; 2]) -> kiln::train::TrainData {
    let source = |k: u32, n_docs: usize, w: f64| {
        let (mut ids, mut starts) = (Vec::new(), vec![0u64]);
        for d in 0..n_docs {
            ids.extend((0..3 + (d * 7 + k as usize) % 40).map(|i| k * 100 + (i % 50) as u32));
            starts.push(ids.len() as u64);
        }
        let split = data::Split { tokens: data::Tokens::from_vec(ids), docs: data::DocIndex::from_starts(starts), mask: None };
        kiln::train::Source { name: format!("s{k}"), weight: w, train: split.clone(), val: split }
    };
    kiln::train::TrainData { sources: vec![source(1, 300, weights[0]), source(2, 200, weights[1])], tokenizer: data::Tokenizer::Byte, description: String::new(), files: vec![], prompts: None }
}

#[test]
fn mixing_realises_the_weights_and_packed_rows_keep_documents_apart() {
    let data = two_sources([0.7, 0.3]);
    for packing in ["windows", "documents"] {
        let mut cfg = kiln::presets::preset("tiny").unwrap();
        cfg.data.packing = plan::policy::Names::parse(packing).unwrap();
        cfg.train.seq_len = 32;
        let mut loader = kiln::train::Loader::new(&cfg, &data, None);
        let mut rng = tensor::Rng::new(1);
        let rows = loader.draw(&mut rng, 10_000);
        let from_first = rows.iter().filter(|r| match r {
            kiln::train::Row::Window { src, .. } => *src == 0,
            kiln::train::Row::Packed(p) => p[0].src == 0,
        }).count();
        let share = from_first as f64 / rows.len() as f64;
        eprintln!("{packing}: first source's share over {} rows: {share:.4} (weight 0.7)", rows.len());
        assert!((share - 0.7).abs() < 0.02, "{packing}: first source's share {share}");
        if packing == "documents" {
            let mut b = kiln::train::RowBuf::new(64, 32, true);
            loader.fill(&rows[..64], &mut b);
            for (i, r) in rows[..64].iter().enumerate() {
                let kiln::train::Row::Packed(pieces) = r else { unreachable!() };
                assert!(pieces.iter().map(|p| p.len).sum::<usize>() <= 32 && pieces.iter().all(|p| p.src == pieces[0].src));
                let mut k = 0;
                for p in pieces {
                    // Each piece's tokens start a segment, and its last token predicts nothing.
                    assert!((k..k + p.len).all(|j| b.start[i * 32 + j] == k as u32));
                    assert_eq!(b.y[i * 32 + k + p.len - 1], model::gpt::IGNORE_INDEX);
                    k += p.len;
                }
            }
        }
    }
}

#[test]
fn packed_masked_rows_train_the_same_on_every_layout() {
    let d = scratch("packed-layouts");
    let data = d.join("pairs.jsonl");
    let pair = |q: String, r: String| serde_json::json!({"prompt": q, "completion": r}).to_string() + "\n";
    fs::write(&data, (0..200).map(|i| pair(format!("Q{}:", i * 7 % 100), format!(" {} and {}", i % 13, "xy".repeat(i % 9)))).collect::<String>()).unwrap();
    let common: &[&str] = &["--format", "prompt_completion", "--packing", "documents", "--reset-positions", "--seq-len", "32",
        "--set", "model.block_size=32", "--set", "model.arch=llama", "--set", "model.bias=false", "--set", "model.n_head=4", "--set", "model.n_kv_head=2",
        "--set", "model.n_layer=2", "--set", "model.tied_embeddings=false", "--set", "train.batch_size=8", "--set", "train.grad_accum=2",
        "--set", "sample.tokens=0", "--set", "checkpoint.interval=0", "--max-steps", "6"];
    let one = d.join("one");
    let o = train(&data, &one, common);
    assert!(o.status.success(), "{}", stderr(&o));
    let base = losses(&one);
    let layouts: [&[&str]; 3] = [&["--dp", "2"], &["--tp", "2", "--sequence-parallel"], &["--pp", "2", "--micro-batches", "2", "--schedule", "1f1b"]];
    for (k, layout) in layouts.iter().enumerate() {
        let out = d.join(format!("layout-{k}"));
        let o = train(&data, &out, &[common, layout].concat());
        assert!(o.status.success(), "{layout:?}: {}", stderr(&o));
        let ls = losses(&out);
        assert_eq!(ls.len(), base.len());
        for ((s, a), (_, b)) in ls.iter().zip(&base) {
            assert!(((a - b) / b).abs() <= 1e-5, "{layout:?} step {s}: loss {a} vs one rank {b}");
        }
    }
}

#[test]
fn bad_documents_and_data_settings_exit_2_naming_them_and_write_nothing() {
    let d = scratch("bad-data");
    let bad = d.join("bad.jsonl");
    fs::write(&bad, "{\"text\": \"fine\"}\n{\"txt\": \"typo\"}\n").unwrap();
    let prep = d.join("prep");
    let o = kiln(&["data", "prepare", "--input", bad.to_str().unwrap(), "--tokenizer", "gpt2", "--out", prep.to_str().unwrap()]);
    assert_user_error(&o, &["bad.jsonl", "line 2", "`text`", "txt"]);
    assert_eq!(stderr(&o).trim().lines().count(), 1, "{}", stderr(&o));
    assert!(!prep.exists());
    let out = d.join("run");
    assert_user_error(&train(&bad, &out, &[]), &["bad.jsonl", "line 2", "`text`"]);
    assert!(!out.exists(), "a bad corpus must not start a run");
    let good = d.join("good.jsonl");
    fs::write(&good, (0..50).map(|i| format!("{{\"text\": \"document {i} has some words in it\"}}\n")).collect::<String>()).unwrap();
    for (args, needles) in [
        (&["--format", "dialogue"][..], &["data.format", "text, chat, prompt_completion, preference or prompt", "dialogue"][..]),
        (&["--packing", "rows"], &["data.packing", "windows or documents", "rows"]),
        (&["--reset-positions"], &["data.reset_positions", "documents"]),
        (&["--format", "chat"], &["good.jsonl", "line 1", "`messages`"]),
    ] {
        let o = train(&good, &out, args);
        assert_user_error(&o, needles);
        assert!(!out.exists(), "{args:?} wrote {}", out.display());
    }
    let cfg = d.join("mix.toml");
    fs::write(&cfg, format!("[data]\nsources = [{{ path = \"{}\", weight = 0 }}]\n", good.display())).unwrap();
    let o = kiln(&["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap(), "--quiet"]);
    assert_user_error(&o, &["data.sources[0].weight", "positive"]);
    let o = kiln(&["train", "--config", cfg.to_str().unwrap(), "--data", good.to_str().unwrap(), "--out", out.to_str().unwrap(), "--quiet"]);
    assert_user_error(&o, &["data.sources", "data.paths"]);
    assert!(!out.exists());
}

/// A model directory as transformers 5 saves it (the chat template in `chat_template.jinja`,
/// none in `tokenizer_config.json`, EOS as a list in `generation_config.json`): chat data
/// prepares with its template, a LoRA fine-tune trains on it, and both exports (merged and
/// PEFT) carry the template file, and the merged `config.json` names the BOS and EOS ids. The
/// run records that its prepared data is chats.
#[test]
fn a_transformers5_directory_keeps_its_chat_template_from_prepare_to_export() {
    let src = shared("fixtures/qwen2-tiny");
    let d = scratch("tf5-journey");
    let fx = d.join("model");
    fs::create_dir_all(&fx).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        fs::copy(src.join(f), fx.join(f)).unwrap();
    }
    let mut tc: serde_json::Value = serde_json::from_str(&fs::read_to_string(src.join("tokenizer_config.json")).unwrap()).unwrap();
    let template = tc.as_object_mut().unwrap().remove("chat_template").unwrap();
    let template = template.as_str().unwrap();
    fs::write(fx.join("tokenizer_config.json"), tc.to_string()).unwrap();
    fs::write(fx.join("chat_template.jinja"), template).unwrap();
    fs::write(fx.join("generation_config.json"), r#"{"bos_token_id": 151643, "eos_token_id": [151645, 151643]}"#).unwrap();
    let data = d.join("chats.jsonl");
    chats(&data, 60, "plus", 3);
    let prep = d.join("prep");
    let o = kiln(&["data", "prepare", "--input", data.to_str().unwrap(), "--tokenizer", fx.to_str().unwrap(), "--format", "chat", "--out", prep.to_str().unwrap(), "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(fs::read_to_string(prep.join("chat_template.jinja")).unwrap(), template);
    // `kiln memory` plans it with the base's tokenizer, as `kiln train` reads it, and counts
    // loading the base: its fp32 weights, and one tensor at a time read and widened beside them.
    let o = kiln(&["memory", "--init-from", fx.to_str().unwrap(), "--data", prep.to_str().unwrap(), "--lora-rank", "2", "--seq-len", "64", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let file = fs::metadata(fx.join("model.safetensors")).unwrap().len();
    let load = v["load_peak_bytes"].as_u64().unwrap();
    assert!(load > file && v["total_bytes"].as_u64().unwrap() >= load, "{v}");
    let out = d.join("run");
    let o = kiln(&["train", "--init-from", fx.to_str().unwrap(), "--data", prep.to_str().unwrap(), "--out", out.to_str().unwrap(), "--lora-rank", "2",
        "--packing", "documents", "--seq-len", "64", "--max-steps", "2", "--set", "train.batch_size=2", "--set", "eval.iters=1", "--set", "sample.tokens=6", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // The allocator's count of what loading the base held (its weights, one tensor read and
    // widened at a time, no gradients for a frozen base) stays within the plan's load phase.
    let metrics = fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let startup = metrics.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).find(|l| l["kind"] == "memory").expect("a memory line");
    let held = startup["base_load_tracked_peak_bytes"].as_u64().unwrap();
    assert!(held > 4 * 4_000_000 && held <= load, "loading the base held {held} bytes against the plan's {load}: {startup}");
    // The end-of-run sample: a held-out conversation's prompt through the template, then the reply.
    let sample = fs::read_to_string(out.join("sample.txt")).unwrap();
    assert!(sample.starts_with("<|im_start|>") && sample.contains("What is") && sample.contains("<|im_start|>assistant\n"), "{sample}");
    // The run records the prepared data's format: evaluating it on chats needs no --format.
    let cfg: toml::Value = toml::from_str(&fs::read_to_string(out.join("config.toml")).unwrap()).unwrap();
    assert_eq!(cfg["data"]["format"].as_str(), Some("chat"), "{cfg}");
    let v = eval_json(&kiln(&["eval", "--run", out.to_str().unwrap(), "--data", data.to_str().unwrap(), "--seq-len", "64"]));
    assert!(v["val_loss"].as_f64().unwrap() > 0.0, "{v}");
    for (name, extra) in [("merged", &["--merge"][..]), ("peft", &["--format", "peft"])] {
        let exp = d.join(name);
        let o = kiln(&[&["export", "--run", out.to_str().unwrap(), "--out", exp.to_str().unwrap()][..], extra].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        assert_eq!(fs::read_to_string(exp.join("chat_template.jinja")).unwrap(), template, "{name}");
    }
    let cj: serde_json::Value = serde_json::from_str(&fs::read_to_string(d.join("merged/config.json")).unwrap()).unwrap();
    assert_eq!((cj["bos_token_id"].as_u64(), cj["eos_token_id"].as_u64()), (Some(151643), Some(151645)), "{cj}");
}

/// `kiln generate --chat`: the prompt through the chat template (with --system), the reply only,
/// ending at the model's EOS (`generation_config.json`'s `eos_token_id` list) or at a `--stop`
/// string; `--ignore-eos` runs on. The reply equals greedy decoding of the templated prompt.
#[test]
fn generate_chat_applies_the_template_and_stops_at_eos_or_a_stop_string() {
    let src = shared("fixtures/qwen2-tiny");
    let d = scratch("gen-chat");
    let fx = d.join("model");
    fs::create_dir_all(&fx).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        fs::copy(src.join(f), fx.join(f)).unwrap();
    }
    // The greedy reply to the templated conversation, through the library.
    let m = kiln::run::import_hf(&fx).unwrap();
    let tok = data::Tokenizer::find_in(&fx).unwrap().unwrap();
    let data::Tokenizer::Hf(h) = &tok else { panic!("an HF tokenizer") };
    let msgs = [serde_json::json!({"role": "system", "content": "Be brief."}), serde_json::json!({"role": "user", "content": "Hello there"})];
    let prompt = tok.encode(&h.config().template.as_ref().unwrap().render(&msgs, true).unwrap()).unwrap();
    let greedy = m.generate(&prompt, 12, &model::Sampler::new(0.0, 0, 1));
    let gen = |extra: &[&str]| {
        let mut a = vec!["generate", "--checkpoint", fx.to_str().unwrap(), "--chat", "--system", "Be brief.", "--prompt", "Hello there", "--temperature", "0", "--max-new-tokens", "12"];
        a.extend_from_slice(extra);
        let o = kiln(&a);
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        stdout(&o).strip_suffix('\n').unwrap().to_string()
    };
    // The tiny model's own EOS never comes early here: the whole greedy reply.
    assert_eq!(gen(&["--ignore-eos"]), tok.decode(&greedy));
    // An EOS list naming the reply's sixth token ends the reply where that token first comes.
    let eos = greedy[5];
    let at = greedy.iter().position(|&t| t == eos).unwrap();
    fs::write(fx.join("generation_config.json"), format!("{{\"eos_token_id\": [{}, {eos}]}}", tok.eos_id().unwrap())).unwrap();
    assert_eq!(gen(&[]), tok.decode(&greedy[..at]));
    assert_eq!(gen(&["--ignore-eos"]), tok.decode(&greedy));
    // A stop string cuts the reply before it.
    fs::remove_file(fx.join("generation_config.json")).unwrap();
    let full = tok.decode(&greedy);
    let stop: String = tok.decode(&greedy[3..4]);
    assert_eq!(gen(&["--ignore-eos", "--stop", &stop]), full[..full.find(&stop).unwrap()]);
    // Bad sampling flags: one line, exit 2.
    for (flag, says) in [(&["--top-p", "1.5"][..], "--top-p 1.5"), (&["--repetition-penalty", "0"], "--repetition-penalty 0")] {
        let o = kiln(&[&["generate", "--checkpoint", fx.to_str().unwrap()][..], flag].concat());
        assert_eq!(o.status.code(), Some(2));
        assert!(stderr(&o).contains(says), "{}", stderr(&o));
    }
    let o = kiln(&["generate", "--checkpoint", fx.to_str().unwrap(), "--system", "x"]);
    assert!(o.status.code() == Some(2) && stderr(&o).contains("--system needs --chat"), "{}", stderr(&o));
}
