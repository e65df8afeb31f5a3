"""bench/vs_fio.sh treats both sides alike: run against stand-ins for fio and terrace that log their
arguments, every timed random read is each side's first pass over its laid-out data (fio: one run;
Terrace: --warmup 0), not a pass after an untimed one on one side only."""
import os
import pathlib
import subprocess

SOURCE = pathlib.Path(os.environ.get("TERRACE_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))

FAKE_FIO = """#!/bin/sh
echo "fio $*" >> "$LOG"
echo '{"jobs": [{"read": {"io_bytes": 1, "bw_bytes": 1000000, "iops": 100, "total_ios": 100, "runtime": 1000,
  "clat_ns": {"percentile": {"50.000000": 1000, "99.000000": 2000}}}, "write": {"io_bytes": 0},
  "usr_cpu": 1, "sys_cpu": 1}]}'
"""

FAKE_TERRACE = """#!/bin/sh
echo "terrace $*" >> "$LOG"
echo '{"mb_per_s": 1, "iops": 100, "p50_us": 1, "p99_us": 2, "user_us_per_op": 0, "sys_us_per_op": 0}'
"""


def test_vs_fio_random_reads_give_neither_side_a_warm_up(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("fio", FAKE_FIO), ("terrace", FAKE_TERRACE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", LOG=str(log), TERRACE=str(bin_dir / "terrace"),
               RAND_ONLY="1", REPEAT="2", RAND_SIZE="1MiB")
    p = subprocess.run(["bash", str(SOURCE / "bench" / "vs_fio.sh"), str(tmp_path / "d")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = log.read_text().splitlines()
    terrace_reads = [l.split() for l in lines if l.startswith("terrace ") and "randread" in l]
    fio_reads = [l for l in lines if l.startswith("fio ") and "--rw=randread" in l]
    assert len(terrace_reads) == 3 and len(fio_reads) == 2  # Terrace: the layout run and one per round
    for args in terrace_reads:
        assert args[args.index("--warmup") + 1] == "0", args
    assert all("ramp" not in l for l in fio_reads)
    assert "ratio 4KiB rand read IOPS:" in p.stdout
