//! A counting global allocator: the bytes live now and at their peak, in total and per category
//! (`params`, `grads`, `optimizer`, `activations`, `other`), for `metrics.jsonl`.
//!
//! Cost: a large allocation or free is two relaxed atomic additions (its category and the
//! total) plus a relaxed load of each peak (a `fetch_max` only when a peak rises); a small one
//! adds to a per-thread count that reaches the shared counters only when it has moved by
//! [`SMALL_FLUSH`] bytes (code that allocates small objects on every thread, as a tokenizer
//! does, would otherwise bounce the counters' cache line between cores on every call). So
//! `other` and the total are exact to within `SMALL_FLUSH` per thread. No locks. kiln's kernels take their scratch from per-thread pools
//! and its activation buffers are sized once per `(B, T)`, so a training step makes few
//! allocations and the counting is far below the noise of a step time.
//!
//! Categories: a large allocation (at least [`LARGE`] bytes) gets a 16-byte header that names
//! its category, so its free (or growth) is charged to the same category wherever it happens.
//! The category is the allocating thread's current [`scope`] (default `other`); buffers whose
//! owner is known after the fact are moved to their category with [`retag_vec`] (the trainer
//! does so for the parameters, gradients and moments once the data-parallel store holds them).
//! Small allocations are always `other`: they carry no header, and their sum is small.
//!
//! Peaks are reset with [`reset_peaks`] (the trainer does so once, just before step 0, at the
//! same moment as the resident-set peak): the figures a train line reports are the peaks over
//! the run so far, not per step.
//!
//! The allocator counts only when it is installed as the `#[global_allocator]` (the `kiln`
//! binary does); otherwise [`active`] is false and every function here is a no-op.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering::Relaxed};

/// What a buffer holds, as far as the tracker can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Category {
    Params = 0,
    Grads = 1,
    Optimizer = 2,
    Activations = 3,
    Other = 4,
}

pub const CATEGORIES: [Category; 5] = [Category::Params, Category::Grads, Category::Optimizer, Category::Activations, Category::Other];

impl Category {
    /// The name in `mem_tracked_peak_<name>_bytes`.
    pub fn name(self) -> &'static str {
        match self {
            Category::Params => "params",
            Category::Grads => "grads",
            Category::Optimizer => "optimizer",
            Category::Activations => "activations",
            Category::Other => "other",
        }
    }

    fn from_u8(x: u8) -> Category {
        CATEGORIES.get(x as usize).copied().unwrap_or(Category::Other)
    }
}

/// Allocations of at least this many bytes carry a category header.
pub const LARGE: usize = 64 << 10;
/// Header bytes in front of a large allocation's payload: `[MAGIC ^ size, category]`.
const HEADER: usize = 16;
/// Tells a header written here from anything else (and a wrong size from the right one).
const MAGIC: u64 = 0x6b69_6c6e_6d65_6d00;

static ACTIVE: AtomicBool = AtomicBool::new(false);
/// Live bytes, signed: a thread's batched small frees may reach the counters before another
/// thread's batched allocations of the same bytes.
static CURRENT: [AtomicIsize; 5] = [const { AtomicIsize::new(0) }; 5];
static PEAK: [AtomicUsize; 5] = [const { AtomicUsize::new(0) }; 5];
static TOTAL: AtomicIsize = AtomicIsize::new(0);
static TOTAL_PEAK: AtomicUsize = AtomicUsize::new(0);

/// Bytes of small allocations a thread counts on its own before adding them to the totals.
pub const SMALL_FLUSH: isize = 256 << 10;

thread_local! {
    static SCOPE: Cell<u8> = const { Cell::new(Category::Other as u8) };
    static SMALL: Cell<isize> = const { Cell::new(0) };
}

/// The counting allocator over the system allocator.
pub struct Tracking;

/// Whether the counting allocator is the global allocator of this process.
pub fn active() -> bool {
    ACTIVE.load(Relaxed)
}

fn raise(peak: &AtomicUsize, now: usize) {
    if now > peak.load(Relaxed) {
        peak.fetch_max(now, Relaxed);
    }
}

fn add_signed(cat: Category, bytes: isize) {
    let i = cat as usize;
    raise(&PEAK[i], (CURRENT[i].fetch_add(bytes, Relaxed) + bytes).max(0) as usize);
    raise(&TOTAL_PEAK, (TOTAL.fetch_add(bytes, Relaxed) + bytes).max(0) as usize);
}

fn add(cat: Category, bytes: usize) {
    add_signed(cat, bytes as isize);
}

fn sub(cat: Category, bytes: usize) {
    CURRENT[cat as usize].fetch_sub(bytes as isize, Relaxed);
    TOTAL.fetch_sub(bytes as isize, Relaxed);
}

