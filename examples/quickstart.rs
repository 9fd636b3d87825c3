//! Several threads share tensors of one lazy engine.
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
//! * one worker runs an operation that fails: the error reaches the read that needs it;
//! * results are dropped on threads that are not their home (foreign drops), and everything is
//!   checked against plain Rust arithmetic.

use std::sync::Barrier;
use std::sync::mpsc::channel;
use std::time::Instant;

use burn_backend::TensorData;
use fusion_streams::host::{HostDevice, HostRuntime};
use fusion_streams::runtime::StreamRuntime;
use fusion_streams::{Error, FusionClient, FusionTensor, Result};

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

/// The CUDA runtime when the crate is built with `--features cuda` and a GPU answers; the
/// embedded host runtime otherwise.
fn main() -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        use fusion_streams::cuda::{CudaDevice, CudaRuntime};
        if CudaRuntime::is_available() {
            let client = FusionClient::<CudaRuntime>::new(CudaDevice::new(0))?;
            return run(client, |_| None);
        }
        println!("(built with `cuda`, but no CUDA device answered: using the host runtime)");
    }
    let client = FusionClient::<HostRuntime>::new(HostDevice::default())?;
    run(client, |client| {
        let d = client.context().stats();
        assert_eq!(d.live_buffers(), 0, "a device buffer leaked");
        Some(format!(
            "kernels {}   buffers allocated {}   freed {}   reused in place {}   live {}",
            d.kernels_dispatched,
            d.buffers_allocated,
            d.buffers_freed,
            d.in_place_reuses,
            d.live_buffers()
        ))
    })
}

fn run<R: StreamRuntime>(
    client: FusionClient<R>,
    device_report: impl Fn(&FusionClient<R>) -> Option<String>,
) -> Result<()> {
    type Tensor<R> = FusionTensor<R>;
    let started = Instant::now();
    println!(
        "fusion-streams quickstart: {WORKERS} worker threads on the {} runtime\n",
        R::name()
    );

    let w = client.from_data(TensorData::new(matrix(0), [N, N]))?;
    let w_half = w.scale(0.5)?; // queued on main's stream, not run
    println!(
        "main      {}: uploaded w (materialised), queued w_half = w * 0.5 (pending)",
        w.stream()
    );

    // Worker 0 → worker 1 → worker 2: a chain of shares.
    let (to_next, mut from_prev): (Vec<_>, Vec<_>) =
        (0..=WORKERS).map(|_| channel::<Tensor<R>>()).unzip();
    // Nobody exits before every share happened (an exiting thread drains its stream, which would
    // make a share find its source already materialised).
    let all_shared = Barrier::new(WORKERS);
    let mut results = Vec::new();
    std::thread::scope(|scope| -> Result<()> {
        let mut handles = Vec::new();
        for worker in 0..WORKERS {
            let (w, w_half, client, all_shared) = (&w, &w_half, client.clone(), &all_shared);
            let send = to_next[worker + 1].clone();
            let receive = std::mem::replace(&mut from_prev[worker], channel().1);
            handles.push(scope.spawn(move || -> Result<Tensor<R>> {
                let me = burn_backend::StreamId::current();
                // Clones on this thread are shared views: fresh ids on this stream, same buffers.
                let w = w.clone();
                let w_half = w_half.clone();
                let x = client.from_data(TensorData::new(matrix(worker + 1), [N, N]))?;
                let mut out = x.matmul(&w)?.add(&w_half)?.scale(0.25)?; // queued here
                let mut note = String::new();
                if worker == 0 {
                    send.send(out.clone()).expect("worker 1");
                } else {
                    let received = receive.recv().expect("previous worker");
                    let view = received.clone(); // a share of a tensor homed elsewhere
                    drop(received); // a foreign drop
                    out = out.add(&view)?;
                    note = if worker == 1 {
                        "; cloned worker 0's pending result (peer)".into()
                    } else {
                        "; cloned worker 1's view of it (grandpeer)".into()
                    };
                    if worker + 1 < WORKERS {
                        send.send(view).expect("next worker");
                    }
                }
                println!("worker {worker}  {me}: cloned w, w_half; queued matmul/add/scale{note}");
                all_shared.wait();
                Ok(out)
            }));
        }
        drop(to_next);
        for h in handles {
            results.push(h.join().expect("worker panicked")?);
        }
        Ok(())
    })?;

    // An operation that fails: the error travels to the read that needs it.
    let failing = client
        .op("normalise")
        .read(&results[0])
        .output([N, N], burn_backend::DType::F32)
        .execute(
            |_: &burn_ir::CustomOpIr, _: &mut burn_ir::HandleContainer<_>| {
                Err(Error::operation("normalise", "division by a zero norm"))
            },
        )
        .map_err(|r| r.error)?
        .remove(0);
    let downstream = failing.scale(2.0)?.exp()?;

    // Check every result against plain arithmetic, reading from main (results live on the
    // workers' streams: reads run there, no view is made).
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
        let got = result.to_vec::<f32>()?;
        assert_eq!(got, want, "worker {worker}");
        println!("checked   worker {worker}'s result: {:?} ... OK", &got[..4]);
    }
    match downstream.read() {
        // Propagated through the two skipped ops, with the failing op's own error at its root.
        Err(error)
            if error.is_propagated()
                && error.root() == &Error::operation("normalise", "division by a zero norm") =>
        {
            println!("checked   read two ops after the failing op: {error}")
        }
        other => panic!("the failure did not propagate as expected: {other:?}"),
    }

    // Drop everything from main: the workers' results are foreign drops into their streams.
    drop((results, failing, downstream, w, w_half));
    client.sync()?;
    client.streams().drain_all();
    client.sync()?;

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
    if let Some(device) = device_report(&client) {
        println!("  device       {device}");
    }
    println!(
        "  at the end   live handles {}   error records {}   shared_sources {}",
        s.live_handles, s.error_records, s.shared_sources
    );
    assert!(s.is_quiescent(), "something leaked");
    println!(
        "\nall results checked, nothing leaked ({:.1?})",
        started.elapsed()
    );
    Ok(())
}
