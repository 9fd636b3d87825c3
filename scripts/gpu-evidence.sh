#!/usr/bin/env bash
# Run on the GPU machine, from the repository root, with the binaries staged by
# scripts/gpu-tests.sh in gpu-bin/. Writes one log per step into the directory given (default
# gpu-logs/), and prints a summary line per step. Step sets: below.
#
#   ./scripts/gpu-evidence.sh tests [DIR]       # the device-only tests, the suite, examples
#   ./scripts/gpu-evidence.sh sanitizers [DIR]  # memcheck, synccheck, racecheck on the device tests
#   ./scripts/gpu-evidence.sh cross-stream [DIR] # tensors crossing streams on StreamFusion<CubeBackend>
#                                               # and plain CubeBackend, plain and under sanitizers
#                                               # (its halves, each under 600 s:
#                                               # cross-stream-programs, cross-stream-suite)
#   ./scripts/gpu-evidence.sh publish [DIR]     # publication on StreamFusion<CubeBackend>:
#                                               # its tests, plain and under the sanitizers,
#                                               # the example, the transfer benchmark
#   ./scripts/gpu-evidence.sh backend [DIR]     # StreamFusion<CubeBackend>: its tests (the
#                                               # two-GPU to_device test needs a second GPU),
#                                               # the burn example, the backend benchmark
#   ./scripts/gpu-evidence.sh performance [DIR] # the rows the dispatch rules move, with each
#                                               # rule undone in turn (same binary), and
#                                               # pipeline's time round by round
#   ./scripts/gpu-evidence.sh bench-full [DIR]  # the backend benchmark in full, with the
#                                               # device-thread ceiling
#   ./scripts/gpu-evidence.sh attention [DIR]   # attention/512 and /128 alone per contender
#                                               # (ours with every default fuser, with the
#                                               # elementwise fuser only, unfused; plain), with
#                                               # the building/reading split
#   ./scripts/gpu-evidence.sh solo [DIR]        # attention/128 and softmax/64 alone per contender
#                                               # (the same four), 7 rounds each, with the split;
#                                               # after a bench run has warmed the autotune cache
#   ./scripts/gpu-evidence.sh correctness [DIR] # the cross-thread set of execution-streams, then
#                                               # the device tests and the backend tests
#   ./scripts/gpu-evidence.sh correctness-suite [DIR] # `correctness`, and beside it burn's CUDA
#                                               # suite (scripts/gpu-suite.sh, its binary packed
#                                               # in gpu-run/suite/): ~9 minutes on an H100
#   ./scripts/gpu-evidence.sh launch-gate [DIR] # the MLP rows at 8 and 16 threads with the
#                                               # device-thread ceiling, with the launch gate off
#                                               # and at 6, 8 and 12 threads (off and 8 twice)
#   ./scripts/gpu-evidence.sh targets [DIR]     # issue 28's CUDA rows in one process (the full
#                                               # backend bench with the ceiling, 5 rounds,
#                                               # verbose), then pipeline alone with section
#                                               # times, and with a queue bound of 128
#   ./scripts/gpu-evidence.sh cut-sightings [DIR] # the pipeline rows (15 rounds, verbose) with a
#                                               # thread's own cut runs fused from their 2nd
#                                               # sighting (the default), their 8th, and never
#   ./scripts/gpu-evidence.sh fused-len [DIR]   # the pipeline rows with fused runs bounded at
#                                               # 512 (default), 32, 16 and 8 entries
#   ./scripts/gpu-evidence.sh host16 [DIR]      # NdArray's chain and MLP-thread rows on the
#                                               # machine's cores, and the engine bench's one
#                                               # stream against burn-fusion, twice
#   ./scripts/gpu-evidence.sh pipeline-host [DIR] # pipeline/1 alone per contender under
#                                               # callgrind, per thread, with system-call time
#                                               # (GPU_TESTS_SYMBOLS=1 build, staged valgrind)
#   ./scripts/gpu-evidence.sh pipeline-compiles [DIR] # pipeline/1, ours then plain alone, with
#                                               # cubecl's compilation, autotune, cross-stream
#                                               # and memory logs between the rounds
#   ./scripts/gpu-evidence.sh pipeline-threads [DIR] # pipeline/1 per contender, natively: each
#                                               # thread's time on a core and what it waits in
#   ./scripts/gpu-evidence.sh pipeline-warm [DIR] # pipeline/1 per contender alone on fresh
#                                               # and on reused cubecl stream slots
#   ./scripts/gpu-evidence.sh execution-streams [DIR] # pipeline/1 per contender on new threads,
#                                               # the pipeline rows, then the cross-thread
#                                               # tests plain and under the sanitizers at once
#   ./scripts/gpu-evidence.sh pipeline-cold [DIR] # pipeline/1 per contender from process start:
#                                               # cubecl's device thread through the first calls
#   ./scripts/gpu-evidence.sh pipeline-stacks [DIR] # pipeline/1 per contender, natively: every
#                                               # thread's stack, sampled with a debugger (and
#                                               # perf, where the machine has it)
#   ./scripts/gpu-evidence.sh host-profile [DIR] # host instructions per repetition of softmax/64,
#                                               # attention/128 and layer-norm/64 under callgrind,
#                                               # per contender (valgrind staged by
#                                               # scripts/stage-valgrind.sh; compare the records
#                                               # with scripts/cg-compare.py)
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-tests}
out=${2:-gpu-logs}
mkdir -p "$out"
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/usr/local/cuda/lib64}
cs=/usr/local/cuda/bin/compute-sanitizer
# Binaries packed by `scripts/gpu-tests.sh --pack` (the device tool's carry limit).
if [ ! -d gpu-bin ] && [ -f gpu-run/bin.tar.xz ]; then
    mkdir -p gpu-bin && xz -dc gpu-run/bin.tar.xz | tar -C gpu-bin -xf -
