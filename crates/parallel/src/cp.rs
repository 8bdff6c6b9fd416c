//! Context parallelism: every sequence's positions split over a `cp`-way group, attention
//! computed across it (Megatron-LM's context parallelism, Liu et al.'s ring attention,
//! DeepSpeed-Ulysses), applied without editing the model: a part's config says which
//! positions it holds (`Placement::context`, contiguous or zig-zag chunks) and its attention
//! calls [`CpComm`] through `model::CpHooks`. Everything else in a block is per position, so
//! it runs on the part's rows unchanged; the weights are whole on every cp rank and their
//! gradients are partial sums over the rank's positions, reduced with the data-parallel ones
//! (the trainer's data group spans `dp × ep × cp`).
//!
//! **Ring** (`CpMode::Ring`): each rank packs its keys and values (`[B, T/cp, 2·NKV·HS]`) and
//! passes them around the group while it attends its queries to the block it holds
//! (`tensor::flash::Block`), merging through the running log-sum-exp: its own block first,
//! then ranks `r−1, r−2, …`; each block is sent on before it is used, so the next block's
//! transfer overlaps this block's compute (sends are buffered). Blocks a query chunk cannot see
//! (keys after it, or before its sliding window) are skipped. Backward passes the keys and
//! values around again with their gradient accumulator, which arrives home after one more hop.
//! Bytes per layer and micro-batch, per rank: forward `(cp−1)·KV`, backward `(cp−1)·KV + cp·KV`
//! (`KV = B·(T/cp)·2·NKV·HS·4`).
//!
//! **Ulysses** (`CpMode::Ulysses`): an all-to-all turns the sequence split into a head split
//! (rank `c` gets heads `c·NH/cp ..` of every position, and their kv heads: `NKV/cp` of them,
//! or with `NKV < cp` the one its query heads share), the whole-sequence kernel runs on them,
//! and an all-to-all turns the output back. Backward exchanges q|k|v again, the output
//! gradient and `D`, and returns `dq|dk|dv` (a kv head shared by several ranks gets their
//! gradients summed in rank order).

use crate::comm::Comm;
use model::config::ContextSlice;
use model::{CpHooks, HeadsBackward, HeadsForward};
use plan::policy::CpMode;
use std::cell::Cell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;
use tensor::attention::AttnDropout;
use tensor::flash::{flash_d, flash_gqa_block_backward, flash_gqa_block_forward, flash_gqa_forward_docs, pack_kv, unpack_kv_add, Block, Span};
use tensor::llama::GqaDims;

/// What this thread's context-parallel attention did since the last [`take_times`]: seconds
/// in the attention kernels, seconds blocked waiting for other ranks (ring blocks not yet
/// arrived, Ulysses' all-to-alls), and ring blocks computed and skipped as invisible.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpTimes {
    pub compute_s: f64,
    pub wait_s: f64,
    pub blocks: u64,
    pub skipped: u64,
    /// Visible (query, key) score pairs of the blocks computed, per head: the attention's work,
    /// which a balanced split shares equally whatever the clock says.
    pub pairs: u64,
}

thread_local! {
    static TIMES: Cell<CpTimes> = const { Cell::new(CpTimes { compute_s: 0.0, wait_s: 0.0, blocks: 0, skipped: 0, pairs: 0 }) };
}

/// This thread's (a rank's) [`CpTimes`] since the last call, and a fresh start.
pub fn take_times() -> CpTimes {
    TIMES.with(|t| t.replace(CpTimes::default()))
}

fn add_times(f: impl FnOnce(&mut CpTimes)) {
    TIMES.with(|t| {
        let mut x = t.get();
        f(&mut x);
        t.set(x);
    });
}

/// The device clock (`parallel.cp_clock = device`): attention kernels run one at a time across
/// the process, so each rank's kernel time is what a processor of its own would take (for
/// measuring balance on a machine with fewer cores than ranks). Waits are not serialised.
static DEVICE_CLOCK: AtomicBool = AtomicBool::new(false);
static DEVICE: Mutex<()> = Mutex::new(());

pub fn set_device_clock(on: bool) {
    DEVICE_CLOCK.store(on, Ordering::Relaxed);
}

