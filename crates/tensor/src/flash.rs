//! FlashAttention-2-style causal self-attention (Dao 2023, "FlashAttention-2: Faster Attention
//! with Better Parallelism and Work Partitioning", Algorithms 1 and 2), fp32 on the CPU, with
//! grouped-query attention (GQA, Ainslie et al. 2023): over the fused LLaMA layout
//! `qkv[B, T, W]`, `W = (NH + 2·NKV)·HS`, each token's row `[q: NH·HS | k: NKV·HS | v: NKV·HS]`
//! (see [`crate::llama`]), query head `h` reading kv head `h / (NH/NKV)`. Multi-head attention
//! over `[B, T, 3C]` (the layout of [`crate::attention`]) is the case `NKV == NH`: the same
//! layout, the same code path, so [`flash_attention_forward`] / [`flash_attention_backward`]
//! are thin wrappers.
//!
//! No `T×T` matrix exists anywhere: forward walks key tiles with an online softmax and saves
//! only the per-row log-sum-exp `lse[B, NH, T]`; backward recomputes each score tile from
//! `q`, `k` and `lse`. Tiles entirely above the causal diagonal are skipped, only tiles that
//! cross it are masked; under a sliding window (`GqaDims::window`, Mistral) so are the tiles
//! wholly before it, and the rows' first valid key moves up, with no `T×T` mask either. Every tile product runs through gemm single-threaded inside a rayon
//! task, so the pool never oversubscribes.
//!
//! Packed documents (the `_docs` entry points): a row of `T` tokens may hold several documents
//! back to back, given per token as `start[b·T + i]`, the index within row `b` of the first
//! token of token `i`'s document (non-decreasing within a row, `start[i] ≤ i`). Query `i` then
//! attends keys `max(first_key(i), start[i]) ..= i` (`first_key` the sliding window's). Since the
//! first key is non-decreasing in `i`, a tile's first row bounds all of its rows: key tiles
//! wholly before it are skipped in forward (and query tiles wholly past a key tile's document in
//! backward), only crossing tiles are masked, row by row, with no `T×T` mask. No documents
//! (an empty `start`) is exactly the kernel without them, bit for bit. Scratch is a few `TILE_Q × TILE_K` blocks per task;
//! the buffers that grow with `T` are backward's `D[B, NH, T]` and, only for the GQA schedule
//! [`Schedule::PerQueryHead`], per-query-head partial `dk`, `dv` (`2·B·NH·T·HS`, twice `out`).
//!
//! Attention-probability dropout ([`AttnDropout`]) uses exactly the reference kernel's
//! counter-based mask, indexed by the *query* head: element `(b·NH + h, i, j)` is kept iff
//! `dropout_keep(seed, ((b·NH + h)·T + i)·T + j, p)` (NH and h the whole model's under tensor parallelism: [`GqaDims::mask_bh`]), scaled by `1/(1-p)`, so this kernel and
//! [`crate::attention`] agree with dropout on.
//!
//! Determinism: every output element is produced in one task, with contributions added in a
//! fixed order that depends on neither the thread count nor the backward schedule: ascending
//! key tile for `out` and `dq`; for the `dk`, `dv` of a kv head, the group's query heads in
//! ascending order and, within each, ascending query tile.

use crate::attention::{AttnDims, AttnDropout};
use crate::llama::GqaDims;
use crate::matmul::{gemm_raw, Threads, View};
use crate::ops::dropout_keep;
use crate::par::{pooled, PoolBuf, SyncPtr};
use crate::simd::exp;
use rayon::prelude::*;

/// Query rows per tile (chosen by measurement, see `benches/flash.rs`).
pub const TILE_Q: usize = 64;
/// Key columns per tile.
pub const TILE_K: usize = 64;

/// Tile sizes, for benchmarks and tests; the public kernels use [`TILE_Q`] × [`TILE_K`].
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiles {
    pub br: usize,
    pub bc: usize,
}

impl Default for Tiles {
    fn default() -> Tiles {
        Tiles { br: TILE_Q, bc: TILE_K }
    }
}

/// How backward is split into tasks. All schedules give bit-identical results.
///
/// With GQA (`NH > NKV`) each kv head's `dk`, `dv` is the sum over its group's query heads of
/// per-(head, key tile) partials, each accumulated from zero over ascending query tiles, added
/// in ascending head order; every schedule forms exactly these partials with the same tile
/// products, so they agree bit for bit. With `NKV == NH` there is one head per group and the
/// products accumulate straight into `dqkv`, as the MHA kernel always did.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Schedule {
    /// The schedule with the least estimated time for this shape and pool size: `PerHead` when
    /// the (batch, kv head) tasks fill the pool evenly, else (GQA) `PerQueryHead` or `TwoPass`.
    #[default]
    Auto,
    /// One task per (batch, kv head): key tiles outer, then the group's query heads, then query
    /// tiles; `dq`, `dk` and `dv` all accumulated in that task. Least work (every score tile is
    /// computed once), and a k/v tile is reused by all heads of its group.
    PerHead,
    /// FA-2's split: one task per (batch, kv head, key tile) for `dk`, `dv`, then one per
    /// (batch, query head, query tile) for `dq`, recomputing the tiles. More tasks, more work.
    TwoPass,
    /// GQA only (the same as `PerHead` when `NKV == NH`): one task per (batch, query head)
    /// writing its `dq` and its partial `dk`, `dv` into a `[B, NH, T, HS]` scratch pair, then a
    /// pass adding each kv head's partials in ascending head order. `NH/NKV` times the tasks
    /// of `PerHead` for little more work: for B·NKV smaller than the pool.
    PerQueryHead,
}

/// How [`flash_attention_backward_with`] / [`flash_gqa_backward_with`] run: the public
/// backward's dropout, plus the tile sizes (the forward's) and the schedule. The public kernels
/// use `BwdOpts { dropout, ..BwdOpts::default() }`.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BwdOpts {
    pub dropout: AttnDropout,
    pub tiles: Tiles,
    pub schedule: Schedule,
}

/// Causal multi-head attention, FlashAttention-2 forward:
/// `out[b,t,h·HS..] = Σ_j dropout(softmax_j(q·kᵀ/√HS))·v_j` and
/// `lse[b,h,t] = ln Σ_{j≤t} exp(q_t·k_j/√HS)`. Overwrites `out` and `lse`.
/// [`flash_gqa_forward`] with `NKV == NH` (bit for bit the same).
pub fn flash_attention_forward(
    out: &mut [f32],   // [B, T, C]
    lse: &mut [f32],   // [B, NH, T]  log-sum-exp of each row's scaled scores
    qkv: &[f32],       // [B, T, 3C]  q, k, v; head h at columns h·HS..
    dims: &AttnDims,
    dropout: AttnDropout,
) {
    flash_attention_forward_tiled(out, lse, qkv, dims, dropout, Tiles::default());
}

/// [`flash_attention_forward`] over packed documents: query `i` of row `b` attends keys
/// `start[b·T + i] ..= i` only, so `lse[b,h,i] = ln Σ_{start[i] ≤ j ≤ i} exp(q_i·k_j/√HS)`.
/// An empty `starts` is [`flash_attention_forward`]. Overwrites `out` and `lse`.
pub fn flash_attention_forward_docs(
    out: &mut [f32],   // [B, T, C]
    lse: &mut [f32],   // [B, NH, T]
    qkv: &[f32],       // [B, T, 3C]
    dims: &AttnDims,
    starts: &[u32],    // [B, T] or empty: each token's document start within its row
    dropout: AttnDropout,
) {
    flash_attention_forward_docs_tiled(out, lse, qkv, dims, starts, dropout, Tiles::default());
}

/// Backward of [`flash_attention_forward`], FlashAttention-2 style. Accumulates into `dqkv`.
/// `out` and `lse` are the forward's outputs. [`flash_gqa_backward`] with `NKV == NH`.
pub fn flash_attention_backward(
    dqkv: &mut [f32],  // [B, T, 3C]
    dout: &[f32],      // [B, T, C]
    qkv: &[f32],       // [B, T, 3C]
    out: &[f32],       // [B, T, C]
    lse: &[f32],       // [B, NH, T]
    dims: &AttnDims,
    dropout: AttnDropout,
) {
    flash_attention_backward_with(dqkv, dout, qkv, out, lse, dims, BwdOpts { dropout, ..BwdOpts::default() });
}

