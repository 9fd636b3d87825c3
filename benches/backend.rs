//! `StreamFusion<B>` against `B` itself, side by side in one run, through burn's `Tensor` API.
//!
//! `cargo bench --bench backend` prints a timing line per measurement and, at the end, one
//! `ratio <name>: <x>` line per comparison, where `x` is the plain backend's time over ours
//! (1.0 = no overhead, below 1.0 = ours is slower):
//!
//! 1. `chain/<n>`: a chain of 1,000 elementwise ops on a tensor of `n` f32, then a read, on one
//!    thread: the engine's per-op overhead against the op's own cost;
//! 2. `short-chain/<n>`: 100 times a chain of 16 elementwise ops and a read: one fusable chain's
//!    latency;
//! 3. `threads/<T>`: T threads, each running a small MLP forward pass repeatedly on its own
//!    data (its own stream), against the same on plain `B`: how the engine scales with threads;
//! 4. `softmax/<rows>`: 100 times a softmax along the rows of a `[rows, 512]` tensor and a read:
//!    reductions with elementwise work around them (burn's default is five operations; ours
//!    fusing on CUDA is one kernel of this crate's, unfused it is plain's five launches as one
//!    recorded operation);
//! 5. `attention/<seq>`: 100 times one attention step (16 heads, `seq` positions, 64 features:
//!    q·kᵀ, scale, causal mask, softmax, ·v) and a read: two matmuls with a softmax between;
//! 6. `layer-norm/<rows>`: 100 times a layer norm over 1,024 features of `rows` rows (mean and
//!    biased variance, normalise, scale and shift) and a read;
//! 7. `pipeline/<T>`: T producer threads each compute 200 small tensors and send them through a
//!    channel to the main thread, which adds them up as they come and reads the sum: tensors
//!    crossing streams, where the engine orders each consumer after its producer and keeps a
//!    buffer from being reused under a reader (plain `CubeBackend` does neither, and is not
//!    always right on this program: `tests/cross_stream.rs`).
//! 8. `ceiling-threads/<T>`: the MLP's forward rate on our engine at T threads as a fraction of
//!    the *ceiling*: the same MLP forwards on plain `B` from one thread, back to back, with one
//!    sync at the end — every kernel straight through the backend's client, no engine and no
//!    waiting. On CUDA, cubecl 0.10 runs every launch, allocation and read of every thread on
//!    one server thread per device, so no number of threads can launch faster than that; a
//!    fraction near 1.0 at 8 and 16 threads says the engine is not what stops the scaling.
//!    (Ours fuses the bias add and the ReLU into one kernel, so it launches fewer kernels per
//!    forward than the ceiling does: the fraction is of forwards, what the user gets.) Each of
//!    its rounds measures the ceiling and ours side by side; the fraction is the median of the
//!    rounds' fractions. Each line also counts how often our threads slept at the engine's
//!    launch gate and how often one went ahead past it after its 1 ms wait
//!    (`EngineStats::launch_waits`, `launch_overdrafts`).
//!
//! Every measurement alternates ours and plain, `ROUNDS` times (each side first in every other
//! round), and keeps the median.
//! `FUSION_STREAMS_BENCH_ONLY=<prefix>[,<prefix>..]` runs only the measurements whose name
//! starts with one of them.
//! `FUSION_STREAMS_BENCH_QUEUE_LEN=<n>` sets our engine's queue bound (how many operations a
//! stream holds before it dispatches what it can, default 32), and
//! `FUSION_STREAMS_BENCH_DISPATCH_CLOSED_RUNS=0` makes a fusing stream wait for that bound
//! rather than dispatch each run as it closes (`EngineConfig::dispatch_closed_runs`).
//! `FUSION_STREAMS_BENCH_UNTIMED=<n>` sets the untimed rounds before them (default 1; the
//! pipeline rows on reused cubecl streams need 128 or more).
//! `FUSION_STREAMS_BENCH_ROUNDS=<n>` sets the number of rounds (default 15) and
//! `FUSION_STREAMS_BENCH_VERBOSE=1` prints every round's two times, not only the medians (to see
//! whether a slow median is a steady cost or a warm-up that outlasts the untimed round), and for
//! the softmax, attention and layer-norm rows each call's time per repetition split into
//! building it and reading its result.
//! `FUSION_STREAMS_BENCH_PROFILE=1` (with `VERBOSE`) also prints, after each call on our engine,
//! the time the engine spent in each of its sections (`fusion_streams::profile`), the main
//! thread's apart.
//! `FUSION_STREAMS_BENCH_SOLO=<ours|plain|unfused|burn-fusion>` runs one contender alone (an
//! untimed round, then `ROUNDS` timed ones, no comparison), for an external profiler; on Linux
//! it also prints the calling thread's time on a core and time waiting for one over the rounds.
//! `FUSION_STREAMS_BENCH_MLP_REPS=<n>` sets the forwards each thread of the MLP rows runs
//! (default 200; each thread starts, builds its weights and ends within the row's time).
//! `FUSION_STREAMS_BENCH_BATCH_POOL=off` makes our engine run every batch on the thread that
//! drains it (`BatchPlacement::InPlace`), where burn-ndarray's default hands each batch holding a
//! matmul to the engine's batch pool in one trip.
//! `FUSION_STREAMS_BENCH_ALIGNED=1` puts every allocation of 1 KiB or more on a 64-byte boundary
//! (`benches/common/aligned.rs`), so that NdArray's SIMD loops meet the same boundary on both
//! sides whatever the heap's history (it moves the 1 Ki chain's ratio by a few thousandths).
//! `FUSION_STREAMS_BENCH_QUICK=1` shortens it (smoke runs); with the `cuda` feature, `B` is
//! `CubeBackend<CudaRuntime>` instead of `NdArray`.
//!
//! With `cuda`, each measurement also runs on our engine with fusion switched off
//! (`ratio unfused-<name>`: unfused time over fused) and on burn-fusion 0.21's
//! `Fusion<CubeBackend>`, and prints
//! `ratio burn-fusion-<name>: <x>` (its time over ours). burn 0.21 has no run-time switch for its
//! fusers (burn-cubecl hard-codes them in `FusionCubeRuntime::fusers`); its "fusion off"
//! configuration is the `fusion` cargo feature off, which makes `burn::backend::Cuda` plain
//! `CubeBackend` — our `plain` column. The `burn-fusion` column is burn with fusion on: the bar
//! kernel fusion on this crate's streams has to clear.

