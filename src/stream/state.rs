//! The state of one stream: its lazy queue, the handles of the tensors it is home to, their error
//! records, and the bookkeeping for shares and frees.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use burn_backend::StreamId;
use burn_ir::TensorId;
use hashbrown::{HashMap, HashSet};

use crate::Error;
use crate::operation::{OpBody, QueuedOp, StreamHandles};
use crate::runtime::StreamRuntime;

/// What the engine knows about a materialised tensor: a backend handle, or the error that
/// prevented it from being produced.
pub(crate) enum Entry<H> {
    Handle(H),
    Failed(Error),
}

/// Per-stream counters. Plain integers: they are only touched under the stream's lock, so threads
/// on different streams never share a cache line for them. [`crate::EngineStats`] sums them.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StreamCounters {
    pub(crate) ops_registered: u64,
    pub(crate) ops_executed: u64,
    pub(crate) ops_failed: u64,
    pub(crate) ops_skipped: u64,
    pub(crate) lazy_flushes: u64,
    pub(crate) closed_runs: u64,
    pub(crate) drains: u64,
    pub(crate) share_drains: u64,
    pub(crate) shares: u64,
    pub(crate) share_fast_paths: u64,
    pub(crate) home_drops: u64,
    pub(crate) foreign_drops: u64,
    pub(crate) deferred_frees: u64,
    pub(crate) frees: u64,
    pub(crate) deferred_flushes: u64,
    pub(crate) idle_flushes: u64,
    pub(crate) batches_pooled: u64,
    pub(crate) batches_detached: u64,
    pub(crate) fused_kernels: u64,
    pub(crate) ops_fused: u64,
    pub(crate) cut_runs_unfused: u64,
    pub(crate) orders: u64,
    pub(crate) orders_skipped: u64,
    pub(crate) ops_posted: u64,
}

impl StreamCounters {
    pub(crate) fn add(&mut self, other: &StreamCounters) {
        self.ops_registered += other.ops_registered;
        self.ops_executed += other.ops_executed;
        self.ops_failed += other.ops_failed;
        self.ops_skipped += other.ops_skipped;
        self.lazy_flushes += other.lazy_flushes;
        self.closed_runs += other.closed_runs;
        self.drains += other.drains;
        self.share_drains += other.share_drains;
        self.shares += other.shares;
        self.share_fast_paths += other.share_fast_paths;
        self.home_drops += other.home_drops;
        self.foreign_drops += other.foreign_drops;
        self.deferred_frees += other.deferred_frees;
        self.frees += other.frees;
        self.deferred_flushes += other.deferred_flushes;
        self.idle_flushes += other.idle_flushes;
        self.batches_pooled += other.batches_pooled;
        self.batches_detached += other.batches_detached;
        self.fused_kernels += other.fused_kernels;
        self.ops_fused += other.ops_fused;
        self.cut_runs_unfused += other.cut_runs_unfused;
        self.orders += other.orders;
        self.orders_skipped += other.orders_skipped;
        self.ops_posted += other.ops_posted;
    }
}

/// Stamps for [`StreamState::stamp`]: each value is handed out once, over every stream of every
/// engine.
static STAMPS: AtomicU64 = AtomicU64::new(1);

fn next_stamp() -> u64 {
    STAMPS.fetch_add(1, Ordering::Relaxed)
}

