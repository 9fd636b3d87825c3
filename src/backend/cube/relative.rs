//! burn-fusion's relative IR, built one operation at a time, with marks so a run can be rolled
//! back to any prefix.
//!
//! Every operation the engine offers is converted, and most runs are known already (a lookup in
//! the trie) or end up running operation by operation, so the conversion is on the recording
//! path of every fusable operation. It therefore keeps what it has converted in lists that only
//! grow at their end while a run is offered (a tensor's relative id, a size's relative id and a
//! scalar's id are each its position), so rolling back is truncating them, and finds a global
//! id or a size by scanning while a run is short ([`Positions`](crate::small::Positions)). The maps burn-fusion's
//! [`Context`] wants are filled from the lists only when a run is executed fused
//! ([`Relative::lend`]).

use super::*;
use crate::small::{Positions, copy_ir, dims};

/// burn-fusion's relative form of a run (see the module docs), built one operation at a time;
/// the last operations' conversions can be taken back ([`Relative::roll_back`]).
#[derive(Default)]
pub(super) struct Relative {
    /// By relative id: each tensor's global IR, with the status of its latest use in the run.
    pub(super) tensors: Vec<TensorIr>,
    /// The global ids of `tensors`, in the same order.
    ids: Positions<TensorId>,
    /// By relative shape id: the size it stands for (id 0 is size 1).
    pub(super) dims: Positions<usize>,
    /// By scalar id: the scalar.
    pub(super) scalars: Vec<ScalarIr>,
    /// The status each tensor seen again in the run had before (its relative id, the status).
    statuses: Vec<(usize, TensorStatus)>,
    /// The lengths of the lists before each converted operation.
    pub(super) marks: Vec<Mark>,
    /// The global ids of the tensors the last operation converted consumes (status
    /// `ReadWrite`: its consumed inputs, or the tensor a drop frees).
    pub(super) consumed: SmallVec<[TensorId; 4]>,
    /// burn-fusion's maps of the run, filled when it executes fused and lent to its context;
    /// kept between runs so that filling them allocates nothing once a stream has warmed up.
    context: ContextMaps,
}

/// The lengths of [`Relative`]'s lists before one operation's conversion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Mark {
    tensors: usize,
    dims: usize,
    scalars: usize,
    statuses: usize,
}

/// The maps of burn-fusion's [`Context`], by relative id.
#[derive(Default)]
pub(super) struct ContextMaps {
    pub(super) tensors: HashMap<TensorId, TensorIr>,
    pub(super) scalars: HashMap<ScalarId, ScalarIr>,
    pub(super) shapes: HashMap<usize, usize>,
}

impl Relative {
    /// Empty, as for a new run, keeping the lists' memory (a stream's runs are alike in size).
    pub(super) fn clear(&mut self) {
        self.tensors.clear();
        self.ids.truncate(0);
        self.dims.truncate(0);
        self.scalars.clear();
        self.statuses.clear();
        self.marks.clear();
    }

    /// The relative id of size `dim`, given one if it is new.
    #[inline]
    fn dim(&mut self, dim: usize) -> usize {
        if dim == 1 {
            return 0;
        }
        if self.dims.len() == 0 {
            // Size 1 is always id 0.
            self.dims.push(1);
        }
        match self.dims.get(dim) {
            Some(id) => id,
            None => self.dims.push(dim),
        }
    }

    pub(super) fn tensor(&mut self, ir: &TensorIr) -> TensorIr {
        if ir.status == TensorStatus::ReadWrite {
            self.consumed.push(ir.id);
        }
        let id = match self.ids.get(ir.id) {
            Some(id) => {
                // Seen before in this run: only its status is new.
                let known = &mut self.tensors[id];
                debug_assert_eq!((&known.shape, known.dtype), (&ir.shape, ir.dtype));
                let before = std::mem::replace(&mut known.status, ir.status);
                self.statuses.push((id, before));
                id
            }
            None => {
                self.tensors.push(copy_ir(ir));
                self.ids.push(ir.id)
            }
        };
        let mut shape = SmallVec::from_slice(dims(&ir.shape));
        for dim in shape.iter_mut() {
            *dim = self.dim(*dim);
        }
        TensorIr {
            id: TensorId::new(id as u64),
            shape: Shape::new_raw(shape),
            status: ir.status,
            dtype: ir.dtype,
        }
    }

    pub(super) fn scalar(&mut self, scalar: &ScalarIr) -> ScalarIr {
        self.scalars.push(*scalar);
        ScalarIr::UInt(self.scalars.len() as u64 - 1)
    }

    /// Take back the conversions of the operations after the first `len`.
    pub(super) fn roll_back_to(&mut self, len: usize) {
        if let Some(mark) = self.marks.get(len).copied() {
            self.marks.truncate(len);
            self.undo_to(mark);
        }
    }

