//! Kernel fusion for `StreamFusion<CubeBackend<R, ..>>` (feature `cuda`): a stream's runs go
//! through burn-cubecl-fusion 0.21's fusers and execute as one [`CubeOptimization`] kernel each:
//! a run that starts with a matmul through the matmul fuser (the matmul with the elementwise
//! operations after it as its epilogue), any other run through the elementwise fuser. The matmul
//! optimization's fallback (what it runs when its fused kernel does not apply, and what autotune
//! measures it against) is the backend's own `float_matmul` on the run's handles. The reduce
//! fusers are not used yet: a reduction runs unfused, between runs.
//!
//! The fuser consumes burn-fusion's *relative* IR: tensor ids renumbered in order of first
//! appearance in the run, every dimension replaced by an id per distinct size (size 1 is id 0),
//! and every scalar replaced by an id into a table. burn-fusion's converter is private, so the
//! conversion is written here, for the operations these fusers accept; any other
//! operation ends the run (and runs unfused). The fused kernel reads the [`Context`] built from
//! the same conversion of exactly the covered operations, so a status seen only by an operation
//! after the run (a later consuming use) never leaks into it.
//!
//! In place: burn-cubecl-fusion and burn-cubecl write a `ReadWrite` input in place when its
//! handle has no other owner (`can_mut`), which already keeps views safe. This crate's CUDA rule
//! adds that a buffer is written in place only on the stream that allocated it (see
//! [`crate::cuda`]): cubecl orders another stream's access to a buffer after the *allocating*
//! stream's work, so a write on a third stream would be invisible to it. A consumed input
//! allocated on another stream is offered to the fusers as `ReadOnly`, so the fused kernel gives
//! it a fresh output instead (the engine still releases it after the run); an operation that
//! runs unfused gets the same rule through [`Fuser::keeps_read_only`].

use std::borrow::Cow;
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind};

use burn_backend::{DType, Shape, StreamId};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_cubecl_fusion::optim::CubeOptimization;
use burn_cubecl_fusion::optim::elemwise::ElementWiseFuser;
use burn_cubecl_fusion::optim::matmul::MatmulFuser;
use burn_cubecl_fusion::{CubeFusionHandle, FallbackOperation};
use burn_fusion::stream::{Context, ScalarId};
use burn_fusion::{FuserStatus, OperationFuser};
use burn_ir::{
    BackendIr, BaseOperationIr, BinaryOpIr, CastOpIr, ClampOpIr, FloatOperationIr, HandleContainer,
    MaskFillOpIr, MaskWhereOpIr, MatmulOpIr, NumericOperationIr, OperationIr, ScalarIr, ScalarOpIr,
    ShapeOpIr, SwapDimsOpIr, TensorId, TensorIr, TensorStatus, UnaryOpIr,
};
use hashbrown::HashMap;
use smallvec::SmallVec;

use super::BackendRuntime;
use crate::runtime::Fuser;
use crate::{Error, Result};

/// The fuser of a `StreamFusion<CubeBackend<R, F, I, BT>>` stream.
pub type CubeStreamFuser<R, F, I, BT> = Box<dyn Fuser<BackendRuntime<CubeBackend<R, F, I, BT>>>>;

/// The fuser of `StreamFusion<CubeBackend<R, F, I, BT>>` streams: registered for the CUDA
/// backends by default; pass it to [`super::register_fuser`] for a `CubeBackend` over another
/// cubecl runtime.
pub fn cube_fuser<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    device: &R::Device,
) -> CubeStreamFuser<R, F, I, BT> {
    Box::new(CubeFuser::<R, CubeBackend<R, F, I, BT>> {
        elementwise: ElementWiseFuser::new(device.clone()),
        matmul: MatmulFuser::new(device.clone()),
        kind: Kind::Elementwise,
        fallback: None,
        backend: PhantomData,
        live: true,
        offered_relative: Vec::new(),
        relative: Relative::default(),
        runs: vec![Node::default()],
        at: 0,
    })
}

/// The most runs (distinct relative prefixes) a stream remembers before it starts over.
const MAX_NODES: usize = 4096;

/// A relative operation as a key. The relative form holds no floating-point value (scalars
/// are ids into the context's table), so equality is an equivalence.
#[derive(Clone, PartialEq, Hash)]
struct Key(OperationIr);

impl Eq for Key {}

/// One relative prefix a fuser has seen: whether the run's fuser took its last operation, what
/// follows it, and the kernel of a run that ends here, once built.
struct Node<R: CubeRuntime> {
    accepted: bool,
    next: HashMap<Key, usize>,
    optimization: Option<CubeOptimization<R>>,
}

