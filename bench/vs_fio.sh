#!/usr/bin/env bash
# Terrace's NVMe tier against fio on the same file system, file size, block size and queue depth, in
# one run: sequential write and read at 1 MiB / QD32 (Terrace in its default async durability, with
# sync beside it) and 4 KiB random reads at QD32. fio uses io_uring with O_DIRECT.
#
# Like for like: each sequential pair times the same kind of pass on both sides, and the pairs run
# REPEAT rounds, fio first in odd rounds and Terrace first in even ones; each ratio line gives every
# round's ratio and their median.
#   first write: fio writes a new file (the previous one removed first) against a fresh Terrace
#     tier's first pass (--warmup 0): both write into space the file system has not written yet,
#     which on ext4 costs far more than a rewrite.
#   rewrite:     fio writes over its existing file against Terrace's default (--warmup 1: the timed
#     pass writes the places the untimed pass wrote). SEQ_REWRITE=0 leaves this pair out.
#   read:        fio's first read of the file it has just written against Terrace's first read
#     (--warmup 0) of the blocks it has just written (untimed).
#   random read: fio's one timed run over its laid-out file against Terrace's first pass (--warmup
#     0) over its laid-out kept store: neither side runs an untimed pass first. (Before 2026-12-06
#     Terrace ran here with --warmup 1, an untimed pass of the same random order before its timed
#     one, and fio with none; ratios from then carry that asymmetry.)
#
#   bench/vs_fio.sh [dir] [size]      # defaults: ./terrace-vs-fio, 2GiB
# Env: TERRACE=path/to/terrace (default build/bin/terrace), QD (32), RAND_SIZE (size of the random-read
# set, default 1GiB), THREADS (Terrace workers, and fio jobs for the random reads; default 1),
# REPEAT (the sequential pairs and the random-read pair run this many times, alternating fio and
# Terrace; each ratio line gives each round's ratio and their median; default 1), SEQ_REWRITE (1:
# also the rewrite pair, the default; 0: not), RAND_ONLY=1 (skip the sequential cases),
# TERRACE_B=path/to/other/terrace (a second binary, e.g. a "before" build: each round runs it too,
# the two Terrace runs in alternating order, and it gets its own ratio line).
# The random reads read one data set per binary, laid out once before the rounds (a --keep store,
# as fio lays out its file once): no round pays for, or follows, the writing or deleting of its
# data. A binary older than the reuse of kept stores rewrites the blocks, untimed, in every round.
# CPU us/IO: user + system CPU time per I/O (fio: its usr/sys over its runtime; Terrace: the
# process's getrusage over the timed pass, every thread; Terrace reads into buffers registered
# with the tier, as the store's host arena is, where fio pins its buffers on every I/O).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-terrace-vs-fio}"
size="${2:-2GiB}"
qd="${QD:-32}"
rand_size="${RAND_SIZE:-1GiB}"
threads="${THREADS:-1}"
repeat="${REPEAT:-1}"
rand_only="${RAND_ONLY:-0}"
seq_rewrite="${SEQ_REWRITE:-1}"
terrace="${TERRACE:-$root/build/bin/terrace}"
terrace_b="${TERRACE_B:-}"
command -v fio >/dev/null || { echo "vs_fio: fio is not installed (apt-get install fio)" >&2; exit 1; }
[ -x "$terrace" ] || { echo "vs_fio: $terrace not found; build first (scripts/build.sh)" >&2; exit 1; }
[ -z "$terrace_b" ] || [ -x "$terrace_b" ] || { echo "vs_fio: TERRACE_B=$terrace_b is not an executable" >&2; exit 1; }
mkdir -p "$dir"
# Scratch names this script creates in $dir and removes when it ends; never remove what was there.
for p in "$dir/fio.dat" "$dir/terrace" "$dir/terrace-rand-a" "$dir/terrace-rand-b"; do
  [ ! -e "$p" ] || { echo "vs_fio: $p exists (left by an interrupted run, or not ours); remove it or pick another directory" >&2; exit 1; }
