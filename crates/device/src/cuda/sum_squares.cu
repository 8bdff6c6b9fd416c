// Σ x² (or Σ x without squares) in two fixed-order stages: stage 0, workgroup g sums elements g·per .. (g + 1)·per of X
// from off into PART[g]; stage 1, one workgroup sums PART[0..groups] into OUT[at] (overwriting,
// or adding with accumulate).
// args: n off per stage at accumulate squares
extern "C" __global__ void __launch_bounds__(256) sum_squares(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid3 = threadIdx;
    const auto lid = lid3.x;
    const auto g = group_id(wg);
    const auto n = arg(0u);
    auto s = 0.0f;
    if (arg(3u) == 0u) {
        const auto lo = g * arg(2u);
        const auto hi = min(lo + arg(2u), n);
        for (auto i = lo + lid; i < hi; i += 256u) {
            const auto x = ld_X(arg(1u) + i);
            s = kiln_select(s + x, fmaf(x, x, s), arg(6u) != 0u);
        }
        const auto total = wg_sum(KP, s, lid);
        if (lid == 0u) {
            st_PART(g, total);
        }
        return;
    }
    for (auto i = lid; i < n; i += 256u) {
        s += ld_PART(i);
    }
    const auto total = wg_sum(KP, s, lid);
    if (lid == 0u) {
        auto v = total;
        if (arg(5u) != 0u) {
            v += ld_OUT(arg(4u));
        }
        st_OUT(arg(4u), v);
    }
}
