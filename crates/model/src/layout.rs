//! One flat buffer holds every parameter; a [`ParamLayout`] names the views into it, using the
//! Hugging Face GPT-2 parameter names. Gradients and optimizer moments use the same layout, so
//! data-parallel reduction, ZeRO sharding and checkpoints all work on slices by name.
//!
//! Order: embeddings, then each block's parameters contiguously (layer 0 first), then the final
//! norm and the untied head. Contiguous blocks make pipeline splits and backward-ordered
//! gradient buckets plain ranges.
//!
//! Linear weights are stored `[out, in]` (PyTorch `nn.Linear`); HF GPT-2's `Conv1D` stores
//! `[in, out]`, which import/export transposes.

use crate::config::{Arch, BlockNorms, GptConfig, MoeRouter};
use std::ops::Range;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// N(0, std²).
    Normal(f32),
    Zeros,
    Ones,
}

#[derive(Clone, Debug)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub init: Init,
    /// Whether AdamW's weight decay applies (matrices yes; biases, norms, embeddings no).
    pub decay: bool,
}

impl ParamSpec {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len()
    }
}

#[derive(Clone, Debug, Default)]
pub struct ParamLayout {
    pub params: Vec<ParamSpec>,
    pub total: usize,
}

impl ParamLayout {
    fn push(&mut self, name: String, shape: Vec<usize>, init: Init, decay: bool) -> Range<usize> {
        let spec = ParamSpec { name, shape, offset: self.total, init, decay };
        self.total += spec.len();
        let r = spec.range();
        self.params.push(spec);
        r
    }

    /// Appends a parameter (for layouts built outside this module, e.g. LoRA adapters).
    pub fn push_named(&mut self, name: String, shape: Vec<usize>, init: Init, decay: bool) -> Range<usize> {
        self.push(name, shape, init, decay)
    }

    pub fn get(&self, name: &str) -> Option<&ParamSpec> {
        self.params.iter().find(|p| p.name == name)
    }

    /// Number of parameters, without the position embedding (the N of PaLM's FLOPs formula).
    pub fn count_without(&self, excluded: &str) -> usize {
        self.params.iter().filter(|p| p.name != excluded).map(|p| p.len()).sum()
    }
}

/// The views of one transformer block. For LLaMA, `c_attn_w` spans the adjacent `q_proj`,
/// `k_proj`, `v_proj` matrices (one `[(NH+2·NKV)·HS, C]` product) and `c_fc_w` the adjacent
/// `gate_proj`, `up_proj` (one `[2F, C]` product): stacking `[out, in]` matrices row-wise is
/// exactly their concatenation.
///
/// The norms before the branches, `ln_1_w` and `ln_2_w`, are empty ranges (at the block's
/// start) when the block has none (`model.block_norms = post`); the norms after them,
/// `post_1_w` and `post_2_w`, are present with `post` and `sandwich`.
#[derive(Clone, Debug)]
pub struct BlockParams {
    pub ln_1_w: Range<usize>,
    pub ln_1_b: Option<Range<usize>>,
    pub c_attn_w: Range<usize>,
    pub c_attn_b: Option<Range<usize>>,
    /// Qwen3's per-head norms, `[q_norm: HS | k_norm: HS]` (`model.qk_norm`), or OLMo 2's
    /// whole-width ones, `[q_norm: NH·HS | k_norm: NKV·HS]` (`model.qk_norm_whole`).
    pub qk_norm_w: Option<Range<usize>>,
    pub attn_proj_w: Range<usize>,
    pub attn_proj_b: Option<Range<usize>>,
    /// The norm after the attention branch (OLMo 2, Gemma).
    pub post_1_w: Option<Range<usize>>,
    pub ln_2_w: Range<usize>,
    pub ln_2_b: Option<Range<usize>>,
    pub c_fc_w: Range<usize>,
    pub c_fc_b: Option<Range<usize>>,
    pub mlp_proj_w: Range<usize>,
    pub mlp_proj_b: Option<Range<usize>>,
    /// The norm after the MLP branch (OLMo 2, Gemma).
    pub post_2_w: Option<Range<usize>>,
    /// Multi-head latent attention's projections in place of q|k|v (then `c_attn_w` is empty).
    pub mla: Option<MlaParams>,
    /// A mixture-of-experts MLP in place of the dense one (then `c_fc_w`, `mlp_proj_w` are empty).
    pub moe: Option<MoeParams>,
}

