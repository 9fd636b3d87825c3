//! The embedded host runtime; its public face, with the design notes, is [`crate::host`].

mod elementwise_fuser;
mod kernels;
pub(crate) mod marker;
mod transfer_jobs;
pub(crate) mod worker;

pub use transfer_jobs::HostEvent;

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn_backend::{DType, DeviceId, DeviceOps, Shape, StreamId, TensorData};
use burn_fusion::stream::{Context, OrderedExecution};
use burn_fusion::{FusionRuntime, NumOperations, OperationFuser, Optimization};
use burn_ir::TensorIr;
use parking_lot::RwLock;
use smallvec::SmallVec;

use kernels::HostData;
use marker::Marker;
use worker::Workers;

use crate::runtime::{Kernel, KernelInputs, StreamRuntime};
use crate::runtime::{Retired, RetirementQueue};

/// Bound of the host device's retirement queue (drainable side).
const RETIREMENT_CAPACITY: usize = 256;
use crate::{Error, Result};

/// burn's device type id for the host device (distinct from burn's own backends).
const HOST_DEVICE_TYPE: u16 = 0x4853; // "HS"

/// A host device. Each [`crate::FusionClient`] opened on it gets its own workers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct HostDevice {
    /// Device index, for logs and for telling devices apart.
    pub index: u16,
    fusion: bool,
}

impl HostDevice {
    /// The host device with this index.
    pub fn new(index: u16) -> Self {
        Self {
            index,
            fusion: false,
        }
    }

    /// This device, fusing: runs of elementwise `f32` built-ins over tensors of one length
    /// execute as one job per run (bit for bit the unfused results, never in place), when the
    /// engine's [`crate::EngineConfig::fusion`] is on. Off by default, so that the host device
    /// keeps modelling one kernel per operation.
    pub fn fusing(mut self) -> Self {
        self.fusion = true;
        self
    }
}

impl burn_backend::Device for HostDevice {
    fn from_id(device_id: DeviceId) -> Self {
        Self::new(device_id.index_id)
    }

    fn to_id(&self) -> DeviceId {
        DeviceId {
            type_id: HOST_DEVICE_TYPE,
            index_id: self.index,
        }
    }
}

impl DeviceOps for HostDevice {}

/// Counters of the host device, for tests and examples.
#[derive(Debug, Default)]
struct HostCounters {
    buffers_allocated: AtomicU64,
    buffers_freed: AtomicU64,
    kernels_dispatched: AtomicU64,
    kernels_completed: AtomicU64,
    kernels_failed: AtomicU64,
    in_place_reuses: AtomicU64,
}

/// A snapshot of the host device's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HostStats {
    /// Buffers allocated (uploads and kernel outputs that did not reuse an input).
    pub buffers_allocated: u64,
    /// Buffers freed (their last owner dropped).
    pub buffers_freed: u64,
    /// Kernels dispatched to the stream workers.
    pub kernels_dispatched: u64,
    /// Kernels that finished (successfully or not).
    pub kernels_completed: u64,
    /// Kernels that failed on the device, including those that propagated an input's failure.
    pub kernels_failed: u64,
    /// Kernels that wrote their output over their first input's buffer.
    pub in_place_reuses: u64,
}

impl HostStats {
    /// Buffers currently alive.
    pub fn live_buffers(&self) -> u64 {
        self.buffers_allocated - self.buffers_freed
    }
}

/// A host buffer. Counts its own free.
struct HostStorage {
    data: RwLock<HostData>,
    counters: Arc<HostCounters>,
}

impl HostStorage {
    fn new(data: HostData, counters: &Arc<HostCounters>) -> Arc<Self> {
        counters.buffers_allocated.fetch_add(1, Ordering::Relaxed);
        Arc::new(Self {
            data: RwLock::new(data),
            counters: counters.clone(),
        })
    }
}

impl Drop for HostStorage {
    fn drop(&mut self) {
        self.counters.buffers_freed.fetch_add(1, Ordering::Relaxed);
    }
}

/// A handle to a host buffer: a reference-counted buffer plus the completion marker of the write
/// that produced its current contents.
#[derive(Clone)]
pub struct HostHandle {
    storage: Arc<HostStorage>,
    written: Arc<Marker>,
}

impl HostHandle {
    /// Whether the write that produced this handle's contents has finished (successfully or not).
    /// Never waits.
    pub fn is_written(&self) -> bool {
        self.written.poll().is_some()
    }
}

impl fmt::Debug for HostHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostHandle")
            .field("owners", &Arc::strong_count(&self.storage))
            .field("written", &self.is_written())
            .finish()
    }
}

