//! Buffers that cross threads (streams) on one device, as burn users write such programs: a
//! tensor is read only after its producer's last write, and its memory is never reused while a
//! kernel of another stream still reads it.
//!
//! Each program is written once, over a generic burn backend, and counts the elements it got
//! wrong (so a control run on another backend can report how often *it* is wrong):
//!
//! * [`late_write`] — the consumer's stream has already synchronised with the producer's past
//!   the allocation of `x`; the producer then writes `x` in place behind a long kernel, and the
//!   consumer reads it at once (a read that is not ordered after the write sees the old data);
//! * [`reuse_under_reader`] — the consumer queues a kernel reading `x` behind a long matmul of
//!   its own and drops `x` at once; the producer then allocates and fills a tensor of `x`'s size
//!   (memory reused before the consumer's kernel ran corrupts its result);
//! * [`accumulate`] — four producer threads send 250 tensors each, computed in place by a chain
//!   of kernels, through a channel to an accumulator that adds and drops them as they come.
//!
//! On NdArray (CI) the programs run small and must be right. With the `cuda` feature they run on
//! burn's CubeCL backend on the GPU, large, many rounds each, and are ignored unless asked for
//! (scripts/gpu-tests.sh builds them; scripts/gpu-evidence.sh runs them plain and under
//! compute-sanitizer). `cross_stream_programs_on_plain_cubebackend` runs the same programs on
//! plain `CubeBackend` in the same binary and prints how often it is wrong: the control.
//!
//! Each program runs with the engine's kernel fusion on and off: fused, `x * 2 + 1` becomes one
//! kernel that may write a fresh buffer; unfused, each operation writes `x` in place.
//!
//! Sizes and rounds can be set with `FUSION_STREAMS_RACE_ROUNDS`, `FUSION_STREAMS_RACE_SIZE`
//! (the side of the square matrices) and `FUSION_STREAMS_RACE_EACH` (tensors per producer of
//! the accumulator): the sanitizer runs use smaller ones.

mod under_test;

use std::sync::mpsc;
use std::thread;

use burn_backend::{Backend, BackendTypes};
use burn_tensor::{Tensor, TensorData};

use under_test::Ours;
#[cfg(feature = "cuda")]
use under_test::Plain;

/// How large and how often the programs run.
#[derive(Clone, Copy)]
struct Settings {
    /// Rounds per program (after a warm-up round).
    rounds: usize,
    /// The side of the square matrices that keep a stream busy.
    size: usize,
    /// Tensors each producer of [`accumulate`] sends.
    each: usize,
}

fn settings() -> Settings {
    let var = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (rounds, size) = if cfg!(feature = "cuda") {
        (20, 4096)
    } else {
        (3, 64)
    };
    Settings {
        rounds: var("FUSION_STREAMS_RACE_ROUNDS", rounds),
        size: var("FUSION_STREAMS_RACE_SIZE", size),
        each: var("FUSION_STREAMS_RACE_EACH", 250),
    }
}

/// Dispatch what the calling thread has recorded, without waiting for it (burn has no call for
/// that: a lazy backend runs its queue when it fills, or when something reads).
type Flush<B> = fn(&<B as BackendTypes>::Device);

fn flush_ours(device: &<Ours as BackendTypes>::Device) {
    Ours::client(device).drain();
}

fn eager<B: Backend>(_: &B::Device) {}

fn filled<B: Backend, const D: usize>(
    value: f32,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(vec![value; n], shape), device)
}

fn wrong(values: &[f32], expected: f32) -> usize {
    values.iter().filter(|v| **v != expected).count()
}

