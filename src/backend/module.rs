//! Module operations (convolutions, pooling, interpolation, attention, FFT) of [`StreamFusion`].
//!
//! Optional operands (a bias, a mask) are appended to the operand list when present; the IR
//! builder takes them back in the same order.

use burn_backend::Element;
use burn_backend::ops::{
    AttentionModuleOptions, ConvOptions, ConvTransposeOptions, DeformConv2dBackward,
    DeformConvOptions, InterpolateOptions, MaxPool2dBackward, MaxPool2dWithIndices, ModuleOps,
};
use burn_backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn_ir::{
    AdaptiveAvgPool2dBackwardOpIr, AdaptiveAvgPool2dOpIr, AttentionOpIr, AvgPool2dBackwardOpIr,
    AvgPool2dOpIr, Conv2dOpIr, Conv3dOpIr, ConvTranspose2dOpIr, ConvTranspose3dOpIr,
    DeformConv2dBackwardOpIr, DeformConv2dOpIr, IRfftOpIr, InterpolateBackwardOpIr,
    InterpolateOpIr, MaxPool2dOpIr, MaxPool2dWithIndicesBackwardOpIr, MaxPool2dWithIndicesOpIr,
    ModuleOperationIr, OperationIr, RfftOpIr, TensorIr,
};

use super::IrBackend;
use super::StreamFusion;
use super::record::Take as _;
use super::record::{Tensor, client_of, record, record_one};

/// Operands, then the optional ones that are present.
fn operands<B: IrBackend, const N: usize>(
    required: [Tensor<B>; N],
    optional: impl IntoIterator<Item = Option<Tensor<B>>>,
) -> Vec<Tensor<B>> {
    required
        .into_iter()
        .chain(optional.into_iter().flatten())
        .collect()
}

/// The IR of an optional operand: the next one of `rest` when it was present.
fn optional<'a>(present: bool, rest: &mut impl Iterator<Item = &'a TensorIr>) -> Option<TensorIr> {
    present.then(|| rest.next().expect("present operand").clone())
}

fn module(ir: ModuleOperationIr) -> OperationIr {
    OperationIr::Module(ir)
}

/// `fn f(x, weight, bias, options) -> tensor`: a convolution whose IR has `x`, `weight`, an
/// optional `bias` and burn's options converted to their IR form.
macro_rules! conv_ops {
    ($($f:ident($options:ty): $ir:ident => $v:ident),* $(,)?) => {$(
        fn $f(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            bias: Option<FloatTensor<Self>>,
            options: $options,
        ) -> FloatTensor<Self> {
            let client = client_of(&x);
            let has_bias = bias.is_some();
            record_one(
                &client,
                stringify!($f),
                operands([x, weight], [bias]),
                |i, id| {
                    let mut rest = i[2..].iter();
                    let bias = optional(has_bias, &mut rest);
                    $ir::create(i[0].clone(), i[1].clone(), bias, options.into(), id)
                },
                |ir| module(ModuleOperationIr::$v(ir.clone())),
                |ir, h| {
                    let x = h.take_float::<B>(&ir.x);
                    let w = h.take_float::<B>(&ir.weight);
                    let b = ir.bias.as_ref().map(|b| h.take_float::<B>(b));
                    let out = B::$f(x, w, b, ir.options.clone().into());
                    h.register_float_tensor::<B>(&ir.out.id, out);
                },
            )
        }
    )*};
}

impl<B: IrBackend> ModuleOps<Self> for StreamFusion<B> {
    conv_ops!(
        conv2d(ConvOptions<2>): Conv2dOpIr => Conv2d,
        conv3d(ConvOptions<3>): Conv3dOpIr => Conv3d,
        conv_transpose2d(ConvTransposeOptions<2>): ConvTranspose2dOpIr => ConvTranspose2d,
        conv_transpose3d(ConvTransposeOptions<3>): ConvTranspose3dOpIr => ConvTranspose3d,
    );

