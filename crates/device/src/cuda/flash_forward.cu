// FlashAttention-2 forward, causal, grouped-query, with a sliding window and packed documents:
// one workgroup per (b·NH + h, 64 queries), one thread per query; keys and values pass through
// workgroup memory TILE at a time with an online softmax, so no T×T matrix exists.
// OUT[b, i, h·HS..] = Σ_j drop(softmax_j)·v_j; LSE[b·NH + h, i] = ln Σ_j exp(s_ij).

extern "C" __global__ void __launch_bounds__(64) flash_forward(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid3 = threadIdx;
    const auto hd = head_of(KP, wg.y);
    const auto t = hd.t;
    const auto hs = hd.hs;
    const auto w = hd.w;
    const auto bh = wg.y;
    const auto b = hd.b;
    const auto h = hd.h;
    const auto lid = lid3.x;
    const auto i0 = wg.x * 64u;
    const auto i = i0 + lid;
    const auto live = i < t;
    const auto scale = argf(14u);
    float q[128];
    float acc[128];
    auto first = 0u;
    if (live) {
        for (auto d = 0u; d < hs; d++) {
            q[d] = ld_QKV((b * t + i) * w + h * hs + d);
            acc[d] = 0.0f;
        }
        first = first_key(KP, b, i);
    }
    // The workgroup's key range: from its first query's window to its last query.
    const auto k_lo = window_start(KP, i0);
    const auto k_hi = min(i0 + 64u, t);
    auto m = NONE;
    auto l = 0.0f;
    for (auto k0 = k_lo; k0 < k_hi; k0 += TILE) {
        load_kv(KP, hd, k0, lid);
        __syncthreads();
        if (live) {
            float s[16];
            auto tmax = m;
            for (auto kk = 0u; kk < TILE; kk++) {
                const auto j = k0 + kk;
                s[kk] = NONE;
                if (j >= first && j <= i) {
                    auto dot = 0.0f;
                    for (auto d = 0u; d < hs; d++) {
                        dot = fmaf(q[d], Ta[kk * MAX_HS + d], dot);
                    }
                    s[kk] = dot * scale;
                    tmax = max(tmax, s[kk]);
                }
            }
            if (tmax > NONE) {
                const auto corr = expf(m - tmax);
                l *= corr;
                for (auto d = 0u; d < hs; d++) {
                    acc[d] *= corr;
                }
                for (auto kk = 0u; kk < TILE; kk++) {
                    if (s[kk] > NONE) {
                        const auto p = expf(s[kk] - tmax);
                        l += p;
                        const auto pz = p * drop_factor(KP, b, h, i, k0 + kk);
                        for (auto d = 0u; d < hs; d++) {
                            acc[d] = fmaf(pz, Tb[kk * MAX_HS + d], acc[d]);
                        }
                    }
                }
                m = tmax;
            }
        }
        __syncthreads();
    }
    if (live) {
        const auto c = hd.nh * hs;
        for (auto d = 0u; d < hs; d++) {
            st_OUT((b * t + i) * c + h * hs + d, acc[d] / l);
        }
        st_LSE(bh * t + i, m + logf(l));
    }
}
