//! Publication on [`StreamFusion`](super::StreamFusion): [`BackendRuntime<B>`] as a
//! [`TransferRuntime`], so a burn program hands finished values to the host through
//! [`crate::transfer`].
//!
//! # The host route (every burn backend)
//!
//! A burn backend offers one way to a value's bytes: its own read (`into_data`), which waits for
//! the value's writes however the backend orders them. The route runs it off the caller's thread:
//!
//! 1. **Frontier.** `publish` queues the read on the captured stream's transfer thread (one per
//!    stream slot, started with the slot's first job), under that stream's id, and returns. The
//!    frontier completes when the backend has handed the bytes over: the value's producer has
//!    finished, and the bytes are the ones it wrote. The backend's handle is released then, so a
//!    device buffer does not outlive its read. On NdArray, whose operations run when the stream
//!    drains, the read is a copy of memory the drain already wrote.
//! 2. **Download.** Behind the frontier on the same thread, the bytes are copied into the
//!    caller's buffer, and the download's event completes.
//!
//! A read that fails (an error recorded on the value, a backend panic) fails the frontier, which
//! makes the publication terminal; a download behind it fails with the same error.
//!
//! What this costs: the value's bytes are copied twice on the host (the backend's read, then the
//! copy into the buffer), and between `publish` and the download the publication holds them in
//! host memory instead of the backend's buffer.

use std::fmt;
use std::sync::Arc;

use burn_backend::{DType, Shape, StreamId, TensorData, TensorPrimitive};
use burn_tensor::{BasicOps, Element};
use parking_lot::Mutex;

use super::runtime::{BackendContext, BackendRuntime, block_on, execution_error};
use super::{IrBackend, StreamFusion};
use crate::runtime::host::marker::Marker;
use crate::runtime::{PinnedHostBuffer, Retired, RetirementQueue, TransferRuntime};
use crate::transfer::Publishable;
use crate::{Error, FusionTensor, Result};

/// Bound of a backend engine's retirement queue (drainable side), as on the other runtimes.
pub(crate) const RETIREMENT_CAPACITY: usize = 256;

/// A completion event of a [`BackendRuntime`]'s transfers: a publication's frontier, or a
/// download's copy.
#[derive(Clone)]
pub struct BackendEvent(Event);

#[derive(Clone)]
enum Event {
    /// The host route's marker.
    Host(Arc<Marker>),
    /// The CUDA route's event.
    #[cfg(feature = "cuda")]
    Cuda(super::cuda::CudaEvent),
}

impl BackendEvent {
    fn poll(&self) -> Option<Result<()>> {
        match &self.0 {
            Event::Host(marker) => marker.poll(),
            #[cfg(feature = "cuda")]
            Event::Cuda(event) => event.poll(),
        }
    }

    fn wait(&self) -> Result<()> {
        match &self.0 {
            Event::Host(marker) => marker.wait(),
            #[cfg(feature = "cuda")]
            Event::Cuda(event) => event.wait(),
        }
    }
}

impl fmt::Debug for BackendEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BackendEvent")
            .field(&self.poll().is_some())
            .finish()
    }
}

/// What a download of a [`BackendRuntime`] publication copies from: on the host route, the
/// value's bytes as the backend's read handed them over; on the CUDA route, the value's device
/// buffer.
pub struct BackendSource(Source);

enum Source {
    Host(HostSource),
    #[cfg(feature = "cuda")]
    Cuda(super::cuda::CudaSource),
}

struct HostSource {
    bytes: usize,
    data: Arc<Mutex<Option<TensorData>>>,
}

impl fmt::Debug for BackendSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Source::Host(host) => f
                .debug_struct("BackendSource")
                .field("bytes", &host.bytes)
                .field("read", &host.data.lock().is_some())
                .finish(),
            #[cfg(feature = "cuda")]
            Source::Cuda(source) => f.debug_tuple("BackendSource").field(source).finish(),
        }
    }
}

/// The backend's read of a value, on the calling thread, as `stream`; a panic of the backend is
/// contained as a typed error, and bytes of the wrong length are refused.
fn read_bytes<B: IrBackend>(
    handle: B::Handle,
    shape: Shape,
    dtype: DType,
    stream: StreamId,
    bytes: usize,
) -> Result<TensorData> {
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        stream.executes(|| block_on(BackendRuntime::<B>::into_data_future(handle, shape, dtype)))
    }))
    .map_err(|payload| Error::from_kernel_panic("publish", payload))?;
    let data = read.map_err(|e| execution_error("publish", e))?;
    if data.as_bytes().len() != bytes {
        return Err(Error::Runtime(
            format!(
                "the backend read {} bytes of a {dtype:?} value that holds {bytes}",
                data.as_bytes().len()
            )
            .into(),
        ));
    }
    Ok(data)
}

/// The host route's frontier: the backend's read of the value, on the stream's transfer thread.
fn host_frontier<B: IrBackend>(
    ctx: &BackendContext<B>,
    stream: StreamId,
    handle: B::Handle,
    shape: &Shape,
    dtype: DType,
) -> Result<(BackendSource, BackendEvent)> {
    let bytes = crate::size::tensor_bytes("a published value", shape, dtype, usize::MAX)?;
    let source = HostSource {
        bytes,
        data: Arc::default(),
    };
    let frontier = Marker::pending();
    let (done, slot, shape) = (frontier.clone(), source.data.clone(), shape.clone());
    ctx.transfers.dispatch(
        stream.value,
        Box::new(move || {
            let outcome = read_bytes::<B>(handle, shape, dtype, stream, bytes)
                .map(|data| *slot.lock() = Some(data));
            done.complete(outcome);
        }),
    );
    Ok((
        BackendSource(Source::Host(source)),
        BackendEvent(Event::Host(frontier)),
    ))
}

