// FlashAttention-2 backward over a block (lib_attn.wgsl), the query gradient: one thread per
// query (b, h, i), keys and values TILE at a time through workgroup memory. With
// p = exp(s − lse_i), dp = dO_i·v_j and z the dropout factor: ds = p·(z·dp − D_i),
// DQ[q_i] += scale·Σ_j ds·k_j (DQ laid out as QKV).

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
    var q: array<f32, 128>;
    var dy: array<f32, 128>;
    var dq: array<f32, 128>;
    var first = 0u;
    var lse = 0.0;
    var dd = 0.0;
    if (live) {
        for (var d = 0u; d < hs; d++) {
            q[d] = ld_QKV(q_row(b, i) * w + h * hs + d);
            dy[d] = ld_DY(q_row(b, i) * hd.nh * hs + h * hs + d);
            dq[d] = 0.0;
        }
        first = first_key(b, i);
        let at = bh * arg(16u) + arg(17u) + i;
        lse = ld_LSE(at);
        dd = ld_DD(at);
    }
    let kr = key_range(i0, min(i0 + 64u, q_len));
    for (var k0 = kr.x; k0 < kr.y; k0 += TILE) {
        load_kv(hd, k0, lid);
        workgroupBarrier();
        if (live) {
            for (var kk = 0u; kk < TILE; kk++) {
                let kp = k_pos0 + k0 + kk;
                if (k0 + kk < kr.y && kp >= first && kp <= pos) {
                    var s = 0.0;
                    var dp = 0.0;
                    for (var d = 0u; d < hs; d++) {
                        s = fma(q[d], Ta[kk * MAX_HS + d], s);
                        dp = fma(dy[d], Tb[kk * MAX_HS + d], dp);
                    }
                    let p = exp(s * scale - lse);
                    let ds = p * (drop_factor(b, h, pos, kp) * dp - dd) * scale;
                    for (var d = 0u; d < hs; d++) {
                        dq[d] = fma(ds, Ta[kk * MAX_HS + d], dq[d]);
                    }
                }
            }
        }
        workgroupBarrier();
    }
    if (live) {
        for (var d = 0u; d < hs; d++) {
            let at = q_row(b, i) * w + h * hs + d;
            st_DQ(at, ld_DQ(at) + dq[d]);
        }
    }
}
