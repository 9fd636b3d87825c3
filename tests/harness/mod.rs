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
#![allow(dead_code)]

use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use burn_backend::{DType, TensorData};
use burn_ir::{CustomOpIr, HandleContainer};
use fusion_streams::host::{HostHandle, HostRuntime};
use fusion_streams::runtime::{Kernel, TransferRuntime};
use fusion_streams::transfer::{
    HeldSession, PendingDownload, PublicationAdmissionError, SourcePublication,
};
use fusion_streams::{Error, Operand};

use super::common::*;

pub const THREADS: usize = 3;
pub const SLOTS: usize = 6;
pub const PUBS: usize = 2;
pub const DOWNLOADS: usize = 2;
pub const LEN: usize = 4;
/// How long one round may take before the run is declared hung.
const ROUND_DEADLINE: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Unary {
    Scale(i8),
    Exp,
    Sum,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Binary {
    Add,
    Mul,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    /// The executor returns an error.
    Error,
    /// The executor panics.
    Panic,
    /// The kernel fails on the device, after dispatch.
    Device,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Upload {
        slot: usize,
        values: [i8; LEN],
    },
    Unary {
        dst: usize,
        src: usize,
        op: Unary,
    },
    Binary {
        dst: usize,
        lhs: usize,
        rhs: usize,
        op: Binary,
    },
    /// Scale `src`, handing the tensor over (a `ReadWrite` use when it is the last reference).
    Consume {
        dst: usize,
        src: usize,
        factor: i8,
    },
    Clone {
        dst: usize,
        src: usize,
    },
    Move {
        dst: usize,
        src: usize,
    },
    Drop {
        slot: usize,
    },
    Read {
        slot: usize,
    },
    ReadConsume {
        slot: usize,
    },
    Fail {
        dst: usize,
        src: usize,
        fault: Fault,
    },
    /// Open a session on this thread, publish `src` into publication slot `publication`, close.
    Publish {
        publication: usize,
        src: usize,
    },
    /// Download a publication into a fresh pinned buffer (one 4 bytes too long if `wrong`);
    /// wait now, or keep the pending download in download slot `keep`.
    Download {
        publication: usize,
        keep: Option<usize>,
        wrong: bool,
    },
    WaitDownload {
        download: usize,
    },
    DropPublication {
        publication: usize,
    },
    DropDownload {
        download: usize,
    },
    /// Three consuming scales in a row, starting from `src` (a chain that runs in place where
    /// the runtime allows it, on whichever thread's stream runs the step).
    Chain {
        dst: usize,
        src: usize,
        factors: [i8; 3],
    },
    /// An identity custom op on `src` whose executor captures a clone of `captured`; the
    /// capture's destructor panics if `panics` (recorded on the output when the op is dropped).
    Capture {
        dst: usize,
        src: usize,
        captured: usize,
        panics: bool,
    },
    /// This thread sits idle for longer than the engine's deferred-free bound: the service
    /// thread's deadline passes while the thread's stream may hold pending work.
    Idle,
}

/// A program: its steps, and the seed of its interleaving.
#[derive(Debug, Clone)]
pub struct Program {
    pub steps: Vec<(usize, Step)>,
    pub schedule: u64,
}

/// The resources a step touches, as indices into one space: tensor slots, then publication
/// slots, then download slots.
fn access(step: &Step) -> (Vec<usize>, Vec<usize>) {
    let p = |i: usize| SLOTS + i;
    let d = |i: usize| SLOTS + PUBS + i;
    match *step {
        Step::Upload { slot, .. } | Step::Drop { slot } | Step::ReadConsume { slot } => {
            (vec![], vec![slot])
        }
        Step::Read { slot } => (vec![slot], vec![]),
        Step::Unary { dst, src, .. } | Step::Clone { dst, src } | Step::Fail { dst, src, .. } => {
            (vec![src], vec![dst])
        }
        Step::Binary { dst, lhs, rhs, .. } => (vec![lhs, rhs], vec![dst]),
        Step::Consume { dst, src, .. } | Step::Move { dst, src } => (vec![], vec![src, dst]),
        Step::Publish { publication, src } => (vec![], vec![src, p(publication)]),
        Step::Download {
            publication, keep, ..
        } => {
            let mut w = vec![p(publication)];
            w.extend(keep.map(d));
            (vec![], w)
        }
        Step::WaitDownload { download } | Step::DropDownload { download } => {
            (vec![], vec![d(download)])
        }
        Step::DropPublication { publication } => (vec![], vec![p(publication)]),
        Step::Chain { dst, src, .. } => (vec![], vec![src, dst]),
        Step::Capture {
            dst, src, captured, ..
        } => (vec![src, captured], vec![dst]),
        Step::Idle => (vec![], vec![]),
    }
}

/// The engine's deferred-free bound in these programs: short, so that `Idle` steps (and slow
/// rounds) let the service thread flush streams while other threads work.
pub const DEFERRED_FREE_DELAY: Duration = Duration::from_millis(1);

/// A small deterministic generator for the schedule.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What to do before a step: nothing, yield, or spin a while.
#[derive(Debug, Clone, Copy)]
enum Jitter {
    None,
    Yield,
    Spin(u32),
}

impl Jitter {
    fn apply(self) {
        match self {
            Jitter::None => {}
            Jitter::Yield => std::thread::yield_now(),
            Jitter::Spin(n) => (0..n).for_each(|_| std::hint::spin_loop()),
        }
    }
}

type Round = Vec<Vec<(usize, Step, Jitter)>>;

/// Cut a program into rounds of steps that may run concurrently.
fn rounds(program: &Program) -> Vec<Round> {
    let mut rng = Rng(program.schedule | 1);
    let mut out = Vec::new();
    let mut round: Round = vec![Vec::new(); THREADS];
    // Per resource: the threads that read / wrote it in the current round.
    let mut readers = [0u8; SLOTS + PUBS + DOWNLOADS];
    let mut writers = [0u8; SLOTS + PUBS + DOWNLOADS];
    let mut budget = 1 + rng.below(8);
    for (index, (thread, step)) in program.steps.iter().enumerate() {
        let me = 1u8 << thread;
        let others = !me;
        let (reads, writes) = access(step);
        let conflict = reads.iter().any(|r| writers[*r] & others != 0)
            || writes
                .iter()
                .any(|w| (writers[*w] | readers[*w]) & others != 0);
        if conflict || budget == 0 {
            out.push(std::mem::replace(&mut round, vec![Vec::new(); THREADS]));
            readers.fill(0);
            writers.fill(0);
            budget = 1 + rng.below(8);
        }
        budget -= 1;
        reads.iter().for_each(|r| readers[*r] |= me);
        writes.iter().for_each(|w| writers[*w] |= me);
        let jitter = match rng.below(4) {
            0 | 1 => Jitter::None,
            2 => Jitter::Yield,
            _ => Jitter::Spin(rng.below(2000) as u32),
        };
        round[*thread].push((index, step.clone(), jitter));
    }
    out.push(round);
    out
}

/// What the model knows of a value: its length and its value or error.
#[derive(Debug, Clone)]
pub struct Model {
    pub len: usize,
    pub value: Result<Vec<f32>, Failure>,
}

/// A failure, split by where the engine records it: on the engine's error map (executor errors
/// and panics) or on the device buffer (device faults). An operation propagates the first
/// engine-recorded failure among its inputs if there is one, else the first device failure.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    Engine(Error),
    Device(Error),
}