/// Which of burn-cubecl-fusion's fusers a run goes through: a run that starts with a matmul
/// goes through the matmul fuser (the matmul and the elementwise operations after it, in one
/// kernel), any other run through the elementwise fuser. Each closes on what the other starts
/// with, so the first operation decides.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Elementwise,
    Matmul,
}

impl<R: CubeRuntime> Default for Node<R> {
    fn default() -> Self {
        Self {
            accepted: true,
            next: HashMap::new(),
            optimization: None,
        }
    }
}

/// The fuser of one stream. burn-cubecl-fusion's fuser decides on the relative form alone, so
/// its decisions and its kernels are remembered per relative prefix (a trie of runs, as
/// burn-fusion caches its optimizations by relative graph): a run seen before costs a lookup
/// per operation and no fuser work, and the fuser itself only runs on a new prefix.
struct CubeFuser<R: CubeRuntime, B> {
    elementwise: ElementWiseFuser<R>,
    matmul: MatmulFuser<R>,
    /// The fuser of the current run.
    kind: Kind,
    /// A matmul run's matmul, as offered (global ids): what the optimization runs unfused when
    /// its fused kernel cannot (burn's fallback).
    fallback: Option<MatmulOpIr>,
    backend: PhantomData<fn() -> B>,
    /// Whether `elementwise` has been fed exactly `offered_relative` since its last reset.
    live: bool,
    /// The accepted operations in relative form, to replay into the fuser on a new prefix.
    offered_relative: Vec<OperationIr>,
    /// The conversion of exactly the accepted operations: the context of the run's kernel.
    relative: Relative,
    /// The trie of runs seen, `runs[0]` the empty prefix.
    runs: Vec<Node<R>>,
    /// The node of the accepted prefix.
    at: usize,
}

impl<R: CubeRuntime, B> CubeFuser<R, B> {
    /// The run's fuser, fed exactly the accepted prefix (replayed into a fresh one if it
    /// lagged).
    fn fed(&mut self) -> &mut dyn OperationFuser<CubeOptimization<R>> {
        let fuser: &mut dyn OperationFuser<CubeOptimization<R>> = match self.kind {
            Kind::Elementwise => &mut self.elementwise,
            Kind::Matmul => &mut self.matmul,
        };
        if !self.live {
            fuser.reset();
            for op in &self.offered_relative {
                fuser.fuse(op);
            }
            self.live = true;
        }
        fuser
    }
}

impl<R, F, I, BT> Fuser<BackendRuntime<CubeBackend<R, F, I, BT>>>
    for CubeFuser<R, CubeBackend<R, F, I, BT>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn offer(&mut self, op: &OperationIr, handles: &HandleContainer<CubeFusionHandle<R>>) -> bool {
        let op = allocated_here_or_read_only(op, handles);
        let Some(relative) = self.relative.op(&op) else {
            return false;
        };
        // From here on, a refusal takes the operation's conversion back: the context must hold
        // exactly the accepted operations (a refused consuming use would otherwise change the
        // status of a tensor the kernel reads).
        let first = self.offered_relative.is_empty();
        if first {
            let matmul = matmul(&op);
            self.kind = if matmul.is_some() {
                Kind::Matmul
            } else {
                Kind::Elementwise
            };
            self.fallback = matmul.cloned();
        }
        let key = Key(relative);
        let (next, fed_now) = match self.runs[self.at].next.get(&key) {
            Some(next) => (*next, false),
            None => {
                // A new prefix: ask the fuser, and remember its answer. The matmul fuser counts
                // its matmul before it takes it; it takes it unless it closes.
                let kind = self.kind;
                let fuser = self.fed();
                let accepted = !matches!(fuser.status(), FuserStatus::Closed) && {
                    let before = fuser.len();
                    fuser.fuse(&key.0);
                    let open = !matches!(fuser.status(), FuserStatus::Closed);
                    fuser.len() > before || (first && kind == Kind::Matmul && open)
                };
                self.runs.push(Node {
                    accepted,
                    ..Node::default()
                });
                let next = self.runs.len() - 1;
                self.runs[self.at].next.insert(key.clone(), next);
                (next, true)
            }
        };
        if !self.runs[next].accepted {
            self.relative.roll_back();
            return false;
        }
        // A known prefix is not fed to the fuser: from here on it lags behind.
        self.live &= fed_now;
        self.at = next;
        self.offered_relative.push(key.0);
        true
    }

    fn covered(&self) -> usize {
        // The elementwise fuser is ready as soon as it holds one operation.
        self.offered_relative.len()
    }

    fn execute(
        &mut self,
        handles: &mut HandleContainer<CubeFusionHandle<R>>,
        _: &super::BackendContext<CubeBackend<R, F, I, BT>>,
    ) -> Result<usize> {
        if self.runs[self.at].optimization.is_none() {
            let built = self.fed().finish();
            self.runs[self.at].optimization = Some(built);
        }
        let relative = std::mem::take(&mut self.relative);
        let fallback = self.fallback.take();
        let optimization = self.runs[self.at]
            .optimization
            .as_mut()
            .expect("built above");
        run::<R, CubeBackend<R, F, I, BT>>(optimization, fallback, relative, handles)?;
        Ok(1)
    }

    fn keeps_read_only(&self, handle: &CubeFusionHandle<R>) -> bool {
        allocated_elsewhere(handle)
    }

    fn reset(&mut self) {
        self.offered_relative.clear();
        self.fallback = None;
        self.relative = Relative::default();
        self.at = 0;
        self.live = false;
        if self.runs.len() >= MAX_NODES {
            // Start over rather than grow without bound.
            self.runs.truncate(1);
            self.runs[0].next.clear();
        }
    }
}

