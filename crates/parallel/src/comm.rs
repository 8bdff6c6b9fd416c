//! The communicator: the collectives every parallel strategy is written against, and the
//! in-process backend (one OS thread per rank, shared memory) that `kiln train --dp N` and the
//! tests run on.
//!
//! Contract shared by every backend:
//! - Every rank of a group calls the same collectives in the same order with matching sizes.
//!   A mismatch (different collective, different lengths, different root) is detected at the
//!   rendezvous and every rank panics with a message naming the group and the ranks.
//! - **Reductions sum in rank order**: element `i` of a sum is
//!   `((x₀[i] + x₁[i]) + x₂[i]) + …`, never in arrival order, so results are bit-identical
//!   regardless of thread timing and equal to the sequential left fold.
//! - At group size 1 every collective is the identity (a copy where input and output differ).
//! - Ranks passed to and returned from a communicator are ranks *within its group*
//!   (`0..size()`); [`InProcessComm::world_ranks`] maps them back to world ranks.
//! - Every backend starts each collective with the same code, `preamble` (shape checks, the
//!   call's [`Signature`] and sequence number, the byte [`Counters`], the size-1 identity), and
//!   `send`/`recv`/`split` with `p2p_preamble` / `split_preamble`; only the rendezvous and
//!   the data phase are the backend's own.
//!
//! Hang diagnostics: a rank that waits longer than the communicator's timeout (default
//! [`DEFAULT_TIMEOUT`], overridable with `KILN_COMM_TIMEOUT_S` or
//! [`InProcess::world_with_timeout`]) panics with the collective, the group (as world ranks),
//! the ranks that have arrived and what each is waiting in, and the ranks that have not. A rank
//! that panics marks the world aborted, and every rank blocked in a collective then panics
//! within ~100 ms instead of waiting out the timeout.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::mesh::{Axis, DeviceMesh};

/// Collectives over one group of ranks. Buffers are `f32`; every call is blocking.
///
/// Every collective is `#[track_caller]`: its signature (per-group sequence number, op, dtype,
/// element counts, the caller's source location) is compared across ranks, and a mismatch or a
/// timeout names the ranks, the sequence number and each rank's call site.
pub trait Comm: Send {
    /// This rank within the communicator's group, `0..size()`.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// `buf ← Σ_r buf_r`, summed in rank order. Lengths must match across ranks.
    #[track_caller]
    fn all_reduce_sum(&self, buf: &mut [f32]);
    /// `out ← (Σ_r input_r)[rank·c .. (rank+1)·c]` with `c = out.len()`,
    /// `input.len() == size·c`; summed in rank order.
    #[track_caller]
    fn reduce_scatter_sum(&self, input: &[f32], out: &mut [f32]);
    /// `out[r·c .. (r+1)·c] ← input_r` with `c = input.len()`, `out.len() == size·c`.
    #[track_caller]
    fn all_gather(&self, input: &[f32], out: &mut [f32]);
    /// `buf ← buf_root` on every rank.
    #[track_caller]
    fn broadcast(&self, buf: &mut [f32], root: usize);
    /// Buffered, non-blocking point-to-point send to group rank `to`. Messages between one
    /// pair with one tag arrive in the order sent; different tags are independent.
    #[track_caller]
    fn send(&self, buf: &[f32], to: usize, tag: u32);
    /// Blocks until the oldest message from `from` with `tag` arrives; its length must equal
    /// `buf.len()`.
    #[track_caller]
    fn recv(&self, buf: &mut [f32], from: usize, tag: u32);
    /// `input` is `size` equal chunks of `c = input.len()/size`; chunk `j` goes to rank `j`,
    /// and `out[r·c .. (r+1)·c]` receives rank `r`'s chunk for this rank.
    /// `out.len() == input.len()`.
    #[track_caller]
    fn all_to_all(&self, input: &[f32], out: &mut [f32]);
    /// Variable all-to-all: `input` is `size` consecutive blocks, `send[j]` elements for rank
    /// `j`; `out` receives rank `r`'s block for this rank at `Σ_{q<r} recv[q]`, `recv[r]`
    /// elements (which must equal rank `r`'s `send[rank]`). `send.len() == recv.len() == size`.
    /// Bytes counted: the blocks to and from other ranks.
    #[track_caller]
    fn all_to_all_v(&self, input: &[f32], send: &[usize], out: &mut [f32], recv: &[usize]);
    #[track_caller]
    fn barrier(&self);
    /// A sub-communicator over `ranks` (ranks of this group, listed in the order that becomes
    /// the new group's rank order; must contain this rank). Collective over this group: every
    /// rank calls `split` (the same number of times, in the same order), each with the group
    /// it belongs to; the groups must partition this group (e.g. one mesh axis's groups).
    fn split(&self, ranks: &[usize]) -> Box<dyn Comm>;
    /// Byte counters of this rank, shared by every communicator split from the same world
    /// communicator (so they total a rank's traffic over all its groups).
    fn counters(&self) -> Arc<Counters>;
}

/// The collectives counted by [`Counters`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    SendRecv,
    AllToAll,
    Barrier,
}

pub const OPS: [Op; 7] = [Op::AllReduce, Op::ReduceScatter, Op::AllGather, Op::Broadcast, Op::SendRecv, Op::AllToAll, Op::Barrier];

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::SendRecv => "send_recv",
            Op::AllToAll => "all_to_all",
            Op::Barrier => "barrier",
        }
    }
}

