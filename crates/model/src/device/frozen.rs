//! LoRA and QLoRA on the device: a frozen base under [`crate::lora`]'s adapters. The base stays
//! on the device read-only, in the passes' storage type (fp32, or bf16 under `train.precision =
//! bf16`), or quantized as the CPU holds it (NF4 or int8 codes with their scales, QLoRA): each
//! projection dequantizes its matrix into one scratch buffer on the device just before its
//! product, forward and backward, so no quantized matrix is ever held whole in fp32 beyond the
//! one being read. The adapters, their gradients and their `x·Aᵀ` are fp32, and step for step
//! the CPU's products: `y += s·(x·Aᵀ)·Bᵀ` forward; `dB += s·dyᵀ·xa`, `dxa = s·dy·B`, `dA +=
//! dxaᵀ·x`, `dx += dxa·A` backward.

use crate::lora::{Adapter, Lora, Site};
use crate::qbase::QuantBase;
use device::{At, Buf, DType, Gemm, Gpu, MatSpec, QBuf};

/// The adapters and, under QLoRA, the quantized projections.
pub(super) struct Frozen {
    rank: usize,
    scale: f32,
    adapters: Vec<Adapter>,
    pub params: Buf,
    pub grads: Buf,
    /// Each adapter's `x·Aᵀ` of the last forward, `[N, r]`, for the `N` of [`Frozen::xa_rows`].
    xa: Vec<Buf>,
    xa_rows: usize,
    /// `d(x·Aᵀ)`, `[N, r]`.
    dxa: Buf,
    /// QLoRA: per layer, each projection's quantized parts ([`Site`] order; empty: the matrix
    /// is in the base's buffer).
    quant: Vec<[Vec<QBuf>; 4]>,
    /// The matrix being read, dequantized (fp32), and its 16-bit copy when the passes read bf16.
    deq: Option<Buf>,
    deq16: Option<Buf>,
    /// The frozen norms' weight and bias gradients, which backward computes and nobody reads:
    /// `[2C]`, every norm writing the same place.
    pub norm_grads: Buf,
}

/// The element count of each adapter buffer and scratch [`Frozen`] holds for `n` tokens, and
/// the largest quantized matrix (the dequantization scratch).
pub(super) fn buffer_lens(lora: (usize, usize, usize), n: usize, deq: usize, c: usize) -> Vec<usize> {
    let (trainable, adapters, rank) = lora;
    let mut v = vec![trainable, trainable, n * rank, 2 * c];
    v.extend(std::iter::repeat_n(n * rank, adapters));
    if deq > 0 {
        v.push(deq);
    }
    v
}

/// The largest projection matrix of a layer of `cfg` (what one dequantization may fill).
pub(super) fn largest_matrix(cfg: &crate::GptConfig) -> usize {
    let c = cfg.n_embd;
    [cfg.qkv_width() * c, cfg.attn_width() * c, cfg.fc_width() * c, cfg.ffn_hidden * c].into_iter().max().unwrap_or(0)
}

impl Frozen {
    /// `lora`'s adapters uploaded; `base` (QLoRA) its quantized projections, for a model of
    /// `n_layer` blocks of width `c`. `bf16`: the passes read 16-bit weights.
    pub fn new(g: &Gpu, lora: &Lora, base: Option<&QuantBase>, (n_layer, c): (usize, usize), bf16: bool) -> Result<Frozen, String> {
        let e = |e: device::DeviceError| e.0;
        let n = lora.params.len();
        let params = g.alloc(n, DType::F32).map_err(e)?;
        g.write(&params, &lora.params);
        let grads = g.alloc(n, DType::F32).map_err(e)?;
        let mut quant = Vec::new();
        let mut largest = 0;
        if let Some(q) = base {
            for l in 0..n_layer {
                let mut sites: [Vec<QBuf>; 4] = Default::default();
                for site in [Site::Qkv, Site::AttnProj, Site::Fc, Site::MlpProj] {
                    if let Some(m) = q.matrix(l, site) {
                        largest = largest.max(m.parts.iter().map(|p| p.len()).sum::<usize>());
                        sites[site as usize] = m.parts.iter().map(|&p| g.upload_quantized(p)).collect::<Result<_, _>>().map_err(e)?;
                    }
                }
                quant.push(sites);
            }
        }
        let deq = (largest > 0).then(|| g.alloc(largest, DType::F32)).transpose().map_err(e)?;
        let deq16 = deq.as_ref().filter(|_| bf16).map(|_| g.alloc(largest, DType::Bf16)).transpose().map_err(e)?;
        Ok(Frozen {
            rank: lora.rank,
            scale: lora.scale(),
            adapters: lora.adapters.clone(),
            params,
            grads,
            xa: Vec::new(),
            xa_rows: 0,
            dxa: g.zeros(1),
            quant,
            deq,
            deq16,
            norm_grads: g.zeros(2 * c),
        })
    }

