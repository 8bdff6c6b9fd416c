//! One optimizer step, shared by `kiln train` and `kiln bench`: micro-batch forward/backward
//! with gradient accumulation through the data-parallel store (one rank or many, any ZeRO
//! stage), global-norm clipping, and AdamW over the pieces this rank owns.

use crate::config::{OptimName, RunConfig};
use model::gpt::Activations;
use model::{Gpt, Pass};
use parallel::pp;
use parallel::DataParallel;
use std::ops::Range;
use std::time::Instant;
use tensor::rng::mix64;
use tensor::{adamw_update, profile, scale_in_place, sum_squares, AdamW};

pub mod lean;
pub mod muon;

/// Where AdamW's moments live: in memory, or (ZeRO-Infinity's NVMe tier, on a CPU) in a
/// memory-mapped file that the update streams through in chunks, handing each chunk's pages
/// back to the kernel once updated, so they stay out of the process's resident memory.
pub enum Moments {
    Mem(Vec<f32>),
    File { map: memmap2::MmapMut, len: usize },
}

impl std::ops::Deref for Moments {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            Moments::Mem(v) => v,
            // SAFETY: the map is `len` f32s long and page-aligned (so f32-aligned).
            Moments::File { map, len } => unsafe { std::slice::from_raw_parts(map.as_ptr() as *const f32, *len) },
        }
    }
}

impl std::ops::DerefMut for Moments {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            Moments::Mem(v) => v,
            Moments::File { map, len } => unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr() as *mut f32, *len) },
        }
    }
}

impl Moments {
    /// `len` zeros in a new file at `path` (replaced if it exists), mapped shared.
    pub fn file(path: &std::path::Path, len: usize) -> std::io::Result<Moments> {
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
        f.set_len((len.max(1) * 4) as u64)?;
        let map = unsafe { memmap2::MmapMut::map_mut(&f)? };
        Ok(Moments::File { map, len })
    }

    /// Replaces the contents with `src` (same length).
    pub fn load(&mut self, src: &[f32]) {
        self.copy_from_slice(src);
        self.release(0..src.len());
    }

    /// Gives the pages of elements `r` back to the kernel (file-backed: the data stays in the
    /// file and the page cache; the process's resident set drops). No-op in memory.
    pub fn release(&mut self, r: Range<usize>) {
        if let Moments::File { map, .. } = self {
            let page = 4096;
            let (a, b) = ((r.start * 4).div_ceil(page) * page, (r.end * 4) / page * page);
            if b > a {
                // SAFETY: a shared file mapping: dropping its pages loses nothing.
                let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, a, b - a) };
            }
        }
    }
}

/// AdamW state: the two moments (in the layout, or in this rank's ZeRO shard), and the
/// layout's contiguous ranges grouped by whether weight decay applies.
pub struct Optimizer {
    pub m: Moments,
    pub v: Moments,
    /// Mixed precision: the fp32 master weights (laid out like the moments); the working
    /// parameters the passes read are these rounded to `round`. `None`: the parameters are the
    /// fp32 weights themselves.
    pub master: Option<Master>,
    pub round: Option<tensor::precision::Format>,
    segs: Vec<(Range<usize>, bool)>,
    /// Muon's split of the layout: its matrices, and what AdamW takes instead (the rest,
    /// grouped as `segs`).
    pub(crate) muon: Vec<MuonMatrix>,
    muon_rest: Vec<(Range<usize>, bool)>,
    /// Every parameter tensor: its range, `(rows, cols)` (a vector `(n, 1)`) and whether it
    /// decays (Adafactor's statistics are per tensor).
    tensors: Vec<(Range<usize>, (usize, usize), bool)>,
    /// Communication compression's state (`parallel.compression`), from the first compressed
    /// step on (restored with a checkpoint).
    pub compression: Option<CompressionState>,
    /// AdamW's compact state (`optim.state`); `m` and `v` are then empty.
    pub lean: Option<lean::Lean>,
    /// Adafactor's statistics, held compact ([`Optimizer::factor`]); `m` and `v` are then empty.
    pub factored: Option<Factored>,
    /// Muon: `v` holds the second moment of AdamW's elements alone ([`Optimizer::compact_v`]):
    /// per run of them, its first position in the moments, its offset in `v`, its length.
    v_runs: Option<Vec<(usize, usize, usize)>>,
    /// Elements of each moment (this rank's share of the layout).
    len: usize,
    /// The sigmoid router's correction biases (`model.moe_bias_rate`): moved by the rate against
    /// the sign of their gradient slot (the balancing signal the model writes there), never by
    /// the optimizer.
    sign: Vec<Range<usize>>,
}

/// Adafactor's statistics alone: each tensor's row and column averages (a vector's second
/// moment), back to back, where the moments' layout would hold them at the tensor's first
/// position and nothing else.
pub struct Factored {
    pub state: Vec<f32>,
    /// Per tensor of the layout: its first position in the moments, its statistics' offset in
    /// `state`, their length.
    runs: Vec<(usize, usize, usize)>,
}

impl Factored {
    /// The second moment as the moments' layout holds it (`len` elements): each tensor's
    /// statistics at its first position, zeros elsewhere (what a checkpoint stores).
    pub fn expanded(&self, len: usize) -> Vec<f32> {
        let mut v = vec![0.0; len];
        for &(at, off, n) in &self.runs {
            v[at..at + n].copy_from_slice(&self.state[off..off + n]);
        }
        v
    }
}

/// One matrix Muon updates: its range in the layout, its `[out, in]` shape there, and how
/// tensor parallelism cuts the whole matrix (`parallel::tp::split_of` its name).
#[derive(Clone, Debug)]
pub(crate) struct MuonMatrix {
    pub range: Range<usize>,
    pub shape: (usize, usize),
    pub split: parallel::tp::Split,
}

/// Mixed precision's fp32 master weights, laid out like the moments.
pub enum Master {
    /// Whole fp32 weights (fp16's, and any offloaded to a file).
    F32(Moments),
    /// bf16: each master weight is its working weight (the parameter the passes read, rounded
    /// with ties away from zero) and these low 16 bits (`tensor::precision::split_bf16`):
    /// 2 bytes beside the working weight instead of 4, and exactly the fp32 master weight.
    Low(Vec<u16>),
}

impl Master {
    /// The fp32 master weights of `dp`'s pieces (what a checkpoint stores), laid out like the
    /// moments.
    pub fn whole(&self, dp: &mut DataParallel) -> Vec<f32> {
        match self {
            Master::F32(mw) => mw.to_vec(),
            Master::Low(low) => {
                let mut x = vec![0.0; low.len()];
                self.join_into(&mut x, dp);
                x
            }
        }
    }

    /// [`Master::whole`] into `dst` (laid out like the moments).
    fn join_into(&self, dst: &mut [f32], dp: &mut DataParallel) {
        match self {
            Master::F32(mw) => dst.copy_from_slice(mw),
            Master::Low(low) => dp.for_each_piece(|piece, params, _| tensor::precision::join_bf16_into(&mut dst[piece.shard.clone()], params, &low[piece.shard.clone()])),
        }
    }
}

/// What a compressor keeps between steps on one rank.
#[derive(Clone, Debug)]
pub enum CompressionState {
    OneBit(parallel::compress::OneBit),
    PowerSgd(parallel::compress::PowerSgd),
    ZeroOne(ZeroOneState),
}

/// 0/1 Adam's state on one rank (`parallel.compression = zero_one_adam`): the 1-bit
/// all-reduce's error feedback (of gradients before the variance freezes, of accumulated moves
/// after), and for the local steps the parameters at the last sync (`anchor`, the same on every
/// rank), this rank's moves since (`acc`), the product of the weight-decay factors `1 − lr·wd`
/// since (`decay`: a decayed parameter is `anchor·decay − acc`, any other `anchor − acc`), the
/// sum of the bias-corrected learning rates since (`lrs`), and whether the anchor was taken
/// (`anchored`: the first local step that runs takes it, whichever step that is). The
/// checkpoint row adds the rank's own momentum ([`Optimizer::compression_row`]).
///
/// Weight decay stays out of the moves: DeepSpeed's `ZeroOneAdam` adds `lr·wd·p` to them, so
/// every sync folds the decay into the momentum, which then applies it again (about `1/(1 −
/// β1)` times the decay at a sync interval of 1). Here the decay scales the anchor instead,
/// the same on every rank, which is AdamW's decoupled decay exactly.
#[derive(Clone, Debug)]
pub struct ZeroOneState {
    pub onebit: parallel::compress::OneBit,
    pub acc: Vec<f32>,
    pub anchor: Vec<f32>,
    pub lrs: f64,
    pub decay: f64,
    pub anchored: bool,
}

impl ZeroOneState {
    fn new(len: usize, n: usize, rank: usize) -> ZeroOneState {
        ZeroOneState { onebit: parallel::compress::OneBit::new(len, n, rank), acc: vec![0.0; len], anchor: vec![0.0; len], lrs: 0.0, decay: 1.0, anchored: false }
    }

    /// Elements of [`CompressionState::state`] for a `len`-element store over `n` ranks.
    pub fn state_len(len: usize, n: usize) -> usize {
        parallel::compress::OneBit::state_len(len, n) + 2 * len + 5
    }

    /// The anchor's factor for a segment: the decay since the sync where weight decay applies.
    fn decay_for(&self, h: &AdamW) -> f32 {
        if h.weight_decay != 0.0 {
            self.decay as f32
        } else {
            1.0
        }
    }
}

/// An f64 as two f32 bit patterns (a checkpoint row is f32; never computed with).
fn f64_words(x: f64) -> [f32; 2] {
    let b = x.to_bits();
    [f32::from_bits(b as u32), f32::from_bits((b >> 32) as u32)]
}

fn words_f64(w: &[f32]) -> f64 {
    f64::from_bits(w[0].to_bits() as u64 | (w[1].to_bits() as u64) << 32)
}

impl CompressionState {
    /// Fresh state for `cfg`'s compressor over a store of `len` elements laid out as `layout`
    /// (rank `rank` of `n`).
    pub fn new(cfg: &RunConfig, layout: &model::ParamLayout, len: usize, n: usize, rank: usize) -> CompressionState {
        match cfg.parallel.compression {
            crate::config::Compression::PowerSgd => CompressionState::PowerSgd(powersgd_state(cfg, layout, len)),
            crate::config::Compression::ZerooneAdam => CompressionState::ZeroOne(ZeroOneState::new(len, n, rank)),
            _ => CompressionState::OneBit(parallel::compress::OneBit::new(len, n, rank)),
        }
    }

    /// As one buffer (for checkpoints: row `rank` of `checkpoint::COMPRESSION_STATE`).
    pub fn state(&self) -> Vec<f32> {
        match self {
            CompressionState::OneBit(o) => o.state(),
            CompressionState::PowerSgd(p) => p.state(),
            CompressionState::ZeroOne(z) => {
                let mut v = z.onebit.state();
                v.extend_from_slice(&z.acc);
                v.extend_from_slice(&z.anchor);
                v.extend(f64_words(z.lrs));
                v.extend(f64_words(z.decay));
                v.push(if z.anchored { 1.0 } else { 0.0 });
                v
            }
        }
    }

