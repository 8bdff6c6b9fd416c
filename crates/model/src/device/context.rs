//! A context-parallel part on a device (ring attention: Liu et al. 2023; Megatron-LM's context
//! parallelism; the model's `Placement::context`): the part is given whole rows and runs on its
//! positions of every sequence (one contiguous chunk, or two under the zig-zag split), each
//! token keeping its global position for RoPE, the position table, the masks and dropout.
//! Everything but attention is per position, so it runs unchanged on the part's rows.
//!
//! Attention is the ring `parallel::cp` runs on the CPU, with the device's block kernels
//! (`Gpu::flash_block_forward` / `flash_block_backward`): the part's keys and values, packed
//! `[B, T/cp, 2·NKV·HS]` on the host, pass around the group through the host model's hooks
//! ([`crate::units::CpHooks`], lent for the passes), and at each step its query chunks attend to
//! the block it holds, in [`crate::placement::ContextSlice::ring_blocks`]' order, merging
//! through the running log-sum-exp. Backward passes the blocks around again with their
//! gradients' accumulator, which arrives home after one more hop and is added into the part's
//! key and value gradients — the CPU ring's order, so a device part computes what the CPU's
//! computes. Under Ulysses the host hooks' all-to-alls run around the device's whole-sequence
//! kernel over the part's heads ([`crate::units::CpHooks::heads_forward`]).

use super::{Acts, DeviceGpt};
use crate::config::ContextSlice;
use crate::units::CpHooks;
use crate::Docs;
use device::{Buf, KvBlock, Seed};
use tensor::flash::{pack_kv, unpack_kv_add};
use tensor::llama::GqaDims;

impl DeviceGpt {
    /// Swaps the part's context-parallel hooks with `hooks` (the host model's
    /// `Hooks::context`): a device run lends them for its passes and takes them back after.
    pub fn swap_context_hooks(&mut self, hooks: &mut Option<Box<dyn CpHooks>>) {
        std::mem::swap(self.context.get_mut(), hooks);
    }

    /// The forward of `tokens` (`[B, T]`, whole rows) on this part's positions: its rows of
    /// the tokens, targets and documents, each with its global position (plain causal rows:
    /// every document starting at 0).
    pub(super) fn forward_context(&mut self, tokens: &[u32], targets: &[i32], docs: Option<Docs>, b: usize, t: usize, pass: crate::Pass) -> usize {
        let cx = self.cfg.place.context.expect("a context-parallel part");
        let (tk, tg) = (cx.rows(tokens, b, t), cx.rows(targets, b, t));
        let (start, pos) = match docs {
            Some(d) => (cx.rows(d.start, b, t), cx.rows(d.pos, b, t)),
            None => {
                let p: Vec<u32> = cx.positions(t).into_iter().map(|p| p as u32).collect();
                (vec![0; b * p.len()], (0..b).flat_map(|_| p.iter().copied()).collect())
            }
        };
        self.forward_rows(&tk, &tg, Some(Docs { start: &start, pos: &pos }), b, t / cx.count, pass)
    }

    /// Attention's forward into `out` and `lse` from `qkv` (rotated): the whole-sequence
    /// kernel, or on a context-parallel part the ring (or Ulysses' exchanges).
    pub(super) fn attention_forward(&self, (out, lse): (&Buf, &Buf), qkv: &Buf, d: &GqaDims, a: &Acts, seed: (f32, Seed)) {
        let starts = self.docs.then_some(&a.starts);
        let Some((kv, _)) = &a.ring else {
            return self.gpu.flash_forward_seeded(out, lse, qkv, d, starts, seed);
        };
        let mut hooks = self.context.borrow_mut();
        let (h, cx, gd) = ring(&mut hooks, self.cfg.place.context, d);
        if !h.is_ring() {
            return self.heads_forward(h, (out, lse), qkv, d, a, seed);
        }
        let (g, n) = (&*self.gpu, cx.count);
        let mut cur = pack_kv(&g.download_f32(qkv, 0, d.b * d.t * d.qkv_width()), d);
        let mut next = vec![0.0; cur.len()];
        for s in 0..n {
            if s + 1 < n {
                h.send_next(&cur, false);
            }
            g.write(kv, &cur);
            for (q, k) in cx.ring_blocks(s, gd.t, (d.window, d.sinks)) {
                g.flash_block_forward((out, lse), (qkv, q), packed(kv, k, d), (&gd, starts), seed, s == 0 && q == k);
            }
            if s + 1 < n {
                h.recv_prev(&mut next, false);
                std::mem::swap(&mut cur, &mut next);
            }
        }
    }

