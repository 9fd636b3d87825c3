//! Recording one backend operation: its burn IR, and the function that runs it on the backend.
//!
//! Every operation of [`super::StreamFusion`] goes through [`record`]: the operands are handed to
//! the engine by value (so the last reference to an id is `ReadWrite`, exactly as burn-fusion's
//! `into_ir` decides it, but under the stream lock that enqueues), the operation's IR struct is
//! built from the operand IRs with fresh output ids, and a plain function runs it later on the
//! stream's thread of execution. An operation is therefore three small pieces of code: its IR
//! (burn's own builder, usually), its [`OperationIr`] variant, and its run function.

use burn_ir::{
    BackendIr, BinaryOpIr, CastOpIr, DimOpIr, FlipOpIr, HandleContainer, MatmulOpIr, OperationIr,
    PermuteOpIr, ReduceDimOpIr, ReduceOpIr, ScalarIr, ScalarOpIr, ShapeOpIr, SliceOpIr,
    SwapDimsOpIr, TensorHandle, TensorId, TensorIr, UnaryOpIr, UnfoldOpIr,
};
use smallvec::SmallVec;

use super::IrBackend;
use super::runtime::BackendRuntime;
use crate::operation::{Irs, OpBody};
use crate::small::{Arity, Fixed, Gather, Many};
use crate::{FusionClient, FusionTensor, Operand, Result};

/// A tensor of the stream-fusion backend over `B`.
pub type Tensor<B> = FusionTensor<BackendRuntime<B>>;
/// The handle map an operation runs against.
pub type Handles<B> = crate::operation::StreamHandles<<B as BackendIr>::Handle>;

/// The IR struct a queued backend operation runs from, and where its operands and outputs sit.
///
/// The elementwise IRs (one struct per op, most of a model's ops) are their own lists: their
/// operand and output fields are read in place, so recording one copies no IR. Any other IR
/// struct goes in a [`Listed`], which keeps the lists beside it.
pub(crate) trait OpIr: Send + Sync + 'static {
    /// What the operation's run and describe functions take.
    type Ir;
    fn ir(&self) -> &Self::Ir;
    fn inputs(&self) -> Irs<'_>;
    fn outputs(&self) -> &[TensorIr];
    /// Whether every run function of this IR takes each operand through [`Take`] (see
    /// [`OpBody::takes_its_inputs`]).
    const TAKES_ITS_INPUTS: bool;
    /// Whether the operation `name` of this IR spreads over the backend's thread pool (see
    /// [`OpBody::uses_thread_pool`]).
    fn uses_thread_pool(name: &str) -> bool;
}

/// [`OpIr`] for IR structs with one `out` field, naming where their operands are. Their run
/// functions (the op families' of `macros.rs`, and the matmuls and arg-reductions of
/// `float.rs` and `int.rs`) each take every operand through [`Take`].
macro_rules! single_output_irs {
    ($($ir:ident: |$s:ident| $inputs:expr;)*) => {$(
        impl OpIr for $ir {
            type Ir = Self;
            fn ir(&self) -> &Self {
                self
            }
            fn inputs(&self) -> Irs<'_> {
                let $s = self;
                $inputs
            }
            fn outputs(&self) -> &[TensorIr] {
                std::slice::from_ref(&self.out)
            }
            const TAKES_ITS_INPUTS: bool = true;
            fn uses_thread_pool(_: &str) -> bool {
                // Of these, only the matmuls (float and int) do; a constant per type.
                std::any::TypeId::of::<Self>() == std::any::TypeId::of::<MatmulOpIr>()
            }
        }
    )*};
}

