//! The LM head with cross-entropy, MoE routing, the optimizer (global norm, clipping, AdamW), and
//! QLoRA's dequantization against their CPU twins.
use crate::common::{close, gpu, randn, stored, tol};
use device::{slot, DType};
use tensor::classifier::HeadDims;
use tensor::matmul::Arith;
use tensor::moe::{moe_assign, moe_combine, moe_combine_backward, moe_dispatch, moe_dispatch_backward, moe_route, moe_router_backward, MoeRoute};
use tensor::optim::AdamW;
use tensor::Rng;

#[test]
fn lm_head_crossentropy_matches_cpu_in_chunks_and_types() {
    let g = gpu();
    let mut rng = Rng::new(41);
    let (n, c, v, vp) = (23, 19, 41, 48);
    let mut targets: Vec<i32> = (0..n).map(|_| rng.below(v as u64) as i32).collect();
    targets[3] = -100;
    targets[17] = -100;
    let count = targets.iter().filter(|&&t| t != -100).count();
    let dloss = 0.7 / count as f32;
    let dims = HeadDims { c, v, vp, offset: 0, ignore_index: -100, arith: Arith::F32, softcap: 0.0 };
    for (dtype, chunk) in [(DType::F32, 5), (DType::F32, n), (DType::Bf16, 7)] {
        let name = format!("{dtype:?} chunks of {chunk}");
        let (x, w) = (randn(&mut rng, n * c, 1.0), randn(&mut rng, vp * c, 0.5));
        let (xs, ws) = (stored(&x, dtype), stored(&w, dtype));
        let dw0 = randn(&mut rng, vp * c, 1.0);
        let (mut losses, mut dinp, mut dw) = (vec![0.0; n], vec![0.0; n * c], dw0.clone());
        let mut scratch = vec![0.0; n * vp];
        tensor::classifier::lm_head_crossentropy(&mut losses, Some((&mut dinp, &mut dw, tensor::classifier::Dloss::All(dloss))), &xs, &ws, &targets, &mut scratch, &dims);

        let tg = g.upload_u32(&targets.iter().map(|&t| t as u32).collect::<Vec<_>>());
        let (gx, gw, gdw, scal) = (g.upload_as(&x, dtype), g.upload_as(&w, dtype), g.upload(&dw0), g.upload(&[0.0, dloss]));
        let (gl, gdi, gs) = (g.zeros(n), g.zeros(n * c), g.zeros(chunk * vp));
        g.lm_head_crossentropy(&gl, Some((&gdi, Some(gdw.at(0)), (&scal, 1))), &gx, gw.at(0), &tg, &gs, &dims);
        let t = tol(DType::F32);
        close(&format!("losses {name}"), &g.download(&gl), &losses, t);
        close(&format!("dinp {name}"), &g.download(&gdi), &dinp, t);
        close(&format!("dweight {name}"), &g.download(&gdw), &dw, t);
        // Without gradients: the losses alone.
        let gl2 = g.zeros(n);
        g.lm_head_crossentropy(&gl2, None, &gx, gw.at(0), &tg, &gs, &dims);
        close(&format!("losses without gradients {name}"), &g.download(&gl2), &losses, t);
    }
}

