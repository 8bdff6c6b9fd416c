// A workgroup-wide sum over 256 threads, in a fixed tree (the same order every time).
var<workgroup> part: array<f32, 256>;

fn wg_sum(v: f32, lid: u32) -> f32 {
    part[lid] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            part[lid] += part[lid + s];
        }
        workgroupBarrier();
    }
    let total = part[0];
    workgroupBarrier();
    return total;
}


// The largest of every thread's `v` over the workgroup.
fn wg_max(v: f32, lid: u32) -> f32 {
    part[lid] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            part[lid] = max(part[lid], part[lid + s]);
        }
        workgroupBarrier();
    }
    let m = part[0];
    workgroupBarrier();
    return m;
}
