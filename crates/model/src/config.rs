//! The decoder config. Field names are the `model.*` config keys.

use serde::{Deserialize, Serialize};
pub use crate::placement::{ContextSlice, Part, Placement, SeqSlice, Stage};

/// The block family. GPT-2: LayerNorm, learned positions, GELU MLP, multi-head attention,
/// biases optional. LLaMA: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention,
/// no biases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Gpt2,
    Llama,
}

impl plan::policy::Names for Arch {
    const NAMES: &'static [(&'static str, Arch)] = &[("gpt2", Arch::Gpt2), ("llama", Arch::Llama)];
}

/// Where a block's norms sit around its two branches (attention, MLP), each branch `y = f(x)`
/// added to the residual stream `x`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockNorms {
    /// `x + f(norm(x))`: GPT-2, LLaMA and most decoders.
    #[default]
    Pre,
    /// `x + norm(f(x))`: OLMo 2's reordered norms.
    Post,
    /// `x + norm(f(norm(x)))`: Gemma 2 and 3's sandwich norms.
    Sandwich,
}

impl BlockNorms {
    /// Whether a norm precedes each branch.
    pub fn pre(self) -> bool {
        self != BlockNorms::Post
    }

    /// Whether a norm follows each branch (before the residual add).
    pub fn post(self) -> bool {
        self != BlockNorms::Pre
    }
}

/// The activation of a gated MLP's gate (llama arch): `down(act(gate(x)) · up(x))`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateAct {
    /// SiLU: SwiGLU (LLaMA and most decoders).
    #[default]
    Silu,
    /// GELU's tanh approximation: GeGLU (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

impl plan::policy::Names for GateAct {
    const NAMES: &'static [(&'static str, GateAct)] = &[("silu", GateAct::Silu), ("gelu_tanh", GateAct::GeluTanh)];
}

/// How an MoE router scores its experts (see [`GptConfig::moe_router`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MoeRouter {
    #[default]
    Softmax,
    Sigmoid,
}

impl plan::policy::Names for MoeRouter {
    const NAMES: &'static [(&'static str, MoeRouter)] = &[("softmax", MoeRouter::Softmax), ("sigmoid", MoeRouter::Sigmoid)];
}

fn one() -> usize {
    1
}

fn unit() -> f32 {
    1.0
}

impl plan::policy::Names for BlockNorms {
    const NAMES: &'static [(&'static str, BlockNorms)] = &[("pre", BlockNorms::Pre), ("post", BlockNorms::Post), ("sandwich", BlockNorms::Sandwich)];
}

/// The defaults of the optional shape and MoE values, for [`GptConfig::gpt2`] and kiln's
/// `model.*` keys alike.
pub mod defaults {
    pub const ROPE_THETA: f64 = 10000.0;
    pub const NORM_EPS: f64 = 1e-5;
    pub const TOP_K: usize = 2;
    pub const MOE_AUX_WEIGHT: f64 = 0.01;
    pub const MOE_Z_WEIGHT: f64 = 0.001;
}

/// Rope scaling (transformers' `rope_type`): how the inverse frequencies of plain RoPE are
/// rescaled to stretch a model's context.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Positions divided by `factor` (every inverse frequency over `factor`).
    Linear { factor: f32 },
    /// Llama 3.1: wavelengths above `original_max_position_embeddings / low_freq_factor` are
    /// stretched by `factor`, those below `… / high_freq_factor` kept, the band between
    /// interpolated smoothly.
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position_embeddings: usize },
    /// YaRN (Peng et al. 2023, transformers' `_compute_yarn_parameters`): each frequency blends
    /// its value over `factor` (interpolated) and its own (extrapolated) by a linear ramp over
    /// the dimensions between `beta_fast` and `beta_slow` rotations in
    /// `original_max_position_embeddings` (the ramp's ends rounded out when `truncate`), and
    /// cos / sin are scaled by `attention_factor` (the logits by its square).
    Yarn { factor: f32, original_max_position_embeddings: usize, beta_fast: f32, beta_slow: f32, attention_factor: f32, truncate: bool },
    /// LongRoPE (Phi-3; transformers' `_compute_longrope_parameters`): inverse frequency `i`
    /// divided by its own factor, `short_factor[i]` in a pass over at most
    /// `original_max_position_embeddings` positions and `long_factor[i]` in a longer one (the
    /// whole pass switches, as transformers' `longrope_frequency_update` does), and cos / sin
    /// scaled by `attention_factor`.
    LongRope { short_factor: Vec<f32>, long_factor: Vec<f32>, original_max_position_embeddings: usize, attention_factor: f32 },
    /// Dynamic NTK (transformers' `_compute_dynamic_ntk_parameters`): plain RoPE in every pass
    /// over at most `original_max_position_embeddings` positions (the Hugging Face config's
    /// `max_position_embeddings`); only longer passes rescale the base, and a model's
    /// `block_size` may not exceed that length, so kiln never runs one.
    Dynamic { factor: f32, original_max_position_embeddings: usize },
}

/// LongRoPE's default attention factor (transformers): `sqrt(1 + ln(factor) / ln(original))`
/// for `factor = max positions / original max positions` above 1, else 1.
pub fn longrope_attention_factor(factor: f64, original: usize) -> f64 {
    if factor <= 1.0 { 1.0 } else { (1.0 + factor.ln() / (original as f64).ln()).sqrt() }
}

/// YaRN's mscale (its paper's Eq. 21, transformers' `yarn_get_mscale`): `0.1·m·ln(scale) + 1`,
/// 1 for `scale ≤ 1`. The default attention factor is `yarn_mscale(factor, 1)`.
pub fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 }
}

impl RopeScaling {
    /// The inverse frequencies of RoPE with base `theta` over head size `hs`, rescaled, in fp32
    /// as transformers' `_compute_linear_scaling_rope_parameters` / `_compute_llama3_parameters`
    /// / `_compute_yarn_parameters` compute them.
    /// In a pass over more than [`RopeScaling::long_after`] positions LongRoPE uses
    /// [`RopeScaling::inv_freq_long`] instead.
    pub fn inv_freq(&self, theta: f32, hs: usize) -> Vec<f32> {
        let mut f = tensor::llama::rope_inv_freq(theta, hs);
        self.apply(&mut f, theta, hs, false);
        f
    }

