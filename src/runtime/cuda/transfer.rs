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
//!    thread's earlier launches: it resolves the value's device address (`get_resource`, kept as
//!    the publication's resolved address) and records cubecl's fence on the captured stream (and
//!    on the stream that created the buffer, if different: the runtime writes a buffer in place
//!    only on its allocating stream, so that stream holds its last write). The waiter awaits
//!    those fences. The
//!    frontier is exactly the work dispatched before `publish`: later work on the session's stream
//!    does not delay it. `frontier_ready` reads a state and never waits.
//! 2. **Download.** Behind the frontier (same waiter, same order), the waiter enqueues
//!    `cuMemcpyDtoHAsync` from the resolved address into the caller's buffer on its own
//!    non-blocking stream, and records a CUDA event. `is_ready` is a `cuEventQuery`; an error is
//!    reported as an error, never as "not ready". The cubecl `Handle` clone and the
//!    `ManagedResource` are held until that event has completed, so the allocation cannot be
//!    reused under the copy.
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

use std::any::Any;
use std::cell::Cell;
use std::fmt;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use burn_backend::{DType, StreamId};
use cubecl::server::Handle;
use cudarc::driver::{result, sys};
use hashbrown::HashMap;
use parking_lot::{Condvar, Mutex};

use super::{CudaContext, CudaHandle, CudaRuntime};
use crate::runtime::{PinnedHostBuffer, PinnedMemory, Retired, RetirementQueue, TransferRuntime};
use crate::{Error, Result};

/// A driver call that sets something up (a context, a stream, an event, memory) failed: a
/// [`Error::Runtime`] naming the call. No kernel was involved.
fn setup(call: &str, error: impl fmt::Debug) -> Error {
    Error::Runtime(format!("{call} failed: {error:?}").into())
}

/// A driver call that waits on, or enqueues behind, device work failed. CUDA reports an earlier
/// kernel's fault (a sticky context error) at the next such call, so it is the device failing:
/// [`Error::KernelFailed`], under the call's name.
fn device_fault(call: &str, error: impl fmt::Debug) -> Error {
    Error::KernelFailed {
        kernel: call.into(),
        message: format!("{error:?}").into(),
    }
}

/// The device's primary context, retained while memory or events of this crate may use it.
pub(crate) struct PrimaryContext {
    context: sys::CUcontext,
    device: sys::CUdevice,
}

// SAFETY: a CUcontext and a CUdevice are driver handles; the driver API accepts them from any
// thread (making the context current per thread is done explicitly before each use).
unsafe impl Send for PrimaryContext {}
// SAFETY: see `Send`: `&PrimaryContext` only exposes the handles.
unsafe impl Sync for PrimaryContext {}

