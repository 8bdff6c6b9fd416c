//! Opt-in per-kernel timing for `kiln bench --breakdown`. Each kernel opens a [`scope`]; when
//! profiling is off (the default) a scope costs one relaxed atomic load.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

static ENABLED: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<Vec<(&'static str, f64, u64)>> = Mutex::new(Vec::new());

pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

pub struct Scope {
    name: &'static str,
    start: Option<Instant>,
}

/// Times the enclosing block under `name` (kernels are called from one thread at a time, so
/// nested parallel work is inside the scope, not counted twice).
#[inline]
pub fn scope(name: &'static str) -> Scope {
    Scope { name, start: ENABLED.load(Ordering::Relaxed).then(Instant::now) }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if let Some(s) = self.start {
            let dt = s.elapsed().as_secs_f64();
            let mut t = TOTALS.lock().unwrap();
            match t.iter_mut().find(|e| e.0 == self.name) {
                Some(e) => {
                    e.1 += dt;
                    e.2 += 1;
                }
                None => t.push((self.name, dt, 1)),
            }
        }
    }
}

/// Accumulated (name, seconds, calls) since the last reset, largest first.
pub fn take() -> Vec<(&'static str, f64, u64)> {
    let mut t = std::mem::take(&mut *TOTALS.lock().unwrap());
    t.sort_by(|a, b| b.1.total_cmp(&a.1));
    t
}
