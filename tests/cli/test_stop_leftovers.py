"""What a Ctrl-C (or a kill) leaves behind: a command stopped by SIGINT removes its temporaries, and
what a killed run left (its own name pattern, a process that no longer runs) is removed by the next
run instead of being left forever or blocking it. Nothing else is ever removed."""
import glob
import os
import shutil
import signal
import socket
import subprocess

import pytest

from conftest import snapshot, wait_for


def dead_pid():
    """A pid that no process has any more (a child that has exited and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def host_tag():
    """The CLI's HostTag: low 32 bits of XXH3-64 of "<host name>/<inode of /proc/self/ns/pid>", 8 hex
    digits (the `xxhash` package is the independent implementation)."""
    import xxhash
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{xxhash.xxh3_64_intdigest(f'{socket.gethostname()}/{ns}'.encode()) & 0xFFFFFFFF:08x}"


def tag(pid):
    """A process tag as the CLI puts it in its temporaries' names: <pid>.<host tag>."""
    return f"{pid}.{host_tag()}"


def wait_for_glob(pattern, proc, seconds=60):
    """The first path matching `pattern` once it exists; None if `proc` ended or `seconds` passed."""
    import time
    end = time.time() + seconds
    while time.time() < end and proc.poll() is None:
        hits = glob.glob(pattern)
        if hits:
            return hits[0]
        time.sleep(0.01)
    return None


def interrupt(p, seconds=120):
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=seconds)
    return err


# ---- output files: .terrace-tmp-<pid>-<n> -------------------------------------------------------

def test_ctrl_c_while_an_output_is_written_leaves_no_temporary(terrace, tmp_path):
    p = terrace.popen("trace", "gen", "--requests", "300000", "--seed", "1", "-o", "out.jsonl", cwd=tmp_path)
    try:
        assert wait_for_glob(str(tmp_path / ".terrace-tmp-*"), p), "trace gen wrote no temporary file"
        interrupt(p)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == -signal.SIGINT, p.returncode  # ended by the signal while it wrote
    assert sorted(os.listdir(tmp_path)) == []


def test_a_killed_writers_temporaries_are_removed_by_the_next_write(terrace, tmp_path):
    dead = dead_pid()
    leftovers = [f".terrace-tmp-{tag(dead)}-3", f".terrace-tmp-{tag(dead)}-4.tmp.{dead}"]
    for name in leftovers:
        (tmp_path / name).write_text("half a file")
    kept = {f".terrace-tmp-{tag(os.getpid())}-0": "a running process's",  # this test's own pid: it runs
            ".terrace-tmp-notes": "not the pattern", f".terrace-tmp-{tag(dead)}-x": "not the pattern",
            f".terrace-tmp-{dead}-3": "no host tag: another host's (or an older version's)",
            f".terrace-tmp-{dead}.0badc0de-3": "another host's or pid namespace's"}
    for name, text in kept.items():
        (tmp_path / name).write_text(text)
    os.mkdir(tmp_path / f".terrace-tmp-{tag(dead)}-5")  # not a regular file
    terrace("trace", "gen", "--requests", "5", "--seed", "1", "-o", "out.jsonl", cwd=tmp_path, check=True)
    for name in leftovers:
        assert not (tmp_path / name).exists(), name
    for name, text in kept.items():
        assert (tmp_path / name).read_text() == text
    assert (tmp_path / f".terrace-tmp-{tag(dead)}-5").is_dir()


@pytest.mark.skipif(shutil.which("unshare") is None or
                    subprocess.run(["unshare", "-p", "-f", "true"], capture_output=True).returncode != 0,
                    reason="needs unshare -p -f (a new pid namespace)")
def test_a_sweep_in_another_pid_namespace_keeps_a_live_writers_temporaries(terrace, tmp_path):
    # A live process of this namespace: in the new one its pid runs nothing (kill says ESRCH).
    live = subprocess.Popen(["sleep", "300"])
    try:
        mine = {f".terrace-tmp-{tag(live.pid)}-0": "a live writer's", f".terrace-tmp-{live.pid}-0": "untagged"}
        for name, text in mine.items():
            (tmp_path / name).write_text(text)
        subprocess.run(["unshare", "-p", "-f", str(terrace.path), "trace", "gen", "--requests", "5", "--seed", "1",
                        "-o", "out.jsonl"], cwd=tmp_path, check=True, capture_output=True, timeout=120)
        for name, text in mine.items():
            assert (tmp_path / name).read_text() == text, name
    finally:
        live.kill()
        live.wait()


