//! A lock with an inbox: a thread that cannot take the lock hands its work over without waiting.
//!
//! # Why an inbox
//!
//! A thread that holds one stream's lock may need to release a tensor or register a view on a
//! stream whose lock it cannot take: an executor (running under the lock of the stream it belongs
//! to) that drops or clones a tensor it captured, or a thread unwinding out of the engine. Taking
//! the lock there would deadlock. Such a thread *posts* the work to the target's inbox instead,
//! and whoever holds (or next takes) that lock applies it.
//!
//! # Protocol (no message is stranded)
//!
//! * A poster pushes its message under the inbox's own small mutex, sets `flag`, issues a
//!   `SeqCst` fence and then *tries* the lock; if it gets it, it applies the inbox and releases.
//! * A holder applies the inbox before it releases the lock; after releasing it issues a `SeqCst`
//!   fence, and if `flag` is set it tries the lock again and repeats.
//!
//! The two fences forbid the store-buffer outcome in which the poster's `try_lock` sees the lock
//! still held *and* the holder's post-release check misses the flag: one of the two always sees
//! the other, so every posted message is applied by someone before that someone leaves. The
//! `loom_` tests below check exactly this over every interleaving.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};

use crate::loom::sync::{AtomicBool, Mutex, MutexGuard, Ordering, fence};

/// State that accepts posted messages.
pub(crate) trait Mailbox {
    type Message;
    /// Apply one message; called with the lock held.
    fn apply(&mut self, message: Self::Message);
    /// Called when the current thread takes the lock, before anything is applied.
    fn entered() {}
    /// Called with the lock held, after the inbox was applied and before the lock is released.
    fn settle(&mut self) {}
    /// Called when the current thread has released the lock.
    fn left() {}
}

/// `S` behind a lock, plus an inbox of messages for it.
pub(crate) struct InboxLock<S: Mailbox> {
    state: Mutex<S>,
    inbox: Mutex<Vec<S::Message>>,
    flag: AtomicBool,
}

impl<S: Mailbox> InboxLock<S> {
    pub(crate) fn new(state: S) -> Self {
        Self {
            state: Mutex::new(state),
            inbox: Mutex::new(Vec::new()),
            flag: AtomicBool::new(false),
        }
    }

    /// Take the lock (applying what was posted). Must not be called by a thread that holds it.
    #[inline]
    pub(crate) fn lock(&self) -> InboxGuard<'_, S> {
        let guard = self.state.lock();
        S::entered();
        let mut guard = InboxGuard {
            lock: self,
            guard: ManuallyDrop::new(guard),
        };
        self.apply(&mut guard.guard);
        guard
    }

    /// Take the lock if it is free (applying what was posted).
    #[inline]
    pub(crate) fn try_lock(&self) -> Option<InboxGuard<'_, S>> {
        let guard = self.state.try_lock()?;
        S::entered();
        let mut guard = InboxGuard {
            lock: self,
            guard: ManuallyDrop::new(guard),
        };
        self.apply(&mut guard.guard);
        Some(guard)
    }

    /// Hand `message` over without blocking; see the module docs.
    pub(crate) fn post(&self, message: S::Message) {
        self.inbox.lock().push(message);
        self.flag.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if let Some(guard) = self.try_lock() {
            // Applied when the guard drops.
            drop(guard);
        }
    }

    /// Apply the inbox, then let the state settle before its lock is released.
    ///
    /// Every lock and release of a stream runs this, and the inbox is almost always empty: the
    /// check is inline, the work out of line (a call here cost ~20 instructions per recorded
    /// operation, most of them saving and restoring registers).
    #[inline(always)]
    fn apply(&self, state: &mut S) {
        if self.flag.load(Ordering::SeqCst) {
            self.apply_posted(state);
        }
        state.settle();
    }

    #[cold]
    #[inline(never)]
    fn apply_posted(&self, state: &mut S) {
        self.flag.store(false, Ordering::SeqCst);
        let messages = std::mem::take(&mut *self.inbox.lock());
        for message in messages {
            state.apply(message);
        }
    }

    /// Messages posted and not applied yet (for tests).
    #[cfg(all(test, loom))]
    fn unapplied(&self) -> usize {
        self.inbox.lock().len()
    }
}

/// Exclusive access to the state. Applies the inbox on release.
pub(crate) struct InboxGuard<'a, S: Mailbox> {
    lock: &'a InboxLock<S>,
    guard: ManuallyDrop<MutexGuard<'a, S>>,
}

