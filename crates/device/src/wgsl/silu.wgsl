// SiLU, x·σ(x). mode 0: OUT = silu(X); 1: OUT = silu'(X)·D; 2: OUT += silu'(X)·D.
// args: n mode
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wg, lid, 256u);
    if (i >= arg(0u)) {
        return;
    }
    let x = ld_X(i);
    let s = 1.0 / (1.0 + exp(-x));
    let mode = arg(1u);
    if (mode == 0u) {
        st_OUT(i, x * s);
        return;
    }
    var g = ld_D(i) * s * (1.0 + x * (1.0 - s));
    if (mode == 2u) {
        g += ld_OUT(i);
    }
    st_OUT(i, g);
}
