//! The figures a training step reports in its `metrics.jsonl` line beyond loss and speed:
//! mixture-of-experts routing, communication, and memory (see docs/metrics.md).

use crate::step::{Chunk, Moments, StepOut};


/// MoE routing figures of the last micro-batch, summed or worst over layers: the router
/// losses, the dropped-token fraction, max/mean tokens per expert, and per-expert load.
pub(super) fn add_moe_stats(line: &mut serde_json::Value, stats: &[tensor::moe::MoeStats]) {
    if stats.is_empty() {
        return;
    }
    let aux: f32 = stats.iter().map(|s| s.aux_loss).sum::<f32>() / stats.len() as f32;
    let z: f32 = stats.iter().map(|s| s.z_loss).sum::<f32>() / stats.len() as f32;
    let dropped: f32 = stats.iter().map(|s| s.dropped_fraction).sum::<f32>() / stats.len() as f32;
    let imbalance = stats.iter().map(|s| s.max_load as f32 / s.mean_load.max(1e-9)).fold(0.0f32, f32::max);
    let e = stats[0].counts.len();
    let load: Vec<usize> = (0..e).map(|i| stats.iter().map(|s| s.counts[i]).sum()).collect();
    line["moe_aux_loss"] = aux.into();
    line["moe_z_loss"] = z.into();
    line["moe_dropped_fraction"] = dropped.into();
    line["moe_max_over_mean_load"] = imbalance.into();
    line["moe_expert_load"] = load.into();
    let (sent, received): (usize, usize) = (stats.iter().map(|s| s.ep_rows_sent).sum(), stats.iter().map(|s| s.ep_rows_received).sum());
    if sent + received > 0 {
        // Expert parallelism: rows this rank sent to other ranks' experts and received for its
        // own, over the layers (see `tensor::moe::MoeStats`).
        line["moe_ep_rows_sent"] = sent.into();
        line["moe_ep_rows_received"] = received.into();
    }
}

/// The communication of a step on `world > 1` ranks: bytes sent and received, per collective as
/// the communicator counts them, and how much of it overlapped compute.
pub(super) fn add_comm(line: &mut serde_json::Value, bytes: &parallel::CommTotals, out: &StepOut) {
    line["comm_bytes_sent"] = bytes.bytes_sent().into();
    line["comm_bytes_recv"] = bytes.bytes_recv().into();
    for op in parallel::OPS {
        let (calls, sent, _) = bytes.get(op);
        if calls > 0 {
            line[format!("comm_bytes_sent_{}", op.name())] = sent.into();
            line[format!("comm_calls_{}", op.name())] = calls.into();
        }
    }
    line["comm_s"] = out.overlap.comm.as_secs_f64().into();
    line["comm_exposed_s"] = out.overlap.exposed.as_secs_f64().into();
    line["comm_hidden_fraction"] = out.overlap.hidden_fraction().into();
}

/// Context parallelism, from every cp rank's `[compute s, wait s, blocks, skipped, pairs]`:
/// each rank's attention kernel time and time blocked on the others (ring blocks not yet
/// arrived, Ulysses' all-to-alls), the slowest rank's attention time and work (visible score
/// pairs) over the mean (1 = balanced), the fraction of the ring exchange hidden behind
/// compute, and blocks computed and skipped.
pub(super) fn add_cp(line: &mut serde_json::Value, t: &[f64]) {
    let (compute, wait): (Vec<f64>, Vec<f64>) = t.chunks(5).map(|r| (r[0], r[1])).unzip();
    let pairs: Vec<f64> = t.chunks(5).map(|r| r[4]).collect();
    let max_over_mean = |x: &[f64]| {
        let mean = x.iter().sum::<f64>() / x.len() as f64;
        if mean > 0.0 { x.iter().copied().fold(0.0, f64::max) / mean } else { 1.0 }
    };
    line["cp_attention_s"] = compute.clone().into();
    line["cp_wait_s"] = wait.clone().into();
    line["cp_attention_max_over_mean"] = max_over_mean(&compute).into();
    line["cp_attention_pairs"] = pairs.clone().into();
    line["cp_pairs_max_over_mean"] = max_over_mean(&pairs).into();
    // Waiting is the exchange not hidden (and imbalance): the busy share of attention time.
    let (c, w): (f64, f64) = (compute.iter().sum(), wait.iter().sum());
    line["cp_compute_fraction"] = (if c + w > 0.0 { c / (c + w) } else { 1.0 }).into();
    line["cp_blocks"] = t.chunks(5).map(|r| r[2]).sum::<f64>().into();
    line["cp_blocks_skipped"] = t.chunks(5).map(|r| r[3]).sum::<f64>().into();
}