impl<S: Mailbox> Deref for InboxGuard<'_, S> {
    type Target = S;
    fn deref(&self) -> &S {
        &self.guard
    }
}

impl<S: Mailbox> DerefMut for InboxGuard<'_, S> {
    fn deref_mut(&mut self) -> &mut S {
        &mut self.guard
    }
}

impl<S: Mailbox> Drop for InboxGuard<'_, S> {
    #[inline(always)]
    fn drop(&mut self) {
        self.lock.apply(&mut self.guard);
        // SAFETY: `guard` is dropped exactly once, here, and never used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.guard) };
        S::left();
        fence(Ordering::SeqCst);
        // A message posted while we held the lock, whose poster's try_lock failed because of
        // us, is ours to apply.
        if self.lock.flag.load(Ordering::SeqCst) {
            self.lock.apply_late_posts();
        }
    }
}

impl<S: Mailbox> InboxLock<S> {
    /// The release's loop over messages posted while the lock was held (see `Drop`).
    #[cold]
    #[inline(never)]
    fn apply_late_posts(&self) {
        while self.flag.load(Ordering::SeqCst) {
            let Some(mut state) = self.state.try_lock() else {
                // Someone else holds it now; their release runs this same check.
                break;
            };
            S::entered();
            self.apply(&mut state);
            drop(state);
            S::left();
            fence(Ordering::SeqCst);
        }
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::loom::sync::Arc;
    use loom::thread;

    #[derive(Default)]
    struct Applied(Vec<u32>);

    impl Mailbox for Applied {
        type Message = u32;
        fn apply(&mut self, message: u32) {
            self.0.push(message);
        }
    }

    /// A thread that takes the lock and applies message 0 itself.
    fn spawn_holder(cell: &Arc<InboxLock<Applied>>) -> thread::JoinHandle<()> {
        let cell = cell.clone();
        thread::spawn(move || {
            let mut guard = cell.lock();
            guard.0.push(0);
        })
    }

    /// Two posters race a holder: once every thread has finished, both messages have been
    /// applied exactly once, and nothing is left in the inbox, without anyone taking the lock
    /// afterwards.
    #[test]
    fn loom_inbox_strands_no_message() {
        loom::model(|| {
            let cell = Arc::new(InboxLock::new(Applied::default()));
            let holder = spawn_holder(&cell);
            let posters: Vec<_> = [1, 2]
                .into_iter()
                .map(|m| {
                    let cell = cell.clone();
                    thread::spawn(move || cell.post(m))
                })
                .collect();
            holder.join().unwrap();
            posters.into_iter().for_each(|p| p.join().unwrap());
            assert_eq!(cell.unapplied(), 0, "a posted message was stranded");
            let state = cell.state.lock();
            let mut applied = state.0.clone();
            applied.sort();
            assert_eq!(applied, vec![0, 1, 2], "applied exactly once each");
        });
    }

    /// One poster's messages are applied in the order it posted them, whoever applies them
    /// (a stream's own thread posts the operations it records while another thread holds the
    /// lock, and their order is the program's).
    #[test]
    fn loom_one_posters_messages_apply_in_order() {
        loom::model(|| {
            let cell = Arc::new(InboxLock::new(Applied::default()));
            let holder = spawn_holder(&cell);
            let poster = {
                let cell = cell.clone();
                thread::spawn(move || {
                    cell.post(1);
                    cell.post(2);
                })
            };
            holder.join().unwrap();
            poster.join().unwrap();
            assert_eq!(cell.unapplied(), 0, "a posted message was stranded");
            let applied = cell.state.lock().0.clone();
            let posted: Vec<u32> = applied.iter().copied().filter(|&m| m != 0).collect();
            assert_eq!(
                posted,
                vec![1, 2],
                "applied in the order posted: {applied:?}"
            );
        });
    }

    /// A message posted from under another lock (the executor case) while the target is held.
    #[test]
    fn loom_post_while_held_is_applied_by_the_holder() {
        loom::model(|| {
            let cell = Arc::new(InboxLock::new(Applied::default()));
            let guard = cell.lock();
            let poster = {
                let cell = cell.clone();
                thread::spawn(move || cell.post(7))
            };
            poster.join().unwrap();
            drop(guard);
            assert_eq!(cell.unapplied(), 0);
            assert_eq!(cell.state.lock().0, vec![7]);
        });
    }
}
