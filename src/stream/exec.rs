//! Execution streams: the backend stream each thread's work runs on, recycled from threads that
//! exited.
//!
//! # Why the engine does not use the thread's own stream id
//!
//! cubecl 0.10 gives every thread that asks a new [`StreamId`], never reused, and keeps its
//! per-stream state in 128 slots chosen by `id % 128`: a CUDA stream, and pools of device memory
//! and of page-locked host memory, each starting empty. So until 128 threads have come and gone,
//! each new thread starts on a fresh slot, and one that runs fused work paid 5–8 ms more for it on
//! an H100 (measured: `docs/BENCHMARKS.md`, "Fresh cubecl streams"; by cubecl-cuda's code, a fused
//! kernel's launch uploads its shapes and strides through the slot's page-locked pool, whose first
//! use maps a 20 MB page).
//!
//! # What the engine does instead
//!
//! Each thread's work — its stream's executions, wherever they run, and what the thread does on
//! the backend itself: uploads, reads, syncs, orderings — runs under the thread's *execution
//! stream*, taken when the thread first needs one:
//!
//! * from the ids of threads that exited, most recent first, so a new thread lands on a slot
//!   that is already warm;
//! * else a fresh id, from a range no thread id reaches (`EXEC_BASE` and up), so an execution
//!   stream is never also some live thread's own stream.
//!
//! A thread gives its id back when it exits, after its exit drain has dispatched what its streams
//! had queued. The number of backend streams in use is then bounded by the number of threads
//! alive at once, not by the number that ever ran.
//!
//! The engine's own streams are still keyed by the thread's [`StreamId`], which is never reused:
//! what the engine remembers per stream (the orderings a thread's stream got, stamps, exit hooks)
//! can never be mistaken for another thread's. Only the backend-facing id is recycled.
//!
//! # Sharing an execution stream is safe
//!
//! Two streams may run on one execution stream: an exiting thread's thread-local destructors may
//! still record work after the thread gave its id back, and a stream orphaned by its thread's exit
//! keeps its id while a new thread takes it. The backend then sees one stream, which runs
//! everything in the order it was dispatched: more ordering, never less. The engine's rules
//! agree: a buffer allocated on the execution stream it is used on is not foreign there
//! ([`crate::runtime::StreamRuntime::foreign_to`]), and needs no ordering because the stream
//! orders it.
//!
//! # Seeing the engine's stream inside an execution
//!
//! An execution sets cubecl's current stream to the execution stream, so that every launch and
//! allocation lands there. Engine code that runs inside one and asks which engine stream is
//! current (a drop posted from an executing operation, say) asks [`current_stream`], which
//! answers with the stream being executed.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use burn_backend::StreamId;
use parking_lot::Mutex;

/// The first execution id. cubecl numbers threads from 0, one at a time; no process starts 2⁴⁸
/// threads. A multiple of cubecl's slot count, so fresh ids take slots 0, 1, 2, … in turn.
const EXEC_BASE: u64 = 1 << 48;

/// The next fresh execution id.
static NEXT_EXEC: AtomicU64 = AtomicU64::new(EXEC_BASE);

/// Execution ids given back by threads that exited, most recent last.
static FREE: Mutex<Vec<u64>> = Mutex::new(Vec::new());

/// No value: no execution id taken, no stream executing.
const NONE: u64 = u64::MAX;

std::thread_local! {
    /// This thread's execution id, or `NONE`. A `Cell` with a const initialiser has no
    /// destructor, so it stays readable while the thread's thread-locals are destroyed.
    static EXEC: Cell<u64> = const { Cell::new(NONE) };
    /// Whether this thread's id goes back to `FREE` when it exits.
    static GIVES_BACK: Cell<bool> = const { Cell::new(false) };
    /// The engine stream whose execution this thread is running, or `NONE`.
    static EXECUTING: Cell<u64> = const { Cell::new(NONE) };
}

/// The current thread's execution stream: the backend stream its work runs on.
#[inline]
pub(crate) fn execution_stream() -> StreamId {
    let value = EXEC.with(Cell::get);
    if value != NONE {
        return StreamId { value };
    }
    take()
}

