//! Module operations (convolutions, pooling, interpolation, attention, FFT) of [`StreamFusion`].
//!
//! Optional operands (a bias, a mask) follow the required ones in the operand list when present;
//! [`record_optional`] hands the IR builder both lists back, the optional ones in place.

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
    ModuleOperationIr, OperationIr, RfftOpIr, TensorId, TensorIr,
};
use smallvec::SmallVec;

use super::IrBackend;
use super::StreamFusion;
use super::record::Take as _;
use super::record::{Handles, Tensor, record, record_on, record_one};

/// [`record`] for an operation with optional operands (a bias, a mask): those present follow
/// the required ones, on the stream of the first. `ir` gets the required operands' IRs and the
/// optional ones', each `None` where the operand was absent.
fn record_optional<B: IrBackend, I: Send + Sync + 'static, const N: usize, const M: usize>(
    name: &'static str,
    required: [Tensor<B>; N],
    optional: [Option<Tensor<B>>; M],
    ir: impl FnOnce([TensorIr; N], [Option<TensorIr>; M], &mut dyn FnMut() -> TensorId) -> I,
    repr: fn(&I) -> OperationIr,
    run: fn(&I, &mut Handles<B>),
) -> SmallVec<[Tensor<B>; 1]> {
    let client = required[0].client().clone();
    let present = optional.each_ref().map(Option::is_some);
    let operands = required.into_iter().chain(optional.into_iter().flatten());
    let split = |inputs: &[TensorIr], id: &mut dyn FnMut() -> TensorId| {
        let mut rest = inputs[N..].iter().cloned();
        let optional = present.map(|present| present.then(|| rest.next().expect("present")));
        ir(std::array::from_fn(|k| inputs[k].clone()), optional, id)
    };
    record_on(&client, name, operands, split, repr, run)
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
            record_optional(
                stringify!($f),
                [x, weight],
                [bias],
                |[x, weight], [bias], id| $ir::create(x, weight, bias, options.into(), id),
                |ir| module(ModuleOperationIr::$v(ir.clone())),
                |ir, h| {
                    let [x, w] = h.take_floats::<B, 2>([&ir.x, &ir.weight]);
                    let b = ir.bias.as_ref().map(|b| h.take_float::<B>(b));
                    let out = B::$f(x, w, b, ir.options.clone().into());
                    h.register_float_tensor::<B>(&ir.out.id, out);
                },
            )
            .swap_remove(0)
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
        record_optional(
            "deform_conv2d",
            [x, offset, weight],
            [mask, bias],
            |[x, offset, weight], [mask, bias], id| {
                let options = options.into();
                Box::new(DeformConv2dOpIr::create(
                    x, offset, weight, mask, bias, options, id,
                ))
            },
            |ir| module(ModuleOperationIr::DeformableConv2d(ir.clone())),
            |ir, h| {
                let [x, offset, w] = h.take_floats::<B, 3>([&ir.x, &ir.offset, &ir.weight]);
                let m = ir.mask.as_ref().map(|m| h.take_float::<B>(m));
                let b = ir.bias.as_ref().map(|b| h.take_float::<B>(b));
                let out = B::deform_conv2d(x, offset, w, m, b, ir.options.clone().into());
                h.register_float_tensor::<B>(&ir.out.id, out);
            },
        )
        .swap_remove(0)
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
        let (has_mask, has_bias) = (mask.is_some(), bias.is_some());
        let mut outputs = record_optional(
            "deform_conv2d_backward",
            [x, offset, weight, output_grad],
            [mask, bias],
            |[x, offset, weight, grad], [mask, bias], id| {
                let options = options.into();
                let ir = DeformConv2dBackwardOpIr::create(
                    x, offset, weight, mask, bias, grad, options, id,
                );
                Box::new(ir)
            },
            |ir| module(ModuleOperationIr::DeformableConv2dBackward(ir.clone())),
            |ir, h| {
                let [x, offset, w, g] =
                    h.take_floats::<B, 4>([&ir.x, &ir.offset, &ir.weight, &ir.out_grad]);
                let m = ir.mask.as_ref().map(|m| h.take_float::<B>(m));
                let b = ir.bias.as_ref().map(|b| h.take_float::<B>(b));
                let options = ir.options.clone().into();
                let out = B::deform_conv2d_backward(x, offset, w, m, b, g, options);
                h.register_float_tensor::<B>(&ir.input_grad.id, out.x_grad);
                h.register_float_tensor::<B>(&ir.offset_grad.id, out.offset_grad);
                h.register_float_tensor::<B>(&ir.weight_grad.id, out.weight_grad);
                for (ir, grad) in [
                    (&ir.mask_grad, out.mask_grad),
                    (&ir.bias_grad, out.bias_grad),
                ] {
                    if let (Some(ir), Some(grad)) = (ir, grad) {
                        h.register_float_tensor::<B>(&ir.id, grad);
                    }
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
        let (size, include_pad) = (kernel_size, count_include_pad);
        record_one(
            "avg_pool2d",
            [x],
            |[x], id| AvgPool2dOpIr::create(x, size, stride, padding, include_pad, ceil_mode, id),
            |ir| module(ModuleOperationIr::AvgPool2d(ir.clone())),
            |ir, h| {
                let x = h.take_float::<B>(&ir.x);
                let (size, stride, padding) = (ir.kernel_size, ir.stride, ir.padding);
                let (include_pad, ceil) = (ir.count_include_pad, ir.ceil_mode);
                let out = B::avg_pool2d(x, size, stride, padding, include_pad, ceil);
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
        let (size, include_pad, ceil) = (kernel_size, count_include_pad, ceil_mode);
        record_one(
            "avg_pool2d_backward",
            [x, grad],
            |[x, grad], id| {
                AvgPool2dBackwardOpIr::create(x, grad, size, stride, padding, include_pad, ceil, id)
            },
            |ir| module(ModuleOperationIr::AvgPool2dBackward(ir.clone())),
            |ir, h| {
                let [x, grad] = h.take_floats::<B, 2>([&ir.x, &ir.grad]);
                let (size, stride, padding) = (ir.kernel_size, ir.stride, ir.padding);
                let (include_pad, ceil) = (ir.count_include_pad, ir.ceil_mode);
                let out = B::avg_pool2d_backward(x, grad, size, stride, padding, include_pad, ceil);
                h.register_float_tensor::<B>(&ir.out.id, out);
            },
        )
    }

    fn adaptive_avg_pool2d(x: FloatTensor<Self>, output_size: [usize; 2]) -> FloatTensor<Self> {
        record_one(
            "adaptive_avg_pool2d",
            [x],
            |[x], id| AdaptiveAvgPool2dOpIr::create(x, output_size, id),
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
        record_one(
            "adaptive_avg_pool2d_backward",
            [x, grad],
            |[x, grad], id| AdaptiveAvgPool2dBackwardOpIr::create(x, grad, id),
            |ir| module(ModuleOperationIr::AdaptiveAvgPool2dBackward(ir.clone())),
            |ir, h| {
                let [x, grad] = h.take_floats::<B, 2>([&ir.x, &ir.grad]);
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
        let size = kernel_size;
        record_one(
            "max_pool2d",
            [x],
            |[x], id| MaxPool2dOpIr::create(x, size, stride, padding, dilation, ceil_mode, id),
            |ir| module(ModuleOperationIr::MaxPool2d(ir.clone())),
            |ir, h| {
                let x = h.take_float::<B>(&ir.x);
                let (size, stride, padding) = (ir.kernel_size, ir.stride, ir.padding);
                let out = B::max_pool2d(x, size, stride, padding, ir.dilation, ir.ceil_mode);
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
        let (size, index) = (kernel_size, <B::IntElem as Element>::dtype());
        let [output, indices] = record(
            "max_pool2d_with_indices",
            [x],
            |[x], id| {
                let (dilation, ceil) = (dilation, ceil_mode);
                MaxPool2dWithIndicesOpIr::create(
                    x, size, stride, padding, dilation, ceil, index, id,
                )
            },
            |ir| module(ModuleOperationIr::MaxPool2dWithIndices(ir.clone())),
            |ir, h| {
                let x = h.take_float::<B>(&ir.x);
                let (size, stride, padding) = (ir.kernel_size, ir.stride, ir.padding);
                let (dilation, ceil) = (ir.dilation, ir.ceil_mode);
                let out = B::max_pool2d_with_indices(x, size, stride, padding, dilation, ceil);
                h.register_float_tensor::<B>(&ir.out.id, out.output);
                h.register_int_tensor::<B>(&ir.out_indices.id, out.indices);
            },
        );
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
        let (size, ceil) = (kernel_size, ceil_mode);
        let x_grad = record_one(
            "max_pool2d_with_indices_backward",
            [x, output_grad, indices],
            |[x, grad, indices], id| {
                let (stride, padding, dilation) = (stride, padding, dilation);
                MaxPool2dWithIndicesBackwardOpIr::create(
                    x, grad, indices, size, stride, padding, dilation, ceil, id,
                )
            },
            |ir| module(ModuleOperationIr::MaxPool2dWithIndicesBackward(ir.clone())),
            |ir, h| {
                let [x, grad] = h.take_floats::<B, 2>([&ir.x, &ir.grad]);
                let indices = h.take_int::<B>(&ir.indices);
                let (size, stride, padding) = (ir.kernel_size, ir.stride, ir.padding);
                let (dilation, ceil) = (ir.dilation, ir.ceil_mode);
                let out = B::max_pool2d_with_indices_backward(
                    x, size, stride, padding, dilation, ceil, grad, indices,
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
        record_one(
            "interpolate",
            [x],
            |[x], id| InterpolateOpIr::create(x, output_size, options.into(), id),
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
        record_one(
            "interpolate_backward",
            [x, grad],
            |[x, grad], id| {
                InterpolateBackwardOpIr::create(x, grad, output_size, options.into(), id)
            },
            |ir| module(ModuleOperationIr::InterpolateBackward(ir.clone())),
            |ir, h| {
                let [x, grad] = h.take_floats::<B, 2>([&ir.x, &ir.grad]);
                let options = ir.options.clone().into();
                let out = B::interpolate_backward(x, grad, ir.output_size, options);
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
        record_optional(
            "attention",
            [query, key, value],
            [mask, attn_bias],
            |[q, k, v], [mask, bias], id| {
                AttentionOpIr::create(q, k, v, mask, bias, options.into(), id)
            },
            |ir| module(ModuleOperationIr::Attention(ir.clone())),
            |ir, h| {
                let [q, k, v] = h.take_floats::<B, 3>([&ir.query, &ir.key, &ir.value]);
                let m = ir.mask.as_ref().map(|m| h.take_bool::<B>(m));
                let b = ir.attn_bias.as_ref().map(|b| h.take_float::<B>(b));
                let out = B::attention(q, k, v, m, b, ir.options.clone().into());
                h.register_float_tensor::<B>(&ir.out.id, out);
            },
        )
        .swap_remove(0)
    }

    fn rfft(
        signal: FloatTensor<Self>,
        dim: usize,
        n: Option<usize>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [re, im] = record(
            "rfft",
            [signal],
            |[signal], id| RfftOpIr::create(signal, dim, n, id),
            |ir| module(ModuleOperationIr::Rfft(ir.clone())),
            |ir, h| {
                let signal = h.take_float::<B>(&ir.signal);
                let (re, im) = B::rfft(signal, ir.dim, ir.n);
                h.register_float_tensor::<B>(&ir.out_re.id, re);
                h.register_float_tensor::<B>(&ir.out_im.id, im);
            },
        );
        (re, im)
    }

    fn irfft(
        spectrum_re: FloatTensor<Self>,
        spectrum_im: FloatTensor<Self>,
        dim: usize,
        n: Option<usize>,
    ) -> FloatTensor<Self> {
        record_one(
            "irfft",
            [spectrum_re, spectrum_im],
            |[re, im], id| IRfftOpIr::create(re, im, dim, n, id),
            |ir| module(ModuleOperationIr::IRfft(ir.clone())),
            |ir, h| {
                let [re, im] = h.take_floats::<B, 2>([&ir.input_re, &ir.input_im]);
                h.register_float_tensor::<B>(&ir.out_signal.id, B::irfft(re, im, ir.dim, ir.n));
            },
        )
    }
}
