//! Run configuration in two stages: a raw table of dotted keys (preset defaults, then a TOML
//! file, then `--set KEY=VALUE` overrides, each checked against the known keys and their
//! types), then a resolved, validated [`RunConfig`] (`RunConfig::resolve`). Errors name the key
//! and, for files, the path.

use crate::error::{user, Result};
use serde::{Deserialize, Serialize};
use plan::policy::Names;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// `gpt2` (LayerNorm, learned positions, GELU) or `llama` (RMSNorm, RoPE, SwiGLU, GQA).
    #[serde(with = "named")]
    pub arch: model::config::Arch,
    pub n_layer: usize,
    pub n_head: usize,
    /// Key/value heads for grouped-query attention (llama); 0 = n_head.
    pub n_kv_head: usize,
    pub n_embd: usize,
    /// MLP width; 0 = 4·n_embd (gpt2) or 8/3·n_embd rounded up to a multiple of 64 (llama).
    pub ffn_hidden: usize,
    pub rope_theta: f64,
    /// Rope scaling (llama arch): `none`, `linear` (positions over `rope_factor`), `llama3`
    /// (Llama 3.1: `rope_factor`, `rope_low_freq_factor`, `rope_high_freq_factor`,
    /// `rope_original_max_positions`) or `yarn` (`rope_factor`, `rope_original_max_positions`,
    /// `rope_beta_fast`, `rope_beta_slow`, `rope_attention_factor` (0: YaRN's `0.1·ln(factor) +
    /// 1`), `rope_truncate`) or `longrope` (Phi-3: `rope_short_factor`, `rope_long_factor`,
    /// `rope_original_max_positions`, `rope_attention_factor` (0: `sqrt(1 + ln(s)/ln(o))` with
    /// `s = block_size / o`, `o` the original positions)) or `dynamic` (dynamic NTK:
    /// `rope_factor`, `rope_original_max_positions` ≥ `block_size`: plain RoPE in every pass kiln
    /// runs). `--init-from` sets them from a Hugging Face config.
    #[serde(with = "named")]
    pub rope_scaling: RopeKind,
    pub rope_factor: f64,
    pub rope_low_freq_factor: f64,
    pub rope_high_freq_factor: f64,
    pub rope_original_max_positions: usize,
    pub rope_beta_fast: f64,
    pub rope_beta_slow: f64,
    pub rope_attention_factor: f64,
    pub rope_truncate: bool,
    /// LongRoPE's per-frequency factors (head width / 2 each): passes over at most
    /// `rope_original_max_positions` positions divide by the short ones, longer passes by the long.
    pub rope_short_factor: Vec<f64>,
    pub rope_long_factor: Vec<f64>,
    /// Biases on the q, k and v projections only (Qwen2; llama arch).
    pub qkv_bias: bool,
    /// Phi-3's Hugging Face form (one `qkv_proj`, one `gate_up_proj`) for import and export.
    pub fused_proj: bool,
    /// RMSNorm over each head of q and k before the rotary embedding (Qwen3; llama arch).
    pub qk_norm: bool,
    /// With `qk_norm`: each norm spans every head of q (of k) at once (OLMo 2).
    pub qk_norm_whole: bool,
    /// Where the block's norms sit (llama arch): `pre` (before each branch), `post` (after
    /// each branch, before the residual add: OLMo 2) or `sandwich` (both: Gemma 2 and 3).
    #[serde(with = "named")]
    pub block_norms: model::config::BlockNorms,
    /// The gated MLP's gate activation (llama arch): `silu` (SwiGLU) or `gelu_tanh` (GeGLU: Gemma).
    #[serde(with = "named")]
    pub gate_act: model::config::GateAct,
    /// RMSNorms scale by `1 + w` (Gemma).
    pub norm_offset: bool,
    /// Token embeddings multiplied by `√n_embd` (Gemma).
    pub embed_scale: bool,
    /// Attention logits scaled by `query_pre_attn_scalar^-½` (Gemma); 0 = the head size.
    pub query_pre_attn_scalar: usize,
    /// The rotary base of the sliding-window layers (Gemma 3's local layers); 0 = `rope_theta`.
    pub rope_local_theta: f64,
    /// Soft-capping of the attention logits and of the output logits, `z ↦ cap·tanh(z / cap)`
    /// (Gemma 2); 0 = none.
    pub attn_softcap: f64,
    pub final_softcap: f64,
    /// Multi-head latent attention (DeepSeek-V2/V3) when above 0: the key/value latent's width;
    /// `rotary_dim` is then the shared rotary key's width and `head_dim` q·k's head width.
    pub kv_lora_rank: usize,
    /// MLA's query latent width (0: one q projection), value head width, and whether the
    /// rotary dimensions are stored interleaved (transformers' `rope_interleave`).
    pub q_lora_rank: usize,
    pub v_head_dim: usize,
    pub rope_interleave: bool,
    /// Dimensions of each head the rotary embedding turns (a Hugging Face config's `head_dim ·
    /// partial_rotary_factor`, Phi-4-mini's 0.75); 0 = the whole head.
    pub rotary_dim: usize,
    /// The token whose embedding row the lookup gives no gradient (transformers'
    /// `padding_idx`, a Hugging Face config's `pad_token_id`; llama arch); -1 = none.
    pub pad_token_id: i64,
    /// Sliding-window attention (Mistral; llama arch): each position attends to itself and the
    /// `sliding_window - 1` before it; 0 = every earlier position.
    pub sliding_window: usize,
    /// Attention sinks under the sliding window (StreamingLLM): the first `attn_sinks`
    /// positions of each document stay visible to every later position; 0 = none.
    pub attn_sinks: usize,
    /// The layers the sliding window applies to (Hugging Face configs name them per layer:
    /// Qwen2's `max_window_layers`, `layer_types`); empty = every layer.
    pub window_layers: Vec<usize>,
    /// The layers without a rotary embedding (SmolLM3's NoPE layers); empty = none.
    pub nope_layers: Vec<usize>,
    /// Width of each attention head when it is not `n_embd / n_head` (llama arch, transformers'
    /// `head_dim`); 0 = `n_embd / n_head`.
    pub head_dim: usize,
    pub norm_eps: f64,
    pub block_size: usize,
    /// 0 = from the tokenizer (rounded up to a multiple of 64 above 256 tokens: 50257 → 50304).
    pub vocab_size: usize,
    /// The rows the loss is a softmax over: 0 = the tokenizer's vocabulary (the rows kiln pads
    /// the embedding with are never predicted); `--init-from` a Hugging Face model sets its
    /// whole vocabulary, the loss transformers computes.
    pub loss_vocab: usize,
    pub bias: bool,
    pub dropout: f64,
    pub tied_embeddings: bool,
    /// A Hugging Face GPT-2 directory to start from ("" = fresh initialisation). Its
    /// `config.json` fixes the shape keys above; its weights replace the initialisation.
    pub init_from: String,
    /// Mixture of experts (llama arch): routed experts per layer, 0 = dense MLP; `ffn_hidden`
    /// is then each expert's width.
    pub n_expert: usize,
    pub top_k: usize,
    /// Always-on shared experts (DeepSeekMoE).
    pub n_shared_expert: usize,
    /// Expert capacity factor; 0 = dropless.
    pub capacity_factor: f64,
    /// Weight of the Switch load-balancing loss.
    pub moe_aux_weight: f64,
    /// Weight of the ST-MoE router z-loss.
    pub moe_z_weight: f64,
    /// The router: `softmax` (Mixtral) or `sigmoid` (DeepSeek-V3: group-limited selection
    /// steered by a per-expert correction bias, without the Switch or z losses), its expert
    /// groups and the groups a token's experts come from, and the gates' factor after
    /// renormalising (`routed_scaling_factor`).
    #[serde(with = "named")]
    pub moe_router: model::config::MoeRouter,
    pub moe_groups: usize,
    pub moe_topk_groups: usize,
    pub moe_gate_scale: f64,
    /// The sigmoid router's auxiliary-loss-free balancing: each step every expert's correction
    /// bias moves by this much towards balance (DeepSeek-V3: 0.001); 0 = the bias stays as loaded.
    pub moe_bias_rate: f64,
    /// With experts: the layers before this one are dense MLPs of `dense_ffn_hidden`
    /// (DeepSeek-V3's `first_k_dense_replace` and `intermediate_size`); 0 = every layer routed.
    pub moe_first_layer: usize,
    pub dense_ffn_hidden: usize,
    /// Activation recomputation: `none`, `selective` (Korthikanti et al.: re-run the attention
    /// core) or `full` (keep block inputs only). Results are bit-identical to `none`.
    #[serde(with = "named")]
    pub recompute: model::Recompute,
    /// With `full`: recompute every k-th layer only (1 = all), keeping the others' activations.
    pub recompute_every: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainSection {
    /// Sequences per optimizer step (the global batch), split into `grad_accum` micro-batches.
    pub batch_size: usize,
    /// Tokens per training sequence, at most `model.block_size` (the model's positions); 0 =
    /// `model.block_size`, or for a model started with `--init-from` the smaller of its
    /// positions and 1024 (a base model's context can be 131072). The run's `config.toml`
    /// records the length used.
    pub seq_len: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    /// Length of the cosine decay from `lr` to `min_lr`; 0 = `max_steps`. Changing
    /// `max_steps` (e.g. `--max-steps`) does not change the schedule when this is set.
    pub lr_decay_steps: u64,
    pub max_steps: u64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global gradient-norm clip; 0 disables.
    pub grad_clip: f64,
    pub seed: u64,
    /// Worker threads; 0 = all cores.
    pub threads: usize,
    /// Progress/metrics line every this many steps.
    pub log_interval: u64,
    /// Storage precision: `fp32`, or mixed precision `bf16` / `fp16` (parameters, activations
    /// and activation gradients rounded to it, fp32 master weights, moments and weight-gradient
    /// accumulation). Stored activations are kept in 16 bits between forward and backward;
    /// bf16 matmuls run on BF16 instructions where the CPU has them (`kiln doctor`).
    #[serde(with = "named")]
    pub precision: model::Precision,
    /// fp16: the initial dynamic loss scale, and the overflow-free updates after which it doubles.
    pub loss_scale: f64,
    pub loss_scale_window: u64,
    /// fp8: steps of amax history behind each tensor's delayed scale.
    pub fp8_amax_history: usize,
    /// Append each step's global batch (its token windows, `train.seq_len + 1` ids each) to
    /// `RUN/batches.jsonl`, to replay the run elsewhere (`bench/compare_hf.py` does, in PyTorch).
    pub record_batches: bool,
    /// Where the step runs: `cpu`, or `vulkan` / `vulkan:N` (a GPU through Vulkan: `kiln doctor`
    /// lists them). A device run is one rank; what it does not run yet is refused by name.
    pub device: String,
    /// What the step minimises: `lm` (the mean next-token loss over the targets the data
    /// counts), a preference loss over pairs of completions (`dpo`, `ipo`, `simpo`: the
    /// `[preference]` keys), which reads `data.format = "preference"` rows, or `grpo`
    /// (reinforcement learning with verifiable rewards over sampled completions: the `[grpo]`
    /// keys), which reads `data.format = "prompt"` rows.
    #[serde(with = "named")]
    pub objective: Objective,
}

/// `train.objective`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Objective {
    #[default]
    Lm,
    Pairs(tensor::preference::PairLoss),
    Grpo,
}

impl Names for Objective {
    const NAMES: &'static [(&'static str, Objective)] = {
        use tensor::preference::PairLoss as P;
        &[("lm", Objective::Lm), ("dpo", Objective::Pairs(P::Dpo)), ("ipo", Objective::Pairs(P::Ipo)), ("simpo", Objective::Pairs(P::Simpo)), ("grpo", Objective::Grpo)]
    };
}

impl Objective {
    /// The preference loss, if the objective is one.
    pub fn pairs(self) -> Option<tensor::preference::PairLoss> {
        match self {
            Objective::Pairs(p) => Some(p),
            Objective::Lm | Objective::Grpo => None,
        }
    }
}

/// A preference objective's hyper-parameters (TRL's names).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PreferenceSection {
    /// `β`: DPO's and IPO's KL strength (TRL's default 0.1), SimPO's reward scale (its paper
    /// uses 2 to 2.5).
    pub beta: f64,
    /// cDPO's label smoothing `ε` (DPO and SimPO): the chance a pair's labels are flipped.
    pub label_smoothing: f64,
    /// SimPO's target reward margin `γ`.
    pub simpo_gamma: f64,
}

