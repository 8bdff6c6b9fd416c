//! Opt-in timing. Two consumers:
//! - `kiln bench --breakdown`: per-kernel totals ([`enable`], [`take`]);
//! - `kiln train --profile N`: a timeline of spans per thread for a Chrome trace-event file
//!   ([`trace`], [`take_trace`]).
//!
//! Each kernel (and the trainer's phases) opens a [`scope`]; with both consumers off a scope
//! costs two relaxed atomic loads.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

static ENABLED: AtomicBool = AtomicBool::new(false);
static TRACING: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<Vec<(&'static str, f64, u64)>> = Mutex::new(Vec::new());
static EVENTS: Mutex<Vec<Span>> = Mutex::new(Vec::new());
static NEXT_TID: AtomicU64 = AtomicU64::new(0);
/// The name of each thread that recorded a span (`tid`, name).
static NAMES: Mutex<Vec<(u64, String)>> = Mutex::new(Vec::new());

thread_local! {
    static TID: u64 = {
        let t = NEXT_TID.fetch_add(1, Ordering::Relaxed);
        let name = std::thread::current().name().unwrap_or("").to_string();
        NAMES.lock().unwrap().push((t, name));
        t
    };
}

/// The names of the threads that recorded spans, by `tid` (empty for unnamed threads; rank
/// threads are `rank{r}`, their communication threads `comm{r}`, rayon's `rayon{i}`).
pub fn thread_names() -> Vec<(u64, String)> {
    NAMES.lock().unwrap().clone()
}

fn epoch() -> Instant {
    static E: OnceLock<Instant> = OnceLock::new();
    *E.get_or_init(Instant::now)
}

/// One finished span of the trace.
#[derive(Clone, Debug)]
pub struct Span {
    pub name: &'static str,
    /// The layer the span belongs to, when it does.
    pub layer: Option<usize>,
    /// Microseconds since the process's trace epoch.
    pub start_us: f64,
    pub dur_us: f64,
    /// A small per-thread number (0 for the first thread that recorded anything).
    pub tid: u64,
}

pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Starts or stops recording the trace timeline.
pub fn trace(on: bool) {
    epoch();
    TRACING.store(on, Ordering::Relaxed);
}

pub struct Scope {
    name: &'static str,
    layer: Option<usize>,
    start: Option<Instant>,
}

/// Times the enclosing block under `name`.
#[inline]
pub fn scope(name: &'static str) -> Scope {
    scope_in(name, None)
}

/// Times the enclosing block under `name` for layer `layer`.
#[inline]
pub fn layer_scope(name: &'static str, layer: usize) -> Scope {
    scope_in(name, Some(layer))
}

#[inline]
fn scope_in(name: &'static str, layer: Option<usize>) -> Scope {
    let on = ENABLED.load(Ordering::Relaxed) || TRACING.load(Ordering::Relaxed);
    Scope { name, layer, start: on.then(Instant::now) }
}

impl Drop for Scope {
    fn drop(&mut self) {
        let Some(s) = self.start else { return };
        let dt = s.elapsed().as_secs_f64();
        if ENABLED.load(Ordering::Relaxed) && self.layer.is_none() {
            let mut t = TOTALS.lock().unwrap();
            match t.iter_mut().find(|e| e.0 == self.name) {
                Some(e) => {
                    e.1 += dt;
                    e.2 += 1;
                }
                None => t.push((self.name, dt, 1)),
            }
        }
        if TRACING.load(Ordering::Relaxed) {
            let start_us = s.duration_since(epoch()).as_secs_f64() * 1e6;
            let tid = TID.with(|t| *t);
            EVENTS.lock().unwrap().push(Span { name: self.name, layer: self.layer, start_us, dur_us: dt * 1e6, tid });
        }
    }
}

/// Accumulated (name, seconds, calls) since the last call, largest first.
pub fn take() -> Vec<(&'static str, f64, u64)> {
    let mut t = std::mem::take(&mut *TOTALS.lock().unwrap());
    t.sort_by(|a, b| b.1.total_cmp(&a.1));
    t
}

/// The spans recorded since the last call, in completion order.
pub fn take_trace() -> Vec<Span> {
    std::mem::take(&mut *EVENTS.lock().unwrap())
}
