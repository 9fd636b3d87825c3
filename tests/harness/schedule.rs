//! The interleaving: a program cut into rounds of steps that may run concurrently, with a
//! seeded jitter before each step.

use super::program::{DOWNLOADS, PUBS, Program, SLOTS, Step, THREADS, access};

/// A small deterministic generator for the schedule.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What to do before a step: nothing, yield, or spin a while.
#[derive(Debug, Clone, Copy)]
pub(super) enum Jitter {
    None,
    Yield,
    Spin(u32),
}

impl Jitter {
    pub(super) fn apply(self) {
        match self {
            Jitter::None => {}
            Jitter::Yield => std::thread::yield_now(),
            Jitter::Spin(n) => (0..n).for_each(|_| std::hint::spin_loop()),
        }
    }
}

pub(super) type Round = Vec<Vec<(usize, Step, Jitter)>>;

/// Cut a program into rounds of steps that may run concurrently.
pub(super) fn rounds(program: &Program) -> Vec<Round> {
    let mut rng = Rng(program.schedule | 1);
    let mut out = Vec::new();
    let mut round: Round = vec![Vec::new(); THREADS];
    // Per resource: the threads that read / wrote it in the current round.
    let mut readers = [0u8; SLOTS + PUBS + DOWNLOADS];
    let mut writers = [0u8; SLOTS + PUBS + DOWNLOADS];
    let mut budget = 1 + rng.below(8);
    for (index, (thread, step)) in program.steps.iter().enumerate() {
        let me = 1u8 << thread;
        let others = !me;
        let (reads, writes) = access(step);
        let conflict = reads.iter().any(|r| writers[*r] & others != 0)
            || writes
                .iter()
                .any(|w| (writers[*w] | readers[*w]) & others != 0);
        if conflict || budget == 0 {
            out.push(std::mem::replace(&mut round, vec![Vec::new(); THREADS]));
            readers.fill(0);
            writers.fill(0);
            budget = 1 + rng.below(8);
        }
        budget -= 1;
        reads.iter().for_each(|r| readers[*r] |= me);
        writes.iter().for_each(|w| writers[*w] |= me);
        let jitter = match rng.below(4) {
            0 | 1 => Jitter::None,
            2 => Jitter::Yield,
            _ => Jitter::Spin(rng.below(2000) as u32),
        };
        round[*thread].push((index, step.clone(), jitter));
    }
    out.push(round);
    out
}
