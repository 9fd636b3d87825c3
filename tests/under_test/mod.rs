//! The burn backend the backend tests run on: NdArray by default; with the `cuda` feature,
//! burn's CubeCL backend on CUDA (then every test that uses it needs a GPU and is ignored unless
//! asked for: see scripts/gpu-tests.sh). The benches include this file too, for the same types
//! and the elementwise chain. (Not in `tests/common`: the fuzz target includes that, and has no
//! burn backend.)
#![allow(dead_code)]

use burn_backend::Backend;
use burn_tensor::Tensor;

#[cfg(not(feature = "cuda"))]
pub type Plain = burn_ndarray::NdArray<f32>;
#[cfg(feature = "cuda")]
pub type Plain = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
/// [`Plain`] under this crate's engine.
pub type Ours = fusion_streams::backend::StreamFusion<Plain>;

/// `ops` cheap elementwise operations on `t`, alternating so that the values stay bounded: the
/// chain of the fusion tests and of the backend and per-op benches.
pub fn elementwise_chain<B: Backend>(mut t: Tensor<B, 1>, ops: usize) -> Tensor<B, 1> {
    for i in 0..ops {
        t = match i % 4 {
            0 => t * 1.5,
            1 => t.tanh(),
            2 => t + 0.25,
            _ => t.abs(),
        };
    }
    t
}