    /// Take back the conversion of the last operation converted.
    pub(super) fn roll_back(&mut self) {
        if let Some(mark) = self.marks.pop() {
            self.undo_to(mark);
        }
    }

    fn undo_to(&mut self, mark: Mark) {
        for (id, status) in self.statuses.drain(mark.statuses..).rev() {
            self.tensors[id].status = status;
        }
        self.tensors.truncate(mark.tensors);
        self.ids.truncate(mark.tensors);
        self.dims.truncate(mark.dims);
        self.scalars.truncate(mark.scalars);
    }

    /// burn-fusion's maps of the operations converted (relative ids to global IRs, scalar ids
    /// to scalars, shape ids to sizes), to lend to a fused kernel's context: they come back
    /// through [`Relative::give_back`].
    pub(super) fn lend(&mut self) -> ContextMaps {
        let mut maps = std::mem::take(&mut self.context);
        maps.tensors.clear();
        maps.scalars.clear();
        maps.shapes.clear();
        let ids = (0..).map(TensorId::new);
        maps.tensors
            .extend(ids.zip(self.tensors.iter().map(copy_ir)));
        let ids = (0..).map(|value| ScalarId { value });
        maps.scalars.extend(ids.zip(self.scalars.iter().copied()));
        maps.shapes.insert(0, 1);
        maps.shapes
            .extend(self.dims.keys().iter().copied().enumerate().skip(1));
        maps
    }

    /// Take back the maps [`Relative::lend`] lent.
    pub(super) fn give_back(&mut self, maps: ContextMaps) {
        self.context = maps;
    }

    pub(super) fn unary(&mut self, ir: &UnaryOpIr) -> UnaryOpIr {
        UnaryOpIr {
            input: self.tensor(&ir.input),
            out: self.tensor(&ir.out),
        }
    }

    pub(super) fn binary(&mut self, ir: &BinaryOpIr) -> BinaryOpIr {
        BinaryOpIr {
            lhs: self.tensor(&ir.lhs),
            rhs: self.tensor(&ir.rhs),
            out: self.tensor(&ir.out),
        }
    }

    pub(super) fn scalar_op(&mut self, ir: &ScalarOpIr) -> ScalarOpIr {
        ScalarOpIr {
            lhs: self.tensor(&ir.lhs),
            rhs: self.scalar(&ir.rhs),
            out: self.tensor(&ir.out),
        }
    }

    pub(super) fn reduce_dim(&mut self, ir: &ReduceDimOpIr) -> ReduceDimOpIr {
        ReduceDimOpIr {
            input: self.tensor(&ir.input),
            out: self.tensor(&ir.out),
            axis: ir.axis,
            accumulator_len: ir.accumulator_len,
        }
    }

    /// The relative form of `op`, which must be [`fusable`].
    pub(super) fn op(&mut self, op: &OperationIr) -> OperationIr {
        self.consumed.clear();
        self.marks.push(Mark {
            tensors: self.tensors.len(),
            dims: self.dims.len(),
            scalars: self.scalars.len(),
            statuses: self.statuses.len(),
        });
        match op {
            OperationIr::Drop(tensor) => OperationIr::Drop(self.tensor(tensor)),
            OperationIr::Float(dtype, op) => OperationIr::Float(*dtype, self.float(op)),
            OperationIr::NumericFloat(dtype, op) => {
                OperationIr::NumericFloat(*dtype, self.numeric(op))
            }
            OperationIr::NumericInt(dtype, op) => OperationIr::NumericInt(*dtype, self.numeric(op)),
            OperationIr::BaseFloat(op) => OperationIr::BaseFloat(self.base(op)),
            OperationIr::BaseInt(op) => OperationIr::BaseInt(self.base(op)),
            OperationIr::BaseBool(op) => OperationIr::BaseBool(self.base(op)),
            _ => unreachable!("checked by `fusable`"),
        }
    }

    pub(super) fn float(&mut self, op: &FloatOperationIr) -> FloatOperationIr {
        use FloatOperationIr as O;
        match op {
            O::Exp(ir) => O::Exp(self.unary(ir)),
            O::Log(ir) => O::Log(self.unary(ir)),
            O::Log1p(ir) => O::Log1p(self.unary(ir)),
            O::Cos(ir) => O::Cos(self.unary(ir)),
            O::Sin(ir) => O::Sin(self.unary(ir)),
            O::Tanh(ir) => O::Tanh(self.unary(ir)),
            O::Sqrt(ir) => O::Sqrt(self.unary(ir)),
            O::Erf(ir) => O::Erf(self.unary(ir)),
            O::Recip(ir) => O::Recip(self.unary(ir)),
            O::Powf(ir) => O::Powf(self.binary(ir)),
            O::PowfScalar(ir) => O::PowfScalar(self.scalar_op(ir)),
            O::Matmul(ir) => O::Matmul(MatmulOpIr {
                lhs: self.tensor(&ir.lhs),
                rhs: self.tensor(&ir.rhs),
                out: self.tensor(&ir.out),
            }),
            _ => unreachable!("checked by `fusable`"),
        }
    }