/// A buffer's contents as a kernel dispatched with [`HostContext::dispatch`] reads them.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum HostSlice<'a> {
    /// 32-bit floats.
    F32(&'a [f32]),
    /// 32-bit integers.
    I32(&'a [i32]),
}

/// The contents a kernel dispatched with [`HostContext::dispatch`] writes to its output.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum HostValues {
    /// 32-bit floats.
    F32(Vec<f32>),
    /// 32-bit integers.
    I32(Vec<i32>),
}

/// Per-client state of a host device: its stream workers and counters.
pub struct HostContext {
    device: HostDevice,
    // Dropped first: waits for dispatched work, then joins the workers. Only then is the
    // retirement queue (below) dropped, so no record is released while a stream may use it.
    workers: Workers,
    counters: Arc<HostCounters>,
    retirement: RetirementQueue<Retired<HostRuntime>>,
}

impl HostContext {
    /// Run `body` on the current stream's worker once every marker in `deps` has completed, then
    /// complete `written` with its outcome (a dependency's failure, or a panic, included).
    fn spawn(
        &self,
        name: &'static str,
        deps: SmallVec<[Arc<Marker>; 2]>,
        written: Arc<Marker>,
        body: impl FnOnce() -> Result<()> + Send + 'static,
    ) {
        let counters = self.counters.clone();
        counters.kernels_dispatched.fetch_add(1, Ordering::Relaxed);
        self.workers.dispatch(
            StreamId::current().value,
            Box::new(move || {
                let run = || -> Result<()> {
                    for dep in &deps {
                        dep.wait()?;
                    }
                    body()
                };
                let outcome = catch_unwind(AssertUnwindSafe(run))
                    .unwrap_or_else(|payload| Err(Error::from_kernel_panic(name, payload)));
                if outcome.is_err() {
                    counters.kernels_failed.fetch_add(1, Ordering::Relaxed);
                }
                counters.kernels_completed.fetch_add(1, Ordering::Relaxed);
                written.complete(outcome);
            }),
        );
    }

    /// Dispatch a custom kernel on the current stream's worker, and return the handle of its
    /// output at once. Nothing here waits: this is how a custom executor on the host runtime
    /// reads and writes data.
    ///
    /// `kernel` runs on the worker after the last write of every input, with their contents; what
    /// it returns becomes the output buffer's contents. If an input's write failed, the kernel
    /// does not run and the output carries that error; an error or a panic of the kernel is the
    /// output's error too, reported by whatever reads it. The inputs stay alive (and are not
    /// written in place by anyone) until the kernel has run.
    ///
    /// A custom executor captures the context (`client.context().clone()`: it holds the device,
    /// not the engine):
    ///
    /// ```
    /// use burn_backend::{DType, TensorData};
    /// use burn_ir::{CustomOpIr, HandleContainer};
    /// use fusion_streams::FusionClient;
    /// use fusion_streams::host::{HostDevice, HostHandle, HostRuntime, HostSlice, HostValues};
    ///
    /// let client = FusionClient::<HostRuntime>::new(HostDevice::default())?;
    /// let x = client.from_data(TensorData::new(vec![1.0f32, -2.0, 3.0], [3]))?;
    /// let context = client.context().clone();
    /// let relu = client
    ///     .op("relu")
    ///     .read(&x)
    ///     .output([3], DType::F32)
    ///     .execute(move |op: &CustomOpIr, handles: &mut HandleContainer<HostHandle>| {
    ///         let input = handles.get_handle(&op.inputs[0].id, &op.inputs[0].status);
    ///         let out = context.dispatch("relu", &[&input], |inputs| match inputs[0] {
    ///             HostSlice::F32(v) => Ok(HostValues::F32(v.iter().map(|x| x.max(0.0)).collect())),
    ///             other => Err(fusion_streams::Error::operation("relu", format!("{other:?}"))),
    ///         });
    ///         handles.register_handle(op.outputs[0].id, out);
    ///         Ok(())
    ///     })?
    ///     .remove(0);
    /// assert_eq!(relu.to_vec::<f32>()?, vec![1.0, 0.0, 3.0]);
    /// # Ok::<(), fusion_streams::Error>(())
    /// ```
    pub fn dispatch<F>(&self, name: &'static str, inputs: &[&HostHandle], kernel: F) -> HostHandle
    where
        F: FnOnce(&[HostSlice<'_>]) -> Result<HostValues> + Send + 'static,
    {
        let deps = inputs.iter().map(|h| h.written.clone()).collect();
        let sources: SmallVec<[Arc<HostStorage>; 2]> =
            inputs.iter().map(|h| h.storage.clone()).collect();
        let target = HostStorage::new(HostData::Unwritten, &self.counters);
        let written = Marker::pending();
        let handle = HostHandle {
            storage: target.clone(),
            written: written.clone(),
        };
        self.spawn(name, deps, written, move || {
            let guards: SmallVec<[_; 2]> = sources.iter().map(|s| s.data.read()).collect();
            let slices = guards
                .iter()
                .map(|data| match &**data {
                    HostData::F32(v) => Ok(HostSlice::F32(v)),
                    HostData::I32(v) => Ok(HostSlice::I32(v)),
                    HostData::Unwritten => Err(Error::Runtime(
                        format!("`{name}` read a buffer that was never written").into(),
                    )),
                })
                .collect::<Result<SmallVec<[_; 2]>>>()?;
            let values = kernel(&slices)?;
            *target.data.write() = match values {
                HostValues::F32(v) => HostData::F32(v),
                HostValues::I32(v) => HostData::I32(v),
            };
            Ok(())
        });
        handle
    }

    /// The device.
    pub fn device(&self) -> &HostDevice {
        &self.device
    }

    /// The retirement queue of dropped transfers.
    pub fn retirement(&self) -> &RetirementQueue<Retired<HostRuntime>> {
        &self.retirement
    }

    /// The device's counters.
    pub fn stats(&self) -> HostStats {
        let c = &self.counters;
        HostStats {
            buffers_allocated: c.buffers_allocated.load(Ordering::Relaxed),
            buffers_freed: c.buffers_freed.load(Ordering::Relaxed),
            kernels_dispatched: c.kernels_dispatched.load(Ordering::Relaxed),
            kernels_completed: c.kernels_completed.load(Ordering::Relaxed),
            kernels_failed: c.kernels_failed.load(Ordering::Relaxed),
            in_place_reuses: c.in_place_reuses.load(Ordering::Relaxed),
        }
    }
}

/// Holds a host stream's worker; see [`HostContext::pause`]. Dropping it lets the stream run.
/// Feature `testing`.
#[cfg(feature = "testing")]
#[must_use = "the stream resumes when this guard is dropped"]
pub struct StreamPause {
    gate: Arc<Marker>,
}

#[cfg(feature = "testing")]
impl fmt::Debug for StreamPause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamPause").finish_non_exhaustive()
    }
}

#[cfg(feature = "testing")]
impl Drop for StreamPause {
    fn drop(&mut self) {
        self.gate.complete(Ok(()));
    }
}

#[cfg(feature = "testing")]
impl HostContext {
    /// Hold `stream`'s worker: kernels dispatched to that stream stay pending (genuinely not
    /// run) until the returned guard is dropped. For tests and demonstrations of asynchronous
    /// behaviour.
    ///
    /// The device cannot shut down while a stream is paused: dropping the last owner of this
    /// context waits for it, so never `mem::forget` the guard.
    pub fn pause(&self, stream: StreamId) -> StreamPause {
        let gate = Marker::pending();
        let wait = gate.clone();
        self.workers.dispatch(
            stream.value,
            Box::new(move || {
                let _ = wait.wait();
            }),
        );
        StreamPause { gate }
    }
}

impl fmt::Debug for HostContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostContext")
            .field("device", &self.device)
            .field("stats", &self.stats())
            .finish()
    }
}