fi
# The backend bench with its symbol table (GPU_TESTS_SYMBOLS=1), for the callgrind steps.
if [ ! -f gpu-bin/bench-backend-syms ] && [ -f gpu-run/bench-syms.xz ]; then
    xz -dc gpu-run/bench-syms.xz > gpu-bin/bench-backend-syms && chmod +x gpu-bin/bench-backend-syms
fi
# The two fault tests (memory exhausted, a kernel that traps) lose the device on purpose, each in
# a child process: not under the sanitizers, which would report the fault itself.
skip=(--skip device_out_of_memory --skip a_device_fault_after_publish)
# memcheck reports every failing driver call as an error, the 64 TiB `cuMemHostAlloc` the
# page-locked allocation test makes fail on purpose included: not under memcheck either.
skip_memcheck=("${skip[@]}" --skip pinned_allocation_failure_is_out_of_memory)

step() {
    local name=$1
    shift
    local start=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    local rc=$?
    printf '%-22s rc=%s %4ss  %s\n' "$name" "$rc" "$((SECONDS - start))" \
        "$(grep -E 'test result|ERROR SUMMARY|RACECHECK SUMMARY|^ratio| alone ' "$out/$name.log" | tr '\n' ' ')"
}

# pipeline/1 with contender $1 alone, $2 rounds, verbose, under `timeout $3`, binary $4, output
# to $5, in the background, for the steps that watch it from outside: sets $tpid (the timeout)
# and, once the bench has started, $pid (the bench).
pipeline_alone() {
    FUSION_STREAMS_BENCH_ONLY=pipeline/1 FUSION_STREAMS_BENCH_SOLO=$1 \
        FUSION_STREAMS_BENCH_ROUNDS=$2 FUSION_STREAMS_BENCH_VERBOSE=1 \
        timeout "$3" "$4" --bench > "$5" 2>&1 &
    tpid=$!
    pid=
    while [ -z "$pid" ] && kill -0 $tpid 2> /dev/null; do
        pid=$(pgrep -P $tpid | head -n 1)
        [ -n "$pid" ] || sleep 0.05
    done
}

# Bench row $1 with each contender alone in its own process (ours with every default fuser,
# ours with the elementwise fuser only, ours unfused, plain), 7 rounds each, with the
# building/reading split; step names $2-<contender>, each capped at $3 seconds.
alone() {
    local row=$1 name=$2 cap=$3 who
    for who in ours ours-elementwise unfused plain; do
        (
            [ "$who" = ours-elementwise ] && export FUSION_STREAMS_CUBE_FUSERS=elementwise
            FUSION_STREAMS_BENCH_ONLY="$row" FUSION_STREAMS_BENCH_SOLO="${who%-elementwise}" \
                FUSION_STREAMS_BENCH_ROUNDS=7 FUSION_STREAMS_BENCH_VERBOSE=1 \
                step "$name-$who" timeout "$cap" ./gpu-bin/bench-backend --bench
        )
    done
}

