// FlashAttention-2 backward over a block (lib_attn.wgsl), the key and value gradients: one
// thread per key (b, g, j) of kv head g; the group's query heads in ascending order, queries
// TILE at a time through workgroup memory. DKV[v_j] += Σ_i z·p·dO_i, DKV[k_j] += scale·Σ_i
// ds·q_i (as flash_backward_dq; DKV laid out as KV).
var<workgroup> Ls: array<f32, 16>;
var<workgroup> Ds: array<f32, 16>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let nh = arg(2u);
    let nkv = arg(3u);
    let hs = arg(4u);
    let w = attn_w();
    let q_len = arg(18u);
    let q_pos0 = arg(19u);
    let kw = arg(24u);
    let bg = wg.y;
    let b = bg / nkv;
    let g = bg % nkv;
    let group = nh / nkv;
    let lid = lid3.x;
    let j0 = wg.x * 64u;
    let j = j0 + lid;
    let live = j < arg(22u);
    let kp = arg(23u) + j;
    let scale = argf(14u);
    let kat = k_row(b, j) * kw + arg(25u) + g * hs;
    let vat = k_row(b, j) * kw + arg(26u) + g * hs;
    var k: array<f32, 128>;
    var v: array<f32, 128>;
    var dk: array<f32, 128>;
    var dv: array<f32, 128>;
    if (live) {
        for (var d = 0u; d < hs; d++) {
            k[d] = ld_KV(kat + d);
            v[d] = ld_KV(vat + d);
            dk[d] = 0.0;
            dv[d] = 0.0;
        }
    }
    let qr = query_range(j0);
    for (var hh = 0u; hh < group; hh++) {
        let h = g * group + hh;
        let bh = b * nh + h;
        for (var i0 = qr.x; i0 < qr.y; i0 += TILE) {
            for (var e = lid; e < TILE * hs; e += 64u) {
                let ii = e / hs;
                let d = e % hs;
                let i = i0 + ii;
                if (i < q_len) {
                    Ta[ii * MAX_HS + d] = ld_QKV(q_row(b, i) * w + h * hs + d);
                    Tb[ii * MAX_HS + d] = ld_DY(q_row(b, i) * nh * hs + h * hs + d);
                }
            }
            if (lid < TILE && i0 + lid < q_len) {
                let at = bh * arg(16u) + arg(17u) + i0 + lid;
                Ls[lid] = ld_LSE(at);
                Ds[lid] = ld_DD(at);
            }
            workgroupBarrier();
            if (live) {
                for (var ii = 0u; ii < TILE; ii++) {
                    let i = i0 + ii;
                    let pos = q_pos0 + i;
                    if (i < qr.y && kp <= pos && first_key(b, i) <= kp) {
                        var s = 0.0;
                        var dp = 0.0;
                        for (var d = 0u; d < hs; d++) {
                            s = fma(Ta[ii * MAX_HS + d], k[d], s);
                            dp = fma(Tb[ii * MAX_HS + d], v[d], dp);
                        }
                        let p = exp(s * scale - Ls[ii]);
                        let z = drop_factor(b, h, pos, kp);
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
            st_DKV(kat + d, ld_DKV(kat + d) + dk[d]);
            st_DKV(vat + d, ld_DKV(vat + d) + dv[d]);
        }
    }
}
