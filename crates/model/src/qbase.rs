//! A frozen base held quantized (QLoRA): each unit's parameters as segments — the
//! blocks' matrices in NF4 (blocks of 64, double-quantized scales) or int8 per row, everything
//! else (embeddings, norms, biases, an untied head) in fp32. A pass's store hands out a unit's
//! fp32 segments alone, packed ([`QuantBase::compact_unit`]; the model indexes them with
//! [`QuantBase::compact_views`]), and the model's projections read the quantized matrices
//! directly ([`QuantBase::matrix`]), dequantizing them a tile at a time inside the product
//! (`tensor::quant::qmatmul_forward`): no block matrix ever exists whole in fp32.

use crate::layout::GptParams;
use crate::lora::Site;
use crate::{BaseQuant, ParamLayout, ParamSpec};
use std::ops::Range;
use tensor::quant::{Int8Rows, Nf4, QMat, QPart};

enum Data {
    F32(Vec<f32>),
    Nf4(Nf4),
    Int8(Int8Rows),
}

impl Data {
    /// The whole tensor in fp32 into `out`.
    fn decode(&self, out: &mut [f32]) {
        match self {
            Data::F32(v) => out.copy_from_slice(v),
            Data::Nf4(q) => q.dequantize_into(out, 0),
            Data::Int8(q) => q.dequantize_rows(out, 0),
        }
    }
}

/// One parameter tensor of a unit, at `at` within the unit, and at `packed` within its
/// compact form (`None`: a projection reads it quantized, through [`QuantBase::matrix`]);
/// `decay` as its parameter's (false: a norm or a bias).
struct Segment {
    at: Range<usize>,
    packed: Option<Range<usize>>,
    decay: bool,
    data: Data,
}

/// The quantized base: every unit's segments.
pub struct QuantBase {
    pub kind: BaseQuant,
    units: Vec<Vec<Segment>>,
    unit_lens: Vec<usize>,
    /// Each unit's packed elements (the length of its compact form), and the length of the
    /// gradient scratch a frozen model's passes write in it.
    compact_lens: Vec<usize>,
    grad_lens: Vec<usize>,
    /// Per layer, the segments of unit `l + 1` stacked into each projection's matrix ([`Site`]
    /// order; empty: it is fp32).
    sites: Vec<[Vec<usize>; 4]>,
}

/// Whether `kind` quantizes parameter `p`: a matrix of a block (AdamW decays exactly the
/// matrices), not the untied output head.
pub fn quantizes(p: &ParamSpec) -> bool {
    p.decay && p.shape.len() == 2 && p.name != "lm_head.weight"
}

/// Whether a projection reads parameter `p` quantized, through [`QuantBase::matrix`] (what
/// [`QuantBase::build`] finds from the views): a quantized block matrix that is not an MoE
/// layer's expert (those are dequantized with their unit).
pub fn read_quantized(p: &ParamSpec) -> bool {
    quantizes(p) && !p.name.contains("experts.")
}

