//! The pointer a [`FusionClient`](super::FusionClient) (and so every tensor) holds to its engine:
//! an [`Arc`] whose count can be given up for good.
//!
//! Every recorded operation clones its first operand's client and every new tensor holds one, so
//! a plain `Arc` costs an atomic add and an atomic subtract on the engine's one count per
//! operation. One thread pays ~20 cycles for each. Threads recording on one engine at once pay
//! far more: the count's cache line moves between their cores on every operation (two threads on
//! the 2-core dev machine: 22–32 ns per clone and drop,
//! `docs/logs/2026-12-05-host-shared-client-and-order.log`). An engine that lives for the rest of
//! the process, as every [`StreamFusion`](crate::backend::StreamFusion) engine does, needs no
//! count at all: its pointers are made [`Counted::immortal`], and their clones and drops touch
//! nothing shared. Measured: 35 fewer engine instructions per recorded op, and no wall-time change
//! that 16 host cores or an H100 could show (`docs/BENCHMARKS.md`, "Engines that count no
//! owners").

use std::marker::PhantomData;
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::Arc;

/// An `Arc<T>`, or a pointer to a `T` that is never freed.
pub(crate) struct Counted<T> {
    /// From [`Arc::into_raw`]. While `counted`, this value owns one strong count; otherwise the
    /// count it owned was given up ([`Counted::immortal`]), so the allocation outlives the
    /// process's use of it.
    ptr: NonNull<T>,
    counted: bool,
    /// Dropping a counted pointer may drop a `T`.
    _owns: PhantomData<Arc<T>>,
}

// SAFETY: as for `Arc<T>`: the value is shared between threads by reference and dropped by
// whichever thread holds the last count.
unsafe impl<T: Send + Sync> Send for Counted<T> {}
// SAFETY: as for `Arc<T>`.
unsafe impl<T: Send + Sync> Sync for Counted<T> {}

impl<T> Counted<T> {
    pub(crate) fn new(value: T) -> Self {
        let ptr = Arc::into_raw(Arc::new(value)).cast_mut();
        Self {
            // SAFETY: `Arc::into_raw` never returns null.
            ptr: unsafe { NonNull::new_unchecked(ptr) },
            counted: true,
            _owns: PhantomData,
        }
    }

    /// This pointer, its value kept for the rest of the process: it and its clones count
    /// nothing. (A counted pointer gives its count up, so the count never reaches zero.)
    pub(crate) fn immortal(self) -> Self {
        let ptr = self.ptr;
        std::mem::forget(self);
        Self {
            ptr,
            counted: false,
            _owns: PhantomData,
        }
    }

    pub(crate) fn ptr_eq(&self, other: &Self) -> bool {
        self.ptr == other.ptr
    }
}

impl<T> Deref for Counted<T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: a counted pointer owns a count; an immortal one points into an allocation whose
        // count can no longer reach zero. Either way the value is alive.
        unsafe { self.ptr.as_ref() }
    }
}

impl<T> Clone for Counted<T> {
    #[inline]
    fn clone(&self) -> Self {
        if self.counted {
            // SAFETY: `ptr` came from `Arc::into_raw` and this value owns a count, so the
            // allocation is alive; the new count is owned by the clone.
            unsafe { Arc::increment_strong_count(self.ptr.as_ptr()) };
        }
        Self {
            ptr: self.ptr,
            counted: self.counted,
            _owns: PhantomData,
        }
    }
}

impl<T> Drop for Counted<T> {
    #[inline]
    fn drop(&mut self) {
        if self.counted {
            // SAFETY: gives back the count this value owns (from `new` or `clone`).
            unsafe { Arc::decrement_strong_count(self.ptr.as_ptr()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts its drops.
    struct Probe<'a>(&'a AtomicUsize);
    impl Drop for Probe<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_counted_value_drops_with_its_last_pointer_on_any_thread() {
        static DROPS: AtomicUsize = AtomicUsize::new(0);
        let a = Counted::new(Probe(&DROPS));
        let b = a.clone();
        assert!(a.ptr_eq(&b));
        drop(a);
        assert_eq!(DROPS.load(Ordering::SeqCst), 0, "one pointer is left");
        std::thread::spawn(move || drop(b)).join().unwrap();
        assert_eq!(DROPS.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn an_immortal_value_is_never_dropped_and_its_clones_count_nothing() {
        static DROPS: AtomicUsize = AtomicUsize::new(0);
        let a = Counted::new(Probe(&DROPS));
        let b = a.clone();
        let a = a.immortal();
        let clones: Vec<_> = (0..4).map(|_| a.clone()).collect();
        assert!(clones.iter().all(|c| c.ptr_eq(&b)));
        drop(clones);
        drop(b);
        drop(a);
        assert_eq!(
            DROPS.load(Ordering::SeqCst),
            0,
            "the count given up keeps it"
        );
    }
}
