//! Softmax and log-softmax along one axis as one kernel, for `StreamFusion<CubeBackend>` streams
//! that fuse.
//!
//! burn's `softmax` is a backend operation whose default (the one `CubeBackend` keeps) is five:
//! the row maximum, a broadcast subtraction, `exp`, the row sum and a broadcast division, each
//! its own launch. On small tensors read back often these rows are bound by host work, about
//! 48k instructions per launch between the calling thread and cubecl's server thread (counted
//! with callgrind on the H200, docs/BENCHMARKS.md), and burn-cubecl-fusion's broadcasted reduce
//! fuser still launches three kernels for them. Here each row is reduced by the units of one
//! plane (a warp), or of a whole cube when rows are long or few: the maximum, then the sum of
//! `exp(x - max)`, then `exp(x - max) / sum` written out. The input is read three times and
//! written once, against five reads and three writes op by op; the value of every element is
//! the same function of the same operands, only the sum may be accumulated in another order.
//! burn's `log_softmax` (six operations by default: `(x - max) - ln(sum(exp(x - max)))`, what
//! cross-entropy losses call) is the same kernel writing `(x - max) - ln(sum)` instead.
//!
//! Arithmetic is in `f32` whatever the element type (`f16` and `bf16` sums of many terms lose
//! too much otherwise); other element types (`f64`, quantized) and devices without plane
//! operations of a fixed size run burn's default instead.

use burn_backend::{DType, TensorMetadata};
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::features::Plane;
use cubecl::prelude::*;

use super::*;
use crate::backend::SoftmaxKind;

/// Planes per cube: rows per cube when each plane takes a row, planes per row when the whole
/// cube takes one.
const PLANES: u32 = 8;

/// The most cubes one launch asks for; past that each cube takes several rows in turn.
const MAX_CUBES: usize = 65_535;

/// Softmax (or log-softmax, `kind`) of `tensor` along `dim` on the device, one kernel: the
/// kernel this crate registers for `StreamFusion<CubeBackend<R, ..>>` streams that fuse (see the
/// module docs); burn's default where the kernel does not apply (an element type other than
/// `f32`, `f16` and `bf16`, an empty tensor, a device without fixed-size plane operations).
pub fn softmax<R, F, I, BT>(tensor: CubeTensor<R>, dim: usize, kind: SoftmaxKind) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    use burn_backend::ops::ActivationOps;
    match plane_size(&tensor) {
        Some(plane) if dim < tensor.meta.num_dims() => launch(tensor, dim, plane, kind),
        _ => match kind {
            SoftmaxKind::Softmax => CubeBackend::<R, F, I, BT>::softmax(tensor, dim),
            SoftmaxKind::LogSoftmax => CubeBackend::<R, F, I, BT>::log_softmax(tensor, dim),
        },
    }
}

/// The device's plane size, if the kernel can run on `tensor`.
fn plane_size<R: CubeRuntime>(tensor: &CubeTensor<R>) -> Option<u32> {
    if !matches!(tensor.dtype, DType::F32 | DType::F16 | DType::BF16)
        || tensor.meta.num_elements() == 0
    {
        return None;
    }
    let properties = tensor.client.properties();
    let hardware = &properties.hardware;
    (properties.features.plane.contains(Plane::Ops)
        && hardware.plane_size_min == hardware.plane_size_max
        && hardware.plane_size_max > 0
        && hardware
            .plane_size_max
            .checked_mul(PLANES)
            .is_some_and(|units| units <= hardware.max_units_per_cube))
    .then_some(hardware.plane_size_max)
}