impl BlockParams {
    /// Where the block's parameters start in the layout (its unit's start).
    pub fn start(&self) -> usize {
        if !self.ln_1_w.is_empty() {
            return self.ln_1_w.start;
        }
        self.mla.as_ref().map_or(self.c_attn_w.start, |m| m.q_a.start.min(m.q_b.start))
    }
}

/// The views of multi-head latent attention (DeepSeek's MLA, transformers' names): q's
/// down-projection `q_a_proj` `[QR, C]` and its norm `[QR]` (empty without `q_lora_rank`), q's
/// projection `q_b_proj` `[NH·HS, QR]` (or `q_proj` `[NH·HS, C]`), the key/value latent with the
/// shared rotary key `kv_a_proj_with_mqa` `[KVR + R, C]`, its norm `[KVR]`, and its per-head
/// up-projection `kv_b_proj` `[NH·(HS − R + V), KVR]`. Each head's rows are transformers' order:
/// its q (and k) without rotation, then its rotary dimensions.
#[derive(Clone, Debug)]
pub struct MlaParams {
    pub q_a: Range<usize>,
    pub q_a_norm: Range<usize>,
    pub q_b: Range<usize>,
    pub kv_a: Range<usize>,
    pub kv_norm: Range<usize>,
    pub kv_b: Range<usize>,
}

/// The views of an MoE layer: the router `[E, C]`, the routed experts `[E, 3FC]` (each
/// `[w1 | w3 | w2]`, Mixtral's names, the layout `tensor::moe` reads), the shared experts.
#[derive(Clone, Debug)]
pub struct MoeParams {
    pub router: Range<usize>,
    /// The sigmoid router's correction bias `[E]` (DeepSeek-V3's `e_score_correction_bias`):
    /// never given a gradient; empty for the softmax router.
    pub router_bias: Range<usize>,
    pub experts: Range<usize>,
    pub shared: Range<usize>,
}

/// The views of the whole model, resolved once from the layout.
#[derive(Clone, Debug)]
pub struct GptParams {
    pub wte: Range<usize>,
    /// Learned positions (GPT-2); `None` with rotary embeddings.
    pub wpe: Option<Range<usize>>,
    pub blocks: Vec<BlockParams>,
    pub ln_f_w: Range<usize>,
    pub ln_f_b: Option<Range<usize>>,
    /// The output head: `wte` when tied.
    pub lm_head: Range<usize>,
}

/// Builds the layout of a model and the resolved views.
/// Initialisation follows GPT-2 / nanoGPT: N(0, 0.02) everywhere, residual projections
/// (`attn.c_proj`/`o_proj`, `mlp.c_proj`/`down_proj`) N(0, 0.02/√(2·n_layer)), biases 0, norm
/// weights 1.
pub fn gpt_layout(cfg: &GptConfig) -> (ParamLayout, GptParams) {
    match cfg.arch {
        Arch::Gpt2 => gpt2_layout(cfg),
        Arch::Llama => llama_layout(cfg),
    }
}