single_output_irs! {
    UnaryOpIr: |ir| Irs::one(&ir.input);
    ScalarOpIr: |ir| Irs::one(&ir.lhs);
    BinaryOpIr: |ir| Irs::pair(&ir.lhs, &ir.rhs);
    ReduceOpIr: |ir| Irs::one(&ir.input);
    ReduceDimOpIr: |ir| Irs::one(&ir.input);
    DimOpIr: |ir| Irs::one(&ir.input);
    MatmulOpIr: |ir| Irs::pair(&ir.lhs, &ir.rhs);
    CastOpIr: |ir| Irs::one(&ir.input);
    ShapeOpIr: |ir| Irs::one(&ir.input);
    SwapDimsOpIr: |ir| Irs::one(&ir.input);
    PermuteOpIr: |ir| Irs::one(&ir.input);
    FlipOpIr: |ir| Irs::one(&ir.input);
    UnfoldOpIr: |ir| Irs::one(&ir.input);
    SliceOpIr: |ir| Irs::one(&ir.tensor);
}

/// An IR struct with its operand and output lists kept beside it (the outputs read off its
/// [`OperationIr`] once, at recording).
pub(crate) struct Listed<I> {
    ir: I,
    inputs: SmallVec<[TensorIr; 2]>,
    outputs: SmallVec<[TensorIr; 1]>,
}

impl<I> Listed<I> {
    /// `ir` with its operands `inputs`; the outputs are read off its burn IR once, here, not on
    /// every use.
    fn new(ir: I, inputs: SmallVec<[TensorIr; 2]>, repr: fn(&I) -> OperationIr) -> Self {
        let outputs = crate::small::collect(repr(&ir).outputs().map(crate::small::copy_ir));
        Self {
            ir,
            inputs,
            outputs,
        }
    }
}

impl<I: Send + Sync + 'static> OpIr for Listed<I> {
    type Ir = I;
    fn ir(&self) -> &I {
        &self.ir
    }
    fn inputs(&self) -> Irs<'_> {
        Irs::list(&self.inputs)
    }
    fn outputs(&self) -> &[TensorIr] {
        &self.outputs
    }
    // Hand-written run functions may take an operand another way, or not at all.
    const TAKES_ITS_INPUTS: bool = false;
    fn uses_thread_pool(name: &str) -> bool {
        thread_pool_op(name)
    }
}

/// Whether burn's operation `name` is one a CPU backend spreads over its thread pool: burn-
/// ndarray runs its matmuls, convolutions (deformable and transposed ones too), pooling,
/// interpolation and grid sampling, and their backward passes, through rayon; an attention is
/// made of matmuls.
fn thread_pool_op(name: &str) -> bool {
    const PREFIXES: [&str; 8] = [
        "conv",
        "deform_conv",
        "max_pool",
        "avg_pool",
        "adaptive_avg_pool",
        "interpolate",
        "grid_sample",
        "attention",
    ];
    name.ends_with("matmul") || PREFIXES.iter().any(|prefix| name.starts_with(prefix))
}

/// A queued backend operation: its IR, and how to run it and describe it.
pub(crate) struct BackendOp<B: IrBackend, L: OpIr> {
    name: &'static str,
    ir: L,
    run: fn(&L::Ir, &mut Handles<B>),
    repr: fn(&L::Ir) -> OperationIr,
}

impl<B: IrBackend, L: OpIr> OpBody<BackendRuntime<B>> for BackendOp<B, L> {
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
        (self.run)(self.ir.ir(), handles);
        Ok(())
    }

    fn inputs(&self) -> Irs<'_> {
        self.ir.inputs()
    }

    fn outputs(&self) -> &[TensorIr] {
        self.ir.outputs()
    }

    fn repr(&self) -> OperationIr {
        (self.repr)(self.ir.ir())
    }

    fn drop_runs_user_code(&self) -> bool {
        // Its fields are function pointers and an IR struct, which this crate alone chooses
        // (`record` is crate-private): a burn IR struct, with `B::Device` for creation and random
        // ops. Both are plain data; no executor capture or other user code lives in a backend op.
        false
    }

    fn may_skip_outputs(&self) -> bool {
        // Every run function registers each output its IR declares (or panics, which the engine
        // records on all of them).
        false
    }

    fn takes_its_inputs(&self) -> bool {
        L::TAKES_ITS_INPUTS
    }

    fn uses_thread_pool(&self) -> bool {
        L::uses_thread_pool(self.name)
    }
}

