//! The user API: [`FusionClient`] (a device's engine, and the calls a framework makes into it),
//! [`FusionTensor`], and the built-in operations.
//!
//! A tensor holds its client and a client makes tensors, so the two live in one module; below
//! it sit the engine ([`crate::stream`]) and what it queues ([`crate::operation`]), neither of
//! which imports anything from here.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use burn_backend::{DType, Shape, StreamId, TensorData};
use burn_ir::{CustomOpIr, OperationIr, TensorIr, TensorStatus};
use smallvec::SmallVec;

use crate::error::Rejected;
use crate::operation::{
    BurnOperation, CustomExecutor, CustomOperation, FallibleOperation, IntoQueued, WithRepr,
};
use crate::runtime::StreamRuntime;
use crate::small::{Arity, Gather, Many};
use crate::stream::{EngineConfig, EngineStats, Entry, MultiStream, in_engine};
use crate::{Error, Result};

mod counted;
mod ops;
mod tensor;

use counted::Counted;

pub use tensor::FusionTensor;

struct ClientInner<R: StreamRuntime> {
    // Field order is drop order: the engine (and the handles it holds) goes before the device.
    streams: Arc<MultiStream<R>>,
    context: Arc<R::Context>,
    device: R::FusionDevice,
    /// Streams on which a held session is open (see `transfer::HeldSession`).
    sessions: parking_lot::Mutex<hashbrown::HashSet<StreamId>>,
}

/// A device's engine: its streams, its handles, and the runtime that executes on it.
///
/// Cheap to clone (a reference count); every clone is the same engine. Tensors keep their client
/// alive. Dropping the last owner of the runtime context (the last client, tensor, or — with the
/// transfer module — publication) shuts the device down, waiting for in-flight work. The engines
/// of [`StreamFusion`](crate::backend::StreamFusion) are the exception: they stay open for the
/// rest of the process, and their clients and tensors count no owners at all, so threads
/// recording on one engine share no reference count.
///
/// ```
/// use fusion_streams::{FusionClient, host::{HostDevice, HostRuntime}};
/// use burn_backend::{DType, TensorData};
///
/// let client = FusionClient::<HostRuntime>::new(HostDevice::default())?;
/// let a = client.from_data(TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2]))?;
/// let b = client.fill([2, 2], 0.5, DType::F32)?;
/// let c = client.matmul(&a, &b)?;
/// assert_eq!(c.to_vec::<f32>()?, vec![1.5, 1.5, 3.5, 3.5]);
/// # Ok::<(), fusion_streams::Error>(())
/// ```
pub struct FusionClient<R: StreamRuntime> {
    inner: Counted<ClientInner<R>>,
}

impl<R: StreamRuntime> Clone for FusionClient<R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<R: StreamRuntime> fmt::Debug for FusionClient<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FusionClient")
            .field("runtime", &R::name())
            .field("device", &self.inner.device)
            .field("streams", &self.inner.streams)
            .finish()
    }
}

/// An operand of an operation: borrowed (read only) or handed over (the operation may consume it
/// and, when it was the last reference, reuse its buffer in place).
#[derive(Debug)]
pub enum Operand<'a, R: StreamRuntime> {
    /// Read the tensor; the caller keeps it.
    Read(&'a FusionTensor<R>),
    /// Hand the tensor to the operation.
    Consume(FusionTensor<R>),
}

impl<'a, R: StreamRuntime> From<&'a FusionTensor<R>> for Operand<'a, R> {
    fn from(tensor: &'a FusionTensor<R>) -> Self {
        Operand::Read(tensor)
    }
}

impl<R: StreamRuntime> From<FusionTensor<R>> for Operand<'_, R> {
    fn from(tensor: FusionTensor<R>) -> Self {
        Operand::Consume(tensor)
    }
}

