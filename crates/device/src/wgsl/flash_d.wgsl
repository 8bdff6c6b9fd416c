// FlashAttention-2's D[b·NH + h, i] = dO_i · O_i, one thread per (b, h, i).
// args: b t nh hs
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let e = flat_id(wg, lid, 64u);
    let t = arg(1u);
    let nh = arg(2u);
    let hs = arg(3u);
    if (e >= arg(0u) * nh * t) {
        return;
    }
    let i = e % t;
    let bh = e / t;
    let o = ((bh / nh) * t + i) * nh * hs + (bh % nh) * hs;
    var s = 0.0;
    for (var d = 0u; d < hs; d++) {
        s = fma(ld_DY(o + d), ld_Y(o + d), s);
    }
    st_DD(e, s);
}
