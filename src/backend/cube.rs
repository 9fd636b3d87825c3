//! Kernel fusion for `StreamFusion<CubeBackend<R, ..>>` (feature `cuda`): a stream's runs go
//! through burn-cubecl-fusion 0.21's fusers and execute as one [`CubeOptimization`] kernel each.
//!
//! **Which fusers.** Every enabled fuser is offered each operation of a run side by side, as
//! burn-fusion offers its fusers; the run grows while at least one of them takes the next
//! operation. When it ends, the longest prefix some fuser can build a kernel for is executed by
//! that fuser (on a tie, the first in the order elementwise, matmul, reduce, broadcasted
//! reduce), and the rest of the run is offered again to a new one. By default the elementwise
//! and matmul fusers are enabled (a matmul with the elementwise operations after it as its
//! epilogue); the reduce fusers (a reduction with the elementwise operations before and after
//! it, and the softmax-like chains of reductions and broadcasts) are enabled by naming them in
//! [`FUSERS_ENV`] — see its docs for why they are not on by default.
//!
//! **Fallbacks.** A matmul or reduce kernel may run its matmul or reduction unfused instead (when
//! its fused kernel does not apply, or while autotune measures both). That fallback is the
//! backend's own operation (`float_matmul`, `float_sum_dim`, ..) on the run's handles, exactly
//! what the stream runs when the operation is not fused.
//!
//! **Fresh fusers.** Each run starts every fuser from a clone of the fuser as built, never from
//! `OperationFuser::reset`: burn-cubecl-fusion 0.21's trace fuser resets with the settings of
//! its *last* block, so a reduce fuser reset after a reduction would plan its next kernel with
//! the reduction's write settings (and panic in its vectorization planner at launch). burn-fusion
//! does the same: its searches start from never-fed fusers.
//!
//! **Relative IR.** The fusers consume burn-fusion's *relative* IR: tensor ids renumbered in
//! order of first appearance in the run, every dimension replaced by an id per distinct size
//! (size 1 is id 0), and every scalar replaced by an id into a table. burn-fusion's converter is
//! private, so the conversion is written here, for the operations these fusers accept; any other
//! operation ends the run (and runs unfused). The fused kernel reads the [`Context`] built from
//! the same conversion of exactly the covered operations, so a status seen only by an operation
//! after the run (a later consuming use) never leaks into it. The fusers decide on the relative
//! form alone, so their decisions and kernels are remembered per relative prefix (a trie of
//! runs, as burn-fusion caches its optimizations by relative graph): a run seen before costs a
//! lookup per operation and no fuser work. The conversion's maps are lent to the kernel's
//! context and come back to be cleared for the next run, so a stream's steady state allocates
//! nothing for them; a tensor seen again in a run changes only its status, which is all the
//! undo log keeps of it.
//!
//! **In place.** burn-cubecl-fusion and burn-cubecl write a `ReadWrite` input in place when its
//! handle has no other owner (`can_mut`), which already keeps views safe. The engine's CUDA rule
//! adds that a buffer is written in place only on the stream that allocated it (see
//! `cross_stream`): the engine orders another stream's use of a buffer after everything its
//! allocating stream dispatched, so every write must happen there. A consumed input allocated on
//! another stream is offered to the fusers as `ReadOnly`, so the fused kernel gives it a fresh
//! output instead (the engine still releases it after the run, in order); an operation that runs
//! unfused gets the same rule from the engine ([`StreamRuntime::foreign_to`](crate::runtime::StreamRuntime::foreign_to)).

use std::borrow::Cow;
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind};

use burn_backend::tensor::{FloatTensor, IntTensor};
use burn_backend::{DType, Shape, StreamId};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_cubecl_fusion::optim::CubeOptimization;
use burn_cubecl_fusion::optim::elemwise::ElementWiseFuser;
use burn_cubecl_fusion::optim::matmul::MatmulFuser;
use burn_cubecl_fusion::optim::reduce::{ReduceFuser, ReduceSettings};
use burn_cubecl_fusion::optim::reduce_broadcasted::ReduceBroadcastedFuser;
use burn_cubecl_fusion::{CubeFusionHandle, FallbackOperation};
use burn_fusion::stream::{Context, ScalarId};
use burn_fusion::{FuserStatus, OperationFuser};
use burn_ir::{
    BackendIr, BaseOperationIr, BinaryOpIr, CastOpIr, ClampOpIr, FloatOperationIr, HandleContainer,
    MaskFillOpIr, MaskWhereOpIr, MatmulOpIr, NumericOperationIr, OperationIr, ReduceDimOpIr,
    ScalarIr, ScalarOpIr, ShapeOpIr, SwapDimsOpIr, TensorId, TensorIr, TensorStatus, UnaryOpIr,
};
use hashbrown::HashMap;
use smallvec::SmallVec;

