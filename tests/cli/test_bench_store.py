"""`terrace bench store`: a small run prints sane JSON, reads back what it put, and leaves nothing behind."""
import json
import os
import statistics

import pytest

from conftest import snapshot


def test_bench_store_json_small(terrace, tmp_path):
    d = tmp_path / "bs"
    r = terrace("bench", "store", "--dir", d, "--block-size", "1MiB", "--total-bytes", "16MiB", "--batch", "8",
                "--repeat", "2", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["blocks"] == 16 and j["block_size"] == 1 << 20 and j["total_bytes"] == 16 << 20
    for k in ("mb_per_s", "tier_mb_per_s", "put_first_mb_per_s", "put_warm_mb_per_s", "get_host_mb_per_s",
              "put_nvme_mb_per_s", "get_nvme_first_mb_per_s", "tier_first_mb_per_s", "promote_mb_per_s",
              "get_promoted_mb_per_s"):
        assert isinstance(j[k], (int, float)) and j[k] > 0, k
    assert len(j["get_nvme_rounds_mb_per_s"]) == 2 and len(j["tier_rounds_mb_per_s"]) == 2
    assert min(j["get_nvme_rounds_mb_per_s"]) <= j["mb_per_s"] <= max(j["get_nvme_rounds_mb_per_s"])
    assert min(j["tier_rounds_mb_per_s"]) <= j["tier_mb_per_s"] <= max(j["tier_rounds_mb_per_s"])
    assert j["ratio_vs_tier"] > 0
    # Each ratio is the median over the rounds of store / tier in the same round; put_warm is the
    # median of its rounds (two rounds: their mean, neither round alone).
    s, t = j["get_nvme_rounds_mb_per_s"], j["tier_rounds_mb_per_s"]
    assert j["ratio_vs_tier"] == pytest.approx(statistics.median(a / b for a, b in zip(s, t)), rel=1e-9)
    assert len(j["put_warm_rounds_mb_per_s"]) == 2
    assert j["put_warm_mb_per_s"] == pytest.approx(statistics.median(j["put_warm_rounds_mb_per_s"]), rel=1e-9)
    # One key per call: Store::Get against the NVMe tier's own Get, into aligned buffers with room,
    # so every store read landed in the caller's buffer directly and nothing was staged.
    for k in ("single_get_mb_per_s", "single_get_tier_mb_per_s", "single_get_ratio_vs_tier",
              "single_get_first_mb_per_s", "single_get_tier_first_mb_per_s"):
        assert isinstance(j[k], (int, float)) and j[k] > 0, k
    rounds, tier_rounds = j["single_get_rounds_mb_per_s"], j["single_get_tier_rounds_mb_per_s"]
    assert len(rounds) == 2 and len(tier_rounds) == 2
    assert min(rounds) <= j["single_get_mb_per_s"] <= max(rounds)
    assert min(tier_rounds) <= j["single_get_tier_mb_per_s"] <= max(tier_rounds)
    assert j["single_get_ratio_vs_tier"] == pytest.approx(
        statistics.median(a / b for a, b in zip(rounds, tier_rounds)), rel=1e-9)
    assert j["single_get_direct_transfers"] == 2 * 16 and j["single_get_staged_transfers"] == 0
    assert j["single_get_nvme_staged_ios"] == 0
    # Every NVMe-resident block was promoted by the prefetch.
    assert j["promotions"] == 16
    assert "bench store:" in r.stderr  # progress
    assert not d.exists()  # the bench created it and removed it


def test_bench_store_keeps_a_users_empty_dir_and_refuses_a_full_one(terrace, tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    r = terrace("bench", "store", "--dir", d, "--total-bytes", "4MiB", "--repeat", "1", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    assert d.is_dir() and os.listdir(d) == []
    (d / "precious.txt").write_text("keep")
    r = terrace("bench", "store", "--dir", d, "--total-bytes", "4MiB", "--json")
    assert r.returncode == 2 and "--dir" in r.stderr
    assert (d / "precious.txt").read_text() == "keep"


def test_bench_store_bad_sizes_exit_2(terrace, tmp_path):
    r = terrace("bench", "store", "--dir", tmp_path / "x", "--block-size", "1MiB", "--total-bytes", "64KiB")
    assert r.returncode == 2 and "--total-bytes" in r.stderr
    assert not (tmp_path / "x").exists()


def test_bench_store_host_prefault_eager_populates_the_host_tier_at_open(terrace, tmp_path):
    d = tmp_path / "bs"
    r = terrace("bench", "store", "--dir", d, "--total-bytes", "8MiB", "--batch", "8", "--repeat", "1",
                "--host-prefault", "eager", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["host_prefault"] == "eager" and j["host_open_seconds"] > 0
    assert "at open in" in j["host_detail"], j["host_detail"]
    assert not d.exists()
    r = terrace("bench", "store", "--dir", d, "--host-prefault", "maybe")
    assert r.returncode == 2 and "--host-prefault" in r.stderr


def test_bench_store_get_host_reads_into_a_prefaulted_buffer(terrace, tmp_path):
    # Every get lands in one --batch x --block-size buffer (here 16 x 1 MiB = 4096 pages), faulted in
    # before the first phase: the host-resident get, the first to write it, takes far fewer minor
    # faults than its pages (eager: the host tier's arena was populated at open, so it adds none).
    r = terrace("bench", "store", "--dir", tmp_path / "bs", "--block-size", "1MiB", "--total-bytes", "16MiB",
                "--batch", "16", "--repeat", "1", "--host-prefault", "eager", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert 0 <= j["get_host_minor_faults"] < 4096 // 4, j["get_host_minor_faults"]


def test_bench_store_and_kv_refuse_a_killed_runs_leftover_next_to_a_users_file(terrace, toy_model, tmp_path):
    """A --dir holding only a killed run's marked store folder is cleared and used; the same folder next to
    any other entry is the user's: refused, nothing removed."""
    cases = [(("bench", "store", "--total-bytes", "64KiB", "--block-size", "4KiB", "--repeat", "1", "--json"),
              "nvme", "terrace-bench-store.marker"),
             (("bench", "kv", "--model", toy_model, "--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB",
               "--chunk-tokens", "32", "--prefix-tokens", "64", "--turns", "0", "--json"),
              "kv", "terrace-bench-kv.marker")]
    for args, sub, marker in cases:
        d = tmp_path / sub
        (d / sub).mkdir(parents=True)
        (d / sub / marker).touch()  # a killed run's leftover: its marker only
        (d / "precious.txt").write_text("mine\n")
        before = snapshot(d)
        r = terrace(*args, "--dir", d, timeout=300)
        assert r.returncode == 2 and "--dir" in r.stderr and "not empty" in r.stderr, (args, r.stdout, r.stderr)
        assert snapshot(d) == before, args
        (d / "precious.txt").unlink()  # the leftover alone is removed and the run goes ahead
        r = terrace(*args, "--dir", d, timeout=300)
        assert r.returncode == 0, (args, r.stderr)
        assert "left behind by an earlier run" in r.stderr, r.stderr
        assert d.is_dir() and os.listdir(d) == []
