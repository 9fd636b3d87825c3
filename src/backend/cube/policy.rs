//! What may join a run: the operations with a fallback or a relative form, the one-width rule of
//! matmul runs, and the in-place rule for buffers allocated on another stream.

use super::*;

/// Whether a fused kernel may run `op` unfused (see [`Fallback`]).
pub(super) fn has_fallback(op: &OperationIr) -> bool {
    matmul(op).is_some() || reduction(op).is_some()
}

/// `op`'s IR if it is a matmul of (unquantized) float tensors.
pub(super) fn matmul(op: &OperationIr) -> Option<&MatmulOpIr> {
    match op {
        OperationIr::Float(_, FloatOperationIr::Matmul(ir)) if unquantized(ir) => Some(ir),
        _ => None,
    }
}

/// `op`'s IR if it is a reduction along one axis (what the reduce fusers fuse).
pub(super) fn reduction(op: &OperationIr) -> Option<&ReduceDimOpIr> {
    use NumericOperationIr as N;
    match op {
        OperationIr::NumericFloat(_, op) | OperationIr::NumericInt(_, op) => match op {
            N::SumDim(ir) | N::MeanDim(ir) | N::ProdDim(ir) | N::MaxDim(ir) | N::MinDim(ir) => {
                Some(ir)
            }
            N::MaxAbsDim(ir) | N::ArgMax(ir) | N::ArgMin(ir) => Some(ir),
            _ => None,
        },
        _ => None,
    }
}

/// Whether every tensor the run `prefix` then `op` reads from outside itself (not an output
/// of an earlier operation of the run) has the same element width: the only runs the matmul
/// fuser is offered.
///
/// burn-cubecl-fusion 0.21 keys a fused matmul's autotune result by the matmul problem and the
/// number of operations and outputs in its run, not by the widths of the other tensors the run
/// reads, although those set the kernel's vector sizes. Two runs with one key can therefore need
/// different kernels: `scores * s + bias` (all `f32`) and `scores * s` masked by a bool mask
/// read as `u8`. Tuned on the first, the choice was reused for the second, whose 16-wide `u8`
/// vectors the chosen stage layout cannot hold: the launch failed to compile ("Invalid vector
/// size. Got 16 which should not be >8") and failed the next read on the stream. burn's
/// `attention::test_attention_bool_mask_broadcast_batch_and_heads` hit this on a cold autotune
/// cache after the bias-broadcast tests (measured on the H200; the log is `docs/logs/2026-12-02-attention-cold-cache.log`).
/// Keeping reads of another width out of matmul runs gives every run under one key one width;
/// the masking then runs as its own elementwise kernel. A bool made inside the run (`relu`'s
/// mask) is not read from memory and stays fused. A run's bool *output* of another width is not
/// caught by this rule; none was seen to collide.
///
/// Relative ids are the same for every run of one relative prefix, so the answer is too (the
/// trie may keep it).
pub(super) fn one_input_width<'a>(
    prefix: impl IntoIterator<Item = &'a OperationIr>,
    op: &'a OperationIr,
) -> bool {
    let mut made_here: SmallVec<[TensorId; 16]> = SmallVec::new();
    let mut width = None;
    for op in prefix.into_iter().chain([op]) {
        for input in op.inputs().filter(|input| !made_here.contains(&input.id)) {
            let size = input.dtype.size();
            if *width.get_or_insert(size) != size {
                return false;
            }
        }
        made_here.extend(op.outputs().map(|out| out.id));
    }
    true
}

/// What the first block of a reduce kernel over a run (its operations before the first
/// reduction) writes to memory, and so whether burn-cubecl-fusion 0.21 launches the kernel right
/// (see [`first_block`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FirstBlock {
    /// Nothing: the launch takes its reference layout from an input. Always right.
    Reads,
    /// The run's first operation's output, which has the shape of the first reduction's input,
    /// as does the first tensor the run reads (that operation's first operand). Right when
    /// that operand is contiguous, which only the run's handles tell.
    WritesFirstMade,
    /// Something else: never launched right.
    Writes,
}

