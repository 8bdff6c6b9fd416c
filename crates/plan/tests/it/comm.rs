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
