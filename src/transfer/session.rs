//! [`HeldSession`]: a thread's hold on one stream of a client, the entry point of publication.

use std::fmt;
use std::marker::PhantomData;

use burn_backend::StreamId;

use super::error::{PublicationAdmissionError, PublicationRejected};
use super::publication::SourcePublication;
use crate::runtime::{StreamRuntime, TransferRuntime};
use crate::stream::in_engine;
use crate::{Error, FusionClient, FusionTensor, Result};

/// A value [`HeldSession::publish`] takes: an engine tensor, or, on
/// [`StreamFusion`](crate::backend::StreamFusion), a burn `Tensor` of any kind (float, int, bool)
/// or a burn tensor primitive.
pub trait Publishable<R: StreamRuntime> {
    /// The engine tensor behind the value.
    fn into_fusion_tensor(self) -> FusionTensor<R>;
}

impl<R: StreamRuntime> Publishable<R> for FusionTensor<R> {
    fn into_fusion_tensor(self) -> FusionTensor<R> {
        self
    }
}

/// A held session on a client's stream: captures the current thread's stream when opened, and
/// the backend stream its work runs on ([`FusionClient::execution_stream`]).
///
/// * `!Send` and `!Sync`: it belongs to the thread whose stream it captured.
/// * One per (client, stream) at a time: a second [`HeldSession::open`] on the same stream
///   returns [`Error::SessionHeld`]. Threads on other streams hold their own sessions
///   concurrently.
/// * Work registered on this thread runs on the captured stream; [`HeldSession::submit`]
///   dispatches it, [`HeldSession::synchronize`] waits for the device, [`HeldSession::close`]
///   (or dropping the session) releases the hold.
///
/// Publications outlive the session that made them.
///
/// ```compile_fail,E0277
/// # use fusion_streams::{FusionClient, host::{HostDevice, HostRuntime}, transfer::HeldSession};
/// let client = FusionClient::<HostRuntime>::new(HostDevice::default()).unwrap();
/// let session = HeldSession::open(&client).unwrap();
/// // A session is not `Send`: it cannot move to another thread.
/// std::thread::spawn(move || drop(session));
/// ```
pub struct HeldSession<R: TransferRuntime> {
    client: FusionClient<R>,
    /// The engine stream held (the thread's).
    held: StreamId,
    /// Its execution stream: where frontiers are recorded and copies run.
    stream: StreamId,
    _not_send: PhantomData<*const ()>,
}

impl<R: TransferRuntime> HeldSession<R> {
    /// Hold the current thread's stream of `client`.
    pub fn open(client: &FusionClient<R>) -> Result<Self> {
        if in_engine() {
            return Err(Error::Reentrant {
                what: "HeldSession::open",
            });
        }
        let held = crate::stream::current_stream();
        client.claim_session(held)?;
        Ok(Self {
            client: client.clone(),
            held,
            stream: client.execution_stream(),
            _not_send: PhantomData,
        })
    }

    /// The captured stream, as the backend knows it: the execution stream the session's work
    /// runs on ([`FusionClient::execution_stream`]), where its publications' frontiers are
    /// recorded and their copies run ([`SourcePublication::stream`]).
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// Run `f` as the session's stream: the engine sees the held stream as current, the backend
    /// its execution stream.
    fn on_stream<T>(&self, f: impl FnOnce() -> T) -> T {
        crate::stream::executes(self.held, self.stream, f)
    }

    /// The client.
    pub fn client(&self) -> &FusionClient<R> {
        &self.client
    }

    /// Dispatch the work queued on the captured stream, without waiting for the device.
    pub fn submit(&mut self) {
        self.client.streams().drain(self.held);
    }

    /// Dispatch the queued work and wait for the device; releases completed records of the
    /// runtime's retirement queue.
    pub fn synchronize(&mut self) -> Result<()> {
        self.on_stream(|| self.client.sync())
    }

    /// Release the hold. Publications made from this session stay valid.
    pub fn close(self) {}

