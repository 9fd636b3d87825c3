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
//! **Softmax.** burn's `softmax` and `log_softmax` are backend operations; on a fusing stream of
//! these backends each is recorded as one operation running this crate's kernel ([`softmax`]),
//! not as burn's five or six (two reductions and two broadcasts, which no default fuser takes
//! and burn-cubecl-fusion's broadcasted reduce fuser launches as three kernels). See `StreamFusion`'s `ActivationOps` and
//! [`register_softmax`](crate::backend::register_softmax).
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
//! conversion and a lookup per operation and no fuser work. Both are on the recording path of
//! every fusable operation, whether or not a kernel results, so both are kept cheap (measured
//! with callgrind on the H200, `docs/BENCHMARKS.md`): the conversion keeps what it converted in
//! lists, found by a scan while a run is short, and rolls back by truncating them; burn-fusion's
//! maps are filled from the lists only when a run executes fused, and lent to its context; a
//! trie node holds its own relative operation and compares a handful of longer prefixes
//! directly, hashing only where there are many.
//!
//! **Cut runs.** A run the fusers close (or that reaches the engine's length bound) is always
//! fused. A run its own thread's drain cuts while it is still open (a read, a sync) is fused
//! only once the same run has been cut [`CUT_SIGHTINGS_ENV`] times (twice by default) in the
//! process; before that its operations run unfused ([`Fuser::fuse_cut_run`]). A run another
//! thread's drain cuts (a share or a read of one of its tensors), or the engine's service
//! thread (a thread's exit, a deferred free's deadline), runs unfused unless the stream has
//! built its kernel already ([`FOREIGN_CUT_SIGHTINGS_ENV`]). A kernel is compiled per distinct
//! run, and another thread's cut point depends on its timing: fusing every cut run compiled a
//! kernel for nearly every result a consumer thread took from a producer, and counting the
//! producer's exit cuts as its own compiled one whenever a length came up twice.
//!
//! **Short runs.** The elementwise fuser's kernel replaces a run only from
//! [`MIN_ELEMENTWISE_OPS_ENV`] operations on (three by default): its launch costs more host work
//! than two plain launches save, so a run of two runs operation by operation. Runs the matmul
//! and reduce fusers cover fuse from two operations, as before (a matmul's epilogue saves a pass
//! over its output).
//!
//! **Reduce runs launched wrongly upstream.** burn-cubecl-fusion 0.21's reduce launchers look
//! the first block's reference strides up among the kernel's inputs even when the reference is
//! one of its outputs, which it is whenever the operations before the reduction write a tensor
//! (one read again after the reduction, or kept past the run): an out-of-bounds panic in an
//! autotune candidate, or another input's strides. The reduce fusers are ready only on runs
//! where that lookup lands on the right strides (`policy::first_block`): the first block
//! writes nothing, or it writes the run's first tensor and the run's first operand has that
//! tensor's shape and is contiguous (a scaled softmax of a contiguous input).
//!
//! **In place.** burn-cubecl-fusion and burn-cubecl write a `ReadWrite` input in place when its
//! handle has no other owner (`can_mut`), which already keeps views safe. The engine's CUDA rule
//! adds that a buffer is written in place only on the stream that allocated it (see
//! `cross_stream`): the engine orders another stream's use of a buffer after everything its
//! allocating stream dispatched, so every write must happen there. A consumed input allocated on
//! another stream is offered to the fusers as `ReadOnly`, so the fused kernel gives it a fresh
//! output instead (the engine still releases it after the run, in order); an operation that runs
//! unfused gets the same rule from the engine ([`StreamRuntime::foreign_to`](crate::runtime::StreamRuntime::foreign_to)).

mod choice;
mod kernel;
mod planner;
mod policy;
mod relative;
mod softmax;
#[cfg(test)]
mod tests;

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
use crate::runtime::{Cut, Fuser};
use crate::{Error, Result};

use choice::*;
pub use choice::{
    CUT_SIGHTINGS_ENV, CubeStreamFuser, FOREIGN_CUT_SIGHTINGS_ENV, FUSERS_ENV,
    MIN_ELEMENTWISE_OPS_ENV, cube_fuser, cube_fuser_with,
};
use kernel::*;
use planner::*;
use policy::*;
use relative::*;
pub use softmax::softmax;
