//! Bool tensor operations of [`StreamFusion`].

use burn_backend::ops::BoolTensorOps;
use burn_backend::tensor::{BoolTensor, Device, FloatTensor, IntTensor};
use burn_backend::{BoolDType, ExecutionError, FloatDType, IntDType, Shape, TensorData};
use burn_ir::{BackendIr, BoolOperationIr, CastOpIr, CreationOpIr, OperationIr};

use super::StreamFusion;
use super::macros::*;
use super::record::{client_of, record_one};

/// `bool_empty`/`bool_zeros`/`bool_ones`: a creation op of the device.
macro_rules! bool_creation_ops {
    ($($f:ident: $v:ident),* $(,)?) => {$(
        fn $f(shape: Shape, device: &Device<Self>, dtype: BoolDType) -> BoolTensor<Self> {
            let client = Self::client(device);
            let device = device.clone();
            record_one(
                &client,
                stringify!($f),
                [],
                |_, id| (CreationOpIr::create(shape, dtype.into(), id), device),
                |(ir, _)| wrap!(BaseBool, $v, ir.out.dtype, ir),
                |(ir, device), h| {
                    let out = B::$f(ir.out.shape.clone(), device, ir.out.dtype.into());
                    h.register_bool_tensor::<B>(&ir.out.id, out);
                },
            )
        }
    )*};
}

impl<B: BackendIr> BoolTensorOps<Self> for StreamFusion<B> {
    bool_creation_ops!(bool_empty: Empty, bool_zeros: Zeros, bool_ones: Ones);

    fn bool_into_data(
        tensor: BoolTensor<Self>,
    ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
        Self::download(tensor)
    }

    fn bool_from_data(data: TensorData, device: &Device<Self>) -> BoolTensor<Self> {
        Self::upload(data, device)
    }

    fn bool_into_int(tensor: BoolTensor<Self>, out_dtype: IntDType) -> IntTensor<Self> {
        let client = client_of(&tensor);
        record_one(
            &client,
            "bool_into_int",
            [tensor],
            |i, id| CastOpIr::create(i[0].clone(), out_dtype.into(), id),
            |ir| OperationIr::Bool(BoolOperationIr::IntoInt(ir.clone())),
            |ir, h| {
                let x = h.get_bool_tensor::<B>(&ir.input);
                let out = B::bool_into_int(x, ir.out.dtype.into());
                h.register_int_tensor::<B>(&ir.out.id, out);
            },
        )
    }

    fn bool_into_float(tensor: BoolTensor<Self>, out_dtype: FloatDType) -> FloatTensor<Self> {
        let client = client_of(&tensor);
        record_one(
            &client,
            "bool_into_float",
            [tensor],
            |i, id| CastOpIr::create(i[0].clone(), out_dtype.into(), id),
            |ir| OperationIr::Bool(BoolOperationIr::IntoFloat(ir.clone())),
            |ir, h| {
                let x = h.get_bool_tensor::<B>(&ir.input);
                let out = B::bool_into_float(x, ir.out.dtype.into());
                h.register_float_tensor::<B>(&ir.out.id, out);
            },
        )
    }

    fn bool_device(tensor: &BoolTensor<Self>) -> Device<Self> {
        super::device_of(tensor)
    }

    fn bool_to_device(tensor: BoolTensor<Self>, device: &Device<Self>) -> BoolTensor<Self> {
        Self::move_to(tensor, device)
    }

    unary_ops!(get_bool_tensor, register_bool_tensor; bool_not: Bool::Not);

    binary_ops!(get_bool_tensor, register_bool_tensor;
        bool_equal: BaseBool::Equal, bool_and: Bool::And, bool_or: Bool::Or,
    );

    scalar_ops!(get_bool_tensor, register_bool_tensor; bool_equal_elem: BaseBool::EqualElem);

    base_ops!(get_bool_tensor, register_bool_tensor, BaseBool;
        reshape: bool_reshape, expand: bool_expand, swap_dims: bool_swap_dims,
        permute: bool_permute, flip: bool_flip, unfold: bool_unfold, slice: bool_slice,
        slice_assign: bool_slice_assign, select: bool_select, select_assign: bool_select_or,
        gather: bool_gather, scatter: bool_scatter_or, mask_where: bool_mask_where,
        mask_fill: bool_mask_fill,
    );
}
