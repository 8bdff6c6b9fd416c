//! Embedding, norms, activations, residual, RoPE and dropout against their CPU twins.
use crate::common::{close, gpu, randn, stored, tol};
use device::{DType, RopePos};
use tensor::llama::GqaDims;
use tensor::ops::{Chunks, RowMap};
use tensor::Rng;

const F32: f32 = 1e-5;

#[test]
fn embedding_matches_cpu() {
    let g = gpu();
    let mut rng = Rng::new(21);
    let (b, t, c, vp) = (3, 13, 37, 53);
    let tokens: Vec<u32> = (0..b * t).map(|_| rng.below(vp as u64) as u32).collect();
    // One parameter buffer: [junk 7 | wte | wpe], as a model's flat parameters.
    let params = randn(&mut rng, 7 + vp * c + t * c, 1.0);
    let (wte, wpe) = (&params[7..7 + vp * c], &params[7 + vp * c..]);
    let mut out = vec![0.0; b * t * c];
    tensor::embedding_forward(&mut out, &tokens, wte, Some(wpe), t, c);
    let (p, tok, o) = (g.upload(&params), g.upload_u32(&tokens), g.zeros(b * t * c));
    g.embedding_forward(&o, &tok, p.at(7), Some(p.at(7 + vp * c)), t, c);
    close("embedding_forward", &g.download(&o), &out, F32);

    let dout = randn(&mut rng, b * t * c, 1.0);
    let grads0 = randn(&mut rng, params.len(), 1.0);
    let mut grads = grads0.clone();
    {
        let (dwte, dwpe) = grads[7..].split_at_mut(vp * c);
        tensor::embedding_backward(dwte, Some(dwpe), &dout, &tokens, t, c);
    }
    let dg = g.upload(&grads0);
    g.embedding_backward(dg.at(7), Some(dg.at(7 + vp * c)), &g.upload(&dout), &tok, t, c);
    // Sums in the CPU's order: equal to the bit.
    let got = g.download(&dg);
    assert!(got.iter().zip(&grads).all(|(a, b)| a.to_bits() == b.to_bits()), "embedding_backward differs from the CPU");
}

/// With explicit positions (packed documents whose positions restart): the table rows by
/// position, and the position table's gradient summed per position in token order; and a
/// vocabulary-parallel shard's table (rows 9 .. 9 + 14 of the vocabulary: other tokens look up
/// zeros and leave no gradient).
#[test]
fn embedding_with_positions_matches_cpu() {
    let g = gpu();
    let mut rng = Rng::new(26);
    let (b, t, c, vp, max_t) = (2, 11, 19, 23, 16);
    let tokens: Vec<u32> = (0..b * t).map(|_| rng.below(vp as u64) as u32).collect();
    let pos: Vec<u32> = (0..b * t).map(|i| ((i % t) % 6) as u32).collect();
    for (name, rows) in [("whole table", 0..vp), ("vocabulary shard", 9..23)] {
        let params = randn(&mut rng, rows.len() * c + max_t * c, 1.0);
        let (wte, wpe) = params.split_at(rows.len() * c);
        let mut out = vec![0.0; b * t * c];
        tensor::ops::embedding_forward_rows(&mut out, &tokens, (wte, Some(wpe)), Some(&pos), t, c, rows.clone());
        let (p, tok, gp, o) = (g.upload(&params), g.upload_u32(&tokens), g.upload_u32(&pos), g.zeros(b * t * c));
        let table = if rows.start == 0 { device::ALL_ROWS } else { rows.clone() };
        g.embedding_forward_pos(&o, &tok, (p.at(0), Some(p.at(wte.len()))), Some(&gp), (t, c), table.clone());
        close(&format!("embedding_forward with positions, {name}"), &g.download(&o), &out, F32);
        let dout = randn(&mut rng, b * t * c, 1.0);
        let grads0 = randn(&mut rng, params.len(), 1.0);
        let mut grads = grads0.clone();
        {
            let (dwte, dwpe) = grads.split_at_mut(wte.len());
            tensor::ops::embedding_backward_rows((dwte, Some(dwpe)), &dout, &tokens, Some(&pos), t, c, rows.clone());
        }
        let dg = g.upload(&grads0);
        g.embedding_backward_pos((dg.at(0), Some(dg.at(wte.len()))), &g.upload(&dout), &tok, Some((&gp, max_t)), (t, c), table);
        let got = g.download(&dg);
        assert!(got.iter().zip(&grads).all(|(a, b)| a.to_bits() == b.to_bits()), "embedding_backward with positions, {name}, differs from the CPU");
    }
}

