//! The LM head fused with softmax cross-entropy (`tensor::classifier::lm_head_crossentropy`'s
//! twin), and the optimizer's device side: the global gradient norm, clipping and AdamW
//! (`tensor::optim`'s twins). The step's changing scalars (the loss weight, the learning rate's
//! AdamW factors, the clipping factor) live in a small device buffer, never in a kernel's
//! arguments, so a step records the same launches every time.

use crate::kernels::u;
use crate::shader::{kernel, Kernel};
use crate::{At, Buf, DType, Gemm, Gpu, MatSpec};
use tensor::classifier::HeadDims;
use tensor::optim::AdamW;

/// Where [`Gpu::adamw_update_at`] finds element 0 of its run in each buffer.
#[derive(Clone, Copy, Debug)]
pub struct Offsets {
    pub params: usize,
    pub grads: usize,
    pub moments: usize,
}

const CROSSENTROPY: Kernel = kernel!("crossentropy", libs ["reduce", "softmax"], ["L", "LOSSES", "TGT", "S"], writes ["L", "LOSSES"]);
const CROSSENTROPY_VP: Kernel = kernel!("crossentropy_vp", libs ["reduce", "softmax"], ["L", "LOSSES", "TGT", "S", "ST"], writes ["L", "LOSSES", "ST"]);
const SUM_SQUARES: Kernel = kernel!("sum_squares", libs ["reduce"], ["OUT", "PART", "X"], writes ["OUT", "PART"]);
const CLIP: Kernel = kernel!("clip", ["S"], writes ["S"]);
const ADAMW: Kernel = kernel!("adamw", libs ["optim"], ["P", "G", "M", "V", "S"], writes ["P", "M", "V"]);
const LION: Kernel = kernel!("lion", libs ["optim"], ["P", "G", "M", "S"], writes ["P", "M"]);
/// This module's kernels (the CUDA build compiles each).
pub(crate) const KERNELS: &[&Kernel] = &[&CROSSENTROPY, &CROSSENTROPY_VP, &SUM_SQUARES, &CLIP, &ADAMW, &LION];

/// The vocabulary-parallel head's exchange: every rank's `[lse | target logit]` rows gathered.
type Gather<'a> = &'a mut dyn FnMut(&[f32]) -> Vec<f32>;

/// Every rank's `[lse | target logit]` of `rows` rows (rank order, as gathered) into the rows'
/// global `[lse | target logit]`: `m + ln Σ_r exp(lse_r − m)` in f64 and the target logits
/// summed in rank order (only the target's owner has a nonzero one), as the CPU combines them.
fn combine_row_stats(all: &[f32], rows: usize) -> Vec<f32> {
    let ranks = all.len() / (2 * rows);
    let part = |k: usize, j: usize, i: usize| all[k * 2 * rows + j * rows + i];
    let mut out = vec![0.0; 2 * rows];
    for i in 0..rows {
        let m = (0..ranks).map(|k| part(k, 0, i)).fold(f32::NEG_INFINITY, f32::max);
        out[i] = m + (0..ranks).map(|k| ((part(k, 0, i) - m) as f64).exp()).sum::<f64>().ln() as f32;
        out[rows + i] = (0..ranks).map(|k| part(k, 1, i)).sum::<f32>();
    }
    out
}

/// Workgroups the first stage of [`Gpu::sum_squares`] uses at most (its partial sums).
const PARTS: usize = 1024;

/// Where the optimizer's scalars sit in the step's scalar buffer: `[0..3]` AdamW's
/// `(step, rbc2, decay)` (`tensor::optim::adamw_scalars`), then the gradients' sum of squares,
/// their norm, and the factor clipping scales them by.
pub mod slot {
    pub const SUMSQ: usize = 3;
    pub const NORM: usize = 4;
    pub const CLIP_SCALE: usize = 5;
    /// Slots the optimizer uses; a step's own scalars (the loss weight) follow.
    pub const OPTIM: usize = 6;
}

