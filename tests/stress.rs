//! Stress: T = 2, 4, 8, 16 threads share a pool of tensors for a fixed budget of operations —
//! uploads, unary and binary ops on whatever tensor a slot holds (often another thread's, so
//! uses and clones become shares), drops and reads — while a monitor samples the engine.
//!
//! Checked: no deadlock (each T must finish within a deadline), every read is finite and of the
//! right length, memory stays bounded — the engine's handle count and `shared_sources` never
//! exceed what the live tensors and the bounded lazy queues explain — and nothing is left at the
//! end. With `--nocapture` it prints a table of peaks against the live-tensor count.
//! `FUSION_STREAMS_STRESS_OPS` sets the budget per T (default 20,000).

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn_backend::TensorData;
use common::*;
use fusion_streams::host::{HostDevice, HostRuntime};
use fusion_streams::{EngineConfig, FusionClient};

const LEN: usize = 8;
const QUEUE: usize = 16;
const DEADLINE: Duration = Duration::from_secs(120);

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Peaks {
    handles: usize,
    shared_sources: usize,
    live_tensors: usize,
    /// The largest excess of handles over live tensors seen in one sample.
    excess: usize,
}

fn budget() -> usize {
    std::env::var("FUSION_STREAMS_STRESS_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

fn run(threads: usize, ops: usize, config: EngineConfig) -> (Peaks, Duration) {
    let c: Client =
        FusionClient::<HostRuntime>::with_config(HostDevice::default(), config).unwrap();
    let slots: Arc<Vec<Mutex<Option<Tensor>>>> =
        Arc::new((0..4 * threads).map(|_| Mutex::new(None)).collect());
    // Tensors alive outside the pool (taken out of a slot for an op) are counted too.
    let in_hand = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let started = Instant::now();

    let monitor = {
        let (c, slots, in_hand, done) = (c.clone(), slots.clone(), in_hand.clone(), done.clone());
        std::thread::spawn(move || {
            let mut peaks = Peaks::default();
            while !done.load(Ordering::Acquire) {
                let live = slots.iter().filter(|s| s.lock().unwrap().is_some()).count()
                    + in_hand.load(Ordering::Acquire);
                let s = c.stats();
                peaks.handles = peaks.handles.max(s.live_handles);
                peaks.shared_sources = peaks.shared_sources.max(s.shared_sources);
                peaks.live_tensors = peaks.live_tensors.max(live);
                peaks.excess = peaks.excess.max(s.live_handles.saturating_sub(live));
                std::thread::sleep(Duration::from_micros(200));
            }
            peaks
        })
    };

    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (c, slots, in_hand) = (c.clone(), slots.clone(), in_hand.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((t as u64 + 1) * 0x1234_5678));
                let n = slots.len();
                let take = |i: usize| {
                    let t = slots[i].lock().unwrap().clone();
                    if t.is_some() {
                        in_hand.fetch_add(1, Ordering::AcqRel);
                    }
                    t
                };
                let put = |i: usize, t: Option<Tensor>| {
                    *slots[i].lock().unwrap() = t;
                };
                let done_with = |t: Option<Tensor>| {
                    if t.is_some() {
                        in_hand.fetch_sub(1, Ordering::AcqRel);
                    }
                    drop(t);
                };
                for _ in 0..ops / threads {
                    let (src, dst) = (rng.below(n), rng.below(n));
                    match rng.below(10) {
                        0 | 1 => {
                            let data: Vec<f32> =
                                (0..LEN).map(|i| (i + rng.below(5)) as f32 * 0.25).collect();
                            put(
                                dst,
                                Some(c.from_data(TensorData::new(data, [LEN])).unwrap()),
                            );
                        }
                        2..=4 => {
                            let x = take(src);
                            if let Some(x) = &x {
                                // exp(x / 2) / 4 maps [0, 4] into itself: values stay bounded.
                                let y = x.scale(0.5).unwrap().exp().unwrap().scale(0.25).unwrap();
                                put(dst, Some(y));
                            }
                            done_with(x);
                        }
                        5 | 6 => {
                            let (a, b) = (take(src), take(dst));
                            if let (Some(a), Some(b)) = (&a, &b) {
                                let sum = a.add(b).unwrap().scale(0.5).unwrap();
                                put(rng.below(n), Some(sum));
                            }
                            done_with(a);
                            done_with(b);
                        }
                        7 => put(dst, None),
                        _ => {
                            let x = take(src);
                            if let Some(x) = &x {
                                // Values stay in [0, 4]: uploads, averages and the map above.
                                let v = x.to_vec::<f32>().unwrap();
                                assert_eq!(v.len(), LEN);
                                assert!(v.iter().all(|x| (0.0..=4.0).contains(x)), "{v:?}");
                            }
                            done_with(x);
                        }
                    }
                }
            })
        })
        .collect();

    for w in workers {
        while !w.is_finished() {
            assert!(
                started.elapsed() < DEADLINE,
                "T={threads}: not finished after {DEADLINE:?}: deadlock"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        w.join().expect("worker panicked");
    }
    let elapsed = started.elapsed();
    done.store(true, Ordering::Release);
    let peaks = monitor.join().unwrap();

    for s in slots.iter() {
        s.lock().unwrap().take();
    }
    c.streams().drain_all();
    settle(&c);
    assert!(c.stats().is_quiescent(), "T={threads}: {:?}", c.stats());
    assert_eq!(host(&c).live_buffers(), 0, "T={threads}: buffers leaked");
    (peaks, elapsed)
}

#[test]
fn threads_sharing_a_pool_stay_bounded_and_never_deadlock() {
    let ops = budget();
    println!("stress: {ops} ops per run, lazy queue bound {QUEUE}");
    println!(
        "{:>3} {:>9} {:>10} {:>13} {:>13} {:>15} {:>8}",
        "T", "time", "ops/s", "peak handles", "peak shared", "peak live tens.", "excess"
    );
    for threads in [2, 4, 8, 16] {
        let (peaks, elapsed) = run(threads, ops, config());
        println!(
            "{threads:>3} {:>9.1?} {:>10.0} {:>13} {:>13} {:>15} {:>8}",
            elapsed,
            ops as f64 / elapsed.as_secs_f64(),
            peaks.handles,
            peaks.shared_sources,
            peaks.live_tensors,
            peaks.excess
        );
        // Each handle belongs to a live tensor, or to an intermediate or a deferred free held
        // by a bounded lazy queue: at most two per queued op (an op's output, and a freed input
        // waiting behind it), one queue per thread.
        let bound = peaks.live_tensors + threads * 2 * QUEUE;
        assert!(
            peaks.handles <= bound,
            "T={threads}: {peaks:?} exceeds {bound} handles"
        );
        // A shared source is a live tensor that has been shared.
        assert!(
            peaks.shared_sources <= peaks.live_tensors + threads * QUEUE,
            "T={threads}: {peaks:?}"
        );
    }
}

fn config() -> EngineConfig {
    EngineConfig::default().with_max_queue_len(QUEUE)
}

/// The same pool behind a launch gate that lets one thread execute at a time: a thread holding
/// the permit drains other threads' streams (to share their tensors) while those threads wait at
/// the gate holding their streams' locks. The gate's bounded wait must keep that from ever
/// deadlocking, and the results right.
#[test]
fn threads_behind_a_launch_gate_of_one_never_deadlock() {
    let ops = budget() / 4;
    for threads in [4, 16] {
        let (_, elapsed) = run(threads, ops, config().with_max_launching_threads(1));
        println!("T={threads} behind a gate of one: {ops} ops in {elapsed:.1?}");
    }
}

/// A thread that finds the launch gate's one permit held sleeps, then goes ahead without a
/// permit after the gate's patience; the engine's stats count both. Here the holder is an
/// operation that keeps its permit until the other thread's execution has finished, so the
/// other thread must go ahead past the gate (and this test would hang, not pass, if it could
/// not). The other thread stays alive until the stats are read: its exit drains its stream,
/// which would enter the gate again.
#[test]
fn a_wait_at_the_launch_gate_and_going_past_it_are_counted() {
    use std::sync::mpsc::channel;
    let config = lazy_config().with_max_launching_threads(1);
    let c: Client =
        FusionClient::<HostRuntime>::with_config(HostDevice::default(), config).unwrap();
    let input = f32s(&c, &[1.0, 2.0]);
    let (ready_tx, ready_rx) = channel();
    let (holding_tx, holding_rx) = channel();
    let (done_tx, done_rx) = channel();
    let (read_tx, read_rx) = channel();
    let (finish_tx, finish_rx) = channel::<()>();
    let other = {
        let c = c.clone();
        std::thread::spawn(move || {
            let x = f32s(&c, &[3.0, 4.0]);
            ready_tx.send(()).unwrap();
            holding_rx.recv().unwrap();
            let y = custom_op(&c, "after the holder", &x, [2], pass_through);
            let read = values(&y);
            done_tx.send(()).unwrap();
            read_tx.send(read).unwrap();
            finish_rx.recv().unwrap();
        })
    };
    ready_rx.recv().unwrap();
    let before = c.stats();
    let (holding_tx, done_rx) = (Mutex::new(holding_tx), Mutex::new(done_rx));
    let held = custom_op(
        &c,
        "holds the permit",
        &input,
        [2],
        move |op: &_, handles: &mut _| {
            holding_tx.lock().unwrap().send(()).unwrap();
            done_rx
                .lock()
                .unwrap()
                .recv_timeout(DEADLINE)
                .expect("the other thread went past the gate");
            pass_through(op, handles)
        },
    );
    assert_eq!(values(&held), [1.0, 2.0]);
    assert_eq!(read_rx.recv().unwrap(), [3.0, 4.0]);
    let after = c.stats();
    finish_tx.send(()).unwrap();
    other.join().unwrap();
    assert_eq!(after.launch_waits - before.launch_waits, 1, "{after:?}");
    assert_eq!(
        after.launch_overdrafts - before.launch_overdrafts,
        1,
        "{after:?}"
    );
}
