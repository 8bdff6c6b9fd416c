// C = alpha·A·B (+ C) (+ bias): one 64×64 tile of C per workgroup of 16×16 threads, each thread
// 4×4 outputs (rows ty + 16i, columns tx + 16j), k in steps of 16 through workgroup memory.
// Every output is one fp32 sum over k in ascending order, from zero.
// Ragged (a mixture-of-experts layer's experts over their packed rows): with ragged 1 the
// rows, with ragged 2 the inner dimension, are expert e's, OFFS[e] .. OFFS[e + 1]: m or k is
// their count (the launch's m or k its upper bound), and A's and C's rows (ragged 1) or A's
// columns and B's rows (ragged 2) start at OFFS[e].
// args: m n k inner | A: off rs cs b0 b1 | B: off rs cs b0 b1 | C: off rs b0 b1 |
//       alpha accumulate has_bias bias_off | ragged e
__shared__ float As[1024]; // [16 k][64 rows]
__shared__ float Bs[1024]; // [16 k][64 cols]
__shared__ uint2 rag;        // (first row, rows) of a ragged product

extern "C" __global__ void __launch_bounds__(256) matmul(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto ragged = arg(22u);
    if (ragged != 0u && lid.x == 0u && lid.y == 0u) {
        const auto e = arg(23u);
        rag = make_uint2(OFFS[e], OFFS[e + 1u] - OFFS[e]);
    }
    __syncthreads();
    const auto r = rag;
    auto m = arg(0u);
    const auto n = arg(1u);
    auto k = arg(2u);
    const auto inner = arg(3u);
    const auto zo = wg.z / inner;
    const auto zi = wg.z % inner;
    auto a0 = arg(4u) + zo * arg(7u) + zi * arg(8u);
    auto b0 = arg(9u) + zo * arg(12u) + zi * arg(13u);
    auto c0 = arg(14u) + zo * arg(16u) + zi * arg(17u);
    if (ragged == 1u) {
        m = min(m, r.y);
        a0 += r.x * arg(5u);
        c0 += r.x * arg(15u);
    } else if (ragged == 2u) {
        k = min(k, r.y);
        a0 += r.x * arg(6u);
        b0 += r.x * arg(10u);
    }
    const auto row0 = wg.y * 64u;
    const auto col0 = wg.x * 64u;
    const auto tid = lid.y * 16u + lid.x;
    float acc[16];
    for (auto i = 0u; i < 16u; i++) {
        acc[i] = 0.0f;
    }
    for (auto k0 = 0u; k0 < k; k0 += 16u) {
        for (auto r = 0u; r < 4u; r++) {
            const auto e = tid + r * 256u;
            // A: 64 rows × 16 k; B: 16 k × 64 columns.
            const auto ai = e / 16u;
            const auto ak = e % 16u;
            auto av = 0.0f;
            if (row0 + ai < m && k0 + ak < k) {
                av = ld_A(a0 + (row0 + ai) * arg(5u) + (k0 + ak) * arg(6u));
            }
            As[ak * 64u + ai] = av;
            const auto bk = e / 64u;
            const auto bj = e % 64u;
            auto bv = 0.0f;
            if (k0 + bk < k && col0 + bj < n) {
                bv = ld_B(b0 + (k0 + bk) * arg(10u) + (col0 + bj) * arg(11u));
            }
            Bs[bk * 64u + bj] = bv;
        }
        __syncthreads();
        for (auto kk = 0u; kk < 16u; kk++) {
            float a[4];
            float b[4];
            for (auto i = 0u; i < 4u; i++) {
                a[i] = As[kk * 64u + lid.y + 16u * i];
                b[i] = Bs[kk * 64u + lid.x + 16u * i];
            }
            for (auto i = 0u; i < 4u; i++) {
                for (auto j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] = fmaf(a[i], b[j], acc[i * 4u + j]);
                }
            }
        }
        __syncthreads();
    }
    const auto alpha = argf(18u);
    for (auto i = 0u; i < 4u; i++) {
        const auto row = row0 + lid.y + 16u * i;
        for (auto j = 0u; j < 4u; j++) {
            const auto col = col0 + lid.x + 16u * j;
            if (row < m && col < n) {
                const auto at = c0 + row * arg(15u) + col;
                auto v = alpha * acc[i * 4u + j];
                if (arg(19u) != 0u) {
                    v = ld_C(at) + v;
                }
                if (arg(20u) != 0u) {
                    v = v + ld_BIAS(arg(21u) + col);
                }
                st_C(at, v);
            }
        }
    }
}
