//! What only a GPU shows, on the one CUDA path: the engine under `StreamFusion<Cuda>`
//! (`FusionClient<BackendRuntime<CubeBackend<CudaRuntime, ..>>>`, feature `cuda`). Long
//! producers read on another stream without a host wait, a buffer read on one stream while its
//! last id goes on another, a drain from another thread on the source's cubecl stream, real
//! device faults (memory exhausted, a kernel that traps), and the transfer paths' device side.
//! The runtime-generic suite runs on the same client in `tests/suite_backend.rs`, and
//! publication as burn code in `tests/publish.rs`.
//!
//! Every test needs a GPU and is ignored by default: `scripts/gpu-tests.sh` builds this binary
//! for a GPU machine, `scripts/gpu-evidence.sh` runs it.
#![cfg(feature = "cuda")]

mod common;
mod suite;

use std::time::Instant;

use common::Peer;
use fusion_streams::FusionClient;
use fusion_streams::backend::BackendRuntime;
use fusion_streams::cuda::Cuda;
use suite::{matrix, settle, values};

fn client() -> FusionClient<BackendRuntime<Cuda>> {
    FusionClient::with_config(Default::default(), common::lazy_config()).expect("CUDA device 0")
}

/// Run test `name` of this binary in a child process, and check that it printed `marker`: for
/// scenarios that leave cubecl's server or the device's context unusable for the rest of the
/// process. Returns `true` in the child, where the scenario itself is to run.
fn in_child(name: &str, marker: &str) -> bool {
    if std::env::var_os("FUSION_STREAMS_GPU_CHILD").is_some() {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ])
        .env("FUSION_STREAMS_GPU_CHILD", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let seen: Vec<_> = stdout.lines().filter(|l| l.contains(marker)).collect();
    println!("child: {}", seen.join(" | "));
    assert!(
        out.status.success() && !seen.is_empty(),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    false
}

/// A share from thread B drains stream A: A's queued work must still run on A's cubecl stream
/// (the engine executes it on A's execution stream, `FusionClient::execution_stream`), and B's
/// own work on B's.
#[test]
#[ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"]
fn a_drain_from_another_thread_runs_on_the_source_stream() {
    let c = client();
    let main = c.execution_stream();
    let x = suite::f32s(&c, &[1.0, 2.0]);
    let y = x.scale(2.0).unwrap(); // queued on main
    let peer = Peer::spawn();
    let peer_stream = peer.run({
        let c = c.clone();
        move || c.execution_stream()
    });
    assert_ne!(peer_stream, main);
    let y2 = y.clone();
    let z = peer.run(move || {
        let view = y2.clone(); // drains main from the peer thread
        view.scale(3.0).unwrap()
    });
    assert_eq!(
        // SAFETY: only the handle's allocating stream is inspected.
        unsafe { y.handle() }.unwrap().handle.stream,
        main,
        "y was produced on main's stream"
    );
    let z_stream = peer.run({
        let z = z.clone();
        // SAFETY: as above.
        move || unsafe { z.clone().handle() }.unwrap().handle.stream
    });
    assert_eq!(z_stream, peer_stream, "z was produced on the peer's stream");
    assert_eq!(values(&z), vec![6.0, 12.0]);
}

/// A real device failure (allocating past the GPU's memory) reaches the caller as a typed error
/// from the read of the tensor it was to produce, not as a crash or as silently wrong data.
///
/// cubecl 0.10 panics on its own server thread when an allocation fails, and its server may stay
/// unhealthy afterwards: the scenario runs in a child process.
#[test]
#[ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"]
fn device_out_of_memory_is_a_typed_error() {
    if !in_child("device_out_of_memory_is_a_typed_error", "typed error") {
        return;
    }
    let c = client();
    let n = 1usize << 30; // 4 GiB of f32 per tensor; 40 of them exceed an H200's 141 GiB
    let held: Vec<_> = (0..40)
        .map(|_| {
            let t = c.fill([n], 1.0, burn_backend::DType::F32).unwrap();
            c.drain();
            t
        })
        .collect();
    let error = held.last().unwrap().read().unwrap_err();
    println!("typed error: the read of the 40th 4 GiB tensor returned {error}");
    assert!(matches!(
        error,
        fusion_streams::Error::KernelFailed { .. }
            | fusion_streams::Error::OperationPanicked { .. }
    ));
    // cubecl's server is gone: skip the teardown that would wait on it.
    std::process::exit(0);
}

/// Small integers, so every product and sum below is exact in f32.
fn ints(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + seed) % 7) as f32 - 3.0).collect()
}

