//! The stream fuser's run logic over stand-in fusers (no GPU needed).

//! The run logic over stand-in fusers (no GPU: a stand-in never builds a kernel). The
//! kernels themselves are tested on the GPU (`tests/backend.rs`, `cuda_fusion`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn_fusion::FuserProperties;
use cubecl::cuda::CudaRuntime;

use super::*;

type R = CudaRuntime;
type Cube = CubeBackend<R, f32, i32, u8>;

/// A fuser that takes operations while `takes` says so (and then closes), is ready once
/// it holds one that `readies` says so of, and counts what it is fed and how often it is
/// cloned. It must never be reset: a run starts from a clone.
#[derive(Clone)]
struct Stand {
    takes: fn(&OperationIr) -> bool,
    readies: fn(&OperationIr) -> bool,
    taken: usize,
    ready: bool,
    closed: bool,
    fed: Arc<AtomicUsize>,
    clones: Arc<AtomicUsize>,
}

impl Stand {
    fn new(takes: fn(&OperationIr) -> bool, readies: fn(&OperationIr) -> bool) -> Self {
        Self {
            takes,
            readies,
            taken: 0,
            ready: false,
            closed: false,
            fed: Arc::default(),
            clones: Arc::default(),
        }
    }
}

impl OperationFuser<CubeOptimization<R>> for Stand {
    fn fuse(&mut self, op: &OperationIr) {
        self.fed.fetch_add(1, Ordering::Relaxed);
        if self.closed {
            return;
        }
        if (self.takes)(op) {
            self.taken += 1;
            self.ready |= (self.readies)(op);
        } else {
            self.closed = true;
        }
    }

    fn finish(&mut self) -> CubeOptimization<R> {
        unreachable!("a stand-in builds no kernel")
    }

    fn reset(&mut self) {
        panic!("a fed fuser was reset instead of cloned afresh");
    }

    fn status(&self) -> FuserStatus {
        if self.closed {
            FuserStatus::Closed
        } else {
            FuserStatus::Open
        }
    }

    fn properties(&self) -> FuserProperties {
        FuserProperties {
            score: 0,
            ready: self.ready,
        }
    }

    fn len(&self) -> usize {
        self.taken
    }

    fn clone_dyn(&self) -> Box<dyn OperationFuser<CubeOptimization<R>>> {
        self.clones.fetch_add(1, Ordering::Relaxed);
        Box::new(self.clone())
    }
}

fn elementwise(op: &OperationIr) -> bool {
    reduction(op).is_none()
}

fn anything(_: &OperationIr) -> bool {
    true
}

fn a_reduction(op: &OperationIr) -> bool {
    reduction(op).is_some()
}

fn tensor(id: u64, shape: [usize; 2], status: TensorStatus) -> TensorIr {
    TensorIr {
        id: TensorId::new(id),
        shape: Shape::new(shape),
        status,
        dtype: DType::F32,
    }
}

/// `out = lhs + rhs` over `[4, 8]` tensors (`lhs` consumed).
fn add(lhs: u64, rhs: u64, out: u64) -> OperationIr {
    OperationIr::NumericFloat(
        DType::F32,
        NumericOperationIr::Add(BinaryOpIr {
            lhs: tensor(lhs, [4, 8], TensorStatus::ReadWrite),
            rhs: tensor(rhs, [4, 8], TensorStatus::ReadOnly),
            out: tensor(out, [4, 8], TensorStatus::NotInit),
        }),
    )
}

/// `out = input.sum_dim(1)` (`input` `[4, 8]`, consumed).
fn sum(input: u64, out: u64) -> OperationIr {
    OperationIr::NumericFloat(
        DType::F32,
        NumericOperationIr::SumDim(ReduceDimOpIr {
            input: tensor(input, [4, 8], TensorStatus::ReadWrite),
            out: tensor(out, [4, 1], TensorStatus::NotInit),
            axis: 1,
            accumulator_len: 1,
        }),
    )
}

