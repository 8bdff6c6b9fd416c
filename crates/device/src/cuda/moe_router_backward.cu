// The router's backward, one thread per token (tensor::moe::moe_router_backward): d(probs) from
// the load-balancing coefficients AUX[E] and the gates' gradient DG (through the
// renormalisation with renormalize), then the softmax's backward plus the z-loss's
// z_coef·LSE[t]·p, into DL[t, :E].
// args: n e k renormalize z_coef
extern "C" __global__ void __launch_bounds__(64) moe_router_backward(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto t = flat_id(wg, lid, 64u);
    if (t >= arg(0u)) {
        return;
    }
    const auto e = arg(1u);
    const auto k = arg(2u);
    const auto p0 = t * e;
    for (auto x = 0u; x < e; x++) {
        st_DL(p0 + x, ld_AUX(x));
    }
    if (arg(3u) != 0u) {
        auto ssum = 0.0f;
        auto gd = 0.0f;
        for (auto j = 0u; j < k; j++) {
            ssum += ld_P(p0 + IDX[t * k + j]);
            gd += ld_DG(t * k + j) * ld_G(t * k + j);
        }
        for (auto j = 0u; j < k; j++) {
            const auto x = p0 + IDX[t * k + j];
            st_DL(x, ld_DL(x) + (ld_DG(t * k + j) - gd) / ssum);
        }
    } else {
        for (auto j = 0u; j < k; j++) {
            const auto x = p0 + IDX[t * k + j];
            st_DL(x, ld_DL(x) + ld_DG(t * k + j));
        }
    }
    auto pd = 0.0f;
    for (auto x = 0u; x < e; x++) {
        pd += ld_P(p0 + x) * ld_DL(p0 + x);
    }
    const auto zc = argf(4u) * ld_LSE(t);
    for (auto x = 0u; x < e; x++) {
        const auto p = ld_P(p0 + x);
        st_DL(p0 + x, p * (ld_DL(p0 + x) - pd) + zc * p);
    }
}
