//! Publication on `StreamFusion<B>`, written as burn code: a value a burn program computed is
//! published from a held session and downloaded into a pinned buffer, and what comes back is
//! what burn's own `into_data` of the same value gives — for every kind and dtype the backend
//! stores, and for every way a value is produced (a fused run of element-wise operations, a
//! matmul, an operation that wrote in place, a value produced on another thread, a value still
//! queued when `publish` is called).
//!
//! NdArray in CI; with the `cuda` feature, burn's CubeCL backend on the GPU (ignored unless asked
//! for: scripts/gpu-tests.sh builds the binary, scripts/gpu-evidence.sh runs it).

mod under_test;

use std::thread;

use burn_backend::{Backend, DType, DTypeUsage, TensorData, TensorPrimitive};
use burn_tensor::{Bool, Int, Tensor};
use fusion_streams::backend::{Publication, Session};
use fusion_streams::transfer::{PinnedHostBuffer, PublicationAdmissionError, PublicationError};
use fusion_streams::{Error, FusionClient};

use under_test::{Ours as B, Plain};

/// Publish `tensor` and download it; its data as burn reads it must come back, byte for byte.
fn round_trip<const D: usize, K>(session: &mut Session<Plain>, tensor: Tensor<B, D, K>)
where
    K: burn_tensor::BasicOps<B>,
    K::Elem: burn_tensor::Element,
    K::Primitive:
        fusion_streams::transfer::Publishable<fusion_streams::backend::BackendRuntime<Plain>>,
{
    let expected = tensor.clone().into_data();
    let device = tensor.device();
    // SAFETY: every value these tests publish was produced through the engine's operations,
    // which order it before the session's stream.
    let publication = unsafe { session.publish(tensor) }.expect("publish");
    assert_eq!(publication.bytes(), expected.as_bytes().len());
    let buffer = B::pinned_buffer(&device, publication.bytes()).unwrap();
    let (data, _) = publication
        .download_into(buffer)
        .expect("download")
        .wait_data()
        .expect("copy");
    assert_eq!(data.shape, expected.shape);
    assert_eq!(data.dtype, expected.dtype);
    assert_eq!(data.as_bytes(), expected.as_bytes(), "{:?}", expected.dtype);
}

fn stored(dtype: DType) -> bool {
    Plain::dtype_usage(&Default::default(), dtype).contains(DTypeUsage::Storage)
}

#[test]
#[cfg_attr(
    feature = "cuda",
    ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"
)]
fn every_kind_and_every_stored_dtype_round_trips() {
    let device = Default::default();
    let mut session = B::session(&device).unwrap();
    let floats = Tensor::<B, 2>::from_data([[1.5f32, -2.25, 3.0], [0.5, 7.0, -8.125]], &device);
    let ints = Tensor::<B, 2, Int>::from_data([[1i64, -2, 3], [40, 5, 126]], &device);
    let mut published = Vec::new();
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        if stored(dtype) {
            round_trip(&mut session, floats.clone().cast(dtype));
            published.push(dtype);
        }
    }
    let int_dtypes = [
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U64,
        DType::U32,
        DType::U16,
        DType::U8,
    ];
    for dtype in int_dtypes {
        if stored(dtype) {
            let value = ints.clone().abs().cast(dtype);
            round_trip(&mut session, value);
            published.push(dtype);
        }
    }
    let mask = floats.clone().greater_elem(1.0);
    published.push(mask.dtype());
    round_trip::<2, Bool>(&mut session, mask);
    println!("published and read back: {published:?}");
    // Not vacuous: every backend stores these.
    for dtype in [DType::F32, DType::I32] {
        assert!(published.contains(&dtype), "{dtype:?} was not published");
    }
}

