//! The crate's error type.
//!
//! Errors come in two kinds, and the distinction matters for who receives them:
//!
//! * **Rejections** happen at the call that submitted something (bad shapes, a tensor of another
//!   client, a re-entrant call). Nothing was enqueued; the caller gets the error immediately and
//!   keeps everything it passed by reference (operations that take tensors by value hand them back
//!   in [`Rejected`]).
//! * **Execution failures** happen later, when a lazily queued operation runs (its executor
//!   returned an error or panicked) or when the device ran the kernel. They *travel with the data*:
//!   the failure is recorded on every tensor the operation was going to write, operations that read
//!   such a tensor are skipped and propagate the same error, and the caller receives it from the
//!   read of an affected tensor — the point where it is actually waiting for that data.

use std::fmt;
use std::sync::Arc;

use burn_backend::DType;
use burn_ir::TensorId;

/// Errors returned by fusion-streams.
///
/// The enum is `#[non_exhaustive]`: match the variants you handle and keep a catch-all arm.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operation's executor returned an error. Recorded on the operation's outputs and
    /// delivered by the read of one of them (or of anything computed from them).
    #[error("operation `{op}` failed: {message}")]
    OperationFailed {
        /// Name of the failing operation.
        op: Arc<str>,
        /// What the executor reported.
        message: Arc<str>,
    },
    /// An operation's executor panicked. The panic was contained: the engine keeps working and
    /// the panic message is recorded on the operation's outputs.
    #[error("operation `{op}` panicked: {message}")]
    OperationPanicked {
        /// Name of the panicking operation.
        op: Arc<str>,
        /// The panic payload, when it was a string.
        message: Arc<str>,
    },
    /// An operation was skipped because one of its inputs carried an error, so it wrote none of
    /// its outputs. `root` is that error as the failing operation recorded it; `skipped` is the
    /// first operation skipped because of it. Every tensor computed, directly or not, from a failed
    /// one reads as this; [`Error::root`] gives the original failure.
    #[error("{root} (propagated: `{skipped}` was skipped because its input carried this error)")]
    Propagated {
        /// The first operation skipped because of the failure.
        skipped: Arc<str>,
        /// The original failure (never itself `Propagated`).
        root: Arc<Error>,
    },
    /// The device failed while running a kernel (reported asynchronously, after dispatch).
    #[error("kernel `{kernel}` failed on the device: {message}")]
    KernelFailed {
        /// Name of the kernel.
        kernel: Arc<str>,
        /// What the device reported.
        message: Arc<str>,
    },
    /// An operation reported success without producing one of its declared outputs.
    #[error("operation `{op}` did not write its output {id}")]
    OutputNotWritten {
        /// Name of the operation.
        op: Arc<str>,
        /// The output that was never written.
        id: TensorId,
    },
    /// An operation found an input with neither a handle nor an error record. This indicates a
    /// misbehaving executor (one that removed a handle it did not own).
    #[error("no handle for tensor {id} when `{op}` ran")]
    MissingHandle {
        /// Name of the operation that needed the handle.
        op: Arc<str>,
        /// The missing tensor.
        id: TensorId,
    },
    /// A debug-build check of the SSA invariant failed: an operation output already had a handle.
    #[error("SSA violation: output {id} of `{op}` was already registered")]
    SsaViolation {
        /// Name of the operation.
        op: Arc<str>,
        /// The output id that was reused.
        id: TensorId,
    },
    /// The engine was called from inside an operation it is executing. Nothing was done; the
    /// call returned instead of deadlocking.
    #[error("re-entrant call: {what} was called from inside an executing operation")]
    Reentrant {
        /// The API that was called.
        what: &'static str,
    },
    /// Operand shapes do not fit the operation.
    #[error("shape mismatch in `{op}`: {detail}")]
    ShapeMismatch {
        /// Name of the operation.
        op: Arc<str>,
        /// Which shapes, and why they do not fit.
        detail: String,
    },
    /// Operand data types differ, or do not fit the operation.
    #[error("dtype mismatch in `{op}`: expected {expected:?}, found {found:?}")]
    DTypeMismatch {
        /// Name of the operation.
        op: Arc<str>,
        /// The data type required.
        expected: DType,
        /// The data type given.
        found: DType,
    },
    /// The runtime does not implement this data type for this operation.
    #[error("dtype {dtype:?} is not supported by `{op}` on this runtime")]
    UnsupportedDType {
        /// Name of the operation.
        op: Arc<str>,
        /// The unsupported data type.
        dtype: DType,
    },
    /// A tensor belongs to another client (another device or another engine instance).
    #[error("tensor {id} belongs to another client ({detail})")]
    DeviceMismatch {
        /// The foreign tensor.
        id: TensorId,
        /// The two devices involved.
        detail: String,
    },
    /// Host data handed to the engine is malformed (length does not match the shape, ...).
    #[error("invalid host data: {0}")]
    InvalidData(String),
    /// An operation description is inconsistent with the tensors it was registered with.
    #[error("invalid operation `{op}`: {detail}")]
    InvalidOperation {
        /// Name of the operation.
        op: Arc<str>,
        /// What is inconsistent.
        detail: String,
    },
    /// A held session is already open on this client and stream.
    #[error("a held session is already open on {stream} (one per client and stream)")]
    SessionHeld {
        /// The stream the existing session holds.
        stream: burn_backend::StreamId,
    },
    /// A buffer's size does not match the data it should hold: a pinned buffer given to a
    /// download, or a device buffer registered for a tensor of another shape.
    #[error("buffer of {found} bytes, {expected} needed")]
    BufferSize {
        /// Bytes the data needs.
        expected: usize,
        /// Bytes the buffer has.
        found: usize,
    },
    /// A setting names something that does not exist (an unknown fuser, ...).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// The runtime reported an error outside of a kernel (allocation, setup, teardown).
    #[error("runtime error: {0}")]
    Runtime(Arc<str>),
    /// A size computed from the caller's input cannot be represented or exceeds what the runtime
    /// can ever allocate (a shape whose element count overflows, a buffer longer than the
    /// address space). Refused before anything was allocated or queued.
    #[error("{what} is too large: {detail}")]
    TooLarge {
        /// What was being sized.
        what: Arc<str>,
        /// The sizes involved.
        detail: String,
    },
    /// An allocation the runtime attempted failed. On the host runtime a kernel's output that
    /// does not fit in memory is reported here (recorded on the tensor, like any device failure),
    /// never by aborting the process.
    #[error("out of memory: could not allocate {bytes} bytes for {what}")]
    OutOfMemory {
        /// What the memory was for.
        what: Arc<str>,
        /// Bytes requested.
        bytes: usize,
    },
}

