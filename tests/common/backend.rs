//! The burn backend the backend tests run on: NdArray by default; with the `cuda` feature,
//! burn's CubeCL backend on CUDA (then every test that uses it needs a GPU and is ignored unless
//! asked for: see scripts/gpu-tests.sh).

#[cfg(not(feature = "cuda"))]
pub type Plain = burn_ndarray::NdArray<f32>;
#[cfg(feature = "cuda")]
pub type Plain = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
/// [`Plain`] under this crate's engine.
pub type Ours = fusion_streams::backend::StreamFusion<Plain>;
