"""Flags that would change nothing, or change the result in a way the run would not report, are refused
with a usage error (exit 2) naming the flag, never ignored (docs/errors.md); and the flags that are
taken do what they say. Each case here was accepted silently before."""
import json

import pytest

SMALL_POOLS = ("--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB")


def refused(r, *words):
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    for w in words:
        assert w in r.stderr, (w, r.stderr)


def test_expert_cache_sizes_read_units_as_every_size_flag(terrace, toy_model):
    """--expert-cache 1MB is 1 000 000 bytes (MB decimal, as --block-size and every other size flag
    read it; it was 2^20), 1MiB is 2^20 (the toy model's experts total about 2.2 MB, and a budget
    above that is capped at it, so the sizes stay below). GB, TB, ... go through the same unit table."""
    run = ("model", "run", "--model", toy_model, "--tokens", "1,2,3", "--max-new", "1", "--json")
    for text, want in (("1MB", 1_000_000), ("1MiB", 1 << 20), ("2MB", 2_000_000)):
        r = terrace(*run, "--expert-cache", text, timeout=300)
        assert r.returncode == 0, (text, r.stderr)
        assert json.loads(r.stdout)["experts"]["budget_bytes"] == want, text
    refused(terrace(*run, "--expert-cache", "64XB"), "64XB", "25%")


def test_model_run_expert_flags_need_expert_cache(terrace, toy_model):
    run = ("model", "run", "--model", toy_model, "--tokens", "1,2,3", "--max-new", "1")
    for flag, value in (("--predictor", "none"), ("--expert-policy", "lru"), ("--lookahead-depth", "3")):
        refused(terrace(*run, flag, value), flag, "--expert-cache")
    # --lookahead-depth is the lookahead / oracle reach and the utility policy's window: refused where
    # neither is used, taken where one is.
    cached = (*run, "--expert-cache", "50%", "--lookahead-depth", "3")
    for predictor, policy in (("none", "lru"), ("statistical", "lfu")):
        refused(terrace(*cached, "--predictor", predictor, "--expert-policy", policy), "--lookahead-depth",
                f"--predictor {predictor}")
    for predictor, policy in (("statistical", "utility"), ("lookahead", "lru")):
        r = terrace(*cached, "--predictor", predictor, "--expert-policy", policy, timeout=300)
        assert r.returncode == 0, (predictor, policy, r.stderr)


def test_bench_flags_for_rows_or_tiers_that_do_not_run_are_refused(terrace, toy_model, tmp_path):
    # bench tiers: the NVMe tier's flags with a memory tier.
    for flag in (["--durability", "sync"], ["--keep"], ["--dir", str(tmp_path / "b")],
                 ["--index-dir", str(tmp_path / "i")]):
        for tier in ("host", "hbm"):
            r = terrace("bench", "tiers", "--tier", tier, "--total-bytes", "4MiB", "--block-size", "1MiB", *flag)
            refused(r, flag[0], "--tier nvme")
    assert not (tmp_path / "b").exists() and not (tmp_path / "i").exists()
    # bench experts: lookahead flags without a lookahead row, --drop-caches without an mmap row,
    # a --link-gbps that is not a finite number.
    ex = ("bench", "experts", "--model", toy_model, "--dir", tmp_path / "e", "--configs", "on-demand")
    for flag in (["--lookahead-depth", "5"], ["--lookahead-embedding-depth", "3"]):
        refused(terrace(*ex, *flag), flag[0], "lookahead")
    refused(terrace(*ex, "--drop-caches"), "--drop-caches", "mmap")
    # The lead-protection flags size the partitioned rows' caches: refused where only mmap rows and
    # the unpartitioned oracle+belady run, and the share without protected layers; a budget below one
    # expert block is refused before any row runs (it was found after the resident row, exit 1).
    for configs in ("mmap", "oracle+belady", "mmap,oracle+belady"):
        for flag in (["--lead-protected-layers", "3"], ["--lead-protected-share", "0.9"]):
            refused(terrace(*ex[:-1], configs, *flag), flag[0], "--configs")
    refused(terrace(*ex, "--lead-protected-layers", "0", "--lead-protected-share", "0.9"), "--lead-protected-share",
            "--lead-protected-layers is 0")
    r = terrace(*ex, "--budgets", "0.5%")
    refused(r, "--budgets", "0.5%", "smaller than one expert block")
    assert "resident" not in r.stdout
    for bad in ("inf", "nan"):
        refused(terrace(*ex, "--link-gbps", bad), "--link-gbps")
    assert not (tmp_path / "e").exists()


