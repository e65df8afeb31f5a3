#!/usr/bin/env bash
# Host tier gets of 1 MiB blocks against memcpy, alternated between two builds: steady state
# (--warmup 1 --repeat 5) and the first pass (--warmup 0 --repeat 1: the first read of the blocks
# the untimed prep writes put; its read buffers are faulted in before it, as the memcpy baseline's
# are, in builds since commit 17831a7, and into fresh buffers in older ones), plus the new build
# with --host-stream-gets off. Prints one line per run: ratio_vs_memcpy, MB/s, memcpy MB/s.
#   bench/host_get_ab.sh OLD_TERRACE NEW_TERRACE [ROUNDS]
# (docs/benchmarks.md, "Host tier gets: streaming stores").
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: bench/host_get_ab.sh OLD_TERRACE NEW_TERRACE [ROUNDS]" >&2
  exit 2
fi
old="$1" new="$2" rounds="${3:-5}"
run() {
  "$@" --tier host --op read --block-size 1MiB --total-bytes 2GiB --json |
    python3 -c 'import json,sys; j=json.load(sys.stdin); print(round(j["ratio_vs_memcpy"], 2), round(j["mb_per_s"]), round(j["memcpy_mb_per_s"]))'
}
for i in $(seq "$rounds"); do
  echo "round $i steady old   $(run "$old" bench tiers --warmup 1 --repeat 5)"
  echo "round $i steady new   $(run "$new" bench tiers --warmup 1 --repeat 5)"
  echo "round $i steady off   $(run "$new" bench tiers --warmup 1 --repeat 5 --host-stream-gets off)"
  echo "round $i first  old   $(run "$old" bench tiers --warmup 0 --repeat 1)"
  echo "round $i first  new   $(run "$new" bench tiers --warmup 0 --repeat 1)"
done
