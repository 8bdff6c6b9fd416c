//! One optimizer step, shared by `kiln train` and `kiln bench`: micro-batch forward/backward
//! with gradient accumulation through the data-parallel store (one rank or many, any ZeRO
//! stage), global-norm clipping, and AdamW over the pieces this rank owns.

use crate::config::RunConfig;
use model::{Gpt, Pass};
use parallel::DataParallel;
use std::ops::Range;
use tensor::rng::mix64;
use tensor::{adamw_update, profile, scale_in_place, sum_squares, AdamW};

/// Where AdamW's moments live: in memory, or (ZeRO-Infinity's NVMe tier, on a CPU) in a
/// memory-mapped file that the update streams through in chunks, handing each chunk's pages
/// back to the kernel once updated, so they stay out of the process's resident memory.
pub enum Moments {
    Mem(Vec<f32>),
    File { map: memmap2::MmapMut, len: usize },
}

impl std::ops::Deref for Moments {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            Moments::Mem(v) => v,
            // SAFETY: the map is `len` f32s long and page-aligned (so f32-aligned).
            Moments::File { map, len } => unsafe { std::slice::from_raw_parts(map.as_ptr() as *const f32, *len) },
        }
    }
}

impl std::ops::DerefMut for Moments {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            Moments::Mem(v) => v,
            Moments::File { map, len } => unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr() as *mut f32, *len) },
        }
    }
}

impl Moments {
    /// `len` zeros in a new file at `path` (replaced if it exists), mapped shared.
    pub fn file(path: &std::path::Path, len: usize) -> std::io::Result<Moments> {
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
        f.set_len((len.max(1) * 4) as u64)?;
        let map = unsafe { memmap2::MmapMut::map_mut(&f)? };
        Ok(Moments::File { map, len })
    }

    /// Replaces the contents with `src` (same length).
    pub fn load(&mut self, src: &[f32]) {
        self.copy_from_slice(src);
        self.release(0..src.len());
    }

    /// Gives the pages of elements `r` back to the kernel (file-backed: the data stays in the
    /// file and the page cache; the process's resident set drops). No-op in memory.
    pub fn release(&mut self, r: Range<usize>) {
        if let Moments::File { map, .. } = self {
            let page = 4096;
            let (a, b) = ((r.start * 4).div_ceil(page) * page, (r.end * 4) / page * page);
            if b > a {
                // SAFETY: a shared file mapping: dropping its pages loses nothing.
                let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, a, b - a) };
            }
        }
    }
}

/// AdamW state: the two moments (in the layout, or in this rank's ZeRO shard), and the
/// layout's contiguous ranges grouped by whether weight decay applies.
pub struct Optimizer {
    pub m: Moments,
    pub v: Moments,
    segs: Vec<(Range<usize>, bool)>,
}

/// Elements per chunk of an offloaded update (4 MiB of each moment).
const OFFLOAD_CHUNK: usize = 1 << 20;

impl Optimizer {
    /// Moments for the whole `layout`.
    pub fn new(layout: &model::ParamLayout) -> Optimizer {
        Self::with_len(layout, layout.total)
    }

    /// Moments of `len` elements (a ZeRO shard: see [`parallel::Piece`]).
    pub fn with_len(layout: &model::ParamLayout, len: usize) -> Optimizer {
        let mut segs: Vec<(Range<usize>, bool)> = Vec::new();
        for p in &layout.params {
            match segs.last_mut() {
                Some((r, d)) if *d == p.decay && r.end == p.offset => r.end = p.offset + p.len(),
                _ => segs.push((p.range(), p.decay)),
            }
        }
        Optimizer { m: Moments::Mem(vec![0.0; len]), v: Moments::Mem(vec![0.0; len]), segs }
    }

    /// Moves the moments to memory-mapped files `dir/exp_avg.bin` and `dir/exp_avg_sq.bin`.
    pub fn offload(&mut self, dir: &std::path::Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let len = self.m.len();
        let (mut m, mut v) = (Moments::file(&dir.join("exp_avg.bin"), len)?, Moments::file(&dir.join("exp_avg_sq.bin"), len)?);
        m.load(&self.m);
        v.load(&self.v);
        (self.m, self.v) = (m, v);
        Ok(())
    }

