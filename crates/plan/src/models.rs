//! Model shapes and the built-in model catalogue.
//!
//! A `ModelShape` is a plain description of a decoder-only transformer: enough to count parameters, FLOPs and
//! activation bytes. It deliberately does not depend on the engine's `model` crate (the planner must describe
//! models kiln cannot run yet, e.g. a 1T-parameter GPT).

use serde::{Deserialize, Serialize};

use crate::PlanError;

/// Feed-forward block kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mlp {
    /// `fc2(gelu(fc1 x))`, two matrices h×f (GPT-2/3, Megatron).
    Gelu,
    /// `w2(silu(w1 x) * w3 x)`, three matrices h×f (LLaMA, Mixtral).
    Swiglu,
}

impl Mlp {
    pub fn parse(s: &str) -> Result<Mlp, PlanError> {
        match s.to_ascii_lowercase().as_str() {
            "gelu" => Ok(Mlp::Gelu),
            "swiglu" => Ok(Mlp::Swiglu),
            other => Err(PlanError(format!(
                "--mlp: unknown MLP kind '{other}' (expected gelu|swiglu)"
            ))),
        }
    }
    /// Number of h×f matrices in one MLP (expert).
    pub fn matrices(self) -> u64 {
        match self {
            Mlp::Gelu => 2,
            Mlp::Swiglu => 3,
        }
    }
}

/// Raw, parsed form of a model entry (catalogue JSON or user file): optional fields get defaults in `resolve`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    pub name: String,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    #[serde(default)]
    pub kv_heads: Option<u64>,
    #[serde(default)]
    pub head_dim: Option<u64>,
    #[serde(default)]
    pub ffn_hidden: Option<u64>,
    pub vocab: u64,
    #[serde(default)]
    pub seq: Option<u64>,
    #[serde(default)]
    pub mlp: Option<Mlp>,
    #[serde(default)]
    pub experts: Option<u64>,
    #[serde(default)]
    pub top_k: Option<u64>,
    #[serde(default)]
    pub shared_experts: Option<u64>,
    #[serde(default)]
    pub expert_ffn_hidden: Option<u64>,
    #[serde(default)]
    pub moe_layer_freq: Option<u64>,
    #[serde(default)]
    pub first_dense_layers: Option<u64>,
    #[serde(default)]
    pub capacity_factor: Option<f64>,
    #[serde(default)]
    pub tied_embeddings: Option<bool>,
    #[serde(default)]
    pub learned_pos_emb: Option<bool>,
    #[serde(default)]
    pub biases: Option<bool>,
    #[serde(default)]
    pub dropout: Option<bool>,
    /// Multi-head latent attention (DeepSeek-V2/V3): the key/value latent width (`head_dim` is
    /// then q·k's head width, `qk_nope + qk_rope`), q's latent width (0: one projection), the
    /// shared rotary key's width and the value head width.
    #[serde(default)]
    pub kv_lora_rank: Option<u64>,
    #[serde(default)]
    pub q_lora_rank: Option<u64>,
    #[serde(default)]
    pub qk_rope_dim: Option<u64>,
    #[serde(default)]
    pub v_head_dim: Option<u64>,
    #[serde(default)]
    pub note: Option<String>,
}

/// Multi-head latent attention's widths (see [`RawModel::kv_lora_rank`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Mla {
    pub q_rank: u64,
    pub kv_rank: u64,
    pub rope: u64,
    pub v: u64,
}