/// The vocabulary-parallel head over two shards of a 41-token vocabulary (rows 0..21 and
/// 21..41, each padded to 24): on each shard the device's losses, partial input gradient and
/// weight gradient equal the CPU's, the other shard's `[lse | target logit]` standing in for
/// the gather.
#[test]
fn vocab_parallel_lm_head_matches_cpu() {
    let g = gpu();
    let mut rng = Rng::new(44);
    let (n, c, v, vl) = (23, 19, 41, 24);
    let mut targets: Vec<i32> = (0..n).map(|_| rng.below(v as u64) as i32).collect();
    targets[5] = -100;
    let dloss = 0.7 / (n - 1) as f32;
    let x = randn(&mut rng, n * c, 1.0);
    let w = randn(&mut rng, 2 * vl * c, 0.5);
    let shard = |r: usize| HeadDims { c, v: (v - r * 21).min(21 + r), vp: vl, offset: r * 21, ignore_index: -100, arith: Arith::F32, softcap: 0.0 };
    // Each shard's own [lse | target logit] per row, as its head computes them.
    let stats = |r: usize| {
        let d = shard(r);
        let mut st = vec![0.0f32; 2 * n];
        for i in 0..n {
            let z: Vec<f32> = (0..d.v).map(|j| (0..c).map(|k| x[i * c + k] * w[(r * vl + j) * c + k]).sum()).collect();
            let m = z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            st[i] = m + (z.iter().map(|&q| ((q - m) as f64).exp()).sum::<f64>() as f32).ln();
            let t = targets[i];
            st[n + i] = if t >= 0 && (d.offset..d.offset + d.v).contains(&(t as usize)) { z[t as usize - d.offset] } else { 0.0 };
        }
        st
    };
    let tg = g.upload_u32(&targets.iter().map(|&t| t as u32).collect::<Vec<_>>());
    for r in 0..2 {
        let (d, other) = (shard(r), stats(1 - r));
        let ws = &w[r * vl * c..(r + 1) * vl * c];
        // The whole chunk is gathered at once: pair this shard's with the other's, rank order.
        let gather = |mine: &[f32]| -> Vec<f32> {
            let rows = mine.len() / 2;
            let (a, b) = if r == 0 { (mine.to_vec(), other.clone()) } else { (other.clone(), mine.to_vec()) };
            assert_eq!(rows, n, "one chunk of every row");
            [a, b].concat()
        };
        let (mut losses, mut dinp, mut dw) = (vec![0.0; n], vec![0.0; n * c], vec![0.0; vl * c]);
        let mut scratch = vec![0.0; n * vl];
        tensor::classifier::lm_head_crossentropy_vocab_parallel(&mut losses, Some((&mut dinp, &mut dw, tensor::classifier::Dloss::All(dloss))), &x, ws, &targets, &mut scratch, &d, &mut { gather });
        let (gx, gw, gdw, scal) = (g.upload(&x), g.upload(ws), g.zeros(vl * c), g.upload(&[0.0, dloss]));
        let (gl, gdi, gs) = (g.zeros(n), g.zeros(n * c), g.zeros(n * vl));
        g.lm_head_crossentropy_vocab_parallel(&gl, Some((&gdi, Some(gdw.at(0)), (&scal, 1))), &gx, gw.at(0), &tg, (&gs, &g.zeros(2 * n)), &d, &mut { gather });
        let t = tol(DType::F32);
        close(&format!("shard {r} losses"), &g.download(&gl), &losses, t);
        close(&format!("shard {r} dinp"), &g.download(&gdi), &dinp, t);
        close(&format!("shard {r} dweight"), &g.download(&gdw), &dw, t);
    }
}

