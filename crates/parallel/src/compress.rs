//! Communication compression: 1-bit Adam's compressed all-reduce (Tang et al.,
//! "1-bit Adam", ICML 2021, Algorithm 1; DeepSpeed's `compressed_allreduce`), which 0/1 Adam
//! reuses on its own schedule ([`ZeroOneSchedule`]), and PowerSGD's low-rank gradient
//! all-reduce ([`PowerSgd`]).
//!
//! A buffer is averaged over the group as signs with scales, in two phases, each with
//! **error feedback** so that what compression drops is added back next time:
//! 1. *Workers.* Each rank adds its worker error to its buffer, cuts it into one chunk per rank
//!    and sends chunk `j` to rank `j` as one bit per element (32 signs per word) and the
//!    chunk's scale `‖u_j‖₂ / √len_j` (so the compressed chunk has the original's norm); what
//!    that loses is the new worker error.
//! 2. *Servers.* Rank `j` averages the chunks it received (in rank order), adds its server
//!    error, compresses the average the same way and all-gathers it; every rank ends with the
//!    same buffer.
//!
//! Bytes per rank: `2 (n−1) (⌈len/n⌉/32 + 1)` words, against an uncompressed all-reduce's
//! `2 (n−1)/n · len`: about 32× fewer. The words travel as `f32` bit patterns and are never
//! computed with.

use crate::comm::Comm;

/// Signs per word.
const BITS: usize = 32;

/// Packs the signs of `x` (bit set: `x ≥ 0`) 32 to a word, each word carried as an `f32`'s
/// bits; a short last word is padded with set bits.
pub fn pack_signs(x: &[f32], out: &mut [f32]) {
    for (w, c) in out.iter_mut().zip(x.chunks(BITS)) {
        let mut bits = u32::MAX;
        for (i, &v) in c.iter().enumerate() {
            if v < 0.0 {
                bits &= !(1 << i);
            }
        }
        *w = f32::from_bits(bits);
    }
}

/// `out[i] = ±scale` from the packed signs `words` ([`pack_signs`]).
pub fn unpack_signs(words: &[f32], scale: f32, out: &mut [f32]) {
    for (c, w) in out.chunks_mut(BITS).zip(words) {
        let bits = w.to_bits();
        for (i, v) in c.iter_mut().enumerate() {
            *v = if bits >> i & 1 == 1 { scale } else { -scale };
        }
    }
}

/// The norm-preserving scale of `x`'s signs: `‖x‖₂ / √len` (0 for an empty slice).
fn scale_of(x: &[f32]) -> f32 {
    if x.is_empty() {
        return 0.0;
    }
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    (ss / x.len() as f64).sqrt() as f32
}

/// Compresses `u` in place to `scale · sign(u)`, packing the signs into `words`; `err` gets
/// what was lost (`u − compressed`). Returns the scale.
fn compress(u: &mut [f32], err: &mut [f32], words: &mut [f32]) -> f32 {
    let s = scale_of(u);
    pack_signs(u, words);
    for (e, v) in err.iter_mut().zip(u.iter_mut()) {
        let c = if *v < 0.0 { -s } else { s };
        *e = *v - c;
        *v = c;
    }
    s
}

/// One rank's state of the compressed all-reduce of a `len`-element buffer over `n` ranks:
/// its worker error (`len`) and, as the server of its chunk, its server error (one chunk).
#[derive(Clone, Debug, PartialEq)]
pub struct OneBit {
    pub worker: Vec<f32>,
    pub server: Vec<f32>,
    len: usize,
    n: usize,
    rank: usize,
}

impl OneBit {
    /// Elements per chunk: `⌈len/n⌉`, rounded up to whole words.
    pub fn chunk(len: usize, n: usize) -> usize {
        len.div_ceil(n.max(1)).div_ceil(BITS) * BITS
    }

    /// Zero errors for rank `rank` of `n`.
    pub fn new(len: usize, n: usize, rank: usize) -> OneBit {
        OneBit { worker: vec![0.0; len], server: vec![0.0; Self::chunk(len, n)], len, n, rank }
    }

    /// Both errors as one buffer (for checkpoints): the worker's, then the server's; every
    /// rank's is [`OneBit::state_len`] long.
    pub fn state(&self) -> Vec<f32> {
        let mut v = self.worker.clone();
        v.extend_from_slice(&self.server);
        v
    }

    pub fn state_len(len: usize, n: usize) -> usize {
        len + Self::chunk(len, n)
    }