    pub fn state_len(&self) -> usize {
        match self {
            CompressionState::OneBit(o) => o.worker.len() + o.server.len(),
            CompressionState::PowerSgd(p) => p.err.len() + p.q.len(),
            CompressionState::ZeroOne(z) => z.onebit.worker.len() + z.onebit.server.len() + z.acc.len() + z.anchor.len() + 5,
        }
    }

    pub fn set_state(&mut self, s: &[f32]) {
        match self {
            CompressionState::OneBit(o) => o.set_state(s),
            CompressionState::PowerSgd(p) => p.set_state(s),
            CompressionState::ZeroOne(z) => {
                let e = z.onebit.worker.len() + z.onebit.server.len();
                let len = z.acc.len();
                z.onebit.set_state(&s[..e]);
                z.acc.copy_from_slice(&s[e..e + len]);
                z.anchor.copy_from_slice(&s[e + len..e + 2 * len]);
                let w = &s[e + 2 * len..];
                (z.lrs, z.decay, z.anchored) = (words_f64(&w[0..2]), words_f64(&w[2..4]), w[4] != 0.0);
            }
        }
    }
}

/// Elements per chunk of an offloaded update (4 MiB of each moment).
const OFFLOAD_CHUNK: usize = 1 << 20;

impl Optimizer {
    /// Moments for the whole `layout`.
    pub fn new(layout: &model::ParamLayout) -> Optimizer {
        Self::with_len(layout, layout.total)
    }

    /// Moments of `len` elements (a ZeRO shard: see [`parallel::Piece`]).
    pub fn with_len(layout: &model::ParamLayout, len: usize) -> Optimizer {
        let is_bias = |p: &model::ParamSpec| p.name.ends_with("e_score_correction_bias");
        let groups = |skip: &dyn Fn(&model::ParamSpec) -> bool| {
            let mut segs: Vec<(Range<usize>, bool)> = Vec::new();
            for p in layout.params.iter().filter(|p| !skip(p) && !is_bias(p) && !p.is_empty()) {
                match segs.last_mut() {
                    Some((r, d)) if *d == p.decay && r.end == p.offset => r.end = p.offset + p.len(),
                    _ => segs.push((p.range(), p.decay)),
                }
            }
            segs
        };
        let muon = layout.params.iter().filter(|p| muon_matrix(p)).map(|p| MuonMatrix { range: p.range(), shape: (p.shape[0], p.shape[1]), split: parallel::tp::split_of(&p.name) }).collect();
        let (segs, muon_rest) = (groups(&|_| false), groups(&muon_matrix));
        let tensors = layout.params.iter().filter(|p| !p.is_empty() && !is_bias(p)).map(|p| {
            // A row or column (rows + cols > rows·cols) keeps its statistics unfactored.
            let shape = match p.shape[..] {
                [r, c] if r > 1 && c > 1 => (r, c),
                _ => (p.len(), 1),
            };
            (p.range(), shape, p.decay)
        }).collect();
        let sign = layout.params.iter().filter(|p| is_bias(p) && !p.is_empty()).map(|p| p.range()).collect();
        Optimizer { m: Moments::Mem(vec![0.0; len]), v: Moments::Mem(vec![0.0; len]), master: None, round: None, segs, muon, muon_rest, tensors, compression: None, lean: None, factored: None, v_runs: None, len, sign }
    }

    /// Muon: keeps the second moment for the elements AdamW updates alone (the embeddings, the
    /// head, norms, biases), back to back, instead of for every element: Muon's matrices have
    /// none. From `v` as laid out (fresh zeros, or a checkpoint's); `pieces` are this rank's.
    pub fn compact_v(&mut self, pieces: &[parallel::Piece]) {
        let (mut runs, mut v) = (Vec::new(), Vec::new());
        for p in pieces {
            let f = &p.flat;
            for (r, _) in &self.muon_rest {
                let (a, b) = (r.start.max(f.start), r.end.min(f.end));
                if a < b {
                    let at = p.shard.start + a - f.start;
                    runs.push((at, v.len(), b - a));
                    v.extend_from_slice(&self.v[at..at + b - a]);
                }
            }
        }
        runs.sort_unstable();
        self.v = Moments::Mem(v);
        self.v_runs = Some(runs);
    }

    /// Where the second moment of the run of elements at moment position `at` is held: `at`, or
    /// with a compact `v` its offset there.
    fn v_at(&self, at: usize) -> usize {
        let Some(runs) = &self.v_runs else { return at };
        let k = runs.partition_point(|r| r.0 <= at) - 1;
        let (start, off, n) = runs[k];
        assert!(at < start + n, "an element AdamW does not update has no second moment");
        off + at - start
    }

    /// Adafactor: keeps only its statistics, compact (from the second moment as laid out:
    /// fresh zeros, or a checkpoint's), and frees both moments: its state is then sublinear in
    /// the matrices' size, as the algorithm means it to be. `pieces` are this rank's.
    pub fn factor(&mut self, pieces: &[parallel::Piece]) {
        let (mut runs, mut state) = (Vec::with_capacity(self.tensors.len()), Vec::new());
        for (r, shape, _) in &self.tensors {
            let Some(p) = pieces.iter().find(|p| p.flat.start <= r.start && r.end <= p.flat.end) else {
                runs.push((0, 0, 0));
                continue;
            };
            let at = p.shard.start + (r.start - p.flat.start);
            let n = if shape.1 > 1 { shape.0 + shape.1 } else { shape.0 };
            runs.push((at, state.len(), n));
            state.extend_from_slice(&self.v[at..at + n]);
        }
        self.factored = Some(Factored { state, runs });
        (self.m, self.v) = (Moments::Mem(Vec::new()), Moments::Mem(Vec::new()));
    }

    /// The first and second moments as the layout holds them (`len` elements each): Lion's
    /// absent second and Adafactor's absent first as zeros, Adafactor's statistics expanded.
    pub fn moments_f32(&self) -> (Vec<f32>, Vec<f32>) {
        let zeros = || vec![0.0; self.len];
        match &self.factored {
            Some(f) => (zeros(), f.expanded(self.len)),
            None => (self.m.to_vec(), self.v_f32()),
        }
    }

    /// Whether `v` is Muon's compact second moment ([`Optimizer::compact_v`]).
    pub fn v_is_compact(&self) -> bool {
        self.v_runs.is_some()
    }

    /// The second moment as the layout holds it: Lion's absent one as zeros, Muon's compact one
    /// expanded (zeros at Muon's matrices).
    pub fn v_f32(&self) -> Vec<f32> {
        match &self.v_runs {
            _ if self.v.is_empty() => vec![0.0; self.len],
            Some(runs) => {
                let mut v = vec![0.0; self.len];
                for &(at, off, n) in runs {
                    v[at..at + n].copy_from_slice(&self.v[off..off + n]);
                }
                v
            }
            None => self.v.to_vec(),
        }
    }

    /// Frees the second buffer for an optimizer that keeps one state (Lion): its checkpoints
    /// hold zeros in its place.
    pub fn keep_only_first_moment(&mut self) {
        self.v = Moments::Mem(Vec::new());
    }

    /// The layout's contiguous ranges, each with whether weight decay applies to it.
    pub fn decay_groups(&self) -> &[(Range<usize>, bool)] {
        &self.segs
    }

    /// Mixed precision: keeps fp32 master weights, taken from the fp32 parameters of `dp`'s
    /// pieces (fresh, or a checkpoint's), and rounds the working parameters to `fmt`. bf16's
    /// master weights are split ([`Master::Low`]), fp16's whole.
    pub fn mixed(&mut self, dp: &mut DataParallel, fmt: tensor::precision::Format) {
        let len = self.len;
        let mut master = if fmt == tensor::precision::Format::Bf16 { Master::Low(vec![0; len]) } else { Master::F32(Moments::Mem(vec![0.0; len])) };
        dp.for_each_piece(|piece, params, _| match &mut master {
            Master::Low(low) => tensor::precision::split_bf16_in_place(params, &mut low[piece.shard.clone()]),
            Master::F32(mw) => {
                mw[piece.shard.clone()].copy_from_slice(params);
                tensor::precision::master_round_into(params, &mw[piece.shard.clone()], fmt);
            }
        });
        dp.after_update();
        (self.master, self.round) = (Some(master), Some(fmt));
    }

