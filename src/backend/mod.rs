//! [`StreamFusion`]: a burn [`Backend`] whose operations are recorded on this crate's per-thread
//! streams, so burn code gets shared views, foreign drops and errors that travel with the data,
//! unchanged.
//!
//! `StreamFusion<B>` wraps any backend `B` that speaks burn's IR ([`BackendIr`]; every
//! `FusionBackend` does, and so does `burn-ndarray`). Its tensor primitives are
//! [`FusionTensor`](crate::FusionTensor)s over a [`BackendRuntime<B>`] whose handles are `B`'s own. Each operation
//! records burn's [`burn_ir::OperationIr`] and a function that runs `B`'s same-named operation on
//! the stream's handles, lazily, when the stream drains:
//!
//! * a tensor cloned, used or dropped on another thread goes through a shared view or a foreign
//!   drop, exactly as in the engine (see [`crate::MultiStream`]);
//! * `B`'s operation panicking is recorded on the outputs and surfaces from `into_data` as a
//!   burn [`ExecutionError`] with the root cause's message;
//! * `into_data` does its eager part at the call (drain the stream, take the handle) and returns
//!   `B`'s own future for the copy; `sync` drains the calling thread's stream, then runs `B::sync`.
//! * with the `cuda` feature, `StreamFusion<CubeBackend<CudaRuntime, ..>>` fuses each run of
//!   elementwise operations, and each matmul with the elementwise operations after it, into one
//!   kernel, through burn-cubecl-fusion's fusers (`cube_fuser`; switch it with
//!   [`crate::MultiStream::set_fusion`]; the reduce fusers are opt-in, see `FUSERS_ENV`). Other
//!   backends run operation by operation unless a fuser is registered for them
//!   ([`register_fuser`]).
//!
//! ```
//! use burn_backend::{Backend, TensorData, ops::FloatTensorOps};
//! use burn_ndarray::NdArray;
//! use fusion_streams::backend::StreamFusion;
//!
//! type B = StreamFusion<NdArray<f32>>;
//! let device = Default::default();
//! let x = B::float_from_data(TensorData::new(vec![1.0f32, 2.0], [2]), &device);
//! let y = B::float_exp(B::float_mul_scalar(x, 0.0.into())); // queued on this thread's stream
//! let moved = std::thread::spawn(move || B::float_add_scalar(y, 1.0.into())).join().unwrap();
//! let data = burn_backend::read_sync(B::float_into_data(moved)).unwrap();
//! assert_eq!(data.to_vec::<f32>().unwrap(), vec![2.0, 2.0]);
//! ```

mod bool;
mod cross_stream;
#[cfg(feature = "cuda")]
mod cube;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod float;
mod fuser_registry;
mod int;
pub(crate) mod macros;
mod module;
mod publication_routes;
mod qtensor;
pub(crate) mod record;
mod runtime;

use std::any::{Any, TypeId};
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use burn_backend::QTensorPrimitive;
use burn_backend::quantization::QuantScheme;
use burn_backend::tensor::Device;
use burn_backend::{
    Backend, BackendTypes, DType, DTypeUsageSet, Device as _, DeviceId, ExecutionError, TensorData,
};
use burn_ir::{BackendIr, TensorHandle};
use hashbrown::HashMap;
use parking_lot::Mutex;

pub use crate::runtime::BatchPlacement;
#[cfg(feature = "cuda")]
pub use cube::softmax as cube_softmax;
#[cfg(feature = "cuda")]
pub use cube::{
    CUT_SIGHTINGS_ENV, CubeStreamFuser, FOREIGN_CUT_SIGHTINGS_ENV, FUSERS_ENV,
    MIN_ELEMENTWISE_OPS_ENV, cube_fuser, cube_fuser_with,
};
pub use fuser_registry::{
    SoftmaxKernel, SoftmaxKind, register_fuser, register_softmax, set_batch_placement,
};
pub use publication_routes::{BackendEvent, BackendSource};
pub use record::Tensor;
pub use runtime::{BackendContext, BackendRuntime};

