//! `kiln bench --kernels [--device vulkan[:N]]`: each kernel timed on the CPU and on the device
//! at one shape, its rate (GFLOP/s for products, GB/s for the bandwidth-bound kernels) beside the
//! CPU's, and the two results compared (max |device − CPU| over max |CPU|). On lavapipe, a
//! software Vulkan driver, the rates say nothing about GPUs: there the bench is a correctness run.

use crate::device::DeviceArg;
use crate::error::{user, Result};
use serde_json::{json, Value};
use std::time::Instant;
use tensor::matmul::Arith;
use tensor::Rng;

/// The products' shape: `[BT, C] · [OC, C]ᵀ`, a GPT-2-small projection over 256 tokens.
pub const SHAPE: (usize, usize, usize) = (256, 768, 768);

/// Seconds per call of `f`, after one untimed call.
fn time<R>(reps: usize, mut f: impl FnMut() -> R) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    t.elapsed().as_secs_f64() / reps as f64
}

/// One kernel's row: its work (FLOPs or bytes), the CPU's time and output.
struct Row {
    kernel: &'static str,
    dtype: &'static str,
    /// "GFLOP/s" or "GB/s".
    unit: &'static str,
    work: f64,
    cpu_s: f64,
    cpu_out: Vec<f32>,
}

fn randn(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut v = vec![0.0; n];
    rng.fill_normal(&mut v, 1.0);
    v
}

/// The inputs every row shares.
struct Inputs {
    inp: Vec<f32>,
    w: Vec<f32>,
    bias: Vec<f32>,
    dout: Vec<f32>,
}

fn inputs() -> Inputs {
    let (bt, c, oc) = SHAPE;
    let mut rng = Rng::new(1);
    Inputs { inp: randn(&mut rng, bt * c), w: randn(&mut rng, oc * c), bias: randn(&mut rng, oc), dout: randn(&mut rng, bt * oc) }
}

/// The CPU's rows, in the order the device rows follow.
fn cpu_rows(x: &Inputs, reps: usize) -> Vec<Row> {
    let (bt, c, oc) = SHAPE;
    let flops = 2.0 * (bt * c * oc) as f64;
    let mut rows = Vec::new();
    for (arith, dtype) in [(Arith::F32, "f32"), (Arith::Bf16, "bf16")] {
        let mut out = vec![0.0; bt * oc];
        let cpu_s = time(reps, || tensor::matmul::matmul_forward_as(arith, &mut out, &x.inp, &x.w, Some(&x.bias), bt, c, oc));
        rows.push(Row { kernel: "matmul_forward", dtype, unit: "GFLOP/s", work: flops, cpu_s, cpu_out: out });
    }
    let (mut di, mut dw, mut db) = (vec![0.0; bt * c], vec![0.0; oc * c], vec![0.0; oc]);
    let cpu_s = time(reps, || tensor::matmul_backward(&mut di, &mut dw, Some(&mut db), &x.dout, &x.inp, &x.w, bt, c, oc));
    // Backward accumulates: after 1 + reps calls, the gradient is (1 + reps) times one call's.
    let once: Vec<f32> = di.iter().map(|v| v / (1 + reps) as f32).collect();
    rows.push(Row { kernel: "matmul_backward", dtype: "f32", unit: "GFLOP/s", work: 2.0 * flops, cpu_s, cpu_out: once });
    let mut db = vec![0.0; oc];
    let cpu_s = time(reps, || {
        db.iter_mut().for_each(|d| *d = 0.0);
        x.dout.chunks(oc).for_each(|r| db.iter_mut().zip(r).for_each(|(d, g)| *d += g));
    });
    rows.push(Row { kernel: "bias_backward", dtype: "f32", unit: "GB/s", work: (bt * oc * 4) as f64, cpu_s, cpu_out: db });
    use tensor::precision::{from_bits16, pack16, round_into, Format};
    let (mut h, mut rounded) = (vec![0u16; bt * c], vec![0.0; bt * c]);
    let cpu_s = time(reps, || {
        round_into(&mut rounded, &x.inp, Format::Bf16);
        pack16(&mut h, &rounded, Format::Bf16)
    });
    let cast: Vec<f32> = h.iter().map(|&b| from_bits16(b, Format::Bf16)).collect();
    rows.push(Row { kernel: "cast", dtype: "f32->bf16", unit: "GB/s", work: (bt * c * 6) as f64, cpu_s, cpu_out: cast });
    rows
}

