//! A fixed pool of worker threads for the optimized CPU backend, started once. A parallel call
//! hands every worker the same job (a closure over task indices); workers and the caller claim
//! tasks from one counter until none are left, and the call returns when every worker is done
//! with the job. Workers spin briefly between jobs (an op every few microseconds during a decode
//! step), then sleep on a condition variable. On wasm32 (no threads) every job runs inline.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

type Job = dyn Fn(usize) + Sync;

struct Inner {
    /// The job of the current generation (lifetime erased; valid while `pending > 0`).
    job: Mutex<Option<JobPtr>>,
    generation: AtomicU64,
    next: AtomicUsize,
    tasks: AtomicUsize,
    pending: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Set while the caller waits on something else (a read): workers sleep instead of spinning.
    parked: AtomicBool,
    sleep: Mutex<()>,
    wake: Condvar,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync` and outlives every use (the caller waits for all workers).
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

impl Inner {
    fn claim_and_run(&self, job: &(dyn Fn(usize) + Sync + '_)) {
        let n = self.tasks.load(Ordering::Acquire);
        loop {
            let i = self.next.fetch_add(1, Ordering::AcqRel);
            if i >= n {
                break;
            }
            job(i);
        }
    }
}

fn worker(inner: Arc<Inner>) {
    let mut seen = 0u64;
    loop {
        // Spin for a while (the next op usually comes within microseconds), then sleep.
        let mut spins = 0u32;
        let mut g = inner.generation.load(Ordering::Acquire);
        while g == seen && !inner.shutdown.load(Ordering::Acquire) {
            spins += 1;
            if spins < 20_000 && !inner.parked.load(Ordering::Relaxed) {
                std::hint::spin_loop();
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
        seen = g;
        let job = *inner.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(p)) = job {
            // SAFETY: the caller keeps the closure alive until `pending` reaches zero.
            let f: &Job = unsafe { &*p };
            let r =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.claim_and_run(f)));
            if r.is_err() {
                inner.panicked.store(true, Ordering::Release);
            }
        }
        inner.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ThreadPool {
    /// A pool of `threads` threads in all (the caller counts as one).
    pub fn new(threads: usize) -> Self {
        let inner = Arc::new(Inner {
            job: Mutex::new(None),
            generation: AtomicU64::new(0),
            next: AtomicUsize::new(0),
            tasks: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
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
        // SAFETY: only the lifetime is erased; this call waits below until every worker has
        // finished with the job, so the reference never outlives `f`.
        let erased: *const Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(f) };
        *inner.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(erased));
        inner.next.store(0, Ordering::Release);
        inner.tasks.store(tasks, Ordering::Release);
        inner.pending.store(self.workers, Ordering::Release);
        {
            let _g = inner.sleep.lock().unwrap_or_else(|e| e.into_inner());
            inner.generation.fetch_add(1, Ordering::AcqRel);
            inner.wake.notify_all();
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.claim_and_run(f)));
        let mut spins = 0u32;
        while inner.pending.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < 1_000_000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        *inner.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if r.is_err() || inner.panicked.swap(false, Ordering::AcqRel) {
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
