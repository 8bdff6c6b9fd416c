//! Causal attention on the device in the FlashAttention-2 style (`tensor::flash`'s twin):
//! tiled, an online softmax, only the per-row log-sum-exp saved, no `T×T` matrix in memory;
//! grouped-query heads, a sliding window, packed documents and attention dropout with the CPU's
//! masks.

use crate::kernels::u;
use crate::shader::{kernel, Kernel};
use crate::{Buf, Gpu, Seed};
use tensor::attention::AttnDropout;
use tensor::flash::Span;
use tensor::llama::GqaDims;

const FORWARD: Kernel = kernel!("flash_forward", libs ["rng", "attn"], ["OUT", "LSE", "QKV", "KV", "STARTS", "SEED"], writes ["OUT", "LSE"]);
const D: Kernel = kernel!("flash_d", ["DD", "DY", "Y"], writes ["DD"]);
const BACKWARD_DQ: Kernel = kernel!("flash_backward_dq", libs ["rng", "attn"], ["DQ", "DY", "QKV", "KV", "LSE", "DD", "STARTS", "SEED"], writes ["DQ"]);
const BACKWARD_DKV: Kernel = kernel!("flash_backward_dkv", libs ["rng", "attn"], ["DKV", "DY", "QKV", "KV", "LSE", "DD", "STARTS", "SEED"], writes ["DKV"]);

const DECODE: Kernel = kernel!("attention_decode", ["OUT", "Q", "K", "V"], writes ["OUT"]);
/// This module's kernels (the CUDA build compiles each).
pub(crate) const KERNELS: &[&Kernel] = &[&FORWARD, &D, &BACKWARD_DQ, &BACKWARD_DKV, &DECODE];

/// The largest head size the attention kernels hold in registers.
pub const MAX_HEAD_SIZE: usize = 128;

/// The keys and values of a block of attention (`tensor::flash::Block`'s): rows `span` of
/// `buf`, `[B, span.rows, kw]`, kv head `g`'s key at column `kc + g·HS` and its value at
/// `vc + g·HS`, at positions from `span.pos0`.
#[derive(Clone, Copy)]
pub struct KvBlock<'a> {
    pub buf: &'a Buf,
    pub span: Span,
    pub kw: usize,
    pub kc: usize,
    pub vc: usize,
}

impl<'a> KvBlock<'a> {
    /// The keys and values of a whole `[B, T, W]` q|k|v buffer.
    pub fn whole(qkv: &'a Buf, d: &GqaDims) -> KvBlock<'a> {
        KvBlock { buf: qkv, span: Span::whole(d.t), kw: d.qkv_width(), kc: d.nh * d.hs, vc: (d.nh + d.nkv) * d.hs }
    }
}

/// The shared argument list (`wgsl/lib_attn.wgsl`): the shapes, the dropout mask's, and the
/// block's queries `q` and keys `kv`; `fresh` starts the softmax anew.
fn args(d: &GqaDims, starts: Option<&Buf>, (p, seed): (f32, Seed), (q, kv, fresh): (Span, &KvBlock, bool)) -> Vec<u32> {
    assert!(d.hs <= MAX_HEAD_SIZE, "device attention holds heads of at most {MAX_HEAD_SIZE}, not {}", d.hs);
    assert!(d.sinks == 0, "attention sinks do not run on the device yet");
    assert!((0.0..1.0).contains(&p), "attention dropout p must be in [0, 1)");
    let heads = if d.heads == 0 { d.nh } else { d.heads };
    let k = kv.span;
    #[rustfmt::skip]
    let a = vec![
        u(d.b), u(d.t), u(d.nh), u(d.nkv), u(d.hs), u(d.window), starts.is_some() as u32,
        p.to_bits(), (1.0 / (1.0 - p)).to_bits(), u(seed.at), seed.site.unwrap_or(0),
        u(heads), u(d.head0), u(d.b0), (1.0 / (d.hs as f32).sqrt()).to_bits(), seed.site.is_some() as u32,
        u(q.rows), u(q.row0), u(q.len), u(q.pos0), u(k.rows), u(k.row0), u(k.len), u(k.pos0),
        u(kv.kw), u(kv.kc), u(kv.vc), fresh as u32,
    ];
    a
}

/// Panics unless the buffers hold the block's spans and the spans fit the sequence.
fn check(d: &GqaDims, (qkv, q): (&Buf, Span), kv: &KvBlock, starts: Option<&Buf>) {
    let k = kv.span;
    assert!(d.nkv > 0 && d.nh.is_multiple_of(d.nkv), "NH must be a multiple of NKV");
    assert!(q.row0 + q.len <= q.rows && k.row0 + k.len <= k.rows, "attention: block spans exceed their buffers");
    assert!(q.pos0 + q.len <= d.t && k.pos0 + k.len <= d.t, "attention: block spans exceed the sequence of {}", d.t);
    assert!(qkv.len() >= d.b * q.rows * d.qkv_width(), "attention: qkv is shorter than [B, q.rows, W]");
    assert!(kv.buf.len() >= d.b * k.rows * kv.kw && kv.kc.max(kv.vc) + d.nkv * d.hs <= kv.kw, "attention: kv is shorter than [B, k.rows, kw]");
    assert!(starts.is_none_or(|s| s.len() == d.b * q.rows), "attention: document starts must be [B, q.rows]");
}

impl Gpu {
    /// `out[b, i, h·HS..] = Σ_j dropout(softmax_j(q_h,i·k_g,j/√HS))·v_g,j` over the keys query
    /// `i` sees (causal, the sliding window, its document), and `lse[b·NH + h, i]`, the log-sum-exp
    /// of its scores: `tensor::flash::flash_gqa_forward_docs`. Overwrites `out` and `lse`.
    pub fn flash_forward(&self, out: &Buf, lse: &Buf, qkv: &Buf, d: &GqaDims, starts: Option<&Buf>, dropout: AttnDropout) {
        self.flash_forward_seeded(out, lse, qkv, d, starts, (dropout.p, self.direct_seed(dropout.seed)));
    }