    /// LongRoPE's inverse frequencies for a pass longer than [`RopeScaling::long_after`]
    /// positions (the others' are [`RopeScaling::inv_freq`]'s).
    pub fn inv_freq_long(&self, theta: f32, hs: usize) -> Vec<f32> {
        let mut f = tensor::llama::rope_inv_freq(theta, hs);
        self.apply(&mut f, theta, hs, true);
        f
    }

    /// The pass length above which the frequencies change (LongRoPE's original context); `None`
    /// for the scalings whose frequencies do not depend on it.
    pub fn long_after(&self) -> Option<usize> {
        match self {
            RopeScaling::LongRope { original_max_position_embeddings, .. } => Some(*original_max_position_embeddings),
            _ => None,
        }
    }

    /// What cos and sin are multiplied by (YaRN's and LongRoPE's attention factor; 1 otherwise).
    pub fn attention_factor(&self) -> f32 {
        match *self {
            RopeScaling::Yarn { attention_factor, .. } | RopeScaling::LongRope { attention_factor, .. } => attention_factor,
            _ => 1.0,
        }
    }

    fn apply(&self, inv_freq: &mut [f32], theta: f32, hs: usize, long: bool) {
        match *self {
            // Plain RoPE in every pass kiln runs (validate).
            RopeScaling::Dynamic { .. } => {}
            RopeScaling::LongRope { ref short_factor, ref long_factor, .. } => {
                // transformers: 1 / (ext · base^(2i/d)), the product in fp32.
                let ext = if long { long_factor } else { short_factor };
                let pos = tensor::llama::rope_pos_freq(theta, hs);
                for ((f, &p), &e) in inv_freq.iter_mut().zip(&pos).zip(ext) {
                    *f = 1.0 / (e * p);
                }
            }
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let old = original_max_position_embeddings as f32;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    let scaled = if wavelen > low_wavelen { *f / factor } else { *f };
                    // As transformers' `~(wavelen < high) * ~(wavelen > low)`: a NaN wavelength must count as medium.
                    #[allow(clippy::neg_cmp_op_on_partial_ord)]
                    let medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
                    *f = if medium {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
            }
            RopeScaling::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, .. } => {
                // The ramp's ends in f64 (Python floats), the frequencies in fp32 (torch's).
                let (dim, base) = (hs as f64, theta as f64);
                let dim_of = |rotations: f64| dim * (original_max_position_embeddings as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
                let (mut low, mut high) = (dim_of(beta_fast as f64), dim_of(beta_slow as f64));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                let pos = tensor::llama::rope_pos_freq(theta, hs);
                for (i, (f, &p)) in inv_freq.iter_mut().zip(&pos).enumerate() {
                    let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
                    let extrapolated = 1.0 - ramp;
                    let interpolated = 1.0 / (factor * p);
                    *f = interpolated * (1.0 - extrapolated) + *f * extrapolated;
                }
            }
        }
    }

    /// Checks the factors (`hs`: the head width); the error names the key.
    fn validate(&self, hs: usize, block_size: usize) -> Result<(), String> {
        let factor = match *self {
            RopeScaling::Dynamic { factor, original_max_position_embeddings } => {
                if block_size > original_max_position_embeddings {
                    return Err(format!(
                        "rope scaling dynamic rescales only passes longer than its original context (model.rope_original_max_positions = {original_max_position_embeddings}), which kiln does not run: model.block_size = {block_size} must not exceed it"
                    ));
                }
                factor
            }
            RopeScaling::LongRope { ref short_factor, ref long_factor, original_max_position_embeddings, attention_factor } => {
                for (key, f) in [("rope_short_factor", short_factor), ("rope_long_factor", long_factor)] {
                    if f.len() != hs / 2 {
                        return Err(format!("model.{key} has {} factors; rope scaling longrope needs one per rotary frequency, head width / 2 = {}", f.len(), hs / 2));
                    }
                    if let Some(x) = f.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                        return Err(format!("model.{key} must hold finite positive factors, got {x}"));
                    }
                }
                if original_max_position_embeddings == 0 || !(attention_factor > 0.0 && attention_factor.is_finite()) {
                    return Err(format!(
                        "rope scaling longrope needs original_max_position_embeddings > 0 and a positive attention_factor, got {original_max_position_embeddings}, {attention_factor}"
                    ));
                }
                1.0
            }
            RopeScaling::Linear { factor } => factor,
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                if !(low_freq_factor > 0.0 && high_freq_factor > low_freq_factor) || original_max_position_embeddings == 0 {
                    return Err(format!(
                        "rope scaling llama3 needs 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0, got {low_freq_factor}, {high_freq_factor}, {original_max_position_embeddings}"
                    ));
                }
                factor
            }
            RopeScaling::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, attention_factor, .. } => {
                if original_max_position_embeddings == 0 || !(beta_fast > 0.0 && beta_slow > 0.0 && attention_factor > 0.0 && attention_factor.is_finite()) {
                    return Err(format!(
                        "rope scaling yarn needs original_max_position_embeddings > 0 and positive beta_fast, beta_slow and attention_factor, got {original_max_position_embeddings}, {beta_fast}, {beta_slow}, {attention_factor}"
                    ));
                }
                factor
            }
        };
        if !(factor >= 1.0 && factor.is_finite()) {
            return Err(format!("model.rope_factor must be a finite number ≥ 1, got {factor}"));
        }
        Ok(())
    }
}

