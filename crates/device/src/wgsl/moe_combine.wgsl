// Combine (tensor::moe::moe_combine): Y[t, j] (= or +=) Σ_i G[t, i]·EO[SLOT[t, i], j] over the
// kept assignments in rank order, one thread per element.
// args: n c k accumulate
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let id = flat_id(wg, lid, 256u);
    let c = arg(1u);
    if (id >= arg(0u) * c) {
        return;
    }
    let t = id / c;
    let j = id % c;
    let k = arg(2u);
    var y = 0.0;
    if (arg(3u) != 0u) {
        y = ld_Y(id);
    }
    for (var i = 0u; i < k; i++) {
        let row = SLOT[t * k + i];
        if (row != 0xffffffffu) {
            y += ld_G(t * k + i) * ld_EO(row * c + j);
        }
    }
    st_Y(id, y);
}
