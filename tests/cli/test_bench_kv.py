"""`terrace bench kv`'s tier figures, bytes per token per codec and multi-turn workload, and
`terrace verify kv`'s progress, on k3-toy with 32-token chunks (seconds per test)."""
import json
import os
import pathlib
import tempfile

import pytest

# Small NVMe pools: the defaults (1 GiB + 256 MiB) would be fallocated for every run.
SMALL_POOLS = ("--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB")
CHUNK = 32
TIERS = ("hbm", "host", "nvme")
# Every codec a KvLayout takes, by nominal bytes per value: 4, 2, 2, 1, 1, 1, 0.5, 0.5.
CODECS = {"f32": 4, "bf16": 2, "f16": 2, "fp8": 1, "fp8-block": 1, "int8": 1, "int4-g32": 0.5, "int4-g64": 0.5}


def bench(terrace, tmp_path, *flags):
    if "--chunk-tokens" not in flags:
        flags = ("--chunk-tokens", CHUNK, *flags)
    r = terrace("bench", "kv", "--dir", tmp_path / "b", *SMALL_POOLS, *flags, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "b").exists()  # the bench removed what it created
    return r


def bench_json(terrace, toy_model, tmp_path, *flags):
    return json.loads(bench(terrace, tmp_path, "--model", toy_model, "--json", *flags).stdout)


def check_tier_shares(row):
    """Shares in [0, 1], summing to at most 1, and to exactly 1 when every requested block was
    served (the blocks per tier add up to the requests)."""
    rates = row["hit_rate_by_tier"]
    assert set(rates) == set(TIERS)
    assert all(0.0 <= rates[t] <= 1.0 for t in TIERS), rates
    assert sum(rates.values()) <= 1.0 + 1e-12, rates
    blocks = row["blocks_read_by_tier"]
    assert sum(blocks.values()) <= row["blocks_requested"]
    for t in TIERS:
        want = blocks[t] / row["blocks_requested"] if row["blocks_requested"] else 0.0
        assert rates[t] == pytest.approx(want), t
    if row["blocks_requested"] and sum(blocks.values()) == row["blocks_requested"]:
        assert sum(rates.values()) == pytest.approx(1.0)
    # A tier that served no block read no bytes, and one that served blocks read some.
    for t in TIERS:
        assert (blocks[t] > 0) == (row["bytes_read_by_tier"][t] > 0), t


def test_rows_say_the_nvme_tier_served_every_block(terrace, toy_model, tmp_path):
    j = bench_json(terrace, toy_model, tmp_path, "--prefix-tokens", "64,96", "--kv-codec", "f32", "--turns", "0")
    assert "multi_turn" not in j  # --turns 0: no multi-turn workload
    for r in j["rows"]:
        check_tier_shares(r)
        # The pools were reopened before turn 2: every block of the restore came from NVMe.
        assert r["hit_rate_by_tier"]["nvme"] == 1.0
        assert r["blocks_read_by_tier"]["nvme"] == r["blocks_requested"] > r["prefix_tokens"] // CHUNK
        # One round: the store's bytes per tier are the restore's own report of them.
        assert r["bytes_read_by_tier"] == r["bytes_read"]
        # Turn 1 wrote every block through to NVMe once (write-through from the host tier).
        assert r["bytes_written_by_tier"]["nvme"] == r["bytes_written"] > 0
        assert r["bytes_written_by_tier"]["host"] > 0
    # The run's totals are the rows' sums.
    check_tier_shares(j)
    for k in ("blocks_requested",):
        assert j[k] == sum(r[k] for r in j["rows"])
    for t in TIERS:
        assert j["bytes_written_by_tier"][t] == sum(r["bytes_written_by_tier"][t] for r in j["rows"])
    assert j["hit_rate_by_tier"]["nvme"] == 1.0