/// GRPO's keys (TRL's `GRPOConfig` names where it has them).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpoSection {
    /// Completions sampled per prompt (`G`); `train.batch_size` counts completions, so a step
    /// samples `batch_size / group` prompts.
    pub group: usize,
    /// The length cap of a completion, and how it is sampled.
    pub max_new_tokens: usize,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: usize,
    /// A completion ends at the model's EOS or once it contains one of these strings.
    pub stop: Vec<String>,
    /// Optimiser steps per batch of completions (`μ`: TRL's `num_iterations`).
    pub iterations: usize,
    /// The clip range of the policy ratio, below and above 1.
    pub epsilon: f64,
    pub epsilon_high: f64,
    /// The KL penalty's weight (0: no reference model is kept).
    pub beta: f64,
    /// `grpo` (advantages over the group's standard deviation, each completion's mean token
    /// loss) or `dr_grpo` (Liu et al. 2025: advantages unscaled, token losses summed over
    /// `max_new_tokens`).
    #[serde(with = "named")]
    pub loss: GrpoLoss,
    /// The rewards (`kiln::reward`: `exact`, `numeric:TOL`, `regex:P`, `format:P`, `command:C`)
    /// and their weights (empty: 1 each).
    pub rewards: Vec<String>,
    pub reward_weights: Vec<f64>,
    /// Where a completion's final answer is: the last match, its first group if it has one.
    pub answer_pattern: String,
    /// The prompt row's field holding its reference answer.
    pub answer_field: String,
    /// Held-out prompts each evaluation completes greedily (0: all).
    pub eval_prompts: usize,
}

/// `grpo.loss`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GrpoLoss {
    #[default]
    Grpo,
    DrGrpo,
}

impl Names for GrpoLoss {
    const NAMES: &'static [(&'static str, GrpoLoss)] = &[("grpo", GrpoLoss::Grpo), ("dr_grpo", GrpoLoss::DrGrpo)];
}

impl GrpoLoss {
    /// Whether advantages are divided by their group's standard deviation.
    pub fn scales_rewards(self) -> bool {
        self == GrpoLoss::Grpo
    }

    /// How a completion's token losses make its loss.
    pub fn aggregation(self) -> tensor::grpo::Aggregation {
        match self {
            GrpoLoss::Grpo => tensor::grpo::Aggregation::Sequence,
            GrpoLoss::DrGrpo => tensor::grpo::Aggregation::Constant,
        }
    }
}

impl Default for GrpoSection {
    fn default() -> Self {
        GrpoSection {
            group: 8, max_new_tokens: 64, temperature: 1.0, top_p: 1.0, top_k: 0, stop: vec![], iterations: 1, epsilon: 0.2, epsilon_high: 0.2, beta: 0.0,
            loss: GrpoLoss::Grpo, rewards: vec!["exact".into()], reward_weights: vec![], answer_pattern: r"(-?\d+(?:\.\d+)?)".into(), answer_field: "answer".into(), eval_prompts: 200,
        }
    }
}

impl Default for PreferenceSection {
    fn default() -> Self {
        PreferenceSection { beta: 0.1, label_smoothing: 0.0, simpo_gamma: 0.5 }
    }
}

impl RunConfig {
    /// The preference loss and its hyper-parameters, when `train.objective` is one.
    pub fn pair_cfg(&self) -> Option<tensor::preference::PairCfg> {
        let p = &self.preference;
        self.train.objective.pairs().map(|loss| tensor::preference::PairCfg { loss, beta: p.beta, label_smoothing: p.label_smoothing, gamma: p.simpo_gamma })
    }
}





#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalSection {
    /// Evaluate on the held-out split every this many steps (0 = only at the end).
    pub interval: u64,
    /// Batches of non-overlapping windows per evaluation (0 = the whole split).
    pub iters: usize,
    /// Sequences per evaluation batch (0 = the training micro-batch).
    pub batch_size: usize,
    /// Tokens per evaluation window (0 = train.seq_len). A validation split too short for a
    /// training window gets windows of what it holds, said at start.
    pub seq_len: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointSection {
    /// Save every this many steps (0 = only at the end).
    pub interval: u64,
    /// Valid checkpoints kept (older ones are removed after a newer one is safely written).
    pub keep: usize,
    /// Also keep every checkpoint whose step is a multiple of this (0 = none).
    pub keep_every: u64,
    /// Write checkpoints on a background thread while training continues.
    pub background: bool,
    /// Mean time between failures, seconds: when positive the interval is chosen automatically,
    /// `sqrt(2 · cost · MTBF)` (Young 1974, Daly 2006) from each checkpoint's measured cost, the
    /// first at `interval` (or step 10). 0 = the fixed `interval`.
    pub mtbf_s: f64,
    /// In-memory checkpoints (Gemini): every this many steps (0 = off) each rank snapshots
    /// its state into its memory and a copy into the next rank's, and a failed rank is
    /// restored from there without reading disk. Disk checkpoints are kept in memory too.
    /// Needs at least two in-process ranks.
    pub memory_interval: u64,
}


#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataSection {
    /// `byte`, `char`, `gpt2`, or a tokenizer JSON file.
    pub tokenizer: String,
    /// Files or directories; empty = the Rust books of the local Rust install.
    pub paths: Vec<String>,
    pub val_fraction: f64,
    /// The JSON field / parquet column holding a text document.
    pub text_field: String,
    /// What a document is: `text`, `chat` (messages rendered by the chat template, loss on the
    /// assistant turns) or `prompt_completion` (loss on the completion).
    #[serde(with = "named")]
    pub format: Format,
    /// How rows are drawn: `windows` (random windows of the stream, nanoGPT) or `documents`
    /// (whole documents packed into rows, attention kept inside each).
    #[serde(with = "named")]
    pub packing: Packing,
    /// With `packing = "documents"`: positions restart at 0 in every document.
    pub reset_positions: bool,
    /// Several corpora mixed by weight (instead of `paths`): each row comes from source `i`
    /// with probability `weight_i / Σ weight`.
    pub sources: Vec<SourceSpec>,
}

/// One corpus of a mixture (`data.sources`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceSpec {
    pub path: String,
    #[serde(default = "one")]
    pub weight: f64,
}

fn one() -> f64 {
    1.0
}

/// `data.format`: the data crate's document formats, by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Format(pub data::DocFormat);

impl Names for Format {
    const NAMES: &'static [(&'static str, Format)] = &[
        ("text", Format(data::DocFormat::Text)),
        ("chat", Format(data::DocFormat::Chat)),
        ("prompt_completion", Format(data::DocFormat::PromptCompletion)),
        ("preference", Format(data::DocFormat::Preference)),
        ("prompt", Format(data::DocFormat::Prompt)),
    ];
}

/// `data.packing`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Packing {
    #[default]
    Windows,
    Documents,
}

impl Names for Packing {
    const NAMES: &'static [(&'static str, Packing)] = &[("windows", Packing::Windows), ("documents", Packing::Documents)];
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SampleSection {
    /// Tokens generated at the end of training (0 = none).
    pub tokens: usize,
    pub prompt: String,
    pub temperature: f64,
    pub top_k: usize,
}

/// LoRA fine-tuning (Hu et al. 2021): off while `rank` is 0.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraSection {
    pub rank: usize,
    pub alpha: f64,
    /// Any of q, k, v, o, gate, up, down.
    pub targets: Vec<String>,
    /// QLoRA: the frozen base's matrices stored as `nf4` (4-bit NormalFloat, blocks of 64,
    /// double-quantized scales) or `int8` (per output channel), dequantized a unit at a time in
    /// the passes; `none` keeps them fp32.
    pub quantize_base: model::BaseQuant,
}

/// Data parallelism and ZeRO (`parallel` crate). Changing these changes speed and memory,
/// not the result: `train.batch_size` stays the global batch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelSection {
    /// Data-parallel ranks. With `backend = "inproc"`, one thread per rank in this process;
    /// with `"mpi"`, must equal the number of MPI processes (0 = take it from MPI).
    pub dp: usize,
    /// ZeRO stage: 0 (plain data parallel), 1 (optimizer state sharded), 2 (+ gradients),
    /// 3 (+ parameters).
    pub zero: usize,
    /// Tensor-parallel ranks (Megatron column/row split of attention heads and MLP columns);
    /// the world is `dp × tp` ranks.
    pub tp: usize,
    /// Expert-parallel ranks: each MoE layer's routed experts spread over them, the batch split
    /// over `dp × ep` (see `parallel::ep`); the world is `pp × dp × ep × tp` ranks.
    pub ep: usize,
    /// Context-parallel ranks: every sequence's positions split over them, attention computed
    /// across them (`parallel::cp`); the world is `pp × dp × ep × cp × tp` ranks.
    pub cp: usize,
    /// How context-parallel ranks compute attention: `ring` (key/value blocks passed around)
    /// or `ulysses` (all-to-all to a head split and back).
    #[serde(with = "named")]
    pub cp_mode: plan::policy::CpMode,
    /// Which positions a context-parallel rank holds: `zigzag` (chunks `r` and `2·cp − 1 − r`
    /// of `2·cp`: equal causal-attention work) or `none` (the `r`-th of `cp` chunks).
    #[serde(with = "named")]
    pub cp_balance: plan::policy::CpBalance,
    /// How each step's context-parallel attention time is measured for its metrics line:
    /// `wall` (as it ran) or `device` (attention kernels one at a time across the process, so
    /// each rank's time is uncontended: for measuring balance on fewer cores than ranks).
    #[serde(with = "named")]
    pub cp_clock: CpClock,
    /// `inproc` or `mpi` (a build with `--features mpi`, run under `mpirun`).
    #[serde(with = "named")]
    pub backend: Backend,
    /// Data-parallel communication compression: `none`; `onebit_adam` (Tang et al. 2021:
    /// after `compression_warmup` steps of plain AdamW the variance is frozen and the momentum
    /// is all-reduced as signs with scales and error feedback); `powersgd`; `zero_one_adam`
    /// (Lu et al. 2023, on `parallel.zeroone`'s schedule).
    #[serde(with = "named")]
    pub compression: Compression,
    /// Steps of uncompressed training before compression starts (1-bit Adam's warm-up, after
    /// which its variance is frozen; PowerSGD's uncompressed start).
    pub compression_warmup: u64,
    /// PowerSGD's rank: each gradient matrix travels as `(rows + cols) · rank` numbers.
    pub powersgd_rank: usize,
    /// Gradient all-reduce bucket size in MiB (stages 0 and 1).
    pub bucket_mb: f64,
    /// On CUDA devices: the data-parallel gradient all-reduce through NCCL on the device
    /// buffers (`device::nccl`) instead of staged through the host. Off by default: the path
    /// has not yet been run on a GPU.
    pub nccl: bool,
    /// With `tp > 1`: sequence parallelism (Korthikanti et al.): norms, dropout and the
    /// residual stream split along the sequence over the tensor-parallel ranks.
    pub sequence_parallel: bool,
    /// Pipeline stages (consecutive layers each; the world is `pp × dp × tp` ranks). The
    /// step's micro-batches are `train.grad_accum` (`--micro-batches`).
    pub pp: usize,
    /// Pipeline schedule: `gpipe`, `1f1b` or `interleaved`.
    #[serde(with = "named")]
    pub schedule: parallel::pp::Kind,
    /// Model chunks per pipeline rank (`interleaved` only).
    pub virtual_stages: usize,
    /// Layers per pipeline stage (`pp × virtual_stages` counts, adding up to `model.n_layer`);
    /// empty: balanced by cost (the last stage also pays for the head).
    pub pp_layers: Vec<usize>,
    /// Record each rank's pipeline tasks per step in `RUN/pipeline/rank-R.jsonl`: `off`,
    /// `wall` (as they ran), or `device` (also compute one task at a time across the process,
    /// so each task's time is uncontended; for measuring schedules on a machine with fewer
    /// cores than ranks; needs dp = tp = 1).
    #[serde(with = "named")]
    pub pp_trace: PpTrace,
    /// ZeRO++ on ZeRO-3's collectives (`parallel::zeropp`).
    pub zeropp: ZeroPpSection,
    /// 0/1 Adam's schedule (`parallel.compression = zero_one_adam`).
    pub zeroone: ZeroOneSection,
}

