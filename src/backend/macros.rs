//! The op-family tables: one macro per IR shape, so that each backend operation is one line.
//!
//! Every macro expands to trait methods of `StreamFusion<B>` that record the operation through
//! [`super::record`]'s helpers: the IR is burn's own (built with burn-ir's `create` builders),
//! the [`burn_ir::OperationIr`] variant is named in the table, and the run function calls the
//! same-named method of the wrapped backend `B`.

/// The `OperationIr` of an op IR `$ir` (a reference), under one of burn's variant families.
/// `$dtype` is the dtype burn records with numeric and float families.
macro_rules! wrap {
    (Float, $v:ident, $dtype:expr, $ir:expr) => {
        burn_ir::OperationIr::Float($dtype, burn_ir::FloatOperationIr::$v($ir.clone()))
    };
    (NumericFloat, $v:ident, $dtype:expr, $ir:expr) => {
        burn_ir::OperationIr::NumericFloat($dtype, burn_ir::NumericOperationIr::$v($ir.clone()))
    };
    (NumericInt, $v:ident, $dtype:expr, $ir:expr) => {
        burn_ir::OperationIr::NumericInt($dtype, burn_ir::NumericOperationIr::$v($ir.clone()))
    };
    (BaseFloat, $v:ident, $dtype:expr, $ir:expr) => {
        burn_ir::OperationIr::BaseFloat(burn_ir::BaseOperationIr::$v($ir.clone()))
    };
    (BaseInt, $v:ident, $dtype:expr, $ir:expr) => {
        burn_ir::OperationIr::BaseInt(burn_ir::BaseOperationIr::$v($ir.clone()))
    };
    (BaseBool, $v:ident, $dtype:expr, $ir:expr) => {
        burn_ir::OperationIr::BaseBool(burn_ir::BaseOperationIr::$v($ir.clone()))
    };
    (Int, $v:ident, $dtype:expr, $ir:expr) => {
        burn_ir::OperationIr::Int(burn_ir::IntOperationIr::$v($ir.clone()))
    };
    (Bool, $v:ident, $dtype:expr, $ir:expr) => {
        burn_ir::OperationIr::Bool(burn_ir::BoolOperationIr::$v($ir.clone()))
    };
}

/// `fn f(tensor) -> tensor`, recorded as a `UnaryOpIr`. `$get`/`$put` fetch the input and
/// register the output with the backend's primitive of the right kind.
macro_rules! unary_ops {
    ($get:ident, $put:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        fn $f(tensor: $crate::backend::record::Tensor<B>) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::unary::<B>(
                stringify!($f),
                tensor,
                None,
                |ir| wrap!($fam, $v, ir.out.dtype, ir),
                |ir, h| {
                    let x = h.$get::<B>(&ir.input);
                    h.$put::<B>(&ir.out.id, B::$f(x));
                },
            )
        }
    )*};
}

/// `fn f(lhs, rhs) -> tensor`, recorded as a `BinaryOpIr` (both operands of one kind).
macro_rules! binary_ops {
    ($get:ident, $put:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        fn $f(
            lhs: $crate::backend::record::Tensor<B>,
            rhs: $crate::backend::record::Tensor<B>,
        ) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::binary::<B>(
                stringify!($f),
                lhs,
                rhs,
                None,
                |ir| wrap!($fam, $v, ir.out.dtype, ir),
                |ir, h| {
                    let (l, r) = (h.$get::<B>(&ir.lhs), h.$get::<B>(&ir.rhs));
                    h.$put::<B>(&ir.out.id, B::$f(l, r));
                },
            )
        }
    )*};
}

/// `fn f(lhs, rhs: Scalar) -> tensor`, recorded as a `ScalarOpIr`.
macro_rules! scalar_ops {
    ($get:ident, $put:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        fn $f(
            lhs: $crate::backend::record::Tensor<B>,
            rhs: burn_backend::Scalar,
        ) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::scalar::<B>(
                stringify!($f),
                lhs,
                rhs.into(),
                None,
                |ir| wrap!($fam, $v, ir.out.dtype, ir),
                |ir, h| {
                    let l = h.$get::<B>(&ir.lhs);
                    h.$put::<B>(&ir.out.id, B::$f(l, ir.rhs.into()));
                },
            )
        }
    )*};
}

