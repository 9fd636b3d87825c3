//! What the criterion benches share: every sample's time per unit (an op, a clone, an
//! iteration), kept by measurement name for the medians and ratios printed at the end.
#![allow(dead_code)]

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