impl<R: StreamRuntime> Operand<'_, R> {
    pub(crate) fn tensor(&self) -> &FusionTensor<R> {
        match self {
            Operand::Read(t) => t,
            Operand::Consume(t) => t,
        }
    }
}

/// An operand on its way into an operation: a tensor of the current stream, or a foreign one
/// that will be read through a view on the current stream under a reserved id.
enum Local<'a, R: StreamRuntime> {
    Borrowed(&'a FusionTensor<R>),
    Owned(FusionTensor<R>),
    /// Minted into a view (under `view`) only once the operation has been validated, so that a
    /// rejection hands back exactly what the caller gave.
    Foreign {
        source: Operand<'a, R>,
        view: burn_ir::TensorId,
    },
}

impl<'a, R: StreamRuntime> Local<'a, R> {
    fn new(operand: Operand<'a, R>, current: StreamId) -> Self {
        match operand {
            Operand::Read(t) if t.stream() == current => Local::Borrowed(t),
            Operand::Consume(t) if t.stream() == current => Local::Owned(t),
            source => Local::Foreign {
                source,
                view: crate::id::fresh_tensor_id(),
            },
        }
    }

    /// The operand as the operation records it. An owned tensor that is the last reference to its
    /// id is handed over `ReadWrite`; so is a foreign operand's view, which only the operation
    /// will own. Everything else is `ReadOnly`.
    #[inline(always)]
    fn ir(&self) -> TensorIr {
        match self {
            Local::Owned(t) if t.inner.count() == 1 => t.ir(TensorStatus::ReadWrite),
            Local::Owned(t) => t.ir(TensorStatus::ReadOnly),
            Local::Borrowed(t) => t.ir(TensorStatus::ReadOnly),
            Local::Foreign { source, view } => TensorIr {
                id: *view,
                ..source.tensor().ir(TensorStatus::ReadWrite)
            },
        }
    }

    /// What a rejection hands back: the tensor the caller handed over, if any, unchanged.
    fn into_returned(self) -> Option<FusionTensor<R>> {
        match self {
            Local::Owned(t)
            | Local::Foreign {
                source: Operand::Consume(t),
                ..
            } => Some(t),
            Local::Borrowed(_)
            | Local::Foreign {
                source: Operand::Read(_),
                ..
            } => None,
        }
    }

    /// The home of a local operand: the current stream.
    fn home(&self) -> Option<&Arc<crate::stream::StreamCell<R>>> {
        match self {
            Local::Borrowed(tensor) => Some(&tensor.inner.home),
            Local::Owned(tensor) => Some(&tensor.inner.home),
            Local::Foreign { .. } => None,
        }
    }

    /// The tensor the operation takes from the caller, if any: a local one handed over, or a
    /// foreign operand's view, minted here (materialising its source; a handed-over source is
    /// let go of).
    fn into_owned(self) -> Option<FusionTensor<R>> {
        match self {
            Local::Owned(tensor) => Some(tensor),
            Local::Borrowed(_) => None,
            Local::Foreign { source, view } => Some(Self::mint_view(source, view)),
        }
    }

    /// A foreign operand's view, minted under `view` (see [`Self::into_owned`]). Out of line:
    /// most operations have local operands only, and every recording path has a copy of
    /// `into_owned`.
    #[cold]
    #[inline(never)]
    fn mint_view(source: Operand<'a, R>, view: burn_ir::TensorId) -> FusionTensor<R> {
        source.tensor().share_as(view)
    }

    /// What a rejected operation hands back: the tensors the caller handed over, unchanged and
    /// in order, with `error`.
    #[cold]
    #[inline(never)]
    fn reject(locals: impl IntoIterator<Item = Self>, error: Error) -> Rejected<FusionTensor<R>> {
        let returned = locals
            .into_iter()
            .filter_map(Local::into_returned)
            .collect();
        Rejected { error, returned }
    }
}

/// Operands of one operation (most have one or two).
pub(crate) type Operands<'a, R> = SmallVec<[Operand<'a, R>; 2]>;