# The cross-thread correctness set, plain and under the sanitizers, all at once on the one GPU:
# the cross-stream program, the suite, the thread programs, publication and its example.
cross_thread_set() {
    main=tensors_that_cross_streams_are_read_after_their_writes_and_never_reused_under_a_reader
    step cross-stream ./gpu-bin/cross_stream --ignored --exact $main --nocapture &
    step suite-backend ./gpu-bin/suite_backend --ignored --test-threads=1 &
    step backend-threads ./gpu-bin/backend_threads --ignored &
    step publish ./gpu-bin/publish --ignored --test-threads=1 &
    step publish-download-cuda ./gpu-bin/publish_download &
    (
        export FUSION_STREAMS_RACE_ROUNDS=11 FUSION_STREAMS_RACE_SIZE=256 FUSION_STREAMS_RACE_EACH=20
        export NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS=1000000
        for tool in racecheck memcheck; do
            step "cross-stream-$tool" "$cs" --tool "$tool" ./gpu-bin/cross_stream --ignored \
                --exact $main --nocapture &
        done
        step suite-backend-racecheck "$cs" --tool racecheck ./gpu-bin/suite_backend --ignored \
            --test-threads=1 &
        step backend-threads-racecheck "$cs" --tool racecheck ./gpu-bin/backend_threads --ignored &
        step publish-memcheck "$cs" --tool memcheck ./gpu-bin/publish --ignored --test-threads=1 &
        wait
    )
    wait
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
case "$what" in
tests)
    step device-tests ./gpu-bin/device --ignored --test-threads=1
    step suite-backend ./gpu-bin/suite_backend --ignored --test-threads=1
    step quickstart-cuda ./gpu-bin/quickstart
    step publish-download-cuda ./gpu-bin/publish_download
    ;;
sanitizers)
    step device-memcheck "$cs" --tool memcheck ./gpu-bin/device --ignored --test-threads=1 \
        "${skip_memcheck[@]}"
    for tool in synccheck racecheck; do
        step "device-$tool" "$cs" --tool "$tool" ./gpu-bin/device --ignored --test-threads=1 "${skip[@]}"
    done
    ;;
cross-stream | cross-stream-programs | cross-stream-suite)
    control=cross_stream_programs_on_plain_cubebackend
    main=tensors_that_cross_streams_are_read_after_their_writes_and_never_reused_under_a_reader
    # The whole set runs past the device tool's 600 s a call: `cross-stream-programs` and
    # `cross-stream-suite` are its two halves.
    if [ "$what" != cross-stream-suite ]; then
        step cross-stream-control ./gpu-bin/cross_stream --ignored --exact $control --nocapture
        step cross-stream ./gpu-bin/cross_stream --ignored --exact $main --nocapture
        step suite-backend ./gpu-bin/suite_backend --ignored --test-threads=1
        # The sanitizers slow every kernel down: smaller programs, 20 rounds (1 warm-up + 19),
        # the four cross-stream runs at once on the one GPU (about 5 minutes on an H200
        # together).
        (
            export FUSION_STREAMS_RACE_ROUNDS=19 FUSION_STREAMS_RACE_SIZE=256 FUSION_STREAMS_RACE_EACH=20
            export NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS=1000000
            for tool in racecheck memcheck synccheck; do
                step "cross-stream-$tool" "$cs" --tool "$tool" ./gpu-bin/cross_stream --ignored \
                    --exact $main --nocapture &
            done
            step cross-stream-control-racecheck "$cs" --tool racecheck ./gpu-bin/cross_stream \
                --ignored --exact $control --nocapture &
            wait
        )
    fi
    if [ "$what" != cross-stream-programs ]; then
        for tool in racecheck memcheck; do
            step "suite-backend-$tool" "$cs" --tool "$tool" ./gpu-bin/suite_backend --ignored \
                --test-threads=1
        done
        step backend-threads-racecheck "$cs" --tool racecheck ./gpu-bin/backend_threads --ignored
    fi
    ;;
publish)
    step publish ./gpu-bin/publish --ignored --test-threads=1
    for tool in memcheck racecheck synccheck; do
        step "publish-$tool" "$cs" --tool "$tool" ./gpu-bin/publish --ignored --test-threads=1 &
    done
    wait
    step publish-download-cuda ./gpu-bin/publish_download
    step transfer-bench ./gpu-bin/transfer --bench
    ;;
backend)
    step backend-cuda ./gpu-bin/backend --ignored --test-threads=1
    step backend-threads-cuda ./gpu-bin/backend_threads --ignored
    step burn-multi-thread-cuda ./gpu-bin/burn_multi_thread
    step bench-backend-cuda ./gpu-bin/bench-backend --bench
    ;;
