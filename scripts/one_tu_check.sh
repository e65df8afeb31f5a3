#!/usr/bin/env bash
# Compiles each library's sources as ONE translation unit (g++ -fsyntax-only), so a name that two
# files of a library both define at namespace scope (an anonymous-namespace helper, a `using`
# alias) is caught now, not later: unity builds (CMAKE_UNITY_BUILD, scripts/test.sh) batch a
# library's files several to a translation unit, and which files share one changes whenever a file
# is added. CUDA sources are left out (nvcc compiles them file by file). About a minute.
#   scripts/one_tu_check.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cxx="${CXX:-g++}"
tu="$(mktemp --suffix=.cpp)"
trap 'rm -f "$tu"' EXIT
failed=0
for dir in "$root"/src/* "$root"/tiers/* "$root"/adapters/*; do
  [ -d "$dir" ] || continue
  mapfile -t files < <(find "$dir" -maxdepth 1 -name '*.cpp' ! -name '*cuda*' | sort)
  [ "${#files[@]}" -gt 1 ] || continue
  printf '#include "%s"\n' "${files[@]}" > "$tu"
  if ! "$cxx" -std=c++20 -fsyntax-only -Wno-subobject-linkage -Wno-psabi -I"$root/include" -I"$root" -DFMT_SHARED "$tu"; then
    echo "scripts/one_tu_check.sh: ${dir#"$root"/}: its ${#files[@]} sources do not compile as one translation unit" \
         "(a name defined in two of them clashes; rename one, or fold them into one shared helper)" >&2
    failed=1
  fi
done
[ "$failed" -eq 0 ] && echo "scripts/one_tu_check.sh: every library compiles as one translation unit"
exit "$failed"
