//! Source publication: hand a finished device value to the host without keeping anything else
//! alive.
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
//! [`RetirementQueue`] instead of waiting for it. The one wait a drop can meet is the queue's
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
mod pinned;
mod publication;
mod retirement;
mod session;

pub use error::{
    DownloadFailed, DownloadRejected, PublicationAdmissionError, PublicationError,
    PublicationRejected,
};
pub use pinned::PinnedHostBuffer;
#[cfg(feature = "cuda")]
pub(crate) use pinned::PinnedMemory;
pub use publication::{PendingDownload, SourcePublication};
pub use retirement::{Retire, RetirementQueue, RetirementStats};
pub use session::HeldSession;

use burn_backend::{DType, StreamId};

use crate::Result;
use crate::runtime::StreamRuntime;

/// What the transfer module needs from a runtime, on top of [`StreamRuntime`].
///
/// Completion is one concept, an [`TransferRuntime::Event`]: the producer's frontier and a copy's
/// completion are both events, polled without waiting and waited on explicitly. A failed event
/// reports its error from both.
pub trait TransferRuntime: StreamRuntime {
    /// A completion marker recorded on a stream (a CUDA event; a host marker).
    type Event: Send + Sync + 'static;

    /// Whether values of `dtype` can be published.
    fn publishable(dtype: DType) -> bool;

    /// Record, on `stream`, an event that completes once everything dispatched to `stream` so far
    /// — and the last write of `handle` — has finished. Must not wait.
    fn record_frontier(
        context: &Self::Context,
        stream: StreamId,
        handle: &Self::FusionHandle,
    ) -> Result<Self::Event>;

    /// Enqueue, in `stream`'s order and after `frontier`, a copy of `bytes` bytes of `handle`'s
    /// buffer into `buffer`. Must not wait. `buffer` stays alive (its owner holds it) until the
    /// returned event completes.
    fn download(
        context: &Self::Context,
        stream: StreamId,
        handle: &Self::FusionHandle,
        frontier: &Self::Event,
        buffer: &PinnedHostBuffer,
        bytes: usize,
    ) -> Result<Self::Event>;

    /// The event's outcome if it has completed. Never waits, and never reports a failed event as
    /// not ready.
    fn poll_event(event: &Self::Event) -> Option<Result<()>>;

    /// Wait for the event.
    fn wait_event(event: &Self::Event) -> Result<()>;

    /// A host buffer of `len` bytes that this runtime copies into fastest.
    fn alloc_pinned(context: &Self::Context, len: usize) -> Result<PinnedHostBuffer>;

    /// The runtime's retirement queue.
    fn retirement(context: &Self::Context) -> &RetirementQueue<Retired<Self>>;
}

/// A detached transfer record: an event and everything the device may still touch until it
/// completes.
pub struct Retired<R: TransferRuntime> {
    pub(crate) event: R::Event,
    pub(crate) _handle: Option<R::FusionHandle>,
    pub(crate) _buffer: Option<PinnedHostBuffer>,
    pub(crate) _frontier: Option<R::Event>,
}

impl<R: TransferRuntime> std::fmt::Debug for Retired<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Retired")
            .field("done", &R::poll_event(&self.event).is_some())
            .field("buffer", &self._buffer)
            .finish_non_exhaustive()
    }
}

impl<R: TransferRuntime> Retire for Retired<R> {
    fn poll(&self) -> Option<Result<()>> {
        R::poll_event(&self.event)
    }

    fn wait(&self) -> Result<()> {
        R::wait_event(&self.event)
    }
}
