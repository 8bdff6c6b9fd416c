// Rotary embedding in place over qkv rows [N, W], W = (NH + 2·NKV)·HS: the first ROT dims of
// each q and k head turned by its token's position (HF's rotate_half pairs (i, i + ROT/2));
// inverse = the transposed rotation (backward). Positions: offset + (row mod T), or POS[row].
// args: rows nqk hs rot t offset has_pos inverse w
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let e = flat_id(wg, lid, 256u);
    let nqk = arg(1u);
    let hs = arg(2u);
    let half = arg(3u) / 2u;
    if (e >= arg(0u) * nqk * half) {
        return;
    }
    let i = e % half;
    let head = (e / half) % nqk;
    let row = e / (half * nqk);
    var pos = arg(5u) + row % arg(4u);
    if (arg(6u) != 0u) {
        pos = POS[row];
    }
    let base = row * arg(8u) + head * hs;
    let c = ld_COS(pos * half + i);
    let s = ld_SIN(pos * half + i);
    let a = ld_X(base + i);
    let b = ld_X(base + half + i);
    if (arg(7u) != 0u) {
        st_X(base + i, a * c + b * s);
        st_X(base + half + i, b * c - a * s);
    } else {
        st_X(base + i, a * c - b * s);
        st_X(base + half + i, b * c + a * s);
    }
}
