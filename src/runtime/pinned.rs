//! [`PinnedHostBuffer`]: caller-owned, page-aligned host memory that downloads copy into.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use burn_backend::{DType, Shape, TensorData};

use crate::{Error, Result};

/// Page size the host allocation is aligned to.
const PAGE: usize = 4096;

/// Memory behind a [`PinnedHostBuffer`]. Implemented by each runtime's allocator (page-aligned
/// host memory here; page-locked `cuMemHostAlloc` memory on CUDA).
pub(crate) trait PinnedMemory: Send + Sync {
    /// Start of the memory. Valid, and not moved, for the memory's whole life.
    fn as_ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// What kind of memory this is, for `Debug`.
    fn kind(&self) -> &'static str;
    /// Whether the memory is page-locked (registered with a device driver for DMA).
    fn page_locked(&self) -> bool {
        false
    }
}

/// Page-aligned host memory from the global allocator.
struct HostPages {
    ptr: NonNull<u8>,
    layout: Layout,
    len: usize,
}

// SAFETY: `HostPages` owns its allocation outright (no aliasing pointer escapes except through
// `PinnedHostBuffer`, which enforces exclusive access: the user holds the buffer, or one in-flight
// copy does, never both). Moving it or sharing `&HostPages` across threads is therefore sound.
unsafe impl Send for HostPages {}
// SAFETY: see `Send`; `&HostPages` exposes only the pointer and the length.
unsafe impl Sync for HostPages {}

impl HostPages {
    fn new(len: usize) -> Result<Self> {
        let size = crate::size::round_up("a pinned host buffer", len, PAGE)?;
        let layout = Layout::from_size_align(size, PAGE).map_err(|e| Error::TooLarge {
            what: "a pinned host buffer".into(),
            detail: format!("{len} bytes: {e}"),
        })?;
        // SAFETY: `layout` has a non-zero size: len > 0 is checked by the caller, and `size` is
        // `len` rounded up to a whole page without overflow.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::OutOfMemory {
            what: "a pinned host buffer".into(),
            bytes: size,
        })?;
        Ok(Self { ptr, layout, len })
    }
}

impl Drop for HostPages {
    fn drop(&mut self) {
        // SAFETY: `ptr` was returned by `alloc_zeroed` with exactly `layout`, and is freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

impl PinnedMemory for HostPages {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> &'static str {
        "host pages"
    }
}

/// Host memory a download copies into: caller-owned and reusable.
///
/// Allocating pinned memory is expensive (on CUDA, `cuMemHostAlloc` of 256 MiB took 119 ms on an
/// H200), so a buffer is meant to be reused: [`crate::transfer::PendingDownload::wait`] hands it
/// back for the next download. While a copy is in flight the buffer belongs to the download; no
/// safe code can reach its bytes until the copy has finished.
///
/// Not `Clone`: a second owner could read the bytes while a copy writes them.
pub struct PinnedHostBuffer {
    pub(crate) memory: Arc<dyn PinnedMemory>,
}

impl PinnedHostBuffer {
    /// A page-aligned host buffer of `len` bytes, zero-filled, from the global allocator.
    ///
    /// It is **not page-locked**: ordinary pageable memory, which every runtime can copy into,
    /// but which a GPU cannot write by DMA (a CUDA copy into it is staged through the driver's
    /// own buffers, and is slower). For downloads from a GPU, allocate with the device's
    /// allocator instead: [`crate::backend::StreamFusion::pinned_buffer`] (or
    /// [`crate::runtime::TransferRuntime::alloc_pinned`]), which gives page-locked
    /// `cuMemHostAlloc` memory on CUDA and this same memory on host backends.
    /// [`PinnedHostBuffer::is_page_locked`] tells the two apart.
    ///
    /// A zero length is rejected with [`Error::InvalidData`], a length no allocation can have
    /// with [`Error::TooLarge`], and a failed allocation is [`Error::OutOfMemory`].
    pub fn new(len: usize) -> Result<Self> {
        Self::check_len(len)?;
        Ok(Self::from_memory(Arc::new(HostPages::new(len)?)))
    }

    /// The length rule every allocator of pinned buffers applies: at least one byte, and no more
    /// than an allocation can have.
    pub(crate) fn check_len(len: usize) -> Result<()> {
        if len == 0 {
            return Err(Error::InvalidData(
                "a pinned buffer needs at least one byte".into(),
            ));
        }
        crate::size::round_up("a pinned host buffer", len, 1).map(drop)
    }

    pub(crate) fn from_memory(memory: Arc<dyn PinnedMemory>) -> Self {
        Self { memory }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// Whether the memory is page-locked (from a device driver's allocator, such as CUDA's
    /// `cuMemHostAlloc`), so that a device copies into it by DMA. `false` for
    /// [`PinnedHostBuffer::new`]'s memory.
    pub fn is_page_locked(&self) -> bool {
        self.memory.page_locked()
    }

    /// Always `false`: empty buffers are rejected at allocation.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: the memory is valid for `len` bytes for as long as `self.memory` lives, and no
        // copy writes it while the caller can hold `&self`: a buffer under copy is owned by its
        // download, which gives it back only after the copy's completion has been observed.
        unsafe { std::slice::from_raw_parts(self.memory.as_ptr(), self.memory.len()) }
    }

    /// The bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.memory.as_ptr(), self.memory.len()) }
    }

    /// The bytes as burn [`TensorData`] of `shape` and `dtype` (copied).
    pub fn to_data(&self, shape: impl Into<Shape>, dtype: DType) -> Result<TensorData> {
        let shape = shape.into();
        let expected = crate::size::tensor_bytes("pinned data", &shape, dtype, usize::MAX)?;
        if expected != self.len() {
            return Err(Error::BufferSize {
                expected,
                found: self.len(),
            });
        }
        Ok(TensorData::from_bytes_vec(
            self.as_bytes().to_vec(),
            shape,
            dtype,
        ))
    }
}

impl fmt::Debug for PinnedHostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedHostBuffer")
            .field("len", &self.len())
            .field("memory", &self.memory.kind())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    //! Properties: buffers are page aligned and zeroed; zero length is refused; `to_data`
    //! checks the size.
    use super::*;

    #[test]
    fn page_aligned_zeroed_and_sized() {
        let mut buffer = PinnedHostBuffer::new(10).unwrap();
        assert_eq!(buffer.len(), 10);
        assert_eq!(buffer.as_bytes().as_ptr() as usize % PAGE, 0);
        assert!(buffer.as_bytes().iter().all(|b| *b == 0));
        buffer.as_bytes_mut()[3] = 7;
        assert_eq!(buffer.as_bytes()[3], 7);
        assert!(matches!(
            PinnedHostBuffer::new(0),
            Err(Error::InvalidData(_))
        ));
        assert!(matches!(
            buffer.to_data([2], DType::F32),
            Err(Error::BufferSize {
                expected: 8,
                found: 10
            })
        ));
    }
}
