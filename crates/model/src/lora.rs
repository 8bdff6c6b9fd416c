//! LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): a frozen base
//! Linear `W` gains a trainable low-rank update, `y = x·Wᵀ + (α/r)·(x·Aᵀ)·Bᵀ`, with `A[r, in]`
//! initialised small and random and `B[out, r]` zero, so training starts from the base model.
//!
//! Adapters attach by target name to row ranges of the model's projections — `q`, `k`, `v`
//! (rows of the fused q|k|v matrix), `o`, `gate`, `up` (rows of the fused gate|up matrix for
//! LLaMA; GPT-2's `c_fc` is `up`), `down` — without touching the block code's structure: the
//! block calls [`Lora::forward`] after a projection's matmul and [`Lora::backward`] before its
//! backward. Their parameters live in their own flat buffer and layout (PEFT's names,
//! `<base>.lora_A.weight`, `<base>.lora_B.weight`), so the optimizer, checkpoints and export
//! see only them.

use crate::config::{Arch, GptConfig};
use crate::layout::{GptParams, Init, ParamLayout};
use std::ops::Range;
use tensor::matmul::{gemm, gemm_raw, Threads, View};
use tensor::Rng;

/// The projection an adapter modifies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    Qkv,
    AttnProj,
    Fc,
    MlpProj,
}

pub const TARGETS: &[&str] = &["q", "k", "v", "o", "gate", "up", "down"];

/// `targets` in kiln's names: each as given (`q`, …, `down`), or PEFT's module name for it
/// (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`; GPT-2's
/// `c_attn` is q, k and v, `c_fc` up), or `all-linear` (PEFT's: every projection the model's
/// blocks have that takes an adapter); duplicates dropped, order kept.
pub fn expand_targets(cfg: &GptConfig, targets: &[String]) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    for t in targets {
        let names: Vec<&str> = match t.as_str() {
            "all-linear" => match (cfg.arch, cfg.is_moe()) {
                (_, true) => vec!["q", "k", "v", "o"],
                (Arch::Gpt2, false) => vec!["q", "k", "v", "o", "up", "down"],
                (Arch::Llama, false) => TARGETS.to_vec(),
            },
            "c_attn" if cfg.arch == Arch::Gpt2 => vec!["q", "k", "v"],
            "c_fc" if cfg.arch == Arch::Gpt2 => vec!["up"],
            s => vec![s.strip_suffix("_proj").filter(|b| TARGETS.contains(b)).unwrap_or(s)],
        };
        for n in names {
            if !out.iter().any(|o| o == n) {
                out.push(n.to_string());
            }
        }
    }
    Ok(out)
}

#[derive(Clone, Debug)]
pub struct Adapter {
    pub layer: usize,
    pub site: Site,
    /// Output rows of the site's weight that this adapter updates.
    pub rows: Range<usize>,
    pub d_in: usize,
    /// Views into [`Lora::params`].
    pub a: Range<usize>,
    pub b: Range<usize>,
    /// The base weight's name (e.g. `model.layers.0.self_attn.q_proj.weight`).
    pub base: String,
}

#[derive(Clone)]
pub struct Lora {
    pub rank: usize,
    pub alpha: f32,
    pub layout: ParamLayout,
    pub adapters: Vec<Adapter>,
    pub params: Vec<f32>,
    pub grads: Vec<f32>,
    /// `x·Aᵀ` of each adapter for the last forward, `[N, r]` each.
    xa: Vec<Vec<f32>>,
    /// Scratch for `d(x·Aᵀ)`, `[N, r]`.
    dxa: Vec<f32>,
}