/// Hazard 1: a read ordered after the buffer's allocation but not after its last write.
///
/// The producer uploads `x` and then a small `marker`; the consumer uses `marker`, so its stream
/// synchronises with the producer's past `x`'s allocation. The producer then keeps its stream
/// busy with a matmul and writes `x` in place behind it (`x * 2 + 1`: 3 everywhere), and the
/// consumer reads `x` at once. Returns the number of elements not equal to 3.
fn late_write<B: Backend>(device: &B::Device, settings: Settings, flush: Flush<B>) -> usize {
    let size = settings.size;
    let (to_consumer, from_producer) = mpsc::channel::<Tensor<B, 1>>();
    let (ack, acked) = mpsc::channel::<()>();
    let dev = device.clone();
    let producer = thread::spawn(move || {
        let x = filled::<B, 1>(1.0, [size * size / 4], &dev);
        let marker = filled::<B, 1>(0.0, [4], &dev);
        to_consumer.send(marker).unwrap();
        acked.recv().unwrap();
        let a = filled::<B, 2>(1.0, [size, size], &dev);
        let busy = a.clone().matmul(a);
        let x = x * 2.0 + 1.0;
        flush(&dev);
        to_consumer.send(x).unwrap();
        busy
    });
    let marker = from_producer.recv().unwrap();
    let used = (marker + 1.0).into_data().to_vec::<f32>().unwrap();
    assert_eq!(used, vec![1.0; 4]);
    ack.send(()).unwrap();
    let x = from_producer.recv().unwrap();
    let values = x.into_data().to_vec::<f32>().unwrap();
    let busy = producer.join().unwrap();
    // The matmul's result is checked too: it is a product of ones.
    let busy = busy
        .slice([0..1, 0..8])
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    wrong(&values, 3.0) + wrong(&busy, size as f32)
}

/// Hazard 2: memory reused by its home stream while another stream's kernel still reads it.
///
/// The consumer keeps its own stream busy with a matmul, then dispatches a kernel reading the
/// producer's `x` (ones) behind it, `x * 3`, and drops `x` at once. The producer then fills a
/// new tensor of `x`'s size with 7s: if `x`'s memory went back to the producer's pool before
/// the consumer's kernel ran, the fill lands in it first, and the product is 21, not 3. Returns
/// the number of elements not equal to 3.
fn reuse_under_reader<B: Backend>(
    device: &B::Device,
    settings: Settings,
    flush: Flush<B>,
) -> usize {
    let size = settings.size;
    let (to_consumer, from_producer) = mpsc::channel::<Tensor<B, 2>>();
    let (ack, acked) = mpsc::channel::<()>();
    let dev = device.clone();
    let producer = thread::spawn(move || {
        let x = filled::<B, 2>(1.0, [size, size], &dev);
        flush(&dev);
        to_consumer.send(x).unwrap();
        acked.recv().unwrap();
        let refill = Tensor::<B, 2>::full([size, size], 7.0, &dev);
        flush(&dev);
        refill
    });
    let a = filled::<B, 2>(1.0, [size, size], device);
    let busy = a.clone().matmul(a);
    let x = from_producer.recv().unwrap();
    let tripled = x.clone() * 3.0;
    drop(x);
    flush(device);
    ack.send(()).unwrap();
    let refill = producer.join().unwrap();
    let values = tripled.into_data().to_vec::<f32>().unwrap();
    let refill = refill
        .slice([0..1, 0..8])
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let busy = busy
        .slice([0..1, 0..8])
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    wrong(&values, 3.0) + wrong(&refill, 7.0) + wrong(&busy, size as f32)
}

/// The program of the report that found both hazards: four producers send 250 tensors each,
/// computed by a chain of kernels (`x * 1` repeated, then `* 2 + 1`, each in place), to an
/// accumulator that adds each to its sum as it arrives and drops it. Returns the number of
/// elements of the sum that are wrong.
fn accumulate<B: Backend>(device: &B::Device, settings: Settings, flush: Flush<B>) -> usize {
    const PRODUCERS: usize = 4;
    const CHAIN: usize = 12;
    let (n, each) = (settings.size * 16, settings.each);
    let (to_consumer, from_producers) = mpsc::channel::<Tensor<B, 1>>();
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let (tx, dev) = (to_consumer.clone(), device.clone());
            thread::spawn(move || {
                for i in 0..each {
                    let mut t = filled::<B, 1>((p * 1000 + i) as f32, [n], &dev);
                    for _ in 0..CHAIN {
                        t = t * 1.0;
                    }
                    let t = t * 2.0 + 1.0;
                    flush(&dev);
                    tx.send(t).unwrap();
                }
            })
        })
        .collect();
    drop(to_consumer);
    let mut sum = Tensor::<B, 1>::zeros([n], device);
    for t in from_producers {
        sum = sum + t;
    }
    for p in producers {
        p.join().unwrap();
    }
    // Sum over p and i of 2 * (1000 p + i) + 1, exact in f32.
    let expected: usize = (0..PRODUCERS)
        .flat_map(|p| (0..each).map(move |i| 2 * (p * 1000 + i) + 1))
        .sum();
    wrong(&sum.into_data().to_vec::<f32>().unwrap(), expected as f32)
}

