// Backward of combine (tensor::moe::moe_combine_backward). mode 0, one thread per assignment
// (t, i): DG[t, i] = ⟨DY[t], EO[SLOT[t, i]]⟩, 0 if dropped. mode 1, one thread per element of
// the kept rows r < OFFSETS[E]: DEO[r, j] = G[t, i]·DY[t, j] for the assignment (t, i) row r holds.
// args: n c k e mode
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let id = flat_id(wg, lid, 256u);
    let c = arg(1u);
    let k = arg(2u);
    if (arg(4u) == 0u) {
        if (id >= arg(0u) * k) {
            return;
        }
        let row = SLOT[id];
        var s = 0.0;
        if (row != 0xffffffffu) {
            let t = id / k;
            for (var j = 0u; j < c; j++) {
                s = fma(ld_DY(t * c + j), ld_EO(row * c + j), s);
            }
        }
        st_DG(id, s);
        return;
    }
    let r = id / c;
    if (r >= OFFSETS[arg(3u)]) {
        return;
    }
    let t = ROWTOK[r];
    var g = 0.0;
    for (var i = 0u; i < k; i++) {
        if (SLOT[t * k + i] == r) {
            g = ld_G(t * k + i);
        }
    }
    st_DEO(id, g * ld_DY(t * c + id % c));
}
