//! Transfer steps: publish a tensor from a session on this thread, download a publication (now,
//! or kept pending), wait for a kept download, drop either.

use fusion_streams::Error;
use fusion_streams::host::HostRuntime;
use fusion_streams::runtime::TransferRuntime;
use fusion_streams::transfer::{HeldSession, PublicationAdmissionError};

use super::{At, Run};
use crate::common::buffer_f32s;
use crate::harness::model::{Failure, Model, Observed, Reference, agrees, same_error};
use crate::harness::world::Download;

fn wait_and_read(download: Download) -> Result<Vec<f32>, Error> {
    match download.wait() {
        Ok(buffer) => Ok(buffer_f32s(&buffer)),
        Err(failed) => Err(failed.error),
    }
}

// Publish: open a session, publish `src` (refused, with the value back, if it carries an
// engine failure), close.

pub(super) fn run_publish(run: &mut Run, publication: usize, src: usize) -> Observed {
    let Some(value) = run.slots.slot(src).take() else {
        return Observed::Nothing;
    };
    let mut session = HeldSession::open(run.client()).expect("one session per thread at a time");
    // SAFETY: the value was produced by this crate's operations.
    let outcome = unsafe { session.publish(value) };
    session.close();
    match outcome {
        Ok(p) => {
            *run.world.publications[publication].lock().unwrap() = Some(p);
            Observed::Registered(Ok(()))
        }
        Err(PublicationAdmissionError::Rejected(rejected)) => {
            let rejected = *rejected;
            *run.slots.slot(src) = Some(rejected.value);
            Observed::PublishRejected(rejected.reason)
        }
        Err(other) => Observed::Registered(Err(other.error().clone())),
    }
}

pub(super) fn model_publish(
    r: &mut Reference,
    at: &At,
    observed: Observed,
    publication: usize,
    src: usize,
) -> Result<(), String> {
    let Some(s) = r.slots[src].clone() else {
        return Ok(());
    };
    match (&s.value, observed) {
        // A failure known at the dispatch boundary: refused, the value handed back.
        (Err(Failure::Engine(want)), Observed::PublishRejected(got)) if same_error(want, &got) => {}
        // Admitted (a device failure surfaces at the frontier, later).
        (Ok(_) | Err(Failure::Device(_)), Observed::Registered(Ok(()))) => {
            r.failed_publications += usize::from(s.value.is_err());
            r.slots[src] = None;
            r.publications[publication] = Some(s);
        }
        (_, other) => return at.fail(format!("publish {other:?}, model {:?}", s.value)),
    }
    Ok(())
}

// Download: into a fresh pinned buffer (4 bytes too long if `wrong`); wait now, or keep the
// pending download in slot `keep`.

pub(super) fn run_download(
    run: &mut Run,
    publication: usize,
    keep: Option<usize>,
    wrong: bool,
) -> Observed {
    let mut cell = run.world.publications[publication].lock().unwrap();
    let Some(p) = cell.take() else {
        return Observed::Nothing;
    };
    let len = p.bytes() + if wrong { 4 } else { 0 };
    let buffer = HostRuntime::alloc_pinned(run.client().context(), len).unwrap();
    match p.download_into(buffer) {
        Ok(pending) => match keep {
            None => Observed::Downloaded(Some(wait_and_read(pending))),
            Some(d) => {
                *run.world.downloads[d].lock().unwrap() = Some(pending);
                Observed::Downloaded(None)
            }
        },
        Err(refused) => {
            let (p, buffer, reason) = refused.into_parts();
            assert_eq!(buffer.len(), len, "the buffer comes back");
            *cell = Some(p);
            Observed::DownloadRejected(reason)
        }
    }
}

pub(super) fn model_download(
    r: &mut Reference,
    at: &At,
    observed: Observed,
    publication: usize,
    keep: Option<usize>,
    wrong: bool,
) -> Result<(), String> {
    let Some(p) = r.publications[publication].clone() else {
        return Ok(());
    };
    match observed {
        Observed::DownloadRejected(reason) => {
            // Both owners back: the publication stays where it was.
            let expected = match (&p.value, wrong) {
                (Err(Failure::Device(e)), _) if reason == *e => true,
                (_, true) => matches!(reason, Error::BufferSize { .. }),
                _ => false,
            };
            if !expected {
                return at.fail(format!("download refused: {reason:?}, model {p:?}"));
            }
        }
        Observed::Downloaded(got) => {
            if wrong {
                return at.fail("a wrong-length buffer was accepted".into());
            }
            r.publications[publication] = None;
            match (got, keep) {
                (Some(got), None) if agrees(&p, &got) => {}
                (None, Some(d)) => r.downloads[d] = Some(p),
                (got, _) => return at.fail(format!("downloaded {got:?}, model {:?}", p.value)),
            }
        }
        other => return at.fail(format!("download {other:?}")),
    }
    Ok(())
}

// WaitDownload: wait for a kept download and read its buffer.

pub(super) fn run_wait_download(run: &mut Run, download: usize) -> Observed {
    match run.world.downloads[download].lock().unwrap().take() {
        Some(pending) => Observed::Downloaded(Some(wait_and_read(pending))),
        None => Observed::Nothing,
    }
}

pub(super) fn model_wait_download(
    r: &mut Reference,
    at: &At,
    observed: Observed,
    download: usize,
) -> Result<(), String> {
    let Some(d) = r.downloads[download].take() else {
        return Ok(());
    };
    match observed {
        Observed::Downloaded(Some(got)) if agrees(&d, &got) => Ok(()),
        other => at.fail(format!("waited {other:?}, model {:?}", d.value)),
    }
}

// DropPublication, DropDownload: possibly with work in flight (retired, never waited for).

/// Drop what a world's publication or download slot holds.
pub(super) fn run_drop<T>(held: &std::sync::Mutex<Option<T>>) -> Observed {
    drop(held.lock().unwrap().take());
    Observed::Nothing
}

/// The model of [`run_drop`]: the slot is empty.
pub(super) fn model_drop(slot: &mut Option<Model>) -> Result<(), String> {
    *slot = None;
    Ok(())
}
