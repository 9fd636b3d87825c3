//! Bool tensor operations of [`StreamFusion`].

use burn_backend::ops::BoolTensorOps;
use burn_backend::{BoolDType, FloatDType, IntDType};
use burn_ir::{BoolOperationIr, OperationIr};

use super::IrBackend;
use super::StreamFusion;
use super::macros::*;
use super::record::Take as _;
use super::record::Tensor;

impl<B: IrBackend> BoolTensorOps<Self> for StreamFusion<B> {
    creation_ops!(register_bool_tensor, BoolDType;
        bool_empty: BaseBool::Empty, bool_zeros: BaseBool::Zeros, bool_ones: BaseBool::Ones,
    );
    data_ops!(
        from_data: bool_from_data, into_data: bool_into_data, device: bool_device,
        to_device: bool_to_device,
    );
    cast_ops!(
        bool_into_int(take_bool -> register_int_tensor, IntDType): |ir| {
            OperationIr::Bool(BoolOperationIr::IntoInt(ir.clone()))
        },
        bool_into_float(take_bool -> register_float_tensor, FloatDType): |ir| {
            OperationIr::Bool(BoolOperationIr::IntoFloat(ir.clone()))
        },
    );

    unary_ops!(take_bool, register_bool_tensor; bool_not: Bool::Not);

    binary_ops!(take_bool, register_bool_tensor;
        bool_equal: BaseBool::Equal, bool_and: Bool::And, bool_or: Bool::Or,
    );

    scalar_ops!(take_bool, register_bool_tensor; bool_equal_elem: BaseBool::EqualElem);

    base_ops!(take_bool, register_bool_tensor, BaseBool;
        reshape: bool_reshape, expand: bool_expand, swap_dims: bool_swap_dims,
        permute: bool_permute, flip: bool_flip, unfold: bool_unfold, slice: bool_slice,
        slice_assign: bool_slice_assign, select: bool_select, select_assign: bool_select_or,
        gather: bool_gather, scatter: bool_scatter_or, mask_where: bool_mask_where,
        mask_fill: bool_mask_fill,
    );
}
