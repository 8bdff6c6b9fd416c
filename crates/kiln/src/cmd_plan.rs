//! `kiln plan estimate|search|validate`: flag parsing and printing only. All logic lives in the `plan` crate
//! (`plan::cli` declares the model, cluster and layout flags, flattened here, and returns the text to print).

use std::io::Write;

use clap::{Args, Subcommand};
use plan::cli::{ClusterArgs, LayoutArgs, ModelArgs};

#[derive(Subcommand, Debug)]
pub enum PlanCmd {
    /// Predict step time, TFLOP/s, MFU and memory of one layout (omitted flags: best feasible value).
    Estimate(EstimateArgs),
    /// Enumerate layouts, drop those that do not fit, rank the rest by step time.
    Search(SearchArgs),
    /// Predicted vs published throughput for a table of runs (CSV or JSON).
    Validate(ValidateArgs),
    /// Measure this machine (matmul rate vs shape, memory bandwidth, kiln's memory-bound kernels) and write the
    /// cpu-local hardware file that `kiln plan estimate --gpu FILE` reads.
    Calibrate(CalibrateArgs),
}

#[derive(Args, Debug, Clone)]
pub struct CalibrateArgs {
    /// Where to write the cpu-local JSON.
    #[arg(long)]
    pub out: String,
    /// Least timed repetitions of each measurement (one untimed warm-up first; the fastest is kept).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Least seconds each measurement repeats for (more chances of a run the other processes leave alone).
    #[arg(long, default_value_t = 0.2)]
    pub min_time: f64,
    /// Use this memory bandwidth (bytes/s) instead of measuring a STREAM triad.
    #[arg(long)]
    pub mem_bw: Option<f64>,
    /// Name of the accelerator entry.
    #[arg(long, default_value = "cpu-local")]
    pub name: String,
    /// cpu: time on CPU seconds ÷ threads (robust to other processes on a shared machine); wall: wall seconds.
    #[arg(long, default_value = "cpu")]
    pub clock: String,
}

#[derive(Args, Debug, Clone)]
pub struct EstimateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// Print {"step_time_s","model_tflops_per_gpu","mfu","memory_bytes_per_gpu","fits","breakdown","chosen"}.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct SearchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// How many plans to print.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct ValidateArgs {
    /// CSV or JSON table of published runs; `table1` = the built-in Narayanan et al. 2021 Table 1.
    #[arg(long)]
    pub table: String,
    #[arg(long)]
    pub hardware_file: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// Run a `kiln plan` subcommand; an error is one line naming the flag, file or value at fault.
pub fn run(cmd: PlanCmd) -> Result<(), String> {
    let out = match &cmd {
        PlanCmd::Estimate(a) => plan::cli::estimate_cmd(&a.model, &a.cluster, &a.layout, a.json),
        PlanCmd::Search(a) => plan::cli::search_cmd(&a.model, &a.cluster, &a.layout, a.top, a.json),
        PlanCmd::Validate(a) => plan::cli::validate_cmd(&a.table, a.hardware_file.as_deref(), a.json),
        PlanCmd::Calibrate(a) => calibrate::run(a),
    }
    .map_err(|e| format!("kiln plan: {e}"))?;
    // A closed pipe (`kiln plan search | head`) is not an error worth a panic.
    let mut stdout = std::io::stdout().lock();
    let nl = if out.ends_with('\n') { "" } else { "\n" };
    let _ = write!(stdout, "{out}{nl}");
    Ok(())
}

/// `kiln plan calibrate`: measurements only (through the same tensor kernels training calls); the fit and every
/// use of the numbers live in `plan` (`plan::hardware::CpuLocal`, `GemmCurve::fit`).
mod calibrate {
    use super::CalibrateArgs;
    use plan::hardware::{CpuLocal, GemmCurve, MeasuredGemm};
    use plan::PlanError;
    use rayon::prelude::*;
    use std::fmt::Write as _;
    use std::time::Instant;
    use tensor::matmul::{gemm, Threads, View};

