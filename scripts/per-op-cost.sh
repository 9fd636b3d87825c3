#!/usr/bin/env bash
# The engine's own cost per recorded burn op, in instructions (callgrind), on the 1,024-op
# elementwise chain of 1 Ki f32 (benches/per_op.rs): (ours - plain NdArray) per op, from the
# difference between a run of 12 chains and a run of 2 (start-up cancels out). With `--top N`,
# also the N functions whose instructions per op grew most from plain to ours.
#
# It also prints how much of that difference lies in the backend's own kernels (ndarray,
# macerator, libm): the same kernels over the same values. It was up to ~80 when the heap put
# the chain's buffer on a 32-byte boundary on one side only (their SIMD loops then take a scalar
# head and tail); the bench now gives both sides 64-byte-aligned large buffers, so it should be
# ~0, and a figure far from it says the two sides no longer run the same kernels.
#
# Then the same for the small MLP forward of benches/backend.rs (batch 32, 64 -> 128 -> 16, one
# read each, one rayon thread): the engine's instructions per forward, over 100 more forwards,
# and plain's instructions over ours (the MLP's ratio as an instruction count), with every batch
# run on the recording thread (FUSION_STREAMS_BENCH_BATCH_POOL=off; the last line gives ours
# with burn-ndarray's batch runner, which runs them on rayon's worker). Those totals
# move by a thousand or more between runs: rayon's worker spins, waiting for work, for as long
# as the scheduler lets it. The second MLP line counts the recording thread alone (callgrind's
# `--separate-threads`), where the engine's work is and the matmuls' is not; it moves by a few
# hundred.
#
#   scripts/per-op-cost.sh [--top N]
set -euo pipefail
cd "$(dirname "$0")/.."
top=0
[ "${1:-}" = "--top" ] && top=${2:-25}
bin=$(cargo bench --bench per_op --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*per_op[^"]*\)".*/\1/p' | tail -1)
[ -x "$bin" ] || { echo "per-op-cost: could not build benches/per_op.rs" >&2; exit 1; }
dir=$(mktemp -d)
count() { # who chains -> instructions
  valgrind --tool=callgrind --callgrind-out-file="$dir/cg.$1.$2" "$bin" "$1" "$2" 2>&1 |
    sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
count_threads() { # who forwards -> "all-threads recording-thread" instructions (MLP)
  local out="$dir/threads.$1.$2"
  local all
  all=$(valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$out" \
    "$bin" "$1" "$2" mlp 2>&1 | sed -n 's/.*Collected : \([0-9]*\).*/\1/p')
  # Thread 1 is the process's main thread: the one that records and reads.
  echo "$all $(sed -n 's/^totals: \([0-9]*\).*/\1/p' "$out-01")"
}
declare -A ir
for who in ours plain; do for n in 2 12; do ir[$who.$n]=$(count "$who" "$n"); done; done
per_op() { echo $(( (ir[$1.12] - ir[$1.2]) / (10 * 1024) )); }
ours=$(per_op ours) plain=$(per_op plain)
echo "instructions per op: ours $ours, plain NdArray $plain, the engine's own $((ours - plain))"
for f in "$dir"/cg.*; do
  callgrind_annotate --inclusive=no --threshold=100 "$f" 2>/dev/null |
    sed -n 's/^ *\([0-9,]*\) ([ 0-9.]*%)  \(.*\)$/\1\t\2/p' | tr -d ',' >"$f.txt"
done
python3 - "$dir" "$top" <<'PY'
import re, sys
d, top = sys.argv[1], int(sys.argv[2])
def load(name):
    out = {}
    for line in open(f"{d}/cg.{name}.txt"):
        v, f = line.rstrip("\n").split("\t", 1)
        f = re.sub(r" \[.*\]$", "", f)
        out[f] = out.get(f, 0) + int(v)
    return out
o12, o2, p12, p2 = (load(n) for n in ("ours.12", "ours.2", "plain.12", "plain.2"))
grown = {
    k: ((o12.get(k, 0) - o2.get(k, 0)) - (p12.get(k, 0) - p2.get(k, 0))) / 10240
    for k in set(o12) | set(p12) if "PROGRAM TOTALS" not in k
}
# The function part of "file:function": the backend's kernels, not its IR glue.
kernel = re.compile(r"^<?(macerator::|ndarray::|burn_ndarray::ops::|tanh$|__expm1)")
in_kernels = sum(v for k, v in grown.items() if kernel.search(k.split(":", 1)[-1]))
print(f"  of which in the backend's own kernels (buffer alignment, see the script's header): {in_kernels:.0f}")
for k, v in sorted(grown.items(), key=lambda kv: -kv[1])[:top]:
    print(f"{v:8.1f}  {k[:150]}")
PY
# One rayon thread: NdArray's matmul otherwise spins worker threads for a count that varies.
export RAYON_NUM_THREADS=1
for n in 20 120; do
  read -r ir[runner.mlp.$n] ir[runner.main.$n] <<<"$(count_threads ours "$n")"
done
# The engine's own cost: every batch on the recording thread, as plain runs its operations
# (burn-ndarray's batch runner, on by default, runs a batch holding a matmul on rayon's worker).
export FUSION_STREAMS_BENCH_BATCH_POOL=off
for who in ours plain; do
  for n in 20 120; do
    read -r ir[$who.mlp.$n] ir[$who.main.$n] <<<"$(count_threads "$who" "$n")"
  done
done
mlp() { echo $(( (ir[$1.$2.120] - ir[$1.$2.20]) / 100 )); }
ratio() { python3 -c "print(f'{$1 / $2:.3f}')"; }
ours_mlp=$(mlp ours mlp) plain_mlp=$(mlp plain mlp)
echo "instructions per MLP forward, every batch on the recording thread: ours $ours_mlp, plain" \
  "NdArray $plain_mlp, the engine's own $((ours_mlp - plain_mlp)); plain/ours $(ratio "$plain_mlp" "$ours_mlp")"
ours_main=$(mlp ours main) plain_main=$(mlp plain main)
echo "  on the recording thread alone: ours $ours_main, plain NdArray $plain_main, the engine's own" \
  "$((ours_main - plain_main))"
runner=$(mlp runner mlp) runner_main=$(mlp runner main)
echo "  with the batch runner (the default): ours $runner ($runner_main on the recording thread);" \
  "plain/ours $(ratio "$plain_mlp" "$runner")"
rm -rf "$dir"
