//! Observability: TensorBoard event files, plots, `kiln doctor`, `kiln runs`.
use crate::common::scratch;
use kiln::obs::tfevents::{self, Event, EventBody};
use kiln::obs::MetricsWriter;
use serde_json::{json, Value};
use std::fs;
use std::path::{Path, PathBuf};

fn train_line(step: u64) -> Value {
    let s = step as f64;
    json!({"kind": "train", "step": step, "loss": 4.0 / (1.0 + 0.1 * s), "lr": 1e-3 * (s / 10.0).min(1.0),
           "grad_norm": 1.5 + 0.01 * s, "tokens_per_sec": 12000.0 + 37.0 * s, "mfu": 0.123 + 1e-4 * s, "elapsed_s": 0.25 * s})
}

fn eval_line(step: u64) -> Value {
    json!({"kind": "eval", "step": step, "val_loss": 4.2 / (1.0 + 0.09 * step as f64)})
}

/// A run-like directory: config.toml of a real preset (with `lr` set) and `steps` steps of
/// metrics written by MetricsWriter, an eval line every 5 steps.
fn make_run(dir: &Path, steps: u64, lr: f64) {
    fs::create_dir_all(dir).unwrap();
    let mut cfg = kiln::presets::preset("shakespeare-char").unwrap();
    cfg.train.lr = lr;
    cfg.train.max_steps = steps;
    fs::write(dir.join("config.toml"), cfg.to_toml()).unwrap();
    let mut w = MetricsWriter::open(dir, None).unwrap();
    for s in 1..=steps {
        w.log(&train_line(s)).unwrap();
        if s % 5 == 0 {
            w.log(&eval_line(s)).unwrap();
        }
    }
}

