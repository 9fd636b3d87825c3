//! Tensor steps: uploads, built-in ops (borrowing and consuming), clones, moves, drops, reads.

use burn_backend::TensorData;
use fusion_streams::Operand;
use fusion_streams::runtime::Kernel;

use super::{At, Run};
use crate::harness::DEFERRED_FREE_DELAY;
use crate::harness::model::{Model, Observed, Reference, agrees, apply_unary, combine};
use crate::harness::program::{Binary, LEN, Unary};

fn uploaded(values: [i8; LEN]) -> Vec<f32> {
    values.iter().map(|v| *v as f32 * 0.5).collect()
}

// Upload: a fresh tensor of `LEN` values.

pub(super) fn run_upload(run: &mut Run, slot: usize, values: [i8; LEN]) -> Observed {
    let data = TensorData::new(uploaded(values), [LEN]);
    *run.slots.slot(slot) = Some(run.client().from_data(data).unwrap());
    Observed::Nothing
}

pub(super) fn model_upload(
    r: &mut Reference,
    slot: usize,
    values: [i8; LEN],
) -> Result<(), String> {
    r.slots[slot] = Some(Model {
        len: LEN,
        value: Ok(uploaded(values)),
    });
    Ok(())
}

// Unary: scale, exp or sum of a borrowed tensor.

pub(super) fn run_unary(run: &mut Run, dst: usize, src: usize, op: Unary) -> Observed {
    let Some(s) = run.slots.get(src) else {
        return Observed::Nothing;
    };
    let out = match op {
        Unary::Scale(f) => s.scale(f as f64),
        Unary::Exp => s.exp(),
        Unary::Sum => s.sum(),
    };
    run.put(dst, out)
}

pub(super) fn model_unary(
    r: &mut Reference,
    at: &At,
    observed: Observed,
    dst: usize,
    src: usize,
    op: Unary,
) -> Result<(), String> {
    let Some(s) = r.slots[src].clone() else {
        return Ok(());
    };
    at.expect_registered(&observed, true)?;
    r.slots[dst] = Some(Model {
        len: if matches!(op, Unary::Sum) { 1 } else { s.len },
        value: combine(&[&s]).map(|v| apply_unary(op, &v[0])),
    });
    Ok(())
}

// Binary: add or multiply two borrowed tensors (refused when their lengths differ).

pub(super) fn run_binary(
    run: &mut Run,
    dst: usize,
    lhs: usize,
    rhs: usize,
    op: Binary,
) -> Observed {
    let (Some(l), Some(r)) = (run.slots.get(lhs), run.slots.get(rhs)) else {
        return Observed::Nothing;
    };
    let out = match op {
        Binary::Add => l.add(r),
        Binary::Mul => l.mul(r),
    };
    run.put(dst, out)
}

