// The parameter gradients of LayerNorm (or RMSNorm), one thread per column, rows in order:
// DP[w_off + j] += Σ_r n[r, j]·D[r, j] (n the normalised input), DP[b_off + j] += Σ_r D[r, j].
// args: rows c w_off b_off has_bias rms
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let j = flat_id(wg, lid, 64u);
    let c = arg(1u);
    if (j >= c) {
        return;
    }
    let rms = arg(5u) != 0u;
    var sw = 0.0;
    var sb = 0.0;
    for (var r = 0u; r < arg(0u); r++) {
        let d = ld_D(r * c + j);
        var mu = 0.0;
        if (!rms) {
            mu = ld_MEAN(r);
        }
        sw += (ld_X(r * c + j) - mu) * ld_RSTD(r) * d;
        sb += d;
    }
    st_DP(arg(2u) + j, ld_DP(arg(2u) + j) + sw);
    if (arg(4u) != 0u) {
        st_DP(arg(3u) + j, ld_DP(arg(3u) + j) + sb);
    }
}