/// Test hook (features `cuda` and `testing`): the next DMA copy of a download fails right after
/// it was enqueued, as a failing `cuEventRecord` would. For this crate's own tests.
#[cfg(all(feature = "cuda", feature = "testing"))]
#[doc(hidden)]
pub fn fail_next_download_after_enqueue() {
    cuda::FAIL_NEXT_RECORD.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Test hook (features `cuda` and `testing`): a kernel that executes PTX `trap` on `device` —
/// a real device fault, after which the device's context (cubecl's included) is lost for the
/// rest of the process. Returns once the fault has happened. For this crate's own tests.
#[cfg(all(feature = "cuda", feature = "testing"))]
#[doc(hidden)]
pub fn trap_on_device(device: &cubecl::cuda::CudaDevice) -> crate::Result<()> {
    cuda::trap_on_device(device.index)
}

/// A [`HeldSession`] on a [`StreamFusion`] device: see [`StreamFusion::session`].
pub type Session<B> = HeldSession<BackendRuntime<B>>;
/// A value published from a [`Session`].
pub type Publication<B> = crate::transfer::SourcePublication<BackendRuntime<B>>;
/// A [`Publication`]'s copy into a [`PinnedHostBuffer`], in flight.
pub type Download<B> = crate::transfer::PendingDownload<BackendRuntime<B>>;
use runtime::{TensorKind, to_execution_error};

use crate::runtime::TransferRuntime;
use crate::stream::Entry;
use crate::transfer::{HeldSession, PinnedHostBuffer};
use crate::{EngineConfig, FusionClient};

/// A backend [`StreamFusion`] can wrap: one that speaks burn's IR ([`BackendIr`]) and whose
/// handles own what they point at (`'static`), as every burn backend's do. Implemented for
/// every such backend: there is nothing to implement.
pub trait IrBackend: BackendIr<Handle: 'static> {}

impl<B: BackendIr<Handle: 'static>> IrBackend for B {}

/// A burn backend over this crate's per-thread streams: see the [module docs](self).
pub struct StreamFusion<B>(PhantomData<fn() -> B>);

impl<B> Clone for StreamFusion<B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for StreamFusion<B> {}
impl<B> Default for StreamFusion<B> {
    fn default() -> Self {
        Self(PhantomData)
    }
}
impl<B> fmt::Debug for StreamFusion<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StreamFusion<{}>", std::any::type_name::<B>())
    }
}

/// The engines of every backend type and device opened so far. Nothing removes one: an engine
/// opened here serves the rest of the process, so its client is [`FusionClient::immortal`].
type Clients = Mutex<HashMap<(TypeId, DeviceId), Arc<dyn Any + Send + Sync>>>;

fn clients() -> &'static Clients {
    static CLIENTS: OnceLock<Clients> = OnceLock::new();
    CLIENTS.get_or_init(Default::default)
}

impl<B: IrBackend> StreamFusion<B> {
    /// The engine of `device`: one per backend type and device, opened on first use with the
    /// default [`EngineConfig`] (see [`StreamFusion::configure`]).
    pub fn client(device: &B::Device) -> FusionClient<BackendRuntime<B>> {
        let key = (TypeId::of::<B>(), device.to_id());
        let mut clients = clients().lock();
        let entry = clients.entry(key).or_insert_with(|| {
            let client = FusionClient::<BackendRuntime<B>>::new(device.clone())
                .expect("opening a burn backend device cannot fail");
            Arc::new(client.immortal())
        });
        entry
            .downcast_ref::<FusionClient<BackendRuntime<B>>>()
            .expect("one client type per key")
            .clone()
    }

    /// Open `device`'s engine with `config`, before its first use. Returns `false` (and changes
    /// nothing) if the engine was already open.
    pub fn configure(device: &B::Device, config: EngineConfig) -> bool {
        let key = (TypeId::of::<B>(), device.to_id());
        let mut clients = clients().lock();
        if clients.contains_key(&key) {
            return false;
        }
        let client = FusionClient::<BackendRuntime<B>>::with_config(device.clone(), config)
            .expect("opening a burn backend device cannot fail");
        clients.insert(key, Arc::new(client.immortal()));
        true
    }

