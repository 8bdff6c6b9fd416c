//! The device twins of `tensor::ops` and `tensor::llama`'s elementwise and row-wise kernels:
//! embedding, LayerNorm and RMSNorm, GELU, SiLU and SwiGLU, residual, RoPE and dropout. Same
//! names, argument order and conventions as the CPU functions; parameters are views ([`At`]) of
//! one flat buffer.

use crate::kernels::u;
use crate::shader::{kernel, Kernel};
use crate::{At, Buf, Gpu, Seed};
use tensor::llama::GqaDims;
use tensor::ops::RowMap;
use std::ops::Range;

const EMBEDDING_FORWARD: Kernel = kernel!("embedding_forward", ["OUT", "TOK", "P", "POS"], writes ["OUT"]);
const EMBEDDING_BACKWARD: Kernel = kernel!("embedding_backward", ["DP", "D", "TOK", "POS"], writes ["DP"]);
const NORM_FORWARD: Kernel = kernel!("layernorm_forward", libs ["reduce"], ["OUT", "MEAN", "RSTD", "X", "P"], writes ["OUT", "MEAN", "RSTD"]);
const NORM_BACKWARD: Kernel = kernel!("layernorm_backward", libs ["reduce"], ["DX", "D", "X", "P", "MEAN", "RSTD"], writes ["DX"]);
const NORM_PARAMS: Kernel = kernel!("layernorm_params", ["DP", "D", "X", "MEAN", "RSTD"], writes ["DP"]);
const GELU: Kernel = kernel!("gelu", ["OUT", "X", "D"], writes ["OUT"]);
const SILU: Kernel = kernel!("silu", ["OUT", "X", "D"], writes ["OUT"]);
const SWIGLU: Kernel = kernel!("swiglu", ["OUT", "GU", "D"], writes ["OUT"]);
const ADD: Kernel = kernel!("add", ["OUT", "A", "B"], writes ["OUT"]);
const ROPE: Kernel = kernel!("rope", ["X", "COS", "SIN", "POS"], writes ["X"]);
const DROPOUT: Kernel = kernel!("dropout", libs ["rng"], ["OUT", "IN", "SEED"], writes ["OUT"]);
/// This module's kernels (the CUDA build compiles each).
pub(crate) const KERNELS: &[&Kernel] = &[&EMBEDDING_FORWARD, &EMBEDDING_BACKWARD, &NORM_FORWARD, &NORM_BACKWARD, &NORM_PARAMS, &GELU, &SILU, &SWIGLU, &ADD, &ROPE, &DROPOUT];

/// Forward, backward overwriting, or backward accumulating: the elementwise kernels' modes.
#[derive(Clone, Copy)]
enum Mode {
    Forward = 0,
    Into = 1,
    Accumulate = 2,
}

fn mode(accumulate: bool) -> Mode {
    if accumulate {
        Mode::Accumulate
    } else {
        Mode::Into
    }
}

/// Every row of a token table (no vocabulary shard).
pub const ALL_ROWS: Range<usize> = 0..u32::MAX as usize;

impl Gpu {
    /// `out[i] = wte[tokens[i]] + wpe[i mod T]` over `tokens.len()` rows of `c`
    /// (`tensor::embedding_forward`; both tables views of one buffer).
    pub fn embedding_forward(&self, out: &Buf, tokens: &Buf, wte: At, wpe: Option<At>, t: usize, c: usize) {
        self.embedding_forward_pos(out, tokens, (wte, wpe), None, (t, c), ALL_ROWS);
    }

