// DB[off + j] += Σ_i DOUT[i, j], rows in order: one thread per column.
// args: rows cols off
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let j = flat_id(wg, lid, 64u);
    let rows = arg(0u);
    let cols = arg(1u);
    if (j >= cols) {
        return;
    }
    var s = 0.0;
    for (var i = 0u; i < rows; i++) {
        s += ld_DOUT(i * cols + j);
    }
    st_DB(arg(2u) + j, ld_DB(arg(2u) + j) + s);
}
