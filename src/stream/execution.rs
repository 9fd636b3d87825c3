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
//!
//! Nothing is reported to the caller of `drain`: errors wait on the data for the read that needs
//! it.

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn_ir::TensorStatus;

use super::state::{PendingOp, QueuedOp, StreamState};
use crate::Error;
use crate::runtime::StreamRuntime;

impl<R: StreamRuntime> StreamState<R> {
    /// Execute every queued operation in order, on this stream, then apply deferred frees.
    pub(crate) fn execute_all(&mut self) {
        if !self.queue.is_empty() {
            let mut ops = std::mem::take(&mut self.queue);
            // Device work dispatched by the executors must land on this stream even when another
            // thread is draining it (to share or read one of its tensors).
            self.id.executes(|| {
                for op in ops.drain(..) {
                    match op {
                        QueuedOp::Drop(id) => self.free(id),
                        QueuedOp::Op(op) => self.execute_one(*op),
                    }
                }
            });
            // Executors cannot enqueue (re-entrant calls are refused), so the queue is still
            // empty: give it back its allocation.
            debug_assert!(self.queue.is_empty());
            self.queue = ops;
        }
        for id in std::mem::take(&mut self.deferred_frees) {
            self.free(id);
        }
    }

    fn execute_one(&mut self, op: PendingOp<R>) {
        self.counters.ops_executed += 1;

        if let Some(error) = self.input_failure(&op) {
            self.counters.ops_skipped += 1;
            self.record_failure(&op, error);
            self.consume_inputs(&op);
            return;
        }

        if let Some(error) = self.ssa_violation(&op) {
            self.counters.ops_failed += 1;
            self.record_failure(&op, error);
            self.consume_inputs(&op);
            return;
        }

        let handles = &mut self.handles;
        let outcome = catch_unwind(AssertUnwindSafe(|| op.executor.execute(handles)));
        let failure = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(error)) => Some(error),
            Err(payload) => Some(Error::from_panic(&op.name, payload)),
        };

        match failure {
            None => {
                for out in &op.outputs {
                    if !self.handles.has_handle(out) {
                        self.errors.insert(
                            *out,
                            Error::OutputNotWritten {
                                op: op.name.as_ref().into(),
                                id: *out,
                            },
                        );
                    }
                }
            }
            Some(error) => {
                self.counters.ops_failed += 1;
                tracing::debug!(op = %op.name, stream = %self.id, %error, "operation failed");
                self.record_failure(&op, error);
            }
        }
        self.consume_inputs(&op);
    }

    /// The error an input already carries, if any.
    fn input_failure(&self, op: &PendingOp<R>) -> Option<Error> {
        for (id, _) in &op.inputs {
            if self.handles.has_handle(id) {
                continue;
            }
            return Some(match self.errors.get(id) {
                Some(error) => error.clone(),
                None => Error::MissingHandle {
                    op: op.name.as_ref().into(),
                    id: *id,
                },
            });
        }
        None
    }

    /// Debug builds check the SSA invariant: an output id must be fresh.
    fn ssa_violation(&self, op: &PendingOp<R>) -> Option<Error> {
        if !cfg!(debug_assertions) {
            return None;
        }
        op.outputs
            .iter()
            .find(|out| self.is_materialised(out))
            .map(|out| Error::SsaViolation {
                op: op.name.as_ref().into(),
                id: *out,
            })
    }

    /// Replace whatever the outputs hold (a partial write) by the error record. This is the one
    /// place a registered handle may be overwritten, and only by an error record.
    fn record_failure(&mut self, op: &PendingOp<R>, error: Error) {
        for out in &op.outputs {
            self.handles.remove_handle(*out);
            self.errors.insert(*out, error.clone());
        }
    }

    fn consume_inputs(&mut self, op: &PendingOp<R>) {
        for (id, status) in &op.inputs {
            if *status == TensorStatus::ReadWrite {
                self.handles.remove_handle(*id);
                self.errors.remove(id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Property: in debug builds, an operation whose output id already holds a handle is refused
    //! (recorded as an SSA violation) instead of overwriting the handle.
    use super::*;
    use crate::host::HostRuntime;
    use crate::operation::FallibleOperation;
    use burn_backend::{StreamId, TensorData};
    use burn_ir::{HandleContainer, OperationIr, TensorId};

    #[derive(Debug)]
    struct Overwrite(
        TensorId,
        <HostRuntime as burn_fusion::FusionRuntime>::FusionHandle,
    );

    impl FallibleOperation<HostRuntime> for Overwrite {
        fn execute(
            &self,
            handles: &mut HandleContainer<
                <HostRuntime as burn_fusion::FusionRuntime>::FusionHandle,
            >,
        ) -> crate::Result<()> {
            handles.register_handle(self.0, self.1.clone());
            Ok(())
        }
    }

    #[test]
    #[cfg(debug_assertions)]
    fn an_output_id_that_already_has_a_handle_is_an_ssa_violation() {
        let ctx = HostRuntime::open(&Default::default()).unwrap();
        let upload = |v: f32| HostRuntime::upload(&ctx, &TensorData::new(vec![v], [1])).unwrap();
        let mut state = StreamState::<HostRuntime>::new(StreamId::current(), 8);
        let existing = crate::id::fresh_tensor_id();
        state.handles.register_handle(existing, upload(1.0));
        let op = PendingOp {
            name: "overwrite".into(),
            repr: OperationIr::Drop(burn_ir::TensorIr {
                id: existing,
                shape: [1].into(),
                status: TensorStatus::NotInit,
                dtype: burn_backend::DType::F32,
            }),
            inputs: Default::default(),
            outputs: [existing].into_iter().collect(),
            executor: Box::new(Overwrite(existing, upload(2.0))),
        };
        state.enqueue(QueuedOp::Op(Box::new(op)));
        state.drain();
        assert!(matches!(
            state.errors.get(&existing),
            Some(Error::SsaViolation { id, .. }) if *id == existing
        ));
        assert_eq!(state.counters.ops_failed, 1);
    }
}
