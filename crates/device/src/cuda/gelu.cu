// GELU, tanh form, as x·σ(2u) = x / (1 + e^{−2u}), u = √(2/π)(x + 0.044715x³).
// mode 0: OUT = GELU(X); 1: OUT = GELU'(X)·D; 2: OUT += GELU'(X)·D.
// args: n mode
#define K ((float)(0.7978846f))

extern "C" __global__ void __launch_bounds__(256) gelu(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto i = flat_id(wg, lid, 256u);
    if (i >= arg(0u)) {
        return;
    }
    const auto x = ld_X(i);
    const auto e = expf(x * fmaf(x * x, -2.0f * K * 0.044715f, -2.0f * K));
    const auto mode = arg(1u);
    if (mode == 0u) {
        st_OUT(i, x / (1.0f + e));
        return;
    }
    const auto s = 1.0f / (1.0f + e);
    const auto du2 = fmaf(x * x, 2.0f * K * 3.0f * 0.044715f, 2.0f * K);
    auto g = fmaf(x * (s - s * s), du2, s) * ld_D(i);
    if (mode == 2u) {
        g += ld_OUT(i);
    }
    st_OUT(i, g);
}
