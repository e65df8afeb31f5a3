"""`terrace store` end to end, driving the built binary (TERRACE_BIN).

fill/check argument handling (issue 8), check's read-only contract, lost-from-index detection and
`store recover` (issue 7), `store drill`, and `store stats` with its documented metrics.
"""
import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

BIN = os.environ.get("TERRACE_BIN")
if not BIN or not os.path.exists(BIN):
    pytest.skip("TERRACE_BIN is not set to the built terrace binary", allow_module_level=True)
SOURCE_DIR = Path(os.environ.get("TERRACE_SOURCE_DIR", Path(__file__).resolve().parents[2]))


def terrace(*args, timeout=120, stdin=subprocess.DEVNULL):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=timeout, stdin=stdin)


def fill(store, *extra, count=8, block_size="16KiB", capacity="64MiB", seed=1):
    args = ["store", "fill", "--dir", store, "--count", count, "--block-size", block_size, "--seed", seed]
    if capacity:
        args += ["--capacity", capacity]
    return terrace(*args, *extra)


def filled(tmp_path, **fill_args):
    """A store in tmp_path/s filled by `fill(**fill_args)`; returns it and its acknowledged list."""
    store = tmp_path / "s"
    r = fill(store, **fill_args)
    assert r.returncode == 0, r.stderr
    expect = tmp_path / "acked.txt"
    expect.write_text(r.stdout)
    return store, expect


def snapshot(path):
    """Every file under `path`: relative name -> (size, sha256). A read-only command must not change it."""
    out = {}
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(path))] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def durable_keys(stdout):
    return [line for line in stdout.splitlines() if line.startswith("durable ")]


def flip_byte_in_block(data_file, seed_block_bytes):
    """Flips one byte 8 KiB into the first extent whose first bytes are `seed_block_bytes` (the middle of a
    16 KiB block, whatever header its extent carries)."""
    data = bytearray(Path(data_file).read_bytes())
    at = data.find(seed_block_bytes)
    assert at >= 0, "block not found in the data file"
    data[at + 8192] ^= 0x40
    Path(data_file).write_bytes(bytes(data))


def first_block_prefix(store, tmp_path):
    """The first 64 bytes of the first 4 KiB unit past the superblock that is not zero (the first extent)."""
    data = Path(store, "terrace.data").read_bytes()
    for off in range(4096, len(data), 4096):
        chunk = data[off:off + 64]
        if chunk.strip(b"\0"):
            return chunk
    raise AssertionError("no block found")


# ---- issue 8: fill/check arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize("flag,value,range_text", [
    ("--count", "-1", "1 to "),
    ("--seed", "-1", "0 to "),
    ("--threads", "100000", "1 to 256"),
    ("--threads", "0", "1 to 256"),
    ("--count", "1e3", "1 to "),
])
def test_fill_refuses_out_of_range_numbers_with_exit_2(tmp_path, flag, value, range_text):
    args = {"--count": "4", "--seed": "1", "--threads": "2"}
    args[flag] = value
    r = terrace("store", "fill", "--dir", tmp_path / "s", "--capacity", "16MiB",
                *[x for kv in args.items() for x in kv], timeout=30)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert flag in r.stderr and range_text in r.stderr, r.stderr
    assert not (tmp_path / "s").exists(), "a refused command line must not create the store"


def test_fill_count_times_block_size_overflow_is_refused(tmp_path):
    # 2^62 blocks of 16 B wraps to 0 in 64-bit arithmetic: it must be refused, not run.
    r = terrace("store", "fill", "--dir", tmp_path / "s", "--count", str(1 << 62), "--block-size", "16",
                "--capacity", "16MiB", timeout=30)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "--count" in r.stderr and "--block-size" in r.stderr, r.stderr
    r = terrace("store", "fill", "--dir", tmp_path / "s", "--count", "100", "--block-size", "1MiB",
                "--capacity", "16MiB", timeout=30)
    assert r.returncode == 2 and "--capacity" in r.stderr, r.stderr


def test_fill_reports_every_put_failure_and_stops(tmp_path):
    store = tmp_path / "s"
    r = fill(store, count=15, block_size="1MiB", capacity="16MiB", seed=1)
    assert r.returncode == 0, r.stderr
    # Different blocks cannot fit next to the first ones: every put fails with "full".
    start = time.monotonic()
    r = fill(store, count=15, block_size="1MiB", capacity=None, seed=2)
    assert time.monotonic() - start < 60
    assert r.returncode == 1, r.stderr
    failures = [line for line in r.stderr.splitlines() if re.match(r"terrace: put of .* failed", line)]
    assert len(failures) >= 8, r.stderr          # each failure as it happens, not only the first
    assert "stopping after 8 consecutive failed puts" in r.stderr, r.stderr
    assert len(failures) < 15, r.stderr          # ... and then it stops
    assert re.search(r"store fill: no block was written; \d+ failed", r.stderr), r.stderr  # no "0 of 15 ... 0.0 MB/s"
    assert "MB/s" not in r.stderr, r.stderr


def test_fill_exits_non_zero_when_the_store_fails_to_close(tmp_path):
    store = tmp_path / "s"
    r = fill(store, "--drill-fault", "close-eio", count=3)  # only the close's fdatasync fails
    assert r.returncode == 1, r.stderr
    assert re.search(r"terrace: error: IOError: closing '[^']*terrace\.data'", r.stderr), r.stderr
    expect = tmp_path / "acked.txt"
    expect.write_text(r.stdout)
    assert len(durable_keys(r.stdout)) == 3
    r = terrace("store", "check", "--dir", store, "--expect", expect)  # what was acknowledged stays
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_index_preallocates_nothing_and_keeps_small_tables(tmp_path):
    """RocksDB's defaults preallocate ~74 MB per log and table file (fallocate), which fills a small
    file system while the store is open; the index's records are 73 bytes."""
    store, _ = filled(tmp_path, count=2)
    (options,) = (store / "index").glob("OPTIONS-*")
    text = options.read_text()
    for setting in ("allow_fallocate=false", "write_buffer_size=4194304", "target_file_size_base=4194304"):
        assert re.search(rf"^\s*{setting}$", text, re.M), setting


def test_fill_of_identical_blocks_says_nothing_was_written(tmp_path):
    store = tmp_path / "s"
    assert fill(store, count=6).returncode == 0
    r = fill(store, count=6)
    assert r.returncode == 0, r.stderr
    assert "already in the store with identical bytes" in r.stderr, r.stderr
    assert "MB/s" not in r.stderr, r.stderr      # no throughput for work not done
    assert len(durable_keys(r.stdout)) == 6       # still acknowledged: the blocks are durable


