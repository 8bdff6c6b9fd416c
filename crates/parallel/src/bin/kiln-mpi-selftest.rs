//! Self-test of the MPI backend: `mpirun -n N kiln-mpi-selftest [MODE]`.
//!
//! Modes:
//! - `check` (default): every collective at several sizes (tiny, not divisible by N, around and
//!   above the 4096-element all-reduce switch), sub-groups from `split` (even/odd ranks, a
//!   reversed list, a split of a split), send/recv ordering per tag, and the byte counters;
//!   results are compared bit for bit against the rank-order left fold computed locally and
//!   against the in-process backend run inside this process. Exits 0 on success.
//! - `mismatch`: after three good collectives, rank 1 calls `all_gather` where the others call
//!   `all_reduce_sum`. Every rank prints the caught panic and exits with [`PLANTED`].
//! - `timeout`: after three good collectives, rank 1 skips an `all_reduce_sum` and sleeps; the
//!   others time out (set `KILN_COMM_TIMEOUT_S=2`), print the caught panic, exit [`PLANTED`].
//! - `badsplit`: after three good collectives, rank 0 asks `split` for `[0, 1]` while rank 1
//!   asks for `[1]`; every rank prints the caught panic and exits with [`PLANTED`].
//! - `die`: after three good collectives, rank 1 panics (exit code 101) while the others wait in
//!   `all_reduce_sum`; mpirun ends the job.
//! - `abort`: as `die`, but rank 1 calls `std::process::abort()` (SIGABRT).
//! - `bench`: all-reduce timings (16M floats and 1024 floats).

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use parallel::mpi::{init, MpiComm};
use parallel::{run_ranks, Comm, CommTotals, Op};

/// Exit code of a rank that caught the planted failure.
const PLANTED: i32 = 17;

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
            u * [1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3][(h % 7) as usize]
        })
        .collect()
}

/// Sequential left fold in rank order.
fn seq_sum(parts: &[Vec<f32>]) -> Vec<f32> {
    let mut acc = parts[0].clone();
    for p in &parts[1..] {
        for (a, x) in acc.iter_mut().zip(p) {
            *a += *x;
        }
    }
    acc
}

fn same_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: element {i} is {} ({:#x}), expected {} ({:#x})", got[i], got[i].to_bits(), want[i], want[i].to_bits());
    }
}

/// Runs `f` and checks the counters moved by exactly one call of `op` with these bytes.
fn counted<T>(c: &dyn Comm, what: &str, op: Op, sent: u64, recv: u64, f: impl FnOnce() -> T) -> T {
    let before = c.counters().snapshot();
    let r = f();
    let d = c.counters().snapshot().since(&before);
    let mut want = CommTotals::default();
    want.0[op as usize] = (1, sent, recv);
    assert_eq!(d, want, "{what}: counters");
    r
}

/// The collectives of one group. `members[r]` is the world rank of group rank `r`: the data of
/// group rank `r` is `data(seed, members[r], ..)`.
fn check_group(c: &dyn Comm, members: &[usize], seed: u64, sizes: &[usize]) -> usize {
    let n = c.size();
    let me = c.rank();
    assert_eq!(members.len(), n);
    let mut calls = 0;
    for &len in sizes {
        let s = seed ^ mix64(len as u64);
        // all_reduce_sum
        let parts: Vec<Vec<f32>> = members.iter().map(|&w| data(s, w, len)).collect();
        let want = seq_sum(&parts);
        let mut buf = parts[me].clone();
        let b = if n == 1 {
            0
        } else if len <= 4096 {
            ((n - 1) * len * 4) as u64
        } else {
            let (lo, hi) = parallel::comm::chunk_bounds(len, n, me);
            ((len - (hi - lo)) * 2 * 4) as u64
        };
        counted(c, "all_reduce_sum", Op::AllReduce, b, b, || c.all_reduce_sum(&mut buf));
        same_bits(&format!("all_reduce_sum len {len} n {n}"), &buf, &want);
        // reduce_scatter_sum: chunk `len` per rank.
        let parts: Vec<Vec<f32>> = members.iter().map(|&w| data(s ^ 1, w, n * len)).collect();
        let full = seq_sum(&parts);
        let mut out = vec![0f32; len];
        let b = ((n - 1) * len * 4) as u64;
        counted(c, "reduce_scatter_sum", Op::ReduceScatter, b, b, || c.reduce_scatter_sum(&parts[me], &mut out));
        same_bits(&format!("reduce_scatter_sum len {len}"), &out, &full[me * len..(me + 1) * len]);
        // all_gather
        let mut out = vec![0f32; n * len];
        counted(c, "all_gather", Op::AllGather, b, b, || c.all_gather(&data(s ^ 2, members[me], len), &mut out));
        let want: Vec<f32> = members.iter().flat_map(|&w| data(s ^ 2, w, len)).collect();
        same_bits(&format!("all_gather len {len}"), &out, &want);
        // broadcast from every root
        for root in 0..n {
            let mut buf = data(s ^ 3 ^ root as u64, members[me], len);
            let (sent, recv) = if me == root { ((n as u64 - 1) * len as u64 * 4, 0) } else { (0, len as u64 * 4) };
            counted(c, "broadcast", Op::Broadcast, sent, recv, || c.broadcast(&mut buf, root));
            same_bits(&format!("broadcast len {len} root {root}"), &buf, &data(s ^ 3 ^ root as u64, members[root], len));
            calls += 1;
        }
        // all_to_all: chunk `len` per rank.
        let input = data(s ^ 4, members[me], n * len);
        let mut out = vec![0f32; n * len];
        counted(c, "all_to_all", Op::AllToAll, b, b, || c.all_to_all(&input, &mut out));
        let want: Vec<f32> = members.iter().flat_map(|&w| data(s ^ 4, w, n * len)[me * len..(me + 1) * len].to_vec()).collect();
        same_bits(&format!("all_to_all len {len}"), &out, &want);
        counted(c, "barrier", Op::Barrier, 0, 0, || c.barrier());
        calls += 5;
    }
    // send/recv around the ring: per tag in order, tags independent (received out of order).
    if n > 1 {
        let to = (me + 1) % n;
        let from = (me + n - 1) % n;
        for (k, &len) in [3usize, 0, 5000].iter().enumerate() {
            counted(c, "send", Op::SendRecv, len as u64 * 4, 0, || c.send(&data(seed ^ 50 ^ k as u64, members[me], len), to, 5));
        }
        c.send(&data(seed ^ 60, members[me], 7), to, 9);
        let mut m = vec![0f32; 7];
        counted(c, "recv", Op::SendRecv, 0, 28, || c.recv(&mut m, from, 9));
        same_bits("recv tag 9", &m, &data(seed ^ 60, members[from], 7));
        for (k, &len) in [3usize, 0, 5000].iter().enumerate() {
            let mut m = vec![0f32; len];
            c.recv(&mut m, from, 5);
            same_bits(&format!("recv tag 5 #{k}"), &m, &data(seed ^ 50 ^ k as u64, members[from], len));
        }
        c.barrier();
        calls += 1;
    }
    calls
}

