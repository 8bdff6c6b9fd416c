//! The CUDA kernels compile: every kernel's CUDA C twin, for each buffer-type combination a
//! launch may give it, through NVRTC for `sm_80` and `sm_90`, with no GPU and no warning. NVRTC
//! comes from the `nvidia-cuda-nvrtc` pip wheel (`.ci/run` installs it); when it is not on the
//! library path, the test runs itself again with the wheel's directory on `LD_LIBRARY_PATH`.
use std::process::Command;

/// The pip wheel's library directory, found through python3.
fn wheel_lib_dir() -> String {
    let probe = "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))";
    let out = Command::new("python3").args(["-c", probe]).output().expect("python3 runs");
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(out.status.success() && std::path::Path::new(&dir).join("libnvrtc.so.13").exists(), "NVRTC not found: {}; `python3 -m pip install nvidia-cuda-nvrtc`", device::cuda::NVRTC_HINT);
    dir
}

#[test]
fn every_cuda_kernel_compiles_with_nvrtc_for_sm80_and_sm90() {
    if !device::cuda::nvrtc_present() {
        assert!(std::env::var_os("KILN_NVRTC_RERUN").is_none(), "NVRTC is still missing with the wheel's directory on LD_LIBRARY_PATH");
        let path = match std::env::var("LD_LIBRARY_PATH") {
            Ok(p) if !p.is_empty() => format!("{}:{p}", wheel_lib_dir()),
            _ => wheel_lib_dir(),
        };
        let me = std::env::current_exe().unwrap();
        let o = Command::new(me).args(["--exact", "cuda::every_cuda_kernel_compiles_with_nvrtc_for_sm80_and_sm90", "--nocapture"]).env("LD_LIBRARY_PATH", path).env("KILN_NVRTC_RERUN", "1").output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success() && text.contains("1 passed"), "{text}");
        return;
    }
    for arch in ["sm_80", "sm_90"] {
        let n = device::cuda::compile_all(arch).unwrap_or_else(|e| panic!("{e}"));
        assert!(n >= 90, "{arch}: {n} programs");
        eprintln!("{arch}: {n} programs compiled");
    }
}

/// NCCL from its pip wheel (`nvidia-nccl-cu13`, which `.ci/run` installs), with no GPU: the
/// library opens and gives its version and a group's unique id, and a group on a Vulkan device
/// is refused in one line. Without the library, each call says where to get it. (When it is
/// not on the library path, the test runs itself again with a `libnccl.so` link to the wheel's
/// library there.)
#[test]
fn nccl_opens_from_its_wheel_and_needs_a_cuda_device() {
    if !device::nccl::nccl_present() {
        let e = device::nccl::version().unwrap_err();
        assert!(e.0.contains("nvidia-nccl-cu13") && device::nccl::unique_id().is_err(), "{e:?}");
        assert!(std::env::var_os("KILN_NCCL_RERUN").is_none(), "NCCL is still missing with the wheel's directory on LD_LIBRARY_PATH");
        let probe = "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'nccl', 'lib', 'libnccl.so.2'))";
        let out = Command::new("python3").args(["-c", probe]).output().expect("python3 runs");
        let lib = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        assert!(lib.exists(), "NCCL not found: {}; `python3 -m pip install nvidia-nccl-cu13`", device::nccl::NCCL_HINT);
        // The wheel ships `libnccl.so.2`; the loader looks for `libnccl.so`.
        let dir = std::env::temp_dir().join(format!("kiln-nccl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let link = dir.join("libnccl.so");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&lib, &link).unwrap();
        let dir = dir.to_string_lossy().into_owned();
        let path = match std::env::var("LD_LIBRARY_PATH") {
            Ok(p) if !p.is_empty() => format!("{dir}:{p}"),
            _ => dir,
        };
        let me = std::env::current_exe().unwrap();
        let o = Command::new(me).args(["--exact", "cuda::nccl_opens_from_its_wheel_and_needs_a_cuda_device", "--nocapture"]).env("LD_LIBRARY_PATH", path).env("KILN_NCCL_RERUN", "1").output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success() && text.contains("1 passed"), "{text}");
        return;
    }
    let v = device::nccl::version().unwrap_or_else(|e| panic!("{}", e.0));
    assert!(v >= 21800, "NCCL {v}: 2.18 or later");
    let id = device::nccl::unique_id().unwrap_or_else(|e| panic!("{}", e.0));
    assert!(id.iter().any(|&b| b != 0), "an empty unique id");
    let gpu = device::Gpu::open(0).unwrap_or_else(|e| panic!("the test needs a Vulkan adapter: {e:?}"));
    let e = device::nccl::Nccl::new(&gpu, id, 0, 1).err().expect("NCCL on a Vulkan device");
    assert!(e.0.starts_with("NCCL runs on CUDA devices, not vulkan:0"), "{e:?}");
    eprintln!("NCCL {v}");
}
