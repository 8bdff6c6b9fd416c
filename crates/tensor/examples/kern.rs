use std::time::Instant;
fn main() {
    let n = 768 * 512;
    let x: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 0.01).collect();
    let mut o = vec![0.0f32; n];
    let mut d = vec![0.0f32; n];
    for name in ["gelu_fwd", "gelu_bwd", "residual", "ln_fwd"] {
        let mut best = f64::INFINITY;
        for _ in 0..50 {
            let t = Instant::now();
            match name {
                "gelu_fwd" => tensor::gelu_forward(&mut o, &x),
                "gelu_bwd" => tensor::gelu_backward(&mut d, &o, &x),
                "residual" => tensor::residual_forward(&mut d, &x, &o),
                _ => { let (mut m, mut r) = (vec![0.0; 768*4], vec![0.0; 768*4]); tensor::layernorm_forward(&mut d, &mut m, &mut r, &x, &vec![1.0; 128], None, 128); }
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("{name}: {:.3} ms ({:.2} ns/elem)", best * 1e3, best * 1e9 / n as f64);
    }
}