/// An operation no fuser here takes (no relative form).
fn unfusable(input: u64, out: u64) -> OperationIr {
    OperationIr::Float(
        DType::F32,
        FloatOperationIr::Round(UnaryOpIr {
            input: tensor(input, [4, 8], TensorStatus::ReadWrite),
            out: tensor(out, [4, 8], TensorStatus::NotInit),
        }),
    )
}

fn fuser(slots: [Option<Stand>; 4]) -> CubeFuser<R, Cube> {
    CubeFuser::new(slots.map(|slot| slot.map(|stand| Box::new(stand) as DynFuser<R>)))
}

/// Offer `ops` until one is refused; how many were accepted.
fn offer_all(fuser: &mut CubeFuser<R, Cube>, ops: &[OperationIr]) -> usize {
    let handles = HandleContainer::new();
    ops.iter()
        .take_while(|op| Fuser::<BackendRuntime<Cube>>::offer(fuser, op, &handles))
        .count()
}

fn covered(fuser: &CubeFuser<R, Cube>) -> usize {
    Fuser::<BackendRuntime<Cube>>::covered(fuser)
}

fn reset(fuser: &mut CubeFuser<R, Cube>) {
    Fuser::<BackendRuntime<Cube>>::reset(fuser)
}

fn fuse_cut_run(fuser: &mut CubeFuser<R, Cube>, cut: Cut) -> bool {
    Fuser::<BackendRuntime<Cube>>::fuse_cut_run(fuser, cut)
}

/// An elementwise stand-in and a reduce stand-in that takes anything once it holds a
/// reduction.
fn elementwise_and_reduce() -> [Option<Stand>; 4] {
    [
        Some(Stand::new(elementwise, elementwise)),
        None,
        Some(Stand::new(anything, a_reduction)),
        None,
    ]
}

#[test]
fn the_longest_prefix_a_fuser_can_finish_wins() {
    let mut fuser = fuser(elementwise_and_reduce());
    let program = [add(0, 1, 2), add(2, 1, 3), sum(3, 4), add(5, 5, 6)];
    assert_eq!(offer_all(&mut fuser, &program), 4);
    // The elementwise fuser closed at the reduction; the reduce fuser covers all four.
    assert_eq!(covered(&fuser), 4);
    assert_eq!(fuser.chosen(), Some((4, FuserKind::Reduce)));

    // Without the reduction, the reduce fuser is never ready: the elementwise one runs.
    reset(&mut fuser);
    let program = [add(0, 1, 2), add(2, 1, 3), add(3, 1, 4)];
    assert_eq!(offer_all(&mut fuser, &program), 3);
    assert_eq!(fuser.chosen(), Some((3, FuserKind::Elementwise)));
}

#[test]
fn a_tie_goes_to_the_first_fuser_in_order() {
    let both = Stand::new(elementwise, elementwise);
    let mut fuser = fuser([Some(both.clone()), None, Some(both), None]);
    let program = [add(0, 1, 2), add(2, 1, 3), add(3, 1, 4)];
    assert_eq!(offer_all(&mut fuser, &program), 3);
    assert_eq!(fuser.chosen(), Some((3, FuserKind::Elementwise)));
}

/// An elementwise run of two operations runs unfused by default, drops in it not counted; a
/// third operation, or a threshold of two, fuses it. Another fuser's run of two still fuses.
#[test]
fn an_elementwise_run_of_two_operations_runs_unfused_by_default() {
    let elementwise_only = || [Some(Stand::new(elementwise, elementwise)), None, None, None];
    let mut fuser = fuser(elementwise_only());
    assert_eq!(fuser.min_elementwise_ops, DEFAULT_MIN_ELEMENTWISE_OPS);
    let dropped = OperationIr::Drop(tensor(1, [4, 8], TensorStatus::ReadWrite));
    let program = [add(0, 1, 2), dropped, add(2, 5, 3), add(3, 5, 4)];
    assert_eq!(offer_all(&mut fuser, &program[..3]), 3);
    assert_eq!(fuser.chosen(), None, "two operations and a drop");
    assert_eq!(covered(&fuser), 0);
    reset(&mut fuser);
    assert_eq!(offer_all(&mut fuser, &program), 4);
    assert_eq!(fuser.chosen(), Some((4, FuserKind::Elementwise)));

    let mut two = self::fuser(elementwise_only());
    two.min_elementwise_ops = 2;
    assert_eq!(offer_all(&mut two, &program[..3]), 3);
    assert_eq!(two.chosen(), Some((3, FuserKind::Elementwise)));

    // The reduce stand-in is ready once it holds a reduction: a two-operation reduce run.
    let mut reduce = self::fuser(elementwise_and_reduce());
    assert_eq!(offer_all(&mut reduce, &[add(0, 1, 2), sum(2, 3)]), 2);
    assert_eq!(reduce.chosen(), Some((2, FuserKind::Reduce)));
}