/// What the first block of a reduce kernel over `run` writes (see [`FirstBlock`]). The reduce
/// fusers are never ready on a [`FirstBlock::Writes`] run, and on a
/// [`FirstBlock::WritesFirstMade`] run only when its first operand is contiguous.
///
/// The first block writes a tensor made before the run's first reduction that an operation
/// after that reduction reads, or that the run neither consumes nor drops (it lives past the
/// run). burn-cubecl-fusion 0.21's launch plan then takes the first such tensor of the
/// reduction's input shape as the first block's reference layout, `FuseArg::Output(pos, ..)`
/// with `pos` its place among the tensors the run makes. Both reduce launchers
/// (`FusedReduceLaunch::run`, `ReduceBroadcastedLaunch::run`) then look the reference's strides
/// up with `inputs.strides_ref`, among the kernel's *inputs*, at that position. With fewer
/// inputs than `pos + 1` the lookup is out of bounds: the panic burn's per-block quantization of
/// a transposed tensor raised in two reduce autotune candidates ("the len is 1 but the index is
/// 1": the run makes a transposed view first, a view is never the reference, and the next tensor
/// it makes is). Otherwise it reads input `pos`'s strides, and the reduction's output is
/// vectorized along the axis those strides say: right only when that input is laid out as the
/// reference. The one case this rule can tell is right: the reference is the run's first made
/// tensor (`pos` 0) and input 0, the first tensor the run reads, has its shape and is
/// contiguous. `softmax(2x)` of a contiguous `x` is that case (`2x` is read again after the row
/// maximum).
///
/// burn-cubecl-fusion 0.21's reduce fusers take a reduction only after an elementwise operation
/// of its input's shape (`ReduceFuser::on_reduce` closes otherwise), so a run a reduction starts
/// is not theirs at all. Relative ids and shapes are the same for every run of one relative
/// prefix, so the answer is too (the trie may keep it).
pub(super) fn first_block<'a>(run: impl IntoIterator<Item = &'a OperationIr>) -> FirstBlock {
    let mut run = run.into_iter().peekable();
    let Some(first) = run.peek().copied() else {
        return FirstBlock::Reads;
    };
    let mut made: SmallVec<[TensorId; 8]> = SmallVec::new();
    let mut written: SmallVec<[TensorId; 4]> = SmallVec::new();
    let mut reduced: Option<&Shape> = None;
    for op in run {
        if let OperationIr::Drop(tensor) = op {
            made.retain(|id| *id != tensor.id);
            continue;
        }
        if reduced.is_some() {
            for input in op.inputs() {
                if made.contains(&input.id) && !written.contains(&input.id) {
                    written.push(input.id);
                }
            }
            continue;
        }
        for input in op.inputs() {
            if input.status == TensorStatus::ReadWrite {
                made.retain(|id| *id != input.id);
            }
        }
        match reduction(op) {
            Some(ir) => reduced = Some(&ir.input.shape),
            None => made.extend(op.outputs().map(|out| out.id)),
        }
    }
    for id in made {
        if !written.contains(&id) {
            written.push(id);
        }
    }
    if written.is_empty() {
        return FirstBlock::Reads;
    }
    let view = matches!(
        first,
        OperationIr::BaseFloat(BaseOperationIr::Reshape(_) | BaseOperationIr::SwapDims(_))
            | OperationIr::BaseInt(BaseOperationIr::Reshape(_) | BaseOperationIr::SwapDims(_))
            | OperationIr::BaseBool(BaseOperationIr::Reshape(_) | BaseOperationIr::SwapDims(_))
    );
    let (Some(out), Some(operand), Some(reduced)) =
        (first.outputs().next(), first.inputs().next(), reduced)
    else {
        return FirstBlock::Writes;
    };
    if !view
        && reduction(first).is_none()
        && written.contains(&out.id)
        && out.shape == *reduced
        && operand.shape == out.shape
    {
        FirstBlock::WritesFirstMade
    } else {
        FirstBlock::Writes
    }
}

/// Whether `strides` are exactly the row-major contiguous strides of `shape`, those of the
/// reference the kernel computes: the strides the launcher reads instead must equal them, size-1
/// dimensions included (its vectorization axis is the smallest stride).
pub(super) fn contiguous(shape: &Shape, strides: &[usize]) -> bool {
    if shape.rank() != strides.len() {
        return false;
    }
    let mut expected = 1;
    for (dim, stride) in shape.iter().zip(strides).rev() {
        if *stride != expected {
            return false;
        }
        // A shape's dimensions come from the user: a product past `usize` is no layout.
        let Some(next) = expected.checked_mul(*dim) else {
            return false;
        };
        expected = next;
    }
    true
}

