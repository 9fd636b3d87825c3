//! Regression tests for the defects found by outside use (memory safety, engine re-entrancy,
//! rejected calls, executor destructors, thread teardown, foreign drops, orphan streams, short
//! buffers, consuming reads). Each test failed before its fix; its doc comment names the defect.

mod common;

use std::sync::mpsc::channel;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use burn_backend::{DType, StreamId};
use burn_ir::{CustomOpIr, OperationIr, TensorIr, UnaryOpIr};
use common::*;
use fusion_streams::host::{HostDevice, HostRuntime};
use fusion_streams::runtime::TransferRuntime;
use fusion_streams::transfer::PinnedHostBuffer;
use fusion_streams::{EngineConfig, Error, FallibleOperation, FusionClient, Operand};

/// Run `f` on its own thread; fail the test if it has not finished within `limit` (a deadlock
/// check, not a timing assertion: the limits are orders of magnitude above the work's cost).
fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(value) => value,
        Err(_) => panic!("{what}: no result after {limit:?} (deadlock or stranded work)"),
    }
}

/// Poll `done` until it holds, failing after `limit`.
fn eventually(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < limit,
            "{what}: still not true after {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

// ---------------------------------------------------------------------------------------------
// Memory safety: sizes computed from user input.

/// `PinnedHostBuffer::new(len)` rounded `len` up to a page with unchecked arithmetic: near
/// `usize::MAX` it wrapped to a zero-sized allocation reporting `len() == usize::MAX`, and
/// `as_bytes()` then read unmapped memory from safe code.
#[test]
fn a_pinned_buffer_of_an_impossible_length_is_a_typed_error() {
    for len in [
        usize::MAX,
        usize::MAX - 4095,
        usize::MAX / 2 + 1,
        isize::MAX as usize,
    ] {
        match PinnedHostBuffer::new(len) {
            Err(Error::TooLarge { .. } | Error::OutOfMemory { .. }) => {}
            other => panic!("PinnedHostBuffer::new({len}) gave {other:?}"),
        }
        let c = client();
        match HostRuntime::alloc_pinned(c.context(), len) {
            Err(Error::TooLarge { .. } | Error::OutOfMemory { .. }) => {}
            other => panic!("alloc_pinned({len}) gave {other:?}"),
        }
    }
    // Large but possible lengths still work, and are exactly as long as asked.
    let buffer = PinnedHostBuffer::new(3 * 4096 + 1).unwrap();
    assert_eq!(buffer.len(), 3 * 4096 + 1);
    assert_eq!(buffer.as_bytes().len(), 3 * 4096 + 1);
}

/// A shape whose element count overflows `usize` was accepted: in release builds `fill` gave an
/// empty tensor of that shape (and overflowed in debug builds). It is refused at registration.
#[test]
fn a_shape_whose_size_overflows_is_refused_at_registration() {
    let c = client();
    for shape in [
        vec![1usize << 62, 4],
        vec![usize::MAX, 2],
        vec![1 << 40, 1 << 40],
    ] {
        match c.fill(shape.clone(), 1.0, DType::F32) {
            Err(Error::TooLarge { .. }) => {}
            other => panic!("fill({shape:?}) gave {other:?}"),
        }
    }
    // The same through a custom operation's declared output.
    let x = f32s(&c, &[1.0]);
    let rejected = c
        .op("huge")
        .consume(x)
        .output([usize::MAX, 3], DType::F32)
        .execute(|_: &CustomOpIr, _: &mut Handles| Ok(()))
        .unwrap_err();
    assert!(
        matches!(rejected.error, Error::TooLarge { .. }),
        "{:?}",
        rejected.error
    );
    assert_eq!(
        values(&rejected.returned[0]),
        vec![1.0],
        "the operand comes back"
    );
}

/// A shape that fits in `usize` but not in memory aborted the process on the host runtime
/// (`fill([1 << 40])`: 4 TiB). The allocation is fallible now: the read reports the failure.
#[test]
fn an_allocation_larger_than_memory_is_an_error_on_the_tensor_not_an_abort() {
    let c = client();
    let huge = c.fill([1usize << 40], 1.0, DType::F32).unwrap();
    let downstream = huge.scale(2.0).unwrap();
    for t in [&huge, &downstream] {
        match t.read() {
            Err(Error::OutOfMemory { .. }) => {}
            other => panic!("read gave {:?}", other.map(|d| d.shape)),
        }
    }
    // The engine and the device keep working.
    assert_eq!(
        values(&f32s(&c, &[1.0, 2.0]).scale(3.0).unwrap()),
        vec![3.0, 6.0]
    );
    drop((huge, downstream));
    assert_nothing_held(&c);
}

// ---------------------------------------------------------------------------------------------
// The engine.

/// `stats()`, `holds()` and `pending()` called from inside an executor locked every stream,
/// including the one the executing thread holds: a self-deadlock. Two threads each inside an
/// executor calling `stats()` must not deadlock each other either.
#[test]
fn inspection_from_inside_an_executor_does_not_deadlock() {
    within(
        Duration::from_secs(30),
        "inspection inside executors",
        || {
            let c = client();
            let barrier = Arc::new(Barrier::new(2));
            let run = |c: Client, barrier: Arc<Barrier>| {
                let x = f32s(&c, &[1.0]);
                let inner = c.clone();
                let seen = Arc::new(Mutex::new(None));
                let seen2 = seen.clone();
                let out = c
                    .op("inspects")
                    .read(&x)
                    .output([1], DType::F32)
                    .execute(move |op: &CustomOpIr, handles: &mut Handles| {
                        barrier.wait(); // both threads are inside an executor now
                        let stats = inner.stats();
                        let holds = inner.streams().holds(StreamId::current(), op.inputs[0].id);
                        let pending = inner.streams().pending(StreamId::current());
                        *seen2.lock().unwrap() = Some((stats, holds, pending));
                        let input = handles.get_handle(&op.inputs[0].id, &op.inputs[0].status);
                        handles.register_handle(op.outputs[0].id, input);
                        Ok(())
                    })
                    .unwrap()
                    .remove(0);
                assert_eq!(values(&out), vec![1.0]);
                let (stats, holds, pending) = seen.lock().unwrap().take().expect("executor ran");
                // Inside the engine the executing stream cannot be inspected: it is reported as
                // skipped (stats) or as a re-entrant call (holds, pending), never waited for.
                assert!(stats.streams_skipped >= 1, "{stats:?}");
                assert!(matches!(holds, Err(Error::Reentrant { .. })), "{holds:?}");
                assert!(
                    matches!(pending, Err(Error::Reentrant { .. })),
                    "{pending:?}"
                );
            };
            let (c2, b2) = (c.clone(), barrier.clone());
            let other = std::thread::spawn(move || run(c2, b2));
            run(c.clone(), barrier);
            other.join().unwrap();
            // Outside the engine everything is inspectable again.
            let stats = c.stats();
            assert_eq!(stats.streams_skipped, 0);
            assert!(c.streams().pending(StreamId::current()).is_ok());
            assert!(
                c.streams()
                    .holds(StreamId::current(), burn_ir::TensorId::new(0))
                    .is_ok()
            );
        },
    );
}

/// A rejected `execute_operation` turned foreign operands into views before validating: a
/// borrowed foreign operand came back as an extra tensor, and a handed-over foreign tensor came
/// back as a different one (new id, new home). `returned` must be exactly what was handed over.
#[test]
fn a_rejected_operation_hands_back_exactly_the_tensors_given() {
    leak_checked(|c| {
        let peer = Peer::spawn();
        let c2 = c.clone();
        let (borrowed, handed) = peer.run(move || (f32s(&c2, &[1.0]), f32s(&c2, &[2.0])));
        let (handed_id, handed_stream) = (handed.id(), handed.stream());
        let local = f32s(&c, &[3.0]);
        let local_id = local.id();
        let before = c.stats();

        #[derive(Debug)]
        struct Never;
        impl FallibleOperation<HostRuntime> for Never {
            fn execute(&self, _: &mut Handles) -> fusion_streams::Result<()> {
                unreachable!("a rejected operation never runs")
            }
        }
        let rejected = c
            .op("bad_ir")
            .read(&borrowed)
            .consume(handed)
            .consume(local)
            .output([1], DType::F32)
            .execute_operation(|inputs: &[TensorIr], outputs: &[TensorIr]| {
                // Names only the first input: inconsistent with the registration.
                let repr = OperationIr::Float(
                    DType::F32,
                    burn_ir::FloatOperationIr::Exp(UnaryOpIr {
                        input: inputs[0].clone(),
                        out: outputs[0].clone(),
                    }),
                );
                (repr, Never)
            })
            .unwrap_err();
        assert!(matches!(rejected.error, Error::InvalidOperation { .. }));
        let returned: Vec<_> = rejected
            .returned
            .iter()
            .map(|t| (t.id(), t.stream()))
            .collect();
        assert_eq!(
            returned,
            vec![(handed_id, handed_stream), (local_id, StreamId::current())],
            "exactly the handed-over tensors, unchanged, in order"
        );
        assert_eq!(c.stats().shares, before.shares, "no view was minted");
        assert_eq!(values(&rejected.returned[0]), vec![2.0]);
        assert_eq!(values(&borrowed), vec![1.0]);
        // The same through `launch` with a bad arity, and `execute_burn`-style rejection paths share
        // the code above; a foreign consumed operand of a refused kernel also comes back unchanged.
        let rejected = c
            .launch(
                fusion_streams::runtime::Kernel::Add,
                [Operand::Consume(
                    rejected.returned.into_iter().next().unwrap(),
                )],
            )
            .unwrap_err();
        assert_eq!(
            rejected
                .returned
                .iter()
                .map(|t| (t.id(), t.stream()))
                .collect::<Vec<_>>(),
            vec![(handed_id, handed_stream)]
        );
        drop((rejected, borrowed));
        peer.join();
    });
}

/// An executor capture whose destructor panics was dropped outside the error scope: the panic
/// escaped into an unrelated read, the operations queued behind it vanished (their reads gave
/// `MissingHandle`) and a queued free never ran.
#[test]
fn a_panicking_capture_destructor_stays_inside_the_error_scope() {
    struct PanicsOnDrop;
    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("capture destructor panicked");
        }
    }
    let c = client();
    let x = f32s(&c, &[1.0, 2.0]);
    let capture = PanicsOnDrop;
    let first = custom_op(&c, "panicky_capture", &x, [2], move |op: &_, h: &mut _| {
        let _keep = &capture;
        pass_through(op, h)
    });
    let temporary = x.scale(10.0).unwrap();
    drop(temporary); // a queued free behind the panicking op
    let behind = x.scale(2.0).unwrap();
    // The read that drains the queue gets its own data, not someone else's panic.
    assert_eq!(values(&behind), vec![2.0, 4.0]);
    // The panic is reported where data went: on the op whose capture panicked.
    assert!(
        matches!(first.read(), Err(Error::OperationPanicked { ref message, .. }) if message.contains("capture destructor")),
        "{:?}",
        first.read()
    );
    drop((x, first, behind));
    assert_nothing_held(&c); // the queued free ran
}

