// Inverted dropout with tensor's counter-based mask: element (row, k) is kept iff
// hash_uniform(seed, global(row)·C + k) ≥ p, where hash_uniform(s, i) = (mix64(s ^ mix64(i))
// >> 40)·2⁻²⁴ and mix64 is SplitMix64's finaliser: the CPU's masks, bit for bit. 64-bit
// integers are (lo, hi) pairs of u32, so no SHADER_INT64 is needed (lib_rng.wgsl).
// mode 0: OUT = keep ? IN·scale : 0; mode 1: OUT += keep ? IN·scale : 0; mode 2, in place:
// OUT = keep ? OUT·scale : 0.
// The seed: read_seed(seed_at, has_site, site) (lib_rng.wgsl).
// args: rows c p scale seed_at site mode t_local t offset b0 chunked len first second has_site

// tensor::RowMap::global: the whole tensor's row of local row `row`.
__device__ uint global_row(const KilnParams& KP, uint row) {
    const auto t_local = arg(7u);
    const auto i = arg(9u) + row % t_local;
    auto at = i;
    if (arg(11u) != 0u) {
        at = kiln_select(arg(14u) + i - arg(12u), arg(13u) + i, i < arg(12u));
    }
    return (arg(10u) + row / t_local) * arg(8u) + at;
}

extern "C" __global__ void __launch_bounds__(256) dropout(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto e = flat_id(wg, lid, 256u);
    const auto c = arg(1u);
    if (e >= arg(0u) * c) {
        return;
    }
    const auto row = e / c;
    const auto k = e % c;
    const auto index = add64(KP, mul32(KP, global_row(KP, row), c), make_uint2(k, 0u));
    const auto p = argf(2u);
    const auto mode = arg(6u);
    auto v = 0.0f;
    if (p == 0.0f || hash_uniform(KP, read_seed(KP, arg(4u), arg(15u), arg(5u)), index) >= p) {
        if (mode == 2u) {
            v = ld_OUT(e) * argf(3u);
        } else {
            v = ld_IN(e) * argf(3u);
        }
    }
    if (mode == 1u) {
        st_OUT(e, ld_OUT(e) + v);
    } else {
        st_OUT(e, v);
    }
}
