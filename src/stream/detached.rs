//! Batches that run without their stream's lock: a batch for the engine's batch pool is taken out
//! of the stream with the handles it needs, runs there unlocked, and is merged back.
//!
//! # Why
//!
//! A batch that holds a matmul, a convolution or a pooling runs on the engine's batch pool
//! ([`super::batch_pool`]), and is the longest work a stream runs. Were it run under the stream's
//! lock, every thread sharing or reading one of the stream's tensors would wait for all of it,
//! tensors made long before included: a pool of workers cloning weights homed on a thread that
//! computes with them would wait out each of that thread's batches (measured in debug builds:
//! ~0.6 ms per job where an idle home costs ~0.07 ms). Detached, the lock is held for
//! bookkeeping only, and a share waits only for a tensor the batch itself produces.
//!
//! # Lifecycle
//!
//! 1. **Detach** (under the lock, where the queue would have run: [`StreamState::detach`]). The
//!    batch's entries leave the queue. Each tensor they read that the batch does not produce is
//!    handed to a *scratch* state, the batch's own: moved when the batch consumes it (a
//!    `ReadWrite` use or a drop: its last live tensor is gone, so nothing else can name it),
//!    otherwise a second owner ([`StreamRuntime::alias`]) while the stream keeps its own. The
//!    stream notes the batch as [`Running`], with the ids it produces.
//! 2. **Run** (after the lock is released, by the thread that detached it:
//!    [`super::cell::StreamCell::run_detached`]). The batch runs on the batch pool against the
//!    scratch state, exactly as it would have against the stream's: the same error scopes.
//! 3. **Merge** (under the lock again: [`StreamState::merge`]). What the batch produced and did
//!    not consume moves into the stream's map, its counters are added, `Running` is cleared, the
//!    deferred frees are retried, and threads waiting for the stream to be idle are woken.
//!
//! # When
//!
//! Detaching costs a little per batch (handing the handles over and back, a second lock); what it
//! buys is that other threads do not wait for the batch. So a batch for the batch pool runs
//! detached when another thread has lately waited for the stream's lock
//! (`StreamState::contended`, set by a thread that found the lock taken: a stream whose tensors
//! other threads share or read), for the next few such batches after each time it is seen
//! (`execution::DETACH_CREDIT`). Otherwise it runs on the pool under the lock, as a batch in place
//! does: no deadlock either way, since the pool's threads never wait for a lock
//! ([`super::batch_pool`]). The first batch after other threads start using a stream may keep
//! them waiting; the ones after it do not.
//!
//! # While a batch runs
//!
//! * A share or read of a tensor the stream holds goes ahead at once.
//! * One of a tensor the batch produces, and every drain (a read, a sync, a share whose producer
//!   is queued behind the batch, a thread's exit), waits until the stream is idle, without the
//!   lock ([`super::cell::StreamCell::lock_idle`]): what is queued behind the batch may read its
//!   outputs, so it runs after the merge.
//! * The home thread keeps recording; a queue that reaches its bound waits for the merge (at most
//!   one batch of a stream runs at a time), and runs at the next bound or drain after it.
//! * A foreign drop of a tensor the batch produces is deferred until the merge
//!   ([`StreamState::queue_references`]); one of a tensor the batch reads frees the stream's
//!   owner, and the batch keeps its own.

use std::collections::VecDeque;
use std::sync::Arc;

use burn_ir::{TensorId, TensorStatus};

use super::state::StreamState;
use crate::loom::sync::{Condvar, Mutex};
use crate::operation::QueuedOp;
use crate::runtime::StreamRuntime;

/// How many of a stream's detached batches have finished, and where threads wait for the next to
/// finish ([`super::cell::StreamCell::lock_idle`]).
///
/// # Protocol (no waiter is left asleep)
///
/// * A waiter, holding the stream's lock and seeing a batch running, reads [`Self::finished`]
///   *before* it lets go of the stream's lock, then [`Self::wait_past`] that count.
/// * The batch's thread merges under the stream's lock (the batch stops running there), lets go,
///   then [`Self::finish`]es: the count goes up and every waiter is woken.
///
/// A waiter that read the count under the lock read it before the merge, so before the
/// increment: either it sees the increment when it starts waiting, or it is asleep on the
/// condition when the notification comes (both under the latch's mutex). The `loom_` test below
/// checks it over every interleaving.
#[derive(Default)]
pub(crate) struct IdleLatch {
    finished: Mutex<u64>,
    done: Condvar,
}

impl IdleLatch {
    /// How many batches have finished.
    pub(crate) fn finished(&self) -> u64 {
        *self.finished.lock()
    }

    /// Sleep until more than `finished` batches have finished.
    pub(crate) fn wait_past(&self, finished: u64) {
        let mut count = self.finished.lock();
        while *count == finished {
            self.done.wait(&mut count);
        }
    }

    /// One more batch finished: wake every waiter.
    pub(crate) fn finish(&self) {
        *self.finished.lock() += 1;
        self.done.notify_all();
    }
}

/// A batch of the stream running detached (see the module docs).
pub(crate) struct Running {
    /// The ids its operations produce: not in the stream's map before the merge. (A batch holds
    /// at most a queue bound's worth of entries: a list is as fast as a set here.)
    pub(crate) outputs: Vec<TensorId>,
    /// Its entries (they count as pending in [`crate::EngineStats`]).
    pub(crate) len: usize,
}