/// Record an operation on the current stream of its first operand's client.
///
/// * `operands` are handed over (burn's ops take their tensors by value);
/// * `ir` builds the operation's IR struct from the operands' IRs (in order, with the statuses
///   the engine decided) and a generator of fresh output ids;
/// * `repr` wraps it in its [`OperationIr`] variant; its inputs and outputs are the engine's;
/// * `run` executes it against the stream's handles.
///
/// Returns the `K` outputs, in the order `repr`'s IR lists them. A backend operation cannot
/// return an error, so a refusal here (only a tensor of another device can cause one) panics
/// with the engine's message, as burn's own backends do on bad input. An operation without
/// operands (a creation op), or with optional ones, names its client: [`record_on`].
pub(crate) fn record<B: IrBackend, I: Send + Sync + 'static, const N: usize, const K: usize>(
    name: &'static str,
    operands: [Tensor<B>; N],
    ir: impl FnOnce([TensorIr; N], &mut dyn FnMut() -> TensorId) -> I,
    repr: fn(&I) -> OperationIr,
    run: fn(&I, &mut Handles<B>),
) -> [Tensor<B>; K] {
    let client = first_client(&operands);
    record_ir::<B, _, Fixed<N>, _>(
        &client,
        name,
        crate::small::map_array(operands, Operand::Consume),
        listed(ir, repr),
        repr,
        run,
    )
}

/// [`record`] for an operation with exactly one output.
pub(crate) fn record_one<B: IrBackend, I: Send + Sync + 'static, const N: usize>(
    name: &'static str,
    operands: [Tensor<B>; N],
    ir: impl FnOnce([TensorIr; N], &mut dyn FnMut() -> TensorId) -> I,
    repr: fn(&I) -> OperationIr,
    run: fn(&I, &mut Handles<B>),
) -> Tensor<B> {
    let [out] = record(name, operands, ir, repr, run);
    out
}

/// [`record`] on the current stream of `client`: for operations whose operands do not name it
/// (creation ops have none; optional operands make a list).
pub(crate) fn record_on<B: IrBackend, I: Send + Sync + 'static>(
    client: &FusionClient<BackendRuntime<B>>,
    name: &'static str,
    operands: impl IntoIterator<Item = Tensor<B>>,
    ir: impl FnOnce(&[TensorIr], &mut dyn FnMut() -> TensorId) -> I,
    repr: fn(&I) -> OperationIr,
    run: fn(&I, &mut Handles<B>),
) -> SmallVec<[Tensor<B>; 1]> {
    let operands = crate::small::collect(operands.into_iter().map(Operand::Consume));
    let ir = |inputs: SmallVec<[TensorIr; 2]>, id: &mut dyn FnMut() -> TensorId| {
        let ir = ir(&inputs, id);
        Listed::new(ir, inputs, repr)
    };
    record_ir::<B, _, Many, _>(client, name, operands, ir, repr, run)
}

/// An IR builder for a [`Listed`] IR of `N` operands, which takes them by value: the list beside
/// the struct is a copy.
fn listed<I: Send + Sync + 'static, const N: usize>(
    ir: impl FnOnce([TensorIr; N], &mut dyn FnMut() -> TensorId) -> I,
    repr: fn(&I) -> OperationIr,
) -> impl FnOnce([TensorIr; N], &mut dyn FnMut() -> TensorId) -> Listed<I> {
    move |inputs, id| {
        let copies = crate::small::collect(inputs.iter().map(crate::small::copy_ir));
        Listed::new(ir(inputs, id), copies, repr)
    }
}