/// 0/1 Adam's schedule (`parallel::compress::ZeroOneSchedule`; DeepSpeed's `ZeroOneAdam`
/// names). Steps before `parallel.compression_warmup` are plain AdamW.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ZeroOneSection {
    /// The step after which the variance is frozen and local steps begin.
    pub var_freeze_step: u64,
    /// Variance updates per interval before the interval between them doubles (κ).
    pub var_update_scaler: u64,
    /// Local steps per sync interval before the interval doubles.
    pub local_step_scaler: u64,
    /// The largest sync interval (H): at most this many local steps between averages.
    pub local_step_clipper: u64,
}

impl Default for ZeroOneSection {
    fn default() -> Self {
        // DeepSpeed's κ and H; its freeze step (100000) and local scaler (32678) are for runs of
        // hundreds of thousands of steps, scaled here to a few thousand.
        ZeroOneSection { var_freeze_step: 1000, var_update_scaler: 16, local_step_scaler: 1000, local_step_clipper: 16 }
    }
}

impl ZeroOneSection {
    pub fn schedule(&self, warmup: u64) -> parallel::compress::ZeroOneSchedule {
        parallel::compress::ZeroOneSchedule {
            warmup,
            var_freeze_step: self.var_freeze_step,
            var_update_scaler: self.var_update_scaler,
            local_step_scaler: self.local_step_scaler,
            local_step_clipper: self.local_step_clipper,
        }
    }
}

/// ZeRO++ (Wang et al. 2023; `parallel::zeropp`), with `parallel.zero = 3` and data
/// parallelism alone.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ZeroPpSection {
    /// qwZ: parameter all-gathers as int8 blocks of 64 with fp32 scales.
    pub qwz: bool,
    /// qgZ: the gradient reduce-scatter as hierarchical all-to-alls of `qgz_bits`-bit blocks.
    pub qgz: bool,
    /// qgZ's code bits: 4 (the paper's) or 8.
    pub qgz_bits: u32,
    /// hpZ: each rank keeps its node's share of every unit gathered in forward, and backward
    /// gathers inside the node.
    pub hpz: bool,
    /// Ranks per node for qgZ's and hpZ's hierarchy (0: every data-parallel rank on one node).
    pub node_size: usize,
}

impl Default for ZeroPpSection {
    fn default() -> Self {
        ZeroPpSection { qwz: false, qgz: false, qgz_bits: 4, hpz: false, node_size: 0 }
    }
}

impl ZeroPpSection {
    pub fn any(&self) -> bool {
        self.qwz || self.qgz || self.hpz
    }

    /// The switches for a data-parallel degree of `dp`.
    pub fn resolve(&self, dp: usize) -> parallel::zeropp::ZeroPp {
        let node = if self.node_size == 0 { dp } else { self.node_size };
        parallel::zeropp::ZeroPp { qwz: self.qwz, qgz: self.qgz.then_some(self.qgz_bits), hpz: self.hpz, node }
    }
}




/// The optimizer: AdamW (its hyper-parameters are `train.beta1`, `beta2`, `eps`,
/// `weight_decay`), Lion, or Muon on the hidden matrices with AdamW on the rest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimSection {
    /// `adamw`; `lion` (Chen et al. 2023: `train.lr`, with `train.beta1` / `beta2` as its two
    /// interpolations and `train.weight_decay`; it wants a learning rate 3–10× below AdamW's);
    /// `muon` (Jordan et al. 2024): every 2-D weight matrix but the embeddings and the output
    /// head takes Muon's orthogonalised momentum, the rest AdamW with the `train` keys; or
    /// `adafactor` (Shazeer & Stern 2018, as `torch.optim.Adafactor`): no first moment, each
    /// matrix's second moment factored into row and column averages, a relative step size
    /// (`train.lr` caps it) and clipped updates.
    #[serde(with = "named")]
    pub name: OptimName,
    /// Muon's peak learning rate; its schedule has `train.lr`'s shape (warm-up, cosine decay to
    /// `train.min_lr`'s fraction of it).
    pub muon_lr: f64,
    /// Muon's momentum (an average: `buf = μ·buf + (1−μ)·g`), and whether the update looks
    /// ahead with Nesterov's `(1−μ)·g + μ·buf`.
    pub muon_momentum: f64,
    pub muon_nesterov: bool,
    /// Newton–Schulz steps (Jordan et al.'s quintic, coefficients 3.4445, −4.775, 2.0315).
    pub muon_ns_steps: usize,
    /// `bf16` (as `torch.optim.Muon` runs it: each product rounded to bf16) or `fp32`.
    #[serde(with = "named")]
    pub muon_ns_precision: NsPrecision,
    /// How the learning rate scales with an `[out, in]` matrix's shape: `original`
    /// (`√max(1, out/in)`), `match_rms_adamw` (Moonlight: `0.2·√max(out, in)`, so AdamW's
    /// learning rate and weight decay carry over) or `spectral_unclamped` (`√(out/in)`).
    #[serde(with = "named")]
    pub muon_adjust_lr: MuonAdjust,
    /// AdamW's state: `fp32`; `bf16` (the moments in bf16, rounded stochastically, and under
    /// `train.precision = bf16` the weights their own master copy, updated with stochastic
    /// rounding: 6 bytes a parameter where there were 12); or `int8` (the moments in 8 bits
    /// each, block-wise with an fp32 scale per 256, Dettmers et al. 2022: 2 bytes where there
    /// were 8).
    #[serde(with = "named")]
    pub state: StateForm,
    /// Adafactor's second-moment rate `1 − β2_t = t^adafactor_beta2_decay` (≤ 0), the floor of
    /// its relative step's parameter scale, and the RMS its updates are clipped to.
    pub adafactor_beta2_decay: f64,
    pub adafactor_eps2: f64,
    pub adafactor_d: f64,
}


/// `optim.name` and `optim.state` (the planner's names: `kiln plan --optimizer`).
pub use plan::policy::{OptimName, StateForm};

/// `optim.muon_ns_precision`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NsPrecision {
    #[default]
    Bf16,
    Fp32,
}

impl Names for NsPrecision {
    const NAMES: &'static [(&'static str, NsPrecision)] = &[("bf16", NsPrecision::Bf16), ("fp32", NsPrecision::Fp32)];
}

/// `optim.muon_adjust_lr`: the kernel's choice, under its config names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MuonAdjust(pub tensor::optim::MuonAdjust);

impl Names for MuonAdjust {
    const NAMES: &'static [(&'static str, MuonAdjust)] = {
        use tensor::optim::MuonAdjust as K;
        &[("original", MuonAdjust(K::Original)), ("match_rms_adamw", MuonAdjust(K::MatchRmsAdamw)), ("spectral_unclamped", MuonAdjust(K::SpectralUnclamped))]
    };
}

impl Default for OptimSection {
    fn default() -> Self {
        OptimSection { name: OptimName::AdamW, muon_lr: 0.02, muon_momentum: 0.95, muon_nesterov: true, muon_ns_steps: 5, muon_ns_precision: NsPrecision::Bf16, muon_adjust_lr: MuonAdjust::default(), state: StateForm::Fp32, adafactor_beta2_decay: -0.8, adafactor_eps2: 1e-3, adafactor_d: 1.0 }
    }
}

/// Memory tiers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemorySection {
    /// `none`, or `optimizer`: AdamW's moments in memory-mapped files under the run directory
    /// (`offload/`), streamed through the update in chunks (ZeRO-Infinity's NVMe tier).
    #[serde(with = "named")]
    pub offload: Offload,
    /// The most one rank may hold, as planned before step 0 (`kiln memory`): a number of bytes
    /// or a size such as `2GiB` or `1500MB`; `0` = no limit. A run whose plan exceeds it is
    /// refused before anything is written.
    pub limit: String,
    /// The most a device run (`train.device`) may allocate on the device, as planned before it
    /// allocates: a size such as `8GiB`; `0` = the adapter's own limits only (no buffer past its
    /// largest, which is all Vulkan reports).
    pub device_limit: String,
    /// `none`, `int8` or `int4`: the activations each block keeps for backward stored as 8- or
    /// 4-bit codes per group of 64 with fp32 scales (GACT), expanded before its backward.
    #[serde(with = "named")]
    pub activation_compression: plan::policy::ActCompression,
    /// `nearest` or `stochastic` rounding of the compressed activations.
    #[serde(with = "named")]
    pub activation_rounding: plan::policy::ActRounding,
}


/// String keys that also take a plain integer (a number of bytes).
const SIZE_KEYS: &[&str] = &["memory.limit", "memory.device_limit"];


/// Numerical faults: what a step with a non-finite or spiking loss does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultSection {
    /// Skip the update of a step whose loss or gradient norm is not finite (else stop).
    pub skip_nonfinite: bool,
    /// Skip the update of a step whose loss is more than this many standard deviations above
    /// the mean of the last `spike_window` applied steps (0 = off).
    pub spike_zscore: f64,
    pub spike_window: usize,
    /// After this many consecutive skipped updates, roll back to the newest valid checkpoint
    /// and skip those steps' batches on the way forward (0 = stop instead).
    pub max_consecutive_skips: usize,
    /// Debug: poison the gradient with NaN at these steps (1-based).
    pub inject_nan_steps: Vec<u64>,
    /// Debug: these ranks fail (lose their state and memory) at the start of step
    /// `fail_step` (1-based; 0 = never), once per run.
    pub fail_ranks: Vec<usize>,
    pub fail_step: u64,
    /// Debug: SIGKILL this process in the middle of writing the checkpoint of this step
    /// (0 = never), once per run.
    pub kill_in_write_step: u64,
    /// In-process restarts after a rank fails (from in-memory snapshots, else from disk)
    /// before the run gives up.
    pub max_rank_restarts: u32,
    /// Debug: the ranks of `fail_ranks` never come back (until `rejoin_step`): the run goes on
    /// without them when it is elastic (`elastic_min` > 0), else stops.
    pub fail_permanent: bool,
    /// Debug, in process: the permanently failed ranks are back from this step (0 = never);
    /// the first disk checkpoint at or after it takes them in again.
    pub rejoin_step: u64,
    /// Under MPI (`kiln train --supervise --elastic`): seconds the supervisor waits for a
    /// restarted world's every rank to report before it relaunches without the missing ones.
    pub rejoin_timeout_s: f64,
    /// Elastic data parallelism (`--elastic MIN:MAX`): after a rank is lost for good the run
    /// goes on with the data-parallel replicas left, down to `elastic_min`, and takes returning
    /// ones back, up to `elastic_max`, keeping the global batch (0 = not elastic).
    pub elastic_min: usize,
    pub elastic_max: usize,
    /// The most sequences a rank may take per micro-batch after a resize (0: those of the
    /// layout the elastic run started with; resolved then and saved with the run).
    pub elastic_rows: usize,
    /// Stragglers: a rank whose median step compute time over the last `straggler_steps` steps
    /// exceeds the median rank's by this factor is reported (0 = off).
    pub straggler_ratio: f64,
    pub straggler_steps: u64,
    /// Debug: these ranks run each step's compute `slow_factor` times as long (they sleep).
    pub slow_ranks: Vec<usize>,
    pub slow_factor: f64,
}

/// The keys the user set (in the config file, with `--set` or a dedicated flag), as opposed to
/// those that come from the preset or a saved run.
pub fn user_keys(args: &TrainArgs) -> Result<std::collections::BTreeSet<String>> {
    let mut keys = std::collections::BTreeSet::new();
    if let Some(p) = &args.config {
        keys.extend(read_file(p)?.into_keys());
    }
    keys.extend(args.set.iter().filter_map(|kv| kv.split_once('=')).map(|(k, _)| k.trim().to_string()));
    keys.extend(args.flags.iter().map(|f| f.key.to_string()));
    Ok(keys)
}

/// Model settings a base model brings but the user may change (training settings, not shape):
/// the base's value unless the user set one.
const BASE_SETTINGS: &[&str] = &["model.capacity_factor", "model.moe_aux_weight", "model.moe_z_weight"];