/// Hand back the tensors a rejected call took by value.
#[cold]
#[inline(never)]
pub(crate) fn hand_back<'a, R: StreamRuntime + 'a>(
    operands: impl IntoIterator<Item = Operand<'a, R>>,
    error: Error,
) -> Rejected<FusionTensor<R>> {
    let returned = operands
        .into_iter()
        .filter_map(|o| match o {
            Operand::Consume(t) => Some(t),
            Operand::Read(_) => None,
        })
        .collect();
    Rejected { error, returned }
}

/// The error for an operation `op` that declared `outputs` outputs where its caller gathers
/// another number.
#[cold]
#[inline(never)]
fn wrong_output_count(op: &str, outputs: usize) -> Error {
    Error::InvalidOperation {
        op: op.into(),
        detail: format!("{outputs} outputs, where its caller takes another number"),
    }
}

impl<R: StreamRuntime> FusionClient<R> {
    /// Open `device` with the default [`EngineConfig`].
    pub fn new(device: R::FusionDevice) -> Result<Self> {
        Self::with_config(device, EngineConfig::default())
    }

    /// Open `device` with `config`.
    pub fn with_config(device: R::FusionDevice, config: EngineConfig) -> Result<Self> {
        let context = Arc::new(R::open(&device)?);
        Ok(Self {
            inner: Counted::new(ClientInner {
                streams: MultiStream::new(config, context.clone()),
                context,
                device,
                sessions: Default::default(),
            }),
        })
    }

    /// The device this client runs on.
    pub fn device(&self) -> &R::FusionDevice {
        &self.inner.device
    }

    /// The runtime's per-device state (for runtime-specific calls).
    pub fn context(&self) -> &Arc<R::Context> {
        &self.inner.context
    }

    /// The multi-stream engine.
    pub fn streams(&self) -> &MultiStream<R> {
        &self.inner.streams
    }

    /// The backend stream the current thread's work runs on: its stream's kernels, its uploads,
    /// reads and syncs, and the waits that order a tensor from another thread before its use
    /// here.
    ///
    /// It is not the thread's own [`StreamId::current`]: each thread gets an id that a thread
    /// which exited gave back, so that a new thread lands on backend state (cubecl's per-stream
    /// memory pools) that is already warm, and the number of backend streams in use stays the
    /// number of threads alive at once. The engine's own streams are still named by the
    /// thread's id ([`FusionTensor::stream`], [`crate::MultiStream::pending`]).
    ///
    /// Backend code that uses a tensor's handle ([`FusionTensor::handle`]) outside the engine
    /// runs under it (`client.execution_stream().executes(|| ...)`) to be ordered after the
    /// tensor's producer as the engine's own reads are.
    ///
    /// ```
    /// # use fusion_streams::{FusionClient, host::{HostDevice, HostRuntime}};
    /// # use fusion_streams::burn::StreamId;
    /// let client = FusionClient::<HostRuntime>::new(HostDevice::default()).unwrap();
    /// let exec = client.execution_stream();
    /// assert_ne!(exec, StreamId::current());
    /// assert_eq!(client.execution_stream(), exec, "the same for the thread's whole life");
    /// ```
    pub fn execution_stream(&self) -> StreamId {
        crate::stream::execution_stream()
    }

    /// What the engine did and what it holds.
    pub fn stats(&self) -> EngineStats {
        self.inner.streams.stats()
    }

    /// Record a held session on `stream`; refused if one is already open there.
    pub(crate) fn claim_session(&self, stream: StreamId) -> Result<()> {
        if self.inner.sessions.lock().insert(stream) {
            Ok(())
        } else {
            Err(Error::SessionHeld { stream })
        }
    }

    pub(crate) fn release_session(&self, stream: StreamId) {
        self.inner.sessions.lock().remove(&stream);
    }

