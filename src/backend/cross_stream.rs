//! Buffers that cross streams on a burn backend's device: the rules the engine adds where the
//! backend's own are not enough ([`StreamRules`]).
//!
//! # Why this exists: cubecl 0.10 on CUDA
//!
//! burn's CubeCL backend runs each thread's work on its own CUDA stream (cubecl picks the stream
//! from [`StreamId::current`]), and leaves the ordering of a buffer used on two streams to
//! cubecl's `MultiStream`. In cubecl 0.10 that leaves two hazards open (measured on an H200:
//! `docs/cross-stream-cuda.md`):
//!
//! 1. **A read before the last write.** A stream waits for a buffer's home stream only when the
//!    buffer's *allocation* cursor is past the last point it synchronised with that stream. A
//!    write dispatched after the allocation — the kernel that fills a fresh output, or an
//!    in-place write — is not waited for once the reader has synchronised past the allocation
//!    for any other buffer.
//! 2. **Reuse under a reader.** A buffer whose last owner drops returns at once to its home
//!    stream's pool, and the next allocation there of a fitting size reuses it, ordered only
//!    within the home stream. A kernel on another stream that still reads it is not waited for
//!    (the garbage collector cubecl hands shared bindings to holds their ids, which are plain
//!    numbers, not the memory).
//!
//! # What the engine does instead
//!
//! A buffer is *foreign* to a stream when another cubecl stream allocated it
//! ([`StreamRules::foreign_to`]). The engine knows every point where a buffer meets a stream
//! it is foreign to — a shared view registered, a tensor read on another thread, a view let go
//! of — and calls the rules there:
//!
//! * **Ordering (closes hazard 1).** When a view is registered on stream `C`, or a tensor is
//!   read on `C`, `C` is made to wait on the device for everything already dispatched on the
//!   buffer's home stream `H` ([`StreamRules::order_use`]). Every write of the buffer was
//!   dispatched by then: the engine materialises a source before aliasing it, an aliased buffer
//!   is never written in place, and a foreign buffer is never written in place at all (the
//!   engine keeps such a consumed input read-only, see `StreamState::execute_one`), so `H` holds
//!   every write the buffer will ever get. One wait covers everything `H` had dispatched, so
//!   `C` waits for `H` again only once `H` has dispatched something since (the engine keeps a
//!   stamp per stream for this, `MultiStream::plan_order`): a consumer taking the tensors one
//!   fused kernel of a producer wrote waits once, not once per tensor.
//! * **Release (closes hazard 2).** A handle of a buffer foreign to `C` that `C` lets go of —
//!   a view freed, consumed or read for the last time, or the second owner the engine held while
//!   an operation consumed it — is released by [`StreamRules::release_after_use`]: `H` is made to
//!   wait on the device for everything dispatched on `C` so far, and only then is the handle
//!   dropped. Any reuse of the memory happens in `H`'s pool, on `H`, after that wait.
//!
//! Both are one closure submitted to cubecl's server without waiting for it, in order after
//! everything the engine dispatched before (`DeviceHandle::submit`; cubecl's channel keeps the
//! order of submissions that happen one after the other, from any threads). cubecl exposes no
//! way to make one stream wait for another, so the closure asks cubecl's own alignment for it:
//! it allocates a small marker buffer on the stream to wait for, whose cursor is new by
//! construction, and resolves it on the waiting stream ([`wait_for`]). The host never waits.
//!
//! # Why the device waits, not the host
//!
//! The release could instead keep the handle on the host until an event recorded on `C` has
//! completed (PyTorch's `record_stream`, or this crate's retirement queue). That needs a thread or
//! a poll to notice the completion, holds the memory for as long as the host takes to notice,
//! and leaves `H` free to reuse nothing in the meantime. Making `H` wait on the device costs one
//! event and one stream wait, both recorded where the buffer could next be touched, and frees
//! the handle at once: any reuse is ordered behind the reader by the device itself.
//!
//! Backends whose devices order every access themselves (NdArray: a host array is read where it
//! is) have no rules: [`rules_for`] returns `None`.

use burn_backend::StreamId;

use super::IrBackend;

/// The rules of one device of backend `B` for buffers that cross streams (see the module docs).
pub(crate) trait StreamRules<B: IrBackend>: Send + Sync {
    /// Whether another stream than `stream` allocated `handle`'s buffer.
    fn foreign_to(&self, handle: &B::Handle, stream: StreamId) -> bool;

