//! Parallelism applied in one place (torchtitan's `parallelize_llama`): [`parallelize`] turns
//! the whole model into this rank's parts, in a fixed order, each step the identity at degree 1:
//!
//! 1. the mesh's groups (`pp × dp × ep × cp × tp`, tp fastest: tensor-parallel peers are
//!    neighbours, pipeline stages farthest apart);
//! 2. the pipeline stage: this rank's chunks' layers, cut by name (`pp::stage_config`, `cut`);
//! 3. the tensor-parallel or expert-parallel shard of each chunk (`tp::local_config` + `shard`,
//!    `ep::local_config` + `shard`), with the hooks the model calls at its branch boundaries
//!    and MoE exchanges;
//! 4. recomputation, precision (and FP8's scaling state) and the batch offset;
//! 5. data parallel / ZeRO (`DataParallel`) over the data-parallel group.
//!
//! Its inverse lives beside it: [`Applied::gather_whole`] rebuilds a whole-model buffer
//! (parameters or optimizer moments) from every rank's parts, for checkpoints, samples and
//! exports, and [`Applied::cut`] cuts any whole-model buffer as the parameters were cut.

use crate::comm::{mesh_group, Comm};
use crate::dp::DataParallel;
use crate::mesh::{Axis, DeviceMesh};
use crate::{ep, pp, tp};
use model::gpt::{Fp8State, Precision, Recompute};
use model::{Gpt, GptConfig, ParamLayout};
use std::ops::Range;

/// How the whole model is spread: the degrees, the pipeline split, and what every part gets.
#[derive(Clone, Debug)]
pub struct Strategy {
    pub pp: usize,
    pub dp: usize,
    pub ep: usize,
    pub tp: usize,
    /// Context-parallel ranks, how they compute attention, and whether they hold zig-zag chunks.
    pub cp: usize,
    pub cp_mode: plan::policy::CpMode,
    pub cp_zigzag: bool,
    /// Model chunks per pipeline rank (1 unless interleaved).
    pub virtual_stages: usize,
    /// Each pipeline stage's layers (`pp · virtual_stages` of them; one for no pipeline).
    pub stages: Vec<Range<usize>>,
    pub sequence_parallel: bool,
    /// ZeRO stage 0–3.
    pub zero: u8,
    /// Elements per data-parallel gradient bucket.
    pub bucket_elems: usize,
    /// Sequences per micro-batch (the global micro-batch, split over the `dp × ep` ranks).
    pub micro_batch: usize,
    pub recompute: Recompute,
    pub recompute_every: usize,
    pub precision: Precision,
    /// FP8's amax history length (with `Precision::Fp8`).
    pub fp8_amax_history: usize,
    /// Activation compression of the kept activations, and its rounding.
    pub act_compression: (plan::policy::ActCompression, plan::policy::ActRounding),
    /// ZeRO++ on the data-parallel group's ZeRO-3 collectives.
    pub zeropp: crate::zeropp::ZeroPp,
}

/// One model chunk of this rank: the part of the whole model it holds, behind its data-parallel
/// store, and the gradient ranges the norm and the update treat specially.
pub struct Part {
    pub model: Gpt,
    pub dp: DataParallel,
    /// Tensor parallelism: ranges whose gradients are identical on every tp rank (counted once
    /// in the norm).
    pub replicated: Vec<Range<usize>>,
    /// Tensor parallelism: the ranges whose gradients are partial per tp rank
    /// (`tp::partial_gradient_ranges`: per-head norms; with sequence parallelism, the norms).
    pub seq_partial: Vec<Range<usize>>,
}

/// This rank's communicators and places in the mesh.
pub struct Groups {
    /// The tensor-parallel group (whole-model gathers, the gradient norm).
    pub tp: Box<dyn Comm>,
    /// The expert-parallel group (whole-model gathers).
    pub ep: Box<dyn Comm>,
    /// The pipeline group.
    pub pp: Box<dyn Comm>,
    /// The context-parallel group.
    pub cp: Box<dyn Comm>,
    /// The first and last pipeline stages, which share a tied embedding.
    pub tie: Box<dyn Comm>,
    /// This rank's place among the `dp × ep` ranks that split the batch, and their count
    /// (context-parallel ranks share their rows; they are in the data-parallel store's group,
    /// which reduces gradients over `dp × ep × cp`).
    pub dp_rank: usize,
    pub dp_size: usize,
    pub tp_rank: usize,
    pub pp_rank: usize,
    pub ep_rank: usize,
    pub cp_rank: usize,
}