    fn deform_conv2d(
        x: FloatTensor<Self>,
        offset: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        mask: Option<FloatTensor<Self>>,
        bias: Option<FloatTensor<Self>>,
        options: DeformConvOptions<2>,
    ) -> FloatTensor<Self> {
        let client = client_of(&x);
        let (has_mask, has_bias) = (mask.is_some(), bias.is_some());
        record_one(
            &client,
            "deform_conv2d",
            operands([x, offset, weight], [mask, bias]),
            |i, id| {
                let mut rest = i[3..].iter();
                let mask = optional(has_mask, &mut rest);
                let bias = optional(has_bias, &mut rest);
                let (x, offset, weight) = (i[0].clone(), i[1].clone(), i[2].clone());
                Box::new(DeformConv2dOpIr::create(
                    x,
                    offset,
                    weight,
                    mask,
                    bias,
                    options.into(),
                    id,
                ))
            },
            |ir| module(ModuleOperationIr::DeformableConv2d(ir.clone())),
            |ir, h| {
                let x = h.take_float::<B>(&ir.x);
                let offset = h.take_float::<B>(&ir.offset);
                let w = h.take_float::<B>(&ir.weight);
                let m = ir.mask.as_ref().map(|m| h.take_float::<B>(m));
                let b = ir.bias.as_ref().map(|b| h.take_float::<B>(b));
                let out = B::deform_conv2d(x, offset, w, m, b, ir.options.clone().into());
                h.register_float_tensor::<B>(&ir.out.id, out);
            },
        )
    }

    fn deform_conv2d_backward(
        x: FloatTensor<Self>,
        offset: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        mask: Option<FloatTensor<Self>>,
        bias: Option<FloatTensor<Self>>,
        output_grad: FloatTensor<Self>,
        options: DeformConvOptions<2>,
    ) -> DeformConv2dBackward<Self> {
        let client = client_of(&x);
        let (has_mask, has_bias) = (mask.is_some(), bias.is_some());
        let mut outputs = record(
            &client,
            "deform_conv2d_backward",
            operands([x, offset, weight, output_grad], [mask, bias]),
            |i, id| {
                let mut rest = i[4..].iter();
                let mask = optional(has_mask, &mut rest);
                let bias = optional(has_bias, &mut rest);
                let (x, offset, weight, grad) =
                    (i[0].clone(), i[1].clone(), i[2].clone(), i[3].clone());
                Box::new(DeformConv2dBackwardOpIr::create(
                    x,
                    offset,
                    weight,
                    mask,
                    bias,
                    grad,
                    options.into(),
                    id,
                ))
            },
            |ir| module(ModuleOperationIr::DeformableConv2dBackward(ir.clone())),
            |ir, h| {
                let x = h.take_float::<B>(&ir.x);
                let offset = h.take_float::<B>(&ir.offset);
                let w = h.take_float::<B>(&ir.weight);
                let m = ir.mask.as_ref().map(|m| h.take_float::<B>(m));
                let b = ir.bias.as_ref().map(|b| h.take_float::<B>(b));
                let g = h.take_float::<B>(&ir.out_grad);
                let out =
                    B::deform_conv2d_backward(x, offset, w, m, b, g, ir.options.clone().into());
                h.register_float_tensor::<B>(&ir.input_grad.id, out.x_grad);
                h.register_float_tensor::<B>(&ir.offset_grad.id, out.offset_grad);
                h.register_float_tensor::<B>(&ir.weight_grad.id, out.weight_grad);
                if let (Some(ir), Some(grad)) = (&ir.mask_grad, out.mask_grad) {
                    h.register_float_tensor::<B>(&ir.id, grad);
                }
                if let (Some(ir), Some(grad)) = (&ir.bias_grad, out.bias_grad) {
                    h.register_float_tensor::<B>(&ir.id, grad);
                }
            },
        )
        .into_iter();
        let mut next = || outputs.next().expect("declared output");
        let (x_grad, offset_grad, weight_grad) = (next(), next(), next());
        let mask_grad = has_mask.then(&mut next);
        let bias_grad = has_bias.then(&mut next);
        DeformConv2dBackward::new(x_grad, offset_grad, weight_grad, mask_grad, bias_grad)
    }

