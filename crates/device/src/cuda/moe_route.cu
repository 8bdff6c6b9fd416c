// Routing, one thread per token (tensor::moe::moe_route): the softmax of the router's logits
// L[t, :E] into P, LSE[t], the top-k experts IDX[t, :K] (ties → lower id, by logit) and their
// gates G[t, :K] (renormalised over the k with renormalize).
// args: n e k renormalize
extern "C" __global__ void __launch_bounds__(64) moe_route(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto t = flat_id(wg, lid, 64u);
    if (t >= arg(0u)) {
        return;
    }
    const auto e = arg(1u);
    const auto k = arg(2u);
    const auto l0 = t * e;
    auto mx = -3.4e38f;
    for (auto x = 0u; x < e; x++) {
        mx = max(mx, ld_L(l0 + x));
    }
    auto sum = 0.0f;
    for (auto x = 0u; x < e; x++) {
        const auto p = expf(ld_L(l0 + x) - mx);
        st_P(l0 + x, p);
        sum += p;
    }
    const auto inv = 1.0f / sum;
    for (auto x = 0u; x < e; x++) {
        st_P(l0 + x, ld_P(l0 + x) * inv);
    }
    st_LSE(t, mx + logf(sum));
    auto gsum = 0.0f;
    for (auto j = 0u; j < k; j++) {
        auto best = 0xffffffffu;
        for (auto x = 0u; x < e; x++) {
            auto taken = false;
            for (auto jj = 0u; jj < j; jj++) {
                taken = taken || IDX[t * k + jj] == x;
            }
            if (!taken && (best == 0xffffffffu || ld_L(l0 + x) > ld_L(l0 + best))) {
                best = x;
            }
        }
        IDX[t * k + j] = best;
        st_G(t * k + j, ld_P(l0 + best));
        gsum += ld_P(l0 + best);
    }
    if (arg(3u) != 0u) {
        for (auto j = 0u; j < k; j++) {
            st_G(t * k + j, ld_G(t * k + j) / gsum);
        }
    }
}
