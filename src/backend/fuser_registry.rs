//! Which backends fuse under [`super::StreamFusion`], and how: registries of fuser factories, of
//! fused softmax kernels and of batch runners, by backend type.
//!
//! `StreamFusion<B>` works for any [`BackendIr`](burn_ir::BackendIr) backend, and most of them have no fuser; the
//! ones that do are found here by type when a stream is created. With the `cuda` feature,
//! `CubeBackend<CudaRuntime, f32, i32, u8>` (and `.., u32>`) fuse through burn-cubecl-fusion's
//! fusers (see [`cube_fuser`](super::cube_fuser)), and run a softmax as one kernel
//! ([`cube_softmax`](super::cube_softmax)); [`register_fuser`] and [`register_softmax`] add
//! another backend, for instance a `CubeBackend` over another cubecl runtime.

use std::any::{Any, TypeId};
use std::sync::{Arc, OnceLock};

use hashbrown::HashMap;
use parking_lot::RwLock;

use burn_backend::tensor::FloatTensor;

use super::BackendRuntime;
use super::IrBackend;
use crate::runtime::{BatchPlacement, Fuser};

/// A type-erased factory: the backend's device in, a boxed `Box<dyn Fuser<BackendRuntime<B>>>`
/// out.
type Make = Arc<dyn Fn(&dyn Any) -> Option<Box<dyn Any + Send>> + Send + Sync>;

fn registry() -> &'static RwLock<HashMap<TypeId, Make>> {
    static REGISTRY: OnceLock<RwLock<HashMap<TypeId, Make>>> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let registry = RwLock::new(HashMap::new());
        #[cfg(feature = "cuda")]
        {
            use burn_cubecl::CubeBackend;
            use cubecl::cuda::CudaRuntime;
            insert::<CubeBackend<CudaRuntime, f32, i32, u8>>(&registry, super::cube_fuser);
            insert::<CubeBackend<CudaRuntime, f32, i32, u32>>(&registry, super::cube_fuser);
        }
        registry
    })
}

/// What a [`SoftmaxKernel`] computes along its axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SoftmaxKind {
    /// `exp(x - max) / sum(exp(x - max))`: burn's `softmax`.
    Softmax,
    /// `(x - max) - ln(sum(exp(x - max)))`: burn's `log_softmax`.
    LogSoftmax,
}

impl SoftmaxKind {
    /// burn's name of the operation: `softmax` or `log_softmax`.
    pub fn name(self) -> &'static str {
        match self {
            SoftmaxKind::Softmax => "softmax",
            SoftmaxKind::LogSoftmax => "log_softmax",
        }
    }
}

/// A softmax kernel of backend `B`: the tensor, the axis, what to compute; the result.
pub type SoftmaxKernel<B> = fn(FloatTensor<B>, usize, SoftmaxKind) -> FloatTensor<B>;

/// The softmax kernels, each a [`SoftmaxKernel<B>`] behind `Any`, by `TypeId::of::<B>()`.
fn softmax_registry() -> &'static RwLock<HashMap<TypeId, Box<dyn Any + Send + Sync>>> {
    static REGISTRY: OnceLock<RwLock<HashMap<TypeId, Box<dyn Any + Send + Sync>>>> =
        OnceLock::new();
    REGISTRY.get_or_init(|| {
        #[allow(unused_mut)]
        let mut registry: HashMap<TypeId, Box<dyn Any + Send + Sync>> = HashMap::new();
        #[cfg(feature = "cuda")]
        {
            use burn_cubecl::CubeBackend;
            use cubecl::cuda::CudaRuntime;
            type Narrow = CubeBackend<CudaRuntime, f32, i32, u8>;
            type Wide = CubeBackend<CudaRuntime, f32, i32, u32>;
            let narrow: SoftmaxKernel<Narrow> = super::cube_softmax::<CudaRuntime, f32, i32, u8>;
            let wide: SoftmaxKernel<Wide> = super::cube_softmax::<CudaRuntime, f32, i32, u32>;
            registry.insert(TypeId::of::<Narrow>(), Box::new(narrow));
            registry.insert(TypeId::of::<Wide>(), Box::new(wide));
        }
        RwLock::new(registry)
    })
}

/// Make `StreamFusion<B>`'s fusing streams run burn's `softmax` and `log_softmax` as one
/// operation calling `kernel`, for the engines opened after this call; `None` takes a registered
/// kernel back, so that they are recorded as burn's operations (five for a softmax) and offered
/// to the fusers. Where streams do not fuse (no fuser, or fusion off), each is always one
/// operation calling the backend's own `softmax` or `log_softmax`. With the `cuda` feature, the
/// CUDA `CubeBackend`s come registered with `cube_softmax`, and
/// `register_softmax::<CubeBackend<CudaRuntime, f32, i32, u8>>(None)` gives that backend's
/// reduce fusers burn's operations instead (`FUSION_STREAMS_CUBE_FUSERS`).
///
/// A kernel is a plain function of the backend's tensors; registering one for a backend whose
/// streams do not fuse changes nothing (NdArray's here, so this only shows the shape):
///
/// ```
/// use burn_backend::ops::ActivationOps;
/// use burn_backend::tensor::FloatTensor;
/// use burn_ndarray::NdArray;
/// use fusion_streams::backend::{SoftmaxKind, register_softmax};
///
/// type B = NdArray<f32>;
///
/// fn softmax(x: FloatTensor<B>, dim: usize, kind: SoftmaxKind) -> FloatTensor<B> {
///     match kind {
///         SoftmaxKind::Softmax => B::softmax(x, dim),
///         SoftmaxKind::LogSoftmax => B::log_softmax(x, dim),
///     }
/// }
///
/// register_softmax::<B>(Some(softmax));
/// register_softmax::<B>(None);
/// ```
pub fn register_softmax<B: IrBackend>(kernel: Option<SoftmaxKernel<B>>) {
    let mut registry = softmax_registry().write();
    match kernel {
        Some(kernel) => registry.insert(TypeId::of::<B>(), Box::new(kernel)),
        None => registry.remove(&TypeId::of::<B>()),
    };
}