/// The fusion optimisation type of runtimes that run every operation unfused. Uninhabited: no
/// fuser ever produces one.
#[derive(Debug)]
pub enum Unfused {}

impl NumOperations for Unfused {
    fn len(&self) -> usize {
        match *self {}
    }

    fn name(&self) -> &'static str {
        match *self {}
    }
}

impl<R: FusionRuntime> Optimization<R> for Unfused {
    fn execute(&mut self, _: &mut Context<R::FusionHandle>, _: &OrderedExecution<R>) {
        match *self {}
    }

    fn to_state(&self) -> R::OptimizationState {
        match *self {}
    }

    fn from_state(_: &R::FusionDevice, _: R::OptimizationState) -> Self {
        // burn only restores optimisations a fuser produced; runtimes using `Unfused` have none.
        unreachable!("fusion-streams runtimes register no fusers")
    }
}

/// The embedded asynchronous CPU runtime. See the [module docs](crate::host).
#[derive(Debug, Clone, Copy, Default)]
pub struct HostRuntime;

impl FusionRuntime for HostRuntime {
    type OptimizationState = ();
    type Optimization = Unfused;
    type FusionHandle = HostHandle;
    type FusionDevice = HostDevice;

    fn fusers(_: HostDevice) -> Vec<Box<dyn OperationFuser<Unfused>>> {
        Vec::new()
    }
}

fn to_host_data(data: &TensorData) -> Result<HostData> {
    let bad = |e| Error::InvalidData(format!("{e:?}"));
    match data.dtype {
        DType::F32 => Ok(HostData::F32(data.to_vec::<f32>().map_err(bad)?)),
        DType::I32 => Ok(HostData::I32(data.to_vec::<i32>().map_err(bad)?)),
        dtype => Err(Error::UnsupportedDType {
            op: "from_data".into(),
            dtype,
        }),
    }
}