/// Everything one stream owns. Only ever accessed under its [`super::cell::StreamCell`]'s lock.
pub(crate) struct StreamState<R: StreamRuntime> {
    pub(crate) id: StreamId,
    /// The backend stream this stream's work runs on, wherever it is executed: its thread's
    /// execution stream (see [`super::exec`]). Every backend-facing use of "this stream" (an
    /// execution, `foreign_to`, `release_after_use`) means this one.
    pub(crate) exec: StreamId,
    /// Tells this state apart from a later state of the same stream id (after a retirement).
    pub(crate) serial: u64,
    /// The engine, for what a state cannot do alone: retiring itself from the engine's map, and
    /// scheduling a deferred free's deadline on the service thread.
    pub(crate) engine: Weak<super::MultiStream<R>>,
    /// The device, handed to each operation as it runs (one reference per stream rather than one
    /// per queued operation: the context's count is shared by every thread).
    pub(crate) context: Arc<R::Context>,
    pub(crate) max_queue_len: usize,
    pub(crate) max_deferred_free_delay: Duration,
    pub(crate) queue: VecDeque<QueuedOp<R>>,
    /// The runtime's kernel fuser for this stream, if the runtime fuses.
    pub(crate) fuser: Option<Box<dyn crate::runtime::Fuser<R>>>,
    /// A call into the fuser panicked where it could not be put back in a known state (its
    /// `reset`): it is dropped when it comes back to the stream (see `execution`).
    pub(crate) fuser_broken: bool,
    /// What the fuser has been offered of the queue's front (see `execution`).
    pub(crate) plan: super::execution::Plan,
    pub(crate) max_fused_len: usize,
    /// [`crate::EngineConfig::dispatch_closed_runs`].
    pub(crate) dispatch_closed_runs: bool,
    /// The engine's switch for fusion (see `MultiStream::set_fusion`).
    pub(crate) fusion: Arc<std::sync::atomic::AtomicBool>,
    /// The engine's bound on threads running work on the device at once, if any: an execution
    /// of this queue holds a permit (see `super::gate`). Taken out while an execution holds its
    /// permit, and put back after.
    pub(crate) gate: Option<Arc<super::gate::LaunchGate>>,
    /// Handles of the tensors whose home is this stream, and of nothing else (stream locality).
    pub(crate) handles: StreamHandles<R::FusionHandle>,
    /// Error records: tensors whose producer failed. Disjoint from `handles`.
    pub(crate) errors: HashMap<TensorId, Error>,
    /// Sources that needed a drain to be shared; see [`crate::MultiStream`], "Bounding
    /// `shared_sources`".
    pub(crate) shared_sources: HashSet<TensorId>,
    /// Ids dropped from another thread while a pending operation here still reads (or has yet
    /// to produce) them.
    pub(crate) deferred_frees: Vec<TensorId>,
    /// Handles of buffers [foreign](StreamRuntime::foreign_to) to this stream that it let go
    /// of, while work it dispatched may still read them: handed to
    /// [`StreamRuntime::release_after_use`] together when the stream's lock is released
    /// ([`StreamState::settle`]).
    pub(crate) released: Vec<R::FusionHandle>,
    /// A deadline for the deferred frees is scheduled on the service thread.
    pub(crate) flush_scheduled: bool,
    /// Whose drain is running (for a run it cuts: [`crate::runtime::Fuser::fuse_cut_run`]).
    pub(crate) cut: crate::runtime::Cut,
    pub(crate) counters: StreamCounters,
    /// Whether the runtime's buffers can be [foreign](StreamRuntime::foreign_to) to a stream
    /// ([`StreamRuntime::has_foreign_buffers`], asked once): only then are consumed operands
    /// looked up to ask `foreign_to` (`execute_one`), and [`Self::stamp`] kept.
    pub(crate) foreign_buffers: bool,
    /// Whether a batch holding an operation that spreads over the backend's thread pool runs on
    /// the engine's batch pool when the stream does not fuse
    /// ([`StreamRuntime::batch_placement`], asked once).
    pub(crate) batch_pool: bool,
    /// A value that changes, to one no stream ever had, whenever this stream may have dispatched
    /// a write to a buffer it allocated: after each execution of its queue and each handle
    /// registered here (an upload's write is dispatched before). Both happen under the stream's
    /// lock, where the stamp is read too. So once another stream has been made to wait for
    /// everything this one dispatched, read when the stamp was `s`, every write of this stream's
    /// buffers up to that point is covered while the stamp is still `s`, and a share or a read
    /// of one of them on that stream needs no new wait (`MultiStream::plan_order`). Being
    /// unique over all streams, a stamp never matches one remembered for an earlier state of
    /// the same stream id.
    pub(crate) stamp: u64,
    /// Set when the stream was removed from the engine's map (its thread exited and it became
    /// empty). A retired state is never used again; a later user of the id gets a fresh one.
    pub(crate) retired: bool,
    /// Set when the thread that used this stream exited while it still held tensors that live on
    /// elsewhere; the stream is retired once those are gone.
    pub(crate) orphaned: bool,
    /// A batch of this stream running on the batch pool without the lock, if one is (see
    /// [`super::detached`]).
    pub(crate) running: Option<super::detached::Running>,
    /// That batch between its detachment and the release of the lock, for the thread that holds
    /// the lock to run ([`super::cell::StreamGuard`]): never seen by another thread.
    pub(crate) detached: Option<super::detached::Detached<R>>,
    /// What the service thread's last sweep saw of this stream's activity, when it found work
    /// queued (see [`Self::idle_since_last_sweep`]).
    pub(crate) swept: Option<u64>,
    /// Set by a thread that found the lock taken and waited for it (shared with the stream's
    /// cell, which sets it without the lock); read and cleared when a batch goes to the batch
    /// pool: it runs detached only when another thread wants the stream while it runs (see
    /// [`super::detached`], "When").
    pub(crate) contended: Arc<std::sync::atomic::AtomicBool>,
    /// How many more batches for the batch pool run detached (see `execution::DETACH_CREDIT`).
    pub(crate) detach_credit: u8,
}

