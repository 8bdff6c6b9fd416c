//! Activation recomputation's cost: step time of forward + backward under each
//! `Recompute` policy on shakespeare-char's shape (4 layers, 4 heads, 128 channels, B 12, T 64;
//! median of 20 steps after 5 warm-up), and GPT-2 124M's activation bytes at B 4, T 256 under
//! each policy. Prints one JSON object per line.
//!
//! `cargo bench -p model --bench recompute` (threads: `RAYON_NUM_THREADS`, rayon's default all
//! cores).

use model::gpt::Recompute;
use model::{Gpt, GptConfig, Pass};
use std::time::Instant;

const POLICIES: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

fn main() {
    let cfg = GptConfig::gpt2((4, 4, 128), 64, 65, false, 0.0, true);
    let (b, t) = (12, 64);
    let tokens: Vec<u32> = (0..b * t).map(|i| ((i * 31 + 7) % 65) as u32).collect();
    let targets: Vec<i32> = (0..b * t).map(|i| ((i * 17 + 3) % 65) as i32).collect();
    let mut times = Vec::new();
    for policy in POLICIES {
        let mut m = Gpt::new(cfg.clone(), 65, 1);
        m.recompute = policy;
        let mut ts = Vec::new();
        for i in 0..25 {
            let t0 = Instant::now();
            m.forward(&tokens, &targets, b, t, Pass::Train { dropout_seed: i, loss_scale: 1.0 });
            m.backward();
            ts.push(t0.elapsed().as_secs_f64());
        }
        ts.drain(..5);
        ts.sort_by(|x, y| x.partial_cmp(y).unwrap());
        times.push((ts[ts.len() / 2], m.activation_bytes()));
    }
    for (policy, (s, bytes)) in POLICIES.iter().zip(&times) {
        println!(
            "{{\"bench\":\"recompute_step\",\"model\":\"shakespeare-char\",\"b\":{b},\"t\":{t},\"policy\":\"{policy:?}\",\"step_ms\":{:.3},\"overhead\":{:.3},\"act_bytes\":{bytes}}}",
            s * 1e3,
            s / times[0].0 - 1.0
        );
    }
    let mut m = Gpt::zeroed(GptConfig::gpt2_124m(), 50257);
    let mut none = 0;
    for policy in POLICIES {
        m.recompute = policy;
        m.reserve_activations(4, 256);
        let bytes = m.activation_bytes();
        none = none.max(bytes);
        println!(
            "{{\"bench\":\"recompute_act_bytes\",\"model\":\"gpt2-124m\",\"b\":4,\"t\":256,\"policy\":\"{policy:?}\",\"act_bytes\":{bytes},\"of_none\":{:.4}}}",
            bytes as f64 / none as f64
        );
    }
}