    /// The `x·Aᵀ` buffers for passes of `n` tokens.
    pub fn ensure_rows(&mut self, g: &Gpu, n: usize) {
        if self.xa_rows != n {
            self.xa = self.adapters.iter().map(|_| g.zeros(n * self.rank)).collect();
            self.dxa = g.zeros(n * self.rank);
            self.xa_rows = n;
        }
    }

    /// Layer `l`'s matrix at `site` dequantized into the scratch (in the passes' type), or
    /// `None` when it is not quantized.
    pub fn dequantized(&self, g: &Gpu, l: usize, site: Site) -> Option<At<'_>> {
        let parts = self.quant.get(l).map(|s| &s[site as usize]).filter(|p| !p.is_empty())?;
        let deq = self.deq.as_ref().expect("a quantized base has its scratch");
        let mut at = 0;
        for p in parts {
            g.dequantize(deq.at(at), p);
            at += p.len;
        }
        Some(match &self.deq16 {
            Some(h) => {
                g.cast(h, deq).expect("the scratch's two types have one length");
                h.at(0)
            }
            None => deq.at(0),
        })
    }

    fn at(&self, l: usize, site: Site) -> impl Iterator<Item = (usize, &Adapter)> {
        self.adapters.iter().enumerate().filter(move |(_, a)| a.layer == l && a.site == site)
    }

    /// `y[N, W] += s·(x·Aᵀ)·Bᵀ` on each adapter's rows at `(l, site)`, keeping `x·Aᵀ`.
    pub fn forward(&self, g: &Gpu, (l, site): (usize, Site), y: &Buf, x: &Buf, n: usize, width: usize) {
        let r = self.rank;
        for (i, ad) in self.at(l, site) {
            let xa = &self.xa[i];
            g.gemm(Gemm::new(n, r, ad.d_in), (xa, MatSpec::rows(0, r)), (x, MatSpec::rows(0, ad.d_in)), (&self.params, MatSpec::rows(ad.a.start, ad.d_in).t()), None);
            let out = MatSpec { off: ad.rows.start, rs: width, cs: 1, b0: 0, b1: 0 };
            let gm = Gemm { alpha: self.scale, ..Gemm::new(n, ad.rows.len(), r).acc() };
            g.gemm(gm, (y, out), (xa, MatSpec::rows(0, r)), (&self.params, MatSpec::rows(ad.b.start, r).t()), None);
        }
    }

    /// Given `dy[N, W]`, the adapters' gradients at `(l, site)` accumulated and their part of
    /// the input gradient added to `dx[N, in]` (`(n, width)`: `N` and `W`).
    pub fn backward(&self, g: &Gpu, (l, site): (usize, Site), dx: &Buf, dy: &Buf, x: &Buf, (n, width): (usize, usize)) {
        let r = self.rank;
        for (i, ad) in self.at(l, site) {
            let (o, d_in) = (ad.rows.len(), ad.d_in);
            let d_o = MatSpec { off: ad.rows.start, rs: width, cs: 1, b0: 0, b1: 0 };
            let xa = (&self.xa[i], MatSpec::rows(0, r));
            // dB += s·d_oᵀ·xa ; dxa = s·d_o·B
            g.gemm(Gemm { alpha: self.scale, ..Gemm::new(o, r, n).acc() }, (&self.grads, MatSpec::rows(ad.b.start, r)), (dy, d_o.t()), xa, None);
            g.gemm(Gemm { alpha: self.scale, ..Gemm::new(n, r, o) }, (&self.dxa, MatSpec::rows(0, r)), (dy, d_o), (&self.params, MatSpec::rows(ad.b.start, r)), None);
            // dA += dxaᵀ·x ; dx += dxa·A
            g.gemm(Gemm::new(r, d_in, n).acc(), (&self.grads, MatSpec::rows(ad.a.start, d_in)), (&self.dxa, MatSpec::rows(0, r).t()), (x, MatSpec::rows(0, d_in)), None);
            g.gemm(Gemm::new(n, d_in, r).acc(), (dx, MatSpec::rows(0, d_in)), (&self.dxa, MatSpec::rows(0, r)), (&self.params, MatSpec::rows(ad.a.start, d_in)), None);
        }
    }
}
