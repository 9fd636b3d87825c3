//! Which backends fuse under [`super::StreamFusion`]: a registry of fuser factories by backend
//! type.
//!
//! `StreamFusion<B>` works for any [`BackendIr`](burn_ir::BackendIr) backend, and most of them have no fuser; the
//! ones that do are found here by type when a stream is created. With the `cuda` feature,
//! `CubeBackend<CudaRuntime, f32, i32, u8>` (and `.., u32>`) fuse through burn-cubecl-fusion's
//! fusers (see [`cube_fuser`](super::cube_fuser)); [`register_fuser`] adds another backend, for
//! instance a `CubeBackend` over another cubecl runtime.

use std::any::{Any, TypeId};
use std::sync::{Arc, OnceLock};

use hashbrown::HashMap;
use parking_lot::RwLock;

use super::BackendRuntime;
use super::IrBackend;
use crate::runtime::Fuser;

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
    let made = make(device)?;
    made.downcast::<Box<dyn Fuser<BackendRuntime<B>>>>()
        .ok()
        .map(|fuser| *fuser)
}
