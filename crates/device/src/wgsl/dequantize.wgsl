// OUT[out_off + i] = the quantized tensor's element i, for i < len: `tensor::quant`'s
// `Nf4::dequantize_into` and `Int8Rows::dequantize_rows`, one element per thread.
// args: len out_off mode cols mean_bits
//   mode 0: NF4, block maxima in fp32 (AM); 1: NF4, block maxima double-quantized (AM: E4M3
//   codes, four to a word; SC: one scale per 256 blocks; mean); 2: int8 per row (SC: row
//   scales, `cols` to a row).
// Q: NF4 codes two to a byte (the first in the high nibble), bytes little-endian in words; or
// int8 codes four to a word.

var<private> NF4_BITS: array<u32, 16> = array<u32, 16>(
    0xbf800000u, 0xbf3239b1u, 0xbf066b30u, 0xbeca32a0u, 0xbe91a24du, 0xbe3d353fu, 0xbdba7871u, 0x00000000u,
    0x3da2faffu, 0x3e24cae3u, 0x3e7c04ddu, 0x3ead033au, 0x3ee1a4b8u, 0x3f1007abu, 0x3f3913b3u, 0x3f800000u);

fn byte_at(word: u32, i: u32) -> u32 {
    return (word >> (8u * (i & 3u))) & 0xffu;
}

// The value of FP8 E4M3 bits (`tensor::quant::e4m3_value`).
fn e4m3(b: u32) -> f32 {
    let e = i32((b >> 3u) & 0xfu);
    let m = f32(b & 7u);
    var v = m / 512.0;
    if (e != 0) {
        v = ldexp(1.0 + m / 8.0, e - 7);
    }
    return select(v, -v, (b & 0x80u) != 0u);
}

fn block_max(b: u32, mode: u32) -> f32 {
    if (mode == 0u) {
        return bitcast<f32>(AM[b]);
    }
    let code = byte_at(AM[b >> 2u], b);
    let scaled = e4m3(code) * ld_SC(b / 256u);
    return scaled + argf(4u);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wg, lid, 256u);
    if (i >= arg(0u)) {
        return;
    }
    let mode = arg(2u);
    var v: f32;
    if (mode == 2u) {
        let c = byte_at(Q[i >> 2u], i);
        let code = select(i32(c), i32(c) - 256, c >= 128u);
        v = f32(code) * ld_SC(i / arg(3u));
    } else {
        let byte = byte_at(Q[i >> 3u], i >> 1u);
        let code = select(byte & 0xfu, byte >> 4u, (i & 1u) == 0u);
        v = bitcast<f32>(NF4_BITS[code]) * block_max(i / 64u, mode);
    }
    st_OUT(arg(1u) + i, v);
}