    /// Moves the moments (and mixed precision's master weights, whole fp32) to memory-mapped
    /// files `dir/exp_avg.bin`, `dir/exp_avg_sq.bin` (and `dir/master.bin`).
    pub fn offload(&mut self, dir: &std::path::Path, dp: &mut DataParallel) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let len = self.m.len();
        let mut m = Moments::file(&dir.join("exp_avg.bin"), len)?;
        m.load(&self.m);
        self.m = m;
        if !self.v.is_empty() {
            // (Muon's compact second moment is shorter than the moments.)
            let mut v = Moments::file(&dir.join("exp_avg_sq.bin"), self.v.len())?;
            v.load(&self.v);
            self.v = v;
        }
        if let Some(mw) = self.master.as_mut() {
            // Joined (or copied) straight into the file.
            let mut f = Moments::file(&dir.join("master.bin"), len)?;
            mw.join_into(&mut f, dp);
            f.release(0..len);
            *mw = Master::F32(f);
        }
        Ok(())
    }

    /// Applies one AdamW update with learning rate `lr` as step number `t` (1-based) to every
    /// parameter (`params`, `grads` and the moments all in the layout).
    pub fn update(&mut self, params: &mut [f32], grads: &[f32], cfg: &RunConfig, lr: f64, t: u64) {
        let all = 0..params.len();
        self.update_piece(params, grads, &parallel::Piece { flat: all.clone(), shard: all }, cfg, lr, t);
    }

    /// The update of one piece: `params` and `grads` hold layout elements `piece.flat`, whose
    /// state is at `piece.shard`. AdamW and Lion are elementwise, so an element's new value
    /// does not depend on how the layout is cut into pieces; Muon's matrices are updated whole
    /// (each inside one piece: the config refuses layouts that split them).
    pub fn update_piece(&mut self, params: &mut [f32], grads: &[f32], piece: &parallel::Piece, cfg: &RunConfig, lr: f64, t: u64) {
        if cfg.optim.name == OptimName::Adafactor {
            self.sign_update(params, grads, piece, cfg);
            return self.adafactor_piece(params, grads, piece, cfg, (lr, t));
        }
        if cfg.optim.name == OptimName::Muon {
            self.muon_piece(params, grads, piece, cfg, lr);
        }
        self.update_rest(params, grads, piece, cfg, lr, t);
    }

    /// [`Optimizer::update_piece`] but for Muon's matrices (which distributed Muon updates:
    /// `muon`): AdamW or Lion on every other element of the piece.
    pub fn update_rest(&mut self, params: &mut [f32], grads: &[f32], piece: &parallel::Piece, cfg: &RunConfig, lr: f64, t: u64) {
        self.sign_update(params, grads, piece, cfg);
        let muon = cfg.optim.name == OptimName::Muon;
        let f = &piece.flat;
        let segs = std::mem::take(if muon { &mut self.muon_rest } else { &mut self.segs });
        for (r, decay) in &segs {
            let (a, b) = (r.start.max(f.start), r.end.min(f.end));
            if a < b {
                self.elementwise((&mut params[a - f.start..b - f.start], &grads[a - f.start..b - f.start]), (piece.shard.start + a - f.start, a), cfg, (lr, t, *decay));
            }
        }
        *(if muon { &mut self.muon_rest } else { &mut self.segs }) = segs;
    }

    /// The sigmoid router's loss-free balancing (DeepSeek-V3) on the correction biases inside
    /// `piece`: `b ← b − rate·sign(g)`, `g` the step's signal (assignments over their mean, summed
    /// over the micro-batches and ranks), on the master weights under mixed precision.
    fn sign_update(&mut self, params: &mut [f32], grads: &[f32], piece: &parallel::Piece, cfg: &RunConfig) {
        let rate = cfg.model.moe_bias_rate as f32;
        let f = &piece.flat;
        for k in 0..self.sign.len() {
            let r = &self.sign[k];
            let (a, b) = (r.start.max(f.start), r.end.min(f.end));
            if a >= b || rate == 0.0 {
                continue;
            }
            let g = &grads[a - f.start..b - f.start];
            let at = piece.shard.start + a - f.start;
            on_master(&mut self.master, self.round, (&mut params[a - f.start..b - f.start], at), Span::Pieces, |w, rr| {
                for (w, &g) in w.iter_mut().zip(&g[rr]) {
                    if g != 0.0 {
                        *w -= rate * g.signum();
                    }
                }
            });
        }
    }

    /// AdamW's or Lion's update of one run of elements whose state starts at `at` (and which
    /// starts at `flat` in the layout), at learning rate `lr`, step `t`, with or without weight
    /// decay. Offloaded state streams through in chunks, each released once updated.
    fn elementwise(&mut self, (params, grads): (&mut [f32], &[f32]), (at, flat): (usize, usize), cfg: &RunConfig, (lr, t, decay): (f64, u64, bool)) {
        let tc = &cfg.train;
        let wd = if decay { tc.weight_decay as f32 } else { 0.0 };
        let h = AdamW { lr: lr as f32, beta1: tc.beta1 as f32, beta2: tc.beta2 as f32, eps: tc.eps as f32, weight_decay: wd, t };
        if self.lean.is_some() {
            return self.lean_update((params, grads), (at, flat), &h);
        }
        let lion = (cfg.optim.name == OptimName::Lion).then_some(tensor::optim::Lion { lr: lr as f32, beta1: tc.beta1 as f32, beta2: tc.beta2 as f32, weight_decay: wd });
        let n = params.len();
        let step = if matches!(self.m, Moments::File { .. }) { OFFLOAD_CHUNK } else { n.max(1) };
        let vat = if lion.is_some() { at } else { self.v_at(at) };
        let mut i = 0;
        while i < n {
            let j = (i + step).min(n);
            let (p, g, e, ve) = (&mut params[i..j], &grads[i..j], at + i..at + j, vat + i..vat + j);
            match (&lion, &mut self.master, self.round) {
                (Some(l), master, round) => {
                    let m = &mut self.m[e.clone()];
                    on_master(master, round, (p, e.start), Span::Pieces, |w, r| tensor::optim::lion_update(w, &g[r.clone()], &mut m[r], l));
                }
                // Mixed precision: AdamW on the fp32 master weights, then the working copy.
                (None, Some(Master::F32(mw)), Some(fmt)) => {
                    let w = &mut mw[e.clone()];
                    adamw_update(w, g, &mut self.m[e.clone()], &mut self.v[ve.clone()], &h);
                    tensor::precision::master_round_into(p, w, fmt);
                    mw.release(e.clone());
                }
                (None, Some(Master::Low(low)), _) => tensor::optim::adamw_update_split(p, &mut low[e.clone()], g, &mut self.m[e.clone()], &mut self.v[ve.clone()], &h),
                _ => adamw_update(p, g, &mut self.m[e.clone()], &mut self.v[ve.clone()], &h),
            }
            self.m.release(e.clone());
            self.v.release(ve);
            i = j;
        }
    }

    /// Muon's update of the matrices inside `piece` (Jordan et al. 2024, as `torch.optim.Muon`):
    /// the momentum, its Newton–Schulz orthogonalisation, and `p = p·(1 − lr·wd) − lr'·O` with
    /// `lr'` the shape-adjusted rate. Muon's rate is `optim.muon_lr` on `train.lr`'s schedule.
    fn muon_piece(&mut self, params: &mut [f32], grads: &[f32], piece: &parallel::Piece, cfg: &RunConfig, lr: f64) {
        let h = MuonStep::new(cfg, lr);
        let f = &piece.flat;
        for k in 0..self.muon.len() {
            let (r, shape) = (self.muon[k].range.clone(), self.muon[k].shape);
            if r.end <= f.start || r.start >= f.end {
                continue;
            }
            assert!(r.start >= f.start && r.end <= f.end, "a Muon matrix split between pieces (distributed Muon updates those)");
            let (i, j) = (r.start - f.start, r.end - f.start);
            let e = piece.shard.start + i..piece.shard.start + j;
            let mut u = vec![0.0f32; j - i];
            h.momentum(&grads[i..j], &mut self.m[e.clone()], &mut u);
            self.m.release(e.clone());
            tensor::optim::newton_schulz(&mut u, shape, &h.ns);
            self.muon_apply(&mut params[i..j], &u, e.start, h.adjusted(shape), h.decay);
        }
    }

    /// Adafactor's update of every tensor inside `piece` (each whole in it: the config refuses
    /// layouts that split them), its second moment in the second buffer's first elements of the
    /// tensor (row then column averages, or a vector's own), at learning rate `lr`, step `t`.
    fn adafactor_piece(&mut self, params: &mut [f32], grads: &[f32], piece: &parallel::Piece, cfg: &RunConfig, (lr, t): (f64, u64)) {
        let (o, f) = (&cfg.optim, &piece.flat);
        for k in 0..self.tensors.len() {
            let (r, shape, decay) = self.tensors[k].clone();
            if r.end <= f.start || r.start >= f.end {
                continue;
            }
            assert!(r.start >= f.start && r.end <= f.end, "an Adafactor tensor split between pieces (the config refuses such layouts)");
            let h = tensor::optim::Adafactor { lr, beta2_decay: o.adafactor_beta2_decay, eps1: f32::EPSILON, eps2: o.adafactor_eps2, d: o.adafactor_d, weight_decay: if decay { cfg.train.weight_decay } else { 0.0 }, t };
            let (i, j) = (r.start - f.start, r.end - f.start);
            let e = piece.shard.start + i;
            let fac = self.factored.as_mut().expect("Adafactor's statistics (Optimizer::factor)");
            let (at, off, n) = fac.runs[k];
            assert_eq!(at, e, "an Adafactor tensor where its statistics were laid out");
            let state = &mut fac.state[off..off + n];
            on_master(&mut self.master, self.round, (&mut params[i..j], e), Span::Whole, |w, _| tensor::optim::adafactor_update(w, &grads[i..j], state, shape, &h));
        }
    }

    /// `p = p·decay − lr·o` on weights whose state starts at `at` (the master weights under
    /// mixed precision, then the working copy).
    pub(crate) fn muon_apply(&mut self, params: &mut [f32], o: &[f32], at: usize, lr: f32, decay: f32) {
        on_master(&mut self.master, self.round, (params, at), Span::Pieces, |w, r| tensor::optim::muon_apply(w, &o[r], lr, decay));
    }
}

/// One Muon step's settings: its learning rate (`optim.muon_lr` on `train.lr`'s schedule), the
/// decay factor `1 − lr·wd`, the momentum and the Newton–Schulz iteration.
pub(crate) struct MuonStep {
    pub lr: f64,
    pub decay: f32,
    pub momentum: f32,
    pub nesterov: bool,
    pub ns: tensor::optim::NewtonSchulz,
    adjust: tensor::optim::MuonAdjust,
}

impl MuonStep {
    /// At the schedule's learning rate `lr` (`train.lr`'s) for this step.
    pub fn new(cfg: &RunConfig, lr: f64) -> MuonStep {
        let o = &cfg.optim;
        let lr = lr * (o.muon_lr / cfg.train.lr);
        let ns = tensor::optim::NewtonSchulz { steps: o.muon_ns_steps, bf16: o.muon_ns_precision == crate::config::NsPrecision::Bf16, ..Default::default() };
        MuonStep { lr, decay: (1.0 - lr * cfg.train.weight_decay) as f32, momentum: o.muon_momentum as f32, nesterov: o.muon_nesterov, ns, adjust: o.muon_adjust_lr.0 }
    }

    /// The momentum of a run of a matrix's elements: `buf` updated, `out` the update to orthogonalise.
    pub fn momentum(&self, grads: &[f32], buf: &mut [f32], out: &mut [f32]) {
        tensor::optim::muon_momentum(grads, buf, out, self.momentum, self.nesterov);
    }

    /// The learning rate for a whole `[out, in]` matrix of this shape.
    pub fn adjusted(&self, shape: (usize, usize)) -> f32 {
        tensor::optim::muon_adjusted_lr(self.lr, self.adjust, shape) as f32
    }
}

/// Whether Muon takes parameter `p`: a 2-D matrix that decays, but not the output head (the
/// embeddings, norms, biases and MoE router do not decay).
pub(crate) fn muon_matrix(p: &model::ParamSpec) -> bool {
    p.shape.len() == 2 && p.decay && !p.name.ends_with("lm_head.weight")
}

/// How much of a run [`on_master`] hands its update at once: all of it (an update that needs
/// the whole tensor), or pieces of `tensor::par::ELEMS` (an elementwise one: bf16 master
/// weights are then joined and split a cache-sized piece at a time, with no run-sized copy).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Span {
    Whole,
    Pieces,
}

/// Runs the update `f` on the fp32 weights of `params` (whose master weights, under mixed
/// precision, start at `at`), then refreshes the working copy. `f` gets the weights and their
/// range within `params`: once over all of them, or under bf16's split master weights with
/// [`Span::Pieces`], piece by piece.
fn on_master(master: &mut Option<Master>, round: Option<tensor::precision::Format>, (params, at): (&mut [f32], usize), span: Span, mut f: impl FnMut(&mut [f32], Range<usize>)) {
    let (n, e) = (params.len(), at..at + params.len());
    match (master, round) {
        (Some(Master::F32(mw)), Some(fmt)) => {
            f(&mut mw[e.clone()], 0..n);
            tensor::precision::master_round_into(params, &mw[e.clone()], fmt);
            mw.release(e);
        }
        (Some(Master::Low(low)), _) => {
            let piece = if span == Span::Whole { n.max(1) } else { tensor::par::ELEMS };
            let mut x = vec![0.0f32; piece.min(n)];
            for a in (0..n).step_by(piece) {
                let b = (a + piece).min(n);
                let (w, lo, x) = (&mut params[a..b], &mut low[at + a..at + b], &mut x[..b - a]);
                tensor::precision::join_bf16_into(x, w, lo);
                f(x, a..b);
                w.copy_from_slice(x);
                tensor::precision::split_bf16_in_place(w, lo);
            }
        }
        _ => f(params, 0..n),
    }
}