    /// [`Gpu::flash_forward`] with the dropout seed read on the device.
    pub fn flash_forward_seeded(&self, out: &Buf, lse: &Buf, qkv: &Buf, d: &GqaDims, starts: Option<&Buf>, dropout: (f32, Seed)) {
        self.flash_block_forward((out, lse), (qkv, Span::whole(d.t)), KvBlock::whole(qkv, d), (d, starts), dropout, true);
    }

    /// A block of attention (`tensor::flash::flash_gqa_block_forward`): the queries at rows `q`
    /// of `qkv` (`[B, q.rows, W]`) against the keys and values of `kv`, masked by global
    /// position (causal, the sliding window, the documents: `starts` `[B, q.rows]` of global
    /// positions), dropout drawn by global position in the whole sequence of `d.t`. Writes
    /// `out` `[B, q.rows, C]` and `lse` `[B·NH, q.rows]` at the query rows; unless `fresh` the
    /// softmax continues from what they hold (an earlier block's: a ring of context-parallel
    /// blocks merges so).
    pub fn flash_block_forward(&self, (out, lse): (&Buf, &Buf), (qkv, q): (&Buf, Span), kv: KvBlock, (d, starts): (&GqaDims, Option<&Buf>), (p, seed): (f32, Seed), fresh: bool) {
        check(d, (qkv, q), &kv, starts);
        assert!(out.len() >= d.b * q.rows * d.c() && lse.len() >= d.b * d.nh * q.rows, "flash_forward: shapes");
        let groups = [u(q.len.div_ceil(64)), u(d.b * d.nh), 1];
        let a = args(d, starts, (p, seed), (q, &kv, fresh));
        self.launch(&FORWARD, groups, &a, &[Some(out), Some(lse), Some(qkv), Some(kv.buf), starts, Some(seed.buf)]);
    }

    /// Backward of [`Gpu::flash_forward`] (`tensor::flash::flash_gqa_backward_docs`):
    /// accumulates into `dqkv`; `out` and `lse` are the forward's, `scratch` holds `[B, NH, T]`
    /// (FlashAttention-2's `D = rowsum(dO ⊙ O)`). A kv head's `dk`, `dv` sum over its group's
    /// query heads in ascending order.
    pub fn flash_backward(&self, dqkv: &Buf, scratch: &Buf, dout: &Buf, saved: (&Buf, &Buf, &Buf), (d, starts): (&GqaDims, Option<&Buf>), dropout: AttnDropout) {
        self.flash_backward_seeded(dqkv, scratch, dout, saved, (d, starts), (dropout.p, self.direct_seed(dropout.seed)));
    }

