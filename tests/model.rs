//! Property: random programs of operations, cross-thread clones and uses, consuming uses, drops
//! (home and foreign), reads and failing operations, run over several threads, agree read for
//! read with a sequential reference model, and leave nothing behind.
//!
//! Each step runs on the thread it names, one step at a time, so a case is deterministic and
//! shrinks to a minimal program (proptest prints it). `FUSION_STREAMS_MODEL_CASES` sets the case
//! count (default 1,000).

mod common;

use std::sync::{Arc, Mutex};

use burn_backend::{DType, TensorData};
use burn_ir::{CustomOpIr, HandleContainer};
use common::*;
use fusion_streams::host::HostHandle;
use fusion_streams::runtime::Kernel;
use fusion_streams::{Error, Operand};
use proptest::prelude::*;

const THREADS: usize = 3;
const SLOTS: usize = 6;
const LEN: usize = 4;

#[derive(Debug, Clone, Copy)]
enum Unary {
    Scale(i8),
    Exp,
    Sum,
}

#[derive(Debug, Clone, Copy)]
enum Binary {
    Add,
    Mul,
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    /// The executor returns an error.
    Error,
    /// The executor panics.
    Panic,
    /// The kernel fails on the device, after dispatch.
    Device,
}

#[derive(Debug, Clone)]
enum Step {
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
}

fn slot() -> impl Strategy<Value = usize> {
    0..SLOTS
}

fn step() -> impl Strategy<Value = Step> {
    let unary = prop_oneof![
        (-2i8..=2).prop_map(Unary::Scale),
        Just(Unary::Exp),
        Just(Unary::Sum)
    ];
    let binary = prop_oneof![Just(Binary::Add), Just(Binary::Mul)];
    let fault = prop_oneof![Just(Fault::Error), Just(Fault::Panic), Just(Fault::Device)];
    prop_oneof![
        3 => (slot(), prop::array::uniform4(-3i8..=3)).prop_map(|(slot, values)| Step::Upload { slot, values }),
        3 => (slot(), slot(), unary).prop_map(|(dst, src, op)| Step::Unary { dst, src, op }),
        3 => (slot(), slot(), slot(), binary).prop_map(|(dst, lhs, rhs, op)| Step::Binary { dst, lhs, rhs, op }),
        2 => (slot(), slot(), -2i8..=2).prop_map(|(dst, src, factor)| Step::Consume { dst, src, factor }),
        3 => (slot(), slot()).prop_map(|(dst, src)| Step::Clone { dst, src }),
        1 => (slot(), slot()).prop_map(|(dst, src)| Step::Move { dst, src }),
        2 => slot().prop_map(|slot| Step::Drop { slot }),
        3 => slot().prop_map(|slot| Step::Read { slot }),
        1 => slot().prop_map(|slot| Step::ReadConsume { slot }),
        1 => (slot(), slot(), fault).prop_map(|(dst, src, fault)| Step::Fail { dst, src, fault }),
    ]
}

fn program() -> impl Strategy<Value = Vec<(usize, Step)>> {
    prop::collection::vec((0..THREADS, step()), 1..40)
}

/// What the model knows of a slot: the tensor's shape and its value or error.
#[derive(Debug, Clone)]
struct Model {
    shape: usize,
    value: Result<Vec<f32>, Failure>,
}