/// The largest model `validate` accepts: 2^60 parameters, so a parameter count times four
/// bytes stays within u64 / usize. (Anything near it is refused by a memory check first.)
pub const MAX_PARAMS: u128 = 1 << 60;
/// The longest context `validate` accepts (2^32 positions).
pub const MAX_CONTEXT: usize = 1 << 32;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    pub arch: Arch,
    pub n_layer: usize,
    pub n_head: usize,
    /// Key/value heads (grouped-query attention; 1 is multi-query). Equals `n_head` for GPT-2.
    pub n_kv_head: usize,
    pub n_embd: usize,
    /// MLP width: 4·n_embd for GPT-2, the SwiGLU hidden size for LLaMA.
    pub ffn_hidden: usize,
    /// Maximum context length (rows of the position embedding, or of the rotary table).
    pub block_size: usize,
    /// Rows of the token embedding. May exceed the tokenizer's vocabulary (GPT-2: 50304 = 50257
    /// padded up to a multiple of 64 for matmul-friendly shapes); the padded rows are never
    /// predicted.
    pub vocab_size: usize,
    /// Biases in Linear layers and LayerNorms (GPT-2: true; nanoGPT's shakespeare-char: false).
    pub bias: bool,
    /// Dropout probability on embeddings, attention probabilities and residual branches.
    pub dropout: f32,
    /// Output head shares the token embedding matrix (GPT-2: true, LLaMA: false).
    pub tied_embeddings: bool,
    /// Rotary embedding base (LLaMA-2: 10000, LLaMA-3: 500000).
    pub rope_theta: f32,
    /// Rope scaling of the rotary frequencies (Llama 3.1's `llama3`, `linear`); `None` = plain.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Biases on the q, k and v projections only (Qwen2; llama arch).
    #[serde(default)]
    pub qkv_bias: bool,
    /// The token whose embedding row the lookup gives no gradient (transformers' `padding_idx`,
    /// its config's `pad_token_id`; llama arch). `None`: every row.
    #[serde(default)]
    pub pad_token_id: Option<usize>,
    /// RMSNorm over each head of q and of k before the rotary embedding (Qwen3's `q_norm`,
    /// `k_norm`; llama arch).
    #[serde(default)]
    pub qk_norm: bool,
    /// The q and k norms span all of a token's heads at once (OLMo 2's `q_norm` over
    /// `NH·HS`, `k_norm` over `NKV·HS`) rather than each head (with `qk_norm`).
    #[serde(default)]
    pub qk_norm_whole: bool,
    /// Where the block's norms sit (llama arch): before each branch, after it, or both.
    #[serde(default)]
    pub block_norms: BlockNorms,
    /// The gated MLP's gate activation (llama arch): SwiGLU's SiLU or GeGLU's GELU.
    #[serde(default)]
    pub gate_act: GateAct,
    /// Every RMSNorm scales by `1 + w` rather than `w` (Gemma; the stored weight is Gemma's).
    #[serde(default)]
    pub norm_offset: bool,
    /// The token embeddings are multiplied by `√n_embd` (Gemma; the tied head reads them
    /// unscaled).
    #[serde(default)]
    pub embed_scale: bool,
    /// Attention logits scaled by `query_pre_attn_scalar^-½` rather than `head_size^-½`
    /// (Gemma); 0 = the head size.
    #[serde(default)]
    pub query_pre_attn_scalar: usize,
    /// The rotary base of the sliding-window layers when it differs from `rope_theta` (Gemma 3's
    /// local layers, `rope_local_base_freq`), without rope scaling; 0 = `rope_theta` everywhere.
    #[serde(default)]
    pub rope_local_theta: f32,
    /// Soft-capping of the attention logits, `s ↦ cap·tanh(s / cap)` (Gemma 2's
    /// `attn_logit_softcapping`); 0 = none.
    #[serde(default)]
    pub attn_softcap: f32,
    /// Soft-capping of the output logits (Gemma 2's `final_logit_softcapping`); 0 = none.
    #[serde(default)]
    pub final_softcap: f32,
    /// Multi-head latent attention (DeepSeek-V2/V3's MLA) when above 0: keys and values are
    /// up-projected per head from a normed latent of this width (`kv_lora_rank`), beside one
    /// rotary key shared by every head (`rotary_dim` wide: `qk_rope_head_dim`); each head's q·k
    /// spans `head_dim` = `qk_nope_head_dim + qk_rope_head_dim` (llama arch, `n_kv_head =
    /// n_head`).
    #[serde(default)]
    pub kv_lora_rank: usize,
    /// MLA's query latent width (`q_lora_rank`): q down-projected, normed and up-projected;
    /// 0 = one q projection.
    #[serde(default)]
    pub q_lora_rank: usize,
    /// MLA's value head width (`v_head_dim`).
    #[serde(default)]
    pub v_head_dim: usize,
    /// MLA's rotary dimensions stored interleaved (transformers' `rope_interleave`: pairs
    /// `(2i, 2i+1)` rather than `(i, i + R/2)`).
    #[serde(default)]
    pub rope_interleave: bool,
    /// Hugging Face files hold q, k and v as one `qkv_proj` and gate and up as one
    /// `gate_up_proj` (Phi-3's `Phi3ForCausalLM`); the model itself is LLaMA's.
    #[serde(default)]
    pub fused_proj: bool,
    /// Sliding-window attention (Mistral; llama arch): each position attends to itself and the
    /// `sliding_window - 1` before it; 0 = all earlier positions.
    #[serde(default)]
    pub sliding_window: usize,
    /// Attention sinks under the sliding window (StreamingLLM): the first `attn_sinks`
    /// positions of each document stay visible to every later position; 0 = none.
    #[serde(default)]
    pub attn_sinks: usize,
    /// The (whole-model) layers the sliding window applies to, as Hugging Face configs name
    /// them per layer (Qwen2's `max_window_layers`, `layer_types`); empty = every layer. The
    /// others attend to every earlier position.
    #[serde(default)]
    pub window_layers: Vec<usize>,
    /// The (whole-model) layers whose attention has no rotary embedding (SmolLM3's NoPE layers:
    /// transformers' `no_rope_layers` zeros); empty = RoPE in every layer (llama arch).
    #[serde(default)]
    pub nope_layers: Vec<usize>,
    /// Width of each attention head when it is not `n_embd / n_head` (llama arch, as
    /// transformers' `head_dim`); 0 = `n_embd / n_head`.
    #[serde(default)]
    pub head_dim: usize,
    /// Dimensions of each head the rotary embedding turns when not all of them (transformers'
    /// `head_dim · partial_rotary_factor`, Phi-4-mini's 0.75); 0 = the whole head.
    #[serde(default)]
    pub rotary_dim: usize,
    /// Epsilon of LayerNorm / RMSNorm.
    pub norm_eps: f32,
    /// Routed experts per MoE layer (0 = dense MLP). With experts, `ffn_hidden` is each
    /// expert's SwiGLU width (Mixtral, DeepSeekMoE; llama arch only).
    pub n_expert: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Always-on shared experts (DeepSeekMoE).
    pub n_shared_expert: usize,
    /// Expert capacity `ceil(capacity_factor·N·top_k/n_expert)`; ≤ 0 = dropless.
    pub capacity_factor: f32,
    /// Weight of the Switch load-balancing loss.
    pub moe_aux_weight: f32,
    /// Weight of the ST-MoE router z-loss.
    pub moe_z_weight: f32,
    /// How the router scores experts: Mixtral's softmax, or DeepSeek-V3's sigmoid with
    /// group-limited selection steered by a per-expert correction bias
    /// (`mlp.gate.e_score_correction_bias`, held with the weights, never given a gradient).
    #[serde(default)]
    pub moe_router: MoeRouter,
    /// The sigmoid router's expert groups and the groups a token's experts come from.
    #[serde(default = "one")]
    pub moe_groups: usize,
    #[serde(default = "one")]
    pub moe_topk_groups: usize,
    /// The routed gates' factor after renormalising (DeepSeek-V3's `routed_scaling_factor`).
    #[serde(default = "unit")]
    pub moe_gate_scale: f32,
    /// The sigmoid router's auxiliary-loss-free balancing (DeepSeek-V3): after every step each
    /// expert's correction bias moves by this much, up when the step routed it fewer
    /// token-assignments than the mean, down when more; 0 = the bias stays as loaded.
    #[serde(default)]
    pub moe_bias_rate: f32,
    /// With experts: the (whole-model) layers before this one are dense MLPs of
    /// `dense_ffn_hidden` (DeepSeek-V3's `first_k_dense_replace`); 0 = every layer routed.
    #[serde(default)]
    pub moe_first_layer: usize,
    /// The dense layers' SwiGLU width in a model with experts (`intermediate_size`).
    #[serde(default)]
    pub dense_ffn_hidden: usize,
    /// Where this model sits in the whole model it is a part of (the default: it is the
    /// whole model). Set by `parallel` when it cuts a part; never serialised.
    #[serde(skip)]
    pub place: Placement,
}

