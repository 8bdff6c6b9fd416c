//! `--device`: parsing, the refusals (a device that is not there; a model that does not run on
//! a device yet), `kiln doctor`'s GPU lines and `kiln bench --kernels` on the first adapter
//! (lavapipe in CI).
use crate::common::{corpus, kiln, scratch, stderr, stdout};

#[test]
fn device_flags_are_checked_and_refusals_are_one_line_with_exit_2() {
    let dir = scratch("device-flags");
    let data = corpus(&dir);
    let out = dir.join("run");
    let base = ["train", "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--max-steps", "1"];
    for (device, says) in [
        ("gpu", "expected cpu, vulkan or vulkan:N, got `gpu`"),
        ("vulkan:99", "--device vulkan:99: no such adapter; found vulkan:0 "),
        ("vulkan", "the model does not run on a device yet"),
    ] {
        let o = kiln(&[&base[..], &["--device", device]].concat());
        assert_eq!(o.status.code(), Some(2), "--device {device}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "--device {device}: {}", stderr(&o));
        assert!(!out.exists(), "--device {device} wrote a run directory");
    }
    for cmd in ["eval", "generate"] {
        let o = kiln(&[cmd, "--run", out.to_str().unwrap(), "--device", "vulkan"]);
        assert_eq!(o.status.code(), Some(2), "{cmd}: {}", stderr(&o));
        assert!(stderr(&o).contains(&format!("kiln {cmd} --device vulkan:0")), "{cmd}: {}", stderr(&o));
    }
    // No Vulkan driver at all: the line names what to install.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["bench", "--kernels", "--device", "vulkan"])
        .env("VK_DRIVER_FILES", dir.join("none.json"))
        .env("VK_ICD_FILENAMES", dir.join("none.json"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("no Vulkan adapter found") && stderr(&o).contains("mesa-vulkan-drivers"), "{}", stderr(&o));
}

#[test]
fn doctor_lists_gpus_and_the_kernel_bench_runs_on_the_device() {
    let o = kiln(&["doctor"]);
    assert!(stdout(&o).contains("gpus:     vulkan:0  "), "{}", stdout(&o));
    let o = kiln(&["bench", "--kernels", "--device", "vulkan", "--steps", "1", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let rows = v["kernels"].as_array().unwrap();
    assert!(rows.len() >= 5);
    for r in rows {
        assert!(r["device_rate"].as_f64().unwrap() > 0.0 && r["cpu_rate"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["max_err_over_max_ref"].as_f64().unwrap() <= 1e-2, "{r}");
    }
}
