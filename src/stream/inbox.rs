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
//!
//! # The lane
//!
//! The state's own thread has a second way in, without a lock or a fence: its [`Lane`] of
//! records, which whoever takes the lock moves into the state first ([`Mailbox::apply_record`]).
//! Records are not "applied before the holder leaves" like messages: they wait in the lane, as
//! they would in the state's queue, for the next holder. What the protocol keeps is the order:
//! a holder takes the posted messages, *then* drains the lane, then applies the messages, so a
//! message posted by a thread that had seen a record (a last drop of a tensor the record reads)
//! is applied after that record.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};

use super::lane::Lane;
use crate::loom::sync::{AtomicBool, Mutex, MutexGuard, Ordering, fence};

/// State that accepts posted messages.
pub(crate) trait Mailbox {
    type Message;
    /// What the state's own thread hands over through the lane.
    type Record;
    /// Apply one message; called with the lock held.
    fn apply(&mut self, message: Self::Message);
    /// Apply one record of the lane, in the order they were pushed; called with the lock held.
    /// `by_home`: [`Mailbox::home_holds`] for the holder.
    fn apply_record(&mut self, record: Self::Record, by_home: bool);
    /// Whether the thread that holds the lock is the state's own thread (asked once for each
    /// drain of the lane).
    fn home_holds(&self) -> bool {
        false
    }
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
    lane: Lane<S::Record>,
}

impl<S: Mailbox> InboxLock<S> {
    /// `state` behind a lock, with a lane for at least `lane` records.
    pub(crate) fn new(state: S, lane: usize) -> Self {
        Self {
            state: Mutex::new(state),
            inbox: Mutex::new(Vec::new()),
            flag: AtomicBool::new(false),
            lane: Lane::new(lane),
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

    /// Hand `record` to the state without the lock, through the lane (see the module docs); it
    /// comes back if the lane is full.
    ///
    /// # Safety
    ///
    /// Only one thread ever pushes to this lock's lane.
    #[inline]
    pub(crate) unsafe fn push(&self, record: S::Record) -> Result<(), S::Record> {
        // SAFETY: the caller's promise is the lane's.
        unsafe { self.lane.push(record) }
    }

    /// Apply the inbox and the lane, then let the state settle before its lock is released.
    ///
    /// Every lock and release of a stream runs this, and the inbox is almost always empty: the
    /// checks are inline, the work out of line (a call here cost ~20 instructions per recorded
    /// operation, most of them saving and restoring registers).
    #[inline(always)]
    fn apply(&self, state: &mut S) {
        if self.flag.load(Ordering::SeqCst) {
            self.apply_posted(state);
        // SAFETY: the caller holds the lock, which every drain of the lane takes.
        } else if unsafe { !self.lane.is_empty() } {
            self.apply_lane(state);
        }
        state.settle();
    }

    #[cold]
    #[inline(never)]
    fn apply_posted(&self, state: &mut S) {
        self.flag.store(false, Ordering::SeqCst);
        let messages = std::mem::take(&mut *self.inbox.lock());
        // The lane after the messages are taken, and before they are applied: see the module
        // docs.
        self.apply_lane(state);
        for message in messages {
            state.apply(message);
        }
    }

    /// Move the lane's records into the state, oldest first.
    #[inline(never)]
    fn apply_lane(&self, state: &mut S) {
        let by_home = state.home_holds();
        // SAFETY: the caller holds the lock, which every drain of the lane takes.
        unsafe {
            self.lane
                .drain(|record| state.apply_record(record, by_home))
        };
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
        type Record = u32;
        fn apply(&mut self, message: u32) {
            self.0.push(message);
        }
        fn apply_record(&mut self, record: u32, _: bool) {
            self.0.push(record);
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
            let cell = Arc::new(InboxLock::new(Applied::default(), 1));
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
            let cell = Arc::new(InboxLock::new(Applied::default(), 1));
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

    /// The state's own thread pushes a record through the lane and then lets a second thread
    /// know (as a last drop of a tensor it used would); that thread posts a message, while a
    /// third takes and releases the lock. Whoever applies the message has drained the record
    /// first: the message comes after the record, and both come exactly once.
    #[test]
    fn loom_a_message_posted_after_a_record_applies_after_it() {
        loom::model(|| {
            let cell = Arc::new(InboxLock::new(Applied::default(), 1));
            let pushed = Arc::new(AtomicBool::new(false));
            let holder = {
                let cell = cell.clone();
                thread::spawn(move || drop(cell.lock()))
            };
            let poster = {
                let (cell, pushed) = (cell.clone(), pushed.clone());
                thread::spawn(move || {
                    if pushed.load(Ordering::Acquire) {
                        cell.post(20);
                    }
                })
            };
            // SAFETY: this thread is the lane's only producer.
            assert!(unsafe { cell.push(10) }.is_ok());
            pushed.store(true, Ordering::Release);
            holder.join().unwrap();
            poster.join().unwrap();
            let applied = cell.lock().0.clone();
            assert_eq!(cell.unapplied(), 0, "a posted message was stranded");
            assert!(
                applied == vec![10] || applied == vec![10, 20],
                "the record once, before the message: {applied:?}"
            );
        });
    }

    /// A message posted from under another lock (the executor case) while the target is held.
    #[test]
    fn loom_post_while_held_is_applied_by_the_holder() {
        loom::model(|| {
            let cell = Arc::new(InboxLock::new(Applied::default(), 1));
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
