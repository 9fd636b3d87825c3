#!/usr/bin/env bash
# Run on the GPU machine, from the repository root: burn v0.21.0's `tensor` suite on
# StreamFusion<CubeBackend<CudaRuntime>>, in four parts at once (16 test threads each), each in
# a fresh directory (so from a cold autotune cache). The binary is built and packed here:
#
#   bash scripts/burn-suite.sh BURN_CHECKOUT DIR cuda --list   # builds; listing fails without a GPU
#   strip -o /tmp/suite target/burn-suite/release/deps/tensor-<hash>
#   mkdir -p gpu-run/suite && xz -c /tmp/suite > gpu-run/suite/suite.xz
#
# Then, on the GPU machine (carry gpu-run): `bash scripts/gpu-suite.sh [DIR]`. One log per part
# in DIR (default gpu-logs/), and the summary line of each.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-gpu-logs}")
mkdir -p "$out"
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/usr/local/cuda/lib64}
suite=$(mktemp -d)/suite
xz -dc gpu-run/suite/suite.xz > "$suite" && chmod +x "$suite"
part() {
    local name=$1
    shift
    local dir
    dir=$(mktemp -d)
    (
        cd "$dir" || exit 1
        {
            echo "# suite --test-threads=16 $*"
            echo "# $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader), cwd: a fresh directory"
            timeout "${SUITE_TIMEOUT:-480}" "$suite" --test-threads=16 "$@"
        } > "$out/burn-suite-$name.log" 2>&1
    )
}
part float-ops tensor::float::ops &
part float-linalg tensor::float::linalg &
part float-rest tensor::float --skip tensor::float::ops --skip tensor::float::linalg &
part rest --skip tensor::float &
wait
for f in "$out"/burn-suite-*.log; do
    printf '%-28s %s\n' "$(basename "$f" .log)" "$(grep -E '^test result|^error|panicked' "$f" | tail -n 1)"
done