    /// Applies one AdamW update with learning rate `lr` as step number `t` (1-based) to every
    /// parameter (`params`, `grads` and the moments all in the layout).
    pub fn update(&mut self, params: &mut [f32], grads: &[f32], cfg: &RunConfig, lr: f64, t: u64) {
        let all = 0..params.len();
        self.update_piece(params, grads, &parallel::Piece { flat: all.clone(), shard: all }, cfg, lr, t);
    }

    /// The update of one piece: `params` and `grads` hold layout elements `piece.flat`, whose
    /// moments are at `piece.shard`. AdamW is elementwise, so an element's new value does not
    /// depend on how the layout is cut into pieces.
    pub fn update_piece(&mut self, params: &mut [f32], grads: &[f32], piece: &parallel::Piece, cfg: &RunConfig, lr: f64, t: u64) {
        let tc = &cfg.train;
        let f = &piece.flat;
        for (r, decay) in &self.segs {
            let (a, b) = (r.start.max(f.start), r.end.min(f.end));
            if a >= b {
                continue;
            }
            let h = AdamW {
                lr: lr as f32,
                beta1: tc.beta1 as f32,
                beta2: tc.beta2 as f32,
                eps: tc.eps as f32,
                weight_decay: if *decay { tc.weight_decay as f32 } else { 0.0 },
                t,
            };
            let (lo, hi) = (a - f.start, b - f.start);
            let off = piece.shard.start;
            // Offloaded moments stream through in chunks, each released once updated.
            let step = if matches!(self.m, Moments::File { .. }) { OFFLOAD_CHUNK } else { hi - lo };
            let mut i = lo;
            while i < hi {
                let j = (i + step.max(1)).min(hi);
                adamw_update(&mut params[i..j], &grads[i..j], &mut self.m[off + i..off + j], &mut self.v[off + i..off + j], &h);
                self.m.release(off + i..off + j);
                self.v.release(off + i..off + j);
                i = j;
            }
        }
    }
}

/// The dropout seed of micro-batch `micro` of step `step`.
pub fn dropout_seed(seed: u64, step: u64, micro: usize) -> u64 {
    mix64(seed ^ mix64(step.wrapping_mul(1 << 16) + micro as u64))
}

/// What one optimizer step reports.
#[derive(Clone, Copy, Debug)]
pub struct StepOut {
    /// Mean loss over the global batch (the mean over micro-batches of each one's mean).
    pub loss: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// The gradient reduction's cost and how much of it backward hid (last micro-batch).
    pub overlap: parallel::Overlap,
    /// Why the update was skipped (`None`: it was applied).
    pub skipped: Option<&'static str>,
}

