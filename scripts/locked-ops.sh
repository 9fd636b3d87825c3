#!/usr/bin/env bash
# Locked read-modify-write instructions per recorded op (and per MLP forward), ours and plain
# NdArray, by where they sit in the source.
#
# callgrind counts a `lock cmpxchg` as one instruction, but on a 16-core server core each costs
# ~8 ns beside the engine's other work (docs/logs/2026-12-06-locked-ops-per-op.log: five fewer
# per op made the 1 Ki chain ~1% faster there, where the instruction count moved by 28). This
# script counts them, which `scripts/per-op-cost.sh` cannot: benches/per_op.rs is built with line
# tables, run under callgrind with a per-instruction dump (2 and 12 chains, or 20 and 120 MLP
# forwards with `--mlp`), and every executed instruction with a `lock` prefix, or an `xchg` with
# memory (locked implicitly), is counted per op from the difference of the two runs, then placed
# with addr2line: the instruction, the innermost function, and the first source lines of this
# repository or of ndarray on the inlining chain. (With `--mlp`, the rows of rayon's idle worker,
# crossbeam's and rayon_core's, move from run to run with how long it spun; the engine's rows do
# not.)
#
#   scripts/locked-ops.sh [--mlp]
set -euo pipefail
cd "$(dirname "$0")/.."
mode=chain
[ "${1:-}" = "--mlp" ] && mode=mlp
export CARGO_PROFILE_BENCH_DEBUG=line-tables-only CARGO_TARGET_DIR=target/locked-ops
bin=$(cargo bench --bench per_op --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*per_op[^"]*\)".*/\1/p' | tail -1)
[ -x "$bin" ] || { echo "locked-ops: could not build benches/per_op.rs" >&2; exit 1; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
objdump -d --no-show-raw-insn "$bin" |
  awk '$2 ~ /^lock/ || ($2 ~ /^xchg/ && $3 ~ /\(/) { sub(":", "", $1); print $1, $2, $3 }' >"$dir/locked"
if [ "$mode" = mlp ]; then runs="20 120" unit=100 what="MLP forward"; else runs="2 12" unit=10240 what=op; fi
for who in ours plain; do
  for n in $runs; do
    RAYON_NUM_THREADS=1 valgrind --tool=callgrind --dump-instr=yes --callgrind-out-file="$dir/cg.$who.$n" \
      "$bin" "$who" "$n" $([ "$mode" = mlp ] && echo mlp) >/dev/null 2>&1
  done
done
set -- $runs
python3 - "$dir" "$bin" "$1" "$2" "$unit" "$what" "$(pwd)" <<'PY'
import collections, re, subprocess, sys
d, binary, lo, hi, unit, what, repo = sys.argv[1:8]
unit = float(unit)
locked = {}
for line in open(f"{d}/locked"):
    addr, *insn = line.split()
    locked[int(addr, 16)] = " ".join(insn)

def counts(path):
    # Executions of each locked instruction, from callgrind's per-instruction dump (addresses
    # absolute or relative to the previous line; a cost line after `calls=` is the call's).
    out, last, call, npos = collections.Counter(), 0, False, 1
    for line in open(path):
        if line.startswith("positions:"):
            npos = len(line.split()) - 1
            continue
        if line.startswith("calls="):
            call = True
            continue
        if not (line.startswith("0x") or line[:1] in "+-*"):
            continue
        fields = line.split()
        at = fields[0]
        if at.startswith("0x"):
            last = int(at, 16)
        elif at[0] in "+-":
            last += int(at[1:]) * (1 if at[0] == "+" else -1)
        if call:
            call = False
            continue
        if last in locked and len(fields) > npos:
            out[last] += int(fields[npos])
    return out

def place(addr):
    lines = subprocess.run(["addr2line", "-i", "-f", "-C", "-e", binary, hex(addr)],
                           capture_output=True, text=True).stdout.splitlines()
    frames = list(zip(lines[::2], lines[1::2]))
    inner = frames[0][0] if frames else "?"
    if not inner.startswith("<"):
        inner = re.sub(r"<.*", "", inner)
    ours = [loc.replace(repo + "/", "") for _, loc in frames
            if loc.startswith(repo) or "/ndarray-" in loc]
    ours = [re.sub(r".*/(ndarray-[^/]*/)", r"\1", loc) for loc in ours]
    return inner, " <- ".join(ours[:3])

for who in ("ours", "plain"):
    a, b = counts(f"{d}/cg.{who}.{hi}"), counts(f"{d}/cg.{who}.{lo}")
    rows = collections.Counter()
    for addr in set(a) | set(b):
        per = (a[addr] - b[addr]) / unit
        if per > 0.05:
            inner, where = place(addr)
            rows[(locked[addr], inner[:40], where)] += per
    print(f"{who}: {sum(rows.values()):.1f} locked instructions per {what}")
    for (insn, inner, where), per in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {per:6.2f}  {insn:14s} {inner:40s} {where}")
PY