std::thread_local! {
    /// The context last made current on this thread (a `Cell` of a plain integer: no
    /// destructor, usable during thread exit).
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

impl PrimaryContext {
    fn retain(ordinal: usize) -> Result<Arc<Self>> {
        result::init().map_err(|e| setup("cuInit", e))?;
        let device = result::device::get(ordinal as i32).map_err(|e| setup("cuDeviceGet", e))?;
        // SAFETY: `device` is a valid device handle just returned by the driver.
        let context = unsafe { result::primary_ctx::retain(device) }
            .map_err(|e| setup("cuDevicePrimaryCtxRetain", e))?;
        Ok(Arc::new(Self { context, device }))
    }

    /// Make the primary context current on this thread (once per thread).
    fn make_current(&self) -> Result<()> {
        let key = self.context as usize;
        if CURRENT.with(Cell::get) == key {
            return Ok(());
        }
        // SAFETY: `context` is retained for as long as `self` lives.
        unsafe { result::ctx::set_current(self.context) }
            .map_err(|e| setup("cuCtxSetCurrent", e))?;
        CURRENT.with(|c| c.set(key));
        Ok(())
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `PrimaryContext::retain`.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

/// Page-locked host memory from `cuMemHostAlloc` (portable, not write-combined: CPU reads of
/// write-combined memory are very slow).
struct CudaPinned {
    ptr: *mut u8,
    len: usize,
    primary: Arc<PrimaryContext>,
}

// SAFETY: the allocation is owned by this value; exclusive access is enforced by
// `PinnedHostBuffer` (the user or one in-flight copy, never both).
unsafe impl Send for CudaPinned {}
// SAFETY: see `Send`.
unsafe impl Sync for CudaPinned {}

impl CudaPinned {
    fn new(primary: &Arc<PrimaryContext>, len: usize) -> Result<Self> {
        primary.make_current()?;
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer; the primary context is current.
        unsafe { sys::cuMemHostAlloc(&mut ptr, len, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .result()
            .map_err(|e| match e.0 {
                sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory {
                    what: "pinned host memory".into(),
                    bytes: len,
                },
                _ => setup("cuMemHostAlloc", e),
            })?;
        Ok(Self {
            ptr: ptr.cast(),
            len,
            primary: primary.clone(),
        })
    }
}

impl Drop for CudaPinned {
    fn drop(&mut self) {
        // Freed with the context it was allocated in still retained (`primary`).
        if self.primary.make_current().is_ok() {
            // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed once, when no copy can
            // touch it any more (the buffer is dropped only by its owner).
            let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
        }
    }
}

impl PinnedMemory for CudaPinned {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> &'static str {
        "cuMemHostAlloc"
    }
}

enum State {
    /// Not reached yet (a frontier), or not enqueued yet (a copy waiting for its frontier).
    Pending,
    /// A copy enqueued on a waiter's stream; `keep` holds what it reads and writes.
    Enqueued {
        event: sys::CUevent,
        keep: Box<dyn Any + Send>,
    },
    Done(Result<()>),
}

struct EventInner {
    state: Mutex<State>,
    changed: Condvar,
    primary: Arc<PrimaryContext>,
    /// For a frontier: the published value's resolved device address, and the cubecl
    /// `ManagedResource` that keeps it valid.
    resolved: Mutex<Option<(u64, Arc<dyn Any + Send + Sync>)>>,
}

// SAFETY: the raw `CUevent` in `State` is only used under the mutex, with the primary context
// made current first; the driver accepts it from any thread.
unsafe impl Send for EventInner {}
// SAFETY: see `Send`.
unsafe impl Sync for EventInner {}

/// A completion event of the CUDA runtime: a frontier, or a copy's CUDA event.
#[derive(Clone)]
pub struct CudaEvent(Arc<EventInner>);

impl fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &*self.0.state.lock() {
            State::Pending => "pending",
            State::Enqueued { .. } => "enqueued",
            State::Done(Ok(())) => "done",
            State::Done(Err(_)) => "failed",
        };
        f.debug_tuple("CudaEvent").field(&state).finish()
    }
}

impl CudaEvent {
    fn pending(primary: &Arc<PrimaryContext>) -> Self {
        Self(Arc::new(EventInner {
            state: Mutex::new(State::Pending),
            changed: Condvar::new(),
            primary: primary.clone(),
            resolved: Mutex::new(None),
        }))
    }

    fn set(&self, state: State) {
        let old = std::mem::replace(&mut *self.0.state.lock(), state);
        self.0.changed.notify_all();
        debug_assert!(!matches!(old, State::Enqueued { .. }));
    }

    fn finish(inner: &EventInner, state: &mut State, outcome: Result<()>) {
        if let State::Enqueued { event, keep } = std::mem::replace(state, State::Done(outcome)) {
            let _ = inner.primary.make_current();
            // SAFETY: the event was created by a waiter and is destroyed once, here, after it
            // completed (or failed).
            let _ = unsafe { result::event::destroy(event) };
            drop(keep);
        }
    }

    fn poll(&self) -> Option<Result<()>> {
        let mut state = self.0.state.lock();
        let event = match &*state {
            State::Pending => return None,
            State::Done(outcome) => return Some(outcome.clone()),
            State::Enqueued { event, .. } => *event,
        };
        if let Err(error) = self.0.primary.make_current() {
            Self::finish(&self.0, &mut state, Err(error.clone()));
            return Some(Err(error));
        }
        // SAFETY: `event` is alive: only `finish`, under this lock, destroys it.
        let outcome = match unsafe { sys::cuEventQuery(event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            sys::CUresult::CUDA_ERROR_NOT_READY => return None,
            error => Err(device_fault("cuEventQuery", error)),
        };
        Self::finish(&self.0, &mut state, outcome.clone());
        Some(outcome)
    }

    fn wait(&self) -> Result<()> {
        spin_until(|| !matches!(*self.0.state.lock(), State::Pending));
        let mut state = self.0.state.lock();
        loop {
            match &*state {
                State::Pending => self.0.changed.wait(&mut state),
                State::Done(outcome) => return outcome.clone(),
                State::Enqueued { event, .. } => {
                    let event = *event;
                    let outcome = self.0.primary.make_current().and_then(|()| {
                        // SAFETY: `event` is alive while the lock is held.
                        unsafe { result::event::synchronize(event) }
                            .map_err(|e| device_fault("cuEventSynchronize", e))
                    });
                    Self::finish(&self.0, &mut state, outcome.clone());
                    return outcome;
                }
            }
        }
    }
}

impl Drop for EventInner {
    fn drop(&mut self) {
        // The last owner of an event whose copy is still enqueued waits for the copy: the copy's
        // buffers (`keep`) must outlive it. This crate's own records never get here with a copy
        // in flight except at teardown, after the copy streams were synchronised (a dropped
        // download is retired while in flight, and released only once its event completed), so
        // the wait returns at once; it can block only for a caller of `TransferRuntime::download`
        // who drops the event it returned while the copy runs.
        let mut state = std::mem::replace(self.state.get_mut(), State::Pending);
        if let State::Enqueued { event, .. } = &mut state
            && self.primary.make_current().is_ok()
        {
            // SAFETY: last owner of the event.
            let _ = unsafe { result::event::synchronize(*event) };
            let _ = unsafe { result::event::destroy(*event) };
        }
    }
}

/// How long a waiter on a hand-off between threads spins before it sleeps. A frontier or a copy
/// that is about to be ready usually is within a few microseconds; a futex wake-up costs about
/// as much again, on each of the two hand-offs of a download. Bounded, so a long wait costs at
/// most this much CPU.
const SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// Spin (re-checking `ready`) for at most [`SPIN`]; whether it became ready.
fn spin_until(mut ready: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    loop {
        if ready() {
            return true;
        }
        if start.elapsed() >= SPIN {
            return false;
        }
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    }
}

type Fence = cubecl::future::DynFut<std::result::Result<(), cubecl::server::ServerError>>;
type Resolved = std::result::Result<(u64, Arc<dyn Any + Send + Sync>), Error>;

enum Job {
    /// Finish every copy enqueued so far, then complete the event.
    Barrier(CudaEvent),
    /// The parts cubecl's server produced at publish time: the resolved address and the fences.
    Frontier {
        parts: std::sync::mpsc::Receiver<(Resolved, Vec<Fence>)>,
        event: CudaEvent,
    },
    Download {
        handle: Handle,
        frontier: CudaEvent,
        dst: Arc<dyn PinnedMemory>,
        bytes: usize,
        event: CudaEvent,
    },
}

struct Waiter {
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The per-device transfer machinery, created with the first publication.
type Server = <cubecl::cuda::CudaRuntime as cubecl::Runtime>::Server;

pub(crate) struct CudaTransfer {
    primary: Arc<PrimaryContext>,
    waiters: Mutex<HashMap<u64, Waiter>>,
    /// The stream of copies whose frontier had already been reached when they were asked for:
    /// those are enqueued by the caller at once, without a hop through a waiter. Declared after
    /// `waiters`, so it is synchronised and destroyed after them.
    direct: OnceLock<Result<DirectStream>>,
    /// cubecl's device service, for non-blocking submissions to its server.
    device: cubecl::device_handle::DeviceHandle<Server>,
}

/// A non-blocking stream of the primary context, synchronised and destroyed with its owner.
struct DirectStream {
    stream: sys::CUstream,
    primary: Arc<PrimaryContext>,
}

// SAFETY: a CUstream is a driver handle that the driver accepts from any thread; enqueues on
// one stream from several threads are serialised by the driver.
unsafe impl Send for DirectStream {}
// SAFETY: see `Send`.
unsafe impl Sync for DirectStream {}

impl DirectStream {
    fn new(primary: &Arc<PrimaryContext>) -> Result<Self> {
        primary.make_current()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| setup("cuStreamCreate", e))?;
        Ok(Self {
            stream,
            primary: primary.clone(),
        })
    }

    fn synchronize(&self) -> Result<()> {
        self.primary.make_current()?;
        // SAFETY: the stream lives as long as `self`.
        unsafe { result::stream::synchronize(self.stream) }
            .map_err(|e| device_fault("cuStreamSynchronize", e))
    }
}

impl Drop for DirectStream {
    fn drop(&mut self) {
        // Every copy enqueued here completes before the stream goes.
        if self.synchronize().is_ok() {
            // SAFETY: last owner of the stream.
            let _ = unsafe { result::stream::destroy(self.stream) };
        }
    }
}

impl CudaTransfer {
    fn new(ctx: &CudaContext) -> Result<Self> {
        use cubecl::device::Device as _;
        Ok(Self {
            primary: PrimaryContext::retain(ctx.device.index)?,
            waiters: Mutex::new(HashMap::new()),
            direct: OnceLock::new(),
            device: cubecl::device_handle::DeviceHandle::new(ctx.device.to_id()),
        })
    }

    fn send(&self, stream: StreamId, job: Job) -> Result<()> {
        let mut waiters = self.waiters.lock();
        let waiter = match waiters.entry(stream.value) {
            hashbrown::hash_map::Entry::Occupied(w) => w.into_mut(),
            hashbrown::hash_map::Entry::Vacant(slot) => {
                let (jobs, queue) = channel::<Job>();
                let primary = self.primary.clone();
                let thread = std::thread::Builder::new()
                    .name(format!("fusion-streams-cuda-transfer-{}", stream.value))
                    .spawn(move || run_waiter(primary, queue))
                    .map_err(|e| {
                        Error::Runtime(format!("spawning a transfer waiter: {e}").into())
                    })?;
                slot.insert(Waiter {
                    jobs: Some(jobs),
                    thread: Some(thread),
                })
            }
        };
        waiter
            .jobs
            .as_ref()
            .expect("a live waiter has its sender")
            .send(job)
            .map_err(|_| Error::Runtime("the transfer waiter is gone".into()))
    }
}

fn run_waiter(primary: Arc<PrimaryContext>, queue: std::sync::mpsc::Receiver<Job>) {
    let stream = primary.make_current().and_then(|()| {
        result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| setup("cuStreamCreate", e))
    });
    for job in queue {
        match job {
            Job::Barrier(event) => {
                let outcome = match &stream {
                    // SAFETY: the stream belongs to this thread.
                    Ok(s) => unsafe { result::stream::synchronize(*s) }
                        .map_err(|e| device_fault("cuStreamSynchronize", e)),
                    Err(e) => Err(e.clone()),
                };
                event.set(State::Done(outcome));
            }
            Job::Frontier { parts, event } => {
                let mut early = None;
                spin_until(|| {
                    early = parts.try_recv().ok();
                    early.is_some()
                });
                let received = match early {
                    Some(parts) => Ok(parts),
                    None => parts.recv(),
                };
                let outcome = match received {
                    Ok((resolved, fences)) => {
                        // Every fence is polled to completion (an unpolled one leaks its event).
                        let mut outcome = Ok(());
                        for fence in fences {
                            let waited = cubecl::future::block_on(fence)
                                .map_err(|e| device_fault("fence", e));
                            outcome = outcome.and(waited);
                        }
                        outcome.and_then(|()| {
                            *event.0.resolved.lock() = Some(resolved?);
                            Ok(())
                        })
                    }
                    Err(_) => Err(Error::Runtime(
                        "cubecl's server dropped the frontier request".into(),
                    )),
                };
                event.set(State::Done(outcome));
            }
            Job::Download {
                handle,
                frontier,
                dst,
                bytes,
                event,
            } => {
                let copy_stream = stream.as_ref().map_err(Clone::clone);
                let enqueued = frontier
                    .wait()
                    .and_then(|()| enqueue_copy(&primary, copy_stream?, &frontier, &*dst, bytes));
                match enqueued {
                    Ok((cuda_event, resource)) => event.set(State::Enqueued {
                        event: cuda_event,
                        keep: Box::new((handle, resource, dst)),
                    }),
                    Err(error) => event.set(State::Done(Err(error))),
                }
            }
        }
    }
    // Teardown: every copy this waiter enqueued completes before its stream goes.
    if let Ok(copy_stream) = stream {
        // SAFETY: the stream was created by this thread and is destroyed once.
        unsafe {
            let _ = result::stream::synchronize(copy_stream);
            let _ = result::stream::destroy(copy_stream);
        }
    }
}

/// Enqueue the copy of a reached frontier's value into `dst` on `copy_stream`, and record its
/// event. Returns the event and the cubecl resource that must outlive the copy.
fn enqueue_copy(
    primary: &PrimaryContext,
    copy_stream: &sys::CUstream,
    frontier: &CudaEvent,
    dst: &dyn PinnedMemory,
    bytes: usize,
) -> Result<(sys::CUevent, Arc<dyn Any + Send + Sync>)> {
    let (source, resource) = frontier
        .0
        .resolved
        .lock()
        .clone()
        .ok_or_else(|| Error::Runtime("frontier without an address".into()))?;
    primary.make_current()?;
    // SAFETY: `source` is a live device allocation of at least `bytes` bytes (kept alive by the
    // caller's handle and `resource`, held until the copy's event completes); `dst` is host
    // memory of `bytes` bytes owned by the download until then; `copy_stream` is a live stream
    // of the primary context, and the driver accepts enqueues on it from any thread.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_ptr().cast(), source, bytes, *copy_stream) }
        .result()
        .map_err(|e| device_fault("cuMemcpyDtoHAsync", e))?;
    let cuda_event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .map_err(|e| setup("cuEventCreate", e))?;
    // SAFETY: both handles are live in the current (primary) context.
    if let Err(e) = unsafe { result::event::record(cuda_event, *copy_stream) } {
        // SAFETY: created just above, never shared.
        let _ = unsafe { result::event::destroy(cuda_event) };
        return Err(device_fault("cuEventRecord", e));
    }
    Ok((cuda_event, resource))
}

impl CudaTransfer {
    /// Wait until every waiter has handled its jobs so far and finished its copies.
    fn barrier(&self) -> Result<()> {
        let streams: Vec<u64> = self.waiters.lock().keys().copied().collect();
        for stream in streams {
            let event = CudaEvent::pending(&self.primary);
            self.send(StreamId { value: stream }, Job::Barrier(event.clone()))?;
            event.wait()?;
        }
        if let Some(Ok(direct)) = self.direct.get() {
            direct.synchronize()?;
        }
        Ok(())
    }

    fn direct(&self) -> Result<&DirectStream> {
        self.direct
            .get_or_init(|| DirectStream::new(&self.primary))
            .as_ref()
            .map_err(Clone::clone)
    }
}

impl CudaContext {
    /// Wait for the transfer waiters (if any) and release completed retirement records.
    pub(crate) fn settle_transfers(&self) -> Result<()> {
        if let Some(transfer) = self.transfer.get() {
            transfer.barrier()?;
        }
        self.retirement.sweep();
        Ok(())
    }

    fn transfer(&self) -> Result<&CudaTransfer> {
        if let Some(t) = self.transfer.get() {
            return Ok(t);
        }
        let t = CudaTransfer::new(self)?;
        Ok(self.transfer.get_or_init(|| t))
    }

    /// The retirement queue of dropped transfers.
    pub fn retirement(&self) -> &RetirementQueue<Retired<CudaRuntime>> {
        &self.retirement
    }
}

impl TransferRuntime for CudaRuntime {
    type Event = CudaEvent;

    fn publishable(dtype: DType) -> bool {
        matches!(dtype, DType::F32 | DType::I32)
    }

    fn record_frontier(
        ctx: &CudaContext,
        stream: StreamId,
        handle: &CudaHandle,
    ) -> Result<CudaEvent> {
        let transfer = ctx.transfer()?;
        let event = CudaEvent::pending(&transfer.primary);
        let (parts_tx, parts) = channel();
        let created_on = handle.handle.stream;
        let binding = handle.handle.clone().binding();
        // Runs on cubecl's server, in order after this thread's earlier submissions; does not
        // block the caller.
        transfer.device.submit(move |server: &mut Server| {
            use cubecl::server::ComputeServer;
            let resolved: Resolved = server
                .get_resource(binding, created_on)
                .map(|resource| {
                    let ptr = resource.resource().ptr;
                    (
                        ptr,
                        Arc::new(Mutex::new(resource)) as Arc<dyn Any + Send + Sync>,
                    )
                })
                .map_err(|e| setup("get_resource", e));
            let mut fences = vec![server.sync(stream)];
            if created_on != stream {
                fences.push(server.sync(created_on));
            }
            let _ = parts_tx.send((resolved, fences));
        });
        transfer.device.flush_queue();
        transfer.send(
            stream,
            Job::Frontier {
                parts,
                event: event.clone(),
            },
        )?;
        Ok(event)
    }

    fn download(
        ctx: &CudaContext,
        stream: StreamId,
        handle: &CudaHandle,
        frontier: &CudaEvent,
        buffer: &PinnedHostBuffer,
        bytes: usize,
    ) -> Result<CudaEvent> {
        if bytes != buffer.len() {
            return Err(Error::BufferSize {
                expected: bytes,
                found: buffer.len(),
            });
        }
        let transfer = ctx.transfer()?;
        let event = CudaEvent::pending(&transfer.primary);
        if let Some(Ok(())) = frontier.poll() {
            // The frontier has been reached: nothing is left to order the copy after, so it is
            // enqueued here, with no hop through the stream's waiter.
            let dst = buffer.memory.clone();
            let (cuda_event, resource) = enqueue_copy(
                &transfer.primary,
                &transfer.direct()?.stream,
                frontier,
                &*dst,
                bytes,
            )?;
            event.set(State::Enqueued {
                event: cuda_event,
                keep: Box::new((handle.handle.clone(), resource, dst)),
            });
            return Ok(event);
        }
        transfer.send(
            stream,
            Job::Download {
                handle: handle.handle.clone(),
                frontier: frontier.clone(),
                dst: buffer.memory.clone(),
                bytes,
                event: event.clone(),
            },
        )?;
        Ok(event)
    }

    fn poll_event(event: &CudaEvent) -> Option<Result<()>> {
        event.poll()
    }

    fn wait_event(event: &CudaEvent) -> Result<()> {
        event.wait()
    }

    fn alloc_pinned(ctx: &CudaContext, len: usize) -> Result<PinnedHostBuffer> {
        PinnedHostBuffer::check_len(len)?;
        let primary = &ctx.transfer()?.primary;
        Ok(PinnedHostBuffer::from_memory(Arc::new(CudaPinned::new(
            primary, len,
        )?)))
    }

    fn retirement(ctx: &CudaContext) -> &RetirementQueue<Retired<Self>> {
        &ctx.retirement
    }
}

/// The context's slot for its transfer machinery, created with the first publication.
pub(crate) type TransferSlot = OnceLock<CudaTransfer>;
