//! The multi-thread programs burn users hit bugs with, on `StreamFusion<NdArray>` through burn's
//! `Tensor` API: clones into threads that do nothing and never wait (burn issue 4328), a tensor
//! behind `Arc<RwLock<_>>` replaced while readers clone it (burn issue 4947), a backend panic on
//! another thread, and tensors moved through a worker pool. One test runs them in order, so the
//! device's engine (shared by every test of a binary) can be checked to hold nothing after each.

mod under_test;

use std::sync::{Arc, Barrier, RwLock};

use burn_backend::Backend;
use burn_tensor::{Distribution, Tensor};

use under_test::{Ours, Plain};

#[test]
#[cfg_attr(
    feature = "cuda",
    ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"
)]
fn burn_multi_thread_programs() {
    for (name, program) in [
        (
            "4328: clones dropped on threads without ops",
            clones_dropped_on_threads_without_ops as fn(),
        ),
        (
            "4947: a tensor behind a lock replaced while readers clone it",
            a_tensor_behind_a_lock_replaced_while_readers_clone_it,
        ),
        (
            "a backend panic on another thread",
            a_backend_panic_becomes_an_error_on_the_data,
        ),
        (
            "tensors moved through a worker pool",
            tensors_moved_between_threads_and_dropped_there,
        ),
    ] {
        program();
        let device = Default::default();
        Ours::sync(&device).unwrap();
        let client = Ours::client(&device);
        client.streams().drain_all();
        client.sync().unwrap();
        let stats = client.stats();
        assert!(
            stats.is_quiescent(),
            "{name}: the engine still holds {stats:?}"
        );
    }
}

/// burn issue 4328: a tensor cloned into threads that drop their clones at once, without any
/// operation, while the main thread consumes the tensor without waiting for them.
fn clones_dropped_on_threads_without_ops() {
    {
        let device = Default::default();
        for round in 0..200 {
            let tensor =
                Tensor::<Ours, 2>::from_data([[0.0, -1.0, 2.0], [3.0, 4.0, -5.0]], &device);
            let threads: Vec<_> = (0..3)
                .map(|_| {
                    let moved = tensor.clone();
                    std::thread::spawn(move || {
                        let base = moved.clone();
                        drop((moved, base));
                    })
                })
                .collect();
            let doubled = (tensor * 2.0).into_data();
            assert_eq!(
                doubled.to_vec::<f32>().unwrap(),
                vec![0.0, -2.0, 4.0, 6.0, 8.0, -10.0]
            );
            for t in threads {
                t.join()
                    .unwrap_or_else(|_| panic!("round {round}: a thread panicked"));
            }
        }
    }
}

/// burn issue 4947: a tensor behind `Arc<RwLock<_>>` replaced 10,000 times by a writer while 8
/// readers clone it and compute with their clones.
fn a_tensor_behind_a_lock_replaced_while_readers_clone_it() {
    {
        let device = Default::default();
        let shared = Arc::new(RwLock::new(Tensor::<Ours, 1>::from_data(
            [0.0f32; 16],
            &device,
        )));
        let start = Arc::new(Barrier::new(9));
        let readers: Vec<_> = (0..8)
            .map(|_| {
                let (shared, start) = (shared.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    let mut last = 0.0f32;
                    for _ in 0..500 {
                        let t = shared.read().unwrap().clone();
                        let v = (t + 1.0).sum().into_scalar();
                        // Every element of a version holds the same value, and versions only
                        // grow: the sum (16 * (value + 1)) never goes back.
                        assert!(v >= last, "went back from {last} to {v}");
                        last = v;
                    }
                })
            })
            .collect();
        start.wait();
        for i in 1..=10_000 {
            let next = shared.read().unwrap().clone().add_scalar(1.0);
            *shared.write().unwrap() = next;
            if i % 1000 == 0 {
                let v = shared.read().unwrap().clone().into_data();
                assert_eq!(v.to_vec::<f32>().unwrap(), vec![i as f32; 16]);
            }
        }
        for r in readers {
            r.join().unwrap();
        }
    }
}

