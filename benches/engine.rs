//! The engine, side by side with burn-fusion's own (0.21.0, which we build on, and 0.23.0-pre.1,
//! whose `MultiStream` has shared views), each driven through its public client with an equivalent
//! mock runtime (an `Arc<()>` handle) and the same no-op `Exp` operation, registered the way burn's
//! `float_exp` registers it. burn's mock has one never-ready fuser, so its ops queue lazily and run
//! unfused at the sync: the lazy, unfused setup this crate's engine is measured in.
//!
//! `cargo bench --bench engine` — three groups, then one `ratio <name>: <ours/theirs>` line per
//! comparison (higher is better for us; for latencies the ratio is theirs/ours):
//!
//! 1. `throughput`: one stream, a chain of lazily queued ops, then a sync;
//! 2. `share`: the latency of a cross-thread clone of a materialised and of a pending source;
//! 3. `threads`: T = 1, 2, 4, 8, 16 threads, each running its own chain on its own stream.
//!
//! `FUSION_STREAMS_BENCH_QUICK=1` shortens the measurement (for smoke runs).
//!
//! This bench measures the engine alone, so it has no GPU part: on a GPU the kernels dominate.
//! `benches/backend.rs` compares `StreamFusion<CubeBackend>` with plain `CubeBackend` and with
//! burn-fusion's `Fusion<CubeBackend>` on CUDA, and `benches/transfer.rs` the transfer paths.

use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};

mod common;

use common::{median, record};

/// The operations every engine below runs: create a tensor, apply `exp` (consuming its input),
/// clone, sync.
trait Engine: Send + Sync + 'static {
    type Tensor: Clone + Send + 'static;
    const NAME: &'static str;
    fn new() -> Self;
    fn create(&self) -> Self::Tensor;
    fn exp(&self, x: Self::Tensor) -> Self::Tensor;
    fn sync(&self);
}

mod ours {
    use std::sync::Arc;

    use burn_backend::{DType, DeviceId, DeviceOps, Shape, TensorData};
    use burn_fusion::{FusionRuntime, OperationFuser};
    use burn_ir::TensorIr;
    use fusion_streams::host::Unfused;
    use fusion_streams::runtime::{Kernel, KernelInputs, StreamRuntime};
    use fusion_streams::{FusionClient, FusionTensor, Operand};

    #[derive(Clone, Debug, Default, PartialEq)]
    pub struct MockDevice;

    impl burn_backend::Device for MockDevice {
        fn from_id(_: DeviceId) -> Self {
            MockDevice
        }
        fn to_id(&self) -> DeviceId {
            DeviceId {
                type_id: 0x4d31,
                index_id: 0,
            }
        }
    }
    impl DeviceOps for MockDevice {}

    /// A device whose kernels do nothing: handles are `Arc<()>`.
    #[derive(Debug)]
    pub struct MockRuntime;

    impl FusionRuntime for MockRuntime {
        type OptimizationState = ();
        type Optimization = Unfused;
        type FusionHandle = Arc<()>;
        type FusionDevice = MockDevice;
        fn fusers(_: MockDevice) -> Vec<Box<dyn OperationFuser<Unfused>>> {
            Vec::new()
        }
    }