/// Runs an attention kernel, timed (alone in the process under the device clock).
fn compute<R>(f: impl FnOnce() -> R) -> R {
    let _one = DEVICE_CLOCK.load(Ordering::Relaxed).then(|| DEVICE.lock().unwrap_or_else(|e| e.into_inner()));
    let t0 = Instant::now();
    let r = f();
    let dt = t0.elapsed().as_secs_f64();
    add_times(|t| t.compute_s += dt);
    r
}

/// Runs a blocking exchange, timed as waiting.
fn wait<R>(f: impl FnOnce() -> R) -> R {
    let t0 = Instant::now();
    let r = f();
    let dt = t0.elapsed().as_secs_f64();
    add_times(|t| t.wait_s += dt);
    r
}

/// The attention hooks of a context-parallel part.
pub struct CpComm {
    pub comm: Box<dyn Comm>,
    pub slice: ContextSlice,
    pub mode: CpMode,
}

const TAG_KV: u32 = 0x6370_0001;
const TAG_DKV: u32 = 0x6370_0002;

impl CpComm {
    pub fn new(comm: Box<dyn Comm>, slice: ContextSlice, mode: CpMode) -> CpComm {
        assert_eq!(comm.size(), slice.count, "context-parallel group size");
        assert_eq!(comm.rank(), slice.index, "context-parallel rank");
        CpComm { comm, slice, mode }
    }

    /// Rank `r`'s slice of the group.
    fn of(&self, r: usize) -> ContextSlice {
        ContextSlice { index: r, ..self.slice }
    }

    /// The blocks of ring step `s` on this rank ([`ContextSlice::ring_blocks`]), counted.
    fn ring_blocks(&self, s: usize, t: usize, window: usize, sinks: usize) -> Vec<(Span, Span)> {
        let v = self.slice.ring_blocks(s, t, (window, sinks));
        let owner = self.of((self.slice.index + self.slice.count - s) % self.slice.count);
        let all = self.slice.spans(t).len() * owner.spans(t).len();
        add_times(|x| (x.blocks, x.skipped) = (x.blocks + v.len() as u64, x.skipped + (all - v.len()) as u64));
        v
    }

    fn ring_forward(&mut self, out: &mut [f32], lse: &mut [f32], qkv: &[f32], dims: &GqaDims, starts: &[u32], dropout: AttnDropout) {
        let (n, r) = (self.slice.count, self.slice.index);
        let gd = GqaDims { t: dims.t * n, ..*dims };
        let kw = 2 * dims.nkv * dims.hs;
        let mut cur = pack_kv(qkv, dims);
        let mut next = vec![0.0; cur.len()];
        for s in 0..n {
            if s + 1 < n {
                self.comm.send(&cur, (r + 1) % n, TAG_KV);
            }
            for (q, k) in self.ring_blocks(s, gd.t, dims.window, dims.sinks) {
                let blk = Block { qkv, q, kv: &cur, kw, kc: 0, vc: kw / 2, k, starts };
                add_times(|x| x.pairs += visible_pairs(&gd, q, k, starts));
                compute(|| flash_gqa_block_forward(out, lse, &blk, &gd, s == 0 && q == k, dropout));
            }
            if s + 1 < n {
                wait(|| self.comm.recv(&mut next, (r + n - 1) % n, TAG_KV));
                std::mem::swap(&mut cur, &mut next);
            }
        }
    }

    fn ring_backward(&mut self, dqkv: &mut [f32], dout: &[f32], saved: (&[f32], &[f32], &[f32]), dims: &GqaDims, starts: &[u32], dropout: AttnDropout) {
        let (qkv, out, lse) = saved;
        let (n, r) = (self.slice.count, self.slice.index);
        let gd = GqaDims { t: dims.t * n, ..*dims };
        let kw = 2 * dims.nkv * dims.hs;
        let mut d = vec![0.0; dims.b * dims.nh * dims.t];
        flash_d(&mut d, dout, out, dims, dims.t);
        let mut cur = pack_kv(qkv, dims);
        let mut dcur = vec![0.0; cur.len()];
        let (mut next, mut dnext) = (vec![0.0; cur.len()], vec![0.0; cur.len()]);
        for s in 0..n {
            if s + 1 < n {
                self.comm.send(&cur, (r + 1) % n, TAG_KV);
            }
            for (q, k) in self.ring_blocks(s, gd.t, dims.window, dims.sinks) {
                let blk = Block { qkv, q, kv: &cur, kw, kc: 0, vc: kw / 2, k, starts };
                compute(|| flash_gqa_block_backward((dqkv, Some(&mut dcur)), dout, lse, &d, &blk, &gd, dropout));
            }
            // The gradient of the keys just used travels on with them (after the last step:
            // home, to the next rank, whose keys they are).
            self.comm.send(&dcur, (r + 1) % n, TAG_DKV);
            wait(|| self.comm.recv(&mut dnext, (r + n - 1) % n, TAG_DKV));
            std::mem::swap(&mut dcur, &mut dnext);
            if s + 1 < n {
                wait(|| self.comm.recv(&mut next, (r + n - 1) % n, TAG_KV));
                std::mem::swap(&mut cur, &mut next);
            }
        }
        unpack_kv_add(dqkv, &dcur, dims);
    }

