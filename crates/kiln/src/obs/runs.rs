//! `kiln runs [DIR]`: a table of the run directories under DIR.

use crate::config::{flatten, Raw};
use std::fs;
use std::path::{Path, PathBuf};

/// What one run directory says about itself.
#[derive(Clone, Debug)]
pub struct RunSummary {
    pub dir: PathBuf,
    pub name: String,
    pub preset: Option<String>,
    /// The last step in metrics.jsonl.
    pub steps: Option<u64>,
    pub final_val: Option<f64>,
    pub best_val: Option<f64>,
    /// config.toml, flattened to dotted keys (empty when unreadable).
    pub config: Raw,
    /// Why config.toml could not be read, if it could not.
    pub config_error: Option<String>,
    /// Its elastic and straggler events, one phrase each (`straggler rank 2 (1.52×) at step 14`).
    pub events: Vec<String>,
}

pub fn summarize(dir: &Path) -> RunSummary {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| dir.display().to_string());
    let mut s = RunSummary { dir: dir.to_path_buf(), name, preset: None, steps: None, final_val: None, best_val: None, config: Raw::new(), config_error: None, events: Vec::new() };
    let cpath = dir.join("config.toml");
    match fs::read_to_string(&cpath).map_err(|e| e.to_string()).and_then(|t| t.parse::<toml::Table>().map_err(|e| e.to_string())) {
        // Resolved, so keys a run's (older) config.toml lacks read as their defaults and do
        // not show up as differences; as written when it no longer resolves.
        Ok(t) => match crate::config::RunConfig::load(&cpath) {
            Ok(c) => s.config = c.to_raw(),
            Err(_) => flatten("", &t, &mut s.config),
        },
        Err(e) => s.config_error = Some(e.lines().next().unwrap_or("").to_string()),
    }
    s.preset = s.config.get("preset").and_then(|v| v.as_str()).map(str::to_string);
    if let Ok(text) = fs::read_to_string(dir.join("metrics.jsonl")) {
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
            let Some(step) = v.get("step").and_then(|x| x.as_u64()) else { continue };
            if let Some(e) = event_phrase(&v, step) {
                s.events.push(e);
            }
            s.steps = Some(s.steps.map_or(step, |m| m.max(step)));
            if let Some(vl) = v.get("val_loss").and_then(|x| x.as_f64()) {
                s.final_val = Some(vl);
                s.best_val = Some(s.best_val.map_or(vl, |b| b.min(vl)));
            }
        }
    }
    s
}

/// A fault line's phrase for `kiln runs`: stragglers and elastic resizes.
fn event_phrase(v: &serde_json::Value, step: u64) -> Option<String> {
    if v["kind"] != "fault" {
        return None;
    }
    let n = |k: &str| v[k].as_u64().map_or("?".to_string(), |x| x.to_string());
    Some(match v["event"].as_str()? {
        "straggler" => format!("straggler rank {} ({:.2}×) at step {step}", n("rank"), v["ratio"].as_f64().unwrap_or(f64::NAN)),
        "rank_lost" => format!("rank {} lost at step {step}", n("rank")),
        "world_resized" => format!("{} → {} ranks at step {step} (from step {}, {} steps lost)", n("from"), n("to"), n("restored_step"), n("lost_steps")),
        "rank_rejoined" => format!("ranks {} rejoined at step {step}", v["ranks"]),
        _ => return None,
    })
}

fn value_str(v: Option<&toml::Value>) -> String {
    match v {
        None => "-".into(),
        Some(toml::Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    }
}

/// The config keys whose values are not the same in every run (a key missing from some run
/// counts as differing).
pub fn differing_keys(runs: &[RunSummary]) -> Vec<String> {
    let mut keys: Vec<&String> = runs.iter().flat_map(|r| r.config.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| k.as_str() != "preset")
        .filter(|k| {
            let first = runs[0].config.get(*k);
            runs.iter().any(|r| r.config.get(*k) != first)
        })
        .cloned()
        .collect()
}

/// The run directories under `dir` (those with a config.toml or a metrics.jsonl), by name.
pub fn run_dirs(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let rd = fs::read_dir(dir).map_err(|e| format!("{}: cannot list: {e}", dir.display()))?;
    let mut v: Vec<PathBuf> = rd.flatten().map(|e| e.path()).filter(|p| p.is_dir() && (p.join("config.toml").is_file() || p.join("metrics.jsonl").is_file())).collect();
    v.sort();
    Ok(v)
}

fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let width: Vec<usize> = (0..cols).map(|c| rows.iter().filter_map(|r| r.get(c)).map(|s| s.chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for (i, r) in rows.iter().enumerate() {
        let line: Vec<String> = r.iter().enumerate().map(|(c, s)| format!("{s:<w$}", w = width[c])).collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
        if i == 0 {
            let rule: Vec<String> = width.iter().map(|w| "-".repeat(*w)).collect();
            out.push_str(&rule.join("  "));
            out.push('\n');
        }
    }
    out
}

/// A table of the runs under `dir`: name (marked live while a process trains in it), preset,
/// steps done, final and best val loss, and one
/// column per config key that differs between the runs.
pub fn list_runs(dir: &Path) -> Result<String, String> {
    let dirs = run_dirs(dir)?;
    if dirs.is_empty() {
        return Ok(format!("no run directories under {}\n", dir.display()));
    }
    let runs: Vec<RunSummary> = dirs.iter().map(|d| summarize(d)).collect();
    let diff = if runs.len() > 1 { differing_keys(&runs) } else { Vec::new() };
    let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.4}"));
    let mut rows = vec![["run", "preset", "steps", "final val", "best val"].iter().map(|s| s.to_string()).chain(diff.iter().cloned()).collect::<Vec<_>>()];
    for (r, d) in runs.iter().zip(&dirs) {
        // A run a process is training in now (its lock is held).
        let live = crate::run::holder(d).map_or(String::new(), |(pid, _)| format!(" (live, pid {pid})"));
        let mut row = vec![
            format!("{}{live}", r.name),
            r.preset.clone().unwrap_or_else(|| "-".into()),
            r.steps.map_or("-".to_string(), |s| s.to_string()),
            f(r.final_val),
            f(r.best_val),
        ];
        row.extend(diff.iter().map(|k| value_str(r.config.get(k))));
        rows.push(row);
    }
    let mut out = table(&rows);
    for r in runs.iter().filter(|r| r.config_error.is_some()) {
        out.push_str(&format!("note: {}: config.toml unreadable: {}\n", r.name, r.config_error.as_deref().unwrap_or("")));
    }
    for r in runs.iter().filter(|r| !r.events.is_empty()) {
        out.push_str(&format!("events: {}: {}\n", r.name, r.events.join("; ")));
    }
    if runs.len() > 1 && diff.is_empty() {
        out.push_str("(all runs have the same config)\n");
    }
    Ok(out)
}
