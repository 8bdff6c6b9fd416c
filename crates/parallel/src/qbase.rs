//! A frozen base held quantized (QLoRA, issue 25): the data-parallel store keeps each unit's
//! parameters as segments — the blocks' matrices in NF4 (blocks of 64, double-quantized scales)
//! or int8 per row, everything else (embeddings, norms, biases, an untied head) in fp32 — and
//! dequantizes a unit when a pass acquires it (`DataParallel`'s `UnitStore`), so at most the
//! units a pass holds at once exist in fp32.

use model::{BaseQuant, ParamLayout, ParamSpec};
use std::ops::Range;
use tensor::quant::{Int8Rows, Nf4};

enum Data {
    F32(Vec<f32>),
    Nf4(Nf4),
    Int8(Int8Rows),
}

/// One parameter tensor of a unit, at `at` within the unit.
struct Segment {
    at: Range<usize>,
    data: Data,
}

/// The quantized base: every unit's segments.
pub struct QuantBase {
    pub kind: BaseQuant,
    units: Vec<Vec<Segment>>,
    unit_lens: Vec<usize>,
}

/// Whether `kind` quantizes parameter `p`: a matrix of a block (AdamW decays exactly the
/// matrices), not the untied output head.
pub fn quantizes(p: &ParamSpec) -> bool {
    p.decay && p.shape.len() == 2 && p.name != "lm_head.weight"
}

impl QuantBase {
    /// Builds the base tensor by tensor, in layout order: `fill(p, dst)` writes parameter `p`'s
    /// fp32 values (from a buffer, a file, or an initialiser), then they are quantized, so only
    /// one tensor exists in fp32 at a time. `units` are the layout's unit ranges.
    pub fn build(layout: &ParamLayout, units: &[Range<usize>], kind: BaseQuant, mut fill: impl FnMut(&ParamSpec, &mut [f32])) -> QuantBase {
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
            out[u].push(Segment { at: r.start - base..r.end - base, data });
        }
        QuantBase { kind, units: out, unit_lens: units.iter().map(|u| u.len()).collect() }
    }

    /// Unit `u` in fp32 into `out` (its length).
    pub fn dequantize_unit(&self, u: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.unit_lens[u], "unit {u}'s buffer");
        for s in &self.units[u] {
            let dst = &mut out[s.at.clone()];
            match &s.data {
                Data::F32(v) => dst.copy_from_slice(v),
                Data::Nf4(q) => q.dequantize_into(dst, 0),
                Data::Int8(q) => q.dequantize_rows(dst, 0),
            }
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

    pub fn unit_len(&self, u: usize) -> usize {
        self.unit_lens[u]
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
