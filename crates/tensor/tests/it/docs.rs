//! Packed documents: FlashAttention with per-token document starts (GQA and MHA, sliding window,
//! small tiles, every backward schedule) against each document run on its own, the materialised
//! references with documents, finite differences, all-zero starts bit for bit the kernel without
//! documents; rope and the position embedding with explicit positions.

use crate::common::*;
use tensor::attention::AttnDims;
use tensor::flash::*;
use tensor::llama::{gqa_attention_backward, gqa_attention_forward_docs, rope_backward, rope_backward_pos, rope_forward, rope_forward_pos, rope_table, GqaDims};
use tensor::*;

const SCHEDULES: [Schedule; 4] = [Schedule::Auto, Schedule::PerHead, Schedule::TwoPass, Schedule::PerQueryHead];

/// Document starts `[B, T]` of rows packed with documents of the given lengths.
fn starts_of(rows: &[&[usize]]) -> Vec<u32> {
    let mut s = Vec::new();
    for lens in rows {
        let mut at = 0;
        for &n in lens.iter() {
            s.extend(std::iter::repeat_n(at as u32, n));
            at += n;
        }
    }
    s
}

/// Rows of `T` tokens: 23 = 5 + 9 + 1 + 8 (documents crossing tiles of 3, 4, 5 and 8, a
/// one-token document) and 23 = 13 + 10.
const LAYOUT: [&[usize]; 2] = [&[5, 9, 1, 8], &[13, 10]];
const T: usize = 23;
const TILES: [(usize, usize); 5] = [(4, 3), (3, 5), (8, 8), (1, 1), (64, 64)];

fn gqa_fwd(qkv: &[f32], d: &GqaDims, starts: &[u32], p: f32, tiles: Tiles) -> (Vec<f32>, Vec<f32>) {
    let (mut o, mut l) = (vec![f32::NAN; d.b * d.t * d.c()], vec![f32::NAN; d.b * d.nh * d.t]);
    flash_gqa_forward_docs_tiled(&mut o, &mut l, qkv, d, starts, AttnDropout { p, seed: 7 }, tiles);
    (o, l)
}

fn gqa_bwd(dout: &[f32], qkv: &[f32], d: &GqaDims, starts: &[u32], p: f32, tiles: Tiles, schedule: Schedule) -> Vec<f32> {
    let (o, l) = gqa_fwd(qkv, d, starts, p, tiles);
    let mut g = vec![0.0; qkv.len()];
    flash_gqa_backward_docs_with(&mut g, dout, (qkv, &o, &l), d, starts, BwdOpts { dropout: AttnDropout { p, seed: 7 }, tiles, schedule });
    g
}

/// Rows `t0 .. t0 + n` of batch row `b` of a `[B, T, width]` buffer.
fn rows(x: &[f32], b: usize, t0: usize, n: usize, width: usize) -> &[f32] {
    &x[(b * T + t0) * width..(b * T + t0 + n) * width]
}

/// `lse[b, h, t0 .. t0 + n]` of a `[B, NH, T]` buffer, heads concatenated.
fn lse_rows(l: &[f32], b: usize, nh: usize, t0: usize, n: usize) -> Vec<f32> {
    (0..nh).flat_map(|h| l[(b * nh + h) * T + t0..(b * nh + h) * T + t0 + n].to_vec()).collect()
}