use super::BackendRuntime;
use super::record::Take;
use crate::runtime::Fuser;
use crate::{Error, Result};

/// The fuser of a `StreamFusion<CubeBackend<R, F, I, BT>>` stream.
pub type CubeStreamFuser<R, F, I, BT> = Box<dyn Fuser<BackendRuntime<CubeBackend<R, F, I, BT>>>>;

/// The environment variable that picks the fusers of `StreamFusion<CubeBackend>` streams (read
/// when a stream is created): a comma-separated list of `elementwise`, `matmul`, `reduce` and
/// `reduce_broadcasted`, or `all`, or `none` (no kernel fusion at all). Unset, it is
/// `elementwise,matmul`. An unknown name is reported (a `tracing` warning) and the default is
/// used.
///
/// The reduce fusers are opt-in until burn 0.21's backend suite has run in full on the H200 with
/// them on (see docs/BENCHMARKS.md, "Reduce fusion (opt-in)"); on the benchmark's softmax they gain
/// nothing measurable yet.
pub const FUSERS_ENV: &str = "FUSION_STREAMS_CUBE_FUSERS";

/// The fusers, in the order that breaks a tie between two that cover the same run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum FuserKind {
    Elementwise,
    Matmul,
    Reduce,
    ReduceBroadcasted,
}

impl FuserKind {
    const ALL: [FuserKind; 4] = [
        FuserKind::Elementwise,
        FuserKind::Matmul,
        FuserKind::Reduce,
        FuserKind::ReduceBroadcasted,
    ];

    fn name(self) -> &'static str {
        match self {
            FuserKind::Elementwise => "elementwise",
            FuserKind::Matmul => "matmul",
            FuserKind::Reduce => "reduce",
            FuserKind::ReduceBroadcasted => "reduce_broadcasted",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// A set of [`FuserKind`]s, one bit each.
type Kinds = u8;

const DEFAULT_KINDS: Kinds = 0b0011;

/// The fusers `spec` names (see [`FUSERS_ENV`]).
fn parse_kinds(spec: &str) -> std::result::Result<Kinds, String> {
    let mut kinds = 0;
    for name in spec
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
    {
        kinds |= match name {
            "all" => FuserKind::ALL.iter().map(|kind| kind.bit()).sum(),
            "none" => 0,
            name => match FuserKind::ALL.iter().find(|kind| kind.name() == name) {
                Some(kind) => kind.bit(),
                None => {
                    return Err(format!(
                        "unknown fuser `{name}` in {FUSERS_ENV}={spec:?} (known: elementwise, \
                         matmul, reduce, reduce_broadcasted, all, none)"
                    ));
                }
            },
        };
    }
    Ok(kinds)
}

/// The fusers [`FUSERS_ENV`] asks for.
fn kinds_from_env() -> Kinds {
    match std::env::var(FUSERS_ENV) {
        Ok(spec) => parse_kinds(&spec).unwrap_or_else(|error| {
            tracing::warn!(target: "fusion_streams", "{error}; using elementwise,matmul");
            DEFAULT_KINDS
        }),
        Err(_) => DEFAULT_KINDS,
    }
}

/// The fuser of `StreamFusion<CubeBackend<R, F, I, BT>>` streams, with the fusers
/// [`FUSERS_ENV`] asks for: registered for the CUDA backends by default; pass it to
/// [`super::register_fuser`] for a `CubeBackend` over another cubecl runtime.
pub fn cube_fuser<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    device: &R::Device,
) -> CubeStreamFuser<R, F, I, BT> {
    Box::new(CubeFuser::<R, CubeBackend<R, F, I, BT>>::new(fusers(
        device,
        kinds_from_env(),
    )))
}

/// The fuser of `StreamFusion<CubeBackend<R, F, I, BT>>` streams with the fusers `names` lists
/// (the syntax of [`FUSERS_ENV`]), whatever the environment says; for
/// [`super::register_fuser`]. An unknown name is an [`Error::InvalidConfig`].
///
/// ```no_run
/// use burn_cubecl::CubeBackend;
/// use cubecl::cuda::CudaRuntime;
/// use fusion_streams::backend::{cube_fuser_with, register_fuser};
///
/// type Cuda = CubeBackend<CudaRuntime, f32, i32, u8>;
/// // Every fuser, reductions included, for the engines opened from here on.
/// register_fuser::<Cuda>(|device| cube_fuser_with(device, "all").expect("known names"));
/// ```
pub fn cube_fuser_with<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    device: &R::Device,
    names: &str,
) -> Result<CubeStreamFuser<R, F, I, BT>> {
    let kinds = parse_kinds(names).map_err(Error::InvalidConfig)?;
    Ok(Box::new(CubeFuser::<R, CubeBackend<R, F, I, BT>>::new(
        fusers(device, kinds),
    )))
}

