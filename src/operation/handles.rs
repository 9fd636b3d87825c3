//! A stream's handles: burn's [`HandleContainer`], and the output of the last operation carried
//! beside it.
//!
//! Most operations of a chain consume the output of the one before: the first registers a handle
//! under a fresh id, the next takes it out again. Through the map that is a hash insert and a
//! hash removal per operation, each moving the handle (a backend's handle is ~100 bytes: NdArray's
//! array, cubecl's buffer and strides) — ~200 of the engine's instructions per recorded op on a
//! chain of NdArray ops (callgrind, `scripts/per-op-cost.sh`). An output registered through
//! [`StreamHandles::carry`] waits in one slot instead; the next operation takes it from there when
//! it names it, and it enters the map only when another output takes the slot.
//!
//! The map is private: every lookup, removal and registration goes through the methods here,
//! which look in the slot first, and whoever needs burn's container itself (a fuser, a custom
//! executor, a burn operation) gets it from [`StreamHandles::flushed`], which puts the carried
//! handle into the map first. An id is in the slot or in the map, never in both.

use burn_ir::{BackendIr, Handle, HandleContainer, TensorId, TensorIr, TensorStatus};

/// A stream's handle map, with the last carried output beside it (see the module docs).
pub(crate) struct StreamHandles<H> {
    map: HandleContainer<H>,
    carried: Option<(TensorId, H)>,
}

impl<H> Default for StreamHandles<H> {
    fn default() -> Self {
        Self {
            map: HandleContainer::default(),
            carried: None,
        }
    }
}

impl<H: Clone> StreamHandles<H> {
    /// Burn's container, holding every handle (the carried one put into it first).
    #[inline]
    pub(crate) fn flushed(&mut self) -> &mut HandleContainer<H> {
        if let Some((id, handle)) = self.carried.take() {
            self.map.register_handle(id, handle);
        }
        &mut self.map
    }

    /// Register `handle` under `id`, an id no handle is registered under (an operation's output:
    /// the engine's ids are fresh), in the slot: the handle carried until now goes into the map
    /// (or is replaced, if it was `id`'s).
    #[inline(always)]
    pub(crate) fn carry(&mut self, id: TensorId, handle: H) {
        debug_assert!(!self.map.has_handle(&id), "{id:?} is registered already");
        // In a chain the next operation took the carried handle: the slot is empty.
        if let Some((carried, _)) = &self.carried
            && *carried != id
        {
            self.spill();
        }
        self.carried = Some((id, handle));
    }

    /// Move the carried handle into the map.
    #[cold]
    #[inline(never)]
    fn spill(&mut self) {
        if let Some((id, handle)) = self.carried.take() {
            self.map.register_handle(id, handle);
        }
    }

    /// Whether `id` has a handle.
    #[inline]
    pub(crate) fn has_handle(&self, id: &TensorId) -> bool {
        self.carried.as_ref().is_some_and(|(c, _)| c == id) || self.map.has_handle(id)
    }

    /// `id`'s handle, if it has one.
    #[inline]
    pub(crate) fn get_handle_ref(&self, id: &TensorId) -> Option<&H> {
        match &self.carried {
            Some((c, handle)) if c == id => Some(handle),
            _ => self.map.get_handle_ref(id),
        }
    }

    /// Take `id`'s handle out.
    #[inline]
    pub(crate) fn remove_handle(&mut self, id: TensorId) -> Option<Handle<H>> {
        if self.carried.as_ref().is_some_and(|(c, _)| *c == id) {
            return self
                .carried
                .take()
                .map(|(_, handle)| Handle::Existing(handle));
        }
        self.map.remove_handle(id)
    }

    /// Register `handle` under `id`, replacing what `id` held.
    pub(crate) fn register_handle(&mut self, id: TensorId, handle: H) {
        match &mut self.carried {
            Some((c, carried)) if *c == id => *carried = handle,
            _ => self.map.register_handle(id, handle),
        }
    }