type Program<B> = fn(&<B as BackendTypes>::Device, Settings, Flush<B>) -> usize;

fn programs<B: Backend>() -> [(&'static str, Program<B>); 3] {
    [
        ("late write", late_write::<B>),
        ("reuse under a reader", reuse_under_reader::<B>),
        ("accumulate", accumulate::<B>),
    ]
}

/// Run each program `rounds` times (after one warm-up round, which also autotunes the matmul);
/// for each, how many rounds got something wrong and how many elements were wrong in all.
fn failures<B: Backend>(flush: Flush<B>, settings: Settings) -> Vec<(&'static str, usize, usize)> {
    let device = Default::default();
    programs::<B>()
        .into_iter()
        .map(|(name, program)| {
            let (mut failed, mut elements) = (0, 0);
            for _ in 0..=settings.rounds {
                let wrong = program(&device, settings, flush);
                failed += usize::from(wrong > 0);
                elements += wrong;
            }
            (name, failed, elements)
        })
        .collect()
}

fn report(backend: &str, settings: Settings, results: &[(&str, usize, usize)]) {
    for (name, failed, elements) in results {
        println!(
            "{backend}: {name}: {failed} of {} rounds wrong ({elements} wrong elements; size {}, \
             {} tensors per producer)",
            settings.rounds + 1,
            settings.size,
            settings.each,
        );
    }
}

/// Every program right on our engine, with fusion on and then off; the engine holds nothing
/// afterwards. Every count is printed before anything is asserted.
fn assert_right(settings: Settings, flush: Flush<Ours>, how: &str) {
    let client = Ours::client(&Default::default());
    let mut all = Vec::new();
    for fusion in [true, false] {
        client.streams().set_fusion(fusion);
        let results = failures::<Ours>(flush, settings);
        let label = format!(
            "StreamFusion ({how}, fusion {})",
            if fusion { "on" } else { "off" }
        );
        report(&label, settings, &results);
        all.extend(results.into_iter().map(|r| (label.clone(), r)));
    }
    client.streams().set_fusion(true);
    for (label, (name, failed, elements)) in all {
        assert_eq!(
            (failed, elements),
            (0, 0),
            "{label}: {name}: {failed} rounds wrong, {elements} wrong elements"
        );
    }
    client.streams().drain_all();
    client.sync().unwrap();
    let stats = client.stats();
    assert!(stats.is_quiescent(), "the engine still holds {stats:?}");
}

/// Both ways of dispatching, one after the other (the device's engine is shared by the tests of
/// a binary, and each run ends by checking that it holds nothing): with an explicit drain after
/// each producer step, and with the engine alone deciding when work reaches the device (at its
/// queue bound, a share or a read), as in a burn program.
#[test]
#[cfg_attr(
    feature = "cuda",
    ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"
)]
fn tensors_that_cross_streams_are_read_after_their_writes_and_never_reused_under_a_reader() {
    let settings = settings();
    assert_right(settings, flush_ours, "drained");
    assert_right(settings, eager::<Ours>, "lazy");
}

/// The control: the same programs on plain `CubeBackend` in this binary. Its failures are
/// printed, not asserted (they are cubecl's, and timing decides them); ours must be zero in the
/// same run.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"]
fn cross_stream_programs_on_plain_cubebackend() {
    let settings = settings();
    let plain = failures::<Plain>(eager::<Plain>, settings);
    report("plain CubeBackend", settings, &plain);
    assert_right(settings, flush_ours, "drained");
}
