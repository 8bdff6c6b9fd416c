//! The communicator against sequential references (communicator, collective diagnostics).

use parallel::{mesh_group, run_ranks, run_ranks_with_timeout, Axis, Comm, DeviceMesh};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Deterministic data for (seed, rank) with magnitudes spread over 1e-3..1e3, so the order of a
/// sum shows in its low bits.
fn data(seed: u64, rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let h = mix64(seed ^ mix64(rank as u64 * 1_000_003 + i as u64));
            let u = (h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            // A table, not `powi`: Miri makes library float functions deliberately inexact.
            u * [1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3][(h % 7) as usize]
        })
        .collect()
}

/// Sequential left fold in rank order: the reference every reduction must equal bit for bit.
fn seq_sum(parts: &[Vec<f32>]) -> Vec<f32> {
    let mut acc = parts[0].clone();
    for p in &parts[1..] {
        for (a, x) in acc.iter_mut().zip(p) {
            *a += *x;
        }
    }
    acc
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn panic_text(e: &(dyn std::any::Any + Send)) -> String {
    e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

/// Odd sizes on both sides of the small/large all-reduce paths (4096 elements); fewer under
/// Miri (`cargo +nightly miri test -p parallel --test it -- comm::`), which checks the
/// raw-pointer sharing for data races and aliasing violations.
const LENS: &[usize] = if cfg!(miri) { &[0, 7, 4097] } else { &[0, 1, 2, 7, 1001, 4096, 4097, 9999] };

#[test]
fn all_reduce_matches_sequential_sum_on_1_to_4_ranks() {
    for n in 1..=4 {
        for &len in LENS {
            let parts: Vec<_> = (0..n).map(|r| data(11, r, len)).collect();
            let want = bits(&seq_sum(&parts));
            let got = run_ranks(n, |c| {
                let mut b = data(11, c.rank(), len);
                c.all_reduce_sum(&mut b);
                b
            });
            for (r, g) in got.iter().enumerate() {
                assert_eq!(bits(g), want, "n={n} len={len} rank {r}");
            }
        }
    }
}

#[test]
fn reduce_scatter_all_gather_all_to_all_broadcast_match_references() {
    for n in 1..=4 {
        for c in [1usize, 3, 5, if cfg!(miri) { 17 } else { 333 }] {
            let len = n * c;
            let parts: Vec<_> = (0..n).map(|r| data(12, r, len)).collect();
            let sum = seq_sum(&parts);
            let small: Vec<_> = (0..n).map(|r| data(13, r, c)).collect();
            let gathered: Vec<f32> = small.concat();
            let out = run_ranks(n, |comm| {
                let r = comm.rank();
                let input = data(12, r, len);
                let mut rs = vec![f32::NAN; c];
                comm.reduce_scatter_sum(&input, &mut rs);
                let mut ag = vec![f32::NAN; len];
                comm.all_gather(&data(13, r, c), &mut ag);
                let mut a2a = vec![f32::NAN; len];
                comm.all_to_all(&input, &mut a2a);
                let mut bc = Vec::new();
                for root in 0..n {
                    let mut b = data(14 + root as u64, r, c + 1);
                    comm.broadcast(&mut b, root);
                    bc.push(b);
                }
                comm.barrier();
                (rs, ag, a2a, bc)
            });
            for (r, (rs, ag, a2a, bc)) in out.iter().enumerate() {
                assert_eq!(bits(rs), bits(&sum[r * c..(r + 1) * c]), "reduce_scatter n={n} c={c} rank {r}");
                assert_eq!(bits(ag), bits(&gathered), "all_gather n={n} c={c} rank {r}");
                let want_a2a: Vec<f32> = (0..n).flat_map(|k| parts[k][r * c..(r + 1) * c].to_vec()).collect();
                assert_eq!(bits(a2a), bits(&want_a2a), "all_to_all n={n} c={c} rank {r}");
                for (root, b) in bc.iter().enumerate() {
                    assert_eq!(bits(b), bits(&data(14 + root as u64, root, c + 1)), "broadcast n={n} root {root} rank {r}");
                }
            }
        }
    }
}

#[test]
fn reductions_are_bit_identical_under_random_timing() {
    let n = 4;
    let len = if cfg!(miri) { 4099 } else { 10_007 };
    let parts: Vec<_> = (0..n).map(|r| data(21, r, len)).collect();
    let want = seq_sum(&parts);
    // The test means something only if arrival order would change the bits.
    let rev: Vec<f32> = {
        let mut p = parts.clone();
        p.reverse();
        seq_sum(&p)
    };
    assert_ne!(bits(&want), bits(&rev), "data too tame: reversed order sums identically");
    for run in 0..if cfg!(miri) { 1 } else { 6u64 } {
        let got = run_ranks(n, |c| {
            let r = c.rank();
            let nap = |step: u64| std::thread::sleep(Duration::from_micros(mix64(run * 97 + step * 13 + r as u64) % 3000));
            let mut b = data(21, r, len);
            nap(0);
            c.all_reduce_sum(&mut b);
            nap(1);
            let mut rs = vec![0.0; len.div_ceil(n)];
            let input = {
                let mut v = data(21, r, len);
                v.resize(rs.len() * n, 0.0);
                v
            };
            c.reduce_scatter_sum(&input, &mut rs);
            nap(2);
            let mut all = vec![0.0; rs.len() * n];
            c.all_gather(&rs, &mut all);
            all.truncate(len);
            (b, all)
        });
        for (r, (ar, rsag)) in got.iter().enumerate() {
            assert_eq!(bits(ar), bits(&want), "run {run} rank {r}: all_reduce");
            assert_eq!(bits(rsag), bits(&want), "run {run} rank {r}: reduce_scatter + all_gather");
        }
    }
}

#[test]
fn dp_and_tp_groups_of_a_2x2_mesh_run_concurrently() {
    let mesh = DeviceMesh::new(&[(Axis::Dp, 2), (Axis::Tp, 2)], 4).unwrap();
    let len = 513;
    let iters = if cfg!(miri) { 3 } else { 20 };
    let out = run_ranks(4, |world| {
        let dp = mesh_group(world, &mesh, Axis::Dp);
        let tp = mesh_group(world, &mesh, Axis::Tp);
        let [_, d, _, _, t] = mesh.coords(world.rank());
        assert_eq!((dp.size(), dp.rank(), tp.size(), tp.rank()), (2, d, 2, t));
        let mut results = Vec::new();
        for it in 0..iters {
            std::thread::sleep(Duration::from_micros(mix64(it * 4 + world.rank() as u64) % 500));
            let mut x = data(100 + it, world.rank(), len);
            tp.all_reduce_sum(&mut x);
            let mut g = vec![0.0; 2 * 3];
            dp.all_gather(&data(200 + it, world.rank(), 3), &mut g);
            let mut y = data(300 + it, world.rank(), len);
            dp.all_reduce_sum(&mut y);
            // Point-to-point inside a sub-group with a tag also used by the other group.
            let peer = 1 - tp.rank();
            tp.send(&[world.rank() as f32, it as f32], peer, 7);
            let mut m = [0.0; 2];
            tp.recv(&mut m, peer, 7);
            results.push((x, g, y, m));
        }
        results
    });
    for (w, per_iter) in out.iter().enumerate() {
        for (it, (x, g, y, m)) in per_iter.iter().enumerate() {
            let it64 = it as u64;
            let tp_g = mesh.group(Axis::Tp, w);
            let dp_g = mesh.group(Axis::Dp, w);
            let want_x = seq_sum(&tp_g.iter().map(|&r| data(100 + it64, r, len)).collect::<Vec<_>>());
            let want_g: Vec<f32> = dp_g.iter().flat_map(|&r| data(200 + it64, r, 3)).collect();
            let want_y = seq_sum(&dp_g.iter().map(|&r| data(300 + it64, r, len)).collect::<Vec<_>>());
            let peer_w = tp_g.iter().copied().find(|&r| r != w).unwrap();
            assert_eq!(bits(x), bits(&want_x), "world rank {w} iter {it}: tp all_reduce");
            assert_eq!(bits(g), bits(&want_g), "world rank {w} iter {it}: dp all_gather");
            assert_eq!(bits(y), bits(&want_y), "world rank {w} iter {it}: dp all_reduce");
            assert_eq!(*m, [peer_w as f32, it as f32], "world rank {w} iter {it}: tp send/recv");
        }
    }
}

#[test]
fn recv_matches_by_source_and_tag_in_send_order() {
    let out = run_ranks(3, |c| {
        let r = c.rank();
        if r == 0 {
            c.send(&[1.0], 1, 1);
            c.send(&[2.0, 2.0], 1, 2);
            c.send(&[3.0], 1, 1);
            vec![]
        } else if r == 2 {
            c.send(&[9.0], 1, 1);
            vec![]
        } else {
            let mut got = Vec::new();
            let mut two = [0.0; 2];
            c.recv(&mut two, 0, 2); // tag 2 first, though sent second
            got.extend(two);
            let mut one = [0.0];
            c.recv(&mut one, 2, 1); // another source, same tag
            got.extend(one);
            c.recv(&mut one, 0, 1);
            got.extend(one);
            c.recv(&mut one, 0, 1);
            got.extend(one);
            got
        }
    });
    assert_eq!(out[1], vec![2.0, 2.0, 9.0, 1.0, 3.0]);
    // A ring where every rank sends before it receives cannot deadlock: sends are buffered.
    let ring = run_ranks(4, |c| {
        let (r, n) = (c.rank(), c.size());
        c.send(&[r as f32], (r + 1) % n, 0);
        let mut b = [0.0];
        c.recv(&mut b, (r + n - 1) % n, 0);
        b[0]
    });
    assert_eq!(ring, vec![3.0, 0.0, 1.0, 2.0]);
}

#[test]
fn hang_diagnostic_names_the_collective_and_the_missing_rank() {
    let t0 = Instant::now();
    let msgs = run_ranks_with_timeout(3, Duration::from_millis(300), |c| {
        if c.rank() == 2 {
            return String::new(); // never arrives
        }
        let mut b = vec![1.0; 5];
        let e = catch_unwind(AssertUnwindSafe(|| c.all_reduce_sum(&mut b))).expect_err("should time out");
        panic_text(&*e)
    });
    assert!(t0.elapsed() < Duration::from_secs(10));
    for m in &msgs[..2] {
        assert!(m.contains("all_reduce_sum") && m.contains("timed out"), "{m}");
        assert!(m.contains("ranks [2] (world ranks [2]) have not arrived"), "{m}");
    }
    // In a sub-group the message names group ranks and world ranks.
    let mesh = DeviceMesh::new(&[(Axis::Dp, 2), (Axis::Tp, 2)], 4).unwrap();
    let msgs = run_ranks_with_timeout(4, Duration::from_millis(300), |c| {
        let dp = mesh_group(c, &mesh, Axis::Dp);
        if c.rank() == 3 {
            return String::new();
        }
        if c.rank() == 1 {
            let e = catch_unwind(AssertUnwindSafe(|| dp.barrier())).expect_err("should time out");
            return panic_text(&*e);
        }
        dp.barrier();
        String::new()
    });
    let m = &msgs[1];
    assert!(m.contains("barrier") && m.contains("world ranks [1, 3]") && m.contains("ranks [1] (world ranks [3]) have not arrived"), "{m}");
}

#[test]
fn a_panicking_rank_aborts_the_others_promptly() {
    let t0 = Instant::now();
    let e = catch_unwind(|| {
        run_ranks_with_timeout(3, Duration::from_secs(60), |c| {
            if c.rank() == 1 {
                panic!("boom on rank 1");
            }
            c.barrier();
        })
    })
    .expect_err("must propagate");
    assert_eq!(panic_text(&*e), "boom on rank 1");
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
}

#[test]
fn mismatched_calls_panic_on_every_rank() {
    let msgs = run_ranks(2, |c| {
        let e = catch_unwind(AssertUnwindSafe(|| {
            let mut b = vec![0.0; 4 + c.rank()];
            c.all_reduce_sum(&mut b);
        }))
        .expect_err("sizes differ");
        panic_text(&*e)
    });
    for m in &msgs {
        assert!(m.contains("collective mismatch") && m.contains("sequence number 0") && m.contains("rank 1 called #0 all_reduce_sum(f32 × 5) at crates/parallel/tests/it/comm.rs:"), "{m}");
    }
    let msgs = run_ranks(2, |c| {
        let e = catch_unwind(AssertUnwindSafe(|| {
            if c.rank() == 0 {
                c.barrier();
            } else {
                let mut o = [0.0; 2];
                c.all_gather(&[1.0], &mut o);
            }
        }))
        .expect_err("different collectives");
        panic_text(&*e)
    });
    for m in &msgs {
        assert!(m.contains("collective mismatch") && m.contains("rank 0 called #0 barrier") && m.contains("rank 1 called #0 all_gather(f32 × 1 → 2)"), "{m}");
    }
    let msgs = run_ranks(3, |c| {
        let e = catch_unwind(AssertUnwindSafe(|| {
            let g: &[usize] = if c.rank() == 2 { &[2] } else { &[0, 1, 2] };
            c.split(g);
        }))
        .expect_err("not a partition");
        panic_text(&*e)
    });
    for m in &msgs {
        assert!(m.contains("groups do not partition"), "{m}");
    }
}

#[test]
fn world_size_1_is_the_identity() {
    let out = run_ranks(1, |c| {
        assert_eq!((c.rank(), c.size()), (0, 1));
        let x = data(5, 0, 37);
        let mut a = x.clone();
        c.all_reduce_sum(&mut a);
        let mut rs = vec![0.0; 37];
        c.reduce_scatter_sum(&x, &mut rs);
        let mut ag = vec![0.0; 37];
        c.all_gather(&x, &mut ag);
        let mut bc = x.clone();
        c.broadcast(&mut bc, 0);
        let mut a2a = vec![0.0; 37];
        c.all_to_all(&x, &mut a2a);
        c.barrier();
        c.send(&x, 0, 3);
        let mut rv = vec![0.0; 37];
        c.recv(&mut rv, 0, 3);
        let sub = c.split(&[0]);
        let mut s = x.clone();
        sub.all_reduce_sum(&mut s);
        for v in [&a, &rs, &ag, &bc, &a2a, &rv, &s] {
            assert_eq!(bits(v), bits(&x));
        }
        sub.size()
    });
    assert_eq!(out, vec![1]);
}

#[test]
fn many_ranks_on_few_cores_do_not_deadlock() {
    // 8 ranks on (typically) 2 cores: heavy oversubscription, mixed collectives and sub-groups.
    let mesh = DeviceMesh::new(&[(Axis::Pp, 2), (Axis::Dp, 2), (Axis::Tp, 2)], 8).unwrap();
    let iters = if cfg!(miri) { 10 } else { 150 };
    let out = run_ranks(8, |c| {
        let tp = mesh_group(c, &mesh, Axis::Tp);
        let pp = mesh_group(c, &mesh, Axis::Pp);
        let mut acc = 0.0f32;
        for it in 0..iters {
            let mut b = vec![1.0f32; 1 + it % 9];
            c.all_reduce_sum(&mut b);
            tp.all_reduce_sum(&mut b);
            let mut g = vec![0.0; 2 * b.len()];
            pp.all_gather(&b, &mut g);
            acc += g.iter().sum::<f32>();
            if it % 10 == 0 {
                tp.barrier();
            }
        }
        acc
    });
    let want: f32 = (0..iters).map(|it| (1 + it % 9) as f32 * 16.0 * 2.0).sum();
    assert!(out.iter().all(|&a| a == want), "{out:?} vs {want}");
}

#[test]
fn a_skipped_collective_is_named_by_sequence_number_and_call_sites() {
    // Rank 1 skips the first of two all-reduces: its barrier meets rank 0's all-reduce, and the
    // error names both calls, their sequence number and each rank's call site.
    let msgs = run_ranks(2, |c| {
        let e = catch_unwind(AssertUnwindSafe(|| {
            let mut b = vec![1.0; 8];
            if c.rank() == 0 {
                c.all_reduce_sum(&mut b);
            }
            c.barrier();
            c.all_reduce_sum(&mut b);
        }))
        .expect_err("rank 1 skipped one");
        panic_text(&*e)
    });
    for m in &msgs {
        assert!(m.contains("collective mismatch on group 0 (world ranks [0, 1]) at sequence number 0"), "{m}");
        assert!(m.contains("rank 0 called #0 all_reduce_sum(f32 × 8) at crates/parallel/tests/it/comm.rs:"), "{m}");
        assert!(m.contains("rank 1 called #0 barrier(f32 × 0) at crates/parallel/tests/it/comm.rs:"), "{m}");
    }
}

#[test]
fn counters_follow_the_ring_volumes() {
    let n = 4;
    let len = 1 << 16;
    let totals = run_ranks(n, |c| {
        let mut g = vec![1.0f32; len];
        c.all_reduce_sum(&mut g);
        let mut shard = vec![0.0f32; len / n];
        c.reduce_scatter_sum(&g, &mut shard);
        c.all_gather(&shard.clone(), &mut g);
        c.counters().snapshot()
    });
    let bytes = (len * 4) as u64;
    for t in &totals {
        let (calls, sent, recv) = t.get(parallel::Op::AllReduce);
        assert_eq!((calls, sent, recv), (1, 2 * 3 * bytes / 4, 2 * 3 * bytes / 4));
        assert_eq!(t.get(parallel::Op::ReduceScatter), (1, 3 * bytes / 4, 3 * bytes / 4));
        assert_eq!(t.get(parallel::Op::AllGather), (1, 3 * bytes / 4, 3 * bytes / 4));
        assert_eq!(t.bytes_sent(), 4 * 3 * bytes / 4);
    }
}
