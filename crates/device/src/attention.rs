//! Causal attention on the device in the FlashAttention-2 style (`tensor::flash`'s twin):
//! tiled, an online softmax, only the per-row log-sum-exp saved, no `T×T` matrix in memory;
//! grouped-query heads, a sliding window, packed documents and attention dropout with the CPU's
//! masks.

use crate::kernels::u;
use crate::shader::{kernel, Kernel};
use crate::{Buf, Gpu, Seed};
use tensor::attention::AttnDropout;
use tensor::llama::GqaDims;

const FORWARD: Kernel = kernel!("flash_forward", libs ["rng", "attn"], ["OUT", "LSE", "QKV", "STARTS", "SEED"], writes ["OUT", "LSE"]);
const D: Kernel = kernel!("flash_d", ["DD", "DY", "Y"], writes ["DD"]);
const BACKWARD_DQ: Kernel = kernel!("flash_backward_dq", libs ["rng", "attn"], ["DQKV", "DY", "QKV", "LSE", "DD", "STARTS", "SEED"], writes ["DQKV"]);
const BACKWARD_DKV: Kernel = kernel!("flash_backward_dkv", libs ["rng", "attn"], ["DQKV", "DY", "QKV", "LSE", "DD", "STARTS", "SEED"], writes ["DQKV"]);

const DECODE: Kernel = kernel!("attention_decode", ["OUT", "Q", "K", "V"], writes ["OUT"]);
/// This module's kernels (the CUDA build compiles each).
pub(crate) const KERNELS: &[&Kernel] = &[&FORWARD, &D, &BACKWARD_DQ, &BACKWARD_DKV, &DECODE];

/// The largest head size the attention kernels hold in registers.
pub const MAX_HEAD_SIZE: usize = 128;

/// The shared argument list (`wgsl/lib_attn.wgsl`).
fn args(d: &GqaDims, starts: Option<&Buf>, p: f32, seed: Seed) -> Vec<u32> {
    assert!(d.hs <= MAX_HEAD_SIZE, "device attention holds heads of at most {MAX_HEAD_SIZE}, not {}", d.hs);
    assert!(d.sinks == 0, "attention sinks do not run on the device yet");
    assert!((0.0..1.0).contains(&p), "attention dropout p must be in [0, 1)");
    let heads = if d.heads == 0 { d.nh } else { d.heads };
    #[rustfmt::skip]
    let a = vec![
        u(d.b), u(d.t), u(d.nh), u(d.nkv), u(d.hs), u(d.window), starts.is_some() as u32,
        p.to_bits(), (1.0 / (1.0 - p)).to_bits(), u(seed.at), seed.site.unwrap_or(0),
        u(heads), u(d.head0), u(d.b0), (1.0 / (d.hs as f32).sqrt()).to_bits(), seed.site.is_some() as u32,
    ];
    a
}

fn check(d: &GqaDims, qkv: &Buf, starts: Option<&Buf>) {
    assert!(d.nkv > 0 && d.nh.is_multiple_of(d.nkv), "NH must be a multiple of NKV");
    assert!(qkv.len() >= d.b * d.t * d.qkv_width(), "attention: qkv is shorter than [B, T, W]");
    assert!(starts.is_none_or(|s| s.len() == d.b * d.t), "attention: document starts must be [B, T]");
}

impl Gpu {
    /// `out[b, i, h·HS..] = Σ_j dropout(softmax_j(q_h,i·k_g,j/√HS))·v_g,j` over the keys query
    /// `i` sees (causal, the sliding window, its document), and `lse[b·NH + h, i]`, the log-sum-exp
    /// of its scores: `tensor::flash::flash_gqa_forward_docs`. Overwrites `out` and `lse`.
    pub fn flash_forward(&self, out: &Buf, lse: &Buf, qkv: &Buf, d: &GqaDims, starts: Option<&Buf>, dropout: AttnDropout) {
        self.flash_forward_seeded(out, lse, qkv, d, starts, (dropout.p, self.direct_seed(dropout.seed)));
    }

    /// [`Gpu::flash_forward`] with the dropout seed read on the device.
    pub fn flash_forward_seeded(&self, out: &Buf, lse: &Buf, qkv: &Buf, d: &GqaDims, starts: Option<&Buf>, (p, seed): (f32, Seed)) {
        check(d, qkv, starts);
        assert!(out.len() >= d.b * d.t * d.c() && lse.len() >= d.b * d.nh * d.t, "flash_forward: shapes");
        let groups = [u(d.t.div_ceil(64)), u(d.b * d.nh), 1];
        self.launch(&FORWARD, groups, &args(d, starts, p, seed), &[Some(out), Some(lse), Some(qkv), starts, Some(seed.buf)]);
    }

    /// Backward of [`Gpu::flash_forward`] (`tensor::flash::flash_gqa_backward_docs`):
    /// accumulates into `dqkv`; `out` and `lse` are the forward's, `scratch` holds `[B, NH, T]`
    /// (FlashAttention-2's `D = rowsum(dO ⊙ O)`). A kv head's `dk`, `dv` sum over its group's
    /// query heads in ascending order.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_backward(&self, dqkv: &Buf, scratch: &Buf, dout: &Buf, saved: (&Buf, &Buf, &Buf), d: &GqaDims, starts: Option<&Buf>, dropout: AttnDropout) {
        self.flash_backward_seeded(dqkv, scratch, dout, saved, d, starts, (dropout.p, self.direct_seed(dropout.seed)));
    }

    /// [`Gpu::flash_backward`] with the dropout seed read on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_backward_seeded(&self, dqkv: &Buf, scratch: &Buf, dout: &Buf, saved: (&Buf, &Buf, &Buf), d: &GqaDims, starts: Option<&Buf>, (p, seed): (f32, Seed)) {
        let (qkv, out, lse) = saved;
        check(d, qkv, starts);
        let n = d.b * d.nh * d.t;
        assert!(dqkv.len() >= d.b * d.t * d.qkv_width() && scratch.len() >= n && dout.len() >= d.b * d.t * d.c(), "flash_backward: shapes");
        self.launch(&D, Gpu::grid(n, 64), &[u(d.b), u(d.t), u(d.nh), u(d.hs)], &[Some(scratch), Some(dout), Some(out)]);
        let a = args(d, starts, p, seed);
        let bufs = [Some(dqkv), Some(dout), Some(qkv), Some(lse), Some(scratch), starts, Some(seed.buf)];
        self.launch(&BACKWARD_DQ, [u(d.t.div_ceil(64)), u(d.b * d.nh), 1], &a, &bufs);
        self.launch(&BACKWARD_DKV, [u(d.t.div_ceil(64)), u(d.b * d.nkv), 1], &a, &bufs);
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
