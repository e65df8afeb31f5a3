#!/usr/bin/env bash
# Configures and builds Terrace. Usage: scripts/build.sh [build-dir] [extra cmake args...]
# Uses Ninja and ccache when present; the CUDA HBM tier is built when nvcc is found (TERRACE_CUDA=AUTO).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
shift || true
args=(-S "$root" -B "$build" -G Ninja -DPython3_EXECUTABLE="$root/.venv/bin/python")
if command -v ccache >/dev/null; then
  args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
cmake "${args[@]}" "$@" >"$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
grep -E '^-- Terrace:' "$build.configure.log" || true
cmake --build "$build" -j "$(nproc)"
