//! Hand a model's outputs to the host without blocking the thread that computes them.
//!
//! `cargo run --release --example publish_download` (NdArray), or with `--features cuda` on a
//! machine with an NVIDIA GPU (burn's CubeCL backend).
//!
//! A worker thread runs a small model's forward pass batch after batch, on
//! `StreamFusion<B>`. Each output is published from the worker's held session and copied into a
//! pinned buffer while the next batch computes; when the next output is published, the
//! previous copy is waited for and its buffer reused. The worker sends each batch's data to the
//! main thread, which checks it against the same forward pass read with burn's `into_data`.

use std::sync::mpsc;
use std::thread;
use std::time::Instant;

use burn_backend::Backend;
use burn_tensor::{Distribution, Tensor, TensorData, Tolerance};
use fusion_streams::backend::{Download, IrBackend, StreamFusion};

const BATCHES: usize = 6;
const BATCH: usize = 256;
const FEATURES: usize = 512;
const CLASSES: usize = 64;

/// A two-layer perceptron's weights.
struct Model<B: Backend> {
    hidden: Tensor<B, 2>,
    out: Tensor<B, 2>,
}

impl<B: Backend> Model<B> {
    fn new(device: &B::Device) -> Self {
        let init = Distribution::Uniform(-0.05, 0.05);
        Self {
            hidden: Tensor::random([FEATURES, FEATURES], init, device),
            out: Tensor::random([FEATURES, CLASSES], init, device),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = x.matmul(self.hidden.clone()).clamp_min(0.0);
        burn_tensor::activation::softmax(h.matmul(self.out.clone()), 1)
    }
}

fn batch<B: Backend>(i: usize, device: &B::Device) -> Tensor<B, 2> {
    Tensor::<B, 1, burn_tensor::Int>::arange(0..(BATCH * FEATURES) as i64, device)
        .reshape([BATCH, FEATURES])
        .float()
        .mul_scalar(1.0 / (BATCH * FEATURES) as f64)
        .add_scalar(i as f64)
        .sin()
}

fn run<P: IrBackend>(device: P::Device) {
    type B<P> = StreamFusion<P>;
    let started = Instant::now();
    println!("publish_download on {}", B::<P>::name(&device));
    let model = Model::<B<P>>::new(&device);
    let (to_main, outputs) = mpsc::channel::<TensorData>();

    // The worker: forward passes, each output published and copied while the next computes.
    let worker = {
        let (hidden, out, device) = (model.hidden.clone(), model.out.clone(), device.clone());
        thread::spawn(move || {
            let model = Model::<B<P>> { hidden, out };
            let mut session = B::<P>::session(&device).expect("a session on this thread");
            let mut free = None;
            let mut pending: Option<Download<P>> = None;
            for i in 0..BATCHES {
                let y = model.forward(batch(i, &device));
                // SAFETY: `y` was computed on this thread, whose stream the session holds.
                let mut publication = unsafe { session.publish(y) }.expect("publish");
                let ready = publication.frontier_ready().expect("frontier");
                if let Some(download) = pending.take() {
                    let (data, buffer) = download.wait_data().expect("the previous copy");
                    to_main.send(data).unwrap();
                    free = Some(buffer);
                }
                let buffer = match free.take() {
                    Some(buffer) => buffer,
                    None => {
                        println!("worker: one pinned buffer of {} bytes", publication.bytes());
                        B::<P>::pinned_buffer(&device, publication.bytes()).expect("pinned")
                    }
                };
                println!("worker: batch {i} published (computed already: {ready}), copying");
                pending = Some(publication.download_into(buffer).expect("download"));
            }
            let (data, _) = pending.unwrap().wait_data().expect("the last copy");
            to_main.send(data).unwrap();
        })
    };

    for (i, data) in outputs.iter().enumerate() {
        let expected = model.forward(batch(i, &device)).into_data();
        data.assert_approx_eq::<f32>(&expected, Tolerance::default());
        println!(
            "main: batch {i} arrived, {:?} {:?}, equal to into_data",
            data.shape, data.dtype
        );
    }
    worker.join().unwrap();
    println!("done ({:.1?})", started.elapsed());
}

fn main() {
    #[cfg(feature = "cuda")]
    {
        type Cube = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
        if <Cube as Backend>::device_count(0) > 0 {
            return run::<Cube>(Default::default());
        }
        println!("(built with `cuda`, but no CUDA device answered: using NdArray)");
    }
    run::<burn_ndarray::NdArray<f32>>(Default::default());
}
