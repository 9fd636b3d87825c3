//! Per-thread helpers: a cache of the current stream, and the drain that runs when a thread exits.
//!
//! # Current-stream cache
//!
//! Registering an operation needs the state of the current stream. Looking it up in the engine's
//! map takes a shared read lock whose counter every registering thread would bump, so each thread
//! remembers the last stream it used (a `Weak`, so a cache entry never keeps an engine's state
//! alive after the engine is gone).
//!
//! # Exit drain
//!
//! A thread may leave work queued on its stream and exit. Nothing would ever run that work, and
//! frees deferred behind it would never happen. Each thread therefore remembers the streams it used
//! and, when it exits, has them drained ([`ThreadExitHook`]); a stream left empty is retired from
//! its engine.
//!
//! The exiting thread does not run that work itself: it is in the middle of destroying its
//! thread-locals, and a runtime may need its own (cubecl's are gone by then: running a queued
//! matmul there panicked on the H200). It hands each stream to the process's exit-drain thread,
//! started with the first engine, and waits until that thread has drained it — so a `join` on the
//! exiting thread still returns only after its work ran. The hand-off uses parking_lot's mutex and
//! condition variable, which fall back to stack-allocated thread data when the waiting thread's
//! thread-locals are already destroyed.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, OnceLock, Weak};

use burn_backend::StreamId;
use parking_lot::{Condvar, Mutex};

/// Something to run when a thread that used `stream` exits.
pub(crate) trait ThreadExitHook: Send + Sync {
    fn on_thread_exit(&self, stream: StreamId);
}

struct Cached {
    engine: u64,
    stream: u64,
    cell: Weak<dyn Any + Send + Sync>,
}

/// (engine key, the engine, a stream this thread used on it).
type ExitHook = (u64, Weak<dyn ThreadExitHook>, StreamId);

struct ExitHooks(RefCell<Vec<ExitHook>>);

impl Drop for ExitHooks {
    fn drop(&mut self) {
        EXITING.with(|exiting| exiting.set(true));
        let Some(drainer) = DRAINER.get() else {
            return;
        };
        for (_, hook, stream) in self.0.get_mut().drain(..) {
            let done = Arc::new(Latch::default());
            drainer.push((hook, stream, done.clone()));
            done.wait();
        }
    }
}

/// A one-shot signal.
#[derive(Default)]
struct Latch {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Latch {
    fn open(&self) {
        *self.open.lock() = true;
        self.opened.notify_all();
    }

    fn wait(&self) {
        let mut open = self.open.lock();
        while !*open {
            self.opened.wait(&mut open);
        }
    }
}

type ExitJob = (Weak<dyn ThreadExitHook>, StreamId, Arc<Latch>);

/// The exit-drain thread's work queue.
struct Drainer {
    jobs: Mutex<VecDeque<ExitJob>>,
    pending: Condvar,
}

impl Drainer {
    fn push(&self, job: ExitJob) {
        self.jobs.lock().push_back(job);
        self.pending.notify_one();
    }

    fn run(&self) {
        loop {
            let (hook, stream, done) = {
                let mut jobs = self.jobs.lock();
                loop {
                    if let Some(job) = jobs.pop_front() {
                        break job;
                    }
                    self.pending.wait(&mut jobs);
                }
            };
            if let Some(hook) = hook.upgrade() {
                // Contained: a failing drain must not take the drain thread (or the waiting
                // thread) down with it; the work's errors are recorded on its tensors anyway.
                let _ = catch_unwind(AssertUnwindSafe(|| hook.on_thread_exit(stream)));
            }
            done.open();
        }
    }
}

static DRAINER: OnceLock<&'static Drainer> = OnceLock::new();

/// Start the process's exit-drain thread (once; called when an engine is created, in an
/// ordinary context where spawning a thread is safe).
pub(crate) fn start_exit_drainer() {
    DRAINER.get_or_init(|| {
        let drainer: &'static Drainer = Box::leak(Box::new(Drainer {
            jobs: Mutex::new(VecDeque::new()),
            pending: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("fusion-streams-exit-drain".into())
            .spawn(move || drainer.run())
            .expect("spawning the fusion-streams exit-drain thread");
        drainer
    });
}

/// Whether this thread has started exiting (its exit hooks are running): it must not execute
/// operations any more.
pub(crate) fn exiting() -> bool {
    EXITING.with(Cell::get)
}

std::thread_local! {
    static CURRENT: RefCell<Option<Cached>> = const { RefCell::new(None) };
    static EXIT_HOOKS: ExitHooks = const { ExitHooks(RefCell::new(Vec::new())) };
    /// A `Cell<bool>` with a const initialiser: no destructor, readable during thread exit.
    static EXITING: Cell<bool> = const { Cell::new(false) };
}

/// The cached cell of `stream` in engine `engine`, if this thread has it.
pub(crate) fn cached<T: Any + Send + Sync>(engine: u64, stream: StreamId) -> Option<Arc<T>> {
    CURRENT
        .try_with(|current| {
            let current = current.borrow();
            let cached = current.as_ref()?;
            if cached.engine != engine || cached.stream != stream.value {
                return None;
            }
            cached.cell.upgrade()?.downcast::<T>().ok()
        })
        .ok()
        .flatten()
}

/// Remember `cell` as this thread's current stream of `engine`.
pub(crate) fn cache<T: Any + Send + Sync>(engine: u64, stream: StreamId, cell: &Arc<T>) {
    let erased: Arc<dyn Any + Send + Sync> = cell.clone();
    let _ = CURRENT.try_with(|current| {
        *current.borrow_mut() = Some(Cached {
            engine,
            stream: stream.value,
            cell: Arc::downgrade(&erased),
        });
    });
}

/// Forget the cached stream (it was retired).
pub(crate) fn evict(engine: u64) {
    let _ = CURRENT.try_with(|current| {
        let mut current = current.borrow_mut();
        if current.as_ref().is_some_and(|c| c.engine == engine) {
            *current = None;
        }
    });
}

/// Run `hook` for `stream` when this thread exits (once per engine and stream).
pub(crate) fn on_exit(engine: u64, hook: Weak<dyn ThreadExitHook>, stream: StreamId) {
    let _ = EXIT_HOOKS.try_with(|hooks| {
        let mut hooks = hooks.0.borrow_mut();
        // Forget hooks of engines that are gone, so a long-lived thread that uses many engines
        // does not accumulate them.
        hooks.retain(|(_, hook, _)| hook.strong_count() > 0);
        if !hooks.iter().any(|(e, _, s)| *e == engine && *s == stream) {
            hooks.push((engine, hook, stream));
        }
    });
}
