//! Training curves as a PNG (plotters, bitmap backend): train and val loss against steps and
//! against tokens, the learning rate, and throughput; several runs overlaid.
//!
//! No system font is assumed: DejaVu Sans (`crates/kiln/assets/`, Bitstream Vera licence) is
//! compiled in and registered with plotters' `ab_glyph` renderer.

use plotters::prelude::*;
use plotters::style::FontStyle;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";

fn register_font() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).map_err(|_| "the embedded DejaVu Sans font does not parse".to_string()))
        .clone()
}

/// One run's curves, read from its directory.
#[derive(Clone, Debug, Default)]
pub struct RunCurves {
    pub name: String,
    /// `(step, loss)` of train lines.
    pub train: Vec<(f64, f64)>,
    /// `(step, val_loss)` of eval lines.
    pub val: Vec<(f64, f64)>,
    pub lr: Vec<(f64, f64)>,
    pub tokens_per_sec: Vec<(f64, f64)>,
    /// Tokens per optimizer step (`train.batch_size · model.block_size`), when config.toml says.
    pub tokens_per_step: Option<f64>,
    /// Cumulative tokens by step, where metrics lines carry them (`tokens` or `tokens_seen`);
    /// these win over `step · tokens_per_step`.
    pub tokens_at: std::collections::BTreeMap<u64, f64>,
}

impl RunCurves {
    /// Tokens seen by the end of `step`, if known.
    pub fn tokens(&self, step: f64) -> Option<f64> {
        self.tokens_at.get(&(step as u64)).copied().or_else(|| self.tokens_per_step.map(|t| step * t))
    }
}

impl RunCurves {
    /// Reads `dir/metrics.jsonl` (required) and `dir/config.toml` (optional: for tokens).
    pub fn load(dir: &Path) -> Result<RunCurves, String> {
        let mpath = dir.join("metrics.jsonl");
        let text = fs::read_to_string(&mpath).map_err(|e| format!("{}: cannot read: {e}", mpath.display()))?;
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| dir.display().to_string());
        let mut c = RunCurves { name, ..Default::default() };
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
            let Some(step) = v.get("step").and_then(|s| s.as_f64()) else { continue };
            let num = |k: &str| v.get(k).and_then(|x| x.as_f64()).filter(|x| x.is_finite());
            if let Some(t) = num("tokens").or_else(|| num("tokens_seen")) {
                c.tokens_at.insert(step as u64, t);
            }
            match v.get("kind").and_then(|k| k.as_str()) {
                Some("train") => {
                    if let Some(x) = num("loss") {
                        c.train.push((step, x));
                    }
                    if let Some(x) = num("lr") {
                        c.lr.push((step, x));
                    }
                    if let Some(x) = num("tokens_per_sec") {
                        c.tokens_per_sec.push((step, x));
                    }
                }
                Some("eval") => {
                    if let Some(x) = num("val_loss") {
                        c.val.push((step, x));
                    }
                }
                _ => {}
            }
        }
        if let Ok(cfg) = fs::read_to_string(dir.join("config.toml")) {
            if let Ok(t) = cfg.parse::<toml::Table>() {
                let get = |s: &str, k: &str| t.get(s).and_then(|x| x.get(k)).and_then(|x| x.as_integer());
                if let (Some(b), Some(bs)) = (get("train", "batch_size"), get("model", "block_size")) {
                    c.tokens_per_step = Some((b * bs) as f64);
                }
            }
        }
        Ok(c)
    }
}

const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// `1.5k`, `2.3M`, `1.2G`.
pub fn human(x: f64) -> String {
    let a = x.abs();
    let (d, s) = if a >= 1e9 { (1e9, "G") } else if a >= 1e6 { (1e6, "M") } else if a >= 1e3 { (1e3, "k") } else { (1.0, "") };
    let v = x / d;
    let t = if s.is_empty() && v.fract() != 0.0 { format!("{v:.2}") } else if v.fract() == 0.0 { format!("{v:.0}") } else { format!("{v:.1}") };
    format!("{t}{s}")
}

