//! Running a fused kernel, and the fallbacks it may call: the backend's own matmul or
//! reduction on the run's handles.

use super::*;

/// Run the fused kernel over the stream's handles and the run's relative maps, which the context
/// owns for the call and always gives back (a panic included: it becomes the run's error). The
/// maps come back to be refilled by the next fused run, not reallocated.
pub(super) fn run<R: CubeRuntime, B: BackendIr<Handle = CubeFusionHandle<R>> + 'static>(
    optimization: &mut CubeOptimization<R>,
    fallbacks: &[(usize, OperationIr)],
    relative: &mut Relative,
    handles: &mut HandleContainer<CubeFusionHandle<R>>,
) -> Result<()> {
    let maps = relative.lend();
    let mut context = Context {
        tensors: maps.tensors,
        handles: std::mem::take(handles),
        scalars: maps.scalars,
        shapes_relative2global: maps.shapes,
    };
    // The operation at `index` in the run, run unfused by the backend.
    let fallback = |index: usize| -> Box<dyn FallbackOperation<R>> {
        let op = fallbacks.iter().find(|(i, _)| *i == index);
        Box::new(Fallback::<B> {
            op: op.map(|(_, op)| op.clone()),
            backend: PhantomData,
        })
    };
    let outcome = catch_unwind(AssertUnwindSafe(|| match optimization {
        CubeOptimization::ElementWise(elementwise) => elementwise.execute(&mut context),
        CubeOptimization::Matmul(matmul) => matmul.execute(&mut context, fallback),
        CubeOptimization::Reduce(reduce) => reduce.execute(&mut context, fallback),
        CubeOptimization::ReduceBroadcasted(reduce) => reduce.execute(&mut context, fallback),
    }));
    *handles = context.handles;
    relative.give_back(ContextMaps {
        tensors: context.tensors,
        scalars: context.scalars,
        shapes: context.shapes_relative2global,
    });
    outcome.map_err(|payload| Error::from_kernel_panic("fused kernel", payload))
}

/// A run's matmul or reduction, run by the backend on the run's handles (global ids): what
/// burn's matmul and reduce optimizations run when their fused kernel does not apply, or while
/// autotuning. The same backend calls as the unfused operation's (`src/backend/float.rs`,
/// `int.rs`).
pub(super) struct Fallback<B> {
    pub(super) op: Option<OperationIr>,
    pub(super) backend: PhantomData<fn() -> B>,
}

impl<R: CubeRuntime, B: BackendIr<Handle = CubeFusionHandle<R>> + 'static> FallbackOperation<R>
    for Fallback<B>
{
    fn run(&self, context: &mut Context<CubeFusionHandle<R>>) {
        use NumericOperationIr as N;
        let h = &mut context.handles;
        let float = reduce_float::<R, B>;
        let int = reduce_int::<R, B>;
        match &self.op {
            Some(OperationIr::Float(_, FloatOperationIr::Matmul(ir))) => {
                let out = B::float_matmul(h.take_float::<B>(&ir.lhs), h.take_float::<B>(&ir.rhs));
                h.register_float_tensor::<B>(&ir.out.id, out);
            }
            Some(OperationIr::NumericFloat(_, op)) => match op {
                N::SumDim(ir) => float(h, ir, B::float_sum_dim),
                N::MeanDim(ir) => float(h, ir, B::float_mean_dim),
                N::ProdDim(ir) => float(h, ir, B::float_prod_dim),
                N::MaxDim(ir) => float(h, ir, B::float_max_dim),
                N::MinDim(ir) => float(h, ir, B::float_min_dim),
                N::MaxAbsDim(ir) => float(h, ir, B::float_max_abs_dim),
                N::ArgMax(ir) | N::ArgMin(ir) => {
                    let x = h.take_float::<B>(&ir.input);
                    let out = match op {
                        N::ArgMax(_) => B::float_argmax(x, ir.axis, ir.out.dtype.into()),
                        _ => B::float_argmin(x, ir.axis, ir.out.dtype.into()),
                    };
                    h.register_int_tensor::<B>(&ir.out.id, out);
                }
                op => panic!("no unfused fallback for {op:?}"),
            },
            Some(OperationIr::NumericInt(_, op)) => match op {
                N::SumDim(ir) => int(h, ir, B::int_sum_dim),
                N::MeanDim(ir) => int(h, ir, B::int_mean_dim),
                N::ProdDim(ir) => int(h, ir, B::int_prod_dim),
                N::MaxDim(ir) => int(h, ir, B::int_max_dim),
                N::MinDim(ir) => int(h, ir, B::int_min_dim),
                N::MaxAbsDim(ir) => int(h, ir, B::int_max_abs_dim),
                N::ArgMax(ir) => int(h, ir, B::int_argmax),
                N::ArgMin(ir) => int(h, ir, B::int_argmin),
                op => panic!("no unfused fallback for {op:?}"),
            },
            op => panic!("no unfused fallback for {op:?}"),
        }
    }
}

/// `f(input, axis)` of a float reduction, registered as its output.
pub(super) fn reduce_float<R: CubeRuntime, B: BackendIr<Handle = CubeFusionHandle<R>>>(
    handles: &mut HandleContainer<CubeFusionHandle<R>>,
    ir: &ReduceDimOpIr,
    f: fn(FloatTensor<B>, usize) -> FloatTensor<B>,
) {
    let out = f(handles.take_float::<B>(&ir.input), ir.axis);
    handles.register_float_tensor::<B>(&ir.out.id, out);
}

/// `f(input, axis)` of an int reduction, registered as its output.
pub(super) fn reduce_int<R: CubeRuntime, B: BackendIr<Handle = CubeFusionHandle<R>>>(
    handles: &mut HandleContainer<CubeFusionHandle<R>>,
    ir: &ReduceDimOpIr,
    f: fn(IntTensor<B>, usize) -> IntTensor<B>,
) {
    let out = f(handles.take_int::<B>(&ir.input), ir.axis);
    handles.register_int_tensor::<B>(&ir.out.id, out);
}