impl Failure {
    fn error(&self) -> &Error {
        match self {
            Failure::Engine(e) | Failure::Device(e) => e,
        }
    }
}

/// The inputs' values, or the failure the operation reading them ends with. An engine failure
/// upstream skips the operation, which records it as propagated (`Error::Propagated`, naming
/// the first skipped operation: the model leaves that name out, see [`same_error`]).
fn combine(inputs: &[&Model]) -> Result<Vec<Vec<f32>>, Failure> {
    if let Some(Err(Failure::Engine(e))) = inputs
        .iter()
        .map(|m| &m.value)
        .find(|v| matches!(v, Err(Failure::Engine(_))))
    {
        return Err(Failure::Engine(propagated(e)));
    }
    inputs.iter().map(|m| m.value.clone()).collect()
}

fn propagated(error: &Error) -> Error {
    match error {
        Error::Propagated { .. } => error.clone(),
        root => Error::Propagated {
            skipped: "(any)".into(),
            root: std::sync::Arc::new(root.clone()),
        },
    }
}

/// The same failure: the same root, reached the same way (propagated or not).
fn same_error(want: &Error, got: &Error) -> bool {
    want.root() == got.root() && want.is_propagated() == got.is_propagated()
}

fn apply_unary(op: Unary, v: &[f32]) -> Vec<f32> {
    match op {
        Unary::Scale(f) => v.iter().map(|x| x * (f as f64) as f32).collect(),
        Unary::Exp => v.iter().map(|x| x.exp()).collect(),
        Unary::Sum => vec![v.iter().fold(0.0f32, |s, x| s + x)],
    }
}

fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

fn agrees(model: &Model, got: &Result<Vec<f32>, Error>) -> bool {
    match (&model.value, got) {
        (Ok(want), Ok(got)) => same(want, got),
        (Err(want), Err(got)) => same_error(want.error(), got),
        _ => false,
    }
}

type Publication = SourcePublication<HostRuntime>;
type Download = PendingDownload<HostRuntime>;

/// The program's state, shared by its threads.
struct World {
    client: Client,
    slots: Vec<RwLock<Option<Tensor>>>,
    publications: Vec<Mutex<Option<Publication>>>,
    downloads: Vec<Mutex<Option<Download>>>,
}

enum Guard<'a> {
    Read(RwLockReadGuard<'a, Option<Tensor>>),
    Write(RwLockWriteGuard<'a, Option<Tensor>>),
}

/// The tensor slots a step touches, locked in ascending order (the only order anyone locks
/// them in), shared for reads and exclusive for writes.
struct Locked<'a> {
    guards: Vec<(usize, Guard<'a>)>,
}

impl<'a> Locked<'a> {
    fn new(world: &'a World, reads: &[usize], writes: &[usize]) -> Self {
        let mut wanted: Vec<(usize, bool)> = reads
            .iter()
            .filter(|r| **r < SLOTS)
            .map(|r| (*r, false))
            .chain(writes.iter().filter(|w| **w < SLOTS).map(|w| (*w, true)))
            .collect();
        wanted.sort();
        // A slot both read and written is locked once, for writing (sorted: `true` comes last).
        let mut merged: Vec<(usize, bool)> = Vec::new();
        for (slot, write) in wanted {
            match merged.last_mut() {
                Some(last) if last.0 == slot => last.1 |= write,
                _ => merged.push((slot, write)),
            }
        }
        let guards = merged
            .into_iter()
            .map(|(slot, write)| {
                let lock = &world.slots[slot];
                let guard = if write {
                    Guard::Write(lock.write().unwrap())
                } else {
                    Guard::Read(lock.read().unwrap())
                };
                (slot, guard)
            })
            .collect();
        Self { guards }
    }

    fn get(&self, slot: usize) -> Option<&Tensor> {
        let (_, guard) = self.guards.iter().find(|(s, _)| *s == slot)?;
        match guard {
            Guard::Read(g) => g.as_ref(),
            Guard::Write(g) => g.as_ref(),
        }
    }

    fn slot(&mut self, slot: usize) -> &mut Option<Tensor> {
        match self.guards.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, Guard::Write(g))) => g,
            _ => panic!("slot {slot} is not locked for writing"),
        }
    }
}

/// What a step observed, for the model to check.
#[derive(Debug)]
enum Observed {
    Nothing,
    Registered(Result<(), Error>),
    Read(Result<Vec<f32>, Error>),
    /// The publication was refused and the value handed back.
    PublishRejected(Error),
    /// A download: refused with both owners back, or enqueued (and read, if waited for).
    DownloadRejected(Error),
    Downloaded(Option<Result<Vec<f32>, Error>>),
}

