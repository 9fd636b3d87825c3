//! What a stream's queue stores, and the traits users implement to put operations there: the
//! fallible-op trait, the adapter for burn's [`Operation`], and the executors of custom
//! operations.
//!
//! This module depends only on [`crate::runtime`]: the engine (`stream/`) and the user API
//! (`client/`) both build on it, and neither is imported from here.
//!
//! burn-fusion 0.21's [`Operation::execute`] returns `()`: a failing burn op can only panic. The
//! engine's own trait, [`FallibleOperation`], returns a [`Result`], and the engine contains panics
//! of either kind, so that both end up as an error recorded on the operation's outputs (see
//! [`crate::Error`] for how it then travels with the data).

use std::fmt;

use burn_fusion::FusionRuntime;
use burn_fusion::stream::Operation;
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use crate::Result;
use crate::runtime::StreamRuntime;

mod builtin;
mod custom;
mod handles;
pub(crate) mod pool;
mod queued;

pub(crate) use builtin::Builtin;
pub(crate) use custom::{CustomOperation, WithRepr};
pub(crate) use handles::{StreamHandles, missing_handle, take_from};
pub(crate) use queued::{IntoQueued, PendingOp, QueuedOp};

/// An operation that can fail without panicking.
///
/// `execute` runs on the thread that executes the stream (the registering thread, or a thread that
/// drains the stream to share or read one of its tensors), with [`burn_backend::StreamId::current`]
/// set to the operation's stream's execution stream ([`crate::FusionClient::execution_stream`] of
/// the stream's thread), where its device work must land. It must:
///
/// * take its inputs from `handles` with the status recorded in its IR (`ReadWrite` inputs are
///   consumed and may be reused in place);
/// * register every declared output, and nothing else;
/// * dispatch device work without waiting for it.
///
/// It must not call back into the engine: such calls return [`crate::Error::Reentrant`].
pub trait FallibleOperation<R: FusionRuntime>: Send + Sync + fmt::Debug {
    /// Run the operation.
    fn execute(&self, handles: &mut HandleContainer<R::FusionHandle>) -> Result<()>;
}

/// Adapter that runs a burn [`Operation`] as a [`FallibleOperation`].
///
/// burn operations report failure by panicking; the engine catches the panic and records it as
/// [`crate::Error::OperationPanicked`] on the outputs.
#[derive(Debug)]
pub struct BurnOperation<O>(pub O);

impl<R, O> FallibleOperation<R> for BurnOperation<O>
where
    R: FusionRuntime,
    O: Operation<R>,
{
    fn execute(&self, handles: &mut HandleContainer<R::FusionHandle>) -> Result<()> {
        self.0.execute(handles);
        Ok(())
    }
}

/// The executor of a custom operation registered with [`crate::OpBuilder`].
///
/// It receives the operation's IR (inputs with their statuses, outputs with their fresh ids) and
/// the stream's handles. Any `Fn(&CustomOpIr, &mut HandleContainer<H>) -> Result<()>` closure that
/// is `Send + Sync + 'static` is an executor.
///
/// An executor that captures a [`crate::FusionTensor`] or a [`crate::FusionClient`] keeps the
/// engine alive while it is queued (the engine holds the queue, the queue holds the executor):
/// nothing is freed until the operation runs, which happens at the latest when a read, a sync, a
/// share, the queue bound or the exit of its thread runs the stream. Pass data through operands
/// instead of captures where you can.
///
/// An executor runs inside a drain of its stream, like every operation: it must not wait for a
/// thread that may itself be waiting for the engine — a `join` or parallel iterator of rayon's
/// global pool, whose workers may be the program's own jobs sharing this stream's tensors, or a
/// channel another such thread feeds. Give its parallel work a thread pool of its own
/// (docs/ARCHITECTURE.md, "Locks and waits").
pub trait CustomExecutor<R: FusionRuntime>: Send + Sync + 'static {
    /// Run the operation described by `op`.
    fn execute(
        &self,
        op: &CustomOpIr,
        handles: &mut HandleContainer<R::FusionHandle>,
    ) -> Result<()>;
}

impl<R, F> CustomExecutor<R> for F
where
    R: FusionRuntime,
    F: Fn(&CustomOpIr, &mut HandleContainer<R::FusionHandle>) -> Result<()> + Send + Sync + 'static,
{
    fn execute(
        &self,
        op: &CustomOpIr,
        handles: &mut HandleContainer<R::FusionHandle>,
    ) -> Result<()> {
        self(op, handles)
    }
}