fn check(world: &MpiComm) {
    let n = world.size();
    let me = world.rank();
    let sizes = [0usize, 1, 3, 7, 5 * n + 1, 4095, 4096, 4097, 10007, 65539];
    let all: Vec<usize> = (0..n).collect();
    let mut calls = check_group(world, &all, 1, &sizes);

    // Bit-identical to the in-process backend (results and counters), run inside this process.
    for &len in &[5usize, 4096, 4097, 100_003] {
        let reference = run_ranks(n, |c| {
            let mut buf = data(7, c.rank(), len);
            c.all_reduce_sum(&mut buf);
            (buf, c.counters().snapshot())
        });
        let mut buf = data(7, me, len);
        let before = world.counters().snapshot();
        world.all_reduce_sum(&mut buf);
        same_bits(&format!("all_reduce_sum vs in-process len {len}"), &buf, &reference[me].0);
        assert_eq!(world.counters().snapshot().since(&before), reference[me].1, "counters vs in-process, len {len}");
        calls += 1;
    }

    // Even/odd sub-groups; counters are shared with the world communicator.
    let parity: Vec<usize> = (0..n).filter(|r| r % 2 == me % 2).collect();
    let sub = world.split(&parity);
    assert_eq!(sub.size(), parity.len());
    assert_eq!(sub.rank(), parity.iter().position(|&r| r == me).unwrap());
    let before = world.counters().snapshot();
    calls += check_group(&*sub, &parity, 2, &[1, 3, 4097, 9001]);
    assert!(world.counters().snapshot().since(&before).bytes_sent() > 0 || sub.size() == 1, "sub-group traffic missing from the shared counters");

    // A reversed list: the new rank order is the list order.
    let rev: Vec<usize> = parity.iter().rev().copied().collect();
    let sub_rev = world.split(&rev);
    assert_eq!(sub_rev.rank(), rev.iter().position(|&r| r == me).unwrap(), "split rank order");
    calls += check_group(&*sub_rev, &rev, 3, &[2, 4099]);

    // A split of a split: halves of the parity group (in sub-group ranks).
    let m = sub.size();
    let half: Vec<usize> = if sub.rank() < m.div_ceil(2) { (0..m.div_ceil(2)).collect() } else { (m.div_ceil(2)..m).collect() };
    let subsub = sub.split(&half);
    let members: Vec<usize> = half.iter().map(|&r| parity[r]).collect();
    calls += check_group(&*subsub, &members, 4, &[6, 5001]);

    // Interleaved use of the world and a sub-group.
    world.barrier();
    drop(subsub);
    drop(sub_rev);
    drop(sub);
    world.barrier();
    println!("kiln-mpi-selftest: rank {me} of {n}: all checks passed ({calls} collective calls)");
}

fn panic_text(e: Box<dyn std::any::Any + Send>) -> String {
    match e.downcast::<String>() {
        Ok(s) => *s,
        Err(e) => e.downcast::<&str>().map(|s| s.to_string()).unwrap_or_else(|_| "<non-string panic>".into()),
    }
}

