//! How a pass reaches the parameters: one *unit* (see [`GptParams::units`]) at a time, through
//! a [`UnitStore`]. The model's own store hands out slices of its flat buffers; the parallel
//! crate's stores gather ZeRO-3 shards before a unit is used and reduce a unit's gradients as
//! soon as backward is done with it, without the model knowing about ranks.
//!
//! [`GptParams::units`]: crate::layout::GptParams::units

use std::ops::Range;
use tensor::attention::AttnDropout;
use tensor::llama::GqaDims;

/// What a pass does with a unit it acquires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Forward through the unit: parameters only.
    Forward,
    /// The fused output head (forward): parameters, and gradients when `train` (the head's
    /// weight gradient is accumulated here; the unit's gradients are not complete yet).
    Head { train: bool },
    /// Backward through the unit: gradients, and its parameters when `params`. When it is
    /// released the unit's gradients for this micro-batch are complete.
    Backward { params: bool },
}

impl Access {
    pub fn params(self) -> bool {
        !matches!(self, Access::Backward { params: false })
    }

    pub fn grads(self) -> bool {
        matches!(self, Access::Head { train: true } | Access::Backward { .. })
    }
}

/// Where a pass gets unit `u`'s parameters and gradient accumulators: slices laid out as the
/// unit's range of the flat layout, indexed from 0 (the model indexes them with
/// [`GptParams::rebased`] views). A slice the access does not need may be empty.
///
/// [`GptParams::rebased`]: crate::layout::GptParams::rebased
pub trait UnitStore {
    /// Unit `u`'s slices for `access`; `next` is the unit the pass will acquire after this one
    /// (a store may start fetching it now).
    fn acquire(&mut self, u: usize, access: Access, next: Option<(usize, Access)>) -> (&[f32], &mut [f32]);
    /// The pass is done with unit `u` for `access` (for `Backward`, its gradients are final).
    fn release(&mut self, u: usize, access: Access);
}

/// The model's own flat buffers as a store.
pub struct Local<'a> {
    pub params: &'a [f32],
    pub grads: &'a mut [f32],
    pub units: &'a [Range<usize>],
}

impl UnitStore for Local<'_> {
    fn acquire(&mut self, u: usize, access: Access, _next: Option<(usize, Access)>) -> (&[f32], &mut [f32]) {
        let r = self.units[u].clone();
        let g: &mut [f32] = if access.grads() { &mut self.grads[r.clone()] } else { &mut [] };
        (&self.params[r], g)
    }

    fn release(&mut self, _u: usize, _access: Access) {}
}

/// The collectives a tensor-parallel shard needs inside a block (Megatron-LM's conjugate `f`
/// and `g`): the model calls them at its two branch boundaries; which heads, rows and
/// positions it holds it reads from its [`crate::Placement`]. A shard's column-parallel products (q|k|v, the MLP's up/gate) see the whole input;
/// its row-parallel products (attention output, MLP down) produce partial sums.
pub trait TpHooks: Send {
    /// `g` forward: `out` (`[N, C]`) holds this rank's partial sum of a row-parallel product,
    /// plus `bias` if the layer has one (every rank adds it); make it the full output, with the
    /// bias counted once. Backward of `g` is the identity.
    fn reduce_output(&mut self, out: &mut [f32], bias: Option<&[f32]>);
    /// `f` backward: `dx` (`[N, C]`) holds this rank's part of the gradient of a
    /// column-parallel product's input; make it the sum over ranks. Forward of `f` is the
    /// identity.
    fn reduce_input_grad(&mut self, dx: &mut [f32]);
    /// Sequence parallel `g` forward (before a column-parallel product): `local`
    /// (`[B, T/t, C]`, this rank's positions `rank·T/t ..` of each sequence) gathered into
    /// `full` (`[B, T, C]`).
    fn gather_seq(&mut self, local: &[f32], full: &mut [f32], b: usize, t: usize);
    /// Sequence parallel `ḡ` forward (after a row-parallel product): `full` (`[B, T, C]`, this
    /// rank's partial sum, plus `bias` if the layer has one) summed over the ranks, of which
    /// this rank keeps its positions in `local`; the bias counted once. `full` is clobbered.
    fn scatter_seq(&mut self, full: &mut [f32], local: &mut [f32], bias: Option<&[f32]>, b: usize, t: usize);
    /// Every rank's `x` (equal lengths), concatenated in rank order (the vocab-parallel
    /// cross-entropy's exchange of per-row log-sum-exps and target logits).
    fn all_gather(&mut self, x: &[f32]) -> Vec<f32>;
}

