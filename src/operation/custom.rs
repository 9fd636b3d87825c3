//! The bodies of operations that arrive with their burn IR: a [`FallibleOperation`] (burn's
//! operations through [`super::BurnOperation`], or the crate's users') and a custom operation
//! with its [`CustomExecutor`].

use std::borrow::Cow;

use burn_fusion::FusionRuntime;
use burn_ir::{CustomOpIr, OperationIr, TensorIr};
use smallvec::SmallVec;

use super::{CustomExecutor, FallibleOperation, IntoQueued, Irs, OpBody};
use crate::Result;
use crate::runtime::StreamRuntime;

/// A [`FallibleOperation`] registered together with its IR.
pub(crate) struct WithRepr<O> {
    pub(crate) name: Cow<'static, str>,
    pub(crate) repr: OperationIr,
    pub(crate) inputs: SmallVec<[TensorIr; 2]>,
    pub(crate) outputs: SmallVec<[TensorIr; 1]>,
    pub(crate) operation: O,
}

impl<R: StreamRuntime, O: FallibleOperation<R> + 'static> IntoQueued<R> for WithRepr<O> {}

impl<R: StreamRuntime, O: FallibleOperation<R>> OpBody<R> for WithRepr<O> {
    fn name(&self) -> &str {
        &self.name
    }

    fn execute(
        &self,
        handles: &mut super::StreamHandles<R::FusionHandle>,
        _: &R::Context,
    ) -> Result<()> {
        self.operation.execute(handles.flushed())
    }

    fn inputs(&self) -> Irs<'_> {
        Irs::list(&self.inputs)
    }

    fn outputs(&self) -> &[TensorIr] {
        &self.outputs
    }

    fn repr(&self) -> OperationIr {
        self.repr.clone()
    }
}

/// A custom operation: its IR plus its executor.
pub(crate) struct CustomOperation<R: FusionRuntime, E> {
    pub(crate) ir: CustomOpIr,
    pub(crate) executor: E,
    pub(crate) _runtime: std::marker::PhantomData<fn() -> R>,
}

impl<R: StreamRuntime, E: CustomExecutor<R>> IntoQueued<R> for CustomOperation<R, E> {}

impl<R: StreamRuntime, E: CustomExecutor<R>> OpBody<R> for CustomOperation<R, E> {
    fn name(&self) -> &str {
        &self.ir.id
    }

    fn execute(
        &self,
        handles: &mut super::StreamHandles<R::FusionHandle>,
        _: &R::Context,
    ) -> Result<()> {
        self.executor.execute(&self.ir, handles.flushed())
    }

    fn inputs(&self) -> Irs<'_> {
        Irs::list(&self.ir.inputs)
    }

    fn outputs(&self) -> &[TensorIr] {
        &self.ir.outputs
    }

    fn repr(&self) -> OperationIr {
        OperationIr::Custom(self.ir.clone())
    }
}
