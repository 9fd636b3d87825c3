//! One stream's lock and inbox ([`super::inbox`]), and the thread's record of held stream locks.
//!
//! # Re-entrancy
//!
//! [`in_engine`] tells whether the current thread holds any stream lock. The public API refuses to
//! run then ([`crate::Error::Reentrant`]); drops and clones, which cannot fail, post to the
//! target stream's inbox instead of taking its lock.

use std::cell::Cell;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};

use burn_backend::StreamId;
use burn_ir::TensorId;

use super::detached::{Detached, IdleLatch};
use super::inbox::{InboxGuard, InboxLock, Mailbox};
use super::lane;
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

/// Debug builds fail loudly when the calling thread holds a stream lock (or runs inside the
/// engine) on entry to a wait whose end depends on another thread: the batch pool, the service
/// thread, another detached batch. Such a wait under a lock is how a deadlock starts
/// (docs/ARCHITECTURE.md, "Locks and waits").
#[inline(always)]
pub(crate) fn assert_no_stream_lock(wait: &str) {
    debug_assert!(
        !in_engine(),
        "{wait}: a wait on another thread entered with a stream lock held (or from inside the engine)"
    );
}

/// Counts the current thread as inside the engine until dropped, as if it held a stream lock:
/// for a batch that runs on the engine's batch pool ([`super::batch_pool`]), detached from its
/// stream ([`super::detached`]), so that an operation calling back into the engine is refused
/// there as it is under the lock, and a drop or clone there is posted to an inbox.
pub(crate) struct InEngine(());

impl InEngine {
    pub(crate) fn enter() -> Self {
        LOCKS_HELD.with(|held| held.set(held.get() + 1));
        InEngine(())
    }
}

impl Drop for InEngine {
    fn drop(&mut self) {
        LOCKS_HELD.with(|held| held.set(held.get() - 1));
    }
}

/// Work handed to a stream by a thread that could not take its lock.
pub(crate) enum InboxMessage<R: StreamRuntime> {
    /// The last live tensor of this id went away: release it (foreign-drop rules).
    Free(TensorId),
    /// Register this entry under a fresh id (a view minted where the lock was unavailable).
    Register(TensorId, Entry<R::FusionHandle>),
    /// An operation (or a last drop) the stream's own thread recorded while another thread
    /// held the lock, when it could not go through the stream's lane (a stream that fuses has
    /// none; see [`super::MultiStream::record`]).
    Record(QueuedOp<R>),
}

impl<R: StreamRuntime> Mailbox for StreamState<R> {
    type Message = InboxMessage<R>;
    type Record = QueuedOp<R>;

    fn apply(&mut self, message: Self::Message) {
        match message {
            // A retired state holds no ids; a stale poster's free has nothing to do there.
            InboxMessage::Free(_) if self.retired => {}
            InboxMessage::Free(id) => self.foreign_drop(id),
            InboxMessage::Register(id, entry) => self.register_entry(id, entry),
            InboxMessage::Record(op) => self.record_posted(op, true),
        }
    }

    #[inline(always)]
    fn apply_record(&mut self, op: QueuedOp<R>, by_home: bool) {
        self.record_posted(op, !by_home);
    }

    fn home_holds(&self) -> bool {
        self.on_home_thread()
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

/// Exclusive access to a stream's state. Applies the inbox on release; then, with the lock let
/// go, runs the batch the holder detached, if it did ([`super::detached`]): every execution of a
/// batch for the batch pool happens here, whoever asked for it and wherever in the engine.
pub(crate) struct StreamGuard<'a, R: StreamRuntime> {
    guard: ManuallyDrop<InboxGuard<'a, StreamState<R>>>,
    cell: &'a StreamCell<R>,
}

impl<R: StreamRuntime> Deref for StreamGuard<'_, R> {
    type Target = StreamState<R>;
    #[inline(always)]
    fn deref(&self) -> &StreamState<R> {
        &self.guard
    }
}

