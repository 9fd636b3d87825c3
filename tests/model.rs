//! Property: random programs of operations, cross-thread clones and uses, consuming uses, drops
//! (home and foreign), reads, failing operations, publications and downloads, run over several
//! threads with a randomised interleaving, agree read for read with a sequential reference model,
//! and leave nothing behind (see `harness/mod.rs` for the interleavings and the end checks).
//!
//! proptest prints a failing case shrunk to a minimal program. `FUSION_STREAMS_MODEL_CASES` sets
//! the case count (default 2,000); the long mode is `FUSION_STREAMS_MODEL_CASES=100000`.

mod common;
mod harness;

use harness::*;
use proptest::prelude::*;

fn slot() -> impl Strategy<Value = usize> {
    0..SLOTS
}

fn step() -> impl Strategy<Value = Step> {
    let unary = prop_oneof![
        (-2i8..=2).prop_map(Unary::Scale),
        Just(Unary::Exp),
        Just(Unary::Sum)
    ];
    let binary = prop_oneof![Just(Binary::Add), Just(Binary::Mul)];
    let fault = prop_oneof![Just(Fault::Error), Just(Fault::Panic), Just(Fault::Device)];
    let publication = 0..PUBS;
    let download = 0..DOWNLOADS;
    prop_oneof![
        3 => (slot(), prop::array::uniform4(-3i8..=3)).prop_map(|(slot, values)| Step::Upload { slot, values }),
        3 => (slot(), slot(), unary).prop_map(|(dst, src, op)| Step::Unary { dst, src, op }),
        3 => (slot(), slot(), slot(), binary).prop_map(|(dst, lhs, rhs, op)| Step::Binary { dst, lhs, rhs, op }),
        2 => (slot(), slot(), -2i8..=2).prop_map(|(dst, src, factor)| Step::Consume { dst, src, factor }),
        3 => (slot(), slot()).prop_map(|(dst, src)| Step::Clone { dst, src }),
        1 => (slot(), slot()).prop_map(|(dst, src)| Step::Move { dst, src }),
        2 => slot().prop_map(|slot| Step::Drop { slot }),
        3 => slot().prop_map(|slot| Step::Read { slot }),
        1 => slot().prop_map(|slot| Step::ReadConsume { slot }),
        1 => (slot(), slot(), fault).prop_map(|(dst, src, fault)| Step::Fail { dst, src, fault }),
        2 => (publication.clone(), slot()).prop_map(|(publication, src)| Step::Publish { publication, src }),
        3 => (publication.clone(), prop::option::of(download.clone()), prop::bool::weighted(0.1))
            .prop_map(|(publication, keep, wrong)| Step::Download { publication, keep, wrong }),
        1 => download.clone().prop_map(|download| Step::WaitDownload { download }),
        1 => publication.prop_map(|publication| Step::DropPublication { publication }),
        1 => download.prop_map(|download| Step::DropDownload { download }),
        2 => (slot(), slot(), prop::array::uniform3(-2i8..=2)).prop_map(|(dst, src, factors)| Step::Chain { dst, src, factors }),
        2 => (slot(), slot(), slot(), prop::bool::weighted(0.25)).prop_map(|(dst, src, captured, panics)| Step::Capture { dst, src, captured, panics }),
        1 => Just(Step::Idle),
    ]
}

/// Every slot starts filled (uploaded by a random thread), so that steps act on tensors rather
/// than on empty slots; then random steps.
fn program() -> impl Strategy<Value = Program> {
    let uploads =
        prop::collection::vec((0..THREADS, prop::array::uniform4(-3i8..=3)), SLOTS..=SLOTS);
    (
        uploads,
        prop::collection::vec((0..THREADS, step()), 1..48),
        any::<u64>(),
    )
        .prop_map(|(uploads, steps, schedule)| {
            let mut all: Vec<(usize, Step)> = uploads
                .into_iter()
                .enumerate()
                .map(|(slot, (thread, values))| (thread, Step::Upload { slot, values }))
                .collect();
            all.extend(steps);
            Program {
                steps: all,
                schedule,
            }
        })
}

fn cases() -> u32 {
    std::env::var("FUSION_STREAMS_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 4000,
        .. ProptestConfig::default()
    })]

    #[test]
    fn random_multithreaded_programs_match_the_sequential_model(program in program()) {
        if let Err(divergence) = run_program(&program) {
            prop_assert!(false, "{}", divergence);
        }
    }
}

/// What the generated programs exercise (printed with `--nocapture`): a guard against a
/// generator that drifts into programs that check nothing.
#[test]
fn generated_programs_exercise_every_kind_of_check() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let mut total = RunReport::default();
    for _ in 0..200 {
        let program = program().new_tree(&mut runner).unwrap().current();
        total += run_program(&program).unwrap_or_else(|e| panic!("{e}\n{program:?}"));
    }
    println!("200 programs: {total:?}");
    assert!(
        total.concurrent_rounds * 4 > total.rounds,
        "too little concurrency: {total:?}"
    );
    assert!(total.reads > 300 && total.publications > 100 && total.downloads > 40);
    assert!(total.refusals > 5, "{total:?}");
    assert!(
        total.deferred_frees > 10 && total.deferred_flushes > 0 && total.in_place_reuses > 50,
        "deferred frees, service-thread flushes and in-place chains: {total:?}"
    );
    assert!(
        total.fused_kernels > 50 && total.ops_fused > 2 * total.fused_kernels,
        "fused runs: {total:?}"
    );
}

/// The fuzz target's seed corpus (and the decoder it goes through) runs against the model.
#[test]
fn the_fuzz_seed_corpus_matches_the_model() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/programs");
    let mut seeds = 0;
    for entry in std::fs::read_dir(&dir).expect("the seed corpus is committed") {
        let path = entry.unwrap().path();
        let program = decode(&std::fs::read(&path).unwrap());
        if let Err(divergence) = run_program(&program) {
            panic!("{}: {divergence}\n{program:?}", path.display());
        }
        seeds += 1;
    }
    assert!(seeds >= 8, "{seeds} seeds");
    assert!(run_program(&decode(&[])).is_ok(), "the empty input");
}
