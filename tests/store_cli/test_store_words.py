"""What the `store` commands and `model run` say about a store they cannot use, in the CLI's words.

A creation under way is never called a stopped one (whose advice is to delete its files); the
directory `model run --store` keeps its stores in is answered with the stores to give; --repair is
never told a block was kept; a store the file system cannot preallocate names the flag that sets its
size; --expert-home host makes no NVMe expert store; a store another process writes is waited for,
in the same words by every command.
"""
import fcntl
import json
import os
import resource
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

BIN = os.environ.get("TERRACE_BIN")
if not BIN or not os.path.exists(BIN):
    pytest.skip("TERRACE_BIN is not set to the built terrace binary", allow_module_level=True)

TOKENS = ",".join(map(str, range(1, 17)))
SMALL_POOLS = ("--store-nvme-size", "4MiB", "--state-nvme-size", "4MiB", "--chunk-tokens", "8")


def terrace(*args, timeout=300, preexec_fn=None):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, preexec_fn=preexec_fn)


@pytest.fixture(scope="module")
def toy(make_model):
    return make_model("k3-toy", seed=3)


def model_run(toy, store, *flags, preexec_fn=None):
    return terrace("model", "run", "--model", toy, "--tokens", TOKENS, "--max-new", 2, "--store", store,
                   *SMALL_POOLS, *flags, preexec_fn=preexec_fn)


def stopped_creation(store, capacity="1MiB"):
    """`store`/terrace.data.creating as a creation cut off after its superblock and preallocation left it."""
    r = terrace("store", "fill", "--dir", store, "--count", 1, "--capacity", capacity,
                "--drill-fault", "powercut", "--drill-cut-after", 2)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in Path(store).iterdir()) == ["terrace.data.creating"], r.stderr