impl Gpu {
    /// Rows of the fused head processed at once: `[R, Vp]` fp32 logits within 64 MiB and within
    /// the adapter's largest binding.
    pub fn head_rows(&self, n: usize, vp: usize) -> usize {
        let bytes = (64usize << 20).min(self.info.max_binding as usize);
        (bytes / 4 / vp.max(1)).clamp(1, n.max(1))
    }

    /// The LM head and its loss, fused, in chunks of [`Gpu::head_rows`] rows: `logits = inp ·
    /// weightᵀ`, `losses[i] = −ln softmax(logits[i, :V])[targets[i]]` (0 for the ignore index;
    /// `targets` holds the `i32` bits), and with `grads = (dinp, dweight, (scalars, at))`
    /// `dinp = dlogits·weight` (overwritten) and `dweight += dlogitsᵀ·inp` (none for a frozen
    /// head: `dweight` `None`), `dlogits =
    /// dloss·(p − onehot)` with `dloss = scalars[at]`. `scratch` holds at least one `[Vp]` fp32 row; it
    /// sets the chunk's rows `R`.
    #[allow(clippy::too_many_arguments)]
    pub fn lm_head_crossentropy(&self, losses: &Buf, grads: Option<(&Buf, Option<At>, (&Buf, usize))>, inp: &Buf, weight: At, targets: &Buf, scratch: &Buf, d: &HeadDims) {
        assert_eq!(d.offset, 0, "a vocabulary slice's head is lm_head_crossentropy_vocab_parallel");
        self.head_chunks(losses, grads, inp, weight, targets, scratch, d, None);
    }

    /// [`Gpu::lm_head_crossentropy`] over a vocabulary-parallel shard's rows `d.offset ..` of the
    /// head (`tensor::classifier::lm_head_crossentropy_vocab_parallel`): per chunk this rank's
    /// `[log-sum-exp | target logit]` per row are downloaded, `gather` all-gathers them across the
    /// ranks (rank order), the rows' global log-sum-exps (`m + ln Σ_r exp(lse_r − m)`, in f64 as
    /// the CPU's) and target logits go back up, and the losses and this rank's logit gradients
    /// follow from them. `dinp` is this rank's partial input gradient (the caller sums it over
    /// the ranks); `targets` hold global ids. `scratch` is the logits' chunk, as
    /// [`Gpu::lm_head_crossentropy`]'s, and the rows' statistics (two words a row of the chunk).
    #[allow(clippy::too_many_arguments)]
    pub fn lm_head_crossentropy_vocab_parallel(&self, losses: &Buf, grads: Option<(&Buf, Option<At>, (&Buf, usize))>, inp: &Buf, weight: At, targets: &Buf, scratch: (&Buf, &Buf), d: &HeadDims, gather: Gather) {
        self.head_chunks(losses, grads, inp, weight, targets, scratch.0, d, Some((gather, scratch.1)));
    }