    /// [`Gpu::embedding_forward`] with each token's position from `pos` (`[B, T]`, packed
    /// documents whose positions restart), `wte` holding vocabulary rows `rows` (a
    /// vocabulary-parallel shard's: another token's row is 0; [`ALL_ROWS`] for the whole
    /// table): `tensor::embedding_forward_rows`.
    pub fn embedding_forward_pos(&self, out: &Buf, tokens: &Buf, (wte, wpe): (At, Option<At>), pos: Option<&Buf>, (t, c): (usize, usize), rows: Range<usize>) {
        let n = tokens.len();
        assert!(out.len() >= n * c && wpe.is_none_or(|w| w.buf.same(wte.buf) && w.fits(t * c)), "embedding_forward: shapes");
        assert!(pos.is_none_or(|p| p.len() == n), "embedding_forward: positions must be [B, T]");
        let args = [u(n), u(c), u(t), u(wte.off), u(wpe.map_or(0, |w| w.off)), wpe.is_some() as u32, pos.is_some() as u32, u(rows.start), u(rows.end)];
        self.launch(&EMBEDDING_FORWARD, Gpu::grid(n * c, 256), &args, &[Some(out), Some(tokens), Some(wte.buf), pos]);
    }

    /// Backward of [`Gpu::embedding_forward`], accumulating into `dwte` (tokens in order) and
    /// `dwpe` (batch rows in order): the CPU kernel's summation order.
    pub fn embedding_backward(&self, dwte: At, dwpe: Option<At>, dout: &Buf, tokens: &Buf, t: usize, c: usize) {
        self.embedding_backward_pos((dwte, dwpe), dout, tokens, None, (t, c), ALL_ROWS);
    }

    /// Backward of [`Gpu::embedding_forward_pos`] (`tensor::embedding_backward_rows`): `dwte`
    /// accumulates the tokens in `rows`; with positions, `dwpe`'s rows over `max_t` positions
    /// (`dwpe`'s view) sum their tokens in token order.
    pub fn embedding_backward_pos(&self, (dwte, dwpe): (At, Option<At>), dout: &Buf, tokens: &Buf, pos: Option<(&Buf, usize)>, (t, c): (usize, usize), rows: Range<usize>) {
        let n = tokens.len();
        assert!(dout.len() >= n * c && (pos.is_some() || n.is_multiple_of(t)), "embedding_backward: shapes");
        let bufs = [Some(dwte.buf), Some(dout), Some(tokens), pos.map(|p| p.0)];
        let (lo, hi) = (u(rows.start), u(rows.end));
        self.launch(&EMBEDDING_BACKWARD, Gpu::grid(c, 64), &[u(n), u(c), u(t), u(dwte.off), 0, 0, 0, lo, hi], &bufs);
        if let Some(w) = dwpe {
            let rows = pos.map_or(t, |p| p.1);
            let bufs = [Some(w.buf), Some(dout), Some(tokens), pos.map(|p| p.0)];
            self.launch(&EMBEDDING_BACKWARD, Gpu::grid(rows * c, 64), &[u(n), u(c), u(t), u(w.off), 1, pos.is_some() as u32, u(rows), lo, hi], &bufs);
        }
    }

    /// `out = (inp − mean)·rstd·weight (+ bias)` per row of `c`, saving `mean` and `rstd`
    /// (`tensor::layernorm_forward`; `weight` and `bias` views of one buffer).
    pub fn layernorm_forward(&self, out: &Buf, (mean, rstd): (&Buf, &Buf), inp: &Buf, weight: At, bias: Option<At>, c: usize) {
        let rows = rstd.len();
        assert!(inp.len() >= rows * c && out.len() >= rows * c && mean.len() >= rows && weight.fits(c), "layernorm_forward: shapes");
        assert!(bias.is_none_or(|b| b.buf.same(weight.buf) && b.fits(c)), "layernorm_forward: the bias is a view of the weight's buffer");
        let args = [u(rows), u(c), u(weight.off), u(bias.map_or(0, |b| b.off)), bias.is_some() as u32, 0, 0];
        self.launch(&NORM_FORWARD, Gpu::grid(rows, 1), &args, &[Some(out), Some(mean), Some(rstd), Some(inp), Some(weight.buf)]);
    }

