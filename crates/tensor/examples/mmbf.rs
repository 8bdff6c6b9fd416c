use std::time::Instant;
use tensor::bf16::{gemm_bf16, Mat, to_bf16};
use tensor::matmul::{gemm, View, Threads};
fn time<F: FnMut()>(mut f: F) -> f64 { let mut best = f64::INFINITY; for _ in 0..10 { let t = Instant::now(); f(); best = best.min(t.elapsed().as_secs_f64()); } best }
fn main() {
    for &(m, n, k, tr) in &[(1024usize, 2304usize, 768usize, 1u8), (1024, 768, 3072, 1), (1024, 768, 3072, 0), (768, 3072, 1024, 2), (3072, 768, 1024, 2), (667, 50304, 768, 1), (667, 768, 50304, 0), (50304, 768, 667, 2)] {
        let a = vec![0.5f32; m * k]; let b = vec![0.25f32; n * k]; let mut c = vec![0.0f32; m * n];
        let ah: Vec<u16> = a.iter().map(|&x| to_bf16(x)).collect(); let bh: Vec<u16> = b.iter().map(|&x| to_bf16(x)).collect();
        let fl = 2.0 * (m * n * k) as f64;
        // tr 0: A·B row-major; 1: A·Bᵀ (forward); 2: Aᵀ·B (weight gradient)
        let (va, vb) = match tr { 0 => (View::rows(&a, m, k), View::rows(&b, k, n)), 1 => (View::rows(&a, m, k), View::rows(&b, n, k).t()), _ => (View::rows(&a, k, m).t(), View::rows(&b, k, n)) };
        let t32 = time(|| gemm(&mut c, false, va, vb, 1.0, Threads::All));
        let (ma, mb) = match tr { 0 => (Mat::rows(&a[..], m, k), Mat::rows(&b[..], k, n)), 1 => (Mat::rows(&a[..], m, k), Mat::rows(&b[..], n, k).t()), _ => (Mat::rows(&a[..], k, m).t(), Mat::rows(&b[..], k, n)) };
        let tbf = time(|| gemm_bf16(&mut c, false, ma, mb, 1.0, Threads::All));
        let (ha, hb) = match tr { 0 => (Mat::rows(&ah[..], m, k), Mat::rows(&bh[..], k, n)), 1 => (Mat::rows(&ah[..], m, k), Mat::rows(&bh[..], n, k).t()), _ => (Mat::rows(&ah[..], k, m).t(), Mat::rows(&bh[..], k, n)) };
        let th = time(|| gemm_bf16(&mut c, false, ha, hb, 1.0, Threads::All));
        println!("{m}x{n}x{k} tr{tr}: fp32 {:.0} GF/s  bf16(f32 in) {:.0}  bf16(bf16 in) {:.0}", fl / t32 / 1e9, fl / tbf / 1e9, fl / th / 1e9);
    }
}