impl QuantBase {
    /// Builds the base tensor by tensor, in layout order: `fill(p, dst)` writes parameter `p`'s
    /// fp32 values (from a buffer, a file, or an initialiser), then they are quantized, so only
    /// one tensor exists in fp32 at a time. `views` are the layout's views (`Gpt::views`) and
    /// `units` its unit ranges.
    pub fn build(layout: &ParamLayout, views: &GptParams, units: &[Range<usize>], kind: BaseQuant, mut fill: impl FnMut(&ParamSpec, &mut [f32])) -> QuantBase {
        assert!(kind != BaseQuant::None, "QuantBase::build with BaseQuant::None");
        let mut out: Vec<Vec<Segment>> = units.iter().map(|_| Vec::new()).collect();
        let mut scratch = Vec::new();
        for p in &layout.params {
            let r = p.range();
            let u = units.iter().position(|u| u.start <= r.start && r.end <= u.end).unwrap_or_else(|| panic!("parameter {} is in no unit", p.name));
            scratch.resize(r.len(), 0.0);
            fill(p, &mut scratch);
            let data = match (quantizes(p), kind) {
                (true, BaseQuant::Nf4) => Data::Nf4(Nf4::quantize(&scratch, true)),
                (true, _) => Data::Int8(Int8Rows::quantize(&scratch, p.shape[0], p.shape[1])),
                (false, _) => Data::F32(scratch.clone()),
            };
            let base = units[u].start;
            out[u].push(Segment { at: r.start - base..r.end - base, packed: None, decay: p.decay, data });
        }
        let sites: Vec<[Vec<usize>; 4]> = views
            .blocks
            .iter()
            .enumerate()
            .map(|(l, b)| {
                let u = l + 1;
                // The quantized tensors inside the view (q|k|v and gate|up are several).
                let find = |w: &Range<usize>| -> Vec<usize> {
                    let Some(at) = w.start.checked_sub(units[u].start) else { return Vec::new() };
                    let end = at + w.len();
                    (0..out[u].len()).filter(|&i| { let s = &out[u][i]; at <= s.at.start && s.at.end <= end && !matches!(s.data, Data::F32(_)) }).collect()
                };
                [find(&b.c_attn_w), find(&b.attn_proj_w), find(&b.c_fc_w), find(&b.mlp_proj_w)]
            })
            .collect();
        // Everything no projection reads through `matrix` is packed: the fp32 tensors, and
        // quantized ones read from the unit (an MoE layer's experts, dequantized per unit).
        let (mut compact_lens, mut grad_lens) = (Vec::with_capacity(out.len()), Vec::with_capacity(out.len()));
        let last = out.len() - 1;
        for (u, segs) in out.iter_mut().enumerate() {
            let direct: Vec<usize> = if (1..last).contains(&u) { sites[u - 1].iter().flatten().copied().collect() } else { Vec::new() };
            let (mut at, mut norms_end) = (0, 0);
            for (_, s) in segs.iter_mut().enumerate().filter(|(i, _)| !direct.contains(i)) {
                s.packed = Some(at..at + s.at.len());
                at += s.at.len();
                if !s.decay {
                    norms_end = at;
                }
            }
            compact_lens.push(at);
            // A frozen model computes no embedding or head gradients (`Gpt`'s LoRA passes).
            grad_lens.push(match u {
                0 => 0,
                u if u == last => norms_end,
                _ => at,
            });
        }
        QuantBase { kind, units: out, unit_lens: units.iter().map(|u| u.len()).collect(), compact_lens, grad_lens, sites }
    }

