//! Predicted TFLOP/s per GPU on Narayanan et al. Table 1 (the table's convention, counting
//! the recomputation forward) has MAPE <= 8% and no row beyond 15%. Fails if the cost model drifts.

use plan::hardware::HardwareCatalog;
use plan::validate::validate;

#[test]
fn table1_mape_within_8_percent_and_every_row_within_15() {
    let rows = super::table1_rows();
    assert_eq!(rows.len(), 10);
    let rep = validate(&rows, &HardwareCatalog::builtin(), "table1").unwrap();
    print!("{}", plan::cli::report_text(&rep));
    for r in &rep.rows {
        assert!(r.fits, "{}: published layout predicted not to fit", r.name);
        assert!(
            r.error_pct.abs() <= 15.0,
            "{}: {:.1}% off (predicted {:.1}, published {:.1})",
            r.name,
            r.error_pct,
            r.predicted_tflops,
            r.published_tflops
        );
    }
    assert!(rep.mape_pct <= 8.0, "MAPE {:.2}%", rep.mape_pct);
}

#[test]
fn table1_json_form_gives_the_same_answer() {
    let json = r#"[{"params":1.7,"heads":24,"hidden":2304,"layers":24,"TP":1,"PP":1,"GPUs":32,"global_batch":512,"tflops_per_gpu":137}]"#;
    let rows = plan::validate::parse_json(json, "t.json").unwrap();
    let rep = validate(&rows, &HardwareCatalog::builtin(), "t.json").unwrap();
    let csv = validate(&super::table1_rows()[..1], &HardwareCatalog::builtin(), "t.csv").unwrap();
    assert!((rep.rows[0].predicted_tflops - csv.rows[0].predicted_tflops).abs() < 1e-9);
}

#[test]
fn planner_parameter_count_matches_the_table() {
    // Table 1's "params" column (rounded, e.g. 1.65B printed as 1.7) vs eq. (1) as the planner counts it.
    for r in super::table1_rows() {
        let p = super::gpt_of(&r).params(2048) as f64 / 1e9;
        assert!(
            (p - r.params_b).abs() / r.params_b < 0.04,
            "{}: planner counts {p:.2}B",
            r.name
        );
    }
}
