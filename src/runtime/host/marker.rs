//! Completion markers: the host device's equivalent of a CUDA event.

use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::{Error, Result};

enum State {
    Pending,
    Done,
    Failed(Error),
}

/// Set once, when the work it marks has finished (or failed); can be polled without waiting, or
/// waited on.
pub(crate) struct Marker {
    state: Mutex<State>,
    completed: Condvar,
}

impl Marker {
    /// A marker for work that has not run yet.
    pub(crate) fn pending() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::Pending),
            completed: Condvar::new(),
        })
    }

    /// A marker for work that is already complete (uploads).
    pub(crate) fn done() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::Done),
            completed: Condvar::new(),
        })
    }

    /// Record the outcome and wake every waiter. Only the first completion counts.
    pub(crate) fn complete(&self, outcome: Result<()>) {
        let mut state = self.state.lock();
        if matches!(*state, State::Pending) {
            *state = match outcome {
                Ok(()) => State::Done,
                Err(error) => State::Failed(error),
            };
            self.completed.notify_all();
        }
    }

    /// The outcome, if the work has finished. Never waits.
    pub(crate) fn poll(&self) -> Option<Result<()>> {
        match &*self.state.lock() {
            State::Pending => None,
            State::Done => Some(Ok(())),
            State::Failed(error) => Some(Err(error.clone())),
        }
    }

    /// Wait for the work to finish and return its outcome.
    pub(crate) fn wait(&self) -> Result<()> {
        let mut state = self.state.lock();
        loop {
            match &*state {
                State::Pending => self.completed.wait(&mut state),
                State::Done => return Ok(()),
                State::Failed(error) => return Err(error.clone()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Property: a marker is observable as pending, completes once, and wakes waiters.
    use super::*;

    #[test]
    fn pending_then_completed_once_and_waiters_wake() {
        let marker = Marker::pending();
        assert!(marker.poll().is_none());
        let waiter = {
            let marker = marker.clone();
            std::thread::spawn(move || marker.wait())
        };
        marker.complete(Err(Error::Runtime("first".into())));
        marker.complete(Ok(()));
        assert_eq!(waiter.join().unwrap(), Err(Error::Runtime("first".into())));
        assert_eq!(marker.poll(), Some(Err(Error::Runtime("first".into()))));
    }
}
