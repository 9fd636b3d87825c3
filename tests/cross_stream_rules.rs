//! The engine keeps the cross-stream contract of [`StreamRuntime`] on every path, checked by a
//! runtime that records what a device like CUDA under cubecl 0.10 would get wrong.
//!
//! `Checked` is a small synchronous device whose buffers remember the stream that allocated them
//! and where their last write stands in that stream's order of writes. It says a buffer is
//! *foreign* to every other stream ([`StreamRuntime::foreign_to`]), as the CUDA backend does,
//! and records a violation when:
//!
//! 1. a kernel or a read on stream `S` uses a buffer foreign to `S` whose last write `S` was not
//!    ordered after: an [`StreamRuntime::order_use`] for `S` made once the write was dispatched
//!    (the read-before-write hazard). As on CUDA, where it is an event recorded on the buffer's
//!    stream and waited for on `S`, one ordering covers every write its stream had dispatched,
//!    to any of its buffers: that is the contract, and the engine waits once for several
//!    tensors one dispatch wrote;
//! 2. a buffer is freed while a kernel of a stream it is foreign to used it and that use was
//!    never handed to [`StreamRuntime::release_after_use`] (the reuse-under-a-reader hazard);
//! 3. a buffer is written in place by a stream it is foreign to, or a handle that is not foreign
//!    is handed to `release_after_use`.
//!
//! The runtime-generic suite and a set of cross-thread programs run on it; each test then
//! requires no violation, and that the rules were exercised at all.

mod common;
mod suite;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use burn_backend::{DType, Shape, StreamId, TensorData};
use burn_fusion::FusionRuntime;
use burn_ir::{TensorIr, TensorStatus};
use fusion_streams::host::Unfused;
use fusion_streams::runtime::{Kernel, KernelInputs, StreamRuntime};
use fusion_streams::{Error, FusionClient, Operand, Result};

use common::Peer;

/// Violations of the contract, and how often the rules were used, for the whole binary.
static VIOLATIONS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static ORDERED: AtomicUsize = AtomicUsize::new(0);
static RELEASED: AtomicUsize = AtomicUsize::new(0);
static FOREIGN_KERNEL_READS: AtomicUsize = AtomicUsize::new(0);

/// How many writes each stream has dispatched: a write's position in its stream's order.
static WRITES: LazyLock<Mutex<HashMap<StreamId, u64>>> = LazyLock::new(Mutex::default);
/// For (waiter, home): how many of `home`'s writes `waiter` was last ordered after.
static SEEN: LazyLock<Mutex<HashMap<(StreamId, StreamId), u64>>> = LazyLock::new(Mutex::default);

/// A write dispatched on `stream`: its position in the stream's order.
fn write_on(stream: StreamId) -> u64 {
    let mut writes = WRITES.lock().unwrap();
    let count = writes.entry(stream).or_default();
    *count += 1;
    *count
}

/// Tests of this binary share the counters above: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn violation(what: String) {
    VIOLATIONS.lock().unwrap().push(what);
}

/// A buffer of `Checked`: its data, the stream that allocated it, and what the rules were told.
struct Buffer {
    data: Mutex<Vec<f32>>,
    home: StreamId,
    /// Its last write's position in `home`'s writes (the allocation's fill is the first).
    written: AtomicU64,
    /// Streams it is foreign to whose kernels used it, not yet released.
    unreleased: Mutex<HashMap<StreamId, usize>>,
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let unreleased = self.unreleased.get_mut().unwrap();
        if !unreleased.is_empty() {
            violation(format!(
                "a buffer of {} was freed while kernels of {:?} that used it were never released \
                 in order",
                self.home,
                unreleased.keys().collect::<Vec<_>>()
            ));
        }
    }
}

/// A handle: a second owner is a clone.
#[derive(Clone)]
struct CheckedHandle(Arc<Buffer>);

impl fmt::Debug for CheckedHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CheckedHandle({})", self.0.home)
    }
}

impl CheckedHandle {
    fn new(data: Vec<f32>) -> Self {
        let home = StreamId::current();
        Self(Arc::new(Buffer {
            data: Mutex::new(data),
            home,
            written: AtomicU64::new(write_on(home)),
            unreleased: Mutex::default(),
        }))
    }

    fn foreign_to(&self, stream: StreamId) -> bool {
        self.0.home != stream
    }

