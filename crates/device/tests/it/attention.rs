//! Flash attention forward and backward against `tensor::flash`: multi-head and grouped-query,
//! a sliding window, packed documents, dropout; shapes that are multiples of no tile.
use crate::common::{close, gpu, randn};
use tensor::attention::AttnDropout;
use tensor::llama::GqaDims;
use tensor::Rng;

/// Document starts for rows of `t`: documents of lengths 5, 9, … cut where they fall.
fn starts(b: usize, t: usize) -> Vec<u32> {
    let mut s = Vec::new();
    for _ in 0..b {
        let mut start = 0;
        for i in 0..t {
            if i - start >= 5 + start % 4 {
                start = i;
            }
            s.push(start as u32);
        }
    }
    s
}

#[test]
fn flash_attention_matches_cpu() {
    let g = gpu();
    let mut rng = Rng::new(31);
    #[rustfmt::skip]
    let cases = [
        // (b, t, nh, nkv, hs, window, docs, dropout)
        (2, 37, 3, 3, 8, 0, false, 0.0),
        (1, 70, 4, 2, 24, 0, false, 0.0),
        (2, 67, 6, 2, 16, 13, false, 0.0),
        (1, 45, 2, 1, 12, 0, true, 0.0),
        (2, 29, 4, 2, 8, 0, false, 0.2),
        (1, 130, 2, 2, 128, 0, false, 0.0),
    ];
    for (b, t, nh, nkv, hs, window, docs, p) in cases {
        let name = format!("b{b} t{t} nh{nh} nkv{nkv} hs{hs} window{window} docs{docs} p{p}");
        let d = GqaDims { b, t, nh, nkv, hs, window, heads: nh + 2, head0: 1, b0: 3, ..Default::default() };
        let drop = AttnDropout { p, seed: 0x1234_5678_9ABC };
        let st = if docs { starts(b, t) } else { Vec::new() };
        let qkv = randn(&mut rng, b * t * d.qkv_width(), 1.0);
        let dout = randn(&mut rng, b * t * d.c(), 1.0);
        let dqkv0 = randn(&mut rng, qkv.len(), 1.0);
        let (mut out, mut lse) = (vec![0.0; b * t * d.c()], vec![0.0; b * nh * t]);
        tensor::flash::flash_gqa_forward_docs(&mut out, &mut lse, &qkv, &d, &st, drop);
        let mut dqkv = dqkv0.clone();
        tensor::flash::flash_gqa_backward_docs(&mut dqkv, &dout, (&qkv, &out, &lse), &d, &st, drop);

        let (gq, go, gl) = (g.upload(&qkv), g.zeros(out.len()), g.zeros(lse.len()));
        let gs = docs.then(|| g.upload_u32(&st));
        g.flash_forward(&go, &gl, &gq, &d, gs.as_ref(), drop);
        close(&format!("flash out {name}"), &g.download(&go), &out, 1e-5);
        close(&format!("flash lse {name}"), &g.download(&gl), &lse, 1e-5);
        let (gd, scratch) = (g.upload(&dqkv0), g.zeros(b * nh * t));
        g.flash_backward(&gd, &scratch, &g.upload(&dout), (&gq, &go, &gl), (&d, gs.as_ref()), drop);
        close(&format!("flash dqkv {name}"), &g.download(&gd), &dqkv, 1e-5);
    }
}

