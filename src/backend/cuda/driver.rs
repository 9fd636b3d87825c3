//! The CUDA driver calls of the transfer path, each behind an owning type: the device's primary
//! context, page-locked host memory, a non-blocking stream, and the copy enqueue.
//!
//! cudarc's safe layer (`cudarc::driver::safe`) wraps the same calls, but owns its own context
//! object and binds events and streams to it; cubecl 0.10 keeps its own, so this module uses
//! cudarc's thin `result` layer and gives each raw handle exactly one owner instead.

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::{result, sys};

use crate::runtime::PinnedMemory;
use crate::{Error, Result};

/// A driver call that sets something up (a context, a stream, an event, memory) failed: a
/// [`Error::Runtime`] naming the call. No kernel was involved.
pub(super) fn setup(call: &str, error: impl fmt::Debug) -> Error {
    Error::Runtime(format!("{call} failed: {error:?}").into())
}

/// A driver call that waits on, or enqueues behind, device work failed. CUDA reports an earlier
/// kernel's fault (a sticky context error) at the next such call, so it is the device failing:
/// [`Error::KernelFailed`], under the call's name.
pub(super) fn device_fault(call: &str, error: impl fmt::Debug) -> Error {
    Error::KernelFailed {
        kernel: call.into(),
        message: format!("{error:?}").into(),
    }
}

/// The device's primary context, retained while memory, streams or events of this crate may use
/// it.
pub(super) struct PrimaryContext {
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
    pub(super) fn retain(ordinal: usize) -> Result<Arc<Self>> {
        result::init().map_err(|e| setup("cuInit", e))?;
        let device = result::device::get(ordinal as i32).map_err(|e| setup("cuDeviceGet", e))?;
        // SAFETY: `device` is a valid device handle just returned by the driver.
        let context = unsafe { result::primary_ctx::retain(device) }
            .map_err(|e| setup("cuDevicePrimaryCtxRetain", e))?;
        Ok(Arc::new(Self { context, device }))
    }

    /// Make the primary context current on this thread (once per thread).
    pub(super) fn make_current(&self) -> Result<()> {
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
pub(super) struct CudaPinned {
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
    pub(super) fn new(primary: &Arc<PrimaryContext>, len: usize) -> Result<Self> {
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
    fn page_locked(&self) -> bool {
        true
    }
}

/// A non-blocking stream of the primary context, owned: every copy enqueued on it completes
/// before it is destroyed.
pub(super) struct OwnedStream {
    stream: sys::CUstream,
    primary: Arc<PrimaryContext>,
}

// SAFETY: a CUstream is a driver handle that the driver accepts from any thread; enqueues on
// one stream from several threads are serialised by the driver.
unsafe impl Send for OwnedStream {}
// SAFETY: see `Send`.
unsafe impl Sync for OwnedStream {}

impl OwnedStream {
    pub(super) fn new(primary: &Arc<PrimaryContext>) -> Result<Self> {
        Self::create(primary, || {
            result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(|e| setup("cuStreamCreate", e))
        })
    }

    /// A stream of the context's greatest priority: the device schedules its blocks before any
    /// waiting block of a stream of lower priority.
    #[cfg(feature = "testing")]
    fn urgent(primary: &Arc<PrimaryContext>) -> Result<Self> {
        Self::create(primary, || {
            let (_, greatest) = result::stream::get_priority_range()
                .map_err(|e| setup("cuCtxGetStreamPriorityRange", e))?;
            let kind = result::stream::StreamKind::NonBlocking;
            result::stream::create_with_priority(kind, greatest)
                .map_err(|e| setup("cuStreamCreateWithPriority", e))
        })
    }

    /// A stream made by `create` with `primary` current.
    fn create(
        primary: &Arc<PrimaryContext>,
        create: impl FnOnce() -> Result<sys::CUstream>,
    ) -> Result<Self> {
        primary.make_current()?;
        Ok(Self {
            stream: create()?,
            primary: primary.clone(),
        })
    }

    /// Wait for every copy enqueued so far.
    pub(super) fn synchronize(&self) -> Result<()> {
        self.primary.make_current()?;
        // SAFETY: the stream lives as long as `self`.
        unsafe { result::stream::synchronize(self.stream) }
            .map_err(|e| device_fault("cuStreamSynchronize", e))
    }

    /// Enqueue a copy of `dst.len()` bytes from the device address `source` into `dst`, and
    /// record an event behind it.
    ///
    /// An error means no copy can still write `dst`: the event is created before anything is
    /// enqueued, and a failure once the copy may have been enqueued (the enqueue reporting an
    /// error, or the event's record failing) waits for this stream before returning, so the
    /// caller can hand `dst` back at once.
    ///
    /// # Safety
    ///
    /// `source` must be a live device allocation of at least `dst.len()` bytes, and both it and
    /// `dst` must stay allocated, and `dst` untouched by anyone else, until the returned event
    /// has completed.
    pub(super) unsafe fn copy_to_host(
        &self,
        source: u64,
        dst: &dyn PinnedMemory,
    ) -> Result<sys::CUevent> {
        self.primary.make_current()?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| setup("cuEventCreate", e))?;
        // SAFETY: the caller's contract covers both buffers; the stream is live in the current
        // (primary) context, and the driver accepts enqueues on it from any thread.
        let enqueued = unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_ptr().cast(), source, dst.len(), self.stream)
        }
        .result()
        .map_err(|e| device_fault("cuMemcpyDtoHAsync", e));
        let recorded = enqueued.and_then(|()| {
            #[cfg(feature = "testing")]
            if FAIL_NEXT_RECORD.swap(false, std::sync::atomic::Ordering::SeqCst) {
                return Err(device_fault("cuEventRecord", "injected by the test hook"));
            }
            // SAFETY: both handles are live in the current (primary) context.
            unsafe { result::event::record(event, self.stream) }
                .map_err(|e| device_fault("cuEventRecord", e))
        });
        if let Err(error) = recorded {
            // The copy may be in flight: nothing is handed back before it has finished. (A
            // failed wait means the context is lost, and with it every copy on it.)
            let _ = self.synchronize();
            // SAFETY: created above, never recorded or shared.
            let _ = unsafe { result::event::destroy(event) };
            return Err(error);
        }
        Ok(event)
    }
}

