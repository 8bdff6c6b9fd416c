//! ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
//! Training", 2023), on ZeRO-3's three collectives:
//!
//! - **qwZ**, quantized weights: a unit's parameter all-gather carries each rank's shard as
//!   int8 codes in blocks of [`GROUP`] with one fp32 scale each (symmetric, nearest rounding),
//!   and every rank — the owner too — uses the dequantized values, so all ranks compute with the
//!   same weights. 1.0625 bytes per element instead of 4.
//! - **qgZ**, quantized gradients: the gradient reduce-scatter becomes two all-to-alls of int4
//!   (or int8) block-quantized gradients, hierarchical over the nodes: each rank first sends,
//!   inside its node, every local peer the chunks whose owners share that peer's local index,
//!   sums what it receives (dequantized, in rank order), then sends across the nodes, to the
//!   rank with its own local index on each node, that node's chunk of the partial sum, and sums
//!   those. Inter-node traffic falls by the node size on top of the quantization.
//! - **hpZ**, hierarchical partitioning: each rank also keeps, from a unit's forward gather, its
//!   node-local share of the gathered unit (1/G of it, with qwZ as the codes it received), and
//!   backward gathers the unit from its node alone: the same values as forward, bit for bit,
//!   and no inter-node traffic for the backward all-gather, for P/G more memory per rank.
//!
//! Ranks are numbered node-major: world rank `r` is local index `r mod G` of node `r div G`.
//! Codes travel as `f32` bit patterns ([`packet_words`]) and are never computed with; every
//! sum runs in rank order, so both backends give the same bits.

use crate::comm::Comm;
use tensor::quant::{compress_groups, decompress_groups, ACT_GROUP};

/// Elements per quantization block.
pub const GROUP: usize = ACT_GROUP;

/// ZeRO++'s switches (`parallel.zeropp`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZeroPp {
    /// qwZ: int8 parameter all-gathers.
    pub qwz: bool,
    /// qgZ: the gradient reduce-scatter's code bits (4 or 8), or off.
    pub qgz: Option<u32>,
    /// hpZ: backward gathers from the node's secondary partition.
    pub hpz: bool,
    /// Ranks per node, `G` (dividing the data-parallel degree).
    pub node: usize,
}

impl ZeroPp {
    pub fn any(&self) -> bool {
        self.qwz || self.qgz.is_some() || self.hpz
    }
}

/// Words of a packet of `n` elements at `bits` (8 or 4): the codes four bytes to a word, then
/// one scale per block.
pub fn packet_words(n: usize, bits: u32) -> usize {
    let bytes = if bits == 4 { n.div_ceil(2) } else { n };
    bytes.div_ceil(4) + n.div_ceil(GROUP)
}

/// `x` quantized into a packet (`out`: [`packet_words`]`(x.len(), bits)` words).
pub fn quantize_packet(x: &[f32], bits: u32, out: &mut [f32]) {
    let n = x.len();
    assert_eq!(out.len(), packet_words(n, bits), "packet size");
    let mut codes = vec![0u8; if bits == 4 { n.div_ceil(2) } else { n }];
    let words = codes.len().div_ceil(4);
    let (cw, scales) = out.split_at_mut(words);
    compress_groups(&mut codes, scales, x, bits, None);
    for (w, c) in cw.iter_mut().zip(codes.chunks(4)) {
        let mut b = [0u8; 4];
        b[..c.len()].copy_from_slice(c);
        *w = f32::from_bits(u32::from_le_bytes(b));
    }
}

/// The `out.len()` elements a packet ([`quantize_packet`]) holds, dequantized.
pub fn dequantize_packet(p: &[f32], bits: u32, out: &mut [f32]) {
    let n = out.len();
    assert_eq!(p.len(), packet_words(n, bits), "packet size");
    let nc = if bits == 4 { n.div_ceil(2) } else { n };
    let (cw, scales) = p.split_at(nc.div_ceil(4));
    let mut codes: Vec<u8> = cw.iter().flat_map(|w| w.to_bits().to_le_bytes()).collect();
    codes.truncate(nc);
    decompress_groups(out, &codes, scales, bits);
}

/// qwZ: every rank's `shard` (`c` elements) gathered as int8 packets into `packets` (`n`
/// packets in rank order), then dequantized into `out` (`n · c`, rank order).
pub fn all_gather_quantized(comm: &dyn Comm, shard: &[f32], packets: &mut [f32], out: &mut [f32]) {
    let (n, c) = (comm.size(), shard.len());
    let w = packet_words(c, 8);
    assert!(packets.len() == n * w && out.len() == n * c, "gather sizes");
    let mut mine = vec![0.0; w];
    quantize_packet(shard, 8, &mut mine);
    comm.all_gather(&mine, packets);
    dequantize_packets(packets, c, 8, out);
}

/// `out` (`k · c` elements) from `k` consecutive packets of `c` elements each.
pub fn dequantize_packets(packets: &[f32], c: usize, bits: u32, out: &mut [f32]) {
    let w = packet_words(c, bits);
    for (p, o) in packets.chunks(w).zip(out.chunks_mut(c)) {
        dequantize_packet(p, bits, o);
    }
}