pub(super) fn model_binary(
    r: &mut Reference,
    at: &At,
    observed: Observed,
    dst: usize,
    lhs: usize,
    rhs: usize,
    op: Binary,
) -> Result<(), String> {
    let (Some(l), Some(rh)) = (r.slots[lhs].clone(), r.slots[rhs].clone()) else {
        return Ok(());
    };
    let fits = l.len == rh.len;
    at.expect_registered(&observed, fits)?;
    if fits {
        r.slots[dst] = Some(Model {
            len: l.len,
            value: combine(&[&l, &rh]).map(|v| {
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
    Ok(())
}

// Consume: scale `src`, handing the tensor over (in place when it is the last reference).

pub(super) fn run_consume(run: &mut Run, dst: usize, src: usize, factor: i8) -> Observed {
    let Some(s) = run.slots.slot(src).take() else {
        return Observed::Nothing;
    };
    match run
        .client()
        .launch(Kernel::Scale(factor as f64), vec![Operand::Consume(s)])
    {
        Ok(t) => {
            *run.slots.slot(dst) = Some(t);
            Observed::Registered(Ok(()))
        }
        Err(rejected) => {
            *run.slots.slot(src) = rejected.returned.into_iter().next();
            Observed::Registered(Err(rejected.error))
        }
    }
}

pub(super) fn model_consume(
    r: &mut Reference,
    at: &At,
    observed: Observed,
    dst: usize,
    src: usize,
    factor: i8,
) -> Result<(), String> {
    let Some(s) = r.slots[src].take() else {
        return Ok(());
    };
    at.expect_registered(&observed, true)?;
    r.slots[dst] = Some(Model {
        len: s.len,
        value: combine(&[&s]).map(|v| apply_unary(Unary::Scale(factor), &v[0])),
    });
    Ok(())
}

// Chain: three consuming scales in a row.

pub(super) fn run_chain(run: &mut Run, dst: usize, src: usize, factors: [i8; 3]) -> Observed {
    let Some(mut t) = run.slots.slot(src).take() else {
        return Observed::Nothing;
    };
    for factor in factors {
        let scaled = run
            .client()
            .launch(Kernel::Scale(factor as f64), vec![Operand::Consume(t)]);
        t = match scaled {
            Ok(t) => t,
            Err(rejected) => return Observed::Registered(Err(rejected.error)),
        };
    }
    *run.slots.slot(dst) = Some(t);
    Observed::Registered(Ok(()))
}

pub(super) fn model_chain(
    r: &mut Reference,
    at: &At,
    observed: Observed,
    dst: usize,
    src: usize,
    factors: [i8; 3],
) -> Result<(), String> {
    let Some(s) = r.slots[src].take() else {
        return Ok(());
    };
    at.expect_registered(&observed, true)?;
    let value = factors
        .iter()
        .fold(combine(&[&s]).map(|v| v[0].clone()), |v, f| {
            v.map(|v| apply_unary(Unary::Scale(*f), &v))
        });
    r.slots[dst] = Some(Model { len: s.len, value });
    Ok(())
}

// Clone, Move, Drop: slot bookkeeping (a clone on another thread is a share).

/// Clone `src` into `dst` (`keep`), or move it there.
pub(super) fn run_clone_or_move(run: &mut Run, dst: usize, src: usize, keep: bool) -> Observed {
    let tensor = match keep {
        true => run.slots.get(src).cloned(),
        false => run.slots.slot(src).take(),
    };
    if let Some(t) = tensor {
        *run.slots.slot(dst) = Some(t);
    }
    Observed::Nothing
}

pub(super) fn model_clone_or_move(
    r: &mut Reference,
    dst: usize,
    src: usize,
    keep: bool,
) -> Result<(), String> {
    let model = match keep {
        true => r.slots[src].clone(),
        false => r.slots[src].take(),
    };
    if let Some(s) = model {
        r.slots[dst] = Some(s);
    }
    Ok(())
}

pub(super) fn run_drop(run: &mut Run, slot: usize) -> Observed {
    *run.slots.slot(slot) = None;
    Observed::Nothing
}

pub(super) fn model_drop(r: &mut Reference, slot: usize) -> Result<(), String> {
    r.slots[slot] = None;
    Ok(())
}

// Read (borrowing) and ReadConsume (the tensor's last use).

pub(super) fn run_read(run: &mut Run, slot: usize) -> Observed {
    match run.slots.get(slot) {
        Some(t) => Observed::Read(t.to_vec::<f32>()),
        None => Observed::Nothing,
    }
}

pub(super) fn run_read_consume(run: &mut Run, slot: usize) -> Observed {
    match run.slots.slot(slot).take() {
        Some(t) => Observed::Read(t.into_data().map(|d| d.to_vec::<f32>().unwrap())),
        None => Observed::Nothing,
    }
}

pub(super) fn model_read(
    r: &mut Reference,
    at: &At,
    observed: Observed,
    slot: usize,
    consume: bool,
) -> Result<(), String> {
    let model = if consume {
        r.slots[slot].take()
    } else {
        r.slots[slot].clone()
    };
    let Some(m) = model else {
        return Ok(());
    };
    let Observed::Read(got) = observed else {
        return at.fail("no read observed".into());
    };
    if !agrees(&m, &got) {
        return at.fail(format!("read {got:?}, model {:?}", m.value));
    }
    Ok(())
}

// Idle: sleep past the deferred-free bound (the model does nothing).

pub(super) fn run_idle() -> Observed {
    std::thread::sleep(DEFERRED_FREE_DELAY * 3);
    Observed::Nothing
}
