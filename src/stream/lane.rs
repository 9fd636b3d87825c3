//! A stream's home lane: the records of the stream's own thread, handed over without a lock.
//!
//! # Why a lane
//!
//! Recording an operation under the stream's lock costs three locked instructions (the lock, its
//! release and the inbox protocol's fence), on every operation of a thread that almost never
//! meets another thread at its lock. On a host backend, where an operation itself is a few
//! thousand instructions, those were worth about 1% of a chain of 1 Ki-element operations
//! (docs/BENCHMARKS.md, "Locked instructions per op").
//!
//! So the stream's own thread writes its records into a ring that only it writes, and publishes
//! each with a release store of `tail`: on x86 an ordinary store. Whoever holds the stream's lock
//! next (the home thread itself, or another thread that came to share or read one of its
//! tensors) moves what the lane holds into the queue, in order, before it reads anything else
//! of the state ([`super::inbox`]). A thread that sees a record's effects (it holds a tensor the
//! record produced, or it acquired the home thread's drop of an operand) therefore finds the
//! record queued once it holds the lock.
//!
//! # Protocol
//!
//! * One producer: [`Lane::push`] writes the slot at `tail`, then stores `tail + 1` (release).
//!   It first loads `head` (acquire) and refuses when the ring is full, so it never writes a
//!   slot a consumer may still read.
//! * Consumers one at a time (the caller's lock orders them): [`Lane::drain`] loads `tail`
//!   (acquire), and for each slot reads it, then stores `head` past it (release).
//!
//! The `loom_` tests below check this over every interleaving, the unit tests under miri.

use std::cell::Cell;
use std::mem::MaybeUninit;

use crate::loom::cell::UnsafeCell;
use crate::loom::sync::{AtomicUsize, Ordering};

std::thread_local! {
    /// This thread's [`thread_token`], once it has one. (A `Cell<u64>` with a const initialiser
    /// has no destructor: readable while the thread's other thread-locals are destroyed.)
    static TOKEN: Cell<u64> = const { Cell::new(0) };
}

/// The next [`thread_token`].
static NEXT_TOKEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A number no other thread of the process has or will have (never 0): which thread is a lane's
/// producer. (A thread's `StreamId` does not say: cubecl lets code set the current one.)
#[inline]
pub(crate) fn thread_token() -> u64 {
    TOKEN.with(|token| match token.get() {
        0 => {
            let new = NEXT_TOKEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            token.set(new);
            new
        }
        known => known,
    })
}

/// A single-producer ring of `T`, drained by one consumer at a time.
pub(crate) struct Lane<T> {
    slots: Box<[UnsafeCell<MaybeUninit<T>>]>,
    /// The slot count less one (the count is a power of two).
    mask: usize,
    /// How many values were ever pushed; only the producer stores it.
    tail: AtomicUsize,
    /// How many values were ever taken out; only a consumer stores it.
    head: AtomicUsize,
}

// SAFETY: values cross from the producer to a consumer (so `T: Send`); the slots are accessed as
// the protocol above allows: a slot is written only by the producer while it is outside
// `head..tail`, and read only by the one consumer of the moment while it is inside.
unsafe impl<T: Send> Send for Lane<T> {}
unsafe impl<T: Send> Sync for Lane<T> {}

impl<T> Lane<T> {
    /// A lane for at least `capacity` values (at least one).
    pub(crate) fn new(capacity: usize) -> Self {
        let slots = capacity.max(1).next_power_of_two();
        Self {
            slots: (0..slots)
                .map(|_| UnsafeCell::new(MaybeUninit::uninit()))
                .collect(),
            mask: slots - 1,
            tail: AtomicUsize::new(0),
            head: AtomicUsize::new(0),
        }
    }

    /// The slot of the value counted `index` (wrapping round the ring).
    #[inline(always)]
    fn slot(&self, index: usize) -> &UnsafeCell<MaybeUninit<T>> {
        // SAFETY: `index & mask` is less than the slot count, `mask + 1`.
        unsafe { self.slots.get_unchecked(index & self.mask) }
    }

    /// Append `value`, or hand it back if the lane is full.
    ///
    /// # Safety
    ///
    /// Every push to this lane is made by one thread (or pushes are otherwise ordered one after
    /// another by happens-before).
    #[inline]
    pub(crate) unsafe fn push(&self, value: T) -> Result<(), T> {
        let tail = self.tail.load(Ordering::Relaxed);
        if tail.wrapping_sub(self.head.load(Ordering::Acquire)) > self.mask {
            return Err(value);
        }
        // SAFETY: the slot is outside `head..tail` (the check above, whose acquire orders this
        // write after the read of the consumer that last took the slot's value), and no other
        // producer writes it (the caller's promise).
        self.slot(tail)
            .with_mut(|slot| unsafe { (*slot).write(value) });
        self.tail.store(tail.wrapping_add(1), Ordering::Release);
        Ok(())
    }

    /// Whether a [`Lane::drain`] now would take nothing. Same contract as `drain`.
    #[inline]
    pub(crate) unsafe fn is_empty(&self) -> bool {
        self.tail.load(Ordering::Acquire) == self.head.load(Ordering::Relaxed)
    }