/// A context-parallel rank's blocks of attention (ring attention under a zig-zag split of two
/// ranks: this rank holds chunks 0 and 3 of 4, the other 1 and 2, its keys and values packed
/// `[B, rows, K|V]`) against `tensor::flash`'s block kernels: each query chunk against this
/// rank's own chunks (keys in its q|k|v buffer) and the other rank's, merged through the running
/// log-sum-exp, invisible blocks leaving the state as it was; backward's query gradient and the
/// packed keys' and values' gradient. Sliding windows, packed documents (global starts) and
/// dropout by global position.
#[test]
fn flash_attention_blocks_match_cpu() {
    use tensor::flash::{Block, Span};
    let g = gpu();
    let mut rng = Rng::new(41);
    for (window, docs, p) in [(0, false, 0.0), (0, true, 0.2), (13, false, 0.1)] {
        let (b, t, nh, nkv, hs) = (2, 44, 4, 2, 8);
        let name = format!("window{window} docs{docs} p{p}");
        let d = GqaDims { b, t, nh, nkv, hs, window, b0: 1, ..Default::default() };
        let drop = AttnDropout { p, seed: 0x0BAD_5EED };
        let (w, ch, tl) = (d.qkv_width(), t / 4, t / 2);
        let whole = randn(&mut rng, b * t * w, 1.0);
        let all_starts = if docs { starts(b, t) } else { Vec::new() };
        // This rank's rows (chunks 0 and 3), and the other's keys and values packed.
        let rows = |chunks: [usize; 2]| -> Vec<usize> { (0..b).flat_map(|bi| chunks.iter().flat_map(move |&c| (c * ch..(c + 1) * ch).map(move |i| bi * t + i))).collect() };
        let mine: Vec<f32> = rows([0, 3]).iter().flat_map(|&r| whole[r * w..(r + 1) * w].to_vec()).collect();
        let (kc, kw) = (nh * hs, 2 * nkv * hs);
        let theirs: Vec<f32> = rows([1, 2]).iter().flat_map(|&r| whole[r * w + kc..(r + 1) * w].to_vec()).collect();
        let st: Vec<u32> = if docs { rows([0, 3]).iter().map(|&r| all_starts[r]).collect() } else { Vec::new() };
        let span = |row0: usize, pos0: usize| Span { rows: tl, row0, len: ch, pos0 };
        // (query chunk, key chunk, the other rank's) in ring order: own keys, then theirs.
        let q_spans = [span(0, 0), span(ch, 3 * ch)];
        let own = [span(0, 0), span(ch, 3 * ch)];
        let other = [span(0, ch), span(ch, 2 * ch)];
        let blocks: Vec<(Span, Span, bool)> = q_spans.iter().flat_map(|&q| own.iter().map(move |&k| (q, k, false)).chain(other.iter().map(move |&k| (q, k, true)))).collect();
        let cpu_block = |q: Span, k: Span, remote: bool| Block { qkv: &mine, q, kv: if remote { &theirs } else { &mine }, kw: if remote { kw } else { w }, kc: if remote { 0 } else { kc }, vc: if remote { nkv * hs } else { kc + nkv * hs }, k, starts: &st };
        let (mut out, mut lse) = (vec![0.0; b * tl * d.c()], vec![0.0; b * nh * tl]);
        let (gq, gk, go, gl) = (g.upload(&mine), g.upload(&theirs), g.zeros(out.len()), g.zeros(lse.len()));
        let gs = docs.then(|| g.upload_u32(&st));
        let seed_buf = g.upload_u32(&[drop.seed as u32, (drop.seed >> 32) as u32]);
        let seed = (p, device::Seed { buf: &seed_buf, at: 0, site: None });
        let dev_block = |k: Span, remote: bool| match remote {
            true => device::KvBlock { buf: &gk, span: k, kw, kc: 0, vc: nkv * hs },
            false => device::KvBlock { buf: &gq, span: k, kw: w, kc, vc: kc + nkv * hs },
        };
        for (n, &(q, k, remote)) in blocks.iter().enumerate() {
            let fresh = n % 4 == 0;
            tensor::flash::flash_gqa_block_forward(&mut out, &mut lse, &cpu_block(q, k, remote), &d, fresh, drop);
            g.flash_block_forward((&go, &gl), (&gq, q), dev_block(k, remote), (&d, gs.as_ref()), seed, fresh);
        }
        close(&format!("block out {name}"), &g.download(&go), &out, 1e-5);
        close(&format!("block lse {name}"), &g.download(&gl), &lse, 1e-5);
        let dout = randn(&mut rng, out.len(), 1.0);
        let mut dd = vec![0.0; b * nh * tl];
        tensor::flash::flash_d(&mut dd, &dout, &out, &d, tl);
        let (gdd, gdout) = (g.zeros(dd.len()), g.upload(&dout));
        g.flash_d(&gdd, &gdout, &go, &d, tl);
        close(&format!("block D {name}"), &g.download(&gdd), &dd, 1e-5);
        let (mut dq, mut dkv) = (vec![0.0; mine.len()], vec![0.0; theirs.len()]);
        let (gdq, gdkv) = (g.zeros(dq.len()), g.zeros(dkv.len()));
        for &(q, k, remote) in &blocks {
            let dkv_cpu = if remote { Some(&mut dkv[..]) } else { None };
            tensor::flash::flash_gqa_block_backward((&mut dq, dkv_cpu), &dout, &lse, &dd, &cpu_block(q, k, remote), &d, drop);
            g.flash_block_backward((&gdq, if remote { &gdkv } else { &gdq }), (&gdd, &gdout), (&gq, &gl, q), dev_block(k, remote), (&d, gs.as_ref()), seed);
        }
        close(&format!("block dq {name}"), &g.download(&gdq), &dq, 1e-5);
        close(&format!("block dkv {name}"), &g.download(&gdkv), &dkv, 1e-5);
    }
}

#[test]
fn attention_decode_matches_cpu() {
    let g = gpu();
    let mut rng = Rng::new(33);
    let (max_t, nh, nkv, hs) = (29, 6, 2, 16);
    let kw = nkv * hs;
    // Two layers' caches in one buffer: the second's from element `at`.
    let at = max_t * kw;
    let (k, v) = (randn(&mut rng, 2 * max_t * kw, 1.0), randn(&mut rng, 2 * max_t * kw, 1.0));
    let q = randn(&mut rng, nh * hs, 1.0);
    let (gk, gv, gq, o) = (g.upload(&k), g.upload(&v), g.upload(&q), g.zeros(nh * hs));
    for (t, window) in [(1, 0), (17, 0), (29, 0), (23, 6)] {
        let d = GqaDims { b: 1, t, nh, nkv, hs, window, ..Default::default() };
        let mut want = vec![0.0; nh * hs];
        tensor::attention::attention_decode(&mut want, &q, &k[at..at + t * kw], &v[at..at + t * kw], &d);
        g.attention_decode(&o, &gq, (&gk, &gv), at, &d);
        close(&format!("attention_decode t{t} window{window}"), &g.download(&o), &want, 1e-5);
    }
}
