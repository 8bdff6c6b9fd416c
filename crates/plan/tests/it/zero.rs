//! ZeRO model-state bytes per GPU are exactly the ZeRO paper's formulas
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

/// ZeRO-2/3 with a pipeline (FSDP-style, as kiln's runtime runs it) is accepted: it shards
/// gradients (and parameters) per stage, and its per-micro-batch traffic is charged where the
/// micro-batches' compute cannot hide it.
#[test]
fn zero_2_and_3_with_a_pipeline_are_estimated() {
    use plan::cost::{estimate, memory};
    use plan::search::{search, Constraints};
    let m = plan::models::find_model("llama3-8b", &[]).unwrap();
    let cl = plan::hardware::Cluster::new(&plan::hardware::HardwareCatalog::builtin(), "h100-sxm", 64, None).unwrap();
    let c = Constraints { tp: Some(2), pp: Some(4), zero: Some(1), ..Default::default() };
    let base = search(&m, &cl, 64, 8192, &c).unwrap().plans[0].chosen.clone();
    let z = |zero: u8| plan::cost::Layout { zero, ..base.clone() };
    let (m1, m2, m3) = (memory(&m, &cl, &z(1)).total, memory(&m, &cl, &z(2)).total, memory(&m, &cl, &z(3)).total);
    assert!(m3 < m2 && m2 < m1, "zero 1 {m1}, 2 {m2}, 3 {m3}");
    // One micro-batch's compute is small against 8 data-parallel ranks' gathers on a slow
    // fabric: ZeRO-3's per-micro-batch all-gathers show.
    let slow = plan::hardware::Cluster::new(&plan::hardware::HardwareCatalog::builtin(), "h100-sxm", 64, Some(1)).unwrap();
    let (e1, e3) = (estimate(&m, &slow, &z(1)), estimate(&m, &slow, &z(3)));
    assert!(e3.step_time_s > e1.step_time_s, "zero 3 {} vs zero 1 {} with one GPU per node", e3.step_time_s, e1.step_time_s);
}

/// Each optimizer's state bytes per parameter, and what they do to a layout: the same layout's
/// optimizer memory orders as the bytes do, and only Muon's iteration adds to the step.
#[test]
fn each_optimizer_has_its_state_bytes_and_muon_its_iteration() {
    use plan::cost::{estimate, memory, optimizer_bytes_per_param, Layout};
    use plan::policy::{OptimName, StateForm};
    use plan::search::{search, Constraints};
    let m = plan::models::find_model("llama2-7b", &[]).unwrap();
    let cl = plan::hardware::Cluster::new(&plan::hardware::HardwareCatalog::builtin(), "h100-sxm", 8, None).unwrap();
    let c = Constraints { tp: Some(1), pp: Some(1), zero: Some(1), micro_batch: Some(1), precision: Some(Precision::Bf16), ..Default::default() };
    let base = search(&m, &cl, 32, 4096, &c).unwrap().plans[0].chosen.clone();
    let with = |optimizer, optim_state| Layout { optimizer, optim_state, ..base.clone() };
    let share = plan::cost::matrix_share(&m);
    assert!((0.9..1.0).contains(&share), "{share}");
    let k = |o, s| optimizer_bytes_per_param(&with(o, s), share);
    // fp32 master + moments: AdamW 4 + 8, 8-bit 4 + 2 + scales, bf16 state under bf16 weights 4 (no master).
    assert_eq!(k(OptimName::AdamW, StateForm::Fp32), 12.0);
    assert!((k(OptimName::AdamW, StateForm::Int8) - (6.0 + 8.0 / 256.0)).abs() < 1e-12);
    assert_eq!(k(OptimName::AdamW, StateForm::Bf16), 4.0);
    assert_eq!(k(OptimName::Lion, StateForm::Fp32), 8.0);
    assert_eq!(k(OptimName::Adafactor, StateForm::Fp32), 4.0);
    let muon = k(OptimName::Muon, StateForm::Fp32);
    assert!(muon > 8.0 && muon < 8.5, "{muon}");
    let opt = |o, s| memory(&m, &cl, &with(o, s)).optimizer;
    assert!(opt(OptimName::AdamW, StateForm::Bf16) < opt(OptimName::AdamW, StateForm::Int8) && opt(OptimName::AdamW, StateForm::Int8) < opt(OptimName::Lion, StateForm::Fp32));
    assert!(opt(OptimName::Lion, StateForm::Fp32) < opt(OptimName::AdamW, StateForm::Fp32));
    let step = |o| estimate(&m, &cl, &with(o, StateForm::Fp32)).step_time_s;
    assert!(step(OptimName::Muon) > 1.05 * step(OptimName::AdamW), "Muon's Newton–Schulz iteration costs: {} vs {}", step(OptimName::Muon), step(OptimName::AdamW));
    assert!(step(OptimName::Lion) <= step(OptimName::AdamW));
}
