#!/usr/bin/env bash
# Builds the GPU check's tests and benchmarks (bench/gpu/targets.sh) with CUDA for sm_90 (H100 and
# H200) on THIS machine, which has the project's packages and the CUDA toolkit, into a bundle that
# bench/gpu/check.sh runs on a GPU machine that has neither the packages nor a network:
#   <build>/bundle/bin   the stripped binaries
#   <build>/bundle/lib   their shared libraries except glibc's, the CUDA driver's and the C++ runtime (ldd)
#   <build>/bundle/lib-cxx   this machine's C++ runtime (libstdc++, libgcc_s), which check.sh uses
#                        only where the GPU machine's own cannot run the binaries (it needs a newer glibc)
#   <build>/bundle/MANIFEST   commit, build flags, the newest glibc symbol version the binaries need
# Usage: bench/gpu/prepare.sh        (build in $TERRACE_GPU_BUILD_DIR, default <repo>/build-gpu)
# Then carry <build>/bundle to the GPU machine and run bench/gpu/check.sh there (bench/gpu/README.md).
# Fails when the bundle is over 60 MiB (the device tool carries 64 MiB with the working tree).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${TERRACE_GPU_BUILD_DIR:-$ROOT/build-gpu}"
BUNDLE="$BUILD/bundle"
MAX_MIB=60
# shellcheck source=bench/gpu/targets.sh
source "$ROOT/bench/gpu/targets.sh"
export PATH="/usr/local/cuda/bin:$PATH"
command -v nvcc >/dev/null || { echo "prepare.sh: nvcc not found (PATH, /usr/local/cuda/bin); install the CUDA toolkit" >&2; exit 1; }

launcher=()
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
# Release, CUDA required, sm_90 only; the model component and the CLI are not needed by any target.
flags=(-DCMAKE_BUILD_TYPE=Release -DTERRACE_CUDA=ON -DTERRACE_CUDA_ARCHITECTURES=90 -DTERRACE_BUILD_TESTS=ON
       -DTERRACE_BUILD_BENCH=ON -DTERRACE_BUILD_MODEL=OFF -DTERRACE_BUILD_CLI=OFF -DTERRACE_WERROR=OFF)
echo "prepare.sh: configuring $BUILD/full (${flags[*]})"
cmake -S "$ROOT" -B "$BUILD/full" -G Ninja "${flags[@]}" "${launcher[@]}" >"$BUILD.configure.log" 2>&1 \
  || { cat "$BUILD.configure.log"; echo "prepare.sh: configure failed (above)" >&2; exit 1; }
cmake --build "$BUILD/full" -j "$(nproc)" --target "${GPU_TEST_BINARIES[@]}" "${GPU_BENCHES[@]}"

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin" "$BUNDLE/lib" "$BUNDLE/lib-cxx"
for t in "${GPU_TEST_BINARIES[@]}" "${GPU_BENCHES[@]}"; do
  exe="$(find "$BUILD/full" -name "$t" -type f -perm -u+x | head -1)"
  [[ -n $exe ]] || { echo "prepare.sh: $t was not built" >&2; exit 1; }
  cp "$exe" "$BUNDLE/bin/$t"
  strip --strip-unneeded "$BUNDLE/bin/$t"
done
# Shared libraries: everything ldd resolves except glibc (libc, libm, libpthread, libdl, librt,
# the loader) and the CUDA driver (libcuda, the GPU machine's own); the CUDA runtime is static.
skip='^(libc|libm|libpthread|libdl|librt|libresolv|libutil|ld-linux[^.]*|linux-vdso|libcuda|libnvidia[^.]*)\.so'
for b in "$BUNDLE"/bin/*; do
  if ldd "$b" | grep -q 'not found'; then ldd "$b" >&2; echo "prepare.sh: $b has unresolved libraries" >&2; exit 1; fi
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' | while read -r name path; do
    if [[ $name =~ ^(libstdc\+\+|libgcc_s)\.so ]]; then dest="$BUNDLE/lib-cxx/$name"
    elif [[ $name =~ $skip ]]; then continue
    else dest="$BUNDLE/lib/$name"; fi
    [[ -e $dest ]] || cp -L "$path" "$dest"
  done
done
strip --strip-unneeded "$BUNDLE"/lib/* "$BUNDLE"/lib-cxx/* 2>/dev/null || true

glibc_of() { objdump -T "$@" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 | sed 's/GLIBC_//'; }
{
  echo "commit $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n) with $(nvcc --version | tail -1)"
  echo "flags ${flags[*]}"
  echo "needs glibc >= $(glibc_of "$BUNDLE"/bin/* "$BUNDLE"/lib/*) (>= $(glibc_of "$BUNDLE"/lib-cxx/*) where lib-cxx is used) and the CUDA driver (libcuda.so.1) for CUDA 13.0"
  echo "bin $(cd "$BUNDLE/bin" && echo *)"
  echo "lib $(cd "$BUNDLE/lib" && echo *)"
  echo "lib-cxx $(cd "$BUNDLE/lib-cxx" && echo *)"
} >"$BUNDLE/MANIFEST"
mib=$(( ($(du -sb "$BUNDLE" | cut -f1) + (1 << 20) - 1) >> 20 ))
cat "$BUNDLE/MANIFEST"
if (( mib > MAX_MIB )); then
  echo "prepare.sh: the bundle is $mib MiB, over $MAX_MIB MiB (what the device tool can carry beside the tree)" >&2
  exit 1
fi
echo "prepare.sh: bundle $BUNDLE: $mib MiB; run it on the GPU machine with bench/gpu/check.sh (bench/gpu/README.md)"