thread_local! {
    static TEARDOWN: std::cell::RefCell<Option<Teardown>> = const { std::cell::RefCell::new(None) };
}

/// Engine work done by a thread-local destructor.
struct Teardown {
    client: Client,
    results: std::sync::mpsc::Sender<Tensor>,
}

impl Drop for Teardown {
    fn drop(&mut self) {
        // Runs during thread exit, after the engine's own exit hook: registers work on the
        // exiting thread's stream, hands one result out, consumes another in place.
        let local = f32s(&self.client, &[1.0, 2.0]);
        let out = local.scale(3.0).unwrap();
        let _ = self.results.send(out);
        let consumed = local.exp().unwrap().add(&local).unwrap();
        let _ = consumed.into_data();
        let dropped = local.scale(5.0).unwrap();
        drop((local, dropped));
    }
}

/// Work registered during thread teardown (a thread-local destructor running after the exit
/// hook) was stranded: a fresh stream with no exit hook, its ops and frees pending until someone
/// called `drain_all`.
#[test]
fn work_registered_during_thread_teardown_runs_and_nothing_stays_pending() {
    let c = client();
    let (tx, rx) = channel();
    let c2 = c.clone();
    std::thread::spawn(move || {
        // Registered before the engine's own thread-locals, so destroyed after them.
        TEARDOWN.with(|t| {
            *t.borrow_mut() = Some(Teardown {
                client: c2.clone(),
                results: tx,
            })
        });
        let warm_up = f32s(&c2, &[0.0]).scale(1.0).unwrap();
        assert_eq!(values(&warm_up), vec![0.0]);
    })
    .join()
    .unwrap();
    let out = rx.recv().expect("the destructor ran");
    let stats = c.stats();
    assert_eq!(
        stats.pending_ops, 0,
        "nothing pending once the thread is gone: {stats:?}"
    );
    assert_eq!(stats.deferred_frees_pending, 0, "{stats:?}");
    assert_eq!(values(&out), vec![3.0, 6.0]);
    drop(out);
    settle(&c);
    let stats = c.stats();
    assert!(stats.is_quiescent(), "{stats:?}");
    assert_eq!(
        stats.streams, 0,
        "the exited thread's streams were retired: {stats:?}"
    );
    assert_eq!(host(&c).live_buffers(), 0);
}

