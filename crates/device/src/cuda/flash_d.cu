// FlashAttention-2's D[b·NH + h, i] = dO_i · O_i, one thread per (b, h, i).
// args: b t nh hs
extern "C" __global__ void __launch_bounds__(64) flash_d(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto e = flat_id(wg, lid, 64u);
    const auto t = arg(1u);
    const auto nh = arg(2u);
    const auto hs = arg(3u);
    if (e >= arg(0u) * nh * t) {
        return;
    }
    const auto i = e % t;
    const auto bh = e / t;
    const auto o = ((bh / nh) * t + i) * nh * hs + (bh % nh) * hs;
    auto s = 0.0f;
    for (auto d = 0u; d < hs; d++) {
        s = fmaf(ld_DY(o + d), ld_Y(o + d), s);
    }
    st_DD(e, s);
}