/// Runs optimizer step `step` (0-based) on this rank: for each micro-batch, `fill(micro, x, y)`
/// writes this rank's rows of it (`micro_batch / dp` sequences), then forward and backward
/// through `dp` accumulate gradients scaled so that their sum over ranks is the gradient of
/// the global micro-batch's mean loss, divided by `grad_accum`; then the reduction, clipping by
/// the global norm, and the AdamW update of the pieces this rank owns. `tp` is the
/// tensor-parallel group and the shard's replicated ranges, when the model is a shard.
#[allow(clippy::too_many_arguments)]
pub fn train_step(
    model: &mut Gpt,
    dp: &mut DataParallel,
    tp: Option<(&dyn parallel::Comm, &[std::ops::Range<usize>])>,
    opt: &mut Optimizer,
    cfg: &RunConfig,
    step: u64,
    x: &mut [u32],
    y: &mut [i32],
    mut fill: impl FnMut(usize, &mut [u32], &mut [i32]),
    mut veto: impl FnMut(f32, f64) -> Option<&'static str>,
) -> StepOut {
    let (t, accum) = (cfg.model.block_size, cfg.train.grad_accum);
    let rows = cfg.micro_batch() / dp.n();
    dp.zero_grad();
    if let Some(lo) = model.lora.as_mut() {
        lo.grads.fill(0.0);
    }
    let mut sums = vec![0.0f64; 2 * accum];
    for micro in 0..accum {
        {
            let _p = profile::scope("data");
            fill(micro, x, y);
        }
        let count = y.iter().filter(|&&v| v != model::gpt::IGNORE_INDEX).count();
        let global = if dp.n() > 1 { dp.all_reduce_f64(&[count as f64])[0] } else { count as f64 };
        // Per-token gradient scale 1/(global count · accum) on every rank.
        let loss_scale = if global > 0.0 { (count as f64 / global / accum as f64) as f32 } else { 0.0 };
        let pass = Pass::Train { dropout_seed: dropout_seed(cfg.train.seed, step, micro), loss_scale };
        dp.begin_micro(micro + 1 == accum);
        {
            let _p = profile::scope("forward");
            model.forward_with(dp, x, y, rows, t, pass);
            sums[2 * micro] = model.losses().iter().map(|&l| l as f64).sum::<f64>();
            sums[2 * micro + 1] = count as f64;
        }
        let _p = profile::scope("backward");
        model.backward_with(dp);
    }
    let overlap = {
        let _p = profile::scope("grad_sync");
        dp.finish_backward()
    };
    let _p = profile::scope("optimizer");
    let sums = if dp.n() > 1 { dp.all_reduce_f64(&sums) } else { sums };
    let loss = (0..accum).map(|k| if sums[2 * k + 1] > 0.0 { sums[2 * k] / sums[2 * k + 1] } else { 0.0 }).sum::<f64>() / accum as f64;
    let (lr, clip) = (cfg.lr_at(step), cfg.train.grad_clip);
    if cfg.faults.inject_nan_steps.contains(&(step + 1)) {
        match model.lora.as_mut() {
            Some(lo) => lo.grads[0] = f32::NAN,
            None => dp.for_each_piece(|p, _, g| if p.flat.start == 0 { g[0] = f32::NAN }),
        }
    }
    // The update is decided from the global loss and gradient norm, so every rank agrees.
    let check = |loss: f32, norm: f64, veto: &mut dyn FnMut(f32, f64) -> Option<&'static str>| {
        if !(loss.is_finite() && norm.is_finite()) {
            return Some("non-finite loss or gradient norm");
        }
        veto(loss, norm)
    };
    let grad_norm = if let Some(lo) = model.lora.as_mut() {
        dp.reduce_adapters(&mut lo.grads);
        let norm = sum_squares(&lo.grads).sqrt();
        if let Some(why) = check(loss as f32, norm, &mut veto) {
            return StepOut { loss: loss as f32, grad_norm: norm, overlap, skipped: Some(why) };
        }
        if clip > 0.0 && norm > clip {
            scale_in_place(&mut lo.grads, (clip / (norm + 1e-6)) as f32);
        }
        opt.update(&mut lo.params, &lo.grads, cfg, lr, step + 1);
        norm
    } else {
        // With tensor parallelism the shards' squares add up over the tp group; replicated
        // parameters (identical on every tp rank) count once.
        let norm = match tp {
            Some((comm, replicated)) => {
                let (sharded, repl) = dp.grad_sq_split(replicated);
                (parallel::comm::sum_f64(comm, sharded) + repl).sqrt()
            }
            None => dp.grad_norm(),
        };
        if let Some(why) = check(loss as f32, norm, &mut veto) {
            return StepOut { loss: loss as f32, grad_norm: norm, overlap, skipped: Some(why) };
        }
        if clip > 0.0 && norm > clip {
            dp.scale_grads((clip / (norm + 1e-6)) as f32);
        }
        dp.for_each_piece(|piece, params, grads| opt.update_piece(params, grads, piece, cfg, lr, step + 1));
        dp.after_update();
        norm
    };
    StepOut { loss: loss as f32, grad_norm, overlap, skipped: None }
}

/// A single-rank [`DataParallel`] over `model` (its own communication thread does nothing).
pub fn single_rank(model: &mut Gpt) -> DataParallel {
    let comm: Box<dyn parallel::Comm> = Box::new(parallel::InProcess::world(1).pop().unwrap());
    DataParallel::new(comm, model, 0, parallel::dp::DEFAULT_BUCKET_ELEMS)
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