/// Packed attention equals each document attended on its own: `out`, `lse` and `dqkv`.
fn assert_docs_equal_separate(nh: usize, nkv: usize, window: usize, tiles: Tiles) {
    let d = GqaDims { b: 2, t: T, nh, nkv, hs: 8, window, ..Default::default() };
    let (w, c) = (d.qkv_width(), d.c());
    let mut rng = Rng::new((nh * 100 + nkv * 10 + window + tiles.br * 1000 + tiles.bc * 7) as u64);
    let qkv = randn(&mut rng, d.b * T * w, 1.0);
    let dout = randn(&mut rng, d.b * T * c, 1.0);
    let starts = starts_of(&LAYOUT);
    let (o, l) = gqa_fwd(&qkv, &d, &starts, 0.0, tiles);
    let grads: Vec<Vec<f32>> = SCHEDULES.iter().map(|&s| gqa_bwd(&dout, &qkv, &d, &starts, 0.0, tiles, s)).collect();
    for g in &grads[1..] {
        assert!(g == &grads[0], "schedules differ with documents");
    }
    for (b, lens) in LAYOUT.iter().enumerate() {
        let mut t0 = 0;
        for &n in lens.iter() {
            let sd = GqaDims { b: 1, t: n, ..d };
            let sq = rows(&qkv, b, t0, n, w);
            let (so, sl) = gqa_fwd(sq, &sd, &[], 0.0, tiles);
            let sg = gqa_bwd(rows(&dout, b, t0, n, c), sq, &sd, &[], 0.0, tiles, Schedule::Auto);
            let what = format!("NH={nh} NKV={nkv} window={window} {tiles:?} row {b} doc at {t0}+{n}");
            let eo = max_err(rows(&o, b, t0, n, c), &so);
            let el = max_err(&lse_rows(&l, b, nh, t0, n), &sl);
            let eg = max_err(rows(&grads[0], b, t0, n, w), &sg);
            assert!(eo < 1e-6 && el < 1e-6 && eg < 1e-6, "{what}: out {eo}, lse {el}, dqkv {eg}");
            t0 += n;
        }
    }
}

#[test]
fn gqa_docs_equal_documents_run_separately() {
    for (br, bc) in TILES {
        for (nh, nkv) in [(4, 2), (4, 1), (3, 3)] {
            for window in [0, 4] {
                assert_docs_equal_separate(nh, nkv, window, Tiles { br, bc });
            }
        }
    }
}

#[test]
fn mha_docs_equal_documents_run_separately() {
    let d = AttnDims { b: 2, t: T, c: 16, nh: 2, ..Default::default() };
    let mut rng = Rng::new(41);
    let qkv = randn(&mut rng, d.b * T * 3 * d.c, 1.0);
    let dout = randn(&mut rng, d.b * T * d.c, 1.0);
    let starts = starts_of(&LAYOUT);
    let fwd = |x: &[f32], d: &AttnDims, s: &[u32], tl: Tiles| {
        let (mut o, mut l) = (vec![0.0; d.b * d.t * d.c], vec![0.0; d.b * d.nh * d.t]);
        flash_attention_forward_docs_tiled(&mut o, &mut l, x, d, s, AttnDropout::NONE, tl);
        (o, l)
    };
    let bwd = |dy: &[f32], x: &[f32], d: &AttnDims, s: &[u32], tl: Tiles, schedule: Schedule| {
        let (o, l) = fwd(x, d, s, tl);
        let mut g = vec![0.0; x.len()];
        flash_attention_backward_docs_with(&mut g, dy, (x, &o, &l), d, s, BwdOpts { dropout: AttnDropout::NONE, tiles: tl, schedule });
        g
    };
    for (br, bc) in TILES {
        let tl = Tiles { br, bc };
        let (o, l) = fwd(&qkv, &d, &starts, tl);
        let g = bwd(&dout, &qkv, &d, &starts, tl, Schedule::PerHead);
        assert!(g == bwd(&dout, &qkv, &d, &starts, tl, Schedule::TwoPass), "{tl:?}: schedules differ");
        for (b, lens) in LAYOUT.iter().enumerate() {
            let mut t0 = 0;
            for &n in lens.iter() {
                let sd = AttnDims { b: 1, t: n, ..d };
                let sq = rows(&qkv, b, t0, n, 3 * d.c);
                let (so, sl) = fwd(sq, &sd, &[], tl);
                let sg = bwd(rows(&dout, b, t0, n, d.c), sq, &sd, &[], tl, Schedule::Auto);
                let (eo, el, eg) = (max_err(rows(&o, b, t0, n, d.c), &so), max_err(&lse_rows(&l, b, d.nh, t0, n), &sl), max_err(rows(&g, b, t0, n, 3 * d.c), &sg));
                assert!(eo < 1e-6 && el < 1e-6 && eg < 1e-6, "{tl:?} row {b} doc {t0}+{n}: out {eo}, lse {el}, dqkv {eg}");
                t0 += n;
            }
        }
    }
}