/// `cfg` on top of a base model (`--init-from`) whose config is `base`: every model key the base
/// fixes takes its value (a user's different value is refused, naming the key), the
/// [`BASE_SETTINGS`] take it unless the user set them, and with a Hugging Face base
/// (`hf`) the loss covers its whole vocabulary. `explicit` is [`user_keys`]; `origin` names the
/// base in errors.
pub fn adopt_base(cfg: &RunConfig, base: &model::GptConfig, hf: bool, explicit: &std::collections::BTreeSet<String>, origin: &str) -> Result<RunConfig> {
    let mut based = cfg.clone();
    set_model_shape(&mut based.model, base);
    let (mc, hc) = (&mut based.model, base);
    if hf {
        mc.loss_vocab = hc.vocab_size;
    }
    let (mut raw, theirs) = (cfg.to_raw(), based.to_raw());
    for (key, v) in theirs.iter().filter(|(k, _)| k.starts_with("model.")) {
        if raw.get(key) == Some(v) {
            continue;
        }
        let set_by_user = explicit.contains(key);
        if BASE_SETTINGS.contains(&key.as_str()) {
            if !set_by_user {
                raw.insert(key.clone(), v.clone());
            }
        } else if set_by_user && key != "model.loss_vocab" {
            let hint = if key == "model.block_size" { "; to train on shorter sequences set train.seq_len (--seq-len)" } else { "" };
            return user(format!("{key} = {} was given, but the base model {origin} has {key} = {v}: --init-from fixes the model's shape (drop the setting{hint})", raw[key]));
        } else {
            raw.insert(key.clone(), v.clone());
        }
    }
    RunConfig::resolve(&raw)
}

/// Sets every `model.*` key a model config fixes (its shape, rope, attention and MoE keys) to
/// `hc`'s.
pub fn set_model_shape(mc: &mut ModelSection, hc: &model::GptConfig) {
    mc.arch = hc.arch;
    (mc.n_layer, mc.n_head, mc.n_kv_head, mc.n_embd, mc.ffn_hidden, mc.block_size, mc.vocab_size, mc.bias, mc.tied_embeddings) =
        (hc.n_layer, hc.n_head, hc.n_kv_head, hc.n_embd, hc.ffn_hidden, hc.block_size, hc.vocab_size, hc.bias, hc.tied_embeddings);
    (mc.rope_theta, mc.norm_eps, mc.qkv_bias, mc.sliding_window) = (hc.rope_theta as f64, hc.norm_eps as f64, hc.qkv_bias, hc.sliding_window);
    (mc.head_dim, mc.window_layers, mc.fused_proj, mc.qk_norm) = (hc.head_dim, hc.window_layers.clone(), hc.fused_proj, hc.qk_norm);
    (mc.qk_norm_whole, mc.block_norms, mc.gate_act) = (hc.qk_norm_whole, hc.block_norms, hc.gate_act);
    (mc.norm_offset, mc.embed_scale, mc.query_pre_attn_scalar, mc.rope_local_theta) = (hc.norm_offset, hc.embed_scale, hc.query_pre_attn_scalar, hc.rope_local_theta as f64);
    (mc.attn_softcap, mc.final_softcap) = (hc.attn_softcap as f64, hc.final_softcap as f64);
    (mc.kv_lora_rank, mc.q_lora_rank, mc.v_head_dim, mc.rope_interleave) = (hc.kv_lora_rank, hc.q_lora_rank, hc.v_head_dim, hc.rope_interleave);
    mc.pad_token_id = hc.pad_token_id.map_or(-1, |p| p as i64);
    mc.rotary_dim = hc.rotary_dim;
    mc.nope_layers = hc.nope_layers.clone();
    set_rope_scaling(mc, hc.rope_scaling.clone());
    (mc.n_expert, mc.top_k, mc.n_shared_expert) = (hc.n_expert, hc.top_k, hc.n_shared_expert);
    (mc.capacity_factor, mc.moe_aux_weight, mc.moe_z_weight) = (hc.capacity_factor as f64, hc.moe_aux_weight as f64, hc.moe_z_weight as f64);
    (mc.moe_router, mc.moe_groups, mc.moe_topk_groups, mc.moe_gate_scale) = (hc.moe_router, hc.moe_groups, hc.moe_topk_groups, hc.moe_gate_scale as f64);
    (mc.moe_first_layer, mc.dense_ffn_hidden) = (hc.moe_first_layer, hc.dense_ffn_hidden);
}

/// Sets the `model.rope_*` keys to a model's rope scaling.
pub fn set_rope_scaling(m: &mut ModelSection, r: Option<model::config::RopeScaling>) {
    use model::config::RopeScaling as R;
    match r {
        None => m.rope_scaling = RopeKind::None,
        Some(R::Linear { factor }) => (m.rope_scaling, m.rope_factor) = (RopeKind::Linear, factor as f64),
        Some(R::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
            (m.rope_scaling, m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_max_positions) =
                (RopeKind::Llama3, factor as f64, low_freq_factor as f64, high_freq_factor as f64, original_max_position_embeddings);
        }
        Some(R::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, attention_factor, truncate }) => {
            (m.rope_scaling, m.rope_factor, m.rope_original_max_positions) = (RopeKind::Yarn, factor as f64, original_max_position_embeddings);
            (m.rope_beta_fast, m.rope_beta_slow, m.rope_attention_factor, m.rope_truncate) = (beta_fast as f64, beta_slow as f64, attention_factor as f64, truncate);
        }
        Some(R::Dynamic { factor, original_max_position_embeddings }) => {
            (m.rope_scaling, m.rope_factor, m.rope_original_max_positions) = (RopeKind::Dynamic, factor as f64, original_max_position_embeddings);
        }
        Some(R::LongRope { short_factor, long_factor, original_max_position_embeddings, attention_factor }) => {
            (m.rope_scaling, m.rope_original_max_positions, m.rope_attention_factor) = (RopeKind::LongRope, original_max_position_embeddings, attention_factor as f64);
            let wide = |f: Vec<f32>| f.into_iter().map(f64::from).collect();
            (m.rope_short_factor, m.rope_long_factor) = (wide(short_factor), wide(long_factor));
        }
    }
}

/// `model.rope_scaling`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RopeKind {
    #[default]
    None,
    Linear,
    Llama3,
    Yarn,
    LongRope,
    Dynamic,
}

impl Names for RopeKind {
    const NAMES: &'static [(&'static str, RopeKind)] =
        &[("none", RopeKind::None), ("linear", RopeKind::Linear), ("llama3", RopeKind::Llama3), ("yarn", RopeKind::Yarn), ("longrope", RopeKind::LongRope), ("dynamic", RopeKind::Dynamic)];
}

/// `parallel.backend`: how ranks talk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// One thread per rank in this process.
    #[default]
    Inproc,
    /// One process per rank under `mpirun` (a build with `--features mpi`).
    Mpi,
}

impl Names for Backend {
    const NAMES: &'static [(&'static str, Backend)] = &[("inproc", Backend::Inproc), ("mpi", Backend::Mpi)];
}

/// `parallel.pp_trace`: whether and how pipeline tasks are recorded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PpTrace {
    #[default]
    Off,
    /// As the tasks ran.
    Wall,
    /// One task at a time across the process, so each task's time is uncontended.
    Device,
}

impl Names for PpTrace {
    const NAMES: &'static [(&'static str, PpTrace)] = &[("off", PpTrace::Off), ("wall", PpTrace::Wall), ("device", PpTrace::Device)];
}

/// `parallel.cp_clock`: how context-parallel attention is timed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpClock {
    #[default]
    Wall,
    Device,
}

impl Names for CpClock {
    const NAMES: &'static [(&'static str, CpClock)] = &[("wall", CpClock::Wall), ("device", CpClock::Device)];
}

/// `parallel.compression`: how data-parallel ranks compress what they communicate (the
/// planner's policy enum, so `kiln plan --compression` and the run share one set of names).
pub use plan::policy::Compression;

/// `memory.offload`: what leaves memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Offload {
    #[default]
    None,
    /// AdamW's moments, to memory-mapped files.
    Optimizer,
}

impl Names for Offload {
    const NAMES: &'static [(&'static str, Offload)] = &[("none", Offload::None), ("optimizer", Offload::Optimizer)];
}

/// Serde for a key whose value is one of a fixed set of names ([`Names`]): written as its name,
/// read from any accepted spelling, and the error lists them ("must be a, b or c, got `x`";
/// [`serde_message`] puts the key first).
mod named {
    use plan::policy::Names;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<T: Names, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(v.name())
    }

    pub fn deserialize<'de, T: Names, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
        let s = String::deserialize(d)?;
        T::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// The one default of every key: the `tiny` preset's base (presets override some), and the
/// value a saved run directory's `config.toml` gets for a key it predates.
impl Default for ModelSection {
    fn default() -> Self {
        use model::config::defaults;
        ModelSection {
            arch: model::config::Arch::Gpt2, n_layer: 4, n_head: 4, n_kv_head: 0, n_embd: 128, ffn_hidden: 0,
            rope_theta: defaults::ROPE_THETA, rope_scaling: RopeKind::None, rope_factor: 1.0, rope_low_freq_factor: 1.0,
            rope_high_freq_factor: 4.0, rope_original_max_positions: 8192, rope_beta_fast: 32.0, rope_beta_slow: 1.0, rope_attention_factor: 0.0, rope_truncate: true,
            rope_short_factor: Vec::new(), rope_long_factor: Vec::new(), qkv_bias: false, fused_proj: false, qk_norm: false, qk_norm_whole: false, block_norms: model::config::BlockNorms::Pre, gate_act: model::config::GateAct::Silu, norm_offset: false, embed_scale: false, query_pre_attn_scalar: 0, rope_local_theta: 0.0, attn_softcap: 0.0, final_softcap: 0.0, kv_lora_rank: 0, q_lora_rank: 0, v_head_dim: 0, rope_interleave: false, pad_token_id: -1, rotary_dim: 0, sliding_window: 0, attn_sinks: 0, window_layers: Vec::new(), nope_layers: Vec::new(), head_dim: 0, norm_eps: defaults::NORM_EPS, block_size: 128, vocab_size: 0, loss_vocab: 0, bias: false,
            dropout: 0.0, tied_embeddings: true, init_from: String::new(), n_expert: 0, top_k: defaults::TOP_K,
            n_shared_expert: 0, capacity_factor: 0.0, moe_aux_weight: defaults::MOE_AUX_WEIGHT, moe_z_weight: defaults::MOE_Z_WEIGHT,
            moe_router: model::config::MoeRouter::Softmax, moe_groups: 1, moe_topk_groups: 1, moe_gate_scale: 1.0, moe_bias_rate: 0.0, moe_first_layer: 0, dense_ffn_hidden: 0,
            recompute: model::Recompute::None, recompute_every: 1,
        }
    }
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            batch_size: 16, seq_len: 0, grad_accum: 1, lr: 1e-3, min_lr: 1e-4, warmup_steps: 100, lr_decay_steps: 0, max_steps: 1000,
            weight_decay: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8, grad_clip: 1.0, seed: 1337, threads: 0, log_interval: 10,
            precision: model::Precision::Fp32, loss_scale: 65536.0, loss_scale_window: 1000, fp8_amax_history: 16, record_batches: false, device: "cpu".into(),
            objective: Objective::Lm,
        }
    }
}

impl Default for EvalSection {
    fn default() -> Self {
        EvalSection { interval: 250, iters: 20, batch_size: 0, seq_len: 0 }
    }
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection { interval: 500, keep: 3, keep_every: 0, background: true, mtbf_s: 0.0, memory_interval: 0 }
    }
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            tokenizer: "byte".into(), paths: vec![], val_fraction: 0.1, text_field: "text".into(), format: Format::default(),
            packing: Packing::Windows, reset_positions: false, sources: vec![],
        }
    }
}

impl Default for SampleSection {
    fn default() -> Self {
        SampleSection { tokens: 300, prompt: "\n".into(), temperature: 0.8, top_k: 200 }
    }
}

impl Default for LoraSection {
    fn default() -> Self {
        LoraSection { rank: 0, alpha: 16.0, targets: vec!["q".into(), "v".into()], quantize_base: model::BaseQuant::None }
    }
}

impl ParallelSection {
    /// Ranks in the world with `dp` data-parallel ranks: `pp × dp × ep × cp × tp`.
    pub fn world(&self, dp: usize) -> usize {
        self.pp * dp * self.ep * self.cp * self.tp
    }

