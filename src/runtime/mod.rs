//! Runtimes: what the engine needs from a device, on top of burn's [`FusionRuntime`].
//!
//! burn-fusion 0.21's [`FusionRuntime`] names the handle and device types but has no way to
//! allocate, read, alias or synchronise; its operations are infallible. [`StreamRuntime`] adds
//! exactly those capabilities, so the engine stays generic: the embedded [`host::HostRuntime`]
//! (an asynchronous CPU device, the default) and the CUDA runtime behind the `cuda` feature
//! implement it.

use burn_backend::{DType, Shape, StreamId, TensorData};
use burn_fusion::FusionRuntime;
use burn_ir::TensorIr;

use crate::Result;

mod fuser;
pub(crate) mod host;
mod pinned;
mod retirement;
mod transfer_runtime;

pub use fuser::{Cut, Fuser};
pub use pinned::PinnedHostBuffer;
#[cfg(feature = "cuda")]
pub(crate) use pinned::PinnedMemory;
pub use retirement::{Retire, RetirementQueue, RetirementStats};
pub use transfer_runtime::{Retired, TransferRuntime};

/// A built-in kernel: the op set every runtime provides, enough for real programs and examples.
///
/// Each maps to the burn IR variant a burn backend would record for it (see
/// [`crate::FusionClient::add`] and friends).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Kernel {
    /// `out = lhs + rhs`, elementwise, equal shapes.
    Add,
    /// `out = lhs * rhs`, elementwise, equal shapes.
    Mul,
    /// `out = input * factor`.
    Scale(f64),
    /// `out = exp(input)`.
    Exp,
    /// `out = [sum(input)]`, shape `[1]`.
    Sum,
    /// `out = lhs @ rhs` for `[m, k] @ [k, n]`.
    Matmul,
    /// `out = value` everywhere, no inputs.
    Fill(f64),
    /// A kernel that dispatches normally and then fails *on the device*, at execution time:
    /// for tests of the asynchronous error paths. `out = input` otherwise. Feature `testing`.
    #[cfg(feature = "testing")]
    FailOnDevice,
}

impl Kernel {
    /// A short name for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Add => "add",
            Kernel::Mul => "mul",
            Kernel::Scale(_) => "scale",
            Kernel::Exp => "exp",
            Kernel::Sum => "sum",
            Kernel::Matmul => "matmul",
            Kernel::Fill(_) => "fill",
            #[cfg(feature = "testing")]
            Kernel::FailOnDevice => "fail_on_device",
        }
    }
}

/// One kernel input, fetched from the stream's handle map by the engine.
///
/// `status` is the operand's [`burn_ir::TensorStatus`] for this operation: with `ReadWrite` the
/// engine has removed the handle from the map and the kernel owns it, so it may reuse the buffer
/// in place when [`StreamRuntime::can_mut`] allows.
pub struct KernelInput<'a, H> {
    /// The backend handle.
    pub handle: H,
    /// The operand as the operation recorded it.
    pub ir: &'a TensorIr,
}

impl<H> std::fmt::Debug for KernelInput<'_, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelInput")
            .field("ir", self.ir)
            .finish_non_exhaustive()
    }
}

/// Whether a kernel may write its output over its first input's buffer: that input was handed
/// over as the last reference to its id (`ReadWrite`), has the output's dtype and shape, and its
/// buffer has no other owner ([`StreamRuntime::can_mut`] — false while a view aliases it, or an
/// in-flight kernel still reads it).
///
/// This is necessary, not sufficient: a runtime that writes in place must also keep every later
/// reader, on any stream, ordered after that write. The host runtime does (each write carries its
/// own completion marker); the CUDA runtime adds that the buffer was allocated on the current
/// stream, since cubecl 0.10 orders other streams after a buffer's allocating stream only.
pub fn first_input_reusable<R: StreamRuntime>(
    inputs: &KernelInputs<'_, R::FusionHandle>,
    out: &TensorIr,
) -> bool {
    inputs.first().is_some_and(|first| {
        first.ir.status == burn_ir::TensorStatus::ReadWrite
            && first.ir.dtype == out.dtype
            && first.ir.shape == out.shape
            && R::can_mut(&first.handle)
    })
}

