// Backward of combine (tensor::moe::moe_combine_backward). mode 0, one thread per assignment
// (t, i): DG[t, i] = ⟨DY[t], EO[SLOT[t, i]]⟩, 0 if dropped. mode 1, one thread per element of
// the kept rows r < OFFSETS[E]: DEO[r, j] = G[t, i]·DY[t, j] for the assignment (t, i) row r holds.
// args: n c k e mode
extern "C" __global__ void __launch_bounds__(256) moe_combine_backward(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto id = flat_id(wg, lid, 256u);
    const auto c = arg(1u);
    const auto k = arg(2u);
    if (arg(4u) == 0u) {
        if (id >= arg(0u) * k) {
            return;
        }
        const auto row = SLOT[id];
        auto s = 0.0f;
        if (row != 0xffffffffu) {
            const auto t = id / k;
            for (auto j = 0u; j < c; j++) {
                s = fmaf(ld_DY(t * c + j), ld_EO(row * c + j), s);
            }
        }
        st_DG(id, s);
        return;
    }
    const auto r = id / c;
    if (r >= OFFSETS[arg(3u)]) {
        return;
    }
    const auto t = ROWTOK[r];
    auto g = 0.0f;
    for (auto i = 0u; i < k; i++) {
        if (SLOT[t * k + i] == r) {
            g = ld_G(t * k + i);
        }
    }
    st_DEO(id, g * ld_DY(t * c + id % c));
}