/// Calls and bytes per collective of one rank. Bytes are what this rank's buffers exchange with
/// other ranks under the backend's algorithm (a ring all-reduce of `B` bytes on `N` ranks sends
/// and receives `2(N−1)/N·B` each); copies within a rank are not counted.
#[derive(Default, Debug)]
pub struct Counters {
    calls: [AtomicU64; 7],
    sent: [AtomicU64; 7],
    recv: [AtomicU64; 7],
    /// Nanoseconds this rank spent blocked waiting for other ranks: at each collective's
    /// rendezvous and in `recv` (what a straggler costs the others).
    wait_ns: AtomicU64,
}

/// A snapshot of [`Counters`]: `(calls, bytes sent, bytes received)` per op, in [`OPS`] order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommTotals(pub [(u64, u64, u64); 7]);

impl Counters {
    pub fn add(&self, op: Op, sent: u64, recv: u64) {
        let i = op as usize;
        self.calls[i].fetch_add(1, Ordering::Relaxed);
        self.sent[i].fetch_add(sent, Ordering::Relaxed);
        self.recv[i].fetch_add(recv, Ordering::Relaxed);
    }

    /// Records one collective of this rank (group rank `rank` of `n`) under the byte model
    /// every backend implements: all-reduce of `len` elements — every rank reads every other
    /// whole buffer up to [`SMALL_ALL_REDUCE`] elements, else a reduce-scatter + all-gather,
    /// `2·(len − own chunk)` each way; reduce-scatter and all-gather of `len`-element chunks and
    /// all-to-all of `len`-element blocks, `(n−1)·len` each way; broadcast of `len` elements,
    /// `(n−1)·len` out of the root and `len` into every other rank; barrier, nothing.
    pub fn record(&self, op: Op, n: usize, rank: usize, len: usize, root: usize) {
        let e = |x: usize| (x * std::mem::size_of::<f32>()) as u64;
        let (sent, recv) = match op {
            _ if n == 1 => (0, 0),
            Op::AllReduce if len <= SMALL_ALL_REDUCE => (e((n - 1) * len), e((n - 1) * len)),
            Op::AllReduce => {
                let (lo, hi) = chunk_bounds(len, n, rank);
                (e(2 * (len - (hi - lo))), e(2 * (len - (hi - lo))))
            }
            Op::ReduceScatter | Op::AllGather | Op::AllToAll => (e((n - 1) * len), e((n - 1) * len)),
            Op::Broadcast if rank == root => (e((n - 1) * len), 0),
            Op::Broadcast => (0, e(len)),
            Op::Barrier | Op::SendRecv => (0, 0),
        };
        self.add(op, sent, recv);
    }

    /// Records one variable all-to-all of rank `rank`: the blocks to and from other ranks
    /// (`send[j]` / `recv[j]` elements each), `(Σ_{j≠rank} send[j])·4` bytes out and
    /// `(Σ_{j≠rank} recv[j])·4` in.
    pub fn record_v(&self, op: Op, rank: usize, send: &[usize], recv: &[usize]) {
        let others = |c: &[usize]| c.iter().enumerate().filter(|&(j, _)| j != rank).map(|(_, &x)| x).sum::<usize>() as u64 * 4;
        self.add(op, others(send), others(recv));
    }

    /// Adds time spent blocked on other ranks.
    pub fn add_wait(&self, d: Duration) {
        self.wait_ns.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Seconds blocked on other ranks so far (see [`Counters::add_wait`]).
    pub fn wait_s(&self) -> f64 {
        self.wait_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }

    pub fn snapshot(&self) -> CommTotals {
        let mut t = CommTotals::default();
        for i in 0..7 {
            t.0[i] = (self.calls[i].load(Ordering::Relaxed), self.sent[i].load(Ordering::Relaxed), self.recv[i].load(Ordering::Relaxed));
        }
        t
    }
}

impl CommTotals {
    /// What happened between `before` and `self`.
    pub fn since(&self, before: &CommTotals) -> CommTotals {
        let mut t = CommTotals::default();
        for i in 0..7 {
            t.0[i] = (self.0[i].0 - before.0[i].0, self.0[i].1 - before.0[i].1, self.0[i].2 - before.0[i].2);
        }
        t
    }

    pub fn get(&self, op: Op) -> (u64, u64, u64) {
        self.0[op as usize]
    }

    pub fn bytes_sent(&self) -> u64 {
        self.0.iter().map(|x| x.1).sum()
    }

    pub fn bytes_recv(&self) -> u64 {
        self.0.iter().map(|x| x.2).sum()
    }
}

/// What one rank called, compared across the group at each collective's first rendezvous.
///
/// `S` is the call site: the caller's `Location` in the in-process backend; a backend that
/// receives other processes' signatures (MPI) uses `Signature<String>` with the site as text
/// (`file:line:col`, as `Location` displays).
#[derive(Clone, Copy, Debug)]
pub struct Signature<S = &'static std::panic::Location<'static>> {
    /// Collectives this rank has called on this communicator before this one.
    pub seq: u64,
    pub op: &'static str,
    pub dtype: &'static str,
    /// Element counts (input, output) and a scalar argument (root) that must agree.
    pub counts: (usize, usize, usize),
    pub site: S,
}

impl<S> Signature<S> {
    /// Whether two ranks made the same call (the call sites may differ).
    pub fn same_call<T>(&self, o: &Signature<T>) -> bool {
        self.seq == o.seq && self.op == o.op && self.dtype == o.dtype && self.counts == o.counts
    }
}

impl<S: std::fmt::Display> Signature<S> {
    /// The same signature with its call site as text (what crosses a process boundary).
    pub fn with_site_text(&self) -> Signature<String> {
        Signature { seq: self.seq, op: self.op, dtype: self.dtype, counts: self.counts, site: self.site.to_string() }
    }
}

impl<S: std::fmt::Display> std::fmt::Display for Signature<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (a, b, x) = self.counts;
        write!(f, "#{} {}({} × {a}", self.seq, self.op, self.dtype)?;
        if b != 0 {
            write!(f, " → {b}")?;
        }
        if x != 0 {
            write!(f, ", root {x}")?;
        }
        write!(f, ") at {}", self.site)
    }
}

