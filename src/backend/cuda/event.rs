//! [`CudaEvent`]: the one completion concept of the CUDA transfer path, as a small state machine.
//!
//! ```text
//! Pending ──(frontier reached / failed)──────────────────────────────▶ Done(outcome)
//! Pending ──(copy enqueued)──▶ Enqueued(CUevent) ──(query / wait)──▶ Done(outcome)
//! ```
//!
//! `Pending` is set by whoever will complete the event (a waiter thread); `Enqueued` holds a CUDA
//! event recorded behind a copy, destroyed on the transition to `Done`. The event owns nothing
//! the copy touches: its owner (a download record, or a retired one) holds the source and the
//! buffer until the event has completed.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{result, sys};
use parking_lot::{Condvar, Mutex};

use super::driver::{PrimaryContext, device_fault};
use crate::Result;

pub(super) enum State {
    /// Not reached yet (a frontier), or not enqueued yet (a copy waiting for its frontier).
    Pending,
    /// A copy enqueued on a copy stream, with the CUDA event recorded behind it.
    Enqueued(sys::CUevent),
    Done(Result<()>),
}

struct EventInner {
    state: Mutex<State>,
    changed: Condvar,
    primary: Arc<PrimaryContext>,
}

// SAFETY: the raw `CUevent` in `State` is only used under the mutex, with the primary context
// made current first; the driver accepts it from any thread.
unsafe impl Send for EventInner {}
// SAFETY: see `Send`.
unsafe impl Sync for EventInner {}

/// A completion event of the CUDA runtime: a frontier, or a copy's CUDA event.
#[derive(Clone)]
pub struct CudaEvent(Arc<EventInner>);

impl fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &*self.0.state.lock() {
            State::Pending => "pending",
            State::Enqueued(_) => "enqueued",
            State::Done(Ok(())) => "done",
            State::Done(Err(_)) => "failed",
        };
        f.debug_tuple("CudaEvent").field(&state).finish()
    }
}

impl CudaEvent {
    pub(super) fn pending(primary: &Arc<PrimaryContext>) -> Self {
        Self(Arc::new(EventInner {
            state: Mutex::new(State::Pending),
            changed: Condvar::new(),
            primary: primary.clone(),
        }))
    }

    /// Leave `Pending` (only its completer calls this, once).
    pub(super) fn set(&self, state: State) {
        let old = std::mem::replace(&mut *self.0.state.lock(), state);
        self.0.changed.notify_all();
        debug_assert!(matches!(old, State::Pending));
    }

    fn finish(inner: &EventInner, state: &mut State, outcome: Result<()>) {
        if let State::Enqueued(event) = std::mem::replace(state, State::Done(outcome)) {
            let _ = inner.primary.make_current();
            // SAFETY: the event was created behind a copy and is destroyed once, here, after it
            // completed (or failed).
            let _ = unsafe { result::event::destroy(event) };
        }
    }

    /// The outcome if the event has completed. Never waits.
    pub(crate) fn poll(&self) -> Option<Result<()>> {
        let mut state = self.0.state.lock();
        let event = match &*state {
            State::Pending => return None,
            State::Done(outcome) => return Some(outcome.clone()),
            State::Enqueued(event) => *event,
        };
        if let Err(error) = self.0.primary.make_current() {
            Self::finish(&self.0, &mut state, Err(error.clone()));
            return Some(Err(error));
        }
        // SAFETY: `event` is alive: only `finish`, under this lock, destroys it.
        let outcome = match unsafe { sys::cuEventQuery(event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            sys::CUresult::CUDA_ERROR_NOT_READY => return None,
            error => Err(device_fault("cuEventQuery", error)),
        };
        Self::finish(&self.0, &mut state, outcome.clone());
        Some(outcome)
    }

    /// Wait for the event.
    pub(crate) fn wait(&self) -> Result<()> {
        spin_until(|| !matches!(*self.0.state.lock(), State::Pending));
        let mut state = self.0.state.lock();
        loop {
            match &*state {
                State::Pending => self.0.changed.wait(&mut state),
                State::Done(outcome) => return outcome.clone(),
                State::Enqueued(event) => {
                    let event = *event;
                    let outcome = self.0.primary.make_current().and_then(|()| {
                        // SAFETY: `event` is alive while the lock is held.
                        unsafe { result::event::synchronize(event) }
                            .map_err(|e| device_fault("cuEventSynchronize", e))
                    });
                    Self::finish(&self.0, &mut state, outcome.clone());
                    return outcome;
                }
            }
        }
    }
}

impl Drop for EventInner {
    fn drop(&mut self) {
        // An event dropped with its copy in flight is destroyed at once: the driver releases it
        // when the copy completes, and what the copy touches is held by the event's owner (the
        // contract of `TransferRuntime::download`), not by the event. Dropping never waits.
        if let State::Enqueued(event) = *self.state.get_mut()
            && self.primary.make_current().is_ok()
        {
            // SAFETY: last owner of the event.
            let _ = unsafe { result::event::destroy(event) };
        }
    }
}

/// How long a waiter on a hand-off between threads spins before it sleeps. A frontier or a copy
/// that is about to be ready usually is within a few microseconds; a futex wake-up costs about
/// as much again, on each of the two hand-offs of a download. Bounded, so a long wait costs at
/// most this much CPU.
const SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// Spin (re-checking `ready`) for at most [`SPIN`]; whether it became ready.
pub(super) fn spin_until(mut ready: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    loop {
        if ready() {
            return true;
        }
        if start.elapsed() >= SPIN {
            return false;
        }
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    }
}
