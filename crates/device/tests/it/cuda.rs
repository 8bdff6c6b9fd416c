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