    /// Attention's backward: accumulates into `dqkv` (zero on entry) from `dout`, given the
    /// forward's `qkv`, `out` and `lse`; `dd` is scratch `[B, NH, T]`.
    pub(super) fn attention_backward(&self, (dqkv, dd): (&Buf, &Buf), dout: &Buf, (qkv, out, lse): (&Buf, &Buf, &Buf), d: &GqaDims, a: &Acts, seed: (f32, Seed)) {
        let starts = self.docs.then_some(&a.starts);
        let Some((kv, dkv)) = &a.ring else {
            return self.gpu.flash_backward_seeded(dqkv, dd, dout, (qkv, out, lse), (d, starts), seed);
        };
        let mut hooks = self.context.borrow_mut();
        let (h, cx, gd) = ring(&mut hooks, self.cfg.place.context, d);
        if !h.is_ring() {
            return self.heads_backward(h, (dqkv, dout), (qkv, out, lse), d, a, seed);
        }
        let (g, n) = (&*self.gpu, cx.count);
        g.flash_d(dd, dout, out, d, d.t);
        let len = d.b * d.t * d.qkv_width();
        let mut cur = pack_kv(&g.download_f32(qkv, 0, len), d);
        let (mut next, mut dnext) = (vec![0.0; cur.len()], vec![0.0; cur.len()]);
        g.clear(dkv);
        for s in 0..n {
            if s + 1 < n {
                h.send_next(&cur, false);
            }
            g.write(kv, &cur);
            for (q, k) in cx.ring_blocks(s, gd.t, (d.window, d.sinks)) {
                g.flash_block_backward((dqkv, dkv), (dd, dout), (qkv, lse, q), packed(kv, k, d), (&gd, starts), seed);
            }
            // The gradient of the keys just used travels on with them (after the last step:
            // home, to the next part, whose keys they are).
            h.send_next(&g.download_f32(dkv, 0, cur.len()), true);
            h.recv_prev(&mut dnext, true);
            g.write(dkv, &dnext);
            if s + 1 < n {
                h.recv_prev(&mut next, false);
                std::mem::swap(&mut cur, &mut next);
            }
        }
        let mut host = g.download(dqkv);
        unpack_kv_add(&mut host[..len], &dnext, d);
        g.write(dqkv, &host);
    }
}

/// The lent hooks, the part's slice, and the whole sequence's attention dims.
fn ring<'h>(hooks: &'h mut Option<Box<dyn CpHooks>>, slice: Option<ContextSlice>, d: &GqaDims) -> (&'h mut dyn CpHooks, ContextSlice, GqaDims) {
    let h = hooks.as_deref_mut().expect("a context-parallel part runs with its hooks lent (DeviceGpt::swap_context_hooks)");
    let cx = slice.expect("a context-parallel part");
    (h, cx, GqaDims { t: d.t * cx.count, ..*d })
}

impl DeviceGpt {
    /// Ulysses' forward on a device: the host hooks' all-to-alls (this part's positions of
    /// every head to every position of its heads, and back) around the device's
    /// whole-sequence kernel over its heads, each layer's exchanged buffers staged for the call.
    fn heads_forward(&self, h: &mut dyn CpHooks, (out, lse): (&Buf, &Buf), qkv: &Buf, d: &GqaDims, a: &Acts, seed: (f32, Seed)) {
        let g = &*self.gpu;
        let n = d.b * d.t;
        let starts = self.starts_of(a, n);
        let (mut o, mut l) = (vec![0.0; n * d.c()], vec![0.0; d.b * d.nh * d.t]);
        h.heads_forward(&mut o, &mut l, &g.download_f32(qkv, 0, n * d.qkv_width()), d, &starts, &mut |hf| {
            let (gq, go, gl) = (g.upload(hf.qkv), g.zeros(hf.out.len()), g.zeros(hf.lse.len()));
            let gs = (!hf.starts.is_empty()).then(|| g.upload_u32(hf.starts));
            g.flash_forward_seeded(&go, &gl, &gq, &hf.dims, gs.as_ref(), seed);
            hf.out.copy_from_slice(&g.download(&go));
            hf.lse.copy_from_slice(&g.download(&gl));
        });
        g.write(out, &o);
        g.write(lse, &l);
    }

    /// Ulysses' backward on a device: accumulates into `dqkv` (zero on entry).
    fn heads_backward(&self, h: &mut dyn CpHooks, (dqkv, dout): (&Buf, &Buf), (qkv, out, lse): (&Buf, &Buf, &Buf), d: &GqaDims, a: &Acts, seed: (f32, Seed)) {
        let g = &*self.gpu;
        let n = d.b * d.t;
        let starts = self.starts_of(a, n);
        let (w, c) = (d.qkv_width(), d.c());
        let mut dq = vec![0.0; n * w];
        let (q, dy, y, l) = (g.download_f32(qkv, 0, n * w), g.download_f32(dout, 0, n * c), g.download_f32(out, 0, n * c), g.download_f32(lse, 0, d.b * d.nh * d.t));
        h.heads_backward(&mut dq, &dy, (&q, &y, &l), d, &starts, &mut |hb| {
            let (gq, gdy, gl, gd, gdq) = (g.upload(hb.qkv), g.upload(hb.dout), g.upload(hb.lse), g.upload(hb.d), g.zeros(hb.dqkv.len()));
            let gs = (!hb.starts.is_empty()).then(|| g.upload_u32(hb.starts));
            let whole = tensor::flash::Span::whole(hb.dims.t);
            g.flash_block_backward((&gdq, &gdq), (&gd, &gdy), (&gq, &gl, whole), KvBlock::whole(&gq, &hb.dims), (&hb.dims, gs.as_ref()), seed);
            hb.dqkv.iter_mut().zip(g.download(&gdq)).for_each(|(x, v)| *x += v);
        });
        let mut host = g.download(dqkv);
        host[..n * w].iter_mut().zip(&dq).for_each(|(x, v)| *x += v);
        g.write(dqkv, &host);
    }

    /// The pass's document starts (global positions, `[B, T]`), or none.
    fn starts_of(&self, a: &Acts, n: usize) -> Vec<u32> {
        if self.docs { self.gpu.download_words(&a.starts, 0, n) } else { Vec::new() }
    }
}

/// Rows `k` of the packed keys and values in `kv` (`[B, T/cp, 2·NKV·HS]`).
fn packed<'a>(kv: &'a Buf, k: tensor::flash::Span, d: &GqaDims) -> KvBlock<'a> {
    let kw = 2 * d.nkv * d.hs;
    KvBlock { buf: kv, span: k, kw, kc: 0, vc: kw / 2 }
}
