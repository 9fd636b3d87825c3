//! Fault injection on every error path. For each fault: the caller gets a typed error, every
//! owner is handed back or retained (never silently leaked, never freed twice), and the engine
//! keeps working for unrelated tensors and streams afterwards — checked by [`Bystanders`], which
//! holds tensors made *before* the fault on this thread and on another one, and by the final
//! leak check. docs/EVIDENCE.md's "Faults survived" table lists these tests.

mod common;

use std::time::Duration;

use burn_backend::{DType, TensorData};
use burn_ir::CustomOpIr;
use common::*;
use fusion_streams::Error;
use fusion_streams::host::HostRuntime;
use fusion_streams::transfer::{
    HeldSession, PinnedHostBuffer, PublicationAdmissionError, SourcePublication,
};

/// Tensors made before a fault, on this thread and on a peer (another stream).
struct Bystanders {
    client: Client,
    peer: Peer,
    local: Tensor,
    remote: Tensor,
}

impl Bystanders {
    fn new(client: &Client) -> Self {
        let peer = Peer::spawn();
        let c2 = client.clone();
        let remote = peer.run(move || f32s(&c2, &[10.0, 20.0]).scale(0.5).unwrap());
        Self {
            client: client.clone(),
            peer,
            local: f32s(client, &[1.0, 2.0]).scale(3.0).unwrap(),
            remote,
        }
    }

    /// The engine still works after the fault: old tensors read right on both threads, new work
    /// runs on both streams, and a share across them works.
    fn still_work(&self) {
        assert_eq!(values(&self.local), vec![3.0, 6.0]);
        assert_eq!(values(&self.remote), vec![5.0, 10.0]);
        let fresh = self.local.add(&self.remote).unwrap();
        assert_eq!(values(&fresh), vec![8.0, 16.0]);
        let (c2, shared) = (self.client.clone(), fresh.clone());
        let got = self.peer.run(move || {
            let on_peer = f32s(&c2, &[1.0, 1.0]);
            values(&shared.add(&on_peer).unwrap())
        });
        assert_eq!(got, vec![9.0, 17.0]);
    }

    /// Drop everything, end the peer, and check nothing is held beyond `retained` buffers.
    fn finish(self, retained: u64) {
        self.still_work();
        let Self {
            client,
            peer,
            local,
            remote,
        } = self;
        drop((local, remote));
        peer.join();
        client.streams().drain_all();
        settle(&client);
        client.context().retirement().sweep();
        assert!(client.stats().is_quiescent(), "{:?}", client.stats());
        assert_eq!(host(&client).live_buffers(), retained, "buffers held");
    }
}

/// Run `fault` on a fresh client with [`Bystanders`] made before it; once it returns (its
/// tensors dropped), check that they survived and that nothing is held beyond `retained` buffers.
fn survive(retained: u64, fault: impl FnOnce(Client, &Bystanders)) {
    let c = client();
    let by = Bystanders::new(&c);
    fault(c, &by);
    by.finish(retained);
}

fn failing_op(c: &Client, x: &Tensor, panic: bool) -> Tensor {
    let name = if panic { "panics" } else { "errors" };
    custom_op(c, name, x, x.shape().clone(), move |_: &_, _: &mut _| {
        if panic {
            panic!("injected panic");
        }
        Err(Error::operation("errors", "injected error"))
    })
}

/// An input, an operation over it that fails (an error, or a panic), and one that depends on it.
fn failure_and_dependant(c: &Client, panic: bool) -> (Tensor, Tensor, Tensor) {
    let x = f32s(c, &[1.0]);
    let failed = failing_op(c, &x, panic);
    let downstream = failed.exp().unwrap();
    (x, failed, downstream)
}

fn publish(
    session: &mut HeldSession<HostRuntime>,
    value: Tensor,
) -> SourcePublication<HostRuntime> {
    // SAFETY: produced by this crate's operations.
    unsafe { session.publish(value) }.expect("admitted")
}

#[test]
fn fault_an_operation_that_returns_an_error() {
    survive(0, |c, _| {
        let (x, failed, downstream) = failure_and_dependant(&c, false);
        let expected = Error::operation("errors", "injected error");
        assert_eq!(failed.read().unwrap_err(), expected);
        assert_propagated(&downstream.read().unwrap_err(), &expected, "exp");
        assert_eq!(values(&x), vec![1.0], "the input is untouched");
    });
}

