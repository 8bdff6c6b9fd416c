//! Context parallelism in the planner: the search splits the sequence when it is long and
//! leaves it whole when it is short, and models Ulysses' all-to-alls as exposed where ring
//! attention's blocks hide behind compute.

use plan::cost::estimate;
use plan::hardware::{Cluster, HardwareCatalog};
use plan::policy::CpMode;
use plan::search::{search, Constraints};

fn llama3_8b() -> plan::models::ModelShape {
    plan::models::find_model("llama3-8b", &[]).expect("catalogue model")
}

#[test]
fn the_search_splits_long_sequences_and_not_short_ones() {
    let m = llama3_8b();
    let cl = Cluster::new(&HardwareCatalog::builtin(), "h100-sxm", 64, None).unwrap();
    let best = |seq: u64| search(&m, &cl, 64, seq, &Constraints::default()).unwrap().plans[0].chosen.clone();
    assert_eq!(best(4096).cp, 1, "4K tokens fit one GPU's activations: no context parallelism");
    let long = best(131072);
    assert!(long.cp >= 4, "128K tokens: the best plan splits the sequence, got {long:?}");
    assert_eq!(long.cp_mode, CpMode::Ring, "ring attention hides its blocks behind the attention compute");
    // The same mesh with Ulysses: its all-to-alls are exposed, so it is predicted slower, and
    // its context-parallel time is what the all-to-alls cost.
    let ring = estimate(&m, &cl, &long);
    let uly = estimate(&m, &cl, &plan::cost::Layout { cp_mode: CpMode::Ulysses, ..long.clone() });
    assert!(uly.breakdown.cp_comm_s > ring.breakdown.cp_comm_s, "ulysses {} vs ring {}", uly.breakdown.cp_comm_s, ring.breakdown.cp_comm_s);
    assert!(uly.step_time_s > ring.step_time_s);
}