impl<R: StreamRuntime> DerefMut for StreamGuard<'_, R> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut StreamState<R> {
        &mut self.guard
    }
}

impl<R: StreamRuntime> Drop for StreamGuard<'_, R> {
    #[inline(always)]
    fn drop(&mut self) {
        let detached = self.guard.detached.take();
        // SAFETY: `guard` is dropped exactly once, here, and never used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.guard) };
        if let Some(batch) = detached {
            self.cell.run_detached(batch);
        }
    }
}

/// The most records a stream's lane holds (when the queue bound is larger, the stream's thread
/// takes the lock more often than the bound asks). A stream that fuses gets one slot, never
/// pushed to.
const LANE_MAX: usize = 256;

/// A stream: its state behind a lock, plus an inbox and its own thread's lane.
pub(crate) struct StreamCell<R: StreamRuntime> {
    pub(crate) id: StreamId,
    /// Its state's serial (see `StreamState::serial`).
    pub(crate) serial: u64,
    state: InboxLock<StreamState<R>>,
    /// The lane's one producer: the [`lane::thread_token`] of the thread that made the stream,
    /// its own thread; 0 for a stream that fuses, whose records go under the lock (its fuser
    /// sees each as it is recorded).
    producer: u64,
    /// Records the stream's own thread handed over without the lock, through the lane or the
    /// inbox, since it last recorded under the lock (only that thread reads or writes it): see
    /// [`StreamCell::hand_over`] and [`StreamCell::may_post`].
    pending: AtomicUsize,
    /// The most it may hand over in a row: the queue bound (`EngineConfig::max_queue_len`).
    max_pending: usize,
    /// Where threads wait for a batch of this stream running detached to finish.
    idle: IdleLatch,
    /// The state's `contended`: set by a thread that waits for the lock.
    contended: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl<R: StreamRuntime> StreamCell<R> {
    /// The cell of a new stream, made on the stream's own thread.
    pub(crate) fn new(state: StreamState<R>) -> Self {
        let contended = state.contended.clone();
        let laned = state.fuser.is_none();
        let lane_len = if laned {
            state.max_queue_len.min(LANE_MAX)
        } else {
            1
        };
        Self {
            id: state.id,
            serial: state.serial,
            producer: if laned { lane::thread_token() } else { 0 },
            max_pending: state.max_queue_len,
            state: InboxLock::new(state, lane_len),
            pending: AtomicUsize::new(0),
            idle: IdleLatch::default(),
            contended,
        }
    }

    /// Hand the stream's own thread's `record` over without the lock, through the lane
    /// (`super::lane`), or give it back: the stream fuses, the caller is not the stream's own
    /// thread, or the record is the queue bound's (it goes under the lock, which runs what the
    /// bound asks for on the thread itself; the count starts again:
    /// [`StreamCell::held_by_home`]).
    #[inline]
    pub(crate) fn hand_over(&self, record: QueuedOp<R>) -> Result<(), QueuedOp<R>> {
        let pending = self.pending.load(Ordering::Relaxed);
        // (The thread's token is read last: a fusing stream, or the bound, decides first.)
        if self.producer == 0
            || pending + 1 >= self.max_pending
            || self.producer != lane::thread_token()
        {
            return Err(record);
        }
        // SAFETY: the lane's one producer is the thread whose token is `producer`: this one.
        unsafe { self.state.push(record) }?;
        self.pending.store(pending + 1, Ordering::Relaxed);
        Ok(())
    }

    /// Whether the stream's own thread, finding the lock taken, may post its record rather than
    /// wait (counting the post). Handed-over records are queued but not run by whoever applies
    /// them, so after a queue bound's worth in a row the thread waits for the lock once, and
    /// that record runs what the bound asks for on the thread itself (the count starts again:
    /// [`StreamCell::held_by_home`]).
    #[inline]
    pub(crate) fn may_post(&self) -> bool {
        let pending = self.pending.load(Ordering::Relaxed);
        if pending >= self.max_pending {
            return false;
        }
        self.pending.store(pending + 1, Ordering::Relaxed);
        true
    }

    /// The stream's own thread holds the lock: it may hand over a queue bound's worth again.
    #[inline]
    pub(crate) fn held_by_home(&self) {
        if self.pending.load(Ordering::Relaxed) != 0 {
            self.pending.store(0, Ordering::Relaxed);
        }
    }

    /// Take the stream's lock. Must not be called by a thread that already holds it (callers
    /// check [`in_engine`] first).
    #[inline]
    pub(crate) fn lock(&self) -> StreamGuard<'_, R> {
        let guard = match self.state.try_lock() {
            Some(guard) => guard,
            None => self.lock_held(),
        };
        self.guarded(guard)
    }

