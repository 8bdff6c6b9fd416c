//! `tensor::quant` against its definition: the NF4 codebook built from normal
//! quantiles equals the 16 values the QLoRA paper and bitsandbytes publish, and quantization,
//! double quantization and dequantization equal a NumPy reference bit for bit
//! (`tests/fixtures/quant/make.py`: scipy's `norm.ppf`, ml_dtypes' E4M3).

use tensor::quant::{nf4_codebook, Absmax, Int8Rows, Nf4, NF4, NF4_BLOCK, SCALE_BLOCK};

/// The values printed in QLoRA's Appendix E / bitsandbytes' `NF4` table.
#[allow(clippy::excessive_precision)]
const PUBLISHED: [f64; 16] = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
];

fn fixture() -> serde_json::Value {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant/expected.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

fn bytes(v: &serde_json::Value) -> Vec<u8> {
    let s = v.as_str().unwrap();
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    bytes(v).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn nf4_codebook_is_the_published_one() {
    let built = nf4_codebook();
    for i in 0..16 {
        assert_eq!(built[i] as f64, PUBLISHED[i], "value {i}");
        assert_eq!(NF4[i] as f64, PUBLISHED[i], "value {i}");
    }
    assert_eq!(floats(&fixture()["codebook"]), NF4.to_vec(), "the NumPy reference's codebook");
}

#[test]
fn nf4_quantize_and_dequantize_equal_the_numpy_reference() {
    let e = fixture();
    let x = floats(&e["input"]);
    let q = Nf4::quantize(&x, false);
    assert_eq!(q.codes, bytes(&e["nf4"]["codes"]));
    assert_eq!(q.absmax, Absmax::F32(floats(&e["nf4"]["absmax"])));
    let d = Nf4::quantize(&x, true);
    assert_eq!(d.codes, bytes(&e["nf4_double"]["codes"]));
    let Absmax::Double { codes, scales, mean } = &d.absmax else { panic!("not double-quantized") };
    assert_eq!(*codes, bytes(&e["nf4_double"]["absmax_codes"]));
    assert_eq!(*scales, floats(&e["nf4_double"]["scales"]));
    assert_eq!(*mean, floats(&e["nf4_double"]["mean"])[0]);
    let deq = d.dequantize();
    assert_eq!(deq, floats(&e["nf4_double"]["dequantized"]));
    // A tile of whole blocks dequantizes to the same values as the whole tensor.
    let mut tile = vec![0.0; 3 * NF4_BLOCK];
    d.dequantize_into(&mut tile, 7 * NF4_BLOCK);
    assert_eq!(tile, deq[7 * NF4_BLOCK..10 * NF4_BLOCK]);
    // Error bounded by half the widest codebook gap times the block maximum.
    for (b, (xs, ds)) in x.chunks(NF4_BLOCK).zip(deq.chunks(NF4_BLOCK)).enumerate() {
        let c = d.block_max(b);
        for (a, r) in xs.iter().zip(ds) {
            assert!((a - r).abs() <= 0.17 * c, "block {b}: {a} vs {r}");
        }
    }
    // 0.5 byte per weight + the maxima: 4 bytes per 64 weights, or 1 byte + 4 per 256 blocks.
    let n = x.len();
    assert_eq!(q.bytes(), n.div_ceil(2) + 4 * n.div_ceil(NF4_BLOCK));
    assert_eq!(d.bytes(), n.div_ceil(2) + n.div_ceil(NF4_BLOCK) + 4 * n.div_ceil(NF4_BLOCK).div_ceil(SCALE_BLOCK) + 4);
}

#[test]
fn int8_rows_equal_the_numpy_reference() {
    let e = &fixture()["int8"];
    let (rows, cols) = (e["rows"].as_u64().unwrap() as usize, e["cols"].as_u64().unwrap() as usize);
    let q = Int8Rows::quantize(&floats(&e["input"]), rows, cols);
    assert_eq!(q.codes.iter().map(|&c| c as u8).collect::<Vec<_>>(), bytes(&e["codes"]));
    assert_eq!(q.scales, floats(&e["scales"]));
    let mut out = vec![0.0; rows * cols];
    q.dequantize_rows(&mut out, 0);
    assert_eq!(out, floats(&e["dequantized"]));
    assert_eq!(q.bytes(), rows * cols + 4 * rows);
}

/// Activation compression: codes and scales as `compressed_bytes` says; nearest rounding within
/// half a step of every value, stochastic rounding within one step and unbiased; zero groups
/// and tails shorter than a group; 4-bit codes sign-extend.
#[test]
fn activation_compression_rounds_within_a_step_and_stochastic_rounding_is_unbiased() {
    use tensor::quant::{compress_groups, compressed_bytes, decompress_groups, ACT_GROUP};
    let mut rng = tensor::Rng::new(9);
    for &n in &[1usize, 63, 64, 65, 200, 1000] {
        let mut x = vec![0.0f32; n];
        rng.fill_normal(&mut x, 2.0);
        if n > 64 {
            x[64..128.min(n)].fill(0.0); // a group of zeros
        }
        for bits in [8u32, 4] {
            let per = if bits == 4 { 2 } else { 1 };
            let (mut c, mut s) = (vec![0u8; n.div_ceil(per)], vec![0f32; n.div_ceil(ACT_GROUP)]);
            assert_eq!(c.len() + 4 * s.len(), compressed_bytes(n, bits));
            let qmax = ((1 << (bits - 1)) - 1) as f32;
            for stochastic in [None, Some(5u64)] {
                compress_groups(&mut c, &mut s, &x, bits, stochastic);
                let mut y = vec![0.0f32; n];
                decompress_groups(&mut y, &c, &s, bits);
                for (g, (xg, yg)) in x.chunks(ACT_GROUP).zip(y.chunks(ACT_GROUP)).enumerate() {
                    let amax = xg.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    assert_eq!(s[g], amax / qmax);
                    let step = s[g];
                    let bound = if stochastic.is_some() { step * 1.0001 } else { step * 0.5001 };
                    for (a, b) in xg.iter().zip(yg) {
                        assert!((a - b).abs() <= bound + 1e-12, "n {n} bits {bits} {stochastic:?}: {a} -> {b} (step {step})");
                    }
                }
            }
        }
    }
    // Stochastic rounding is unbiased: the mean over many streams approaches the value.
    let x = vec![0.3f32, -0.71, 1.0, 0.05];
    let mut mean = [0.0f64; 4];
    for seed in 0..4000u64 {
        let (mut c, mut s) = (vec![0u8; 2], vec![0f32; 1]);
        compress_groups(&mut c, &mut s, &x, 4, Some(seed));
        let mut y = vec![0.0f32; 4];
        decompress_groups(&mut y, &c, &s, 4);
        y.iter().enumerate().for_each(|(i, v)| mean[i] += *v as f64 / 4000.0);
    }
    for (m, v) in mean.iter().zip(&x) {
        assert!((m - *v as f64).abs() < 0.01, "stochastic mean {m} vs {v}");
    }
}

/// A product over a quantized weight, dequantized tile by tile inside it, equals the product
/// over the whole dequantized matrix bit for bit — forward and the input gradient, NF4 and int8, fp32 and
/// bf16 arithmetic, an fp32 or a bf16-rounded base, one tensor or three stacked, with shapes that split into uneven tiles and
/// unaligned NF4 blocks.
#[test]
fn quantized_products_dequantize_tile_by_tile_and_equal_the_dequantized_product() {
    use tensor::matmul::{matmul_backward_input_as, matmul_forward_as, Arith};
    use tensor::quant::{qmatmul_backward_input, qmatmul_forward, QMat, QPart};
    let (bt, c, oc) = (37, 200, 300);
    let mut rng = tensor::Rng::new(7);
    let mut w = vec![0.0f32; oc * c];
    rng.fill_normal(&mut w, 0.05);
    let mut x = vec![0.0f32; bt * c];
    rng.fill_normal(&mut x, 1.0);
    let mut g = vec![0.0f32; bt * oc];
    rng.fill_normal(&mut g, 1.0);
    let bias: Vec<f32> = (0..oc).map(|i| i as f32 * 1e-3).collect();
    let nf4 = Nf4::quantize(&w, true);
    let int8 = Int8Rows::quantize(&w, oc, c);
    let mut int8_deq = vec![0.0; w.len()];
    int8.dequantize_rows(&mut int8_deq, 0);
    // Stacked: three tensors of 100 rows each (q|k|v), quantized on their own.
    let thirds: Vec<Nf4> = w.chunks(100 * c).map(|t| Nf4::quantize(t, true)).collect();
    let stacked_deq: Vec<f32> = thirds.iter().flat_map(|t| t.dequantize()).collect();
    let cases = [
        (QMat { parts: vec![QPart::Nf4(&nf4)] }, nf4.dequantize()),
        (QMat { parts: vec![QPart::Int8(&int8)] }, int8_deq),
        (QMat { parts: thirds.iter().map(QPart::Nf4).collect() }, stacked_deq),
    ];
    for (q, deq) in &cases {
        for arith in [Arith::F32, Arith::Bf16] {
            let (mut want, mut got) = (vec![0.0; bt * oc], vec![1.0; bt * oc]);
            matmul_forward_as(arith, &mut want, &x, deq, Some(&bias), (bt, c, oc));
            qmatmul_forward(arith, None, &mut got, &x, q, Some(&bias), (bt, c, oc));
            assert!(want == got, "{arith:?} forward differs");
            let (mut want, mut got) = (vec![0.5; bt * c], vec![0.5; bt * c]);
            matmul_backward_input_as(arith, &mut want, &g, deq, bt, c, oc);
            qmatmul_backward_input(arith, None, &mut got, &g, q, (bt, c, oc));
            assert!(want == got, "{arith:?} input gradient differs");
            // A bf16 base: each tile rounded, as the whole matrix rounded.
            let mut rounded = deq.clone();
            tensor::precision::round_slice(&mut rounded, tensor::precision::Format::Bf16);
            let (mut want, mut got) = (vec![0.0; bt * oc], vec![1.0; bt * oc]);
            matmul_forward_as(arith, &mut want, &x, &rounded, None, (bt, c, oc));
            qmatmul_forward(arith, Some(tensor::precision::Format::Bf16), &mut got, &x, q, None, (bt, c, oc));
            assert!(want == got, "{arith:?} rounded forward differs");
            let (mut want, mut got) = (vec![0.5; bt * c], vec![0.5; bt * c]);
            matmul_backward_input_as(arith, &mut want, &g, &rounded, bt, c, oc);
            qmatmul_backward_input(arith, Some(tensor::precision::Format::Bf16), &mut got, &g, q, (bt, c, oc));
            assert!(want == got, "{arith:?} rounded input gradient differs");
        }
    }
}
