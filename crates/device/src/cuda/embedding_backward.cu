// Embedding gradients, accumulated, each element's sum in token order (the CPU's order).
// mode 0 (token table of vocabulary rows lo .. hi): one thread per column j,
// DP[wte + (TOK[i] − lo)·C + j] += D[i, j] for the tokens i in the rows, in order;
// mode 1 (position table): one thread per (p, j), DP[wpe + p·C + j] += Σ_b D[b·T + p, j], or
// with has_pos the sum over the tokens i with POS[i] = p, in token order (the CPU's).
// args: n c t off mode has_pos rows lo hi
extern "C" __global__ void __launch_bounds__(64) embedding_backward(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto e = flat_id(wg, lid, 64u);
    const auto n = arg(0u);
    const auto c = arg(1u);
    const auto t = arg(2u);
    const auto off = arg(3u);
    if (arg(4u) == 0u) {
        if (e >= c) {
            return;
        }
        for (auto i = 0u; i < n; i++) {
            const auto tok = TOK[i];
            if (tok >= arg(7u) && tok < arg(8u)) {
                const auto at = off + (tok - arg(7u)) * c + e;
                st_DP(at, ld_DP(at) + ld_D(i * c + e));
            }
        }
        return;
    }
    if (e >= arg(6u) * c) {
        return;
    }
    const auto p = e / c;
    const auto j = e % c;
    auto s = ld_DP(off + e);
    if (arg(5u) != 0u) {
        for (auto i = 0u; i < n; i++) {
            if (POS[i] == p) {
                s += ld_D(i * c + j);
            }
        }
    } else {
        for (auto i = p; i < n; i += t) {
            s += ld_D(i * c + j);
        }
    }
    st_DP(off + e, s);
}
