//! The launch gate: how many threads run work on one device at once.
//!
//! # Why a bound helps
//!
//! cubecl 0.10 hands every launch and allocation of every thread to one device thread per device,
//! through a buffer of 32 tasks. A thread that finds the buffer full spins (up to 524,288 spin
//! hints) before it yields, waiting for the device thread to take the buffer. With many threads
//! launching, the spinners compete with the device thread that must empty the buffer, and every
//! thread's launches slow down together.
//!
//! Measured on an H100 host with 16 hardware threads (`docs/BENCHMARKS.md`, "The launch gate"):
//! 16 threads running the backend bench's small MLP forward reached 0.73–0.85 of the rate one
//! thread reaches launching the same kernels back to back (below their rate at 8 threads,
//! 1.16–1.28). Bounded to 15 or 12 launching at once, 0.81–0.90; to 8, 1.07–1.21; to 6, 1.12.
//! So the bound that helps is near half the hardware threads, not one fewer than them: what
//! the device thread loses is more than a core to run on (the SMT sibling it shares a core with
//! is one candidate; the machine's topology was not read). On an H200 host, also with 16:
//! 0.68–0.93 unbounded, 1.12–1.15 bounded at 6 or 8, and at 8 about 2% of the waits ended past
//! the gate ([`EngineStats::launch_overdrafts`](crate::EngineStats::launch_overdrafts)).
//!
//! # What the gate does
//!
//! At most `limit` threads hold a permit of a gate at once. The engine takes one around each
//! execution of a stream's queue and each upload: the work that sends launches and allocations
//! to the device. Reads and syncs do not take one: they wait for the device, and a thread
//! waiting there spins on nothing and must not keep another from launching.
//!
//! * A thread that finds no permit free sleeps until one is given back (not spinning: the point
//!   is to leave the cores to the threads that launch and to the device thread).
//! * **A wait is bounded** ([`PATIENCE`]): a thread that has waited that long goes ahead without
//!   a permit. The gate can delay a thread, never stop it. That matters because a thread holding
//!   a permit can wait for another stream's lock (draining it to share one of its tensors), and
//!   the thread holding that lock can be one waiting at the gate.
//! * **Re-entrant:** a thread that holds a permit of a gate takes no second one from it (an
//!   execution that drains another stream of the same engine runs under the permit it has).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// The longest a thread waits for a permit before it goes ahead without one (every engine's
/// gate; tests may set another).
pub(crate) const PATIENCE: Duration = Duration::from_millis(1);

/// A bound on how many threads run work on one device at once (see the module docs).
#[derive(Debug)]
pub(crate) struct LaunchGate {
    limit: usize,
    /// How long a thread waits for a permit before it goes ahead: [`PATIENCE`], except in tests.
    patience: Duration,
    /// Permits held.
    inside: AtomicUsize,
    /// Threads asleep waiting for a permit.
    waiting: AtomicUsize,
    /// Entries that found no permit free and slept ([`EngineStats::launch_waits`]).
    ///
    /// [`EngineStats::launch_waits`]: crate::EngineStats::launch_waits
    waits: AtomicU64,
    /// Of those, the entries that went ahead without a permit after [`PATIENCE`]
    /// ([`EngineStats::launch_overdrafts`]).
    ///
    /// [`EngineStats::launch_overdrafts`]: crate::EngineStats::launch_overdrafts
    overdrafts: AtomicU64,
    lock: Mutex<()>,
    wake: Condvar,
}

std::thread_local! {
    /// The gate whose permit this thread holds, if any (by address, for re-entry only).
    static HELD: Cell<usize> = const { Cell::new(0) };
}

impl LaunchGate {
    /// A gate letting `limit` threads through at once (at least 1).
    pub(crate) fn new(limit: usize) -> Self {
        Self::with_patience(limit, PATIENCE)
    }

    /// A gate whose waits last at most `patience`: tests that count threads inside must not
    /// depend on how fast the machine schedules them, so they wait for as long as it takes.
    fn with_patience(limit: usize, patience: Duration) -> Self {
        Self {
            limit: limit.max(1),
            patience,
            inside: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            waits: AtomicU64::new(0),
            overdrafts: AtomicU64::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        }
    }

    /// How many threads it lets through at once.
    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// Entries that slept for a permit, and those of them that went ahead without one, since
    /// the gate was made. Counted on the waiting path only: a permit taken at once touches no
    /// counter.
    pub(crate) fn waits_and_overdrafts(&self) -> (u64, u64) {
        (
            self.waits.load(Ordering::Relaxed),
            self.overdrafts.load(Ordering::Relaxed),
        )
    }

