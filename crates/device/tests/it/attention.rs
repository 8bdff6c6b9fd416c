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
        tensor::flash::flash_gqa_backward_docs(&mut dqkv, &dout, &qkv, &out, &lse, &d, &st, drop);

        let (gq, go, gl) = (g.upload(&qkv), g.zeros(out.len()), g.zeros(lse.len()));
        let gs = docs.then(|| g.upload_u32(&st));
        g.flash_forward(&go, &gl, &gq, &d, gs.as_ref(), drop);
        close(&format!("flash out {name}"), &g.download(&go), &out, 1e-5);
        close(&format!("flash lse {name}"), &g.download(&gl), &lse, 1e-5);
        let (gd, scratch) = (g.upload(&dqkv0), g.zeros(b * nh * t));
        g.flash_backward(&gd, &scratch, &g.upload(&dout), (&gq, &go, &gl), &d, gs.as_ref(), drop);
        close(&format!("flash dqkv {name}"), &g.download(&gd), &dqkv, 1e-5);
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
