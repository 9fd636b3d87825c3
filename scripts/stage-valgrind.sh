#!/usr/bin/env bash
# Copy valgrind's launcher, its callgrind tool (statically linked) and the core preload into DIR
# (default gpu-run/valgrind, git-ignored), to carry to the GPU machine, which has no valgrind:
# `scripts/gpu-evidence.sh host-profile` runs it there with VALGRIND_LIB pointing at DIR.
#
#   scripts/stage-valgrind.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-gpu-run/valgrind}
launcher=$(command -v valgrind) || { echo "stage-valgrind: no valgrind here" >&2; exit 1; }
# Debian's `valgrind` is a shell wrapper around `valgrind.bin`.
[ -x "$launcher.bin" ] && launcher=$launcher.bin
lib=
for candidate in /usr/libexec/valgrind /usr/lib/x86_64-linux-gnu/valgrind /usr/lib/valgrind; do
    [ -x "$candidate/callgrind-amd64-linux" ] && lib=$candidate && break
done
[ -n "$lib" ] || { echo "stage-valgrind: callgrind-amd64-linux not found" >&2; exit 1; }
mkdir -p "$dir"
cp "$launcher" "$dir/valgrind"
cp "$lib/callgrind-amd64-linux" "$lib/vgpreload_core-amd64-linux.so" "$lib/default.supp" "$dir/"
echo "staged $(valgrind --version) from $lib in $dir ($(du -sh "$dir" | cut -f1))"
