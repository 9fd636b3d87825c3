//! Batch runners: where a stream of `StreamFusion<B>` that does not fuse runs a batch of queued
//! operations holding one that spreads over the backend's thread pool (a matmul, a convolution,
//! a pooling...). burn-ndarray's default is one trip into rayon's pool per batch
//! (`backend::rayon_scope`); `register_batch_runner` sets another.
//!
//! Each test binary is its own process, and a backend's runner is read when its engine opens:
//! `NdArray<f32, i32>`, `<f32, i16>`, `<f32, i8>` and `<f32, u8>` (registered below, before
//! their first use) and `NdArray<f32>` (left at the default) are used by this file alone. All are
//! f32 backends: burn keeps a device's default float type per device, not per backend type, so
//! an f64 backend on the same CPU device would change what the others' `from_data` makes.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::thread::ThreadId;

use burn_backend::{DType, TensorData};
use burn_ir::{CustomOpIr, HandleContainer};
use burn_ndarray::NdArray;
use burn_tensor::activation::relu;
use burn_tensor::backend::Backend;
use burn_tensor::{Tensor, TensorPrimitive};
use fusion_streams::Error;
use fusion_streams::backend::{BatchRunner, StreamFusion, register_batch_runner};

/// Registered with a runner that moves every batch to a new thread.
type Moved = NdArray<f32, i32>;
/// Left at burn-ndarray's default runner.
type Unregistered = NdArray<f32>;

std::thread_local! {
    /// Batches this thread handed to `on_a_new_thread`.
    static HANDED: Cell<usize> = const { Cell::new(0) };
}

/// A runner that runs the batch on a thread of its own, and passes a panic on.
fn on_a_new_thread(batch: &mut (dyn FnMut() + Send)) {
    HANDED.with(|handed| handed.set(handed.get() + 1));
    std::thread::scope(|s| {
        if let Err(panic) = s.spawn(batch).join() {
            std::panic::resume_unwind(panic);
        }
    });
}

fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| register_batch_runner::<Moved>(Some(on_a_new_thread as BatchRunner)));
}

fn handed() -> usize {
    HANDED.with(Cell::get)
}

fn data(n: usize, seed: usize) -> TensorData {
    let values = (0..n)
        .map(|i| (((i * 31 + seed) % 17) as f32 - 8.0) / 64.0)
        .collect::<Vec<_>>();
    TensorData::new(values, [n])
}

/// A small MLP forward (two matmuls, a bias, a ReLU, a sum), read.
fn mlp<B: Backend>(device: &B::Device) -> TensorData {
    let tensor = |n, seed, shape: [usize; 2]| {
        Tensor::<B, 1>::from_data(data(n, seed), device).reshape(shape)
    };
    let (w1, w2, x) = (
        tensor(64 * 128, 1, [64, 128]),
        tensor(128 * 16, 2, [128, 16]),
        tensor(32 * 64, 3, [32, 64]),
    );
    let h = relu(x.matmul(w1) + 0.1);
    h.matmul(w2).sum_dim(1).into_data()
}

/// A batch with a matmul goes to the runner, whole, and computes what plain NdArray does, bit for
/// bit; a batch of elementwise operations runs in place.
#[test]
fn a_batch_with_a_matmul_goes_to_the_runner_and_computes_the_same() {
    setup();
    let device = Default::default();
    let before = handed();
    let ours = mlp::<StreamFusion<Moved>>(&device);
    assert!(handed() > before, "the forward's batch was not handed over");
    assert_eq!(ours, mlp::<Moved>(&device));

    let before = handed();
    let x = Tensor::<StreamFusion<Moved>, 1>::from_data(data(1024, 4), &device);
    let chain = ((x * 1.5).tanh() + 0.25).abs().into_data();
    assert_eq!(handed(), before, "a batch without a matmul was handed over");
    let x = Tensor::<Moved, 1>::from_data(data(1024, 4), &device);
    assert_eq!(chain, ((x * 1.5).tanh() + 0.25).abs().into_data());
}

/// What an operation of a handed-over batch sees: the thread it ran on, whether it ran on one of
/// rayon's workers, and what a call back into the engine returned.
type Seen = Arc<Mutex<Option<(ThreadId, bool, Result<(), Error>)>>>;

