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
//! The engine's settings follow the same environment knobs as `benches/backend.rs`
//! (`FUSION_STREAMS_BENCH_QUEUE_LEN` and the others; for the cache model of
//! `docs/BENCHMARKS.md`, "Shorter fused runs"), `FUSION_STREAMS_BENCH_BATCH_RUNNER=off` among
//! them: the MLP's batches then run on the recording thread, as plain's operations do, instead of
//! in rayon's pool.
//!
//! For the chains, both sides allocate through [`Aligned`], which gives every allocation of
//! 1 KiB or more a 64-byte boundary. Without it glibc's 16-byte alignment put the chain's buffer
//! on or off a 32-byte boundary by the heap's history: NdArray's SIMD loops then took a scalar
//! head and tail on one side and not the other, which moved the difference by up to ~80
//! instructions per op in either direction, none of it the engine's. (The MLP's matmuls pack
//! their operands into buffers of their own; there the aligned allocations would only add
//! `memalign`'s own heap-dependent cost, so they stay off.)

use std::sync::atomic::Ordering;
use std::time::Instant;

use burn_backend::Backend;
use burn_ndarray::NdArray;
use burn_tensor::{Tensor, TensorData};
use fusion_streams::backend::StreamFusion;

mod common;
#[path = "../tests/under_test/mod.rs"]
mod under_test;

use common::aligned::{ALIGNED, Aligned};
use under_test::elementwise_chain;

#[global_allocator]
static ALLOCATOR: Aligned = Aligned;

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

/// `count` forwards of the small MLP of `benches/backend.rs` (batch 32, 64 -> 128 -> 16), each
/// read, after one untimed forward: where the engine's cost per forward goes beyond its cost per
/// operation (the reads, the matmuls' operands that stay alive).
fn mlp_forwards<B: Backend>(count: usize) {
    let device = Default::default();
    let tensor = |n: usize, seed: usize, shape: [usize; 2]| {
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 7 + seed) % 23) as f32 / 23.0 - 0.5)
            .collect();
        Tensor::<B, 1>::from_data(TensorData::new(values, [n]), &device).reshape(shape)
    };
    let (w1, w2, x) = (
        tensor(64 * 128, 0, [64, 128]),
        tensor(128 * 16, 1, [128, 16]),
        tensor(32 * 64, 2, [32, 64]),
    );
    let forward = || {
        let h = burn_tensor::activation::relu(x.clone().matmul(w1.clone()) + 0.1);
        std::hint::black_box(h.matmul(w2.clone()).sum_dim(1).into_data());
    };
    forward();
    let start = Instant::now();
    for _ in 0..count {
        forward();
    }
    if count > 0 {
        eprintln!(
            "{count} MLP forwards: {:?} per forward (wall time)",
            start.elapsed() / count as u32
        );
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
    let mlp = args.get(2).is_some_and(|w| w == "mlp");
    ALIGNED.store(!mlp, Ordering::Relaxed);
    // The engine settings of benches/backend.rs' knobs, if the environment sets any.
    common::batch_placement_from_env::<Plain>();
    if let Some(config) = common::engine_config_from_env() {
        assert!(
            Ours::configure(&Default::default(), config),
            "configured before first use"
        );
    }
    match who {
        "ours" if mlp => mlp_forwards::<Ours>(count),
        "plain" if mlp => mlp_forwards::<Plain>(count),
        "ours" => chains::<Ours>(count),
        "plain" => chains::<Plain>(count),
        other => {
            eprintln!("per_op: expected `ours` or `plain`, got `{other}`");
            std::process::exit(2);
        }
    }
}
