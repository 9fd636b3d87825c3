//! Recycled allocations for queued operation bodies.
//!
//! Every recorded operation is boxed ([`super::PendingOp`]) and freed once it has run. A stream
//! queues up to `max_queue_len` operations and then runs them in one go, so a thread allocates a
//! batch of bodies and frees a batch: more than the allocator's per-thread cache holds (glibc's
//! tcache keeps seven blocks of a size), and each allocation and free beyond it takes the slow
//! path. callgrind put the box's allocation and free at ~280 instructions per recorded operation,
//! a tenth of the engine's whole cost (`scripts/per-op-cost.sh`, 2026-12-03).
//!
//! This module keeps freed bodies' blocks on the thread that ran them, up to [`CAPACITY`] blocks
//! of at most [`MAX_BLOCK`] bytes, and the next body of the same layout boxed on that thread
//! reuses one. A block is only ever handed to a `Box` of exactly the layout it was allocated
//! with, by the global allocator, so every `Box` here is one the global allocator could have
//! made. Blocks left when the thread exits are freed with it.
//!
//! The kept blocks are intrusive lists, one per layout in a few slots (a stream's bodies come in
//! a handful of layouts: a chain of unary, scalar and binary ops has three): a free block holds
//! the address of the next one, so keeping and reusing a block is a push and a pop, with no
//! search and no vector of its own. The first version kept one `Vec` of blocks and searched it
//! for the layout; callgrind put its keeping and reuse at ~117 instructions per operation.

use std::alloc::{Layout, dealloc};
use std::cell::RefCell;
use std::ptr::{self, NonNull};

/// Blocks kept per thread, over all layouts: the default queue bound's worth of operations.
const CAPACITY: usize = 32;
/// The largest block kept, in bytes (a backend operation's body is a few hundred).
const MAX_BLOCK: usize = 1024;
/// Layouts kept at once per thread; a block of another layout is freed.
const SLOTS: usize = 4;