use std::time::{Duration, Instant};

use burn_backend::Backend;
use burn_tensor::activation::{relu, softmax};
use burn_tensor::{Bool, Tensor, TensorData};

mod common;
#[path = "../tests/under_test/mod.rs"]
mod under_test;

use common::aligned::{ALIGNED, Aligned};
use under_test::{Ours, Plain, elementwise_chain};

#[global_allocator]
static ALLOCATOR: Aligned = Aligned;
#[cfg(feature = "cuda")]
type BurnFusion = burn_fusion::Fusion<Plain>;

fn quick() -> bool {
    std::env::var_os("FUSION_STREAMS_BENCH_QUICK").is_some()
}

fn data(n: usize, seed: usize) -> TensorData {
    let values = (0..n)
        .map(|i| (((i * 31 + seed) % 17) as f32 - 8.0) / 64.0)
        .collect::<Vec<_>>();
    TensorData::new(values, [n])
}

/// 1,000 cheap elementwise ops, alternating so values stay bounded, then a read.
fn chain<B: Backend>(device: &B::Device, n: usize) -> Duration {
    let x = Tensor::<B, 1>::from_data(data(n, 1), device);
    B::sync(device).unwrap();
    let start = Instant::now();
    let t = elementwise_chain(x, 1000);
    let out = t.into_data();
    let elapsed = start.elapsed();
    std::hint::black_box(out);
    elapsed
}

/// `reps` times: a chain of 16 elementwise ops on `n` f32, then a read (the latency of one
/// short fusable chain, which fusion turns from 16 kernels into one).
fn short_chain<B: Backend>(device: &B::Device, n: usize, reps: usize) -> Duration {
    let x = Tensor::<B, 1>::from_data(data(n, 3), device);
    B::sync(device).unwrap();
    let start = Instant::now();
    for _ in 0..reps {
        let mut t = x.clone();
        for i in 0..16 {
            t = match i % 4 {
                0 => t * 1.5,
                1 => t.tanh(),
                2 => t + x.clone(),
                _ => t.abs(),
            };
        }
        std::hint::black_box(t.into_data());
    }
    start.elapsed()
}

