//! Source publication: hand a finished device value to the host without keeping anything else
//! alive.
//!
//! This module is the user protocol (sessions, publications, downloads and their errors). What it
//! needs from a device — [`TransferRuntime`](crate::runtime::TransferRuntime), pinned memory, the
//! retirement queue — is a runtime contract and lives in [`crate::runtime`].
//!
//! On [`StreamFusion`](crate::backend::StreamFusion) a burn program holds a session with
//! `StreamFusion::<B>::session(&device)`, publishes burn tensors of any kind, allocates buffers
//! with `StreamFusion::<B>::pinned_buffer`, and reads a finished download back as burn
//! [`TensorData`](burn_backend::TensorData) with [`PendingDownload::wait_data`]; how each
//! backend's copy runs is in `backend::transfer` (a DMA copy from the device buffer on CUDA, the
//! backend's own read on a transfer thread elsewhere).
//!
//! From a [`HeldSession`] (which captures the current stream), `unsafe {
//! session.publish(value) }` moves a tensor into an owned [`SourcePublication`]:
//!
//! * it **drains** the session's lazy work, so no lazy source work hides in the later copy;
//! * it **retains the allocation** — a second owner of the value's buffer plus a pin on the runtime
//!   context — and releases the value's engine id, so the publication outlives the session, the
//!   client and every tensor;
//! * it **records the producer's frontier** on the captured stream without waiting: a completion
//!   event ordered after everything the session dispatched.
//!
//! The publication reports readiness without waiting ([`SourcePublication::frontier_ready`]), can
//! wait explicitly ([`SourcePublication::await_frontier`]; a failure is terminal and recorded), and
//! is consumed by [`SourcePublication::download_into`], an asynchronous copy into a caller-owned
//! [`PinnedHostBuffer`] that returns a [`PendingDownload`] to poll or wait on. There is no public
//! accessor of the value: a borrowed tensor carries no readiness, so a consumer on a third stream
//! could read it before the producer finished; the copy is the honest route back.
//!
//! Dropping a publication or a download with work in flight hands its record to the runtime's
//! [`RetirementQueue`](crate::runtime::RetirementQueue) instead of waiting for it. The one wait a drop can meet is the queue's
//! backpressure: when its bounded side is full (256 records in flight on both runtimes), the drop
//! waits for the *oldest* record's device work, which was submitted before it. A publication whose
//! frontier failed goes to the permanent side and never waits. Dropping the last owner of the
//! runtime (client, tensor, publication or download) waits for every stream of the device, then
//! releases the queue. `mem::forget` leaks the record in place.
//!
//! ```
//! use burn_backend::{DType, TensorData};
//! use fusion_streams::FusionClient;
//! use fusion_streams::host::{HostDevice, HostRuntime};
//! use fusion_streams::transfer::{HeldSession, PinnedHostBuffer};
//!
//! let client = FusionClient::<HostRuntime>::new(HostDevice::default())?;
//! let mut session = HeldSession::open(&client)?;
//! let x = client.from_data(TensorData::new(vec![1.0f32, 2.0, 3.0], [3]))?;
//! let value = x.scale(2.0)?;
//! // SAFETY: `value` was produced on this thread's stream, which the session captured.
//! // `?` keeps the error and drops any owner a rejection hands back; match on the error to keep
//! // them instead.
//! let publication = unsafe { session.publish(value) }?;
//! session.close();
//! drop((x, client)); // the publication keeps only the allocation and the runtime
//!
//! let download = publication.download_into(PinnedHostBuffer::new(12)?)?;
//! let buffer = download.wait()?;
//! assert_eq!(buffer.to_data([3], DType::F32)?.to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0]);
//! # Ok::<(), fusion_streams::Error>(())
//! ```

mod error;
mod publication;
mod session;

pub use crate::runtime::PinnedHostBuffer;
pub use error::{
    DownloadFailed, DownloadRejected, PublicationAdmissionError, PublicationError,
    PublicationRejected,
};
pub use publication::{PendingDownload, SourcePublication};
pub use session::{HeldSession, Publishable};
