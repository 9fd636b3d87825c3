//! Source publication on the host runtime: the properties every runtime shares
//! (`suite/publication.rs`, instantiated here, under miri in CI too), then what needs the host
//! device's hooks — a stream held still (`HostContext::pause`) and a kernel that fails after
//! dispatch.

mod common;
mod suite;

use burn_backend::{StreamId, TensorData};
use common::*;
use fusion_streams::Error;
use fusion_streams::host::{HostContext, HostRuntime};
use fusion_streams::transfer::{
    HeldSession, PendingDownload, PinnedHostBuffer, PublicationAdmissionError, SourcePublication,
};
use suite::suite;

type Publication = SourcePublication<HostRuntime>;

fn publish(session: &mut HeldSession<HostRuntime>, value: Tensor) -> Publication {
    // SAFETY: every value published in these tests was produced by this crate's operations, which
    // the host device orders before the session's stream.
    unsafe { session.publish(value) }.expect("admitted")
}

fn download(publication: Publication, len: usize) -> PendingDownload<HostRuntime> {
    publication
        .download_into(PinnedHostBuffer::new(len).unwrap())
        .expect("enqueued")
}

/// A fresh client, a session on this thread's stream, and `values` uploaded there.
fn open(values: &[f32]) -> (Client, HeldSession<HostRuntime>, Tensor) {
    let c = client();
    let session = HeldSession::open(&c).unwrap();
    let x = f32s(&c, values);
    (c, session, x)
}

fn retirement(context: &HostContext) -> fusion_streams::runtime::RetirementStats {
    context.retirement().stats()
}

// Publication's shared properties (`suite/publication.rs`) on the host runtime.
suite! {
    {}
    suite::publication {
        a_publication_survives_its_session(&client());
        forgetting_a_publication_leaks_it_in_place(client(), &suite::Counters::host());
        a_refused_publication_returns_the_value(client);
        a_wrong_length_buffer_is_refused_with_both_owners_back(&client());
        one_session_per_stream(client);
        a_pinned_buffer_is_reused_across_downloads(&client());
    }
}

#[test]
fn a_publication_outlives_its_session_client_and_tensors() {
    let runtime =
        suite::publication::a_publication_outlives_its_session_client_and_tensors(client());
    assert!(
        runtime.upgrade().is_none(),
        "the last owner of the runtime was the download"
    );
}

#[test]
fn a_value_from_another_stream_is_published_after_its_producer_ran() {
    leak_checked(|c| {
        suite::publication::a_value_from_another_stream_is_published_after_its_producer_ran(&c);
    });
}

/// "Producer frontier": publish right after a deliberately large producer — the frontier is
/// not ready; `await_frontier` then succeeds and the copy is exact.
#[test]
#[cfg_attr(
    miri,
    ignore = "33M multiply-adds take hours under miri; the frontier logic is covered by frontier_stays_pending_while_the_stream_is_held"
)]
fn frontier_is_not_ready_right_after_a_large_producer() {
    let c = client();
    let mut session = HeldSession::open(&c).unwrap();
    let n = 320;
    let a: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 - 3.0).collect();
    let b: Vec<f32> = (0..n * n).map(|i| (i % 5) as f32 - 2.0).collect();
    let ta = c.from_data(TensorData::new(a.clone(), [n, n])).unwrap();
    let tb = c.from_data(TensorData::new(b.clone(), [n, n])).unwrap();
    let product = ta.matmul(&tb).unwrap(); // ~33M multiply-adds on the stream's worker
    let mut publication = publish(&mut session, product);
    assert!(
        !publication.frontier_ready().unwrap(),
        "frontier ready before the producer ran"
    );
    publication.await_frontier().unwrap();
    assert!(publication.frontier_ready().unwrap());
    let got = buffer_f32s(&download(publication, n * n * 4).wait().unwrap());
    for (i, j) in [(0, 0), (17, 301), (n - 1, n - 1)] {
        let want: f32 = (0..n).map(|k| a[i * n + k] * b[k * n + j]).sum();
        assert_eq!(got[i * n + j], want, "element ({i}, {j})");
    }
}

/// The same, deterministically: with the stream held, the frontier cannot complete.
#[test]
fn frontier_stays_pending_while_the_stream_is_held() {
    let (c, mut session, x) = open(&[1.0, 2.0]);
    let pause = c.context().pause(session.stream());
    let mut publication = publish(&mut session, x.exp().unwrap());
    for _ in 0..3 {
        assert!(!publication.frontier_ready().unwrap());
    }
    drop(pause);
    publication.await_frontier().unwrap();
    let got = buffer_f32s(&download(publication, 8).wait().unwrap());
    assert_eq!(got, vec![1f32.exp(), 2f32.exp()]);
}

/// "Lifecycle": dropping a publication with its frontier in flight detaches it into the
/// retirement queue without waiting, and `synchronize` releases it.
#[test]
fn dropping_a_publication_in_flight_retires_it_and_synchronize_releases_it() {
    let (c, mut session, x) = open(&[1.0]);
    let pause = c.context().pause(session.stream());
    let publication = publish(&mut session, x.scale(3.0).unwrap());
    drop(publication); // must not wait: the stream is held
    let s = retirement(c.context());
    assert_eq!((s.pending, s.released), (1, 0));
    drop(pause);
    session.synchronize().unwrap();
    let s = retirement(c.context());
    assert_eq!((s.pending, s.released, s.permanent), (0, 1, 0));
}