    /// Backward of [`Gpu::layernorm_forward`]: accumulates into `dinp`, `dweight` and `dbias`
    /// (views of one buffer, the gradients).
    pub fn layernorm_backward(&self, grads: (&Buf, At, Option<At>), dout: &Buf, inp: &Buf, weight: At, stats: (&Buf, &Buf), c: usize) {
        let ((dinp, dw, db), (mean, rstd)) = (grads, stats);
        let rows = rstd.len();
        assert!(db.is_none_or(|b| b.buf.same(dw.buf)), "layernorm_backward: the bias gradient is a view of the weight gradient's buffer");
        self.launch(&NORM_BACKWARD, Gpu::grid(rows, 1), &[u(rows), u(c), u(weight.off), 0], &[Some(dinp), Some(dout), Some(inp), Some(weight.buf), Some(mean), Some(rstd)]);
        let args = [u(rows), u(c), u(dw.off), u(db.map_or(0, |b| b.off)), db.is_some() as u32, 0];
        self.launch(&NORM_PARAMS, Gpu::grid(c, 64), &args, &[Some(dw.buf), Some(dout), Some(inp), Some(mean), Some(rstd)]);
    }

    /// `out = weight·(inp·rstd)`, `rstd = 1/√(mean(inp²) + eps)` per row, saving `rstd`
    /// (`tensor::llama::rmsnorm_forward`).
    pub fn rmsnorm_forward(&self, out: &Buf, rstd: &Buf, inp: &Buf, weight: At, eps: f32, c: usize) {
        let rows = rstd.len();
        assert!(inp.len() >= rows * c && out.len() >= rows * c && weight.fits(c), "rmsnorm_forward: shapes");
        let args = [u(rows), u(c), u(weight.off), 0, 0, 1, eps.to_bits()];
        self.launch(&NORM_FORWARD, Gpu::grid(rows, 1), &args, &[Some(out), None, Some(rstd), Some(inp), Some(weight.buf)]);
    }

    /// Backward of [`Gpu::rmsnorm_forward`]: accumulates into `dinp` and `dweight`.
    pub fn rmsnorm_backward(&self, grads: (&Buf, At), dout: &Buf, inp: &Buf, weight: At, rstd: &Buf, c: usize) {
        let (dinp, dw) = grads;
        let rows = rstd.len();
        self.launch(&NORM_BACKWARD, Gpu::grid(rows, 1), &[u(rows), u(c), u(weight.off), 1], &[Some(dinp), Some(dout), Some(inp), Some(weight.buf), None, Some(rstd)]);
        self.launch(&NORM_PARAMS, Gpu::grid(c, 64), &[u(rows), u(c), u(dw.off), 0, 0, 1], &[Some(dw.buf), Some(dout), Some(inp), None, Some(rstd)]);
    }

    /// `out = GELU(inp)`, tanh form (`tensor::gelu_forward`).
    pub fn gelu_forward(&self, out: &Buf, inp: &Buf) {
        self.elementwise(&GELU, Mode::Forward, out, inp, None);
    }

    /// `dinp += GELU'(inp)·dout` (`tensor::gelu_backward`).
    pub fn gelu_backward(&self, dinp: &Buf, dout: &Buf, inp: &Buf) {
        self.elementwise(&GELU, Mode::Accumulate, dinp, inp, Some(dout));
    }

    /// `dinp = GELU'(inp)·dout` (`tensor::gelu_backward_into`).
    pub fn gelu_backward_into(&self, dinp: &Buf, dout: &Buf, inp: &Buf) {
        self.elementwise(&GELU, Mode::Into, dinp, inp, Some(dout));
    }

    /// `out = inp·σ(inp)` (`tensor::llama::silu_forward`).
    pub fn silu_forward(&self, out: &Buf, inp: &Buf) {
        self.elementwise(&SILU, Mode::Forward, out, inp, None);
    }

    /// `dinp += silu'(inp)·dout` (`tensor::llama::silu_backward`).
    pub fn silu_backward(&self, dinp: &Buf, dout: &Buf, inp: &Buf) {
        self.elementwise(&SILU, Mode::Accumulate, dinp, inp, Some(dout));
    }

