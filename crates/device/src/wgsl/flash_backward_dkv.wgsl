// FlashAttention-2 backward, the key and value gradients: one thread per key (b, g, j) of kv
// head g; the group's query heads in ascending order, queries TILE at a time through workgroup
// memory. DQKV[v_j] += Σ_i z·p·dO_i, DQKV[k_j] += scale·Σ_i ds·q_i (as flash_backward_dq).
var<workgroup> Ls: array<f32, 16>;
var<workgroup> Ds: array<f32, 16>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let t = arg(1u);
    let nh = arg(2u);
    let nkv = arg(3u);
    let hs = arg(4u);
    let window = arg(5u);
    let w = attn_w();
    let bg = wg.y;
    let b = bg / nkv;
    let g = bg % nkv;
    let group = nh / nkv;
    let lid = lid3.x;
    let j0 = wg.x * 64u;
    let j = j0 + lid;
    let live = j < t;
    let scale = argf(14u);
    var k: array<f32, 128>;
    var v: array<f32, 128>;
    var dk: array<f32, 128>;
    var dv: array<f32, 128>;
    if (live) {
        for (var d = 0u; d < hs; d++) {
            k[d] = ld_QKV((b * t + j) * w + (nh + g) * hs + d);
            v[d] = ld_QKV((b * t + j) * w + (nh + nkv + g) * hs + d);
            dk[d] = 0.0;
            dv[d] = 0.0;
        }
    }
    // The queries that can see the workgroup's keys: from its first key to, under a window,
    // its last key's window.
    var q_hi = t;
    if (window != 0u) {
        q_hi = min(t, j0 + 63u + window);
    }
    for (var hh = 0u; hh < group; hh++) {
        let h = g * group + hh;
        let bh = b * nh + h;
        for (var i0 = j0; i0 < q_hi; i0 += TILE) {
            for (var e = lid; e < TILE * hs; e += 64u) {
                let ii = e / hs;
                let d = e % hs;
                let i = i0 + ii;
                if (i < t) {
                    Ta[ii * MAX_HS + d] = ld_QKV((b * t + i) * w + h * hs + d);
                    Tb[ii * MAX_HS + d] = ld_DY((b * t + i) * nh * hs + h * hs + d);
                }
            }
            if (lid < TILE && i0 + lid < t) {
                Ls[lid] = ld_LSE(bh * t + i0 + lid);
                Ds[lid] = ld_DD(bh * t + i0 + lid);
            }
            workgroupBarrier();
            if (live) {
                for (var ii = 0u; ii < TILE; ii++) {
                    let i = i0 + ii;
                    if (i < t && j <= i && first_key(b, i) <= j) {
                        var s = 0.0;
                        var dp = 0.0;
                        for (var d = 0u; d < hs; d++) {
                            s = fma(Ta[ii * MAX_HS + d], k[d], s);
                            dp = fma(Tb[ii * MAX_HS + d], v[d], dp);
                        }
                        let p = exp(s * scale - Ls[ii]);
                        let z = drop_factor(b, h, i, j);
                        let ds = p * (z * dp - Ds[ii]) * scale;
                        for (var d = 0u; d < hs; d++) {
                            dv[d] = fma(p * z, Tb[ii * MAX_HS + d], dv[d]);
                            dk[d] = fma(ds, Ta[ii * MAX_HS + d], dk[d]);
                        }
                    }
                }
            }
            workgroupBarrier();
        }
    }
    if (live) {
        for (var d = 0u; d < hs; d++) {
            let kat = (b * t + j) * w + (nh + g) * hs + d;
            let vat = (b * t + j) * w + (nh + nkv + g) * hs + d;
            st_DQKV(kat, ld_DQKV(kat) + dk[d]);
            st_DQKV(vat, ld_DQKV(vat) + dv[d]);
        }
    }
}