/// Two `n`×`n` integer-valued matrices from `seeds`: their values, and the tensors uploaded.
fn square_operands(
    c: &FusionClient<BackendRuntime<Cuda>>,
    n: usize,
    seeds: [usize; 2],
) -> (
    [Vec<f32>; 2],
    [fusion_streams::FusionTensor<BackendRuntime<Cuda>>; 2],
) {
    let host = seeds.map(|seed| ints(n * n, seed));
    let tensors = [0, 1].map(|k| matrix(c, host[k].clone(), n, n));
    (host, tensors)
}

fn matmul_at(a: &[f32], b: &[f32], n: usize, i: usize, j: usize) -> f32 {
    (0..n).map(|p| a[i * n + p] * b[p * n + j]).sum()
}

/// A long producer on stream A, shared to thread B and consumed there at once, with no host
/// synchronisation in between: the consumer must see the producer's result.
#[test]
#[ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"]
fn long_producer_shared_across_streams_without_host_sync() {
    let c = client();
    let n = 2048;
    let ([a, b], [ta, tb]) = square_operands(&c, n, [1, 4]);
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

mod transfer {
    //! The device side of publication: page-locked allocation failures, frontiers of long
    //! producers, both copy routes, retention of in-flight copies, and a device fault after
    //! `publish`. What holds on every runtime is in `suite/publication.rs`, run on CUDA by
    //! `suite_backend.rs`.
    use fusion_streams::backend::{BackendContext, Download, Publication, Session};
    use fusion_streams::runtime::TransferRuntime;
    use fusion_streams::transfer::{HeldSession, PinnedHostBuffer, PublicationAdmissionError};

    use super::{Cuda, client, in_child, matmul_at, square_operands};
    use crate::common::buffer_f32s;

    type Runtime = fusion_streams::backend::BackendRuntime<Cuda>;
    type Tensor = fusion_streams::FusionTensor<Runtime>;

    /// The side of the matrices whose product is the long producer of these tests.
    const LARGE: usize = 4096;

    /// A session on a fresh client, and two `LARGE`² matrices from `seeds` to multiply.
    fn large_operands(
        seeds: [usize; 2],
    ) -> (
        fusion_streams::FusionClient<Runtime>,
        HeldSession<Runtime>,
        [Vec<f32>; 2],
        [Tensor; 2],
    ) {
        let c = client();
        let session = HeldSession::open(&c).unwrap();
        let (values, tensors) = square_operands(&c, LARGE, seeds);
        (c, session, values, tensors)
    }

    fn publish(session: &mut Session<Cuda>, value: Tensor) -> Publication<Cuda> {
        // SAFETY: values are produced by the engine's operations, which order them before the
        // session's stream.
        unsafe { session.publish(value) }.expect("admitted")
    }

    fn pinned(ctx: &BackendContext<Cuda>, len: usize) -> PinnedHostBuffer {
        Runtime::alloc_pinned(ctx, len).unwrap()
    }

    fn download(p: Publication<Cuda>, buffer: PinnedHostBuffer) -> Download<Cuda> {
        p.download_into(buffer).expect("enqueued")
    }

    /// A pinned allocation the host cannot back is a typed out-of-memory error from the driver
    /// call, not a kernel failure; and allocation keeps working after it.
    #[test]
    #[ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"]
    fn pinned_allocation_failure_is_out_of_memory() {
        let c = client();
        let huge = 1usize << 46; // 64 TiB of page-locked memory: no host has it
        let error = Runtime::alloc_pinned(c.context(), huge).unwrap_err();
        println!("alloc_pinned(64 TiB) returned: {error}");
        // Out of memory when the driver says so; any other refusal is a runtime error naming
        // the call. Never a kernel failure.
        assert!(
            match &error {
                fusion_streams::Error::OutOfMemory { bytes, .. } => *bytes >= huge,
                fusion_streams::Error::Runtime(message) => message.contains("cuMemHostAlloc"),
                _ => false,
            },
            "{error:?}"
        );
        let buffer = pinned(c.context(), 16);
        assert_eq!(buffer.len(), 16);
        assert!(buffer.is_page_locked(), "cuMemHostAlloc memory");
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"]
    fn frontier_is_not_ready_right_after_a_large_producer() {
        let (c, mut session, [a, b], [ta, tb]) = large_operands([3, 6]);
        let n = LARGE;
        // Warm the fused matmul + scale up (its autotune runs once), so that the producer
        // `publish` drains is the kernel alone.
        let _ = ta.matmul(&tb).unwrap().scale(1.0).unwrap().read().unwrap();
        let product = ta.matmul(&tb).unwrap().scale(1.0).unwrap();
        let started = std::time::Instant::now();
        let mut p = publish(&mut session, product);
        let publish_took = started.elapsed();
        let started = std::time::Instant::now();
        let ready_now = p.frontier_ready().unwrap();
        let poll_took = started.elapsed();
        println!("publish {publish_took:?}, frontier_ready {poll_took:?} -> {ready_now}");
        assert!(
            !ready_now,
            "frontier ready right after a 4096² matmul was queued"
        );
        p.await_frontier().unwrap();
        assert!(p.frontier_ready().unwrap());
        let got = buffer_f32s(&download(p, pinned(c.context(), n * n * 4)).wait().unwrap());
        for (i, j) in [(0, 0), (9, 4095), (4095, 4095)] {
            assert_eq!(got[i * n + j], matmul_at(&a, &b, n, i, j), "({i}, {j})");
        }
    }

    /// A publication dropped while its producer (a 4096² matmul) still runs is retired without
    /// waiting, and `synchronize` releases it. (`mem::forget` and the runtime's retention are in
    /// the suite's publication part, run on CUDA by `suite_backend.rs`.)
    #[test]
    #[ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"]
    fn a_publication_dropped_in_flight_is_retired() {
        let (c, mut session, _, [ta, tb]) = large_operands([1, 2]);
        let _ = ta.matmul(&tb).unwrap().read().unwrap(); // autotune once
        let before = c.context().retirement().stats();
        drop(publish(&mut session, ta.matmul(&tb).unwrap())); // frontier in flight: retired
        assert_eq!(c.context().retirement().stats().pending, before.pending + 1);
        session.synchronize().unwrap();
        let s = c.context().retirement().stats();
        assert_eq!(s.pending, 0, "synchronize released it");
        assert_eq!(s.released, before.released + 1);
    }

    /// A kernel that traps on the device (a real fault, which loses the device's context) while
    /// a publication's producer still runs: `await_frontier` fails; the publication is terminal,
    /// `frontier_ready` reports the error, a further await refuses, `download_into` refuses with
    /// both owners back and the buffer untouched, and the dropped record goes to permanent
    /// retention. The lost context stays lost: the scenario runs in a child process.
    #[test]
    #[ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"]
    fn a_device_fault_after_publish_makes_the_publication_terminal() {
        const NAME: &str = "transfer::a_device_fault_after_publish_makes_the_publication_terminal";
        if !in_child(NAME, "terminal path observed") {
            return;
        }
        let c = client();
        let mut session = HeldSession::open(&c).unwrap();
        let n = 8192;
        let x = c.fill([n, n], 1.0, burn_backend::DType::F32).unwrap();
        // A producer of a few hundred milliseconds: a chain of 8192² matmuls. Run once to the
        // end first, so that every kernel of it is compiled and autotuned, and known to work:
        // the failure below can only be the trap's.
        let chain = || {
            let mut producer = x.matmul(&x).unwrap();
            for _ in 0..8 {
                producer = producer.scale(1.0 / n as f64).unwrap().matmul(&x).unwrap();
            }
            producer
        };
        let warm = chain().read().unwrap();
        assert_eq!(warm.to_vec::<f32>().unwrap()[0], n as f32);
        let mut p = publish(&mut session, chain());
        assert!(
            !p.frontier_ready().unwrap(),
            "the producer finished before the fault: make it longer"
        );
        fusion_streams::backend::trap_on_device(&Default::default()).unwrap();
        let error = match p.await_frontier() {
            Err(PublicationAdmissionError::Unproven { error }) => error,
            other => panic!("expected a failed frontier, got {other:?}"),
        };
        assert!(p.is_terminal());
        assert_eq!(p.frontier_ready().unwrap_err(), error);
        assert!(matches!(
            p.await_frontier(),
            Err(PublicationAdmissionError::Unproven { .. })
        ));
        let mut buffer = PinnedHostBuffer::new(n * n * 4).unwrap();
        buffer.as_bytes_mut().fill(0xAB);
        let (p, buffer, reason) = p.download_into(buffer).unwrap_err().into_parts();
        assert_eq!(reason, error);
        assert!(p.is_terminal());
        assert!(
            buffer.as_bytes().iter().all(|b| *b == 0xAB),
            "buffer untouched"
        );
        drop(p);
        let s = c.context().retirement().stats();
        assert_eq!((s.permanent, s.pending), (1, 0));
        let message = error.to_string().replace('\n', " ");
        println!("terminal path observed: {message}");
        // The context is lost: skip the teardown that would wait on it.
        std::process::exit(0);
    }

    /// Both copy routes give exact bytes and keep the allocation until their event: a download
    /// asked for while the frontier is pending goes through the stream's waiter; one asked for
    /// after `await_frontier` is enqueued by the caller at once. A direct copy dropped in flight
    /// is retired, and `synchronize` releases it.
    #[test]
    #[ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"]
    fn direct_and_waiter_copies_are_exact_and_retained_until_done() {
        let c = client();
        let mut session = HeldSession::open(&c).unwrap();
        let len = 64 << 20; // 256 MiB: milliseconds to copy
        let data: Vec<f32> = (0..len).map(|i| (i % 1013) as f32).collect();
        let value = c
            .from_data(burn_backend::TensorData::new(data, [len]))
            .unwrap();
        let doubled = value.scale(2.0).unwrap();
        // Waiter route: the frontier is still pending when the download is asked for.
        let waited = download(
            publish(&mut session, doubled.clone()),
            pinned(c.context(), len * 4),
        )
        .wait()
        .unwrap();
        // Direct route: the frontier has been reached.
        let mut p = publish(&mut session, doubled);
        p.await_frontier().unwrap();
        let direct = download(p, pinned(c.context(), len * 4)).wait().unwrap();
        for (name, buffer) in [("waiter", &waited), ("direct", &direct)] {
            let got = buffer_f32s(buffer);
            for i in [0, 1012, 1013, len / 2 + 7, len - 1] {
                assert_eq!(got[i], 2.0 * (i % 1013) as f32, "{name} route, element {i}");
            }
        }
        // A direct copy dropped in flight: retired until its event, then released.
        let before = c.context().retirement().stats();
        let mut p = publish(&mut session, value);
        p.await_frontier().unwrap();
        drop(download(p, direct));
        let after = c.context().retirement().stats();
        assert_eq!(after.pending, before.pending + 1, "retired while copying");
        session.synchronize().unwrap();
        let settled = c.context().retirement().stats();
        assert_eq!(settled.pending, 0);
        assert!(settled.released > before.released);
    }
}
