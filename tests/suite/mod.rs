//! The cross-thread tests that make sense on any device, generic over the runtime.
//!
//! Instantiated for the host runtime in `suite_host.rs` and for burn backends in
//! `suite_backend.rs` (NdArray in CI, CUDA on a GPU). Checks are engine-level (handles, shares,
//! drains, frees) and value-level. Where a device counter says
//! more (live buffers, in-place reuses), the caller passes a [`Counters`] that reads it; a
//! runtime without that counter passes [`Counters::none`].
#![allow(dead_code)]

use burn_backend::{DType, StreamId, TensorData};
use fusion_streams::runtime::{Kernel, StreamRuntime};
use fusion_streams::{Error, FusionClient, FusionTensor, Operand};

use crate::common::{Client, assert_propagated, failing_op, host};
pub use crate::common::{Peer, f32s, values};

pub mod publication;

/// One test per line: `suite! { {attributes} module { name(args); ... } ... }` defines
/// `#[test] fn name()`, with the attributes, calling `module::name(args)`.
#[allow(unused_macros)] // not every binary that includes the suite calls it
macro_rules! suite {
    ($attributes:tt $($module:path { $($name:ident($($arg:expr),*);)* })*) => {$($(
        crate::suite::suite!(@test $attributes $module; $name($($arg),*));
    )*)*};
    (@test {$($attribute:tt)*} $module:path; $name:ident($($arg:expr),*)) => {
        #[test]
        $($attribute)*
        fn $name() {
            use $module as module;
            module::$name($($arg),*);
        }
    };
}
#[allow(unused_imports)]
pub(crate) use suite;

