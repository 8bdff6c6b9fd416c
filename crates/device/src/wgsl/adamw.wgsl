// AdamW over n elements from off, tensor::optim's arithmetic: with g = G·S[scale_at] (the
// clipping factor), m = β1·m + (1 − β1)·g, v = β2·v + (1 − β2)·g·g,
// p = p·decay − step·m / (√v·rbc2 + ε), where S[0..3] = (step, rbc2, decay)
// (tensor::optim::adamw_scalars) and decay is 1 for parameters without weight decay.
// The gradient of element off + e is at goff + e and its moments at moff + e (a ZeRO
// shard's: ZeRO-1 holds the whole layout's gradients, ZeRO-2 and 3 their shard).
// args: n off beta1 one_minus_beta1 beta2 one_minus_beta2 eps decay scale_at moff goff
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let e = flat_id(wg, lid, 256u);
    if (e >= arg(0u)) {
        return;
    }
    let g = clipped_grad(e, 10u, 8u);
    let i = arg(1u) + e;
    let mi = arg(9u) + e;
    let m = argf(2u) * ld_M(mi) + argf(3u) * g;
    let v = argf(4u) * ld_V(mi) + argf(5u) * g * g;
    st_M(mi, m);
    st_V(mi, v);
    let denom = sqrt(v) * ld_S(1u) + argf(6u);
    st_P(i, ld_P(i) * decay_factor(7u) - ld_S(0u) * m / denom);
}
