//! Distributed Muon: the Newton–Schulz iteration needs each matrix whole, which ZeRO (a unit's
//! elements cut into one chunk per data-parallel rank) and tensor parallelism (rows or columns
//! per rank) split. Each rank forms the momentum of the elements it owns; then, unit by unit,
//! the ranks gather the unit's updates (an all-gather over the data-parallel group, then one
//! over the tensor-parallel group, assembled in the whole model's element order), the matrix's
//! *owner* alone runs the iteration, and the results go back (an all-reduce over the
//! tensor-parallel group, each rank keeping its part, then a reduce-scatter over the
//! data-parallel group, each rank keeping its chunk; every other rank adds zeros, so the sums
//! are exact). Owners are spread over the ranks by the iteration's cost, largest first, so the
//! work is balanced. The same matrix, in the same order, goes through the same iteration as on
//! one rank.
//!
//! Without ZeRO the data-parallel replicas hold the whole reduced gradient, and each runs the
//! iteration of its tensor-parallel group's matrices itself (as data-parallel Muon does).

use crate::config::RunConfig;
use super::{Chunk, MuonMatrix, MuonStep};
use parallel::tp::Split;

/// Whether a chunk's Muon matrices are split over ranks: ZeRO over several data-parallel
/// ranks, or tensor parallelism.
pub fn distributed(ch: &Chunk, tp: Option<&dyn parallel::Comm>) -> bool {
    (ch.dp.zero > 0 && ch.dp.n() > 1) || tp.is_some_and(|c| c.size() > 1)
}

/// The owner of each matrix among `n` ranks: largest iteration first (`r·c·min(r, c)` of the
/// whole matrix), each to the least-loaded rank so far (the lowest on a tie).
fn owners(mats: &[MuonMatrix], tp: usize, n: usize) -> Vec<usize> {
    let cost = |m: &MuonMatrix| {
        let (r, c) = whole_shape(m, tp);
        (r * c * r.min(c)) as u128
    };
    let mut order: Vec<usize> = (0..mats.len()).collect();
    order.sort_by_key(|&k| std::cmp::Reverse(cost(&mats[k])));
    let (mut load, mut owner) = (vec![0u128; n], vec![0; mats.len()]);
    for k in order {
        let r = (0..n).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        owner[k] = r;
        load[r] += cost(&mats[k]);
    }
    owner
}

/// A matrix's whole shape, over `tp` tensor-parallel ranks.
fn whole_shape(m: &MuonMatrix, tp: usize) -> (usize, usize) {
    parallel::tp::whole_shape(m.split, m.shape, tp)
}

/// Whether tensor parallelism cuts the matrix.
fn tp_split(m: &MuonMatrix, tp: usize) -> bool {
    tp > 1 && matches!(m.split, Split::Rows { .. } | Split::Cols)
}

/// Muon's update of every matrix of `ch` at the schedule's learning rate `lr`, `tp` the
/// tensor-parallel group (`None` without). The other parameters are left to
/// [`crate::step::Optimizer::update_rest`], and the parameters' gathers to the caller's
/// `DataParallel::after_update`.
pub fn step(ch: &mut Chunk, tp: Option<&dyn parallel::Comm>, cfg: &RunConfig, lr: f64) {
    let _p = tensor::profile::scope("distributed muon");
    let h = MuonStep::new(cfg, lr);
    let mats = ch.opt.muon.clone();
    let ntp = tp.map_or(1, |c| c.size());
    let sharded = ch.dp.zero > 0 && ch.dp.n() > 1;
    let ndp = if sharded { ch.dp.n() } else { 1 };
    let me = if sharded { ch.dp.rank() } else { 0 } * ntp + tp.map_or(0, |c| c.rank());
    let owner = owners(&mats, ntp, ndp * ntp);
    // 1. The momentum of the elements this rank owns, laid out like the moments.
    let mut u = vec![0.0f32; ch.opt.m.len()];
    let opt = &mut ch.opt;
    ch.dp.for_each_piece(|piece, _, g| {
        for m in &mats {
            if let Some((rel, st)) = inside(m, piece) {
                h.momentum(&g[rel], &mut opt.m[st.clone()], &mut u[st]);
            }
        }
    });
    // 2. Unit by unit: gather, iterate on the owner, give back.
    let shards = ch.dp.shards.clone();
    let mut o = vec![0.0f32; u.len()];
    for (ui, unit) in shards.units.iter().enumerate() {
        let here: Vec<usize> = (0..mats.len()).filter(|&k| mats[k].range.start >= unit.start && mats[k].range.end <= unit.end).collect();
        if here.is_empty() {
            continue;
        }
        let (own, off) = (shards.own(ui, shards.rank), shards.offset[ui]);
        // The unit's updates, whole (in this tensor-parallel rank's layout).
        let mut full = if sharded {
            let c = shards.chunk[ui];
            let mut mine = vec![0.0f32; c];
            mine[..own.len()].copy_from_slice(&u[off..off + own.len()]);
            ch.dp.run("muon all-gather", move |comm| {
                let mut out = vec![0.0f32; c * comm.size()];
                comm.all_gather(&mine, &mut out);
                out
            })
        } else {
            u[unit.clone()].to_vec()
        };
        iterate_unit(&mut full, unit.start, (&mats, &here, &owner), (me, ntp, tp), &h);
        // Each rank's own chunk of the unit's results.
        if sharded {
            let c = shards.chunk[ui];
            let back = ch.dp.run("muon reduce-scatter", move |comm| {
                let mut out = vec![0.0f32; c];
                comm.reduce_scatter_sum(&full, &mut out);
                out
            });
            o[off..off + own.len()].copy_from_slice(&back[..own.len()]);
        } else {
            o[unit.clone()].copy_from_slice(&full[..unit.len()]);
        }
    }
    // 3. The update of the elements this rank owns.
    let opt = &mut ch.opt;
    ch.dp.for_each_piece(|piece, params, _| {
        for m in &mats {
            if let Some((rel, st)) = inside(m, piece) {
                opt.muon_apply(&mut params[rel], &o[st.clone()], st.start, h.adjusted(whole_shape(m, ntp)), h.decay);
            }
        }
    });
}