    /// Wait for a permit (at most the gate's patience, [`PATIENCE`]); none is taken by a thread
    /// that holds one already.
    pub(crate) fn enter(&self) -> Permit<'_> {
        let me = self as *const Self as usize;
        let outer = HELD.with(Cell::get);
        if outer == me {
            return Permit { gate: None, outer };
        }
        if !self.try_take() {
            self.wait();
        }
        HELD.with(|held| held.set(me));
        Permit {
            gate: Some(self),
            outer,
        }
    }

    fn try_take(&self) -> bool {
        self.inside
            .fetch_update(Ordering::SeqCst, Ordering::Relaxed, |n| {
                (n < self.limit).then_some(n + 1)
            })
            .is_ok()
    }

    #[cold]
    #[inline(never)]
    fn wait(&self) {
        self.waits.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + self.patience;
        let mut lock = self.lock.lock();
        // Counted before the last look, so a permit given back after it wakes this thread
        // (`Permit::drop` reads `waiting` after giving its permit back; both are SeqCst).
        self.waiting.fetch_add(1, Ordering::SeqCst);
        while !self.try_take() {
            if self.wake.wait_until(&mut lock, deadline).timed_out() {
                // Overdrawn: counted as inside, so its permit's return balances.
                self.inside.fetch_add(1, Ordering::SeqCst);
                self.overdrafts.fetch_add(1, Ordering::Relaxed);
                break;
            }
        }
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }

    fn give_back(&self) {
        self.inside.fetch_sub(1, Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) > 0 {
            let _lock = self.lock.lock();
            self.wake.notify_one();
        }
    }
}

/// A held permit of a [`LaunchGate`] (or none, for a thread that held one already); given back
/// on drop.
#[must_use = "the permit is given back when dropped"]
pub(crate) struct Permit<'a> {
    gate: Option<&'a LaunchGate>,
    /// What this thread held before (restored on drop).
    outer: usize,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if let Some(gate) = self.gate {
            HELD.with(|held| held.set(self.outer));
            gate.give_back();
        }
    }
}

/// Enter `gate` if there is one.
#[inline]
pub(crate) fn enter(gate: Option<&LaunchGate>) -> Option<Permit<'_>> {
    gate.map(LaunchGate::enter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn at_most_limit_threads_hold_a_permit_at_once() {
        // A patience far beyond any hold: a loaded machine (CI has two cores) can keep a permit's
        // holder off its core for longer than the engine's millisecond, and an overdraft would
        // then let a third thread in, as designed. Here nothing may overdraw.
        let gate = Arc::new(LaunchGate::with_patience(2, Duration::from_secs(60)));
        let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let threads: Vec<_> = (0..6)
            .map(|_| {
                let (gate, now, most) = (gate.clone(), now.clone(), most.clone());
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        let _permit = gate.enter();
                        let inside = now.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(inside, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_micros(50));
                        now.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let most = most.load(Ordering::SeqCst);
        assert!(
            (1..=2).contains(&most),
            "{most} threads were inside at once"
        );
        assert_eq!(gate.waits_and_overdrafts().1, 0, "no wait ran out");
        assert_eq!(
            gate.inside.load(Ordering::SeqCst),
            0,
            "every permit given back"
        );
    }

    #[test]
    fn a_thread_waits_at_most_the_patience_then_goes_ahead() {
        let gate = LaunchGate::new(1);
        let held = gate.enter();
        let start = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                let _second = gate.enter();
                assert_eq!(
                    gate.inside.load(Ordering::SeqCst),
                    2,
                    "overdrawn, and counted"
                );
            });
        });
        assert!(start.elapsed() >= PATIENCE, "it waited first");
        assert_eq!(gate.waits_and_overdrafts(), (1, 1), "one wait, overdrawn");
        drop(held);
        assert_eq!(gate.inside.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_holder_enters_again_without_a_second_permit() {
        let (gate, other) = (LaunchGate::new(1), LaunchGate::new(1));
        let outer = gate.enter();
        {
            let _inner = gate.enter();
            assert_eq!(gate.inside.load(Ordering::SeqCst), 1);
            let _elsewhere = other.enter();
            assert_eq!(
                other.inside.load(Ordering::SeqCst),
                1,
                "another gate: its own permit"
            );
            // The permit this thread holds last is the other gate's: this one is entered anew
            // (overdrawn after the wait, since its one permit is taken).
            let _again = gate.enter();
            assert_eq!(
                gate.inside.load(Ordering::SeqCst),
                2,
                "not held any more: a new one"
            );
        }
        drop(outer);
        assert_eq!(gate.inside.load(Ordering::SeqCst), 0);
        assert_eq!(other.inside.load(Ordering::SeqCst), 0);
        assert_eq!(
            gate.waits_and_overdrafts(),
            (1, 1),
            "only the new entry waited"
        );
        assert_eq!(other.waits_and_overdrafts(), (0, 0));
    }
}