/// `out = input.sum_dim(1)`, `input` kept (read-only).
fn sum_keeping(input: u64, out: u64) -> OperationIr {
    let mut op = sum(input, out);
    op.mark_read_only(&[TensorId::new(input)]);
    op
}

/// `out = input * 2` over `[4, 8]` tensors, `input` kept (read-only).
fn double_keeping(input: u64, out: u64) -> OperationIr {
    let mut op = add(input, input, out);
    op.mark_read_only(&[TensorId::new(input)]);
    op
}

/// `out = input` with its two dimensions swapped, `input` kept.
fn swapped_keeping(input: u64, out: u64) -> OperationIr {
    OperationIr::BaseFloat(BaseOperationIr::SwapDims(SwapDimsOpIr {
        input: tensor(input, [4, 8], TensorStatus::ReadOnly),
        out: tensor(out, [4, 8], TensorStatus::NotInit),
        dim1: 0,
        dim2: 1,
    }))
}

/// What a reduce kernel's first block writes decides whether the reduce fusers may take the
/// run: burn-cubecl-fusion 0.21 launches it with another tensor's strides, or out of bounds,
/// unless the reference it then picks is the run's first made tensor over a contiguous first
/// operand (see `first_block`).
#[test]
fn a_reduce_run_whose_first_block_writes_is_fused_only_where_it_launches_right() {
    use FirstBlock::*;
    let dropped = |id| OperationIr::Drop(tensor(id, [4, 8], TensorStatus::ReadWrite));
    // Made before the reduction and consumed by it: nothing written.
    assert_eq!(first_block(&[add(0, 1, 2), sum(2, 3)]), Reads);
    assert_eq!(first_block(&[sum_keeping(0, 1), add(0, 5, 2)]), Reads);
    // `2` is dropped in the run.
    assert_eq!(
        first_block(&[add(0, 1, 2), sum_keeping(2, 3), dropped(2)]),
        Reads
    );
    // Made after the first reduction: a later block's output, not the first's.
    assert_eq!(
        first_block(&[sum(0, 1), add(1, 5, 2), sum_keeping(2, 3)]),
        Reads
    );
    // The first made tensor lives past the run, or is read after the reduction (a scaled
    // softmax): the reference is output 0 over input 0, of one shape.
    assert_eq!(
        first_block(&[add(0, 1, 2), sum_keeping(2, 3)]),
        WritesFirstMade
    );
    assert_eq!(
        first_block(&[add(0, 1, 2), sum_keeping(2, 3), add(2, 3, 4)]),
        WritesFirstMade
    );
    // A later made tensor is written, the first is not: the reference is output 1.
    assert_eq!(
        first_block(&[add(0, 1, 2), add(2, 1, 3), sum_keeping(3, 4)]),
        Writes
    );
    // Both the first made tensor and a later one are written: the first is the reference.
    assert_eq!(
        first_block(&[add(0, 1, 2), double_keeping(2, 3), sum_keeping(3, 4)]),
        WritesFirstMade
    );
    // burn's per-block quantization of a transposed tensor: a kept view first.
    assert_eq!(
        first_block(&[swapped_keeping(0, 1), double_keeping(1, 2), sum(2, 3)]),
        Writes
    );

    let mut fuser = fuser(elementwise_and_reduce());
    let handles = HandleContainer::new();
    // No handle for the first operand here: not known to be contiguous.
    let program = [add(0, 1, 2), add(2, 1, 3), sum_keeping(3, 4), dropped(3)];
    assert!(
        program
            .iter()
            .all(|op| Fuser::<BackendRuntime<Cube>>::offer(&mut fuser, op, &handles))
    );
    assert!(!fuser.first_operand_contiguous);
    assert_eq!(
        fuser.chosen(),
        Some((4, FuserKind::Reduce)),
        "nothing written"
    );
    reset(&mut fuser);
    assert_eq!(offer_all(&mut fuser, &program[..3]), 3);
    // `3` is written, and it is not the first made tensor: only the elementwise prefix of
    // two is ready, under the elementwise threshold.
    assert_eq!(fuser.chosen(), None);

    reset(&mut fuser);
    let scaled = [add(0, 1, 2), sum_keeping(2, 3), add(2, 5, 4), add(4, 1, 6)];
    assert_eq!(offer_all(&mut fuser, &scaled), 4);
    assert_eq!(
        fuser.chosen(),
        None,
        "a first operand not known to be contiguous"
    );
    fuser.first_operand_contiguous = true;
    assert_eq!(fuser.chosen(), Some((4, FuserKind::Reduce)));
}