/// A download dropped before its copy completed is retired the same way, buffer included.
#[test]
fn dropping_a_download_in_flight_retires_it() {
    let (c, mut session, x) = open(&[1.0, 2.0]);
    let publication = publish(&mut session, x.clone());
    let pause = c.context().pause(session.stream());
    let pending = download(publication, 8);
    assert!(!pending.is_ready().unwrap());
    drop(pending);
    assert_eq!(retirement(c.context()).pending, 1);
    drop(pause);
    session.synchronize().unwrap();
    let s = retirement(c.context());
    assert_eq!((s.pending, s.released), (0, 1));
    drop(x);
    c.streams().drain_all();
    settle(&c);
    assert_eq!(
        host(&c).live_buffers(),
        0,
        "the retained allocation was released"
    );
}

/// Beyond the evidence table: a kernel that fails *on the device* after `publish` makes `await_frontier`
/// fail; the publication is terminal, `frontier_ready` reports the error, a further await
/// refuses, `download_into` refuses with both owners back, and dropping the publication moves
/// its record to the permanent-retention side.
#[test]
fn a_device_failure_after_publish_makes_the_publication_terminal() {
    let (c, mut session, x) = open(&[1.0, 2.0]);
    let pause = c.context().pause(session.stream());
    let faulty = c.fail_on_device(&x).unwrap();
    let mut publication = publish(&mut session, faulty);
    assert!(!publication.frontier_ready().unwrap());
    drop(pause);

    let error = match publication.await_frontier() {
        Err(PublicationAdmissionError::Unproven { error }) => error,
        other => panic!("expected a failed frontier, got {other:?}"),
    };
    assert!(matches!(&error, Error::KernelFailed { kernel, .. } if &**kernel == "fail_on_device"));
    assert!(publication.is_terminal());
    assert_eq!(publication.frontier_ready().unwrap_err(), error);
    assert!(matches!(
        publication.await_frontier(),
        Err(PublicationAdmissionError::Unproven { error: e }) if e == error
    ));

    let mut buffer = PinnedHostBuffer::new(8).unwrap();
    buffer.as_bytes_mut().fill(0xAB);
    let (publication, buffer, reason) = publication.download_into(buffer).unwrap_err().into_parts();
    assert_eq!(reason, error);
    assert!(publication.is_terminal(), "handed back terminal");
    assert!(
        buffer.as_bytes().iter().all(|b| *b == 0xAB),
        "buffer untouched"
    );

    drop(publication);
    let s = retirement(c.context());
    assert_eq!((s.permanent, s.pending), (1, 0));
    session.synchronize().unwrap();
    assert_eq!(
        retirement(c.context()).permanent,
        1,
        "never released by a sweep"
    );
    // Unrelated work is unaffected.
    assert_eq!(values(&x.scale(2.0).unwrap()), vec![2.0, 4.0]);
}

/// Two publications (frontiers pending) and three downloads in flight, on three streams,
/// complete independently of one another.
#[test]
fn two_publications_and_three_downloads_complete_independently() {
    let c = client();
    let peers: Vec<Peer> = (0..3).map(|_| Peer::spawn()).collect();
    let streams: Vec<StreamId> = peers
        .iter()
        .map(|peer| {
            let c = c.clone();
            peer.run(move || c.execution_stream())
        })
        .collect();
    let (pause_a, pause_b) = (c.context().pause(streams[0]), c.context().pause(streams[1]));
    // On each stream: one publication kept, one downloaded (stream C: only the download).
    let mut kept = Vec::new();
    let mut downloads = Vec::new();
    for (i, peer) in peers.iter().enumerate() {
        let c2 = c.clone();
        let (publication, pending) = peer.run(move || {
            let mut session = HeldSession::open(&c2).unwrap();
            let base = (i * 10) as f32;
            let x = f32s(&c2, &[base, base + 1.0]);
            let keep = (i < 2).then(|| publish(&mut session, x.scale(2.0).unwrap()));
            let pending = download(publish(&mut session, x.scale(3.0).unwrap()), 8);
            (keep, pending)
        });
        kept.extend(publication);
        downloads.push(pending);
    }
    assert_eq!((kept.len(), downloads.len()), (2, 3));

    // Stream C is free: its download completes while A and B are held.
    let c_buffer = downloads.pop().unwrap().wait().unwrap();
    assert_eq!(buffer_f32s(&c_buffer), vec![60.0, 63.0]);
    for d in &downloads {
        assert!(!d.is_ready().unwrap());
    }
    for p in kept.iter_mut() {
        assert!(!p.frontier_ready().unwrap());
    }

    // Releasing B completes B's transfers, not A's.
    drop(pause_b);
    kept[1].await_frontier().unwrap();
    let b_buffer = downloads.pop().unwrap().wait().unwrap();
    assert_eq!(buffer_f32s(&b_buffer), vec![30.0, 33.0]);
    assert!(!downloads[0].is_ready().unwrap());
    assert!(!kept[0].frontier_ready().unwrap());

    drop(pause_a);
    let a_buffer = downloads.pop().unwrap().wait().unwrap();
    assert_eq!(buffer_f32s(&a_buffer), vec![0.0, 3.0]);
    let expected = [vec![0.0, 2.0], vec![20.0, 22.0]];
    for (p, want) in kept.into_iter().zip(expected) {
        assert_eq!(buffer_f32s(&download(p, 8).wait().unwrap()), want);
    }
}
