// DST = SRC converted to DST's type, one output word per thread.
// args: len words mode (0: fp32, 1: bf16 pairs, 2: f16 pairs)

// bf16 bits of x, rounded to nearest, ties to even; NaN stays NaN.
fn to_bf16(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (b >> 16u) | 0x40u;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let w = flat_id(wg, lid, 64u);
    let len = arg(0u);
    if (w >= arg(1u)) {
        return;
    }
    let mode = arg(2u);
    if (mode == 0u) {
        DST[w] = bitcast<u32>(ld_SRC(w));
        return;
    }
    let lo = ld_SRC(2u * w);
    var hi = 0.0;
    if (2u * w + 1u < len) {
        hi = ld_SRC(2u * w + 1u);
    }
    if (mode == 1u) {
        DST[w] = to_bf16(lo) | (to_bf16(hi) << 16u);
    } else {
        DST[w] = pack2x16float(vec2<f32>(lo, hi));
    }
}
