//! Tensors crossing threads, host-only cases: foreign operands, consumed views, thread exit,
//! the queue bound, panics, consuming reads. The cases that hold on every device (shares of
//! pending, materialised and chained sources; every drop order; deferred foreign drops) are in
//! `suite/`, run on the host by `suite_host.rs` and on burn backends (NdArray in CI, CUDA on a
//! GPU) by `suite_backend.rs`.

mod common;

use burn_backend::DType;
use burn_backend::StreamId;
use common::*;
use fusion_streams::runtime::Kernel;
use fusion_streams::{EngineConfig, FusionClient, Operand};

/// A tensor used as an operand on another thread goes through a view; the op on the other thread
/// consumes the view, never the original.
#[test]
fn foreign_operands_are_used_through_views() {
    let c = client();
    let x = f32s(&c, &[1.0, 2.0]);
    let y = x.scale(2.0).unwrap();
    let peer = Peer::spawn();
    let (y2, x2) = (y.clone(), x.clone());
    let z = peer.run(move || {
        let z = y2.mul(&x2).unwrap();
        drop((y2, x2));
        z
    });
    assert_eq!(values(&z), vec![2.0, 8.0]);
    assert_eq!(values(&y), vec![2.0, 4.0], "original unaffected");
    let s = c.stats();
    assert_eq!(s.shares, 2);
    assert_eq!(s.share_drains, 1);
}

/// A consumed foreign operand is handed over through its view: the original id is released
/// (foreign drop), the op consumes the view.
#[test]
fn consumed_foreign_operand_releases_the_original() {
    let c = client();
    let main = StreamId::current();
    let x = f32s(&c, &[1.0, 2.0]);
    let x_id = x.id();
    let peer = Peer::spawn();
    let z = peer.run(move || {
        let client = x.client().clone();
        client
            .launch(Kernel::Exp, vec![Operand::Consume(x)])
            .unwrap()
    });
    assert!(
        !c.streams().holds(main, x_id).unwrap(),
        "original freed by the foreign drop"
    );
    let got = values(&z);
    assert!((got[0] - 1f32.exp()).abs() < 1e-6 && (got[1] - 2f32.exp()).abs() < 1e-5);
}

/// A thread that exits with work queued has it run by its exit drain; nothing is left behind.
#[test]
fn thread_exit_drains_pending_work_and_deferred_frees() {
    let c = client();
    let c2 = c.clone();
    let (y, kept) = std::thread::spawn(move || {
        let x = f32s(&c2, &[1.0, 2.0]);
        let y = x.scale(4.0).unwrap();
        let kept = x.add(&x).unwrap();
        (y, kept) // x dropped here: a queued home drop
    })
    .join()
    .unwrap();
    let s = c.stats();
    assert_eq!(s.pending_ops, 0, "exit drain ran the queue");
    assert!(s.drains >= 1);
    assert_eq!(values(&y), vec![4.0, 8.0]);
    assert_eq!(values(&kept), vec![2.0, 4.0]);
    drop((y, kept)); // foreign drops into the exited thread's stream
    settle(&c);
    let s = c.stats();
    assert!(s.is_quiescent(), "{s:?}");
    // Main never registered anything (reads and foreign drops do not create a stream), and the
    // exited thread's stream was retired once its last tensor was gone.
    assert_eq!(s.streams, 0, "{s:?}");
    assert_eq!(host(&c).live_buffers(), 0);
}

/// A stream executes what it has once its queue reaches the configured bound.
#[test]
fn queue_executes_at_its_bound() {
    let c: Client = FusionClient::with_config(
        fusion_streams::host::HostDevice::default(),
        EngineConfig::default()
            .with_max_queue_len(4)
            .with_max_idle_delay(std::time::Duration::from_secs(3600)),
    )
    .unwrap();
    let x = f32s(&c, &[1.0]);
    let a = x.scale(2.0).unwrap();
    let b = a.scale(2.0).unwrap();
    let d = b.scale(2.0).unwrap();
    assert_eq!(c.stats().pending_ops, 3);
    assert_eq!(c.stats().lazy_flushes, 0);
    let e = d.scale(2.0).unwrap();
    let s = c.stats();
    assert_eq!((s.pending_ops, s.lazy_flushes, s.ops_executed), (0, 1, 4));
    assert_eq!(values(&e), vec![16.0]);
}

