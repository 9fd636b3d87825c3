//! Opt-in timing of the engine's own sections: where a workload's host time goes.
//!
//! Counters ([`crate::EngineStats`]) say *how often* the engine did something; this module says
//! *how long* it took, on the calling threads' clocks. It is off by default and then costs one
//! relaxed load per section. [`enable`] switches it on for the whole process; [`take`] returns
//! what was gathered since the last call and starts afresh.
//!
//! Sections nest: a share's time includes the lock it waited for and the drain it ran, and an
//! execution's time includes its fused kernels' launches. Each section is counted twice over:
//! for every thread, and for the threads that called [`mark_current_thread`] (a benchmark's
//! consumer thread, say), so one thread's share of the time can be told from the rest.
//!
//! ```
//! use fusion_streams::{FusionClient, host::{HostDevice, HostRuntime}, profile};
//! use burn_backend::TensorData;
//!
//! profile::enable(true);
//! let client = FusionClient::<HostRuntime>::new(HostDevice::default())?;
//! let x = client.from_data(TensorData::new(vec![1.0f32, 2.0], [2]))?.scale(3.0)?;
//! let y = std::thread::spawn(move || x.add(&x)?.to_vec::<f32>()).join().unwrap()?;
//! assert_eq!(y, vec![6.0, 12.0]);
//! let spent = profile::take();
//! assert!(spent.section(profile::Section::Share).all.count >= 1);
//! println!("{spent}");
//! profile::enable(false);
//! # Ok::<(), fusion_streams::Error>(())
//! ```

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// A section of the engine's work that [`take`] reports on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Section {
    /// Recording an operation on the calling thread's stream (its lock included, and any
    /// execution the queue's bound set off).
    Record,
    /// Minting a shared view of another stream's tensor (the source's lock, its drain if its
    /// producer was pending, the ordering, the view's registration).
    Share,
    /// Waiting for a stream's lock while another thread held it (and applying what other
    /// threads posted to it); a lock taken at once is not counted.
    Lock,
    /// Asking the device to make one stream wait for another's work
    /// ([`crate::runtime::StreamRuntime::order_use`]).
    Order,
    /// Executing a stream's queue: fused kernels, single operations, frees.
    Execute,
    /// A fuser launching the kernels of one planned run.
    FusedRun,
    /// Handing buffers another stream allocated back to the device once this stream's work is
    /// done with them ([`crate::runtime::StreamRuntime::release_after_use`]).
    Release,
    /// Reading a tensor: its stream's lock, drain and ordering, not the copy itself.
    Read,
}

impl Section {
    /// Every section, in report order.
    pub const ALL: [Section; 8] = [
        Section::Record,
        Section::Share,
        Section::Lock,
        Section::Order,
        Section::Execute,
        Section::FusedRun,
        Section::Release,
        Section::Read,
    ];

    fn name(self) -> &'static str {
        match self {
            Section::Record => "record",
            Section::Share => "share",
            Section::Lock => "lock",
            Section::Order => "order",
            Section::Execute => "execute",
            Section::FusedRun => "fused run",
            Section::Release => "release",
            Section::Read => "read",
        }
    }
}

const SECTIONS: usize = Section::ALL.len();

static ON: AtomicBool = AtomicBool::new(false);

struct Tally {
    count: AtomicU64,
    nanos: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: Tally = Tally {
    count: AtomicU64::new(0),
    nanos: AtomicU64::new(0),
};

#[allow(clippy::declare_interior_mutable_const)]
const PAIR: [Tally; 2] = [ZERO, ZERO];

/// `[section][0]` every thread, `[section][1]` marked threads only.
static TALLIES: [[Tally; 2]; SECTIONS] = [PAIR; SECTIONS];

std::thread_local! {
    static MARKED: Cell<bool> = const { Cell::new(false) };
}

/// Switch timing on or off for the whole process.
pub fn enable(on: bool) {
    ON.store(on, Relaxed);
}

/// Whether timing is on.
pub fn enabled() -> bool {
    ON.load(Relaxed)
}

/// Count the calling thread's sections apart as well (see [`Profile`]'s `marked`).
pub fn mark_current_thread() {
    MARKED.with(|m| m.set(true));
}

/// Time spent in one section.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Spent {
    /// How many times the section ran.
    pub count: u64,
    /// Its time, summed over those times (and over threads).
    pub time: Duration,
}

/// One section's time on every thread, and on the marked ones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SectionSpent {
    /// On every thread.
    pub all: Spent,
    /// On the threads that called [`mark_current_thread`].
    pub marked: Spent,
}

/// What [`take`] gathered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Profile {
    sections: [SectionSpent; SECTIONS],
}

impl Profile {
    /// The time spent in `section`.
    pub fn section(&self, section: Section) -> SectionSpent {
        self.sections[section as usize]
    }
}

impl fmt::Display for Profile {
    /// One `name count× total (marked: count× total)` item per section that ran.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for section in Section::ALL {
            let s = self.section(section);
            if s.all.count == 0 {
                continue;
            }
            if !first {
                f.write_str(", ")?;
            }
            first = false;
            write!(f, "{} {}× {:.2?}", section.name(), s.all.count, s.all.time)?;
            if s.marked.count > 0 {
                write!(f, " (marked {}× {:.2?})", s.marked.count, s.marked.time)?;
            }
        }
        if first {
            f.write_str("nothing timed")?;
        }
        Ok(())
    }
}

/// What was gathered since the last call, resetting every tally.
pub fn take() -> Profile {
    let mut profile = Profile::default();
    for (i, tallies) in TALLIES.iter().enumerate() {
        let [all, marked] = tallies.each_ref().map(|t| Spent {
            count: t.count.swap(0, Relaxed),
            time: Duration::from_nanos(t.nanos.swap(0, Relaxed)),
        });
        profile.sections[i] = SectionSpent { all, marked };
    }
    profile
}

/// Times a section from its creation to its drop, when timing is on.
pub(crate) struct Timer(Option<(Section, Instant)>);

/// Start timing `section`; the time is added when the returned timer drops.
#[inline(always)]
pub(crate) fn time(section: Section) -> Timer {
    if ON.load(Relaxed) {
        Timer(Some((section, Instant::now())))
    } else {
        Timer(None)
    }
}

impl Drop for Timer {
    #[inline(always)]
    fn drop(&mut self) {
        if let Some((section, start)) = self.0 {
            add(section, start.elapsed());
        }
    }
}

#[cold]
fn add(section: Section, spent: Duration) {
    let nanos = u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX);
    let marked = MARKED.try_with(Cell::get).unwrap_or(false);
    for t in &TALLIES[section as usize][..1 + usize::from(marked)] {
        t.count.fetch_add(1, Relaxed);
        t.nanos.fetch_add(nanos, Relaxed);
    }
}
