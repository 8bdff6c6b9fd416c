// DB[off + j] += Σ_i DOUT[i, j], rows in order: one thread per column.
// args: rows cols off
extern "C" __global__ void __launch_bounds__(64) bias_backward(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto j = flat_id(wg, lid, 64u);
    const auto rows = arg(0u);
    const auto cols = arg(1u);
    if (j >= cols) {
        return;
    }
    auto s = 0.0f;
    for (auto i = 0u; i < rows; i++) {
        s += ld_DOUT(i * cols + j);
    }
    st_DB(arg(2u) + j, ld_DB(arg(2u) + j) + s);
}