/// Test hook: the next [`OwnedStream::copy_to_host`] fails after its copy was enqueued, as a
/// failing `cuEventRecord` would.
#[cfg(feature = "testing")]
pub(crate) static FAIL_NEXT_RECORD: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

impl Drop for OwnedStream {
    fn drop(&mut self) {
        // Every copy enqueued here completes before the stream goes.
        if self.synchronize().is_ok() {
            // SAFETY: last owner of the stream.
            let _ = unsafe { result::stream::destroy(self.stream) };
        }
    }
}

/// Test hook: run a kernel that executes PTX `trap` on device `ordinal`, and return once it has
/// faulted. A real device fault: the driver marks the device's primary context lost, so every
/// later wait on that context (cubecl's fences included) reports it, for the rest of the
/// process.
#[cfg(feature = "testing")]
pub(crate) fn trap_on_device(ordinal: usize) -> Result<()> {
    const PTX: &std::ffi::CStr = c".version 7.0
.target sm_70
.address_size 64
.visible .entry fusion_streams_trap()
{
    trap;
}
";
    let primary = PrimaryContext::retain(ordinal)?;
    primary.make_current()?;
    // SAFETY: a NUL-terminated PTX image; the primary context is current.
    let module = unsafe { result::module::load_data(PTX.as_ptr().cast()) }
        .map_err(|e| setup("cuModuleLoadData", e))?;
    // SAFETY: `module` was just loaded and is never unloaded (the context is lost anyway).
    let function = unsafe { result::module::get_function(module, c"fusion_streams_trap".into()) }
        .map_err(|e| setup("cuModuleGetFunction", e))?;
    // At the greatest priority, so that the fault comes while the work already queued on the
    // device's other streams still runs (at the default priority it could wait for all of it;
    // seen once on an H100: the publication's producer finished first).
    let stream = OwnedStream::urgent(&primary)?;
    // SAFETY: the kernel takes no parameters and touches no memory.
    unsafe { result::launch_kernel(function, (1, 1, 1), (1, 1, 1), 0, stream.stream, &mut []) }
        .map_err(|e| setup("cuLaunchKernel", e))?;
    match stream.synchronize() {
        Err(_) => Ok(()),
        Ok(()) => Err(Error::Runtime("the trap kernel did not fault".into())),
    }
}