/// Where a matrix meets a piece: its elements relative to the piece, and their state positions.
fn inside(m: &MuonMatrix, piece: &parallel::Piece) -> Option<(std::ops::Range<usize>, std::ops::Range<usize>)> {
    let f = &piece.flat;
    let (a, b) = (m.range.start.max(f.start), m.range.end.min(f.end));
    (a < b).then(|| (a - f.start..b - f.start, piece.shard.start + a - f.start..piece.shard.start + b - f.start))
}

/// The iteration over one unit's matrices `here` (ranges in the layout; `unit` holds the unit's
/// updates from layout position `at`): each matrix gathered whole over the tensor-parallel
/// group, orthogonalised by its owner, and given back (each rank's part in its place in
/// `unit`; zeros for the matrices other data-parallel ranks' groups own).
fn iterate_unit(unit: &mut [f32], at: usize, (mats, here, owner): (&[MuonMatrix], &[usize], &[usize]), (me, ntp, tp): (usize, usize, Option<&dyn parallel::Comm>), h: &MuonStep) {
    let rel = |m: &MuonMatrix| m.range.start - at..m.range.end - at;
    // Every tensor-parallel rank's parts of the split matrices, in one all-gather.
    let split: Vec<usize> = here.iter().copied().filter(|&k| tp_split(&mats[k], ntp)).collect();
    let parts = match (tp, split.is_empty()) {
        (Some(c), false) => {
            let mine: Vec<f32> = split.iter().flat_map(|&k| unit[rel(&mats[k])].to_vec()).collect();
            parallel::tp::gather(c, &mine)
        }
        _ => Vec::new(),
    };
    let group = me / ntp * ntp;
    let mut results = vec![0.0f32; unit.len()];
    let mut whole_results: Vec<f32> = Vec::new();
    let mut at_part = 0;
    for &k in here {
        let m = &mats[k];
        let mine = owner[k] == me;
        if tp_split(m, ntp) {
            let len = m.range.len();
            let pieces: Vec<&[f32]> = parts.iter().map(|p| &p[at_part..at_part + len]).collect();
            at_part += len;
            let (mut x, shape) = parallel::tp::assemble(m.split, m.shape, &pieces);
            if mine {
                tensor::optim::newton_schulz(&mut x, shape, &h.ns);
            } else {
                x.fill(0.0);
            }
            whole_results.extend_from_slice(&x);
        } else if mine {
            let mut x = unit[rel(m)].to_vec();
            tensor::optim::newton_schulz(&mut x, m.shape, &h.ns);
            results[rel(m)].copy_from_slice(&x);
        }
    }
    // The split matrices' results: summed over the group (one owner each), each rank's part kept.
    if let (Some(c), false) = (tp, whole_results.is_empty()) {
        c.all_reduce_sum(&mut whole_results);
        let mut at_whole = 0;
        for &k in &split {
            let m = &mats[k];
            let shape = whole_shape(m, ntp);
            let n = shape.0 * shape.1;
            parallel::tp::part_of(m.split, shape, &whole_results[at_whole..at_whole + n], (c.rank(), ntp), &mut results[rel(m)]);
            at_whole += n;
        }
    }
    // Unsplit matrices owned inside this tensor-parallel group but not by this rank: summed too.
    if let Some(c) = tp.filter(|c| c.size() > 1) {
        let unsplit: Vec<usize> = here.iter().copied().filter(|&k| !tp_split(&mats[k], ntp) && owner[k] >= group && owner[k] < group + ntp).collect();
        if !unsplit.is_empty() {
            let mut buf: Vec<f32> = unsplit.iter().flat_map(|&k| results[rel(&mats[k])].to_vec()).collect();
            c.all_reduce_sum(&mut buf);
            let mut a = 0;
            for &k in &unsplit {
                let r = rel(&mats[k]);
                let n = r.len();
                results[r].copy_from_slice(&buf[a..a + n]);
                a += n;
            }
        }
    }
    unit.copy_from_slice(&results);
}
