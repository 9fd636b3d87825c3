//! Several threads share burn tensors on one lazy engine: `StreamFusion<NdArray>`.
//!
//! `cargo run --release --example quickstart`
//!
//! * main uploads weights `w` (materialised) and queues `w_half = w * 0.5` (pending);
//! * three workers each clone both: the first clone of `w_half` drains main's stream, the rest
//!   alias without draining;
//! * each worker queues a small matmul/add/scale chain on its own stream;
//! * worker 0's pending result is cloned by worker 1 (a share that drains worker 0's stream), and
//!   worker 1 forwards that *view* to worker 2, which clones it again: owner → peer → grandpeer,
//!   a chained share that needs no second drain;
//! * an operation fails on the device (an integer division by zero, which NdArray refuses): the
//!   error reaches the read that needs it, two operations later;
//! * results are dropped on threads that did not create them (foreign drops), and everything is
//!   checked against plain Rust arithmetic; then the engine reports what it did.
//!
//! With `--features cuda` and a GPU, the same program runs on `StreamFusion<Cuda>` (burn's
//! CubeCL backend on CUDA; a CUDA kernel does not fail on a zero divisor, so that step is left
//! out there).

use std::sync::Barrier;
use std::sync::mpsc::channel;
use std::time::Instant;

use burn_backend::StreamId;
use burn_tensor::{Int, Tensor, TensorData};
use fusion_streams::backend::{IrBackend, StreamFusion};

const N: usize = 4;
const WORKERS: usize = 3;

fn matrix(seed: usize) -> Vec<f32> {
    (0..N * N)
        .map(|i| ((i * 7 + seed * 3) % 11) as f32 - 5.0)
        .collect()
}

fn matmul(a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut c = vec![0.0; N * N];
    for i in 0..N {
        for k in 0..N {
            for j in 0..N {
                c[i * N + j] += a[i * N + k] * b[k * N + j];
            }
        }
    }
    c
}

/// `StreamFusion<Cuda>` when the crate is built with `--features cuda` and a GPU answers;
/// `StreamFusion<NdArray>` otherwise.
fn main() {
    #[cfg(feature = "cuda")]
    {
        if fusion_streams::cuda::is_available() {
            return run::<fusion_streams::cuda::Cuda>(
                Default::default(),
                "StreamFusion<Cuda>",
                false,
            );
        }
        println!("(built with `cuda`, but no CUDA device answered: using NdArray)");
    }
    run::<burn_ndarray::NdArray<f32>>(Default::default(), "StreamFusion<NdArray>", true);
}