#[cold]
#[inline(never)]
fn take() -> StreamId {
    // The id goes back only from the thread's exit hooks; a thread whose hooks are already
    // gone (a late thread-local destructor) keeps a fresh one for the rest of its life.
    let gives_back = super::local::will_run_exit_hooks();
    let recycled = if gives_back { FREE.lock().pop() } else { None };
    let value = recycled.unwrap_or_else(|| NEXT_EXEC.fetch_add(1, Ordering::Relaxed));
    EXEC.with(|exec| exec.set(value));
    GIVES_BACK.with(|g| g.set(gives_back));
    StreamId { value }
}

/// Every execution stream handed out so far (they are recycled, so as many as threads have had
/// one at once): what a wait for the whole device waits for, on a backend whose streams are
/// synchronised one by one.
pub(crate) fn execution_streams() -> impl Iterator<Item = StreamId> {
    (EXEC_BASE..NEXT_EXEC.load(Ordering::Relaxed)).map(|value| StreamId { value })
}

/// Give this thread's execution id back for a later thread (from the thread's exit hooks, after
/// its exit drain). The thread keeps using it for whatever its last destructors do (see "Sharing
/// an execution stream is safe").
pub(crate) fn give_back() {
    if !GIVES_BACK.with(|g| g.replace(false)) {
        return;
    }
    let value = EXEC.with(Cell::get);
    if value != NONE {
        FREE.lock().push(value);
    }
}

/// The engine stream that is current on this thread: the stream being executed while an
/// execution runs here, else cubecl's current stream (the thread's own, or whatever the caller
/// set with [`StreamId::executes`]).
#[inline]
pub(crate) fn current_stream() -> StreamId {
    let current = StreamId::current();
    if current.value < EXEC_BASE {
        return current;
    }
    executing_or(current)
}

/// The engine stream `id` names: `id` itself, unless it is the execution stream an execution on
/// this thread set as cubecl's current stream, which names the stream being executed. So code
/// inside an executing operation that passes [`StreamId::current`] to the engine names that
/// stream, as it did before execution streams existed.
pub(crate) fn engine_stream(id: StreamId) -> StreamId {
    if id == StreamId::current() {
        current_stream()
    } else {
        id
    }
}

#[cold]
#[inline(never)]
fn executing_or(current: StreamId) -> StreamId {
    match EXECUTING.with(Cell::get) {
        NONE => current,
        value => StreamId { value },
    }
}

/// Run `f` with cubecl's current stream set to `exec`, while the engine still sees `stream` as
/// the current engine stream ([`current_stream`]). Restores both afterwards, on unwind too.
pub(crate) fn executes<T>(stream: StreamId, exec: StreamId, f: impl FnOnce() -> T) -> T {
    struct Restore(u64);
    impl Drop for Restore {
        fn drop(&mut self) {
            EXECUTING.with(|executing| executing.set(self.0));
        }
    }
    let _restore = Restore(EXECUTING.with(|executing| executing.replace(stream.value)));
    exec.executes(f)
}

/// Run `f` on the current thread's execution stream, as the current engine stream: for what a
/// thread does on the backend outside an execution (an upload, a read, a sync).
pub(crate) fn on_execution_stream<T>(f: impl FnOnce() -> T) -> T {
    executes(current_stream(), execution_stream(), f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_execution_stream_is_stable_and_never_a_threads_own() {
        let exec = std::thread::spawn(|| {
            let exec = execution_stream();
            assert_eq!(execution_stream(), exec, "stable for the thread's life");
            assert_ne!(exec, StreamId::current());
            exec
        })
        .join()
        .unwrap();
        assert!(exec.value >= EXEC_BASE);
    }

    #[test]
    fn inside_an_execution_the_engine_sees_the_executed_stream() {
        let me = StreamId::current();
        let stream = StreamId { value: 12_345 };
        let exec = execution_stream();
        let (cubecl, engine) = executes(stream, exec, || (StreamId::current(), current_stream()));
        assert_eq!(cubecl, exec);
        assert_eq!(engine, stream);
        assert_eq!(current_stream(), me, "restored");
        assert_eq!(StreamId::current(), me, "restored");
        let caught = std::panic::catch_unwind(|| executes(stream, exec, || panic!("unwinds")));
        assert!(caught.is_err());
        assert_eq!(current_stream(), me, "restored on unwind");
    }
}
