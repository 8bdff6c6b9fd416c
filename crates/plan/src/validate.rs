//! Predicted vs published throughput on a table of runs (CSV or JSON).
//!
//! Columns (case-insensitive; CSV header or JSON keys): `params,heads,hidden,layers,TP,PP,GPUs,global_batch,
//! tflops_per_gpu` are required. Optional, defaulting to the setup of Narayanan et al. 2021 Table 1 (Megatron-LM,
//! 2021): `name`; `gpu` (a100-80gb); `gpus_per_node`; `seq` (2048); `vocab` (51200); `kv_heads`, `ffn_hidden`,
//! `mlp` (gelu), `experts`, `top_k`; `micro_batch` and `virtual_stages` (chosen, as Megatron would: best feasible);
//! `setup` (a `plan::setup` preset, default `megatron-2021`, which sets the defaults of the software columns:
//! `recompute` (full); `sequence_parallel` (false); `attention` (unfused); `precision` (fp16, Megatron's fp16
//! optimizer); `fp32_grads` (false); `zero` (0); `overlap_comm` (false: no TP/p2p overlap); `overlap_dp` (false:
//! gradients reduced after the backward pass)); `schedule` (chosen; Table 1 used interleaved, which wins where it
//! fits); `cp` (1); `ep`;
//! `convention`: `hardware` (the default: counts recomputation, Table 1's convention) or `model` (72·… model FLOPs,
//! i.e. MFU × peak).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::cost::{hardware_flops, model_flops, Attention, Layout, Recompute};
use crate::hardware::{Cluster, HardwareCatalog, Precision};
use crate::policy::Names;
use crate::models::{Mlp, RawModel};
use crate::schedule::{self, Kind};
use crate::search::{search, Constraints};
use crate::setup::Setup;
use crate::PlanError;

/// One published run, resolved.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub name: String,
    pub params_b: f64,
    pub heads: u64,
    pub hidden: u64,
    pub layers: u64,
    pub tp: u64,
    pub pp: u64,
    pub gpus: u64,
    pub global_batch: u64,
    pub published_tflops: f64,
    fields: BTreeMap<String, String>,
    /// A catalogue row lacking a required column: which (it is skipped, not evaluated).
    missing: Option<String>,
}

impl Row {
    fn get(&self, k: &str) -> Option<&str> {
        self.fields.get(k).map(|s| s.as_str()).filter(|s| !s.is_empty())
    }
    fn num(&self, k: &str, origin: &str) -> Result<Option<f64>, PlanError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.trim_end_matches('%').parse::<f64>().map(Some).map_err(|_| {
                PlanError(format!(
                    "{origin}: row '{}': column '{k}' = '{v}' is not a number",
                    self.name
                ))
            }),
        }
    }
    fn int(&self, k: &str, origin: &str) -> Result<Option<u64>, PlanError> {
        Ok(self.num(k, origin)?.map(|x| x.round() as u64))
    }
}

fn norm_key(k: &str) -> String {
    let k = k.trim().trim_matches('"').to_ascii_lowercase().replace([' ', '-'], "_");
    match k.as_str() {
        "params_b" | "params(b)" | "parameters" => "params".into(),
        "batch" | "global_batch_size" | "batch_size" => "global_batch".into(),
        "tflops" | "achieved_tflops_per_gpu" | "tflop/s_per_gpu" | "tflops/gpu" => "tflops_per_gpu".into(),
        "gpu_count" | "n_gpus" => "gpus".into(),
        "tensor_parallel" | "t" => "tp".into(),
        "pipeline_parallel" | "p" => "pp".into(),
        // The published-runs catalogue's names.
        "id" => "name".into(),
        "accelerator" => "gpu".into(),
        "global_batch_seqs" => "global_batch".into(),
        "seq_len" => "seq".into(),
        "zero_stage" => "zero".into(),
        _ => k,
    }
}

const REQUIRED: [&str; 9] = [
    "params",
    "heads",
    "hidden",
    "layers",
    "tp",
    "pp",
    "gpus",
    "global_batch",
    "tflops_per_gpu",
];

/// A table with a `source` column is a catalogue of published runs: a row kiln cannot evaluate
/// (no throughput published, an accelerator it does not know) is listed as skipped with its
/// reason instead of failing the table, and the report gives each half of [`split_of`].
fn is_catalogue(maps: &[BTreeMap<String, String>]) -> bool {
    maps.first().is_some_and(|m| m.contains_key("source"))
}

