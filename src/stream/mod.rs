//! The multi-stream engine: per-thread lazy queues, shared views, foreign drops.

mod batch_pool;
mod cell;
mod detached;
mod exec;
mod execution;
mod gate;
pub(crate) mod inbox;
mod lane;
mod local;
mod service;
mod state;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use burn_backend::StreamId;
use burn_ir::TensorId;
use hashbrown::HashMap;
use parking_lot::{Mutex, RwLock};

pub(crate) use cell::{InboxMessage, StreamCell, StreamGuard, in_engine};
pub(crate) use exec::{
    current_stream, executes, execution_stream, execution_streams, on_execution_stream,
};
pub(crate) use gate::enter as enter_gate;
use service::EngineHook;
pub(crate) use state::{Entry, StreamCounters, StreamState};

use crate::operation::{IntoQueued, OpBody, QueuedOp};
use crate::runtime::StreamRuntime;
use crate::{Error, Result};

/// The current stream's cell, as [`MultiStream::recording_target`] finds it: an operand's home,
/// borrowed without touching its count, or the thread's own.
pub(crate) enum Target<R: StreamRuntime> {
    Home(CellRef<R>),
    Found(Arc<StreamCell<R>>),
}

impl<R: StreamRuntime> Target<R> {
    #[inline]
    pub(crate) fn cell(&self) -> &StreamCell<R> {
        match self {
            Target::Home(cell) => cell.get(),
            Target::Found(cell) => cell,
        }
    }

    /// Whether `cell` is this target's cell.
    #[inline]
    pub(crate) fn is(&self, cell: &Arc<StreamCell<R>>) -> bool {
        std::ptr::eq(self.cell(), Arc::as_ptr(cell))
    }

    /// A counted pointer to the cell, for a tensor that stays on it.
    #[inline]
    pub(crate) fn to_arc(&self) -> Arc<StreamCell<R>> {
        match self {
            Target::Home(cell) => cell.to_arc(),
            Target::Found(cell) => cell.clone(),
        }
    }
}

/// A stream cell borrowed from an `Arc` that something else keeps alive, without the locked
/// increment and decrement of a clone: what [`crate::FusionClient`]'s registration holds of its
/// first operand's home while it moves that operand, maybe into an output (which keeps the
/// cell). It holds no count, so it is made only with [`CellRef::borrowed`]'s promise.
/// (Its copies are bound by the same promise.)
pub(crate) struct CellRef<R: StreamRuntime>(std::ptr::NonNull<StreamCell<R>>);

impl<R: StreamRuntime> Clone for CellRef<R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: StreamRuntime> Copy for CellRef<R> {}

impl<R: StreamRuntime> CellRef<R> {
    /// `cell`, borrowed without its count.
    ///
    /// # Safety
    ///
    /// An `Arc` of the same cell must live for as long as the returned value is used.
    #[inline]
    pub(crate) unsafe fn borrowed(cell: &Arc<StreamCell<R>>) -> Self {
        // `Arc::as_ptr` is never null; the pointer is taken from the allocation, not through a
        // reference, so moving or mutating the tensor that holds `cell` does not retire it.
        Self(std::ptr::NonNull::new(Arc::as_ptr(cell).cast_mut()).expect("an Arc is not null"))
    }

    #[inline]
    fn get(&self) -> &StreamCell<R> {
        // SAFETY: an `Arc` of the cell lives while `self` is used (`borrowed`'s contract), and
        // nothing takes a mutable reference into an `Arc`'s shared value.
        unsafe { self.0.as_ref() }
    }

    /// A counted pointer to the cell.
    #[inline]
    pub(crate) fn to_arc(self) -> Arc<StreamCell<R>> {
        let ptr = self.0.as_ptr().cast_const();
        // SAFETY: `ptr` came from `Arc::as_ptr` of an `Arc` that still lives (`borrowed`'s
        // contract), so adding a count and taking it as an `Arc` of its own is sound.
        unsafe {
            Arc::increment_strong_count(ptr);
            Arc::from_raw(ptr)
        }
    }
}

/// Engine settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineConfig {
    /// Queue length at which a stream executes what it has, without waiting for a read, a share
    /// or a sync. Bounds the memory of pending work. At least 1. (A fusing stream that
    /// [dispatches closed runs](EngineConfig::dispatch_closed_runs) rarely reaches it: what it
    /// holds is one open run, bounded by `max_fused_len`.)
    pub max_queue_len: usize,
    /// The longest a foreign drop's free may wait for the home stream's pending segment (which
    /// still reads the dropped tensor) before the engine's service thread runs that segment
    /// itself: the bound on how long an idle home thread can hold a dropped buffer, plus the
    /// service thread's scheduling latency. Default 10 ms.
    pub max_deferred_free_delay: Duration,
    /// How long a thread may leave work queued on its stream without calling into the engine
    /// before the engine's service thread runs that work itself: the bound on how long a thread
    /// that went idle (a producer blocked on its channel, an idle rayon worker) holds queued
    /// work and the buffers it reads. The service thread looks at every stream this often, and
    /// runs a queue that was there, unchanged, the time before: so within about twice this
    /// delay. Default 50 ms; `Duration::MAX` never.
    pub max_idle_delay: Duration,
    /// Whether streams fuse their queued operations into fewer kernels where the runtime can
    /// (see [`crate::runtime::Fuser`]). Default on; a runtime that does not fuse ignores it.
    pub fusion: bool,
    /// The longest run of operations one fused kernel may cover. When a stream reaches
    /// `max_queue_len`, a run the fuser could still extend stays queued (so that one kernel
    /// covers it, as burn-fusion does until its fuser closes) until it reaches this length or
    /// the stream drains. Bounds the pending work a fusing stream holds, and the size of a
    /// fused kernel. Default 512; at least `max_queue_len`.
    pub max_fused_len: usize,
    /// Whether a fusing stream dispatches a run the moment it closes. Each operation is offered
    /// to the stream's fuser as it is recorded; when the fuser refuses one, the run before it
    /// can grow no more, so it is dispatched then (and an operation no fuser takes is
    /// dispatched at once), while the new, open run stays queued. The fused kernels are the same
    /// either way; what changes is that the device starts on a closed run while the thread
    /// records the next one, instead of after `max_queue_len` more operations. Default on; off,
    /// a fusing stream waits for `max_queue_len` like one that does not fuse.
    pub dispatch_closed_runs: bool,
    /// How many threads may run work on the device at once: execute their streams' queues, or
    /// upload. The others wait, asleep, for a turn (at most a millisecond, then they go ahead).
    /// `None` (the default) leaves it to the runtime ([`StreamRuntime::launching_threads`]):
    /// half the machine's hardware threads on a CUDA device, whose launches cubecl 0.10 all
    /// hands to one device thread, where more launching threads only slow each other down; no
    /// bound on NdArray, which runs each operation on the thread that executes it. `Some(n)`
    /// lets `n` through (at least 1); `Some(usize::MAX)` sets no bound. Reads and syncs are never
    /// held back: they wait for the device, and launch nothing more.
    pub max_launching_threads: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_queue_len: 32,
            max_deferred_free_delay: Duration::from_millis(10),
            max_idle_delay: Duration::from_millis(50),
            fusion: true,
            max_fused_len: 512,
            dispatch_closed_runs: true,
            max_launching_threads: None,
        }
    }
}