impl Optimizer {
    /// This rank's row of `checkpoint::COMPRESSION_STATE`: the compressor's state, and for 0/1
    /// Adam the rank's own momentum after it (its local steps make it differ between ranks).
    pub fn compression_row(&self) -> Option<Vec<f32>> {
        let mut row = self.compression.as_ref()?.state();
        if let Some(CompressionState::ZeroOne(_)) = &self.compression {
            row.extend_from_slice(&self.m);
        }
        Some(row)
    }

    pub fn compression_row_len(&self) -> Option<usize> {
        let st = self.compression.as_ref()?;
        Some(st.state_len() + if matches!(st, CompressionState::ZeroOne(_)) { self.m.len() } else { 0 })
    }

    /// Restores [`Optimizer::compression_row`] into `st`, and for 0/1 Adam the rank's momentum.
    pub fn restore_compression(&mut self, mut st: CompressionState, row: &[f32]) {
        let k = st.state_len();
        st.set_state(&row[..k]);
        if let CompressionState::ZeroOne(_) = &st {
            let len = self.m.len();
            self.m.copy_from_slice(&row[k..k + len]);
        }
        self.compression = Some(st);
    }

    /// 0/1 Adam past its freeze: this rank's own parameters of `piece` (`anchor·decay − acc`,
    /// as [`tensor::optim::zeroone_local`] computes them; the anchor itself right after a
    /// sync). Returns false, touching nothing, before the first local step took the anchor.
    pub fn zeroone_local_params(&self, params: &mut [f32], piece: &parallel::Piece, cfg: &RunConfig) -> bool {
        assert!(self.master.is_none(), "0/1 Adam runs in fp32 only");
        let Some(CompressionState::ZeroOne(z)) = &self.compression else { return false };
        if !z.anchored {
            return false;
        }
        for (r, off, h) in self.segments(piece, cfg, 0.0, 1) {
            let d = z.decay_for(&h);
            let e = off + r.start..off + r.end;
            params[r].iter_mut().zip(&z.anchor[e.clone()]).zip(&z.acc[e]).for_each(|((p, &a), &m)| *p = a * d - m);
        }
        true
    }

    /// The AdamW hyper-parameters of each weight-decay segment inside `piece`: (the segment's
    /// range relative to the piece, the piece's offset in the moments, hyper-parameters).
    fn segments(&self, piece: &parallel::Piece, cfg: &RunConfig, lr: f64, t: u64) -> Vec<(Range<usize>, usize, AdamW)> {
        let tc = &cfg.train;
        let f = &piece.flat;
        self.segs
            .iter()
            .filter_map(|(r, decay)| {
                let (a, b) = (r.start.max(f.start), r.end.min(f.end));
                let h = AdamW { lr: lr as f32, beta1: tc.beta1 as f32, beta2: tc.beta2 as f32, eps: tc.eps as f32, weight_decay: if *decay { tc.weight_decay as f32 } else { 0.0 }, t };
                (a < b).then(|| (a - f.start..b - f.start, piece.shard.start, h))
            })
            .collect()
    }

    /// 0/1 Adam's update of one piece on the ranks' averaged gradient (`grads`, the piece's),
    /// at learning rate `lr` and step `t`, updating the variance only with `update_v`
    /// (`tensor::optim::zeroone_update`).
    pub fn update_piece_zeroone(&mut self, params: &mut [f32], grads: &[f32], piece: &parallel::Piece, cfg: &RunConfig, (lr, t): (f64, u64), (var_updates, update_v): (u64, bool)) {
        assert!(self.master.is_none(), "0/1 Adam runs in fp32 only (config validation refuses mixed precision)");
        for (r, off, h) in self.segments(piece, cfg, lr, t) {
            let moments = off + r.start..off + r.end;
            let (m, v) = (&mut self.m[moments.clone()], &mut self.v[moments]);
            tensor::optim::zeroone_update(&mut params[r.clone()], &grads[r], m, v, &h, var_updates, update_v);
        }
    }

    /// 1-bit Adam's update of one piece in the compression stage: the momentum `m` is given
    /// (already averaged over the ranks) and stored; the variance stays as the warm-up left it,
    /// with its bias correction frozen at step `frozen_at`; at learning rate `lr` and step `t`.
    pub fn update_piece_frozen(&mut self, params: &mut [f32], m: &[f32], piece: &parallel::Piece, cfg: &RunConfig, (lr, t): (f64, u64), frozen_at: u64) {
        let rbc2 = (1.0 / (1.0 - cfg.train.beta2.powi(frozen_at as i32)).sqrt()) as f32;
        for (r, off, h) in self.segments(piece, cfg, lr, t) {
            let (lo, hi) = (r.start, r.end);
            let (ms, vs) = (&m[off + lo..off + hi], &self.v[off + lo..off + hi]);
            match (&mut self.master, self.round) {
                (Some(Master::F32(mw)), Some(fmt)) => {
                    let w = &mut mw[off + lo..off + hi];
                    tensor::optim::adam_frozen_update(w, None, ms, vs, &h, rbc2);
                    tensor::precision::master_round_into(&mut params[lo..hi], w, fmt);
                }
                (Some(Master::Low(low)), _) => tensor::optim::adam_frozen_update(&mut params[lo..hi], Some(&mut low[off + lo..off + hi]), ms, vs, &h, rbc2),
                _ => tensor::optim::adam_frozen_update(&mut params[lo..hi], None, ms, vs, &h, rbc2),
            }
            self.m[off + lo..off + hi].copy_from_slice(ms);
        }
    }
}

/// The gradient norm a step with unreduced gradients reports: the root mean square of the
/// ranks' own norms, each rank's gradient taken as `n ×` its share of the batch's.
fn ranks_norm(ch: &mut Chunk) -> f64 {
    let n = ch.dp.n();
    let mut sq = 0.0;
    ch.dp.for_each_piece(|_, _, g| sq += sum_squares(g));
    (ch.dp.all_reduce_f64(&[sq])[0] / n as f64).sqrt() * n as f64
}

/// 1-bit Adam's compression stage (`parallel.compression = onebit_adam`, past
/// `parallel.compression_warmup`): the gradients stayed on their ranks (no reduction). Each
/// rank forms its momentum `β1·m + (1−β1)·g` from its own gradient (of its share of the batch,
/// `n ×` what it accumulated; not clipped), and the ranks average the momenta through the
/// compressed all-reduce (`parallel::compress`); the update divides by the frozen variance.
/// Every rank applies the same update. Returns the gradient norm reported (the root mean
/// square of the ranks' own norms, which the non-finite and spike vetoes read) or why the
/// update was skipped.
fn onebit_step(ch: &mut Chunk, cfg: &RunConfig, step: u64, lr: f64, check: &mut dyn FnMut(f64) -> Option<&'static str>) -> (f64, Option<&'static str>) {
    let n = ch.dp.n();
    let share = n as f32;
    let norm = ranks_norm(ch);
    if let Some(why) = check(norm) {
        return (norm, Some(why));
    }
    // No clipping here: no rank sees the global gradient, and clipping each rank's by the
    // ranks' norms (which its share of the batch inflates) shrinks every step (measured on
    // shakespeare-char at dp 4: val loss 1.9309 against 1.8914 uncompressed; unclipped 1.8348).
    let scale = share;
    let (b1, opt) = (cfg.train.beta1 as f32, &mut ch.opt);
    let mut mom = vec![0.0f32; opt.m.len()];
    ch.dp.for_each_piece(|piece, _, g| {
        for ((o, &m), &gi) in mom[piece.shard.clone()].iter_mut().zip(&opt.m[piece.shard.clone()]).zip(g.iter()) {
            *o = b1 * m + (1.0 - b1) * gi * scale;
        }
    });
    let len = mom.len();
    let mut st = match opt.compression.take() {
        Some(CompressionState::OneBit(o)) => o,
        _ => parallel::compress::OneBit::new(len, n, ch.dp.rank()),
    };
    let (st, mom) = ch.dp.run("onebit_adam", move |comm| {
        st.all_reduce_mean(comm, &mut mom);
        (st, mom)
    });
    opt.compression = Some(CompressionState::OneBit(st));
    let frozen_at = cfg.parallel.compression_warmup;
    ch.dp.for_each_piece(|piece, params, _| opt.update_piece_frozen(params, &mom, piece, cfg, (lr, step + 1), frozen_at));
    ch.dp.after_update();
    (norm, None)
}

