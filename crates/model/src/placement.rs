//! Where a model sits in the whole model it is a part of.
//!
//! A parallel strategy (crate `parallel`) cuts a part out of the whole model and says, in one
//! [`Placement`], which of the whole model's heads, vocabulary rows, sequence positions,
//! layers and experts the part holds and where its sequences start in the global batch. The
//! model reads nothing else about its place: everything is in the whole model's numbering, so
//! a part takes the whole model's parameter names and draws the dropout masks the whole model
//! draws there. Collectives reach the model only through hook traits ([`crate::units::TpHooks`],
//! `tensor::moe::MoeExchange`) that `parallel` implements.

use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Where a model sits in the whole model (the default: it is the whole model).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Placement {
    /// A tensor-parallel part: the whole model's attention heads it holds start at
    /// `heads.first` of `heads.total` (its own count is its config's `n_head`; its key/value
    /// heads and MLP columns are the same share). `None`: every head.
    pub heads: Option<Part>,
    /// A vocabulary-parallel part: its embedding and head rows start at `vocab.first` of the
    /// padded vocabulary's `vocab.total` (its own count is its config's `vocab_size`).
    pub vocab: Option<Part>,
    /// Sequence parallel: the residual stream, the norms and dropout hold slice `index` of
    /// `count` equal slices of every sequence's positions. `None`: every position.
    pub seq: Option<SeqSlice>,
    /// Context parallel: every sequence's positions are split over `count` parts and this part
    /// holds part `index`'s ([`ContextSlice::chunks`]); the model is given whole rows and runs
    /// on its positions only, attention reaching the other parts' keys through
    /// [`crate::units::CpHooks`]. `None`: every position.
    pub context: Option<ContextSlice>,
    /// A pipeline stage: its config's `n_layer` layers start at whole-model layer
    /// `first_layer`. `None`: every layer, the embedding and the head.
    pub stage: Option<Stage>,
    /// An expert-parallel part: the routed experts it holds (whole-model ids; the router still
    /// scores all `n_expert`). `None`: every expert.
    pub experts: Option<Range<usize>>,
    /// The index of this part's first sequence in the global micro-batch (a data-parallel
    /// part's share starts at its offset): dropout masks are drawn by global sequence.
    pub batch_offset: usize,
}

/// A part of a whole that starts at `first` of `total` (its length is kept elsewhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    pub first: usize,
    pub total: usize,
}

/// Slice `index` of `count` equal slices of every sequence's positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSlice {
    pub index: usize,
    pub count: usize,
}

impl SeqSlice {
    /// This slice's positions of a length-`t` sequence (`t` divisible by `count`).
    pub fn positions(&self, t: usize) -> Range<usize> {
        assert!(t.is_multiple_of(self.count), "sequence parallel: T = {t} is not divisible into {} slices", self.count);
        let tl = t / self.count;
        self.index * tl..(self.index + 1) * tl
    }
}

/// Part `index` of `count` context-parallel parts of every sequence: one contiguous chunk of
/// `T/count` positions, or (`zigzag`) chunks `index` and `2·count − 1 − index` of `2·count`, which
/// balances causal attention's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextSlice {
    pub index: usize,
    pub count: usize,
    pub zigzag: bool,
}

impl ContextSlice {
    /// The chunks `(first position, length)` of a length-`t` sequence this part holds, in the
    /// order its rows hold them (`t` divisible by `count`, or `2·count` with zig-zag).
    pub fn chunks(&self, t: usize) -> Vec<(usize, usize)> {
        let (r, n) = (self.index, self.count);
        if self.zigzag {
            assert!(t.is_multiple_of(2 * n), "context parallel (zig-zag): T = {t} is not divisible into {} chunks", 2 * n);
            let h = t / (2 * n);
            vec![(r * h, h), ((2 * n - 1 - r) * h, h)]
        } else {
            assert!(t.is_multiple_of(n), "context parallel: T = {t} is not divisible into {n} chunks");
            vec![(r * (t / n), t / n)]
        }
    }

    /// Every local row's global position, in row order.
    pub fn positions(&self, t: usize) -> Vec<usize> {
        self.chunks(t).into_iter().flat_map(|(p0, len)| p0..p0 + len).collect()
    }

    /// This part's chunks as spans of its `[B, T/count, ·]` buffers (a length-`t` sequence).
    pub fn spans(&self, t: usize) -> Vec<tensor::flash::Span> {
        let tl = t / self.count;
        let mut row0 = 0;
        self.chunks(t)
            .into_iter()
            .map(|(pos0, len)| {
                let s = tensor::flash::Span { rows: tl, row0, len, pos0 };
                row0 += len;
                s
            })
            .collect()
    }

    /// The blocks of ring attention's step `s` on this part: its query chunks against the
    /// chunks of part `index − s`, those no query can see left out (keys after the chunk, or
    /// wholly before its sliding window, unless attention sinks may reach them); on the own step
    /// each chunk's diagonal block first (it starts the softmax's state).
    pub fn ring_blocks(&self, s: usize, t: usize, (window, sinks): (usize, usize)) -> Vec<(tensor::flash::Span, tensor::flash::Span)> {
        let (r, n) = (self.index, self.count);
        let owner = ContextSlice { index: (r + n - s) % n, ..*self };
        let mut v = Vec::new();
        for q in self.spans(t) {
            for k in owner.spans(t) {
                let before_window = window > 0 && sinks == 0 && k.pos0 + k.len + window <= q.pos0 + 1;
                if k.pos0 < q.pos0 + q.len && !before_window {
                    v.push((q, k));
                }
            }
        }
        v.sort_by_key(|(q, k)| q != k);
        v
    }

    /// This part's rows of `x` (`[B, T]` per-token values): `[B, T/count]`.
    pub fn rows<X: Copy>(&self, x: &[X], b: usize, t: usize) -> Vec<X> {
        assert_eq!(x.len(), b * t);
        let mut out = Vec::with_capacity(x.len() / self.count);
        for bi in 0..b {
            for (p0, len) in self.chunks(t) {
                out.extend_from_slice(&x[bi * t + p0..bi * t + p0 + len]);
            }
        }
        out
    }
}

/// Where a pipeline stage sits in the whole model. Layer names, dropout streams and the
/// residual projections' initialisation scale use the whole model's layer numbering, so a
/// stage is exactly its layers of the whole model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stage {
    /// Global index of the stage's first block.
    pub first_layer: usize,
    /// Blocks in the whole model.
    pub total_layers: usize,
    /// The stage embeds the tokens (the first stage).
    pub embed: bool,
    /// The stage applies the final norm, the head and the loss (the last stage).
    pub head: bool,
}
