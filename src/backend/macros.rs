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

/// The skeleton every family below fills in: `fn $f(params) -> tensor`, recorded by
/// `record::$how` (`unary`, `binary`, `scalar`, `record_out` or `record_one`) with `$args`, then the
/// operation's `OperationIr` (`$fam::$v`, with the dtype of the IR's `$dtype` field, as burn
/// records it) and its run: the operands it takes from the handles, then the backend call whose
/// result `$put` registers as the output.
macro_rules! op {
    (
        fn $f:ident($($param:ident: $ty:ty),* $(,)?) = $how:ident($($arg:expr),* $(,)?);
        repr: $fam:ident::$v:ident(dtype of $dtype:ident);
        run: |$ir:ident, $h:ident| [$($x:ident = $get:ident($field:ident)),*] => $put:ident($call:expr) $(,)?
    ) => {
        fn $f($($param: $ty),*) -> $crate::backend::record::Tensor<B> {
            $crate::backend::record::$how(
                stringify!($f),
                $($arg,)*
                |ir| wrap!($fam, $v, ir.$dtype.dtype, ir),
                |$ir, $h| {
                    $(let $x = $h.$get::<B>(&$ir.$field);)*
                    $h.$put::<B>(&$ir.out.id, $call);
                },
            )
        }
    };
}

/// `fn f(tensor) -> tensor`, recorded as a `UnaryOpIr`. `$get`/`$put` fetch the input and
/// register the output with the backend's primitive of the right kind.
macro_rules! unary_ops {
    ($get:ident, $put:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        op! {
            fn $f(tensor: Tensor<B>) = unary(tensor, None);
            repr: $fam::$v(dtype of out);
            run: |ir, h| [x = $get(input)] => $put(B::$f(x)),
        }
    )*};
}

/// `fn f(lhs, rhs) -> tensor`, recorded as a `BinaryOpIr` (both operands of one kind).
macro_rules! binary_ops {
    ($get:ident, $put:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        op! {
            fn $f(lhs: Tensor<B>, rhs: Tensor<B>) = binary(lhs, rhs, None);
            repr: $fam::$v(dtype of out);
            run: |ir, h| [l = $get(lhs), r = $get(rhs)] => $put(B::$f(l, r)),
        }
    )*};
}

/// `fn f(lhs, rhs: Scalar) -> tensor`, recorded as a `ScalarOpIr`.
macro_rules! scalar_ops {
    ($get:ident, $put:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        op! {
            fn $f(lhs: Tensor<B>, rhs: burn_backend::Scalar) = scalar(lhs, rhs.into(), None);
            repr: $fam::$v(dtype of out);
            run: |ir, h| [l = $get(lhs)] => $put(B::$f(l, ir.rhs.into())),
        }
    )*};
}

/// `fn f(lhs, rhs, out_dtype: BoolDType) -> bool tensor`, recorded as a `BinaryOpIr`.
macro_rules! compare_ops {
    ($get:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        op! {
            fn $f(lhs: Tensor<B>, rhs: Tensor<B>, out_dtype: burn_backend::BoolDType) =
                binary(lhs, rhs, Some(out_dtype.into()));
            repr: $fam::$v(dtype of lhs);
            run: |ir, h| [l = $get(lhs), r = $get(rhs)] =>
                register_bool_tensor(B::$f(l, r, ir.out.dtype.into())),
        }
    )*};
}

/// `fn f(lhs, rhs: Scalar, out_dtype: BoolDType) -> bool tensor`, recorded as a `ScalarOpIr`.
macro_rules! compare_scalar_ops {
    ($get:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        op! {
            fn $f(lhs: Tensor<B>, rhs: burn_backend::Scalar, out_dtype: burn_backend::BoolDType) =
                scalar(lhs, rhs.into(), Some(out_dtype.into()));
            repr: $fam::$v(dtype of lhs);
            run: |ir, h| [l = $get(lhs)] =>
                register_bool_tensor(B::$f(l, ir.rhs.into(), ir.out.dtype.into())),
        }
    )*};
}

/// `fn f(tensor) -> tensor` reducing every element to one, recorded as a `ReduceOpIr`.
macro_rules! reduce_ops {
    ($get:ident, $put:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        op! {
            fn $f(tensor: Tensor<B>) =
                record_out([tensor], |[x], id| burn_ir::ReduceOpIr::create(x, id));
            repr: $fam::$v(dtype of out);
            run: |ir, h| [x = $get(input)] => $put(B::$f(x)),
        }
    )*};
}

