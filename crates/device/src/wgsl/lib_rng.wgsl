// 64-bit integers as (lo, hi) pairs of u32, and tensor::rng::hash_uniform on them: the CPU's
// counter-based dropout hash, bit for bit, without SHADER_INT64.
fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}

// The full 64-bit product of two u32.
fn mul32(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let p11 = a1 * b1;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    let lo = (p00 & 0xffffu) | (mid << 16u);
    let hi = p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
    return vec2<u32>(lo, hi);
}

// a·b mod 2^64.
fn mul64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let p = mul32(a.x, b.x);
    return vec2<u32>(p.x, p.y + a.x * b.y + a.y * b.x);
}

fn shr64(a: vec2<u32>, s: u32) -> vec2<u32> {
    // 0 < s < 32
    return vec2<u32>((a.x >> s) | (a.y << (32u - s)), a.y >> s);
}

fn mix64(z0: vec2<u32>) -> vec2<u32> {
    var z = add64(z0, vec2<u32>(0x7f4a7c15u, 0x9e3779b9u));
    z = mul64(z ^ shr64(z, 30u), vec2<u32>(0x1ce4e5b9u, 0xbf58476du));
    z = mul64(z ^ shr64(z, 27u), vec2<u32>(0x133111ebu, 0x94d049bbu));
    return z ^ shr64(z, 31u);
}

fn hash_uniform(seed: vec2<u32>, index: vec2<u32>) -> f32 {
    let h = mix64(seed ^ mix64(index));
    return f32(h.y >> 8u) * (1.0 / 16777216.0);
}


// The seed of dropout site `site` from a pass's seed (the CPU model's
// mix64(seed ^ mix64(site + 0xD1B54A32D192ED03))).
fn site_seed(seed: vec2<u32>, site: u32) -> vec2<u32> {
    return mix64(seed ^ mix64(add64(vec2<u32>(site, 0u), vec2<u32>(0xd192ed03u, 0xd1b54a32u))));
}

// A kernel's mask seed: the u64 at SEED[at], through site_seed when `has_site`.
fn read_seed(at: u32, has_site: u32, site: u32) -> vec2<u32> {
    let s = vec2<u32>(SEED[at], SEED[at + 1u]);
    if (has_site != 0u) {
        return site_seed(s, site);
    }
    return s;
}
