// One token's attention over a KV cache (tensor::attention::attention_decode): for query head h
// (one thread each) and its kv head h / (NH/NKV), OUT[h·HS..] = Σ_j softmax_j(q·k_j/√HS)·v_j
// over the cached positions first .. t (the sliding window's first key; every one without).
// K and V are [max_t, NKV·HS] from row `at` (a layer's slice of the cache).
// args: nh nkv hs t first k_at softmax_scale
extern "C" __global__ void __launch_bounds__(32) attention_decode(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto h = flat_id(wg, lid, 32u);
    const auto nh = arg(0u);
    if (h >= nh) {
        return;
    }
    const auto nkv = arg(1u);
    const auto hs = arg(2u);
    const auto t = arg(3u);
    const auto kw = nkv * hs;
    const auto g = h / (nh / nkv);
    const auto base = arg(5u);
    const auto scale = argf(6u);
    auto m = -3.0e38f;
    for (auto j = arg(4u); j < t; j++) {
        auto s = 0.0f;
        for (auto d = 0u; d < hs; d++) {
            s += ld_Q(h * hs + d) * ld_K(base + j * kw + g * hs + d);
        }
        m = max(m, s * scale);
    }
    auto sum = 0.0f;
    for (auto j = arg(4u); j < t; j++) {
        auto s = 0.0f;
        for (auto d = 0u; d < hs; d++) {
            s += ld_Q(h * hs + d) * ld_K(base + j * kw + g * hs + d);
        }
        sum += expf(s * scale - m);
    }
    for (auto d = 0u; d < hs; d++) {
        st_OUT(h * hs + d, 0.0f);
    }
    for (auto j = arg(4u); j < t; j++) {
        auto s = 0.0f;
        for (auto d = 0u; d < hs; d++) {
            s += ld_Q(h * hs + d) * ld_K(base + j * kw + g * hs + d);
        }
        const auto a = expf(s * scale - m) / sum;
        for (auto d = 0u; d < hs; d++) {
            st_OUT(h * hs + d, ld_OUT(h * hs + d) + a * ld_V(base + j * kw + g * hs + d));
        }
    }
}