/// The source whose rows every constant of the planner was fitted on before the wider catalogue (Narayanan et al.
/// 2021 Table 1): always in the fit half, never evidence of generalisation.
pub const FITTED_SOURCE: &str = "narayanan2021";

/// The fit / hold-out split of the published-runs catalogue, a fixed rule decided before any constant of
/// the wider catalogue was fitted and independent of every value in the row (throughput, shape, error):
/// the rows of [`FITTED_SOURCE`] are `fit`; every other source's rows are numbered 0, 1, 2, … in
/// catalogue order within the source, and row `k` is `fit` when `k mod 3 == 1`, else `holdout`.
/// So at most a third (rounded up) of each other source is fitted on, a one-row source is held out, every source
/// with two rows or more lands in both halves, and appending rows never moves an existing one.
pub fn split_of(source: &str, index_in_source: usize) -> &'static str {
    if source == FITTED_SOURCE || index_in_source % 3 == 1 {
        "fit"
    } else {
        "holdout"
    }
}

fn rows_from_maps(maps: Vec<BTreeMap<String, String>>, origin: &str) -> Result<Vec<Row>, PlanError> {
    let mut rows = Vec::new();
    let catalogue = is_catalogue(&maps);
    let mut per_source: BTreeMap<String, usize> = BTreeMap::new();
    for (i, mut f) in maps.into_iter().enumerate() {
        if catalogue {
            let src = f.get("source").cloned().unwrap_or_default();
            let k = per_source.entry(src.clone()).or_insert(0);
            f.insert("split".into(), split_of(&src, *k).into());
            *k += 1;
        }
        let mut missing = None;
        for k in REQUIRED {
            // (A catalogue row may publish MFU instead of TFLOP/s, or neither: `validate` says.)
            if f.get(k).is_none_or(|v| v.is_empty()) && !(catalogue && k == "tflops_per_gpu") {
                if !catalogue {
                    return Err(PlanError(format!("{origin}: row {}: missing column '{k}'", i + 1)));
                }
                missing.get_or_insert(format!("the catalogue gives no '{k}'"));
            }
        }
        let name = f.get("name").cloned().unwrap_or_else(|| format!("{}B", f["params"]));
        let mut row = Row {
            name,
            params_b: 0.0,
            heads: 0,
            hidden: 0,
            layers: 0,
            tp: 0,
            pp: 0,
            gpus: 0,
            global_batch: 0,
            published_tflops: 0.0,
            fields: f,
            missing,
        };
        if row.missing.is_some() {
            rows.push(row);
            continue;
        }
        let need = |r: &Row, k: &str| -> Result<f64, PlanError> { Ok(r.num(k, origin)?.unwrap_or(0.0)) };
        row.params_b = need(&row, "params")?;
        row.heads = need(&row, "heads")? as u64;
        row.hidden = need(&row, "hidden")? as u64;
        row.layers = need(&row, "layers")? as u64;
        row.tp = need(&row, "tp")? as u64;
        row.pp = need(&row, "pp")? as u64;
        row.gpus = need(&row, "gpus")? as u64;
        row.global_batch = need(&row, "global_batch")? as u64;
        row.published_tflops = need(&row, "tflops_per_gpu")?;
        rows.push(row);
    }
    if rows.is_empty() {
        return Err(PlanError(format!("{origin}: no rows")));
    }
    Ok(rows)
}

/// Parse a CSV table: a header line, then rows; `#` comments and blank lines are skipped.
pub fn parse_csv(text: &str, origin: &str) -> Result<Vec<Row>, PlanError> {
    let mut lines = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'));
    let header: Vec<String> = match lines.next() {
        Some(h) => h.split(',').map(norm_key).collect(),
        None => return Err(PlanError(format!("{origin}: empty table"))),
    };
    let mut maps = Vec::new();
    for (i, line) in lines.enumerate() {
        let cells = split_csv_line(line);
        if cells.len() != header.len() {
            return Err(PlanError(format!(
                "{origin}: line {}: {} cells but the header has {}",
                i + 2,
                cells.len(),
                header.len()
            )));
        }
        maps.push(
            header
                .iter()
                .cloned()
                .zip(cells.iter().cloned())
                .collect(),
        );
    }
    rows_from_maps(maps, origin)
}