/// An allocation of the global allocator, of `layout`, holding no value. Frees itself on drop.
struct Block {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: `ptr` was allocated by the global allocator with `layout` (it came from a
        // `Box` of that layout, see `recycle`) and nothing else owns it.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// The kept blocks of one layout: `head` is the first, and each holds the address of the next
/// in its first bytes (null after the last).
struct List {
    layout: Layout,
    head: *mut u8,
    len: usize,
}

impl List {
    const EMPTY: List = List {
        layout: Layout::new::<()>(),
        head: ptr::null_mut(),
        len: 0,
    };

    /// Keep `block` (a free allocation of this list's layout, at least a pointer wide).
    #[inline]
    fn push(&mut self, block: Block) {
        debug_assert_eq!(block.layout, self.layout);
        let at = block.ptr.as_ptr();
        std::mem::forget(block);
        // SAFETY: `at` is a live allocation of at least a pointer's size (`keeps`) that holds no
        // value and that nobody else owns: the list owns it from here on.
        unsafe { at.cast::<*mut u8>().write_unaligned(self.head) };
        self.head = at;
        self.len += 1;
    }

    /// A kept block, if any.
    #[inline]
    fn pop(&mut self) -> Option<Block> {
        let at = NonNull::new(self.head)?;
        // SAFETY: a kept block holds the address of the next one (see `push`).
        self.head = unsafe { at.as_ptr().cast::<*mut u8>().read_unaligned() };
        self.len -= 1;
        Some(Block {
            ptr: at,
            layout: self.layout,
        })
    }
}

/// A thread's kept blocks.
struct Lists {
    slots: [List; SLOTS],
    /// Blocks kept, over all slots.
    kept: usize,
}

impl Lists {
    const EMPTY: Lists = Lists {
        slots: [List::EMPTY; SLOTS],
        kept: 0,
    };

    #[inline]
    fn list(&mut self, layout: Layout) -> Option<&mut List> {
        self.slots.iter_mut().find(|list| list.layout == layout)
    }

    /// Keep `block`, unless enough are kept or every slot holds blocks of another layout (it
    /// is then freed).
    #[inline]
    fn keep(&mut self, block: Block) {
        if self.kept >= CAPACITY {
            return;
        }
        let layout = block.layout;
        let list = match self.slots.iter().position(|list| list.layout == layout) {
            Some(at) => &mut self.slots[at],
            None => match self.slots.iter_mut().find(|list| list.len == 0) {
                Some(list) => {
                    list.layout = layout;
                    list
                }
                None => return,
            },
        };
        list.push(block);
        self.kept += 1;
    }

    #[inline]
    fn take(&mut self, layout: Layout) -> Option<Block> {
        let block = self.list(layout)?.pop()?;
        self.kept -= 1;
        Some(block)
    }
}

impl Drop for Lists {
    fn drop(&mut self) {
        for list in &mut self.slots {
            while list.pop().is_some() {}
        }
    }
}

std::thread_local! {
    static FREE: RefCell<Lists> = const { RefCell::new(Lists::EMPTY) };
}

fn keeps(layout: Layout) -> bool {
    layout.size() >= size_of::<*mut u8>() && layout.size() <= MAX_BLOCK
}

/// `value` in a box, in a recycled block when this thread has one of its layout.
#[inline]
pub(crate) fn boxed<T>(value: T) -> Box<T> {
    let Some(block) = take(Layout::new::<T>()) else {
        return Box::new(value);
    };
    let ptr = block.ptr.cast::<T>().as_ptr();
    std::mem::forget(block);
    // SAFETY: `ptr` is an allocation of the global allocator with `Layout::new::<T>()` (`take`
    // compared the layouts), owned by nobody else and holding no value: writing `value` there
    // makes it exactly what `Box::new` would have returned.
    unsafe {
        ptr.write(value);
        Box::from_raw(ptr)
    }
}

/// A block of `layout` this thread keeps, if any.
#[inline]
fn take(layout: Layout) -> Option<Block> {
    if !keeps(layout) {
        return None;
    }
    FREE.try_with(|free| free.try_borrow_mut().ok()?.take(layout))
        .ok()
        .flatten()
}

/// Drop `boxed`'s value and keep its allocation for [`boxed`] on this thread (or free it, when
/// the thread keeps enough or the block is too large to keep).
pub(crate) fn recycle<T: ?Sized>(boxed: Box<T>) {
    let Some(block) = emptied(boxed) else { return };
    // Otherwise (the thread is exiting, or a destructor run by `emptied` is recycling too)
    // `block` drops here and frees the allocation.
    let _ = FREE.try_with(|free| {
        if let Ok(mut free) = free.try_borrow_mut() {
            free.keep(block);
        }
    });
}

/// `boxed`'s allocation, its value dropped: a block to keep, if its size is one kept (otherwise
/// it is freed here).
#[inline(always)]
fn emptied<T: ?Sized>(boxed: Box<T>) -> Option<Block> {
    let layout = Layout::for_value(&*boxed);
    if !keeps(layout) {
        drop(boxed);
        return None;
    }
    let raw = Box::into_raw(boxed);
    // Owns the allocation from here on, so it is freed even if the value's destructor panics.
    let block = Block {
        // SAFETY: `Box::into_raw` never returns null.
        ptr: unsafe { NonNull::new_unchecked(raw.cast::<u8>()) },
        layout,
    };
    // SAFETY: `raw` came from a `Box` and holds a live value, dropped once here; its allocation
    // is `block`'s, which never reads it.
    unsafe { std::ptr::drop_in_place(raw) };
    Some(block)
}

/// A thread's kept blocks, taken out of its thread-local for a while: lent to another thread, where
/// a stream's batch run there (see `stream::execution`, `run_through`) frees its bodies into the
/// lists of the thread that boxed them, which boxes the next ones; or held by the thread itself
/// while it runs a batch ([`Lent::recycle`]).
pub(crate) struct Lent(Lists);

// SAFETY: the lists own their blocks (allocations of the global allocator holding no value,
// which any thread may free or reuse) and nothing else points into them.
unsafe impl Send for Lent {}

/// The calling thread's kept blocks, taken out of it (it keeps none until [`put_back`]).
///
/// Also for a batch of frees on the thread itself ([`Lent::recycle`]): a stream that runs its
/// queue frees a body per operation, and each [`recycle`] reaches the thread-local (~25
/// instructions of NdArray's chain, `scripts/per-op-cost.sh`), where the batch reaches it twice.
pub(crate) fn lend() -> Lent {
    Lent(swap_lists(Lists::EMPTY))
}

impl Lent {
    /// [`recycle`] into these blocks rather than the thread's.
    #[inline]
    pub(crate) fn recycle<T: ?Sized>(&mut self, boxed: Box<T>) {
        if let Some(block) = emptied(boxed) {
            self.0.keep(block);
        }
    }

    /// Keep (or free) the allocation of a `Box` whose value was dropped in place already
    /// (`OpBody::execute_then_drop`): `raw` is what [`Box::into_raw`] gave, `layout` the
    /// value's, read before it was dropped.
    ///
    /// # Safety
    ///
    /// `raw` came from [`Box::into_raw`] of a `Box` (of the global allocator) holding a value of
    /// `layout`, that value has been dropped, and nothing else uses or frees the allocation.
    #[inline]
    pub(crate) unsafe fn keep_emptied<T: ?Sized>(&mut self, raw: *mut T, layout: Layout) {
        if layout.size() == 0 {
            // A `Box` of a zero-sized value allocated nothing.
            return;
        }
        // SAFETY: `Box::into_raw` never returns null; the allocation is of `layout` and ours
        // (the caller's contract), which is what `Block` owns and frees if it is not kept.
        let block = Block {
            ptr: unsafe { NonNull::new_unchecked(raw.cast::<u8>()) },
            layout,
        };
        if keeps(layout) {
            self.0.keep(block);
        }
    }
}

/// Give `lent` back to the thread that lent it (that thread calls this).
pub(crate) fn put_back(lent: Lent) {
    // What the thread kept meanwhile (nothing, unless it boxed and freed bodies itself) is freed.
    drop(swap_lists(lent.0));
}

/// Run `f` on this thread with `lent` as its kept blocks, then take them back into `lent`
/// (also on unwind); the thread's own are set aside meanwhile. Nests: each call restores what
/// it found.
pub(crate) fn with_lent<T>(lent: &mut Lent, f: impl FnOnce() -> T) -> T {
    struct Restore<'a>(&'a mut Lent);
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            exchange(&mut self.0.0);
        }
    }
    // `lent` holds this thread's own lists from here until `Restore` swaps them back.
    exchange(&mut lent.0);
    let _restore = Restore(lent);
    f()
}

