//! Quantized tensor operations of [`StreamFusion`] (for backends that support quantization).

use burn_backend::FloatDType;
use burn_backend::ops::QTensorOps;
use burn_backend::quantization::{QuantScheme, QuantizationParametersPrimitive};
use burn_backend::tensor::{FloatTensor, QuantizedTensor};
use burn_ir::{
    DequantizeOpIr, FloatOperationIr, OperationIr, QuantizationParametersIr, QuantizeOpIr,
};

use super::IrBackend;
use super::StreamFusion;
use super::macros::*;
use super::record::Take as _;
use super::record::Tensor;
use super::record::record_one;

impl<B: IrBackend> QTensorOps<Self> for StreamFusion<B> {
    data_ops!(
        from_data: q_from_data, into_data: q_into_data, device: q_device, to_device: q_to_device,
    );

    fn quantize(
        tensor: FloatTensor<Self>,
        scheme: &QuantScheme,
        qparams: QuantizationParametersPrimitive<Self>,
    ) -> QuantizedTensor<Self> {
        let scheme = *scheme;
        record_one(
            "quantize",
            [tensor, qparams.scales],
            |[tensor, scales], id| {
                let qparams = QuantizationParametersIr { scales };
                QuantizeOpIr::create(tensor, qparams, scheme, id)
            },
            |ir| OperationIr::Float(ir.tensor.dtype, FloatOperationIr::Quantize(ir.clone())),
            |ir, h| {
                let x = h.take_float::<B>(&ir.tensor);
                let scales = h.take_float::<B>(&ir.qparams.scales);
                let qparams = QuantizationParametersPrimitive { scales };
                let out = B::quantize(x, &ir.scheme, qparams);
                h.register_quantized_tensor::<B>(&ir.out.id, out);
            },
        )
    }

    fn dequantize(tensor: QuantizedTensor<Self>, dtype: FloatDType) -> FloatTensor<Self> {
        record_one(
            "dequantize",
            [tensor],
            |[tensor], id| DequantizeOpIr::create(tensor, dtype.into(), id),
            |ir| OperationIr::Float(ir.out.dtype, FloatOperationIr::Dequantize(ir.clone())),
            |ir, h| {
                let x = h.get_quantized_tensor::<B>(&ir.input);
                h.register_float_tensor::<B>(&ir.out.id, B::dequantize(x, ir.out.dtype.into()));
            },
        )
    }

    base_ops!(get_quantized_tensor, register_quantized_tensor, BaseFloat;
        reshape: q_reshape, expand: q_expand, swap_dims: q_swap_dims, permute: q_permute,
        flip: q_flip, select: q_select, slice: q_slice,
    );
}
