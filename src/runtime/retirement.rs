//! The retirement queue: where dropped transfers wait for the device without blocking the drop.
//!
//! # Lifecycle of a record
//!
//! 1. **Detach.** A [`crate::transfer::SourcePublication`] or [`crate::transfer::PendingDownload`]
//!    dropped while its device work is in flight hands its record (the completion event plus
//!    everything the device may still touch: the retained allocation, the destination buffer) to
//!    [`RetirementQueue::retire`]. The drop does not wait.
//! 2. **Sweep.** Every `retire` and every [`RetirementQueue::sweep`] (which the runtime's
//!    `synchronize` runs) polls *all* drainable records and releases each one whose event has
//!    completed, successfully or not. A stuck record anywhere in the queue, the oldest included,
//!    never holds back a later one that has completed (no head-of-line blocking).
//! 3. **Backpressure.** The drainable side is bounded. When a `retire` finds it full after a
//!    sweep, it resolves the *oldest* record: waits for its event (outside the queue's lock), then
//!    releases it. This is the only wait a drop can meet, and it is bounded by device work already
//!    submitted.
//! 4. **Permanent retention.** A *terminal* record — a publication whose frontier failed, where
//!    the state of the allocation is unknown — never becomes drainable: it goes to the permanent
//!    side and stays there until the queue itself is dropped, which happens only after the runtime
//!    has synchronised its streams during teardown.
//! 5. **Teardown.** Dropping the queue releases everything it holds. Its owner (the runtime
//!    context) drops it only after every stream has finished.
//!
//! `mem::forget` on a publication or a download bypasses all of this: the record leaks in place,
//! and so does its pin on the runtime.

use std::collections::VecDeque;

use crate::loom::sync::Mutex;

use crate::Result;

/// A record the queue can poll and wait on.
pub trait Retire: Send {
    /// The outcome of the record's device work, if it has finished. Must not wait.
    fn poll(&self) -> Option<Result<()>>;
    /// Wait for the record's device work to finish.
    fn wait(&self) -> Result<()>;
}

/// Counters of a [`RetirementQueue`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetirementStats {
    /// Records waiting for their device work (drainable side).
    pub pending: usize,
    /// Terminal records kept until teardown.
    pub permanent: usize,
    /// Records released so far.
    pub released: u64,
    /// Records that had to be waited for because the queue was full.
    pub resolved_at_capacity: u64,
}

struct State<T> {
    drainable: VecDeque<T>,
    permanent: Vec<T>,
    released: u64,
    resolved_at_capacity: u64,
}

/// A bounded queue of detached transfer records; see the module docs for the lifecycle.
pub struct RetirementQueue<T: Retire> {
    capacity: usize,
    state: Mutex<State<T>>,
}

impl<T: Retire> RetirementQueue<T> {
    /// A queue holding at most `capacity` (at least 1) drainable records.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            state: Mutex::new(State {
                drainable: VecDeque::new(),
                permanent: Vec::new(),
                released: 0,
                resolved_at_capacity: 0,
            }),
        }
    }

    /// The bound of the drainable side.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Detach a record whose device work may still be running. `terminal` records go to the
    /// permanent side.
    pub fn retire(&self, record: T, terminal: bool) {
        tracing::trace!(terminal, "record retired with device work in flight");
        let oldest = {
            let mut state = self.state.lock();
            if terminal {
                state.permanent.push(record);
                return;
            }
            Self::sweep_locked(&mut state);
            state.drainable.push_back(record);
            if state.drainable.len() > self.capacity {
                state.resolved_at_capacity += 1;
                state.drainable.pop_front()
            } else {
                None
            }
        };
        if let Some(oldest) = oldest {
            // Outside the lock: other threads keep retiring and sweeping meanwhile. The outcome
            // does not matter here, only that the device is done with the record.
            let _ = oldest.wait();
            drop(oldest);
            self.state.lock().released += 1;
        }
    }

    /// Release every drainable record whose device work has finished. Returns how many.
    pub fn sweep(&self) -> usize {
        Self::sweep_locked(&mut self.state.lock())
    }

    fn sweep_locked(state: &mut State<T>) -> usize {
        let before = state.drainable.len();
        state.drainable.retain(|record| record.poll().is_none());
        let released = before - state.drainable.len();
        state.released += released as u64;
        released
    }

    /// The queue's counters.
    pub fn stats(&self) -> RetirementStats {
        let state = self.state.lock();
        RetirementStats {
            pending: state.drainable.len(),
            permanent: state.permanent.len(),
            released: state.released,
            resolved_at_capacity: state.resolved_at_capacity,
        }
    }
}

