"""The prefix cache's pools in the words of the command that opens them (`model run --store`,
`bench kv --dir`): size flags that cannot work are usage errors naming the flag and the largest size
accepted; pool-open failures keep their label, exit 1 and give remedies the CLI offers; a full pool
gives one summary line, not a warning per block.

Run by ctest with TERRACE_BIN pointing at the terrace binary.
"""
import os
import re
import subprocess

import pytest

BIN = os.environ.get("TERRACE_BIN")
if not BIN or not os.path.exists(BIN):
    pytest.skip("TERRACE_BIN is not set to the terrace binary", allow_module_level=True)

SMALL_POOLS = ("--store-nvme-size", "4MiB", "--state-nvme-size", "4MiB")
# Words of the library's API and remedies the CLI does not offer.
LIBRARY_WORDS = ("capacity_bytes", "chunk_bytes", "hbm.mode", "kOff", "options.", "NVMe tier", "--index-dir",
                 "reformat", "open it read-write", "erase blocks", "Erase or unpin")


@pytest.fixture(scope="module")
def toy(make_model):
    return make_model("k3-toy", seed=3)


def model_run(toy, store, *flags, tokens="1,2,3,4,5,6,7,8"):
    if "--chunk-tokens" not in flags:
        flags = ("--chunk-tokens", "4", *flags)
    return subprocess.run([BIN, "model", "run", "--model", str(toy), "--store", str(store), "--tokens", tokens,
                           "--max-new", "1", *flags],
                          capture_output=True, text=True, timeout=300)


def assert_cli_words(err):
    for word in LIBRARY_WORDS:
        assert word not in err, (word, err)


@pytest.mark.parametrize("flag,value,largest", [
    ("--store-hbm-size", "16000000TiB", "16.0 TiB"),
    ("--store-host-size", "100TiB", "16.0 TiB"),
    ("--state-host-size", "100TiB", "16.0 TiB"),
])
def test_model_run_refuses_a_tier_size_that_cannot_work_as_a_usage_error(toy, tmp_path, flag, value, largest):
    store = tmp_path / "hb"
    r = model_run(toy, store, *SMALL_POOLS, flag, value)
    assert r.returncode == 2, r.stderr
    assert flag in r.stderr and "out of range" in r.stderr and largest in r.stderr, r.stderr
    assert "IOError" not in r.stderr, r.stderr
    assert_cli_words(r.stderr)
    assert not store.exists()  # refused before anything was created


def test_bench_kv_refuses_a_host_size_that_cannot_work_as_a_usage_error(toy, tmp_path):
    r = subprocess.run([BIN, "bench", "kv", "--model", str(toy), "--dir", str(tmp_path / "b"), "--prefix-tokens",
                        "8", "--turns", "0", *SMALL_POOLS, "--store-host-size", "100TiB"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "--store-host-size" in r.stderr and "out of range" in r.stderr, r.stderr
    assert_cli_words(r.stderr)


def test_the_largest_host_size_accepted_opens(toy, tmp_path):
    # The limit printed is true: the largest value the flag accepts opens the pool (its memory is
    # mapped only as blocks arrive).
    r = model_run(toy, tmp_path / "big", *SMALL_POOLS, "--store-host-size", "100TiB")
    largest = re.search(r"to [0-9.]+ TiB \((\d+) bytes\)", r.stderr).group(1)
    r = model_run(toy, tmp_path / "big", *SMALL_POOLS, "--store-host-size", largest, "--store-hbm-size", "1MiB")
    assert r.returncode == 0, r.stderr


def test_a_data_file_that_is_not_a_store_is_a_runtime_failure_in_cli_words(toy, tmp_path):
    store = tmp_path / "gb"
    (store / "kv").mkdir(parents=True)
    (store / "kv" / "terrace.data").write_bytes(bytes((i * 97 + 13) % 256 for i in range(64 * 1024)))
    r = model_run(toy, store)
    assert r.returncode == 1, r.stderr
    assert "InvalidArgument:" in r.stderr and "IOError" not in r.stderr, r.stderr  # the label is the library's
    assert f"--store: opening the pool in {store / 'kv'}" in r.stderr, r.stderr
    assert "give a new --store directory" in r.stderr, r.stderr
    assert_cli_words(r.stderr)


def test_a_pool_folder_of_other_files_gets_a_remedy_the_cli_offers(toy, tmp_path):
    store = tmp_path / "of"
    (store / "kv").mkdir(parents=True)
    (store / "kv" / "notes.txt").write_text("mine\n")
    r = model_run(toy, store)
    assert r.returncode == 1, r.stderr
    assert "give a new --store directory" in r.stderr, r.stderr
    assert_cli_words(r.stderr)


def test_a_stray_creation_file_is_named_as_the_pools(toy, tmp_path):
    store = tmp_path / "cr"
    (store / "kv").mkdir(parents=True)
    (store / "kv" / "terrace.data.creating").write_bytes(b"not terrace" * 100)
    r = model_run(toy, store)
    assert r.returncode == 1, r.stderr
    assert f"the pool '{store / 'kv'}' holds 'terrace.data.creating'" in r.stderr, r.stderr
    assert_cli_words(r.stderr)


def test_a_full_pool_gives_one_summary_line_not_a_warning_per_block(toy, tmp_path):
    r = model_run(toy, tmp_path / "pcf", "--store-nvme-size", "1MiB", "--state-nvme-size", "1MiB",
                  "--store-host-size", "1MiB", "--state-host-size", "1MiB", "--store-hbm-size", "1MiB",
                  "--chunk-tokens", "2", tokens=",".join(str(i) for i in range(1, 65)))
    assert r.returncode == 0, r.stderr  # the cache is best effort: the run itself succeeded
    failed = int(re.search(r"(\d+) write failure", r.stdout).group(1))
    assert failed > 2, r.stdout  # enough failures that one warning each would flood stderr
    warnings = [l for l in r.stderr.splitlines() if "write-back of" in l]
    assert len(warnings) == 1, r.stderr
    summary = [l for l in r.stderr.splitlines() if "block write(s) failed" in l]
    assert len(summary) == 1 and summary[0].startswith(f"terrace model run: warning: prefix cache: {failed} "), r.stderr
    assert "a new --store directory" in summary[0], summary
    assert "--store-nvme-size" in summary[0] and "--state-nvme-size" in summary[0], summary
    # The one logged failure too: no API names or remedies the CLI lacks ("NVMe tier at '<file>'" only
    # says where).
    for word in LIBRARY_WORDS:
        if word != "NVMe tier":
            assert word not in r.stderr, (word, r.stderr)
    assert "PrefixCacheStats" not in r.stderr, r.stderr
    assert r.stderr.isprintable() or all(c.isprintable() or c == "\n" for c in r.stderr), r.stderr
