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

use burn_ir::{TensorId, TensorStatus};
use hashbrown::HashSet;

use super::state::StreamState;
use crate::operation::QueuedOp;
use crate::runtime::StreamRuntime;

/// A batch of the stream running detached (see the module docs).
pub(crate) struct Running {
    /// The ids its operations produce: not in the stream's map before the merge.
    pub(crate) outputs: HashSet<TensorId>,
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
    pub(crate) fn detach(&mut self, ops: VecDeque<QueuedOp<R>>) {
        debug_assert!(self.running.is_none() && self.detached.is_none());
        // The ids the batch consumes: handed over whole rather than as a second owner (a second
        // owner would keep the backend from reusing the buffer in place, and the map's own
        // would outlive the consumption).
        let consumed: HashSet<TensorId> = ops
            .iter()
            .flat_map(|entry| -> Vec<TensorId> {
                match entry {
                    QueuedOp::Drop(id) => vec![*id],
                    QueuedOp::Op(op, _) => op
                        .inputs()
                        .into_iter()
                        .filter(|input| input.status == TensorStatus::ReadWrite)
                        .map(|input| input.id)
                        .collect(),
                }
            })
            .collect();
        let mut scratch = Box::new(self.scratch());
        let mut outputs = HashSet::new();
        for entry in &ops {
            match entry {
                QueuedOp::Drop(id) => {
                    if !outputs.contains(id) {
                        self.hand_over_to(&mut scratch, *id, true);
                    }
                }
                QueuedOp::Op(op, _) => {
                    for input in op.inputs() {
                        let id = input.id;
                        if !outputs.contains(&id) && !scratch.is_materialised(&id) {
                            self.hand_over_to(&mut scratch, id, consumed.contains(&id));
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

    /// Give `scratch` the handle or error record of `id`: the stream's own when the batch
    /// consumes it, else a second owner.
    fn hand_over_to(&mut self, scratch: &mut StreamState<R>, id: TensorId, consumed: bool) {
        if consumed {
            match self.handles.remove_handle(id) {
                Some(burn_ir::Handle::Existing(handle)) => {
                    scratch.handles.register_handle(id, handle);
                }
                Some(burn_ir::Handle::NotInit) | None => {}
            }
            if let Some(error) = (!self.errors.is_empty())
                .then(|| self.errors.remove(&id))
                .flatten()
            {
                scratch.errors.insert(id, error);
            }
        } else if let Some(handle) = self.handles.get_handle_ref(&id) {
            scratch.handles.register_handle(id, R::alias(handle));
        } else if let Some(error) = self.errors.get(&id) {
            scratch.errors.insert(id, error.clone());
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
