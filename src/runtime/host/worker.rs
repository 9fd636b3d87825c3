//! The host device's streams: one worker thread per stream slot, executing kernels in order.

use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, OnceLock};
use std::thread::{JoinHandle, ThreadId};

use parking_lot::Mutex;

use super::marker::Marker;

/// Number of stream slots per device. Like cubecl's, a stream id maps to slot `id % SLOTS`: two
/// ids on one slot share a worker (still correct, only serialised).
pub(crate) const SLOTS: usize = 64;

type Job = Box<dyn FnOnce() + Send>;

struct Worker {
    jobs: Sender<Job>,
    thread: Mutex<Option<JoinHandle<()>>>,
    thread_id: ThreadId,
}

/// The set of stream workers of one host device.
pub(crate) struct Workers {
    /// Thread names are `{name}-stream{slot}`.
    name: String,
    slots: Box<[OnceLock<Worker>]>,
}

impl Workers {
    /// Workers whose threads are named `{name}-stream{slot}`; none is started before its first
    /// job.
    pub(crate) fn new(name: String) -> Self {
        Self {
            name,
            slots: (0..SLOTS).map(|_| OnceLock::new()).collect(),
        }
    }

    fn worker(&self, stream: u64) -> &Worker {
        let slot = (stream % SLOTS as u64) as usize;
        self.slots[slot].get_or_init(|| {
            let (jobs, queue) = channel::<Job>();
            let thread = std::thread::Builder::new()
                .name(format!("{}-stream{slot}", self.name))
                .spawn(move || {
                    // Runs until every sender is gone, then exits after the last job.
                    for job in queue {
                        job();
                    }
                })
                .expect("spawning a host stream worker");
            Worker {
                jobs,
                thread_id: thread.thread().id(),
                thread: Mutex::new(Some(thread)),
            }
        })
    }

    /// Queue `job` on `stream`'s worker, behind everything dispatched to it before.
    pub(crate) fn dispatch(&self, stream: u64, job: Job) {
        // The receiver only goes away when the worker exits, which happens after `Drop` below
        // has dropped the sender: a send cannot fail while `self` is alive.
        let _ = self.worker(stream).jobs.send(job);
    }

    /// A marker for each started worker, completed once everything dispatched to it so far has
    /// run.
    pub(crate) fn fences(&self) -> Vec<Arc<Marker>> {
        self.slots
            .iter()
            .filter_map(OnceLock::get)
            .map(|worker| {
                let marker = Marker::pending();
                let done = marker.clone();
                let _ = worker.jobs.send(Box::new(move || done.complete(Ok(()))));
                marker
            })
            .collect()
    }
}

impl Drop for Workers {
    /// Shut the device down: each worker finishes what was dispatched to it, then exits.
    fn drop(&mut self) {
        let me = std::thread::current().id();
        for slot in self.slots.iter_mut() {
            let Some(worker) = slot.take() else { continue };
            let Worker {
                jobs,
                thread,
                thread_id,
            } = worker;
            drop(jobs);
            if thread_id != me
                && let Some(thread) = thread.into_inner()
            {
                let _ = thread.join();
            }
        }
    }
}
