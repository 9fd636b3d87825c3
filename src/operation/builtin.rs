//! The body of a built-in operation: a [`Kernel`] and its operand IRs, executed by the runtime's
//! [`StreamRuntime::launch`]. Its burn IR is derived only when somebody inspects the queue.

use burn_backend::DType;
use burn_ir::{
    BinaryOpIr, FloatOperationIr, FullOpIr, MatmulOpIr, NumericOperationIr, OperationIr,
    ReduceOpIr, ScalarIr, ScalarOpIr, TensorIr, UnaryOpIr,
};

use super::{Irs, OpBody, StreamHandles, missing_handle};
use crate::Result;
use crate::runtime::{Kernel, KernelInput, StreamRuntime};

/// Runs a built-in kernel: takes the operands from the stream's handles, launches, registers the
/// output. Its burn IR is derived on demand.
///
/// `L` is the operand IRs' list as registration made it: an array for one or two operands (no
/// list header moved, nothing spilled to check on drop), a `SmallVec` otherwise.
pub(crate) struct Builtin<L> {
    pub(crate) kernel: Kernel,
    pub(crate) inputs: L,
    pub(crate) out: [TensorIr; 1],
}

impl<R: StreamRuntime, L: AsRef<[TensorIr]> + Send + Sync + 'static> OpBody<R> for Builtin<L> {
    fn name(&self) -> &str {
        self.kernel.name()
    }

    fn execute(
        &self,
        handles: &mut StreamHandles<R::FusionHandle>,
        context: &R::Context,
    ) -> Result<()> {
        let inputs = crate::small::collect(self.inputs.as_ref().iter().map(|ir| KernelInput {
            handle: handles.take(ir).unwrap_or_else(|| missing_handle(ir)),
            ir,
        }));
        let [out] = &self.out;
        let handle = R::launch(context, &self.kernel, inputs, out)?;
        handles.carry(out.id, handle);
        Ok(())
    }

    fn inputs(&self) -> Irs<'_> {
        Irs::list(self.inputs.as_ref())
    }

    fn outputs(&self) -> &[TensorIr] {
        &self.out
    }

    fn repr(&self) -> OperationIr {
        kernel_ir(&self.kernel, self.inputs.as_ref(), &self.out[0])
    }

    fn drop_runs_user_code(&self) -> bool {
        // A kernel descriptor and IRs: plain data.
        false
    }

    fn may_skip_outputs(&self) -> bool {
        // A launch that returns registers its one output; one that fails records the error.
        false
    }

    fn takes_its_inputs(&self) -> bool {
        // Through `StreamHandles::take`, as burn's `get_handle` takes them.
        true
    }
}

fn numeric(dtype: DType, op: NumericOperationIr) -> OperationIr {
    if dtype.is_float() {
        OperationIr::NumericFloat(dtype, op)
    } else {
        OperationIr::NumericInt(dtype, op)
    }
}

/// The burn IR of a built-in kernel.
fn kernel_ir(kernel: &Kernel, inputs: &[TensorIr], out: &TensorIr) -> OperationIr {
    let dtype = out.dtype;
    let out = out.clone();
    let binary = || BinaryOpIr {
        lhs: inputs[0].clone(),
        rhs: inputs[1].clone(),
        out: out.clone(),
    };
    match kernel {
        Kernel::Add => numeric(dtype, NumericOperationIr::Add(binary())),
        Kernel::Mul => numeric(dtype, NumericOperationIr::Mul(binary())),
        Kernel::Scale(factor) => numeric(
            dtype,
            NumericOperationIr::MulScalar(ScalarOpIr {
                lhs: inputs[0].clone(),
                rhs: ScalarIr::Float(*factor),
                out,
            }),
        ),
        Kernel::Exp => OperationIr::Float(
            dtype,
            FloatOperationIr::Exp(UnaryOpIr {
                input: inputs[0].clone(),
                out,
            }),
        ),
        Kernel::Sum => numeric(
            dtype,
            NumericOperationIr::Sum(ReduceOpIr {
                input: inputs[0].clone(),
                out,
            }),
        ),
        Kernel::Matmul => OperationIr::Float(
            dtype,
            FloatOperationIr::Matmul(MatmulOpIr {
                lhs: inputs[0].clone(),
                rhs: inputs[1].clone(),
                out,
            }),
        ),
        Kernel::Fill(value) => numeric(
            dtype,
            NumericOperationIr::Full(FullOpIr {
                out,
                value: ScalarIr::Float(*value),
            }),
        ),
        #[cfg(feature = "testing")]
        Kernel::FailOnDevice => OperationIr::Custom(burn_ir::CustomOpIr {
            id: "fusion_streams::fail_on_device".to_owned(),
            inputs: inputs.to_vec(),
            outputs: vec![out],
        }),
    }
}