    /// This client, its engine kept open for the rest of the process: neither it nor its clones
    /// (nor the tensors it makes) keep a count of the engine's owners, so recording an operation
    /// touches nothing that other threads recording on the engine touch too. For engines that
    /// are never closed, as [`crate::backend::StreamFusion`]'s are.
    pub(crate) fn immortal(self) -> Self {
        Self {
            inner: self.inner.immortal(),
        }
    }

    /// Whether two clients are the same engine.
    pub fn same_engine(&self, other: &Self) -> bool {
        self.inner.ptr_eq(&other.inner)
    }

    fn refuse_reentry(what: &'static str) -> Result<()> {
        if in_engine() {
            Err(Error::Reentrant { what })
        } else {
            Ok(())
        }
    }

    fn check_owner(&self, tensor: &FusionTensor<R>) -> Result<()> {
        if self.same_engine(tensor.client()) {
            Ok(())
        } else {
            Err(self.foreign_tensor(tensor))
        }
    }

    /// The error for `tensor` of another client: it names both devices, and says so when the
    /// two clients are on the same device (two engines, where the caller likely meant one).
    #[cold]
    #[inline(never)]
    pub(crate) fn foreign_tensor(&self, tensor: &FusionTensor<R>) -> Error {
        let (theirs, ours) = (tensor.client().device(), self.device());
        let detail = if theirs == ours {
            format!(
                "both on {ours:?}, but in two clients: each `FusionClient::new` opens its own \
                 engine; clone one client to share it"
            )
        } else {
            format!("tensor of {theirs:?}, operation on {ours:?}")
        };
        Error::DeviceMismatch {
            id: tensor.id(),
            detail,
        }
    }

    /// Create a tensor on the current stream from host data (copied to the device now).
    pub fn from_data(&self, data: TensorData) -> Result<FusionTensor<R>> {
        Self::refuse_reentry("FusionClient::from_data")?;
        let expected = self.check_size("host data", &data.shape, data.dtype)?;
        // Quantized data packs its values with its quantization parameters: its length is the
        // backend's to check.
        if !matches!(data.dtype, DType::QFloat(_)) && data.bytes.len() != expected {
            return Err(Error::InvalidData(format!(
                "{} bytes for shape {:?} of {:?} (expected {expected})",
                data.bytes.len(),
                &data.shape[..],
                data.dtype
            )));
        }
        let (shape, dtype) = (crate::small::copy_shape(&data.shape), data.dtype);
        // On the thread's execution stream, where its stream's work will use the buffer.
        let handle = {
            let _permit = crate::stream::enter_gate(self.inner.streams.launch_gate());
            crate::stream::on_execution_stream(|| R::upload(&self.inner.context, data))?
        };
        Ok(self.adopt(Entry::Handle(handle), shape, dtype))
    }

    /// A tensor of the current stream holding `entry` (a handle made outside the engine, or an
    /// error), under a fresh id.
    pub(crate) fn adopt(
        &self,
        entry: Entry<R::FusionHandle>,
        shape: Shape,
        dtype: DType,
    ) -> FusionTensor<R> {
        let id = crate::id::fresh_tensor_id();
        let home = self.inner.streams.register_entry(id, entry);
        FusionTensor::new(id, shape, dtype, home, self.clone())
    }

    /// Run the current stream's pending work (dispatch only, no device wait).
    pub fn drain(&self) {
        self.inner.streams.drain(crate::stream::current_stream());
    }

    /// Run the current stream's pending work and wait until the device has finished everything
    /// dispatched to it.
    ///
    /// Errors of individual operations are not reported here: they are on the tensors they
    /// affect. An error is returned only if the runtime itself fails.
    pub fn sync(&self) -> Result<()> {
        Self::refuse_reentry("FusionClient::sync")?;
        self.drain();
        crate::stream::on_execution_stream(|| R::synchronize(&self.inner.context))
    }