/// burn-cubecl-fusion's fusers of `kinds`, as built, in [`FuserKind`] order.
fn fusers<R: CubeRuntime>(device: &R::Device, kinds: Kinds) -> [Option<DynFuser<R>>; 4] {
    FuserKind::ALL.map(|kind| {
        (kinds & kind.bit() != 0).then(|| -> DynFuser<R> {
            match kind {
                FuserKind::Elementwise => Box::new(ElementWiseFuser::new(device.clone())),
                FuserKind::Matmul => Box::new(MatmulFuser::new(device.clone())),
                FuserKind::Reduce => {
                    Box::new(ReduceFuser::new(device.clone(), ReduceSettings::Always))
                }
                FuserKind::ReduceBroadcasted => {
                    Box::new(ReduceBroadcastedFuser::new(device.clone()))
                }
            }
        })
    })
}

type DynFuser<R> = Box<dyn OperationFuser<CubeOptimization<R>>>;

/// The most runs (distinct relative prefixes) a stream remembers before it starts over.
const MAX_NODES: usize = 4096;

/// A relative operation as a key. The relative form holds no floating-point value (scalars
/// are ids into the context's table), so equality is an equivalence.
#[derive(Clone, PartialEq, Hash)]
struct Key(OperationIr);

impl Eq for Key {}

/// One relative prefix the fusers have seen: which fusers took every operation of it, which of
/// those can build a kernel for exactly it, what follows it, and the kernels built for it.
struct Node<R: CubeRuntime> {
    alive: Kinds,
    ready: Kinds,
    next: HashMap<Key, usize>,
    optimizations: SmallVec<[(FuserKind, CubeOptimization<R>); 1]>,
}

impl<R: CubeRuntime> Node<R> {
    fn new(alive: Kinds) -> Self {
        Self {
            alive,
            ready: 0,
            next: HashMap::new(),
            optimizations: SmallVec::new(),
        }
    }
}

/// The fuser of one stream (see the module docs).
struct CubeFuser<R: CubeRuntime, B> {
    /// Each enabled fuser as built: a run starts from a clone of it.
    pristine: [Option<DynFuser<R>>; 4],
    /// Each enabled fuser at work, with how many of the run's accepted operations it has been
    /// fed (`None`: it must start over from a clone).
    working: [(Option<DynFuser<R>>, Option<usize>); 4],
    /// Whether a reduction may join a run (a reduce fuser is enabled).
    reductions: bool,
    backend: PhantomData<fn() -> B>,
    /// The accepted operations in relative form, to feed fusers that lag behind.
    offered_relative: Vec<OperationIr>,
    /// The accepted operations a kernel may run unfused (matmuls and reductions, global ids),
    /// with their position in the run: its fallbacks.
    fallbacks: SmallVec<[(usize, OperationIr); 2]>,
    /// The conversion of exactly the accepted operations: the context of the run's kernel.
    relative: Relative,
    /// The trie of runs seen, `runs[0]` the empty prefix.
    runs: Vec<Node<R>>,
    /// The node of each accepted prefix, `path[0] == 0`.
    path: Vec<usize>,
}