/// The softmax kernel registered for `B`, if any.
pub(crate) fn softmax_for<B: IrBackend>() -> Option<SoftmaxKernel<B>> {
    softmax_registry()
        .read()
        .get(&TypeId::of::<B>())?
        .downcast_ref::<SoftmaxKernel<B>>()
        .copied()
}

/// The placements set with [`set_batch_placement`], by `TypeId::of::<B>()`.
fn batch_placement_registry() -> &'static RwLock<HashMap<TypeId, BatchPlacement>> {
    static REGISTRY: OnceLock<RwLock<HashMap<TypeId, BatchPlacement>>> = OnceLock::new();
    REGISTRY.get_or_init(|| RwLock::new(HashMap::new()))
}

/// Set where the streams of `StreamFusion<B>` that do not fuse run each batch of queued
/// operations that holds one spreading over `B`'s thread pool (a matmul, a convolution, a
/// pooling, an interpolation, an attention), for the engines opened after this call.
///
/// Without a call, a burn-ndarray backend (one whose type path starts with `burn_ndarray::`)
/// runs them on the engine's batch pool ([`BatchPlacement::BatchPool`]), and any other backend
/// in place. Only a backend that runs nothing on a thread pool may run them in place: a
/// burn-ndarray built without its `multi-threads` feature, say, which then saves a trip to the
/// pool per batch.
///
/// ```
/// use burn_ndarray::NdArray;
/// use fusion_streams::backend::{BatchPlacement, set_batch_placement};
///
/// // burn-ndarray's default, said explicitly.
/// set_batch_placement::<NdArray<f32>>(BatchPlacement::BatchPool);
/// ```
pub fn set_batch_placement<B: IrBackend>(placement: BatchPlacement) {
    batch_placement_registry()
        .write()
        .insert(TypeId::of::<B>(), placement);
}

/// Where `B`'s batches run: the placement set for it, else the batch pool for burn-ndarray.
pub(crate) fn batch_placement_for<B: IrBackend>() -> BatchPlacement {
    if let Some(set) = batch_placement_registry().read().get(&TypeId::of::<B>()) {
        return *set;
    }
    if std::any::type_name::<B>().starts_with("burn_ndarray::") {
        BatchPlacement::BatchPool
    } else {
        BatchPlacement::InPlace
    }
}

fn insert<B: IrBackend>(
    registry: &RwLock<HashMap<TypeId, Make>>,
    make: impl Fn(&B::Device) -> Box<dyn Fuser<BackendRuntime<B>>> + Send + Sync + 'static,
) {
    let make: Make = Arc::new(move |device: &dyn Any| {
        let device = device.downcast_ref::<B::Device>()?;
        Some(Box::new(make(device)) as Box<dyn Any + Send>)
    });
    registry.write().insert(TypeId::of::<B>(), make);
}

/// Make `StreamFusion<B>` fuse: each stream of an engine opened after this call gets
/// `make(device)` as its [`Fuser`] (while [`crate::EngineConfig::fusion`] is on). Replaces any
/// factory registered for `B` before, the built-in ones included.
pub fn register_fuser<B: IrBackend>(
    make: impl Fn(&B::Device) -> Box<dyn Fuser<BackendRuntime<B>>> + Send + Sync + 'static,
) {
    insert::<B>(registry(), make);
}

/// Whether a fuser is registered for `B` (its streams fuse while fusion is on).
pub(crate) fn has_fuser<B: IrBackend>() -> bool {
    registry().read().contains_key(&TypeId::of::<B>())
}

/// The fuser registered for `B`, if any.
pub(crate) fn fuser_for<B: IrBackend>(
    device: &B::Device,
) -> Option<Box<dyn Fuser<BackendRuntime<B>>>> {
    let make = registry().read().get(&TypeId::of::<B>())?.clone();
    // A factory is the user's code, called when a stream is made: one that panics leaves that
    // stream without a fuser rather than failing the operation that made it.
    let made = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| make(device))) {
        Ok(made) => made?,
        Err(payload) => {
            tracing::warn!("a fuser factory panicked: the stream runs unfused");
            crate::error::drop_payload(payload);
            return None;
        }
    };
    made.downcast::<Box<dyn Fuser<BackendRuntime<B>>>>()
        .ok()
        .map(|fuser| *fuser)
}
