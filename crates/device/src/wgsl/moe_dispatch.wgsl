// Dispatch and its backward. mode 0 (dispatch): XE[r, j] = X[ROWTOK[r], j] for the kept rows
// r < OFFSETS[E]; mode 1 (backward): DX[t, j] += Σ_i DXE[SLOT[t, i], j] over the kept
// assignments, in rank order. Buffers: A = XE or DX (written), B = X or DXE.
// args: rows c k e mode
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let id = flat_id(wg, lid, 256u);
    let c = arg(1u);
    if (id >= arg(0u) * c) {
        return;
    }
    let r = id / c;
    let j = id % c;
    if (arg(4u) == 0u) {
        if (r < OFFSETS[arg(3u)]) {
            st_A(id, ld_B(ROWTOK[r] * c + j));
        }
        return;
    }
    let k = arg(2u);
    var s = ld_A(id);
    for (var i = 0u; i < k; i++) {
        let row = SLOT[r * k + i];
        if (row != 0xffffffffu) {
            s += ld_B(row * c + j);
        }
    }
    st_A(id, s);
}
