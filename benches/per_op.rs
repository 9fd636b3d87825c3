//! The engine's own cost per recorded burn operation, for an instruction counter.
//!
//! `per_op <ours|plain> <chains>` runs `chains` times the 1,024-op elementwise chain of
//! `benches/backend.rs` (on 1 Ki f32, then a read) on `StreamFusion<NdArray>` or on plain
//! `NdArray`, after one untimed chain. Under callgrind, the difference of two runs' instruction
//! counts over the difference of their chains is the cost of one more chain; ours minus plain,
//! over 1,024, is the engine's cost per recorded operation:
//!
//! ```text
//! cargo bench --bench per_op --no-run
//! for who in ours plain; do for n in 10 60; do
//!   valgrind --tool=callgrind --callgrind-out-file=cg.$who.$n target/release/deps/per_op-* $who $n
//! done; done
//! ```
//!
//! `scripts/per-op-cost.sh` does exactly that and prints the result. Without callgrind it
//! prints the wall time per op, which on a shared machine is only a rough guide.

use std::time::Instant;

use burn_backend::Backend;
use burn_ndarray::NdArray;
use burn_tensor::{Tensor, TensorData};
use fusion_streams::backend::StreamFusion;

#[path = "../tests/under_test/mod.rs"]
mod under_test;

use under_test::elementwise_chain;

type Plain = NdArray<f32>;
type Ours = StreamFusion<Plain>;

/// Operations in one chain.
const OPS: usize = 1024;
/// Elements of the chain's tensor.
const LEN: usize = 1024;

fn chains<B: Backend>(count: usize) {
    let device = Default::default();
    let values: Vec<f32> = (0..LEN).map(|i| (i % 17) as f32 / 64.0 - 0.125).collect();
    let x = Tensor::<B, 1>::from_data(TensorData::new(values, [LEN]), &device);
    let run = || {
        std::hint::black_box(elementwise_chain(x.clone(), OPS).into_data());
    };
    run();
    let start = Instant::now();
    for _ in 0..count {
        run();
    }
    if count > 0 {
        let per_op = start.elapsed() / (count * OPS) as u32;
        eprintln!("{count} chains of {OPS} ops: {per_op:?} per op (wall time)");
    }
}

fn main() {
    // `cargo bench` passes `--bench` first; it is not one of ours.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let who = args.first().map_or("ours", String::as_str);
    let count = args.get(1).and_then(|n| n.parse().ok()).unwrap_or(10);
    match who {
        "ours" => chains::<Ours>(count),
        "plain" => chains::<Plain>(count),
        other => {
            eprintln!("per_op: expected `ours` or `plain`, got `{other}`");
            std::process::exit(2);
        }
    }
}
