// Slot assignment, one thread, in token order then rank order (tensor::moe::moe_assign): each
// token-assignment takes its expert's next slot, past `capacity` it is dropped (0xffffffff).
// Writes SLOT[N·K] (packed row or dropped), ROWTOK[R], OFFSETS[E + 1] (OFFSETS[E] = R) and the
// pre-drop COUNTS[E].
// args: nk k e capacity
extern "C" __global__ void __launch_bounds__(1) moe_assign(const KilnParams KP) {
    const auto nk = arg(0u);
    const auto k = arg(1u);
    const auto e = arg(2u);
    const auto cap = arg(3u);
    for (auto x = 0u; x < e; x++) {
        COUNTS[x] = 0u;
    }
    for (auto i = 0u; i < nk; i++) {
        const auto x = IDX[i];
        SLOT[i] = kiln_select(0xffffffffu, COUNTS[x], COUNTS[x] < cap);
        COUNTS[x] += 1u;
    }
    OFFSETS[0] = 0u;
    for (auto x = 0u; x < e; x++) {
        OFFSETS[x + 1u] = OFFSETS[x] + min(COUNTS[x], cap);
    }
    for (auto i = 0u; i < nk; i++) {
        if (SLOT[i] != 0xffffffffu) {
            const auto row = OFFSETS[IDX[i]] + SLOT[i];
            SLOT[i] = row;
            ROWTOK[row] = i / k;
        }
    }
}
