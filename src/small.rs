//! Small helpers for the recording path, each cheaper than the general tool it replaces there.
//!
//! `SmallVec`'s `FromIterator`/`Extend` reserve for the iterator's size hint and handle the
//! spilled case up front, which costs ~160 instructions even for one element (measured with
//! callgrind on the op-registration path). Operations have one or two operands and one output,
//! so a loop of `push`es is several times cheaper. Likewise a short list of ids is searched
//! faster by a scan than by hashing ([`Positions`]).

use hashbrown::HashMap;
use smallvec::{Array, SmallVec};

/// Collect `items` by pushing them one at a time.
#[inline]
pub(crate) fn collect<A: Array>(items: impl IntoIterator<Item = A::Item>) -> SmallVec<A> {
    let mut out = SmallVec::new();
    for item in items {
        out.push(item);
    }
    out
}

/// The dimensions of `shape`.
///
/// `Shape::as_slice` and `Deref` are not marked `#[inline]`, so every call from here is a call
/// into cubecl-zspace (callgrind counted ~24 instructions per recorded operation in it); the
/// generic `Index` impl is instantiated, and inlined, in this crate.
#[inline]
pub(crate) fn dims(shape: &burn_backend::Shape) -> &[usize] {
    &shape[..]
}

/// Whether two shapes have the same dimensions, compared in place (`Shape`'s `PartialEq` goes
/// through `as_slice` and `memcmp`).
#[inline]
pub(crate) fn same_dims(a: &burn_backend::Shape, b: &burn_backend::Shape) -> bool {
    let (a, b) = (dims(a), dims(b));
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

/// A copy of `shape`.
///
/// `Shape`'s derived `Clone` goes through `SmallVec`'s `FromIterator` (the cost above, paid on
/// every recorded operation). A slice copy (`SmallVec::from_slice`) is a `memcpy` call of a
/// length known only at run time, ~25 instructions for one dimension, and a recorded operation
/// copies two or three shapes; a shape of up to five dimensions (all of cubecl's inline
/// storage holds) is built here from its dimensions directly.
#[inline]
pub(crate) fn copy_shape(shape: &burn_backend::Shape) -> burn_backend::Shape {
    let dims = match *dims(shape) {
        [] => SmallVec::new(),
        [a] => SmallVec::from_buf_and_len([a, 0, 0, 0, 0], 1),
        [a, b] => SmallVec::from_buf_and_len([a, b, 0, 0, 0], 2),
        [a, b, c] => SmallVec::from_buf_and_len([a, b, c, 0, 0], 3),
        [a, b, c, d] => SmallVec::from_buf_and_len([a, b, c, d, 0], 4),
        [a, b, c, d, e] => SmallVec::from_buf([a, b, c, d, e]),
        ref more => SmallVec::from_slice(more),
    };
    burn_backend::Shape::new_raw(dims)
}

/// A copy of `ir`, its shape copied as [`copy_shape`] does (`TensorIr`'s derived `Clone` pays
/// the slow shape clone).
#[inline]
pub(crate) fn copy_ir(ir: &burn_ir::TensorIr) -> burn_ir::TensorIr {
    burn_ir::TensorIr {
        id: ir.id,
        shape: copy_shape(&ir.shape),
        status: ir.status,
        dtype: ir.dtype,
    }
}

/// `[f(a), f(b), ..]` for an array `[a, b, ..]`, in order: what `<[T; N]>::map` returns.
///
/// Core's `map` (and `array::from_fn`) goes through a generic drain and a short-circuit wrapper
/// that LLVM leaves out of line: callgrind counted ~90 instructions per recorded operation in
/// those two functions for the four one-operand maps of a registration. Here the loop is
/// written out and forced inline. If `f` panics, the items already made are dropped, and the
/// rest of `list` with them.
#[inline(always)]
pub(crate) fn map_array<T, U, const N: usize>(list: [T; N], mut f: impl FnMut(T) -> U) -> [U; N] {
    use std::mem::{ManuallyDrop, MaybeUninit};
    /// The outputs made so far; dropped (the first `made` of them) if `f` unwinds.
    struct Made<U, const N: usize> {
        items: [MaybeUninit<U>; N],
        made: usize,
    }
    impl<U, const N: usize> Drop for Made<U, N> {
        fn drop(&mut self) {
            for item in &mut self.items[..self.made] {
                // SAFETY: the first `made` items were written, and nothing else reads them.
                unsafe { item.assume_init_drop() };
            }
        }
    }
    let mut out = Made::<U, N> {
        items: [const { MaybeUninit::uninit() }; N],
        made: 0,
    };
    for item in list {
        out.items[out.made].write(f(item));
        out.made += 1;
    }
    let out = ManuallyDrop::new(out);
    // SAFETY: the loop wrote all `N` items (an array iterator yields exactly `N`), and
    // `[MaybeUninit<U>; N]` has the layout of `[U; N]`. `out` is not dropped, so each item is
    // moved out exactly once.
    unsafe { std::ptr::read((&raw const out.items).cast::<[U; N]>()) }
}

/// [`map_array`] over the items' references.
#[inline(always)]
pub(crate) fn map_array_ref<T, U, const N: usize>(list: &[T; N], f: impl FnMut(&T) -> U) -> [U; N] {
    map_array(list.each_ref(), f)
}

/// How many operands an operation has, as a type: its per-operand lists (the operands, their
/// IRs, the tensors on their way in) are arrays when the count is known where the operation is
/// recorded ([`Fixed`]: burn's operations), `SmallVec`s otherwise ([`Many`]: builders, optional
/// operands). The array path moves no list header, checks no spill and drops nothing inline;
/// callgrind counted the four `SmallVec`s of a unary operation's registration at ~300
/// instructions, an eighth of the engine's cost per operation (`scripts/per-op-cost.sh`).
pub(crate) trait Arity {
    /// A list of one `T` per operand.
    type List<T>: IntoIterator<Item = T> + AsRef<[T]> + AsMut<[T]>;
    /// `list` with `f` applied to each item, in order.
    fn map<T, U>(list: Self::List<T>, f: impl FnMut(T) -> U) -> Self::List<U>;
    /// A new list of `f` of each item of `list`, in order.
    fn map_ref<T, U>(list: &Self::List<T>, f: impl FnMut(&T) -> U) -> Self::List<U>;
    /// The operands' IRs as an operation body keeps them (a `List<TensorIr>` that says it can
    /// cross threads).
    type Irs: AsRef<[burn_ir::TensorIr]> + Send + Sync + 'static;
    /// `list`, as that type.
    fn irs(list: Self::List<burn_ir::TensorIr>) -> Self::Irs;
}

/// Exactly `N` operands: arrays.
pub(crate) struct Fixed<const N: usize>;

impl<const N: usize> Arity for Fixed<N> {
    type List<T> = [T; N];

    #[inline(always)]
    fn map<T, U>(list: [T; N], f: impl FnMut(T) -> U) -> [U; N] {
        map_array(list, f)
    }

    #[inline(always)]
    fn map_ref<T, U>(list: &[T; N], f: impl FnMut(&T) -> U) -> [U; N] {
        map_array_ref(list, f)
    }

    type Irs = [burn_ir::TensorIr; N];

    #[inline(always)]
    fn irs(list: [burn_ir::TensorIr; N]) -> Self::Irs {
        list
    }
}

/// Any number of operands, most often one or two: `SmallVec`s.
pub(crate) struct Many;

impl Arity for Many {
    type List<T> = SmallVec<[T; 2]>;

    #[inline]
    fn map<T, U>(list: SmallVec<[T; 2]>, f: impl FnMut(T) -> U) -> SmallVec<[U; 2]> {
        collect(list.into_iter().map(f))
    }

    #[inline]
    fn map_ref<T, U>(list: &SmallVec<[T; 2]>, f: impl FnMut(&T) -> U) -> SmallVec<[U; 2]> {
        collect(list.iter().map(f))
    }

    type Irs = SmallVec<[burn_ir::TensorIr; 2]>;

    #[inline]
    fn irs(list: SmallVec<[burn_ir::TensorIr; 2]>) -> Self::Irs {
        list
    }
}

/// What an operation's outputs are handed out as: an array when the caller knows how many
/// there are, a `SmallVec` otherwise.
pub(crate) trait Gather<T>: Sized {
    /// Whether `len` outputs make one.
    fn fits(len: usize) -> bool;
    /// The outputs, `len` of them with `fits(len)`.
    fn gather(items: impl Iterator<Item = T>) -> Self;
}

impl<T> Gather<T> for SmallVec<[T; 1]> {
    fn fits(_: usize) -> bool {
        true
    }

    #[inline]
    fn gather(items: impl Iterator<Item = T>) -> Self {
        collect(items)
    }
}

impl<T, const K: usize> Gather<T> for [T; K] {
    fn fits(len: usize) -> bool {
        len == K
    }

    #[inline]
    fn gather(mut items: impl Iterator<Item = T>) -> Self {
        map_array([(); K], |()| {
            items.next().expect("as many outputs as `fits` was told")
        })
    }
}

/// Up to how many entries [`Positions`] scans instead of looking up its map.
const SCANNED: usize = 32;

/// The position of each key of a list of distinct keys that grows and shrinks at its end: found
/// by scanning the keys while there are at most [`SCANNED`] of them (a short run: no hashing),
/// through a map beside them once there are more.
pub(crate) struct Positions<K> {
    keys: Vec<K>,
    /// Every key's position, kept only while there are more than [`SCANNED`] keys.
    map: HashMap<K, usize>,
}

impl<K> Default for Positions<K> {
    fn default() -> Self {
        Self {
            keys: Vec::new(),
            map: HashMap::new(),
        }
    }
}

impl<K: Copy + Eq + std::hash::Hash> Positions<K> {
    // The relative IR of the CUDA fusers keeps its sizes in one and asks these two.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    /// The keys, in order.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn keys(&self) -> &[K] {
        &self.keys
    }

    #[inline]
    pub(crate) fn get(&self, key: K) -> Option<usize> {
        if self.keys.len() <= SCANNED {
            // Newest first: an operation's operand is most often the output just before it.
            self.keys.iter().rposition(|k| *k == key)
        } else {
            self.map.get(&key).copied()
        }
    }

    #[inline]
    pub(crate) fn push(&mut self, key: K) -> usize {
        let position = self.keys.len();
        self.keys.push(key);
        if self.keys.len() > SCANNED {
            if self.map.is_empty() {
                self.map
                    .extend(self.keys.iter().enumerate().map(|(at, k)| (*k, at)));
            } else {
                self.map.insert(key, position);
            }
        }
        position
    }

    pub(crate) fn truncate(&mut self, len: usize) {
        if self.keys.len() <= len {
            return;
        }
        if len <= SCANNED {
            self.map.clear();
        } else {
            for key in &self.keys[len..] {
                self.map.remove(key);
            }
        }
        self.keys.truncate(len);
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    #[test]
    fn map_array_maps_in_order() {
        let mut seen = Vec::new();
        let out = super::map_array([1, 2, 3], |x| {
            seen.push(x);
            x * 10
        });
        assert_eq!((out, seen), ([10, 20, 30], vec![1, 2, 3]));
        let strings = super::map_array_ref(&[1, 2], |x| x.to_string());
        assert_eq!(strings, ["1".to_string(), "2".to_string()]);
        assert_eq!(super::map_array([(); 0], |()| 1), [0; 0]);
    }

    #[test]
    fn map_array_drops_everything_when_its_function_panics() {
        let live = Rc::new(());
        let list = [(); 4].map(|()| Rc::clone(&live));
        let mut calls = 0;
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            super::map_array(list, |item| {
                calls += 1;
                assert!(calls < 3, "the third item");
                item
            })
        }));
        assert!(unwound.is_err());
        assert_eq!(calls, 3);
        // The two outputs made, the item in hand and the one not reached were all dropped.
        assert_eq!(Rc::strong_count(&live), 1);
    }
    #[test]
    fn copy_shape_is_equal_and_keeps_large_ranks() {
        // Every rank the copy builds directly (0-5), one past cubecl's inline storage, and more.
        for dims in (0..=8).map(|rank| (2..2 + rank).collect::<Vec<usize>>()) {
            let shape = burn_backend::Shape::from(dims.clone());
            let copy = super::copy_shape(&shape);
            assert_eq!(copy, shape);
            assert_eq!(copy.as_slice(), dims.as_slice());
        }
    }

    #[test]
    fn positions_are_found_by_scan_and_by_map_alike() {
        let mut positions = super::Positions::default();
        for key in 0..100u64 {
            assert_eq!(positions.push(key * 7), key as usize);
            // Every key pushed so far, on both sides of the switch to the map.
            for earlier in 0..=key {
                assert_eq!(positions.get(earlier * 7), Some(earlier as usize));
            }
            assert_eq!(positions.get(key * 7 + 1), None);
        }
        // Back below the switch: scanned again, the rest forgotten.
        positions.truncate(40);
        assert_eq!(positions.get(39 * 7), Some(39));
        assert_eq!(positions.get(40 * 7), None);
        positions.truncate(10);
        assert_eq!(positions.len(), 10);
        assert_eq!(positions.get(9 * 7), Some(9));
        assert_eq!(positions.get(10 * 7), None);
        assert_eq!(positions.get(50 * 7), None);
        // And past it again: the map is rebuilt from the keys.
        for key in 10..60u64 {
            positions.push(key * 3);
        }
        assert_eq!(positions.get(59 * 3), Some(59));
        assert_eq!(positions.get(5 * 7), Some(5));
        assert_eq!(positions.keys().len(), 60);
    }
}
