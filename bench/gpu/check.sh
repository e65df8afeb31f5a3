#!/usr/bin/env bash
# GPU check for Terrace's HBM tier: on a machine with an NVIDIA GPU (e.g. an H200), configure with
# -DTERRACE_CUDA=ON, build the GPU tests and benchmarks, run them, and print a short table.
#
# Usage: bench/gpu/check.sh            (from anywhere; builds in $TERRACE_GPU_BUILD_DIR or <repo>/build-gpu)
#        TERRACE_GPU_CHECK_SKIP_FULL=1 bench/gpu/check.sh   (go straight to the standalone build)
# Steps: 1 nvidia-smi / nvcc checks; 2 install missing apt packages if root and apt works (bounded
# time; never fatal); 3 full-project configure + build of the GPU targets, else a standalone build of
# just the host/HBM tiers (bench/gpu/standalone), else nvcc alone for the bandwidth benchmark;
# 4 run tests and benchmarks; 5 summary. Exit status: 0 when every GPU test built and passed.
# Budget: designed for < 8 minutes on 16 cores (each step has its own timeout).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${TERRACE_GPU_BUILD_DIR:-$ROOT/build-gpu}"
JOBS="$(nproc 2>/dev/null || echo 8)"
LOGDIR="$BUILD/check-logs"
mkdir -p "$LOGDIR"
START=$(date +%s)

