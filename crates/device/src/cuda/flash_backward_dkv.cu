// FlashAttention-2 backward, the key and value gradients: one thread per key (b, g, j) of kv
// head g; the group's query heads in ascending order, queries TILE at a time through workgroup
// memory. DQKV[v_j] += Σ_i z·p·dO_i, DQKV[k_j] += scale·Σ_i ds·q_i (as flash_backward_dq).
__shared__ float Ls[16];
__shared__ float Ds[16];

extern "C" __global__ void __launch_bounds__(64) flash_backward_dkv(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid3 = threadIdx;
    const auto t = arg(1u);
    const auto nh = arg(2u);
    const auto nkv = arg(3u);
    const auto hs = arg(4u);
    const auto window = arg(5u);
    const auto w = attn_w(KP);
    const auto bg = wg.y;
    const auto b = bg / nkv;
    const auto g = bg % nkv;
    const auto group = nh / nkv;
    const auto lid = lid3.x;
    const auto j0 = wg.x * 64u;
    const auto j = j0 + lid;
    const auto live = j < t;
    const auto scale = argf(14u);
    float k[128];
    float v[128];
    float dk[128];
    float dv[128];
    if (live) {
        for (auto d = 0u; d < hs; d++) {
            k[d] = ld_QKV((b * t + j) * w + (nh + g) * hs + d);
            v[d] = ld_QKV((b * t + j) * w + (nh + nkv + g) * hs + d);
            dk[d] = 0.0f;
            dv[d] = 0.0f;
        }
    }
    // The queries that can see the workgroup's keys: from its first key to, under a window,
    // its last key's window.
    auto q_hi = t;
    if (window != 0u) {
        q_hi = min(t, j0 + 63u + window);
    }
    for (auto hh = 0u; hh < group; hh++) {
        const auto h = g * group + hh;
        const auto bh = b * nh + h;
        for (auto i0 = j0; i0 < q_hi; i0 += TILE) {
            for (auto e = lid; e < TILE * hs; e += 64u) {
                const auto ii = e / hs;
                const auto d = e % hs;
                const auto i = i0 + ii;
                if (i < t) {
                    Ta[ii * MAX_HS + d] = ld_QKV((b * t + i) * w + h * hs + d);
                    Tb[ii * MAX_HS + d] = ld_DY((b * t + i) * nh * hs + h * hs + d);
                }
            }
            if (lid < TILE && i0 + lid < t) {
                Ls[lid] = ld_LSE(bh * t + i0 + lid);
                Ds[lid] = ld_DD(bh * t + i0 + lid);
            }
            __syncthreads();
            if (live) {
                for (auto ii = 0u; ii < TILE; ii++) {
                    const auto i = i0 + ii;
                    if (i < t && j <= i && first_key(KP, b, i) <= j) {
                        auto s = 0.0f;
                        auto dp = 0.0f;
                        for (auto d = 0u; d < hs; d++) {
                            s = fmaf(Ta[ii * MAX_HS + d], k[d], s);
                            dp = fmaf(Tb[ii * MAX_HS + d], v[d], dp);
                        }
                        const auto p = expf(s * scale - Ls[ii]);
                        const auto z = drop_factor(KP, b, h, i, j);
                        const auto ds = p * (z * dp - Ds[ii]) * scale;
                        for (auto d = 0u; d < hs; d++) {
                            dv[d] = fmaf(p * z, Tb[ii * MAX_HS + d], dv[d]);
                            dk[d] = fmaf(ds, Ta[ii * MAX_HS + d], dk[d]);
                        }
                    }
                }
            }
            __syncthreads();
        }
    }
    if (live) {
        for (auto d = 0u; d < hs; d++) {
            const auto kat = (b * t + j) * w + (nh + g) * hs + d;
            const auto vat = (b * t + j) * w + (nh + nkv + g) * hs + d;
            st_DQKV(kat, ld_DQKV(kat) + dk[d]);
            st_DQKV(vat, ld_DQKV(vat) + dv[d]);
        }
    }
}
