//! [`BackendRuntime`]: the engine's runtime over any burn backend that speaks burn's IR.
//!
//! Handles are the backend's own [`BackendIr::Handle`]s, stored in the engine's per-stream
//! handle maps exactly as burn-fusion stores them; an alias is a clone of the handle, and the
//! backend's own primitives decide in-place reuse (NdArray and cubecl both refuse it while a
//! second owner of the buffer exists, which is what a view is).

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use burn_backend::{
    DType, Device as _, ExecutionError, Shape, StreamId, TensorData, TensorMetadata,
};
use burn_fusion::FusionRuntime;
use burn_ir::{TensorHandle, TensorIr};

use super::IrBackend;
use super::cross_stream::{StreamRules, rules_for};
use super::publication_routes::RETIREMENT_CAPACITY;

use crate::host::Unfused;
use crate::runtime::host::worker::Workers;
use crate::runtime::{
    BatchPlacement, Kernel, KernelInputs, Retired, RetirementQueue, StreamRuntime,
};
use crate::{Error, Result};

/// The engine's runtime over the burn backend `B`: its handles are `B`'s own handles, an alias
/// is a clone of one, and `B`'s operations decide in-place reuse on their primitives (NdArray and
/// cubecl refuse it while a second owner of the buffer, such as a view, exists).
pub struct BackendRuntime<B>(PhantomData<fn() -> B>);

impl<B> fmt::Debug for BackendRuntime<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BackendRuntime<{}>", std::any::type_name::<B>())
    }
}

impl<B: IrBackend> FusionRuntime for BackendRuntime<B> {
    type OptimizationState = ();
    type Optimization = Unfused;
    type FusionHandle = B::Handle;
    type FusionDevice = B::Device;

    fn fusers(_: B::Device) -> Vec<Box<dyn burn_fusion::OperationFuser<Unfused>>> {
        Vec::new()
    }
}

/// The per-device state of a [`BackendRuntime`]: the backend's device, the rules its streams
/// need for buffers that cross them (see `cross_stream`), and its transfers (see `transfer`).
pub struct BackendContext<B: IrBackend> {
    device: B::Device,
    rules: Option<Box<dyn StreamRules<B>>>,
    /// Whether a fuser was registered for `B` when the device was opened (read once: recording
    /// asks it per operation, see `ActivationOps::relu`).
    has_fuser: bool,
    /// Where a batch holding an operation that spreads over `B`'s thread pool runs (read once,
    /// see [`set_batch_placement`](super::set_batch_placement)).
    batch_placement: BatchPlacement,
    /// The softmax kernel registered for `B` when the device was opened (see
    /// [`register_softmax`](super::register_softmax)).
    softmax: Option<super::fuser_registry::SoftmaxKernel<B>>,
    // Dropped before the retirement queue: each transfer thread finishes its jobs and exits,
    // and the CUDA route's waiters and copy streams finish, first, so no record is released
    // while a copy may still use it.
    pub(crate) transfers: Workers,
    #[cfg(feature = "cuda")]
    pub(crate) cuda: Option<super::cuda::CudaRoute>,
    pub(crate) retirement: RetirementQueue<Retired<BackendRuntime<B>>>,
}

impl<B: IrBackend> BackendContext<B> {
    /// The backend's device.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Whether this device's streams get a fuser (registered for `B` when the device was
    /// opened; streams fuse while [`EngineConfig::fusion`](crate::EngineConfig::fusion) is on).
    pub fn has_fuser(&self) -> bool {
        self.has_fuser
    }

    /// The softmax kernel of this device's fusing streams, if one was registered for `B` when
    /// the device was opened ([`register_softmax`](super::register_softmax)).
    pub fn softmax_kernel(&self) -> Option<super::fuser_registry::SoftmaxKernel<B>> {
        self.softmax
    }

    /// The retirement queue of dropped transfers.
    pub fn retirement(&self) -> &RetirementQueue<Retired<BackendRuntime<B>>> {
        &self.retirement
    }
}

impl<B: IrBackend> fmt::Debug for BackendContext<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendContext")
            .field("device", &self.device)
            .field("cross_stream_rules", &self.rules.is_some())
            .finish()
    }
}

