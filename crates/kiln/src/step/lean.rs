//! AdamW's compact state (`optim.state`): the moments in bf16 or in 8 bits
//! (`tensor::lean`), and under bf16 the weights their own master copy. The moments keep the
//! layout of the fp32 ones (this rank's shard); 8-bit blocks start at each run the update
//! visits (a decay group inside a piece), so no block straddles two runs. Checkpoints hold the
//! moments in fp32, which quantize back to the same codes: a resume at the same layout is
//! exact.

use super::{Moments, Optimizer};
use crate::config::StateForm;
use tensor::lean::{adamw_update_lean, dequantize, quantize, Draws, LeanMoments, Moment, BLOCK};

/// The moments in their compact form.
pub enum LeanForm {
    Bf16 { m: Vec<u16>, v: Vec<u16> },
    Int8 { m: Vec<u8>, v: Vec<u8>, ms: Vec<f32>, vs: Vec<f32> },
}

/// Compact state and where each update run's blocks start.
pub struct Lean {
    pub form: LeanForm,
    /// bf16 weights updated with stochastic rounding (no fp32 master copy).
    pub round_weights: bool,
    seed: u64,
    len: usize,
    /// Each run the update visits: (its first state position, length, first 8-bit scale).
    runs: Vec<(usize, usize, usize)>,
}

/// One compact moment's live buffers, for a checkpoint's copy while training waits at the
/// snapshot's gate: raw views of heap buffers (which stay put however the optimizer moves) and a
/// copy of the update runs.
pub struct LeanView {
    codes: Codes,
    len: usize,
    runs: Vec<(usize, usize, usize)>,
}

enum Codes {
    Bf16(*const u16),
    Int8 { codes: *const u8, scales: (*const f32, usize), which: Moment },
}

// SAFETY: read only, on the checkpoint writer's thread, while the gate holds the update back
// (as `checkpoint::Source::Live`).
unsafe impl Send for LeanView {}

impl Lean {
    /// The view of the first moment, or with `second` the second.
    pub fn view(&self, second: bool) -> LeanView {
        let codes = match &self.form {
            LeanForm::Bf16 { m, v } => Codes::Bf16(if second { v.as_ptr() } else { m.as_ptr() }),
            LeanForm::Int8 { m, v, ms, vs } => {
                let (c, s, which) = if second { (v, vs, Moment::Second) } else { (m, ms, Moment::First) };
                Codes::Int8 { codes: c.as_ptr(), scales: (s.as_ptr(), s.len()), which }
            }
        };
        LeanView { codes, len: self.len, runs: self.runs.clone() }
    }
}

impl LeanView {
    /// Appends state positions `r` to `out` in fp32; positions outside every update run are 0.
    ///
    /// # Safety
    /// The viewed buffers must be alive and unwritten for the call (the snapshot's gate).
    pub unsafe fn extend_f32(&self, out: &mut Vec<f32>, r: std::ops::Range<usize>) {
        let at = out.len();
        out.resize(at + r.len(), 0.0);
        let dst = &mut out[at..];
        match self.codes {
            Codes::Bf16(p) => {
                let src = &std::slice::from_raw_parts(p, self.len)[r];
                dst.iter_mut().zip(src).for_each(|(o, &x)| *o = tensor::bf16::from_bf16(x));
            }
            Codes::Int8 { codes, scales, which } => {
                let (codes, scales) = (std::slice::from_raw_parts(codes, self.len), std::slice::from_raw_parts(scales.0, scales.1));
                for &(start, n, s) in &self.runs {
                    let (a, b) = (r.start.max(start), r.end.min(start + n));
                    if a >= b {
                        continue;
                    }
                    // Whole blocks around [a, b), dequantized, then the part asked for.
                    let (b0, b1) = ((a - start) / BLOCK, (b - start).div_ceil(BLOCK));
                    let (lo, hi) = (start + b0 * BLOCK, (start + b1 * BLOCK).min(start + n));
                    let mut tmp = vec![0.0f32; hi - lo];
                    dequantize(which, &codes[lo..hi], &scales[s + b0..s + b1], &mut tmp);
                    dst[a - r.start..b - r.start].copy_from_slice(&tmp[a - lo..b - lo]);
                }
            }
        }
    }
}