/// qgZ: `input` (`n · c`, the chunk for world rank `k` at `k · c`) summed over the world into
/// `out` (this rank's chunk, `c`), through `node` (this rank's `G` node peers, in local order)
/// and `cross` (the `N` ranks with this rank's local index, one per node, in node order) with
/// `bits`-bit packets. A group of one rank sends nothing and quantizes nothing.
pub fn reduce_scatter_quantized(node: &dyn Comm, cross: &dyn Comm, input: &[f32], out: &mut [f32], bits: u32) {
    let (g, nn, c) = (node.size(), cross.size(), out.len());
    assert_eq!(input.len(), g * nn * c, "reduce-scatter input");
    // 1. Inside the node: to local peer j the chunks of owners b·G + j (b = 0..N), N·c values.
    let part = nn * c;
    let mut partial = vec![0.0f32; part];
    let gather_for = |j: usize, dst: &mut [f32]| {
        for b in 0..nn {
            let k = b * g + j;
            dst[b * c..(b + 1) * c].copy_from_slice(&input[k * c..(k + 1) * c]);
        }
    };
    if g == 1 {
        gather_for(0, &mut partial);
    } else {
        let w = packet_words(part, bits);
        let (mut send, mut recv) = (vec![0.0f32; g * w], vec![0.0f32; g * w]);
        let mut tmp = vec![0.0f32; part];
        for j in 0..g {
            gather_for(j, &mut tmp);
            quantize_packet(&tmp, bits, &mut send[j * w..(j + 1) * w]);
        }
        node.all_to_all(&send, &mut recv);
        for p in recv.chunks(w) {
            dequantize_packet(p, bits, &mut tmp);
            partial.iter_mut().zip(&tmp).for_each(|(a, x)| *a += x);
        }
    }
    // 2. Across the nodes: to node b's rank with this local index its chunk of the partial sum.
    if nn == 1 {
        out.copy_from_slice(&partial);
        return;
    }
    let w = packet_words(c, bits);
    let (mut send, mut recv) = (vec![0.0f32; nn * w], vec![0.0f32; nn * w]);
    for b in 0..nn {
        quantize_packet(&partial[b * c..(b + 1) * c], bits, &mut send[b * w..(b + 1) * w]);
    }
    cross.all_to_all(&send, &mut recv);
    out.fill(0.0);
    let mut tmp = vec![0.0f32; c];
    for p in recv.chunks(w) {
        dequantize_packet(p, bits, &mut tmp);
        out.iter_mut().zip(&tmp).for_each(|(a, x)| *a += x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packets round-trip within a block's quantization step, and a block of zeros is exact.
    #[test]
    fn packets_round_trip_within_the_quantization_step() {
        let x: Vec<f32> = (0..200).map(|i| ((i as f32) * 0.37).sin() * if i < 64 { 0.0 } else { 2.0 }).collect();
        for bits in [8, 4] {
            let mut p = vec![0.0; packet_words(x.len(), bits)];
            quantize_packet(&x, bits, &mut p);
            let mut y = vec![0.0; x.len()];
            dequantize_packet(&p, bits, &mut y);
            let step = 2.0 / ((1 << (bits - 1)) - 1) as f32;
            for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                assert!((a - b).abs() <= 0.5 * step + 1e-6, "{bits} bits, element {i}: {a} vs {b}");
            }
            assert!(y[..64].iter().all(|&v| v == 0.0));
        }
    }

    /// qgZ over 4 ranks as two nodes of two: each rank ends with its chunk of the sum over all
    /// ranks (within the quantization error of two int8 rounds), the same bits on a second run;
    /// qwZ's gather gives every rank the same dequantized shards.
    #[test]
    fn hierarchical_reduce_scatter_and_quantized_gather_match_the_exact_collectives() {
        let (n, g, c) = (4, 2, 150);
        let input = |r: usize| -> Vec<f32> { (0..n * c).map(|i| ((i * 7 + r * 13) as f32 * 0.01).cos()).collect() };
        let run = || {
            crate::run_ranks(n, |comm| {
                let me = comm.rank();
                let node: Vec<usize> = (me / g * g..me / g * g + g).collect();
                let cross: Vec<usize> = (0..n / g).map(|b| b * g + me % g).collect();
                let (nc, cc) = (comm.split(&node), comm.split(&cross));
                let mut out = vec![0.0; c];
                reduce_scatter_quantized(&*nc, &*cc, &input(me), &mut out, 8);
                let shard: Vec<f32> = input(me)[..c].to_vec();
                let mut packets = vec![0.0; n * packet_words(c, 8)];
                let mut full = vec![0.0; n * c];
                all_gather_quantized(comm, &shard, &mut packets, &mut full);
                (out, full)
            })
        };
        let (a, b) = (run(), run());
        for r in 0..n {
            let exact: Vec<f32> = (0..c).map(|j| (0..n).map(|s| input(s)[r * c + j]).sum()).collect();
            let worst = a[r].0.iter().zip(&exact).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(worst < 0.1, "rank {r}: off by {worst}");
            assert_eq!(a[r].0, b[r].0, "rank {r}: deterministic");
            assert_eq!(a[r].1, a[0].1, "rank {r}: the same gathered values");
        }
    }
}