fn fail_op(c: &Client, src: &Tensor, fault: Fault, step: usize) -> Result<Tensor, Error> {
    let message = format!("step {step}");
    match fault {
        Fault::Device => c.fail_on_device(src),
        Fault::Error => Ok(c
            .op("fail")
            .read(src)
            .output(src.shape().clone(), DType::F32)
            .execute(move |_: &CustomOpIr, _: &mut HandleContainer<HostHandle>| {
                Err(Error::operation("fail", &message))
            })
            .map_err(|r| r.error)?
            .remove(0)),
        Fault::Panic => Ok(c
            .op("panic")
            .read(src)
            .output(src.shape().clone(), DType::F32)
            .execute(move |_: &CustomOpIr, _: &mut HandleContainer<HostHandle>| {
                std::panic::panic_any(message.clone())
            })
            .map_err(|r| r.error)?
            .remove(0)),
    }
}

/// What a `Capture` step's executor holds: a tensor, and whether dropping it panics.
struct Captured {
    _tensor: Tensor,
    panic: Option<String>,
}

impl Drop for Captured {
    fn drop(&mut self) {
        if let Some(message) = self.panic.take() {
            std::panic::panic_any(message);
        }
    }
}

fn capture_op(c: &Client, src: &Tensor, captured: Captured) -> Result<Tensor, Error> {
    Ok(c.op("capture")
        .read(src)
        .output(src.shape().clone(), DType::F32)
        .execute(
            move |op: &CustomOpIr, handles: &mut HandleContainer<HostHandle>| {
                let _held = &captured;
                let input = handles.get_handle(&op.inputs[0].id, &op.inputs[0].status);
                handles.register_handle(op.outputs[0].id, input);
                Ok(())
            },
        )
        .map_err(|r| r.error)?
        .remove(0))
}

fn wait_and_read(download: Download) -> Result<Vec<f32>, Error> {
    match download.wait() {
        Ok(buffer) => Ok(buffer_f32s(&buffer)),
        Err(failed) => Err(failed.error),
    }
}