/// How a tensor of `dtype` is held by a burn backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TensorKind {
    Float,
    Int,
    Bool,
    Quantized,
}

impl TensorKind {
    pub(crate) fn of(dtype: DType) -> Self {
        match dtype {
            DType::QFloat(_) => TensorKind::Quantized,
            DType::Bool(_) => TensorKind::Bool,
            d if d.is_float() => TensorKind::Float,
            _ => TensorKind::Int,
        }
    }
}

/// A burn backend error as this crate's error.
pub(crate) fn execution_error(what: &str, error: ExecutionError) -> Error {
    Error::KernelFailed {
        kernel: what.into(),
        message: error.to_string().into(),
    }
}

/// This crate's error as burn's: the root cause's message.
pub(crate) fn to_execution_error(error: Error) -> ExecutionError {
    ExecutionError::WithContext {
        reason: error.to_string(),
    }
}

/// Wait for a backend future on the calling thread (burn's data futures are ready at once on
/// CPU backends, and resolve once the device has copied the data on GPU backends).
pub(crate) fn block_on<F: Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

/// A future whose every poll runs with [`StreamId::current`] set to `stream` (a backend's read
/// dispatches its copy on the current stream when first polled).
pub(crate) struct OnStream<F> {
    pub(crate) stream: StreamId,
    pub(crate) future: F,
}

impl<F: Future + Unpin> Future for OnStream<F> {
    type Output = F::Output;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        this.stream
            .executes(|| std::pin::Pin::new(&mut this.future).poll(cx))
    }
}

impl<B: IrBackend> BackendRuntime<B> {
    /// The backend primitive a handle of `dtype` and `shape` stands for, as a handle again (the
    /// identity on the handle; it checks the kind on backends that tag their handles).
    pub(crate) fn tensor_handle(handle: B::Handle, shape: Shape) -> TensorHandle<B::Handle> {
        TensorHandle { handle, shape }
    }

    /// The data of a handle (the backend's own read, awaited on this thread).
    pub(crate) fn into_data_future(handle: B::Handle, shape: Shape, dtype: DType) -> DataFuture {
        let t = Self::tensor_handle(handle, shape);
        // A backend whose device thread died panics on the caller's thread (cubecl 0.10 unwraps
        // its server's reply), when the read is asked for or when it is awaited: contained, as
        // the read's error.
        let future = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> DataFuture {
            match TensorKind::of(dtype) {
                TensorKind::Float => Box::pin(B::float_into_data(B::float_tensor(t))),
                TensorKind::Int => Box::pin(B::int_into_data(B::int_tensor(t))),
                TensorKind::Bool => Box::pin(B::bool_into_data(B::bool_tensor(t))),
                TensorKind::Quantized => Box::pin(B::q_into_data(B::quantized_tensor(t))),
            }
        }));
        match future {
            Ok(future) => Box::pin(Contained(future)),
            Err(payload) => Box::pin(std::future::ready(Err(read_panicked(payload)))),
        }
    }
}

/// A backend's data future, boxed.
pub(crate) type DataFuture =
    std::pin::Pin<Box<dyn Future<Output = Result<TensorData, ExecutionError>> + Send>>;

/// A read that panicked, as burn's error.
fn read_panicked(payload: Box<dyn std::any::Any + Send>) -> ExecutionError {
    to_execution_error(Error::from_kernel_panic("read", payload))
}

/// A data future whose panics are its error.
struct Contained(DataFuture);

impl Future for Contained {
    type Output = Result<TensorData, ExecutionError>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let future = &mut self.0;
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| future.as_mut().poll(cx)))
            .unwrap_or_else(|payload| Poll::Ready(Err(read_panicked(payload))))
    }
}

impl<B: IrBackend> StreamRuntime for BackendRuntime<B> {
    type Context = BackendContext<B>;

