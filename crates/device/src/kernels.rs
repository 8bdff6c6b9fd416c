//! The launchers: one method per kernel, each the device twin of the CPU function of the same
//! name in `tensor` (same argument order and conventions).

use crate::shader::{kernel, Kernel};
use crate::{At, Buf, DType, DeviceError, Gpu};

const MATMUL: Kernel = kernel!("matmul", ["A", "B", "C", "BIAS", "OFFS"], writes ["C"]);
const BIAS_BACKWARD: Kernel = kernel!("bias_backward", ["DB", "DOUT"], writes ["DB"]);
const CAST: Kernel = kernel!("cast", ["DST", "SRC"], writes []);
/// This module's kernels (the CUDA build compiles each).
pub(crate) const KERNELS: &[&Kernel] = &[&MATMUL, &BIAS_BACKWARD, &CAST];

/// A strided, batched matrix view of a device buffer: element `(i, j)` of batch `z` lives at
/// `off + (z / inner)·b0 + (z % inner)·b1 + i·rs + j·cs`.
#[derive(Clone, Copy, Debug)]
pub struct MatSpec {
    pub off: usize,
    pub rs: usize,
    pub cs: usize,
    pub b0: usize,
    pub b1: usize,
}

impl MatSpec {
    /// A dense row-major matrix with `cols` columns at `off`.
    pub fn rows(off: usize, cols: usize) -> MatSpec {
        MatSpec { off, rs: cols, cs: 1, b0: 0, b1: 0 }
    }

    /// The transpose: rows and columns swap strides.
    pub fn t(self) -> MatSpec {
        MatSpec { rs: self.cs, cs: self.rs, ..self }
    }

    /// Batched with strides `b0` (outer) and `b1` (inner).
    pub fn batched(self, b0: usize, b1: usize) -> MatSpec {
        MatSpec { b0, b1, ..self }
    }
}

/// One batched product `C = alpha·A·B (+ C) (+ bias)`: `m × k` by `k × n`, `batch = outer ×
/// inner` of them.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub outer: usize,
    pub inner: usize,
    pub alpha: f32,
    pub accumulate: bool,
}

impl Gemm {
    pub fn new(m: usize, n: usize, k: usize) -> Gemm {
        Gemm { m, n, k, outer: 1, inner: 1, alpha: 1.0, accumulate: false }
    }

    /// The same product, added to what the output holds.
    pub fn acc(self) -> Gemm {
        Gemm { accumulate: true, ..self }
    }
}

/// `x` as a kernel argument: device kernels index with 32 bits.
pub(crate) fn u(x: usize) -> u32 {
    u32::try_from(x).expect("device kernels index with 32 bits: a tensor is over 4G elements")
}

/// The last element a view touches, plus one: what must lie inside its buffer.
fn extent(s: MatSpec, rows: usize, cols: usize, g: &Gemm) -> usize {
    if rows == 0 || cols == 0 {
        return s.off;
    }
    let last_batch = ((g.outer - 1) * s.b0) + ((g.inner - 1) * s.b1);
    s.off + last_batch + (rows - 1) * s.rs + (cols - 1) * s.cs + 1
}

/// Which dimension of a product is one expert's packed rows ([`Gpu::gemm_ragged`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ragged {
    /// The output's rows (and A's): an expert's forward, or its input gradient.
    Rows = 1,
    /// The inner dimension (A's columns, B's rows): an expert's weight gradient.
    Inner = 2,
}

impl Gpu {
    /// The strided batched product every matmul here is made of (fp32 accumulation, inputs of
    /// any floating type, fp32 output): `tensor::matmul::gemm`'s twin.
    pub fn gemm(&self, g: Gemm, c: (&Buf, MatSpec), a: (&Buf, MatSpec), b: (&Buf, MatSpec), bias: Option<At>) {
        self.gemm_with(g, c, a, b, bias, None);
    }

    /// [`Gpu::gemm`] over expert `e`'s packed rows `offsets[e] .. offsets[e + 1]` (u32, on the
    /// device): along `ragged`, `g.m` or `g.k` is an upper bound and the views start at row 0
    /// of the packed buffers. No count comes back to the host.
    pub fn gemm_ragged(&self, g: Gemm, c: (&Buf, MatSpec), a: (&Buf, MatSpec), b: (&Buf, MatSpec), ragged: Ragged, (offsets, e): (&Buf, usize)) {
        assert!(offsets.dtype() == DType::U32 && e + 1 < offsets.len(), "gemm_ragged: expert {e} of {} offsets", offsets.len());
        self.gemm_with(g, c, a, b, None, Some((ragged, offsets, e)));
    }

    fn gemm_with(&self, g: Gemm, c: (&Buf, MatSpec), a: (&Buf, MatSpec), b: (&Buf, MatSpec), bias: Option<At>, rag: Option<(Ragged, &Buf, usize)>) {
        let (cs, asp, bsp) = (c.1, a.1, b.1);
        assert_eq!(cs.cs, 1, "the output of a device gemm is row-major");
        assert!(extent(asp, g.m, g.k, &g) <= a.0.len, "gemm: A's view runs past its buffer");
        assert!(extent(bsp, g.k, g.n, &g) <= b.0.len, "gemm: B's view runs past its buffer");
        assert!(extent(cs, g.m, g.n, &g) <= c.0.len, "gemm: C's view runs past its buffer");
        assert!(bias.is_none_or(|b| b.fits(g.n)), "gemm: the bias runs past its buffer");
        #[rustfmt::skip]
        let args = [
            u(g.m), u(g.n), u(g.k), u(g.inner),
            u(asp.off), u(asp.rs), u(asp.cs), u(asp.b0), u(asp.b1),
            u(bsp.off), u(bsp.rs), u(bsp.cs), u(bsp.b0), u(bsp.b1),
            u(cs.off), u(cs.rs), u(cs.b0), u(cs.b1),
            g.alpha.to_bits(), g.accumulate as u32, bias.is_some() as u32, u(bias.map_or(0, |b| b.off)),
            rag.map_or(0, |r| r.0 as u32), u(rag.map_or(0, |r| r.2)),
        ];
        let groups = [u(g.n.div_ceil(64)), u(g.m.div_ceil(64)), u(g.outer * g.inner)];
        assert!(groups.iter().all(|&x| x <= 65535), "gemm: {g:?} needs over 65535 workgroups along one axis");
        self.launch(&MATMUL, groups, &args, &[Some(a.0), Some(b.0), Some(c.0), bias.map(|b| b.buf), rag.map(|r| r.1)]);
    }