/// Backward of [`flash_attention_forward_docs`] (the same `starts`). Accumulates into `dqkv`.
// Eight arguments: the backward's seven plus the document layout, kept flat like the others.
pub fn flash_attention_backward_docs(
    dqkv: &mut [f32],  // [B, T, 3C]
    dout: &[f32],      // [B, T, C]
    saved: (&[f32], &[f32], &[f32]), // the forward's qkv [B, T, 3C], out [B, T, C], lse [B, NH, T]
    dims: &AttnDims,
    starts: &[u32],    // [B, T] or empty
    dropout: AttnDropout,
) {
    flash_attention_backward_docs_with(dqkv, dout, saved, dims, starts, BwdOpts { dropout, ..BwdOpts::default() });
}

/// Causal grouped-query attention, FlashAttention-2 forward: for query head `h` and its kv head
/// `g = h / (NH/NKV)`, `out[b,t,h·HS..] = Σ_j dropout(softmax_j(q_h·k_gᵀ/√HS))·v_g,j` and
/// `lse[b,h,t] = ln Σ_{j≤t} exp(q_h,t·k_g,j/√HS)`. Overwrites `out` and `lse`.
pub fn flash_gqa_forward(
    out: &mut [f32],   // [B, T, C]   C = NH·HS
    lse: &mut [f32],   // [B, NH, T]  log-sum-exp of each row's scaled scores
    qkv: &[f32],       // [B, T, W]   W = (NH + 2·NKV)·HS: [q heads | k heads | v heads]
    dims: &GqaDims,
    dropout: AttnDropout,
) {
    flash_gqa_forward_tiled(out, lse, qkv, dims, dropout, Tiles::default());
}

/// [`flash_gqa_forward`] over packed documents: query `i` of row `b` attends keys
/// `max(first_key(i), start[b·T + i]) ..= i` (`first_key` of the sliding window, 0 without),
/// and `lse` sums over those keys. An empty `starts` is [`flash_gqa_forward`]. Overwrites `out`
/// and `lse`.
pub fn flash_gqa_forward_docs(
    out: &mut [f32],   // [B, T, C]
    lse: &mut [f32],   // [B, NH, T]
    qkv: &[f32],       // [B, T, W]
    dims: &GqaDims,
    starts: &[u32],    // [B, T] or empty: each token's document start within its row
    dropout: AttnDropout,
) {
    flash_gqa_forward_docs_tiled(out, lse, qkv, dims, starts, dropout, Tiles::default());
}

/// Backward of [`flash_gqa_forward`]. Accumulates into `dqkv`; `out` and `lse` are the
/// forward's outputs. A kv head's `dk`, `dv` sum over its group's query heads in ascending
/// order, whatever the thread count.
pub fn flash_gqa_backward(
    dqkv: &mut [f32],  // [B, T, W]
    dout: &[f32],      // [B, T, C]
    qkv: &[f32],       // [B, T, W]
    out: &[f32],       // [B, T, C]
    lse: &[f32],       // [B, NH, T]
    dims: &GqaDims,
    dropout: AttnDropout,
) {
    flash_gqa_backward_with(dqkv, dout, qkv, out, lse, dims, BwdOpts { dropout, ..BwdOpts::default() });
}

/// Backward of [`flash_gqa_forward_docs`] (the same `starts`). Accumulates into `dqkv`, in the
/// order [`flash_gqa_backward`] does.
pub fn flash_gqa_backward_docs(
    dqkv: &mut [f32],  // [B, T, W]
    dout: &[f32],      // [B, T, C]
    saved: (&[f32], &[f32], &[f32]), // the forward's qkv [B, T, W], out [B, T, C], lse [B, NH, T]
    dims: &GqaDims,
    starts: &[u32],    // [B, T] or empty
    dropout: AttnDropout,
) {
    flash_gqa_backward_docs_with(dqkv, dout, saved, dims, starts, BwdOpts { dropout, ..BwdOpts::default() });
}

fn check_dims(dims: &GqaDims, tiles: Tiles, dropout: f32) {
    assert!(dims.nh > 0 && dims.nkv > 0 && dims.nh.is_multiple_of(dims.nkv), "NH must be a multiple of NKV");
    assert!(tiles.br > 0 && tiles.bc > 0, "tile sizes must be positive");
    assert!((0.0..1.0).contains(&dropout), "dropout p must be in [0, 1)");
}

/// Document starts are empty, or `[B, T]` with `start[i] ≤ i` and non-decreasing along each
/// row (the tile skipping relies on it).
pub(crate) fn check_starts(starts: &[u32], b: usize, t: usize) {
    if starts.is_empty() {
        return;
    }
    assert_eq!(starts.len(), b * t, "document starts must be [B, T] (or empty)");
    for (bi, row) in starts.chunks(t).enumerate() {
        let mut prev = 0;
        for (i, &s) in row.iter().enumerate() {
            assert!(s as usize <= i && s >= prev, "document start {s} of token {i} in row {bi}: starts must satisfy start[i] <= i and be non-decreasing along a row");
            prev = s;
        }
    }
}

/// One side of a [`Block`] of attention: in a buffer of `rows` rows per batch row, rows
/// `row0 .. row0 + len`, which hold the sequence's positions `pos0 .. pos0 + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub rows: usize,
    pub row0: usize,
    pub len: usize,
    pub pos0: usize,
}

impl Span {
    /// All `t` rows of a buffer, holding positions `0..t`.
    pub fn whole(t: usize) -> Span {
        Span { rows: t, row0: 0, len: t, pos0: 0 }
    }

    /// The buffer row of this side's row `i` in batch row `bi`.
    #[inline]
    fn row(&self, bi: usize, i: usize) -> usize {
        bi * self.rows + self.row0 + i
    }
}

/// The k|v columns of every row of `qkv` (`[B, t, W]`): `[B, t, 2·NKV·HS]`, the keys and
/// values a context-parallel ring passes around ([`Block`]'s `kv` with `kc = 0`,
/// `vc = NKV·HS`).
pub fn pack_kv(qkv: &[f32], dims: &GqaDims) -> Vec<f32> {
    let (w, k0) = (dims.qkv_width(), dims.nh * dims.hs);
    qkv.chunks(w).flat_map(|row| row[k0..].iter().copied()).collect()
}

/// `dqkv`'s k|v columns `+= dkv` (`[B, t, 2·NKV·HS]`, [`pack_kv`]'s layout).
pub fn unpack_kv_add(dqkv: &mut [f32], dkv: &[f32], dims: &GqaDims) {
    let (w, k0) = (dims.qkv_width(), dims.nh * dims.hs);
    let kw = w - k0;
    for (row, g) in dqkv.chunks_mut(w).zip(dkv.chunks(kw)) {
        row[k0..].iter_mut().zip(g).for_each(|(a, b)| *a += b);
    }
}

/// A block of causal attention, for context parallelism: the queries of `q` (rows of a
/// `[B, q.rows, W]` qkv buffer, `W = (NH + 2·NKV)·HS`, query head `h` at columns `h·HS`) against
/// the keys and values of `k` (rows of `kv`, `[B, k.rows, kw]`, kv head `g`'s key at columns
/// `kc + g·HS` and its value at `vc + g·HS`), masked by *global* position: causal, the sliding
/// window, and the documents (`starts`, `[B, q.rows]`: each query's document start as a global
/// position; empty for none). The whole sequence is `dims.t` positions long (dropout masks are
/// indexed in it). [`Block::whole`] is the whole sequence against itself: the kernel of
/// [`flash_gqa_forward_docs`] and [`flash_gqa_backward_docs`].
#[derive(Clone, Copy)]
pub struct Block<'a> {
    pub qkv: &'a [f32],
    pub q: Span,
    pub kv: &'a [f32],
    pub kw: usize,
    pub kc: usize,
    pub vc: usize,
    pub k: Span,
    pub starts: &'a [u32],
}

