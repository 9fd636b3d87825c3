//! libFuzzer over the reference-model harness: any byte string decodes to a multi-threaded
//! program (see `tests/harness/mod.rs`, `decode`), which runs on the host runtime with a
//! randomised interleaving and must agree with the sequential model and leave nothing behind.
//!
//! ```text
//! cargo +nightly fuzz run programs fuzz/corpus/programs -- -max_total_time=60
//! ```
#![no_main]

#[path = "../../tests/common/mod.rs"]
mod common;
#[path = "../../tests/harness/mod.rs"]
mod harness;

use std::sync::Once;

/// Panics injected by a program's failing steps carry the payload `"step N"` and are contained
/// by the engine; libFuzzer's hook would abort on them. Any other panic still aborts (a crash).
fn allow_injected_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let abort = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let injected = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|m| m.starts_with("step "));
            if !injected {
                abort(info);
            }
        }));
    });
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    allow_injected_panics();
    let program = harness::decode(data);
    if let Err(divergence) = harness::run_program(&program) {
        panic!("{divergence}\n{program:#?}");
    }
});