impl<R: StreamRuntime> StreamState<R> {
    /// The state of a new stream `id` of `engine`, running on the backend stream `exec`.
    pub(crate) fn new(
        id: StreamId,
        exec: StreamId,
        serial: u64,
        engine: &super::MultiStream<R>,
    ) -> Self {
        let (config, context) = (engine.config, engine.context.clone());
        let fuser = R::fuser(&context);
        let foreign_buffers = R::has_foreign_buffers(&context);
        Self {
            foreign_buffers,
            batch_pool: R::batch_placement(&context) == crate::runtime::BatchPlacement::BatchPool,
            stamp: next_stamp(),
            fusion: engine.fusion.clone(),
            gate: engine.gate.clone(),
            id,
            exec,
            serial,
            engine: engine.this.clone(),
            fuser,
            fuser_broken: false,
            context,
            max_queue_len: config.max_queue_len,
            max_deferred_free_delay: config.max_deferred_free_delay,
            queue: VecDeque::new(),
            plan: Default::default(),
            max_fused_len: config.max_fused_len,
            dispatch_closed_runs: config.dispatch_closed_runs,
            handles: StreamHandles::default(),
            errors: HashMap::new(),
            shared_sources: HashSet::new(),
            deferred_frees: Vec::new(),
            released: Vec::new(),
            flush_scheduled: false,
            cut: crate::runtime::Cut::Own,
            counters: StreamCounters::default(),
            retired: false,
            orphaned: false,
            running: None,
            detached: None,
            swept: None,
            contended: Arc::default(),
            detach_credit: 0,
        }
    }

    /// For the service thread's sweep (with the lock, which applied the lane): whether work is
    /// queued that was already queued at the last sweep, with nothing recorded, run or drained
    /// since: the stream's thread has gone idle, and its queue is the service thread's to run.
    pub(crate) fn idle_since_last_sweep(&mut self) -> bool {
        if self.retired || self.running.is_some() || self.queue.is_empty() {
            self.swept = None;
            return false;
        }
        let c = &self.counters;
        let activity = c.ops_registered + c.home_drops + c.ops_executed + c.drains;
        self.swept.replace(activity) == Some(activity)
    }