say() { printf '[check.sh %4ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }
die() { printf '[check.sh] ERROR: %s\n' "$*" >&2; exit 1; }

# ---- 1. GPU and toolkit ------------------------------------------------------------------------
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this script needs a machine with an NVIDIA driver"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  || die "nvidia-smi cannot talk to the driver; check the GPU with 'nvidia-smi'"
export PATH="/usr/local/cuda/bin:$PATH"
command -v nvcc >/dev/null || die "nvcc not found (looked in PATH and /usr/local/cuda/bin); install the CUDA toolkit"
say "nvcc: $(nvcc --version | tail -1)"

# ---- 2. Packages (best effort) -----------------------------------------------------------------
PKGS=(cmake ninja-build g++ pkg-config libfmt-dev libxxhash-dev catch2 liburing-dev librocksdb-dev
      libboost-dev nlohmann-json3-dev libcli11-dev libopenblas-dev libzstd-dev liblz4-dev)
MISSING=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || MISSING+=("$p"); done
if (( ${#MISSING[@]} )); then
  say "missing packages: ${MISSING[*]}"
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    if timeout 90 apt-get update -qq >"$LOGDIR/apt.log" 2>&1 &&
       timeout 150 apt-get install -y -qq --no-install-recommends "${MISSING[@]}" >>"$LOGDIR/apt.log" 2>&1; then
      say "installed: ${MISSING[*]}"
    else
      say "apt-get could not install them (offline?); continuing with what exists (see $LOGDIR/apt.log)"
    fi
  else
    say "not root or no apt-get; continuing with what exists"
  fi
fi
command -v cmake >/dev/null || say "cmake missing: only the nvcc-only fallback is possible"
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)

# ---- 3. Build ----------------------------------------------------------------------------------
MODE=none
TESTS=(test_hbm_cuda test_hbm_store_cuda test_hbm_emulated test_host_tier test_conformance test_codec_cuda)
BENCHES=(bench_hbm_bandwidth bench_hbm_tier bench_host_tier bench_codec_cuda)
if command -v cmake >/dev/null && [[ -z ${TERRACE_GPU_CHECK_SKIP_FULL:-} ]]; then
  say "configuring the full project (TERRACE_CUDA=ON) in $BUILD/full"
  if timeout 120 cmake -S "$ROOT" -B "$BUILD/full" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DTERRACE_CUDA=ON \
       -DTERRACE_BUILD_BENCH=ON -DTERRACE_BUILD_CLI=OFF -DTERRACE_WERROR=OFF >"$LOGDIR/configure-full.log" 2>&1; then
    say "building ${TESTS[*]} ${BENCHES[*]}"
    if timeout 300 cmake --build "$BUILD/full" -j "$JOBS" --target "${TESTS[@]}" "${BENCHES[@]}" \
         >"$LOGDIR/build-full.log" 2>&1; then
      MODE=full; BIN="$BUILD/full"
    else
      say "full build failed (tail of $LOGDIR/build-full.log):"; tail -15 "$LOGDIR/build-full.log" || true
    fi
  else
    say "full configure failed (tail of $LOGDIR/configure-full.log):"; tail -8 "$LOGDIR/configure-full.log" || true
  fi
fi
if command -v cmake >/dev/null; then
  if [[ $MODE == none ]]; then
    say "trying the standalone build (host + HBM tiers only) in $BUILD/standalone"
    if timeout 90 cmake -S "$ROOT/bench/gpu/standalone" -B "$BUILD/standalone" "${GEN[@]}" \
         -DCMAKE_BUILD_TYPE=Release >"$LOGDIR/configure-standalone.log" 2>&1 &&
       timeout 240 cmake --build "$BUILD/standalone" -j "$JOBS" >"$LOGDIR/build-standalone.log" 2>&1; then
      MODE=standalone; BIN="$BUILD/standalone"
    else
      say "standalone build failed (see $LOGDIR/*standalone.log)"; tail -8 "$LOGDIR/build-standalone.log" 2>/dev/null || true
    fi
  fi
fi
if [[ $MODE == none ]]; then
  say "last resort: nvcc-only build of the bandwidth benchmark"
  mkdir -p "$BUILD/nvcc"
  nvcc -O2 -std=c++17 -o "$BUILD/nvcc/bench_hbm_bandwidth" "$ROOT/bench/gpu/hbm_bandwidth.cpp" \
    || die "even the nvcc-only build failed; see the compiler output above"
  MODE=nvcc; BIN="$BUILD/nvcc"
fi
say "build mode: $MODE"

# ---- 4. Run ------------------------------------------------------------------------------------
declare -A RESULT
FAILED=0
if [[ $MODE == full || $MODE == standalone ]]; then
  if [[ $MODE == full ]]; then TEST_RE='^(test_hbm_cuda|test_hbm_store_cuda|test_hbm_emulated|test_host_tier|test_conformance|test_codec_cuda|test_codec_cuda_api)$'
  else TEST_RE='^test_hbm_'; fi
  say "running GPU tests"
  set +e
  timeout 240 ctest --test-dir "$BIN" -R "$TEST_RE" --output-on-failure --timeout 200 >"$LOGDIR/ctest.log" 2>&1
  set -e
  while read -r line; do
    if [[ $line =~ Test\ +#[0-9]+:\ +([A-Za-z0-9_]+)\ .*(Passed|Failed|Skipped|Not\ Run|Timeout|Exception) ]]; then
      RESULT[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
    fi
  done <"$LOGDIR/ctest.log"
  grep -E "Test +#|tests passed|SKIPPED" "$LOGDIR/ctest.log" || true
  for t in "${!RESULT[@]}"; do [[ ${RESULT[$t]} == Passed ]] || FAILED=1; done
  (( ${#RESULT[@]} )) || { say "no test results found; see $LOGDIR/ctest.log"; FAILED=1; }
else
  say "tests not built (mode $MODE)"; FAILED=1
fi

run_bench() {  # name, timeout
  local exe; exe="$(find "$BIN" -name "$1" -type f -perm -u+x | head -1)"
  if [[ -z $exe ]]; then say "$1 not built"; return 0; fi
  say "running $1"
  set +e; timeout "$2" "$exe" >"$LOGDIR/$1.log" 2>&1; local rc=$?; set -e
  grep -v '^RESULT' "$LOGDIR/$1.log" || true
  (( rc == 0 )) || { say "$1 exited with status $rc"; FAILED=1; }
}
run_bench bench_hbm_bandwidth 150
run_bench bench_hbm_tier 120
run_bench bench_host_tier 60
run_bench bench_codec_cuda 60   # KV codec kernels (src/codec/cuda), full build only

# ---- 5. Summary --------------------------------------------------------------------------------
pick() {  # file, awk filter -> max GB/s
  [[ -f $LOGDIR/$1 ]] || { echo "n/a"; return; }
  awk "$2"' { if ($NF > m) m = $NF } END { if (m) printf "%.1f", m; else print "n/a" }' "$LOGDIR/$1"
}
echo
echo "================ Terrace GPU check ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)) ================"
printf '%-44s %s\n' "build" "$MODE"
for t in test_hbm_cuda test_hbm_store_cuda test_hbm_emulated test_host_tier test_conformance test_codec_cuda test_codec_cuda_api; do
  printf '%-44s %s\n' "$t" "${RESULT[$t]:-not run}"
done
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
if (( FAILED )); then echo "RESULT: FAIL"; exit 1; fi
echo "RESULT: PASS"