/// `fn f(lhs, rhs, out_dtype: BoolDType) -> bool tensor`, recorded as a `BinaryOpIr`.
macro_rules! compare_ops {
    ($get:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        fn $f(
            lhs: $crate::backend::record::Tensor<B>,
            rhs: $crate::backend::record::Tensor<B>,
            out_dtype: burn_backend::BoolDType,
        ) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::binary::<B>(
                stringify!($f),
                lhs,
                rhs,
                Some(out_dtype.into()),
                |ir| wrap!($fam, $v, ir.lhs.dtype, ir),
                |ir, h| {
                    let (l, r) = (h.$get::<B>(&ir.lhs), h.$get::<B>(&ir.rhs));
                    let out = B::$f(l, r, ir.out.dtype.into());
                    h.register_bool_tensor::<B>(&ir.out.id, out);
                },
            )
        }
    )*};
}

/// `fn f(lhs, rhs: Scalar, out_dtype: BoolDType) -> bool tensor`, recorded as a `ScalarOpIr`.
macro_rules! compare_scalar_ops {
    ($get:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        fn $f(
            lhs: $crate::backend::record::Tensor<B>,
            rhs: burn_backend::Scalar,
            out_dtype: burn_backend::BoolDType,
        ) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::scalar::<B>(
                stringify!($f),
                lhs,
                rhs.into(),
                Some(out_dtype.into()),
                |ir| wrap!($fam, $v, ir.lhs.dtype, ir),
                |ir, h| {
                    let l = h.$get::<B>(&ir.lhs);
                    let out = B::$f(l, ir.rhs.into(), ir.out.dtype.into());
                    h.register_bool_tensor::<B>(&ir.out.id, out);
                },
            )
        }
    )*};
}

/// `fn f(tensor) -> tensor` reducing every element to one, recorded as a `ReduceOpIr`.
macro_rules! reduce_ops {
    ($get:ident, $put:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        fn $f(tensor: $crate::backend::record::Tensor<B>) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f),
                [tensor],
                |[tensor], id| burn_ir::ReduceOpIr::create(tensor, id),
                |ir| wrap!($fam, $v, ir.out.dtype, ir),
                |ir, h| {
                    let x = h.$get::<B>(&ir.input);
                    h.$put::<B>(&ir.out.id, B::$f(x));
                },
            )
        }
    )*};
}

/// `fn f(tensor, dim) -> tensor` reducing `dim` to length 1, recorded as a `ReduceDimOpIr`.
macro_rules! reduce_dim_ops {
    ($get:ident, $put:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        fn $f(tensor: $crate::backend::record::Tensor<B>, dim: usize) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f),
                [tensor],
                |[tensor], id| burn_ir::ReduceDimOpIr::create(tensor, dim, 1, id),
                |ir| wrap!($fam, $v, ir.out.dtype, ir),
                |ir, h| {
                    let x = h.$get::<B>(&ir.input);
                    h.$put::<B>(&ir.out.id, B::$f(x, ir.axis));
                },
            )
        }
    )*};
}

/// `fn f(tensor, dim, out_dtype: IntDType) -> int tensor` (argmax, argmin), recorded as a
/// `ReduceDimOpIr`.
macro_rules! arg_reduce_ops {
    ($get:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        fn $f(
            tensor: $crate::backend::record::Tensor<B>,
            dim: usize,
            out_dtype: burn_backend::IntDType,
        ) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f),
                [tensor],
                |[tensor], id| burn_ir::ReduceDimOpIr::create_arg(tensor, dim, 1, out_dtype.into(), id),
                |ir| wrap!($fam, $v, ir.input.dtype, ir),
                |ir, h| {
                    let x = h.$get::<B>(&ir.input);
                    let out = B::$f(x, ir.axis, ir.out.dtype.into());
                    h.register_int_tensor::<B>(&ir.out.id, out);
                },
            )
        }
    )*};
}

/// `fn f(tensor, dim) -> tensor` of the same shape (cumulative ops), recorded as a `DimOpIr`.
macro_rules! dim_ops {
    ($get:ident, $put:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        fn $f(tensor: $crate::backend::record::Tensor<B>, dim: usize) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f),
                [tensor],
                |[tensor], id| burn_ir::DimOpIr::create(tensor, dim, id),
                |ir| wrap!($fam, $v, ir.out.dtype, ir),
                |ir, h| {
                    let x = h.$get::<B>(&ir.input);
                    h.$put::<B>(&ir.out.id, B::$f(x, ir.axis));
                },
            )
        }
    )*};
}