/// Swap `lists` with this thread's.
fn exchange(lists: &mut Lists) {
    *lists = swap_lists(std::mem::replace(lists, Lists::EMPTY));
}

/// Put `lists` in this thread's place and return what was there (an empty set when the
/// thread-local is gone or in use).
fn swap_lists(lists: Lists) -> Lists {
    let mut lists = Some(lists);
    let swapped = FREE.try_with(|free| {
        let mut free = free.try_borrow_mut().ok()?;
        Some(std::mem::replace(&mut *free, lists.take()?))
    });
    // Lists that found no place are dropped here, which frees their blocks.
    swapped.ok().flatten().unwrap_or(Lists::EMPTY)
}

/// Blocks this thread keeps (for tests).
#[cfg(test)]
fn kept() -> usize {
    FREE.with(|free| free.borrow().kept)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts its drops.
    struct Tracked(Arc<AtomicUsize>, [u64; 8]);

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    trait Body {
        fn sum(&self) -> u64;
    }

    /// Where a boxed body lives (its block).
    fn block_of(body: &dyn Body) -> *const u8 {
        (body as *const dyn Body).cast::<u8>()
    }

    impl Body for Tracked {
        fn sum(&self) -> u64 {
            self.1.iter().sum()
        }
    }

    impl<const N: usize> Body for [u8; N] {
        fn sum(&self) -> u64 {
            self.iter().map(|&b| u64::from(b)).sum()
        }
    }

    #[test]
    fn a_recycled_block_is_reused_for_the_same_layout_only() {
        let drops = Arc::new(AtomicUsize::new(0));
        let first: Box<dyn Body> = boxed(Tracked(drops.clone(), [1; 8]));
        let first_at = block_of(&*first);
        recycle(first);
        assert_eq!(drops.load(Ordering::SeqCst), 1, "the value is dropped once");

        // Another layout does not take the block.
        let other: Box<dyn Body> = boxed([1u8, 2, 3]);
        assert_ne!(block_of(&*other), first_at);
        assert_eq!(other.sum(), 6);

        // The same layout does, and holds the new value.
        let second: Box<dyn Body> = boxed(Tracked(drops.clone(), [2; 8]));
        assert_eq!(block_of(&*second), first_at);
        assert_eq!(second.sum(), 16);
        drop(second);
        assert_eq!(drops.load(Ordering::SeqCst), 2);
        recycle(other);
    }

    #[test]
    fn a_thread_keeps_at_most_capacity_blocks_and_frees_them_on_exit() {
        std::thread::spawn(|| {
            let drops = Arc::new(AtomicUsize::new(0));
            let many: Vec<Box<dyn Body>> = (0..CAPACITY + 5)
                .map(|k| boxed(Tracked(drops.clone(), [k as u64; 8])) as Box<dyn Body>)
                .collect();
            many.into_iter().for_each(recycle);
            assert_eq!(drops.load(Ordering::SeqCst), CAPACITY + 5);
            assert_eq!(kept(), CAPACITY);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn each_layout_gets_a_slot_and_one_more_layout_is_freed() {
        std::thread::spawn(|| {
            // Five layouts for four slots: the fifth block is not kept; each other one comes
            // back for its own layout only.
            let blocks: [Box<dyn Body>; SLOTS + 1] = [
                boxed([1u8; 8]),
                boxed([1u8; 16]),
                boxed([1u8; 24]),
                boxed([1u8; 32]),
                boxed([1u8; 40]),
            ];
            let at: Vec<*const u8> = blocks.iter().map(|b| block_of(&**b)).collect();
            blocks.into_iter().for_each(recycle);
            assert_eq!(kept(), SLOTS);
            let again: [Box<dyn Body>; SLOTS] = [
                boxed([2u8; 32]),
                boxed([2u8; 24]),
                boxed([2u8; 16]),
                boxed([2u8; 8]),
            ];
            let again_at: Vec<*const u8> = again.iter().map(|b| block_of(&**b)).collect();
            assert_eq!(again_at, [at[3], at[2], at[1], at[0]]);
            assert_eq!(
                again.iter().map(|b| b.sum()).sum::<u64>(),
                2 * (32 + 24 + 16 + 8)
            );
            assert_eq!(kept(), 0);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn lent_blocks_serve_another_thread_and_come_back_with_what_it_freed() {
        std::thread::spawn(|| {
            let drops = Arc::new(AtomicUsize::new(0));
            let tracked = |k| boxed(Tracked(drops.clone(), [k; 8])) as Box<dyn Body>;
            recycle(tracked(1));
            assert_eq!(kept(), 1);
            let mut lent = lend();
            assert_eq!(kept(), 0, "lent out, not kept here");
            std::thread::scope(|s| {
                s.spawn(|| {
                    // The other thread's own block is set aside while it holds the lent ones.
                    recycle(boxed([1u8; 16]) as Box<dyn Body>);
                    assert_eq!(kept(), 1);
                    with_lent(&mut lent, || {
                        assert_eq!(kept(), 1, "the lent block");
                        let reused = tracked(2);
                        assert_eq!(kept(), 0, "taken from the lent list");
                        assert_eq!(reused.sum(), 16);
                        let another = tracked(3);
                        recycle(reused);
                        recycle(another);
                        assert_eq!(kept(), 2);
                    });
                    assert_eq!(kept(), 1, "its own block is back");
                });
            });
            put_back(lent);
            assert_eq!(kept(), 2, "both blocks freed there are kept here");
            assert_eq!(drops.load(Ordering::SeqCst), 3);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_batch_keeps_its_frees_in_the_taken_blocks_and_puts_them_back() {
        std::thread::spawn(|| {
            let drops = Arc::new(AtomicUsize::new(0));
            let tracked = |k| boxed(Tracked(drops.clone(), [k; 8])) as Box<dyn Body>;
            let batch: Vec<Box<dyn Body>> = (0..CAPACITY as u64 + 3).map(tracked).collect();
            let at: Vec<*const u8> = batch.iter().map(|b| block_of(&**b)).collect();
            let mut kept_here = lend();
            for body in batch {
                kept_here.recycle(body);
            }
            assert_eq!(
                drops.load(Ordering::SeqCst),
                CAPACITY + 3,
                "each value dropped once"
            );
            assert_eq!(kept(), 0, "nothing went through the thread-local");
            put_back(kept_here);
            assert_eq!(
                kept(),
                CAPACITY,
                "at most `CAPACITY` kept; the rest were freed"
            );
            // The last block kept is the first reused.
            let reused = tracked(9);
            assert_eq!(block_of(&*reused), at[CAPACITY - 1]);
            assert_eq!(reused.sum(), 72);
            // A block too large to keep is freed, never kept.
            let mut kept_here = lend();
            kept_here.recycle(Box::new([0u8; MAX_BLOCK + 1]) as Box<dyn Body>);
            put_back(kept_here);
            assert_eq!(
                kept(),
                CAPACITY - 1,
                "the taken blocks are back, the large one is not"
            );
            drop(reused);
        })
        .join()
        .unwrap();
    }

    /// A body dropped in place by its own code (as `OpBody::execute_then_drop` does) leaves an
    /// allocation that `keep_emptied` keeps for the next body of its layout; one too large is
    /// freed, and a zero-sized value's `Box`, which allocated nothing, is left alone.
    #[test]
    fn an_allocation_emptied_in_place_is_kept_or_freed() {
        /// What the engine does with a body that has run: its layout read, its value dropped
        /// through its `dyn` table, its allocation handed on.
        fn empty_into(lent: &mut Lent, body: Box<dyn Body>) {
            let layout = Layout::for_value(&*body);
            let raw = Box::into_raw(body);
            // SAFETY: `raw` is a live `Box`'s value, dropped once here and never used again;
            // its allocation (of `layout`) goes to `keep_emptied` alone.
            unsafe {
                std::ptr::drop_in_place(raw);
                lent.keep_emptied(raw, layout);
            }
        }
        std::thread::spawn(|| {
            let drops = Arc::new(AtomicUsize::new(0));
            let first: Box<dyn Body> = boxed(Tracked(drops.clone(), [3; 8]));
            let first_at = block_of(&*first);
            let mut kept_here = lend();
            empty_into(&mut kept_here, first);
            assert_eq!(drops.load(Ordering::SeqCst), 1, "the value is dropped once");
            empty_into(&mut kept_here, Box::new([0u8; MAX_BLOCK + 1]));
            empty_into(&mut kept_here, Box::new([0u8; 0]));
            put_back(kept_here);
            assert_eq!(kept(), 1, "the body's block alone is kept");
            let second: Box<dyn Body> = boxed(Tracked(drops.clone(), [4; 8]));
            assert_eq!(block_of(&*second), first_at, "and reused");
            assert_eq!(second.sum(), 32);
            drop(second);
            assert_eq!(drops.load(Ordering::SeqCst), 2);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_panicking_destructor_still_frees_the_block() {
        struct Panics;
        impl Drop for Panics {
            fn drop(&mut self) {
                panic!("destructor");
            }
        }
        let before = kept();
        let b = boxed((Panics, [0u64; 4]));
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| recycle(b)));
        assert!(result.is_err());
        // Not kept: the unwinding freed it (miri without `-Zmiri-ignore-leaks` would report it
        // otherwise).
        assert_eq!(kept(), before);
    }
}
