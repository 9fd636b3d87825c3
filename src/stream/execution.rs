//! Running a stream's pending segment, with error scopes.
//!
//! Every operation runs inside its own error scope:
//!
//! 1. **Propagation.** If an input carries an error record, the operation is skipped and the
//!    same error is recorded on each of its outputs. An input with neither a handle nor an error
//!    record (only a misbehaving executor can cause that) skips the operation with
//!    [`Error::MissingHandle`].
//! 2. **Containment.** The executor runs under `catch_unwind`. An `Err` or a panic removes any
//!    output it had already registered and records the error on every output instead.
//! 3. **Completeness.** An executor that returns `Ok` without registering a declared output gets
//!    [`Error::OutputNotWritten`] recorded on it, so a later read reports it instead of panicking.
//! 4. **Consumption.** Inputs used `ReadWrite` were the last live reference to their id; whatever
//!    happened, their handle or error record is removed afterwards, so nothing leaks when an
//!    executor fails before taking them.
//! 5. **Disposal.** The operation itself (an executor and whatever it captured) is dropped inside
//!    the same scope, once it has run or been skipped. A destructor that panics is recorded on the
//!    operation's outputs like a panic of the executor; it never escapes into whoever drained the
//!    stream, and the operations queued behind it still run.
//!
//! Nothing is reported to the caller of `drain`: errors wait on the data for the read that needs
//! it.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;

use burn_ir::{OperationIr, TensorId, TensorIr, TensorStatus};
use hashbrown::HashSet;
use smallvec::SmallVec;

use super::state::StreamState;
use crate::Error;
use crate::operation::QueuedOp;
use crate::operation::{OpBody, Traits};
use crate::runtime::{Fuser, StreamRuntime};
use crate::small::{Positions, copy_ir};

/// What the stream's fuser has been offered of the queue's front since its last reset.
///
/// Every entry before `scanned` was accepted, or is a drop of a tensor the run never touched
/// (freed with the run, never shown to the fuser). The plan survives between lazy flushes, so a
/// run the fuser can still extend is offered each operation once, however many flushes it
/// spans; only the execution of queued entries (which removes them from the front) clears it.
#[derive(Default)]
pub(crate) struct Plan {
    scanned: usize,
    /// The fuser refused the entry at `scanned`, or the run reached `max_fused_len`: nothing
    /// more is offered until the run has executed.
    closed: bool,
    /// The offered entries: their index in the queue, and whether each is an operation.
    offered: Vec<(usize, bool)>,
    /// The tensors the offered operations read or produce (found by a scan while the run is
    /// short: most runs are)...
    seen: Positions<TensorId>,
    /// ...and, for each, the queue index of the first offered operation naming it, whose IR of it
    /// a drop of it is offered with.
    seen_in: Vec<usize>,
    /// The fuser panicked when offered the entry at this index: the error its operation fails
    /// with (see `StreamState::execute_poisoned`).
    poisoned: Option<(usize, Error)>,
}

impl Plan {
    /// How many entries at the queue's front the fuser has looked at.
    pub(crate) fn scanned(&self) -> usize {
        self.scanned
    }

    fn clear(&mut self) {
        self.scanned = 0;
        self.closed = false;
        self.offered.clear();
        self.seen.truncate(0);
        self.seen_in.clear();
        self.poisoned = None;
    }

    /// Whether an offered entry is an operation.
    fn has_operation(&self) -> bool {
        self.offered.iter().any(|(_, op)| *op)
    }
}

/// How many of its next batches for the batch pool a stream runs detached once another thread
/// was seen waiting for its lock (see `super::detached`, "When"): a stream whose tensors other
/// threads keep using stays detached, one they stopped using goes back to running its batches
/// under the lock.
const DETACH_CREDIT: u8 = 8;

impl<R: StreamRuntime> StreamState<R> {
    /// Execute every queued operation in order, on this stream, then apply deferred frees.
    pub(crate) fn execute_all(&mut self) {
        self.execute_queue(false);
    }

    /// The queue reached its bound: execute it, except for a trailing run the fuser could still
    /// extend (it stays queued, up to `max_fused_len` entries, so that one kernel covers it).
    pub(crate) fn execute_lazily(&mut self) {
        self.execute_queue(true);
    }

    /// Whether this stream fuses now: it has a fuser, and fusion is switched on.
    pub(crate) fn fusing(&self) -> bool {
        self.fuser.is_some() && self.fusion.load(Ordering::Relaxed)
    }

    /// Offer the queue's entries the plan has not looked at to the fuser (which the caller knows
    /// is there and on). Returns whether the run is closed, so the queue has something to run
    /// that can grow no more.
    pub(crate) fn offer_queued(&mut self) -> bool {
        let Some(mut fuser) = self.fuser.take() else {
            return false;
        };
        let queue = std::mem::take(&mut self.queue);
        let closed = self.extend_plan(&queue, &mut *fuser);
        self.queue = queue;
        self.put_back_fuser(fuser);
        closed
    }

