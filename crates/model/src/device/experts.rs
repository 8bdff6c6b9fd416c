//! The routed experts of an MoE layer on a device, and expert parallelism (GShard: Lepikhin et
//! al. 2020; DeepSpeed-MoE: Rajbhandari et al. 2022; the model's `Placement::experts`).
//!
//! A whole model runs each of its experts over its packed rows with `gemm_ragged`, the row
//! offsets staying on the device. An expert-parallel part holds a block of the routed experts
//! and routes its own tokens over all of them; at each MoE layer it sends the dispatched rows to
//! the experts' owners and takes their outputs back through the host model's exchange
//! ([`tensor::moe::MoeExchange`], lent for the passes like the tensor-parallel hooks), the rows
//! staged through host memory: the per-expert counts exchanged, then a variable all-to-all each
//! way in forward, and again in backward — `tensor::moe`'s exchanges, in its order and with its
//! row order, so a part on a device computes what the CPU's part computes. The rows an owner
//! receives are held on its device expert-major (each local expert's rows from every source in
//! rank order) with the local experts' offsets, and its experts run over them as a whole model's
//! run over its own rows. Those buffers are sized for the worst case, every source's kept rows
//! for this part's experts (`P · min(N · min(K, El), El · cap)` rows), so a pass allocates
//! nothing and the memory plan counts them.

use super::{DeviceGpt, MoeActs, MoeScratch};
use crate::layout::MoeParams;
use crate::GptConfig;
use device::{Buf, DType, Gemm, Gpu, MatSpec, Ragged};
use std::cell::RefCell;
use tensor::moe::{ep_permute, ep_runs, local_offsets, per_peer, MoeExchange};

/// An expert-parallel part's shape for `N` tokens a pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct EpShape {
    /// The parts the experts are spread over, and the experts each holds.
    pub p: usize,
    pub el: usize,
    /// The most rows this part's experts can receive in a pass, and any one of them.
    pub rows: usize,
    pub per_expert: usize,
}

/// The shape of `cfg`'s expert-parallel part for `n` tokens; `None` for a model holding every
/// expert.
pub(super) fn ep_shape(cfg: &GptConfig, n: usize) -> Option<EpShape> {
    let el = cfg.place.experts.as_ref()?.len();
    let p = cfg.n_expert / el;
    let cap = cfg.moe_dims(n).capacity().min(n);
    let rows = p * (n * cfg.top_k.min(el)).min(el * cap);
    Some(EpShape { p, el, rows, per_expert: (p * cap).min(rows) })
}

/// The element counts of an expert-parallel part's buffers for `n` tokens: [`EpActs`]' (the
/// last its offsets, `u32`), then the backward scratch's received-row gradients; empty for a
/// whole model.
pub(super) fn ep_sizes(cfg: &GptConfig, n: usize) -> (Vec<usize>, Vec<usize>) {
    let Some(s) = ep_shape(cfg, n) else { return (Vec::new(), Vec::new()) };
    let (c, f) = (cfg.n_embd, cfg.ffn_hidden);
    (vec![s.rows * c, s.rows * 2 * f, s.rows * f, s.rows * c, s.el + 1], vec![s.rows * c])
}

/// An expert-parallel part's MoE activations: the rows its experts received, expert-major,
/// their `[gate | up]`, activations and outputs; the local experts' row offsets; and the
/// forward's counts, which backward's exchanges follow.
pub(super) struct EpActs {
    xl: Buf,
    gul: Buf,
    hl: Buf,
    eol: Buf,
    offsets: Buf,
    /// Rows sent to and received from each (part, local expert), `[P · El]` each.
    counts: RefCell<(Vec<usize>, Vec<usize>)>,
}

impl EpActs {
    pub(super) fn new(g: &Gpu, cfg: &GptConfig, n: usize) -> Option<EpActs> {
        let (z, _) = ep_sizes(cfg, n);
        (!z.is_empty()).then(|| EpActs {
            xl: g.zeros(z[0]),
            gul: g.zeros(z[1]),
            hl: g.zeros(z[2]),
            eol: g.zeros(z[3]),
            offsets: g.zeros_of(z[4], DType::U32),
            counts: RefCell::default(),
        })
    }
}

/// The rows an expert pass reads and writes: its inputs, `[gate | up]`, activations, outputs.
type ExpertRows<'a> = (&'a Buf, &'a Buf, &'a Buf, &'a Buf);

/// Row bounds of an expert pass: any one expert's rows, and all of them.
type Bounds = (usize, usize);

