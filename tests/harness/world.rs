//! The program's shared state: the tensor, publication and download slots its threads use, and
//! the slot locks a step takes (in one global order).

use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use fusion_streams::host::HostRuntime;
use fusion_streams::transfer::{PendingDownload, SourcePublication};

use super::program::SLOTS;
use crate::common::{Client, Tensor};

pub(super) type Publication = SourcePublication<HostRuntime>;
pub(super) type Download = PendingDownload<HostRuntime>;

/// The program's state, shared by its threads.
pub(super) struct World {
    pub(super) client: Client,
    pub(super) slots: Vec<RwLock<Option<Tensor>>>,
    pub(super) publications: Vec<Mutex<Option<Publication>>>,
    pub(super) downloads: Vec<Mutex<Option<Download>>>,
}

enum Guard<'a> {
    Read(RwLockReadGuard<'a, Option<Tensor>>),
    Write(RwLockWriteGuard<'a, Option<Tensor>>),
}

/// The tensor slots a step touches, locked in ascending order (the only order anyone locks
/// them in), shared for reads and exclusive for writes.
pub(super) struct Locked<'a> {
    guards: Vec<(usize, Guard<'a>)>,
}

impl<'a> Locked<'a> {
    pub(super) fn new(world: &'a World, reads: &[usize], writes: &[usize]) -> Self {
        let mut wanted: Vec<(usize, bool)> = reads
            .iter()
            .filter(|r| **r < SLOTS)
            .map(|r| (*r, false))
            .chain(writes.iter().filter(|w| **w < SLOTS).map(|w| (*w, true)))
            .collect();
        wanted.sort();
        // A slot both read and written is locked once, for writing (sorted: `true` comes last).
        let mut merged: Vec<(usize, bool)> = Vec::new();
        for (slot, write) in wanted {
            match merged.last_mut() {
                Some(last) if last.0 == slot => last.1 |= write,
                _ => merged.push((slot, write)),
            }
        }
        let guards = merged
            .into_iter()
            .map(|(slot, write)| {
                let lock = &world.slots[slot];
                let guard = if write {
                    Guard::Write(lock.write().unwrap())
                } else {
                    Guard::Read(lock.read().unwrap())
                };
                (slot, guard)
            })
            .collect();
        Self { guards }
    }

    pub(super) fn get(&self, slot: usize) -> Option<&Tensor> {
        let (_, guard) = self.guards.iter().find(|(s, _)| *s == slot)?;
        match guard {
            Guard::Read(g) => g.as_ref(),
            Guard::Write(g) => g.as_ref(),
        }
    }

    pub(super) fn slot(&mut self, slot: usize) -> &mut Option<Tensor> {
        match self.guards.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, Guard::Write(g))) => g,
            _ => panic!("slot {slot} is not locked for writing"),
        }
    }
}
