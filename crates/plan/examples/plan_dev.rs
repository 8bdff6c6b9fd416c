//! Developer check: print the Table 1 validation and per-row breakdowns
//! (`cargo run --release -p plan --example plan_dev [--detail]`).
use plan::cli::*;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    match validate_cmd("table1", None, false) {
        Ok(s) => print!("{s}"),
        Err(e) => eprintln!("error: {e}"),
    }
    if args.iter().any(|a| a == "--70b") {
        let m = ModelArgs { model: Some("llama3-70b".into()), ..Default::default() };
        let c = ClusterArgs { gpu: "h100-sxm".into(), gpus: 64, ..Default::default() };
        let l = LayoutArgs { global_batch: 512, seq: Some(8192), ..Default::default() };
        let t0 = std::time::Instant::now();
        print!("{}", search_cmd(&m, &c, &l, 8, false).unwrap());
        println!("total {:.3}s", t0.elapsed().as_secs_f64());
        return;
    }
    if args.iter().any(|a| a == "--ranks") {
        ranks();
        return;
    }
    if !args.iter().any(|a| a == "--detail") {
        return;
    }
    let rows = plan::validate::parse_table(plan::validate::NARAYANAN_TABLE1, "t1").unwrap();
    for r in rows {
        let m = ModelArgs { layers: Some(r.layers), hidden: Some(r.hidden), heads: Some(r.heads), vocab: Some(51200), ..Default::default() };
        let c = ClusterArgs { gpu: "a100-80gb".into(), gpus: r.gpus, ..Default::default() };
        let l = LayoutArgs {
            tp: Some(r.tp), pp: Some(r.pp), global_batch: r.global_batch, seq: Some(2048),
            schedule: Some(if r.pp > 1 { "interleaved" } else { "1f1b" }.into()),
            recompute: Some("full".into()), sequence_parallel: Some(false), zero: Some(0),
            attention: Some("unfused".into()), ..Default::default()
        };
        println!("== {}", r.name);
        match estimate_cmd(&m, &c, &l, false) { Ok(s) => print!("{s}"), Err(e) => println!("error: {e}") }
    }
}

/// Rank of the published (TP, PP) in the search, under the published software setup.
#[allow(dead_code)]
pub fn ranks() {
    use plan::cost::*;
    use plan::search::*;
    let rows = plan::validate::parse_table(plan::validate::NARAYANAN_TABLE1, "t1").unwrap();
    let cat = plan::hardware::HardwareCatalog::builtin();
    for r in rows {
        let m = plan::models::ModelShape::gpt(&r.name, r.layers, r.hidden, r.heads, 51200, 2048).unwrap();
        let cl = plan::hardware::Cluster::new(&cat, "a100-80gb", r.gpus, None).unwrap();
        let c = Constraints {
            schedule: Some(Schedule::Interleaved), recompute: Some(Recompute::Full), sequence_parallel: Some(false),
            zero: Some(0), attention: Some(Attention::Unfused), overlap_dp: Some(false), overlap_comm: Some(false), fp32_grads: Some(false), precision: Some(plan::hardware::Precision::Fp16), ..Default::default()
        };
        let t0 = std::time::Instant::now();
        let res = search(&m, &cl, r.global_batch, 2048, &c).unwrap();
        let rank = res.plans.iter().position(|e| e.chosen.tp == r.tp && e.chosen.pp == r.pp);
        let top: Vec<String> = res.plans.iter().take(4).map(|e| format!("{}:{:.1}", mesh_name(&e.chosen), e.breakdown.hardware_tflops_per_gpu)).collect();
        if let (Some(k), true) = (rank, std::env::var("EXPLAIN").is_ok()) {
            println!("   {}", explain(&res.plans[0], &res.plans[k]));
        }
        println!("{:<8} rank {:?} of {} ({} evaluated, {:.2}s) top: {}", r.name, rank.map(|x| x + 1), res.plans.len(), res.evaluated, t0.elapsed().as_secs_f64(), top.join(" | "));
    }
}