    /// A use on `stream` (a kernel input or a read): it must be ordered after the last write.
    fn check_ordered(&self, stream: StreamId, what: &str) {
        if !self.foreign_to(stream) {
            return;
        }
        let written = self.0.written.load(Ordering::SeqCst);
        let seen = SEEN
            .lock()
            .unwrap()
            .get(&(stream, self.0.home))
            .copied()
            .unwrap_or(0);
        if seen < written {
            violation(format!(
                "{what} on {stream} of a buffer of {} not ordered after its last write \
                 (its write #{written} there; {stream} was ordered after #{seen})",
                self.0.home
            ));
        }
    }

    fn data(&self) -> MutexGuard<'_, Vec<f32>> {
        self.0.data.lock().unwrap()
    }
}

#[derive(Debug)]
struct Checked;

impl FusionRuntime for Checked {
    type OptimizationState = ();
    type Optimization = Unfused;
    type FusionHandle = CheckedHandle;
    type FusionDevice = burn_ndarray::NdArrayDevice;

    fn fusers(_: Self::FusionDevice) -> Vec<Box<dyn burn_fusion::OperationFuser<Unfused>>> {
        Vec::new()
    }
}

impl StreamRuntime for Checked {
    type Context = ();

    fn name() -> &'static str {
        "checked"
    }

    fn open(_: &Self::FusionDevice) -> Result<()> {
        Ok(())
    }

    fn upload(_: &(), data: TensorData) -> Result<CheckedHandle> {
        let values = data
            .to_vec::<f32>()
            .map_err(|e| Error::InvalidData(format!("{e:?}")))?;
        Ok(CheckedHandle::new(values))
    }

    fn read(_: &(), handle: &CheckedHandle, shape: &Shape, _: DType) -> Result<TensorData> {
        handle.check_ordered(StreamId::current(), "a read");
        Ok(TensorData::new(handle.data().clone(), shape.clone()))
    }

    fn can_mut(handle: &CheckedHandle) -> bool {
        Arc::strong_count(&handle.0) == 1
    }

    fn synchronize(_: &()) -> Result<()> {
        Ok(())
    }

    fn supports(kernel: &Kernel, dtype: DType) -> bool {
        dtype == DType::F32
            && matches!(
                kernel,
                Kernel::Add
                    | Kernel::Mul
                    | Kernel::Scale(_)
                    | Kernel::Exp
                    | Kernel::Sum
                    | Kernel::Fill(_)
            )
    }

    fn foreign_to(_: &(), handle: &CheckedHandle, stream: StreamId) -> bool {
        handle.foreign_to(stream)
    }

    fn order_use(_: &(), handle: &CheckedHandle, stream: StreamId) {
        if handle.foreign_to(stream) {
            ORDERED.fetch_add(1, Ordering::SeqCst);
            // Everything the buffer's stream dispatched so far, not only this buffer's writes.
            let home = handle.0.home;
            let dispatched = WRITES.lock().unwrap().get(&home).copied().unwrap_or(0);
            let mut seen = SEEN.lock().unwrap();
            let seen = seen.entry((stream, home)).or_default();
            *seen = (*seen).max(dispatched);
        }
    }

    fn release_after_use(_: &(), stream: StreamId, handles: Vec<CheckedHandle>) {
        for handle in handles {
            RELEASED.fetch_add(1, Ordering::SeqCst);
            if !handle.foreign_to(stream) {
                violation(format!(
                    "{stream} released a handle of its own buffer in order"
                ));
            }
            handle.0.unreleased.lock().unwrap().remove(&stream);
        }
    }

    fn launch(
        _: &(),
        kernel: &Kernel,
        inputs: KernelInputs<'_, CheckedHandle>,
        out: &TensorIr,
    ) -> Result<CheckedHandle> {
        let stream = StreamId::current();
        for input in &inputs {
            input.handle.check_ordered(stream, kernel.name());
            if input.handle.foreign_to(stream) {
                FOREIGN_KERNEL_READS.fetch_add(1, Ordering::SeqCst);
                *input
                    .handle
                    .0
                    .unreleased
                    .lock()
                    .unwrap()
                    .entry(stream)
                    .or_default() += 1;
            }
        }
        let values: Vec<Vec<f32>> = inputs.iter().map(|i| i.handle.data().clone()).collect();
        let result: Vec<f32> = match kernel {
            Kernel::Add => values[0]
                .iter()
                .zip(&values[1])
                .map(|(a, b)| a + b)
                .collect(),
            Kernel::Mul => values[0]
                .iter()
                .zip(&values[1])
                .map(|(a, b)| a * b)
                .collect(),
            Kernel::Scale(f) => values[0].iter().map(|a| a * *f as f32).collect(),
            Kernel::Exp => values[0].iter().map(|a| a.exp()).collect(),
            Kernel::Sum => vec![values[0].iter().sum()],
            Kernel::Fill(v) => vec![*v as f32; out.shape.num_elements()],
            other => unreachable!("{other:?} is not supported"),
        };
        let first = inputs.into_iter().next();
        // In place exactly where the engine allows it (`first_input_reusable`), which must never
        // be a buffer foreign to this stream.
        if let Some(first) = first
            && first.ir.status == TensorStatus::ReadWrite
            && first.ir.shape == out.shape
            && Self::can_mut(&first.handle)
        {
            if first.handle.foreign_to(stream) {
                violation(format!(
                    "{} written in place on {stream}, a stream it is foreign to",
                    kernel.name()
                ));
            }
            *first.handle.data() = result;
            first
                .handle
                .0
                .written
                .store(write_on(stream), Ordering::SeqCst);
            return Ok(first.handle);
        }
        Ok(CheckedHandle::new(result))
    }
}