/// The suite's tests (this module's), each on a fresh `$client()`, with the runtime's
/// `$counters` and long chains of `$large` elements; `$attributes` as for [`suite!`].
#[allow(unused_macros)]
macro_rules! cross_thread_suite {
    ($attributes:tt $client:ident, $counters:expr, $large:expr) => {
        crate::suite::suite! {
            $attributes
            crate::suite {
                builtins_match_reference(&$client());
                pending_share_drains_then_aliases(&$client());
                materialised_share_does_not_drain(&$client());
                chained_share_drains_once(&$client());
                every_drop_order_frees_each_id_once($client, &$counters);
                foreign_drop_under_a_pending_reader_is_deferred(&$client());
                errors_travel_across_threads(&$client());
                in_place_is_refused_while_an_alias_lives(&$client(), &$counters);
                nothing_leaks_after_cross_thread_work(&$client());
                a_chain_on_a_moved_tensor_is_complete_for_a_reader_on_a_third_stream(
                    &$client(),
                    $large
                );
                a_chain_on_a_moved_tensor_is_complete_for_a_publication_on_a_third_stream(
                    &$client(),
                    $large
                );
                a_chain_on_the_allocating_stream_is_complete_for_a_stream_that_synced_earlier(
                    &$client(),
                    $large
                );
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use cross_thread_suite;

pub fn matrix<R: StreamRuntime>(
    c: &FusionClient<R>,
    values: Vec<f32>,
    rows: usize,
    cols: usize,
) -> FusionTensor<R> {
    c.from_data(TensorData::new(values, [rows, cols])).unwrap()
}

/// Device counters a runtime may expose to the suite, read after the work so far has settled.
pub struct Counters<R: StreamRuntime> {
    /// Buffers allocated and not yet freed.
    pub live_buffers: fn(&FusionClient<R>) -> Option<u64>,
    /// Kernels that wrote a consumed input's buffer in place.
    pub in_place_reuses: fn(&FusionClient<R>) -> Option<u64>,
}

impl Counters<fusion_streams::host::HostRuntime> {
    /// The host device counts its buffers and in-place reuses.
    pub fn host() -> Self {
        Self {
            live_buffers: |c: &Client| Some(host(c).live_buffers()),
            in_place_reuses: |c: &Client| Some(host(c).in_place_reuses),
        }
    }
}

impl<R: StreamRuntime> Counters<R> {
    /// For a runtime that counts neither.
    pub fn none() -> Self {
        Self {
            live_buffers: |_| None,
            in_place_reuses: |_| None,
        }
    }
}

/// Run every stream's pending work and wait for the current stream's device work.
pub fn settle<R: StreamRuntime>(c: &FusionClient<R>) {
    c.streams().drain_all();
    c.sync().unwrap();
}

/// Every built-in agrees with plain Rust arithmetic (exactly where the values are exact).
pub fn builtins_match_reference<R: StreamRuntime>(c: &FusionClient<R>) {
    let a = [1.0f32, -2.0, 3.5, 4.0];
    let b = [0.5f32, 2.0, -1.0, 8.0];
    let (ta, tb) = (f32s(c, &a), f32s(c, &b));
    let zip = |f: fn(f32, f32) -> f32| a.iter().zip(&b).map(|(x, y)| f(*x, *y)).collect::<Vec<_>>();
    assert_eq!(values(&ta.add(&tb).unwrap()), zip(|x, y| x + y), "add");
    assert_eq!(values(&ta.mul(&tb).unwrap()), zip(|x, y| x * y), "mul");
    assert_eq!(
        values(&ta.scale(-3.0).unwrap()),
        a.iter().map(|x| x * -3.0).collect::<Vec<_>>(),
        "scale"
    );
    for (got, x) in values(&ta.exp().unwrap()).iter().zip(a) {
        assert!(
            (got - x.exp()).abs() <= 1e-6 * x.exp().max(1.0),
            "exp({x}) = {got}"
        );
    }
    assert_eq!(
        values(&ta.sum().unwrap()),
        vec![a.iter().sum::<f32>()],
        "sum"
    );
    let mv: Vec<f32> = (0..6).map(|i| i as f32 - 2.0).collect();
    let nv: Vec<f32> = (0..12).map(|i| (i % 5) as f32).collect();
    let (m, n) = (matrix(c, mv.clone(), 2, 3), matrix(c, nv.clone(), 3, 4));
    let mut want = vec![0.0f32; 8];
    for i in 0..2 {
        for j in 0..4 {
            for p in 0..3 {
                want[i * 4 + j] += mv[i * 3 + p] * nv[p * 4 + j];
            }
        }
    }
    assert_eq!(values(&m.matmul(&n).unwrap()), want, "matmul");
    assert_eq!(
        values(&c.fill([3], 2.5, DType::F32).unwrap()),
        vec![2.5; 3],
        "fill"
    );
    let i = c
        .from_data(TensorData::new(vec![3i32, -4, 5], [3]))
        .unwrap();
    assert_eq!(
        i.add(&i).unwrap().to_vec::<i32>().unwrap(),
        vec![6, -8, 10],
        "add i32"
    );
    assert_eq!(
        i.sum().unwrap().to_vec::<i32>().unwrap(),
        vec![4],
        "sum i32"
    );
    let consumed = c
        .launch(Kernel::Scale(2.0), [Operand::Consume(f32s(c, &a))])
        .unwrap();
    assert_eq!(
        values(&consumed),
        a.iter().map(|x| x * 2.0).collect::<Vec<_>>(),
        "scale of a consumed operand (in place when allowed)"
    );
}

/// A clone of a pending source on another thread drains the source stream, then aliases.
pub fn pending_share_drains_then_aliases<R: StreamRuntime>(c: &FusionClient<R>) {
    let main = StreamId::current();
    let x = f32s(c, &[1.0, 2.0, 3.0]);
    let y = x.scale(2.0).unwrap();
    assert!(
        !c.streams().holds(main, y.id()).unwrap(),
        "y is still pending"
    );
    let peer = Peer::spawn();
    let peer_stream = peer.stream();
    let y2 = y.clone();
    let view = peer.run(move || y2.clone());
    assert_ne!(view.id(), y.id(), "a view is a fresh id");
    assert_eq!(view.stream(), peer_stream, "homed on the receiving stream");
    assert!(c.streams().holds(main, y.id()).unwrap(), "drained");
    assert!(
        c.streams().holds(peer_stream, view.id()).unwrap(),
        "alias registered"
    );
    let s = c.stats();
    assert_eq!((s.shares, s.share_drains, s.drains), (1, 1, 1));
    let got = peer.run(move || values(&view.scale(1.0).unwrap()));
    assert_eq!(got, vec![2.0, 4.0, 6.0]);
}

/// A clone of a materialised source does not drain, and is not tracked as a drained source.
pub fn materialised_share_does_not_drain<R: StreamRuntime>(c: &FusionClient<R>) {
    let x = f32s(c, &[4.0, 5.0]);
    let y = x.scale(2.0).unwrap();
    assert_eq!(values(&y), vec![8.0, 10.0]); // the read materialised y
    let drains_before = c.stats().drains;
    let peer = Peer::spawn();
    let (x2, y2) = (x.clone(), y.clone());
    let (view, vy) = peer.run(move || (x2.clone(), y2.clone()));
    let s = c.stats();
    assert_eq!((s.share_drains, s.share_fast_paths), (0, 2));
    assert_eq!(s.drains, drains_before, "no drain for materialised sources");
    assert_eq!(s.shared_sources, 0, "only drained sources are tracked");
    assert_eq!(values(&vy), vec![8.0, 10.0]);
    assert_eq!(
        peer.run(move || values(&view.add(&view).unwrap())),
        vec![8.0, 10.0]
    );
}

/// owner → peer → grandpeer: the second share finds the peer's id registered and skips the drain.
pub fn chained_share_drains_once<R: StreamRuntime>(c: &FusionClient<R>) {
    let x = f32s(c, &[1.0, 2.0]);
    let y = x.scale(10.0).unwrap();
    let (peer, grandpeer) = (Peer::spawn(), Peer::spawn());
    let y2 = y.clone();
    let at_peer = peer.run(move || {
        let v = y2.clone();
        let forwarded = v.clone();
        (v, forwarded)
    });
    let forwarded = at_peer.1;
    let s = c.stats();
    // The peer's second clone is of its own view: a plain clone, not a share.
    assert_eq!((s.shares, s.share_drains), (1, 1));
    let at_grandpeer = grandpeer.run(move || forwarded.clone());
    let s = c.stats();
    assert_eq!(s.shares, 2);
    assert_eq!(s.share_drains, 1, "no second drain along the chain");
    assert_eq!(s.shared_sources, 1);
    assert_eq!(values(&at_grandpeer), vec![10.0, 20.0]);
    drop((y, at_peer.0, at_grandpeer));
}

/// Every drop order of an original and its alias, each on its home or a foreign thread: the
/// survivor keeps its data, each id is freed exactly once, and the one buffer lives until the
/// last of them.
pub fn every_drop_order_frees_each_id_once<R: StreamRuntime>(
    new: impl Fn() -> FusionClient<R>,
    counters: &Counters<R>,
) {
    for original_first in [true, false] {
        for original_home in [true, false] {
            for alias_home in [true, false] {
                let case = format!("{original_first} {original_home} {alias_home}");
                let c = new();
                let original = f32s(&c, &[7.0, 8.0]);
                let peer = Peer::spawn();
                let o2 = original.clone();
                let alias = peer.run(move || o2.clone());
                let buffers = |c: &FusionClient<R>| (counters.live_buffers)(c).unwrap_or(1);
                assert_eq!(buffers(&c), 1, "{case}: one buffer, two ids");
                let drop_original = |t: FusionTensor<R>| {
                    if original_home {
                        drop(t)
                    } else {
                        peer.run(move || drop(t))
                    }
                };
                let drop_alias = |t: FusionTensor<R>| {
                    if alias_home {
                        peer.run(move || drop(t))
                    } else {
                        drop(t)
                    }
                };
                let survivor = if original_first {
                    drop_original(original);
                    alias
                } else {
                    drop_alias(alias);
                    original
                };
                settle(&c);
                assert_eq!(c.stats().live_handles, 1, "{case}");
                assert_eq!(buffers(&c), 1, "{case}: freed too early");
                assert_eq!(values(&survivor), vec![7.0, 8.0], "{case}");
                if original_first {
                    drop_alias(survivor)
                } else {
                    drop_original(survivor)
                }
                settle(&c);
                let s = c.stats();
                assert_eq!((s.live_handles, s.frees), (0, 2), "{case}");
                if let Some(live) = (counters.live_buffers)(&c) {
                    assert_eq!(live, 0, "{case}: the buffer outlived its last id");
                }
                peer.join();
            }
        }
    }
}

/// A foreign drop of a tensor that a pending op on its home stream still reads is deferred until
/// that op has run, and leaves the home queue untouched.
pub fn foreign_drop_under_a_pending_reader_is_deferred<R: StreamRuntime>(c: &FusionClient<R>) {
    let main = StreamId::current();
    let x = f32s(c, &[1.0, 2.0]);
    let y = x.scale(3.0).unwrap(); // pending, reads x
    let x_id = x.id();
    let queued = c.streams().pending(main).unwrap();
    let peer = Peer::spawn();
    peer.run(move || drop(x));
    let s = c.stats();
    assert_eq!((s.foreign_drops, s.deferred_frees), (1, 1));
    assert!(
        c.streams().holds(main, x_id).unwrap(),
        "x is still needed by the pending op"
    );
    assert_eq!(
        c.streams().pending(main).unwrap(),
        queued,
        "home queue untouched"
    );
    assert_eq!(values(&y), vec![3.0, 6.0]);
    assert!(
        !c.streams().holds(main, x_id).unwrap(),
        "freed once the reader ran"
    );
    assert_eq!(c.stats().deferred_frees_pending, 0);
}

pub fn errors_travel_across_threads<R: StreamRuntime>(c: &FusionClient<R>) {
    let x = f32s(c, &[1.0]);
    let bad = failing_op(c, "boom", &x, "injected");
    let downstream = bad.scale(2.0).unwrap().add(&x).unwrap();
    let peer = Peer::spawn();
    let d2 = downstream.clone();
    let err = peer.run(move || d2.clone().exp().unwrap().read().unwrap_err());
    // Propagated from the first skipped operation, on the home thread.
    assert_propagated(&err, &Error::operation("boom", "injected"), "scale");
    assert_eq!(
        values(&x.scale(4.0).unwrap()),
        vec![4.0],
        "unrelated work unaffected"
    );
}

/// Aliases disable in-place reuse: a consuming op on the original must not write the buffer a
/// view on another thread still reads. Without an alias, the same call reuses the buffer where
/// the runtime counts reuses.
pub fn in_place_is_refused_while_an_alias_lives<R: StreamRuntime>(
    c: &FusionClient<R>,
    counters: &Counters<R>,
) {
    let reuses = || {
        settle(c);
        (counters.in_place_reuses)(c)
    };
    let lone = f32s(c, &[1.0, 2.0]);
    let out = c
        .launch(Kernel::Scale(2.0), [Operand::Consume(lone)])
        .unwrap();
    assert_eq!(values(&out), vec![2.0, 4.0]);
    let before = reuses();
    if let Some(before) = before {
        assert_eq!(before, 1, "a lone consumed operand is reused in place");
    }

    let shared = f32s(c, &[1.0, 2.0]);
    let peer = Peer::spawn();
    let s2 = shared.clone();
    let view = peer.run(move || s2.clone());
    let out = c
        .launch(Kernel::Scale(5.0), [Operand::Consume(shared)])
        .unwrap();
    assert_eq!(values(&out), vec![5.0, 10.0]);
    assert_eq!(reuses(), before, "an aliased buffer was written in place");
    assert_eq!(peer.run(move || values(&view)), vec![1.0, 2.0]);
}

/// After cross-thread work and every tensor gone, the engine holds nothing.
pub fn nothing_leaks_after_cross_thread_work<R: StreamRuntime>(c: &FusionClient<R>) {
    let peers: Vec<Peer> = (0..3).map(|_| Peer::spawn()).collect();
    let x = f32s(c, &[1.0, 2.0, 3.0, 4.0]);
    let mut results = Vec::new();
    for (i, peer) in peers.iter().enumerate() {
        let x2 = x.scale(i as f64 + 1.0).unwrap();
        results.push(peer.run(move || {
            let v = x2.clone();
            let r = v.mul(&v).unwrap().sum().unwrap();
            drop((v, x2));
            r
        }));
    }
    for (i, r) in results.iter().enumerate() {
        let f = (i + 1) as f32;
        assert_eq!(values(r), vec![30.0 * f * f]);
    }
    drop((x, results));
    drop(peers);
    settle(c);
    assert!(c.stats().is_quiescent(), "{:?}", c.stats());
}

/// Doublings per chain: 2^24 is exact in f32, and every partial result (2^k, k < 24) differs.
const CHAIN: usize = 24;

/// `x` doubled `CHAIN` times by consuming operations: the shape of chain that runs in place.
fn doubled_in_a_chain<R: StreamRuntime>(
    c: &FusionClient<R>,
    x: FusionTensor<R>,
) -> FusionTensor<R> {
    let mut t = x;
    for _ in 0..CHAIN {
        t = c.launch(Kernel::Scale(2.0), [Operand::Consume(t)]).unwrap();
    }
    c.drain(); // dispatched, not waited for
    t
}

fn all_equal(got: &[f32], want: f32, what: &str) {
    let wrong = got.iter().filter(|v| **v != want).count();
    assert_eq!(
        wrong,
        0,
        "{what}: {wrong} of {} elements differ from {want} (first: {:?})",
        got.len(),
        got.iter().find(|v| **v != want)
    );
}

/// A buffer created on stream A, moved to thread B and consumed there by a chain of kernels, then
/// read on a third stream C at once: C must see the whole chain. (A guard of the same rule as the
/// publication test below; on the H200 this read was ordered correctly even before the fix.)
pub fn a_chain_on_a_moved_tensor_is_complete_for_a_reader_on_a_third_stream<R: StreamRuntime>(
    c: &FusionClient<R>,
    n: usize,
) {
    let x = c.fill([n], 1.0, DType::F32).unwrap();
    c.drain(); // allocated and written on A
    let (b, reader) = (Peer::spawn(), Peer::spawn());
    // The reader's stream has read before (on CUDA its first read allocates pinned staging, which
    // takes long enough to hide a race).
    let c3 = c.clone();
    assert_eq!(reader.run(move || values(&f32s(&c3, &[1.0]))), vec![1.0]);
    let c2 = c.clone();
    let y = b.run(move || doubled_in_a_chain(&c2, x));
    let got = reader.run(move || y.to_vec::<f32>().unwrap());
    all_equal(&got, (1u64 << CHAIN) as f32, "read on a third stream");
}

/// The same chain, published from a session on the third stream: the frontier must cover the
/// chain, so the download sees all of it. On cubecl 0.10 the frontier aligns with the buffer's
/// *allocating* stream; before the fix the chain was written in place on B into A's buffer, and
/// on an H200 the download saw 62 of 64 Mi elements half done (`docs/logs/2026-12-01-cudaruntime-prefix-in-place-chain.log`).
pub fn a_chain_on_a_moved_tensor_is_complete_for_a_publication_on_a_third_stream<R>(
    c: &FusionClient<R>,
    n: usize,
) where
    R: fusion_streams::runtime::TransferRuntime,
{
    use fusion_streams::transfer::HeldSession;
    let x = c.fill([n], 1.0, DType::F32).unwrap();
    c.drain();
    let (b, publisher) = (Peer::spawn(), Peer::spawn());
    let c2 = c.clone();
    let y = b.run(move || doubled_in_a_chain(&c2, x));
    let c3 = c.clone();
    let got = publisher.run(move || {
        let mut session = HeldSession::open(&c3).unwrap();
        // SAFETY: produced by this crate's operations (the contract of `publish`).
        let publication = unsafe { session.publish(y) }.unwrap();
        let buffer = R::alloc_pinned(c3.context(), publication.bytes()).unwrap();
        let buffer = publication.download_into(buffer).unwrap().wait().unwrap();
        crate::common::buffer_f32s(&buffer)
    });
    all_equal(&got, (1u64 << CHAIN) as f32, "download on a third stream");
}

/// A chain consumed in place on the stream that allocated the buffer, after another stream C has
/// already synchronised with that stream (it read a newer buffer of it): a kernel on C reading
/// the chain's result must still see all of it. This is the in-place write the CUDA runtime keeps;
/// the test guards that cubecl orders C after it (it passed on the H200 before and after the fix).
pub fn a_chain_on_the_allocating_stream_is_complete_for_a_stream_that_synced_earlier<
    R: StreamRuntime,
>(
    c: &FusionClient<R>,
    n: usize,
) {
    let x = c.fill([n], 1.0, DType::F32).unwrap();
    c.drain(); // x allocated on A
    let newer = c.fill([4], 3.0, DType::F32).unwrap();
    c.drain(); // allocated on A after x
    let reader = Peer::spawn();
    let seen = reader.run(move || newer.to_vec::<f32>().unwrap()); // C syncs with A here
    assert_eq!(seen, vec![3.0; 4]);
    let y = doubled_in_a_chain(c, x); // on A, into x's buffer if written in place
    let got = reader.run(move || {
        let on_c = y.clone().scale(1.0).unwrap(); // a kernel on C reading the chain's result
        on_c.to_vec::<f32>().unwrap()
    });
    all_equal(
        &got,
        (1u64 << CHAIN) as f32,
        "a kernel on a stream that synced earlier",
    );
}
