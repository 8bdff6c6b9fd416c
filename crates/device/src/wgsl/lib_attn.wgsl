// What the attention kernels share. Their args: b t nh nkv hs window has_starts p drop_scale
// seed_at site heads head0 b0 softmax_scale has_site (the mask seed: read_seed, lib_rng.wgsl).
const MAX_HS: u32 = 128u;
const TILE: u32 = 16u;
// A score that is not there (masked); real scores are finite.
const NONE: f32 = -3.0e38;

fn attn_w() -> u32 {
    return (arg(2u) + 2u * arg(3u)) * arg(4u);
}

// The first key query `i` of row `b` sees: the sliding window's, and its document's start.
fn first_key(b: u32, i: u32) -> u32 {
    let window = arg(5u);
    var first = 0u;
    if (window != 0u && i + 1u > window) {
        first = i + 1u - window;
    }
    if (arg(6u) != 0u) {
        first = max(first, STARTS[b * arg(1u) + i]);
    }
    return first;
}

// The layer's mask seed, read once per thread.
var<private> mask_seed: vec2<u32>;
var<private> mask_seed_read: bool = false;

// The dropout factor of probability (b, h, i, j): 1/(1 − p) if kept, else 0 (1 without
// dropout). The mask is the CPU's: keep iff hash_uniform(seed, ((bh')·T + i)·T + j) ≥ p, bh' the
// whole model's (batch, head) (tensor::llama::GqaDims::mask_bh).
fn drop_factor(b: u32, h: u32, i: u32, j: u32) -> f32 {
    let p = argf(7u);
    if (p == 0.0) {
        return 1.0;
    }
    if (!mask_seed_read) {
        mask_seed = read_seed(arg(9u), arg(15u), arg(10u));
        mask_seed_read = true;
    }
    let t = arg(1u);
    let mask_bh = (arg(13u) + b) * arg(11u) + arg(12u) + h;
    let index = add64(mul32(mask_bh * t + i, t), vec2<u32>(j, 0u));
    if (hash_uniform(mask_seed, index) >= p) {
        return argf(8u);
    }
    return 0.0;
}

// One workgroup's (batch, query head) over `b·NH + h`, and the shapes every kernel reads.
struct Head {
    b: u32,
    h: u32,
    g: u32,
    t: u32,
    nh: u32,
    nkv: u32,
    hs: u32,
    w: u32,
}

fn head_of(bh: u32) -> Head {
    let nh = arg(2u);
    let nkv = arg(3u);
    let h = bh % nh;
    return Head(bh / nh, h, h / (nh / nkv), arg(1u), nh, nkv, arg(4u), attn_w());
}

// Two TILE × MAX_HS tiles in workgroup memory: keys and values (forward, dq), or queries and
// output gradients (dk, dv).
var<workgroup> Ta: array<f32, 2048>;
var<workgroup> Tb: array<f32, 2048>;

// Rows k0 .. k0 + TILE of kv head g's keys into Ta and values into Tb, by the 64 threads.
fn load_kv(hd: Head, k0: u32, lid: u32) {
    for (var e = lid; e < TILE * hd.hs; e += 64u) {
        let kk = e / hd.hs;
        let d = e % hd.hs;
        let j = k0 + kk;
        if (j < hd.t) {
            let row = (hd.b * hd.t + j) * hd.w;
            Ta[kk * MAX_HS + d] = ld_QKV(row + (hd.nh + hd.g) * hd.hs + d);
            Tb[kk * MAX_HS + d] = ld_QKV(row + (hd.nh + hd.nkv + hd.g) * hd.hs + d);
        }
    }
}

// The first key any of the 64 queries from i0 sees under the sliding window.
fn window_start(i0: u32) -> u32 {
    let window = arg(5u);
    if (window != 0u && i0 + 1u > window) {
        return i0 + 1u - window;
    }
    return 0u;
}
