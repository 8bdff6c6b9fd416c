//! The training policies every crate names: the storage [`Precision`], activation [`Recompute`] and (in
//! [`crate::schedule`]) the pipeline schedule [`Kind`](crate::schedule::Kind). One definition each, shared by the
//! planner, `parallel`, `model` (which re-exports them) and `kiln`'s config, with one table of spellings per
//! enum ([`Names`]), so a flag, a config key and a validation table accept the same words.

use serde::{Deserialize, Serialize};

/// A value's accepted spellings, any case; the first spelling of each value is its name.
pub trait Names: Copy + PartialEq + 'static {
    const NAMES: &'static [(&'static str, Self)];

    /// The value `s` spells (ASCII case-insensitive).
    fn from_name(s: &str) -> Option<Self> {
        Self::NAMES.iter().find(|(n, _)| n.eq_ignore_ascii_case(s)).map(|&(_, v)| v)
    }

    /// [`Names::from_name`], or an error that lists the accepted names and the value, to follow the flag or
    /// key the caller puts first: "must be a, b or c, got `x`".
    fn parse(s: &str) -> Result<Self, String> {
        Self::from_name(s).ok_or_else(|| format!("must be {}, got `{s}`", Self::expected()))
    }

    /// The canonical spelling, which [`Names::from_name`] reads back.
    fn name(self) -> &'static str {
        Self::NAMES.iter().find(|(_, v)| *v == self).map(|&(n, _)| n).expect("every value has a name")
    }

    /// The canonical spellings as a list for an error message: "a, b or c".
    fn expected() -> String {
        let mut names: Vec<String> = Vec::new();
        for (i, &(n, v)) in Self::NAMES.iter().enumerate() {
            if Self::NAMES[..i].iter().all(|&(_, w)| w != v) {
                names.push(n.to_string());
            }
        }
        match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => names.join(""),
        }
    }
}

/// Arithmetic precision of the matmuls and of stored weights, activations and their gradients. Training in a
/// 16-bit format keeps fp32 master weights, moments and weight-gradient accumulation; fp8 computes the block
/// matmuls in FP8 with delayed scaling and stores in bf16.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, PartialOrd, Ord, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Bf16,
    /// fp16 with loss scaling, Megatron-LM's `Float16Optimizer` (2021): its optimizer also keeps an fp32 copy of the
    /// gradients. Same tensor-core peak as bf16.
    Fp16,
    Fp8,
    #[default]
    Fp32,
}

impl Names for Precision {
    const NAMES: &'static [(&'static str, Precision)] =
        &[("fp32", Precision::Fp32), ("bf16", Precision::Bf16), ("fp16", Precision::Fp16), ("fp8", Precision::Fp8)];
}

impl Precision {
    /// Bytes of one activation element as stored between kernels (fp8 training keeps activations in bf16).
    pub fn act_bytes(self) -> f64 {
        match self {
            Precision::Fp32 => 4.0,
            _ => 2.0,
        }
    }
}

/// Activation recomputation ("gradient checkpointing"; Chen et al. 2016, "Training Deep Nets with Sublinear
/// Memory Cost"; Megatron-LM's `--recompute-granularity`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, PartialOrd, Ord, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Forward keeps every block's activations.
    #[default]
    None,
    /// Korthikanti et al.'s selective recomputation: forward keeps everything but the attention core's outputs;
    /// backward re-runs the attention core. Costs one attention forward per layer, no matmul.
    Selective,
    /// Forward keeps only each block's input; backward re-runs each block's forward from it, then differentiates
    /// it: one more forward per step.
    Full,
}

impl Names for Recompute {
    const NAMES: &'static [(&'static str, Recompute)] =
        &[("none", Recompute::None), ("selective", Recompute::Selective), ("full", Recompute::Full)];
}

/// How a LoRA run stores its frozen base weights (QLoRA, Dettmers et al. 2023): fp32 as trained,
/// 4-bit NormalFloat in blocks of 64 with double-quantized scales, or int8 per output channel.
/// Only the matrices of the blocks are quantized; embeddings, norms, biases and an untied head
/// stay fp32 (as QLoRA and bitsandbytes keep them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "lowercase")]
pub enum BaseQuant {
    #[default]
    None,
    Nf4,
    Int8,
}

impl Names for BaseQuant {
    const NAMES: &'static [(&'static str, BaseQuant)] = &[("none", BaseQuant::None), ("nf4", BaseQuant::Nf4), ("int8", BaseQuant::Int8)];
}

/// How context parallelism computes attention over a sequence split along its positions
/// (`parallel.cp_mode`): `Ring` passes key/value blocks around the cp group while each rank
/// accumulates its own queries' attention (Liu et al. 2023, ring attention; Megatron's
/// `p2p`); `Ulysses` exchanges the sequence split for a head split with an all-to-all before
/// attention and back after (Jacobs et al. 2023, DeepSpeed-Ulysses).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "lowercase")]
pub enum CpMode {
    #[default]
    Ring,
    Ulysses,
}

