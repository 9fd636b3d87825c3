//! Failures at every stage reach the caller as typed errors: executor errors and panics, device
//! failures after dispatch, incomplete executors, and bad input rejected before anything is
//! queued (with consumed operands handed back).

mod common;

use burn_backend::{DType, TensorData};
use burn_fusion::stream::Operation;
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr, UnaryOpIr};
use common::*;
use fusion_streams::host::{HostHandle, HostRuntime};
use fusion_streams::runtime::Kernel;
use fusion_streams::{Error, Operand};

type Handles = HandleContainer<HostHandle>;

#[test]
fn executor_panic_is_contained_and_reported_on_the_read() {
    let c = client();
    let x = f32s(&c, &[1.0]);
    let out = c
        .op("panicky")
        .read(&x)
        .output([1], DType::F32)
        .execute(|_: &CustomOpIr, _: &mut Handles| panic!("bad kernel config"))
        .unwrap()
        .remove(0);
    let downstream = out.exp().unwrap();
    let error = downstream.read().unwrap_err();
    assert!(error.is_propagated(), "{error:?}");
    match error.root() {
        Error::OperationPanicked { op, message } => {
            assert_eq!(&**op, "panicky");
            assert_eq!(&**message, "bad kernel config");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(
        error.to_string(),
        "operation `panicky` panicked: bad kernel config \
         (propagated: `exp` was skipped because its input carried this error)"
    );
    assert_eq!(
        values(&x.scale(2.0).unwrap()),
        vec![2.0],
        "engine keeps working"
    );
}

#[test]
fn device_failure_after_dispatch_propagates_to_downstream_reads() {
    let c = client();
    let x = f32s(&c, &[1.0, 2.0]);
    let bad = c.fail_on_device(&x).unwrap();
    let downstream = bad.scale(2.0).unwrap().add(&x).unwrap();
    c.drain();
    // The engine saw successful dispatches: the failure is the device's.
    assert_eq!(c.stats().ops_failed, 0);
    let err = downstream.read().unwrap_err();
    assert!(
        matches!(&err, Error::KernelFailed { kernel, .. } if &**kernel == "fail_on_device"),
        "{err:?}"
    );
    assert_eq!(bad.read().unwrap_err(), err);
    settle(&c);
    assert_eq!(
        host(&c).kernels_failed,
        3,
        "the failure and its two dependants"
    );
    assert_eq!(values(&x), vec![1.0, 2.0]);
}

#[test]
fn shape_dtype_and_arity_mismatches_are_rejected_before_queueing() {
    let c = client();
    let a = f32s(&c, &[1.0, 2.0]);
    let b = f32s(&c, &[1.0, 2.0, 3.0]);
    let i = c.from_data(TensorData::new(vec![1i32, 2], [2])).unwrap();
    let registered = c.stats().ops_registered;

    assert!(matches!(
        a.add(&b),
        Err(Error::ShapeMismatch { op, .. }) if &*op == "add"
    ));
    assert!(matches!(
        a.mul(&i),
        Err(Error::DTypeMismatch {
            op,
            expected: DType::F32,
            found: DType::I32
        }) if &*op == "mul"
    ));
    assert!(matches!(
        i.exp(),
        Err(Error::UnsupportedDType {
            op,
            dtype: DType::I32
        }) if &*op == "exp"
    ));
    assert!(matches!(
        a.matmul(&b),
        Err(Error::ShapeMismatch { op, .. }) if &*op == "matmul"
    ));
    assert!(matches!(
        c.launch(Kernel::Add, vec![Operand::Read(&a)]),
        Err(r) if matches!(r.error, Error::InvalidOperation { .. })
    ));
    assert_eq!(c.stats().ops_registered, registered, "nothing was queued");

    // Integers work where supported.
    assert_eq!(i.add(&i).unwrap().to_vec::<i32>().unwrap(), vec![2, 4]);
}

#[test]
fn a_rejected_call_hands_back_the_tensors_it_took() {
    let c = client();
    let a = f32s(&c, &[1.0, 2.0]);
    let b = f32s(&c, &[1.0, 2.0, 3.0]);
    let a_id = a.id();
    let rejected = c
        .launch(Kernel::Add, vec![Operand::Consume(a), Operand::Read(&b)])
        .unwrap_err();
    assert!(matches!(rejected.error, Error::ShapeMismatch { .. }));
    assert_eq!(rejected.returned.len(), 1);
    let a = rejected.returned.into_iter().next().unwrap();
    assert_eq!(a.id(), a_id, "the same tensor, untouched");
    assert_eq!(values(&a), vec![1.0, 2.0]);
}

#[test]
fn a_tensor_of_another_client_is_rejected() {
    let c1 = client();
    let c2 = client();
    let a = f32s(&c1, &[1.0]);
    let b = f32s(&c2, &[1.0]);
    let err = c1.add(&a, &b).unwrap_err();
    assert!(
        matches!(err, Error::DeviceMismatch { id, .. } if id == b.id()),
        "{err:?}"
    );
    // Both clients are on the default device: the message says that is the problem.
    assert!(err.to_string().contains("two clients"), "{err}");
    let rejected = c1
        .launch(Kernel::Exp, vec![Operand::Consume(b)])
        .unwrap_err();
    assert_eq!(values(&rejected.returned[0]), vec![1.0]);
}

#[test]
fn malformed_host_data_is_rejected() {
    let c = client();
    let bad = TensorData::from_bytes_vec(vec![0u8; 7], [2], DType::F32);
    assert!(matches!(c.from_data(bad), Err(Error::InvalidData(_))));
    let unsupported = TensorData::new(vec![1.0f64], [1]);
    assert!(matches!(
        c.from_data(unsupported),
        Err(Error::UnsupportedDType {
            dtype: DType::F64,
            ..
        })
    ));
    assert!(c.stats().is_quiescent());
}

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
