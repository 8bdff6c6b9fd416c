// What the attention kernels share. Their args: b t nh nkv hs window has_starts p drop_scale
// seed_at site heads head0 b0 softmax_scale has_site (the mask seed: read_seed, lib_rng.wgsl),
// then the block (tensor::flash::Block): q_rows q_row0 q_len q_pos0, k_rows k_row0 k_len k_pos0,
// kw kc vc, fresh. The queries are rows q_row0 .. q_row0 + q_len of each batch row's q_rows in
// QKV, at positions from q_pos0; the keys and values rows k_row0 .. of k_rows in KV (kw wide,
// kv head g's key at column kc + g·HS, its value at vc + g·HS), at positions from k_pos0. T is
// the whole sequence's length: masks, windows, documents and dropout are by global position.
const MAX_HS: u32 = 128u;
const TILE: u32 = 16u;
// A score that is not there (masked); real scores are finite.
const NONE: f32 = -3.0e38;

fn attn_w() -> u32 {
    return (arg(2u) + 2u * arg(3u)) * arg(4u);
}

// The buffer rows of the block's query `i` and key `j` in batch row `b`.
fn q_row(b: u32, i: u32) -> u32 {
    return b * arg(16u) + arg(17u) + i;
}

fn k_row(b: u32, j: u32) -> u32 {
    return b * arg(20u) + arg(21u) + j;
}

// The first position the block's query `i` of row `b` sees: the sliding window's, and its
// document's start (STARTS holds global positions, one per query row).
fn first_key(b: u32, i: u32) -> u32 {
    let window = arg(5u);
    let pos = arg(19u) + i;
    var first = 0u;
    if (window != 0u && pos + 1u > window) {
        first = pos + 1u - window;
    }
    if (arg(6u) != 0u) {
        first = max(first, STARTS[q_row(b, i)]);
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

// The block's keys k0 .. k0 + TILE of kv head g into Ta and values into Tb, by the 64 threads.
fn load_kv(hd: Head, k0: u32, lid: u32) {
    for (var e = lid; e < TILE * hd.hs; e += 64u) {
        let kk = e / hd.hs;
        let d = e % hd.hs;
        let j = k0 + kk;
        if (j < arg(22u)) {
            let row = k_row(hd.b, j) * arg(24u);
            Ta[kk * MAX_HS + d] = ld_KV(row + arg(25u) + hd.g * hd.hs + d);
            Tb[kk * MAX_HS + d] = ld_KV(row + arg(26u) + hd.g * hd.hs + d);
        }
    }
}

// The first position any query from position `pos` on sees under the sliding window.
fn window_start(pos: u32) -> u32 {
    let window = arg(5u);
    if (window != 0u && pos + 1u > window) {
        return pos + 1u - window;
    }
    return 0u;
}

// The block's keys [x, y) that its queries i0 .. i1 (exclusive) can see: from the first
// query's window to the last query's position.
fn key_range(i0: u32, i1: u32) -> vec2<u32> {
    let k_pos0 = arg(23u);
    let first = window_start(arg(19u) + i0);
    let last = arg(19u) + i1;
    var lo = 0u;
    if (first > k_pos0) {
        lo = first - k_pos0;
    }
    var hi = 0u;
    if (last > k_pos0) {
        hi = min(last - k_pos0, arg(22u));
    }
    return vec2<u32>(lo, hi);
}

// The block's queries [x, y) that can see its keys j0 .. j0 + 64: from the first key's
// position to, under a window, the last key's window.
fn query_range(j0: u32) -> vec2<u32> {
    let q_pos0 = arg(19u);
    let q_len = arg(18u);
    let first = arg(23u) + j0;
    var lo = 0u;
    if (first > q_pos0) {
        lo = min(first - q_pos0, q_len);
    }
    var hi = q_len;
    let window = arg(5u);
    if (window != 0u) {
        let end = first + 63u + window;
        hi = 0u;
        if (end > q_pos0) {
            hi = min(end - q_pos0, q_len);
        }
    }
    return vec2<u32>(lo, hi);
}
