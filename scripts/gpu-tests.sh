#!/usr/bin/env bash
# Build the GPU test binaries (tests/device.rs and the rest) and the CUDA examples for a GPU machine, stripped,
# into gpu-bin/ (git-ignored). No GPU or CUDA toolkit is needed to build.
#
# On the GPU machine, from the repository root:
#   export CUDA_PATH=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64
#   ./gpu-bin/device --ignored --test-threads=1                     # device-only engine tests
#   compute-sanitizer --tool memcheck ./gpu-bin/device --ignored --test-threads=1
#   compute-sanitizer --tool synccheck ./gpu-bin/device --ignored --test-threads=1
#   ./gpu-bin/quickstart                                              # the quickstart on CUDA
#   ./gpu-bin/publish_download                                        # publication on CUDA
#   ./gpu-bin/engine --bench                                          # the engine benchmark (CPU)
#   ./gpu-bin/transfer --bench                                        # the transfer benchmark
#   ./gpu-bin/backend --ignored --test-threads=1                      # StreamFusion<CubeBackend>
#   ./gpu-bin/backend_threads --ignored                               #   op families, threads
#   ./gpu-bin/cross_stream --ignored --test-threads=1 --nocapture     # tensors crossing streams
#   ./gpu-bin/suite_backend --ignored --test-threads=1                # the suite on CubeBackend
#   ./gpu-bin/publish --ignored --test-threads=1                      # publication on StreamFusion
#   ./gpu-bin/burn_multi_thread                                       # the burn example on CUDA
#   ./gpu-bin/bench-backend --bench                                   # vs CubeBackend, burn-fusion
#   ./gpu-bin/bench-backend-ndarray --bench                           # the same on NdArray (the
#                                                                   # host's cores)
# (scripts/gpu-evidence.sh runs these in sets and writes a log per step.)
#
# With `--pack`, the stripped binaries are also packed into gpu-run/bin.tar.xz, which fits the
# device tool's 64 MiB carry where gpu-bin/ (~560 MB) does not: carry `gpu-run`, and
# scripts/gpu-evidence.sh unpacks it into gpu-bin/ on the GPU machine before its first step. The
# binaries share most of their code, so one xz stream whose dictionary spans several of them
# packs them into ~35 MB (~4 minutes); xz's default dictionary sees one at a time (~70 MB).
set -euo pipefail
pack=false
[ "${1:-}" = "--pack" ] && pack=true
cd "$(dirname "$0")/.."
# cudarc picks its driver bindings at build time; without a toolkit here, pin CUDA 13.0 (the
# H200 machine's driver) instead of the newest.
export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13000}"
mkdir -p gpu-bin

log=$(mktemp)
cargo test --release --features cuda --test device --test backend --test backend_threads \
    --test cross_stream --test suite_backend --test publish --no-run \
    2>&1 | tee "$log"
test_bin=$(grep -o 'target/release/deps/device-[0-9a-f]*' "$log" | tail -n 1)
backend_bin=$(grep -o 'target/release/deps/backend-[0-9a-f]*' "$log" | tail -n 1)
threads_bin=$(grep -o 'target/release/deps/backend_threads-[0-9a-f]*' "$log" | tail -n 1)
cross_bin=$(grep -o 'target/release/deps/cross_stream-[0-9a-f]*' "$log" | tail -n 1)
suite_backend_bin=$(grep -o 'target/release/deps/suite_backend-[0-9a-f]*' "$log" | tail -n 1)
publish_bin=$(grep -o 'target/release/deps/publish-[0-9a-f]*' "$log" | tail -n 1)
cargo build --release --features cuda --example quickstart --example publish_download \
    --example burn_multi_thread
cargo bench --features cuda --bench backend --no-run 2>&1 | tee "$log"
bench_backend_bin=$(grep -o 'target/release/deps/backend-[0-9a-f]*' "$log" | tail -n 1)
cargo bench --features cuda --bench engine --no-run 2>&1 | tee "$log"
bench_bin=$(grep -o 'target/release/deps/engine-[0-9a-f]*' "$log" | tail -n 1)
cargo bench --features cuda --bench transfer --no-run 2>&1 | tee "$log"
transfer_bin=$(grep -o 'target/release/deps/transfer-[0-9a-f]*' "$log" | tail -n 1)
# The backend bench without `cuda`: NdArray's rows, for the GPU machine's 16 cores.
cargo bench --bench backend --no-run 2>&1 | tee "$log"
bench_ndarray_bin=$(grep -o 'target/release/deps/backend-[0-9a-f]*' "$log" | tail -n 1)

cp "$test_bin" gpu-bin/device
cp target/release/examples/quickstart gpu-bin/quickstart
cp target/release/examples/publish_download gpu-bin/publish_download
cp "$bench_bin" gpu-bin/engine
cp "$transfer_bin" gpu-bin/transfer
cp "$backend_bin" gpu-bin/backend
cp "$threads_bin" gpu-bin/backend_threads
cp "$cross_bin" gpu-bin/cross_stream
cp "$suite_backend_bin" gpu-bin/suite_backend
cp "$publish_bin" gpu-bin/publish
cp target/release/examples/burn_multi_thread gpu-bin/burn_multi_thread
cp "$bench_backend_bin" gpu-bin/bench-backend
cp "$bench_ndarray_bin" gpu-bin/bench-backend-ndarray
# With GPU_TESTS_SYMBOLS=1, the CUDA backend bench also keeps its symbol table, beside the
# others and packed on its own (gpu-run/bench-syms.xz, ~10 MB): scripts/gpu-evidence.sh's
# `host-profile` and `pipeline-host` steps run it under callgrind.
if [ -n "${GPU_TESTS_SYMBOLS:-}" ]; then
    strip --strip-debug -o gpu-bin/bench-backend-syms "$bench_backend_bin"
fi
find gpu-bin -type f ! -name '*-syms' -exec strip {} +
ls -la gpu-bin
if $pack; then
    mkdir -p gpu-run
    tar -C gpu-bin --exclude='*-syms' -cf - . | xz -T1 --lzma2=preset=6,dict=256MiB > gpu-run/bin.tar.xz
    ls -la gpu-run/bin.tar.xz
    if [ -f gpu-bin/bench-backend-syms ]; then
        xz -T1 -c gpu-bin/bench-backend-syms > gpu-run/bench-syms.xz
        ls -la gpu-run/bench-syms.xz
    fi
fi
echo "staged in gpu-bin/ (carry it to the GPU machine; see the comment at the top of this script)"
