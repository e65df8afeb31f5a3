"""`terrace plan --trace`: what the replay says about the trace's load on the hardware, its timing with
absolute timestamps, and its parse errors and warnings (docs/plan.md, "Trace format" and "Trace replay")."""
import json
import subprocess
from pathlib import Path

HEAD200 = Path(__file__).resolve().parents[1] / "plan" / "data" / "mooncake_head200.jsonl"


def write_trace(path, requests):
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def plan_json(terrace, *args):
    r = terrace("plan", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def unique_requests(n, blocks, step_ms, first_ms=0):
    """n requests of `blocks` 512-token blocks each, no id shared, `step_ms` apart."""
    return [{"timestamp": first_ms + i * step_ms, "input_length": blocks * 512, "output_length": 1,
             "hash_ids": list(range(i * blocks, (i + 1) * blocks))} for i in range(n)]


# Small tiers, so that every new K3 block (~900 MiB with its KDA snapshots) is demoted to host and then
# written into NVMe.
SMALL_TIERS = ("--kv-hbm", "2GiB", "--kv-host", "4GiB", "--policy", "lru")


def trace_warnings(j):
    return [w for w in j["warnings"] if w.startswith("trace replay")]


def test_heavy_trace_warns_of_nvme_writes_and_recompute_over_the_hardware(terrace, tmp_path):
    # 200 requests of 10 new blocks in 1 s: ~1800 GB/s into NVMe, 1M tokens/s of prefill.
    t = write_trace(tmp_path / "heavy.jsonl", unique_requests(200, 10, 5))
    j = plan_json(terrace, "--trace", t, *SMALL_TIERS)
    load = j["trace"]["policies"][0]["load"]
    assert load["duration_s"] == 0.995
    nvme = next(x for x in load["tiers"] if x["name"] == "nvme")
    assert nvme["write_utilisation"] > 1, load
    assert nvme["write_bytes_per_s"] == nvme["max_node_bytes_written"] / 0.995
    assert load["max_node_recomputed_tokens"] == 200 * 10 * 512
    assert load["prefill_utilisation"] > 1, load
    warns = trace_warnings(j)
    assert any("writes" in w and "into nvme" in w and "nvme_write_bandwidth" in w and "not time writes" in w
               for w in warns), j["warnings"]
    assert any("recomputing the prompt tokens not hit" in w and "prefill" in w for w in warns), j["warnings"]
    # The text output prints them as warning: lines.
    text = terrace("plan", "--trace", t, *SMALL_TIERS).stdout
    for w in warns:
        assert f"warning: {w}\n" in text


def test_light_trace_has_no_load_warning(terrace, tmp_path):
    # The same blocks spread over 200,000 s.
    t = write_trace(tmp_path / "light.jsonl", unique_requests(200, 10, 1_000_000))
    j = plan_json(terrace, "--trace", t, *SMALL_TIERS)
    assert trace_warnings(j) == [], j["warnings"]
    load = j["trace"]["policies"][0]["load"]
    assert all(x["write_utilisation"] < 1 for x in load["tiers"]) and load["prefill_utilisation"] < 1, load


def test_a_trace_of_one_timestamp_has_no_rates(terrace, tmp_path):
    t = write_trace(tmp_path / "once.jsonl", unique_requests(20, 10, 0))
    j = plan_json(terrace, "--trace", t, *SMALL_TIERS)
    load = j["trace"]["policies"][0]["load"]
    assert load["duration_s"] == 0 and load["recompute_tokens_per_s"] is None and load["prefill_utilisation"] is None
    assert trace_warnings(j) == []
    assert any("spans 0 s" in n for n in j["trace"]["notes"]), j["trace"]["notes"]


def test_analytic_warnings_beside_a_trace_name_the_flags(terrace, tmp_path):
    bare = plan_json(terrace)
    assert bare["warnings"], "the default plan warns (prefill over the GPUs' compute, ...)"
    assert not any(w.startswith("analytic plan at") for w in bare["warnings"])
    j = plan_json(terrace, "--trace", HEAD200, "--policy", "lru")
    analytic = [w for w in j["warnings"] if not w.startswith("trace replay")]
    assert len(analytic) == len(bare["warnings"])
    prefix = ("analytic plan at --rate 1 --context 32k --prefix-reuse 0.5 --concurrency 32 --decode-tokens 512 "
              "(from these flags, not from the trace): ")
    for w, plain in zip(analytic, bare["warnings"]):
        assert w == prefix + plain
    text = terrace("plan", "--trace", HEAD200, "--policy", "lru").stdout
    assert f"warning: {prefix}" in text


def shifted(src, dst, offset):
    lines = []
    for line in src.read_text().splitlines():
        r = json.loads(line)
        r["timestamp"] += offset
        lines.append(r)
    return write_trace(dst, lines)


FIGURES = ("restore_s", "queue_wait_s", "ttft_saved_s", "restores_slower_than_recompute", "hit_rate")


def test_replay_timing_does_not_depend_on_a_constant_timestamp_offset(terrace, tmp_path):
    base = plan_json(terrace, "--trace", HEAD200, "--policy", "lru")["trace"]["policies"][0]
    assert base["restore_s"] > 0
    for offset in (1_700_000_000_000_000_000, 1_700_000_000_000_000, 1_700_000_000_000):
        t = shifted(HEAD200, tmp_path / f"off{offset}.jsonl", offset)
        p = plan_json(terrace, "--trace", t, "--policy", "lru")["trace"]["policies"][0]
        for key in FIGURES:
            assert p[key] == base[key], (offset, key, p[key], base[key])
        assert p["load"] == base["load"]


def test_no_queueing_is_exactly_zero_wait(terrace):
    j = plan_json(terrace, "--trace", HEAD200, "--policy", "lru")
    # No restore of this trace waits for another (it summed to 1.26e-15 s of rounding residue).
    assert j["trace"]["policies"][0]["queue_wait_s"] == 0.0


def test_mismatch_warning_names_an_exporter_that_drops_the_partial_last_block(terrace, tmp_path):
    # input 1300 tokens: ceil(1300/512) = 3 ids expected, floor = 2 given.
    floor = write_trace(tmp_path / "floor.jsonl", [
        {"timestamp": 0, "input_length": 1300, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 2, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2]}])
    j = plan_json(terrace, "--trace", floor, "--policy", "lru")
    assert j["trace"]["blocks_not_matching_input_length"] == 2
    w = [w for w in j["warnings"] if "hash_ids count" in w]
    assert len(w) == 1 and w[0].startswith("2 requests have a hash_ids count of floor(input_length / 512)"), w
    assert "partial last block" in w[0] and "is --trace-block-tokens right?" not in w[0]
    # One request with a count that is neither: the old hint, in the singular.
    other = write_trace(tmp_path / "other.jsonl", [
        {"timestamp": 0, "input_length": 1300, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 1300, "output_length": 1, "hash_ids": [1]}])
    j = plan_json(terrace, "--trace", other, "--policy", "lru")
    w = [w for w in j["warnings"] if "hash_ids count" in w]
    assert len(w) == 1 and w[0].startswith("1 request has a hash_ids count that does not match"), w
    assert w[0].endswith("is --trace-block-tokens right?")