/// 0/1 Adam (`parallel.compression = zero_one_adam`) on a step of its schedule that does not
/// all-reduce the gradients in full precision (`parallel::compress::ZeroOneSchedule`). The
/// gradients stayed on their ranks; each rank's (`n ×` what it accumulated, as 1-bit Adam's; not
/// clipped) either goes through the 1-bit all-reduce, the momentum and parameters then updated
/// as AdamW with the variance as it was, or, once the variance is frozen, drives a local step
/// (`tensor::optim::zeroone_local`). At a sync step every rank sends its accumulated moves
/// scaled by the denominator `√v̂ + ε` (momentum units, the same scale on every element) through
/// the 1-bit all-reduce; the average `ū` gives every rank the same parameters, `anchor −
/// ū / (√v̂ + ε)`, and momentum, `ū / Σ lr`. Returns the reported gradient norm (as 1-bit Adam's)
/// or why the update was skipped.
fn zeroone_step(ch: &mut Chunk, cfg: &RunConfig, step: u64, lr: f64, kind: parallel::compress::ZeroOneKind, check: &mut dyn FnMut(f64) -> Option<&'static str>) -> (f64, Option<&'static str>) {
    use parallel::compress::{OneBit, ZeroOneKind};
    let (n, rank) = (ch.dp.n(), ch.dp.rank());
    let share = n as f32;
    let norm = ranks_norm(ch);
    if let Some(why) = check(norm) {
        return (norm, Some(why));
    }
    let len = ch.opt.m.len();
    let mut st = match ch.opt.compression.take() {
        Some(CompressionState::ZeroOne(z)) => z,
        _ => ZeroOneState::new(len, n, rank),
    };
    let mut g = vec![0.0f32; len];
    ch.dp.for_each_piece(|piece, _, grads| g[piece.shard.clone()].iter_mut().zip(grads.iter()).for_each(|(o, &x)| *o = x * share));
    let (t, opt) = (step + 1, &mut ch.opt);
    let onebit_mean = |dp: &mut DataParallel, ob: OneBit, x: Vec<f32>| dp.run("zeroone_adam", move |comm| {
        let (mut ob, mut x) = (ob, x);
        ob.all_reduce_mean(comm, &mut x);
        (ob, x)
    });
    match kind {
        ZeroOneKind::Variance { .. } => unreachable!("a variance step all-reduces its gradients in full precision"),
        ZeroOneKind::OneBitGrad { var_updates } => {
            let ob = std::mem::replace(&mut st.onebit, OneBit::new(0, n, rank));
            let (ob, g) = onebit_mean(&mut ch.dp, ob, g);
            st.onebit = ob;
            ch.dp.for_each_piece(|piece, params, _| opt.update_piece_zeroone(params, &g[piece.shard.clone()], piece, cfg, (lr, t), (var_updates, false)));
        }
        ZeroOneKind::Local { var_updates, sync, .. } => {
            if !st.anchored {
                // The first local step that runs (not the schedule's first: a vetoed or
                // rolled-back step, or a resume without this rank's state, takes none). The
                // error feedback held gradients; from here it holds moves.
                st.onebit = OneBit::new(len, n, rank);
                ch.dp.for_each_piece(|piece, params, _| st.anchor[piece.shard.clone()].copy_from_slice(params));
                st.acc.fill(0.0);
                (st.lrs, st.decay, st.anchored) = (0.0, 1.0, true);
            }
            st.decay *= 1.0 - lr * cfg.train.weight_decay;
            ch.dp.for_each_piece(|piece, params, _| {
                for (r, off, h) in opt.segments(piece, cfg, lr, t) {
                    let d = st.decay_for(&h);
                    let e = off + r.start..off + r.end;
                    let (m, v) = (&mut opt.m[e.clone()], &opt.v[e.clone()]);
                    tensor::optim::zeroone_local(&mut params[r], &g[e.clone()], (m, v), (&mut st.acc[e.clone()], &st.anchor[e]), &h, var_updates, d);
                }
            });
            // The momentum after a sync is the moves' average per unit of step size, which
            // carries the bias correction the moves did.
            st.lrs += lr / (1.0 - cfg.train.beta1.powi(t as i32));
            if sync {
                let tc = &cfg.train;
                let rbc2 = (1.0 / (1.0 - (tc.beta2 as f32 as f64).powi(var_updates as i32)).sqrt()) as f32;
                let denom = |v: f32| v.sqrt() * rbc2 + tc.eps as f32;
                let u: Vec<f32> = st.acc.iter().zip(opt.v.iter()).map(|(&a, &v)| a * denom(v)).collect();
                let ob = std::mem::replace(&mut st.onebit, OneBit::new(0, n, rank));
                let (ob, u) = onebit_mean(&mut ch.dp, ob, u);
                st.onebit = ob;
                // The decay since the last sync, folded into the anchor where it applies.
                ch.dp.for_each_piece(|piece, _, _| {
                    for (r, off, h) in opt.segments(piece, cfg, lr, t) {
                        let d = st.decay_for(&h);
                        st.anchor[off + r.start..off + r.end].iter_mut().for_each(|a| *a *= d);
                    }
                });
                let inv = (1.0 / st.lrs) as f32;
                for (i, &ui) in u.iter().enumerate() {
                    st.anchor[i] -= ui / denom(opt.v[i]);
                    opt.m[i] = ui * inv;
                }
                ch.dp.for_each_piece(|piece, params, _| params.copy_from_slice(&st.anchor[piece.shard.clone()]));
                st.acc.fill(0.0);
                (st.lrs, st.decay) = (0.0, 1.0);
            }
        }
    }
    ch.dp.after_update();
    ch.opt.compression = Some(CompressionState::ZeroOne(st));
    (norm, None)
}

/// 0/1 Adam's schedule for `cfg` (its warm-up is `parallel.compression_warmup`).
pub fn zeroone_schedule(cfg: &RunConfig) -> parallel::compress::ZeroOneSchedule {
    cfg.parallel.zeroone.schedule(cfg.parallel.compression_warmup)
}

/// PowerSGD (`parallel.compression = powersgd`, past `parallel.compression_warmup`): the
/// gradients stayed on their ranks; each rank's (`n ×` what it accumulated, its share of the
/// batch's gradient) goes through the low-rank all-reduce (`parallel::compress::PowerSgd`),
/// which leaves every rank the same approximate mean, scaled back to the store's convention
/// (its sum over ranks is the gradient): the update then runs as without compression.
fn powersgd_reduce(ch: &mut Chunk, cfg: &RunConfig) {
    let n = ch.dp.n();
    let mut g = vec![0.0f32; ch.opt.m.len()];
    ch.dp.for_each_piece(|piece, _, grads| g[piece.shard.clone()].copy_from_slice(grads));
    let mut st = match ch.opt.compression.take() {
        Some(CompressionState::PowerSgd(p)) => p,
        _ => powersgd_state(cfg, &ch.model.layout, g.len()),
    };
    // The sum over ranks is the gradient, so the mean of n × each is too.
    let share = n as f32;
    g.iter_mut().for_each(|x| *x *= share);
    let (st, g) = ch.dp.run("powersgd", move |comm| {
        st.all_reduce_mean(comm, &mut g);
        (st, g)
    });
    ch.opt.compression = Some(CompressionState::PowerSgd(st));
    // Every rank now holds the whole gradient: the store's reduced-gradient convention.
    ch.dp.for_each_piece(|piece, _, grads| grads.copy_from_slice(&g[piece.shard.clone()]));
}

/// Fresh PowerSGD state over a `len`-element store laid out as `layout`.
fn powersgd_state(cfg: &RunConfig, layout: &model::ParamLayout, len: usize) -> parallel::compress::PowerSgd {
    let tensors = parallel::compress::PowerSgd::tensors(layout);
    parallel::compress::PowerSgd::new(&tensors, len, cfg.parallel.powersgd_rank, cfg.train.seed)
}

/// Whether step `step` (0-based) is in the compression stage of `parallel.compression`.
pub fn compressing(cfg: &RunConfig, step: u64) -> bool {
    cfg.parallel.compression != crate::config::Compression::None && step >= cfg.parallel.compression_warmup
}

/// The dropout seed of micro-batch `micro` of step `step`.
pub fn dropout_seed(seed: u64, step: u64, micro: usize) -> u64 {
    mix64(seed ^ mix64(step.wrapping_mul(1 << 16) + micro as u64))
}

/// What one optimizer step reports.
#[derive(Clone, Copy, Debug)]
pub struct StepOut {
    /// Mean loss over the global batch (the mean over micro-batches of each one's mean).
    pub loss: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// The gradient reduction's cost and how much of it backward hid (last micro-batch).
    pub overlap: parallel::Overlap,
    /// Why the update was skipped (`None`: it was applied).
    pub skipped: Option<&'static str>,
    /// Most bytes of forward activations this rank held at once (every chunk, every
    /// micro-batch in flight), and the most micro-batches in flight.
    pub peak_activation_bytes: usize,
    pub peak_in_flight: usize,
    /// Targets that carried loss in the global batch (fewer than its tokens under SFT masks,
    /// packed documents' boundaries and padding).
    pub loss_tokens: f64,
    /// A preference objective: the global batch's pair sums (rewards, accuracy, log-probs).
    pub pairs: Option<model::pairs::PairStats>,
    /// A policy-gradient objective: the global batch's completion sums (KL, clipping).
    pub policy: Option<model::policy::PolicyStats>,
}

/// fp16's dynamic loss scaling (Micikevicius et al. 2018): the loss gradient is multiplied by
/// `scale` so small gradients survive fp16; an overflow (a non-finite gradient norm) skips the
/// update and halves the scale, and `window` updates without one double it.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaler {
    pub scale: f64,
    /// Updates since the last overflow or growth.
    pub good: u64,
    pub window: u64,
}

/// The reason a step reports when fp16 overflowed (the update is skipped, not a fault).
pub const FP16_OVERFLOW: &str = "fp16 overflow: loss scale halved";

/// One model chunk a rank trains: a whole model, or a pipeline stage, or a tensor-parallel
/// shard of either; the data-parallel store its passes go through, and its optimizer state.
pub struct Chunk {
    pub model: Gpt,
    pub dp: DataParallel,
    pub opt: Optimizer,
    /// Flat ranges of `model` that every tensor-parallel rank holds whole (counted once in the
    /// gradient norm); empty without tensor parallelism.
    pub replicated: Vec<Range<usize>>,
    /// Flat ranges whose gradients are partial sums over the tensor-parallel group (the norms'
    /// under sequence parallelism), summed there before the update.
    pub seq_partial: Vec<Range<usize>>,
    /// Activation sets beyond the model's own, kept from step to step for the micro-batches a
    /// pipeline schedule holds in flight (allocated once, not every step).
    pub pool: Vec<Activations>,
}

/// Sums this rank's reduced gradients inside `ranges` over `comm`, whose ranks hold the same
/// layout and the same data-parallel pieces (tensor-parallel peers).
fn sum_grads_over(dp: &mut DataParallel, comm: &dyn parallel::Comm, ranges: &[Range<usize>]) {
    let overlaps = |p: &parallel::Piece| -> Vec<Range<usize>> {
        ranges.iter().filter_map(|r| {
            let (a, b) = (r.start.max(p.flat.start), r.end.min(p.flat.end));
            (a < b).then(|| a - p.flat.start..b - p.flat.start)
        }).collect()
    };
    let mut buf = Vec::new();
    dp.for_each_piece(|p, _, g| overlaps(p).into_iter().for_each(|r| buf.extend_from_slice(&g[r])));
    comm.all_reduce_sum(&mut buf);
    let mut at = 0;
    dp.for_each_piece(|p, _, g| {
        for r in overlaps(p) {
            g[r.clone()].copy_from_slice(&buf[at..at + r.len()]);
            at += r.len();
        }
    });
}

/// How a rank's chunks sit in the pipeline, and the groups a step talks to beyond each chunk's
/// data-parallel group. Without pipeline parallelism: one chunk, `p = 1`, the 1F1B schedule
/// over the accumulation micro-batches (forward then backward of each in turn).
pub struct Pipeline<'a> {
    pub sched: pp::Schedule,
    /// This rank's pipeline stage, `0..p`; chunk `c` is virtual stage `c·p + rank`.
    pub rank: usize,
    /// The pipeline group (`None` when `p = 1`).
    pub comm: Option<&'a dyn parallel::Comm>,
    /// The tensor-parallel group (for the gradient norm).
    pub tp: Option<&'a dyn parallel::Comm>,
    /// The first and last stages' group when they share a tied embedding (on those two ranks).
    pub tie: Option<&'a dyn parallel::Comm>,
    /// Record this step's tasks (see [`PipeTrace`]).
    pub trace: Option<&'a mut PipeTrace>,
    /// Called before the update writes parameters and moments (a background checkpoint may
    /// still be copying them: it blocks until the copy is done).
    pub before_update: Option<&'a dyn Fn()>,
    /// fp16: the dynamic loss scale.
    pub scaler: Option<&'a mut LossScaler>,
}

impl Pipeline<'_> {
    /// One chunk, no pipeline: micro-batch after micro-batch.
    pub fn single(accum: usize, tp: Option<&dyn parallel::Comm>) -> Pipeline<'_> {
        Pipeline { sched: pp::Schedule::new(pp::Kind::OneFOneB, 1, accum, 1).expect("accum > 0"), rank: 0, comm: None, tp, tie: None, trace: None, before_update: None, scaler: None }
    }
}

/// One traced task: forward or backward of micro-batch `mb` through chunk `chunk`, with its
/// times in seconds from the step's start on two clocks. `wall_*`: this process's clock
/// (waiting for messages included). `dev_*`: the rank's *device clock*, which advances only by
/// the task's measured compute time and waits for messages by the sender's device time — the
/// timeline the same tasks would have on ranks with a processor each, however many cores the
/// ranks share here. With `exclusive`, tasks compute one at a time across the process, so each
/// one's measured time is an uncontended one.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct TracedTask {
    pub forward: bool,
    pub mb: usize,
    pub chunk: usize,
    pub wall_start: f64,
    pub wall_end: f64,
    /// Of `wall_end − wall_start`, the time spent waiting for the input message.
    pub wall_wait: f64,
    pub dev_start: f64,
    pub dev_end: f64,
}

