//! [`FusionTensor`]: a lazily computed tensor that can cross threads.

use std::fmt;
use std::sync::Arc;

use burn_backend::{DType, Element, Shape, StreamId, TensorData};
use burn_ir::{TensorId, TensorIr, TensorStatus};

use super::FusionClient;
use crate::live::{Live, Release};
use crate::runtime::StreamRuntime;
use crate::stream::{Reader, StreamCell};
use crate::{Error, Result};

/// One id's worth of tensor. Every [`FusionTensor`] of the same id on the same stream shares one
/// `TensorInner`; its `Arc` count *is* the id's live count, so the last drop is exactly the drop
/// of the `TensorInner`.
pub(crate) struct TensorInner<R: StreamRuntime> {
    pub(crate) id: TensorId,
    pub(crate) shape: Shape,
    pub(crate) dtype: DType,
    /// The stream whose handle map holds this id.
    pub(crate) home: Arc<StreamCell<R>>,
    pub(crate) client: FusionClient<R>,
}

/// Run by the id's last owner, unless the id's last reference was handed to an operation
/// (`ReadWrite`) or to a consuming read, which disarm it: the engine frees the id then.
impl<R: StreamRuntime> Release for TensorInner<R> {
    fn release(&mut self) {
        // No early return while panicking (burn's workaround leaks the handle): `release` never
        // blocks on a lock this thread holds, so it is safe during unwinding too.
        self.client.streams().release(&self.home, self.id);
    }
}

/// A tensor of a [`FusionClient`]: lazily computed on the stream of the thread that created it,
/// `Send`, and `Clone` across threads.
///
/// * **Home stream.** A tensor lives on the stream that produced it ([`FusionTensor::stream`]):
///   its backend handle is in that stream's map, and its producer, if still pending, is in that
///   stream's queue.
/// * **Clone.** On the home stream, a clone is a reference-count bump (same id). On any other
///   stream it is a *shared view*: a fresh id on the current stream, aliasing the same buffer,
///   after the source's pending producer has been materialised (see [`crate::MultiStream`]).
/// * **Use as an operand** from another stream likewise goes through a shared view; a foreign id
///   never enters the current stream's queue. Handing a tensor to an operation
///   ([`crate::Operand::Consume`], [`crate::OpBuilder::consume`]) is what burn calls `into_ir`:
///   when it is the id's last reference the operation gets it `ReadWrite` (and may reuse its
///   buffer). There is deliberately no public `into_ir` returning a bare `TensorIr`: deciding the
///   status apart from enqueueing the operation lets a concurrent last drop on another thread free
///   the id in between, so here the status is decided under the stream lock that enqueues.
/// * **Drop.** The last drop of an id on its home thread enqueues a free behind the pending work;
///   from any other thread it is a foreign drop that never touches the home queue.
/// * **Read.** [`FusionTensor::read`] returns the data, or the error that prevented it from being
///   produced (an error travels from a failing operation to everything computed from it).
///
/// ```
/// use fusion_streams::{FusionClient, host::{HostDevice, HostRuntime}};
/// use burn_backend::TensorData;
///
/// let client = FusionClient::<HostRuntime>::new(HostDevice::default())?;
/// let x = client.from_data(TensorData::new(vec![1.0f32, 2.0, 3.0], [3]))?;
/// let y = x.scale(2.0)?; // queued, not run
///
/// // Another thread gets a shared view: y's producer runs first, then y's buffer is aliased.
/// let z = std::thread::spawn(move || y.clone().add(&y).unwrap()).join().unwrap();
/// assert_eq!(z.to_vec::<f32>()?, vec![4.0, 8.0, 12.0]);
/// # Ok::<(), fusion_streams::Error>(())
/// ```
pub struct FusionTensor<R: StreamRuntime> {
    pub(crate) inner: Live<TensorInner<R>>,
}

impl<R: StreamRuntime> FusionTensor<R> {
    pub(crate) fn new(
        id: TensorId,
        shape: Shape,
        dtype: DType,
        home: Arc<StreamCell<R>>,
        client: FusionClient<R>,
    ) -> Self {
        Self {
            inner: Live::new(TensorInner {
                id,
                shape,
                dtype,
                home,
                client,
            }),
        }
    }

    /// The tensor's id on its home stream.
    pub fn id(&self) -> TensorId {
        self.inner.id
    }

    /// The tensor's shape.
    pub fn shape(&self) -> &Shape {
        &self.inner.shape
    }

    /// The tensor's data type.
    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    /// The tensor's home stream.
    pub fn stream(&self) -> StreamId {
        self.inner.home.id
    }

    /// Whether the current thread's stream is this tensor's home.
    pub fn is_local(&self) -> bool {
        crate::stream::current_stream() == self.inner.home.id
    }

    /// The client this tensor belongs to.
    pub fn client(&self) -> &FusionClient<R> {
        &self.inner.client
    }

    /// Number of live [`FusionTensor`]s with this id (on its home stream).
    pub fn live_count(&self) -> usize {
        self.inner.count()
    }

    /// The intermediate representation of this tensor used as an operand with `status`.
    #[inline(always)]
    pub(crate) fn ir(&self, status: TensorStatus) -> TensorIr {
        TensorIr {
            id: self.inner.id,
            shape: crate::small::copy_shape(&self.inner.shape),
            status,
            dtype: self.inner.dtype,
        }
    }

