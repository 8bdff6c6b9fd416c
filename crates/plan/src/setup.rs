//! The software setup an estimate assumes: arithmetic precision, attention kernel, which communication overlaps,
//! gradient storage, and the stack's usual ZeRO stage / recomputation. `kiln plan estimate --setup NAME` and a
//! catalogue row's `setup` column take the same presets, and individual flags (columns) override them, so an
//! estimate and a validation of the same run assume the same software and both say so.
//!
//! Presets (each field's source in the preset's doc line):
//! - `kiln`: what kiln's own runtime does (bf16 where the accelerator has it, flash attention where it has it,
//!   DP and TP/p2p overlap on, fp32 gradients); ZeRO stage and recomputation searched. The default.
//! - `megatron-2021`: Megatron-LM as in Narayanan et al. 2021 (SC21): fp16 with its `Float16Optimizer`, unfused
//!   softmax attention, gradients all-reduced after the backward pass, TP/p2p not overlapped, full recomputation.
//! - `megatron-2022`: Megatron-LM of 2022 (Korthikanti et al. 2022): unfused attention, asynchronous TP all-reduce
//!   in backward (overlap_comm), gradient reduction after backward, fp32 `main_grad`.
//! - `megatron-deepspeed`: `megatron-2022` with DeepSpeed's pipeline engine (Smith et al. 2022 MT-NLG; BLOOM's
//!   Megatron-DeepSpeed): blocking p2p of the full activation (`Layout::pp_blocking_p2p`).
//! - `megatron-2023`: Megatron-LM 2023 (FlashAttention, `--overlap-grad-reduce`, distributed optimizer = ZeRO-1,
//!   sequence parallelism with TP), bf16.
//! - `megatron-2024`: Megatron-Core r0.6+ / NeMo / Megatron-Bridge (README "Performance Benchmarking": Transformer
//!   Engine fused attention, `--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap`, distributed
//!   optimizer), bf16 unless the run says fp8.
//! - `deepspeed-zero`: DeepSpeed ZeRO-3 (Rajbhandari et al. 2020; `overlap_comm: true` in its configs), fp16,
//!   unfused attention (the ZeRO / ZeRO++ evaluations' Megatron-style GPT).
//! - `fsdp`: PyTorch FSDP FULL_SHARD (Zhao et al. 2023, VLDB) with backward prefetch, bf16 gradients
//!   (`reduce_dtype` bf16 in llm-foundry's PURE/DEFAULT modes), flash attention.

use serde::Serialize;

use crate::cost::Attention;
use crate::hardware::Accelerator;
use crate::policy::{Precision, Recompute};
use crate::PlanError;

/// One software setup. `None` fields are left to the search (or to the row / flags).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Setup {
    pub name: String,
    pub precision: Option<Precision>,
    pub attention: Option<Attention>,
    pub overlap_dp: bool,
    pub overlap_comm: bool,
    pub fp32_grads: bool,
    pub zero: Option<u8>,
    pub recompute: Option<Recompute>,
    pub sequence_parallel: Option<bool>,
    /// Interleaved pipeline chunks of unequal layer counts (Megatron-Core, Llama 3's stack, torchtitan), so
    /// stages × virtual stages need not divide the layers.
    pub uneven_pipeline: bool,
    /// Pipeline p2p as DeepSpeed's pipeline engine does it: blocking, the full activation per TP rank.
    pub pp_blocking_p2p: bool,
}

/// The preset names, in the order `--setup` lists them.
pub const PRESETS: [&str; 8] =
    ["kiln", "megatron-2021", "megatron-2022", "megatron-deepspeed", "megatron-2023", "megatron-2024", "deepspeed-zero", "fsdp"];

impl Setup {
    pub fn preset(name: &str) -> Result<Setup, PlanError> {
        let uneven_pipeline = matches!(name, "megatron-2024" | "fsdp");
        let pp_blocking_p2p = name == "megatron-deepspeed";
        let s = |precision, attention, overlap_dp, overlap_comm, fp32_grads, zero, recompute, sequence_parallel| Setup {
            name: name.to_string(),
            precision,
            attention,
            overlap_dp,
            overlap_comm,
            fp32_grads,
            zero,
            recompute,
            sequence_parallel,
            uneven_pipeline,
            pp_blocking_p2p,
        };
        use Attention::*;
        use Precision::*;
        Ok(match name {
            "kiln" => s(None, None, true, true, true, None, None, None),
            "megatron-2021" => s(Some(Fp16), Some(Unfused), false, false, false, Some(0), Some(Recompute::Full), Some(false)),
            "megatron-2022" | "megatron-deepspeed" => s(Some(Fp16), Some(Unfused), false, true, true, None, None, None),
            "megatron-2023" => s(Some(Bf16), Some(Flash), true, true, true, Some(1), None, None),
            "megatron-2024" => s(Some(Bf16), Some(Flash), true, true, true, Some(1), None, None),
            "deepspeed-zero" => s(Some(Fp16), Some(Unfused), true, true, false, Some(3), None, None),
            "fsdp" => s(Some(Bf16), Some(Flash), true, true, false, Some(3), None, None),
            o => {
                return Err(PlanError(format!("--setup: unknown preset '{o}' (expected {})", PRESETS.join("|"))))
            }
        })
    }

    /// The precision this setup runs on `acc`: its own, else bf16 where the accelerator has a bf16 peak, else fp32.
    pub fn precision_on(&self, acc: &Accelerator) -> Precision {
        self.precision.unwrap_or(if acc.peak(Precision::Bf16).is_ok() { Precision::Bf16 } else { Precision::Fp32 })
    }

    /// The setup an estimate actually assumed: the preset's name and the chosen layout's software fields (explicit
    /// flags override a preset; the search fills what neither fixes).
    pub fn of_layout(base: &Setup, l: &crate::cost::Layout) -> Setup {
        Setup {
            name: base.name.clone(),
            precision: Some(l.precision),
            attention: Some(l.attention),
            overlap_dp: l.overlap_dp,
            overlap_comm: l.overlap_comm,
            fp32_grads: l.fp32_grads,
            zero: Some(l.zero),
            recompute: Some(l.recompute),
            sequence_parallel: Some(l.sequence_parallel),
            uneven_pipeline: base.uneven_pipeline,
            pp_blocking_p2p: l.pp_blocking_p2p,
        }
    }

    /// One line for `kiln plan estimate`.
    pub fn describe(&self) -> String {
        let opt = |o: Option<String>| o.unwrap_or_else(|| "searched".into());
        format!(
            "{}: precision {}, attention {}, DP overlap {}, TP/p2p overlap {}, {} gradients, ZeRO {}, recompute {}, {} pipeline chunks, {} pipeline p2p",
            self.name,
            opt(self.precision.map(|p| crate::policy::Names::name(p).to_string())),
            opt(self.attention.map(|a| format!("{a:?}").to_lowercase())),
            if self.overlap_dp { "on" } else { "off" },
            if self.overlap_comm { "on" } else { "off" },
            if self.fp32_grads { "fp32" } else { "16-bit" },
            opt(self.zero.map(|z| z.to_string())),
            opt(self.recompute.map(|r| crate::policy::Names::name(r).to_string())),
            if self.uneven_pipeline { "uneven" } else { "equal" },
            if self.pp_blocking_p2p { "DeepSpeed blocking" } else { "Megatron" },
        )
    }
}