/// The program on `StreamFusion<Inner>`; `zero_divisor_fails`: whether `Inner` refuses an integer
/// division by zero (NdArray does; a CUDA kernel does not).
fn run<Inner: IrBackend>(device: Inner::Device, name: &str, zero_divisor_fails: bool) {
    type B<I> = StreamFusion<I>;
    let started = Instant::now();
    println!("fusion-streams quickstart: {WORKERS} worker threads on {name}\n");

    let tensor = |values: Vec<f32>| {
        Tensor::<B<Inner>, 2>::from_data(TensorData::new(values, [N, N]), &device)
    };
    let w = tensor(matrix(0));
    let w_half = w.clone() * 0.5; // queued on main's stream, not run
    println!(
        "main      {}: uploaded w (materialised), queued w_half = w * 0.5 (pending)",
        StreamId::current()
    );

    // Worker 0 → worker 1 → worker 2: a chain of shares.
    let (to_next, mut from_prev): (Vec<_>, Vec<_>) = (0..=WORKERS)
        .map(|_| channel::<Tensor<B<Inner>, 2>>())
        .unzip();
    // Nobody exits before every share happened (an exiting thread drains its stream, which would
    // make a share find its source already materialised).
    let all_shared = Barrier::new(WORKERS);
    let results: Vec<Tensor<B<Inner>, 2>> = std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for worker in 0..WORKERS {
            let (w, w_half, tensor, all_shared) = (&w, &w_half, &tensor, &all_shared);
            let send = to_next[worker + 1].clone();
            let receive = std::mem::replace(&mut from_prev[worker], channel().1);
            handles.push(scope.spawn(move || {
                // Clones on this thread are shared views: fresh ids on this stream, same buffers.
                let (w, w_half) = (w.clone(), w_half.clone());
                let x = tensor(matrix(worker + 1));
                let mut out = (x.matmul(w) + w_half) * 0.25; // queued here
                let mut note = String::new();
                if worker == 0 {
                    send.send(out.clone()).expect("worker 1");
                } else {
                    let received = receive.recv().expect("previous worker");
                    let view = received.clone(); // a share of a tensor homed elsewhere
                    drop(received); // a foreign drop
                    out = out + view.clone();
                    note = if worker == 1 {
                        "; cloned worker 0's pending result (peer)".into()
                    } else {
                        "; cloned worker 1's view of it (grandpeer)".into()
                    };
                    if worker + 1 < WORKERS {
                        send.send(view).expect("next worker");
                    }
                }
                println!(
                    "worker {worker}  {}: cloned w, w_half; queued matmul/add/scale{note}",
                    StreamId::current()
                );
                all_shared.wait();
                out
            }));
        }
        drop(to_next);
        handles
            .into_iter()
            .map(|h| h.join().expect("worker panicked"))
            .collect()
    });

    // Check every result against plain arithmetic, reading from main (results live on the
    // workers' streams: reads run there).
    let w_plain = matrix(0);
    let own = |worker: usize| -> Vec<f32> {
        matmul(&matrix(worker + 1), &w_plain)
            .iter()
            .zip(&w_plain)
            .map(|(a, b)| (a + b * 0.5) * 0.25)
            .collect()
    };
    for (worker, result) in results.iter().enumerate() {
        let mut want = own(worker);
        if worker > 0 {
            want = want.iter().zip(own(0)).map(|(a, b)| a + b).collect();
        }
        let got = result.clone().into_data().to_vec::<f32>().unwrap();
        assert_eq!(got, want, "worker {worker}");
        println!("checked   worker {worker}'s result: {:?} ... OK", &got[..4]);
    }

    // An operation that fails where it runs: the error travels to the read that needs it.
    if zero_divisor_fails {
        let counts = Tensor::<B<Inner>, 1, Int>::from_data([3, 1, 4], &device);
        let downstream = (counts / 0 + 1) * 2; // queued: nothing has failed yet
        // NdArray panics on the zero divisor when the stream runs the division; the engine
        // catches it. Say so in one line instead of the default hook's report.
        let default_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|info| {
            let why = info.payload_as_str().unwrap_or("a panic");
            println!("(NdArray panicked inside the engine: {why}; the engine caught it)");
        }));
        let read = downstream.try_into_data();
        std::panic::set_hook(default_hook);
        match read {
            Err(error) => {
                let message = error.to_string();
                assert!(message.contains("divide by zero"), "{message}");
                let message = message.replace("\n", " ");
                println!("checked   read two ops after a failing op: {message}");
            }
            Ok(data) => panic!("a division by zero produced {data:?}"),
        }
    }

    // Drop everything from main: the workers' results are foreign drops into their streams.
    drop((results, w, w_half));
    let client = B::<Inner>::client(&device);
    client.sync().expect("sync");
    client.streams().drain_all();
    client.sync().expect("sync");

    let s = client.stats();
    println!("\nwhat the engine did");
    println!(
        "  operations   registered {:>4}   executed {:>4}   failed {}   skipped (error propagated) {}",
        s.ops_registered, s.ops_executed, s.ops_failed, s.ops_skipped
    );
    println!(
        "  drains       {:>4}   (of which for shares: {})",
        s.drains, s.share_drains
    );
    println!(
        "  shares       {:>4}   (materialised source, no drain: {})",
        s.shares, s.share_fast_paths
    );
    println!(
        "  drops        home {:>4}   foreign {:>4}   deferred behind pending work {}",
        s.home_drops, s.foreign_drops, s.deferred_frees
    );
    println!("  frees        {:>4}", s.frees);
    println!(
        "  at the end   live handles {}   error records {}   shared_sources {}",
        s.live_handles, s.error_records, s.shared_sources
    );
    assert!(s.is_quiescent(), "something leaked");
    println!(
        "\nall results checked, nothing leaked ({:.1?})",
        started.elapsed()
    );
}