/// Exactly the contiguous strides: a size-1 dimension's stride counts too, since the launcher
/// picks its vectorization axis from the smallest strides.
#[test]
fn contiguity_is_exactly_the_row_major_strides() {
    assert!(contiguous(&Shape::new([4, 8]), &[8, 1]));
    assert!(!contiguous(&Shape::new([4, 8]), &[1, 4]));
    assert!(contiguous(&Shape::new([4, 1]), &[1, 1]));
    assert!(!contiguous(&Shape::new([4, 1]), &[1, 7]));
    assert!(!contiguous(&Shape::new([4, 8]), &[8]));
    // Dimensions whose product overflows: no layout, no panic.
    assert!(!contiguous(
        &Shape::new([0, 1 << 40, 1 << 40]),
        &[1 << 40, 1 << 40, 1]
    ));
}

#[test]
fn a_run_ends_at_its_last_ready_prefix() {
    // The reduce fuser takes the trailing additions but is never ready again after a
    // second reduction it refuses; the run's kernel covers the prefix the elementwise
    // fuser can finish.
    let mut fuser = fuser([
        Some(Stand::new(elementwise, elementwise)),
        None,
        Some(Stand::new(elementwise, a_reduction)),
        None,
    ]);
    let program = [add(0, 1, 2), add(2, 1, 3), add(3, 1, 4), sum(4, 5)];
    assert_eq!(offer_all(&mut fuser, &program), 3);
    assert_eq!(fuser.chosen(), Some((3, FuserKind::Elementwise)));
    // The refused reduction's conversion was taken back.
    assert_eq!(fuser.relative.marks.len(), 3);
}

#[test]
fn an_operation_without_a_relative_form_or_a_disabled_reduction_is_refused() {
    let stand = Stand::new(anything, anything);
    let fed = stand.fed.clone();
    let mut fuser = fuser([Some(stand), None, None, None]);
    // No reduce fuser: a reduction is not offered to any fuser.
    assert_eq!(offer_all(&mut fuser, &[add(0, 1, 2), sum(2, 3)]), 1);
    reset(&mut fuser);
    assert_eq!(offer_all(&mut fuser, &[add(0, 1, 2), unfusable(2, 3)]), 1);
    // Fed the first addition only (the second run's is a known prefix).
    assert_eq!(fed.load(Ordering::Relaxed), 1);
}

/// `out = input`, or -1 where `mask` (a `u8` bool) holds, over `[4, 8]` tensors.
fn mask_fill(input: u64, mask: u64, out: u64) -> OperationIr {
    OperationIr::BaseFloat(BaseOperationIr::MaskFill(MaskFillOpIr {
        tensor: tensor(input, [4, 8], TensorStatus::ReadWrite),
        mask: TensorIr {
            dtype: DType::Bool(burn_backend::BoolStore::U8),
            ..tensor(mask, [4, 8], TensorStatus::ReadOnly)
        },
        value: ScalarIr::Float(-1.0),
        out: tensor(out, [4, 8], TensorStatus::NotInit),
    }))
}