impl Optimizer {
    /// Makes the state compact, from the fp32 moments of the `pieces` this optimizer updates
    /// (a checkpoint's with `loaded`, else zeros, which are not read: their untouched pages
    /// never become resident); under `form = bf16` with bf16 weights, drops the master
    /// weights' low halves (the working weights become the master copy). `seed` draws the
    /// stochastic rounding.
    pub fn make_lean(&mut self, form: StateForm, pieces: &[parallel::Piece], (seed, loaded): (u64, bool)) {
        let mut runs = Vec::new();
        for piece in pieces {
            let f = &piece.flat;
            for (r, _) in self.decay_groups() {
                let (a, b) = (r.start.max(f.start), r.end.min(f.end));
                if a < b {
                    runs.push((piece.shard.start + a - f.start, b - a, 0));
                }
            }
        }
        runs.sort();
        let mut blocks = 0;
        for run in runs.iter_mut() {
            run.2 = blocks;
            blocks += run.1.div_ceil(BLOCK);
        }
        let len = self.m.len();
        let lean_form = match form {
            StateForm::Fp32 => return,
            StateForm::Bf16 if !loaded => LeanForm::Bf16 { m: vec![0; len], v: vec![0; len] },
            StateForm::Int8 if !loaded => LeanForm::Int8 { m: vec![0; len], v: vec![0; len], ms: vec![0.0; blocks], vs: vec![0.0; blocks] },
            StateForm::Bf16 => LeanForm::Bf16 { m: self.m.iter().map(|&x| tensor::bf16::to_bf16(x)).collect(), v: self.v.iter().map(|&x| tensor::bf16::to_bf16(x)).collect() },
            StateForm::Int8 => {
                let (mut m, mut v, mut ms, mut vs) = (vec![0u8; len], vec![0u8; len], vec![0.0f32; blocks], vec![0.0f32; blocks]);
                for &(a, n, s) in &runs {
                    let k = n.div_ceil(BLOCK);
                    quantize(Moment::First, &self.m[a..a + n], &mut m[a..a + n], &mut ms[s..s + k]);
                    quantize(Moment::Second, &self.v[a..a + n], &mut v[a..a + n], &mut vs[s..s + k]);
                }
                LeanForm::Int8 { m, v, ms, vs }
            }
        };
        let round_weights = form == StateForm::Bf16 && matches!(self.master, Some(super::Master::Low(_)));
        if round_weights {
            // The working weights are the bf16 rounding of the master weights: they become
            // the master copy.
            self.master = None;
        }
        (self.m, self.v) = (Moments::Mem(Vec::new()), Moments::Mem(Vec::new()));
        self.lean = Some(Lean { form: lean_form, round_weights, seed, len, runs });
    }

    /// The compact moments in fp32, laid out as the fp32 ones would be (`None` in fp32).
    pub fn lean_moments_f32(&self) -> Option<(Vec<f32>, Vec<f32>)> {
        let l = self.lean.as_ref()?;
        let whole = |second: bool| {
            let mut x = Vec::with_capacity(l.len);
            // SAFETY: `l` is borrowed for the call, so its buffers live and stay unwritten.
            unsafe { l.view(second).extend_f32(&mut x, 0..l.len) };
            x
        };
        Some((whole(false), whole(true)))
    }

    /// Bytes of optimizer state held in memory (moments, compact or not).
    pub fn state_bytes(&self) -> usize {
        let plain = (self.m.len() + self.v.len() + self.factored.as_ref().map_or(0, |f| f.state.len())) * 4;
        plain + self.lean.as_ref().map_or(0, |l| match &l.form {
            LeanForm::Bf16 { m, v } => (m.len() + v.len()) * 2,
            LeanForm::Int8 { m, v, ms, vs } => m.len() + v.len() + (ms.len() + vs.len()) * 4,
        })
    }

    /// The compact update of one run: `at` its state position (a run [`Optimizer::make_lean`]
    /// listed), `flat` its layout position (the stochastic rounding's stream). Pieces of it
    /// start at multiples of `tensor::par::ELEMS`, so 8-bit blocks stay whole.
    pub(super) fn lean_update(&mut self, (params, grads): (&mut [f32], &[f32]), (at, flat): (usize, usize), h: &tensor::AdamW) {
        let Some(l) = self.lean.as_mut() else { unreachable!("lean_update without compact state") };
        let n = params.len();
        let scales_at = match &l.form {
            LeanForm::Int8 { .. } => {
                let i = l.runs.binary_search_by_key(&at, |r| r.0).expect("an update run of make_lean");
                assert_eq!(l.runs[i].1, n, "an update run of make_lean");
                l.runs[i].2
            }
            LeanForm::Bf16 { .. } => 0,
        };
        let (seed, round_params, form) = (l.seed, l.round_weights, &mut l.form);
        super::on_master(&mut self.master, self.round, (params, at), super::Span::Pieces, |w, r| {
            let d = Draws { seed, at: (flat + r.start) as u64, round_params };
            let e = at + r.start..at + r.end;
            let st = match form {
                LeanForm::Bf16 { m, v } => LeanMoments::Bf16 { m: &mut m[e.clone()], v: &mut v[e] },
                LeanForm::Int8 { m, v, ms, vs } => {
                    let k = scales_at + r.start / BLOCK..scales_at + r.end.div_ceil(BLOCK);
                    LeanMoments::Int8 { m: (&mut m[e.clone()], &mut ms[k.clone()]), v: (&mut v[e], &mut vs[k]) }
                }
            };
            adamw_update_lean(w, &grads[r], st, h, d);
        });
    }

    /// The compact state's buffers, for the tracking allocator.
    pub fn lean_buffers(&self) -> Vec<(*const u8, usize)> {
        let Some(l) = &self.lean else { return Vec::new() };
        match &l.form {
            LeanForm::Bf16 { m, v } => vec![(m.as_ptr() as *const u8, m.capacity() * 2), (v.as_ptr() as *const u8, v.capacity() * 2)],
            LeanForm::Int8 { m, v, ms, vs } => vec![(m.as_ptr(), m.capacity()), (v.as_ptr(), v.capacity()), (ms.as_ptr() as *const u8, ms.capacity() * 4), (vs.as_ptr() as *const u8, vs.capacity() * 4)],
        }
    }
}