fn gpt2_layout(cfg: &GptConfig) -> (ParamLayout, GptParams) {
    let c = cfg.n_embd;
    // The attention width (C, or a tensor-parallel shard's share of the heads).
    let aw = cfg.attn_width();
    let std = 0.02f32;
    let proj_std = std / ((2 * cfg.total_layers()) as f32).sqrt();
    let mut l = ParamLayout::default();
    let (wte, wpe) = if cfg.has_embedding_unit() {
        let wte = l.push("transformer.wte.weight".into(), vec![cfg.vocab_size, c], Init::Normal(std), false);
        (wte, Some(l.push("transformer.wpe.weight".into(), vec![cfg.block_size, c], Init::Normal(std), false)))
    } else {
        (0..0, None)
    };
    let mut blocks = Vec::new();
    for i in cfg.first_layer()..cfg.first_layer() + cfg.n_layer {
        let p = format!("transformer.h.{i}.");
        let bias = |l: &mut ParamLayout, name: &str, n: usize| {
            cfg.bias.then(|| l.push(format!("{p}{name}.bias"), vec![n], Init::Zeros, false))
        };
        let ln_1_w = l.push(format!("{p}ln_1.weight"), vec![c], Init::Ones, false);
        let ln_1_b = bias(&mut l, "ln_1", c);
        let c_attn_w = l.push(format!("{p}attn.c_attn.weight"), vec![3 * aw, c], Init::Normal(std), true);
        let c_attn_b = bias(&mut l, "attn.c_attn", 3 * aw);
        let attn_proj_w = l.push(format!("{p}attn.c_proj.weight"), vec![c, aw], Init::Normal(proj_std), true);
        let attn_proj_b = bias(&mut l, "attn.c_proj", c);
        let ln_2_w = l.push(format!("{p}ln_2.weight"), vec![c], Init::Ones, false);
        let ln_2_b = bias(&mut l, "ln_2", c);
        let f = cfg.ffn_hidden;
        let c_fc_w = l.push(format!("{p}mlp.c_fc.weight"), vec![f, c], Init::Normal(std), true);
        let c_fc_b = bias(&mut l, "mlp.c_fc", f);
        let mlp_proj_w = l.push(format!("{p}mlp.c_proj.weight"), vec![c, f], Init::Normal(proj_std), true);
        let mlp_proj_b = bias(&mut l, "mlp.c_proj", c);
        blocks.push(BlockParams { ln_1_w, ln_1_b, c_attn_w, c_attn_b, qk_norm_w: None, attn_proj_w, attn_proj_b, post_1_w: None, ln_2_w, ln_2_b, c_fc_w, c_fc_b, mlp_proj_w, mlp_proj_b, post_2_w: None, mla: None, moe: None });
    }
    if !cfg.has_head() {
        let end = l.total;
        return (l, GptParams { wte, wpe, blocks, ln_f_w: end..end, ln_f_b: None, lm_head: 0..0 });
    }
    let ln_f_w = l.push("transformer.ln_f.weight".into(), vec![c], Init::Ones, false);
    let ln_f_b = cfg.bias.then(|| l.push("transformer.ln_f.bias".into(), vec![c], Init::Zeros, false));
    let lm_head = if cfg.tied_embeddings {
        wte.clone()
    } else {
        l.push("lm_head.weight".into(), vec![cfg.vocab_size, c], Init::Normal(std), true)
    };
    (l, GptParams { wte, wpe, blocks, ln_f_w, ln_f_b, lm_head })
}