impl GptConfig {
    /// A GPT-2-family config of `(n_layer, n_head, n_embd)` with the usual derived sizes.
    pub fn gpt2((n_layer, n_head, n_embd): (usize, usize, usize), block_size: usize, vocab_size: usize, bias: bool, dropout: f32, tied: bool) -> GptConfig {
        GptConfig {
            arch: Arch::Gpt2, n_layer, n_head, n_kv_head: n_head, n_embd, ffn_hidden: 4 * n_embd, block_size, vocab_size,
            bias, dropout, tied_embeddings: tied, rope_theta: defaults::ROPE_THETA as f32, rope_scaling: None, qkv_bias: false, pad_token_id: None, qk_norm: false, qk_norm_whole: false, block_norms: BlockNorms::Pre, gate_act: GateAct::Silu, norm_offset: false, embed_scale: false, query_pre_attn_scalar: 0, rope_local_theta: 0.0, attn_softcap: 0.0, final_softcap: 0.0, kv_lora_rank: 0, q_lora_rank: 0, v_head_dim: 0, rope_interleave: false, fused_proj: false, sliding_window: 0, attn_sinks: 0, window_layers: Vec::new(), nope_layers: Vec::new(), head_dim: 0, rotary_dim: 0, norm_eps: defaults::NORM_EPS as f32,
            n_expert: 0, top_k: defaults::TOP_K, n_shared_expert: 0, capacity_factor: 0.0, moe_aux_weight: defaults::MOE_AUX_WEIGHT as f32,
            moe_z_weight: defaults::MOE_Z_WEIGHT as f32, moe_router: MoeRouter::Softmax, moe_groups: 1, moe_topk_groups: 1, moe_gate_scale: 1.0, moe_bias_rate: 0.0, moe_first_layer: 0, dense_ffn_hidden: 0, place: Placement::default(),
        }
    }

    /// GPT-2 small (124M), Radford et al. 2019, with the vocabulary padded to 50304.
    pub fn gpt2_124m() -> GptConfig {
        GptConfig::gpt2((12, 12, 768), 1024, 50304, true, 0.0, true)
    }

    /// LLaMA's SwiGLU width for `n_embd` channels: 2/3 of 4·n_embd, rounded up to a multiple
    /// of 64 (Touvron et al. 2023, as in Meta's reference code with `multiple_of = 64`).
    pub fn llama_ffn(n_embd: usize) -> usize {
        (8 * n_embd / 3).div_ceil(64) * 64
    }