/// A small allocation's (or free's, negative) bytes: counted per thread, added to `other` and
/// the total once they have moved by [`SMALL_FLUSH`] (directly while the thread is exiting).
fn small(delta: isize) {
    let flush = SMALL.try_with(|c| {
        let v = c.get() + delta;
        if v.abs() >= SMALL_FLUSH {
            c.set(0);
            v
        } else {
            c.set(v);
            0
        }
    });
    match flush {
        Ok(0) => {}
        Ok(v) => add_signed(Category::Other, v),
        Err(_) => add_signed(Category::Other, delta),
    }
}

fn current_scope() -> Category {
    Category::from_u8(SCOPE.try_with(|c| c.get()).unwrap_or(Category::Other as u8))
}

/// Offset of the payload in a large allocation: room for the header, keeping the alignment.
fn offset(align: usize) -> usize {
    HEADER.max(align)
}

/// The layout of a large allocation with its header.
fn big(l: Layout) -> Layout {
    // SAFETY: the alignment is a power of two (at least 16) and the size only grows by the
    // header offset, which is a multiple of it.
    unsafe { Layout::from_size_align_unchecked(l.size() + offset(l.align()), l.align().max(HEADER)) }
}

/// # Safety
/// `payload` is the start of a large allocation made here.
unsafe fn header(payload: *mut u8) -> *mut [u64; 2] {
    payload.sub(HEADER) as *mut [u64; 2]
}

impl Tracking {
    unsafe fn alloc_with(&self, l: Layout, zeroed: bool) -> *mut u8 {
        if !ACTIVE.load(Relaxed) {
            ACTIVE.store(true, Relaxed);
        }
        if l.size() < LARGE {
            let p = if zeroed { System.alloc_zeroed(l) } else { System.alloc(l) };
            if !p.is_null() {
                small(l.size() as isize);
            }
            return p;
        }
        let b = big(l);
        let base = if zeroed { System.alloc_zeroed(b) } else { System.alloc(b) };
        if base.is_null() {
            out_of_memory(l.size());
        }
        let p = base.add(offset(l.align()));
        let cat = current_scope();
        header(p).write([MAGIC ^ l.size() as u64, cat as u64]);
        add(cat, l.size());
        p
    }
}

/// The run directory a refused allocation cleans up after: its path, its lock file's, the note
/// it leaves there, and whether this process made the directory. Paths made ahead of time, so
/// the handler needs no allocation.
struct RunDir {
    dir: std::ffi::CString,
    lock: std::ffi::CString,
    note: std::ffi::CString,
    created: bool,
}

static RUN_DIR: std::sync::OnceLock<RunDir> = std::sync::OnceLock::new();

/// Names the run directory this process trains in (`lock`: its lock file; `created`: this
/// process made it): if an allocation is then refused, a directory the run made and left
/// holding only its lock is removed, and any other is left a note ([`OOM_NOTE`]) saying what
/// happened.
pub fn note_run_dir(dir: &std::path::Path, lock: &std::path::Path, created: bool) {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &std::path::Path| std::ffi::CString::new(p.as_os_str().as_bytes()).ok();
    if let (Some(dir), Some(lock), Some(note)) = (c(dir), c(lock), c(&dir.join(OOM_NOTE))) {
        let _ = RUN_DIR.set(RunDir { dir, lock, note, created });
    }
}

/// The file a run stopped by a refused allocation leaves in its directory: the error line.
pub const OOM_NOTE: &str = "out_of_memory.txt";

