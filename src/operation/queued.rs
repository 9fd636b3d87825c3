//! What a stream's queue stores: a drop, or a boxed operation body.

use burn_ir::{OperationIr, TensorId, TensorIr};

use super::{Irs, OpBody};
use crate::Result;
use crate::runtime::StreamRuntime;

/// An operation waiting in a stream's queue: one allocation holding its executor, name and
/// operand IRs (which the engine's bookkeeping reads in place).
pub(crate) type PendingOp<R> = Box<dyn OpBody<R>>;

/// A queue entry: a drop, or an operation with its [`Traits`](super::Traits). Twenty-four bytes,
/// so that queueing and draining move a pointer: an operation body with its IR is a few hundred
/// bytes, and moving it by value in and out of the queue cost more than the allocation that
/// boxing it takes (measured with callgrind on a chain of backend operations). The traits ride
/// beside the pointer because the engine reads them for every operation of a batch (whether it
/// spreads over the thread pool, then how to run and drop it), and asked through the body's
/// `dyn` table each reading was an indirect call.
pub(crate) enum QueuedOp<R: StreamRuntime> {
    Drop(TensorId),
    Op(PendingOp<R>, super::Traits),
}

const _: () = assert!(size_of::<QueuedOp<crate::host::HostRuntime>>() == 24);

impl<R: StreamRuntime> QueuedOp<R> {
    /// Whether it is an operation that spreads over the backend's thread pool
    /// ([`OpBody::uses_thread_pool`]).
    pub(crate) fn uses_thread_pool(&self) -> bool {
        matches!(self, QueuedOp::Op(_, traits) if traits.uses_thread_pool)
    }
}

/// How an operation body becomes a queue entry.
pub(crate) trait IntoQueued<R: StreamRuntime>: OpBody<R> + Sized + 'static {
    fn into_queued(self) -> QueuedOp<R> {
        let traits = self.traits();
        QueuedOp::Op(super::pool::boxed(self), traits)
    }
}

/// A body boxed where it is built: registration then moves a pointer, not the body, through
/// validation and into the stream's critical section (a backend operation's body is several
/// hundred bytes of IR).
impl<R: StreamRuntime, B: OpBody<R> + 'static> IntoQueued<R> for Box<B> {
    fn into_queued(self) -> QueuedOp<R> {
        let traits = (*self).traits();
        QueuedOp::Op(self, traits)
    }
}

impl<R: StreamRuntime, B: OpBody<R> + ?Sized> OpBody<R> for Box<B> {
    fn name(&self) -> &str {
        (**self).name()
    }

    fn execute(
        &self,
        handles: &mut super::StreamHandles<R::FusionHandle>,
        context: &R::Context,
    ) -> Result<()> {
        (**self).execute(handles, context)
    }

    fn inputs(&self) -> Irs<'_> {
        (**self).inputs()
    }

    fn outputs(&self) -> &[TensorIr] {
        (**self).outputs()
    }

    fn repr(&self) -> OperationIr {
        (**self).repr()
    }

    fn drop_runs_user_code(&self) -> bool {
        (**self).drop_runs_user_code()
    }

    fn may_skip_outputs(&self) -> bool {
        (**self).may_skip_outputs()
    }

    fn takes_its_inputs(&self) -> bool {
        (**self).takes_its_inputs()
    }

    fn traits(&self) -> super::Traits {
        (**self).traits()
    }

    fn uses_thread_pool(&self) -> bool {
        (**self).uses_thread_pool()
    }
}
