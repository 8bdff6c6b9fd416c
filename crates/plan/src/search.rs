//! Strategy search: enumerate layouts (respecting whatever the user fixed), drop those that do not fit, rank the
//! rest by predicted step time. Exhaustive over a small, structured space (the Alpa/Galvatron idea with the cost
//! model above as the oracle; no ILP needed at this size).

use std::collections::HashMap;

use serde::Serialize;

use crate::cost::{check_layout, estimate, memory, Attention, Estimate, Layout, Recompute};
use crate::hardware::{Cluster, Precision};
use crate::models::ModelShape;
use crate::schedule::Kind;
use crate::PlanError;

/// Values the user fixed; `None` means "choose the best feasible".
#[derive(Clone, Debug, Default, Serialize)]
pub struct Constraints {
    pub tp: Option<u64>,
    pub pp: Option<u64>,
    pub dp: Option<u64>,
    pub cp: Option<u64>,
    pub cp_mode: Option<crate::policy::CpMode>,
    pub ep: Option<u64>,
    pub micro_batch: Option<u64>,
    pub schedule: Option<Kind>,
    pub virtual_stages: Option<u64>,
    pub recompute: Option<Recompute>,
    pub sequence_parallel: Option<bool>,
    pub zero: Option<u8>,
    pub precision: Option<Precision>,
    pub attention: Option<Attention>,
    /// Overlap DP gradient reduction with backward (default true).
    pub overlap_dp: Option<bool>,
    /// Overlap TP backward / interleaved p2p communication (default true).
    pub overlap_comm: Option<bool>,
    /// fp32 gradients (default true).
    pub fp32_grads: Option<bool>,
    /// The optimizer and AdamW's state form (default AdamW, fp32).
    pub optimizer: Option<crate::policy::OptimName>,
    pub optim_state: Option<crate::policy::StateForm>,
    /// Data-parallel compression (default none) and PowerSGD's rank (default 4).
    pub compression: Option<crate::policy::Compression>,
    pub powersgd_rank: Option<u64>,
    /// ZeRO++ on ZeRO-3 (default off).
    pub zeropp: Option<bool>,
    /// Interleaved chunks of unequal layer counts when stages × virtual stages do not divide the layers (the
    /// setup's `uneven_pipeline`; default false: Megatron-LM before Megatron-Core needs pv | L).
    pub uneven_pipeline: Option<bool>,
    /// DeepSpeed's pipeline engine's blocking full-activation p2p (the setup's; default false).
    pub pp_blocking_p2p: Option<bool>,
}

#[derive(Clone, Debug, Serialize)]
pub struct SearchResult {
    /// The best plan of each mesh (tp, pp, dp, cp, ep), fitting ones only, fastest first.
    pub plans: Vec<Estimate>,
    /// Layouts evaluated, and how many of them did not fit in memory.
    pub evaluated: usize,
    pub pruned_unfit: usize,
    /// When nothing fits: the plan needing the least memory, for the error message.
    pub smallest_unfit: Option<Estimate>,
}

fn divisors(n: u64) -> Vec<u64> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

fn pick(fixed: Option<u64>, all: Vec<u64>) -> Vec<u64> {
    match fixed {
        Some(v) => vec![v],
        None => all,
    }
}

