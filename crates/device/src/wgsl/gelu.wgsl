// GELU, tanh form, as x·σ(2u) = x / (1 + e^{−2u}), u = √(2/π)(x + 0.044715x³).
// mode 0: OUT = GELU(X); 1: OUT = GELU'(X)·D; 2: OUT += GELU'(X)·D.
// args: n mode
const K: f32 = 0.7978846;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wg, lid, 256u);
    if (i >= arg(0u)) {
        return;
    }
    let x = ld_X(i);
    let e = exp(x * fma(x * x, -2.0 * K * 0.044715, -2.0 * K));
    let mode = arg(1u);
    if (mode == 0u) {
        st_OUT(i, x / (1.0 + e));
        return;
    }
    let s = 1.0 / (1.0 + e);
    let du2 = fma(x * x, 2.0 * K * 3.0 * 0.044715, 2.0 * K);
    var g = fma(x * (s - s * s), du2, s) * ld_D(i);
    if (mode == 2u) {
        g += ld_OUT(i);
    }
    st_OUT(i, g);
}
