//! Fusers registered through `register_fuser`, as the engine calls them.
//!
//! * A run cut by a drain before its fuser closed it reaches [`Fuser::fuse_cut_run`] with whose
//!   drain cut it: the stream's own thread (a read) or another thread (a share of one of its
//!   tensors). A fuser that declines runs the whole cut run unfused, with the values of plain
//!   NdArray.
//! * A fuser is code the engine does not own: one that panics when offered an operation fails
//!   that operation, and nothing else (`a_fuser_that_panics_fails_only_the_operation_offered`).
//!
//! The backend types here, `NdArray<f32, i32>` and `NdArray<f32, i16>`, are used by no other test
//! of this binary: their engines get the fusers below through `register_fuser`.

use std::sync::{Mutex, Once};

use burn_ir::{HandleContainer, OperationIr};
use burn_ndarray::NdArray;
use burn_tensor::{Tensor, TensorData};
use fusion_streams::backend::{BackendContext, BackendRuntime, StreamFusion, register_fuser};
use fusion_streams::runtime::{Cut, Fuser};

type Plain = NdArray<f32, i32>;
type Ours = StreamFusion<Plain>;
type Handles = HandleContainer<<Plain as burn_ir::BackendIr>::Handle>;

/// The cuts the fusers of `Ours` were asked about, in order, with the number of entries each
/// cut run held.
static CUTS: Mutex<Vec<(Cut, usize)>> = Mutex::new(Vec::new());

/// The tests of this binary read [`CUTS`] whole: they take turns.
static TURN: Mutex<()> = Mutex::new(());

/// This test's turn (a test that failed before does not stop the others).
fn take_turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A fuser that takes every operation and declines every cut run, recording whose drain cut
/// it. Its runs are never closed, so it never executes one itself.
#[derive(Default)]
struct DeclineAndRecord {
    offered: usize,
}

impl Fuser<BackendRuntime<Plain>> for DeclineAndRecord {
    fn offer(&mut self, _: &OperationIr, _: &Handles) -> bool {
        self.offered += 1;
        true
    }

    fn covered(&self) -> usize {
        self.offered
    }

    fn execute(
        &mut self,
        _: &mut Handles,
        _: &BackendContext<Plain>,
    ) -> fusion_streams::Result<usize> {
        Err(fusion_streams::Error::InvalidOperation {
            op: "DeclineAndRecord".into(),
            detail: "asked to execute a run it declined or never closed".into(),
        })
    }

    fn reset(&mut self) {
        self.offered = 0;
    }

    fn fuse_cut_run(&mut self, cut: Cut) -> bool {
        CUTS.lock().unwrap().push((cut, self.offered));
        false
    }
}

fn client() -> fusion_streams::FusionClient<BackendRuntime<Plain>> {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        register_fuser::<Plain>(|_| Box::new(DeclineAndRecord::default()));
        // Every cut these tests count is one they make: no sweep of an idle stream while a
        // test thread is descheduled.
        let quiet = fusion_streams::EngineConfig::default()
            .with_max_idle_delay(std::time::Duration::from_secs(3600));
        assert!(
            Ours::configure(&Default::default(), quiet),
            "opened before its tests"
        );
    });
    Ours::client(&Default::default())
}

fn input<B: burn_backend::Backend>() -> Tensor<B, 1> {
    let v: Vec<f32> = (0..64).map(|i| (i % 9) as f32 / 4.0 - 1.0).collect();
    Tensor::from_data(TensorData::new(v, [64]), &Default::default())
}

/// What the program below computes, on any backend: a producer's two operations, a consumer's
/// two on the result, and the producer's own two more, read.
fn program<B: burn_backend::Backend>() -> (TensorData, TensorData) {
    let x = input::<B>();
    let y = x.clone() * 2.0 + 1.0;
    let consumed = std::thread::spawn(move || ((y + 1.0) * 3.0).into_data())
        .join()
        .unwrap();
    let own = ((x - 0.5) * 4.0).into_data();
    (consumed, own)
}

