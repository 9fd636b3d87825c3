//! Collecting into `SmallVec`s on the hot path.
//!
//! `SmallVec`'s `FromIterator`/`Extend` reserve for the iterator's size hint and handle the
//! spilled case up front, which costs ~160 instructions even for one element (measured with
//! callgrind on the op-registration path). Operations have one or two operands and one output,
//! so a loop of `push`es is several times cheaper.

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

/// A copy of `shape`.
///
/// `Shape`'s derived `Clone` goes through `SmallVec`'s `FromIterator` (the cost above, paid on
/// every recorded operation); its dimensions are `Copy`, so one slice copy does.
#[inline]
pub(crate) fn copy_shape(shape: &burn_backend::Shape) -> burn_backend::Shape {
    burn_backend::Shape::new_raw(SmallVec::from_slice(shape.as_slice()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn copy_shape_is_equal_and_keeps_large_ranks() {
        for dims in [
            vec![],
            vec![3],
            vec![2, 3, 4, 5, 6],
            vec![1, 2, 3, 4, 5, 6, 7, 8],
        ] {
            let shape = burn_backend::Shape::from(dims.clone());
            let copy = super::copy_shape(&shape);
            assert_eq!(copy, shape);
            assert_eq!(copy.as_slice(), dims.as_slice());
        }
    }
}
