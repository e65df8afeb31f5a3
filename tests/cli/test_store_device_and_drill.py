"""`terrace store drill` fails when it tested nothing; `terrace bench tiers` removes what it made in
an empty --dir / --index-dir the user already had (keeping the folders), and leaves a block device
holding a Terrace store alone (loop device: root and losetup only)."""
import json
import os
import shutil
import subprocess

import pytest

BENCH = ("bench", "tiers", "--tier", "nvme", "--block-size", "64KiB", "--total-bytes", "4MiB")


def test_drill_refuses_a_capacity_that_holds_too_few_blocks(terrace, tmp_path):
    r = terrace("store", "drill", "--dir", tmp_path / "d", "--block-size", "16MiB", "--capacity", "16MiB",
                "--kills", "1")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "--capacity 16.0 MiB holds fewer than 8 blocks of 16.0 MiB" in r.stderr
    assert "raise --capacity or lower --block-size" in r.stderr


def test_drill_that_acknowledged_nothing_fails(terrace, tmp_path):
    # Every child fails to preallocate its store past RLIMIT_FSIZE: no round writes anything.
    def limit():
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    d = tmp_path / "d"
    r = terrace("store", "drill", "--dir", d, "--capacity", "64MiB", "--kills", "2", "--faults", "eio", "--json",
                preexec_fn=limit)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    j = json.loads(r.stdout)
    assert j["ok"] is False
    row = j["faults"][0]
    assert row["acknowledged"] == 0 and row["tested_nothing"] is True
    assert any("nothing was checked" in p for p in row["problems"]), row["problems"]
    assert any("made no store" in p and "eio.log" in p for p in row["problems"]), row["problems"]


def test_bench_tiers_empties_an_existing_empty_dir_and_keeps_it(terrace, tmp_path):
    d, idx = tmp_path / "d", tmp_path / "idx"
    d.mkdir()
    for _ in range(2):  # the second run finds the folder as the user left it: empty
        terrace(*BENCH, "--dir", d, check=True)
        assert d.is_dir() and os.listdir(d) == []
    idx.mkdir()
    terrace(*BENCH, "--dir", tmp_path / "new", "--index-dir", idx, check=True)
    assert idx.is_dir() and os.listdir(idx) == []
    assert not (tmp_path / "new").exists()  # the folder the run made goes whole


def _loop_device(tmp_path, size):
    if os.geteuid() != 0 or shutil.which("losetup") is None or not os.path.exists("/dev/loop-control"):
        pytest.skip("needs root and losetup for a loop device")
    img = tmp_path / "dev.img"
    with open(img, "wb") as f:
        f.truncate(size)
    r = subprocess.run(["losetup", "--find", "--show", str(img)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"losetup failed: {r.stderr.strip()}")
    return r.stdout.strip()


def test_bench_tiers_leaves_a_device_holding_a_terrace_store_alone(terrace, tmp_path):
    dev = _loop_device(tmp_path, 80 << 20)
    try:
        terrace("store", "fill", "--dir", dev, "--index-dir", tmp_path / "fidx", "--count", "3", "--capacity",
                "80MiB", check=True)
        before = open(tmp_path / "dev.img", "rb").read()
        r = terrace(*BENCH, "--dir", dev, "--index-dir", tmp_path / "bidx")
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert "is a block device that holds a Terrace store" in r.stderr
        assert open(tmp_path / "dev.img", "rb").read() == before
        check = terrace("store", "check", "--dir", dev, "--index-dir", tmp_path / "fidx")
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        subprocess.run(["losetup", "-d", dev])


def test_store_fill_never_formats_a_device_with_a_file_system_past_its_first_4k(terrace, tmp_path):
    dev = _loop_device(tmp_path, 80 << 20)
    try:
        with open(dev, "r+b") as f:  # btrfs keeps its superblock magic at 64 KiB + 64
            f.seek(64 * 1024 + 64)
            f.write(b"_BHRfS_M")
            f.flush()
            os.fsync(f.fileno())
        before = open(tmp_path / "dev.img", "rb").read()
        r = terrace("store", "fill", "--dir", dev, "--index-dir", tmp_path / "fidx", "--count", "3", "--capacity",
                    "80MiB")
        assert r.returncode != 0, r.stderr
        assert "is not blank" in r.stderr and "65600" in r.stderr, r.stderr
        assert open(tmp_path / "dev.img", "rb").read() == before
    finally:
        subprocess.run(["losetup", "-d", dev])


def test_drill_names_a_symlink_dir_as_one(terrace, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    r = terrace("store", "drill", "--dir", tmp_path / "link", "--kills", "1")
    assert r.returncode == 2, r.stderr
    assert "is a symbolic link; give the directory itself" in r.stderr
    assert os.listdir(tmp_path / "real") == []


def test_fill_whose_store_creation_fails_removes_the_dir_it_made(terrace, tmp_path):
    def limit():
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    d = tmp_path / "new" / "store"
    r = terrace("store", "fill", "--dir", d, "--count", "1", "--capacity", "64MiB", preexec_fn=limit)
    assert r.returncode == 1, r.stderr
    assert "preallocate" in r.stderr
    assert not d.exists(), os.listdir(d)
    # A folder the user had stays, empty.
    mine = tmp_path / "mine"
    mine.mkdir()
    r = terrace("store", "fill", "--dir", mine, "--count", "1", "--capacity", "64MiB", preexec_fn=limit)
    assert r.returncode == 1 and mine.is_dir() and os.listdir(mine) == []


def test_fill_block_size_over_capacity_says_what_to_change(terrace, tmp_path):
    r = terrace("store", "fill", "--dir", tmp_path / "s", "--count", "1", "--block-size", "16MiB", "--capacity",
                "16MiB")
    assert r.returncode == 2, r.stderr
    assert "lower --block-size, or raise --capacity for a new store" in r.stderr


def test_trace_gen_counts_one_request_in_the_singular(terrace, tmp_path):
    r = terrace("trace", "gen", "--requests", "1", "--turns", "1", "-o", tmp_path / "t.jsonl")
    assert r.returncode == 0, r.stderr
    assert ": 1 request, " in r.stdout, r.stdout


def test_bench_tiers_on_a_blank_device_clears_it_again_so_the_next_run_works(terrace, tmp_path):
    dev = _loop_device(tmp_path, 80 << 20)
    try:
        idx = tmp_path / "idx"
        for _ in range(2):
            r = terrace(*BENCH, "--dir", dev, "--index-dir", idx)
            assert r.returncode == 0, r.stderr
            assert not idx.exists()  # the index the run made went with the store
            img = open(tmp_path / "dev.img", "rb").read()
            assert img[:1 << 20] == bytes(1 << 20) and img[-(1 << 20):] == bytes(1 << 20)  # blank again
    finally:
        subprocess.run(["losetup", "-d", dev])


def test_bench_tiers_never_clears_a_device_it_did_not_format(terrace, tmp_path):
    dev = _loop_device(tmp_path, 80 << 20)
    try:
        with open(dev, "r+b") as f:
            f.seek(64 * 1024 + 64)
            f.write(b"_BHRfS_M")
            f.flush()
            os.fsync(f.fileno())
        before = open(tmp_path / "dev.img", "rb").read()
        r = terrace(*BENCH, "--dir", dev, "--index-dir", tmp_path / "idx")
        assert r.returncode != 0, r.stderr
        assert "not blank" in r.stderr, r.stderr
        assert open(tmp_path / "dev.img", "rb").read() == before
    finally:
        subprocess.run(["losetup", "-d", dev])
