#!/usr/bin/env bash
# Every test binary of `cargo test`, run PASSES times while LOOPS busy loops hold the CPUs: a
# test that depends on how fast the machine schedules its threads fails here long before it
# fails on CI's two cores. Two did (the launch gate's count of threads inside, and a random
# program required to cross threads on its own); each failed in a few to most of 40 runs here,
# and passed on CI most of the time.
#
#   scripts/tests-under-load.sh [PASSES] [LOOPS]      (defaults: 3 passes, 4 loops)
#
# Prints one line per binary and pass, the failing tests' panics, and exits 1 if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
passes=${1:-3}
loops=${2:-4}
# The test harnesses only: `cargo test` also builds the examples, which it does not run.
mapfile -t bins < <(cargo test --no-run --message-format=json 2>/dev/null |
  grep -v '"kind":\["example"\]' | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p')
[ "${#bins[@]}" -gt 0 ] || { echo "tests-under-load: no test binary built" >&2; exit 2; }
busy=()
stop() { [ "${#busy[@]}" -eq 0 ] || kill "${busy[@]}" 2>/dev/null || true; }
trap stop EXIT
for _ in $(seq "$loops"); do
  (while :; do :; done) &
  busy+=($!)
done
log=$(mktemp)
failed=0
for pass in $(seq "$passes"); do
  for bin in "${bins[@]}"; do
    name=$(basename "$bin")
    start=$SECONDS
    if timeout 900 "$bin" -q >"$log" 2>&1; then
      echo "ok    pass $pass  ${name%-*}  ($((SECONDS - start)) s)"
    else
      failed=1
      echo "FAIL  pass $pass  ${name%-*}  ($((SECONDS - start)) s)"
      grep -E "panicked at|^test .* FAILED" -A1 "$log" | sed 's/^/      /' | head -12 || true
    fi
  done
done
rm -f "$log"
exit "$failed"
