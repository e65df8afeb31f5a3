"""`terrace bench tiers`: the sizes the command takes and what it says about them - memory tiers sized so
that a block can be rewritten (blocks over 64 MiB), the hbm tier's block limit named by --block-size, the
default NVMe --batch capped as --help says and read buffers no larger than the data set, the NVMe file's
size said before it is made and true advice when it does not fit, the latency columns saying what they
measured, the bytes a pass really moved, and a --dir whose terrace.data is not a Terrace data file."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

MiB = 1 << 20


# Runs argv[2:] and writes its own peak RSS (KiB) to the file argv[1]. A small process of its own
# starts it: a child's ru_maxrss counts from the fork, so a child forked by a large pytest process
# would report at least that process's size.
_RSS_WRAPPER = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(p.pid, 0)
p.returncode = os.waitstatus_to_exitcode(status)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(p.returncode if p.returncode >= 0 else 128 - p.returncode)
"""


def run_with_rss(terrace, *args, timeout=120):
    """(returncode, stdout, stderr, peak RSS in bytes) of one terrace run, the RSS of that process alone."""
    with tempfile.TemporaryDirectory() as d:
        rss_file = os.path.join(d, "rss")
        try:
            r = subprocess.run([sys.executable, "-c", _RSS_WRAPPER, rss_file, terrace.path, *map(str, args)],
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"terrace {' '.join(map(str, args))} hung (no exit within {timeout} s)")
        with open(rss_file) as f:
            rss = int(f.read()) * 1024
        return r.returncode, r.stdout, r.stderr, rss


# ---- 1. memory tiers: a block larger than 64 MiB can be rewritten; hbm's limit named by --block-size ----

@pytest.mark.parametrize("tier", ["host", "hbm"])
def test_memory_tier_rewrites_a_128MiB_block(terrace, tier):
    # The timed pass after the warm-up rewrites every block: the tier needs room for the new copy
    # before the old one goes. Sized at need + 1/8 + 64 MiB it had 208 MiB for a 128 MiB block and
    # failed "no room ... raise --capacity" (a flag bench tiers does not have).
    r = terrace("bench", "tiers", "--tier", tier, "--op", "write", "--block-size", "128MiB", "--total-bytes", "128MiB",
                "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "--capacity" not in r.stderr and "capacity_bytes" not in r.stderr, r.stderr
    j = json.loads(r.stdout)
    assert j["total_bytes"] == 128 * MiB


def test_memory_tier_with_two_workers_rewrites_blocks_that_fill_a_chunk(terrace):
    # 200 MiB blocks: one per 256 MiB arena chunk; two workers each hold a new copy while rewriting.
    r = terrace("bench", "tiers", "--tier", "host", "--op", "write", "--block-size", "200MiB", "--total-bytes", "400MiB",
                "--threads", "2", "--warmup", "1", "--json", timeout=300)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="a CUDA hbm tier takes blocks as large as itself")
def test_hbm_block_over_its_largest_is_refused_naming_block_size(terrace):
    r = terrace("bench", "tiers", "--tier", "hbm", "--block-size", "257MiB", "--total-bytes", "257MiB", timeout=300)
    assert r.returncode == 2, r.stderr
    assert "--block-size 257.0 MiB" in r.stderr and "--tier hbm" in r.stderr and "256MiB" in r.stderr, r.stderr
    assert "split it" not in r.stderr and "OutOfCapacity" not in r.stderr, r.stderr
    # The largest one it takes still works.
    r = terrace("bench", "tiers", "--tier", "hbm", "--block-size", "256MiB", "--total-bytes", "256MiB", timeout=300)
    assert r.returncode == 0, r.stderr


# ---- 2. the default NVMe batch is capped; read buffers hold no more blocks than a call moves -----------

def test_nvme_default_batch_is_at_most_4096_blocks(terrace, tmp_path):
    r = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--queue-depth", "4096", "--block-size", "4KiB",
                "--total-bytes", "64KiB", "--dir", tmp_path / "b", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["batch"] == 4096  # was 8 x 4096 = 32768, against --help's "up to 4096 blocks"
    assert "4096" in terrace("bench", "tiers", "--help").stdout