#[test]
fn fault_an_operation_that_panics() {
    survive(0, |c, _| {
        let (_x, failed, downstream) = failure_and_dependant(&c, true);
        assert!(matches!(
            failed.read().unwrap_err(),
            Error::OperationPanicked { ref op, ref message } if &**op == "panics" && &**message == "injected panic"
        ));
        // The panic is contained, and what it skipped says why.
        let error = downstream.read().unwrap_err();
        assert!(error.is_propagated(), "{error:?}");
        assert_eq!(
            error.to_string(),
            "operation `panics` panicked: injected panic \
             (propagated: `exp` was skipped because its input carried this error)"
        );
    });
}

/// A panic payload is the panicking code's value, and its destructor is that code's too: one
/// that panics when the engine drops the payload must stay inside the operation's error scope,
/// and the operations queued behind it still run.
#[test]
fn fault_a_panic_whose_payload_panics_when_dropped() {
    struct Bomb;
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("dropping the payload");
        }
    }
    survive(0, |c, _| {
        let x = f32s(&c, &[1.0, 2.0]);
        let failed = custom_op(&c, "bomb", &x, [2], |_: &_, _: &mut _| {
            std::panic::panic_any(Bomb)
        });
        let behind = x.scale(3.0).unwrap();
        assert_eq!(values(&behind), vec![3.0, 6.0], "queued behind it, and run");
        assert!(matches!(
            failed.read().unwrap_err(),
            Error::OperationPanicked { ref op, ref message }
                if &**op == "bomb" && &**message == "non-string panic payload"
        ));
    });
}

#[test]
fn fault_a_kernel_that_fails_at_execution_time() {
    survive(0, |c, _| {
        let x = f32s(&c, &[1.0, 2.0]);
        let failed = c.fail_on_device(&x).unwrap(); // dispatch succeeds; the device side fails
        let downstream = failed.scale(2.0).unwrap().add(&x).unwrap();
        c.drain();
        // The engine saw successful dispatches: the failure is the device's.
        assert_eq!(c.stats().ops_failed, 0);
        let error = downstream.read().unwrap_err();
        assert!(
            matches!(&error, Error::KernelFailed { kernel, .. } if &**kernel == "fail_on_device"),
            "{error:?}"
        );
        assert_eq!(
            failed.read().unwrap_err(),
            error,
            "the same error on every dependant"
        );
        settle(&c);
        let kernels_failed = host(&c).kernels_failed;
        assert_eq!(kernels_failed, 3, "the failure and its two dependants");
        assert_eq!(values(&x), vec![1.0, 2.0], "the input is untouched");
    });
}

#[test]
fn fault_a_drop_during_unwinding() {
    survive(0, |c, _| {
        let kept = f32s(&c, &[4.0]).scale(2.0).unwrap(); // pending on this stream
        let c2 = c.clone();
        let shared = kept.clone();
        let outcome = std::thread::spawn(move || {
            // A pending chain, a view of a foreign pending tensor, then a panic: every drop runs
            // during unwinding.
            let mine = f32s(&c2, &[1.0]).exp().unwrap();
            let view = shared.clone();
            let _both = (mine, view.scale(3.0).unwrap(), view);
            panic!("the thread dies holding tensors");
        })
        .join();
        assert!(outcome.is_err());
        assert_eq!(values(&kept), vec![8.0], "the shared source is intact");
    });
}

#[test]
fn fault_a_read_of_a_never_written_tensor() {
    survive(0, |c, _| {
        let x = f32s(&c, &[1.0]);
        let never_written = c
            .op("lazy")
            .read(&x)
            .output([1], DType::F32)
            .execute(|_: &CustomOpIr, _: &mut Handles| Ok(()))
            .unwrap()
            .remove(0);
        let id = never_written.id();
        let downstream = never_written.add(&x).unwrap();
        let expected = Error::OutputNotWritten {
            op: "lazy".into(),
            id,
        };
        assert_eq!(never_written.read().unwrap_err(), expected);
        let propagated = downstream.read().unwrap_err();
        assert!(propagated.is_propagated(), "{propagated:?}");
        assert_eq!(propagated.root(), &expected);
    });
}

#[test]
fn fault_a_share_of_an_errored_tensor() {
    survive(0, |c, by| {
        let x = f32s(&c, &[1.0]);
        let failed = failing_op(&c, &x, false); // pending: the share drains it
        let shared = failed.clone();
        let got = by.peer.run(move || {
            let view = shared.clone(); // a view on the peer's stream
            (view.read(), view.exp().unwrap().read())
        });
        let expected = Error::operation("errors", "injected error");
        // The share carries the error itself; an operation on the view is skipped and propagates it.
        assert_eq!(got.0, Err(expected.clone()));
        let propagated = got.1.unwrap_err();
        assert!(propagated.is_propagated(), "{propagated:?}");
        assert_eq!(propagated.root(), &expected);
    });
}