def test_fill_again_rewrites_a_listed_block_that_no_longer_reads_back(tmp_path):
    """A re-run acknowledged a block whose bytes were damaged as durable with "identical bytes": it
    compared the index's size and checksum, never the data."""
    store = tmp_path / "s"
    assert fill(store, "--threads", "1", count=6).returncode == 0
    with open(store / "terrace.data", "r+b") as f:  # inside the first block's data (extents start at 4 KiB)
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    r = fill(store, "--threads", "1", count=6)
    assert r.returncode == 0, r.stderr
    assert "1 block the store listed with identical bytes did not read back intact and was written again" in r.stderr
    assert "already in the store with identical bytes" not in r.stderr, r.stderr
    expect = tmp_path / "acked.txt"
    expect.write_text(r.stdout)
    assert len(durable_keys(r.stdout)) == 6
    c = terrace("store", "check", "--dir", store, "--expect", expect)
    assert c.returncode == 0, c.stdout + c.stderr  # every acknowledged block reads back intact


def test_capacity_is_read_from_the_store(tmp_path):
    store = tmp_path / "s"
    assert fill(store, count=4, capacity="48MiB").returncode == 0
    r = fill(store, count=8, capacity=None)                  # no --capacity: the store's own
    assert r.returncode == 0, r.stderr
    assert len(durable_keys(r.stdout)) == 8
    r = terrace("store", "check", "--dir", store, "--quick")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "8 blocks in the index" in r.stdout, r.stdout
    r = fill(store, count=4000, capacity=None)               # checked against the store's 48 MiB
    assert r.returncode == 2 and "48.0 MiB" in r.stderr, r.stderr
    r = terrace("store", "check", "--dir", store, "--capacity", "1GiB")
    assert r.returncode == 2, r.stderr
    assert "--capacity" in r.stderr and "48.0 MiB" in r.stderr, r.stderr


def test_messages_name_cli_flags_not_api_fields(tmp_path):
    for args in (["store", "check", "--dir", tmp_path / "absent"],
                 ["store", "check", "--dir", tmp_path, "--capacity", "1GiB"],
                 ["store", "stats", "--dir", tmp_path / "absent"],
                 ["store", "recover", "--dir", tmp_path / "absent"]):
        r = terrace(*args, timeout=30)
        assert r.returncode != 0
        for field in ("capacity_bytes", "create_if_missing", "index_dir", "options."):
            assert field not in r.stderr, (args, r.stderr)
        assert "--dir" in r.stderr, (args, r.stderr)


@pytest.mark.parametrize("cmd", ["check", "stats", "recover"])
def test_a_dir_that_is_a_file_is_a_usage_error(tmp_path, cmd):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    r = terrace("store", cmd, "--dir", f, timeout=30)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "--dir" in r.stderr and "directory" in r.stderr, r.stderr
    assert f.read_text() == "mine"


@pytest.mark.parametrize("kind", ["directory", "dev-zero", "fifo"])
def test_check_expect_must_be_a_regular_file(tmp_path, kind):
    store = tmp_path / "s"
    assert fill(store, count=2).returncode == 0
    if kind == "directory":
        target = tmp_path
    elif kind == "dev-zero":
        target = Path("/dev/zero")
        if not stat.S_ISCHR(os.stat(target).st_mode):
            pytest.skip("/dev/zero is not a character device on this machine")
    else:
        target = tmp_path / "fifo"
        os.mkfifo(target)
    try:
        r = terrace("store", "check", "--dir", store, "--expect", target, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"check --expect {kind} hung")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "--expect" in r.stderr and "regular file" in r.stderr, r.stderr


@pytest.mark.parametrize("cmd", ["check", "stats", "recover"])
@pytest.mark.parametrize("kind", ["regular-file", "dangling-symlink"])
def test_an_index_dir_of_the_wrong_kind_is_a_usage_error_naming_the_flag(tmp_path, cmd, kind):
    store = tmp_path / "s"
    assert fill(store, count=2).returncode == 0
    target = tmp_path / "afile"
    if kind == "regular-file":
        target.write_text("mine\n")
    else:
        target.symlink_to(tmp_path / "nowhere")
    before = snapshot(tmp_path)
    r = terrace("store", cmd, "--dir", store, "--index-dir", target, timeout=30)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("terrace: error: --index-dir "), r.stderr
    assert ("regular file" if kind == "regular-file" else "symbolic link to nothing") in r.stderr, r.stderr
    # No advice to run a command that refuses this path, no library wording.
    assert "store recover" not in r.stdout + r.stderr, r.stdout + r.stderr
    for words in ("index path", "options.", "Not a directory"):
        assert words not in r.stderr, r.stderr
    assert snapshot(tmp_path) == before


def test_an_empty_index_dir_says_what_a_cli_user_can_do(tmp_path):
    (store, expect), index = filled(tmp_path, count=4), tmp_path / "idx"
    index.mkdir()
    r = terrace("store", "check", "--dir", store, "--index-dir", index)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "reformat" not in r.stderr, r.stderr  # the library's option: the CLI has no such flag
    assert "terrace store fill" in r.stderr, r.stderr
    advice = f"terrace store recover --dir {store} --index-dir {index}"
    assert advice in r.stdout, r.stdout
    assert terrace(*advice.split()[1:]).returncode == 0  # the advice works
    r = terrace("store", "check", "--dir", store, "--index-dir", index, "--expect", expect)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_missing_index_dir_gets_advice_that_works(tmp_path):
    # A path holding an API field's name stays as given (the flag wording rewrites whole words only).
    (store, expect), index = filled(tmp_path, count=4), tmp_path / "new_index_dir"
    r = terrace("store", "check", "--dir", store, "--index-dir", index)
    assert r.returncode == 1 and "--index-dir" in r.stderr, r.stderr
    advice = f"terrace store recover --dir {store} --index-dir {index}"
    assert advice in r.stderr, r.stderr
    r = terrace(*advice.split()[1:])  # recover writes the index into the directory it was given
    assert r.returncode == 0, r.stdout + r.stderr
    verify = f"terrace store check --dir {store} --index-dir {index}"
    assert f"run '{verify}' to verify" in r.stdout, r.stdout  # the index recover wrote, not --dir's own
    r = terrace(*verify.split()[1:], "--expect", expect)
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_asks_recover_itself_whether_it_would_refuse(tmp_path):
    # Names alone look like an index (a log file), but there is no RocksDB database: recover refuses
    # it, so check must not advise running it.
    store = tmp_path / "s"
    r = fill(store, count=4, block_size="8KiB")
    assert r.returncode == 0, r.stderr
    lose_index(store)
    (store / "index").mkdir()
    (store / "index" / "000001.log").write_text("mine\n")
    r = terrace("store", "check", "--dir", store)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "would refuse" in r.stdout + r.stderr and "CURRENT" in r.stdout + r.stderr, r.stdout + r.stderr
    r = terrace("store", "recover", "--dir", store)
    assert r.returncode == 2, r.stdout + r.stderr
    assert (store / "index" / "000001.log").read_text() == "mine\n"


def damage_first_descriptor(store):
    """Flips one bit inside the key of the first descriptor past the superblock area: it no longer decodes."""
    data = store / "terrace.data"
    at = data.read_bytes().find(b"TRRCDESC", 64 * 1024)
    assert at > 0 and at % 4096 == 0
    with open(data, "r+b") as f:
        f.seek(at + 40)
        byte = f.read(1)[0]
        f.seek(at + 40)
        f.write(bytes([byte ^ 0x08]))