    fn avg_pool2d(
        x: FloatTensor<Self>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        count_include_pad: bool,
        ceil_mode: bool,
    ) -> FloatTensor<Self> {
        let client = client_of(&x);
        record_one(
            &client,
            "avg_pool2d",
            [x],
            |i, id| {
                let x = i[0].clone();
                AvgPool2dOpIr::create(
                    x,
                    kernel_size,
                    stride,
                    padding,
                    count_include_pad,
                    ceil_mode,
                    id,
                )
            },
            |ir| module(ModuleOperationIr::AvgPool2d(ir.clone())),
            |ir, h| {
                let x = h.take_float::<B>(&ir.x);
                let out = B::avg_pool2d(
                    x,
                    ir.kernel_size,
                    ir.stride,
                    ir.padding,
                    ir.count_include_pad,
                    ir.ceil_mode,
                );
                h.register_float_tensor::<B>(&ir.out.id, out);
            },
        )
    }

    fn avg_pool2d_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        count_include_pad: bool,
        ceil_mode: bool,
    ) -> FloatTensor<Self> {
        let client = client_of(&x);
        record_one(
            &client,
            "avg_pool2d_backward",
            [x, grad],
            |i, id| {
                let (x, grad) = (i[0].clone(), i[1].clone());
                AvgPool2dBackwardOpIr::create(
                    x,
                    grad,
                    kernel_size,
                    stride,
                    padding,
                    count_include_pad,
                    ceil_mode,
                    id,
                )
            },
            |ir| module(ModuleOperationIr::AvgPool2dBackward(ir.clone())),
            |ir, h| {
                let (x, grad) = (h.take_float::<B>(&ir.x), h.take_float::<B>(&ir.grad));
                let out = B::avg_pool2d_backward(
                    x,
                    grad,
                    ir.kernel_size,
                    ir.stride,
                    ir.padding,
                    ir.count_include_pad,
                    ir.ceil_mode,
                );
                h.register_float_tensor::<B>(&ir.out.id, out);
            },
        )
    }

    fn adaptive_avg_pool2d(x: FloatTensor<Self>, output_size: [usize; 2]) -> FloatTensor<Self> {
        let client = client_of(&x);
        record_one(
            &client,
            "adaptive_avg_pool2d",
            [x],
            |i, id| AdaptiveAvgPool2dOpIr::create(i[0].clone(), output_size, id),
            |ir| module(ModuleOperationIr::AdaptiveAvgPool2d(ir.clone())),
            |ir, h| {
                let x = h.take_float::<B>(&ir.x);
                h.register_float_tensor::<B>(&ir.out.id, B::adaptive_avg_pool2d(x, ir.output_size));
            },
        )
    }

    fn adaptive_avg_pool2d_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let client = client_of(&x);
        record_one(
            &client,
            "adaptive_avg_pool2d_backward",
            [x, grad],
            |i, id| AdaptiveAvgPool2dBackwardOpIr::create(i[0].clone(), i[1].clone(), id),
            |ir| module(ModuleOperationIr::AdaptiveAvgPool2dBackward(ir.clone())),
            |ir, h| {
                let (x, grad) = (h.take_float::<B>(&ir.x), h.take_float::<B>(&ir.grad));
                h.register_float_tensor::<B>(&ir.out.id, B::adaptive_avg_pool2d_backward(x, grad));
            },
        )
    }

    fn max_pool2d(
        x: FloatTensor<Self>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        ceil_mode: bool,
    ) -> FloatTensor<Self> {
        let client = client_of(&x);
        record_one(
            &client,
            "max_pool2d",
            [x],
            |i, id| {
                let x = i[0].clone();
                MaxPool2dOpIr::create(x, kernel_size, stride, padding, dilation, ceil_mode, id)
            },
            |ir| module(ModuleOperationIr::MaxPool2d(ir.clone())),
            |ir, h| {
                let x = h.take_float::<B>(&ir.x);
                let out = B::max_pool2d(
                    x,
                    ir.kernel_size,
                    ir.stride,
                    ir.padding,
                    ir.dilation,
                    ir.ceil_mode,
                );
                h.register_float_tensor::<B>(&ir.out.id, out);
            },
        )
    }

    fn max_pool2d_with_indices(
        x: FloatTensor<Self>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        ceil_mode: bool,
    ) -> MaxPool2dWithIndices<Self> {
        let client = client_of(&x);
        let mut outputs = record(
            &client,
            "max_pool2d_with_indices",
            [x],
            |i, id| {
                let x = i[0].clone();
                let index = <B::IntElem as Element>::dtype();
                MaxPool2dWithIndicesOpIr::create(
                    x,
                    kernel_size,
                    stride,
                    padding,
                    dilation,
                    ceil_mode,
                    index,
                    id,
                )
            },
            |ir| module(ModuleOperationIr::MaxPool2dWithIndices(ir.clone())),
            |ir, h| {
                let x = h.take_float::<B>(&ir.x);
                let out = B::max_pool2d_with_indices(
                    x,
                    ir.kernel_size,
                    ir.stride,
                    ir.padding,
                    ir.dilation,
                    ir.ceil_mode,
                );
                h.register_float_tensor::<B>(&ir.out.id, out.output);
                h.register_int_tensor::<B>(&ir.out_indices.id, out.indices);
            },
        )
        .into_iter();
        let output = outputs.next().expect("output");
        let indices = outputs.next().expect("indices");
        MaxPool2dWithIndices::new(output, indices)
    }

    fn max_pool2d_with_indices_backward(
        x: FloatTensor<Self>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        ceil_mode: bool,
        output_grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> MaxPool2dBackward<Self> {
        let client = client_of(&x);
        let x_grad = record_one(
            &client,
            "max_pool2d_with_indices_backward",
            [x, output_grad, indices],
            |i, id| {
                let (x, grad, indices) = (i[0].clone(), i[1].clone(), i[2].clone());
                MaxPool2dWithIndicesBackwardOpIr::create(
                    x,
                    grad,
                    indices,
                    kernel_size,
                    stride,
                    padding,
                    dilation,
                    ceil_mode,
                    id,
                )
            },
            |ir| module(ModuleOperationIr::MaxPool2dWithIndicesBackward(ir.clone())),
            |ir, h| {
                let x = h.take_float::<B>(&ir.x);
                let grad = h.take_float::<B>(&ir.grad);
                let indices = h.take_int::<B>(&ir.indices);
                let out = B::max_pool2d_with_indices_backward(
                    x,
                    ir.kernel_size,
                    ir.stride,
                    ir.padding,
                    ir.dilation,
                    ir.ceil_mode,
                    grad,
                    indices,
                );
                h.register_float_tensor::<B>(&ir.out.id, out.x_grad);
            },
        );
        MaxPool2dBackward::new(x_grad)
    }

    fn interpolate(
        x: FloatTensor<Self>,
        output_size: [usize; 2],
        options: InterpolateOptions,
    ) -> FloatTensor<Self> {
        let client = client_of(&x);
        record_one(
            &client,
            "interpolate",
            [x],
            |i, id| InterpolateOpIr::create(i[0].clone(), output_size, options.into(), id),
            |ir| module(ModuleOperationIr::Interpolate(ir.clone())),
            |ir, h| {
                let x = h.take_float::<B>(&ir.x);
                let out = B::interpolate(x, ir.output_size, ir.options.clone().into());
                h.register_float_tensor::<B>(&ir.out.id, out);
            },
        )
    }

    fn interpolate_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        output_size: [usize; 2],
        options: InterpolateOptions,
    ) -> FloatTensor<Self> {
        let client = client_of(&x);
        record_one(
            &client,
            "interpolate_backward",
            [x, grad],
            |i, id| {
                let (x, grad) = (i[0].clone(), i[1].clone());
                InterpolateBackwardOpIr::create(x, grad, output_size, options.into(), id)
            },
            |ir| module(ModuleOperationIr::InterpolateBackward(ir.clone())),
            |ir, h| {
                let (x, grad) = (h.take_float::<B>(&ir.x), h.take_float::<B>(&ir.grad));
                let out =
                    B::interpolate_backward(x, grad, ir.output_size, ir.options.clone().into());
                h.register_float_tensor::<B>(&ir.out.id, out);
            },
        )
    }

    fn attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: Option<BoolTensor<Self>>,
        attn_bias: Option<FloatTensor<Self>>,
        options: AttentionModuleOptions,
    ) -> FloatTensor<Self> {
        let client = client_of(&query);
        let (has_mask, has_bias) = (mask.is_some(), attn_bias.is_some());
        record_one(
            &client,
            "attention",
            operands([query, key, value], [mask, attn_bias]),
            |i, id| {
                let mut rest = i[3..].iter();
                let mask = optional(has_mask, &mut rest);
                let bias = optional(has_bias, &mut rest);
                let (q, k, v) = (i[0].clone(), i[1].clone(), i[2].clone());
                AttentionOpIr::create(q, k, v, mask, bias, options.into(), id)
            },
            |ir| module(ModuleOperationIr::Attention(ir.clone())),
            |ir, h| {
                let q = h.take_float::<B>(&ir.query);
                let k = h.take_float::<B>(&ir.key);
                let v = h.take_float::<B>(&ir.value);
                let m = ir.mask.as_ref().map(|m| h.take_bool::<B>(m));
                let b = ir.attn_bias.as_ref().map(|b| h.take_float::<B>(b));
                let out = B::attention(q, k, v, m, b, ir.options.clone().into());
                h.register_float_tensor::<B>(&ir.out.id, out);
            },
        )
    }

    fn rfft(
        signal: FloatTensor<Self>,
        dim: usize,
        n: Option<usize>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let client = client_of(&signal);
        let mut outputs = record(
            &client,
            "rfft",
            [signal],
            |i, id| RfftOpIr::create(i[0].clone(), dim, n, id),
            |ir| module(ModuleOperationIr::Rfft(ir.clone())),
            |ir, h| {
                let signal = h.take_float::<B>(&ir.signal);
                let (re, im) = B::rfft(signal, ir.dim, ir.n);
                h.register_float_tensor::<B>(&ir.out_re.id, re);
                h.register_float_tensor::<B>(&ir.out_im.id, im);
            },
        )
        .into_iter();
        let re = outputs.next().expect("real part");
        let im = outputs.next().expect("imaginary part");
        (re, im)
    }

    fn irfft(
        spectrum_re: FloatTensor<Self>,
        spectrum_im: FloatTensor<Self>,
        dim: usize,
        n: Option<usize>,
    ) -> FloatTensor<Self> {
        let client = client_of(&spectrum_re);
        record_one(
            &client,
            "irfft",
            [spectrum_re, spectrum_im],
            |i, id| IRfftOpIr::create(i[0].clone(), i[1].clone(), dim, n, id),
            |ir| module(ModuleOperationIr::IRfft(ir.clone())),
            |ir, h| {
                let (re, im) = (
                    h.take_float::<B>(&ir.input_re),
                    h.take_float::<B>(&ir.input_im),
                );
                h.register_float_tensor::<B>(&ir.out_signal.id, B::irfft(re, im, ir.dim, ir.n));
            },
        )
    }
}