/// Run the fused kernel over the stream's handles, which the context owns for the call and
/// always gives back (a panic included: it becomes the run's error).
fn run<R: CubeRuntime, B: BackendIr<Handle = CubeFusionHandle<R>> + 'static>(
    optimization: &mut CubeOptimization<R>,
    fallback: Option<MatmulOpIr>,
    relative: Relative,
    handles: &mut HandleContainer<CubeFusionHandle<R>>,
) -> Result<()> {
    let mut context = Context {
        tensors: relative.relative2global,
        handles: std::mem::take(handles),
        scalars: relative.scalars,
        shapes_relative2global: relative.shapes_relative2global,
    };
    let outcome = catch_unwind(AssertUnwindSafe(|| match optimization {
        CubeOptimization::ElementWise(elementwise) => {
            elementwise.execute(&mut context);
            Ok(())
        }
        CubeOptimization::Matmul(matmul) => {
            let Some(ir) = fallback else {
                return Err(Error::Runtime("a matmul run without its matmul".into()));
            };
            matmul.execute(&mut context, move |_| {
                Box::new(MatmulFallback::<B> {
                    ir,
                    backend: PhantomData,
                })
            });
            Ok(())
        }
        _ => Err(Error::Runtime(
            "a fuser built an optimization this crate does not run".into(),
        )),
    }));
    *handles = context.handles;
    outcome.map_err(|payload| Error::from_kernel_panic("fused kernel", payload))?
}

/// A matmul run's matmul, run by the backend on the run's handles (global ids): what burn's
/// matmul optimization runs when its fused kernel does not apply, or while autotuning.
struct MatmulFallback<B> {
    ir: MatmulOpIr,
    backend: PhantomData<fn() -> B>,
}

impl<R: CubeRuntime, B: BackendIr<Handle = CubeFusionHandle<R>> + 'static> FallbackOperation<R>
    for MatmulFallback<B>
{
    fn run(&self, context: &mut Context<CubeFusionHandle<R>>) {
        let lhs = context.handles.get_float_tensor::<B>(&self.ir.lhs);
        let rhs = context.handles.get_float_tensor::<B>(&self.ir.rhs);
        let out = B::float_matmul(lhs, rhs);
        context
            .handles
            .register_float_tensor::<B>(&self.ir.out.id, out);
    }
}

/// `op`'s IR if it is a matmul of (unquantized) float tensors: what starts a matmul run.
fn matmul(op: &OperationIr) -> Option<&MatmulOpIr> {
    match op {
        OperationIr::Float(_, FloatOperationIr::Matmul(ir)) if unquantized(ir) => Some(ir),
        _ => None,
    }
}

/// Whether neither operand of a matmul is quantized (the matmul fuser's quantized path is
/// not taken here).
fn unquantized(ir: &MatmulOpIr) -> bool {
    !matches!(ir.lhs.dtype, DType::QFloat(_)) && !matches!(ir.rhs.dtype, DType::QFloat(_))
}

