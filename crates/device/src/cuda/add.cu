// mode 0: OUT = A + B; mode 1: OUT += A.
// args: n mode
extern "C" __global__ void __launch_bounds__(256) add(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto i = flat_id(wg, lid, 256u);
    if (i >= arg(0u)) {
        return;
    }
    if (arg(1u) == 0u) {
        st_OUT(i, ld_A(i) + ld_B(i));
    } else {
        st_OUT(i, ld_OUT(i) + ld_A(i));
    }
}