impl<R: CubeRuntime, B> CubeFuser<R, B> {
    fn new(pristine: [Option<DynFuser<R>>; 4]) -> Self {
        let enabled = FuserKind::ALL
            .iter()
            .filter(|kind| pristine[**kind as usize].is_some())
            .map(|kind| kind.bit())
            .sum();
        let reductions = pristine[FuserKind::Reduce as usize].is_some()
            || pristine[FuserKind::ReduceBroadcasted as usize].is_some();
        Self {
            pristine,
            working: Default::default(),
            reductions,
            backend: PhantomData,
            offered_relative: Vec::new(),
            fallbacks: SmallVec::new(),
            relative: Relative::default(),
            runs: vec![Node::new(enabled)],
            path: vec![0],
        }
    }

    /// Fuser `kind`, fed exactly the first `depth` accepted operations of the run: fed forward
    /// if it lags, or a fresh clone fed from the start.
    fn fed(
        &mut self,
        kind: FuserKind,
        depth: usize,
    ) -> &mut dyn OperationFuser<CubeOptimization<R>> {
        let (working, fed) = &mut self.working[kind as usize];
        let from = match (*fed, working.as_ref()) {
            (Some(fed), Some(_)) if fed <= depth => fed,
            _ => {
                let pristine = self.pristine[kind as usize].as_ref();
                *working = Some(pristine.expect("an enabled fuser").clone_dyn());
                0
            }
        };
        let fuser = working.as_deref_mut().expect("set above");
        for op in &self.offered_relative[from..depth] {
            fuser.fuse(op);
        }
        *fed = Some(depth);
        fuser
    }

    /// The run's kernel: the longest accepted prefix some fuser can build a kernel for, and
    /// the first such fuser in [`FuserKind`] order.
    fn chosen(&self) -> Option<(usize, FuserKind)> {
        let depth = self
            .path
            .iter()
            .rposition(|node| self.runs[*node].ready != 0)?;
        let ready = self.runs[self.path[depth]].ready;
        FuserKind::ALL
            .into_iter()
            .find(|kind| ready & kind.bit() != 0)
            .map(|kind| (depth, kind))
    }

    /// Offer `op` (relative) to every fuser that took the whole prefix of `depth` operations
    /// ending at node `at`: the node of the longer prefix.
    fn decide(&mut self, at: usize, depth: usize, op: &OperationIr) -> Node<R> {
        let mut node = Node::new(0);
        for kind in FuserKind::ALL {
            if self.runs[at].alive & kind.bit() == 0 {
                continue;
            }
            if kind == FuserKind::Matmul && !one_input_width(&self.offered_relative[..depth], op) {
                // Never offered: the run ends here for the matmul fuser (see `one_input_width`).
                continue;
            }
            let fuser = self.fed(kind, depth);
            if matches!(fuser.status(), FuserStatus::Closed) {
                continue;
            }
            let before = fuser.len();
            fuser.fuse(op);
            let open = !matches!(fuser.status(), FuserStatus::Closed);
            // The matmul fuser counts its matmul before it takes it; it takes it unless it
            // closes.
            let took = fuser.len() > before || (depth == 0 && kind == FuserKind::Matmul && open);
            let ready = took
                && match kind {
                    // Ready with one operation (the engine fuses two or more).
                    FuserKind::Elementwise | FuserKind::Matmul => true,
                    FuserKind::Reduce | FuserKind::ReduceBroadcasted => fuser.properties().ready,
                };
            self.working[kind as usize].1 = took.then_some(depth + 1);
            if took {
                node.alive |= kind.bit();
            }
            if ready {
                node.ready |= kind.bit();
            }
        }
        node
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
        let at = *self.path.last().expect("the empty prefix");
        if self.runs[at].alive == 0 || !fusable(op, self.reductions) {
            return false;
        }
        let op = allocated_here_or_read_only(op, handles);
        // From here on, a refusal takes the operation's conversion back: the context must hold
        // exactly the accepted operations (a refused consuming use would otherwise change the
        // status of a tensor the kernel reads).
        let key = Key(self.relative.op(&op));
        let depth = self.offered_relative.len();
        let next = match self.runs[at].next.get(&key) {
            Some(next) => *next,
            None => {
                // A new prefix: ask the fusers, and remember their answer.
                let node = self.decide(at, depth, &key.0);
                self.runs.push(node);
                let next = self.runs.len() - 1;
                self.runs[at].next.insert(key.clone(), next);
                next
            }
        };
        if self.runs[next].alive == 0 {
            self.relative.roll_back();
            return false;
        }
        if has_fallback(&op) {
            self.fallbacks.push((depth, op.into_owned()));
        }
        self.path.push(next);
        self.offered_relative.push(key.0);
        true
    }