    /// Checks every size; the error names the `model.*` key at fault.
    pub fn validate(&self) -> Result<(), String> {
        for (key, v) in [("n_layer", self.n_layer), ("n_head", self.n_head), ("n_kv_head", self.n_kv_head), ("n_embd", self.n_embd), ("ffn_hidden", self.ffn_hidden), ("block_size", self.block_size), ("vocab_size", self.vocab_size)] {
            if v == 0 {
                return Err(format!("model.{key} must be positive, got 0"));
            }
        }
        // Sizes whose products would overflow 64-bit byte counts are refused before anything
        // multiplies them in usize; sizes that merely exceed a machine are the caller's to refuse
        // against its memory (kiln's plan), with `param_count` computed without overflow.
        if self.param_count() > MAX_PARAMS || self.block_size > MAX_CONTEXT {
            return Err(format!(
                "model sizes overflow 64-bit arithmetic: {:.3e} parameters ({:.3e} bytes of fp32 weights), {} positions (model.n_layer = {}, model.n_embd = {}, model.ffn_hidden = {}, model.vocab_size = {}, model.n_expert = {}, model.block_size = {}); at most 2^60 parameters and 2^32 positions",
                self.param_count() as f64, self.param_count() as f64 * 4.0, self.block_size, self.n_layer, self.n_embd, self.ffn_hidden, self.vocab_size, self.n_expert, self.block_size
            ));
        }
        if self.head_dim > 0 && self.arch != Arch::Llama {
            return Err("model.head_dim needs model.arch = llama (GPT-2's heads are n_embd / n_head wide)".into());
        }
        if self.head_dim == 0 && !self.n_embd.is_multiple_of(self.n_head) {
            return Err(format!("model.n_embd ({}) must be divisible by model.n_head ({})", self.n_embd, self.n_head));
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            return Err(format!("model.n_head ({}) must be divisible by model.n_kv_head ({})", self.n_head, self.n_kv_head));
        }
        if self.arch == Arch::Gpt2 && self.n_kv_head != self.n_head {
            return Err(format!("model.n_kv_head ({}) must equal model.n_head ({}) for arch gpt2 (grouped-query attention is a llama feature)", self.n_kv_head, self.n_head));
        }
        if self.arch == Arch::Llama && !self.head_size().is_multiple_of(2) {
            return Err(format!("the head width (model.head_dim, or model.n_embd / model.n_head) = {} must be even for rotary embeddings", self.head_size()));
        }
        if !(0.0..1.0).contains(&self.dropout) || self.dropout.is_nan() {
            return Err(format!("model.dropout must be in [0, 1), got {}", self.dropout));
        }
        if self.n_expert > 0 {
            if self.arch != Arch::Llama {
                return Err("model.n_expert > 0 needs model.arch = llama (the experts are SwiGLU MLPs)".into());
            }
            if self.top_k == 0 || self.top_k > self.n_expert {
                return Err(format!("model.top_k ({}) must be between 1 and model.n_expert ({})", self.top_k, self.n_expert));
            }
        }
        self.validate_router()?;
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN rope_theta must be refused too
        if !(self.rope_theta > 0.0) {
            return Err(format!("model.rope_theta must be positive, got {}", self.rope_theta));
        }
        if self.rotary_dim > 0 && (self.arch != Arch::Llama || !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_size()) {
            return Err(format!("model.rotary_dim = {} must be even and at most the head width ({}) of a llama-arch model", self.rotary_dim, self.head_size()));
        }
        if let Some(r) = &self.rope_scaling {
            if self.arch != Arch::Llama {
                return Err("model.rope_scaling needs model.arch = llama (rotary embeddings)".into());
            }
            r.validate(self.rotary_size(), self.block_size)?;
        }
        if self.sliding_window > 0 && self.arch != Arch::Llama {
            return Err("model.sliding_window needs model.arch = llama (GPT-2 attends to every earlier position)".into());
        }
        if !self.window_layers.is_empty() && self.sliding_window == 0 {
            return Err("model.window_layers needs a sliding window (model.sliding_window)".into());
        }
        if let Some(&l) = self.window_layers.iter().find(|&&l| l >= self.total_layers()) {
            return Err(format!("model.window_layers names layer {l}, but the model has {} (model.n_layer)", self.total_layers()));
        }
        if !self.nope_layers.is_empty() && self.arch != Arch::Llama {
            return Err("model.nope_layers needs model.arch = llama (GPT-2 has no rotary embedding)".into());
        }
        if let Some(&l) = self.nope_layers.iter().find(|&&l| l >= self.total_layers()) {
            return Err(format!("model.nope_layers names layer {l}, but the model has {} (model.n_layer)", self.total_layers()));
        }
        if self.attn_sinks > 0 && self.sliding_window == 0 {
            return Err(format!("model.attn_sinks = {} needs a sliding window (model.sliding_window): without one every earlier position is visible already", self.attn_sinks));
        }
        if self.fused_proj && (self.arch != Arch::Llama || self.qkv_bias || self.n_expert > 0) {
            return Err("model.fused_proj is Phi-3's form of a llama-arch model without q/k/v biases or experts".into());
        }
        if let Some(pad) = self.pad_token_id {
            if self.arch != Arch::Llama || pad >= self.vocab_size {
                return Err(format!("model.pad_token_id = {pad} must be a row of a llama-arch model's vocabulary (model.vocab_size = {})", self.vocab_size));
            }
        }
        if self.qk_norm && self.arch != Arch::Llama {
            return Err("model.qk_norm is a llama-arch setting (Qwen3's per-head q and k norms)".into());
        }
        if self.qk_norm_whole && !self.qk_norm {
            return Err("model.qk_norm_whole needs model.qk_norm (it says the q and k norms span every head at once)".into());
        }
        if self.block_norms != BlockNorms::Pre && self.arch != Arch::Llama {
            return Err("model.block_norms = post or sandwich needs model.arch = llama (RMSNorm blocks)".into());
        }
        if self.arch != Arch::Llama && (self.gate_act != GateAct::Silu || self.norm_offset || self.embed_scale || self.query_pre_attn_scalar > 0 || self.rope_local_theta != 0.0 || self.attn_softcap != 0.0 || self.final_softcap != 0.0) {
            return Err("model.gate_act, model.norm_offset, model.embed_scale, model.query_pre_attn_scalar, model.rope_local_theta and the soft-caps are llama-arch settings (Gemma's)".into());
        }
        self.validate_mla()?;
        for (key, cap) in [("attn_softcap", self.attn_softcap), ("final_softcap", self.final_softcap)] {
            #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN must be refused too
            if !(cap >= 0.0) || cap.is_infinite() {
                return Err(format!("model.{key} must be a finite cap above 0 (or 0: none), got {cap}"));
            }
        }
        if self.n_expert > 0 && self.gate_act != GateAct::Silu {
            return Err("model.gate_act = gelu_tanh with experts is not supported (the experts are SwiGLU MLPs)".into());
        }
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN must be refused too
        if self.rope_local_theta != 0.0 && !(self.rope_local_theta > 0.0) {
            return Err(format!("model.rope_local_theta must be positive (or 0: rope_theta everywhere), got {}", self.rope_local_theta));
        }
        if self.qkv_bias && self.arch != Arch::Llama {
            return Err("model.qkv_bias is a llama-arch setting (Qwen2); GPT-2's biases are model.bias".into());
        }
        Ok(())
    }

