"""`terrace plan` and `terrace trace gen` end to end: JSON keys, exit codes and messages, and the
prefix-hit ceiling against an independent Python oracle."""
import json
import os
import pathlib
import re
import signal
import subprocess

import pytest

DATA = pathlib.Path(os.environ.get("PLAN_TEST_DATA", pathlib.Path(__file__).parent / "data"))
FIXTURE = DATA / "mooncake_head200.jsonl"


@pytest.fixture(scope="session")
def terrace():
    import subprocess

    path = os.environ.get("TERRACE_BIN")
    if not path or not os.path.exists(path):
        pytest.skip("TERRACE_BIN is not set to the built terrace binary")

    def run(*args, timeout=120):
        try:
            return subprocess.run([path, *map(str, args)], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"terrace {' '.join(map(str, args))} hung")

    return run


def inclusion(experts, zipf_s, top_k):
    """P(expert i is among a token's top_k distinct picks): min(1, c w_i), Zipf weights, summing to top_k."""
    w = [1 / (i + 1) ** zipf_s for i in range(experts)]
    w = [x / sum(w) for x in w]
    if top_k >= experts:
        return [1.0] * experts
    sat = 0
    while True:
        c = (top_k - sat) / sum(w[sat:])
        if c * w[sat] <= 1:
            break
        sat += 1
    return [1.0] * sat + [min(1.0, c * x) for x in w[sat:]]


def oracle_ceiling(path, restore_every_blocks=1):
    """Share of blocks in a leading run of ids all seen in earlier requests, the run cut back to a
    whole multiple of restore_every_blocks."""
    seen, hits, blocks = set(), 0, 0
    for line in pathlib.Path(path).read_text().splitlines():
        if not line.strip():
            continue
        ids = json.loads(line)["hash_ids"]
        run = 0
        while run < len(ids) and ids[run] in seen:
            run += 1
        hits += run - run % restore_every_blocks
        blocks += len(ids)
        seen.update(ids)
    return hits / blocks


def test_plan_json_has_the_documented_keys_and_k3_sizes(terrace):
    r = terrace("plan", "--model", "kimi-k3", "--hardware", "h200-gen5", "--kv-codec", "bf16", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["memory"]["mla_bytes_per_token"] == 24 * 576 * 2
    assert j["memory"]["kda_recurrent_bytes_per_layer"] == 96 * 128 * 128 * 4
    assert j["memory"]["kda_state_bytes_per_sequence"] == 69 * (96 * 128 * 128 + 3 * 3 * 96 * 128) * 4
    assert [p["tokens"] for p in j["memory"]["curve"]] == [1024 << i for i in range(11)]
    assert {t["name"] for t in j["tiers"]} == {"hbm", "host", "nvme"}
    assert "trace" not in j
    fp8 = json.loads(terrace("plan", "--kv-codec", "fp8", "--json").stdout)
    assert fp8["memory"]["mla_bytes_per_token"] * 2 == j["memory"]["mla_bytes_per_token"]


def test_plan_text_output(terrace):
    r = terrace("plan", "--model", "k3-small", "--hardware", "h100-gen4")
    assert r.returncode == 0, r.stderr
    for word in ("MLA latents", "KDA state", "AttnRes bank", "memory vs context", "expert cache", "lifecycle"):
        assert word in r.stdout


def test_plan_trace_json_and_ceiling_match_an_independent_oracle(terrace):
    r = terrace("plan", "--model", "k3-small", "--trace", FIXTURE, "--json", "--nodes", "2")
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)["trace"]
    assert t["requests"] == 200
    assert t["prefix_hit_ceiling"] == pytest.approx(oracle_ceiling(FIXTURE), abs=1e-12)
    assert {p["policy"] for p in t["policies"]} == {"lru", "s3fifo"}
    for p in t["policies"]:
        assert 0 <= p["hit_rate"] <= t["prefix_hit_ceiling"] + 1e-12
    # The sweep's full-footprint point is an infinite cache: the ceiling.
    full = [s for s in t["sweep"] if s["capacity_share_of_footprint"] == 1.0]
    assert len(full) == 2
    for s in full:
        assert s["hit_rate"] == pytest.approx(t["prefix_hit_ceiling"])
    assert {c["routing"] for c in t["cluster"]} == {"prefix-affinity", "round-robin"}


def test_trace_gen_output_is_read_by_plan(terrace, tmp_path):
    out = tmp_path / "gen.jsonl"
    r = terrace("trace", "gen", "--requests", "500", "--seed", "4", "--turns", "2", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "expected" in r.stdout
    again = terrace("trace", "gen", "--requests", "500", "--seed", "4", "--turns", "2")
    assert again.stdout == out.read_text()
    p = terrace("plan", "--model", "k3-small", "--trace", out, "--json", "--sweep-points", "2")
    assert p.returncode == 0, p.stderr
    t = json.loads(p.stdout)["trace"]
    assert t["requests"] == 500
    assert t["prefix_hit_ceiling"] == pytest.approx(oracle_ceiling(out), abs=1e-12)
    assert t["blocks_not_matching_input_length"] == 0


@pytest.mark.parametrize("args,flag", [
    (["--kv-codec", "nope"], "--kv-codec"),
    (["--model", "gpt-9"], "--model"),
    (["--hardware", "a100"], "--hardware"),
    (["--prefix-reuse", "2"], "--prefix-reuse"),
    (["--concurrency", "0"], "--concurrency"),
    (["--policy", "lfu"], "--policy"),
    (["--trace", "/nonexistent/t.jsonl"], "--trace"),
])
def test_bad_arguments_exit_2_naming_the_flag(terrace, args, flag):
    r = terrace("plan", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert flag in r.stderr
    assert r.stderr.startswith("terrace: error:")


def test_bad_trace_line_names_file_and_line(terrace, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = FIXTURE.read_text().splitlines()[:2] + ['{"timestamp": 5, "input_length": 3, "hash_ids": [1]}']
    bad.write_text("\n".join(lines) + "\n")
    r = terrace("plan", "--trace", bad)
    assert r.returncode == 2
    assert f"{bad}:3:" in r.stderr and "output_length" in r.stderr


def test_hardware_file(terrace, tmp_path):
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"base": "h100-gen4", "gpus": 2, "name": "two"}))
    j = json.loads(terrace("plan", "--hardware", hw, "--json").stdout)
    assert j["hardware"]["gpus"] == 2 and j["hardware"]["name"] == "two"
    hw.write_text(json.dumps({"base": "h100-gen4", "hbm": 1}))
    r = terrace("plan", "--hardware", hw)
    assert r.returncode == 2 and "hbm" in r.stderr and "known keys" in r.stderr


