// FlashAttention-2 backward over a block (lib_attn.cu), the query gradient: one thread per
// query (b, h, i), keys and values TILE at a time through workgroup memory. With
// p = exp(s − lse_i), dp = dO_i·v_j and z the dropout factor: ds = p·(z·dp − D_i),
// DQ[q_i] += scale·Σ_j ds·k_j (DQ laid out as QKV).

extern "C" __global__ void __launch_bounds__(64) flash_backward_dq(const KilnParams KP) {
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
    float q[128];
    float dy[128];
    float dq[128];
    auto first = 0u;
    auto lse = 0.0f;
    auto dd = 0.0f;
    if (live) {
        for (auto d = 0u; d < hs; d++) {
            q[d] = ld_QKV(q_row(KP, b, i) * w + h * hs + d);
            dy[d] = ld_DY(q_row(KP, b, i) * hd.nh * hs + h * hs + d);
            dq[d] = 0.0f;
        }
        first = first_key(KP, b, i);
        const auto at = bh * arg(16u) + arg(17u) + i;
        lse = ld_LSE(at);
        dd = ld_DD(at);
    }
    const auto kr = key_range(KP, i0, min(i0 + 64u, q_len));
    for (auto k0 = kr.x; k0 < kr.y; k0 += TILE) {
        load_kv(KP, hd, k0, lid);
        __syncthreads();
        if (live) {
            for (auto kk = 0u; kk < TILE; kk++) {
                const auto kp = k_pos0 + k0 + kk;
                if (k0 + kk < kr.y && kp >= first && kp <= pos) {
                    auto s = 0.0f;
                    auto dp = 0.0f;
                    for (auto d = 0u; d < hs; d++) {
                        s = fmaf(q[d], Ta[kk * MAX_HS + d], s);
                        dp = fmaf(dy[d], Tb[kk * MAX_HS + d], dp);
                    }
                    const auto p = expf(s * scale - lse);
                    const auto ds = p * (drop_factor(KP, b, h, pos, kp) * dp - dd) * scale;
                    for (auto d = 0u; d < hs; d++) {
                        dq[d] = fmaf(ds, Ta[kk * MAX_HS + d], dq[d]);
                    }
                }
            }
        }
        __syncthreads();
    }
    if (live) {
        for (auto d = 0u; d < hs; d++) {
            const auto at = q_row(KP, b, i) * w + h * hs + d;
            st_DQ(at, ld_DQ(at) + dq[d]);
        }
    }
}