/// Queue a matmul, then a custom operation that records what it sees and calls back into the
/// engine; read the operation's output (which runs both as one batch) and return what it saw.
fn callback_after_a_matmul<B>(device: &B::Device) -> (ThreadId, bool, Result<(), Error>)
where
    B: fusion_streams::backend::IrBackend,
{
    type Ours<B> = StreamFusion<B>;
    let client = StreamFusion::<B>::client(device);
    client.drain();
    let a = Tensor::<Ours<B>, 2>::from_data(TensorData::new(vec![1.0f32; 4], [2, 2]), device);
    let product = a.clone().matmul(a).into_primitive().tensor();
    let seen: Seen = Arc::default();
    let (inner, seen_there) = (client.clone(), seen.clone());
    let out = client
        .op("calls_back")
        .read(&product)
        .output([1], DType::F32)
        .execute(move |_: &CustomOpIr, _: &mut HandleContainer<_>| {
            let call = inner.fill([1], 0.0, DType::F32).map(drop);
            let worker = rayon::current_thread_index().is_some();
            *seen_there.lock().unwrap() = Some((std::thread::current().id(), worker, call));
            Err(Error::KernelFailed {
                kernel: "calls_back".into(),
                message: "stops here".into(),
            })
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

/// On the runner's thread the batch is as much inside the engine as on the draining thread: an
/// operation that calls back into the engine is refused, not recorded on that thread's stream.
#[test]
fn an_operation_run_by_the_runner_cannot_call_back_into_the_engine() {
    setup();
    let before = handed();
    let (thread, _, call) = callback_after_a_matmul::<Moved>(&Default::default());
    assert!(handed() > before);
    assert_ne!(thread, std::thread::current().id(), "the batch stayed here");
    assert!(matches!(call, Err(Error::Reentrant { .. })), "{call:?}");
}

/// burn-ndarray's default: a batch with a matmul runs on one of rayon's workers.
#[test]
fn burn_ndarray_batches_run_in_rayons_pool_by_default() {
    let (thread, worker, call) = callback_after_a_matmul::<Unregistered>(&Default::default());
    assert!(worker, "not on a rayon worker");
    assert_ne!(thread, std::thread::current().id());
    assert!(matches!(call, Err(Error::Reentrant { .. })), "{call:?}");
    let ours = mlp::<StreamFusion<Unregistered>>(&Default::default());
    assert_eq!(ours, mlp::<Unregistered>(&Default::default()));
}

/// A panic out of a handed-over batch (here: of the runner's own thread, after the batch ran)
/// reaches the thread that drained the queue, and the stream keeps working.
#[test]
fn a_panic_on_the_runners_thread_reaches_the_reader() {
    type Panicky = NdArray<f32, i16>;
    fn run_then_panic(batch: &mut (dyn FnMut() + Send)) {
        on_a_new_thread(&mut || {
            batch();
            panic!("the runner failed");
        });
    }
    register_batch_runner::<Panicky>(Some(run_then_panic as BatchRunner));
    let device = Default::default();
    let a = Tensor::<StreamFusion<Panicky>, 2>::from_data([[1.0f32, 2.0], [3.0, 4.0]], &device);
    let product = a.clone().matmul(a.clone());
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| product.into_data()));
    let message = *caught.unwrap_err().downcast::<&str>().unwrap();
    assert_eq!(message, "the runner failed");
    // Elementwise work runs in place, and the tensor still reads.
    let doubled = (a * 2.0).into_data().to_vec::<f32>().unwrap();
    assert_eq!(doubled, vec![2.0, 4.0, 6.0, 8.0]);
}

/// A thread that exits with a matmul still queued runs it on its way out (from its thread-local
/// destructors), through the runner, and the tensor it sent away reads.
#[test]
fn a_batch_queued_at_thread_exit_runs_through_the_runner() {
    /// This test's own backend type and runner, so that no other test's batch counts.
    type Exiting = NdArray<f32, i8>;
    static EXIT_HANDED: AtomicUsize = AtomicUsize::new(0);
    fn counted(batch: &mut (dyn FnMut() + Send)) {
        EXIT_HANDED.fetch_add(1, Ordering::SeqCst);
        on_a_new_thread(batch);
    }
    register_batch_runner::<Exiting>(Some(counted as BatchRunner));
    fn sent_away<B: Backend>() -> Tensor<B, 2> {
        std::thread::spawn(|| {
            let a = Tensor::<B, 2>::from_data([[1.0f32, 2.0], [3.0, 4.0]], &Default::default());
            a.clone().matmul(a)
        })
        .join()
        .unwrap()
    }
    let expected = vec![7.0f32, 10.0, 15.0, 22.0];
    let moved = sent_away::<StreamFusion<Exiting>>();
    assert_eq!(
        EXIT_HANDED.load(Ordering::SeqCst),
        1,
        "the exiting thread did not hand its batch over"
    );
    assert_eq!(moved.into_data().to_vec::<f32>().unwrap(), expected);
    let default = sent_away::<StreamFusion<Unregistered>>().into_data();
    assert_eq!(default.to_vec::<f32>().unwrap(), expected);
}

/// A runner that breaks its contract, running the batch twice or not at all, still gets each
/// batch run exactly once: the results are plain NdArray's.
#[test]
fn a_batch_runs_once_whatever_the_runner_does() {
    type Careless = NdArray<f32, u8>;
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    fn twice_or_never(batch: &mut (dyn FnMut() + Send)) {
        if CALLS.fetch_add(1, Ordering::SeqCst).is_multiple_of(2) {
            batch();
            batch();
        }
    }
    register_batch_runner::<Careless>(Some(twice_or_never as BatchRunner));
    let device = Default::default();
    for _ in 0..4 {
        assert_eq!(
            mlp::<StreamFusion<Careless>>(&device),
            mlp::<Careless>(&device)
        );
    }
    assert!(CALLS.load(Ordering::SeqCst) >= 4);
}