#[test]
fn a_share_cuts_as_foreign_and_a_read_as_own_and_declined_runs_are_unfused() {
    let _turn = take_turn();
    let client = client();
    let before = client.stats();
    CUTS.lock().unwrap().clear();
    let (consumed, own) = program::<Ours>();
    let cuts = CUTS.lock().unwrap().clone();
    // The consumer's share of `y` cuts the producer's open run of two operations (and the drop
    // of `y`'s first product, whose last reference went with them); the consumer's read cuts
    // its own run of two; the producer's read cuts its second run of two.
    let whose: Vec<Cut> = cuts.iter().map(|(cut, _)| *cut).collect();
    assert_eq!(whose, [Cut::Foreign, Cut::Own, Cut::Own], "{cuts:?}");
    assert!(cuts.iter().all(|(_, entries)| *entries >= 2), "{cuts:?}");
    let after = client.stats();
    assert_eq!(
        after.cut_runs_unfused - before.cut_runs_unfused,
        3,
        "{after:?}"
    );
    assert_eq!(after.fused_kernels, before.fused_kernels, "{after:?}");

    let (want_consumed, want_own) = program::<Plain>();
    assert_eq!(consumed, want_consumed);
    assert_eq!(own, want_own);
}

/// Another thread's share of a queued tensor runs the producer's queue only through that
/// tensor's producer: the operations recorded after it stay queued for the producer's thread,
/// and the cut run it hands the fuser ends at the shared tensor.
#[test]
fn another_threads_share_runs_the_queue_only_through_its_tensor() {
    let _turn = take_turn();
    let client = client();
    let here = burn_backend::StreamId::current();
    let program = |x: Tensor<Ours, 1>| {
        let y = x.clone() * 2.0 + 1.0;
        let z = (x - 0.5) * 4.0; // recorded after y's producer
        (y, z)
    };
    let (y, z) = program(input::<Ours>());
    let operations = |pending: Vec<fusion_streams::Pending>| {
        pending
            .into_iter()
            .filter(|p| matches!(p, fusion_streams::Pending::Operation(_)))
            .count()
    };
    assert_eq!(operations(client.streams().pending(here).unwrap()), 4);
    CUTS.lock().unwrap().clear();

    let consumed = std::thread::spawn(move || (y + 1.0).into_data())
        .join()
        .unwrap();
    assert_eq!(
        operations(client.streams().pending(here).unwrap()),
        2,
        "z's two operations are still queued"
    );
    let cuts = CUTS.lock().unwrap().clone();
    assert_eq!(cuts.first(), Some(&(Cut::Foreign, 2)), "{cuts:?}");
    let own = z.into_data();

    let x = input::<Plain>();
    let (y, z) = (x.clone() * 2.0 + 1.0, (x - 0.5) * 4.0);
    assert_eq!(consumed, (y + 1.0).into_data());
    assert_eq!(own, z.into_data());
}

/// A thread that exits with a run still open leaves it to the engine's service thread, and that
/// cut counts as foreign: a thread exits once, at a point its last drain decided (on a producer,
/// another thread's share), so a kernel built for the run would seldom run again.
#[test]
fn a_threads_exit_cuts_as_foreign() {
    let _turn = take_turn();
    let client = client();
    let x = input::<Ours>();
    let _ = x.clone().into_data(); // nothing of the main thread's left queued
    let before = client.stats();
    CUTS.lock().unwrap().clear();
    // Two operations recorded on the spawned thread's stream, nothing read there: its exit
    // drains them.
    let y = std::thread::spawn(move || (x * 2.0) + 1.0).join().unwrap();
    let cuts = CUTS.lock().unwrap().clone();
    let whose: Vec<Cut> = cuts.iter().map(|(cut, _)| *cut).collect();
    assert_eq!(whose, [Cut::Foreign], "{cuts:?}");
    assert!(cuts[0].1 >= 2, "{cuts:?}");
    let after = client.stats();
    assert_eq!(
        after.cut_runs_unfused - before.cut_runs_unfused,
        1,
        "{after:?}"
    );

    let want = (input::<Plain>() * 2.0 + 1.0).into_data();
    assert_eq!(y.into_data(), want);
}

