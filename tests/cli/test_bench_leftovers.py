"""What `terrace bench experts` and `terrace bench kv` leave after a runtime failure (exit 1):
nothing they created (docs/errors.md), and never a pool they call foreign. The failures are
provoked with RLIMIT_FSIZE: a preallocation past it fails with EFBIG, as on a full disk."""
import os
import resource

import pytest


def files_up_to(limit):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


EXPERTS = ("bench", "experts", "--prompt", "2", "--decode", "2", "--budgets", "50%", "--configs", "on-demand")


@pytest.mark.parametrize("existing", [False, True], ids=["new-dir", "user-dir"])
def test_bench_experts_failed_store_creation_leaves_nothing(terrace, toy_model, tmp_path, existing):
    d = tmp_path / "be"
    if existing:
        d.mkdir()
    # The expert store's data file cannot be preallocated past 1 MiB.
    r = terrace(*EXPERTS, "--model", toy_model, "--dir", d, preexec_fn=files_up_to(1 << 20))
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "preallocate" in r.stderr
    if existing:  # the user's folder stays, empty
        assert os.listdir(d) == []
    else:  # the folder the run created goes with it
        assert not d.exists(), os.listdir(d)
    # A rerun with room succeeds and leaves nothing behind either.
    terrace(*EXPERTS, "--model", toy_model, "--dir", d, check=True)
    assert (os.listdir(d) == []) if existing else not d.exists()


KV = ("bench", "kv", "--prefix-tokens", "64", "--turns", "1", "--conversations", "1", "--system-tokens", "32",
      "--user-tokens", "16", "--chunk-tokens", "16", "--store-host-size", "1MiB", "--state-host-size", "1MiB",
      "--store-nvme-size", "4MiB", "--state-nvme-size", "16MiB")


def test_bench_kv_removes_the_pool_it_created_when_the_next_cannot_be(terrace, toy_model, tmp_path):
    d = tmp_path / "bk"
    # Room for the 4 MiB KV pool's data file, not for the 16 MiB state pool's.
    r = terrace(*KV, "--model", toy_model, "--dir", d, timeout=300, preexec_fn=files_up_to(8 << 20))
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "preallocate" in r.stderr
    assert "did not create" not in r.stderr and "left" not in r.stderr, r.stderr
    assert not d.exists(), sorted(p.relative_to(d) for p in d.rglob("*"))
    # The rerun with room finds nothing in its way.
    r = terrace(*KV, "--model", toy_model, "--dir", d, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not d.exists()
