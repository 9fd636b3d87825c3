//! The engine's service thread: the one place where the engine runs work that no user thread is
//! there to run.
//!
//! One thread per process, started with the first engine, serves every engine through a
//! [`EngineHook`] (held weakly: a job for an engine that is gone is skipped). It takes two kinds of
//! jobs:
//!
//! 1. **Drains for exiting threads.** A thread that is exiting must not execute operations itself:
//!    it is in the middle of destroying its thread-locals, and a runtime may need its own (cubecl's
//!    are gone by then: running a queued matmul there panicked on the H200). It hands the stream to
//!    this thread and waits until the drain is done, so a `join` on the exiting thread still
//!    returns only after its work ran. This covers the exit hook itself and any work that a later
//!    thread-local destructor registers, reads or shares during teardown. The hand-off uses
//!    parking_lot's mutex and condition variable, which fall back to stack-allocated thread data
//!    when the waiting thread's thread-locals are already destroyed.
//! 2. **Deferred-free deadlines.** A foreign drop whose id a pending operation still reads is
//!    deferred until the home stream runs that operation. An idle home thread might never do so,
//!    so the deferral also schedules a deadline here; if the free is still pending then, this
//!    thread runs the home stream's pending segment (dispatch only, as a share from another
//!    thread would). That bounds how long a dropped buffer can be held by an idle thread.
//! 3. **Sweeps of idle streams.** Every `EngineConfig::max_idle_delay`, while an engine lives,
//!    this thread looks at each of its streams whose lock is free; a queue that was already
//!    there at the last sweep, with nothing recorded or run since, belongs to a thread that has
//!    gone idle, and this thread runs it. So no thread holds queued work, or the buffers it
//!    reads, for long by going quiet: rayon's workers never exit, and a producer may block on
//!    its channel for good.
//!
//! Every job runs contained: a failing drain takes neither this thread nor a waiting thread down
//! (its operations' errors are recorded on their tensors anyway).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use burn_backend::StreamId;
use parking_lot::{Condvar, Mutex};

/// What the service thread calls back into an engine for.
pub(crate) trait EngineHook: Send + Sync {
    /// The thread that used `stream` exited (or is registering work while it exits): drain the
    /// stream, retire it if it is empty, otherwise mark it orphaned.
    fn on_thread_exit(&self, stream: StreamId);
    /// Drain `stream` on behalf of a thread that cannot execute operations itself.
    fn drain_stream(&self, stream: StreamId);
    /// A deferred free on `stream` reached its deadline: run the pending segment if a deferred
    /// free is still waiting for it.
    fn flush_deferred(&self, stream: StreamId);
    /// Run the queues of streams whose thread has gone idle with work queued (see
    /// `EngineConfig::max_idle_delay`).
    fn sweep_idle(&self);
}

/// A one-shot signal.
#[derive(Default)]
struct Latch {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Latch {
    fn open(&self) {
        *self.open.lock() = true;
        self.opened.notify_all();
    }

    fn wait(&self) {
        let mut open = self.open.lock();
        while !*open {
            self.opened.wait(&mut open);
        }
    }
}

#[derive(Clone, Copy)]
enum ImmediateJob {
    Exit,
    Drain,
}

struct Immediate {
    kind: ImmediateJob,
    hook: Weak<dyn EngineHook>,
    stream: StreamId,
    done: Arc<Latch>,
}

struct Deadline {
    at: Instant,
    seq: u64,
    hook: Weak<dyn EngineHook>,
    what: Due,
}

/// What a deadline is for.
#[derive(Clone, Copy)]
enum Due {
    /// A deferred free of this stream (`EngineHook::flush_deferred`).
    Flush(StreamId),
    /// The engine's sweep of idle streams, every this often while the engine lives
    /// (`EngineHook::sweep_idle`).
    Sweep(Duration),
}

impl PartialEq for Deadline {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Deadline {}
impl PartialOrd for Deadline {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Deadline {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

#[derive(Default)]
struct Jobs {
    immediate: VecDeque<Immediate>,
    deadlines: BinaryHeap<Reverse<Deadline>>,
    seq: u64,
}

struct Service {
    jobs: Mutex<Jobs>,
    wake: Condvar,
}

enum Job {
    Now(Immediate),
    Due(Deadline),
}

impl Service {
    fn next(&self) -> Job {
        let mut jobs = self.jobs.lock();
        loop {
            if let Some(job) = jobs.immediate.pop_front() {
                return Job::Now(job);
            }
            match jobs.deadlines.peek().map(|Reverse(d)| d.at) {
                Some(at) if at <= Instant::now() => {
                    let Reverse(due) = jobs.deadlines.pop().expect("peeked");
                    return Job::Due(due);
                }
                Some(at) => {
                    self.wake.wait_until(&mut jobs, at);
                }
                None => self.wake.wait(&mut jobs),
            }
        }
    }