/// A fuser that takes every operation but an `exp`, which it panics on, and declines every cut
/// run (so it is never asked to execute one).
#[derive(Default)]
struct PanicsOnExp {
    offered: usize,
}

/// Operations offered to every `PanicsOnExp`, over the process.
static OFFERED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

type Panicky = NdArray<f32, i16>;

impl Fuser<BackendRuntime<Panicky>> for PanicsOnExp {
    fn offer(
        &mut self,
        op: &OperationIr,
        _: &HandleContainer<<Panicky as burn_ir::BackendIr>::Handle>,
    ) -> bool {
        use burn_ir::{FloatOperationIr, OperationIr as Op};
        if let Op::Float(_, FloatOperationIr::Exp(_)) = op {
            panic!("the fuser fails on exp");
        }
        OFFERED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.offered += 1;
        true
    }

    fn covered(&self) -> usize {
        self.offered
    }

    fn execute(
        &mut self,
        _: &mut HandleContainer<<Panicky as burn_ir::BackendIr>::Handle>,
        _: &BackendContext<Panicky>,
    ) -> fusion_streams::Result<usize> {
        Err(fusion_streams::Error::InvalidOperation {
            op: "PanicsOnExp".into(),
            detail: "asked to execute a run it declined".into(),
        })
    }

    fn reset(&mut self) {
        self.offered = 0;
    }

    fn fuse_cut_run(&mut self, _: Cut) -> bool {
        false
    }
}

/// A panic in `Fuser::offer`, met when the operation is recorded (a fusing stream offers each
/// operation as it comes), took the stream's whole queue with it: every queued operation was
/// dropped unrun (their outputs read "no handle"), the fuser was lost, and a debug build
/// aborted on an underflow while unwinding. Now the operation offered fails with the panic, what
/// depends on it carries that error, and everything else on the stream runs and reads right,
/// with the fuser still offered what comes after.
#[test]
fn a_fuser_that_panics_fails_only_the_operation_offered() {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| register_fuser::<Panicky>(|_| Box::new(PanicsOnExp::default())));
    type Ours = StreamFusion<Panicky>;
    fn program<B: burn_backend::Backend>(
        x: Tensor<B, 1>,
    ) -> (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>) {
        let b = x * 2.0 + 1.0;
        let c = b.clone().exp(); // the fuser panics on this one
        let d = c.clone() + 1.0;
        let e = b.clone() * 3.0;
        (b, c, d, e)
    }
    let (b, c, d, e) = program(input::<Ours>());
    // Offered: the `* 2.0` and `+ 1.0` before the panic, and `e`'s `* 3.0` after it (`d` reads
    // the failed `c`, so it runs alone without being offered).
    let offered = OFFERED.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        offered, 3,
        "the fuser is still offered what comes after the panic"
    );
    let (want_b, _, _, want_e) = program(input::<Plain>());
    assert_eq!(b.into_data(), want_b.into_data());
    assert_eq!(e.into_data(), want_e.into_data());
    let failed = c.try_into_data().expect_err("the exp failed");
    assert!(
        failed.to_string().contains("the fuser fails on exp"),
        "{failed}"
    );
    let propagated = d.try_into_data().expect_err("what reads it fails");
    assert!(
        propagated.to_string().contains("the fuser fails on exp"),
        "{propagated}"
    );
    let stats = Ours::client(&Default::default()).stats();
    assert_eq!(stats.ops_failed, 1, "{stats:?}");
}
