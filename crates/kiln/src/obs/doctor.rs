//! `kiln doctor`: what this machine and this build offer a training run, and whether the
//! default corpus is there.

use std::fmt::Write;
use std::path::PathBuf;

/// The SIMD features the kernels dispatch on, as `(name, detected)`.
pub fn simd_features() -> Vec<(&'static str, bool)> {
    #[cfg(target_arch = "x86_64")]
    {
        vec![
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("fma", std::arch::is_x86_feature_detected!("fma")),
            ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
        ]
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Vec::new()
    }
}

/// `(MemTotal, MemAvailable)` in bytes from /proc/meminfo.
pub fn meminfo() -> Option<(u64, Option<u64>)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| {
        text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok().map(|k| k * 1024))
    };
    Some((field("MemTotal")?, field("MemAvailable")))
}

fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines().find_map(|l| l.strip_prefix("model name").map(|r| r.trim_start_matches([' ', '\t', ':']).trim().to_string()))
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// The report and whether everything a default `kiln train` needs is present.
pub fn doctor() -> (String, bool) {
    doctor_with(data::default_corpus_files().map_err(|e| e.to_string()), Some(tensor::matmul::measure_peak_flops(1024, 5)))
}

/// [`doctor`] with the corpus lookup and the measured peak (None: not measured) given.
pub fn doctor_with(corpus: Result<Vec<PathBuf>, String>, peak_flops: Option<f64>) -> (String, bool) {
    let mut r = String::new();
    let mut ok = true;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let _ = writeln!(r, "kiln {} doctor", env!("CARGO_PKG_VERSION"));
    let _ = writeln!(r, "cpu:      {} ({} cores available, rayon pool {} threads)", cpu_model().unwrap_or_else(|| std::env::consts::ARCH.to_string()), cores, rayon::current_num_threads());
    let simd = simd_features();
    let simd_s = if simd.is_empty() {
        format!("none probed on {}", std::env::consts::ARCH)
    } else {
        simd.iter().map(|(n, d)| format!("{n} {}", if *d { "yes" } else { "no" })).collect::<Vec<_>>().join(", ")
    };
    let _ = writeln!(r, "simd:     {simd_s}");
    match meminfo() {
        Some((total, avail)) => {
            let _ = writeln!(r, "memory:   {} total{}", gib(total), avail.map(|a| format!(", {} available", gib(a))).unwrap_or_default());
        }
        None => {
            let _ = writeln!(r, "memory:   unknown (no /proc/meminfo)");
        }
    }
    match peak_flops {
        Some(p) => {
            let _ = writeln!(r, "matmul:   {:.1} GFLOP/s fp32 peak (1024³ gemm, best of 5; the MFU denominator)", p / 1e9);
            let b = tensor::bf16::measure_peak_flops(1024, 5);
            let _ = writeln!(r, "bf16:     {}; {:.1} GFLOP/s peak (1024³, best of 5; bf16 training's MFU denominator)", tensor::bf16::choice().describe(), b / 1e9);
            let d = tensor::bf16::dot_over_fma();
            if d > 0.0 {
                let _ = writeln!(r, "          vdpbf16ps measured {d:.2}× the fp32 FMA's arithmetic rate on one core");
            }
        }
        None => {
            let _ = writeln!(r, "matmul:   not measured");
            let _ = writeln!(r, "bf16:     {}", tensor::bf16::choice().describe());
        }
    }
    let _ = writeln!(r, "backends: CPU yes; in-process ranks yes (kiln train --dp N); MPI {}; Vulkan {}; CUDA not built", mpi_status(), if cfg!(feature = "vulkan") { "built" } else { "not built" });
    for line in crate::device::doctor_lines() {
        let _ = writeln!(r, "{line}");
    }
    match corpus {
        Ok(files) if !files.is_empty() => {
            let bytes: u64 = files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum();
            let _ = writeln!(r, "corpus:   default corpus present: {} files, {:.1} MB of HTML", files.len(), bytes as f64 / 1e6);
            for f in &files {
                let _ = writeln!(r, "          {}", f.display());
            }
        }
        Ok(_) => {
            ok = false;
            let _ = writeln!(r, "corpus:   MISSING: the default corpus lookup found no files; `kiln train` needs --data PATH");
        }
        Err(e) => {
            ok = false;
            let _ = writeln!(r, "corpus:   MISSING: {e}");
        }
    }
    let _ = writeln!(r, "status:   {}", if ok { "ok" } else { "problems found (see MISSING above)" });
    (r, ok)
}

/// Whether this build has the MPI backend, and whether `mpirun` is on the PATH to start it.
fn mpi_status() -> String {
    let mpirun = std::env::var_os("PATH")
        .and_then(|p| std::env::split_paths(&p).map(|d| d.join("mpirun")).find(|f| f.is_file()));
    let found = match &mpirun {
        Some(p) => format!("mpirun at {}", p.display()),
        None => "no mpirun on PATH".to_string(),
    };
    if cfg!(feature = "mpi") {
        format!("built ({found})")
    } else {
        format!("not built (rebuild with --features mpi; {found})")
    }
}
