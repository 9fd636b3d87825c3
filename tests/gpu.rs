//! The engine on an NVIDIA GPU (feature `cuda`). Every test needs a GPU and is ignored by
//! default; `scripts/gpu-tests.sh` builds this binary for a GPU machine and says how to run it.
#![cfg(feature = "cuda")]

mod common;
mod suite;

use std::time::Instant;

use common::Peer;
use fusion_streams::runtime::cuda::{CudaDevice, CudaRuntime};
use fusion_streams::{EngineConfig, FusionClient};
use suite::{matrix, settle, values};

const GPU: &str = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine";

fn client() -> FusionClient<CudaRuntime> {
    FusionClient::with_config(
        CudaDevice::new(0),
        EngineConfig::default().with_max_queue_len(1024),
    )
    .expect("CUDA device 0")
}

macro_rules! on_gpu {
    ($($name:ident($arg:expr);)*) => {$(
        #[test]
        #[ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"]
        fn $name() {
            suite::$name($arg);
        }
    )*};
}

on_gpu! {
    builtins_match_reference(&client());
    pending_share_drains_then_aliases(&client());
    materialised_share_does_not_drain(&client());
    chained_share_drains_once(&client());
    every_drop_order_frees_each_id_once(client);
    foreign_drop_under_a_pending_reader_is_deferred(&client());
    errors_travel_across_threads(&client());
    in_place_is_refused_while_an_alias_lives(&client());
    nothing_leaks_after_cross_thread_work(&client());
}

/// Small integers, so every product and sum below is exact in f32.
fn ints(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + seed) % 7) as f32 - 3.0).collect()
}

fn matmul_at(a: &[f32], b: &[f32], n: usize, i: usize, j: usize) -> f32 {
    (0..n).map(|p| a[i * n + p] * b[p * n + j]).sum()
}

/// A long producer on stream A, shared to thread B and consumed there at once, with no host
/// synchronisation in between: the consumer must see the producer's result.
#[test]
#[ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"]
fn long_producer_shared_across_streams_without_host_sync() {
    let _ = GPU;
    let c = client();
    let n = 2048;
    let (a, b) = (ints(n * n, 1), ints(n * n, 4));
    let (ta, tb) = (matrix(&c, a.clone(), n, n), matrix(&c, b.clone(), n, n));
    let started = Instant::now();
    let product = ta.matmul(&tb).unwrap();
    c.drain(); // dispatched on A; nothing waits for it
    let dispatched = started.elapsed();
    let peer = Peer::spawn();
    let p2 = product.clone();
    let (consumer_queued, got) = peer.run(move || {
        let t = Instant::now();
        let view = p2.clone(); // materialised handle: no drain, no host sync
        let doubled = view.scale(2.0).unwrap();
        doubled.client().drain(); // dispatched on B right away
        let queued = t.elapsed();
        (queued, values(&doubled))
    });
    println!(
        "producer dispatched in {dispatched:?}, consumer queued {consumer_queued:?} after, total {:?}",
        started.elapsed()
    );
    for (i, j) in [(0, 0), (1, 2047), (1024, 7), (2047, 2047)] {
        assert_eq!(
            got[i * n + j],
            2.0 * matmul_at(&a, &b, n, i, j),
            "({i}, {j})"
        );
    }
}

/// A buffer read by an in-flight kernel on stream B must not be reused while that kernel runs,
/// even after every engine id naming it is gone. Stream A frees its id and then allocates
/// same-sized buffers full of 7s: if A reused the buffer under B's reader, B's result would be
/// corrupt.
#[test]
#[ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"]
fn a_buffer_read_on_another_stream_is_not_reused_under_the_reader() {
    let c = client();
    let n = 2048;
    let (a, b) = (ints(n * n, 2), ints(n * n, 5));
    let x = matrix(&c, a.clone(), n, n);
    let peer = Peer::spawn();
    let (x2, c2, b2) = (x.clone(), c.clone(), b.clone());
    let result = peer.run(move || {
        let view = x2.clone();
        drop(x2);
        let w = matrix(&c2, b2, n, n);
        let r = view.matmul(&w).unwrap(); // long kernel on B reading X's buffer
        c2.drain();
        drop((view, w)); // B's id for the buffer goes while the kernel runs
        c2.drain();
        r
    });
    drop(x); // A's id goes too
    c.drain();
    let junk: Vec<_> = (0..16)
        .map(|_| {
            let t = c.fill([n, n], 7.0, burn_backend::DType::F32).unwrap();
            c.drain();
            t
        })
        .collect();
    let got = peer.run(move || values(&result));
    for (i, j) in [(0, 0), (3, 2040), (1500, 1500), (2047, 0)] {
        assert_eq!(got[i * n + j], matmul_at(&a, &b, n, i, j), "({i}, {j})");
    }
    assert!(values(&junk[0]).iter().all(|v| *v == 7.0));
    drop(junk);
    settle(&c);
}