def test_nvme_read_at_queue_depth_4096_is_not_refused_for_read_buffers(terrace, tmp_path):
    # Was: "--threads 1 x --batch 32768 x --block-size 1.0 MiB need 32.0 GiB of read buffers", with no
    # --batch given, for a 4 MiB data set.
    r = terrace("bench", "tiers", "--tier", "nvme", "--op", "read", "--queue-depth", "4096", "--block-size", "1MiB",
                "--total-bytes", "4MiB", "--dir", tmp_path / "b", "--json")
    assert r.returncode == 0, r.stderr
    assert "read buffers" not in r.stderr, r.stderr
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("tier", ["nvme", "host"])
def test_read_buffers_are_sized_for_the_data_set_not_the_batch(terrace, tmp_path, tier):
    # 16 blocks of 64 KiB (1 MiB) read at queue depth 4096 (nvme: batch 4096; host: batch 4096):
    # the buffers were 4096 x 64 KiB = 256 MiB (nvme: 8192 x 64 KiB = 512 MiB at qd 1024), faulted in.
    qd = "1024" if tier == "nvme" else "4096"
    extra = ["--dir", tmp_path / "b"] if tier == "nvme" else []
    rc, out, err, rss = run_with_rss(terrace, "bench", "tiers", "--tier", tier, "--op", "read", "--queue-depth", qd,
                                     "--block-size", "64KiB", "--total-bytes", "1MiB", "--json", *extra)
    assert rc == 0, err
    assert rss < 200 * MiB, (rss >> 20, err)


# ---- 3. the NVMe file's size is said before it is made; the advice when it does not fit is true --------

def nvme_file_bytes(blocks, block_size):
    per_block = (block_size + 4095) // 4096 * 4096 + 4096
    need = blocks * per_block
    return (need + need // 8 + 64 * MiB + 4095) // 4096 * 4096


def test_nvme_file_size_is_in_help_and_said_before_it_is_created(terrace, tmp_path):
    help_text = " ".join(terrace("bench", "tiers", "--help").stdout.split())
    assert "preallocated" in help_text and "64 MiB" in help_text and "640 MiB" in help_text, help_text
    d = tmp_path / "b"
    r = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--block-size", "1", "--total-bytes", "4KiB",
                "--dir", d, "--keep")
    assert r.returncode == 0, r.stderr
    m = re.search(r"creating the NVMe tier's data file (\S+) of [^(]+\((\d+) bytes: 4096 blocks x 8 KiB on disk", r.stderr)
    assert m, r.stderr
    want = nvme_file_bytes(4096, 1)  # 4 KiB of 1-byte blocks: a 100 MiB file
    assert int(m.group(2)) == want == os.stat(d / "terrace.data").st_size
    assert r.stderr.index("creating the NVMe tier's data file") < r.stderr.index("[terrace nvme] created")
    shutil.rmtree(d)


def test_nvme_free_space_advice_says_how_far_to_lower_total_bytes(terrace, tmp_path):
    # 64 TiB of 1-byte blocks take 8 KiB each: the advice names a --total-bytes whose file fits.
    r = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--block-size", "1", "--total-bytes", "64TiB",
                "--dir", tmp_path / "b")
    assert r.returncode == 2, r.stderr
    m = re.search(r"lower --total-bytes to at most (\d+)(MiB|KiB)? \((\d+) blocks\)", r.stderr)
    assert m, r.stderr
    suggested = int(m.group(1)) * {"MiB": MiB, "KiB": 1024, None: 1}[m.group(2)]
    free = shutil.disk_usage(tmp_path).free
    assert nvme_file_bytes(suggested, 1) <= free * 1.01, (suggested, free)
    assert "8 KiB of the file" in r.stderr and "whole 4 KiB units" in r.stderr, r.stderr
    assert not (tmp_path / "b").exists()


@pytest.fixture
def small_tmpfs(tmp_path):
    """Mounts a tmpfs of the requested MiB under tmp_path (root only; skipped otherwise)."""
    mounted = []

    def mount(mib):
        d = tmp_path / f"fs{mib}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(d)], capture_output=True)
        if r.returncode != 0:
            pytest.skip("cannot mount a small tmpfs here (needs root)")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        for _ in range(20):
            if subprocess.run(["umount", str(d)], capture_output=True).returncode == 0:
                break
            subprocess.run(["sleep", "0.2"])