/// A rank's record of one pipeline step.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PipeTrace {
    pub tasks: Vec<TracedTask>,
    /// Compute tasks one at a time across the process (only safe when no collective runs
    /// inside a pass: no tensor parallelism, no data parallelism).
    #[serde(skip)]
    pub exclusive: bool,
}

impl PipeTrace {
    /// Idle over busy time on the device clock between the step's first start and last end
    /// over all ranks (`end`, the step's device makespan) — the bubble as Narayanan et al.
    /// define it, `(p−1)/m` for GPipe and 1F1B.
    pub fn bubble(&self, end: f64) -> f64 {
        let busy: f64 = self.tasks.iter().map(|t| t.dev_end - t.dev_start).sum();
        (end - busy) / busy
    }

    pub fn dev_end(&self) -> f64 {
        self.tasks.iter().map(|t| t.dev_end).fold(0.0, f64::max)
    }
}

/// Serialises compute across the process's ranks in exclusive trace mode.
static EXCLUSIVE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Message tags between pipeline stages: activations across the boundary after virtual stage
/// `b` (forward), and their gradients back (backward); device-clock stamps beside them.
fn tag(boundary: usize, backward: bool, stamp: bool) -> u32 {
    (4 * boundary + 2 * backward as usize + stamp as usize) as u32
}

/// f64 as two f32 bit patterns (a device-clock stamp in an f32 message).
fn stamp_bits(x: f64) -> [f32; 2] {
    let b = x.to_bits();
    [f32::from_bits(b as u32), f32::from_bits((b >> 32) as u32)]
}

fn from_stamp(s: [f32; 2]) -> f64 {
    f64::from_bits(s[0].to_bits() as u64 | ((s[1].to_bits() as u64) << 32))
}

/// Runs optimizer step `step` (0-based) on this rank's `chunks`: the pipeline schedule's
/// forwards and backwards of the step's micro-batches (for each, `fill(micro, x, y)` writes
/// this rank's rows of it, `micro_batch / dp` sequences), activations and their gradients
/// passed between stages, each chunk's data-parallel store accumulating gradients scaled so that
/// their sum over ranks is the gradient of the global batch's mean loss (divided by the
/// micro-batch count); then the reductions, the tied embedding's two copies summed, clipping by
/// the global norm, and the AdamW update of the pieces this rank owns.
pub fn train_step(
    chunks: &mut [Chunk],
    pipe: &mut Pipeline,
    cfg: &RunConfig,
    step: u64,
    fill: impl FnMut(usize, &mut RowBuf),
    mut veto: impl FnMut(f32, f64) -> Option<&'static str>,
) -> StepOut {
    assert_eq!(chunks.len(), pipe.sched.v, "one chunk per virtual stage");
    let compress = compressing(cfg, step) && chunks[0].dp.n() > 1;
    let onebit = compress && cfg.parallel.compression == crate::config::Compression::OnebitAdam;
    // 0/1 Adam: its variance steps all-reduce the gradients in full precision.
    let zeroone = (compress && cfg.parallel.compression == crate::config::Compression::ZerooneAdam).then(|| zeroone_schedule(cfg).kind(step + 1));
    let variance_step = match zeroone {
        Some(parallel::compress::ZeroOneKind::Variance { var_updates }) => Some(var_updates),
        _ => None,
    };
    let local = compress && variance_step.is_none();
    for ch in chunks.iter_mut() {
        ch.dp.set_local(local);
        ch.dp.zero_grad();
        if let Some(lo) = ch.model.lora.as_mut() {
            lo.grads.fill(0.0);
        }
    }
    // Forward and backward of every micro-batch, in the schedule's order.
    let batch = MicroBatches::draw(chunks, cfg, pipe.sched.m, fill);
    let mut ex = Executor::new(chunks, pipe, cfg, step, &batch);
    for task in pipe.sched.tasks(pipe.rank) {
        ex.run(chunks, pipe, task);
    }
    let (sums, (pair_stats, policy_stats), peak_bytes, peak_in_flight) = ex.finish(chunks, pipe);
    // The gradients' reductions, FP8's amaxes, the loss.
    let mut overlap = parallel::Overlap::default();
    {
        let _p = profile::scope("grad_sync");
        for ch in chunks.iter_mut() {
            let o = ch.dp.finish_backward();
            (overlap.comm, overlap.exposed) = (overlap.comm + o.comm, overlap.exposed + o.exposed);
        }
    }
    fp8_amaxes(chunks, pipe.tp);
    let _p = profile::scope("optimizer");
    let loss = global_loss(chunks, pipe, sums) as f32;
    let loss_tokens = batch.tokens;
    // (Every stage takes part: only the last one measured its pairs.)
    // (The context-parallel ranks of the group each measured the same pairs.)
    let pairs = cfg.train.objective.pairs().map(|_| model::pairs::PairStats::from_array(global_sums(chunks, pipe, &pair_stats.unwrap_or_default().to_array()).map(|x| x / cfg.parallel.cp as f64)));
    // (Every stage takes part: only the last one measured its completions.)
    let grpo = cfg.train.objective == crate::config::Objective::Grpo;
    let policy = grpo.then(|| model::policy::PolicyStats::from_array(global_sums(chunks, pipe, &policy_stats.unwrap_or_default().to_array())));
    let out = |grad_norm: f64, skipped: Option<&'static str>| StepOut { loss, grad_norm, overlap, skipped, peak_activation_bytes: peak_bytes, peak_in_flight, loss_tokens, pairs, policy };
    if cfg.faults.inject_nan_steps.contains(&(step + 1)) {
        match chunks[0].model.lora.as_mut() {
            Some(lo) => lo.grads[0] = f32::NAN,
            None => chunks[0].dp.for_each_piece(|p, _, g| if p.flat.start == 0 && !g.is_empty() { g[0] = f32::NAN }),
        }
    }
    // The update is decided from the global loss and gradient norm, so every rank agrees.
    let mut check = |norm: f64| if !(loss.is_finite() && norm.is_finite()) { Some("non-finite loss or gradient norm") } else { veto(loss, norm) };
    let lr = cfg.lr_at(step);
    if chunks[0].model.lora.is_some() {
        let (norm, skipped) = lora_update(&mut chunks[0], pipe, cfg, step, &mut check);
        return out(norm, skipped);
    }
    if let (Some(kind), None) = (zeroone, variance_step) {
        if let Some(wait) = pipe.before_update {
            wait();
        }
        let (norm, skipped) = zeroone_step(&mut chunks[0], cfg, step, lr, kind, &mut check);
        return out(norm, skipped);
    }
    if zeroone.is_some() && chunks[0].opt.compression.is_none() {
        // (A variance step first: the state exists from the first compressed step on.)
        let ch = &mut chunks[0];
        let (len, n, me) = (ch.opt.m.len(), ch.dp.n(), ch.dp.rank());
        ch.opt.compression = Some(CompressionState::ZeroOne(ZeroOneState::new(len, n, me)));
    }
    if compress && !onebit && zeroone.is_none() {
        // The vetoes first, on the ranks' own gradients (RMS norm, as 1-bit Adam's): a skipped
        // step must leave PowerSGD's error and Q as they were.
        let ch = &mut chunks[0];
        let local = ranks_norm(ch);
        if let Some(why) = check(local) {
            return out(local, Some(why));
        }
        let _p = profile::scope("powersgd");
        powersgd_reduce(ch, cfg);
    }
    if onebit {
        if let Some(wait) = pipe.before_update {
            wait();
        }
        let (norm, skipped) = onebit_step(&mut chunks[0], cfg, step, lr, &mut check);
        return out(norm, skipped);
    }
    let tied = sum_tied_embedding(chunks, pipe);
    // Sequence parallelism: each tensor-parallel shard's norm gradients cover its positions.
    if let Some(tp) = pipe.tp {
        for ch in chunks.iter_mut().filter(|c| !c.seq_partial.is_empty()) {
            let _p = profile::scope("sp norm gradients");
            sum_grads_over(&mut ch.dp, tp, &ch.seq_partial);
        }
    }
    let norm = global_grad_norm(chunks, pipe, &tied);
    let (norm, skipped) = dense_update(chunks, pipe, cfg, (step, variance_step), (norm, loss), &mut check);
    out(norm, skipped)
}

/// The LoRA adapters' update: their gradients summed over the data-parallel group, the
/// vetoes on their norm, clipping, AdamW. The norm, and why the update was skipped.
fn lora_update(ch: &mut Chunk, pipe: &Pipeline, cfg: &RunConfig, step: u64, check: &mut dyn FnMut(f64) -> Option<&'static str>) -> (f64, Option<&'static str>) {
    let lo = ch.model.lora.as_mut().expect("LoRA adapters");
    ch.dp.reduce_adapters(&mut lo.grads);
    let norm = sum_squares(&lo.grads).sqrt();
    if let Some(why) = check(norm) {
        return (norm, Some(why));
    }
    if let Some(wait) = pipe.before_update {
        wait();
    }
    let clip = cfg.train.grad_clip;
    if clip > 0.0 && norm > clip {
        scale_in_place(&mut lo.grads, (clip / (norm + 1e-6)) as f32);
    }
    ch.opt.update(&mut lo.params, &lo.grads, cfg, cfg.lr_at(step), step + 1);
    (norm, None)
}

/// The update of every chunk's pieces from the global gradient `norm`: fp16's loss scale
/// taken out (an overflow skips the step and halves it), the vetoes, clipping, and AdamW (0/1
/// Adam's variance step when `variance_step` says so). The unscaled norm, and why the update
/// was skipped.
fn dense_update(chunks: &mut [Chunk], pipe: &mut Pipeline, cfg: &RunConfig, (step, variance_step): (u64, Option<u64>), (norm, loss): (f64, f32), check: &mut dyn FnMut(f64) -> Option<&'static str>) -> (f64, Option<&'static str>) {
    let unscale = match pipe.scaler.as_deref_mut() {
        Some(sc) if !norm.is_finite() && loss.is_finite() => {
            sc.scale = (sc.scale / 2.0).max(1.0);
            sc.good = 0;
            return (norm, Some(FP16_OVERFLOW));
        }
        Some(sc) => 1.0 / sc.scale,
        None => 1.0,
    };
    let norm = norm * unscale;
    if let Some(why) = check(norm) {
        return (norm, Some(why));
    }
    if let Some(sc) = pipe.scaler.as_deref_mut() {
        sc.good += 1;
        if sc.good >= sc.window {
            (sc.scale, sc.good) = (sc.scale * 2.0, 0);
        }
    }
    if let Some(wait) = pipe.before_update {
        wait();
    }
    let (lr, clip) = (cfg.lr_at(step), cfg.train.grad_clip);
    let clip_scale = if clip > 0.0 && norm > clip { clip / (norm + 1e-6) } else { 1.0 };
    for ch in chunks.iter_mut() {
        if clip_scale * unscale != 1.0 {
            ch.dp.scale_grads((clip_scale * unscale) as f32);
        }
        let distributed_muon = cfg.optim.name == OptimName::Muon && muon::distributed(ch, pipe.tp);
        if distributed_muon {
            muon::step(ch, pipe.tp, cfg, lr);
        }
        let opt = &mut ch.opt;
        match variance_step {
            Some(cv) => ch.dp.for_each_piece(|piece, params, grads| opt.update_piece_zeroone(params, grads, piece, cfg, (lr, step + 1), (cv, true))),
            None if distributed_muon => ch.dp.for_each_piece(|piece, params, grads| opt.update_rest(params, grads, piece, cfg, lr, step + 1)),
            None => ch.dp.for_each_piece(|piece, params, grads| opt.update_piece(params, grads, piece, cfg, lr, step + 1)),
        }
        ch.dp.after_update();
    }
    (norm, None)
}

