//! What the benches share: every sample's time per unit (an op, a clone, an iteration), kept by
//! measurement name for the medians and ratios printed at the end (the criterion benches), and
//! the engine settings the environment asks for (the backend benches).
#![allow(dead_code)]

pub mod aligned;

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

fn samples() -> &'static Mutex<BTreeMap<String, Vec<f64>>> {
    static SAMPLES: OnceLock<Mutex<BTreeMap<String, Vec<f64>>>> = OnceLock::new();
    SAMPLES.get_or_init(Default::default)
}

/// Keep one sample of `name`: `total` over `units` units.
pub fn record(name: &str, total: Duration, units: u64) {
    samples()
        .lock()
        .unwrap()
        .entry(name.to_owned())
        .or_default()
        .push(total.as_secs_f64() / units.max(1) as f64);
}

/// The median seconds per unit of `name`'s samples, if it ran.
pub fn median(name: &str) -> Option<f64> {
    let samples = samples().lock().unwrap();
    let mut v = samples.get(name)?.clone();
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// The names of every measurement that ran, in order.
pub fn names() -> Vec<String> {
    samples().lock().unwrap().keys().cloned().collect()
}

/// The engine settings the environment asks for, if it asks for any:
/// `FUSION_STREAMS_BENCH_QUEUE_LEN=<n>` (`EngineConfig::max_queue_len`),
/// `FUSION_STREAMS_BENCH_DISPATCH_CLOSED_RUNS=<0|1>` (`EngineConfig::dispatch_closed_runs`) and
/// `FUSION_STREAMS_BENCH_MAX_FUSED_LEN=<n>` (`EngineConfig::max_fused_len`) and
/// `FUSION_STREAMS_BENCH_LAUNCHING_THREADS=<n>` (`EngineConfig::max_launching_threads`, 0 for no
/// bound), each over the default.
pub fn engine_config_from_env() -> Option<fusion_streams::EngineConfig> {
    let knob = |name| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
    };
    let queue_len = knob("FUSION_STREAMS_BENCH_QUEUE_LEN");
    let dispatch = knob("FUSION_STREAMS_BENCH_DISPATCH_CLOSED_RUNS").map(|on| on != 0);
    let fused_len = knob("FUSION_STREAMS_BENCH_MAX_FUSED_LEN");
    let launching = knob("FUSION_STREAMS_BENCH_LAUNCHING_THREADS");
    if queue_len.is_none() && dispatch.is_none() && fused_len.is_none() && launching.is_none() {
        return None;
    }
    let mut config = fusion_streams::EngineConfig::default();
    if let Some(len) = queue_len {
        config = config.with_max_queue_len(len);
    }
    if let Some(dispatch) = dispatch {
        config = config.with_dispatch_closed_runs(dispatch);
    }
    if let Some(len) = fused_len {
        config = config.with_max_fused_len(len);
    }
    // 0: no bound.
    if let Some(n) = launching {
        config = config.with_max_launching_threads(if n == 0 { usize::MAX } else { n });
    }
    Some(config)
}

/// `FUSION_STREAMS_BENCH_BATCH_POOL=off`: `StreamFusion<B>` runs every batch of queued
/// operations on the thread that drains it (`BatchPlacement::InPlace`), where burn-ndarray's
/// default hands a batch holding a matmul to the engine's batch pool in one trip (a comparison
/// only: in place, a batch can wait under its stream's lock for rayon's workers). Call before
/// `B`'s first use; says whether it was asked.
pub fn batch_placement_from_env<B: fusion_streams::backend::IrBackend>() -> bool {
    let off = std::env::var("FUSION_STREAMS_BENCH_BATCH_POOL").is_ok_and(|v| v == "off");
    if off {
        use fusion_streams::backend::{BatchPlacement, set_batch_placement};
        set_batch_placement::<B>(BatchPlacement::InPlace);
    }
    off
}
