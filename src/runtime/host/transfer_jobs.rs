//! The host device's transfer path: frontiers and copies are jobs on the stream's worker, with
//! completion markers as events.

use std::fmt;
use std::sync::Arc;

use burn_backend::{DType, Shape, StreamId};

use super::kernels::HostData;
use super::marker::Marker;
use super::{HostContext, HostHandle, HostRuntime};
use crate::runtime::{PinnedHostBuffer, Retired, RetirementQueue, TransferRuntime};
use crate::{Error, Result};

/// A completion event of the host device (an opaque marker).
#[derive(Clone)]
pub struct HostEvent(Arc<Marker>);

impl fmt::Debug for HostEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("HostEvent")
            .field(&self.0.poll().is_some())
            .finish()
    }
}

fn copy_into(data: &HostData, dst: &mut [u8]) -> Result<()> {
    fn write<const N: usize, T: Copy>(src: &[T], dst: &mut [u8], bytes: impl Fn(T) -> [u8; N]) {
        for (chunk, value) in dst.chunks_exact_mut(N).zip(src) {
            chunk.copy_from_slice(&bytes(*value));
        }
    }
    let needed = match data {
        HostData::F32(v) => v.len() * 4,
        HostData::I32(v) => v.len() * 4,
        HostData::Unwritten => 0,
    };
    // The copy never reads past the source (`TransferRuntime::download`'s one bound; the
    // publication has already checked that the buffer holds exactly the value).
    if dst.len() > needed {
        return Err(Error::BufferSize {
            expected: needed,
            found: dst.len(),
        });
    }
    match data {
        HostData::F32(v) => write(v, dst, f32::to_ne_bytes),
        HostData::I32(v) => write(v, dst, i32::to_ne_bytes),
        HostData::Unwritten => {}
    }
    Ok(())
}

impl TransferRuntime for HostRuntime {
    type Event = HostEvent;
    /// The buffer itself: a host handle is its storage and its last write's marker.
    type Source = HostHandle;

    fn publishable(_: &HostContext, dtype: DType) -> bool {
        matches!(dtype, DType::F32 | DType::I32)
    }

    fn record_frontier(
        context: &HostContext,
        stream: StreamId,
        handle: HostHandle,
        _: &Shape,
        _: DType,
    ) -> Result<(HostHandle, HostEvent)> {
        let frontier = Marker::pending();
        let (done, written) = (frontier.clone(), handle.written.clone());
        // Behind everything dispatched to the stream so far; and after the value's last write,
        // wherever that was dispatched (its failure is the frontier's failure).
        context.workers.dispatch(
            stream.value,
            Box::new(move || done.complete(written.wait())),
        );
        Ok((handle, HostEvent(frontier)))
    }

    unsafe fn download(
        context: &HostContext,
        stream: StreamId,
        handle: &HostHandle,
        frontier: &HostEvent,
        buffer: &PinnedHostBuffer,
    ) -> Result<HostEvent> {
        let completion = Marker::pending();
        let done = completion.clone();
        let frontier = frontier.0.clone();
        let (written, storage) = (handle.written.clone(), handle.storage.clone());
        let memory = buffer.memory.clone();
        context.workers.dispatch(
            stream.value,
            Box::new(move || {
                let outcome = frontier
                    .wait()
                    .and_then(|()| written.wait())
                    .and_then(|()| {
                        // SAFETY: the buffer is owned by the download that enqueued this copy until
                        // the copy's completion is observed, so nothing else reads or writes these
                        // bytes now; the memory is valid for `len` bytes while `memory` lives.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(memory.as_ptr(), memory.len())
                        };
                        copy_into(&storage.data.read(), dst)
                    });
                // Let go of the buffer before announcing completion.
                drop((memory, storage));
                done.complete(outcome);
            }),
        );
        Ok(HostEvent(completion))
    }

    fn poll_event(event: &HostEvent) -> Option<Result<()>> {
        event.0.poll()
    }

    fn wait_event(event: &HostEvent) -> Result<()> {
        event.0.wait()
    }

    fn alloc_pinned(_: &HostContext, len: usize) -> Result<PinnedHostBuffer> {
        PinnedHostBuffer::new(len)
    }

    fn retirement(context: &HostContext) -> &RetirementQueue<Retired<Self>> {
        &context.retirement
    }
}
