// AdamW over n elements from off, tensor::optim's arithmetic: with g = G·S[scale_at] (the
// clipping factor), m = β1·m + (1 − β1)·g, v = β2·v + (1 − β2)·g·g,
// p = p·decay − step·m / (√v·rbc2 + ε), where S[0..3] = (step, rbc2, decay)
// (tensor::optim::adamw_scalars) and decay is 1 for parameters without weight decay.
// The gradient of element off + e is at goff + e and its moments at moff + e (a ZeRO
// shard's: ZeRO-1 holds the whole layout's gradients, ZeRO-2 and 3 their shard).
// args: n off beta1 one_minus_beta1 beta2 one_minus_beta2 eps decay scale_at moff goff
extern "C" __global__ void __launch_bounds__(256) adamw(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto e = flat_id(wg, lid, 256u);
    if (e >= arg(0u)) {
        return;
    }
    const auto g = clipped_grad(KP, e, 10u, 8u);
    const auto i = arg(1u) + e;
    const auto mi = arg(9u) + e;
    const auto m = argf(2u) * ld_M(mi) + argf(3u) * g;
    const auto v = argf(4u) * ld_V(mi) + argf(5u) * g * g;
    st_M(mi, m);
    st_V(mi, v);
    const auto denom = sqrtf(v) * ld_S(1u) + argf(6u);
    st_P(i, ld_P(i) * decay_factor(KP, 7u) - ld_S(0u) * m / denom);
}
