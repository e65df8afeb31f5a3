"""`terrace bench experts` and `terrace bench kv` take a store in --dir as their own only when their
own store open creates it: a store another process puts into --dir while the bench runs is refused
(exit 1), never removed, and never marked as the bench's (so a later run does not remove it either).
TERRACE_TEST_STORE_OPEN_GATE holds the bench right before its first store open, so the other
process's store lands there deterministically, after the bench took --dir and before it opens it."""
import os
import subprocess

import pytest

from conftest import snapshot, wait_for

EXPERTS = ("bench", "experts", "--prompt", "2", "--decode", "2", "--budgets", "50%", "--configs", "on-demand")
KV = ("bench", "kv", "--prefix-tokens", "64", "--turns", "1", "--conversations", "1", "--system-tokens", "32",
      "--user-tokens", "16", "--chunk-tokens", "16", "--store-host-size", "1MiB", "--state-host-size", "1MiB",
      "--store-nvme-size", "4MiB", "--state-nvme-size", "16MiB")
REFUSAL = "gained entries while the bench ran (another process wrote into it?)"


def run_with_store_put_in(terrace, tmp_path, store_dir, *args):
    """Runs `terrace *args` held at its store-open gate, fills a 4-block store into store_dir (as a
    user would, with 'terrace store fill') meanwhile, then lets it go. (returncode, stderr, the
    snapshot of store_dir right after the fill)."""
    gate = tmp_path / "gate"
    p = subprocess.Popen([terrace.path, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, TERRACE_TEST_STORE_OPEN_GATE=str(gate)))
    try:
        assert wait_for(tmp_path / "gate.waiting", 120), "the bench never reached its store-open gate"
        terrace("store", "fill", "--dir", store_dir, "--capacity", "4MiB", "--count", "4", "--block-size", "64KiB",
                check=True)
        filled = snapshot(store_dir)
    finally:
        gate.write_text("")
        out, err = p.communicate(timeout=300)
    return p.returncode, err, filled


@pytest.mark.parametrize("keep", [[], ["--keep"]], ids=["remove", "keep"])
def test_bench_experts_leaves_a_store_put_into_dir_during_the_run(terrace, toy_model, tmp_path, keep):
    d = tmp_path / "be"
    d.mkdir()
    rc, err, filled = run_with_store_put_in(terrace, tmp_path, d, *EXPERTS, "--model", toy_model, "--dir", d, *keep)
    assert rc == 1, err
    assert REFUSAL in err and "nothing in it was removed" in err, err
    assert snapshot(d) == filled, sorted(os.listdir(d))  # neither removed nor marked (--keep)
    # A later run takes it for someone else's store: refused, left untouched.
    r = terrace(*EXPERTS, "--model", toy_model, "--dir", d)
    assert r.returncode == 2, r.stderr
    assert snapshot(d) == filled, sorted(os.listdir(d))


def test_bench_kv_leaves_a_pool_put_into_dir_during_the_run(terrace, toy_model, tmp_path):
    d = tmp_path / "bk"
    rc, err, filled = run_with_store_put_in(terrace, tmp_path, d / "kv", *KV, "--model", toy_model, "--dir", d)
    assert rc == 1, err
    assert REFUSAL in err and f"{d / 'kv'} appeared" in err and "nothing in it was removed" in err, err
    assert snapshot(d / "kv") == filled, sorted(os.listdir(d / "kv"))
    assert sorted(os.listdir(d)) == ["kv"], sorted(os.listdir(d))  # the bench made no pool of its own