    /// Ulysses: rank `c`'s query heads and kv heads.
    fn heads(&self, dims: &GqaDims, c: usize) -> (Range<usize>, Range<usize>) {
        let n = self.slice.count;
        let hq = dims.nh / n;
        let group = dims.nh / dims.nkv;
        let q = c * hq..(c + 1) * hq;
        let kv = q.start / group..(q.end - 1) / group + 1;
        (q, kv)
    }

    /// Ulysses: the column ranges of a local qkv row that rank `c` gets (its q, k and v heads).
    fn qkv_cols(&self, dims: &GqaDims, c: usize) -> Vec<Range<usize>> {
        let (q, kv) = self.heads(dims, c);
        let (hs, nh, nkv) = (dims.hs, dims.nh, dims.nkv);
        vec![q.start * hs..q.end * hs, (nh + kv.start) * hs..(nh + kv.end) * hs, (nh + nkv + kv.start) * hs..(nh + nkv + kv.end) * hs]
    }

    /// Ulysses: the columns of an attention output row (`[.., C]`) that are rank `c`'s heads.
    #[allow(clippy::single_range_in_vec_init)] // one column range (qkv_cols' has three), not 0..n's elements
    fn q_cols(&self, dims: &GqaDims, c: usize) -> Vec<Range<usize>> {
        let q = self.heads(dims, c).0;
        vec![q.start * dims.hs..q.end * dims.hs]
    }

    /// Ulysses: the head-split dims on this rank (the whole sequence, its heads; dropout masks
    /// by whole-model head).
    fn head_dims(&self, dims: &GqaDims) -> GqaDims {
        let n = self.slice.count;
        let (q, kv) = self.heads(dims, self.slice.index);
        let heads = if dims.heads == 0 { dims.nh } else { dims.heads };
        GqaDims { t: dims.t * n, nh: q.len(), nkv: kv.len(), head0: dims.head0 + q.start, heads, ..*dims }
    }

    /// Ulysses' first all-to-all: `x` (`[B, tl, w]`, this rank's positions) → `[B, T, wc]`
    /// (every position, the columns `cols(c)` of this rank `c`).
    fn seq_to_heads(&self, x: &[f32], b: usize, tl: usize, cols: &dyn Fn(usize) -> Vec<Range<usize>>) -> Vec<f32> {
        let n = self.slice.count;
        let w = x.len() / (b * tl);
        let wc: usize = cols(self.slice.index).iter().map(|r| r.len()).sum();
        let mut send = Vec::with_capacity(b * tl * wc * n);
        for c in 0..n {
            let rc = cols(c);
            for row in x.chunks(w) {
                for r in &rc {
                    send.extend_from_slice(&row[r.clone()]);
                }
            }
        }
        let mut recv = vec![0.0; send.len()];
        wait(|| self.comm.all_to_all(&send, &mut recv));
        self.place_rows(&recv, b, tl, wc)
    }

    /// Every rank's `[B, tl, w]` rows (`parts`, in rank order) placed at that rank's positions
    /// of the whole sequence: `[B, T, w]`.
    fn place_rows(&self, parts: &[f32], b: usize, tl: usize, w: usize) -> Vec<f32> {
        let t = tl * self.slice.count;
        let mut full = vec![0.0; b * t * w];
        for (src, chunk) in parts.chunks(b * tl * w).enumerate() {
            let pos = self.of(src).positions(t);
            for bi in 0..b {
                for (i, &p) in pos.iter().enumerate() {
                    full[(bi * t + p) * w..(bi * t + p + 1) * w].copy_from_slice(&chunk[(bi * tl + i) * w..(bi * tl + i + 1) * w]);
                }
            }
        }
        full
    }