impl EngineConfig {
    /// Settings with the given queue bound (clamped to at least 1).
    pub fn with_max_queue_len(mut self, max_queue_len: usize) -> Self {
        self.max_queue_len = max_queue_len.max(1);
        self
    }

    /// Settings with the given bound on fused runs (see [`EngineConfig::max_fused_len`]).
    pub fn with_max_fused_len(mut self, max_fused_len: usize) -> Self {
        self.max_fused_len = max_fused_len;
        self
    }

    /// Settings that dispatch closed runs at once, or not (see
    /// [`EngineConfig::dispatch_closed_runs`]).
    pub fn with_dispatch_closed_runs(mut self, dispatch: bool) -> Self {
        self.dispatch_closed_runs = dispatch;
        self
    }

    /// Settings with fusion on or off (see [`EngineConfig::fusion`]).
    pub fn with_fusion(mut self, fusion: bool) -> Self {
        self.fusion = fusion;
        self
    }

    /// Settings letting at most `n` threads run work on the device at once (see
    /// [`EngineConfig::max_launching_threads`]; `usize::MAX`: no bound).
    pub fn with_max_launching_threads(mut self, n: usize) -> Self {
        self.max_launching_threads = Some(n.max(1));
        self
    }

    /// Settings with the given bound on deferred frees (see
    /// [`EngineConfig::max_deferred_free_delay`]).
    pub fn with_max_deferred_free_delay(mut self, delay: Duration) -> Self {
        self.max_deferred_free_delay = delay;
        self
    }

    /// Settings with the given bound on work an idle thread leaves queued (see
    /// [`EngineConfig::max_idle_delay`]).
    pub fn with_max_idle_delay(mut self, delay: Duration) -> Self {
        self.max_idle_delay = delay;
        self
    }
}

/// What the engine did and what it holds, summed over its streams.
///
/// Counters (`ops_*`, `drains`, `shares`, ...) only grow. Gauges (`streams`, `pending_ops`,
/// `live_handles`, `error_records`, `shared_sources`) describe the moment of the snapshot. A
/// snapshot taken while other threads work is a sum of per-stream snapshots, not one atomic view.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineStats {
    /// Streams with state in the engine.
    pub streams: usize,
    /// Operations queued and not yet executed.
    pub pending_ops: usize,
    /// Backend handles held (originals and views).
    pub live_handles: usize,
    /// Error records held (tensors whose producer failed).
    pub error_records: usize,
    /// Size of `shared_sources`, over all streams.
    pub shared_sources: usize,
    /// Frees waiting for a pending segment to run.
    pub deferred_frees_pending: usize,
    /// Operations registered (drops not included).
    pub ops_registered: u64,
    /// Operations executed (including skipped and failed ones).
    pub ops_executed: u64,
    /// Operations whose executor failed or panicked.
    pub ops_failed: u64,
    /// Operations skipped because an input carried an error.
    pub ops_skipped: u64,
    /// Times a queue reached its bound (counting only entries its fuser had not yet planned)
    /// and executed.
    pub lazy_flushes: u64,
    /// Times a fusing stream's fuser closed a run and the stream dispatched it at once
    /// ([`EngineConfig::dispatch_closed_runs`]).
    pub closed_runs: u64,
    /// Drains that executed a non-empty queue (reads, syncs, shares).
    pub drains: u64,
    /// Shares of a source with no handle yet, which drained the source's stream.
    pub share_drains: u64,
    /// Shared views created (cross-stream clones and foreign operands).
    pub shares: u64,
    /// Shares that found the source already materialised and skipped the drain.
    pub share_fast_paths: u64,
    /// Last-tensor drops on the home thread (enqueued frees).
    pub home_drops: u64,
    /// Last-tensor drops from other threads (or from inside the engine).
    pub foreign_drops: u64,
    /// Foreign drops that had to wait for a pending segment.
    pub deferred_frees: u64,
    /// Handles and error records released.
    pub frees: u64,
    /// Pending segments the service thread ran because a deferred free reached
    /// [`EngineConfig::max_deferred_free_delay`] with its home thread idle.
    pub deferred_flushes: u64,
    /// Queues the service thread ran because their thread had recorded nothing for
    /// [`EngineConfig::max_idle_delay`] with work queued.
    pub idle_flushes: u64,
    /// Batches run on the engine's batch pool (holding an operation that spreads over the
    /// backend's thread pool: [`crate::runtime::BatchPlacement::BatchPool`]).
    pub batches_pooled: u64,
    /// Of those, the ones run detached from their stream, without its lock, because another
    /// thread had waited for the stream's lock since its last pooled batch (a stream whose
    /// tensors other threads share or read; docs/ARCHITECTURE.md, "Locks and waits").
    pub batches_detached: u64,
    /// Fused kernels launched (each covers a run of queued operations).
    pub fused_kernels: u64,
    /// Operations executed inside fused kernels (counted in `ops_executed` too).
    pub ops_fused: u64,
    /// Runs a drain cut before their fuser closed them that ran unfused, because the fuser
    /// declined them ([`crate::runtime::Fuser::fuse_cut_run`]).
    pub cut_runs_unfused: u64,
    /// Times a stream was made to wait on the device for another's work before using one of its
    /// buffers (a share or a read on a runtime whose buffers can be foreign to a stream, see
    /// [`StreamRuntime::order_use`]).
    pub orders: u64,
    /// Shares and reads that needed no such wait: their stream had waited for the buffer's
    /// stream since that stream last dispatched anything.
    pub orders_skipped: u64,
    /// Operations a thread recorded on its own stream without its lock that another thread
    /// queued (holding the lock to share or read one of its tensors): handed over without
    /// waiting, and queued in order by the lock's holder (see [`MultiStream`], "Recording takes
    /// no lock", "Recording never waits for a drain").
    pub ops_posted: u64,
    /// Times a thread found every permit of the engine's launch gate taken and slept for one
    /// ([`EngineConfig::max_launching_threads`]; always 0 without a bound).
    pub launch_waits: u64,
    /// Of those waits, the ones that ended after the gate's patience (1 ms) with the thread
    /// going ahead without a permit: how often more threads than the bound were launching.
    pub launch_overdrafts: u64,
    /// Streams left out of this snapshot because it was taken from inside an executing
    /// operation while their lock was held (always 0 outside the engine).
    pub streams_skipped: usize,
}

