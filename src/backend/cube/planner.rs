//! The fuser of one stream: the fusers side by side, the trie of runs seen (their decisions and
//! kernels, by relative prefix), and the [`Fuser`] contract the engine drives.

use std::hash::{Hash, Hasher};
use std::sync::{Mutex, PoisonError};

use super::*;

pub(super) type DynFuser<R> = Box<dyn OperationFuser<CubeOptimization<R>>>;

/// The most runs (distinct relative prefixes) a stream remembers before it starts over.
pub(super) const MAX_NODES: usize = 4096;

/// How many times each run cut by a drain has been met in this process (see
/// [`CUT_SIGHTINGS_ENV`]), by a hash of its relative operations and the fuser that would build
/// its kernel. Shared by every stream, as cubecl's cache of compiled kernels is: a thread's first
/// cut of a run another thread compiled fuses at once. Only cuts touch it, never an offer.
static CUT_RUNS: Mutex<Option<HashMap<u64, u32>>> = Mutex::new(None);

/// The most runs [`CUT_RUNS`] counts before it starts over.
const MAX_CUT_RUNS: usize = 1 << 16;

/// Up to how many longer prefixes of a node [`CubeFuser::known`] compares one by one; past
/// that, it looks them up by a hash of their last operation.
const SCANNED_NEXT: usize = 8;

/// One relative prefix the fusers have seen: its last operation, which fusers took every
/// operation of it, which of those can build a kernel for exactly it, what follows it, and the
/// kernels built for it.
pub(super) struct Node<R: CubeRuntime> {
    /// The relative operation that extends the parent's prefix to this one (none at the root).
    /// The relative form holds no floating-point value (scalars are ids into the context's
    /// table), so equality of operations is an equivalence.
    pub(super) op: Option<OperationIr>,
    /// How many of the prefix's entries are operations (the others are drops).
    pub(super) ops: usize,
    pub(super) alive: Kinds,
    pub(super) ready: Kinds,
    /// The longer prefixes seen, as node indices.
    pub(super) next: Vec<usize>,
    /// `next` by [`op_hash`] of their last operation, kept once there are more than
    /// [`SCANNED_NEXT`] of them.
    pub(super) next_by_hash: HashMap<u64, SmallVec<[usize; 1]>>,
    pub(super) optimizations: SmallVec<[(FuserKind, CubeOptimization<R>); 1]>,
    /// Whether the reduce fusers' readiness holds only for a run whose first operand is
    /// contiguous ([`FirstBlock::WritesFirstMade`]).
    pub(super) reduce_needs_contiguous: bool,
}

impl<R: CubeRuntime> Node<R> {
    pub(super) fn new(alive: Kinds) -> Self {
        Self {
            op: None,
            ops: 0,
            alive,
            ready: 0,
            next: Vec::new(),
            next_by_hash: HashMap::new(),
            optimizations: SmallVec::new(),
            reduce_needs_contiguous: false,
        }
    }
}

/// A hash of a relative operation, the same in every process (a trie node with many longer
/// prefixes finds the next one by it).
pub(super) fn op_hash(op: &OperationIr) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    op.hash(&mut hasher);
    hasher.finish()
}

/// The fuser of one stream (see the module docs).
pub(super) struct CubeFuser<R: CubeRuntime, B> {
    /// Each enabled fuser as built: a run starts from a clone of it.
    pub(super) pristine: [Option<DynFuser<R>>; 4],
    /// Each enabled fuser at work, with how many of the run's accepted operations it has been
    /// fed (`None`: it must start over from a clone).
    pub(super) working: [(Option<DynFuser<R>>, Option<usize>); 4],
    /// Whether a reduction may join a run (a reduce fuser is enabled).
    pub(super) reductions: bool,
    pub(super) backend: PhantomData<fn() -> B>,
    /// The accepted operations a kernel may run unfused (matmuls and reductions, global ids),
    /// with their position in the run: its fallbacks.
    pub(super) fallbacks: SmallVec<[(usize, OperationIr); 2]>,
    /// The conversion of exactly the accepted operations: the context of the run's kernel.
    pub(super) relative: Relative,
    /// The trie of runs seen, `runs[0]` the empty prefix.
    pub(super) runs: Vec<Node<R>>,
    /// The node of each accepted prefix, `path[0] == 0`: the accepted operations in relative
    /// form are the nodes' operations ([`CubeFuser::prefix`]).
    pub(super) path: Vec<usize>,
    /// [`CUT_SIGHTINGS_ENV`], read when the stream was created.
    pub(super) cut_sightings: u32,
    /// [`FOREIGN_CUT_SIGHTINGS_ENV`], read when the stream was created.
    pub(super) foreign_cut_sightings: u32,
    /// [`MIN_ELEMENTWISE_OPS_ENV`], read when the stream was created.
    pub(super) min_elementwise_ops: u32,
    /// Whether the run's first operand (its first operation's first input) is laid out
    /// contiguously (see [`FirstBlock::WritesFirstMade`]).
    pub(super) first_operand_contiguous: bool,
}