    /// Make work dispatched on `stream` from now on wait for everything already dispatched on
    /// the stream that allocated `handle`'s buffer.
    fn order_use(&self, handle: &B::Handle, stream: StreamId);

    /// Drop `handles` (each foreign to `stream`) once the streams that allocated them wait for
    /// everything already dispatched on `stream`.
    fn release_after_use(&self, stream: StreamId, handles: Vec<B::Handle>);
}

/// The rules of `device`, if backend `B` needs any (CubeCL on CUDA, with the `cuda` feature).
pub(crate) fn rules_for<B: IrBackend>(device: &B::Device) -> Option<Box<dyn StreamRules<B>>> {
    #[cfg(feature = "cuda")]
    if let Some(rules) = cuda::CudaRules::for_backend::<B>(device) {
        return Some(Box::new(rules));
    }
    let _ = device;
    None
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::any::Any;

    use burn_backend::StreamId;
    use cubecl::cuda::CudaRuntime;
    use cubecl::device_handle::DeviceHandle;
    use cubecl::server::{ComputeServer, Handle};
    use smallvec::SmallVec;

    use super::{IrBackend, StreamRules};
    use crate::backend::cuda::{CudaHandle, cuda_device, cuda_handle as cuda};

    type Server = <CudaRuntime as cubecl::Runtime>::Server;

    /// The size of the marker buffer [`wait_for`] allocates: the smallest a pool hands out.
    const MARKER_BYTES: u64 = 4;

    /// The rules of a CubeCL CUDA device, for every backend whose handles are
    /// `CubeFusionHandle<CudaRuntime>` (burn's `CubeBackend<CudaRuntime, F, I, B>` for any
    /// element types).
    pub(super) struct CudaRules {
        device: DeviceHandle<Server>,
    }

    impl CudaRules {
        /// The rules for backend `B`'s `device`, if `B`'s handles are cubecl CUDA handles.
        pub(super) fn for_backend<B: IrBackend>(device: &B::Device) -> Option<Self> {
            use cubecl::device::Device as _;
            Some(Self {
                device: DeviceHandle::new(cuda_device::<B>(device)?.to_id()),
            })
        }
    }

    impl<B: IrBackend> StreamRules<B> for CudaRules {
        fn foreign_to(&self, handle: &B::Handle, stream: StreamId) -> bool {
            cuda(handle).handle.stream != stream
        }

        fn order_use(&self, handle: &B::Handle, stream: StreamId) {
            let home = cuda(handle).handle.stream;
            if home != stream {
                self.device
                    .submit(move |server: &mut Server| wait_for(server, stream, home));
            }
        }

        fn release_after_use(&self, stream: StreamId, mut handles: Vec<B::Handle>) {
            let handles: Vec<CudaHandle> = std::mem::take(
                (&mut handles as &mut dyn Any)
                    .downcast_mut()
                    .expect("the rules of a cubecl CUDA device see only its handles"),
            );
            let mut homes: SmallVec<[StreamId; 4]> = SmallVec::new();
            for handle in &handles {
                let home = handle.handle.stream;
                if home != stream && !homes.contains(&home) {
                    homes.push(home);
                }
            }
            self.device.submit(move |server: &mut Server| {
                for home in homes {
                    wait_for(server, home, stream);
                }
                // Any reuse of these buffers is now behind `stream`'s work on the device.
                drop(handles);
            });
        }
    }

    /// On cubecl's server: make `waiter` wait, on the device, for everything dispatched on
    /// `done` so far.
    ///
    /// cubecl makes a stream wait for another when it meets a binding of the other stream whose
    /// cursor is past the last point it synchronised with it; it then records an event on the
    /// other stream and waits for it. A binding allocated now has the other stream's newest
    /// cursor, so resolving it on `waiter` always does that.
    fn wait_for(server: &mut Server, waiter: StreamId, done: StreamId) {
        let marker = Handle::new(done, MARKER_BYTES);
        server.initialize_memory(marker.memory.clone(), MARKER_BYTES, done);
        if let Err(error) = server.get_resource(marker.binding(), waiter) {
            tracing::warn!(%waiter, %done, %error, "ordering one cubecl stream after another failed");
        }
    }
}