/// The base weight name, site, and output rows for `target` in layer `l`.
fn locate(cfg: &GptConfig, l: usize, target: &str) -> Result<(String, Site, Range<usize>, usize), String> {
    let (c, hs, f) = (cfg.n_embd, cfg.head_size(), cfg.ffn_hidden);
    let (q, kv) = (cfg.n_head * hs, cfg.n_kv_head * hs);
    Ok(match (cfg.arch, target) {
        (Arch::Llama, "q") => (format!("model.layers.{l}.self_attn.q_proj.weight"), Site::Qkv, 0..q, c),
        (Arch::Llama, "k") => (format!("model.layers.{l}.self_attn.k_proj.weight"), Site::Qkv, q..q + kv, c),
        (Arch::Llama, "v") => (format!("model.layers.{l}.self_attn.v_proj.weight"), Site::Qkv, q + kv..q + 2 * kv, c),
        (Arch::Llama, "o") => (format!("model.layers.{l}.self_attn.o_proj.weight"), Site::AttnProj, 0..c, q),
        (Arch::Llama, "gate") => (format!("model.layers.{l}.mlp.gate_proj.weight"), Site::Fc, 0..f, c),
        (Arch::Llama, "up") => (format!("model.layers.{l}.mlp.up_proj.weight"), Site::Fc, f..2 * f, c),
        (Arch::Llama, "down") => (format!("model.layers.{l}.mlp.down_proj.weight"), Site::MlpProj, 0..c, f),
        // GPT-2 fuses q, k, v in `c_attn`: each adapter covers a third of its rows.
        (Arch::Gpt2, "q") => (format!("transformer.h.{l}.attn.c_attn.q.weight"), Site::Qkv, 0..c, c),
        (Arch::Gpt2, "k") => (format!("transformer.h.{l}.attn.c_attn.k.weight"), Site::Qkv, c..2 * c, c),
        (Arch::Gpt2, "v") => (format!("transformer.h.{l}.attn.c_attn.v.weight"), Site::Qkv, 2 * c..3 * c, c),
        (Arch::Gpt2, "o") => (format!("transformer.h.{l}.attn.c_proj.weight"), Site::AttnProj, 0..c, c),
        (Arch::Gpt2, "up") => (format!("transformer.h.{l}.mlp.c_fc.weight"), Site::Fc, 0..f, c),
        (Arch::Gpt2, "down") => (format!("transformer.h.{l}.mlp.c_proj.weight"), Site::MlpProj, 0..c, f),
        (Arch::Gpt2, "gate") => return Err("lora target `gate` names no layer in a gpt2 model (its MLP has no gate; use up, down)".into()),
        (_, other) => return Err(format!("unknown lora target `{other}` (known: {}, PEFT's module names such as q_proj, or all-linear)", TARGETS.join(", "))),
    })
}

impl Lora {
    /// Adapters of rank `rank` on `targets` in every layer, initialised from `seed`.
    pub fn new(cfg: &GptConfig, rank: usize, alpha: f32, targets: &[String], seed: u64) -> Result<Lora, String> {
        if rank == 0 {
            return Err("lora rank must be positive".into());
        }
        if targets.is_empty() {
            return Err("lora needs at least one target".into());
        }
        if cfg.is_mla() {
            return Err("LoRA adapters on multi-head latent attention (model.kv_lora_rank) are not supported yet".into());
        }
        let targets = &expand_targets(cfg, targets)?;
        let mut layout = ParamLayout::default();
        let mut adapters = Vec::new();
        if cfg.is_moe() {
            if let Some(t) = targets.iter().find(|t| ["gate", "up", "down"].contains(&t.as_str())) {
                return Err(format!("lora target `{t}` names no layer in a mixture-of-experts model (adapters on experts are not supported; use q, k, v, o)"));
            }
        }
        for l in 0..cfg.n_layer {
            for t in targets {
                let (base, site, rows, d_in) = locate(cfg, l, t)?;
                let stem = base.strip_suffix(".weight").unwrap_or(&base).to_string();
                // A: Kaiming-style N(0, 1/in); B: zeros (PEFT's initialisation up to the distribution).
                let a = layout.push_named(format!("{stem}.lora_A.weight"), vec![rank, d_in], Init::Normal(1.0 / (d_in as f32).sqrt()), true);
                let b = layout.push_named(format!("{stem}.lora_B.weight"), vec![rows.len(), rank], Init::Zeros, true);
                adapters.push(Adapter { layer: l, site, rows, d_in, a, b, base });
            }
        }
        let mut params = vec![0.0; layout.total];
        let mut rng = Rng::new(seed ^ 0x10FA);
        for p in &layout.params {
            if let Init::Normal(std) = p.init {
                rng.fill_normal(&mut params[p.range()], std);
            }
        }
        let n = layout.total;
        let k = adapters.len();
        Ok(Lora { rank, alpha, layout, adapters, params, grads: vec![0.0; n], xa: vec![Vec::new(); k], dxa: Vec::new() })
    }

