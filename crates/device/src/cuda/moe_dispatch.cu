// Dispatch and its backward. mode 0 (dispatch): XE[r, j] = X[ROWTOK[r], j] for the kept rows
// r < OFFSETS[E]; mode 1 (backward): DX[t, j] += Σ_i DXE[SLOT[t, i], j] over the kept
// assignments, in rank order. Buffers: A = XE or DX (written), B = X or DXE.
// args: rows c k e mode
extern "C" __global__ void __launch_bounds__(256) moe_dispatch(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto id = flat_id(wg, lid, 256u);
    const auto c = arg(1u);
    if (id >= arg(0u) * c) {
        return;
    }
    const auto r = id / c;
    const auto j = id % c;
    if (arg(4u) == 0u) {
        if (r < OFFSETS[arg(3u)]) {
            st_A(id, ld_B(ROWTOK[r] * c + j));
        }
        return;
    }
    const auto k = arg(2u);
    auto s = ld_A(id);
    for (auto i = 0u; i < k; i++) {
        const auto row = SLOT[r * k + i];
        if (row != 0xffffffffu) {
            s += ld_B(row * c + j);
        }
    }
    st_A(id, s);
}