/// A foreign drop was deferred whenever the home queue held any operation, even one that does not
/// read the dropped tensor.
#[test]
fn a_foreign_drop_frees_at_once_when_no_pending_op_reads_it() {
    let c = client();
    let home = Peer::spawn();
    let c2 = c.clone();
    let (moved, other, unrelated) = home.run(move || {
        let moved = f32s(&c2, &[1.0]);
        let other = f32s(&c2, &[2.0]);
        let unrelated = other.scale(2.0).unwrap(); // pending on the home stream
        (moved, other, unrelated)
    });
    let frees = c.stats().frees;
    drop(moved); // foreign drop: nothing pending reads it
    let stats = c.stats();
    assert_eq!(stats.deferred_frees_pending, 0, "{stats:?}");
    assert_eq!(stats.frees, frees + 1, "freed at once: {stats:?}");
    assert_eq!(
        stats.pending_ops, 1,
        "the unrelated op is still lazy: {stats:?}"
    );
    drop((other, unrelated));
    home.join();
    assert_nothing_held(&c);
}

/// With a pending reader the free must wait, but an idle home thread held it forever. The delay
/// is bounded by `EngineConfig::max_deferred_free_delay`: after it, the engine's service thread
/// runs the home stream's pending segment.
#[test]
fn a_deferred_free_under_an_idle_home_thread_happens_within_the_bound() {
    let c = FusionClient::<HostRuntime>::with_config(
        HostDevice::default(),
        EngineConfig::default()
            .with_max_queue_len(1024)
            .with_max_deferred_free_delay(Duration::from_millis(20)),
    )
    .unwrap();
    let home = Peer::spawn();
    let c2 = c.clone();
    let (moved, reader) = home.run(move || {
        let moved = f32s(&c2, &[4.0]);
        let reader = moved.scale(0.5).unwrap(); // pending, reads `moved`
        (moved, reader)
    });
    drop(moved); // foreign drop under a pending reader: deferred
    assert_eq!(c.stats().deferred_frees, 1);
    // The home thread stays idle (blocked in its job queue). The free still happens.
    eventually(
        Duration::from_secs(20),
        "deferred free under an idle home",
        || c.stats().deferred_frees_pending == 0,
    );
    assert_eq!(
        values(&reader),
        vec![2.0],
        "the pending reader saw the value"
    );
    drop(reader);
    home.join();
    assert_nothing_held(&c);
}