/// The attention of a context-parallel part (`Placement::context` set): the model holds its
/// positions of every sequence ([`crate::placement::ContextSlice::chunks`]) and calls these in
/// place of the attention kernel; `parallel` implements them (ring attention, or the Ulysses
/// all-to-alls). `dims` is the part's (its `t` the part's rows per sequence, its heads those
/// of a tensor-parallel shard); `starts` (`[B, t]`) gives each local query's document start as
/// a *global* position (0 for plain causal rows); dropout masks are drawn by global position,
/// so a part drops what one rank drops.
pub trait CpHooks: Send {
    /// `out` (`[B, t, C]`) and `state` (`B·NH·t` floats the hook may lay out as it needs: the
    /// log-sum-exps backward reads) from this part's `qkv` (`[B, t, W]`, rotated).
    fn attention_forward(&mut self, out: &mut [f32], state: &mut [f32], qkv: &[f32], dims: &GqaDims, starts: &[u32], dropout: AttnDropout);
    /// Accumulates this part's `dqkv` (`[B, t, W]`, zero on entry) from `dout`, given the
    /// forward's `saved = (qkv, out, state)`.
    fn attention_backward(&mut self, dqkv: &mut [f32], dout: &[f32], saved: (&[f32], &[f32], &[f32]), dims: &GqaDims, starts: &[u32], dropout: AttnDropout);
    /// Whether the part's attention is a ring ([`crate::placement::ContextSlice::ring_blocks`]):
    /// then a model that runs the blocks with kernels of its own (a device's) moves the keys and
    /// values through [`CpHooks::send_next`] and [`CpHooks::recv_prev`] instead.
    fn is_ring(&self) -> bool;
    /// Ring attention's exchange: `x` to the next part of the group (its keys and values, or
    /// with `backward` their gradients' accumulator). Buffered: it does not wait.
    fn send_next(&mut self, x: &[f32], backward: bool);
    /// The previous part's [`CpHooks::send_next`] into `x` (of the same length).
    fn recv_prev(&mut self, x: &mut [f32], backward: bool);
    /// [`CpHooks::attention_forward`] of a part that is not a ring (Ulysses) with the caller's
    /// attention kernel (a device's): the exchanges around `attend`, which computes the
    /// whole-sequence attention of this part's heads ([`HeadsForward`]).
    fn heads_forward(&mut self, out: &mut [f32], state: &mut [f32], qkv: &[f32], dims: &GqaDims, starts: &[u32], attend: &mut dyn FnMut(HeadsForward));
    /// [`CpHooks::attention_backward`] likewise, `attend` the kernel's backward
    /// ([`HeadsBackward`]).
    fn heads_backward(&mut self, dqkv: &mut [f32], dout: &[f32], saved: (&[f32], &[f32], &[f32]), dims: &GqaDims, starts: &[u32], attend: &mut dyn FnMut(HeadsBackward));
    /// `x` summed over the parts (in part order), each holding its positions' partial sums of
    /// the same rows (a sequence objective's row log-probabilities).
    fn sum_over_parts(&mut self, x: &mut [f64]);
}

/// The whole-sequence attention of a Ulysses part's heads: `out` (`[B, T, hq·HS]`) and `lse`
/// (`[B·hq, T]`) from `qkv` (`[B, T, (hq + 2·hkv)·HS]`), under `dims` (the part's heads, every
/// position; dropout by whole-model head) and `starts` (`[B, T]`, or empty).
pub struct HeadsForward<'a> {
    pub out: &'a mut [f32],
    pub lse: &'a mut [f32],
    pub qkv: &'a [f32],
    pub dims: GqaDims,
    pub starts: &'a [u32],
}

/// The backward of [`HeadsForward`]: accumulates into `dqkv` from `dout`, given the forward's
/// `qkv` and `lse` and FlashAttention-2's `d` (`[B·hq, T]`).
pub struct HeadsBackward<'a> {
    pub dqkv: &'a mut [f32],
    pub dout: &'a [f32],
    pub qkv: &'a [f32],
    pub lse: &'a [f32],
    pub d: &'a [f32],
    pub dims: GqaDims,
    pub starts: &'a [u32],
}