impl EngineStats {
    fn add_counters(&mut self, c: &StreamCounters) {
        self.ops_registered += c.ops_registered;
        self.ops_executed += c.ops_executed;
        self.ops_failed += c.ops_failed;
        self.ops_skipped += c.ops_skipped;
        self.lazy_flushes += c.lazy_flushes;
        self.closed_runs += c.closed_runs;
        self.drains += c.drains;
        self.share_drains += c.share_drains;
        self.shares += c.shares;
        self.share_fast_paths += c.share_fast_paths;
        self.home_drops += c.home_drops;
        self.foreign_drops += c.foreign_drops;
        self.deferred_frees += c.deferred_frees;
        self.frees += c.frees;
        self.deferred_flushes += c.deferred_flushes;
        self.idle_flushes += c.idle_flushes;
        self.batches_pooled += c.batches_pooled;
        self.batches_detached += c.batches_detached;
        self.fused_kernels += c.fused_kernels;
        self.ops_fused += c.ops_fused;
        self.cut_runs_unfused += c.cut_runs_unfused;
        self.orders += c.orders;
        self.orders_skipped += c.orders_skipped;
        self.ops_posted += c.ops_posted;
    }

    /// Nothing held: no handle, no error record, no pending work, no `shared_sources` entry.
    pub fn is_quiescent(&self) -> bool {
        self.pending_ops == 0
            && self.live_handles == 0
            && self.error_records == 0
            && self.shared_sources == 0
            && self.deferred_frees_pending == 0
    }
}

/// What a use of a buffer on a stream needs before it ([`MultiStream::plan_order`]).
enum Order {
    /// Nothing: the buffer is the stream's own, or the stream waited for its writes already.
    Covered,
    /// A wait for the stream that allocated the buffer; `stamp` is the holder's
    /// [`StreamState::stamp`] to remember after it, when that stamp describes the buffer's writes.
    Wait { stamp: Option<u64> },
}

/// A queued entry, as returned by [`MultiStream::pending`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Pending {
    /// An operation, as burn's IR records it.
    Operation(Box<burn_ir::OperationIr>),
    /// A free of the tensor's handle (the last drop on its home thread).
    Drop(TensorId),
}

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