/// `out = input <= 0` (a `u8` bool), over `[4, 8]` tensors.
fn non_positive(input: u64, out: u64) -> OperationIr {
    OperationIr::NumericFloat(
        DType::F32,
        NumericOperationIr::LowerEqualElem(ScalarOpIr {
            lhs: tensor(input, [4, 8], TensorStatus::ReadOnly),
            rhs: ScalarIr::Float(0.0),
            out: TensorIr {
                dtype: DType::Bool(burn_backend::BoolStore::U8),
                ..tensor(out, [4, 8], TensorStatus::NotInit)
            },
        }),
    )
}

#[test]
fn a_matmul_run_reads_one_width() {
    let takes_all = || Some(Stand::new(anything, anything));
    let mut matmul = fuser([None, takes_all(), None, None]);
    // The mask comes from outside the run: refused.
    assert_eq!(
        offer_all(&mut matmul, &[add(0, 1, 2), mask_fill(2, 3, 4)]),
        1
    );
    assert_eq!(matmul.chosen(), Some((1, FuserKind::Matmul)));

    // Made inside the run (`relu`'s mask), it is never read from memory: taken.
    let mut relu = fuser([None, takes_all(), None, None]);
    let program = [add(0, 1, 2), non_positive(2, 3), mask_fill(2, 3, 4)];
    assert_eq!(offer_all(&mut relu, &program), 3);
    assert_eq!(relu.chosen(), Some((3, FuserKind::Matmul)));

    // The elementwise fuser takes it: the run goes on without the matmul fuser.
    let mut both = fuser([takes_all(), takes_all(), None, None]);
    let program = [add(0, 1, 2), mask_fill(2, 3, 4), add(4, 1, 5)];
    assert_eq!(offer_all(&mut both, &program), 3);
    assert_eq!(both.chosen(), Some((3, FuserKind::Elementwise)));
    let alive = |depth: usize| both.runs[both.path[depth]].alive;
    assert_eq!(
        alive(1),
        FuserKind::Elementwise.bit() | FuserKind::Matmul.bit()
    );
    assert_eq!(alive(2), FuserKind::Elementwise.bit());
}

#[test]
fn a_known_prefix_asks_no_fuser() {
    let stand = Stand::new(elementwise, elementwise);
    let fed = stand.fed.clone();
    let mut fuser = fuser([Some(stand), None, None, None]);
    let program = [add(0, 1, 2), add(2, 1, 3), add(3, 1, 4)];
    assert_eq!(offer_all(&mut fuser, &program), 3);
    let first = fed.load(Ordering::Relaxed);
    assert_eq!(first, 3);
    reset(&mut fuser);
    // The same run with other global ids has the same relative form.
    let again = [add(10, 11, 12), add(12, 11, 13), add(13, 11, 14)];
    assert_eq!(offer_all(&mut fuser, &again), 3);
    assert_eq!(fed.load(Ordering::Relaxed), first);
    assert_eq!(fuser.chosen(), Some((3, FuserKind::Elementwise)));
}

