//! [`SourcePublication`] and [`PendingDownload`]: owned records of a published value and of its
//! copy to the host.

use std::fmt;
use std::sync::Arc;

use burn_backend::{DType, Shape, StreamId, TensorData};

use super::error::{DownloadFailed, DownloadRejected, PublicationAdmissionError, PublicationError};
use crate::runtime::{PinnedHostBuffer, Retired, TransferRuntime};
use crate::{Error, FusionTensor, Result};

/// What a publication retains: the runtime pin, the value's source (the one owner of its
/// allocation once the engine id is released), and the frontier recorded on the captured stream.
struct Record<R: TransferRuntime> {
    context: Arc<R::Context>,
    source: R::Source,
    frontier: R::Event,
    stream: StreamId,
    shape: Shape,
    dtype: DType,
    /// The value's byte length, computed with checked arithmetic at admission.
    bytes: usize,
    /// Set once a failure of the frontier was observed: the publication is terminal.
    failure: Option<Error>,
}

impl<R: TransferRuntime> Record<R> {
    fn bytes(&self) -> usize {
        self.bytes
    }

    /// Poll the frontier; a failure observed here makes the record terminal.
    fn poll(&mut self) -> Option<Result<()>> {
        if let Some(error) = &self.failure {
            return Some(Err(error.clone()));
        }
        let outcome = R::poll_event(&self.frontier);
        if let Some(Err(error)) = &outcome {
            tracing::debug!(stream = %self.stream, %error, "frontier failed: publication terminal");
            self.failure = Some(error.clone());
        }
        outcome
    }
}

/// An owned, published value: its allocation, the runtime pin, and its producer's frontier.
///
/// It outlives the session that published it, the client, and every tensor. It exposes no read
/// accessor of the value; the way back is [`SourcePublication::download_into`]. See the
/// [module docs](super).
pub struct SourcePublication<R: TransferRuntime> {
    /// `None` only transiently: while being dropped, or after `download_into` moved it out.
    record: Option<Record<R>>,
}

impl<R: TransferRuntime> SourcePublication<R> {
    /// The publication of `value`, whose allocation `source` now owns, `bytes` long.
    pub(crate) fn new(
        context: Arc<R::Context>,
        (source, frontier): (R::Source, R::Event),
        stream: StreamId,
        value: &FusionTensor<R>,
        bytes: usize,
    ) -> Self {
        Self {
            record: Some(Record {
                bytes,
                context,
                source,
                frontier,
                stream,
                shape: value.shape().clone(),
                dtype: value.dtype(),
                failure: None,
            }),
        }
    }

    fn record(&self) -> &Record<R> {
        self.record
            .as_ref()
            .expect("a live publication always holds its record")
    }

    fn record_mut(&mut self) -> &mut Record<R> {
        self.record
            .as_mut()
            .expect("a live publication always holds its record")
    }

    /// Byte length of the published value.
    pub fn bytes(&self) -> usize {
        self.record().bytes()
    }

    /// Shape of the published value.
    pub fn shape(&self) -> &Shape {
        &self.record().shape
    }

    /// Data type of the published value.
    pub fn dtype(&self) -> DType {
        self.record().dtype
    }

    /// The stream the session captured, as the backend knows it: the session's
    /// [`HeldSession::stream`](super::HeldSession::stream), its thread's execution stream, where
    /// the frontier was recorded and the copy will run. (Not the thread's own
    /// [`StreamId::current`], which names the thread's stream in the engine; see
    /// [`FusionClient::execution_stream`](crate::FusionClient::execution_stream).)
    pub fn stream(&self) -> StreamId {
        self.record().stream
    }

    /// Whether a failure of the producer's frontier has been observed.
    pub fn is_terminal(&self) -> bool {
        self.record().failure.is_some()
    }