    /// Run every stream's pending work, every thread's, and wait until the device has finished
    /// everything dispatched to it: what burn's `Backend::sync` does on
    /// [`StreamFusion`](crate::backend::StreamFusion). Afterwards the engine holds only what
    /// live tensors hold ([`EngineStats::is_quiescent`](crate::EngineStats::is_quiescent) once
    /// every tensor is dropped), whatever threads queued work and went idle.
    ///
    /// Errors as [`FusionClient::sync`].
    pub fn sync_device(&self) -> Result<()> {
        Self::refuse_reentry("FusionClient::sync_device")?;
        self.inner.streams.drain_all();
        crate::stream::on_execution_stream(|| R::synchronize(&self.inner.context))
    }

    /// Start a custom operation named `name` (recorded as a burn [`CustomOpIr`]).
    pub fn op(&self, name: impl Into<Cow<'static, str>>) -> OpBuilder<'_, R> {
        OpBuilder {
            client: self,
            name: name.into(),
            operands: SmallVec::new(),
            outputs: SmallVec::new(),
        }
    }

    pub(crate) fn read_entry(
        &self,
        entry: Entry<R::FusionHandle>,
        shape: &Shape,
        dtype: DType,
    ) -> Result<TensorData> {
        match entry {
            // The wait for the device happens here, after the engine lock was released, on the
            // execution stream the engine ordered after the buffer's writes.
            Entry::Handle(handle) => crate::stream::on_execution_stream(|| {
                R::read_owned(&self.inner.context, handle, shape, dtype)
            }),
            Entry::Failed(error) => Err(error),
        }
    }

    /// Register an operation on the current stream.
    ///
    /// The steps, in order, each one a point where nothing is lost if it fails:
    ///
    /// 1. Refuse re-entrant calls and tensors of other clients, handing every operand back.
    /// 2. Decide each operand's IR without touching the engine: a local operand that is the last
    ///    reference to its id is `ReadWrite`, other local ones `ReadOnly`; a foreign operand gets a
    ///    reserved id for the view it will be read through (`ReadWrite`: only the operation owns
    ///    that view). `build` makes the operation from those IRs (user code, outside any lock),
    ///    minting a fresh id for each output; it may reject, and so may an output whose size is
    ///    impossible: the caller then gets back exactly the tensors it handed over, unchanged and
    ///    in order, and no view was minted.
    /// 3. Turn foreign operands into shared views under their reserved ids (outside any lock).
    /// 4. Commit the statuses (a `ReadWrite` operand is released to the operation) and record it
    ///    on the current stream (`MultiStream::record`: through the stream's lane, or under its
    ///    lock), where the consumed operands leave `shared_sources`.
    /// 5. Then drop the `ReadOnly` owned operands (a last drop now lands behind the operation
    ///    that reads them) and hand out the outputs. An output reuses the allocation of a
    ///    `ReadWrite` operand when there is one: a chain of consuming operations allocates no
    ///    tensor structs and touches no shared reference count.
    pub(crate) fn register<'a, A: Arity, B: IntoQueued<R>, O: Gather<FusionTensor<R>>>(
        &self,
        operands: A::List<Operand<'a, R>>,
        build: impl FnOnce(A::List<TensorIr>) -> Result<B>,
    ) -> Result<O, Rejected<FusionTensor<R>>> {
        // 1.
        let refused = Self::refuse_reentry("FusionClient::register").and_then(|()| {
            operands
                .as_ref()
                .iter()
                .try_for_each(|o| self.check_owner(o.tensor()))
        });
        if let Err(error) = refused {
            return Err(hand_back(operands, error));
        }

        // 2. The IRs move into the operation's body; the engine reads them there.
        let current = crate::stream::current_stream();
        let locals = A::map(operands, |o| Local::new(o, current));
        let built = build(A::map_ref(&locals, |local| local.ir())).and_then(|body| {
            let outputs = body.outputs();
            if !O::fits(outputs.len()) {
                return Err(wrong_output_count(body.name(), outputs.len()));
            }
            outputs
                .iter()
                .try_for_each(|out| {
                    self.check_size("an operation output", &out.shape, out.dtype)
                        .map(drop)
                })
                .map(|()| body)
        });
        let body = match built {
            Ok(body) => body,
            Err(error) => return Err(Local::reject(locals, error)),
        };

        // 3. (Most operations have local operands only: nothing to mint.)
        //
        // SAFETY: the home is a local operand's, and that operand's tensor outlives every use
        // of `home` below: a borrowed one is the caller's; an owned one stays in `owned` until
        // after the operation is recorded, unless step 4 recycles it into an output, which
        // keeps its home (it is this very cell) and is returned to the caller.
        let home = (locals.as_ref().iter().find_map(Local::home))
            .map(|cell| unsafe { crate::stream::CellRef::borrowed(cell) });
        let mut owned = A::map(locals, |local| local.into_owned());

        // 4. (An exiting thread records through the engine's general path.)
        let streams = &self.inner.streams;
        let Some(cell) = streams.recording_target(home, current) else {
            return Ok(self.register_exiting::<B, O>(home, current, body, owned.as_mut()));
        };
        let outputs = self.settle_operands::<O, B>(&body, &cell, owned.as_mut());
        streams.record(cell.cell(), body);

        // 5. The read-only owned operands (and consumed ones no output reused) go now.
        drop(owned);
        Ok(outputs)
    }