performance)
    # The rows the dispatch rules move, in one process each, 7 rounds: with the defaults, then
    # with each rule undone on its own, then with all of them undone (the rules of 2026-12-02).
    export FUSION_STREAMS_BENCH_ROUNDS=${FUSION_STREAMS_BENCH_ROUNDS:-7}
    rows=pipeline,attention/128,softmax,threads/1,threads/2
    FUSION_STREAMS_BENCH_ONLY=$rows step ab-defaults ./gpu-bin/bench-backend --bench
    # Runs another thread cuts counted like the thread's own (fused from their second cut).
    FUSION_STREAMS_CUBE_FOREIGN_CUT_SIGHTINGS=2 FUSION_STREAMS_BENCH_ONLY=$rows \
        step ab-foreign-cuts-counted ./gpu-bin/bench-backend --bench
    # Closed runs wait for the queue bound instead of being dispatched as they close.
    FUSION_STREAMS_BENCH_DISPATCH_CLOSED_RUNS=0 FUSION_STREAMS_BENCH_ONLY=$rows \
        step ab-waiting ./gpu-bin/bench-backend --bench
    # Every cut run fused at once, and closed runs waiting.
    FUSION_STREAMS_CUBE_CUT_SIGHTINGS=1 FUSION_STREAMS_CUBE_FOREIGN_CUT_SIGHTINGS=1 \
        FUSION_STREAMS_BENCH_DISPATCH_CLOSED_RUNS=0 FUSION_STREAMS_BENCH_ONLY=$rows \
        step ab-all-undone ./gpu-bin/bench-backend --bench
    # Where pipeline's time goes with the defaults, round by round.
    FUSION_STREAMS_BENCH_ONLY=pipeline FUSION_STREAMS_BENCH_VERBOSE=1 \
        step pipeline-verbose ./gpu-bin/bench-backend --bench
    ;;
bench-full)
    # The backend benchmark in full (with the device-thread ceiling).
    step bench-backend-cuda ./gpu-bin/bench-backend --bench
    ;;
launch-gate)
    # How many threads may launch at once (EngineConfig::max_launching_threads; the default is
    # half the hardware threads): the rows it moves, 5 rounds, one process per bound, alternated.
    nproc
    for n in 0 6 8 12 0 8; do
        FUSION_STREAMS_BENCH_LAUNCHING_THREADS=$n FUSION_STREAMS_BENCH_ROUNDS=5 \
            FUSION_STREAMS_BENCH_ONLY=threads/8,threads/16 \
            step "launch-gate-$n-$SECONDS" ./gpu-bin/bench-backend --bench
    done
    ;;
targets)
    # Every row of issue 28's first and third targets, side by side in one process, with what
    # the engine did per call (about 5 minutes on an H200); then the pipeline rows alone with
    # the engine's section times, and with a queue bound (and so a posting bound) of 128.
    FUSION_STREAMS_BENCH_ROUNDS=5 FUSION_STREAMS_BENCH_VERBOSE=1 \
        step bench-full-verbose ./gpu-bin/bench-backend --bench
    FUSION_STREAMS_BENCH_ONLY=pipeline FUSION_STREAMS_BENCH_ROUNDS=5 FUSION_STREAMS_BENCH_VERBOSE=1 \
        FUSION_STREAMS_BENCH_PROFILE=1 step pipeline-profile ./gpu-bin/bench-backend --bench
    FUSION_STREAMS_BENCH_ONLY=pipeline FUSION_STREAMS_BENCH_ROUNDS=5 \
        FUSION_STREAMS_BENCH_QUEUE_LEN=128 step pipeline-queue128 ./gpu-bin/bench-backend --bench
    ;;
cut-sightings)
    # Whether the final reads of `pipeline/1` that take 16-250 ms (docs/BENCHMARKS.md, "Records
    # posted while another thread drains, measured") wait behind the compilation of a kernel for
    # a cut run met for the second time, and what fusing own cuts later or never costs those rows
    # (FUSION_STREAMS_CUBE_CUT_SIGHTINGS; about 40 s each).
    for n in 2 8 0; do
        FUSION_STREAMS_CUBE_CUT_SIGHTINGS=$n FUSION_STREAMS_BENCH_ONLY=pipeline \
            FUSION_STREAMS_BENCH_VERBOSE=1 step "pipeline-cut-sightings-$n" \
            timeout 120 ./gpu-bin/bench-backend --bench
    done
    ;;