/// Keep track of multiple concurrent lazy streams of operations.
///
/// # Why this exists
///
/// Each stream holds a lazy queue of operations whose inputs are assumed to live on that stream:
/// every [`TensorId`] in a queue resolves in that stream's handle map, against that stream's
/// pending chain. But a [`crate::FusionTensor`] is `Send + Clone`, so user code moves and clones
/// tensors from one thread (one [`StreamId`]) to another, and the receiving thread then submits
/// operations that read a tensor whose home is another stream. This type makes that case correct
/// without giving up stream locality.
///
/// # Strategy: shared views
///
/// A foreign-stream id never appears in another stream's queue. When a tensor is cloned on, or
/// used as an operand by, a thread whose current stream is not the tensor's home, the engine mints
/// a fresh id `dst` on the current stream and *tags a shared view* of the source `src`:
///
/// 1. **Materialise `src`.** If `src` has neither a handle nor an error record yet, its producer is
///    still queued on the source stream, so that stream is drained through `src`'s producer (its
///    pending operations up to that one run, on the source stream, from this thread; what the
///    source recorded after it stays queued for the source's own thread). `src` is then noted in `shared_sources` (the
///    sources a share had to drain, reported by [`EngineStats::shared_sources`]). Later shares
///    skip the drain because `src` now has a handle or an error record: that test alone decides,
///    and the set is never read to decide it.
/// 2. **Alias the handle under `dst`.** `dst` is registered on the current stream with a second
///    owner of the source's backend handle ([`StreamRuntime::alias`]). Both ids now point at the
///    same buffer; it lives until the last alias is freed. If `src` carries an error instead, the
///    error is registered under `dst`: a share of an errored tensor carries its error.
///
/// The view is an ordinary local tensor from then on.
///
/// # Freeing
///
/// Each tensor frees its id on its own home stream. On the home thread the last drop enqueues a
/// drop behind the pending operations (which may still read the id). From any other thread it is
/// a *foreign drop*, which never touches the home queue and never waits for the home's lock (it is
/// posted to the home's inbox and applied by whoever holds or next takes that lock): it frees at
/// once unless a pending
/// operation there reads the id (or has yet to produce it), and otherwise defers the free until
/// the pending segment has run — which the home thread does when it reads, syncs, shares, fills
/// its queue or exits, and the engine's service thread does at the latest
/// [`EngineConfig::max_deferred_free_delay`] after the drop, so an idle home thread cannot hold a
/// dropped buffer. An original and its views are separate ids on separate streams, each freed by
/// its own side; the buffer goes with the last one. A thread that exits drains the streams it
/// used (on the service thread, as is anything a later thread-local destructor does with the
/// engine), so deferred frees and queued work never outlive it.
///
/// # Bounding `shared_sources`
///
/// An entry leaves `shared_sources` the moment the last live tensor of its id goes away —
/// dropped on the home thread, dropped on a foreign thread, consumed by an operation (a
/// `ReadWrite` use) or consumed by a read — without waiting for the free to run. The set is
/// bookkeeping (it counts in [`EngineStats::shared_sources`]); no drain decision reads it, so
/// removing an entry can neither cause nor skip a drain.
///
/// # The SSA invariant
///
/// Every operation output is a fresh id from a process-wide allocator ([`crate::id`]); a
/// registered handle is never overwritten, except by an error record when its producer fails.
/// Once `src` has a handle, nothing changes it, which is what makes skipping the drain on later
/// shares sound. Debug builds check that every output is fresh before its operation runs.
///
/// In-place reuse of an input buffer is gated by [`StreamRuntime::can_mut`], which is false while
/// a view holds a second owner: aliased buffers are never written in place.
///
/// # Devices whose streams do not order each other
///
/// On a device whose streams are ordered only within themselves (CUDA under cubecl 0.10), a
/// buffer used on a stream other than the one that wrote it needs the engine's help, and the
/// engine knows every such point. When a view is registered, or a tensor is read, on a stream
/// the buffer is foreign to, the runtime makes that stream wait for the buffer's writes
/// ([`StreamRuntime::order_use`]); an operation that consumes a foreign buffer gets a second owner
/// of it for the call, so it is never written in place; and every handle of a foreign buffer the
/// stream lets go of is handed to [`StreamRuntime::release_after_use`] when the stream's lock is
/// released, so its memory is not reused before the stream's work on it has run.
///
/// # The chained-share fast path
///
/// Re-sharing a view (owner → peer → grandpeer) finds the peer's id already registered — the view
/// was registered directly, not produced by a queued operation — so the drain is skipped by the
/// handle-existence test alone, even though the peer id never entered `shared_sources`.
///
/// # Where this implementation differs from burn-fusion's, and why
///
/// * **One handle map per stream, not per device.** Stream locality already means every id lives
///   in exactly one stream's map, so the map partitions for free. Each stream has its own lock;
///   threads working on their own streams never contend, and cross-stream work (a share, a foreign
///   drop) takes the two locks one after the other, never nested.
/// * **An operand is let go only after its operation is recorded.** The caller holds every
///   operand until the operation is in the stream's lane or queue, so a last drop on another
///   thread (posted to the inbox, which is applied after the lane) lands behind the operation.
///   burn's `FusionTensor::into_ir` decides `ReadOnly` and drops the tensor *before* the operation
///   is enqueued, so a concurrent last drop on another thread can free the id first ("Should have
///   handle for tensor").
/// * **Drops and clones never block on a lock their thread holds.** Inside an executing operation,
///   or while unwinding out of the engine, they post to the target stream's inbox instead (see
///   `StreamCell`), and public calls return [`Error::Reentrant`].
/// * **Errors travel with the data** (see [`crate::Error`]); `drain` reports nothing.
pub struct MultiStream<R: StreamRuntime> {
    key: u64,
    config: EngineConfig,
    context: Arc<R::Context>,
    streams: RwLock<HashMap<StreamId, Arc<StreamCell<R>>>>,
    /// Counters of retired streams, so the totals never go backwards.
    retired: Mutex<StreamCounters>,
    /// Whether streams fuse now (see [`MultiStream::set_fusion`]); shared with every stream.
    fusion: Arc<AtomicBool>,
    /// The bound on threads running work on the device at once, if there is one (see
    /// [`EngineConfig::max_launching_threads`]); shared with every stream.
    gate: Option<Arc<gate::LaunchGate>>,
    this: Weak<Self>,
}

impl<R: StreamRuntime> MultiStream<R> {
    pub(crate) fn new(config: EngineConfig, context: Arc<R::Context>) -> Arc<Self> {
        service::start();
        let launching = config
            .max_launching_threads
            .or_else(|| R::launching_threads(&context))
            .filter(|&n| n != usize::MAX);
        let gate = launching.map(|n| Arc::new(gate::LaunchGate::new(n)));
        let engine = Arc::new_cyclic(|this| Self {
            key: NEXT_ENGINE.fetch_add(1, Ordering::Relaxed),
            context,
            config: EngineConfig {
                max_queue_len: config.max_queue_len.max(1),
                max_fused_len: config.max_fused_len.max(config.max_queue_len.max(1)),
                ..config
            },
            streams: RwLock::new(HashMap::new()),
            retired: Mutex::new(StreamCounters::default()),
            fusion: Arc::new(AtomicBool::new(config.fusion)),
            gate,
            this: this.clone(),
        });
        service::sweep_every(config.max_idle_delay, engine.hook());
        engine
    }