    /// Give the stream its fuser back after an execution or an offer, unless a call into it
    /// panicked where the engine could not put it in a known state (its `reset`): then it is
    /// dropped (contained), and the stream runs unfused from then on.
    fn put_back_fuser(&mut self, fuser: Box<dyn Fuser<R>>) {
        if !std::mem::take(&mut self.fuser_broken) {
            self.fuser = Some(fuser);
            return;
        }
        tracing::warn!(stream = %self.id, "the stream's fuser panicked in `reset`: the stream runs unfused from now on");
        if let Err(payload) = catch_unwind(AssertUnwindSafe(move || drop(fuser))) {
            crate::error::drop_payload(payload);
        }
    }

    /// `fuser.reset()`, contained: a panic there marks the fuser broken (see
    /// [`Self::put_back_fuser`]).
    fn reset_fuser(&mut self, fuser: &mut dyn Fuser<R>) {
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| fuser.reset())) {
            crate::error::drop_payload(payload);
            self.fuser_broken = true;
        }
    }

    /// [`Self::reset_fuser`] of the fuser the stream holds, dropping it at once if it is broken.
    fn reset_own_fuser(&mut self) {
        if let Some(mut fuser) = self.fuser.take() {
            self.reset_fuser(&mut *fuser);
            self.put_back_fuser(fuser);
        }
    }

    fn execute_queue(&mut self, lazy: bool) {
        self.run_queue(lazy);
        self.retry_deferred_frees();
    }

    /// Execute the queue's first `end` entries and leave the rest queued (a drain for another
    /// thread that needs only a tensor the `end`-th entry produces), then apply deferred frees.
    ///
    /// The rest is the home thread's to extend and run: a share or read from another thread
    /// pays only for what it needs, and the run it cuts ends where its tensor is made, which
    /// repeats from call to call where the end of the whole queue would not (see
    /// [`crate::runtime::Fuser::fuse_cut_run`]).
    pub(crate) fn execute_through(&mut self, end: usize) {
        if end >= self.queue.len() {
            return self.execute_all();
        }
        let tail = self.queue.split_off(end);
        if self.plan.scanned > end {
            // The fuser was offered entries past the cut: plan the front again on its own.
            self.reset_own_fuser();
            self.plan.clear();
        }
        self.run_queue(false);
        debug_assert!(
            self.queue.is_empty(),
            "an eager run executes everything it is given"
        );
        self.queue = tail;
        self.free_unread_drops();
        // After the tail is back: a deferred free must still wait for the readers queued there.
        self.retry_deferred_frees();
    }

    /// Free now the home thread's drops left queued behind a drain that ran only part of the
    /// queue (another thread's share or read), when nothing queued or running reads their id: a
    /// home thread that goes idle then holds no buffer it dropped. A drop whose id a queued
    /// operation still reads stays in place, where a fuser sees it as the end of that tensor
    /// (and an idle thread's queue is run by the service thread's sweep). Nothing queued after
    /// a drop names its id, so freeing it early changes no result.
    fn free_unread_drops(&mut self) {
        if !self
            .queue
            .iter()
            .any(|entry| matches!(entry, QueuedOp::Drop(_)))
        {
            return;
        }
        let mut unread = Vec::new();
        for (at, entry) in self.queue.iter().enumerate() {
            if let QueuedOp::Drop(id) = entry
                && !self.queue_references(*id)
            {
                unread.push((at, *id));
            }
        }
        for (at, id) in unread.into_iter().rev() {
            self.queue.remove(at);
            self.free(id);
        }
    }

    fn run_queue(&mut self, lazy: bool) {
        if self.queue.is_empty() {
            return;
        }
        if self.running.is_some() {
            // A batch of this stream runs detached: what is queued behind it may read its
            // outputs, so it runs after the merge (a drain waits for that first:
            // `StreamCell::lock_idle`; a full queue runs at its next bound).
            debug_assert!(lazy, "a drain of a stream whose batch runs detached");
            return;
        }
        let fusing = self.fusing();
        // A batch with an operation that spreads over the backend's thread pool runs on the
        // engine's batch pool, whole: without the lock when other threads want the stream (see
        // `super::detached`, "When"), else under it.
        let pooled =
            !fusing && self.batch_pool && self.queue.iter().any(QueuedOp::uses_thread_pool);
        self.counters.batches_pooled += u64::from(pooled);
        if pooled && self.contended.load(Ordering::Relaxed) {
            self.contended.store(false, Ordering::Relaxed);
            self.detach_credit = DETACH_CREDIT;
        }
        if pooled && self.detach_credit > 0 {
            self.detach_credit -= 1;
            self.counters.batches_detached += 1;
            self.forget_plan();
            let ops = std::mem::take(&mut self.queue);
            return self.detach(ops);
        }
        let _timer = crate::profile::time(crate::profile::Section::Execute);
        let mut ops = std::mem::take(&mut self.queue);
        // Device work dispatched by the executors must land on this stream even when another
        // thread is draining it (to share or read one of its tensors).
        let (id, exec) = (self.id, self.exec);
        // Out of `self` while the permit borrows it (the execution needs `self` whole); an
        // unwind leaves the stream ungated, never a permit held.
        let gate = self.gate.take();
        let permit = super::gate::enter(gate.as_deref());
        let mut run = || {
            super::exec::executes(id, exec, || match self.fuser.take() {
                Some(mut fuser) if fusing => {
                    self.execute_fusing(&mut ops, &mut *fuser, lazy);
                    self.put_back_fuser(fuser);
                }
                fuser => {
                    self.fuser = fuser;
                    self.forget_plan();
                    self.execute_in_place(ops.drain(..));
                }
            })
        };
        if pooled {
            // The one wait under a stream lock: on the batch pool, whose threads never wait for
            // a lock (docs/ARCHITECTURE.md, "Locks and waits").
            run_on_batch_pool(&mut run);
        } else {
            run();
        }
        drop(permit);
        self.gate = gate;
        // Executors cannot enqueue (re-entrant calls are refused), so the queue is still
        // empty: give it back what is left (an open run) and its allocation.
        debug_assert!(self.queue.is_empty());
        self.queue = ops;
        self.new_stamp();
    }

    /// Fusion was switched off with a run planned, or the queue goes to the batch pool: forget
    /// the plan.
    fn forget_plan(&mut self) {
        if self.plan.scanned > 0 {
            self.reset_own_fuser();
        }
        self.plan.clear();
    }

    /// Execute `ops` one by one, without fusion, with the thread's kept blocks at hand for their
    /// bodies (see `pool::lend`; on an unwind they are freed with `kept`).
    fn execute_in_place(&mut self, ops: impl Iterator<Item = QueuedOp<R>>) {
        let mut kept = crate::operation::pool::lend();
        for op in ops {
            self.execute_entry_keeping(op, Some(&mut kept));
        }
        crate::operation::pool::put_back(kept);
    }

    /// Run a detached batch (see [`super::detached`]) against this state, its scratch state, on
    /// the engine's batch pool; the calling thread holds no stream lock, and waits.
    pub(crate) fn execute_detached(&mut self, mut ops: VecDeque<QueuedOp<R>>) {
        let _timer = crate::profile::time(crate::profile::Section::Execute);
        let (id, exec) = (self.id, self.exec);
        run_on_batch_pool(&mut || {
            super::exec::executes(id, exec, || self.execute_in_place(ops.drain(..)))
        });
    }

    pub(crate) fn retry_deferred_frees(&mut self) {
        // A deferred free waits for every queued reader; an open run left queued may be one.
        for id in std::mem::take(&mut self.deferred_frees) {
            if self.queue_references(id) {
                self.deferred_frees.push(id);
            } else {
                self.free(id);
            }
        }
    }

    /// Execute one queued entry without fusion.
    fn execute_entry(&mut self, entry: QueuedOp<R>) {
        self.execute_entry_keeping(entry, None);
    }

    /// [`Self::execute_entry`], its operation's block kept in `kept` (when its drop runs no user
    /// code) rather than through the thread-local pool.
    #[inline(always)]
    fn execute_entry_keeping(
        &mut self,
        entry: QueuedOp<R>,
        kept: Option<&mut crate::operation::pool::Lent>,
    ) {
        match entry {
            QueuedOp::Drop(id) => self.free(id),
            QueuedOp::Op(op, traits) => match kept {
                Some(kept) if !traits.drop_runs_user_code => {
                    if self.runs_in_one_call(traits) {
                        self.execute_in_one_call(op, kept);
                    } else {
                        self.execute_one(&*op, traits);
                        kept.recycle(op);
                    }
                }
                _ => {
                    self.execute_one(&*op, traits);
                    self.dispose(op, traits);
                }
            },
        }
    }

    /// Whether an operation of `traits` whose drop runs no user code may run through
    /// [`Self::execute_in_one_call`]: it takes its own inputs and registers every output, so
    /// that after a success [`Self::execute_one`] would have nothing left to check, on a stream
    /// with no error record and no foreign buffer (no check or guard around the call either).
    #[inline(always)]
    fn runs_in_one_call(&self, traits: Traits) -> bool {
        traits.takes_its_inputs
            && !traits.may_skip_outputs
            && self.errors.is_empty()
            && !self.foreign_buffers
    }

    /// [`Self::execute_one`] and the drop of `op` into `kept`, for an operation that
    /// [`Self::runs_in_one_call`], through one call of its own code
    /// ([`OpBody::execute_then_drop`]) where running it and dropping it would take a call
    /// through its `dyn` table each; the emptied allocation is then kept. (On NdArray's chain
    /// the separate drop was a call that rarely finds its target predicted, around a block
    /// descriptor built on the stack and read back wider than it was written.) A failure is
    /// handled as `execute_one` handles it, the body whole.
    #[inline(always)]
    fn execute_in_one_call(
        &mut self,
        op: crate::operation::PendingOp<R>,
        kept: &mut crate::operation::pool::Lent,
    ) {
        self.counters.ops_executed += 1;
        // Debug builds check what `execute_one` checks there, from the ids read beforehand.
        let checked = cfg!(debug_assertions).then(|| DebugIds::of(&*op));
        if let Some(error) = self.ssa_violation(&*op) {
            return self.failed_one_call(op, error, kept);
        }
        let layout = std::alloc::Layout::for_value(&*op);
        let raw = Box::into_raw(op);
        let (handles, context) = (&mut self.handles, &*self.context);
        // SAFETY: `raw` is the live value of a `Box` we own; after a success it is dropped and
        // only its allocation is used (`keep_emptied`), otherwise it is whole and boxed again.
        let outcome = unsafe { (*raw).execute_then_drop(handles, context) };
        if let Ok(Ok(())) = outcome {
            if let Some(ids) = checked {
                self.check_one_call(&ids);
            }
            // SAFETY: `raw` came from `Box::into_raw`, its value (of `layout`) is dropped, and
            // nothing else holds it.
            return unsafe { kept.keep_emptied(raw, layout) };
        }
        // SAFETY: not dropped (see above), and still only ours.
        let op = unsafe { Box::from_raw(raw) };
        let error = match outcome {
            Ok(Err(error)) => error,
            Err(payload) => Error::from_panic(op.name(), payload),
            Ok(Ok(())) => unreachable!("a success returned above"),
        };
        self.failed_one_call(op, error, kept);
    }

    /// A failure of [`Self::execute_in_one_call`]: recorded as [`Self::execute_one`] records
    /// it, then `op` dropped into `kept`.
    #[cold]
    #[inline(never)]
    fn failed_one_call(
        &mut self,
        op: crate::operation::PendingOp<R>,
        error: Error,
        kept: &mut crate::operation::pool::Lent,
    ) {
        self.counters.ops_failed += 1;
        tracing::debug!(op = op.name(), stream = %self.id, %error, "operation failed");
        self.record_failure(op.outputs(), error);
        self.consume_inputs(&*op);
        kept.recycle(op);
    }

    /// What debug builds check after a success of [`Self::execute_in_one_call`], as
    /// [`Self::execute_one`] checks it: every consumed input left the map, and every output
    /// has a handle (else [`Error::OutputNotWritten`]).
    #[cold]
    fn check_one_call(&mut self, ids: &DebugIds) {
        for id in &ids.consumed {
            assert!(
                !self.handles.has_handle(id) && !self.errors.contains_key(id),
                "{} says it takes its inputs, and left a consumed one",
                ids.name
            );
        }
        self.note_unwritten(&ids.name, ids.outputs.iter().copied());
    }

    /// Execute the queue through `fuser`: each run it covers (two operations or more) as one
    /// fused execution, everything else operation by operation (see [`crate::runtime::Fuser`]).
    /// With `lazy`, a trailing run the fuser still accepts stays in `ops`, planned.
    fn execute_fusing(
        &mut self,
        ops: &mut VecDeque<QueuedOp<R>>,
        fuser: &mut dyn Fuser<R>,
        lazy: bool,
    ) {
        while !ops.is_empty() {
            let closed = self.extend_plan(ops, fuser);
            if self.plan.poisoned.is_some() {
                self.execute_poisoned(ops, fuser);
                continue;
            }
            if lazy && !closed && self.plan.has_operation() {
                return;
            }
            // A fuser that panics answering is taken to cover nothing, or to decline the cut run:
            // its operations run one by one (and the fuser is reset, below).
            let covered = contained(|| fuser.covered()).unwrap_or(0);
            let covered = covered.min(self.plan.offered.len());
            let offered = &self.plan.offered[..covered];
            let fused = offered.iter().filter(|(_, op)| *op).count() >= 2;
            let cut = self.cut;
            if fused && !closed && !contained(|| fuser.fuse_cut_run(cut)).unwrap_or(false) {
                // A run cut by this drain that the fuser declines (see `Fuser::fuse_cut_run`):
                // it was open, so it is everything queued, and all of it runs unfused.
                self.counters.cut_runs_unfused += 1;
                for entry in ops.drain(..) {
                    self.execute_entry(entry);
                }
            } else if fused {
                let end = offered[covered - 1].0 + 1;
                let run: Vec<QueuedOp<R>> = ops.drain(..end).collect();
                self.execute_run(run, fuser);
            } else {
                // No run: the entries up to the first operation (drops the fuser never saw, or
                // the refused entry itself) execute one by one.
                let end = match self.plan.offered.iter().find(|(_, op)| *op) {
                    Some((index, _)) => index + 1,
                    None => self.plan.scanned.max(1),
                };
                for _ in 0..end {
                    let entry = ops.pop_front().expect("a scanned entry");
                    self.execute_entry(entry);
                }
            }
            self.reset_fuser(fuser);
            self.plan.clear();
        }
    }

    /// The fuser panicked when offered an entry (`Plan::poisoned`): what it accepted before that
    /// entry runs one by one (a fuser that panicked is not asked to execute what it planned),
    /// the entry's operation fails with the panic, recorded on its outputs as any failure is,
    /// and the fuser is reset for what comes next. Nothing else on the stream is affected.
    #[cold]
    fn execute_poisoned(&mut self, ops: &mut VecDeque<QueuedOp<R>>, fuser: &mut dyn Fuser<R>) {
        let (at, error) = self.plan.poisoned.take().expect("a poisoned plan");
        for _ in 0..at {
            let entry = ops.pop_front().expect("an offered entry");
            self.execute_entry(entry);
        }
        match ops.pop_front().expect("the entry the fuser panicked on") {
            QueuedOp::Drop(id) => self.free(id),
            QueuedOp::Op(op, traits) => {
                self.counters.ops_executed += 1;
                self.counters.ops_failed += 1;
                tracing::debug!(op = op.name(), stream = %self.id, %error, "the fuser panicked when offered it");
                self.record_failure(op.outputs(), error);
                self.consume_inputs(&*op);
                self.dispose(op, traits);
            }
        }
        self.reset_fuser(fuser);
        self.plan.clear();
    }

    /// Offer the entries of `ops` the plan has not looked at yet to `fuser`, in order. Returns
    /// whether the run is closed: an entry was refused (it is left for the next run), or the
    /// run is `max_fused_len` entries long. `false`: every entry was accepted.
    fn extend_plan(&mut self, ops: &VecDeque<QueuedOp<R>>, fuser: &mut dyn Fuser<R>) -> bool {
        let closed = self.extend_open_plan(ops, fuser);
        self.plan.closed = closed;
        closed
    }

    fn extend_open_plan(&mut self, ops: &VecDeque<QueuedOp<R>>, fuser: &mut dyn Fuser<R>) -> bool {
        let plan = &mut self.plan;
        if plan.closed {
            // Already refused: a fuser is not offered the entry it refused twice.
            return true;
        }
        while let Some(entry) = ops.get(plan.scanned) {
            if plan.scanned >= self.max_fused_len {
                return true;
            }
            match entry {
                QueuedOp::Drop(id) => {
                    // A drop of a tensor the run never touched is not the fuser's concern: it
                    // is freed with the run (nothing after it may use the id).
                    if let Some(seen) = plan.seen.get(*id) {
                        let Some(QueuedOp::Op(named, _)) = ops.get(plan.seen_in[seen]) else {
                            unreachable!("a tensor is seen in an offered operation");
                        };
                        let mut ir = named.inputs().into_iter().chain(named.outputs());
                        let ir = ir.find(|ir| ir.id == *id).expect("named by it");
                        let dropped = TensorIr {
                            status: TensorStatus::ReadWrite,
                            ..copy_ir(ir)
                        };
                        let ir = OperationIr::Drop(dropped);
                        match contained(|| fuser.offer(&ir, self.handles.flushed())) {
                            Ok(true) => {}
                            Ok(false) => return true,
                            Err(payload) => {
                                let error = Error::from_panic("Fuser::offer (a drop)", payload);
                                plan.poisoned = Some((plan.scanned, error));
                                return true;
                            }
                        }
                        plan.offered.push((plan.scanned, false));
                    }
                }
                QueuedOp::Op(op, _) => {
                    // An input with an error record (or no handle) ends the run: the operation
                    // runs alone, so the error travels per tensor.
                    let failed = op
                        .inputs()
                        .into_iter()
                        .any(|i| plan.seen.get(i.id).is_none() && !self.handles.has_handle(&i.id));
                    if failed {
                        return true;
                    }
                    let ir = op.repr();
                    match contained(|| fuser.offer(&ir, self.handles.flushed())) {
                        Ok(true) => {}
                        Ok(false) => return true,
                        Err(payload) => {
                            let name = format!("Fuser::offer({})", op.name());
                            plan.poisoned = Some((plan.scanned, Error::from_panic(&name, payload)));
                            return true;
                        }
                    }
                    for ir in op.inputs().into_iter().chain(op.outputs()) {
                        if plan.seen.get(ir.id).is_none() {
                            plan.seen.push(ir.id);
                            plan.seen_in.push(plan.scanned);
                        }
                    }
                    plan.offered.push((plan.scanned, true));
                }
            }
            plan.scanned += 1;
        }
        false
    }

    /// Execute a planned run: the fused kernels in one error scope, then each entry's
    /// bookkeeping in queue order.
    fn execute_run(&mut self, run: Vec<QueuedOp<R>>, fuser: &mut dyn Fuser<R>) {
        let (handles, context) = (self.handles.flushed(), &*self.context);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let _timer = crate::profile::time(crate::profile::Section::FusedRun);
            fuser.execute(handles, context)
        }));
        let failure = match outcome {
            Ok(Ok(kernels)) => {
                self.counters.fused_kernels += kernels as u64;
                None
            }
            Ok(Err(error)) => Some(error),
            Err(payload) => Some(Error::from_panic("fused kernel", payload)),
        };
        if let Some(error) = &failure {
            tracing::debug!(stream = %self.id, %error, ops = run.len(), "fused kernel failed");
        }
        // Outputs that are consumed or dropped inside the run need not have been written.
        let gone: HashSet<TensorId> = run
            .iter()
            .flat_map(|entry| match entry {
                QueuedOp::Drop(id) => SmallVec::<[TensorId; 2]>::from_slice(&[*id]),
                QueuedOp::Op(op, _) => op
                    .inputs()
                    .into_iter()
                    .filter(|i| i.status == TensorStatus::ReadWrite)
                    .map(|i| i.id)
                    .collect(),
            })
            .collect();
        for entry in run {
            let (op, traits) = match entry {
                QueuedOp::Drop(id) => {
                    self.free(id);
                    continue;
                }
                QueuedOp::Op(op, traits) => (op, traits),
            };
            self.counters.ops_executed += 1;
            self.counters.ops_fused += 1;
            match &failure {
                Some(error) => {
                    self.counters.ops_failed += 1;
                    self.record_failure(op.outputs(), error.clone());
                }
                None => {
                    for out in op.outputs() {
                        if !self.handles.has_handle(&out.id) && !gone.contains(&out.id) {
                            self.errors.insert(
                                out.id,
                                Error::OutputNotWritten {
                                    op: op.name().into(),
                                    id: out.id,
                                },
                            );
                        }
                    }
                }
            }
            self.consume_inputs(&*op);
            self.dispose(op, traits);
        }
    }

    #[inline(always)]
    fn execute_one<B: OpBody<R> + ?Sized>(&mut self, op: &B, traits: Traits) {
        self.counters.ops_executed += 1;
        // An operation that takes its own inputs (see `OpBody::takes_its_inputs`) needs neither
        // check around it on a stream without error records: no input can carry one, and a
        // missing input fails the execution itself.
        let takes_its_inputs = traits.takes_its_inputs;
        let checked = !takes_its_inputs || !self.errors.is_empty();
        if let Some(error) = checked.then(|| self.input_failure(op)).flatten() {
            self.counters.ops_skipped += 1;
            self.record_failure(op.outputs(), error);
            self.consume_inputs(op);
            return;
        }

        if let Some(error) = self.ssa_violation(op) {
            self.counters.ops_failed += 1;
            self.record_failure(op.outputs(), error);
            self.consume_inputs(op);
            return;
        }

        let outcome = if self.foreign_buffers {
            self.execute_keeping_foreign(op)
        } else {
            let (handles, context) = (&mut self.handles, &*self.context);
            catch_unwind(AssertUnwindSafe(|| op.execute(handles, context)))
        };
        let failure = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(error)) => Some(error),
            Err(payload) => Some(Error::from_panic(op.name(), payload)),
        };

        if failure.is_none() && takes_its_inputs {
            // Every consumed input left the map with the execution, and none had an error
            // record (an input with one skips the operation).
            debug_assert!(
                op.inputs()
                    .into_iter()
                    .all(|input| input.status != TensorStatus::ReadWrite
                        || !self.handles.has_handle(&input.id)
                            && !self.errors.contains_key(&input.id)),
                "{} says it takes its inputs, and left a consumed one",
                op.name()
            );
            if traits.may_skip_outputs || cfg!(debug_assertions) {
                self.check_outputs_written(op);
            }
            return;
        }
        match failure {
            None if !traits.may_skip_outputs && !cfg!(debug_assertions) => {}
            None => self.check_outputs_written(op),
            Some(error) => {
                self.counters.ops_failed += 1;
                tracing::debug!(op = op.name(), stream = %self.id, %error, "operation failed");
                self.record_failure(op.outputs(), error);
            }
        }
        self.consume_inputs(op);
    }

    /// [`Self::execute_one`]'s call of `op` on a stream whose buffers may be foreign to it.
    ///
    /// A consumed input whose buffer is foreign to this stream gets a second owner for the
    /// call, so the backend's own in-place check (cubecl's `can_mut`) refuses it and the
    /// operation writes a fresh buffer; the second owner is then let go of in order, like the
    /// map's own handle (see `StreamState::let_go`), since the kernel just dispatched may still
    /// read the buffer after the operation dropped its own owner.
    ///
    /// Out of line: a stream without foreign buffers (a host backend's) would otherwise make
    /// and drop an empty list of two handles around every operation (~20 instructions on
    /// NdArray, `scripts/per-op-cost.sh`).
    #[inline(never)]
    fn execute_keeping_foreign<B: OpBody<R> + ?Sized>(
        &mut self,
        op: &B,
    ) -> std::thread::Result<crate::Result<()>> {
        let kept: SmallVec<[R::FusionHandle; 2]> = crate::small::collect(
            op.inputs()
                .into_iter()
                .filter(|input| input.status == TensorStatus::ReadWrite)
                .filter_map(|input| self.handles.get_handle_ref(&input.id))
                .filter(|handle| R::foreign_to(&self.context, handle, self.exec))
                .cloned(),
        );
        let (handles, context) = (&mut self.handles, &*self.context);
        let outcome = catch_unwind(AssertUnwindSafe(|| op.execute(handles, context)));
        // Not iterated when empty: `into_iter` moves the list's inline storage (two handles).
        if !kept.is_empty() {
            for handle in kept {
                self.let_go(handle);
            }
        }
        outcome
    }

    /// Record [`Error::OutputNotWritten`] on each output a successful execution left without a
    /// handle.
    fn check_outputs_written<B: OpBody<R> + ?Sized>(&mut self, op: &B) {
        let outputs = op.outputs().iter().map(|out| out.id);
        self.note_unwritten(op.name(), outputs);
    }

    /// Record [`Error::OutputNotWritten`] on each of `outputs`, the outputs of the successful
    /// execution of operation `name`, that has no handle.
    fn note_unwritten(&mut self, name: &str, outputs: impl IntoIterator<Item = TensorId>) {
        for id in outputs {
            if !self.handles.has_handle(&id) {
                let error = Error::OutputNotWritten {
                    op: name.into(),
                    id,
                };
                self.errors.insert(id, error);
            }
        }
    }

    /// Drop an operation that has run (or was skipped), of `traits` (its queue entry's),
    /// containing a panic of its destructor: the panic is recorded on the operation's outputs.
    fn dispose(&mut self, op: crate::operation::PendingOp<R>, traits: Traits) {
        // Dropped through the pool either way: its block is kept for the next body, and freed
        // if the destructor panics.
        if !traits.drop_runs_user_code {
            return crate::operation::pool::recycle(op);
        }
        let name: Box<str> = op.name().into();
        let outputs: smallvec::SmallVec<[TensorIr; 1]> = op.outputs().iter().cloned().collect();
        let drop_op = move || crate::operation::pool::recycle(op);
        if let Err(payload) = catch_unwind(AssertUnwindSafe(drop_op)) {
            let error = match Error::from_panic(&name, payload) {
                Error::OperationPanicked { op, message } => Error::OperationPanicked {
                    op,
                    message: format!("while dropping the executor: {message}").into(),
                },
                other => other,
            };
            self.counters.ops_failed += 1;
            tracing::debug!(op = %name, stream = %self.id, %error, "executor destructor panicked");
            self.record_failure(&outputs, error);
        }
    }

    /// The error an input already carries, if any.
    fn input_failure<B: OpBody<R> + ?Sized>(&self, op: &B) -> Option<Error> {
        for input in op.inputs() {
            if self.handles.has_handle(&input.id) {
                continue;
            }
            return Some(match self.errors.get(&input.id) {
                Some(error) => error.propagated_to(op.name()),
                None => Error::MissingHandle {
                    op: op.name().into(),
                    id: input.id,
                },
            });
        }
        None
    }

    /// Debug builds check the SSA invariant: an output id must be fresh.
    fn ssa_violation<B: OpBody<R> + ?Sized>(&self, op: &B) -> Option<Error> {
        if !cfg!(debug_assertions) {
            return None;
        }
        op.outputs()
            .iter()
            .find(|out| self.is_materialised(&out.id))
            .map(|out| Error::SsaViolation {
                op: op.name().into(),
                id: out.id,
            })
    }

    /// Replace whatever the outputs hold (a partial write) by the error record. This is the one
    /// place a registered handle may be overwritten, and only by an error record.
    fn record_failure(&mut self, outputs: &[TensorIr], error: Error) {
        for out in outputs {
            self.remove_handle(out.id);
            self.errors.insert(out.id, error.clone());
        }
    }

    fn consume_inputs<B: OpBody<R> + ?Sized>(&mut self, op: &B) {
        for input in op.inputs() {
            if input.status == TensorStatus::ReadWrite {
                self.remove_handle(input.id);
                self.remove_error(input.id);
            }
        }
    }
}

