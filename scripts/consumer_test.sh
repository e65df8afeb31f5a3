#!/usr/bin/env bash
# The package as an embedder sees it. Installs Terrace into a temporary prefix, then:
#   1. checks the installed tree (public headers only, the CMake package files, the CLI if built);
#   2. builds tests/consumer with find_package(terrace) and runs it (put, get, prefetch, reopen),
#      and its shared-library plugin, loaded with Python's ctypes;
#   3. checks that an internal header ("src/store/store_impl.h") does NOT compile from the consumer,
#      both against the installed package and through add_subdirectory (store-only, no tests there).
# Usage:
#   scripts/consumer_test.sh BUILD_DIR      install from an already built build folder (ctest does this)
#   scripts/consumer_test.sh                configure and build a store-only Release build in
#                                           ./build-package first (what an embedder without OpenBLAS,
#                                           CLI11 or nlohmann_json gets), then as above
# Extra cmake arguments for that build come from $TERRACE_PACKAGE_CMAKE_ARGS. Exit 0 when all passed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-}"
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
gen=()
if command -v ninja >/dev/null; then gen=(-G Ninja); fi

tmp="$(mktemp -d "${TMPDIR:-/tmp}/terrace-consumer.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "consumer_test: FAILED: $*" >&2; exit 1; }
# Runs a command with its output in a log; shows the log when it fails.
quiet() {
  local log="$tmp/step.log"
  if ! "$@" >"$log" 2>&1; then cat "$log" >&2; fail "$*"; fi
}

if [ -z "$build" ]; then
  build="$root/build-package"
  echo "consumer_test: store-only Release build in $build"
  # shellcheck disable=SC2086
  cmake -S "$root" -B "$build" "${gen[@]}" "${launcher[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DTERRACE_BUILD_MODEL=OFF -DTERRACE_BUILD_CLI=OFF -DTERRACE_BUILD_TESTS=OFF -DTERRACE_BUILD_BENCH=OFF \
    -DTERRACE_CUDA=OFF ${TERRACE_PACKAGE_CMAKE_ARGS:-} >"$tmp/configure.log" 2>&1 \
    || { cat "$tmp/configure.log" >&2; fail "configure $build"; }
  cmake --build "$build" -j "$(nproc)"
fi
[ -f "$build/CMakeCache.txt" ] || fail "$build is not a configured build folder"

prefix="$tmp/prefix"
echo "consumer_test: cmake --install $build --prefix $prefix"
quiet cmake --install "$build" --prefix "$prefix"

# 1. The installed tree.
[ -f "$prefix/include/terrace/store.h" ] || fail "include/terrace/store.h was not installed"
[ -f "$prefix/lib/cmake/terrace/terraceConfig.cmake" ] || fail "terraceConfig.cmake was not installed"
[ -f "$prefix/lib/cmake/terrace/terraceConfigVersion.cmake" ] || fail "terraceConfigVersion.cmake was not installed"
stray="$(cd "$prefix/include" && find . -type f ! -path './terrace/*')"
[ -z "$stray" ] || fail "headers outside include/terrace were installed: $stray"
if grep -q '^TERRACE_BUILD_CLI:BOOL=ON' "$build/CMakeCache.txt"; then
  [ -x "$prefix/bin/terrace" ] || fail "the terrace CLI was not installed"
  "$prefix/bin/terrace" --help >/dev/null || fail "the installed terrace CLI does not run"
fi
with_model=OFF
if grep -q '^TERRACE_BUILD_MODEL:BOOL=ON' "$build/CMakeCache.txt"; then with_model=ON; fi

# 2. The consumer, through find_package.
echo "consumer_test: building tests/consumer against the installed package (model component: $with_model)"
quiet cmake -S "$root/tests/consumer" -B "$tmp/consumer" "${gen[@]}" "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$prefix" -DCONSUMER_INTERNAL_PROBE=ON -DCONSUMER_MODEL="$with_model"
cmake --build "$tmp/consumer" --target consumer consumer_plugin
"$tmp/consumer/consumer" "$tmp/nvme" || fail "the consumer program failed"
# Terrace inside a shared library, loaded at run time as an engine loads its plugin.
python3 - "$tmp/consumer/libconsumer_plugin.so" "$tmp/plugin-nvme" <<'PY' || fail "the shared-library plugin failed"
import ctypes, sys
sys.exit(ctypes.CDLL(sys.argv[1]).terrace_plugin_round_trip(sys.argv[2].encode()))
PY

# 3. Internal headers stay internal.
probe() {  # $1: build folder with the internal_probe target
  if cmake --build "$1" --target internal_probe >"$tmp/probe.log" 2>&1; then
    fail "internal_probe compiled: src/store/store_impl.h is reachable from a consumer ($1)"
  fi
  grep -Eq "store_impl\.h.*(No such file|file not found)" "$tmp/probe.log" \
    || { cat "$tmp/probe.log" >&2; fail "internal_probe failed for another reason than the missing header"; }
}
probe "$tmp/consumer"
echo "consumer_test: add_subdirectory(terrace) as a store-only subproject"
quiet cmake -S "$root/tests/consumer" -B "$tmp/subdir" "${gen[@]}" "${launcher[@]}" \
  -DCONSUMER_TERRACE_SOURCE="$root" -DCONSUMER_INTERNAL_PROBE=ON -DTERRACE_BUILD_MODEL=OFF -DTERRACE_CUDA=OFF
if grep -Eq '^TERRACE_BUILD_(TESTS|BENCH|CLI):BOOL=ON' "$tmp/subdir/CMakeCache.txt"; then
  fail "tests, benchmarks or the CLI default to ON in a subproject"
fi
probe "$tmp/subdir"
echo "consumer_test: ok"
