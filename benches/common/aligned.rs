//! An allocator for the benches that compare NdArray kernels on both sides: every allocation of
//! [`Aligned::LARGE`] bytes or more on a 64-byte boundary while [`ALIGNED`] is set.
//!
//! glibc aligns to 16 bytes, so a large buffer lands on or off a 32-byte boundary by the heap's
//! history, which differs between our engine's run and plain NdArray's. NdArray's SIMD loops
//! take a scalar head and tail off the boundary: callgrind counted up to ~80 instructions per
//! 1 Ki-element op of difference, in either direction, none of it the engine's. A bench that
//! installs this allocator (`#[global_allocator]`) and sets [`ALIGNED`] first thing in `main`
//! gives both sides the same boundary.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, Ordering};

/// The system allocator, with allocations of [`Aligned::LARGE`] bytes or more on a 64-byte
/// boundary while [`ALIGNED`] is set (see the module docs).
pub struct Aligned;

/// Set once, first thing in `main`, before any allocation of [`Aligned::LARGE`] bytes or more.
pub static ALIGNED: AtomicBool = AtomicBool::new(false);

impl Aligned {
    pub const LARGE: usize = 1024;

    fn layout(layout: Layout) -> Layout {
        let aligned = ALIGNED.load(Ordering::Relaxed);
        if !aligned || layout.size() < Self::LARGE || layout.align() >= 64 {
            return layout;
        }
        // A valid layout's size stays valid at a larger power-of-two alignment up to 64.
        Layout::from_size_align(layout.size(), 64).unwrap_or(layout)
    }
}

// SAFETY: every call forwards to `System` with the layout `Aligned::layout` derives from the
// caller's. It gives the same layout when a block is freed or grown as when it was made:
// `ALIGNED` is set once, in `main`, before any allocation of `LARGE` bytes or more (what the
// runtime and the argument list allocate before it is smaller), and never changes after. The
// alignment only grows, so the caller's is met.
unsafe impl GlobalAlloc for Aligned {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        unsafe { System.alloc(Self::layout(layout)) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        unsafe { System.alloc_zeroed(Self::layout(layout)) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, Self::layout(layout)) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = Self::layout(layout);
        let Ok(wanted) = Layout::from_size_align(new_size, layout.align()) else {
            return std::ptr::null_mut();
        };
        let new = Self::layout(wanted);
        if new.align() == old.align() {
            return unsafe { System.realloc(ptr, old, new_size) };
        }
        // Crossing `LARGE` changes the alignment: move the bytes by hand.
        let moved = unsafe { System.alloc(new) };
        if !moved.is_null() {
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, moved, layout.size().min(new_size));
                System.dealloc(ptr, old);
            }
        }
        moved
    }
}