/// Resolved and validated model description.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelShape {
    pub name: String,
    /// L: transformer layers.
    pub layers: u64,
    /// h: residual width.
    pub hidden: u64,
    /// a: query heads.
    pub heads: u64,
    /// Key/value heads (GQA; = heads for MHA).
    pub kv_heads: u64,
    /// Per-head width (h / a unless given, e.g. DeepSeek-V3's 128 with h = 7168).
    pub head_dim: u64,
    /// f: dense MLP inner width.
    pub ffn_hidden: u64,
    /// V: vocabulary (padded as trained).
    pub vocab: u64,
    /// Default training sequence length.
    pub seq: u64,
    pub mlp: Mlp,
    /// Routed experts per MoE layer (1 = dense model).
    pub experts: u64,
    /// Routed experts each token visits.
    pub top_k: u64,
    /// Always-on shared experts per MoE layer (DeepSeek).
    pub shared_experts: u64,
    /// Inner width of one expert.
    pub expert_ffn_hidden: u64,
    /// Every `moe_layer_freq`-th layer (after the dense ones) is MoE.
    pub moe_layer_freq: u64,
    /// The first layers that stay dense (DeepSeek-V3: 3).
    pub first_dense_layers: u64,
    /// Expert capacity factor: tokens an expert is sized for, relative to a perfect balance (compute is padded to it).
    pub capacity_factor: f64,
    pub tied_embeddings: bool,
    /// GPT-style learned position embedding (s×h parameters); false for RoPE models.
    pub learned_pos_emb: bool,
    /// Linear/LayerNorm biases (GPT: yes; LLaMA: no).
    pub biases: bool,
    /// Dropout after attention probs and residual branches (stores 1-byte masks; Korthikanti's accounting).
    pub dropout: bool,
    /// Multi-head latent attention in place of GQA's projections (keys and values per head).
    pub mla: Option<Mla>,
}

impl RawModel {
    pub fn resolve(self) -> Result<ModelShape, PlanError> {
        let n = &self.name;
        let bad = |what: &str| PlanError(format!("model '{n}': {what}"));
        if self.layers == 0 || self.hidden == 0 || self.heads == 0 || self.vocab == 0 {
            return Err(bad("layers, hidden, heads and vocab must be positive"));
        }
        let kv_heads = self.kv_heads.unwrap_or(self.heads);
        if kv_heads == 0 || !self.heads.is_multiple_of(kv_heads) {
            return Err(bad(&format!("kv_heads {kv_heads} must divide heads {}", self.heads)));
        }
        let head_dim = match self.head_dim {
            Some(d) => d,
            None => {
                if !self.hidden.is_multiple_of(self.heads) {
                    return Err(bad(&format!("heads {} must divide hidden {}", self.heads, self.hidden)));
                }
                self.hidden / self.heads
            }
        };
        let mlp = self.mlp.unwrap_or(Mlp::Gelu);
        // GPT: f = 4h. SwiGLU without an explicit width: LLaMA's 2/3·4h rounded up to a multiple of 256.
        let ffn_hidden = self.ffn_hidden.unwrap_or(match mlp {
            Mlp::Gelu => 4 * self.hidden,
            Mlp::Swiglu => (8 * self.hidden / 3).div_ceil(256) * 256,
        });
        let experts = self.experts.unwrap_or(1).max(1);
        let top_k = self.top_k.unwrap_or(if experts > 1 { 2 } else { 1 });
        if top_k == 0 || top_k > experts {
            return Err(bad(&format!("top_k {top_k} must be in 1..=experts ({experts})")));
        }
        let gpt_like = mlp == Mlp::Gelu;
        let mla = match self.kv_lora_rank.filter(|&r| r > 0) {
            None => None,
            Some(kv_rank) => {
                let (rope, v) = (self.qk_rope_dim.unwrap_or(0), self.v_head_dim.unwrap_or(head_dim));
                if rope == 0 || rope >= head_dim || v == 0 || kv_heads != self.heads {
                    return Err(bad(&format!("multi-head latent attention needs 0 < qk_rope_dim ({rope}) < head_dim ({head_dim}), v_head_dim > 0 and kv_heads = heads")));
                }
                Some(Mla { q_rank: self.q_lora_rank.unwrap_or(0), kv_rank, rope, v })
            }
        };
        Ok(ModelShape {
            name: self.name.clone(),
            layers: self.layers,
            hidden: self.hidden,
            heads: self.heads,
            kv_heads,
            head_dim,
            ffn_hidden,
            vocab: self.vocab,
            seq: self.seq.unwrap_or(2048),
            mlp,
            experts,
            top_k,
            shared_experts: self.shared_experts.unwrap_or(0),
            expert_ffn_hidden: self.expert_ffn_hidden.unwrap_or(ffn_hidden),
            moe_layer_freq: self.moe_layer_freq.unwrap_or(1).max(1),
            first_dense_layers: self.first_dense_layers.unwrap_or(0),
            capacity_factor: self.capacity_factor.unwrap_or(1.0),
            tied_embeddings: self.tied_embeddings.unwrap_or(gpt_like),
            learned_pos_emb: self.learned_pos_emb.unwrap_or(gpt_like),
            biases: self.biases.unwrap_or(gpt_like),
            dropout: self.dropout.unwrap_or(gpt_like),
            mla,
        })
    }
}

