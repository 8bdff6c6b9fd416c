// Slot assignment, one thread, in token order then rank order (tensor::moe::moe_assign): each
// token-assignment takes its expert's next slot, past `capacity` it is dropped (0xffffffff).
// Writes SLOT[N·K] (packed row or dropped), ROWTOK[R], OFFSETS[E + 1] (OFFSETS[E] = R) and the
// pre-drop COUNTS[E].
// args: nk k e capacity
@compute @workgroup_size(1)
fn main() {
    let nk = arg(0u);
    let k = arg(1u);
    let e = arg(2u);
    let cap = arg(3u);
    for (var x = 0u; x < e; x++) {
        COUNTS[x] = 0u;
    }
    for (var i = 0u; i < nk; i++) {
        let x = IDX[i];
        SLOT[i] = select(0xffffffffu, COUNTS[x], COUNTS[x] < cap);
        COUNTS[x] += 1u;
    }
    OFFSETS[0] = 0u;
    for (var x = 0u; x < e; x++) {
        OFFSETS[x + 1u] = OFFSETS[x] + min(COUNTS[x], cap);
    }
    for (var i = 0u; i < nk; i++) {
        if (SLOT[i] != 0xffffffffu) {
            let row = OFFSETS[IDX[i]] + SLOT[i];
            SLOT[i] = row;
            ROWTOK[row] = i / k;
        }
    }
}