    /// Hold the calling thread's stream of `device`'s engine, to publish values from it (see
    /// [`crate::transfer`]). One session per thread and device at a time.
    ///
    /// ```
    /// use burn_ndarray::NdArray;
    /// use burn_tensor::{Int, Tensor};
    /// use fusion_streams::backend::StreamFusion;
    ///
    /// type B = StreamFusion<NdArray<f32>>;
    /// let device = Default::default();
    /// let mut session = B::session(&device)?;
    /// let tokens = Tensor::<B, 1, Int>::arange(0..4, &device) * 2;
    /// // SAFETY: `tokens` was computed on this thread, whose stream the session holds.
    /// let publication = unsafe { session.publish(tokens) }?;
    /// let buffer = B::pinned_buffer(&device, publication.bytes())?;
    /// let (data, _buffer) = publication.download_into(buffer)?.wait_data()?;
    /// assert_eq!(data.to_vec::<i64>().unwrap(), vec![0, 2, 4, 6]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn session(device: &B::Device) -> crate::Result<Session<B>> {
        HeldSession::open(&Self::client(device))
    }

    /// A host buffer of `bytes` bytes for downloads from `device`, from the allocator its copies
    /// are fastest into. Allocating is expensive; reuse the buffer
    /// ([`PendingDownload::wait`](crate::transfer::PendingDownload::wait) hands it back).
    pub fn pinned_buffer(device: &B::Device, bytes: usize) -> crate::Result<PinnedHostBuffer> {
        BackendRuntime::<B>::alloc_pinned(Self::client(device).context(), bytes)
    }

    /// The wrapped backend's default quantization scheme (what burn's `Dispatch` backend offers
    /// under the same name; burn's backend test suite uses it).
    pub fn default_quant_scheme(_device: &B::Device) -> QuantScheme {
        <Tensor<B> as QTensorPrimitive>::default_scheme()
    }

    /// Upload host data to `device` (eager, as burn's `from_data`).
    pub(crate) fn upload(data: TensorData, device: &B::Device) -> Tensor<B> {
        Self::client(device)
            .from_data(data)
            .unwrap_or_else(|error| panic!("from_data: {error}"))
    }

    /// A tensor's data: the drain and the taking of its handle happen now, the copy in `B`'s
    /// future. An error recorded on the tensor is the future's error.
    pub(crate) fn download(
        tensor: Tensor<B>,
    ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
        let (shape, dtype) = (crate::small::copy_shape(tensor.shape()), tensor.dtype());
        // The engine ordered this thread's execution stream after the buffer's writes: the read
        // must run there, wherever the future is polled.
        let stream = crate::stream::execution_stream();
        let read = tensor
            .into_handle()
            .map(|handle| BackendRuntime::<B>::into_data_future(handle, shape, dtype));
        async move {
            match read {
                Ok(future) => runtime::OnStream { stream, future }.await,
                Err(error) => Err(to_execution_error(error)),
            }
        }
    }

    /// `tensor` on `device`: the same tensor if it is there already, otherwise `B`'s own copy of
    /// its (materialised) handle, registered on the current stream of `device`'s engine.
    pub(crate) fn move_to(tensor: Tensor<B>, device: &B::Device) -> Tensor<B> {
        if tensor.client().device() == device {
            return tensor;
        }
        let (shape, dtype) = (crate::small::copy_shape(tensor.shape()), tensor.dtype());
        let entry = match tensor.into_handle() {
            // The copy reads the source on the execution stream the engine ordered after the
            // source's writes (the same on both devices: it is the thread's).
            Ok(handle) => crate::stream::on_execution_stream(|| {
                let t = TensorHandle {
                    handle,
                    shape: shape.clone(),
                };
                Entry::Handle(match TensorKind::of(dtype) {
                    TensorKind::Float => {
                        B::float_tensor_handle(B::float_to_device(B::float_tensor(t), device))
                    }
                    TensorKind::Int => {
                        B::int_tensor_handle(B::int_to_device(B::int_tensor(t), device))
                    }
                    TensorKind::Bool => {
                        B::bool_tensor_handle(B::bool_to_device(B::bool_tensor(t), device))
                    }
                    TensorKind::Quantized => {
                        B::quantized_tensor_handle(B::q_to_device(B::quantized_tensor(t), device))
                    }
                })
            }),
            Err(error) => Entry::Failed(error),
        };
        Self::client(device).adopt(entry, shape, dtype)
    }
}