fused-len)
    # Whether shorter fused runs help the pipeline rows (docs/BENCHMARKS.md, "Shares without the
    # producer's lock"): a 64-operation run of the producer is 17 tasks for cubecl's device
    # thread in a burst. The rows with section times, with fused runs bounded at 512 entries
    # (the default; the fuser closes them near 64), 32, 16 and 8 (about 15 s each).
    for n in 512 32 16 8; do
        FUSION_STREAMS_BENCH_MAX_FUSED_LEN=$n FUSION_STREAMS_BENCH_ONLY=pipeline \
            FUSION_STREAMS_BENCH_ROUNDS=7 FUSION_STREAMS_BENCH_VERBOSE=1 FUSION_STREAMS_BENCH_PROFILE=1 \
            step "pipeline-fused-len-$n" timeout 120 ./gpu-bin/bench-backend --bench
    done
    ;;
host16)
    # Issue 28's second target on the machine's cores: NdArray's 1,000-op chains and the small
    # MLP at 1-16 threads against plain NdArray, then the engine bench's one stream against
    # burn-fusion (mock runtime), in two processes.
    FUSION_STREAMS_BENCH_ONLY=chain/,threads/ FUSION_STREAMS_BENCH_ROUNDS=7 \
        step ndarray-chain-threads ./gpu-bin/bench-backend-ndarray --bench
    for run in 1 2; do
        step "engine-throughput-$run" ./gpu-bin/engine --bench throughput
    done
    # chain/16384 loses 12-15% on this host and nothing on the 2-core dev machine: each
    # contender alone (the bench prints the thread's time on a core and time waiting for one),
    # under perf's counters where the machine has perf.
    stat=()
    command -v perf > /dev/null && stat=(perf stat -e \
        task-clock,page-faults,context-switches,cpu-migrations,cycles,instructions,cache-misses)
    for who in ours plain; do
        FUSION_STREAMS_BENCH_ONLY=chain/16384 FUSION_STREAMS_BENCH_SOLO=$who \
            FUSION_STREAMS_BENCH_ROUNDS=7 step "chain16k-solo-$who" "${stat[@]}" \
            ./gpu-bin/bench-backend-ndarray --bench
    done
    ;;
attention)
    # Where the fused attention step loses at 512 positions (docs/BENCHMARKS.md, "Attention at
    # 512 positions, alone"): each contender alone in its own process, and ours with the matmul
    # fuser left out, each with the per-repetition split between building and reading. cubecl's
    # cold autotune of the fused matmul takes ~30 s of the untimed round: no cap under 90 s.
    for seq in 512 128; do
        alone "attention/$seq" "attention$seq" 180
    done
    ;;
solo)
    # The rows furthest below plain (docs/BENCHMARKS.md, "Each contender alone, the rows furthest
    # below plain"): each contender alone in its own process, with the building/reading split.
    for row in attention/128 softmax/64; do
        alone "$row" "solo-${row%/*}${row#*/}" 75
    done
    ;;
host-profile)
    # The host's instructions per repetition (docs/BENCHMARKS.md, "Host work per repetition on
    # CUDA"): callgrind from $VALGRIND_DIR (default gpu-run/valgrind, staged by
    # scripts/stage-valgrind.sh) on gpu-bin/bench-backend-syms, which keeps its symbol table
    # (GPU_TESTS_SYMBOLS=1 scripts/gpu-tests.sh). One callgrind record per round of a row
    # (`--dump-after` the bench's `Phases::report`). A native round of each contender first fills
    # cubecl's autotune and PTX caches (kept under target/ by the cubecl.toml written here), so
    # the records hold no compilation or tuning.
    vg=${VALGRIND_DIR:-gpu-run/valgrind}
    rows=${FUSION_STREAMS_BENCH_ONLY:-softmax/64,attention/128,layer-norm/64}
    printf '[compilation]\ncache = "target"\n' > cubecl.toml
    for who in plain ours unfused; do
        FUSION_STREAMS_BENCH_ONLY=$rows FUSION_STREAMS_BENCH_SOLO=$who FUSION_STREAMS_BENCH_ROUNDS=1 \
            step "warm-$who" timeout 150 ./gpu-bin/bench-backend-syms --bench
    done
    for who in plain ours unfused; do
        VALGRIND_LIB=$PWD/$vg FUSION_STREAMS_BENCH_ONLY=$rows FUSION_STREAMS_BENCH_SOLO=$who \
            FUSION_STREAMS_BENCH_ROUNDS=2 step "callgrind-$who" timeout 300 "$vg/valgrind" \
            --tool=callgrind --dump-after='*Phases*report*' --callgrind-out-file="$out/cg-$who.out" \
            ./gpu-bin/bench-backend-syms --bench &
    done
    wait
    ;;
