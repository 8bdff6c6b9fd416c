//! `--device cpu|vulkan[:N]|cuda[:N]`: which processor a command runs on, and what `kiln doctor`
//! says about the GPUs it finds. The kernels live in the `device` crate (feature `vulkan`, on by
//! default; `cuda` adds NVIDIA's backend); a build without one still parses the flag and
//! refuses that device plainly.

use crate::error::Result;
use std::str::FromStr;

/// Where a command's kernels run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceArg {
    #[default]
    Cpu,
    /// Adapter N of `kiln doctor`'s list (discrete GPUs first).
    Vulkan(usize),
    /// CUDA device N (the driver's order).
    Cuda(usize),
}

impl FromStr for DeviceArg {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<DeviceArg, String> {
        let bad = || format!("expected cpu, vulkan, vulkan:N, cuda or cuda:N, got `{s}`");
        match s {
            "cpu" => Ok(DeviceArg::Cpu),
            "vulkan" => Ok(DeviceArg::Vulkan(0)),
            "cuda" => Ok(DeviceArg::Cuda(0)),
            _ => match s.split_once(':') {
                Some(("vulkan", n)) => n.parse().map(DeviceArg::Vulkan).map_err(|_| bad()),
                Some(("cuda", n)) => n.parse().map(DeviceArg::Cuda).map_err(|_| bad()),
                _ => Err(bad()),
            },
        }
    }
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceArg::Cpu => f.write_str("cpu"),
            DeviceArg::Vulkan(n) => write!(f, "vulkan:{n}"),
            DeviceArg::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The device named, opened; `None` for the CPU. A device that is not there is a user error
/// naming the adapters found and what to install.
#[cfg(feature = "vulkan")]
pub fn open(d: DeviceArg) -> Result<Option<device::Gpu>> {
    match d {
        DeviceArg::Cpu => Ok(None),
        DeviceArg::Vulkan(n) => device::Gpu::open(n).map(Some).map_err(|e| crate::error::KilnError::User(e.0)),
        #[cfg(feature = "cuda")]
        DeviceArg::Cuda(n) => device::Gpu::open_cuda(n).map(Some).map_err(|e| crate::error::KilnError::User(e.0)),
        #[cfg(not(feature = "cuda"))]
        DeviceArg::Cuda(_) => crate::error::user(format!("--device {d}: this kiln was built without the CUDA backend (rebuild with `--features cuda`), or pass --device vulkan or cpu")),
    }
}

/// What a build without the `vulkan` feature answers for a device.
#[cfg(not(feature = "vulkan"))]
pub fn open(d: DeviceArg) -> Result<Option<std::convert::Infallible>> {
    match d {
        DeviceArg::Cpu => Ok(None),
        DeviceArg::Vulkan(_) | DeviceArg::Cuda(_) => crate::error::user(format!("--device {d}: this kiln was built without the device backend (rebuild with the default features, or `--features vulkan`), or pass --device cpu")),
    }
}

/// Rank `rank`'s device when `d` names a job's: device `N + rank` of its kind, modulo how many
/// there are (ranks share a device when there are fewer than ranks: each opens its own logical
/// device on it).
#[cfg(feature = "vulkan")]
pub fn for_rank(d: DeviceArg, rank: usize) -> DeviceArg {
    let count = |n: usize| n.max(1);
    match d {
        DeviceArg::Cpu => DeviceArg::Cpu,
        DeviceArg::Vulkan(n) if rank > 0 => DeviceArg::Vulkan((n + rank) % count(device::adapters().len())),
        #[cfg(feature = "cuda")]
        DeviceArg::Cuda(n) if rank > 0 => DeviceArg::Cuda((n + rank) % count(device::cuda::devices().map_or(0, |v| v.len()))),
        other => other,
    }
}

/// `kiln doctor`'s lines about GPUs.
pub fn doctor_lines() -> Vec<String> {
    #[cfg(feature = "vulkan")]
    {
        let all = device::adapters();
        let mut lines: Vec<String> = if all.is_empty() {
            vec![format!("gpus:     none found; {}", device::INSTALL_HINT)]
        } else {
            all.iter().enumerate().map(|(i, a)| format!("{}{}", if i == 0 { "gpus:     " } else { "          " }, a.describe())).collect()
        };
        lines.extend(cuda_lines());
        lines
    }
    #[cfg(not(feature = "vulkan"))]
    {
        vec!["gpus:     not built (rebuild with the default features, or `--features vulkan`)".to_string()]
    }
}

/// `kiln doctor`'s CUDA lines: each device, or why there is none.
#[cfg(feature = "cuda")]
fn cuda_lines() -> Vec<String> {
    let nvrtc = if device::cuda::nvrtc_present() { "NVRTC found".to_string() } else { format!("NVRTC missing: {}", device::cuda::NVRTC_HINT) };
    match device::cuda::devices() {
        Ok(all) if !all.is_empty() => all.iter().map(|a| format!("cuda:     {}; {nvrtc}", a.describe())).collect(),
        Ok(_) => vec![format!("cuda:     the driver reports no device; {nvrtc}")],
        Err(e) => vec![format!("cuda:     {}; {nvrtc}", e.0)],
    }
}

#[cfg(all(feature = "vulkan", not(feature = "cuda")))]
fn cuda_lines() -> Vec<String> {
    vec!["cuda:     not built (rebuild with `--features cuda`)".to_string()]
}

#[cfg(test)]
mod tests {
    use super::DeviceArg;

    #[test]
    fn device_flags_parse_and_bad_ones_say_what_is_expected() {
        assert_eq!("cpu".parse(), Ok(DeviceArg::Cpu));
        assert_eq!("vulkan".parse(), Ok(DeviceArg::Vulkan(0)));
        assert_eq!("vulkan:3".parse(), Ok(DeviceArg::Vulkan(3)));
        assert_eq!("cuda".parse(), Ok(DeviceArg::Cuda(0)));
        assert_eq!("cuda:1".parse(), Ok(DeviceArg::Cuda(1)));
        for bad in ["gpu", "vulkan:", "vulkan:x", "cuda:", "vulkan:-1", "cuda:x", "rocm:0"] {
            let e = bad.parse::<DeviceArg>().unwrap_err();
            assert!(e.contains("expected cpu, vulkan, vulkan:N, cuda or cuda:N") && e.contains(bad), "{e}");
        }
        assert_eq!(DeviceArg::Vulkan(2).to_string(), "vulkan:2");
        assert_eq!(DeviceArg::Cuda(2).to_string(), "cuda:2");
    }
}