impl<B: IrBackend> BackendTypes for StreamFusion<B> {
    type Device = B::Device;
    type FloatTensorPrimitive = Tensor<B>;
    type FloatElem = B::FloatElem;
    type IntTensorPrimitive = Tensor<B>;
    type IntElem = B::IntElem;
    type BoolTensorPrimitive = Tensor<B>;
    type BoolElem = B::BoolElem;
    type QuantizedTensorPrimitive = Tensor<B>;
}

impl<B: IrBackend> Backend for StreamFusion<B> {
    fn name(device: &Self::Device) -> String {
        format!("stream-fusion<{}>", B::name(device))
    }

    fn seed(device: &Self::Device, seed: u64) {
        B::seed(device, seed);
    }

    /// Device-wide, as burn means it: every thread's queued work runs (an idle thread's too:
    /// a rayon worker's, say), and then the device finishes everything dispatched to it.
    fn sync(device: &Self::Device) -> Result<(), ExecutionError> {
        Self::client(device)
            .sync_device()
            .map_err(runtime::to_execution_error)
    }

    fn dtype_usage(device: &Self::Device, dtype: DType) -> DTypeUsageSet {
        B::dtype_usage(device, dtype)
    }

    fn device_count(type_id: u16) -> usize {
        B::device_count(type_id)
    }

    fn ad_enabled(_device: &Self::Device) -> bool {
        false
    }

    fn memory_cleanup(device: &Self::Device) {
        // cubecl cleans the pools of the current stream: this thread's work runs on its
        // execution stream.
        crate::stream::on_execution_stream(|| B::memory_cleanup(device));
    }
}

impl<B: IrBackend> burn_backend::ops::TransactionOps<Self> for StreamFusion<B> {}
/// Activations. burn's defaults write each as elementwise operations, which a fusing stream
/// fuses with the work around them; a backend may implement one its own way instead. NdArray's
/// ReLU is one clamp in place, where the default is a comparison and a masked fill into a new
/// array (on a small MLP that made `StreamFusion<NdArray>` 0.79 of plain NdArray:
/// `benches/per_op.rs ours|plain N mlp`). So ReLU records the backend's own `relu` as one
/// operation on a backend without a fuser (recorded as a custom operation named `relu`: burn's
/// IR has no ReLU), and the comparison and fill where the device's streams fuse (a fuser is
/// registered and fusion is on), as burn-fusion does.
///
/// Softmax is a reduction, a broadcast, another reduction and another broadcast (burn's default:
/// five operations; log-softmax six), which no default fuser takes as one kernel. Where the
/// device's streams fuse and a softmax kernel is registered for the backend
/// ([`register_softmax`]; the CUDA `CubeBackend`s come with `cube_softmax`), each is one
/// operation running that kernel; where they fuse and none is, burn's operations, for the
/// fusers; elsewhere one operation running the backend's own `softmax` or `log_softmax`. Each is
/// recorded as a custom operation named `softmax` or `log_softmax`. The other activations keep
/// burn's defaults: no backend this crate runs on implements them its own way.
impl<B: IrBackend> burn_backend::ops::ActivationOps<Self> for StreamFusion<B> {
    fn relu(tensor: record::Tensor<B>) -> record::Tensor<B> {
        use burn_backend::ops::FloatTensorOps;
        if fusing(&tensor) {
            let device = device_of(&tensor);
            let bool_dtype = burn_backend::get_device_settings::<Self>(&device).bool_dtype;
            let at_most_zero =
                Self::float_lower_equal_elem(tensor.clone(), 0f32.into(), bool_dtype);
            return Self::float_mask_fill(tensor, at_most_zero, 0f32.into());
        }
        record::unary(
            "relu",
            tensor,
            None,
            |ir| custom("relu", &ir.input, &ir.out),
            |ir, h| {
                use record::Take as _;
                let x = h.take_float::<B>(&ir.input);
                h.register_float_tensor::<B>(&ir.out.id, B::relu(x));
            },
        )
    }

    fn softmax(tensor: record::Tensor<B>, dim: usize) -> record::Tensor<B> {
        softmax_op(tensor, dim, SoftmaxKind::Softmax)
    }