def test_one_request_trace_header_is_singular(terrace, tmp_path):
    t = write_trace(tmp_path / "one.jsonl", unique_requests(1, 2, 1))
    out = terrace("plan", "--trace", t, "--policy", "lru", check=True).stdout
    assert f"trace {t}: 1 request, 2 blocks" in out, out


def plan_error(terrace, path):
    r = terrace("plan", "--trace", path)
    assert r.returncode == 2, r.stdout
    return r.stderr


def test_syntax_error_column_is_of_the_files_line(terrace, tmp_path):
    t = tmp_path / "bad.jsonl"
    t.write_text('{"timestamp": 1, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n'
                 '{"timestamp": 2, "input_length": 3, x}\n')
    err = plan_error(terrace, t)
    assert f"{t}:2: " in err and "column 37 of that line" in err and "line 1," not in err, err


def test_cr_line_endings_are_named(terrace, tmp_path):
    t = tmp_path / "mac.jsonl"
    line = '{"timestamp": 1, "input_length": 3, "output_length": 1, "hash_ids": [1]}'
    t.write_bytes((line + "\r" + line + "\r").encode())
    err = plan_error(terrace, t)
    assert "the file uses CR line endings" in err and "tr '\\r' '\\n'" in err, err


def test_invalid_utf8_is_escaped_in_the_error(terrace, tmp_path):
    t = tmp_path / "latin1.jsonl"
    t.write_bytes(b'{"timestamp": 2, "input_length": \xe9\xff}\n')
    p = subprocess.run([terrace.path, "plan", "--trace", str(t)], capture_output=True, timeout=120)  # stderr as bytes
    assert p.returncode == 2
    assert b"\xe9" not in p.stderr and b"\xff" not in p.stderr, p.stderr
    assert b"\\xe9" in p.stderr, p.stderr
    p.stderr.decode("utf-8")  # valid UTF-8 throughout


def test_report_shows_each_policys_load_as_the_json_says(terrace, tmp_path):
    t = write_trace(tmp_path / "heavy.jsonl", unique_requests(200, 10, 5))
    r = terrace("plan", "--trace", t, *SMALL_TIERS, "--json")
    assert r.returncode == 0, r.stderr
    src = tmp_path / "plan.json"
    src.write_text(r.stdout)
    out = tmp_path / "plan.html"
    terrace("report", src, "-o", out, check=True)
    html = out.read_text()
    assert "Load on the busiest node" in html
    load = json.loads(r.stdout)["trace"]["policies"][0]["load"]
    for tier in load["tiers"]:
        assert f"writes into {tier['name']}" in html
        assert f"({100 * tier['write_utilisation']:.1f}% of the hardware)" in html
    assert f"{load['recompute_tokens_per_s']:.0f} tokens/s ({100 * load['prefill_utilisation']:.1f}% of the hardware)" in html