/// Call into code the engine does not own (a fuser) inside an error scope: the panic's payload
/// on failure, for the caller to record or drop (with [`crate::error::drop_payload`]).
fn contained<T>(call: impl FnOnce() -> T) -> std::thread::Result<T> {
    catch_unwind(AssertUnwindSafe(call))
}

/// Run `batch` (a detached batch's execution) on the engine's batch pool
/// ([`super::batch_pool`]), where it is inside the engine as a drain under the lock is: an
/// operation calling back into the engine is refused ([`super::cell::InEngine`]), and the bodies
/// it frees go to this thread's kept blocks, from which this thread boxes the next ones
/// ([`crate::operation::pool::lend`]). The stream's identity there is `executes`' (inside
/// `batch`), which answers [`super::exec::current_stream`] with the stream being executed.
///
/// Every operation of a batch runs in its own error scope, so nothing unwinds out of it unless
/// the engine itself is broken; if it does, the payload is dropped here (the operations not run
/// are dropped unrun, and a read of their outputs reports a missing handle) rather than resumed
/// on a thread that may be letting go of a lock.
fn run_on_batch_pool(batch: &mut (dyn FnMut() + Send)) {
    use crate::operation::pool;
    let mut lent = pool::lend();
    let outcome = super::batch_pool::run(&mut || {
        let _inside = super::cell::InEngine::enter();
        pool::with_lent(&mut lent, &mut *batch);
    });
    pool::put_back(lent);
    if let Err(payload) = outcome {
        tracing::error!("a batch unwound out of its error scopes");
        crate::error::drop_payload(payload);
    }
}