    /// Ulysses' second all-to-all, [`CpComm::seq_to_heads`]'s inverse: `full` (`[B, T, wc]`,
    /// this rank's columns of every position) → this rank's positions, each rank `c`'s part
    /// added into columns `cols(c)` of `x` (`[B, tl, w]`), ranks in ascending order.
    fn heads_to_seq_add(&self, full: &[f32], x: &mut [f32], b: usize, tl: usize, cols: &dyn Fn(usize) -> Vec<Range<usize>>) {
        let n = self.slice.count;
        let t = tl * n;
        let wc = full.len() / (b * t);
        let w = x.len() / (b * tl);
        let mut send = Vec::with_capacity(full.len());
        for dst in 0..n {
            let pos = self.of(dst).positions(t);
            for bi in 0..b {
                for &p in &pos {
                    send.extend_from_slice(&full[(bi * t + p) * wc..(bi * t + p + 1) * wc]);
                }
            }
        }
        let mut recv = vec![0.0; send.len()];
        wait(|| self.comm.all_to_all(&send, &mut recv));
        for (c, chunk) in recv.chunks(b * tl * wc).enumerate() {
            let rc = cols(c);
            for (row, part) in x.chunks_mut(w).zip(chunk.chunks(wc)) {
                let mut at = 0;
                for r in &rc {
                    row[r.clone()].iter_mut().zip(&part[at..at + r.len()]).for_each(|(a, b)| *a += b);
                    at += r.len();
                }
            }
        }
    }

    /// Ulysses: every position's document start (the parts' `starts` gathered), `[B, T]`.
    fn all_starts(&self, starts: &[u32], b: usize, tl: usize) -> Vec<u32> {
        let n = self.slice.count;
        let t = tl * n;
        assert!(t < 1 << 24, "document starts travel as exact f32 values");
        let mine: Vec<f32> = starts.iter().map(|&s| s as f32).collect();
        let mut all = vec![0.0; mine.len() * n];
        self.comm.all_gather(&mine, &mut all);
        self.place_rows(&all, b, tl, 1).into_iter().map(|s| s as u32).collect()
    }

    /// Ulysses' forward, `attend` the whole-sequence kernel over this rank's heads.
    fn ulysses_forward(&mut self, out: &mut [f32], lse: &mut [f32], qkv: &[f32], dims: &GqaDims, starts: &[u32], attend: &mut dyn FnMut(HeadsForward)) {
        let (b, tl, hs) = (dims.b, dims.t, dims.hs);
        let hd = self.head_dims(dims);
        let qkv_h = self.seq_to_heads(qkv, b, tl, &|c| self.qkv_cols(dims, c));
        let starts_h = if starts.is_empty() { Vec::new() } else { self.all_starts(starts, b, tl) };
        let mut out_h = vec![0.0; b * hd.t * hd.nh * hs];
        add_times(|x| x.pairs += visible_pairs(&hd, tensor::flash::Span::whole(hd.t), tensor::flash::Span::whole(hd.t), &starts_h));
        compute(|| attend(HeadsForward { out: &mut out_h, lse, qkv: &qkv_h, dims: hd, starts: &starts_h }));
        drop((qkv_h, starts_h));
        out.fill(0.0);
        self.heads_to_seq_add(&out_h, out, b, tl, &|c| self.q_cols(dims, c));
    }

