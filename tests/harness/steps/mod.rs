//! The steps. Each family's file holds, for every step, its execution (on its thread, against the
//! engine) beside its model (sequential, in program order): `run_*` then `model_*`. This file
//! dispatches to them.

mod faults;
mod tensors;
mod transfer;

use fusion_streams::Error;

use super::model::{Observed, Reference};
use super::program::{Step, access};
use super::world::{Locked, World};
use crate::common::{Client, Tensor};

/// What a step's execution has at hand: the world, the slots it locked, and its index.
pub(super) struct Run<'w> {
    pub(super) world: &'w World,
    pub(super) slots: Locked<'w>,
    pub(super) index: usize,
}

impl<'w> Run<'w> {
    fn client(&self) -> &'w Client {
        &self.world.client
    }

    /// Store a registered output in `dst`, and observe the registration.
    fn put(&mut self, dst: usize, registered: Result<Tensor, Error>) -> Observed {
        let observed = registered.as_ref().map(|_| ()).map_err(Clone::clone);
        if let Ok(t) = registered {
            *self.slots.slot(dst) = Some(t);
        }
        Observed::Registered(observed)
    }
}

/// Where a model check is, for its messages.
pub(super) struct At<'a> {
    index: usize,
    step: &'a Step,
}

impl At<'_> {
    fn fail<T>(&self, what: String) -> Result<T, String> {
        Err(format!("step {} {:?}: {what}", self.index, self.step))
    }

    /// The registration succeeded if `ok`, or was refused for its shapes otherwise.
    fn expect_registered(&self, observed: &Observed, ok: bool) -> Result<(), String> {
        match observed {
            Observed::Registered(Ok(())) if ok => Ok(()),
            Observed::Registered(Err(Error::ShapeMismatch { .. })) if !ok => Ok(()),
            other => self.fail(format!("registration {other:?}, model expected ok={ok}")),
        }
    }
}

/// Run one step on the calling thread.
pub(super) fn execute(world: &World, index: usize, step: &Step) -> Observed {
    let (reads, writes) = access(step);
    let mut run = Run {
        world,
        slots: Locked::new(world, &reads, &writes),
        index,
    };
    let run = &mut run;
    match *step {
        Step::Upload { slot, values } => tensors::run_upload(run, slot, values),
        Step::Unary { dst, src, op } => tensors::run_unary(run, dst, src, op),
        Step::Binary { dst, lhs, rhs, op } => tensors::run_binary(run, dst, lhs, rhs, op),
        Step::Consume { dst, src, factor } => tensors::run_consume(run, dst, src, factor),
        Step::Chain { dst, src, factors } => tensors::run_chain(run, dst, src, factors),
        Step::Clone { dst, src } => tensors::run_clone_or_move(run, dst, src, true),
        Step::Move { dst, src } => tensors::run_clone_or_move(run, dst, src, false),
        Step::Drop { slot } => tensors::run_drop(run, slot),
        Step::Read { slot } => tensors::run_read(run, slot),
        Step::ReadConsume { slot } => tensors::run_read_consume(run, slot),
        Step::Idle => tensors::run_idle(),
        Step::Fail { dst, src, fault } => faults::run_fail(run, dst, src, fault),
        Step::Capture {
            dst,
            src,
            captured,
            panics,
        } => faults::run_capture(run, dst, src, captured, panics),
        Step::Publish { publication, src } => transfer::run_publish(run, publication, src),
        Step::Download {
            publication,
            keep,
            wrong,
        } => transfer::run_download(run, publication, keep, wrong),
        Step::WaitDownload { download } => transfer::run_wait_download(run, download),
        Step::DropPublication { publication } => {
            transfer::run_drop(&run.world.publications[publication])
        }
        Step::DropDownload { download } => transfer::run_drop(&run.world.downloads[download]),
    }
}

impl Reference {
    /// Advance the model by one step and check what the engine observed.
    pub(super) fn check(
        &mut self,
        index: usize,
        step: &Step,
        observed: Observed,
    ) -> Result<(), String> {
        match &observed {
            Observed::Read(_) | Observed::Downloaded(Some(_)) => self.counts.reads += 1,
            Observed::PublishRejected(_) | Observed::DownloadRejected(_) => {
                self.counts.refusals += 1
            }
            _ => {}
        }
        match (step, &observed) {
            (Step::Publish { .. }, Observed::Registered(Ok(()))) => self.counts.publications += 1,
            (Step::Download { .. }, Observed::Downloaded(_)) => self.counts.downloads += 1,
            _ => {}
        }
        let at = &At { index, step };
        let r = self;
        match *step {
            Step::Upload { slot, values } => tensors::model_upload(r, slot, values),
            Step::Unary { dst, src, op } => tensors::model_unary(r, at, observed, dst, src, op),
            Step::Binary { dst, lhs, rhs, op } => {
                tensors::model_binary(r, at, observed, dst, lhs, rhs, op)
            }
            Step::Consume { dst, src, factor } => {
                tensors::model_consume(r, at, observed, dst, src, factor)
            }
            Step::Chain { dst, src, factors } => {
                tensors::model_chain(r, at, observed, dst, src, factors)
            }
            Step::Clone { dst, src } => tensors::model_clone_or_move(r, dst, src, true),
            Step::Move { dst, src } => tensors::model_clone_or_move(r, dst, src, false),
            Step::Drop { slot } => tensors::model_drop(r, slot),
            Step::Read { slot } => tensors::model_read(r, at, observed, slot, false),
            Step::ReadConsume { slot } => tensors::model_read(r, at, observed, slot, true),
            Step::Idle => Ok(()),
            Step::Fail { dst, src, fault } => faults::model_fail(r, at, observed, dst, src, fault),
            Step::Capture {
                dst,
                src,
                captured,
                panics,
            } => faults::model_capture(r, at, observed, dst, src, captured, panics),
            Step::Publish { publication, src } => {
                transfer::model_publish(r, at, observed, publication, src)
            }
            Step::Download {
                publication,
                keep,
                wrong,
            } => transfer::model_download(r, at, observed, publication, keep, wrong),
            Step::WaitDownload { download } => {
                transfer::model_wait_download(r, at, observed, download)
            }
            Step::DropPublication { publication } => {
                transfer::model_drop(&mut r.publications[publication])
            }
            Step::DropDownload { download } => transfer::model_drop(&mut r.downloads[download]),
        }
    }
}
