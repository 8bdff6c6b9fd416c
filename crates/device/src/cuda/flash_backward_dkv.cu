// FlashAttention-2 backward over a block (lib_attn.cu), the key and value gradients: one
// thread per key (b, g, j) of kv head g; the group's query heads in ascending order, queries
// TILE at a time through workgroup memory. DKV[v_j] += Σ_i z·p·dO_i, DKV[k_j] += scale·Σ_i
// ds·q_i (as flash_backward_dq; DKV laid out as KV).
__shared__ float Ls[16];
__shared__ float Ds[16];

extern "C" __global__ void __launch_bounds__(64) flash_backward_dkv(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid3 = threadIdx;
    const auto nh = arg(2u);
    const auto nkv = arg(3u);
    const auto hs = arg(4u);
    const auto w = attn_w(KP);
    const auto q_len = arg(18u);
    const auto q_pos0 = arg(19u);
    const auto kw = arg(24u);
    const auto bg = wg.y;
    const auto b = bg / nkv;
    const auto g = bg % nkv;
    const auto group = nh / nkv;
    const auto lid = lid3.x;
    const auto j0 = wg.x * 64u;
    const auto j = j0 + lid;
    const auto live = j < arg(22u);
    const auto kp = arg(23u) + j;
    const auto scale = argf(14u);
    const auto kat = k_row(KP, b, j) * kw + arg(25u) + g * hs;
    const auto vat = k_row(KP, b, j) * kw + arg(26u) + g * hs;
    float k[128];
    float v[128];
    float dk[128];
    float dv[128];
    if (live) {
        for (auto d = 0u; d < hs; d++) {
            k[d] = ld_KV(kat + d);
            v[d] = ld_KV(vat + d);
            dk[d] = 0.0f;
            dv[d] = 0.0f;
        }
    }
    const auto qr = query_range(KP, j0);
    for (auto hh = 0u; hh < group; hh++) {
        const auto h = g * group + hh;
        const auto bh = b * nh + h;
        for (auto i0 = qr.x; i0 < qr.y; i0 += TILE) {
            for (auto e = lid; e < TILE * hs; e += 64u) {
                const auto ii = e / hs;
                const auto d = e % hs;
                const auto i = i0 + ii;
                if (i < q_len) {
                    Ta[ii * MAX_HS + d] = ld_QKV(q_row(KP, b, i) * w + h * hs + d);
                    Tb[ii * MAX_HS + d] = ld_DY(q_row(KP, b, i) * nh * hs + h * hs + d);
                }
            }
            if (lid < TILE && i0 + lid < q_len) {
                const auto at = bh * arg(16u) + arg(17u) + i0 + lid;
                Ls[lid] = ld_LSE(at);
                Ds[lid] = ld_DD(at);
            }
            __syncthreads();
            if (live) {
                for (auto ii = 0u; ii < TILE; ii++) {
                    const auto i = i0 + ii;
                    const auto pos = q_pos0 + i;
                    if (i < qr.y && kp <= pos && first_key(KP, b, i) <= kp) {
                        auto s = 0.0f;
                        auto dp = 0.0f;
                        for (auto d = 0u; d < hs; d++) {
                            s = fmaf(Ta[ii * MAX_HS + d], k[d], s);
                            dp = fmaf(Tb[ii * MAX_HS + d], v[d], dp);
                        }
                        const auto p = expf(s * scale - Ls[ii]);
                        const auto z = drop_factor(KP, b, h, pos, kp);
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
            st_DKV(kat + d, ld_DKV(kat + d) + dk[d]);
            st_DKV(vat + d, ld_DKV(vat + d) + dv[d]);
        }
    }
}
