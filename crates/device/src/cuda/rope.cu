// Rotary embedding in place over qkv rows [N, W], W = (NH + 2·NKV)·HS: the first ROT dims of
// each q and k head turned by its token's position (HF's rotate_half pairs (i, i + ROT/2));
// inverse = the transposed rotation (backward). Positions: offset + (row mod T), or POS[row].
// args: rows nqk hs rot t offset has_pos inverse w
extern "C" __global__ void __launch_bounds__(256) rope(const KilnParams KP) {
    const uint3 wg = blockIdx;
    const uint3 lid = threadIdx;
    const auto e = flat_id(wg, lid, 256u);
    const auto nqk = arg(1u);
    const auto hs = arg(2u);
    const auto half = arg(3u) / 2u;
    if (e >= arg(0u) * nqk * half) {
        return;
    }
    const auto i = e % half;
    const auto head = (e / half) % nqk;
    const auto row = e / (half * nqk);
    auto pos = arg(5u) + row % arg(4u);
    if (arg(6u) != 0u) {
        pos = POS[row];
    }
    const auto base = row * arg(8u) + head * hs;
    const auto c = ld_COS(pos * half + i);
    const auto s = ld_SIN(pos * half + i);
    const auto a = ld_X(base + i);
    const auto b = ld_X(base + half + i);
    if (arg(7u) != 0u) {
        st_X(base + i, a * c + b * s);
        st_X(base + half + i, b * c - a * s);
    } else {
        st_X(base + i, a * c - b * s);
        st_X(base + half + i, b * c + a * s);
    }
}