    pub fn scale(&self) -> f32 {
        self.alpha / self.rank as f32
    }

    /// `out[N, W] += scale · (x·Aᵀ)·Bᵀ` on the adapter rows of every adapter at `(layer, site)`;
    /// saves `x·Aᵀ` for backward.
    pub fn forward(&mut self, layer: usize, site: Site, out: &mut [f32], x: &[f32], n: usize, width: usize) {
        let scale = self.scale();
        let r = self.rank;
        for (i, ad) in self.adapters.iter().enumerate().filter(|(_, a)| a.layer == layer && a.site == site) {
            let xa = &mut self.xa[i];
            xa.resize(n * r, 0.0);
            let a = View::rows(&self.params[ad.a.clone()], r, ad.d_in);
            gemm(xa, false, View::rows(x, n, ad.d_in), a.t(), 1.0, Threads::All);
            let b = View::rows(&self.params[ad.b.clone()], ad.rows.len(), r);
            assert_eq!(out.len(), n * width);
            // Safety: the destination is rows 0..n, columns ad.rows of `out`, which we hold
            // mutably; `xa` and `b` are other buffers.
            unsafe { gemm_raw((out.as_mut_ptr().add(ad.rows.start), width), true, View::rows(xa, n, r), b.t(), scale, Threads::All) };
        }
    }

    /// Given `dout[N, W]` of the site's output, accumulates the adapters' gradients and adds
    /// their contribution to `dx[N, in]`, for the adapters at `(layer, site)`.
    pub fn backward(&mut self, (layer, site): (usize, Site), dx: &mut [f32], dout: &[f32], x: &[f32], n: usize, width: usize) {
        let scale = self.scale();
        let r = self.rank;
        self.dxa.resize(n * r, 0.0);
        for (i, ad) in self.adapters.iter().enumerate().filter(|(_, a)| a.layer == layer && a.site == site) {
            let d_o = View { data: dout, off: ad.rows.start, rows: n, cols: ad.rows.len(), rs: width, cs: 1 };
            let xa = View::rows(&self.xa[i], n, r);
            // dB += scale · doutᵀ · xa
            gemm(&mut self.grads[ad.b.clone()], true, d_o.t(), xa, scale, Threads::All);
            // dxa = scale · dout · B
            gemm(&mut self.dxa, false, d_o, View::rows(&self.params[ad.b.clone()], ad.rows.len(), r), scale, Threads::All);
            let dxa = View::rows(&self.dxa, n, r);
            // dA += dxaᵀ · x ; dx += dxa · A
            gemm(&mut self.grads[ad.a.clone()], true, dxa.t(), View::rows(x, n, ad.d_in), 1.0, Threads::All);
            gemm(dx, true, dxa, View::rows(&self.params[ad.a.clone()], r, ad.d_in), 1.0, Threads::All);
        }
    }

    /// Folds every adapter into the base weights: `W[rows] += scale · B·A`.
    pub fn merge_into(&self, params: &mut [f32], views: &GptParams) {
        let scale = self.scale();
        let r = self.rank;
        for ad in &self.adapters {
            let bp = &views.blocks[ad.layer];
            let w = match ad.site {
                Site::Qkv => &bp.c_attn_w,
                Site::AttnProj => &bp.attn_proj_w,
                Site::Fc => &bp.c_fc_w,
                Site::MlpProj => &bp.mlp_proj_w,
            };
            let dst = &mut params[w.start + ad.rows.start * ad.d_in..w.start + ad.rows.end * ad.d_in];
            let b = View::rows(&self.params[ad.b.clone()], ad.rows.len(), r);
            let a = View::rows(&self.params[ad.a.clone()], r, ad.d_in);
            gemm(dst, true, b, a, scale, Threads::All);
        }
    }

    pub fn num_params(&self) -> usize {
        self.layout.total
    }
}
