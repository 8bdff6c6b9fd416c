// What the attention kernels share. Their args: b t nh nkv hs window has_starts p drop_scale
// seed_at site heads head0 b0 softmax_scale has_site (the mask seed: read_seed, lib_rng.wgsl).
#define MAX_HS ((uint)(128u))
#define TILE ((uint)(16u))
// A score that is not there (masked); real scores are finite.
#define NONE ((float)(-3.0e38f))

__device__ uint attn_w(const KilnParams& KP) {
    return (arg(2u) + 2u * arg(3u)) * arg(4u);
}

// The first key query `i` of row `b` sees: the sliding window's, and its document's start.
__device__ uint first_key(const KilnParams& KP, uint b, uint i) {
    const auto window = arg(5u);
    auto first = 0u;
    if (window != 0u && i + 1u > window) {
        first = i + 1u - window;
    }
    if (arg(6u) != 0u) {
        first = max(first, STARTS[b * arg(1u) + i]);
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

// Rows k0 .. k0 + TILE of kv head g's keys into Ta and values into Tb, by the 64 threads.
__device__ void load_kv(const KilnParams& KP, Head hd, uint k0, uint lid) {
    for (auto e = lid; e < TILE * hd.hs; e += 64u) {
        const auto kk = e / hd.hs;
        const auto d = e % hd.hs;
        const auto j = k0 + kk;
        if (j < hd.t) {
            const auto row = (hd.b * hd.t + j) * hd.w;
            Ta[kk * MAX_HS + d] = ld_QKV(row + (hd.nh + hd.g) * hd.hs + d);
            Tb[kk * MAX_HS + d] = ld_QKV(row + (hd.nh + hd.nkv + hd.g) * hd.hs + d);
        }
    }
}

// The first key any of the 64 queries from i0 sees under the sliding window.
__device__ uint window_start(const KilnParams& KP, uint i0) {
    const auto window = arg(5u);
    if (window != 0u && i0 + 1u > window) {
        return i0 + 1u - window;
    }
    return 0u;
}
