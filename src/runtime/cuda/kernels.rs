//! The built-in kernels in CubeCL. One unit per output element, cubes of [`BLOCK`] units.
//!
//! Every kernel name ends in `_kernel`: NVRTC compiles kernels with C linkage, so a kernel named
//! like a CUDA math function (`exp`) fails to compile ("more than one instance of overloaded
//! function has C linkage", seen on the H200).
//!
//! Summation order matches the host runtime's (sequential, in element order, in the element
//! type), so sums and matrix products of exactly representable values are bit-identical across
//! runtimes.

use cubecl::prelude::*;

/// Units per cube.
pub(crate) const BLOCK: u32 = 256;

#[cube(launch)]
pub(crate) fn add_kernel<N: Numeric>(lhs: &Array<N>, rhs: &Array<N>, out: &mut Array<N>) {
    if ABSOLUTE_POS < out.len() {
        out[ABSOLUTE_POS] = lhs[ABSOLUTE_POS] + rhs[ABSOLUTE_POS];
    }
}

#[cube(launch)]
pub(crate) fn add_in_place_kernel<N: Numeric>(lhs: &mut Array<N>, rhs: &Array<N>) {
    if ABSOLUTE_POS < lhs.len() {
        lhs[ABSOLUTE_POS] += rhs[ABSOLUTE_POS];
    }
}

#[cube(launch)]
pub(crate) fn mul_kernel<N: Numeric>(lhs: &Array<N>, rhs: &Array<N>, out: &mut Array<N>) {
    if ABSOLUTE_POS < out.len() {
        out[ABSOLUTE_POS] = lhs[ABSOLUTE_POS] * rhs[ABSOLUTE_POS];
    }
}

#[cube(launch)]
pub(crate) fn mul_in_place_kernel<N: Numeric>(lhs: &mut Array<N>, rhs: &Array<N>) {
    if ABSOLUTE_POS < lhs.len() {
        lhs[ABSOLUTE_POS] *= rhs[ABSOLUTE_POS];
    }
}

#[cube(launch)]
pub(crate) fn scale_kernel(input: &Array<f32>, out: &mut Array<f32>, factor: f32) {
    if ABSOLUTE_POS < out.len() {
        out[ABSOLUTE_POS] = input[ABSOLUTE_POS] * factor;
    }
}

#[cube(launch)]
pub(crate) fn scale_in_place_kernel(data: &mut Array<f32>, factor: f32) {
    if ABSOLUTE_POS < data.len() {
        data[ABSOLUTE_POS] *= factor;
    }
}

#[cube(launch)]
pub(crate) fn exp_kernel(input: &Array<f32>, out: &mut Array<f32>) {
    // Used by the expansion `#[cube]` generates, not by the plain-Rust body rustc lints.
    #[allow(unused_imports)]
    use cubecl::frontend::Exp;
    if ABSOLUTE_POS < out.len() {
        out[ABSOLUTE_POS] = f32::exp(input[ABSOLUTE_POS]);
    }
}

#[cube(launch)]
pub(crate) fn exp_in_place_kernel(data: &mut Array<f32>) {
    #[allow(unused_imports)]
    use cubecl::frontend::Exp;
    if ABSOLUTE_POS < data.len() {
        data[ABSOLUTE_POS] = f32::exp(data[ABSOLUTE_POS]);
    }
}

/// A single unit adds every element in order (the host runtime's order).
#[cube(launch)]
pub(crate) fn sum_kernel<N: Numeric>(input: &Array<N>, out: &mut Array<N>) {
    if ABSOLUTE_POS == 0 {
        let mut acc = N::from_int(0);
        for i in 0..input.len() {
            acc += input[i];
        }
        out[0] = acc;
    }
}

/// `out[i, j] = sum over p of lhs[i, p] * rhs[p, j]`, accumulated in order of `p`.
#[cube(launch)]
pub(crate) fn matmul_kernel(
    lhs: &Array<f32>,
    rhs: &Array<f32>,
    out: &mut Array<f32>,
    k: u32,
    n: u32,
) {
    if ABSOLUTE_POS < out.len() {
        let row = ABSOLUTE_POS / n as usize;
        let col = ABSOLUTE_POS % n as usize;
        let mut acc = 0.0f32;
        for p in 0..k as usize {
            acc += lhs[row * k as usize + p] * rhs[p * n as usize + col];
        }
        out[ABSOLUTE_POS] = acc;
    }
}

/// Fault injection (`Kernel::FailOnDevice`): NVRTC refuses to compile this kernel — its name
/// collides with CUDA's `exp` under C linkage — so it fails on cubecl's server *after* the
/// engine's dispatch returned, the way a device failure does. cubecl's server stays unhealthy for
/// the rest of the process: use it in a process of its own.
#[cfg(feature = "testing")]
#[cube(launch)]
pub(crate) fn exp(input: &Array<f32>, out: &mut Array<f32>) {
    if ABSOLUTE_POS < out.len() {
        out[ABSOLUTE_POS] = input[ABSOLUTE_POS];
    }
}

#[cube(launch)]
pub(crate) fn fill_kernel<N: Numeric>(out: &mut Array<N>, value: f32) {
    if ABSOLUTE_POS < out.len() {
        out[ABSOLUTE_POS] = N::cast_from(value);
    }
}
