//! Errors of the transfer module. Each says what the caller still owns.

use std::fmt;

use super::SourcePublication;
use crate::runtime::StreamRuntime;
use crate::runtime::{PinnedHostBuffer, TransferRuntime};
use crate::{Error, FusionTensor};

/// A value [`crate::transfer::HeldSession::publish`] refused before enqueueing anything.
#[derive(Debug)]
pub struct PublicationRejected<R: StreamRuntime> {
    /// The value, unchanged: still a live tensor of its client.
    pub value: FusionTensor<R>,
    /// Why it was refused.
    pub reason: Error,
}

/// A publication that could not be admitted, or whose completion could not be proven.
#[non_exhaustive]
#[derive(Debug)]
pub enum PublicationAdmissionError<R: StreamRuntime> {
    /// Nothing was enqueued, so the caller keeps the value.
    Rejected(Box<PublicationRejected<R>>),
    /// The enqueue may have happened, or the publication has already failed terminally: no owner
    /// is returned. A terminal publication still owns its record; dropping it moves the record to
    /// the retirement queue's permanent side.
    Unproven {
        /// The failure.
        error: Error,
    },
}

impl<R: StreamRuntime> PublicationAdmissionError<R> {
    /// The underlying error.
    pub fn error(&self) -> &Error {
        match self {
            PublicationAdmissionError::Rejected(r) => &r.reason,
            PublicationAdmissionError::Unproven { error } => error,
        }
    }
}

impl<R: StreamRuntime> fmt::Display for PublicationAdmissionError<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PublicationAdmissionError::Rejected(r) => {
                write!(f, "publication rejected (value returned): {}", r.reason)
            }
            PublicationAdmissionError::Unproven { error } => {
                write!(f, "publication unproven: {error}")
            }
        }
    }
}

impl<R: StreamRuntime> std::error::Error for PublicationAdmissionError<R> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.error())
    }
}

/// A download [`SourcePublication::download_into`] refused before enqueueing anything.
#[derive(Debug)]
pub struct DownloadRejected<R: TransferRuntime> {
    /// The publication, frontier included, as it was.
    pub publication: SourcePublication<R>,
    /// The buffer, untouched.
    pub buffer: PinnedHostBuffer,
    /// Why it was refused.
    pub reason: Error,
}

/// The transfer's error carrier: consumption can refuse before any enqueue and must then hand
/// both submitted owners back.
#[non_exhaustive]
#[derive(Debug)]
pub enum PublicationError<R: TransferRuntime> {
    /// Nothing was enqueued: the publication and the buffer come back.
    Rejected(Box<DownloadRejected<R>>),
}

impl<R: TransferRuntime> PublicationError<R> {
    /// The underlying error.
    pub fn error(&self) -> &Error {
        match self {
            PublicationError::Rejected(r) => &r.reason,
        }
    }

    /// Take back the publication and the buffer.
    pub fn into_parts(self) -> (SourcePublication<R>, PinnedHostBuffer, Error) {
        match self {
            PublicationError::Rejected(r) => {
                let r = *r;
                (r.publication, r.buffer, r.reason)
            }
        }
    }
}

impl<R: TransferRuntime> fmt::Display for PublicationError<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "download refused (publication and buffer returned): {}",
            self.error()
        )
    }
}

impl<R: TransferRuntime> std::error::Error for PublicationError<R> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.error())
    }
}

/// A download whose copy failed on the device. The buffer comes back (its contents are
/// unspecified) so it can be reused.
#[derive(Debug)]
pub struct DownloadFailed {
    /// The buffer.
    pub buffer: PinnedHostBuffer,
    /// The failure.
    pub error: Error,
}

impl fmt::Display for DownloadFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "download failed (buffer returned): {}", self.error)
    }
}

impl std::error::Error for DownloadFailed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

// One way out of every rejection type: `error()` borrows the error (the owners stay with the
// caller, to take back), `into_error()` and `?` (through `From`) keep the error and drop the
// owners.

impl<R: StreamRuntime> PublicationAdmissionError<R> {
    /// The error, dropping any returned value.
    pub fn into_error(self) -> Error {
        match self {
            PublicationAdmissionError::Rejected(r) => r.reason,
            PublicationAdmissionError::Unproven { error } => error,
        }
    }
}

impl<R: TransferRuntime> PublicationError<R> {
    /// The error, dropping the returned publication and buffer.
    pub fn into_error(self) -> Error {
        self.into_parts().2
    }
}

impl DownloadFailed {
    /// The underlying error.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The error, dropping the returned buffer.
    pub fn into_error(self) -> Error {
        self.error
    }
}

impl<R: StreamRuntime> From<PublicationAdmissionError<R>> for Error {
    fn from(error: PublicationAdmissionError<R>) -> Self {
        error.into_error()
    }
}

impl<R: TransferRuntime> From<PublicationError<R>> for Error {
    fn from(error: PublicationError<R>) -> Self {
        error.into_error()
    }
}

impl From<DownloadFailed> for Error {
    fn from(error: DownloadFailed) -> Self {
        error.into_error()
    }
}