    /// Add a deadline; wakes the service thread if it is the earliest.
    fn schedule(&self, at: Instant, hook: Weak<dyn EngineHook>, what: Due) {
        let mut jobs = self.jobs.lock();
        jobs.seq += 1;
        let seq = jobs.seq;
        let earliest = jobs.deadlines.peek().is_none_or(|Reverse(d)| at < d.at);
        jobs.deadlines.push(Reverse(Deadline {
            at,
            seq,
            hook,
            what,
        }));
        drop(jobs);
        if earliest {
            self.wake.notify_one();
        }
    }

    fn run(&self) {
        loop {
            match self.next() {
                Job::Now(job) => {
                    if let Some(hook) = job.hook.upgrade() {
                        contained(|| match job.kind {
                            ImmediateJob::Exit => hook.on_thread_exit(job.stream),
                            ImmediateJob::Drain => hook.drain_stream(job.stream),
                        });
                    }
                    job.done.open();
                }
                Job::Due(due) => {
                    let Some(hook) = due.hook.upgrade() else {
                        continue;
                    };
                    match due.what {
                        Due::Flush(stream) => contained(|| hook.flush_deferred(stream)),
                        Due::Sweep(every) => {
                            contained(|| hook.sweep_idle());
                            drop(hook);
                            self.schedule(Instant::now() + every, due.hook, due.what);
                        }
                    }
                }
            }
        }
    }
}

/// Run a job so that nothing it does can take the service thread down: a panic is caught, and its
/// payload dropped where a panic of its own destructor is caught too.
fn contained(job: impl FnOnce()) {
    if let Err(payload) = catch_unwind(AssertUnwindSafe(job)) {
        crate::error::drop_payload(payload);
    }
}

static SERVICE: OnceLock<&'static Service> = OnceLock::new();

/// Start the process's service thread (once; called when an engine is created, in an ordinary
/// context where spawning a thread is safe).
pub(crate) fn start() {
    SERVICE.get_or_init(|| {
        let service: &'static Service = Box::leak(Box::new(Service {
            jobs: Mutex::new(Jobs::default()),
            wake: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("fusion-streams-service".into())
            .spawn(move || service.run())
            .expect("spawning the fusion-streams service thread");
        service
    });
}

fn immediate(kind: ImmediateJob, hook: Weak<dyn EngineHook>, stream: StreamId) {
    super::cell::assert_no_stream_lock("waiting for the service thread");
    let Some(service) = SERVICE.get() else {
        return;
    };
    let done = Arc::new(Latch::default());
    service.jobs.lock().immediate.push_back(Immediate {
        kind,
        hook,
        stream,
        done: done.clone(),
    });
    service.wake.notify_one();
    done.wait();
}

/// Have `stream`'s exit hook run on the service thread, and wait for it.
pub(crate) fn exit_drain(hook: Weak<dyn EngineHook>, stream: StreamId) {
    immediate(ImmediateJob::Exit, hook, stream);
}

/// Have `stream` drained on the service thread, and wait for it.
pub(crate) fn drain(hook: Weak<dyn EngineHook>, stream: StreamId) {
    immediate(ImmediateJob::Drain, hook, stream);
}

/// Call `hook.flush_deferred(stream)` on the service thread at `at`. Never waits.
pub(crate) fn flush_at(at: Instant, hook: Weak<dyn EngineHook>, stream: StreamId) {
    if let Some(service) = SERVICE.get() {
        service.schedule(at, hook, Due::Flush(stream));
    }
}

/// Call `hook.sweep_idle()` on the service thread every `every`, for as long as the engine
/// behind `hook` lives (`Duration::MAX`: never). Never waits.
pub(crate) fn sweep_every(every: Duration, hook: Weak<dyn EngineHook>) {
    let Some(at) = Instant::now().checked_add(every) else {
        return;
    };
    if let Some(service) = SERVICE.get() {
        service.schedule(at, hook, Due::Sweep(every));
    }
}
