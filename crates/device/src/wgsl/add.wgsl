// mode 0: OUT = A + B; mode 1: OUT += A.
// args: n mode
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wg, lid, 256u);
    if (i >= arg(0u)) {
        return;
    }
    if (arg(1u) == 0u) {
        st_OUT(i, ld_A(i) + ld_B(i));
    } else {
        st_OUT(i, ld_OUT(i) + ld_A(i));
    }
}