/// The operations every tensor kind has, with the kind's own method names: shape and indexing
/// ops whose IR is in burn's `BaseOperationIr` family (`$fam` is `BaseFloat`, `BaseInt` or
/// `BaseBool`). One `role: method` pair per operation; the role picks the signature and IR.
macro_rules! base_ops {
    ($get:ident, $put:ident, $fam:ident; $($role:ident: $f:ident),* $(,)?) => {$(
        base_ops!(@$role $f, $get, $put, $fam);
    )*};
    (@reshape $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(tensor: $crate::backend::record::Tensor<B>, shape: burn_backend::Shape) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor],
                |[tensor], id| burn_ir::ShapeOpIr::reshape(tensor, shape, id),
                |ir| wrap!($fam, Reshape, ir.out.dtype, ir),
                |ir, h| { let x = h.$get::<B>(&ir.input); h.$put::<B>(&ir.out.id, B::$f(x, ir.out.shape.clone())); })
        }
    };
    (@expand $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(tensor: $crate::backend::record::Tensor<B>, shape: burn_backend::Shape) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor],
                |[tensor], id| burn_ir::ShapeOpIr::expand(tensor, shape, id),
                |ir| wrap!($fam, Expand, ir.out.dtype, ir),
                |ir, h| { let x = h.$get::<B>(&ir.input); h.$put::<B>(&ir.out.id, B::$f(x, ir.out.shape.clone())); })
        }
    };
    (@swap_dims $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(tensor: $crate::backend::record::Tensor<B>, dim1: usize, dim2: usize) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor],
                |[tensor], id| burn_ir::SwapDimsOpIr::create(tensor, dim1, dim2, id),
                |ir| wrap!($fam, SwapDims, ir.out.dtype, ir),
                |ir, h| { let x = h.$get::<B>(&ir.input); h.$put::<B>(&ir.out.id, B::$f(x, ir.dim1, ir.dim2)); })
        }
    };
    (@permute $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(tensor: $crate::backend::record::Tensor<B>, axes: &[usize]) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor],
                |[tensor], id| burn_ir::PermuteOpIr::create(tensor, axes.to_vec(), id),
                |ir| wrap!($fam, Permute, ir.out.dtype, ir),
                |ir, h| { let x = h.$get::<B>(&ir.input); h.$put::<B>(&ir.out.id, B::$f(x, &ir.axes)); })
        }
    };
    (@flip $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(tensor: $crate::backend::record::Tensor<B>, axes: &[usize]) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor],
                |[tensor], id| burn_ir::FlipOpIr::create(tensor, axes.to_vec(), id),
                |ir| wrap!($fam, Flip, ir.out.dtype, ir),
                |ir, h| { let x = h.$get::<B>(&ir.input); h.$put::<B>(&ir.out.id, B::$f(x, &ir.axes)); })
        }
    };
    (@unfold $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(tensor: $crate::backend::record::Tensor<B>, dim: usize, size: usize, step: usize) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor],
                |[tensor], id| burn_ir::UnfoldOpIr::create(tensor, dim, size, step, id),
                |ir| wrap!($fam, Unfold, ir.out.dtype, ir),
                |ir, h| { let x = h.$get::<B>(&ir.input); h.$put::<B>(&ir.out.id, B::$f(x, ir.dim, ir.size, ir.step)); })
        }
    };
    (@slice $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(tensor: $crate::backend::record::Tensor<B>, slices: &[burn_backend::Slice]) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor],
                |[tensor], id| burn_ir::SliceOpIr::create(tensor, slices.to_vec(), id),
                |ir| wrap!($fam, Slice, ir.out.dtype, ir),
                |ir, h| { let x = h.$get::<B>(&ir.tensor); h.$put::<B>(&ir.out.id, B::$f(x, &ir.ranges)); })
        }
    };
    (@slice_assign $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(tensor: $crate::backend::record::Tensor<B>, slices: &[burn_backend::Slice], value: $crate::backend::record::Tensor<B>) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor, value],
                |[tensor, value], id| burn_ir::SliceAssignOpIr::create(tensor, slices.to_vec(), value, id),
                |ir| wrap!($fam, SliceAssign, ir.out.dtype, ir),
                |ir, h| {
                    let (x, v) = (h.$get::<B>(&ir.tensor), h.$get::<B>(&ir.value));
                    h.$put::<B>(&ir.out.id, B::$f(x, &ir.ranges, v));
                })
        }
    };
    (@select $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(tensor: $crate::backend::record::Tensor<B>, dim: usize, indices: $crate::backend::record::Tensor<B>) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor, indices],
                |[tensor, indices], id| burn_ir::SelectOpIr::create(tensor, dim, indices, id),
                |ir| wrap!($fam, Select, ir.out.dtype, ir),
                |ir, h| {
                    let (x, idx) = (h.$get::<B>(&ir.tensor), h.take_int::<B>(&ir.indices));
                    h.$put::<B>(&ir.out.id, B::$f(x, ir.dim, idx));
                })
        }
    };
    (@select_assign $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(tensor: $crate::backend::record::Tensor<B>, dim: usize, indices: $crate::backend::record::Tensor<B>, value: $crate::backend::record::Tensor<B>) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor, indices, value],
                |[tensor, indices, value], id| burn_ir::SelectAssignOpIr::create(tensor, dim, indices, value, burn_backend::tensor::IndexingUpdateOp::Add, id),
                |ir| wrap!($fam, SelectAssign, ir.out.dtype, ir),
                |ir, h| {
                    let (x, idx, v) = (h.$get::<B>(&ir.tensor), h.take_int::<B>(&ir.indices), h.$get::<B>(&ir.value));
                    h.$put::<B>(&ir.out.id, B::$f(x, ir.dim, idx, v));
                })
        }
    };
    (@gather $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(dim: usize, tensor: $crate::backend::record::Tensor<B>, indices: $crate::backend::record::Tensor<B>) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor, indices],
                |[tensor, indices], id| burn_ir::GatherOpIr::create(tensor, dim, indices, id),
                |ir| wrap!($fam, Gather, ir.out.dtype, ir),
                |ir, h| {
                    let (x, idx) = (h.$get::<B>(&ir.tensor), h.take_int::<B>(&ir.indices));
                    h.$put::<B>(&ir.out.id, B::$f(ir.dim, x, idx));
                })
        }
    };
    (@scatter $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(dim: usize, tensor: $crate::backend::record::Tensor<B>, indices: $crate::backend::record::Tensor<B>, value: $crate::backend::record::Tensor<B>) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor, indices, value],
                |[tensor, indices, value], id| burn_ir::ScatterOpIr::create(tensor, dim, indices, value, burn_backend::tensor::IndexingUpdateOp::Add, id),
                |ir| wrap!($fam, Scatter, ir.out.dtype, ir),
                |ir, h| {
                    let (x, idx, v) = (h.$get::<B>(&ir.tensor), h.take_int::<B>(&ir.indices), h.$get::<B>(&ir.value));
                    h.$put::<B>(&ir.out.id, B::$f(ir.dim, x, idx, v));
                })
        }
    };
    (@mask_where $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(tensor: $crate::backend::record::Tensor<B>, mask: $crate::backend::record::Tensor<B>, value: $crate::backend::record::Tensor<B>) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor, mask, value],
                |[tensor, mask, value], id| burn_ir::MaskWhereOpIr::create(tensor, mask, value, id),
                |ir| wrap!($fam, MaskWhere, ir.out.dtype, ir),
                |ir, h| {
                    let (x, m, v) = (h.$get::<B>(&ir.tensor), h.take_bool::<B>(&ir.mask), h.$get::<B>(&ir.value));
                    h.$put::<B>(&ir.out.id, B::$f(x, m, v));
                })
        }
    };
    (@gather_nd $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(data: $crate::backend::record::Tensor<B>, indices: $crate::backend::record::Tensor<B>) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [data, indices],
                |[data, indices], id| burn_ir::GatherNdOpIr::create(data, indices, id),
                |ir| wrap!($fam, GatherNd, ir.out.dtype, ir),
                |ir, h| {
                    let (x, idx) = (h.$get::<B>(&ir.data), h.take_int::<B>(&ir.indices));
                    h.$put::<B>(&ir.out.id, B::$f(x, idx));
                })
        }
    };
    (@scatter_nd $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(data: $crate::backend::record::Tensor<B>, indices: $crate::backend::record::Tensor<B>, values: $crate::backend::record::Tensor<B>, reduction: burn_backend::tensor::IndexingUpdateOp) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [data, indices, values],
                |[data, indices, values], id| burn_ir::ScatterNdOpIr::create(data, indices, values, reduction, id),
                |ir| wrap!($fam, ScatterNd, ir.out.dtype, ir),
                |ir, h| {
                    let (x, idx, v) = (h.$get::<B>(&ir.data), h.take_int::<B>(&ir.indices), h.$get::<B>(&ir.values));
                    h.$put::<B>(&ir.out.id, B::$f(x, idx, v, ir.reduction));
                })
        }
    };
    (@mask_fill $f:ident, $get:ident, $put:ident, $fam:ident) => {
        fn $f(tensor: $crate::backend::record::Tensor<B>, mask: $crate::backend::record::Tensor<B>, value: burn_backend::Scalar) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f), [tensor, mask],
                |[tensor, mask], id| burn_ir::MaskFillOpIr::create(tensor, mask, value.into(), id),
                |ir| wrap!($fam, MaskFill, ir.out.dtype, ir),
                |ir, h| {
                    let (x, m) = (h.$get::<B>(&ir.tensor), h.take_bool::<B>(&ir.mask));
                    h.$put::<B>(&ir.out.id, B::$f(x, m, ir.value.into()));
                })
        }
    };
}

