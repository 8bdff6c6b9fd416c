// Lion over n elements from off, tensor::optim::lion_update's arithmetic: with g = G·S[scale_at]
// (the clipping factor), u = β1·m + (1 − β1)·g, p = p·decay − lr·sign(u) (sign(0) = 0),
// m = β2·m + (1 − β2)·g, where S[0] = lr, S[2] = 1 − lr·wd (Gpu::set_lion_scalars) and decay is
// 1 for parameters without weight decay. The gradient of element off + e is at goff + e and its
// moment at moff + e (a ZeRO shard's).
// args: n off beta1 one_minus_beta1 beta2 one_minus_beta2 decay scale_at moff goff
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let e = flat_id(wg, lid, 256u);
    if (e >= arg(0u)) {
        return;
    }
    let g = clipped_grad(e, 9u, 7u);
    let i = arg(1u) + e;
    let m = ld_M(arg(8u) + e);
    let u = m * argf(2u) + g * argf(3u);
    st_P(i, ld_P(i) * decay_factor(6u) - ld_S(0u) * sign(u));
    st_M(arg(8u) + e, m * argf(4u) + g * argf(5u));
}