/// Check fixed values one by one so the error names the flag.
fn check_fixed(m: &ModelShape, cl: &Cluster, c: &Constraints) -> Result<(), PlanError> {
    let n = cl.gpus;
    for (flag, v) in [
        ("--tp", c.tp),
        ("--pp", c.pp),
        ("--dp", c.dp),
        ("--cp", c.cp),
        ("--ep", c.ep),
        ("--micro-batch", c.micro_batch),
    ] {
        if v == Some(0) {
            return Err(PlanError(format!("{flag}: must be at least 1")));
        }
    }
    if let Some(tp) = c.tp {
        if !m.heads.is_multiple_of(tp) {
            return Err(PlanError(format!("--tp {tp} does not divide heads {}", m.heads)));
        }
        if !m.kv_heads.is_multiple_of(tp) {
            return Err(PlanError(format!("--tp {tp} does not divide kv_heads {}", m.kv_heads)));
        }
    }
    if let Some(pp) = c.pp {
        // Uneven splits are allowed when asked for (Megatron-DeepSpeed); the search itself only proposes even ones.
        if pp > m.layers {
            return Err(PlanError(format!("--pp {pp} exceeds layers {}", m.layers)));
        }
    }
    if let (Some(v), pp) = (c.virtual_stages.filter(|&v| v > 1), c.pp.unwrap_or(1)) {
        // Interleaving gives every pipeline rank v chunks of equal layers.
        if pp < 2 {
            return Err(PlanError(format!("--virtual-stages {v} needs --pp > 1 (interleaved pipeline chunks)")));
        }
        if pp * v > m.layers {
            return Err(PlanError(format!("--pp {pp} x --virtual-stages {v} = {} chunks but the model has only {} layers", pp * v, m.layers)));
        }
        if !m.layers.is_multiple_of(pp * v) && !c.uneven_pipeline.unwrap_or(false) {
            return Err(PlanError(format!("--pp {pp} x --virtual-stages {v} = {} chunks do not divide the model's {} layers (chunks of unequal size need a setup with uneven pipeline stages, e.g. --setup megatron-2024)", pp * v, m.layers)));
        }
    }
    let given: Vec<(&str, u64)> = [("--tp", c.tp), ("--pp", c.pp), ("--dp", c.dp), ("--cp", c.cp)]
        .iter()
        .filter_map(|(f, v)| v.map(|v| (*f, v)))
        .collect();
    let prod: u64 = given.iter().map(|(_, v)| v).product();
    let all_given = given.len() == 4;
    if (all_given && prod != n) || !n.is_multiple_of(prod) {
        let desc: Vec<String> = given.iter().map(|(f, v)| format!("{f} {v}")).collect();
        let lhs = if given.len() == 1 {
            desc[0].clone()
        } else {
            format!("{} = {prod}", desc.join(" x "))
        };
        return Err(PlanError(format!(
            "{lhs} {} --gpus {n}",
            if all_given { "but" } else { "does not divide" }
        )));
    }
    if let (Some(e), false) = (c.ep, m.is_moe()) {
        if e > 1 {
            return Err(PlanError(format!(
                "--ep {e} given but model '{}' has no experts",
                m.name
            )));
        }
    }
    if let Some(p) = c.precision {
        cl.acc.peak(p)?;
    }
    Ok(())
}

/// The pipeline schedules (with their chunks per stage) a layout with `pp` stages may run.
fn schedules(m: &ModelShape, pp: u64, c: &Constraints) -> Vec<(Kind, u64)> {
    let mut scheds: Vec<(Kind, u64)> = Vec::new();
    if pp == 1 {
        scheds.push((Kind::OneFOneB, 1));
    } else {
        let per = m.layers / pp;
        let uneven = c.uneven_pipeline.unwrap_or(false);
        let want = |s: Kind| c.schedule.is_none_or(|x| x == s);
        if c.virtual_stages.is_none_or(|v| v == 1) {
            if want(Kind::Gpipe) {
                scheds.push((Kind::Gpipe, 1));
            }
            if want(Kind::OneFOneB) {
                scheds.push((Kind::OneFOneB, 1));
            }
        }
        if want(Kind::Interleaved) {
            // The search proposes 2..=8 chunks per stage; a fixed --virtual-stages is taken as given.
            let vs: Vec<u64> = if uneven { (2..=per).collect() } else { divisors(per) };
            for v in vs.into_iter().filter(|&v| (2..=8).contains(&v) || c.virtual_stages == Some(v)) {
                if c.virtual_stages.is_none_or(|x| x == v) {
                    scheds.push((Kind::Interleaved, v));
                }
            }
        }
    }
    scheds
}