#[test]
fn a_prefix_with_many_longer_ones_finds_each_again() {
    // More distinct one-operation runs than a node compares one by one: the root then finds
    // them by hash, and each is known the second time.
    let unary = |n: usize, input: u64, out: u64| {
        let ir = UnaryOpIr {
            input: tensor(input, [4, 8], TensorStatus::ReadOnly),
            out: tensor(out, [4, 8], TensorStatus::NotInit),
        };
        match n {
            0 => OperationIr::Float(DType::F32, FloatOperationIr::Exp(ir)),
            1 => OperationIr::Float(DType::F32, FloatOperationIr::Log(ir)),
            2 => OperationIr::Float(DType::F32, FloatOperationIr::Log1p(ir)),
            3 => OperationIr::Float(DType::F32, FloatOperationIr::Cos(ir)),
            4 => OperationIr::Float(DType::F32, FloatOperationIr::Sin(ir)),
            5 => OperationIr::Float(DType::F32, FloatOperationIr::Tanh(ir)),
            6 => OperationIr::Float(DType::F32, FloatOperationIr::Sqrt(ir)),
            7 => OperationIr::Float(DType::F32, FloatOperationIr::Erf(ir)),
            8 => OperationIr::Float(DType::F32, FloatOperationIr::Recip(ir)),
            _ => OperationIr::NumericFloat(DType::F32, NumericOperationIr::Abs(ir)),
        }
    };
    let stand = Stand::new(elementwise, elementwise);
    let fed = stand.fed.clone();
    let mut fuser = fuser([Some(stand), None, None, None]);
    let mut first = 0;
    for round in 0..2u64 {
        for n in 0..10 {
            let base = 100 * round + 10 * n as u64;
            let program = [unary(n, base, base + 1), unary(9 - n, base + 1, base + 2)];
            assert_eq!(offer_all(&mut fuser, &program), 2);
            reset(&mut fuser);
        }
        if round == 0 {
            first = fed.load(Ordering::Relaxed);
            assert_eq!(fuser.runs[0].next.len(), 10);
        }
    }
    assert_eq!(fed.load(Ordering::Relaxed), first, "every run was known");
    assert_eq!(fuser.runs.len(), 21);
}

#[test]
fn a_new_run_starts_every_fuser_from_a_fresh_clone() {
    let stand = Stand::new(anything, a_reduction);
    let clones = stand.clones.clone();
    let mut fuser = fuser([None, None, Some(stand), None]);
    assert_eq!(offer_all(&mut fuser, &[add(0, 1, 2), sum(2, 3)]), 2);
    assert_eq!(clones.load(Ordering::Relaxed), 1);
    reset(&mut fuser);
    // A different run: the fuser fed the last one is not reset (the stand-in panics if
    // it is) but replaced by a clone of the pristine one.
    assert_eq!(
        offer_all(&mut fuser, &[add(0, 1, 2), add(2, 1, 3), sum(3, 4)]),
        3
    );
    assert_eq!(clones.load(Ordering::Relaxed), 2);
    assert_eq!(fuser.chosen(), Some((3, FuserKind::Reduce)));
    // A known prefix, then a new operation: a clone fed the known prefix takes it.
    reset(&mut fuser);
    let program = [add(0, 1, 2), add(2, 1, 3), sum(3, 4), add(5, 1, 6)];
    assert_eq!(offer_all(&mut fuser, &program), 4);
    assert_eq!(clones.load(Ordering::Relaxed), 3);
    assert_eq!(fuser.chosen(), Some((4, FuserKind::Reduce)));
}

#[test]
fn rolling_back_to_a_prefix_gives_that_prefix_s_conversion() {
    let program = [add(0, 1, 2), add(2, 1, 3), sum(3, 4)];
    let mut long = Relative::default();
    for op in &program {
        long.op(op);
    }
    long.roll_back_to(1);
    let mut short = Relative::default();
    short.op(&program[0]);
    assert_same_conversion(&mut long, &mut short);
    assert_eq!(long.marks.len(), 1);
    // Converting the rest again gives what it gave the first time.
    let mut again = Relative::default();
    for op in &program {
        again.op(op);
    }
    for op in &program[1..] {
        long.op(op);
    }
    assert_same_conversion(&mut long, &mut again);
}

#[test]
fn a_cleared_conversion_converts_like_a_fresh_one() {
    let program = [add(0, 1, 2), add(2, 1, 3), sum(3, 4)];
    let mut reused = Relative::default();
    for op in &program {
        reused.op(op);
    }
    reused.clear();
    let mut fresh = Relative::default();
    let again = [add(10, 11, 12), add(12, 11, 13), sum(13, 14)];
    for op in &again {
        assert_eq!(reused.op(op), fresh.op(op));
    }
    assert_same_conversion(&mut reused, &mut fresh);
}