    /// Ulysses' backward, `attend` the whole-sequence kernel's backward over this rank's heads.
    fn ulysses_backward(&mut self, dqkv: &mut [f32], dout: &[f32], saved: (&[f32], &[f32], &[f32]), dims: &GqaDims, starts: &[u32], attend: &mut dyn FnMut(HeadsBackward)) {
        let (qkv, out, lse) = saved;
        let (b, tl, nh) = (dims.b, dims.t, dims.nh);
        let hd = self.head_dims(dims);
        let qkv_h = self.seq_to_heads(qkv, b, tl, &|c| self.qkv_cols(dims, c));
        let dout_h = self.seq_to_heads(dout, b, tl, &|c| self.q_cols(dims, c));
        // D per local position and head ([B, tl, NH]), then to the head split ([B, T, hq]) and
        // the kernel's [B, hq, T].
        let mut d = vec![0.0; b * nh * tl];
        flash_d(&mut d, dout, out, dims, tl);
        let mut d_rows = vec![0.0; b * tl * nh];
        for bi in 0..b {
            for h in 0..nh {
                for i in 0..tl {
                    d_rows[(bi * tl + i) * nh + h] = d[(bi * nh + h) * tl + i];
                }
            }
        }
        let d_h_rows = self.seq_to_heads(&d_rows, b, tl, &|c| vec![self.heads(dims, c).0]);
        let (t, hq) = (hd.t, hd.nh);
        let mut d_h = vec![0.0; b * hq * t];
        for bi in 0..b {
            for h in 0..hq {
                for i in 0..t {
                    d_h[(bi * hq + h) * t + i] = d_h_rows[(bi * t + i) * hq + h];
                }
            }
        }
        drop((d, d_rows, d_h_rows));
        let starts_h = if starts.is_empty() { Vec::new() } else { self.all_starts(starts, b, tl) };
        let mut dqkv_h = vec![0.0; qkv_h.len()];
        compute(|| attend(HeadsBackward { dqkv: &mut dqkv_h, dout: &dout_h, qkv: &qkv_h, lse, d: &d_h, dims: hd, starts: &starts_h }));
        // Only the gradient travels back: the rest is freed first (the plan counts the peak).
        drop((qkv_h, dout_h, d_h, starts_h));
        self.heads_to_seq_add(&dqkv_h, dqkv, b, tl, &|c| self.qkv_cols(dims, c));
    }
}

/// The (query, key) pairs of block `q` × `k` that the causal, window, sink and document masks
/// leave visible, summed over the batch rows, times the heads (`dims`'; forward work).
fn visible_pairs(dims: &GqaDims, q: Span, k: Span, starts: &[u32]) -> u64 {
    let mut n = 0u64;
    for bi in 0..dims.b {
        for i in 0..q.len {
            let gi = q.pos0 + i;
            let start = if starts.is_empty() { 0 } else { starts[bi * q.rows + q.row0 + i] as usize };
            let first = dims.first_key(gi).max(start);
            let sink_end = dims.sink_end(gi, start);
            let count = |lo: usize, hi: usize| (hi.min(k.pos0 + k.len)).saturating_sub(lo.max(k.pos0)) as u64;
            n += count(first, gi + 1) + count(start, sink_end);
        }
    }
    n * dims.nh as u64
}

impl CpHooks for CpComm {
    fn sum_over_parts(&mut self, x: &mut [f64]) {
        let (all, n) = (crate::comm::all_gather_f64(&*self.comm, x), x.len());
        for (i, v) in x.iter_mut().enumerate() {
            *v = (0..self.comm.size()).map(|r| all[r * n + i]).sum();
        }
    }

    fn attention_forward(&mut self, out: &mut [f32], state: &mut [f32], qkv: &[f32], dims: &GqaDims, starts: &[u32], dropout: AttnDropout) {
        let _p = tensor::profile::scope("cp attention forward");
        match self.mode {
            CpMode::Ring => self.ring_forward(out, state, qkv, dims, starts, dropout),
            CpMode::Ulysses => self.ulysses_forward(out, state, qkv, dims, starts, &mut |h| flash_gqa_forward_docs(h.out, h.lse, h.qkv, &h.dims, h.starts, dropout)),
        }
    }

    fn attention_backward(&mut self, dqkv: &mut [f32], dout: &[f32], saved: (&[f32], &[f32], &[f32]), dims: &GqaDims, starts: &[u32], dropout: AttnDropout) {
        let _p = tensor::profile::scope("cp attention backward");
        match self.mode {
            CpMode::Ring => self.ring_backward(dqkv, dout, saved, dims, starts, dropout),
            CpMode::Ulysses => self.ulysses_backward(dqkv, dout, saved, dims, starts, &mut |h| {
                flash_gqa_block_backward((h.dqkv, None), h.dout, h.lse, h.d, &Block::whole(h.qkv, &h.dims, h.starts), &h.dims, dropout)
            }),
        }
    }

