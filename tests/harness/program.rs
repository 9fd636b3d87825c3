//! A program: the steps a run performs, which resources each step touches, and the decoder the
//! fuzz target generates programs with.

pub const THREADS: usize = 3;
pub const SLOTS: usize = 6;
pub const PUBS: usize = 2;
pub const DOWNLOADS: usize = 2;
pub const LEN: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Unary {
    Scale(i8),
    Exp,
    Sum,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Binary {
    Add,
    Mul,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    /// The executor returns an error.
    Error,
    /// The executor panics.
    Panic,
    /// The kernel fails on the device, after dispatch.
    Device,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Upload {
        slot: usize,
        values: [i8; LEN],
    },
    Unary {
        dst: usize,
        src: usize,
        op: Unary,
    },
    Binary {
        dst: usize,
        lhs: usize,
        rhs: usize,
        op: Binary,
    },
    /// Scale `src`, handing the tensor over (a `ReadWrite` use when it is the last reference).
    Consume {
        dst: usize,
        src: usize,
        factor: i8,
    },
    Clone {
        dst: usize,
        src: usize,
    },
    Move {
        dst: usize,
        src: usize,
    },
    Drop {
        slot: usize,
    },
    Read {
        slot: usize,
    },
    ReadConsume {
        slot: usize,
    },
    Fail {
        dst: usize,
        src: usize,
        fault: Fault,
    },
    /// Open a session on this thread, publish `src` into publication slot `publication`, close.
    Publish {
        publication: usize,
        src: usize,
    },
    /// Download a publication into a fresh pinned buffer (one 4 bytes too long if `wrong`);
    /// wait now, or keep the pending download in download slot `keep`.
    Download {
        publication: usize,
        keep: Option<usize>,
        wrong: bool,
    },
    WaitDownload {
        download: usize,
    },
    DropPublication {
        publication: usize,
    },
    DropDownload {
        download: usize,
    },
    /// Three consuming scales in a row, starting from `src` (a chain that runs in place where
    /// the runtime allows it, on whichever thread's stream runs the step).
    Chain {
        dst: usize,
        src: usize,
        factors: [i8; 3],
    },
    /// An identity custom op on `src` whose executor captures a clone of `captured`; the
    /// capture's destructor panics if `panics` (recorded on the output when the op is dropped).
    Capture {
        dst: usize,
        src: usize,
        captured: usize,
        panics: bool,
    },
    /// This thread sits idle for longer than the engine's deferred-free bound: the service
    /// thread's deadline passes while the thread's stream may hold pending work.
    Idle,
}

/// A program: its steps, and the seed of its interleaving.
#[derive(Debug, Clone)]
pub struct Program {
    pub steps: Vec<(usize, Step)>,
    pub schedule: u64,
}

/// The resources a step touches, as indices into one space: tensor slots, then publication
/// slots, then download slots.
pub(super) fn access(step: &Step) -> (Vec<usize>, Vec<usize>) {
    let p = |i: usize| SLOTS + i;
    let d = |i: usize| SLOTS + PUBS + i;
    match *step {
        Step::Upload { slot, .. } | Step::Drop { slot } | Step::ReadConsume { slot } => {
            (vec![], vec![slot])
        }
        Step::Read { slot } => (vec![slot], vec![]),
        Step::Unary { dst, src, .. } | Step::Clone { dst, src } | Step::Fail { dst, src, .. } => {
            (vec![src], vec![dst])
        }
        Step::Binary { dst, lhs, rhs, .. } => (vec![lhs, rhs], vec![dst]),
        Step::Consume { dst, src, .. } | Step::Move { dst, src } => (vec![], vec![src, dst]),
        Step::Publish { publication, src } => (vec![], vec![src, p(publication)]),
        Step::Download {
            publication, keep, ..
        } => {
            let mut w = vec![p(publication)];
            w.extend(keep.map(d));
            (vec![], w)
        }
        Step::WaitDownload { download } | Step::DropDownload { download } => {
            (vec![], vec![d(download)])
        }
        Step::DropPublication { publication } => (vec![], vec![p(publication)]),
        Step::Chain { dst, src, .. } => (vec![], vec![src, dst]),
        Step::Capture {
            dst, src, captured, ..
        } => (vec![src, captured], vec![dst]),
        Step::Idle => (vec![], vec![]),
    }
}

/// Decode a program from arbitrary bytes (the fuzz target's generator): every byte string is a
/// valid program, so the fuzzer explores programs rather than parse errors.
pub fn decode(bytes: &[u8]) -> Program {
    let mut it = bytes.iter().copied();
    let mut schedule = [0u8; 8];
    for b in &mut schedule {
        *b = it.next().unwrap_or(0);
    }
    let mut next = move || it.next();
    // Every slot starts filled, as in the property test.
    let mut steps: Vec<(usize, Step)> = (0..SLOTS)
        .map(|slot| {
            let b = next().unwrap_or(slot as u8);
            let values = [b, b >> 2, b >> 4, b.rotate_left(3)].map(|v| (v % 7) as i8 - 3);
            (b as usize % THREADS, Step::Upload { slot, values })
        })
        .collect();
    while steps.len() < SLOTS + 64 {
        let Some(head) = next() else { break };
        let mut arg = || next().unwrap_or(0) as usize;
        let thread = (head as usize >> 5) % THREADS;
        let slot = |v: usize| v % SLOTS;
        let step = match head % 19 {
            0 => {
                let values = [arg(), arg(), arg(), arg()].map(|v| (v % 7) as i8 - 3);
                Step::Upload {
                    slot: slot(arg()),
                    values,
                }
            }
            1 => Step::Unary {
                dst: slot(arg()),
                src: slot(arg()),
                op: match arg() % 3 {
                    0 => Unary::Scale((arg() % 5) as i8 - 2),
                    1 => Unary::Exp,
                    _ => Unary::Sum,
                },
            },
            2 => Step::Binary {
                dst: slot(arg()),
                lhs: slot(arg()),
                rhs: slot(arg()),
                op: if arg() % 2 == 0 {
                    Binary::Add
                } else {
                    Binary::Mul
                },
            },
            3 => Step::Consume {
                dst: slot(arg()),
                src: slot(arg()),
                factor: (arg() % 5) as i8 - 2,
            },
            4 | 5 => Step::Clone {
                dst: slot(arg()),
                src: slot(arg()),
            },
            6 => Step::Move {
                dst: slot(arg()),
                src: slot(arg()),
            },
            7 => Step::Drop { slot: slot(arg()) },
            8 => Step::Read { slot: slot(arg()) },
            9 => Step::ReadConsume { slot: slot(arg()) },
            10 => Step::Fail {
                dst: slot(arg()),
                src: slot(arg()),
                fault: match arg() % 3 {
                    0 => Fault::Error,
                    1 => Fault::Panic,
                    _ => Fault::Device,
                },
            },
            11 => Step::Publish {
                publication: arg() % PUBS,
                src: slot(arg()),
            },
            12 => {
                let publication = arg() % PUBS;
                let k = arg();
                Step::Download {
                    publication,
                    keep: (k % 3 != 0).then_some(k % DOWNLOADS),
                    wrong: k % 11 == 0,
                }
            }
            13 => Step::WaitDownload {
                download: arg() % DOWNLOADS,
            },
            14 => Step::DropPublication {
                publication: arg() % PUBS,
            },
            15 => Step::DropDownload {
                download: arg() % DOWNLOADS,
            },
            16 => Step::Chain {
                dst: slot(arg()),
                src: slot(arg()),
                factors: [arg(), arg(), arg()].map(|v| (v % 5) as i8 - 2),
            },
            17 => Step::Capture {
                dst: slot(arg()),
                src: slot(arg()),
                captured: slot(arg()),
                panics: arg() % 4 == 0,
            },
            _ => Step::Idle,
        };
        steps.push((thread, step));
    }
    Program {
        steps,
        schedule: u64::from_le_bytes(schedule),
    }
}
