//! What source publication needs from a device, on top of [`StreamRuntime`]: completion events,
//! frontier recording, asynchronous copies into pinned memory, and a retirement queue for records
//! dropped with work in flight.

use burn_backend::{DType, Shape, StreamId};

use super::{PinnedHostBuffer, Retire, RetirementQueue, StreamRuntime};
use crate::Result;

/// What the transfer module needs from a runtime, on top of [`StreamRuntime`].
///
/// Completion is one concept, an [`TransferRuntime::Event`]: the producer's frontier and a copy's
/// completion are both events, polled without waiting and waited on explicitly. A failed event
/// reports its error from both.
pub trait TransferRuntime: StreamRuntime {
    /// A completion marker recorded on a stream (a CUDA event; a host marker).
    type Event: Send + Sync + 'static;

    /// What a download copies from: a published value's buffer, with whatever the runtime needs
    /// to reach it. Owned by the publication, then by its download until the copy completes.
    type Source: Send + Sync + 'static;

    /// Whether values of `dtype` can be published on this device.
    fn publishable(context: &Self::Context, dtype: DType) -> bool;

    /// Record, on `stream`, an event that completes once everything dispatched to `stream` so far
    /// — and the last write of `handle` — has finished; and turn `handle`, a value of `shape`
    /// and `dtype`, into the source a download copies from. Must not wait.
    fn record_frontier(
        context: &Self::Context,
        stream: StreamId,
        handle: Self::FusionHandle,
        shape: &Shape,
        dtype: DType,
    ) -> Result<(Self::Source, Self::Event)>;

    /// Enqueue, in `stream`'s order and after `frontier`, a copy of the first `buffer.len()`
    /// bytes of `source` into `buffer`. Must not wait. A buffer longer than the source is an
    /// error ([`crate::Error::BufferSize`]).
    ///
    /// # Safety
    ///
    /// The caller keeps `source` and `buffer` alive, and does not touch `buffer`'s bytes, until
    /// the returned event has completed: the runtime does not keep them alive itself, so that
    /// each has one owner (a download record, then possibly a retired one).
    unsafe fn download(
        context: &Self::Context,
        stream: StreamId,
        source: &Self::Source,
        frontier: &Self::Event,
        buffer: &PinnedHostBuffer,
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

/// A detached transfer record: an event, and the one owner of everything the device may still
/// touch until it completes (the source, and a download's buffer).
pub struct Retired<R: TransferRuntime> {
    pub(crate) event: R::Event,
    pub(crate) _source: R::Source,
    pub(crate) _buffer: Option<PinnedHostBuffer>,
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
