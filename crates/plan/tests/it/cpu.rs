//! The CPU path of the cost model (last criterion: predict kiln's own `shakespeare-char` and GPT-2 124M
//! B4 T256 step times from a `kiln plan calibrate` file). A fixed synthetic calibration, so the formula cannot
//! drift silently; no timing here (`crates/plan/scripts/plan_vs_bench.py` compares with `kiln bench` on the machine).

use plan::cost::{estimate, single_device_layout, Attention};
use plan::hardware::{Cluster, CpuLocal, GemmCurve, HardwareCatalog, MeasuredGemm};
use plan::models::{find_model, ModelShape, RawModel};

const PEAK: f64 = 100e9;
const MEM_BW: f64 = 20e9;
const ELEM_BW: f64 = 5e9;
const OVH: f64 = 10e-6;
const CURVE: GemmCurve = GemmCurve { plateau: 0.9, m_half: 64.0, n_half: 32.0, k_half: 16.0 };
const ATTN_CURVE: GemmCurve = GemmCurve { plateau: 0.5, m_half: 16.0, n_half: 16.0, k_half: 32.0 };

fn synthetic_cpu() -> Cluster {
    let cpu = CpuLocal {
        name: "cpu-synthetic".into(),
        peak_flops_fp32: PEAK,
        mem_bytes: 16e9,
        mem_bw: MEM_BW,
        threads: Some(2),
        products: vec![],
        gemm_curve: Some(CURVE),
        attention_products: vec![],
        attention_curve: Some(ATTN_CURVE),
        elementwise_bw: Some(ELEM_BW),
        kernel_overhead: Some(OVH),
    };
    let mut cat = HardwareCatalog::builtin();
    cat.extend(HardwareCatalog { accelerators: vec![cpu.to_accelerator()], links: vec![] });
    Cluster::new(&cat, "cpu-synthetic", 1, None).unwrap()
}

/// An m×n×k product at the synthetic curve, plus one kernel call.
fn t(m: f64, n: f64, k: f64, batch: f64) -> f64 {
    2.0 * m * n * k * batch / (PEAK * CURVE.efficiency(m, n, k)) + OVH
}

/// A batched attention-core product at the synthetic attention curve.
fn ta(m: f64, n: f64, k: f64, batch: f64) -> f64 {
    2.0 * m * n * k * batch / (PEAK * ATTN_CURVE.efficiency(m, n, k)) + OVH
}

/// A Linear on `tok` rows, C → OC: forward, data gradient, weight gradient.
fn linear(tok: f64, c: f64, oc: f64) -> f64 {
    t(tok, oc, c, 1.0) + t(tok, c, oc, 1.0) + t(oc, c, tok, 1.0)
}

fn gpt2() -> ModelShape {
    let mut m = find_model("gpt2-124m", &[]).unwrap();
    m.vocab = 50304; // kiln pads 50257 to a multiple of 64
    m
}

fn shakespeare() -> ModelShape {
    RawModel {
        name: "shakespeare-char".into(),
        layers: 4,
        hidden: 128,
        heads: 4,
        vocab: 65,
        biases: Some(false),
        dropout: Some(false),
        ..Default::default()
    }
    .resolve()
    .unwrap()
}

/// Independent re-derivation of the GEMM, attention and optimizer terms.
fn check_terms(m: &ModelShape, b: u64, s: u64) -> f64 {
    let cl = synthetic_cpu();
    let e = estimate(m, &cl, &single_device_layout(b, s, Attention::Unfused));
    let (h, tok, sf) = (m.hidden as f64, (b * s) as f64, s as f64);
    let (l, v, a, d) = (m.layers as f64, m.vocab as f64, m.heads as f64, m.head_dim as f64);
    let per_layer = linear(tok, h, 3.0 * h) + linear(tok, h, h) + linear(tok, h, 4.0 * h) + linear(tok, 4.0 * h, h);
    // kiln's fused LM head: chunks of floor(2^23 / V) rows, the last one partial.
    let rows = (8388608.0 / v).floor().min(tok);
    let full = (tok / rows).floor();
    let rest = tok - full * rows;
    let head = |r: f64| if r > 0.0 { linear(r, h, v) } else { 0.0 };
    let gemm = l * per_layer + full * head(rows) + head(rest);
    let bt = b as f64 * a;
    // Forward S = QKᵀ, O = PV; backward dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q.
    let attn = l * (2.0 * ta(sf, sf, d, bt) + 4.0 * ta(sf, d, sf, bt));
    let params = m.params(s) as f64;
    let opt = 36.0 * params / MEM_BW + 4.0 * OVH;
    let br = &e.breakdown;
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-9 * y.abs().max(1e-12);
    assert!(close(br.compute_gemm_s, gemm), "gemm {} vs {}", br.compute_gemm_s, gemm);
    assert!(close(br.compute_attention_s, attn), "attention {} vs {}", br.compute_attention_s, attn);
    assert!(close(br.optimizer_s, opt), "optimizer {} vs {}", br.optimizer_s, opt);
    // No parallelism: the step is compute + memory-bound kernels + optimizer, nothing else.
    let sum = br.compute_gemm_s + br.compute_attention_s + br.compute_elementwise_s + br.optimizer_s;
    assert!(close(e.step_time_s, sum), "{} vs {sum}", e.step_time_s);
    assert_eq!(br.pp_bubble_s + br.tp_comm_s + br.dp_comm_exposed_s + br.recompute_s, 0.0);
    e.step_time_s
}