impl Error {
    /// The error a custom executor returns to fail its operation:
    /// [`Error::OperationFailed`] with the operation's name and a message.
    pub fn operation(op: &str, message: impl fmt::Display) -> Self {
        Error::OperationFailed {
            op: op.into(),
            message: message.to_string().into(),
        }
    }

    pub(crate) fn from_panic(op: &str, payload: Box<dyn std::any::Any + Send>) -> Self {
        let message: Arc<str> = if let Some(s) = payload.downcast_ref::<&'static str>() {
            (*s).into()
        } else if let Some(s) = payload.downcast_ref::<String>() {
            s.as_str().into()
        } else {
            "non-string panic payload".into()
        };
        drop_payload(payload);
        Error::OperationPanicked {
            op: op.into(),
            message,
        }
    }
}

/// Drop a panic payload without letting a panic of its destructor escape: code the engine does
/// not own chose the payload, and its `Drop` runs wherever the engine lets go of it (a second
/// payload is leaked rather than dropped: a destructor that panicked once may do it again).
pub(crate) fn drop_payload(payload: Box<dyn std::any::Any + Send>) {
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(payload)));
    if let Err(second) = dropped {
        std::mem::forget(second);
    }
}

impl Error {
    /// The failure this error comes from: for [`Error::Propagated`], the error of the operation
    /// that failed first; otherwise the error itself.
    ///
    /// ```
    /// use fusion_streams::{Error, FusionClient, host::HostRuntime};
    /// use burn_backend::TensorData;
    ///
    /// let client = FusionClient::<HostRuntime>::new(Default::default())?;
    /// let x = client.from_data(TensorData::new(vec![1.0f32, 2.0], [2]))?;
    /// let failed = client
    ///     .op("refuse")
    ///     .read(&x)
    ///     .output([2], burn_backend::DType::F32)
    ///     .execute(|_: &burn_ir::CustomOpIr, _: &mut burn_ir::HandleContainer<_>| {
    ///         Err(Error::operation("refuse", "bad input"))
    ///     })
    ///     .map_err(|rejected| rejected.error)?
    ///     .remove(0);
    /// let downstream = failed.exp()?;
    /// let error = downstream.read().unwrap_err();
    /// assert!(error.is_propagated());
    /// assert_eq!(error.root(), &Error::operation("refuse", "bad input"));
    /// assert_eq!(
    ///     error.to_string(),
    ///     "operation `refuse` failed: bad input \
    ///      (propagated: `exp` was skipped because its input carried this error)"
    /// );
    /// # Ok::<(), fusion_streams::Error>(())
    /// ```
    pub fn root(&self) -> &Error {
        match self {
            Error::Propagated { root, .. } => root,
            error => error,
        }
    }

    /// Whether this error reached its tensor through a skipped operation (see
    /// [`Error::Propagated`]) rather than from the operation that produces it.
    pub fn is_propagated(&self) -> bool {
        matches!(self, Error::Propagated { .. })
    }

    /// The error recorded on the outputs of `skipped`, an operation that reads a tensor failed
    /// with `self`: the root failure, with the first operation skipped on its way.
    pub(crate) fn propagated_to(&self, skipped: &str) -> Error {
        match self {
            Error::Propagated { .. } => self.clone(),
            root => Error::Propagated {
                skipped: skipped.into(),
                root: Arc::new(root.clone()),
            },
        }
    }

    /// A panic inside a kernel or a device call: the device failed, not an operation's executor.
    pub(crate) fn from_kernel_panic(kernel: &str, payload: Box<dyn std::any::Any + Send>) -> Self {
        match Error::from_panic(kernel, payload) {
            Error::OperationPanicked { message, .. } => Error::KernelFailed {
                kernel: kernel.into(),
                message,
            },
            other => other,
        }
    }
}

/// A rejected call that took tensors by value: the error and every tensor handed back untouched.
///
/// Returned by the calls that consume their operands (see [`crate::OpBuilder::consume`]), so that
/// a bad input never costs the caller its data.
pub struct Rejected<T> {
    /// Why the call was rejected.
    pub error: Error,
    /// The operands, in the order they were given, unchanged.
    pub returned: Vec<T>,
}

impl<T> Rejected<T> {
    /// The underlying error (the operands stay in `returned`).
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The error, dropping the returned operands.
    pub fn into_error(self) -> Error {
        self.error
    }
}

impl<T> fmt::Debug for Rejected<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rejected")
            .field("error", &self.error)
            .field("returned", &self.returned.len())
            .finish()
    }
}

impl<T> fmt::Display for Rejected<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({} operand(s) returned)",
            self.error,
            self.returned.len()
        )
    }
}

impl<T> std::error::Error for Rejected<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<T> From<Rejected<T>> for Error {
    fn from(rejected: Rejected<T>) -> Self {
        rejected.error
    }
}

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
