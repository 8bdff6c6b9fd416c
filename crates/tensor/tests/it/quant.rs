//! `tensor::quant` against its definition (issue 25): the NF4 codebook built from normal
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