done
bytes() { python3 -c "import sys; s=sys.argv[1]; u={'KiB':1<<10,'MiB':1<<20,'GiB':1<<30}; n=[k for k in u if s.endswith(k)]; print(int(s[:-3])*u[n[0]] if n else int(s))" "$1"; }
fio_size=$(bytes "$size"); fio_rand=$(bytes "$rand_size")

fio_run() {  # rw bs size [jobs] -> "MB/s IOPS p50_us p99_us cpu_us_per_io(user+sys)"
  local rw=$1 bs=$2 sz=$3 jobs=${4:-1}
  fio --name=t --filename="$dir/fio.dat" --size="$sz" --bs="$bs" --iodepth="$qd" --rw="$rw" \
      --ioengine=io_uring --direct=1 --numjobs="$jobs" --group_reporting --output-format=json 2>/dev/null |
    python3 -c '
import json, sys
j = json.load(sys.stdin)["jobs"][0]
side = j["read"] if j["read"]["io_bytes"] else j["write"]
pct = side["clat_ns"].get("percentile", {})
# With --group_reporting, usr_cpu / sys_cpu are the mean over the jobs: times the job count.
ios = max(side["total_ios"], 1); cpu_s = side["runtime"] / 1e3 * (j["usr_cpu"] + j["sys_cpu"]) / 100 * int(sys.argv[1])
print("%.0f %.0f %.1f %.1f %.2f" % (side["bw_bytes"] / 1e6, side["iops"], pct.get("50.000000", 0) / 1e3, pct.get("99.000000", 0) / 1e3, cpu_s * 1e6 / ios))' "$jobs"
}
# warmup: untimed passes before the one timed pass (0: the timed pass is a fresh tier's first).
terrace_run() {  # op bs total durability warmup [binary [kept dir]] -> "MB/s IOPS p50_us p99_us cpu_us_per_io(user+sys, or - )"
  local bin=${6:-$terrace} keep_dir=${7:-}
  local d=${keep_dir:-$dir/terrace}
  "$bin" bench tiers --tier nvme --op "$1" --block-size "$2" --queue-depth "$qd" --total-bytes "$3" \
      --durability "$4" --warmup "$5" --repeat 1 --threads "$threads" --dir "$d" ${keep_dir:+--keep} --json |
    python3 -c '
import json, sys
j = json.load(sys.stdin)
cpu = "%.2f" % (j["user_us_per_op"] + j["sys_us_per_op"]) if "user_us_per_op" in j else "-"
print("%.0f %.0f %.1f %.1f %s" % (j["mb_per_s"], j["iops"], j["p50_us"], j["p99_us"], cpu))'
  [ -n "$keep_dir" ] || rm -rf "$d"
}

printf "%-34s %10s %10s %9s %9s %10s\n" "case" "MB/s" "IOPS" "p50 us" "p99 us" "CPU us/IO"
row() { printf "%-34s %10s %10s %9s %9s %10s\n" "$1" $2; }
ratio() { python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); print('%.2f' % (a/b if b else 0))" "$1" "$2"; }
median() { python3 -c "import sys, statistics; print('%.2f' % statistics.median(map(float, sys.argv[1:])))" "$@"; }

