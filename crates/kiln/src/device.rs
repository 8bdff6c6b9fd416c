//! `--device cpu|vulkan[:N]`: which processor a command runs on, and what `kiln doctor` says
//! about the GPUs it finds. The kernels live in the `device` crate (feature `vulkan`, on by
//! default); a build without it still parses the flag and refuses a device plainly.

use crate::error::Result;
use std::str::FromStr;

/// Where a command's kernels run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceArg {
    #[default]
    Cpu,
    /// Adapter N of `kiln doctor`'s list (discrete GPUs first).
    Vulkan(usize),
}

impl FromStr for DeviceArg {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<DeviceArg, String> {
        let bad = || format!("expected cpu, vulkan or vulkan:N, got `{s}`");
        match s {
            "cpu" => Ok(DeviceArg::Cpu),
            "vulkan" => Ok(DeviceArg::Vulkan(0)),
            _ => {
                let n = s.strip_prefix("vulkan:").ok_or_else(bad)?;
                n.parse().map(DeviceArg::Vulkan).map_err(|_| bad())
            }
        }
    }
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceArg::Cpu => f.write_str("cpu"),
            DeviceArg::Vulkan(n) => write!(f, "vulkan:{n}"),
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
    }
}

/// What a build without the `vulkan` feature answers for a device.
#[cfg(not(feature = "vulkan"))]
pub fn open(d: DeviceArg) -> Result<Option<std::convert::Infallible>> {
    match d {
        DeviceArg::Cpu => Ok(None),
        DeviceArg::Vulkan(_) => crate::error::user(format!("--device {d}: this kiln was built without the device backend (rebuild with the default features, or `--features vulkan`), or pass --device cpu")),
    }
}

/// `kiln doctor`'s lines about GPUs.
pub fn doctor_lines() -> Vec<String> {
    #[cfg(feature = "vulkan")]
    {
        let all = device::adapters();
        if all.is_empty() {
            return vec![format!("gpus:     none found; {}", device::INSTALL_HINT)];
        }
        all.iter().enumerate().map(|(i, a)| format!("{}{}", if i == 0 { "gpus:     " } else { "          " }, a.describe())).collect()
    }
    #[cfg(not(feature = "vulkan"))]
    {
        vec!["gpus:     not built (rebuild with the default features, or `--features vulkan`)".to_string()]
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceArg;

    #[test]
    fn device_flags_parse_and_bad_ones_say_what_is_expected() {
        assert_eq!("cpu".parse(), Ok(DeviceArg::Cpu));
        assert_eq!("vulkan".parse(), Ok(DeviceArg::Vulkan(0)));
        assert_eq!("vulkan:3".parse(), Ok(DeviceArg::Vulkan(3)));
        for bad in ["gpu", "vulkan:", "vulkan:x", "cuda", "vulkan:-1"] {
            let e = bad.parse::<DeviceArg>().unwrap_err();
            assert!(e.contains("expected cpu, vulkan or vulkan:N") && e.contains(bad), "{e}");
        }
        assert_eq!(DeviceArg::Vulkan(2).to_string(), "vulkan:2");
    }
}
