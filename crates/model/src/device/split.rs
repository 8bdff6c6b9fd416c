//! A tensor-parallel part on a device (Megatron-LM's tensor and vocabulary parallelism; the
//! model's [`crate::Placement`] has `heads` and `vocab`): the part holds its attention heads,
//! MLP columns and vocabulary rows, so its column-parallel products (q|k|v, the MLP's up and
//! gate) see the whole input and its row-parallel products (attention output, MLP down) and
//! embedding lookups give partial sums. At those boundaries the part calls the host model's
//! hooks ([`crate::units::TpHooks`]), the buffers staged through host memory: Megatron's `g`
//! (the partial outputs summed, a bias counted once) in forward, `f`'s backward (the
//! column-parallel inputs' gradients summed) in backward, and the vocabulary-parallel head's
//! exchange of per-row log-sum-exps. Under sequence parallelism (`Placement::seq`) the residual
//! stream, the norms and dropout hold the part's positions of every sequence: a norm's output
//! is gathered along the sequence before a column-parallel product, a row-parallel product's
//! partial sums reduce-scattered back (and the reverse in backward). Attention dropout is drawn by whole-model head, so the
//! parts drop what one model drops. Mixture-of-experts layers are not split: every part holds
//! the experts whole and runs the layer on every token (under sequence parallelism the
//! sequence gathered first and its positions kept after), as on the CPU.

use super::DeviceGpt;
use crate::units::TpHooks;
use device::Buf;
use std::ops::Range;

impl DeviceGpt {
    /// Swaps the part's tensor-parallel hooks with `hooks` (the host model's `Hooks::tensor`):
    /// a device run lends them for its passes and takes them back after.
    pub fn swap_tensor_hooks(&mut self, hooks: &mut Option<Box<dyn TpHooks>>) {
        std::mem::swap(self.tensor.get_mut(), hooks);
    }

    /// Whether the model is a tensor-parallel part.
    pub(super) fn is_part(&self) -> bool {
        self.cfg.place.heads.is_some()
    }

    /// Megatron's `g` forward: `out` (`[N, C]`, this part's partial sum of a row-parallel
    /// product or embedding lookup, plus the bias at `bias`) made the whole output, the bias
    /// counted once. Nothing for a whole model.
    pub(super) fn reduce_output(&self, out: &Buf, bias: Option<&Range<usize>>) {
        let mut hooks = self.tensor.borrow_mut();
        let Some(h) = hooks.as_mut() else { return };
        let mut x = self.gpu.download(out);
        let b = bias.map(|r| self.bias_values(r));
        h.reduce_output(&mut x, b.as_deref());
        self.gpu.write(out, &x);
    }

    /// `f` backward: `dx` (`[N, C]`, this part's share of a column-parallel product's input
    /// gradient) made the sum over the parts. Nothing for a whole model.
    pub(super) fn reduce_input_grad(&self, dx: &Buf) {
        let mut hooks = self.tensor.borrow_mut();
        let Some(h) = hooks.as_mut() else { return };
        let mut x = self.gpu.download(dx);
        h.reduce_input_grad(&mut x);
        self.gpu.write(dx, &x);
    }

    /// Whether the part holds a slice of every sequence's positions (sequence parallelism).
    pub(super) fn sp(&self) -> bool {
        self.cfg.place.seq.is_some()
    }

    /// Sequence parallelism's `g` forward: this part's rows `local` (`[B, T/n, C]`) gathered
    /// along the sequence into `full` (`[B, T, C]`).
    pub(super) fn gather_seq(&self, local: &Buf, full: &Buf, a: &super::Acts) {
        let mut hooks = self.tensor.borrow_mut();
        let h = hooks.as_mut().expect("sequence parallelism needs tensor-parallel hooks");
        let mut out = vec![0.0; full.len()];
        h.gather_seq(&self.gpu.download(local), &mut out, a.b, a.t);
        self.gpu.write(full, &out);
    }

    /// Sequence parallelism's `ḡ` forward (and `f`'s backward): the parts' partial sums in
    /// `full` (plus the bias at `bias`) summed, this part's positions into `local`, the bias
    /// counted once.
    pub(super) fn scatter_seq(&self, full: &Buf, local: &Buf, bias: Option<&Range<usize>>, a: &super::Acts) {
        let mut hooks = self.tensor.borrow_mut();
        let h = hooks.as_mut().expect("sequence parallelism needs tensor-parallel hooks");
        let mut x = self.gpu.download(full);
        let mut out = vec![0.0; local.len()];
        let b = bias.map(|r| self.bias_values(r));
        h.scatter_seq(&mut x, &mut out, b.as_deref(), a.b, a.t);
        self.gpu.write(local, &out);
    }

    /// Sequence parallelism: this part's positions of `full` (`[B, T, C]`, the same on every
    /// part) into `local`, on the device.
    pub(super) fn take_seq(&self, full: &Buf, local: &Buf, a: &super::Acts) {
        let p = self.cfg.place.seq.expect("sequence parallel").positions(a.t);
        let c = self.cfg.n_embd;
        for bi in 0..a.b {
            self.gpu.copy_words(local, bi * p.len() * c, full, (bi * a.t + p.start) * c, p.len() * c);
        }
    }

    /// A bias as the passes read it: the fp32 weights, rounded as the working copy is.
    fn bias_values(&self, r: &Range<usize>) -> Vec<f32> {
        let (w, at) = self.zero.as_ref().and_then(|z| z.weight_f32(r.start)).unwrap_or((&self.params, r.start));
        let mut b = self.gpu.download_f32(w, at, r.len());
        if let Some(fmt) = self.work.as_ref().and_then(|w| w.dtype().format()) {
            tensor::precision::round_slice(&mut b, fmt);
        }
        b
    }

    /// The vocabulary rows the part's token table and head hold ([`device::ALL_ROWS`] for a
    /// whole model).
    pub(super) fn vocab_rows(&self) -> Range<usize> {
        self.cfg.place.vocab.map_or(device::ALL_ROWS, |v| v.first..v.first + self.cfg.vocab_size)
    }

    /// Every part's `x`, concatenated in part order (the head's exchange).
    pub(super) fn all_gather_parts(&self, x: &[f32]) -> Vec<f32> {
        self.tensor.borrow_mut().as_mut().expect("a vocabulary-parallel head has tensor-parallel hooks").all_gather(x)
    }
}
