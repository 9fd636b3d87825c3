//! The one import point for the synchronisation primitives that loom model-checks (tokio's
//! layout).
//!
//! The small concurrency-critical pieces — the inbox lock ([`crate::stream::inbox`]) and the
//! lane of records it drains (`stream::lane`), the latch threads wait on for a detached batch
//! (`stream::detached::IdleLatch`), the live count and last-owner release
//! ([`crate::live`]) and the retirement queue ([`crate::runtime::RetirementQueue`]) — take their
//! `Arc`, `Mutex`, atomics, fences and `UnsafeCell` from here. A normal build gets `std` and
//! `parking_lot`; a build with `RUSTFLAGS="--cfg loom"` gets loom's instrumented versions, and
//! the `loom_*` unit tests explore every interleaving of those pieces (bounded preemptions):
//!
//! ```text
//! RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --release --lib loom_
//! ```

#[cfg(not(loom))]
pub(crate) mod sync {
    pub(crate) use parking_lot::{Condvar, Mutex, MutexGuard};
    pub(crate) use std::sync::Arc;
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};
}

/// `UnsafeCell` with loom's closure API, so that loom can check each access.
#[cfg(not(loom))]
pub(crate) mod cell {
    #[derive(Debug, Default)]
    pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        pub(crate) const fn new(value: T) -> Self {
            Self(std::cell::UnsafeCell::new(value))
        }

        #[inline(always)]
        pub(crate) fn with_mut<F: FnOnce(*mut T) -> U, U>(&self, f: F) -> U {
            f(self.0.get())
        }
    }
}

#[cfg(loom)]
pub(crate) use loom::cell;

#[cfg(loom)]
pub(crate) mod sync {
    pub(crate) use loom::sync::Arc;
    pub(crate) use loom::sync::MutexGuard;

    /// loom's condition variable behind `parking_lot`'s API (the guard waited on in place).
    #[derive(Debug, Default)]
    pub(crate) struct Condvar(loom::sync::Condvar);

    impl Condvar {
        pub(crate) fn new() -> Self {
            Self(loom::sync::Condvar::new())
        }

        pub(crate) fn wait<T>(&self, guard: &mut MutexGuard<'_, T>) {
            // SAFETY: the guard is moved out of `*guard` and a guard of the same mutex written
            // back before `*guard` is used again; loom's `wait` returns the guard rather than
            // unwinding (a panic in a loom model ends the model run before any drop matters).
            unsafe {
                let taken = std::ptr::read(guard);
                let back = self.0.wait(taken).unwrap_or_else(|e| e.into_inner());
                std::ptr::write(guard, back);
            }
        }

        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }
    }
    pub(crate) use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};

    /// loom's mutex behind `parking_lot`'s API (no poisoning).
    #[derive(Debug, Default)]
    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Self(loom::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|e| e.into_inner())
        }

        pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
            self.0.try_lock().ok()
        }
    }
}
