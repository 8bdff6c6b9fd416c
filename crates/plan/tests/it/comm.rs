//! α–β collectives and link selection.

use plan::cost::{all_gather_time, all_reduce_time, all_to_all_time, group_link, p2p_time, reduce_scatter_time};

#[test]
fn ring_formulas_and_link_levels() {
    let cl = super::a100(64);
    // 8-way TP inside a DGX node: NVLink at 300 GB/s x 0.78.
    let tp = group_link(&cl, 8, 1);
    assert!(!tp.inter_node);
    assert_eq!(tp.bw, 300e9 * 0.78);
    let s = 100e6;
    let ring = 2.0 * 7.0 * tp.latency + 2.0 * 7.0 / 8.0 * s / tp.bw;
    assert!((all_reduce_time(tp, s) - ring).abs() < 1e-15);
    assert!((reduce_scatter_time(tp, s) + all_gather_time(tp, s) - all_reduce_time(tp, s)).abs() < 1e-12);
    // DP across nodes, one rank per node (TP 8 inside): one HDR NIC per GPU, 25 GB/s x 0.92.
    let dp = group_link(&cl, 8, 8);
    assert!(dp.inter_node);
    assert!((dp.bw - 25e9 * 0.92).abs() < 1.0);
    // DP across nodes with all 8 GPUs of each node in the group: 8 rings, 8 NICs.
    let dp8 = group_link(&cl, 64, 1);
    assert!((dp8.bw - 8.0 * 25e9 * 0.92).abs() < 1.0);
    // A 6-way group does not tile an 8-GPU node: it crosses nodes.
    assert!(group_link(&cl, 6, 1).inter_node);
    // All-to-all across 2 nodes of 8: half the bytes leave through the NIC share.
    let ep = group_link(&cl, 16, 1);
    let want = 15.0 * ep.latency + (8.0 / 16.0 * s / ep.nic_bw).max(7.0 / 16.0 * s / ep.intra_bw);
    assert!((all_to_all_time(ep, s) - want).abs() < 1e-12);
    assert!((p2p_time(tp, s) - (tp.latency + s / tp.bw)).abs() < 1e-15);
}