impl<'a> Block<'a> {
    /// Every query of `qkv` (`[B, T, W]`) against every key of the same buffer.
    pub fn whole(qkv: &'a [f32], dims: &GqaDims, starts: &'a [u32]) -> Block<'a> {
        let (t, hs, nh, nkv) = (dims.t, dims.hs, dims.nh, dims.nkv);
        Block { qkv, q: Span::whole(t), kv: qkv, kw: (nh + 2 * nkv) * hs, kc: nh * hs, vc: (nh + nkv) * hs, k: Span::whole(t), starts }
    }

    /// Panics unless the buffers hold the spans, the spans fit the sequence and `starts` is
    /// empty or a valid global layout of the query rows (`start ≤ position`, non-decreasing).
    fn check(&self, dims: &GqaDims) {
        let (q, k) = (self.q, self.k);
        assert!(q.row0 + q.len <= q.rows && k.row0 + k.len <= k.rows, "block spans exceed their buffers");
        assert!(q.pos0 + q.len <= dims.t && k.pos0 + k.len <= dims.t, "block spans exceed the sequence of {}", dims.t);
        assert_eq!(self.qkv.len(), dims.b * q.rows * dims.qkv_width(), "q buffer must be [B, q.rows, W]");
        assert_eq!(self.kv.len(), dims.b * k.rows * self.kw, "kv buffer must be [B, k.rows, kw]");
        assert!(self.kc + dims.nkv * dims.hs <= self.kw && self.vc + dims.nkv * dims.hs <= self.kw, "k and v columns exceed the kv rows");
        if self.starts.is_empty() {
            return;
        }
        assert_eq!(self.starts.len(), dims.b * q.rows, "document starts must be [B, q.rows] (or empty)");
        for bi in 0..dims.b {
            let mut prev = 0;
            for i in 0..q.len {
                let (s, gi) = (self.starts[q.row(bi, i)], q.pos0 + i);
                assert!(s as usize <= gi && s >= prev, "document start {s} of position {gi} in row {bi}: starts must satisfy start[i] <= i and be non-decreasing along a row");
                prev = s;
            }
        }
    }
}

/// What a query row may see beyond causality: the keys of a sliding window (`window`, 0 = all)
/// and of its own document (`starts`: the batch row's query starts, empty = one document; the
/// query at global position `gi` is entry `gi − pos0 + row0`).
#[derive(Clone, Copy)]
struct Mask<'a> {
    window: usize,
    sinks: usize,
    starts: &'a [u32],
    pos0: usize,
    row0: usize,
}

