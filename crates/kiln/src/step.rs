//! One optimizer step, shared by `kiln train` and `kiln bench`: micro-batch forward/backward
//! with gradient accumulation, global-norm clipping, and AdamW over the flat buffers.

use crate::config::RunConfig;
use model::{Gpt, Pass};
use std::ops::Range;
use tensor::rng::mix64;
use tensor::{adamw_update, profile, scale_in_place, sum_squares, AdamW};

/// AdamW state: the two moments in the parameter layout, and the layout's contiguous ranges
/// grouped by whether weight decay applies (one update call per range).
pub struct Optimizer {
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    segs: Vec<(Range<usize>, bool)>,
}

impl Optimizer {
    pub fn new(layout: &model::ParamLayout) -> Optimizer {
        let mut segs: Vec<(Range<usize>, bool)> = Vec::new();
        for p in &layout.params {
            match segs.last_mut() {
                Some((r, d)) if *d == p.decay && r.end == p.offset => r.end = p.offset + p.len(),
                _ => segs.push((p.range(), p.decay)),
            }
        }
        Optimizer { m: vec![0.0; layout.total], v: vec![0.0; layout.total], segs }
    }

    /// Applies one AdamW update with learning rate `lr` as step number `t` (1-based) to the
    /// trainable parameters (the model's, or its LoRA adapters').
    pub fn update(&mut self, params: &mut [f32], grads: &[f32], cfg: &RunConfig, lr: f64, t: u64) {
        let tc = &cfg.train;
        for (r, decay) in &self.segs {
            let h = AdamW {
                lr: lr as f32,
                beta1: tc.beta1 as f32,
                beta2: tc.beta2 as f32,
                eps: tc.eps as f32,
                weight_decay: if *decay { tc.weight_decay as f32 } else { 0.0 },
                t,
            };
            adamw_update(&mut params[r.clone()], &grads[r.clone()], &mut self.m[r.clone()], &mut self.v[r.clone()], &h);
        }
    }
}

/// The dropout seed of micro-batch `micro` of step `step`.
pub fn dropout_seed(seed: u64, step: u64, micro: usize) -> u64 {
    mix64(seed ^ mix64(step.wrapping_mul(1 << 16) + micro as u64))
}

/// Runs optimizer step `step` (0-based): for each micro-batch, `fill(micro, x, y)` writes its
/// tokens and targets, then forward and backward accumulate gradients scaled by 1/grad_accum;
/// then clipping and the AdamW update. Returns (mean loss, gradient norm before clipping).
pub fn train_step(
    model: &mut Gpt,
    opt: &mut Optimizer,
    cfg: &RunConfig,
    step: u64,
    x: &mut [u32],
    y: &mut [i32],
    mut fill: impl FnMut(usize, &mut [u32], &mut [i32]),
) -> (f32, f64) {
    let (mb, t, accum) = (cfg.micro_batch(), cfg.model.block_size, cfg.train.grad_accum);
    model.zero_grad();
    let mut loss_sum = 0.0f64;
    for micro in 0..accum {
        {
            let _p = profile::scope("data");
            fill(micro, x, y);
        }
        let pass = Pass::Train { dropout_seed: dropout_seed(cfg.train.seed, step, micro), loss_scale: 1.0 / accum as f32 };
        {
            let _p = profile::scope("forward");
            loss_sum += model.forward(x, y, mb, t, pass) as f64;
        }
        let _p = profile::scope("backward");
        model.backward();
    }
    let _p = profile::scope("optimizer");
    let (params, grads) = trainable(model);
    let grad_norm = sum_squares(grads).sqrt();
    if cfg.train.grad_clip > 0.0 && grad_norm > cfg.train.grad_clip {
        scale_in_place(grads, (cfg.train.grad_clip / (grad_norm + 1e-6)) as f32);
    }
    opt.update(params, grads, cfg, cfg.lr_at(step), step + 1);
    ((loss_sum / accum as f64) as f32, grad_norm)
}

/// Model FLOPs per trained token (forward and backward, no recomputation), by PaLM's formula
/// (Chowdhery et al. 2022, appendix B) as the planner states it.
/// With mixture-of-experts layers N counts the parameters a token uses: the routed experts'
/// weights only `top_k / n_expert` of them.
pub fn model_flops_per_token(model: &Gpt) -> f64 {
    let mut n = model.layout.count_without("transformer.wpe.weight") as f64;
    let c = &model.cfg;
    if c.is_moe() {
        let routed: usize = model.views.blocks.iter().filter_map(|b| b.moe.as_ref()).map(|m| m.experts.len()).sum();
        n -= routed as f64 * (1.0 - c.top_k as f64 / c.n_expert as f64);
    }
    plan::palm_flops_per_token(n, c.n_layer as f64, c.n_embd as f64, c.block_size as f64)
}

/// The parameters and gradients that train: the LoRA adapters when the model has them, else
/// every parameter.
pub fn trainable(model: &mut Gpt) -> (&mut [f32], &mut [f32]) {
    match model.lora.as_mut() {
        Some(lo) => (&mut lo.params, &mut lo.grads),
        None => (&mut model.params, &mut model.grads),
    }
}

/// The layout of [`trainable`].
pub fn trainable_layout(model: &Gpt) -> &model::ParamLayout {
    model.lora.as_ref().map_or(&model.layout, |lo| &lo.layout)
}

/// Hardware FLOPs per token: the model FLOPs plus the forward work that activation
/// recomputation repeats (for HFU, which counts what the machine executes; MFU never counts
/// recomputation). Full reruns each block's forward, `2·N_blocks + 4·L·C·T` (its matmuls and
/// attention, as in PaLM's split of `6N + 12·L·C·T` into forward and backward); selective
/// reruns the q|k|v and first MLP products and attention.
pub fn hardware_flops_per_token(model: &Gpt) -> f64 {
    let c = &model.cfg;
    let attn_fwd = 4.0 * (c.n_layer * c.n_embd * c.block_size) as f64;
    let sum = |f: &dyn Fn(&model::layout::BlockParams) -> usize| model.views.blocks.iter().map(f).sum::<usize>() as f64;
    let extra = match model.recompute {
        model::gpt::Recompute::None => 0.0,
        model::gpt::Recompute::Full => {
            2.0 * sum(&|b| b.c_attn_w.len() + b.attn_proj_w.len() + b.c_fc_w.len() + b.mlp_proj_w.len() + b.moe.as_ref().map_or(0, |m| m.router.len() + m.shared.len() + m.experts.len() * c.top_k / c.n_expert.max(1))) + attn_fwd
        }
        model::gpt::Recompute::Selective => {
            2.0 * sum(&|b| b.c_attn_w.len() + b.c_fc_w.len() + b.moe.as_ref().map_or(0, |m| m.router.len() + m.shared.len() + m.experts.len() * c.top_k / c.n_expert.max(1))) + attn_fwd
        }
    };
    model_flops_per_token(model) + extra
}