def test_report_from_plan_json(terrace, tmp_path):
    import xml.etree.ElementTree as ET

    run = tmp_path / "run.json"
    r = terrace("plan", "--model", "k3-small", "--trace", FIXTURE, "--json", "--sweep-points", "4")
    assert r.returncode == 0, r.stderr
    run.write_text(r.stdout)
    out = tmp_path / "report.html"
    r = terrace("report", run, "-o", out, "--svg")
    assert r.returncode == 0, r.stderr
    html = out.read_text()
    assert html.startswith("<!DOCTYPE html>") and "<script" not in html
    weights = json.loads(run.read_text())["weights"]  # the formats in the Weights table, not only in "All values"
    assert (f"<tr><th>routed experts&#39; format</th><td>{weights['expert_format']}</td></tr>" in html or
            f"<tr><th>routed experts&apos; format</th><td>{weights['expert_format']}</td></tr>" in html), html[:0]
    svgs = sorted(p.name for p in tmp_path.glob("report-*.svg"))
    assert svgs == ["report-hit-rate-vs-capacity.svg", "report-memory-vs-context.svg", "report-stall-per-token.svg",
                    "report-tier-hit-rates.svg"]
    for name in svgs:
        root = ET.parse(tmp_path / name).getroot()  # well-formed XML
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        assert (tmp_path / name).read_text() in html
    # The sweep's polyline per policy has one point per capacity.
    root = ET.parse(tmp_path / "report-hit-rate-vs-capacity.svg").getroot()
    lines = {p.get("data-name"): p.get("points").split() for p in root.iter("{http://www.w3.org/2000/svg}polyline")}
    assert len(lines["lru"]) == len(lines["s3fifo"]) == 4
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    r = terrace("report", bad, "-o", tmp_path / "x.html")
    assert r.returncode == 2 and "not a JSON object" in r.stderr
    r = terrace("report", tmp_path / "missing.json", "-o", tmp_path / "x.html")
    assert r.returncode == 2


@pytest.mark.parametrize("args,flag", [
    (["--policy", "lru"], "--policy"),
    (["--nodes", "4"], "--nodes"),
    (["--kv-hbm", "1GiB"], "--kv-hbm"),
    (["--kv-host", "1GiB"], "--kv-host"),
    (["--kv-nvme", "1GiB"], "--kv-nvme"),
    (["--sweep-points", "3"], "--sweep-points"),
    (["--trace-block-tokens", "256"], "--trace-block-tokens"),
    (["--placement", "inclusive"], "--placement"),
    (["--write-policy", "write-through"], "--write-policy"),
    (["--trace", FIXTURE, "--routing", "round-robin"], "--nodes"),
    (["--context", "32x"], "token count"),
    (["--context", "4k:0.5,32k"], "weight"),
    (["--context", "0"], "tokens"),
    (["--model", "k3-small", "--expert-cache", "100TiB"], "--expert-cache"),
])
def test_flags_that_would_be_ignored_or_wrong_are_refused(terrace, args, flag):
    """A flag is either honoured or refused: trace-only flags without --trace, --routing on one node,
    malformed token counts (in tokens, not bytes) and an expert cache larger than the HBM exit 2."""
    r = terrace("plan", *args)
    assert r.returncode == 2, (args, r.stdout[-500:], r.stderr)
    assert flag in r.stderr
    assert " B " not in r.stderr and "bytes)" not in r.stderr  # a token count is not a size in bytes


