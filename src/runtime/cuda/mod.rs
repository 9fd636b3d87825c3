//! The CUDA runtime; its public face, with the design notes, is [`crate::cuda`].

mod kernels;
pub(crate) mod transfer;

pub use transfer::{CudaEvent, CudaSource};

/// Bound of the device's retirement queue (drainable side).
const RETIREMENT_CAPACITY: usize = 256;

use std::fmt;

use burn_backend::{DType, Shape, StreamId, TensorData};
use burn_fusion::{FusionRuntime, OperationFuser};
use burn_ir::TensorIr;
use cubecl::Runtime;
pub use cubecl::cuda::CudaDevice;
use cubecl::cuda::CudaRuntime as CubeCuda;
use cubecl::prelude::{ArrayArg, ComputeClient, CubeCount, CubeDim};
use cubecl::server::Handle;

use crate::host::Unfused;
use crate::runtime::{Kernel, KernelInputs, StreamRuntime};
use crate::{Error, Result};

/// The cubecl client of the device.
pub type CudaClient = ComputeClient<CubeCuda>;

/// A device allocation of the CUDA runtime.
#[derive(Clone)]
pub struct CudaHandle {
    pub(crate) handle: Handle,
}

impl CudaHandle {
    /// The cubecl handle.
    ///
    /// # Safety
    ///
    /// cubecl's launch API writes any handle it is given as an output. The caller must not write
    /// the buffer through the returned handle (it may be aliased by views on other streams, read
    /// by pending operations, or published), and must order every access after the buffer's
    /// producer on the device side. See [`crate::FusionTensor::handle`].
    pub unsafe fn cubecl(&self) -> &Handle {
        &self.handle
    }

    /// The cubecl stream that allocated the buffer (cubecl orders other streams' accesses
    /// against this one).
    pub fn stream(&self) -> burn_backend::StreamId {
        self.handle.stream
    }
}

impl fmt::Debug for CudaHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaHandle")
            .field("stream", &self.handle.stream)
            .field("can_mut", &self.handle.can_mut())
            .finish()
    }
}

/// Per-client state of a CUDA device: its cubecl client, and the transfer machinery.
///
/// Dropping it (the last owner of the runtime: the last client, tensor or publication) first
/// waits for every cubecl stream this context dispatched to, then for the transfer streams, and
/// only then releases the retirement queue's records.
pub struct CudaContext {
    /// Tells contexts apart in the per-thread stream note (never reused, unlike an address).
    id: u64,
    /// The cubecl streams this context has dispatched work to: what `synchronize` and teardown
    /// wait for.
    streams: parking_lot::Mutex<hashbrown::HashSet<u64>>,
    device: CudaDevice,
    // Drop order: the transfer waiters finish their jobs and synchronise their copy streams
    // before the retirement queue releases its records and before the client goes.
    transfer: transfer::TransferSlot,
    retirement: crate::runtime::RetirementQueue<crate::runtime::Retired<CudaRuntime>>,
    client: CudaClient,
}

static NEXT_CONTEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