pipeline-host)
    # Where the host's time goes in pipeline/1 (docs/BENCHMARKS.md, "Exit cuts"): each
    # contender alone under callgrind, one record per thread (the producer, the consumer,
    # cubecl's device thread), with the time spent in system calls (a wait on a lock or on
    # another thread is a futex call). A native round of each first fills cubecl's kernel cache
    # on disk, so the records hold no compilation.
    vg=${VALGRIND_DIR:-gpu-run/valgrind}
    bin=./gpu-bin/bench-backend-syms
    printf '[compilation]\ncache = "target"\n' > cubecl.toml
    for who in ours plain; do
        FUSION_STREAMS_BENCH_ONLY=pipeline/1 FUSION_STREAMS_BENCH_SOLO=$who \
            FUSION_STREAMS_BENCH_ROUNDS=3 step "pipeline-warm-$who" timeout 100 $bin --bench
    done
    for who in ours plain; do
        VALGRIND_LIB=$PWD/$vg FUSION_STREAMS_BENCH_ONLY=pipeline/1 FUSION_STREAMS_BENCH_SOLO=$who \
            FUSION_STREAMS_BENCH_ROUNDS=4 step "pipeline-callgrind-$who" timeout 300 "$vg/valgrind" \
            --tool=callgrind --separate-threads=yes --collect-systime=nsec \
            --callgrind-out-file="$out/cg-pipe-$who.out" $bin --bench &
    done
    wait
    ;;
