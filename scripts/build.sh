#!/usr/bin/env bash
# Configures and builds Terrace.
#   scripts/build.sh [build-dir] [cmake args...] [--target T ...]
# build-dir defaults to ./build. `--target T` (repeatable) builds only T (e.g. terrace_cli); the
# rest of the arguments go to the configure step, as do the words of $TERRACE_CMAKE_ARGS (.ci/run
# sets -DTERRACE_WERROR=ON there). Uses Ninja, and ccache when present; the CUDA HBM tier is built
# when nvcc is found (TERRACE_CUDA=AUTO). The configure output goes to <build-dir>.configure.log and
# is shown when configuring fails; the build shows its progress and errors.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
shift || true
args=(-S "$root" -B "$build" -G Ninja -DPython3_EXECUTABLE="$root/.venv/bin/python")
if command -v ccache >/dev/null; then
  # Paths inside the checkout are hashed relative to it, so clones at other paths (CI's clean
  # clone) reuse the cache; the build directory's own path is not hashed either.
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$root}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
  args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
targets=()
while (($#)); do
  if [ "$1" = --target ]; then
    [ $# -ge 2 ] || { echo "scripts/build.sh: --target needs a target name" >&2; exit 2; }
    targets+=(--target "$2")
    shift 2
  else
    args+=("$1")
    shift
  fi
done
# shellcheck disable=SC2206
args+=(${TERRACE_CMAKE_ARGS:-})
cmake "${args[@]}" >"$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
grep -E '^-- Terrace:' "$build.configure.log" || true
cmake --build "$build" -j "$(nproc)" "${targets[@]}"
