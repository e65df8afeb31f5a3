#!/usr/bin/env bash
# One command for a new user: installs what is missing, builds the `terrace` tool, and runs
# `terrace demo` on embedded defaults (a data directory ./terrace-data under the working folder; no
# server, no GPU needed): the k3-small model on a multi-turn chat with prefix-cache restore and
# expert offload, checked against a full recompute (docs/demo.md). Arguments go to `terrace demo`.
#
# Uses the same ./build folder and the same configuration as scripts/test.sh
# (scripts/main_build_flags.sh; it only builds fewer targets), so running one after the other
# recompiles nothing the first one built.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TERRACE_SKIP_PYTHON=1 "$root/scripts/deps.sh"
echo "terrace: building the terrace tool in $root/build"
# shellcheck source=scripts/main_build_flags.sh
source "$root/scripts/main_build_flags.sh"  # main_build
"$root/scripts/build.sh" "$root/build" -DTERRACE_BUILD_MODEL=ON -DTERRACE_BUILD_CLI=ON "${main_build[@]}" \
  --target terrace_cli
exec "$root/build/bin/terrace" demo "$@"
