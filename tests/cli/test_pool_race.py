"""`terrace model run --store DIR` when another process uses DIR's pools at the same moment.

The races are made deterministic by holding the pool's lock from the test, the way the NVMe tier
holds it (flock on the pool's terrace.data, or on terrace.data.creating while it is created): the run
waits for it (up to 2 s), and while it waits the test changes the pool under it.
"""
import fcntl
import os
import shutil
import time
from contextlib import contextmanager

# Small pools and tiers: every run here creates its pools.
TIERS = ("--store-host-size", "1MiB", "--state-host-size", "1MiB", "--store-hbm-size", "1MiB", "--kv-codec", "f32",
         "--chunk-tokens", "64")
MIB = 1 << 20


def model_run(terrace, toy_model, store, *flags):
    return terrace.popen("model", "run", "--model", toy_model, "--tokens", "1,2,3,4,5", "--json", "--store", store,
                         *TIERS, *flags)


def make_pools(terrace, toy_model, store, *flags):
    p = model_run(terrace, toy_model, store, *flags)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err


def opened_for_writing(pid, path):
    """True when process `pid` has `path` open read-write (the tier's open; a size check reads it read-only)."""
    target = os.path.realpath(path)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != target:
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                flags = next(int(line.split()[1], 8) for line in info if line.startswith("flags:"))
        except (OSError, StopIteration):
            continue
        if flags & os.O_ACCMODE == os.O_RDWR:
            return True
    return False


@contextmanager
def locked(path, mode=fcntl.LOCK_EX):
    """Holds the tier's lock (flock) on `path` for the with-block."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def wait_until_waiting(proc, path):
    """Returns once `proc` opened `path` to lock it (it then waits for the lock the test holds)."""
    end = time.time() + 120
    while not opened_for_writing(proc.pid, path):
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before it opened {path}: {proc.stderr.read()}"
        assert time.time() < end, f"the run never opened {path}"
        time.sleep(0.005)


def finish(proc):
    out, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_state_size_flag_refused_when_the_pool_appears_while_the_run_waits(terrace, toy_model, tmp_path):
    # The run checks --state-nvme-size while DIR/state does not exist, then waits for DIR/kv's lock;
    # meanwhile another process's 8 MiB state pool appears. It ran on that pool, exit 0, before.
    store, other = tmp_path / "st", tmp_path / "other"
    make_pools(terrace, toy_model, store, "--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB")
    make_pools(terrace, toy_model, other, "--store-nvme-size", "16MiB", "--state-nvme-size", "8MiB")
    shutil.rmtree(store / "state")
    with locked(store / "kv" / "terrace.data"):
        proc = model_run(terrace, toy_model, store, "--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB")
        wait_until_waiting(proc, store / "kv" / "terrace.data")
        os.rename(other / "state", store / "state")
    rc, err = finish(proc)
    assert rc == 2, err
    assert (f"--state-nvme-size 16.0 MiB (16777216 bytes) does not match the pool in {store / 'state'}, which was "
            "created with 8.0 MiB (8388608 bytes)") in err
    assert os.path.getsize(store / "state" / "terrace.data") == 8 * MIB


def move_pool(src, dst):
    os.rename(src / "terrace.data", dst / "terrace.data")
    os.rename(src / "index", dst / "index")


def run_while_an_8mib_kv_pool_is_created(terrace, toy_model, tmp_path, *flags):
    """Runs `model run --store tmp_path/st *flags` while another process (the test) holds
    st/kv/terrace.data.creating locked, and finishes that creation with an 8 MiB pool once the run
    waits for it. Returns the run's exit code and stderr."""
    store, other = tmp_path / "st", tmp_path / "other"
    make_pools(terrace, toy_model, other, "--store-nvme-size", "8MiB", "--state-nvme-size", "16MiB")
    (store / "kv").mkdir(parents=True)
    creating = store / "kv" / "terrace.data.creating"
    creating.touch()
    with locked(creating):
        proc = model_run(terrace, toy_model, store, *flags, "--state-nvme-size", "16MiB")
        wait_until_waiting(proc, creating)
        move_pool(other / "kv", store / "kv")
        creating.unlink()
    return finish(proc)