/// `op`, with every consumed input that another stream allocated marked `ReadOnly` (see the
/// module docs).
fn allocated_here_or_read_only<'a, R: CubeRuntime>(
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
fn allocated_elsewhere<R: CubeRuntime>(handle: &CubeFusionHandle<R>) -> bool {
    handle.handle.stream != StreamId::current()
}

/// burn-fusion's relative form of a run (see the module docs), built one operation at a time;
/// the last operation's conversion can be taken back ([`Relative::roll_back`]).
struct Relative {
    global2relative: HashMap<TensorId, TensorIr>,
    relative2global: HashMap<TensorId, TensorIr>,
    shapes_global2relative: HashMap<usize, usize>,
    shapes_relative2global: HashMap<usize, usize>,
    scalars: HashMap<ScalarId, ScalarIr>,
    /// What the last operation's conversion replaced, to take it back.
    undo: Vec<Undo>,
}

/// One change of a conversion, with what it replaced.
enum Undo {
    Tensor {
        global: TensorId,
        relative: TensorId,
        global2relative: Option<TensorIr>,
        relative2global: Option<TensorIr>,
    },
    Shape(usize, usize),
    Scalar(ScalarId),
}

impl Default for Relative {
    fn default() -> Self {
        // Size 1 is always dimension id 0.
        Self {
            global2relative: HashMap::new(),
            relative2global: HashMap::new(),
            shapes_global2relative: HashMap::from_iter([(1, 0)]),
            shapes_relative2global: HashMap::from_iter([(0, 1)]),
            scalars: HashMap::new(),
            undo: Vec::new(),
        }
    }
}

impl Relative {
    fn tensor(&mut self, ir: &TensorIr) -> TensorIr {
        let id = match self.global2relative.get(&ir.id) {
            Some(known) => known.id,
            None => TensorId::new(self.relative2global.len() as u64),
        };
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
        let relative2global = self.relative2global.insert(id, ir.clone());
        let global2relative = self.global2relative.insert(ir.id, relative.clone());
        self.undo.push(Undo::Tensor {
            global: ir.id,
            relative: id,
            global2relative,
            relative2global,
        });
        relative
    }

    fn scalar(&mut self, scalar: &ScalarIr) -> ScalarIr {
        let id = ScalarId {
            value: self.scalars.len() as u64,
        };
        self.scalars.insert(id, *scalar);
        self.undo.push(Undo::Scalar(id));
        ScalarIr::UInt(id.value)
    }

    /// Take back the conversion of the last operation converted.
    fn roll_back(&mut self) {
        for undo in self.undo.drain(..).rev() {
            match undo {
                Undo::Tensor {
                    global,
                    relative,
                    global2relative,
                    relative2global,
                } => {
                    match global2relative {
                        Some(before) => self.global2relative.insert(global, before),
                        None => self.global2relative.remove(&global),
                    };
                    match relative2global {
                        Some(before) => self.relative2global.insert(relative, before),
                        None => self.relative2global.remove(&relative),
                    };
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

    fn unary(&mut self, ir: &UnaryOpIr) -> UnaryOpIr {
        UnaryOpIr {
            input: self.tensor(&ir.input),
            out: self.tensor(&ir.out),
        }
    }

    fn binary(&mut self, ir: &BinaryOpIr) -> BinaryOpIr {
        BinaryOpIr {
            lhs: self.tensor(&ir.lhs),
            rhs: self.tensor(&ir.rhs),
            out: self.tensor(&ir.out),
        }
    }

    fn scalar_op(&mut self, ir: &ScalarOpIr) -> ScalarOpIr {
        ScalarOpIr {
            lhs: self.tensor(&ir.lhs),
            rhs: self.scalar(&ir.rhs),
            out: self.tensor(&ir.out),
        }
    }

    /// The relative form of `op`, or `None` (and nothing recorded) if the elementwise fuser
    /// does not take it.
    fn op(&mut self, op: &OperationIr) -> Option<OperationIr> {
        if !fusable(op) {
            return None;
        }
        self.undo.clear();
        Some(match op {
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
        })
    }

    fn float(&mut self, op: &FloatOperationIr) -> FloatOperationIr {
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

    fn numeric(&mut self, op: &NumericOperationIr) -> NumericOperationIr {
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
            _ => unreachable!("checked by `fusable`"),
        }
    }

    fn base(&mut self, op: &BaseOperationIr) -> BaseOperationIr {
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

/// Whether the conversion above covers `op` (a subset of what burn-cubecl-fusion 0.21's
/// elementwise fuser accepts; boolean scalars have no relative form in burn-fusion either).
fn fusable(op: &OperationIr) -> bool {
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