#[test]
fn layernorm_and_rmsnorm_match_cpu_in_every_type() {
    let g = gpu();
    let mut rng = Rng::new(22);
    for &(rows, c) in &[(17, 45), (5, 300), (1, 3)] {
        for dtype in [DType::F32, DType::Bf16, DType::F16] {
            let name = format!("{rows}x{c} {dtype:?}");
            let x = randn(&mut rng, rows * c, 2.0);
            let xs = stored(&x, dtype);
            let params = randn(&mut rng, 2 * c + 3, 1.0);
            let (w, bias) = (&params[3..3 + c], &params[3 + c..]);
            let dout = randn(&mut rng, rows * c, 1.0);
            let (gx, p, dx, d) = (g.upload_as(&x, dtype), g.upload(&params), g.zeros(rows * c), g.upload(&dout));

            // LayerNorm
            let (mut out, mut mean, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
            tensor::layernorm_forward(&mut out, &mut mean, &mut rstd, &xs, w, Some(bias), c);
            let (o, m, r) = (g.zeros(rows * c), g.zeros(rows), g.zeros(rows));
            g.layernorm_forward(&o, (&m, &r), &gx, p.at(3), Some(p.at(3 + c)), c);
            close(&format!("layernorm_forward {name}"), &g.download(&o), &out, tol(dtype).max(F32 * 4.0));
            let grads0 = randn(&mut rng, params.len(), 1.0);
            let mut grads = grads0.clone();
            let mut di = vec![0.0; rows * c];
            {
                let (gw, gb) = grads[3..].split_at_mut(c);
                tensor::layernorm_backward((&mut di, gw, Some(gb)), &dout, &xs, w, (&mean, &rstd), c);
            }
            let dp = g.upload(&grads0);
            g.layernorm_backward((&dx, dp.at(3), Some(dp.at(3 + c))), &d, &gx, p.at(3), (&m, &r), c);
            close(&format!("layernorm dinp {name}"), &g.download(&dx), &di, tol(dtype).max(F32 * 4.0));
            close(&format!("layernorm dparams {name}"), &g.download(&dp), &grads, tol(dtype).max(F32));

            // RMSNorm
            let (mut out, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows]);
            tensor::llama::rmsnorm_forward(&mut out, &mut rstd, &xs, w, 1e-6, c);
            g.rmsnorm_forward(&o, &r, &gx, p.at(3), 1e-6, c);
            close(&format!("rmsnorm_forward {name}"), &g.download(&o), &out, tol(dtype).max(F32 * 4.0));
            let mut di = vec![0.0; rows * c];
            let mut gw = grads0[3..3 + c].to_vec();
            tensor::llama::rmsnorm_backward(&mut di, &mut gw, &dout, &xs, w, &rstd, c);
            let (dx, dp) = (g.zeros(rows * c), g.upload(&grads0));
            g.rmsnorm_backward((&dx, dp.at(3)), &d, &gx, p.at(3), &r, c);
            close(&format!("rmsnorm dinp {name}"), &g.download(&dx), &di, tol(dtype).max(F32 * 4.0));
            close(&format!("rmsnorm dweight {name}"), &g.download(&dp)[3..3 + c], &gw, tol(dtype).max(F32));
        }
    }
}