    /// Publish a value whose production is ordered before this session's captured stream.
    ///
    /// Drains the session's lazy work (dispatch only), retains the value's allocation (a second
    /// owner of its buffer plus a pin on the runtime), releases the value's engine id, and records
    /// the frontier on the captured stream without waiting.
    ///
    /// # Errors
    ///
    /// * [`PublicationAdmissionError::Rejected`], with the value unchanged, when nothing was
    ///   enqueued: a value of another client, a dtype the runtime cannot publish, an empty value
    ///   (zero bytes: no buffer could receive it), a producer whose
    ///   failure is already known at the dispatch boundary (its error record), a re-entrant call.
    /// * [`PublicationAdmissionError::Unproven`] when recording the frontier failed: the value is
    ///   released, no owner is returned.
    ///
    /// # Safety
    ///
    /// The caller asserts that the value's last write is ordered before this session's stream:
    ///
    /// 1. the value was produced by work dispatched on the captured stream, or
    /// 2. by work on another stream that the device orders before the captured stream (on the
    ///    host runtime and on cubecl 0.10, a kernel reading a buffer waits for its last writer, so
    ///    values produced through this crate's operations satisfy this).
    ///
    /// A value written through a route outside the engine (a raw device pointer, another
    /// session's `_into` route) does not satisfy the contract: neither the handle nor the session
    /// can prove who wrote last, and the frontier would not cover that write.
    ///
    /// The value cannot be used after it is published:
    ///
    /// ```compile_fail,E0382
    /// # use fusion_streams::{FusionClient, host::{HostDevice, HostRuntime}, transfer::HeldSession};
    /// # use burn_backend::TensorData;
    /// # let client = FusionClient::<HostRuntime>::new(HostDevice::default()).unwrap();
    /// # let mut session = HeldSession::open(&client).unwrap();
    /// let value = client.from_data(TensorData::new(vec![1.0f32], [1])).unwrap();
    /// let publication = unsafe { session.publish(value) }.unwrap();
    /// let again = value.read(); // moved into the publication
    /// ```
    ///
    /// and no accessor yields it back:
    ///
    /// ```compile_fail,E0599
    /// # use fusion_streams::{FusionClient, host::{HostDevice, HostRuntime}, transfer::HeldSession};
    /// # use burn_backend::TensorData;
    /// # let client = FusionClient::<HostRuntime>::new(HostDevice::default()).unwrap();
    /// # let mut session = HeldSession::open(&client).unwrap();
    /// let value = client.from_data(TensorData::new(vec![1.0f32], [1])).unwrap();
    /// let publication = unsafe { session.publish(value) }.unwrap();
    /// let tensor = publication.value(); // there is no such accessor
    /// ```
    ///
    /// The same code without the offending line compiles and runs:
    ///
    /// ```
    /// # use fusion_streams::{FusionClient, host::{HostDevice, HostRuntime}, transfer::HeldSession};
    /// # use burn_backend::TensorData;
    /// # let client = FusionClient::<HostRuntime>::new(HostDevice::default()).unwrap();
    /// # let mut session = HeldSession::open(&client).unwrap();
    /// let value = client.from_data(TensorData::new(vec![1.0f32], [1])).unwrap();
    /// let publication = unsafe { session.publish(value) }.unwrap();
    /// assert_eq!(publication.bytes(), 4);
    /// ```
    pub unsafe fn publish(
        &mut self,
        value: impl Publishable<R>,
    ) -> Result<SourcePublication<R>, PublicationAdmissionError<R>> {
        let value = value.into_fusion_tensor();
        let reject = |value, reason| {
            Err(PublicationAdmissionError::Rejected(Box::new(
                PublicationRejected { value, reason },
            )))
        };
        if !self.client.same_engine(value.client()) {
            let reason = self.client.foreign_tensor(&value);
            return reject(value, reason);
        }
        if !R::publishable(self.client.context(), value.dtype()) {
            let reason = Error::UnsupportedDType {
                op: "publish".into(),
                dtype: value.dtype(),
            };
            return reject(value, reason);
        }
        // Checked: the byte length every later step (buffer check, copy) relies on.
        let bytes = match crate::size::tensor_bytes(
            "a published value",
            value.shape(),
            value.dtype(),
            usize::MAX,
        ) {
            Ok(bytes) => bytes,
            Err(reason) => return reject(value, reason),
        };
        if bytes == 0 {
            let reason = Error::InvalidData(
                "a value of zero bytes cannot be published: no pinned buffer could receive it"
                    .into(),
            );
            return reject(value, reason);
        }
        if in_engine() {
            return reject(value, Error::Reentrant { what: "publish" });
        }

        let (held, stream) = (self.held, self.stream);
        let streams = self.client.streams();
        self.on_stream(|| {
            // Dispatch everything the session queued: no lazy source work in the later copy.
            streams.drain(held);
            // The value's producer is dispatched (its home stream drained if it was pending). A
            // value from another stream needs no view here: its writers all ran on its home
            // stream or on the buffer's allocating stream, which the frontier covers.
            // SAFETY: the handle becomes the publication's source, which only reads the buffer.
            let handle = match unsafe { value.handle() } {
                Ok(handle) => handle,
                Err(reason) => return reject(value, reason),
            };
            let context = self.client.context().clone();
            let (shape, dtype) = (value.shape(), value.dtype());
            let recorded = R::record_frontier(&context, stream, handle, shape, dtype);
            let recorded = match recorded {
                Ok(recorded) => recorded,
                Err(error) => {
                    tracing::debug!(%stream, %error, "publication unproven");
                    return Err(PublicationAdmissionError::Unproven { error });
                }
            };
            tracing::trace!(%stream, tensor = %value.id(), "published");
            let publication = SourcePublication::new(context, recorded, stream, &value, bytes);
            // The publication owns the allocation now; the engine id goes.
            drop(value);
            Ok(publication)
        })
    }
}

impl<R: TransferRuntime> Drop for HeldSession<R> {
    fn drop(&mut self) {
        self.client.release_session(self.held);
    }
}

impl<R: TransferRuntime> fmt::Debug for HeldSession<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeldSession")
            .field("held", &self.held)
            .field("stream", &self.stream)
            .finish()
    }
}