impl ModelShape {
    /// A GPT (Megatron) model as in Narayanan et al. Table 1: GELU MLP with f = 4h, MHA, biases, dropout,
    /// tied embeddings and learned position embeddings.
    pub fn gpt(
        name: &str,
        layers: u64,
        hidden: u64,
        heads: u64,
        vocab: u64,
        seq: u64,
    ) -> Result<ModelShape, PlanError> {
        RawModel {
            name: name.into(),
            layers,
            hidden,
            heads,
            vocab,
            seq: Some(seq),
            ..Default::default()
        }
        .resolve()
    }

    pub fn is_moe(&self) -> bool {
        self.experts > 1
    }

    /// Whether layer `i` (0-based) is an MoE layer.
    pub fn layer_is_moe(&self, i: u64) -> bool {
        self.is_moe()
            && i >= self.first_dense_layers
            && (i - self.first_dense_layers).is_multiple_of(self.moe_layer_freq)
    }

    pub fn moe_layers(&self) -> u64 {
        (0..self.layers).filter(|&i| self.layer_is_moe(i)).count() as u64
    }

    /// Query width a·d (= h for standard models).
    pub fn q_dim(&self) -> u64 {
        self.heads * self.head_dim
    }

    /// Key (= value) width kv·d.
    pub fn kv_dim(&self) -> u64 {
        self.kv_heads * self.head_dim
    }

    /// Value head width: MLA's `v_head_dim`, else the head width.
    pub fn v_head_dim(&self) -> u64 {
        self.mla.map_or(self.head_dim, |m| m.v)
    }

    /// Attention parameters of one layer: W_q h×a·d, W_k,W_v h×kv·d, W_o a·d×h (+ biases); under
    /// MLA q's down- and up-projections and norm (or one projection), the key/value latent with the
    /// shared rotary key, its norm and per-head up-projection, and W_o a·v×h.
    pub fn attn_params(&self) -> u64 {
        let h = self.hidden;
        if let Some(m) = self.mla {
            let (a, d) = (self.heads, self.head_dim);
            let q = if m.q_rank > 0 { h * m.q_rank + m.q_rank + m.q_rank * a * d } else { h * a * d };
            return q + h * (m.kv_rank + m.rope) + m.kv_rank + m.kv_rank * a * (d - m.rope + m.v) + a * m.v * h;
        }
        let w = h * (self.q_dim() + 2 * self.kv_dim()) + self.q_dim() * h;
        let b = if self.biases {
            self.q_dim() + 2 * self.kv_dim() + h
        } else {
            0
        };
        w + b
    }

    /// Parameters of one MLP (or one expert) of inner width f.
    pub fn mlp_params(&self, f: u64) -> u64 {
        let h = self.hidden;
        let w = self.mlp.matrices() * h * f;
        let b = if self.biases {
            (self.mlp.matrices() - 1) * f + h
        } else {
            0
        };
        w + b
    }

    /// Norm parameters of one layer: two LayerNorms with weight+bias (4h), or two RMSNorms (2h).
    pub fn norm_params(&self) -> u64 {
        if self.biases {
            4 * self.hidden
        } else {
            2 * self.hidden
        }
    }

    /// Parameters of layer `i`. Dense GPT: 12h² + 13h, the per-layer term of Narayanan et al. eq. (1).
    pub fn layer_params(&self, i: u64) -> u64 {
        let mlp = if self.layer_is_moe(i) {
            let router = self.hidden * self.experts;
            (self.experts + self.shared_experts) * self.mlp_params(self.expert_ffn_hidden) + router
        } else {
            self.mlp_params(self.ffn_hidden)
        };
        self.attn_params() + mlp + self.norm_params()
    }

    /// Expert (EP-shardable) parameters of layer `i`.
    pub fn layer_expert_params(&self, i: u64) -> u64 {
        if self.layer_is_moe(i) {
            self.experts * self.mlp_params(self.expert_ffn_hidden)
        } else {
            0
        }
    }

    /// Embedding parameters: token embedding V×h (+ position s×h), + an untied output head V×h.
    pub fn embedding_params(&self, seq: u64) -> u64 {
        let tok = self.vocab * self.hidden;
        let pos = if self.learned_pos_emb { seq * self.hidden } else { 0 };
        let head = if self.tied_embeddings {
            0
        } else {
            self.vocab * self.hidden
        };
        tok + pos + head
    }