    /// Step 4 of [`Self::register`] on an exiting thread, through the engine's general path (the
    /// caller drops the owned operands after, as step 5). Out of line: a thread exits once, and
    /// every kind of operation has its own copy of `register`.
    #[cold]
    #[inline(never)]
    fn register_exiting<B: IntoQueued<R>, O: Gather<FusionTensor<R>>>(
        &self,
        home: Option<crate::stream::CellRef<R>>,
        current: StreamId,
        body: B,
        owned: &mut [Option<FusionTensor<R>>],
    ) -> O {
        let home = home.map(|cell| cell.to_arc());
        let home = home.as_ref().map(|cell| (cell, current));
        self.inner.streams.register(home, body, |cell, body| {
            let cell = crate::stream::Target::Found(cell.clone());
            self.settle_operands::<O, B>(body, &cell, owned)
        })
    }

    /// Step 4 of [`Self::register`] for the operation `body` recorded on `home`: each
    /// `ReadWrite` operand is released to the operation (its struct no longer frees the id),
    /// and the outputs are built, the last consumed operand's allocation going to the first
    /// output, and so on. Touches no stream state: the consumed operands leave
    /// `shared_sources` when the engine queues the operation (`StreamState::forget_consumed`).
    #[inline(always)]
    fn settle_operands<O: Gather<FusionTensor<R>>, B: crate::operation::OpBody<R>>(
        &self,
        body: &B,
        home: &crate::stream::Target<R>,
        owned: &mut [Option<FusionTensor<R>>],
    ) -> O {
        for (slot, ir) in owned.iter_mut().zip(body.inputs()) {
            if ir.status != TensorStatus::ReadWrite {
                continue;
            }
            if let Some(handed) = slot.as_mut().and_then(|t| t.inner.get_mut()) {
                // The operation owns the id now: this struct must not free it.
                handed.armed = false;
            }
        }
        let mut recycled = owned.iter_mut().rev().filter_map(|slot| {
            slot.take_if(|t| t.inner.get_mut().is_some_and(|handed| !handed.armed))
        });
        O::gather(
            body.outputs()
                .iter()
                .map(|out| self.output_tensor(out, home, recycled.next())),
        )
    }

    /// The byte length of a tensor of `shape` and `dtype`, if this runtime could ever hold it.
    #[inline]
    pub(crate) fn check_size(&self, what: &str, shape: &Shape, dtype: DType) -> Result<usize> {
        crate::size::tensor_bytes(
            what,
            crate::small::dims(shape),
            dtype,
            R::max_buffer_bytes(&self.inner.context),
        )
    }