fn range(vals: impl Iterator<Item = f64>, zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in vals.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if zero {
        lo = lo.min(0.0);
    }
    if hi - lo <= f64::EPSILON * hi.abs().max(1.0) {
        let pad = if hi == 0.0 { 1.0 } else { hi.abs() * 0.1 };
        return (lo - pad, hi + pad);
    }
    let pad = (hi - lo) * 0.05;
    (if zero && lo >= 0.0 { lo } else { lo - pad }, hi + pad)
}

struct Series {
    label: String,
    color: RGBColor,
    pts: Vec<(f64, f64)>,
    markers: bool,
}

/// `c` blended toward white by `f` (train curves are lighter than their run's val curve).
fn lighten(c: RGBColor, f: f64) -> RGBColor {
    let l = |x: u8| (x as f64 + (255.0 - x as f64) * f).round() as u8;
    RGBColor(l(c.0), l(c.1), l(c.2))
}

struct Panel<'a> {
    title: &'a str,
    x_desc: &'a str,
    y_desc: &'a str,
    series: Vec<Series>,
    y_fmt: fn(&f64) -> String,
    y_zero: bool,
    /// Extra room above the data (a fraction of its range) for the legend.
    headroom: f64,
}

type Area<'b> = DrawingArea<BitMapBackend<'b>, plotters::coord::Shift>;

fn draw_panel(area: &Area<'_>, p: &Panel<'_>) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("plot: {e}");
    let (x0, x1) = range(p.series.iter().flat_map(|s| s.pts.iter().map(|q| q.0)), true);
    let (y0, y1) = range(p.series.iter().flat_map(|s| s.pts.iter().map(|q| q.1)), p.y_zero);
    let y1 = y1 + (y1 - y0) * p.headroom;
    let mut chart = ChartBuilder::on(area)
        .caption(p.title, (FAMILY, 26))
        .margin(18)
        .x_label_area_size(55)
        .y_label_area_size(85)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| err(&e))?;
    let y_fmt = p.y_fmt;
    chart
        .configure_mesh()
        .x_desc(p.x_desc)
        .y_desc(p.y_desc)
        .label_style((FAMILY, 17))
        .axis_desc_style((FAMILY, 19))
        .x_label_formatter(&|x| human(*x))
        .y_label_formatter(&y_fmt)
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| err(&e))?;
    if p.series.iter().all(|s| s.pts.is_empty()) {
        let (w, h) = area.dim_in_pixel();
        area.draw(&Text::new("no data", (w as i32 / 2 - 40, h as i32 / 2), (FAMILY, 22).into_font().color(&RGBColor(120, 120, 120)))).map_err(|e| err(&e))?;
        return Ok(());
    }
    for s in &p.series {
        if s.pts.is_empty() {
            continue;
        }
        let color = s.color;
        let width = if s.markers { 3 } else { 2 };
        chart
            .draw_series(LineSeries::new(s.pts.iter().copied(), color.stroke_width(width)))
            .map_err(|e| err(&e))?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(width)));
        // Val points get markers; so does a series too short to draw a line.
        if s.markers || s.pts.len() < 2 {
            chart.draw_series(s.pts.iter().map(|&q| Circle::new(q, 4, color.filled()))).map_err(|e| err(&e))?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(160, 160, 160))
        .label_font((FAMILY, 16))
        .draw()
        .map_err(|e| err(&e))?;
    Ok(())
}

fn fmt_loss(y: &f64) -> String {
    format!("{y:.2}")
}
fn fmt_lr(y: &f64) -> String {
    if *y == 0.0 { "0".into() } else { format!("{y:.1e}") }
}
fn fmt_human(y: &f64) -> String {
    human(*y)
}

/// Plots the curves of several runs into one PNG at `out`: train/val loss vs step, train/val
/// loss vs tokens, learning rate vs step, tokens/s vs step. The legend names each run by its
/// directory name.
pub fn plot_runs(run_dirs: &[PathBuf], out: &Path) -> Result<(), String> {
    if run_dirs.is_empty() {
        return Err("plot: no run directories given".into());
    }
    let runs = run_dirs.iter().map(|d| RunCurves::load(d)).collect::<Result<Vec<_>, _>>()?;
    // Names must tell runs apart: fall back to the full path when two share a last component.
    let mut names: Vec<String> = runs.iter().map(|r| r.name.clone()).collect();
    for i in 0..names.len() {
        if names.iter().filter(|n| **n == runs[i].name).count() > 1 {
            names[i] = run_dirs[i].display().to_string();
        }
    }
    plot_curves(&runs, &names, out)
}