    /// How many ids have a handle.
    pub(crate) fn num_handles(&self) -> usize {
        self.map.num_handles() + usize::from(self.carried.is_some())
    }

    /// `ir`'s handle, taken for an operation: moved out when the operation consumes it
    /// (`ReadWrite`), cloned in place when it reads it, as burn's `get_handle` does (which
    /// removes and reinserts a read one). `None` when it has none.
    #[inline(always)]
    pub(crate) fn take(&mut self, ir: &TensorIr) -> Option<H> {
        if let Some((carried, handle)) = &self.carried
            && *carried == ir.id
        {
            return match ir.status {
                TensorStatus::ReadOnly => Some(handle.clone()),
                TensorStatus::ReadWrite => self.carried.take().map(|(_, handle)| handle),
                TensorStatus::NotInit => None,
            };
        }
        take_from(&mut self.map, ir)
    }

    /// `ir`'s handle with its shape, taken for an operation as [`Self::take`] does.
    ///
    /// The carried handle of a chain is moved straight into the `TensorHandle`: through
    /// `take`'s `Option` it was copied twice on the way (a backend handle is 100–360 bytes).
    #[inline(always)]
    pub(crate) fn take_tensor(&mut self, ir: &TensorIr) -> burn_ir::TensorHandle<H> {
        let shape = crate::small::copy_shape(&ir.shape);
        if ir.status == TensorStatus::ReadWrite
            && let Some((carried, _)) = &self.carried
            && *carried == ir.id
            && let Some((_, handle)) = self.carried.take()
        {
            return burn_ir::TensorHandle { handle, shape };
        }
        match self.take(ir) {
            Some(handle) => burn_ir::TensorHandle { handle, shape },
            None => missing_handle(ir),
        }
    }

    /// burn's `HandleContainer::register_float_tensor`, carried.
    #[inline]
    pub(crate) fn register_float_tensor<B: BackendIr<Handle = H>>(
        &mut self,
        id: &TensorId,
        tensor: B::FloatTensorPrimitive,
    ) {
        self.carry(*id, B::float_tensor_handle(tensor));
    }

    /// burn's `HandleContainer::register_int_tensor`, carried.
    #[inline]
    pub(crate) fn register_int_tensor<B: BackendIr<Handle = H>>(
        &mut self,
        id: &TensorId,
        tensor: B::IntTensorPrimitive,
    ) {
        self.carry(*id, B::int_tensor_handle(tensor));
    }

    /// burn's `HandleContainer::register_bool_tensor`, carried.
    #[inline]
    pub(crate) fn register_bool_tensor<B: BackendIr<Handle = H>>(
        &mut self,
        id: &TensorId,
        tensor: B::BoolTensorPrimitive,
    ) {
        self.carry(*id, B::bool_tensor_handle(tensor));
    }

    /// burn's `HandleContainer::register_quantized_tensor`.
    pub(crate) fn register_quantized_tensor<B: BackendIr<Handle = H>>(
        &mut self,
        id: &TensorId,
        tensor: B::QuantizedTensorPrimitive,
    ) {
        self.flushed().register_quantized_tensor::<B>(id, tensor);
    }

    /// burn's `HandleContainer::get_quantized_tensor`.
    pub(crate) fn get_quantized_tensor<B: BackendIr<Handle = H>>(
        &mut self,
        ir: &TensorIr,
    ) -> B::QuantizedTensorPrimitive {
        self.flushed().get_quantized_tensor::<B>(ir)
    }
}

/// [`StreamHandles::take`] from burn's container alone (a fused kernel's fallback runs on one).
#[inline]
pub(crate) fn take_from<H: Clone>(map: &mut HandleContainer<H>, ir: &TensorIr) -> Option<H> {
    match ir.status {
        TensorStatus::ReadOnly => map.get_handle_ref(&ir.id).cloned(),
        TensorStatus::ReadWrite => match map.remove_handle(ir.id) {
            Some(Handle::Existing(handle)) => Some(handle),
            _ => None,
        },
        TensorStatus::NotInit => None,
    }
}

