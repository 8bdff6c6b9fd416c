// SwiGLU over fused [N, 2F] rows (gate | up): forward OUT[n, j] = silu(g)·u; backward (mode 1
// overwrite, 2 accumulate) DGU[n, j] = D·u·σ(g)(1 + g(1 − σ(g))), DGU[n, F + j] = D·silu(g).
// args: rows f mode
extern "C" __global__ void __launch_bounds__(256) swiglu(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto e = flat_id(wg, lid, 256u);
    const auto f = arg(1u);
    if (e >= arg(0u) * f) {
        return;
    }
    const auto n = e / f;
    const auto j = e % f;
    const auto gi = n * 2u * f + j;
    const auto g = ld_GU(gi);
    const auto u = ld_GU(gi + f);
    const auto s = 1.0f / (1.0f + expf(-g));
    const auto mode = arg(2u);
    if (mode == 0u) {
        st_OUT(e, g * s * u);
        return;
    }
    const auto d = ld_D(e);
    auto dg = d * u * s * (1.0f + g * (1.0f - s));
    auto du = d * g * s;
    if (mode == 2u) {
        dg += ld_OUT(gi);
        du += ld_OUT(gi + f);
    }
    st_OUT(gi, dg);
    st_OUT(gi + f, du);
}