/// Drops during a panic (of the user's thread, and inside an executor) neither deadlock nor
/// abort, and leak nothing.
#[test]
fn drops_during_a_panic_do_not_deadlock_and_leak_nothing() {
    let c = client();
    let x = f32s(&c, &[1.0]);
    let (c2, x2) = (c.clone(), x.clone());
    let outcome = std::thread::spawn(move || {
        let pending = x2.scale(2.0).unwrap();
        let view_of_nothing = c2.fill([3], 1.0, burn_backend::DType::F32).unwrap();
        let _held = (pending, view_of_nothing, x2);
        panic!("user code panics while holding tensors");
    })
    .join();
    assert!(outcome.is_err());

    // An executor that panics while it owns tensors (dropped while unwinding under the lock).
    let captured = x.scale(1.0).unwrap();
    let out = c
        .op("panics")
        .read(&x)
        .output([1], burn_backend::DType::F32)
        .execute(
            move |_: &burn_ir::CustomOpIr,
                  _: &mut burn_ir::HandleContainer<fusion_streams::host::HostHandle>| {
                let _owned = captured.clone();
                panic!("executor panics")
            },
        )
        .unwrap()
        .remove(0);
    assert!(matches!(
        out.read().unwrap_err(),
        fusion_streams::Error::OperationPanicked { .. }
    ));
    drop((out, x));
    assert_nothing_held(&c);
}

/// Regression (found by the model test): a consuming read from a foreign thread released the
/// handle at once, while an operation still queued on the home stream read it.
#[test]
fn consuming_read_on_a_foreign_thread_waits_for_pending_readers() {
    leak_checked(|c| {
        let x = f32s(&c, &[1.0, 2.0]);
        let y = x.scale(3.0).unwrap(); // pending, reads x
        let peer = Peer::spawn();
        let read = peer.run(move || x.into_data().unwrap().to_vec::<f32>().unwrap());
        assert_eq!(read, vec![1.0, 2.0]);
        assert_eq!(
            values(&y),
            vec![3.0, 6.0],
            "the pending reader still found x"
        );
    });
}

/// Regression (found on the H200): a thread's exit drain ran its queued operations on the exiting
/// thread, while its thread-locals were being destroyed — cubecl's were already gone, and the
/// queued matmul panicked. Exit drains now run on the engine's service thread, and `join` still
/// returns only after them.
#[test]
fn exit_drain_runs_on_a_live_thread_before_join_returns() {
    let c = client();
    let ran_on = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
    let (c2, ran_on2) = (c.clone(), ran_on.clone());
    let out = std::thread::Builder::new()
        .name("exiting-worker".into())
        .spawn(move || {
            let x = f32s(&c2, &[1.0]);
            c2.op("records_its_thread")
                .read(&x)
                .output([1], burn_backend::DType::F32)
                .execute(
                    move |op: &burn_ir::CustomOpIr,
                          handles: &mut burn_ir::HandleContainer<
                        fusion_streams::host::HostHandle,
                    >| {
                        let name = std::thread::current().name().map(str::to_owned);
                        *ran_on2.lock().unwrap() = name;
                        let input = handles.get_handle(&op.inputs[0].id, &op.inputs[0].status);
                        handles.register_handle(op.outputs[0].id, input);
                        Ok(())
                    },
                )
                .unwrap()
                .remove(0) // still queued when the thread exits
        })
        .unwrap()
        .join()
        .unwrap();
    assert_eq!(
        ran_on.lock().unwrap().as_deref(),
        Some("fusion-streams-service"),
        "the queued op ran before join returned, on the service thread"
    );
    assert_eq!(values(&out), vec![1.0]);
}

/// A read on another thread held open inside its executor: while it is held, that thread holds
/// the stream's lock (it runs the stream's queue through the tensor it reads).
struct HeldDrain {
    held: Tensor,
    reader: std::thread::JoinHandle<Vec<f32>>,
    /// Lets the executor finish.
    release: std::sync::mpsc::Sender<()>,
    /// The engine's counters from before the reader started (taking them while it holds the
    /// lock would wait for it).
    before: fusion_streams::EngineStats,
}

/// Record a pass-through of `x` whose executor waits to be released, and read it on another
/// thread; returns once that thread is inside the executor.
fn hold_drain(c: &Client, x: &Tensor) -> HeldDrain {
    use std::sync::mpsc::channel;
    use std::time::Duration;

    let (entered_tx, entered) = channel();
    let (release, release_rx) = channel::<()>();
    let release_rx = std::sync::Mutex::new(release_rx);
    let held = custom_op(c, "held open", x, [2], move |op: &_, handles: &mut _| {
        entered_tx.send(()).unwrap();
        // A deadlock check, not a timing: whoever releases it does so at once when it can.
        release_rx
            .lock()
            .unwrap()
            .recv_timeout(Duration::from_secs(30))
            .expect("released");
        pass_through(op, handles)
    });
    let before = c.stats();
    let reader = {
        let held = held.clone();
        std::thread::spawn(move || values(&held))
    };
    entered
        .recv_timeout(Duration::from_secs(30))
        .expect("the reader drains the stream");
    HeldDrain {
        held,
        reader,
        release,
        before,
    }
}

