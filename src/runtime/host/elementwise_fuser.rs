//! The host device's fuser: a run of elementwise `f32` built-ins (`add`, `mul`, `scale`, `exp`)
//! over tensors of one length becomes one worker job, which computes the whole chain per element
//! and writes only the outputs that outlive the run.
//!
//! Results are bit for bit those of the unfused kernels: each element goes through the same
//! `f32` operations in the same order. A fused job never writes in place.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use burn_backend::{DType, StreamId};
use burn_ir::{
    BinaryOpIr, FloatOperationIr, HandleContainer, NumericOperationIr, OperationIr, ScalarIr,
    ScalarOpIr, TensorId, TensorIr, TensorStatus, UnaryOpIr,
};
use hashbrown::{HashMap, HashSet};
use smallvec::SmallVec;

use super::kernels::HostData;
use super::marker::Marker;
use super::{HostContext, HostHandle, HostRuntime, HostStorage};
use crate::runtime::Fuser;
use crate::{Error, Result};

/// One elementwise step of a fused chain.
#[derive(Debug, Clone, Copy)]
enum Step {
    Add,
    Mul,
    Scale(f32),
    Exp,
}

/// An offered operation: its step, operands and output.
#[derive(Debug, Clone)]
struct Planned {
    step: Step,
    inputs: SmallVec<[TensorIr; 2]>,
    out: TensorIr,
}

/// Where a step reads an operand: an input of the run, or an earlier step's result.
#[derive(Debug, Clone, Copy)]
enum Source {
    Input(usize),
    Step(usize),
}

/// The host fuser of one stream.
#[derive(Debug, Default)]
pub(super) struct HostFuser {
    planned: Vec<Planned>,
    /// Tensors dropped inside the run.
    dropped: HashSet<TensorId>,
    /// Offered entries (operations and drops).
    offered: usize,
    /// The length every tensor of the run has.
    len: Option<usize>,
}

impl HostFuser {
    fn plan(op: &OperationIr) -> Option<Planned> {
        let f32_only = |irs: &[&TensorIr]| irs.iter().all(|ir| ir.dtype == DType::F32);
        let (step, inputs, out) = match op {
            OperationIr::NumericFloat(DType::F32, numeric) => match numeric {
                NumericOperationIr::Add(BinaryOpIr { lhs, rhs, out }) => {
                    (Step::Add, [lhs, rhs].as_slice().to_vec(), out)
                }
                NumericOperationIr::Mul(BinaryOpIr { lhs, rhs, out }) => {
                    (Step::Mul, [lhs, rhs].as_slice().to_vec(), out)
                }
                NumericOperationIr::MulScalar(ScalarOpIr {
                    lhs,
                    rhs: ScalarIr::Float(factor),
                    out,
                }) => (Step::Scale(*factor as f32), vec![lhs], out),
                _ => return None,
            },
            OperationIr::Float(DType::F32, FloatOperationIr::Exp(UnaryOpIr { input, out })) => {
                (Step::Exp, vec![input], out)
            }
            _ => return None,
        };
        let mut all = inputs.clone();
        all.push(out);
        f32_only(&all).then(|| Planned {
            step,
            inputs: inputs.into_iter().cloned().collect(),
            out: out.clone(),
        })
    }
}

impl Fuser<HostRuntime> for HostFuser {
    fn offer(&mut self, op: &OperationIr, _: &HandleContainer<HostHandle>) -> bool {
        if let OperationIr::Drop(tensor) = op {
            if self.planned.is_empty() {
                return false;
            }
            self.dropped.insert(tensor.id);
            self.offered += 1;
            return true;
        }
        let Some(planned) = Self::plan(op) else {
            return false;
        };
        let len = planned.out.shape.num_elements();
        let same_len = planned
            .inputs
            .iter()
            .all(|ir| ir.shape.num_elements() == len);
        if !same_len || self.len.is_some_and(|l| l != len) {
            return false;
        }
        self.len = Some(len);
        self.planned.push(planned);
        self.offered += 1;
        true
    }

    fn covered(&self) -> usize {
        self.offered
    }

