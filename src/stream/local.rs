//! Per-thread helpers: a cache of the current stream, the list of streams to drain when the
//! thread exits, and whether it is exiting.
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

/// (engine key, the engine, a stream this thread used on it).
type ExitHook = (u64, Weak<dyn EngineHook>, StreamId);

struct ExitHooks(RefCell<Vec<ExitHook>>);

impl Drop for ExitHooks {
    fn drop(&mut self) {
        EXITING.with(|exiting| exiting.set(true));
        for (_, hook, stream) in self.0.get_mut().drain(..) {
            service::exit_drain(hook, stream);
        }
    }
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