std::thread_local! {
    /// The (context, stream) this thread last noted: a plain `Cell`, so noting costs one
    /// thread-local read on the hot path.
    static NOTED: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

impl CudaContext {
    /// Remember that the current stream has work of this context.
    fn note_stream(&self) {
        let stream = StreamId::current().value;
        if NOTED.with(std::cell::Cell::get) == (self.id, stream) {
            return;
        }
        self.streams.lock().insert(stream);
        NOTED.with(|noted| noted.set((self.id, stream)));
    }

    /// Wait for everything dispatched so far on every stream this context used: fences are
    /// recorded on all of them first, then awaited, so the streams finish concurrently.
    fn sync_streams(&self) -> Result<()> {
        let streams: Vec<u64> = self.streams.lock().iter().copied().collect();
        let fences = streams
            .into_iter()
            .map(|value| {
                contained("synchronize", || {
                    StreamId { value }.executes(|| self.client.sync())
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut outcome = Ok(());
        // Every fence is awaited (an unpolled one leaks its event), the first failure reported.
        for fence in fences {
            let waited = contained("synchronize", || cubecl::future::block_on(fence))
                .and_then(|r| r.map_err(|e| device_error("synchronize", e)));
            outcome = outcome.and(waited);
        }
        outcome
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The cubecl client.
    pub fn client(&self) -> &CudaClient {
        &self.client
    }
}

impl Drop for CudaContext {
    fn drop(&mut self) {
        // Nothing can report an error from here; the streams are waited for all the same, so
        // the claim "dropping the last owner synchronises the device" holds.
        if let Err(error) = self.sync_streams() {
            tracing::warn!(%error, "synchronising the CUDA streams at teardown failed");
        }
    }
}

impl fmt::Debug for CudaContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaContext")
            .field("device", &self.device)
            .finish()
    }
}

/// The engine on an NVIDIA GPU through cubecl-cuda 0.10. See the [module docs](crate::cuda).
#[derive(Debug, Clone, Copy, Default)]
pub struct CudaRuntime;

impl CudaRuntime {
    /// Whether a CUDA driver and at least one device are present. Never panics (cubecl's client
    /// creation does when there is no driver), so callers can fall back to another runtime.
    pub fn is_available() -> bool {
        // SAFETY: loading a shared library runs its initialisers. This loads NVIDIA's driver
        // library by its standard names, the library cubecl itself loads for this runtime.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return false;
        }
        cudarc::driver::result::init().is_ok()
            && cudarc::driver::result::device::get_count().is_ok_and(|n| n > 0)
    }
}

impl FusionRuntime for CudaRuntime {
    type OptimizationState = ();
    type Optimization = Unfused;
    type FusionHandle = CudaHandle;
    type FusionDevice = CudaDevice;

    fn fusers(_: CudaDevice) -> Vec<Box<dyn OperationFuser<Unfused>>> {
        Vec::new()
    }
}

fn runtime_error(what: &str, error: impl fmt::Display) -> Error {
    Error::Runtime(format!("{what}: {error}").into())
}

fn device_error(kernel: &str, error: impl fmt::Display) -> Error {
    Error::KernelFailed {
        kernel: kernel.into(),
        message: error.to_string().into(),
    }
}

/// Run a cubecl call, turning a panic into [`Error::KernelFailed`].
fn contained<T>(what: &str, call: impl FnOnce() -> T) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(call))
        .map_err(|payload| Error::from_kernel_panic(what, payload))
}

/// An allocation of at least one element: cubecl does not hand out empty buffers.
fn empty(client: &CudaClient, bytes: usize) -> Handle {
    client.empty(bytes.max(4))
}

fn cubes(n: usize) -> CubeCount {
    // `n` fits in u32: `launch` refuses larger tensors first.
    CubeCount::Static((n as u32).div_ceil(kernels::BLOCK).max(1), 1, 1)
}

fn dim() -> CubeDim {
    CubeDim::new_1d(kernels::BLOCK)
}

fn array(handle: &Handle, len: usize) -> ArrayArg<CubeCuda> {
    // SAFETY: every handle passed here is an allocation of at least `len` elements of the
    // kernel's element type: operand handles hold tensors of the IR's shape and dtype (checked
    // at registration), outputs are allocated for the output's shape and dtype just before.
    unsafe { ArrayArg::from_raw_parts(handle.clone(), len) }
}

impl StreamRuntime for CudaRuntime {
    type Context = CudaContext;

    fn name() -> &'static str {
        "cuda"
    }

    fn open(device: &CudaDevice) -> Result<CudaContext> {
        let client = std::panic::catch_unwind(|| CubeCuda::client(device))
            .map_err(|_| Error::Runtime("could not open the CUDA device".into()))?;
        Ok(CudaContext {
            id: NEXT_CONTEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            streams: Default::default(),
            device: device.clone(),
            transfer: Default::default(),
            retirement: crate::runtime::RetirementQueue::new(RETIREMENT_CAPACITY),
            client,
        })
    }

    fn upload(ctx: &CudaContext, data: &TensorData) -> Result<CudaHandle> {
        if !matches!(data.dtype, DType::F32 | DType::I32) {
            return Err(Error::UnsupportedDType {
                op: "from_data".into(),
                dtype: data.dtype,
            });
        }
        ctx.note_stream();
        let handle = if data.bytes.is_empty() {
            empty(&ctx.client, 0)
        } else {
            ctx.client.create_from_slice(&data.bytes)
        };
        Ok(CudaHandle { handle })
    }

    fn read(
        ctx: &CudaContext,
        handle: &CudaHandle,
        shape: &Shape,
        dtype: DType,
    ) -> Result<TensorData> {
        // On the stream that allocated the buffer: every write of it was dispatched there, so
        // stream order puts the read after them, whatever cubecl's cross-stream alignment knows.
        // cubecl reports some device failures by panicking (on its server thread, or here):
        // either way the caller gets a typed error.
        let bytes = contained("read", || {
            handle
                .handle
                .stream
                .executes(|| ctx.client.read_one(handle.handle.clone()))
        })?
        .map_err(|e| device_error("read", e))?;
        let len = shape.num_elements() * dtype.size();
        if bytes.len() < len {
            return Err(runtime_error(
                "read",
                format!("{} bytes for a {len}-byte tensor", bytes.len()),
            ));
        }
        Ok(TensorData::from_bytes_vec(
            bytes[..len].to_vec(),
            shape.clone(),
            dtype,
        ))
    }

    fn can_mut(handle: &CudaHandle) -> bool {
        handle.handle.can_mut()
    }

    fn synchronize(ctx: &CudaContext) -> Result<()> {
        ctx.sync_streams()?;
        ctx.settle_transfers()
    }

    fn supports(kernel: &Kernel, dtype: DType) -> bool {
        match kernel {
            Kernel::Add | Kernel::Mul | Kernel::Sum | Kernel::Fill(_) => {
                matches!(dtype, DType::F32 | DType::I32)
            }
            Kernel::Scale(_) | Kernel::Exp | Kernel::Matmul => dtype == DType::F32,
            // A kernel that fails on cubecl's server after dispatch (see `kernels::exp`). It
            // leaves cubecl's server unhealthy for the process.
            #[cfg(feature = "testing")]
            Kernel::FailOnDevice => dtype == DType::F32,
        }
    }

    fn launch(
        ctx: &CudaContext,
        kernel: &Kernel,
        inputs: KernelInputs<'_, CudaHandle>,
        out: &TensorIr,
    ) -> Result<CudaHandle> {
        let client = &ctx.client;
        let n = out.shape.num_elements();
        // The kernels index with 32-bit positions.
        if let Some(big) = std::iter::once(n)
            .chain(inputs.iter().map(|i| i.ir.shape.num_elements()))
            .find(|len| u32::try_from(*len).is_err())
        {
            return Err(Error::ShapeMismatch {
                op: kernel.name().into(),
                detail: format!("{big} elements: the CUDA kernels index at most 2^32 - 1"),
            });
        }
        let bytes = n * out.dtype.size();
        ctx.note_stream();
        // Add, Mul, Scale and Exp have in-place variants: they write their handed-over first
        // input when it may be reused and was allocated on this stream (see the module docs).
        let in_place = matches!(
            kernel,
            Kernel::Add | Kernel::Mul | Kernel::Scale(_) | Kernel::Exp
        ) && crate::runtime::first_input_reusable::<Self>(&inputs, out)
            && inputs[0].handle.handle.stream == StreamId::current();
        let target = if in_place {
            inputs[0].handle.handle.clone()
        } else {
            empty(client, bytes)
        };
        let input = |i: usize| array(&inputs[i].handle.handle, inputs[i].ir.shape.num_elements());
        let o = || array(&target, n);
        // `launch!(name::<generics>; args)`: the kernel over `n` elements, one thread each.
        macro_rules! launch {
            ($name:ident $(::<$($g:ty),*>)?; $($arg:expr),* $(,)?) => {
                kernels::$name::launch::<$($($g,)*)? CubeCuda>(client, cubes(n), dim(), $($arg),*)
            };
        }
        // `numeric!(|T| body)`: the body with `T` the output's element type (f32 or i32).
        macro_rules! numeric {
            (|$t:ident| $body:expr) => {
                match out.dtype {
                    DType::F32 => {
                        type $t = f32;
                        $body
                    }
                    DType::I32 => {
                        type $t = i32;
                        $body
                    }
                    other => {
                        return Err(Error::UnsupportedDType {
                            op: kernel.name().into(),
                            dtype: other,
                        });
                    }
                }
            };
        }

        // The launch table: one row per kernel and placement.
        match (kernel, in_place) {
            (Kernel::Add, true) => numeric!(|T| launch!(add_in_place_kernel::<T>; o(), input(1))),
            (Kernel::Add, false) => numeric!(|T| launch!(add_kernel::<T>; input(0), input(1), o())),
            (Kernel::Mul, true) => numeric!(|T| launch!(mul_in_place_kernel::<T>; o(), input(1))),
            (Kernel::Mul, false) => numeric!(|T| launch!(mul_kernel::<T>; input(0), input(1), o())),
            (Kernel::Scale(f), true) => launch!(scale_in_place_kernel; o(), *f as f32),
            (Kernel::Scale(f), false) => launch!(scale_kernel; input(0), o(), *f as f32),
            (Kernel::Exp, true) => launch!(exp_in_place_kernel; o()),
            (Kernel::Exp, false) => launch!(exp_kernel; input(0), o()),
            // One thread sums in the host runtime's order, so results agree bit for bit.
            (Kernel::Sum, _) => numeric!(|T| kernels::sum_kernel::launch::<T, CubeCuda>(
                client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                input(0),
                array(&target, 1),
            )),
            (Kernel::Matmul, _) => {
                let (k, cols) = (inputs[0].ir.shape[1] as u32, out.shape[1] as u32);
                launch!(matmul_kernel; input(0), input(1), o(), k, cols)
            }
            (Kernel::Fill(value), _) => numeric!(|T| launch!(fill_kernel::<T>; o(), *value as f32)),
            #[cfg(feature = "testing")]
            (Kernel::FailOnDevice, _) => launch!(exp; input(0), o()),
        }
        Ok(CudaHandle { handle: target })
    }
}
