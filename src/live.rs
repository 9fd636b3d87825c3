//! The live count of an id, and last-owner detection.
//!
//! A [`crate::FusionTensor`] is a [`Live`] handle: its `Arc` strong count *is* the id's live
//! count (clones on the home stream share it; a clone on another stream is a new id with a count
//! of its own). The payload is released exactly once, by whoever lets go of it last:
//!
//! * dropping the last `Live` runs [`Release::release`];
//! * [`Live::try_take`] (a consuming read) succeeds only for the sole owner and hands the release
//!   duty over in a [`Last`]: the taker either [`Last::disarm`]s it (it released the id another
//!   way) or drops it (released then).
//!
//! No interleaving of clones, drops and takes on several threads releases twice or never; the
//! `loom_` tests below check this.

use crate::loom::sync::Arc;

/// What the last owner does.
pub(crate) trait Release {
    fn release(&mut self);
}

/// The payload, and whether dropping it releases it.
pub(crate) struct Owned<T: Release> {
    pub(crate) value: T,
    pub(crate) armed: bool,
}

impl<T: Release> Drop for Owned<T> {
    fn drop(&mut self) {
        if self.armed {
            self.value.release();
        }
    }
}

/// A counted owner of `T`.
pub(crate) struct Live<T: Release>(Arc<Owned<T>>);

impl<T: Release> Live<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(Arc::new(Owned { value, armed: true }))
    }

    /// The payload and its release switch, if this is the sole owner (to recycle it in place).
    ///
    /// `Arc::get_mut` answers this with a locked compare-and-swap on the weak count, since a
    /// `Weak` could otherwise be upgraded during the check. A `Live` never makes a `Weak`, so
    /// one strong count, read with acquire ordering, is the whole answer: a plain load. Every
    /// recorded operation asks up to three times (to release a consumed operand and to recycle
    /// its allocation for the output). Those three locked instructions and the two of an `Arc`
    /// clone of the operand's home (see `stream::CellRef`) cost the 1 Ki chain about 1% on a
    /// 16-core H100 host, where callgrind counts them as five instructions
    /// (`docs/logs/2026-12-06-locked-ops-per-op.log`).
    #[cfg(not(loom))]
    #[inline]
    pub(crate) fn get_mut(&mut self) -> Option<&mut Owned<T>> {
        if Arc::strong_count(&self.0) != 1 {
            return None;
        }
        // Pairs with the release decrement of the owner that dropped last before us, so that
        // its writes happen before ours.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        // SAFETY: one strong count, ours, and no `Weak` (this module never makes one): no other
        // pointer to the payload exists, and none can be made while `self` is borrowed mutably,
        // since a new one could only be cloned from `self`. The pointer comes from the `Arc`'s
        // own allocation pointer, not from a shared reference.
        Some(unsafe { &mut *Arc::as_ptr(&self.0).cast_mut() })
    }

    /// The payload and its release switch, if this is the sole owner (loom's `Arc` models the
    /// standard check).
    #[cfg(loom)]
    pub(crate) fn get_mut(&mut self) -> Option<&mut Owned<T>> {
        Arc::get_mut(&mut self.0)
    }

    /// Live owners, this one included.
    pub(crate) fn count(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// Become the sole owner, if no other owner lives; otherwise get `self` back.
    pub(crate) fn try_take(self) -> Result<Last<T>, Self> {
        Arc::try_unwrap(self.0).map(Last).map_err(Self)
    }
}

impl<T: Release> std::ops::Deref for Live<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0.value
    }
}

impl<T: Release> Clone for Live<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

/// The sole owner, taken out of its [`Live`]: releases on drop unless disarmed.
pub(crate) struct Last<T: Release>(Owned<T>);

impl<T: Release> Last<T> {
    pub(crate) fn get(&self) -> &T {
        &self.0.value
    }

    /// The release happened another way: dropping this releases nothing more.
    pub(crate) fn disarm(&mut self) {
        self.0.armed = false;
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::{AtomicUsize, Ordering};
    use loom::thread;

    struct Probe(Arc<AtomicUsize>);

    impl Release for Probe {
        fn release(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Clones dropped on two threads while a third drops the original: one release.
    #[test]
    fn loom_last_drop_releases_once() {
        loom::model(|| {
            let released = Arc::new(AtomicUsize::new(0));
            let live = Live::new(Probe(released.clone()));
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let mine = live.clone();
                    thread::spawn(move || drop(mine))
                })
                .collect();
            drop(live);
            threads.into_iter().for_each(|t| t.join().unwrap());
            assert_eq!(released.load(Ordering::SeqCst), 1);
        });
    }

    /// A consuming read racing a drop: the id is released exactly once, by the drop or through
    /// the taker's `Last` (disarmed when the taker released it itself, as `into_data` does).
    #[test]
    fn loom_take_racing_a_drop_releases_once() {
        for disarm in [false, true] {
            loom::model(move || {
                let released = Arc::new(AtomicUsize::new(0));
                let live = Live::new(Probe(released.clone()));
                let other = live.clone();
                let dropper = thread::spawn(move || drop(other));
                let taken_by_me = match live.try_take() {
                    Ok(mut last) => {
                        assert_eq!(last.get().0.load(Ordering::SeqCst), 0);
                        if disarm {
                            // The taker's own release (a read that frees the id).
                            last.get().0.fetch_add(1, Ordering::SeqCst);
                            last.disarm();
                        }
                        true
                    }
                    Err(live) => {
                        // Not the sole owner: a plain read, then a drop.
                        assert!(live.count() >= 1);
                        drop(live);
                        false
                    }
                };
                dropper.join().unwrap();
                assert_eq!(
                    released.load(Ordering::SeqCst),
                    1,
                    "taken by me: {taken_by_me}"
                );
            });
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    struct Payload(Vec<u32>);

    impl Release for Payload {
        fn release(&mut self) {}
    }

    /// `get_mut` answers only the sole owner, and the payload it lends is the shared one.
    #[test]
    fn get_mut_is_for_the_sole_owner() {
        let mut live = Live::new(Payload(vec![1]));
        let other = live.clone();
        assert!(live.get_mut().is_none(), "two owners");
        drop(other);
        let owned = live.get_mut().expect("the sole owner");
        owned.value.0.push(2);
        owned.armed = false;
        assert_eq!(live.0.value.0, [1, 2]);
        assert!(!live.0.armed);
    }

    /// An owner dropped on another thread after writing through a shared `Live`: the sole owner
    /// left then sees that thread's writes (under miri, the race detector checks the fence).
    #[test]
    fn get_mut_after_a_drop_on_another_thread() {
        let mut live = Live::new(Payload(vec![0; 4]));
        let other = live.clone();
        let seen = std::thread::spawn(move || {
            let n = other.0.value.0.len();
            drop(other);
            n
        })
        .join()
        .unwrap();
        let owned = live.get_mut().expect("the other owner is gone");
        owned.value.0[seen - 1] = 7;
        assert_eq!(live.0.value.0, [0, 0, 0, 7]);
    }
}