    impl StreamRuntime for MockRuntime {
        type Context = ();
        fn name() -> &'static str {
            "mock"
        }
        fn open(_: &MockDevice) -> fusion_streams::Result<()> {
            Ok(())
        }
        fn upload(_: &(), _: TensorData) -> fusion_streams::Result<Arc<()>> {
            Ok(Arc::new(()))
        }
        fn read(
            _: &(),
            _: &Arc<()>,
            shape: &Shape,
            _: DType,
        ) -> fusion_streams::Result<TensorData> {
            Ok(TensorData::zeros::<f32, _>(shape.clone()))
        }
        fn can_mut(handle: &Arc<()>) -> bool {
            Arc::strong_count(handle) == 1
        }
        // No buffer of this device is another stream's (as the trait asks a runtime whose
        // buffers never are to say; burn-fusion has no such check to skip).
        fn has_foreign_buffers(_: &()) -> bool {
            false
        }
        fn synchronize(_: &()) -> fusion_streams::Result<()> {
            Ok(())
        }
        fn supports(_: &Kernel, dtype: DType) -> bool {
            dtype == DType::F32
        }
        fn launch(
            _: &(),
            _: &Kernel,
            inputs: KernelInputs<'_, Arc<()>>,
            _: &TensorIr,
        ) -> fusion_streams::Result<Arc<()>> {
            drop(inputs);
            Ok(Arc::new(()))
        }
    }

    pub struct Ours(pub FusionClient<MockRuntime>);

    impl super::Engine for Ours {
        type Tensor = FusionTensor<MockRuntime>;
        const NAME: &'static str = "fusion-streams";
        fn new() -> Self {
            Ours(FusionClient::new(MockDevice).unwrap())
        }
        fn create(&self) -> Self::Tensor {
            self.0
                .from_data(TensorData::new(vec![0.0f32; 4], [4]))
                .unwrap()
        }
        fn exp(&self, x: Self::Tensor) -> Self::Tensor {
            self.0.launch(Kernel::Exp, [Operand::Consume(x)]).unwrap()
        }
        fn sync(&self) {
            self.0.sync().unwrap();
        }
    }
}