/// `fn f(tensor, dim) -> tensor` reducing `dim` to length 1, recorded as a `ReduceDimOpIr`.
macro_rules! reduce_dim_ops {
    ($get:ident, $put:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        op! {
            fn $f(tensor: Tensor<B>, dim: usize) =
                record_out([tensor], |[x], id| burn_ir::ReduceDimOpIr::create(x, dim, 1, id));
            repr: $fam::$v(dtype of out);
            run: |ir, h| [x = $get(input)] => $put(B::$f(x, ir.axis)),
        }
    )*};
}

/// `fn f(tensor, dim, out_dtype: IntDType) -> int tensor` (argmax, argmin), recorded as a
/// `ReduceDimOpIr`.
macro_rules! arg_reduce_ops {
    ($get:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        op! {
            fn $f(tensor: Tensor<B>, dim: usize, out_dtype: burn_backend::IntDType) =
                record_out([tensor], |[x], id| {
                    burn_ir::ReduceDimOpIr::create_arg(x, dim, 1, out_dtype.into(), id)
                });
            repr: $fam::$v(dtype of input);
            run: |ir, h| [x = $get(input)] =>
                register_int_tensor(B::$f(x, ir.axis, ir.out.dtype.into())),
        }
    )*};
}

/// `fn f(tensor, dim) -> tensor` of the same shape (cumulative ops), recorded as a `DimOpIr`.
macro_rules! dim_ops {
    ($get:ident, $put:ident; $($f:ident: $fam:ident::$v:ident),* $(,)?) => {$(
        op! {
            fn $f(tensor: Tensor<B>, dim: usize) =
                record_out([tensor], |[x], id| burn_ir::DimOpIr::create(x, dim, id));
            repr: $fam::$v(dtype of out);
            run: |ir, h| [x = $get(input)] => $put(B::$f(x, ir.axis)),
        }
    )*};
}

