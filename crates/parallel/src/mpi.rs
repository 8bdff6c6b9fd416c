//! The MPI backend of [`Comm`] (cargo feature `mpi`, rsmpi over the system MPI; tested with
//! OpenMPI 4.1): one process per rank, launched by `mpirun -n N`.
//!
//! Same contract as the in-process backend (see [`crate::comm`]):
//! - **Reductions sum in rank order**, bit-identical to the in-process backend and to the
//!   sequential left fold. `MPI_Allreduce`/`MPI_SUM` is never used (its order is unspecified):
//!   an all-reduce of more than 4096 elements is an `MPI_Alltoallv` that gives rank `k` chunk
//!   [`chunk_bounds`]`(len, n, k)` of every rank's buffer, a local rank-order sum, then an
//!   `MPI_Allgatherv` of the finished chunks; up to 4096 elements every rank all-gathers the
//!   whole buffers and sums everything itself (same order, same bits). `reduce_scatter_sum` is
//!   an `MPI_Alltoall` and a local rank-order sum.
//! - **Byte counters** use exactly the in-process formulas, including its small/large
//!   all-reduce split: `(n−1)·len·4` each way up to 4096 elements, `2·(len − c)·4` each way above
//!   (`c` = this rank's chunk; that is the ring's `2(n−1)/n·B` when `n` divides `len`);
//!   reduce-scatter, all-gather and all-to-all `(n−1)·c·4` each way (`c` = the per-rank chunk);
//!   broadcast `(n−1)·B` sent by the root and `B` received by every other rank; send/recv the
//!   message bytes; barrier 0. So one program reports the same [`Counters`] on both backends.
//!   The counters are shared by every communicator split from the same world communicator.
//! - **Signatures**: every collective (not send/recv) has a per-communicator sequence number
//!   and a [`Signature`] (seq, op, dtype, counts, the caller's `file:line:col`). Before its data
//!   phase, each rank non-blocking-sends a fixed-size record of its signature to every other
//!   rank of the group and non-blocking-receives theirs, polling until a deadline (the timeout:
//!   `KILN_COMM_TIMEOUT_S`, default [`DEFAULT_TIMEOUT`](crate::comm::DEFAULT_TIMEOUT)). The exchange is also the barrier.
//!   - A rank whose record has not arrived by the deadline is named:
//!     `collective all_reduce_sum timed out after 2.0s on rank 0 of group 0 (world ranks [0, 1,
//!     2, 3]): ranks [1] (world ranks [1]) have not arrived; arrived: [rank 0 in all_reduce_sum
//!     of #3 all_reduce_sum(f32 × 8) at src/x.rs:10:5, …]`.
//!   - Records that disagree make every rank of the group panic with the same
//!     [`signature_mismatch`] text: `collective mismatch on group 0 (world ranks [0, 1]) at
//!     sequence number 3: rank 0 called #3 all_reduce_sum(f32 × 8) at …; rank 1 called #3
//!     all_gather(f32 × 8 → 16) at …`.
//!
//!   The data phase after a matching exchange uses blocking MPI collectives. The exchange costs
//!   `2(n−1)` tiny messages per rank per collective: fine for the tens of ranks kiln runs on.
//! - `split` is collective over the parent: its signature (op `split`, the parent's current
//!   sequence number, which it does not advance — as in-process) is exchanged, the requested
//!   rank lists are all-gathered and checked to partition the parent, then
//!   `MPI_Comm_split(color = smallest parent rank of the group, key = position in the list)`
//!   gives the new group in list order. Groups are described as `group <path>` with `0` the
//!   world and `0.2` the world's third split, plus their world ranks.
//! - `send` copies the buffer and `MPI_Isend`s it (completed sends are reaped on later calls and
//!   drained, up to the timeout, when the communicator drops); messages between one pair with
//!   one tag arrive in order (MPI's non-overtaking rule); different tags are independent. User
//!   point-to-point traffic runs on its own duplicated MPI communicator, so user tags never meet
//!   the signature records. Tags must be at most `i32::MAX` (OpenMPI's `MPI_TAG_UB`). `recv`
//!   polls a matched probe until the timeout and checks the message length before receiving.
//!
//! Threads: [`init`] asks for `MPI_THREAD_MULTIPLE` and accepts `MPI_THREAD_SERIALIZED`; an
//! [`MpiComm`] is `Send` (not `Sync`), so it can be moved to a dedicated communication thread.
//! Under `Serialized` (see [`MpiWorld::threading`]) all of a process's communicators must be used
//! from one thread at a time. [`MpiWorld`] calls `MPI_Finalize` when dropped and must be
//! dropped on the thread that called [`init`], after every communicator is gone (if
//! communicators are still alive it warns and skips `MPI_Finalize`).
//!
//! Dead ranks: a rank that exits early makes `mpirun` (OpenMPI 4.1) kill the remaining ranks
//! within about a second and exit non-zero itself, naming the rank. A panic (exit code 101) or
//! `process::exit(c)` prints `mpirun detected that one or more processes exited with non-zero
//! status, thus causing the job to be terminated. The first process to do so was: Process
//! name: [[12345,1],1] Exit code: 101` (the last field of the process name is the world rank)
//! and mpirun exits with that code; a signal prints `mpirun noticed that process rank 1 with PID
//! 0 on node vm exited on signal 6 (Aborted).` and mpirun exits 128 + signal. A rank that hangs
//! without exiting is caught by the timeout above on the ranks waiting for it.