    /// Parameters of the whole model (every layer, every expert), computed from the sizes
    /// alone in u128, so absurd configs neither overflow nor build a layout first: what a
    /// command checks against the memory it has before it allocates anything.
    pub fn param_count(&self) -> u128 {
        // In f64 first: every term is part of the sum, so when the sum is below 2^100 no
        // product in the exact u128 count can overflow; above it the count saturates.
        if self.count_in(|x| x as f64) > 2f64.powi(100) {
            return u128::MAX;
        }
        self.count_in(|x| x as u128)
    }

    /// The parameter count in the number type `u` converts sizes to.
    fn count_in<T: Copy + std::ops::Add<Output = T> + std::ops::Mul<Output = T>>(&self, u: impl Fn(usize) -> T) -> T {
        let (c, f, v, zero) = (u(self.n_embd), u(self.ffn_hidden), u(self.vocab_size), u(0));
        let (two, three) = (u(2), u(3));
        let hs = u(if self.head_dim > 0 { self.head_dim } else { self.n_embd / self.n_head.max(1) });
        let (q, kv) = (u(self.n_head) * hs, u(self.n_kv_head) * hs);
        let bias = |n: T| if self.bias { n } else { zero };
        let mut dense_block = zero;
        let (block, embed) = match self.arch {
            Arch::Gpt2 => {
                let norms = two * (c + bias(c));
                let attn = three * q * c + bias(three * q) + c * q + bias(c);
                let mlp = two * f * c + bias(f) + bias(c);
                (norms + attn + mlp, v * c + u(self.block_size) * c)
            }
            Arch::Llama => {
                let attn = if self.is_mla() {
                    self.mla_count(&u, c)
                } else {
                    (q + two * kv) * c + if self.qkv_bias { q + two * kv } else { zero } + c * q + self.qk_norm_len(&u, hs, q + kv)
                };
                let expert = three * f * c;
                let bias = if self.moe_router == MoeRouter::Sigmoid { u(self.n_expert) } else { zero };
                let mlp = if self.n_expert > 0 { u(self.n_expert) * c + bias + (u(self.n_expert) + u(self.n_shared_expert)) * expert } else { expert };
                let norms = if self.block_norms == BlockNorms::Sandwich { u(4) * c } else { two * c };
                // Dense layers before the first routed one: their own width.
                dense_block = norms + attn + three * u(self.dense_hidden()) * c;
                (norms + attn + mlp, v * c)
            }
        };
        let head = if self.tied_embeddings { zero } else { v * c };
        let final_norm = c + if self.arch == Arch::Gpt2 { bias(c) } else { zero };
        let dense = self.dense_layers();
        embed + u(self.n_layer - dense) * block + u(dense) * dense_block + final_norm + head
    }

    /// The router's constraints (see [`GptConfig::moe_router`]); the error names the key.
    fn validate_router(&self) -> Result<(), String> {
        if self.moe_first_layer > 0 && (self.n_expert == 0 || self.moe_first_layer >= self.total_layers() || self.dense_ffn_hidden == 0) {
            return Err(format!("model.moe_first_layer = {} needs experts (model.n_expert > 0), a routed layer after it (of model.n_layer = {}) and the dense layers' width (model.dense_ffn_hidden > 0)", self.moe_first_layer, self.total_layers()));
        }
        if self.dense_ffn_hidden > 0 && self.moe_first_layer == 0 {
            return Err("model.dense_ffn_hidden is the width of the dense layers before the first routed one: it needs model.moe_first_layer > 0".into());
        }
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN must be refused too
        if !(self.moe_gate_scale > 0.0) || self.moe_gate_scale.is_infinite() {
            return Err(format!("model.moe_gate_scale must be a positive factor, got {}", self.moe_gate_scale));
        }
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN must be refused too
        if !(self.moe_bias_rate >= 0.0) || self.moe_bias_rate.is_infinite() {
            return Err(format!("model.moe_bias_rate must be a finite rate ≥ 0, got {}", self.moe_bias_rate));
        }
        if self.moe_router == MoeRouter::Softmax {
            // (Without experts the rate has nothing to move: a config that `--init-from` gives
            // its experts later is checked again then.)
            if self.moe_bias_rate > 0.0 && self.n_expert > 0 {
                return Err("model.moe_bias_rate moves the sigmoid router's correction bias: it needs model.moe_router = sigmoid".into());
            }
            if self.moe_groups != 1 || self.moe_topk_groups != 1 {
                return Err("model.moe_groups and model.moe_topk_groups are the sigmoid router's (model.moe_router = sigmoid)".into());
            }
            return Ok(());
        }
        let (e, g, tg) = (self.n_expert, self.moe_groups, self.moe_topk_groups);
        if e == 0 {
            return Err("model.moe_router = sigmoid needs experts (model.n_expert > 0)".into());
        }
        if g == 0 || !e.is_multiple_of(g) || !(1..=g).contains(&tg) || self.top_k > tg * (e / g) {
            return Err(format!("model.moe_groups ({g}) must divide model.n_expert ({e}), and model.moe_topk_groups ({tg}) be within 1..=groups with model.top_k ({}) at most the experts of that many groups", self.top_k));
        }
        if self.moe_aux_weight != 0.0 || self.moe_z_weight != 0.0 {
            return Err(format!("the sigmoid router balances by its correction bias, without the Switch or z losses: model.moe_aux_weight ({}) and model.moe_z_weight ({}) must be 0", self.moe_aux_weight, self.moe_z_weight));
        }
        Ok(())
    }

