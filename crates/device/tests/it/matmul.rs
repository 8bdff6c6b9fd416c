//! matmul forward and backward (both gradients and the bias), and the strided batched gemm.
use crate::common::{close, gpu, randn, stored, tol};
use device::{DType, Gemm, MatSpec};
use tensor::matmul::Arith;
use tensor::Rng;

#[test]
fn matmul_matches_cpu_on_odd_shapes_in_every_type() {
    let g = gpu();
    let mut rng = Rng::new(7);
    for &(bt, c, oc) in &[(67, 45, 33), (1, 3, 5), (130, 199, 257)] {
        for dtype in [DType::F32, DType::Bf16, DType::F16] {
            let (inp, w, b) = (randn(&mut rng, bt * c, 1.0), randn(&mut rng, oc * c, 1.0), randn(&mut rng, oc, 1.0));
            let dout = randn(&mut rng, bt * oc, 1.0);
            // The CPU twin computes on the values as the device stores them.
            let (inp_s, w_s) = (stored(&inp, dtype), stored(&w, dtype));
            let mut out = vec![0.0; bt * oc];
            tensor::matmul_forward(&mut out, &inp_s, &w_s, Some(&b), bt, c, oc);
            let (di, dw, db) = (g.upload_as(&inp, dtype), g.upload_as(&w, dtype), g.upload(&b));
            let o = g.zeros(bt * oc);
            g.matmul_forward(&o, &di, dw.at(0), Some(db.at(0)), (bt, c, oc));
            let name = format!("matmul_forward {dtype:?} {bt}x{c}x{oc}");
            close(&name, &g.download(&o), &out, tol(DType::F32));
            // Backward accumulates: every gradient starts from a nonzero value.
            let (gi0, gw0, gb0) = (randn(&mut rng, bt * c, 1.0), randn(&mut rng, oc * c, 1.0), randn(&mut rng, oc, 1.0));
            let (mut gi, mut gw, mut gb) = (gi0.clone(), gw0.clone(), gb0.clone());
            tensor::matmul_backward((&mut gi, &mut gw, Some(&mut gb)), &dout, &inp_s, &w_s, bt, c, oc);
            let (dgi, dgw, dgb) = (g.upload(&gi0), g.upload(&gw0), g.upload(&gb0));
            g.matmul_backward((&dgi, dgw.at(0), Some(dgb.at(0))), &g.upload(&dout), &di, dw.at(0), (bt, c, oc));
            close(&format!("{name} dinp"), &g.download(&dgi), &gi, tol(DType::F32));
            close(&format!("{name} dweight"), &g.download(&dgw), &gw, tol(DType::F32));
            close(&format!("{name} dbias"), &g.download(&dgb), &gb, tol(DType::F32));
            // The overwriting form: dinp replaced, the weight's gradient accumulated.
            let (mut gi2, mut gw2) = (gi0.clone(), gw0.clone());
            tensor::matmul::matmul_backward_into_as(Arith::F32, (&mut gi2, &mut gw2, None), &dout, &inp_s, &w_s, (bt, c, oc));
            let (dgi2, dgw2) = (g.upload(&gi0), g.upload(&gw0));
            g.matmul_backward_into((&dgi2, dgw2.at(0), None), &g.upload(&dout), &di, dw.at(0), (bt, c, oc));
            close(&format!("{name} dinp (overwritten)"), &g.download(&dgi2), &gi2, tol(DType::F32));
            close(&format!("{name} dweight (with dinp overwritten)"), &g.download(&dgw2), &gw2, tol(DType::F32));
        }
    }
}

/// Against the CPU's strided gemm: batched heads, transposed operands, alpha, offsets inside
/// one buffer, accumulation: the forms attention is built from.
#[test]
fn strided_batched_gemm_matches_cpu() {
    let g = gpu();
    let mut rng = Rng::new(9);
    let (outer, inner, m, n, k) = (2, 3, 37, 29, 19);
    let a = randn(&mut rng, 5 + outer * inner * m * k, 1.0);
    let b = randn(&mut rng, outer * inner * n * k, 1.0);
    let c0 = randn(&mut rng, outer * inner * m * n, 1.0);
    // A: [outer, inner, m, k] from offset 5; B stored as [outer, inner, n, k] and used transposed.
    let asp = MatSpec::rows(5, k).batched(inner * m * k, m * k);
    let bsp = MatSpec::rows(0, k).t().batched(inner * n * k, n * k);
    let csp = MatSpec::rows(0, n).batched(inner * m * n, m * n);
    let mut want = c0.clone();
    for z in 0..outer * inner {
        let (ab, bb, cb) = (5 + z * m * k, z * n * k, z * m * n);
        let lhs = tensor::matmul::View::rows(&a[ab..ab + m * k], m, k);
        let rhs = tensor::matmul::View::rows(&b[bb..bb + n * k], n, k).t();
        tensor::matmul::gemm(&mut want[cb..cb + m * n], true, lhs, rhs, 0.3, tensor::matmul::Threads::All);
    }
    let (da, dbuf, dc) = (g.upload(&a), g.upload(&b), g.upload(&c0));
    let gm = Gemm { outer, inner, alpha: 0.3, ..Gemm::new(m, n, k) }.acc();
    g.gemm(gm, (&dc, csp), (&da, asp), (&dbuf, bsp), None);
    close("strided batched gemm", &g.download(&dc), &want, 1e-5);
}
