#!/usr/bin/env bash
# GPU check for Terrace's HBM tier and CUDA codec kernels: on a machine with an NVIDIA GPU (H100 or
# H200), run the GPU tests and benchmarks and print a short table. bench/gpu/README.md has the
# device tool's exact invocation.
#
# Usage: bench/gpu/check.sh
# Binaries, in this order:
#   prebuilt  the bundle bench/gpu/prepare.sh made on a machine with the project's packages
#             ($TERRACE_GPU_BUNDLE, default <repo>/build-gpu/bundle): run as they are, with
#             LD_LIBRARY_PATH=<bundle>/lib; nothing is built or installed here.
#   full      configure -DTERRACE_CUDA=ON and build the targets of bench/gpu/targets.sh
#             ($TERRACE_GPU_BUILD_DIR, default <repo>/build-gpu); missing apt packages are installed
#             first when root, apt-get exists and the network answers.
#   standalone  bench/gpu/standalone: only the host and HBM tiers (two of the tests; RESULT: FAIL).
#   nvcc      nvcc alone builds the bandwidth benchmark (no tests; RESULT: FAIL).
# TERRACE_GPU_CHECK_SKIP_FULL=1 goes from prebuilt straight to standalone.
# Time: everything, builds included, ends within $TERRACE_GPU_CHECK_DEADLINE seconds (default 540,
# under the device tool's 600 s per call); each step gets at most its own cap and what is left.
# Output: the whole log, each test's and benchmark's output, results.txt (one line per test as it
# finishes) and summary.txt (the table) go to $OUT when set (the device tool returns that folder,
# also from a run it killed), else to <build>/check-logs; 6 files at most.
# Exit status 0 (RESULT: PASS) only when every test of bench/gpu/targets.sh ran and passed (a test
# that skips for want of a device counts as failed: this check is for machines that have one) and
# every benchmark exited 0.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${TERRACE_GPU_BUILD_DIR:-$ROOT/build-gpu}"
BUNDLE="${TERRACE_GPU_BUNDLE:-$BUILD/bundle}"
DEADLINE="${TERRACE_GPU_CHECK_DEADLINE:-540}"
JOBS="$(nproc 2>/dev/null || echo 8)"
START=$(date +%s)
LOGDIR="${OUT:-$BUILD/check-logs}"
WORK="$BUILD/check-work"  # per-step logs the summary parses (copied into LOGDIR as they are written)
rm -rf "$WORK"
mkdir -p "$LOGDIR" "$WORK/tmp"
: >"$LOGDIR/results.txt"
exec > >(tee -a "$LOGDIR/check.log") 2>&1
TEE_PID=$!
trap 'exec >&- 2>&-; wait "$TEE_PID" 2>/dev/null || true' EXIT  # check.log complete before the exit
# shellcheck source=bench/gpu/targets.sh
source "$ROOT/bench/gpu/targets.sh"