def test_recompute_threshold_changes_only_how_the_recompute_is_timed(terrace, toy_model, tmp_path):
    # Prefix 32: the 64-token turn-2 prompt has a full chunk the prefix lacks. Prefix 48: the 80-token
    # prompt's last full chunk (the one --snapshot-every 0 snapshots) is past the prefix. Turn 1 stores
    # the prefix's blocks alone whether it computes the prefix (threshold 4096) or the whole prompt (10).
    # (A prefix under one chunk is refused: test_a_prefix_shorter_than_a_chunk_is_refused.)
    flags = ("--prefix-tokens", "32,48", "--snapshot-every", "0", "--kv-codec", "f32", "--turns", "0")
    low = bench_json(terrace, toy_model, tmp_path, *flags, "--recompute-max-tokens", "10")
    high = bench_json(terrace, toy_model, tmp_path, *flags, "--recompute-max-tokens", "4096")
    for lo, hi in zip(low["rows"], high["rows"]):
        assert lo["recompute_in_turn1"] and not hi["recompute_in_turn1"]
        assert lo["restored_tokens"] == hi["restored_tokens"] == lo["prefix_tokens"] // CHUNK * CHUNK
        for k in ("bytes_written", "bytes_written_by_tier", "kv_bytes", "state_bytes", "bytes_read"):
            assert lo[k] == hi[k], k
        assert lo["logits_max_rel_err_vs_recompute"] == 0.0  # f32: the recompute of turn 1 matches bitwise


def test_blocks_count_each_block_once_whatever_the_read_order(terrace, toy_model, tmp_path):
    config = json.loads((toy_model / "config.json").read_text())["linear_attn_config"]
    mla, kda = len(config["full_attn_layers"]), len(config["kda_layers"])
    flags = ("--prefix-tokens", "64,96", "--kv-codec", "f32", "--turns", "2", "--conversations", "2", "--system-tokens",
             "80", "--user-tokens", "40")
    by_order = {o: bench_json(terrace, toy_model, tmp_path, *flags, "--read-order", o) for o in ("layers", "chunks")}
    layers, chunks = by_order["layers"], by_order["chunks"]
    for lr, cr in zip(layers["rows"], chunks["rows"]):
        assert lr["read_by_layer"] and not cr["read_by_layer"]
        # Each KV chunk of the prefix and each KDA layer's snapshot at its last chunk: one block each.
        k = lr["prefix_tokens"] // CHUNK
        for r in (lr, cr):
            assert r["blocks_requested"] == r["blocks_read_by_tier"]["nvme"] == k + kda
        # Read by layer, each KV chunk is one sub-range read per MLA layer.
        assert lr["range_reads_by_tier"] == {"hbm": 0, "host": 0, "nvme": k * mla}
        assert cr["range_reads_by_tier"] == {"hbm": 0, "host": 0, "nvme": 0}
    for k in ("blocks_requested", "blocks_read_by_tier"):
        assert layers[k] == chunks[k], k
        assert layers["multi_turn"][k] == chunks["multi_turn"][k], k
        assert [r[k] for r in layers["multi_turn"]["rows"]] == [r[k] for r in chunks["multi_turn"]["rows"]], k
    assert sum(layers["multi_turn"]["range_reads_by_tier"].values()) > 0
    assert sum(chunks["multi_turn"]["range_reads_by_tier"].values()) == 0


def test_tier_figures_are_per_restore_whatever_repeat(terrace, toy_model, tmp_path):
    # The row's block, sub-range and byte counts are one restore's (as bytes_read is), not sums over
    # the --repeat rounds; so are the text line's and the run's totals.
    flags = ("--prefix-tokens", "64", "--turns", "0")
    one, three = (bench_json(terrace, toy_model, tmp_path, *flags, "--repeat", n) for n in ("1", "3"))
    (r1,), (r3,) = one["rows"], three["rows"]
    assert r3["rounds"] == 3
    for k in ("blocks_requested", "blocks_read_by_tier", "range_reads_by_tier", "bytes_read_by_tier",
              "hit_rate_by_tier"):
        assert r1[k] == r3[k], k
        assert one[k] == three[k], k
    assert r3["bytes_read_by_tier"] == r3["bytes_read"]
    assert r3["blocks_requested"] > 0 and sum(r3["range_reads_by_tier"].values()) > 0
    texts = [bench(terrace, tmp_path, "--model", toy_model, *flags, "--repeat", n).stdout for n in ("1", "3")]
    lines = [next(l for l in t.splitlines() if l.startswith("prefix 64: the restore's blocks")) for t in texts]
    assert [l.split("; the forward pass")[0] for l in lines] == [lines[0].split("; the forward pass")[0]] * 2


