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
extern "C" __global__ void __launch_bounds__(256) crossentropy_vp(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid3 = threadIdx;
    const auto row = group_id(wg);
    const auto lid = lid3.x;
    const auto rows = arg(0u);
    if (row >= rows) {
        return;
    }
    const auto v = arg(1u);
    const auto vp = arg(2u);
    const auto base = row * vp;
    const auto tgt = TGT[arg(4u) + row];
    const auto ignored = tgt == arg(3u);
    const auto off = arg(7u);
    const auto owned = !ignored && tgt >= off && tgt - off < v;
    if (arg(8u) == 0u) {
        const auto ms = row_max_sum(KP, base, v, lid);
        if (lid == 0u) {
            auto lse = -3.4e38f;
            if (v > 0u) {
                lse = ms.x + logf(ms.y);
            }
            auto zt = 0.0f;
            if (owned) {
                zt = ld_L(base + tgt - off);
            }
            st_ST(row, lse);
            st_ST(rows + row, zt);
        }
        return;
    }
    const auto lse = ld_ST(row);
    if (lid == 0u) {
        st_LOSSES(arg(4u) + row, kiln_select(lse - ld_ST(rows + row), 0.0f, ignored));
    }
    if (arg(5u) != 0u) {
        const auto d = ld_S(arg(6u));
        for (auto j = lid; j < vp; j += 256u) {
            auto g = 0.0f;
            if (j < v && !ignored) {
                g = expf(ld_L(base + j) - lse) * d;
                if (owned && j == tgt - off) {
                    g -= d;
                }
            }
            st_L(base + j, g);
        }
    }
}
