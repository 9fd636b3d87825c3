//! [`CudaRuntime`]: the engine on an NVIDIA GPU, over cubecl-cuda 0.10 (feature `cuda`).
//!
//! * **Handles** are cubecl handles: reference-counted device allocations. `alias` is a handle
//!   clone, and cubecl's `can_mut` is false while two exist.
//! * **In place only on the allocating stream.** cubecl 0.10 orders another stream's access to a
//!   buffer through the stream that *allocated* it (`Handle::stream`), not the stream that last
//!   wrote it. A kernel may therefore write its handed-over input in place only when that input
//!   was allocated on the current stream; a tensor moved to another thread gets a fresh output
//!   buffer on its new stream instead. Without this rule a chain written in place on stream B into
//!   a buffer allocated on A was invisible to a publication's frontier on a third stream, which
//!   then downloaded it half done (reproduced on an H200: `tests/gpu.rs`, the `a_chain_on_*`
//!   tests). With it, every buffer's writers are all on its allocating stream: what cubecl aligns
//!   other streams with, and what a frontier covers.
//! * **Reads** run on the buffer's allocating stream, ordered after its writers by stream order.
//! * **Synchronisation** waits for every cubecl stream the context has dispatched to (recorded as
//!   work is dispatched), not only the caller's.
//! * **Streams.** Each engine stream runs on its own cubecl stream: the engine runs every
//!   operation inside `StreamId::executes(stream)`, including when another thread drains the
//!   stream to share one of its tensors, and cubecl selects its CUDA stream from
//!   [`burn_backend::StreamId::current`].
//! * **Cross-stream ordering.** cubecl 0.10 orders a kernel that reads a buffer after that
//!   buffer's last write on another stream (measured on an H200 with a standalone cudarc probe,
//!   and tested by this crate's GPU tests with a long producer).
//! * **Kernels** are the built-in op set in CubeCL, with the host runtime's
//!   summation order so that results agree bit for bit where the inputs are exact.
//! * **Errors.** cubecl reports device failures when work is read or synchronised; they surface as
//!   [`crate::Error::KernelFailed`] from the read. `FusionClient::fail_on_device` launches a kernel
//!   NVRTC refuses to compile, a failure on cubecl's server after dispatch; it leaves that server
//!   unhealthy for the process, so use it in a process of its own. A driver call that only sets
//!   something up (`cuInit`, a context, a stream, an event, `cuMemHostAlloc`) is not a kernel:
//!   its failure is [`crate::Error::Runtime`] naming the call, or [`crate::Error::OutOfMemory`]
//!   when the driver ran out of memory. Calls that wait on device work (event queries, stream
//!   synchronisation, fences) or enqueue behind it report an earlier kernel's fault, and keep
//!   [`crate::Error::KernelFailed`].
//!
//! This is the crate's one public path to the CUDA runtime; it also names the transfer types
//! for it.
//!
//! ```no_run
//! use fusion_streams::cuda::{CudaDevice, CudaHeldSession, CudaRuntime};
//! use fusion_streams::runtime::TransferRuntime;
//! use fusion_streams::FusionClient;
//!
//! let client = FusionClient::<CudaRuntime>::new(CudaDevice::new(0))?;
//! let mut session = CudaHeldSession::open(&client)?;
//! let value = client.fill([1024], 1.0, burn_backend::DType::F32)?;
//! // SAFETY: produced on the session's stream by this crate's operations.
//! let publication = unsafe { session.publish(value) }.map_err(|e| e.error().clone())?;
//! let buffer = CudaRuntime::alloc_pinned(client.context(), publication.bytes())?;
//! let buffer = publication
//!     .download_into(buffer)
//!     .map_err(|e| e.error().clone())?
//!     .wait()
//!     .map_err(|e| e.error)?;
//! # Ok::<(), fusion_streams::Error>(())
//! ```

pub use crate::runtime::cuda::{
    CudaClient, CudaContext, CudaDevice, CudaEvent, CudaHandle, CudaRuntime, CudaSource,
};
pub use crate::transfer::{
    DownloadFailed, PinnedHostBuffer, PublicationAdmissionError, PublicationError,
};

/// A held session on a CUDA stream.
pub type CudaHeldSession = crate::transfer::HeldSession<CudaRuntime>;
/// A published CUDA value.
pub type SourcePublication = crate::transfer::SourcePublication<CudaRuntime>;
/// A download of a published CUDA value into pinned host memory.
pub type PendingDownload = crate::transfer::PendingDownload<CudaRuntime>;