    /// The tensor for output `out`: a consumed operand's allocation when there is one (updated in
    /// place, its shape kept when unchanged), a new one otherwise.
    #[inline(always)]
    fn output_tensor(
        &self,
        out: &TensorIr,
        home: &crate::stream::Target<R>,
        recycled: Option<FusionTensor<R>>,
    ) -> FusionTensor<R> {
        let Some(mut tensor) = recycled else {
            return FusionTensor::new(
                out.id,
                crate::small::copy_shape(&out.shape),
                out.dtype,
                home.to_arc(),
                self.clone(),
            );
        };
        let owned = tensor
            .inner
            .get_mut()
            .expect("consumed operands are unique");
        owned.armed = true;
        let inner = &mut owned.value;
        inner.id = out.id;
        inner.dtype = out.dtype;
        if !crate::small::same_dims(&inner.shape, &out.shape) {
            inner.shape = crate::small::copy_shape(&out.shape);
        }
        if !home.is(&inner.home) {
            inner.home = home.to_arc();
        }
        tensor
    }
}

/// Builder of a custom operation; see [`FusionClient::op`].
///
/// ```
/// use fusion_streams::{FusionClient, host::{HostDevice, HostRuntime}};
/// use burn_backend::{DType, TensorData};
///
/// let client = FusionClient::<HostRuntime>::new(HostDevice::default())?;
/// let x = client.from_data(TensorData::new(vec![1.0f32, 2.0], [2]))?;
/// // An identity op: the output aliases the input's buffer.
/// let out = client
///     .op("identity")
///     .read(&x)
///     .output([2], DType::F32)
///     .execute(|op: &burn_ir::CustomOpIr, handles: &mut burn_ir::HandleContainer<_>| {
///         let input = handles.get_handle(&op.inputs[0].id, &op.inputs[0].status);
///         handles.register_handle(op.outputs[0].id, input);
///         Ok(())
///     })
///     .map_err(|rejected| rejected.error)?;
/// assert_eq!(out[0].to_vec::<f32>()?, vec![1.0, 2.0]);
/// # Ok::<(), fusion_streams::Error>(())
/// ```
#[derive(Debug)]
pub struct OpBuilder<'a, R: StreamRuntime> {
    client: &'a FusionClient<R>,
    name: Cow<'static, str>,
    operands: Operands<'a, R>,
    outputs: SmallVec<[(Shape, DType); 1]>,
}

impl<'a, R: StreamRuntime> OpBuilder<'a, R> {
    /// Read `tensor`; the caller keeps it.
    pub fn read(mut self, tensor: &'a FusionTensor<R>) -> Self {
        self.operands.push(Operand::Read(tensor));
        self
    }

    /// Hand `tensor` to the operation. If it is the last reference to its id, the operation sees
    /// it as `ReadWrite` and may reuse its buffer in place.
    pub fn consume(mut self, tensor: FusionTensor<R>) -> Self {
        self.operands.push(Operand::Consume(tensor));
        self
    }

    /// Declare an output.
    pub fn output(mut self, shape: impl Into<Shape>, dtype: DType) -> Self {
        self.outputs.push((shape.into(), dtype));
        self
    }

    /// Queue the operation with a custom executor. Returns the outputs (not yet computed).
    pub fn execute<E: CustomExecutor<R>>(
        self,
        executor: E,
    ) -> Result<Vec<FusionTensor<R>>, Rejected<FusionTensor<R>>> {
        self.register(|name, inputs, outputs| {
            Ok(CustomOperation {
                ir: CustomOpIr {
                    id: name.into_owned(),
                    inputs: inputs.into_vec(),
                    outputs: outputs.into_vec(),
                },
                executor,
                _runtime: std::marker::PhantomData,
            })
        })
    }