/// The error message for ranks whose signatures disagree (`None` when they agree).
/// `sigs[r]` is group rank `r`'s signature.
pub fn signature_mismatch<S: std::fmt::Display>(group: &str, sigs: &[Signature<S>]) -> Option<String> {
    if sigs.iter().all(|s| s.same_call(&sigs[0])) {
        return None;
    }
    let calls: Vec<String> = sigs.iter().enumerate().map(|(r, s)| format!("rank {r} called {s}")).collect();
    Some(format!("collective mismatch on {group} at sequence number {}: {}", sigs[0].seq.min(sigs.iter().map(|s| s.seq).min().unwrap()), calls.join("; ")))
}

/// The communicator of `comm`'s rank along `axis` of `mesh`. `comm` must be the world
/// communicator for `mesh` (its ranks are the mesh's ranks). Collective over `comm`.
pub fn mesh_group(comm: &dyn Comm, mesh: &DeviceMesh, axis: Axis) -> Box<dyn Comm> {
    assert_eq!(comm.size(), mesh.world(), "mesh_group: communicator size {} is not the mesh's world {}", comm.size(), mesh.world());
    comm.split(&mesh.group(axis, comm.rank()))
}

/// `out[r·k .. (r+1)·k] = x_r` for `k = x.len()`, exactly: each f64 travels as the bit
/// patterns of two f32s (collective over `comm`).
pub fn all_gather_f64(comm: &dyn Comm, x: &[f64]) -> Vec<f64> {
    if comm.size() == 1 {
        return x.to_vec();
    }
    let bits: Vec<f32> = x
        .iter()
        .flat_map(|v| {
            let b = v.to_bits();
            [f32::from_bits(b as u32), f32::from_bits((b >> 32) as u32)]
        })
        .collect();
    let mut out = vec![0f32; bits.len() * comm.size()];
    comm.all_gather(&bits, &mut out);
    out.chunks(2).map(|p| f64::from_bits(p[0].to_bits() as u64 | ((p[1].to_bits() as u64) << 32))).collect()
}

/// `Σ_r x_r` over `comm`'s ranks in rank order, exactly as a sequential f64 sum (collective).
pub fn sum_f64(comm: &dyn Comm, x: f64) -> f64 {
    all_gather_f64(comm, &[x]).iter().fold(0.0, |a, v| a + v)
}

/// One collective call as its [`preamble`] sees it: which collective, with the lengths or buffers whose shapes it
/// checks (and, at group size 1, copies).
pub(crate) enum Call<'a> {
    AllReduce { len: usize },
    ReduceScatter { input: &'a [f32], out: &'a mut [f32] },
    AllGather { input: &'a [f32], out: &'a mut [f32] },
    Broadcast { len: usize, root: usize },
    AllToAll { input: &'a [f32], out: &'a mut [f32] },
    AllToAllV { input: &'a [f32], send: &'a [usize], out: &'a mut [f32], recv: &'a [usize] },
    Barrier,
}

/// What every backend does first in every collective, written once: checks the shapes, takes this rank's
/// [`Signature`] of the call (sequence number from `seq`, which advances; the caller's site), records the bytes in
/// `counters` under the shared byte model, and at group size `n == 1` performs the call (the identity: a copy where
/// input and output differ). Returns the signature for the backend to check across the group before its data
/// phase, or `None` when the group has one rank and the call is done.
#[track_caller]
pub(crate) fn preamble(seq: &std::cell::Cell<u64>, counters: &Counters, n: usize, me: usize, call: Call<'_>) -> Option<Signature> {
    // (op name, signature counts, counted op, counted per-rank elements, root)
    let (name, counts, op, len, root) = match &call {
        Call::AllReduce { len } => ("all_reduce_sum", (*len, 0, 0), Op::AllReduce, *len, 0),
        Call::ReduceScatter { input, out } => {
            let c = out.len();
            assert_eq!(input.len(), n * c, "reduce_scatter_sum: input length {} is not size {n} × output length {c}", input.len());
            ("reduce_scatter_sum", (input.len(), c, 0), Op::ReduceScatter, c, 0)
        }
        Call::AllGather { input, out } => {
            let c = input.len();
            assert_eq!(out.len(), n * c, "all_gather: output length {} is not size {n} × input length {c}", out.len());
            ("all_gather", (c, out.len(), 0), Op::AllGather, c, 0)
        }
        Call::Broadcast { len, root } => {
            assert!(*root < n, "broadcast: root {root} outside group of size {n}");
            ("broadcast", (*len, 0, *root), Op::Broadcast, *len, *root)
        }
        Call::AllToAll { input, out } => {
            assert_eq!(input.len() % n, 0, "all_to_all: input length {} not divisible by size {n}", input.len());
            assert_eq!(out.len(), input.len(), "all_to_all: output length {} != input length {}", out.len(), input.len());
            ("all_to_all", (input.len(), 0, 0), Op::AllToAll, input.len() / n, 0)
        }
        Call::AllToAllV { input, send, out, recv } => {
            check_v("all_to_all_v", n, me, input, send, out, recv);
            ("all_to_all_v", (n, 0, 0), Op::AllToAll, 0, 0)
        }
        Call::Barrier => ("barrier", (0, 0, 0), Op::Barrier, 0, 0),
    };
    let s = seq.get();
    seq.set(s + 1);
    let sig = Signature { seq: s, op: name, dtype: "f32", counts, site: std::panic::Location::caller() };
    match &call {
        Call::AllToAllV { send, recv, .. } => counters.record_v(op, me, send, recv),
        _ => counters.record(op, n, me, len, root),
    }
    if n > 1 {
        return Some(sig);
    }
    if let Call::ReduceScatter { input, out } | Call::AllGather { input, out } | Call::AllToAll { input, out } | Call::AllToAllV { input, out, .. } = call {
        out.copy_from_slice(input);
    }
    None
}

