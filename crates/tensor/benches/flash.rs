//! Forward + backward time of the FlashAttention-2 kernel against the materialised reference,
//! GPT-2-small heads (NH = 12, HS = 64). Prints one JSON object per line.
//!
//! `cargo bench -p tensor --bench flash` (threads: `RAYON_NUM_THREADS`, default 2; tile sweep:
//! `FLASH_TILES=32x32,64x64,128x64`; shapes: `FLASH_SHAPES=4x256,1x1024,1x2048`; dropout:
//! `FLASH_DROPOUT=0.1`).

use std::time::Instant;
use tensor::attention::AttnDims;
use tensor::flash::*;
use tensor::*;

fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t0 = Instant::now();
        f();
        best = best.min(t0.elapsed().as_secs_f64());
    }
    best
}

fn parse_pairs(s: &str) -> Vec<(usize, usize)> {
    s.split(',')
        .map(|p| {
            let (a, b) = p.split_once('x').expect("AxB");
            (a.trim().parse().unwrap(), b.trim().parse().unwrap())
        })
        .collect()
}

fn main() {
    let threads: usize = std::env::var("RAYON_NUM_THREADS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().unwrap();
    let shapes = parse_pairs(&std::env::var("FLASH_SHAPES").unwrap_or("4x256,1x1024,1x2048".into()));
    let tiles = parse_pairs(&std::env::var("FLASH_TILES").unwrap_or(format!("{TILE_Q}x{TILE_K}")));
    let p: f32 = std::env::var("FLASH_DROPOUT").ok().and_then(|s| s.parse().ok()).unwrap_or(0.0);
    let skip_ref = std::env::var("FLASH_NO_REF").is_ok();
    let (nh, hs) = (12, 64);
    let c = nh * hs;
    for &(b, t) in &shapes {
        let d = AttnDims { b, t, c, nh };
        let mut rng = Rng::new(1);
        let mut qkv = vec![0.0; b * t * 3 * c];
        rng.fill_normal(&mut qkv, 1.0);
        let mut dout = vec![0.0; b * t * c];
        rng.fill_normal(&mut dout, 1.0);
        let reps = if t >= 2048 { 3 } else { 5 };
        let mut out = vec![0.0; b * t * c];
        let mut dqkv = vec![0.0; qkv.len()];
        let (ref_f, ref_b) = if skip_ref {
            (f64::NAN, f64::NAN)
        } else {
            let mut att = vec![0.0; b * nh * t * t];
            let f = best_of(reps, || attention_forward(&mut out, &mut att, &qkv, &d, p, 3));
            let bw = best_of(reps, || attention_backward(&mut dqkv, &dout, &qkv, &att, &d, p, 3));
            (f, bw)
        };
        for &(br, bc) in &tiles {
            let tl = Tiles { br, bc };
            let mut lse = vec![0.0; b * nh * t];
            let f = best_of(reps, || flash_attention_forward_tiled(&mut out, &mut lse, &qkv, &d, p, 3, tl));
            let mut bws = Vec::new();
            for sched in [Schedule::Auto, Schedule::TwoPass] {
                bws.push(best_of(reps, || {
                    flash_attention_backward_with(&mut dqkv, &dout, &qkv, &out, &lse, &d, p, 3, tl, sched)
                }));
            }
            let (fl, rf) = (f + bws[0], ref_f + ref_b);
            // Peak extra memory: reference keeps att [B,NH,T,T] and, per task in backward, a
            // [T,T] dS (plus a [T,T] dropped copy with dropout); flash keeps lse, D [B,NH,T]
            // and a few [br,bc] tiles per task.
            let ref_bytes = 4 * (b * nh * t * t + threads * t * t * if p > 0.0 { 2 } else { 1 });
            let fl_task = 4 * (3 * br * bc + br * hs + 3 * br + bc);
            let fl_bytes = 4 * 2 * b * nh * t + threads * fl_task;
            println!(
                "{{\"B\":{b},\"T\":{t},\"NH\":{nh},\"HS\":{hs},\"threads\":{threads},\"dropout\":{p},\"tiles\":\"{br}x{bc}\",\
                \"ref_fwd_ms\":{:.2},\"ref_bwd_ms\":{:.2},\"flash_fwd_ms\":{:.2},\"flash_bwd_ms\":{:.2},\"flash_bwd_twopass_ms\":{:.2},\
                \"ref_total_ms\":{:.2},\"flash_total_ms\":{:.2},\"speedup\":{:.2},\"ref_extra_bytes\":{ref_bytes},\"flash_extra_bytes\":{fl_bytes},\"flash_task_scratch_bytes\":{fl_task}}}",
                ref_f * 1e3, ref_b * 1e3, f * 1e3, bws[0] * 1e3, bws[1] * 1e3, rf * 1e3, fl * 1e3, rf / fl
            );
        }
    }
}
