//! burn programs inside thread pools, on `StreamFusion<B>` through burn's `Tensor` API: rayon's
//! `par_iter`, `join` and `scope` jobs that clone, compute with, read and drop tensors homed on
//! threads that are themselves running matmuls, convolutions and pooling (which burn-ndarray runs
//! inside rayon). The properties: nothing hangs (each program runs under a watchdog), no job is
//! refused as re-entrant, and every value is the one plain `B` computes.
//!
//! Each program runs once on rayon's default global pool and once more in a child process whose
//! global pool has two threads, the tightest case (`on_a_two_thread_global_pool`).

mod under_test;

use std::sync::Barrier;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::channel;
use std::time::Duration;

use burn_backend::Backend;
use burn_tensor::{Tensor, TensorData};
use rayon::prelude::*;

use under_test::{Ours, Plain};

/// The environment variable that makes this binary's `child` test build a global pool of that
/// many threads and run every program there.
const POOL_VAR: &str = "FUSION_STREAMS_TEST_GLOBAL_POOL";

/// Far above what any program here costs (a debug build on two busy cores): a deadlock check,
/// not a timing assertion.
const LIMIT: Duration = Duration::from_secs(120);

/// Run `program` on its own thread; fail if it has not finished within [`LIMIT`].
fn watchdog(name: &str, program: fn()) {
    let (tx, rx) = channel();
    std::thread::Builder::new()
        .name(format!("program: {name}"))
        .spawn(move || {
            program();
            let _ = tx.send(());
        })
        .expect("spawn");
    match rx.recv_timeout(LIMIT) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("{name}: still running after {LIMIT:?}: a deadlock")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("{name}: panicked"),
    }
}

/// A deterministic `[rows, cols]` matrix with small values (sums of products stay exact enough
/// that both backends agree bit for bit: the same kernels run on the same data).
fn matrix<B: Backend>(rows: usize, cols: usize, seed: usize, device: &B::Device) -> Tensor<B, 2> {
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| (((i * 31 + seed * 7) % 17) as f32 - 8.0) / 16.0)
        .collect();
    Tensor::from_data(TensorData::new(values, [rows, cols]), device)
}

fn f32s(data: TensorData) -> Vec<f32> {
    data.to_vec::<f32>().expect("f32 data")
}

/// `ours` is what plain `B` computed: bit for bit on NdArray (the same kernels on the same data);
/// on CUDA within what TF32 matmuls and autotuned kernels explain (two runs of plain
/// `CubeBackend` may pick different matmul kernels): 0.05 + 1% of the value, far below the 1.0
/// by which a value from another round differs (a read of a stale or reused buffer).
#[track_caller]
fn assert_same(ours: &[f32], plain: &[f32], what: &str) {
    if !cfg!(feature = "cuda") {
        assert_eq!(ours, plain, "{what}");
        return;
    }
    assert_eq!(ours.len(), plain.len(), "{what}: lengths");
    for (i, (a, b)) in ours.iter().zip(plain).enumerate() {
        assert!(
            (a - b).abs() <= 0.05 + 0.01 * b.abs(),
            "{what}: element {i} is {a}, plain computed {b}"
        );
    }
}

/// `FUSION_STREAMS_TEST_SHORT=1`: fewer jobs and rounds, for a run under compute-sanitizer
/// (which slows every kernel down by orders of magnitude).
fn short() -> bool {
    std::env::var_os("FUSION_STREAMS_TEST_SHORT").is_some()
}

const PROGRAMS: [(&str, fn()); 5] = [
    (
        "a thread computing with weights a pool clones",
        a_thread_computes_with_weights_a_pool_clones,
    ),
    (
        "a pending matmul read at once by a thread and every worker",
        a_pending_matmul_read_at_once_by_a_thread_and_every_worker,
    ),
    (
        "pool jobs using tensors of threads that run matmuls, convolutions and pooling",
        pool_jobs_use_tensors_of_threads_running_matmuls_convolutions_and_pooling,
    ),
    (
        "a pool job running batches while other jobs share its tensors",
        a_pool_job_runs_batches_while_other_jobs_share_its_tensors,
    ),
    ("nested joins and scopes", nested_joins_and_scopes),
];