/// One micro-batch's rows: inputs, targets and, for packed documents, each token's document
/// start and position (empty otherwise).
#[derive(Clone, Debug, Default)]
pub struct RowBuf {
    pub x: Vec<u32>,
    pub y: Vec<i32>,
    pub start: Vec<u32>,
    pub pos: Vec<u32>,
    /// A preference objective: each row's reference log-probability (empty otherwise).
    pub reference: Vec<f64>,
    /// A policy-gradient objective: each row's advantage, and each position's log-probability
    /// when its completion was sampled and under the reference (empty where not needed).
    pub advantages: Vec<f64>,
    pub old_logps: Vec<f32>,
    pub ref_logps: Vec<f32>,
}

impl RowBuf {
    pub fn new(rows: usize, t: usize, packed: bool) -> RowBuf {
        let n = rows * t;
        let docs = if packed { n } else { 0 };
        RowBuf { x: vec![0; n], y: vec![model::gpt::IGNORE_INDEX; n], start: vec![0; docs], pos: vec![0; docs], reference: Vec::new(), advantages: Vec::new(), old_logps: Vec::new(), ref_logps: Vec::new() }
    }

    /// The document layout for the model (`None`: plain causal rows).
    pub fn docs(&self) -> Option<model::Docs<'_>> {
        (!self.start.is_empty()).then_some(model::Docs { start: &self.start, pos: &self.pos })
    }
}

/// A step's micro-batches on this rank (its rows of each) and the global count of targets in
/// each (over the data-parallel group).
struct MicroBatches {
    data: Vec<RowBuf>,
    counts: Vec<f64>,
    global: Vec<f64>,
    /// Targets that carried loss, over the data-parallel group.
    tokens: f64,
    rows: usize,
}

impl MicroBatches {
    fn draw(chunks: &mut [Chunk], cfg: &RunConfig, m: usize, mut fill: impl FnMut(usize, &mut RowBuf)) -> MicroBatches {
        let t = cfg.seq_len();
        // The store's group spans the context-parallel ranks, which share their rows.
        let dpn = chunks[0].dp.n();
        let rows = cfg.micro_batch() / (dpn / cfg.parallel.cp);
        let context = chunks[0].model.cfg.place.context;
        let packed = cfg.data.packing == crate::config::Packing::Documents;
        let data: Vec<RowBuf> = {
            let _p = profile::scope("data");
            (0..m).map(|micro| {
                let mut b = RowBuf::new(rows, t, packed);
                fill(micro, &mut b);
                b
            }).collect()
        };
        // A context-parallel rank counts the targets at its positions.
        let counted = |y: &[i32]| y.iter().filter(|&&v| v != model::gpt::IGNORE_INDEX).count() as f64;
        let tokens: Vec<f64> = data.iter().map(|b| context.map_or_else(|| counted(&b.y), |cx| counted(&cx.rows(&b.y, rows, t)))).collect();
        let counts = match cfg.train.objective {
            // A preference objective counts pairs, a policy objective completions: each one's
            // loss weighs the same.
            crate::config::Objective::Pairs(_) => vec![(rows / 2) as f64; m],
            crate::config::Objective::Grpo => vec![rows as f64; m],
            crate::config::Objective::Lm => tokens.clone(),
        };
        let mut both = counts.clone();
        both.extend(&tokens);
        let both = if dpn > 1 { chunks[0].dp.all_reduce_f64(&both) } else { both };
        let (mut global, tokens): (Vec<f64>, f64) = (both[..m].to_vec(), both[m..].iter().sum());
        if cfg.train.objective != crate::config::Objective::Lm {
            // The group's context-parallel ranks hold the same pairs or completions (each its
            // positions).
            global.iter_mut().for_each(|g| *g /= cfg.parallel.cp as f64);
        }
        MicroBatches { data, counts, global, tokens, rows }
    }
}

/// The pipeline executor of one step: runs this rank's tasks of the schedule, moving
/// activations (and their gradients) between stages, keeping each micro-batch's activations
/// from its forward to its backward, and measuring the step's clock and memory.
struct Executor<'b> {
    batch: &'b MicroBatches,
    cfg: &'b RunConfig,
    step: u64,
    t: usize,
    t0: Instant,
    /// `--pp-trace device`: compute serialised across in-process ranks.
    exclusive: bool,
    /// This rank's device clock: when its last task ended.
    clock: f64,
    traced: Vec<TracedTask>,
    /// Per micro-batch: the last stage's sum of losses and count of targets (of pair losses and
    /// pairs under a preference objective).
    sums: Vec<f64>,
    /// A preference objective: this rank's pair sums over its micro-batches (a policy
    /// objective: its completion sums).
    pair_stats: Option<model::pairs::PairStats>,
    policy_stats: Option<model::policy::PolicyStats>,
    /// Activations of micro-batches between their forward and backward, per chunk; sets free
    /// for reuse.
    live: Vec<Vec<Option<Activations>>>,
    free: Vec<Vec<Activations>>,
    held: usize,
    peak_bytes: usize,
    in_flight: usize,
    peak_in_flight: usize,
}

impl<'b> Executor<'b> {
    fn new(chunks: &mut [Chunk], pipe: &Pipeline, cfg: &'b RunConfig, step: u64, batch: &'b MicroBatches) -> Executor<'b> {
        let (m, v) = (pipe.sched.m, pipe.sched.v);
        Executor {
            batch, cfg, step, t: cfg.seq_len(), t0: Instant::now(),
            exclusive: pipe.trace.as_ref().is_some_and(|tr| tr.exclusive), clock: 0.0, traced: Vec::new(), sums: vec![0.0; 2 * m], pair_stats: None, policy_stats: None,
            live: (0..v).map(|_| (0..m).map(|_| None).collect()).collect(),
            free: chunks.iter_mut().map(|ch| std::mem::take(&mut ch.pool)).collect(),
            held: 0, peak_bytes: 0, in_flight: 0, peak_in_flight: 0,
        }
    }

    /// One task: receive its input (activations, or the output's gradient) from the
    /// neighbouring stage, compute, send its output on.
    fn run(&mut self, chunks: &mut [Chunk], pipe: &mut Pipeline, task: pp::Task) {
        let (p, m, me) = (pipe.sched.p, pipe.sched.m, pipe.rank);
        let (c, rows, t) = (task.chunk, self.batch.rows, self.t);
        let vs = c * p + me;
        let (first, last) = (vs == 0, vs == p * pipe.sched.v - 1);
        let ch = &mut chunks[c];
        let rb = &self.batch.data[task.mb];
        let w0 = self.t0.elapsed().as_secs_f64();
        let mut ready = self.clock;
        let recv_stamp = |comm: &dyn parallel::Comm, from: usize, tg: u32| {
            let mut st = [0f32; 2];
            comm.recv(&mut st, from, tg);
            from_stamp(st)
        };
        let traced_on = pipe.trace.is_some();
        if task.forward {
            if let Some(a) = self.free[c].pop() {
                ch.model.put_activations(a);
            }
            if !first {
                let comm = pipe.comm.expect("pipeline group");
                let _p = profile::scope("pp recv");
                comm.recv(ch.model.stage_input_mut(rows, t), (vs - 1) % p, tag(vs - 1, false, false));
                if traced_on {
                    ready = ready.max(recv_stamp(comm, (vs - 1) % p, tag(vs - 1, false, true)));
                }
            }
        } else {
            ch.model.put_activations(self.live[c][task.mb].take().expect("forward before backward"));
            if !last {
                let comm = pipe.comm.expect("pipeline group");
                let _p = profile::scope("pp recv");
                comm.recv(ch.model.stage_output_grad_mut(), (vs + 1) % p, tag(vs, true, false));
                if traced_on {
                    ready = ready.max(recv_stamp(comm, (vs + 1) % p, tag(vs, true, true)));
                }
            }
        }
        let w1 = self.t0.elapsed().as_secs_f64();
        let (c0, c1) = {
            let _lock = self.exclusive.then(|| EXCLUSIVE.lock().unwrap_or_else(|e| e.into_inner()));
            let c0 = Instant::now();
            if task.forward {
                let (counts, global) = (&self.batch.counts, &self.batch.global);
                let s = pipe.scaler.as_ref().map_or(1.0, |x| x.scale);
                let loss_scale = if global[task.mb] > 0.0 { (s * counts[task.mb] / global[task.mb] / m as f64) as f32 } else { 0.0 };
                let pass = Pass::Train { dropout_seed: dropout_seed(self.cfg.train.seed, self.step, task.mb), loss_scale };
                if let Some(p) = ch.model.pairs.as_mut() {
                    p.reference.clone_from(&rb.reference);
                }
                if let Some(p) = ch.model.policy.as_mut() {
                    (p.advantages, p.old, p.reference) = (rb.advantages.clone(), rb.old_logps.clone(), rb.ref_logps.clone());
                }
                let _p = profile::scope("forward");
                ch.model.forward_with(&mut ch.dp, &rb.x, &rb.y, rb.docs(), (rows, t), pass);
            } else {
                ch.dp.begin_micro(task.mb + 1 == m);
                let _p = profile::scope("backward");
                ch.model.backward_with(&mut ch.dp);
            }
            (c0, Instant::now())
        };
        let dev_start = ready;
        self.clock = ready + (c1 - c0).as_secs_f64();
        if task.forward {
            if let (true, Some(p)) = (last, ch.model.pairs.as_ref()) {
                let st = p.stats();
                (self.sums[2 * task.mb], self.sums[2 * task.mb + 1]) = (st.loss, st.pairs);
                self.pair_stats.get_or_insert_with(Default::default).add(&st);
            } else if let (true, Some(p)) = (last, ch.model.policy.as_ref()) {
                let st = p.stats();
                (self.sums[2 * task.mb], self.sums[2 * task.mb + 1]) = (st.loss, st.completions);
                self.policy_stats.get_or_insert_with(Default::default).add(&st);
            } else if last {
                self.sums[2 * task.mb] = ch.model.losses().iter().map(|&l| l as f64).sum::<f64>();
                self.sums[2 * task.mb + 1] = self.batch.counts[task.mb];
            } else {
                let comm = pipe.comm.expect("pipeline group");
                comm.send(ch.model.stage_output(), (vs + 1) % p, tag(vs, false, false));
                if traced_on {
                    comm.send(&stamp_bits(self.clock), (vs + 1) % p, tag(vs, false, true));
                }
            }
            let a = ch.model.take_activations().expect("forward made activations");
            (self.held, self.in_flight) = (self.held + a.bytes(), self.in_flight + 1);
            (self.peak_bytes, self.peak_in_flight) = (self.peak_bytes.max(self.held), self.peak_in_flight.max(self.in_flight));
            self.live[c][task.mb] = Some(a);
        } else {
            if !first {
                let comm = pipe.comm.expect("pipeline group");
                comm.send(ch.model.stage_input_grad(), (vs - 1) % p, tag(vs - 1, true, false));
                if traced_on {
                    comm.send(&stamp_bits(self.clock), (vs - 1) % p, tag(vs - 1, true, true));
                }
            }
            let a = ch.model.take_activations().expect("backward keeps its activations");
            (self.held, self.in_flight) = (self.held - a.bytes(), self.in_flight - 1);
            self.free[c].push(a);
        }
        if traced_on {
            self.traced.push(TracedTask { forward: task.forward, mb: task.mb, chunk: c, wall_start: w0, wall_end: self.t0.elapsed().as_secs_f64(), wall_wait: w1 - w0, dev_start, dev_end: self.clock });
        }
    }

    /// After the last task: each model keeps its last activations (for its statistics), the
    /// pool the others; the trace gets the tasks. Returns the loss sums and the peaks.
    #[allow(clippy::type_complexity)] // (the step's sums, the objective's sums, two peaks)
    fn finish(self, chunks: &mut [Chunk], pipe: &mut Pipeline) -> (Vec<f64>, (Option<model::pairs::PairStats>, Option<model::policy::PolicyStats>), usize, usize) {
        for (ch, mut f) in chunks.iter_mut().zip(self.free) {
            if let Some(a) = f.pop() {
                ch.model.put_activations(a);
            }
            ch.pool = f;
        }
        if let Some(tr) = pipe.trace.as_deref_mut() {
            tr.tasks = self.traced;
        }
        (self.sums, (self.pair_stats, self.policy_stats), self.peak_bytes, self.peak_in_flight)
    }
}