impl DeviceGpt {
    /// Swaps the part's expert exchange with `hooks` (the host model's `Hooks::experts`): a
    /// device run lends it for its passes and takes it back after. Through it an
    /// expert-parallel part reaches its experts' owners, and a data-parallel MoE model sums its
    /// load-balancing statistics over the ranks that split the batch.
    pub fn swap_expert_hooks(&mut self, hooks: &mut Option<Box<dyn MoeExchange + Send>>) {
        std::mem::swap(self.experts.get_mut(), hooks);
    }

    /// The routed experts' forward of an MoE layer, from its dispatched rows (`ma.xe`) to their
    /// outputs (`ma.eo`): on this device, or under expert parallelism on their owners'.
    /// Returns the rows sent to and received from other parts (zero on a whole model).
    pub(super) fn routed_forward(&self, mp: &MoeParams, ma: &MoeActs) -> (usize, usize) {
        let r = &ma.routing;
        let Some(ep) = &ma.ep else {
            let cap = self.cfg.moe_dims(r.n).capacity().min(r.n);
            self.experts_forward_on(mp, (&ma.xe, &ma.gu, &ma.h, &ma.eo), (&r.offsets, self.cfg.n_expert), (cap, r.n * r.k));
            return (0, 0);
        };
        let mut hooks = self.experts.borrow_mut();
        let ex = hooks.as_deref_mut().expect("an expert-parallel part runs with its exchange lent (DeviceGpt::swap_expert_hooks)");
        let (g, c, e) = (&*self.gpu, self.cfg.n_embd, self.cfg.n_expert);
        let s = ep_shape(&self.cfg, r.n).expect("an expert-parallel part");
        assert_eq!(ex.size(), s.p, "the expert exchange's group is not the part's");
        let off = g.download_words(&r.offsets, 0, e + 1);
        let send: Vec<usize> = (0..e).map(|j| (off[j + 1] - off[j]) as usize).collect();
        let mut recv = vec![0; e];
        ex.exchange_counts(&send, &mut recv);
        let (sent, received) = (per_peer(&send, s.el), per_peer(&recv, s.el));
        let (rows, rl) = (off[e] as usize, received.iter().sum::<usize>());
        // The kept rows to their experts' owners, arriving source-major, held expert-major.
        let runs = ep_runs(&recv, s.p, s.el);
        let mut staged = vec![0.0; rl * c];
        ex.exchange_rows(&g.download_f32(&ma.xe, 0, rows * c), &sent, &mut staged, &received, c);
        let mut xl = vec![0.0; rl * c];
        ep_permute(&mut xl, &staged, &runs, c, true);
        g.write_f32(&ep.xl, 0, &xl);
        let lo: Vec<u32> = local_offsets(&recv, s.p, s.el).iter().map(|&o| o as u32).collect();
        g.write_words(&ep.offsets, 0, &lo);
        self.experts_forward_on(mp, (&ep.xl, &ep.gul, &ep.hl, &ep.eol), (&ep.offsets, s.el), (s.per_expert, s.rows));
        // The outputs back to the rows' own parts, in their packed order.
        ep_permute(&mut staged, &g.download_f32(&ep.eol, 0, rl * c), &runs, c, false);
        let mut eo = vec![0.0; rows * c];
        ex.exchange_rows(&staged, &received, &mut eo, &sent, c);
        g.write_f32(&ma.eo, 0, &eo);
        let me = ex.rank();
        *ep.counts.borrow_mut() = (send, recv);
        (rows - sent[me], rl - received[me])
    }

