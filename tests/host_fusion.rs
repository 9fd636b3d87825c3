//! Kernel fusion on the host device (`HostDevice::fusing`): the engine's rules for fused runs —
//! results bit for bit the unfused ones, intermediates never written, errors per tensor, runs cut
//! by failed inputs and shares, drops inside a run, and nothing held afterwards.

mod common;

use common::*;
use fusion_streams::host::HostDevice;
use fusion_streams::runtime::Kernel;
use fusion_streams::{EngineConfig, Error, FusionClient, Operand};

fn fusing() -> Client {
    FusionClient::with_config(HostDevice::default().fusing(), lazy_config()).expect("host device")
}

fn unfused() -> Client {
    FusionClient::with_config(
        HostDevice::default().fusing(),
        lazy_config().with_fusion(false),
    )
    .expect("host device")
}

const INPUT: [f32; 6] = [0.25, -1.5, 3.0, 0.1, -0.7, 2.2];

/// A ten-operation elementwise chain with a second operand: every kind of step the host fuses.
fn chain(c: &Client) -> (Tensor, Tensor) {
    let x = f32s(c, &INPUT);
    let y = f32s(c, &INPUT.map(|v| v * 0.5 + 1.0));
    let mut t = x.scale(1.5).unwrap();
    for i in 0..3 {
        t = t.add(&y).unwrap();
        t = t.mul(&x).unwrap();
        t = if i == 1 {
            t.exp().unwrap().scale(1e-3).unwrap()
        } else {
            t.scale(0.5).unwrap()
        };
    }
    (x, t)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_ten_op_chain_is_one_kernel_and_matches_unfused_bit_for_bit() {
    let (f, u) = (fusing(), unfused());
    let (fx, ft) = chain(&f);
    let (ux, ut) = chain(&u);
    let dispatched = host(&f).kernels_dispatched;
    let fused = values(&ft);
    assert_eq!(bits(&fused), bits(&values(&ut)), "fused {fused:?}");
    let s = f.stats();
    assert_eq!((s.fused_kernels, s.ops_fused), (1, 11), "{s:?}");
    assert_eq!(
        host(&f).kernels_dispatched - dispatched,
        1,
        "one job for the chain"
    );
    let s = u.stats();
    assert_eq!((s.fused_kernels, s.ops_fused), (0, 0), "fusion off: {s:?}");
    // Intermediates live in registers: `x` and the result are the only buffers left (`y` was
    // dropped inside the run, after its last reader).
    settle(&f);
    assert_eq!(host(&f).live_buffers(), 2);
    drop((fx, ft, ux, ut));
    assert_nothing_held(&f);
    assert_nothing_held(&u);
}

#[test]
fn results_that_outlive_the_run_are_written_and_dropped_ones_are_not() {
    let c = fusing();
    let x = f32s(&c, &[1.0, 2.0]);
    let kept = x.scale(2.0).unwrap(); // still held: written
    let dropped = kept.exp().unwrap(); // dropped before the run: never written
    let out = dropped.add(&kept).unwrap();
    drop(dropped);
    assert_eq!(values(&out), vec![2f32.exp() + 2.0, 4f32.exp() + 4.0]);
    assert_eq!(values(&kept), vec![2.0, 4.0]);
    let s = c.stats();
    assert_eq!(
        (s.fused_kernels, s.ops_fused, s.error_records),
        (1, 3, 0),
        "{s:?}"
    );
    settle(&c);
    assert_eq!(host(&c).live_buffers(), 3, "x, kept, out");
    drop((x, kept, out));
    assert_nothing_held(&c);
}

/// An engine error on an input ends the run before the operation that reads it; the operation
/// runs alone and the error travels per tensor, exactly as without fusion.
#[test]
fn an_input_with_an_error_record_cuts_the_run() {
    let program = |c: &Client| {
        let x = f32s(c, &[1.0, 2.0]);
        let bad = custom_op(c, "boom", &x, [2], |_: &_, _: &mut _| {
            Err(Error::operation("boom", "injected"))
        });
        let a = x.scale(2.0).unwrap().exp().unwrap();
        let b = bad.scale(3.0).unwrap().add(&a).unwrap();
        let d = a.mul(&x).unwrap().scale(0.5).unwrap();
        (x, bad, a, b, d)
    };
    let (f, u) = (fusing(), unfused());
    let (_, _, fa, fb, fd) = program(&f);
    let (_, _, ua, ub, ud) = program(&u);
    assert_eq!(bits(&values(&fa)), bits(&values(&ua)));
    assert_eq!(bits(&values(&fd)), bits(&values(&ud)));
    let (fe, ue) = (fb.read().unwrap_err(), ub.read().unwrap_err());
    assert_eq!(fe, ue, "the same propagated error");
    assert!(fe.is_propagated(), "{fe:?}");
    let s = f.stats();
    assert!(s.fused_kernels >= 1, "{s:?}");
    assert_eq!(
        s.ops_skipped,
        u.stats().ops_skipped,
        "the same operations skipped"
    );
}

/// A device failure inside a fused run reaches exactly the results that depend on it, with the
/// error the unfused kernels report; the independent results of the same run are unaffected.
#[test]
fn a_device_failure_in_a_run_reaches_only_its_dependents() {
    let program = |c: &Client| {
        let x = f32s(c, &[1.0, 2.0]);
        let failed = c.fail_on_device(&x).unwrap();
        let independent = x.scale(2.0).unwrap().exp().unwrap();
        let dependent = failed.scale(3.0).unwrap().add(&independent).unwrap();
        (x, failed, independent, dependent)
    };
    let (f, u) = (fusing(), unfused());
    let (_, _, fi, fd) = program(&f);
    let (_, _, ui, ud) = program(&u);
    assert_eq!(bits(&values(&fi)), bits(&values(&ui)));
    assert_eq!(fd.read().unwrap_err(), ud.read().unwrap_err());
    assert!(f.stats().fused_kernels >= 1, "{:?}", f.stats());
}

/// A share drains the queue before it aliases: a run never spans it, and the view sees the
/// complete value.
#[test]
fn a_share_ends_the_run_and_sees_the_complete_value() {
    let c = fusing();
    let x = f32s(&c, &[1.0, -1.0]);
    let y = x.scale(3.0).unwrap().exp().unwrap();
    let peer = Peer::spawn();
    let y2 = y.clone();
    let got = peer.run(move || values(&y2.clone().scale(2.0).unwrap().add(&y2).unwrap()));
    let want: Vec<f32> = [3f32.exp(), (-3f32).exp()]
        .iter()
        .map(|v| v * 2.0 + v)
        .collect();
    assert_eq!(bits(&got), bits(&want));
    let s = c.stats();
    assert_eq!(s.share_drains, 1);
    assert_eq!(
        s.fused_kernels, 2,
        "one run before the share, one on the peer: {s:?}"
    );
    drop((x, y));
    peer.join();
    assert_nothing_held(&c);
}

/// Operations the host does not fuse (a sum, a matmul, another length, a consumed built-in
/// launched by hand) run alone between fused runs, in queue order.
#[test]
fn unfusable_operations_run_alone_between_runs() {
    let c = fusing();
    let x = f32s(&c, &[1.0, 2.0, 3.0]);
    let a = x.scale(2.0).unwrap().add(&x).unwrap(); // run 1
    let total = a.sum().unwrap(); // alone (another length)
    let b = total.scale(2.0).unwrap().exp().unwrap(); // run 2 (length 1)
    let out = c.launch(Kernel::Scale(0.5), [Operand::Consume(a)]).unwrap();
    assert_eq!(values(&b), vec![36f32.exp()]);
    assert_eq!(values(&out), vec![1.5, 3.0, 4.5]);
    let s = c.stats();
    assert_eq!(s.fused_kernels, 2, "{s:?}");
    assert_eq!(s.ops_fused, 4, "{s:?}");
    drop((x, total, b, out));
    assert_nothing_held(&c);
}

/// Fusion off in the engine's settings: the fusing device runs one kernel per operation.
#[test]
fn fusion_can_be_turned_off_per_engine() {
    let c: Client = FusionClient::with_config(
        HostDevice::default().fusing(),
        EngineConfig::default().with_fusion(false),
    )
    .unwrap();
    let x = f32s(&c, &[1.0]);
    assert_eq!(
        values(&x.scale(2.0).unwrap().exp().unwrap()),
        vec![2f32.exp()]
    );
    assert_eq!(c.stats().fused_kernels, 0);
}

/// The engine's switch takes effect at the next drain, both ways.
#[test]
fn fusion_can_be_switched_at_run_time() {
    let c = fusing();
    let x = f32s(&c, &[1.0, 2.0]);
    let run = || values(&x.scale(2.0).unwrap().exp().unwrap());
    let fused = run();
    assert_eq!(c.stats().fused_kernels, 1);
    c.streams().set_fusion(false);
    assert!(!c.streams().config().fusion);
    assert_eq!(bits(&run()), bits(&fused));
    assert_eq!(c.stats().fused_kernels, 1, "unfused while off");
    c.streams().set_fusion(true);
    run();
    assert_eq!(c.stats().fused_kernels, 2);
}

/// A fusing host device's engine with `config`.
fn fusing_with(config: EngineConfig) -> Client {
    FusionClient::with_config(HostDevice::default().fusing(), config).expect("host device")
}

/// A chain `n` operations long on `c`, each step dropping its input (so the queue holds a drop
/// after every operation), alternating so that values stay bounded.
fn long_chain(c: &Client, n: usize) -> Tensor {
    let mut t = f32s(c, &INPUT);
    for i in 0..n {
        t = match i % 3 {
            0 => t.scale(1.5).unwrap(),
            1 => t.exp().unwrap(),
            _ => t.scale(1e-3).unwrap(),
        };
    }
    t
}

/// The queue bound does not cut a run the fuser still accepts: it stays queued, planned, and
/// the whole chain is one kernel, bit for bit the unfused result (with closed runs left to the
/// bound, which is what this checks).
#[test]
fn a_run_longer_than_the_queue_bound_is_still_one_kernel() {
    let config = EngineConfig::default()
        .with_max_queue_len(8)
        .with_dispatch_closed_runs(false);
    let (c, u) = (fusing_with(config), fusing_with(config.with_fusion(false)));
    let (t, reference) = (long_chain(&c, 100), long_chain(&u, 100));
    let s = c.stats();
    assert!(s.lazy_flushes >= 20, "the bound was reached: {s:?}");
    assert_eq!(s.fused_kernels, 0, "the open run waits: {s:?}");
    assert!(s.pending_ops > 100, "the open run is queued: {s:?}");
    assert_eq!(bits(&values(&t)), bits(&values(&reference)));
    let s = c.stats();
    assert_eq!((s.fused_kernels, s.ops_fused), (1, 100), "{s:?}");
    drop((t, reference));
    assert_nothing_held(&c);
    assert_nothing_held(&u);
}

/// `max_fused_len` bounds a run (and what a stream holds queued): a longer chain is cut into
/// runs of at most that many queue entries, executed as the queue fills.
#[test]
fn max_fused_len_cuts_a_long_run() {
    let config = EngineConfig::default()
        .with_max_queue_len(8)
        .with_max_fused_len(64);
    let (c, u) = (fusing_with(config), fusing_with(config.with_fusion(false)));
    let (t, reference) = (long_chain(&c, 100), long_chain(&u, 100));
    let s = c.stats();
    assert!(s.pending_ops <= 64 + 8, "bounded: {s:?}");
    // 100 operations and 99 drops: runs of 64 entries (32 operations) until the read.
    assert_eq!(s.fused_kernels, 3, "{s:?}");
    assert_eq!(bits(&values(&t)), bits(&values(&reference)));
    let s = c.stats();
    assert_eq!((s.fused_kernels, s.ops_fused), (4, 100), "{s:?}");
    assert_eq!(c.streams().config().max_fused_len, 64);
    drop((t, reference));
    assert_nothing_held(&c);
}

/// Operations the fuser refuses are not held back by the open-run rule: the queue bound still
/// executes them.
#[test]
fn unfusable_work_still_executes_at_the_queue_bound() {
    let config = EngineConfig::default().with_max_queue_len(8);
    let c = fusing_with(config);
    let x = f32s(&c, &[1.0, 2.0, 3.0]);
    let sums: Vec<Tensor> = (0..50).map(|_| x.sum().unwrap()).collect();
    let s = c.stats();
    assert!(s.pending_ops < 8, "{s:?}");
    assert_eq!(s.fused_kernels, 0, "{s:?}");
    assert_eq!(values(&sums[49]), vec![6.0]);
    drop((x, sums));
    assert_nothing_held(&c);
}

/// A foreign drop of a tensor that an open run (kept queued past the bound) reads waits for
/// that run; one whose readers have executed is freed at the flush that ran them, even though
/// an open run stays queued behind them.
#[test]
fn a_foreign_drop_waits_only_for_the_queued_runs_that_read_it() {
    let config = EngineConfig::default()
        .with_max_queue_len(4)
        .with_dispatch_closed_runs(false)
        .with_max_deferred_free_delay(std::time::Duration::from_secs(3600));
    let c = fusing_with(config);
    let (x, y) = (f32s(&c, &[1.0, 2.0]), f32s(&c, &[3.0, 4.0]));
    let (x_id, y_id, home) = (x.id(), y.id(), x.stream());

    // An open run reads `x`: dropping `x` on another thread defers its free.
    let mut t = x.scale(2.0).unwrap();
    for _ in 0..5 {
        t = t.scale(0.5).unwrap();
    }
    let s = c.stats();
    assert!(s.lazy_flushes > 0 && s.fused_kernels == 0, "open: {s:?}");
    std::thread::spawn(move || drop(x)).join().unwrap();
    assert!(c.streams().holds(home, x_id).unwrap());
    assert_eq!(c.stats().deferred_frees_pending, 1);
    assert_eq!(values(&t), vec![2.0 / 32.0, 4.0 / 32.0]);
    assert!(
        !c.streams().holds(home, x_id).unwrap(),
        "freed by the drain"
    );

    // `y` is read only by an operation the fuser refuses (a sum).
    let total = y.sum().unwrap();
    std::thread::spawn(move || drop(y)).join().unwrap();
    assert_eq!(c.stats().deferred_frees_pending, 1);
    // The flush at the bound runs the sum; the run behind it stays open and does not read
    // `y`, which is freed.
    let mut u = total.scale(2.0).unwrap();
    for _ in 0..3 {
        u = u.scale(1.0).unwrap();
    }
    let s = c.stats();
    assert!(
        s.pending_ops > 0 && s.lazy_flushes >= 3,
        "an open run is queued: {s:?}"
    );
    assert_eq!(s.deferred_frees_pending, 0, "{s:?}");
    assert!(!c.streams().holds(home, y_id).unwrap());
    assert_eq!(values(&u), vec![14.0]);
    drop((t, total, u));
    assert_nothing_held(&c);
}

/// A run is dispatched the moment it closes, without waiting for the queue bound: the fuser
/// refuses the sum, so the chain before it runs as one kernel when the sum is recorded; the
/// sum (which no fuser takes) runs at once too, and the chain after it stays queued, open.
/// The results are bit for bit the unfused ones, and the kernels are the same as when closed
/// runs wait for the bound.
#[test]
fn a_closed_run_is_dispatched_when_it_closes() {
    let record = |c: &Client| {
        let mut t = f32s(c, &INPUT);
        for _ in 0..5 {
            t = t.scale(1.5).unwrap().exp().unwrap().scale(1e-3).unwrap();
        }
        let total = t.sum().unwrap();
        let mut u = total.scale(2.0).unwrap();
        for _ in 0..3 {
            u = u.exp().unwrap().scale(0.5).unwrap();
        }
        (t, u)
    };
    // A bound the 45 entries recorded do not reach.
    let config = EngineConfig::default().with_max_queue_len(64);
    let eager = fusing_with(config);
    let (t, u) = record(&eager);
    let s = eager.stats();
    assert_eq!(
        s.closed_runs, 1,
        "one dispatch: the chain, and the sum it was closed by: {s:?}"
    );
    assert_eq!(
        (s.fused_kernels, s.ops_fused),
        (1, 15),
        "the closed run ran: {s:?}"
    );
    assert_eq!(s.ops_executed, 15 + 1, "and the sum after it: {s:?}");
    // Seven operations and seven drops: six intermediates, and `total` when `record` returns.
    assert_eq!(s.pending_ops, 7 + 7, "the open run waits: {s:?}");

    let waiting = fusing_with(config.with_dispatch_closed_runs(false));
    let unfused = fusing_with(config.with_fusion(false));
    let (t_waiting, u_waiting) = record(&waiting);
    assert_eq!(
        waiting.stats().ops_executed,
        0,
        "nothing ran before the bound"
    );
    let (t_unfused, u_unfused) = record(&unfused);
    for (ours, reference) in [
        (&t, &t_unfused),
        (&u, &u_unfused),
        (&t_waiting, &t),
        (&u_waiting, &u),
    ] {
        assert_eq!(bits(&values(ours)), bits(&values(reference)));
    }
    let (s, w) = (eager.stats(), waiting.stats());
    assert_eq!(
        (s.fused_kernels, s.ops_fused),
        (w.fused_kernels, w.ops_fused),
        "same kernels"
    );
    drop((t, u, t_waiting, u_waiting, t_unfused, u_unfused));
    for c in [&eager, &waiting, &unfused] {
        assert_nothing_held(c);
    }
}