pipeline-compiles)
    # Whether ours compiles kernels in the measured rounds of pipeline/1 (its fused-run time
    # varies 4-16 ms between rounds, docs/BENCHMARKS.md "Shorter fused runs"): cubecl's
    # compilation log (level "basic", on stderr, in order with the bench's per-round lines), ours
    # alone, 15 rounds, verbose, with the engine's sections; then the same with fused runs of at
    # most 8 entries. The same cubecl.toml also logs autotune choices, cubecl's cross-stream waits
    # ("Waiting on <stream> from <stream>": each one an event, a stream wait and a task for
    # cubecl's garbage-collection thread, whose channel holds 8) and memory-page events; plain
    # runs last, alone, for its count of the same. The step's summary counts each kind (logging
    # on cubecl's device thread slows the rounds: read this step for counts, not times).
    printf '%s\n' '[compilation.logger]' 'level = "basic"' 'stderr = true' \
        '[autotune.logger]' 'level = "minimal"' 'stderr = true' \
        '[streaming.logger]' 'level = "basic"' 'stderr = true' \
        '[memory.logger]' 'level = "basic"' 'stderr = true' > cubecl.toml
    for run in ours:512 ours:8 plain:512; do
        who=${run%:*} n=${run#*:}
        FUSION_STREAMS_BENCH_MAX_FUSED_LEN=$n FUSION_STREAMS_BENCH_ONLY=pipeline/1 \
            FUSION_STREAMS_BENCH_SOLO=$who FUSION_STREAMS_BENCH_ROUNDS=15 \
            FUSION_STREAMS_BENCH_VERBOSE=1 FUSION_STREAMS_BENCH_PROFILE=1 \
            step "pipeline-compiles-$who-$n" timeout 150 ./gpu-bin/bench-backend --bench
        log=$out/pipeline-compiles-$who-$n.log
        echo "  $who, fused runs <= $n: compilation lines $(grep -ci 'compil' "$log")," \
            "autotune lines $(grep -ci 'autotune\|fastest' "$log")," \
            "cross-stream waits $(grep -c 'Waiting on' "$log")," \
            "memory lines $(grep -ci 'page\|memory' "$log")"
    done
    rm -f cubecl.toml
    ;;
pipeline-threads)
    # What each thread of pipeline/1 does, from outside and without stopping it (a debugger's
    # attach stalls cuLaunchKernel on its own lock, so pipeline-stacks cannot show cubecl's
    # device thread): each contender alone, rounds back to back; after 8 s, every thread's time
    # on a core and user/system split over a window (/proc/PID/task/TID/schedstat and stat),
    # and its state, kernel wait channel and system call sampled every ~5 ms in between. The
    # rounds completed in the window come from the verbose per-call lines.
    for who in ${THREADS_WHO:-ours unfused plain}; do
        pipeline_alone $who 1000000 60 "${THREADS_BIN:-./gpu-bin/bench-backend}" \
            "$out/threads-$who-bench.log"
        sleep 8
        snap() { # tid comm on-cpu-ns waiting-ns slices utime stime (ticks); then the process
            for t in /proc/$pid/task/*; do
                echo "$(basename "$t") $(cat "$t/comm") $(cat "$t/schedstat") $(awk '{print $14, $15}' "$t/stat")"
            done 2> /dev/null
            echo "process all $(awk '{print $14, $15}' /proc/$pid/stat) (utime stime, ticks of $(getconf CLK_TCK)/s)"
        }
        calls() { grep -c 'in all' "$out/threads-$who-bench.log"; }
        snap > "$out/threads-$who-t0.txt"
        c0=$(calls) t0=$(date +%s.%N)
        for _ in $(seq 1 "${THREAD_SAMPLES:-600}"); do
            for t in /proc/$pid/task/*; do
                echo "$(basename "$t") $(cat "$t/comm") $(cut -d' ' -f3 "$t/stat") $(cat "$t/wchan") $(cut -d' ' -f1 "$t/syscall")"
            done 2> /dev/null
            sleep 0.005
        done > "$out/threads-$who-states.txt"
        snap > "$out/threads-$who-t1.txt"
        c1=$(calls) t1=$(date +%s.%N)
        kill $pid 2> /dev/null
        wait $tpid 2> /dev/null
        echo "$who: $((c1 - c0)) calls in a $(awk "BEGIN { printf \"%.2f\", $t1 - $t0 }") s window"
    done
    ;;
pipeline-warm)
    # pipeline/1 (a new producer thread every call) after one untimed call (every call on a
    # fresh cubecl stream slot) and after 130 (slots reused: docs/BENCHMARKS.md, "Fresh cubecl
    # streams"); each contender alone in its own process (burn-fusion's pipeline is too slow
    # for 130 untimed calls), 15 rounds; all rows with the peers when PIPELINE_WARM_ALL=1.
    for untimed in 1 130; do
        for who in ours unfused plain; do
            FUSION_STREAMS_BENCH_ONLY=pipeline/1 FUSION_STREAMS_BENCH_SOLO=$who \
                FUSION_STREAMS_BENCH_UNTIMED=$untimed FUSION_STREAMS_BENCH_ROUNDS=15 \
                step "pipeline1-$who-untimed-$untimed" timeout 120 ./gpu-bin/bench-backend --bench
        done
        if [ "${PIPELINE_WARM_ALL:-0}" = 1 ]; then
            FUSION_STREAMS_BENCH_ONLY=pipeline/ FUSION_STREAMS_BENCH_UNTIMED=$untimed \
                FUSION_STREAMS_BENCH_ROUNDS=15 \
                step "pipeline-untimed-$untimed" timeout 560 ./gpu-bin/bench-backend --bench
        fi
    done
    ;;
execution-streams)
    # Execution streams (src/stream/exec.rs: a new thread runs on the backend stream of one that
    # exited). pipeline/1 alone per contender after 1 untimed call, each call a new producer
    # thread (before: ours paid a fresh cubecl slot per call), and ours after 130 for the warm
    # reference; the pipeline rows as the bench runs them; then the cross-thread correctness
    # set, plain and under the sanitizers, all at once on the one GPU.
    for who in ours unfused plain; do
        FUSION_STREAMS_BENCH_ONLY=pipeline/1 FUSION_STREAMS_BENCH_SOLO=$who \
            FUSION_STREAMS_BENCH_UNTIMED=1 FUSION_STREAMS_BENCH_ROUNDS=15 \
            step "pipeline1-$who-untimed-1" timeout 120 ./gpu-bin/bench-backend --bench
    done
    FUSION_STREAMS_BENCH_ONLY=pipeline/1 FUSION_STREAMS_BENCH_SOLO=ours \
        FUSION_STREAMS_BENCH_UNTIMED=130 FUSION_STREAMS_BENCH_ROUNDS=15 \
        step pipeline1-ours-untimed-130 timeout 120 ./gpu-bin/bench-backend --bench
    FUSION_STREAMS_BENCH_ONLY=pipeline/ FUSION_STREAMS_BENCH_ROUNDS=15 \
        step pipeline-rows timeout 240 ./gpu-bin/bench-backend --bench
    cross_thread_set
    ;;
correctness | correctness-suite)
    # The cross-thread correctness set (as in execution-streams), then the device tests and
    # StreamFusion<CubeBackend>'s tests, one after another; with `correctness-suite`, burn's
    # CUDA suite runs at the same time (its four parts, each under SUITE_TIMEOUT), so that both
    # fit one device call.
    if [ "$what" = correctness-suite ]; then
        SUITE_TIMEOUT=${SUITE_TIMEOUT:-420} bash scripts/gpu-suite.sh "$out" > "$out/suite-summary.txt" 2>&1 &
        suite=$!
    fi
    cross_thread_set
    step device-tests ./gpu-bin/device --ignored --test-threads=1
    step backend-cuda ./gpu-bin/backend --ignored --test-threads=1
    if [ "$what" = correctness-suite ]; then
        wait "$suite"
        cat "$out/suite-summary.txt"
    fi
    ;;
pipeline-cold)
    # The first calls of pipeline/1 on fresh cubecl streams (docs/BENCHMARKS.md, "Fresh cubecl
    # streams"): each contender alone from process start, 400 calls, while cubecl's device
    # threads ("DSD-0-0"; its garbage-collection thread inherits the name) are sampled as fast
    # as bash's builtins allow (no process per sample): milliseconds since start, thread, state,
    # system call (or "running"), user and system ticks so far; the calls done so far every 100
    # samples. A blocking driver call shows as a system call; page faults as system ticks.
    for who in ${THREADS_WHO:-ours plain}; do
        log=$out/cold-$who-bench.log
        pipeline_alone $who 400 60 "${THREADS_BIN:-./gpu-bin/bench-backend}" "$log"
        dsd=()
        while [ ${#dsd[@]} -lt 2 ] && kill -0 "$pid" 2> /dev/null; do
            dsd=()
            for t in /proc/$pid/task/*; do
                { read -r comm < "$t/comm"; } 2> /dev/null && [ "$comm" = DSD-0-0 ] && dsd+=("$t")
            done
            [ ${#dsd[@]} -ge 2 ] || sleep 0.01
        done
        i=0
        while kill -0 "$pid" 2> /dev/null; do
            ((i % 100 == 0)) && echo "calls $(grep -c 'in all' "$log")"
            for t in "${dsd[@]}"; do
                { read -r stat < "$t/stat"; } 2> /dev/null || continue
                { read -r sys _ < "$t/syscall"; } 2> /dev/null
                f=(${stat##*) })
                echo "${EPOCHREALTIME} ${t##*/} ${f[0]} $sys ${f[11]} ${f[12]}"
            done
            i=$((i + 1))
        done > "$out/cold-$who-samples.txt"
        wait $tpid
        echo "$who: $(grep -vc '^calls' "$out/cold-$who-samples.txt") samples over" \
            "$(grep -c 'in all' "$log") calls"
    done
    ;;