    fn covered(&self) -> usize {
        self.chosen().map_or(0, |(depth, _)| depth)
    }

    fn execute(
        &mut self,
        handles: &mut HandleContainer<CubeFusionHandle<R>>,
        _: &super::BackendContext<CubeBackend<R, F, I, BT>>,
    ) -> Result<usize> {
        let Some((depth, kind)) = self.chosen() else {
            return Err(Error::Runtime("no fused run to execute".into()));
        };
        let at = self.path[depth];
        if !self.runs[at].optimizations.iter().any(|(k, _)| *k == kind) {
            let built = self.fed(kind, depth).finish();
            // `finish` may leave the fuser in any state.
            self.working[kind as usize].1 = None;
            self.runs[at].optimizations.push((kind, built));
        }
        self.relative.roll_back_to(depth);
        let optimization = self.runs[at]
            .optimizations
            .iter_mut()
            .find_map(|(k, optimization)| (*k == kind).then_some(optimization))
            .expect("built above");
        run::<R, CubeBackend<R, F, I, BT>>(
            optimization,
            &self.fallbacks,
            &mut self.relative,
            handles,
        )?;
        Ok(1)
    }

    fn reset(&mut self) {
        // A fuser fed this run's operations starts the next one from a clone (`fed`), never
        // from `OperationFuser::reset` (see the module docs).
        for (_, fed) in &mut self.working {
            if *fed != Some(0) {
                *fed = None;
            }
        }
        self.offered_relative.clear();
        self.fallbacks.clear();
        self.relative.clear();
        self.path.truncate(1);
        if self.runs.len() >= MAX_NODES {
            // Start over rather than grow without bound.
            self.runs.truncate(1);
            self.runs[0].next.clear();
        }
    }
}

/// Run the fused kernel over the stream's handles and the run's relative maps, which the context
/// owns for the call and always gives back (a panic included: it becomes the run's error). The
/// maps come back to be cleared and reused by the next run, not reallocated.
fn run<R: CubeRuntime, B: BackendIr<Handle = CubeFusionHandle<R>> + 'static>(
    optimization: &mut CubeOptimization<R>,
    fallbacks: &[(usize, OperationIr)],
    relative: &mut Relative,
    handles: &mut HandleContainer<CubeFusionHandle<R>>,
) -> Result<()> {
    let mut context = Context {
        tensors: std::mem::take(&mut relative.relative2global),
        handles: std::mem::take(handles),
        scalars: std::mem::take(&mut relative.scalars),
        shapes_relative2global: std::mem::take(&mut relative.shapes_relative2global),
    };
    // The operation at `index` in the run, run unfused by the backend.
    let fallback = |index: usize| -> Box<dyn FallbackOperation<R>> {
        let op = fallbacks.iter().find(|(i, _)| *i == index);
        Box::new(Fallback::<B> {
            op: op.map(|(_, op)| op.clone()),
            backend: PhantomData,
        })
    };
    let outcome = catch_unwind(AssertUnwindSafe(|| match optimization {
        CubeOptimization::ElementWise(elementwise) => elementwise.execute(&mut context),
        CubeOptimization::Matmul(matmul) => matmul.execute(&mut context, fallback),
        CubeOptimization::Reduce(reduce) => reduce.execute(&mut context, fallback),
        CubeOptimization::ReduceBroadcasted(reduce) => reduce.execute(&mut context, fallback),
    }));
    *handles = context.handles;
    relative.relative2global = context.tensors;
    relative.scalars = context.scalars;
    relative.shapes_relative2global = context.shapes_relative2global;
    outcome.map_err(|payload| Error::from_kernel_panic("fused kernel", payload))
}

