//! The simulated number formats hold exactly the values the formats hold.

use tensor::precision::{amax, quantize_into, round, round_slice, Format};

#[test]
fn bf16_and_fp16_round_to_nearest_even_and_overflow_to_infinity() {
    // bf16 keeps 8 significant bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 → even (1).
    assert_eq!(round(1.0 + 2f32.powi(-8), Format::Bf16), 1.0);
    assert_eq!(round(1.0 + 3.0 * 2f32.powi(-8), Format::Bf16), 1.0 + 2f32.powi(-6));
    assert_eq!(round(3.0e38, Format::Bf16), f32::from_bits(0x7F62_0000));
    // fp16: 11 significant bits, largest 65504, smallest subnormal 2^-24.
    assert_eq!(round(2049.0, Format::Fp16), 2048.0);
    assert_eq!(round(2051.0, Format::Fp16), 2052.0);
    assert_eq!(round(65504.0, Format::Fp16), 65504.0);
    assert_eq!(round(65520.0, Format::Fp16), f32::INFINITY);
    assert_eq!(round(-70000.0, Format::Fp16), f32::NEG_INFINITY);
    assert_eq!(round(2f32.powi(-24), Format::Fp16), 2f32.powi(-24));
    assert_eq!(round(2f32.powi(-26), Format::Fp16), 0.0);
    assert!(round(f32::NAN, Format::Fp16).is_nan() && round(f32::NAN, Format::Bf16).is_nan());
    // Every fp16 value is a fixed point.
    for bits in (0u16..0x7C00).step_by(7) {
        let v = f16_to_f32(bits);
        assert_eq!(round(v, Format::Fp16), v, "{bits:#x}");
        assert_eq!(round(-v, Format::Fp16), -v);
    }
}

/// Every format passes NaN and infinities through and keeps a zero's sign, one value at a time
/// and in place over a slice (whose vectorised loop computes every lane: no masked store).
#[test]
fn every_format_passes_non_finite_values_and_signed_zeros() {
    for fmt in [Format::Bf16, Format::Fp16, Format::E4m3, Format::E5m2] {
        let specials = [f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, f32::NAN, -f32::NAN, f32::from_bits(0x7F80_0001), 1.5];
        let mut xs: Vec<f32> = (0..67).map(|i| specials[i % specials.len()]).collect();
        let want: Vec<f32> = xs.iter().map(|&x| round(x, fmt)).collect();
        round_slice(&mut xs, fmt);
        for (i, (&got, &w)) in xs.iter().zip(&want).enumerate() {
            let x = specials[i % specials.len()];
            if x.is_nan() {
                assert!(got.is_nan() && w.is_nan(), "{fmt:?} NaN {:#x}: {got}", x.to_bits());
            } else {
                assert_eq!((got.to_bits(), w.to_bits()), (x.to_bits(), x.to_bits()), "{fmt:?} {x}");
            }
        }
    }
}