def plan_json(terrace, *args):
    r = terrace("plan", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("flag,a,b,key", [
    ("--rate", "1", "2", lambda j: [x["required_bytes_per_s"] for x in j["bandwidth"]]),
    ("--context", "32k", "4k:0.5,128k:0.5", lambda j: j["memory"]["sequence_bytes"]),
    ("--prefix-reuse", "0.5", "0.9", lambda j: j["lifecycle"]["prefill_tokens_needed_per_s"]),
    ("--concurrency", "32", "64", lambda j: j["lifecycle"]["decode_step_s"]),
    ("--decode-tokens", "512", "1024", lambda j: j["memory"]["sequence_bytes"]),
    ("--kv-codec", "bf16", "fp8", lambda j: j["memory"]["mla_bytes_per_token"]),
    ("--state-codec", "f32", "bf16", lambda j: j["memory"]["kda_state_bytes_per_sequence"]),
    ("--hardware", "h200-gen5", "h100-gen4", lambda j: j["tiers"][0]["sequences"]),
    ("--expert-cache", "8MiB", "64MiB", lambda j: j["experts"]["hit_rate"]),
    ("--gqa-kv-heads", "8", "4", lambda j: j["memory"]["gqa_bytes_per_token"]),
])
def test_every_input_changes_the_plan(terrace, flag, a, b, key):
    base = ["--model", "k3-small"]
    assert key(plan_json(terrace, *base, flag, a)) != key(plan_json(terrace, *base, flag, b))


def test_context_distribution_json(terrace):
    j = plan_json(terrace, "--model", "k3-small", "--context", "4k:1,128k:3")
    w, m = j["workload"], j["memory"]
    assert w["context_distribution"] == [{"tokens": 4096, "share": 0.25}, {"tokens": 131072, "share": 0.75}]
    assert w["context_tokens_mean"] == pytest.approx(0.25 * 4096 + 0.75 * 131072)
    assert w["context_tokens"] == round(0.25 * 4096 + 0.75 * 131072)
    assert plan_json(terrace, "--model", "k3-small")["workload"]["context_tokens"] == 32768  # an integer
    assert m["longest_sequence_tokens"] == 131072 + 512
    rows = m["per_context"]
    assert [r["sequence_tokens"] for r in rows] == [4096 + 512, 131072 + 512]
    for r in rows:
        assert r["sequence_bytes"] == r["sequence_tokens"] * m["mla_bytes_per_token"] + m["kda_state_bytes_per_sequence"]
    for t in j["tiers"]:
        assert t["sequences_longest"] == t["kv_bytes"] // m["longest_sequence_bytes"]
    text = terrace("plan", "--model", "k3-small", "--context", "4k:1,128k:3").stdout
    assert "--context distribution" in text and "if all longest" in text


def test_warnings_name_the_flags(terrace):
    j = plan_json(terrace, "--model", "k3-small", "--concurrency", "100000")
    assert any("--concurrency 100000" in w for w in j["warnings"])
    light = plan_json(terrace, "--model", "k3-small", "--rate", "0.01")
    assert light["warnings"] == []
    r = terrace("plan", "--model", "k3-small", "--concurrency", "100000")
    assert "warning: --concurrency 100000" in r.stdout


def test_help_shows_no_fake_defaults(terrace):
    h = terrace("plan", "--help").stdout
    for flag in ("--expert-cache", "--kv-hbm", "--kv-host", "--kv-nvme", "--context"):
        line = next(l for l in h.splitlines() if l.strip().startswith(flag))
        assert "default 0 B" not in line and " B to " not in line, line



def test_trace_replay_follows_the_store_placement_flags(terrace):
    """--placement / --write-policy reach the replay: write-through writes every new block to the
    lowest tier too, so it moves more bytes than write-back on the same trace (with HBM for most of
    the trace's ~5000 blocks of 3 MiB, KV and KDA snapshots: few demotions)."""
    args = ["--model", "k3-small", "--trace", FIXTURE, "--kv-hbm", "14GiB", "--kv-host", "56GiB", "--sweep-points", "1",
            "--policy", "lru"]
    wb = plan_json(terrace, *args)["trace"]
    wt = plan_json(terrace, *args, "--write-policy", "write-through")["trace"]
    inc = plan_json(terrace, *args, "--placement", "inclusive")["trace"]
    assert (wb["placement"], wb["write_policy"]) == ("exclusive", "write-back")
    assert (inc["placement"], wt["write_policy"]) == ("inclusive", "write-through")
    # NVMe never fills here, so each distinct block is computed once and written through once; every
    # victim above it then has an NVMe copy and is dropped without a demotion write.
    nvme = [t for t in wt["policies"][0]["tiers"] if t["name"] == "nvme"][0]
    assert nvme["bytes_written"] == wt["unique_blocks"] * wt["stored_block_bytes"]
    assert [t for t in wb["policies"][0]["tiers"] if t["name"] == "nvme"][0]["bytes_written"] < nvme["bytes_written"]
    assert wt["policies"][0]["bytes_moved"] > wb["policies"][0]["bytes_moved"]
    assert inc["policies"][0]["hit_rate"] == pytest.approx(wb["policies"][0]["hit_rate"])
    # Under write-through host gets no block (its size changes nothing): the output says so.
    host = [t for t in wt["policies"][0]["tiers"] if t["name"] == "host"][0]
    assert host["bytes_written"] == 0 and host["hit_blocks"] == 0
    assert any("host receives no block" in n for n in wt["notes"]), wt["notes"]
    assert not any("host receives no block" in n for n in wb["notes"])
    text = terrace("plan", *args, "--write-policy", "write-through").stdout
    assert "note: with --write-policy write-through every block is also written to nvme" in text
    # Without an HBM tier host is the first tier: it takes the blocks, and no such note.
    no_hbm = plan_json(terrace, *[a if a != "14GiB" else "0" for a in args], "--write-policy", "write-through")
    no_hbm = no_hbm["trace"]
    assert [t for t in no_hbm["policies"][0]["tiers"] if t["name"] == "host"][0]["hit_blocks"] > 0
    assert not any("host receives no block" in n for n in no_hbm["notes"])


def test_model_directory_or_config_json_plans_like_the_preset(terrace, tmp_path):
    r = terrace("model", "init", "--preset", "k3-toy", "--out", tmp_path / "toy")
    assert r.returncode == 0, r.stderr
    want = plan_json(terrace, "--model", "k3-toy")
    assert want["weights"].pop("expert_format_from") == "as `terrace model init` writes them"
    for given in (tmp_path / "toy", tmp_path / "toy" / "config.json"):
        got = plan_json(terrace, "--model", given)
        assert got["model"] == str(given)
        got["model"] = want["model"]
        # The experts' format comes from the checkpoint's tensors (MXFP4, as `model init` writes them).
        assert got["weights"].pop("expert_format_from") == "the checkpoint's tensors"
        assert got == want
    # config.json copied away from its checkpoint: its quantization_config says MXFP4, as the tensors do.
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_bytes((tmp_path / "toy" / "config.json").read_bytes())
    bare = plan_json(terrace, "--model", tmp_path / "bare" / "config.json")
    assert bare["weights"].pop("expert_format_from") == "config.json's quantization_config"
    assert bare["weights"] == want["weights"]
    r = terrace("plan", "--model", tmp_path)  # a directory without config.json
    assert r.returncode == 2 and "--model" in r.stderr and "config.json" in r.stderr
    # A config.json that is read but does not parse: a model that does not open (exit 1, docs/errors.md),
    # as `model run --model` says of it.
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    r = terrace("plan", "--model", tmp_path / "broken")
    assert r.returncode == 1 and "--model" in r.stderr and "num_hidden_layers" in r.stderr, r.stderr


def test_bad_trace_prints_only_the_error(terrace, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = terrace("plan", "--trace", empty)
    assert r.returncode == 2 and "empty" in r.stderr
    assert r.stdout == ""  # no plan printed before the refusal
    r = terrace("plan", "--model", "k3-small", "--trace", FIXTURE, "--kv-hbm", "0", "--kv-host", "0", "--kv-nvme", "0")
    assert r.returncode == 2 and "--kv-hbm" in r.stderr and r.stdout == ""


def test_duplicate_key_in_a_trace_line_is_refused_naming_file_line_and_key(terrace, tmp_path):
    bad = tmp_path / "dup.jsonl"
    lines = FIXTURE.read_text().splitlines()[:1]
    lines.append('{"timestamp": 99999, "input_length": 1000, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}')
    bad.write_text("\n".join(lines) + "\n")
    r = terrace("plan", "--trace", bad)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f'{bad}:2: duplicate key "input_length"' in r.stderr
    assert r.stdout == ""


def test_nul_byte_in_a_trace_line_or_hardware_file_is_refused_naming_where(terrace, tmp_path):
    """The JSON parser read a NUL byte as the end of the text and ignored the rest: a trace line of two
    requests parsed as one, a hardware file's keys after the NUL were dropped (gpus stayed 8)."""
    first = '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}'
    bad = tmp_path / "nul.jsonl"
    bad.write_bytes(first.encode() + b"\n" + first.encode() + b"\x00" +
                    b'{"timestamp": 5, "input_length": 512, "output_length": 1, "hash_ids": [2]}\n')
    r = terrace("plan", "--trace", bad, "--sweep-points", "1", "--json")
    assert r.returncode == 2, (r.stdout, r.stderr)
    # The column of the file's line 2, not "line 1" (the parser sees the line alone).
    where = f"column {len(first) + 1} of that line (byte offset {len(first)})"
    assert f"{bad}:2: not valid JSON: a NUL byte at {where}" in r.stderr
    assert r.stdout == ""
    hw = tmp_path / "hw.json"
    hw.write_bytes(b'{"base": "h200-gen5"}\n\x00{"gpus": 1}')
    r = terrace("plan", "--hardware", hw, "--json")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"--hardware: {hw}: not valid JSON: a NUL byte at line 2, column 1 (byte offset 22)" in r.stderr
    assert r.stdout == ""


def block_lengths_agree(path, block_tokens=512):
    """Mooncake's hash ids name blocks chained from the prompt's start: an id stands for the same
    tokens wherever it appears, so it never names blocks of two lengths (a partial last block that
    recurs as a full one). Returns the first id that does, or None."""
    tokens = {}
    for line in pathlib.Path(path).read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        for i, h in enumerate(r["hash_ids"]):
            n = max(0, min(block_tokens, r["input_length"] - i * block_tokens))
            if tokens.setdefault(h, n) != n:
                return h
    return None


def test_trace_gen_shares_only_full_blocks_like_the_real_trace(terrace, tmp_path):
    assert block_lengths_agree(FIXTURE) is None  # the real trace's property
    # The reviewer's repro: turn 1 is [0, 1] (738 tokens: block 1 partial); turn 2 extends it, so
    # its block 1 is another block. Only block 0 (512 tokens) was cached for it.
    out = tmp_path / "two.jsonl"
    r = terrace("trace", "gen", "--requests", "2", "--prefixes", "1", "--prefix-blocks", "1", "--turn-blocks", "1",
                "--turns", "2", "--seed", "3", "-o", out)
    assert r.returncode == 0, r.stderr
    a, b = [json.loads(l) for l in out.read_text().splitlines()]
    assert a["input_length"] % 512 != 0 and len(a["hash_ids"]) == 2 and len(b["hash_ids"]) == 3
    assert b["hash_ids"][0] == a["hash_ids"][0] and b["hash_ids"][1] not in a["hash_ids"]
    t = plan_json(terrace, "--model", "k3-toy", "--trace", out, "--policy", "lru", "--sweep-points", "1")["trace"]
    assert t["policies"][0]["hit_tokens"] == 512
    many = tmp_path / "many.jsonl"
    assert terrace("trace", "gen", "--requests", "3000", "--seed", "5", "--turns", "4", "-o", many).returncode == 0
    assert block_lengths_agree(many) is None


@pytest.mark.parametrize("doc,note", [
    ({"kind": "plan", "workload": 5}, "Not charted: the workload (workload is not an object)"),
    ({"kind": "plan", "weights": [1]}, "Not charted: the weights (weights is not an object)"),
    ({"kind": "plan", "trace": 5}, "Not charted: the trace replay (trace is not an object)"),
    ({"turns": [], "summary": {}, "verified": "yes"}, "verified is missing or not true or false"),
])
def test_report_of_wrongly_typed_json_renders_with_a_note(terrace, tmp_path, doc, note):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(doc))
    out = tmp_path / "r.html"
    r = terrace("report", run, "-o", out)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "internal error" not in r.stderr
    assert note in out.read_text()


def run_bytes(*args):
    """terrace with arguments that need not be UTF-8 (bytes)."""
    import subprocess

    path = os.environ.get("TERRACE_BIN")
    if not path or not os.path.exists(path):
        pytest.skip("TERRACE_BIN is not set to the built terrace binary")
    return subprocess.run([os.fsencode(path), *[a if isinstance(a, bytes) else os.fsencode(str(a)) for a in args]],
                          capture_output=True, timeout=120)


def test_json_output_survives_names_that_are_not_utf8(terrace, tmp_path):
    """A trace path, a model path or a hardware file path need not be UTF-8; --json replaces the bad
    bytes (U+FFFD) instead of failing with nlohmann's type_error.316 and printing nothing."""
    trace = os.fsencode(tmp_path) + b"/s\xe9.jsonl"
    with open(trace, "wb") as f:
        f.write("\n".join(FIXTURE.read_text().splitlines()[:5]).encode() + b"\n")
    preset = plan_json(terrace, "--hardware", "h100-gen4")["hardware"]
    del preset["name"]  # no "name" and no "base": the file's path is the name
    hw = os.fsencode(tmp_path) + b"/h\xe9.json"
    with open(hw, "wb") as f:
        f.write(json.dumps(preset).encode())
    r = run_bytes("plan", "--model", "k3-toy", "--trace", trace, "--hardware", hw, "--sweep-points", "1", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout.decode("utf-8"))
    assert j["trace"]["file"].endswith("s\ufffd.jsonl")
    assert j["hardware"]["name"].endswith("h\ufffd.json")
    assert j["trace"]["requests"] == 5
    # `terrace report` of that JSON, from a path that is not UTF-8 either: a well-formed page.
    run = os.fsencode(tmp_path) + b"/r\xe9.json"
    with open(run, "wb") as f:
        f.write(r.stdout)
    out = tmp_path / "page.html"
    rr = run_bytes("report", run, "-o", out)
    assert rr.returncode == 0, rr.stderr
    out.read_text(encoding="utf-8")  # valid UTF-8


def test_replay_sizes_blocks_with_their_kda_snapshots(terrace):
    """A hybrid model's KDA snapshots take tier room with the KV blocks: the footprint, the sweep's
    capacities and the tiers' block counts all count them (derived from the model, not typed in)."""
    j = plan_json(terrace, "--model", "kimi-k3", "--trace", FIXTURE, "--sweep-points", "2", "--policy", "lru")
    t, m = j["trace"], j["memory"]
    snapshot = m["kda_layers"] * m["state_block_bytes"]
    assert snapshot > 400 << 20  # K3: 69 KDA layers, f32 state: ~443 MiB per restore boundary
    assert t["restore_state_bytes"] == snapshot
    assert t["snapshots_per_block"] == 2  # 512-token blocks of two 256-token chunks, a snapshot after each
    assert t["snapshot_bytes_per_block"] == 2 * snapshot
    assert t["stored_block_bytes"] == t["block_bytes"] + 2 * snapshot
    assert t["snapshots_simulated"] is True
    assert t["footprint_kv_bytes"] == t["unique_blocks"] * t["block_bytes"]
    assert t["footprint_bytes"] == t["unique_blocks"] * t["stored_block_bytes"]
    assert max(s["capacity_bytes"] for s in t["sweep"]) == t["footprint_bytes"]
    for tier in t["policies"][0]["tiers"]:
        cap = [x for x in t["tiers"] if x["name"] == tier["name"]][0]["capacity_bytes"]
        assert tier["capacity_blocks"] == cap // t["stored_block_bytes"]
    # One chunk per block: one snapshot per block.
    one = plan_json(terrace, "--model", "kimi-k3", "--trace", FIXTURE, "--sweep-points", "1", "--policy", "lru",
                    "--chunk-tokens", "512")["trace"]
    assert one["snapshots_per_block"] == 1
    text = terrace("plan", "--model", "kimi-k3", "--trace", FIXTURE, "--sweep-points", "1", "--policy", "lru").stdout
    assert "note: a block is" in text and "KDA state" in text and "hit rates are for KV + snapshots" in text


def test_queued_restore_wait_is_printed_per_request(terrace, tmp_path):
    """The text table's and the report's restore wait was queue_wait_s summed over the whole trace,
    printed beside per-request TTFT saved. Ten requests at once restore the same 8-block prefix from
    host RAM (no HBM tier), so each waits for the ones before it on the PCIe link."""
    trace = tmp_path / "burst.jsonl"
    lines = [{"timestamp": 0, "input_length": 8 * 512, "output_length": 1, "hash_ids": list(range(1, 9))}]
    lines += [{"timestamp": 1000, "input_length": 9 * 512, "output_length": 1,
               "hash_ids": list(range(1, 9)) + [100 + i]} for i in range(10)]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ["--model", "kimi-k3", "--trace", trace, "--kv-hbm", "0", "--sweep-points", "1", "--policy", "lru"]
    r = terrace("plan", "--json", *args)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["trace"]["policies"][0]
    assert p["restores"] == 10 and p["queue_wait_s"] > 0
    per_request = p["queue_wait_s"] / 11
    assert p["queue_wait_s_per_request"] == pytest.approx(per_request)
    text = terrace("plan", *args).stdout.splitlines()
    header = next(i for i, line in enumerate(text) if "TTFT saved/req" in line)
    column = text[header].index("queued restore wait/req")
    cell = text[header + 1][column:column + len("queued restore wait/req")].strip()
    assert cell == f"{per_request * 1e3:.2f} ms", text[header:header + 2]  # Sec()'s format for 1 ms..1 s
    run = tmp_path / "run.json"
    run.write_text(r.stdout)
    html_path = tmp_path / "r.html"
    assert terrace("report", run, "-o", html_path).returncode == 0
    html = html_path.read_text()
    assert "<th>queued restore wait per request</th>" in html
    assert f"<td>{per_request * 1e3:.3g} ms</td>" in html


def write_prompts(path, prompts, block_tokens):
    """Writes prompts given as lists of 512-token block ids as a trace of `block_tokens`-token blocks:
    the same tokens, each 512-token block split into 512 / block_tokens ids of its own."""
    per = 512 // block_tokens
    with open(path, "w") as f:
        for ts, ids in enumerate(prompts):
            split = [i * per + k for i in ids for k in range(per)]
            f.write(json.dumps({"timestamp": ts * 10, "input_length": 512 * len(ids), "output_length": 1,
                                "hash_ids": split}) + "\n")


def test_ceiling_counts_hits_in_runs_of_restore_every_blocks_as_the_replay_does(terrace, tmp_path):
    """With 16-token trace blocks (a restore boundary every 16 blocks) the replay counts a prefix hit
    in whole runs of 16 blocks; the ceiling counted every seen block (0.96 against the infinite
    cache's 0.65 here), above what a cache of any size reaches. Shared prefixes of lengths that are
    not multiples of 16 blocks make the two differ."""
    import random

    rng = random.Random(1)
    path = tmp_path / "t16.jsonl"
    with open(path, "w") as f:
        for i in range(300):
            n, base = rng.randint(4, 40), rng.randint(0, 5) * 1000
            f.write(json.dumps({"timestamp": i * 100, "input_length": n * 16, "output_length": 10,
                                "hash_ids": [base + j for j in range(n)]}) + "\n")
    t = plan_json(terrace, "--model", "kimi-k3", "--trace", path, "--trace-block-tokens", "16",
                  "--sweep-points", "2")["trace"]
    assert t["restore_every_blocks"] == 16
    assert t["prefix_hit_ceiling"] == pytest.approx(oracle_ceiling(path, 16), abs=1e-12)
    assert t["prefix_hit_ceiling"] < oracle_ceiling(path)  # the cut matters on this trace
    for p in t["policies"]:
        assert p["hit_rate"] <= t["prefix_hit_ceiling"] + 1e-12
    # The sweep's full-footprint point holds every block: an infinite cache, the ceiling.
    full = [s for s in t["sweep"] if s["capacity_share_of_footprint"] == 1.0]
    assert len(full) == 2
    for s in full:
        assert s["hit_rate"] == pytest.approx(t["prefix_hit_ceiling"], abs=1e-12)


def test_trace_block_is_charged_what_the_store_holds_for_its_tokens(terrace, tmp_path):
    """A block smaller than a chunk was charged a whole chunk of KV and a whole KDA snapshot: 16-token
    blocks put 16x the stored KV per token and 16x the snapshots in the footprint. Now the same
    prompts take the same room whatever the trace's block size, and the KV charged per token is the
    store's stored bytes per token."""
    prompts = [json.loads(line)["hash_ids"] for line in FIXTURE.read_text().splitlines()[:60]]
    runs = {}
    for bt in (16, 512):
        path = tmp_path / f"b{bt}.jsonl"
        write_prompts(path, prompts, bt)
        runs[bt] = plan_json(terrace, "--model", "kimi-k3", "--trace", path, "--trace-block-tokens", bt,
                             "--policy", "lru", "--sweep-points", "2")
    stored = runs[512]["memory"]["mla_stored_bytes_per_token"]
    for bt, j in runs.items():
        t = j["trace"]
        assert t["blocks_not_matching_input_length"] == 0
        assert t["block_bytes"] / bt == pytest.approx(stored, abs=0.5 / bt)  # to the byte per block
        assert t["chunks_per_block"] == bt / 256
        assert t["snapshots_per_block"] == bt / 256
        assert t["restore_every_blocks"] == (16 if bt == 16 else 1)
    a, b = runs[16]["trace"], runs[512]["trace"]
    assert a["unique_blocks"] == 32 * b["unique_blocks"]
    for key in ("footprint_bytes", "footprint_kv_bytes", "footprint_snapshot_bytes"):
        assert a[key] == pytest.approx(b[key], rel=1e-6), key
    assert a["prefix_hit_ceiling"] == pytest.approx(b["prefix_hit_ceiling"])
    assert a["policies"][0]["hit_rate"] == pytest.approx(b["policies"][0]["hit_rate"])
    assert [s["hit_rate"] for s in a["sweep"]] == pytest.approx([s["hit_rate"] for s in b["sweep"]])
    text = terrace("plan", "--model", "kimi-k3", "--trace", tmp_path / "b16.jsonl", "--trace-block-tokens", "16",
                   "--policy", "lru", "--sweep-points", "1").stdout
    assert "1/16 of a snapshot" in text and "a restore boundary falls every 16 blocks" in text
    # A chunk of 8 trace blocks: each block is charged an eighth of the 4096-token chunk.
    big = plan_json(terrace, "--model", "kimi-k3", "--trace", tmp_path / "b512.jsonl", "--chunk-tokens", "4096",
                    "--policy", "lru", "--sweep-points", "1")
    t = big["trace"]
    assert t["block_bytes"] / 512 == pytest.approx(big["memory"]["mla_stored_bytes_per_token"], abs=0.5 / 512)
    assert t["snapshots_per_block"] == 1 / 8 and t["restore_every_blocks"] == 8
    # Neither divides the other: refused, naming both flags.
    for bt, chunk in ((512, 384), (16, 24)):
        r = terrace("plan", "--trace", tmp_path / f"b{bt}.jsonl", "--trace-block-tokens", bt, "--chunk-tokens", chunk)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert f"--trace-block-tokens {bt} and --chunk-tokens {chunk}: neither divides the other" in r.stderr
        assert r.stdout == ""


# ---- Kimi Linear 48B-A3B from its config alone (docs/model-format.md sections 3 and 4) ----
H200_HBM = 8 * 143771 * 2**20            # h200-gen5: 8 GPUs of 143771 MiB
H200_FLOPS = 8 * 989e12 * 0.4            # dense bf16 x mfu
H200_HBM_BW = 8 * 4.8e12


def kimi_linear_48b(tied=False, mla=(4, 8, 12, 16, 20, 24, 27)):
    """Kimi Linear 48B-A3B's tensors, written out from its config.json values (hidden 2304, vocab
    163840, 27 layers, MLA at 1-based 4, 8, ..., 24, 27; KDA 32 x 128, conv 4, low-rank gate; MLA 32
    heads, q_proj, kv_lora 512, 128/64/128; dense layer 0 of 9216; 26 MoE layers of 256 experts
    (1024 wide) top-8 and one 1024-wide shared expert). BF16 except A_log, dt_bias and the router's
    correction bias (F32); routed experts as the published checkpoint stores them, BF16. `mla`: the
    1-based MLA layers (transformers' KimiLinearConfig defaults put them at 0-based 4, 8, ..., 24)."""
    d, V, L = 2304, 163840, 27
    H, dk, K = 32, 128, 4
    Hm, nope, rope, v, rkv = 32, 128, 64, 128, 512
    E, I, S, D = 256, 1024, 1024, 9216
    bf16, f32 = [V * d], []  # resident parameters by dtype; embed_tokens first
    for l in range(1, L + 1):
        bf16 += [d, d]  # input / post-attention norms
        if l in mla:
            bf16 += [Hm * (nope + rope) * d, (rkv + rope) * d, rkv, Hm * (nope + v) * rkv, d * Hm * v]
        else:  # q/k/v proj, q/k/v conv, f_a, f_b, b, g_a, g_b, o_norm, o_proj
            bf16 += [3 * H * dk * d, 3 * H * dk * K, dk * d, H * dk * dk, H * d, dk * d, H * dk * dk, dk, d * H * dk]
            f32 += [H, H * dk]  # A_log, dt_bias
        if l == 1:
            bf16 += [2 * D * d, d * D]
        else:
            bf16 += [E * d, 2 * S * d, d * S]  # router, shared expert
            f32 += [E]  # e_score_correction_bias
    bf16 += [d]  # final norm
    if not tied:
        bf16 += [V * d]  # lm_head
    expert = 3 * I * d
    return {"resident_bytes": 2 * sum(bf16) + 4 * sum(f32), "resident_params": sum(bf16) + sum(f32),
            "expert_params": expert, "expert_bytes": 2 * expert, "routed_bytes": 26 * E * expert * 2,
            "embed_params": V * d, "moe_layers": 26, "top_k": 8, "experts": E}


KL_SEQ_BYTES = (32768 + 512) * 7 * 576 * 2 + 20 * (32 * 128 * 128 + 3 * 3 * 32 * 128) * 4  # MLA latents + KDA state


def test_default_expert_cache_is_at_most_all_routed_experts(terrace):
    """The default budget is half the HBM left after the resident weights, at most all routed
    experts: a cache larger than them holds nothing more and took the HBM from KV (kimi-linear-48b
    had 559.7 GiB of cache for its experts and 1,918 sequences)."""
    k = kimi_linear_48b()
    j = plan_json(terrace, "--model", "kimi-linear-48b")
    assert (H200_HBM - k["resident_bytes"]) // 2 > k["routed_bytes"]  # the cap binds
    assert j["experts"]["budget_bytes"] == k["routed_bytes"]
    assert j["experts"]["budget_capped"] is False and j["experts"]["budget_requested_bytes"] == 0
    hbm = j["tiers"][0]
    assert hbm["capacity_bytes"] == H200_HBM
    assert hbm["other_bytes"] == k["resident_bytes"] + k["routed_bytes"]
    assert hbm["kv_bytes"] == H200_HBM - k["resident_bytes"] - k["routed_bytes"]
    assert hbm["sequences"] == (H200_HBM - k["resident_bytes"] - k["routed_bytes"]) // KL_SEQ_BYTES == 3536
    # k3-small: 11 MoE layers x 64 experts x 3 x 256 x 256 MXFP4 weights (1/2 + 1/32 B each) = 70.1 MiB.
    small_experts = 11 * 64 * (3 * 256 * 256 // 2 + 3 * 256 * 256 // 32)
    s = plan_json(terrace, "--model", "k3-small")
    assert s["experts"]["budget_bytes"] == small_experts
    assert s["tiers"][0]["other_bytes"] == s["weights"]["resident_bytes"] + small_experts
    # A larger --expert-cache (that fits the HBM) is capped at all routed experts, and says so.
    c = plan_json(terrace, "--model", "k3-small", "--expert-cache", "1GiB")
    assert c["experts"]["budget_bytes"] == small_experts
    assert c["experts"]["budget_capped"] is True and c["experts"]["budget_requested_bytes"] == 2**30
    assert c["tiers"][0]["kv_bytes"] == H200_HBM - s["weights"]["resident_bytes"] - small_experts
    text = terrace("plan", "--model", "k3-small", "--expert-cache", "1GiB").stdout
    assert "--expert-cache 1.0 GiB capped at all routed experts" in text
    assert "budget 70.1 MiB" in text
    # The replay's default --kv-hbm is the plan's HBM for KV.
    t = plan_json(terrace, "--model", "k3-small", "--trace", FIXTURE, "--sweep-points", "1", "--policy", "lru")
    assert t["trace"]["tiers"][0]["capacity_bytes"] == H200_HBM - s["weights"]["resident_bytes"] - small_experts


def test_resident_weights_larger_than_hbm_are_a_warning(terrace, tmp_path):
    """K3's resident weights (about 105.7 GiB: everything but the routed experts) do not fit one H100
    (81559 MiB = 79.6 GiB): the plan says so, names the fix, and marks its rates as hypothetical."""
    hw = tmp_path / "hw1.json"
    hw.write_text(json.dumps({"base": "h100-gen4", "gpus": 1}))
    j = plan_json(terrace, "--hardware", hw)
    assert j["weights"]["resident_fits_hbm"] is False
    first = j["warnings"][0]
    assert f"exceed the node's {81559 / 1024:.1f} GiB of HBM" in first
    assert "does not fit" in first and "--hardware gpus" in first and "rates" in first
    assert not any("lower --concurrency, --context or --expert-cache" in w for w in j["warnings"])
    text = terrace("plan", "--hardware", hw).stdout
    assert "warning: resident weights" in text
    assert "lifecycle (as if the resident weights fitted in HBM: they do not)" in text
    # Two H100s (159.3 GiB) hold them: no such warning.
    hw.write_text(json.dumps({"base": "h100-gen4", "gpus": 2}))
    two = plan_json(terrace, "--hardware", hw)
    assert two["weights"]["resident_fits_hbm"] is True
    assert not any("resident weights" in w for w in two["warnings"])
    assert "as if the resident weights" not in terrace("plan", "--hardware", hw).stdout


def test_routed_experts_are_sized_in_the_checkpoints_format(terrace, tmp_path):
    """Kimi Linear's checkpoint stores its routed experts in BF16 (47.11 B parameters x 2 B =
    87.75 GiB), K3's in MXFP4; a config.json without a quantization_config is planned as BF16, one
    with compressed-tensors MXFP4 as MXFP4."""
    k = kimi_linear_48b()
    j = plan_json(terrace, "--model", "kimi-linear-48b")
    w = j["weights"]
    assert w["expert_format"] == "bf16" and "BF16" in w["expert_format_from"]
    assert w["expert_bytes"] == k["expert_bytes"] == 3 * 1024 * 2304 * 2
    assert w["routed_expert_bytes"] == k["routed_bytes"]
    assert w["by_component"]["routed_experts"] == k["routed_bytes"]
    assert w["resident_bytes"] == k["resident_bytes"]
    assert w["total_bytes"] == k["resident_bytes"] + k["routed_bytes"]
    assert "routed experts in BF16" in terrace("plan", "--model", "kimi-linear-48b").stdout
    k3 = plan_json(terrace, "--model", "kimi-k3")["weights"]
    assert k3["expert_format"] == "mxfp4"
    assert k3["expert_bytes"] == 3 * 3584 * 3072 // 2 + 3 * 3584 * 3072 // 32
    # A bare Kimi Linear config.json (absent keys take the 48B's values): BF16 unless quantised.
    cfg = tmp_path / "kl.json"
    cfg.write_text(json.dumps({"model_type": "kimi_linear"}))
    bare = plan_json(terrace, "--model", cfg)["weights"]
    assert bare["expert_format"] == "bf16" and bare["expert_format_from"] == (
        "config.json has no quantization_config and no checkpoint beside it: BF16 assumed")
    assert bare["routed_expert_bytes"] == k["routed_bytes"]
    cfg.write_text(json.dumps({"model_type": "kimi_linear", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}}))
    q = plan_json(terrace, "--model", cfg)["weights"]
    assert q["expert_format"] == "mxfp4" and q["expert_format_from"] == "config.json's quantization_config"
    assert q["routed_expert_bytes"] == 26 * 256 * (3 * 1024 * 2304 // 2 + 3 * 1024 * 2304 // 32)
    # K3's published config.json (quantization_config inside text_config) plans like the preset.
    source = pathlib.Path(os.environ.get("TERRACE_SOURCE_DIR", DATA.parents[2]))
    published = source / "tests" / "model_io" / "data" / "kimi_k3_config.json"
    pub = plan_json(terrace, "--model", published)["weights"]
    assert pub["expert_format"] == "mxfp4" and pub["routed_expert_bytes"] == k3["routed_expert_bytes"]


KIMI_LINEAR_CHECKPOINT = (pathlib.Path(os.environ.get("TERRACE_SOURCE_DIR", DATA.parents[2])) /
                          "tests" / "kimi_linear" / "checkpoint")


def safetensors_sizes(path):
    """Bytes per tensor, read from the safetensors header (data_offsets), independent of Terrace."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {name: t["data_offsets"][1] - t["data_offsets"][0] for name, t in header.items()}


def test_weights_are_sized_as_the_checkpoint_stores_them(terrace, tmp_path):
    """A checkpoint beside config.json sizes the weights at its tensors' stored dtypes: the F32
    fixture (written by transformers) at 4 bytes a value, not the BF16 of a config-only plan; a copy
    whose routed experts are BF16 and the rest F32 is sized and labelled so."""
    sizes = safetensors_sizes(KIMI_LINEAR_CHECKPOINT / "model.safetensors")
    routed = sum(b for name, b in sizes.items() if ".experts." in name)
    expert0 = sum(b for name, b in sizes.items() if ".layers.1.block_sparse_moe.experts.0." in name)
    w = plan_json(terrace, "--model", KIMI_LINEAR_CHECKPOINT)["weights"]
    assert (w["routed_expert_bytes"], w["by_component"]["routed_experts"]) == (routed, routed) == (72 * 1024,) * 2
    assert w["total_bytes"] == sum(sizes.values())
    assert w["resident_bytes"] == sum(sizes.values()) - routed
    assert w["expert_bytes"] == expert0 == 3 * 32 * 16 * 4
    assert (w["expert_format"], w["resident_format"], w["expert_format_from"]) == ("f32", "f32", "the checkpoint's tensors")
    text = terrace("plan", "--model", KIMI_LINEAR_CHECKPOINT).stdout
    assert "routed experts in F32 (the checkpoint's tensors)" in text
    assert "resident (all but routed experts; F32)" in text
    # Routed experts converted to BF16, the rest left F32.
    import ml_dtypes
    from safetensors.numpy import load_file, save_file
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "config.json").write_bytes((KIMI_LINEAR_CHECKPOINT / "config.json").read_bytes())
    tensors = load_file(KIMI_LINEAR_CHECKPOINT / "model.safetensors")
    for name in tensors:
        if ".experts." in name:
            tensors[name] = tensors[name].astype(ml_dtypes.bfloat16)
    save_file(tensors, mixed / "model.safetensors")
    m = plan_json(terrace, "--model", mixed)["weights"]
    assert (m["expert_format"], m["resident_format"]) == ("bf16", "f32")
    assert (m["routed_expert_bytes"], m["resident_bytes"]) == (routed // 2, w["resident_bytes"])
    assert "routed experts in BF16 (the checkpoint's tensors)" in terrace("plan", "--model", mixed).stdout


def test_a_checkpoint_that_does_not_open_is_an_error(terrace, tmp_path):
    """config.json beside a truncated model.safetensors: exit 1 naming --model, the file and the
    cause (as `model run` refuses it), never a plan sized from the config alone."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((KIMI_LINEAR_CHECKPOINT / "config.json").read_bytes())
    (bad / "model.safetensors").write_bytes((KIMI_LINEAR_CHECKPOINT / "model.safetensors").read_bytes()[:100000])
    for given in (bad, bad / "config.json"):
        for json_flag in ((), ("--json",)):
            r = terrace("plan", "--model", given, *json_flag)
            assert r.returncode == 1 and r.stdout == "", r.stdout
            assert f"--model {bad}: plan sizes the weights from the checkpoint" in r.stderr, r.stderr
            assert "model.safetensors" in r.stderr and "Corruption" in r.stderr, r.stderr
    run = terrace("model", "run", "--model", bad, "--tokens", "1,2")
    assert run.returncode == 1 and "Corruption" in run.stderr, run.stderr


def test_active_params_leave_out_the_embedding_lookup(terrace, tmp_path):
    """embed_tokens is a lookup (no FLOPs, one row read per token): active parameters are the
    resident ones without it plus top-k experts per MoE layer; tied, it is the lm_head and counts once."""
    k = kimi_linear_48b()
    active = k["resident_params"] - k["embed_params"] + k["top_k"] * k["moe_layers"] * k["expert_params"]
    j = plan_json(terrace, "--model", "kimi-linear-48b")
    assert j["weights"]["active_params_per_token"] == active == 3_106_972_544
    assert j["lifecycle"]["prefill_tokens_per_s"] == pytest.approx(H200_FLOPS / (2 * active), rel=1e-12)
    assert round(H200_FLOPS / (2 * active)) == 509306
    assert j["lifecycle"]["routing_flops_share"] == pytest.approx(26 * 256 * 2304 / active, rel=1e-12)
    # A decode step reads the resident weights but the table (one 2304-wide BF16 row per sequence),
    # the experts the step's 32 sequences touch (each picks 8 distinct of 256, Zipf 1: expert i with
    # probability min(1, c w_i), summing to 8), every sequence's KV and its KDA state twice.
    touched = sum(1 - (1 - x) ** 32 for x in inclusion(256, 1.0, 8))
    kv = (32768 + 512) * 7 * 576 * 2
    kda = 20 * (32 * 128 * 128 + 3 * 3 * 32 * 128) * 4
    step = (k["resident_bytes"] - 2 * k["embed_params"] + 32 * 2304 * 2 + touched * 26 * k["expert_bytes"]
            + 32 * (kv + 2 * kda))
    assert j["lifecycle"]["decode_step_bytes"] == pytest.approx(step, rel=1e-12)
    assert j["lifecycle"]["decode_step_s"] == pytest.approx(step / H200_HBM_BW, rel=1e-12)
    # Tied embeddings: embed_tokens is the lm_head (a matmul), counted once; there is no lm_head
    # tensor. A bare kimi_linear config takes transformers' layer kinds (MLA at 0-based 4, ..., 24).
    transformers_mla = (5, 9, 13, 17, 21, 25)
    for tied in (False, True):
        cfg = tmp_path / "kl.json"
        cfg.write_text(json.dumps({"model_type": "kimi_linear", "tie_word_embeddings": tied}))
        t = plan_json(terrace, "--model", cfg)
        kt = kimi_linear_48b(tied=tied, mla=transformers_mla)
        head = kt["embed_params"] if tied else 0  # the table is the head: counted once
        assert t["weights"]["active_params_per_token"] == (kt["resident_params"] - kt["embed_params"] + head +
                                                           8 * 26 * kt["expert_params"])
        assert t["weights"]["lookup_embedding_bytes"] == (0 if tied else 2 * kt["embed_params"])
    # Printed as a parameter count, not "B" (bytes).
    text = terrace("plan", "--model", "kimi-linear-48b").stdout
    assert f"{active / 1e9:.2f} G active params per token" in text
    small = terrace("plan", "--model", "k3-small").stdout
    assert " B active params" not in small and " M active params per token" in small


def test_sigint_stops_a_long_trace_replay_with_a_message(terrace, tmp_path):
    """A long replay prints progress on stderr (every 5 s); SIGINT after the first progress line stops it
    at its next checkpoint: exit 130, one 'stopped by SIGINT' line, nothing on stdout."""
    big = tmp_path / "big.jsonl"
    assert terrace("trace", "gen", "--requests", "100000", "--seed", "1", "--prefixes", "20000", "-o", big).returncode == 0
    p = subprocess.Popen([os.environ["TERRACE_BIN"], "plan", "--trace", str(big)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    first = p.stderr.readline()
    assert re.match(r"terrace plan: trace replay \d+ of \d+ \(.*\): \d+ of 100000 requests, \d+ s$", first), first
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGINT, first + err
    assert "terrace plan: stopped by SIGINT in trace replay " in err and "nothing was printed" in err, err
    assert out == ""


def test_a_model_without_routed_experts_has_no_expert_cache_figures(terrace, tmp_path):
    # Every layer dense (first_k_dense_replace = num_hidden_layers): there is no expert format to
    # take and no hit rate to estimate, so none is printed as a measured 0.
    r = terrace("model", "init", "--preset", "k3-toy", "--out", tmp_path / "toy")
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "toy" / "config.json").read_text())
    text = config.get("text_config", config)
    text["first_k_dense_replace"] = text["num_hidden_layers"]
    text.pop("quantization_config", None)
    config.pop("quantization_config", None)
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps(config))
    j = plan_json(terrace, "--model", tmp_path / "dense" / "config.json")
    assert j["weights"]["expert_format"] == "none"
    assert j["weights"]["expert_format_from"] == "the model has no MoE layers"
    assert j["experts"]["hit_rate"] is None
    out = terrace("plan", "--model", tmp_path / "dense" / "config.json").stdout
    assert "no routed experts (the model has no MoE layers)" in out and "expert cache: none" in out
    assert "hit rate 0.0%" not in out and "BF16 assumed" not in out


def write_trace(path, prompts):
    """A trace of prompts given as lists of 512-token block ids, one request every 10 ms."""
    with open(path, "w") as f:
        for ts, ids in enumerate(prompts):
            f.write(json.dumps({"timestamp": ts * 10, "input_length": 512 * len(ids), "output_length": 1,
                                "hash_ids": list(ids)}) + "\n")


def test_sweep_says_how_many_capacities_it_left_out(terrace):
    """--sweep-points N asks for footprint / 2^i, i = N-1..0; a capacity under one block is left out,
    and the JSON, the text and --help say so (32 points on the fixture gave fewer, silently)."""
    args = ["--model", "kimi-k3", "--trace", FIXTURE, "--sweep-points", "32", "--policy", "lru"]
    t = plan_json(terrace, *args)["trace"]
    kept = len(t["sweep"])
    assert 0 < kept < 32
    assert t["sweep_points_left_out"] == 32 - kept
    for s in t["sweep"]:
        assert s["capacity_bytes"] >= t["stored_block_bytes"]
    assert any("32" in n and str(32 - kept) in n and "one block" in n for n in t["notes"]), t["notes"]
    text = terrace("plan", *args).stdout
    assert re.search(rf"note: {32 - kept} of the sweep's 32 capacities .*one block", text), text[-2000:]
    none_left = plan_json(terrace, "--model", "kimi-k3", "--trace", FIXTURE, "--sweep-points", "2",
                          "--policy", "lru")["trace"]
    assert none_left["sweep_points_left_out"] == 0 and len(none_left["sweep"]) == 2
    help_text = terrace("plan", "--help").stdout
    assert "footprint / 2^i" in help_text and "one block" in help_text


def test_cluster_table_names_its_policy_and_reuses_the_first_policys_replay(terrace):
    """The cluster projection replays the first --policy only: the text title says which. Its row
    for the routing of the main replay (--routing) is that policy's replay, figure for figure."""
    base = ["--model", "k3-small", "--trace", FIXTURE, "--nodes", "3", "--sweep-points", "1"]
    for routing in ("prefix-affinity", "round-robin"):
        t = plan_json(terrace, *base, "--routing", routing)["trace"]
        first = t["policies"][0]
        assert first["policy"] == "lru"
        row = next(c for c in t["cluster"] if c["routing"] == routing)
        assert row["policy"] == "lru"
        assert row["hit_rate"] == first["hit_rate"]
        assert row["ttft_saved_s"] == first["ttft_saved_s"]
        assert row["requests_per_node"] == first["requests_per_node"]
    # The other routing's row is its own replay: the same whichever --routing the main replay used.
    pa = plan_json(terrace, *base, "--routing", "prefix-affinity")["trace"]["cluster"]
    rr = plan_json(terrace, *base, "--routing", "round-robin")["trace"]["cluster"]
    for key in ("hit_rate", "ttft_saved_s", "load_imbalance", "requests_per_node"):
        assert [c[key] for c in pa] == [c[key] for c in rr], key
    text = terrace("plan", *base).stdout
    assert re.search(r"cluster of 3 nodes.*\blru\b", text), text[-1500:]
    text = terrace("plan", *base, "--policy", "s3fifo").stdout
    assert re.search(r"cluster of 3 nodes.*\bs3fifo\b", text), text[-1500:]


def test_report_names_the_cluster_policy_and_shows_the_trace_notes(terrace, tmp_path):
    r = terrace("plan", "--json", "--model", "kimi-k3", "--trace", FIXTURE, "--nodes", "3", "--sweep-points", "32",
                "--policy", "s3fifo", "--kv-hbm", "100MiB")
    assert r.returncode == 0, r.stderr
    notes = json.loads(r.stdout)["trace"]["notes"]
    assert len(notes) >= 3
    run, html = tmp_path / "run.json", tmp_path / "r.html"
    run.write_text(r.stdout)
    rep = terrace("report", run, "-o", html)
    assert rep.returncode == 0, rep.stderr
    page = html.read_text()
    assert "<h3>Cluster projection (s3fifo eviction)</h3>" in page
    for n in notes:
        assert f"<p>Note: {n}</p>" in page.replace("&#39;", "'").replace("&apos;", "'")


def test_more_nodes_than_requests_is_noted(terrace, tmp_path):
    path = tmp_path / "three.jsonl"
    write_trace(path, [[1, 2], [1, 2, 3], [4]])
    args = ["--model", "k3-small", "--trace", path, "--nodes", "5", "--sweep-points", "1"]
    t = plan_json(terrace, *args)["trace"]
    assert any("5 nodes" in n and "3 requests" in n for n in t["notes"]), t["notes"]
    assert re.search(r"note: .*5 nodes.*3 requests", terrace("plan", *args).stdout)
    enough = plan_json(terrace, "--model", "k3-small", "--trace", path, "--nodes", "3", "--sweep-points", "1")
    assert not any("nodes" in n for n in enough["trace"]["notes"])


def test_a_trace_of_empty_prompts_has_no_hit_rate(terrace, tmp_path):
    """No prompt blocks: every hit rate and the ceiling are 0/0, null in JSON, n/a in text, and the
    report of that JSON still renders."""
    path = tmp_path / "empty_prompts.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 0, "output_length": 1, "hash_ids": []}) + "\n"
                            for i in range(2)))
    args = ["--model", "k3-small", "--trace", path, "--nodes", "2", "--sweep-points", "3"]
    r = terrace("plan", "--json", *args)
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)["trace"]
    assert t["blocks"] == 0
    assert t["prefix_hit_ceiling"] is None
    for p in t["policies"]:
        assert p["hit_rate"] is None
        assert all(tier["hit_rate"] is None for tier in p["tiers"])
    assert all(s["hit_rate"] is None for s in t["sweep"])
    assert all(c["hit_rate"] is None for c in t["cluster"])
    text = terrace("plan", *args)
    assert text.returncode == 0, text.stderr
    assert "prefix-hit ceiling n/a" in text.stdout
    assert "0.0%" not in text.stdout.split("\ntrace ", 1)[1]
    run = tmp_path / "run.json"
    run.write_text(r.stdout)
    html = tmp_path / "r.html"
    rep = terrace("report", run, "-o", html)
    assert rep.returncode == 0, rep.stderr
    page = html.read_text()
    assert "ceiling <b>not recorded</b>" in page


