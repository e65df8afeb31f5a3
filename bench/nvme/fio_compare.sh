#!/usr/bin/env bash
# Runs bench_nvme_tier and fio (io_uring, O_DIRECT) with the same file size, block size and queue
# depth in the same directory, and prints both with the ratio tier/fio.
# Usage: bench/nvme/fio_compare.sh BENCH_BINARY DIR [FILE_SIZE_BYTES] [MODE async|sync] [RANDREAD_SECONDS]
set -euo pipefail
bench=${1:?path to bench_nvme_tier}
dir=${2:?scratch directory on the file system to measure}
size=${3:-2147483648}
mode=${4:-async}
secs=${5:-10}
mkdir -p "$dir"
tier_json=$("$bench" --dir "$dir/tier" --file-size "$size" --queue-depth 32 --mode "$mode" --seconds "$secs" --json)
fio_one() {  # name rw bs extra...
  local name=$1 rw=$2 bs=$3; shift 3
  fio --name="$name" --filename="$dir/fio.dat" --size="$size" --bs="$bs" --rw="$rw" --iodepth=32 \
      --ioengine=io_uring --direct=1 --numjobs=1 --output-format=json "$@"
}
fw=$(fio_one seqwrite write 1M)
fr=$(fio_one seqread read 1M)
frr=$(fio_one randread randread 4k --time_based --runtime="$secs")
rm -f "$dir/fio.dat"
python3 - "$tier_json" "$fw" "$fr" "$frr" "$mode" <<'PY'
import json, sys
tier = {}
for line in sys.argv[1].splitlines():
    o = json.loads(line); tier[o["op"]] = o
def fio(text, rw):
    j = json.loads(text[text.index("{"):])["jobs"][0][rw]
    pct = j["clat_ns"].get("percentile", {})
    return {"mb_per_s": j["bw_bytes"] / 1e6, "iops": j["iops"],
            "p50_us": pct.get("50.000000", 0) / 1e3, "p99_us": pct.get("99.000000", 0) / 1e3}
rows = [(f"seqwrite 1MiB QD32 ({sys.argv[5]})", tier.get(f"seqwrite({sys.argv[5]})"), fio(sys.argv[2], "write"), "mb_per_s"),
        ("seqread 1MiB QD32", tier.get("seqread"), fio(sys.argv[3], "read"), "mb_per_s"),
        ("randread 4KiB QD32", tier.get("randread4k"), fio(sys.argv[4], "read"), "iops")]
print(f"{'test':<28} {'tier':>12} {'fio':>12} {'ratio':>7}   tier p50/p99 us   fio p50/p99 us")
for name, t, f, key in rows:
    if not t: continue
    print(f"{name:<28} {t[key]:>12.1f} {f[key]:>12.1f} {t[key]/f[key]:>7.2f}   "
          f"{t['p50_us']:>6.0f}/{t['p99_us']:<8.0f} {f['p50_us']:>6.0f}/{f['p99_us']:.0f}   ({key})")
PY