#[test]
fn fp16_rounding_matches_a_reference_across_the_f32_range() {
    // Reference in f64: the fp16 spacing at |x| (2^(e − 10), subnormal below 2^-14), x over the
    // spacing rounded half to even, overflow from 65520 on.
    let reference = |x: f32| -> f32 {
        if !x.is_finite() {
            return x;
        }
        let a = x.abs() as f64;
        if a >= 65520.0 {
            return f32::INFINITY.copysign(x);
        }
        let e = if a == 0.0 { -14 } else { (a.log2().floor() as i32).max(-14) };
        // log2 can be off by one at powers of two: the spacing is the one of a's binade.
        let e = if a >= 2f64.powi(e + 1) { e + 1 } else if a < 2f64.powi(e) && e > -14 { e - 1 } else { e };
        let q = 2f64.powi(e - 10);
        let y = a / q;
        let f = y.floor();
        let r = if y - f > 0.5 || (y - f == 0.5 && f % 2.0 == 1.0) { f + 1.0 } else { f };
        ((r * q) as f32).copysign(x)
    };
    // A stride through every bit pattern (both signs, zeros, subnormals, NaNs, infinities), and
    // the neighbourhood of every fp16 rounding boundary near 1 and the overflow threshold.
    let mut bits: Vec<u32> = (0..=u32::MAX / 40_009).map(|k| k * 40_009).collect();
    bits.extend((0x3F80_0000u32..0x3F80_0000 + (1 << 16)).chain(0x477F_E000 - 4096..0x477F_E000 + 4096).chain(0x3880_0000 - 4096..0x3880_0000 + 4096));
    for b in bits {
        let x = f32::from_bits(b);
        let (got, want) = (round(x, Format::Fp16), reference(x));
        assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{b:#x} ({x:e}): {got:e} vs {want:e}");
    }
}

/// IEEE half bits → f32 (reference for the test).
fn f16_to_f32(h: u16) -> f32 {
    let (e, m) = ((h >> 10) & 0x1F, (h & 0x3FF) as f32);
    if e == 0 { m * 2f32.powi(-24) } else { (1.0 + m / 1024.0) * 2f32.powi(e as i32 - 15) }
}

#[test]
fn fp8_formats_hold_their_grids_and_saturate() {
    // E4M3: 0.0625 · 2^-6 granularity below 2^-6, 3 mantissa bits, max 448.
    let e4m3: Vec<f32> = (0..=0x7E).map(|b: u32| {
        let (e, m) = ((b >> 3) as i32, (b & 7) as f32);
        if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) }
    }).collect();
    assert_eq!(*e4m3.last().unwrap(), 448.0);
    for &v in &e4m3 {
        assert_eq!(round(v, Format::E4m3), v);
    }
    // Midpoints round to the even neighbour; beyond the range saturates.
    assert_eq!(round(1.0625, Format::E4m3), 1.0);
    assert_eq!(round(1.1875, Format::E4m3), 1.25);
    assert_eq!(round(1000.0, Format::E4m3), 448.0);
    assert_eq!(round(-1e9, Format::E5m2), -57344.0);
    // 1.5 quanta of the subnormal grid (2^-16): a tie, to the even multiple.
    assert_eq!(round(3.0 * 2f32.powi(-17), Format::E5m2), 2f32.powi(-15));
    assert_eq!(round(2f32.powi(-18), Format::E5m2), 0.0);
    // Random values land on the grid, within half a step.
    let mut rng = tensor::Rng::new(3);
    for _ in 0..2000 {
        let x = (rng.normal() * 50.0) as f32;
        let r = round(x, Format::E4m3);
        assert!(e4m3.contains(&r.abs()), "{x} → {r}");
        let nearest = e4m3.iter().map(|g| (g - x.abs()).abs()).fold(f32::INFINITY, f32::min);
        assert!(((r.abs() - x.abs()).abs() - nearest).abs() < 1e-6 || x.abs() > 448.0);
    }
}

#[test]
fn scaled_quantisation_and_amax() {
    let x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 1e-5).collect();
    let a = amax(&x);
    assert_eq!(a, 500.0 * 1e-5);
    let scale = a / Format::E4m3.max();
    let mut q = vec![0.0; x.len()];
    assert_eq!(quantize_into(&mut q, &x, Format::E4m3, scale), a, "the cast finds the amax too");
    // Relative error at most half a unit in the last of 4 significant bits, for normal values.
    for (a, b) in x.iter().zip(&q) {
        if a.abs() > 2f32.powi(-6) * scale {
            assert!((a - b).abs() <= a.abs() / 16.0 + 1e-12, "{a} vs {b}");
        }
    }
    let mut y = x.clone();
    round_slice(&mut y, Format::Bf16);
    assert!(y.iter().zip(&x).all(|(a, b)| (a - b).abs() <= b.abs() / 256.0));
    // Across chunks and lanes (40 000 values: several 16K chunks, a partial lane group), a NaN
    // anywhere makes the amax NaN; infinities count.
    let mut big: Vec<f32> = (0..40_003).map(|i| ((i * 7919) % 1000) as f32 - 500.0).collect();
    assert_eq!(amax(&big), 500.0);
    big[39_999] = -f32::INFINITY;
    assert_eq!(amax(&big), f32::INFINITY);
    big[40_002] = f32::NAN;
    assert!(amax(&big).is_nan() && quantize_into(&mut vec![0.0; big.len()], &big, Format::E5m2, 1.0).is_nan());
    assert_eq!(amax(&[]), 0.0);
}

#[test]
fn sixteen_bit_packing_is_lossless_for_rounded_values_in_both_formats() {
    use tensor::precision::{pack16, round, unpack16, Format};
    let mut r = tensor::Rng::new(5);
    // Normal values over a wide range, fp16 subnormals, zeros, infinities, NaN.
    let mut x: Vec<f32> = (0..40_000).map(|i| (r.normal() as f32) * 2f32.powi((i % 40) - 20)).collect();
    x.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, 6e-8, -3e-6, 65504.0, 1e-30]);
    for fmt in [Format::Bf16, Format::Fp16] {
        let v: Vec<f32> = x.iter().map(|&a| round(a, fmt)).collect();
        let mut h = vec![0u16; v.len()];
        pack16(&mut h, &v, fmt);
        let mut back = vec![0.0f32; v.len()];
        unpack16(&mut back, &h, fmt);
        for (i, (a, b)) in v.iter().zip(&back).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{fmt:?} [{i}]: {a:e} came back as {b:e}");
        }
        // NaN survives as a NaN.
        let mut h1 = [0u16; 1];
        pack16(&mut h1, &[f32::NAN], fmt);
        let mut b1 = [0.0f32; 1];
        unpack16(&mut b1, &h1, fmt);
        assert!(b1[0].is_nan(), "{fmt:?}");
    }
}