def test_a_damaged_descriptor_is_reported_by_check_and_kept_by_recover(tmp_path):
    store, expect = filled(tmp_path, count=8, block_size="8KiB")
    damage_first_descriptor(store)
    r = terrace("store", "check", "--dir", store, "--expect", expect)
    assert r.returncode == 0, r.stdout + r.stderr  # every block still reads back from the index
    assert "1 indexed blocks have no valid descriptor" in r.stdout, r.stdout
    r = terrace("store", "recover", "--dir", store)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 blocks whose descriptor is damaged or missing were kept from the old index" in r.stdout, r.stdout
    r = terrace("store", "check", "--dir", store, "--expect", expect)
    assert r.returncode == 0 and "ok 8" in r.stdout, r.stdout + r.stderr


def test_check_names_a_pending_commit_as_such_not_as_damage(tmp_path):
    # recover keeps a block whose descriptor is damaged as the index's pending commit (one commit ahead
    # of the superblock, with its !terrace-redo record), as a kill between a group commit's index write
    # and its descriptors leaves one: check must say the next read-write open writes its descriptors.
    store, expect = filled(tmp_path, count=8, block_size="8KiB")
    damage_first_descriptor(store)
    assert terrace("store", "recover", "--dir", store).returncode == 0
    before = snapshot(store)
    r = terrace("store", "check", "--dir", store, "--expect", expect)
    assert r.returncode == 0 and "ok 8" in r.stdout, r.stdout + r.stderr
    assert "no valid descriptor" not in r.stdout, r.stdout
    assert "1 indexed blocks belong to the index's pending group commit" in r.stdout, r.stdout
    assert "no action needed" in r.stdout, r.stdout
    assert snapshot(store) == before, "store check changed the store"
    assert fill(store, count=1, block_size="8KiB").returncode == 0  # a read-write open finishes the commit
    r = terrace("store", "check", "--dir", store, "--expect", expect)
    assert r.returncode == 0 and "ok 8" in r.stdout, r.stdout + r.stderr
    assert "pending" not in r.stdout and "no valid descriptor" not in r.stdout, r.stdout


@pytest.mark.parametrize("repair", [[], ["--repair"]])
def test_check_keeps_writers_out_between_its_scan_and_its_index(tmp_path, repair):
    # A writer started right after check's scan of the data file (check waits there at the test gate)
    # must be refused until check has read the index too; else check compares a scan and an index of
    # two moments and warns of indexed blocks with no descriptor that a quiet store does not have.
    store, expect = filled(tmp_path, count=8)
    gate = tmp_path / "gate"
    gate.write_text("")
    check = subprocess.Popen([BIN, "store", "check", "--dir", str(store), "--expect", str(expect), *repair],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, TERRACE_TEST_CHECK_GATE=str(gate)))
    try:
        scanned = tmp_path / "gate.scanned"
        for _ in range(6000):
            if scanned.exists() or check.poll() is not None:
                break
            time.sleep(0.01)
        assert scanned.exists(), "store check never reached its gate"
        w = fill(store, count=40, block_size="16KiB", seed=2)
        assert w.returncode != 0 and "in use by another process" in w.stderr, w.stdout + w.stderr
    finally:
        gate.unlink()
    out, err = check.communicate(timeout=120)
    assert check.returncode == 0, out + err
    assert "8 blocks in the index: ok 8  missing 0  corrupt 0  wrong-content 0  lost-from-index 0" in out, out
    assert "no valid descriptor" not in out, out


def test_check_never_advises_a_recover_that_would_refuse(tmp_path):
    store, expect = filled_without_index(tmp_path, count=6)
    (store / "index").mkdir()
    (store / "index" / "foo.txt").write_text("mine\n")  # recover moves aside only an index: it refuses this one
    r = terrace("store", "check", "--dir", store)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "would refuse" in r.stdout and "foo.txt" in r.stdout, r.stdout
    assert "would refuse" in r.stderr and "`terrace store recover" not in r.stderr, r.stderr
    assert terrace("store", "recover", "--dir", store).returncode == 2  # the refusal the advice foresaw (a path of the wrong kind)
    (store / "index" / "foo.txt").rename(tmp_path / "foo.txt")  # what the advice says to do
    r = terrace("store", "recover", "--dir", store)
    assert r.returncode == 0, r.stdout + r.stderr
    r = terrace("store", "check", "--dir", store, "--expect", expect)
    assert r.returncode == 0, r.stdout + r.stderr


def plant_foreign_rebuilding(store, kind):
    """A path named index.rebuilding that Terrace did not create (recover refuses it); returns it."""
    building = Path(store, "index.rebuilding")
    if kind == "regular-file":
        building.write_text("mine\n")
    else:
        building.mkdir()
        (building / "notes.txt").write_text("mine\n")
    return building


@pytest.mark.parametrize("kind", ["regular-file", "directory-of-other-files"])
def test_check_foresees_recover_refusing_a_foreign_rebuilding(tmp_path, kind):
    store, expect = filled_without_index(tmp_path, count=4)
    building = plant_foreign_rebuilding(store, kind)
    before = snapshot(tmp_path)
    r = terrace("store", "check", "--dir", store)
    assert r.returncode == 1, r.stdout + r.stderr
    assert snapshot(tmp_path) == before, "store check changed the store"
    assert "would refuse" in r.stdout and f"move '{building}' away" in r.stdout, r.stdout
    assert terrace("store", "recover", "--dir", store).returncode == 2  # the refusal the advice foresaw
    assert snapshot(tmp_path) == before
    building.rename(tmp_path / "mine")  # what the advice says to do
    r = terrace("store", "recover", "--dir", store)
    assert r.returncode == 0, r.stdout + r.stderr
    assert terrace("store", "check", "--dir", store, "--expect", expect).returncode == 0


def test_check_names_every_obstacle_to_recover_at_once(tmp_path):
    store, expect = filled_without_index(tmp_path, count=4)
    building = plant_foreign_rebuilding(store, "regular-file")
    (store / "index").mkdir()
    (store / "index" / "foo.txt").write_text("mine\n")
    before = snapshot(tmp_path)
    r = terrace("store", "check", "--dir", store)
    assert r.returncode == 1, r.stdout + r.stderr
    assert snapshot(tmp_path) == before, "store check changed the store"
    advice = f"move '{building}' away and move 'foo.txt' out of '{store / 'index'}', then run " \
             f"'terrace store recover --dir {store}'"
    assert "would refuse, for 2 reasons" in r.stdout and advice in r.stdout, r.stdout
    r = terrace("store", "recover", "--dir", store)  # recover names both reasons too
    assert r.returncode == 2 and "index.rebuilding" in r.stderr and "foo.txt" in r.stderr, r.stderr
    assert snapshot(tmp_path) == before
    building.rename(tmp_path / "mine")  # both fixes the advice named, and nothing else
    (store / "index" / "foo.txt").rename(tmp_path / "foo.txt")
    r = terrace("store", "recover", "--dir", store)
    assert r.returncode == 0, r.stdout + r.stderr
    assert terrace("store", "check", "--dir", store, "--expect", expect).returncode == 0


