//! The CUDA transfer path: frontiers, downloads into pinned memory, CUDA events.
//!
//! # Route
//!
//! cubecl 0.10 does not expose its `CUstream`s, and its fence future blocks when polled, so
//! frontiers cannot be multiplexed on one thread. Each captured stream therefore gets a *waiter*
//! thread, which handles that stream's transfer jobs in order:
//!
//! 1. **Frontier.** `publish` submits one closure to cubecl's device handle, without waiting for
//!    it (`submit` + `flush_queue`, a few µs). It runs on cubecl's server in order after this
//!    thread's earlier launches: it resolves the value's device address (`get_resource`, stored
//!    in the publication's [`CudaSource`], which owns it) and records cubecl's fence on the captured stream (and
//!    on the stream that created the buffer, if different: the runtime writes a buffer in place
//!    only on its allocating stream, so that stream holds its last write). The waiter awaits
//!    those fences. The frontier is exactly the work dispatched before `publish`: later work on the session's stream
//!    does not delay it. `frontier_ready` reads a state and never waits.
//! 2. **Download.** Behind the frontier (same waiter, same order), the waiter enqueues
//!    `cuMemcpyDtoHAsync` from the resolved address into the caller's buffer on its own
//!    non-blocking stream, and records a CUDA event. `is_ready` is a `cuEventQuery`; an error is
//!    reported as an error, never as "not ready". The source (the cubecl `Handle` and its
//!    `ManagedResource`) and the buffer have one owner each, the download record, which holds
//!    them until that event has completed (or hands them to the retirement queue), so the
//!    allocation cannot be reused under the copy.
//!
//!    A download asked for once the frontier has been reached skips the waiter: the caller
//!    enqueues the copy at once on a shared non-blocking stream (the common case of handing off
//!    a finished value, and the one that matches a raw `cuMemcpyDtoHAsync` + event).
//!
//! A stuck stream delays only its own later jobs, which the device orders after it anyway: there
//! is no head-of-line blocking across streams. The cost is a host hop between frontier and copy;
//! both hand-offs (server → waiter, waiter → caller) spin for up to 50 µs before sleeping, which
//! took publish + download of small values from 0.67 to 0.78–0.86 of cubecl's `read_one`.
//!
//! Teardown (dropping the last owner of the runtime context) lets every waiter finish its jobs,
//! synchronises its copy stream, and only then releases the retirement queue.

//!
//! # Files
//!
//! * `driver.rs` — the driver calls, each raw handle behind one owning type (primary context,
//!   pinned memory, copy stream).
//! * `event.rs` — [`CudaEvent`], the completion state machine.
//! * `waiter.rs` — the per-stream waiter threads and their jobs.
//! * `route.rs` — [`CudaRoute`], which `BackendRuntime`'s `TransferRuntime` implementation takes
//!   for a contiguous value of a cubecl CUDA handle.
//! * here — [`CudaTransfer`], which ties them to cubecl's server, and the check that a backend's
//!   handles are cubecl CUDA handles.

mod driver;
mod event;
mod route;
mod waiter;

use std::any::{Any, TypeId};
use std::fmt;
use std::sync::mpsc::channel;
use std::sync::{Arc, OnceLock};

use burn_backend::StreamId;
use cubecl::server::Handle;
use parking_lot::Mutex;

use driver::{CudaPinned, OwnedStream, PrimaryContext, setup};
#[cfg(feature = "testing")]
pub(crate) use driver::{FAIL_NEXT_RECORD, trap_on_device};
pub use event::CudaEvent;
use event::State;
pub(crate) use route::CudaRoute;
use waiter::{Job, Waiters};

use cubecl::cuda::CudaDevice;

use crate::backend::IrBackend;
use crate::runtime::{PinnedHostBuffer, PinnedMemory};
use crate::{Error, Result};

/// The handle type of burn's `CubeBackend<CudaRuntime, F, I, B>`, for any element types.
pub(crate) type CudaHandle = burn_cubecl_fusion::CubeFusionHandle<cubecl::cuda::CudaRuntime>;

/// `device` as the CUDA device it is, when backend `B`'s handles are cubecl CUDA handles (burn's
/// `CubeBackend` on CUDA); `None` for every other backend.
pub(crate) fn cuda_device<B: IrBackend>(device: &B::Device) -> Option<&CudaDevice> {
    if TypeId::of::<B::Handle>() != TypeId::of::<CudaHandle>() {
        return None;
    }
    (device as &dyn Any).downcast_ref::<CudaDevice>()
}

/// A handle of a backend [`cuda_device`] accepted, as the cubecl CUDA handle it is.
pub(crate) fn cuda_handle<H: 'static>(handle: &H) -> &CudaHandle {
    (handle as &dyn Any)
        .downcast_ref()
        .expect("a backend with a CUDA device has cubecl CUDA handles")
}

/// A published value's device address, and the cubecl resource that keeps it valid.
struct Address {
    ptr: u64,
    _resource: Mutex<Box<dyn Any + Send>>,
}

/// Where a publication's source lives on the device: filled in by cubecl's server when the
/// frontier is recorded, read when the copy is enqueued (never before the frontier is reached).
type Resolved = Arc<OnceLock<Result<Address>>>;

/// What a CUDA download copies from: the published value's cubecl handle and its resolved
/// device address. Owned by the publication, then by its download until the copy completes.
pub struct CudaSource {
    handle: Handle,
    resolved: Resolved,
}

impl fmt::Debug for CudaSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaSource")
            .field("bytes", &self.handle.size_in_used())
            .field("resolved", &matches!(self.resolved.get(), Some(Ok(_))))
            .finish()
    }
}