impl<'a> Mask<'a> {
    /// Batch row `bi`'s mask in block `blk`.
    fn of(dims: &GqaDims, blk: &Block<'a>, bi: usize) -> Mask<'a> {
        let q = blk.q;
        let starts = if blk.starts.is_empty() { &[][..] } else { &blk.starts[bi * q.rows..(bi + 1) * q.rows] };
        Mask { window: dims.window, sinks: if dims.window > 0 { dims.sinks } else { 0 }, starts, pos0: q.pos0, row0: q.row0 }
    }

    /// The first key of the document of the query at `gi` (0 without documents).
    #[inline]
    fn start(self, gi: usize) -> usize {
        if self.starts.is_empty() { 0 } else { self.starts[gi - self.pos0 + self.row0] as usize }
    }

    /// The end of the query's sink keys, `start .. sink_end` (empty without sinks; never past
    /// [`Mask::first`]); non-decreasing in `gi` within a document.
    #[inline]
    fn sink_end(self, gi: usize) -> usize {
        let s = self.start(gi);
        if self.sinks == 0 { s } else { (s + self.sinks).min(self.first(gi)) }
    }

    /// Whether a tile of queries `gi0 .. gi0 + rows` and keys `jg0 .. jg0 + ncols` may hold a
    /// visible score (with sinks, the tiles between a document's sinks and a window are not).
    #[inline]
    fn tile_visible(self, gi0: usize, rows: usize, jg0: usize, ncols: usize) -> bool {
        let last = gi0 + rows - 1;
        let window = self.first(gi0) < jg0 + ncols && jg0 <= last;
        window || (self.start(gi0) < jg0 + ncols && self.sink_end(last) > jg0)
    }

    /// The first key tile (in keys from `k0`, tiles of `bc`) a query tile starting at `gi0`
    /// visits: its first row's window's, or with sinks its document's first.
    #[inline]
    fn first_tile(self, gi0: usize, k0: usize, bc: usize) -> usize {
        let first = if self.sinks > 0 { self.start(gi0) } else { self.first(gi0) };
        first.saturating_sub(k0) / bc * bc
    }

    /// The first key the query at global position `gi` attends: `max(gi + 1 − window, start)`,
    /// non-decreasing in `gi`.
    #[inline]
    fn first(self, gi: usize) -> usize {
        let w = if self.window == 0 { 0 } else { (gi + 1).saturating_sub(self.window) };
        if self.starts.is_empty() {
            return w;
        }
        w.max(self.starts[gi - self.pos0 + self.row0] as usize)
    }
}

/// Number of valid (causal) key columns of query row `gi` in a key tile starting at `j0`.
#[inline]
fn valid_cols(gi: usize, j0: usize, ncols: usize) -> usize {
    if gi >= j0 { (gi - j0 + 1).min(ncols) } else { 0 }
}

/// The valid key columns `lo..hi` of query row `gi` in a key tile starting at `j0`: causal, and
/// not before the row's first key ([`Mask::first`]: its sliding window's and its document's).
#[inline]
fn valid_range(gi: usize, j0: usize, ncols: usize, mask: Mask) -> (usize, usize) {
    let hi = valid_cols(gi, j0, ncols);
    (mask.first(gi).saturating_sub(j0).min(hi), hi)
}

/// The valid key columns of query row `gi` in a key tile starting at `j0`, as two ranges in
/// order: its sink keys' (empty without sinks), then [`valid_range`]'s.
#[inline]
fn segments(gi: usize, j0: usize, ncols: usize, mask: Mask) -> [(usize, usize); 2] {
    let (lo, hi) = valid_range(gi, j0, ncols, mask);
    if mask.sinks == 0 {
        return [(lo, lo), (lo, hi)];
    }
    let clamp = |x: usize| x.saturating_sub(j0).min(lo);
    [(clamp(mask.start(gi)), clamp(mask.sink_end(gi))), (lo, hi)]
}

/// Writes `mk[jj] = keep ? 1/(1-p) : 0` for the first `n` columns of a score row whose first
/// column is mask element `base` ([`mask_base`]).
/// Pure integer hashing, so the vector versions give the same mask bit for bit. (Dispatched by
/// hand, not `multiversion!`: the hash's 64-bit lane multiplies need AVX-512 DQ.)
fn dropout_row(mk: &mut [f32], base: u64, n: usize, p: f32, seed: u64) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512dq") {
            // Safety: the CPU supports AVX-512 F and DQ (64-bit lane multiplies).
            return unsafe { dropout_row_avx512(mk, base, n, p, seed) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // Safety: the CPU supports AVX2.
            return unsafe { dropout_row_avx2(mk, base, n, p, seed) };
        }
    }
    dropout_row_body(mk, base, n, p, seed)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn dropout_row_avx512(mk: &mut [f32], base: u64, n: usize, p: f32, seed: u64) {
    dropout_row_body(mk, base, n, p, seed)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dropout_row_avx2(mk: &mut [f32], base: u64, n: usize, p: f32, seed: u64) {
    dropout_row_body(mk, base, n, p, seed)
}

/// The mask row of score row `gi`, key columns `j0 .. j0 + n`, of mask head `bh`: element
/// `base + jj`, `base = (bh·T + gi)·T + j0` (see [`mask_base`]).
#[inline(always)]
fn dropout_row_body(mk: &mut [f32], base: u64, n: usize, p: f32, seed: u64) {
    let sc = 1.0 / (1.0 - p);
    for (jj, m) in mk[..n].iter_mut().enumerate() {
        *m = if dropout_keep(seed, base + jj as u64, p) { sc } else { 0.0 };
    }
}

/// The mask index of score `(gi, j0)` of mask head `bh` in a length-`t` attention.
fn mask_base(bh: usize, t: usize, gi: usize, j0: usize) -> u64 {
    ((bh * t + gi) * t + j0) as u64
}

// ---------------------------------------------------------------------------------------------
// Forward

struct FwdScratch {
    s: PoolBuf,     // [br, bc]  scores, then (dropped) unnormalised probabilities
    o: PoolBuf,     // [br, HS]  unnormalised output accumulator
    m: PoolBuf,     // [br]      running row max
    l: PoolBuf,     // [br]      running row sum
    alpha: PoolBuf, // [br]      per-tile rescale factor
    mk: PoolBuf,    // [bc]      dropout keep-scale of one row
}

#[doc(hidden)]
pub fn flash_attention_forward_tiled(
    out: &mut [f32],   // [B, T, C]
    lse: &mut [f32],   // [B, NH, T]
    qkv: &[f32],       // [B, T, 3C]
    dims: &AttnDims,
    dropout: AttnDropout,
    tiles: Tiles,
) {
    flash_gqa_forward_docs_tiled(out, lse, qkv, &dims.as_gqa(), &[], dropout, tiles);
}

#[doc(hidden)]
pub fn flash_attention_forward_docs_tiled(
    out: &mut [f32],   // [B, T, C]
    lse: &mut [f32],   // [B, NH, T]
    qkv: &[f32],       // [B, T, 3C]
    dims: &AttnDims,
    starts: &[u32],    // [B, T] or empty
    dropout: AttnDropout,
    tiles: Tiles,
) {
    flash_gqa_forward_docs_tiled(out, lse, qkv, &dims.as_gqa(), starts, dropout, tiles);
}

#[doc(hidden)]
pub fn flash_gqa_forward_tiled(
    out: &mut [f32],   // [B, T, C]
    lse: &mut [f32],   // [B, NH, T]
    qkv: &[f32],       // [B, T, W]
    dims: &GqaDims,
    dropout: AttnDropout,
    tiles: Tiles,
) {
    flash_gqa_forward_docs_tiled(out, lse, qkv, dims, &[], dropout, tiles);
}

#[doc(hidden)]
pub fn flash_gqa_forward_docs_tiled(
    out: &mut [f32],   // [B, T, C]
    lse: &mut [f32],   // [B, NH, T]
    qkv: &[f32],       // [B, T, W]
    dims: &GqaDims,
    starts: &[u32],    // [B, T] or empty
    dropout: AttnDropout,
    tiles: Tiles,
) {
    check_starts(starts, dims.b, dims.t);
    flash_gqa_block_forward_tiled(out, lse, &Block::whole(qkv, dims, starts), dims, true, dropout, tiles);
}

/// FlashAttention-2 forward over one [`Block`]: `out` (`[B, q.rows, C]`) and `lse`
/// (`[B, NH, q.rows]`) at the query rows get the attention of those queries over the block's
/// keys. `fresh`: overwrite them; otherwise they hold the attention over other keys so far
/// (as a previous call left them) and the result is the attention over both — the online
/// softmax continues from `m = lse`, `l = 1`, `o = out`, which is log-sum-exp merging without a
/// second pass. A row that sees no key of the block is left as it was; in a fresh block every
/// row must see one (its own position, say). Other rows are untouched.
pub fn flash_gqa_block_forward(
    out: &mut [f32],   // [B, q.rows, C]
    lse: &mut [f32],   // [B, NH, q.rows]
    blk: &Block,
    dims: &GqaDims,
    fresh: bool,
    dropout: AttnDropout,
) {
    flash_gqa_block_forward_tiled(out, lse, blk, dims, fresh, dropout, Tiles::default());
}

#[doc(hidden)]
pub fn flash_gqa_block_forward_tiled(
    out: &mut [f32],
    lse: &mut [f32],
    blk: &Block,
    dims: &GqaDims,
    fresh: bool,
    dropout: AttnDropout,
    tiles: Tiles,
) {
    let _p = crate::profile::scope("flash_attention_forward");
    let AttnDropout { p: dropout, seed } = dropout;
    check_dims(dims, tiles, dropout);
    blk.check(dims);
    let GqaDims { b, t, nh, nkv, hs, .. } = *dims;
    let (c, w, group) = (nh * hs, (nh + 2 * nkv) * hs, nh / nkv);
    let (qs, ks, kw) = (blk.q, blk.k, blk.kw);
    assert_eq!(out.len(), b * qs.rows * c);
    assert_eq!(lse.len(), b * nh * qs.rows);
    let Tiles { br, bc } = tiles;
    let ntq = qs.len.div_ceil(br);
    let scale = dims.logit_scale();
    let outp = SyncPtr(out.as_mut_ptr());
    let lsep = SyncPtr(lse.as_mut_ptr());
    let init = || FwdScratch {
        s: pooled(br * bc),
        o: pooled(br * hs),
        m: pooled(br),
        l: pooled(br),
        alpha: pooled(br),
        mk: pooled(bc),
    };
    (0..b * nh * ntq).into_par_iter().for_each_init(init, |sc, task| {
        let (outp, lsep) = (outp, lsep);
        // Within each head, the longest query tiles (most key tiles) first.
        let (bh, it) = (task / ntq, ntq - 1 - task % ntq);
        let (bi, h) = (bh / nh, bh % nh);
        let g = h / group;
        let i0 = it * br;
        let rows = br.min(qs.len - i0);
        // Global positions from here on: the tile's first query, and its key columns'.
        let gi0 = qs.pos0 + i0;
        let q = View { data: blk.qkv, off: qs.row(bi, i0) * w + h * hs, rows, cols: hs, rs: w, cs: 1 };
        let FwdScratch { s, o, m, l, alpha, mk } = sc;
        let lrow = bh * qs.rows + qs.row0 + i0;
        // Safety (reads and writes below): task (bh, it) alone touches query rows i0..i0+rows
        // of batch bi, head h's columns of `out`, and their lse entries.
        let out_row = |r: usize| unsafe { std::slice::from_raw_parts_mut(outp.0.add(qs.row(bi, i0 + r) * c + h * hs), hs) };
        if fresh {
            o[..rows * hs].fill(0.0);
            m[..rows].fill(f32::NEG_INFINITY);
            l[..rows].fill(0.0);
        } else {
            for r in 0..rows {
                o[r * hs..(r + 1) * hs].copy_from_slice(out_row(r));
                m[r] = unsafe { *lsep.0.add(lrow + r) };
                l[r] = 1.0;
            }
        }
        // Key tiles wholly before the first row's sliding window or document are skipped, and
        // so are keys after the last row.
        let mask = Mask::of(dims, blk, bi);
        let end = (gi0 + rows).saturating_sub(ks.pos0).min(ks.len);
        let mut j0 = mask.first_tile(gi0, ks.pos0, bc);
        while j0 < end {
            // Key columns past the tile's last query row are all masked: trim them.
            let ncols = bc.min(end - j0);
            let jg0 = ks.pos0 + j0;
            if mask.sinks > 0 && !mask.tile_visible(gi0, rows, jg0, ncols) {
                j0 += bc;
                continue;
            }
            let k = View { data: blk.kv, off: ks.row(bi, j0) * kw + blk.kc + g * hs, rows: ncols, cols: hs, rs: kw, cs: 1 };
            let v = View { off: ks.row(bi, j0) * kw + blk.vc + g * hs, ..k };
            // S = q·kᵀ·scale   [rows, ncols], row stride bc (soft-capped)
            unsafe { gemm_raw((s.as_mut_ptr(), bc), false, q, k.t(), scale, Threads::One) };
            if dims.softcap > 0.0 {
                softcap_tile(s, (rows, ncols, bc), dims.softcap, None);
            }
            online_softmax_tile(s, bc, Tile { i0: gi0, rows, j0: jg0, ncols, mask }, m, l, alpha);
            for r in 0..rows {
                if alpha[r] != 1.0 {
                    let a = alpha[r];
                    o[r * hs..(r + 1) * hs].iter_mut().for_each(|x| *x *= a);
                }
            }
            if dropout > 0.0 {
                for r in 0..rows {
                    for (lo, hi) in segments(gi0 + r, jg0, ncols, mask) {
                        dropout_row(mk, mask_base(dims.mask_bh(bh), t, gi0 + r, jg0 + lo), hi - lo, dropout, seed);
                        mul_into(&mut s[r * bc + lo..r * bc + hi], &mk[..hi - lo]);
                    }
                }
            }
            let p = View { data: s, off: 0, rows, cols: ncols, rs: bc, cs: 1 };
            // o += P·v   [rows, HS]
            unsafe { gemm_raw((o.as_mut_ptr(), hs), true, p, v, 1.0, Threads::One) };
            j0 += bc;
        }
        for r in 0..rows {
            let inv = 1.0 / l[r];
            for (d, x) in out_row(r).iter_mut().zip(&o[r * hs..(r + 1) * hs]) {
                *d = x * inv;
            }
            unsafe { *lsep.0.add(lrow + r) = m[r] + l[r].ln() };
        }
    });
}


/// A score tile: query rows `i0 .. i0 + rows` against key columns `j0 .. j0 + ncols`, under
/// the row's sliding window and documents.
#[derive(Clone, Copy)]
struct Tile<'a> {
    i0: usize,
    rows: usize,
    j0: usize,
    ncols: usize,
    mask: Mask<'a>,
}

