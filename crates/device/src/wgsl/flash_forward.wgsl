// FlashAttention-2 forward, causal, grouped-query, with a sliding window and packed documents:
// one workgroup per (b·NH + h, 64 queries), one thread per query; keys and values pass through
// workgroup memory TILE at a time with an online softmax, so no T×T matrix exists.
// OUT[b, i, h·HS..] = Σ_j drop(softmax_j)·v_j; LSE[b·NH + h, i] = ln Σ_j exp(s_ij).

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let hd = head_of(wg.y);
    let t = hd.t;
    let hs = hd.hs;
    let w = hd.w;
    let bh = wg.y;
    let b = hd.b;
    let h = hd.h;
    let lid = lid3.x;
    let i0 = wg.x * 64u;
    let i = i0 + lid;
    let live = i < t;
    let scale = argf(14u);
    var q: array<f32, 128>;
    var acc: array<f32, 128>;
    var first = 0u;
    if (live) {
        for (var d = 0u; d < hs; d++) {
            q[d] = ld_QKV((b * t + i) * w + h * hs + d);
            acc[d] = 0.0;
        }
        first = first_key(b, i);
    }
    // The workgroup's key range: from its first query's window to its last query.
    let k_lo = window_start(i0);
    let k_hi = min(i0 + 64u, t);
    var m = NONE;
    var l = 0.0;
    for (var k0 = k_lo; k0 < k_hi; k0 += TILE) {
        load_kv(hd, k0, lid);
        workgroupBarrier();
        if (live) {
            var s: array<f32, 16>;
            var tmax = m;
            for (var kk = 0u; kk < TILE; kk++) {
                let j = k0 + kk;
                s[kk] = NONE;
                if (j >= first && j <= i) {
                    var dot = 0.0;
                    for (var d = 0u; d < hs; d++) {
                        dot = fma(q[d], Ta[kk * MAX_HS + d], dot);
                    }
                    s[kk] = dot * scale;
                    tmax = max(tmax, s[kk]);
                }
            }
            if (tmax > NONE) {
                let corr = exp(m - tmax);
                l *= corr;
                for (var d = 0u; d < hs; d++) {
                    acc[d] *= corr;
                }
                for (var kk = 0u; kk < TILE; kk++) {
                    if (s[kk] > NONE) {
                        let p = exp(s[kk] - tmax);
                        l += p;
                        let pz = p * drop_factor(b, h, i, k0 + kk);
                        for (var d = 0u; d < hs; d++) {
                            acc[d] = fma(pz, Tb[kk * MAX_HS + d], acc[d]);
                        }
                    }
                }
                m = tmax;
            }
        }
        workgroupBarrier();
    }
    if (live) {
        let c = hd.nh * hs;
        for (var d = 0u; d < hs; d++) {
            st_OUT((b * t + i) * c + h * hs + d, acc[d] / l);
        }
        st_LSE(bh * t + i, m + log(l));
    }
}
