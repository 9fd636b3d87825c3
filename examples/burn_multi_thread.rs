//! An ordinary burn program on `StreamFusion`: a small MLP's forward pass and a reduction, with
//! the weights cloned into a worker pool, each worker's activations moved back to the main
//! thread, and tensors dropped on threads that did not create them. Every result is checked
//! against the same program on plain `NdArray`.
//!
//! ```text
//! cargo run --release --example burn_multi_thread                  # StreamFusion<NdArray>
//! CUDARC_CUDA_VERSION=13000 cargo run --release --features cuda --example burn_multi_thread
//!                                                                   # StreamFusion<CubeBackend<Cuda>>
//! ```

use std::sync::mpsc::channel;
use std::time::Instant;

use burn_backend::Backend;
use burn_ndarray::NdArray;
use burn_tensor::activation::{relu, softmax};
use burn_tensor::{Tensor, TensorData, Tolerance};
use fusion_streams::backend::StreamFusion;

#[cfg(not(feature = "cuda"))]
type Inner = NdArray<f32>;
#[cfg(feature = "cuda")]
type Inner = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
type Ours = StreamFusion<Inner>;

const BATCH: usize = 64;
const IN: usize = 32;
const HIDDEN: usize = 64;
const OUT: usize = 8;
const WORKERS: usize = 4;

/// Deterministic host data (no RNG: both backends must see the same inputs).
fn data(rows: usize, cols: usize, seed: usize) -> TensorData {
    let values = (0..rows * cols)
        .map(|i| (((i * 37 + seed * 11) % 23) as f32 - 11.0) / 16.0)
        .collect::<Vec<_>>();
    TensorData::new(values, [rows, cols])
}

struct Mlp<B: Backend> {
    w1: Tensor<B, 2>,
    b1: Tensor<B, 2>,
    w2: Tensor<B, 2>,
    b2: Tensor<B, 2>,
}

impl<B: Backend> Clone for Mlp<B> {
    fn clone(&self) -> Self {
        Self {
            w1: self.w1.clone(),
            b1: self.b1.clone(),
            w2: self.w2.clone(),
            b2: self.b2.clone(),
        }
    }
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            w1: Tensor::from_data(data(IN, HIDDEN, 1), device),
            b1: Tensor::from_data(data(1, HIDDEN, 2), device),
            w2: Tensor::from_data(data(HIDDEN, OUT, 3), device),
            b2: Tensor::from_data(data(1, OUT, 4), device),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = relu(x.matmul(self.w1.clone()) + self.b1.clone());
        softmax(h.matmul(self.w2.clone()) + self.b2.clone(), 1)
    }
}

/// The plain program: the whole batch on one thread.
fn reference() -> (TensorData, TensorData) {
    let device = Default::default();
    let mlp = Mlp::<NdArray<f32>>::new(&device);
    let x = Tensor::<NdArray<f32>, 2>::from_data(data(BATCH, IN, 0), &device);
    let y = mlp.forward(x);
    (y.clone().into_data(), y.mean_dim(0).into_data())
}

fn main() {
    let started = Instant::now();
    let device = Default::default();
    println!("backend: {}", Ours::name(&device));
    let mlp = Mlp::<Ours>::new(&device);
    let x = Tensor::<Ours, 2>::from_data(data(BATCH, IN, 0), &device);
    let rows = BATCH / WORKERS;

    // Each worker gets a clone of the weights and its slice of the batch (recorded lazily here:
    // the worker's first use drains this thread's stream, then reads a shared view), runs the
    // forward pass on its own stream, and sends the activations back; its clones of the weights
    // are dropped there.
    let (tx, rx) = channel();
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let (mlp, tx) = (mlp.clone(), tx.clone());
            let slice = x.clone().slice([w * rows..(w + 1) * rows, 0..IN]);
            std::thread::spawn(move || {
                let y = mlp.forward(slice);
                tx.send((w, y)).unwrap();
                drop(mlp); // foreign drops of the main thread's weights
            })
        })
        .collect();
    drop(tx);
    let mut parts: Vec<_> = rx.iter().collect();
    for worker in workers {
        worker.join().expect("a worker panicked");
    }
    parts.sort_by_key(|(w, _)| *w);
    let y = Tensor::cat(parts.into_iter().map(|(_, y)| y).collect(), 0);

    // The reduction runs here, on tensors produced on four other streams.
    let mean = y.clone().mean_dim(0);
    let (y, mean) = (y.into_data(), mean.into_data());
    drop((mlp, x));

    let (want_y, want_mean) = reference();
    y.assert_approx_eq::<f32>(&want_y, Tolerance::default());
    mean.assert_approx_eq::<f32>(&want_mean, Tolerance::default());
    println!(
        "forward of {BATCH}x{IN} through {IN}->{HIDDEN}->{OUT} on {WORKERS} worker threads: \
         matches plain NdArray"
    );
    println!("class means: {:?}", mean.to_vec::<f32>().unwrap());

    Ours::sync(&device).expect("sync");
    let client = Ours::client(&device);
    client.streams().drain_all();
    client.sync().expect("sync");
    let stats = client.stats();
    println!(
        "engine: {} ops registered, {} shares ({} drained a pending source), {} foreign drops; \
         at the end {} handles, {} pending",
        stats.ops_registered,
        stats.shares,
        stats.share_drains,
        stats.foreign_drops,
        stats.live_handles,
        stats.pending_ops
    );
    assert!(stats.is_quiescent(), "nothing held at the end: {stats:?}");
    println!(
        "all results checked, nothing held ({:.1?})",
        started.elapsed()
    );
}
