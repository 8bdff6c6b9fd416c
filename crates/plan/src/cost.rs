//! The cost model: FLOPs, memory, communication and time of one training iteration. Pure functions of
//! (model, cluster, layout). Every formula names its source; where none exists, the comment says it is an
//! assumption of this planner.
//!
//! Shape letters: B global batch (sequences), b micro-batch, s sequence, h hidden, a heads, d head width,
//! f MLP width, V vocabulary, L layers, t tensor-parallel, p pipeline, v virtual stages (interleaving),
//! m micro-batches per pipeline per iteration, N data-parallel degree, Ψ parameters.

use serde::Serialize;

use crate::hardware::{Cluster, GemmCurve, Precision};
use crate::models::{Mlp, ModelShape};
use crate::schedule::Kind;
use crate::PlanError;

pub use crate::policy::Recompute;

/// Attention kernel: Megatron's unfused QKᵀ / softmax / dropout / AV (stores the s² tensors, streams them through
/// HBM), or a flash-style fused kernel (Dao et al. 2022: no s² tensor in HBM, recomputes it in backward, skips the
/// masked half under a causal mask).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    Unfused,
    Flash,
}

impl Attention {
    pub fn parse(s: &str) -> Result<Attention, PlanError> {
        match s.to_ascii_lowercase().as_str() {
            "unfused" | "megatron" => Ok(Attention::Unfused),
            "flash" => Ok(Attention::Flash),
            o => Err(PlanError(format!(
                "--attention: unknown kernel '{o}' (expected unfused|flash)"
            ))),
        }
    }
}

/// A complete parallel layout.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Layout {
    pub tp: u64,
    pub pp: u64,
    pub dp: u64,
    pub cp: u64,
    /// How context-parallel ranks compute attention: ring (K/V blocks passed around, overlapped
    /// with the blocks' attention) or Ulysses (all-to-alls to a head split and back, exposed).
    pub cp_mode: crate::policy::CpMode,
    pub ep: u64,
    pub micro_batch: u64,
    pub global_batch: u64,
    pub seq: u64,
    pub schedule: Kind,
    pub virtual_stages: u64,
    pub recompute: Recompute,
    pub sequence_parallel: bool,
    pub zero: u8,
    pub precision: Precision,
    pub attention: Attention,
    /// Overlap the data-parallel gradient reduction with the last micro-batch's backward (PyTorch DDP buckets,
    /// Megatron `--overlap-grad-reduce`). Megatron-LM of 2021–2022 reduced after the backward pass (false).
    pub overlap_dp: bool,
    /// Overlap TP backward collectives with weight-gradient GEMMs and interleaved-PP p2p with compute (modern
    /// Megatron). Megatron-LM of 2021 did neither (false).
    pub overlap_comm: bool,
    /// Keep (and reduce) gradients in fp32, as Megatron's `main_grad` buffer and FSDP's fp32 `reduce_dtype` do:
    /// 4 bytes per gradient instead of the ZeRO paper's 2 (18 bytes of model state per parameter, not 16).
    pub fp32_grads: bool,
    /// The optimizer and AdamW's state form (their state bytes, and Muon's iteration).
    #[serde(default)]
    pub optimizer: crate::policy::OptimName,
    #[serde(default)]
    pub optim_state: crate::policy::StateForm,
    /// Data-parallel communication compression (1-bit Adam after its warm-up).
    pub compression: crate::policy::Compression,
    /// PowerSGD's rank.
    pub powersgd_rank: u64,
    /// ZeRO++ (Wang et al. 2023) on ZeRO-3: qwZ int8 parameter gathers, qgZ hierarchical int4
    /// gradient reduce-scatter, hpZ backward gathers inside the node (`parallel::zeropp`).
    #[serde(default)]
    pub zeropp: bool,
    /// DeepSpeed's pipeline engine (Megatron-DeepSpeed: BLOOM, MT-NLG): each stage boundary moves the full b·s·h
    /// activation from every tensor-parallel rank (Megatron's scatter/gather split of it, Narayanan §4.1, is
    /// Megatron-LM's own) with blocking send/recv, so forward's receive and send and backward's receive and send
    /// are four exposed transfers per micro-batch (`deepspeed/runtime/pipe/engine.py` `_exec_send_activations`,
    /// `_exec_recv_activations`, `_exec_send_grads`, `_exec_recv_grads`), not Megatron's two.
    #[serde(default)]
    pub pp_blocking_p2p: bool,
}

impl Layout {
    /// m: micro-batches per pipeline per iteration.
    pub fn micro_batches(&self) -> u64 {
        self.global_batch / (self.dp * self.micro_batch)
    }
    pub fn gpus(&self) -> u64 {
        self.tp * self.pp * self.dp * self.cp
    }
}

