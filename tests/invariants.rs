//! One test per invariant of the engine (`MultiStream`'s rustdoc lists them). Each would fail
//! if the invariant were broken.

mod common;

use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn_backend::{DType, StreamId, TensorData};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorId};
use common::*;
use fusion_streams::host::HostHandle;
use fusion_streams::{Error, Operand, Pending};

fn ids_in(pending: &[Pending]) -> Vec<TensorId> {
    let mut ids = Vec::new();
    for entry in pending {
        match entry {
            Pending::Operation(op) => ids.extend(op.nodes().into_iter().map(|t| t.id)),
            Pending::Drop(id) => ids.push(*id),
            _ => unreachable!(),
        }
    }
    ids
}

/// Stream locality: a queue only ever holds ids whose home is that stream; crossing streams goes
/// through a new alias id.
#[test]
fn stream_locality_foreign_ids_never_enter_a_queue() {
    let c = client();
    let main = StreamId::current();
    let x = f32s(&c, &[1.0, 2.0, 3.0]);
    let y = x.scale(2.0).unwrap(); // pending on main
    let peer = Peer::spawn();
    let peer_stream = peer.stream();

    let (y2, c2) = (y.clone(), c.clone());
    let (z, view_ids) = peer.run(move || {
        // y is foreign here: both operand uses go through views.
        let z = y2.add(&y2).unwrap();
        let pending = c2.streams().pending(StreamId::current()).unwrap();
        (z, ids_in(&pending))
    });

    assert!(!view_ids.contains(&y.id()), "peer queue names main's id");
    assert!(!view_ids.contains(&x.id()));
    for id in &view_ids {
        // Every id in peer's queue is peer's: registered there, or produced by its queue.
        assert!(
            c.streams().holds(peer_stream, *id).unwrap() || *id == z.id(),
            "{id} in peer's queue is not homed on peer"
        );
        assert!(
            !c.streams().holds(main, *id).unwrap(),
            "{id} is held by main"
        );
    }
    for id in ids_in(&c.streams().pending(main).unwrap()) {
        assert!(!c.streams().holds(peer_stream, id).unwrap());
    }
    assert_eq!(values(&z), vec![4.0, 8.0, 12.0]);
}

/// SSA outputs: every op output is a fresh id; a registered handle is never overwritten.
#[test]
fn ssa_outputs_are_fresh_and_handles_never_overwritten() {
    let c = client();
    let x = f32s(&c, &[1.0, 2.0]);
    let mut seen = std::collections::HashSet::new();
    seen.insert(x.id());
    let mut chain = vec![x.clone()];
    for i in 0..200 {
        let next = chain.last().unwrap().scale(1.0 + (i % 3) as f64).unwrap();
        assert!(seen.insert(next.id()), "output id {} reused", next.id());
        chain.push(next);
    }
    // Reading every tensor after everything ran: each id still holds its own value, so no later
    // op overwrote an earlier output.
    let mut expected = vec![1.0f32, 2.0];
    assert_eq!(values(&chain[0]), expected);
    for (i, t) in chain.iter().enumerate().skip(1) {
        let f = 1.0 + ((i - 1) % 3) as f32;
        expected = expected.iter().map(|v| v * f).collect();
        assert_eq!(values(t), expected, "tensor {i}");
    }
}

/// Materialise before alias: a share of a source with no handle yet drains the source's stream
/// first; later shares of the same source skip the drain.
#[test]
fn materialise_before_alias_drains_once_per_source() {
    let c = client();
    let x = f32s(&c, &[1.0, 2.0]);
    let y = x.scale(3.0).unwrap();
    assert!(!c.streams().holds(StreamId::current(), y.id()).unwrap());

    let (a, b) = (Peer::spawn(), Peer::spawn());
    let y1 = y.clone();
    let v1 = a.run(move || y1.clone());
    assert!(
        c.streams().holds(StreamId::current(), y.id()).unwrap(),
        "drained"
    );
    assert_eq!(c.stats().share_drains, 1);
    assert_eq!(c.stats().shared_sources, 1);

    let y2 = y.clone();
    let v2 = b.run(move || y2.clone());
    let s = c.stats();
    assert_eq!(s.share_drains, 1, "second share skipped the drain");
    assert_eq!(s.shares, 2);
    assert_eq!(s.share_fast_paths, 1);
    assert_eq!(values(&v1), vec![3.0, 6.0]);
    assert_eq!(values(&v2), vec![3.0, 6.0]);
}