/// The two conversions hold the same tensors, sizes and scalars, and lend the same maps.
fn assert_same_conversion(a: &mut Relative, b: &mut Relative) {
    assert_eq!(a.tensors, b.tensors);
    assert_eq!(a.scalars, b.scalars);
    assert_eq!(a.marks, b.marks);
    let (lent_a, lent_b) = (a.lend(), b.lend());
    assert_eq!(lent_a.tensors, lent_b.tensors);
    assert_eq!(lent_a.scalars, lent_b.scalars);
    assert_eq!(lent_a.shapes, lent_b.shapes);
    a.give_back(lent_a);
    b.give_back(lent_b);
}

#[test]
fn the_conversion_renumbers_as_burn_fusion_does() {
    // `out = lhs + rhs` over [4, 8], then `sum_dim(1)` of it: tensors numbered in order of first
    // appearance, sizes by first appearance after size 1 (id 0), scalars in order.
    let mut relative = Relative::default();
    let first = relative.op(&add(7, 9, 11));
    let OperationIr::NumericFloat(_, NumericOperationIr::Add(ir)) = &first else {
        panic!("an addition converts to an addition: {first:?}");
    };
    assert_eq!(ir.lhs.id, TensorId::new(0));
    assert_eq!(ir.rhs.id, TensorId::new(1));
    assert_eq!(ir.out.id, TensorId::new(2));
    assert_eq!(ir.out.shape, Shape::new([1, 2]));
    let second = relative.op(&sum(11, 12));
    let OperationIr::NumericFloat(_, NumericOperationIr::SumDim(ir)) = &second else {
        panic!("a sum converts to a sum: {second:?}");
    };
    // Seen before: same relative id, the new status.
    assert_eq!(ir.input.id, TensorId::new(2));
    assert_eq!(ir.input.status, TensorStatus::ReadWrite);
    assert_eq!(ir.out.shape, Shape::new([1, 0]));
    let maps = relative.lend();
    assert_eq!(maps.shapes, HashMap::from([(0, 1), (1, 4), (2, 8)]));
    assert_eq!(maps.tensors[&TensorId::new(2)].id, TensorId::new(11));
    assert_eq!(
        maps.tensors[&TensorId::new(2)].status,
        TensorStatus::ReadWrite
    );
    assert_eq!(maps.tensors.len(), 4);
    relative.give_back(maps);
}

#[test]
fn a_run_longer_than_the_scanned_lists_converts_the_same() {
    // More tensors and sizes than `Positions` scans: the map beside the list takes over, and
    // rolling back below the switch goes back to scanning.
    let wide = |id: u64, n: usize| TensorIr {
        id: TensorId::new(id),
        shape: Shape::new([2 + n, 3]),
        status: TensorStatus::ReadOnly,
        dtype: DType::F32,
    };
    let op = |n: usize| {
        OperationIr::NumericFloat(
            DType::F32,
            NumericOperationIr::Add(BinaryOpIr {
                lhs: wide(1000, 0).clone(),
                rhs: TensorIr {
                    shape: Shape::new([2 + n, 3]),
                    ..wide(n as u64, n)
                },
                out: TensorIr {
                    status: TensorStatus::NotInit,
                    ..wide(500 + n as u64, n)
                },
            }),
        )
    };
    let mut relative = Relative::default();
    let converted: Vec<OperationIr> = (1..60).map(|n| relative.op(&op(n))).collect();
    // The shared left operand is tensor 0 every time; each new size gets the next id.
    for (n, converted) in (1..60).zip(&converted) {
        let OperationIr::NumericFloat(_, NumericOperationIr::Add(ir)) = converted else {
            unreachable!()
        };
        assert_eq!(ir.lhs.id, TensorId::new(0));
        assert_eq!(ir.rhs.id, TensorId::new(2 * n as u64 - 1));
        assert_eq!(ir.out.id, TensorId::new(2 * n as u64));
        assert_eq!(ir.rhs.shape[1], 2, "size 3 is the second size seen");
    }
    relative.roll_back_to(5);
    let mut short = Relative::default();
    for n in 1..6 {
        short.op(&op(n));
    }
    assert_same_conversion(&mut relative, &mut short);
    // And forward again, past the switch.
    for n in 6..60 {
        assert_eq!(relative.op(&op(n)), converted[n - 1]);
    }
}

