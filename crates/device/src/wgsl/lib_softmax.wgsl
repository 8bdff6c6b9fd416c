// The largest of the logits L[base .. base + v] and Σ exp(L[j] − largest) over them, across the
// workgroup (every thread gets both).
fn row_max_sum(base: u32, v: u32, lid: u32) -> vec2<f32> {
    var mx = -3.4e38;
    for (var j = lid; j < v; j += 256u) {
        mx = max(mx, ld_L(base + j));
    }
    let m = wg_max(mx, lid);
    var s = 0.0;
    for (var j = lid; j < v; j += 256u) {
        s += exp(ld_L(base + j) - m);
    }
    return vec2<f32>(m, wg_sum(s, lid));
}
