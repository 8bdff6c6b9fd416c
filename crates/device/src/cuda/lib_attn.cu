// What the attention kernels share. Their args: b t nh nkv hs window has_starts p drop_scale
// seed_at site heads head0 b0 softmax_scale has_site (the mask seed: read_seed, lib_rng.cu),
// then the block (tensor::flash::Block): q_rows q_row0 q_len q_pos0, k_rows k_row0 k_len k_pos0,
// kw kc vc, fresh. The queries are rows q_row0 .. q_row0 + q_len of each batch row's q_rows in
// QKV, at positions from q_pos0; the keys and values rows k_row0 .. of k_rows in KV (kw wide,
// kv head g's key at column kc + g·HS, its value at vc + g·HS), at positions from k_pos0. T is
// the whole sequence's length: masks, windows, documents and dropout are by global position.
#define MAX_HS ((uint)(128u))
#define TILE ((uint)(16u))
// A score that is not there (masked); real scores are finite.
#define NONE ((float)(-3.0e38f))

__device__ uint attn_w(const KilnParams& KP) {
    return (arg(2u) + 2u * arg(3u)) * arg(4u);
}

// The buffer rows of the block's query `i` and key `j` in batch row `b`.
__device__ uint q_row(const KilnParams& KP, uint b, uint i) {
    return b * arg(16u) + arg(17u) + i;
}

__device__ uint k_row(const KilnParams& KP, uint b, uint j) {
    return b * arg(20u) + arg(21u) + j;
}

// The first position the block's query `i` of row `b` sees: the sliding window's, and its
// document's start (STARTS holds global positions, one per query row).
__device__ uint first_key(const KilnParams& KP, uint b, uint i) {
    const auto window = arg(5u);
    const auto pos = arg(19u) + i;
    auto first = 0u;
    if (window != 0u && pos + 1u > window) {
        first = pos + 1u - window;
    }
    if (arg(6u) != 0u) {
        first = max(first, STARTS[q_row(KP, b, i)]);
    }
    return first;
}

// The dropout factor of probability (b, h, i, j): 1/(1 − p) if kept, else 0 (1 without
// dropout). The mask is the CPU's: keep iff hash_uniform(seed, ((bh')·T + i)·T + j) ≥ p, bh' the
// whole model's (batch, head) (tensor::llama::GqaDims::mask_bh).
__device__ float drop_factor(const KilnParams& KP, uint b, uint h, uint i, uint j) {
    const auto p = argf(7u);
    if (p == 0.0f) {
        return 1.0f;
    }
    const uint2 mask_seed = read_seed(KP, arg(9u), arg(15u), arg(10u));
    const auto t = arg(1u);
    const auto mask_bh = (arg(13u) + b) * arg(11u) + arg(12u) + h;
    const auto index = add64(KP, mul32(KP, mask_bh * t + i, t), make_uint2(j, 0u));
    if (hash_uniform(KP, mask_seed, index) >= p) {
        return argf(8u);
    }
    return 0.0f;
}

// One workgroup's (batch, query head) over `b·NH + h`, and the shapes every kernel reads.
struct Head {
    uint b;
    uint h;
    uint g;
    uint t;
    uint nh;
    uint nkv;
    uint hs;
    uint w;
};

__device__ Head head_of(const KilnParams& KP, uint bh) {
    const auto nh = arg(2u);
    const auto nkv = arg(3u);
    const auto h = bh % nh;
    return Head{bh / nh, h, h / (nh / nkv), arg(1u), nh, nkv, arg(4u), attn_w(KP)};
}

// Two TILE × MAX_HS tiles in workgroup memory: keys and values (forward, dq), or queries and
// output gradients (dk, dv).
__shared__ float Ta[2048];
__shared__ float Tb[2048];

// The block's keys k0 .. k0 + TILE of kv head g into Ta and values into Tb, by the 64 threads.
__device__ void load_kv(const KilnParams& KP, Head hd, uint k0, uint lid) {
    for (auto e = lid; e < TILE * hd.hs; e += 64u) {
        const auto kk = e / hd.hs;
        const auto d = e % hd.hs;
        const auto j = k0 + kk;
        if (j < arg(22u)) {
            const auto row = k_row(KP, hd.b, j) * arg(24u);
            Ta[kk * MAX_HS + d] = ld_KV(row + arg(25u) + hd.g * hd.hs + d);
            Tb[kk * MAX_HS + d] = ld_KV(row + arg(26u) + hd.g * hd.hs + d);
        }
    }
}

// The first position any query from position `pos` on sees under the sliding window.
__device__ uint window_start(const KilnParams& KP, uint pos) {
    const auto window = arg(5u);
    if (window != 0u && pos + 1u > window) {
        return pos + 1u - window;
    }
    return 0u;
}

// The block's keys [x, y) that its queries i0 .. i1 (exclusive) can see: from the first
// query's window to the last query's position.
__device__ uint2 key_range(const KilnParams& KP, uint i0, uint i1) {
    const auto k_pos0 = arg(23u);
    const auto first = window_start(KP, arg(19u) + i0);
    const auto last = arg(19u) + i1;
    auto lo = 0u;
    if (first > k_pos0) {
        lo = first - k_pos0;
    }
    auto hi = 0u;
    if (last > k_pos0) {
        hi = min(last - k_pos0, arg(22u));
    }
    return make_uint2(lo, hi);
}

// The block's queries [x, y) that can see its keys j0 .. j0 + 64: from the first key's
// position to, under a window, the last key's window.
__device__ uint2 query_range(const KilnParams& KP, uint j0) {
    const auto q_pos0 = arg(19u);
    const auto q_len = arg(18u);
    const auto first = arg(23u) + j0;
    auto lo = 0u;
    if (first > q_pos0) {
        lo = min(first - q_pos0, q_len);
    }
    auto hi = q_len;
    const auto window = arg(5u);
    if (window != 0u) {
        const auto end = first + 63u + window;
        hi = 0u;
        if (end > q_pos0) {
            hi = min(end - q_pos0, q_len);
        }
    }
    return make_uint2(lo, hi);
}
