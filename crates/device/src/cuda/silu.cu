// SiLU, x·σ(x). mode 0: OUT = silu(X); 1: OUT = silu'(X)·D; 2: OUT += silu'(X)·D.
// args: n mode
extern "C" __global__ void __launch_bounds__(256) silu(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto i = flat_id(wg, lid, 256u);
    if (i >= arg(0u)) {
        return;
    }
    const auto x = ld_X(i);
    const auto s = 1.0f / (1.0f + expf(-x));
    const auto mode = arg(1u);
    if (mode == 0u) {
        st_OUT(i, x * s);
        return;
    }
    auto g = ld_D(i) * s * (1.0f + x * (1.0f - s));
    if (mode == 2u) {
        g += ld_OUT(i);
    }
    st_OUT(i, g);
}
