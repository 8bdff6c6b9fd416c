// SwiGLU over fused [N, 2F] rows (gate | up): forward OUT[n, j] = silu(g)·u; backward (mode 1
// overwrite, 2 accumulate) DGU[n, j] = D·u·σ(g)(1 + g(1 − σ(g))), DGU[n, F + j] = D·silu(g).
// args: rows f mode
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let e = flat_id(wg, lid, 256u);
    let f = arg(1u);
    if (e >= arg(0u) * f) {
        return;
    }
    let n = e / f;
    let j = e % f;
    let gi = n * 2u * f + j;
    let g = ld_GU(gi);
    let u = ld_GU(gi + f);
    let s = 1.0 / (1.0 + exp(-g));
    let mode = arg(2u);
    if (mode == 0u) {
        st_OUT(e, g * s * u);
        return;
    }
    let d = ld_D(e);
    var dg = d * u * s * (1.0 + g * (1.0 - s));
    var du = d * g * s;
    if (mode == 2u) {
        dg += ld_OUT(gi);
        du += ld_OUT(gi + f);
    }
    st_OUT(gi, dg);
    st_OUT(gi + f, du);
}