/// LLaMA (Touvron et al. 2023) with Hugging Face `LlamaForCausalLM` names. No biases but
/// Qwen2's on q, k and v (`qkv_bias`).
fn llama_layout(cfg: &GptConfig) -> (ParamLayout, GptParams) {
    let (c, hs, f) = (cfg.n_embd, cfg.head_size(), cfg.ffn_hidden);
    let std = 0.02f32;
    let proj_std = std / ((2 * cfg.total_layers()) as f32).sqrt();
    let mut l = ParamLayout::default();
    // A norm's neutral weight: 1, or 0 where the norm scales by `1 + w` (Gemma).
    let one = if cfg.norm_offset { Init::Zeros } else { Init::Ones };
    let wte = if cfg.has_embedding_unit() { l.push("model.embed_tokens.weight".into(), vec![cfg.vocab_size, c], Init::Normal(std), false) } else { 0..0 };
    let mut blocks = Vec::new();
    for i in cfg.first_layer()..cfg.first_layer() + cfg.n_layer {
        let p = format!("model.layers.{i}.");
        let norms = cfg.block_norms;
        let ln_1_w = if norms.pre() { l.push(format!("{p}input_layernorm.weight"), vec![c], one, false) } else { l.total..l.total };
        let mla = cfg.is_mla().then(|| mla_layout(&mut l, cfg, &p, one));
        let (q, v) = if mla.is_some() {
            (l.total..l.total, l.total..l.total)
        } else {
            let q = l.push(format!("{p}self_attn.q_proj.weight"), vec![cfg.n_head * hs, c], Init::Normal(std), true);
            l.push(format!("{p}self_attn.k_proj.weight"), vec![cfg.n_kv_head * hs, c], Init::Normal(std), true);
            (q, l.push(format!("{p}self_attn.v_proj.weight"), vec![cfg.n_kv_head * hs, c], Init::Normal(std), true))
        };
        // Qwen2's q/k/v biases, adjacent like the weights: one `[(NH+2·NKV)·HS]` bias.
        let c_attn_b = cfg.qkv_bias.then(|| {
            let qb = l.push(format!("{p}self_attn.q_proj.bias"), vec![cfg.n_head * hs], Init::Zeros, false);
            l.push(format!("{p}self_attn.k_proj.bias"), vec![cfg.n_kv_head * hs], Init::Zeros, false);
            let vb = l.push(format!("{p}self_attn.v_proj.bias"), vec![cfg.n_kv_head * hs], Init::Zeros, false);
            qb.start..vb.end
        });
        // Qwen3's per-head norms of q and k (OLMo 2's over every head), adjacent: one range.
        let qk_norm_w = cfg.qk_norm.then(|| {
            let (qw, kw) = if cfg.qk_norm_whole { (cfg.n_head * hs, cfg.n_kv_head * hs) } else { (hs, hs) };
            let qn = l.push(format!("{p}self_attn.q_norm.weight"), vec![qw], one, false);
            let kn = l.push(format!("{p}self_attn.k_norm.weight"), vec![kw], one, false);
            qn.start..kn.end
        });
        let attn_proj_w = l.push(format!("{p}self_attn.o_proj.weight"), vec![c, cfg.o_width()], Init::Normal(proj_std), true);
        // LLaMA's `post_attention_layernorm` is the norm before the MLP; with norms after the
        // branches (OLMo 2, Gemma) it is the attention branch's, and Gemma's before the MLP is
        // `pre_feedforward_layernorm`.
        let post_1_w = norms.post().then(|| l.push(format!("{p}post_attention_layernorm.weight"), vec![c], one, false));
        let ln_2_w = match norms {
            BlockNorms::Pre => l.push(format!("{p}post_attention_layernorm.weight"), vec![c], one, false),
            BlockNorms::Sandwich => l.push(format!("{p}pre_feedforward_layernorm.weight"), vec![c], one, false),
            BlockNorms::Post => l.total..l.total,
        };
        let (c_fc_w, mlp_proj_w, moe) = if cfg.is_moe_layer(i) {
            // Mixtral's names; DeepSeekMoE-style shared experts beside them.
            let m = format!("{p}block_sparse_moe.");
            let router = l.push(format!("{m}gate.weight"), vec![cfg.n_expert, c], Init::Normal(std), false);
            let router_bias = if cfg.moe_router == MoeRouter::Sigmoid { l.push(format!("{m}gate.e_score_correction_bias"), vec![cfg.n_expert], Init::Zeros, false) } else { l.total..l.total };
            let expert = |l: &mut ParamLayout, stem: String| {
                let w1 = l.push(format!("{stem}.w1.weight"), vec![f, c], Init::Normal(std), true);
                l.push(format!("{stem}.w3.weight"), vec![f, c], Init::Normal(std), true);
                let w2 = l.push(format!("{stem}.w2.weight"), vec![c, f], Init::Normal(proj_std), true);
                w1.start..w2.end
            };
            let start = l.total;
            for e in cfg.local_experts() {
                expert(&mut l, format!("{m}experts.{e}"));
            }
            let experts = start..l.total;
            let start = l.total;
            for e in 0..cfg.n_shared_expert {
                expert(&mut l, format!("{m}shared_experts.{e}"));
            }
            (0..0, 0..0, Some(MoeParams { router, router_bias, experts, shared: start..l.total }))
        } else {
            // A dense layer (of a model with experts: before its first routed layer).
            let f = cfg.dense_hidden();
            let gate = l.push(format!("{p}mlp.gate_proj.weight"), vec![f, c], Init::Normal(std), true);
            let up = l.push(format!("{p}mlp.up_proj.weight"), vec![f, c], Init::Normal(std), true);
            let down = l.push(format!("{p}mlp.down_proj.weight"), vec![c, f], Init::Normal(proj_std), true);
            (gate.start..up.end, down, None)
        };
        let post_2_w = norms.post().then(|| l.push(format!("{p}post_feedforward_layernorm.weight"), vec![c], one, false));
        blocks.push(BlockParams {
            ln_1_w, ln_1_b: None, c_attn_w: q.start..v.end, c_attn_b, qk_norm_w, attn_proj_w, attn_proj_b: None, post_1_w,
            ln_2_w, ln_2_b: None, c_fc_w, c_fc_b: None, mlp_proj_w, mlp_proj_b: None, post_2_w, mla, moe,
        });
    }
    if !cfg.has_head() {
        let end = l.total;
        return (l, GptParams { wte, wpe: None, blocks, ln_f_w: end..end, ln_f_b: None, lm_head: 0..0 });
    }
    let ln_f_w = l.push("model.norm.weight".into(), vec![c], one, false);
    let lm_head = if cfg.tied_embeddings {
        wte.clone()
    } else {
        l.push("lm_head.weight".into(), vec![cfg.vocab_size, c], Init::Normal(std), true)
    };
    (l, GptParams { wte, wpe: None, blocks, ln_f_w, ln_f_b: None, lm_head })
}

