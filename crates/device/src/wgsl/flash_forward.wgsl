// FlashAttention-2 forward over a block (lib_attn.wgsl), causal by global position,
// grouped-query, with a sliding window and packed documents: one workgroup per (b·NH + h, 64
// queries), one thread per query; keys and values pass through workgroup memory TILE at a time
// with an online softmax, so no T×T matrix exists. OUT[b, i, h·HS..] = Σ_j drop(softmax_j)·v_j;
// LSE[b·NH + h, i] = ln Σ_j exp(s_ij). Unless `fresh`, the softmax continues from OUT and LSE
// (an earlier block's), as a ring of context-parallel blocks merges them.

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let hd = head_of(wg.y);
    let hs = hd.hs;
    let w = hd.w;
    let bh = wg.y;
    let b = hd.b;
    let h = hd.h;
    let lid = lid3.x;
    let q_len = arg(18u);
    let i0 = wg.x * 64u;
    let i = i0 + lid;
    let live = i < q_len;
    let pos = arg(19u) + i;
    let k_pos0 = arg(23u);
    let scale = argf(14u);
    let c = hd.nh * hs;
    let lse_at = bh * arg(16u) + arg(17u) + i;
    var q: array<f32, 128>;
    var acc: array<f32, 128>;
    var first = 0u;
    var m = NONE;
    var l = 0.0;
    if (live) {
        let fresh = arg(27u) != 0u;
        for (var d = 0u; d < hs; d++) {
            q[d] = ld_QKV(q_row(b, i) * w + h * hs + d);
            acc[d] = 0.0;
            if (!fresh) {
                acc[d] = ld_OUT(q_row(b, i) * c + h * hs + d);
            }
        }
        if (!fresh) {
            m = ld_LSE(lse_at);
            l = 1.0;
        }
        first = first_key(b, i);
    }
    let kr = key_range(i0, min(i0 + 64u, q_len));
    for (var k0 = kr.x; k0 < kr.y; k0 += TILE) {
        load_kv(hd, k0, lid);
        workgroupBarrier();
        if (live) {
            var s: array<f32, 16>;
            var tmax = m;
            for (var kk = 0u; kk < TILE; kk++) {
                let kp = k_pos0 + k0 + kk;
                s[kk] = NONE;
                if (k0 + kk < kr.y && kp >= first && kp <= pos) {
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
                        let pz = p * drop_factor(b, h, pos, k_pos0 + k0 + kk);
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
        for (var d = 0u; d < hs; d++) {
            st_OUT(q_row(b, i) * c + h * hs + d, acc[d] / l);
        }
        st_LSE(lse_at, m + log(l));
    }
}
