//! burn-fusion's relative IR, built one operation at a time, with an undo log so a run can be
//! rolled back to any prefix.

use super::*;

/// burn-fusion's relative form of a run (see the module docs), built one operation at a time;
/// the last operation's conversion can be taken back ([`Relative::roll_back`]).
pub(super) struct Relative {
    pub(super) global2relative: HashMap<TensorId, TensorIr>,
    pub(super) relative2global: HashMap<TensorId, TensorIr>,
    pub(super) shapes_global2relative: HashMap<usize, usize>,
    pub(super) shapes_relative2global: HashMap<usize, usize>,
    pub(super) scalars: HashMap<ScalarId, ScalarIr>,
    /// What each conversion replaced, to take it back.
    pub(super) undo: Vec<Undo>,
    /// Where each converted operation's entries start in `undo`.
    pub(super) marks: Vec<usize>,
}

/// One change of a conversion, with what it replaced. Small (24 bytes): a run's undo log grows
/// by one per tensor of each operation offered.
pub(super) enum Undo {
    /// A tensor converted: seen first here (`None`: its entries go), or seen before with this
    /// status (a tensor's id, shape and dtype never change, so its status is all that did).
    Tensor {
        global: TensorId,
        relative: TensorId,
        before: Option<TensorStatus>,
    },
    Shape(usize, usize),
    Scalar(ScalarId),
}

const _: () = assert!(
    std::mem::size_of::<Undo>() <= 24,
    "the undo record stays small"
);

impl Default for Relative {
    fn default() -> Self {
        let mut relative = Self {
            global2relative: HashMap::new(),
            relative2global: HashMap::new(),
            shapes_global2relative: HashMap::new(),
            shapes_relative2global: HashMap::new(),
            scalars: HashMap::new(),
            undo: Vec::new(),
            marks: Vec::new(),
        };
        relative.clear();
        relative
    }
}

impl Relative {
    /// Empty, as for a new run, keeping the maps' memory (a stream's runs are alike in size).
    pub(super) fn clear(&mut self) {
        self.global2relative.clear();
        self.relative2global.clear();
        self.shapes_global2relative.clear();
        self.shapes_relative2global.clear();
        self.scalars.clear();
        self.undo.clear();
        self.marks.clear();
        // Size 1 is always dimension id 0.
        self.shapes_global2relative.insert(1, 0);
        self.shapes_relative2global.insert(0, 1);
    }

    pub(super) fn tensor(&mut self, ir: &TensorIr) -> TensorIr {
        if let Some(known) = self.global2relative.get_mut(&ir.id) {
            // Seen before in this run: only its status is new.
            let before = std::mem::replace(&mut known.status, ir.status);
            let relative = known.clone();
            let global = self
                .relative2global
                .get_mut(&relative.id)
                .expect("a tensor is in both maps or in neither");
            debug_assert_eq!((&global.shape, global.dtype), (&ir.shape, ir.dtype));
            global.status = ir.status;
            self.undo.push(Undo::Tensor {
                global: ir.id,
                relative: relative.id,
                before: Some(before),
            });
            return relative;
        }
        let id = TensorId::new(self.relative2global.len() as u64);
        let shape: Shape = ir
            .shape
            .iter()
            .map(|dim| match self.shapes_global2relative.get(dim) {
                Some(relative) => *relative,
                None => {
                    let relative = self.shapes_global2relative.len();
                    self.shapes_global2relative.insert(*dim, relative);
                    self.shapes_relative2global.insert(relative, *dim);
                    self.undo.push(Undo::Shape(*dim, relative));
                    relative
                }
            })
            .collect();
        let relative = TensorIr {
            id,
            shape,
            status: ir.status,
            dtype: ir.dtype,
        };
        self.relative2global.insert(id, ir.clone());
        self.global2relative.insert(ir.id, relative.clone());
        self.undo.push(Undo::Tensor {
            global: ir.id,
            relative: id,
            before: None,
        });
        relative
    }

    pub(super) fn scalar(&mut self, scalar: &ScalarIr) -> ScalarIr {
        let id = ScalarId {
            value: self.scalars.len() as u64,
        };
        self.scalars.insert(id, *scalar);
        self.undo.push(Undo::Scalar(id));
        ScalarIr::UInt(id.value)
    }

    /// Take back the conversions of the operations after the first `len`.
    pub(super) fn roll_back_to(&mut self, len: usize) {
        while self.marks.len() > len {
            self.roll_back();
        }
    }

    /// Take back the conversion of the last operation converted.
    pub(super) fn roll_back(&mut self) {
        let Some(mark) = self.marks.pop() else {
            return;
        };
        for undo in self.undo.drain(mark..).rev() {
            match undo {
                Undo::Tensor {
                    global,
                    relative,
                    before: Some(status),
                } => {
                    let unknown = "a tensor converted before is in both maps";
                    self.global2relative.get_mut(&global).expect(unknown).status = status;
                    self.relative2global
                        .get_mut(&relative)
                        .expect(unknown)
                        .status = status;
                }
                Undo::Tensor {
                    global,
                    relative,
                    before: None,
                } => {
                    self.global2relative.remove(&global);
                    self.relative2global.remove(&relative);
                }
                Undo::Shape(dim, relative) => {
                    self.shapes_global2relative.remove(&dim);
                    self.shapes_relative2global.remove(&relative);
                }
                Undo::Scalar(id) => {
                    self.scalars.remove(&id);
                }
            }
        }
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
        self.marks.push(self.undo.len());
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
