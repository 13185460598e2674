//! A fixed pool of worker threads for the optimized CPU backend, started once. A parallel call
//! hands every worker the same job (a closure over task indices); workers and the caller claim
//! tasks from one counter until none are left, and the call returns when every task has run.
//! The caller never waits for a worker that has not claimed a task: when a reader thread (or
//! anything else) has the worker's core, the caller runs the tasks itself instead of spinning
//! until the worker is scheduled again. Between jobs a worker spins for 20 us (during a decode
//! step the next op usually comes within a few), then polls while yielding its core for 300 us
//! (a reader thread copying the next ring slot gets the core instead of a spinning worker: on
//! two cores that spin cost the streamed decode about 13% of its CPU time), then sleeps on a
//! condition variable. On wasm32 (no threads) every job runs inline.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;
use web_time::Instant;

type Job = dyn Fn(usize) + Sync;

/// The posted job: its generation, the closure (lifetime erased) and its task count.
#[derive(Clone, Copy)]
struct Posted {
    generation: u64,
    job: Option<JobPtr>,
    tasks: usize,
}

struct Inner {
    posted: Mutex<Posted>,
    /// Bumped when a job is posted; workers watch it.
    generation: AtomicU64,
    /// The low 32 bits of the current job's generation, then the next unclaimed task index:
    /// a claim succeeds only for the job whose closure the worker read.
    claim: AtomicU64,
    /// Tasks of the current job that have finished.
    done: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Set while the caller waits on something else (a read): workers sleep instead of spinning.
    parked: AtomicBool,
    sleep: Mutex<()>,
    wake: Condvar,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync` and outlives every call through it (the caller returns only
// after every claimed task has finished, and a task is called only after a successful claim).
unsafe impl Send for JobPtr {}

/// The worker pool.
pub struct ThreadPool {
    inner: Arc<Inner>,
    workers: usize,
    caller: Mutex<()>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadPool({} threads)", self.workers + 1)
    }
}

fn tag(generation: u64) -> u64 {
    (generation & 0xffff_ffff) << 32
}

impl Inner {
    /// Claims and runs tasks of the job of `generation` until none are left.
    fn claim_and_run(&self, generation: u64, tasks: usize, job: &(dyn Fn(usize) + Sync + '_)) {
        let tag = tag(generation);
        let mut cur = self.claim.load(Ordering::Acquire);
        loop {
            let i = (cur & 0xffff_ffff) as usize;
            if cur & !0xffff_ffff != tag || i >= tasks {
                return;
            }
            match self.claim.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(i)));
                    if r.is_err() {
                        self.panicked.store(true, Ordering::Release);
                    }
                    self.done.fetch_add(1, Ordering::AcqRel);
                    cur = self.claim.load(Ordering::Acquire);
                }
                Err(now) => cur = now,
            }
        }
    }
}

/// How long a waiting thread spins before it starts yielding its core.
const SPIN: Duration = Duration::from_micros(20);
/// How long an idle worker keeps polling (yielding between polls) before it sleeps.
const YIELD: Duration = Duration::from_micros(300);

/// A wait that spins first, then yields the core between polls, then gives up.
struct Wait {
    start: Option<Instant>,
}

impl Wait {
    fn new() -> Self {
        Wait { start: None }
    }

    /// One poll: spins (up to [`SPIN`] since the first poll) or yields (up to `SPIN +
    /// yield_for`); false once both are over.
    fn poll(&mut self, yield_for: Duration) -> bool {
        let start = *self.start.get_or_insert_with(Instant::now);
        let elapsed = start.elapsed();
        if elapsed < SPIN {
            std::hint::spin_loop();
            true
        } else if elapsed - SPIN < yield_for {
            std::thread::yield_now();
            true
        } else {
            false
        }
    }
}

