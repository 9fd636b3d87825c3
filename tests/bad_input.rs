//! Bad input through the public API, refused before anything is queued: a clear, typed error
//! every time — never a panic, never a hang — and whatever the call took is handed back.
//! Failures after queueing (an operation's error or panic, a device failure) are in
//! `faults.rs`; operations built with `FusionClient::op` in `custom_ops.rs`.

mod common;

use burn_backend::{DType, TensorData};
use common::*;
use fusion_streams::host::{HostDevice, HostRuntime};
use fusion_streams::runtime::{Kernel, TransferRuntime};
use fusion_streams::transfer::{HeldSession, PinnedHostBuffer, PublicationAdmissionError};
use fusion_streams::{EngineConfig, Error, FusionClient, Operand};

#[test]
fn mismatched_shapes_are_refused_with_the_operands_back() {
    let c = client();
    let a = f32s(&c, &[1.0, 2.0]);
    let b = f32s(&c, &[1.0, 2.0, 3.0]);
    let registered = c.stats().ops_registered;
    assert!(matches!(a.add(&b), Err(Error::ShapeMismatch { op, .. }) if &*op == "add"));
    assert!(matches!(a.matmul(&b), Err(Error::ShapeMismatch { op, .. }) if &*op == "matmul"));
    let m = c
        .from_data(TensorData::new(vec![1.0f32; 6], [2, 3]))
        .unwrap();
    assert!(matches!(m.matmul(&m), Err(Error::ShapeMismatch { .. })));
    assert_eq!(c.stats().ops_registered, registered, "nothing was queued");
    let (a_id, b_id) = (a.id(), b.id());
    let rejected = c
        .launch(Kernel::Mul, vec![Operand::Consume(a), Operand::Consume(b)])
        .unwrap_err();
    assert!(matches!(rejected.error, Error::ShapeMismatch { .. }));
    let back: Vec<_> = rejected.returned.iter().map(|t| t.id()).collect();
    assert_eq!(
        back,
        vec![a_id, b_id],
        "both operands back, the same tensors"
    );
    assert_eq!(values(&rejected.returned[0]), vec![1.0, 2.0], "untouched");
}

#[test]
fn mismatched_dtypes_are_refused() {
    let c = client();
    let f = f32s(&c, &[1.0, 2.0]);
    let i = c.from_data(TensorData::new(vec![1i32, 2], [2])).unwrap();
    assert!(matches!(
        f.mul(&i),
        Err(Error::DTypeMismatch { op, expected: DType::F32, found: DType::I32 }) if &*op == "mul"
    ));
    assert!(matches!(
        i.exp(),
        Err(Error::UnsupportedDType { op, dtype: DType::I32 }) if &*op == "exp"
    ));
    // Integers work where supported.
    assert_eq!(i.add(&i).unwrap().to_vec::<i32>().unwrap(), vec![2, 4]);
}

#[test]
fn malformed_or_unsupported_host_data_is_refused() {
    let c = client();
    // Bytes that do not match the dtype and shape.
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

#[test]
fn a_tensor_of_another_client_on_the_same_device_is_refused() {
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
    assert_eq!(values(&rejected.returned[0]), vec![1.0], "handed back");
}

#[test]
fn tensors_of_another_device_are_refused() {
    let here = client();
    let there =
        FusionClient::<HostRuntime>::with_config(HostDevice::new(1), EngineConfig::default())
            .unwrap();
    let a = f32s(&here, &[1.0]);
    let b = f32s(&there, &[1.0]);
    let err = a.add(&b).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { .. }));
    assert!(err.to_string().contains("tensor of"), "{err}");
    assert!(matches!(here.exp(&b), Err(Error::DeviceMismatch { .. })));
    let mut session = HeldSession::open(&here).unwrap();
    match unsafe { session.publish(b) } {
        Err(PublicationAdmissionError::Rejected(r)) => {
            assert!(matches!(r.reason, Error::DeviceMismatch { .. }));
            assert_eq!(values(&r.value), vec![1.0], "the value comes back");
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn zero_length_buffers_are_refused() {
    let c = client();
    assert!(matches!(
        PinnedHostBuffer::new(0),
        Err(Error::InvalidData(_))
    ));
    assert!(matches!(
        HostRuntime::alloc_pinned(c.context(), 0),
        Err(Error::InvalidData(_))
    ));
}

#[test]
fn an_empty_value_is_refused_at_publication_with_the_value_back() {
    let c = client();
    let empty = c
        .from_data(TensorData::new(Vec::<f32>::new(), [0]))
        .unwrap();
    let mut session = HeldSession::open(&c).unwrap();
    match unsafe { session.publish(empty) } {
        Err(PublicationAdmissionError::Rejected(r)) => {
            assert!(matches!(r.reason, Error::InvalidData(_)), "{:?}", r.reason);
            assert_eq!(r.value.shape().num_elements(), 0, "the value comes back");
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// Publishing "the same value twice" can only mean two clones (the value itself moves into its
/// publication; see the `compile_fail` doctest on `publish`): both are valid, independent
/// publications of one allocation.
#[test]
fn publishing_clones_of_one_value_twice_gives_two_valid_publications() {
    let c = client();
    let x = f32s(&c, &[3.0, 4.0]);
    let mut session = HeldSession::open(&c).unwrap();
    let first = unsafe { session.publish(x.clone()) }.unwrap();
    let second = unsafe { session.publish(x.clone()) }.unwrap();
    session.close();
    drop(x);
    for p in [second, first] {
        let buffer = p
            .download_into(PinnedHostBuffer::new(8).unwrap())
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(buffer_f32s(&buffer), vec![3.0, 4.0]);
    }
    c.streams().drain_all();
    settle(&c);
    assert_eq!(host(&c).live_buffers(), 0);
}

#[test]
fn a_second_session_on_a_stream_is_refused() {
    let c = client();
    let session = HeldSession::open(&c).unwrap();
    assert!(matches!(
        HeldSession::open(&c),
        Err(Error::SessionHeld { .. })
    ));
    session.close();
    HeldSession::open(&c).unwrap().close();
}

#[test]
fn an_operation_arity_mismatch_is_refused() {
    let c = client();
    let a = f32s(&c, &[1.0]);
    assert!(matches!(
        c.launch(Kernel::Add, vec![Operand::Read(&a)]),
        Err(r) if matches!(r.error, Error::InvalidOperation { .. })
    ));
    assert!(matches!(
        c.launch(Kernel::Exp, vec![]),
        Err(r) if matches!(r.error, Error::InvalidOperation { .. })
    ));
}

/// Errors show shapes the way users write them, `[2, 3]`, and every rejection converts into
/// the crate's error for `?`.
#[test]
fn errors_show_shapes_as_lists_and_convert_for_question_mark() {
    let c = client();
    let a = f32s(&c, &[1.0, 2.0]);
    let b = f32s(&c, &[1.0, 2.0, 3.0]);
    let message = a.add(&b).unwrap_err().to_string();
    assert!(message.contains("[2] and [3] differ"), "{message}");
    fn launch(c: &Client, t: Tensor) -> fusion_streams::Result<Tensor> {
        Ok(c.launch(
            Kernel::Exp,
            vec![Operand::Consume(t.clone()), Operand::Consume(t)],
        )?)
    }
    assert!(matches!(launch(&c, a), Err(Error::InvalidOperation { .. })));
}
