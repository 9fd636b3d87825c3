//! Recording one backend operation: its burn IR, and the function that runs it on the backend.
//!
//! Every operation of [`super::StreamFusion`] goes through [`record`]: the operands are handed to
//! the engine by value (so the last reference to an id is `ReadWrite`, exactly as burn-fusion's
//! `into_ir` decides it, but under the stream lock that enqueues), the operation's IR struct is
//! built from the operand IRs with fresh output ids, and a plain function runs it later on the
//! stream's thread of execution. An operation is therefore three small pieces of code: its IR
//! (burn's own builder, usually), its [`OperationIr`] variant, and its run function.

use burn_ir::{
    BackendIr, BinaryOpIr, HandleContainer, OperationIr, ScalarIr, ScalarOpIr, TensorId, TensorIr,
    UnaryOpIr,
};
use smallvec::SmallVec;

use super::runtime::BackendRuntime;
use crate::operation::OpBody;
use crate::{FusionClient, FusionTensor, Operand, Result};

/// A tensor of the stream-fusion backend over `B`.
pub type Tensor<B> = FusionTensor<BackendRuntime<B>>;
/// The handle map an operation runs against.
pub type Handles<B> = HandleContainer<<B as BackendIr>::Handle>;

/// A queued backend operation: its IR, and how to run it and describe it.
pub(crate) struct BackendOp<B: BackendIr, I> {
    pub(crate) name: &'static str,
    pub(crate) ir: I,
    inputs: SmallVec<[TensorIr; 2]>,
    outputs: SmallVec<[TensorIr; 1]>,
    run: fn(&I, &mut Handles<B>),
    repr: fn(&I) -> OperationIr,
}

impl<B: BackendIr, I: Send + Sync> OpBody<BackendRuntime<B>> for BackendOp<B, I> {
    fn name(&self) -> &str {
        self.name
    }

    fn execute(
        &self,
        handles: &mut Handles<B>,
        _: &super::runtime::BackendContext<B>,
    ) -> Result<()> {
        // A backend reports failure by panicking; the engine contains it and records it on the
        // outputs.
        (self.run)(&self.ir, handles);
        Ok(())
    }

    fn inputs(&self) -> &[TensorIr] {
        &self.inputs
    }

    fn outputs(&self) -> &[TensorIr] {
        &self.outputs
    }

    fn repr(&self) -> OperationIr {
        (self.repr)(&self.ir)
    }

    fn drop_runs_user_code(&self) -> bool {
        // Its fields are function pointers and `I`, which this crate alone chooses (`record` is
        // crate-private): a burn IR struct, with `B::Device` for creation and random ops. Both
        // are plain data; no executor capture or other user code lives in a backend op.
        false
    }
}

/// Record an operation on the current stream of `client`.
///
/// * `operands` are handed over (burn's ops take their tensors by value);
/// * `ir` builds the operation's IR struct from the operands' IRs (in order, with the statuses
///   the engine decided) and a generator of fresh output ids;
/// * `repr` wraps it in its [`OperationIr`] variant; its inputs and outputs are the engine's;
/// * `run` executes it against the stream's handles.
///
/// Returns the outputs, in the order `repr`'s IR lists them. A backend operation cannot return
/// an error, so a refusal here (only a tensor of another device can cause one) panics with the
/// engine's message, as burn's own backends do on bad input.
pub(crate) fn record<B: BackendIr, I: Send + Sync + 'static>(
    client: &FusionClient<BackendRuntime<B>>,
    name: &'static str,
    operands: impl IntoIterator<Item = Tensor<B>>,
    ir: impl FnOnce(&[TensorIr], &mut dyn FnMut() -> TensorId) -> I,
    repr: fn(&I) -> OperationIr,
    run: fn(&I, &mut Handles<B>),
) -> SmallVec<[Tensor<B>; 1]> {
    // The outputs are read off the operation's burn IR once, here, not on every use.
    let outputs = |ir: &I| repr(ir).outputs().cloned().collect();
    record_with(client, name, operands, ir, outputs, repr, run)
}

/// [`record`] with the outputs taken straight from the IR struct (the elementwise fast path:
/// no [`OperationIr`] is built just to list them).
fn record_with<B: BackendIr, I: Send + Sync + 'static>(
    client: &FusionClient<BackendRuntime<B>>,
    name: &'static str,
    operands: impl IntoIterator<Item = Tensor<B>>,
    ir: impl FnOnce(&[TensorIr], &mut dyn FnMut() -> TensorId) -> I,
    outputs: impl FnOnce(&I) -> SmallVec<[TensorIr; 1]>,
    repr: fn(&I) -> OperationIr,
    run: fn(&I, &mut Handles<B>),
) -> SmallVec<[Tensor<B>; 1]> {
    let operands = crate::small::collect(operands.into_iter().map(Operand::Consume));
    let build = |inputs: SmallVec<[TensorIr; 2]>| {
        // The operands' IRs are the operation's inputs, in order.
        let ir = ir(&inputs, &mut crate::id::fresh_tensor_id);
        Ok(Box::new(BackendOp::<B, I> {
            name,
            inputs,
            outputs: outputs(&ir),
            ir,
            run,
            repr,
        }))
    };
    match client.register(operands, build) {
        Ok(outputs) => outputs,
        Err(rejected) => panic!("{name}: {}", rejected.error),
    }
}