/// Multi-head latent attention's parameters of block prefix `p` (see [`MlaParams`]); `one` is a
/// norm's neutral init.
fn mla_layout(l: &mut ParamLayout, cfg: &GptConfig, p: &str, one: Init) -> MlaParams {
    let (c, hs, nh, rot) = (cfg.n_embd, cfg.head_size(), cfg.n_head, cfg.rotary_dim);
    let (qr, kvr) = (cfg.q_lora_rank, cfg.kv_lora_rank);
    let std = Init::Normal(0.02);
    let (q_a, q_a_norm, q_b) = if qr > 0 {
        let a = l.push(format!("{p}self_attn.q_a_proj.weight"), vec![qr, c], std, true);
        let n = l.push(format!("{p}self_attn.q_a_layernorm.weight"), vec![qr], one, false);
        (a, n, l.push(format!("{p}self_attn.q_b_proj.weight"), vec![nh * hs, qr], std, true))
    } else {
        (l.total..l.total, l.total..l.total, l.push(format!("{p}self_attn.q_proj.weight"), vec![nh * hs, c], std, true))
    };
    let kv_a = l.push(format!("{p}self_attn.kv_a_proj_with_mqa.weight"), vec![kvr + rot, c], std, true);
    let kv_norm = l.push(format!("{p}self_attn.kv_a_layernorm.weight"), vec![kvr], one, false);
    let kv_b = l.push(format!("{p}self_attn.kv_b_proj.weight"), vec![nh * (hs - rot + cfg.v_head_dim), kvr], std, true);
    MlaParams { q_a, q_a_norm, q_b, kv_a, kv_norm, kv_b }
}

