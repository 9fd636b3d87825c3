//! Execution streams ([`fusion_streams::FusionClient::execution_stream`]): a thread's work runs
//! on the backend stream a thread that exited gave back, wherever the work is executed.
//!
//! One test in its own binary: the ids are handed out process-wide, and another test's threads
//! taking or giving back ids in between would make "the next thread gets the id the last one gave
//! back" untrue.

mod common;

use std::sync::{Arc, Mutex};

use burn_backend::{DType, StreamId};
use common::*;
use fusion_streams::Pending;

/// Record `x`'s copy through a custom op that notes the stream cubecl would launch on.
fn noted_copy(c: &Client, x: &Tensor, seen: &Arc<Mutex<Vec<StreamId>>>) -> Tensor {
    let seen = seen.clone();
    c.op("noted copy")
        .read(x)
        .output(x.shape().clone(), DType::F32)
        .execute(move |op: &burn_ir::CustomOpIr, handles: &mut Handles| {
            seen.lock().unwrap().push(StreamId::current());
            let input = handles.get_handle(&op.inputs[0].id, &op.inputs[0].status);
            handles.register_handle(op.outputs[0].id, input);
            Ok(())
        })
        .expect("admitted")
        .remove(0)
}

#[test]
fn threads_reuse_the_execution_streams_of_threads_that_exited() {
    let c = client();
    let main_exec = c.execution_stream();
    assert_ne!(main_exec, StreamId::current(), "not the thread's own id");

    // A thread runs work, leaves a tensor with main (its stream is orphaned) and exits.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (c1, seen1) = (c.clone(), seen.clone());
    let (first, kept, first_stream) = std::thread::spawn(move || {
        let x = f32s(&c1, &[1.0, 2.0]);
        let y = noted_copy(&c1, &x, &seen1);
        assert_eq!(values(&y), vec![1.0, 2.0]);
        let kept = noted_copy(&c1, &y, &seen1); // still queued when the thread exits
        (c1.execution_stream(), kept, StreamId::current())
    })
    .join()
    .unwrap();
    assert_ne!(first, main_exec, "two live threads never share one");
    assert_eq!(
        kept.stream(),
        first_stream,
        "the engine names streams by thread"
    );

    // The next thread takes the id the first gave back, while the first's orphaned stream is
    // still alive (it holds `kept`).
    let (c2, seen2) = (c.clone(), seen.clone());
    let peer = Peer::spawn();
    let (second, produced) = peer.run(move || {
        let x = f32s(&c2, &[3.0]);
        let produced = noted_copy(&c2, &x, &seen2); // queued: main drains it below
        (c2.execution_stream(), produced)
    });
    assert_eq!(
        second, first,
        "a thread that exited gave its execution stream back"
    );
    let pending = c.streams().pending(produced.stream()).unwrap();
    assert!(
        pending.iter().any(|p| matches!(p, Pending::Operation(_))),
        "lazy: the copy waits for a drain ({pending:?})"
    );

    // Work runs on its stream's execution stream wherever it is executed: on its thread, on
    // the engine's service thread at the thread's exit (`kept`), on another thread that reads
    // (`produced`, drained by main while the peer is alive).
    assert_eq!(values(&kept), vec![1.0, 2.0]);
    assert_eq!(values(&produced), vec![3.0]);
    assert_eq!(*seen.lock().unwrap(), vec![first; 3]);
    peer.join();

    // Two threads alive at once have two execution streams.
    let (tx, rx) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let c3 = c.clone();
    let holder = std::thread::spawn(move || {
        tx.send(c3.execution_stream()).unwrap();
        let _ = released.recv();
    });
    let held = rx.recv().unwrap();
    let c4 = c.clone();
    let other = std::thread::spawn(move || c4.execution_stream())
        .join()
        .unwrap();
    assert_ne!(held, other);
    drop(release);
    holder.join().unwrap();

    drop((kept, produced));
    c.sync().unwrap();
    assert_nothing_held(&c);
}
