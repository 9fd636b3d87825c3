//! # fusion-streams
//!
//! Correct, fast multi-thread semantics for a lazy, burn-style fusion backend.
//!
//! Each thread records operations lazily on its own stream. A [`FusionTensor`] is `Send + Clone`;
//! cloned (or used) on another thread it becomes a *shared view* — a fresh id on that thread's
//! stream aliasing the same buffer — after the source's pending producer has been materialised.
//! Drops, reads and errors keep working across threads, nothing leaks, and no stream ever holds
//! another stream's ids. [`MultiStream`] documents the design.
//!
//! ```
//! use fusion_streams::{FusionClient, host::{HostDevice, HostRuntime}};
//! use burn_backend::TensorData;
//!
//! let client = FusionClient::<HostRuntime>::new(HostDevice::default())?;
//! let x = client.from_data(TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [4]))?;
//! let pending = x.scale(10.0)?.add(&x)?; // queued on this thread's stream
//!
//! // Clone to another thread: the producer runs first, then the buffer is aliased there.
//! let total = std::thread::scope(|s| {
//!     s.spawn(|| pending.clone().sum()?.to_vec::<f32>()).join().unwrap()
//! })?;
//! assert_eq!(total, vec![110.0]);
//!
//! drop((x, pending));
//! client.sync()?;
//! assert!(client.stats().is_quiescent()); // nothing held, nothing pending
//! # Ok::<(), fusion_streams::Error>(())
//! ```
//!
//! ## Layout
//!
//! * [`FusionClient`] and [`FusionTensor`] — the user API: upload, built-in ops, custom and burn
//!   operations, reads, statistics.
//! * [`MultiStream`] — the engine: per-stream lazy queues and handle maps, shared views, foreign
//!   drops.
//! * [`runtime`] — every device contract ([`runtime::StreamRuntime`],
//!   [`runtime::TransferRuntime`], the retirement queue); the runtimes themselves are [`host`]
//!   (the embedded asynchronous CPU device) and [`backend::BackendRuntime`] (any burn backend).
//! * [`transfer`] — held sessions, source publication, pinned downloads.
//! * [`backend`] — [`backend::StreamFusion`], a burn `Backend` over the engine for any backend
//!   that speaks burn's IR.
//!
//! ## Feature flags
//!
//! * `cuda` — `StreamFusion<cuda::Cuda>`: burn's CubeCL backend on an NVIDIA GPU over
//!   cubecl-cuda 0.10, with kernel fusion, the cross-stream rules and DMA downloads.
//!   Builds without a GPU or a CUDA toolkit (set `CUDARC_CUDA_VERSION=13000` to pin the driver
//!   bindings); needs the NVIDIA driver at run time.

#![warn(missing_docs, missing_debug_implementations)]

pub mod backend;
mod client;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
pub mod host;
pub mod id;
mod live;
mod loom;
mod operation;
pub mod profile;
pub mod runtime;
mod size;
mod small;
mod stream;
pub mod transfer;

pub use client::{FusionClient, FusionTensor, OpBuilder, Operand};
pub use error::{Error, Rejected, Result};
pub use operation::{BurnOperation, CustomExecutor, FallibleOperation};
pub use stream::{EngineConfig, EngineStats, MultiStream, Pending};

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// Re-exports of the burn vocabulary used in this crate's API, and of the burn crates themselves
/// at the exact versions this crate is built on (so a user who needs more of them does not have
/// to match versions by hand).
pub mod burn {
    pub use burn_backend as backend;
    pub use burn_backend::{DType, Shape, StreamId, TensorData};
    pub use burn_fusion as fusion;
    pub use burn_ir as ir;
    pub use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorId, TensorIr, TensorStatus};
}