impl GptParams {
    /// The model's *units*: the contiguous ranges of the flat layout a pass uses one at a time,
    /// in layout order — `0` the embeddings (`wte`, `wpe`), `1 + l` block `l`, and last the
    /// final norm (with the untied head). They tile `0..total`. Data-parallel buckets, ZeRO
    /// shards and ZeRO-3's gathers are made of units.
    pub fn units(&self, total: usize) -> Vec<Range<usize>> {
        let mut starts = vec![0];
        starts.extend(self.blocks.iter().map(BlockParams::start));
        starts.push(self.ln_f_w.start);
        starts.push(total);
        starts.windows(2).map(|w| w[0]..w[1]).collect()
    }

    /// The unit holding the output head: the embeddings when tied, else the final unit.
    pub fn head_unit(&self) -> usize {
        if self.lm_head == self.wte { 0 } else { self.blocks.len() + 1 }
    }

    /// These views with every range relative to the start of its unit (what a pass indexes a
    /// unit's own parameter and gradient slices with).
    pub fn rebased(&self, total: usize) -> GptParams {
        let units = self.units(total);
        self.map_units(|r, u| {
            let s = units[u].start;
            let inside = r.start >= s && r.end <= units[u].end;
            assert!(inside || r.is_empty(), "range {r:?} outside unit {u}");
            // Empty ranges outside the unit are the `0..0` placeholders of absent weights.
            if inside { r.start - s..r.end - s } else { 0..0 }
        })
    }

    /// These views with every range `r` of unit `u` replaced by `f(r, u)`.
    pub fn map_units(&self, f: impl Fn(&Range<usize>, usize) -> Range<usize>) -> GptParams {
        let fo = |r: &Option<Range<usize>>, u: usize| r.as_ref().map(|r| f(r, u));
        let last = self.blocks.len() + 1;
        let blocks = self
            .blocks
            .iter()
            .enumerate()
            .map(|(l, b)| {
                let u = l + 1;
                BlockParams {
                    ln_1_w: f(&b.ln_1_w, u),
                    ln_1_b: fo(&b.ln_1_b, u),
                    c_attn_w: f(&b.c_attn_w, u),
                    c_attn_b: fo(&b.c_attn_b, u),
                    qk_norm_w: fo(&b.qk_norm_w, u),
                    attn_proj_w: f(&b.attn_proj_w, u),
                    attn_proj_b: fo(&b.attn_proj_b, u),
                    post_1_w: fo(&b.post_1_w, u),
                    ln_2_w: f(&b.ln_2_w, u),
                    ln_2_b: fo(&b.ln_2_b, u),
                    c_fc_w: f(&b.c_fc_w, u),
                    c_fc_b: fo(&b.c_fc_b, u),
                    mlp_proj_w: f(&b.mlp_proj_w, u),
                    mlp_proj_b: fo(&b.mlp_proj_b, u),
                    post_2_w: fo(&b.post_2_w, u),
                    mla: b.mla.as_ref().map(|m| MlaParams { q_a: f(&m.q_a, u), q_a_norm: f(&m.q_a_norm, u), q_b: f(&m.q_b, u), kv_a: f(&m.kv_a, u), kv_norm: f(&m.kv_norm, u), kv_b: f(&m.kv_b, u) }),
                    moe: b.moe.as_ref().map(|m| MoeParams { router: f(&m.router, u), router_bias: f(&m.router_bias, u), experts: f(&m.experts, u), shared: f(&m.shared, u) }),
                }
            })
            .collect();
        GptParams {
            wte: f(&self.wte, 0),
            wpe: fo(&self.wpe, 0),
            blocks,
            ln_f_w: f(&self.ln_f_w, last),
            ln_f_b: fo(&self.ln_f_b, last),
            lm_head: f(&self.lm_head, self.head_unit()),
        }
    }
}