/// Run one step on the calling thread.
fn execute(world: &World, index: usize, step: &Step) -> Observed {
    let c = &world.client;
    let (reads, writes) = access(step);
    let mut slots = Locked::new(world, &reads, &writes);
    let put = |slots: &mut Locked, dst: usize, r: Result<Tensor, Error>| {
        let observed = r.as_ref().map(|_| ()).map_err(Clone::clone);
        if let Ok(t) = r {
            *slots.slot(dst) = Some(t);
        }
        Observed::Registered(observed)
    };
    match *step {
        Step::Upload { slot, values } => {
            let data: Vec<f32> = values.iter().map(|v| *v as f32 * 0.5).collect();
            *slots.slot(slot) = Some(c.from_data(TensorData::new(data, [LEN])).unwrap());
            Observed::Nothing
        }
        Step::Unary { dst, src, op } => {
            let Some(s) = slots.get(src) else {
                return Observed::Nothing;
            };
            let r = match op {
                Unary::Scale(f) => s.scale(f as f64),
                Unary::Exp => s.exp(),
                Unary::Sum => s.sum(),
            };
            put(&mut slots, dst, r)
        }
        Step::Binary { dst, lhs, rhs, op } => {
            let (Some(l), Some(r)) = (slots.get(lhs), slots.get(rhs)) else {
                return Observed::Nothing;
            };
            let out = match op {
                Binary::Add => l.add(r),
                Binary::Mul => l.mul(r),
            };
            put(&mut slots, dst, out)
        }
        Step::Consume { dst, src, factor } => {
            let Some(s) = slots.slot(src).take() else {
                return Observed::Nothing;
            };
            match c.launch(Kernel::Scale(factor as f64), vec![Operand::Consume(s)]) {
                Ok(t) => {
                    *slots.slot(dst) = Some(t);
                    Observed::Registered(Ok(()))
                }
                Err(rejected) => {
                    *slots.slot(src) = rejected.returned.into_iter().next();
                    Observed::Registered(Err(rejected.error))
                }
            }
        }
        Step::Clone { dst, src } => {
            if let Some(t) = slots.get(src).cloned() {
                *slots.slot(dst) = Some(t);
            }
            Observed::Nothing
        }
        Step::Move { dst, src } => {
            if let Some(t) = slots.slot(src).take() {
                *slots.slot(dst) = Some(t);
            }
            Observed::Nothing
        }
        Step::Drop { slot } => {
            *slots.slot(slot) = None;
            Observed::Nothing
        }
        Step::Read { slot } => match slots.get(slot) {
            Some(t) => Observed::Read(t.to_vec::<f32>()),
            None => Observed::Nothing,
        },
        Step::ReadConsume { slot } => match slots.slot(slot).take() {
            Some(t) => Observed::Read(t.into_data().map(|d| d.to_vec::<f32>().unwrap())),
            None => Observed::Nothing,
        },
        Step::Fail { dst, src, fault } => {
            let Some(s) = slots.get(src) else {
                return Observed::Nothing;
            };
            let r = fail_op(c, s, fault, index);
            put(&mut slots, dst, r)
        }
        Step::Publish { publication, src } => {
            let Some(value) = slots.slot(src).take() else {
                return Observed::Nothing;
            };
            let mut session = HeldSession::open(c).expect("one session per thread at a time");
            // SAFETY: the value was produced by this crate's operations.
            let outcome = unsafe { session.publish(value) };
            session.close();
            match outcome {
                Ok(p) => {
                    *world.publications[publication].lock().unwrap() = Some(p);
                    Observed::Registered(Ok(()))
                }
                Err(PublicationAdmissionError::Rejected(rejected)) => {
                    let rejected = *rejected;
                    *slots.slot(src) = Some(rejected.value);
                    Observed::PublishRejected(rejected.reason)
                }
                Err(other) => Observed::Registered(Err(other.error().clone())),
            }
        }
        Step::Download {
            publication,
            keep,
            wrong,
        } => {
            let mut cell = world.publications[publication].lock().unwrap();
            let Some(p) = cell.take() else {
                return Observed::Nothing;
            };
            let len = p.bytes() + if wrong { 4 } else { 0 };
            let buffer = HostRuntime::alloc_pinned(c.context(), len).unwrap();
            match p.download_into(buffer) {
                Ok(pending) => match keep {
                    None => Observed::Downloaded(Some(wait_and_read(pending))),
                    Some(d) => {
                        *world.downloads[d].lock().unwrap() = Some(pending);
                        Observed::Downloaded(None)
                    }
                },
                Err(refused) => {
                    let (p, buffer, reason) = refused.into_parts();
                    assert_eq!(buffer.len(), len, "the buffer comes back");
                    *cell = Some(p);
                    Observed::DownloadRejected(reason)
                }
            }
        }
        Step::WaitDownload { download } => match world.downloads[download].lock().unwrap().take() {
            Some(pending) => Observed::Downloaded(Some(wait_and_read(pending))),
            None => Observed::Nothing,
        },
        Step::DropPublication { publication } => {
            drop(world.publications[publication].lock().unwrap().take());
            Observed::Nothing
        }
        Step::DropDownload { download } => {
            drop(world.downloads[download].lock().unwrap().take());
            Observed::Nothing
        }
        Step::Chain { dst, src, factors } => {
            let Some(mut t) = slots.slot(src).take() else {
                return Observed::Nothing;
            };
            for factor in factors {
                t = match c.launch(Kernel::Scale(factor as f64), vec![Operand::Consume(t)]) {
                    Ok(t) => t,
                    Err(rejected) => return Observed::Registered(Err(rejected.error)),
                };
            }
            *slots.slot(dst) = Some(t);
            Observed::Registered(Ok(()))
        }
        Step::Capture {
            dst,
            src,
            captured,
            panics,
        } => {
            let (Some(s), Some(held)) = (slots.get(src), slots.get(captured)) else {
                return Observed::Nothing;
            };
            let captured = Captured {
                _tensor: held.clone(),
                panic: panics.then(|| format!("step {index}")),
            };
            let r = capture_op(c, s, captured);
            put(&mut slots, dst, r)
        }
        Step::Idle => {
            std::thread::sleep(DEFERRED_FREE_DELAY * 3);
            Observed::Nothing
        }
    }
}

/// The sequential reference model.
struct Reference {
    slots: Vec<Option<Model>>,
    publications: Vec<Option<Model>>,
    downloads: Vec<Option<Model>>,
    /// Publications admitted whose value's device work failed (their records may end on the
    /// permanent side).
    failed_publications: usize,
    counts: RunReport,
}