    /// MLA's constraints (see [`GptConfig::kv_lora_rank`]); the error names the key.
    fn validate_mla(&self) -> Result<(), String> {
        if self.kv_lora_rank == 0 {
            if self.q_lora_rank > 0 || self.v_head_dim > 0 || self.rope_interleave {
                return Err("model.q_lora_rank, model.v_head_dim and model.rope_interleave are multi-head latent attention's: they need model.kv_lora_rank > 0".into());
            }
            return Ok(());
        }
        if self.arch != Arch::Llama || self.n_kv_head != self.n_head {
            return Err(format!("model.kv_lora_rank (multi-head latent attention) needs model.arch = llama and model.n_kv_head = model.n_head (got {} and {})", self.n_kv_head, self.n_head));
        }
        let hs = self.head_size();
        if self.rotary_dim == 0 || self.rotary_dim >= hs || self.v_head_dim == 0 || self.v_head_dim > hs {
            return Err(format!("multi-head latent attention needs 0 < model.rotary_dim (qk_rope_head_dim, {}) < model.head_dim ({hs}) and 0 < model.v_head_dim ({}) <= model.head_dim", self.rotary_dim, self.v_head_dim));
        }
        if self.qkv_bias || self.qk_norm || self.fused_proj || self.norm_offset {
            return Err("multi-head latent attention has no q/k/v biases, q/k norms, fused projections or 1 + w norms (model.qkv_bias, model.qk_norm, model.fused_proj, model.norm_offset)".into());
        }
        Ok(())
    }

    /// Floats a KV cache of every layer and position holds ([`crate::KvCache`]): keys and values
    /// per kv head, or latent attention's compressed latent and shared rotary key.
    pub fn kv_cache_floats(&self) -> usize {
        let per = if self.is_mla() { self.kv_lora_rank + self.rotary_dim } else { 2 * self.n_kv_head * self.head_size() };
        self.n_layer.saturating_mul(self.block_size).saturating_mul(per)
    }

    /// Whether whole-model layer `l` routes its tokens to experts (every layer of an MoE model
    /// from `moe_first_layer` on).
    pub fn is_moe_layer(&self, l: usize) -> bool {
        self.n_expert > 0 && l >= self.moe_first_layer
    }

    /// The dense MLP width of this model's dense layers (`dense_ffn_hidden` in a model with
    /// experts, else `ffn_hidden`).
    pub fn dense_hidden(&self) -> usize {
        if self.n_expert > 0 && self.dense_ffn_hidden > 0 { self.dense_ffn_hidden } else { self.ffn_hidden }
    }

    /// This part's dense layers in a model with experts (those before `moe_first_layer`).
    pub fn dense_layers(&self) -> usize {
        if self.n_expert == 0 {
            return 0;
        }
        // Those of `first..first + n_layer` below `moe_first_layer`, counted without a walk (a
        // hostile config's layer count must not cost time).
        let first = self.first_layer();
        self.moe_first_layer.clamp(first, first.saturating_add(self.n_layer)) - first
    }

    /// Whether attention is multi-head latent attention (DeepSeek's MLA).
    pub fn is_mla(&self) -> bool {
        self.kv_lora_rank > 0
    }

    /// The output projection's input width: `n_head · v_head_dim` under MLA (its heads' values
    /// are narrower than q·k's), else [`GptConfig::attn_width`].
    pub fn o_width(&self) -> usize {
        if self.is_mla() { self.n_head * self.v_head_dim } else { self.attn_width() }
    }

    /// MLA's attention parameters: q (down, norm, up; or one projection), the key/value latent
    /// and shared rotary key, its norm and up-projection, the output projection.
    fn mla_count<T: Copy + std::ops::Add<Output = T> + std::ops::Mul<Output = T>>(&self, u: &impl Fn(usize) -> T, c: T) -> T {
        let (nh, hs, kvr, qr, rot, v) = (u(self.n_head), u(self.head_size()), u(self.kv_lora_rank), u(self.q_lora_rank), u(self.rotary_dim), u(self.v_head_dim));
        let nope = u(self.head_size() - self.rotary_dim);
        let q = if self.q_lora_rank > 0 { qr * c + qr + nh * hs * qr } else { nh * hs * c };
        q + (kvr + rot) * c + kvr + nh * (nope + v) * kvr + c * nh * v
    }

    /// The q and k norms' weights: none, one head's each, or every head's (`qk_norm_whole`).
    fn qk_norm_len<T: Copy + std::ops::Add<Output = T>>(&self, u: &impl Fn(usize) -> T, hs: T, whole: T) -> T {
        match (self.qk_norm, self.qk_norm_whole) {
            (false, _) => u(0),
            (true, false) => hs + hs,
            (true, true) => whole,
        }
    }