/// The same mock and op for one burn-fusion version. The versions differ only in the arguments:
/// crate paths, `Operation::execute`'s return, how `register` is told the stream, and
/// `DeviceOps`'s required items.
macro_rules! burn_engine {
    (
        mod $module:ident ($label:literal, device type $type_id:literal) {
            crates: $fusion:ident, $ir:ident, $backend:ident;
            execute returns $ret:ty = $ok:expr;
            init streams: $init_streams:expr;
            input streams: |$x:ident| $input_streams:expr;
            device ops: { $($device_ops:tt)* }
        }
    ) => {
        mod $module {
            use std::sync::Arc;

            use $backend::{DType, DeviceId, DeviceOps, Shape};
            use $fusion::stream::{Context, Operation, OrderedExecution};
            use $fusion::{
                Client, FuserProperties, FuserStatus, FusionRuntime, FusionTensor, NumOperations,
                OperationFuser, Optimization,
            };
            use $ir::{
                FloatOperationIr, HandleContainer, InitOperationIr, OperationIr, TensorIr,
                TensorStatus, UnaryOpIr,
            };

            #[derive(Clone, Debug, Default, PartialEq)]
            pub struct MockDevice;

            impl $backend::Device for MockDevice {
                fn from_id(_: DeviceId) -> Self {
                    MockDevice
                }
                fn to_id(&self) -> DeviceId {
                    DeviceId { type_id: $type_id, index_id: 0 }
                }
            }

            impl DeviceOps for MockDevice {
                $($device_ops)*
            }

            #[derive(Debug)]
            pub struct MockRuntime;

            /// Never produced: the fuser below is never ready, so burn never calls `finish`.
            #[derive(Debug)]
            pub enum NoFusion {}

            impl NumOperations for NoFusion {
                fn len(&self) -> usize {
                    match *self {}
                }
                fn name(&self) -> &'static str {
                    match *self {}
                }
            }

            impl Optimization<MockRuntime> for NoFusion {
                fn execute(&mut self, _: &mut Context<Arc<()>>, _: &OrderedExecution<MockRuntime>) {
                    match *self {}
                }
                fn to_state(&self) {
                    match *self {}
                }
                fn from_state(_: &MockDevice, _: ()) -> Self {
                    unreachable!("no fusion state is ever saved")
                }
            }

            /// Open and never ready: ops queue lazily and run unfused at the sync.
            #[derive(Clone, Default)]
            struct NeverReady(usize);

            impl OperationFuser<NoFusion> for NeverReady {
                fn fuse(&mut self, _: &OperationIr) {
                    self.0 += 1;
                }
                fn finish(&mut self) -> NoFusion {
                    unreachable!("burn only finishes ready fusers")
                }
                fn reset(&mut self) {
                    self.0 = 0;
                }
                fn status(&self) -> FuserStatus {
                    FuserStatus::Open
                }
                fn properties(&self) -> FuserProperties {
                    FuserProperties { score: 0, ready: false }
                }
                fn len(&self) -> usize {
                    self.0
                }
                fn clone_dyn(&self) -> Box<dyn OperationFuser<NoFusion>> {
                    Box::new(self.clone())
                }
            }

            impl FusionRuntime for MockRuntime {
                type OptimizationState = ();
                type Optimization = NoFusion;
                type FusionHandle = Arc<()>;
                type FusionDevice = MockDevice;
                fn fusers(_: MockDevice) -> Vec<Box<dyn OperationFuser<NoFusion>>> {
                    vec![Box::new(NeverReady::default())]
                }
            }

            /// burn's `ExpOps` with a no-op kernel: take the input, register a fresh output.
            #[derive(Debug)]
            struct ExpOp(UnaryOpIr);

            impl Operation<MockRuntime> for ExpOp {
                fn execute(&self, handles: &mut HandleContainer<Arc<()>>) -> $ret {
                    let _input = handles.get_handle(&self.0.input.id, &self.0.input.status);
                    handles.register_handle(self.0.out.id, Arc::new(()));
                    $ok
                }
            }

            #[derive(Debug)]
            struct InitOp(TensorIr);

            impl Operation<MockRuntime> for InitOp {
                fn execute(&self, handles: &mut HandleContainer<Arc<()>>) -> $ret {
                    handles.register_handle(self.0.id, Arc::new(()));
                    $ok
                }
            }

            pub struct Burn(Client<MockRuntime>);

            impl super::Engine for Burn {
                type Tensor = FusionTensor<MockRuntime>;
                const NAME: &'static str = $label;
                fn new() -> Self {
                    Burn(Client::<MockRuntime>::new(MockDevice))
                }
                fn create(&self) -> Self::Tensor {
                    let out = TensorIr {
                        id: self.0.create_empty_handle(),
                        shape: Shape::new([4]),
                        status: TensorStatus::NotInit,
                        dtype: DType::F32,
                    };
                    let repr = OperationIr::Init(InitOperationIr { out: out.clone() });
                    self.0.register($init_streams, repr, InitOp(out)).remove(0)
                }
                fn exp(&self, $x: Self::Tensor) -> Self::Tensor {
                    // As burn's `float_exp` registers it.
                    let streams = $input_streams;
                    let desc = UnaryOpIr::create($x.into_ir(), || self.0.create_empty_handle());
                    let repr = OperationIr::Float(DType::F32, FloatOperationIr::Exp(desc.clone()));
                    self.0.register(streams, repr, ExpOp(desc)).remove(0)
                }
                fn sync(&self) {
                    self.0.sync(|| ());
                }
            }
        }
    };
}

burn_engine! {
    mod burn021 ("burn-fusion 0.21", device type 0x4d32) {
        crates: burn_fusion, burn_ir, burn_backend;
        execute returns () = ();
        init streams: burn_fusion::stream::OperationStreams::default();
        input streams: |x| burn_fusion::stream::OperationStreams::with_inputs([&x]);
        device ops: {}
    }
}

burn_engine! {
    mod burn023 ("burn-fusion 0.23-pre", device type 0x4d33) {
        crates: burn_fusion_023, burn_ir_023, burn_backend_023;
        execute returns Result<(), burn_backend_023::ExecutionError> = Ok(());
        init streams: burn_fusion_023::stream::StreamId::current();
        input streams: |x| burn_fusion_023::stream::StreamId::current();
        device ops: {
            fn defaults(&self) -> burn_backend_023::DeviceSettings {
                burn_backend_023::DeviceSettings::with_dtypes(
                    burn_backend_023::FloatDType::F32,
                    burn_backend_023::IntDType::I32,
                    burn_backend_023::BoolDType::Native,
                )
            }
        }
    }
}