/// Where a stream that does not fuse runs a batch of queued operations holding one that spreads
/// over the backend's thread pool (see [`StreamRuntime::batch_placement`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BatchPlacement {
    /// On the thread that drains the queue, like any other batch: for a backend whose
    /// operations run nothing on a thread pool.
    InPlace,
    /// Whole, on the engine's batch pool, a rayon pool whose threads run nothing but the
    /// engine's batches; the draining thread sleeps until the batch is done. For a backend that
    /// runs operations through rayon (burn-ndarray): they then never wait for a thread that
    /// may be waiting for the stream, and no job of the program's own pools ever runs inside a
    /// drain. One trip to the pool per batch, where a plain backend called from a thread
    /// outside rayon makes one per parallel operation.
    BatchPool,
}

/// The inputs of one kernel launch (inline up to two: no allocation per launch).
pub type KernelInputs<'a, H> = smallvec::SmallVec<[KernelInput<'a, H>; 2]>;

/// The device capabilities the engine needs beyond burn's [`FusionRuntime`].
///
/// # Contract
///
/// * Handles are reference counted: [`StreamRuntime::alias`] returns a second owner of the same
///   buffer, and the buffer lives until the last owner drops.
/// * [`StreamRuntime::can_mut`] is `false` while more than one owner exists (this is what makes an
///   aliased buffer ineligible for in-place reuse).
/// * `launch` and `upload` *dispatch*: they may return before the device has finished. The device
///   must order a kernel (and a read) after the last write of every buffer it reads, even when
///   that write was dispatched on another stream — an in-place write included — and must not
///   reuse a buffer while an in-flight kernel reads it.
/// * `read` and `synchronize` may wait for the device; the engine never calls them while it holds
///   a lock.
pub trait StreamRuntime: FusionRuntime {
    /// Per-device state: allocator, streams, worker threads, counters.
    type Context: Send + Sync + 'static;

    /// Short runtime name for logs.
    fn name() -> &'static str;

    /// Bring up the device. Called once per [`crate::FusionClient`].
    fn open(device: &Self::FusionDevice) -> Result<Self::Context>;

    /// The largest buffer this runtime can ever allocate, in bytes. Operations whose outputs
    /// would be larger are refused when they are registered ([`crate::Error::TooLarge`]); an
    /// allocation below this bound may still fail at run time (reported on the tensor).
    fn max_buffer_bytes(_context: &Self::Context) -> usize {
        crate::size::MAX_ALLOCATION
    }

    /// Copy host data into a new device buffer. The data is handed over, so a runtime whose
    /// backend takes ownership (burn's `from_data`) need not copy it first.
    fn upload(ctx: &Self::Context, data: TensorData) -> Result<Self::FusionHandle>;

    /// Wait for the buffer's last write and copy it to the host.
    ///
    /// A kernel failure recorded on the buffer is returned as the error.
    fn read(
        ctx: &Self::Context,
        handle: &Self::FusionHandle,
        shape: &Shape,
        dtype: DType,
    ) -> Result<TensorData>;

    /// [`StreamRuntime::read`], given the caller's handle to keep or drop (a consuming read: it
    /// may be the buffer's only owner, and a runtime that can hand the buffer over instead of
    /// copying it should). By default, `read` of the handle.
    fn read_owned(
        ctx: &Self::Context,
        handle: Self::FusionHandle,
        shape: &Shape,
        dtype: DType,
    ) -> Result<TensorData> {
        Self::read(ctx, &handle, shape, dtype)
    }

    /// A second owner of the same buffer (the alias hook burn 0.21 lacks).
    fn alias(handle: &Self::FusionHandle) -> Self::FusionHandle {
        handle.clone()
    }

    /// Whether `handle` is the only owner of its buffer, so a kernel may write it in place.
    fn can_mut(handle: &Self::FusionHandle) -> bool;

    /// Wait until everything dispatched on any stream of this device has finished.
    fn synchronize(ctx: &Self::Context) -> Result<()>;

    /// Whether the runtime implements `kernel` for `dtype`.
    fn supports(kernel: &Kernel, dtype: DType) -> bool;

    /// A kernel fuser for one of this runtime's streams, or `None` if the runtime does not fuse
    /// (the default). Called when a stream is created, when [`crate::EngineConfig::fusion`] is
    /// on.
    fn fuser(_ctx: &Self::Context) -> Option<Box<dyn Fuser<Self>>> {
        None
    }