#[test]
fn moe_routing_matches_cpu() {
    let g = gpu();
    let mut rng = Rng::new(42);
    for (n, e, k, capacity, renormalize) in [(37, 5, 2, 12, true), (29, 7, 1, 29, false), (40, 4, 3, 25, true)] {
        let name = format!("n{n} e{e} k{k} capacity {capacity}");
        let c = 13;
        let logits = randn(&mut rng, n * e, 1.5);
        let (mut probs, mut lse, mut idx, mut gates) = (vec![0.0; n * e], vec![0.0; n], vec![0u32; n * k], vec![0.0; n * k]);
        moe_route(MoeRoute { probs: &mut probs, lse: &mut lse, idx: &mut idx, gates: &mut gates }, &logits, e, renormalize);
        let (mut slot, mut row_token, mut offsets, mut counts) = (vec![0u32; n * k], vec![0u32; n * k], vec![0usize; e + 1], vec![0usize; e]);
        let rows = moe_assign(&mut slot, &mut row_token, &mut offsets, &mut counts, &idx, k, capacity);
        assert!(rows < n * k || capacity >= n, "{name}: the case should drop assignments");

        let r = g.routing(n, e, k);
        g.moe_route(&r, &g.upload(&logits), renormalize, capacity);
        close(&format!("probs {name}"), &g.download(&r.probs), &probs, 1e-5);
        close(&format!("lse {name}"), &g.download(&r.lse), &lse, 1e-5);
        close(&format!("gates {name}"), &g.download(&r.gates), &gates, 1e-5);
        assert_eq!(g.download_u32(&r.idx), idx, "{name}: idx");
        assert_eq!(g.download_u32(&r.slot), slot, "{name}: slot");
        assert_eq!(&g.download_u32(&r.row_token)[..rows], &row_token[..rows], "{name}: row_token");
        assert_eq!(g.download_u32(&r.offsets), offsets.iter().map(|&o| o as u32).collect::<Vec<_>>(), "{name}: offsets");
        assert_eq!(g.download_u32(&r.counts), counts.iter().map(|&o| o as u32).collect::<Vec<_>>(), "{name}: counts");

        // Dispatch and combine, and their backwards.
        let x = randn(&mut rng, n * c, 1.0);
        let mut xe = vec![0.0; rows * c];
        moe_dispatch(&mut xe, &x, &row_token[..rows], c);
        let gxe = g.zeros(n * k * c);
        g.moe_dispatch(&gxe, &g.upload(&x), &r, c);
        assert_eq!(&g.download(&gxe)[..rows * c], &xe[..], "{name}: dispatch");
        let eo = randn(&mut rng, rows * c, 1.0);
        let mut geo_host = eo.clone();
        geo_host.resize(n * k * c, 0.0);
        let geo = g.upload(&geo_host);
        let y0 = randn(&mut rng, n * c, 1.0);
        let mut y = y0.clone();
        moe_combine(&mut y, &eo, &gates, &slot, true, c, k);
        let gy = g.upload(&y0);
        g.moe_combine(&gy, &geo, &r, c, true);
        close(&format!("combine {name}"), &g.download(&gy), &y, 1e-5);

        let dy = randn(&mut rng, n * c, 1.0);
        let (mut dgate, mut deo) = (vec![0.0; n * k], vec![0.0; rows * c]);
        moe_combine_backward((&mut dgate, &mut deo), &dy, &eo, &gates, &slot, &row_token, (c, k));
        let (gdg, gdeo, gdy) = (g.zeros(n * k), g.zeros(n * k * c), g.upload(&dy));
        g.moe_combine_backward((&gdg, &gdeo), &gdy, &geo, &r, c);
        close(&format!("dgate {name}"), &g.download(&gdg), &dgate, 1e-5);
        close(&format!("deo {name}"), &g.download(&gdeo)[..rows * c], &deo, 1e-5);
        let dx0 = randn(&mut rng, n * c, 1.0);
        let mut dx = dx0.clone();
        moe_dispatch_backward(&mut dx, &deo, &slot, c, k);
        let gdx = g.upload(&dx0);
        g.moe_dispatch_backward(&gdx, &gdeo, &r, c);
        close(&format!("dispatch backward {name}"), &g.download(&gdx), &dx, 1e-5);

        let aux: Vec<f32> = (0..e).map(|i| 0.01 * (i as f32 + 1.0)).collect();
        let mut dlogits = vec![0.0; n * e];
        moe_router_backward(&mut dlogits, (&probs, &lse, &idx, &gates), &dgate, (&aux, 0.003), e, renormalize);
        let gdl = g.zeros(n * e);
        g.moe_router_backward(&gdl, &r, &gdg, &g.upload(&aux), 0.003, renormalize);
        close(&format!("router backward {name}"), &g.download(&gdl), &dlogits, 1e-5);
    }
}