/// Ops per chain in the throughput group, and per thread in the threads group.
const CHAIN: usize = 10_000;
const PER_THREAD: usize = 20_000;
const THREADS: [usize; 5] = [1, 2, 4, 8, 16];

fn quick() -> bool {
    std::env::var_os("FUSION_STREAMS_BENCH_QUICK").is_some()
}

/// `n` lazily queued ops, each consuming the previous output, then a sync.
fn chain<E: Engine>(engine: &E, n: usize) {
    let mut x = engine.create();
    for _ in 0..n {
        x = engine.exp(x);
    }
    engine.sync();
}

fn throughput<E: Engine>(c: &mut Criterion, engine: &E) {
    let name = format!("throughput/{}", E::NAME);
    let mut group = c.benchmark_group("throughput");
    group.throughput(criterion::Throughput::Elements(CHAIN as u64));
    group.bench_function(E::NAME, |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                chain(engine, CHAIN);
            }
            let elapsed = start.elapsed();
            record(&name, elapsed, iters * CHAIN as u64);
            elapsed
        })
    });
    group.finish();
}

type Job = Box<dyn FnOnce() + Send>;

/// A second thread that keeps its stream for the whole group.
struct Peer(Sender<Job>);

impl Peer {
    fn spawn() -> Self {
        let (jobs, queue) = channel::<Job>();
        std::thread::spawn(move || queue.into_iter().for_each(|job| job()));
        Peer(jobs)
    }

    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = channel();
        self.0
            .send(Box::new(move || {
                let _ = tx.send(f());
            }))
            .unwrap();
        rx.recv().unwrap()
    }
}

/// The latency of `clone()` on another thread, of a materialised or a pending source. Both
/// threads sync after every iteration (untimed), so each clone starts from empty queues: without
/// that, burn's never-ready fuser lets queued ops and drops pile up across iterations and every
/// later clone pays for them.
fn share<E: Engine>(c: &mut Criterion, engine: &Arc<E>, peer: &Peer) {
    let mut group = c.benchmark_group("share");
    let materialised = engine.create();
    engine.sync();
    for pending in [false, true] {
        let kind = if pending { "pending" } else { "materialised" };
        let name = format!("share/{kind}/{}", E::NAME);
        group.bench_function(BenchmarkId::new(kind, E::NAME), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let source = if pending {
                        engine.exp(materialised.clone())
                    } else {
                        materialised.clone()
                    };
                    let on_peer = engine.clone();
                    total += peer.run(move || {
                        let start = Instant::now();
                        let view = source.clone();
                        let elapsed = start.elapsed();
                        drop((view, source));
                        on_peer.sync();
                        elapsed
                    });
                    engine.sync();
                }
                record(&name, total, iters);
                total
            })
        });
    }
    group.finish();
    drop(materialised);
    engine.sync();
}

/// `t` persistent threads (a pool, like a serving or data-loading pool: each keeps its stream
/// between rounds), released together for each round.
struct Pool {
    start: Arc<Barrier>,
    end: Arc<Barrier>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Pool {
    fn new<E: Engine>(t: usize, engine: &Arc<E>) -> Self {
        let start = Arc::new(Barrier::new(t + 1));
        let end = Arc::new(Barrier::new(t + 1));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..t)
            .map(|_| {
                let (start, end, stop, engine) =
                    (start.clone(), end.clone(), stop.clone(), engine.clone());
                std::thread::spawn(move || {
                    loop {
                        start.wait();
                        if stop.load(std::sync::atomic::Ordering::Acquire) {
                            break;
                        }
                        chain(&*engine, PER_THREAD);
                        end.wait();
                    }
                })
            })
            .collect();
        Self {
            start,
            end,
            stop,
            threads,
        }
    }

