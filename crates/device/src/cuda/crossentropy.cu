// Softmax cross-entropy over one chunk of the LM head's logits, one row per workgroup, in place
// in L[rows, Vp] (tensor::classifier::lm_head_crossentropy's row step): the softmax over the first
// V columns, LOSSES[r0 + row] = −ln p[target] (0 for the ignore index), and with gradients the
// logit gradient dloss·(p − onehot) (0 for padding and ignored rows), dloss = S[dloss_at].
// args: rows v vp ignore r0 grads dloss_at
extern "C" __global__ void __launch_bounds__(256) crossentropy(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid3 = threadIdx;
    const auto row = group_id(wg);
    const auto lid = lid3.x;
    if (row >= arg(0u)) {
        return;
    }
    const auto v = arg(1u);
    const auto vp = arg(2u);
    const auto base = row * vp;
    const auto tgt = TGT[arg(4u) + row];
    const auto grads = arg(5u) != 0u;
    const auto ms = row_max_sum(KP, base, v, lid);
    const auto m = ms.x;
    const auto inv = 1.0f / ms.y;
    const auto ignored = tgt == arg(3u);
    // Every thread reads the target's logit before any thread overwrites the row.
    auto pt = 0.0f;
    if (!ignored) {
        pt = expf(ld_L(base + tgt) - m) * inv;
    }
    __syncthreads();
    if (lid == 0u) {
        st_LOSSES(arg(4u) + row, kiln_select(-logf(max(pt, 1.17549435e-38f)), 0.0f, ignored));
    }
    if (grads) {
        const auto d = ld_S(arg(6u));
        for (auto j = lid; j < vp; j += 256u) {
            auto g = 0.0f;
            if (j < v && !ignored) {
                g = expf(ld_L(base + j) - m) * inv * d;
                if (j == tgt) {
                    g -= d;
                }
            }
            st_L(base + j, g);
        }
    }
}