    /// The engine's settings (with [`EngineConfig::fusion`] as it is now, and
    /// [`EngineConfig::max_launching_threads`] the bound in force: `Some(usize::MAX)` for none).
    pub fn config(&self) -> EngineConfig {
        EngineConfig {
            fusion: self.fusion_on(),
            max_launching_threads: Some(self.gate.as_ref().map_or(usize::MAX, |g| g.limit())),
            ..self.config
        }
    }

    /// The bound on threads running work on the device at once, if there is one.
    pub(crate) fn launch_gate(&self) -> Option<&gate::LaunchGate> {
        self.gate.as_deref()
    }

    /// Whether fusion is on now (see [`EngineConfig::fusion`]); one relaxed load.
    #[inline]
    pub fn fusion_on(&self) -> bool {
        self.fusion.load(Ordering::Relaxed)
    }

    /// Turn fusion on or off for every stream, from their next drain on (see
    /// [`EngineConfig::fusion`]). For comparing fused and unfused runs in one process.
    pub fn set_fusion(&self, on: bool) {
        self.fusion.store(on, Ordering::Relaxed);
    }

    fn hook(&self) -> Weak<dyn EngineHook> {
        self.this.clone()
    }

    /// The state of stream `id`, created on first use.
    fn cell(&self, id: StreamId) -> Arc<StreamCell<R>> {
        if let Some(cell) = self.streams.read().get(&id) {
            return cell.clone();
        }
        self.streams
            .write()
            .entry(id)
            .or_insert_with(|| {
                let serial = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed);
                let exec = exec::execution_stream();
                Arc::new(StreamCell::new(StreamState::new(id, exec, serial, self)))
            })
            .clone()
    }

    /// The state of the current thread's stream.
    pub(crate) fn current(&self) -> Arc<StreamCell<R>> {
        let id = exec::current_stream();
        if let Some(cell) = local::cached::<StreamCell<R>>(self.key, id) {
            return cell;
        }
        let cell = self.cell(id);
        local::cache(self.key, id, &cell);
        local::on_exit(self.key, self.hook(), id);
        cell
    }

    /// Run `f` with the current stream locked. Retries with a fresh state if the cached one was
    /// retired in the meantime. `home` is a stream the caller holds, tried first when it is the
    /// current one (an operand's home): that saves the thread-local lookup of the current stream.
    ///
    /// On a thread that is exiting (a thread-local destructor running after the engine's exit
    /// hook), whatever `f` did is handed to the service thread right after, exactly as the exit
    /// hook hands the thread's streams over: queued work runs, and the stream is retired or
    /// orphaned, so nothing is stranded on a stream whose thread is gone.
    fn with_current<T>(
        &self,
        home: Option<(&Arc<StreamCell<R>>, StreamId)>,
        f: impl FnOnce(&Arc<StreamCell<R>>, &mut StreamState<R>) -> T,
    ) -> T {
        // Every cell of this thread's stream was made by `current`, which also arranged its
        // exit drain; a cell whose state was retired is passed over like a stale cache entry.
        let mut home = home.and_then(|(cell, current)| (cell.id == current).then_some(cell));
        loop {
            let found;
            let cell = match home.take() {
                Some(cell) => cell,
                None => {
                    found = self.current();
                    &found
                }
            };
            let mut state = cell.lock();
            if state.retired {
                drop(state);
                local::evict(self.key);
                continue;
            }
            let out = f(cell, &mut state);
            drop(state);
            if local::exiting() && !in_engine() {
                service::exit_drain(self.hook(), cell.id);
            }
            return out;
        }
    }

    /// Lock `home` with `id` produced, draining `home` first if `id`'s producer is still queued.
    /// Returns whether a drain ran.
    ///
    /// An exiting thread does not execute operations itself: the drain runs on the service
    /// thread.
    fn lock_materialised<'a>(
        &self,
        home: &'a Arc<StreamCell<R>>,
        id: &TensorId,
    ) -> (StreamGuard<'a, R>, bool) {
        if local::exiting() {
            let state = home.lock_idle();
            if state.is_materialised(id) || state.queue.is_empty() {
                return (state, false);
            }
            drop(state);
            service::drain(self.hook(), home.id);
            return (home.lock_idle(), true);
        }
        let mut state = home.lock();
        if state.is_materialised(id) {
            // A tensor the stream holds is shared at once, even while a batch runs detached.
            return (state, false);
        }
        if state.running.is_some() {
            drop(state);
            state = home.lock_idle();
        }
        let drained = state.materialise(id);
        (home.settled(state), drained)
    }

    /// The stream an operation this thread records goes to: `home` (an operand's home stream)
    /// when it is the current stream, else the current stream's cell. `None` on an exiting
    /// thread, which records through [`Self::register`] instead.
    ///
    /// While the thread is not exiting its stream's state cannot be retired (retirement needs
    /// the thread's exit hook, which runs only once it is exiting), so [`Self::record`] on the
    /// cell returned here never meets a stale state.
    #[inline]
    pub(crate) fn recording_target(
        &self,
        home: Option<CellRef<R>>,
        current: StreamId,
    ) -> Option<Target<R>> {
        if local::exiting() {
            return None;
        }
        Some(match home {
            Some(cell) if cell.get().id == current => Target::Home(cell),
            _ => Target::Found(self.current()),
        })
    }

    /// Record an operation on `cell`, the current stream ([`Self::recording_target`]). The
    /// operands it consumes (`ReadWrite`) leave `shared_sources` when it is queued. The
    /// operation is recorded before the caller lets go of its operands, which is what keeps a
    /// concurrent last drop on another thread from freeing one first: that drop is applied
    /// after the record. If the queue reaches its bound, the stream executes what it has (but
    /// for a trailing run its fuser still extends: [`EngineConfig::max_fused_len`]).
    ///
    /// # Recording takes no lock
    ///
    /// On a stream without a fuser, the operation goes into the stream's lane (`lane`), which
    /// only this thread writes and whoever takes the lock next
    /// drains into the queue, in order, before anything else: no locked instruction, and no wait
    /// while another thread holds the lock (draining the stream to share or read one of its
    /// tensors). Every queue bound's worth, the record goes under the lock instead, and runs the
    /// queue as the bound asks. A stream that fuses records under the lock, so that its fuser
    /// sees each operation as it comes.
    ///
    /// # Recording never waits for a drain
    ///
    /// When another thread holds a fusing stream's lock, the operation is not made to wait
    /// either: it is posted to the stream's inbox
    /// ([`InboxMessage::Record`]), which the holder applies before it lets go — queued in order,
    /// behind everything recorded before it and ahead of any later drop or share, which all go
    /// through the same lock or the same inbox. A producer thread then keeps recording while a
    /// consumer runs what it needs, where it would otherwise wait out every such drain.
    #[inline]
    pub(crate) fn record<B: IntoQueued<R>>(&self, cell: &StreamCell<R>, body: B) {
        let _timer = crate::profile::time(crate::profile::Section::Record);
        Self::record_queued(cell, body.into_queued());
    }

    /// [`Self::record`] of a queue entry: an operation, or the home thread's last drop of an
    /// id ([`Self::release`]).
    #[inline(always)]
    fn record_queued(cell: &StreamCell<R>, record: QueuedOp<R>) {
        if let Err(record) = cell.hand_over(record) {
            Self::record_under_lock(cell, record);
        }
    }

    /// [`Self::record_queued`] of a record that did not go through the lane.
    #[inline(never)]
    fn record_under_lock(cell: &StreamCell<R>, record: QueuedOp<R>) {
        match cell.try_lock() {
            Some(state) => Self::record_locked(cell, state, record),
            None => Self::post_record(cell, record),
        }
    }

    /// [`Self::record`] with the lock held.
    #[inline(always)]
    fn record_locked(cell: &StreamCell<R>, mut state: StreamGuard<'_, R>, op: QueuedOp<R>) {
        cell.held_by_home();
        debug_assert!(!state.retired, "the current stream of a live thread");
        state.enqueue_record(op);
    }

    /// [`Self::record`] while another thread holds the stream's lock: posted, unless a queue
    /// bound's worth was handed over in a row ([`StreamCell::may_post`]); then recorded once the
    /// lock is free.
    #[cold]
    #[inline(never)]
    fn post_record(cell: &StreamCell<R>, record: QueuedOp<R>) {
        if cell.may_post() {
            cell.post(InboxMessage::Record(record));
        } else {
            Self::record_locked(cell, cell.lock(), record);
        }
    }

    /// Register an operation on the current stream of an exiting thread (see
    /// [`Self::recording_target`]).
    ///
    /// `commit` runs first, in the same critical section: it settles the operands (a `ReadWrite`
    /// operand is released to the operation) and builds the outputs. Then the operation is
    /// enqueued, as [`Self::record`] does, and its consumed operands leave `shared_sources`.
    /// `home` is an operand's home stream, with the current stream's id (see `with_current`).
    pub(crate) fn register<B: IntoQueued<R>, T>(
        &self,
        home: Option<(&Arc<StreamCell<R>>, StreamId)>,
        body: B,
        commit: impl FnOnce(&Arc<StreamCell<R>>, &B) -> T,
    ) -> T {
        let _timer = crate::profile::time(crate::profile::Section::Record);
        self.with_current(home, |cell, state| {
            let settled = commit(cell, &body);
            state.enqueue_record(body.into_queued());
            settled
        })
    }

    /// Register a handle or an error record under the fresh id `id` on the current stream (an
    /// upload). Returns the stream that is now `id`'s home.
    pub(crate) fn register_entry(
        &self,
        id: TensorId,
        entry: Entry<R::FusionHandle>,
    ) -> Arc<StreamCell<R>> {
        self.with_current(None, |cell, state| {
            state.register_entry(id, entry);
            cell.clone()
        })
    }

    /// Run stream `id`'s pending segment to completion.
    ///
    /// Reports nothing. An operation that fails leaves its error on the tensors it was going to
    /// write, so it is delivered by the read of one of those tensors — where a caller is actually
    /// waiting for that data — and not to whoever happened to drain the stream next. Called from
    /// inside an executing operation it does nothing (it would have to wait for itself).
    pub fn drain(&self, id: StreamId) {
        if in_engine() {
            return;
        }
        let id = exec::engine_stream(id);
        if local::exiting() {
            service::drain(self.hook(), id);
            return;
        }
        let cell = self.streams.read().get(&id).cloned();
        if let Some(cell) = cell {
            cell.lock_idle().drain_here();
        }
    }

    /// Drain every stream of this engine.
    pub fn drain_all(&self) {
        if in_engine() {
            return;
        }
        for cell in self.cells() {
            if local::exiting() {
                service::drain(self.hook(), cell.id);
            } else {
                cell.lock_idle().drain_here();
            }
        }
    }

    /// Lock `cell` for inspection: from inside the engine only if the lock is free (the
    /// executing thread holds at least one stream lock, and waiting for another could deadlock
    /// with a thread that holds that one and waits for ours).
    fn inspect(cell: &StreamCell<R>) -> Option<StreamGuard<'_, R>> {
        if in_engine() {
            cell.try_lock()
        } else {
            Some(cell.lock())
        }
    }

    fn inspected<T>(
        &self,
        id: StreamId,
        what: &'static str,
        empty: T,
        f: impl FnOnce(&StreamState<R>) -> T,
    ) -> Result<T> {
        let id = exec::engine_stream(id);
        let Some(cell) = self.streams.read().get(&id).cloned() else {
            return Ok(empty);
        };
        let state = Self::inspect(&cell).ok_or(Error::Reentrant { what })?;
        Ok(f(&state))
    }

    /// The operations queued on stream `id`, in order (inspection and tests).
    ///
    /// # Errors
    ///
    /// [`Error::Reentrant`] when called from inside an executing operation while `id`'s lock is
    /// held (by this thread's own execution, or by another thread).
    pub fn pending(&self, id: StreamId) -> Result<Vec<Pending>> {
        self.inspected(id, "MultiStream::pending", Vec::new(), |state| {
            state
                .queue
                .iter()
                .map(|op| match op {
                    QueuedOp::Drop(id) => Pending::Drop(*id),
                    QueuedOp::Op(op, _) => Pending::Operation(Box::new(op.repr())),
                })
                .collect()
        })
    }

    /// Whether stream `id`'s map holds a handle or an error record for `tensor`.
    ///
    /// # Errors
    ///
    /// As [`MultiStream::pending`].
    pub fn holds(&self, id: StreamId, tensor: TensorId) -> Result<bool> {
        self.inspected(id, "MultiStream::holds", false, |state| {
            state.is_materialised(&tensor)
        })
    }

    fn cells(&self) -> Vec<Arc<StreamCell<R>>> {
        self.streams.read().values().cloned().collect()
    }

    /// Set up a cross-stream alias of `src`, whose home is `src_home`, under the fresh id `dst`
    /// on the current stream. Returns `dst`'s home.
    ///
    /// Called when [`crate::FusionTensor`]'s `clone`, or an operation using it as an operand,
    /// finds that the tensor's home stream is not the current stream. In short:
    ///
    /// * If `src`'s handle is not materialised yet, drain `src_home` so its producer runs. Skip
    ///   the drain on later shares of the same source, and on a chained share (where `src` is
    ///   itself a view), by observing that the handle already exists
    ///   (`StreamState::is_materialised`; a drained source is also noted in `shared_sources`,
    ///   which no decision reads).
    /// * Then alias the handle under `dst` on the current stream: both ids share the buffer until
    ///   each side is freed.
    pub(crate) fn tag_shared_view(
        &self,
        src_home: &Arc<StreamCell<R>>,
        src: TensorId,
        dst: TensorId,
    ) -> Arc<StreamCell<R>> {
        if in_engine() {
            // Cloning inside an executor: the source stream may be the one we are executing.
            let current = self.current();
            current.post(InboxMessage::Register(
                dst,
                Entry::Failed(Error::Reentrant {
                    what: "FusionTensor::clone",
                }),
            ));
            return current;
        }

        let _timer = crate::profile::time(crate::profile::Section::Share);
        let current = exec::current_stream();
        let (entry, order) = {
            let (mut source, drained) = self.lock_materialised(src_home, &src);
            source.counters.shares += 1;
            if drained {
                source.counters.share_drains += 1;
                source.shared_sources.insert(src);
            } else if source.is_materialised(&src) {
                source.counters.share_fast_paths += 1;
            }
            tracing::trace!(source = %src, view = %dst, from = %src_home.id, drained, "shared view");
            let entry = source.entry(&src, "share");
            let order = self.plan_order(&mut source, &entry, current);
            (entry, order)
        };
        // The view's stream must not read the buffer before the source's writes, which were all
        // dispatched by now (the source is materialised, and an aliased buffer is never written
        // in place).
        self.order(&entry, src_home.id, current, order);

        self.register_entry(dst, entry)
    }

    /// Read access to `id` on `home`: drains if its producer is pending, and returns an owner
    /// of its handle (or its error record).
    ///
    /// A [`Reader::Borrower`] gets a second owner; the id stays. A [`Reader::LastOwner`] marks
    /// the tensor read by its last live owner, and the id is released in the same critical
    /// section (see `StreamState::take_for_read`): when no pending operation on the home stream
    /// still reads it, the reader takes the stream's own handle and the id is freed at once;
    /// otherwise the reader gets a second owner and the id is released exactly as its last drop
    /// would be. Its `shared_sources` entry goes at once.
    pub(crate) fn read_entry(
        &self,
        home: &Arc<StreamCell<R>>,
        id: TensorId,
        reader: Reader,
    ) -> Result<Entry<R::FusionHandle>> {
        let release = matches!(reader, Reader::LastOwner);
        if in_engine() {
            let what = if release {
                "FusionTensor::into_data"
            } else {
                "FusionTensor::read"
            };
            return Err(Error::Reentrant { what });
        }
        let _timer = crate::profile::time(crate::profile::Section::Read);
        let current = exec::current_stream();
        let (mut state, _) = self.lock_materialised(home, &id);
        let entry = if release {
            state.take_for_read(id, "read")
        } else {
            state.entry(&id, "read")
        };
        let order = self.plan_order(&mut state, &entry, current);
        drop(state);
        // The read runs on this thread's stream, after the buffer's writes.
        self.order(&entry, home.id, current, order);
        Ok(entry)
    }

    /// Whether stream `current`, this thread's, must be made to wait for `home`'s writes before
    /// it uses `entry`'s buffer, decided under `home`'s lock. On the backend both are their
    /// execution streams ([`exec`]): this thread's, and `home`'s.
    ///
    /// One wait covers everything `home` dispatched, not only this buffer
    /// ([`StreamRuntime::order_use`]). So where `current` was made to wait for `home` while
    /// `home`'s stamp was what it is now, every write to a buffer `home` allocated was covered
    /// (see `StreamState::stamp`), and this use needs no wait of its own. A consumer taking
    /// several tensors one fused kernel of a producer wrote waits once, not once per tensor.
    fn plan_order(
        &self,
        home: &mut StreamState<R>,
        entry: &Entry<R::FusionHandle>,
        current: StreamId,
    ) -> Order {
        let Entry::Handle(handle) = entry else {
            return Order::Covered;
        };
        if !home.foreign_buffers || !R::foreign_to(&self.context, handle, exec::execution_stream())
        {
            return Order::Covered;
        }
        // `home`'s stamp describes the writes of the buffers `home` allocated, not those of a
        // view's buffer, which a third stream wrote.
        let stamp = (!R::foreign_to(&self.context, handle, home.exec)).then_some(home.stamp);
        if stamp.is_some() && local::ordered_after(self.key, current, home.id) == stamp {
            home.counters.orders_skipped += 1;
            return Order::Covered;
        }
        home.counters.orders += 1;
        Order::Wait { stamp }
    }

    /// Carry out what [`Self::plan_order`] decided, after `home`'s lock is released: make
    /// `current` (this thread's stream, on its execution stream) wait for the stream that
    /// allocated `entry`'s buffer, and remember up to which stamp of `home` it did.
    fn order(
        &self,
        entry: &Entry<R::FusionHandle>,
        home: StreamId,
        current: StreamId,
        order: Order,
    ) {
        let (Entry::Handle(handle), Order::Wait { stamp }) = (entry, order) else {
            return;
        };
        {
            let _timer = crate::profile::time(crate::profile::Section::Order);
            R::order_use(&self.context, handle, exec::execution_stream());
        }
        if let Some(stamp) = stamp {
            local::note_ordered(self.key, current, home, stamp);
        }
    }

    /// The last live tensor of `id` went away: free it on its home stream.
    ///
    /// A drop on another thread than the home's is posted to the home's inbox rather than made
    /// under its lock: the home may be executing its queue (launching kernels, for a while), and
    /// a consumer dropping the tensors it received must not wait for that. Whoever holds the
    /// lock applies the free before releasing it ([`super::inbox`]), as a foreign drop.
    pub(crate) fn release(&self, home: &Arc<StreamCell<R>>, id: TensorId) {
        let current = exec::current_stream();
        if in_engine() || home.id != current {
            home.post(InboxMessage::Free(id));
            return;
        }
        if local::exiting() {
            // An exiting thread runs nothing any more: its drop frees like a foreign one
            // (`StreamState::release_by`).
            home.lock().release_by(id, current);
            return;
        }
        // The home thread's drop, queued behind its records the way they are.
        Self::record_queued(home, QueuedOp::Drop(id));
    }

    /// Remove an empty stream's state from the map. Called under that stream's lock; lock order:
    /// stream, then map (never the reverse).
    pub(crate) fn retire(&self, state: &mut StreamState<R>) {
        state.retired = true;
        self.retired.lock().add(&state.counters);
        let mut streams = self.streams.write();
        if streams
            .get(&state.id)
            .is_some_and(|c| c.serial == state.serial)
        {
            streams.remove(&state.id);
        }
    }

    /// What the engine did and what it holds.
    ///
    /// Called from inside an executing operation, streams whose lock is held (the executing
    /// stream among them) are not waited for: they are left out and counted in
    /// [`EngineStats::streams_skipped`].
    pub fn stats(&self) -> EngineStats {
        let mut stats = EngineStats::default();
        for cell in self.cells() {
            let Some(state) = Self::inspect(&cell) else {
                stats.streams_skipped += 1;
                continue;
            };
            if state.retired {
                continue;
            }
            stats.streams += 1;
            stats.pending_ops += state.queue.len() + state.running.as_ref().map_or(0, |r| r.len);
            stats.live_handles += state.handles.num_handles();
            stats.error_records += state.errors.len();
            stats.shared_sources += state.shared_sources.len();
            stats.deferred_frees_pending += state.deferred_frees.len();
            stats.add_counters(&state.counters);
        }
        stats.add_counters(&self.retired.lock());
        if let Some(gate) = &self.gate {
            (stats.launch_waits, stats.launch_overdrafts) = gate.waits_and_overdrafts();
        }
        stats
    }
}