# One sequential pair: fio's command and Terrace's, in the round's order; appends Terrace / fio
# (MB/s) to the array named by $1. $2 $3: the rows' labels; $4: fio's arguments; $5: Terrace's.
# A pair whose fio side writes a new file removes the old one first (its "fresh" word in $4).
seq_pair() {
  local -n out=$1
  local fio_label=$2 terrace_label=$3 fio_args=${4#fresh } terrace_args=$5 f t side
  local fresh=0; [[ $4 == fresh* ]] && fresh=1
  local order=(fio terrace); ((round % 2)) || order=(terrace fio)
  for side in "${order[@]}"; do
    if [ "$side" = fio ]; then
      ((fresh == 0)) || rm -f "$dir/fio.dat"
      # shellcheck disable=SC2086
      f=$(fio_run $fio_args); row "$fio_label" "$f"
    else
      # shellcheck disable=SC2086
      t=$(terrace_run $terrace_args); row "$terrace_label" "$t"
    fi
  done
  out+=("$(ratio "${t%% *}" "${f%% *}")")
}
if [ "$rand_only" != 1 ]; then
  first_w=() first_ws=() rewrite_w=() seq_r=()
  for ((round = 1; round <= repeat; ++round)); do
    [ "$repeat" = 1 ] || echo "-- sequential round $round of $repeat ($( ((round % 2)) && echo "fio first" || echo "Terrace first"))"
    seq_pair first_w "fio seq write 1MiB qd$qd (new file)" "terrace seq write (async, first)" \
      "fresh write 1M $fio_size" "write 1MiB $size async 0"
    seq_pair first_ws "fio seq write 1MiB qd$qd (new file)" "terrace seq write (sync, first)" \
      "fresh write 1M $fio_size" "write 1MiB $size sync 0"
    if [ "$seq_rewrite" = 1 ]; then
      seq_pair rewrite_w "fio seq rewrite 1MiB qd$qd" "terrace seq rewrite (async, warmup 1)" \
        "write 1M $fio_size" "write 1MiB $size async 1"
    fi
    seq_pair seq_r "fio seq read 1MiB qd$qd (first read)" "terrace seq read (first read)" \
      "read 1M $fio_size" "read 1MiB $size async 0"
  done
  rm -f "$dir/fio.dat"
fi
# Lay out each data set once, untimed: fio's file, and a kept Terrace store per binary.
fio_run write 1M "$fio_rand" >/dev/null
rand_a="$dir/terrace-rand-a" rand_b="$dir/terrace-rand-b"
terrace_run randread 4KiB "$rand_size" async 0 "$terrace" "$rand_a" >/dev/null
[ -z "$terrace_b" ] || terrace_run randread 4KiB "$rand_size" async 0 "$terrace_b" "$rand_b" >/dev/null
ratios=() ratios_b=()
rand_a_row() {
  local t; t=$(terrace_run randread 4KiB "$rand_size" async 0 "$terrace" "$rand_a"); row "terrace rand read 4KiB x$threads" "$t"
  ratios+=("$(ratio "$(echo "$t" | cut -d' ' -f2)" "$(echo "$frr" | cut -d' ' -f2)")")
}
rand_b_row() {
  local t; t=$(terrace_run randread 4KiB "$rand_size" async 0 "$terrace_b" "$rand_b"); row "TERRACE_B rand read 4KiB x$threads" "$t"
  ratios_b+=("$(ratio "$(echo "$t" | cut -d' ' -f2)" "$(echo "$frr" | cut -d' ' -f2)")")
}
for ((r = 1; r <= repeat; ++r)); do
  frr=$(fio_run randread 4k "$fio_rand" "$threads"); row "fio rand read 4KiB qd$qd x$threads" "$frr"
  if [ -z "$terrace_b" ]; then
    rand_a_row
  elif ((r % 2)); then
    rand_a_row; rand_b_row
  else
    rand_b_row; rand_a_row
  fi
done
rm -f "$dir/fio.dat"
rm -rf "$rand_a" "$rand_b"
echo
if [ "$rand_only" != 1 ]; then
  echo "ratio seq first write (async / fio new file): $(median "${first_w[@]}") (median of ${first_w[*]})   target >= 0.9"
  echo "ratio seq first write (sync / fio new file):  $(median "${first_ws[@]}") (median of ${first_ws[*]})"
  if [ "$seq_rewrite" = 1 ]; then
    echo "ratio seq rewrite (async / fio rewrite):      $(median "${rewrite_w[@]}") (median of ${rewrite_w[*]})"
  fi
  echo "ratio seq first read:                         $(median "${seq_r[@]}") (median of ${seq_r[*]})   target >= 0.9"
fi
echo "ratio 4KiB rand read IOPS:      $(median "${ratios[@]}") (median of ${ratios[*]})   target >= 0.9"
if [ -n "$terrace_b" ]; then
  echo "ratio 4KiB rand read IOPS (TERRACE_B): $(median "${ratios_b[@]}") (median of ${ratios_b[*]})"
fi
