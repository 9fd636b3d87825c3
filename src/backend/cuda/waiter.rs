//! Waiter threads: one per captured stream, handling that stream's transfer jobs in order.
//!
//! cubecl 0.10 does not expose its `CUstream`s, and its fence future blocks when polled, so
//! frontiers cannot be multiplexed on one thread. A stuck stream delays only its own later jobs,
//! which the device orders after it anyway: there is no head-of-line blocking across streams.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use burn_backend::StreamId;
use hashbrown::HashMap;
use parking_lot::Mutex;

use super::driver::{OwnedStream, PrimaryContext, device_fault};
use super::event::{CudaEvent, State, spin_until};
use super::{Resolved, copy_resolved};
use crate::runtime::PinnedMemory;
use crate::{Error, Result};

/// A cubecl fence: completes once its stream has finished what was submitted before it.
pub(super) type Fence =
    cubecl::future::DynFut<std::result::Result<(), cubecl::server::ServerError>>;

pub(super) enum Job {
    /// Finish every copy enqueued so far, then complete the event.
    Barrier(CudaEvent),
    /// Await the fences cubecl's server recorded at publish time, then complete the event (with
    /// the server's failure to resolve the source, if it failed).
    Frontier {
        fences: Receiver<Vec<Fence>>,
        source: Resolved,
        event: CudaEvent,
    },
    /// Once `frontier` is reached, enqueue the copy of the resolved source into `dst`.
    Download {
        source: Resolved,
        frontier: CudaEvent,
        dst: Arc<dyn PinnedMemory>,
        event: CudaEvent,
    },
}

struct Waiter {
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Waiter {
    /// Lets the thread finish its jobs and synchronise its copy stream, then joins it.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The waiters of one device, by stream.
pub(super) struct Waiters {
    primary: Arc<PrimaryContext>,
    by_stream: Mutex<HashMap<u64, Waiter>>,
}

impl Waiters {
    pub(super) fn new(primary: Arc<PrimaryContext>) -> Self {
        Self {
            primary,
            by_stream: Mutex::new(HashMap::new()),
        }
    }

    /// Hand `job` to `stream`'s waiter, starting it if needed.
    pub(super) fn send(&self, stream: StreamId, job: Job) -> Result<()> {
        let mut waiters = self.by_stream.lock();
        let waiter = match waiters.entry(stream.value) {
            hashbrown::hash_map::Entry::Occupied(w) => w.into_mut(),
            hashbrown::hash_map::Entry::Vacant(slot) => {
                let (jobs, queue) = channel::<Job>();
                let primary = self.primary.clone();
                let thread = std::thread::Builder::new()
                    .name(format!("fusion-streams-cuda-transfer-{}", stream.value))
                    .spawn(move || run(primary, queue))
                    .map_err(|e| {
                        Error::Runtime(format!("spawning a transfer waiter: {e}").into())
                    })?;
                slot.insert(Waiter {
                    jobs: Some(jobs),
                    thread: Some(thread),
                })
            }
        };
        waiter
            .jobs
            .as_ref()
            .expect("a live waiter has its sender")
            .send(job)
            .map_err(|_| Error::Runtime("the transfer waiter is gone".into()))
    }

    /// Wait until every waiter has handled its jobs so far and finished its copies.
    pub(super) fn barrier(&self) -> Result<()> {
        let streams: Vec<u64> = self.by_stream.lock().keys().copied().collect();
        for stream in streams {
            let event = CudaEvent::pending(&self.primary);
            self.send(StreamId { value: stream }, Job::Barrier(event.clone()))?;
            event.wait()?;
        }
        Ok(())
    }
}

fn run(primary: Arc<PrimaryContext>, queue: Receiver<Job>) {
    // Dropped when the queue closes: every copy enqueued here completes before the stream goes.
    let stream = OwnedStream::new(&primary);
    for job in queue {
        match job {
            Job::Barrier(event) => {
                let outcome = match &stream {
                    Ok(stream) => stream.synchronize(),
                    Err(error) => Err(error.clone()),
                };
                event.set(State::Done(outcome));
            }
            Job::Frontier {
                fences,
                source,
                event,
            } => {
                let mut early = None;
                spin_until(|| {
                    early = fences.try_recv().ok();
                    early.is_some()
                });
                let outcome = match early.map_or_else(|| fences.recv(), Ok) {
                    // Every fence is polled to completion (an unpolled one leaks its event).
                    Ok(fences) => {
                        let mut outcome = Ok(());
                        for fence in fences {
                            let waited = cubecl::future::block_on(fence)
                                .map_err(|e| device_fault("fence", e));
                            outcome = outcome.and(waited);
                        }
                        outcome
                    }
                    Err(_) => Err(Error::Runtime(
                        "cubecl's server dropped the frontier request".into(),
                    )),
                };
                let resolved = match source.get() {
                    Some(Err(error)) => Err(error.clone()),
                    _ => Ok(()),
                };
                event.set(State::Done(outcome.and(resolved)));
            }
            Job::Download {
                source,
                frontier,
                dst,
                event,
            } => {
                let enqueued = frontier.wait().and_then(|()| {
                    let stream = stream.as_ref().map_err(Clone::clone)?;
                    // SAFETY: the download's owner holds the source and the buffer until
                    // `event` completes (the contract of `TransferRuntime::download`).
                    unsafe { copy_resolved(stream, &source, &*dst) }
                });
                event.set(match enqueued {
                    Ok(cuda_event) => State::Enqueued(cuda_event),
                    Err(error) => State::Done(Err(error)),
                });
            }
        }
    }
}