/// The preamble of `send` (`sending`) and `recv` on every backend: the peer is in the group of `n`; the message's
/// `len` elements are counted.
pub(crate) fn p2p_preamble(counters: &Counters, n: usize, peer: usize, len: usize, sending: bool) {
    let bytes = (len * 4) as u64;
    if sending {
        assert!(peer < n, "send: destination rank {peer} outside group of size {n}");
        counters.add(Op::SendRecv, bytes, 0);
    } else {
        assert!(peer < n, "recv: source rank {peer} outside group of size {n}");
        counters.add(Op::SendRecv, 0, bytes);
    }
}

/// The preamble of `split` on every backend: takes the split's number from `splits` (which advances) and checks
/// this rank's list (`ranks` of a group of `n`, containing this rank `me`, each once). Returns the split's number.
pub(crate) fn split_preamble(splits: &std::cell::Cell<u64>, n: usize, me: usize, ranks: &[usize]) -> u64 {
    let s = splits.get();
    splits.set(s + 1);
    assert!(ranks.contains(&me), "split on rank {me}: the group {ranks:?} does not contain this rank");
    for (i, &r) in ranks.iter().enumerate() {
        assert!(r < n, "split on rank {me}: rank {r} outside group of size {n}");
        assert!(!ranks[..i].contains(&r), "split on rank {me}: rank {r} listed twice in {ranks:?}");
    }
    s
}

/// The error of a `split` of `group` (`n` ranks) whose requested lists (`list(k)`: rank `k`'s) do not partition it,
/// or `None` when they do; every rank computes the same.
pub(crate) fn partition_error(group: &str, n: usize, list: impl Fn(usize) -> Vec<usize>) -> Option<String> {
    for k in 0..n {
        for j in list(k) {
            if j >= n || list(j) != list(k) {
                let theirs = if j < n { list(j) } else { vec![] };
                return Some(format!("split on {group}: groups do not partition the parent: rank {k} asked for {:?} but rank {j} asked for {theirs:?}", list(k)));
            }
        }
    }
    None
}

/// The hang timeout from `KILN_COMM_TIMEOUT_S` (seconds), else [`DEFAULT_TIMEOUT`]; every backend reads it so.
pub(crate) fn timeout_from_env() -> Result<Duration, String> {
    match std::env::var("KILN_COMM_TIMEOUT_S") {
        Ok(s) => match s.trim().parse::<f64>() {
            Ok(t) if t > 0.0 && t.is_finite() => Ok(Duration::from_secs_f64(t)),
            _ => Err(format!("KILN_COMM_TIMEOUT_S must be a positive number of seconds, got {s:?}")),
        },
        Err(_) => Ok(DEFAULT_TIMEOUT),
    }
}

/// The shape checks of `all_to_all_v`.
fn check_v(what: &str, n: usize, me: usize, input: &[f32], send: &[usize], out: &[f32], recv: &[usize]) {
    assert!(send.len() == n && recv.len() == n, "{what} on rank {me}: {} send and {} receive counts for a group of {n}", send.len(), recv.len());
    assert_eq!(input.len(), send.iter().sum::<usize>(), "{what} on rank {me}: input length is not the sum of the send counts {send:?}");
    assert_eq!(out.len(), recv.iter().sum::<usize>(), "{what} on rank {me}: output length is not the sum of the receive counts {recv:?}");
    if n == 1 {
        assert_eq!(send[0], recv[0], "{what}: a single rank sends itself {} elements but expects {}", send[0], recv[0]);
    }
}

/// Chunk `k` of `len` elements split `n` ways, balanced (sizes differ by at most one).
pub fn chunk_bounds(len: usize, n: usize, k: usize) -> (usize, usize) {
    (k * len / n, (k + 1) * len / n)
}

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// All-reduces up to this many elements take the two-rendezvous path (every rank sums all).
pub(crate) const SMALL_ALL_REDUCE: usize = 4096;
const POLL: Duration = Duration::from_millis(100);
const NO_RANK: usize = usize::MAX;

// ---------------------------------------------------------------------------------------------
// In-process backend
// ---------------------------------------------------------------------------------------------

/// Constructor namespace for the in-process backend.
pub struct InProcess;

impl InProcess {
    /// `n` connected communicators, one per rank; move each to its own thread.
    pub fn world(n: usize) -> Vec<InProcessComm> {
        Self::world_with_timeout(n, timeout_from_env().unwrap_or_else(|e| panic!("{e}")))
    }

