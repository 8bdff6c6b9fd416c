// Embedding gradients, accumulated, each element's sum in token order (the CPU's order).
// mode 0 (token table of vocabulary rows lo .. hi): one thread per column j,
// DP[wte + (TOK[i] − lo)·C + j] += D[i, j] for the tokens i in the rows, in order;
// mode 1 (position table): one thread per (p, j), DP[wpe + p·C + j] += Σ_b D[b·T + p, j], or
// with has_pos the sum over the tokens i with POS[i] = p, in token order (the CPU's).
// args: n c t off mode has_pos rows lo hi
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let e = flat_id(wg, lid, 64u);
    let n = arg(0u);
    let c = arg(1u);
    let t = arg(2u);
    let off = arg(3u);
    if (arg(4u) == 0u) {
        if (e >= c) {
            return;
        }
        for (var i = 0u; i < n; i++) {
            let tok = TOK[i];
            if (tok >= arg(7u) && tok < arg(8u)) {
                let at = off + (tok - arg(7u)) * c + e;
                st_DP(at, ld_DP(at) + ld_D(i * c + e));
            }
        }
        return;
    }
    if (e >= arg(6u) * c) {
        return;
    }
    let p = e / c;
    let j = e % c;
    var s = ld_DP(off + e);
    if (arg(5u) != 0u) {
        for (var i = 0u; i < n; i++) {
            if (POS[i] == p) {
                s += ld_D(i * c + j);
            }
        }
    } else {
        for (var i = p; i < n; i += t) {
            s += ld_D(i * c + j);
        }
    }
    st_DP(off + e, s);
}