/// Each row's device time and output, in [`cpu_rows`]' order.
#[cfg(feature = "vulkan")]
fn device_rows(g: &device::Gpu, x: &Inputs, reps: usize) -> Vec<(f64, Vec<f32>)> {
    use device::DType;
    let (bt, c, oc) = SHAPE;
    let mut rows = Vec::new();
    let (w, bias, dout) = (g.upload(&x.w), g.upload(&x.bias), g.upload(&x.dout));
    for dtype in [DType::F32, DType::Bf16] {
        let (inp, w) = (g.upload_as(&x.inp, dtype), g.upload_as(&x.w, dtype));
        let out = g.zeros(bt * oc);
        let s = time(reps, || {
            g.matmul_forward(&out, &inp, w.at(0), Some(bias.at(0)), bt, c, oc);
            g.sync()
        });
        rows.push((s, g.download(&out)));
    }
    let inp = g.upload(&x.inp);
    let (di, dw, db) = (g.zeros(bt * c), g.zeros(oc * c), g.zeros(oc));
    let s = time(reps, || {
        g.matmul_backward((&di, dw.at(0), Some(db.at(0))), &dout, &inp, w.at(0), bt, c, oc);
        g.sync()
    });
    rows.push((s, g.download(&di).iter().map(|v| v / (1 + reps) as f32).collect()));
    let db = g.zeros(oc);
    let s = time(reps, || {
        g.clear(&db);
        g.bias_backward(db.at(0), &dout, bt, oc);
        g.sync()
    });
    rows.push((s, g.download(&db)));
    let h = g.zeros_of(bt * c, DType::Bf16);
    let s = time(reps, || {
        g.cast(&h, &inp).expect("same lengths");
        g.sync()
    });
    rows.push((s, g.download(&h)));
    rows
}

/// max |got − want| over max |want|.
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(0.0f32, |m, w| m.max(w.abs())) as f64;
    got.iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs() as f64)) / scale.max(f64::MIN_POSITIVE)
}

/// The bench's JSON: one object per kernel.
pub fn run(d: DeviceArg, reps: usize) -> Result<Value> {
    let gpu = crate::device::open(d)?;
    let x = inputs();
    let cpu = cpu_rows(&x, reps);
    #[cfg(feature = "vulkan")]
    let (dev, name) = match &gpu {
        Some(g) => (Some(device_rows(g, &x, reps)), Some(g.info.describe())),
        None => (None, None),
    };
    #[cfg(not(feature = "vulkan"))]
    let (dev, name): (Option<Vec<(f64, Vec<f32>)>>, Option<String>) = (gpu.map(|never| match never {}), None);
    let rate = |work: f64, s: f64| work / s / 1e9;
    let mut rows = Vec::new();
    for (i, r) in cpu.iter().enumerate() {
        let mut v = json!({"kernel": r.kernel, "dtype": r.dtype, "unit": r.unit, "cpu_ms": r.cpu_s * 1e3, "cpu_rate": rate(r.work, r.cpu_s)});
        if let Some((s, out)) = dev.as_ref().map(|d| &d[i]) {
            let err = rel_err(out, &r.cpu_out);
            v["device_ms"] = json!(s * 1e3);
            v["device_rate"] = json!(rate(r.work, *s));
            v["device_over_cpu"] = json!(r.cpu_s / s);
            v["max_err_over_max_ref"] = json!(err);
            // The conformance suite's contract: 1e-5 in fp32, 1e-2 where the inputs are 16-bit.
            let tol = if r.dtype == "f32" { 1e-5 } else { 1e-2 };
            if err > tol {
                return user(format!("kernel {} ({}) on {d}: device and CPU differ by {err:e} (max abs error over max abs reference), over the {tol:e} contract", r.kernel, r.dtype));
            }
        }
        rows.push(v);
    }
    let (bt, c, oc) = SHAPE;
    Ok(json!({
        "device": d.to_string(),
        "adapter": name,
        "shape": {"bt": bt, "c": c, "oc": oc},
        "reps": reps,
        "threads": rayon::current_num_threads(),
        "kernels": rows,
    }))
}