/// This rank's memory: model state by kind (parameters, gradients, optimizer moments, in
/// memory or offloaded), the process's peak resident set, the step's activations and
/// transients, and the tracking allocator's peaks per category.
pub(super) fn add_memory(line: &mut serde_json::Value, chunks: &[Chunk], out: &StepOut, pipelined: bool) {
    let (mut params_b, mut grads_b, mut transient_b, mut optim) = (0, 0, 0, 0);
    for ch in chunks {
        let sb = ch.dp.state_bytes();
        let lora = ch.model.lora.as_ref().map_or(0, |lo| lo.params.len() * 4);
        (params_b, grads_b, transient_b) = (params_b + sb.params + lora, grads_b + sb.grads + lora, transient_b + sb.peak_transient);
        optim += ch.opt.state_bytes();
    }
    line["mem_params_bytes"] = params_b.into();
    line["mem_grads_bytes"] = grads_b.into();
    let offloaded = matches!(chunks[0].opt.m, Moments::File { .. });
    line["mem_optim_bytes"] = (if offloaded { 0 } else { optim }).into();
    if offloaded {
        line["mem_optim_offloaded_bytes"] = optim.into();
    }
    if let Some(hwm) = crate::util::peak_rss() {
        line["mem_rss_peak_bytes"] = hwm.into();
    }
    line["mem_activations_bytes"] = out.peak_activation_bytes.into();
    if pipelined {
        line["pp_peak_in_flight"] = out.peak_in_flight.into();
    }
    line["mem_transient_peak_bytes"] = transient_b.into();
    crate::memory::track::log_peaks(line);
}

/// A preference objective's figures, each a mean over the pairs (TRL's `rewards/*` and
/// `logps/*`), under `prefix` (`""` for a training step, `"val_"` for the held-out pairs).
pub(super) fn add_pairs(line: &mut serde_json::Value, st: &model::pairs::PairStats, prefix: &str) {
    let n = st.pairs.max(1.0);
    let figures = [
        ("rewards_chosen", st.reward_chosen),
        ("rewards_rejected", st.reward_rejected),
        ("rewards_margin", st.reward_chosen - st.reward_rejected),
        ("rewards_accuracy", st.correct),
        ("preference_accuracy", st.prefers),
        ("logps_chosen", st.logps_chosen),
        ("logps_rejected", st.logps_rejected),
    ];
    for (k, v) in figures {
        line[format!("{prefix}{k}")] = (v / n).into();
    }
    line[format!("{prefix}pairs")] = st.pairs.into();
}

/// GRPO's figures: the batch's rewards, completion lengths and sampling speed (`rollout`), and
/// over its completion tokens the mean KL to the reference and the fractions clipped.
pub(super) fn add_policy(line: &mut serde_json::Value, st: &model::policy::PolicyStats, rollout: &serde_json::Map<String, serde_json::Value>) {
    for (k, v) in rollout {
        line[k.as_str()] = v.clone();
    }
    let n = st.tokens.max(1.0);
    line["kl"] = (st.kl / n).into();
    line["clip_fraction_low"] = (st.clipped_low / n).into();
    line["clip_fraction_high"] = (st.clipped_high / n).into();
    line["clip_fraction"] = ((st.clipped_low + st.clipped_high) / n).into();
}