/// Enqueue the copy of a resolved source into `dst` on `stream`.
///
/// # Safety
///
/// As [`OwnedStream::copy_to_host`]: the source and `dst` stay alive until the returned event
/// completes, and `dst` is no larger than the source (checked by `download`).
unsafe fn copy_resolved(
    stream: &OwnedStream,
    source: &Resolved,
    dst: &dyn PinnedMemory,
) -> Result<cudarc::driver::sys::CUevent> {
    let address = match source.get() {
        Some(Ok(address)) => address.ptr,
        Some(Err(error)) => return Err(error.clone()),
        None => {
            return Err(Error::Runtime(
                "a frontier was reached before its source was resolved".into(),
            ));
        }
    };
    // SAFETY: forwarded from the caller.
    unsafe { stream.copy_to_host(address, dst) }
}

/// The per-device transfer machinery, created with the first publication.
type Server = <cubecl::cuda::CudaRuntime as cubecl::Runtime>::Server;

pub(crate) struct CudaTransfer {
    primary: Arc<PrimaryContext>,
    waiters: Waiters,
    /// The stream of copies whose frontier had already been reached when they were asked for:
    /// those are enqueued by the caller at once, without a hop through a waiter. Declared after
    /// `waiters`, so it is synchronised and destroyed after them.
    direct: OnceLock<Result<OwnedStream>>,
    /// cubecl's device service, for non-blocking submissions to its server.
    device: cubecl::device_handle::DeviceHandle<Server>,
}

impl CudaTransfer {
    /// The transfer machinery of `device`: retains its primary context; starts no thread.
    pub(crate) fn new(device: &CudaDevice) -> Result<Self> {
        use cubecl::device::Device as _;
        let primary = PrimaryContext::retain(device.index)?;
        Ok(Self {
            waiters: Waiters::new(primary.clone()),
            primary,
            direct: OnceLock::new(),
            device: cubecl::device_handle::DeviceHandle::new(device.to_id()),
        })
    }

    /// Wait until every waiter has handled its jobs so far and every copy has finished.
    pub(crate) fn barrier(&self) -> Result<()> {
        self.waiters.barrier()?;
        if let Some(Ok(direct)) = self.direct.get() {
            direct.synchronize()?;
        }
        Ok(())
    }

    fn direct(&self) -> Result<&OwnedStream> {
        self.direct
            .get_or_init(|| OwnedStream::new(&self.primary))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Record the frontier of a value held by `handle` on `stream` (see the module docs): one
    /// closure submitted to cubecl's server, which resolves the buffer's address and records
    /// cubecl's fences on `stream` and on the buffer's allocating stream; the stream's waiter
    /// awaits them. Does not wait.
    pub(crate) fn record_frontier(
        &self,
        stream: StreamId,
        handle: Handle,
    ) -> Result<(CudaSource, CudaEvent)> {
        let event = CudaEvent::pending(&self.primary);
        let (fences_tx, fences) = channel();
        let source = CudaSource {
            handle,
            resolved: Arc::default(),
        };
        let (resolved, created_on) = (source.resolved.clone(), source.handle.stream);
        let binding = source.handle.clone().binding();
        // Runs on cubecl's server, in order after this thread's earlier submissions; does not
        // block the caller.
        self.device.submit(move |server: &mut Server| {
            use cubecl::server::ComputeServer;
            let address = server
                .get_resource(binding, created_on)
                .map(|resource| Address {
                    ptr: resource.resource().ptr,
                    _resource: Mutex::new(Box::new(resource)),
                })
                .map_err(|e| setup("get_resource", e));
            let _ = resolved.set(address);
            let mut fences = vec![server.sync(stream)];
            if created_on != stream {
                fences.push(server.sync(created_on));
            }
            let _ = fences_tx.send(fences);
        });
        self.device.flush_queue();
        self.waiters.send(
            stream,
            Job::Frontier {
                fences,
                source: source.resolved.clone(),
                event: event.clone(),
            },
        )?;
        Ok((source, event))
    }

    /// Enqueue the copy of `source` into `buffer`, in `stream`'s order after `frontier`.
    ///
    /// # Safety
    ///
    /// As [`TransferRuntime::download`].
    pub(crate) unsafe fn download(
        &self,
        stream: StreamId,
        source: &CudaSource,
        frontier: &CudaEvent,
        buffer: &PinnedHostBuffer,
    ) -> Result<CudaEvent> {
        // The one bound the copy itself relies on: it never reads past the source.
        if buffer.len() as u64 > source.handle.size_in_used() {
            return Err(Error::BufferSize {
                expected: source.handle.size_in_used() as usize,
                found: buffer.len(),
            });
        }
        let event = CudaEvent::pending(&self.primary);
        if let Some(Ok(())) = frontier.poll() {
            // The frontier has been reached: nothing is left to order the copy after, so it is
            // enqueued here, with no hop through the stream's waiter.
            // SAFETY: the caller holds the source and the buffer until the event completes.
            let cuda_event =
                unsafe { copy_resolved(self.direct()?, &source.resolved, &*buffer.memory) }?;
            event.set(State::Enqueued(cuda_event));
            return Ok(event);
        }
        self.waiters.send(
            stream,
            Job::Download {
                source: source.resolved.clone(),
                frontier: frontier.clone(),
                dst: buffer.memory.clone(),
                event: event.clone(),
            },
        )?;
        Ok(event)
    }

    /// Page-locked host memory of `len` bytes (`cuMemHostAlloc`), which copies from this device
    /// run into at full speed.
    pub(crate) fn alloc_pinned(&self, len: usize) -> Result<PinnedHostBuffer> {
        PinnedHostBuffer::check_len(len)?;
        Ok(PinnedHostBuffer::from_memory(Arc::new(CudaPinned::new(
            &self.primary,
            len,
        )?)))
    }
}
