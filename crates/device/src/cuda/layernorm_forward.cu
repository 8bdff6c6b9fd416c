// LayerNorm (or RMSNorm) of one row per workgroup: OUT = (X − mean)·rstd·W (+ B); RMSNorm:
// OUT = W·(X·rstd) with rstd = 1/√(mean(X²) + eps). Saves MEAN (LayerNorm) and RSTD.
// args: rows c w_off b_off has_bias rms eps
extern "C" __global__ void __launch_bounds__(256) layernorm_forward(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid3 = threadIdx;
    const auto row = group_id(wg);
    const auto lid = lid3.x;
    const auto c = arg(1u);
    if (row >= arg(0u)) {
        return;
    }
    const auto x0 = row * c;
    const auto rms = arg(5u) != 0u;
    auto mu = 0.0f;
    if (!rms) {
        auto s = 0.0f;
        for (auto j = lid; j < c; j += 256u) {
            s += ld_X(x0 + j);
        }
        mu = wg_sum(KP, s, lid) / float(c);
    }
    auto q = 0.0f;
    for (auto j = lid; j < c; j += 256u) {
        const auto d = ld_X(x0 + j) - mu;
        q += d * d;
    }
    auto rs = 0.0f;
    if (rms) {
        rs = 1.0f / sqrtf(wg_sum(KP, q, lid) / float(c) + argf(6u));
    } else {
        rs = 1.0f / sqrtf(wg_sum(KP, q, lid) / float(c) + 1e-5f);
    }
    for (auto j = lid; j < c; j += 256u) {
        const auto w = ld_P(arg(2u) + j);
        auto o = 0.0f;
        if (rms) {
            o = w * (ld_X(x0 + j) * rs);
        } else {
            o = (ld_X(x0 + j) - mu) * rs * w;
            if (arg(4u) != 0u) {
                o += ld_P(arg(3u) + j);
            }
        }
        st_OUT(x0 + j, o);
    }
    if (lid == 0u) {
        if (!rms) {
            st_MEAN(row, mu);
        }
        st_RSTD(row, rs);
    }
}
