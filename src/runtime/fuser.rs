//! Kernel fusion: the contract between the engine and a runtime that fuses ([`Fuser`]).

use burn_ir::{HandleContainer, OperationIr};

use super::StreamRuntime;
use crate::Result;

/// A runtime's kernel fuser for one stream.
///
/// The engine offers a stream's queued operations to the stream's [`Fuser`] in order, as burn
/// IR, until one is refused; the fuser says how many of them (a prefix) one fused execution
/// covers, and the engine runs that prefix through [`Fuser::execute`] inside one error scope,
/// then offers the rest again. Runs the fuser does not cover (or that cover fewer than two
/// operations) execute operation by operation, as without fusion.
///
/// Offers happen when the queue reaches its bound and when the stream drains. At the bound, a
/// run the fuser has accepted to the end of the queue stays queued, still planned (up to
/// [`crate::EngineConfig::max_fused_len`] entries): later operations are offered to the same
/// fuser, without a reset, so one kernel covers a run longer than the queue bound and each
/// operation is offered once. A drain (a read, a share, a sync) executes the run as it stands:
/// fused, or operation by operation where the fuser declines a run cut there
/// ([`Fuser::fuse_cut_run`]).
///
/// The engine keeps the rules fusion must not break:
///
/// * **Error scopes.** An operation with an input that carries an error record (or has no
///   handle) ends the run before it, and executes alone, so errors still travel per tensor. A
///   fused execution that fails records its error on every output of the run.
/// * **Liveness.** A dropped tensor that an offered operation produced or read is offered as
///   [`OperationIr::Drop`] (status `ReadWrite`), so the fuser knows it is not needed afterwards;
///   an output consumed (`ReadWrite`) or dropped inside the run may legitimately never be
///   written. Every other output must be registered, or it gets [`crate::Error::OutputNotWritten`].
/// * **Shares and reads.** A share or a read drains the whole queue before aliasing or reading,
///   so a run never spans one: what is drained is complete before the alias exists.
/// * **Aliases.** The fuser sees the stream's handles when an operation is offered, so it can
///   refuse to write in place a buffer that another owner (a view) holds or that is foreign to
///   the stream ([`StreamRuntime::foreign_to`]); an operation that runs unfused gets the second
///   rule from the engine.
pub trait Fuser<R: StreamRuntime>: Send {
    /// Offer the next queued operation. `false` when it cannot join the run (the run ends
    /// before it, and it will be offered again, first, to a reset fuser). `handles` are the
    /// stream's handles now; every handle an offered operation reads stays registered, as it
    /// is, until the run executes.
    fn offer(&mut self, op: &OperationIr, handles: &HandleContainer<R::FusionHandle>) -> bool;

    /// How many of the operations offered since the last reset (a prefix, drops included) one
    /// fused execution would cover now.
    fn covered(&self) -> usize;

    /// Execute the covered operations on the current stream: take their inputs from `handles`
    /// by the status their IR records, and register every output the fused kernels write.
    /// Returns how many kernels were launched. Dispatch only; must not wait for the device.
    fn execute(
        &mut self,
        handles: &mut HandleContainer<R::FusionHandle>,
        context: &R::Context,
    ) -> Result<usize>;

    /// Forget everything offered.
    fn reset(&mut self);

    /// The run offered since the last reset was cut by a drain before the fuser closed it
    /// (`cut` says whose): whether to execute it fused (as [`Fuser::covered`] says), or to run
    /// every one of its operations unfused.
    ///
    /// Where a drain cuts a run depends on when it comes. A program that reads at the same
    /// point every iteration cuts the same run each time ([`Cut::Own`]), but a share's or a
    /// foreign read's drain comes when another thread asks ([`Cut::Foreign`]): a producer's
    /// open run is cut at a different point nearly every time. A fuser that builds and compiles
    /// a kernel per distinct run can decline a cut run it has not met before, so that such cuts
    /// do not each compile a kernel that never runs again. Runs the fuser closed itself, or
    /// that reached [`crate::EngineConfig::max_fused_len`], are always fused. The default fuses
    /// every run.
    fn fuse_cut_run(&mut self, cut: Cut) -> bool {
        let _ = cut;
        true
    }
}

/// Whose drain cut a run before its fuser closed it ([`Fuser::fuse_cut_run`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cut {
    /// The stream's own thread (a read, a sync): where it cuts repeats when the program does.
    #[default]
    Own,
    /// Another thread, sharing or reading one of the stream's tensors, or draining it by id:
    /// where it cuts depends on when that thread came. Also the engine's service thread (a
    /// thread's exit, a deferred free's deadline): a deadline comes when the clock says, and a
    /// thread's exit cuts the run its last drain left open, once.
    Foreign,
}