/// bf16's split master weights (`split_bf16`): the working weight is the nearest bf16 value
/// (ties away from zero, where round-to-nearest-even may go the other way), and the pair gives
/// the fp32 master weight back bit for bit — every 16-bit low half over upper halves spread
/// over the whole range, both signs, the largest finite value and infinities. AdamW on split
/// weights is AdamW on fp32 weights, then the split.
#[test]
fn split_bf16_master_weights_are_exact_and_round_to_nearest() {
    use tensor::precision::{join_bf16, split_bf16, split_bf16_in_place};
    let mut his: Vec<u32> = (0..0x7F80u32).step_by(997).collect();
    his.extend([0, 1, 0x3F80, 0x7F7F]);
    let mut ties = 0;
    for &hi in &his {
        for lo in 0..=0xFFFFu32 {
            for sign in [0, 0x8000_0000u32] {
                let x = f32::from_bits(sign | hi << 16 | lo);
                let (w, l) = split_bf16(x);
                assert_eq!(join_bf16(w, l).to_bits(), x.to_bits(), "{:#x}", x.to_bits());
                assert_eq!(w.to_bits() & 0xFFFF, 0, "{:#x}: the working weight is a bf16 value", x.to_bits());
                let (rne, wd, xd) = (round(x, Format::Bf16), w as f64, x as f64);
                if lo == 0x8000 {
                    ties += 1;
                    assert_eq!(w.abs(), f32::from_bits((x.abs().to_bits() & 0xFFFF_0000) + 0x1_0000), "a tie goes away from zero");
                } else {
                    assert_eq!(w.to_bits(), rne.to_bits(), "{:#x}: off a tie, the nearest value", x.to_bits());
                }
                assert!(w.is_infinite() || (wd - xd).abs() <= (wd - f32::from_bits(w.to_bits() ^ 0x1_0000) as f64).abs(), "{:#x}", x.to_bits());
            }
        }
    }
    assert!(ties > 0);
    for x in [f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN, 0.0, -0.0] {
        let (w, l) = split_bf16(x);
        assert_eq!(join_bf16(w, l).to_bits(), x.to_bits());
    }
    let (w, l) = split_bf16(f32::NAN);
    assert!(w.is_nan() && join_bf16(w, l).is_nan());

    // AdamW: one update of split weights equals the fp32 update followed by the split, bit for bit.
    let n = 3 * tensor::par::ELEMS + 123;
    let mut r = tensor::Rng::new(7);
    let x: Vec<f32> = (0..n).map(|_| r.normal() as f32 * 0.02).collect();
    let g: Vec<f32> = (0..n).map(|_| r.normal() as f32 * 1e-3).collect();
    let h = tensor::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 3 };
    let (mut xf, mut mf, mut vf) = (x.clone(), vec![1e-4f32; n], vec![1e-7f32; n]);
    let (mut w, mut lo, mut ms, mut vs) = (x.clone(), vec![0u16; n], mf.clone(), vf.clone());
    split_bf16_in_place(&mut w, &mut lo);
    for _ in 0..3 {
        tensor::adamw_update(&mut xf, &g, &mut mf, &mut vf, &h);
        tensor::optim::adamw_update_split(&mut w, &mut lo, &g, &mut ms, &mut vs, &h);
    }
    assert!(xf != x);
    for i in 0..n {
        assert_eq!(join_bf16(w[i], lo[i]).to_bits(), xf[i].to_bits(), "element {i}");
        assert_eq!(w[i].to_bits(), split_bf16(xf[i]).0.to_bits());
    }
    assert!(ms == mf && vs == vf);
    let (mut wf, mut lof) = (x.clone(), lo.clone());
    let (mut xs, mut ls) = (x.clone(), vec![0u16; n]);
    split_bf16_in_place(&mut xs, &mut ls);
    tensor::optim::adam_frozen_update(&mut wf, None, &mf, &vf, &h, 1.5);
    tensor::optim::adam_frozen_update(&mut xs, Some(&mut ls), &mf, &vf, &h, 1.5);
    lof.iter_mut().zip(&wf).for_each(|(l, &x)| *l = split_bf16(x).1);
    assert!((0..n).all(|i| join_bf16(xs[i], ls[i]).to_bits() == wf[i].to_bits() && ls[i] == lof[i]));
}