/// What [`parallelize`] did, kept for its inverse.
pub struct Applied {
    pub groups: Groups,
    /// The whole model's config and layout.
    pub whole: GptConfig,
    pub full_layout: ParamLayout,
    pub stages: Vec<Range<usize>>,
    /// Each chunk's layout before the tensor- or expert-parallel cut, and its final config.
    stage_layouts: Vec<ParamLayout>,
    locals: Vec<GptConfig>,
    strategy: Strategy,
}

/// One virtual stage's expert communicators: the experts' gradient group (dp × cp), the
/// expert-parallel hooks' group (ep) and the group that splits the batch (dp × ep × cp).
type ExpertComms = (Box<dyn Comm>, Box<dyn Comm>, Box<dyn Comm>);

/// This rank's parts of `whole` under `s` (see the module comment for the order), over the
/// world communicator `comm` (collective: every rank calls it). The error names the config key
/// that does not fit.
pub fn parallelize(whole: Gpt, s: &Strategy, comm: &dyn Comm) -> Result<(Vec<Part>, Applied), String> {
    // 1. The mesh and this rank's groups: per model chunk, the data-parallel store's (with
    // expert parallelism the whole dp × ep group, which splits the batch, plus the dp group for
    // the experts and the ep group for the MoE exchange) and the tensor-parallel hooks'; one
    // tensor-parallel and one ep group for whole-model gathers and the gradient norm; the
    // pipeline group. (The order of the splits is the same on every rank.)
    let (world, rank, vn) = (comm.size(), comm.rank(), s.virtual_stages);
    let mesh = DeviceMesh::new(&[(Axis::Pp, s.pp), (Axis::Dp, s.dp), (Axis::Ep, s.ep), (Axis::Cp, s.cp), (Axis::Tp, s.tp)], world)?;
    // Context-parallel ranks reduce gradients with the data-parallel ones (each holds partial
    // sums over its positions), so the store's group, the experts' (dp × cp) and the MoE
    // statistics' span them too.
    let data_group = mesh.group_axes(&[Axis::Dp, Axis::Ep, Axis::Cp], rank);
    let expert_group = mesh.group_axes(&[Axis::Dp, Axis::Cp], rank);
    let dp_comms: Vec<Box<dyn Comm>> = (0..vn).map(|_| comm.split(&data_group)).collect();
    let ep_comms: Vec<ExpertComms> =
        (0..vn).map(|_| (comm.split(&expert_group), mesh_group(comm, &mesh, Axis::Ep), comm.split(&data_group))).collect();
    let cp_hooks_comms: Vec<Box<dyn Comm>> = (0..vn).map(|_| mesh_group(comm, &mesh, Axis::Cp)).collect();
    let cp_comm = mesh_group(comm, &mesh, Axis::Cp);
    let ep_comm = mesh_group(comm, &mesh, Axis::Ep);
    let tp_hooks_comms: Vec<Box<dyn Comm>> = (0..vn).map(|_| mesh_group(comm, &mesh, Axis::Tp)).collect();
    let tp_comm = mesh_group(comm, &mesh, Axis::Tp);
    let pp_comm = mesh_group(comm, &mesh, Axis::Pp);
    let (cp_rank, tp_rank, pp_rank, ep_rank) = (cp_comm.rank(), tp_comm.rank(), pp_comm.rank(), ep_comm.rank());
    let dp_rank = dp_comms[0].rank() / s.cp;
    let dp_size = s.dp * s.ep;
    let mut tie_group = if pp_rank == 0 || pp_rank + 1 == s.pp { vec![0, s.pp - 1] } else { vec![pp_rank] };
    tie_group.dedup();
    let tie_comm = pp_comm.split(&tie_group);
    let groups = Groups { tp: tp_comm, ep: ep_comm, pp: pp_comm, cp: cp_comm, tie: tie_comm, dp_rank, dp_size, tp_rank, pp_rank, ep_rank, cp_rank };

    // 2. The pipeline stage: this rank's chunks (the whole model without a pipeline).
    let (whole_cfg, full_layout, real_vocab) = (whole.cfg.clone(), whole.layout.clone(), whole.real_vocab);
    let chunks: Vec<Gpt> = if s.stages.len() > 1 {
        (0..vn)
            .map(|c| {
                let mut st = Gpt::zeroed(pp::stage_config(&whole_cfg, s.stages[c * s.pp + pp_rank].clone()), real_vocab);
                st.params = pp::cut(&full_layout, &whole.params, &st.layout);
                st
            })
            .collect()
    } else {
        vec![whole]
    };
    let mut applied = Applied { groups, whole: whole_cfg, full_layout, stages: s.stages.clone(), stage_layouts: Vec::new(), locals: Vec::new(), strategy: s.clone() };
    let rows = s.micro_batch / dp_size;
    let mut parts = Vec::new();
    for ((((mut m, dp_comm), tp_hooks), (expert_comm, ep_hooks, batch)), cp_hooks) in chunks.into_iter().zip(dp_comms).zip(tp_hooks_comms).zip(ep_comms).zip(cp_hooks_comms) {
        applied.stage_layouts.push(m.layout.clone());
        // 3. The tensor-parallel shard: its heads, MLP columns and vocabulary rows.
        let (mut replicated, mut seq_partial) = (Vec::new(), Vec::new());
        if s.tp > 1 {
            let mut local = Gpt::zeroed(tp::local_config(&m.cfg, s.tp, tp_rank, s.sequence_parallel)?, m.real_vocab);
            local.params = tp::shard(&m.layout, &m.params, &local.layout, tp_rank, s.tp);
            local.hooks.tensor = Some(Box::new(tp::TpComm { comm: tp_hooks, c: m.cfg.n_embd }));
            replicated = tp::replicated_ranges(&local.layout);
            seq_partial = tp::partial_gradient_ranges(&local.layout, local.cfg.place.seq.is_some());
            m = local;
        }
        // ... or the expert-parallel shard: this rank's block of experts, by name, the exchange
        // over the ep group. MoE layers sum their load-balancing statistics over the ranks that
        // split the batch or its positions (so the loss is one rank's), through the same hooks.
        let route = (m.cfg.is_moe() && dp_size * s.cp > 1).then_some(batch);
        if s.ep > 1 {
            let mut local = Gpt::zeroed(ep::local_config(&m.cfg, s.ep, ep_rank)?, m.real_vocab);
            local.params = ep::shard(&m.layout, &m.params, &local.layout);
            local.hooks.experts = Some(Box::new(ep::EpComm { comm: ep_hooks, batch: route }));
            m = local;
        } else if route.is_some() {
            m.hooks.experts = Some(Box::new(ep::EpComm { comm: ep_hooks, batch: route }));
        }
        // ... and the context-parallel part: this rank's positions of every sequence, attention
        // across the cp group.
        if s.cp > 1 {
            let slice = model::config::ContextSlice { index: cp_rank, count: s.cp, zigzag: s.cp_zigzag };
            m.cfg.place.context = Some(slice);
            m.hooks.context = Some(Box::new(crate::cp::CpComm::new(cp_hooks, slice, s.cp_mode)));
        }
        // 4. Recomputation, precision, and where this rank's sequences start in each
        // micro-batch (dropout masks are drawn by global sequence).
        (m.recompute, m.recompute_every) = (s.recompute, s.recompute_every);
        m.precision = s.precision;
        m.act_compression = s.act_compression;
        if s.precision == Precision::Fp8 {
            m.fp8 = Some(std::cell::RefCell::new(Fp8State::new(m.cfg.n_layer, s.fp8_amax_history)));
        }
        m.cfg.place.batch_offset = dp_rank * rows;
        applied.locals.push(m.cfg.clone());
        // 5. Data parallel / ZeRO over the data-parallel group.
        let dp = if s.ep > 1 {
            DataParallel::new_ep(dp_comm, expert_comm, ep::expert_ranges(&m.layout), &mut m, s.bucket_elems)
        } else {
            let mut dp = DataParallel::new(dp_comm, &mut m, s.zero, s.bucket_elems);
            dp.set_zeropp(s.zeropp);
            dp
        };
        parts.push(Part { model: m, dp, replicated, seq_partial });
    }
    Ok((parts, applied))
}