impl StreamRuntime for HostRuntime {
    type Context = HostContext;

    fn name() -> &'static str {
        "host"
    }

    fn open(device: &HostDevice) -> Result<HostContext> {
        Ok(HostContext {
            device: device.clone(),
            workers: Workers::new(format!("host{}", device.index)),
            counters: Arc::default(),
            retirement: RetirementQueue::new(RETIREMENT_CAPACITY),
        })
    }

    fn upload(ctx: &HostContext, data: TensorData) -> Result<HostHandle> {
        let host = to_host_data(&data)?;
        Ok(HostHandle {
            storage: HostStorage::new(host, &ctx.counters),
            written: Marker::done(),
        })
    }

    fn read(
        _ctx: &HostContext,
        handle: &HostHandle,
        shape: &Shape,
        dtype: DType,
    ) -> Result<TensorData> {
        handle.written.wait()?;
        let data = handle.storage.data.read();
        // The buffer may come from a custom executor: check it really holds the tensor before
        // handing it to `TensorData`, which panics on a length mismatch.
        let expected = shape.num_elements();
        if data.len() != expected {
            return Err(Error::BufferSize {
                expected: expected * dtype.size(),
                found: data.len() * data.dtype().map_or(0, |d| d.size()),
            });
        }
        fn copy<T: Copy>(v: &[T]) -> Result<Vec<T>> {
            let mut out = crate::size::try_vec("a read", v.len())?;
            out.extend_from_slice(v);
            Ok(out)
        }
        match (&*data, dtype) {
            (HostData::F32(v), DType::F32) => Ok(TensorData::new(copy(v)?, shape.clone())),
            (HostData::I32(v), DType::I32) => Ok(TensorData::new(copy(v)?, shape.clone())),
            (other, _) => Err(Error::Runtime(
                format!("buffer holds {:?}, read as {dtype:?}", other.dtype()).into(),
            )),
        }
    }

    fn has_foreign_buffers(_: &HostContext) -> bool {
        // Every host buffer carries its last writer's completion marker (`foreign_to`'s default).
        false
    }

    fn can_mut(handle: &HostHandle) -> bool {
        Arc::strong_count(&handle.storage) == 1
    }

    fn synchronize(ctx: &HostContext) -> Result<()> {
        for fence in ctx.workers.fences() {
            fence.wait()?;
        }
        ctx.retirement.sweep();
        Ok(())
    }

    fn supports(kernel: &Kernel, dtype: DType) -> bool {
        kernels::supports(kernel, dtype)
    }

    fn fuser(ctx: &HostContext) -> Option<Box<dyn crate::runtime::Fuser<Self>>> {
        ctx.device.fusion.then(|| {
            Box::new(elementwise_fuser::HostFuser::default())
                as Box<dyn crate::runtime::Fuser<Self>>
        })
    }

    fn launch(
        ctx: &HostContext,
        kernel: &Kernel,
        inputs: KernelInputs<'_, HostHandle>,
        out: &TensorIr,
    ) -> Result<HostHandle> {
        let reuse = kernels::elementwise(kernel)
            && crate::runtime::first_input_reusable::<Self>(&inputs, out);
        let deps: SmallVec<[Arc<Marker>; 2]> =
            inputs.iter().map(|i| i.handle.written.clone()).collect();
        // The kernel owns its inputs until it has run: no buffer it reads can be freed or written
        // in place before then.
        let sources: SmallVec<[Arc<HostStorage>; 2]> =
            inputs.into_iter().map(|i| i.handle.storage).collect();
        let target = if reuse {
            ctx.counters.in_place_reuses.fetch_add(1, Ordering::Relaxed);
            sources[0].clone()
        } else {
            HostStorage::new(HostData::Unwritten, &ctx.counters)
        };
        let written = Marker::pending();
        let handle = HostHandle {
            storage: target.clone(),
            written: written.clone(),
        };

        let kernel = *kernel;
        let (shape, dtype) = (out.shape.clone(), out.dtype);
        ctx.spawn(kernel.name(), deps, written, move || {
            if reuse {
                let rest: SmallVec<[_; 2]> = sources[1..].iter().map(|s| s.data.read()).collect();
                let rest: SmallVec<[&HostData; 2]> = rest.iter().map(|g| &**g).collect();
                let mut data = target.data.write();
                let first = std::mem::replace(&mut *data, HostData::Unwritten);
                *data = kernels::compute_in_place(&kernel, first, &rest, &shape, dtype)?;
            } else {
                let guards: SmallVec<[_; 2]> = sources.iter().map(|s| s.data.read()).collect();
                let refs: SmallVec<[&HostData; 2]> = guards.iter().map(|g| &**g).collect();
                *target.data.write() = kernels::compute(&kernel, &refs, &shape, dtype)?;
            }
            Ok(())
        });
        Ok(handle)
    }
}
