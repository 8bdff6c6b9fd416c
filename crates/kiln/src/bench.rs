//! `kiln bench`: timed training steps of a preset or config on synthetic tokens, and
//! `kiln bench --peak`, this machine's fp32 and bf16 matmul peaks through the same kernels.
//! Prints JSON so scripts (bench/compare.py) can compare runs.

use crate::config::{self, padded_vocab, Raw, RunConfig};
use crate::error::{user, Result};
use crate::presets;
use crate::step::{model_flops_per_token, single_rank, train_step, Chunk, Optimizer, Pipeline};
use model::Gpt;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;
use tensor::bf16::{gemm_bf16, to_bf16, Mat};
use tensor::matmul::{gemm, Arith, Threads, View};
use tensor::Rng;

pub struct BenchArgs {
    pub preset: Option<String>,
    pub config: Option<PathBuf>,
    pub set: Vec<String>,
    pub steps: usize,
    pub warmup: usize,
    pub breakdown: bool,
    /// Where the steps run (a device: `train.device`'s step, `device_step::DeviceRun`).
    pub device: crate::device::DeviceArg,
}

/// Best-of-`reps` FLOP/s of an `m × k · k × n` product (B·T × C · C × OC, as in a Linear) in
/// `arith` (bf16: the inputs stored as bf16, as the peak's denominator assumes).
fn product_flops(arith: Arith, m: usize, n: usize, k: usize, reps: usize) -> f64 {
    let a: Vec<f32> = (0..m * k).map(|i| ((i % 7) as f32 - 3.0) * 0.01).collect();
    let b: Vec<f32> = (0..n * k).map(|i| ((i % 5) as f32 - 2.0) * 0.01).collect();
    let (ah, bh): (Vec<u16>, Vec<u16>) = match arith {
        Arith::Bf16 => (a.iter().map(|&x| to_bf16(x)).collect(), b.iter().map(|&x| to_bf16(x)).collect()),
        Arith::F32 => (Vec::new(), Vec::new()),
    };
    let mut c = vec![0.0f32; m * n];
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t0 = Instant::now();
        // The Linear layout: weights [OC, C] read transposed through strides.
        match arith {
            Arith::F32 => gemm(&mut c, false, View::rows(&a, m, k), View::rows(&b, n, k).t(), 1.0, Threads::All),
            Arith::Bf16 => gemm_bf16(&mut c, false, Mat::rows(&ah, m, k), Mat::rows(&bh, n, k).t(), 1.0, Threads::All),
        }
        best = best.min(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(&c);
    2.0 * (m * n * k) as f64 / best
}

/// The matmul peak in FLOP/s of the arithmetic `precision` trains in: the best product of
/// [`peak`] (bf16 products for bf16, fp32 otherwise). Training and `kiln bench` state MFU
/// against this figure.
pub fn peak_flops(precision: model::Precision) -> f64 {
    peak_of(model::gpt::arith(precision), false).0 * 1e9
}

/// [`peak_flops`] measured again now (and written to the peak cache): for a run whose
/// throughput beat the figure it started with, which was therefore measured on a busy machine.
pub fn remeasured_peak_flops(precision: model::Precision) -> f64 {
    let arith = model::gpt::arith(precision);
    let got = measure_products(arith);
    PeakCache::new(arith).put(&got);
    got.0 * 1e9
}

/// A rate stated against `peak`, never above 100 %: a `rate` above the peak shows the peak is
/// out of date. `remeasure` gives a fresh figure (called at most once, the first time it is
/// beaten); if the rate beats that too, the rate itself is the best this machine is known to
/// do and becomes the peak. Returns the utilisation and the peak now in force.
pub fn honest_utilisation(rate: f64, peak: f64, remeasured: &mut bool, remeasure: impl FnOnce() -> f64) -> (f64, f64) {
    if rate <= peak || !rate.is_finite() {
        return (rate / peak, peak);
    }
    let mut peak = peak;
    if !*remeasured {
        *remeasured = true;
        peak = peak.max(remeasure());
    }
    let peak = peak.max(rate);
    (rate / peak, peak)
}

/// The best GFLOP/s and the per-shape rows of [`peak`]'s products in `arith`, measured once per
/// process (an in-process restart of the ranks does not measure again; training measures only
/// its own arithmetic's) and kept in the peak cache ([`PeakCache`]) for later processes on the
/// same machine: the products take seconds, which every short run would otherwise pay.
/// `fresh` (`kiln bench --peak`) measures again and replaces the cached figure.
fn peak_of(arith: Arith, fresh: bool) -> &'static (f64, Vec<serde_json::Value>) {
    static PEAK: [std::sync::OnceLock<(f64, Vec<serde_json::Value>)>; 2] = [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
    PEAK[arith as usize].get_or_init(|| {
        let cache = PeakCache::new(arith);
        if !fresh {
            if let Some(hit) = cache.get() {
                return hit;
            }
        }
        let got = measure_products(arith);
        cache.put(&got);
        got
    })
}

/// The products [`peak_of`] times, and their best GFLOP/s.
fn measure_products(arith: Arith) -> (f64, Vec<serde_json::Value>) {
    {
        let shapes: &[(&str, usize, usize, usize)] = &[
            ("square 2048", 2048, 2048, 2048),
            ("square 1024", 1024, 1024, 1024),
            ("gpt2 qkv B4T256", 1024, 2304, 768),
            ("gpt2 mlp up B4T256", 1024, 3072, 768),
            ("gpt2 mlp down B4T256", 1024, 768, 3072),
            ("gpt2 lm head B4T256", 1024, 50304, 768),
        ];
        let mut rows = Vec::new();
        let mut best = 0.0f64;
        for &(name, m, n, k) in shapes {
            let f = product_flops(arith, m, n, k, if m * n * k > 1 << 31 { 3 } else { 6 });
            best = best.max(f);
            rows.push(json!({"shape": name, "m": m, "n": n, "k": k, "gflops": f / 1e9}));
        }
        (best / 1e9, rows)
    }
}

/// The matmul peak measured on this machine before: `peak.json` in `$KILN_CACHE_DIR` (else
/// `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`), one entry per CPU model, ISA path, thread
/// count, arithmetic, kiln version and build profile, so a different machine, pool size or build measures
/// afresh. A missing, unreadable or corrupt cache is a miss; a failed write is ignored (the
/// figure is then measured again next time).
struct PeakCache {
    path: Option<PathBuf>,
    key: String,
}

impl PeakCache {
    fn new(arith: Arith) -> PeakCache {
        let dir = std::env::var_os("KILN_CACHE_DIR").map(PathBuf::from).or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("kiln")).or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kiln")))
        });
        let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())).unwrap_or_default();
        let build = if cfg!(debug_assertions) { "debug" } else { "release" };
        let key = format!("{cpu} | {} | {} threads | {arith:?} | kiln {} {build}", tensor::bf16::path().name(), rayon::current_num_threads(), env!("CARGO_PKG_VERSION"));
        PeakCache { path: dir.map(|d| d.join("peak.json")), key }
    }

    fn read(&self) -> serde_json::Map<String, serde_json::Value> {
        let text = self.path.as_ref().and_then(|p| std::fs::read_to_string(p).ok());
        text.and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok()).and_then(|v| v.as_object().cloned()).unwrap_or_default()
    }

    fn get(&self) -> Option<(f64, Vec<serde_json::Value>)> {
        let e = self.read().get(&self.key)?.clone();
        let best = e["peak_gflops"].as_f64().filter(|x| x.is_finite() && *x > 0.0)?;
        Some((best, e["products"].as_array()?.clone()))
    }

    fn put(&self, got: &(f64, Vec<serde_json::Value>)) {
        let Some(path) = &self.path else { return };
        let mut all = self.read();
        all.insert(self.key.clone(), json!({"peak_gflops": got.0, "products": got.1}));
        if let Some(d) = path.parent() {
            let _ = std::fs::create_dir_all(d);
        }
        let _ = crate::util::write_atomic(path, serde_json::to_string_pretty(&all).unwrap_or_default().as_bytes());
    }
}

