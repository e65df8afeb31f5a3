"""`terrace bench tiers --warmup/--repeat`: median and spread over timed passes; memory tiers report
per-operation latency (single-operation calls), not the latency of the batch that carried an op."""
import json
import re
import resource

import pytest


def test_bench_tiers_repeat_median_spread_and_per_op_latency(terrace):
    r = terrace("bench", "tiers", "--tier", "host", "--op", "read", "--block-size", "1MiB", "--total-bytes", "64MiB",
                "--batch", "32", "--warmup", "1", "--repeat", "3", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["repeat"] == 3 and j["warmup"] == 1 and len(j["passes_mb_per_s"]) == 3
    # Progress goes to stderr with --json too (it was silent there), one line per pass.
    for line in ("bench: warm-up pass 1/1 (not timed)", "bench: timed pass 3/3"):
        assert line in r.stderr, r.stderr
    passes = sorted(j["passes_mb_per_s"])
    assert j["min_mb_per_s"] == passes[0] and j["max_mb_per_s"] == passes[-1]
    assert abs(j["mb_per_s"] - passes[1]) <= 1e-6 * passes[1]  # the median pass
    # Per-op latency: a 32-block batch of 1 MiB gets takes 32 ops' time; one op must take far less.
    per_batch_us = j["seconds"] / (j["total_bytes"] / j["block_size"] / j["batch"]) * 1e6
    assert 0 < j["p50_us"] < per_batch_us / 4, (j["p50_us"], per_batch_us)


def test_bench_tiers_even_repeat_median_is_the_mean_of_the_two_middle_passes(terrace):
    # Two timed passes: MB/s, the memcpy baseline and the ratio are each the mean of the two, not the
    # slower (or faster) one.
    r = terrace("bench", "tiers", "--tier", "host", "--op", "write", "--block-size", "1MiB", "--total-bytes", "32MiB",
                "--warmup", "1", "--repeat", "2", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    p, m = j["passes_mb_per_s"], j["memcpy_passes_mb_per_s"]
    assert len(p) == 2 and len(m) == 2
    assert j["mb_per_s"] == pytest.approx((p[0] + p[1]) / 2, rel=1e-9)
    assert j["iops"] == pytest.approx(j["mb_per_s"] * 1e6 / j["block_size"], rel=1e-9)
    assert j["memcpy_mb_per_s"] == pytest.approx((m[0] + m[1]) / 2, rel=1e-9)
    assert j["ratio_vs_memcpy"] == pytest.approx((p[0] / m[0] + p[1] / m[1]) / 2, rel=1e-9)


def test_bench_tiers_cpu_time_per_op_is_in_microseconds(terrace):
    # One thread copying 1 MiB blocks out of the host tier into buffers faulted in before the passes:
    # its user CPU time per op is that of a 1 MiB memcpy, tens of microseconds (>= 2 even at 500 GB/s),
    # and its CPU time per op is at most about the pass's wall time per op.
    r = terrace("bench", "tiers", "--tier", "host", "--op", "read", "--block-size", "1MiB", "--total-bytes", "64MiB",
                "--threads", "1", "--warmup", "1", "--repeat", "3", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    wall_us_per_op = j["seconds"] / (j["total_bytes"] / j["block_size"]) * 1e6
    assert j["user_us_per_op"] >= 2, (j["user_us_per_op"], wall_us_per_op)
    assert j["user_us_per_op"] + j["sys_us_per_op"] <= 5 * wall_us_per_op + 100, (j["user_us_per_op"], wall_us_per_op)


def test_bench_tiers_read_passes_do_not_fault_their_buffers_again(terrace):
    # The read buffers (here 32 x 1 MiB) are allocated and faulted in once, before the warm-up, as
    # the memcpy baseline's are: eight more timed passes add far fewer minor faults than the 8 x 8192
    # pages of buffers allocated afresh in every pass (half of that is the bound: a loaded machine
    # adds a few thousand faults of its own, 11k for four passes once in CI).
    def minor_faults(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        r = terrace("bench", "tiers", "--tier", "host", "--op", "read", "--block-size", "1MiB", "--total-bytes",
                    "64MiB", "--batch", "32", "--warmup", "1", "--repeat", str(repeat), "--json", timeout=300)
        assert r.returncode == 0, r.stderr
        return resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
    one, nine = minor_faults(1), minor_faults(9)
    assert nine - one < 4 * 8192, (one, nine)


def test_bench_tiers_warmup_zero_and_bad_repeat(terrace):
    r = terrace("bench", "tiers", "--tier", "host", "--op", "write", "--block-size", "1MiB", "--total-bytes", "8MiB",
                "--warmup", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["warmup"] == 0
    r = terrace("bench", "tiers", "--tier", "host", "--repeat", "0")
    assert r.returncode == 2 and "--repeat" in r.stderr


def test_bench_tiers_nvme_write_repeats_fit_the_tier(terrace, tmp_path):
    # The NVMe tier holds one copy of each block: every write pass after the first starts from an
    # emptied tier instead of overwriting (which would need room for two copies).
    d = tmp_path / "nv"
    r = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--block-size", "1MiB", "--total-bytes", "128MiB",
                "--dir", d, "--warmup", "1", "--repeat", "2", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert len(j["passes_mb_per_s"]) == 2 and all(m > 0 for m in j["passes_mb_per_s"])
    assert j["latency"] == "per-io (tier)"
    assert not d.exists()


def test_bench_tiers_host_prefault_flag(terrace):
    # --host-prefault on faults each new 256 MiB chunk in on a background thread ("faulted ahead"
    # in the detail); off leaves it to the putting thread. A bad value is a usage error (exit 2).
    for value, faulted_ahead in (("on", True), ("off", False)):
        r = terrace("bench", "tiers", "--tier", "host", "--op", "write", "--block-size", "1MiB", "--total-bytes",
                    "16MiB", "--warmup", "0", "--host-prefault", value, "--json")
        assert r.returncode == 0, r.stderr
        j = json.loads(r.stdout)
        assert ("faulted ahead" in j["detail"]) == faulted_ahead, j["detail"]
        assert j["total_bytes"] == 16 << 20
    # background / eager populate the whole capacity at open: "populating" (from open, on the
    # background thread) or "populated ... at open" (before the first put; open_seconds > 0).
    for value, note in (("background", "in the background from open"), ("eager", "at open in")):
        r = terrace("bench", "tiers", "--tier", "host", "--op", "write", "--block-size", "1MiB", "--total-bytes",
                    "16MiB", "--warmup", "0", "--host-prefault", value, "--json")
        assert r.returncode == 0, r.stderr
        j = json.loads(r.stdout)
        assert note in j["detail"], j["detail"]
        assert j["host_prefault"] == value and j["open_seconds"] > 0
    r = terrace("bench", "tiers", "--tier", "host", "--host-prefault", "maybe")
    assert r.returncode == 2 and "--host-prefault" in r.stderr
    # The flag means nothing for other tiers: refused, not ignored.
    for tier in ("nvme", "hbm"):
        r = terrace("bench", "tiers", "--tier", tier, "--host-prefault", "eager", "--total-bytes", "8MiB")
        assert r.returncode == 2 and "--host-prefault applies to --tier host only" in r.stderr, (tier, r.stderr)


def test_bench_tiers_nvme_read_reuses_a_kept_data_set(terrace, tmp_path):
    # A read run on a store kept by --keep that holds the bench's blocks reads them as they are (as
    # fio rereads its file) instead of writing them again first; one that lacks some writes them.
    import shutil
    d = tmp_path / "kept"
    args = ("bench", "tiers", "--tier", "nvme", "--op", "randread", "--block-size", "4KiB", "--dir", d, "--keep",
            "--warmup", "0", "--json")
    runs = []
    for total in ("8MiB", "8MiB", "16MiB", "16MiB"):
        r = terrace(*args, "--total-bytes", total, timeout=120)
        assert r.returncode == 0, r.stderr
        runs.append(json.loads(r.stdout))
    assert [j["prep_writes"] for j in runs] == [2048, 0, 4096, 0]
    assert all(j["iops"] > 0 for j in runs)
    assert (d / "terrace-bench-kept.marker").is_file()
    r = terrace(*args[:-1], "--total-bytes", "8MiB", timeout=120)  # the text says it reopened the store
    assert r.returncode == 0 and "tier open (reopening the kept store)" in r.stdout, r.stdout
    shutil.rmtree(d)


def _tree_digest(root):
    import hashlib
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_bench_tiers_nvme_leaves_a_store_it_did_not_create_alone(terrace, tmp_path):
    """The bench writes and erases its own blocks in the store it opens: a store `store fill` made
    (or any other without the bench's kept marker) is refused with exit 2 and left byte for byte as
    it was; so is a directory of other files."""
    user = tmp_path / "user"
    r = terrace("store", "fill", "--dir", user, "--count", "8", "--block-size", "4096", "--seed", "3",
                "--capacity", "16MiB", timeout=120)
    assert r.returncode == 0, r.stderr
    before = _tree_digest(user)
    for op in ("write", "read"):
        r = terrace("bench", "tiers", "--tier", "nvme", "--op", op, "--block-size", "4KiB", "--total-bytes", "1MiB",
                    "--dir", user, timeout=120)
        assert r.returncode == 2 and "--dir" in r.stderr and "terrace-bench-kept.marker" in r.stderr, r.stderr
        assert _tree_digest(user) == before
    r = terrace("store", "check", "--dir", user, "--seed", "3", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    r = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--block-size", "4KiB", "--total-bytes", "1MiB",
                "--dir", other, timeout=120)
    assert r.returncode == 2 and "--dir" in r.stderr and "not empty" in r.stderr, r.stderr
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def test_bench_tiers_host_stream_gets_flag(terrace):
    # --host-stream-gets: on streams every get of a 1 MiB block, off none; auto (the default) streams
    # a batch of 32 x 1 MiB buffers wherever the kernel reports a last-level cache of at most 128 MiB.
    # The detail names the mode and counts the streamed gets; bytes are verified either way.
    for value, want in (("on", "gets stream every block of at least 256 KiB ("), ("off", "gets: cached stores")):
        r = terrace("bench", "tiers", "--tier", "host", "--op", "read", "--block-size", "1MiB", "--total-bytes",
                    "16MiB", "--warmup", "0", "--host-stream-gets", value, "--json")
        assert r.returncode == 0, r.stderr
        j = json.loads(r.stdout)
        assert want in j["detail"], j["detail"]
        assert j["host_stream_gets"] == value
        if value == "on":  # at least the 16 timed gets
            assert int(re.search(r"\((\d+) streamed\)", j["detail"]).group(1)) >= 16, j["detail"]
    r = terrace("bench", "tiers", "--tier", "nvme", "--op", "read", "--block-size", "1MiB", "--total-bytes", "16MiB",
                "--host-stream-gets", "on")
    assert r.returncode == 2
    assert "--host-stream-gets applies to --tier host only" in r.stderr
    r = terrace("bench", "tiers", "--tier", "host", "--op", "read", "--host-stream-gets", "sometimes")
    assert r.returncode == 2
    assert "--host-stream-gets" in r.stderr


def test_bench_tiers_nvme_latency_covers_the_timed_passes_only(terrace, tmp_path):
    # p50 / p99 come from the tier's per-I/O histogram over the timed passes, as MB/s does: the
    # same timed pass on a kept store takes the same number of samples whatever the warm-up passes.
    d = tmp_path / "kept"
    args = ("bench", "tiers", "--tier", "nvme", "--op", "read", "--block-size", "64KiB", "--total-bytes", "4MiB",
            "--batch", "1", "--dir", d, "--keep", "--repeat", "1", "--json")
    runs = {}
    for w in ("0", "2", "0"):
        r = terrace(*args, "--warmup", w, timeout=120)
        assert r.returncode == 0, r.stderr
        runs.setdefault(w, []).append(json.loads(r.stdout))
    samples = {w: [j["latency_samples"] for j in js] for w, js in runs.items()}
    # One 64 KiB request per block (--batch 1: no adjacent blocks merged).
    assert samples == {"0": [64, 64], "2": [64]}, samples
    assert all(j["p50_us"] > 0 for js in runs.values() for j in js)


def test_bench_tiers_memory_latency_samples_are_the_single_operation_calls(terrace):
    r = terrace("bench", "tiers", "--tier", "host", "--op", "read", "--block-size", "4KiB", "--total-bytes", "64KiB",
                "--warmup", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["latency_samples"] == 16