/// FP8: this step's amaxes, the same on every data-parallel rank (elementwise max) and, over
/// the tensor-parallel shards of each tensor, the whole tensor's (the max of the shards'), join
/// the scaling histories (whether or not the update happens).
fn fp8_amaxes(chunks: &mut [Chunk], tp: Option<&dyn parallel::Comm>) {
    for ch in chunks.iter_mut() {
        let dpn = ch.dp.n();
        if let Some(st) = ch.model.fp8.as_mut() {
            let pending = st.get_mut().pending_mut();
            let mut max_over = |n: usize, gather: &mut dyn FnMut(&[f64]) -> Vec<f64>| {
                let mine: Vec<f64> = pending.iter().map(|&x| x as f64).collect();
                let all = gather(&mine);
                for (i, p) in pending.iter_mut().enumerate() {
                    *p = (0..n).map(|r| all[r * mine.len() + i] as f32).fold(0.0, f32::max);
                }
            };
            if dpn > 1 {
                max_over(dpn, &mut |x| ch.dp.all_gather_f64(x));
            }
            if let Some(tp) = tp.filter(|c| c.size() > 1) {
                max_over(tp.size(), &mut |x| parallel::comm::all_gather_f64(tp, x));
            }
            ch.model.fp8_commit();
        }
    }
}

/// The step's mean loss: the last stage's sums over its data-parallel group, taken from it by
/// every stage; the mean over micro-batches of each one's mean.
/// A sequence objective's sums over the data-parallel ranks, as the pipeline's last stage has
/// them.
fn global_sums<const N: usize>(chunks: &mut [Chunk], pipe: &Pipeline, st: &[f64; N]) -> [f64; N] {
    let v = chunks.len();
    let sums = if chunks[0].dp.n() > 1 { chunks[v - 1].dp.all_reduce_f64(st) } else { st.to_vec() };
    let sums = match pipe.comm {
        Some(comm) => parallel::comm::all_gather_f64(comm, &sums)[(pipe.sched.p - 1) * N..].to_vec(),
        None => sums,
    };
    sums.try_into().expect("one sum per field")
}

fn global_loss(chunks: &mut [Chunk], pipe: &Pipeline, sums: Vec<f64>) -> f64 {
    let (p, m, v) = (pipe.sched.p, pipe.sched.m, pipe.sched.v);
    let sums = if chunks[0].dp.n() > 1 { chunks[v - 1].dp.all_reduce_f64(&sums) } else { sums };
    let sums = match pipe.comm {
        Some(comm) => parallel::comm::all_gather_f64(comm, &sums)[(p - 1) * 2 * m..].to_vec(),
        None => sums,
    };
    (0..m).map(|k| if sums[2 * k + 1] > 0.0 { sums[2 * k] / sums[2 * k + 1] } else { 0.0 }).sum::<f64>() / m as f64
}

/// The tied embedding: the first stage's gradient (from the embedding) and the last stage's
/// (from the head) are two parts of one gradient; both copies get the sum. Returns this
/// rank's chunks that hold a tied copy.
fn sum_tied_embedding(chunks: &mut [Chunk], pipe: &Pipeline) -> Vec<usize> {
    let (p, v, me) = (pipe.sched.p, pipe.sched.v, pipe.rank);
    let last_vs = p * v - 1;
    let tied: Vec<usize> = (0..v)
        .filter(|&c| {
            let vs = c * p + me;
            chunks[c].model.cfg.tied_embeddings && (vs == 0 || vs == last_vs) && p * v > 1
        })
        .collect();
    if !tied.is_empty() {
        let _p = profile::scope("pp tied embedding");
        let mut sum: Vec<f32> = chunks[tied[0]].dp.unit_grads_mut(0).to_vec();
        for &c in &tied[1..] {
            for (s, g) in sum.iter_mut().zip(chunks[c].dp.unit_grads_mut(0).iter()) {
                *s += *g;
            }
        }
        if let Some(tie) = pipe.tie {
            tie.all_reduce_sum(&mut sum);
        }
        for &c in &tied {
            chunks[c].dp.unit_grads_mut(0).copy_from_slice(&sum);
        }
    }
    tied
}

/// The global gradient norm: per chunk over its data-parallel group, tensor-parallel shards
/// added (replicated parameters once), then the pipeline's stages added (the tied embedding
/// once: not on the last stage).
fn global_grad_norm(chunks: &mut [Chunk], pipe: &Pipeline, tied: &[usize]) -> f64 {
    let (p, me, last_vs) = (pipe.sched.p, pipe.rank, pipe.sched.p * pipe.sched.v - 1);
    let (mut sharded, mut repl) = (0.0, 0.0);
    for (c, ch) in chunks.iter_mut().enumerate() {
        let vs = c * p + me;
        let skip: Vec<Range<usize>> = if vs == last_vs && tied.contains(&c) && vs != 0 { vec![ch.model.units[0].clone()] } else { Vec::new() };
        let (a, b) = ch.dp.grad_sq_split(&ch.replicated, &skip);
        (sharded, repl) = (sharded + a, repl + b);
    }
    let sq = match pipe.tp {
        Some(comm) => parallel::comm::sum_f64(comm, sharded) + repl,
        None => sharded + repl,
    };
    match pipe.comm {
        Some(comm) => parallel::comm::sum_f64(comm, sq),
        None => sq,
    }
    .sqrt()
}

/// A single-rank [`DataParallel`] over `model` (its own communication thread does nothing).
pub fn single_rank(model: &mut Gpt) -> DataParallel {
    let comm: Box<dyn parallel::Comm> = Box::new(parallel::InProcess::world(1).pop().unwrap());
    DataParallel::new(comm, model, 0, parallel::dp::DEFAULT_BUCKET_ELEMS)
}

/// Model FLOPs per trained token (forward and backward, no recomputation), by PaLM's formula
/// (Chowdhery et al. 2022, appendix B) as the planner states it.
/// With mixture-of-experts layers N counts the parameters a token uses: the routed experts'
/// weights only `top_k / n_expert` of them. Under LoRA the frozen base computes no weight
/// gradients: 4 FLOPs per base parameter (forward, input gradient) and 6 per adapter
/// parameter, what the passes compute (attention's term is unchanged).
pub fn model_flops_per_token(model: &Gpt, t: usize) -> f64 {
    let mut n = model.layout.count_without("transformer.wpe.weight") as f64;
    let c = &model.cfg;
    if c.is_moe() {
        let routed: usize = model.views.blocks.iter().filter_map(|b| b.moe.as_ref()).map(|m| m.experts.len()).sum();
        n -= routed as f64 * (1.0 - c.top_k as f64 / c.n_expert as f64);
    }
    let full = plan::palm_flops_per_token(n, c.n_layer as f64, c.n_embd as f64, t as f64);
    match &model.lora {
        Some(lo) => full - 2.0 * n + 6.0 * lo.num_params() as f64,
        None => full,
    }
}

/// The parameters and gradients that train: the LoRA adapters when the model has them, else
/// every parameter.
pub fn trainable(model: &mut Gpt) -> (&mut [f32], &mut [f32]) {
    match model.lora.as_mut() {
        Some(lo) => (&mut lo.params, &mut lo.grads),
        None => (&mut model.params, &mut model.grads),
    }
}

/// The layout of [`trainable`].
pub fn trainable_layout(model: &Gpt) -> &model::ParamLayout {
    model.lora.as_ref().map_or(&model.layout, |lo| &lo.layout)
}

/// Hardware FLOPs per token: the model FLOPs plus the forward work that activation
/// recomputation repeats (for HFU, which counts what the machine executes; MFU never counts
/// recomputation). Full reruns each block's forward, `2·N_blocks + 4·L·C·T` (its matmuls and
/// attention, as in PaLM's split of `6N + 12·L·C·T` into forward and backward) — for the
/// recomputed share of the layers; selective reruns the attention core.
pub fn hardware_flops_per_token(model: &Gpt, t: usize) -> f64 {
    let c = &model.cfg;
    let attn_fwd = 4.0 * (c.n_layer * c.n_embd * t) as f64;
    let sum = |f: &dyn Fn(&model::layout::BlockParams) -> usize| model.views.blocks.iter().map(f).sum::<usize>() as f64;
    let extra = match model.recompute {
        model::gpt::Recompute::None => 0.0,
        model::gpt::Recompute::Full => {
            // Every `recompute_every`-th layer only.
            let k = model.recompute_every.max(1);
            let share = (0..c.n_layer).filter(|i| (c.first_layer() + i).is_multiple_of(k)).count() as f64 / c.n_layer as f64;
            share * (2.0 * sum(&|b| b.c_attn_w.len() + b.attn_proj_w.len() + b.c_fc_w.len() + b.mlp_proj_w.len() + b.moe.as_ref().map_or(0, |m| m.router.len() + m.shared.len() + m.experts.len() * c.top_k / c.n_expert.max(1))) + attn_fwd)
        }
        // Korthikanti's selective recomputation re-runs the attention core alone.
        model::gpt::Recompute::Selective => attn_fwd,
    };
    model_flops_per_token(model, t) + extra
}