/// `reps` times a softmax along the rows of a `[rows, 512]` tensor, scaled first, then a read.
fn softmax_rows<B: Backend>(device: &B::Device, rows: usize, reps: usize) -> Duration {
    let x = Tensor::<B, 1>::from_data(data(rows * 512, 5), device).reshape([rows, 512]);
    B::sync(device).unwrap();
    let mut phases = Phases::new(format!("softmax/{rows}"));
    let start = Instant::now();
    for _ in 0..reps {
        phases.rep(|| softmax(x.clone() * 4.0, 1), read);
    }
    phases.report(start.elapsed())
}

/// `reps` times one attention step over 16 heads of `seq` positions and 64 features, then a
/// read: scores = q·kᵀ, scaled, causally masked, softmax along the keys, then ·v.
fn attention<B: Backend>(device: &B::Device, seq: usize, reps: usize) -> Duration {
    const HEADS: usize = 16;
    const FEATURES: usize = 64;
    let input = |seed| {
        Tensor::<B, 1>::from_data(data(HEADS * seq * FEATURES, seed), device)
            .reshape([HEADS, seq, FEATURES])
    };
    let (q, k, v) = (input(7), input(8), input(9));
    let future = Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, device)
        .unsqueeze::<3>()
        .expand([HEADS, seq, seq]);
    let scale = 1.0 / (FEATURES as f64).sqrt();
    B::sync(device).unwrap();
    let mut phases = Phases::new(format!("attention/{seq}"));
    let start = Instant::now();
    for _ in 0..reps {
        let step = || {
            let scores = q.clone().matmul(k.clone().swap_dims(1, 2)) * scale;
            let probabilities = softmax(scores.mask_fill(future.clone(), -1.0e9), 2);
            probabilities.matmul(v.clone())
        };
        phases.rep(step, read);
    }
    phases.report(start.elapsed())
}

/// `reps` times a layer norm over the 1,024 features of `rows` rows (biased variance, a scale
/// and a shift per feature), then a read.
fn layer_norm<B: Backend>(device: &B::Device, rows: usize, reps: usize) -> Duration {
    const FEATURES: usize = 1024;
    let x = Tensor::<B, 1>::from_data(data(rows * FEATURES, 11), device).reshape([rows, FEATURES]);
    let gamma = Tensor::<B, 1>::from_data(data(FEATURES, 12), device).reshape([1, FEATURES]) + 1.0;
    let beta = Tensor::<B, 1>::from_data(data(FEATURES, 13), device).reshape([1, FEATURES]);
    B::sync(device).unwrap();
    let mut phases = Phases::new(format!("layer-norm/{rows}"));
    let start = Instant::now();
    for _ in 0..reps {
        let step = || {
            let (variance, mean) = x.clone().var_mean_bias(1);
            let normalised = (x.clone() - mean) / (variance + 1e-5).sqrt();
            normalised * gamma.clone() + beta.clone()
        };
        phases.rep(step, read);
    }
    phases.report(start.elapsed())
}

/// Read a result back (the end of each repetition of the read-per-repetition workloads).
fn read<B: Backend, const D: usize>(y: Tensor<B, D>) {
    std::hint::black_box(y.into_data());
}

/// Where a read-per-repetition workload's time goes, printed with `FUSION_STREAMS_BENCH_VERBOSE`:
/// building each repetition (recording its operations, and whatever the backend launches on the
/// way) against reading its result (the rest of the dispatch, waiting for the device, the copy
/// back). A device-bound workload spends its time reading; one bound by host work done at
/// launch, building.
struct Phases {
    what: String,
    building: Duration,
    reading: Duration,
    reps: u32,
}

impl Phases {
    fn new(what: String) -> Self {
        Self {
            what,
            building: Duration::ZERO,
            reading: Duration::ZERO,
            reps: 0,
        }
    }

    fn rep<T>(&mut self, build: impl FnOnce() -> T, read: impl FnOnce(T)) {
        let start = Instant::now();
        let built = build();
        let built_at = Instant::now();
        read(built);
        self.building += built_at - start;
        self.reading += built_at.elapsed();
        self.reps += 1;
    }