/// The shape of model evaluation and serving: weights made on one thread, which keeps computing
/// with them (matmuls, read back) while rayon jobs clone them and compute too. Every clone is a
/// share from the thread's stream, often while that thread drains its matmuls.
fn a_thread_computes_with_weights_a_pool_clones() {
    let device = Default::default();
    let plain_w = matrix::<Plain>(64, 64, 1, &device);
    let own: Vec<f32> = f32s(plain_w.clone().matmul(plain_w.clone()).sum().into_data());
    // Most jobs are cheap (the share is most of their work), every eighth one a matmul.
    let job = |w: Tensor<_, 2>, k: usize| match k {
        0 => w.clone().matmul(w).sum_dim(1).into_data(),
        _ => (w * (k as f32)).sum_dim(1).into_data(),
    };
    let expected: Vec<Vec<f32>> = (0..8).map(|k| f32s(job(plain_w.clone(), k))).collect();

    let stop = AtomicUsize::new(0);
    let (tx, rx) = channel();
    let steps = std::thread::scope(|s| {
        let home = s.spawn(|| {
            let w = matrix::<Ours>(64, 64, 1, &device);
            tx.send(w.clone()).unwrap();
            let mut steps = 0;
            while stop.load(Ordering::Acquire) == 0 || steps < 20 {
                let read = f32s(w.clone().matmul(w.clone()).sum().into_data());
                assert_same(&read, &own, &format!("step {steps} on the home thread"));
                steps += 1;
            }
            steps
        });
        let w = rx.recv().unwrap();
        (0..if short() { 512 } else { 4096usize })
            .into_par_iter()
            .for_each(|i| {
                let k = i % 8;
                let w = w.clone();
                let job = |w: Tensor<Ours, 2>| match k {
                    0 => w.clone().matmul(w).sum_dim(1).into_data(),
                    _ => (w * (k as f32)).sum_dim(1).into_data(),
                };
                assert_same(&f32s(job(w)), &expected[k], &format!("job {i}"));
            });
        stop.store(1, Ordering::Release);
        home.join().expect("the home thread")
    });
    assert!(steps >= 20);
}

/// A pending `x.matmul(x) + k`, read at once by a spawned thread and by as many rayon jobs as
/// the pool has workers: whoever comes first drains it, the others wait for that drain.
fn a_pending_matmul_read_at_once_by_a_thread_and_every_worker() {
    let device = Default::default();
    let plain_x = matrix::<Plain>(128, 128, 2, &device);
    let x = matrix::<Ours>(128, 128, 2, &device);
    let workers = rayon::current_num_threads();
    for round in 0..if short() { 5 } else { 50 } {
        let k = round as f32;
        let expected = f32s((plain_x.clone().matmul(plain_x.clone()) + k).into_data());
        let y = x.clone().matmul(x.clone()) + k;
        let barrier = Barrier::new(2);
        std::thread::scope(|s| {
            let thread = s.spawn(|| {
                barrier.wait();
                f32s(y.clone().into_data())
            });
            barrier.wait();
            (0..workers).into_par_iter().for_each(|_| {
                let y = y.clone();
                assert_same(
                    &f32s(y.into_data()),
                    &expected,
                    &format!("round {round}: a job"),
                );
            });
            let thread = thread.join().unwrap();
            assert_same(&thread, &expected, &format!("round {round}: the thread"));
        });
    }
}

/// A convolution, a max pooling and a matmul on `x`, reduced to one row: the work of the home
/// threads of [`pool_jobs_use_tensors_of_threads_running_matmuls_convolutions_and_pooling`].
fn conv_pool_matmul<B: Backend>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    w: Tensor<B, 2>,
) -> TensorData {
    use burn_tensor::module::{conv2d, max_pool2d};
    use burn_tensor::ops::ConvOptions;
    let conv = conv2d(x, weight, None, ConvOptions::new([1, 1], [1, 1], [1, 1], 1));
    let pooled = max_pool2d(conv, [2, 2], [2, 2], [0, 0], [1, 1], false);
    // [1, 2, 4, 4] -> [2, 16] x [16, 16]
    pooled.reshape([2, 16]).matmul(w).sum_dim(0).into_data()
}