/// A backend panic on another thread reaches the reader as an error, and the thread that
/// registered the op keeps working. The panicking op is one the backend refuses at run time:
/// integer division by zero on NdArray; on CubeBackend (where integer division by zero does not
/// panic) flipping a quantized tensor, which burn-cubecl 0.21 leaves unimplemented.
fn a_backend_panic_becomes_an_error_on_the_data() {
    let device = Default::default();
    #[cfg(not(feature = "cuda"))]
    let (failed, op) = {
        use burn_tensor::Int;
        let a = Tensor::<Ours, 1, Int>::from_data([4, 2], &device);
        let zero = Tensor::<Ours, 1, Int>::from_data([0, 0], &device);
        let failed = std::thread::spawn(move || a.clone() / zero).join().unwrap();
        (failed.float(), "int_div")
    };
    #[cfg(feature = "cuda")]
    let (failed, op) = {
        let scheme = Ours::default_quant_scheme(&device);
        // Four values: the default scheme packs four 8-bit values into a u32.
        let values = [4.0, 2.0, 1.0, -3.0];
        let q = Tensor::<Ours, 1>::from_data(values, &device).quantize_dynamic(&scheme);
        let failed = std::thread::spawn(move || q.flip([0])).join().unwrap();
        (failed, "q_flip")
    };
    let downstream = failed.clone() + 1.0;
    let error = downstream.try_into_data().unwrap_err().to_string();
    assert!(error.contains(op), "{error}");
    let ok = Tensor::<Ours, 1>::from_data([1.0, 2.0], &device) * 2.0;
    assert_eq!(ok.into_data().to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
    drop(failed);
}

/// Tensors moved through a worker pool and dropped there: every worker's result is right, and
/// the lazily recorded work of each thread runs on its own stream.
fn tensors_moved_between_threads_and_dropped_there() {
    let device = Default::default();
    let x = Tensor::<Ours, 2>::random([8, 8], Distribution::Uniform(-1.0, 1.0), &device);
    let expected = x.clone().into_data();
    let workers: Vec<_> = (0..4)
        .map(|i| {
            let x = x.clone();
            std::thread::spawn(move || {
                let y = x.clone().matmul(x.clone().transpose()) * (i as f32);
                drop(x);
                y
            })
        })
        .collect();
    let host_x = expected.to_vec::<f32>().unwrap();
    let plain_x = Tensor::<Plain, 2>::from_data(expected, &Default::default());
    for (i, worker) in workers.into_iter().enumerate() {
        let y = worker.join().unwrap().into_data();
        if cfg!(feature = "cuda") {
            // On CUDA each side's matmul is autotuned (ours fused with the scale, under another
            // key), and a kernel may feed f32 inputs to TF32 tensor cores: on a loaded H200
            // ours and plain `CubeBackend` differed by up to 3e-4 relative, TF32's size
            // (`docs/logs/2026-12-04-final-backend-threads.log`). So each entry is checked
            // against an f64 reference, within TF32's error for its dot product: TF32 keeps 10
            // of f32's 23 mantissa bits, so an input truncated to it errs by under 2^-10 and a
            // product by under 2^-9; the bound is 2^-8 of the sum of the products' magnitudes,
            // far tighter than a stale or reused buffer could meet.
            assert_within_tf32_of_reference(&y.to_vec::<f32>().unwrap(), &host_x, 8, i as f64);
        } else {
            // On NdArray the same kernels run: bit for bit.
            let want = plain_x.clone().matmul(plain_x.clone().transpose()) * (i as f32);
            assert_eq!(y, want.into_data());
        }
    }
}

/// `got` (n × n) is `scale · x·xᵀ` within TF32's error (2^-8 of each entry's sum of product
/// magnitudes), entry by entry.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn assert_within_tf32_of_reference(got: &[f32], x: &[f32], n: usize, scale: f64) {
    assert_eq!(got.len(), n * n);
    for r in 0..n {
        for c in 0..n {
            let (mut dot, mut magnitude) = (0f64, 0f64);
            for k in 0..n {
                let product = f64::from(x[r * n + k]) * f64::from(x[c * n + k]);
                dot += product;
                magnitude += product.abs();
            }
            let (want, bound) = (scale * dot, scale * magnitude / 256.0 + 1e-6);
            let entry = f64::from(got[r * n + c]);
            assert!(
                (entry - want).abs() <= bound,
                "entry ({r}, {c}) of {scale}·x·xᵀ: {entry}, want {want} within {bound}"
            );
        }
    }
}