/// Three good collectives, then the planted failure `f`; prints what was caught and exits.
fn planted(world: &MpiComm, f: impl FnOnce(&MpiComm)) -> ! {
    let me = world.rank();
    let mut x = vec![1f32; 8];
    world.barrier();
    world.all_reduce_sum(&mut x);
    world.broadcast(&mut x, 0);
    // The caught message is printed below; skip the default hook's copy and backtrace.
    std::panic::set_hook(Box::new(|_| {}));
    let r = catch_unwind(AssertUnwindSafe(|| f(world)));
    match r {
        Err(e) => {
            println!("kiln-mpi-selftest: rank {me} caught: {}", panic_text(e));
            let _ = std::io::stdout().flush();
            // mpirun aborts the job when the first rank exits non-zero: give the other ranks,
            // which catch the same failure within milliseconds, time to print theirs.
            std::thread::sleep(std::time::Duration::from_millis(1500));
            std::process::exit(PLANTED);
        }
        Ok(()) => {
            println!("kiln-mpi-selftest: rank {me}: planted failure did not panic");
            let _ = std::io::stdout().flush();
            std::process::exit(1);
        }
    }
}

fn bench(world: &MpiComm) {
    let me = world.rank();
    for &(len, iters) in &[(16usize << 20, 5usize), (1024, 2000)] {
        let mut buf = data(9, me, len);
        world.all_reduce_sum(&mut buf);
        world.barrier();
        let t = Instant::now();
        for _ in 0..iters {
            world.all_reduce_sum(&mut buf);
        }
        world.barrier();
        let dt = t.elapsed().as_secs_f64() / iters as f64;
        // For comparison: the MPI library's own all-reduce (unspecified summation order).
        let raw = mpi::topology::SimpleCommunicator::world();
        let mut out = vec![0f32; len];
        let native = {
            use mpi::collective::{CommunicatorCollectives, SystemOperation};
            raw.all_reduce_into(&buf[..], &mut out[..], SystemOperation::sum());
            world.barrier();
            let t = Instant::now();
            for _ in 0..iters {
                raw.all_reduce_into(&buf[..], &mut out[..], SystemOperation::sum());
            }
            world.barrier();
            t.elapsed().as_secs_f64() / iters as f64
        };
        if me == 0 {
            println!(
                "kiln-mpi-selftest: all_reduce_sum of {len} f32 on {} ranks: {:.3} ms ({:.2} GB/s of buffer); MPI_Allreduce: {:.3} ms",
                world.size(),
                dt * 1e3,
                (len * 4) as f64 / dt / 1e9,
                native * 1e3
            );
        }
    }
}

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "check".into());
    let mpi = match init() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("kiln-mpi-selftest: {e}");
            std::process::exit(2);
        }
    };
    // The trainer runs the communicator on its own thread: so does this test.
    let world = mpi.world();
    if world.rank() == 0 {
        println!("kiln-mpi-selftest: {} ranks, MPI thread level {:?}, timeout {:?}, mode {mode}", world.size(), mpi.threading(), world.timeout());
    }
    let world = std::thread::spawn(move || {
        match mode.as_str() {
            "check" => check(&world),
            "bench" => bench(&world),
            "mismatch" => planted(&world, |c| {
                let x = vec![2f32; 8];
                if c.rank() == 1 {
                    let mut out = vec![0f32; 8 * c.size()];
                    c.all_gather(&x, &mut out);
                } else {
                    let mut y = x.clone();
                    c.all_reduce_sum(&mut y);
                }
            }),
            "timeout" => planted(&world, |c| {
                if c.rank() == 1 {
                    std::thread::sleep(c.timeout() + Duration::from_secs(20));
                } else {
                    let mut y = vec![2f32; 8];
                    c.all_reduce_sum(&mut y);
                }
            }),
            "badsplit" => planted(&world, |c| {
                let ranks = if c.rank() == 0 { vec![0, 1] } else { vec![c.rank()] };
                let _ = c.split(&ranks);
            }),
            "abort" | "die" => {
                let mut x = vec![1f32; 8];
                world.barrier();
                world.all_reduce_sum(&mut x);
                world.broadcast(&mut x, 0);
                if world.rank() == 1 {
                    if mode == "abort" {
                        eprintln!("kiln-mpi-selftest: rank 1 aborts on purpose");
                        std::process::abort();
                    }
                    panic!("kiln-mpi-selftest: rank 1 dies on purpose");
                }
                world.all_reduce_sum(&mut x);
                println!("kiln-mpi-selftest: rank {}: all_reduce_sum returned although rank 1 died", world.rank());
            }
            m => {
                eprintln!("kiln-mpi-selftest: unknown mode {m:?} (check, bench, mismatch, timeout, badsplit, die, abort)");
                std::process::exit(2);
            }
        }
        world
    })
    .join()
    .unwrap_or_else(|_| std::process::exit(101));
    drop(world);
    drop(mpi);
}
