//! The reference-model harness shared by the property test (`tests/model.rs`), the stress test
//! and the `cargo fuzz` target (`fuzz/`): a program type, its sequential reference model, and a
//! runner that executes a program over several threads with a randomised interleaving.
//!
//! # Interleavings
//!
//! A program is a sequence of `(thread, step)`. The runner cuts it into *rounds*: consecutive
//! steps join the current round as long as they do not conflict with a step of *another* thread
//! already in it (one writes a slot the other touches). Within a round every thread runs its
//! steps in order, all threads at once, with random yields and spins between steps (from the
//! program's schedule seed). Steps that do not conflict commute in the model, so every
//! interleaving the runner can produce must agree with the sequential model read for read, while
//! the engine sees real concurrency: two threads sharing one pending tensor, drops racing
//! shares, publications racing foreign drops.
//!
//! After the program: every remaining tensor is read, everything is dropped, every thread exits,
//! and the engine must hold nothing (no handle, no `shared_sources` entry, no error record), the
//! host must have no live buffer, and the retirement queue must be empty. A round that does not
//! finish within a deadline is reported as a hang.
//!
//! # Files
//!
//! * `program.rs` — the step vocabulary, the resources each step touches, the fuzz decoder.
//! * `schedule.rs` — cutting a program into rounds, and the jitter between steps.
//! * `world.rs` — the slots the threads share, and how a step locks them.
//! * `model.rs` — the sequential model: values, failures and how they travel, comparisons.
//! * `steps/` — every step's execution beside its model check, by family (tensors, faults,
//!   transfer).
//! * here — the runner and its end-of-program checks.
#![allow(dead_code)]

mod model;
mod program;
mod schedule;
mod steps;
mod world;

use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

pub use program::*;

use super::common::*;
use model::{Reference, agrees};
use world::World;

/// How long one round may take before the run is declared hung.
const ROUND_DEADLINE: Duration = Duration::from_secs(30);

/// The engine's deferred-free bound in these programs: short, so that `Idle` steps (and slow
/// rounds) let the service thread flush streams while other threads work.
pub const DEFERRED_FREE_DELAY: Duration = Duration::from_millis(1);

/// What a run saw at its end, for the stress test's report.
#[derive(Debug, Default, Clone, Copy)]
pub struct RunReport {
    pub rounds: usize,
    pub concurrent_rounds: usize,
    /// Reads (tensor reads and waited downloads) checked against the model.
    pub reads: usize,
    /// Publications admitted, and downloads enqueued.
    pub publications: usize,
    pub downloads: usize,
    /// Refusals checked: publications of failed values, and downloads.
    pub refusals: usize,
    /// Pending segments the service thread ran for a deferred free whose home stayed idle.
    pub deferred_flushes: u64,
    /// Deferred foreign frees (a pending op still read the dropped tensor).
    pub deferred_frees: u64,
    /// Kernels that wrote their first input's buffer in place.
    pub in_place_reuses: u64,
    /// Fused runs, and the operations they covered (on the fusing half of the programs).
    pub fused_kernels: u64,
    pub ops_fused: u64,
}

impl std::ops::AddAssign for RunReport {
    fn add_assign(&mut self, r: Self) {
        self.rounds += r.rounds;
        self.concurrent_rounds += r.concurrent_rounds;
        self.reads += r.reads;
        self.publications += r.publications;
        self.downloads += r.downloads;
        self.refusals += r.refusals;
        self.deferred_flushes += r.deferred_flushes;
        self.deferred_frees += r.deferred_frees;
        self.in_place_reuses += r.in_place_reuses;
        self.fused_kernels += r.fused_kernels;
        self.ops_fused += r.ops_fused;
    }
}