    /// `elapsed` back, after printing the split if asked to. Never inlined: it ends each round
    /// of a read-per-repetition workload, so a profiler can cut its record there (callgrind's
    /// `--dump-after='*Phases*report*'`: one record per round, the first with the start-up).
    #[inline(never)]
    fn report(self, elapsed: Duration) -> Duration {
        if verbose() && self.reps > 0 {
            eprintln!(
                "    {}: {:.1?} per repetition: building {:.1?}, reading {:.1?}",
                self.what,
                elapsed / self.reps,
                self.building / self.reps,
                self.reading / self.reps
            );
        }
        elapsed
    }
}

/// A small MLP (batch 32, 64 -> 128 -> 16): its weights and input.
struct Mlp<B: Backend> {
    w1: Tensor<B, 2>,
    w2: Tensor<B, 2>,
    x: Tensor<B, 2>,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device, seed: usize) -> Self {
        let tensor = |n, seed, shape: [usize; 2]| {
            Tensor::<B, 1>::from_data(data(n, seed), device).reshape(shape)
        };
        Self {
            w1: tensor(64 * 128, seed, [64, 128]),
            w2: tensor(128 * 16, seed + 1, [128, 16]),
            x: tensor(32 * 64, seed + 2, [32, 64]),
        }
    }

    /// One forward pass: a matmul, a bias and a ReLU, a matmul, a sum.
    fn forward(&self) -> Tensor<B, 2> {
        let h = relu(self.x.clone().matmul(self.w1.clone()) + 0.1);
        h.matmul(self.w2.clone()).sum_dim(1)
    }
}

/// The MLP forward pass, `reps` times, on each of `threads` threads with its own weights and
/// input, each output read.
fn mlp_threads<B: Backend>(device: &B::Device, threads: usize, reps: usize) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let device = device.clone();
            s.spawn(move || {
                let mlp = Mlp::<B>::new(&device, t);
                for _ in 0..reps {
                    std::hint::black_box(mlp.forward().into_data());
                }
            });
        }
    });
    start.elapsed()
}

/// The MLP forward `reps` times from one thread with nothing waiting between them, then one
/// sync: how fast the backend's client takes exactly these kernels (the ceiling).
fn mlp_back_to_back<B: Backend>(device: &B::Device, reps: usize) -> Duration {
    let mlp = Mlp::<B>::new(device, 0);
    B::sync(device).unwrap();
    let start = Instant::now();
    for _ in 0..reps {
        std::hint::black_box(mlp.forward());
    }
    B::sync(device).unwrap();
    start.elapsed()
}