#[test]
fn the_fusers_env_names_fusers() {
    assert_eq!(parse_kinds(""), Ok(0));
    assert_eq!(parse_kinds("none"), Ok(0));
    assert_eq!(parse_kinds("elementwise, matmul"), Ok(DEFAULT_KINDS));
    assert_eq!(parse_kinds("all"), Ok(0b1111));
    assert_eq!(
        parse_kinds("reduce,reduce_broadcasted"),
        Ok(FuserKind::Reduce.bit() | FuserKind::ReduceBroadcasted.bit())
    );
    let error = parse_kinds("elementwise,softmax").unwrap_err();
    assert!(error.contains("unknown fuser `softmax`"), "{error}");
}

/// A run cut by a drain is fused from the second time it is cut on (by default), on whichever
/// stream: the first time its operations run unfused. A shorter cut of the same operations is
/// another run, with its own count; with a threshold of 1 every cut run is fused.
#[test]
fn a_cut_run_is_fused_from_its_second_sighting_on_any_stream() {
    // Seven chained adds: a run no other test of this binary cuts (the counts are per process).
    let ops: Vec<OperationIr> = (0..7).map(|i| add(900 + i, 950, 901 + i)).collect();
    let elementwise_only = || [Some(Stand::new(elementwise, elementwise)), None, None, None];
    let mut first = fuser(elementwise_only());
    assert_eq!(first.cut_sightings, DEFAULT_CUT_SIGHTINGS);
    assert_eq!(offer_all(&mut first, &ops), 7);
    assert!(
        !fuse_cut_run(&mut first, Cut::Own),
        "first sighting: unfused"
    );
    reset(&mut first);

    let mut other_stream = fuser(elementwise_only());
    assert_eq!(offer_all(&mut other_stream, &ops), 7);
    assert!(
        fuse_cut_run(&mut other_stream, Cut::Own),
        "second sighting, another stream: fused"
    );
    reset(&mut other_stream);
    assert_eq!(offer_all(&mut other_stream, &ops[..5]), 5);
    assert!(
        !fuse_cut_run(&mut other_stream, Cut::Own),
        "a shorter cut is a run of its own"
    );

    let mut eager = fuser(elementwise_only());
    eager.cut_sightings = 1;
    assert_eq!(offer_all(&mut eager, &ops[..4]), 4);
    assert!(
        fuse_cut_run(&mut eager, Cut::Own),
        "threshold 1: fused at once"
    );
}

/// A run another thread's drain cuts runs unfused however often it is met (by default), and
/// does not count toward the sightings of its own thread's cuts; with a foreign threshold set,
/// foreign cuts are counted like the others.
#[test]
fn a_run_cut_by_another_thread_runs_unfused_by_default() {
    // Six chained adds: a run no other test of this binary cuts (the counts are per process).
    let ops: Vec<OperationIr> = (0..6).map(|i| add(700 + i, 750, 701 + i)).collect();
    let elementwise_only = || [Some(Stand::new(elementwise, elementwise)), None, None, None];
    let mut stream = fuser(elementwise_only());
    assert_eq!(stream.foreign_cut_sightings, DEFAULT_FOREIGN_CUT_SIGHTINGS);
    for sighting in 1..=3 {
        assert_eq!(offer_all(&mut stream, &ops), 6);
        assert!(
            !fuse_cut_run(&mut stream, Cut::Foreign),
            "foreign cut, sighting {sighting}: unfused"
        );
        reset(&mut stream);
    }
    assert_eq!(offer_all(&mut stream, &ops), 6);
    assert!(
        !fuse_cut_run(&mut stream, Cut::Own),
        "the foreign cuts were not counted: the first own cut is unfused"
    );
    reset(&mut stream);

    let mut counted = fuser(elementwise_only());
    counted.foreign_cut_sightings = 2;
    assert_eq!(offer_all(&mut counted, &ops[..3]), 3);
    assert!(!fuse_cut_run(&mut counted, Cut::Foreign), "first: unfused");
    reset(&mut counted);
    assert_eq!(offer_all(&mut counted, &ops[..3]), 3);
    assert!(fuse_cut_run(&mut counted, Cut::Foreign), "second: fused");
}
