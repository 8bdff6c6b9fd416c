//! Issue 9, done-when (2a): ZeRO model-state bytes per GPU are exactly the ZeRO paper's formulas
//! (Rajbhandari et al., SC20, §5 and Figure 1).

use plan::cost::zero_model_state_bytes;
use plan::hardware::Precision;

fn total(psi: f64, n: f64, stage: u8) -> f64 {
    let (w, g, o) = zero_model_state_bytes(psi, n, stage, Precision::Bf16, false);
    w + g + o
}

#[test]
fn zero_stages_match_the_paper_formulas_exactly() {
    for psi in [1.0e9, 7.5e9, 1.75e11, 1.0e12] {
        for n in [1.0, 8.0, 64.0, 1024.0] {
            assert_eq!(total(psi, n, 0), 16.0 * psi);
            assert_eq!(total(psi, n, 1), 4.0 * psi + 12.0 * psi / n);
            assert_eq!(total(psi, n, 2), 2.0 * psi + 14.0 * psi / n);
            assert_eq!(total(psi, n, 3), 16.0 * psi / n);
        }
    }
}

#[test]
fn zero_paper_figure1_example() {
    // Ψ = 7.5B, N_d = 64: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    let gb = |x: f64| (x / 1e9 * 10.0).round() / 10.0;
    assert_eq!(gb(total(7.5e9, 64.0, 0)), 120.0);
    assert_eq!(gb(total(7.5e9, 64.0, 1)), 31.4);
    assert_eq!(gb(total(7.5e9, 64.0, 2)), 16.6);
    assert_eq!(gb(total(7.5e9, 64.0, 3)), 1.9);
}

#[test]
fn fp32_gradients_and_fp16_optimizer_are_the_documented_variants() {
    let psi = 1e9;
    let (w, g, o) = zero_model_state_bytes(psi, 1.0, 0, Precision::Bf16, true);
    assert_eq!(w + g + o, 18.0 * psi); // Megatron bf16 + fp32 main_grad
    let (w, g, o) = zero_model_state_bytes(psi, 1.0, 0, Precision::Fp16, false);
    assert_eq!(w + g + o, 20.0 * psi); // Megatron fp16 optimizer
}