    /// [`Gpu::flash_backward`] with the dropout seed read on the device.
    pub fn flash_backward_seeded(&self, dqkv: &Buf, scratch: &Buf, dout: &Buf, saved: (&Buf, &Buf, &Buf), (d, starts): (&GqaDims, Option<&Buf>), dropout: (f32, Seed)) {
        let (qkv, out, lse) = saved;
        assert!(dqkv.len() >= d.b * d.t * d.qkv_width(), "flash_backward: shapes");
        self.flash_d(scratch, dout, out, d, d.t);
        let kv = KvBlock::whole(qkv, d);
        self.flash_block_backward((dqkv, dqkv), (scratch, dout), (qkv, lse, Span::whole(d.t)), kv, (d, starts), dropout);
    }

    /// FlashAttention-2's `D[b·NH + h, i] = dO_i · O_i` over `rows` rows of `dout` and `out`
    /// (`[B, rows, C]`) into `dd` (`[B·NH, rows]`): what a block's backward reads
    /// (`tensor::flash::flash_d`).
    pub fn flash_d(&self, dd: &Buf, dout: &Buf, out: &Buf, d: &GqaDims, rows: usize) {
        let n = d.b * d.nh * rows;
        assert!(dd.len() >= n && dout.len() >= d.b * rows * d.c() && out.len() >= d.b * rows * d.c(), "flash_d: shapes");
        self.launch(&D, Gpu::grid(n, 64), &[u(d.b), u(rows), u(d.nh), u(d.hs)], &[Some(dd), Some(dout), Some(out)]);
    }

    /// Backward of [`Gpu::flash_block_forward`] (`tensor::flash::flash_gqa_block_backward`),
    /// given the attention's final `lse` and [`Gpu::flash_d`]'s `dd` at the query rows:
    /// accumulates `dq` into the q columns of `dq` (laid out as `qkv`) and `dk`, `dv` into the
    /// kv columns of `dkv` (laid out as `kv.buf`). A kv head's `dk`, `dv` sum over its group's
    /// query heads in ascending order.
    pub fn flash_block_backward(&self, (dq, dkv): (&Buf, &Buf), (dd, dout): (&Buf, &Buf), (qkv, lse, q): (&Buf, &Buf, Span), kv: KvBlock, (d, starts): (&GqaDims, Option<&Buf>), (p, seed): (f32, Seed)) {
        check(d, (qkv, q), &kv, starts);
        let n = d.b * d.nh * q.rows;
        assert!(dq.len() >= d.b * q.rows * d.qkv_width() && dkv.len() >= d.b * kv.span.rows * kv.kw, "flash_backward: gradient shapes");
        assert!(dd.len() >= n && lse.len() >= n && dout.len() >= d.b * q.rows * d.c(), "flash_backward: shapes");
        let a = args(d, starts, (p, seed), (q, &kv, false));
        let ins = [Some(dout), Some(qkv), Some(kv.buf), Some(lse), Some(dd), starts, Some(seed.buf)];
        self.launch(&BACKWARD_DQ, [u(q.len.div_ceil(64)), u(d.b * d.nh), 1], &a, &[&[Some(dq)][..], &ins].concat());
        self.launch(&BACKWARD_DKV, [u(kv.span.len.div_ceil(64)), u(d.b * d.nkv), 1], &a, &[&[Some(dkv)][..], &ins].concat());
    }
}

impl Gpu {
    /// One token's attention over a KV cache (`tensor::attention::attention_decode`'s twin):
    /// `q` `[NH·HS]` against the cached rows `0 .. d.t` of `k`, `v` (`[max_t, NKV·HS]` from
    /// element `at`: one layer's slice), the sliding window's (`d.window`) only. Overwrites
    /// `out` `[NH·HS]`.
    pub fn attention_decode(&self, out: &Buf, q: &Buf, kv: (&Buf, &Buf), at: usize, d: &GqaDims) {
        assert!(d.sinks == 0, "attention sinks do not run on the device yet");
        assert!(d.t >= 1 && d.nkv > 0 && d.nh.is_multiple_of(d.nkv), "attention_decode: dims");
        assert!(kv.0.len() >= at + d.t * d.nkv * d.hs && out.len() >= d.c() && q.len() >= d.c(), "attention_decode: shapes");
        let first = d.first_key(d.t - 1);
        let args = [u(d.nh), u(d.nkv), u(d.hs), u(d.t), u(first), u(at), (1.0 / (d.hs as f32).sqrt()).to_bits()];
        self.launch(&DECODE, Gpu::grid(d.nh, 32), &args, &[Some(out), Some(q), Some(kv.0), Some(kv.1)]);
    }
}
