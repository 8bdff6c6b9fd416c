// The load-balancing loss's gradient with respect to probs[t, e], per expert:
// AUX[e] = coef·COUNTS[e], coef = aux_weight·E / (N·K·N) (one routing group: this batch).
// args: e coef
extern "C" __global__ void __launch_bounds__(64) moe_aux_coef(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto x = flat_id(wg, lid, 64u);
    if (x >= arg(0u)) {
        return;
    }
    st_AUX(x, argf(1u) * float(COUNTS[x]));
}
