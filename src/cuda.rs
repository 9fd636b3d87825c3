//! The crate on an NVIDIA GPU (feature `cuda`): [`StreamFusion`]`<`[`Cuda`]`>`, burn's CubeCL
//! backend on cubecl-cuda 0.10 under the engine.
//!
//! There is one CUDA path. Everything the crate does on a GPU — per-thread streams, shared
//! views, foreign drops, kernel fusion, publication and pinned downloads — runs on
//! `StreamFusion<CubeBackend<CudaRuntime, ..>>` and on the [`FusionClient`](crate::FusionClient) it is built on
//! ([`StreamFusion::client`], a `FusionClient<BackendRuntime<Cuda>>` for framework authors who
//! drive the engine directly). What the GPU adds to the backend layer:
//!
//! * **Fusion.** Each run of queued operations goes through burn-cubecl-fusion's fusers
//!   ([`crate::backend::CubeStreamFuser`]): element-wise runs and matmuls become single kernels.
//! * **Cross-stream rules.** cubecl 0.10 leaves two hazards open when a buffer is used on two
//!   CUDA streams (a read ordered before the last write, and reuse under a reader on another
//!   stream); the engine closes both on the device, without host waits. The design is in the
//!   docs of the backend's `cross_stream` module, the measurements in
//!   `docs/cross-stream-cuda.md`.
//! * **Transfers.** A publication's frontier is cubecl's own fence on the session's stream (and
//!   on the buffer's allocating stream), awaited by a per-stream waiter thread; its download is
//!   one `cuMemcpyDtoHAsync` from the value's device buffer into page-locked `cuMemHostAlloc`
//!   memory ([`StreamFusion::pinned_buffer`]), with a CUDA event behind it. Values that are not
//!   one contiguous buffer (a strided view) are read through burn's own `into_data` instead.
//! * **Errors.** cubecl reports device failures when work is read or synchronised; they reach
//!   the read that needs the failed value. A driver call that only sets something up (a
//!   context, a stream, an event, `cuMemHostAlloc`) is [`crate::Error::Runtime`] naming the
//!   call, or [`crate::Error::OutOfMemory`] when the driver ran out of memory; a wait on device
//!   work that reports an earlier kernel's fault is [`crate::Error::KernelFailed`].
//!
//! ```no_run
//! use burn_tensor::Tensor;
//! use fusion_streams::backend::StreamFusion;
//! use fusion_streams::cuda::{Cuda, CudaDevice};
//!
//! type B = StreamFusion<Cuda>;
//! let device = CudaDevice::new(0);
//! let x = Tensor::<B, 1>::from_floats([1.0, 2.0, 3.0], &device);
//! let y = (x.clone() * 2.0 + x).exp(); // queued on this thread's stream, fused when drained
//! let mut session = B::session(&device)?;
//! // SAFETY: `y` was produced by the engine's operations, which order it before the session.
//! let publication = unsafe { session.publish(y) }.map_err(|e| e.error().clone())?;
//! let buffer = B::pinned_buffer(&device, publication.bytes())?;
//! let (data, _buffer) = publication
//!     .download_into(buffer)
//!     .map_err(|e| e.error().clone())?
//!     .wait_data()
//!     .map_err(|e| e.error)?;
//! assert_eq!(data.shape, vec![3]);
//! # Ok::<(), fusion_streams::Error>(())
//! ```

pub use crate::backend::StreamFusion;
pub use cubecl::cuda::CudaDevice;

/// burn's CubeCL backend on CUDA, with burn's default element types: the backend to wrap in
/// [`StreamFusion`]. (burn's own `burn::backend::Cuda` is this backend inside burn-fusion's
/// `Fusion`; `StreamFusion<Cuda>` takes that place.)
pub type Cuda = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

/// Whether a CUDA driver and at least one device are present. Never panics (cubecl does, when
/// it first opens a device without a driver), so a program can fall back to another backend.
pub fn is_available() -> bool {
    // SAFETY: loading a shared library runs its initialisers. This loads NVIDIA's driver library
    // by its standard names, the library cubecl itself loads for this backend.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    cudarc::driver::result::init().is_ok()
        && cudarc::driver::result::device::get_count().is_ok_and(|n| n > 0)
}
