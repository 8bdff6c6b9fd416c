mod apply;
mod comm;
mod ep;
mod mpi;

use parallel::{Axis, DeviceMesh};

#[test]
fn mesh_validates_world_size() {
    let e = DeviceMesh::new(&[(Axis::Dp, 2), (Axis::Tp, 2)], 8).unwrap_err();
    assert!(e.contains("multiply to 4") && e.contains("world size is 8"), "{e}");
    let e = DeviceMesh::new(&[(Axis::Pp, 0)], 1).unwrap_err();
    assert!(e.contains("pp must be positive"), "{e}");
    assert_eq!(DeviceMesh::single().world(), 1);
}

#[test]
fn ranks_and_coordinates_round_trip_with_tp_fastest() {
    let m = DeviceMesh::new(&[(Axis::Pp, 2), (Axis::Dp, 3), (Axis::Tp, 2)], 12).unwrap();
    for r in 0..12 {
        assert_eq!(m.rank(m.coords(r)), r);
    }
    assert_eq!(m.group(Axis::Tp, 0), vec![0, 1]);
    assert_eq!(m.group(Axis::Dp, 1), vec![1, 3, 5]);
    assert_eq!(m.group(Axis::Pp, 5), vec![5, 11]);
    // Every rank is in exactly one group per axis.
    for axis in [Axis::Pp, Axis::Dp, Axis::Tp] {
        let mut seen = vec![0; 12];
        for r in 0..12 {
            if m.group(axis, r)[0] == r {
                for g in m.group(axis, r) {
                    seen[g] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&s| s == 1), "{axis}: {seen:?}");
    }
}
mod pp;

#[test]
fn ep_mesh_groups_split_the_batch_over_dp_and_ep() {
    let m = DeviceMesh::new(&[(Axis::Pp, 2), (Axis::Dp, 2), (Axis::Ep, 2)], 8).unwrap();
    // Ranks 0..4 are stage 0: (dp, ep) = (0,0) (0,1) (1,0) (1,1); the experts' group is dp.
    assert_eq!(m.group_axes(&[Axis::Dp, Axis::Ep], 1), vec![0, 1, 2, 3]);
    assert_eq!(m.group_axes(&[Axis::Dp, Axis::Ep], 6), vec![4, 5, 6, 7]);
    assert_eq!(m.group(Axis::Ep, 2), vec![2, 3]);
    assert_eq!(m.group(Axis::Dp, 1), vec![1, 3]);
    assert_eq!(m.group_axes(&[Axis::Dp], 5), m.group(Axis::Dp, 5));
}