    /// Seconds of CPU time all threads of this process have run (`/proc/self/task/*/schedstat`, nanoseconds).
    fn cpu_seconds() -> f64 {
        let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return f64::NAN };
        dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().next()?.parse::<f64>().ok())
            .sum::<f64>()
            * 1e-9
    }

    /// The clock measurements are read on: wall seconds, or CPU seconds of all threads ÷ threads (what the wall
    /// time would be on an otherwise idle machine, for work that keeps every thread busy).
    #[derive(Clone, Copy, PartialEq)]
    pub enum Clock {
        Wall,
        Cpu,
    }

    fn now(clock: Clock) -> f64 {
        match clock {
            Clock::Wall => {
                static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
                T0.get_or_init(Instant::now).elapsed().as_secs_f64()
            }
            Clock::Cpu => cpu_seconds() / rayon::current_num_threads() as f64,
        }
    }

    /// Fastest of the timed runs after one warm-up, over at least `reps` runs and at least `min_s` wall seconds.
    /// On a shared machine other processes stretch a wall-clock run by anything from 0 to 3×, changing from
    /// second to second; `--clock cpu` (default) times on CPU seconds instead, which they barely touch.
    fn best_time(reps: usize, min_s: f64, mut f: impl FnMut()) -> f64 {
        let clock = CLOCK.with(|c| c.get());
        f();
        let t0 = Instant::now();
        let (mut n, mut best) = (0usize, f64::INFINITY);
        while n < reps.max(1) || t0.elapsed().as_secs_f64() < min_s {
            let t1 = now(clock);
            f();
            best = best.min(now(clock) - t1);
            n += 1;
        }
        best
    }

    thread_local! {
        static CLOCK: std::cell::Cell<Clock> = const { std::cell::Cell::new(Clock::Cpu) };
    }

    /// One product in one of kiln's Linear layouts: "nt" `A[m,k]·B[n,k]ᵀ` (forward), "nn" `A[m,k]·B[k,n]` (data
    /// gradient), "tn" `A[k,m]ᵀ·B[k,n]` (weight gradient).
    fn product(m: usize, n: usize, k: usize, layout: &str, reps: usize, min_s: f64) -> MeasuredGemm {
        let a: Vec<f32> = (0..m * k).map(|i| ((i % 7) as f32 - 3.0) * 0.01).collect();
        let b: Vec<f32> = (0..n * k).map(|i| ((i % 5) as f32 - 2.0) * 0.01).collect();
        let mut c = vec![0.0f32; m * n];
        let t = best_time(reps, min_s, || {
            let (lhs, rhs) = match layout {
                "nt" => (View::rows(&a, m, k), View::rows(&b, n, k).t()),
                "nn" => (View::rows(&a, m, k), View::rows(&b, k, n)),
                _ => (View::rows(&a, k, m).t(), View::rows(&b, k, n)),
            };
            gemm(&mut c, true, lhs, rhs, 1.0, Threads::All);
        });
        std::hint::black_box(&c);
        MeasuredGemm {
            m: m as u64,
            n: n as u64,
            k: k as u64,
            gflops: 2.0 * (m * n * k) as f64 / t / 1e9,
            layout: Some(layout.into()),
        }
    }

    /// The attention core's per-head products as `tensor::attention` runs them: `batch` independent m×n×k
    /// products, one single-threaded gemm per rayon task. "nt" is `Q·Kᵀ` ([T,T,HS]), "nn" is `P·V` ([T,HS,T]).
    fn batched(m: usize, n: usize, k: usize, layout: &str, batch: usize, reps: usize, min_s: f64) -> MeasuredGemm {
        let a: Vec<Vec<f32>> = (0..batch).map(|j| (0..m * k).map(|i| (((i + j) % 7) as f32 - 3.0) * 0.01).collect()).collect();
        let b: Vec<Vec<f32>> = (0..batch).map(|j| (0..n * k).map(|i| (((i + j) % 5) as f32 - 2.0) * 0.01).collect()).collect();
        let mut c: Vec<Vec<f32>> = (0..batch).map(|_| vec![0.0f32; m * n]).collect();
        let t = best_time(reps, min_s, || {
            c.par_iter_mut().enumerate().for_each(|(i, ci)| {
                let rhs = if layout == "nt" { View::rows(&b[i], n, k).t() } else { View::rows(&b[i], k, n) };
                gemm(ci, false, View::rows(&a[i], m, k), rhs, 1.0, Threads::One);
            });
        });
        std::hint::black_box(&c);
        MeasuredGemm {
            m: m as u64,
            n: n as u64,
            k: k as u64,
            gflops: 2.0 * (m * n * k * batch) as f64 / t / 1e9,
            layout: Some(format!("{layout} x{batch} single-threaded")),
        }
    }

    /// STREAM triad `a = b + s·c` on 3 × 64 MiB (twice a 32 MiB last-level cache), all threads; 12 bytes per element.
    fn triad(reps: usize, min_s: f64) -> f64 {
        let n = 16 << 20;
        let mut a = vec![0.0f32; n];
        let b = vec![1.0f32; n];
        let c = vec![2.0f32; n];
        let t = best_time(reps, min_s, || {
            a.par_chunks_mut(1 << 16)
                .zip(b.par_chunks(1 << 16).zip(c.par_chunks(1 << 16)))
                .for_each(|(a, (b, c))| {
                    for ((a, b), c) in a.iter_mut().zip(b).zip(c) {
                        *a = b + 3.0 * c;
                    }
                });
        });
        std::hint::black_box(&a);
        12.0 * n as f64 / t
    }

    /// kiln's per-layer memory-bound kernels on an [n, c] residual stream and its [n, 4c] MLP activation: LayerNorm
    /// forward + backward, GELU forward + backward, a residual add. Returns (seconds, bytes as the cost model counts
    /// them: read + write per pass, 4-byte elements; LN 2 + 3, GELU (2 + 3)·4, residual 3 per residual element),
    /// 5 kernel calls.
    fn elementwise(n: usize, c: usize, reps: usize, min_s: f64) -> (f64, f64) {
        let x: Vec<f32> = (0..n * c).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let h: Vec<f32> = (0..4 * n * c).map(|i| ((i % 11) as f32 - 5.0) * 0.1).collect();
        let w = vec![1.0f32; c];
        let bias = vec![0.0f32; c];
        let (mut out, mut mean, mut rstd) = (vec![0.0f32; n * c], vec![0.0f32; n], vec![0.0f32; n]);
        let (mut dx, mut dw, mut db) = (vec![0.0f32; n * c], vec![0.0f32; c], vec![0.0f32; c]);
        let (mut g, mut dg) = (vec![0.0f32; 4 * n * c], vec![0.0f32; 4 * n * c]);
        let mut r = vec![0.0f32; n * c];
        let t = best_time(reps, min_s, || {
            tensor::ops::layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, Some(&bias), c);
            tensor::ops::layernorm_backward((&mut dx, &mut dw, Some(&mut db)), &x, &x, &w, (&mean, &rstd), c);
            tensor::ops::gelu_forward(&mut g, &h);
            tensor::ops::gelu_backward(&mut dg, &g, &h);
            tensor::ops::residual_forward(&mut r, &x, &out);
        });
        std::hint::black_box((&dx, &dg, &r));
        let e = 4.0 * (n * c) as f64;
        (t, e * (2.0 + 3.0 + 4.0 * (2.0 + 3.0) + 3.0))
    }

    /// Linear layers (tokens T, in C, out OC) whose three products sample the curve: kiln's shakespeare-char
    /// (C = 128) and GPT-2 small (C = 768) widths at T = 256 and 1024, plus two squares and the chunked LM head
    /// (kiln's fused head runs 2^23 / V rows at a time: 166 rows at V = 50304).
    const LINEARS: &[(usize, usize, usize)] = &[
        (256, 128, 384),
        (1024, 128, 384),
        (256, 128, 512),
        (1024, 512, 128),
        (256, 768, 2304),
        (1024, 768, 2304),
        (1024, 768, 3072),
        (256, 3072, 768),
        (1024, 3072, 768),
        (166, 768, 50304),
    ];

    pub fn run(a: &CalibrateArgs) -> Result<String, PlanError> {
        let t0 = Instant::now();
        let (reps, min_s) = (a.reps.max(1), a.min_time.max(0.0));
        let clock = match a.clock.as_str() {
            "cpu" => Clock::Cpu,
            "wall" => Clock::Wall,
            o => return Err(PlanError(format!("--clock {o}: expected cpu|wall"))),
        };
        CLOCK.with(|c| c.set(clock));
        let mut products = Vec::new();
        for &(t, c, oc) in LINEARS {
            products.push(product(t, oc, c, "nt", reps, min_s)); // forward
            products.push(product(t, c, oc, "nn", reps, min_s)); // data gradient
            products.push(product(oc, c, t, "tn", reps, min_s)); // weight gradient
        }
        for n in [512, 1024] {
            products.push(product(n, n, n, "nt", reps, min_s));
        }
        let peak = products.iter().map(|p| p.gflops).fold(0.0, f64::max) * 1e9;
        let curve = GemmCurve::fit(&products, peak)?;
        // Attention: B·NH = 48 heads in both of kiln's CPU configs (12 × 4 and 4 × 12), T and HS around theirs.
        let mut attention_products = Vec::new();
        for (t, hs) in [(64, 32), (128, 32), (64, 64), (128, 64), (256, 64), (512, 64)] {
            attention_products.push(batched(t, t, hs, "nt", 48, reps, min_s)); // S = Q·Kᵀ (and dP = dO·Vᵀ)
            attention_products.push(batched(t, hs, t, "nn", 48, reps, min_s)); // O = P·V (and dQ, dK, dV)
        }
        let attention_curve = GemmCurve::fit(&attention_products, peak)?;
        let mem_bw = match a.mem_bw {
            Some(b) if b > 0.0 => b,
            Some(b) => return Err(PlanError(format!("--mem-bw {b}: must be positive bytes/s"))),
            None => triad(reps, min_s),
        };
        // Two sizes (shakespeare-char's 768 × 128 and GPT-2's 1024 × 768) give the per-call overhead and the
        // rate: t = 5·overhead + bytes/bw.
        let (t1, b1) = elementwise(768, 128, reps, 2.0 * min_s);
        let (t2, b2) = elementwise(1024, 768, reps, 2.0 * min_s);
        let mut bw = (b2 - b1) / (t2 - t1);
        let mut ovh = (t1 - b1 / bw) / 5.0;
        if !(bw.is_finite() && bw > 0.0 && ovh >= 0.0) {
            bw = b2 / t2;
            ovh = 0.0;
        }
        let mem_bytes = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| s.lines().find(|l| l.starts_with("MemTotal:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok()))
            .map_or(8e9, |kb| kb * 1024.0);
        let cpu = CpuLocal {
            name: a.name.clone(),
            peak_flops_fp32: peak,
            mem_bytes,
            mem_bw,
            threads: Some(rayon::current_num_threads() as u64),
            products,
            gemm_curve: Some(curve),
            attention_products,
            attention_curve: Some(attention_curve),
            elementwise_bw: Some(bw),
            kernel_overhead: Some(ovh),
        };
        let text = serde_json::to_string_pretty(&cpu).map_err(|e| PlanError(e.to_string()))?;
        std::fs::write(&a.out, text + "\n").map_err(|e| PlanError(format!("--out {}: cannot write: {e}", a.out)))?;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "wrote {} ({} threads, {} clock, {:.1} s)",
            a.out,
            rayon::current_num_threads(),
            a.clock,
            t0.elapsed().as_secs_f64()
        );
        let _ = writeln!(o, "peak fp32    {:.1} GFLOP/s (best measured product)", peak / 1e9);
        let _ = writeln!(
            o,
            "gemm curve   plateau {:.3}, m_half {:.0}, n_half {:.0}, k_half {:.0}",
            curve.plateau, curve.m_half, curve.n_half, curve.k_half
        );
        let _ = writeln!(
            o,
            "attention    plateau {:.3}, m_half {:.0}, n_half {:.0}, k_half {:.0} (per-head products, 48 tasks)",
            attention_curve.plateau, attention_curve.m_half, attention_curve.n_half, attention_curve.k_half
        );
        let _ = writeln!(o, "memory       triad {:.1} GB/s; kiln elementwise {:.1} GB/s + {:.1} us per call", mem_bw / 1e9, bw / 1e9, ovh * 1e6);
        let _ = writeln!(o, "{:>6} {:>6} {:>6} {:>3} {:>9} {:>9} {:>7}", "m", "n", "k", "lay", "measured", "curve", "error");
        let rows = cpu.products.iter().map(|p| (p, &curve)).chain(cpu.attention_products.iter().map(|p| (p, &attention_curve)));
        for (p, c) in rows {
            let fit = peak * c.efficiency(p.m as f64, p.n as f64, p.k as f64) / 1e9;
            let _ = writeln!(
                o,
                "{:>6} {:>6} {:>6} {:>3} {:>9.1} {:>9.1} {:>+6.1}%",
                p.m,
                p.n,
                p.k,
                p.layout.as_deref().map_or("", |l| &l[..2]),
                p.gflops,
                fit,
                (fit / p.gflops - 1.0) * 100.0
            );
        }
        Ok(o)
    }
}