say() { printf '[check.sh %4ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }
die() { say "ERROR: $*"; echo "RESULT: FAIL"; exit 1; }
# budget CAP: seconds the next step may take: CAP, or what is left before the deadline less 20 s
# kept for the summary, whichever is smaller; 0 when nothing is left.
budget() {
  local left=$(( START + DEADLINE - 20 - $(date +%s) ))
  (( left < 0 )) && left=0
  echo $(( $1 < left ? $1 : left ))
}
# logged FILE CAP CMD...: runs CMD under the budget, its output into $WORK/FILE and appended to
# $LOGDIR/FILE's group log (build.log, tests.log or bench.log) as it is produced; returns CMD's
# status (124: out of time, or not started because no time was left).
logged() {
  local file=$1 group=$2 t; t=$(budget "$3"); shift 3
  if (( t < 5 )); then echo "out of time: not run ($*)" >"$WORK/$file"; cat "$WORK/$file" >>"$LOGDIR/$group"; return 124; fi
  echo "===== $file: $* (limit ${t}s)" >>"$LOGDIR/$group"
  local rc=0
  timeout -k 5 "$t" "$@" 2>&1 | tee "$WORK/$file" >>"$LOGDIR/$group" || rc=${PIPESTATUS[0]}
  return "$rc"
}

# ---- 1. GPU and toolkit ------------------------------------------------------------------------
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this script needs a machine with an NVIDIA driver"
GPU="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)" \
  || die "nvidia-smi cannot talk to the driver ($GPU); check the GPU with 'nvidia-smi'"
say "GPU: $GPU"
say "host: $(uname -srm); $(ldd --version 2>&1 | head -1)"
export PATH="/usr/local/cuda/bin:$PATH"

# ---- 2. Binaries -------------------------------------------------------------------------------
MODE=none
if [[ -d $BUNDLE/bin ]]; then
  MODE=prebuilt; BIN="$BUNDLE/bin"
  export LD_LIBRARY_PATH="$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "prebuilt bundle $BUNDLE:"; sed 's/^/    /' "$BUNDLE/MANIFEST" 2>/dev/null || say "(no MANIFEST)"
  # This machine's C++ runtime where it runs the binaries (it is the newer one on a newer system);
  # the bundle's own (lib-cxx) where it does not.
  # (ldd names a missing library or symbol version "not found").
  if [[ -d $BUNDLE/lib-cxx ]] && ldd "$BIN"/* 2>&1 | grep -q 'not found'; then
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$BUNDLE/lib-cxx"
    say "using the bundle's C++ runtime (lib-cxx): this machine's does not run the binaries"
  fi
fi
if [[ $MODE == none ]]; then
  command -v nvcc >/dev/null || die "no prebuilt bundle ($BUNDLE) and no nvcc: run bench/gpu/prepare.sh where the packages are and carry the bundle, or install the CUDA toolkit"
  say "no prebuilt bundle ($BUNDLE); building here. nvcc: $(nvcc --version | tail -1)"
  PKGS=(cmake ninja-build g++ pkg-config libfmt-dev libxxhash-dev catch2 liburing-dev librocksdb-dev
        libboost-dev libabsl-dev libcli11-dev libzstd-dev liblz4-dev)
  MISSING=()
  for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || MISSING+=("$p"); done
  if (( ${#MISSING[@]} )); then
    say "missing packages: ${MISSING[*]}"
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
      say "not root or no apt-get: continuing with what exists"
    elif ! timeout 5 getent hosts deb.debian.org >/dev/null 2>&1 && ! timeout 5 getent hosts archive.ubuntu.com >/dev/null 2>&1; then
      say "no network (no DNS answer): not trying apt-get"
    else
      export DEBIAN_FRONTEND=noninteractive
      if logged apt.log build.log 60 apt-get update -qq && logged apt-install.log build.log 120 apt-get install -y -qq --no-install-recommends "${MISSING[@]}"; then
        say "installed: ${MISSING[*]}"
      else
        say "apt-get could not install them; continuing with what exists (build.log)"
      fi
    fi
  fi
  GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
  if command -v cmake >/dev/null && [[ -z ${TERRACE_GPU_CHECK_SKIP_FULL:-} ]]; then
    say "configuring the full project (TERRACE_CUDA=ON) in $BUILD/full"
    if logged configure-full.log build.log 90 cmake -S "$ROOT" -B "$BUILD/full" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
         -DTERRACE_CUDA=ON -DTERRACE_BUILD_BENCH=ON -DTERRACE_BUILD_CLI=OFF -DTERRACE_BUILD_MODEL=OFF -DTERRACE_WERROR=OFF; then
      say "building ${GPU_TEST_BINARIES[*]} ${GPU_BENCHES[*]}"
      if logged build-full.log build.log 240 cmake --build "$BUILD/full" -j "$JOBS" --target "${GPU_TEST_BINARIES[@]}" "${GPU_BENCHES[@]}"; then
        MODE=full; BIN="$BUILD/full"
      else
        say "full build failed (tail of build-full.log):"; tail -15 "$WORK/build-full.log" || true
      fi
    else
      say "full configure failed (tail of configure-full.log):"; tail -8 "$WORK/configure-full.log" || true
    fi
  fi
  if [[ $MODE == none ]] && command -v cmake >/dev/null; then
    say "trying the standalone build (host + HBM tiers only) in $BUILD/standalone"
    if logged configure-standalone.log build.log 60 cmake -S "$ROOT/bench/gpu/standalone" -B "$BUILD/standalone" "${GEN[@]}" \
         -DCMAKE_BUILD_TYPE=Release &&
       logged build-standalone.log build.log 180 cmake --build "$BUILD/standalone" -j "$JOBS"; then
      MODE=standalone; BIN="$BUILD/standalone"
    else
      say "standalone build failed (build.log)"; tail -8 "$WORK/build-standalone.log" 2>/dev/null || true
    fi
  fi
  if [[ $MODE == none ]]; then
    say "last resort: nvcc-only build of the bandwidth benchmark"
    mkdir -p "$BUILD/nvcc"
    logged build-nvcc.log build.log 120 nvcc -O2 -std=c++17 -o "$BUILD/nvcc/bench_hbm_bandwidth" "$ROOT/bench/gpu/hbm_bandwidth.cpp" \
      || die "even the nvcc-only build failed (build.log)"
    MODE=nvcc; BIN="$BUILD/nvcc"
  fi
fi
say "binaries: $MODE ($BIN)"

find_exe() { find "$BIN" -name "$1" -type f -perm -u+x 2>/dev/null | head -1; }

# ---- 3. Tests: every entry of GPU_TESTS, whatever the mode ----------------------------------------
declare -A RESULT
FAILED=0
for t in "${GPU_TESTS[@]}"; do
  mapfile -t cmd < <(gpu_test_command "$t")
  exe="$(find_exe "${cmd[0]}")"
  if [[ -z $exe ]]; then
    RESULT[$t]="not built"
  else
    say "running $t"
    rc=0
    TERRACE_TEST_TMPDIR="$WORK/tmp" TERRACE_SOURCE_DIR="$ROOT" logged "$t.log" tests.log 150 "$exe" "${cmd[@]:1}" || rc=$?
    if (( rc == 124 || rc == 137 )); then RESULT[$t]="Timeout"
    elif (( rc != 0 )); then RESULT[$t]="Failed (exit $rc)"
    elif grep -q "SKIPPED: no CUDA device" "$WORK/$t.log"; then RESULT[$t]="Skipped (no CUDA device)"
    else RESULT[$t]="Passed"; fi
  fi
  [[ ${RESULT[$t]} == Passed ]] || FAILED=1
  printf '%-44s %s\n' "$t" "${RESULT[$t]}" | tee -a "$LOGDIR/results.txt"
done

# ---- 4. Benchmarks -----------------------------------------------------------------------------
run_bench() {  # name, cap in seconds
  local exe rc; exe="$(find_exe "$1")"
  if [[ -z $exe ]]; then say "$1 not built"; FAILED=1; return 0; fi
  say "running $1"
  rc=0; logged "$1.log" bench.log "$2" "$exe" || rc=$?
  grep -v '^RESULT' "$WORK/$1.log" || true
  (( rc == 0 )) || { say "$1 exited with status $rc$( (( rc == 124 )) && echo ' (out of time)')"; FAILED=1; }
  echo "$1 exit $rc" >>"$LOGDIR/results.txt"
}
run_bench bench_hbm_bandwidth 150
run_bench bench_hbm_tier 120
run_bench bench_host_tier 60
run_bench bench_codec_cuda 60   # KV codec kernels (src/codec/cuda)

# ---- 5. Summary --------------------------------------------------------------------------------
pick() {  # file, awk filter -> max GB/s
  [[ -f $WORK/$1 ]] || { echo "n/a"; return; }
  awk "$2"' { if ($NF > m) m = $NF } END { if (m) printf "%.1f", m; else print "n/a" }' "$WORK/$1"
}
{
  echo
  echo "================ Terrace GPU check (${GPU%%,*}) ================"
  printf '%-44s %s\n' "binaries" "$MODE"
  for t in "${GPU_TESTS[@]}"; do printf '%-44s %s\n' "$t" "${RESULT[$t]}"; done
  printf '%-44s %s GB/s\n' "H2D pinned (peak over 64 KiB..256 MiB)"   "$(pick bench_hbm_bandwidth.log '$1=="RESULT" && $2=="pinned" && $3=="h2d"')"
  printf '%-44s %s GB/s\n' "D2H pinned (peak)"                         "$(pick bench_hbm_bandwidth.log '$1=="RESULT" && $2=="pinned" && $3=="d2h"')"
  printf '%-44s %s GB/s\n' "H2D pageable (peak)"                       "$(pick bench_hbm_bandwidth.log '$1=="RESULT" && $2=="pageable" && $3=="h2d"')"
  printf '%-44s %s GB/s\n' "D2H pageable (peak)"                       "$(pick bench_hbm_bandwidth.log '$1=="RESULT" && $2=="pageable" && $3=="d2h"')"
  printf '%-44s %s GB/s\n' "HBM tier put, pinned source (best)"        "$(pick bench_hbm_tier.log '$1=="RESULT" && $3=="put" && $4=="pinned"')"
  printf '%-44s %s GB/s\n' "HBM tier get, pinned dest (best)"          "$(pick bench_hbm_tier.log '$1=="RESULT" && $3=="get" && $4=="pinned"')"
  printf '%-44s %s GB/s\n' "HBM tier put, pageable source (best)"      "$(pick bench_hbm_tier.log '$1=="RESULT" && $3=="put" && $4=="pageable"')"
  printf '%-44s %s GB/s\n' "HBM tier get, pageable dest (best)"        "$(pick bench_hbm_tier.log '$1=="RESULT" && $3=="get" && $4=="pageable"')"
  # KV codecs on the GPU (bench_codec_cuda: device-resident fp32 in and out, GB/s of fp32 values).
  printf '%-44s %s GB/s\n' "codec: device memcpy of the same fp32 bytes"  "$(pick bench_codec_cuda.log '$1=="RESULT" && $3=="memcpy"')"
  for c in f32 bf16 f16 fp8 fp8-block int8 int4-g32 int4-g64; do
    printf '%-44s %s GB/s\n' "codec $c encode / decode on the GPU" \
      "$(pick bench_codec_cuda.log '$1=="RESULT" && $3=="'"$c"'" && $4=="encode"') / $(pick bench_codec_cuda.log '$1=="RESULT" && $3=="'"$c"'" && $4=="decode"')"
  done
  echo "logs: $LOGDIR   total time: $(( $(date +%s) - START )) s"
  if (( FAILED )); then echo "RESULT: FAIL"; else echo "RESULT: PASS"; fi
} | tee "$LOGDIR/summary.txt"
exit "$FAILED"