impl Applied {
    /// Whether this rank holds a part of the whole model rather than all of it (a pipeline
    /// stage, a tensor- or an expert-parallel shard).
    pub fn is_part(&self) -> bool {
        self.stages.len() > 1 || self.strategy.tp > 1 || self.strategy.ep > 1
    }

    /// A whole-model buffer laid out as [`Applied::full_layout`] (parameters, or an optimizer
    /// moment) cut as this rank's chunks' parameters were: per chunk, its stage's layers, then
    /// its tensor- or expert-parallel shard. Without a cut, `whole` itself.
    pub fn cut(&self, whole: Vec<f32>) -> Vec<Vec<f32>> {
        if !self.is_part() {
            return vec![whole];
        }
        let s = &self.strategy;
        (0..self.locals.len())
            .map(|c| {
                let stage = &self.stage_layouts[c];
                let cut = (self.stages.len() > 1).then(|| pp::cut(&self.full_layout, &whole, stage));
                let buf = cut.as_deref().unwrap_or(&whole);
                let local = model::layout::gpt_layout(&self.locals[c]).0;
                if s.tp > 1 {
                    tp::shard(stage, buf, &local, self.groups.tp_rank, s.tp)
                } else if s.ep > 1 {
                    ep::shard(stage, buf, &local)
                } else {
                    buf.to_vec()
                }
            })
            .collect()
    }

