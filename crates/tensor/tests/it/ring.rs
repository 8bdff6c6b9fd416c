//! Blocks of attention (`tensor::flash::Block`), the kernel of context parallelism: a sequence
//! cut into chunks held by simulated ranks, each rank's queries attending every visible chunk's
//! keys one block at a time (its own first, the others in ring order, merged through the running
//! log-sum-exp), and the backward's `dq` on the queries' rank and `dk`, `dv` on the keys' —
//! equal to the whole-sequence kernel within float rounding, with GQA, dropout, a sliding
//! window and packed documents, for contiguous and zig-zag chunks and tiles that cross chunk
//! edges.

use tensor::attention::AttnDropout;
use tensor::flash::*;
use tensor::llama::GqaDims;
use tensor::*;
use crate::common::*;

/// The chunks (first position, length) rank `r` of `n` holds of a length-`t` sequence: one
/// contiguous chunk, or with zig-zag chunks `r` and `2n − 1 − r` of `2n`.
fn chunks(r: usize, n: usize, t: usize, zigzag: bool) -> Vec<(usize, usize)> {
    if zigzag {
        let h = t / (2 * n);
        vec![(r * h, h), ((2 * n - 1 - r) * h, h)]
    } else {
        vec![(r * t / n, t / n)]
    }
}

/// Rows of `x` (`[B, T, w]`) at the rank's chunks, in order: `[B, Tl, w]`.
fn rows_of(x: &[f32], b: usize, t: usize, w: usize, ch: &[(usize, usize)]) -> Vec<f32> {
    let mut out = Vec::new();
    for bi in 0..b {
        for &(p0, len) in ch {
            out.extend_from_slice(&x[(bi * t + p0) * w..(bi * t + p0 + len) * w]);
        }
    }
    out
}

/// Puts a rank's `[B, Tl, w]` rows back into `dst` (`[B, T, w]`).
fn put_rows(dst: &mut [f32], src: &[f32], b: usize, t: usize, w: usize, ch: &[(usize, usize)]) {
    let tl: usize = ch.iter().map(|c| c.1).sum();
    for bi in 0..b {
        let mut i = 0;
        for &(p0, len) in ch {
            dst[(bi * t + p0) * w..(bi * t + p0 + len) * w].copy_from_slice(&src[(bi * tl + i) * w..(bi * tl + i + len) * w]);
            i += len;
        }
    }
}

/// `lse` (`[B, NH, T]`) entries of a rank's rows, and back.
fn lse_put(dst: &mut [f32], src: &[f32], d: &GqaDims, ch: &[(usize, usize)]) {
    let tl: usize = ch.iter().map(|c| c.1).sum();
    for bh in 0..d.b * d.nh {
        let mut i = 0;
        for &(p0, len) in ch {
            dst[bh * d.t + p0..bh * d.t + p0 + len].copy_from_slice(&src[bh * tl + i..bh * tl + i + len]);
            i += len;
        }
    }
}

/// The spans of a rank's chunks in its `[B, Tl, ·]` buffers.
fn spans(ch: &[(usize, usize)]) -> Vec<Span> {
    let tl: usize = ch.iter().map(|c| c.1).sum();
    let mut row0 = 0;
    ch.iter()
        .map(|&(pos0, len)| {
            let s = Span { rows: tl, row0, len, pos0 };
            row0 += len;
            s
        })
        .collect()
}

struct Case {
    d: GqaDims,
    n: usize,
    zigzag: bool,
    p: f32,
    tiles: Tiles,
    docs: bool,
}

