"""`terrace model run --store`: a second process restores what the first stored, with the same output.

Run by ctest with TERRACE_BIN pointing at the terrace binary.
"""
import json
import os
import re
import subprocess

import pytest

BIN = os.environ.get("TERRACE_BIN")
if not BIN or not os.path.exists(BIN):
    pytest.skip("TERRACE_BIN is not set to the terrace binary", allow_module_level=True)

TOKENS = ",".join(str((i * 37 + 5) % 512) for i in range(150))


@pytest.fixture(scope="module")
def toy(make_model):
    return make_model("k3-toy", seed=3)


# Small NVMe pools: the defaults (1 GiB + 256 MiB) would be fallocated for every store a test makes.
SMALL_POOLS = ("--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB")


def run(toy, store, *flags, tokens=TOKENS, expect=0):
    if "--kv-codec" not in flags:
        flags = ("--kv-codec", "f32", *flags)
    if "--store-nvme-size" not in flags:
        flags = (*SMALL_POOLS, *flags)
    p = subprocess.run([BIN, "model", "run", "--model", str(toy), "--store", str(store), "--tokens", tokens,
                        "--max-new", "3", "--chunk-tokens", "32", *flags],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == expect, p.stderr
    return p


def run_json(toy, store, *flags, **kw):
    return json.loads(run(toy, store, "--json", *flags, **kw).stdout)


def test_second_process_restores_with_identical_output(toy, tmp_path):
    store = tmp_path / "st"
    a = run_json(toy, store, "--dump-logits", str(tmp_path / "a.safetensors"))
    assert a["restored_tokens"] == 0 and a["computed_tokens"] == 150
    assert a["chunk_blocks_written"] == 4 and a["write_failures"] == 0
    b = run_json(toy, store, "--dump-logits", str(tmp_path / "b.safetensors"))
    assert b["restored_tokens"] == 128 and b["joint_boundary"] == 128 and b["computed_tokens"] == 22
    assert b["bytes_read"]["nvme"] + b["bytes_read"]["host"] + b["bytes_read"]["hbm"] > 0
    assert b["fallbacks"] == 0
    assert b["generated"] == a["generated"]
    assert b["logits_xxh3_64"] == a["logits_xxh3_64"]
    # Restored positions' logits are recomputed for the file: it is byte-identical.
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    # Another tenant never sees these blocks.
    c = run_json(toy, store, "--tenant", "other")
    assert c["restored_tokens"] == 0 and c["generated"] == a["generated"]
    # Another chunk size or codec is another namespace.
    d = run_json(toy, store, "--kv-codec", "bf16")
    assert d["restored_tokens"] == 0


def store_blocks(pool):
    p = subprocess.run([BIN, "store", "stats", "--dir", str(pool), "--json"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["blocks"]


def test_blocks_already_stored_are_not_counted_as_written(toy, tmp_path):
    # 128 tokens = 4 whole 32-token chunks: a second run restores 3 (the last token is computed),
    # computes chunk 4 and finds its KV block and its boundary's snapshots already stored. It wrote
    # nothing; it reported "wrote 1 chunk and 6 state blocks" before.
    store = tmp_path / "st"
    tokens = ",".join(TOKENS.split(",")[:128])
    a = run_json(toy, store, tokens=tokens)
    assert a["restored_tokens"] == 0 and a["write_failures"] == 0
    assert a["chunk_blocks_written"] == store_blocks(store / "kv") == 4
    assert a["state_blocks_written"] == store_blocks(store / "state") > 0
    assert a["chunk_blocks_already_stored"] == a["state_blocks_already_stored"] == 0
    per_boundary = a["state_blocks_written"] // 4  # one snapshot per KDA layer at each of 4 boundaries
    b = run_json(toy, store, tokens=tokens)
    assert b["restored_tokens"] == 96
    assert b["chunk_blocks_written"] == b["state_blocks_written"] == b["bytes_written"] == 0
    assert b["chunk_blocks_already_stored"] == 1 and b["state_blocks_already_stored"] == per_boundary
    assert store_blocks(store / "kv") == 4 and store_blocks(store / "state") == a["state_blocks_written"]
    text = run(toy, store, tokens=tokens).stdout
    assert (f"prefix cache: wrote 0 chunk and 0 state blocks (0 B), 0 write failure(s); 1 chunk and {per_boundary} "
            "state blocks were already stored") in text, text
    # Snapshots only at the last full chunk, then a prompt differing in its last chunk: no boundary
    # to restore, 4 chunks computed, 3 of them already stored, 1 written (it said "wrote 4" before).
    last_only = tmp_path / "last"
    run_json(toy, last_only, "--snapshot-every", "0", tokens=tokens)
    other = tokens.split(",")
    other[100] = str((int(other[100]) + 1) % 512)
    c = run_json(toy, last_only, "--snapshot-every", "0", tokens=",".join(other))
    assert c["restored_tokens"] == 0
    assert c["chunk_blocks_written"] == 1 and c["chunk_blocks_already_stored"] == 3
    assert c["state_blocks_written"] == per_boundary and c["state_blocks_already_stored"] == 0
    assert store_blocks(last_only / "kv") == 5 and store_blocks(last_only / "state") == 2 * per_boundary


def test_lossless_restore_is_independent_of_the_write_history(toy, tmp_path):
    # With f32 codecs the blocks a run writes after a restore are bitwise a cold run's, so the same
    # prompt restores to the same logits whichever runs filled the pool (docs/prefix-cache.md,
    # "Lossy codecs": with a lossy codec they may differ).
    cold = tmp_path / "cold"
    run_json(toy, cold)  # one cold run writes every block
    a = run_json(toy, cold)
    turns = tmp_path / "turns"
    first = run_json(toy, turns, tokens=",".join(TOKENS.split(",")[:33]))  # a first turn: chunk 1
    second = run_json(toy, turns)  # restores chunk 1, writes chunks 2-4 computed on the restored state
    assert first["chunk_blocks_written"] == 1 and second["restored_tokens"] == 32
    assert second["chunk_blocks_written"] == 3
    b = run_json(toy, turns)
    assert a["restored_tokens"] == b["restored_tokens"] == 128
    assert a["logits_xxh3_64"] == b["logits_xxh3_64"] and a["generated"] == b["generated"]


def test_state_reserved_while_the_pools_open_changes_no_output(toy, tmp_path):
    # model run --store reserves the state's latents for the prompt beside the pools' opening;
    # --no-reserve leaves them to the restore and the forward pass. Same ids and digest either way.
    store = tmp_path / "st"
    a = run_json(toy, store)
    assert a["state_reserve_s"] > 0 and a["pools_open_s"] > 0
    b = run_json(toy, store)
    c = run_json(toy, store, "--no-reserve")
    assert b["restored_tokens"] == c["restored_tokens"] == 128
    assert b["state_reserve_s"] > 0 and c["state_reserve_s"] == 0
    assert a["generated"] == b["generated"] == c["generated"]
    assert a["logits_xxh3_64"] == b["logits_xxh3_64"] == c["logits_xxh3_64"]


def test_snapshot_interval_and_text_output(toy, tmp_path):
    store = tmp_path / "st"
    run_json(toy, store, "--snapshot-every", "3")
    # Snapshots at chunks 3 and 4 (the last full chunk); a prompt sharing 3.5 chunks restores 3.
    short = ",".join(TOKENS.split(",")[:112]) + ",1,2,3"
    j = run_json(toy, store, tokens=short)
    assert j["restored_tokens"] == 96
    text = run(toy, store, tokens=short).stdout
    assert "prefix cache: restored 96 tokens (joint boundary 96), computed 19" in text


def test_saved_estimate_only_from_a_suffix_as_long_as_the_restored_prefix(toy, tmp_path):
    # The saving is the restored tokens at the suffix's per-token rate: from a suffix shorter than
    # the restored prefix that rate is mostly per-pass overhead, multiplied up (a 1-token suffix
    # claimed 6x a full recompute), so no figure is given; nor with nothing restored (was -0.0000).
    store = tmp_path / "st"
    first = run_json(toy, store, tokens=",".join(TOKENS.split(",")[:40]))  # stores chunk 1 (32 tokens)
    assert first["restored_tokens"] == 0
    assert first["saved_s_estimate"] is None and first["saved_s_unestimated"] == "nothing was restored"
    whole = run_json(toy, store)  # restores 32, computes 118
    assert whole["restored_tokens"] == 32 and whole["computed_tokens"] == 118
    assert isinstance(whole["saved_s_estimate"], float) and "saved_s_unestimated" not in whole
    short = run_json(toy, store)  # restores 128, computes 22
    assert short["restored_tokens"] == 128 and short["computed_tokens"] == 22
    assert short["saved_s_estimate"] is None
    assert short["saved_s_unestimated"] == "the computed suffix is shorter than the restored prefix"
    text = run(toy, store).stdout
    assert "; saved: not estimated (the computed suffix is shorter than the restored prefix)" in text
    assert "saved ~-" not in text


def test_store_check_checksums_only_verifies_a_pool_fill_did_not_write(toy, tmp_path):
    # `store check` compares blocks with the pattern of `store fill`; a prefix-cache pool holds other
    # bytes, so operations.md's advice is --checksums-only: every block's checksum, no pattern.
    store = tmp_path / "st"
    run(toy, store)
    pool = store / "kv"
    r = subprocess.run([BIN, "store", "check", "--dir", str(pool)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--checksums-only" in r.stdout, r.stdout + r.stderr
    check = [BIN, "store", "check", "--checksums-only", "--dir", str(pool)]
    r = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"4 blocks in the index: ok 4  missing 0  corrupt 0  wrong-content 0  lost-from-index 0", r.stdout), r.stdout
    data = bytearray((pool / "terrace.data").read_bytes())
    unit = next(off for off in range(4096, len(data), 4096)
                if data[off:off + 4096].strip(b"\0") and not data[off:off + 4096].startswith(b"TRRCDESC"))
    data[unit + 100] ^= 0x01
    (pool / "terrace.data").write_bytes(bytes(data))
    r = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"ok 3  missing 0  corrupt 1  wrong-content 0", r.stdout), r.stdout
    assert "--repair" in r.stdout, r.stdout
    r = subprocess.run([*check, "--seed", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--seed" in r.stderr, r.stderr


def test_corrupt_state_block_falls_back_exactly(toy, tmp_path):
    store = tmp_path / "st"
    a = run_json(toy, store)
    data = store / "state" / "terrace.data"
    blob = bytearray(data.read_bytes())
    # Flip a payload byte in every KDA snapshot of boundary 128 (header: boundary tokens at byte 16).
    flipped = 0
    pos = blob.find(b"TKDASNP1")
    while pos >= 0:
        if int.from_bytes(blob[pos + 16:pos + 24], "little") == 128:
            blob[pos + 1000] ^= 0x5A
            flipped += 1
        pos = blob.find(b"TKDASNP1", pos + 1)
    assert flipped == 6
    data.write_bytes(bytes(blob))
    b = run_json(toy, store)
    assert b["restored_tokens"] == 96
    assert b["fallbacks"] >= 1 and b["fallback_reasons"]
    assert b["generated"] == a["generated"] and b["logits_xxh3_64"] == a["logits_xxh3_64"]


def test_a_partly_written_boundary_is_named_in_the_fallback(toy, tmp_path):
    # A 1200 KiB state pool holds two boundaries' six KDA snapshots and part of the third's: the
    # boundary at 96 is partly written, and the restore falls back from it to 64.
    store = tmp_path / "st"
    run(toy, store, "--store-nvme-size", "16MiB", "--state-nvme-size", "1200KiB", "--state-host-size", "1MiB")
    j = run_json(toy, store, "--store-nvme-size", "16MiB")
    assert j["partial_boundary"] > j["lookup_boundary"] == j["joint_boundary"] > 0
    assert j["fallbacks"] == 1 and f"at token {j['partial_boundary']}: NotFound" in j["fallback_reasons"][0]
    text = run(toy, store, "--store-nvme-size", "16MiB").stdout
    assert f"prefix cache: 1 fallback(s) from boundary {j['partial_boundary']} (partly written) to {j['joint_boundary']}:" \
        in text
    assert "looked-up boundary" not in text


def test_read_order_changes_how_not_what_is_restored(toy, tmp_path):
    store = tmp_path / "st"
    a = run_json(toy, store)
    by_layer = run_json(toy, store, "--read-order", "layers")
    by_chunk = run_json(toy, store, "--read-order", "chunks")
    for r in (by_layer, by_chunk):
        assert r["restored_tokens"] == 128 and r["fallbacks"] == 0 and r["range_rereads"] == 0
        assert r["generated"] == a["generated"] and r["logits_xxh3_64"] == a["logits_xxh3_64"]
    assert by_layer["restore_read_by_layer"] and not by_chunk["restore_read_by_layer"]
    # A lossless stage moves the layers off the offsets the layout fixes: whole chunks.
    z = run_json(toy, tmp_path / "z", "--kv-codec", "f32+zstd")
    z = run_json(toy, tmp_path / "z", "--kv-codec", "f32+zstd", "--read-order", "layers")
    assert z["restored_tokens"] == 128 and not z["restore_read_by_layer"]
    assert z["logits_xxh3_64"] == a["logits_xxh3_64"]
    text = run(toy, store, "--read-order", "layers").stdout
    assert "read by layer" in text
    p = run(toy, store, "--read-order", "sideways", expect=2)
    assert "--read-order" in p.stderr


def test_a_restore_that_read_nothing_is_not_read_by_layer(toy, tmp_path):
    # A new store holds nothing for the prompt: no chunk was read, by layer or otherwise.
    store = tmp_path / "st"
    a = run_json(toy, store, "--read-order", "layers")
    assert a["restored_tokens"] == 0 and a["kv_bytes_restored"] == 0
    assert not a["restore_read_by_layer"]
    text = run(toy, tmp_path / "st2", "--read-order", "layers").stdout
    assert "read by layer" not in text and "prefix cache: restored 0 tokens" in text
    # The same prompt again restores its chunks, read by layer.
    b = run_json(toy, store, "--read-order", "layers")
    assert b["restored_tokens"] == 128 and b["restore_read_by_layer"]


def test_routing_stats_only_on_request(toy, tmp_path):
    # --json alone runs the prompt once (through the cache); --routing-stats adds the uncached pass.
    store = tmp_path / "st"
    run_json(toy, store)
    plain = run_json(toy, store)
    assert plain["restored_tokens"] == 128 and "routing" not in plain
    r = run_json(toy, store, "--routing-stats")
    assert r["logits_xxh3_64"] == plain["logits_xxh3_64"]
    layers = r["routing"]["layers"]
    assert layers and all(sum(l["counts"]) % 150 == 0 and sum(l["counts"]) > 0 for l in layers)
    p = run(toy, store, "--routing-stats", expect=2)
    assert "--routing-stats" in p.stderr and "--json" in p.stderr


def test_bad_flags_exit_2(toy, tmp_path):
    p = run(toy, tmp_path / "st", "--kv-codec", "nope", expect=2)
    assert "--kv-codec" in p.stderr
    f = tmp_path / "file"
    f.write_text("x")
    p = run(toy, f, expect=2)
    assert "--store" in p.stderr
    p = run(toy, tmp_path / "st", "--snapshot-every", "-1", expect=2)
    assert "--snapshot-every" in p.stderr


def test_bench_kv_json_rows(toy, tmp_path):
    p = subprocess.run([BIN, "bench", "kv", "--model", str(toy), "--prefix-tokens", "64,96", "--chunk-tokens", "32",
                        "--kv-codec", "f32", "--dir", str(tmp_path / "b"), "--recompute-max-tokens", "64", *SMALL_POOLS,
                        "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    j = json.loads(p.stdout)
    assert [r["prefix_tokens"] for r in j["rows"]] == [64, 96]
    for r in j["rows"]:
        for k in ("ttft_restore_s", "ttft_recompute_s", "restore_mb_per_s", "tier_read_mb_per_s"):
            assert r[k] > 0, k
        assert r["restored_tokens"] == r["prefix_tokens"]
        assert r["bytes_read"]["nvme"] > 0  # the pools were reopened: everything came from NVMe
        assert r["logits_max_rel_err_vs_recompute"] == 0.0  # f32: bitwise
        # Above --recompute-max-tokens the cold run is turn 1 (the whole prompt, storing the prefix).
        assert r["recompute_in_turn1"] == (r["prefix_tokens"] > 64)
        # The headline restore is a fresh cache's first restore into memory prepared at open (timed
        # apart); the unprepared first restore and the warm one restore the same tokens, bitwise.
        assert r["prepare_s"] >= 0 and r["prepare_bytes"] > 0
        assert r["cold_unprepared_restored_tokens"] == r["warm_restored_tokens"] == r["prefix_tokens"]
        assert r["cold_unprepared_restore_s"] > 0 and r["cold_unprepared_tier_read_mb_per_s"] > 0
        assert r["cold_unprepared_logits_bitwise_equal"] and r["warm_logits_bitwise_equal"]
        # The restore alone (no forward pass beside it) read the same blocks, timed with its raw read.
        assert r["alone_restore_s"] > 0 and r["alone_tier_read_mb_per_s"] > 0 and r["alone_restore_over_tier"] > 0
        for k in ("ttft_minor_faults", "cold_unprepared_ttft_minor_faults", "warm_ttft_minor_faults"):
            assert r[k] >= 0, k
    # The bench removed what it created.
    assert not (tmp_path / "b").exists()


def test_bench_kv_repeat_reports_medians_and_rounds(toy, tmp_path):
    p = subprocess.run([BIN, "bench", "kv", "--model", str(toy), "--prefix-tokens", "96", "--chunk-tokens", "32",
                        "--kv-codec", "f32", "--dir", str(tmp_path / "b"), "--recompute-max-tokens", "64", *SMALL_POOLS,
                        "--repeat", "3", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    (r,) = json.loads(p.stdout)["rows"]
    assert r["rounds"] == 3
    for k in ("restore_s_runs", "restore_over_tier_runs", "warm_restore_s_runs", "warm_restore_over_tier_runs",
              "cold_unprepared_restore_over_tier_runs", "alone_restore_s_runs", "alone_restore_over_tier_runs"):
        assert len(r[k]) == 3 and all(v > 0 for v in r[k]), k
    assert r["restore_s"] == sorted(r["restore_s_runs"])[1]  # the median round
    assert r["warm_restore_s"] == sorted(r["warm_restore_s_runs"])[1]
    assert r["prepared_logits_bitwise_equal_across_rounds"] and r["warm_logits_bitwise_equal"]
    assert r["cold_unprepared_logits_bitwise_equal"] and r["logits_max_rel_err_vs_recompute"] == 0.0
    assert r["fallbacks"] == 0 and r["warm_fallbacks"] == 0
    assert not (tmp_path / "b").exists()
    # Out of range.
    q = subprocess.run([BIN, "bench", "kv", "--model", str(toy), "--repeat", "0"], capture_output=True, text=True)
    assert q.returncode == 2



@pytest.mark.parametrize("flags", [["--no-reserve"], ["--tenant", "t1"], ["--kv-codec", "fp8"],
                                   ["--chunk-tokens", "32"], ["--state-nvme-size", "16MiB"],
                                   ["--read-order", "chunks"]])
def test_cache_flags_without_store_are_refused(toy, flags):
    # A prefix-cache flag with no --store would change nothing: a usage error that names both.
    p = subprocess.run([BIN, "model", "run", "--model", str(toy), "--tokens", "1,2,3", "--max-new", "1", *flags],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert flags[0] in p.stderr and "--store" in p.stderr


def test_bench_kv_has_no_store_flag(toy, tmp_path):
    # bench kv's pools live in --dir; a --store there would be ignored, so it is not accepted.
    p = subprocess.run([BIN, "bench", "kv", "--model", str(toy), "--store", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--store" in p.stderr
    assert not (tmp_path / "s").exists()

def test_verify_kv_orders_codecs(toy):
    p = subprocess.run([BIN, "verify", "kv", "--model", str(toy), "--context", "128", "--chunk-tokens", "32",
                        "--eval-tokens", "8", "--codecs", "f32,bf16,int4-g32", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = {r["codec"]: r for r in json.loads(p.stdout)["rows"]}
    assert rows["f32"]["kl_mean"] == 0.0 and rows["f32"]["top1_agreement"] == 1.0  # passthrough: exact
    assert 0.0 < rows["bf16"]["kl_mean"] < 1e-4
    assert rows["int4-g32"]["kl_mean"] > rows["bf16"]["kl_mean"]
    assert rows["int4-g32"]["compression_ratio"] > rows["bf16"]["compression_ratio"] > rows["f32"]["compression_ratio"]
    # The ratio is the f32 codec's stored blocks over the codec's, so f32 is exactly 1 (it was the raw
    # f32 latents over the padded blocks: 0.77 here).
    assert rows["f32"]["compression_ratio"] == 1.0
    assert all(r["f32_kv_bytes"] == rows["f32"]["kv_bytes"] for r in rows.values())
    # Attention focus: every MLA layer x head x evaluation token compared; f32 keeps every top-8
    # position, int4 (16 levels per group over random latents, whose attention is nearly flat over
    # 136 positions) moves some.
    assert all(r["top8_compared"] == rows["f32"]["top8_compared"] > 0 for r in rows.values())
    assert rows["f32"]["top8_overlap_mean"] == 1.0 and rows["f32"]["top8_overlap_min"] == 1.0
    assert 0.0 < rows["int4-g32"]["top8_overlap_min"] <= rows["int4-g32"]["top8_overlap_mean"] < 1.0
    assert rows["bf16"]["top8_overlap_mean"] >= rows["int4-g32"]["top8_overlap_mean"]
    p = subprocess.run([BIN, "verify", "kv", "--model", str(toy), "--context", "100", "--chunk-tokens", "32"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--context" in p.stderr


@pytest.mark.parametrize("chunk", ["1", "128"])
def test_verify_kv_f32_compresses_to_exactly_one_at_any_chunk_size(toy, chunk):
    # Headers and 4 KiB alignment weigh most with small chunks: the old ratio gave f32 0.05x at
    # --chunk-tokens 1 and 0.87x at 128; f32+zstd compresses f32's stored blocks, not more than that.
    p = subprocess.run([BIN, "verify", "kv", "--model", str(toy), "--context", "128", "--chunk-tokens", chunk,
                        "--eval-tokens", "2", "--codecs", "f32,f32+zstd", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = {r["codec"]: r for r in json.loads(p.stdout)["rows"]}
    assert rows["f32"]["compression_ratio"] == 1.0
    assert rows["f32+zstd"]["compression_ratio"] >= 1.0


def test_verify_kv_help_says_it_measures_and_does_not_judge():
    # No threshold: `verify kv` exits 0 whatever the figures, and its help says so (it said "Quality checks").
    p = subprocess.run([BIN, "verify", "kv", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    assert "does not judge" in p.stdout and "exit 0 whatever the figures" in p.stdout
    p = subprocess.run([BIN, "verify", "--help"], capture_output=True, text=True, timeout=60)
    assert "Quality checks" not in p.stdout and "do not pass or fail" in p.stdout


def test_the_codecs_are_named_and_a_lossy_one_is_said_to_be(toy, tmp_path):
    """The default KV codec (bf16) rounds what it stores, so a restored run's logits differ from a
    computed one's; the output named neither the codecs nor that."""
    j = run_json(toy, tmp_path / "f32")
    assert (j["kv_codec"], j["state_codec"], j["codecs_lossless"]) == ("f32", "f32", True)
    assert "prefix cache: codecs KV f32, state f32 (lossless)" in run(toy, tmp_path / "f32").stdout
    j = run_json(toy, tmp_path / "lz4", "--kv-codec", "f32+lz4")
    assert (j["kv_codec"], j["codecs_lossless"]) == ("f32+lz4", True)
    for flags, lossy in ((("--kv-codec", "bf16"), "KV bf16"), (("--state-codec", "bf16"), "state bf16"),
                         (("--kv-codec", "int4-g32", "--state-codec", "fp8"), "KV int4-g32 and state fp8")):
        store = tmp_path / "-".join(flags).replace("--", "")
        j = run_json(toy, store, *flags)
        assert j["codecs_lossless"] is False, flags
        text = run(toy, store, *flags).stdout
        assert f"({lossy} lossy: restored tokens carry its rounding" in text, text