/// 1-bit Adam on a slow fabric (64 nodes of 8 A100s, one 100 Gb/s Ethernet NIC per
/// node). The compressed momentum sends 1/32 of the gradient bytes and, at the optimizer step,
/// is not hidden behind backward; where the gradients' all-reduce dominates, the step is
/// several times faster. Its traffic is `parallel::compress`'s, word for word.
#[test]
fn one_bit_adam_pays_on_ethernet() {
    use plan::cost::{estimate, onebit_buffer_bytes};
    use plan::policy::Compression;
    let m = plan::models::find_model("gpt2-1558m", &[]).unwrap();
    let mut cat = plan::hardware::HardwareCatalog::builtin();
    let acc = cat.accelerators.iter_mut().find(|a| a.name == "a100-80gb").unwrap();
    (acc.node.inter, acc.node.nics_per_node) = ("eth-100g".into(), 1);
    let cl = plan::hardware::Cluster::new(&cat, "a100-80gb", 512, Some(8)).unwrap();
    let c = plan::search::Constraints { tp: Some(1), pp: Some(1), dp: Some(512), zero: Some(0), precision: Some(plan::hardware::Precision::Bf16), ..Default::default() };
    let base = plan::search::search(&m, &cl, 512, 1024, &c).unwrap().plans[0].chosen.clone();
    let one = plan::cost::Layout { compression: Compression::OnebitAdam, ..base.clone() };
    let (e0, e1) = (estimate(&m, &cl, &base), estimate(&m, &cl, &one));
    let ratio = e0.breakdown.dp_bytes_per_gpu / e1.breakdown.dp_bytes_per_gpu;
    assert!(ratio > 30.0 && ratio < 33.0, "bytes ratio {ratio}");
    assert!(e0.step_time_s > 2.0 * e1.step_time_s, "{} s vs {} s", e0.step_time_s, e1.step_time_s);
    assert_eq!(e1.breakdown.dp_comm_exposed_s, e1.breakdown.dp_comm_total_s, "nothing hides the compressed momentum");
    // n messages of ⌈⌈Ψ/n⌉/32⌉ + 1 words.
    assert_eq!(onebit_buffer_bytes(7488.0, 4), 4.0 * 60.0 * 4.0);
    // PowerSGD rank 4: every matrix as (rows + cols)·4 numbers, all-reduced after backward.
    let ps = plan::cost::Layout { compression: Compression::PowerSgd, powersgd_rank: 4, ..base.clone() };
    let e2 = estimate(&m, &cl, &ps);
    let r2 = e0.breakdown.dp_bytes_per_gpu / e2.breakdown.dp_bytes_per_gpu;
    assert!(r2 > 50.0, "PowerSGD rank 4 bytes ratio {r2}");
    assert!(e0.step_time_s > 2.0 * e2.step_time_s, "{} s vs {} s", e0.step_time_s, e2.step_time_s);
    let (p, q) = plan::cost::powersgd_elements(&m, 1024, 4);
    assert!(p + q < m.params(1024) as f64 / 50.0, "{p} + {q}");
    // 0/1 Adam in its steady state: 1-bit Adam's exchange once every 16 steps.
    let zo = plan::cost::Layout { compression: Compression::ZerooneAdam, ..base.clone() };
    let e3 = estimate(&m, &cl, &zo);
    let r3 = e1.breakdown.dp_bytes_per_gpu / e3.breakdown.dp_bytes_per_gpu;
    assert!((r3 - plan::cost::ZEROONE_SYNC_INTERVAL).abs() < 1e-9, "0/1 Adam against 1-bit Adam {r3}");
    assert!(e1.step_time_s > e3.step_time_s, "{} s vs {} s", e1.step_time_s, e3.step_time_s);
    let zero1 = plan::cost::Layout { zero: 1, ..zo.clone() };
    let err = plan::cost::check_layout(&m, &cl, &zero1).unwrap_err();
    assert!(err.0.contains("--compression zero_one_adam") && err.0.contains("--zero 0"), "{}", err.0);
}

/// ZeRO++ on the same Ethernet cluster. Against ZeRO-3 in bf16 it sends int8 gathers
/// (about half the bytes), the backward's inside the node (hpZ), and int4 gradients through two
/// all-to-alls (a quarter, an eighth of it across the nodes): several times fewer bytes per
/// GPU, and a faster step where ZeRO-3's collectives dominate.
#[test]
fn zeropp_cuts_zero3_traffic_on_ethernet() {
    use plan::cost::estimate;
    let m = plan::models::find_model("gpt2-1558m", &[]).unwrap();
    let mut cat = plan::hardware::HardwareCatalog::builtin();
    let acc = cat.accelerators.iter_mut().find(|a| a.name == "a100-80gb").unwrap();
    (acc.node.inter, acc.node.nics_per_node) = ("eth-100g".into(), 1);
    let cl = plan::hardware::Cluster::new(&cat, "a100-80gb", 512, Some(8)).unwrap();
    let c = plan::search::Constraints { tp: Some(1), pp: Some(1), dp: Some(512), zero: Some(3), precision: Some(plan::hardware::Precision::Bf16), ..Default::default() };
    let base = plan::search::search(&m, &cl, 512, 1024, &c).unwrap().plans[0].chosen.clone();
    let zpp = plan::cost::Layout { zeropp: true, ..base.clone() };
    let (e0, e1) = (estimate(&m, &cl, &base), estimate(&m, &cl, &zpp));
    let ratio = e0.breakdown.dp_bytes_per_gpu / e1.breakdown.dp_bytes_per_gpu;
    assert!(ratio > 2.5, "bytes ratio {ratio}");
    assert!(e0.step_time_s > 1.5 * e1.step_time_s, "{} s vs {} s", e0.step_time_s, e1.step_time_s);
    // Refused without ZeRO-3.
    let bad = plan::cost::Layout { zeropp: true, zero: 2, ..base.clone() };
    assert!(plan::cost::check_layout(&m, &cl, &bad).is_err());
}
