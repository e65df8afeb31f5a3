"""`terrace bench kv`: a prefix row whose pools filled up says so (write_failures, the `!` mark, a
stderr warning naming the flags to raise, the report's warning); the logits checks that must hold
are printed and fail the run when they do not; the codec table marks the base of a codec with a
lossless stage. k3-toy, small pools."""
import json
import os
import subprocess

import pytest

SMALL_POOLS = ("--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB")
# Pools too small for a 1024-token prefix in 64-token chunks: turn 1's snapshot writes fail (pool
# full) after the first few chunks, and turn 2 restores only 256 tokens.
FULL_POOLS = ("--store-nvme-size", "1MiB", "--state-nvme-size", "2MiB", "--store-host-size", "1MiB",
              "--state-host-size", "1MiB", "--store-hbm-size", "1MiB")


def bench(terrace, model, d, *flags, env=None, expect=0):
    e = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    e.update(env or {})
    p = subprocess.run([terrace.path, "bench", "kv", "--model", str(model), "--dir", str(d), "--turns", "0", *flags],
                       capture_output=True, text=True, timeout=300, env=e)
    assert p.returncode == expect, (p.returncode, p.stdout, p.stderr)
    assert not d.exists()  # the bench removed what it created, pass or fail
    return p


def test_a_row_whose_pools_filled_up_says_so(terrace, toy_model, tmp_path):
    flags = ("--prefix-tokens", "256,1024", "--chunk-tokens", "64", *FULL_POOLS)
    p = bench(terrace, toy_model, tmp_path / "b", *flags, "--json")
    rows = {r["prefix_tokens"]: r for r in json.loads(p.stdout)["rows"]}
    ok, full = rows[256], rows[1024]
    assert ok["write_failures"] == 0 and ok["restored_tokens"] == ok["restorable_tokens"] == 256
    assert full["write_failures"] > 0 and full["restorable_tokens"] == 1024
    assert full["restored_tokens"] < 1024
    warning = [line for line in p.stderr.splitlines() if "warning: prefix 1024 tokens" in line]
    assert len(warning) == 1, p.stderr
    assert f"restored only {full['restored_tokens']} of the prefix's 1024 tokens" in warning[0]
    assert "--store-nvme-size" in warning[0] and "--state-nvme-size" in warning[0]
    assert "warning: prefix 256 tokens" not in p.stderr
    # The report says it too, and marks the row in the hit-rate chart.
    src = tmp_path / "kv.json"
    src.write_text(p.stdout)
    out = tmp_path / "kv.html"
    terrace("report", src, "-o", out, check=True)
    html = out.read_text()
    assert f"restored only {full['restored_tokens']} of the prefix&#39;s 1024 tokens" in html or \
        f"restored only {full['restored_tokens']} of the prefix's 1024 tokens" in html
    assert ">1k!<" in html and ">256!<" not in html
    # The text marks the row's restored count and explains the mark.
    t = bench(terrace, toy_model, tmp_path / "b", *flags)
    table = {line.split()[0]: line.split() for line in t.stdout.splitlines() if line.split()[:1] in (["256"], ["1024"])}
    assert table["1024"][1] == f"{full['restored_tokens']}!" and table["256"][1] == "256"
    assert "! turn 1's block writes failed" in t.stdout
    assert f"prefix 1024: restored {full['restored_tokens']} of 1024 tokens" in t.stdout


def test_logits_checks_are_printed_and_a_failed_one_fails_the_run(terrace, toy_model, tmp_path):
    f32 = ("--prefix-tokens", "128", "--chunk-tokens", "32", "--kv-codec", "f32", "--state-codec", "f32", *SMALL_POOLS)
    p = bench(terrace, toy_model, tmp_path / "b", *f32)
    assert ("prefix 128: logits bitwise equal: warm vs cold prepared yes, cold unprepared vs cold prepared yes, cold "
            "prepared across rounds yes; max rel err vs recompute 0 (must be 0 with f32 codecs: ok)") in p.stdout
    j = json.loads(bench(terrace, toy_model, tmp_path / "b", *f32, "--json").stdout)
    assert j["rows"][0]["failed_checks"] == [] and j["rows"][0]["lossless_codecs"] is True
    # A warm restore whose logits differ (one moved by the test hook): the output is printed, then exit 1.
    p = bench(terrace, toy_model, tmp_path / "b", *f32, "--json", env={"TERRACE_TEST_BENCH_KV_SKEW": "warm"}, expect=1)
    row = json.loads(p.stdout)["rows"][0]
    assert row["warm_logits_bitwise_equal"] is False and row["failed_checks"] == ["warm_logits_bitwise_equal"]
    assert "check failed: warm_logits_bitwise_equal" in p.stderr
    p = bench(terrace, toy_model, tmp_path / "b", *f32, env={"TERRACE_TEST_BENCH_KV_SKEW": "warm"}, expect=1)
    assert "warm vs cold prepared NO" in p.stdout
    # f32 codecs: the restored run must be the recompute, bitwise.
    p = bench(terrace, toy_model, tmp_path / "b", *f32, env={"TERRACE_TEST_BENCH_KV_SKEW": "recompute"}, expect=1)
    assert "must be 0 with f32 codecs: FAILED" in p.stdout
    assert "check failed: logits_max_rel_err_vs_recompute" in p.stderr
    # A lossy codec differs from the recompute by design: not a failure.
    lossy = ("--prefix-tokens", "128", "--chunk-tokens", "32", "--kv-codec", "bf16", *SMALL_POOLS)
    p = bench(terrace, toy_model, tmp_path / "b", *lossy, env={"TERRACE_TEST_BENCH_KV_SKEW": "recompute"})
    assert "(lossy codec: not checked)" in p.stdout


@pytest.mark.parametrize("kv,state", [("bf16+zstd", "f32+lz4"), ("int8", "bf16+zstd")])
def test_codec_table_marks_the_base_of_a_codec_with_a_lossless_stage(terrace, toy_model, tmp_path, kv, state):
    p = bench(terrace, toy_model, tmp_path / "b", "--prefix-tokens", "64", "--chunk-tokens", "32", "--kv-codec", kv,
              "--state-codec", state, *SMALL_POOLS)
    base_kv, base_state = kv.split("+")[0], state.split("+")[0]
    marked = [line.split()[0] + " " + " ".join(line.split()[1:3]) for line in p.stdout.splitlines() if "(run:" in line]
    assert f"{base_kv} (run: kv)" in marked, p.stdout
    assert f"{base_state} (run: state)" in marked, p.stdout
