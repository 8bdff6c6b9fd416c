//! FLOP conventions: 72·B·s·l·h²(1 + s/(6h) + V/(12lh)) (model), 96·…(1 + s/(6h) + V/(16lh)) (with full
//! recomputation), Narayanan eq. (1) for parameters, and PaLM's 6N + 12LCT.

use plan::cost::{hardware_flops, model_flops, Recompute};
use plan::palm_flops_per_token;

#[test]
fn gpt_flops_follow_narayanan() {
    for r in super::table1_rows() {
        let m = super::gpt_of(&r);
        let (b, s, l, h, v) = (r.global_batch as f64, 2048.0, r.layers as f64, r.hidden as f64, 51200.0);
        let f72 = 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h));
        let f96 = 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h));
        let got72 = model_flops(&m, r.global_batch, 2048);
        let got96 = hardware_flops(&m, r.global_batch, 2048, Recompute::Full);
        assert!((got72 - f72).abs() / f72 < 1e-12, "{}", r.name);
        assert!((got96 - f96).abs() / f96 < 1e-12, "{}", r.name);
        let p = 12.0 * l * h * h * (1.0 + 13.0 / (12.0 * h) + (v + s) / (12.0 * l * h));
        assert_eq!(m.params(2048) as f64, p.round(), "{}", r.name);
    }
}

#[test]
fn palm_formula() {
    assert_eq!(
        palm_flops_per_token(124e6, 12.0, 768.0, 1024.0),
        6.0 * 124e6 + 12.0 * 12.0 * 768.0 * 1024.0
    );
}

#[test]
fn gqa_swiglu_moe_count_only_active_matmuls() {
    let m = plan::models::find_model("mixtral-8x7b", &[]).unwrap();
    let s = 4096;
    // Active params ~12.9B of 46.7B (Mixtral paper: 13B active, 47B total).
    let total = m.params(s) as f64 / 1e9;
    let active = m.active_params(s) as f64 / 1e9;
    assert!((46.0..47.5).contains(&total), "{total}");
    assert!((12.5..13.5).contains(&active), "{active}");
    let f = model_flops(&m, 1, s) / s as f64;
    // ~6 N_active per token plus attention.
    let approx =
        6.0 * (active * 1e9 - 2.0 * 32000.0 * 4096.0) + 6.0 * 2.0 * 4096.0 * 32000.0 + 12.0 * 32.0 * 4096.0 * s as f64;
    assert!((f - approx).abs() / approx < 0.01, "{f} vs {approx}");
}