    /// Ranks per data-parallel rank: `pp × ep × cp × tp`.
    pub fn per_dp(&self) -> usize {
        self.pp * self.ep * self.cp * self.tp
    }
}

impl Default for ParallelSection {
    fn default() -> Self {
        ParallelSection {
            dp: 1, zero: 0, tp: 1, ep: 1, cp: 1, cp_mode: plan::policy::CpMode::Ring, cp_balance: plan::policy::CpBalance::Zigzag, cp_clock: CpClock::Wall, backend: Backend::Inproc, compression: Compression::None, compression_warmup: 100, powersgd_rank: 4, bucket_mb: 25.0, nccl: false, sequence_parallel: false, pp: 1,
            schedule: parallel::pp::Kind::OneFOneB, virtual_stages: 1, pp_layers: Vec::new(), pp_trace: PpTrace::Off, zeropp: Default::default(), zeroone: Default::default(),
        }
    }
}

impl Default for MemorySection {
    fn default() -> Self {
        MemorySection { offload: Offload::None, limit: "0".into(), device_limit: "0".into(), activation_compression: Default::default(), activation_rounding: Default::default() }
    }
}

impl Default for FaultSection {
    fn default() -> Self {
        FaultSection {
            skip_nonfinite: true, spike_zscore: 0.0, spike_window: 50, max_consecutive_skips: 3, inject_nan_steps: vec![],
            fail_ranks: vec![], fail_step: 0, kill_in_write_step: 0, max_rank_restarts: 3, fail_permanent: false, rejoin_step: 0,
            rejoin_timeout_s: 30.0, elastic_min: 0, elastic_max: 0, elastic_rows: 0, straggler_ratio: 1.3, straggler_steps: 10,
            slow_ranks: vec![], slow_factor: 1.0,
        }
    }
}


#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    pub preset: String,
    pub model: ModelSection,
    pub train: TrainSection,
    pub optim: OptimSection,
    pub preference: PreferenceSection,
    pub grpo: GrpoSection,
    pub eval: EvalSection,
    pub checkpoint: CheckpointSection,
    pub data: DataSection,
    pub sample: SampleSection,
    pub lora: LoraSection,
    pub parallel: ParallelSection,
    pub faults: FaultSection,
    pub memory: MemorySection,
}

/// A flat map of dotted keys to TOML values.
pub type Raw = BTreeMap<String, toml::Value>;

pub fn flatten(prefix: &str, table: &toml::Table, out: &mut Raw) {
    for (k, v) in table {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match v {
            toml::Value::Table(t) => flatten(&key, t, out),
            _ => {
                out.insert(key, v.clone());
            }
        }
    }
}

fn unflatten(raw: &Raw) -> toml::Table {
    let mut root = toml::Table::new();
    for (key, v) in raw {
        let mut t = &mut root;
        let parts: Vec<&str> = key.split('.').collect();
        for p in &parts[..parts.len() - 1] {
            t = t.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new())).as_table_mut().unwrap();
        }
        t.insert(parts[parts.len() - 1].to_string(), v.clone());
    }
    root
}

fn type_name(v: &toml::Value) -> &'static str {
    match v {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a number",
        toml::Value::Boolean(_) => "true or false",
        toml::Value::Array(_) => "a list",
        toml::Value::Table(_) => "a table",
        toml::Value::Datetime(_) => "a date",
    }
}

