//! `StreamFusion<NdArray>` as a burn backend: each op family against plain NdArray, and the
//! cross-thread behaviour burn users rely on.

use burn_backend::ops::{BoolTensorOps, FloatTensorOps, IntTensorOps};
use burn_backend::{BoolDType, FloatDType, IntDType, Scalar, TensorData, read_sync};
use burn_ndarray::NdArray;
use fusion_streams::backend::StreamFusion;

type Plain = NdArray<f32>;
type B = StreamFusion<Plain>;

fn data(v: &[f32], shape: &[usize]) -> TensorData {
    TensorData::new(v.to_vec(), shape.to_vec())
}

#[test]
fn float_chain_matches_ndarray() {
    let device = Default::default();
    let a = data(&[1.0, -2.0, 3.5, 4.0, 0.5, -1.0], &[2, 3]);
    let run_ours = || {
        let x = B::float_from_data(a.clone(), &device);
        let y = B::float_exp(B::float_mul_scalar(x.clone(), Scalar::Float(0.5)));
        let z = B::float_add(y, x);
        let s = B::float_sum_dim(z, 1);
        read_sync(B::float_into_data(s)).unwrap()
    };
    let run_plain = || {
        let x = Plain::float_from_data(a.clone(), &device);
        let y = Plain::float_exp(Plain::float_mul_scalar(x.clone(), Scalar::Float(0.5)));
        let z = Plain::float_add(y, x);
        let s = Plain::float_sum_dim(z, 1);
        read_sync(Plain::float_into_data(s)).unwrap()
    };
    assert_eq!(run_ours(), run_plain());
}

#[test]
fn cross_thread_clone_and_drop() {
    let device = Default::default();
    let x = B::float_from_data(data(&[1.0, 2.0], &[2]), &device);
    let y = B::float_mul_scalar(x, Scalar::Float(3.0)); // pending
    let y2 = y.clone();
    let z = std::thread::spawn(move || B::float_add_scalar(y2, Scalar::Float(1.0)))
        .join()
        .unwrap();
    let got = read_sync(B::float_into_data(z)).unwrap();
    assert_eq!(got.to_vec::<f32>().unwrap(), vec![4.0, 7.0]);
    let mask = B::float_greater_elem(y, Scalar::Float(4.0), BoolDType::Native);
    let ints = B::bool_into_int(mask, IntDType::I64);
    let total = B::int_sum(ints);
    assert_eq!(
        read_sync(B::int_into_data(total))
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        vec![1]
    );
    let f = B::int_into_float(
        B::int_from_data(TensorData::new(vec![1i64, 2], [2]), &device),
        FloatDType::F32,
    );
    assert_eq!(
        read_sync(B::float_into_data(f))
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![1.0, 2.0]
    );
}
