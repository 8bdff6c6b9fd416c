// The router's backward, one thread per token (tensor::moe::moe_router_backward): d(probs) from
// the load-balancing coefficients AUX[E] and the gates' gradient DG (through the
// renormalisation with renormalize), then the softmax's backward plus the z-loss's
// z_coef·LSE[t]·p, into DL[t, :E].
// args: n e k renormalize z_coef
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = flat_id(wg, lid, 64u);
    if (t >= arg(0u)) {
        return;
    }
    let e = arg(1u);
    let k = arg(2u);
    let p0 = t * e;
    for (var x = 0u; x < e; x++) {
        st_DL(p0 + x, ld_AUX(x));
    }
    if (arg(3u) != 0u) {
        var ssum = 0.0;
        var gd = 0.0;
        for (var j = 0u; j < k; j++) {
            ssum += ld_P(p0 + IDX[t * k + j]);
            gd += ld_DG(t * k + j) * ld_G(t * k + j);
        }
        for (var j = 0u; j < k; j++) {
            let x = p0 + IDX[t * k + j];
            st_DL(x, ld_DL(x) + (ld_DG(t * k + j) - gd) / ssum);
        }
    } else {
        for (var j = 0u; j < k; j++) {
            let x = p0 + IDX[t * k + j];
            st_DL(x, ld_DL(x) + ld_DG(t * k + j));
        }
    }
    var pd = 0.0;
    for (var x = 0u; x < e; x++) {
        pd += ld_P(p0 + x) * ld_DL(p0 + x);
    }
    let zc = argf(4u) * ld_LSE(t);
    for (var x = 0u; x < e; x++) {
        let p = ld_P(p0 + x);
        st_DL(p0 + x, p * (ld_DL(p0 + x) - pd) + zc * p);
    }
}