    /// `out[BT, OC] = inp[BT, C] · weight[OC, C]ᵀ (+ bias[OC])`: `tensor::matmul_forward`'s
    /// twin. Overwrites `out`.
    pub fn matmul_forward(&self, out: &Buf, inp: &Buf, weight: At, bias: Option<At>, (bt, c, oc): (usize, usize, usize)) {
        self.gemm(Gemm::new(bt, oc, c), (out, MatSpec::rows(0, oc)), (inp, MatSpec::rows(0, c)), (weight.buf, MatSpec::rows(weight.off, c).t()), bias);
    }

    /// Backward of [`Gpu::matmul_forward`]: accumulates `dinp += dout·W`, `dweight +=
    /// doutᵀ·inp`, `dbias += Σ_rows dout` (`tensor::matmul_backward`'s twin).
    pub fn matmul_backward(&self, grads: (&Buf, At, Option<At>), dout: &Buf, inp: &Buf, weight: At, (bt, c, oc): (usize, usize, usize)) {
        let (dinp, dweight, dbias) = grads;
        self.gemm(Gemm::new(bt, c, oc).acc(), (dinp, MatSpec::rows(0, c)), (dout, MatSpec::rows(0, oc)), (weight.buf, MatSpec::rows(weight.off, c)), None);
        self.gemm(Gemm::new(oc, c, bt).acc(), (dweight.buf, MatSpec::rows(dweight.off, c)), (dout, MatSpec::rows(0, oc).t()), (inp, MatSpec::rows(0, c)), None);
        if let Some(db) = dbias {
            self.bias_backward(db, dout, bt, oc);
        }
    }

    /// [`Gpu::matmul_backward`] overwriting `dinp` instead of accumulating into it
    /// (`tensor::matmul::matmul_backward_into_as`'s twin); the weight's and bias's gradients
    /// accumulate.
    pub fn matmul_backward_into(&self, grads: (&Buf, At, Option<At>), dout: &Buf, inp: &Buf, weight: At, (bt, c, oc): (usize, usize, usize)) {
        let (dinp, dweight, dbias) = grads;
        self.gemm(Gemm::new(bt, c, oc), (dinp, MatSpec::rows(0, c)), (dout, MatSpec::rows(0, oc)), (weight.buf, MatSpec::rows(weight.off, c)), None);
        self.gemm(Gemm::new(oc, c, bt).acc(), (dweight.buf, MatSpec::rows(dweight.off, c)), (dout, MatSpec::rows(0, oc).t()), (inp, MatSpec::rows(0, c)), None);
        if let Some(db) = dbias {
            self.bias_backward(db, dout, bt, oc);
        }
    }

    /// `dbias[OC] += Σ_rows dout[BT, OC]`, rows in order.
    pub fn bias_backward(&self, dbias: At, dout: &Buf, bt: usize, oc: usize) {
        assert!(dbias.fits(oc) && dout.len >= bt * oc);
        self.launch(&BIAS_BACKWARD, Gpu::grid(oc, 64), &[u(bt), u(oc), u(dbias.off)], &[Some(dbias.buf), Some(dout)]);
    }

    /// The adapter's fp32 matmul rate in FLOP/s: the best of `reps` timed `n³` products (after
    /// one untimed), each submitted and waited for alone. The MFU denominator of a device run.
    pub fn measure_peak_flops(&self, n: usize, reps: usize) -> f64 {
        let (a, b, c) = (self.zeros(n * n), self.zeros(n * n), self.zeros(n * n));
        let run = || {
            self.gemm(Gemm::new(n, n, n), (&c, MatSpec::rows(0, n)), (&a, MatSpec::rows(0, n)), (&b, MatSpec::rows(0, n)), None);
            self.sync();
        };
        run();
        let best = (0..reps.max(1))
            .map(|_| {
                let t = std::time::Instant::now();
                run();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        2.0 * (n * n * n) as f64 / best
    }

    /// `dst = src` converted to `dst`'s type (rounded to nearest, ties to even, for bf16; f16 as
    /// the device's `pack2x16float` rounds): how fp32 master weights become a step's bf16 or f16
    /// copy.
    pub fn cast(&self, dst: &Buf, src: &Buf) -> Result<(), DeviceError> {
        if dst.len != src.len || dst.dtype == DType::U32 || src.dtype == DType::U32 {
            return Err(DeviceError(format!("cast: {} {} elements into {} {} elements", src.len, src.dtype.name(), dst.len, dst.dtype.name())));
        }
        let words = dst.dtype.words(dst.len);
        let mode = match dst.dtype {
            DType::F32 => 0,
            DType::Bf16 => 1,
            DType::F16 => 2,
            DType::U32 => unreachable!(),
        };
        self.launch(&CAST, Gpu::grid(words, 64), &[u(src.len), u(words), mode], &[Some(dst), Some(src)]);
        Ok(())
    }
}