type Client = FusionClient<Checked>;

fn client() -> Client {
    FusionClient::with_config(Default::default(), common::lazy_config()).unwrap()
}

/// Run `program`, then require that nothing was violated and that the rules were used.
fn checked(program: impl FnOnce()) {
    let ordered = checked_ordering(program);
    assert!(
        ordered > 0,
        "the program never ordered a stream after another"
    );
}

/// Run `program`, then require that nothing was violated; returns how many times it ordered a
/// stream after another. A program whose threads hand tensors over at random may order none when
/// the scheduler runs its threads one after another (each exits, its work done, before the next
/// takes its tensors): its caller counts orderings over many programs.
fn checked_ordering(program: impl FnOnce()) -> usize {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    VIOLATIONS.lock().unwrap().clear();
    let before = (
        ORDERED.load(Ordering::SeqCst),
        RELEASED.load(Ordering::SeqCst),
        FOREIGN_KERNEL_READS.load(Ordering::SeqCst),
    );
    program();
    let violations = std::mem::take(&mut *VIOLATIONS.lock().unwrap());
    assert!(violations.is_empty(), "{violations:#?}");
    let ordered = ORDERED.load(Ordering::SeqCst) - before.0;
    let foreign_reads = FOREIGN_KERNEL_READS.load(Ordering::SeqCst) - before.2;
    let released = RELEASED.load(Ordering::SeqCst) - before.1;
    assert!(
        foreign_reads == 0 || released > 0,
        "{foreign_reads} foreign kernel reads and no ordered release"
    );
    ordered
}

/// Everything drained and synchronised, the engine holds nothing.
fn assert_nothing_held(c: &Client) {
    suite::settle(c);
    assert!(c.stats().is_quiescent(), "{:?}", c.stats());
}

fn f32s(c: &Client, values: &[f32]) -> fusion_streams::FusionTensor<Checked> {
    suite::f32s(c, values)
}

#[test]
fn the_suite_keeps_the_contract() {
    checked(|| {
        suite::pending_share_drains_then_aliases(&client());
        suite::materialised_share_does_not_drain(&client());
        suite::chained_share_drains_once(&client());
        suite::every_drop_order_frees_each_id_once(client, &suite::Counters::none());
        suite::foreign_drop_under_a_pending_reader_is_deferred(&client());
        suite::in_place_is_refused_while_an_alias_lives(&client(), &suite::Counters::none());
        suite::nothing_leaks_after_cross_thread_work(&client());
        suite::a_chain_on_a_moved_tensor_is_complete_for_a_reader_on_a_third_stream(&client(), 64);
        suite::a_chain_on_the_allocating_stream_is_complete_for_a_stream_that_synced_earlier(
            &client(),
            64,
        );
    });
}

/// A view consumed by an operation on its stream (the engine holds a second owner while the
/// operation runs, and lets go of it in order), then dropped everywhere.
#[test]
fn a_consumed_view_is_kept_read_only_and_released_in_order() {
    checked(|| {
        let c = client();
        let x = f32s(&c, &[1.0, 2.0, 3.0]);
        let peer = Peer::spawn();
        let c2 = c.clone();
        let y = peer.run(move || {
            let view = x.clone();
            drop(x);
            let y = c2
                .launch(Kernel::Scale(2.0), [Operand::Consume(view)])
                .unwrap();
            c2.drain();
            y
        });
        assert_eq!(suite::values(&y), vec![2.0, 4.0, 6.0]);
        drop(y);
        drop(peer);
        assert_nothing_held(&c);
    });
}

