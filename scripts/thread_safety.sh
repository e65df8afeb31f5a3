#!/usr/bin/env bash
# Builds the store, the tier libraries, the prefix cache and the expert cache with clang's
# thread-safety analysis as errors (-Wthread-safety -Werror), into ./build-tsa (or $1). Fails when
# a TERRACE_GUARDED_BY member is touched without its lock, a TERRACE_REQUIRES function is called
# without it, or a lock is released twice / leaked (src/common/thread_annotations.h). No CUDA,
# CLI, bench or tests: only the libraries the annotations are in (and the model, which the prefix
# and expert caches build on). Needs clang (CC/CXX override).
#   scripts/thread_safety.sh [build-dir]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build-tsa}"
# clang-14 where installed under that name, else the default clang (Debian's `clang` package).
if [ -z "${CXX:-}" ] && ! command -v clang++-14 >/dev/null && command -v clang++ >/dev/null; then
  export CC=clang CXX=clang++
fi
export CC="${CC:-clang-14}" CXX="${CXX:-clang++-14}"
command -v "$CXX" >/dev/null || { echo "scripts/thread_safety.sh: $CXX not found; install clang-14 or set CXX" >&2; exit 1; }
# TERRACE_CMAKE_ARGS is emptied so that a CI setting meant for the GCC build does not leak in.
TERRACE_CMAKE_ARGS="" "$root/scripts/build.sh" "$build" \
  -DCMAKE_BUILD_TYPE=Debug -DTERRACE_WERROR=ON -DTERRACE_CUDA=OFF -DTERRACE_BUILD_MODEL=ON \
  -DTERRACE_BUILD_CLI=OFF -DTERRACE_BUILD_BENCH=OFF -DTERRACE_BUILD_TESTS=OFF -DTERRACE_BUILD_FUZZ=OFF \
  "-DCMAKE_CXX_FLAGS=-Wthread-safety -ferror-limit=0" \
  --target terrace_store_core --target terrace_store \
  --target terrace_tier_nvme --target terrace_tier_host --target terrace_tier_hbm --target terrace_tier_fault \
  --target terrace_kv --target terrace_experts
echo "scripts/thread_safety.sh: thread-safety analysis clean ($build)"
