//! Communication compression (issue 23): 1-bit Adam's compressed all-reduce (Tang et al.,
//! "1-bit Adam", ICML 2021, Algorithm 1; DeepSpeed's `compressed_allreduce`).
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

#[cfg(test)]
mod tests {
    use super::*;

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