def test_store_size_flag_refused_in_cli_words_when_the_pool_is_created_while_the_run_waits(terrace, toy_model,
                                                                                          tmp_path):
    # Another process is creating DIR/kv (it holds terrace.data.creating locked) and finishes it with
    # 8 MiB. The run was refused with exit 1 and the library's "was created with --store-nvme-size
    # 8388608 but the options ask for 16777216" before.
    store = tmp_path / "st"
    rc, err = run_while_an_8mib_kv_pool_is_created(terrace, toy_model, tmp_path, "--store-nvme-size", "16MiB")
    assert rc == 2, err
    assert (f"--store-nvme-size 16.0 MiB (16777216 bytes) does not match the pool in {store / 'kv'}, which was "
            "created with 8.0 MiB (8388608 bytes)") in err
    assert "options ask for" not in err
    assert os.path.getsize(store / "kv" / "terrace.data") == 8 * MIB


def test_pool_created_while_the_run_waits_keeps_its_size_without_the_flag(terrace, toy_model, tmp_path):
    # Without --store-nvme-size the pool's own size is used, whoever created it. The run asked the
    # tier for the default 1 GiB and was refused with exit 1 before.
    store = tmp_path / "st"
    rc, err = run_while_an_8mib_kv_pool_is_created(terrace, toy_model, tmp_path)
    assert rc == 0, err
    assert os.path.getsize(store / "kv" / "terrace.data") == 8 * MIB


def test_store_in_use_names_the_holder_and_the_store_flag(terrace, toy_model, tmp_path):
    store = tmp_path / "st"
    make_pools(terrace, toy_model, store, "--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB")
    with locked(store / "kv" / "terrace.data"):
        rc, err = finish(model_run(terrace, toy_model, store, "--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB"))
    assert rc == 1, err
    assert (f"--store: another process (pid {os.getpid()}) is using this --store directory (its pool "
            f"{store / 'kv'} stayed locked for the 2 s this run waited); wait for it to finish or give another --store "
            "directory") in err
    assert "its NVMe size is" not in err and "close that process" not in err


def test_store_command_in_use_names_the_holder(terrace, toy_model, tmp_path):
    # `store recover` scans the data file under an exclusive lock (tiers/nvme/data_scan.cpp).
    store = tmp_path / "st"
    make_pools(terrace, toy_model, store, "--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB")
    with locked(store / "kv" / "terrace.data", fcntl.LOCK_SH):
        r = terrace("store", "recover", "--dir", store / "kv")
    assert r.returncode == 1, r.stderr
    assert f"is in use by another process (pid {os.getpid()})" in r.stderr


def test_store_check_of_a_pool_in_use_names_the_holder_and_says_to_wait(terrace, toy_model, tmp_path):
    # `store check` reads under a shared lock: a writer's exclusive one keeps it out.
    store = tmp_path / "st"
    make_pools(terrace, toy_model, store, "--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB")
    with locked(store / "kv" / "terrace.data"):
        r = terrace("store", "check", "--dir", store / "kv")
    assert r.returncode == 1, r.stderr
    assert f"is in use by another process (pid {os.getpid()})" in r.stderr
    assert "wait for it to finish, then run the command again" in r.stderr and "close that process" not in r.stderr


def test_expert_store_in_use_names_the_holder_and_the_store_flag(terrace, toy_model, tmp_path):
    store = tmp_path / "st"
    experts = ("--expert-cache", "50%", "--expert-home", "nvme")
    make_pools(terrace, toy_model, store, "--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB", *experts)
    with locked(store / "experts" / "terrace.data"):
        rc, err = finish(model_run(terrace, toy_model, store, *experts))
    assert rc == 1, err
    assert (f"--store: another process (pid {os.getpid()}) is using this --store directory (its expert store "
            f"{store / 'experts'} stayed locked") in err
    assert "close that process" not in err and "read-only opens" not in err