    /// Whether the producer's frontier has completed. Never waits.
    ///
    /// # Errors
    ///
    /// Returns the recorded failure once the publication is terminal, so a failed publication can
    /// never report readiness. Observing a failure here makes the publication terminal.
    pub fn frontier_ready(&mut self) -> Result<bool> {
        match self.record_mut().poll() {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(error)) => Err(error),
        }
    }

    /// Explicit readiness boundary: wait for the producer's frontier.
    ///
    /// A failure is terminal: it is recorded, [`SourcePublication::frontier_ready`] reports it
    /// from then on, a further `await_frontier` refuses at once without releasing anything, and
    /// [`SourcePublication::download_into`] refuses, handing the publication and the buffer
    /// back. A success does not release anything: the allocation is still needed by the copy.
    pub fn await_frontier(&mut self) -> Result<(), PublicationAdmissionError<R>> {
        let record = self.record_mut();
        if let Some(error) = &record.failure {
            return Err(PublicationAdmissionError::Unproven {
                error: error.clone(),
            });
        }
        R::wait_event(&record.frontier).map_err(|error| {
            record.failure = Some(error.clone());
            PublicationAdmissionError::Unproven { error }
        })
    }

    /// Consume the publication by copying it into `buffer`.
    ///
    /// The copy runs from the retained allocation, in the captured stream's order, after the
    /// frontier. It takes no session and enters none, re-runs no producer work, and never falls
    /// back to another route. The retained allocation and the runtime pin move into the returned
    /// [`PendingDownload`], and stay alive until the copy has completed.
    ///
    /// # Errors
    ///
    /// [`PublicationError::Rejected`], with the publication (frontier included) and the buffer
    /// handed back, when nothing was enqueued: the publication is terminal, the buffer's length is
    /// not the value's byte length, or the runtime refused the copy.
    pub fn download_into(
        mut self,
        buffer: PinnedHostBuffer,
    ) -> Result<PendingDownload<R>, PublicationError<R>> {
        let refuse = |publication, buffer, reason| {
            Err(PublicationError::Rejected(Box::new(DownloadRejected {
                publication,
                buffer,
                reason,
            })))
        };
        let record = self.record_mut();
        if let Some(Err(error)) = record.poll() {
            return refuse(self, buffer, error);
        }
        let bytes = record.bytes();
        if buffer.len() != bytes {
            let reason = Error::BufferSize {
                expected: bytes,
                found: buffer.len(),
            };
            return refuse(self, buffer, reason);
        }
        // SAFETY: the download record takes the source and the buffer, and holds them (or
        // retires them) until the event completes.
        let downloaded = unsafe {
            R::download(
                &record.context,
                record.stream,
                &record.source,
                &record.frontier,
                &buffer,
            )
        };
        let event = match downloaded {
            Ok(event) => event,
            Err(reason) => return refuse(self, buffer, reason),
        };
        let Record {
            context,
            source,
            stream,
            shape,
            dtype,
            ..
        } = self
            .record
            .take()
            .expect("a live publication always holds its record");
        tracing::trace!(%stream, bytes, "download enqueued");
        Ok(PendingDownload {
            record: Some(DownloadRecord {
                context,
                event,
                buffer,
                source,
                bytes,
                shape,
                dtype,
            }),
        })
    }
}

impl<R: TransferRuntime> Drop for SourcePublication<R> {
    /// A publication whose frontier is still in flight detaches into the runtime's retirement
    /// queue; a failed one goes to its permanent side. Waits only when the queue's bounded side is
    /// full, and then for the oldest record (see [`crate::runtime::RetirementQueue`]).
    fn drop(&mut self) {
        let Some(mut record) = self.record.take() else {
            return;
        };
        let outcome = record.poll();
        if matches!(outcome, Some(Ok(()))) {
            return;
        }
        let terminal = matches!(outcome, Some(Err(_)));
        let Record {
            context,
            source,
            frontier,
            ..
        } = record;
        R::retirement(&context).retire(
            Retired {
                event: frontier,
                _source: source,
                _buffer: None,
            },
            terminal,
        );
        // The pin goes last: if it was the runtime's last owner, its teardown synchronises the
        // streams and then drops the queue holding the record.
        drop(context);
    }
}

/// The `Debug` of an owner whose record goes once it is used up: `fields` of the record, or
/// `name(gone)`.
fn debug_record<T>(
    f: &mut fmt::Formatter<'_>,
    (name, gone): (&str, &str),
    record: Option<&T>,
    fields: impl FnOnce(&mut fmt::DebugStruct<'_, '_>, &T),
) -> fmt::Result {
    match record {
        Some(record) => {
            let mut out = f.debug_struct(name);
            fields(&mut out, record);
            out.finish()
        }
        None => write!(f, "{name}({gone})"),
    }
}

