//! Small utilities every part of kiln uses, with no dependency on any other kiln module: atomic
//! file writes, one-shot debug faults, sizes, the thread pool.

use crate::error::{io_err, Result};
use std::fs;
use std::io::Write;
use std::path::Path;

/// A debug fault armed once per run: true the first time it is asked for `marker` (the file is
/// created then), false ever after, in this process or a restarted one.
pub fn fire_once(marker: &Path) -> bool {
    fs::OpenOptions::new().write(true).create_new(true).open(marker).is_ok()
}

/// Writes `bytes` to `path` through a temporary file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = fs::File::create(&tmp).map_err(|e| io_err(&tmp, e))?;
        f.write_all(bytes).map_err(|e| io_err(&tmp, e))?;
        f.sync_all().map_err(|e| io_err(&tmp, e))?;
    }
    fs::rename(&tmp, path).map_err(|e| io_err(path, e))
}

/// Parses a size: bytes (`1500000`), or a number with a unit (`1500MB`, `2GiB`, `1.5 GB`; k/K,
/// M, G, T in powers of 1000, KiB/MiB/GiB/TiB in powers of 1024). `0` means no limit.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let split = s.find(|ch: char| !(ch.is_ascii_digit() || ch == '.')).unwrap_or(s.len());
    let (num, unit) = (s[..split].trim(), s[split..].trim());
    let x: f64 = num.parse().map_err(|_| format!("`{s}` is not a size (expected e.g. 2GiB, 1500MB or a number of bytes)"))?;
    let scale = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return Err(format!("`{s}`: unknown unit `{unit}` (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)")),
    };
    Ok((x * scale).round() as u64)
}

/// Sizes the one rayon pool: `n` threads, or with 0 `RAYON_NUM_THREADS` / all cores. Only the
/// first call in a process has an effect.
pub fn init_threads(n: usize) {
    let mut b = rayon::ThreadPoolBuilder::new().thread_name(|i| format!("rayon{i}"));
    if n > 0 {
        b = b.num_threads(n);
    }
    let _ = b.build_global();
}

/// This process's peak resident set in bytes: Linux's `VmHWM` (`/proc/self/status`), counted from the
/// process's start or from the last write of `5` to `/proc/self/clear_refs` (the trainer's reset); `None` where
/// `/proc` does not say. The one reading of it, for `kiln bench` and the trainer's `mem_rss_peak_bytes`.
pub fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = s.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// Restarts the peak-resident-set count (Linux `clear_refs` 5), so the training loop's peak is
/// not the start-up's (the matmul peak probe's large products).
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Hands the memory the start-up freed back to the system. glibc's allocator keeps what is
/// freed inside its heap (the base's per-tensor scratch, the matmul peak probe's products)
/// resident until asked: about 100 MiB that no plan row would own once training runs.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of the allocator's own heap to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}