# ---- model init: .terrace-tmp-init-<pid>/ -------------------------------------------------------

def test_model_init_after_a_killed_init_removes_its_folder_and_runs(terrace, tmp_path):
    out = tmp_path / "m"
    dead = dead_pid()
    left = out / f".terrace-tmp-init-{tag(dead)}"
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"\0" * 4096)
    (left / f"config.json.tmp.{dead}").write_text("{")
    r = terrace("model", "init", "--preset", "k3-toy", "--out", out, "--routing-tokens", "0")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_model_init_keeps_a_folder_of_that_name_with_other_files(terrace, tmp_path):
    out = tmp_path / "m"
    left = out / f".terrace-tmp-init-{tag(dead_pid())}"
    left.mkdir(parents=True)
    (left / "notes.txt").write_text("mine")
    before = snapshot(out)
    r = terrace("model", "init", "--preset", "k3-toy", "--out", out, "--routing-tokens", "0")
    assert r.returncode == 2 and "not empty" in r.stderr, r.stderr
    assert snapshot(out) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the folder to another user")
def test_model_init_keeps_another_users_leftover_folder(terrace, tmp_path):
    out = tmp_path / "m"
    left = out / f".terrace-tmp-init-{tag(dead_pid())}"
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"\0" * 4096)
    os.chown(left, 65534, 65534)
    before = snapshot(out)
    r = terrace("model", "init", "--preset", "k3-toy", "--out", out, "--routing-tokens", "0")
    assert r.returncode == 2 and "not empty" in r.stderr, r.stderr
    assert snapshot(out) == before


def test_ctrl_c_during_model_init_removes_what_it_wrote(terrace, tmp_path):
    out = tmp_path / "m"
    p = terrace.popen("model", "init", "--preset", "k3-small", "--out", out, "--routing-tokens", "0")
    try:
        assert wait_for_glob(str(out / ".terrace-tmp-init-*"), p), "model init made no private folder"
        err = interrupt(p)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 128 + signal.SIGINT, (p.returncode, err)
    assert "model init: stopped by SIGINT; removed what it had written" in err, err
    assert not out.exists(), os.listdir(out)


# ---- model run --store: a pool whose creation was interrupted ----------------------------------

def test_model_run_completes_a_pool_creation_a_kill_interrupted(terrace, toy_model, tmp_path):
    tokens = ",".join(str(i % 50 + 1) for i in range(16))
    first = tmp_path / "first"
    terrace("model", "run", "--model", toy_model, "--tokens", tokens, "--store", first, "--store-nvme-size", "16MiB",
            "--state-nvme-size", "16MiB", check=True)
    # A kill during the creation leaves terrace.data.creating, superblock first, at its full size.
    s = tmp_path / "s"
    for pool in ("kv", "state"):
        (s / pool).mkdir(parents=True)
        shutil.copyfile(first / pool / "terrace.data", s / pool / "terrace.data.creating")
    r = terrace("store", "check", "--dir", s / "kv", "--checksums-only")
    assert r.returncode != 0
    assert "terrace.data.creating" in r.stderr and "16.0 MiB" in r.stderr and "completes it" in r.stderr, r.stderr
    assert f"delete that file and the index folder {s / 'kv' / 'index'} to start anew" in r.stderr, r.stderr
    r = terrace("model", "run", "--model", toy_model, "--tokens", tokens, "--store", s, "--store-nvme-size", "32MiB")
    assert r.returncode == 2, r.stderr
    assert "--store-nvme-size 32.0 MiB" in r.stderr and "omit --store-nvme-size to complete it" in r.stderr, r.stderr
    assert f"delete that file and the folder {s / 'kv' / 'index'} to start" in r.stderr, r.stderr
    assert "capacity_bytes" not in r.stderr
    r = terrace("model", "run", "--model", toy_model, "--tokens", tokens, "--store", s)
    assert r.returncode == 0, r.stderr
    for pool in ("kv", "state"):
        assert (s / pool / "terrace.data").stat().st_size == 16 << 20
        assert not (s / pool / "terrace.data.creating").exists()


