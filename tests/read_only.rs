//! `Fuser::keeps_read_only`: a backend's rule that some consumed inputs are never written in
//! place also holds for operations that run without fusion (the CUDA backends keep a buffer
//! another stream allocated read-only; here a fuser for one NdArray flavour keeps every
//! consumed input read-only, and another flavour has no fuser).
//!
//! Its own test binary: the fuser registry is global per backend type.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn_backend::{DType, TensorData};
use burn_ir::{CustomOpIr, HandleContainer, HandleKind, OperationIr};
use burn_ndarray::{NdArray, NdArrayTensor};
use fusion_streams::backend::{BackendContext, BackendRuntime, StreamFusion, register_fuser};
use fusion_streams::runtime::Fuser;
use fusion_streams::{Error, FusionClient, Result};

/// The flavour with a fuser that fuses nothing and keeps every consumed input read-only.
type Kept = NdArray<f32, i64, i8>;
/// The flavour without a fuser.
type Free = NdArray<f32, i32, i8>;

struct KeepsEverythingReadOnly;

impl Fuser<BackendRuntime<Kept>> for KeepsEverythingReadOnly {
    fn offer(&mut self, _: &OperationIr, _: &HandleContainer<HandleKind<Kept>>) -> bool {
        false
    }

    fn covered(&self) -> usize {
        0
    }

    fn execute(
        &mut self,
        _: &mut HandleContainer<HandleKind<Kept>>,
        _: &BackendContext<Kept>,
    ) -> Result<usize> {
        Err(Error::Runtime("this fuser covers nothing".into()))
    }

    fn reset(&mut self) {}

    fn keeps_read_only(&self, _: &HandleKind<Kept>) -> bool {
        true
    }
}

/// Whether a custom operation that consumes a fresh tensor finds its buffer with no other
/// owner (what lets a backend write it in place). The operation passes the buffer through, so
/// the value must come out unchanged either way.
fn consumed_buffer_is_unique<B>(client: &FusionClient<BackendRuntime<B>>) -> bool
where
    B: burn_ir::BackendIr<Handle = HandleKind<B>>,
    B: burn_backend::Backend<FloatTensorPrimitive = NdArrayTensor>,
{
    let x = client
        .from_data(TensorData::new(vec![1.0f32, -2.0, 3.5], [3]))
        .expect("upload");
    let unique = Arc::new(AtomicBool::new(false));
    let seen = unique.clone();
    let out = client
        .op("probe")
        .consume(x)
        .output([3], DType::F32)
        .execute(
            move |op: &CustomOpIr, handles: &mut HandleContainer<HandleKind<B>>| {
                let input = &op.inputs[0];
                assert_eq!(input.status, burn_ir::TensorStatus::ReadWrite);
                let handle = handles.get_handle(&input.id, &input.status);
                let HandleKind::Float(NdArrayTensor::F32(storage)) = &handle else {
                    return Err(Error::Runtime("not an f32 NdArray tensor".into()));
                };
                seen.store(storage.is_unique(), Ordering::SeqCst);
                handles.register_handle(op.outputs[0].id, handle);
                Ok(())
            },
        )
        .map_err(|rejected| rejected.error)
        .expect("queued");
    let data = out.into_iter().next().unwrap().into_data().expect("read");
    assert_eq!(data.to_vec::<f32>().unwrap(), vec![1.0, -2.0, 3.5]);
    unique.load(Ordering::SeqCst)
}

#[test]
fn a_consumed_input_the_fuser_keeps_read_only_has_a_second_owner_while_the_op_runs() {
    register_fuser::<Kept>(|_| Box::new(KeepsEverythingReadOnly));
    let kept = StreamFusion::<Kept>::client(&Default::default());
    let free = StreamFusion::<Free>::client(&Default::default());

    // Without a fuser, a consumed fresh buffer is the operation's alone.
    assert!(consumed_buffer_is_unique(&free));
    // With the rule, fusion on or off: never alone, so never written in place.
    assert!(!consumed_buffer_is_unique(&kept));
    kept.streams().set_fusion(false);
    assert!(!consumed_buffer_is_unique(&kept));
    kept.streams().set_fusion(true);

    // The second owner lives only for the call: nothing is held afterwards.
    kept.streams().drain_all();
    let stats = kept.stats();
    assert!(stats.is_quiescent(), "{stats:?}");
    free.streams().drain_all();
    let stats = free.stats();
    assert!(stats.is_quiescent(), "{stats:?}");
}