    /// Total parameters. For dense GPT this is exactly Narayanan et al. eq. (1):
    /// `P = 12 l h² (1 + 13/(12h) + (V + s)/(12 l h))` (the final LayerNorm, 2h, is left out as in the paper).
    pub fn params(&self, seq: u64) -> u64 {
        (0..self.layers).map(|i| self.layer_params(i)).sum::<u64>() + self.embedding_params(seq)
    }

    /// Parameters touched by one token (MoE: top_k + shared experts instead of all).
    pub fn active_params(&self, seq: u64) -> u64 {
        let mut p = self.params(seq);
        for i in 0..self.layers {
            if self.layer_is_moe(i) {
                p -= (self.experts - self.top_k) * self.mlp_params(self.expert_ffn_hidden);
            }
        }
        p
    }
}

const BUILTIN_MODELS: &str = include_str!("../catalog/models.json");

#[derive(Deserialize)]
struct ModelFile {
    models: Vec<RawModel>,
}

/// A Hugging Face `config.json` as a model entry: GPT-2 (`n_layer`, `n_embd`, … : GeLU, biases,
/// learned positions) or a LLaMA-family config (`num_hidden_layers`, `hidden_size`, … : SwiGLU),
/// with its experts when it has them (Mixtral's `num_local_experts`, Qwen3-MoE's `num_experts`
/// and `moe_intermediate_size`, `n_routed_experts`, `n_shared_experts`, `first_k_dense_replace`,
/// `moe_layer_freq`). Activations other than SiLU, Qwen2-MoE's shared expert, DeepSeek's MLA and
/// dense layers among experts are refused by key. The training length defaults to
/// `max_position_embeddings` capped at 4096 (`--seq` sets it). `None` when `v` is not one.
pub fn hf_config_model(v: &serde_json::Value, name: &str) -> Option<Result<RawModel, PlanError>> {
    let arch = v.get("architectures").and_then(|a| a.get(0)).and_then(|a| a.as_str());
    let ty = v.get("model_type").and_then(|t| t.as_str());
    if arch.is_none() && ty.is_none() {
        return None;
    }
    let u = |k: &str| v.get(k).and_then(|x| x.as_u64());
    let need = |k: &str| u(k).ok_or_else(|| PlanError(format!("{name}: Hugging Face config has no `{k}`")));
    let gpt2 = ty == Some("gpt2") || arch == Some("GPT2LMHeadModel");
    let tied = v.get("tie_word_embeddings").and_then(|x| x.as_bool());
    Some((|| {
        if gpt2 {
            return Ok(RawModel {
                name: name.into(),
                layers: need("n_layer")?,
                hidden: need("n_embd")?,
                heads: need("n_head")?,
                ffn_hidden: u("n_inner"),
                vocab: need("vocab_size")?,
                seq: u("n_positions").map(|s| s.min(4096)),
                mlp: Some(Mlp::Gelu),
                tied_embeddings: Some(tied.unwrap_or(true)),
                ..RawModel::default()
            });
        }
        // What the planner cannot express is refused by key rather than misread.
        let act = v.get("hidden_act").or_else(|| v.get("hidden_activation")).and_then(|a| a.as_str()).unwrap_or("silu");
        if act != "silu" {
            return Err(PlanError(format!("{name}: `hidden_act` = {act}: the planner reads GPT-2 and SwiGLU (silu) models")));
        }
        if v.get("shared_expert_intermediate_size").is_some_and(|x| !x.is_null()) {
            return Err(PlanError(format!("{name}: `shared_expert_intermediate_size` (Qwen2-MoE's shared expert) is not read; use the catalogue's entries or --layers/--hidden/... flags")));
        }
        // DeepSeek's MLA: q·k's head width is nope + rope (its file's `head_dim` is the rotary width).
        let mla = u("kv_lora_rank").filter(|&r| r > 0);
        let head_dim = match mla {
            Some(_) => Some(need("qk_nope_head_dim")? + need("qk_rope_head_dim")?),
            None => u("head_dim"),
        };
        if v.get("mlp_only_layers").and_then(|x| x.as_array()).is_some_and(|a| !a.is_empty()) || u("decoder_sparse_step").is_some_and(|s| s > 1) {
            return Err(PlanError(format!("{name}: dense layers among the experts (`mlp_only_layers`, `decoder_sparse_step`) are not read")));
        }
        // A DeepSeek file whose dense layers are all of them (`first_k_dense_replace`) is dense.
        let all_dense = u("first_k_dense_replace").zip(u("num_hidden_layers")).is_some_and(|(d, l)| d >= l);
        let experts = u("num_local_experts").or_else(|| u("num_experts")).or_else(|| u("n_routed_experts")).filter(|&e| e > 1 && !all_dense);
        Ok(RawModel {
            name: name.into(),
            layers: need("num_hidden_layers")?,
            hidden: need("hidden_size")?,
            heads: need("num_attention_heads")?,
            kv_heads: if mla.is_some() { None } else { u("num_key_value_heads") },
            head_dim,
            kv_lora_rank: mla,
            q_lora_rank: mla.and(u("q_lora_rank")),
            qk_rope_dim: mla.and(u("qk_rope_head_dim")),
            v_head_dim: mla.and(u("v_head_dim")),
            ffn_hidden: u("intermediate_size"),
            vocab: need("vocab_size")?,
            seq: u("max_position_embeddings").map(|s| s.min(4096)),
            mlp: Some(Mlp::Swiglu),
            experts,
            top_k: experts.and(u("num_experts_per_tok")),
            shared_experts: experts.and(u("n_shared_experts")),
            expert_ffn_hidden: experts.and(u("moe_intermediate_size").or_else(|| u("intermediate_size"))),
            moe_layer_freq: experts.and(u("moe_layer_freq")),
            first_dense_layers: experts.and(u("first_k_dense_replace")),
            // Hugging Face's routers drop nothing (dropless).
            capacity_factor: experts.map(|_| 1.0),
            tied_embeddings: Some(tied.unwrap_or(false)),
            learned_pos_emb: Some(false),
            biases: Some(false),
            dropout: Some(false),
            ..RawModel::default()
        })
    })())
}