impl<R: StreamRuntime> EngineHook for MultiStream<R> {
    fn on_thread_exit(&self, stream: StreamId) {
        tracing::trace!(%stream, "exit drain");
        let Some(cell) = self.streams.read().get(&stream).cloned() else {
            return;
        };
        let mut state = cell.lock_idle();
        if state.retired {
            return;
        }
        state.drain_for_service();
        let mut state = cell.settled(state);
        state.orphaned = true;
        state.retire_if_orphan_empty();
    }

    fn drain_stream(&self, stream: StreamId) {
        let Some(cell) = self.streams.read().get(&stream).cloned() else {
            return;
        };
        let mut state = cell.lock_idle();
        state.drain_for_service();
        cell.settled(state).retire_if_orphan_empty();
    }

    fn sweep_idle(&self) {
        for cell in self.cells() {
            // A stream whose lock is taken is in use: not idle.
            let Some(mut state) = cell.try_lock() else {
                continue;
            };
            if !state.idle_since_last_sweep() {
                continue;
            }
            state.counters.idle_flushes += 1;
            tracing::debug!(stream = %cell.id, ops = state.queue.len(), "an idle thread's queue: the service thread runs it");
            state.drain_for_service();
            cell.settled(state).retire_if_orphan_empty();
        }
    }

    fn flush_deferred(&self, stream: StreamId) {
        let Some(cell) = self.streams.read().get(&stream).cloned() else {
            return;
        };
        let mut state = cell.lock_idle();
        state.flush_scheduled = false;
        if state.retired || state.deferred_frees.is_empty() {
            return;
        }
        state.counters.deferred_flushes += 1;
        tracing::debug!(%stream, "deferred free outlived its bound: the service thread runs the stream");
        state.drain_for_service();
        cell.settled(state).retire_if_orphan_empty();
    }
}

/// Who reads a tensor through [`MultiStream::read_entry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reader {
    /// A reader that keeps its tensor: the id stays.
    Borrower,
    /// The tensor's last live owner, consuming it: the id is released by the read.
    LastOwner,
}

impl<R: StreamRuntime> std::fmt::Debug for MultiStream<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiStream")
            .field("streams", &self.streams.read().len())
            .field("config", &self.config)
            .finish()
    }
}
