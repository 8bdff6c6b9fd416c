// C = alpha·A·B (+ C) (+ bias): one 64×64 tile of C per workgroup of 16×16 threads, each thread
// 4×4 outputs (rows ty + 16i, columns tx + 16j), k in steps of 16 through workgroup memory.
// Every output is one fp32 sum over k in ascending order, from zero.
// Ragged (a mixture-of-experts layer's experts over their packed rows): with ragged 1 the
// rows, with ragged 2 the inner dimension, are expert e's, OFFS[e] .. OFFS[e + 1]: m or k is
// their count (the launch's m or k its upper bound), and A's and C's rows (ragged 1) or A's
// columns and B's rows (ragged 2) start at OFFS[e].
// args: m n k inner | A: off rs cs b0 b1 | B: off rs cs b0 b1 | C: off rs b0 b1 |
//       alpha accumulate has_bias bias_off | ragged e
var<workgroup> As: array<f32, 1024>; // [16 k][64 rows]
var<workgroup> Bs: array<f32, 1024>; // [16 k][64 cols]
var<workgroup> rag: vec2<u32>;        // (first row, rows) of a ragged product

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let ragged = arg(22u);
    if (ragged != 0u && lid.x == 0u && lid.y == 0u) {
        let e = arg(23u);
        rag = vec2<u32>(OFFS[e], OFFS[e + 1u] - OFFS[e]);
    }
    let r = workgroupUniformLoad(&rag);
    var m = arg(0u);
    let n = arg(1u);
    var k = arg(2u);
    let inner = arg(3u);
    let zo = wg.z / inner;
    let zi = wg.z % inner;
    var a0 = arg(4u) + zo * arg(7u) + zi * arg(8u);
    var b0 = arg(9u) + zo * arg(12u) + zi * arg(13u);
    var c0 = arg(14u) + zo * arg(16u) + zi * arg(17u);
    if (ragged == 1u) {
        m = min(m, r.y);
        a0 += r.x * arg(5u);
        c0 += r.x * arg(15u);
    } else if (ragged == 2u) {
        k = min(k, r.y);
        a0 += r.x * arg(6u);
        b0 += r.x * arg(10u);
    }
    let row0 = wg.y * 64u;
    let col0 = wg.x * 64u;
    let tid = lid.y * 16u + lid.x;
    var acc: array<f32, 16>;
    for (var i = 0u; i < 16u; i++) {
        acc[i] = 0.0;
    }
    for (var k0 = 0u; k0 < k; k0 += 16u) {
        for (var r = 0u; r < 4u; r++) {
            let e = tid + r * 256u;
            // A: 64 rows × 16 k; B: 16 k × 64 columns.
            let ai = e / 16u;
            let ak = e % 16u;
            var av = 0.0;
            if (row0 + ai < m && k0 + ak < k) {
                av = ld_A(a0 + (row0 + ai) * arg(5u) + (k0 + ak) * arg(6u));
            }
            As[ak * 64u + ai] = av;
            let bk = e / 64u;
            let bj = e % 64u;
            var bv = 0.0;
            if (k0 + bk < k && col0 + bj < n) {
                bv = ld_B(b0 + (k0 + bk) * arg(10u) + (col0 + bj) * arg(11u));
            }
            Bs[bk * 64u + bj] = bv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk++) {
            var a: array<f32, 4>;
            var b: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                a[i] = As[kk * 64u + lid.y + 16u * i];
                b[i] = Bs[kk * 64u + lid.x + 16u * i];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] = fma(a[i], b[j], acc[i * 4u + j]);
                }
            }
        }
        workgroupBarrier();
    }
    let alpha = argf(18u);
    for (var i = 0u; i < 4u; i++) {
        let row = row0 + lid.y + 16u * i;
        for (var j = 0u; j < 4u; j++) {
            let col = col0 + lid.x + 16u * j;
            if (row < m && col < n) {
                let at = c0 + row * arg(15u) + col;
                var v = alpha * acc[i * 4u + j];
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
