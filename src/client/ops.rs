//! The built-in operations' API: operands validated, then a [`Builtin`] queued (recorded as the
//! burn IR a burn backend would record, executed by the runtime's [`StreamRuntime::launch`]).

use burn_backend::{DType, Shape};
use burn_ir::TensorIr;

use super::{FusionClient, FusionTensor, Operand, hand_back};
use crate::error::Rejected;
use crate::operation::Builtin;
use crate::runtime::{Kernel, StreamRuntime};
use crate::small::{Arity, Fixed, Many};
use crate::{Error, Result};

fn arity(kernel: &Kernel) -> usize {
    match kernel {
        Kernel::Add | Kernel::Mul | Kernel::Matmul => 2,
        Kernel::Fill(_) => 0,
        Kernel::Scale(_) | Kernel::Exp | Kernel::Sum => 1,
        #[cfg(feature = "testing")]
        Kernel::FailOnDevice => 1,
    }
}

/// Check operand shapes and dtypes; return the output's.
fn infer_output<R: StreamRuntime>(
    kernel: &Kernel,
    operands: &[Operand<'_, R>],
) -> Result<(Shape, DType)> {
    let op = kernel.name();
    if operands.len() != arity(kernel) {
        return Err(Error::InvalidOperation {
            op: op.into(),
            detail: format!(
                "{} operand(s) given, {} expected",
                operands.len(),
                arity(kernel)
            ),
        });
    }
    let first = operands[0].tensor();
    let dtype = first.dtype();
    if let Some(other) = operands[1..]
        .iter()
        .map(Operand::tensor)
        .find(|t| t.dtype() != dtype)
    {
        return Err(Error::DTypeMismatch {
            op: op.into(),
            expected: dtype,
            found: other.dtype(),
        });
    }
    if !R::supports(kernel, dtype) {
        return Err(Error::UnsupportedDType {
            op: op.into(),
            dtype,
        });
    }
    let shape = match kernel {
        Kernel::Add | Kernel::Mul => {
            let (lhs, rhs) = (first.shape(), operands[1].tensor().shape());
            if !crate::small::same_dims(lhs, rhs) {
                return Err(Error::ShapeMismatch {
                    op: op.into(),
                    detail: format!("{:?} and {:?} differ", &lhs[..], &rhs[..]),
                });
            }
            crate::small::copy_shape(lhs)
        }
        Kernel::Matmul => {
            let (lhs, rhs) = (first.shape(), operands[1].tensor().shape());
            if lhs.num_dims() != 2 || rhs.num_dims() != 2 || lhs[1] != rhs[0] {
                return Err(Error::ShapeMismatch {
                    op: op.into(),
                    detail: format!(
                        "cannot multiply {:?} by {:?} (need [m, k] @ [k, n])",
                        &lhs[..],
                        &rhs[..]
                    ),
                });
            }
            Shape::new([lhs[0], rhs[1]])
        }
        Kernel::Sum => Shape::new([1]),
        Kernel::Scale(_) | Kernel::Exp | Kernel::Fill(_) => crate::small::copy_shape(first.shape()),
        #[cfg(feature = "testing")]
        Kernel::FailOnDevice => crate::small::copy_shape(first.shape()),
    };
    Ok((shape, dtype))
}

impl<R: StreamRuntime> FusionClient<R> {
    /// Queue a built-in kernel on the current stream. Operands may be borrowed (`&tensor`) or
    /// handed over (`tensor`, which allows in-place reuse when it is the last reference).
    ///
    /// A bad operand (wrong arity, shapes, dtypes, another client's tensor) is rejected before
    /// anything is queued, and every handed-over tensor comes back in the [`Rejected`].
    pub fn launch<'a>(
        &self,
        kernel: Kernel,
        operands: impl IntoIterator<Item = Operand<'a, R>>,
    ) -> Result<FusionTensor<R>, Rejected<FusionTensor<R>>> {
        // Every kernel but `fill` has one or two operands: they travel as arrays, which move no
        // list header and drop nothing inline (see `crate::small::Arity`); any other count is
        // refused by `infer_output`, from a list.
        let mut operands = operands.into_iter().fuse();
        match (operands.next(), operands.next(), operands.next()) {
            (Some(a), None, None) => self.launch_checked::<Fixed<1>>(kernel, [a]),
            (Some(a), Some(b), None) => self.launch_checked::<Fixed<2>>(kernel, [a, b]),
            (a, b, c) => {
                let all = crate::small::collect(a.into_iter().chain(b).chain(c).chain(operands));
                self.launch_checked::<Many>(kernel, all)
            }
        }
    }

    fn launch_checked<'a, A: Arity>(
        &self,
        kernel: Kernel,
        operands: A::List<Operand<'a, R>>,
    ) -> Result<FusionTensor<R>, Rejected<FusionTensor<R>>> {
        let checked = if matches!(kernel, Kernel::Fill(_)) {
            Err(Error::InvalidOperation {
                op: "fill".into(),
                detail: "use FusionClient::fill, which takes the shape".to_owned(),
            })
        } else {
            infer_output(&kernel, operands.as_ref())
        };
        match checked {
            Ok((shape, dtype)) => self.register_kernel::<A>(kernel, operands, shape, dtype),
            Err(error) => Err(hand_back(operands, error)),
        }
    }

    fn register_kernel<A: Arity>(
        &self,
        kernel: Kernel,
        operands: A::List<Operand<'_, R>>,
        shape: Shape,
        dtype: DType,
    ) -> Result<FusionTensor<R>, Rejected<FusionTensor<R>>> {
        // Boxed here, outside the stream's lock (see `QueuedOp`).
        let build = |inputs: A::List<TensorIr>| {
            Ok(crate::operation::pool::boxed(Builtin {
                kernel,
                inputs: A::irs(inputs),
                out: [TensorIr {
                    id: crate::id::fresh_tensor_id(),
                    shape,
                    status: burn_ir::TensorStatus::NotInit,
                    dtype,
                }],
            }))
        };
        let [out] = self.register::<A, _, _>(operands, build)?;
        Ok(out)
    }

    fn launch_ref(&self, kernel: Kernel, operands: &[&FusionTensor<R>]) -> Result<FusionTensor<R>> {
        self.launch(kernel, operands.iter().map(|t| Operand::Read(*t)))
            .map_err(Rejected::into_error)
    }

    /// A tensor of `shape` filled with `value` (queued).
    pub fn fill(
        &self,
        shape: impl Into<Shape>,
        value: f64,
        dtype: DType,
    ) -> Result<FusionTensor<R>> {
        let kernel = Kernel::Fill(value);
        if !R::supports(&kernel, dtype) {
            return Err(Error::UnsupportedDType {
                op: "fill".into(),
                dtype,
            });
        }
        self.register_kernel::<Fixed<0>>(kernel, [], shape.into(), dtype)
            .map_err(Rejected::into_error)
    }

    /// A tensor of `shape` filled with zeros (queued).
    pub fn zeros(&self, shape: impl Into<Shape>, dtype: DType) -> Result<FusionTensor<R>> {
        self.fill(shape, 0.0, dtype)
    }

    /// `lhs + rhs`, elementwise.
    pub fn add(&self, lhs: &FusionTensor<R>, rhs: &FusionTensor<R>) -> Result<FusionTensor<R>> {
        self.launch_ref(Kernel::Add, &[lhs, rhs])
    }

    /// `lhs * rhs`, elementwise.
    pub fn mul(&self, lhs: &FusionTensor<R>, rhs: &FusionTensor<R>) -> Result<FusionTensor<R>> {
        self.launch_ref(Kernel::Mul, &[lhs, rhs])
    }

    /// `input * factor`.
    pub fn scale(&self, input: &FusionTensor<R>, factor: f64) -> Result<FusionTensor<R>> {
        self.launch_ref(Kernel::Scale(factor), &[input])
    }

    /// `exp(input)`, elementwise.
    pub fn exp(&self, input: &FusionTensor<R>) -> Result<FusionTensor<R>> {
        self.launch_ref(Kernel::Exp, &[input])
    }

    /// The sum of all elements, as a tensor of shape `[1]`.
    pub fn sum(&self, input: &FusionTensor<R>) -> Result<FusionTensor<R>> {
        self.launch_ref(Kernel::Sum, &[input])
    }

    /// Matrix product of `[m, k]` and `[k, n]`.
    pub fn matmul(&self, lhs: &FusionTensor<R>, rhs: &FusionTensor<R>) -> Result<FusionTensor<R>> {
        self.launch_ref(Kernel::Matmul, &[lhs, rhs])
    }

    /// Fault injection: a copy of `input` whose kernel fails *on the device*, after dispatch.
    /// For tests of asynchronous error paths. Feature `testing`.
    #[cfg(feature = "testing")]
    pub fn fail_on_device(&self, input: &FusionTensor<R>) -> Result<FusionTensor<R>> {
        self.launch_ref(Kernel::FailOnDevice, &[input])
    }
}

/// Shorthands for the built-in operations, on the tensor's own client.
impl<R: StreamRuntime> FusionTensor<R> {
    /// `self + rhs`; see [`FusionClient::add`].
    pub fn add(&self, rhs: &Self) -> Result<Self> {
        self.client().add(self, rhs)
    }

    /// `self * rhs`; see [`FusionClient::mul`].
    pub fn mul(&self, rhs: &Self) -> Result<Self> {
        self.client().mul(self, rhs)
    }

    /// `self * factor`; see [`FusionClient::scale`].
    pub fn scale(&self, factor: f64) -> Result<Self> {
        self.client().scale(self, factor)
    }

    /// `exp(self)`; see [`FusionClient::exp`].
    pub fn exp(&self) -> Result<Self> {
        self.client().exp(self)
    }

    /// Sum of all elements; see [`FusionClient::sum`].
    pub fn sum(&self) -> Result<Self> {
        self.client().sum(self)
    }

    /// `self @ rhs`; see [`FusionClient::matmul`].
    pub fn matmul(&self, rhs: &Self) -> Result<Self> {
        self.client().matmul(self, rhs)
    }
}