/// `kiln bench --peak`: large square and transformer-shaped products on all threads, in fp32
/// and in bf16 (fp32 accumulation) on the path this machine runs.
pub fn peak() -> serde_json::Value {
    let (f, fr) = peak_of(Arith::F32, true);
    let (b, br) = peak_of(Arith::Bf16, true);
    json!({
        "peak_gflops": f, "products": fr, "bf16_peak_gflops": b, "bf16_products": br, "bf16_over_fp32": b / f,
        "bf16_path": tensor::bf16::path().name(), "bf16_choice": tensor::bf16::choice().describe(),
        "bf16_dot_over_fma": tensor::bf16::dot_over_fma(), "cpu_vendor": tensor::bf16::vendor(), "threads": rayon::current_num_threads(),
    })
}

/// Seconds of each timed step (after `args.warmup` untimed ones) of `step(s)`.
fn time_steps(args: &BenchArgs, mut step: impl FnMut(usize) -> Result<()>) -> Result<Vec<f64>> {
    let mut times = Vec::new();
    for s in 0..args.warmup + args.steps {
        if s == args.warmup {
            tensor::profile::enable(args.breakdown);
            let _ = tensor::profile::take();
        }
        let t0 = Instant::now();
        step(s)?;
        if s >= args.warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    tensor::profile::enable(false);
    Ok(times)
}

/// What a device bench adds: the adapter, its measured matmul peak (the MFU denominator) and
/// the host↔device bytes of each timed step, most first.
struct DeviceFigures {
    adapter: String,
    peak: f64,
    bytes_per_step: Vec<u64>,
}

/// The timed steps on the device: `train.device`'s step over the chunk's model.
#[cfg(feature = "vulkan")]
fn device_steps(args: &BenchArgs, cfg: &RunConfig, ch: &mut Chunk, fill: &mut impl FnMut(usize, &mut crate::step::RowBuf)) -> Result<(Vec<f64>, DeviceFigures)> {
    let mut dev = crate::device_step::DeviceRun::new(args.device, cfg, std::slice::from_mut(ch))?;
    let rows = cfg.micro_batch();
    let mut bytes = Vec::new();
    let times = time_steps(args, |s| {
        let before = dev.traffic();
        dev.step(std::slice::from_mut(ch), cfg, (s as u64, rows), &mut *fill, |_, _| None, &crate::step::Pipeline::single(cfg.train.grad_accum, None))?;
        let after = dev.traffic();
        if s >= args.warmup {
            bytes.push(after.to_device - before.to_device + after.to_host - before.to_host);
        }
        Ok(())
    })?;
    bytes.sort_unstable_by(|a, b| b.cmp(a));
    Ok((times, DeviceFigures { adapter: dev.describe(), peak: dev.peak_flops(), bytes_per_step: bytes }))
}

#[cfg(not(feature = "vulkan"))]
fn device_steps(args: &BenchArgs, _: &RunConfig, _: &mut Chunk, _: &mut impl FnMut(usize, &mut crate::step::RowBuf)) -> Result<(Vec<f64>, DeviceFigures)> {
    user(format!("bench --device {}: this kiln was built without the device backend (rebuild with the default features, or `--features vulkan`)", args.device))
}

/// The tokenizer vocabulary a bench config implies without reading data.
fn bench_vocab(cfg: &RunConfig) -> Result<usize> {
    if cfg.model.vocab_size > 0 {
        return Ok(cfg.model.vocab_size);
    }
    match cfg.data.tokenizer.as_str() {
        "byte" => Ok(256),
        "gpt2" => Ok(50257),
        other => user(format!("bench: data.tokenizer `{other}` needs data to size its vocabulary: set model.vocab_size")),
    }
}

pub fn bench(args: &BenchArgs) -> Result<serde_json::Value> {
    let name = args.preset.clone().unwrap_or_else(|| "tiny".into());
    let mut raw: Raw = presets::preset(&name)?.to_raw();
    if let Some(p) = &args.config {
        config::apply_file(&mut raw, p)?;
    }
    for kv in &args.set {
        config::apply_set(&mut raw, kv)?;
    }
    let cfg = RunConfig::resolve(&raw)?;
    if args.steps == 0 {
        return user("bench: --steps must be positive");
    }
    let real_vocab = bench_vocab(&cfg)?;
    let gcfg = cfg.gpt_config(real_vocab);
    let vp = if cfg.model.vocab_size > 0 { gcfg.vocab_size } else { padded_vocab(real_vocab) };
    let gcfg = model::GptConfig { vocab_size: vp, ..gcfg };
    let t = cfg.seq_len();
    // One rank in this process, whatever the config's layout: refused before it allocates when
    // its plan exceeds the memory available.
    let mut one = cfg.clone();
    one.parallel = Default::default();
    crate::memory::plan_checked(&one, &gcfg, 0)?;
    let peak = peak_flops(cfg.train.precision);

    let mut model = Gpt::new(gcfg, real_vocab.min(vp), cfg.train.seed);
    model.recompute = cfg.model.recompute;
    model.recompute_every = cfg.model.recompute_every;
    let mut opt = Optimizer::new(&model.layout);
    if cfg.optim.name == crate::config::OptimName::Lion {
        opt.keep_only_first_moment();
    }
    model.precision = cfg.train.precision;
    if model.precision == model::gpt::Precision::Fp8 {
        model.fp8 = Some(std::cell::RefCell::new(model::gpt::Fp8State::new(model.cfg.n_layer, cfg.train.fp8_amax_history)));
    }
    let mut dp = single_rank(&mut model);
    if let Some(fmt) = model::gpt::storage(model.precision) {
        opt.mixed(&mut dp, fmt);
    }
    let mut chunks = vec![Chunk { model, dp, opt, replicated: Vec::new(), seq_partial: Vec::new(), pool: Vec::new() }];
    let mut scaler = (cfg.train.precision == model::gpt::Precision::Fp16).then_some(crate::step::LossScaler { scale: cfg.train.loss_scale, good: 0, window: cfg.train.loss_scale_window });
    let mut pipe = Pipeline::single(cfg.train.grad_accum, None);
    pipe.scaler = scaler.as_mut();
    let mut rng = Rng::new(cfg.train.seed);
    let mut fill = move |_: usize, b: &mut crate::step::RowBuf| {
        for (xi, yi) in b.x.iter_mut().zip(b.y.iter_mut()) {
            *xi = rng.below(real_vocab as u64) as u32;
            *yi = rng.below(real_vocab as u64) as i32;
        }
    };
    let mut on_device = None;
    let times = if args.device == crate::device::DeviceArg::Cpu {
        time_steps(args, |s| {
            train_step(&mut chunks, &mut pipe, &cfg, s as u64, &mut fill, |_, _| None);
            Ok(())
        })?
    } else {
        let (times, dev) = device_steps(args, &cfg, &mut chunks[0], &mut fill)?;
        on_device = Some(dev);
        times
    };
    let peak = on_device.as_ref().map_or(peak, |d: &DeviceFigures| d.peak);
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let tokens = (cfg.train.batch_size * t) as f64;
    let model = &chunks[0].model;
    let flops = model_flops_per_token(model, t) * tokens;
    let (mfu, peak) = honest_utilisation(flops / median, peak, &mut false, || remeasured_peak_flops(cfg.train.precision));
    let mut out = json!({
        "preset": name,
        "threads": rayon::current_num_threads(),
        "steps": args.steps,
        "tokens_per_step": tokens,
        "step_ms": {"min": sorted[0] * 1e3, "median": median * 1e3, "max": sorted[sorted.len() - 1] * 1e3},
        "tokens_per_sec": tokens / median,
        "model_flops_per_step": flops,
        "achieved_gflops": flops / median / 1e9,
        "peak_gflops": peak / 1e9,
        "peak_arith": format!("{:?}", model::gpt::arith(cfg.train.precision)).to_lowercase(),
        "mfu": mfu,
        "peak_rss_bytes": crate::util::peak_rss().unwrap_or(0),
        "activation_bytes": model.activation_bytes(),
        "parameters": model.num_params(),
        "config": {"model": serde_json::to_value(&cfg.model).unwrap(), "train": {"batch_size": cfg.train.batch_size, "grad_accum": cfg.train.grad_accum}, "vocab_size": vp},
    });
    if let Some(d) = on_device {
        out["device"] = json!(args.device.to_string());
        out["adapter"] = json!(d.adapter);
        out["host_device_bytes_per_step"] = json!(d.bytes_per_step);
        out["batch_bytes_per_step"] = json!(2 * 4 * cfg.train.batch_size * t);
    }
    if args.breakdown {
        let steps = args.steps as f64;
        let rows: Vec<serde_json::Value> = tensor::profile::take()
            .into_iter()
            .map(|(n, s, c)| json!({"op": n, "ms_per_step": s / steps * 1e3, "share": s / steps / median, "calls_per_step": c as f64 / steps}))
            .collect();
        out["breakdown"] = serde_json::Value::Array(rows);
    }
    Ok(out)
}