#[test]
fn zero_starts_are_bit_identical_to_no_documents() {
    let zeros = vec![0u32; 2 * T];
    for (br, bc) in [(4, 3), (64, 64)] {
        let tl = Tiles { br, bc };
        for (window, p) in [(0, 0.0), (0, 0.2), (5, 0.2)] {
            let d = GqaDims { b: 2, t: T, nh: 4, nkv: 2, hs: 8, window, ..Default::default() };
            let mut rng = Rng::new(5);
            let qkv = randn(&mut rng, d.b * T * d.qkv_width(), 1.0);
            let dout = randn(&mut rng, d.b * T * d.c(), 1.0);
            assert!(gqa_fwd(&qkv, &d, &zeros, p, tl) == gqa_fwd(&qkv, &d, &[], p, tl), "forward {tl:?} window {window} p {p}");
            for s in SCHEDULES {
                assert!(gqa_bwd(&dout, &qkv, &d, &zeros, p, tl, s) == gqa_bwd(&dout, &qkv, &d, &[], p, tl, s), "backward {tl:?} window {window} p {p} {s:?}");
            }
            // The public entry points: the default tiles, and the MHA wrappers.
            let (mut o1, mut l1, mut o2, mut l2) = (vec![0.0; d.b * T * d.c()], vec![0.0; d.b * d.nh * T], vec![0.0; d.b * T * d.c()], vec![0.0; d.b * d.nh * T]);
            flash_gqa_forward_docs(&mut o1, &mut l1, &qkv, &d, &zeros, AttnDropout { p, seed: 3 });
            flash_gqa_forward(&mut o2, &mut l2, &qkv, &d, AttnDropout { p, seed: 3 });
            assert!(o1 == o2 && l1 == l2);
            let (mut g1, mut g2) = (vec![0.0; qkv.len()], vec![0.0; qkv.len()]);
            flash_gqa_backward_docs(&mut g1, &dout, (&qkv, &o1, &l1), &d, &zeros, AttnDropout { p, seed: 3 });
            flash_gqa_backward(&mut g2, &dout, &qkv, &o2, &l2, &d, AttnDropout { p, seed: 3 });
            assert!(g1 == g2);
        }
    }
    let d = AttnDims { b: 2, t: T, c: 16, nh: 2, ..Default::default() };
    let mut rng = Rng::new(6);
    let qkv = randn(&mut rng, d.b * T * 3 * d.c, 1.0);
    let dout = randn(&mut rng, d.b * T * d.c, 1.0);
    let drop = AttnDropout { p: 0.2, seed: 4 };
    let (mut o1, mut l1, mut o2, mut l2) = (vec![0.0; d.b * T * d.c], vec![0.0; d.b * d.nh * T], vec![0.0; d.b * T * d.c], vec![0.0; d.b * d.nh * T]);
    flash_attention_forward_docs(&mut o1, &mut l1, &qkv, &d, &zeros, drop);
    flash_attention_forward(&mut o2, &mut l2, &qkv, &d, drop);
    assert!(o1 == o2 && l1 == l2, "MHA forward");
    let (mut g1, mut g2) = (vec![0.0; qkv.len()], vec![0.0; qkv.len()]);
    flash_attention_backward_docs(&mut g1, &dout, (&qkv, &o1, &l1), &d, &zeros, drop);
    flash_attention_backward(&mut g2, &dout, &qkv, &o2, &l2, &d, drop);
    assert!(g1 == g2, "MHA backward");
}

