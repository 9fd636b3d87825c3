//! The engine's batch pool: the threads a batch that spreads over rayon runs on, and the one kind
//! of thread a holder of a stream lock may wait for.
//!
//! # Why the engine has a pool of its own
//!
//! burn-ndarray runs its matmuls, convolutions and pooling through rayon. A stream executes its
//! queue under its lock, so an operation that waits for rayon's workers waits for them under the
//! lock. If those workers are themselves waiting for the lock (user jobs that clone, compute with
//! or read the stream's tensors, which is how a pool evaluates or serves a model), nobody moves:
//! the operation waits for a worker, every worker for the lock. And a wait inside rayon (a
//! `join`, a `scope`, an `install` from another pool's worker) runs other jobs of the pool on the
//! waiting thread meanwhile: a user job could then run *inside* the drain, on the thread that
//! holds the lock, where it could neither take that lock nor wait for the tensor the drain is
//! producing below it on the same stack.
//!
//! So a batch holding such an operation runs, whole, on this pool, and the draining thread waits
//! for it asleep, running nothing else ([`run`]):
//!
//! 1. **Its threads never take a stream lock.** A batch runs inside the engine
//!    ([`super::cell::InEngine`]): an operation that calls back is refused, and a drop or a clone
//!    there is posted to the stream's inbox, which only ever *tries* the lock.
//! 2. **Its threads never run a user job.** Only batches are spawned here; what they spawn (the
//!    backend's own `join`s and parallel iterators) stays here. A batch may run nested inside
//!    another batch's `join` on one of these threads: each sets and restores its own thread-local
//!    state (the executing stream, the in-engine count, the lent blocks).
//! 3. **The draining thread does not steal.** It sleeps on a latch; it is never a worker of this
//!    pool (a batch never drains a stream), and whatever pool it may belong to runs no job on it
//!    while it waits (from outside any pool the batch goes in with `install`, whose wait runs
//!    nothing; from a worker of another pool, where `install` would, it is spawned).
//!
//! A thread that waits here under a stream lock therefore waits for threads that wait for no lock
//! and no other thread: no cycle can close through this wait (docs/ARCHITECTURE.md, "Locks and
//! waits").
//!
//! # Size
//!
//! rayon's defaults: `RAYON_NUM_THREADS` if set, else one thread per hardware thread. The pool
//! is made on first use, and its threads live as long as the process, as rayon's global pool's
//! do. It is separate from the global pool, so a program that sizes rayon's global pool (with
//! `ThreadPoolBuilder::build_global`) is not affected by the engine having started first.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex};

/// The pool, made on first use.
fn pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("fusion-streams-batch-{i}"))
            .build()
            .expect("starting the engine's batch pool")
    })
}

/// Whether the current thread is one of the batch pool's.
pub(crate) fn on_pool_thread() -> bool {
    pool().current_thread_index().is_some()
}

/// How a batch ended, handed from the pool's thread to the waiting one.
#[derive(Default)]
struct Latch {
    done: Mutex<Option<std::thread::Result<()>>>,
    set: Condvar,
}

/// A pointer to the batch, sent to the pool's thread.
struct Batch(*mut (dyn FnMut() + Send + 'static));

// SAFETY: the closure behind the pointer is `Send`, and only the pool's job uses it, while
// `run` waits (see there).
unsafe impl Send for Batch {}

/// Run `batch` once on the batch pool, and return once it has returned, with what
/// [`catch_unwind`] around it returned. The calling thread sleeps meanwhile, running nothing else.
pub(crate) fn run(batch: &mut (dyn FnMut() + Send)) -> std::thread::Result<()> {
    if on_pool_thread() {
        // Not reached (a batch never drains a stream); in place, it is still on the pool.
        return catch_unwind(AssertUnwindSafe(batch));
    }
    if rayon::current_thread_index().is_none() {
        // Not a worker of any pool: `install` blocks this thread on a latch of its own, running
        // no job meanwhile, and needs no allocation (the job lives on this stack).
        return pool().install(|| catch_unwind(AssertUnwindSafe(batch)));
    }
    // A worker of another pool (rayon's global one, or the program's own), where `install` would
    // run that pool's jobs on this thread while it waits: the batch is spawned, and this thread
    // parks on a latch.
    let pointer: *mut (dyn FnMut() + Send + '_) = batch;
    // SAFETY: only the lifetime is erased (same layout). The job below is the pointer's one
    // user, and this function does not return before the job has stopped using it: it waits
    // for the latch, which the job sets after its last use of the batch.
    let job = Batch(unsafe {
        std::mem::transmute::<*mut (dyn FnMut() + Send + '_), *mut (dyn FnMut() + Send + 'static)>(
            pointer,
        )
    });
    let latch = Arc::new(Latch::default());
    let set = latch.clone();
    pool().spawn(move || {
        let job = job;
        // SAFETY: `run` is waiting (see above), so the batch is alive and used by no one else.
        let outcome = catch_unwind(AssertUnwindSafe(|| unsafe { (*job.0)() }));
        // Set last: once the waiting thread sees it, it returns, and the batch is gone.
        *set.done.lock() = Some(outcome);
        set.set.notify_one();
    });
    let mut done = latch.done.lock();
    loop {
        if let Some(outcome) = done.take() {
            return outcome;
        }
        latch.set.wait(&mut done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Under miri these two stop inside rayon: Stacked Borrows rejects crossbeam-epoch's intrusive
    // list, which rayon's work-stealing deques use (a dependency's pattern, not this crate's
    // code). The host runtime, which the miri run covers, runs every batch in place.
    #[test]
    #[cfg_attr(miri, ignore = "rayon's deques (crossbeam-epoch) fail Stacked Borrows")]
    fn a_batch_runs_once_on_the_pool_and_the_caller_waits_for_it() {
        let caller = std::thread::current().id();
        let mut seen = Vec::new();
        run(&mut || seen.push((std::thread::current().id(), on_pool_thread()))).unwrap();
        assert_eq!(seen.len(), 1);
        assert_ne!(seen[0].0, caller);
        assert!(seen[0].1, "not on the batch pool");
        assert!(!on_pool_thread());
    }

    #[test]
    #[cfg_attr(miri, ignore = "rayon's deques (crossbeam-epoch) fail Stacked Borrows")]
    fn a_panic_in_the_batch_reaches_the_caller() {
        let payload = run(&mut || panic!("in the batch")).expect_err("the panic");
        assert_eq!(*payload.downcast::<&str>().unwrap(), "in the batch");
        // The pool survives it.
        let mut ran = false;
        run(&mut || ran = true).unwrap();
        assert!(ran);
    }
}