    /// Whether `handle`'s buffer belongs to another stream than `stream` in the sense of the
    /// device's ordering rules: work on `stream` that uses it must be ordered after its writes
    /// ([`StreamRuntime::order_use`]), must never write it in place, and must have finished
    /// before the buffer can be reused ([`StreamRuntime::release_after_use`]).
    ///
    /// `false` by default: a device that orders every access to a buffer by itself (the host
    /// runtime's buffers carry their last writer's completion marker, and an in-flight kernel
    /// holds a reference to each buffer it reads). `StreamFusion<CubeBackend>` on CUDA says `true`
    /// for a buffer that another cubecl stream allocated (`src/backend/cross_stream.rs`; why, and
    /// the H200 measurements: `docs/cross-stream-cuda.md`).
    fn foreign_to(ctx: &Self::Context, handle: &Self::FusionHandle, stream: StreamId) -> bool {
        let _ = (ctx, handle, stream);
        false
    }

    /// How many threads should run work on `ctx`'s device at once, if the runtime wants a bound
    /// (the default for [`EngineConfig::max_launching_threads`](crate::EngineConfig::max_launching_threads)):
    /// for a device whose work all passes through one thread, where launching threads beyond
    /// what the machine runs beside it only slow each other down. `None` (the default): no bound.
    fn launching_threads(ctx: &Self::Context) -> Option<usize> {
        let _ = ctx;
        None
    }

    /// Whether [`StreamRuntime::foreign_to`] can say `true` for any buffer of `ctx`. `false`
    /// lets the engine skip looking up each consumed operand's handle to ask. `true` by default,
    /// so that a runtime that overrides `foreign_to` alone stays right; a runtime whose buffers
    /// are never foreign says `false`.
    fn has_foreign_buffers(ctx: &Self::Context) -> bool {
        let _ = ctx;
        true
    }

    /// Make work dispatched on `stream` from now on wait, on the device, for everything already
    /// dispatched on the stream that allocated `handle`'s buffer: every write to that buffer,
    /// and to every other buffer that stream allocated. The engine calls it when a buffer crosses
    /// to another stream: a shared view is registered there, or a tensor is read there. It
    /// counts on the whole stream being covered: after one ordering it asks again for another
    /// buffer of the same stream only once that stream has dispatched something since
    /// ([`crate::EngineStats::orders_skipped`]). An event recorded on the allocating stream and
    /// waited for on `stream` (CUDA's way) is exactly that; an implementation that waited for
    /// one buffer's last write alone would not be enough. Dispatch only: it never waits.
    /// Nothing by default.
    fn order_use(ctx: &Self::Context, handle: &Self::FusionHandle, stream: StreamId) {
        let _ = (ctx, handle, stream);
    }

    /// Release `handles`, each [`foreign_to`](StreamRuntime::foreign_to) `stream`, whose
    /// buffers work already dispatched on `stream` may still read: a buffer must not be reused
    /// (by any stream) before that work has finished. Dispatch only: it never waits. By
    /// default, drops them.
    fn release_after_use(ctx: &Self::Context, stream: StreamId, handles: Vec<Self::FusionHandle>) {
        let _ = (ctx, stream);
        drop(handles);
    }

    /// Where a stream that does not fuse runs a queue's worth of operations of which one or more
    /// spread over a thread pool of the backend's own (for `StreamFusion<B>`: a matmul, a
    /// convolution, a pooling, an interpolation or an attention; see [`BatchPlacement`]).
    /// [`BatchPlacement::InPlace`] by default.
    ///
    /// A runtime whose operations wait for a thread pool must answer
    /// [`BatchPlacement::BatchPool`]: run in place, under the stream's lock, such an operation
    /// can wait for a worker that waits for that lock.
    fn batch_placement(ctx: &Self::Context) -> BatchPlacement {
        let _ = ctx;
        BatchPlacement::InPlace
    }

    /// Dispatch `kernel` on the current stream ([`burn_backend::StreamId::current`]) and return the
    /// output handle without waiting for it.
    fn launch(
        ctx: &Self::Context,
        kernel: &Kernel,
        inputs: KernelInputs<'_, Self::FusionHandle>,
        out: &TensorIr,
    ) -> Result<Self::FusionHandle>;
}