    /// The whole model's buffer from this rank's chunks' `bufs` (each laid out as its part):
    /// collective over the tensor-parallel, expert-parallel and pipeline groups. The inverse of
    /// [`Applied::cut`].
    pub fn gather_whole(&self, bufs: Vec<Vec<f32>>) -> Vec<f32> {
        let per_stage: Vec<Vec<f32>> = bufs.into_iter().enumerate().map(|(c, b)| self.unshard(c, b)).collect();
        if self.stages.len() == 1 {
            return per_stage.into_iter().next().unwrap();
        }
        let refs: Vec<&[f32]> = per_stage.iter().map(|b| &b[..]).collect();
        pp::gather_whole(&*self.groups.pp, &self.whole, &self.stages, &refs)
    }

    /// Chunk `c`'s stage buffer from this rank's tensor- or expert-parallel shard `local`
    /// (collective over `tp`, or `ep`; the identity without either).
    fn unshard(&self, c: usize, local: Vec<f32>) -> Vec<f32> {
        let (tpc, epc) = (&*self.groups.tp, &*self.groups.ep);
        let group = if tpc.size() > 1 { tpc } else { epc };
        if group.size() == 1 {
            return local;
        }
        let shards = tp::gather(group, &local);
        let refs: Vec<&[f32]> = shards.iter().map(|s| &s[..]).collect();
        let (full, local_cfg) = (&self.stage_layouts[c], &self.locals[c]);
        if tpc.size() > 1 {
            return tp::unshard(full, &refs, &model::layout::gpt_layout(local_cfg).0);
        }
        let layouts: Vec<ParamLayout> = (0..epc.size()).map(|r| ep::layout_of(local_cfg, r)).collect();
        ep::unshard(full, &refs, &layouts)
    }

    /// The whole model's FP8 amax histories, from every pipeline stage's chunks (`models`, this
    /// rank's) in layer order: collective over the pipeline group.
    pub fn fp8_histories(&self, models: &[&Gpt]) -> Vec<Vec<f32>> {
        let pp = &*self.groups.pp;
        // Per chunk: first layer, slot count, history length, the values (slot-major).
        let mut mine: Vec<f64> = Vec::new();
        for m in models {
            let h = m.fp8.as_ref().expect("fp8 state on every chunk").borrow().history();
            let len = h.first().map_or(0, |x| x.len());
            assert!(h.iter().all(|x| x.len() == len), "every fp8 slot has the same history length");
            mine.extend([m.cfg.first_layer() as f64, h.len() as f64, len as f64]);
            mine.extend(h.iter().flatten().map(|&x| x as f64));
        }
        // Equal lengths for the all-gather: padded to the longest.
        let n = crate::comm::all_gather_f64(pp, &[mine.len() as f64]).into_iter().fold(0.0, f64::max) as usize;
        let real = mine.len();
        mine.resize(n + 1, 0.0);
        mine[n] = real as f64;
        let all = crate::comm::all_gather_f64(pp, &mine);
        let mut stages: Vec<(usize, Vec<Vec<f32>>)> = Vec::new();
        for r in all.chunks(n + 1) {
            let (mut i, end) = (0, r[n] as usize);
            while i < end {
                let (first, slots, len) = (r[i] as usize, r[i + 1] as usize, r[i + 2] as usize);
                i += 3;
                stages.push((first, (0..slots).map(|k| r[i + k * len..i + (k + 1) * len].iter().map(|&x| x as f32).collect()).collect()));
                i += slots * len;
            }
        }
        stages.sort_by_key(|s| s.0);
        stages.into_iter().flat_map(|s| s.1).collect()
    }
}