    /// Take out every value pushed so far, oldest first, handing each to `f`.
    ///
    /// # Safety
    ///
    /// No other thread drains this lane at the same time: consumers are ordered one after
    /// another by happens-before (the caller holds a lock every consumer takes).
    pub(crate) unsafe fn drain(&self, mut f: impl FnMut(T)) {
        let tail = self.tail.load(Ordering::Acquire);
        let mut head = self.head.load(Ordering::Relaxed);
        while head != tail {
            // SAFETY: the slot is inside `head..tail`: the producer wrote it before its release
            // store of a tail past it, which the acquire load above read, and no consumer has
            // taken it (consumers are ordered, and each stores `head` past what it took).
            let value = self
                .slot(head)
                .with_mut(|slot| unsafe { (*slot).assume_init_read() });
            head = head.wrapping_add(1);
            // Released before `f` runs: the slot is free again even if `f` unwinds.
            self.head.store(head, Ordering::Release);
            f(value);
        }
    }
}

impl<T> Drop for Lane<T> {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no producer or consumer runs.
        unsafe { self.drain(drop) };
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn values_come_out_in_order_and_a_full_lane_refuses() {
        let lane = Lane::new(3);
        // SAFETY: one thread pushes and drains.
        unsafe {
            for v in 0..4 {
                assert_eq!(lane.push(v), Ok(()));
            }
            assert_eq!(lane.push(4), Err(4), "four slots, four values");
            let mut out = Vec::new();
            lane.drain(|v| out.push(v));
            assert_eq!(out, [0, 1, 2, 3]);
            assert!(lane.is_empty());
            // Around the ring again.
            for v in 5..8 {
                assert_eq!(lane.push(v), Ok(()));
            }
            lane.drain(|v| out.push(v));
            assert_eq!(out, [0, 1, 2, 3, 5, 6, 7]);
        }
    }

    #[test]
    fn values_left_in_the_lane_are_dropped_with_it() {
        let value = Arc::new(());
        let lane = Lane::new(4);
        // SAFETY: one thread pushes.
        unsafe {
            lane.push(value.clone()).unwrap();
            lane.push(value.clone()).unwrap();
        }
        drop(lane);
        assert_eq!(Arc::strong_count(&value), 1);
    }

    #[test]
    fn a_value_is_released_even_if_its_consumer_unwinds() {
        let lane = Lane::new(2);
        // SAFETY: one thread pushes and drains.
        unsafe {
            lane.push(1).unwrap();
            lane.push(2).unwrap();
            let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                lane.drain(|v| assert_ne!(v, 1, "the consumer fails on 1"))
            }));
            assert!(unwound.is_err());
            let mut out = Vec::new();
            lane.drain(|v| out.push(v));
            assert_eq!(out, [2], "1 was taken once, 2 is still there");
        }
    }

    /// A producer thread against consumers that take a lock to drain (the stream's pattern):
    /// every value arrives once, in order. Under miri, the data-race detector checks the slots.
    #[test]
    fn one_producer_and_locked_consumers_lose_nothing() {
        const VALUES: usize = if cfg!(miri) { 60 } else { 20_000 };
        let lane = Arc::new(Lane::new(8));
        let taken = Arc::new(Mutex::new(Vec::new()));
        let consumers: Vec<_> = (0..2)
            .map(|_| {
                let (lane, taken) = (lane.clone(), taken.clone());
                std::thread::spawn(move || {
                    while taken.lock().unwrap().len() < VALUES {
                        let mut taken = taken.lock().unwrap();
                        // SAFETY: consumers drain under `taken`'s lock.
                        unsafe { lane.drain(|v| taken.push(v)) };
                        drop(taken);
                        std::thread::yield_now();
                    }
                })
            })
            .collect();
        for v in 0..VALUES {
            // SAFETY: this thread is the only producer.
            while unsafe { lane.push(v) }.is_err() {
                std::thread::yield_now();
            }
        }
        consumers.into_iter().for_each(|c| c.join().unwrap());
        let taken = taken.lock().unwrap();
        assert!(taken.iter().copied().eq(0..VALUES), "in order, each once");
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::loom::sync::{Arc, Mutex};
    use loom::thread;

    /// A producer pushes three values into a two-slot lane while another thread drains it
    /// under a lock; when a push finds the lane full, the producer does what a stream's own
    /// thread does: it takes the lock, drains, and adds its value after. A final drain under the
    /// lock finds the rest. Every value arrives exactly once, in order, over every interleaving.
    #[test]
    fn loom_lane_hands_over_in_order() {
        loom::model(|| {
            let lane = Arc::new(Lane::new(2));
            let taken = Arc::new(Mutex::new(Vec::new()));
            let consumer = {
                let (lane, taken) = (lane.clone(), taken.clone());
                thread::spawn(move || {
                    let mut taken = taken.lock();
                    // SAFETY: consumers drain under `taken`'s lock.
                    unsafe { lane.drain(|v| taken.push(v)) };
                })
            };
            for v in 0..3 {
                // SAFETY: this thread is the only producer; it drains under the lock.
                if let Err(v) = unsafe { lane.push(v) } {
                    let mut taken = taken.lock();
                    unsafe { lane.drain(|v| taken.push(v)) };
                    taken.push(v);
                }
            }
            consumer.join().unwrap();
            let mut taken = taken.lock();
            // SAFETY: under the lock.
            unsafe { lane.drain(|v| taken.push(v)) };
            assert_eq!(*taken, vec![0, 1, 2]);
        });
    }
}