    fn is_ring(&self) -> bool {
        self.mode == CpMode::Ring
    }

    fn heads_forward(&mut self, out: &mut [f32], state: &mut [f32], qkv: &[f32], dims: &GqaDims, starts: &[u32], attend: &mut dyn FnMut(HeadsForward)) {
        assert_eq!(self.mode, CpMode::Ulysses, "a ring's blocks are the caller's");
        self.ulysses_forward(out, state, qkv, dims, starts, attend);
    }

    fn heads_backward(&mut self, dqkv: &mut [f32], dout: &[f32], saved: (&[f32], &[f32], &[f32]), dims: &GqaDims, starts: &[u32], attend: &mut dyn FnMut(HeadsBackward)) {
        assert_eq!(self.mode, CpMode::Ulysses, "a ring's blocks are the caller's");
        self.ulysses_backward(dqkv, dout, saved, dims, starts, attend);
    }

    fn send_next(&mut self, x: &[f32], backward: bool) {
        let (r, n) = (self.slice.index, self.slice.count);
        self.comm.send(x, (r + 1) % n, if backward { TAG_DKV } else { TAG_KV });
    }

    fn recv_prev(&mut self, x: &mut [f32], backward: bool) {
        let (r, n) = (self.slice.index, self.slice.count);
        wait(|| self.comm.recv(x, (r + n - 1) % n, if backward { TAG_DKV } else { TAG_KV }));
    }
}

/// Why `cp`-way context parallelism cannot split this shape, or `None`: the sequence into `cp`
/// (zig-zag: `2·cp`) equal chunks; for Ulysses the (tensor-parallel shard's) query heads into
/// `cp` equal parts, with kv heads that split evenly or that whole groups of parts share.
pub fn check(seq_len: usize, n_head: usize, n_kv_head: usize, cp: usize, mode: CpMode, zigzag: bool) -> Option<String> {
    if cp <= 1 {
        return None;
    }
    let chunks = if zigzag { 2 * cp } else { cp };
    if !seq_len.is_multiple_of(chunks) {
        let how = if zigzag { format!("2 × parallel.cp = {chunks} zig-zag chunks") } else { format!("parallel.cp = {cp} chunks") };
        return Some(format!("train.seq_len = {seq_len} does not split into {how}"));
    }
    if mode == CpMode::Ulysses {
        if !n_head.is_multiple_of(cp) {
            return Some(format!("parallel.cp_mode = ulysses needs the attention heads of each tensor-parallel rank ({n_head}) divisible by parallel.cp = {cp}"));
        }
        if !(n_kv_head.is_multiple_of(cp) || cp.is_multiple_of(n_kv_head)) {
            return Some(format!("parallel.cp_mode = ulysses needs the key/value heads of each tensor-parallel rank ({n_kv_head}) to divide or be divisible by parallel.cp = {cp}"));
        }
    }
    None
}

/// The most floats [`CpComm`] holds at once during a layer's attention (forward or backward),
/// for a part with `nh` query and `nkv` key/value heads of `hs`, `rows` sequences of `tl`
/// positions each, on `cp` ranks (`docs`: packed documents' starts travel too). Ring: the held
/// and the arriving key/value block and, in backward, their gradients, and `D`. Ulysses: an
/// all-to-all's send, receive and reassembled buffers of q|k|v (`Q`, the largest exchanged).
pub fn exchange_floats((nh, nkv, hs): (usize, usize, usize), rows: usize, tl: usize, cp: usize, mode: CpMode, docs: bool) -> usize {
    if cp <= 1 {
        return 0;
    }
    let d = rows * nh * tl;
    match mode {
        CpMode::Ring => 4 * rows * tl * 2 * nkv * hs + d,
        CpMode::Ulysses => {
            let (hq, group) = (nh / cp, nh / nkv);
            let hkv = (hq - 1) / group + 1;
            let q = rows * tl * cp * (hq + 2 * hkv) * hs;
            let o = rows * tl * cp * hq * hs;
            let starts = if docs { 3 * rows * tl * cp } else { 0 };
            (3 * q).max(2 * q + o + d / cp + starts).max(q + 3 * o)
        }
    }
}
