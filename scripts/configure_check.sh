#!/usr/bin/env bash
# Configure-only check (a few seconds, no compile): the project configures with the model component
# off (-DTERRACE_BUILD_MODEL=OFF -DTERRACE_BUILD_CLI=OFF) while tests and benchmarks are on, and no
# target then links a Terrace library that was not built (a missing target named without "::"
# reaches the link line as -lterrace_..., and fails only when that target is compiled).
#   scripts/configure_check.sh [build-dir]     (default ./build-nomodel)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build-nomodel}"
rm -rf "$build"
if ! cmake -S "$root" -B "$build" -G Ninja -DTERRACE_BUILD_MODEL=OFF -DTERRACE_BUILD_CLI=OFF \
       -DTERRACE_BUILD_TESTS=ON -DTERRACE_BUILD_BENCH=ON >"$build.configure.log" 2>&1; then
  cat "$build.configure.log"
  echo "configure_check: the project does not configure with -DTERRACE_BUILD_MODEL=OFF (above)" >&2
  exit 1
fi
if missing=$(grep -o -- '-lterrace_[A-Za-z0-9_]*' "$build/build.ninja" | sort -u) && [[ -n $missing ]]; then
  echo "configure_check: with -DTERRACE_BUILD_MODEL=OFF, targets link libraries that are not built: $missing" >&2
  grep -n -- '-lterrace_' "$build/build.ninja" | cut -c1-160 | head -5 >&2
  exit 1
fi
echo "configure_check: configures with the model component off; every linked Terrace library is built"