    /// Restores [`OneBit::state`].
    pub fn set_state(&mut self, s: &[f32]) {
        assert_eq!(s.len(), self.worker.len() + self.server.len(), "1-bit error state length");
        let (w, sv) = s.split_at(self.len);
        self.worker.copy_from_slice(w);
        self.server.copy_from_slice(sv);
    }

    /// Words per rank's message: the chunk's signs and its scale.
    fn msg(&self) -> usize {
        Self::chunk(self.len, self.n) / BITS + 1
    }

    /// `x ← (1/n) Σ_r x_r`, compressed with error feedback (see the module docs); the same
    /// result on every rank. `x.len()` must be the `len` this state was made for.
    pub fn all_reduce_mean(&mut self, comm: &dyn Comm, x: &mut [f32]) {
        assert_eq!((x.len(), comm.size(), comm.rank()), (self.len, self.n, self.rank), "1-bit all-reduce shape");
        let (n, c, msg) = (self.n, Self::chunk(self.len, self.n), self.msg());
        let real = |j: usize| (j * c).min(self.len)..((j + 1) * c).min(self.len);
        // 1. Worker: x + error, compressed chunk by chunk, chunk j for rank j.
        let mut out = vec![0.0f32; n * msg];
        for j in 0..n {
            let r = real(j);
            let (u, e) = (&mut x[r.clone()], &mut self.worker[r]);
            for (a, b) in u.iter_mut().zip(e.iter()) {
                *a += *b;
            }
            let block = &mut out[j * msg..(j + 1) * msg];
            let s = compress(u, e, &mut block[..msg - 1]);
            block[msg - 1] = s;
        }
        let mut inbox = vec![0.0f32; n * msg];
        comm.all_to_all(&out, &mut inbox);
        // 2. Server of chunk `rank`: the mean of every rank's compressed chunk, in rank order,
        //    plus the server error, compressed and gathered.
        let mine = real(self.rank);
        let m = mine.len();
        let mut avg = vec![0.0f32; m];
        let mut one = vec![0.0f32; m];
        for i in 0..n {
            let block = &inbox[i * msg..(i + 1) * msg];
            unpack_signs(&block[..msg - 1], block[msg - 1], &mut one);
            for (a, &v) in avg.iter_mut().zip(&one) {
                *a += v;
            }
        }
        let inv = 1.0 / n as f32;
        for (a, &e) in avg.iter_mut().zip(&self.server) {
            *a = *a * inv + e;
        }
        let mut mine_msg = vec![0.0f32; msg];
        let s = compress(&mut avg, &mut self.server[..m], &mut mine_msg[..msg - 1]);
        mine_msg[msg - 1] = s;
        let mut all = vec![0.0f32; n * msg];
        comm.all_gather(&mine_msg, &mut all);
        for j in 0..n {
            let r = real(j);
            let block = &all[j * msg..(j + 1) * msg];
            unpack_signs(&block[..msg - 1], block[msg - 1], &mut x[r]);
        }
    }
}

/// 0/1 Adam's schedule (Lu et al., "Maximizing Communication Efficiency for Large-scale
/// Training via 0/1 Adam", ICLR 2023; DeepSpeed's `ZeroOneAdam`): what step `t` (1-based) does.
///
/// - Steps `t ≤ warmup` are plain AdamW steps ([`ZeroOneKind::Variance`]).
/// - Up to `var_freeze_step`, the variance is updated at intervals that start at 1 and double
///   after every `var_update_scaler` updates (counted from the warm-up's end); those steps
///   all-reduce the gradient in full precision, the others send it as 1 bit with error feedback
///   ([`ZeroOneKind::OneBitGrad`]) and leave the variance as it was.
/// - Past `var_freeze_step` the variance is frozen and each rank steps on its own gradient
///   ([`ZeroOneKind::Local`]), accumulating its moves; every `interval`-th local step the ranks
///   average the accumulated moves as 1 bit. The interval starts at 1 and doubles after every
///   `local_step_scaler` local steps, up to `local_step_clipper`.
///
/// The kind of a step is a function of `t` alone (replayed from step 1: microseconds per step
/// even at a million steps), so resuming needs no schedule state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZeroOneSchedule {
    pub warmup: u64,
    pub var_freeze_step: u64,
    pub var_update_scaler: u64,
    pub local_step_scaler: u64,
    pub local_step_clipper: u64,
}