fn conv_inputs<B: Backend>(
    seed: usize,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 2>) {
    (
        matrix::<B>(2, 8 * 8, seed, device).reshape([1, 2, 8, 8]),
        matrix::<B>(2, 2 * 3 * 3, seed + 1, device).reshape([2, 2, 3, 3]),
        matrix::<B>(16, 16, seed + 2, device),
    )
}

/// ≥ 100,000 `par_iter` jobs clone, compute with, read and drop small tensors homed on two
/// threads that keep running convolutions, poolings and matmuls (batches that spread over
/// rayon), while the jobs run. No job is refused, and every value is exact.
fn pool_jobs_use_tensors_of_threads_running_matmuls_convolutions_and_pooling() {
    let jobs: usize = if short() { 2_000 } else { 100_000 };
    const HOMES: usize = 2;
    const PER_HOME: usize = 8;
    let device = Default::default();
    let expected_home: Vec<Vec<f32>> = (0..HOMES)
        .map(|h| {
            let (x, weight, w) = conv_inputs::<Plain>(10 * h, &device);
            f32s(conv_pool_matmul(x, weight, w))
        })
        .collect();
    let small = |h: usize, j: usize| -> Vec<f32> { vec![(h * PER_HOME + j) as f32, -1.0] };
    let stop = AtomicUsize::new(0);
    let refused = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let (tx, rx) = channel();
        let homes: Vec<_> = (0..HOMES)
            .map(|h| {
                let (tx, stop, expected, device) = (tx.clone(), &stop, &expected_home[h], &device);
                s.spawn(move || {
                    let tensors: Vec<Tensor<Ours, 1>> = (0..PER_HOME)
                        .map(|j| Tensor::from_data(TensorData::new(small(h, j), [2]), device))
                        .collect();
                    tx.send(tensors).unwrap();
                    let (x, weight, w) = conv_inputs::<Ours>(10 * h, device);
                    let mut steps = 0;
                    while stop.load(Ordering::Acquire) == 0 || steps < 5 {
                        let read = conv_pool_matmul(x.clone(), weight.clone(), w.clone());
                        assert_same(&f32s(read), expected, &format!("home {h}, step {steps}"));
                        steps += 1;
                    }
                })
            })
            .collect();
        drop(tx);
        let tensors: Vec<Tensor<Ours, 1>> = rx.iter().take(HOMES).flatten().collect();
        assert_eq!(tensors.len(), HOMES * PER_HOME);
        (0..jobs).into_par_iter().for_each(|i| {
            let t = &tensors[i % tensors.len()];
            let run = || {
                let view = t.clone();
                let read = f32s((view * 2.0 + (i % 5) as f32).into_data());
                let base = t.clone().into_data();
                (read, f32s(base))
            };
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
                Ok((read, base)) => {
                    let k = (i % 5) as f32;
                    let want: Vec<f32> = base.iter().map(|v| v * 2.0 + k).collect();
                    assert_same(&read, &want, &format!("job {i}"));
                }
                Err(_) => {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        stop.store(1, Ordering::Release);
        for home in homes {
            home.join().expect("a home thread");
        }
    });
    assert_eq!(refused.load(Ordering::Relaxed), 0, "jobs refused or failed");
}

/// A job of a `rayon::scope` makes tensors and keeps running matmuls on them (batches on its
/// worker's stream) while the jobs it spawned compute with clones of them.
fn a_pool_job_runs_batches_while_other_jobs_share_its_tensors() {
    let device = Default::default();
    let plain_w = matrix::<Plain>(48, 48, 3, &device);
    let own = f32s(
        plain_w
            .clone()
            .matmul(plain_w.clone())
            .sum_dim(0)
            .into_data(),
    );
    let theirs: Vec<Vec<f32>> = (0..16)
        .map(|k| {
            f32s(
                (plain_w.clone() + k as f32)
                    .matmul(plain_w.clone())
                    .sum_dim(1)
                    .into_data(),
            )
        })
        .collect();
    for round in 0..if short() { 2 } else { 8 } {
        rayon::scope(|s| {
            s.spawn(|s| {
                let w = matrix::<Ours>(48, 48, 3, &device);
                for (k, expected) in theirs.iter().enumerate() {
                    let w = w.clone();
                    s.spawn(move |_| {
                        let read = (w.clone() + k as f32).matmul(w).sum_dim(1).into_data();
                        let what = format!("round {round}, job {k}");
                        assert_same(&f32s(read), expected, &what);
                    });
                }
                for step in 0..16 {
                    let read = w.clone().matmul(w.clone()).sum_dim(0).into_data();
                    let what = format!("round {round}, the spawning job, step {step}");
                    assert_same(&f32s(read), &own, &what);
                }
            });
        });
    }
}

/// Joins and scopes nested four deep, each level computing with its parent's tensors (made on
/// another worker, often still pending there) and reading its children's results.
fn nested_joins_and_scopes() {
    fn level<B: Backend>(t: Tensor<B, 2>, depth: usize) -> f32 {
        let here = t.clone().matmul(t.clone()) * 0.5;
        if depth == 0 {
            return here.sum().into_scalar().elem();
        }
        let (a, b) = rayon::join(
            || level(here.clone(), depth - 1),
            || level(here.clone() + 1.0, depth - 1),
        );
        let mut c = 0.0;
        rayon::scope(|s| {
            s.spawn(|_| c = level(t.clone() * -1.0, depth - 1));
        });
        a + b + c + here.sum().into_scalar().elem::<f32>()
    }
    use burn_tensor::ElementConversion;
    let device = Default::default();
    let expected = level(matrix::<Plain>(16, 16, 4, &device) * 0.125, 4);
    for round in 0..4 {
        let ours = level(matrix::<Ours>(16, 16, 4, &device) * 0.125, 4);
        assert_same(&[ours], &[expected], &format!("round {round}"));
    }
}

/// After the programs, a sync from this thread covers every stream of the device, including the
/// streams of rayon's workers, now idle: nothing is held.
fn assert_the_device_is_clean() {
    let device = Default::default();
    Ours::sync(&device).expect("sync");
    let stats = Ours::client(&device).stats();
    assert!(
        stats.is_quiescent(),
        "after B::sync the engine holds {stats:?}"
    );
    if !cfg!(feature = "cuda") {
        // NdArray's batches holding a matmul, a convolution or a pooling went to the batch pool,
        // and where jobs shared a busy thread's tensors, some ran detached from their stream.
        assert!(stats.batches_detached > 0, "{stats:?}");
        assert!(stats.batches_pooled > stats.batches_detached, "{stats:?}");
    }
}

fn run_every_program() {
    for (name, program) in PROGRAMS {
        let start = std::time::Instant::now();
        watchdog(name, program);
        eprintln!("{name}: {:.1} s", start.elapsed().as_secs_f64());
    }
    assert_the_device_is_clean();
}

#[test]
#[cfg_attr(
    feature = "cuda",
    ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"
)]
fn on_the_default_global_pool() {
    if std::env::var_os(POOL_VAR).is_some() {
        return;
    }
    run_every_program();
}