def test_nvme_file_system_below_the_floor_is_not_told_to_lower_total_bytes(terrace, small_tmpfs):
    fs = small_tmpfs(32)  # less than the file's 64 MiB floor: no --total-bytes fits
    r = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--block-size", "4KiB", "--total-bytes", "1MiB",
                "--dir", fs / "b")
    assert r.returncode == 2, r.stderr
    assert "a lower --total-bytes cannot help" in r.stderr and "more room" in r.stderr, r.stderr
    assert "lower --total-bytes to" not in r.stderr and "lower --total-bytes or" not in r.stderr, r.stderr


def test_nvme_advice_to_lower_total_bytes_works_when_followed(terrace, small_tmpfs):
    fs = small_tmpfs(100)
    r = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--block-size", "1MiB", "--total-bytes", "64MiB",
                "--dir", fs / "b")
    assert r.returncode == 2, r.stderr
    m = re.search(r"lower --total-bytes to at most (\d+MiB)", r.stderr)
    assert m, r.stderr
    r = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--block-size", "1MiB", "--total-bytes", m.group(1),
                "--dir", fs / "b")
    assert r.returncode == 0, r.stderr


# ---- 4. the latency columns say what they measured -------------------------------------------------

def test_text_latency_columns_name_per_io_at_qd_or_single_calls(terrace, tmp_path):
    nvme = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--block-size", "4KiB", "--total-bytes", "1MiB",
                   "--queue-depth", "8", "--dir", tmp_path / "b")
    assert nvme.returncode == 0, nvme.stderr
    header = nvme.stdout.splitlines()[0]
    assert "p50 us/io at qd 8" in header and "p99 us/io at qd 8" in header, header
    assert "us/op" not in header, header
    host = terrace("bench", "tiers", "--tier", "host", "--op", "write", "--block-size", "1MiB", "--total-bytes", "8MiB")
    assert host.returncode == 0, host.stderr
    header = host.stdout.splitlines()[0]
    assert "p50 us/op, single calls" in header and "us/io" not in header, header


# ---- 5. a --total-bytes that is not a multiple of --block-size: the bytes moved are said -------------

def test_bytes_actually_moved_are_in_the_text_and_json(terrace):
    r = terrace("bench", "tiers", "--tier", "host", "--op", "write", "--block-size", "3MiB", "--total-bytes", "10MiB")
    assert r.returncode == 0, r.stderr
    assert "moved 9.0 MiB a pass, not --total-bytes 10.0 MiB" in r.stdout, r.stdout
    assert "moved/pass" in r.stdout.splitlines()[0], r.stdout
    assert "not a multiple of --block-size" in r.stderr, r.stderr
    j = json.loads(terrace("bench", "tiers", "--tier", "host", "--op", "write", "--block-size", "3MiB", "--total-bytes",
                           "10MiB", "--json", check=True).stdout)
    assert j["total_bytes"] == 9 * MiB and j["total_bytes_requested"] == 10 * MiB
    whole = terrace("bench", "tiers", "--tier", "host", "--op", "write", "--block-size", "1MiB", "--total-bytes", "8MiB")
    assert whole.returncode == 0 and "not --total-bytes" not in whole.stdout, whole.stdout


# ---- 6. a terrace.data that is not a Terrace data file is not "a Terrace store" ---------------------

def test_dir_with_a_text_file_named_terrace_data_holds_no_store(terrace, tmp_path):
    d = tmp_path / "user"
    d.mkdir()
    (d / "terrace.data").write_bytes(b"my note\n")
    r = terrace("bench", "tiers", "--tier", "nvme", "--total-bytes", "4MiB", "--dir", d)
    assert r.returncode == 2, r.stderr
    assert "is not empty and holds no store of the bench" in r.stderr, r.stderr
    assert "holds a Terrace store" not in r.stderr, r.stderr
    assert (d / "terrace.data").read_bytes() == b"my note\n" and os.listdir(d) == ["terrace.data"]


def test_dir_with_a_real_store_the_bench_did_not_keep_is_still_named_a_store(terrace, tmp_path):
    d = tmp_path / "kept"
    terrace("bench", "tiers", "--tier", "nvme", "--total-bytes", "4MiB", "--dir", d, "--keep", check=True)
    os.remove(d / "terrace-bench-kept.marker")
    r = terrace("bench", "tiers", "--tier", "nvme", "--total-bytes", "4MiB", "--dir", d)
    assert r.returncode == 2, r.stderr
    assert "holds a Terrace store that 'terrace bench tiers --keep' did not create" in r.stderr, r.stderr
    shutil.rmtree(d)