/// Run `program` on a fresh engine over [`THREADS`] threads and check it against the model.
pub fn run_program(program: &Program) -> Result<RunReport, String> {
    let client = fusion_streams::FusionClient::with_config(
        // Half the programs run on a fusing device: fused runs must agree with the model too.
        if program.schedule & 2 == 0 {
            fusion_streams::host::HostDevice::default()
        } else {
            fusion_streams::host::HostDevice::default().fusing()
        },
        lazy_config().with_max_deferred_free_delay(DEFERRED_FREE_DELAY),
    )
    .expect("host device");
    let world = Arc::new(World {
        client,
        slots: (0..SLOTS).map(|_| RwLock::new(None)).collect(),
        publications: (0..PUBS).map(|_| Mutex::new(None)).collect(),
        downloads: (0..DOWNLOADS).map(|_| Mutex::new(None)).collect(),
    });
    let c = world.client.clone();
    let peers: Vec<Peer> = (0..THREADS).map(|_| Peer::spawn()).collect();
    let mut reference = Reference::new();
    let mut report = RunReport::default();

    for (number, round) in schedule::rounds(program).into_iter().enumerate() {
        report.rounds += 1;
        if round.iter().filter(|steps| !steps.is_empty()).count() > 1 {
            report.concurrent_rounds += 1;
        }
        let started: Vec<_> = round
            .into_iter()
            .enumerate()
            .filter(|(_, steps)| !steps.is_empty())
            .map(|(thread, steps)| {
                let world = world.clone();
                peers[thread].start(move || {
                    steps
                        .into_iter()
                        .map(|(index, step, jitter)| {
                            jitter.apply();
                            (index, steps::execute(&world, index, &step))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut observed = Vec::new();
        for rx in started {
            match rx.recv_timeout(ROUND_DEADLINE) {
                Ok(steps) => observed.extend(steps),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    // The peers are stuck: report, and leak them rather than hang the test.
                    std::mem::forget(peers);
                    return Err(format!(
                        "round {number} did not finish: a thread is blocked"
                    ));
                }
                Err(_) => return Err(format!("round {number}: a step panicked")),
            }
        }
        observed.sort_by_key(|(index, _)| *index);
        for (index, seen) in observed {
            reference.check(index, &program.steps[index].1, seen)?;
        }
    }

    // Every tensor still held is read on some thread, then everything is dropped and every
    // thread exits.
    for (s, expected) in reference.slots.iter().enumerate() {
        let (world2, thread) = (world.clone(), s % THREADS);
        let got = peers[thread].run(move || {
            world2.slots[s]
                .read()
                .unwrap()
                .as_ref()
                .map(|t| t.to_vec::<f32>())
        });
        if let (Some(m), Some(got)) = (expected, got)
            && !agrees(m, &got)
        {
            return Err(format!(
                "final read of slot {s}: {got:?}, model {:?}",
                m.value
            ));
        }
    }
    for (i, peer) in peers.iter().enumerate() {
        // Publications and downloads left over are dropped on the threads, some in flight.
        let world2 = world.clone();
        peer.run(move || {
            if let Some(p) = world2.publications.get(i) {
                drop(p.lock().unwrap().take());
            }
            if let Some(d) = world2.downloads.get(i) {
                drop(d.lock().unwrap().take());
            }
            for slot in (i..SLOTS).step_by(THREADS) {
                drop(world2.slots[slot].write().unwrap().take());
            }
        });
    }
    for peer in peers {
        peer.join();
    }
    drop(world);
    c.streams().drain_all();
    settle(&c);
    c.context().retirement().sweep();
    let stats = c.stats();
    if !stats.is_quiescent() {
        return Err(format!("engine not empty after the program: {stats:?}"));
    }
    // Terminal records (publications of a value whose device work failed) stay on the permanent
    // side until teardown, by design; everything else is released.
    let retired = c.context().retirement().stats();
    if retired.pending != 0 || retired.permanent > reference.failed_publications {
        return Err(format!(
            "retirement queue not drained: {retired:?}, {} failed publication(s)",
            reference.failed_publications
        ));
    }
    let device = host(&c);
    let live = device.live_buffers();
    if live > retired.permanent as u64 {
        return Err(format!(
            "{live} buffer(s) live, {} held by terminal records",
            retired.permanent
        ));
    }
    // Teardown: the last owner goes, and with it the runtime (no pin leaked, no cycle). The
    // service thread may be in the middle of a deadline flush, holding the engine for its
    // duration: the runtime goes when that flush ends.
    let runtime = Arc::downgrade(c.context());
    drop(c);
    let deadline = std::time::Instant::now() + ROUND_DEADLINE;
    while runtime.upgrade().is_some() {
        if std::time::Instant::now() > deadline {
            return Err("the runtime outlived its last client".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(RunReport {
        rounds: report.rounds,
        concurrent_rounds: report.concurrent_rounds,
        deferred_flushes: stats.deferred_flushes,
        deferred_frees: stats.deferred_frees,
        in_place_reuses: device.in_place_reuses,
        fused_kernels: stats.fused_kernels,
        ops_fused: stats.ops_fused,
        ..reference.counts
    })
}