/// One step of [`ZeroOneSchedule`]; `var_updates` counts the variance updates so far,
/// including this step's (the variance's bias correction is `1 − β2^var_updates`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroOneKind {
    /// Full-precision gradient all-reduce; momentum and variance updated.
    Variance { var_updates: u64 },
    /// 1-bit gradient all-reduce; momentum updated, variance as it was.
    OneBitGrad { var_updates: u64 },
    /// A local step on the rank's own gradient with the variance frozen; `sync`: the
    /// accumulated moves are then averaged. (The first local step that runs restarts the error
    /// feedback, which held gradients and from then on holds moves.)
    Local { var_updates: u64, sync: bool },
}

impl ZeroOneKind {
    pub fn var_updates(self) -> u64 {
        match self {
            ZeroOneKind::Variance { var_updates } | ZeroOneKind::OneBitGrad { var_updates } | ZeroOneKind::Local { var_updates, .. } => var_updates,
        }
    }
}

impl ZeroOneSchedule {
    /// What step `t` (1-based) does.
    pub fn kind(&self, t: u64) -> ZeroOneKind {
        let (mut cv, mut vi, mut vc) = (0u64, 1u64, 0u64);
        let (mut li, mut lc) = (1u64, 0u64);
        let freeze = self.var_freeze_step.max(self.warmup);
        let mut kind = ZeroOneKind::Variance { var_updates: 0 };
        for s in 1..=t.max(1) {
            kind = if s <= self.warmup {
                cv += 1;
                ZeroOneKind::Variance { var_updates: cv }
            } else if s <= freeze {
                if (s - self.warmup).is_multiple_of(vi) {
                    cv += 1;
                    vc += 1;
                    if vc == self.var_update_scaler.max(1) {
                        (vc, vi) = (0, vi * 2);
                    }
                    ZeroOneKind::Variance { var_updates: cv }
                } else {
                    ZeroOneKind::OneBitGrad { var_updates: cv }
                }
            } else {
                let sync = (s - freeze).is_multiple_of(li);
                lc += 1;
                if lc == self.local_step_scaler.max(1) {
                    (lc, li) = (0, (li * 2).min(self.local_step_clipper.max(1)));
                }
                ZeroOneKind::Local { var_updates: cv, sync }
            };
        }
        kind
    }
}

/// PowerSGD (Vogels et al., NeurIPS 2019, Algorithm 1): each gradient matrix `M` (`rows × cols`,
/// with error feedback: `M ← G + e`) is replaced by the rank-`r` product `P Qᵀ` of one power
/// iteration warm-started from the previous step's `Q`: `P = M Q`, all-reduced (mean) and
/// orthonormalised (Gram–Schmidt, in column order), `Q = Mᵀ P`, all-reduced (mean), `M̂ = P Qᵀ`;
/// the error `e = M − M̂` stays on the rank. Every rank ends with the same `M̂`. Vectors and
/// matrices too small to gain (`(rows + cols)·r ≥ rows·cols`) are all-reduced uncompressed in
/// the same collective as the `P`s. Traffic per step: `Σ (rows + cols)·r` plus the
/// uncompressed elements, against all of them.
#[derive(Clone, Debug, PartialEq)]
pub struct PowerSgd {
    r: usize,
    /// Compressed matrices: (flat offset, rows, cols).
    mats: Vec<(usize, usize, usize)>,
    /// The flat ranges all-reduced uncompressed.
    plain: Vec<std::ops::Range<usize>>,
    /// Every matrix's `Q` (`cols × r`, concatenated): the same on every rank.
    pub q: Vec<f32>,
    /// This rank's error feedback over the compressed matrices (concatenated).
    pub err: Vec<f32>,
}

impl PowerSgd {
    /// For tensors `(flat offset, shape)` of a `len`-element gradient buffer, at rank `r`; `Q`
    /// starts as seeded standard normals (the same on every rank).
    pub fn new(tensors: &[(usize, Vec<usize>)], len: usize, r: usize, seed: u64) -> PowerSgd {
        let (mats, plain) = Self::split(tensors, r);
        let covered: usize = mats.iter().map(|&(_, a, b)| a * b).sum::<usize>() + plain.iter().map(|x| x.len()).sum::<usize>();
        assert_eq!(covered, len, "PowerSGD: the tensors must cover the buffer");
        let qn: usize = mats.iter().map(|&(_, _, c)| c * r).sum();
        let en: usize = mats.iter().map(|&(_, rows, c)| rows * c).sum();
        let mut rng = tensor::Rng::new(tensor::rng::mix64(seed ^ 0x0090_E55D));
        let q = (0..qn).map(|_| rng.normal() as f32).collect();
        PowerSgd { r, mats, plain, q, err: vec![0.0; en] }
    }