/// `producers` threads each compute `each` tensors of 1,024 f32 (an elementwise chain) and send
/// them to this thread, which adds them to a running sum as they arrive, then reads the sum.
///
/// With `FUSION_STREAMS_BENCH_VERBOSE`, each call also prints where its time went: how long the
/// producers took to send everything, how long the consumer spent in its additions and waiting
/// for the channel, and how long the final read took.
fn pipeline<B: Backend>(device: &B::Device, producers: usize, each: usize) -> Duration {
    let start = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel::<Tensor<B, 1>>();
    let (mut adding, mut receiving) = (Duration::ZERO, Duration::ZERO);
    let (mut reading, mut read) = (Duration::ZERO, Duration::ZERO);
    let produced = std::thread::scope(|s| {
        let threads: Vec<_> = (0..producers)
            .map(|p| {
                let (tx, device) = (tx.clone(), device.clone());
                s.spawn(move || {
                    let base = Tensor::<B, 1>::from_data(data(1024, p), &device);
                    for i in 0..each {
                        let t = (base.clone() * (i as f32) + 1.0).tanh() * 2.0;
                        tx.send(t).unwrap();
                    }
                    start.elapsed()
                })
            })
            .collect();
        drop(tx);
        let mut sum = Tensor::<B, 1>::zeros([1024], device);
        let mut waited = Instant::now();
        for t in rx.iter() {
            let added = Instant::now();
            receiving += added - waited;
            sum = sum + t;
            waited = Instant::now();
            adding += waited - added;
        }
        let reading_from = Instant::now();
        std::hint::black_box(sum.into_data());
        reading = reading_from.elapsed();
        read = start.elapsed();
        threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .max()
            .unwrap_or_default()
    });
    let elapsed = start.elapsed();
    if verbose() {
        eprintln!(
            "    pipeline/{producers}: {elapsed:.2?} in all; producers done after {produced:.2?}; \
             consumer adding {adding:.2?}, receiving {receiving:.2?}, reading {reading:.2?} \
             (done after {read:.2?}; the rest is the producers' thread exits)"
        );
    }
    elapsed
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// `FUSION_STREAMS_BENCH_UNTIMED=<n>`: untimed rounds per side before the timed ones (default
/// 1). The pipeline rows start a new producer thread every call, which cubecl 0.10 puts on a
/// new one of its 128 stream slots until each has been used once; `n` ≥ 128 measures them on
/// reused slots (docs/BENCHMARKS.md, "Fresh cubecl streams").
fn untimed_rounds() -> usize {
    std::env::var("FUSION_STREAMS_BENCH_UNTIMED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

fn verbose() -> bool {
    std::env::var_os("FUSION_STREAMS_BENCH_VERBOSE").is_some()
}

/// Alternate ours and theirs `rounds` times, each going first in every other round; print both
/// medians and return them (ours, theirs).
fn compare(
    name: &str,
    theirs: &str,
    rounds: usize,
    mut ours: impl FnMut() -> Duration,
    mut plain: impl FnMut() -> Duration,
) -> (Duration, Duration) {
    // Untimed rounds first (one each by default): page faults, thread start-up, lazy
    // initialisation.
    for _ in 0..untimed_rounds() {
        ours();
        plain();
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // Which side goes first alternates, so that an effect of running second (caches and
        // clocks left by the other side) falls on both sides alike.
        if round % 2 == 0 {
            a.push(ours());
            b.push(plain());
        } else {
            b.push(plain());
            a.push(ours());
        }
        if verbose() {
            let first = if round % 2 == 0 { "ours" } else { theirs };
            eprintln!(
                "  {name} round {round}: ours {:.4?}, {theirs} {:.4?} ({first} first)",
                a[round], b[round]
            );
        }
    }
    let (a, b) = (median(a), median(b));
    let ratio = b.as_secs_f64() / a.as_secs_f64();
    eprintln!(
        "{name:<24} stream-fusion {a:>10.2?}   {theirs} {b:>10.2?}   {theirs}/ours {ratio:.3}"
    );
    (a, b)
}

/// Whether `FUSION_STREAMS_BENCH_ONLY` lets measurement `name` run.
fn selected(name: &str) -> bool {
    std::env::var("FUSION_STREAMS_BENCH_ONLY").map_or(true, |only| {
        only.split(',').any(|prefix| name.starts_with(prefix))
    })
}

/// One measurement: ours against plain `B` and, with `cuda`, against burn-fusion too. Returns
/// our median against plain, if it ran.
fn measure(
    ratios: &mut Vec<(String, f64)>,
    name: String,
    rounds: usize,
    run: impl Fn(Contender) -> Duration,
) -> Option<Duration> {
    if !selected(&name) {
        return None;
    }
    if let Ok(solo) = std::env::var("FUSION_STREAMS_BENCH_SOLO") {
        let contender = match solo.as_str() {
            "ours" => Contender::Ours,
            _ => match Contender::peers()
                .into_iter()
                .find(|(peer, _)| *peer == solo)
            {
                Some((_, contender)) => contender,
                None => panic!("FUSION_STREAMS_BENCH_SOLO={solo}: not `ours` or a peer's name"),
            },
        };
        for _ in 0..untimed_rounds() {
            run(contender);
        }
        let before = Schedstat::now();
        let mut times: Vec<Duration> = (0..rounds).map(|_| run(contender)).collect();
        let scheduled = before.zip(Schedstat::now()).map(|(a, b)| b.since(a));
        times.sort();
        println!(
            "{name:<24} {solo} alone {:>9.2?} (median of {rounds})",
            times[rounds / 2]
        );
        if let Some(s) = scheduled {
            let wall: Duration = times.iter().sum();
            println!(
                "{name:<24} {solo} alone, this thread over the {rounds} rounds: wall {wall:.2?}, \
                 on a core {:.2?}, runnable but waiting {:.2?}, {} time slices",
                s.on_cpu, s.waiting, s.slices
            );
        }
        return None;
    }
    let mut against_plain = None;
    for (peer, contender) in Contender::peers() {
        let label = match peer {
            "plain" => name.clone(),
            _ => format!("{peer}-{name}"),
        };
        let (ours, theirs) = compare(
            &label,
            peer,
            rounds,
            || run(Contender::Ours),
            || run(contender),
        );
        ratios.push((label, theirs.as_secs_f64() / ours.as_secs_f64()));
        against_plain.get_or_insert(ours);
    }
    against_plain
}

/// The calling thread's scheduler statistics (Linux `/proc/thread-self/schedstat`): time on a
/// core, time runnable but waiting for one, and time slices. A solo run prints their change
/// over its rounds, which says whether a slow contender executes longer or waits longer (rows
/// that run on the calling thread: the chains, softmax, attention, layer norm). The kernel
/// updates these at scheduler ticks, so they are a few milliseconds coarse: read them over
/// rounds that take far longer.
#[derive(Clone, Copy)]
struct Schedstat {
    on_cpu: Duration,
    waiting: Duration,
    slices: u64,
}

impl Schedstat {
    fn now() -> Option<Self> {
        let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
        let mut fields = text.split_whitespace().map(|f| f.parse::<u64>().ok());
        Some(Self {
            on_cpu: Duration::from_nanos(fields.next()??),
            waiting: Duration::from_nanos(fields.next()??),
            slices: fields.next()??,
        })
    }

    fn since(self, earlier: Self) -> Self {
        Self {
            on_cpu: self.on_cpu.saturating_sub(earlier.on_cpu),
            waiting: self.waiting.saturating_sub(earlier.waiting),
            slices: self.slices.saturating_sub(earlier.slices),
        }
    }
}

/// Which backend a measurement runs on.
#[derive(Clone, Copy)]
enum Contender {
    Ours,
    /// Ours with fusion switched off on the engine (`MultiStream::set_fusion`).
    #[cfg(feature = "cuda")]
    OursUnfused,
    Plain,
    #[cfg(feature = "cuda")]
    BurnFusion,
}

impl Contender {
    /// What ours is compared with: plain `B`; with `cuda`, also our engine unfused and
    /// burn-fusion. Each peer's name prefixes its ratios (but plain's).
    fn peers() -> Vec<(&'static str, Contender)> {
        #[allow(unused_mut)]
        let mut peers = vec![("plain", Contender::Plain)];
        #[cfg(feature = "cuda")]
        peers.extend([
            ("unfused", Contender::OursUnfused),
            ("burn-fusion", Contender::BurnFusion),
        ]);
        peers
    }

    /// The workload on this contender's backend.
    fn run(self, work: Work) -> Duration {
        macro_rules! on {
            ($b:ty) => {{
                let device = Default::default();
                match work {
                    Work::Chain(n) => chain::<$b>(&device, n),
                    Work::Short(n, reps) => short_chain::<$b>(&device, n, reps),
                    Work::Mlp(threads, reps) => mlp_threads::<$b>(&device, threads, reps),
                    Work::Softmax(rows, reps) => softmax_rows::<$b>(&device, rows, reps),
                    Work::Attention(seq, reps) => attention::<$b>(&device, seq, reps),
                    Work::LayerNorm(rows, reps) => layer_norm::<$b>(&device, rows, reps),
                    Work::Pipeline(producers, each) => pipeline::<$b>(&device, producers, each),
                }
            }};
        }
        match self {
            Contender::Ours => engine_counted(|| on!(Ours)),
            #[cfg(feature = "cuda")]
            Contender::OursUnfused => {
                let streams = Ours::client(&Default::default());
                streams.streams().set_fusion(false);
                let elapsed = engine_counted(|| on!(Ours));
                streams.streams().set_fusion(true);
                elapsed
            }
            Contender::Plain => on!(Plain),
            #[cfg(feature = "cuda")]
            Contender::BurnFusion => on!(BurnFusion),
        }
    }
}

/// Run `f` on our backend; with `FUSION_STREAMS_BENCH_VERBOSE`, print what the engine did
/// meanwhile (its counters' growth), and with `FUSION_STREAMS_BENCH_PROFILE` where its time went
/// (`fusion_streams::profile`; the marked thread is the bench's main thread: the one thread of
/// the chains, the reductions and the consumer of the pipeline).
fn engine_counted(f: impl FnOnce() -> Duration) -> Duration {
    if fusion_streams::profile::enabled() {
        fusion_streams::profile::take();
    }
    if !verbose() {
        return f();
    }
    let streams = Ours::client(&Default::default());
    let before = streams.streams().stats();
    let elapsed = f();
    let after = streams.streams().stats();
    let grew = |a: u64, b: u64| b.saturating_sub(a);
    eprintln!(
        "    engine: {} ops executed, {} lazy flushes, {} closed runs, {} drains ({} for shares), \
         {} shares, {} fused kernels over {} ops, {} cut runs unfused, {} deferred frees, \
         {} stream orderings ({} more not needed), {} ops recorded while another thread held \
         the lock",
        grew(before.ops_executed, after.ops_executed),
        grew(before.lazy_flushes, after.lazy_flushes),
        grew(before.closed_runs, after.closed_runs),
        grew(before.drains, after.drains),
        grew(before.share_drains, after.share_drains),
        grew(before.shares, after.shares),
        grew(before.fused_kernels, after.fused_kernels),
        grew(before.ops_fused, after.ops_fused),
        grew(before.cut_runs_unfused, after.cut_runs_unfused),
        grew(before.deferred_frees, after.deferred_frees),
        grew(before.orders, after.orders),
        grew(before.orders_skipped, after.orders_skipped),
        grew(before.ops_posted, after.ops_posted),
    );
    if fusion_streams::profile::enabled() {
        eprintln!("    engine time: {}", fusion_streams::profile::take());
    }
    elapsed
}

/// What a measurement runs.
#[derive(Clone, Copy)]
enum Work {
    /// The 1,000-op chain on `n` elements.
    Chain(usize),
    /// The 16-op chain on `n` elements, `reps` times.
    Short(usize, usize),
    /// The MLP on `threads` threads, `reps` times each.
    Mlp(usize, usize),
    /// The softmax on `rows` rows, `reps` times.
    Softmax(usize, usize),
    /// The attention step over `seq` positions, `reps` times.
    Attention(usize, usize),
    /// The layer norm of `rows` rows, `reps` times.
    LayerNorm(usize, usize),
    /// `producers` threads sending `each` tensors each to an accumulating consumer.
    Pipeline(usize, usize),
}

/// The ceiling (see the module docs): `16 × reps` MLP forwards back to back on plain `B` from
/// one thread, against our forward rate at each thread count of `mlp`. Each round runs the
/// ceiling and then ours at that thread count, and the fraction printed is the median of the
/// rounds' fractions: the two sides of each fraction are measured moments apart, so a drift in
/// the shared machine's load moves both (one ceiling measured after all the MLP rows, against
/// their medians, moved the fraction at 16 threads between 0.79 and 1.26 from run to run).
fn ceiling(ratios: &mut Vec<(String, f64)>, rounds: usize, reps: usize, mlp: &[usize]) {
    let device = Default::default();
    let forwards = 16 * reps;
    let per_second = |n: usize, t: Duration| n as f64 / t.as_secs_f64();
    mlp_back_to_back::<Plain>(&device, forwards);
    let mut ceilings = Vec::new();
    // How often our threads waited at the launch gate, and went ahead past it (read outside
    // the timed forwards).
    let gate = || {
        let stats = Ours::client(&device).streams().stats();
        (stats.launch_waits, stats.launch_overdrafts)
    };
    for &threads in mlp {
        let (mut rates, mut fractions) = (Vec::new(), Vec::new());
        let before = gate();
        for _ in 0..rounds {
            let ceiling = per_second(forwards, mlp_back_to_back::<Plain>(&device, forwards));
            let ours = per_second(
                threads * reps,
                Contender::Ours.run(Work::Mlp(threads, reps)),
            );
            ceilings.push(ceiling);
            rates.push(ours);
            fractions.push(ours / ceiling);
        }
        let after = gate();
        let fraction = median_f64(fractions);
        eprintln!(
            "ceiling-threads/{threads:<8} {:>10.0} forwards/s   of ceiling {fraction:.3} \
             (median of {rounds} paired rounds; launch gate: {} waits, {} past it after 1 ms, \
             over {} forwards)",
            median_f64(rates),
            after.0 - before.0,
            after.1 - before.1,
            rounds * threads * reps,
        );
        ratios.push((format!("ceiling-threads/{threads}"), fraction));
    }
    eprintln!(
        "ceiling: {:.0} MLP forwards/s (plain, one thread, back to back; median of every round)",
        median_f64(ceilings)
    );
}

fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    // First, before any large allocation (see `common::aligned`).
    let aligned = std::env::var_os("FUSION_STREAMS_BENCH_ALIGNED").is_some_and(|v| v == "1");
    ALIGNED.store(aligned, std::sync::atomic::Ordering::Relaxed);
    if aligned {
        eprintln!("allocations of 1 KiB or more on a 64-byte boundary");
    }
    // `cargo bench` passes `--bench`; there are no filters to honour.
    let device = Default::default();
    if std::env::var_os("FUSION_STREAMS_BENCH_PROFILE").is_some() {
        fusion_streams::profile::enable(true);
        fusion_streams::profile::mark_current_thread();
    }
    if common::batch_placement_from_env::<Plain>() {
        eprintln!("our engine: every batch runs on the thread that drains it (no batch pool)");
    }
    // How lazily our engine dispatches, if the environment says (`common::engine_config_from_env`).
    if let Some(config) = common::engine_config_from_env() {
        assert!(
            Ours::configure(&device, config),
            "configured before first use"
        );
        eprintln!(
            "our engine: queue bound {}, fused runs at most {} entries, closed runs dispatched \
             at once: {}",
            config.max_queue_len, config.max_fused_len, config.dispatch_closed_runs
        );
    }
    let launching = Ours::client(&device)
        .streams()
        .config()
        .max_launching_threads;
    eprintln!(
        "our engine: threads launching at once at most {}",
        launching.map_or("(no bound)".to_string(), |n| {
            if n == usize::MAX {
                "(no bound)".into()
            } else {
                n.to_string()
            }
        })
    );
    let rounds = std::env::var("FUSION_STREAMS_BENCH_ROUNDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(if quick() { 3 } else { 15 });
    eprintln!(
        "backend bench: {} vs {}, {rounds} alternating rounds per measurement (medians)",
        Ours::name(&device),
        Plain::name(&device)
    );
    let mut ratios = Vec::new();
    for n in [1 << 10, 1 << 14, 1 << 16, 1 << 18] {
        measure(&mut ratios, format!("chain/{n}"), rounds, |c| {
            c.run(Work::Chain(n))
        });
    }
    let short_reps = if quick() { 10 } else { 100 };
    for n in [1 << 10, 1 << 16] {
        measure(&mut ratios, format!("short-chain/{n}"), rounds, |c| {
            c.run(Work::Short(n, short_reps))
        });
    }
    for rows in [64, 4096] {
        measure(&mut ratios, format!("softmax/{rows}"), rounds, |c| {
            c.run(Work::Softmax(rows, short_reps))
        });
    }
    for seq in [128, 512] {
        measure(&mut ratios, format!("attention/{seq}"), rounds, |c| {
            c.run(Work::Attention(seq, short_reps))
        });
    }
    for rows in [64, 4096] {
        measure(&mut ratios, format!("layer-norm/{rows}"), rounds, |c| {
            c.run(Work::LayerNorm(rows, short_reps))
        });
    }
    let reps = std::env::var("FUSION_STREAMS_BENCH_MLP_REPS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(if quick() { 20 } else { 200 });
    let mut mlp = Vec::new();
    for threads in [1, 2, 4, 8, 16] {
        let name = format!("threads/{threads}");
        if measure(&mut ratios, name, rounds, |c| {
            c.run(Work::Mlp(threads, reps))
        })
        .is_some()
        {
            mlp.push(threads);
        }
    }
    if !mlp.is_empty() {
        ceiling(&mut ratios, rounds, reps, &mlp);
    }
    let each = if quick() { 20 } else { 200 };
    for producers in [1, 4, 8] {
        let name = format!("pipeline/{producers}");
        measure(&mut ratios, name, rounds, |c| {
            c.run(Work::Pipeline(producers, each))
        });
    }
    for (name, r) in ratios {
        println!("ratio {name}: {r:.3}");
    }
}
