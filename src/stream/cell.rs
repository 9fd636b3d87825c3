//! One stream's lock, and the inbox that lets a thread hand it work without waiting for it.
//!
//! # Why an inbox
//!
//! A thread that holds a stream's lock may need to release a tensor or register a view on a
//! stream whose lock it cannot take: an executor (running under the lock of the stream it belongs
//! to) that drops or clones a tensor it captured, or a thread unwinding out of the engine. Taking
//! the lock there would deadlock. Such a thread *posts* the work to the target stream's inbox
//! instead, and whoever holds (or next takes) that stream's lock applies it.
//!
//! # Protocol (no message is stranded)
//!
//! * A poster pushes its message under the inbox's own small mutex, sets `inbox_flag`, issues a
//!   `SeqCst` fence and then *tries* the stream lock; if it gets it, it applies the inbox and
//!   releases.
//! * A holder applies the inbox before it releases the lock; after releasing it issues a `SeqCst`
//!   fence, and if `inbox_flag` is set it tries the lock again and repeats.
//!
//! The two fences forbid the store-buffer outcome in which the poster's `try_lock` sees the lock
//! still held *and* the holder's post-release check misses the flag: one of the two always sees
//! the other, so every posted message is applied by someone before that someone leaves.
//!
//! # Re-entrancy
//!
//! [`in_engine`] tells whether the current thread holds any stream lock. The public API refuses to
//! run then ([`crate::Error::Reentrant`]); drops and clones, which cannot fail, use the inbox.

use std::cell::Cell;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering, fence};

use burn_backend::StreamId;
use burn_ir::TensorId;
use parking_lot::{Mutex, MutexGuard};

use super::state::{Entry, StreamState};
use crate::runtime::StreamRuntime;

std::thread_local! {
    /// Stream locks held by this thread. A `Cell<u32>` with a const initialiser has no destructor,
    /// so it stays readable while the thread's other thread-locals are destroyed.
    static LOCKS_HELD: Cell<u32> = const { Cell::new(0) };
}

/// Whether the current thread holds a stream lock: it is running an operation, or is inside the
/// engine's own bookkeeping.
pub(crate) fn in_engine() -> bool {
    LOCKS_HELD.with(|held| held.get() > 0)
}

fn enter() {
    LOCKS_HELD.with(|held| held.set(held.get() + 1));
}

fn leave() {
    LOCKS_HELD.with(|held| held.set(held.get() - 1));
}

/// Work handed to a stream by a thread that could not take its lock.
pub(crate) enum InboxMessage<H> {
    /// The last live tensor of this id went away: release it (foreign-drop rules).
    Free(TensorId),
    /// Register this entry under a fresh id (a view minted where the lock was unavailable).
    Register(TensorId, Entry<H>),
}

/// A stream: its state behind a lock, plus an inbox.
pub(crate) struct StreamCell<R: StreamRuntime> {
    pub(crate) id: StreamId,
    state: Mutex<StreamState<R>>,
    inbox: Mutex<Vec<InboxMessage<R::FusionHandle>>>,
    inbox_flag: AtomicBool,
}

impl<R: StreamRuntime> StreamCell<R> {
    pub(crate) fn new(id: StreamId, max_queue_len: usize, context: Arc<R::Context>) -> Self {
        Self {
            id,
            state: Mutex::new(StreamState::new(id, max_queue_len, context)),
            inbox: Mutex::new(Vec::new()),
            inbox_flag: AtomicBool::new(false),
        }
    }

    /// Take the stream's lock. Must not be called by a thread that already holds it (callers
    /// check [`in_engine`] first).
    pub(crate) fn lock(&self) -> StreamGuard<'_, R> {
        let guard = self.state.lock();
        enter();
        let mut guard = StreamGuard {
            cell: self,
            guard: ManuallyDrop::new(guard),
        };
        guard.apply_inbox();
        guard
    }

    fn try_lock(&self) -> Option<StreamGuard<'_, R>> {
        let guard = self.state.try_lock()?;
        enter();
        Some(StreamGuard {
            cell: self,
            guard: ManuallyDrop::new(guard),
        })
    }

    /// Hand `message` to this stream without blocking; see the module docs.
    pub(crate) fn post(&self, message: InboxMessage<R::FusionHandle>) {
        self.inbox.lock().push(message);
        self.inbox_flag.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if let Some(guard) = self.try_lock() {
            // Applied when the guard drops.
            drop(guard);
        }
    }
}

/// Exclusive access to a stream's state. Applies the inbox on release.
pub(crate) struct StreamGuard<'a, R: StreamRuntime> {
    cell: &'a StreamCell<R>,
    guard: ManuallyDrop<MutexGuard<'a, StreamState<R>>>,
}

impl<R: StreamRuntime> StreamGuard<'_, R> {
    fn apply_inbox(&mut self) {
        apply_inbox(self.cell, &mut self.guard);
    }
}

fn apply_inbox<R: StreamRuntime>(cell: &StreamCell<R>, state: &mut StreamState<R>) {
    if !cell.inbox_flag.load(Ordering::SeqCst) {
        return;
    }
    cell.inbox_flag.store(false, Ordering::SeqCst);
    let messages = std::mem::take(&mut *cell.inbox.lock());
    for message in messages {
        match message {
            InboxMessage::Free(id) => state.foreign_drop(id),
            InboxMessage::Register(id, entry) => state.register_entry(id, entry),
        }
    }
}

impl<R: StreamRuntime> Deref for StreamGuard<'_, R> {
    type Target = StreamState<R>;
    fn deref(&self) -> &StreamState<R> {
        &self.guard
    }
}

impl<R: StreamRuntime> DerefMut for StreamGuard<'_, R> {
    fn deref_mut(&mut self) -> &mut StreamState<R> {
        &mut self.guard
    }
}

impl<R: StreamRuntime> Drop for StreamGuard<'_, R> {
    fn drop(&mut self) {
        self.apply_inbox();
        // SAFETY: `guard` is dropped exactly once, here, and never used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.guard) };
        leave();
        fence(Ordering::SeqCst);
        // A message posted while we held the lock, whose poster's try_lock failed because of
        // us, is ours to apply.
        while self.cell.inbox_flag.load(Ordering::SeqCst) {
            let Some(mut state) = self.cell.state.try_lock() else {
                // Someone else holds it now; their release runs this same check.
                break;
            };
            enter();
            apply_inbox(self.cell, &mut state);
            drop(state);
            leave();
            fence(Ordering::SeqCst);
        }
    }
}
