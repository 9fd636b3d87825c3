#!/usr/bin/env bash
# Two builds of the NdArray benchmarks side by side on another machine's cores (the GPU
# machine's 16-core host): one process of each build in turn, so that a drift in the machine's
# speed falls on both. The host rows of docs/BENCHMARKS.md ("The lane on a 16-core host") come
# from this.
#
#   scripts/host-ab.sh build NAME   # here: benches/backend.rs and benches/per_op.rs of the
#                                   # working tree, stripped, as gpu-bin/host/{backend,per_op}-NAME
#   scripts/host-ab.sh run A B      # there (carry gpu-bin/host and this script): PAIRS (6) pairs
#                                   # of backend-A, backend-B processes, then PER_OP (6) turns of
#                                   # per_op-B ours and plain (chain; MLP, with rayon's default
#                                   # pool and with one worker)
#
# A name ending in `+aligned` runs its build's backend bench with FUSION_STREAMS_BENCH_ALIGNED=1
# (large buffers on a 64-byte boundary on both sides: benches/common/aligned.rs), so
# `run NAME NAME+aligned` measures one build both ways in turn.
#
# `run` prints one line per process (its `ratio` lines, plain/ours) and the medians per row over
# the processes of each build, then the median per row over every round of every process of a
# build (each round's plain time over ours, from FUSION_STREAMS_BENCH_VERBOSE's round lines: a
# process that ran in a noisy spell weighs as much as its rounds, not as one whole vote). Each
# process's full output goes to $OUT (the device tool brings back only some files, so the
# summary is on stdout). ONLY and ROUNDS set the backend bench's FUSION_STREAMS_BENCH_ONLY
# (default chain/1024,threads/) and FUSION_STREAMS_BENCH_ROUNDS (9). PIN=<cpu list> runs the
# backend bench's processes under `taskset -c` (the chain runs on one thread: pinned, it is not
# migrated).
set -euo pipefail
cd "$(dirname "$0")/.."
host=gpu-bin/host
case "${1:-}" in
build)
    name=${2:?usage: host-ab.sh build NAME}
    mkdir -p "$host"
    for bench in backend per_op; do
        bin=$(cargo bench --bench "$bench" --no-run --message-format=json 2>/dev/null |
            sed -n "s/.*\"executable\":\"\\([^\"]*$bench[^\"]*\\)\".*/\\1/p" | tail -1)
        [ -x "$bin" ] || { echo "host-ab: could not build benches/$bench.rs" >&2; exit 1; }
        strip -o "$host/$bench-$name" "$bin"
    done
    ls -la "$host"/*-"$name"
    ;;
run)
    a=${2:?usage: host-ab.sh run A B} b=${3:?usage: host-ab.sh run A B}
    out=${OUT:-$(mktemp -d)}
    nproc
    lscpu | grep -i "model name" || true
    export FUSION_STREAMS_BENCH_ONLY=${ONLY:-chain/1024,threads/}
    export FUSION_STREAMS_BENCH_ROUNDS=${ROUNDS:-9}
    export FUSION_STREAMS_BENCH_VERBOSE=1
    summary=$out/summary.txt
    : >"$summary"
    for i in $(seq 1 "${PAIRS:-6}"); do
        for build in "$a" "$b"; do
            aligned=0
            [ "$build" != "${build%+aligned}" ] && aligned=1
            FUSION_STREAMS_BENCH_ALIGNED=$aligned ${PIN:+taskset -c "$PIN"} \
                "$host/backend-${build%+aligned}" --bench \
                >"$out/$build-$i.log" 2>&1
            echo "$build $i $(grep '^ratio' "$out/$build-$i.log" | grep -v ceiling |
                sed 's/ratio //' | tr '\n' ' ')" | tee -a "$summary"
        done
    done
    python3 - "$summary" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    build, _, rest = line.split(" ", 2)
    for name, value in re.findall(r"(\S+): ([0-9.]+)", rest):
        rows.setdefault(name, {}).setdefault(build, []).append(float(value))
for name, builds in rows.items():
    print(name, "  ".join(f"{b} median {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f}, {len(v)})"
                          for b, v in builds.items()))
PY
    python3 - "$out" "$a" "$b" <<'PY'
import re, statistics, sys
out, builds = sys.argv[1], sys.argv[2:]
unit = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}
line = re.compile(r"^\s+(\S+) round \d+: ours ([0-9.]+)(ns|µs|us|ms|s), plain ([0-9.]+)(ns|µs|us|ms|s)")
import glob
for build in builds:
    rows = {}
    for log in glob.glob(f"{out}/{build}-*.log"):
        for text in open(log, encoding="utf-8"):
            m = line.match(text)
            if m:
                ours = float(m[2]) * unit[m[3]]
                plain = float(m[4]) * unit[m[5]]
                rows.setdefault(m[1], []).append(plain / ours)
    for name, r in sorted(rows.items()):
        q = statistics.quantiles(r, n=4)
        print(f"{name} {build} over rounds: median {statistics.median(r):.3f} "
              f"(quartiles {q[0]:.3f}-{q[2]:.3f}, {len(r)} rounds)")
PY
    b=${b%+aligned}
    for _ in $(seq 1 "${PER_OP:-6}"); do
        for who in ours plain; do
            echo "chain $who $("$host/per_op-$b" "$who" 150 2>&1 | tail -1)"
        done
        for who in ours plain; do
            echo "mlp $who $("$host/per_op-$b" "$who" 5000 mlp 2>&1 | tail -1)"
        done
        for who in ours plain; do
            echo "mlp-rayon1 $who $(RAYON_NUM_THREADS=1 "$host/per_op-$b" "$who" 5000 mlp 2>&1 | tail -1)"
        done
    done
    ;;
*)
    echo "usage: host-ab.sh build NAME | run A B" >&2
    exit 2
    ;;
esac
