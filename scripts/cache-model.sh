#!/usr/bin/env bash
# The engine's cost under callgrind's cache and branch model, on the two host workloads of
# benches/per_op.rs: the 1 Ki elementwise chain (per op: 12 chains minus 2, over 10,240 ops) and
# the small MLP forward (per forward: 120 forwards minus 20, over 100; one rayon thread), ours
# and plain NdArray, every batch run on the recording thread (the batch runner off). Prints, per
# op and per forward: the engine's instructions (ours minus plain), the first-level
# instruction-cache misses of each side, ours' extra mispredicted branches, and plain's
# instructions over ours.
#
# `scripts/per-op-cost.sh` counts instructions only; this is the model behind the instruction-
# miss figures of docs/BENCHMARKS.md ("Running each operation at its record", "A fuser for
# NdArray"). It takes about a minute on the 2-core dev machine. With `--keep DIR`, the callgrind
# outputs (per-instruction dumps) stay in DIR for callgrind_annotate.
#
#   scripts/cache-model.sh [--keep DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--keep" ]; then
  dir=${2:?--keep needs a directory}
  mkdir -p "$dir"
else
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
fi
# PER_OP_BIN names a built benches/per_op.rs binary to model instead of this tree's (an A/B of
# two builds, e.g. gpu-bin/host/per_op-NAME from scripts/host-ab.sh).
bin=${PER_OP_BIN:-$(cargo bench --bench per_op --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*per_op[^"]*\)".*/\1/p' | tail -1)}
[ -x "$bin" ] || { echo "cache-model: could not build benches/per_op.rs" >&2; exit 1; }
export RAYON_NUM_THREADS=1
# Every batch on the recording thread, as plain runs its operations (see scripts/per-op-cost.sh).
export FUSION_STREAMS_BENCH_BATCH_POOL=off
run() { # who n [mlp]
  valgrind --tool=callgrind --dump-instr=yes --cache-sim=yes --branch-sim=yes \
    --callgrind-out-file="$dir/cg.$1.$2${3:+.$3}" "$bin" "$1" "$2" ${3:-} >/dev/null 2>&1
}
for who in ours plain; do
  run "$who" 2; run "$who" 12; run "$who" 20 mlp; run "$who" 120 mlp
done
python3 - "$dir" <<'PY'
import sys
d = sys.argv[1]
def summary(name):
    for line in open(f"{d}/cg.{name}"):
        if line.startswith("summary:"):
            return [int(x) for x in line.split()[1:]]
    raise SystemExit(f"cache-model: no summary in {name}")
# events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw Bc Bcm Bi Bim
for what, more, less, unit, per in (("chain", "12", "2", 10240, "op"), ("MLP", "120.mlp", "20.mlp", 100, "forward")):
    side = {}
    for who in ("ours", "plain"):
        a, b = summary(f"{who}.{more}"), summary(f"{who}.{less}")
        side[who] = [(x - y) / unit for x, y in zip(a, b)]
    o, p = side["ours"], side["plain"]
    print(f"{what}, per {per}: engine instructions {o[0] - p[0]:.0f}; "
          f"L1 instruction misses ours {o[3]:.2f}, plain {p[3]:.2f}; "
          f"mispredicted branches ours - plain {o[10] + o[12] - p[10] - p[12]:.2f}; "
          f"plain/ours instructions {p[0] / o[0]:.4f}")
PY