def test_raw_read_reads_as_many_written_bytes_as_the_restore(terrace, toy_model, tmp_path):
    # The raw read takes the restore's bytes (rounded up to 4 KiB per pool) from the pools' written
    # data, not a 1 MiB minimum from offset 0 of their fallocated files. (A prefix under one chunk,
    # whose restore read nothing, is refused now: test_a_prefix_shorter_than_a_chunk_is_refused.)
    j = bench_json(terrace, toy_model, tmp_path, "--prefix-tokens", "64", "--kv-codec", "f32", "--turns", "0")
    (row,) = j["rows"]

    def up(n):
        return (n + 4095) // 4096 * 4096

    want = up(row["kv_bytes"]) + up(row["state_bytes"])
    assert row["tier_read_bytes"] == want, (row["tier_read_bytes"], want)
    assert 0 < want < 1 << 20  # below the old 1 MiB floor
    assert want <= row["bytes_written_by_tier"]["nvme"]  # never beyond what turn 1 wrote
    assert row["tier_read_mb_per_s"] > 0
    assert row["tier_read_extents_from"] in ("fiemap", "seek_data")


def mount_type(path):
    """The file system type of the mount `path` is on (the longest mount point above it), or None."""
    best, kind = "", None
    real = os.path.realpath(path)
    for line in pathlib.Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        point = fields[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


def test_raw_read_on_tmpfs_maps_the_data_with_seek_data(terrace, toy_model):
    # tmpfs has no FIEMAP (EOPNOTSUPP): the raw read used to fail the whole bench there (the default
    # --dir is under the temp directory, tmpfs on many systems); it maps the written data with
    # lseek(SEEK_DATA) instead and reads as many bytes as the restore.
    if not os.path.isdir("/dev/shm") or mount_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs mount")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        r = terrace("bench", "kv", "--dir", pathlib.Path(d) / "b", *SMALL_POOLS, "--chunk-tokens", CHUNK, "--model",
                    toy_model, "--json", "--prefix-tokens", "64", "--turns", "0", timeout=300)
        assert r.returncode == 0, r.stderr
        (row,) = json.loads(r.stdout)["rows"]
    assert row["tier_read_extents_from"] == "seek_data"
    assert row["tier_read_bytes"] == sum((row[k] + 4095) // 4096 * 4096 for k in ("kv_bytes", "state_bytes")) > 0
    assert row["tier_read_mb_per_s"] > 0


def test_host_tier_restores_say_host(terrace, toy_model, tmp_path):
    j = bench_json(terrace, toy_model, tmp_path, "--prefix-tokens", "64", "--tier", "host", "--repeat", "2",
                   "--turns", "0")
    (r,) = j["rows"]
    check_tier_shares(r)
    assert r["hit_rate_by_tier"]["host"] == 1.0 and r["hit_rate_by_tier"]["nvme"] == 0.0
    # Per restore, whatever --repeat: one round's prepared restore.
    assert r["blocks_read_by_tier"]["host"] == r["blocks_requested"]
    assert r["bytes_read_by_tier"]["host"] == r["bytes_read"]["host"]


def test_bytes_per_token_by_codec_follow_the_codec_sizes(terrace, toy_model, tmp_path):
    j = bench_json(terrace, toy_model, tmp_path, "--prefix-tokens", "64", "--kv-codec", "f32", "--turns", "0")
    by = j["bytes_per_token_by_codec"]
    assert set(by) == set(CODECS)
    f32 = by["f32"]
    for name, size in CODECS.items():
        c = by[name]
        # Nominal sizes scale with the codec's bytes per value ...
        assert c["kv_bytes_per_token"] == pytest.approx(f32["kv_bytes_per_token"] * size / 4), name
        assert c["state_bytes_per_snapshot"] == pytest.approx(f32["state_bytes_per_snapshot"] * size / 4, abs=1), name
        # ... and the stored blocks hold at least that (headers, scales, 4 KiB alignment).
        assert c["kv_block_bytes_per_token"] >= c["kv_bytes_per_token"], name
        assert c["state_block_bytes_per_snapshot"] >= c["state_bytes_per_snapshot"], name
    for a, b in (("f32", "bf16"), ("bf16", "fp8"), ("fp8", "int4-g32")):
        assert by[a]["kv_bytes_per_token"] > by[b]["kv_bytes_per_token"], (a, b)
        assert by[a]["state_bytes_per_snapshot"] > by[b]["state_bytes_per_snapshot"], (a, b)
        assert by[a]["kv_block_bytes_per_token"] >= by[b]["kv_block_bytes_per_token"], (a, b)
        assert by[a]["state_block_bytes_per_snapshot"] >= by[b]["state_block_bytes_per_snapshot"], (a, b)
    # The run's own codecs (f32 KV, f32 state) are the same figures as the row's.
    (r,) = j["rows"]
    assert r["kv_bytes_per_token"] == f32["kv_bytes_per_token"]
    assert r["state_bytes_per_sequence"] == f32["state_bytes_per_snapshot"]
    # Per token means per token: another chunk size changes the blocks' overhead, not the nominal size.
    k = bench_json(terrace, toy_model, tmp_path, "--prefix-tokens", "64", "--turns", "0", "--chunk-tokens", "64")
    assert k["bytes_per_token_by_codec"]["bf16"]["kv_bytes_per_token"] == by["bf16"]["kv_bytes_per_token"]
    assert k["bytes_per_token_by_codec"]["bf16"]["kv_block_bytes_per_token"] <= by["bf16"]["kv_block_bytes_per_token"]


MULTI = ("--prefix-tokens", "none", "--turns", "3", "--conversations", "2", "--system-tokens", "80", "--user-tokens",
         "40")


def check_multi_turn(mt, system=80, user=40, turns=3, conversations=2):
    rows = mt["rows"]
    assert [(r["turn"], r["conversation"]) for r in rows] == [
        (t, c) for t in range(1, turns + 1) for c in range(1, conversations + 1)]
    prev = {}
    for r in rows:
        n = r["prompt_tokens"]
        assert n == system + user * r["turn"]
        assert r["restored_tokens"] + r["computed_tokens"] == n
        assert r["restored_tokens"] % CHUNK == 0 and r["restored_tokens"] <= (n - 1) // CHUNK * CHUNK
        assert r["fallbacks"] == 0 and r["write_failures"] == 0
        check_tier_shares(r)
        if r["turn"] == 1:
            # The first conversation computes everything; the others restore the shared system
            # prompt's full chunks.
            assert r["restored_tokens"] == (0 if r["conversation"] == 1 else system // CHUNK * CHUNK)
        else:
            # Turn k restores at least every full chunk of the conversation's turn k-1.
            assert r["restored_tokens"] >= prev[r["conversation"]] // CHUNK * CHUNK
        if r["restored_tokens"] > 0:
            assert r["blocks_requested"] > 0 and sum(r["hit_rate_by_tier"].values()) == pytest.approx(1.0)
        prev[r["conversation"]] = n
    assert mt["restored_tokens"] == sum(r["restored_tokens"] for r in rows)
    assert mt["computed_tokens"] == sum(r["computed_tokens"] for r in rows)
    assert mt["blocks_requested"] == sum(r["blocks_requested"] for r in rows)
    for t in TIERS:
        assert mt["blocks_read_by_tier"][t] == sum(r["blocks_read_by_tier"][t] for r in rows)
        assert mt["bytes_written_by_tier"][t] == sum(r["bytes_written_by_tier"][t] for r in rows)
    # "written" counts each block once: a write-through block reaches host and NVMe, so the bytes
    # per tier are each as large as the blocks written, and their sum twice as large.
    assert mt["bytes_written"] == sum(r["bytes_written"] for r in rows) > 0
    for r in rows:
        assert r["bytes_written"] <= max(r["bytes_written_by_tier"].values())
    check_tier_shares(mt)
    assert mt["write_failures"] == 0


def test_multi_turn_restores_the_conversation_so_far(terrace, toy_model, tmp_path):
    j = bench_json(terrace, toy_model, tmp_path, *MULTI)
    assert j["rows"] == [] and j["blocks_requested"] == 0  # --prefix-tokens none: no prefix rows
    mt = j["multi_turn"]
    assert (mt["conversations"], mt["turns"], mt["system_tokens"], mt["user_tokens"]) == (2, 3, 80, 40)
    check_multi_turn(mt)
    # The pools stay open: with tiers of the default sizes every block comes from the host tier.
    assert mt["hit_rate_by_tier"]["host"] == 1.0
    assert all(r["ttft_restore_s"] > 0 for r in mt["rows"])


def test_multi_turn_blocks_evicted_from_host_come_from_nvme(terrace, toy_model, tmp_path):
    # 1 MiB host tiers hold a few of the blocks; the rest were written through to NVMe.
    j = bench_json(terrace, toy_model, tmp_path, *MULTI, "--store-host-size", "1MiB", "--state-host-size", "1MiB")
    mt = j["multi_turn"]
    check_multi_turn(mt)
    assert mt["hit_rate_by_tier"]["nvme"] > 0
    assert mt["hit_rate_by_tier"]["host"] + mt["hit_rate_by_tier"]["nvme"] == pytest.approx(1.0)


def test_text_output_has_the_tier_lines_codec_table_and_turns(terrace, toy_model, tmp_path):
    out = bench(terrace, tmp_path, "--model", toy_model, "--prefix-tokens", "64", "--turns", "2", "--conversations",
                "1", "--system-tokens", "40", "--user-tokens", "40").stdout
    # 2 KV chunks and 6 KDA snapshots; the KV chunks read as 2 MLA layers' sub-ranges each.
    assert "prefix 64: the restore's blocks by tier: hbm 0% host 0% nvme 100% of 8 blocks;" in out
    assert "read by layer, 4 sub-range reads (--read-order layers)" in out
    assert "int4-g64" in out and "bf16 (run: kv)" in out and "f32 (run: state)" in out
    assert "multi-turn: 1 conversations x 2 turns, system prompt 40 tokens, 40 new tokens per turn" in out
    # Turn 1 computes its 80 tokens; turn 2 (120 tokens) restores its 2 full chunks and computes 56.
    assert "multi-turn: restored 64 tokens, computed 136;" in out


def test_a_prefix_shorter_than_a_chunk_is_refused(terrace, toy_model, tmp_path):
    # No full chunk to store: its row was all zeros that looked measured (restored_tokens 0, restore
    # MB/s 0.0). Now a usage error naming both flags, before --dir is made.
    r = terrace("bench", "kv", "--model", toy_model, "--dir", tmp_path / "b", *SMALL_POOLS, "--chunk-tokens", str(CHUNK),
                "--prefix-tokens", "16", "--turns", "0")
    assert r.returncode == 2, r.stderr
    assert "--prefix-tokens 16" in r.stderr and f"--chunk-tokens {CHUNK}" in r.stderr, r.stderr
    assert not (tmp_path / "b").exists()


def test_nothing_to_run_is_a_usage_error(terrace, toy_model, tmp_path):
    r = terrace("bench", "kv", "--model", toy_model, "--prefix-tokens", "none", "--turns", "0",
                "--dir", tmp_path / "b")
    assert r.returncode == 2 and "--prefix-tokens none" in r.stderr
    assert not (tmp_path / "b").exists()


def test_verify_kv_reports_progress_per_codec(terrace, toy_model):
    r = terrace("verify", "kv", "--model", toy_model, "--context", "64", "--chunk-tokens", CHUNK, "--eval-tokens", "4",
                "--codecs", "f32,int8", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    assert [row["codec"] for row in json.loads(r.stdout)["rows"]] == ["f32", "int8"]  # stdout: the JSON only
    assert "terrace verify kv: codec f32 done (1/2)" in r.stderr
    assert "terrace verify kv: codec int8 done (2/2)" in r.stderr