/// Parse a model catalogue (`{"models":[...]}`), a JSON array of models, a single model object,
/// or a Hugging Face `config.json` ([`hf_config_model`]).
pub fn parse_models(text: &str, origin: &str) -> Result<Vec<ModelShape>, PlanError> {
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(text) {
        let name = std::path::Path::new(origin).parent().and_then(|d| d.file_name()).and_then(|n| n.to_str()).filter(|n| !n.is_empty()).unwrap_or(origin);
        if let Some(raw) = hf_config_model(&v, name) {
            return Ok(vec![raw?.resolve().map_err(|e| PlanError(format!("{origin}: {}", e.0)))?]);
        }
    }
    let raws: Vec<RawModel> = if let Ok(f) = serde_json::from_str::<ModelFile>(text) {
        f.models
    } else if let Ok(v) = serde_json::from_str::<Vec<RawModel>>(text) {
        v
    } else {
        match serde_json::from_str::<RawModel>(text) {
            Ok(m) => vec![m],
            Err(e) => {
                return Err(PlanError(format!(
                    "{origin}: not a model catalogue or model config: {e}"
                )))
            }
        }
    };
    raws.into_iter()
        .map(|r| r.resolve().map_err(|e| PlanError(format!("{origin}: {}", e.0))))
        .collect()
}

/// The built-in model catalogue.
pub fn builtin_models() -> Vec<ModelShape> {
    parse_models(BUILTIN_MODELS, "catalog/models.json").expect("built-in model catalogue is valid")
}

/// Find a model by name in the built-in catalogue plus `extra` entries (extra entries win).
pub fn find_model(name: &str, extra: &[ModelShape]) -> Result<ModelShape, PlanError> {
    let key = name.to_ascii_lowercase();
    if let Some(m) = extra.iter().find(|m| m.name.to_ascii_lowercase() == key) {
        return Ok(m.clone());
    }
    let all = builtin_models();
    if let Some(m) = all.iter().find(|m| m.name.to_ascii_lowercase() == key) {
        return Ok(m.clone());
    }
    let names: Vec<&str> = all.iter().map(|m| m.name.as_str()).collect();
    Err(PlanError(format!(
        "--model: unknown model '{name}' (known: {})",
        names.join(", ")
    )))
}