/// The same programs in a child process whose rayon global pool has two threads: every job that
/// waits holds one of the only two workers.
#[test]
#[cfg_attr(
    feature = "cuda",
    ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"
)]
fn on_a_two_thread_global_pool() {
    if std::env::var_os(POOL_VAR).is_some() {
        return;
    }
    let status = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args(["--exact", "child", "--include-ignored", "--nocapture"])
        .env(POOL_VAR, "2")
        .status()
        .expect("running this binary again");
    assert!(
        status.success(),
        "the programs failed on a two-thread global pool: {status}"
    );
}

/// The child of [`on_a_two_thread_global_pool`] (does nothing unless [`POOL_VAR`] is set).
#[test]
#[ignore = "run by on_a_two_thread_global_pool, in a child process"]
fn child() {
    let Some(threads) = std::env::var_os(POOL_VAR) else {
        return;
    };
    let threads: usize = threads
        .to_str()
        .and_then(|t| t.parse().ok())
        .expect(POOL_VAR);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .expect("the first use of rayon's global pool in this process");
    assert_eq!(rayon::current_num_threads(), threads);
    run_every_program();
}

/// Where a batch runs: on the engine's batch pool when it holds an operation that spreads over
/// rayon (burn-ndarray's default), on the draining thread otherwise or when the backend is set
/// to run in place. NdArray only (a CUDA stream fuses, and runs every batch in place).
#[cfg(not(feature = "cuda"))]
mod placement {
    use std::sync::{Arc, Mutex};

