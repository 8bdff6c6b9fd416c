//! The bf16 products against an f64 reference of the bf16-rounded inputs, on every path this
//! machine has, over the shapes and strides training uses and the edges of the register tile.

use tensor::bf16::{available_paths, from_bf16, gemm_bf16, gemm_bf16_on, to_bf16, Elem, Mat};
use tensor::matmul::Threads;

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut r = tensor::Rng::new(seed);
    (0..n).map(|_| (r.normal() * 0.5) as f32).collect()
}

/// `(rs, cs)` of a row-major or (transposed storage) column-major `rows × cols` view.
fn strides(rows: usize, cols: usize, transposed: bool) -> (usize, usize) {
    if transposed { (1, rows) } else { (cols, 1) }
}

/// f64 reference of `acc + alpha · bf16(a) · bf16(b)`.
fn reference(a: &Mat<f32>, b: &Mat<f32>, init: &[f32], alpha: f64) -> Vec<f64> {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let mut out = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f64;
            for p in 0..k {
                let x = a.data[a.off + i * a.rs + p * a.cs].rounded() as f64;
                let y = b.data[b.off + p * b.rs + j * b.cs].rounded() as f64;
                s += x * y;
            }
            out[i * n + j] = init[i * n + j] as f64 + alpha * s;
        }
    }
    out
}

#[test]
fn bf16_products_match_an_f64_reference_over_shapes_strides_and_tile_edges() {
    // Tile edges (12 × 32), k blocks (256) and odd k, transposed operands, accumulation.
    // The fallback's blocks (512 rows, 512 k, 4096 columns) too.
    let shapes = [(1, 1, 1), (12, 32, 2), (13, 33, 3), (25, 70, 257), (40, 31, 600), (130, 65, 513), (7, 300, 64), (600, 20, 9), (2, 4100, 5)];
    for &(m, n, k) in &shapes {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            for accumulate in [false, true] {
                let av = data(m * k, 1 + m as u64);
                let bv = data(k * n, 2 + n as u64);
                let (ars, acs) = strides(m, k, ta);
                let (brs, bcs) = strides(k, n, tb);
                let a = Mat { data: &av[..], off: 0, rows: m, cols: k, rs: ars, cs: acs };
                let b = Mat { data: &bv[..], off: 0, rows: k, cols: n, rs: brs, cs: bcs };
                let init = if accumulate { data(m * n, 3) } else { vec![0.0; m * n] };
                let alpha = if accumulate { 0.5 } else { 1.0 };
                let want = reference(&a, &b, &init, alpha as f64);
                for (path, threads) in available_paths().into_iter().flat_map(|p| [(p, Threads::One), (p, Threads::All)]) {
                    let mut got = init.clone();
                    gemm_bf16_on(path, &mut got, accumulate, a, b, alpha, threads);
                    for (idx, (g, w)) in got.iter().zip(&want).enumerate() {
                        // fp32 accumulation of k exact products: error ≲ k·eps·Σ|terms|.
                        let bound = 1e-6 * (k as f64) * 2.0 + 1e-6;
                        assert!((*g as f64 - w).abs() <= bound * (1.0 + w.abs()), "{path:?} {m}x{n}x{k} ta={ta} tb={tb} acc={accumulate} [{idx}]: {g} vs {w}");
                    }
                }
            }
        }
    }
}

#[test]
fn bf16_inputs_read_as_bits_equal_f32_inputs_and_results_do_not_depend_on_threads() {
    let (m, n, k) = (200, 96, 300);
    let av = data(m * k, 7);
    let bv = data(k * n, 8);
    let ah: Vec<u16> = av.iter().map(|&x| to_bf16(x)).collect();
    let bh: Vec<u16> = bv.iter().map(|&x| to_bf16(x)).collect();
    let mut f = vec![0.0; m * n];
    gemm_bf16(&mut f, false, Mat::rows(&av, m, k), Mat::rows(&bv, k, n), 1.0, Threads::All);
    let mut h = vec![0.0; m * n];
    gemm_bf16(&mut h, false, Mat::rows(&ah, m, k), Mat::rows(&bh, k, n), 1.0, Threads::All);
    let mut one = vec![0.0; m * n];
    gemm_bf16(&mut one, false, Mat::rows(&ah, m, k), Mat::rows(&bv, k, n), 1.0, Threads::One);
    assert_eq!(f, h);
    assert_eq!(f, one);
}

#[test]
fn bf16_conversion_rounds_to_nearest_even_and_keeps_nan_and_infinity() {
    assert_eq!(from_bf16(to_bf16(1.0)), 1.0);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even (1.0).
    assert_eq!(from_bf16(to_bf16(1.0 + 2f32.powi(-8))), 1.0);
    assert_eq!(from_bf16(to_bf16(1.0 + 3.0 * 2f32.powi(-8))), 1.0 + 2f32.powi(-6));
    assert!(from_bf16(to_bf16(f32::NAN)).is_nan());
    assert_eq!(from_bf16(to_bf16(f32::INFINITY)), f32::INFINITY);
    assert_eq!(from_bf16(to_bf16(-0.0)).to_bits(), (-0.0f32).to_bits());
    // The simulated storage rounding and the conversion agree.
    for x in data(10_000, 9) {
        assert_eq!(from_bf16(to_bf16(x)), tensor::precision::round(x, tensor::precision::Format::Bf16));
    }
}

/// `vdpbf16ps` runs where the CPU has it, except on Intel (where it measured slower than fp32
/// FMAs), and the choice says why; the rate probe runs and gives a plausible ratio.
#[test]
fn the_bf16_path_follows_the_cpu() {
    use tensor::bf16::{choice, dot_over_fma, vendor, Path};
    let c = choice();
    let has = available_paths().contains(&Path::Avx512Bf16);
    if std::env::var("KILN_BF16_PATH").is_err() {
        assert_eq!(c.path == Path::Avx512Bf16, has && vendor() != "GenuineIntel", "{} on {}", c.describe(), vendor());
    }
    assert!(c.describe().starts_with(c.path.name()));
    let r = dot_over_fma();
    if has {
        assert!(r > 0.05 && r < 10.0, "{r}");
    } else {
        assert_eq!(r, 0.0);
    }
}