    /// The routed experts' backward of an MoE layer: `ms.deo` holds the outputs' gradient on
    /// entry and the dispatched rows' on return; the experts' weight gradients accumulate
    /// (`train`). Under expert parallelism the gradients travel to the owners and back as the
    /// rows did in forward.
    pub(super) fn routed_backward(&self, mp: &MoeParams, (ma, ms): (&MoeActs, &MoeScratch), train: bool) {
        let r = &ma.routing;
        let (Some(ep), Some(dl)) = (&ma.ep, &ms.dl) else {
            let cap = self.cfg.moe_dims(r.n).capacity().min(r.n);
            let grads = (&ms.deo, &ms.dh, &ms.dgu);
            return self.experts_backward_on(mp, ((&ma.xe, &ma.gu, &ma.h), grads), (&r.offsets, self.cfg.n_expert), ((cap, r.n * r.k), train));
        };
        let mut hooks = self.experts.borrow_mut();
        let ex = hooks.as_deref_mut().expect("an expert-parallel part runs with its exchange lent (DeviceGpt::swap_expert_hooks)");
        let (g, c) = (&*self.gpu, self.cfg.n_embd);
        let s = ep_shape(&self.cfg, r.n).expect("an expert-parallel part");
        let (send, recv) = ep.counts.borrow().clone();
        let (sent, received) = (per_peer(&send, s.el), per_peer(&recv, s.el));
        let (rows, rl) = (sent.iter().sum::<usize>(), received.iter().sum::<usize>());
        let runs = ep_runs(&recv, s.p, s.el);
        let mut staged = vec![0.0; rl * c];
        ex.exchange_rows(&g.download_f32(&ms.deo, 0, rows * c), &sent, &mut staged, &received, c);
        let mut d = vec![0.0; rl * c];
        ep_permute(&mut d, &staged, &runs, c, true);
        g.write_f32(dl, 0, &d);
        let grads = (dl, &ms.dh, &ms.dgu);
        self.experts_backward_on(mp, ((&ep.xl, &ep.gul, &ep.hl), grads), (&ep.offsets, s.el), ((s.per_expert, s.rows), train));
        ep_permute(&mut staged, &g.download_f32(dl, 0, rl * c), &runs, c, false);
        let mut deo = vec![0.0; rows * c];
        ex.exchange_rows(&staged, &received, &mut deo, &sent, c);
        g.write_f32(&ms.deo, 0, &deo);
    }

    /// This model's first `experts` routed experts over their packed rows (`offsets`, `u32`
    /// `[experts + 1]` on the device): `[gate | up]`, SwiGLU, the down projection.
    fn experts_forward_on(&self, mp: &MoeParams, (x, gu, h, out): ExpertRows, (offsets, experts): (&Buf, usize), (one, _): Bounds) {
        let (g, c, f) = (&*self.gpu, self.cfg.n_embd, self.cfg.ffn_hidden);
        let (es, rows) = (3 * f * c, |cols: usize| MatSpec::rows(0, cols));
        for ex in 0..experts {
            let w = mp.experts.start + ex * es;
            g.gemm_ragged(Gemm::new(one, 2 * f, c), (gu, rows(2 * f)), (x, rows(c)), self.wm(w, c, true), Ragged::Rows, (offsets, ex));
        }
        g.swiglu_forward(h, gu, f);
        for ex in 0..experts {
            let w2 = mp.experts.start + ex * es + 2 * f * c;
            g.gemm_ragged(Gemm::new(one, c, f), (out, rows(c)), (h, rows(f)), self.wm(w2, f, true), Ragged::Rows, (offsets, ex));
        }
    }

    /// The backward of [`DeviceGpt::experts_forward_on`]: `deo` holds the outputs' gradient on
    /// entry and the inputs' on return (`dh`, `dgu` scratch of as many rows); the weights'
    /// gradients accumulate when `train`.
    #[allow(clippy::type_complexity)]
    fn experts_backward_on(&self, mp: &MoeParams, ((x, gu, h), (deo, dh, dgu)): ((&Buf, &Buf, &Buf), (&Buf, &Buf, &Buf)), (offsets, experts): (&Buf, usize), ((one, all), train): (Bounds, bool)) {
        let (g, c, f) = (&*self.gpu, self.cfg.n_embd, self.cfg.ffn_hidden);
        let (es, rows) = (3 * f * c, |cols: usize| MatSpec::rows(0, cols));
        for ex in 0..experts {
            let w2 = mp.experts.start + ex * es + 2 * f * c;
            g.gemm_ragged(Gemm::new(one, f, c), (dh, rows(f)), (deo, rows(c)), self.wm(w2, f, false), Ragged::Rows, (offsets, ex));
            if train {
                g.gemm_ragged(Gemm::new(c, f, all).acc(), self.gm(w2, f), (deo, rows(c).t()), (h, rows(f)), Ragged::Inner, (offsets, ex));
            }
        }
        g.swiglu_backward(dgu, dh, gu, f, false);
        for ex in 0..experts {
            let w = mp.experts.start + ex * es;
            if train {
                g.gemm_ragged(Gemm::new(2 * f, c, all).acc(), self.gm(w, c), (dgu, rows(2 * f).t()), (x, rows(c)), Ragged::Inner, (offsets, ex));
            }
            g.gemm_ragged(Gemm::new(one, c, 2 * f), (deo, rows(c)), (dgu, rows(2 * f)), self.wm(w, c, false), Ragged::Rows, (offsets, ex));
        }
    }
}

