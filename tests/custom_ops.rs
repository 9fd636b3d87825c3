//! Operations built with `FusionClient::op`: burn operations through the adapter (and a burn IR
//! that names other tensors, refused with the operands back), and a host kernel dispatched to the
//! stream's worker, whose errors and panics land on its output.

mod common;

use burn_backend::DType;
use burn_fusion::stream::Operation;
use burn_ir::{CustomOpIr, OperationIr, TensorIr, UnaryOpIr};
use common::*;
use fusion_streams::Error;
use fusion_streams::host::HostRuntime;

/// A burn operation, written the way burn's own ops are: it holds its IR and reads/registers
/// handles in `execute`.
#[derive(Debug)]
struct CopyOp {
    desc: UnaryOpIr,
    fail: bool,
}

impl Operation<HostRuntime> for CopyOp {
    fn execute(&self, handles: &mut Handles) {
        assert!(!self.fail, "burn op failed");
        let input = handles.get_handle(&self.desc.input.id, &self.desc.input.status);
        handles.register_handle(self.desc.out.id, input);
    }
}

fn copy_ir(inputs: &[TensorIr], outputs: &[TensorIr]) -> UnaryOpIr {
    UnaryOpIr {
        input: inputs[0].clone(),
        out: outputs[0].clone(),
    }
}

/// Register `CopyOp` over `x` the way burn registers its own ops.
fn burn_copy(c: &Client, x: &Tensor, fail: bool) -> Tensor {
    c.op("copy")
        .read(x)
        .output(x.shape().clone(), DType::F32)
        .execute_burn(|inputs, outputs| {
            let desc = copy_ir(inputs, outputs);
            (
                OperationIr::Float(DType::F32, burn_ir::FloatOperationIr::Exp(desc.clone())),
                CopyOp { desc, fail },
            )
        })
        .unwrap()
        .remove(0)
}

#[test]
fn burn_operations_run_through_the_adapter() {
    let c = client();
    let x = f32s(&c, &[3.0, 4.0]);
    assert_eq!(values(&burn_copy(&c, &x, false)), vec![3.0, 4.0]);
    assert!(matches!(
        burn_copy(&c, &x, true).read().unwrap_err(),
        Error::OperationPanicked { .. }
    ));
}

#[test]
fn a_burn_ir_that_names_other_tensors_is_rejected_with_operands_back() {
    let c = client();
    let x = f32s(&c, &[1.0]);
    let other = f32s(&c, &[2.0]);
    let other_ir = TensorIr {
        id: other.id(),
        shape: other.shape().clone(),
        status: burn_ir::TensorStatus::ReadOnly,
        dtype: DType::F32,
    };
    let rejected = c
        .op("mislabelled")
        .consume(x)
        .output([1], DType::F32)
        .execute_burn(|_, outputs| {
            let desc = UnaryOpIr {
                input: other_ir.clone(),
                out: outputs[0].clone(),
            };
            (
                OperationIr::Float(DType::F32, burn_ir::FloatOperationIr::Exp(desc.clone())),
                CopyOp { desc, fail: false },
            )
        })
        .unwrap_err();
    assert!(matches!(rejected.error, Error::InvalidOperation { .. }));
    assert_eq!(values(&rejected.returned[0]), vec![1.0]);
    assert_eq!(c.stats().ops_registered, 0);
}

/// A host custom op built on `HostContext::dispatch`: the kernel runs on the stream's worker, not
/// in the executor, so registering and executing the op never waits for data; its error or panic
/// is the output's error, and an input's failure reaches the output without running it.
#[test]
fn a_dispatched_host_kernel_runs_on_the_worker_and_reports_on_its_output() {
    use fusion_streams::host::{HostSlice, HostValues};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let c = client();
    let runs = Arc::new(AtomicUsize::new(0));
    let dispatched = |input: &Tensor, behaviour: &'static str| {
        let (context, runs) = (c.context().clone(), runs.clone());
        c.op(behaviour)
            .read(input)
            .output([2], DType::F32)
            .execute(move |op: &CustomOpIr, handles: &mut Handles| {
                let input = handles.get_handle(&op.inputs[0].id, &op.inputs[0].status);
                let runs = runs.clone();
                let out = context.dispatch(behaviour, &[&input], move |inputs| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    match (behaviour, inputs[0]) {
                        ("fails", _) => Err(Error::operation("fails", "injected")),
                        ("panics", _) => panic!("injected"),
                        (_, HostSlice::F32(v)) => {
                            Ok(HostValues::F32(v.iter().map(|x| x + 1.0).collect()))
                        }
                        (_, other) => Err(Error::operation("plus_one", format!("{other:?}"))),
                    }
                });
                handles.register_handle(op.outputs[0].id, out);
                Ok(())
            })
            .unwrap()
            .remove(0)
    };

    // Asynchronous: with the stream's worker held, the op registers and executes (a sync of the
    // engine's queue), and the kernel has not run.
    let x = f32s(&c, &[1.0, 2.0]);
    let pause = c.context().pause(c.execution_stream());
    let y = dispatched(&x, "plus_one");
    c.streams().drain_all();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "ran while the worker was held"
    );
    drop(pause);
    assert_eq!(values(&y), vec![2.0, 3.0]);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Errors and panics of the kernel land on its output.
    let failed = dispatched(&x, "fails").read().unwrap_err();
    assert!(
        matches!(failed.root(), Error::OperationFailed { op, .. } if &**op == "fails"),
        "{failed:?}"
    );
    let panicked = dispatched(&x, "panics").read().unwrap_err();
    assert!(
        matches!(panicked, Error::KernelFailed { ref kernel, .. } if &**kernel == "panics"),
        "{panicked:?}"
    );

    // A failed input: the kernel does not run, and the output carries the input's failure.
    let before = runs.load(Ordering::SeqCst);
    let bad = c.fail_on_device(&x).unwrap();
    let downstream = dispatched(&bad, "plus_one").read().unwrap_err();
    assert!(
        matches!(downstream.root(), Error::KernelFailed { .. }),
        "{downstream:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), before, "ran on a failed input");
    drop((x, y, bad));
    assert_nothing_held(&c);
}