    /// The rotary inverse frequencies, rope scaling applied.
    /// (LongRoPE's in a pass over at most `original_max_position_embeddings` positions.)
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        self.rope_inv_freq_for(false)
    }

    /// The rotary inverse frequencies; `long`: LongRoPE's for a pass longer than its original
    /// context (the same as `rope_inv_freq` for every other scaling).
    pub fn rope_inv_freq_for(&self, long: bool) -> Vec<f32> {
        let rot = self.rotary_size();
        match &self.rope_scaling {
            Some(r) if long => r.inv_freq_long(self.rope_theta, rot),
            Some(r) => r.inv_freq(self.rope_theta, rot),
            None => tensor::llama::rope_inv_freq(self.rope_theta, rot),
        }
    }

    /// The dimensions of each head the rotary embedding turns (`rotary_dim`, else all).
    pub fn rotary_size(&self) -> usize {
        if self.rotary_dim > 0 { self.rotary_dim } else { self.head_size() }
    }

    /// The rotary tables `(cos, sin)` for `block_size` positions (`tensor::llama::rope_table_from`),
    /// scaled by the rope scaling's attention factor (YaRN's, LongRoPE's); `long` as for
    /// [`GptConfig::rope_inv_freq_for`].
    pub fn rope_tables(&self, long: bool) -> (Vec<f32>, Vec<f32>) {
        let (mut cos, mut sin) = tensor::llama::rope_table_from(&self.rope_inv_freq_for(long), self.block_size);
        let a = self.rope_scaling.as_ref().map_or(1.0, RopeScaling::attention_factor);
        if a != 1.0 {
            cos.iter_mut().chain(sin.iter_mut()).for_each(|x| *x *= a);
        }
        (cos, sin)
    }

    pub fn head_size(&self) -> usize {
        if self.head_dim > 0 {
            return self.head_dim;
        }
        self.n_embd / self.place.heads.map_or(self.n_head, |h| h.total)
    }

    /// Width of the attention output (`n_head · head_size`): `n_embd` for a whole model, its
    /// heads' share for a tensor-parallel shard.
    pub fn attn_width(&self) -> usize {
        self.n_head * self.head_size()
    }

    /// Width of the fused q|k|v projection output: `(NH + 2·NKV)·HS`.
    pub fn qkv_width(&self) -> usize {
        (self.n_head + 2 * self.n_kv_head) * self.head_size()
    }

    /// The attention logits' scale for [`tensor::llama::GqaDims::scale`]: Gemma's
    /// `query_pre_attn_scalar^-½`, or 0 (the kernels' `1/√HS`).
    pub fn attn_scale(&self) -> f32 {
        if self.query_pre_attn_scalar == 0 { 0.0 } else { (self.query_pre_attn_scalar as f64).powf(-0.5) as f32 }
    }

    /// The factor the token embeddings are multiplied by (Gemma's `√n_embd`, rounded to f32 as
    /// transformers does), if any.
    pub fn embed_multiplier(&self) -> Option<f32> {
        self.embed_scale.then(|| (self.n_embd as f64).sqrt() as f32)
    }

    /// The rotary tables of the sliding-window layers when their base differs (Gemma 3's local
    /// layers: `rope_local_theta`, plain RoPE), `[block_size, rotary/2]` each.
    pub fn rope_local_tables(&self) -> Option<(Vec<f32>, Vec<f32>)> {
        (self.rope_local_theta > 0.0).then(|| {
            tensor::llama::rope_table_from(&tensor::llama::rope_inv_freq(self.rope_local_theta, self.rotary_size()), self.block_size)
        })
    }

    /// The vectors the q and k norms normalise per token (`qk_norm`): each head, or q and k
    /// each as one (`qk_norm_whole`); 0 without them.
    pub fn qk_norm_groups(&self) -> usize {
        match (self.qk_norm, self.qk_norm_whole) {
            (false, _) => 0,
            (true, false) => self.n_head + self.n_kv_head,
            (true, true) => 2,
        }
    }

    /// Global index of this config's first block (0 unless a pipeline stage).
    /// Whether whole-model layer `l` turns q and k by the rotary embedding (LLaMA, not a NoPE
    /// layer).
    pub fn rope_at(&self, l: usize) -> bool {
        self.arch == Arch::Llama && !self.nope_layers.contains(&l)
    }

    /// The sliding window of whole-model layer `l` (0: every earlier position).
    pub fn window_of(&self, l: usize) -> usize {
        if self.window_layers.is_empty() || self.window_layers.contains(&l) { self.sliding_window } else { 0 }
    }

    pub fn first_layer(&self) -> usize {
        self.place.stage.map_or(0, |s| s.first_layer)
    }

    /// Blocks of the whole model this config belongs to.
    pub fn total_layers(&self) -> usize {
        self.place.stage.map_or(self.n_layer, |s| s.total_layers)
    }

    /// Whether this model embeds the tokens (every model but a later pipeline stage).
    pub fn has_embed(&self) -> bool {
        self.place.stage.is_none_or(|s| s.embed)
    }

    /// Whether this model ends in the final norm, head and loss.
    pub fn has_head(&self) -> bool {
        self.place.stage.is_none_or(|s| s.head)
    }

    /// Whether the layout holds the embedding unit: to embed, or (tied) as the head's weight.
    /// A last stage that only needs `wte` for its tied head keeps the whole unit (with `wpe`,
    /// unused there), so the unit is laid out — and ZeRO-sharded — exactly as on the first
    /// stage, and the two copies' gradients can be summed shard by shard.
    pub fn has_embedding_unit(&self) -> bool {
        self.has_embed() || (self.has_head() && self.tied_embeddings)
    }

    pub fn is_moe(&self) -> bool {
        self.n_expert > 0
    }

    /// The routed experts this config's layout holds (global ids): all of them, or an
    /// expert-parallel shard's block.
    pub fn local_experts(&self) -> std::ops::Range<usize> {
        self.place.experts.clone().unwrap_or(0..self.n_expert)
    }

    /// The MoE kernel's dimensions for `n` tokens.
    pub fn moe_dims(&self, n: usize) -> tensor::moe::MoeDims {
        tensor::moe::MoeDims {
            n, c: self.n_embd, f: self.ffn_hidden, e: self.n_expert, k: self.top_k, n_shared: self.n_shared_expert,
            capacity_factor: self.capacity_factor, renormalize: true,
            scoring: match self.moe_router {
                MoeRouter::Softmax => tensor::moe::Scoring::Softmax,
                MoeRouter::Sigmoid => tensor::moe::Scoring::Sigmoid { groups: self.moe_groups, topk_groups: self.moe_topk_groups },
            },
            gate_scale: self.moe_gate_scale,
        }
    }

    /// [`GptConfig::fc_width`] of the dense layers ([`GptConfig::dense_hidden`] wide).
    pub fn dense_fc_width(&self) -> usize {
        match self.arch {
            Arch::Gpt2 => self.dense_hidden(),
            Arch::Llama => 2 * self.dense_hidden(),
        }
    }

    /// Width of the MLP's first projection: `F` (GELU) or `2F` (SwiGLU's gate and up).
    pub fn fc_width(&self) -> usize {
        match self.arch {
            Arch::Gpt2 => self.ffn_hidden,
            Arch::Llama => 2 * self.ffn_hidden,
        }
    }
}
