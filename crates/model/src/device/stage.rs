//! A pipeline stage on a device (`crate::Placement::stage`): the stage's blocks, with the
//! embedding on the first and the final norm, head and loss on the last. A later stage's
//! forward starts from the activations the previous one sent ([`DeviceGpt::set_stage_input`]),
//! an earlier stage's backward from its output's gradient
//! ([`DeviceGpt::set_stage_output_grad`]); what goes on is downloaded for the host to send. A
//! schedule keeps several micro-batches in flight: each one's activations, and what its
//! backward reads of its forward (the dropout seed, the loss scale, the targets counted, packed
//! documents), are taken out after its forward and put back before its backward.

use super::{Acts, DeviceGpt, DROPOUT_SEED};

/// One micro-batch's activations on the device, taken out of a model between its forward and
/// its backward. Opaque: only the model reads it.
pub struct DeviceActs {
    acts: Acts,
    drop: (f32, u64),
    count: usize,
    loss_scale: f32,
    docs: bool,
}

impl DeviceGpt {
    /// Elements of a stage's input or output at `(B, T)`: `[B, T, C]`, or under sequence or
    /// context parallelism this part's rows of it.
    pub fn stage_width(&self, b: usize, t: usize) -> usize {
        super::local_rows(&self.cfg, b * self.part_t(t)) * self.cfg.n_embd
    }

    /// The positions of a length-`t` sequence this model holds (a context-parallel part's
    /// share).
    fn part_t(&self, t: usize) -> usize {
        t / self.cfg.place.context.map_or(1, |cx| cx.count)
    }

    /// A stage without the embedding: `x` (`[B, T, C]`, this part's rows of it) as the input of
    /// the next forward at `(B, T)`.
    pub fn set_stage_input(&mut self, x: &[f32], b: usize, t: usize) {
        assert!(!self.cfg.has_embed(), "set_stage_input: the first stage embeds its tokens");
        self.acts(b, self.part_t(t));
        let a = self.acts.as_ref().unwrap();
        assert_eq!(x.len(), a.xs[0].len(), "set_stage_input: the input is [B, T, C]");
        self.gpu.write(&a.xs[0], x);
    }

    /// A stage without the head: its output activations from the last forward (the next
    /// stage's input).
    pub fn stage_output(&self) -> Vec<f32> {
        let a = self.acts.as_ref().expect("forward first");
        self.gpu.download(&a.xs[self.cfg.n_layer])
    }

    /// A stage without the head: the gradient of its output (the next stage's input
    /// gradient), before [`DeviceGpt::backward`].
    pub fn set_stage_output_grad(&mut self, d: &[f32]) {
        assert!(!self.cfg.has_head(), "set_stage_output_grad: the last stage starts from its loss");
        let a = self.acts.as_ref().expect("the micro-batch's activations first");
        assert_eq!(d.len(), a.dres.len(), "set_stage_output_grad: the gradient is [B, T, C]");
        self.gpu.write(&a.dres, d);
    }

    /// A stage without the embedding: the gradient of its input after the last backward (for
    /// the previous stage).
    pub fn stage_input_grad(&self) -> Vec<f32> {
        self.gpu.download(&self.acts.as_ref().expect("backward first").dres)
    }

    /// The last pass's activations, taken out (the next forward allocates or is given a set).
    pub fn take_activations(&mut self) -> Option<DeviceActs> {
        let acts = self.acts.take()?;
        Some(DeviceActs { acts, drop: self.drop, count: self.count, loss_scale: self.loss_scale, docs: self.docs })
    }

    /// Puts a micro-batch's activations back (before its backward, or to reuse the buffers for
    /// the next forward), with what its backward reads of its forward.
    pub fn put_activations(&mut self, a: DeviceActs) {
        (self.drop, self.count, self.loss_scale, self.docs) = (a.drop, a.count, a.loss_scale, a.docs);
        let seed = self.drop.1;
        self.gpu.write_words(&self.scalars, DROPOUT_SEED, &[seed as u32, (seed >> 32) as u32]);
        self.acts = Some(a.acts);
    }
}