/// Runs `case` on `n` simulated ranks; returns (out, lse, dqkv) assembled in the whole layout.
fn ring(qkv: &[f32], dout: &[f32], starts: &[u32], cs: &Case) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (d, n) = (cs.d, cs.n);
    let (b, t, nh, nkv, hs) = (d.b, d.t, d.nh, d.nkv, d.hs);
    let (w, c, kw) = (d.qkv_width(), d.c(), 2 * nkv * hs);
    let drop = AttnDropout { p: cs.p, seed: 5 };
    let chs: Vec<Vec<(usize, usize)>> = (0..n).map(|r| chunks(r, n, t, cs.zigzag)).collect();
    let tl = t / n;
    let local: Vec<Vec<f32>> = chs.iter().map(|ch| rows_of(qkv, b, t, w, ch)).collect();
    // The keys and values a rank sends round the ring: [B, Tl, 2·NKV·HS].
    let kv: Vec<Vec<f32>> = local.iter().map(|x| x.chunks(w).flat_map(|row| row[nh * hs..].to_vec()).collect()).collect();
    let st: Vec<Vec<u32>> = chs.iter().map(|ch| if cs.docs { rows_of(&starts.iter().map(|&s| s as f32).collect::<Vec<_>>(), b, t, 1, ch).iter().map(|&s| s as u32).collect() } else { Vec::new() }).collect();
    let blocks = |r: usize, o: usize| {
        let mut v = Vec::new();
        for qs in spans(&chs[r]) {
            for ks in spans(&chs[o]) {
                // Keys wholly after the queries are invisible.
                if ks.pos0 < qs.pos0 + qs.len {
                    v.push((qs, ks));
                }
            }
        }
        v
    };
    let (mut out, mut lse, mut dqkv) = (vec![0.0; b * t * c], vec![0.0; b * nh * t], vec![0.0; b * t * w]);
    let mut dkv: Vec<Vec<f32>> = (0..n).map(|_| vec![0.0; b * tl * kw]).collect();
    let mut dq_local: Vec<Vec<f32>> = (0..n).map(|_| vec![0.0; b * tl * w]).collect();
    for r in 0..n {
        let (mut o, mut l) = (vec![f32::NAN; b * tl * c], vec![f32::NAN; b * nh * tl]);
        // The rank's own keys first (each chunk's diagonal block fresh), then the ring: the
        // keys of ranks r−1, r−2, …
        for s in 0..n {
            let owner = (r + n - s) % n;
            let mut bl = blocks(r, owner);
            // Within the own step, each chunk's diagonal block first (it starts the state).
            bl.sort_by_key(|(q, k)| q != k);
            for (qs, ks) in bl {
                let fresh = s == 0 && qs == ks;
                let blk = Block { qkv: &local[r], q: qs, kv: &kv[owner], kw, kc: 0, vc: nkv * hs, k: ks, starts: &st[r] };
                flash_gqa_block_forward_tiled(&mut o, &mut l, &blk, &d, fresh, drop, cs.tiles);
            }
        }
        let dl = rows_of(dout, b, t, c, &chs[r]);
        let mut dd = vec![0.0; b * nh * tl];
        flash_d(&mut dd, &dl, &o, &d, tl);
        for s in 0..n {
            let owner = (r + n - s) % n;
            for (qs, ks) in blocks(r, owner) {
                let blk = Block { qkv: &local[r], q: qs, kv: &kv[owner], kw, kc: 0, vc: nkv * hs, k: ks, starts: &st[r] };
                flash_gqa_block_backward_with((&mut dq_local[r], Some(&mut dkv[owner])), &dl, &l, &dd, &blk, &d, BwdOpts { dropout: drop, tiles: cs.tiles, ..Default::default() });
            }
        }
        put_rows(&mut out, &o, b, t, c, &chs[r]);
        lse_put(&mut lse, &l, &d, &chs[r]);
    }
    for r in 0..n {
        // Each rank's dq columns, and the dk, dv its keys collected round the ring.
        let mut g = dq_local[r].clone();
        for (row, kvrow) in g.chunks_mut(w).zip(dkv[r].chunks(kw)) {
            row[nh * hs..].iter_mut().zip(kvrow).for_each(|(a, b)| *a += b);
        }
        put_rows(&mut dqkv, &g, b, t, w, &chs[r]);
    }
    (out, lse, dqkv)
}