impl Reference {
    fn new() -> Self {
        Self {
            slots: vec![None; SLOTS],
            publications: vec![None; PUBS],
            downloads: vec![None; DOWNLOADS],
            failed_publications: 0,
            counts: RunReport::default(),
        }
    }

    /// Advance the model by one step and check what the engine observed.
    fn check(&mut self, index: usize, step: &Step, observed: Observed) -> Result<(), String> {
        let fail = |what: String| Err(format!("step {index} {step:?}: {what}"));
        match &observed {
            Observed::Read(_) | Observed::Downloaded(Some(_)) => self.counts.reads += 1,
            Observed::PublishRejected(_) | Observed::DownloadRejected(_) => {
                self.counts.refusals += 1
            }
            _ => {}
        }
        match (step, &observed) {
            (Step::Publish { .. }, Observed::Registered(Ok(()))) => self.counts.publications += 1,
            (Step::Download { .. }, Observed::Downloaded(_)) => self.counts.downloads += 1,
            _ => {}
        }
        let expect_registered = |observed: &Observed, ok: bool| -> Result<(), String> {
            match observed {
                Observed::Registered(Ok(())) if ok => Ok(()),
                Observed::Registered(Err(Error::ShapeMismatch { .. })) if !ok => Ok(()),
                other => fail(format!("registration {other:?}, model expected ok={ok}")),
            }
        };
        let model = &mut self.slots;
        match *step {
            Step::Upload { slot, values } => {
                model[slot] = Some(Model {
                    len: LEN,
                    value: Ok(values.iter().map(|v| *v as f32 * 0.5).collect()),
                });
            }
            Step::Unary { dst, src, op } => {
                let Some(s) = model[src].clone() else {
                    return Ok(());
                };
                expect_registered(&observed, true)?;
                model[dst] = Some(Model {
                    len: if matches!(op, Unary::Sum) { 1 } else { s.len },
                    value: combine(&[&s]).map(|v| apply_unary(op, &v[0])),
                });
            }
            Step::Binary { dst, lhs, rhs, op } => {
                let (Some(l), Some(r)) = (model[lhs].clone(), model[rhs].clone()) else {
                    return Ok(());
                };
                let fits = l.len == r.len;
                expect_registered(&observed, fits)?;
                if fits {
                    model[dst] = Some(Model {
                        len: l.len,
                        value: combine(&[&l, &r]).map(|v| {
                            v[0].iter()
                                .zip(&v[1])
                                .map(|(x, y)| match op {
                                    Binary::Add => x + y,
                                    Binary::Mul => x * y,
                                })
                                .collect()
                        }),
                    });
                }
            }
            Step::Consume { dst, src, factor } => {
                let Some(s) = model[src].take() else {
                    return Ok(());
                };
                expect_registered(&observed, true)?;
                model[dst] = Some(Model {
                    len: s.len,
                    value: combine(&[&s]).map(|v| apply_unary(Unary::Scale(factor), &v[0])),
                });
            }
            Step::Clone { dst, src } => {
                if let Some(s) = model[src].clone() {
                    model[dst] = Some(s);
                }
            }
            Step::Move { dst, src } => {
                if let Some(s) = model[src].take() {
                    model[dst] = Some(s);
                }
            }
            Step::Drop { slot } => model[slot] = None,
            Step::Read { slot } | Step::ReadConsume { slot } => {
                let Some(m) = (if matches!(step, Step::ReadConsume { .. }) {
                    model[slot].take()
                } else {
                    model[slot].clone()
                }) else {
                    return Ok(());
                };
                let Observed::Read(got) = observed else {
                    return fail("no read observed".into());
                };
                if !agrees(&m, &got) {
                    return fail(format!("read {got:?}, model {:?}", m.value));
                }
            }
            Step::Fail { dst, src, fault } => {
                let Some(s) = model[src].clone() else {
                    return Ok(());
                };
                expect_registered(&observed, true)?;
                let own = match fault {
                    Fault::Error => {
                        Failure::Engine(Error::operation("fail", format!("step {index}")))
                    }
                    Fault::Panic => Failure::Engine(Error::OperationPanicked {
                        op: "panic".into(),
                        message: format!("step {index}").into(),
                    }),
                    Fault::Device => Failure::Device(Error::KernelFailed {
                        kernel: "fail_on_device".into(),
                        message: "injected device fault".into(),
                    }),
                };
                let value = match (combine(&[&s]), fault) {
                    // An engine failure upstream skips the op: its own fault never happens.
                    (Err(upstream @ Failure::Engine(_)), _) => Err(upstream),
                    // The device kernel waits for its input first: an upstream device failure
                    // wins.
                    (Err(upstream), Fault::Device) => Err(upstream),
                    _ => Err(own),
                };
                model[dst] = Some(Model { len: s.len, value });
            }
            Step::Publish { publication, src } => {
                let Some(s) = model[src].clone() else {
                    return Ok(());
                };
                match (&s.value, observed) {
                    // A failure known at the dispatch boundary: refused, the value handed back.
                    (Err(Failure::Engine(want)), Observed::PublishRejected(got))
                        if same_error(want, &got) => {}
                    // Admitted (a device failure surfaces at the frontier, later).
                    (Ok(_) | Err(Failure::Device(_)), Observed::Registered(Ok(()))) => {
                        self.failed_publications += usize::from(s.value.is_err());
                        model[src] = None;
                        self.publications[publication] = Some(s);
                    }
                    (_, other) => return fail(format!("publish {other:?}, model {:?}", s.value)),
                }
            }
            Step::Download {
                publication, keep, ..
            } => {
                let Some(p) = self.publications[publication].clone() else {
                    return Ok(());
                };
                let wrong = matches!(step, Step::Download { wrong: true, .. });
                match observed {
                    Observed::DownloadRejected(reason) => {
                        // Both owners back: the publication stays where it was.
                        let expected = match (&p.value, wrong) {
                            (Err(Failure::Device(e)), _) if reason == *e => true,
                            (_, true) => matches!(reason, Error::BufferSize { .. }),
                            _ => false,
                        };
                        if !expected {
                            return fail(format!("download refused: {reason:?}, model {p:?}"));
                        }
                    }
                    Observed::Downloaded(got) => {
                        if wrong {
                            return fail("a wrong-length buffer was accepted".into());
                        }
                        self.publications[publication] = None;
                        match (got, keep) {
                            (Some(got), None) if agrees(&p, &got) => {}
                            (None, Some(d)) => self.downloads[d] = Some(p),
                            (got, _) => {
                                return fail(format!("downloaded {got:?}, model {:?}", p.value));
                            }
                        }
                    }
                    other => return fail(format!("download {other:?}")),
                }
            }
            Step::WaitDownload { download } => {
                let Some(d) = self.downloads[download].take() else {
                    return Ok(());
                };
                match observed {
                    Observed::Downloaded(Some(got)) if agrees(&d, &got) => {}
                    other => return fail(format!("waited {other:?}, model {:?}", d.value)),
                }
            }
            Step::DropPublication { publication } => self.publications[publication] = None,
            Step::DropDownload { download } => self.downloads[download] = None,
            Step::Chain { dst, src, factors } => {
                let Some(s) = model[src].take() else {
                    return Ok(());
                };
                expect_registered(&observed, true)?;
                let value = factors
                    .iter()
                    .fold(combine(&[&s]).map(|v| v[0].clone()), |v, f| {
                        v.map(|v| apply_unary(Unary::Scale(*f), &v))
                    });
                model[dst] = Some(Model { len: s.len, value });
            }
            Step::Capture {
                dst,
                src,
                captured,
                panics,
            } => {
                let (Some(s), Some(_)) = (model[src].clone(), model[captured].as_ref()) else {
                    return Ok(());
                };
                expect_registered(&observed, true)?;
                let value = if panics {
                    // Whatever the op did, its disposal panicked: that is recorded on it.
                    Err(Failure::Engine(Error::OperationPanicked {
                        op: "capture".into(),
                        message: format!("while dropping the executor: step {index}").into(),
                    }))
                } else {
                    combine(&[&s]).map(|v| v[0].clone())
                };
                model[dst] = Some(Model { len: s.len, value });
            }
            Step::Idle => {}
        }
        Ok(())
    }
}

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
    }
}