#[test]
fn docs_match_the_materialised_references() {
    let starts = starts_of(&LAYOUT);
    // GQA (no dropout in the reference), with and without a sliding window.
    for window in [0, 6] {
        let d = GqaDims { b: 2, t: T, nh: 4, nkv: 2, hs: 8, window, ..Default::default() };
        let mut rng = Rng::new(8 + window as u64);
        let qkv = randn(&mut rng, d.b * T * d.qkv_width(), 1.5);
        let dout = randn(&mut rng, d.b * T * d.c(), 1.0);
        let (mut ro, mut att) = (vec![0.0; d.b * T * d.c()], vec![0.0; d.b * d.nh * T * T]);
        gqa_attention_forward_docs(&mut ro, &mut att, &qkv, &d, &starts);
        let mut rg = vec![0.0; qkv.len()];
        gqa_attention_backward(&mut rg, &dout, &qkv, &att, &d);
        let tl = Tiles { br: 4, bc: 3 };
        assert!(max_err(&gqa_fwd(&qkv, &d, &starts, 0.0, tl).0, &ro) < 1e-5, "GQA out, window {window}");
        assert!(max_err(&gqa_bwd(&dout, &qkv, &d, &starts, 0.0, tl, Schedule::Auto), &rg) < 1e-5, "GQA dqkv, window {window}");
    }
    // MHA, with dropout: the same mask indices in both.
    let d = AttnDims { b: 2, t: T, c: 16, nh: 2, ..Default::default() };
    let mut rng = Rng::new(10);
    let qkv = randn(&mut rng, d.b * T * 3 * d.c, 1.5);
    let dout = randn(&mut rng, d.b * T * d.c, 1.0);
    for p in [0.0, 0.3] {
        let drop = AttnDropout { p, seed: 12 };
        let (mut ro, mut att) = (vec![0.0; d.b * T * d.c], vec![0.0; d.b * d.nh * T * T]);
        attention_forward_docs(&mut ro, &mut att, &qkv, &d, &starts, drop);
        let mut rg = vec![0.0; qkv.len()];
        attention_backward(&mut rg, &dout, &qkv, &att, &d, drop);
        let tl = Tiles { br: 3, bc: 5 };
        let (mut o, mut l) = (vec![0.0; d.b * T * d.c], vec![0.0; d.b * d.nh * T]);
        flash_attention_forward_docs_tiled(&mut o, &mut l, &qkv, &d, &starts, drop, tl);
        let mut g = vec![0.0; qkv.len()];
        flash_attention_backward_docs_with(&mut g, &dout, (&qkv, &o, &l), &d, &starts, BwdOpts { dropout: drop, tiles: tl, schedule: Schedule::Auto });
        assert!(max_err(&o, &ro) < 1e-5, "MHA out p={p}");
        assert!(max_err(&g, &rg) < 1e-5, "MHA dqkv p={p}");
    }
}

#[test]
fn docs_gradients_match_finite_differences() {
    // Two rows of T = 7: 3 + 4 and 2 + 1 + 4; tiles of 2×3 so documents cross tiles.
    let layout: [&[usize]; 2] = [&[3, 4], &[2, 1, 4]];
    let starts = starts_of(&layout);
    for (window, p) in [(0, 0.0), (3, 0.0), (0, 0.25)] {
        let d = GqaDims { b: 2, t: 7, nh: 2, nkv: 1, hs: 4, window, ..Default::default() };
        let tl = Tiles { br: 2, bc: 3 };
        let mut rng = Rng::new(13 + window as u64);
        let qkv = randn(&mut rng, d.b * d.t * d.qkv_width(), 1.0);
        let dout = randn(&mut rng, d.b * d.t * d.c(), 1.0);
        let fwd = |x: &[f32]| dot(&gqa_fwd(x, &d, &starts, p, tl).0, &dout);
        let g = gqa_bwd(&dout, &qkv, &d, &starts, p, tl, Schedule::Auto);
        check(&format!("flash docs (window {window}, p {p}).dqkv"), &qkv, &g, fwd);
    }
}

#[test]
#[should_panic(expected = "non-decreasing")]
fn decreasing_starts_are_refused() {
    let d = GqaDims { b: 1, t: 4, nh: 1, nkv: 1, hs: 4, ..Default::default() };
    let qkv = vec![0.0; 4 * d.qkv_width()];
    gqa_fwd(&qkv, &d, &[0, 1, 0, 3], 0.0, Tiles::default());
}

// ---------------------------------------------------------------------------------------------
// Explicit positions