    #[allow(clippy::too_many_arguments)]
    fn head_chunks(&self, losses: &Buf, grads: Option<(&Buf, Option<At>, (&Buf, usize))>, inp: &Buf, weight: At, targets: &Buf, scratch: &Buf, d: &HeadDims, mut gather: Option<(Gather, &Buf)>) {
        let HeadDims { c, v, vp, offset, ignore_index, .. } = *d;
        let n = targets.len();
        // As many rows as the scratch holds, within [`Gpu::head_rows`].
        let mut r = self.head_rows(n, vp).min(scratch.len() / vp.max(1));
        if let Some((_, st)) = &gather {
            r = r.min(st.len() / 2);
        }
        assert!(r >= 1 && losses.len() >= n && inp.len() >= n * c && weight.fits(vp * c), "lm_head_crossentropy: shapes");
        for r0 in (0..n).step_by(r) {
            let rows = r.min(n - r0);
            let (lg, x) = ((scratch, MatSpec::rows(0, vp)), (inp, MatSpec::rows(r0 * c, c)));
            self.gemm(Gemm::new(rows, vp, c), lg, x, (weight.buf, MatSpec::rows(weight.off, c).t()), None);
            let (scal, at) = grads.map_or((None, 0), |g| (Some(g.2 .0), g.2 .1));
            let args = [u(rows), u(v), u(vp), ignore_index as u32, u(r0), grads.is_some() as u32, u(at), u(offset)];
            match gather.as_mut() {
                Some((gather, st)) => {
                    let ce = |mode: u32| self.launch(&CROSSENTROPY_VP, Gpu::grid(rows, 1), &[&args[..], &[mode]].concat(), &[Some(scratch), Some(losses), Some(targets), scal, Some(st)]);
                    ce(0);
                    let mine: Vec<f32> = self.download_words(st, 0, 2 * rows).into_iter().map(f32::from_bits).collect();
                    let global = combine_row_stats(&gather(&mine), rows);
                    self.write_words(st, 0, &global.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
                    ce(1);
                }
                None => self.launch(&CROSSENTROPY, Gpu::grid(rows, 1), &args[..7], &[Some(scratch), Some(losses), Some(targets), scal]),
            }
            if let Some((dinp, dw, _)) = grads {
                self.gemm(Gemm::new(rows, c, vp), (dinp, MatSpec::rows(r0 * c, c)), lg, (weight.buf, MatSpec::rows(weight.off, c)), None);
                if let Some(dw) = dw {
                    self.gemm(Gemm::new(vp, c, rows).acc(), (dw.buf, MatSpec::rows(dw.off, c)), (scratch, MatSpec::rows(0, vp).t()), x, None);
                }
            }
        }
    }

    /// `out[at] (=|+=) Σ x[..n]²` in a fixed order (two stages through `parts`, at least
    /// [`Gpu::parts_len`] fp32 elements): the global norm's sum of squares, one parameter piece
    /// at a time with `accumulate` (`tensor::sum_squares`, in fp32).
    pub fn sum_squares(&self, out: (&Buf, usize), x: At, n: usize, parts: &Buf, accumulate: bool) {
        self.reduce(out, x, n, parts, accumulate, true);
    }

    /// `out[at] (=|+=) Σ x[..n]` in a fixed order, as [`Gpu::sum_squares`] (a step's loss sum).
    pub fn sum(&self, out: (&Buf, usize), x: At, n: usize, parts: &Buf, accumulate: bool) {
        self.reduce(out, x, n, parts, accumulate, false);
    }

    fn reduce(&self, out: (&Buf, usize), x: At, n: usize, parts: &Buf, accumulate: bool, squares: bool) {
        assert!(x.fits(n) && out.1 < out.0.len() && parts.len() >= PARTS && parts.dtype() == DType::F32, "sum_squares: shapes");
        let per = n.div_ceil(PARTS).next_multiple_of(256).max(256);
        let groups = n.div_ceil(per).max(1);
        self.launch(&SUM_SQUARES, Gpu::grid(groups, 1), &[u(n), u(x.off), u(per), 0, 0, 0, squares as u32], &[None, Some(parts), Some(x.buf)]);
        self.launch(&SUM_SQUARES, [1, 1, 1], &[u(groups), 0, 0, 1, u(out.1), accumulate as u32, 0], &[Some(out.0), Some(parts), None]);
    }

    /// The scratch [`Gpu::sum_squares`] needs.
    pub fn parts_len() -> usize {
        PARTS
    }

    /// From the sum of squares at [`slot::SUMSQ`] of `scalars`: the norm into [`slot::NORM`]
    /// and the clipping factor (`clip / (norm + 1e-6)` past `clip > 0`, else 1) into
    /// [`slot::CLIP_SCALE`].
    pub fn clip_scale(&self, scalars: &Buf, clip: f32) {
        assert!(scalars.len() >= slot::OPTIM, "clip_scale: the scalar buffer holds {} slots", scalars.len());
        self.launch(&CLIP, [1, 1, 1], &[u(slot::SUMSQ), u(slot::NORM), u(slot::CLIP_SCALE), clip.to_bits()], &[Some(scalars)]);
    }

    /// Writes AdamW's step scalars for `h` into `scalars[0..3]` (what [`Gpu::adamw_update`]
    /// reads), ordered with the kernels around it.
    pub fn set_adamw_scalars(&self, scalars: &Buf, h: &AdamW) {
        let s = tensor::optim::adamw_scalars(h, h.t);
        self.write_words(scalars, 0, &s.map(f32::to_bits));
    }

    /// AdamW over `n` elements from `at` of `params`, `grads`, `m`, `v` (fp32, one layout),
    /// the gradients scaled by the clipping factor at [`slot::CLIP_SCALE`] (write 1 there to
    /// leave them), `decay` whether weight decay applies: `tensor::adamw_update`'s arithmetic
    /// with `scalars` from [`Gpu::set_adamw_scalars`].
    pub fn adamw_update(&self, state: (&Buf, &Buf, &Buf, &Buf), at: usize, n: usize, h: &AdamW, decay: bool, scalars: &Buf) {
        self.adamw_update_at(state, Offsets { params: at, grads: at, moments: at }, n, h, decay, scalars);
    }

    /// [`Gpu::adamw_update`] with element `i`'s parameter, gradient and moments at their own
    /// offsets plus `i` (a ZeRO shard's moments and gradients beside the whole layout's
    /// parameters, or all four in the shard's positions).
    pub fn adamw_update_at(&self, state: (&Buf, &Buf, &Buf, &Buf), o: Offsets, n: usize, h: &AdamW, decay: bool, scalars: &Buf) {
        let (p, g, m, v) = state;
        let (at, gat, mat) = (o.params, o.grads, o.moments);
        assert!(at + n <= p.len() && g.len() >= gat + n && m.len() >= mat + n && v.len() >= mat + n && scalars.len() >= slot::OPTIM, "adamw_update: shapes");
        #[rustfmt::skip]
        let args = [
            u(n), u(at), h.beta1.to_bits(), (1.0 - h.beta1).to_bits(), h.beta2.to_bits(), (1.0 - h.beta2).to_bits(),
            h.eps.to_bits(), decay as u32, u(slot::CLIP_SCALE), u(mat), u(gat),
        ];
        self.launch(&ADAMW, Gpu::grid(n, 256), &args, &[Some(p), Some(g), Some(m), Some(v), Some(scalars)]);
    }

    /// Writes Lion's step scalars for `h` into `scalars[0..3]`: `lr`, (unused), `1 − lr·wd`, as
    /// `tensor::optim::lion_update` computes them.
    pub fn set_lion_scalars(&self, scalars: &Buf, h: &tensor::optim::Lion) {
        self.write_words(scalars, 0, &[h.lr.to_bits(), 0, (1.0 - h.lr * h.weight_decay).to_bits()]);
    }

    /// Lion (`tensor::optim::lion_update`) over `n` elements, element `i`'s parameter, gradient
    /// and moment at their offsets plus `i`, the gradients scaled by the clipping factor at
    /// [`slot::CLIP_SCALE`], `decay` whether weight decay applies, with `scalars` from
    /// [`Gpu::set_lion_scalars`].
    pub fn lion_update_at(&self, (p, g, m): (&Buf, &Buf, &Buf), o: Offsets, n: usize, h: &tensor::optim::Lion, decay: bool, scalars: &Buf) {
        let (at, gat, mat) = (o.params, o.grads, o.moments);
        assert!(at + n <= p.len() && g.len() >= gat + n && m.len() >= mat + n && scalars.len() >= slot::OPTIM, "lion_update: shapes");
        #[rustfmt::skip]
        let args = [
            u(n), u(at), h.beta1.to_bits(), (1.0 - h.beta1).to_bits(), h.beta2.to_bits(), (1.0 - h.beta2).to_bits(),
            decay as u32, u(slot::CLIP_SCALE), u(mat), u(gat),
        ];
        self.launch(&LION, Gpu::grid(n, 256), &args, &[Some(p), Some(g), Some(m), Some(scalars)]);
    }
}
