#!/usr/bin/env bash
# One command for the whole test suite: installs what is missing, builds (RelWithDebInfo, CUDA code
# compiled when nvcc is found) and runs every test with ctest.
#   scripts/test.sh                 # the normal build in ./build
#   scripts/test.sh address         # AddressSanitizer + UBSan build in ./build-asan
#   scripts/test.sh thread          # ThreadSanitizer build in ./build-tsan
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mode="${1:-none}"
"$root/scripts/deps.sh"
export PATH="$root/.venv/bin:$PATH"
# Everything the suite covers, stated explicitly: a folder configured otherwise before (by hand, or by
# an old scripts/demo.sh that turned the tests off) is switched back instead of running stale tests.
components=(-DTERRACE_BUILD_TESTS=ON -DTERRACE_BUILD_MODEL=ON -DTERRACE_BUILD_CLI=ON)
# shellcheck source=scripts/main_build_flags.sh
source "$root/scripts/main_build_flags.sh"  # unity, main_build
case "$mode" in
  none)
    build="$root/build"
    "$root/scripts/build.sh" "$build" "${components[@]}" "${main_build[@]}"
    ctest --test-dir "$build" --output-on-failure -j 2
    ;;
  address|thread)
    build="$root/build-${mode/address/asan}"
    build="${build/thread/tsan}"
    # The CLI's own tests are Python (run in the normal build only, see below); its helpers have a C++
    # test built without the CLI. So the sanitizer builds leave the CLI out: it is their longest compile.
    sanitized=(-DTERRACE_BUILD_TESTS=ON -DTERRACE_BUILD_MODEL=ON -DTERRACE_BUILD_CLI=OFF)
    # -O1 -g1: what the sanitizers recommend; line tables keep file:line in reports. Compiles a third
    # faster than -O2 (measured on the test targets), which keeps CI inside its time budget.
    "$root/scripts/build.sh" "$build" "${sanitized[@]}" "${unity[@]}" -DTERRACE_SANITIZE="$mode" -DTERRACE_CUDA=OFF -DTERRACE_BUILD_BENCH=OFF \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
    export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
    export OPENBLAS_NUM_THREADS=1  # OpenBLAS's own threads are not instrumented
    # Python oracle tests drive the same binaries through the CLI; they run in the normal build only.
    ctest --test-dir "$build" --output-on-failure -j 2 -E 'pytest|^python'
    ;;
  *) echo "usage: scripts/test.sh [none|address|thread]" >&2; exit 2 ;;
esac