impl Names for CpMode {
    const NAMES: &'static [(&'static str, CpMode)] = &[("ring", CpMode::Ring), ("p2p", CpMode::Ring), ("ulysses", CpMode::Ulysses), ("a2a", CpMode::Ulysses)];
}

/// The optimizer (`optim.name` of a run, `--optimizer` of `kiln plan`): AdamW; Lion (one
/// moment); Muon (one momentum buffer for the hidden matrices, AdamW's two for the rest, and a
/// Newton–Schulz iteration per matrix each step); Adafactor (factored second moments: about no
/// state).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "lowercase")]
pub enum OptimName {
    #[default]
    AdamW,
    Lion,
    Muon,
    Adafactor,
}

impl Names for OptimName {
    const NAMES: &'static [(&'static str, OptimName)] = &[("adamw", OptimName::AdamW), ("lion", OptimName::Lion), ("muon", OptimName::Muon), ("adafactor", OptimName::Adafactor)];
}

/// AdamW's state (`optim.state`, `--optim-state`): fp32 moments; bf16 moments (and under bf16
/// weights no fp32 master copy: the weights update with stochastic rounding); or 8-bit moments,
/// block-wise with a scale per 256.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "lowercase")]
pub enum StateForm {
    #[default]
    Fp32,
    Bf16,
    Int8,
}

impl Names for StateForm {
    const NAMES: &'static [(&'static str, StateForm)] = &[("fp32", StateForm::Fp32), ("bf16", StateForm::Bf16), ("int8", StateForm::Int8), ("8bit", StateForm::Int8)];
}

/// Data-parallel communication compression (`parallel.compression`; `kiln plan --compression`):
/// `OnebitAdam` (Tang et al. 2021) averages the momentum as one sign bit per element with a
/// scale per chunk, at the optimizer step, instead of all-reducing the gradients; `PowerSgd`
/// (Vogels et al. 2019) all-reduces each gradient matrix as a rank-`r` factor pair;
/// `ZerooneAdam` (0/1 Adam, Lu et al. 2023) updates the variance at doubling intervals, sends
/// 1-bit gradients in between, then, its variance frozen, takes local steps and averages the
/// accumulated moves as 1 bit at intervals that double up to 16 steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Compression {
    #[default]
    None,
    OnebitAdam,
    #[serde(rename = "powersgd")]
    PowerSgd,
    #[serde(rename = "zero_one_adam")]
    ZerooneAdam,
}

impl Names for Compression {
    const NAMES: &'static [(&'static str, Compression)] = &[("none", Compression::None), ("onebit_adam", Compression::OnebitAdam), ("powersgd", Compression::PowerSgd), ("zero_one_adam", Compression::ZerooneAdam), ("zeroone_adam", Compression::ZerooneAdam)];
}

/// Which positions a context-parallel rank holds (`parallel.cp_balance`): `Zigzag` cuts the
/// sequence into `2·cp` chunks and gives rank `r` chunks `r` and `2·cp − 1 − r`, so every rank
/// does the same causal-attention work; `None` gives rank `r` the `r`-th of `cp` contiguous
/// chunks (the last rank then attends to the most keys).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "lowercase")]
pub enum CpBalance {
    #[default]
    Zigzag,
    None,
}

impl Names for CpBalance {
    const NAMES: &'static [(&'static str, CpBalance)] = &[("zigzag", CpBalance::Zigzag), ("none", CpBalance::None)];
}

/// Activation compression (`memory.activation_compression`; GACT, Liu et al. 2022; Mesa, Pan
/// et al. 2021): the activations a block keeps for backward are stored as 8- or 4-bit integers
/// per group of 64 with an fp32 scale, and expanded before backward (lossy: backward sees the
/// expanded values; the forward's own are exact).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "lowercase")]
pub enum ActCompression {
    #[default]
    None,
    Int8,
    Int4,
}

impl ActCompression {
    /// The codes' bits (None: not compressed).
    pub fn bits(self) -> Option<u32> {
        match self {
            ActCompression::None => None,
            ActCompression::Int8 => Some(8),
            ActCompression::Int4 => Some(4),
        }
    }
}

impl Names for ActCompression {
    const NAMES: &'static [(&'static str, ActCompression)] = &[("none", ActCompression::None), ("int8", ActCompression::Int8), ("int4", ActCompression::Int4)];
}

/// How compressed activations round (`memory.activation_rounding`): to the nearest code, or
/// stochastically (unbiased; deterministic from the step's seed), as GACT compares.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "lowercase")]
pub enum ActRounding {
    #[default]
    Nearest,
    Stochastic,
}

impl Names for ActRounding {
    const NAMES: &'static [(&'static str, ActRounding)] = &[("nearest", ActRounding::Nearest), ("stochastic", ActRounding::Stochastic)];
}
