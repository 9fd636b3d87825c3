//! Process-wide fresh [`TensorId`]s.
//!
//! The SSA invariant (see [`crate::MultiStream`]) needs every operation output to carry an id that
//! was never used before, by any engine, on any thread. A single `AtomicU64::fetch_add` gives that,
//! but with many threads registering operations at once the counter's cache line bounces between
//! cores on every op. Each thread therefore reserves a block of 1,024 ids with one atomic add
//! and hands them out locally. Ids stay unique process-wide; they are no longer globally ordered by
//! creation time, which nothing relies on.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use burn_ir::TensorId;

/// Ids reserved per refill of a thread's block.
const BLOCK: u64 = 1024;

/// Next unreserved id. Starts above zero so that `TensorId::new(0)` is never handed out, which
/// makes accidental default ids easy to spot in logs.
static NEXT_BLOCK: AtomicU64 = AtomicU64::new(1);

std::thread_local! {
    // `Cell` of a `Copy` type with a const initialiser: no destructor is registered, so it stays
    // usable while other thread-locals are being destroyed at thread exit (the exit drain runs
    // operations then).
    static LOCAL: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// A [`TensorId`] that no engine has used before and none will use again.
pub fn fresh_tensor_id() -> TensorId {
    LOCAL.with(|local| {
        let (mut next, mut end) = local.get();
        if next == end {
            // Relaxed is enough: uniqueness only needs the atomicity of the add.
            next = NEXT_BLOCK.fetch_add(BLOCK, Ordering::Relaxed);
            end = next + BLOCK;
        }
        local.set((next + 1, end));
        TensorId::new(next)
    })
}

#[cfg(test)]
mod tests {
    //! Property: ids are unique across threads and across block refills.
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn ids_are_unique_across_threads_and_blocks() {
        let per_thread = (BLOCK * 3 + 7) as usize;
        let handles: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    (0..per_thread)
                        .map(|_| fresh_tensor_id().value())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut seen = HashSet::new();
        for h in handles {
            for id in h.join().unwrap() {
                assert!(seen.insert(id), "id {id} handed out twice");
            }
        }
        assert_eq!(seen.len(), per_thread * 4);
    }
}