    /// A shared view of this tensor on the current stream (see [`crate::MultiStream`]).
    pub(crate) fn share(&self) -> Self {
        self.share_as(crate::id::fresh_tensor_id())
    }

    /// A shared view of this tensor on the current stream, under the fresh id `id` (reserved by
    /// the caller, which may have recorded it in an operation's IR already).
    pub(crate) fn share_as(&self, id: TensorId) -> Self {
        let client = &self.inner.client;
        let home = client
            .streams()
            .tag_shared_view(&self.inner.home, self.inner.id, id);
        Self::new(
            id,
            self.inner.shape.clone(),
            self.inner.dtype,
            home,
            client.clone(),
        )
    }

    /// Copy the tensor to the host, waiting for the device.
    ///
    /// Runs the home stream's pending work first if this tensor has not been produced yet (from
    /// any thread). Returns the error recorded on the tensor if its producer, or anything it was
    /// computed from, failed.
    pub fn read(&self) -> Result<TensorData> {
        let inner = &self.inner;
        let entry = inner
            .client
            .streams()
            .read_entry(&inner.home, inner.id, Reader::Borrower)?;
        inner.client.read_entry(entry, &inner.shape, inner.dtype)
    }

    /// A second owner of the tensor's backend handle, once its producer has run (the home
    /// stream is drained if needed), for interoperating with backend code.
    ///
    /// The handle makes the buffer ineligible for in-place reuse while it lives.
    ///
    /// # Safety
    ///
    /// The handle reaches the buffer outside the engine's bookkeeping, and a backend handle (a
    /// cubecl `Handle` on CUDA) can be passed to kernels that write it. The caller must:
    ///
    /// 1. never write the buffer through the handle: it may be aliased by views on other streams,
    ///    read by operations still pending, or published — and a
    ///    [`crate::transfer::SourcePublication`] promises that its bytes no longer change;
    /// 2. order every device access after the tensor's producer (the device may still be writing
    ///    the buffer when this returns).
    ///
    /// Reading the tensor needs none of this: use [`FusionTensor::read`].
    ///
    /// ```compile_fail,E0133
    /// # use fusion_streams::{FusionClient, host::{HostDevice, HostRuntime}};
    /// # use burn_backend::TensorData;
    /// # let client = FusionClient::<HostRuntime>::new(HostDevice::default()).unwrap();
    /// let x = client.from_data(TensorData::new(vec![1.0f32], [1])).unwrap();
    /// let handle = x.handle(); // a writable handle needs `unsafe`
    /// ```
    pub unsafe fn handle(&self) -> Result<R::FusionHandle> {
        let inner = &self.inner;
        match inner
            .client
            .streams()
            .read_entry(&inner.home, inner.id, Reader::Borrower)?
        {
            crate::stream::Entry::Handle(handle) => Ok(handle),
            crate::stream::Entry::Failed(error) => Err(error),
        }
    }

    /// Like [`FusionTensor::read`], consuming the tensor: when it is the last reference to its id,
    /// the id is released in the same step as the read (as its last drop would release it:
    /// behind any pending operation that still reads it).
    pub fn into_data(self) -> Result<TensorData> {
        let (client, shape, dtype) = (self.client().clone(), self.shape().clone(), self.dtype());
        client.read_entry(self.into_entry()?, &shape, dtype)
    }

    /// Consume the tensor for its handle (or its error): as [`FusionTensor::into_data`], without
    /// the copy.
    pub(crate) fn into_handle(self) -> Result<R::FusionHandle> {
        match self.into_entry()? {
            crate::stream::Entry::Handle(handle) => Ok(handle),
            crate::stream::Entry::Failed(error) => Err(error),
        }
    }

    /// A second owner of the tensor's handle (or its error), releasing the id when this was its
    /// last reference.
    fn into_entry(self) -> Result<crate::stream::Entry<R::FusionHandle>> {
        match self.inner.try_take() {
            Ok(mut last) => {
                let inner = last.get();
                let entry =
                    inner
                        .client
                        .streams()
                        .read_entry(&inner.home, inner.id, Reader::LastOwner)?;
                // The last owner's read released the id: dropping `last` must not release it again.
                last.disarm();
                Ok(entry)
            }
            Err(inner) => {
                let inner = FusionTensor { inner };
                inner
                    .client()
                    .streams()
                    .read_entry(&inner.inner.home, inner.id(), Reader::Borrower)
            }
        }
    }

    /// Read the tensor as a `Vec<E>`.
    pub fn to_vec<E: Element>(&self) -> Result<Vec<E>> {
        self.read()?
            .into_vec::<E>()
            .map_err(|e| Error::InvalidData(format!("{e:?}")))
    }
}

impl<R: StreamRuntime> Clone for FusionTensor<R> {
    /// Same stream: another reference to the same id. Another stream: a shared view.
    fn clone(&self) -> Self {
        if self.is_local() {
            Self {
                inner: self.inner.clone(),
            }
        } else {
            self.share()
        }
    }
}

impl<R: StreamRuntime> fmt::Debug for FusionTensor<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FusionTensor")
            .field("id", &self.inner.id)
            .field("shape", &self.inner.shape)
            .field("dtype", &self.inner.dtype)
            .field("stream", &self.inner.home.id)
            .finish()
    }
}
