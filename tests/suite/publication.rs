//! Publication properties that hold on every runtime that publishes, generic like the rest of the
//! suite: instantiated for the host runtime in `suite_host.rs` and for burn backends in
//! `suite_backend.rs` (NdArray in CI, CUDA on a GPU). What needs a particular device — a stream
//! held still, a fault injected, a DMA route — stays with that device (`publication_host.rs`,
//! `device.rs`).

use std::sync::{Arc, Weak};

use burn_backend::StreamId;
use fusion_streams::runtime::TransferRuntime;
use fusion_streams::transfer::{
    HeldSession, PinnedHostBuffer, PublicationAdmissionError, SourcePublication,
};
use fusion_streams::{Error, FusionClient, FusionTensor};

use super::Counters;
use crate::common::{Peer, buffer_f32s, f32s, failing_op, values};

fn publish<R: TransferRuntime>(
    session: &mut HeldSession<R>,
    value: FusionTensor<R>,
) -> SourcePublication<R> {
    // SAFETY: every value published here is produced by this crate's operations, which order it
    // before the session's stream.
    unsafe { session.publish(value) }.expect("admitted")
}

fn pinned<R: TransferRuntime>(c: &FusionClient<R>, len: usize) -> PinnedHostBuffer {
    R::alloc_pinned(c.context(), len).expect("pinned buffer")
}

fn download_f32s<R: TransferRuntime>(c: &FusionClient<R>, p: SourcePublication<R>) -> Vec<f32> {
    let buffer = pinned(c, p.bytes());
    buffer_f32s(&p.download_into(buffer).expect("enqueued").wait().unwrap())
}

/// "Publication survives its session": a pending value published, the session closed, and no
/// session open anywhere when it downloads: the exact bytes come back.
pub fn a_publication_survives_its_session<R: TransferRuntime>(c: &FusionClient<R>) {
    let mut session = HeldSession::open(c).unwrap();
    let x = f32s(c, &[1.5, -2.0, 3.25]);
    let p = publish(&mut session, x.scale(2.0).unwrap().add(&x).unwrap());
    assert_eq!(
        p.stream(),
        session.stream(),
        "the stream the session captured"
    );
    session.close();
    // No session holds this stream any more: opening one succeeds.
    HeldSession::open(c).unwrap().close();
    assert_eq!(download_f32s(c, p), vec![4.5, -6.0, 9.75]);
}

/// "Retention without the source handles": with the session, the client and every tensor gone,
/// the publication alone keeps the runtime and the value's allocation; its download is exact.
/// Returns the runtime, weakly, once the download has gone (the host runtime is torn down then).
pub fn a_publication_outlives_its_session_client_and_tensors<R: TransferRuntime>(
    c: FusionClient<R>,
) -> Weak<R::Context> {
    let runtime = Arc::downgrade(c.context());
    let mut session = HeldSession::open(&c).unwrap();
    let buffer = pinned(&c, 12);
    let x = f32s(&c, &[7.0, 8.0, 9.0]);
    let p = publish(&mut session, x.scale(-1.0).unwrap());
    session.close();
    drop((x, c));
    assert!(
        runtime.upgrade().is_some(),
        "the publication pins the runtime"
    );
    let buffer = p.download_into(buffer).unwrap().wait().unwrap();
    assert_eq!(buffer_f32s(&buffer), vec![-7.0, -8.0, -9.0]);
    runtime
}

/// "Lifecycle": `mem::forget` leaks the record in place — nothing is retired, the allocation
/// stays (where the device counts its buffers) and so does the pin on the runtime.
pub fn forgetting_a_publication_leaks_it_in_place<R: TransferRuntime>(
    c: FusionClient<R>,
    counters: &Counters<R>,
) {
    let runtime = Arc::downgrade(c.context());
    let mut session = HeldSession::open(&c).unwrap();
    let before = R::retirement(c.context()).stats();
    let x = f32s(&c, &[1.0]);
    std::mem::forget(publish(&mut session, x.scale(2.0).unwrap()));
    session.synchronize().unwrap();
    session.close();
    drop(x);
    super::settle(&c);
    let after = R::retirement(c.context()).stats();
    assert_eq!(
        (after.pending, after.released),
        (before.pending, before.released),
        "nothing was retired"
    );
    if let Some(live) = (counters.live_buffers)(&c) {
        assert_eq!(live, 1, "the published buffer leaked in place");
    }
    drop(c);
    assert!(
        runtime.upgrade().is_some(),
        "and so did its pin on the runtime"
    );
}