/// A batch taken out of its stream, with the state it runs against.
pub(crate) struct Detached<R: StreamRuntime> {
    pub(crate) ops: VecDeque<QueuedOp<R>>,
    pub(crate) scratch: Box<StreamState<R>>,
}

impl<R: StreamRuntime> StreamState<R> {
    /// Take `ops`, a batch for the batch pool, out of the stream with what it reads (see the
    /// module docs, step 1); the thread holding the lock runs it once it has let go
    /// ([`super::cell::StreamCell::run_detached`]).
    ///
    /// One pass in queue order. A tensor the batch reads and does not produce is handed over as
    /// a second owner when first read; where the batch then consumes it (a `ReadWrite` use, or
    /// the home thread's drop: its last live tensor is gone, so nothing outside can name it
    /// again), the stream lets go of its own owner, so that the batch's is the only one (a
    /// backend reuses a buffer in place only then) and the id leaves the stream's map as it
    /// would have when run here.
    pub(crate) fn detach(&mut self, ops: VecDeque<QueuedOp<R>>) {
        debug_assert!(self.running.is_none() && self.detached.is_none());
        let mut scratch = Box::new(self.scratch());
        let mut outputs: Vec<TensorId> = Vec::new();
        for entry in &ops {
            match entry {
                QueuedOp::Drop(id) => {
                    if !outputs.contains(id) {
                        self.hand_over_to(&mut scratch, *id, true);
                    }
                }
                QueuedOp::Op(op, _) => {
                    for input in op.inputs() {
                        if !outputs.contains(&input.id) {
                            let consumed = input.status == TensorStatus::ReadWrite;
                            self.hand_over_to(&mut scratch, input.id, consumed);
                        }
                    }
                    outputs.extend(op.outputs().iter().map(|out| out.id));
                }
            }
        }
        self.running = Some(Running {
            outputs,
            len: ops.len(),
        });
        self.detached = Some(Detached { ops, scratch });
    }

    /// Give `scratch` a second owner of `id`'s handle (or a copy of its error record), unless
    /// it has one; where the batch `consumed` it, the stream lets go of its own.
    fn hand_over_to(&mut self, scratch: &mut StreamState<R>, id: TensorId, consumed: bool) {
        if !scratch.is_materialised(&id) {
            if let Some(handle) = self.handles.get_handle_ref(&id) {
                scratch.handles.register_handle(id, R::alias(handle));
            } else if let Some(error) = self.errors.get(&id) {
                scratch.errors.insert(id, error.clone());
            }
        }
        if consumed {
            self.remove_handle(id);
            self.remove_error(id);
        }
    }

    /// An empty state of the same stream, for a detached batch to run against: the stream's
    /// identity, device and settings, no queue, no handles, no fuser.
    fn scratch(&self) -> Self {
        Self {
            id: self.id,
            exec: self.exec,
            serial: self.serial,
            engine: self.engine.clone(),
            context: self.context.clone(),
            max_queue_len: self.max_queue_len,
            max_deferred_free_delay: self.max_deferred_free_delay,
            queue: VecDeque::new(),
            fuser: None,
            fuser_broken: false,
            plan: Default::default(),
            max_fused_len: self.max_fused_len,
            dispatch_closed_runs: self.dispatch_closed_runs,
            fusion: self.fusion.clone(),
            gate: None,
            handles: Default::default(),
            errors: Default::default(),
            shared_sources: Default::default(),
            deferred_frees: Vec::new(),
            released: Vec::new(),
            flush_scheduled: false,
            cut: self.cut,
            counters: Default::default(),
            foreign_buffers: self.foreign_buffers,
            batch_pool: false,
            stamp: self.stamp,
            running: None,
            detached: None,
            swept: None,
            contended: Arc::default(),
            detach_credit: 0,
            retired: false,
            orphaned: false,
        }
    }

    /// Take back a detached batch's `scratch` state once the batch has run (see the module docs,
    /// step 3).
    pub(crate) fn merge(&mut self, scratch: &mut StreamState<R>) {
        let running = self.running.take().expect("a detached batch is running");
        for id in running.outputs {
            match scratch.handles.remove_handle(id) {
                Some(burn_ir::Handle::Existing(handle)) => {
                    self.handles.register_handle(id, handle);
                }
                Some(burn_ir::Handle::NotInit) | None => {
                    if let Some(error) = scratch.errors.remove(&id) {
                        self.errors.insert(id, error);
                    }
                }
            }
        }
        self.counters.add(&scratch.counters);
        self.released.append(&mut scratch.released);
        self.new_stamp();
        self.retry_deferred_frees();
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::loom::sync::Arc;
    use loom::thread;

    /// A thread that finds a batch running waits for it the way `StreamCell::lock_idle` does,
    /// while the batch's thread merges and finishes the way `StreamCell::run_detached` does: the
    /// waiter always wakes, and then sees the batch merged.
    #[test]
    fn loom_a_waiter_for_a_detached_batch_always_wakes() {
        loom::model(|| {
            // The stream's lock, over "a batch is running".
            let stream = Arc::new((Mutex::new(true), IdleLatch::default()));
            let batch = {
                let stream = stream.clone();
                thread::spawn(move || {
                    *stream.0.lock() = false; // the merge, under the stream's lock
                    stream.1.finish(); // after the lock is let go
                })
            };
            loop {
                let running = stream.0.lock();
                if !*running {
                    break;
                }
                let finished = stream.1.finished();
                drop(running);
                stream.1.wait_past(finished);
            }
            batch.join().unwrap();
        });
    }
}