/// What a layout of given degrees may take besides them.
struct Policies {
    recompute: Vec<Recompute>,
    sequence_parallel: Vec<bool>,
    zero: Vec<u8>,
    cp_mode: Vec<crate::policy::CpMode>,
}

/// The recompute policies, sequence parallelism, ZeRO stages and context-parallel modes a
/// layout with `tp`, `dp · cp` = `replicas` and `cp` may take.
fn policies(c: &Constraints, tp: u64, replicas: u64, cp: u64) -> Policies {
    let recs = match c.recompute {
        Some(r) => vec![r],
        None => vec![Recompute::None, Recompute::Selective, Recompute::Full],
    };
    let sps = match (c.sequence_parallel, tp) {
        (Some(s), _) => vec![s],
        (None, 1) => vec![false],
        (None, _) => vec![false, true],
    };
    let zeros = match c.zero {
        Some(z) => vec![z],
        None if replicas == 1 => vec![0],
        None => vec![0, 1, 2, 3],
    };
    let modes: Vec<crate::policy::CpMode> = match (c.cp_mode, cp) {
        (Some(x), _) => vec![x],
        (None, 1) => vec![crate::policy::CpMode::Ring],
        (None, _) => vec![crate::policy::CpMode::Ring, crate::policy::CpMode::Ulysses],
    };
    Policies { recompute: recs, sequence_parallel: sps, zero: zeros, cp_mode: modes }
}

