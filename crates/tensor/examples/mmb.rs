use std::time::Instant;
use tensor::matmul::{gemm, View, Threads, matmul_backward};
fn time<F: FnMut()>(mut f: F) -> f64 { let mut best = f64::INFINITY; for _ in 0..40 { let t = Instant::now(); f(); best = best.min(t.elapsed().as_secs_f64()); } best }
fn main() {
    for &(bt, c, oc) in &[(768usize, 128usize, 384usize), (768, 128, 128), (768, 128, 512), (768, 512, 128), (256, 768, 2304), (256, 768, 3072), (256, 3072, 768)] {
        let inp = vec![0.5f32; bt * c]; let w = vec![0.25f32; oc * c]; let dout = vec![0.1f32; bt * oc];
        let mut di = vec![0.0f32; bt * c]; let mut dw = vec![0.0f32; oc * c];
        let fl = 4.0 * (bt * c * oc) as f64;
        let t_seq = time(|| matmul_backward((&mut di, &mut dw, None), &dout, &inp, &w, bt, c, oc));
        let t_join = time(|| {
            rayon::join(|| gemm(&mut di, true, View::rows(&dout, bt, oc), View::rows(&w, oc, c), 1.0, Threads::One),
                        || gemm(&mut dw, true, View::rows(&dout, bt, oc).t(), View::rows(&inp, bt, c), 1.0, Threads::One));
        });
        println!("bt{bt} c{c} oc{oc}: seq(All) {:.1} GF/s   join(One,One) {:.1} GF/s", fl / t_seq / 1e9, fl / t_join / 1e9);
    }
}
