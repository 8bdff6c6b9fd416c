//! For each Table 1 row, search (same model, cluster, batch and the published software
//! setup: fp16, full recomputation, interleaved schedule, no SP, unfused attention, no communication overlap) ranks the
//! published (TP, PP) in its top 3, or the planner's explanation names the assumption that makes another better.

use plan::cost::{Attention, Recompute};
use plan::schedule::Kind;
use plan::hardware::Precision;
use plan::search::{explain, search, Constraints};

#[test]
fn published_tp_pp_in_top3_or_explained() {
    let mut in_top3 = 0;
    for r in super::table1_rows() {
        let m = super::gpt_of(&r);
        let cl = super::a100(r.gpus);
        let c = Constraints {
            schedule: Some(Kind::Interleaved),
            recompute: Some(Recompute::Full),
            sequence_parallel: Some(false),
            zero: Some(0),
            precision: Some(Precision::Fp16),
            attention: Some(Attention::Unfused),
            overlap_dp: Some(false),
            overlap_comm: Some(false),
            ..Default::default()
        };
        let res = search(&m, &cl, r.global_batch, 2048, &c).unwrap();
        let rank = res
            .plans
            .iter()
            .position(|e| e.chosen.tp == r.tp && e.chosen.pp == r.pp)
            .expect("published layout fits");
        let top: Vec<String> = res
            .plans
            .iter()
            .take(3)
            .map(|e| {
                format!(
                    "{} {:.1}",
                    plan::search::mesh_name(&e.chosen),
                    e.breakdown.hardware_tflops_per_gpu
                )
            })
            .collect();
        println!(
            "{}: published tp{} pp{} ranks {} of {} (top 3: {})",
            r.name,
            r.tp,
            r.pp,
            rank + 1,
            res.plans.len(),
            top.join(" | ")
        );
        if rank < 3 {
            in_top3 += 1;
            continue;
        }
        let why = explain(&res.plans[0], &res.plans[rank]);
        println!("   {why}");
        // The explanation must name the assumption: TP collectives are not overlapped and, without SP, every TP
        // rank repeats the LayerNorm/dropout traffic; the winner uses a smaller TP degree.
        assert!(why.contains("TP communication saves"), "{}: {why}", r.name);
        assert!(res.plans[0].chosen.tp < r.tp, "{}", r.name);
    }
    assert!(
        in_top3 >= 7,
        "only {in_top3} of 10 rows rank the published layout in the top 3"
    );
}
