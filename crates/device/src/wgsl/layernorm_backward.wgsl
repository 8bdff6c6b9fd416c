// The input gradient of LayerNorm (or RMSNorm), one row per workgroup, accumulated:
// LayerNorm: DX += (W·D − mean(W·D) − n·mean(W·D·n))·rstd, n = (X − mean)·rstd;
// RMSNorm:   DX += rstd·(W·D − X·rstd·m), m = Σ(W·D·X)·rstd / C.
// args: rows c w_off rms
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let row = group_id(wg);
    let lid = lid3.x;
    let c = arg(1u);
    if (row >= arg(0u)) {
        return;
    }
    let x0 = row * c;
    let w0 = arg(2u);
    let rs = ld_RSTD(row);
    if (arg(3u) != 0u) {
        var s = 0.0;
        for (var j = lid; j < c; j += 256u) {
            s += ld_P(w0 + j) * ld_D(x0 + j) * ld_X(x0 + j);
        }
        let m = wg_sum(s, lid) * rs / f32(c);
        for (var j = lid; j < c; j += 256u) {
            let x = ld_X(x0 + j);
            st_DX(x0 + j, ld_DX(x0 + j) + rs * (ld_P(w0 + j) * ld_D(x0 + j) - x * rs * m));
        }
        return;
    }
    let mu = ld_MEAN(row);
    var a = 0.0;
    var b = 0.0;
    for (var j = lid; j < c; j += 256u) {
        let wd = ld_P(w0 + j) * ld_D(x0 + j);
        a += wd;
        b += wd * (ld_X(x0 + j) - mu) * rs;
    }
    let dnorm_mean = wg_sum(a, lid) / f32(c);
    let dnorm_norm_mean = wg_sum(b, lid) / f32(c);
    for (var j = lid; j < c; j += 256u) {
        let norm = (ld_X(x0 + j) - mu) * rs;
        let g = (ld_P(w0 + j) * ld_D(x0 + j) - dnorm_mean - norm * dnorm_norm_mean) * rs;
        st_DX(x0 + j, ld_DX(x0 + j) + g);
    }
}