/// A failure, split by where the engine records it: on the engine's error map (executor errors
/// and panics) or on the device buffer (device faults). An operation propagates the first
/// engine-recorded failure among its inputs if there is one, else the first device failure.
#[derive(Debug, Clone, PartialEq)]
enum Failure {
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

fn combine(inputs: &[&Model]) -> Result<Vec<Vec<f32>>, Failure> {
    if let Some(Err(f)) = inputs
        .iter()
        .map(|m| &m.value)
        .find(|v| matches!(v, Err(Failure::Engine(_))))
    {
        return Err(f.clone());
    }
    inputs.iter().map(|m| m.value.clone()).collect()
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

type Slots = Arc<Mutex<Vec<Option<Tensor>>>>;

/// What a step observed, for the model to check.
#[derive(Debug)]
enum Observed {
    Nothing,
    Registered(Result<(), Error>),
    Read(Result<Vec<f32>, Error>),
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

/// Run one step on the calling thread.
fn execute(c: &Client, slots: &Slots, index: usize, step: &Step) -> Observed {
    let mut slots = slots.lock().unwrap();
    let put = |slots: &mut Vec<Option<Tensor>>, dst: usize, r: Result<Tensor, Error>| {
        let observed = r.as_ref().map(|_| ()).map_err(Clone::clone);
        if let Ok(t) = r {
            slots[dst] = Some(t);
        }
        Observed::Registered(observed)
    };
    match *step {
        Step::Upload { slot, values } => {
            let data: Vec<f32> = values.iter().map(|v| *v as f32 * 0.5).collect();
            let t = c.from_data(TensorData::new(data, [LEN])).unwrap();
            slots[slot] = Some(t);
            Observed::Nothing
        }
        Step::Unary { dst, src, op } => {
            let Some(s) = slots[src].as_ref() else {
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
            let (Some(l), Some(r)) = (slots[lhs].as_ref(), slots[rhs].as_ref()) else {
                return Observed::Nothing;
            };
            let out = match op {
                Binary::Add => l.add(r),
                Binary::Mul => l.mul(r),
            };
            put(&mut slots, dst, out)
        }
        Step::Consume { dst, src, factor } => {
            let Some(s) = slots[src].take() else {
                return Observed::Nothing;
            };
            match c.launch(Kernel::Scale(factor as f64), vec![Operand::Consume(s)]) {
                Ok(t) => {
                    slots[dst] = Some(t);
                    Observed::Registered(Ok(()))
                }
                Err(rejected) => {
                    slots[src] = rejected.returned.into_iter().next();
                    Observed::Registered(Err(rejected.error))
                }
            }
        }
        Step::Clone { dst, src } => {
            if let Some(t) = slots[src].clone() {
                slots[dst] = Some(t);
            }
            Observed::Nothing
        }
        Step::Move { dst, src } => {
            if let Some(t) = slots[src].take() {
                slots[dst] = Some(t);
            }
            Observed::Nothing
        }
        Step::Drop { slot } => {
            slots[slot] = None;
            Observed::Nothing
        }
        Step::Read { slot } => match slots[slot].as_ref() {
            Some(t) => Observed::Read(t.to_vec::<f32>()),
            None => Observed::Nothing,
        },
        Step::ReadConsume { slot } => match slots[slot].take() {
            Some(t) => Observed::Read(t.into_data().map(|d| d.to_vec::<f32>().unwrap())),
            None => Observed::Nothing,
        },
        Step::Fail { dst, src, fault } => {
            let Some(s) = slots[src].as_ref() else {
                return Observed::Nothing;
            };
            let r = fail_op(c, s, fault, index);
            put(&mut slots, dst, r)
        }
    }
}

/// Advance the model by one step and check what the engine observed.
fn check(
    model: &mut [Option<Model>],
    index: usize,
    step: &Step,
    observed: Observed,
) -> Result<(), String> {
    let expect_registered = |observed: &Observed, ok: bool| -> Result<(), String> {
        match observed {
            Observed::Registered(Ok(())) if ok => Ok(()),
            Observed::Registered(Err(Error::ShapeMismatch { .. })) if !ok => Ok(()),
            other => Err(format!(
                "step {index} {step:?}: registration {other:?}, model expected ok={ok}"
            )),
        }
    };
    match *step {
        Step::Upload { slot, values } => {
            model[slot] = Some(Model {
                shape: LEN,
                value: Ok(values.iter().map(|v| *v as f32 * 0.5).collect()),
            });
        }
        Step::Unary { dst, src, op } => {
            let Some(s) = model[src].clone() else {
                return Ok(());
            };
            expect_registered(&observed, true)?;
            model[dst] = Some(Model {
                shape: if matches!(op, Unary::Sum) { 1 } else { s.shape },
                value: combine(&[&s]).map(|v| apply_unary(op, &v[0])),
            });
        }
        Step::Binary { dst, lhs, rhs, op } => {
            let (Some(l), Some(r)) = (model[lhs].clone(), model[rhs].clone()) else {
                return Ok(());
            };
            let fits = l.shape == r.shape;
            expect_registered(&observed, fits)?;
            if fits {
                model[dst] = Some(Model {
                    shape: l.shape,
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
                shape: s.shape,
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
                return Err(format!("step {index} {step:?}: no read observed"));
            };
            match (&m.value, &got) {
                (Ok(want), Ok(got)) if same(want, got) => {}
                (Err(want), Err(got)) if want.error() == got => {}
                _ => {
                    return Err(format!(
                        "step {index} {step:?}: read {got:?}, model {:?}",
                        m.value
                    ));
                }
            }
        }
        Step::Fail { dst, src, fault } => {
            let Some(s) = model[src].clone() else {
                return Ok(());
            };
            expect_registered(&observed, true)?;
            let own = match fault {
                Fault::Error => Failure::Engine(Error::operation("fail", format!("step {index}"))),
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
                // The device kernel waits for its input first, so an upstream device failure wins.
                (Err(upstream), Fault::Device) => Err(upstream),
                _ => Err(own),
            };
            model[dst] = Some(Model {
                shape: s.shape,
                value,
            });
        }
    }
    Ok(())
}

fn run_program(program: &[(usize, Step)]) -> Result<(), String> {
    let c = client();
    let peers: Vec<Peer> = (0..THREADS).map(|_| Peer::spawn()).collect();
    let slots: Slots = Arc::new(Mutex::new((0..SLOTS).map(|_| None).collect()));
    let mut model: Vec<Option<Model>> = vec![None; SLOTS];

    for (index, (thread, step)) in program.iter().enumerate() {
        let (c2, slots2, step2) = (c.clone(), slots.clone(), step.clone());
        let observed = peers[*thread].run(move || execute(&c2, &slots2, index, &step2));
        check(&mut model, index, step, observed)?;
    }

    // Every tensor still held is read on a random thread, then everything is dropped and every
    // thread exits.
    for (s, expected) in model.iter().enumerate() {
        let (slots2, thread) = (slots.clone(), s % THREADS);
        let got = peers[thread].run(move || {
            slots2.lock().unwrap()[s]
                .as_ref()
                .map(|t| t.to_vec::<f32>())
        });
        if let (Some(m), Some(got)) = (expected, got) {
            let ok = match (&m.value, &got) {
                (Ok(want), Ok(got)) => same(want, got),
                (Err(want), Err(got)) => want.error() == got,
                _ => false,
            };
            if !ok {
                return Err(format!(
                    "final read of slot {s}: {got:?}, model {:?}",
                    m.value
                ));
            }
        }
    }
    slots.lock().unwrap().clear();
    drop(slots);
    for peer in peers {
        peer.join();
    }
    c.streams().drain_all();
    settle(&c);
    let stats = c.stats();
    if !stats.is_quiescent() {
        return Err(format!("engine not empty after the program: {stats:?}"));
    }
    let live = host(&c).live_buffers();
    if live != 0 {
        return Err(format!("{live} buffer(s) leaked"));
    }
    Ok(())
}

fn cases() -> u32 {
    std::env::var("FUSION_STREAMS_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 2000,
        .. ProptestConfig::default()
    })]

    #[test]
    fn random_multithreaded_programs_match_the_sequential_model(program in program()) {
        if let Err(divergence) = run_program(&program) {
            prop_assert!(false, "{}", divergence);
        }
    }
}
