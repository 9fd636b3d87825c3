//! The runtime-generic cross-thread suite (`tests/suite/`) on the host runtime. The same suite
//! runs on burn backends in `suite_backend.rs` (NdArray in CI, CUDA on a GPU).

mod common;
mod suite;

use common::client;

suite::cross_thread_suite!({} client, suite::Counters::host(), 1 << 16);