use std::cell::{Cell, RefCell};
use std::mem::ManuallyDrop;
use std::os::raw::{c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::datatype::{Equivalence, Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;

use crate::comm::{chunk_bounds, p2p_preamble, partition_error, preamble, signature_mismatch, split_preamble, timeout_from_env, Call, Comm, Counters, Signature, SMALL_ALL_REDUCE};

/// All-reduces up to this many elements take the all-gather path (as in-process).
/// Bytes of one signature record.
const REC: usize = 512;
/// Header of a record: seq, op, dtype, counts ×3, site length.
const REC_HEAD: usize = 7 * 8;
/// Tag of signature records on the collective communicator.
const SIG_TAG: c_int = 1;
/// Ops a record can name (index = op id on the wire).
const OP_NAMES: [&str; 8] = ["all_reduce_sum", "reduce_scatter_sum", "all_gather", "broadcast", "all_to_all", "barrier", "split", "all_to_all_v"];
const DTYPES: [&str; 1] = ["f32"];

/// The MPI environment of this process. Keeps MPI initialised; hands out world communicators.
pub struct MpiWorld {
    universe: Option<Universe>,
    threading: Threading,
    timeout: Duration,
    /// One clone per live communicator.
    live: Arc<()>,
}

/// Initialises MPI (`MPI_THREAD_MULTIPLE` requested, `MPI_THREAD_SERIALIZED` accepted) and
/// reads the hang timeout from `KILN_COMM_TIMEOUT_S` (seconds; default [`DEFAULT_TIMEOUT`](crate::comm::DEFAULT_TIMEOUT)).
/// Errors if MPI was already initialised, provides less than `Serialized`, or the timeout is
/// malformed.
pub fn init() -> Result<MpiWorld, String> {
    let timeout = timeout_from_env()?;
    let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple).ok_or("MPI is already initialised in this process")?;
    match threading {
        Threading::Multiple | Threading::Serialized => {}
        t => return Err(format!("MPI provides thread level {t:?}; kiln needs Serialized or Multiple (the communicator runs on its own thread)")),
    }
    Ok(MpiWorld { universe: Some(universe), threading, timeout, live: Arc::new(()) })
}

impl MpiWorld {
    /// The thread level MPI provides (`Multiple` or `Serialized`).
    pub fn threading(&self) -> Threading {
        self.threading
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Overrides the hang timeout of communicators made from now on.
    pub fn set_timeout(&mut self, timeout: Duration) {
        assert!(timeout > Duration::ZERO, "timeout must be positive");
        self.timeout = timeout;
    }

    /// A communicator over all ranks of the job (`MPI_COMM_WORLD`, duplicated), with its own
    /// [`Counters`]. Collective: every rank calls it the same number of times.
    pub fn world(&self) -> MpiComm {
        let w = self.universe.as_ref().expect("MPI finalised").world();
        let n = w.size() as usize;
        MpiComm::new(&w, (0..n).collect(), "0".into(), self.timeout, Arc::new(Counters::default()), self.live.clone())
    }
}

impl Drop for MpiWorld {
    fn drop(&mut self) {
        let alive = Arc::strong_count(&self.live) - 1;
        if alive > 0 {
            eprintln!("kiln mpi: MpiWorld dropped while {alive} communicator(s) are alive; not calling MPI_Finalize");
            std::mem::forget(self.universe.take());
        }
    }
}

struct PendingSend {
    /// Owned copy being sent; its heap buffer stays put while the request is active (never
    /// read here: MPI reads it).
    _buf: Vec<f32>,
    req: ffi::MPI_Request,
}

/// One rank's handle on one group of MPI ranks. `Send`, not `Sync`.
pub struct MpiComm {
    /// Signature records and collective data.
    coll: ManuallyDrop<SimpleCommunicator>,
    /// User point-to-point messages.
    p2p: ManuallyDrop<SimpleCommunicator>,
    rank: usize,
    /// World rank of each group rank.
    world_ranks: Vec<usize>,
    id: String,
    timeout: Duration,
    /// Collectives called so far (the next one's sequence number).
    seq: Cell<u64>,
    splits: Cell<u64>,
    counters: Arc<Counters>,
    pending: RefCell<Vec<PendingSend>>,
    /// Receive buffer of the reductions, kept between calls (up to [`SCRATCH_KEEP`]) so that
    /// repeated large all-reduces do not page-fault a fresh allocation each time.
    scratch: RefCell<Vec<f32>>,
    _live: Arc<()>,
}

/// Largest scratch buffer (elements) a communicator keeps between calls: 256 MiB.
const SCRATCH_KEEP: usize = 64 << 20;

// SAFETY: MPI runs at `MPI_THREAD_MULTIPLE` or `MPI_THREAD_SERIALIZED` (checked by `init`), so
// MPI may be called from any thread; `MpiComm` is not `Sync`, so one thread at a time uses it.
// Its raw handles (communicators, requests, buffers of pending sends) are owned by it.
unsafe impl Send for MpiComm {}

fn count(x: usize, what: &str) -> c_int {
    c_int::try_from(x).unwrap_or_else(|_| panic!("{what}: {x} elements exceed MPI's count limit"))
}

/// Waits a little between polls: spins (yielding) at first, then sleeps.
fn backoff(polls: &mut u32) {
    *polls += 1;
    if *polls < 2000 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// `MPI_Test`; true when complete (the request is then `MPI_REQUEST_NULL`).
fn test(req: &mut ffi::MPI_Request) -> bool {
    let mut flag: c_int = 0;
    unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
    flag != 0
}

fn encode(s: &Signature<String>) -> Vec<u8> {
    let mut r = vec![0u8; REC];
    let op = OP_NAMES.iter().position(|&o| o == s.op).expect("op on the wire") as u64;
    let dt = DTYPES.iter().position(|&d| d == s.dtype).expect("dtype on the wire") as u64;
    let site = s.site.as_bytes();
    let sl = site.len().min(REC - REC_HEAD);
    for (i, v) in [s.seq, op, dt, s.counts.0 as u64, s.counts.1 as u64, s.counts.2 as u64, sl as u64].into_iter().enumerate() {
        r[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    r[REC_HEAD..REC_HEAD + sl].copy_from_slice(&site[..sl]);
    r
}

fn decode(r: &[u8]) -> Signature<String> {
    let f = |i: usize| u64::from_le_bytes(r[i * 8..i * 8 + 8].try_into().unwrap());
    let sl = (f(6) as usize).min(REC - REC_HEAD);
    Signature {
        seq: f(0),
        op: OP_NAMES.get(f(1) as usize).copied().unwrap_or("?"),
        dtype: DTYPES.get(f(2) as usize).copied().unwrap_or("?"),
        counts: (f(3) as usize, f(4) as usize, f(5) as usize),
        site: String::from_utf8_lossy(&r[REC_HEAD..REC_HEAD + sl]).into_owned(),
    }
}

impl MpiComm {
    fn new(parent: &SimpleCommunicator, world_ranks: Vec<usize>, id: String, timeout: Duration, counters: Arc<Counters>, live: Arc<()>) -> MpiComm {
        let coll = parent.duplicate();
        let p2p = parent.duplicate();
        let rank = coll.rank() as usize;
        assert_eq!(coll.size() as usize, world_ranks.len());
        MpiComm {
            coll: ManuallyDrop::new(coll),
            p2p: ManuallyDrop::new(p2p),
            rank,
            world_ranks,
            id,
            timeout,
            seq: Cell::new(0),
            splits: Cell::new(0),
            counters,
            pending: RefCell::new(Vec::new()),
            scratch: RefCell::new(Vec::new()),
            _live: live,
        }
    }

    /// World rank of each rank of this group, in group order.
    pub fn world_ranks(&self) -> &[usize] {
        &self.world_ranks
    }

    /// This communicator's hang timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn n(&self) -> usize {
        self.world_ranks.len()
    }

    fn describe_group(&self) -> String {
        format!("group {} (world ranks {:?})", self.id, self.world_ranks)
    }

    /// [`preamble`] on this communicator.
    #[track_caller]
    fn preamble(&self, call: Call<'_>) -> Option<Signature> {
        preamble(&self.seq, &self.counters, self.n(), self.rank, call)
    }

    /// Exchanges signatures with every other rank of the group (and so waits until all have
    /// arrived); panics on a timeout or a mismatch.
    fn exchange(&self, sig: Signature) {
        let n = self.n();
        let me = self.rank;
        if n == 1 {
            return;
        }
        let sig = sig.with_site_text();
        self.reap();
        let rec = encode(&sig);
        let mut inbox = vec![0u8; REC * n];
        let comm = self.coll.as_raw();
        let dt = u8::equivalent_datatype().as_raw();
        // (peer, is receive, request)
        let mut reqs: Vec<(usize, bool, ffi::MPI_Request)> = Vec::with_capacity(2 * (n - 1));
        for k in (0..n).filter(|&k| k != me) {
            let mut rq: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
            unsafe { ffi::MPI_Irecv(inbox.as_mut_ptr().add(k * REC) as *mut c_void, REC as c_int, dt, k as c_int, SIG_TAG, comm, &mut rq) };
            reqs.push((k, true, rq));
        }
        for k in (0..n).filter(|&k| k != me) {
            let mut rq: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
            unsafe { ffi::MPI_Isend(rec.as_ptr() as *const c_void, REC as c_int, dt, k as c_int, SIG_TAG, comm, &mut rq) };
            reqs.push((k, false, rq));
        }
        let start = Instant::now();
        let mut polls = 0;
        let mut arrived = vec![false; n];
        arrived[me] = true;
        loop {
            reqs.retain_mut(|(k, is_recv, rq)| {
                let done = test(rq);
                if done && *is_recv {
                    arrived[*k] = true;
                }
                !done
            });
            if reqs.is_empty() {
                break;
            }
            let elapsed = start.elapsed();
            if elapsed >= self.timeout {
                let missing: Vec<usize> = (0..n).filter(|&r| !arrived[r]).collect();
                let missing_world: Vec<usize> = missing.iter().map(|&r| self.world_ranks[r]).collect();
                let here: Vec<String> = (0..n)
                    .filter(|&r| arrived[r])
                    .map(|r| {
                        let s = if r == me { sig.clone() } else { decode(&inbox[r * REC..(r + 1) * REC]) };
                        format!("rank {r} in {} of {s}", s.op)
                    })
                    .collect();
                // MPI may still write into `inbox` and read `rec`: leak them.
                std::mem::forget(inbox);
                std::mem::forget(rec);
                panic!(
                    "collective {} timed out after {:.1}s on rank {me} of {}: ranks {missing:?} (world ranks {missing_world:?}) have not arrived; arrived: [{}]",
                    sig.op,
                    elapsed.as_secs_f64(),
                    self.describe_group(),
                    here.join(", ")
                );
            }
            backoff(&mut polls);
        }
        self.counters.add_wait(start.elapsed());
        let sigs: Vec<Signature<String>> = (0..n).map(|r| if r == me { sig.clone() } else { decode(&inbox[r * REC..(r + 1) * REC]) }).collect();
        if let Some(e) = signature_mismatch(&self.describe_group(), &sigs) {
            panic!("{e}");
        }
    }

    /// Runs `f` on a scratch buffer of `len` elements (contents unspecified).
    fn with_scratch<T>(&self, len: usize, f: impl FnOnce(&mut [f32]) -> T) -> T {
        let mut s = self.scratch.borrow_mut();
        if s.len() < len {
            *s = vec![0f32; len];
        }
        let r = f(&mut s[..len]);
        if s.len() > SCRATCH_KEEP {
            *s = Vec::new();
        }
        r
    }

    /// Frees the completed sends.
    fn reap(&self) {
        self.pending.borrow_mut().retain_mut(|p| !test(&mut p.req));
    }

    fn tag(tag: u32) -> c_int {
        c_int::try_from(tag).unwrap_or_else(|_| panic!("tag {tag} exceeds MPI's tag limit {}", c_int::MAX))
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // Leave pending sends and the MPI communicators alone: the job is going down and
            // freeing communicators could wait on other ranks.
            std::mem::forget(std::mem::take(self.pending.get_mut()));
            return;
        }
        let start = Instant::now();
        let mut polls = 0;
        loop {
            self.reap();
            if self.pending.borrow().is_empty() {
                break;
            }
            if start.elapsed() >= self.timeout {
                eprintln!(
                    "kiln mpi: rank {} of {}: {} send(s) not received after {:.1}s; leaking them",
                    self.rank,
                    self.describe_group(),
                    self.pending.borrow().len(),
                    self.timeout.as_secs_f64()
                );
                std::mem::forget(std::mem::take(self.pending.get_mut()));
                break;
            }
            backoff(&mut polls);
        }
        unsafe {
            ManuallyDrop::drop(&mut self.p2p);
            ManuallyDrop::drop(&mut self.coll);
        }
    }
}

impl Comm for MpiComm {
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
        count(len, "all_reduce_sum");
        self.exchange(sig);
        if len <= SMALL_ALL_REDUCE {
            self.with_scratch(n * len, |all| {
                self.coll.all_gather_into(&buf[..], &mut all[..]);
                buf.copy_from_slice(&all[..len]);
                for part in all.chunks_exact(len.max(1)).skip(1).take(n - 1) {
                    for (a, x) in buf.iter_mut().zip(part) {
                        *a += *x;
                    }
                }
            });
            return;
        }
        let (lo, hi) = chunk_bounds(len, n, me);
        let c = hi - lo;
        // Chunk k of every buffer goes to rank k.
        let sizes: Vec<c_int> = (0..n).map(|k| chunk_bounds(len, n, k)).map(|(l, h)| (h - l) as c_int).collect();
        let offs: Vec<c_int> = (0..n).map(|k| chunk_bounds(len, n, k).0 as c_int).collect();
        self.with_scratch(n * c, |parts| {
            {
                let send = Partition::new(&buf[..], &sizes[..], &offs[..]);
                let rc: Vec<c_int> = vec![c as c_int; n];
                let rd: Vec<c_int> = (0..n).map(|r| (r * c) as c_int).collect();
                let mut recv = PartitionMut::new(&mut parts[..], rc, rd);
                self.coll.all_to_all_varcount_into(&send, &mut recv);
            }
            // Rank-order sum of chunk `me`, into the first part.
            let (acc, rest) = parts.split_at_mut(c);
            for part in rest.chunks_exact(c.max(1)) {
                for (a, x) in acc.iter_mut().zip(part) {
                    *a += *x;
                }
            }
            let mut gathered = PartitionMut::new(buf, &sizes[..], &offs[..]);
            self.coll.all_gather_varcount_into(&acc[..], &mut gathered);
        });
    }

    #[track_caller]
    fn reduce_scatter_sum(&self, input: &[f32], out: &mut [f32]) {
        let (n, c) = (self.n(), out.len());
        let Some(sig) = self.preamble(Call::ReduceScatter { input, out: &mut *out }) else { return };
        count(input.len(), "reduce_scatter_sum");
        self.exchange(sig);
        self.with_scratch(n * c, |parts| {
            self.coll.all_to_all_into(input, &mut parts[..]);
            out.copy_from_slice(&parts[..c]);
            for part in parts.chunks_exact(c.max(1)).skip(1).take(n - 1) {
                for (a, x) in out.iter_mut().zip(part) {
                    *a += *x;
                }
            }
        });
    }

    #[track_caller]
    fn all_gather(&self, input: &[f32], out: &mut [f32]) {
        let Some(sig) = self.preamble(Call::AllGather { input, out: &mut *out }) else { return };
        count(out.len(), "all_gather");
        self.exchange(sig);
        self.coll.all_gather_into(input, out);
    }

    #[track_caller]
    fn broadcast(&self, buf: &mut [f32], root: usize) {
        let len = buf.len();
        let Some(sig) = self.preamble(Call::Broadcast { len, root }) else { return };
        count(len, "broadcast");
        self.exchange(sig);
        self.coll.process_at_rank(root as i32).broadcast_into(buf);
    }

    #[track_caller]
    fn send(&self, buf: &[f32], to: usize, tag: u32) {
        p2p_preamble(&self.counters, self.n(), to, buf.len(), true);
        let tag = Self::tag(tag);
        self.reap();
        let buf = buf.to_vec();
        let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        unsafe {
            ffi::MPI_Isend(
                buf.as_ptr() as *const c_void,
                count(buf.len(), "send"),
                f32::equivalent_datatype().as_raw(),
                to as c_int,
                tag,
                self.p2p.as_raw(),
                &mut req,
            )
        };
        self.pending.borrow_mut().push(PendingSend { _buf: buf, req });
    }

    #[track_caller]
    fn recv(&self, buf: &mut [f32], from: usize, tag: u32) {
        p2p_preamble(&self.counters, self.n(), from, buf.len(), false);
        let tag_c = Self::tag(tag);
        let site = std::panic::Location::caller();
        let start = Instant::now();
        let mut polls = 0;
        loop {
            self.reap();
            if let Some((msg, status)) = self.p2p.process_at_rank(from as i32).immediate_matched_probe_with_tag(tag_c) {
                let got = status.count(f32::equivalent_datatype()) as usize;
                if got != buf.len() {
                    let mut tmp = vec![0f32; got];
                    msg.matched_receive_into(&mut tmp[..]);
                    panic!(
                        "recv on rank {} of {}: message from rank {from} tag {tag} has {got} elements, buffer has {}",
                        self.rank,
                        self.describe_group(),
                        buf.len()
                    );
                }
                msg.matched_receive_into(buf);
                self.counters.add_wait(start.elapsed());
                return;
            }
            let elapsed = start.elapsed();
            if elapsed >= self.timeout {
                let waiting = match self.p2p.any_process().immediate_probe() {
                    Some(s) => format!("from rank {} tag {}, maybe more", s.source_rank(), s.tag()),
                    None => String::new(),
                };
                panic!(
                    "recv from rank {from} tag {tag} at {site} timed out after {:.1}s on rank {} of {}; messages waiting for this rank: [{waiting}]",
                    elapsed.as_secs_f64(),
                    self.rank,
                    self.describe_group(),
                );
            }
            backoff(&mut polls);
        }
    }

    #[track_caller]
    fn all_to_all(&self, input: &[f32], out: &mut [f32]) {
        let Some(sig) = self.preamble(Call::AllToAll { input, out: &mut *out }) else { return };
        count(input.len(), "all_to_all");
        self.exchange(sig);
        self.coll.all_to_all_into(input, out);
    }

    #[track_caller]
    fn all_to_all_v(&self, input: &[f32], send: &[usize], out: &mut [f32], recv: &[usize]) {
        let Some(sig) = self.preamble(Call::AllToAllV { input, send, out: &mut *out, recv }) else { return };
        count(input.len(), "all_to_all_v");
        count(out.len(), "all_to_all_v");
        self.exchange(sig);
        let displs = |c: &[usize]| -> Vec<c_int> { c.iter().scan(0usize, |a, &x| { let d = *a; *a += x; Some(d as c_int) }).collect() };
        let (sc, rc): (Vec<c_int>, Vec<c_int>) = (send.iter().map(|&x| x as c_int).collect(), recv.iter().map(|&x| x as c_int).collect());
        let (sd, rd) = (displs(send), displs(recv));
        let part = Partition::new(input, &sc[..], &sd[..]);
        let mut recv_part = PartitionMut::new(out, &rc[..], &rd[..]);
        self.coll.all_to_all_varcount_into(&part, &mut recv_part);
    }

    #[track_caller]
    fn barrier(&self) {
        // Every rank has arrived once every rank's signature has.
        if let Some(sig) = self.preamble(Call::Barrier) {
            self.exchange(sig);
        }
    }

    #[track_caller]
    fn split(&self, ranks: &[usize]) -> Box<dyn Comm> {
        let (n, me) = (self.n(), self.rank);
        let split_no = split_preamble(&self.splits, n, me, ranks);
        if n > 1 {
            // Not a numbered collective (as in-process): carries the current number unchanged.
            let sig = Signature { seq: self.seq.get(), op: "split", dtype: "f32", counts: (0, 0, 0), site: std::panic::Location::caller() };
            self.exchange(sig);
            let mut mine = vec![u64::MAX; n];
            for (m, &r) in mine.iter_mut().zip(ranks) {
                *m = r as u64;
            }
            let mut all = vec![0u64; n * n];
            self.coll.all_gather_into(&mine[..], &mut all[..]);
            let list = |k: usize| -> Vec<usize> { all[k * n..(k + 1) * n].iter().take_while(|&&r| r != u64::MAX).map(|&r| r as usize).collect() };
            if let Some(e) = partition_error(&self.describe_group(), n, list) {
                panic!("{e}");
            }
        }
        let color = *ranks.iter().min().unwrap() as c_int;
        let key = ranks.iter().position(|&r| r == me).unwrap() as c_int;
        let sub = self.coll.split_by_color_with_key(Color::with_value(color), key).expect("MPI_Comm_split with a defined color");
        assert_eq!(sub.rank(), key, "MPI_Comm_split ordered the group unexpectedly");
        let world_ranks: Vec<usize> = ranks.iter().map(|&r| self.world_ranks[r]).collect();
        let c = MpiComm::new(&sub, world_ranks, format!("{}.{split_no}", self.id), self.timeout, self.counters.clone(), self._live.clone());
        drop(sub);
        Box::new(c)
    }

    fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }
}