/// A run's matmul or reduction, run by the backend on the run's handles (global ids): what
/// burn's matmul and reduce optimizations run when their fused kernel does not apply, or while
/// autotuning. The same backend calls as the unfused operation's (`src/backend/float.rs`,
/// `int.rs`).
struct Fallback<B> {
    op: Option<OperationIr>,
    backend: PhantomData<fn() -> B>,
}

impl<R: CubeRuntime, B: BackendIr<Handle = CubeFusionHandle<R>> + 'static> FallbackOperation<R>
    for Fallback<B>
{
    fn run(&self, context: &mut Context<CubeFusionHandle<R>>) {
        use NumericOperationIr as N;
        let h = &mut context.handles;
        let float = reduce_float::<R, B>;
        let int = reduce_int::<R, B>;
        match &self.op {
            Some(OperationIr::Float(_, FloatOperationIr::Matmul(ir))) => {
                let out = B::float_matmul(h.take_float::<B>(&ir.lhs), h.take_float::<B>(&ir.rhs));
                h.register_float_tensor::<B>(&ir.out.id, out);
            }
            Some(OperationIr::NumericFloat(_, op)) => match op {
                N::SumDim(ir) => float(h, ir, B::float_sum_dim),
                N::MeanDim(ir) => float(h, ir, B::float_mean_dim),
                N::ProdDim(ir) => float(h, ir, B::float_prod_dim),
                N::MaxDim(ir) => float(h, ir, B::float_max_dim),
                N::MinDim(ir) => float(h, ir, B::float_min_dim),
                N::MaxAbsDim(ir) => float(h, ir, B::float_max_abs_dim),
                N::ArgMax(ir) | N::ArgMin(ir) => {
                    let x = h.take_float::<B>(&ir.input);
                    let out = match op {
                        N::ArgMax(_) => B::float_argmax(x, ir.axis, ir.out.dtype.into()),
                        _ => B::float_argmin(x, ir.axis, ir.out.dtype.into()),
                    };
                    h.register_int_tensor::<B>(&ir.out.id, out);
                }
                op => panic!("no unfused fallback for {op:?}"),
            },
            Some(OperationIr::NumericInt(_, op)) => match op {
                N::SumDim(ir) => int(h, ir, B::int_sum_dim),
                N::MeanDim(ir) => int(h, ir, B::int_mean_dim),
                N::ProdDim(ir) => int(h, ir, B::int_prod_dim),
                N::MaxDim(ir) => int(h, ir, B::int_max_dim),
                N::MinDim(ir) => int(h, ir, B::int_min_dim),
                N::MaxAbsDim(ir) => int(h, ir, B::int_max_abs_dim),
                N::ArgMax(ir) => int(h, ir, B::int_argmax),
                N::ArgMin(ir) => int(h, ir, B::int_argmin),
                op => panic!("no unfused fallback for {op:?}"),
            },
            op => panic!("no unfused fallback for {op:?}"),
        }
    }
}

/// `f(input, axis)` of a float reduction, registered as its output.
fn reduce_float<R: CubeRuntime, B: BackendIr<Handle = CubeFusionHandle<R>>>(
    handles: &mut HandleContainer<CubeFusionHandle<R>>,
    ir: &ReduceDimOpIr,
    f: fn(FloatTensor<B>, usize) -> FloatTensor<B>,
) {
    let out = f(handles.take_float::<B>(&ir.input), ir.axis);
    handles.register_float_tensor::<B>(&ir.out.id, out);
}

/// `f(input, axis)` of an int reduction, registered as its output.
fn reduce_int<R: CubeRuntime, B: BackendIr<Handle = CubeFusionHandle<R>>>(
    handles: &mut HandleContainer<CubeFusionHandle<R>>,
    ir: &ReduceDimOpIr,
    f: fn(IntTensor<B>, usize) -> IntTensor<B>,
) {
    let out = f(handles.take_int::<B>(&ir.input), ir.axis);
    handles.register_int_tensor::<B>(&ir.out.id, out);
}

/// Whether a fused kernel may run `op` unfused (see [`Fallback`]).
fn has_fallback(op: &OperationIr) -> bool {
    matmul(op).is_some() || reduction(op).is_some()
}

/// `op`'s IR if it is a matmul of (unquantized) float tensors.
fn matmul(op: &OperationIr) -> Option<&MatmulOpIr> {
    match op {
        OperationIr::Float(_, FloatOperationIr::Matmul(ir)) if unquantized(ir) => Some(ir),
        _ => None,
    }
}

