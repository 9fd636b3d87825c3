//! Failing steps: an executor that errs, panics, or fails on the device; and an executor whose
//! capture's destructor may panic.

use burn_backend::DType;
use burn_ir::{CustomOpIr, HandleContainer};
use fusion_streams::Error;
use fusion_streams::host::HostHandle;

use super::{At, Run};
use crate::common::{Client, Tensor};
use crate::harness::model::{Failure, Model, Observed, Reference, combine};
use crate::harness::program::Fault;

// Fail: an operation on `src` that fails in the way `fault` says.

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

pub(super) fn run_fail(run: &mut Run, dst: usize, src: usize, fault: Fault) -> Observed {
    let Some(s) = run.slots.get(src) else {
        return Observed::Nothing;
    };
    let out = fail_op(run.client(), s, fault, run.index);
    run.put(dst, out)
}

pub(super) fn model_fail(
    r: &mut Reference,
    at: &At,
    observed: Observed,
    dst: usize,
    src: usize,
    fault: Fault,
) -> Result<(), String> {
    let Some(s) = r.slots[src].clone() else {
        return Ok(());
    };
    at.expect_registered(&observed, true)?;
    let own = match fault {
        Fault::Error => Failure::Engine(Error::operation("fail", format!("step {}", at.index))),
        Fault::Panic => Failure::Engine(Error::OperationPanicked {
            op: "panic".into(),
            message: format!("step {}", at.index).into(),
        }),
        Fault::Device => Failure::Device(Error::KernelFailed {
            kernel: "fail_on_device".into(),
            message: "injected device fault".into(),
        }),
    };
    let value = match (combine(&[&s]), fault) {
        // An engine failure upstream skips the op: its own fault never happens.
        (Err(upstream @ Failure::Engine(_)), _) => Err(upstream),
        // The device kernel waits for its input first: an upstream device failure wins.
        (Err(upstream), Fault::Device) => Err(upstream),
        _ => Err(own),
    };
    r.slots[dst] = Some(Model { len: s.len, value });
    Ok(())
}

// Capture: an identity custom op whose executor holds a clone of `captured`.

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

pub(super) fn run_capture(
    run: &mut Run,
    dst: usize,
    src: usize,
    captured: usize,
    panics: bool,
) -> Observed {
    let (Some(s), Some(held)) = (run.slots.get(src), run.slots.get(captured)) else {
        return Observed::Nothing;
    };
    let captured = Captured {
        _tensor: held.clone(),
        panic: panics.then(|| format!("step {}", run.index)),
    };
    let out = capture_op(run.client(), s, captured);
    run.put(dst, out)
}

pub(super) fn model_capture(
    r: &mut Reference,
    at: &At,
    observed: Observed,
    dst: usize,
    src: usize,
    captured: usize,
    panics: bool,
) -> Result<(), String> {
    let (Some(s), Some(_)) = (r.slots[src].clone(), r.slots[captured].as_ref()) else {
        return Ok(());
    };
    at.expect_registered(&observed, true)?;
    let value = if panics {
        // Whatever the op did, its disposal panicked: that is recorded on it.
        Err(Failure::Engine(Error::OperationPanicked {
            op: "capture".into(),
            message: format!("while dropping the executor: step {}", at.index).into(),
        }))
    } else {
        combine(&[&s]).map(|v| v[0].clone())
    };
    r.slots[dst] = Some(Model { len: s.len, value });
    Ok(())
}