impl<R: TransferRuntime> fmt::Debug for SourcePublication<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = ("SourcePublication", "consumed");
        debug_record(f, name, self.record.as_ref(), |out, r| {
            out.field("shape", &r.shape)
                .field("dtype", &r.dtype)
                .field("stream", &r.stream)
                .field("terminal", &r.failure.is_some());
        })
    }
}

/// A download in flight: the copy's event, and the one owner of what the copy touches (the
/// source and the buffer) until it completes.
struct DownloadRecord<R: TransferRuntime> {
    context: Arc<R::Context>,
    event: R::Event,
    buffer: PinnedHostBuffer,
    source: R::Source,
    bytes: usize,
    shape: Shape,
    dtype: DType,
}

/// An asynchronous copy of a publication into a [`PinnedHostBuffer`].
///
/// Holds the buffer, the retained allocation and the runtime pin until the copy completes.
/// Dropping it early detaches the record into the runtime's retirement queue; that waits only
/// when the queue's bounded side is full, and then for the oldest record.
pub struct PendingDownload<R: TransferRuntime> {
    record: Option<DownloadRecord<R>>,
}

impl<R: TransferRuntime> PendingDownload<R> {
    fn record(&self) -> &DownloadRecord<R> {
        self.record
            .as_ref()
            .expect("a live download always holds its record")
    }

    /// Bytes being copied.
    pub fn bytes(&self) -> usize {
        self.record().bytes
    }

    /// Shape of the value being copied.
    pub fn shape(&self) -> &Shape {
        &self.record().shape
    }

    /// Data type of the value being copied.
    pub fn dtype(&self) -> DType {
        self.record().dtype
    }

    /// Whether the copy has completed. Never waits.
    ///
    /// # Errors
    ///
    /// A failed copy is reported as its error, never as "not ready".
    pub fn is_ready(&self) -> Result<bool> {
        match R::poll_event(&self.record().event) {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(error)) => Err(error),
        }
    }

    /// Wait for the copy and take the buffer back.
    ///
    /// # Errors
    ///
    /// [`DownloadFailed`] with the buffer (contents unspecified) if the copy, or the producer it
    /// waited for, failed.
    pub fn wait(mut self) -> Result<PinnedHostBuffer, DownloadFailed> {
        let record = self
            .record
            .take()
            .expect("a live download always holds its record");
        let outcome = R::wait_event(&record.event);
        let DownloadRecord { buffer, .. } = record;
        match outcome {
            Ok(()) => Ok(buffer),
            Err(error) => Err(DownloadFailed { buffer, error }),
        }
    }
}

impl<R: TransferRuntime> PendingDownload<R> {
    /// Wait for the copy, and read the buffer as burn [`TensorData`] of the value's shape and
    /// dtype (a copy of its bytes); the buffer comes back too, for the next download.
    ///
    /// # Errors
    ///
    /// As [`PendingDownload::wait`].
    pub fn wait_data(self) -> Result<(TensorData, PinnedHostBuffer), DownloadFailed> {
        let (shape, dtype) = (self.shape().clone(), self.dtype());
        let buffer = self.wait()?;
        // The buffer's length is the value's byte length: `download_into` checked it.
        let data = TensorData::from_bytes_vec(buffer.as_bytes().to_vec(), shape, dtype);
        Ok((data, buffer))
    }
}

impl<R: TransferRuntime> Drop for PendingDownload<R> {
    fn drop(&mut self) {
        let Some(record) = self.record.take() else {
            return;
        };
        if R::poll_event(&record.event).is_some() {
            return;
        }
        let DownloadRecord {
            context,
            event,
            buffer,
            source,
            ..
        } = record;
        R::retirement(&context).retire(
            Retired {
                event,
                _source: source,
                _buffer: Some(buffer),
            },
            false,
        );
        drop(context);
    }
}

impl<R: TransferRuntime> fmt::Debug for PendingDownload<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = ("PendingDownload", "finished");
        debug_record(f, name, self.record.as_ref(), |out, r| {
            out.field("bytes", &r.bytes)
                .field("ready", &R::poll_event(&r.event).is_some());
        })
    }
}
