//! Pipeline schedules: every task runs once, dependencies hold, and the simulated bubble is the
//! published one with equal-cost stages.

use parallel::pp::{Kind, Schedule};

#[test]
fn every_schedule_runs_each_pass_once_in_dependency_order() {
    for (kind, v) in [(Kind::Gpipe, 1), (Kind::OneFOneB, 1), (Kind::Interleaved, 2), (Kind::Interleaved, 3)] {
        for p in [1, 2, 4] {
            for m in [4, 8, 12] {
                let s = Schedule::new(kind, p, m, v).unwrap();
                for r in 0..p {
                    let mut t = s.tasks(r);
                    assert_eq!(t.len(), 2 * m * v, "{kind:?} p {p} m {m}");
                    t.sort_by_key(|x| (x.forward, x.mb, x.chunk));
                    t.dedup();
                    assert_eq!(t.len(), 2 * m * v, "{kind:?}: a task twice");
                }
                let tl = s.simulate(1.0, 2.0);
                // A stage's forward of a micro-batch ends before the next stage's starts.
                for r in 1..p {
                    for &(t, start, _) in &tl[r] {
                        if t.forward && t.chunk == 0 {
                            let prev = tl[r - 1].iter().find(|x| x.0 == t).unwrap();
                            assert!(prev.2 <= start);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn simulated_bubbles_match_the_formulas() {
    for (kind, v) in [(Kind::Gpipe, 1), (Kind::OneFOneB, 1), (Kind::Interleaved, 2)] {
        for m in [4, 8, 16] {
            let s = Schedule::new(kind, 4, m, v).unwrap();
            let b = s.bubble(1.0 / v as f64, 2.0 / v as f64);
            let worst = b.iter().fold(0.0f64, |a, &x| a.max(x));
            assert!((worst - s.ideal_bubble()).abs() < 1e-9, "{kind:?} m {m}: {b:?} vs {}", s.ideal_bubble());
        }
    }
}

#[test]
fn one_f_one_b_bounds_activations_by_stages_gpipe_by_micro_batches() {
    for m in [4, 8, 16] {
        let g = Schedule::new(Kind::Gpipe, 4, m, 1).unwrap();
        let f = Schedule::new(Kind::OneFOneB, 4, m, 1).unwrap();
        assert_eq!(g.peak_in_flight(0), m);
        assert_eq!(f.peak_in_flight(0), 4);
        assert_eq!(f.peak_in_flight(3), 1);
    }
    assert!(Schedule::new(Kind::Interleaved, 4, 6, 2).is_err());
    assert!(Schedule::new(Kind::OneFOneB, 4, 6, 2).is_err());
}
