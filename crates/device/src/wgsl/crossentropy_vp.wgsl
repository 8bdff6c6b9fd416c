// Vocabulary-parallel softmax cross-entropy over one chunk of the LM head's logits, one row per
// workgroup (tensor::classifier::lm_head_crossentropy_vocab_parallel's row steps): L[rows, Vp]
// holds this rank's columns, vocabulary rows offset .. offset + v, and TGT the global targets.
// mode 0: ST[row] = this rank's log-sum-exp over its v columns (−3.4e38 when v = 0) and
// ST[rows + row] its target's logit (0 where another rank owns it or the row is ignored).
// mode 1: with ST[row] the global log-sum-exp and ST[rows + row] the target's logit,
// LOSSES[r0 + row] = lse − z_target (0 for the ignore index) and with gradients, in place, the
// logit gradient dloss·(exp(z − lse) − onehot) on this rank's columns (0 for padding and ignored
// rows), dloss = S[dloss_at].
// args: rows v vp ignore r0 grads dloss_at offset mode
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let row = group_id(wg);
    let lid = lid3.x;
    let rows = arg(0u);
    if (row >= rows) {
        return;
    }
    let v = arg(1u);
    let vp = arg(2u);
    let base = row * vp;
    let tgt = TGT[arg(4u) + row];
    let ignored = tgt == arg(3u);
    let off = arg(7u);
    let owned = !ignored && tgt >= off && tgt - off < v;
    if (arg(8u) == 0u) {
        let ms = row_max_sum(base, v, lid);
        if (lid == 0u) {
            var lse = -3.4e38;
            if (v > 0u) {
                lse = ms.x + log(ms.y);
            }
            var zt = 0.0;
            if (owned) {
                zt = ld_L(base + tgt - off);
            }
            st_ST(row, lse);
            st_ST(rows + row, zt);
        }
        return;
    }
    let lse = ld_ST(row);
    if (lid == 0u) {
        st_LOSSES(arg(4u) + row, select(lse - ld_ST(rows + row), 0.0, ignored));
    }
    if (arg(5u) != 0u) {
        let d = ld_S(arg(6u));
        for (var j = lid; j < vp; j += 256u) {
            var g = 0.0;
            if (j < v && !ignored) {
                g = exp(ld_L(base + j) - lse) * d;
                if (owned && j == tgt - off) {
                    g -= d;
                }
            }
            st_L(base + j, g);
        }
    }
}