/// What a queue entry runs: everything an operation needs, in one allocation.
///
/// Built-in operations keep their kernel and operand IRs and derive their burn [`OperationIr`]
/// only when somebody inspects the queue ([`crate::MultiStream::pending`]); operations that
/// arrive with an IR keep it.
pub(crate) trait OpBody<R: StreamRuntime>: Send + Sync {
    /// The operation's name, for errors.
    fn name(&self) -> &str;
    /// Run it on the current stream.
    fn execute(
        &self,
        handles: &mut StreamHandles<R::FusionHandle>,
        context: &R::Context,
    ) -> Result<()>;
    /// The operands, with the status each has for this operation.
    fn inputs(&self) -> Irs<'_>;
    /// The outputs (fresh ids).
    fn outputs(&self) -> &[TensorIr];
    /// The operation as burn's IR records it.
    fn repr(&self) -> OperationIr;
    /// Whether dropping it can run user code (an executor's captures), and so panic. The engine
    /// drops such operations inside an error scope, which costs a copy of the name and outputs.
    fn drop_runs_user_code(&self) -> bool {
        true
    }
    /// Whether its execution may succeed without registering every output, so that the engine
    /// must look each one up afterwards ([`crate::Error::OutputNotWritten`]). Only this crate's
    /// own run functions, which register every output they declare, say no; debug builds look
    /// anyway.
    fn may_skip_outputs(&self) -> bool {
        true
    }
    /// Whether its execution takes every operand from the handle map the way burn's
    /// `get_handle` does, and fails when one is missing: a `ReadWrite` operand is removed, a
    /// missing one panics. The engine then leaves to the execution what it would otherwise check
    /// around it: that no operand is missing (when the stream holds no error record, a missing
    /// operand is the only failure that check could find, and the execution's panic records it
    /// on the outputs instead), and, after a success, that no consumed operand is left in the
    /// map. Only this crate's run functions of elementwise IRs, which take each operand through
    /// `record::tensor_handle`, say yes; debug builds assert that they did.
    fn takes_its_inputs(&self) -> bool {
        false
    }
    /// Whether its execution may spread over a thread pool of the backend's own (burn-ndarray's
    /// matmuls, convolutions and pooling run on rayon's): a queue's worth of operations holding
    /// one runs where the runtime's
    /// [`batch_placement`](crate::runtime::StreamRuntime::batch_placement) puts it. `false` by
    /// default.
    fn uses_thread_pool(&self) -> bool {
        false
    }
    /// The four answers above, in one value: the engine asks them of every operation it runs,
    /// and through the queue's `dyn OpBody` each answer would be a call of its own. A queue
    /// entry carries them ([`QueuedOp::Op`]), asked once where the body's type is known.
    #[inline]
    fn traits(&self) -> Traits {
        Traits {
            drop_runs_user_code: self.drop_runs_user_code(),
            may_skip_outputs: self.may_skip_outputs(),
            takes_its_inputs: self.takes_its_inputs(),
            uses_thread_pool: self.uses_thread_pool(),
        }
    }
    /// Run it, and drop it in place once it has succeeded: one call through the queue's `dyn`
    /// table where running it and dropping it would take one each (and its drop glue is then
    /// inlined here). The engine's path for a batch's bodies whose drop runs no user code
    /// (`StreamState::execute_entry_keeping`), which then keeps the emptied allocation.
    ///
    /// Returns what [`std::panic::catch_unwind`] around [`Self::execute`] returns. On anything
    /// but `Ok(Ok(()))` nothing was dropped: the body is whole, for the engine to record the
    /// failure on its outputs and drop it as usual. A panic of the drop itself unwinds out of
    /// here with the value partly dropped: the caller must then neither use nor free it (it
    /// leaks its allocation), so that only bodies whose drop runs no user code come here.
    ///
    /// # Safety
    ///
    /// After `Ok(Ok(()))` the value behind `self` has been dropped: the caller must not use it
    /// or drop it again, only free or reuse its allocation (as [`std::mem::ManuallyDrop::drop`]
    /// asks of its caller).
    #[inline]
    unsafe fn execute_then_drop(
        &mut self,
        handles: &mut StreamHandles<R::FusionHandle>,
        context: &R::Context,
    ) -> std::thread::Result<Result<()>> {
        let run = std::panic::AssertUnwindSafe(|| self.execute(handles, context));
        let outcome = std::panic::catch_unwind(run);
        if matches!(outcome, Ok(Ok(()))) {
            // SAFETY: the caller does not use the value after a success (see above).
            unsafe { std::ptr::drop_in_place(self as *mut Self) };
        }
        outcome
    }
}

/// What [`OpBody::traits`] answers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Traits {
    pub(crate) drop_runs_user_code: bool,
    pub(crate) may_skip_outputs: bool,
    pub(crate) takes_its_inputs: bool,
    pub(crate) uses_thread_pool: bool,
}

/// The operand IRs of a queued operation, in order: a list, and for a binary IR struct (whose
/// operands are two fields, not a slice) its second operand. Operations read their operands in
/// place from whatever struct runs them, so recording one copies no IR.
#[derive(Clone, Copy)]
pub(crate) struct Irs<'a> {
    head: &'a [TensorIr],
    last: Option<&'a TensorIr>,
}

impl<'a> Irs<'a> {
    /// The operands listed in `irs`.
    pub(crate) fn list(irs: &'a [TensorIr]) -> Self {
        Self {
            head: irs,
            last: None,
        }
    }

    /// One operand.
    pub(crate) fn one(ir: &'a TensorIr) -> Self {
        Self::list(std::slice::from_ref(ir))
    }

    /// Two operands held apart.
    pub(crate) fn pair(first: &'a TensorIr, second: &'a TensorIr) -> Self {
        Self {
            head: std::slice::from_ref(first),
            last: Some(second),
        }
    }
}

impl<'a> IntoIterator for Irs<'a> {
    type Item = &'a TensorIr;
    type IntoIter = IrsIter<'a>;

    fn into_iter(self) -> IrsIter<'a> {
        IrsIter {
            head: self.head.iter(),
            last: self.last,
        }
    }
}

/// The iterator of [`Irs`]: the list, then the held-apart operand. (`Chain` of the two costs a
/// state check more per item, on every operand loop of every operation.)
pub(crate) struct IrsIter<'a> {
    head: std::slice::Iter<'a, TensorIr>,
    last: Option<&'a TensorIr>,
}

impl<'a> Iterator for IrsIter<'a> {
    type Item = &'a TensorIr;

    #[inline]
    fn next(&mut self) -> Option<&'a TensorIr> {
        match self.head.next() {
            Some(ir) => Some(ir),
            None => self.last.take(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let len = self.head.len() + usize::from(self.last.is_some());
        (len, Some(len))
    }
}