/// One CSV line's cells: commas inside double quotes stay in the cell, `""` is a quote.
fn split_csv_line(line: &str) -> Vec<String> {
    let (mut cells, mut cur, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            ',' if !quoted => cells.push(std::mem::take(&mut cur).trim().to_string()),
            _ => cur.push(c),
        }
    }
    cells.push(cur.trim().to_string());
    cells
}

/// Parse a JSON array of objects with the same keys as the CSV header.
pub fn parse_json(text: &str, origin: &str) -> Result<Vec<Row>, PlanError> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| PlanError(format!("{origin}: invalid JSON: {e}")))?;
    let arr = v
        .as_array()
        .ok_or_else(|| PlanError(format!("{origin}: expected a JSON array of rows")))?;
    let mut maps = Vec::new();
    for (i, item) in arr.iter().enumerate() {
        let obj = item
            .as_object()
            .ok_or_else(|| PlanError(format!("{origin}: row {} is not an object", i + 1)))?;
        let mut m = BTreeMap::new();
        for (k, v) in obj {
            let s = match v {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Null => String::new(),
                other => other.to_string(),
            };
            m.insert(norm_key(k), s);
        }
        maps.push(m);
    }
    rows_from_maps(maps, origin)
}

/// Parse by content: JSON if it starts with `[`, else CSV.
pub fn parse_table(text: &str, origin: &str) -> Result<Vec<Row>, PlanError> {
    if text.trim_start().starts_with('[') {
        parse_json(text, origin)
    } else {
        parse_csv(text, origin)
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct RowResult {
    pub name: String,
    pub tp: u64,
    pub pp: u64,
    pub gpus: u64,
    pub published_tflops: f64,
    pub predicted_tflops: f64,
    pub error_pct: f64,
    pub fits: bool,
    /// Parameters the planner counts for this shape, billions (vs the table's `params`).
    pub params_b: f64,
    pub chosen: Layout,
    /// A catalogue's `split` ([`split_of`]): `fit` (rows the planner's constants may be fitted on) or `holdout`.
    pub split: Option<String>,
    /// The software setup the prediction assumed (the row's preset and overrides, as the search resolved them).
    pub setup: Setup,
    /// The predicted iteration's time breakdown (seconds on the critical stage).
    pub breakdown: crate::cost::Breakdown,
    pub step_time_s: f64,
}

/// One half of a catalogue: its rows' mean absolute percentage error and worst row.
#[derive(Clone, Debug, Serialize)]
pub struct Half {
    pub split: String,
    pub rows: usize,
    pub mape_pct: f64,
    pub worst_pct: f64,
    pub worst_row: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub rows: Vec<RowResult>,
    pub mape_pct: f64,
    pub worst_pct: f64,
    pub worst_row: String,
    /// A catalogue's halves (`fit`, then `holdout`), and the rows it could not evaluate.
    pub halves: Vec<Half>,
    pub skipped: Vec<(String, String)>,
}

fn parse_bool(s: &str, col: &str, origin: &str) -> Result<bool, PlanError> {
    match s.to_ascii_lowercase().as_str() {
        "true" | "yes" | "1" | "on" => Ok(true),
        "false" | "no" | "0" | "off" => Ok(false),
        _ => Err(PlanError(format!("{origin}: column '{col}' = '{s}' is not a boolean"))),
    }
}

/// A row's model, at sequence length `seq`.
fn row_model(row: &Row, origin: &str, seq: u64) -> Result<crate::models::ModelShape, PlanError> {
    let ctx = |e: PlanError| PlanError(format!("{origin}: row '{}': {}", row.name, e.0));
    let raw = RawModel {
        name: row.name.clone(),
        layers: row.layers,
        hidden: row.hidden,
        heads: row.heads,
        kv_heads: row.int("kv_heads", origin)?,
        ffn_hidden: row.int("ffn_hidden", origin)?,
        vocab: row.int("vocab", origin)?.unwrap_or(51200),
        seq: Some(seq),
        mlp: row.get("mlp").map(Mlp::parse).transpose().map_err(ctx)?,
        experts: row.int("experts", origin)?,
        top_k: row.int("top_k", origin)?,
        ..Default::default()
    };
    raw.resolve().map_err(ctx)
}

/// Resolve one row into model, cluster and constraints, and predict it.
pub fn predict_row(row: &Row, cat: &HardwareCatalog, origin: &str) -> Result<RowResult, PlanError> {
    let ctx = |e: PlanError| PlanError(format!("{origin}: row '{}': {}", row.name, e.0));
    let seq = row.int("seq", origin)?.unwrap_or(2048);
    let model = row_model(row, origin, seq)?;
    let gpu = row.get("gpu").unwrap_or("a100-80gb");
    let cluster = Cluster::new(cat, gpu, row.gpus, row.int("gpus_per_node", origin)?).map_err(ctx)?;
    // The row's software setup: its `setup` preset (Megatron-LM 2021, Table 1's, when the table names none), each
    // field overridden by the row's own column where it has one.
    let setup = Setup::preset(row.get("setup").unwrap_or("megatron-2021")).map_err(ctx)?;
    let recompute = row
        .get("recompute")
        .map(|v| Recompute::parse(v).map_err(|e| PlanError(format!("recompute {e}"))))
        .transpose()
        .map_err(ctx)?
        .or(setup.recompute);
    let flag = |k: &str, default: bool| -> Result<bool, PlanError> {
        row.get(k).map_or(Ok(default), |s| parse_bool(s, k, origin))
    };
    // Without a `schedule` column the planner picks the best feasible one (Table 1's interleaved 1F1B wins
    // wherever it fits).
    let schedule = match row.get("schedule") {
        Some(s) => Some(schedule::parse_flag(s).map_err(ctx)?),
        None => None,
    };
    let schedule = if row.pp == 1 {
        Some(Kind::OneFOneB)
    } else {
        schedule
    };
    let c = Constraints {
        tp: Some(row.tp),
        pp: Some(row.pp),
        dp: None,
        cp: Some(row.int("cp", origin)?.unwrap_or(1)),
        // Published context-parallel runs (Llama 3, Megatron) use ring attention.
        cp_mode: Some(crate::policy::CpMode::Ring),
        compression: None,
        powersgd_rank: None,
        zeropp: None,
        ep: row.int("ep", origin)?,
        micro_batch: row.int("micro_batch", origin)?,
        schedule,
        virtual_stages: if row.pp == 1 {
            Some(1)
        } else {
            row.int("virtual_stages", origin)?
        },
        recompute,
        sequence_parallel: match row.get("sequence_parallel") {
            Some(s) => Some(parse_bool(s, "sequence_parallel", origin)?),
            None => setup.sequence_parallel,
        },
        zero: match row.int("zero", origin)? {
            Some(z) => Some(z as u8),
            None => setup.zero,
        },
        precision: Some(
            row.get("precision")
                .map(|v| Precision::parse(v).map_err(|e| PlanError(format!("precision {e}"))))
                .transpose()
                .map_err(ctx)?
                .unwrap_or(setup.precision_on(&cluster.acc)),
        ),
        attention: row.get("attention").map(Attention::parse).transpose().map_err(ctx)?.or(setup.attention),
        overlap_dp: Some(flag("overlap_dp", setup.overlap_dp)?),
        overlap_comm: Some(flag("overlap_comm", setup.overlap_comm)?),
        fp32_grads: Some(flag("fp32_grads", setup.fp32_grads)?),
        optimizer: None,
        optim_state: None,
        uneven_pipeline: Some(setup.uneven_pipeline),
        pp_blocking_p2p: Some(setup.pp_blocking_p2p),
    };
    let res = search(&model, &cluster, row.global_batch, seq, &c).map_err(ctx)?;
    let (est, fits) = match res.plans.first() {
        Some(e) => (e.clone(), true),
        None => match res.smallest_unfit {
            Some(e) => (e, false),
            None => return Err(ctx(PlanError("no valid layout".into()))),
        },
    };
    let hardware_conv = match row.get("convention") {
        None | Some("hardware") => true,
        Some("model") => false,
        Some(o) => {
            return Err(ctx(PlanError(format!(
                "column 'convention' = '{o}' (expected hardware|model)"
            ))))
        }
    };
    let flops = if hardware_conv {
        hardware_flops(&model, row.global_batch, seq, est.chosen.recompute)
    } else {
        model_flops(&model, row.global_batch, seq)
    };
    let predicted = flops / est.step_time_s / row.gpus as f64 / 1e12;
    let used = Setup::of_layout(&setup, &est.chosen);
    Ok(RowResult {
        name: row.name.clone(),
        tp: row.tp,
        pp: row.pp,
        gpus: row.gpus,
        published_tflops: row.published_tflops,
        predicted_tflops: predicted,
        error_pct: (predicted - row.published_tflops) / row.published_tflops * 100.0,
        fits,
        params_b: model.params(seq) as f64 / 1e9,
        chosen: est.chosen.clone(),
        split: row.get("split").map(str::to_string),
        setup: used,
        breakdown: est.breakdown.clone(),
        step_time_s: est.step_time_s,
    })
}

/// A catalogue row as `predict_row` takes it: its published TFLOP/s per GPU, or, where only
/// MFU is published, MFU × the accelerator's dense bf16 peak under the model-FLOPs convention
/// (how MFU is defined: 6·N·tokens, no recomputation). An error says why it cannot be.
fn catalogue_row(row: &Row, cat: &HardwareCatalog) -> Result<Row, String> {
    if let Some(m) = &row.missing {
        return Err(m.clone());
    }
    if row.get("setup") == Some("unmodelled") {
        return Err("the run changes the model or optimizer in ways the planner does not model (setup 'unmodelled'; see its notes)".into());
    }
    let mut r = row.clone();
    if r.published_tflops > 0.0 {
        return Ok(r);
    }
    let gpu = row.get("gpu").unwrap_or("a100-80gb");
    let acc = cat.accelerator(gpu).map_err(|e| e.0)?;
    let mfu = row.get("mfu_percent").and_then(|v| v.trim_end_matches('%').parse::<f64>().ok()).ok_or("no TFLOP/s or MFU published (tokens/s only)")?;
    let peak = acc.peak_flops.get("bf16").ok_or(format!("{gpu} has no bf16 peak for its MFU"))?;
    r.published_tflops = mfu / 100.0 * peak / 1e12;
    r.fields.insert("convention".into(), "model".into());
    Ok(r)
}

/// The mean absolute percentage error of `rows` and the worst of them.
fn summary(rows: &[&RowResult]) -> (f64, f64, String) {
    let mape = rows.iter().map(|r| r.error_pct.abs()).sum::<f64>() / rows.len().max(1) as f64;
    let worst = rows.iter().max_by(|a, b| a.error_pct.abs().total_cmp(&b.error_pct.abs()));
    (mape, worst.map_or(0.0, |w| w.error_pct.abs()), worst.map_or_else(String::new, |w| w.name.clone()))
}

/// Validate every row of a table. A catalogue (a `split` column) reports its halves apart and
/// lists the rows it cannot evaluate; any other table fails on its first bad row.
pub fn validate(rows: &[Row], cat: &HardwareCatalog, origin: &str) -> Result<Report, PlanError> {
    let catalogue = rows.first().is_some_and(|r| r.fields.contains_key("source"));
    let (mut results, mut skipped) = (Vec::new(), Vec::new());
    for r in rows {
        if !catalogue {
            results.push(predict_row(r, cat, origin)?);
            continue;
        }
        match catalogue_row(r, cat).map_err(PlanError).and_then(|c| predict_row(&c, cat, origin)) {
            Ok(x) => results.push(x),
            Err(e) => skipped.push((r.name.clone(), e.0)),
        }
    }
    if results.is_empty() {
        return Err(PlanError(format!("{origin}: no row could be evaluated")));
    }
    let (mape, worst_pct, worst_row) = summary(&results.iter().collect::<Vec<_>>());
    let halves = if catalogue {
        ["fit", "holdout"]
            .iter()
            .map(|h| {
                let part: Vec<&RowResult> = results.iter().filter(|r| r.split.as_deref() == Some(*h)).collect();
                let (m, w, wr) = summary(&part);
                Half { split: h.to_string(), rows: part.len(), mape_pct: m, worst_pct: w, worst_row: wr }
            })
            .collect()
    } else {
        Vec::new()
    };
    Ok(Report { mape_pct: mape, worst_pct, worst_row, rows: results, halves, skipped })
}

/// The built-in copy of Narayanan et al. 2021 Table 1.
pub const NARAYANAN_TABLE1: &str = include_str!("../catalog/narayanan2021_table1.csv");
