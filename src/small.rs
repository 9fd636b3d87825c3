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
