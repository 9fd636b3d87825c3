//! One stream's lock and inbox ([`super::inbox`]), and the thread's record of held stream locks.
//!
//! # Re-entrancy
//!
//! [`in_engine`] tells whether the current thread holds any stream lock. The public API refuses to
//! run then ([`crate::Error::Reentrant`]); drops and clones, which cannot fail, post to the
//! target stream's inbox instead of taking its lock.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn_backend::StreamId;
use burn_ir::TensorId;

use super::inbox::{InboxGuard, InboxLock, Mailbox};
use super::state::{Entry, StreamState};
use crate::operation::QueuedOp;
use crate::runtime::StreamRuntime;

std::thread_local! {
    /// Stream locks held by this thread. A `Cell<u32>` with a const initialiser has no destructor,
    /// so it stays readable while the thread's other thread-locals are destroyed.
    static LOCKS_HELD: Cell<u32> = const { Cell::new(0) };
}

/// Whether the current thread holds a stream lock: it is running an operation, or is inside the
/// engine's own bookkeeping.
#[inline]
pub(crate) fn in_engine() -> bool {
    LOCKS_HELD.with(|held| held.get() > 0)
}

/// Work handed to a stream by a thread that could not take its lock.
pub(crate) enum InboxMessage<R: StreamRuntime> {
    /// The last live tensor of this id went away: release it (foreign-drop rules).
    Free(TensorId),
    /// Register this entry under a fresh id (a view minted where the lock was unavailable).
    Register(TensorId, Entry<R::FusionHandle>),
    /// An operation (or a last drop) the stream's own thread recorded while another thread held
    /// the lock, with the operands it consumed (see [`super::MultiStream::record`]).
    Record(QueuedOp<R>, Consumed),
}

/// The ids of the operands an operation consumed (`ReadWrite`): they leave `shared_sources`
/// when the operation is queued.
pub(crate) type Consumed = smallvec::SmallVec<[TensorId; 2]>;

impl<R: StreamRuntime> Mailbox for StreamState<R> {
    type Message = InboxMessage<R>;

    fn apply(&mut self, message: Self::Message) {
        match message {
            // A retired state holds no ids; a stale poster's free has nothing to do there.
            InboxMessage::Free(_) if self.retired => {}
            InboxMessage::Free(id) => self.foreign_drop(id),
            InboxMessage::Register(id, entry) => self.register_entry(id, entry),
            InboxMessage::Record(op, consumed) => self.record_posted(op, consumed),
        }
    }

    #[inline(always)]
    fn settle(&mut self) {
        StreamState::settle(self);
    }

    #[inline]
    fn entered() {
        LOCKS_HELD.with(|held| held.set(held.get() + 1));
    }

    #[inline]
    fn left() {
        LOCKS_HELD.with(|held| held.set(held.get() - 1));
    }
}

/// Exclusive access to a stream's state. Applies the inbox on release.
pub(crate) type StreamGuard<'a, R> = InboxGuard<'a, StreamState<R>>;

/// A stream: its state behind a lock, plus an inbox.
pub(crate) struct StreamCell<R: StreamRuntime> {
    pub(crate) id: StreamId,
    /// Its state's serial (see `StreamState::serial`).
    pub(crate) serial: u64,
    state: InboxLock<StreamState<R>>,
    /// Records the stream's own thread posted since it last held the lock (only that thread
    /// reads or writes it): see [`StreamCell::may_post`].
    posted: AtomicUsize,
    /// The most it may post in a row: the queue bound (`EngineConfig::max_queue_len`).
    max_posted: usize,
}

impl<R: StreamRuntime> StreamCell<R> {
    pub(crate) fn new(state: StreamState<R>) -> Self {
        Self {
            id: state.id,
            serial: state.serial,
            max_posted: state.max_queue_len,
            state: InboxLock::new(state),
            posted: AtomicUsize::new(0),
        }
    }

    /// Whether the stream's own thread, finding the lock taken, may post its record rather than
    /// wait (counting the post). Posted records are queued but not run by whoever applies them,
    /// so after a queue bound's worth in a row the thread waits for the lock once, and that
    /// record runs what the bound asks for on the thread itself (the count starts again:
    /// [`StreamCell::held_by_home`]).
    #[inline]
    pub(crate) fn may_post(&self) -> bool {
        let posted = self.posted.load(Ordering::Relaxed);
        if posted >= self.max_posted {
            return false;
        }
        self.posted.store(posted + 1, Ordering::Relaxed);
        true
    }

    /// The stream's own thread holds the lock: it may post a queue bound's worth again.
    #[inline]
    pub(crate) fn held_by_home(&self) {
        if self.posted.load(Ordering::Relaxed) != 0 {
            self.posted.store(0, Ordering::Relaxed);
        }
    }

    /// Take the stream's lock. Must not be called by a thread that already holds it (callers
    /// check [`in_engine`] first).
    #[inline]
    pub(crate) fn lock(&self) -> StreamGuard<'_, R> {
        match self.state.try_lock() {
            Some(guard) => guard,
            None => self.lock_held(),
        }
    }

    /// [`Self::lock`] when another thread holds the lock: the wait is what
    /// [`crate::profile::Section::Lock`] times.
    #[cold]
    #[inline(never)]
    fn lock_held(&self) -> StreamGuard<'_, R> {
        let _timer = crate::profile::time(crate::profile::Section::Lock);
        self.state.lock()
    }

    /// Take the stream's lock if it is free (inspection from inside the engine, which must never
    /// wait for a stream lock).
    pub(crate) fn try_lock(&self) -> Option<StreamGuard<'_, R>> {
        self.state.try_lock()
    }

    /// Hand `message` to this stream without blocking; see [`super::inbox`].
    pub(crate) fn post(&self, message: InboxMessage<R>) {
        self.state.post(message);
    }
}