/// Run `program` on a fresh engine over [`THREADS`] threads and check it against the model.
pub fn run_program(program: &Program) -> Result<RunReport, String> {
    let client = fusion_streams::FusionClient::with_config(
        fusion_streams::host::HostDevice::default(),
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

    for (number, round) in rounds(program).into_iter().enumerate() {
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
                            (index, execute(&world, index, &step))
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
        ..reference.counts
    })
}

/// Decode a program from arbitrary bytes (the fuzz target's generator): every byte string is a
/// valid program, so the fuzzer explores programs rather than parse errors.
pub fn decode(bytes: &[u8]) -> Program {
    let mut it = bytes.iter().copied();
    let mut schedule = [0u8; 8];
    for b in &mut schedule {
        *b = it.next().unwrap_or(0);
    }
    let mut next = move || it.next();
    // Every slot starts filled, as in the property test.
    let mut steps: Vec<(usize, Step)> = (0..SLOTS)
        .map(|slot| {
            let b = next().unwrap_or(slot as u8);
            let values = [b, b >> 2, b >> 4, b.rotate_left(3)].map(|v| (v % 7) as i8 - 3);
            (b as usize % THREADS, Step::Upload { slot, values })
        })
        .collect();
    while steps.len() < SLOTS + 64 {
        let Some(head) = next() else { break };
        let mut arg = || next().unwrap_or(0) as usize;
        let thread = (head as usize >> 5) % THREADS;
        let slot = |v: usize| v % SLOTS;
        let step = match head % 19 {
            0 => {
                let values = [arg(), arg(), arg(), arg()].map(|v| (v % 7) as i8 - 3);
                Step::Upload {
                    slot: slot(arg()),
                    values,
                }
            }
            1 => Step::Unary {
                dst: slot(arg()),
                src: slot(arg()),
                op: match arg() % 3 {
                    0 => Unary::Scale((arg() % 5) as i8 - 2),
                    1 => Unary::Exp,
                    _ => Unary::Sum,
                },
            },
            2 => Step::Binary {
                dst: slot(arg()),
                lhs: slot(arg()),
                rhs: slot(arg()),
                op: if arg() % 2 == 0 {
                    Binary::Add
                } else {
                    Binary::Mul
                },
            },
            3 => Step::Consume {
                dst: slot(arg()),
                src: slot(arg()),
                factor: (arg() % 5) as i8 - 2,
            },
            4 | 5 => Step::Clone {
                dst: slot(arg()),
                src: slot(arg()),
            },
            6 => Step::Move {
                dst: slot(arg()),
                src: slot(arg()),
            },
            7 => Step::Drop { slot: slot(arg()) },
            8 => Step::Read { slot: slot(arg()) },
            9 => Step::ReadConsume { slot: slot(arg()) },
            10 => Step::Fail {
                dst: slot(arg()),
                src: slot(arg()),
                fault: match arg() % 3 {
                    0 => Fault::Error,
                    1 => Fault::Panic,
                    _ => Fault::Device,
                },
            },
            11 => Step::Publish {
                publication: arg() % PUBS,
                src: slot(arg()),
            },
            12 => {
                let publication = arg() % PUBS;
                let k = arg();
                Step::Download {
                    publication,
                    keep: (k % 3 != 0).then_some(k % DOWNLOADS),
                    wrong: k % 11 == 0,
                }
            }
            13 => Step::WaitDownload {
                download: arg() % DOWNLOADS,
            },
            14 => Step::DropPublication {
                publication: arg() % PUBS,
            },
            15 => Step::DropDownload {
                download: arg() % DOWNLOADS,
            },
            16 => Step::Chain {
                dst: slot(arg()),
                src: slot(arg()),
                factors: [arg(), arg(), arg()].map(|v| (v % 5) as i8 - 2),
            },
            17 => Step::Capture {
                dst: slot(arg()),
                src: slot(arg()),
                captured: slot(arg()),
                panics: arg() % 4 == 0,
            },
            _ => Step::Idle,
        };
        steps.push((thread, step));
    }
    Program {
        steps,
        schedule: u64::from_le_bytes(schedule),
    }
}