/// The data and device operations every kind has: upload, download (B's future), device, and
/// a move to another device. One `role: method` pair each.
macro_rules! data_ops {
    ($($role:ident: $f:ident),* $(,)?) => {$(
        data_ops!(@$role $f);
    )*};
    (@from_data $f:ident) => {
        fn $f(data: burn_backend::TensorData, device: &burn_backend::tensor::Device<Self>) -> $crate::backend::record::Tensor<B> {
            Self::upload(data, device)
        }
    };
    (@into_data $f:ident) => {
        fn $f(
            tensor: $crate::backend::record::Tensor<B>,
        ) -> impl Future<Output = Result<burn_backend::TensorData, burn_backend::ExecutionError>> + Send {
            Self::download(tensor)
        }
    };
    (@device $f:ident) => {
        fn $f(tensor: &$crate::backend::record::Tensor<B>) -> burn_backend::tensor::Device<Self> {
            $crate::backend::device_of(tensor)
        }
    };
    (@to_device $f:ident) => {
        fn $f(tensor: $crate::backend::record::Tensor<B>, device: &burn_backend::tensor::Device<Self>) -> $crate::backend::record::Tensor<B> {
            Self::move_to(tensor, device)
        }
    };
}

/// `fn f(shape, device, dtype) -> tensor`: a creation op of `B` on the device, recorded as a
/// `CreationOpIr` under `$fam::$v` (`Empty`, `Zeros`, `Ones`).
macro_rules! creation_ops {
    ($put:ident, $dtype:ty; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        fn $f(
            shape: burn_backend::Shape,
            device: &burn_backend::tensor::Device<Self>,
            dtype: $dtype,
        ) -> $crate::backend::record::Tensor<B> {
            let client = Self::client(device);
            let device = device.clone();
            $crate::backend::record::create(
                &client,
                stringify!($f),
                |id| (burn_ir::CreationOpIr::create(shape, dtype.into(), id), device),
                |(ir, _)| wrap!($fam, $v, ir.out.dtype, ir),
                |(ir, device), h| {
                    let out = B::$f(ir.out.shape.clone(), device, ir.out.dtype.into());
                    h.$put::<B>(&ir.out.id, out);
                },
            )
        }
    )*};
}

