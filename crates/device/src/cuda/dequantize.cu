// OUT[out_off + i] = the quantized tensor's element i, for i < len: `tensor::quant`'s
// `Nf4::dequantize_into` and `Int8Rows::dequantize_rows`, one element per thread.
// args: len out_off mode cols mean_bits
//   mode 0: NF4, block maxima in fp32 (AM); 1: NF4, block maxima double-quantized (AM: E4M3
//   codes, four to a word; SC: one scale per 256 blocks; mean); 2: int8 per row (SC: row
//   scales, `cols` to a row).
// Q: NF4 codes two to a byte (the first in the high nibble), bytes little-endian in words; or
// int8 codes four to a word.

__device__ const uint NF4_BITS[16] = {
    0xbf800000u, 0xbf3239b1u, 0xbf066b30u, 0xbeca32a0u, 0xbe91a24du, 0xbe3d353fu, 0xbdba7871u, 0x00000000u,
    0x3da2faffu, 0x3e24cae3u, 0x3e7c04ddu, 0x3ead033au, 0x3ee1a4b8u, 0x3f1007abu, 0x3f3913b3u, 0x3f800000u};

__device__ uint byte_at(const KilnParams& KP, uint word, uint i) {
    return (word >> (8u * (i & 3u))) & 0xffu;
}

// The value of FP8 E4M3 bits (`tensor::quant::e4m3_value`).
__device__ float e4m3(const KilnParams& KP, uint b) {
    const auto e = int((b >> 3u) & 0xfu);
    const auto m = float(b & 7u);
    auto v = m / 512.0f;
    if (e != 0) {
        v = ldexpf(1.0f + m / 8.0f, e - 7);
    }
    return kiln_select(v, -v, (b & 0x80u) != 0u);
}

__device__ float block_max(const KilnParams& KP, uint b, uint mode) {
    if (mode == 0u) {
        return __uint_as_float(AM[b]);
    }
    const auto code = byte_at(KP, AM[b >> 2u], b);
    const auto scaled = e4m3(KP, code) * ld_SC(b / 256u);
    return scaled + argf(4u);
}

extern "C" __global__ void __launch_bounds__(256) dequantize(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto i = flat_id(wg, lid, 256u);
    if (i >= arg(0u)) {
        return;
    }
    const auto mode = arg(2u);
    float v;
    if (mode == 2u) {
        const auto c = byte_at(KP, Q[i >> 2u], i);
        const auto code = kiln_select(int(c), int(c) - 256, c >= 128u);
        v = float(code) * ld_SC(i / arg(3u));
    } else {
        const auto byte = byte_at(KP, Q[i >> 3u], i >> 1u);
        const auto code = kiln_select(byte & 0xfu, byte >> 4u, (i & 1u) == 0u);
        v = __uint_as_float(NF4_BITS[code]) * block_max(KP, i / 64u, mode);
    }
    st_OUT(arg(1u) + i, v);
}