    /// Nothing pending, nothing held.
    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
            && self.running.is_none()
            && self.handles.num_handles() == 0
            && self.errors.is_empty()
            && self.deferred_frees.is_empty()
            && self.shared_sources.is_empty()
    }

    /// Whether `id` has been produced (successfully or not).
    pub(crate) fn is_materialised(&self, id: &TensorId) -> bool {
        self.handles.has_handle(id) || self.errors.contains_key(id)
    }

    /// A second owner of `id`'s handle, or its error record.
    pub(crate) fn entry(&self, id: &TensorId, op: &str) -> Entry<R::FusionHandle> {
        if let Some(handle) = self.handles.get_handle_ref(id) {
            Entry::Handle(R::alias(handle))
        } else if let Some(error) = self.errors.get(id) {
            Entry::Failed(error.clone())
        } else {
            Entry::Failed(Error::MissingHandle {
                op: op.into(),
                id: *id,
            })
        }
    }

    /// Register a handle or an error record under a fresh id.
    pub(crate) fn register_entry(&mut self, id: TensorId, entry: Entry<R::FusionHandle>) {
        debug_assert!(
            !self.is_materialised(&id),
            "SSA: {id} registered twice on {}",
            self.id
        );
        match entry {
            Entry::Handle(handle) => {
                self.handles.register_handle(id, handle);
                self.new_stamp();
            }
            Entry::Failed(error) => {
                self.errors.insert(id, error);
            }
        }
    }

    /// This stream may have dispatched a write: a new [`Self::stamp`].
    #[inline]
    pub(crate) fn new_stamp(&mut self) {
        if self.foreign_buffers {
            self.stamp = next_stamp();
        }
    }

    /// Remove `id`'s error record; whether it had one. Most streams hold none, and a miss on an
    /// empty map still hashes and probes, so an empty map is not touched (as in
    /// [`Self::forget_shared_source`]).
    pub(crate) fn remove_error(&mut self, id: TensorId) -> bool {
        !self.errors.is_empty() && self.errors.remove(&id).is_some()
    }

    /// `id` can no longer be shared again through its source entry: drop the entry.
    pub(crate) fn forget_shared_source(&mut self, id: TensorId) {
        if !self.shared_sources.is_empty() {
            self.shared_sources.remove(&id);
        }
    }

    /// A record of the home thread (an operation, or a last drop) on its way into the queue:
    /// the operands it consumes leave `shared_sources`, and it is counted (`posted`: another
    /// thread queues it, see [`super::EngineStats::ops_posted`]). Every way into the queue
    /// (under the lock, through the lane, posted) goes through here.
    #[inline(always)]
    fn note_record(&mut self, op: &QueuedOp<R>, posted: bool) {
        self.forget_consumed(op);
        match op {
            // A last drop by the home thread (`MultiStream::release`).
            QueuedOp::Drop(_) => self.counters.home_drops += 1,
            QueuedOp::Op(..) => {
                self.counters.ops_registered += 1;
                self.counters.ops_posted += u64::from(posted);
            }
        }
    }

    /// The operands `op` consumes leave `shared_sources`: a drop's id (its last live tensor is
    /// gone, so no share can name it again: the entry goes without waiting for the free), or an
    /// operation's `ReadWrite` inputs (an operand is handed over `ReadWrite` only as the last
    /// live tensor of its id, or as a view only the operation owns: `FusionClient::register`).
    #[inline(always)]
    fn forget_consumed(&mut self, op: &QueuedOp<R>) {
        if !self.shared_sources.is_empty() {
            self.forget_consumed_sources(op);
        }
    }

    #[inline(never)]
    fn forget_consumed_sources(&mut self, op: &QueuedOp<R>) {
        match op {
            QueuedOp::Drop(id) => {
                self.shared_sources.remove(id);
            }
            QueuedOp::Op(body, _) => {
                for ir in body.inputs() {
                    if ir.status == burn_ir::TensorStatus::ReadWrite {
                        self.shared_sources.remove(&ir.id);
                    }
                }
            }
        }
    }

    /// Release `id`'s handle or error record now.
    pub(crate) fn free(&mut self, id: TensorId) {
        let had_handle = self.remove_handle(id);
        let had_error = self.remove_error(id);
        if had_handle || had_error {
            self.counters.frees += 1;
        }
    }

    /// Take `id`'s handle out of the map and let go of it ([`StreamState::let_go`]); whether
    /// there was one.
    pub(crate) fn remove_handle(&mut self, id: TensorId) -> bool {
        match self.handles.remove_handle(id) {
            Some(burn_ir::Handle::Existing(handle)) => {
                self.let_go(handle);
                true
            }
            Some(burn_ir::Handle::NotInit) => true,
            None => false,
        }
    }

    /// Drop a handle this stream owned. A buffer [foreign](StreamRuntime::foreign_to) to this
    /// stream may still be read by work the stream dispatched, so its handle waits in
    /// `released` for [`StreamState::settle`] instead.
    pub(crate) fn let_go(&mut self, handle: R::FusionHandle) {
        if R::foreign_to(&self.context, &handle, self.exec) {
            self.released.push(handle);
        }
    }

    /// Hand the handles let go of since the last call to the runtime, to be released once the
    /// work this stream dispatched has finished with them. Called whenever the stream's lock is
    /// released, so a released buffer never waits for the stream's next use.
    #[inline(always)]
    pub(crate) fn settle(&mut self) {
        if !self.released.is_empty() {
            self.hand_released();
        }
    }

    #[inline(never)]
    fn hand_released(&mut self) {
        let _timer = crate::profile::time(crate::profile::Section::Release);
        let released = std::mem::take(&mut self.released);
        R::release_after_use(&self.context, self.exec, released);
    }

    /// A drop of `id`'s last live tensor on its home thread: enqueue the free behind the
    /// operations already queued (which may still read `id`).
    pub(crate) fn home_drop(&mut self, id: TensorId) {
        self.enqueue_record(QueuedOp::Drop(id));
    }

    /// A record of the home thread queued under the lock: noted ([`Self::note_record`]), then
    /// enqueued, which may run the queue ([`Self::enqueue`]).
    #[inline(always)]
    pub(crate) fn enqueue_record(&mut self, op: QueuedOp<R>) {
        self.note_record(&op, false);
        self.enqueue(op);
    }

    /// The last live tensor of `id` went away: the one decision between a home drop and a
    /// foreign drop, for drops and consuming reads alike.
    ///
    /// A home drop queues behind the stream's work, which needs a thread that will run it. An
    /// orphaned stream's thread is gone, and an exiting thread runs nothing any more: both free
    /// like a foreign thread does.
    pub(crate) fn release(&mut self, id: TensorId) {
        self.release_by(id, super::exec::current_stream());
    }

    /// [`Self::release`] by a thread whose stream is `current`.
    #[inline]
    pub(crate) fn release_by(&mut self, id: TensorId, current: StreamId) {
        if self.retired {
            return;
        }
        if self.is_home(current) {
            self.home_drop(id);
        } else {
            self.foreign_drop(id);
        }
    }

    /// Whether the calling thread is this stream's home thread, alive and able to run what it
    /// queues (the home/foreign decision of a last drop).
    pub(crate) fn on_home_thread(&self) -> bool {
        self.is_home(super::exec::current_stream())
    }

    /// [`Self::on_home_thread`] for a thread whose stream is `current`.
    #[inline]
    fn is_home(&self, current: StreamId) -> bool {
        current == self.id && !self.orphaned && !super::local::exiting()
    }

    /// The entry of `id` for a consuming read by its last live tensor, with `id` released in
    /// the same step. When no queued operation still names `id`, the stream's own handle is
    /// handed over (taken out of the map: the free happens now) rather than a second owner, so
    /// the reader is the buffer's only owner and a backend can give the buffer away instead of
    /// copying it (NdArray's `into_data` copies a shared array element by element). Otherwise
    /// the reader gets a second owner and `id` is released as its last drop would be.
    pub(crate) fn take_for_read(&mut self, id: TensorId, op: &str) -> Entry<R::FusionHandle> {
        // A buffer foreign to this stream is never handed over: work this stream dispatched may
        // still read it, so its handle must be released in order (see `let_go`).
        let foreign = || {
            self.handles
                .get_handle_ref(&id)
                .is_some_and(|handle| R::foreign_to(&self.context, handle, self.exec))
        };
        if self.retired || self.queue_references(id) || foreign() {
            let entry = self.entry(&id, op);
            self.release(id);
            return entry;
        }
        if self.on_home_thread() {
            self.counters.home_drops += 1;
        } else {
            self.counters.foreign_drops += 1;
        }
        self.forget_shared_source(id);
        let entry = match self.handles.remove_handle(id) {
            Some(burn_ir::Handle::Existing(handle)) => {
                self.counters.frees += 1;
                Entry::Handle(handle)
            }
            _ => {
                let entry = self.entry(&id, op);
                self.free(id);
                entry
            }
        };
        self.retire_if_orphan_empty();
        entry
    }

    /// A drop of `id`'s last live tensor from a thread that is not its home (or that cannot take
    /// the home queue right now). Never touches the queue.
    ///
    /// Frees at once unless a pending operation reads `id` or has yet to produce it; then the free
    /// waits for the pending segment, which runs when the home thread reads, syncs, shares, fills
    /// its queue (and leaves no open fused run queued) or exits — and at the latest `max_deferred_free_delay` after this drop, when the
    /// engine's service thread runs it (see `service`).
    pub(crate) fn foreign_drop(&mut self, id: TensorId) {
        self.counters.foreign_drops += 1;
        self.forget_shared_source(id);
        if !self.queue_references(id) {
            tracing::trace!(stream = %self.id, tensor = %id, "foreign drop: freed at once");
            self.free(id);
            self.retire_if_orphan_empty();
            return;
        }
        tracing::trace!(stream = %self.id, tensor = %id, "foreign drop: deferred behind a pending reader");
        self.counters.deferred_frees += 1;
        self.deferred_frees.push(id);
        if !self.flush_scheduled {
            self.flush_scheduled = true;
            let hook: Weak<dyn super::service::EngineHook> = self.engine.clone();
            super::service::flush_at(Instant::now() + self.max_deferred_free_delay, hook, self.id);
        }
    }

    /// Whether a queued operation reads `id` or produces it, or a batch running detached produces
    /// it (one that reads it holds an owner of its own: [`super::detached`]).
    pub(crate) fn queue_references(&self, id: TensorId) -> bool {
        if let Some(running) = &self.running
            && running.outputs.contains(&id)
        {
            return true;
        }
        fn names<R: StreamRuntime, B: OpBody<R> + ?Sized>(op: &B, id: TensorId) -> bool {
            op.inputs()
                .into_iter()
                .chain(op.outputs())
                .any(|t| t.id == id)
        }
        self.queue.iter().any(|op| match op {
            QueuedOp::Drop(_) => false,
            QueuedOp::Op(op, _) => names::<R, _>(&**op, id),
        })
    }

    /// Remove this stream from the engine once its thread is gone and nothing is left in it.
    pub(crate) fn retire_if_orphan_empty(&mut self) {
        if self.orphaned
            && self.is_empty()
            && let Some(engine) = self.engine.upgrade()
        {
            engine.retire(self);
        }
    }

    /// Add an operation; run the queue when it reaches its bound.
    ///
    /// The bound counts the operations the fuser has not looked at yet: an open fused run kept
    /// queued by the last flush (at most `max_fused_len` entries, see `execution`) does not
    /// count again.
    ///
    /// With [`crate::EngineConfig::dispatch_closed_runs`], a fusing stream offers the operation
    /// to its fuser now, and runs the queue as soon as the fuser closes a run.
    #[inline]
    pub(crate) fn enqueue(&mut self, op: QueuedOp<R>) {
        self.queue.push_back(op);
        let closed = self.dispatch_closed_runs && self.fusing() && self.offer_queued();
        let full = !closed && self.queue.len() - self.plan.scanned() >= self.max_queue_len;
        if closed || full {
            self.dispatch_queued(closed);
        }
    }

    /// An operation (or a last drop) this stream's own thread recorded without the lock, through
    /// its lane or (a stream that fuses) posted while another thread held the lock
    /// ([`InboxMessage::Record`](super::cell::InboxMessage::Record)), applied by whoever holds the
    /// lock now; `posted`: that holder is another thread (it counts in
    /// [`super::EngineStats::ops_posted`]). It is queued in the order it was recorded, but
    /// neither offered to the fuser nor dispatched here: the holder may be another stream's
    /// thread, there to share or read a tensor, and running this stream's work is the home
    /// thread's — its next record under the lock offers and dispatches it, and a read, share or
    /// sync drains it. (The home thread hands over at most a queue bound's worth in a row:
    /// `StreamCell::hand_over`, `StreamCell::may_post`.)
    #[inline]
    pub(crate) fn record_posted(&mut self, op: QueuedOp<R>, posted: bool) {
        // The poster was the live home thread, not yet exiting; the exit hook that could retire
        // this state takes the lock, and so applies this record, first.
        debug_assert!(!self.retired, "a record handed over to a retired stream");
        self.note_record(&op, posted);
        self.queue.push_back(op);
    }

    /// [`Self::enqueue`]'s dispatch of a closed run or a full queue.
    #[inline(never)]
    fn dispatch_queued(&mut self, closed: bool) {
        // An exiting thread runs nothing (see `local`): its stream is drained by the service
        // thread instead.
        if super::local::exiting() {
            return;
        }
        if closed {
            self.counters.closed_runs += 1;
            tracing::trace!(stream = %self.id, ops = self.queue.len(), "a run closed: dispatched");
        } else {
            self.counters.lazy_flushes += 1;
            tracing::trace!(stream = %self.id, ops = self.queue.len(), "lazy flush: queue bound reached");
        }
        self.execute_lazily();
    }

    /// Run the pending segment, then the frees that were waiting for it.
    pub(crate) fn drain(&mut self) {
        if !self.queue.is_empty() {
            self.counters.drains += 1;
            tracing::trace!(stream = %self.id, ops = self.queue.len(), "drain");
        }
        self.execute_all();
    }

    /// [`StreamState::drain`] for the current thread: a drain by another stream's thread is
    /// [foreign](crate::runtime::Cut::Foreign) to the runs it cuts here.
    pub(crate) fn drain_here(&mut self) {
        self.cut_by_current_thread(Self::drain);
    }

    /// Make sure `id` is produced, draining if its producer is still queued (for the current
    /// thread: [`StreamState::drain_here`]). Returns whether a drain ran.
    ///
    /// Another thread's drain runs the queue only through `id`'s producer
    /// ([`StreamState::execute_through`]); the home thread's runs all of it.
    pub(crate) fn materialise(&mut self, id: &TensorId) -> bool {
        if self.is_materialised(id) || self.queue.is_empty() {
            return false;
        }
        match self.producer_position(id) {
            Some(at) if super::exec::current_stream() != self.id => {
                self.counters.drains += 1;
                tracing::trace!(stream = %self.id, ops = at + 1, left = self.queue.len() - at - 1, "drain through a shared tensor");
                self.cut_by_current_thread(|state| state.execute_through(at + 1));
            }
            _ => self.drain_here(),
        }
        true
    }

    /// Run `drain` with the runs it cuts marked as cut by the current thread:
    /// [own](crate::runtime::Cut::Own) on the home thread, [foreign](crate::runtime::Cut::Foreign)
    /// on any other.
    fn cut_by_current_thread(&mut self, drain: impl FnOnce(&mut Self)) {
        use crate::runtime::Cut;
        let cut = if super::exec::current_stream() == self.id {
            Cut::Own
        } else {
            Cut::Foreign
        };
        self.drain_cutting_as(cut, drain);
    }

    /// The engine's service thread drains the stream: for its exiting thread, or at a deferred
    /// free's deadline. The runs it cuts count as [foreign](crate::runtime::Cut::Foreign): a
    /// deadline comes when the clock says, and a thread exits once, where its last run was cut
    /// open by whatever came before — by other threads' shares, on a producer — so a kernel
    /// built for that run would seldom run again (compiling one for the exit of a producer whose
    /// results a consumer shares took 85–333 ms of the consumer's next read on the H200:
    /// docs/BENCHMARKS.md, "Exit cuts").
    pub(crate) fn drain_for_service(&mut self) {
        self.drain_cutting_as(crate::runtime::Cut::Foreign, Self::drain);
    }

    fn drain_cutting_as(&mut self, cut: crate::runtime::Cut, drain: impl FnOnce(&mut Self)) {
        self.cut = cut;
        drain(self);
        self.cut = crate::runtime::Cut::Own;
    }

    /// The queue index of the operation that produces `id`, if one is queued.
    fn producer_position(&self, id: &TensorId) -> Option<usize> {
        self.queue.iter().position(|entry| match entry {
            QueuedOp::Drop(_) => false,
            QueuedOp::Op(op, _) => op.outputs().iter().any(|out| out.id == *id),
        })
    }
}