pipeline-stacks)
    # Where pipeline/1's threads wait, natively (callgrind runs one thread at a time, so its
    # picture of threads waiting on each other is not the native one): each contender alone,
    # running rounds back to back, sampled STACK_SAMPLES times by attaching a debugger
    # (gdb, else CUDA's cuda-gdb) and printing every thread's backtrace; with `perf`, also
    # 10 s of samples, their self time by thread and function. Needs the GPU_TESTS_SYMBOLS=1
    # build. cuda-gdb's attach stalls cuLaunchKernel on libcudadebugger's own lock, so with it
    # the device thread's stack is the attach's (docs/BENCHMARKS.md, "Fresh cubecl streams"):
    # pipeline-threads and pipeline-cold watch that thread without stopping it.
    bin=${STACKS_BIN:-./gpu-bin/bench-backend-syms}
    gdb=$(command -v gdb || echo /usr/local/cuda/bin/cuda-gdb)
    echo "debugger: $gdb; perf: $(command -v perf || echo none)"
    for who in ours plain; do
        pipeline_alone $who 1000000 200 "$bin" "$out/stacks-$who-bench.log"
        sleep 10 # past the untimed round's compilation
        if command -v perf > /dev/null; then
            perf record -F 997 -g -p $pid -o "$out/perf-$who.data" -- sleep 10 > /dev/null 2>&1
            perf report -i "$out/perf-$who.data" --stdio --no-children --sort pid,sym -g none 2> /dev/null |
                head -n 400 > "$out/perf-$who.txt"
            rm -f "$out/perf-$who.data"
        fi
        for i in $(seq 1 "${STACK_SAMPLES:-25}"); do
            echo "=== sample $i" >> "$out/stacks-$who.txt"
            timeout 60 "$gdb" -p $pid -batch -nx -ex 'set pagination off' \
                -ex 'thread apply all bt 30' >> "$out/stacks-$who.txt" 2>&1
            sleep 0.3
        done
        kill $pid 2> /dev/null
        wait $tpid 2> /dev/null
        echo "$who: $(grep -c '^=== sample' "$out/stacks-$who.txt") samples, $(grep -c '^Thread ' "$out/stacks-$who.txt") thread stacks"
    done
    ;;
*)
    echo "unknown step set: $what" >&2
    exit 2
    ;;
esac
