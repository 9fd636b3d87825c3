//! Sizes computed from the caller's input, with checked arithmetic.
//!
//! Shapes, element counts and byte lengths come from user code. Every product or rounding of them
//! goes through here, so an impossible size becomes [`Error::TooLarge`] at the call that asked for
//! it — never a wrapped value that a later allocation or slice would trust.

use burn_backend::DType;

use crate::{Error, Result};

/// The largest allocation any runtime can make: Rust's allocation limit.
pub(crate) const MAX_ALLOCATION: usize = isize::MAX as usize;

/// The element count of `dims`, if it fits in `usize`.
#[inline]
pub(crate) fn elements(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |n, d| n.checked_mul(*d))
}

/// The byte length of a tensor of `dims` and `dtype`, checked against `limit`.
#[inline]
pub(crate) fn tensor_bytes(
    what: &str,
    dims: &[usize],
    dtype: DType,
    limit: usize,
) -> Result<usize> {
    // Every recorded operation checks its outputs here: the error is built out of line.
    match elements(dims).and_then(|n| n.checked_mul(dtype.size())) {
        Some(bytes) if bytes <= limit => Ok(bytes),
        bytes => Err(too_large(what, dims, dtype, bytes, limit)),
    }
}

/// The error for a tensor of `dims` and `dtype` whose byte length (`None`: it overflows) is
/// past `limit`.
#[cold]
#[inline(never)]
fn too_large(
    what: &str,
    dims: &[usize],
    dtype: DType,
    bytes: Option<usize>,
    limit: usize,
) -> Error {
    let detail = match bytes {
        None => "its byte length overflows usize".into(),
        Some(bytes) => {
            format!("{bytes} bytes exceed the runtime's largest buffer ({limit} bytes)")
        }
    };
    Error::TooLarge {
        what: format!("{what} of shape {dims:?} and dtype {dtype:?}").into(),
        detail,
    }
}

/// `len` rounded up to a multiple of `align`, if that is a valid allocation size.
pub(crate) fn round_up(what: &str, len: usize, align: usize) -> Result<usize> {
    len.checked_next_multiple_of(align)
        .filter(|size| *size <= MAX_ALLOCATION)
        .ok_or_else(|| Error::TooLarge {
            what: what.into(),
            detail: format!("{len} bytes exceed the largest allocation ({MAX_ALLOCATION} bytes)"),
        })
}

/// A vector with room for exactly `len` elements, or [`Error::OutOfMemory`]: the host runtime's
/// allocations never abort the process.
pub(crate) fn try_vec<T>(what: &str, len: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| Error::OutOfMemory {
        what: what.into(),
        bytes: len.saturating_mul(std::mem::size_of::<T>()),
    })?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    //! Property: no size computation wraps; impossible sizes are typed errors.
    use super::*;

    #[test]
    fn products_and_roundings_are_checked() {
        assert_eq!(elements(&[2, 3, 4]), Some(24));
        assert_eq!(elements(&[]), Some(1));
        assert_eq!(elements(&[usize::MAX, 2]), None);
        assert_eq!(
            tensor_bytes("t", &[2, 3], DType::F32, MAX_ALLOCATION).unwrap(),
            24
        );
        assert!(matches!(
            tensor_bytes("t", &[1 << 62, 4], DType::F32, MAX_ALLOCATION),
            Err(Error::TooLarge { .. })
        ));
        assert!(matches!(
            tensor_bytes("t", &[10], DType::F32, 39),
            Err(Error::TooLarge { .. })
        ));
        assert_eq!(round_up("b", 1, 4096).unwrap(), 4096);
        assert_eq!(round_up("b", 4096, 4096).unwrap(), 4096);
        assert!(round_up("b", usize::MAX, 4096).is_err());
        assert!(round_up("b", MAX_ALLOCATION, 4096).is_err());
        assert!(matches!(
            try_vec::<u64>("v", usize::MAX / 8),
            Err(Error::OutOfMemory { .. })
        ));
    }
}
