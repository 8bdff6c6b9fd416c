// Combine (tensor::moe::moe_combine): Y[t, j] (= or +=) Σ_i G[t, i]·EO[SLOT[t, i], j] over the
// kept assignments in rank order, one thread per element.
// args: n c k accumulate
extern "C" __global__ void __launch_bounds__(256) moe_combine(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto id = flat_id(wg, lid, 256u);
    const auto c = arg(1u);
    if (id >= arg(0u) * c) {
        return;
    }
    const auto t = id / c;
    const auto j = id % c;
    const auto k = arg(2u);
    auto y = 0.0f;
    if (arg(3u) != 0u) {
        y = ld_Y(id);
    }
    for (auto i = 0u; i < k; i++) {
        const auto row = SLOT[t * k + i];
        if (row != 0xffffffffu) {
            y += ld_G(t * k + i) * ld_EO(row * c + j);
        }
    }
    st_Y(id, y);
}
