// OUT[i, j] = P[wte + (TOK[i] − lo)·C + j] (+ P[wpe + pos·C + j], pos = POS[i] with has_pos,
// else i mod T): the token and position tables are views of one parameter buffer. The table
// holds vocabulary rows lo .. hi (a vocabulary-parallel shard's); another token gets 0.
// args: n c t wte_off wpe_off has_wpe has_pos lo hi
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let e = flat_id(wg, lid, 256u);
    let c = arg(1u);
    if (e >= arg(0u) * c) {
        return;
    }
    let i = e / c;
    let j = e % c;
    let tok = TOK[i];
    if (tok < arg(7u) || tok >= arg(8u)) {
        st_OUT(e, 0.0);
        return;
    }
    var v = ld_P(arg(3u) + (tok - arg(7u)) * c + j);
    if (arg(5u) != 0u) {
        var pos = i % arg(2u);
        if (arg(6u) != 0u) {
            pos = POS[i];
        }
        v += ld_P(arg(4u) + pos * c + j);
    }
    st_OUT(e, v);
}