/// A large allocation the system refused (kiln never asks fallibly): one line on stderr and
/// exit code 1, instead of std's abort; the run directory cleaned up or noted
/// ([`note_run_dir`]). Writes with `write(2)` from a stack buffer: nothing here may allocate.
#[cold]
fn out_of_memory(size: usize) -> ! {
    let mut buf = [0u8; 160];
    let mut n = 0;
    let mut put = |b: &[u8]| {
        let k = b.len().min(buf.len() - n);
        buf[n..n + k].copy_from_slice(&b[..k]);
        n += k;
    };
    put(b"kiln: out of memory: the system refused ");
    let mut digits = [0u8; 20];
    let (mut i, mut v) = (digits.len(), size);
    loop {
        i -= 1;
        digits[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    put(&digits[i..]);
    put(b" bytes (set memory.limit, or lower the batch or the model)\n");
    // SAFETY: writes initialised bytes to stderr (and the run directory's note: NUL-terminated
    // paths made before), then ends the process without unwinding.
    unsafe {
        libc::write(2, buf.as_ptr().cast(), n);
        if let Some(r) = RUN_DIR.get() {
            let gone = r.created && libc::unlink(r.lock.as_ptr()) == 0 && libc::rmdir(r.dir.as_ptr()) == 0;
            if !gone {
                let fd = libc::open(r.note.as_ptr(), libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC, 0o644);
                if fd >= 0 {
                    libc::write(fd, buf.as_ptr().cast(), n);
                    libc::close(fd);
                }
            }
        }
        libc::_exit(1)
    }
}

unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        self.alloc_with(l, false)
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        self.alloc_with(l, true)
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if l.size() < LARGE {
            small(-(l.size() as isize));
            return System.dealloc(p, l);
        }
        let [magic, cat] = header(p).read();
        debug_assert_eq!(magic, MAGIC ^ l.size() as u64, "tracked allocation header overwritten");
        sub(Category::from_u8(cat as u8), l.size());
        System.dealloc(p.sub(offset(l.align())), big(l));
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        let (was_large, large) = (l.size() >= LARGE, new_size >= LARGE);
        if !was_large && !large {
            let q = System.realloc(p, l, new_size);
            if !q.is_null() {
                small(new_size as isize - l.size() as isize);
            }
            return q;
        }
        if was_large && large {
            let off = offset(l.align());
            let [_, cat] = header(p).read();
            let base = System.realloc(p.sub(off), big(l), new_size + off);
            if base.is_null() {
                out_of_memory(new_size);
            }
            let q = base.add(off);
            header(q).write([MAGIC ^ new_size as u64, cat]);
            let cat = Category::from_u8(cat as u8);
            add(cat, new_size);
            sub(cat, l.size());
            return q;
        }
        // Crossing the header threshold: a fresh allocation and a copy.
        let nl = Layout::from_size_align_unchecked(new_size, l.align());
        let q = self.alloc(nl);
        if !q.is_null() {
            std::ptr::copy_nonoverlapping(p, q, l.size().min(new_size));
            self.dealloc(p, l);
        }
        q
    }
}

/// Runs `f` with `cat` as this thread's category for large allocations.
pub fn scope<R>(cat: Category, f: impl FnOnce() -> R) -> R {
    let old = SCOPE.with(|c| c.replace(cat as u8));
    let r = f();
    SCOPE.with(|c| c.set(old));
    r
}

/// Charges the allocation holding `v` to `cat` from now on (its bytes move from the category it
/// was allocated under). No-op for a small allocation or without the counting allocator.
pub fn retag_vec<T>(v: &Vec<T>, cat: Category) {
    // SAFETY: a Vec's pointer and capacity are those of its allocation by the global allocator.
    unsafe { retag_raw(v.as_ptr() as *const u8, v.capacity() * std::mem::size_of::<T>(), cat) }
}

/// [`retag_vec`] for an allocation known by its start and size in bytes.
///
/// # Safety
/// `ptr` is the start of a live allocation of `size` bytes made by the global allocator.
pub unsafe fn retag_raw(ptr: *const u8, size: usize, cat: Category) {
    if !active() || size < LARGE || ptr.is_null() {
        return;
    }
    let h = header(ptr as *mut u8);
    let [magic, old] = h.read();
    if magic != MAGIC ^ size as u64 {
        return;
    }
    let old = Category::from_u8(old as u8);
    if old != cat {
        add(cat, size);
        sub(old, size);
        h.write([magic, cat as u64]);
    }
}

/// Bytes live now: the total and each category (in [`CATEGORIES`] order).
pub fn current() -> (usize, [usize; 5]) {
    (TOTAL.load(Relaxed).max(0) as usize, std::array::from_fn(|i| CURRENT[i].load(Relaxed).max(0) as usize))
}

/// The peaks since the last [`reset_peaks`]: the total's, and each category's own (reached at
/// different moments, so they do not add up to the total's).
pub fn peaks() -> (usize, [usize; 5]) {
    (TOTAL_PEAK.load(Relaxed), std::array::from_fn(|i| PEAK[i].load(Relaxed)))
}

/// Restarts the peaks from the bytes live now.
pub fn reset_peaks() {
    TOTAL_PEAK.store(TOTAL.load(Relaxed).max(0) as usize, Relaxed);
    for i in 0..CATEGORIES.len() {
        PEAK[i].store(CURRENT[i].load(Relaxed).max(0) as usize, Relaxed);
    }
}

/// Adds `mem_tracked_peak_bytes` and `mem_tracked_peak_<category>_bytes` to a metrics line
/// (nothing without the counting allocator).
pub fn log_peaks(line: &mut serde_json::Value) {
    if !active() {
        return;
    }
    let (total, cats) = peaks();
    line["mem_tracked_peak_bytes"] = total.into();
    for (c, b) in CATEGORIES.iter().zip(cats) {
        line[format!("mem_tracked_peak_{}_bytes", c.name())] = b.into();
    }
}