/// `fn f(shape, distribution, device, dtype) -> tensor`: `B`'s random op, recorded as a
/// `RandomOpIr` (it draws from `B`'s generator when the stream runs it).
macro_rules! random_op {
    ($f:ident, $put:ident, $dtype:ty, |$ir:ident| $repr:expr) => {
        fn $f(
            shape: burn_backend::Shape,
            distribution: burn_backend::Distribution,
            device: &burn_backend::tensor::Device<Self>,
            dtype: $dtype,
        ) -> $crate::backend::record::Tensor<B> {
            let client = Self::client(device);
            let device = device.clone();
            $crate::backend::record::create(
                &client,
                stringify!($f),
                |id| {
                    let ir = burn_ir::RandomOpIr::create(shape, dtype.into(), distribution, id);
                    (ir, device)
                },
                |($ir, _)| $repr,
                |(ir, device), h| {
                    let (shape, dtype) = (ir.out.shape.clone(), ir.out.dtype.into());
                    let out = B::$f(shape, ir.distribution, device, dtype);
                    h.$put::<B>(&ir.out.id, out);
                },
            )
        }
    };
}

/// `fn f(tensor, dtype) -> tensor`: a cast, within a kind or across kinds, recorded as a
/// `CastOpIr`. `$get`/`$put` are the input's and the output's kinds.
macro_rules! cast_ops {
    ($($f:ident($get:ident -> $put:ident, $dtype:ty): |$ir:ident| $repr:expr),* $(,)?) => {$(
        fn $f(tensor: $crate::backend::record::Tensor<B>, dtype: $dtype) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::record_one(stringify!($f),
                [tensor],
                |[tensor], id| burn_ir::CastOpIr::create(tensor, dtype.into(), id),
                |$ir| $repr,
                |ir, h| {
                    let x = h.$get::<B>(&ir.input);
                    h.$put::<B>(&ir.out.id, B::$f(x, ir.out.dtype.into()));
                },
            )
        }
    )*};
}

pub(crate) use {
    arg_reduce_ops, base_ops, binary_ops, cast_ops, compare_ops, compare_scalar_ops, creation_ops,
    data_ops, dim_ops, random_op, reduce_dim_ops, reduce_ops, scalar_ops, unary_ops, wrap,
};