/// The client of an operation's first operand: the stream it is recorded on.
fn first_client<B: IrBackend, const N: usize>(
    operands: &[Tensor<B>; N],
) -> FusionClient<BackendRuntime<B>> {
    const {
        assert!(
            N > 0,
            "an operation without operands names its client: `record_on`"
        )
    };
    operands[0].client().clone()
}

/// [`record`] for an IR struct that lists its own operands and outputs ([`OpIr`]): `ir` takes
/// the operand IRs by value, to move them into the struct. The outputs come back as `O` (an
/// array when the caller knows how many there are).
fn record_ir<B: IrBackend, L: OpIr, A: Arity, O: Gather<Tensor<B>>>(
    client: &FusionClient<BackendRuntime<B>>,
    name: &'static str,
    operands: A::List<Operand<'static, BackendRuntime<B>>>,
    ir: impl FnOnce(A::List<TensorIr>, &mut dyn FnMut() -> TensorId) -> L,
    repr: fn(&L::Ir) -> OperationIr,
    run: fn(&L::Ir, &mut Handles<B>),
) -> O {
    let build = |inputs| {
        // The operands' IRs are the operation's inputs, in order.
        let ir = ir(inputs, &mut crate::id::fresh_tensor_id);
        Ok(crate::operation::pool::boxed(BackendOp::<B, L> {
            name,
            ir,
            run,
            repr,
        }))
    };
    match client.register::<A, _, O>(operands, build) {
        Ok(outputs) => outputs,
        Err(rejected) => panic!("{name}: {}", rejected.error),
    }
}

/// [`record_ir`] for an operation of `N` operands and one output, whose IR struct lists its own
/// operands and output ([`OpIr`]: the elementwise IRs, reductions, matmul). Unlike
/// [`record_one`], which keeps lists beside any IR struct, it copies no IR: recording a matmul
/// or a reduction through `record_one` built the operation's whole `OperationIr` (a clone of
/// the struct, its shapes and a boxed iterator) once just to read its output.
pub(crate) fn record_out<B: IrBackend, L: OpIr, const N: usize>(
    name: &'static str,
    operands: [Tensor<B>; N],
    ir: impl FnOnce([TensorIr; N], &mut dyn FnMut() -> TensorId) -> L,
    repr: fn(&L::Ir) -> OperationIr,
    run: fn(&L::Ir, &mut Handles<B>),
) -> Tensor<B> {
    let client = first_client(&operands);
    let [out] = record_ir::<B, L, Fixed<N>, _>(
        &client,
        name,
        crate::small::map_array(operands, Operand::Consume),
        ir,
        repr,
        run,
    );
    out
}

/// An operation without operands (a creation op) with one output, on the current stream of
/// `client`: `ir` gets a generator of fresh output ids.
pub(crate) fn create<B: IrBackend, I: Send + Sync + 'static>(
    client: &FusionClient<BackendRuntime<B>>,
    name: &'static str,
    ir: impl FnOnce(&mut dyn FnMut() -> TensorId) -> I,
    repr: fn(&I) -> OperationIr,
    run: fn(&I, &mut Handles<B>),
) -> Tensor<B> {
    let ir = listed(move |[], id| ir(id), repr);
    let [out] = record_ir::<B, _, Fixed<0>, _>(client, name, [], ir, repr, run);
    out
}

/// An output of `input`'s shape (burn's unary and scalar builders clone it the slow way).
#[inline(always)]
fn same_shape(input: &TensorIr, dtype: Option<burn_backend::DType>, id: TensorId) -> TensorIr {
    TensorIr::uninit(
        id,
        crate::small::copy_shape(&input.shape),
        dtype.unwrap_or(input.dtype),
    )
}