    fn elementwise(&self, k: &Kernel, m: Mode, out: &Buf, inp: &Buf, dout: Option<&Buf>) {
        let n = inp.len();
        assert!(out.len() >= n && dout.is_none_or(|d| d.len() >= n), "{}: shapes", k.name);
        self.launch(k, Gpu::grid(n, 256), &[u(n), m as u32], &[Some(out), Some(inp), dout]);
    }

    /// `out[n, j] = silu(gu[n, j])·gu[n, F + j]` over fused `[N, 2F]` rows
    /// (`tensor::llama::swiglu_forward`).
    pub fn swiglu_forward(&self, out: &Buf, gu: &Buf, f: usize) {
        let rows = gu.len() / (2 * f);
        assert!(out.len() >= rows * f, "swiglu_forward: shapes");
        self.launch(&SWIGLU, Gpu::grid(rows * f, 256), &[u(rows), u(f), Mode::Forward as u32], &[Some(out), Some(gu), None]);
    }

    /// Backward of [`Gpu::swiglu_forward`], accumulating into `dgu` (`accumulate`) or
    /// overwriting it (`tensor::llama::swiglu_backward` / `swiglu_backward_into`).
    pub fn swiglu_backward(&self, dgu: &Buf, dout: &Buf, gu: &Buf, f: usize, accumulate: bool) {
        let rows = gu.len() / (2 * f);
        assert!(dgu.len() >= rows * 2 * f && dout.len() >= rows * f, "swiglu_backward: shapes");
        self.launch(&SWIGLU, Gpu::grid(rows * f, 256), &[u(rows), u(f), mode(accumulate) as u32], &[Some(dgu), Some(gu), Some(dout)]);
    }

    /// `out = a + b` (`tensor::residual_forward`).
    pub fn residual_forward(&self, out: &Buf, a: &Buf, b: &Buf) {
        assert!(a.len() == b.len() && out.len() >= a.len(), "residual_forward: shapes");
        self.launch(&ADD, Gpu::grid(a.len(), 256), &[u(a.len()), 0], &[Some(out), Some(a), Some(b)]);
    }

    /// `da += dout; db += dout` (`tensor::residual_backward`).
    pub fn residual_backward(&self, da: &Buf, db: &Buf, dout: &Buf) {
        self.add_into(da, dout);
        self.add_into(db, dout);
    }

    /// `acc += x` over `x.len()` elements (`tensor::add_into`).
    pub fn add_into(&self, acc: &Buf, x: &Buf) {
        assert!(acc.len() >= x.len(), "add_into: shapes");
        self.launch(&ADD, Gpu::grid(x.len(), 256), &[u(x.len()), 1], &[Some(acc), Some(x), None]);
    }
}

/// Where RoPE's positions come from: `offset + t` (a KV cache's offset), or one id per token.
#[derive(Clone, Copy)]
pub enum RopePos<'a> {
    Offset(usize),
    Ids(&'a Buf),
}

impl Gpu {
    /// Rotates the first `rotary` dims of every q and k head of `qkv` (`[B, T, W]`) in place by
    /// the tables `cos`, `sin` (`[maxT, rot/2]`, from `tensor::llama::rope_table_from`: the
    /// scaled forms differ only in the table), or back with `inverse`: `tensor::llama::
    /// rope_forward[_pos]` and `rope_backward[_pos]`.
    pub fn rope(&self, qkv: &Buf, tables: (&Buf, &Buf), d: &GqaDims, pos: RopePos, inverse: bool) {
        let rot = if d.rotary == 0 { d.hs } else { d.rotary };
        assert!(rot.is_multiple_of(2) && rot <= d.hs, "rotary dimensions must be even and at most the head size");
        let (rows, nqk, w) = (d.b * d.t, d.nh + d.nkv, d.qkv_width());
        assert!(qkv.len() >= rows * w && tables.0.len() == tables.1.len(), "rope: shapes");
        let max_t = tables.0.len() / (rot / 2);
        let (offset, ids) = match pos {
            RopePos::Offset(o) => {
                assert!(o + d.t <= max_t, "rope table shorter than pos_offset + T");
                (o, None)
            }
            RopePos::Ids(ids) => {
                assert_eq!(ids.len(), rows, "rope positions must be [B, T]");
                (0, Some(ids))
            }
        };
        let args = [u(rows), u(nqk), u(d.hs), u(rot), u(d.t), u(offset), ids.is_some() as u32, inverse as u32, u(w)];
        self.launch(&ROPE, Gpu::grid(rows * nqk * rot / 2, 256), &args, &[Some(qkv), Some(tables.0), Some(tables.1), ids]);
    }