/// All candidate layouts consistent with the constraints (not yet checked against memory).
pub fn candidates(m: &ModelShape, cl: &Cluster, global_batch: u64, seq: u64, c: &Constraints) -> Vec<Layout> {
    let n = cl.gpus;
    let mut out = Vec::new();
    let prec = c.precision.unwrap_or(if cl.acc.peak(Precision::Bf16).is_ok() {
        Precision::Bf16
    } else {
        Precision::Fp32
    });
    let attention = c.attention.unwrap_or(if cl.acc.flash_attention {
        Attention::Flash
    } else {
        Attention::Unfused
    });
    let tps = pick(
        c.tp,
        divisors(n)
            .into_iter()
            .filter(|&t| t <= 64 && m.heads.is_multiple_of(t) && m.kv_heads.is_multiple_of(t))
            .collect(),
    );
    for &tp in &tps {
        if !n.is_multiple_of(tp) {
            continue;
        }
        // Context parallelism only for long sequences: at least 2048 tokens per rank.
        let cps = pick(
            c.cp,
            divisors(n / tp)
                .into_iter()
                .filter(|&k| seq.is_multiple_of(k) && (k == 1 || seq / k >= 2048))
                .collect(),
        );
        for &cp in &cps {
            if !n.is_multiple_of(tp * cp) {
                continue;
            }
            let pps = pick(
                c.pp,
                divisors(n / (tp * cp))
                    .into_iter()
                    .filter(|&p| m.layers.is_multiple_of(p))
                    .collect(),
            );
            for &pp in &pps {
                if !n.is_multiple_of(tp * cp * pp) {
                    continue;
                }
                let dp = n / (tp * cp * pp);
                if c.dp.is_some_and(|d| d != dp) || !global_batch.is_multiple_of(dp) {
                    continue;
                }
                let eps = if m.is_moe() {
                    pick(
                        c.ep,
                        divisors(m.experts)
                            .into_iter()
                            .filter(|&e| (dp * cp).is_multiple_of(e))
                            .collect(),
                    )
                } else {
                    vec![c.ep.unwrap_or(1)]
                };
                let per_rank = global_batch / dp;
                let bs = pick(
                    c.micro_batch,
                    divisors(per_rank).into_iter().filter(|&b| b <= 16).collect(),
                );
                let scheds = schedules(m, pp, c);
                let Policies { recompute: recs, sequence_parallel: sps, zero: zeros, cp_mode: modes } = policies(c, tp, dp * cp, cp);
                for (&ep, &cp_mode) in eps.iter().flat_map(|e| modes.iter().map(move |m| (e, m))) {
                    for &b in &bs {
                        for &(schedule, v) in &scheds {
                            for &recompute in &recs {
                                for &sp in &sps {
                                    for &zero in &zeros {
                                        out.push(Layout {
                                            tp,
                                            pp,
                                            dp,
                                            cp,
                                            cp_mode,
                                            ep,
                                            micro_batch: b,
                                            global_batch,
                                            seq,
                                            schedule,
                                            virtual_stages: v,
                                            recompute,
                                            sequence_parallel: sp,
                                            zero,
                                            precision: prec,
                                            attention,
                                            overlap_dp: c.overlap_dp.unwrap_or(true),
                                            overlap_comm: c.overlap_comm.unwrap_or(true),
                                            fp32_grads: c.fp32_grads.unwrap_or(true),
                                            optimizer: c.optimizer.unwrap_or_default(),
                                            optim_state: c.optim_state.unwrap_or_default(),
                                            compression: c.compression.unwrap_or_default(),
                                            powersgd_rank: c.powersgd_rank.unwrap_or(4),
                                            zeropp: c.zeropp.unwrap_or(false),
                                            pp_blocking_p2p: c.pp_blocking_p2p.unwrap_or(false),
                                        });
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Search the best plans. Errors name the flag at fault when the fixed values admit no valid layout.
pub fn search(
    m: &ModelShape,
    cl: &Cluster,
    global_batch: u64,
    seq: u64,
    c: &Constraints,
) -> Result<SearchResult, PlanError> {
    if global_batch == 0 {
        return Err(PlanError("--global-batch: must be at least 1".into()));
    }
    if seq == 0 {
        return Err(PlanError("--seq: must be at least 1".into()));
    }
    check_fixed(m, cl, c)?;
    let cands = candidates(m, cl, global_batch, seq, c);
    let mut first_err: Option<PlanError> = None;
    let mut best: HashMap<(u64, u64, u64, u64, u64), Estimate> = HashMap::new();
    let mut evaluated = 0;
    let mut pruned = 0;
    let mut smallest: Option<Estimate> = None;
    for l in cands {
        if let Err(e) = check_layout(m, cl, &l) {
            first_err.get_or_insert(e);
            continue;
        }
        evaluated += 1;
        let mem = memory(m, cl, &l);
        if mem.total > cl.acc.mem_bytes {
            pruned += 1;
            if smallest.as_ref().is_none_or(|s| mem.total < s.memory_bytes_per_gpu) {
                smallest = Some(estimate(m, cl, &l));
            }
            continue;
        }
        let est = estimate(m, cl, &l);
        let key = (l.tp, l.pp, l.dp, l.cp, l.ep);
        match best.get(&key) {
            Some(b) if b.step_time_s <= est.step_time_s => {}
            _ => {
                best.insert(key, est);
            }
        }
    }
    if evaluated == 0 {
        return Err(first_err.unwrap_or_else(|| no_candidates(m, cl, global_batch, c)));
    }
    let mut plans: Vec<Estimate> = best.into_values().collect();
    plans.sort_by(|a, b| a.step_time_s.total_cmp(&b.step_time_s));
    Ok(SearchResult {
        plans,
        evaluated,
        pruned_unfit: pruned,
        smallest_unfit: smallest,
    })
}

/// Why no layout is consistent with the fixed flags: the first constraint that empties the candidate set, named.
fn no_candidates(m: &ModelShape, cl: &Cluster, global_batch: u64, c: &Constraints) -> PlanError {
    let n = cl.gpus;
    let e = |s: String| PlanError(s);
    if let (Some(tp), Some(pp), cp) = (c.tp, c.pp, c.cp.unwrap_or(1)) {
        let dp = n / (tp * pp * cp).max(1);
        if c.dp.is_some_and(|d| d != dp) {
            return e(format!("--dp {} but --gpus {n} / (--tp {tp} x --pp {pp} x --cp {cp}) = {dp}", c.dp.unwrap_or(0)));
        }
        if !global_batch.is_multiple_of(dp) {
            return e(format!("--global-batch {global_batch} is not a multiple of the data-parallel degree {dp} (--gpus {n} / (--tp {tp} x --pp {pp} x --cp {cp}))"));
        }
        let per_rank = global_batch / dp;
        if let Some(b) = c.micro_batch {
            if !per_rank.is_multiple_of(b) {
                return e(format!("--micro-batch {b} does not divide the {per_rank} sequences per data-parallel rank (--global-batch {global_batch} / dp {dp})"));
            }
        }
        if let Some(v) = c.virtual_stages.filter(|&v| v > 1) {
            if pp * v > m.layers {
                return e(format!("--pp {pp} x --virtual-stages {v} = {} chunks but the model has only {} layers", pp * v, m.layers));
            }
        }
    }
    e(format!(
        "no layout of {n} GPUs satisfies the fixed flags: tp must divide heads {} and kv heads {}, pp the layers {} \
         (unless given), cp the sequence, and --global-batch {global_batch} must be a multiple of the data-parallel degree",
        m.heads, m.kv_heads, m.layers
    ))
}

/// Why the best plan beats the runner-up: the breakdown terms that differ most.
pub fn explain(best: &Estimate, other: &Estimate) -> String {
    let a = &best.breakdown;
    let b = &other.breakdown;
    let terms = [
        ("GEMM compute", a.compute_gemm_s, b.compute_gemm_s),
        ("attention compute", a.compute_attention_s, b.compute_attention_s),
        ("memory-bound kernels", a.compute_elementwise_s, b.compute_elementwise_s),
        ("recomputation", a.recompute_s, b.recompute_s),
        ("TP communication", a.tp_comm_s, b.tp_comm_s),
        ("CP communication", a.cp_comm_s, b.cp_comm_s),
        ("EP all-to-all", a.ep_comm_s, b.ep_comm_s),
        ("PP point-to-point", a.pp_p2p_s, b.pp_p2p_s),
        ("pipeline bubble", a.pp_bubble_s, b.pp_bubble_s),
        ("exposed DP communication", a.dp_comm_exposed_s, b.dp_comm_exposed_s),
        ("compute slowed by hidden DP traffic", a.overlap_contention_s, b.overlap_contention_s),
        ("optimizer step", a.optimizer_s, b.optimizer_s),
    ];
    let mut diffs: Vec<(&str, f64)> = terms
        .iter()
        .map(|(n, x, y)| (*n, y - x))
        .filter(|(_, d)| d.abs() > 1e-9)
        .collect();
    diffs.sort_by(|x, y| y.1.abs().total_cmp(&x.1.abs()));
    let gain = (other.step_time_s - best.step_time_s) / other.step_time_s * 100.0;
    let parts: Vec<String> = diffs
        .iter()
        .take(3)
        .map(|(n, d)| format!("{n} {} {:.3} s", if *d > 0.0 { "saves" } else { "costs" }, d.abs()))
        .collect();
    format!(
        "{} is {gain:.1}% faster than {}: {}",
        mesh_name(&best.chosen),
        mesh_name(&other.chosen),
        parts.join(", ")
    )
}

pub fn mesh_name(l: &Layout) -> String {
    let mut s = format!("tp{} pp{} dp{}", l.tp, l.pp, l.dp);
    if l.cp > 1 {
        s += &format!(" cp{}", l.cp);
        if l.cp_mode == crate::policy::CpMode::Ulysses {
            s += " ulysses";
        }
    }
    if l.ep > 1 {
        s += &format!(" ep{}", l.ep);
    }
    s
}