/// Bounded `shared_sources`: an entry leaves when the id's last live tensor goes away — by a drop,
/// a foreign drop, a consuming use or a consuming read. Counted over many iterations.
#[test]
fn shared_sources_is_bounded_by_live_shared_tensors() {
    let c = client();
    let x = f32s(&c, &[1.0, 2.0, 3.0]);
    let peer = Peer::spawn();
    let mut max_seen = 0;
    for i in 0..200 {
        let y = x.scale(i as f64).unwrap(); // pending
        let y2 = y.clone();
        let view = peer.run(move || y2.clone()); // drains, y enters shared_sources
        assert_eq!(c.stats().shared_sources, 1);
        match i % 4 {
            // Drop on the home thread.
            0 => drop(y),
            // Foreign drop.
            1 => peer.run(move || drop(y)),
            // Consuming (ReadWrite) use.
            2 => {
                let z = c.launch(
                    fusion_streams::runtime::Kernel::Exp,
                    vec![Operand::Consume(y)],
                );
                drop(z.unwrap());
            }
            // Consuming read.
            _ => assert_eq!(y.into_data().unwrap().to_vec::<f32>().unwrap()[0], i as f32),
        }
        let now = c.stats().shared_sources;
        assert_eq!(now, 0, "iteration {i}: entry left with the last tensor");
        max_seen = max_seen.max(now);
        drop(view);
    }
    assert_eq!(max_seen, 0);
    drop(x);
    peer.join();
    assert_nothing_held(&c);
}

/// Frees on the home stream: on the home thread the last drop enqueues a drop; from any other
/// thread it is a foreign drop that never touches the home queue.
#[test]
fn home_drops_enqueue_and_foreign_drops_never_touch_the_queue() {
    let c = client();
    let main = StreamId::current();
    let x = f32s(&c, &[1.0]);
    let y = f32s(&c, &[2.0]);
    let pending_op = x.scale(2.0).unwrap();

    let x_id = x.id();
    drop(x);
    assert_eq!(
        c.streams().pending(main).unwrap().last(),
        Some(&Pending::Drop(x_id)),
        "home drop is queued behind the pending op"
    );
    let queued = c.streams().pending(main).unwrap();

    let peer = Peer::spawn();
    let y_id = y.id();
    peer.run(move || drop(y));
    assert_eq!(
        c.streams().pending(main).unwrap(),
        queued,
        "foreign drop left the queue alone"
    );
    let s = c.stats();
    assert_eq!((s.home_drops, s.foreign_drops), (1, 1));
    // Main has pending work, but none of it reads y: the foreign free happens at once.
    assert!(!c.streams().holds(main, y_id).unwrap());
    assert_eq!(s.deferred_frees, 0);
    assert_eq!(values(&pending_op), vec![2.0]);
    assert!(!c.streams().holds(main, y_id).unwrap());
    assert!(!c.streams().holds(main, x_id).unwrap());
}