    fn log_softmax(tensor: record::Tensor<B>, dim: usize) -> record::Tensor<B> {
        softmax_op(tensor, dim, SoftmaxKind::LogSoftmax)
    }
}

/// A softmax or log-softmax (see `ActivationOps` above): one operation running the registered
/// kernel, or burn's operations for the fusers, or one operation running the backend's own.
fn softmax_op<B: IrBackend>(
    tensor: record::Tensor<B>,
    dim: usize,
    kind: SoftmaxKind,
) -> record::Tensor<B> {
    use burn_backend::ops::FloatTensorOps;
    type S<B> = StreamFusion<B>;
    let kernel: SoftmaxKernel<B> = if fusing(&tensor) {
        match tensor.client().context().softmax_kernel() {
            Some(kernel) => kernel,
            None => {
                // burn's defaults, for the fusers.
                let max = S::<B>::float_max_dim(tensor.clone(), dim);
                let shifted = S::<B>::float_sub(tensor, max);
                return match kind {
                    SoftmaxKind::Softmax => {
                        let exp = S::<B>::float_exp(shifted);
                        let sum = S::<B>::float_sum_dim(exp.clone(), dim);
                        S::<B>::float_div(exp, sum)
                    }
                    SoftmaxKind::LogSoftmax => {
                        let exp = S::<B>::float_exp(shifted.clone());
                        let log_sum = S::<B>::float_log(S::<B>::float_sum_dim(exp, dim));
                        S::<B>::float_sub(shifted, log_sum)
                    }
                };
            }
        }
    } else {
        backend_softmax::<B>
    };
    /// The operation's IR, what it computes, and the kernel it runs.
    struct Softmax<B: IrBackend> {
        ir: burn_ir::DimOpIr,
        kind: SoftmaxKind,
        kernel: SoftmaxKernel<B>,
    }
    record::record_one(
        kind.name(),
        [tensor],
        |[x], id| Softmax::<B> {
            ir: burn_ir::DimOpIr::create(x, dim, id),
            kind,
            kernel,
        },
        |op| custom(op.kind.name(), &op.ir.input, &op.ir.out),
        |op, h| {
            use record::Take as _;
            let x = h.take_float::<B>(&op.ir.input);
            let out = (op.kernel)(x, op.ir.axis, op.kind);
            h.register_float_tensor::<B>(&op.ir.out.id, out);
        },
    )
}

/// The backend's own softmax or log-softmax.
fn backend_softmax<B: IrBackend>(
    tensor: burn_backend::tensor::FloatTensor<B>,
    dim: usize,
    kind: SoftmaxKind,
) -> burn_backend::tensor::FloatTensor<B> {
    match kind {
        SoftmaxKind::Softmax => B::softmax(tensor, dim),
        SoftmaxKind::LogSoftmax => B::log_softmax(tensor, dim),
    }
}

/// Whether `tensor`'s stream fuses: a fuser is registered for its device and fusion is on.
fn fusing<B: IrBackend>(tensor: &record::Tensor<B>) -> bool {
    let client = tensor.client();
    client.context().has_fuser() && client.streams().fusion_on()
}

/// A custom operation named `name`, of one input and one output (burn's IR has no such
/// operation).
fn custom(name: &str, input: &burn_ir::TensorIr, out: &burn_ir::TensorIr) -> burn_ir::OperationIr {
    burn_ir::OperationIr::Custom(burn_ir::CustomOpIr {
        id: name.into(),
        inputs: vec![input.clone()],
        outputs: vec![out.clone()],
    })
}

/// Quantized tensors carry their scheme in their dtype; the default scheme is the wrapped
/// backend's.
impl<B: IrBackend> QTensorPrimitive for Tensor<B> {
    fn scheme(&self) -> &QuantScheme {
        match &self.inner.dtype {
            DType::QFloat(scheme) => scheme,
            other => panic!("quantization scheme of a {other:?} tensor"),
        }
    }

    fn default_scheme() -> QuantScheme {
        <B::QuantizedTensorPrimitive as QTensorPrimitive>::default_scheme()
    }
}

/// The device of a tensor of this backend.
pub(crate) fn device_of<B: IrBackend>(tensor: &Tensor<B>) -> Device<StreamFusion<B>> {
    tensor.client().device().clone()
}