/// An inbox `Free` (a drop posted from inside an executor) emptied an orphaned stream without
/// retiring it: the exited thread's stream stayed in the engine forever.
#[test]
fn an_orphan_emptied_by_a_posted_free_is_retired() {
    leak_checked(|c| {
        let c2 = c.clone();
        let x = f32s(&c, &[1.0]);
        let orphaned = std::thread::spawn(move || f32s(&c2, &[7.0]))
            .join()
            .unwrap();
        let streams_with_orphan = c.stats().streams;
        assert_eq!(streams_with_orphan, 2, "this thread's and the orphan");
        let slot = Arc::new(Mutex::new(Some(orphaned)));
        let slot2 = slot.clone();
        let out = custom_op(&c, "drops_inside", &x, [1], move |op: &_, h: &mut _| {
            drop(slot2.lock().unwrap().take()); // the orphan's last tensor, dropped in the engine
            pass_through(op, h)
        });
        assert_eq!(values(&out), vec![1.0]);
        assert!(slot.lock().unwrap().is_none());
        assert_eq!(
            c.stats().streams,
            streams_with_orphan - 1,
            "the emptied orphan is retired"
        );
    });
}

/// A custom op that registered a buffer smaller than its declared output made `read()` panic
/// inside burn's `TensorData::new`.
#[test]
fn a_custom_op_output_smaller_than_its_shape_is_a_typed_error_on_read() {
    leak_checked(|c| {
        let x = f32s(&c, &[1.0, 2.0]);
        // The input's 2 elements become the [4] output.
        let out = custom_op(&c, "short_output", &x, [4], pass_through);
        assert!(
            matches!(
                out.read(),
                Err(Error::BufferSize {
                    expected: 16,
                    found: 8
                })
            ),
            "{:?}",
            out.read()
        );
    });
}

