// 64-bit integers as (lo, hi) pairs of u32, and tensor::rng::hash_uniform on them: the CPU's
// counter-based dropout hash, bit for bit, as lib_rng.wgsl computes it.
__device__ inline uint2 operator^(uint2 a, uint2 b) {
    return make_uint2(a.x ^ b.x, a.y ^ b.y);
}

__device__ uint2 add64(const KilnParams& KP, uint2 a, uint2 b) {
    const auto lo = a.x + b.x;
    return make_uint2(lo, a.y + b.y + kiln_select(0u, 1u, lo < a.x));
}

// The full 64-bit product of two u32.
__device__ uint2 mul32(const KilnParams& KP, uint a, uint b) {
    const auto a0 = a & 0xffffu;
    const auto a1 = a >> 16u;
    const auto b0 = b & 0xffffu;
    const auto b1 = b >> 16u;
    const auto p00 = a0 * b0;
    const auto p01 = a0 * b1;
    const auto p10 = a1 * b0;
    const auto p11 = a1 * b1;
    const auto mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    const auto lo = (p00 & 0xffffu) | (mid << 16u);
    const auto hi = p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
    return make_uint2(lo, hi);
}

// a·b mod 2^64.
__device__ uint2 mul64(const KilnParams& KP, uint2 a, uint2 b) {
    const auto p = mul32(KP, a.x, b.x);
    return make_uint2(p.x, p.y + a.x * b.y + a.y * b.x);
}

__device__ uint2 shr64(const KilnParams& KP, uint2 a, uint s) {
    // 0 < s < 32
    return make_uint2((a.x >> s) | (a.y << (32u - s)), a.y >> s);
}

__device__ uint2 mix64(const KilnParams& KP, uint2 z0) {
    auto z = add64(KP, z0, make_uint2(0x7f4a7c15u, 0x9e3779b9u));
    z = mul64(KP, z ^ shr64(KP, z, 30u), make_uint2(0x1ce4e5b9u, 0xbf58476du));
    z = mul64(KP, z ^ shr64(KP, z, 27u), make_uint2(0x133111ebu, 0x94d049bbu));
    return z ^ shr64(KP, z, 31u);
}

__device__ float hash_uniform(const KilnParams& KP, uint2 seed, uint2 index) {
    const auto h = mix64(KP, seed ^ mix64(KP, index));
    return float(h.y >> 8u) * (1.0f / 16777216.0f);
}


// The seed of dropout site `site` from a pass's seed (the CPU model's
// mix64(seed ^ mix64(site + 0xD1B54A32D192ED03))).
__device__ uint2 site_seed(const KilnParams& KP, uint2 seed, uint site) {
    return mix64(KP, seed ^ mix64(KP, add64(KP, make_uint2(site, 0u), make_uint2(0xd192ed03u, 0xd1b54a32u))));
}

// A kernel's mask seed: the u64 at SEED[at], through site_seed when `has_site`.
__device__ uint2 read_seed(const KilnParams& KP, uint at, uint has_site, uint site) {
    const auto s = make_uint2(SEED[at], SEED[at + 1u]);
    if (has_site != 0u) {
        return site_seed(KP, s, site);
    }
    return s;
}
