#!/usr/bin/env bash
# One command for a new user: installs what is missing, builds, and runs `terrace demo` on embedded
# defaults (a data directory ./terrace-data under the working folder; no server, no GPU needed).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TERRACE_SKIP_PYTHON=1 "$root/scripts/deps.sh"
"$root/scripts/build.sh" "$root/build" -DTERRACE_BUILD_TESTS=OFF -DTERRACE_BUILD_BENCH=OFF >/dev/null
exec "$root/build/bin/terrace" demo "$@"
