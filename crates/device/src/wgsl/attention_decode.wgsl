// One token's attention over a KV cache (tensor::attention::attention_decode): for query head h
// (one thread each) and its kv head h / (NH/NKV), OUT[h·HS..] = Σ_j softmax_j(q·k_j/√HS)·v_j
// over the cached positions first .. t (the sliding window's first key; every one without).
// K and V are [max_t, NKV·HS] from row `at` (a layer's slice of the cache).
// args: nh nkv hs t first k_at softmax_scale
@compute @workgroup_size(32)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let h = flat_id(wg, lid, 32u);
    let nh = arg(0u);
    if (h >= nh) {
        return;
    }
    let nkv = arg(1u);
    let hs = arg(2u);
    let t = arg(3u);
    let kw = nkv * hs;
    let g = h / (nh / nkv);
    let base = arg(5u);
    let scale = argf(6u);
    var m = -3.0e38;
    for (var j = arg(4u); j < t; j++) {
        var s = 0.0;
        for (var d = 0u; d < hs; d++) {
            s += ld_Q(h * hs + d) * ld_K(base + j * kw + g * hs + d);
        }
        m = max(m, s * scale);
    }
    var sum = 0.0;
    for (var j = arg(4u); j < t; j++) {
        var s = 0.0;
        for (var d = 0u; d < hs; d++) {
            s += ld_Q(h * hs + d) * ld_K(base + j * kw + g * hs + d);
        }
        sum += exp(s * scale - m);
    }
    for (var d = 0u; d < hs; d++) {
        st_OUT(h * hs + d, 0.0);
    }
    for (var j = arg(4u); j < t; j++) {
        var s = 0.0;
        for (var d = 0u; d < hs; d++) {
            s += ld_Q(h * hs + d) * ld_K(base + j * kw + g * hs + d);
        }
        let a = exp(s * scale - m) / sum;
        for (var d = 0u; d < hs; d++) {
            st_OUT(h * hs + d, ld_OUT(h * hs + d) + a * ld_V(base + j * kw + g * hs + d));
        }
    }
}