#[test]
#[cfg_attr(
    feature = "cuda",
    ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"
)]
fn values_produced_every_way_a_burn_program_produces_them() {
    let device = Default::default();
    let mut session = B::session(&device).unwrap();
    let x = Tensor::<B, 2>::random(
        [64, 48],
        burn_tensor::Distribution::Uniform(-1.0, 1.0),
        &device,
    );
    let w = Tensor::<B, 2>::random(
        [48, 32],
        burn_tensor::Distribution::Uniform(-1.0, 1.0),
        &device,
    );
    // A run of element-wise operations (one fused kernel where the backend fuses).
    round_trip(&mut session, ((x.clone() * 2.0).exp() + 1.0).tanh());
    // A matmul, and a matmul with element-wise operations after it.
    round_trip(&mut session, x.clone().matmul(w.clone()));
    round_trip(
        &mut session,
        (x.clone().matmul(w.clone()) + 0.5).clamp_min(0.0),
    );
    // An operation that wrote in place: the only owner of its input.
    let fresh = x.clone() + 0.0;
    round_trip(&mut session, fresh.add_scalar(1.0).mul_scalar(3.0));
    // A value produced on another thread's stream, moved here.
    let (xs, ws) = (x.clone(), w.clone());
    let other = thread::spawn(move || xs.matmul(ws).neg().exp())
        .join()
        .unwrap();
    round_trip(&mut session, other);
    // A value produced on another thread and still queued there, shared with this one.
    let (tx, rx) = std::sync::mpsc::channel();
    let (xs, back) = (x.clone(), std::sync::mpsc::channel::<()>());
    let producer = thread::spawn(move || {
        let lazy = (xs * 3.0).sin();
        tx.send(lazy.clone()).unwrap();
        back.1.recv().unwrap();
        lazy
    });
    round_trip(&mut session, rx.recv().unwrap());
    back.0.send(()).unwrap();
    round_trip(&mut session, producer.join().unwrap());
    // A value still queued on this thread when it is published: nothing read it yet.
    let queued = (x.clone() - 0.25).abs().sqrt();
    round_trip(&mut session, queued);
    // A value reduced to a scalar, and one reshaped and transposed.
    round_trip(&mut session, x.clone().sum());
    round_trip(&mut session, x.clone().reshape([48, 64]).transpose());
}

#[test]
#[cfg_attr(
    feature = "cuda",
    ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"
)]
fn a_publication_outlives_its_session_and_every_tensor() {
    let device = Default::default();
    let publication: Publication<Plain> = {
        let mut session = B::session(&device).unwrap();
        let x = Tensor::<B, 1>::from_data([1.0f32, 2.0, 3.0], &device);
        let y = x.clone().exp().log() * 2.0;
        // SAFETY: `y` was produced on this thread's stream.
        let publication = unsafe { session.publish(y) }.unwrap();
        drop((x, session));
        publication
    };
    // Another session on this thread, and work on it, do not disturb the publication.
    let mut again = B::session(&device).unwrap();
    let z = Tensor::<B, 1>::ones([3], &device) * 5.0;
    // SAFETY: produced on this thread's stream.
    let later = unsafe { again.publish(z) }.unwrap();
    drop(again);
    let buffer = B::pinned_buffer(&device, publication.bytes()).unwrap();
    // Page-locked by the driver on CUDA; the host backend's copies need no locking.
    assert_eq!(buffer.is_page_locked(), cfg!(feature = "cuda"));
    assert!(!PinnedHostBuffer::new(16).unwrap().is_page_locked());
    let (data, buffer) = publication
        .download_into(buffer)
        .unwrap()
        .wait_data()
        .unwrap();
    data.assert_approx_eq::<f32>(&TensorData::from([2.0f32, 4.0, 6.0]), Default::default());
    let (data, _) = later.download_into(buffer).unwrap().wait_data().unwrap();
    assert_eq!(data.to_vec::<f32>().unwrap(), vec![5.0; 3]);
}