/// A tensor read for the last time on another thread (a consuming read of a view): the reader
/// gets a second owner, and the view is released in order.
#[test]
fn a_consuming_read_of_a_view_releases_it_in_order() {
    checked(|| {
        let c = client();
        let x = f32s(&c, &[1.0, 2.0]).scale(3.0).unwrap();
        let peer = Peer::spawn();
        let c2 = c.clone();
        let got = peer.run(move || {
            let view = x.clone();
            drop(x);
            let doubled = view.add(&view).unwrap();
            c2.drain();
            (view.into_data().unwrap(), doubled.to_vec::<f32>().unwrap())
        });
        assert_eq!(got.0.to_vec::<f32>().unwrap(), vec![3.0, 6.0]);
        assert_eq!(got.1, vec![6.0, 12.0]);
        drop(peer);
        assert_nothing_held(&c);
    });
}

/// Four producers send tensors to an accumulator that adds and drops them as they come (the
/// program that found both hazards on CUDA).
#[test]
fn tensors_sent_through_a_channel_to_an_accumulator() {
    checked(|| {
        let c = client();
        let (tx, rx) = std::sync::mpsc::channel();
        let producers: Vec<_> = (0..4)
            .map(|p| {
                let (tx, c) = (tx.clone(), c.clone());
                std::thread::spawn(move || {
                    for i in 0..50 {
                        let t = f32s(&c, &[(p * 100 + i) as f32; 4]);
                        let t = t.scale(2.0).unwrap();
                        tx.send(t).unwrap();
                    }
                })
            })
            .collect();
        drop(tx);
        let mut sum = f32s(&c, &[0.0; 4]);
        for t in rx {
            sum = c
                .launch(Kernel::Add, [Operand::Consume(sum), Operand::Consume(t)])
                .unwrap();
        }
        for p in producers {
            p.join().unwrap();
        }
        let expected: f32 = (0..4)
            .flat_map(|p| (0..50).map(move |i| 2.0 * (p * 100 + i) as f32))
            .sum();
        assert_eq!(suite::values(&sum), vec![expected; 4]);
        drop(sum);
        assert_nothing_held(&c);
    });
}

/// Tensors that one dispatch of a producer wrote: the consumer's stream waits for the producer's
/// stream once, not once per tensor (one wait covers everything that stream dispatched). Once
/// the producer dispatches again, the next share waits again.
#[test]
fn one_wait_covers_every_tensor_one_dispatch_wrote() {
    checked(|| {
        let c = client();
        let peer = Peer::spawn();
        let c2 = c.clone();
        let xs = peer.run(move || {
            let xs: Vec<_> = (0..8)
                .map(|i| f32s(&c2, &[i as f32; 4]).scale(2.0).unwrap())
                .collect();
            c2.drain();
            xs
        });
        let before = c.stats();
        // A clone on this thread is a share: a view on this thread's stream.
        let views: Vec<_> = xs.iter().map(Clone::clone).collect();
        let shared = c.stats();
        assert_eq!(shared.shares - before.shares, 8);
        assert_eq!(shared.orders - before.orders, 1, "{shared:?}");
        assert_eq!(shared.orders_skipped - before.orders_skipped, 7);

        // The producer dispatches again: its stamp moves, and the next share waits.
        let c3 = c.clone();
        let y = peer.run(move || {
            let y = f32s(&c3, &[10.0; 4]).scale(3.0).unwrap();
            c3.drain();
            y
        });
        let y_view = y.clone();
        let again = xs[0].clone();
        let after = c.stats();
        assert_eq!(after.orders - shared.orders, 1, "{after:?}");
        assert_eq!(after.orders_skipped - shared.orders_skipped, 1);

        // An upload is a write too: one made after the last wait is waited for.
        let c4 = c.clone();
        let z = peer.run(move || f32s(&c4, &[5.0; 4]));
        let z_view = z.clone();
        let uploaded = c.stats();
        assert_eq!(uploaded.orders - after.orders, 1, "{uploaded:?}");

        for (i, view) in views.iter().enumerate() {
            assert_eq!(suite::values(view), vec![2.0 * i as f32; 4]);
        }
        assert_eq!(suite::values(&y_view), vec![30.0; 4]);
        assert_eq!(suite::values(&again), vec![0.0; 4]);
        assert_eq!(suite::values(&z_view), vec![5.0; 4]);
        drop((views, y_view, again, xs, y, z_view, z));
        drop(peer);
        assert_nothing_held(&c);
    });
}