/// The ids a debug build checks after [`StreamState::execute_in_one_call`], read before the
/// operation runs (it is dropped by the time they are checked).
struct DebugIds {
    name: String,
    consumed: SmallVec<[TensorId; 2]>,
    outputs: SmallVec<[TensorId; 1]>,
}

impl DebugIds {
    #[cold]
    fn of<R: StreamRuntime, B: OpBody<R> + ?Sized>(op: &B) -> Self {
        Self {
            name: op.name().to_owned(),
            consumed: (op.inputs().into_iter())
                .filter(|input| input.status == TensorStatus::ReadWrite)
                .map(|input| input.id)
                .collect(),
            outputs: op.outputs().iter().map(|out| out.id).collect(),
        }
    }
}

#[cfg(all(test, debug_assertions))]
mod tests {
    //! Property: in debug builds, an operation whose output id already holds a handle is refused
    //! (recorded as an SSA violation) instead of overwriting the handle.
    use super::*;
    use crate::host::{HostHandle, HostRuntime};
    use crate::operation::PendingOp;
    use crate::operation::{FallibleOperation, WithRepr};
    use burn_backend::{StreamId, TensorData};
    use burn_ir::{HandleContainer, OperationIr, TensorId};
    use std::sync::Arc;

    #[derive(Debug)]
    struct Overwrite(TensorId, HostHandle);

