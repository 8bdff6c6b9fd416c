// Σ x² (or Σ x without squares) in two fixed-order stages: stage 0, workgroup g sums elements g·per .. (g + 1)·per of X
// from off into PART[g]; stage 1, one workgroup sums PART[0..groups] into OUT[at] (overwriting,
// or adding with accumulate).
// args: n off per stage at accumulate squares
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let lid = lid3.x;
    let g = group_id(wg);
    let n = arg(0u);
    var s = 0.0;
    if (arg(3u) == 0u) {
        let lo = g * arg(2u);
        let hi = min(lo + arg(2u), n);
        for (var i = lo + lid; i < hi; i += 256u) {
            let x = ld_X(arg(1u) + i);
            s = select(s + x, fma(x, x, s), arg(6u) != 0u);
        }
        let total = wg_sum(s, lid);
        if (lid == 0u) {
            st_PART(g, total);
        }
        return;
    }
    for (var i = lid; i < n; i += 256u) {
        s += ld_PART(i);
    }
    let total = wg_sum(s, lid);
    if (lid == 0u) {
        var v = total;
        if (arg(5u) != 0u) {
            v += ld_OUT(arg(4u));
        }
        st_OUT(arg(4u), v);
    }
}
