//! Int tensor operations of [`StreamFusion`].

use burn_backend::ops::IntTensorOps;
use burn_backend::tensor::IntTensor;
use burn_backend::{FloatDType, IntDType};
use burn_ir::{IntOperationIr, MatmulOpIr, NumericOperationIr, OperationIr, ReduceDimOpIr};

use super::IrBackend;
use super::StreamFusion;
use super::macros::*;
use super::record::Take as _;
use super::record::Tensor;
use super::record::record_out;

/// `int_argmax`/`int_argmin`/`int_argtopk`: an int result of the input's dtype.
macro_rules! int_arg_ops {
    ($($f:ident: $v:ident),* $(,)?) => {$(
        fn $f(tensor: IntTensor<Self>, dim: usize) -> IntTensor<Self> {
            record_out(stringify!($f),
                [tensor],
                |[tensor], id| ReduceDimOpIr::create(tensor, dim, 1, id),
                |ir| wrap!(NumericInt, $v, ir.input.dtype, ir),
                |ir, h| {
                    let x = h.take_int::<B>(&ir.input);
                    h.register_int_tensor::<B>(&ir.out.id, B::$f(x, ir.axis));
                },
            )
        }
    )*};
}

impl<B: IrBackend> IntTensorOps<Self> for StreamFusion<B> {
    data_ops!(
        from_data: int_from_data, into_data: int_into_data, device: int_device,
        to_device: int_to_device,
    );
    creation_ops!(register_int_tensor, IntDType; int_empty: BaseInt::Empty);
    random_op!(int_random, register_int_tensor, IntDType, |ir| {
        OperationIr::NumericInt(ir.out.dtype, NumericOperationIr::IntRandom(ir.clone()))
    });
    cast_ops!(
        int_into_float(take_int -> register_float_tensor, FloatDType): |ir| {
            OperationIr::Int(IntOperationIr::IntoFloat(ir.clone()))
        },
        int_cast(take_int -> register_int_tensor, IntDType): |ir| {
            wrap!(BaseInt, Cast, ir.out.dtype, ir)
        },
    );

    fn int_matmul(lhs: IntTensor<Self>, rhs: IntTensor<Self>) -> IntTensor<Self> {
        record_out(
            "int_matmul",
            [lhs, rhs],
            |[lhs, rhs], id| MatmulOpIr::create(lhs, rhs, id),
            |ir| OperationIr::Int(IntOperationIr::Matmul(ir.clone())),
            |ir, h| {
                let (l, r) = (h.take_int::<B>(&ir.lhs), h.take_int::<B>(&ir.rhs));
                h.register_int_tensor::<B>(&ir.out.id, B::int_matmul(l, r));
            },
        )
    }

    fn int_argtopk(tensor: IntTensor<Self>, dim: usize, k: usize) -> IntTensor<Self> {
        record_out(
            "int_argtopk",
            [tensor],
            |[tensor], id| ReduceDimOpIr::create(tensor, dim, k, id),
            |ir| wrap!(NumericInt, ArgTopK, ir.input.dtype, ir),
            |ir, h| {
                let x = h.take_int::<B>(&ir.input);
                let out = B::int_argtopk(x, ir.axis, ir.accumulator_len);
                h.register_int_tensor::<B>(&ir.out.id, out);
            },
        )
    }

    int_arg_ops!(int_argmax: ArgMax, int_argmin: ArgMin);
    reduce_ops!(take_int, register_int_tensor;
        int_sum: NumericInt::Sum, int_prod: NumericInt::Prod, int_mean: NumericInt::Mean,
        int_max: NumericInt::Max, int_min: NumericInt::Min, int_max_abs: NumericInt::MaxAbs,
    );

    unary_ops!(take_int, register_int_tensor;
        int_abs: NumericInt::Abs, bitwise_not: Int::BitwiseNot,
    );

    binary_ops!(take_int, register_int_tensor;
        int_add: NumericInt::Add, int_sub: NumericInt::Sub, int_mul: NumericInt::Mul,
        int_div: NumericInt::Div, int_remainder: NumericInt::Rem,
        bitwise_and: Int::BitwiseAnd, bitwise_or: Int::BitwiseOr, bitwise_xor: Int::BitwiseXor,
        bitwise_left_shift: Int::BitwiseLeftShift,
        bitwise_right_shift: Int::BitwiseRightShift,
    );

    scalar_ops!(take_int, register_int_tensor;
        int_add_scalar: NumericInt::AddScalar, int_sub_scalar: NumericInt::SubScalar,
        int_mul_scalar: NumericInt::MulScalar, int_div_scalar: NumericInt::DivScalar,
        int_remainder_scalar: NumericInt::RemScalar,
        bitwise_and_scalar: Int::BitwiseAndScalar, bitwise_or_scalar: Int::BitwiseOrScalar,
        bitwise_xor_scalar: Int::BitwiseXorScalar,
        bitwise_left_shift_scalar: Int::BitwiseLeftShiftScalar,
        bitwise_right_shift_scalar: Int::BitwiseRightShiftScalar,
    );

    compare_ops!(take_int;
        int_equal: BaseInt::Equal, int_greater: NumericInt::Greater,
        int_greater_equal: NumericInt::GreaterEqual, int_lower: NumericInt::Lower,
        int_lower_equal: NumericInt::LowerEqual,
    );

    compare_scalar_ops!(take_int;
        int_equal_elem: BaseInt::EqualElem, int_greater_elem: NumericInt::GreaterElem,
        int_greater_equal_elem: NumericInt::GreaterEqualElem,
        int_lower_elem: NumericInt::LowerElem, int_lower_equal_elem: NumericInt::LowerEqualElem,
    );

    reduce_dim_ops!(take_int, register_int_tensor;
        int_sum_dim: NumericInt::SumDim, int_prod_dim: NumericInt::ProdDim,
        int_mean_dim: NumericInt::MeanDim, int_max_dim: NumericInt::MaxDim,
        int_min_dim: NumericInt::MinDim, int_max_abs_dim: NumericInt::MaxAbsDim,
    );

    dim_ops!(take_int, register_int_tensor;
        int_cumsum: NumericInt::CumSum, int_cumprod: NumericInt::CumProd,
        int_cummin: NumericInt::CumMin, int_cummax: NumericInt::CumMax,
    );

    base_ops!(take_int, register_int_tensor, BaseInt;
        reshape: int_reshape, expand: int_expand, swap_dims: int_swap_dims,
        permute: int_permute, flip: int_flip, unfold: int_unfold, slice: int_slice,
        slice_assign: int_slice_assign, select: int_select, select_assign: int_select_add,
        gather: int_gather, scatter: int_scatter_add, mask_where: int_mask_where,
        mask_fill: int_mask_fill, gather_nd: int_gather_nd, scatter_nd: int_scatter_nd,
    );
}
