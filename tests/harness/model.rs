//! The sequential reference model: what each value is (or which failure it carries), how a
//! failure travels, and how an observation is compared with the model.

use fusion_streams::Error;

use super::RunReport;
use super::program::{DOWNLOADS, PUBS, SLOTS, Unary};

/// What the model knows of a value: its length and its value or error.
#[derive(Debug, Clone)]
pub struct Model {
    pub len: usize,
    pub value: Result<Vec<f32>, Failure>,
}

/// A failure, split by where the engine records it: on the engine's error map (executor errors
/// and panics) or on the device buffer (device faults). An operation propagates the first
/// engine-recorded failure among its inputs if there is one, else the first device failure.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    Engine(Error),
    Device(Error),
}

impl Failure {
    pub(super) fn error(&self) -> &Error {
        match self {
            Failure::Engine(e) | Failure::Device(e) => e,
        }
    }
}

/// The inputs' values, or the failure the operation reading them ends with. An engine failure
/// upstream skips the operation, which records it as propagated (`Error::Propagated`, naming
/// the first skipped operation: the model leaves that name out, see [`same_error`]).
pub(super) fn combine(inputs: &[&Model]) -> Result<Vec<Vec<f32>>, Failure> {
    if let Some(Err(Failure::Engine(e))) = inputs
        .iter()
        .map(|m| &m.value)
        .find(|v| matches!(v, Err(Failure::Engine(_))))
    {
        return Err(Failure::Engine(propagated(e)));
    }
    inputs.iter().map(|m| m.value.clone()).collect()
}

pub(super) fn propagated(error: &Error) -> Error {
    match error {
        Error::Propagated { .. } => error.clone(),
        root => Error::Propagated {
            skipped: "(any)".into(),
            root: std::sync::Arc::new(root.clone()),
        },
    }
}

/// The same failure: the same root, reached the same way (propagated or not).
pub(super) fn same_error(want: &Error, got: &Error) -> bool {
    want.root() == got.root() && want.is_propagated() == got.is_propagated()
}

pub(super) fn apply_unary(op: Unary, v: &[f32]) -> Vec<f32> {
    match op {
        Unary::Scale(f) => v.iter().map(|x| x * (f as f64) as f32).collect(),
        Unary::Exp => v.iter().map(|x| x.exp()).collect(),
        Unary::Sum => vec![v.iter().fold(0.0f32, |s, x| s + x)],
    }
}

pub(super) fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

pub(super) fn agrees(model: &Model, got: &Result<Vec<f32>, Error>) -> bool {
    match (&model.value, got) {
        (Ok(want), Ok(got)) => same(want, got),
        (Err(want), Err(got)) => same_error(want.error(), got),
        _ => false,
    }
}

/// What a step observed, for the model to check.
#[derive(Debug)]
pub(super) enum Observed {
    Nothing,
    Registered(Result<(), Error>),
    Read(Result<Vec<f32>, Error>),
    /// The publication was refused and the value handed back.
    PublishRejected(Error),
    /// A download: refused with both owners back, or enqueued (and read, if waited for).
    DownloadRejected(Error),
    Downloaded(Option<Result<Vec<f32>, Error>>),
}

/// The sequential reference model.
pub(super) struct Reference {
    pub(super) slots: Vec<Option<Model>>,
    pub(super) publications: Vec<Option<Model>>,
    pub(super) downloads: Vec<Option<Model>>,
    /// Publications admitted whose value's device work failed (their records may end on the
    /// permanent side).
    pub(super) failed_publications: usize,
    pub(super) counts: RunReport,
}

impl Reference {
    pub(super) fn new() -> Self {
        Self {
            slots: vec![None; SLOTS],
            publications: vec![None; PUBS],
            downloads: vec![None; DOWNLOADS],
            failed_publications: 0,
            counts: RunReport::default(),
        }
    }
}