/// Errors travel with data: the failing op's outputs carry the error, downstream ops are skipped
/// and propagate it, a share carries it, the read returns it, and `drain` reports nothing.
#[test]
fn errors_travel_with_the_data_to_the_read() {
    let c = client();
    let x = f32s(&c, &[1.0]);
    let bad = failing_op(&c, "boom", &x, "injected failure");
    let downstream = bad.scale(2.0).unwrap().add(&x).unwrap();
    let healthy = x.scale(5.0).unwrap();
    c.drain(); // reports nothing
    let err = downstream.read().unwrap_err();
    assert_propagated(&err, &Error::operation("boom", "injected failure"), "scale");
    assert_eq!(values(&healthy), vec![5.0]);
    let s = c.stats();
    assert_eq!((s.ops_failed, s.ops_skipped), (1, 2));

    let peer = Peer::spawn();
    let b2 = bad.clone();
    let shared_err = peer.run(move || b2.clone().read().unwrap_err());
    assert_eq!(
        &shared_err,
        err.root(),
        "a share carries the failure itself"
    );
}

/// Never wait on the device under the engine lock: while a read waits for a paused stream, other
/// threads can still register, share and drop on that stream.
#[test]
fn no_device_wait_happens_under_the_engine_lock() {
    let c = client();
    let x = f32s(&c, &[1.0, 2.0]);
    let pause = c.context().pause(c.execution_stream());
    let y = x.scale(2.0).unwrap();

    let (done_tx, done_rx) = channel();
    let y_reader = y.clone();
    let reader = std::thread::spawn(move || {
        let v = values(&y_reader); // drains main, then waits for the paused device
        done_tx.send(v).unwrap();
    });
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        done_rx.try_recv().is_err(),
        "the device is paused, the read must wait"
    );

    // Meanwhile: register on main, share main's tensors from another thread, drop on it.
    let more = x.add(&x).unwrap();
    let (tx, rx) = channel();
    let (x2, more2) = (x.clone(), more.clone());
    std::thread::spawn(move || {
        let view = x2.clone();
        drop(more2);
        drop(view);
        tx.send(()).unwrap();
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("engine blocked while the device was busy");

    drop(pause);
    assert_eq!(done_rx.recv().unwrap(), vec![2.0, 4.0]);
    reader.join().unwrap();
    assert_eq!(values(&more), vec![2.0, 4.0]);
}

/// Never deadlock on re-entrancy: an op that calls back into the client gets an error.
#[test]
fn reentrant_calls_get_an_error_not_a_deadlock() {
    let c = client();
    let x = f32s(&c, &[1.0]);
    let seen = Arc::new(Mutex::new(None));
    let (c2, seen2, x2) = (c.clone(), seen.clone(), x.clone());
    let out = c
        .op("reentrant")
        .read(&x)
        .output([1], DType::F32)
        .execute(move |_: &CustomOpIr, _: &mut HandleContainer<HostHandle>| {
            let upload = c2.from_data(TensorData::new(vec![0.0f32], [1]));
            let read = x2.read();
            let sync = c2.sync();
            *seen2.lock().unwrap() = Some((upload.is_err(), read.clone().err(), sync.err()));
            Err(read.unwrap_err())
        })
        .unwrap()
        .remove(0);
    let err = out.read().unwrap_err();
    assert!(matches!(err, Error::Reentrant { .. }), "{err:?}");
    let (upload_failed, read_err, sync_err) = seen.lock().unwrap().clone().unwrap();
    assert!(upload_failed);
    assert!(matches!(read_err, Some(Error::Reentrant { .. })));
    assert!(matches!(sync_err, Some(Error::Reentrant { .. })));
    // The engine still works.
    assert_eq!(values(&x.scale(2.0).unwrap()), vec![2.0]);
}

/// The operation IR recorded for built-ins is burn's.
#[test]
fn builtins_record_burn_ir() {
    let c = client();
    let x = f32s(&c, &[1.0]);
    let _y = x.exp().unwrap();
    let pending = c.streams().pending(StreamId::current()).unwrap();
    let [Pending::Operation(op)] = pending.as_slice() else {
        panic!("expected one queued operation, found {pending:?}");
    };
    assert!(matches!(
        **op,
        OperationIr::Float(DType::F32, burn_ir::FloatOperationIr::Exp(_))
    ));
}