/// The host route's copy, behind the frontier's read on the same transfer thread.
fn host_download<B: IrBackend>(
    ctx: &BackendContext<B>,
    stream: StreamId,
    source: &HostSource,
    frontier: Arc<Marker>,
    buffer: &PinnedHostBuffer,
) -> Result<BackendEvent> {
    // The one bound the copy itself relies on: it never reads past the source.
    if buffer.len() > source.bytes {
        return Err(Error::BufferSize {
            expected: source.bytes,
            found: buffer.len(),
        });
    }
    let completion = Marker::pending();
    let done = completion.clone();
    let (slot, memory) = (source.data.clone(), buffer.memory.clone());
    ctx.transfers.dispatch(
        stream.value,
        Box::new(move || {
            let outcome = frontier.wait().and_then(|()| {
                // A publication is downloaded once: its bytes go with the copy.
                let data = slot.lock().take().ok_or_else(|| {
                    Error::Runtime("a publication's bytes were already taken".into())
                })?;
                // SAFETY: the buffer belongs to the download that enqueued this copy until the
                // copy's completion is observed, so nothing else reads or writes these bytes
                // now; the memory is valid for `len` bytes while `memory` lives, and `len` is at
                // most the source's length (checked above).
                let dst = unsafe { std::slice::from_raw_parts_mut(memory.as_ptr(), memory.len()) };
                dst.copy_from_slice(&data.as_bytes()[..dst.len()]);
                Ok(())
            });
            // Let go of the buffer before announcing completion.
            drop(memory);
            done.complete(outcome);
        }),
    );
    Ok(BackendEvent(Event::Host(completion)))
}

impl<B: IrBackend> TransferRuntime for BackendRuntime<B> {
    type Event = BackendEvent;
    type Source = BackendSource;

    fn publishable(_: &BackendContext<B>, dtype: DType) -> bool {
        // Every dtype the backend stores has a plain byte layout except a quantized one, whose
        // bytes are packed values and parameters in the backend's own order.
        !matches!(dtype, DType::QFloat(_))
    }

    fn record_frontier(
        ctx: &BackendContext<B>,
        stream: StreamId,
        handle: B::Handle,
        shape: &Shape,
        dtype: DType,
    ) -> Result<(BackendSource, BackendEvent)> {
        #[cfg(feature = "cuda")]
        let handle = match &ctx.cuda {
            Some(route) => match route.device_buffer::<B>(handle, shape, dtype) {
                Ok(buffer) => {
                    let (source, event) = route.transfer()?.record_frontier(stream, buffer)?;
                    return Ok((
                        BackendSource(Source::Cuda(source)),
                        BackendEvent(Event::Cuda(event)),
                    ));
                }
                Err(handle) => handle,
            },
            None => handle,
        };
        host_frontier(ctx, stream, handle, shape, dtype)
    }

    unsafe fn download(
        ctx: &BackendContext<B>,
        stream: StreamId,
        source: &BackendSource,
        frontier: &BackendEvent,
        buffer: &PinnedHostBuffer,
    ) -> Result<BackendEvent> {
        match (&source.0, &frontier.0) {
            (Source::Host(source), Event::Host(frontier)) => {
                host_download(ctx, stream, source, frontier.clone(), buffer)
            }
            #[cfg(feature = "cuda")]
            (Source::Cuda(source), Event::Cuda(frontier)) => {
                let route = ctx.cuda.as_ref().ok_or_else(|| {
                    Error::Runtime("a CUDA publication on a device without CUDA".into())
                })?;
                // SAFETY: forwarded from the caller.
                let event =
                    unsafe { route.transfer()?.download(stream, source, frontier, buffer) }?;
                Ok(BackendEvent(Event::Cuda(event)))
            }
            #[cfg(feature = "cuda")]
            _ => Err(Error::Runtime(
                "a publication's source and frontier come from different routes".into(),
            )),
        }
    }

    fn poll_event(event: &BackendEvent) -> Option<Result<()>> {
        event.poll()
    }

    fn wait_event(event: &BackendEvent) -> Result<()> {
        event.wait()
    }

    fn alloc_pinned(ctx: &BackendContext<B>, len: usize) -> Result<PinnedHostBuffer> {
        #[cfg(feature = "cuda")]
        if let Some(route) = &ctx.cuda {
            return route.transfer()?.alloc_pinned(len);
        }
        let _ = ctx;
        PinnedHostBuffer::new(len)
    }

    fn retirement(ctx: &BackendContext<B>) -> &RetirementQueue<Retired<Self>> {
        &ctx.retirement
    }
}

/// A burn float tensor's primitive (a quantized one included: its dtype then says so, and
/// `publish` refuses it).
impl<B: IrBackend> Publishable<BackendRuntime<B>> for TensorPrimitive<StreamFusion<B>> {
    fn into_fusion_tensor(self) -> FusionTensor<BackendRuntime<B>> {
        match self {
            TensorPrimitive::Float(tensor) | TensorPrimitive::QFloat(tensor) => tensor,
        }
    }
}

/// A burn tensor of any kind: `unsafe { session.publish(tensor) }`.
impl<B, const D: usize, K> Publishable<BackendRuntime<B>>
    for burn_tensor::Tensor<StreamFusion<B>, D, K>
where
    B: IrBackend,
    K: BasicOps<StreamFusion<B>>,
    K::Elem: Element,
    K::Primitive: Publishable<BackendRuntime<B>>,
{
    fn into_fusion_tensor(self) -> FusionTensor<BackendRuntime<B>> {
        self.into_primitive().into_fusion_tensor()
    }
}