    /// Queue a [`FallibleOperation`] recorded as the [`OperationIr`] it describes.
    ///
    /// `build` receives the operand IRs (with their statuses) and the output IRs (fresh ids) and
    /// returns the IR to record and the operation to run. The IR must name exactly those operands
    /// and outputs; anything else is rejected with [`Error::InvalidOperation`] and the operands
    /// handed back.
    pub fn execute_operation<O>(
        self,
        build: impl FnOnce(&[TensorIr], &[TensorIr]) -> (OperationIr, O),
    ) -> Result<Vec<FusionTensor<R>>, Rejected<FusionTensor<R>>>
    where
        O: FallibleOperation<R> + 'static,
    {
        self.register(|name, inputs, outputs| {
            let (repr, operation) = build(&inputs, &outputs);
            validate_repr(&name, &repr, &inputs, &outputs)?;
            Ok(WithRepr {
                name,
                repr,
                inputs,
                outputs,
                operation,
            })
        })
    }

    /// Queue a burn [`burn_fusion::stream::Operation`] through the [`BurnOperation`] adapter,
    /// built the way burn's own ops are; see [`OpBuilder::execute_operation`].
    pub fn execute_burn<O>(
        self,
        build: impl FnOnce(&[TensorIr], &[TensorIr]) -> (OperationIr, O),
    ) -> Result<Vec<FusionTensor<R>>, Rejected<FusionTensor<R>>>
    where
        O: burn_fusion::stream::Operation<R> + 'static,
    {
        self.execute_operation(|inputs, outputs| {
            let (repr, op) = build(inputs, outputs);
            (repr, BurnOperation(op))
        })
    }
    /// Register the operation `build` makes from this builder's name, the operand IRs and the
    /// declared outputs (under fresh ids).
    fn register<B: IntoQueued<R>>(
        self,
        build: impl FnOnce(
            Cow<'static, str>,
            SmallVec<[TensorIr; 2]>,
            SmallVec<[TensorIr; 1]>,
        ) -> Result<B>,
    ) -> Result<Vec<FusionTensor<R>>, Rejected<FusionTensor<R>>> {
        let (name, outputs) = (self.name, self.outputs);
        let build = move |inputs| build(name, inputs, fresh_outputs(outputs));
        self.client
            .register::<Many, _, SmallVec<_>>(self.operands, build)
            .map(SmallVec::into_vec)
    }
}

/// Output IRs for declared `(shape, dtype)` outputs, each under a fresh id.
pub(crate) fn fresh_outputs(outputs: SmallVec<[(Shape, DType); 1]>) -> SmallVec<[TensorIr; 1]> {
    crate::small::collect(outputs.into_iter().map(|(shape, dtype)| TensorIr {
        id: crate::id::fresh_tensor_id(),
        shape,
        status: TensorStatus::NotInit,
        dtype,
    }))
}

/// The recorded IR must name exactly the registered operands and outputs.
fn validate_repr(
    name: &str,
    repr: &OperationIr,
    inputs: &[TensorIr],
    outputs: &[TensorIr],
) -> Result<()> {
    let mut want_in: Vec<_> = inputs.iter().map(|t| t.id).collect();
    let mut got_in: Vec<_> = repr.inputs().map(|t| t.id).collect();
    let mut want_out: Vec<_> = outputs.iter().map(|t| t.id).collect();
    let mut got_out: Vec<_> = repr.outputs().map(|t| t.id).collect();
    for v in [&mut want_in, &mut got_in, &mut want_out, &mut got_out] {
        v.sort_unstable();
        v.dedup();
    }
    if want_in != got_in || want_out != got_out {
        return Err(Error::InvalidOperation {
            op: name.into(),
            detail: format!(
                "IR names inputs {got_in:?} and outputs {got_out:?}, registered {want_in:?} and {want_out:?}"
            ),
        });
    }
    Ok(())
}