#[test]
fn global_norm_clipping_and_adamw_match_cpu() {
    let g = gpu();
    let mut rng = Rng::new(43);
    let n = 300_007; // several partial sums, none full
    let params = randn(&mut rng, n, 1.0);
    let grads = randn(&mut rng, n, 0.1);
    let m0 = randn(&mut rng, n, 0.01);
    let v0: Vec<f32> = randn(&mut rng, n, 0.01).iter().map(|x| x * x).collect();
    let h = AdamW { lr: 3e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 7 };
    let half = n / 2;
    // CPU: the norm in f64, clipping to 1.0, AdamW with decay on the first half only.
    let norm = tensor::sum_squares(&grads).sqrt();
    let clip = 1.0f32;
    assert!(norm > clip as f64, "the case should clip");
    let mut gs = grads.clone();
    tensor::scale_in_place(&mut gs, (clip as f64 / (norm + 1e-6)) as f32);
    let (mut p, mut m, mut v) = (params.clone(), m0.clone(), v0.clone());
    tensor::adamw_update(&mut p[..half], &gs[..half], &mut m[..half], &mut v[..half], &h);
    let h0 = AdamW { weight_decay: 0.0, ..h };
    tensor::adamw_update(&mut p[half..], &gs[half..], &mut m[half..], &mut v[half..], &h0);

    let (gp, gg, gm, gv) = (g.upload(&params), g.upload(&grads), g.upload(&m0), g.upload(&v0));
    let (scal, parts) = (g.zeros(slot::OPTIM), g.zeros(device::Gpu::parts_len()));
    // The sum of squares over two pieces, accumulated.
    g.sum_squares((&scal, slot::SUMSQ), gg.at(0), half, &parts, false);
    g.sum_squares((&scal, slot::SUMSQ), gg.at(half), n - half, &parts, true);
    g.clip_scale(&scal, clip);
    g.set_adamw_scalars(&scal, &h);
    g.adamw_update((&gp, &gg, &gm, &gv), 0, half, &h, true, &scal);
    g.adamw_update((&gp, &gg, &gm, &gv), half, n - half, &h, false, &scal);
    let s = g.download(&scal);
    close("global norm", &[s[slot::NORM]], &[norm as f32], 1e-5);
    close("clip factor", &[s[slot::CLIP_SCALE]], &[(clip as f64 / (norm + 1e-6)) as f32], 1e-5);
    close("adamw params", &g.download(&gp), &p, 1e-5);
    close("adamw m", &g.download(&gm), &m, 1e-5);
    close("adamw v", &g.download(&gv), &v, 1e-5);
    // The same update with each buffer's run at its own offset (a ZeRO shard's layout).
    let k = 1000;
    let pad = |x: &[f32], o: usize| [vec![0.5; o], x[..k].to_vec()].concat();
    let (sp, sg, sm, sv) = (g.upload(&pad(&params, 3)), g.upload(&pad(&grads, 7)), g.upload(&pad(&m0, 11)), g.upload(&pad(&v0, 11)));
    g.adamw_update_at((&sp, &sg, &sm, &sv), device::Offsets { params: 3, grads: 7, moments: 11 }, k, &h, true, &scal);
    close("adamw params at offsets", &g.download(&sp)[3..], &p[..k], 1e-5);
    close("adamw m at offsets", &g.download(&sm)[11..], &m[..k], 1e-5);
    close("adamw v at offsets", &g.download(&sv)[11..], &v[..k], 1e-5);
    let sums = g.zeros(2);
    g.sum((&sums, 1), gg.at(3), n - 3, &parts, false);
    let want: f64 = grads[3..].iter().map(|&x| x as f64).sum();
    let scale: f64 = grads[3..].iter().map(|&x| x.abs() as f64).sum();
    let got = g.download(&sums)[1] as f64;
    assert!((got - want).abs() <= 1e-6 * scale, "sum {got} against {want}");
}