def test_check_names_at_most_ten_bad_blocks_of_each_kind(tmp_path):
    store, expect = filled(tmp_path, count=14, block_size="4KiB", capacity="16MiB")
    r = terrace("store", "check", "--dir", store, "--seed", "7", "--quick")
    assert r.returncode == 1 and "wrong-content 14" in r.stdout, r.stdout
    assert len([l for l in r.stderr.splitlines() if l.startswith("wrong content ")]) == 10, r.stderr
    assert "... and 4 more wrong-content blocks" in r.stderr, r.stderr
    # Damage every block: a byte of each data unit (not the descriptors, which start with their magic).
    data = bytearray((store / "terrace.data").read_bytes())
    for off in range(4096, len(data), 4096):
        unit = data[off:off + 4096]
        if unit.strip(b"\0") and not unit.startswith(b"TRRCDESC"):
            data[off + 100] ^= 0x40
    (store / "terrace.data").write_bytes(bytes(data))
    r = terrace("store", "check", "--dir", store, "--expect", expect, "--quick")
    assert r.returncode == 1 and "corrupt 14" in r.stdout, r.stdout
    lines = r.stderr.splitlines()
    assert len([l for l in lines if l.startswith("corrupt ")]) == 10, r.stderr
    assert "... and 4 more corrupt blocks" in r.stderr, r.stderr
    # Keys another seed wrote are in neither the index nor the data file: missing.
    other = fill(tmp_path / "other", count=14, block_size="4KiB", capacity="16MiB", seed=2)
    (tmp_path / "other.txt").write_text(other.stdout)
    r = terrace("store", "check", "--dir", store, "--expect", tmp_path / "other.txt", "--quick")
    assert r.returncode == 1 and "missing 14" in r.stdout, r.stdout
    assert len([l for l in r.stderr.splitlines() if l.startswith("missing ")]) == 10, r.stderr
    assert "... and 4 more missing blocks" in r.stderr, r.stderr


def test_a_corrupt_expected_block_is_counted_once_and_its_descriptor_is_not_blamed(tmp_path):
    # A bit flipped in one block's data: corrupt, not also missing (missing means neither in the index
    # nor found by the scan), and its descriptor is intact, so no "no valid descriptor" warning.
    store, expect = filled(tmp_path, count=8)
    flip_byte_in_block(store / "terrace.data", first_block_prefix(store, tmp_path))
    r = terrace("store", "check", "--dir", store, "--expect", expect)
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"ok 7  missing 0  corrupt 1  wrong-content 0  lost-from-index 0", r.stdout), r.stdout
    assert "expected blocks are missing" not in r.stdout, r.stdout
    assert "no valid descriptor" not in r.stdout, r.stdout
    assert not [l for l in r.stderr.splitlines() if l.startswith("missing ")], r.stderr
    # The per-block line names the flag that drops the block, not the library's read-write open.
    corrupt = [l for l in r.stderr.splitlines() if l.startswith("corrupt ")]
    assert len(corrupt) == 1 and "store check --repair" in corrupt[0], r.stderr
    assert "read-write" not in corrupt[0] and "read-only" not in corrupt[0], r.stderr


# ---- issue 7: check is read-only, --repair, lost-from-index, recover --------------------------------------------

def test_check_is_read_only_and_repair_drops_corrupt_blocks(tmp_path):
    store, expect = filled(tmp_path, count=8)
    before = snapshot(store)
    r = terrace("store", "check", "--dir", store, "--expect", expect)
    assert r.returncode == 0, r.stdout + r.stderr
    assert snapshot(store) == before, "store check changed the store"

    flip_byte_in_block(store / "terrace.data", first_block_prefix(store, tmp_path))
    damaged = snapshot(store)
    for _ in range(2):                     # a second run sees the same damage: nothing was dropped
        r = terrace("store", "check", "--dir", store, "--expect", expect)
        assert r.returncode == 1, r.stdout + r.stderr
        assert re.search(r"corrupt 1\b", r.stdout), r.stdout
        assert "--repair" in r.stdout, r.stdout
        assert snapshot(store) == damaged, "store check changed a damaged store"
    r = terrace("store", "check", "--dir", store, "--repair")
    assert r.returncode == 1 and "dropped" in r.stdout, r.stdout + r.stderr
    r = terrace("store", "check", "--dir", store)
    assert r.returncode == 0, r.stdout + r.stderr          # the corrupt block is gone now
    assert re.search(r"7 blocks in the index", r.stdout), r.stdout


def filled_without_index(tmp_path, count):
    """A store of `count` 8 KiB blocks whose index is then lost; returns it and its acknowledged list."""
    store, expect = filled(tmp_path, count=count, block_size="8KiB")
    lose_index(store)
    return store, expect


def lose_index(store):
    """The index is gone (a lost disk, a wrong --index-dir, an rm): the data file alone remains."""
    index = Path(store, "index")
    for p in sorted(index.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    index.rmdir()


def test_check_without_expect_reports_blocks_the_index_lost_and_recover_rebuilds(tmp_path):
    store, expect = filled_without_index(tmp_path, count=24)
    r = terrace("store", "check", "--dir", store)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out                  # never "clean" with acknowledged blocks gone from the index
    assert "store recover" in out, out
    assert "24 committed blocks" in r.stdout, out  # the scan still sees them
    r = terrace("store", "recover", "--dir", store)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"(\d+) blocks indexed", r.stdout)
    assert m and int(m.group(1)) == 24, r.stdout
    r = terrace("store", "check", "--dir", store, "--expect", expect)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "lost-from-index 0" in r.stdout, r.stdout


