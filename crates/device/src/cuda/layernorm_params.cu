// The parameter gradients of LayerNorm (or RMSNorm), one thread per column, rows in order:
// DP[w_off + j] += Σ_r n[r, j]·D[r, j] (n the normalised input), DP[b_off + j] += Σ_r D[r, j].
// args: rows c w_off b_off has_bias rms
extern "C" __global__ void __launch_bounds__(64) layernorm_params(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto j = flat_id(wg, lid, 64u);
    const auto c = arg(1u);
    if (j >= c) {
        return;
    }
    const auto rms = arg(5u) != 0u;
    auto sw = 0.0f;
    auto sb = 0.0f;
    for (auto r = 0u; r < arg(0u); r++) {
        const auto d = ld_D(r * c + j);
        auto mu = 0.0f;
        if (!rms) {
            mu = ld_MEAN(r);
        }
        sw += (ld_X(r * c + j) - mu) * ld_RSTD(r) * d;
        sb += d;
    }
    st_DP(arg(2u) + j, ld_DP(arg(2u) + j) + sw);
    if (arg(4u) != 0u) {
        st_DP(arg(3u) + j, ld_DP(arg(3u) + j) + sb);
    }
}