@contextmanager
def held(store, name):
    """Holds the lock a process using the store holds on store/name (NvmeTier::OpenFd: LOCK_EX on
    terrace.data.creating while it creates the store, on terrace.data while it writes)."""
    with open(Path(store) / name, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield


def live_creator(store):
    return held(store, "terrace.data.creating")


# ---- a creation under way is not a stopped one ------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ["check", "stats", "recover"])
def test_a_creation_under_way_is_waited_for_never_deleted(tmp_path, cmd):
    store = tmp_path / "s"
    stopped_creation(store)
    with live_creator(store):
        r = terrace("store", cmd, "--dir", store)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "another process is creating one there right now" in r.stderr, r.stderr
        assert "wait for that process to finish" in r.stderr, r.stderr
        assert "delete" not in r.stderr and "stopped run" not in r.stderr, r.stderr
    assert (store / "terrace.data.creating").exists()
    r = terrace("store", cmd, "--dir", store)      # no process holds it now: a stopped run left it
    assert r.returncode == 1, r.stdout + r.stderr
    assert "a stopped run left unfinished" in r.stderr and "delete that file" in r.stderr, r.stderr


def locked_data_file(store):
    return held(store, "terrace.data")


@pytest.mark.parametrize("cmd", ["check", "stats", "recover"])
def test_a_store_another_process_writes_is_waited_for_in_the_same_words(tmp_path, cmd):
    store = tmp_path / "s"
    r = terrace("store", "fill", "--dir", store, "--count", 1, "--capacity", "4MiB")
    assert r.returncode == 0, r.stderr
    with locked_data_file(store):
        r = terrace("store", cmd, "--dir", store)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "is in use by another process" in r.stderr, r.stderr
    assert "wait for it to finish, then run the command again" in r.stderr, r.stderr
    # The library's advice (close the process; its read-only opens share the lock) is not the CLI's.
    assert "close that process" not in r.stderr and "read-only opens" not in r.stderr, r.stderr


def test_model_run_with_another_size_than_a_creation_under_way_is_told_to_wait(toy, tmp_path):
    store = tmp_path / "pc"
    stopped_creation(store / "kv", capacity="1MiB")
    with live_creator(store / "kv"):
        r = model_run(toy, store)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "which another process is creating right now with 1.0 MiB" in r.stderr, r.stderr
        assert "--store-nvme-size" in r.stderr and "wait for that process to finish" in r.stderr, r.stderr
        assert "delete" not in r.stderr and "stopped run" not in r.stderr, r.stderr
    r = model_run(toy, store)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "a stopped run left unfinished" in r.stderr and "delete that file" in r.stderr, r.stderr


# ---- the directory of model run --store ------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ["check", "stats", "recover"])
def test_a_model_run_store_directory_is_answered_with_its_stores(tmp_path, cmd):
    root = tmp_path / "pc"
    for name in ("kv", "experts"):
        (root / name).mkdir(parents=True)
    r = terrace("store", cmd, "--dir", root)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "looks like the --store directory of 'terrace model run'" in r.stderr, r.stderr
    assert f"give --dir {root / 'kv'} or --dir {root / 'experts'}" in r.stderr, r.stderr
    assert "state" not in r.stderr, r.stderr     # only the stores present


def test_a_missing_dir_names_model_run_stores_too(tmp_path):
    r = terrace("store", "check", "--dir", tmp_path / "nope")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "give the directory 'store fill' used, or one of the stores 'terrace model run --store DIR' keeps" \
        in r.stderr, r.stderr


# ---- --repair drops, and says nothing else -----------------------------------------------------------------------

def test_repair_is_never_told_the_block_it_drops_was_kept(tmp_path):
    store = tmp_path / "s"
    r = terrace("store", "fill", "--dir", store, "--count", 4, "--block-size", "16KiB", "--capacity", "16MiB")
    assert r.returncode == 0, r.stderr
    data = bytearray((store / "terrace.data").read_bytes())
    first = next(off for off in range(4096, len(data), 4096) if data[off:off + 64].strip(b"\0"))
    data[first + 8192] ^= 0x40
    (store / "terrace.data").write_bytes(bytes(data))
    r = terrace("store", "check", "--dir", store, "--repair")
    assert r.returncode == 1 and "1 corrupt blocks were dropped" in r.stdout, r.stdout + r.stderr
    corrupt = [l for l in r.stderr.splitlines() if l.startswith("corrupt ")]
    assert len(corrupt) == 1 and "kept" not in corrupt[0], r.stderr
    assert "store check --repair' drops corrupt blocks after the check" in corrupt[0], r.stderr


# ---- a store the file system cannot preallocate ------------------------------------------------------------------

def file_size_limit(limit):
    """preexec_fn: files may grow to `limit` bytes (a fuller file system); past it, fallocate fails
    with EFBIG instead of killing the process."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_fill_that_cannot_preallocate_names_capacity(tmp_path):
    r = terrace("store", "fill", "--dir", tmp_path / "s", "--count", 1, "--capacity", "32MiB",
                preexec_fn=file_size_limit(8 << 20))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "cannot preallocate" in r.stderr and "or give a smaller --capacity" in r.stderr, r.stderr
    assert "lower the capacity" not in r.stderr, r.stderr
    # EFBIG (a file size limit): free space would not help, and the advice does not say it would.
    assert "cannot be that large" in r.stderr and "free space on it" not in r.stderr, r.stderr


def test_model_run_pool_that_cannot_preallocate_names_its_size_flag(toy, tmp_path):
    r = terrace("model", "run", "--model", toy, "--tokens", TOKENS, "--max-new", 2, "--store", tmp_path / "pc",
                "--store-nvme-size", "32MiB", "--state-nvme-size", "4MiB", "--chunk-tokens", "8",
                preexec_fn=file_size_limit(8 << 20))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "cannot preallocate" in r.stderr and "or give a smaller --store-nvme-size" in r.stderr, r.stderr
    assert "lower the capacity" not in r.stderr and "--capacity" not in r.stderr, r.stderr


def test_an_expert_store_that_cannot_preallocate_asks_for_space_or_another_store(toy, tmp_path):
    r = model_run(toy, tmp_path / "pc", "--expert-cache", "25%", preexec_fn=file_size_limit(16 << 20))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "cannot preallocate" in r.stderr and "or give another --store directory" in r.stderr, r.stderr
    assert "lower the capacity" not in r.stderr and "--capacity" not in r.stderr, r.stderr


# ---- --expert-home host keeps the experts off NVMe --------------------------------------------------------------

def test_expert_home_host_with_store_makes_no_nvme_expert_store(toy, tmp_path):
    # The reference: the same prefix-cache run (same chunking) without expert offload.
    want = json.loads(model_run(toy, tmp_path / "ref", "--json").stdout)
    store = tmp_path / "pc"
    r = model_run(toy, store, "--json", "--expert-cache", "25%", "--expert-home", "host")
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout)
    assert got["logits_xxh3_64"] == want["logits_xxh3_64"]
    assert not (store / "experts").exists(), sorted(p.name for p in (store / "experts").iterdir())
    assert sorted(p.name for p in store.iterdir()) == ["kv", "state"]


def test_bench_tiers_that_cannot_preallocate_names_total_bytes(tmp_path):
    # bench tiers has no --capacity: its store is sized from --total-bytes.
    r = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--total-bytes", "16MiB", "--block-size", "1MiB",
                "--dir", tmp_path / "b", preexec_fn=file_size_limit(8 << 20))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "cannot preallocate" in r.stderr and "give a smaller --total-bytes" in r.stderr, r.stderr
    assert "--capacity" not in r.stderr and "lower the capacity" not in r.stderr, r.stderr