def fill_then_signal(store, count, capacity, sig, after=37):
    """Runs `store fill` (8 KiB blocks, 3 writers) and sends `sig` once `after` blocks were printed as
    durable (not after a sleep). Returns the ended process, every printed "durable" line and stderr."""
    p = subprocess.Popen([BIN, "store", "fill", "--dir", str(store), "--count", str(count), "--block-size", "8KiB",
                          "--capacity", capacity, "--threads", "3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    acked = []
    for line in p.stdout:
        if line.startswith("durable "):
            acked.append(line)
            if len(acked) == after:
                p.send_signal(sig)
    err = p.stderr.read()
    p.wait(timeout=60)
    return p, acked, err


def test_kill_during_fill_loses_nothing_acknowledged(tmp_path):
    """SIGKILL after a number of printed acknowledgements (not after a sleep), then check --expect."""
    store = tmp_path / "s"
    p, acked, _ = fill_then_signal(store, 2000, "64MiB", signal.SIGKILL)
    assert p.returncode == -signal.SIGKILL
    expect = tmp_path / "acked.txt"
    expect.write_text("".join(acked))
    r = terrace("store", "check", "--dir", store, "--expect", expect)
    out = r.stdout + r.stderr
    assert re.search(r"missing 0 .*corrupt 0 .*wrong-content 0", r.stdout), out
    # The only discrepancy a kill may leave: puts in flight (never acknowledged) whose data and
    # descriptor reached the disk before their index entry, at most one per writer thread.
    lost = int(re.search(r"lost-from-index (\d+)", r.stdout).group(1))
    assert lost <= 3, out
    assert r.returncode == (1 if lost else 0), out
    if lost:
        assert "store recover" in r.stdout, out
        assert terrace("store", "recover", "--dir", store).returncode == 0
        r = terrace("store", "check", "--dir", store, "--expect", expect)
        assert r.returncode == 0 and "lost-from-index 0" in r.stdout, r.stdout + r.stderr


def test_sigint_during_fill_stops_it_and_every_acknowledged_block_checks_ok(tmp_path):
    """SIGINT after a number of printed acknowledgements: the writers stop, the store closes, exit 130 with
    a 'stopped by SIGINT' line that counts the acknowledged blocks; each of them reads back intact."""
    store = tmp_path / "s"
    p, acked, err = fill_then_signal(store, 20000, "256MiB", signal.SIGINT)
    assert p.returncode == 128 + signal.SIGINT, err
    m = re.search(r"store fill: stopped by SIGINT; (\d+) of 20000 blocks acknowledged durable", err)
    assert m and int(m.group(1)) == len(acked), err
    assert len(acked) < 20000, "the fill ended before the signal"
    expect = tmp_path / "acked.txt"
    expect.write_text("".join(acked))
    r = terrace("store", "check", "--dir", store, "--expect", expect)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"ok {len(acked)}  missing 0  corrupt 0  wrong-content 0  lost-from-index 0" in r.stdout, r.stdout


# ---- store drill ---------------------------------------------------------------------------------------------------

def test_drill_short_run_passes_and_reports_every_fault(tmp_path):
    d = tmp_path / "drill"
    # No --block-size: short runs at the 64 KiB it needs, the other kinds at the 16 KiB default.
    r = terrace("store", "drill", "--dir", d, "--kills", "2", "--max-acks", "10",
                "--capacity", "32MiB", "--seed", "5", "--json", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    j = json.loads(r.stdout)
    assert j["ok"] is True
    rows = {row["fault"]: row for row in j["faults"]}
    assert set(rows) == {"eio", "enospc", "short", "bitflip", "powercut"}
    assert j["block_size"] == 16384
    assert {k: row["block_size"] for k, row in rows.items()} == {
        "eio": 16384, "enospc": 16384, "short": 65536, "bitflip": 16384, "powercut": 16384}
    for kind, row in rows.items():
        assert row["rounds"] == 2, row
        assert row["lost"] == 0 and row["corrupt_returned"] == 0, row
    assert rows["bitflip"]["kills"] >= 1 and rows["bitflip"]["faults_injected"] >= 2
    assert rows["bitflip"]["corrupt_detected"] >= 2, rows["bitflip"]   # every damaged block reported
    assert rows["short"]["faults_injected"] > 0
    assert rows["powercut"]["faults_injected"] >= 1
    assert sum(row["acknowledged"] for row in rows.values()) > 0
    assert len(re.findall(r"^drill \w+ round \d+/2", r.stderr, re.M)) == 10, r.stderr  # a progress line per round
    # Rerunning in the drill's own directory is allowed (it recognises its marker).
    r = terrace("store", "drill", "--dir", d, "--kills", "1", "--faults", "short", "--max-acks", "4",
                "--block-size", "64KiB", "--capacity", "32MiB", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "corrupt-returned" in r.stdout and "64.0 KiB" in r.stdout


def test_drill_refuses_a_block_size_short_cannot_use(tmp_path):
    """short injects only into requests longer than one 4 KiB unit: a --block-size below 64 KiB with
    short was raised to 64 KiB for it while the JSON reported the given size; now it is refused."""
    d = tmp_path / "drill"
    for faults in ("short", "eio,short"):
        r = terrace("store", "drill", "--dir", d, "--faults", faults, "--block-size", "4KiB", "--kills", "1",
                    timeout=30)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "--block-size" in r.stderr and "64KiB" in r.stderr and "short" in r.stderr, r.stderr
        assert not d.exists()


def test_drill_refuses_a_directory_it_did_not_make(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    r = terrace("store", "drill", "--dir", d, "--kills", "1", timeout=30)
    assert r.returncode == 2, r.stderr
    assert (d / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]
    r = terrace("store", "drill", "--dir", tmp_path / "x", "--faults", "eio,meteor", timeout=30)
    assert r.returncode == 2 and "meteor" in r.stderr, r.stderr


DRILL_QUICK = ("--kills", "1", "--capacity", "16MiB", "--max-acks", "4", "--block-size", "64KiB")


@pytest.mark.parametrize("plant", ["file-in-index", "damaged-index-of-mine", "folder-in-index", "data-not-a-store",
                                   "creating-not-blank"])
def test_drill_never_removes_a_user_file_inside_its_store_folders(tmp_path, plant):
    """A store folder of an earlier drill is removed only while every file in it, down into index/ and the
    index.damaged-*/ folders, is one a store writes; one foreign file refuses the run and nothing is removed."""
    d = tmp_path / "dr"
    r = terrace("store", "drill", "--dir", d, "--faults", "eio,short", *DRILL_QUICK, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    if plant == "file-in-index":
        mine = d / "eio" / "index" / "precious.txt"
        mine.write_text("precious\n")
    elif plant == "damaged-index-of-mine":
        (d / "short" / "index.damaged-mine").mkdir()
        mine = d / "short" / "index.damaged-mine" / "thesis.tex"
        mine.write_text("keep\n")
    elif plant == "folder-in-index":
        (d / "eio" / "index" / "notes").mkdir()
        mine = d / "eio" / "index" / "notes" / "todo.txt"
        mine.write_text("keep\n")
    elif plant == "creating-not-blank":
        # A terrace.data.creating is a killed creation's only while its superblock is a store's or all
        # zeros; non-zero bytes (a NUL among them, so "holds a zero byte" is not enough) make it a user's.
        mine = d / "short" / "terrace.data.creating"
        mine.write_bytes(b"my data\0with a NUL byte\n")
    else:
        mine = d / "short" / "terrace.data"
        mine.write_bytes(b"my own terrace.data, not a store\n")
    before = snapshot(d)
    r = terrace("store", "drill", "--dir", d, "--faults", "eio", *DRILL_QUICK, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    shown = {"folder-in-index": "eio/index/notes"}.get(plant, str(mine.relative_to(d)))
    assert "--dir" in r.stderr and shown in r.stderr and "nothing was removed" in r.stderr, r.stderr
    assert snapshot(d) == before  # every store file of both kinds is still there, and the user's
    assert mine.read_bytes()
    # Without it the drill's own leftovers are removed and the run goes ahead.
    if plant == "data-not-a-store":
        mine.unlink()
    else:
        mine.unlink()
        if mine.parent.name in ("index.damaged-mine", "notes"):
            mine.parent.rmdir()
    r = terrace("store", "drill", "--dir", d, "--faults", "eio", *DRILL_QUICK, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (d / "short").exists()


# ---- store stats ---------------------------------------------------------------------------------------------------

def test_stats_reports_the_store_read_only_and_every_metric_is_documented(tmp_path):
    store = tmp_path / "s"
    assert fill(store, count=5, block_size="12KiB", capacity="40MiB").returncode == 0
    before = snapshot(store)
    r = terrace("store", "stats", "--dir", store, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["blocks"] == 5 and j["used_bytes"] == 5 * 12 * 1024
    assert j["capacity_bytes"] == 40 * 1024 * 1024
    assert re.fullmatch(r"[0-9a-f-]{36}", j["uuid"]), j["uuid"]
    assert j["format_version"] >= 1
    assert isinstance(j["durability_warnings"], list)
    r = terrace("store", "stats", "--dir", store, "--prometheus")
    assert r.returncode == 0, r.stderr
    assert 'terrace_tier_blocks{tier="nvme"} 5' in r.stdout, r.stdout
    names = set(re.findall(r"^# TYPE (\w+) ", r.stdout, re.M))
    assert len(names) > 10
    doc = (SOURCE_DIR / "docs" / "operations.md").read_text()
    undocumented = sorted(n for n in names if f"`{n}`" not in doc)
    assert not undocumented, f"metrics missing from docs/operations.md: {undocumented}"
    r = terrace("store", "stats", "--dir", store)
    assert r.returncode == 0 and "store id" in r.stdout and "blocks          5" in r.stdout, r.stdout
    assert snapshot(store) == before, "store stats changed the store"
    r = terrace("store", "stats", "--dir", store, "--json", "--prometheus")
    assert r.returncode == 2


def test_stats_shows_the_space_blocks_take_so_a_full_store_reads_full(tmp_path):
    # 127 blocks of 200 B fill a 1 MiB store: each takes 4 KiB of data + a 4 KiB descriptor.
    store = tmp_path / "s"
    assert fill(store, count=127, block_size="200", capacity="1MiB").returncode == 0
    r = terrace("store", "stats", "--dir", store, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["used_bytes"] == 127 * 200  # the blocks' own bytes, as before
    assert j["allocated_bytes"] == 127 * 8192
    r = terrace("store", "stats", "--dir", store)
    assert r.returncode == 0, r.stderr
    assert re.search(r"space taken +1016\.0 KiB \(99\.2% of capacity", r.stdout), r.stdout
    assert "24.8 KiB" in r.stdout and "2.4% of capacity" not in r.stdout, r.stdout
    r = terrace("store", "stats", "--dir", store, "--prometheus")
    assert f'terrace_tier_allocated_bytes{{tier="nvme"}} {127 * 8192}' in r.stdout, r.stdout
    # The next put finds no room, and the advice is something a user can do (fill refuses another
    # --capacity for an existing store).
    r = fill(store, count=1, block_size="200", capacity=None, seed=9)
    assert r.returncode == 1, r.stderr
    assert "no free extent" in r.stderr and "raise --capacity" not in r.stderr, r.stderr
    # The CLI erases no blocks: the advice is a new store, made with a larger --capacity.
    assert "erase" not in r.stderr.lower(), r.stderr
    assert "use a new --dir directory with a larger --capacity" in r.stderr, r.stderr


def interrupted_creation(tmp_path, capacity="1MiB"):
    """A store whose creation was cut off after its superblock and preallocation (the drill's power cut
    after those two durable steps): terrace.data.creating, full size, no index yet."""
    store = tmp_path / "s"
    r = terrace("store", "fill", "--dir", store, "--count", 1, "--capacity", capacity,
                "--drill-fault", "powercut", "--drill-cut-after", 2)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in store.iterdir()) == ["terrace.data.creating"], r.stderr
    return store


def test_fill_without_capacity_completes_an_interrupted_creation(tmp_path):
    store = interrupted_creation(tmp_path, capacity="1MiB")
    r = terrace("store", "fill", "--dir", store, "--count", 2, "--block-size", "4KiB")
    assert r.returncode == 0, r.stderr
    assert not (store / "terrace.data.creating").exists()
    j = json.loads(terrace("store", "stats", "--dir", store, "--json").stdout)
    assert j["capacity_bytes"] == 1024 * 1024


@pytest.mark.parametrize("content", [b"my precious notes\n", bytes(8192)])
def test_fill_never_deletes_a_terrace_data_creating_it_cannot_prove_it_made(tmp_path, content):
    store = tmp_path / "rcd"
    store.mkdir()
    (store / "terrace.data.creating").write_bytes(content)
    (store / "other.txt").write_text("keep me\n")
    before = snapshot(store)
    r = terrace("store", "fill", "--dir", store, "--count", 1, "--capacity", "1MiB")
    assert r.returncode != 0, r.stderr
    assert "terrace.data.creating" in r.stderr and f"--dir '{store}'" in r.stderr, r.stderr
    assert snapshot(store) == before
    assert sorted(p.name for p in store.iterdir()) == ["other.txt", "terrace.data.creating"]


@pytest.mark.parametrize("how", ["symlink", "hardlink", "renamed"])
def test_fill_never_takes_a_used_stores_data_file_for_an_interrupted_creation(tmp_path, how):
    """Another store's data file under the name terrace.data.creating (a link to it, or the file moved
    there) is refused and left as it is: completing it as a creation would overwrite its blocks."""
    a, acked = filled(tmp_path, count=10, block_size="64KiB", capacity="4MiB")
    b = tmp_path / "b"
    b.mkdir()
    creating = b / "terrace.data.creating"
    if how == "symlink":
        creating.symlink_to(a / "terrace.data")
    elif how == "hardlink":
        os.link(a / "terrace.data", creating)
    else:
        (a / "terrace.data").rename(creating)
    before_a, before_b = snapshot(a), snapshot(b)
    r = fill(b, count=10, block_size="64KiB", capacity="4MiB", seed=9)
    assert r.returncode == 1, r.stderr
    assert "terrace.data.creating" in r.stderr and f"--dir '{b}'" in r.stderr, r.stderr
    assert "not an interrupted creation" in r.stderr and "left it as it is" in r.stderr, r.stderr
    assert "durable" not in r.stdout
    assert snapshot(a) == before_a and snapshot(b) == before_b
    assert sorted(p.name for p in b.iterdir()) == ["terrace.data.creating"]
    if how == "renamed":
        # The advice works: the file renamed back is the store, every acknowledged block intact.
        assert "rename it" in r.stderr and "'terrace.data'" in r.stderr, r.stderr
        creating.rename(a / "terrace.data")
    r = terrace("store", "check", "--dir", a, "--expect", acked)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_truncated_data_file_gets_advice_that_works_and_no_advice_to_delete(tmp_path):
    store, _ = filled(tmp_path, count=4, capacity="1MiB")
    data = store / "terrace.data"
    capacity = data.stat().st_size
    os.truncate(data, 40000)  # the first 16 KiB block's extent (4 KiB..24 KiB) survives
    for args in (["check"], ["recover"], ["stats"]):
        r = terrace("store", *args, "--dir", store)
        assert r.returncode == 1, (args, r.stderr)
        assert "truncated" in r.stderr and "Do not delete the store" in r.stderr, (args, r.stderr)
        assert "delete the store" not in r.stderr.replace("Do not delete the store", ""), (args, r.stderr)
        assert f"truncate -s {capacity} '{data}'" in r.stderr, (args, r.stderr)
    os.truncate(data, capacity)  # the advice
    r = terrace("store", "recover", "--dir", store)
    assert r.returncode == 0, r.stderr
    assert "rebuilt the index with 1 blocks" in r.stdout + r.stderr, r.stderr
    r = terrace("store", "check", "--dir", store)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_damaged_superblock_gets_no_advice_to_delete_the_store(tmp_path):
    store, _ = filled(tmp_path, count=2)
    with open(store / "terrace.data", "r+b") as f:
        for slot in (0, 2048):  # both slots' generation_limit
            f.seek(slot + 0x41)
            f.write(b"\x55")
    for args in (["check"], ["recover"], ["check", "--checksums-only"]):
        r = terrace("store", *args, "--dir", store)
        assert r.returncode == 1, (args, r.stderr)
        assert "superblock checksum mismatch" in r.stderr and "Do not delete the store" in r.stderr, (args, r.stderr)
        assert "to start empty" not in r.stderr and "index manifest" in r.stderr, (args, r.stderr)


def test_check_says_when_one_superblock_slot_is_damaged(tmp_path):
    store, _ = filled(tmp_path, count=2)
    data = store / "terrace.data"
    with open(data, "rb") as f:
        unit = f.read(4096)
    slot = 0 if unit[:8] == b"TRRCNVME" else 2048  # a slot Terrace wrote
    assert unit[slot:slot + 8] == b"TRRCNVME"
    with open(data, "r+b") as f:
        f.seek(slot + 0x41)
        f.write(bytes([unit[slot + 0x41] ^ 0x55]))
    before = data.read_bytes()
    r = terrace("store", "check", "--dir", store)
    assert r.returncode == 0, r.stdout + r.stderr  # the other slot serves, every block is there
    assert f"superblock slot {slot // 2048} of" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "no second copy" in r.stdout + r.stderr
    assert data.read_bytes() == before  # a check changes nothing


def test_a_store_in_use_gets_no_advice_to_recover_into_another_index(tmp_path):
    import fcntl
    store = tmp_path / "s"
    assert fill(store, count=2).returncode == 0
    with open(store / "terrace.data", "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # a writer has the store open
        for args in (["check", "--quick"], ["check"], ["stats"]):
            r = terrace("store", *args, "--dir", store, timeout=60)
            assert r.returncode == 1, (args, r.stdout, r.stderr)
            assert "in use by another process" in r.stderr, (args, r.stderr)
            assert "NEW_DIR" not in r.stdout + r.stderr and "would refuse" not in r.stdout + r.stderr, (args, r.stderr)


def recover_commands(text):
    return re.findall(r"terrace store recover --dir \S+(?: --index-dir [^`' ]+)?", text)


@pytest.mark.parametrize("building", ["", "regular-file"])
@pytest.mark.parametrize("cmd", [["check"], ["check", "--quick"], ["stats"], ["fill", "--count", "1"]])
def test_another_stores_index_gets_only_recover_advice_that_works(tmp_path, cmd, building):
    store, other = tmp_path / "s", tmp_path / "other"
    assert fill(store, count=3).returncode == 0
    assert fill(other, count=2).returncode == 0
    if building:  # in the way of a rebuild into other/index as well: moving it away alone would not do
        plant_foreign_rebuilding(other, building)
    r = terrace("store", *cmd, "--dir", store, "--index-dir", other / "index")
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout + r.stderr
    advised = recover_commands(out)
    assert advised, out
    # Every recover it names is one recover accepts: into a new directory, never into other/index.
    assert all(a.endswith("--index-dir NEW_DIR") for a in advised), advised
    assert terrace("store", "recover", "--dir", store, "--index-dir", other / "index").returncode == 2
    assert terrace("store", "recover", "--dir", store, "--index-dir", tmp_path / "new").returncode == 0
    assert terrace("store", "check", "--dir", store, "--index-dir", tmp_path / "new").returncode == 0


@pytest.mark.parametrize("case", ["dir-regular-file", "dir-dangling-symlink", "index-dir-user-folder",
                                  "index-dir-regular-file"])
def test_fill_refuses_paths_of_the_wrong_kind_naming_the_flag_and_creating_nothing(tmp_path, case):
    store, index = tmp_path / "s", None
    if case == "dir-regular-file":
        store.write_text("mine\n")
    elif case == "dir-dangling-symlink":
        store.symlink_to(tmp_path / "nowhere")
    elif case == "index-dir-user-folder":
        index = tmp_path / "idx"
        index.mkdir()
        (index / "notes").write_text("mine\n")
    else:
        index = tmp_path / "idx"
        index.write_text("mine\n")
    before = snapshot(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    args = ["store", "fill", "--dir", store, "--count", 1, "--capacity", "1MiB"]
    if index:
        args += ["--index-dir", index]
    r = terrace(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    flag = "--dir" if case.startswith("dir-") else "--index-dir"
    assert r.stderr.startswith(f"terrace: error: {flag} "), r.stderr
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == names


def test_a_fractional_size_is_refused_as_a_fraction(tmp_path):
    r = terrace("store", "fill", "--dir", tmp_path / "s", "--count", 1, "--block-size", "1.5GiB")
    assert r.returncode == 2, r.stderr
    assert "--block-size" in r.stderr and "fraction" in r.stderr and "not a size" not in r.stderr, r.stderr
    assert not (tmp_path / "s").exists()


# ---- labels and advice of a store that is not a store, and of a prefix-cache pool ---------------------------------

@pytest.mark.parametrize("cmd", ["check", "recover", "stats"])
def test_a_data_file_that_is_not_a_store_is_invalid_argument_of_exit_1(tmp_path, cmd):
    # docs/errors.md: Unavailable is hardware or a driver not present; a malformed file header is an
    # InvalidArgument, and a store that does not open is a runtime failure (exit 1), not a usage error.
    store = tmp_path / "gb"
    store.mkdir()
    (store / "terrace.data").write_bytes(bytes((i * 97 + 13) % 256 for i in range(64 * 1024)))
    r = terrace("store", cmd, "--dir", store, timeout=30)
    assert r.returncode == 1, r.stderr
    assert "InvalidArgument:" in r.stderr and "not a Terrace store" in r.stderr, r.stderr
    assert "Unavailable" not in r.stderr, r.stderr
    assert "NVMe tier" not in r.stderr, r.stderr  # "point the NVMe tier at ...": the library's words


def model_run_pool(tmp_path):
    """A prefix-cache pool directory as `model run --store` makes them: tmp_path/pc/{kv,state}."""
    model = tmp_path / "toy"
    r = terrace("model", "init", "--preset", "k3-toy", "--out", model, timeout=300)
    assert r.returncode == 0, r.stderr
    store = tmp_path / "pc"
    r = terrace("model", "run", "--model", model, "--tokens", ",".join(map(str, range(1, 9))), "--max-new", "1",
                "--store", store, "--store-nvme-size", "4MiB", "--state-nvme-size", "4MiB", "--chunk-tokens", "4",
                timeout=300)
    assert r.returncode == 0, r.stderr
    return store


@pytest.mark.parametrize("cmd", ["check", "stats"])
def test_a_pool_without_its_index_is_started_over_by_model_run_not_store_fill(tmp_path, cmd):
    store = model_run_pool(tmp_path)
    import shutil
    shutil.rmtree(store / "kv" / "index")
    r = terrace("store", cmd, "--dir", store / "kv", timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr
    # Only the folder names say it is model run's pool (model run marks nothing): the advice names
    # model run first, and never deleting a folder (it may hold the user's files, or the index kept aside).
    assert f"give 'terrace model run' a new --store directory if it made this pool with --store {store}" in err, err
    assert "delete the folder" not in err, err
    assert f"terrace store recover --dir {store / 'kv'}" in err, err
    # The index is missing, not damaged, and nothing is kept aside.
    assert "damaged index" not in err and "kept aside" not in err, err


def test_check_counts_what_the_pending_commit_erased_or_replaced_as_pending_not_lost(tmp_path):
    # A store whose last group commit was cut after its index write: it overwrote key 0, erased key 1 and
    # put key 2, and the data file still describes key 1 (and key 0's old extent). The index rightly
    # lacks key 1: check must not call it lost from the index, nor send the user to 'store recover'
    # (which cannot change it and leaves another index.damaged-* folder each time).
    fixture = Path(BIN).resolve().parents[1] / "tests" / "nvme" / "nvme_durability_test"
    if not fixture.exists():
        pytest.skip(f"{fixture} (the store fixture) is not built")
    store = tmp_path / "pend"
    made = subprocess.run([str(fixture), "nvme durability: fixture: leave a pending commit that erased and overwrote keys"],
                          env=dict(os.environ, TERRACE_TEST_STORE_DIR=str(store)), capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    before = snapshot(store)
    r = terrace("store", "check", "--dir", store, "--checksums-only")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "lost-from-index 0" in r.stdout, r.stdout
    assert "run 'terrace store recover" not in r.stdout, r.stdout
    assert "were erased or replaced by the index's pending group commit" in r.stdout, r.stdout
    assert snapshot(store) == before, "store check changed the store"


def test_a_dangling_link_named_like_the_data_file_is_refused_at_once(tmp_path):
    # Not taken for another process's store creation (the open would look again and again, then say the
    # files kept changing): a symbolic link Terrace never makes, refused naming it, and left alone.
    d = tmp_path / "dang"
    d.mkdir()
    (d / "terrace.data").symlink_to("/nonexistent")
    r = fill(d, count=1)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "kept changing" not in r.stderr, r.stderr
    assert "symbolic link" in r.stderr, r.stderr
    assert os.readlink(d / "terrace.data") == "/nonexistent"


def test_a_store_path_that_begins_with_dashes_is_no_usage_error(tmp_path):
    # A data file that is not a store is a failure of the work (exit 1, with its label), whatever the
    # path looks like: a folder named "--weird" must not read as a flag.
    d = tmp_path / "--weird"
    d.mkdir()
    (d / "terrace.data").write_bytes(b"x" * 65536)
    r = subprocess.run([BIN, "store", "check", "--dir=--weird"], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "InvalidArgument: --weird/terrace.data: not a Terrace store" in r.stderr, r.stderr


def test_a_store_whose_index_lives_elsewhere_checked_without_it_is_told_to_give_index_dir(tmp_path):
    """Checked without its --index-dir, the store was called damaged with only `store recover` advice."""
    store, idx = tmp_path / "s", tmp_path / "idx"
    assert fill(store, "--index-dir", idx, count=3).returncode == 0
    r = terrace("store", "check", "--dir", store)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "if the store keeps its index in another directory, give that one (--index-dir)" in r.stderr, r.stderr
    assert terrace("store", "check", "--dir", store, "--index-dir", idx).returncode == 0


def test_check_compares_the_index_with_the_data_files_descriptors(tmp_path):
    """Two index records swapped (each with a valid record_check) served each key the other's bytes
    as good, and `check --checksums-only` said ok."""
    helper = os.environ.get("TERRACE_SWAP_INDEX_RECORDS")
    if not helper:
        pytest.skip("TERRACE_SWAP_INDEX_RECORDS is not set (run through ctest)")
    store, _ = filled(tmp_path, count=4)
    assert subprocess.run([helper, str(store / "index")]).returncode == 0
    r = terrace("store", "check", "--dir", store, "--checksums-only")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "wrong-content 2" in r.stdout, r.stdout
    assert "its index entry describes the bytes of" in r.stderr, r.stderr
    assert "the index points 2 keys at bytes their descriptors in the data file do not describe" in r.stdout, r.stdout
    assert "terrace store recover --dir" in r.stdout, r.stdout
    rec = terrace("store", "recover", "--dir", store)
    assert rec.returncode == 0, rec.stdout + rec.stderr
    assert "lost" not in rec.stdout, rec.stdout  # the swapped records describe intact blocks: nothing is lost
    assert terrace("store", "check", "--dir", store, "--expect", tmp_path / "acked.txt").returncode == 0


@pytest.mark.parametrize("kind", ["directory", "FIFO"])
@pytest.mark.parametrize("cmd", ["check", "stats", "recover"])
def test_a_data_file_that_is_not_a_file_is_named_and_left_alone(tmp_path, kind, cmd):
    """A directory or FIFO where the data file belongs gave a bare 'cannot read the superblock ...:
    Is a directory' (or 'Illegal seek'), with no next step."""
    store = tmp_path / "s"
    store.mkdir()
    data = store / "terrace.data"
    if kind == "directory":
        data.mkdir()
    else:
        os.mkfifo(data)
    r = terrace("store", cmd, "--dir", store, timeout=30)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"is a {kind}, not a Terrace data file" in r.stderr, r.stderr
    assert "move it out of the way, or give the --dir of a Terrace store" in r.stderr, r.stderr
    assert data.is_dir() if kind == "directory" else stat.S_ISFIFO(os.lstat(data).st_mode)


def test_a_record_copied_over_another_refuses_writers_and_check_says_so(tmp_path):
    """One key's record copied over another's: a writer's open dropped one of the two overlapping
    records at random, freeing an intact block's space for the next put."""
    helper = os.environ.get("TERRACE_SWAP_INDEX_RECORDS")
    if not helper:
        pytest.skip("TERRACE_SWAP_INDEX_RECORDS is not set (run through ctest)")
    store, expect = filled(tmp_path, count=6)
    assert subprocess.run([helper, str(store / "index"), "copy"]).returncode == 0
    c = terrace("store", "check", "--dir", store, "--checksums-only")
    assert c.returncode == 1, c.stdout + c.stderr
    assert "the index holds 1 damaged records (malformed 0, out of range 0, overlapping 1" in c.stdout, c.stdout
    w = fill(store, seed=5, count=10)  # a writer: refused, nothing written over the intact block
    assert w.returncode == 1, w.stdout + w.stderr
    assert "damaged block record" in w.stderr and "terrace store recover --dir" in w.stderr, w.stderr
    assert "durable" not in w.stdout
    assert terrace("store", "recover", "--dir", store).returncode == 0
    r = terrace("store", "check", "--dir", store, "--expect", expect)
    assert r.returncode == 0, r.stdout + r.stderr  # every acknowledged block back
