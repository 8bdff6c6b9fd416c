// LayerNorm (or RMSNorm) of one row per workgroup: OUT = (X − mean)·rstd·W (+ B); RMSNorm:
// OUT = W·(X·rstd) with rstd = 1/√(mean(X²) + eps). Saves MEAN (LayerNorm) and RSTD.
// args: rows c w_off b_off has_bias rms eps
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let row = group_id(wg);
    let lid = lid3.x;
    let c = arg(1u);
    if (row >= arg(0u)) {
        return;
    }
    let x0 = row * c;
    let rms = arg(5u) != 0u;
    var mu = 0.0;
    if (!rms) {
        var s = 0.0;
        for (var j = lid; j < c; j += 256u) {
            s += ld_X(x0 + j);
        }
        mu = wg_sum(s, lid) / f32(c);
    }
    var q = 0.0;
    for (var j = lid; j < c; j += 256u) {
        let d = ld_X(x0 + j) - mu;
        q += d * d;
    }
    var rs = 0.0;
    if (rms) {
        rs = 1.0 / sqrt(wg_sum(q, lid) / f32(c) + argf(6u));
    } else {
        rs = 1.0 / sqrt(wg_sum(q, lid) / f32(c) + 1e-5);
    }
    for (var j = lid; j < c; j += 256u) {
        let w = ld_P(arg(2u) + j);
        var o = 0.0;
        if (rms) {
            o = w * (ld_X(x0 + j) * rs);
        } else {
            o = (ld_X(x0 + j) - mu) * rs * w;
            if (arg(4u) != 0u) {
                o += ld_P(arg(3u) + j);
            }
        }
        st_OUT(x0 + j, o);
    }
    if (lid == 0u) {
        if (!rms) {
            st_MEAN(row, mu);
        }
        st_RSTD(row, rs);
    }
}