fn worker(inner: Arc<Inner>) {
    let mut seen = 0u64;
    loop {
        // Wait for the next job: spin (it usually comes within microseconds), then give the
        // core to any other runnable thread (a reader copying the next slot) while polling,
        // then sleep.
        let mut wait = Wait::new();
        let mut g = inner.generation.load(Ordering::Acquire);
        while g == seen && !inner.shutdown.load(Ordering::Acquire) {
            if !inner.parked.load(Ordering::Relaxed) && wait.poll(YIELD) {
                // polled; look again
            } else {
                let guard = inner.sleep.lock().unwrap_or_else(|e| e.into_inner());
                if inner.generation.load(Ordering::Acquire) == seen
                    && !inner.shutdown.load(Ordering::Acquire)
                {
                    drop(inner.wake.wait(guard).unwrap_or_else(|e| e.into_inner()));
                }
            }
            g = inner.generation.load(Ordering::Acquire);
        }
        if inner.shutdown.load(Ordering::Acquire) {
            return;
        }
        let posted = *inner.posted.lock().unwrap_or_else(|e| e.into_inner());
        seen = g.max(posted.generation);
        if let Some(JobPtr(p)) = posted.job {
            // SAFETY: a task is called only after a claim for this very job succeeded, and the
            // caller keeps the closure alive until every claimed task has finished.
            let f: &Job = unsafe { &*p };
            inner.claim_and_run(posted.generation, posted.tasks, f);
        }
    }
}

impl ThreadPool {
    /// A pool of `threads` threads in all (the caller counts as one).
    pub fn new(threads: usize) -> Self {
        let inner = Arc::new(Inner {
            posted: Mutex::new(Posted {
                generation: 0,
                job: None,
                tasks: 0,
            }),
            generation: AtomicU64::new(0),
            claim: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut workers = 0;
        if cfg!(not(target_arch = "wasm32")) {
            for i in 1..threads.max(1) {
                let inner = inner.clone();
                let ok = std::thread::Builder::new()
                    .name(format!("nibble-cpu-{i}"))
                    .spawn(move || worker(inner))
                    .is_ok();
                if ok {
                    workers += 1;
                }
            }
        }
        ThreadPool {
            inner,
            workers,
            caller: Mutex::new(()),
        }
    }

    /// The pool every CPU backend shares: one thread per core (`NIBBLE_THREADS` overrides).
    pub fn global() -> &'static ThreadPool {
        static POOL: OnceLock<ThreadPool> = OnceLock::new();
        POOL.get_or_init(|| {
            let n = std::env::var("NIBBLE_THREADS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| {
                    std::thread::available_parallelism()
                        .map(|n| n.get())
                        .unwrap_or(1)
                });
            ThreadPool::new(n)
        })
    }

    /// Threads that work on a job (workers plus the caller).
    pub fn threads(&self) -> usize {
        self.workers + 1
    }

    /// The caller is about to wait for something other than this pool (a read, a device): idle
    /// workers stop spinning and sleep until the next job, leaving the cores to whoever works.
    pub fn park(&self) {
        self.inner.parked.store(true, Ordering::Relaxed);
    }

    /// Runs `f(0) .. f(tasks - 1)` across the pool and returns when all have run.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if self.workers == 0 || tasks == 1 {
            (0..tasks).for_each(f);
            return;
        }
        let _one_at_a_time = self.caller.lock().unwrap_or_else(|e| e.into_inner());
        let inner = &self.inner;
        inner.parked.store(false, Ordering::Relaxed);
        // SAFETY: only the lifetime is erased; this call returns only after every task has
        // finished, and workers call the closure only for tasks they claimed.
        let erased: *const Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(f) };
        let generation = inner.generation.load(Ordering::Acquire) + 1;
        *inner.posted.lock().unwrap_or_else(|e| e.into_inner()) = Posted {
            generation,
            job: Some(JobPtr(erased)),
            tasks,
        };
        inner.done.store(0, Ordering::Release);
        inner.claim.store(tag(generation), Ordering::Release);
        {
            let _g = inner.sleep.lock().unwrap_or_else(|e| e.into_inner());
            inner.generation.store(generation, Ordering::Release);
            inner.wake.notify_all();
        }
        inner.claim_and_run(generation, tasks, f);
        // Every task is claimed; wait for those that workers are still running (when one of
        // them lost its core to another thread, yielding lets it, or that thread, run here).
        let mut wait = Wait::new();
        while inner.done.load(Ordering::Acquire) != tasks {
            wait.poll(Duration::MAX);
        }
        inner.posted.lock().unwrap_or_else(|e| e.into_inner()).job = None;
        if inner.panicked.swap(false, Ordering::AcqRel) {
            panic!("a CPU kernel task panicked");
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::Release);
        let _g = self.inner.sleep.lock().unwrap_or_else(|e| e.into_inner());
        self.inner.wake.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_across_many_jobs() {
        let pool = ThreadPool::new(3);
        for round in 0..200usize {
            let n = 1 + round % 17;
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "round {round}"
            );
        }
    }
}