    /// The tensors compressed (matrices whose factors are smaller than they are) and the rest.
    #[allow(clippy::type_complexity)]
    fn split(tensors: &[(usize, Vec<usize>)], r: usize) -> (Vec<(usize, usize, usize)>, Vec<std::ops::Range<usize>>) {
        let (mut mats, mut plain) = (Vec::new(), Vec::new());
        for (off, shape) in tensors {
            match shape[..] {
                [rows, cols] if (rows + cols) * r < rows * cols => mats.push((*off, rows, cols)),
                _ => plain.push(*off..*off + shape.iter().product::<usize>()),
            }
        }
        (mats, plain)
    }

    /// Without allocating (for the memory plan): the elements of the error, of `Q`, and of the
    /// first all-reduce (the `P`s and the uncompressed tensors).
    pub fn sizes(tensors: &[(usize, Vec<usize>)], r: usize) -> (usize, usize, usize) {
        let (mats, plain) = Self::split(tensors, r);
        let err = mats.iter().map(|&(_, a, b)| a * b).sum();
        let q = mats.iter().map(|&(_, _, c)| c * r).sum();
        let p = mats.iter().map(|&(_, a, _)| a * r).sum::<usize>() + plain.iter().map(|x| x.len()).sum::<usize>();
        (err, q, p)
    }

    /// `Q` and the error, as one buffer (for checkpoints), and its length.
    pub fn state(&self) -> Vec<f32> {
        let mut v = self.err.clone();
        v.extend_from_slice(&self.q);
        v
    }

    pub fn set_state(&mut self, s: &[f32]) {
        assert_eq!(s.len(), self.err.len() + self.q.len(), "PowerSGD state length");
        let (e, q) = s.split_at(self.err.len());
        self.err.copy_from_slice(e);
        self.q.copy_from_slice(q);
    }

    /// `layout`'s tensors as `new` and `sizes` take them: (flat offset, shape).
    pub fn tensors(layout: &model::ParamLayout) -> Vec<(usize, Vec<usize>)> {
        layout.params.iter().map(|p| (p.offset, p.shape.clone())).collect()
    }

    /// Elements all-reduced per step: the `P`s and the uncompressed tensors, then the `Q`s.
    pub fn sent_elements(&self) -> (usize, usize) {
        let p: usize = self.mats.iter().map(|&(_, rows, _)| rows * self.r).sum::<usize>() + self.plain.iter().map(|x| x.len()).sum::<usize>();
        (p, self.q.len())
    }

    /// `g ← the ranks' mean gradient`, each matrix as its rank-`r` approximation.
    pub fn all_reduce_mean(&mut self, comm: &dyn Comm, g: &mut [f32]) {
        use tensor::matmul::{gemm, Threads, View};
        let (r, n) = (self.r, comm.size() as f32);
        let (np, _) = self.sent_elements();
        // M = G + e, in place in g.
        let mut at = 0;
        for &(off, rows, cols) in &self.mats {
            for (x, e) in g[off..off + rows * cols].iter_mut().zip(&self.err[at..at + rows * cols]) {
                *x += *e;
            }
            at += rows * cols;
        }
        // P = M Q, and the uncompressed tensors, in one all-reduce.
        let mut buf = vec![0.0f32; np];
        let (mut pq, mut qq) = (0, 0);
        for &(off, rows, cols) in &self.mats {
            let m = View::rows(&g[off..off + rows * cols], rows, cols);
            gemm(&mut buf[pq..pq + rows * r], false, m, View::rows(&self.q[qq..qq + cols * r], cols, r), 1.0, Threads::All);
            (pq, qq) = (pq + rows * r, qq + cols * r);
        }
        for x in &self.plain {
            buf[pq..pq + x.len()].copy_from_slice(&g[x.clone()]);
            pq += x.len();
        }
        comm.all_reduce_sum(&mut buf);
        buf.iter_mut().for_each(|x| *x /= n);
        // Orthonormal P (columns, Gram–Schmidt), then Q = Mᵀ P, all-reduced.
        let mut pq = 0;
        for &(_, rows, _) in &self.mats {
            orthonormalise(&mut buf[pq..pq + rows * r], rows, r);
            pq += rows * r;
        }
        let (mut pq, mut qq) = (0, 0);
        for &(off, rows, cols) in &self.mats {
            let m = View::rows(&g[off..off + rows * cols], rows, cols);
            gemm(&mut self.q[qq..qq + cols * r], false, m.t(), View::rows(&buf[pq..pq + rows * r], rows, r), 1.0, Threads::All);
            (pq, qq) = (pq + rows * r, qq + cols * r);
        }
        comm.all_reduce_sum(&mut self.q);
        self.q.iter_mut().for_each(|x| *x /= n);
        // M̂ = P Qᵀ; e = M − M̂; g = M̂.
        let (mut pq, mut qq, mut at) = (0, 0, 0);
        let mut approx = Vec::new();
        for &(off, rows, cols) in &self.mats {
            approx.resize(rows * cols, 0.0);
            gemm(&mut approx, false, View::rows(&buf[pq..pq + rows * r], rows, r), View::rows(&self.q[qq..qq + cols * r], cols, r).t(), 1.0, Threads::All);
            for ((x, e), &a) in g[off..off + rows * cols].iter_mut().zip(&mut self.err[at..at + rows * cols]).zip(&approx) {
                *e = *x - a;
                *x = a;
            }
            (pq, qq, at) = (pq + rows * r, qq + cols * r, at + rows * cols);
        }
        for x in &self.plain {
            g[x.clone()].copy_from_slice(&buf[pq..pq + x.len()]);
            pq += x.len();
        }
    }
}