    /// Layer `l`'s projection at `site`, quantized (`None`: that matrix is fp32).
    pub fn matrix(&self, l: usize, site: Site) -> Option<QMat<'_>> {
        let segs = &self.sites.get(l)?[site as usize];
        let parts = segs
            .iter()
            .map(|&i| match &self.units[l + 1][i].data {
                Data::Nf4(q) => QPart::Nf4(q),
                Data::Int8(q) => QPart::Int8(q),
                Data::F32(_) => unreachable!("sites list quantized segments"),
            })
            .collect::<Vec<_>>();
        (!parts.is_empty()).then_some(QMat { parts })
    }

    /// The views a pass indexes compact units with: `rebased` (the views relative to their
    /// units, `GptParams::rebased`) with each packed tensor moved to its place and each matrix
    /// a projection reads quantized an empty range (read through [`QuantBase::matrix`]).
    pub fn compact_views(&self, rebased: &GptParams) -> GptParams {
        rebased.map_units(|r, u| {
            if r.is_empty() {
                return r.clone();
            }
            if let Some((s, p)) = self.units[u].iter().find_map(|s| s.packed.as_ref().filter(|_| s.at.start <= r.start && r.end <= s.at.end).map(|p| (s, p))) {
                return p.start + (r.start - s.at.start)..p.start + (r.end - s.at.start);
            }
            // A view over whole tensors (q|k|v's weights or biases, gate|up): all read
            // quantized (nothing of it is packed), or all packed, side by side.
            let inside: Vec<&Segment> = self.units[u].iter().filter(|s| r.start <= s.at.start && s.at.end <= r.end).collect();
            let whole = inside.iter().map(|s| s.at.len()).sum::<usize>() == r.len();
            if whole && inside.iter().all(|s| s.packed.is_none()) {
                return 0..0;
            }
            let packed: Vec<&Range<usize>> = inside.iter().filter_map(|s| s.packed.as_ref()).collect();
            assert!(
                whole && packed.len() == inside.len() && packed.windows(2).all(|w| w[0].end == w[1].start),
                "range {r:?} of unit {u} is neither packed tensors side by side nor tensors read quantized"
            );
            packed[0].start..packed[packed.len() - 1].end
        })
    }

    /// Unit `u`'s packed tensors (quantized ones dequantized) into `out`
    /// ([`QuantBase::compact_len`] floats).
    pub fn compact_unit(&self, u: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.compact_lens[u], "unit {u}'s compact buffer");
        for s in &self.units[u] {
            if let Some(p) = &s.packed {
                s.data.decode(&mut out[p.clone()]);
            }
        }
    }

    /// Unit `u`'s packed elements.
    pub fn compact_len(&self, u: usize) -> usize {
        self.compact_lens[u]
    }

    /// The gradient scratch unit `u` needs in a frozen model's passes (packed elements): none
    /// for the embeddings, the final norm's for the head's unit, the whole packed unit for a
    /// block (its norms and biases, an MoE layer's experts).
    pub fn grad_len(&self, u: usize) -> usize {
        self.grad_lens[u]
    }

    /// Unit `u` in fp32 into `out` (its length).
    fn dequantize_unit(&self, u: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.unit_lens[u], "unit {u}'s buffer");
        for s in &self.units[u] {
            s.data.decode(&mut out[s.at.clone()]);
        }
    }

    /// Every unit dequantized, as the flat layout.
    pub fn dequantize_all(&self) -> Vec<f32> {
        let mut full = vec![0.0; self.unit_lens.iter().sum()];
        let mut at = 0;
        for u in 0..self.units.len() {
            let n = self.unit_lens[u];
            self.dequantize_unit(u, &mut full[at..at + n]);
            at += n;
        }
        full
    }

    /// Bytes held: quantized codes with their scales, and the fp32 segments.
    pub fn bytes(&self) -> usize {
        self.units
            .iter()
            .flatten()
            .map(|s| match &s.data {
                Data::F32(v) => 4 * v.len(),
                Data::Nf4(q) => q.bytes(),
                Data::Int8(q) => q.bytes(),
            })
            .sum()
    }
}

/// The fp32 values `kind` leaves of `params` (laid out as `layout`): each quantized tensor
/// replaced by its dequantization — the weights a QLoRA run trains against, for merging its
/// adapters into the base (`kiln export --merge`) or checking it against plain LoRA.
pub fn round_trip(layout: &ParamLayout, params: &mut [f32], kind: BaseQuant) {
    if kind == BaseQuant::None {
        return;
    }
    for p in layout.params.iter().filter(|p| quantizes(p)) {
        let w = &mut params[p.range()];
        let back = match kind {
            BaseQuant::Nf4 => Nf4::quantize(w, true).dequantize(),
            _ => {
                let q = Int8Rows::quantize(w, p.shape[0], p.shape[1]);
                let mut out = vec![0.0; w.len()];
                q.dequantize_rows(&mut out, 0);
                out
            }
        };
        w.copy_from_slice(&back);
    }
}

/// The bytes [`QuantBase::build`] will hold for `layout` as `kind` (for the memory plan), from
/// the shapes alone.
pub fn planned_bytes(layout: &ParamLayout, kind: BaseQuant) -> usize {
    layout
        .params
        .iter()
        .map(|p| {
            let n = p.len();
            match (quantizes(p), kind) {
                (false, _) | (_, BaseQuant::None) => 4 * n,
                (true, BaseQuant::Nf4) => {
                    let blocks = n.div_ceil(tensor::quant::NF4_BLOCK);
                    n.div_ceil(2) + blocks + 4 * blocks.div_ceil(tensor::quant::SCALE_BLOCK) + 4
                }
                (true, BaseQuant::Int8) => n + 4 * p.shape[0],
            }
        })
        .sum()
}