    /// One round: every thread runs its chain; the time from the common start to the last end.
    fn round(&self) -> Duration {
        self.start.wait();
        let begin = Instant::now();
        self.end.wait();
        begin.elapsed()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        self.start.wait();
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
    }
}

/// T threads, each running its own chain on its own stream.
fn threads<E: Engine>(c: &mut Criterion, engine: &Arc<E>) {
    let mut group = c.benchmark_group("threads");
    for t in THREADS {
        let name = format!("threads/{t}/{}", E::NAME);
        let pool = Pool::new(t, engine);
        group.throughput(criterion::Throughput::Elements((t * PER_THREAD) as u64));
        group.bench_function(BenchmarkId::new(E::NAME, t), |b| {
            b.iter_custom(|iters| {
                let total: Duration = (0..iters).map(|_| pool.round()).sum();
                record(&name, total, iters * (t * PER_THREAD) as u64);
                total
            })
        });
    }
    group.finish();
}

fn run_all<E: Engine>(c: &mut Criterion, peer: &Peer) {
    let engine = Arc::new(E::new());
    eprintln!("== {} ==", E::NAME);
    throughput(c, &*engine);
    share(c, &engine, peer);
    threads(c, &engine);
}

fn report() {
    const OURS: &str = "fusion-streams";
    let theirs = ["burn-fusion 0.21", "burn-fusion 0.23-pre"];
    let tag = |name: &str| {
        if name.contains("0.21") {
            "burn021"
        } else {
            "burn023"
        }
    };
    println!("\n== engine benchmark: medians (per op, or per clone) ==");
    for name in &common::names() {
        let ns = median(name).unwrap() * 1e9;
        if name.starts_with("share/") {
            println!("  {name:<48} {:>9.3} us", ns / 1e3);
        } else {
            println!("  {name:<48} {:>9.3} Mops/s", 1e3 / ns);
        }
    }
    println!();
    let ratio = |label: String, ours: Option<f64>, theirs: Option<f64>, note: &str| {
        if let (Some(o), Some(t)) = (ours, theirs) {
            println!("ratio {label}: {:.2}{note}", t / o);
        }
    };
    for other in theirs {
        let t = tag(other);
        ratio(
            format!("throughput_vs_{t}"),
            median(&format!("throughput/{OURS}")),
            median(&format!("throughput/{other}")),
            "",
        );
        for kind in ["materialised", "pending"] {
            let note = if other.contains("0.21") {
                "  (0.21's clone is a refcount bump with no shared view)"
            } else {
                ""
            };
            ratio(
                format!("share_{kind}_vs_{t}"),
                median(&format!("share/{kind}/{OURS}")),
                median(&format!("share/{kind}/{other}")),
                note,
            );
        }
        for n in THREADS {
            ratio(
                format!("threads_{n}_vs_{t}"),
                median(&format!("threads/{n}/{OURS}")),
                median(&format!("threads/{n}/{other}")),
                "",
            );
        }
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if let Some(one) = median(&format!("threads/1/{OURS}")) {
        for n in THREADS {
            if let Some(ns) = median(&format!("threads/{n}/{OURS}")) {
                println!(
                    "scaling {OURS} T={n}: {:.2}x the ops/s of T=1 (ideal {}x on {cores} cores)",
                    one / ns,
                    n.min(cores)
                );
            }
        }
    }
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(if quick() { 50 } else { 500 }))
        .measurement_time(Duration::from_millis(if quick() { 200 } else { 2000 }))
        .configure_from_args();
    let started = Instant::now();
    let peer = Peer::spawn();
    run_all::<ours::Ours>(&mut c, &peer);
    run_all::<burn021::Burn>(&mut c, &peer);
    run_all::<burn023::Burn>(&mut c, &peer);
    c.final_summary();
    report();
    eprintln!("engine benchmark finished in {:.1?}", started.elapsed());
}
