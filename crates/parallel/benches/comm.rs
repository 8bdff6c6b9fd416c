//! The in-process communicator's `all_reduce_sum`: bandwidth on 16M floats (best of 5 after a
//! warm-up, the slowest rank's) and latency on one float (2000 calls), on 2 and 4 ranks. Prints
//! one JSON object per line.
//!
//! `cargo bench -p parallel --bench comm`

use parallel::{run_ranks, Comm};
use std::time::Instant;

fn main() {
    let len = 16 << 20;
    for n in [2usize, 4] {
        let times = run_ranks(n, |c| {
            let mut b = vec![c.rank() as f32; len];
            c.all_reduce_sum(&mut b); // warm-up (page faults)
            let mut ts = Vec::new();
            for _ in 0..5 {
                c.barrier();
                let t0 = Instant::now();
                c.all_reduce_sum(&mut b);
                ts.push(t0.elapsed().as_secs_f64());
            }
            ts
        });
        let best = times.iter().map(|t| t.iter().cloned().fold(f64::MAX, f64::min)).fold(0.0, f64::max);
        let gbs = (len * 4) as f64 / best / 1e9;
        println!("{{\"bench\":\"all_reduce_sum\",\"ranks\":{n},\"floats\":{len},\"best_ms\":{:.2},\"payload_GB_per_s\":{gbs:.2}}}", best * 1e3);
    }
    for n in [2usize, 4] {
        let iters = 2000;
        let t = run_ranks(n, |c| {
            let mut b = [1.0f32];
            c.barrier();
            let t0 = Instant::now();
            for _ in 0..iters {
                c.all_reduce_sum(&mut b);
            }
            t0.elapsed().as_secs_f64()
        });
        let us = t.iter().cloned().fold(0.0, f64::max) / iters as f64 * 1e6;
        println!("{{\"bench\":\"all_reduce_sum_latency\",\"ranks\":{n},\"floats\":1,\"us_per_call\":{us:.1}}}");
    }
}