/// The panic of an operation whose input has no handle on its stream: the engine registers every
/// input's handle before the operation runs, so this is a broken invariant, not a user error.
#[cold]
#[inline(never)]
pub(crate) fn missing_handle(ir: &TensorIr) -> ! {
    panic!("no handle for tensor {:?} ({:?})", ir.id, ir.status);
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_backend::{DType, Shape};

    fn ir(id: u64, status: TensorStatus) -> TensorIr {
        TensorIr {
            id: TensorId::new(id),
            shape: Shape::new([1]),
            status,
            dtype: DType::F32,
        }
    }

    #[test]
    fn a_carried_handle_is_found_taken_and_flushed_like_a_mapped_one() {
        let mut handles = StreamHandles::<u32>::default();
        handles.register_handle(TensorId::new(1), 10);
        handles.carry(TensorId::new(2), 20);
        assert_eq!(handles.num_handles(), 2);
        assert!(handles.has_handle(&TensorId::new(2)));
        assert_eq!(handles.get_handle_ref(&TensorId::new(2)), Some(&20));

        // Read, then consumed: the slot empties.
        assert_eq!(handles.take(&ir(2, TensorStatus::ReadOnly)), Some(20));
        assert_eq!(handles.take(&ir(2, TensorStatus::ReadWrite)), Some(20));
        assert!(!handles.has_handle(&TensorId::new(2)));
        assert_eq!(handles.take(&ir(2, TensorStatus::ReadWrite)), None);

        // A second carried output sends the first into the map.
        handles.carry(TensorId::new(3), 30);
        handles.carry(TensorId::new(4), 40);
        assert_eq!(handles.num_handles(), 3);
        assert!(matches!(
            handles.remove_handle(TensorId::new(3)),
            Some(Handle::Existing(30))
        ));

        // Replacing a carried handle keeps one entry; flushing moves it into burn's map.
        handles.register_handle(TensorId::new(4), 41);
        assert_eq!(handles.num_handles(), 2);
        let map = handles.flushed();
        assert_eq!(map.num_handles(), 2);
        assert_eq!(map.get_handle_ref(&TensorId::new(4)), Some(&41));
        assert_eq!(handles.take(&ir(1, TensorStatus::ReadWrite)), Some(10));
        assert_eq!(handles.num_handles(), 1);
    }

    #[test]
    fn a_tensor_is_taken_with_its_shape_from_the_slot_and_from_the_map() {
        let mut handles = StreamHandles::<u32>::default();
        handles.register_handle(TensorId::new(1), 10);
        handles.carry(TensorId::new(2), 20);
        let taken = |handles: &mut StreamHandles<u32>, id, status| {
            let t = handles.take_tensor(&ir(id, status));
            (t.handle, t.shape)
        };

        // Read: cloned in place, wherever it is.
        assert_eq!(
            taken(&mut handles, 2, TensorStatus::ReadOnly),
            (20, Shape::new([1]))
        );
        assert_eq!(
            taken(&mut handles, 1, TensorStatus::ReadOnly),
            (10, Shape::new([1]))
        );
        assert_eq!(handles.num_handles(), 2);

        // Consumed: moved out, from the slot and from the map.
        assert_eq!(taken(&mut handles, 2, TensorStatus::ReadWrite).0, 20);
        assert!(!handles.has_handle(&TensorId::new(2)));
        assert_eq!(taken(&mut handles, 1, TensorStatus::ReadWrite).0, 10);
        assert_eq!(handles.num_handles(), 0);
    }

    #[test]
    #[should_panic(expected = "no handle for tensor")]
    fn a_tensor_without_a_handle_is_a_broken_invariant() {
        let mut handles = StreamHandles::<u32>::default();
        handles.carry(TensorId::new(2), 20);
        handles.take_tensor(&ir(3, TensorStatus::ReadWrite));
    }
}
