//! The adapter, buffers, their types, batching and refusals.
use crate::common::{gpu, randn, stored};
use device::{DType, Gpu};
use tensor::Rng;

#[test]
fn an_adapter_is_found_and_described() {
    let all = device::adapters();
    assert!(!all.is_empty(), "no Vulkan adapter: {}", device::INSTALL_HINT);
    let line = all[0].describe();
    assert!(line.starts_with("vulkan:0  ") && line.contains("max buffer"), "{line}");
    assert!(all[0].max_buffer >= 1 << 20 && all[0].max_binding >= 1 << 20);
}

#[test]
fn a_missing_adapter_names_those_found_and_what_to_install() {
    let found = device::adapters();
    let e = Gpu::open(found.len()).err().expect("an adapter past the last one opened");
    assert!(e.0.contains(&format!("vulkan:{}", found.len())) && e.0.contains(&found[0].name), "{e}");
    let none = device::missing(0, &[]);
    assert!(none.0.contains("mesa-vulkan-drivers") && none.0.contains("--device cpu"), "{none}");
}

#[test]
fn buffers_round_trip_in_every_type() {
    let g = gpu();
    let mut rng = Rng::new(3);
    let x = randn(&mut rng, 1001, 3.0);
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        let b = g.upload_as(&x, dtype);
        assert_eq!((b.len(), b.dtype()), (1001, dtype));
        let back = g.download(&b);
        let want = stored(&x, dtype);
        assert!(back.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?}: not the CPU's rounding");
    }
    let ids: Vec<u32> = (0..77).map(|i| i * 7919).collect();
    assert_eq!(g.download_u32(&g.upload_u32(&ids)), ids);
}

#[test]
fn cast_rounds_as_the_cpu() {
    let g = gpu();
    let mut rng = Rng::new(5);
    let mut x = randn(&mut rng, 333, 2.0);
    x[0] = f32::from_bits(0x3F80_8000); // a tie: rounds to even (1.0)
    x[1] = f32::from_bits(0x3F81_8000); // a tie: rounds up
    x[2] = 1e-40; // subnormal
    x[3] = f32::MAX; // overflows bf16 to infinity
    let src = g.upload(&x);
    for dtype in [DType::Bf16, DType::F16, DType::F32] {
        let dst = g.zeros_of(x.len(), dtype);
        g.cast(&dst, &src).unwrap();
        let (got, want) = (g.download(&dst), stored(&x, dtype));
        let n = if dtype == DType::F16 { 4 } else { 0 }; // fp16's overflow and subnormals: the device's rounding
        let bad = got.iter().zip(&want).skip(n).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(bad, 0, "{dtype:?}: {bad} values differ from the CPU's rounding");
    }
    assert!(g.cast(&g.zeros(5), &src).is_err());
}

#[test]
fn many_kernels_are_one_submission_and_oversize_buffers_are_refused() {
    // A device of its own: the counts are the device's, and other tests run beside this one.
    let g = &Gpu::open(0).unwrap();
    let x = g.upload(&[1.0; 100]);
    let (acc, db) = (g.zeros(100), g.zeros(10));
    g.sync();
    let (d0, s0) = g.counts();
    for i in 0..5 {
        g.bias_backward(db.at(0), &x, 10, 10);
        g.cast(&acc, &x).unwrap();
        g.write_words(&acc, i, &[i as u32]);
    }
    g.sync();
    let (d1, s1) = g.counts();
    assert_eq!(d1 - d0, 10);
    assert!(s1 - s0 <= 1, "10 dispatches and 5 writes took {} submissions", s1 - s0);
    assert_eq!(g.download(&db), vec![50.0; 10]);
    let e = g.alloc(usize::MAX / 8, DType::F32).err().expect("an oversized buffer was allocated");
    assert!(e.0.contains("exceeds") && e.0.contains(&g.info.name), "{e}");
}
