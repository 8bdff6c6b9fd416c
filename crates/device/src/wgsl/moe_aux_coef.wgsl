// The load-balancing loss's gradient with respect to probs[t, e], per expert:
// AUX[e] = coef·COUNTS[e], coef = aux_weight·E / (N·K·N) (one routing group: this batch).
// args: e coef
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let x = flat_id(wg, lid, 64u);
    if (x >= arg(0u)) {
        return;
    }
    st_AUX(x, argf(1u) * f32(COUNTS[x]));
}
