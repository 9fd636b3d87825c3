//! The CUDA names of the transfer module and runtime (feature `cuda`).
//!
//! ```no_run
//! use fusion_streams::cuda::{CudaDevice, CudaHeldSession, CudaRuntime};
//! use fusion_streams::transfer::TransferRuntime;
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

pub use crate::runtime::cuda::{CudaContext, CudaDevice, CudaEvent, CudaHandle, CudaRuntime};
pub use crate::transfer::{
    DownloadFailed, PinnedHostBuffer, PublicationAdmissionError, PublicationError,
};

/// A held session on a CUDA stream.
pub type CudaHeldSession = crate::transfer::HeldSession<CudaRuntime>;
/// A published CUDA value.
pub type SourcePublication = crate::transfer::SourcePublication<CudaRuntime>;
/// A download of a published CUDA value into pinned host memory.
pub type PendingDownload = crate::transfer::PendingDownload<CudaRuntime>;