/// [`plot_runs`] on curves already loaded, with their legend names.
pub fn plot_curves(runs: &[RunCurves], names: &[String], out: &Path) -> Result<(), String> {
    register_font()?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(|e| format!("{}: cannot create: {e}", parent.display()))?;
    }
    let several = runs.len() > 1;
    let mk = |f: &dyn Fn(&RunCurves) -> Vec<Series>| runs.iter().flat_map(f).collect::<Vec<_>>();
    let color = |i: usize| COLORS[i % COLORS.len()];
    let idx = |r: &RunCurves| runs.iter().position(|q| std::ptr::eq(q, r)).unwrap();
    let label = |r: &RunCurves, what: &str| {
        let n = &names[idx(r)];
        match (several, what.is_empty()) {
            (true, true) => n.clone(),
            (true, false) => format!("{n} {what}"),
            (false, true) => n.clone(),
            (false, false) => what.to_string(),
        }
    };
    let s = |label: String, color: RGBColor, pts: Vec<(f64, f64)>, markers: bool| Series { label, color, pts, markers };
    let loss_vs = |tokens: bool| {
        mk(&|r: &RunCurves| {
            let c = color(idx(r));
            // One run: two clear colours; several: each run's colour, train lighter than val.
            let (ct, cv) = if several { (lighten(c, 0.35), c) } else { (COLORS[0], COLORS[1]) };
            let x = |p: &(f64, f64)| if tokens { r.tokens(p.0).map(|t| (t, p.1)) } else { Some(*p) };
            vec![
                s(label(r, "train"), ct, r.train.iter().filter_map(x).collect(), false),
                s(label(r, "val"), cv, r.val.iter().filter_map(x).collect(), true),
            ]
        })
    };
    let panels = [
        Panel { title: "Loss vs step", x_desc: "step", y_desc: "loss (nats/token)", series: loss_vs(false), y_fmt: fmt_loss, y_zero: false, headroom: 0.0 },
        Panel { title: "Loss vs tokens", x_desc: "tokens seen", y_desc: "loss (nats/token)", series: loss_vs(true), y_fmt: fmt_loss, y_zero: false, headroom: 0.0 },
        Panel {
            title: "Learning rate",
            x_desc: "step",
            y_desc: "learning rate",
            series: mk(&|r: &RunCurves| vec![s(label(r, ""), color(idx(r)), r.lr.clone(), false)]),
            y_fmt: fmt_lr,
            y_zero: true,
            headroom: 0.12 * runs.len() as f64 + 0.1,
        },
        Panel {
            title: "Throughput",
            x_desc: "step",
            y_desc: "tokens / s",
            series: mk(&|r: &RunCurves| vec![s(label(r, ""), color(idx(r)), r.tokens_per_sec.clone(), false)]),
            y_fmt: fmt_human,
            y_zero: true,
            headroom: 0.12 * runs.len() as f64 + 0.1,
        },
    ];
    {
        let root = BitMapBackend::new(out, (1600, 1100)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| format!("plot: {e}"))?;
        let title = if several { format!("kiln: {} runs", runs.len()) } else { format!("kiln: {}", names[0]) };
        let root = root.margin(14, 0, 0, 0).titled(&title, (FAMILY, 30)).map_err(|e| format!("plot: {e}"))?;
        let areas = root.split_evenly((2, 2));
        for (a, p) in areas.iter().zip(panels.iter()) {
            draw_panel(a, p)?;
        }
        root.present().map_err(|e| format!("{}: cannot write the PNG: {e}", out.display()))?;
    }
    Ok(())
}

/// The plot of one run, into `run_dir/loss.png`.
pub fn write_loss_png(run_dir: &Path) -> Result<(), String> {
    plot_runs(&[run_dir.to_path_buf()], &run_dir.join("loss.png"))
}
