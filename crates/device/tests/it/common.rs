use device::{DType, Gpu};
use std::sync::OnceLock;
use tensor::Rng;

/// One device for the whole binary.
pub fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| Gpu::open(0).unwrap_or_else(|e| panic!("the device conformance suite needs a Vulkan adapter: {e}")))
}

pub fn randn(rng: &mut Rng, n: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0.0; n];
    rng.fill_normal(&mut v, std);
    v
}

/// The contract's tolerance for a kernel whose inputs are stored as `dtype`.
pub fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 | DType::U32 => 1e-5,
        DType::Bf16 | DType::F16 => 1e-2,
    }
}

/// max |got − want| / max |want|, asserted to be at most `tol`; the reference must not be all
/// zeros (a kernel that wrote nothing would pass against it).
pub fn close(name: &str, got: &[f32], want: &[f32], tol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{name}: lengths");
    let scale = want.iter().fold(0.0f32, |m, w| m.max(w.abs()));
    assert!(scale > 0.0, "{name}: the reference is all zeros");
    let err = got.iter().zip(want).fold(0.0f32, |m, (g, w)| m.max((g - w).abs())) / scale;
    assert!(err <= tol, "{name}: max abs error over max abs reference {err:e} > {tol:e}");
    err
}

/// `x` as the device stores it in `dtype` (what the CPU twin must be given).
pub fn stored(x: &[f32], dtype: DType) -> Vec<f32> {
    let fmt = match dtype {
        DType::Bf16 => tensor::precision::Format::Bf16,
        DType::F16 => tensor::precision::Format::Fp16,
        _ => return x.to_vec(),
    };
    x.iter().map(|&v| tensor::precision::round(v, fmt)).collect()
}