/// An operation of one tensor operand whose output has its shape, and `out_dtype` or its dtype:
/// `build` makes the IR from the operand's IR and the output's.
fn same_shape_op<B: IrBackend, L: OpIr>(
    name: &'static str,
    input: Tensor<B>,
    out_dtype: Option<burn_backend::DType>,
    build: impl FnOnce(TensorIr, TensorIr) -> L,
    repr: fn(&L::Ir) -> OperationIr,
    run: fn(&L::Ir, &mut Handles<B>),
) -> Tensor<B> {
    let ir = |[input]: [TensorIr; 1], id: &mut dyn FnMut() -> TensorId| {
        let out = same_shape(&input, out_dtype, id());
        build(input, out)
    };
    record_out(name, [input], ir, repr, run)
}

/// An operation of one tensor operand and one output whose IR is a [`UnaryOpIr`].
pub(crate) fn unary<B: IrBackend>(
    name: &'static str,
    input: Tensor<B>,
    out_dtype: Option<burn_backend::DType>,
    repr: fn(&UnaryOpIr) -> OperationIr,
    run: fn(&UnaryOpIr, &mut Handles<B>),
) -> Tensor<B> {
    let build = |input, out| UnaryOpIr { input, out };
    same_shape_op(name, input, out_dtype, build, repr, run)
}

/// An operation of two tensor operands (broadcast) whose IR is a [`BinaryOpIr`]; `out_dtype`
/// for comparisons.
pub(crate) fn binary<B: IrBackend>(
    name: &'static str,
    lhs: Tensor<B>,
    rhs: Tensor<B>,
    out_dtype: Option<burn_backend::DType>,
    repr: fn(&BinaryOpIr) -> OperationIr,
    run: fn(&BinaryOpIr, &mut Handles<B>),
) -> Tensor<B> {
    let ir = |[lhs, rhs]: [TensorIr; 2], id: &mut dyn FnMut() -> TensorId| match out_dtype {
        Some(dtype) => BinaryOpIr::create_comparison(lhs, rhs, dtype, id),
        None => BinaryOpIr::create(lhs, rhs, id),
    };
    record_out(name, [lhs, rhs], ir, repr, run)
}

/// An operation of a tensor and a scalar whose IR is a [`ScalarOpIr`]; `out_dtype` for
/// comparisons.
pub(crate) fn scalar<B: IrBackend>(
    name: &'static str,
    lhs: Tensor<B>,
    rhs: ScalarIr,
    out_dtype: Option<burn_backend::DType>,
    repr: fn(&ScalarOpIr) -> OperationIr,
    run: fn(&ScalarOpIr, &mut Handles<B>),
) -> Tensor<B> {
    let build = |lhs, out| ScalarOpIr { lhs, rhs, out };
    same_shape_op(name, lhs, out_dtype, build, repr, run)
}

/// burn's `HandleContainer::get_{float,int,bool}_tensor`, with the tensor's shape copied the
/// cheap way (see [`crate::small::copy_shape`]): the run functions of every operation take their
/// operands through these.
pub(crate) trait Take<H> {
    fn take_float<B: IrBackend<Handle = H>>(&mut self, ir: &TensorIr) -> B::FloatTensorPrimitive;
    fn take_int<B: IrBackend<Handle = H>>(&mut self, ir: &TensorIr) -> B::IntTensorPrimitive;
    fn take_bool<B: IrBackend<Handle = H>>(&mut self, ir: &TensorIr) -> B::BoolTensorPrimitive;

    /// [`Take::take_float`] of several operands, in order.
    fn take_floats<B: IrBackend<Handle = H>, const N: usize>(
        &mut self,
        irs: [&TensorIr; N],
    ) -> [B::FloatTensorPrimitive; N] {
        irs.map(|ir| self.take_float::<B>(ir))
    }
}

/// Where a run function takes its operands from: the stream's handles, or a fused kernel's
/// container (its fallbacks).
pub(crate) trait Source<H: Clone> {
    /// `ir`'s handle with its shape, taken for an operation as
    /// [`crate::operation::StreamHandles::take`] does (its shape copied the cheap way).
    fn take_tensor(&mut self, ir: &TensorIr) -> TensorHandle<H>;
}

