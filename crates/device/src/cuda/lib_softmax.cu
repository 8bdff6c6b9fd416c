// The largest of the logits L[base .. base + v] and Σ exp(L[j] − largest) over them, across the
// workgroup (every thread gets both).
__device__ float2 row_max_sum(const KilnParams& KP, uint base, uint v, uint lid) {
    auto mx = -3.4e38f;
    for (auto j = lid; j < v; j += 256u) {
        mx = max(mx, ld_L(base + j));
    }
    const auto m = wg_max(KP, mx, lid);
    auto s = 0.0f;
    for (auto j = lid; j < v; j += 256u) {
        s += expf(ld_L(base + j) - m);
    }
    return make_float2(m, wg_sum(KP, s, lid));
}