#[test]
fn activations_and_residual_match_cpu() {
    let g = gpu();
    let mut rng = Rng::new(23);
    let n = 1037;
    for dtype in [DType::F32, DType::F16] {
        let x = randn(&mut rng, n, 3.0);
        let xs = stored(&x, dtype);
        let (dout, acc0) = (randn(&mut rng, n, 1.0), randn(&mut rng, n, 1.0));
        let (gx, d) = (g.upload_as(&x, dtype), g.upload(&dout));
        let t = tol(dtype).max(F32);
        let mut out = vec![0.0; n];
        tensor::gelu_forward(&mut out, &xs);
        let o = g.zeros(n);
        g.gelu_forward(&o, &gx);
        close(&format!("gelu_forward {dtype:?}"), &g.download(&o), &out, t);
        let mut acc = acc0.clone();
        tensor::gelu_backward(&mut acc, &dout, &xs);
        let ga = g.upload(&acc0);
        g.gelu_backward(&ga, &d, &gx);
        close(&format!("gelu_backward {dtype:?}"), &g.download(&ga), &acc, t);
        let mut into = vec![0.0; n];
        tensor::gelu_backward_into(&mut into, &dout, &xs);
        g.gelu_backward_into(&ga, &d, &gx);
        close(&format!("gelu_backward_into {dtype:?}"), &g.download(&ga), &into, t);

        tensor::llama::silu_forward(&mut out, &xs);
        g.silu_forward(&o, &gx);
        close(&format!("silu_forward {dtype:?}"), &g.download(&o), &out, t);
        let mut acc = acc0.clone();
        tensor::llama::silu_backward(&mut acc, &dout, &xs);
        let ga = g.upload(&acc0);
        g.silu_backward(&ga, &d, &gx);
        close(&format!("silu_backward {dtype:?}"), &g.download(&ga), &acc, t);
    }
    // SwiGLU over fused [N, 2F] rows.
    let (rows, f) = (7, 45);
    let gu = randn(&mut rng, rows * 2 * f, 2.0);
    let dout = randn(&mut rng, rows * f, 1.0);
    let dgu0 = randn(&mut rng, rows * 2 * f, 1.0);
    let mut out = vec![0.0; rows * f];
    tensor::llama::swiglu_forward(&mut out, &gu, f);
    let (ggu, o, d) = (g.upload(&gu), g.zeros(rows * f), g.upload(&dout));
    g.swiglu_forward(&o, &ggu, f);
    close("swiglu_forward", &g.download(&o), &out, F32);
    for accumulate in [true, false] {
        let mut dgu = dgu0.clone();
        if accumulate {
            tensor::llama::swiglu_backward(&mut dgu, &dout, &gu, f);
        } else {
            tensor::llama::swiglu_backward_into(&mut dgu, &dout, &gu, f);
        }
        let gd = g.upload(&dgu0);
        g.swiglu_backward(&gd, &d, &ggu, f, accumulate);
        close(&format!("swiglu_backward accumulate={accumulate}"), &g.download(&gd), &dgu, F32);
    }
    // Residual: exact.
    let (a, b) = (randn(&mut rng, n, 1.0), randn(&mut rng, n, 1.0));
    let mut out = vec![0.0; n];
    tensor::residual_forward(&mut out, &a, &b);
    let (ga, gb, o) = (g.upload(&a), g.upload(&b), g.zeros(n));
    g.residual_forward(&o, &ga, &gb);
    assert_eq!(g.download(&o), out);
    let (mut da, mut db) = (a.clone(), b.clone());
    tensor::residual_backward(&mut da, &mut db, &out);
    g.residual_backward(&ga, &gb, &o);
    assert_eq!((g.download(&ga), g.download(&gb)), (da, db));
}