/// [`record_with`] for an operation whose IR has one output, `out`.
fn record_out<B: BackendIr, I: Send + Sync + 'static>(
    client: &FusionClient<BackendRuntime<B>>,
    name: &'static str,
    operands: impl IntoIterator<Item = Tensor<B>>,
    ir: impl FnOnce(&[TensorIr], &mut dyn FnMut() -> TensorId) -> I,
    out: fn(&I) -> &TensorIr,
    repr: fn(&I) -> OperationIr,
    run: fn(&I, &mut Handles<B>),
) -> Tensor<B> {
    let outputs = |ir: &I| smallvec::smallvec![out(ir).clone()];
    let mut outputs = record_with(client, name, operands, ir, outputs, repr, run);
    outputs.swap_remove(0)
}

/// [`record`] for an operation with exactly one output.
pub(crate) fn record_one<B: BackendIr, I: Send + Sync + 'static>(
    client: &FusionClient<BackendRuntime<B>>,
    name: &'static str,
    operands: impl IntoIterator<Item = Tensor<B>>,
    ir: impl FnOnce(&[TensorIr], &mut dyn FnMut() -> TensorId) -> I,
    repr: fn(&I) -> OperationIr,
    run: fn(&I, &mut Handles<B>),
) -> Tensor<B> {
    let mut outputs = record(client, name, operands, ir, repr, run);
    debug_assert_eq!(outputs.len(), 1, "{name} has one output");
    outputs.swap_remove(0)
}

/// The client a tensor's operation is recorded on.
pub(crate) fn client_of<B: BackendIr>(tensor: &Tensor<B>) -> FusionClient<BackendRuntime<B>> {
    tensor.client().clone()
}

/// An operation of one tensor operand and one output whose IR is a [`UnaryOpIr`].
pub(crate) fn unary<B: BackendIr>(
    name: &'static str,
    input: Tensor<B>,
    out_dtype: Option<burn_backend::DType>,
    repr: fn(&UnaryOpIr) -> OperationIr,
    run: fn(&UnaryOpIr, &mut Handles<B>),
) -> Tensor<B> {
    let client = client_of(&input);
    let ir = |i: &[TensorIr], id: &mut dyn FnMut() -> TensorId| match out_dtype {
        Some(dtype) => UnaryOpIr::create_comparison(i[0].clone(), dtype, id),
        None => UnaryOpIr::create(i[0].clone(), id),
    };
    record_out(&client, name, [input], ir, |ir| &ir.out, repr, run)
}

/// An operation of two tensor operands (broadcast) whose IR is a [`BinaryOpIr`]; `out_dtype`
/// for comparisons.
pub(crate) fn binary<B: BackendIr>(
    name: &'static str,
    lhs: Tensor<B>,
    rhs: Tensor<B>,
    out_dtype: Option<burn_backend::DType>,
    repr: fn(&BinaryOpIr) -> OperationIr,
    run: fn(&BinaryOpIr, &mut Handles<B>),
) -> Tensor<B> {
    let client = client_of(&lhs);
    let ir = |i: &[TensorIr], id: &mut dyn FnMut() -> TensorId| match out_dtype {
        Some(dtype) => BinaryOpIr::create_comparison(i[0].clone(), i[1].clone(), dtype, id),
        None => BinaryOpIr::create(i[0].clone(), i[1].clone(), id),
    };
    record_out(&client, name, [lhs, rhs], ir, |ir| &ir.out, repr, run)
}

/// An operation of a tensor and a scalar whose IR is a [`ScalarOpIr`]; `out_dtype` for
/// comparisons.
pub(crate) fn scalar<B: BackendIr>(
    name: &'static str,
    lhs: Tensor<B>,
    rhs: ScalarIr,
    out_dtype: Option<burn_backend::DType>,
    repr: fn(&ScalarOpIr) -> OperationIr,
    run: fn(&ScalarOpIr, &mut Handles<B>),
) -> Tensor<B> {
    let client = client_of(&lhs);
    let ir = |i: &[TensorIr], id: &mut dyn FnMut() -> TensorId| match out_dtype {
        Some(dtype) => ScalarOpIr::create_comparison(i[0].clone(), rhs, dtype, id),
        None => ScalarOpIr::create(i[0].clone(), rhs, id),
    };
    record_out(&client, name, [lhs], ir, |ir| &ir.out, repr, run)
}
