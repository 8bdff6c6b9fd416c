//! Activation bytes per layer equal Korthikanti et al.'s closed forms for each
//! configuration of their Table 2, at every Table 1 shape (s, h, a, t), and the pipeline totals follow §4.2.3.

use plan::cost::{activation_bytes_per_layer, inflight_microbatches, ActConfig, Attention, Recompute};
use plan::schedule::Kind;

fn cfg(s: f64, b: f64, t: f64, sp: bool, recompute: Recompute) -> ActConfig {
    ActConfig {
        s_local: s,
        s_kv: s,
        b,
        t,
        sp,
        recompute,
        attention: Attention::Unfused,
        e: 2.0,
        gemm_in: 2.0,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs()
}

#[test]
fn per_layer_activations_match_korthikanti_for_every_table1_configuration() {
    for r in super::table1_rows() {
        let m = super::gpt_of(&r);
        let (s, h, a) = (2048.0, r.hidden as f64, r.heads as f64);
        for b in [1.0, 2.0, 4.0] {
            for t in [1.0, r.tp as f64] {
                let sbh = s * b * h;
                let cases = [
                    (
                        false,
                        Recompute::None,
                        if t == 1.0 {
                            sbh * (34.0 + 5.0 * a * s / h)
                        } else {
                            sbh * (10.0 + 24.0 / t + 5.0 * a * s / (h * t))
                        },
                    ),
                    (true, Recompute::None, sbh * (34.0 / t + 5.0 * a * s / (h * t))),
                    (false, Recompute::Selective, sbh * (10.0 + 24.0 / t)),
                    (true, Recompute::Selective, sbh * (34.0 / t)),
                    (false, Recompute::Full, 2.0 * sbh),
                ];
                for (sp, rc, want) in cases {
                    if sp && t == 1.0 {
                        continue;
                    }
                    let got = activation_bytes_per_layer(&m, false, &cfg(s, b, t, sp, rc));
                    assert!(
                        close(got, want),
                        "{} b={b} t={t} sp={sp} {rc:?}: {got} vs {want}",
                        r.name
                    );
                }
            }
        }
    }
}

#[test]
fn fp8_linears_keep_their_inputs_in_one_byte() {
    // Transformer Engine saves the FP8 cast of each linear's input: the QKV input sbh, the projection input sbh/t,
    // the fc1 input sbh and the fc2 input 4sbh/t drop from 2 bytes to 1 (sbh(2 + 5/t) less; with SP all are /t).
    for r in super::table1_rows() {
        let m = super::gpt_of(&r);
        let (s, b, h, t) = (2048.0, 2.0, r.hidden as f64, r.tp as f64);
        let sbh = s * b * h;
        for (sp, rc, want) in [
            (false, Recompute::Selective, sbh * (8.0 + 19.0 / t)),
            (true, Recompute::Selective, sbh * (27.0 / t)),
            (false, Recompute::Full, 2.0 * sbh),
        ] {
            if sp && t == 1.0 {
                continue;
            }
            let c = ActConfig { gemm_in: 1.0, ..cfg(s, b, t, sp, rc) };
            let got = activation_bytes_per_layer(&m, false, &c);
            assert!(close(got, want), "{} t={t} sp={sp} {rc:?}: {got} vs {want}", r.name);
        }
    }
}

#[test]
fn pipeline_totals_follow_korthikanti() {
    // 1F1B: the first stage holds p micro-batches of L/p layers = L layers' worth.
    for (p, m) in [(2u64, 8u64), (8, 64), (35, 280), (64, 512)] {
        assert_eq!(inflight_microbatches(Kind::OneFOneB, p, m, 1), p as f64);
        assert_eq!(inflight_microbatches(Kind::Gpipe, p, m, 1), m as f64);
        for v in [2u64, 4] {
            let want = p as f64 * (1.0 + (p as f64 - 1.0) / (p as f64 * v as f64));
            assert_eq!(inflight_microbatches(Kind::Interleaved, p, m, v), want);
        }
    }
}