/// Sets `key` to `value` in `raw`, which must already hold the key (from the defaults);
/// integers are accepted where numbers are expected. `origin` says where the value came from.
pub fn set_key(raw: &mut Raw, key: &str, value: toml::Value, origin: &str) -> Result<()> {
    let Some(old) = raw.get(key) else {
        let mut near: Vec<&String> = raw.keys().filter(|k| k.split('.').next_back() == key.split('.').next_back()).collect();
        near.truncate(3);
        let hint = if near.is_empty() { String::new() } else { format!(" (did you mean {}?)", near.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")) };
        return user(format!("{origin}: unknown config key `{key}`{hint}"));
    };
    let value = match (old, value) {
        (toml::Value::Float(_), toml::Value::Integer(i)) => toml::Value::Float(i as f64),
        (toml::Value::String(_), toml::Value::Integer(i)) if SIZE_KEYS.contains(&key) && i >= 0 => toml::Value::String(i.to_string()),
        (o, v) if std::mem::discriminant(o) == std::mem::discriminant(&v) => v,
        (o, v) => return user(format!("{origin}: config key `{key}` must be {}, got {} ({v})", type_name(o), type_name(&v))),
    };
    if let toml::Value::Integer(i) = value {
        if i < 0 {
            return user(format!("{origin}: config key `{key}` must not be negative, got {i}"));
        }
    }
    raw.insert(key.to_string(), value);
    Ok(())
}

/// A TOML config file's keys, flattened (not yet checked against the known keys).
fn read_file(path: &Path) -> Result<Raw> {
    let text = std::fs::read_to_string(path).or_else(|e| user(format!("{}: cannot read config: {e}", path.display())))?;
    let table: toml::Table = toml::from_str(&text).or_else(|e| user(format!("{}: invalid TOML: {}", path.display(), one_line(&e.to_string()))))?;
    let mut flat = Raw::new();
    flatten("", &table, &mut flat);
    Ok(flat)
}

/// Applies a TOML file's keys over `raw`.
pub fn apply_file(raw: &mut Raw, path: &Path) -> Result<()> {
    for (k, v) in read_file(path)? {
        set_key(raw, &k, v, &path.display().to_string())?;
    }
    Ok(())
}

/// Applies one `--set KEY=VALUE`. VALUE is read as TOML (`3`, `1e-3`, `true`, `"x"`), and as
/// a plain string when it is not valid TOML.
pub fn apply_set(raw: &mut Raw, kv: &str) -> Result<()> {
    let Some((k, v)) = kv.split_once('=') else {
        return user(format!("--set `{kv}`: expected KEY=VALUE"));
    };
    let (k, v) = (k.trim(), v.trim());
    let value = match toml::from_str::<toml::Table>(&format!("v = {v}")) {
        Ok(mut t) => t.remove("v").unwrap(),
        Err(_) => toml::Value::String(v.to_string()),
    };
    set_key(raw, k, value, "--set")
}

/// A deserialization error as one line, its key first: "model.recompute must be none, selective
/// or full, got `x`".
fn serde_message(e: &str) -> String {
    match e.rsplit_once("\nin `") {
        Some((msg, key)) => {
            let (key, msg) = (key.trim_end().trim_end_matches('`'), one_line(msg));
            if msg.starts_with("must be") { format!("{key} {msg}") } else { format!("{key}: {msg}") }
        }
        None => format!("config: {}", one_line(e)),
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl RunConfig {
    /// Builds and validates the config from the raw table.
    pub fn resolve(raw: &Raw) -> Result<RunConfig> {
        let mut cfg: RunConfig = toml::Value::Table(unflatten(raw)).try_into().or_else(|e: toml::de::Error| user(serde_message(&e.to_string())))?;
        // A preference objective reads preference rows, GRPO prompts (plain text is neither).
        if cfg.data.format.0 == data::DocFormat::Text {
            match cfg.train.objective {
                Objective::Pairs(_) => cfg.data.format = Format(data::DocFormat::Preference),
                Objective::Grpo => cfg.data.format = Format(data::DocFormat::Prompt),
                Objective::Lm => {}
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn to_raw(&self) -> Raw {
        let table = toml::Table::try_from(self).expect("config serializes");
        let mut raw = Raw::new();
        flatten("", &table, &mut raw);
        raw
    }

    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("config serializes")
    }

    /// Reads a resolved `config.toml` (as written into a run directory).
    pub fn load(path: &Path) -> Result<RunConfig> {
        let text = std::fs::read_to_string(path).or_else(|e| user(format!("{}: cannot read: {e}", path.display())))?;
        let cfg: RunConfig = toml::from_str(&text).or_else(|e| user(format!("{}: {}", path.display(), one_line(&e.to_string()))))?;
        cfg.validate().map_err(|e| crate::error::KilnError::User(format!("{}: {e}", path.display())))?;
        Ok(cfg)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        self.validate_model()?;
        self.validate_train()?;
        self.validate_optim()?;
        self.validate_data_and_checkpoints()?;
        self.validate_precision_and_memory()?;
        self.validate_parallel()?;
        self.validate_faults()?;
        self.validate_compression()?;
        self.validate_preference()?;
        self.validate_pipeline()
    }

    /// A preference objective: its data, its keys, and the layouts it runs on.
    fn validate_preference(&self) -> Result<()> {
        let (obj, fmt) = (self.train.objective, self.data.format.0);
        if obj == Objective::Grpo {
            return self.validate_grpo();
        }
        if fmt == data::DocFormat::Prompt {
            return user("data.format = \"prompt\" needs train.objective = \"grpo\"");
        }
        let Some(loss) = obj.pairs() else {
            if fmt == data::DocFormat::Preference {
                return user("data.format = \"preference\" needs a preference objective: train.objective = \"dpo\", \"ipo\" or \"simpo\"");
            }
            return Ok(());
        };
        let name = obj.name();
        if fmt != data::DocFormat::Preference {
            return user(format!("train.objective = \"{name}\" reads preference rows (prompt, chosen, rejected): data.format must be \"preference\", not \"{}\"", fmt.name()));
        }
        let p = &self.preference;
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN must be refused too
        if !(p.beta > 0.0) || !p.beta.is_finite() {
            return user(format!("preference.beta must be positive, got {}", p.beta));
        }
        if !(0.0..0.5).contains(&p.label_smoothing) {
            return user(format!("preference.label_smoothing must be in [0, 0.5), got {}", p.label_smoothing));
        }
        if loss == tensor::preference::PairLoss::Ipo && p.label_smoothing != 0.0 {
            return user("preference.label_smoothing applies to dpo and simpo, not ipo");
        }
        if !p.simpo_gamma.is_finite() {
            return user(format!("preference.simpo_gamma must be a number, got {}", p.simpo_gamma));
        }
        let per_rank = self.micro_batch() / self.parallel.dp.max(1);
        if !per_rank.is_multiple_of(2) {
            return user(format!("train.objective = \"{name}\": each rank's micro-batch holds whole pairs (a chosen and a rejected row), but it has {per_rank} rows: make train.batch_size / (train.grad_accum · parallel.dp) even"));
        }
        if self.train.device != "cpu" {
            return user(format!("train.objective = \"{name}\" does not run on a device yet (train.device = \"{}\")", self.train.device));
        }
        Ok(())
    }

    /// GRPO: its data, its keys, and what it runs on.
    fn validate_grpo(&self) -> Result<()> {
        let g = &self.grpo;
        if self.data.format.0 != data::DocFormat::Prompt {
            return user(format!("train.objective = \"grpo\" reads prompt rows ({{\"prompt\", \"{}\"}}): data.format must be \"prompt\", not \"{}\"", g.answer_field, self.data.format.0.name()));
        }
        if g.group < 2 || !self.train.batch_size.is_multiple_of(g.group) {
            return user(format!("grpo.group ({}) must be at least 2 and divide train.batch_size ({}), which counts completions", g.group, self.train.batch_size));
        }
        let positive = [("grpo.max_new_tokens", g.max_new_tokens as f64), ("grpo.iterations", g.iterations as f64), ("grpo.temperature", g.temperature)];
        if let Some((k, v)) = positive.iter().find(|(_, v)| v.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)) {
            return user(format!("{k} must be positive, got {v}"));
        }
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN must be refused too
        if !(g.top_p > 0.0 && g.top_p <= 1.0) {
            return user(format!("grpo.top_p must be in (0, 1], got {}", g.top_p));
        }
        for (k, v) in [("grpo.epsilon", g.epsilon), ("grpo.epsilon_high", g.epsilon_high), ("grpo.beta", g.beta)] {
            #[allow(clippy::neg_cmp_op_on_partial_ord)]
            if !(v >= 0.0) || !v.is_finite() {
                return user(format!("{k} must be a non-negative number, got {v}"));
            }
        }
        if g.epsilon >= 1.0 {
            return user(format!("grpo.epsilon must be below 1, got {}", g.epsilon));
        }
        crate::reward::Rewards::new(&g.rewards, &g.reward_weights, &g.answer_pattern)?;
        let p = &self.parallel;
        let split = [("parallel.tp", p.tp), ("parallel.pp", p.pp), ("parallel.ep", p.ep)];
        if let (Some((k, v)), true) = (split.iter().find(|(_, v)| *v > 1), self.lora.rank > 0) {
            return user(format!("train.objective = \"grpo\" with LoRA merges the adapters into the whole base: not with {k} = {v} yet"));
        }
        let rows = self.micro_batch() / p.dp.max(1);
        if p.dp > 1 && !rows.is_multiple_of(g.group) {
            return user(format!("train.objective = \"grpo\": each data-parallel rank's micro-batch holds whole groups, but it has {rows} rows for groups of {} (grpo.group)", g.group));
        }
        if self.train.device != "cpu" {
            return user(format!("train.objective = \"grpo\" does not run on a device yet (train.device = \"{}\")", self.train.device));
        }
        Ok(())
    }

    /// Communication compression (`parallel.compression`, `parallel.zeropp`).
    fn validate_compression(&self) -> Result<()> {
        let p = &self.parallel;
        let z = &p.zeropp;
        if z.any() {
            if p.zero != 3 || p.tp > 1 || p.pp > 1 || p.cp > 1 || p.ep > 1 {
                return user(format!("parallel.zeropp works on ZeRO-3's collectives with data parallelism alone: it needs parallel.zero = 3 and tp = pp = cp = ep = 1 (got zero {}, tp {}, pp {}, cp {}, ep {})", p.zero, p.tp, p.pp, p.cp, p.ep));
            }
            if p.compression != Compression::None {
                return user(format!("parallel.zeropp with parallel.compression = {}: choose one", p.compression.name()));
            }
            if z.qgz && !matches!(z.qgz_bits, 4 | 8) {
                return user(format!("parallel.zeropp.qgz_bits must be 4 or 8, got {}", z.qgz_bits));
            }
            if p.dp > 0 && z.node_size > 0 && !p.dp.is_multiple_of(z.node_size) {
                return user(format!("parallel.zeropp.node_size = {} does not divide parallel.dp = {}", z.node_size, p.dp));
            }
            if self.lora.rank > 0 {
                return user("parallel.zeropp with LoRA: LoRA runs at ZeRO stage 0");
            }
        }
        if p.compression == Compression::None {
            return Ok(());
        }
        let name = p.compression.name();
        if p.dp < 2 && p.dp != 0 {
            return user(format!("parallel.compression = {name} compresses data-parallel traffic: it needs parallel.dp > 1, got {}", p.dp));
        }
        if p.zero != 0 || p.tp > 1 || p.pp > 1 || p.cp > 1 || p.ep > 1 {
            return user(format!("parallel.compression = {name} is data parallelism alone: it needs parallel.zero = 0 and tp = pp = cp = ep = 1 (got zero {}, tp {}, pp {}, cp {}, ep {})", p.zero, p.tp, p.pp, p.cp, p.ep));
        }
        if self.lora.rank > 0 {
            return user(format!("parallel.compression = {name} with LoRA: the adapters are tiny; use parallel.compression = none"));
        }
        if !matches!(self.train.precision, model::Precision::Fp32 | model::Precision::Bf16) {
            return user(format!("parallel.compression = {name} needs train.precision = fp32 or bf16, got {}", self.train.precision.name()));
        }
        if p.compression_warmup == 0 && p.compression == Compression::OnebitAdam {
            return user("parallel.compression_warmup must be at least 1 (1-bit Adam's variance comes from uncompressed steps), got 0");
        }
        if p.compression == Compression::ZerooneAdam {
            let z = &p.zeroone;
            for (k, v) in [("var_update_scaler", z.var_update_scaler), ("local_step_scaler", z.local_step_scaler), ("local_step_clipper", z.local_step_clipper)] {
                if v == 0 {
                    return user(format!("parallel.zeroone.{k} must be at least 1, got 0"));
                }
            }
            if z.var_freeze_step < p.compression_warmup {
                return user(format!("parallel.zeroone.var_freeze_step = {} is before parallel.compression_warmup = {}: the variance freezes after the warm-up", z.var_freeze_step, p.compression_warmup));
            }
            if self.train.precision != model::Precision::Fp32 {
                return user(format!("parallel.compression = zero_one_adam needs train.precision = fp32, got {} (its local steps move fp32 parameters)", self.train.precision.name()));
            }
        }
        if p.compression == Compression::PowerSgd && p.powersgd_rank == 0 {
            return user("parallel.powersgd_rank must be at least 1, got 0");
        }
        if self.memory.offload != Offload::None {
            return user(format!("parallel.compression = {name} with memory.offload = optimizer is not supported"));
        }
        Ok(())
    }

    /// Elasticity and stragglers.
    fn validate_faults(&self) -> Result<()> {
        let f = &self.faults;
        if f.elastic_min > f.elastic_max || (f.elastic_min == 0) != (f.elastic_max == 0) {
            return user(format!("faults.elastic_min = {} and faults.elastic_max = {}: an elastic run needs 1 ≤ MIN ≤ MAX (--elastic MIN:MAX), or both 0", f.elastic_min, f.elastic_max));
        }
        let dp = self.parallel.dp;
        if f.elastic_min > 0 && dp > 0 && !(f.elastic_min..=f.elastic_max).contains(&dp) {
            return user(format!("--elastic {}:{}: parallel.dp = {dp} is outside it", f.elastic_min, f.elastic_max));
        }
        if f.elastic_min > 0 && self.parallel.zeropp.any() && self.parallel.zeropp.node_size > 0 {
            return user(format!("--elastic with parallel.zeropp.node_size = {}: a resized world need not split into nodes of that size (leave node_size = 0: one node)", self.parallel.zeropp.node_size));
        }
        if f.elastic_min > 0 && self.lora.quantize_base != model::BaseQuant::None {
            return user("--elastic with lora.quantize_base is not supported: a resize would quantize the base again");
        }
        if !(f.slow_factor >= 1.0 && f.slow_factor.is_finite()) {
            return user(format!("faults.slow_factor must be a finite number ≥ 1, got {}", f.slow_factor));
        }
        if !(f.straggler_ratio == 0.0 || (f.straggler_ratio > 1.0 && f.straggler_ratio.is_finite())) || f.straggler_steps == 0 {
            return user(format!("faults.straggler_ratio must be 0 (off) or above 1, and faults.straggler_steps positive; got {} and {}", f.straggler_ratio, f.straggler_steps));
        }
        if !(f.rejoin_timeout_s > 0.0 && f.rejoin_timeout_s.is_finite()) {
            return user(format!("faults.rejoin_timeout_s must be positive, got {}", f.rejoin_timeout_s));
        }
        let world = self.parallel.world(dp);
        if let Some(r) = f.slow_ranks.iter().find(|&&r| self.parallel.backend != Backend::Mpi && r >= world && f.elastic_rows == 0) {
            return user(format!("faults.slow_ranks names rank {r}, but the run has {world} rank(s)"));
        }
        Ok(())
    }

    /// The model section (and the decoder config it resolves to).
    fn validate_model(&self) -> Result<()> {
        let m = &self.model;
        if m.recompute_every == 0 || (m.recompute_every > 1 && m.recompute != model::Recompute::Full) {
            return user(format!("model.recompute_every must be positive and applies to model.recompute = full (got {} with `{}`)", m.recompute_every, m.recompute.name()));
        }
        if m.arch == model::config::Arch::Llama && m.bias {
            return user("model.bias must be false for model.arch = llama (LLaMA has no biases)");
        }
        if m.pad_token_id < -1 {
            return user(format!("model.pad_token_id must be a token id, or -1 for none (got {})", m.pad_token_id));
        }
        let mut g = self.gpt_config(m.vocab_size.max(1));
        if m.vocab_size == 0 {
            // The vocabulary comes from the tokenizer: the pad row is bounded once it is known.
            g.pad_token_id = None;
        }
        g.validate().or_else(user)?;
        Ok(())
    }

    /// The training hyperparameters.
    fn validate_train(&self) -> Result<()> {
        let t = &self.train;
        let positive = [("train.batch_size", t.batch_size as f64), ("train.grad_accum", t.grad_accum as f64), ("train.max_steps", t.max_steps as f64), ("train.lr", t.lr)];
        for (k, v) in positive {
            #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN must be refused too
            if !(v > 0.0) {
                return user(format!("{k} must be positive, got {v}"));
            }
        }
        if let Err(e) = t.device.parse::<crate::device::DeviceArg>() {
            return user(format!("train.device: {e}"));
        }
        if !t.batch_size.is_multiple_of(t.grad_accum) {
            return user(format!("train.batch_size ({}) must be divisible by train.grad_accum ({})", t.batch_size, t.grad_accum));
        }
        let nonneg = [("train.min_lr", t.min_lr), ("train.weight_decay", t.weight_decay), ("train.grad_clip", t.grad_clip), ("train.eps", t.eps), ("sample.temperature", self.sample.temperature)];
        for (k, v) in nonneg {
            #[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN takes this branch, as ±∞ do
            if !(v >= 0.0) || !v.is_finite() {
                return user(format!("{k} must be a non-negative number, got {v}"));
            }
        }
        for (k, v) in [("train.beta1", t.beta1), ("train.beta2", t.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return user(format!("{k} must be in [0, 1), got {v}"));
            }
        }
        if t.seq_len > self.model.block_size && self.model.init_from.is_empty() {
            return user(format!("train.seq_len ({}) exceeds the model's positions, model.block_size ({})", t.seq_len, self.model.block_size));
        }
        if t.min_lr > t.lr {
            return user(format!("train.min_lr ({}) must not exceed train.lr ({})", t.min_lr, t.lr));
        }
        Ok(())
    }

    /// The optimizer's keys, and what it does not combine with.
    fn validate_optim(&self) -> Result<()> {
        let o = &self.optim;
        if o.state != StateForm::Fp32 {
            let why = if o.name != OptimName::AdamW {
                format!("optim.name = {}: compact state is AdamW's", o.name.name())
            } else if self.memory.offload != Offload::None {
                "memory.offload = optimizer streams fp32 moments".to_string()
            } else if self.parallel.compression != Compression::None {
                format!("parallel.compression = {} keeps fp32 state", self.parallel.compression.name())
            } else if self.train.device != "cpu" {
                format!("train.device = {}: the device keeps fp32 moments", self.train.device)
            } else {
                String::new()
            };
            if !why.is_empty() {
                return user(format!("optim.state = {} does not combine with {why}; use optim.state = fp32", o.state.name()));
            }
        }
        if o.name == OptimName::Adafactor {
            return self.validate_adafactor();
        }
        if o.name != OptimName::Muon {
            return self.optim_without_adam_state();
        }
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN must be refused too
        if !(o.muon_lr > 0.0) || !o.muon_lr.is_finite() {
            return user(format!("optim.muon_lr must be positive, got {}", o.muon_lr));
        }
        if !(0.0..1.0).contains(&o.muon_momentum) {
            return user(format!("optim.muon_momentum must be in [0, 1), got {}", o.muon_momentum));
        }
        if !(1..100).contains(&o.muon_ns_steps) {
            return user(format!("optim.muon_ns_steps must be in 1..=99, got {}", o.muon_ns_steps));
        }
        if self.lora.rank > 0 && self.parallel.tp > 1 {
            return user(format!("optim.name = muon with LoRA adapters under tensor parallelism (parallel.tp = {}) is not supported: the adapters' parts are not gathered whole; use optim.name = adamw", self.parallel.tp));
        }
        self.optim_without_adam_state()
    }

    /// Adafactor's keys; its statistics need each tensor whole on its rank.
    fn validate_adafactor(&self) -> Result<()> {
        let o = &self.optim;
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN must be refused too
        let bad = if !(o.adafactor_beta2_decay <= 0.0) {
            Some(("optim.adafactor_beta2_decay", "at most 0", o.adafactor_beta2_decay))
        } else if !(o.adafactor_eps2 >= 0.0) || !o.adafactor_eps2.is_finite() {
            Some(("optim.adafactor_eps2", "a non-negative number", o.adafactor_eps2))
        } else if !(o.adafactor_d > 0.0) || !o.adafactor_d.is_finite() {
            Some(("optim.adafactor_d", "positive", o.adafactor_d))
        } else {
            None
        };
        if let Some((k, what, v)) = bad {
            return user(format!("{k} must be {what}, got {v}"));
        }
        let p = &self.parallel;
        if p.tp > 1 || (p.zero > 0 && (p.dp > 1 || self.faults.elastic_max > 1)) {
            return user(format!("optim.name = adafactor factors each tensor's statistics whole, which ZeRO (parallel.zero = {}) over several ranks and tensor parallelism (parallel.tp = {}) split; use parallel.zero = 0 and tp = 1, or another optimizer", p.zero, p.tp));
        }
        if self.memory.offload != Offload::None {
            return user("optim.name = adafactor keeps statistics a row and a column long per matrix: there are no moments for memory.offload = optimizer to stream; use memory.offload = none");
        }
        self.optim_without_adam_state()
    }

    /// Lion and Muon keep no Adam variance, which 1-bit and 0/1 Adam's compression needs.
    fn optim_without_adam_state(&self) -> Result<()> {
        let (o, c) = (self.optim.name, self.parallel.compression);
        if o != OptimName::AdamW && matches!(c, Compression::OnebitAdam | Compression::ZerooneAdam) {
            return user(format!("parallel.compression = {} compresses Adam's momentum against its variance: it needs optim.name = adamw, got {}", c.name(), o.name()));
        }
        Ok(())
    }

    /// The data split, LoRA's base, checkpoint retention and intervals.
    fn validate_data_and_checkpoints(&self) -> Result<()> {
        let d = &self.data;
        if !(d.val_fraction > 0.0 && d.val_fraction < 1.0) {
            return user(format!("data.val_fraction must be in (0, 1), got {}", d.val_fraction));
        }
        if !d.sources.is_empty() && !d.paths.is_empty() {
            return user("data.sources and data.paths (--data) both name the data: give one of them");
        }
        for (i, s) in d.sources.iter().enumerate() {
            if !(s.weight.is_finite() && s.weight > 0.0) {
                return user(format!("data.sources[{i}].weight must be a positive number, got {}", s.weight));
            }
            if s.path.is_empty() {
                return user(format!("data.sources[{i}].path is empty"));
            }
        }
        if d.text_field.is_empty() {
            return user("data.text_field is empty");
        }
        if d.reset_positions && d.packing != Packing::Documents {
            return user("data.reset_positions needs data.packing = \"documents\" (windows have no document starts)");
        }
        if self.lora.quantize_base != model::BaseQuant::None && self.lora.rank == 0 {
            return user(format!("lora.quantize_base = \"{}\" quantizes a frozen base: it needs LoRA adapters (lora.rank > 0, --lora-rank)", plan::policy::Names::name(self.lora.quantize_base)));
        }
        if self.lora.rank > 0 && self.model.init_from.is_empty() {
            return user("lora.rank needs a base model to adapt: pass --init-from (a kiln run directory or a Hugging Face directory)");
        }
        if self.checkpoint.keep == 0 {
            return user("checkpoint.keep must be positive, got 0");
        }
        if !(self.checkpoint.mtbf_s >= 0.0 && self.checkpoint.mtbf_s.is_finite()) {
            return user(format!("checkpoint.mtbf_s must be a non-negative number of seconds, got {}", self.checkpoint.mtbf_s));
        }
        Ok(())
    }

    /// Mixed precision, fp16 loss scaling, offload and the memory limit.
    fn validate_precision_and_memory(&self) -> Result<()> {
        let t = &self.train;
        if t.fp8_amax_history == 0 {
            return user("train.fp8_amax_history must be positive, got 0");
        }
        if !(t.loss_scale >= 1.0 && t.loss_scale.is_finite()) || t.loss_scale_window == 0 {
            return user(format!("train.loss_scale must be a finite number ≥ 1 and train.loss_scale_window positive, got {} and {}", t.loss_scale, t.loss_scale_window));
        }
        if self.model.moe_bias_rate > 0.0 && self.parallel.compression != Compression::None {
            return user(format!("model.moe_bias_rate with parallel.compression = {} is not supported: the compressed update has no place for the router's balancing signal", self.parallel.compression.name()));
        }
        if t.precision == model::Precision::Fp8 && self.model.kv_lora_rank > 0 {
            return user("train.precision = fp8 with multi-head latent attention (model.kv_lora_rank) is not supported yet: its latent projections have no FP8 scaling; use bf16");
        }
        if !matches!(t.precision, model::Precision::Fp32 | model::Precision::Bf16) && self.lora.rank > 0 {
            return user(format!("train.precision = {} with LoRA is not supported: LoRA runs in fp32 or bf16 (a bf16 base and bf16 products, the adapters fp32)", t.precision.name()));
        }
        crate::util::parse_size(&self.memory.limit).map_err(|e| crate::error::KilnError::User(format!("memory.limit: {e}")))?;
        crate::util::parse_size(&self.memory.device_limit).map_err(|e| crate::error::KilnError::User(format!("memory.device_limit: {e}")))?;
        let ac = self.memory.activation_compression;
        if ac != plan::policy::ActCompression::None && self.model.recompute == model::Recompute::Full {
            return user(format!("memory.activation_compression = {} needs model.recompute = none or selective: full recomputation keeps no block activations to compress", plan::policy::Names::name(ac)));
        }
        Ok(())
    }

    /// The layout against a base model's keys (`--init-from`), which `validate` skips: the
    /// checks of [`RunConfig::validate_parallel_model`] and the pipeline's split of layers.
    pub(crate) fn validate_against_base(&self) -> Result<()> {
        self.validate_parallel_model()?;
        self.stage_layers(256).map(|_| ())
    }

    /// The layout against the model: tensor parallelism's split of heads and MLP columns, expert
    /// parallelism's of experts, context parallelism's of positions and heads.
    fn validate_parallel_model(&self) -> Result<()> {
        let p = &self.parallel;
        let g = self.gpt_config(256);
        if p.tp > 1 {
            parallel::tp::local_config(&g, p.tp, 0, false).map_err(crate::error::KilnError::User)?;
        }
        if p.ep > 1 {
            parallel::ep::local_config(&g, p.ep, 0).map_err(crate::error::KilnError::User)?;
        }
        if p.cp > 1 {
            let (heads, kv) = if p.tp > 1 {
                let l = parallel::tp::local_config(&g, p.tp, 0, false).map_err(crate::error::KilnError::User)?;
                (l.n_head, l.n_kv_head)
            } else {
                (g.n_head, g.n_kv_head)
            };
            if let Some(e) = parallel::cp::check(self.seq_len(), heads, kv, p.cp, p.cp_mode, p.cp_balance == plan::policy::CpBalance::Zigzag) {
                return user(e);
            }
        }
        Ok(())
    }

    /// The parallel layout: backend, degrees, ZeRO, tensor, expert and sequence parallelism,
    /// in-memory checkpoints and injected rank failures.
    fn validate_parallel(&self) -> Result<()> {
        let p = &self.parallel;
        let world = p.world(p.dp);
        if self.checkpoint.memory_interval > 0 && (p.backend == Backend::Mpi || world < 2) {
            return user(format!(
                "checkpoint.memory_interval = {} needs at least two in-process ranks (a peer to keep each rank's copy), got parallel.backend = {} with {world} rank(s): under MPI a failed rank takes the whole job, and the peers' memory, with it",
                self.checkpoint.memory_interval, p.backend.name()
            ));
        }
        // (An elastic run's lists name original ranks, which a shrunk world no longer has.)
        if let Some(r) = self.faults.fail_ranks.iter().find(|&&r| p.backend != Backend::Mpi && r >= world && self.faults.elastic_rows == 0) {
            return user(format!("faults.fail_ranks names rank {r}, but the run has {world} rank(s)"));
        }
        if p.dp == 0 && p.backend != Backend::Mpi {
            return user("parallel.dp must be positive, got 0 (0 means `all MPI processes` and needs parallel.backend = mpi)");
        }
        if p.zero > 3 {
            return user(format!("parallel.zero must be 0, 1, 2 or 3, got {}", p.zero));
        }
        if p.tp == 0 {
            return user("parallel.tp must be positive, got 0");
        }
        if p.tp > 1 && self.lora.rank > 0 {
            return user(format!("parallel.tp = {} with LoRA is not supported: the adapters are tiny; use data parallelism (parallel.dp)", p.tp));
        }
        // The model's own limits on the layout: with --init-from they are checked once the
        // base's keys are adopted (`adopt_base`), not against the preset's model.
        if self.model.init_from.is_empty() {
            self.validate_parallel_model()?;
        }
        if p.ep == 0 {
            return user("parallel.ep must be positive, got 0");
        }
        if p.ep > 1 {
            if p.zero > 0 {
                return user(format!("parallel.ep = {} with parallel.zero = {}: ZeRO stages 1-3 are not supported with expert parallelism (their per-unit shards would cut across the expert blocks); use parallel.zero = 0", p.ep, p.zero));
            }
            if self.lora.rank > 0 {
                return user(format!("parallel.ep = {} with LoRA is not supported: the adapters are tiny; use data parallelism (parallel.dp)", p.ep));
            }
        }
        if p.zero > 0 && self.lora.rank > 0 {
            return user(format!("parallel.zero = {} with LoRA: the adapters are tiny and the base is frozen; use parallel.zero = 0", p.zero));
        }
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN must be refused too
        if !(p.bucket_mb > 0.0) {
            return user(format!("parallel.bucket_mb must be positive, got {}", p.bucket_mb));
        }
        if p.dp > 0 {
            self.check_dp(p.dp)?;
        }
        if p.sequence_parallel && p.tp < 2 {
            return user(format!("parallel.sequence_parallel needs tensor parallelism (parallel.tp > 1, got {})", p.tp));
        }
        if p.nccl && !self.train.device.starts_with("cuda") {
            return user(format!("parallel.nccl = true: NCCL runs on CUDA devices (train.device = {})", self.train.device));
        }
        if p.cp == 0 {
            return user("parallel.cp must be positive, got 0");
        }
        let seq_local = self.seq_len() / p.cp.max(1);
        if p.sequence_parallel && !seq_local.is_multiple_of(p.tp) {
            let what = if p.cp > 1 { format!("each context-parallel rank's {seq_local} positions (train.seq_len = {} over parallel.cp = {})", self.seq_len(), p.cp) } else { format!("the sequence length train.seq_len = {}", self.seq_len()) };
            return user(format!("parallel.sequence_parallel: parallel.tp = {} does not divide {what}", p.tp));
        }
        Ok(())
    }

    /// The pipeline: stages, virtual stages, the schedule, the layer split, the trace.
    fn validate_pipeline(&self) -> Result<()> {
        let (p, t) = (&self.parallel, &self.train);
        if p.pp == 0 {
            return user("parallel.pp must be positive, got 0");
        }
        if p.virtual_stages == 0 {
            return user("parallel.virtual_stages must be positive, got 0");
        }
        parallel::pp::Schedule::new(p.schedule, p.pp, t.grad_accum, p.virtual_stages).map_err(|e| crate::error::KilnError::User(format!("parallel.schedule = {}: {e} (micro-batches are train.grad_accum, --micro-batches)", p.schedule.name())))?;
        // With --init-from the layers are the base's: `validate_against_base`.
        if self.model.init_from.is_empty() {
            self.stage_layers(256)?;
        }
        if p.pp > 1 && self.lora.rank > 0 {
            return user(format!("parallel.pp = {} with LoRA is not supported: the adapters are tiny; use data parallelism (parallel.dp)", p.pp));
        }
        if p.pp_trace == PpTrace::Device && (p.dp != 1 || p.tp != 1 || p.ep != 1 || p.cp != 1) {
            return user(format!("parallel.pp_trace = device serialises compute across ranks, which needs parallel.dp = 1, parallel.tp = 1, parallel.ep = 1 and parallel.cp = 1 (got dp {} × tp {} × ep {} × cp {}); use `wall`", p.dp, p.tp, p.ep, p.cp));
        }
        Ok(())
    }

    /// The model config for a tokenizer vocabulary of `vocab` tokens.
    pub fn gpt_config(&self, vocab: usize) -> model::GptConfig {
        let m = &self.model;
        let arch = m.arch;
        model::GptConfig {
            arch,
            n_layer: m.n_layer,
            n_head: m.n_head,
            n_kv_head: if m.n_kv_head == 0 { m.n_head } else { m.n_kv_head },
            n_embd: m.n_embd,
            ffn_hidden: match (m.ffn_hidden, arch) {
                (0, model::config::Arch::Gpt2) => 4 * m.n_embd,
                (0, model::config::Arch::Llama) => model::GptConfig::llama_ffn(m.n_embd),
                (f, _) => f,
            },
            block_size: m.block_size,
            vocab_size: if m.vocab_size == 0 { padded_vocab(vocab) } else { m.vocab_size },
            bias: m.bias,
            dropout: m.dropout as f32,
            tied_embeddings: m.tied_embeddings,
            rope_theta: m.rope_theta as f32,
            rope_scaling: match m.rope_scaling {
                RopeKind::None => None,
                RopeKind::Linear => Some(model::config::RopeScaling::Linear { factor: m.rope_factor as f32 }),
                RopeKind::Llama3 => Some(model::config::RopeScaling::Llama3 {
                    factor: m.rope_factor as f32,
                    low_freq_factor: m.rope_low_freq_factor as f32,
                    high_freq_factor: m.rope_high_freq_factor as f32,
                    original_max_position_embeddings: m.rope_original_max_positions,
                }),
                RopeKind::Yarn => Some(model::config::RopeScaling::Yarn {
                    factor: m.rope_factor as f32,
                    original_max_position_embeddings: m.rope_original_max_positions,
                    beta_fast: m.rope_beta_fast as f32,
                    beta_slow: m.rope_beta_slow as f32,
                    // 0: YaRN's own, from the factor.
                    attention_factor: if m.rope_attention_factor == 0.0 { model::config::yarn_mscale(m.rope_factor, 1.0) as f32 } else { m.rope_attention_factor as f32 },
                    truncate: m.rope_truncate,
                }),
                RopeKind::Dynamic => Some(model::config::RopeScaling::Dynamic { factor: m.rope_factor as f32, original_max_position_embeddings: m.rope_original_max_positions }),
                RopeKind::LongRope => Some(model::config::RopeScaling::LongRope {
                    short_factor: m.rope_short_factor.iter().map(|&f| f as f32).collect(),
                    long_factor: m.rope_long_factor.iter().map(|&f| f as f32).collect(),
                    original_max_position_embeddings: m.rope_original_max_positions,
                    // 0: LongRoPE's own, from the context's stretch.
                    attention_factor: if m.rope_attention_factor == 0.0 {
                        model::config::longrope_attention_factor(m.block_size as f64 / m.rope_original_max_positions.max(1) as f64, m.rope_original_max_positions) as f32
                    } else {
                        m.rope_attention_factor as f32
                    },
                }),
            },
            qkv_bias: m.qkv_bias,
            fused_proj: m.fused_proj,
            qk_norm: m.qk_norm,
            qk_norm_whole: m.qk_norm_whole,
            block_norms: m.block_norms,
            gate_act: m.gate_act,
            norm_offset: m.norm_offset,
            embed_scale: m.embed_scale,
            query_pre_attn_scalar: m.query_pre_attn_scalar,
            rope_local_theta: m.rope_local_theta as f32,
            attn_softcap: m.attn_softcap as f32,
            final_softcap: m.final_softcap as f32,
            kv_lora_rank: m.kv_lora_rank,
            q_lora_rank: m.q_lora_rank,
            v_head_dim: m.v_head_dim,
            rope_interleave: m.rope_interleave,
            pad_token_id: usize::try_from(m.pad_token_id).ok(),
            rotary_dim: m.rotary_dim,
            sliding_window: m.sliding_window,
            attn_sinks: m.attn_sinks,
            window_layers: m.window_layers.clone(),
            nope_layers: m.nope_layers.clone(),
            head_dim: m.head_dim,
            norm_eps: m.norm_eps as f32,
            n_expert: m.n_expert,
            top_k: m.top_k,
            n_shared_expert: m.n_shared_expert,
            capacity_factor: m.capacity_factor as f32,
            moe_aux_weight: m.moe_aux_weight as f32,
            moe_z_weight: m.moe_z_weight as f32,
            moe_router: m.moe_router,
            moe_groups: m.moe_groups,
            moe_topk_groups: m.moe_topk_groups,
            moe_gate_scale: m.moe_gate_scale as f32,
            moe_bias_rate: m.moe_bias_rate as f32,
            moe_first_layer: m.moe_first_layer,
            dense_ffn_hidden: m.dense_ffn_hidden,
            place: model::Placement::default(),
        }
    }

    /// The rows the loss predicts for a tokenizer of `tokenizer_vocab` ids (`model.loss_vocab`).
    pub fn loss_vocab(&self, tokenizer_vocab: usize) -> usize {
        if self.model.loss_vocab == 0 { tokenizer_vocab } else { self.model.loss_vocab }
    }

    /// Tokens per training sequence: `train.seq_len`, or `model.block_size` while it is 0.
    pub fn seq_len(&self) -> usize {
        if self.train.seq_len == 0 { self.model.block_size } else { self.train.seq_len }
    }

    pub fn micro_batch(&self) -> usize {
        self.train.batch_size / self.train.grad_accum
    }

    pub fn lr_decay_steps(&self) -> u64 {
        if self.train.lr_decay_steps == 0 { self.train.max_steps } else { self.train.lr_decay_steps }
    }

    /// Learning rate at 0-based step `it`: linear warmup, then cosine decay to `min_lr` over
    /// `lr_decay_steps`, then `min_lr` (nanoGPT's `get_lr`).
    pub fn lr_at(&self, it: u64) -> f64 {
        let t = &self.train;
        if it < t.warmup_steps {
            return t.lr * (it + 1) as f64 / (t.warmup_steps + 1) as f64;
        }
        let decay = self.lr_decay_steps();
        if it > decay {
            return t.min_lr;
        }
        let span = (decay - t.warmup_steps).max(1) as f64;
        let ratio = (it - t.warmup_steps) as f64 / span;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        t.min_lr + coeff * (t.lr - t.min_lr)
    }
}

/// Model vocabulary for a tokenizer of `vocab` tokens: exact up to 256, else rounded up to a
/// multiple of 64 (Karpathy's 50257 → 50304, which speeds the LM-head matmul).
pub fn padded_vocab(vocab: usize) -> usize {
    if vocab <= 256 { vocab } else { vocab.div_ceil(64) * 64 }
}

/// Keys that fix the shape of the model or the meaning of its tokens: a run resumed with a
/// different value for any of them cannot continue from its checkpoint.
pub const STRUCTURAL_KEYS: &[&str] = &[
    "model.arch", "model.n_layer", "model.n_head", "model.n_kv_head", "model.n_embd", "model.ffn_hidden", "model.block_size",
    "model.vocab_size", "model.bias", "model.tied_embeddings", "model.rope_theta", "model.norm_eps", "model.init_from",
    "model.rope_scaling", "model.rope_factor", "model.rope_low_freq_factor", "model.rope_high_freq_factor",
    "model.rope_original_max_positions", "model.rope_beta_fast", "model.rope_beta_slow", "model.rope_attention_factor", "model.rope_truncate",
    "model.rope_short_factor", "model.rope_long_factor", "model.fused_proj", "model.qk_norm", "model.qk_norm_whole", "model.block_norms", "model.gate_act", "model.norm_offset", "model.embed_scale", "model.query_pre_attn_scalar", "model.rope_local_theta", "model.attn_softcap", "model.final_softcap", "model.kv_lora_rank", "model.q_lora_rank", "model.v_head_dim", "model.rope_interleave", "model.pad_token_id", "model.rotary_dim", "model.qkv_bias", "model.sliding_window", "model.attn_sinks", "model.window_layers", "model.nope_layers", "model.loss_vocab", "model.head_dim",
    "model.n_expert", "model.top_k", "model.n_shared_expert", "model.moe_router", "model.moe_groups", "model.moe_topk_groups", "model.moe_first_layer", "model.dense_ffn_hidden",
    "lora.rank", "lora.targets", "data.tokenizer", "data.paths", "data.val_fraction", "data.text_field", "data.format",
    "data.packing", "data.reset_positions", "data.sources",
];

impl RunConfig {
    /// Checks that `dp` data-parallel ranks (times `parallel.ep`: expert-parallel ranks split
    /// the batch too) can split the global batch: each micro-batch's sequences divide evenly
    /// among them.
    pub fn check_dp(&self, dp: usize) -> Result<()> {
        let mb = self.micro_batch();
        let ep = self.parallel.ep;
        if ep > 1 && !mb.is_multiple_of(dp * ep) {
            return user(format!(
                "parallel.dp = {dp} × parallel.ep = {ep} = {} ranks split the batch, but they do not divide the micro-batch: train.batch_size {} / train.grad_accum {} = {mb} sequences per micro-batch",
                dp * ep, self.train.batch_size, self.train.grad_accum
            ));
        }
        if !mb.is_multiple_of(dp) {
            return user(format!(
                "parallel.dp = {dp} does not divide the micro-batch: train.batch_size {} / train.grad_accum {} = {mb} sequences per micro-batch must split evenly over {dp} ranks",
                self.train.batch_size, self.train.grad_accum
            ));
        }
        Ok(())
    }

    /// The pipeline's virtual stages as layer ranges (`parallel.pp × parallel.virtual_stages`
    /// of them): as `parallel.pp_layers` lists, or balanced by cost (a block's FLOPs per
    /// token, and the head's on the last stage).
    /// `vocab` is the tokenizer's vocabulary size (the head's cost).
    pub fn stage_layers(&self, vocab: usize) -> Result<Vec<std::ops::Range<usize>>> {
        let p = &self.parallel;
        let g = self.gpt_config(vocab);
        let k = p.pp * p.virtual_stages;
        let c = g.n_embd as f64;
        // Per token: a block's matmuls (2 FLOPs per weight, forward) and attention; the head's V·C.
        let layer = 2.0 * (c * g.qkv_width() as f64 + g.attn_width() as f64 * c + g.fc_width() as f64 * c + g.ffn_hidden as f64 * c) + 4.0 * c * g.block_size as f64;
        let head = 2.0 * c * g.vocab_size as f64;
        parallel::pp::split_layers(g.n_layer, k, &p.pp_layers, layer, head).map_err(crate::error::KilnError::User)
    }

    /// `memory.device_limit` in bytes (0 = none); checked by `validate`.
    pub fn device_memory_limit(&self) -> u64 {
        crate::util::parse_size(&self.memory.device_limit).unwrap_or(0)
    }

    /// `memory.limit` in bytes (0 = none); checked by `validate`.
    pub fn memory_limit(&self) -> u64 {
        crate::util::parse_size(&self.memory.limit).unwrap_or(0)
    }
}

/// The user's overrides of `kiln train` (and `kiln memory`), layered over a preset or a saved
/// run's config by [`layered`].
#[derive(Clone, Debug, Default)]
pub struct TrainArgs {
    pub preset: Option<String>,
    pub config: Option<PathBuf>,
    pub out: Option<PathBuf>,
    pub set: Vec<String>,
    /// The dedicated flags that set a config key (`--dp 2` sets `parallel.dp = 2`), from the
    /// one table in `cmd_train`; applied after `--set`, so they win.
    pub flags: Vec<Flag>,
    pub resume: bool,
    /// Record a trace of this many steps into `trace.json`.
    pub profile: Option<u64>,
    pub quiet: bool,
    /// Under an elastic supervisor (`--elastic-slots`): each MPI rank's original number, and
    /// the ranks lost for good (`--elastic-lost`), which may come back.
    pub slots: Vec<usize>,
    pub lost: Vec<usize>,
}

/// A flag's value for its config key.
#[derive(Clone, Debug)]
pub struct Flag {
    pub flag: &'static str,
    pub key: &'static str,
    pub value: toml::Value,
}

/// Builds the config from a base and the user's overrides, in order: the file, `--set`, then
/// the dedicated flags; each is checked against the key's type, and the error names its origin.
pub fn layered(base: &RunConfig, args: &TrainArgs) -> Result<RunConfig> {
    RunConfig::resolve(&layered_raw(base, args)?)
}

/// [`layered`]'s keys before they are resolved (and checked).
pub fn layered_raw(base: &RunConfig, args: &TrainArgs) -> Result<Raw> {
    let mut raw: Raw = base.to_raw();
    if let Some(p) = &args.config {
        apply_file(&mut raw, p)?;
    }
    for kv in &args.set {
        apply_set(&mut raw, kv)?;
    }
    for f in &args.flags {
        set_key(&mut raw, f.key, f.value.clone(), f.flag)?;
    }
    Ok(raw)
}