    fn name() -> &'static str {
        "burn backend"
    }

    fn open(device: &B::Device) -> Result<BackendContext<B>> {
        Ok(BackendContext {
            device: device.clone(),
            rules: rules_for::<B>(device),
            has_fuser: super::fuser_registry::has_fuser::<B>(),
            batch_placement: super::fuser_registry::batch_placement_for::<B>(),
            softmax: super::fuser_registry::softmax_for::<B>(),
            transfers: Workers::new(format!("publish{}", device.to_id().index_id)),
            #[cfg(feature = "cuda")]
            cuda: super::cuda::CudaRoute::for_backend::<B>(device),
            retirement: RetirementQueue::new(RETIREMENT_CAPACITY),
        })
    }

    fn batch_placement(ctx: &BackendContext<B>) -> BatchPlacement {
        ctx.batch_placement
    }

    fn upload(ctx: &BackendContext<B>, data: TensorData) -> Result<B::Handle> {
        let device = &ctx.device;
        // The backend panics on data it cannot hold: contained, as a typed error.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            match TensorKind::of(data.dtype) {
                TensorKind::Float => B::float_tensor_handle(B::float_from_data(data, device)),
                TensorKind::Int => B::int_tensor_handle(B::int_from_data(data, device)),
                TensorKind::Bool => B::bool_tensor_handle(B::bool_from_data(data, device)),
                TensorKind::Quantized => B::quantized_tensor_handle(B::q_from_data(data, device)),
            }
        }))
        .map_err(|payload| Error::from_kernel_panic("from_data", payload))
    }

    fn read(
        ctx: &BackendContext<B>,
        handle: &B::Handle,
        shape: &Shape,
        dtype: DType,
    ) -> Result<TensorData> {
        Self::read_owned(ctx, handle.clone(), shape, dtype)
    }

    fn read_owned(
        _ctx: &BackendContext<B>,
        handle: B::Handle,
        shape: &Shape,
        dtype: DType,
    ) -> Result<TensorData> {
        // The backend's own read of a primitive it may own alone (NdArray then hands its array
        // over instead of copying it).
        let future = Self::into_data_future(handle, shape.clone(), dtype);
        block_on(future).map_err(|e| execution_error("read", e))
    }

    fn fuser(ctx: &BackendContext<B>) -> Option<Box<dyn crate::runtime::Fuser<Self>>> {
        super::fuser_registry::fuser_for::<B>(&ctx.device)
    }

    fn can_mut(_handle: &B::Handle) -> bool {
        // The engine's built-in kernels never write in place on a burn backend: the backend's own
        // operations decide that on their primitives.
        false
    }

    fn foreign_to(ctx: &BackendContext<B>, handle: &B::Handle, stream: StreamId) -> bool {
        ctx.rules
            .as_ref()
            .is_some_and(|rules| rules.foreign_to(handle, stream))
    }

    fn has_foreign_buffers(ctx: &BackendContext<B>) -> bool {
        ctx.rules.is_some()
    }

    /// On a CubeCL CUDA device (the one whose streams need rules): half the machine's hardware
    /// threads. cubecl 0.10 hands every launch to the device's one thread, and threads that
    /// find its buffer full spin; on an H100 host's 16 hardware threads, bounds of 6 and 8 kept
    /// 16 MLP threads above one thread's back-to-back rate, 12 and 15 did not
    /// (`docs/BENCHMARKS.md`, "The launch gate").
    fn launching_threads(ctx: &BackendContext<B>) -> Option<usize> {
        ctx.rules.as_ref()?;
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        Some((threads / 2).max(1))
    }

    fn order_use(ctx: &BackendContext<B>, handle: &B::Handle, stream: StreamId) {
        if let Some(rules) = &ctx.rules {
            rules.order_use(handle, stream);
        }
    }

    fn release_after_use(ctx: &BackendContext<B>, stream: StreamId, handles: Vec<B::Handle>) {
        match &ctx.rules {
            Some(rules) => rules.release_after_use(stream, handles),
            None => drop(handles),
        }
    }

    fn synchronize(ctx: &BackendContext<B>) -> Result<()> {
        // Every stream of the device: cubecl synchronises one stream per call, and each thread's
        // work runs on its execution stream (`stream::exec`). As a read: a backend whose device
        // thread died panics here; contained.
        for stream in crate::stream::execution_streams() {
            let sync = || stream.executes(|| B::sync(&ctx.device));
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(sync))
                .map_err(|payload| Error::from_kernel_panic("sync", payload))?
                .map_err(|e| execution_error("sync", e))?;
        }
        // And the calling thread's own stream, which is cubecl's current one outside the engine.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| B::sync(&ctx.device)))
            .map_err(|payload| Error::from_kernel_panic("sync", payload))?
            .map_err(|e| execution_error("sync", e))?;
        for fence in ctx.transfers.fences() {
            fence.wait()?;
        }
        #[cfg(feature = "cuda")]
        if let Some(route) = &ctx.cuda {
            route.barrier()?;
        }
        ctx.retirement.sweep();
        Ok(())
    }

    fn supports(kernel: &Kernel, dtype: DType) -> bool {
        match kernel {
            Kernel::Add | Kernel::Mul | Kernel::Sum | Kernel::Fill(_) => {
                dtype.is_float() || dtype.is_int()
            }
            Kernel::Scale(_) | Kernel::Exp | Kernel::Matmul => dtype.is_float(),
            // A burn backend has no way to fail on its device on demand.
            #[cfg(feature = "testing")]
            Kernel::FailOnDevice => false,
        }
    }

    fn launch(
        ctx: &BackendContext<B>,
        kernel: &Kernel,
        mut inputs: KernelInputs<'_, B::Handle>,
        out: &TensorIr,
    ) -> Result<B::Handle> {
        let mut take = |i: usize| {
            let input = &mut inputs[i];
            Self::tensor_handle(input.handle.clone(), input.ir.shape.clone())
        };
        let float = out.dtype.is_float();
        Ok(match (kernel, float) {
            (Kernel::Add, true) => B::float_tensor_handle(B::float_add(
                B::float_tensor(take(0)),
                B::float_tensor(take(1)),
            )),
            (Kernel::Add, false) => {
                B::int_tensor_handle(B::int_add(B::int_tensor(take(0)), B::int_tensor(take(1))))
            }
            (Kernel::Mul, true) => B::float_tensor_handle(B::float_mul(
                B::float_tensor(take(0)),
                B::float_tensor(take(1)),
            )),
            (Kernel::Mul, false) => {
                B::int_tensor_handle(B::int_mul(B::int_tensor(take(0)), B::int_tensor(take(1))))
            }
            (Kernel::Scale(f), _) => {
                B::float_tensor_handle(B::float_mul_scalar(B::float_tensor(take(0)), (*f).into()))
            }
            (Kernel::Exp, _) => B::float_tensor_handle(B::float_exp(B::float_tensor(take(0)))),
            (Kernel::Sum, true) => B::float_tensor_handle(B::float_reshape(
                B::float_sum(B::float_tensor(take(0))),
                out.shape.clone(),
            )),
            (Kernel::Sum, false) => B::int_tensor_handle(B::int_reshape(
                B::int_sum(B::int_tensor(take(0))),
                out.shape.clone(),
            )),
            (Kernel::Matmul, _) => B::float_tensor_handle(B::float_matmul(
                B::float_tensor(take(0)),
                B::float_tensor(take(1)),
            )),
            (Kernel::Fill(v), true) => B::float_tensor_handle(B::float_full(
                out.shape.clone(),
                (*v).into(),
                &ctx.device,
                out.dtype.into(),
            )),
            (Kernel::Fill(v), false) => B::int_tensor_handle(B::int_full(
                out.shape.clone(),
                (*v as i64).into(),
                &ctx.device,
                out.dtype.into(),
            )),
            #[cfg(feature = "testing")]
            (Kernel::FailOnDevice, _) => {
                return Err(Error::UnsupportedDType {
                    op: kernel.name().into(),
                    dtype: out.dtype,
                });
            }
        })
    }
}

/// `FusionTensor`s are burn tensor primitives.
impl<R: StreamRuntime> TensorMetadata for crate::FusionTensor<R> {
    fn dtype(&self) -> DType {
        crate::FusionTensor::dtype(self)
    }

    fn shape(&self) -> Shape {
        // burn's tensor API asks for the shape on most operations (its checks, `dims`); the
        // derived `Clone` goes through `SmallVec`'s slow `extend`.
        crate::small::copy_shape(crate::FusionTensor::shape(self))
    }

    fn rank(&self) -> usize {
        crate::FusionTensor::shape(self).num_dims()
    }
}
