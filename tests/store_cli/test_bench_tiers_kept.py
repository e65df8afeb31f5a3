"""`terrace bench tiers --tier nvme --keep`: a kept store reopened by a later run keeps its size; a run it
cannot hold is refused in bench tiers' own flags (--total-bytes, --dir), never in the library's words."""
import os
import subprocess

import pytest

BIN = os.environ.get("TERRACE_BIN")
if not BIN or not os.path.exists(BIN):
    pytest.skip("TERRACE_BIN is not set to the built terrace binary", allow_module_level=True)


def bench(d, total, block):
    return subprocess.run([BIN, "bench", "tiers", "--tier", "nvme", "--dir", str(d), "--total-bytes", total, "--keep",
                           "--block-size", block], capture_output=True, text=True, timeout=300)


def test_a_kept_store_too_small_for_the_run_is_a_usage_error(tmp_path):
    assert bench(tmp_path / "b", "8MiB", "1MiB").returncode == 0
    p = bench(tmp_path / "b", "128MiB", "4MiB")
    assert p.returncode == 2, p.stderr
    assert "lower --total-bytes or give a new --dir" in p.stderr, p.stderr
    assert "InvalidArgument" not in p.stderr, p.stderr


def test_a_kept_store_that_fills_up_names_the_flags(tmp_path):
    assert bench(tmp_path / "b", "64MiB", "4MiB").returncode == 0
    p = bench(tmp_path / "b", "128MiB", "4MiB")  # fits the store's size, not beside the kept blocks
    assert p.returncode == 1, p.stderr
    assert "is full" in p.stderr and "lower --total-bytes or give a new --dir" in p.stderr, p.stderr
    assert "capacity_bytes" not in p.stderr and "erase blocks" not in p.stderr, p.stderr
