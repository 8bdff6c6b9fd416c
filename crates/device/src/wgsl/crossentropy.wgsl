// Softmax cross-entropy over one chunk of the LM head's logits, one row per workgroup, in place
// in L[rows, Vp] (tensor::classifier::lm_head_crossentropy's row step): the softmax over the first
// V columns, LOSSES[r0 + row] = −ln p[target] (0 for the ignore index), and with gradients the
// logit gradient dloss·(p − onehot) (0 for padding and ignored rows), dloss = S[dloss_at].
// args: rows v vp ignore r0 grads dloss_at
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let row = group_id(wg);
    let lid = lid3.x;
    if (row >= arg(0u)) {
        return;
    }
    let v = arg(1u);
    let vp = arg(2u);
    let base = row * vp;
    let tgt = TGT[arg(4u) + row];
    let grads = arg(5u) != 0u;
    let ms = row_max_sum(base, v, lid);
    let m = ms.x;
    let inv = 1.0 / ms.y;
    let ignored = tgt == arg(3u);
    // Every thread reads the target's logit before any thread overwrites the row.
    var pt = 0.0;
    if (!ignored) {
        pt = exp(ld_L(base + tgt) - m) * inv;
    }
    workgroupBarrier();
    if (lid == 0u) {
        st_LOSSES(arg(4u) + row, select(-log(max(pt, 1.17549435e-38)), 0.0, ignored));
    }
    if (grads) {
        let d = ld_S(arg(6u));
        for (var j = lid; j < vp; j += 256u) {
            var g = 0.0;
            if (j < v && !ignored) {
                g = exp(ld_L(base + j) - m) * inv * d;
                if (j == tgt) {
                    g -= d;
                }
            }
            st_L(base + j, g);
        }
    }
}