/// The operations every tensor kind has, with the kind's own method names: shape and indexing
/// ops whose IR is in burn's `BaseOperationIr` family (`$fam` is `BaseFloat`, `BaseInt` or
/// `BaseBool`). One `role: method` pair per operation; the role picks the signature and IR.
/// Indices are always int tensors, masks bool tensors.
macro_rules! base_ops {
    ($get:ident, $put:ident, $fam:ident; $($role:ident: $f:ident),* $(,)?) => {$(
        base_ops!(@$role $f, $get, $put, $fam);
    )*};
    (@reshape $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(tensor: Tensor<B>, shape: burn_backend::Shape) =
            record_out([tensor], |[x], id| burn_ir::ShapeOpIr::reshape(x, shape, id));
        repr: $fam::Reshape(dtype of out);
        run: |ir, h| [x = $get(input)] => $put(B::$f(x, ir.out.shape.clone())),
    } };
    (@expand $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(tensor: Tensor<B>, shape: burn_backend::Shape) =
            record_out([tensor], |[x], id| burn_ir::ShapeOpIr::expand(x, shape, id));
        repr: $fam::Expand(dtype of out);
        run: |ir, h| [x = $get(input)] => $put(B::$f(x, ir.out.shape.clone())),
    } };
    (@swap_dims $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(tensor: Tensor<B>, dim1: usize, dim2: usize) =
            record_out([tensor], |[x], id| burn_ir::SwapDimsOpIr::create(x, dim1, dim2, id));
        repr: $fam::SwapDims(dtype of out);
        run: |ir, h| [x = $get(input)] => $put(B::$f(x, ir.dim1, ir.dim2)),
    } };
    (@permute $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(tensor: Tensor<B>, axes: &[usize]) =
            record_out([tensor], |[x], id| burn_ir::PermuteOpIr::create(x, axes.to_vec(), id));
        repr: $fam::Permute(dtype of out);
        run: |ir, h| [x = $get(input)] => $put(B::$f(x, &ir.axes)),
    } };
    (@flip $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(tensor: Tensor<B>, axes: &[usize]) =
            record_out([tensor], |[x], id| burn_ir::FlipOpIr::create(x, axes.to_vec(), id));
        repr: $fam::Flip(dtype of out);
        run: |ir, h| [x = $get(input)] => $put(B::$f(x, &ir.axes)),
    } };
    (@unfold $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(tensor: Tensor<B>, dim: usize, size: usize, step: usize) =
            record_out([tensor], |[x], id| burn_ir::UnfoldOpIr::create(x, dim, size, step, id));
        repr: $fam::Unfold(dtype of out);
        run: |ir, h| [x = $get(input)] => $put(B::$f(x, ir.dim, ir.size, ir.step)),
    } };
    (@slice $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(tensor: Tensor<B>, slices: &[burn_backend::Slice]) =
            record_out([tensor], |[x], id| burn_ir::SliceOpIr::create(x, slices.to_vec(), id));
        repr: $fam::Slice(dtype of out);
        run: |ir, h| [x = $get(tensor)] => $put(B::$f(x, &ir.ranges)),
    } };
    (@slice_assign $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(tensor: Tensor<B>, slices: &[burn_backend::Slice], value: Tensor<B>) =
            record_one([tensor, value], |[x, value], id| {
                burn_ir::SliceAssignOpIr::create(x, slices.to_vec(), value, id)
            });
        repr: $fam::SliceAssign(dtype of out);
        run: |ir, h| [x = $get(tensor), v = $get(value)] => $put(B::$f(x, &ir.ranges, v)),
    } };
    (@select $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(tensor: Tensor<B>, dim: usize, indices: Tensor<B>) =
            record_one([tensor, indices], |[x, indices], id| {
                burn_ir::SelectOpIr::create(x, dim, indices, id)
            });
        repr: $fam::Select(dtype of out);
        run: |ir, h| [x = $get(tensor), i = take_int(indices)] => $put(B::$f(x, ir.dim, i)),
    } };
    (@select_assign $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(tensor: Tensor<B>, dim: usize, indices: Tensor<B>, value: Tensor<B>) =
            record_one([tensor, indices, value], |[x, indices, value], id| {
                let add = burn_backend::tensor::IndexingUpdateOp::Add;
                burn_ir::SelectAssignOpIr::create(x, dim, indices, value, add, id)
            });
        repr: $fam::SelectAssign(dtype of out);
        run: |ir, h| [x = $get(tensor), i = take_int(indices), v = $get(value)] =>
            $put(B::$f(x, ir.dim, i, v)),
    } };
    (@gather $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(dim: usize, tensor: Tensor<B>, indices: Tensor<B>) =
            record_one([tensor, indices], |[x, indices], id| {
                burn_ir::GatherOpIr::create(x, dim, indices, id)
            });
        repr: $fam::Gather(dtype of out);
        run: |ir, h| [x = $get(tensor), i = take_int(indices)] => $put(B::$f(ir.dim, x, i)),
    } };
    (@scatter $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(dim: usize, tensor: Tensor<B>, indices: Tensor<B>, value: Tensor<B>) =
            record_one([tensor, indices, value], |[x, indices, value], id| {
                let add = burn_backend::tensor::IndexingUpdateOp::Add;
                burn_ir::ScatterOpIr::create(x, dim, indices, value, add, id)
            });
        repr: $fam::Scatter(dtype of out);
        run: |ir, h| [x = $get(tensor), i = take_int(indices), v = $get(value)] =>
            $put(B::$f(ir.dim, x, i, v)),
    } };
    (@mask_where $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(tensor: Tensor<B>, mask: Tensor<B>, value: Tensor<B>) =
            record_one([tensor, mask, value], |[x, mask, value], id| {
                burn_ir::MaskWhereOpIr::create(x, mask, value, id)
            });
        repr: $fam::MaskWhere(dtype of out);
        run: |ir, h| [x = $get(tensor), m = take_bool(mask), v = $get(value)] =>
            $put(B::$f(x, m, v)),
    } };
    (@mask_fill $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(tensor: Tensor<B>, mask: Tensor<B>, value: burn_backend::Scalar) =
            record_one([tensor, mask], |[x, mask], id| {
                burn_ir::MaskFillOpIr::create(x, mask, value.into(), id)
            });
        repr: $fam::MaskFill(dtype of out);
        run: |ir, h| [x = $get(tensor), m = take_bool(mask)] =>
            $put(B::$f(x, m, ir.value.into())),
    } };
    (@gather_nd $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(data: Tensor<B>, indices: Tensor<B>) =
            record_one([data, indices], |[x, indices], id| {
                burn_ir::GatherNdOpIr::create(x, indices, id)
            });
        repr: $fam::GatherNd(dtype of out);
        run: |ir, h| [x = $get(data), i = take_int(indices)] => $put(B::$f(x, i)),
    } };
    (@scatter_nd $f:ident, $get:ident, $put:ident, $fam:ident) => { op! {
        fn $f(
            data: Tensor<B>,
            indices: Tensor<B>,
            values: Tensor<B>,
            reduction: burn_backend::tensor::IndexingUpdateOp,
        ) = record_one([data, indices, values], |[x, indices, values], id| {
            burn_ir::ScatterNdOpIr::create(x, indices, values, reduction, id)
        });
        repr: $fam::ScatterNd(dtype of out);
        run: |ir, h| [x = $get(data), i = take_int(indices), v = $get(values)] =>
            $put(B::$f(x, i, v, ir.reduction)),
    } };
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
            $crate::backend::record::record_out(stringify!($f),
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
    data_ops, dim_ops, op, random_op, reduce_dim_ops, reduce_ops, scalar_ops, unary_ops, wrap,
};
