#!/usr/bin/env bash
# Builds the libFuzzer targets with clang and runs each for N seconds (default 60).
#   scripts/fuzz.sh [seconds]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
secs="${1:-60}"
TERRACE_EXTRA_APT="clang ${TERRACE_EXTRA_APT:-}" TERRACE_SKIP_PYTHON=1 "$root/scripts/deps.sh"
build="$root/build-fuzz"
CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DTERRACE_BUILD_FUZZ=ON -DTERRACE_CUDA=OFF \
  -DTERRACE_BUILD_TESTS=OFF -DTERRACE_BUILD_BENCH=OFF -DTERRACE_BUILD_CLI=OFF >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" --target fuzzers -j "$(nproc)" >"$build.build.log" 2>&1 ||
  { tail -n 40 "$build.build.log"; echo "scripts/fuzz.sh: building the fuzzers failed (log: $build.build.log)" >&2; exit 1; }
for fuzzer in "$build"/tests/fuzz/*_fuzz; do
  name="$(basename "$fuzzer")"
  corpus="$root/tests/fuzz/corpus/${name%_fuzz}"   # a corpus per fuzzer, or the shared one
  [ -d "$corpus" ] || corpus="$root/tests/fuzz/corpus"
  work="$build/fuzz-work/$name"
  mkdir -p "$work"
  echo "fuzz: $name for ${secs}s (seed corpus $corpus)"
  "$fuzzer" -max_total_time="$secs" -max_len=65536 -print_final_stats=1 "$work" "$corpus" 2>&1 | tail -n 12
done
