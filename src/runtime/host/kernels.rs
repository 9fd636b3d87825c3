//! The built-in kernels, computed on the host device's worker threads.

use burn_backend::{DType, Shape};

use crate::runtime::Kernel;
use crate::{Error, Result};

/// The contents of a host buffer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum HostData {
    /// Allocated by a kernel that has not run yet.
    Unwritten,
    F32(Vec<f32>),
    I32(Vec<i32>),
}

impl HostData {
    pub(crate) fn len(&self) -> usize {
        match self {
            HostData::Unwritten => 0,
            HostData::F32(v) => v.len(),
            HostData::I32(v) => v.len(),
        }
    }

    pub(crate) fn dtype(&self) -> Option<DType> {
        match self {
            HostData::Unwritten => None,
            HostData::F32(_) => Some(DType::F32),
            HostData::I32(_) => Some(DType::I32),
        }
    }
}

/// Whether the host device implements `kernel` for `dtype`.
pub(crate) fn supports(kernel: &Kernel, dtype: DType) -> bool {
    match kernel {
        Kernel::Add | Kernel::Mul | Kernel::Sum | Kernel::Fill(_) => {
            matches!(dtype, DType::F32 | DType::I32)
        }
        #[cfg(feature = "testing")]
        Kernel::FailOnDevice => matches!(dtype, DType::F32 | DType::I32),
        Kernel::Scale(_) | Kernel::Exp | Kernel::Matmul => dtype == DType::F32,
    }
}

/// Whether `kernel` can write its output over its first input.
pub(crate) fn elementwise(kernel: &Kernel) -> bool {
    matches!(
        kernel,
        Kernel::Add | Kernel::Mul | Kernel::Scale(_) | Kernel::Exp
    )
}

fn kernel_error(kernel: &Kernel, message: impl Into<String>) -> Error {
    Error::KernelFailed {
        kernel: kernel.name().into(),
        message: message.into().into(),
    }
}

/// A kernel's output buffer, allocated fallibly: a shape too large for memory is a kernel
/// failure on the tensor ([`Error::OutOfMemory`]), never a process abort.
fn output<T>(kernel: &Kernel, values: impl ExactSizeIterator<Item = T>) -> Result<Vec<T>> {
    let mut out = crate::size::try_vec(kernel.name(), values.len())?;
    out.extend(values);
    Ok(out)
}

fn zip_with<T: Copy>(kernel: &Kernel, a: &[T], b: &[T], f: impl Fn(T, T) -> T) -> Result<Vec<T>> {
    output(kernel, a.iter().zip(b).map(|(x, y)| f(*x, *y)))
}

fn map<T: Copy>(kernel: &Kernel, a: &[T], f: impl Fn(T) -> T) -> Result<Vec<T>> {
    output(kernel, a.iter().map(|x| f(*x)))
}

fn filled<T: Copy>(kernel: &Kernel, len: usize, value: T) -> Result<Vec<T>> {
    output(kernel, std::iter::repeat_n(value, len))
}

/// Compute `kernel` over `inputs` into a new buffer of `out_shape`.
pub(crate) fn compute(
    kernel: &Kernel,
    inputs: &[&HostData],
    out_shape: &Shape,
    out_dtype: DType,
) -> Result<HostData> {
    use HostData::{F32, I32};
    let out = match (kernel, inputs) {
        (Kernel::Add, [F32(a), F32(b)]) => F32(zip_with(kernel, a, b, |x, y| x + y)?),
        (Kernel::Add, [I32(a), I32(b)]) => I32(zip_with(kernel, a, b, i32::wrapping_add)?),
        (Kernel::Mul, [F32(a), F32(b)]) => F32(zip_with(kernel, a, b, |x, y| x * y)?),
        (Kernel::Mul, [I32(a), I32(b)]) => I32(zip_with(kernel, a, b, i32::wrapping_mul)?),
        (Kernel::Scale(f), [F32(a)]) => F32(map(kernel, a, |x| x * *f as f32)?),
        (Kernel::Exp, [F32(a)]) => F32(map(kernel, a, f32::exp)?),
        // Sequential, in element order and in f32: the order the CUDA kernel uses.
        (Kernel::Sum, [F32(a)]) => F32(vec![a.iter().fold(0.0f32, |s, x| s + x)]),
        (Kernel::Sum, [I32(a)]) => I32(vec![a.iter().fold(0i32, |s, x| s.wrapping_add(*x))]),
        (Kernel::Matmul, [F32(a), F32(b)]) => {
            let (m, n) = (out_shape[0], out_shape[1]);
            let k = a.len().checked_div(m).unwrap_or(0);
            // `m * n` is the output's element count, checked when the operation was registered.
            let mut c = filled(kernel, m * n, 0.0f32)?;
            for i in 0..m {
                for p in 0..k {
                    let x = a[i * k + p];
                    let row = &b[p * n..(p + 1) * n];
                    for (acc, y) in c[i * n..(i + 1) * n].iter_mut().zip(row) {
                        *acc += x * y;
                    }
                }
            }
            F32(c)
        }
        (Kernel::Fill(v), []) => match out_dtype {
            DType::F32 => F32(filled(kernel, out_shape.num_elements(), *v as f32)?),
            DType::I32 => I32(filled(kernel, out_shape.num_elements(), *v as i32)?),
            other => return Err(kernel_error(kernel, format!("unsupported dtype {other:?}"))),
        },
        #[cfg(feature = "testing")]
        (Kernel::FailOnDevice, [_]) => {
            return Err(kernel_error(kernel, "injected device fault"));
        }
        (kernel, inputs) => {
            let found: Vec<_> = inputs.iter().map(|d| d.dtype()).collect();
            return Err(kernel_error(
                kernel,
                format!("no host kernel for inputs {found:?}"),
            ));
        }
    };
    if out.len() != out_shape.num_elements() {
        return Err(kernel_error(
            kernel,
            format!("produced {} elements for shape {:?}", out.len(), out_shape),
        ));
    }
    Ok(out)
}

/// Compute an elementwise `kernel` writing over `first` (the reused input buffer).
pub(crate) fn compute_in_place(
    kernel: &Kernel,
    mut first: HostData,
    rest: &[&HostData],
    out_shape: &Shape,
    out_dtype: DType,
) -> Result<HostData> {
    use HostData::{F32, I32};
    match (kernel, &mut first, rest) {
        (Kernel::Add, F32(a), [F32(b)]) => a.iter_mut().zip(b).for_each(|(x, y)| *x += y),
        (Kernel::Add, I32(a), [I32(b)]) => a
            .iter_mut()
            .zip(b)
            .for_each(|(x, y)| *x = x.wrapping_add(*y)),
        (Kernel::Mul, F32(a), [F32(b)]) => a.iter_mut().zip(b).for_each(|(x, y)| *x *= y),
        (Kernel::Mul, I32(a), [I32(b)]) => a
            .iter_mut()
            .zip(b)
            .for_each(|(x, y)| *x = x.wrapping_mul(*y)),
        (Kernel::Scale(f), F32(a), []) => a.iter_mut().for_each(|x| *x *= *f as f32),
        (Kernel::Exp, F32(a), []) => a.iter_mut().for_each(|x| *x = x.exp()),
        _ => {
            let mut inputs = vec![&first];
            inputs.extend_from_slice(rest);
            return compute(kernel, &inputs, out_shape, out_dtype);
        }
    }
    Ok(first)
}