    use burn_backend::DType;
    use burn_ir::{CustomOpIr, HandleContainer};
    use burn_ndarray::NdArray;
    use burn_tensor::{Tensor, TensorData, TensorPrimitive};
    use fusion_streams::Error;
    use fusion_streams::backend::{BatchPlacement, IrBackend, StreamFusion, set_batch_placement};

    /// Set to run in place (its own type: a placement is read when a backend's engine opens).
    type InPlace = NdArray<f32, i32>;

    /// What an operation queued behind a matmul saw: the name of the thread it ran on, and what
    /// a call back into the engine returned.
    type Seen = (Option<String>, Result<(), Error>);

    /// Queue a matmul, then a custom operation that notes where it runs and calls back into the
    /// engine; read the operation's output (which runs both as one batch).
    fn after_a_matmul<B: IrBackend>() -> Seen {
        type Ours<B> = StreamFusion<B>;
        let device = Default::default();
        let client = StreamFusion::<B>::client(&device);
        let a = Tensor::<Ours<B>, 2>::from_data(TensorData::new(vec![1.0f32; 4], [2, 2]), &device);
        let product = a.clone().matmul(a).into_primitive().tensor();
        let seen: Arc<Mutex<Option<Seen>>> = Arc::default();
        let (inner, seen_there) = (client.clone(), seen.clone());
        let out = client
            .op("notes_where_it_runs")
            .read(&product)
            .output([1], DType::F32)
            .execute(move |_: &CustomOpIr, _: &mut HandleContainer<_>| {
                let call = inner.fill([1], 0.0, DType::F32).map(drop);
                let name = std::thread::current().name().map(str::to_owned);
                *seen_there.lock().unwrap() = Some((name, call));
                Err(Error::operation("notes_where_it_runs", "stops here"))
            })
            .map_err(|rejected| rejected.error)
            .unwrap()
            .remove(0);
        let error = Tensor::<Ours<B>, 1>::from_primitive(TensorPrimitive::Float(out))
            .try_into_data()
            .unwrap_err()
            .to_string();
        assert!(error.contains("stops here"), "{error}");
        let product = Tensor::<Ours<B>, 2>::from_primitive(TensorPrimitive::Float(product));
        assert_eq!(
            product.into_data().to_vec::<f32>().unwrap(),
            vec![2.0f32; 4]
        );
        let seen = seen.lock().unwrap().take();
        seen.expect("the custom operation did not run")
    }

    /// burn-ndarray's default: a batch with a matmul runs on the batch pool, where an operation
    /// calling back into the engine is refused as on the draining thread.
    #[test]
    fn a_batch_with_a_matmul_runs_on_the_batch_pool() {
        let (thread, call) = after_a_matmul::<NdArray<f32>>();
        let thread = thread.unwrap_or_default();
        assert!(
            thread.starts_with("fusion-streams-batch-"),
            "ran on {thread:?}"
        );
        assert!(matches!(call, Err(Error::Reentrant { .. })), "{call:?}");
    }

    /// Set to run in place, the same batch runs on the draining thread, with the same refusal.
    #[test]
    fn a_backend_set_to_run_in_place_runs_its_batches_on_the_draining_thread() {
        set_batch_placement::<InPlace>(BatchPlacement::InPlace);
        let here = std::thread::current().name().map(str::to_owned);
        let (thread, call) = after_a_matmul::<InPlace>();
        assert_eq!(thread, here);
        assert!(matches!(call, Err(Error::Reentrant { .. })), "{call:?}");
    }

    /// A thread that exits with a matmul still queued runs it on its way out (the service thread
    /// drains its stream, through the batch pool), and the tensor it sent away reads.
    #[test]
    fn a_batch_queued_at_thread_exit_runs_on_its_way_out() {
        let moved = std::thread::spawn(|| {
            let a = Tensor::<StreamFusion<NdArray<f32>>, 2>::from_data(
                [[1.0f32, 2.0], [3.0, 4.0]],
                &Default::default(),
            );
            a.clone().matmul(a)
        })
        .join()
        .unwrap();
        let values = moved.into_data().to_vec::<f32>().unwrap();
        assert_eq!(values, vec![7.0f32, 10.0, 15.0, 22.0]);
    }
}