/// A small xorshift generator: the random programs below are reproducible from their seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

type Checked32 = fusion_streams::FusionTensor<Checked>;

/// Random programs over four threads that hand tensors to each other through channels and
/// create, combine (borrowing or consuming), clone, read, consume by reading, drop and drain
/// them, each value checked: no use unordered, no buffer freed under a foreign reader, no
/// foreign write, whatever the interleaving. `FUSION_STREAMS_RULES_SEEDS` sets how many
/// programs run (default 32).
#[test]
fn random_programs_keep_the_contract() {
    let seeds = std::env::var("FUSION_STREAMS_RULES_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(32u64);
    let (mut skipped, mut ordered) = (0, 0);
    for seed in 0..seeds {
        ordered += checked_ordering(|| skipped += random_program(seed));
    }
    assert!(
        seeds == 0 || ordered > 0,
        "no program ordered a stream after another"
    );
    assert!(
        seeds == 0 || skipped > 0,
        "no program took a tensor whose stream it had waited for already"
    );
}

/// One random program (see above); returns how many orderings the engine found it did not
/// need.
fn random_program(seed: u64) -> u64 {
    const THREADS: usize = 4;
    const STEPS: usize = 150;
    let c = client();
    let (senders, inboxes): (Vec<_>, Vec<_>) = (0..THREADS)
        .map(|_| std::sync::mpsc::channel::<(Checked32, f32)>())
        .unzip();
    std::thread::scope(|s| {
        for (thread, inbox) in inboxes.into_iter().enumerate() {
            let (c, senders) = (c.clone(), senders.clone());
            s.spawn(move || {
                let mut rng = Rng::new(seed * THREADS as u64 + thread as u64 + 1);
                let mut held: Vec<(Checked32, f32)> = Vec::new();
                let check = |t: &Checked32, v: f32, what: &str| {
                    assert_eq!(suite::values(t), vec![v; 4], "seed {seed}, {what}");
                };
                for _ in 0..STEPS {
                    let pick = |rng: &mut Rng, held: &Vec<_>| rng.below(held.len());
                    match rng.below(10) {
                        0 | 1 => {
                            // An upload, or an operation's output.
                            let v = rng.below(64) as f32;
                            let x = f32s(&c, &[v; 4]);
                            held.push(match rng.below(2) {
                                0 => (x, v),
                                _ => (x.scale(2.0).unwrap(), 2.0 * v),
                            });
                        }
                        2 | 3 if !held.is_empty() => {
                            let item = held.swap_remove(pick(&mut rng, &held));
                            // A finished thread's inbox is gone: the tensor drops here.
                            let _ = senders[rng.below(THREADS)].send(item);
                        }
                        4 => held.extend(inbox.try_iter()),
                        5 if held.len() >= 2 => {
                            let (a, va) = held.swap_remove(pick(&mut rng, &held));
                            let (b, vb) = held.swap_remove(pick(&mut rng, &held));
                            if rng.below(2) == 0 {
                                let sum = a.add(&b).unwrap();
                                held.extend([(a, va), (b, vb), (sum, va + vb)]);
                            } else {
                                let operands = [Operand::Consume(a), Operand::Consume(b)];
                                held.push((c.launch(Kernel::Add, operands).unwrap(), va + vb));
                            }
                        }
                        6 if !held.is_empty() => {
                            let (x, v) = &held[pick(&mut rng, &held)];
                            check(x, *v, "a read");
                        }
                        7 if !held.is_empty() => {
                            let (x, v) = &held[pick(&mut rng, &held)];
                            held.push((x.clone(), *v));
                        }
                        8 if !held.is_empty() => {
                            let (x, v) = held.swap_remove(pick(&mut rng, &held));
                            if rng.below(2) == 0 {
                                let data = x.into_data().unwrap().to_vec::<f32>().unwrap();
                                assert_eq!(data, vec![v; 4], "seed {seed}, a consuming read");
                            }
                        }
                        _ => c.drain(),
                    }
                }
                for (x, v) in &held {
                    check(x, *v, "a tensor held at the end");
                }
            });
        }
    });
    let skipped = c.stats().orders_skipped;
    assert_nothing_held(&c);
    skipped
}