    impl FallibleOperation<HostRuntime> for Overwrite {
        fn execute(&self, handles: &mut HandleContainer<HostHandle>) -> crate::Result<()> {
            handles.register_handle(self.0, self.1.clone());
            Ok(())
        }
    }

    #[test]
    fn an_output_id_that_already_has_a_handle_is_an_ssa_violation() {
        let ctx = Arc::new(HostRuntime::open(&Default::default()).unwrap());
        let upload = |v: f32| HostRuntime::upload(&ctx, TensorData::new(vec![v], [1])).unwrap();
        let config = crate::EngineConfig::default().with_max_queue_len(8);
        let engine = super::super::MultiStream::new(config, ctx.clone());
        let mut state =
            StreamState::<HostRuntime>::new(StreamId::current(), StreamId::current(), 0, &engine);
        let existing = crate::id::fresh_tensor_id();
        state.handles.register_handle(existing, upload(1.0));
        let out = burn_ir::TensorIr {
            id: existing,
            shape: [1].into(),
            status: TensorStatus::NotInit,
            dtype: burn_backend::DType::F32,
        };
        let op: PendingOp<HostRuntime> = Box::new(WithRepr {
            name: "overwrite".into(),
            repr: OperationIr::Drop(out.clone()),
            inputs: Default::default(),
            outputs: [out].into_iter().collect(),
            operation: Overwrite(existing, upload(2.0)),
        });
        let traits = op.traits();
        state.enqueue(QueuedOp::Op(op, traits));
        state.drain();
        assert!(matches!(
            state.errors.get(&existing),
            Some(Error::SsaViolation { id, .. }) if *id == existing
        ));
        assert_eq!(state.counters.ops_failed, 1);
    }
}