/// While another thread holds a stream's lock (here: a read from that thread, running the
/// stream's queue through the tensor it needs, with the executor held open), the stream's own
/// thread keeps recording: its operations are handed over through the stream's lane instead of
/// waiting for the lock, and run in the order they were recorded, consumed operands and drops
/// included. Before records were handed over, the home thread waited out the whole drain (here:
/// forever, as the executor waits for the home thread; its deadline turns that into a failure).
#[test]
fn the_home_thread_records_while_another_thread_drains_its_stream() {
    records_while_another_thread_drains(client());
}

/// The same on a stream that fuses, which has no lane: its records go to the inbox. (Closed
/// runs are not dispatched at once here: the held-open operation, which no fuser takes, would
/// otherwise run at its record, on this thread.)
#[test]
fn a_fusing_home_thread_posts_while_another_thread_drains_its_stream() {
    let device = fusion_streams::host::HostDevice::default().fusing();
    let config = lazy_config().with_dispatch_closed_runs(false);
    records_while_another_thread_drains(FusionClient::with_config(device, config).unwrap());
}

fn records_while_another_thread_drains(c: Client) {
    let x = f32s(&c, &[1.0, 2.0]);
    let drain = hold_drain(&c, &x);

    // The reader's thread holds this stream's lock now: all of this is handed over.
    let y = x.scale(3.0).unwrap();
    let z = c
        .op("consumes y")
        .consume(y)
        .output([2], DType::F32)
        .execute(pass_through)
        .unwrap()
        .remove(0);
    let w = z.scale(2.0).unwrap();
    drop(x);
    drain.release.send(()).unwrap();

    assert_eq!(drain.reader.join().unwrap(), vec![1.0, 2.0]);
    let posted = c.stats().ops_posted - drain.before.ops_posted;
    assert_eq!(
        posted, 3,
        "the three operations were recorded without the lock"
    );
    assert_eq!(values(&w), vec![6.0, 12.0]);
    assert_eq!(values(&z), vec![3.0, 6.0]);
    drop((drain.held, z, w));
    assert_nothing_held(&c);
}

/// A thread hands over at most a queue bound's worth of records in a row without the lock: the
/// next one waits for it, so that what is pending stays bounded (handed-over records are never
/// run by whoever applies them) and the queue's bound is enforced on the home thread itself.
/// Here the bound is 3: the held-open operation (through the lane, before the reader took the
/// lock), `a` and `b` are handed over, and `d` waits.
#[test]
fn the_home_thread_posts_at_most_a_queue_bound_in_a_row() {
    use std::time::Duration;

    let c = FusionClient::with_config(
        fusion_streams::host::HostDevice::default(),
        lazy_config().with_max_queue_len(3),
    )
    .unwrap();
    let x = f32s(&c, &[1.0, 2.0]);
    let drain = hold_drain(&c, &x);
    let a = x.scale(2.0).unwrap();
    let b = a.scale(2.0).unwrap();
    // The fourth waits for the lock: let the reader go once this thread is (very likely)
    // waiting. Whether or not it got there first, the fourth record is never posted.
    let release = drain.release.clone();
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        release.send(()).unwrap();
    });
    let d = b.scale(2.0).unwrap();
    releaser.join().unwrap();
    assert_eq!(drain.reader.join().unwrap(), vec![1.0, 2.0]);
    assert_eq!(
        c.stats().ops_posted - drain.before.ops_posted,
        2,
        "two handed over while the reader held the lock, the next waited"
    );
    assert_eq!(values(&d), vec![8.0, 16.0]);
    drop((x, drain.held, a, b, d));
    assert_nothing_held(&c);
}

/// A posted record that reads a tensor, then that tensor's last drop on a third thread (posted
/// to the same inbox): the free is applied after the record, so it waits for the record's
/// operation, which reads the right values.
#[test]
fn a_foreign_last_drop_after_a_posted_record_waits_for_it() {
    let c = client();
    let x = f32s(&c, &[1.0, 2.0]);
    let drain = hold_drain(&c, &x);
    let y = x.scale(5.0).unwrap(); // posted: the reader holds this stream's lock
    // The last `x` goes on another thread: its free is posted behind the record.
    std::thread::spawn(move || drop(x)).join().unwrap();
    drain.release.send(()).unwrap();
    assert_eq!(drain.reader.join().unwrap(), vec![1.0, 2.0]);
    assert_eq!(values(&y), vec![5.0, 10.0]);
    let (before, after) = (drain.before, c.stats());
    assert_eq!(after.ops_posted - before.ops_posted, 1);
    assert_eq!(after.foreign_drops - before.foreign_drops, 1);
    assert_eq!(after.deferred_frees - before.deferred_frees, 1, "{after:?}");
    drop((drain.held, y));
    assert_nothing_held(&c);
}