    pub fn world_with_timeout(n: usize, timeout: Duration) -> Vec<InProcessComm> {
        assert!(n > 0, "world size must be positive");
        let world = Arc::new(World {
            timeout,
            aborted_by: AtomicUsize::new(NO_RANK),
            next_group: AtomicU64::new(1),
            registry: Mutex::new(HashMap::new()),
            mail: Mutex::new(HashMap::new()),
            mail_cv: Condvar::new(),
        });
        let group = Arc::new(Group::new(0, (0..n).collect()));
        (0..n)
            .map(|r| InProcessComm {
                world: world.clone(),
                group: group.clone(),
                rank: r,
                splits: std::cell::Cell::new(0),
                seq: std::cell::Cell::new(0),
                counters: Arc::new(Counters::default()),
            })
            .collect()
    }
}

/// Runs `f` on `n` ranks, one scoped OS thread each (named `rank{r}`), and returns the per-rank
/// results in rank order. If any rank panics, the other ranks' collectives abort and this
/// re-raises the panic of the first rank that failed (not the follow-on aborts).
pub fn run_ranks<T, F>(n: usize, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(&InProcessComm) -> T + Sync,
{
    run_comms(InProcess::world(n), f)
}

/// [`run_ranks`] with an explicit hang timeout.
pub fn run_ranks_with_timeout<T, F>(n: usize, timeout: Duration, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(&InProcessComm) -> T + Sync,
{
    run_comms(InProcess::world_with_timeout(n, timeout), f)
}

fn run_comms<T, F>(comms: Vec<InProcessComm>, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(&InProcessComm) -> T + Sync,
{
    let world = comms[0].world.clone();
    let joined: Vec<std::thread::Result<T>> = std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                std::thread::Builder::new()
                    .name(format!("rank{}", c.rank))
                    .spawn_scoped(s, move || f(&c))
                    .expect("spawn rank thread")
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    if joined.iter().any(|r| r.is_err()) {
        let first = world.aborted_by.load(Ordering::SeqCst);
        let mut errs: Vec<(usize, Box<dyn std::any::Any + Send>)> =
            joined.into_iter().enumerate().filter_map(|(r, j)| j.err().map(|e| (r, e))).collect();
        let pick = errs.iter().position(|(r, _)| *r == first).unwrap_or(0);
        std::panic::resume_unwind(errs.swap_remove(pick).1);
    }
    joined.into_iter().map(|r| r.ok().unwrap()).collect()
}

/// (parent group id, split number, world ranks) → (the new group, members that picked it up).
type Registry = HashMap<(u64, u64, Vec<usize>), (Arc<Group>, usize)>;
/// (group id, from world rank, to world rank, tag) → messages in send order.
type Mailboxes = HashMap<(u64, usize, usize, u32), VecDeque<Vec<f32>>>;

struct World {
    timeout: Duration,
    /// World rank of the first rank that panicked holding a communicator, or `NO_RANK`.
    aborted_by: AtomicUsize,
    next_group: AtomicU64,
    /// Sub-groups being created by `split`.
    registry: Mutex<Registry>,
    /// Point-to-point mailboxes.
    mail: Mutex<Mailboxes>,
    mail_cv: Condvar,
}

/// What a rank deposits at a rendezvous: raw addresses of its buffers, valid until the
/// collective's closing rendezvous.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Slot {
    /// This rank's buffer (read-only unless the collective says otherwise).
    a: *mut f32,
    a_len: usize,
    /// A second length (e.g. the output's) that must also agree across ranks.
    b_len: usize,
    /// A scalar argument that must agree across ranks (e.g. the root).
    x: usize,
    /// Per-rank element counts (`all_to_all_v`'s send counts), `n` of them, or null.
    v: *const usize,
}

impl Default for Slot {
    fn default() -> Slot {
        Slot { a: std::ptr::null_mut(), a_len: 0, b_len: 0, x: 0, v: std::ptr::null() }
    }
}

// SAFETY: a slot's pointer is only dereferenced between the rendezvous that publishes it and
// the collective's closing rendezvous, while its owner is blocked inside the same collective
// and does not touch the buffer except through the regions the collective assigns it.
unsafe impl Send for Slot {}

struct Group {
    id: u64,
    /// World rank of each group rank.
    ranks: Vec<usize>,
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    generation: u64,
    count: usize,
    arrived: Vec<bool>,
    /// What each rank is waiting in (for diagnostics and the mismatch check).
    waiting_in: Vec<&'static str>,
    /// The signature each rank deposited at the opening rendezvous of its current collective.
    sigs: Vec<Option<Signature>>,
    slots: Vec<Slot>,
    /// Set once when ranks disagree at a rendezvous; every rank then panics with it.
    error: Option<String>,
}

impl Group {
    fn new(id: u64, ranks: Vec<usize>) -> Group {
        let n = ranks.len();
        Group {
            id,
            ranks,
            state: Mutex::new(State {
                generation: 0,
                count: 0,
                arrived: vec![false; n],
                waiting_in: vec![""; n],
                sigs: vec![None; n],
                slots: vec![Slot::default(); n],
                error: None,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank's handle on one group. `Send`, not `Sync`: owned by its rank's thread.
pub struct InProcessComm {
    world: Arc<World>,
    group: Arc<Group>,
    rank: usize,
    splits: std::cell::Cell<u64>,
    /// Collectives called on this communicator so far (the next one's sequence number).
    seq: std::cell::Cell<u64>,
    counters: Arc<Counters>,
}

impl Drop for InProcessComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let me = self.group.ranks[self.rank];
            let _ = self.world.aborted_by.compare_exchange(NO_RANK, me, Ordering::SeqCst, Ordering::SeqCst);
            self.world.mail_cv.notify_all();
        }
    }
}

unsafe fn rd<'a>(base: *mut f32, off: usize, len: usize) -> &'a [f32] {
    std::slice::from_raw_parts(base.add(off), len)
}

unsafe fn wr<'a>(base: *mut f32, off: usize, len: usize) -> &'a mut [f32] {
    std::slice::from_raw_parts_mut(base.add(off), len)
}

impl InProcessComm {
    /// World rank of each rank of this group, in group order.
    pub fn world_ranks(&self) -> &[usize] {
        &self.group.ranks
    }

    fn n(&self) -> usize {
        self.group.ranks.len()
    }

    fn describe_group(&self) -> String {
        format!("group {} (world ranks {:?})", self.group.id, self.group.ranks)
    }

    /// Panics because world rank `a` panicked while this rank waited in `what`.
    fn abort_panic(&self, what: &str, a: usize) -> ! {
        panic!(
            "{what} on {} abandoned by rank {} (world rank {}): world rank {a} panicked",
            self.describe_group(),
            self.rank,
            self.group.ranks[self.rank]
        );
    }

    /// Waits until every rank of the group has arrived at this rendezvous. With `slot`, this
    /// rank deposits its buffers and gets back everyone's (valid until the collective's next
    /// rendezvous: no rank deposits again before every rank has passed that one). With
    /// `uniform`, the last arrival checks that every rank deposited the same sizes.
    fn rendezvous(&self, what: &'static str, slot: Option<Slot>, sig: Option<Signature>) -> Vec<Slot> {
        let n = self.n();
        let me = self.rank;
        let start = Instant::now();
        let mut st = self.group.lock();
        if let Some(s) = slot {
            st.slots[me] = s;
        }
        st.arrived[me] = true;
        st.waiting_in[me] = what;
        if sig.is_some() {
            st.sigs[me] = sig;
        }
        st.count += 1;
        let gen = st.generation;
        if st.count == n {
            if st.error.is_none() {
                st.error = Self::validate(&st, n, what, sig.is_some(), &self.describe_group());
            }
            st.count = 0;
            st.arrived.iter_mut().for_each(|a| *a = false);
            st.generation += 1;
            self.group.cv.notify_all();
        } else {
            while st.generation == gen {
                let elapsed = start.elapsed();
                if elapsed >= self.world.timeout {
                    let msg = self.hang_message(&st, what, elapsed);
                    drop(st);
                    panic!("{msg}");
                }
                let a = self.world.aborted_by.load(Ordering::SeqCst);
                if a != NO_RANK {
                    drop(st);
                    self.abort_panic(what, a);
                }
                let wait = POLL.min(self.world.timeout - elapsed);
                st = self.group.cv.wait_timeout(st, wait).unwrap_or_else(|e| e.into_inner()).0;
            }
        }
        self.counters.add_wait(start.elapsed());
        if let Some(e) = &st.error {
            let e = e.clone();
            drop(st);
            panic!("{e}");
        }
        if slot.is_some() {
            st.slots.clone()
        } else {
            Vec::new()
        }
    }

    fn validate(st: &State, n: usize, what: &str, opening: bool, group: &str) -> Option<String> {
        if st.waiting_in.iter().any(|w| *w != what) || (opening && st.sigs.iter().any(|s| s.is_none())) {
            // Different collectives (or phases of them) met: name what each rank called.
            let calls: Vec<String> = (0..n)
                .map(|r| match &st.sigs[r] {
                    Some(s) if st.waiting_in[r] == s.op => format!("rank {r} called {s}"),
                    Some(s) => format!("rank {r} is in {} of {s}", st.waiting_in[r]),
                    None => format!("rank {r} is in {}", st.waiting_in[r]),
                })
                .collect();
            let seq = st.sigs.iter().flatten().map(|s| s.seq).min().unwrap_or(0);
            return Some(format!("collective mismatch on {group} at sequence number {seq}: {}", calls.join("; ")));
        }
        if opening {
            let sigs: Vec<Signature> = st.sigs.iter().map(|s| s.unwrap()).collect();
            return signature_mismatch(group, &sigs);
        }
        None
    }

    /// [`preamble`] on this communicator.
    #[track_caller]
    fn preamble(&self, call: Call<'_>) -> Option<Signature> {
        preamble(&self.seq, &self.counters, self.n(), self.rank, call)
    }

    fn hang_message(&self, st: &State, what: &str, elapsed: Duration) -> String {
        let missing: Vec<usize> = (0..self.n()).filter(|&r| !st.arrived[r]).collect();
        let missing_world: Vec<usize> = missing.iter().map(|&r| self.group.ranks[r]).collect();
        let here: Vec<String> = (0..self.n())
            .filter(|&r| st.arrived[r])
            .map(|r| match &st.sigs[r] {
                Some(s) => format!("rank {r} in {} of {s}", st.waiting_in[r]),
                None => format!("rank {r} in {}", st.waiting_in[r]),
            })
            .collect();
        format!(
            "collective {what} timed out after {:.1}s on rank {} of {}: ranks {missing:?} (world ranks {missing_world:?}) have not arrived; arrived: [{}]",
            elapsed.as_secs_f64(),
            self.rank,
            self.describe_group(),
            here.join(", ")
        )
    }

    fn lock_mail(&self) -> MutexGuard<'_, Mailboxes> {
        self.world.mail.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Comm for InProcessComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.n()
    }

    #[track_caller]
    fn all_reduce_sum(&self, buf: &mut [f32]) {
        let n = self.n();
        let me = self.rank;
        let len = buf.len();
        let Some(sig) = self.preamble(Call::AllReduce { len }) else { return };
        let p = buf.as_mut_ptr();
        // From here until the last rendezvous, `buf` is touched only through `p`.
        let slots = self.rendezvous("all_reduce_sum", Some(Slot { a: p, a_len: len, ..Slot::default() }), Some(sig));
        if len <= SMALL_ALL_REDUCE {
            // Small buffers: latency, not bandwidth, matters. Every rank sums everything itself
            // (same order, same bits) and writes its own buffer once nobody reads it any more:
            // two rendezvous instead of three.
            let mut acc = unsafe { rd(slots[0].a, 0, len) }.to_vec();
            for s in &slots[1..] {
                for (a, x) in acc.iter_mut().zip(unsafe { rd(s.a, 0, len) }) {
                    *a += *x;
                }
            }
            self.rendezvous("all_reduce_sum/read", None, None);
            unsafe { wr(p, 0, len).copy_from_slice(&acc) };
            return;
        }
        // Reduce-scatter: this rank sums chunk `me` of every buffer, in rank order, into its
        // own buffer. Rank k reads only chunk k of the others and writes only chunk k of its own.
        let (lo, hi) = chunk_bounds(len, n, me);
        const BLK: usize = 1024;
        let mut tmp = [0f32; BLK];
        let mut i = lo;
        while i < hi {
            let m = BLK.min(hi - i);
            let t = &mut tmp[..m];
            unsafe {
                t.copy_from_slice(rd(slots[0].a, i, m));
                for s in &slots[1..] {
                    for (acc, x) in t.iter_mut().zip(rd(s.a, i, m)) {
                        *acc += *x;
                    }
                }
                wr(p, i, m).copy_from_slice(t);
            }
            i += m;
        }
        self.rendezvous("all_reduce_sum/reduced", None, None);
        // All-gather: copy every other rank's finished chunk.
        for (k, s) in slots.iter().enumerate() {
            if k != me {
                let (lo, hi) = chunk_bounds(len, n, k);
                unsafe { wr(p, lo, hi - lo).copy_from_slice(rd(s.a, lo, hi - lo)) };
            }
        }
        self.rendezvous("all_reduce_sum/gathered", None, None);
    }

    #[track_caller]
    fn reduce_scatter_sum(&self, input: &[f32], out: &mut [f32]) {
        let c = out.len();
        let Some(sig) = self.preamble(Call::ReduceScatter { input, out: &mut *out }) else { return };
        let slot = Slot { a: input.as_ptr() as *mut f32, a_len: input.len(), b_len: c, ..Slot::default() };
        let slots = self.rendezvous("reduce_scatter_sum", Some(slot), Some(sig));
        let off = self.rank * c;
        unsafe {
            out.copy_from_slice(rd(slots[0].a, off, c));
            for s in &slots[1..] {
                for (acc, x) in out.iter_mut().zip(rd(s.a, off, c)) {
                    *acc += *x;
                }
            }
        }
        self.rendezvous("reduce_scatter_sum/done", None, None);
    }

    #[track_caller]
    fn all_gather(&self, input: &[f32], out: &mut [f32]) {
        let c = input.len();
        let Some(sig) = self.preamble(Call::AllGather { input, out: &mut *out }) else { return };
        let slot = Slot { a: input.as_ptr() as *mut f32, a_len: c, ..Slot::default() };
        let slots = self.rendezvous("all_gather", Some(slot), Some(sig));
        for (k, s) in slots.iter().enumerate() {
            unsafe { out[k * c..(k + 1) * c].copy_from_slice(rd(s.a, 0, c)) };
        }
        self.rendezvous("all_gather/done", None, None);
    }

    #[track_caller]
    fn broadcast(&self, buf: &mut [f32], root: usize) {
        let len = buf.len();
        let Some(sig) = self.preamble(Call::Broadcast { len, root }) else { return };
        let p = buf.as_mut_ptr();
        let slots = self.rendezvous("broadcast", Some(Slot { a: p, a_len: len, x: root, ..Slot::default() }), Some(sig));
        if self.rank != root {
            unsafe { wr(p, 0, len).copy_from_slice(rd(slots[root].a, 0, len)) };
        }
        self.rendezvous("broadcast/done", None, None);
    }

    #[track_caller]
    fn send(&self, buf: &[f32], to: usize, tag: u32) {
        p2p_preamble(&self.counters, self.n(), to, buf.len(), true);
        let key = (self.group.id, self.group.ranks[self.rank], self.group.ranks[to], tag);
        self.lock_mail().entry(key).or_default().push_back(buf.to_vec());
        self.world.mail_cv.notify_all();
    }

    #[track_caller]
    fn recv(&self, buf: &mut [f32], from: usize, tag: u32) {
        p2p_preamble(&self.counters, self.n(), from, buf.len(), false);
        let site = std::panic::Location::caller();
        let me_w = self.group.ranks[self.rank];
        let key = (self.group.id, self.group.ranks[from], me_w, tag);
        let start = Instant::now();
        let mut mail = self.lock_mail();
        loop {
            if let Some(msg) = mail.get_mut(&key).and_then(|q| q.pop_front()) {
                if mail.get(&key).is_some_and(|q| q.is_empty()) {
                    mail.remove(&key);
                }
                drop(mail);
                self.counters.add_wait(start.elapsed());
                assert_eq!(
                    msg.len(),
                    buf.len(),
                    "recv on rank {} of {}: message from rank {from} tag {tag} has {} elements, buffer has {}",
                    self.rank,
                    self.describe_group(),
                    msg.len(),
                    buf.len()
                );
                buf.copy_from_slice(&msg);
                return;
            }
            let elapsed = start.elapsed();
            if elapsed >= self.world.timeout {
                let mut pending: Vec<String> = mail
                    .iter()
                    .filter(|(k, q)| k.0 == self.group.id && k.2 == me_w && !q.is_empty())
                    .map(|(k, q)| {
                        let r = self.group.ranks.iter().position(|&w| w == k.1).unwrap();
                        format!("{} from rank {r} tag {}", q.len(), k.3)
                    })
                    .collect();
                pending.sort();
                drop(mail);
                panic!(
                    "recv from rank {from} tag {tag} at {site} timed out after {:.1}s on rank {} of {}; messages waiting for this rank: [{}]",
                    elapsed.as_secs_f64(),
                    self.rank,
                    self.describe_group(),
                    pending.join(", ")
                );
            }
            let a = self.world.aborted_by.load(Ordering::SeqCst);
            if a != NO_RANK {
                drop(mail);
                self.abort_panic("recv", a);
            }
            let wait = POLL.min(self.world.timeout - elapsed);
            mail = self.world.mail_cv.wait_timeout(mail, wait).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    #[track_caller]
    fn all_to_all(&self, input: &[f32], out: &mut [f32]) {
        let Some(sig) = self.preamble(Call::AllToAll { input, out: &mut *out }) else { return };
        let c = input.len() / self.n();
        let slot = Slot { a: input.as_ptr() as *mut f32, a_len: input.len(), ..Slot::default() };
        let slots = self.rendezvous("all_to_all", Some(slot), Some(sig));
        for (k, s) in slots.iter().enumerate() {
            unsafe { out[k * c..(k + 1) * c].copy_from_slice(rd(s.a, self.rank * c, c)) };
        }
        self.rendezvous("all_to_all/done", None, None);
    }

    #[track_caller]
    fn all_to_all_v(&self, input: &[f32], send: &[usize], out: &mut [f32], recv: &[usize]) {
        let (n, me) = (self.n(), self.rank);
        let Some(sig) = self.preamble(Call::AllToAllV { input, send, out: &mut *out, recv }) else { return };
        let slot = Slot { a: input.as_ptr() as *mut f32, a_len: input.len(), v: send.as_ptr(), ..Slot::default() };
        let slots = self.rendezvous("all_to_all_v", Some(slot), Some(sig));
        let mut at = 0;
        for (k, s) in slots.iter().enumerate() {
            // SAFETY: rank k's send counts (n of them) and input stay valid until the closing
            // rendezvous; its block for this rank starts after its blocks for ranks 0..me.
            let theirs = unsafe { std::slice::from_raw_parts(s.v, n) };
            assert_eq!(theirs[me], recv[k], "all_to_all_v on rank {me} of {}: rank {k} sends {} elements, this rank expects {}", self.describe_group(), theirs[me], recv[k]);
            let off: usize = theirs[..me].iter().sum();
            unsafe { out[at..at + recv[k]].copy_from_slice(rd(s.a, off, recv[k])) };
            at += recv[k];
        }
        self.rendezvous("all_to_all_v/done", None, None);
    }

    #[track_caller]
    fn barrier(&self) {
        if let Some(sig) = self.preamble(Call::Barrier) {
            self.rendezvous("barrier", None, Some(sig));
        }
    }

    fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    fn split(&self, ranks: &[usize]) -> Box<dyn Comm> {
        let (n, me) = (self.n(), self.rank);
        let seq = split_preamble(&self.splits, n, me, ranks);
        // Every rank checks that the requested groups partition this group consistently.
        if n > 1 {
            let slot = Slot { a: ranks.as_ptr() as *mut f32, a_len: ranks.len(), ..Slot::default() };
            let slots = self.rendezvous("split", Some(slot), None);
            let list = |k: usize| unsafe { std::slice::from_raw_parts(slots[k].a as *const usize, slots[k].a_len) }.to_vec();
            let bad = partition_error(&self.describe_group(), n, list);
            self.rendezvous("split/checked", None, None);
            if let Some(e) = bad {
                panic!("{e}");
            }
        }
        let world_ranks: Vec<usize> = ranks.iter().map(|&r| self.group.ranks[r]).collect();
        let new_rank = ranks.iter().position(|&r| r == me).unwrap();
        let key = (self.group.id, seq, world_ranks.clone());
        let group = {
            let mut reg = self.world.registry.lock().unwrap_or_else(|e| e.into_inner());
            let entry = reg.entry(key.clone()).or_insert_with(|| {
                let id = self.world.next_group.fetch_add(1, Ordering::SeqCst);
                (Arc::new(Group::new(id, world_ranks.clone())), 0)
            });
            entry.1 += 1;
            let g = entry.0.clone();
            if entry.1 == world_ranks.len() {
                reg.remove(&key);
            }
            g
        };
        Box::new(InProcessComm {
            world: self.world.clone(),
            group,
            rank: new_rank,
            splits: std::cell::Cell::new(0),
            seq: std::cell::Cell::new(0),
            counters: self.counters.clone(),
        })
    }
}