/// Orthonormalises the `k` columns of the row-major `rows × k` matrix `a` in order (modified
/// Gram–Schmidt; a column that vanishes is left zero).
fn orthonormalise(a: &mut [f32], rows: usize, k: usize) {
    for j in 0..k {
        for i in 0..j {
            let dot: f64 = (0..rows).map(|t| a[t * k + i] as f64 * a[t * k + j] as f64).sum();
            for t in 0..rows {
                a[t * k + j] -= (dot as f32) * a[t * k + i];
            }
        }
        let norm = (0..rows).map(|t| (a[t * k + j] as f64).powi(2)).sum::<f64>().sqrt();
        let inv = if norm > 1e-30 { (1.0 / norm) as f32 } else { 0.0 };
        for t in 0..rows {
            a[t * k + j] *= inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn power_sgd_is_exact_for_low_rank_gradients_and_the_same_on_every_rank() {
        // Two ranks whose gradients are rank-1 matrices plus a vector: the mean of two rank-1
        // matrices has rank 2, so rank 2 reproduces it (after the power iteration converges,
        // warm-started from the previous Q) and the vector is exact.
        let (rows, cols, r) = (12, 10, 2);
        let len = rows * cols + 5;
        let grad = |rank: usize| -> Vec<f32> {
            let u: Vec<f32> = (0..rows).map(|i| (i as f32 * 0.3 + rank as f32).sin()).collect();
            let v: Vec<f32> = (0..cols).map(|j| (j as f32 * 0.7 - rank as f32).cos()).collect();
            let mut g: Vec<f32> = (0..rows * cols).map(|x| u[x / cols] * v[x % cols]).collect();
            g.extend((0..5).map(|i| i as f32 + rank as f32));
            g
        };
        let truth: Vec<f32> = (0..len).map(|i| 0.5 * (grad(0)[i] + grad(1)[i])).collect();
        let outs = crate::run_ranks(2, |c| {
            let mut p = PowerSgd::new(&[(0, vec![rows, cols]), (rows * cols, vec![5])], len, r, 7);
            let mut last = Vec::new();
            for _ in 0..6 {
                let mut g = grad(c.rank());
                p.all_reduce_mean(c, &mut g);
                last = g;
            }
            (last, p.sent_elements())
        });
        assert_eq!(outs[0].0, outs[1].0, "the same result on every rank");
        let err = outs[0].0.iter().zip(&truth).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(err < 1e-3, "rank-2 mean reproduced: max error {err}");
        assert_eq!(outs[0].1, (rows * r + 5, cols * r));
    }

    #[test]
    fn orthonormalised_columns_are_orthonormal() {
        let mut a: Vec<f32> = (0..30).map(|i| ((i * 7 % 11) as f32) - 5.0).collect();
        orthonormalise(&mut a, 10, 3);
        for i in 0..3 {
            for j in 0..3 {
                let d: f32 = (0..10).map(|t| a[t * 3 + i] * a[t * 3 + j]).sum();
                assert!((d - if i == j { 1.0 } else { 0.0 }).abs() < 1e-5, "{i} {j}: {d}");
            }
        }
    }

    #[test]
    fn zeroone_schedule_doubles_its_intervals_and_freezes() {
        let s = ZeroOneSchedule { warmup: 2, var_freeze_step: 20, var_update_scaler: 3, local_step_scaler: 4, local_step_clipper: 4 };
        let kinds: Vec<ZeroOneKind> = (1..=40).map(|t| s.kind(t)).collect();
        let var: Vec<u64> = (1..=20).filter(|&t| matches!(kinds[t as usize - 1], ZeroOneKind::Variance { .. })).collect();
        // Warm-up 1, 2; then interval 1 for three updates (3, 4, 5), 2 for three (6, 8, 10:
        // counted from the warm-up's end), 4 (14, 18), frozen past 20.
        assert_eq!(var, vec![1, 2, 3, 4, 5, 6, 8, 10, 14, 18]);
        assert_eq!(kinds[19], ZeroOneKind::OneBitGrad { var_updates: 10 });
        assert!((21..=40).all(|t| kinds[t as usize - 1].var_updates() == 10));
        // Local steps from 21: syncing every step for 4, every 2nd for 4, then every 4th.
        let sync: Vec<u64> = (21..=40).filter(|&t| matches!(kinds[t as usize - 1], ZeroOneKind::Local { sync: true, .. })).collect();
        assert_eq!(sync, vec![21, 22, 23, 24, 26, 28, 32, 36, 40]);
        assert_eq!(kinds[20], ZeroOneKind::Local { var_updates: 10, sync: true });
    }

    #[test]
    fn signs_round_trip_through_words() {
        let x: Vec<f32> = (0..70).map(|i| if i % 3 == 0 { -(i as f32) - 0.5 } else { i as f32 }).collect();
        let mut w = vec![0.0; 3];
        pack_signs(&x, &mut w);
        let mut y = vec![0.0; 70];
        unpack_signs(&w, 2.0, &mut y);
        for (a, b) in x.iter().zip(&y) {
            assert_eq!(b.abs(), 2.0);
            assert_eq!(*a < 0.0, *b < 0.0);
        }
    }

    #[test]
    fn compression_keeps_the_norm_and_the_error_is_what_it_dropped() {
        let mut u = vec![3.0, -4.0, 0.0, 1.0];
        let orig = u.clone();
        let (mut e, mut w) = (vec![0.0; 4], vec![0.0; 1]);
        let s = compress(&mut u, &mut e, &mut w);
        assert!((s - (26.0f32 / 4.0).sqrt()).abs() < 1e-6);
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm(&u) - norm(&orig)).abs() < 1e-5);
        for i in 0..4 {
            assert_eq!(u[i] + e[i], orig[i]);
        }
    }

    #[test]
    fn the_compressed_mean_is_the_same_on_every_rank_and_error_feedback_tracks_the_true_mean() {
        let (n, len) = (3, 100);
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| (0..len).map(|i| ((i * 7 + r * 13) % 17) as f32 - 8.0 + 0.1 * r as f32).collect()).collect();
        let truth: Vec<f32> = (0..len).map(|i| inputs.iter().map(|x| x[i]).sum::<f32>() / n as f32).collect();
        let rounds = 64;
        let outs = crate::run_ranks(n, |c| {
            let mut st = OneBit::new(len, n, c.rank());
            // The same input every round: with error feedback the running mean of the outputs
            // converges to the true mean.
            let mut acc = vec![0.0f64; len];
            let mut last = Vec::new();
            let mut sent = 0;
            for _ in 0..rounds {
                let mut x = inputs[c.rank()].clone();
                let before = c.counters().snapshot();
                st.all_reduce_mean(c, &mut x);
                sent = c.counters().snapshot().since(&before).bytes_sent();
                for (a, &v) in acc.iter_mut().zip(&x) {
                    *a += v as f64;
                }
                last = x;
            }
            (last, acc, sent)
        });
        for o in &outs[1..] {
            assert_eq!(o.0, outs[0].0, "every rank holds the same result");
        }
        let err: f64 = outs[0].1.iter().zip(&truth).map(|(a, &t)| (a / rounds as f64 - t as f64).abs()).fold(0.0, f64::max);
        assert!(err < 0.35, "the error-fed average tracks the mean: max deviation {err}");
        // One round's bytes: two phases of (n − 1) messages of ⌈len/n⌉/32 + 1 words.
        let words = OneBit::chunk(len, n) / 32 + 1;
        assert_eq!(words, 3);
        assert_eq!(outs[0].2, (2 * (n - 1) * words * 4) as u64);
    }
}