#[test]
fn fault_a_publication_whose_producer_fails() {
    survive(1, |c, _| {
        let mut session = HeldSession::open(&c).unwrap();
        let x = f32s(&c, &[1.0, 2.0]);
        let mut p = publish(&mut session, c.fail_on_device(&x).unwrap());
        let error = match p.await_frontier() {
            Err(PublicationAdmissionError::Unproven { error }) => error,
            other => panic!("expected a failed frontier, got {other:?}"),
        };
        assert!(matches!(error, Error::KernelFailed { .. }));
        assert!(p.is_terminal());
        let buffer = PinnedHostBuffer::new(8).unwrap();
        let (p, buffer, reason) = p.download_into(buffer).unwrap_err().into_parts();
        assert_eq!(reason, error, "refused, both owners back");
        assert_eq!(buffer.len(), 8);
        drop(p);
        // An engine failure is refused at admission, the value handed back.
        let engine_failed = failing_op(&c, &x, false);
        match unsafe { session.publish(engine_failed) } {
            Err(PublicationAdmissionError::Rejected(r)) => {
                assert_eq!(r.reason, Error::operation("errors", "injected error"));
                assert_eq!(r.value.read().unwrap_err(), r.reason);
            }
            other => panic!("expected a rejection, got {other:?}"),
        }
        session.close();
        let s = c.context().retirement().stats();
        assert_eq!(
            (s.permanent, s.pending),
            (1, 0),
            "the terminal record is retained"
        );
        drop(x);
        // The terminal record keeps its allocation until teardown, by design.
    });
}

#[test]
fn fault_a_download_refused_for_a_wrong_buffer() {
    survive(0, |c, _| {
        let mut session = HeldSession::open(&c).unwrap();
        let p = publish(&mut session, f32s(&c, &[1.0, 2.0, 3.0]));
        let (p, wrong, reason) = p
            .download_into(PinnedHostBuffer::new(8).unwrap())
            .unwrap_err()
            .into_parts();
        assert_eq!(
            reason,
            Error::BufferSize {
                expected: 12,
                found: 8
            }
        );
        assert_eq!(wrong.len(), 8, "the buffer comes back");
        let right = p
            .download_into(PinnedHostBuffer::new(12).unwrap())
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(
            buffer_f32s(&right),
            vec![1.0, 2.0, 3.0],
            "the publication too"
        );
        session.close();
    });
}

#[test]
fn fault_a_retirement_queue_at_capacity() {
    survive(0, |c, _| {
        let mut session = HeldSession::open(&c).unwrap();
        let x = f32s(&c, &[5.0]);
        let capacity = c.context().retirement().capacity();
        let pause = c.context().pause(session.stream());
        // Every download stays in flight while the stream is paused; each drop retires it.
        let publications: Vec<_> = (0..=capacity)
            .map(|_| publish(&mut session, x.clone()))
            .collect();
        let mut pending: Vec<_> = publications
            .into_iter()
            .map(|p| p.download_into(PinnedHostBuffer::new(4).unwrap()).unwrap())
            .collect();
        let last = pending.pop().unwrap();
        drop(pending);
        assert_eq!(c.context().retirement().stats().pending, capacity);
        // One more drop finds the queue full: it waits for the oldest record, which completes
        // once the stream resumes.
        let resume = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(pause);
        });
        drop(last);
        resume.join().unwrap();
        let s = c.context().retirement().stats();
        assert_eq!(s.resolved_at_capacity, 1);
        session.synchronize().unwrap();
        let s = c.context().retirement().stats();
        assert_eq!(s.pending, 0);
        assert_eq!(s.released, capacity as u64 + 1, "each record released once");
        session.close();
        assert_eq!(values(&x), vec![5.0]);
    });
}

/// Faults in one engine leave another engine on the same thread untouched.
#[test]
fn faults_in_one_engine_leave_another_untouched() {
    let faulty = client();
    let healthy = client();
    let by = Bystanders::new(&healthy);
    let x = f32s(&faulty, &[1.0]);
    let _ = failing_op(&faulty, &x, true).read();
    let _ = faulty.fail_on_device(&x).unwrap().read();
    drop((x, faulty));
    let data = TensorData::new(vec![2.0f32], [1]);
    assert_eq!(
        values(
            &healthy
                .from_data(data)
                .unwrap()
                .exp()
                .unwrap()
                .exp()
                .unwrap()
                .scale(0.0)
                .unwrap()
        ),
        vec![0.0]
    );
    by.finish(0);
}
