// The input gradient of LayerNorm (or RMSNorm), one row per workgroup, accumulated:
// LayerNorm: DX += (W·D − mean(W·D) − n·mean(W·D·n))·rstd, n = (X − mean)·rstd;
// RMSNorm:   DX += rstd·(W·D − X·rstd·m), m = Σ(W·D·X)·rstd / C.
// args: rows c w_off rms
extern "C" __global__ void __launch_bounds__(256) layernorm_backward(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid3 = threadIdx;
    const auto row = group_id(wg);
    const auto lid = lid3.x;
    const auto c = arg(1u);
    if (row >= arg(0u)) {
        return;
    }
    const auto x0 = row * c;
    const auto w0 = arg(2u);
    const auto rs = ld_RSTD(row);
    if (arg(3u) != 0u) {
        auto s = 0.0f;
        for (auto j = lid; j < c; j += 256u) {
            s += ld_P(w0 + j) * ld_D(x0 + j) * ld_X(x0 + j);
        }
        const auto m = wg_sum(KP, s, lid) * rs / float(c);
        for (auto j = lid; j < c; j += 256u) {
            const auto x = ld_X(x0 + j);
            st_DX(x0 + j, ld_DX(x0 + j) + rs * (ld_P(w0 + j) * ld_D(x0 + j) - x * rs * m));
        }
        return;
    }
    const auto mu = ld_MEAN(row);
    auto a = 0.0f;
    auto b = 0.0f;
    for (auto j = lid; j < c; j += 256u) {
        const auto wd = ld_P(w0 + j) * ld_D(x0 + j);
        a += wd;
        b += wd * (ld_X(x0 + j) - mu) * rs;
    }
    const auto dnorm_mean = wg_sum(KP, a, lid) / float(c);
    const auto dnorm_norm_mean = wg_sum(KP, b, lid) / float(c);
    for (auto j = lid; j < c; j += 256u) {
        const auto norm = (ld_X(x0 + j) - mu) * rs;
        const auto g = (ld_P(w0 + j) * ld_D(x0 + j) - dnorm_mean - norm * dnorm_norm_mean) * rs;
        st_DX(x0 + j, ld_DX(x0 + j) + g);
    }
}