/// A model's batches, computed on a worker thread while the previous one downloads into the
/// same buffer: each download's data is the batch it published.
#[test]
#[cfg_attr(
    feature = "cuda",
    ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"
)]
fn batches_download_into_one_reused_buffer_while_the_next_computes() {
    const BATCHES: usize = 8;
    let device: <B as burn_backend::BackendTypes>::Device = Default::default();
    let worker = thread::spawn(move || {
        let mut session = B::session(&device).unwrap();
        let w = Tensor::<B, 2>::from_data([[1.0f32, 0.5], [-1.0, 2.0]], &device);
        let mut buffer = None;
        let mut pending = None;
        let mut got = Vec::new();
        for batch in 0..BATCHES {
            let x = Tensor::<B, 2>::full([4, 2], batch as f32, &device);
            let y = x.matmul(w.clone()).clamp_min(0.0);
            // SAFETY: `y` was produced on this thread's stream.
            let publication = unsafe { session.publish(y) }.unwrap();
            // The previous batch's copy finished while this one computed: its buffer is free.
            if let Some(download) = pending.take() {
                let (data, free) =
                    fusion_streams::backend::Download::<Plain>::wait_data(download).unwrap();
                got.push(data);
                buffer = Some(free);
            }
            let target = match buffer.take() {
                Some(b) => b,
                None => B::pinned_buffer(&device, publication.bytes()).unwrap(),
            };
            pending = Some(publication.download_into(target).unwrap());
        }
        got.push(pending.unwrap().wait_data().unwrap().0);
        got
    });
    let got = worker.join().unwrap();
    assert_eq!(got.len(), BATCHES);
    for (batch, data) in got.iter().enumerate() {
        let b = batch as f32;
        // Rows of [b, b] times [[1, 0.5], [-1, 2]], clamped at 0: [0, 2.5 b].
        let expected = TensorData::new([0.0, 2.5 * b].repeat(4), [4, 2]);
        assert_eq!(data, &expected, "batch {batch}");
    }
}

#[test]
#[cfg_attr(
    feature = "cuda",
    ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"
)]
fn refusals_hand_every_owner_back() {
    let device = Default::default();
    let mut session = B::session(&device).unwrap();

    // A quantized value: its bytes are the backend's packing, not a plain layout.
    let x = Tensor::<B, 1>::from_data([1.0f32, -2.0, 3.0, 4.0], &device);
    let scheme = B::default_quant_scheme(&device);
    let quantized = x.clone().quantize_dynamic(&scheme);
    // SAFETY: produced on this thread's stream.
    let rejected = match unsafe { session.publish(quantized) } {
        Err(PublicationAdmissionError::Rejected(rejected)) => rejected,
        other => panic!("a quantized value was not refused: {other:?}"),
    };
    assert!(matches!(rejected.reason, Error::UnsupportedDType { .. }));
    // The value comes back, still a live burn tensor.
    let back = Tensor::<B, 1>::from_primitive(TensorPrimitive::QFloat(rejected.value));
    back.dequantize().into_data().assert_approx_eq::<f32>(
        &x.clone().into_data(),
        burn_tensor::Tolerance::absolute(0.1),
    );

    // A buffer of the wrong length: the publication and the buffer both come back.
    // SAFETY: produced on this thread's stream.
    let publication = unsafe { session.publish(x.clone()) }.unwrap();
    let short = B::pinned_buffer(&device, 8).unwrap();
    let refused = match publication.download_into(short) {
        Err(PublicationError::Rejected(refused)) => refused,
        Ok(_) => panic!("a short buffer was accepted"),
        Err(other) => panic!("{other:?}"),
    };
    assert!(matches!(
        refused.reason,
        Error::BufferSize {
            expected: 16,
            found: 8
        }
    ));
    let buffer = B::pinned_buffer(&device, 16).unwrap();
    let (data, _) = refused
        .publication
        .download_into(buffer)
        .unwrap()
        .wait_data()
        .unwrap();
    assert_eq!(data, x.into_data());
    assert_eq!(refused.buffer.len(), 8);

    // A second session on this thread's stream is refused while this one is held.
    assert!(matches!(
        B::session(&device),
        Err(Error::SessionHeld { .. })
    ));
}