crate::multiversion! {
    /// One online-softmax step over a score tile `s` (row stride `bc`): for each row, new max,
    /// `s ← exp(s − m_new)` on the causal (windowed, own-document) part (0 elsewhere), `l ← l·α + Σ s` with
    /// `α = exp(m_old − m_new)`; `m`, `l`, `alpha` are the tile's rows' running max, running sum
    /// and rescale factor.
    fn online_softmax_tile(s: &mut [f32], bc: usize, tile: Tile<'_>, m: &mut [f32], l: &mut [f32], alpha: &mut [f32]) {
        let Tile { i0, rows, j0, ncols, mask } = tile;
        for r in 0..rows {
            let [(s0, s1), (lo, vr)] = segments(i0 + r, j0, ncols, mask);
            let row = &mut s[r * bc..r * bc + ncols];
            if vr == lo && s1 == s0 {
                row.fill(0.0);
                alpha[r] = 1.0;
                continue;
            }
            let m_new = m[r].max(row_max(&row[lo..vr])).max(row_max(&row[s0..s1]));
            let a = if m[r] == f32::NEG_INFINITY { 0.0 } else { (m[r] - m_new).exp() };
            let sum = exp_sub_sum(&mut row[s0..s1], m_new) + exp_sub_sum(&mut row[lo..vr], m_new);
            row[..s0].fill(0.0);
            row[s1..lo].fill(0.0);
            row[vr..].fill(0.0);
            l[r] = l[r] * a + sum;
            m[r] = m_new;
            alpha[r] = a;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Backward

struct BwdScratch {
    p: PoolBuf,  // [br, bc]  P = exp(S − lse), causal part
    pd: PoolBuf, // [br, bc]  dropped, rescaled P (only with dropout)
    ds: PoolBuf, // [br, bc]  dO·vᵀ, then dS = P ∘ (dP − D)
    mk: PoolBuf, // [bc]      dropout keep-scale of one row
    kp: PoolBuf, // [bc, HS]  one head's partial dk of a key tile (GQA only)
    vp: PoolBuf, // [bc, HS]  one head's partial dv of a key tile (GQA only)
    cap: PoolBuf, // [br, bc] the soft-cap's derivative 1 − tanh²(S / cap) (with soft-capping)
}

struct Ctx<'a> {
    dims: GqaDims,
    blk: Block<'a>,
    dout: &'a [f32],
    lse: &'a [f32],
    d: &'a [f32],
    /// Where `dq` (the q columns of a `[B, q.rows, W]` buffer) and `dk`, `dv` (the block's kv
    /// columns of a `[B, k.rows, kw]` buffer) accumulate: two buffers, or one for both.
    dq: SyncPtr,
    dkv: SyncPtr,
    t: usize,     // the whole sequence (dropout mask indices)
    c: usize,     // NH·HS, the row width of `out` / `dout`
    w: usize,     // (NH + 2·NKV)·HS, the row width of the q buffer
    nh: usize,
    nkv: usize,
    group: usize, // NH / NKV
    hs: usize,
    br: usize,
    bc: usize,
    scale: f32,
    dropout: f32,
    seed: u64,
}

impl<'a> Ctx<'a> {
    fn mask(&self, bi: usize) -> Mask<'a> {
        Mask::of(&self.dims, &self.blk, bi)
    }
    /// Offsets of query head `h`'s row `i` in the q buffer (and `dq`), of kv head `g`'s key
    /// and value row `j` in the kv buffer (and `dkv`), and of head `h`'s row `i` in `dout`.
    fn q_at(&self, bi: usize, i: usize, h: usize) -> usize {
        self.blk.q.row(bi, i) * self.w + h * self.hs
    }
    fn k_at(&self, bi: usize, j: usize, g: usize) -> usize {
        self.blk.k.row(bi, j) * self.blk.kw + self.blk.kc + g * self.hs
    }
    fn v_at(&self, bi: usize, j: usize, g: usize) -> usize {
        self.blk.k.row(bi, j) * self.blk.kw + self.blk.vc + g * self.hs
    }
    fn o_at(&self, bi: usize, i: usize, h: usize) -> usize {
        self.blk.q.row(bi, i) * self.c + h * self.hs
    }
    /// The key tile starting at kv-local `j0`: its columns.
    fn key_cols(&self, j0: usize) -> usize {
        self.bc.min(self.blk.k.len - j0)
    }
}

#[doc(hidden)]
pub fn flash_attention_backward_with(
    dqkv: &mut [f32],  // [B, T, 3C]
    dout: &[f32],      // [B, T, C]
    qkv: &[f32],       // [B, T, 3C]
    out: &[f32],       // [B, T, C]
    lse: &[f32],       // [B, NH, T]
    dims: &AttnDims,
    opts: BwdOpts,
) {
    flash_gqa_backward_docs_with(dqkv, dout, (qkv, out, lse), &dims.as_gqa(), &[], opts);
}

#[doc(hidden)]
pub fn flash_attention_backward_docs_with(
    dqkv: &mut [f32],  // [B, T, 3C]
    dout: &[f32],      // [B, T, C]
    saved: (&[f32], &[f32], &[f32]), // the forward's qkv [B, T, 3C], out [B, T, C], lse [B, NH, T]
    dims: &AttnDims,
    starts: &[u32],    // [B, T] or empty
    opts: BwdOpts,
) {
    flash_gqa_backward_docs_with(dqkv, dout, saved, &dims.as_gqa(), starts, opts);
}

#[doc(hidden)]
pub fn flash_gqa_backward_with(
    dqkv: &mut [f32],  // [B, T, W]
    dout: &[f32],      // [B, T, C]
    qkv: &[f32],       // [B, T, W]
    out: &[f32],       // [B, T, C]
    lse: &[f32],       // [B, NH, T]
    dims: &GqaDims,
    opts: BwdOpts,
) {
    flash_gqa_backward_docs_with(dqkv, dout, (qkv, out, lse), dims, &[], opts);
}

#[doc(hidden)]
pub fn flash_gqa_backward_docs_with(
    dqkv: &mut [f32],  // [B, T, W]
    dout: &[f32],      // [B, T, C]
    saved: (&[f32], &[f32], &[f32]), // the forward's qkv [B, T, W], out [B, T, C], lse [B, NH, T]
    dims: &GqaDims,
    starts: &[u32],    // [B, T] or empty
    opts: BwdOpts,
) {
    let (qkv, out, lse) = saved;
    check_starts(starts, dims.b, dims.t);
    let (b, t, nh) = (dims.b, dims.t, dims.nh);
    assert_eq!(out.len(), b * t * dims.c());
    let mut d = pooled(b * nh * t);
    flash_d(&mut d, dout, out, dims, t);
    flash_gqa_block_backward_with((dqkv, None), dout, lse, &d, &Block::whole(qkv, dims, starts), dims, opts);
}

/// FlashAttention-2's `D[bh, i] = dO_i · O_i` (`[B, NH, rows]`) of `rows` rows per batch row of
/// `dout` and `out` (`[B, rows, C]`): backward's per-row term, equal to `Σ_j P_ij·dP_ij` (with
/// dropout too). Over a context-parallel rank's rows it is computed once and serves every
/// [`Block`] of its queries.
pub fn flash_d(d: &mut [f32], dout: &[f32], out: &[f32], dims: &GqaDims, rows: usize) {
    let (nh, hs) = (dims.nh, dims.hs);
    let c = nh * hs;
    assert_eq!(dout.len(), dims.b * rows * c);
    assert_eq!(out.len(), dims.b * rows * c);
    assert_eq!(d.len(), dims.b * nh * rows);
    if rows == 0 {
        return;
    }
    d.par_chunks_mut(rows).enumerate().for_each(|(bh, d)| {
        let (bi, h) = (bh / nh, bh % nh);
        for (i, di) in d.iter_mut().enumerate() {
            let o = (bi * rows + i) * c + h * hs;
            *di = dot(&dout[o..o + hs], &out[o..o + hs]);
        }
    });
}

/// Backward of [`flash_gqa_block_forward`] over the block's queries and keys, given the
/// attention's final `lse` and [`flash_d`]'s `d` at the query rows (for a context-parallel rank:
/// after every block's forward). Accumulates `dq` into the q columns of `dq` (`[B, q.rows, W]`)
/// and `dk`, `dv` into the kv columns of `dkv` (`[B, k.rows, kw]`); `dkv = None`: into `dq`'s
/// buffer, whose layout the kv buffer then shares (the whole-sequence kernel). Contributions
/// are added in the order [`flash_gqa_backward`] documents.
pub fn flash_gqa_block_backward(
    (dq, dkv): (&mut [f32], Option<&mut [f32]>),
    dout: &[f32],      // [B, q.rows, C]
    lse: &[f32],       // [B, NH, q.rows]
    d: &[f32],         // [B, NH, q.rows]
    blk: &Block,
    dims: &GqaDims,
    dropout: AttnDropout,
) {
    flash_gqa_block_backward_with((dq, dkv), dout, lse, d, blk, dims, BwdOpts { dropout, ..BwdOpts::default() });
}

#[doc(hidden)]
pub fn flash_gqa_block_backward_with(
    (dq, dkv): (&mut [f32], Option<&mut [f32]>),
    dout: &[f32],
    lse: &[f32],
    d: &[f32],
    blk: &Block,
    dims: &GqaDims,
    opts: BwdOpts,
) {
    let _p = crate::profile::scope("flash_attention_backward");
    let BwdOpts { dropout: AttnDropout { p: dropout, seed }, tiles, schedule } = opts;
    check_dims(dims, tiles, dropout);
    blk.check(dims);
    let GqaDims { b, t, nh, nkv, hs, .. } = *dims;
    let (c, w, group) = (nh * hs, (nh + 2 * nkv) * hs, nh / nkv);
    let (qs, ks) = (blk.q, blk.k);
    assert_eq!(dq.len(), b * qs.rows * w);
    assert_eq!(dout.len(), b * qs.rows * c);
    assert_eq!(lse.len(), b * nh * qs.rows);
    assert_eq!(d.len(), b * nh * qs.rows);
    let dqp = SyncPtr(dq.as_mut_ptr());
    let dkvp = match dkv {
        Some(x) => {
            assert_eq!(x.len(), b * ks.rows * blk.kw, "dkv must be [B, k.rows, kw]");
            SyncPtr(x.as_mut_ptr())
        }
        None => {
            assert!(blk.kw == w && ks.rows == qs.rows, "dk and dv in dq's buffer need the kv buffer laid out as it");
            dqp
        }
    };
    if b * nh * qs.len == 0 || ks.len == 0 {
        return;
    }
    let Tiles { br, bc } = tiles;
    let ctx = Ctx {
        dims: *dims, blk: *blk, dout, lse, d, dq: dqp, dkv: dkvp,
        t, c, w, nh, nkv, group, hs,
        br, bc, scale: dims.logit_scale(), dropout, seed,
    };
    let (ntq, ntk) = (qs.len.div_ceil(br), ks.len.div_ceil(bc));
    let schedule = match schedule {
        Schedule::Auto => auto_schedule(b, nh, nkv, rayon::current_num_threads()),
        Schedule::PerQueryHead if group == 1 => Schedule::PerHead,
        s => s,
    };
    let init = || BwdScratch {
        p: pooled(br * bc),
        pd: pooled(if dropout > 0.0 { br * bc } else { 0 }),
        ds: pooled(br * bc),
        mk: pooled(bc),
        kp: pooled(if group > 1 { bc * hs } else { 0 }),
        vp: pooled(if group > 1 { bc * hs } else { 0 }),
        cap: pooled(if dims.softcap > 0.0 { br * bc } else { 0 }),
    };
    if schedule == Schedule::PerHead {
        (0..b * nkv).into_par_iter().for_each_init(init, |sc, bg| {
            for jt in 0..ntk {
                key_tile(&ctx, sc, bg, jt, true);
            }
        });
    } else if schedule == Schedule::PerQueryHead {
        // Partial dk, dv of every (batch, query head): [B, NH, k.len, HS] each.
        let kl = ks.len;
        let mut kp = pooled(b * nh * kl * hs);
        let mut vp = pooled(b * nh * kl * hs);
        let (kpp, vpp) = (SyncPtr(kp.as_mut_ptr()), SyncPtr(vp.as_mut_ptr()));
        (0..b * nh).into_par_iter().for_each_init(init, |sc, bh| {
            let (kpp, vpp) = (kpp, vpp);
            let (bi, h) = (bh / nh, bh % nh);
            for jt in 0..ntk {
                let j0 = jt * bc;
                // Safety: task bh alone writes rows bh·k.len.. of the partials, and the q
                // columns of head h of batch bi in dq.
                let (dk, dv) = unsafe { (kpp.0.add((bh * kl + j0) * hs), vpp.0.add((bh * kl + j0) * hs)) };
                head_key_tile(&ctx, sc, bi, h, jt, DkDv { dk, dv, ld: hs }, true);
            }
        });
        // dk_g += Σ_h partial_h, ascending h (the order `key_tile` adds them in).
        let x = &ctx;
        (0..b * nkv * ntk).into_par_iter().for_each(|task| {
            let (bg, jt) = (task / ntk, task % ntk);
            let (bi, g) = (bg / nkv, bg % nkv);
            let j0 = jt * bc;
            let ncols = x.key_cols(j0);
            for h in g * group..(g + 1) * group {
                let src = ((bi * nh + h) * kl + j0) * hs;
                for r in 0..ncols {
                    // Safety: task (bg, jt) alone writes rows j0..j0+ncols of kv head g's k, v.
                    unsafe {
                        add_into(x.dkv.0.add(x.k_at(bi, j0 + r, g)), &kp[src + r * hs..src + (r + 1) * hs]);
                        add_into(x.dkv.0.add(x.v_at(bi, j0 + r, g)), &vp[src + r * hs..src + (r + 1) * hs]);
                    }
                }
            }
        });
    } else {
        // Longest key tiles (most query tiles) first: natural order.
        (0..b * nkv * ntk).into_par_iter().for_each_init(init, |sc, task| {
            key_tile(&ctx, sc, task / ntk, task % ntk, false);
        });
        (0..b * nh * ntq).into_par_iter().for_each_init(init, |sc, task| {
            query_tile(&ctx, sc, task / ntq, ntq - 1 - task % ntq);
        });
    }
}

/// [`Schedule::Auto`]: the schedule with the least estimated makespan, in units of
/// `PerHead`'s total work. Measured work factors (`benches/flash.rs`, `FLASH_NKV`, one thread,
/// B1 T1024 NH12 HS64): two-pass recomputes every tile, about 1.5×; per-query-head adds the
/// partials' traffic, about 1.1×.
fn auto_schedule(b: usize, nh: usize, nkv: usize, threads: usize) -> Schedule {
    let (n, th) = (b * nkv, threads.max(1));
    if n.is_multiple_of(th) || n >= 4 * th {
        return Schedule::PerHead;
    }
    if nh == nkv {
        return Schedule::TwoPass;
    }
    // n equal tasks on th threads finish after ceil(n/th) task lengths.
    let span = |tasks: usize, work: f64| work * tasks.div_ceil(th) as f64 / tasks as f64;
    let per_head = span(n, 1.0);
    let per_query = span(b * nh, 1.1);
    let two_pass = 1.5 / th as f64;
    if per_head <= per_query && per_head <= two_pass {
        Schedule::PerHead
    } else if per_query <= two_pass {
        Schedule::PerQueryHead
    } else {
        Schedule::TwoPass
    }
}

/// Key tile `jt` of kv head `g` (`bg = b·NKV + g`): `dk_j += Σ_h Σ_i dSᵀ·q_h,i·scale`,
/// `dv_j += Σ_h Σ_i Pdᵀ·dO_h,i` (and `dq_h,i += dS·k_j·scale` when `with_dq`). With one head
/// per group the products accumulate straight into `dkv`; with GQA each head's sum over
/// ascending query tiles is formed from zero in scratch, then added, heads ascending.
fn key_tile(x: &Ctx, sc: &mut BwdScratch, bg: usize, jt: usize, with_dq: bool) {
    let hs = x.hs;
    let (bi, g) = (bg / x.nkv, bg % x.nkv);
    let j0 = jt * x.bc;
    let ncols = x.key_cols(j0);
    let kw = x.blk.kw;
    // Safety: key tile (bg, jt) is handled by exactly one task, the only writer of rows
    // j0..j0+ncols of the k and v columns of kv head g of batch bi; with `with_dq` the task
    // owns all of (bi, g), so also the q columns of the group's query heads.
    let (dk, dv) = unsafe { (x.dkv.0.add(x.k_at(bi, j0, g)), x.dkv.0.add(x.v_at(bi, j0, g))) };
    if x.group == 1 {
        head_key_tile(x, sc, bi, g, jt, DkDv { dk, dv, ld: kw }, with_dq);
        return;
    }
    let (mut kp, mut vp) = (std::mem::take(&mut sc.kp), std::mem::take(&mut sc.vp));
    for h in g * x.group..(g + 1) * x.group {
        kp[..ncols * hs].fill(0.0);
        vp[..ncols * hs].fill(0.0);
        head_key_tile(x, sc, bi, h, jt, DkDv { dk: kp.as_mut_ptr(), dv: vp.as_mut_ptr(), ld: hs }, with_dq);
        for r in 0..ncols {
            // Safety: as above.
            unsafe {
                add_into(dk.add(r * kw), &kp[r * hs..(r + 1) * hs]);
                add_into(dv.add(r * kw), &vp[r * hs..(r + 1) * hs]);
            }
        }
    }
    (sc.kp, sc.vp) = (kp, vp);
}

/// Where one key tile's `dk`, `dv` accumulate: two `[ncols, HS]` blocks, row stride `ld`.
#[derive(Clone, Copy)]
struct DkDv {
    dk: *mut f32,
    dv: *mut f32,
    ld: usize,
}

/// Query head `h` of batch `bi` against key tile `jt` of its kv head, query tiles ascending:
/// `dk += dSᵀ·q·scale`, `dv += Pdᵀ·dO` into the blocks of `dkdv`, and `dq += dS·k·scale` in
/// `dq` when `with_dq`. The caller must own those blocks (and, with `with_dq`, head h's q
/// columns of batch bi).
fn head_key_tile(x: &Ctx, sc: &mut BwdScratch, bi: usize, h: usize, jt: usize, dkdv: DkDv, with_dq: bool) {
    let DkDv { dk, dv, ld } = dkdv;
    let (c, w, hs) = (x.c, x.w, x.hs);
    let (qs, ks) = (x.blk.q, x.blk.k);
    let g = h / x.group;
    let bh = bi * x.nh + h;
    let j0 = jt * x.bc;
    let ncols = x.key_cols(j0);
    let jg0 = ks.pos0 + j0;
    let k = View { data: x.blk.kv, off: x.k_at(bi, j0, g), rows: ncols, cols: hs, rs: x.blk.kw, cs: 1 };
    let mask = x.mask(bi);
    // The first query tile that holds a position at or after the key tile's first.
    let mut it = jg0.saturating_sub(qs.pos0) / x.br;
    // Query tiles whose first row's first key (sliding window, document) is past this key tile
    // are skipped, and so are all later ones: the first key never decreases.
    // With sinks, queries see a document's first keys however far on they are: the loop runs
    // to the document's end, skipping the tiles no row sees.
    let reach = |gi: usize| if mask.sinks > 0 { mask.start(gi) } else { mask.first(gi) };
    while it * x.br < qs.len && reach(qs.pos0 + it * x.br) < jg0 + ncols {
        let i0 = it * x.br;
        let rows = x.br.min(qs.len - i0);
        if mask.sinks > 0 && !mask.tile_visible(qs.pos0 + i0, rows, jg0, ncols) {
            it += 1;
            continue;
        }
        tile_grads(x, sc, bh, i0, rows, j0, ncols);
        let q = View { data: x.blk.qkv, off: x.q_at(bi, i0, h), rows, cols: hs, rs: w, cs: 1 };
        let d_o = View { data: x.dout, off: x.o_at(bi, i0, h), rows, cols: hs, rs: c, cs: 1 };
        let pd = if x.dropout > 0.0 { &sc.pd } else { &sc.p };
        let pd = View { data: pd, off: 0, rows, cols: ncols, rs: x.bc, cs: 1 };
        let ds = View { data: &sc.ds, off: 0, rows, cols: ncols, rs: x.bc, cs: 1 };
        unsafe {
            // dv += Pdᵀ·dO ; dk += dSᵀ·q·scale
            gemm_raw((dv, ld), true, pd.t(), d_o, 1.0, Threads::One);
            gemm_raw((dk, ld), true, ds.t(), q, x.scale, Threads::One);
            if with_dq {
                // dq += dS·k·scale
                gemm_raw((x.dq.0.add(x.q_at(bi, i0, h)), w), true, ds, k, x.scale, Threads::One);
            }
        }
        it += 1;
    }
}

/// `dst[..src.len()] += src`, element by element.
///
/// # Safety
/// `dst` must be valid for `src.len()` writes that no one else makes concurrently.
#[inline]
unsafe fn add_into(dst: *mut f32, src: &[f32]) {
    let d = unsafe { std::slice::from_raw_parts_mut(dst, src.len()) };
    for (a, b) in d.iter_mut().zip(src) {
        *a += b;
    }
}

/// `dq_i += Σ_j dS·k_j·scale` over key tiles `j` in ascending order (the same order, tiles and
/// products as [`key_tile`] with `with_dq`, so both schedules agree bit for bit).
fn query_tile(x: &Ctx, sc: &mut BwdScratch, bh: usize, it: usize) {
    let (w, hs) = (x.w, x.hs);
    let (qs, ks) = (x.blk.q, x.blk.k);
    let (bi, h) = (bh / x.nh, bh % x.nh);
    let g = h / x.group;
    let i0 = it * x.br;
    let rows = x.br.min(qs.len - i0);
    let gi0 = qs.pos0 + i0;
    // Safety: query tile (bh, it) is handled by exactly one task, the only writer of rows
    // i0..i0+rows of the q columns of head h of batch bi.
    let dq = unsafe { x.dq.0.add(x.q_at(bi, i0, h)) };
    let end = (gi0 + rows).saturating_sub(ks.pos0).min(ks.len);
    let mask = x.mask(bi);
    let mut j0 = mask.first_tile(gi0, ks.pos0, x.bc);
    while j0 < end {
        let ncols = x.key_cols(j0);
        if mask.sinks > 0 && !mask.tile_visible(gi0, rows, ks.pos0 + j0, ncols) {
            j0 += x.bc;
            continue;
        }
        tile_grads(x, sc, bh, i0, rows, j0, ncols);
        let k = View { data: x.blk.kv, off: x.k_at(bi, j0, g), rows: ncols, cols: hs, rs: x.blk.kw, cs: 1 };
        let ds = View { data: &sc.ds, off: 0, rows, cols: ncols, rs: x.bc, cs: 1 };
        unsafe { gemm_raw((dq, w), true, ds, k, x.scale, Threads::One) };
        j0 += x.bc;
    }
}

/// Recomputes one tile of query head `bh = b·NH + h` against its kv head (block-local query
/// rows `i0..`, key rows `j0..`): `P = exp(q·kᵀ·scale − lse)` (causal part, 0 elsewhere), the
/// dropped `Pd` (with dropout), and `dS = P ∘ (dP − D)` where `dP = mask ∘ (dO·vᵀ)`.
fn tile_grads(x: &Ctx, sc: &mut BwdScratch, bh: usize, i0: usize, rows: usize, j0: usize, ncols: usize) {
    let (c, w, hs) = (x.c, x.w, x.hs);
    let (qs, ks) = (x.blk.q, x.blk.k);
    let (bi, h) = (bh / x.nh, bh % x.nh);
    let g = h / x.group;
    let q = View { data: x.blk.qkv, off: x.q_at(bi, i0, h), rows, cols: hs, rs: w, cs: 1 };
    let k = View { data: x.blk.kv, off: x.k_at(bi, j0, g), rows: ncols, cols: hs, rs: x.blk.kw, cs: 1 };
    let v = View { off: x.v_at(bi, j0, g), ..k };
    let d_o = View { data: x.dout, off: x.o_at(bi, i0, h), rows, cols: hs, rs: c, cs: 1 };
    let BwdScratch { p, pd, ds, mk, cap, .. } = sc;
    unsafe {
        // S = q·kᵀ·scale ; dPd = dO·vᵀ   [rows, ncols], row stride bc
        gemm_raw((p.as_mut_ptr(), x.bc), false, q, k.t(), x.scale, Threads::One);
        gemm_raw((ds.as_mut_ptr(), x.bc), false, d_o, v.t(), 1.0, Threads::One);
    }
    let softcap = x.dims.softcap;
    if softcap > 0.0 {
        softcap_tile(p, (rows, ncols, x.bc), softcap, Some(cap));
    }
    let l0 = bh * qs.rows + qs.row0 + i0;
    let lse = &x.lse[l0..l0 + rows];
    let d = &x.d[l0..l0 + rows];
    let mask = x.mask(bi);
    let jg0 = ks.pos0 + j0;
    for r in 0..rows {
        let gi = qs.pos0 + i0 + r;
        // Columns lo..vr are valid (and the sinks' s0..s1): the row functions see the tile
        // from `lo` on, and the sinks' columns alone.
        let [(s0, s1), (lo, vr)] = segments(gi, jg0, ncols, mask);
        let pr = &mut p[r * x.bc..r * x.bc + ncols];
        let dr = &mut ds[r * x.bc..r * x.bc + ncols];
        for (a, b) in [(0, s0), (s1, lo)] {
            pr[a..b].fill(0.0);
            dr[a..b].fill(0.0);
        }
        if x.dropout > 0.0 {
            let pdr = &mut pd[r * x.bc..r * x.bc + ncols];
            for (a, b) in [(0, s0), (s1, lo)] {
                pdr[a..b].fill(0.0);
            }
            if s1 > s0 {
                dropout_row(mk, mask_base(x.dims.mask_bh(bh), x.t, gi, jg0 + s0), s1 - s0, x.dropout, x.seed);
                bwd_row_dropout(&mut pr[s0..s1], &mut pdr[s0..s1], &mut dr[s0..s1], &mk[..s1 - s0], s1 - s0, lse[r], d[r]);
            }
            dropout_row(mk, mask_base(x.dims.mask_bh(bh), x.t, gi, jg0 + lo), vr - lo, x.dropout, x.seed);
            bwd_row_dropout(&mut pr[lo..], &mut pdr[lo..], &mut dr[lo..], &mk[..vr - lo], vr - lo, lse[r], d[r]);
        } else {
            if s1 > s0 {
                bwd_row(&mut pr[s0..s1], &mut dr[s0..s1], s1 - s0, lse[r], d[r]);
            }
            bwd_row(&mut pr[lo..], &mut dr[lo..], vr - lo, lse[r], d[r]);
        }
    }
    if softcap > 0.0 {
        // dS with respect to the uncapped scores.
        for r in 0..rows {
            mul_into(&mut ds[r * x.bc..r * x.bc + ncols], &cap[r * x.bc..r * x.bc + ncols]);
        }
    }
}

/// Soft-capping of a score tile's `rows × ncols` (row stride `bc`) in place,
/// `s ← cap·tanh(s / cap)`; with `deriv`, also `deriv ← 1 − tanh²(s / cap)` (backward's factor).
fn softcap_tile(s: &mut [f32], (rows, ncols, bc): (usize, usize, usize), cap: f32, mut deriv: Option<&mut [f32]>) {
    for r in 0..rows {
        for j in r * bc..r * bc + ncols {
            let t = (s[j] / cap).tanh();
            s[j] = cap * t;
            if let Some(d) = deriv.as_deref_mut() {
                d[j] = 1.0 - t * t;
            }
        }
    }
}


crate::multiversion! {
    /// `p ← exp(s − lse)`, `ds ← p ∘ (dP − D)` on the first `vr` columns, 0 after.
    fn bwd_row(p: &mut [f32], ds: &mut [f32], vr: usize, lse: f32, d: f32) {
        for (pj, dj) in p[..vr].iter_mut().zip(ds[..vr].iter_mut()) {
            let e = exp(*pj - lse);
            *pj = e;
            *dj = e * (*dj - d);
        }
        p[vr..].fill(0.0);
        ds[vr..].fill(0.0);
    }
}

crate::multiversion! {
    /// As [`bwd_row`] with dropout: also `pd ← p ∘ mk`, and `dP = mk ∘ (dO·vᵀ)`.
    fn bwd_row_dropout(p: &mut [f32], pd: &mut [f32], ds: &mut [f32], mk: &[f32], vr: usize, lse: f32, d: f32) {
        let it = p[..vr].iter_mut().zip(pd[..vr].iter_mut()).zip(ds[..vr].iter_mut()).zip(mk);
        for (((pj, pdj), dj), &m) in it {
            let e = exp(*pj - lse);
            *pj = e;
            *pdj = e * m;
            *dj = e * (*dj * m - d);
        }
        p[vr..].fill(0.0);
        pd[vr..].fill(0.0);
        ds[vr..].fill(0.0);
    }
}

// ---------------------------------------------------------------------------------------------
// Small vector helpers: fixed 8-lane order, so they vectorise and stay deterministic.

#[inline(always)]
fn row_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let mut ch = x.chunks_exact(8);
    for c in &mut ch {
        for k in 0..8 {
            acc[k] = if c[k] > acc[k] { c[k] } else { acc[k] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &v in acc.iter().chain(ch.remainder()) {
        m = if v > m { v } else { m };
    }
    m
}

/// `x ← exp(x − m)`, returns `Σ x`.
#[inline(always)]
fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut ch = x.chunks_exact_mut(8);
    for c in &mut ch {
        for k in 0..8 {
            let e = exp(c[k] - m);
            c[k] = e;
            acc[k] += e;
        }
    }
    let mut s = 0.0;
    for v in ch.into_remainder() {
        *v = exp(*v - m);
        s += *v;
    }
    acc.iter().sum::<f32>() + s
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let rest: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + rest
}

#[inline(always)]
fn mul_into(x: &mut [f32], m: &[f32]) {
    for (a, b) in x.iter_mut().zip(m) {
        *a *= b;
    }
}
