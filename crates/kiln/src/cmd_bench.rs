//! `kiln bench` (training steps on synthetic tokens, or the matmul peak) and `kiln pp-schedule`
//! (a pipeline schedule's timeline and bubble).

use crate::error::{user, KilnError, Result};
use crate::util::init_threads;
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct BenchCli {
    #[arg(long)]
    pub preset: Option<String>,
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Timed steps (after the warm-up).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Threads (default: RAYON_NUM_THREADS or all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print the JSON on one line (default: pretty-printed).
    #[arg(long)]
    pub json: bool,
    /// Measure the fp32 and bf16 matmul peaks instead.
    #[arg(long)]
    pub peak: bool,
    /// Add per-kernel time per step.
    #[arg(long)]
    pub breakdown: bool,
    /// Time each kernel (forward and backward) on --device beside the CPU, checking the two
    /// agree: GFLOP/s or GB/s for both.
    #[arg(long)]
    pub kernels: bool,
    /// Where the kernels (or the timed training steps) run: cpu (default), vulkan[:N] or
    /// cuda[:N].
    #[arg(long, default_value = "cpu", value_name = "cpu|vulkan[:N]|cuda[:N]")]
    pub device: crate::device::DeviceArg,
}

#[derive(Args)]
pub struct PpScheduleCli {
    /// Pipeline stages (ranks).
    #[arg(long)]
    pub pp: usize,
    #[arg(long)]
    pub micro_batches: usize,
    /// gpipe, 1f1b or interleaved.
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
    /// Model chunks per rank (interleaved).
    #[arg(long, default_value_t = 1)]
    pub r#virtual: usize,
    /// Backward time over forward time.
    #[arg(long, default_value_t = 2.0)]
    pub backward_ratio: f64,
    /// Print JSON (per-rank idle/busy, peak in flight, the formula) instead of the timeline.
    #[arg(long)]
    pub json: bool,
}

/// Runs `kiln bench`.
pub fn bench(b: BenchCli) -> Result<()> {
            init_threads(b.threads.unwrap_or(0));
            let v = if b.kernels {
                kernels(b.device, b.steps.max(1))?
            } else if b.peak {
                if b.device != crate::device::DeviceArg::Cpu {
                    return user(format!("kiln bench --peak measures the CPU's matmul peak; a device's is the `peak_gflops` of `kiln bench --device {}`", b.device));
                }
                crate::bench::peak()
            } else {
                crate::bench::bench(&crate::bench::BenchArgs { preset: b.preset, config: b.config, set: b.set, steps: b.steps, warmup: b.warmup, breakdown: b.breakdown, device: b.device })?
            };
            println!("{}", if b.json { v.to_string() } else { serde_json::to_string_pretty(&v).unwrap() });
            Ok(())
        }

/// `kiln bench --kernels`: the device kernels beside their CPU twins.
#[cfg(feature = "vulkan")]
fn kernels(d: crate::device::DeviceArg, reps: usize) -> Result<serde_json::Value> {
    crate::bench_kernels::run(d, reps)
}

#[cfg(not(feature = "vulkan"))]
fn kernels(_: crate::device::DeviceArg, _: usize) -> Result<serde_json::Value> {
    user("bench --kernels: this kiln was built without the device backend (rebuild with the default features, or `--features vulkan`)")
}

/// Runs `kiln pp-schedule`.
pub fn pp_schedule(a: PpScheduleCli) -> Result<()> {
            let kind = <parallel::pp::Kind as plan::policy::Names>::parse(&a.schedule).map_err(|e| KilnError::User(format!("--schedule {e}")))?;
            let sch = parallel::pp::Schedule::new(kind, a.pp, a.micro_batches, a.r#virtual).map_err(KilnError::User)?;
            #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN ratio must be refused too
            if !(a.backward_ratio > 0.0) {
                return user(format!("--backward-ratio must be positive, got {}", a.backward_ratio));
            }
            let tb = a.backward_ratio;
            // The interleaved chunks are 1/v of a stage: their passes take 1/v as long.
            let (tf, tb) = (1.0 / a.r#virtual as f64, tb / a.r#virtual as f64);
            if a.json {
                let v = serde_json::json!({
                    "schedule": a.schedule, "pp": a.pp, "micro_batches": a.micro_batches, "virtual": a.r#virtual,
                    "bubble": sch.bubble(tf, tb), "formula": sch.ideal_bubble(),
                    "peak_in_flight": (0..a.pp).map(|s| sch.peak_in_flight(s)).collect::<Vec<_>>(),
                });
                println!("{v}");
            } else {
                print!("{}", sch.render(tf, tb));
            }
            Ok(())
        }