/// A value whose producer failed: the error travels with it, and publication refuses it with the
/// root cause, handing it back. (NdArray's integer division panics on a zero divisor when the
/// stream runs it; a CUDA kernel does not fail on it.)
#[cfg(not(feature = "cuda"))]
#[test]
fn a_failed_producer_is_refused_with_its_cause() {
    let device = Default::default();
    let mut session = B::session(&device).unwrap();
    let x = Tensor::<B, 1, Int>::from_data([1i64, 2, 3], &device);
    let bad = (x / 0) + 1;
    // SAFETY: produced on this thread's stream.
    match unsafe { session.publish(bad) } {
        Err(PublicationAdmissionError::Rejected(rejected)) => {
            let message = rejected.reason.to_string();
            assert!(message.contains("divide by zero"), "{message}");
            // The value comes back with its error: reading it reports the same cause.
            let back = Tensor::<B, 1, Int>::from_primitive(rejected.value);
            let read = back.try_into_data().unwrap_err().to_string();
            assert!(read.contains("divide by zero"), "{read}");
        }
        other => panic!("a failed producer was published: {other:?}"),
    }
}

/// Publications and downloads dropped in flight are retired, and released once the engine
/// synchronises: nothing is left behind. On an engine of its own, so that no other test's
/// transfers are counted.
#[test]
#[cfg_attr(
    feature = "cuda",
    ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"
)]
fn dropped_in_flight_is_released_and_nothing_is_left() {
    use fusion_streams::backend::BackendRuntime;
    use fusion_streams::transfer::HeldSession;
    let client = FusionClient::<BackendRuntime<Plain>>::new(Default::default()).unwrap();
    let mut session = HeldSession::open(&client).unwrap();
    let big = client
        .from_data(TensorData::new(vec![1.0f32; 1 << 20], [1 << 20]))
        .unwrap();
    for round in 0..16 {
        let value = big.scale(f64::from(round)).unwrap();
        // SAFETY: produced on this thread's stream.
        let publication = unsafe { session.publish(value) }.unwrap();
        if round % 2 == 0 {
            drop(publication);
        } else {
            let buffer = PinnedHostBuffer::new(publication.bytes()).unwrap();
            drop(publication.download_into(buffer).unwrap());
        }
    }
    drop(big);
    session.synchronize().unwrap();
    let retired = client.context().retirement().stats();
    assert_eq!((retired.pending, retired.permanent), (0, 0), "{retired:?}");
    let stats = client.stats();
    assert!(stats.is_quiescent(), "the engine still holds {stats:?}");
}

/// A DMA copy whose event cannot be recorded after the copy was enqueued (injected): the
/// download is refused (direct route) or fails (waiter route), and the buffer that comes back
/// is the caller's alone — no copy still writes it. Bytes written into it afterwards stay.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"]
fn a_copy_that_fails_after_its_enqueue_gives_the_buffer_back_only_once_it_finished() {
    const N: usize = 64 << 20; // 256 MiB: a copy of about 5 ms on an H200
    let device = Default::default();
    let mut session = B::session(&device).unwrap();
    let x = Tensor::<B, 1>::ones([N], &device) * 3.0;
    for direct in [true, false] {
        let value = x.clone() * 1.0;
        // SAFETY: produced on this thread's stream.
        let mut publication = unsafe { session.publish(value) }.unwrap();
        if direct {
            // The frontier reached: the copy is enqueued by the caller, at once.
            publication.await_frontier().unwrap();
        }
        let buffer = B::pinned_buffer(&device, publication.bytes()).unwrap();
        fusion_streams::backend::fail_next_download_after_enqueue();
        let (route, mut buffer) = match publication.download_into(buffer) {
            Err(PublicationError::Rejected(refused)) => ("refused", refused.buffer),
            Ok(pending) => (
                "failed",
                pending.wait().expect_err("an injected failure").buffer,
            ),
            Err(other) => panic!("{other:?}"),
        };
        println!("direct {direct}: the download {route}");
        let bytes = buffer.as_bytes_mut();
        let len = bytes.len();
        let sentinel = 7.0f32.to_ne_bytes();
        bytes[..4].copy_from_slice(&sentinel);
        bytes[len - 4..].copy_from_slice(&sentinel);
        // A copy still running would overwrite both ends with 3.0 within a few ms.
        thread::sleep(std::time::Duration::from_millis(100));
        let bytes = buffer.as_bytes();
        assert_eq!(
            &bytes[..4],
            &sentinel,
            "direct {direct}: the copy ran after the hand-back"
        );
        assert_eq!(
            &bytes[len - 4..],
            &sentinel,
            "direct {direct}: the copy ran after the hand-back"
        );
    }
}
