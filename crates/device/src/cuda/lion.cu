// Lion over n elements from off, tensor::optim::lion_update's arithmetic: with g = G·S[scale_at]
// (the clipping factor), u = β1·m + (1 − β1)·g, p = p·decay − lr·sign(u) (sign(0) = 0),
// m = β2·m + (1 − β2)·g, where S[0] = lr, S[2] = 1 − lr·wd (Gpu::set_lion_scalars) and decay is
// 1 for parameters without weight decay. The gradient of element off + e is at goff + e and its
// moment at moff + e (a ZeRO shard's).
// args: n off beta1 one_minus_beta1 beta2 one_minus_beta2 decay scale_at moff goff
extern "C" __global__ void __launch_bounds__(256) lion(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto e = flat_id(wg, lid, 256u);
    if (e >= arg(0u)) {
        return;
    }
    const auto g = clipped_grad(KP, e, 9u, 7u);
    const auto i = arg(1u) + e;
    const auto m = ld_M(arg(8u) + e);
    const auto u = m * argf(2u) + g * argf(3u);
    const auto s = u > 0.0f ? 1.0f : (u < 0.0f ? -1.0f : 0.0f);
    st_P(i, ld_P(i) * decay_factor(KP, 6u) - ld_S(0u) * s);
    st_M(arg(8u) + e, m * argf(4u) + g * argf(5u));
}