#[test]
fn rope_matches_cpu_with_scaled_tables_partial_rotary_and_position_ids() {
    let g = gpu();
    let mut rng = Rng::new(24);
    let (b, t, nh, nkv, hs) = (2, 11, 6, 2, 10);
    for rotary in [0, 6] {
        let dims = GqaDims { b, t, nh, nkv, hs, rotary, ..Default::default() };
        let rot = if rotary == 0 { hs } else { rotary };
        // A scaled form: YaRN-like frequencies divided by a factor past a cutoff.
        let inv: Vec<f32> = tensor::llama::rope_inv_freq(10000.0, rot).iter().enumerate().map(|(i, f)| if i > 1 { f / 4.0 } else { *f }).collect();
        let (cos, sin) = tensor::llama::rope_table_from(&inv, 40);
        let (gc, gs) = (g.upload(&cos), g.upload(&sin));
        let qkv = randn(&mut rng, b * t * dims.qkv_width(), 1.0);
        let pos: Vec<u32> = (0..b * t).map(|_| rng.below(40) as u32).collect();
        let mut want = qkv.clone();
        tensor::llama::rope_forward(&mut want, &cos, &sin, &dims, 5);
        let x = g.upload(&qkv);
        g.rope(&x, (&gc, &gs), &dims, RopePos::Offset(5), false);
        close(&format!("rope_forward rotary {rotary}"), &g.download(&x), &want, F32);
        tensor::llama::rope_backward(&mut want, &cos, &sin, &dims, 5);
        g.rope(&x, (&gc, &gs), &dims, RopePos::Offset(5), true);
        close(&format!("rope_backward rotary {rotary}"), &g.download(&x), &want, F32);
        let mut want = qkv.clone();
        tensor::llama::rope_forward_pos(&mut want, &cos, &sin, &dims, &pos);
        let x = g.upload(&qkv);
        g.rope(&x, (&gc, &gs), &dims, RopePos::Ids(&g.upload_u32(&pos)), false);
        close(&format!("rope_forward_pos rotary {rotary}"), &g.download(&x), &want, F32);
    }
}

#[test]
fn dropout_masks_equal_the_cpu_bit_for_bit() {
    let g = gpu();
    let mut rng = Rng::new(25);
    let n = 5003;
    let x = randn(&mut rng, n, 1.0);
    let gx = g.upload(&x);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (p, seed) in [(0.1f32, 7u64), (0.5, 0xDEAD_BEEF_0123_4567), (0.0, 3)] {
        let mut want = vec![0.0; n];
        tensor::dropout_forward(&mut want, &x, p, seed);
        let o = g.zeros(n);
        g.dropout_forward(&o, &gx, p, seed);
        assert_eq!(bits(&g.download(&o)), bits(&want), "dropout_forward p {p} seed {seed}");
        let acc0 = randn(&mut rng, n, 1.0);
        let mut acc = acc0.clone();
        tensor::dropout_backward(&mut acc, &x, p, seed);
        let ga = g.upload(&acc0);
        g.dropout_backward(&ga, &gx, p, seed);
        assert_eq!(bits(&g.download(&ga)), bits(&acc), "dropout_backward p {p} seed {seed}");
    }
    // Rows of a shard: sequence-parallel offsets, a data-parallel batch offset and context-parallel chunks.
    let c = 19;
    for map in [
        RowMap { t_local: 5, t: 20, offset: 5, b0: 3, chunks: None },
        RowMap { t_local: 6, t: 24, offset: 0, b0: 1, chunks: Some(Chunks { len: 3, first: 3, second: 18 }) },
    ] {
        let rows = 2 * map.t_local;
        let x = randn(&mut rng, rows * c, 1.0);
        let mut want = x.clone();
        tensor::ops::dropout_inplace_rows(&mut want, 0.3, 99, c, map);
        let gx = g.upload(&x);
        g.dropout_inplace_rows(&gx, 0.3, 99, c, map);
        assert_eq!(bits(&g.download(&gx)), bits(&want), "dropout_inplace_rows {map:?}");
        let mut acc = x.clone();
        tensor::ops::dropout_backward_rows(&mut acc, &want, 0.3, 99, c, map);
        let ga = g.upload(&x);
        g.dropout_backward_rows(&ga, &gx, 0.3, 99, c, map);
        assert_eq!(bits(&g.download(&ga)), bits(&acc), "dropout_backward_rows {map:?}");
    }
}