/// A refused publication hands the value back unchanged: a value of another engine, and one
/// whose producer's failure is already known when `publish` dispatches.
pub fn a_refused_publication_returns_the_value<R: TransferRuntime>(
    client: fn() -> FusionClient<R>,
) {
    let (c, other) = (client(), client());
    let mut session = HeldSession::open(&c).unwrap();

    let foreign = f32s(&other, &[4.0]);
    let foreign_id = foreign.id();
    // SAFETY: produced by this crate's operations (refused before anything is relied on).
    let rejected = match unsafe { session.publish(foreign) } {
        Err(PublicationAdmissionError::Rejected(r)) => r,
        other => panic!("expected a rejection, got {other:?}"),
    };
    assert!(matches!(rejected.reason, Error::DeviceMismatch { .. }));
    assert_eq!(rejected.value.id(), foreign_id);
    assert_eq!(values(&rejected.value), vec![4.0], "unchanged and usable");

    let x = f32s(&c, &[1.0]);
    let failed = failing_op(&c, "fails", &x, "known at dispatch");
    // SAFETY: as above.
    let rejected = match unsafe { session.publish(failed) } {
        Err(PublicationAdmissionError::Rejected(r)) => r,
        other => panic!("expected a rejection, got {other:?}"),
    };
    assert!(matches!(&rejected.reason, Error::OperationFailed { op, .. } if &**op == "fails"));
    assert_eq!(rejected.value.read().unwrap_err(), rejected.reason);
}

/// A wrong-length buffer is refused before anything is enqueued, with both owners back; the
/// publication then downloads into the right buffer.
pub fn a_wrong_length_buffer_is_refused_with_both_owners_back<R: TransferRuntime>(
    c: &FusionClient<R>,
) {
    let mut session = HeldSession::open(c).unwrap();
    let x = f32s(c, &[1.0, 2.0, 3.0]);
    let p = publish(&mut session, x.clone());
    let (p, buffer, reason) = p.download_into(pinned(c, 16)).unwrap_err().into_parts();
    assert_eq!(
        reason,
        Error::BufferSize {
            expected: 12,
            found: 16
        }
    );
    assert_eq!(buffer.len(), 16);
    assert_eq!(download_f32s(c, p), vec![1.0, 2.0, 3.0]);
}

/// One held session per engine and stream; threads on other streams, and other engines on this
/// stream, hold their own.
pub fn one_session_per_stream<R: TransferRuntime>(client: fn() -> FusionClient<R>) {
    let c = client();
    let session = HeldSession::open(&c).unwrap();
    assert_eq!(
        HeldSession::open(&c).unwrap_err(),
        Error::SessionHeld {
            stream: StreamId::current()
        }
    );
    let c2 = c.clone();
    let other = std::thread::spawn(move || HeldSession::open(&c2).map(|s| s.stream()))
        .join()
        .unwrap()
        .unwrap();
    assert_ne!(other, session.stream());
    HeldSession::open(&client()).unwrap().close();
    session.close();
    HeldSession::open(&c).unwrap().close();
}

/// A pinned buffer is reused across downloads: the same memory, the right bytes every round.
pub fn a_pinned_buffer_is_reused_across_downloads<R: TransferRuntime>(c: &FusionClient<R>) {
    let mut session = HeldSession::open(c).unwrap();
    let mut buffer = pinned(c, 8);
    let address = buffer.as_bytes().as_ptr();
    for round in 0..5 {
        let x = f32s(c, &[round as f32, -(round as f32)]);
        let p = publish(&mut session, x.scale(10.0).unwrap());
        buffer = p.download_into(buffer).unwrap().wait().unwrap();
        assert_eq!(buffer.as_bytes().as_ptr(), address, "the same memory");
        assert_eq!(
            buffer_f32s(&buffer),
            vec![10.0 * round as f32, -10.0 * round as f32]
        );
    }
}

/// A value produced on another thread's stream is published once its producer has run there: its
/// home stream is drained, no view is minted on the session's stream, and nothing is left held.
pub fn a_value_from_another_stream_is_published_after_its_producer_ran<R: TransferRuntime>(
    c: &FusionClient<R>,
) {
    let mut session = HeldSession::open(c).unwrap();
    let peer = Peer::spawn();
    let c2 = c.clone();
    let value = peer.run(move || f32s(&c2, &[2.0, 4.0]).scale(0.25).unwrap()); // pending there
    let drains = c.stats().drains;
    let p = publish(&mut session, value);
    let s = c.stats();
    assert_eq!(s.drains, drains + 1, "the producer was materialised first");
    assert_eq!(s.shares, 0, "no view on the session's stream");
    assert_eq!(download_f32s(c, p), vec![0.5, 1.0]);
    peer.join();
    session.close();
    c.streams().drain_all();
    super::settle(c);
    assert!(c.stats().is_quiescent(), "{:?}", c.stats());
}