/// A consuming read (`into_data`) on the home thread queued the id's free behind the stream's
/// work even when nothing queued still read it, so the engine held a second owner of the buffer
/// through the read. A backend that hands a buffer it owns alone over instead of copying it
/// (NdArray under `StreamFusion`) copied every result it returned instead, element by element:
/// 60 times slower on a 2 Mi-element result than plain NdArray (`softmax/4096` in
/// `benches/backend.rs`: 0.24 of plain's speed). Now the reader takes the stream's own handle,
/// and the id is freed in the same step.
#[test]
fn a_consuming_read_with_nothing_queued_takes_the_handle_itself() {
    leak_checked(|c| {
        let x = f32s(&c, &[1.0, 2.0]);
        let y = x.scale(2.0).unwrap();
        let before = c.stats();
        assert_eq!(y.into_data().unwrap().to_vec::<f32>().unwrap(), [2.0, 4.0]);
        let after = c.stats();
        assert_eq!(after.pending_ops, 0, "no free queued behind: {after:?}");
        assert_eq!(after.live_handles, 1, "only `x` is left: {after:?}");
        assert_eq!(
            after.frees,
            before.frees + 1,
            "freed with the read: {after:?}"
        );
        assert_eq!(after.home_drops, before.home_drops + 1, "{after:?}");
        // A shared view keeps the buffer: the reader of the last tensor of one id takes that id's
        // handle, a second owner of the buffer.
        let z = x.scale(3.0).unwrap();
        let z_elsewhere = Peer::spawn();
        let view = z_elsewhere.run({
            let z = z.clone();
            move || z.clone()
        });
        assert_eq!(z.into_data().unwrap().to_vec::<f32>().unwrap(), [3.0, 6.0]);
        assert_eq!(values(&view), [3.0, 6.0]);
        drop((x, view));
        z_elsewhere.join();
    });
}

/// A share from another thread drains the home stream through the shared tensor's producer and
/// leaves the rest queued for the home thread. The home thread's drops queued behind it stayed
/// queued too, so a home thread that then blocked (a producer waiting on its channel) held
/// every buffer it had dropped until its next call into the engine: forever, if none came.
#[test]
fn drops_queued_behind_a_shared_tensor_are_freed_by_the_share() {
    let c = client();
    let home = Peer::spawn();
    let c2 = c.clone();
    let shared = home.run(move || {
        let (a, b) = (f32s(&c2, &[1.0, 2.0]), f32s(&c2, &[3.0, 4.0]));
        let shared = a.scale(2.0).unwrap(); // pending, reads `a`
        drop((a, b)); // both drops queue behind it: nothing queued reads them any more
        shared
    });
    assert_eq!(
        c.stats().pending_ops,
        3,
        "the scale and two drops, queued at home"
    );
    // The home thread is idle now (blocked on its job queue). A share drains it.
    let view = shared.clone();
    let stats = c.stats();
    assert_eq!(
        stats.pending_ops, 0,
        "the share left work queued: {stats:?}"
    );
    settle(&c);
    assert_eq!(
        host(&c).live_buffers(),
        1,
        "only the shared result is allocated"
    );
    assert_eq!(values(&view), vec![2.0, 4.0]);
    drop((view, shared));
    home.join();
    assert_nothing_held(&c);
}

/// A thread that queued work and then blocked (a producer waiting on its channel, an idle rayon
/// worker) kept it queued, with every buffer it reads, until its next call into the engine:
/// `EngineStats::is_quiescent` stayed false for as long as the thread idled. The engine's
/// service thread now runs such a queue once the thread has recorded nothing for
/// `EngineConfig::max_idle_delay`.
#[test]
fn work_queued_by_a_thread_that_went_idle_runs_within_the_bound() {
    let c = FusionClient::<HostRuntime>::with_config(
        HostDevice::default(),
        lazy_config().with_max_idle_delay(Duration::from_millis(20)),
    )
    .unwrap();
    let home = Peer::spawn();
    let c2 = c.clone();
    home.run(move || {
        let a = f32s(&c2, &[1.0, 2.0]);
        let b = a.scale(2.0).unwrap();
        drop((a, b)); // a scale and two drops, queued; nothing else
    });
    // The home thread is blocked on its job queue: it will not call into the engine again.
    eventually(
        Duration::from_secs(20),
        "an idle thread's queue runs",
        || c.stats().pending_ops == 0,
    );
    let stats = c.stats();
    assert!(stats.idle_flushes >= 1, "{stats:?}");
    settle(&c);
    assert!(c.stats().is_quiescent(), "{:?}", c.stats());
    assert_eq!(host(&c).live_buffers(), 0);
    home.join();
}