#[test]
fn ring_blocks_match_the_whole_sequence_kernel() {
    let tiles = [Tiles { br: 64, bc: 64 }, Tiles { br: 3, bc: 5 }, Tiles { br: 8, bc: 4 }];
    let mut k = 0;
    for &(nh, nkv) in &[(4usize, 4usize), (4, 2), (4, 1)] {
        for &n in &[2usize, 4] {
            for &zigzag in &[false, true] {
                for &(p, window, sinks, docs) in &[(0.0f32, 0usize, 0usize, false), (0.2, 0, 0, false), (0.0, 7, 0, false), (0.1, 0, 0, true), (0.0, 5, 0, true), (0.1, 5, 3, false), (0.0, 4, 2, true)] {
                    k += 1;
                    let t = 48;
                    let d = GqaDims { b: 2, t, nh, nkv, hs: 8, window, b0: 1, head0: 0, heads: 0, sinks, rotary: 0, scale: 0.0, softcap: 0.0 };
                    let cs = Case { d, n, zigzag, p, tiles: tiles[k % tiles.len()], docs };
                    let mut rng = Rng::new(k as u64);
                    let qkv = randn(&mut rng, d.b * t * d.qkv_width(), 1.0);
                    let dout = randn(&mut rng, d.b * t * d.c(), 1.0);
                    // Documents of 11, 20, 1, 16 and 30, 18 tokens: boundaries inside chunks and on them.
                    let starts: Vec<u32> = [&[11usize, 20, 1, 16][..], &[30, 18]].iter().flat_map(|lens| {
                        let mut at = 0;
                        lens.iter().flat_map(move |&l| { let s = at; at += l; std::iter::repeat_n(s as u32, l) }).collect::<Vec<_>>()
                    }).collect();
                    let st: &[u32] = if docs { &starts } else { &[] };
                    let (mut wo, mut wl) = (vec![0.0; d.b * t * d.c()], vec![0.0; d.b * nh * t]);
                    let drop = AttnDropout { p, seed: 5 };
                    flash_gqa_forward_docs_tiled(&mut wo, &mut wl, &qkv, &d, st, drop, cs.tiles);
                    let mut wg = vec![0.0; qkv.len()];
                    flash_gqa_backward_docs_with(&mut wg, &dout, (&qkv, &wo, &wl), &d, st, BwdOpts { dropout: drop, tiles: cs.tiles, ..Default::default() });
                    let (o, l, g) = ring(&qkv, &dout, &starts, &cs);
                    let what = format!("nh {nh} nkv {nkv} cp {n} zigzag {zigzag} p {p} window {window} sinks {sinks} docs {docs}");
                    let scale = |x: &[f32]| x.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                    assert!(max_err(&o, &wo) < 2e-6 * scale(&wo), "out, {what}: {}", max_err(&o, &wo));
                    assert!(max_err(&l, &wl) < 2e-6 * scale(&wl), "lse, {what}: {}", max_err(&l, &wl));
                    assert!(max_err(&g, &wg) < 1e-5 * scale(&wg), "dqkv, {what}: {}", max_err(&g, &wg));
                }
            }
        }
    }
}

#[test]
fn a_block_a_row_cannot_see_leaves_it_untouched() {
    // Queries 0..8 against keys 8..16: nothing visible, so out and lse keep their values.
    let d = GqaDims { b: 1, t: 16, nh: 2, nkv: 1, hs: 4, ..Default::default() };
    let mut rng = Rng::new(3);
    let qkv = randn(&mut rng, 16 * d.qkv_width(), 1.0);
    let (w, hs) = (d.qkv_width(), d.hs);
    let blk = Block { qkv: &qkv, q: Span { rows: 16, row0: 0, len: 8, pos0: 0 }, kv: &qkv, kw: w, kc: 2 * hs, vc: 3 * hs, k: Span { rows: 16, row0: 8, len: 8, pos0: 8 }, starts: &[] };
    let (mut o, mut l) = (randn(&mut rng, 16 * d.c(), 1.0), randn(&mut rng, 2 * 16, 1.0));
    let (o0, l0) = (o.clone(), l.clone());
    flash_gqa_block_forward(&mut o, &mut l, &blk, &d, false, AttnDropout::default());
    assert_eq!(o, o0);
    assert_eq!(l, l0);
}