impl<R: CubeRuntime, B> CubeFuser<R, B> {
    pub(super) fn new(pristine: [Option<DynFuser<R>>; 4]) -> Self {
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
            fallbacks: SmallVec::new(),
            relative: Relative::default(),
            runs: vec![Node::new(enabled)],
            path: vec![0],
            cut_sightings: sightings_from_env(CUT_SIGHTINGS_ENV, DEFAULT_CUT_SIGHTINGS),
            foreign_cut_sightings: sightings_from_env(
                FOREIGN_CUT_SIGHTINGS_ENV,
                DEFAULT_FOREIGN_CUT_SIGHTINGS,
            ),
            min_elementwise_ops: sightings_from_env(
                MIN_ELEMENTWISE_OPS_ENV,
                DEFAULT_MIN_ELEMENTWISE_OPS,
            ),
            first_operand_contiguous: false,
        }
    }

    /// Whether the run chosen now, cut by `cut`'s drain, has been met often enough to be fused
    /// (see [`CUT_SIGHTINGS_ENV`] and [`FOREIGN_CUT_SIGHTINGS_ENV`]); counts this sighting. A run
    /// whose kernel this stream has built already is fused without counting.
    pub(super) fn cut_run_met_enough(&mut self, cut: Cut) -> bool {
        let Some((depth, kind)) = self.chosen() else {
            return true;
        };
        let built = self.runs[self.path[depth]]
            .optimizations
            .iter()
            .any(|(k, _)| *k == kind);
        let needed = match cut {
            Cut::Own => self.cut_sightings,
            Cut::Foreign => self.foreign_cut_sightings,
        };
        if built || needed == 1 {
            return true;
        }
        if needed == 0 {
            return false;
        }
        let mut hasher = std::hash::DefaultHasher::new();
        (kind as u8, depth).hash(&mut hasher);
        for op in self.prefix(depth) {
            op.hash(&mut hasher);
        }
        let key = hasher.finish();
        let mut runs = CUT_RUNS.lock().unwrap_or_else(PoisonError::into_inner);
        let runs = runs.get_or_insert_with(HashMap::new);
        if runs.len() >= MAX_CUT_RUNS {
            runs.clear();
        }
        let met = runs.entry(key).or_insert(0);
        *met = met.saturating_add(1);
        *met >= needed
    }

    /// Fuser `kind`, fed exactly the first `depth` accepted operations of the run: fed forward
    /// if it lags, or a fresh clone fed from the start.
    pub(super) fn fed(
        &mut self,
        kind: FuserKind,
        depth: usize,
    ) -> &mut dyn OperationFuser<CubeOptimization<R>> {
        let (working, fed) = &mut self.working[kind as usize];
        let (runs, path) = (&self.runs, &self.path);
        let from = match (*fed, working.as_ref()) {
            (Some(fed), Some(_)) if fed <= depth => fed,
            _ => {
                let pristine = self.pristine[kind as usize].as_ref();
                *working = Some(pristine.expect("an enabled fuser").clone_dyn());
                0
            }
        };
        let fuser = working.as_deref_mut().expect("set above");
        for node in &path[from + 1..=depth] {
            fuser.fuse(runs[*node].op.as_ref().expect("a node below the root"));
        }
        *fed = Some(depth);
        fuser
    }

    /// The run's kernel: the longest accepted prefix some fuser can build a kernel for, and
    /// the first such fuser in [`FuserKind`] order; none when that is an elementwise kernel over
    /// fewer operations than [`MIN_ELEMENTWISE_OPS_ENV`] asks for.
    pub(super) fn chosen(&self) -> Option<(usize, FuserKind)> {
        let ready = |node: usize| {
            let node = &self.runs[node];
            if node.reduce_needs_contiguous && !self.first_operand_contiguous {
                node.ready & !(FuserKind::Reduce.bit() | FuserKind::ReduceBroadcasted.bit())
            } else {
                node.ready
            }
        };
        let depth = self.path.iter().rposition(|node| ready(*node) != 0)?;
        let ready = ready(self.path[depth]);
        let kind = FuserKind::ALL
            .into_iter()
            .find(|kind| ready & kind.bit() != 0)?;
        if kind == FuserKind::Elementwise
            && self.runs[self.path[depth]].ops < self.min_elementwise_ops as usize
        {
            return None;
        }
        Some((depth, kind))
    }

    /// The first `depth` accepted operations, in relative form.
    pub(super) fn prefix(&self, depth: usize) -> impl Iterator<Item = &OperationIr> + Clone {
        self.path[1..=depth]
            .iter()
            .map(|node| self.runs[*node].op.as_ref().expect("a node below the root"))
    }

    /// The node that extends node `at`'s prefix by `op` (relative), if it has been seen.
    #[inline]
    pub(super) fn known(&self, at: usize, op: &OperationIr) -> Option<usize> {
        let node = &self.runs[at];
        let same = |next: &usize| self.runs[*next].op.as_ref() == Some(op);
        if node.next.len() <= SCANNED_NEXT {
            node.next.iter().copied().find(same)
        } else {
            node.next_by_hash
                .get(&op_hash(op))?
                .iter()
                .copied()
                .find(same)
        }
    }

    /// Add `node` to the trie as a longer prefix of node `at`'s; its index.
    pub(super) fn add(&mut self, at: usize, node: Node<R>) -> usize {
        let index = self.runs.len();
        self.runs.push(node);
        self.runs[at].next.push(index);
        let count = self.runs[at].next.len();
        if count > SCANNED_NEXT {
            // Past the scan limit every longer prefix is found by hash: all of them the first
            // time, the new one after that.
            let from = if count == SCANNED_NEXT + 1 {
                0
            } else {
                count - 1
            };
            for position in from..count {
                let next = self.runs[at].next[position];
                let op = self.runs[next].op.as_ref().expect("a node below the root");
                let hash = op_hash(op);
                self.runs[at]
                    .next_by_hash
                    .entry(hash)
                    .or_default()
                    .push(next);
            }
        }
        index
    }

    /// Offer `op` (relative) to every fuser that took the whole prefix of `depth` operations
    /// ending at node `at`: the node of the longer prefix.
    pub(super) fn decide(&mut self, at: usize, depth: usize, op: &OperationIr) -> Node<R> {
        let mut node = Node::new(0);
        node.ops = self.runs[at].ops + usize::from(!matches!(op, OperationIr::Drop(_)));
        // Asked at most once per new prefix.
        let mut first = None;
        for kind in FuserKind::ALL {
            if self.runs[at].alive & kind.bit() == 0 {
                continue;
            }
            if kind == FuserKind::Matmul && !one_input_width(self.prefix(depth), op) {
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
                    FuserKind::Reduce | FuserKind::ReduceBroadcasted => {
                        fuser.properties().ready && {
                            let first = *first
                                .get_or_insert_with(|| first_block(self.prefix(depth).chain([op])));
                            node.reduce_needs_contiguous = first == FirstBlock::WritesFirstMade;
                            first != FirstBlock::Writes
                        }
                    }
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
        // Only the reduce fusers ask (see `FirstBlock::WritesFirstMade`).
        if self.reductions && self.path.len() == 1 {
            self.first_operand_contiguous = op.inputs().next().is_some_and(|operand| {
                handles
                    .get_handle_ref(&operand.id)
                    .is_some_and(|handle| contiguous(&operand.shape, &handle.strides))
            });
        }
        // From here on, a refusal takes the operation's conversion back: the context must hold
        // exactly the accepted operations (a refused consuming use would otherwise change the
        // status of a tensor the kernel reads).
        let mut relative = self.relative.op(op);
        let mut op = Cow::Borrowed(op);
        // The conversion lists the tensors the operation consumes; if another stream allocated
        // one of them, it is offered read-only instead (see the module docs). Rare: converted
        // again.
        let consumed = self.relative.consumed.iter();
        if consumed
            .filter_map(|id| handles.get_handle_ref(id))
            .any(allocated_elsewhere)
        {
            self.relative.roll_back();
            op = Cow::Owned(allocated_here_or_read_only(&op, handles).into_owned());
            relative = self.relative.op(&op);
        }
        let depth = self.path.len() - 1;
        let next = match self.known(at, &relative) {
            Some(next) => next,
            None => {
                // A new prefix: ask the fusers, and remember their answer.
                let mut node = self.decide(at, depth, &relative);
                node.op = Some(relative);
                self.add(at, node)
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
        true
    }

    fn covered(&self) -> usize {
        self.chosen().map_or(0, |(depth, _)| depth)
    }

    fn execute(
        &mut self,
        handles: &mut HandleContainer<CubeFusionHandle<R>>,
        _: &crate::backend::BackendContext<CubeBackend<R, F, I, BT>>,
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

    fn fuse_cut_run(&mut self, cut: Cut) -> bool {
        self.cut_run_met_enough(cut)
    }

    fn reset(&mut self) {
        // A fuser fed this run's operations starts the next one from a clone (`fed`), never
        // from `OperationFuser::reset` (see the module docs).
        for (_, fed) in &mut self.working {
            if *fed != Some(0) {
                *fed = None;
            }
        }
        self.fallbacks.clear();
        self.relative.clear();
        self.path.truncate(1);
        if self.runs.len() >= MAX_NODES {
            // Start over rather than grow without bound.
            self.runs.truncate(1);
            self.runs[0].next.clear();
            self.runs[0].next_by_hash.clear();
        }
    }
}
