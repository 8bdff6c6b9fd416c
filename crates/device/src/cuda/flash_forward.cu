// FlashAttention-2 forward over a block (lib_attn.cu), causal by global position,
// grouped-query, with a sliding window and packed documents: one workgroup per (b·NH + h, 64
// queries), one thread per query; keys and values pass through workgroup memory TILE at a time
// with an online softmax, so no T×T matrix exists. OUT[b, i, h·HS..] = Σ_j drop(softmax_j)·v_j;
// LSE[b·NH + h, i] = ln Σ_j exp(s_ij). Unless `fresh`, the softmax continues from OUT and LSE
// (an earlier block's), as a ring of context-parallel blocks merges them.

extern "C" __global__ void __launch_bounds__(64) flash_forward(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid3 = threadIdx;
    const auto hd = head_of(KP, wg.y);
    const auto hs = hd.hs;
    const auto w = hd.w;
    const auto bh = wg.y;
    const auto b = hd.b;
    const auto h = hd.h;
    const auto lid = lid3.x;
    const auto q_len = arg(18u);
    const auto i0 = wg.x * 64u;
    const auto i = i0 + lid;
    const auto live = i < q_len;
    const auto pos = arg(19u) + i;
    const auto k_pos0 = arg(23u);
    const auto scale = argf(14u);
    const auto c = hd.nh * hs;
    const auto lse_at = bh * arg(16u) + arg(17u) + i;
    float q[128];
    float acc[128];
    auto first = 0u;
    auto m = NONE;
    auto l = 0.0f;
    if (live) {
        const auto fresh = arg(27u) != 0u;
        for (auto d = 0u; d < hs; d++) {
            q[d] = ld_QKV(q_row(KP, b, i) * w + h * hs + d);
            acc[d] = 0.0f;
            if (!fresh) {
                acc[d] = ld_OUT(q_row(KP, b, i) * c + h * hs + d);
            }
        }
        if (!fresh) {
            m = ld_LSE(lse_at);
            l = 1.0f;
        }
        first = first_key(KP, b, i);
    }
    const auto kr = key_range(KP, i0, min(i0 + 64u, q_len));
    for (auto k0 = kr.x; k0 < kr.y; k0 += TILE) {
        load_kv(KP, hd, k0, lid);
        __syncthreads();
        if (live) {
            float s[16];
            auto tmax = m;
            for (auto kk = 0u; kk < TILE; kk++) {
                const auto kp = k_pos0 + k0 + kk;
                s[kk] = NONE;
                if (k0 + kk < kr.y && kp >= first && kp <= pos) {
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
                        const auto pz = p * drop_factor(KP, b, h, pos, k_pos0 + k0 + kk);
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
        for (auto d = 0u; d < hs; d++) {
            st_OUT(q_row(KP, b, i) * c + h * hs + d, acc[d] / l);
        }
        st_LSE(lse_at, m + logf(l));
    }
}