def test_a_tier_smaller_than_one_block_is_left_out_with_a_note(terrace):
    """A tier that holds no block is left out of the replay, as one of size 0 is; a size under one
    block given (or planned) for it is now said to be left out rather than printed as if used."""
    args = ["--model", "kimi-k3", "--trace", FIXTURE, "--kv-hbm", "100MiB", "--sweep-points", "1", "--policy", "lru"]
    t = plan_json(terrace, *args)["trace"]
    hbm = t["tiers"][0]
    assert hbm["name"] == "hbm" and hbm["capacity_bytes"] == 100 << 20 and hbm["capacity_blocks"] == 0
    assert t["policies"][0]["tiers"][0]["hit_blocks"] == 0
    assert any("--kv-hbm" in n and "left out" in n for n in t["notes"]), t["notes"]
    text = terrace("plan", *args).stdout
    assert re.search(r"note: .*hbm.*100\.0 MiB.*left out.*--kv-hbm", text), text[-2000:]
    # Size 0 asks for no tier: no note.
    zero = plan_json(terrace, "--model", "kimi-k3", "--trace", FIXTURE, "--kv-hbm", "0", "--sweep-points", "1",
                     "--policy", "lru")["trace"]
    assert not any("--kv-hbm" in n for n in zero["notes"])