#[test]
fn rope_pos_matches_rope_with_offset_and_restarts_per_document() {
    let d = GqaDims { b: 2, t: T, nh: 4, nkv: 2, hs: 8, ..Default::default() };
    let (cos, sin) = rope_table(10000.0, d.hs, 64);
    let mut rng = Rng::new(21);
    let x = randn(&mut rng, d.b * T * d.qkv_width(), 1.0);
    for offset in [0, 9] {
        let pos: Vec<u32> = (0..d.b * T).map(|i| (offset + i % T) as u32).collect();
        let (mut a, mut b) = (x.clone(), x.clone());
        rope_forward(&mut a, &cos, &sin, &d, offset);
        rope_forward_pos(&mut b, &cos, &sin, &d, &pos);
        assert!(a == b, "forward, offset {offset}");
        rope_backward(&mut a, &cos, &sin, &d, offset);
        rope_backward_pos(&mut b, &cos, &sin, &d, &pos);
        assert!(a == b, "backward, offset {offset}");
        assert!(max_err(&a, &x) < 1e-5, "backward inverts forward");
    }
    // Positions restarting per document: each document rotated as a sequence of its own.
    let starts = starts_of(&LAYOUT);
    let pos: Vec<u32> = starts.iter().enumerate().map(|(i, &s)| (i % T) as u32 - s).collect();
    let mut packed = x.clone();
    rope_forward_pos(&mut packed, &cos, &sin, &d, &pos);
    let w = d.qkv_width();
    for (b, lens) in LAYOUT.iter().enumerate() {
        let mut t0 = 0;
        for &n in lens.iter() {
            let mut one = rows(&x, b, t0, n, w).to_vec();
            rope_forward(&mut one, &cos, &sin, &GqaDims { b: 1, t: n, ..d }, 0);
            assert!(one == rows(&packed, b, t0, n, w), "row {b} doc {t0}+{n}");
            t0 += n;
        }
    }
}

#[test]
fn embedding_with_positions() {
    let (b, t, c, v, max_t) = (2, 5, 3, 6, 8);
    let tokens: Vec<u32> = (0..b * t).map(|i| (i * 7 % v) as u32).collect();
    let mut rng = Rng::new(22);
    let wte = randn(&mut rng, v * c, 1.0);
    let wpe = randn(&mut rng, max_t * c, 1.0);
    let dout = randn(&mut rng, b * t * c, 1.0);
    // pos = i mod T: bit for bit the embedding without positions.
    let cyclic: Vec<u32> = (0..b * t).map(|i| (i % t) as u32).collect();
    let (mut o1, mut o2) = (vec![0.0; b * t * c], vec![0.0; b * t * c]);
    embedding_forward(&mut o1, &tokens, &wte, Some(&wpe), t, c);
    embedding_forward_rows(&mut o2, &tokens, (&wte, Some(&wpe)), Some(&cyclic), t, c, 0..v);
    assert!(o1 == o2);
    let (mut dte1, mut dpe1, mut dte2, mut dpe2) = (vec![0.0; v * c], vec![0.0; max_t * c], vec![0.0; v * c], vec![0.0; max_t * c]);
    embedding_backward(&mut dte1, Some(&mut dpe1), &dout, &tokens, t, c);
    embedding_backward_rows((&mut dte2, Some(&mut dpe2)), &dout, &tokens, Some(&cyclic), t, c, 0..v);
    assert!(dte1 == dte2 && dpe1 == dpe2);
    // Arbitrary positions (repeated, out of order, up to maxT − 1).
    let pos = [3u32, 0, 1, 7, 3, 0, 1, 2, 0, 3];
    let mut o = vec![0.0; b * t * c];
    embedding_forward_rows(&mut o, &tokens, (&wte, Some(&wpe)), Some(&pos), t, c, 0..v);
    for i in 0..b * t {
        for k in 0..c {
            assert_eq!(o[i * c + k], wte[tokens[i] as usize * c + k] + wpe[pos[i] as usize * c + k]);
        }
    }
    let (mut dte, mut dpe) = (vec![0.0; v * c], vec![0.0; max_t * c]);
    embedding_backward_rows((&mut dte, Some(&mut dpe)), &dout, &tokens, Some(&pos), t, c, 0..v);
    assert!(dte == dte1, "dwte does not depend on positions");
    check("embedding_pos.dwpe", &wpe, &dpe, |x| {
        let mut o = vec![0.0; b * t * c];
        embedding_forward_rows(&mut o, &tokens, (&wte, Some(x)), Some(&pos), t, c, 0..v);
        dot(&o, &dout)
    });
    // A vocabulary slice (rows 2..5): the positions' gradient is still every token's.
    let (mut dte_s, mut dpe_s) = (vec![0.0; 3 * c], vec![0.0; max_t * c]);
    embedding_backward_rows((&mut dte_s, Some(&mut dpe_s)), &dout, &tokens, Some(&pos), t, c, 2..5);
    assert!(dpe_s == dpe && dte_s == dte[2 * c..5 * c]);
}