    fn execute(
        &mut self,
        handles: &mut HandleContainer<HostHandle>,
        context: &HostContext,
    ) -> Result<usize> {
        let len = self.len.unwrap_or(0);
        // Operands: each step's result by output id, the run's inputs in first-use order.
        let mut produced: HashMap<TensorId, usize> = HashMap::new();
        let mut inputs: Vec<TensorId> = Vec::new();
        let mut program: Vec<(Step, SmallVec<[Source; 2]>)> = Vec::new();
        let mut consumed: HashSet<TensorId> = HashSet::new();
        for (index, planned) in self.planned.iter().enumerate() {
            let sources = planned
                .inputs
                .iter()
                .map(|ir| match produced.get(&ir.id) {
                    Some(step) => Source::Step(*step),
                    None => Source::Input(match inputs.iter().position(|id| *id == ir.id) {
                        Some(position) => position,
                        None => {
                            inputs.push(ir.id);
                            inputs.len() - 1
                        }
                    }),
                })
                .collect();
            for ir in &planned.inputs {
                if ir.status == TensorStatus::ReadWrite {
                    consumed.insert(ir.id);
                }
            }
            produced.insert(planned.out.id, index);
            program.push((planned.step, sources));
        }
        // The run's inputs: second owners (the engine removes consumed ones afterwards).
        let sources: Vec<HostHandle> = inputs
            .iter()
            .map(|id| {
                handles
                    .get_handle_ref(id)
                    .cloned()
                    .ok_or(Error::MissingHandle {
                        op: FUSED.into(),
                        id: *id,
                    })
            })
            .collect::<Result<_>>()?;
        // The results that outlive the run get a buffer; the others stay in registers.
        let written: Vec<(usize, TensorId)> = self
            .planned
            .iter()
            .enumerate()
            .filter(|(_, p)| !consumed.contains(&p.out.id) && !self.dropped.contains(&p.out.id))
            .map(|(index, p)| (index, p.out.id))
            .collect();
        // Each written result has its own marker: a step fails exactly when its unfused kernel
        // would (with the first failing operand's error), and only the results that depend on a
        // failed input carry the failure.
        let targets: Vec<(usize, Arc<HostStorage>, Arc<Marker>)> = written
            .iter()
            .map(|(index, id)| {
                let storage = HostStorage::new(HostData::Unwritten, &context.counters);
                let marker = Marker::pending();
                handles.register_handle(
                    *id,
                    HostHandle {
                        storage: storage.clone(),
                        written: marker.clone(),
                    },
                );
                (*index, storage, marker)
            })
            .collect();
        let mut keep = vec![false; program.len()];
        for (index, _, _) in &targets {
            keep[*index] = true;
        }
        let counters = context.counters.clone();
        counters.kernels_dispatched.fetch_add(1, Ordering::Relaxed);
        context.workers.dispatch(
            StreamId::current().value,
            Box::new(move || {
                let run = || compute(&sources, &program, &keep, len);
                let outcomes = catch_unwind(AssertUnwindSafe(run)).unwrap_or_else(|payload| {
                    let error = Error::from_kernel_panic(FUSED, payload);
                    (vec![Err(error); program.len()], Vec::new())
                });
                let (status, mut values) = outcomes;
                let mut failed = false;
                for (index, storage, marker) in targets {
                    let outcome = status[index].clone();
                    if outcome.is_ok() {
                        *storage.data.write() = HostData::F32(std::mem::take(&mut values[index]));
                    }
                    failed |= outcome.is_err();
                    drop(storage);
                    marker.complete(outcome);
                }
                if failed {
                    counters.kernels_failed.fetch_add(1, Ordering::Relaxed);
                }
                counters.kernels_completed.fetch_add(1, Ordering::Relaxed);
            }),
        );
        Ok(1)
    }

    fn reset(&mut self) {
        self.planned.clear();
        self.dropped.clear();
        self.offered = 0;
        self.len = None;
    }
}

const FUSED: &str = "fused elementwise";

/// Each step's outcome, and the values of the steps to `keep` that succeeded. A step fails with
/// its first failing operand's error, as its unfused kernel (which waits for its operands in
/// order) would.
fn compute(
    sources: &[HostHandle],
    program: &[(Step, SmallVec<[Source; 2]>)],
    keep: &[bool],
    len: usize,
) -> (Vec<Result<()>>, Vec<Vec<f32>>) {
    let inputs: Vec<Result<()>> = sources.iter().map(|h| h.written.wait()).collect();
    let guards: Vec<_> = sources.iter().map(|h| h.storage.data.read()).collect();
    let data: Vec<Result<&[f32]>> = guards
        .iter()
        .zip(inputs)
        .map(|(guard, written)| {
            written?;
            match &**guard {
                HostData::F32(v) if v.len() == len => Ok(v.as_slice()),
                other => Err(Error::KernelFailed {
                    kernel: FUSED.into(),
                    message: format!(
                        "an input holds {:?} of {} elements, {len} expected",
                        other.dtype(),
                        other.len()
                    )
                    .into(),
                }),
            }
        })
        .collect();
    let mut status: Vec<Result<()>> = Vec::with_capacity(program.len());
    for (_, operands) in program {
        let failure = operands.iter().find_map(|operand| match operand {
            Source::Input(input) => data[*input].as_ref().err().cloned(),
            Source::Step(step) => status[*step].as_ref().err().cloned(),
        });
        status.push(failure.map_or(Ok(()), Err));
    }
    let mut values: Vec<Vec<f32>> = status
        .iter()
        .zip(keep)
        .map(|(s, keep)| {
            if s.is_ok() && *keep {
                Vec::with_capacity(len)
            } else {
                Vec::new()
            }
        })
        .collect();
    let mut registers = vec![0.0f32; program.len()];
    for i in 0..len {
        for (index, (step, operands)) in program.iter().enumerate() {
            if status[index].is_err() {
                continue;
            }
            let value = |k: usize| match operands[k] {
                Source::Input(input) => data[input].as_ref().map_or(0.0, |v| v[i]),
                Source::Step(step) => registers[step],
            };
            registers[index] = match step {
                Step::Add => value(0) + value(1),
                Step::Mul => value(0) * value(1),
                Step::Scale(factor) => value(0) * factor,
                Step::Exp => value(0).exp(),
            };
            if keep[index] {
                values[index].push(registers[index]);
            }
        }
    }
    (status, values)
}