    #[inline(always)]
    fn guarded<'a>(&'a self, guard: InboxGuard<'a, StreamState<R>>) -> StreamGuard<'a, R> {
        StreamGuard {
            guard: ManuallyDrop::new(guard),
            cell: self,
        }
    }

    /// [`Self::lock`] when another thread holds the lock: the wait is what
    /// [`crate::profile::Section::Lock`] times.
    #[cold]
    #[inline(never)]
    fn lock_held(&self) -> InboxGuard<'_, StreamState<R>> {
        let _timer = crate::profile::time(crate::profile::Section::Lock);
        self.contended.store(true, Ordering::Relaxed);
        self.state.lock()
    }

    /// Take the stream's lock if it is free (inspection from inside the engine, which must never
    /// wait for a stream lock).
    pub(crate) fn try_lock(&self) -> Option<StreamGuard<'_, R>> {
        self.state.try_lock().map(|guard| self.guarded(guard))
    }

    /// Take the stream's lock once no batch of it runs detached ([`super::detached`]): for
    /// whatever executes the queue (a drain, a share or read that may drain), since what is
    /// queued behind a running batch may read its outputs. The wait is without the lock.
    pub(crate) fn lock_idle(&self) -> StreamGuard<'_, R> {
        loop {
            let state = self.lock();
            if state.running.is_none() {
                return state;
            }
            // Read under the stream's lock: before the merge (see `IdleLatch`).
            let finished = self.idle.finished();
            drop(state);
            self.wait_idle(finished);
        }
    }

    /// Wait until a batch of this stream finishes after the `finished`-th did.
    #[cold]
    fn wait_idle(&self, finished: u64) {
        assert_no_stream_lock("waiting for a detached batch");
        let _timer = crate::profile::time(crate::profile::Section::Lock);
        self.idle.wait_past(finished);
    }

    /// `state`, with the batch its holder detached run and merged first, if it did: the lock
    /// again, idle. For a caller that reads what the drain it just made produced.
    pub(crate) fn settled<'a>(&'a self, mut state: StreamGuard<'a, R>) -> StreamGuard<'a, R> {
        let Some(batch) = state.detached.take() else {
            return state;
        };
        drop(state);
        self.run_detached(batch);
        self.lock_idle()
    }

    /// Run a batch detached from this stream by the calling thread, which has let go of the lock,
    /// and merge it back ([`super::detached`], steps 2 and 3).
    pub(crate) fn run_detached(&self, batch: Detached<R>) {
        assert_no_stream_lock("running a detached batch");
        let Detached { ops, mut scratch } = batch;
        scratch.execute_detached(ops);
        self.lock().merge(&mut scratch);
        // What is left of the scratch state (second owners of what the batch read) goes after
        // the lock.
        drop(scratch);
        self.idle.finish();
    }

    /// Hand `message` to this stream without blocking; see [`super::inbox`].
    pub(crate) fn post(&self, message: InboxMessage<R>) {
        self.state.post(message);
    }
}