/// QLoRA's base on the device: NF4 (block maxima in fp32 and double-quantized) and int8 rows,
/// uploaded as held and dequantized into a view of a larger buffer, equal to the CPU's
/// dequantization (the double-quantized maxima within one rounding of theirs).
#[test]
fn dequantize_matches_cpu() {
    use tensor::quant::{Int8Rows, Nf4, QPart};
    let g = gpu();
    let mut rng = Rng::new(77);
    // 300 blocks of 64 and a short last one: more than one double-quantization run of 256.
    let n = 300 * 64 + 37;
    let x = randn(&mut rng, n, 0.02);
    let out = g.zeros(n + 9);
    for double in [false, true] {
        let q = Nf4::quantize(&x, double);
        let want = q.dequantize();
        g.dequantize(out.at(9), &g.upload_quantized(QPart::Nf4(&q)).unwrap());
        let got = g.download(&out)[9..].to_vec();
        if double {
            close("dequantize nf4 (double)", &got, &want, 1e-6);
        } else {
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "dequantize nf4 differs from the CPU");
        }
    }
    let (rows, cols) = (37, 29);
    let q = Int8Rows::quantize(&x[..rows * cols], rows, cols);
    let mut want = vec![0.0; rows * cols];
    q.dequantize_rows(&mut want, 0);
    let qb = g.upload_quantized(QPart::Int8(&q)).unwrap();
    assert!(qb.bytes() < 4 * (rows * cols) as u64 / 3);
    g.dequantize(out.at(0), &qb);
    let got = g.download(&out)[..rows * cols].to_vec();
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "dequantize int8 differs from the CPU");
}

/// Lion against `tensor::optim::lion_update`: every weight moves by exactly ±lr or not at all,
/// so the parameters and the moment agree with the CPU to rounding, at offsets too.
#[test]
fn lion_matches_cpu() {
    let g = gpu();
    let mut rng = Rng::new(47);
    let n = 70_001;
    let params = randn(&mut rng, n, 1.0);
    let grads = randn(&mut rng, n, 0.1);
    let m0 = randn(&mut rng, n, 0.05);
    let h = tensor::optim::Lion { lr: 3e-3, beta1: 0.9, beta2: 0.99, weight_decay: 0.1 };
    let half = n / 2;
    let (mut p, mut m) = (params.clone(), m0.clone());
    tensor::optim::lion_update(&mut p[..half], &grads[..half], &mut m[..half], &h);
    let h0 = tensor::optim::Lion { weight_decay: 0.0, ..h };
    tensor::optim::lion_update(&mut p[half..], &grads[half..], &mut m[half..], &h0);
    let (gp, gg, gm) = (g.upload(&params), g.upload(&grads), g.upload(&m0));
    let scal = g.zeros(slot::OPTIM);
    // No clipping: a factor of 1.
    g.write(&scal, &{
        let mut s = vec![0.0f32; slot::OPTIM];
        s[slot::CLIP_SCALE] = 1.0;
        s
    });
    g.set_lion_scalars(&scal, &h);
    let at = |a: usize| device::Offsets { params: a, grads: a, moments: a };
    g.lion_update_at((&gp, &gg, &gm), at(0), half, &h, true, &scal);
    g.lion_update_at((&gp, &gg, &gm), at(half), n - half, &h, false, &scal);
    close("lion params", &g.download(&gp), &p, 1e-5);
    close("lion m", &g.download(&gm), &m, 1e-5);
    let moved = p.iter().zip(&params).filter(|(a, b)| a != b).count();
    assert!(moved > n / 2, "most weights move: {moved} of {n}");
    // At offsets (a ZeRO shard's layout).
    let k = 1000;
    let pad = |x: &[f32], o: usize| [vec![0.5; o], x[..k].to_vec()].concat();
    let (sp, sg, sm) = (g.upload(&pad(&params, 3)), g.upload(&pad(&grads, 7)), g.upload(&pad(&m0, 11)));
    g.lion_update_at((&sp, &sg, &sm), device::Offsets { params: 3, grads: 7, moments: 11 }, k, &h, true, &scal);
    close("lion params at offsets", &g.download(&sp)[3..], &p[..k], 1e-5);
    close("lion m at offsets", &g.download(&sm)[11..], &m[..k], 1e-5);
}