    pub(super) fn numeric(&mut self, op: &NumericOperationIr) -> NumericOperationIr {
        use NumericOperationIr as O;
        match op {
            O::Add(ir) => O::Add(self.binary(ir)),
            O::Sub(ir) => O::Sub(self.binary(ir)),
            O::Mul(ir) => O::Mul(self.binary(ir)),
            O::Div(ir) => O::Div(self.binary(ir)),
            O::Rem(ir) => O::Rem(self.binary(ir)),
            O::Greater(ir) => O::Greater(self.binary(ir)),
            O::GreaterEqual(ir) => O::GreaterEqual(self.binary(ir)),
            O::Lower(ir) => O::Lower(self.binary(ir)),
            O::LowerEqual(ir) => O::LowerEqual(self.binary(ir)),
            O::AddScalar(ir) => O::AddScalar(self.scalar_op(ir)),
            O::SubScalar(ir) => O::SubScalar(self.scalar_op(ir)),
            O::MulScalar(ir) => O::MulScalar(self.scalar_op(ir)),
            O::DivScalar(ir) => O::DivScalar(self.scalar_op(ir)),
            O::RemScalar(ir) => O::RemScalar(self.scalar_op(ir)),
            O::GreaterElem(ir) => O::GreaterElem(self.scalar_op(ir)),
            O::GreaterEqualElem(ir) => O::GreaterEqualElem(self.scalar_op(ir)),
            O::LowerElem(ir) => O::LowerElem(self.scalar_op(ir)),
            O::LowerEqualElem(ir) => O::LowerEqualElem(self.scalar_op(ir)),
            O::Abs(ir) => O::Abs(self.unary(ir)),
            O::Clamp(ir) => O::Clamp(ClampOpIr {
                tensor: self.tensor(&ir.tensor),
                min: self.scalar(&ir.min),
                max: self.scalar(&ir.max),
                out: self.tensor(&ir.out),
            }),
            O::SumDim(ir) => O::SumDim(self.reduce_dim(ir)),
            O::MeanDim(ir) => O::MeanDim(self.reduce_dim(ir)),
            O::ProdDim(ir) => O::ProdDim(self.reduce_dim(ir)),
            O::MaxDim(ir) => O::MaxDim(self.reduce_dim(ir)),
            O::MinDim(ir) => O::MinDim(self.reduce_dim(ir)),
            O::MaxAbsDim(ir) => O::MaxAbsDim(self.reduce_dim(ir)),
            O::ArgMax(ir) => O::ArgMax(self.reduce_dim(ir)),
            O::ArgMin(ir) => O::ArgMin(self.reduce_dim(ir)),
            _ => unreachable!("checked by `fusable`"),
        }
    }

    pub(super) fn base(&mut self, op: &BaseOperationIr) -> BaseOperationIr {
        use BaseOperationIr as O;
        match op {
            O::Equal(ir) => O::Equal(self.binary(ir)),
            O::EqualElem(ir) => O::EqualElem(self.scalar_op(ir)),
            O::Cast(ir) => O::Cast(CastOpIr {
                input: self.tensor(&ir.input),
                out: self.tensor(&ir.out),
            }),
            O::Reshape(ir) => O::Reshape(ShapeOpIr {
                input: self.tensor(&ir.input),
                out: self.tensor(&ir.out),
            }),
            O::SwapDims(ir) => O::SwapDims(SwapDimsOpIr {
                input: self.tensor(&ir.input),
                out: self.tensor(&ir.out),
                dim1: ir.dim1,
                dim2: ir.dim2,
            }),
            O::MaskWhere(ir) => O::MaskWhere(MaskWhereOpIr {
                tensor: self.tensor(&ir.tensor),
                mask: self.tensor(&ir.mask),
                value: self.tensor(&ir.value),
                out: self.tensor(&ir.out),
            }),
            O::MaskFill(ir) => O::MaskFill(MaskFillOpIr {
                tensor: self.tensor(&ir.tensor),
                mask: self.tensor(&ir.mask),
                value: self.scalar(&ir.value),
                out: self.tensor(&ir.out),
            }),
            _ => unreachable!("checked by `fusable`"),
        }
    }
}