impl<H: Clone> Source<H> for crate::operation::StreamHandles<H> {
    #[inline(always)]
    fn take_tensor(&mut self, ir: &TensorIr) -> TensorHandle<H> {
        crate::operation::StreamHandles::take_tensor(self, ir)
    }
}

impl<H: Clone> Source<H> for HandleContainer<H> {
    #[inline]
    fn take_tensor(&mut self, ir: &TensorIr) -> TensorHandle<H> {
        match crate::operation::take_from(self, ir) {
            Some(handle) => TensorHandle {
                handle,
                shape: crate::small::copy_shape(&ir.shape),
            },
            None => crate::operation::missing_handle(ir),
        }
    }
}

impl<H: Clone, S: Source<H>> Take<H> for S {
    fn take_float<B: IrBackend<Handle = H>>(&mut self, ir: &TensorIr) -> B::FloatTensorPrimitive {
        B::float_tensor(self.take_tensor(ir))
    }

    fn take_int<B: IrBackend<Handle = H>>(&mut self, ir: &TensorIr) -> B::IntTensorPrimitive {
        B::int_tensor(self.take_tensor(ir))
    }

    fn take_bool<B: IrBackend<Handle = H>>(&mut self, ir: &TensorIr) -> B::BoolTensorPrimitive {
        B::bool_tensor(self.take_tensor(ir))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One batch of elementwise operations on NdArray, each run through
    /// `OpBody::execute_then_drop` (one call through its `dyn` table that runs it and drops
    /// it), one of them failing: the results before it are right, the failure is recorded on
    /// its output and travels to what reads it, and the stream goes on working. Small enough to
    /// run under miri (`cargo miri test --lib -- backend::record`), which checks the in-place
    /// drops and the kept allocations.
    #[test]
    fn a_batch_runs_each_operation_through_one_call_and_keeps_a_failure_on_its_outputs() {
        use burn_tensor::{Int, Tensor};
        type Ours = super::super::StreamFusion<burn_ndarray::NdArray>;

        let device = Default::default();
        let x = Tensor::<Ours, 1>::from_data([1.0, -2.0], &device);
        let y = -((x * 2.0).abs() + 0.5);
        let y = y.abs();
        let a = Tensor::<Ours, 1, Int>::from_data([4, 2], &device);
        let zero = Tensor::<Ours, 1, Int>::from_data([0, 0], &device);
        let failed = (a / zero).float() * 2.0;
        let after = y.clone() * 4.0;
        let error = failed.try_into_data().unwrap_err().to_string();
        assert!(error.contains("int_div"), "{error}");
        // Exact in f32 (no transcendental function, whose results miri perturbs on purpose).
        assert_eq!(y.into_data().to_vec::<f32>().unwrap(), vec![2.5, 4.5]);
        assert_eq!(after.into_data().to_vec::<f32>().unwrap(), vec![10.0, 18.0]);
    }

    #[test]
    fn the_operations_burn_ndarray_runs_on_rayon_use_the_thread_pool() {
        for name in [
            "float_matmul",
            "int_matmul",
            "conv2d",
            "conv_transpose1d",
            "deform_conv2d_backward",
            "max_pool2d_with_indices",
            "avg_pool2d_backward",
            "adaptive_avg_pool2d",
            "interpolate",
            "attention",
        ] {
            assert!(thread_pool_op(name), "{name}");
        }
        for name in [
            "float_add",
            "float_tanh",
            "float_sum_dim",
            "relu",
            "softmax",
            "rfft",
        ] {
            assert!(!thread_pool_op(name), "{name}");
        }
        assert!(<MatmulOpIr as OpIr>::uses_thread_pool("anything"));
        assert!(!<BinaryOpIr as OpIr>::uses_thread_pool("float_matmul"));
    }
}
