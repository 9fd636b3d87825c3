//! Operations the engine queues: the fallible-op trait, the adapter for burn's [`Operation`], and
//! the executors of custom operations.
//!
//! burn-fusion 0.21's [`Operation::execute`] returns `()`: a failing burn op can only panic. The
//! engine's own trait, [`FallibleOperation`], returns a [`Result`], and the engine contains panics
//! of either kind, so that both end up as an error recorded on the operation's outputs (see
//! [`crate::Error`] for how it then travels with the data).

use std::fmt;

use burn_fusion::FusionRuntime;
use burn_fusion::stream::Operation;
use burn_ir::{CustomOpIr, HandleContainer};

use crate::Result;

/// An operation that can fail without panicking.
///
/// `execute` runs on the thread that executes the stream (the registering thread, or a thread that
/// drains the stream to share or read one of its tensors), with [`burn_backend::StreamId::current`]
/// set to the operation's stream. It must:
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

/// A custom operation: its IR plus its executor.
pub(crate) struct CustomOperation<R: FusionRuntime, E> {
    pub(crate) ir: CustomOpIr,
    pub(crate) executor: E,
    pub(crate) _runtime: std::marker::PhantomData<fn() -> R>,
}

impl<R: FusionRuntime, E> fmt::Debug for CustomOperation<R, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CustomOperation")
            .field("id", &self.ir.id)
            .field("inputs", &self.ir.inputs.len())
            .field("outputs", &self.ir.outputs.len())
            .finish()
    }
}

impl<R: FusionRuntime, E: CustomExecutor<R>> FallibleOperation<R> for CustomOperation<R, E> {
    fn execute(&self, handles: &mut HandleContainer<R::FusionHandle>) -> Result<()> {
        self.executor.execute(&self.ir, handles)
    }
}