    /// `out[i] = keep(i) ? inp[i]/(1 − p) : 0` with the CPU's counter-based mask of `(seed,
    /// i)` (`tensor::dropout_forward`).
    pub fn dropout_forward(&self, out: &Buf, inp: &Buf, p: f32, seed: u64) {
        let n = inp.len();
        self.dropout(out, Some(inp), (p, self.direct_seed(seed)), (1, n), RowMap::whole(1), 0);
    }

    /// Backward of [`Gpu::dropout_forward`]: accumulates into `dinp` (`tensor::dropout_backward`).
    pub fn dropout_backward(&self, dinp: &Buf, dout: &Buf, p: f32, seed: u64) {
        let n = dout.len();
        self.dropout(dinp, Some(dout), (p, self.direct_seed(seed)), (1, n), RowMap::whole(1), 1);
    }

    /// In-place dropout over rows of `c` laid out as `map` says: element `(row, k)` uses the
    /// mask of global element `map.global(row)·c + k` (`tensor::dropout_inplace_rows`).
    pub fn dropout_inplace_rows(&self, x: &Buf, p: f32, seed: u64, c: usize, map: RowMap) {
        if p != 0.0 {
            self.dropout_inplace_rows_seeded(x, p, self.direct_seed(seed), c, map);
        }
    }

    /// [`Gpu::dropout_inplace_rows`] with the seed read on the device (a pass's seed, per site):
    /// a training step records the same launches every time.
    pub fn dropout_inplace_rows_seeded(&self, x: &Buf, p: f32, seed: Seed, c: usize, map: RowMap) {
        if p != 0.0 {
            self.dropout(x, None, (p, seed), (x.len() / c, c), map, 2);
        }
    }

    /// Backward of [`Gpu::dropout_inplace_rows`], accumulating (`tensor::dropout_backward_rows`).
    pub fn dropout_backward_rows(&self, dinp: &Buf, dout: &Buf, p: f32, seed: u64, c: usize, map: RowMap) {
        self.dropout_backward_rows_seeded(dinp, dout, p, self.direct_seed(seed), c, map);
    }

    /// [`Gpu::dropout_backward_rows`] with the seed read on the device.
    pub fn dropout_backward_rows_seeded(&self, dinp: &Buf, dout: &Buf, p: f32, seed: Seed, c: usize, map: RowMap) {
        self.dropout(dinp, Some(dout), (p, seed), (dout.len() / c, c), map, 1);
    }

    fn dropout(&self, out: &Buf, inp: Option<&Buf>, (p, seed): (f32, Seed), (rows, c): (usize, usize), map: RowMap, mode: u32) {
        assert!((0.0..1.0).contains(&p), "dropout p must be in [0, 1)");
        assert!(out.len() >= rows * c && inp.is_none_or(|i| i.len() >= rows * c), "dropout: shapes");
        let ch = map.chunks;
        #[rustfmt::skip]
        let args = [
            u(rows), u(c), p.to_bits(), (1.0 / (1.0 - p)).to_bits(), u(seed.at), seed.site.unwrap_or(0), mode,
            u(map.t_local), u(map.t), u(map.offset), u(map.b0),
            ch.is_some() as u32, u(ch.map_or(0, |c| c.len)), u(ch.map_or(0, |c| c.first)), u(ch.map_or(0, |c| c.second)),
            seed.site.is_some() as u32,
        ];
        self.launch(&DROPOUT, Gpu::grid(rows * c, 256), &args, &[Some(out), inp, Some(seed.buf)]);
    }
}