/// Launch the kernel: in place when `tensor` is contiguous and nothing else holds its buffer.
fn launch<R: CubeRuntime>(
    tensor: CubeTensor<R>,
    dim: usize,
    plane: u32,
    kind: SoftmaxKind,
) -> CubeTensor<R> {
    let n = tensor.meta.shape()[dim];
    let rows = tensor.meta.num_elements() / n;
    // A plane per row while there are enough rows to fill the device and rows are short;
    // otherwise a cube per row.
    let wide = n >= 4096 || (n >= 256 && rows < 2048);
    let rows_per_cube = if wide { 1 } else { PLANES as usize };
    let cubes = rows.div_ceil(rows_per_cube).min(MAX_CUBES) as u32;
    let client = tensor.client.clone();
    let dtype = tensor.dtype;
    let in_place = tensor.can_mut() && tensor.is_contiguous();
    let output = if in_place {
        None
    } else {
        Some(empty_device_dtype(
            client.clone(),
            tensor.device.clone(),
            tensor.shape(),
            dtype,
        ))
    };
    let address = match &output {
        Some(output) => tensor
            .required_address_type()
            .max(output.required_address_type()),
        None => tensor.required_address_type(),
    };
    let output_arg = match &output {
        Some(output) => output.clone().into_tensor_arg(),
        None => tensor.as_tensor_alias(0),
    };
    // SAFETY: every index the kernel reads or writes is an offset the tensors' own shapes and
    // strides give for a row below `rows` and a position below the axis' size.
    unsafe {
        softmax_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(cubes, 1, 1),
            CubeDim::new_2d(plane, PLANES),
            address,
            tensor.clone().into_tensor_arg(),
            output_arg,
            dim,
            rows,
            PLANES as usize,
            wide,
            kind == SoftmaxKind::LogSoftmax,
            dtype.into(),
        );
    }
    output.unwrap_or(tensor)
}

/// Softmax (log-softmax when `log`) along `axis` of `input` into `output` (see the module docs):
/// `rows` rows, each taken by one plane (`wide` false, `planes` rows per cube) or by the cube's
/// `planes` planes.
#[cube(launch_unchecked, address_type = "dynamic")]
fn softmax_kernel<F: Float>(
    input: &Tensor<F>,
    output: &mut Tensor<F>,
    axis: usize,
    rows: usize,
    #[comptime] planes: usize,
    #[comptime] wide: bool,
    #[comptime] log: bool,
    #[define(F)] _dtype: StorageType,
) {
    let plane = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let plane_dim = CUBE_DIM_X as usize;
    let mut unit = lane;
    let mut units = plane_dim;
    let mut row = CUBE_POS * planes + plane;
    let mut row_step = CUBE_COUNT * planes;
    if wide {
        unit = plane * plane_dim + lane;
        units = planes * plane_dim;
        row = CUBE_POS;
        row_step = CUBE_COUNT;
    }
    let mut partials = SharedMemory::<f32>::new(planes);

    let n = input.shape(axis);
    let in_step = input.stride(axis);
    let out_step = output.stride(axis);
    let rank = input.rank();

    // The whole plane (the whole cube when `wide`) takes the same rows, so the plane operations
    // and barriers below are reached by all of its units together.
    while row < rows {
        let mut rest = row;
        let mut in_at = 0;
        let mut out_at = 0;
        for k in 0..rank {
            let d = rank - 1 - k;
            if d != axis {
                let size = input.shape(d);
                let coordinate = rest % size;
                rest /= size;
                in_at += coordinate * input.stride(d);
                out_at += coordinate * output.stride(d);
            }
        }

        let mut top = f32::min_value();
        let mut j = unit;
        while j < n {
            top = max(top, f32::cast_from(input[in_at + j * in_step]));
            j += units;
        }
        top = plane_max(top);
        if wide {
            top = across_planes(top, &mut partials, planes, false);
        }

        let mut sum = 0.0f32;
        j = unit;
        while j < n {
            sum += f32::exp(f32::cast_from(input[in_at + j * in_step]) - top);
            j += units;
        }
        sum = plane_sum(sum);
        if wide {
            sum = across_planes(sum, &mut partials, planes, true);
        }

        j = unit;
        if log {
            let log_sum = f32::ln(sum);
            while j < n {
                let shifted = f32::cast_from(input[in_at + j * in_step]) - top;
                output[out_at + j * out_step] = F::cast_from(shifted - log_sum);
                j += units;
            }
        } else {
            while j < n {
                let e = f32::exp(f32::cast_from(input[in_at + j * in_step]) - top);
                output[out_at + j * out_step] = F::cast_from(e / sum);
                j += units;
            }
        }
        row += row_step;
    }
}

/// A plane's maximum (or sum, `sum`), the same in each of its units, combined with the other
/// planes' of the cube through `partials`: the cube's, in every unit. Every unit of the cube
/// must call it.
#[cube]
fn across_planes(
    value: f32,
    partials: &mut SharedMemory<f32>,
    #[comptime] planes: usize,
    #[comptime] sum: bool,
) -> f32 {
    if UNIT_POS_X == 0 {
        partials[UNIT_POS_Y as usize] = value;
    }
    sync_cube();
    let mut all = partials[0];
    for p in 1..planes {
        if sum {
            all += partials[p];
        } else {
            all = max(all, partials[p]);
        }
    }
    // No unit writes its next partial before every unit has read these.
    sync_cube();
    all
}
