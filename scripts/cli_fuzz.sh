#!/usr/bin/env bash
# A bounded fuzz run of the `terrace` command line: random argument vectors over every command with
# edge values and odd paths (FIFOs, device nodes, symlinks, user folders), each with a timeout in a
# sandbox. Fails on a crash, a hang, or a file outside the sandbox (or a user fixture) changed.
# Fixed seed; well under a minute on two cores (bounded by --budget). See tests/cli/cli_fuzz.py.
#   scripts/cli_fuzz.sh [build-dir] [runs]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
runs="${2:-1200}"
py="$root/.venv/bin/python"
[ -x "$py" ] || py="$(command -v python3)"
exec "$py" "$root/tests/cli/cli_fuzz.py" --terrace "$build/bin/terrace" --runs "$runs" --seed 1 --jobs 2 \
  --timeout 30 --budget 120 --root "$build/cli-fuzz"