def test_model_run_starts_anew_after_an_interrupted_creations_data_file_was_deleted(terrace, toy_model, tmp_path):
    tokens = ",".join(str(i % 50 + 1) for i in range(16))
    # A kill in step 3 of a creation leaves terrace.data.creating and index/ with the creation marker
    # (docs/nvme-format.md, "Creation"); the user then deletes the data file, as the refusal advises.
    s = tmp_path / "s"
    for pool in ("kv", "state"):
        (s / pool / "index").mkdir(parents=True)
        (s / pool / "index" / "TERRACE-INDEX-CREATING.tmp").write_text("uuid")
    (s / "kv" / "index" / "TERRACE-INDEX-CREATING").write_text("uuid")
    r = terrace("model", "run", "--model", toy_model, "--tokens", tokens, "--store", s, "--store-nvme-size", "16MiB",
                "--state-nvme-size", "16MiB")
    assert r.returncode == 0, r.stderr
    assert "the index of a store creation a stopped run left unfinished" in r.stderr, r.stderr
    for pool in ("kv", "state"):
        assert (s / pool / "terrace.data").stat().st_size == 16 << 20
    # An index with anything else in it is not the creation's: refused, left as it was.
    t = tmp_path / "t"
    (t / "kv" / "index").mkdir(parents=True)
    (t / "kv" / "index" / "TERRACE-INDEX-CREATING").write_text("uuid")
    (t / "kv" / "index" / "notes.txt").write_text("mine")
    before = snapshot(t)
    r = terrace("model", "run", "--model", toy_model, "--tokens", tokens, "--store", t, "--store-nvme-size", "16MiB",
                "--state-nvme-size", "16MiB")
    assert r.returncode != 0
    assert (t / "kv" / "index" / "notes.txt").read_text() == "mine"


# ---- bench experts: its --dir ------------------------------------------------------------------

def test_bench_experts_removes_the_dir_it_created(terrace, toy_model, tmp_path):
    args = ("bench", "experts", "--model", toy_model, "--prompt", "2", "--decode", "2", "--budgets", "50%",
            "--configs", "on-demand")
    terrace(*args, cwd=tmp_path, check=True)  # default --dir ./terrace-bench-experts
    assert os.listdir(tmp_path) == []
    mine = tmp_path / "mine"
    mine.mkdir()
    terrace(*args, "--dir", mine, check=True)
    assert mine.is_dir() and os.listdir(mine) == []  # the user's folder stays


def test_bench_experts_keeps_a_user_dir_that_held_an_earlier_kept_store(terrace, toy_model, tmp_path):
    args = ("bench", "experts", "--model", toy_model, "--prompt", "2", "--decode", "2", "--budgets", "50%",
            "--configs", "on-demand")
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o750)
    terrace(*args, "--dir", mine, "--keep", check=True)
    assert os.listdir(mine) != []  # the kept store
    terrace(*args, "--dir", mine, check=True)  # removes the kept store, and only that
    assert mine.is_dir() and os.listdir(mine) == []
    assert (mine.stat().st_mode & 0o777) == 0o750


# ---- bench store / bench kv: the default --dir in $TMPDIR --------------------------------------

def test_bench_store_refuses_a_user_dir_with_an_empty_nvme_folder(terrace, tmp_path):
    d = tmp_path / "u2"
    (d / "nvme").mkdir(parents=True)
    r = terrace("bench", "store", "--dir", d, "--total-bytes", "64KiB", "--block-size", "4KiB")
    assert r.returncode == 2, r.stderr
    assert f"--dir {d} is not empty" in r.stderr, r.stderr
    assert "left behind" not in r.stderr
    assert (d / "nvme").is_dir() and os.listdir(d) == ["nvme"]



def test_bench_store_removes_the_scratch_dir_a_killed_run_left(terrace, tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    # A user's folder with the bench's name pattern, of a process that no longer runs: never removed.
    foreign = tmp / f"terrace-bench-store-{tag(dead_pid())}-0000abcd"
    (foreign / "nvme").mkdir(parents=True)
    (foreign / "nvme" / "notes.txt").write_text("mine")
    before = snapshot(foreign)
    p = terrace.popen("bench", "store", "--block-size", "64KiB", "--total-bytes", "256MiB", "--batch", "1",
                      "--repeat", "100")
    try:
        marker = wait_for_glob(str(tmp / "terrace-bench-store-*" / "nvme" / "terrace-bench-store.marker"), p)
        assert marker, "the bench did not mark its store"
    finally:
        p.kill()
        p.communicate()
    left = os.path.dirname(os.path.dirname(marker))
    assert os.path.basename(left).startswith(f"terrace-bench-store-{tag(p.pid)}-"), left
    r = terrace("bench", "store", "--total-bytes", "4MiB", "--repeat", "1", timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"left behind by an earlier run (process {p.pid})" in r.stderr, r.stderr
    assert not os.path.exists(left)
    assert snapshot(foreign) == before
    assert sorted(os.listdir(tmp)) == [foreign.name]
