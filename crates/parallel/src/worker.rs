//! A rank's communication thread: it owns a communicator and runs collectives submitted by
//! the compute thread in submission order, so gradient reduction and ZeRO-3 gathers overlap
//! with backward and forward (PyTorch DDP's and DeepSpeed's side streams, as a thread).
//!
//! A collective that fails (mismatch, timeout, a dead peer) fails the worker: the next
//! [`CommWorker::wait`] on the compute thread panics with the collective's own message, and the
//! communicator is dropped while unwinding, which makes the other ranks' pending collectives
//! abort instead of waiting out their timeout.

use crate::comm::Comm;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = (&'static str, Option<usize>, Box<dyn FnOnce(&dyn Comm) + Send>);

#[derive(Default)]
struct State {
    /// Jobs finished, in order (job `k` is done when `done >= k`).
    done: u64,
    failed: Option<String>,
    /// Total time spent inside jobs.
    busy: Duration,
}

pub struct CommWorker {
    tx: Option<mpsc::Sender<Job>>,
    submitted: u64,
    state: Arc<(Mutex<State>, Condvar)>,
    thread: Option<JoinHandle<()>>,
    rank: usize,
    size: usize,
}

fn panic_text(e: &(dyn std::any::Any + Send)) -> String {
    e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "collective panicked".into())
}

impl CommWorker {
    /// Moves `comm` to a new thread named `comm{rank}`.
    pub fn spawn(comm: Box<dyn Comm>) -> CommWorker {
        let (rank, size) = (comm.rank(), comm.size());
        let (tx, rx) = mpsc::channel::<Job>();
        let state = Arc::new((Mutex::new(State::default()), Condvar::new()));
        let st = state.clone();
        let thread = std::thread::Builder::new()
            .name(format!("comm{rank}"))
            .spawn(move || {
                let comm = comm;
                for (name, unit, job) in rx {
                    let t0 = Instant::now();
                    let r = catch_unwind(AssertUnwindSafe(|| {
                        let _span = match unit {
                            Some(u) => tensor::profile::layer_scope(name, u),
                            None => tensor::profile::scope(name),
                        };
                        job(&*comm)
                    }));
                    let (lock, cv) = &*st;
                    let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
                    s.busy += t0.elapsed();
                    match r {
                        Ok(()) => s.done += 1,
                        Err(e) => {
                            s.failed = Some(panic_text(&*e));
                            drop(s);
                            cv.notify_all();
                            // Unwind with the communicator on the stack: dropping it while
                            // panicking tells the other ranks this one is gone.
                            resume_unwind(e);
                        }
                    }
                    drop(s);
                    cv.notify_all();
                }
            })
            .expect("spawn communication thread");
        CommWorker { tx: Some(tx), submitted: 0, state, thread: Some(thread), rank, size }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Queues `job`, traced as a span `name` (of model unit `unit`, shown as its layer); returns
    /// its ticket for [`CommWorker::wait`].
    pub fn submit(&mut self, name: &'static str, unit: Option<usize>, job: impl FnOnce(&dyn Comm) + Send + 'static) -> u64 {
        self.submitted += 1;
        if self.tx.as_ref().unwrap().send((name, unit, Box::new(job))).is_err() {
            self.wait(self.submitted); // the worker has failed: report why
        }
        self.submitted
    }

    /// Blocks until job `ticket` (and every job before it) is done.
    pub fn wait(&self, ticket: u64) {
        let (lock, cv) = &*self.state;
        let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(f) = &s.failed {
                panic!("{f}");
            }
            if s.done >= ticket {
                return;
            }
            s = cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    pub fn wait_all(&self) {
        self.wait(self.submitted);
    }

    /// Runs `f` on the communication thread and waits for it.
    pub fn run<T: Send + 'static>(&mut self, name: &'static str, f: impl FnOnce(&dyn Comm) -> T + Send + 'static) -> T {
        let slot = Arc::new(Mutex::new(None));
        let out = slot.clone();
        let t = self.submit(name, None, move |c| *out.lock().unwrap() = Some(f(c)));
        self.wait(t);
        let v = slot.lock().unwrap().take();
        v.expect("job ran")
    }

    /// Total time the thread has spent in collectives.
    pub fn busy(&self) -> Duration {
        self.state.0.lock().unwrap_or_else(|e| e.into_inner()).busy
    }
}

impl Drop for CommWorker {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