/// `op`'s IR if it is a reduction along one axis (what the reduce fusers fuse).
fn reduction(op: &OperationIr) -> Option<&ReduceDimOpIr> {
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
/// cache after the bias-broadcast tests (measured on the H200; the log is in `docs/fusion/`).
/// Keeping reads of another width out of matmul runs gives every run under one key one width;
/// the masking then runs as its own elementwise kernel. A bool made inside the run (`relu`'s
/// mask) is not read from memory and stays fused. A run's bool *output* of another width is not
/// caught by this rule; none was seen to collide.
///
/// Relative ids are the same for every run of one relative prefix, so the answer is too (the
/// trie may keep it).
fn one_input_width(prefix: &[OperationIr], op: &OperationIr) -> bool {
    let mut made_here: SmallVec<[TensorId; 16]> = SmallVec::new();
    let mut width = None;
    for op in prefix.iter().chain([op]) {
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
    /// What each conversion replaced, to take it back.
    undo: Vec<Undo>,
    /// Where each converted operation's entries start in `undo`.
    marks: Vec<usize>,
}

/// One change of a conversion, with what it replaced. Small (24 bytes): a run's undo log grows
/// by one per tensor of each operation offered.
enum Undo {
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
    fn clear(&mut self) {
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

    fn tensor(&mut self, ir: &TensorIr) -> TensorIr {
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

    fn scalar(&mut self, scalar: &ScalarIr) -> ScalarIr {
        let id = ScalarId {
            value: self.scalars.len() as u64,
        };
        self.scalars.insert(id, *scalar);
        self.undo.push(Undo::Scalar(id));
        ScalarIr::UInt(id.value)
    }

    /// Take back the conversions of the operations after the first `len`.
    fn roll_back_to(&mut self, len: usize) {
        while self.marks.len() > len {
            self.roll_back();
        }
    }

    /// Take back the conversion of the last operation converted.
    fn roll_back(&mut self) {
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

    fn reduce_dim(&mut self, ir: &ReduceDimOpIr) -> ReduceDimOpIr {
        ReduceDimOpIr {
            input: self.tensor(&ir.input),
            out: self.tensor(&ir.out),
            axis: ir.axis,
            accumulator_len: ir.accumulator_len,
        }
    }

    /// The relative form of `op`, which must be [`fusable`].
    fn op(&mut self, op: &OperationIr) -> OperationIr {
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

/// Whether the conversion above covers `op`: a subset of what burn-cubecl-fusion 0.21's
/// elementwise fuser accepts (boolean scalars have no relative form in burn-fusion either), its
/// matmuls, and, with `reductions`, the reductions its reduce fusers accept.
fn fusable(op: &OperationIr, reductions: bool) -> bool {
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

#[cfg(test)]
mod tests {
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
        assert_eq!(offer_all(&mut fuser, &[add(0, 1, 2), add(2, 1, 3)]), 2);
        assert_eq!(fuser.chosen(), Some((2, FuserKind::Elementwise)));
    }

    #[test]
    fn a_tie_goes_to_the_first_fuser_in_order() {
        let both = Stand::new(elementwise, elementwise);
        let mut fuser = fuser([Some(both.clone()), None, Some(both), None]);
        assert_eq!(offer_all(&mut fuser, &[add(0, 1, 2), add(2, 1, 3)]), 2);
        assert_eq!(fuser.chosen(), Some((2, FuserKind::Elementwise)));
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
        assert_eq!(long.relative2global, short.relative2global);
        assert_eq!(long.global2relative, short.global2relative);
        assert_eq!(long.shapes_relative2global, short.shapes_relative2global);
        assert_eq!(long.shapes_global2relative, short.shapes_global2relative);
        assert_eq!(long.marks.len(), 1);
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
        assert_eq!(reused.relative2global, fresh.relative2global);
        assert_eq!(reused.global2relative, fresh.global2relative);
        assert_eq!(reused.shapes_relative2global, fresh.shapes_relative2global);
        assert_eq!(reused.shapes_global2relative, fresh.shapes_global2relative);
        assert_eq!(reused.undo.len(), fresh.undo.len());
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
}