/// Check a layout against the model and cluster; every message names the flag and value at fault.
pub fn check_layout(model: &ModelShape, cluster: &Cluster, l: &Layout) -> Result<(), PlanError> {
    let e = |s: String| Err(PlanError(s));
    if l.tp == 0 || l.pp == 0 || l.dp == 0 || l.cp == 0 || l.ep == 0 || l.micro_batch == 0 {
        return e("--tp/--pp/--dp/--cp/--ep/--micro-batch must all be at least 1".into());
    }
    if l.compression == crate::policy::Compression::PowerSgd && l.powersgd_rank == 0 {
        return e("--powersgd-rank must be at least 1".into());
    }
    if l.compression == crate::policy::Compression::PowerSgd && (l.tp > 1 || l.pp > 1 || l.zero != 0 || model.experts > 1) {
        return e(format!("--compression powersgd is modelled for a dense model's whole replicas: it needs --tp 1 --pp 1 --zero 0 (got tp {}, pp {}, zero {}, {} experts)", l.tp, l.pp, l.zero, model.experts));
    }
    if l.zeropp && (l.zero != 3 || l.compression != crate::policy::Compression::None) {
        return e(format!("--zeropp works on ZeRO-3's collectives: it needs --zero 3 and no --compression (got zero {}, compression {})", l.zero, crate::policy::Names::name(l.compression)));
    }
    if matches!(l.compression, crate::policy::Compression::OnebitAdam | crate::policy::Compression::ZerooneAdam) && l.zero != 0 {
        return e(format!("--compression {} communicates the momentum of whole replicas: it needs --zero 0, got {}", crate::policy::Names::name(l.compression), l.zero));
    }
    if l.gpus() != cluster.gpus {
        return e(format!(
            "--tp {} x --pp {} x --dp {} x --cp {} = {} but --gpus is {}",
            l.tp,
            l.pp,
            l.dp,
            l.cp,
            l.gpus(),
            cluster.gpus
        ));
    }
    if !model.heads.is_multiple_of(l.tp) {
        return e(format!("--tp {} does not divide heads {}", l.tp, model.heads));
    }
    if !model.kv_heads.is_multiple_of(l.tp) {
        return e(format!("--tp {} does not divide kv_heads {}", l.tp, model.kv_heads));
    }
    if l.pp * l.virtual_stages > model.layers {
        return e(format!(
            "--pp {} x --virtual-stages {} = {} chunks but the model has only {} layers",
            l.pp,
            l.virtual_stages,
            l.pp * l.virtual_stages,
            model.layers
        ));
    }
    if !l.global_batch.is_multiple_of(l.dp * l.micro_batch) {
        return e(format!(
            "--global-batch {} is not a multiple of --dp {} x --micro-batch {}",
            l.global_batch, l.dp, l.micro_batch
        ));
    }
    if !l.seq.is_multiple_of(l.cp) || (l.sequence_parallel && !l.seq.is_multiple_of(l.cp * l.tp)) {
        return e(format!(
            "--seq {} is not divisible by --cp {} (x --tp with --sequence-parallel)",
            l.seq, l.cp
        ));
    }
    if l.cp > 1 && l.cp_mode == crate::policy::CpMode::Ulysses {
        let (h, kv) = (model.heads / l.tp.max(1), model.kv_heads / l.tp.max(1));
        if !h.is_multiple_of(l.cp) || !(kv.is_multiple_of(l.cp) || l.cp.is_multiple_of(kv.max(1))) {
            return e(format!("--cp-mode ulysses needs the heads per tensor-parallel rank ({h}, kv {kv}) to split over --cp {}", l.cp));
        }
    }
    if l.ep > 1 {
        if !model.is_moe() {
            return e(format!("--ep {} given but model '{}' has no experts", l.ep, model.name));
        }
        if !model.experts.is_multiple_of(l.ep) || !(l.dp * l.cp).is_multiple_of(l.ep) {
            return e(format!(
                "--ep {} must divide experts {} and --dp x --cp {}",
                l.ep,
                model.experts,
                l.dp * l.cp
            ));
        }
    }
    if l.zero > 3 {
        return e(format!("--zero {} (expected 0|1|2|3)", l.zero));
    }
    if l.schedule == Kind::Interleaved {
        if l.pp == 1 {
            return e("--schedule interleaved needs --pp > 1".into());
        }
        if l.virtual_stages < 2 {
            return e(format!(
                "--schedule interleaved needs --virtual-stages >= 2 (got {})",
                l.virtual_stages
            ));
        }
        // Megatron's interleaved schedule requires m to be a multiple of p.
        if !l.micro_batches().is_multiple_of(l.pp) {
            return e(format!(
                "--schedule interleaved needs micro-batches ({}) to be a multiple of --pp {}",
                l.micro_batches(),
                l.pp
            ));
        }
    } else if l.virtual_stages != 1 {
        return e(format!(
            "--virtual-stages {} needs --schedule interleaved",
            l.virtual_stages
        ));
    }
    if l.sequence_parallel && l.tp == 1 {
        return e("--sequence-parallel needs --tp > 1".into());
    }
    cluster.acc.peak(l.precision)?;
    if l.attention == Attention::Flash && !cluster.acc.flash_attention {
        return e(format!("--attention flash: not available on '{}'", cluster.acc.name));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------------
// FLOPs
// ---------------------------------------------------------------------------------------------------------------

/// PaLM (Chowdhery et al. 2022), appendix B: training FLOPs per token `6N + 12·L·C·T`, N the parameters without the
/// position embedding, L layers, C = h, T the sequence length (attention counted without the causal halving).
pub fn palm_flops_per_token(n_params_no_pos_emb: f64, n_layer: f64, n_embd: f64, seq: f64) -> f64 {
    6.0 * n_params_no_pos_emb + 12.0 * n_layer * n_embd * seq
}

/// Weight-matmul parameters one token multiplies by in layer `i` (no biases, norms): W_qkv, W_o, MLP (MoE: the
/// top-k routed plus the shared experts, plus the router).
pub fn layer_matmul_params_active(m: &ModelShape, i: u64) -> f64 {
    let h = m.hidden as f64;
    let attn = h * (m.q_dim() + 2 * m.kv_dim()) as f64 + m.q_dim() as f64 * h;
    let mats = m.mlp.matrices() as f64;
    let mlp = if m.layer_is_moe(i) {
        (m.top_k + m.shared_experts) as f64 * mats * h * m.expert_ffn_hidden as f64 + h * m.experts as f64
    } else {
        mats * h * m.ffn_hidden as f64
    };
    attn + mlp
}

/// Forward FLOPs of the transformer layers for one sequence of length s. Per layer and token:
/// `2·(matmul params)` + attention `4·s·a·d` (QKᵀ and AV, no causal halving; Narayanan et al. §5.1 convention).
pub fn layers_forward_flops_per_seq(m: &ModelShape, s: u64) -> f64 {
    let s = s as f64;
    (0..m.layers)
        .map(|i| s * (2.0 * layer_matmul_params_active(m, i) + 4.0 * s * m.q_dim() as f64))
        .sum()
}

/// Forward FLOPs of the output layer (logits) for one sequence: `2·s·h·V`.
pub fn logits_forward_flops_per_seq(m: &ModelShape, s: u64) -> f64 {
    2.0 * s as f64 * m.hidden as f64 * m.vocab as f64
}

/// Model FLOPs per iteration: forward + backward (= 3 × forward), never counting recomputation.
/// For dense GPT this is exactly `72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))` (Narayanan et al. 2021, eq. (3) with 72
/// for 96; Korthikanti et al. 2023 §6). Generalised by counting matmul parameters: GQA (narrower K/V), SwiGLU (3
/// matrices), MoE (top-k + shared experts + router).
pub fn model_flops(m: &ModelShape, global_batch: u64, s: u64) -> f64 {
    3.0 * global_batch as f64 * (layers_forward_flops_per_seq(m, s) + logits_forward_flops_per_seq(m, s))
}

/// FLOPs the hardware executes, the convention of Narayanan et al. Table 1: full recomputation adds one forward of
/// the transformer layers (`96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`); selective recomputation adds the attention
/// core `4·B·s²·a·d` per layer (Korthikanti et al. §6, "hardware FLOPs").
pub fn hardware_flops(m: &ModelShape, global_batch: u64, s: u64, r: Recompute) -> f64 {
    let b = global_batch as f64;
    let extra = match r {
        Recompute::None => 0.0,
        Recompute::Full => b * layers_forward_flops_per_seq(m, s),
        Recompute::Selective => b * m.layers as f64 * 4.0 * (s as f64).powi(2) * m.q_dim() as f64,
    };
    model_flops(m, global_batch, s) + extra
}

// ---------------------------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------------------------

/// Bytes per parameter of (weights, gradients, optimizer states) for mixed-precision Adam.
/// bf16/fp16 and fp8: 2 + 2 + 12 (fp32 master copy, momentum, variance), ZeRO paper §3.1 (K = 12).
/// fp32: 4 + 4 + 8 (no master copy).
/// With `fp32_grads` the gradient takes 4 bytes (Megatron-LM's `main_grad`; its distributed-optimizer notes count
/// 18 bytes per parameter for bf16 parameters with fp32 gradients).
pub fn state_bytes_per_param(p: Precision, fp32_grads: bool) -> (f64, f64, f64) {
    match p {
        Precision::Fp32 => (4.0, 4.0, 8.0),
        // Megatron's fp16 optimizer: fp32 master, fp32 gradient copy, m, v (its distributed-optimizer notes: 20 B).
        Precision::Fp16 => (2.0, 2.0, 16.0),
        _ => (2.0, if fp32_grads { 4.0 } else { 2.0 }, 12.0),
    }
}

/// Bytes of optimizer state per parameter (the `k` of [`state_bytes_per_param`]) for the layout's optimizer, with
/// `matrix_share` of the parameters in hidden 2-D matrices (Muon's). The fp32 master copy under 16-bit precision
/// (4 B; none for bf16 AdamW state under bf16 weights, which update with stochastic rounding) plus the moments:
/// AdamW's two (fp32 8 B, bf16 4 B, 8-bit 2 B and a 4-byte scale per 256), Lion's one (4 B), Muon's one for the
/// matrices and AdamW's two for the rest, Adafactor's factored statistics (row and column averages: about none).
/// kiln's implementations: `tensor::optim`, `tensor::lean`.
pub fn optimizer_bytes_per_param(l: &Layout, matrix_share: f64) -> f64 {
    use crate::policy::{OptimName, StateForm};
    let sixteen = l.precision != Precision::Fp32;
    let own_master = l.optimizer == OptimName::AdamW && l.optim_state == StateForm::Bf16 && l.precision == Precision::Bf16;
    let master = if sixteen && !own_master { 4.0 } else { 0.0 };
    let adam = match l.optim_state {
        StateForm::Fp32 => 8.0,
        StateForm::Bf16 => 4.0,
        StateForm::Int8 => 2.0 + 8.0 / 256.0,
    };
    master
        + match l.optimizer {
            OptimName::AdamW => adam,
            OptimName::Lion => 4.0,
            OptimName::Muon => 4.0 * matrix_share + 8.0 * (1.0 - matrix_share),
            OptimName::Adafactor => 0.0,
        }
}

/// The share of a model's parameters in its hidden 2-D matrices (not the embeddings, head, norms and biases):
/// what Muon updates.
pub fn matrix_share(m: &ModelShape) -> f64 {
    let total = m.params(m.seq) as f64;
    // Norm weights: two per layer and the final one.
    let norms = ((2 * m.layers + 1) * m.hidden) as f64;
    ((total - m.embedding_params(m.seq) as f64 - norms) / total).clamp(0.0, 1.0)
}

/// The Newton–Schulz iteration's FLOPs in one Muon step over `m`'s hidden matrices (Jordan et al.'s 5 quintic
/// steps, each `4r²c + 2r³` for an `r × c` matrix with `r ≤ c`), before any split over ranks.
pub fn muon_flops(m: &ModelShape) -> f64 {
    let (h, q, kv, f) = (m.hidden as f64, m.q_dim() as f64, (m.kv_heads * m.head_dim) as f64, m.ffn_hidden as f64);
    let ns = |a: f64, b: f64| {
        let (r, c) = (a.min(b), a.max(b));
        5.0 * (4.0 * r * r * c + 2.0 * r * r * r)
    };
    let gated = m.mlp == crate::models::Mlp::Swiglu;
    let mlp = if gated { 2.0 * ns(f, h) + ns(h, f) } else { ns(f, h) + ns(h, f) };
    let attn = match m.mla {
        // MLA's matrices: q's down and up (or one), the latent with the rotary key, its up, W_o.
        Some(a) => {
            let (r, kr, rope, v, nh, d) = (a.q_rank as f64, a.kv_rank as f64, a.rope as f64, a.v as f64, m.heads as f64, m.head_dim as f64);
            let qm = if a.q_rank > 0 { ns(r, h) + ns(nh * d, r) } else { ns(nh * d, h) };
            qm + ns(kr + rope, h) + ns(nh * (d - rope + v), kr) + ns(h, nh * v)
        }
        None => ns(q, h) + 2.0 * ns(kv, h) + ns(h, q),
    };
    m.layers as f64 * (attn + mlp)
}

/// Model-state bytes per GPU, Rajbhandari et al. (ZeRO, SC20) §5: with Ψ parameters on the GPU (after TP/PP
/// sharding), data-parallel degree N and (w, g, k) bytes per parameter:
/// stage 0: (w+g+k)Ψ = 16Ψ; stage 1: (w+g)Ψ + kΨ/N = 4Ψ + 12Ψ/N; stage 2: wΨ + (g+k)Ψ/N = 2Ψ + 14Ψ/N;
/// stage 3: (w+g+k)Ψ/N = 16Ψ/N. Returns (weights, gradients, optimizer) bytes.
pub fn zero_model_state_bytes(psi: f64, n: f64, stage: u8, p: Precision, fp32_grads: bool) -> (f64, f64, f64) {
    zero_state_bytes(psi, n, stage, state_bytes_per_param(p, fp32_grads))
}

/// [`zero_model_state_bytes`] with the bytes per parameter `(w, g, k)` given.
pub fn zero_state_bytes(psi: f64, n: f64, stage: u8, (w, g, k): (f64, f64, f64)) -> (f64, f64, f64) {
    match stage {
        0 => (w * psi, g * psi, k * psi),
        1 => (w * psi, g * psi, k * psi / n),
        2 => (w * psi, g * psi / n, k * psi / n),
        _ => (w * psi / n, g * psi / n, k * psi / n),
    }
}

/// Activation-memory configuration of one layer.
#[derive(Clone, Copy, Debug)]
pub struct ActConfig {
    /// Tokens per sequence on this GPU (s / cp).
    pub s_local: f64,
    /// Keys each query attends to (s).
    pub s_kv: f64,
    pub b: f64,
    pub t: f64,
    pub sp: bool,
    pub recompute: Recompute,
    pub attention: Attention,
    /// Bytes per stored activation element (2 for 16-bit).
    pub e: f64,
    /// Bytes per stored element of a linear layer's input (the QKV, projection, fc1 and fc2 inputs): `e`, or 1
    /// under FP8, where Transformer Engine's linears keep the FP8 cast they multiplied for the weight gradient
    /// (`_Linear.forward` saves `inputmat`, the cast, instead of `inputmat_no_fp8`; LayerNormLinear and
    /// LayerNormMLP save their FP8 `ln_out` and `gelu_out` the same way).
    pub gemm_in: f64,
}

/// Activation bytes one layer keeps for backward, per micro-batch. Korthikanti et al. 2023 §4.1–4.2, term by term
/// (16-bit activations, 1-byte dropout masks), generalised to GQA, SwiGLU, MoE and flash attention:
/// - attention: QKV input 2sbh, Q and K 2sb(a·d + kv·d)/t, softmax output 2as²b/t, its dropout mask as²b/t,
///   dropout output 2as²b/t, V 2sb·kv·d/t, projection input 2sb·a·d/t, output dropout mask sbh — 11sbh + 5as²b;
/// - MLP: fc1 input 2sbh, GeLU input 2sbf/t, fc2 input 2sbf/t, dropout mask sbh — 19sbh at f = 4h
///   (SwiGLU: 3 stored sbf tensors, 6sbf/t; MoE: top_k copies of the expert MLP plus the shared experts);
/// - two LayerNorm inputs 4sbh.
///
/// Terms marked "sbh" are replicated over the TP group unless sequence parallelism shards them (÷t).
/// Selective recompute drops the s² terms (as does flash attention, which never stores them).
/// Full recompute stores only the layer input, 2sbh (÷t with SP).
/// Dense GPT results: `sbh(34 + 5as/h)`, `sbh(10 + 24/t + 5as/(ht))`, `sbh(34/t + 5as/(ht))`, `sbh(10 + 24/t)`,
/// `sbh(34/t)`, `2sbh` (Korthikanti Table 2).
pub fn activation_bytes_per_layer(m: &ModelShape, moe_layer: bool, c: &ActConfig) -> f64 {
    let (s, b, t, e) = (c.s_local, c.b, c.t, c.e);
    let h = m.hidden as f64;
    let sbh = s * b * h;
    let rep = if c.sp { 1.0 / t } else { 1.0 };
    if c.recompute == Recompute::Full {
        return e * sbh * rep;
    }
    let mask = if m.dropout { 1.0 } else { 0.0 };
    let qd = m.q_dim() as f64;
    let kvd = m.kv_dim() as f64;
    let a = m.heads as f64;
    // Attention block.
    let gi = c.gemm_in;
    let mut attn = gi * sbh * rep // QKV input
        + e * s * b * (qd + kvd) / t // Q, K
        + e * s * b * kvd / t // V
        + gi * s * b * qd / t // projection input
        + mask * sbh * rep; // output dropout mask
    let keep_s2 = c.recompute == Recompute::None && c.attention == Attention::Unfused;
    if keep_s2 {
        let as2b = a * s * c.s_kv * b / t;
        attn += e * as2b // softmax output
            + mask * as2b // attention dropout mask
            + if m.dropout { e * as2b } else { 0.0 }; // dropout output
    }
    // MLP block.
    let mlp_inner = |f: f64| match m.mlp {
        Mlp::Gelu => (e + gi) * s * b * f / t,         // GeLU input, fc2 input
        Mlp::Swiglu => (2.0 * e + gi) * s * b * f / t, // w1·x, w3·x, their product (fc2 input)
    };
    let mlp = if moe_layer {
        let k = m.top_k as f64 * m.capacity_factor;
        let fe = m.expert_ffn_hidden as f64;
        gi * sbh * rep // router/fc1 input
            + k * (gi * sbh / t + mlp_inner(fe)) // dispatched token copies and their expert activations
            + m.shared_experts as f64 * mlp_inner(fe)
            + mask * sbh * rep
    } else {
        gi * sbh * rep + mlp_inner(m.ffn_hidden as f64) + mask * sbh * rep
    };
    let norms = 2.0 * e * sbh * rep;
    attn + mlp + norms
}

/// Micro-batches whose activations the first pipeline stage holds at its peak, as a multiple of one micro-batch
/// of all L/p of its layers. Narayanan et al. §2.2: GPipe holds m micro-batches, 1F1B at most p; Korthikanti et al.
/// §4.2.3: interleaving with v chunks multiplies the 1F1B figure by `1 + (p−1)/(p·v)`.
pub fn inflight_microbatches(schedule: Kind, p: u64, m: u64, v: u64) -> f64 {
    let (p, m, v) = (p as f64, m as f64, v as f64);
    match schedule {
        Kind::Gpipe => m,
        Kind::OneFOneB => p.min(m),
        Kind::Interleaved => p.min(m) * (1.0 + (p - 1.0) / (p * v)),
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct MemoryBreakdown {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer: f64,
    pub activations: f64,
    /// Last stage: output-layer input, fp32 logits and their gradient.
    pub logits: f64,
    /// CUDA context, communication buffers, fragmentation (catalogue constant).
    pub reserved: f64,
    pub total: f64,
    /// Local parameters Ψ on the fullest GPU (after TP/PP/EP sharding).
    pub params_on_gpu: f64,
}

/// Layer indices on pipeline stage `stage`. Interleaved (v > 1): chunk c holds layers (c·p + stage)·L/(pv) ..
/// +L/(pv) (Megatron; needs pv | L). Otherwise a contiguous split; when p does not divide L the L mod p extra layers
/// go to stages 1, 2, … (the first stage already holds the embeddings and the most in-flight activations), as
/// Megatron-DeepSpeed's uneven partitioning does (BLOOM: 70 layers on 12 stages).
pub fn stage_layers(m: &ModelShape, l: &Layout, stage: u64) -> Vec<u64> {
    let (nl, p, v) = (m.layers, l.pp, l.virtual_stages);
    if v > 1 {
        // When pv ∤ L the chunks differ by one layer, and the short ones are the model's first and last chunks
        // (stage 0's first, stage p−1's last: they also hold the embeddings and the output layer), then the next
        // ones inward: Llama 3 §3.3.2 ("we reduce one Transformer layer each from the first and the last stages"),
        // Megatron-Core's `--account-for-embedding-in-pipeline-split` / `--decoder-first-pipeline-num-layers`.
        let chunks = p * v;
        let (base, extra) = (nl / chunks, nl % chunks);
        let short = if extra == 0 { 0 } else { chunks - extra };
        let is_short = |k: u64| {
            let inward = k.min(chunks - 1 - k);
            // Order 0, C−1, 1, C−2, …: position of chunk k in that order.
            let pos = 2 * inward + u64::from(k > chunks - 1 - k);
            pos < short
        };
        let size = |k: u64| if extra == 0 { base } else { base + 1 - u64::from(is_short(k)) };
        let start = |k: u64| (0..k).map(size).sum::<u64>();
        return (0..v)
            .flat_map(|c| {
                let k = c * p + stage;
                start(k)..start(k) + size(k)
            })
            .collect();
    }
    let (base, extra) = (nl / p, nl % p);
    // Stage order that receives an extra layer: 1, 2, …, p−1, then 0.
    let gets_extra = |s: u64| {
        if extra == 0 {
            false
        } else if s == 0 {
            extra == p
        } else {
            s <= extra.min(p - 1)
        }
    };
    let count = |s: u64| base + u64::from(gets_extra(s));
    let start: u64 = (0..stage).map(count).sum();
    (start..start + count(stage)).collect()
}

/// Parameters on pipeline stage `stage`, per GPU: (dense, expert), over `stage_layers`. Word embeddings live on the
/// first stage and, for tied embeddings with p > 1, a copy on the last (Megatron); position embeddings on the
/// first. All ÷t (norms and row-parallel biases are in fact replicated; they are <0.1% of a layer). Experts ÷(t·ep).
pub fn stage_params(m: &ModelShape, l: &Layout, stage: u64) -> (f64, f64) {
    let (mut dense, mut expert) = (0.0, 0.0);
    for i in stage_layers(m, l, stage) {
        let e = m.layer_expert_params(i) as f64;
        dense += (m.layer_params(i) as f64 - e) / l.tp as f64;
        expert += e / (l.tp * l.ep) as f64;
    }
    let h = m.hidden as f64;
    let vh = m.vocab as f64 * h / l.tp as f64;
    if stage == 0 {
        dense += vh + if m.learned_pos_emb { l.seq as f64 * h } else { 0.0 };
    }
    if stage == l.pp - 1 && (l.pp > 1 || !m.tied_embeddings) {
        dense += vh;
    }
    (dense, expert)
}

/// Per-GPU memory of the fullest stage (first or last).
pub fn memory(m: &ModelShape, cl: &Cluster, l: &Layout) -> MemoryBreakdown {
    let mut worst = MemoryBreakdown::default();
    let stages: Vec<u64> = match l.pp {
        1 => vec![0],
        2 => vec![0, 1],
        p => vec![0, 1, p - 1],
    };
    for &st in &stages {
        let (dense, expert) = stage_params(m, l, st);
        let layers = stage_layers(m, l, st);
        let per = layers.len().max(1);
        let n_dense = (l.dp * l.cp) as f64; // Megatron shards optimizer state over DP×CP
        let n_expert = (l.dp * l.cp / l.ep) as f64;
        let (w, g, _) = state_bytes_per_param(l.precision, l.fp32_grads);
        let k = optimizer_bytes_per_param(l, matrix_share(m));
        let (w1, g1, o1) = zero_state_bytes(dense, n_dense, l.zero, (w, g, k));
        let (w2, g2, o2) = zero_state_bytes(expert, n_expert, l.zero, (w, g, k));
        let c = ActConfig {
            s_local: (l.seq / l.cp) as f64,
            s_kv: l.seq as f64,
            b: l.micro_batch as f64,
            t: l.tp as f64,
            sp: l.sequence_parallel,
            recompute: l.recompute,
            attention: l.attention,
            e: l.precision.act_bytes(),
            gemm_in: if l.precision == Precision::Fp8 { 1.0 } else { l.precision.act_bytes() },
        };
        let layer_sum: f64 = layers
            .iter()
            .map(|&i| activation_bytes_per_layer(m, m.layer_is_moe(i), &c))
            .sum();
        let mb = l.micro_batches();
        // Stage s of 1F1B holds p − s micro-batches (Narayanan §2.2); the last runs each backward right after its
        // forward. Stage 0 gets the closed forms of `inflight_microbatches`.
        let inflight = match (st, l.schedule) {
            (0, _) | (_, Kind::Gpipe) => inflight_microbatches(l.schedule, l.pp, mb, l.virtual_stages),
            _ => inflight_microbatches(l.schedule, l.pp - st, mb, l.virtual_stages),
        };
        let mut act = layer_sum * inflight;
        if l.recompute == Recompute::Full {
            // Working set while one layer is recomputed and back-propagated: its full activations.
            let full = ActConfig {
                recompute: Recompute::None,
                ..c
            };
            act += activation_bytes_per_layer(m, m.layer_is_moe(layers[0]), &full);
        }
        let (sb, h, v, t) = (c.s_local * c.b, m.hidden as f64, m.vocab as f64, c.t);
        // Embedding dropout mask (Korthikanti §4.3) on the first stage.
        if st == 0 && m.dropout {
            act += inflight * sb * h / if l.sequence_parallel { t } else { 1.0 };
        }
        // Output layer and loss (Korthikanti §4.3: 4sbh/t·(1 + V/h)) plus the fp32 logits gradient 4sbV/t.
        let logits = if st == l.pp - 1 {
            4.0 * sb * (h + v) / t + 4.0 * sb * v / t
        } else {
            0.0
        };
        // ZeRO-3 gathers each layer's full (TP/EP-local) weights before use and prefetches the next one
        // (DeepSpeed's prefetch bucket; FSDP's default of one unit ahead): two layers of 16-bit weights.
        let mut w_gathered = 0.0;
        if l.zero == 3 {
            let (wb, _, _) = state_bytes_per_param(l.precision, l.fp32_grads);
            let per_layer = (dense + expert) / per as f64;
            w_gathered = 2.0 * wb * per_layer;
        }
        let reserved = cl.acc.reserved_bytes;
        let total = w1 + w2 + w_gathered + g1 + g2 + o1 + o2 + act + logits + reserved;
        if total > worst.total {
            worst = MemoryBreakdown {
                weights: w1 + w2 + w_gathered,
                gradients: g1 + g2,
                optimizer: o1 + o2,
                activations: act,
                logits,
                reserved,
                total,
                params_on_gpu: dense + expert,
            };
        }
    }
    worst
}

// ---------------------------------------------------------------------------------------------------------------
// Kernel and communication times
// ---------------------------------------------------------------------------------------------------------------

/// Time of a (batched) GEMM C[M×N] = A[M×K]·B[K×N] in 16-bit (or the layout's precision).
/// Efficiency curve (assumption of this planner, from how GPU GEMM libraries work):
/// `eff = plateau · wave · K/(K + k_half)`, where `wave = tiles / (⌈tiles/units⌉·units)` is the wave-quantisation
/// loss (each SM/CU takes one output tile; the library picks the best of three tile shapes, smaller ones at
/// 0.92 and 0.80 of the large tile's rate) and `k_half` models the main-loop prologue/epilogue. Roofline: never
/// faster than moving A, B and C once through HBM. Plus one launch overhead.
pub fn gemm_time(cl: &Cluster, prec: Precision, m: f64, n: f64, k: f64, batch: f64) -> f64 {
    if let Some(curve) = &cl.acc.gemm_curve {
        return cpu_gemm_time(cl, curve, prec, m, n, k, batch);
    }
    let acc = &cl.acc;
    let peak = acc.peak(prec).unwrap_or(f64::MIN_POSITIVE);
    let flops = 2.0 * m * n * k * batch;
    let units = acc.compute_units as f64;
    let (tm, tn) = (acc.tile_m as f64, acc.tile_n as f64);
    let mut wave = 0.0f64;
    for (fm, fn_, rate) in [(1.0, 1.0, 1.0), (0.5, 1.0, 0.92), (0.5, 0.5, 0.80)] {
        let tiles = batch * (m / (tm * fm)).ceil().max(1.0) * (n / (tn * fn_)).ceil().max(1.0);
        let waves = (tiles / units).ceil();
        wave = wave.max(rate * tiles / (waves * units));
    }
    let size = if acc.mn_half > 0.0 { m / (m + acc.mn_half) * n / (n + acc.mn_half) } else { 1.0 };
    let eff = acc.gemm_efficiency * wave * size * k / (k + acc.k_half);
    let t_compute = flops / (peak * eff);
    let e = prec.act_bytes().min(2.0) * if prec == Precision::Fp8 { 0.5 } else { 1.0 };
    let bytes = e * (m * k + k * n + m * n) * batch;
    t_compute.max(bytes / acc.stream_bw()) + acc.kernel_overhead
}

/// GEMM time on a calibrated CPU: the measured rate curve (`GemmCurve`, fitted to products run through the same
/// kernels as training, so cache and packing effects are inside the measurement; no separate roofline) plus one
/// kernel call. A batched product (attention heads) runs `batch` independent products spread over the threads,
/// each at the rate of one m×n×k product.
fn cpu_gemm_time(cl: &Cluster, curve: &GemmCurve, prec: Precision, m: f64, n: f64, k: f64, batch: f64) -> f64 {
    let peak = cl.acc.peak(prec).unwrap_or(f64::MIN_POSITIVE);
    2.0 * m * n * k * batch / (peak * curve.efficiency(m, n, k)) + cl.acc.kernel_overhead
}

/// One (batched) product of the attention core: the measured attention curve where there is one (CPU), else
/// `gemm_time`.
fn attn_gemm_time(cl: &Cluster, prec: Precision, m: f64, n: f64, k: f64, batch: f64) -> f64 {
    match &cl.acc.attention_curve {
        Some(c) => cpu_gemm_time(cl, c, prec, m, n, k, batch),
        None => gemm_time(cl, prec, m, n, k, batch),
    }
}

/// Time of `bytes` of the per-layer memory-bound kernels (norms, activations, residual adds, softmax, cross
/// entropy) in `kernels` kernels, at the accelerator's `elem_bw` (= `stream_bw` unless measured).
pub fn elem_time(cl: &Cluster, bytes: f64, kernels: f64) -> f64 {
    bytes / cl.acc.elem_bw() + kernels * cl.acc.kernel_overhead
}

/// Time of `bytes` of memory-bound traffic in `kernels` kernels.
pub fn stream_time(cl: &Cluster, bytes: f64, kernels: f64) -> f64 {
    bytes / cl.acc.stream_bw() + kernels * cl.acc.kernel_overhead
}

/// Which link a communicator group runs on, and how fast. Mesh order (Megatron's default, innermost first):
/// tp, cp, dp, pp; EP is carved out of the innermost DP ranks. A group of `n` ranks at `stride` has
/// `g = clamp(G/stride, 1, n)` ranks per node (groups that do not tile a node count as crossing nodes).
/// Within a node it runs at the intra-node link's achievable bandwidth. Across nodes a ring crosses the network
/// once per node; with `g` ranks per node there are `g` rings in parallel, each on its own GPU's share of the NICs,
/// so the bus bandwidth is `min(intra, g · nic_share)` (the NCCL multi-ring picture: 8-GPU DGX nodes with 8 NICs
/// reach ~8 × NIC speed).
#[derive(Clone, Copy, Debug)]
pub struct GroupLink {
    pub n: f64,
    /// Bus bandwidth of a ring collective, bytes/s.
    pub bw: f64,
    pub latency: f64,
    pub inter_node: bool,
    /// Ranks of the group in one node, and one GPU's NIC share and intra-node bandwidth (for all-to-all and p2p).
    pub ranks_per_node: f64,
    pub nic_bw: f64,
    pub intra_bw: f64,
    /// Latency of a step between two ranks of the same node.
    pub intra_latency: f64,
}

pub fn group_link(cl: &Cluster, n: u64, stride: u64) -> GroupLink {
    let g_node = cl.gpus_per_node;
    let intra = cl.intra.eff_bw();
    if n <= 1 {
        return GroupLink {
            n: 1.0,
            bw: intra,
            latency: 0.0,
            inter_node: false,
            ranks_per_node: 1.0,
            nic_bw: cl.inter_bw_per_gpu,
            intra_bw: intra,
            intra_latency: cl.intra.latency,
        };
    }
    let span = n * stride;
    // A group stays inside a node only if groups tile the node (a 6-way group on 8-GPU nodes straddles two).
    if span <= g_node && g_node.is_multiple_of(span) {
        return GroupLink {
            n: n as f64,
            bw: intra,
            latency: cl.intra.latency,
            inter_node: false,
            ranks_per_node: n as f64,
            nic_bw: cl.inter_bw_per_gpu,
            intra_bw: intra,
            intra_latency: cl.intra.latency,
        };
    }
    let g = if stride >= g_node {
        1
    } else {
        (g_node / stride).clamp(1, n)
    };
    GroupLink {
        n: n as f64,
        bw: intra.min(g as f64 * cl.inter_bw_per_gpu),
        latency: cl.inter.latency.max(cl.intra.latency),
        inter_node: true,
        ranks_per_node: g as f64,
        nic_bw: cl.inter_bw_per_gpu,
        intra_bw: intra,
        intra_latency: cl.intra.latency,
    }
}

/// The link a point-to-point transfer inside a group uses: across nodes one GPU's share of the NICs (a pair of ranks
/// does not get the multi-ring aggregate a collective gets), inside a node the intra-node link.
pub fn p2p_link(gl: GroupLink) -> GroupLink {
    if gl.inter_node {
        GroupLink {
            bw: gl.nic_bw.min(gl.intra_bw),
            ..gl
        }
    } else {
        gl
    }
}

/// All-reduce of `bytes` per rank. Ring (Patarasuk & Yuan 2009; NCCL): `2(n−1)·α + 2(n−1)/n · S/β`;
/// double binary tree (NCCL ≥ 2.4, Sanders et al. 2009): `2·⌈log₂n⌉·α + 2·S/β`. The faster is used.
pub fn all_reduce_time(gl: GroupLink, bytes: f64) -> f64 {
    let n = gl.n;
    if n <= 1.0 || bytes <= 0.0 {
        return 0.0;
    }
    let ring = 2.0 * collective_latency(gl) + 2.0 * (n - 1.0) / n * bytes / gl.bw;
    let tree = 2.0 * n.log2().ceil() * gl.latency + 2.0 * bytes / gl.bw;
    ring.min(tree)
}

/// Reduce-scatter (or all-gather) of a `bytes` buffer (each rank ends with/starts from bytes/n):
/// ring `(n−1)·α + (n−1)/n · S/β` (Thakur et al. 2005). Across nodes the latency term does not grow linearly with
/// the ranks: with one rank of the group per node NCCL (≥ 2.23) runs PAT, "Parallel Aggregated Trees", a
/// Bruck-style algorithm with `⌈log₂n⌉` network steps (NCCL 2.23 release notes, 2024); with `g` ranks per node the
/// ring's steps between node-mates cost the intra-node latency and only `n/g` of them cross the network
/// (NCCL's rings enter and leave each node once).
pub fn reduce_scatter_time(gl: GroupLink, bytes: f64) -> f64 {
    let n = gl.n;
    if n <= 1.0 || bytes <= 0.0 {
        return 0.0;
    }
    (n - 1.0) / n * bytes / gl.bw + collective_latency(gl)
}

/// The latency part of a reduce-scatter / all-gather over `gl` (see [`reduce_scatter_time`]).
pub fn collective_latency(gl: GroupLink) -> f64 {
    let n = gl.n;
    if n <= 1.0 {
        return 0.0;
    }
    let ring = (n - 1.0) * gl.latency;
    if !gl.inter_node {
        return ring;
    }
    let g = gl.ranks_per_node.max(1.0);
    if g <= 1.0 {
        return ring.min(n.log2().ceil() * gl.latency);
    }
    let nodes = (n / g).ceil();
    nodes * gl.latency + (n - nodes) * gl.intra_latency
}

/// All-gather: same cost as reduce-scatter (Thakur et al. 2005).
pub fn all_gather_time(gl: GroupLink, bytes: f64) -> f64 {
    reduce_scatter_time(gl, bytes)
}

/// All-to-all where each rank holds `bytes` and keeps 1/n: pairwise exchange `(n−1)·α + (n−1)/n · S/β` inside a
/// node. Across nodes the (n−g)/n of the data bound for other nodes leaves through this GPU's NIC share while the
/// (g−1)/n for node-mates takes the intra-node link: `(n−1)·α + max((n−g)/n·S/β_nic, (g−1)/n·S/β_intra)`.
pub fn all_to_all_time(gl: GroupLink, bytes: f64) -> f64 {
    if !gl.inter_node {
        return reduce_scatter_time(gl, bytes);
    }
    let (n, g) = (gl.n, gl.ranks_per_node);
    if n <= 1.0 || bytes <= 0.0 {
        return 0.0;
    }
    (n - 1.0) * gl.latency + ((n - g) / n * bytes / gl.nic_bw).max((g - 1.0) / n * bytes / gl.intra_bw)
}

/// Point-to-point send of `bytes`: `α + S/β`.
pub fn p2p_time(gl: GroupLink, bytes: f64) -> f64 {
    if bytes <= 0.0 {
        return 0.0;
    }
    gl.latency + bytes / gl.bw
}

// ---------------------------------------------------------------------------------------------------------------
// Iteration time
// ---------------------------------------------------------------------------------------------------------------

/// Times of one micro-batch's forward+backward on one device, by kind (seconds).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct DeviceTime {
    pub gemm: f64,
    pub attention: f64,
    pub elementwise: f64,
    pub recompute: f64,
    pub tp_comm: f64,
    pub cp_comm: f64,
    pub ep_comm: f64,
    pub pp_p2p: f64,
    /// Backward part (for the DP overlap window).
    pub backward: f64,
}

impl DeviceTime {
    pub fn total(&self) -> f64 {
        self.gemm
            + self.attention
            + self.elementwise
            + self.recompute
            + self.tp_comm
            + self.cp_comm
            + self.ep_comm
            + self.pp_p2p
    }
}

/// Forward pieces of one layer for one micro-batch on one GPU.
#[derive(Clone, Copy, Debug, Default)]
struct LayerFwd {
    gemm: f64,
    attn: f64,
    attn_elem: f64,
    elem: f64,
    tp: f64,
    cp: f64,
    ep: f64,
    // Backward pieces.
    gemm_b: f64,
    attn_b: f64,
    attn_elem_b: f64,
    elem_b: f64,
    tp_b: f64,
    cp_b: f64,
    ep_b: f64,
}

/// Forward and backward of one layer, one micro-batch, one GPU.
fn layer_time(m: &ModelShape, cl: &Cluster, l: &Layout, moe: bool) -> LayerFwd {
    let pr = l.precision;
    let e = pr.act_bytes();
    let t = l.tp as f64;
    let s_loc = (l.seq / l.cp) as f64;
    let b = l.micro_batch as f64;
    let tok = b * s_loc; // M of every weight GEMM
    let h = m.hidden as f64;
    let (qd, kvd) = (m.q_dim() as f64, m.kv_dim() as f64);
    let mut r = LayerFwd::default();

    // Weight GEMMs. Forward [M,N,K]; backward: data gradient [M,K,N] and weight gradient [K,N,M]
    // (Narayanan et al. §5.1: backward = 2 × forward FLOPs).
    // FP8 (Transformer Engine / torchao Float8 with per-tensor scaling): each FP8 GEMM's operands are cast from
    // bf16 first (read 2 bytes, write 1, plus the amax reduction over the same tensor): the input and the weight in
    // forward, the output gradient in backward. Memory-bound kernels, counted at the streaming rate with one launch
    // each (Micikevicius et al. 2022 §4; TE's fused cast_transpose writes the transposed copy backward needs in the
    // same pass). The weights' FP8 copies are cast once per step and reused by every micro-batch (TE's
    // `is_first_microbatch`, which Megatron-Core passes), so they are not charged per micro-batch.
    let fp8_cast = |elems: f64| if pr == Precision::Fp8 { stream_time(cl, 5.0 * elems, 1.0) } else { 0.0 };
    let mut gemm = |mm: f64, nn: f64, kk: f64, batch: f64, r: &mut LayerFwd| {
        r.elem += fp8_cast(batch * mm * kk);
        r.elem_b += fp8_cast(batch * mm * nn);
        r.gemm += gemm_time(cl, pr, mm, nn, kk, batch);
        // kiln's CPU Linear stores W as [N, K] and forms dW = doutᵀ·inp as an N×K×M product; the GPU model
        // counts the transposed K×N×M product (the same under its symmetric tile model up to tile shape).
        let wgrad = if cl.acc.gemm_curve.is_some() {
            gemm_time(cl, pr, nn, kk, mm, batch)
        } else {
            gemm_time(cl, pr, kk, nn, mm, batch)
        };
        r.gemm_b += gemm_time(cl, pr, mm, kk, nn, batch) + wgrad;
    };
    gemm(tok, (qd + 2.0 * kvd) / t, h, 1.0, &mut r); // QKV (column parallel)
    gemm(tok, h, qd / t, 1.0, &mut r); // output projection (row parallel)
    let mats = m.mlp.matrices() as f64;
    let mlp_gemms =
        |f: f64, rows: f64, batch: f64, r: &mut LayerFwd, g: &mut dyn FnMut(f64, f64, f64, f64, &mut LayerFwd)| {
            g(rows, (mats - 1.0) * f / t, h, batch, r); // fc1 (and gate)
            g(rows, h, f / t, batch, r); // fc2
        };
    // Memory-bound bytes, forward and backward, counted kernel by kernel (read + write of 16-bit tensors).
    let mut elem_bytes = 0.0;
    let mut elem_bytes_b = 0.0;
    let rep = if l.sequence_parallel { 1.0 / t } else { 1.0 };
    let x = tok * h; // elements of one sbh tensor
    let act_elems = |f: f64, rows: f64| rows * f / t;
    // (forward, backward) bytes of the MLP activation.
    let mlp_elem = |f: f64, rows: f64| match m.mlp {
        // Fused bias-GeLU: read and write the sbf/t tensor; backward reads input and gradient, writes gradient.
        Mlp::Gelu => (2.0 * e * act_elems(f, rows), 3.0 * e * act_elems(f, rows)),
        // SwiGLU: read gate and up, write product; backward reads gate, up, gradient, writes two gradients.
        Mlp::Swiglu => (3.0 * e * act_elems(f, rows), 5.0 * e * act_elems(f, rows)),
    };
    if moe {
        // Router GEMM [tok, E, h] (replicated over TP), then routed experts: each GPU holds E/ep experts and receives
        // on average tok·k·cf token copies in total (GShard/Switch capacity factor pads compute to capacity).
        let fe = m.expert_ffn_hidden as f64;
        gemm(tok, m.experts as f64, h, 1.0, &mut r);
        let local_experts = (m.experts / l.ep) as f64;
        let rows = tok * m.top_k as f64 * m.capacity_factor / local_experts;
        mlp_gemms(fe, rows, local_experts, &mut r, &mut gemm);
        if m.shared_experts > 0 {
            mlp_gemms(fe * m.shared_experts as f64, tok, 1.0, &mut r, &mut gemm);
        }
        let copies = tok * m.top_k as f64 * m.capacity_factor;
        let (f1, b1) = mlp_elem(fe, copies);
        let (f2, b2) = mlp_elem(fe * m.shared_experts as f64, tok);
        // Permute and unpermute token copies (read + write each), the same again in backward.
        let perm = 4.0 * e * copies * h * rep;
        elem_bytes += f1 + f2 + perm;
        elem_bytes_b += b1 + b2 + perm;
        // Expert-parallel all-to-all: dispatch and combine, each tok·k·h elements per GPU (Lepikhin et al. 2020).
        if l.ep > 1 {
            let gl = group_link(cl, l.ep, l.tp);
            let bytes = e * copies * h * rep;
            r.ep = 2.0 * all_to_all_time(gl, bytes);
            r.ep_b = r.ep;
        }
    } else {
        mlp_gemms(m.ffn_hidden as f64, tok, 1.0, &mut r, &mut gemm);
        let (f1, b1) = mlp_elem(m.ffn_hidden as f64, tok);
        elem_bytes += f1;
        elem_bytes_b += b1;
    }

    attention_core(m, cl, l, &mut r);
    // Rotary embeddings on Q and K (RoPE models): read + write.
    if !m.learned_pos_emb {
        elem_bytes += 2.0 * e * tok * (qd + kvd) / t;
        elem_bytes_b += 2.0 * e * tok * (qd + kvd) / t;
    }
    // Per layer, replicated over TP unless SP: two norms (read + write), two residual adds with bias and dropout
    // (read branch and residual, write sum, write 1-byte mask).
    // Backward: each norm reads input and gradient and writes a gradient (3e); each dropout-add reads the gradient
    // and mask and writes one (2e + 1); the residual stream adds the norm's input gradient (read 2, write 1: 3e).
    let mask = if m.dropout { 1.0 } else { 0.0 };
    elem_bytes += (2.0 * 2.0 * e + 2.0 * (3.0 * e + mask)) * x * rep;
    elem_bytes_b += (2.0 * 3.0 * e + 2.0 * (2.0 * e + mask) + 2.0 * 3.0 * e) * x * rep;
    r.elem += elem_time(cl, elem_bytes, 8.0);
    r.elem_b += elem_time(cl, elem_bytes_b, 12.0);

    layer_comm(m, cl, l, moe, &mut r);
    r
}

/// The attention core's forward and backward time, one layer, one micro-batch, one GPU
/// (`r.attn*`).
fn attention_core(m: &ModelShape, cl: &Cluster, l: &Layout, r: &mut LayerFwd) {
    let e = l.precision.act_bytes();
    let (s_loc, s_kv) = ((l.seq / l.cp) as f64, l.seq as f64);
    // q·k's head width, and the values' (narrower under MLA).
    let (d, dv) = (m.head_dim as f64, m.v_head_dim() as f64);
    // Attention core. Under FP8 training only the linear layers' GEMMs run in FP8: Transformer Engine's recipe
    // (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; TE `fp8_autocast` covers Linear /
    // LayerNormLinear / LayerNormMLP, and its DotProductAttention stays bf16 unless `fp8_dpa` is set, which NeMo
    // 24.07 and torchtitan's Float8 do not), so the attention core runs at the bf16 rate.
    let pr = if l.precision == Precision::Fp8 { Precision::Bf16 } else { l.precision };
    let batch = l.micro_batch as f64 * m.heads as f64 / l.tp as f64;
    let s2 = batch * s_loc * s_kv; // elements of one score tensor
    match l.attention {
        Attention::Unfused => {
            // Megatron: baddbmm QKᵀ [s, s, d] and bmm AV [s, d, s]; backward: 2 of each shape.
            let qk = attn_gemm_time(cl, pr, s_loc, s_kv, d, batch);
            let av = attn_gemm_time(cl, pr, s_loc, dv, s_kv, batch);
            r.attn = qk + av;
            r.attn_b = attn_gemm_time(cl, pr, s_loc, d, s_kv, batch) * 2.0 + attn_gemm_time(cl, pr, s_kv, d, s_loc, batch) + qk;
            // Fused scale-mask-softmax (read + write the scores) and attention dropout (read, write, 1-byte mask).
            let mask = if m.dropout { 1.0 } else { 0.0 };
            let drop = if m.dropout { 2.0 * e } else { 0.0 };
            r.attn_elem = elem_time(cl, (2.0 * e + drop + mask) * s2, 2.0);
            // Backward: softmax backward reads probs and grad, writes grad; dropout backward reads grad and mask.
            r.attn_elem_b = elem_time(cl, (3.0 * e + drop + mask) * s2, 2.0);
        }
        Attention::Flash => match cl.acc.attention_curve {
            // kiln's CPU kernel (`tensor::flash`, FlashAttention-2 style): 64 × 64 tiles, one single-threaded
            // product per tile, tiles above the causal diagonal skipped, the diagonal ones computed in full
            // ((n+1)/(2n) of the n² tiles). Forward S = Q·Kᵀ and O += P·V per tile; backward recomputes S and forms
            // dP = dO·Vᵀ ([br, bc, HS] shape) and dV, dK, dQ ([br, HS, bc]), each at the measured curve at the tile
            // shape. The tile's exp (forward, and again in backward) is counted as the softmax bytes it replaces:
            // read + write the computed scores at the elementwise rate.
            Some(curve) if cl.acc.gemm_curve.is_some() => {
                let tile = 64f64.min(s_kv);
                let n = (s_kv / tile).ceil();
                let computed = batch * s_loc * s_kv * (n + 1.0) / (2.0 * n); // score elements actually formed
                let peak = cl.acc.peak(pr).unwrap_or(f64::MIN_POSITIVE);
                let st = 2.0 * computed * d / (peak * curve.efficiency(tile, tile, d)); // one S-shaped product
                let pv = 2.0 * computed * dv / (peak * curve.efficiency(tile, dv, tile)); // one PV-shaped product
                let ovh = cl.acc.kernel_overhead;
                r.attn = st + pv + ovh;
                r.attn_b = 2.0 * st + 3.0 * pv + ovh;
                r.attn_elem = elem_time(cl, 2.0 * e * computed, 0.0);
                r.attn_elem_b = elem_time(cl, 2.0 * e * computed, 0.0);
            }
            _ => {
                // FlashAttention-2 (Dao 2023): forward 2 matmuls, backward 5 (recomputes S); causal masking skips half.
                let causal = 0.5;
                let mm = attn_gemm_time(cl, pr, s_loc, s_kv, (d + dv) / 2.0, batch) - cl.acc.kernel_overhead;
                r.attn = 2.0 * mm * causal + cl.acc.kernel_overhead;
                r.attn_b = 5.0 * mm * causal + cl.acc.kernel_overhead;
            }
        },
    }
}

/// Tensor and context parallelism's exchanges, one layer, one micro-batch (`r.tp*`, `r.cp*`;
/// the attention core's times already in `r`, which the ring overlaps).
fn layer_comm(m: &ModelShape, cl: &Cluster, l: &Layout, moe: bool, r: &mut LayerFwd) {
    let (e, t) = (l.precision.act_bytes(), l.tp as f64);
    // The weight-gradient GEMMs a TP collective can hide under run at the bf16 rate under FP8
    // training as the attention core does.
    let pr = if l.precision == Precision::Fp8 { Precision::Bf16 } else { l.precision };
    let tok = l.micro_batch as f64 * (l.seq / l.cp) as f64;
    let (h, qd, kvd) = (m.hidden as f64, m.q_dim() as f64, m.kv_dim() as f64);
    let mats = m.mlp.matrices() as f64;
    let x = tok * h;
    // Tensor parallelism (Shoeybi et al. 2019): 2 all-reduces of the sbh activation in forward, 2 in backward;
    // with SP each becomes a reduce-scatter + all-gather pair of the same volume (Korthikanti §4.2.2).
    // Megatron-LM 2021 does not overlap them with compute: exposed. With `overlap_comm` (Megatron's asynchronous
    // TP all-reduce / SP reduce-scatter, since late 2021) the backward collective of each column-parallel layer's
    // input gradient (QKV, fc1) runs under that layer's weight-gradient GEMM; only the excess is exposed.
    if l.tp > 1 {
        let gl = group_link(cl, l.tp, 1);
        let bytes = e * x;
        let one = if l.sequence_parallel {
            reduce_scatter_time(gl, bytes) + all_gather_time(gl, bytes)
        } else {
            all_reduce_time(gl, bytes)
        };
        r.tp = 2.0 * one;
        r.tp_b = 2.0 * one;
        if l.overlap_comm {
            let wgrad_qkv = gemm_time(cl, pr, h, (qd + 2.0 * kvd) / t, tok, 1.0);
            let wgrad_fc1 = if moe {
                0.0
            } else {
                gemm_time(cl, pr, h, (mats - 1.0) * m.ffn_hidden as f64 / t, tok, 1.0)
            };
            r.tp_b = (one - wgrad_qkv).max(0.0) + (one - wgrad_fc1).max(0.0);
        }
    }
    // Context parallelism (ring attention, Liu et al. 2023; Megatron CP): K and V blocks travel the ring,
    // (cp−1) steps of 2·e·b·(s/cp)·kv·d/t bytes, overlapped with the attention blocks; backward also sends dK, dV.
    // Ulysses (Jacobs et al. 2023): all-to-alls of q|k|v and of the output forward, of the output
    // gradient and dq|dk|dv backward, each rank holding its s/cp positions' share, on the critical path.
    if l.cp > 1 && l.cp_mode == crate::policy::CpMode::Ulysses {
        let gl = group_link(cl, l.cp, l.tp);
        let (qkv, out) = (e * tok * (qd + 2.0 * kvd) / t, e * tok * qd / t);
        r.cp = all_to_all_time(gl, qkv) + all_to_all_time(gl, out);
        r.cp_b = r.cp;
    } else if l.cp > 1 {
        let gl = p2p_link(group_link(cl, l.cp, l.tp));
        let step = 2.0 * e * tok * kvd / t;
        let comm = (l.cp as f64 - 1.0) * p2p_time(gl, step);
        r.cp = (comm - r.attn).max(0.0);
        r.cp_b = (2.0 * comm - r.attn_b).max(0.0);
    }
}

/// Output layer and loss, one micro-batch: logits GEMM [tok, V/t, h], vocab-parallel cross entropy in fp32
/// (Megatron: ≈ 5 passes over the fp32 logits forward, 5 backward), and TP's all-reduces of the loss statistics.
fn logits_time(m: &ModelShape, cl: &Cluster, l: &Layout) -> (f64, f64, f64) {
    // The output layer stays bf16 under FP8 training (TE recipe: only the transformer layers' linears are FP8).
    let pr = if l.precision == Precision::Fp8 { Precision::Bf16 } else { l.precision };
    let t = l.tp as f64;
    let tok = (l.micro_batch * l.seq / l.cp) as f64;
    let h = m.hidden as f64;
    let v = m.vocab as f64 / t;
    let (g, gb) = if cl.acc.gemm_curve.is_some() {
        // kiln's fused LM head + cross entropy on CPU (`tensor::classifier`) runs the three products over chunks
        // of R = clamp(2^23 / V, 1, tokens) rows so that one [R, V] block of fp32 logits (32 MB) is live at a time:
        // logits [R, V, h], input gradient [R, h, V], weight gradient [V, h, R]. Same FLOPs, smaller M and K.
        // The last chunk holds the remaining rows.
        let rows = ((8u64 << 20) as f64 / v).floor().clamp(1.0, tok);
        let full = (tok / rows).floor();
        let rest = tok - full * rows;
        let fwd = |r: f64| if r > 0.0 { gemm_time(cl, pr, r, v, h, 1.0) } else { 0.0 };
        let bwd = |r: f64| {
            if r > 0.0 {
                gemm_time(cl, pr, r, h, v, 1.0) + gemm_time(cl, pr, v, h, r, 1.0)
            } else {
                0.0
            }
        };
        (full * fwd(rows) + fwd(rest), full * bwd(rows) + bwd(rest))
    } else {
        (
            gemm_time(cl, pr, tok, v, h, 1.0),
            gemm_time(cl, pr, tok, h, v, 1.0) + gemm_time(cl, pr, h, v, tok, 1.0),
        )
    };
    let ce = elem_time(cl, 20.0 * tok * v, 6.0);
    let mut tp = 0.0;
    if l.tp > 1 {
        // Input of the output layer: one all-reduce (backward) of the sbh gradient; CE statistics: 3 tiny ones.
        let gl = group_link(cl, l.tp, 1);
        tp = all_reduce_time(gl, pr.act_bytes() * tok * h) + 3.0 * all_reduce_time(gl, 4.0 * tok);
    }
    (g + gb, ce, tp)
}

/// Everything one micro-batch costs on pipeline stage `stage` (all of its v chunks).
pub fn device_time(m: &ModelShape, cl: &Cluster, l: &Layout, stage: u64) -> DeviceTime {
    let mut d = DeviceTime::default();
    let mut n_dense = 0u64;
    let mut n_moe = 0u64;
    for i in stage_layers(m, l, stage) {
        if m.layer_is_moe(i) {
            n_moe += 1;
        } else {
            n_dense += 1;
        }
    }
    for (count, moe) in [(n_dense, false), (n_moe, true)] {
        if count == 0 {
            continue;
        }
        let lt = layer_time(m, cl, l, moe);
        let k = count as f64;
        d.gemm += k * (lt.gemm + lt.gemm_b);
        d.attention += k * (lt.attn + lt.attn_b);
        d.elementwise += k * (lt.elem + lt.elem_b + lt.attn_elem + lt.attn_elem_b);
        d.tp_comm += k * (lt.tp + lt.tp_b);
        d.cp_comm += k * (lt.cp + lt.cp_b);
        d.ep_comm += k * (lt.ep + lt.ep_b);
        d.backward += k * (lt.gemm_b + lt.attn_b + lt.elem_b + lt.attn_elem_b + lt.tp_b + lt.cp_b + lt.ep_b);
        // Recomputation (Chen et al. 2016; Korthikanti §5): full = the layer's forward again, with its TP
        // communication; selective = the attention core (QKᵀ, softmax, dropout, AV) again.
        d.recompute += k * match (l.recompute, l.attention) {
            (Recompute::Full, _) => lt.gemm + lt.attn + lt.attn_elem + lt.elem + lt.tp + lt.cp + lt.ep,
            (Recompute::Selective, Attention::Unfused) => lt.attn + lt.attn_elem,
            _ => 0.0,
        };
    }
    d.backward += d.recompute;
    if stage == l.pp - 1 {
        let (g, ce, tp) = logits_time(m, cl, l);
        d.gemm += g;
        d.elementwise += ce;
        d.tp_comm += tp;
        d.backward += g * 2.0 / 3.0 + ce / 2.0;
    }
    if stage == 0 {
        // Embedding lookup (+ position embedding add and dropout) and its gradient: memory-bound.
        let x = (l.micro_batch * l.seq / l.cp) as f64 * m.hidden as f64;
        d.elementwise += elem_time(cl, 6.0 * l.precision.act_bytes() * x, 4.0);
        if l.tp > 1 {
            d.tp_comm += all_reduce_time(group_link(cl, l.tp, 1), l.precision.act_bytes() * x);
        }
    }
    // Pipeline point-to-point (Narayanan et al. §4.1): each chunk sends its output activation forward and receives
    // the gradient back, b·s·h elements, ÷t with the scatter/gather optimisation (always on with TP here).
    // Megatron's batched send/recv blocks, so it is exposed: 2 transfers per chunk per micro-batch. With
    // `overlap_comm` the interleaved schedule posts them asynchronously under the next chunk's compute
    // (Megatron `--overlap-p2p-communication`): only the latency α remains.
    if l.pp > 1 {
        let gl = p2p_link(group_link(cl, l.pp, l.tp * l.cp * l.dp));
        let full = l.precision.act_bytes() * (l.micro_batch * l.seq / l.cp) as f64 * m.hidden as f64;
        if l.pp_blocking_p2p {
            d.pp_p2p = 4.0 * l.virtual_stages as f64 * p2p_time(gl, full);
        } else {
            let one = if l.overlap_comm && l.schedule == Kind::Interleaved {
                gl.latency
            } else {
                p2p_time(gl, full / l.tp as f64)
            };
            d.pp_p2p = 2.0 * l.virtual_stages as f64 * one;
        }
    }
    d
}

/// The layout of one of kiln's own CPU runs: one device, no parallelism, the whole batch in one micro-batch
/// (`grad_accum` 1), fp32, no recomputation, kiln's attention kernel (`Unfused`: it keeps the [B, NH, T, T]
/// probabilities; `Flash` for the FlashAttention-style kernel).
pub fn single_device_layout(batch: u64, seq: u64, attention: Attention) -> Layout {
    Layout {
        tp: 1,
        pp: 1,
        dp: 1,
        cp: 1,
        cp_mode: Default::default(),
        ep: 1,
        micro_batch: batch,
        global_batch: batch,
        seq,
        schedule: Kind::OneFOneB,
        virtual_stages: 1,
        recompute: Recompute::None,
        sequence_parallel: false,
        zero: 0,
        precision: Precision::Fp32,
        attention,
        overlap_dp: false,
        overlap_comm: false,
        fp32_grads: true,
        optimizer: Default::default(),
        optim_state: Default::default(),
        compression: Default::default(),
        powersgd_rank: 4,
        zeropp: false,
        pp_blocking_p2p: false,
    }
}

/// Everything about one iteration.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Breakdown {
    /// Per-iteration seconds on the critical (slowest) pipeline stage; these add up to `step_time_s`.
    pub compute_gemm_s: f64,
    pub compute_attention_s: f64,
    pub compute_elementwise_s: f64,
    pub recompute_s: f64,
    pub tp_comm_s: f64,
    pub cp_comm_s: f64,
    pub ep_comm_s: f64,
    pub pp_p2p_s: f64,
    pub pp_bubble_s: f64,
    pub dp_comm_exposed_s: f64,
    /// Compute slowed by the data-parallel traffic hidden under it ([`OVERLAP_CONTENTION`] × the hidden part).
    pub overlap_contention_s: f64,
    pub optimizer_s: f64,
    /// Not in the sum: data-parallel gradient traffic before overlap.
    pub dp_comm_total_s: f64,
    /// Bytes one GPU of the first stage sends per step in data-parallel synchronisation.
    pub dp_bytes_per_gpu: f64,
    /// Micro-batches per pipeline per iteration.
    pub micro_batches: u64,
    /// FLOPs the hardware executes per GPU per second (Narayanan Table 1 convention: counts recomputation).
    pub hardware_tflops_per_gpu: f64,
    pub memory: MemoryBreakdown,
}

#[derive(Clone, Debug, Serialize)]
pub struct Estimate {
    pub step_time_s: f64,
    pub model_tflops_per_gpu: f64,
    pub mfu: f64,
    pub memory_bytes_per_gpu: f64,
    pub fits: bool,
    pub breakdown: Breakdown,
    pub chosen: Layout,
}

/// Data-parallel gradient synchronisation of one stage (seconds, before overlap). ZeRO paper §7: stages 0–2 move
/// 2Ψ per step (all-reduce, or reduce-scatter + all-gather), stage 3 3Ψ (an extra parameter all-gather).
/// Gradients are reduced in their storage type (16-bit, or fp32 with `fp32_grads`). Dense parameters over DP×CP, experts over DP×CP/EP.
pub fn dp_comm_time(m: &ModelShape, cl: &Cluster, l: &Layout, stage: u64) -> f64 {
    let (dense, expert) = stage_params(m, l, stage);
    let gbytes = state_bytes_per_param(l.precision, l.fp32_grads).1;
    let stride = l.tp;
    let one = |psi: f64, n: u64| -> f64 {
        let gl = group_link(cl, n, stride);
        let bytes = gbytes * psi;
        match l.zero {
            // (No parameters of this kind, e.g. experts in a dense model: nothing to send.)
            _ if psi <= 0.0 => 0.0,
            // 1-bit Adam: an all-to-all of the signed chunks and an all-gather of the averaged
            // ones, each rank's buffer `n` messages of ⌈Ψ/n⌉/32 + 1 words.
            0 if l.compression == crate::policy::Compression::OnebitAdam => {
                let buf = onebit_buffer_bytes(psi, n);
                all_to_all_time(gl, buf) + all_gather_time(gl, buf)
            }
            // 0/1 Adam past its variance freeze: the same 1-bit exchange once every
            // `ZEROONE_SYNC_INTERVAL` steps (its steady state), local steps in between.
            0 if l.compression == crate::policy::Compression::ZerooneAdam => {
                let buf = onebit_buffer_bytes(psi, n);
                (all_to_all_time(gl, buf) + all_gather_time(gl, buf)) / ZEROONE_SYNC_INTERVAL
            }
            // PowerSGD: two all-reduces, the Ps with the uncompressed tensors, then the Qs.
            0 if l.compression == crate::policy::Compression::PowerSgd => {
                let (p, q) = powersgd_elements(m, l.seq, l.powersgd_rank);
                all_reduce_time(gl, 4.0 * p) + all_reduce_time(gl, 4.0 * q)
            }
            0 => all_reduce_time(gl, bytes),
            1 | 2 => reduce_scatter_time(gl, bytes) + all_gather_time(gl, bytes),
            // ZeRO++: the forward gather over every rank as int8, backward's inside the node
            // (hpZ), the gradients as two int4 all-to-alls, inside the node then across.
            _ if l.zeropp => {
                let z = zeropp_bytes(psi, n, cl.gpus_per_node);
                let (node, cross) = (group_link(cl, z.node, stride), group_link(cl, n / z.node, stride * z.node));
                all_gather_time(gl, z.gather) + all_gather_time(node, z.gather) + all_to_all_time(node, z.grad_node) + all_to_all_time(cross, z.grad_cross)
            }
            _ => reduce_scatter_time(gl, bytes) + 2.0 * all_gather_time(gl, bytes),
        }
    };
    one(dense, l.dp * l.cp) + one(expert, l.dp * l.cp / l.ep)
}

/// ZeRO++'s messages for `psi` parameters over `n` data-parallel ranks, `per_node` of them to a
/// node (`parallel::zeropp`: blocks of 64 with an fp32 scale each): the int8 shards every rank
/// gathers (`Ψ · 1.0625` bytes in all), and each rank's int4 gradient buffers, `Ψ · 0.5625`
/// inside the node and `1/G` of that across.
pub struct ZeroPpBytes {
    pub node: u64,
    pub gather: f64,
    pub grad_node: f64,
    pub grad_cross: f64,
}

pub fn zeropp_bytes(psi: f64, n: u64, per_node: u64) -> ZeroPpBytes {
    let node = per_node.clamp(1, n.max(1));
    let (q8, q4) = (1.0 + 4.0 / 64.0, 0.5 + 4.0 / 64.0);
    ZeroPpBytes { node, gather: q8 * psi, grad_node: q4 * psi, grad_cross: q4 * psi / node as f64 }
}

/// 1-bit Adam's per-rank message buffer for `psi` parameters over `n` ranks: `n` messages of
/// the chunk's signs (`⌈⌈Ψ/n⌉/32⌉` words, the chunk rounded up to whole words) and a scale
/// (`parallel::compress`).
/// Steps per 1-bit sync in 0/1 Adam's steady state: its largest interval, DeepSpeed's
/// `local_step_clipper` default and kiln's `parallel.zeroone.local_step_clipper`.
pub const ZEROONE_SYNC_INTERVAL: f64 = 16.0;

pub fn onebit_buffer_bytes(psi: f64, n: u64) -> f64 {
    let chunk = (psi / n as f64).ceil();
    n as f64 * ((chunk / 32.0).ceil() + 1.0) * 4.0
}

/// PowerSGD's elements all-reduced per step for a whole dense replica at rank `r`: the `P`s
/// (`rows·r`) with every tensor it does not compress, and the `Q`s (`cols·r`). A matrix is
/// compressed when `(rows + cols)·r < rows·cols` (`parallel::compress::PowerSgd`); the matrices
/// are the fused `W_qkv` (`(a + 2·kv)·d × h`), `W_o`, the MLP's, and the embeddings (`V × h`,
/// the position table, an untied head).
pub fn powersgd_elements(m: &ModelShape, seq: u64, r: u64) -> (f64, f64) {
    let (h, f) = (m.hidden, m.ffn_hidden);
    let (mut p, mut q, mut mats) = (0u64, 0u64, 0u64);
    let mut mat = |rows: u64, cols: u64| {
        mats += rows * cols;
        if (rows + cols) * r < rows * cols {
            (p, q) = (p + rows * r, q + cols * r);
        } else {
            p += rows * cols;
        }
    };
    for _ in 0..m.layers {
        mat(m.q_dim() + 2 * m.kv_dim(), h);
        mat(h, m.q_dim());
        for _ in 0..m.mlp.matrices() - 1 {
            mat(f, h);
        }
        mat(h, f);
    }
    mat(m.vocab, h);
    if m.learned_pos_emb {
        mat(seq, h);
    }
    if !m.tied_embeddings {
        mat(m.vocab, h);
    }
    let total = (0..m.layers).map(|i| m.layer_params(i)).sum::<u64>() + m.embedding_params(seq);
    // Biases and norms travel uncompressed with the Ps.
    ((p + total.saturating_sub(mats)) as f64, q as f64)
}

/// Bytes one rank sends per step in its data-parallel synchronisation of stage `stage`: a ring
/// all-reduce, or reduce-scatter + all-gather, `2(n−1)/n` of the gradient bytes (ZeRO-3 `3(n−1)/n`);
/// 1-bit Adam `2(n−1)/n` of its message buffer; ZeRO++ its int8 gathers (the backward's inside a
/// node of `per_node`) and int4 all-to-alls ([`zeropp_bytes`]).
pub fn dp_bytes_sent(m: &ModelShape, l: &Layout, stage: u64, per_node: u64) -> f64 {
    let (dense, expert) = stage_params(m, l, stage);
    let gbytes = state_bytes_per_param(l.precision, l.fp32_grads).1;
    let one = |psi: f64, n: u64| -> f64 {
        let f = (n as f64 - 1.0) / n as f64;
        match l.zero {
            _ if n <= 1 || psi <= 0.0 => 0.0,
            0 if l.compression == crate::policy::Compression::OnebitAdam => 2.0 * f * onebit_buffer_bytes(psi, n),
            0 if l.compression == crate::policy::Compression::ZerooneAdam => 2.0 * f * onebit_buffer_bytes(psi, n) / ZEROONE_SYNC_INTERVAL,
            0 if l.compression == crate::policy::Compression::PowerSgd => {
                let (p, q) = powersgd_elements(m, l.seq, l.powersgd_rank);
                2.0 * f * 4.0 * (p + q)
            }
            0..=2 => 2.0 * f * gbytes * psi,
            _ if l.zeropp => {
                let z = zeropp_bytes(psi, n, per_node);
                let (g, c) = (z.node as f64, (n / z.node) as f64);
                f * z.gather + (g - 1.0) / g * (z.gather + z.grad_node) + (c - 1.0) / c * z.grad_cross
            }
            _ => 3.0 * f * gbytes * psi,
        }
    };
    one(dense, l.dp * l.cp) + one(expert, l.dp * l.cp / l.ep)
}

/// The gradient reduce-scatter alone of one stage's data-parallel synchronisation (ZeRO-2's per-micro-batch
/// traffic).
fn dp_reduce_scatter_time(m: &ModelShape, cl: &Cluster, l: &Layout, stage: u64) -> f64 {
    let (dense, expert) = stage_params(m, l, stage);
    let gbytes = state_bytes_per_param(l.precision, l.fp32_grads).1;
    let one = |psi: f64, n: u64| reduce_scatter_time(group_link(cl, n, l.tp), gbytes * psi);
    one(dense, l.dp * l.cp) + one(expert, l.dp * l.cp / l.ep)
}

/// ZeRO's data-parallel traffic of stage `stage` by phase, and how much of it compute hides (seconds per step:
/// exposed, total). `d` is one micro-batch on that stage.
///
/// - Parameters are gathered in their 16-bit storage type (2 bytes; fp32 runs 4), gradients reduce-scattered in
///   theirs (ZeRO paper §5–7: stage 1/2 = reduce-scatter of gradients + all-gather of updated parameters, stage 3
///   adds a parameter all-gather before each unit's forward and again before its backward).
/// - Stages 1 and 2 reduce the last micro-batch's gradients under its backward (bucketed, Li et al. 2020) and
///   gather the updated parameters under the next step's first forward (Megatron-Core `--overlap-param-gather`,
///   FSDP SHARD_GRAD_OP's prefetch); stage 2 also reduce-scatters every earlier micro-batch's gradients as
///   backward releases them (DeepSpeed stage 2, kiln's `DataParallel`).
/// - Stage 3 (FSDP FULL_SHARD, DeepSpeed ZeRO-3; Zhao et al. 2023 §3.3) gathers every unit for every micro-batch's
///   forward and backward and reduce-scatters its gradients per micro-batch; prefetching overlaps unit i+1's
///   gather with unit i's compute, so per micro-batch `max(0, AG − forward) + max(0, AG + RS − backward)` is
///   exposed, plus the first unit's gather, which nothing precedes. When compute per micro-batch is small (few
///   tokens per GPU: a fixed global batch over more GPUs) the collectives, whose size does not shrink with the
///   batch, stop hiding: throughput falls with GPU count.
/// - Stages 2 and 3 communicate per wrapped unit, one transformer layer, not once per model: FSDP wraps each block
///   and issues one all-gather (and, in backward, one reduce-scatter) per unit (Zhao et al. 2023, VLDB, §3.2–3.3:
///   "FSDP units", one `FlatParameter` and one collective each; llm-foundry wraps every `MPTBlock`), DeepSpeed
///   ZeRO-3 gathers per submodule, and kiln's ZeRO-2 buffers are unit-sized. Each collective pays its own
///   latency ([`collective_latency`]: `(n/g)·α_net + (n − n/g)·α_NVLink` for a ring over nodes of g ranks), so a
///   step carries units × latency per phase: across 64 nodes about 3 ms per collective, which grows with the
///   ranks while the bandwidth term does not. (DeepSpeed ZeRO-2 reduces in 5·10⁸-element buckets, so for it
///   this overcounts the latency; no evaluated row runs it.)
/// - Without `overlap_dp` everything is exposed.
pub fn zero_exposure(m: &ModelShape, cl: &Cluster, l: &Layout, stage: u64, d: &DeviceTime) -> (f64, f64) {
    let (dense, expert) = stage_params(m, l, stage);
    let gbytes = state_bytes_per_param(l.precision, l.fp32_grads).1;
    let pbytes = l.precision.act_bytes();
    let units = if l.zero >= 2 { stage_layers(m, l, stage).len().max(1) as f64 } else { 1.0 };
    let coll = |psi: f64, n: u64, bytes_per: f64, rs: bool| -> f64 {
        if psi <= 0.0 {
            return 0.0;
        }
        let gl = group_link(cl, n, l.tp);
        let unit = bytes_per * psi / units;
        units * if rs { reduce_scatter_time(gl, unit) } else { all_gather_time(gl, unit) }
    };
    let (nd, ne) = (l.dp * l.cp, l.dp * l.cp / l.ep);
    let rs = coll(dense, nd, gbytes, true) + coll(expert, ne, gbytes, true);
    let ag = coll(dense, nd, pbytes, false) + coll(expert, ne, pbytes, false);
    let mb = l.micro_batches() as f64;
    let bwd = d.backward;
    let fwd = (d.total() - d.backward).max(0.0);
    let ov = l.overlap_dp;
    let hide = |comm: f64, window: f64| if ov { (comm - window).max(0.0) } else { comm };
    match l.zero {
        3 => {
            let per_mb = hide(ag, fwd) + hide(ag + rs, bwd);
            (mb * per_mb + if ov { ag / units } else { 0.0 }, mb * (2.0 * ag + rs))
        }
        2 if mb > 1.0 => {
            let earlier = hide((mb - 1.0) * rs, (mb - 1.0) * (fwd + bwd));
            (earlier + hide(rs, bwd) + hide(ag, fwd), mb * rs + ag)
        }
        _ => (hide(rs, bwd) + hide(ag, fwd), rs + ag),
    }
}

/// Seconds of compute lost per second of data-parallel collective running concurrently with it (the part of the DP /
/// ZeRO traffic the schedule hides). An overlapped collective is not free: NCCL runs each channel as a CUDA block
/// that stays resident on an SM for the whole collective, its latency-bound steps included, and streams its buffers
/// through the same HBM, so the GEMMs under it run on fewer SMs and less bandwidth (NCCL user guide,
/// `NCCL_MIN_NCHANNELS` / `NCCL_MAX_NCHANNELS`: fewer channels, fewer CUDA blocks taken from compute; Rashidi et al.
/// 2021, ISCA, "Enabling Compute-Communication Overlap in Distributed Deep Learning Training Platforms": overlapped
/// collectives slow the concurrent compute through SM and memory-bandwidth contention; the reason Megatron's
/// `--tp-comm-overlap` caps the SMs its communication may take). The order of magnitude is channels / SMs (16–32
/// blocks on 108–132 SMs: 0.12–0.3). Charged on DP / ZeRO traffic only (TP collectives are charged exposed; CP's
/// ring is not charged). With ZeRO-3's per-unit collectives across many nodes the hidden time, and so this charge,
/// grows with the ranks through the latency terms (llm-foundry's MPT at 128 → 512 H100s).
/// FITTED, once, for every accelerator: the argmin of the fit half's MAPE over 0..0.5 in steps of 0.025 (5.07 % at 0,
/// 4.75 % at 0.15–0.2, minimum 4.746 % at 0.175, 5.35 % at 0.5), with the per-unit ZeRO-2/3 collectives of
/// [`zero_exposure`] in place. `validate` prints the held-out half too, but the choice used the fit half only.
/// Re-swept after FP8's 1-byte linear inputs changed a fit row (2026-12-05): fit MAPE 4.17 % at 0, 3.85 % across
/// 0.15–0.225 (flat at two decimals), 4.45 % at 0.5, so the value stands.
pub const OVERLAP_CONTENTION: f64 = 0.175;

/// Predict one iteration of `l`. The layout must pass `check_layout`.
///
/// Pipeline: `T = (m + (p−1)/v) · T_dev` where `T_dev` is one micro-batch's forward+backward on the slowest
/// device (Narayanan et al. §2.2: bubble fraction (p−1)/m, ÷v when interleaved; the slowest stage paces the
/// pipeline, e.g. the last one, which also runs the output layer). Data-parallel gradient sync overlaps with the
/// backward of the last micro-batch (bucketed DDP, Li et al. 2020) and the rest is exposed; ZeRO-3 parameter
/// gathers of later micro-batches are prefetched behind compute. Then the optimizer step, memory-bound:
/// 28 bytes of traffic per local parameter for mixed-precision Adam (read master, m, v, 16-bit grad; write master,
/// m, v, 16-bit copy), 2 more with fp32 gradients.
pub fn estimate(m: &ModelShape, cl: &Cluster, l: &Layout) -> Estimate {
    let p = l.pp;
    // First (embeddings), second (first to get an extra layer when p ∤ L), middle, last (logits).
    let mut stages: Vec<u64> = vec![0, 1.min(p - 1), p / 2, p - 1];
    stages.dedup();
    let mut crit = DeviceTime::default();
    let mut crit_stage = 0;
    for &st in &stages {
        let d = device_time(m, cl, l, st);
        if d.total() > crit.total() {
            crit = d;
            crit_stage = st;
        }
    }
    let mb = l.micro_batches() as f64;
    let bubble_chunks = (p as f64 - 1.0) / l.virtual_stages as f64;
    let t_dev = crit.total();
    let pipe = (mb + bubble_chunks) * t_dev;
    let bubble = bubble_chunks * t_dev;

    // Data parallel on the first stage (finishes last) and on the critical one.
    let mut dp_total = stages.iter().map(|&st| dp_comm_time(m, cl, l, st)).fold(0.0, f64::max);
    let d0 = device_time(m, cl, l, 0);
    let phased = l.compression == crate::policy::Compression::None && !l.zeropp && l.zero >= 1;
    // 1-bit Adam communicates at the optimizer step, after backward: nothing hides it.
    let window = if l.overlap_dp && l.compression == crate::policy::Compression::None { d0.backward } else { 0.0 };
    // (PowerSGD too: its power iteration needs the whole accumulated gradient.)
    let mut dp_exposed = (dp_total - window).max(0.0);
    if phased {
        let (e, t) = stages.iter().map(|&st| zero_exposure(m, cl, l, st, &device_time(m, cl, l, st))).fold((0.0, 0.0), |a, b| (f64::max(a.0, b.0), f64::max(a.1, b.1)));
        dp_exposed = e;
        dp_total = t;
    }
    // With several micro-batches per step (accumulation, or a pipeline's), ZeRO-2 reduce-scatters each
    // micro-batch's gradients as backward releases them (its gradient buffers are unit-sized, so nothing
    // accumulates across micro-batches: DeepSpeed's stage 2, and kiln's `DataParallel`), and ZeRO-3 also
    // all-gathers every unit for each micro-batch's forward and backward (FSDP with a pipeline): the earlier
    // micro-batches' traffic is hidden behind their compute where it fits, the rest exposed.
    if !phased && l.zero >= 2 && mb > 1.0 {
        let per_mb = if l.zero == 3 { dp_total } else { stages.iter().map(|&st| dp_reduce_scatter_time(m, cl, l, st)).fold(0.0, f64::max) } * (mb - 1.0);
        dp_exposed += (per_mb - (mb - 1.0) * t_dev).max(0.0);
    }
    // Hidden is not free: the overlapped part of the traffic slows the compute it runs under.
    let contention = OVERLAP_CONTENTION * (dp_total - dp_exposed).max(0.0);
    let mem = memory(m, cl, l);
    let (dense0, expert0) = stage_params(m, l, crit_stage.min(p - 1));
    let opt_params = if l.zero >= 1 {
        dense0 / (l.dp * l.cp) as f64 + expert0 / (l.dp * l.cp / l.ep) as f64
    } else {
        dense0 + expert0
    };
    let opt_bytes = match l.precision {
        // fp32 AdamW (kiln on CPU, PyTorch's fused AdamW): read w, g, m, v (16 B), write w, m, v (12 B); plus the
        // global-norm pass for clipping (read g, 4 B) and zeroing the gradient buffer for the next step (write g,
        // 4 B), both over the same flat buffer.
        Precision::Fp32 => 28.0 + 8.0,
        _ => 26.0 + state_bytes_per_param(l.precision, l.fp32_grads).1,
    };
    // The optimizer's own traffic beyond AdamW's: Lion reads and writes one moment (8 B less than AdamW's two),
    // 8-bit and bf16 AdamW state move a quarter and a half of the moments' bytes; Muon orthogonalises each matrix
    // (its FLOPs spread over the ranks that share the stage's matrices, at the precision's matmul rate, as one
    // mid-sized product: an assumption of this planner).
    let state_saving = match (l.optimizer, l.optim_state) {
        (crate::policy::OptimName::Lion, _) => 8.0,
        (crate::policy::OptimName::AdamW, crate::policy::StateForm::Bf16) => 8.0,
        (crate::policy::OptimName::AdamW, crate::policy::StateForm::Int8) => 12.0,
        (crate::policy::OptimName::Adafactor, _) => 12.0,
        _ => 0.0,
    };
    let mut optimizer = stream_time(cl, (opt_bytes - state_saving).max(8.0) * opt_params, 4.0);
    if l.optimizer == crate::policy::OptimName::Muon {
        let ranks = (l.tp * if l.zero >= 1 { l.dp * l.cp } else { 1 }) as f64;
        let flops = muon_flops(m) / l.pp as f64 / ranks;
        let h = m.hidden as f64;
        optimizer += flops / (2.0 * h * h * h) * gemm_time(cl, l.precision, h, h, h, 1.0);
    }
    let step = pipe + dp_exposed + contention + optimizer;

    let n = cl.gpus as f64;
    let mf = model_flops(m, l.global_batch, l.seq);
    let hf = hardware_flops(m, l.global_batch, l.seq, l.recompute);
    let peak = cl.acc.peak(l.precision).unwrap_or(f64::NAN);
    let usable = cl.acc.mem_bytes;
    Estimate {
        step_time_s: step,
        model_tflops_per_gpu: mf / step / n / 1e12,
        mfu: mf / step / n / peak,
        memory_bytes_per_gpu: mem.total,
        fits: mem.total <= usable,
        breakdown: Breakdown {
            compute_gemm_s: mb * crit.gemm,
            compute_attention_s: mb * crit.attention,
            compute_elementwise_s: mb * crit.elementwise,
            recompute_s: mb * crit.recompute,
            tp_comm_s: mb * crit.tp_comm,
            cp_comm_s: mb * crit.cp_comm,
            ep_comm_s: mb * crit.ep_comm,
            pp_p2p_s: mb * crit.pp_p2p,
            pp_bubble_s: bubble,
            dp_comm_exposed_s: dp_exposed,
            overlap_contention_s: contention,
            optimizer_s: optimizer,
            dp_comm_total_s: dp_total,
            dp_bytes_per_gpu: dp_bytes_sent(m, l, 0, cl.gpus_per_node),
            micro_batches: l.micro_batches(),
            hardware_tflops_per_gpu: hf / step / n / 1e12,
            memory: mem,
        },
        chosen: l.clone(),
    }
}