#[test]
fn cpu_step_time_of_kiln_gpt2_b4_t256_is_pinned() {
    let step = check_terms(&gpt2(), 4, 256);
    // Pinned with the synthetic calibration: a change of formula must update this number on purpose.
    let pinned = GPT2_PINNED;
    assert!((step / pinned - 1.0).abs() < 1e-9, "GPT-2 B4 T256 step {step} s, pinned {pinned} s");
}

#[test]
fn cpu_step_time_of_kiln_shakespeare_char_is_pinned() {
    let step = check_terms(&shakespeare(), 12, 64);
    let pinned = SHAKESPEARE_PINNED;
    assert!((step / pinned - 1.0).abs() < 1e-9, "shakespeare-char step {step} s, pinned {pinned} s");
}

const GPT2_PINNED: f64 = 11.867590197120002;
const SHAKESPEARE_PINNED: f64 = 0.0975493905777778;

#[test]
fn gemm_curve_fit_recovers_a_synthetic_curve() {
    let mut products = Vec::new();
    for m in [64u64, 256, 1024] {
        for n in [32u64, 128, 768, 3072] {
            for k in [16u64, 128, 768] {
                let gflops = PEAK * CURVE.efficiency(m as f64, n as f64, k as f64) / 1e9;
                products.push(MeasuredGemm { m, n, k, gflops, layout: None });
            }
        }
    }
    let fit = GemmCurve::fit(&products, PEAK).unwrap();
    assert_eq!((fit.m_half, fit.n_half, fit.k_half), (64.0, 32.0, 16.0));
    assert!((fit.plateau - 0.9).abs() < 1e-9, "{fit:?}");
}

#[test]
fn calibrate_file_round_trips_through_the_catalogue() {
    let text = r#"{"name":"cpu-x","peak_flops_fp32":1e11,"mem_bytes":8e9,"mem_bw":2e10,"threads":2,
        "products":[{"m":1024,"n":1024,"k":1024,"gflops":90.0,"layout":"nt"},{"m":256,"n":128,"k":128,"gflops":45.0}],
        "elementwise_bw":4e9,"kernel_overhead":2e-5}"#;
    let cat = HardwareCatalog::parse_extra(text, "cpu-x.json").unwrap();
    let acc = &cat.accelerators[0];
    assert_eq!(acc.elementwise_bw, Some(4e9));
    assert_eq!(acc.kernel_overhead, 2e-5);
    let c = acc.gemm_curve.expect("curve fitted from the products");
    let r = |m: f64, n: f64, k: f64| 1e11 * c.efficiency(m, n, k) / 1e9;
    assert!((r(1024.0, 1024.0, 1024.0) / 90.0 - 1.0).abs() < 0.02, "{c:?}");
    assert!((r(256.0, 128.0, 128.0) / 45.0 - 1.0).abs() < 0.02, "{c:?}");
}

#[test]
fn cpu_flash_attention_counts_kiln_tiles() {
    // kiln's tensor::flash: 64 × 64 tiles, the ones above the causal diagonal skipped (n = 4 tiles per row at
    // T = 256: 10 of 16 computed), 2 tile products forward and 5 backward at the attention curve's tile shape.
    let m = gpt2();
    let cl = synthetic_cpu();
    let e = estimate(&m, &cl, &single_device_layout(4, 256, Attention::Flash));
    let computed = 4.0 * 12.0 * 256.0 * 256.0 * 10.0 / 16.0;
    let st = 2.0 * computed * 64.0 / (PEAK * ATTN_CURVE.efficiency(64.0, 64.0, 64.0));
    let pv = 2.0 * computed * 64.0 / (PEAK * ATTN_CURVE.efficiency(64.0, 64.0, 64.0));
    let want = 12.0 * (3.0 * st + 4.0 * pv + 2.0 * OVH);
    let got = e.breakdown.compute_attention_s;
    assert!((got / want - 1.0).abs() < 1e-9, "{got} vs {want}");
}
