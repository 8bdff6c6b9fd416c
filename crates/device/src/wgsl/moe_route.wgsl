// Routing, one thread per token (tensor::moe::moe_route): the softmax of the router's logits
// L[t, :E] into P, LSE[t], the top-k experts IDX[t, :K] (ties → lower id, by logit) and their
// gates G[t, :K] (renormalised over the k with renormalize).
// args: n e k renormalize
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = flat_id(wg, lid, 64u);
    if (t >= arg(0u)) {
        return;
    }
    let e = arg(1u);
    let k = arg(2u);
    let l0 = t * e;
    var mx = -3.4e38;
    for (var x = 0u; x < e; x++) {
        mx = max(mx, ld_L(l0 + x));
    }
    var sum = 0.0;
    for (var x = 0u; x < e; x++) {
        let p = exp(ld_L(l0 + x) - mx);
        st_P(l0 + x, p);
        sum += p;
    }
    let inv = 1.0 / sum;
    for (var x = 0u; x < e; x++) {
        st_P(l0 + x, ld_P(l0 + x) * inv);
    }
    st_LSE(t, mx + log(sum));
    var gsum = 0.0;
    for (var j = 0u; j < k; j++) {
        var best = 0xffffffffu;
        for (var x = 0u; x < e; x++) {
            var taken = false;
            for (var jj = 0u; jj < j; jj++) {
                taken = taken || IDX[t * k + jj] == x;
            }
            if (!taken && (best == 0xffffffffu || ld_L(l0 + x) > ld_L(l0 + best))) {
                best = x;
            }
        }
        IDX[t * k + j] = best;
        st_G(t * k + j, ld_P(l0 + best));
        gsum += ld_P(l0 + best);
    }
    if (arg(3u) != 0u) {
        for (var j = 0u; j < k; j++) {
            st_G(t * k + j, ld_G(t * k + j) / gsum);
        }
    }
}
