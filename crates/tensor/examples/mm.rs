use std::time::Instant;
use tensor::matmul::{gemm, View, Threads};
fn time<F: FnMut()>(mut f: F) -> f64 { let mut best = f64::INFINITY; for _ in 0..30 { let t = Instant::now(); f(); best = best.min(t.elapsed().as_secs_f64()); } best }
fn main() {
    for &(m, n, k) in &[(768usize, 384usize, 128usize), (768, 128, 128), (768, 512, 128), (768, 128, 512), (768, 65, 128), (128, 384, 768), (128,128,768)] {
        let a = vec![0.5f32; m * k]; let b = vec![0.25f32; n * k]; let mut c = vec![0.0f32; m * n];
        let fl = 2.0 * (m * n * k) as f64;
        let t_all = time(|| gemm(&mut c, false, View::rows(&a, m, k), View::rows(&b, n, k).t(), 1.0, Threads::All));
        let t_one = time(|| gemm(&mut c, false, View::rows(&a, m, k), View::rows(&b, n, k).t(), 1.0, Threads::One));
        let t_split = time(|| {
            let (c1, c2) = c.split_at_mut(m / 2 * n);
            let (a1, a2) = a.split_at(m / 2 * k);
            rayon::join(|| gemm(c1, false, View::rows(a1, m / 2, k), View::rows(&b, n, k).t(), 1.0, Threads::One),
                        || gemm(c2, false, View::rows(a2, m - m / 2, k), View::rows(&b, n, k).t(), 1.0, Threads::One));
        });
        println!("{m}x{n}x{k}: all {:.1} GF/s  one {:.1}  split2 {:.1}", fl / t_all / 1e9, fl / t_one / 1e9, fl / t_split / 1e9);
    }
}