def test_bench_kv_runs_under_its_tenant(terrace, toy_model, tmp_path):
    """--tenant was accepted and every block was written and read under tenant "": now the pools are
    keyed under it (the JSON says which), and a turn still restores what an earlier turn stored."""
    r = terrace("bench", "kv", "--model", toy_model, "--dir", tmp_path / "b", *SMALL_POOLS, "--chunk-tokens", "32",
                "--prefix-tokens", "none", "--turns", "2", "--conversations", "1", "--system-tokens", "64",
                "--user-tokens", "8", "--tenant", "acme", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["tenant"] == "acme"
    assert j["multi_turn"]["restored_tokens"] > 0


def test_plan_refuses_a_lossless_stage(terrace):
    for flag, codec, base in (("--kv-codec", "int8+zstd", "int8"), ("--state-codec", "f32+lz4", "f32")):
        refused(terrace("plan", flag, codec), flag, codec, f"{flag} {base}")


def test_model_run_store_size_must_match_the_existing_pool(terrace, toy_model, tmp_path):
    store = tmp_path / "s"
    run = ("model", "run", "--model", toy_model, "--tokens", "1,2,3", "--max-new", "1", "--store", store)
    r = terrace(*run, *SMALL_POOLS, timeout=300)
    assert r.returncode == 0, r.stderr
    r = terrace(*run, *SMALL_POOLS, timeout=300)  # the same sizes: fine
    assert r.returncode == 0, r.stderr
    for flag in ("--store-nvme-size", "--state-nvme-size"):
        refused(terrace(*run, flag, "32MiB"), flag, "16.0 MiB")
    r = terrace(*run, timeout=300)  # no size given: the pools keep theirs
    assert r.returncode == 0, r.stderr


def test_nvme_sizes_off_the_4kib_unit_are_refused_before_anything_is_created(terrace, toy_model, tmp_path):
    # model run --store, bench kv and demo share the prefix cache's pool sizes: a size the NVMe tier
    # cannot take is a usage error naming the flag, before any pool (or --dir) exists.
    store, bench_dir, demo_dir = tmp_path / "s", tmp_path / "b", tmp_path / "d"
    run = ("model", "run", "--model", toy_model, "--tokens", "1,2,3", "--store", store)
    bench = ("bench", "kv", "--model", toy_model, "--dir", bench_dir, "--turns", "0", "--prefix-tokens", "64")
    demo = ("demo", "--preset", "k3-toy", "--dir", demo_dir)
    for cmd, kv_flag in ((run, "--store-nvme-size"), (bench, "--store-nvme-size"), (demo, "--kv-nvme-size")):
        for flag in (kv_flag, "--state-nvme-size"):
            other = "--state-nvme-size" if flag == kv_flag else kv_flag
            refused(terrace(*cmd, other, "16MiB", flag, "2000001", timeout=300), flag, "2000001",
                    "multiple of 4 KiB", "1998848 or 2002944")
    assert not store.exists() and not bench_dir.exists() and not demo_dir.exists()
    # A pool that exists: the same refusal, the pool untouched.
    r = terrace(*run, *SMALL_POOLS, timeout=300)
    assert r.returncode == 0, r.stderr
    before = sorted(p.name for p in store.rglob("*"))
    refused(terrace(*run, "--state-nvme-size", "2000001"), "--state-nvme-size", "multiple of 4 KiB")
    assert sorted(p.name for p in store.rglob("*")) == before


def test_ref_kda_chunk_size_needs_chunked(terrace, tmp_path):
    refused(terrace("ref", "kda", "--in", tmp_path / "i", "--out", tmp_path / "o", "--chunk-size", "4"),
            "--chunk-size", "--chunked")


def test_flags_that_would_change_nothing_are_refused(terrace, tmp_path):
    """plan --gqa-kv-heads above the model's heads was capped; trace gen's prefix flags without prefix
    blocks and --think-ms with one turn did nothing; model inspect took --summary with --tensors."""
    refused(terrace("plan", "--model", "k3-toy", "--gqa-kv-heads", "4096"), "--gqa-kv-heads", "at most")
    assert terrace("plan", "--model", "k3-toy", "--gqa-kv-heads", "4").returncode == 0
    for flags, word in ((["--prefix-blocks", "0", "--zipf", "2"], "--zipf"),
                        (["--prefix-blocks", "0", "--prefixes", "5"], "--prefixes"),
                        (["--turns", "1", "--think-ms", "10"], "--think-ms")):
        refused(terrace("trace", "gen", "--requests", "2", *flags), word)
    refused(terrace("model", "inspect", "--preset", "k3-toy", "--summary", "--tensors"), "--summary", "--tensors")


def test_trace_gen_refuses_a_trace_plan_could_not_read(terrace, tmp_path):
    """A request's input_length over 2^32 tokens: trace gen wrote it (exit 0) and plan --trace refused it."""
    out = tmp_path / "big.jsonl"
    refused(terrace("trace", "gen", "--requests", "1", "--turns", "1", "--turn-blocks", "65537", "--prefix-blocks", "0",
                    "--block-tokens", "65536", "-o", out), "--block-tokens", "input_length")
    assert not out.exists()
    ok = tmp_path / "ok.jsonl"  # exactly at the limit (2^32 tokens): written, and plan reads it
    assert terrace("trace", "gen", "--requests", "1", "--turns", "1", "--turn-blocks", "65536", "--prefix-blocks", "0",
                   "--block-tokens", "65536", "-o", ok).returncode == 0
    r = terrace("plan", "--model", "k3-toy", "--trace", ok, "--trace-block-tokens", "65536")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("head,words", [
    (b"\x1f\x8b\x08\x00", ["gzip-compressed", "gunzip"]),
    (b"\x28\xb5\x2f\xfd", ["zstd-compressed", "unzstd"]),
    ('{"timestamp": 0}\n'.encode("utf-16"), ["UTF-16", "UTF-8"]),
    ('{"timestamp": 0}\n'.encode("utf-16-le"), ["UTF-16", "UTF-8"]),  # no byte-order mark
    ('{"timestamp": 0}\n'.encode("utf-16-be"), ["UTF-16", "UTF-8"]),
    (b"BZh91AY&SY", ["bzip2-compressed", "bunzip2"]),
    (b"\xfd7zXZ\x00\x00", ["xz-compressed", "unxz"]),
])
def test_a_compressed_or_utf16_trace_is_named_as_such(terrace, tmp_path, head, words):
    """It was 'not valid JSON: a NUL byte at line 1 ...; remove it', a fix that does not apply."""
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(head + bytes(64))
    refused(terrace("plan", "--model", "k3-toy", "--trace", trace), "--trace", str(trace), *words)


def test_trace_gen_writes_dev_stdout_as_standard_output(terrace):
    b = terrace("trace", "gen", "--requests", "3")
    for name in ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"):
        a = terrace("trace", "gen", "--requests", "3", "-o", name)
        assert a.returncode == 0 and a.stdout == b.stdout and a.stdout.count("\n") == 3, (name, a.stderr)


def test_a_folder_without_config_json_is_not_a_model_and_a_demo_dir_points_at_its_model(terrace, tmp_path):
    """--model given a demo's data directory (its model is in DIR/model) failed with "NotFound: cannot
    open config file" (exit 1), naming no flag."""
    demo = tmp_path / "terrace-data"
    (demo / "model").mkdir(parents=True)
    (demo / "model" / "config.json").write_text("{}")
    for argv in (("model", "run", "--model", demo, "--tokens", "1"), ("model", "inspect", demo),
                 ("bench", "experts", "--model", demo, "--dir", tmp_path / "b")):
        refused(terrace(*argv), "no config.json in it", f"its folder 'model' holds one (a demo's data directory?): "
                f"give {demo / 'model'}")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(terrace("model", "run", "--model", empty, "--tokens", "1"), "--model", "no config.json in it",
            "'terrace model init' wrote")
