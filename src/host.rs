//! [`HostRuntime`]: the embedded default runtime, an asynchronous CPU device.
//!
//! It behaves like a GPU where ordering is concerned, so every ordering rule of the engine is
//! exercised without one:
//!
//! * **Asynchronous streams.** Each stream has a worker thread; `launch` only *dispatches* a kernel
//!   to it and returns. Work is genuinely pending until the worker gets to it.
//! * **Cross-stream ordering.** Every buffer write has a completion marker; a
//!   kernel waits (on its worker, never on the caller's thread) for the markers of every buffer it
//!   reads, so a view consumed on stream B is ordered after its producer on stream A.
//! * **No reuse under a reader.** In-flight kernels own references to the buffers they read, so a
//!   buffer is never freed or written in place while any stream still reads it.
//! * **Execution-time failures.** A kernel can fail on the device after a successful dispatch
//!   (`FusionClient::fail_on_device`, feature `testing`); its marker records the error, kernels reading the
//!   buffer propagate it, and the read that waits for it returns it.
//! * **Teardown.** Dropping the last owner of the [`HostContext`] lets every worker finish what was
//!   dispatched to it, then joins them.
//!
//! This is the crate's one public path to the host runtime.

#[cfg(feature = "testing")]
pub use crate::runtime::host::StreamPause;
pub use crate::runtime::host::{
    HostContext, HostDevice, HostEvent, HostHandle, HostRuntime, HostSlice, HostStats, HostValues,
    Unfused,
};
