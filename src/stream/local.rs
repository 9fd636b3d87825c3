//! Per-thread helpers: a cache of the current stream, the list of streams to drain when the
//! thread exits, whether it is exiting, and the orderings this thread's stream was given.
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
//! and, when it exits, has them drained ([`EngineHook::on_thread_exit`]); a stream left empty is
//! retired from its engine. The exiting thread does not run that work itself: it hands each stream
//! to the engine's service thread and waits (see [`super::service`]).
//!
//! # Orderings
//!
//! A stream that uses a buffer another stream allocated is first made to wait on the device for
//! everything that stream dispatched (`StreamRuntime::order_use`). Only the thread whose stream
//! waits asks for that (a share or a read, never from inside an executing operation), so the
//! orderings its stream got so far are the thread's to remember: [`ordered_after`] and
//! [`note_ordered`], and `MultiStream::plan_order` for when one can be skipped.
//!
//! Thread-local destructors that run *after* this one may still use the engine. [`exiting`] is
//! set from here on, and the engine routes whatever such a destructor does through the service
//! thread as well (see `MultiStream::with_current`), so nothing it registers is stranded.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::sync::{Arc, Weak};

use burn_backend::StreamId;

use super::service::{self, EngineHook};

struct Cached {
    engine: u64,
    stream: u64,
    cell: Weak<dyn Any + Send + Sync>,
}

/// An ordering this thread asked for: in engine `engine`, stream `waiter` (this thread's stream
/// then) was made to wait for everything stream `home` had dispatched when `home`'s stamp was
/// `stamp` (see `StreamState::stamp`).
#[derive(Clone, Copy)]
struct Ordered {
    engine: u64,
    waiter: u64,
    home: u64,
    stamp: u64,
}

/// How many orderings a thread remembers: the streams it takes tensors from, most often a few.
/// Forgetting one only costs a wait that was not needed.
const ORDERINGS_KEPT: usize = 16;

/// (engine key, the engine, a stream this thread used on it).
type ExitHook = (u64, Weak<dyn EngineHook>, StreamId);

struct ExitHooks(RefCell<Vec<ExitHook>>);

impl Drop for ExitHooks {
    fn drop(&mut self) {
        EXITING.with(|exiting| exiting.set(true));
        for (_, hook, stream) in self.0.get_mut().drain(..) {
            service::exit_drain(hook, stream);
        }
        // What the thread's streams had queued is dispatched: a later thread may run on its
        // execution stream.
        super::exec::give_back();
    }
}

/// Whether this thread's exit hooks will still run (they have not started): arranges for them
/// to run even if the thread never uses an engine stream.
pub(crate) fn will_run_exit_hooks() -> bool {
    EXIT_HOOKS.try_with(|_| ()).is_ok() && !exiting()
}

/// Whether this thread has started exiting (its exit hooks are running): it must not execute
/// operations any more.
#[inline]
pub(crate) fn exiting() -> bool {
    EXITING.with(Cell::get)
}

std::thread_local! {
    static CURRENT: RefCell<Option<Cached>> = const { RefCell::new(None) };
    static EXIT_HOOKS: ExitHooks = const { ExitHooks(RefCell::new(Vec::new())) };
    /// A `Cell<bool>` with a const initialiser: no destructor, readable during thread exit.
    static EXITING: Cell<bool> = const { Cell::new(false) };
    /// The latest orderings, newest last.
    static ORDERED: RefCell<Vec<Ordered>> = const { RefCell::new(Vec::new()) };
}

/// The stamp `home` had when `waiter` was last ordered after it in `engine` by this thread, if
/// this thread remembers one.
pub(crate) fn ordered_after(engine: u64, waiter: StreamId, home: StreamId) -> Option<u64> {
    ORDERED
        .try_with(|ordered| {
            ordered
                .borrow()
                .iter()
                .rev()
                .find(|o| o.engine == engine && o.waiter == waiter.value && o.home == home.value)
                .map(|o| o.stamp)
        })
        .ok()
        .flatten()
}

/// Remember that `waiter` was ordered after everything `home` dispatched up to `stamp`.
pub(crate) fn note_ordered(engine: u64, waiter: StreamId, home: StreamId, stamp: u64) {
    let _ = ORDERED.try_with(|ordered| {
        let mut ordered = ordered.borrow_mut();
        ordered
            .retain(|o| !(o.engine == engine && o.waiter == waiter.value && o.home == home.value));
        if ordered.len() == ORDERINGS_KEPT {
            ordered.remove(0);
        }
        ordered.push(Ordered {
            engine,
            waiter: waiter.value,
            home: home.value,
            stamp,
        });
    });
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
pub(crate) fn on_exit(engine: u64, hook: Weak<dyn EngineHook>, stream: StreamId) {
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
