//! Float tensor operations of [`StreamFusion`].

use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::{FloatTensor, IntTensor};
use burn_backend::{FloatDType, IntDType};
use burn_ir::{CrossOpIr, FloatOperationIr, MatmulOpIr, OperationIr, ReduceDimOpIr};

use super::IrBackend;
use super::StreamFusion;
use super::macros::*;
use super::record::Take as _;
use super::record::Tensor;
use super::record::{record_one, record_out};

impl<B: IrBackend> FloatTensorOps<Self> for StreamFusion<B> {
    data_ops!(
        from_data: float_from_data, into_data: float_into_data, device: float_device,
        to_device: float_to_device,
    );
    creation_ops!(register_float_tensor, FloatDType; float_empty: BaseFloat::Empty);
    random_op!(float_random, register_float_tensor, FloatDType, |ir| {
        OperationIr::Float(ir.out.dtype, FloatOperationIr::Random(ir.clone()))
    });
    cast_ops!(
        float_into_int(take_float -> register_int_tensor, IntDType): |ir| {
            OperationIr::Float(ir.input.dtype, FloatOperationIr::IntoInt(ir.clone()))
        },
        float_cast(take_float -> register_float_tensor, FloatDType): |ir| {
            wrap!(BaseFloat, Cast, ir.out.dtype, ir)
        },
    );

    unary_ops!(take_float, register_float_tensor;
        float_exp: Float::Exp, float_log: Float::Log, float_log1p: Float::Log1p,
        float_erf: Float::Erf, float_sqrt: Float::Sqrt, float_recip: Float::Recip,
        float_cos: Float::Cos, float_sin: Float::Sin, float_tan: Float::Tan,
        float_cosh: Float::Cosh, float_sinh: Float::Sinh, float_tanh: Float::Tanh,
        float_acos: Float::ArcCos, float_acosh: Float::ArcCosh, float_asin: Float::ArcSin,
        float_asinh: Float::ArcSinh, float_atan: Float::ArcTan, float_atanh: Float::ArcTanh,
        float_round: Float::Round, float_floor: Float::Floor, float_ceil: Float::Ceil,
        float_trunc: Float::Trunc, float_abs: NumericFloat::Abs,
    );

    binary_ops!(take_float, register_float_tensor;
        float_add: NumericFloat::Add, float_sub: NumericFloat::Sub,
        float_mul: NumericFloat::Mul, float_div: NumericFloat::Div,
        float_remainder: NumericFloat::Rem, float_atan2: Float::ArcTan2,
        float_powf: Float::Powf,
    );

    scalar_ops!(take_float, register_float_tensor;
        float_add_scalar: NumericFloat::AddScalar, float_sub_scalar: NumericFloat::SubScalar,
        float_mul_scalar: NumericFloat::MulScalar, float_div_scalar: NumericFloat::DivScalar,
        float_remainder_scalar: NumericFloat::RemScalar,
        float_powf_scalar_impl: Float::PowfScalar,
    );

    compare_ops!(take_float;
        float_equal: BaseFloat::Equal, float_greater: NumericFloat::Greater,
        float_greater_equal: NumericFloat::GreaterEqual, float_lower: NumericFloat::Lower,
        float_lower_equal: NumericFloat::LowerEqual,
    );

    compare_scalar_ops!(take_float;
        float_equal_elem: BaseFloat::EqualElem, float_greater_elem: NumericFloat::GreaterElem,
        float_greater_equal_elem: NumericFloat::GreaterEqualElem,
        float_lower_elem: NumericFloat::LowerElem,
        float_lower_equal_elem: NumericFloat::LowerEqualElem,
    );

    reduce_dim_ops!(take_float, register_float_tensor;
        float_sum_dim: NumericFloat::SumDim, float_mean_dim: NumericFloat::MeanDim,
        float_prod_dim: NumericFloat::ProdDim, float_max_dim: NumericFloat::MaxDim,
        float_min_dim: NumericFloat::MinDim, float_max_abs_dim: NumericFloat::MaxAbsDim,
    );

    arg_reduce_ops!(take_float;
        float_argmax: NumericFloat::ArgMax, float_argmin: NumericFloat::ArgMin,
    );

    dim_ops!(take_float, register_float_tensor;
        float_cumsum: NumericFloat::CumSum, float_cumprod: NumericFloat::CumProd,
        float_cummin: NumericFloat::CumMin, float_cummax: NumericFloat::CumMax,
    );

    base_ops!(take_float, register_float_tensor, BaseFloat;
        reshape: float_reshape, expand: float_expand, swap_dims: float_swap_dims,
        permute: float_permute, flip: float_flip, unfold: float_unfold, slice: float_slice,
        slice_assign: float_slice_assign, select: float_select, select_assign: float_select_add,
        gather: float_gather, scatter: float_scatter_add, mask_where: float_mask_where,
        mask_fill: float_mask_fill, gather_nd: float_gather_nd, scatter_nd: float_scatter_nd,
    );

    reduce_ops!(take_float, register_float_tensor;
        float_sum: NumericFloat::Sum, float_prod: NumericFloat::Prod,
        float_mean: NumericFloat::Mean, float_max: NumericFloat::Max,
        float_min: NumericFloat::Min, float_max_abs: NumericFloat::MaxAbs,
    );

    fn float_argtopk(
        tensor: FloatTensor<Self>,
        dim: usize,
        k: usize,
        out_dtype: IntDType,
    ) -> IntTensor<Self> {
        record_out(
            "float_argtopk",
            [tensor],
            |[tensor], id| ReduceDimOpIr::create_arg(tensor, dim, k, out_dtype.into(), id),
            |ir| wrap!(NumericFloat, ArgTopK, ir.input.dtype, ir),
            |ir, h| {
                let x = h.take_float::<B>(&ir.input);
                let out = B::float_argtopk(x, ir.axis, ir.accumulator_len, ir.out.dtype.into());
                h.register_int_tensor::<B>(&ir.out.id, out);
            },
        )
    }

    fn float_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        record_out(
            "float_matmul",
            [lhs, rhs],
            |[lhs, rhs], id| MatmulOpIr::create(lhs, rhs, id),
            |ir| OperationIr::Float(ir.out.dtype, FloatOperationIr::Matmul(ir.clone())),
            |ir, h| {
                let (l, r) = (h.take_float::<B>(&ir.lhs), h.take_float::<B>(&ir.rhs));
                h.register_float_tensor::<B>(&ir.out.id, B::float_matmul(l, r));
            },
        )
    }

    fn float_cross(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        dim: usize,
    ) -> FloatTensor<Self> {
        record_one(
            "float_cross",
            [lhs, rhs],
            |[lhs, rhs], id| CrossOpIr::create(lhs, rhs, dim, id),
            |ir| OperationIr::Float(ir.out.dtype, FloatOperationIr::Cross(ir.clone())),
            |ir, h| {
                let (l, r) = (h.take_float::<B>(&ir.lhs), h.take_float::<B>(&ir.rhs));
                h.register_float_tensor::<B>(&ir.out.id, B::float_cross(l, r, ir.dim));
            },
        )
    }
}