impl<T: Retire> std::fmt::Debug for RetirementQueue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetirementQueue")
            .field("capacity", &self.capacity)
            .field("stats", &self.stats())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    //! Properties: completed records are released in any order (no head-of-line blocking); a
    //! full queue resolves its oldest record; terminal records are never released before
    //! teardown; records are released exactly once.
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::runtime::host::marker::Marker;

    struct Record {
        done: Arc<Marker>,
        dropped: Arc<AtomicUsize>,
    }

    impl Retire for Record {
        fn poll(&self) -> Option<Result<()>> {
            self.done.poll()
        }
        fn wait(&self) -> Result<()> {
            self.done.wait()
        }
    }

    impl Drop for Record {
        fn drop(&mut self) {
            self.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Records that count their drops.
    #[derive(Default)]
    struct Records(Arc<AtomicUsize>);

    impl Records {
        /// A record and the marker that completes it.
        fn new_record(&self) -> (Record, Arc<Marker>) {
            let done = Marker::pending();
            let dropped = self.0.clone();
            (
                Record {
                    done: done.clone(),
                    dropped,
                },
                done,
            )
        }

        /// Retire a new record (not terminal) into `queue`; returns its marker.
        fn retire_into(&self, queue: &RetirementQueue<Record>) -> Arc<Marker> {
            let (record, done) = self.new_record();
            queue.retire(record, false);
            done
        }

        fn dropped(&self) -> usize {
            self.0.load(Ordering::SeqCst)
        }
    }

    #[test]
    fn a_stuck_oldest_record_does_not_hold_back_completed_ones() {
        let (records, queue) = (Records::default(), RetirementQueue::new(8));
        let _stuck = records.retire_into(&queue);
        let later: Vec<_> = (0..3).map(|_| records.retire_into(&queue)).collect();
        for done in &later {
            done.complete(Ok(()));
        }
        assert_eq!(queue.sweep(), 3);
        assert_eq!(records.dropped(), 3, "all three released");
        let s = queue.stats();
        assert_eq!((s.pending, s.released), (1, 3), "only the stuck one waits");
    }

    #[test]
    fn a_failed_record_is_released_like_a_completed_one() {
        let (records, queue) = (Records::default(), RetirementQueue::new(8));
        let done = records.retire_into(&queue);
        done.complete(Err(crate::Error::Runtime("copy failed".into())));
        assert_eq!(queue.sweep(), 1);
        assert_eq!(records.dropped(), 1);
    }

    #[test]
    fn a_full_queue_resolves_its_oldest_record() {
        let (records, queue) = (Records::default(), Arc::new(RetirementQueue::new(2)));
        let first_done = records.retire_into(&queue);
        let _second_done = records.retire_into(&queue);
        let (third, _third_done) = records.new_record();
        let retiring = {
            let queue = queue.clone();
            std::thread::spawn(move || queue.retire(third, false))
        };
        // The third retire must wait for the first (oldest) record.
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !retiring.is_finished(),
            "did not wait for the oldest record"
        );
        first_done.complete(Ok(()));
        retiring.join().unwrap();
        let s = queue.stats();
        assert_eq!((s.pending, s.released, s.resolved_at_capacity), (2, 1, 1));
        assert_eq!(records.dropped(), 1);
    }

    #[test]
    fn terminal_records_are_kept_until_teardown_and_released_once() {
        let (records, queue) = (Records::default(), RetirementQueue::new(2));
        let (terminal, done) = records.new_record();
        done.complete(Ok(()));
        queue.retire(terminal, true);
        assert_eq!(queue.sweep(), 0, "never swept");
        assert_eq!(queue.stats().permanent, 1);
        assert_eq!(records.dropped(), 0);
        drop(queue);
        assert_eq!(records.dropped(), 1, "released once, at teardown");
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    //! Every interleaving of retiring, resolving at capacity, completing and sweeping: each
    //! record is released exactly once, never before its device work has finished, and nothing
    //! is left once all work has finished and the queue is swept.
    use super::*;
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use loom::thread;

    struct Record {
        done: Arc<AtomicBool>,
        released: Arc<AtomicUsize>,
    }

    impl Retire for Record {
        fn poll(&self) -> Option<Result<()>> {
            self.done.load(Ordering::Acquire).then_some(Ok(()))
        }
        fn wait(&self) -> Result<()> {
            while !self.done.load(Ordering::Acquire) {
                thread::yield_now();
            }
            Ok(())
        }
    }

    impl Drop for Record {
        fn drop(&mut self) {
            assert!(
                self.done.load(Ordering::Acquire),
                "released while its device work was running"
            );
            self.released.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn loom_retire_at_capacity_and_sweep_release_each_record_once() {
        loom::model(|| {
            let queue = Arc::new(RetirementQueue::new(1));
            let released = Arc::new(AtomicUsize::new(0));
            let done: Vec<Arc<AtomicBool>> =
                (0..2).map(|_| Arc::new(AtomicBool::new(false))).collect();
            let retirers: Vec<_> = done
                .iter()
                .map(|d| {
                    let (queue, record) = (
                        queue.clone(),
                        Record {
                            done: d.clone(),
                            released: released.clone(),
                        },
                    );
                    // The second to retire finds the queue full and resolves the oldest.
                    thread::spawn(move || queue.retire(record, false))
                })
                .collect();
            // The device finishes both, then a synchronize sweeps.
            for d in &done {
                d.store(true, Ordering::Release);
            }
            queue.sweep();
            retirers.into_iter().for_each(|t| t.join().unwrap());
            queue.sweep();
            let s = queue.stats();
            assert_eq!(s.pending, 0);
            assert_eq!(s.released, 2);
            assert_eq!(released.load(Ordering::SeqCst), 2);
        });
    }
}