/// Whether neither operand of a matmul is quantized (the matmul fuser's quantized path is
/// not taken here).
pub(super) fn unquantized(ir: &MatmulOpIr) -> bool {
    !matches!(ir.lhs.dtype, DType::QFloat(_)) && !matches!(ir.rhs.dtype, DType::QFloat(_))
}

/// `op`, with every consumed input that another stream allocated marked `ReadOnly` (see the
/// module docs).
pub(super) fn allocated_here_or_read_only<'a, R: CubeRuntime>(
    op: &'a OperationIr,
    handles: &HandleContainer<CubeFusionHandle<R>>,
) -> Cow<'a, OperationIr> {
    let foreign: SmallVec<[TensorId; 2]> = op
        .inputs()
        .filter(|input| input.status == TensorStatus::ReadWrite)
        .filter(|input| {
            handles
                .get_handle_ref(&input.id)
                .is_some_and(allocated_elsewhere)
        })
        .map(|input| input.id)
        .collect();
    if foreign.is_empty() {
        return Cow::Borrowed(op);
    }
    let mut op = op.clone();
    op.mark_read_only(&foreign);
    Cow::Owned(op)
}

/// Whether another stream than the current one allocated `handle`'s buffer: then it is never
/// written in place here (see the module docs).
pub(super) fn allocated_elsewhere<R: CubeRuntime>(handle: &CubeFusionHandle<R>) -> bool {
    handle.handle.stream != StreamId::current()
}

/// Whether the conversion above covers `op`: a subset of what burn-cubecl-fusion 0.21's
/// elementwise fuser accepts (boolean scalars have no relative form in burn-fusion either), its
/// matmuls, and, with `reductions`, the reductions its reduce fusers accept.
pub(super) fn fusable(op: &OperationIr, reductions: bool) -> bool {
    if reduction(op).is_some() {
        return reductions;
    }
    use BaseOperationIr as B;
    use FloatOperationIr as Fl;
    use NumericOperationIr as N;
    let scalar = |s: &ScalarIr| !matches!(s, ScalarIr::Bool(_));
    match op {
        OperationIr::Drop(_) => true,
        OperationIr::Float(_, op) => match op {
            Fl::Exp(_) | Fl::Log(_) | Fl::Log1p(_) | Fl::Cos(_) | Fl::Sin(_) | Fl::Tanh(_) => true,
            Fl::Sqrt(_) | Fl::Erf(_) | Fl::Recip(_) | Fl::Powf(_) => true,
            Fl::PowfScalar(ir) => scalar(&ir.rhs),
            Fl::Matmul(ir) => unquantized(ir),
            _ => false,
        },
        OperationIr::NumericFloat(_, op) | OperationIr::NumericInt(_, op) => match op {
            N::Add(_) | N::Sub(_) | N::Mul(_) | N::Div(_) | N::Rem(_) | N::Abs(_) => true,
            N::Greater(_) | N::GreaterEqual(_) | N::Lower(_) | N::LowerEqual(_) => true,
            N::AddScalar(ir) | N::SubScalar(ir) | N::MulScalar(ir) | N::DivScalar(ir) => {
                scalar(&ir.rhs)
            }
            N::RemScalar(ir) | N::GreaterElem(ir) | N::GreaterEqualElem(ir) => scalar(&ir.rhs),
            N::LowerElem(ir) | N::LowerEqualElem(ir) => scalar(&ir.rhs),
            N::Clamp(ir) => scalar(&ir.min) && scalar(&ir.max),
            _ => false,
        },
        OperationIr::BaseFloat(op) | OperationIr::BaseInt(op) | OperationIr::BaseBool(op) => {
            match op {
                B::Equal(_) | B::Cast(_) | B::Reshape(_) | B::SwapDims(_) | B::MaskWhere(_) => true,
                B::EqualElem(ir) => scalar(&ir.rhs),
                B::MaskFill(ir) => scalar(&ir.value),
                _ => false,
            }
        }
        _ => false,
    }
}
