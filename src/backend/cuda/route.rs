//! The CUDA route of a `StreamFusion<CubeBackend<CudaRuntime, ..>>` device: the transfer
//! machinery of this folder on burn-cubecl's handles.

use std::any::Any;
use std::sync::OnceLock;

use burn_backend::{DType, Shape};
use cubecl::cuda::CudaDevice;
use cubecl::server::Handle;

use super::{CudaHandle, CudaTransfer, cuda_device};
use crate::Result;
use crate::backend::IrBackend;

/// The CUDA route of one device: made when the engine opens for a backend whose handles are
/// cubecl CUDA handles; its machinery starts with the first publication.
pub(crate) struct CudaRoute {
    device: CudaDevice,
    transfer: OnceLock<CudaTransfer>,
}

impl CudaRoute {
    pub(crate) fn for_backend<B: IrBackend>(device: &B::Device) -> Option<Self> {
        Some(Self {
            device: cuda_device::<B>(device)?.clone(),
            transfer: OnceLock::new(),
        })
    }

    pub(crate) fn transfer(&self) -> Result<&CudaTransfer> {
        if let Some(t) = self.transfer.get() {
            return Ok(t);
        }
        let t = CudaTransfer::new(&self.device)?;
        Ok(self.transfer.get_or_init(|| t))
    }

    /// Wait for every transfer job so far, if the machinery was started.
    pub(crate) fn barrier(&self) -> Result<()> {
        self.transfer.get().map_or(Ok(()), CudaTransfer::barrier)
    }

    /// The cubecl buffer a DMA copy can take the value's bytes from: the handle's own, when
    /// it holds exactly the value's elements in row-major order. Otherwise (a strided view,
    /// a packed or differently sized element) the handle comes back, for the host route.
    pub(crate) fn device_buffer<B: IrBackend>(
        &self,
        handle: B::Handle,
        shape: &Shape,
        dtype: DType,
    ) -> Result<Handle, B::Handle> {
        let boxed: Box<dyn Any> = Box::new(handle);
        let cube = boxed
            .downcast::<CudaHandle>()
            .expect("the CUDA route sees only cubecl CUDA handles");
        let plain = cube.qparams.is_none()
            && cube.dtype.size() == dtype.size()
            && row_major(shape, &cube.strides);
        if plain {
            return Ok(cube.handle.clone());
        }
        let boxed: Box<dyn Any> = cube;
        Err(*boxed
            .downcast::<B::Handle>()
            .expect("the handle's own type"))
    }
}

/// Whether `strides` lay `shape` out in row-major order without gaps (a dimension of one
/// element may have any stride).
fn row_major(shape: &Shape, strides: &[usize]) -> bool {
    if strides.len() != shape.num_dims() {
        return false;
    }
    let mut expected = 1;
    for (dim, stride) in shape.iter().zip(strides).rev() {
        if *dim != 1 && *stride != expected {
            return false;
        }
        expected *= dim;
    }
    true
}
