#!/usr/bin/env python3
"""Compare callgrind records of the backend bench's read-per-repetition rows.

The records come from `scripts/gpu-evidence.sh host-profile` (callgrind with
`--dump-after='*Phases*report*'`: one record per round of a row, `<file>.<n>`, the first of each
row holding the start-up). Instructions are counted over every thread, so cubecl's server
thread (its tasks and its polling loop) is in them.

  scripts/cg-compare.py rounds REPS FILE...        instructions per repetition, each record
  scripts/cg-compare.py diff REPS BASE OTHER [N]   the N functions (self cost) that grew most
                                                   per repetition from BASE to OTHER, and the
                                                   12 that shrank most
"""
import re
import subprocess
import sys

# Frames on every stack (a thread's entry, `main`): in a record after the first, callgrind's
# annotation reports part of their callees' cost as their own.
FRAMES = re.compile(r"\(below main\)|lang_start|__rust_begin_short_backtrace|thread_start|"
                    r"vtable\.shim|\bmain \[|:clone \[|^clone \[|0x000000000009c800|"
                    r"0x000000000002a150|0x000000000001f540")
LINE = re.compile(r"^\s*([0-9,]+) \([^)]*\)\s+(.*)$")


def summary(path):
    with open(path) as f:
        for line in f:
            if line.startswith("summary:"):
                return int(line.split()[1])
    raise SystemExit(f"{path}: no summary line")


def self_costs(path):
    out = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", path],
        capture_output=True, text=True, check=True).stdout
    costs = {}
    for line in out.splitlines():
        match = LINE.match(line)
        if not match:
            continue
        value = int(match.group(1).replace(",", ""))
        name = match.group(2).strip().replace("???:", "")
        if name == "PROGRAM TOTALS" or FRAMES.search(name):
            continue
        costs[name] = costs.get(name, 0) + value
    return costs


def main():
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    what, reps = sys.argv[1], int(sys.argv[2])
    if what == "rounds":
        for path in sys.argv[3:]:
            print(f"{summary(path) / reps:>12,.0f}  {path}")
    elif what == "diff":
        base, other = sys.argv[3], sys.argv[4]
        n = int(sys.argv[5]) if len(sys.argv) > 5 else 30
        a, b = self_costs(base), self_costs(other)
        total = (summary(other) - summary(base)) / reps
        print(f"per repetition: {summary(base) / reps:,.0f} -> {summary(other) / reps:,.0f} "
              f"({total:+,.0f})")
        print(f"{'change':>9} {'base':>9} {'other':>9}  function (self cost per repetition)")
        rows = sorted(set(a) | set(b), key=lambda k: a.get(k, 0) - b.get(k, 0))
        for name in rows[:n] + ["..."] + rows[-12:]:
            if name == "...":
                print("      ...")
                continue
            x, y = a.get(name, 0) / reps, b.get(name, 0) / reps
            print(f"{y - x:>+9,.0f} {x:>9,.0f} {y:>9,.0f}  {name[:150]}")
    else:
        raise SystemExit(__doc__)


main()