fn jsonl(dir: &Path) -> Vec<Value> {
    fs::read_to_string(dir.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// What metrics.jsonl says TensorBoard should show: `(tag, step, value as f32)`, sorted.
fn expected_scalars(lines: &[Value]) -> Vec<(String, i64, f32)> {
    let mut v: Vec<(String, i64, f32)> = lines
        .iter()
        .flat_map(|l| {
            let kind = l["kind"].as_str().unwrap().to_string();
            let step = l["step"].as_i64().unwrap();
            l.as_object().unwrap().iter().filter(|(k, _)| *k != "step").filter_map(move |(k, x)| x.as_f64().map(|x| (format!("{kind}/{k}"), step, x as f32))).collect::<Vec<_>>()
        })
        .collect();
    v.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    v
}

/// Same tags and steps; values equal to float32 precision (the JSON text may round the last
/// bit of an f64 differently from the value that was logged).
fn same_scalars(got: &[(String, i64, f32)], want: &[(String, i64, f32)]) {
    let key = |v: &[(String, i64, f32)]| v.iter().map(|t| (t.0.clone(), t.1)).collect::<Vec<_>>();
    assert_eq!(key(got), key(want));
    for (g, w) in got.iter().zip(want) {
        assert!((g.2 - w.2).abs() <= 1e-6 * w.2.abs().max(1e-30), "{g:?} vs {w:?}");
    }
}

fn sorted(mut v: Vec<(String, i64, f32)>) -> Vec<(String, i64, f32)> {
    v.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    v
}

#[test]
fn crc32c_matches_the_castagnoli_check_value() {
    assert_eq!(tfevents::crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(tfevents::crc32c(b""), 0);
    // TFRecord's masking, ((crc >> 15) | (crc << 17)) + 0xa282ead8, worked by hand.
    assert_eq!(tfevents::masked_crc32c(b"123456789"), 0xC78A_B0E5);
}

#[test]
fn event_protobuf_round_trips() {
    let events = [
        Event { wall_time: 1.7e9 + 0.25, step: 0, body: EventBody::FileVersion("brain.Event:2".into()) },
        Event { wall_time: 1.7e9 + 1.5, step: 123_456_789_012, body: EventBody::Scalars(vec![("train/loss".into(), 2.5), ("train/lr".into(), 3e-4)]) },
        Event { wall_time: 1.7e9 + 2.0, step: 7, body: EventBody::RunStart },
    ];
    for e in &events {
        assert_eq!(&tfevents::decode_event(&tfevents::encode_event(e)).unwrap(), e);
    }
    // The exact bytes of a scalar event (checked field by field against event.proto).
    let e = Event { wall_time: 0.0, step: 3, body: EventBody::Scalars(vec![("a".into(), 1.0)]) };
    let b = tfevents::encode_event(&e);
    assert_eq!(b, [&[0x09][..], &[0; 8], &[0x10, 3, 0x2a, 10, 0x0a, 8, 0x0a, 1, b'a', 0x15], &1.0f32.to_le_bytes()].concat());
    // The run-status log is field 7 (6 is the deprecated log_message), its status START = 1.
    let b = tfevents::encode_event(&Event { wall_time: 0.0, step: 9, body: EventBody::RunStart });
    assert_eq!(b, [&[0x09][..], &[0; 8], &[0x10, 9, 0x3a, 2, 0x08, 1]].concat());
}

#[test]
fn metrics_writer_writes_jsonl_and_matching_tfevents() {
    let dir = scratch("obs-writer").join("run");
    make_run(&dir, 12, 1e-3);
    let lines = jsonl(&dir);
    assert_eq!(lines.len(), 12 + 2);
    // (serde_json's default parser may differ from the written f64 in the last bit.)
    assert_eq!(lines[0], serde_json::from_str::<Value>(&train_line(1).to_string()).unwrap());
    let files = tfevents::event_files(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    let parts: Vec<&str> = name.splitn(5, '.').collect();
    assert_eq!(&parts[..3], ["events", "out", "tfevents"], "{name}");
    assert!(parts[3].parse::<u64>().unwrap() > 1_600_000_000, "{name}");
    assert!(!parts[4].is_empty(), "{name}: no hostname");
    let events = tfevents::read_events(&files[0]).unwrap();
    assert_eq!(events[0].body, EventBody::FileVersion("brain.Event:2".into()));
    assert_eq!(events.len(), 1 + 14);
    let got = sorted(tfevents::read_scalars(&dir).unwrap());
    same_scalars(&got, &expected_scalars(&lines));
    let tags: std::collections::BTreeSet<&str> = got.iter().map(|t| t.0.as_str()).collect();
    for t in ["train/loss", "train/lr", "train/tokens_per_sec", "train/mfu", "train/grad_norm", "eval/val_loss"] {
        assert!(tags.contains(t), "{t} missing from {tags:?}");
    }
    assert!(!tags.iter().any(|t| t.ends_with("/step") || t.ends_with("/kind")), "{tags:?}");
}

#[test]
fn corrupt_event_records_are_detected() {
    let dir = scratch("obs-corrupt").join("run");
    make_run(&dir, 3, 1e-3);
    let f = &tfevents::event_files(&dir)[0];
    let good = fs::read(f).unwrap();
    assert!(tfevents::read_records(f).is_ok());
    for (at, what) in [(good.len() - 7, "payload CRC"), (1, "length CRC")] {
        let mut bad = good.clone();
        bad[at] ^= 0x40;
        fs::write(f, &bad).unwrap();
        let e = tfevents::read_records(f).unwrap_err();
        assert!(e.contains("CRC mismatch"), "{what}: {e}");
    }
    fs::write(f, &good[..good.len() - 2]).unwrap();
    assert!(tfevents::read_records(f).unwrap_err().contains("truncated"));
}

#[test]
fn resumed_writer_keeps_steps_up_to_the_checkpoint_and_purges_the_rest() {
    let dir = scratch("obs-resume").join("run");
    make_run(&dir, 12, 1e-3); // steps 1..=12, evals at 5, 10
    // A line cut short by a crash, then a resume from the checkpoint at step 8.
    let mut f = fs::OpenOptions::new().append(true).open(dir.join("metrics.jsonl")).unwrap();
    std::io::Write::write_all(&mut f, b"{\"kind\":\"train\",\"st").unwrap();
    drop(f);
    let mut w = MetricsWriter::open(&dir, Some(8)).unwrap();
    let mut resumed: Vec<Value> = Vec::new();
    for s in 9..=11 {
        let mut l = train_line(s);
        l["loss"] = json!(9.0 + s as f64); // different from the first attempt
        w.log(&l).unwrap();
        resumed.push(l);
    }
    let lines = jsonl(&dir);
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10, 11]);
    assert_eq!(lines[9..].iter().map(|l| l["loss"].as_f64().unwrap() as f32).collect::<Vec<_>>(), [18.0f32, 19.0, 20.0]);
    assert_eq!(resumed.len(), 3);
    assert_eq!(tfevents::event_files(&dir).len(), 2, "a resume starts a new event file");
    same_scalars(&sorted(tfevents::read_scalars(&dir).unwrap()), &expected_scalars(&lines));
    let first = tfevents::read_events(&tfevents::event_files(&dir)[1]).unwrap();
    assert_eq!(first[1].body, EventBody::RunStart);
    assert_eq!(first[1].step, 9);
}

#[test]
fn log_rejects_lines_without_a_step() {
    let dir = scratch("obs-nostep").join("run");
    let mut w = MetricsWriter::open(&dir, None).unwrap();
    assert!(w.log(&json!({"kind": "train", "loss": 1.0})).unwrap_err().contains("step"));
    assert!(w.log(&json!([1, 2])).is_err());
    assert_eq!(fs::read_to_string(dir.join("metrics.jsonl")).unwrap(), "");
}

/// TensorBoard's own EventAccumulator (`pip install tensorboard`, as .ci/run does) reads a
/// resumed run's event files back to exactly metrics.jsonl.
#[test]
fn tensorboard_reads_our_event_files() {
    let dir = scratch("obs-tb").join("run");
    make_run(&dir, 20, 1e-3);
    let mut w = MetricsWriter::open(&dir, Some(14)).unwrap();
    for s in 15..=25 {
        let mut l = train_line(s);
        l["loss"] = json!(0.5 + 0.01 * s as f64);
        w.log(&l).unwrap();
        if s % 5 == 0 {
            w.log(&eval_line(s)).unwrap();
        }
    }
    run_roundtrip_script(&dir);
}

/// A real `kiln train` run directory with event files: the trainer's own once it writes them,
/// until then its metrics.jsonl replayed through MetricsWriter.
/// The run directory, inside the scratch directory that holds it (removed when that drops).
fn real_run(name: &str) -> (crate::common::Scratch, PathBuf) {
    let root = scratch(name);
    let data = crate::common::corpus(&root);
    let dir = root.join("run");
    let o = crate::common::train(&data, &dir, &["--max-steps", "12"]);
    assert!(o.status.success(), "{}", crate::common::stderr(&o));
    if tfevents::event_files(&dir).is_empty() {
        let text = fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        fs::remove_file(dir.join("metrics.jsonl")).unwrap();
        let mut w = MetricsWriter::open(&dir, None).unwrap();
        for l in text.lines() {
            w.log(&serde_json::from_str(l).unwrap()).unwrap();
        }
    }
    (root, dir)
}

fn run_roundtrip_script(dir: &Path) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tfevents_roundtrip.py");
    let py = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let o = std::process::Command::new(py).arg(&script).arg(dir).output().expect("run python3");
    let out = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{}: {out}", script.display());
    assert!(out.contains("OK"), "{out}");
    out
}

#[test]
fn real_run_event_files_match_metrics_and_plot() {
    let (_root, dir) = real_run("obs-real");
    let lines = jsonl(&dir);
    assert!(lines.iter().any(|l| l["kind"] == "eval"));
    same_scalars(&sorted(tfevents::read_scalars(&dir).unwrap()), &expected_scalars(&lines));
    kiln::obs::write_loss_png(&dir).unwrap();
    assert_eq!(png_size(&dir.join("loss.png")).0, 1600);
    let t = kiln::obs::list_runs(dir.parent().unwrap()).unwrap();
    assert!(t.lines().nth(2).unwrap().starts_with("run ") && t.contains(" 12 "), "{t}");
    let out = run_roundtrip_script(&dir);
    assert!(out.contains("train/loss") && out.contains("eval/val_loss"), "{out}");
}

fn png_size(p: &Path) -> (u32, u32, usize) {
    let b = fs::read(p).unwrap();
    assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n", "{}: not a PNG", p.display());
    assert_eq!(&b[12..16], b"IHDR");
    (u32::from_be_bytes(b[16..20].try_into().unwrap()), u32::from_be_bytes(b[20..24].try_into().unwrap()), b.len())
}

#[test]
fn plots_several_runs_and_one_runs_loss_png() {
    let root = scratch("obs-plot");
    let (a, b) = (root.join("lr-1e-3"), root.join("lr-3e-3"));
    make_run(&a, 40, 1e-3);
    make_run(&b, 30, 3e-3);
    let out = root.join("plots/compare.png");
    kiln::obs::plot_runs(&[a.clone(), b.clone()], &out).unwrap();
    let (w, h, len) = png_size(&out);
    assert_eq!((w, h), (1600, 1100));
    assert!(len > 20_000, "{len} bytes: the plot looks empty");
    kiln::obs::write_loss_png(&a).unwrap();
    let (w, h, one) = png_size(&a.join("loss.png"));
    assert_eq!((w, h), (1600, 1100));
    assert!(one > 20_000 && one != len, "{one} bytes");
    // Curves read back with the tokens of config.toml (shakespeare-char: 12 × 64 per step).
    let c = kiln::obs::plot::RunCurves::load(&a).unwrap();
    assert_eq!(c.tokens_per_step, Some(12.0 * 64.0));
    assert_eq!((c.train.len(), c.val.len(), c.lr.len(), c.tokens_per_sec.len()), (40, 8, 40, 40));
}

#[test]
fn plot_tokens_come_from_metrics_when_there_is_no_config() {
    let dir = scratch("obs-plot-tokens").join("bare");
    let mut w = MetricsWriter::open(&dir, None).unwrap();
    for s in 1..=6u64 {
        let mut l = train_line(s);
        l["tokens"] = json!(1000 * s * s);
        w.log(&l).unwrap();
    }
    let c = kiln::obs::plot::RunCurves::load(&dir).unwrap();
    assert_eq!(c.tokens_per_step, None);
    assert_eq!((c.tokens(3.0), c.tokens(7.0)), (Some(9000.0), None));
    kiln::obs::write_loss_png(&dir).unwrap();
    assert_eq!(png_size(&dir.join("loss.png")).0, 1600);
    // Neither config.toml nor tokens in the lines: the tokens panel is empty, the plot still draws.
    fs::write(dir.join("metrics.jsonl"), format!("{}\n", train_line(1))).unwrap();
    kiln::obs::write_loss_png(&dir).unwrap();
}

#[test]
fn plot_errors_name_the_missing_run() {
    let root = scratch("obs-plot-err");
    let e = kiln::obs::plot_runs(&[root.join("nope")], &root.join("x.png")).unwrap_err();
    assert!(e.contains("nope") && e.contains("metrics.jsonl"), "{e}");
    assert!(kiln::obs::plot_runs(&[], &root.join("x.png")).is_err());
    assert!(!root.join("x.png").exists());
}

#[test]
fn human_numbers() {
    use kiln::obs::plot::human;
    assert_eq!(human(0.0), "0");
    assert_eq!(human(1500.0), "1.5k");
    assert_eq!(human(2_000_000.0), "2M");
    assert_eq!(human(0.25), "0.25");
}

#[test]
fn doctor_reports_machine_and_fails_without_the_corpus() {
    let (r, ok) = kiln::obs::doctor_with(Err("default corpus not found: looked under /nowhere".into()), Some(4.2e10));
    assert!(!ok, "{r}");
    assert!(r.contains("MISSING") && r.contains("/nowhere"), "{r}");
    assert!(r.contains("42.0 GFLOP/s"), "{r}");
    // Which bf16 product path this machine runs, and its measured peak.
    assert!(r.contains("bf16:     avx512_bf16") || r.contains("bf16:     fp32 fallback"), "{r}");
    assert!(r.contains("CUDA not built") && r.contains("CPU yes") && r.contains("in-process ranks yes"), "{r}");
    let mpi = if cfg!(feature = "mpi") { "MPI built" } else { "MPI not built (rebuild with --features mpi" };
    assert!(r.contains(mpi), "{r}");
    if cfg!(target_arch = "x86_64") {
        assert!(r.contains("avx2") && r.contains("fma") && r.contains("avx512f"), "{r}");
    }
    if Path::new("/proc/meminfo").exists() {
        assert!(r.contains("GiB total"), "{r}");
    }
    assert!(!kiln::obs::doctor_with(Ok(vec![]), None).1);

    let d = scratch("obs-doctor");
    let book = d.join("print.html");
    fs::write(&book, "<html>book</html>").unwrap();
    let (r, ok) = kiln::obs::doctor_with(Ok(vec![book.clone()]), None);
    assert!(ok, "{r}");
    assert!(r.contains("present") && r.contains(&book.display().to_string()), "{r}");
}

#[test]
fn doctor_measures_the_peak() {
    let (r, ok) = kiln::obs::doctor();
    let line = r.lines().find(|l| l.starts_with("matmul:")).unwrap_or_else(|| panic!("{r}"));
    let gflops: f64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(gflops > 0.1, "{line}");
    assert_eq!(ok, data::default_corpus_files().is_ok(), "{r}");
}

#[test]
fn runs_table_shows_progress_and_differing_keys() {
    let root = scratch("obs-runs");
    make_run(&root.join("a"), 40, 1e-3);
    make_run(&root.join("b"), 30, 3e-3);
    fs::create_dir_all(root.join("not-a-run")).unwrap();
    let t = kiln::obs::list_runs(&root).unwrap();
    let lines: Vec<&str> = t.lines().collect();
    assert!(lines[0].starts_with("run") && lines[0].contains("preset") && lines[0].contains("best val"), "{t}");
    assert!(lines[0].contains("train.lr") && lines[0].contains("train.max_steps"), "{t}");
    assert!(!lines[0].contains("model.n_layer"), "same in both runs: {t}");
    let a: Vec<&str> = lines[2].split_whitespace().collect();
    let fin = format!("{:.4}", eval_line(40)["val_loss"].as_f64().unwrap());
    assert_eq!(&a[..5], ["a", "shakespeare-char", "40", fin.as_str(), fin.as_str()], "{t}");
    assert!(lines[2].contains("0.001") && lines[3].contains("0.003"), "{t}");
    assert!(lines[3].starts_with("b ") && !t.contains("not-a-run"), "{t}");
    assert_eq!(lines.len(), 4, "{t}");
    // A run written before a key existed (its config.toml lacks it) has that key's default:
    // not a difference.
    let cfg = root.join("b/config.toml");
    let text = fs::read_to_string(&cfg).unwrap();
    fs::write(&cfg, text.lines().filter(|l| !l.starts_with("memory_interval")).collect::<Vec<_>>().join("\n")).unwrap();
    assert!(text.contains("memory_interval") && !fs::read_to_string(&cfg).unwrap().contains("memory_interval"));
    let t2 = kiln::obs::list_runs(&root).unwrap();
    assert_eq!(t2.lines().next(), t.lines().next(), "{t2}");

    let empty = scratch("obs-runs-empty");
    assert!(kiln::obs::list_runs(&empty).unwrap().contains("no run directories"));
    let e = kiln::obs::list_runs(&root.join("missing")).unwrap_err();
    assert!(e.contains("missing"), "{e}");
}

#[test]
fn cli_args_parse() {
    use clap::Parser;
    #[derive(Parser)]
    struct P {
        #[command(flatten)]
        a: kiln::obs::cmd::PlotArgs,
    }
    #[derive(Parser)]
    struct R {
        #[command(flatten)]
        a: kiln::obs::cmd::RunsArgs,
    }
    let p = P::try_parse_from(["plot", "runs/a", "runs/b", "--out", "x.png"]).unwrap();
    assert_eq!(p.a.runs, [PathBuf::from("runs/a"), PathBuf::from("runs/b")]);
    assert_eq!(p.a.out, PathBuf::from("x.png"));
    assert!(P::try_parse_from(["plot", "--out", "x.png"]).is_err(), "a run is required");
    assert!(P::try_parse_from(["plot", "runs/a"]).is_err(), "--out is required");
    assert_eq!(R::try_parse_from(["runs"]).unwrap().a.dir, None);
    assert_eq!(R::try_parse_from(["runs", "elsewhere"]).unwrap().a.dir, Some(PathBuf::from("elsewhere")));
}
