"""`terrace plan`'s arithmetic end to end (docs/plan.md): the write-back's KDA snapshots, expert misses
from NVMe, tiers too small, MXFP4 dimensions, flags for parts a model lacks, --expert-cache 0, the
top-k hit-rate model, and the trace's hash_ids warning in JSON."""
import json

import pytest


def plan_json(terrace, *args):
    r = terrace("plan", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def line(j, link):
    return next(b for b in j["bandwidth"] if b["link"] == link)


def refused(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    for w in words:
        assert w in r.stderr, (w, r.stderr)


@pytest.fixture
def toy_config(toy_model, tmp_path):
    """The k3-toy config.json in a directory of its own (no checkpoint beside it), as a dict and a writer."""
    cfg = json.loads((toy_model / "config.json").read_text())

    def write(c, name):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c))
        return d / "config.json"

    return cfg, write


def text_config(c):
    return c.get("text_config", c)


def test_writeback_counts_a_kda_snapshot_per_chunk(terrace):
    j = plan_json(terrace)
    m, lc = j["memory"], j["lifecycle"]
    snapshot = m["kda_layers"] * m["state_block_bytes"]
    assert snapshot == 464_916_480
    # 32k prompt, half restored: 16384 new tokens = 64 chunks of 256, a snapshot at each.
    assert lc["snapshots_per_request"] == pytest.approx(64)
    wb = 16384 * m["mla_stored_bytes_per_token"] + 64 * snapshot
    assert lc["writeback_bytes_per_request"] == pytest.approx(wb)
    assert line(j, "nvme-write")["required_bytes_per_s"] == pytest.approx(wb)
    assert line(j, "pcie-d2h")["required_bytes_per_s"] == pytest.approx(wb)
    assert line(j, "nvme-write")["utilisation"] == pytest.approx(0.472, abs=0.002)
    assert lc["offload_bytes_per_request"] >= wb
    r3 = plan_json(terrace, "--rate", "3")
    assert any(w.startswith("link nvme-write needs 14") for w in r3["warnings"]), r3["warnings"]


def test_snapshot_every_is_honoured_and_checked(terrace, tmp_path):
    # The store's rule (KvLayout::SnapshotDue) over the new chunks 65..128 of the default prompt: each
    # multiple of N, and the last chunk once even when it is one.
    for every in (1, 2, 3, 5, 64, 100):
        want = sum(1 for c in range(65, 129) if c % every == 0 or c == 128)
        got = plan_json(terrace, "--snapshot-every", str(every))["lifecycle"]["snapshots_per_request"]
        assert got == pytest.approx(want), (every, got, want)
    assert plan_json(terrace, "--snapshot-every", "0")["lifecycle"]["snapshots_per_request"] == pytest.approx(1)
    refused(terrace("plan", "--snapshot-every", "-1"), "--snapshot-every")
    t = tmp_path / "t.jsonl"
    t.write_text('{"timestamp":0,"input_length":1024,"output_length":5,"hash_ids":[1,2]}\n')
    refused(terrace("plan", "--model", "k3-toy", "--trace", t, "--snapshot-every", "0"), "--snapshot-every")
    # The replay takes the interval too: every 2 chunks of 256 is one snapshot per 512-token block.
    j = plan_json(terrace, "--model", "k3-toy", "--trace", t, "--snapshot-every", "2")
    assert j["trace"]["snapshots_per_block"] == pytest.approx(1)


def test_expert_misses_from_nvme_count_on_the_nvme_read_line(terrace, tmp_path):
    hw = tmp_path / "hw.json"
    hw.write_text('{"base":"h200-gen5","host_bytes":1048576}')
    j = plan_json(terrace, "--hardware", hw)
    nr = line(j, "nvme-read")
    misses = j["experts"]["miss_bytes_per_token_batched"] * j["lifecycle"]["decode_tokens_needed_per_s"]
    assert nr["required_bytes_per_s"] == pytest.approx(j["lifecycle"]["restore_bytes_per_request"] + misses)
    assert nr["utilisation"] > 10
    assert any(w.startswith("link nvme-read") for w in j["warnings"]), j["warnings"]


def test_a_tier_too_small_is_a_warning(terrace, tmp_path):
    hw = tmp_path / "hw.json"
    hw.write_text('{"base":"h200-gen5","nvme_bytes":1048576}')
    j = plan_json(terrace, "--hardware", hw)
    assert any("the nvme tier's 1.0 MiB cannot hold the checkpoint" in w and "raise nvme_bytes (--hardware)" in w
               for w in j["warnings"]), j["warnings"]
    assert not any("tier" in w for w in plan_json(terrace)["warnings"])
    # Host RAM smaller than the routed experts: filled by them, the rest read from NVMe, no room for KV.
    hw.write_text('{"base":"h200-gen5","host_bytes":1048576}')
    j = plan_json(terrace, "--hardware", hw)
    assert j["tiers"][1]["kv_bytes"] == 0
    assert any(w.startswith("the host tier's 1.0 MiB is filled by the routed experts") and "read from NVMe" in w
               and "raise host_bytes (--hardware)" in w for w in j["warnings"]), j["warnings"]


def test_mxfp4_expert_dims_must_be_whole_blocks(terrace, toy_config, tmp_path):
    cfg, write = toy_config
    text_config(cfg)["moe_intermediate_size"] = 200
    path = write(cfg, "i200")
    r = terrace("plan", "--model", path)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "config field 'moe_intermediate_size' is 200" in r.stderr and "multiple of 32" in r.stderr, r.stderr
    # model init refuses the same config in the same words.
    m = terrace("model", "init", "--config", path, "--out", tmp_path / "out")
    assert m.returncode != 0 and "config field 'moe_intermediate_size' is 200" in m.stderr, m.stderr


def test_flags_for_parts_the_model_lacks_are_refused(terrace, toy_config):
    cfg, write = toy_config
    t = text_config(cfg)
    dense = json.loads(json.dumps(cfg))
    text_config(dense)["first_k_dense_replace"] = t["num_hidden_layers"]
    dense_path = write(dense, "dense")
    assert plan_json(terrace, "--model", dense_path)["weights"]["moe_layers"] == 0
    for flag, value in (("--expert-cache", "1GiB"), ("--expert-zipf", "1.2"), ("--expert-hit-target", "0.5")):
        refused(terrace("plan", "--model", dense_path, flag, value), "no routed experts", flag)
    layers = list(range(1, t["num_hidden_layers"] + 1))
    nokda = json.loads(json.dumps(cfg))
    text_config(nokda)["linear_attn_config"].update(full_attn_layers=layers, kda_layers=[])
    nokda_path = write(nokda, "nokda")
    assert plan_json(terrace, "--model", nokda_path)["memory"]["kda_layers"] == 0
    refused(terrace("plan", "--model", nokda_path, "--state-codec", "bf16"), "no KDA layers", "--state-codec")
    refused(terrace("plan", "--model", nokda_path, "--snapshot-every", "4"), "no KDA layers", "--snapshot-every")
    nomla = json.loads(json.dumps(cfg))
    text_config(nomla)["linear_attn_config"].update(full_attn_layers=[], kda_layers=layers)
    nomla_path = write(nomla, "nomla")
    assert plan_json(terrace, "--model", nomla_path)["memory"]["mla_layers"] == 0
    # --kv-codec still sizes the GQA/MHA comparison of a model without MLA layers: honoured, not refused.
    plain, fp8 = plan_json(terrace, "--model", nomla_path), plan_json(terrace, "--model", nomla_path, "--kv-codec", "fp8")
    assert fp8["memory"]["gqa_bytes_per_token"] < plain["memory"]["gqa_bytes_per_token"]
    # The toy is hybrid with routed experts: the same flags are accepted for it.
    plan_json(terrace, "--model", "k3-toy", "--kv-codec", "fp8", "--state-codec", "bf16", "--expert-cache", "1MiB")


def test_expert_cache_zero_is_no_expert_cache(terrace):
    j = plan_json(terrace, "--expert-cache", "0")
    e = j["experts"]
    assert e["budget_given"] is True and e["budget_bytes"] == 0 and e["cached_per_layer"] == 0
    assert e["hit_rate"] == 0
    assert plan_json(terrace)["experts"]["budget_given"] is False
    text = terrace("plan", "--expert-cache", "0").stdout
    assert "--expert-cache 0: no expert cache" in text and "default: half" not in text


def test_a_full_expert_cache_hits_exactly_one(terrace):
    j = plan_json(terrace, "--model", "k3-small")
    e = j["experts"]
    assert e["cached_per_layer"] == j["weights"]["experts_per_layer"]  # the default budget holds them all
    assert e["hit_rate"] == 1.0
    assert e["stall_s_per_token_batch1"] == 0.0 and e["stall_s_per_token_batched"] == 0.0


def test_top_k_hit_rate_counts_distinct_experts(terrace):
    # K3 defaults cache 338 of 896 experts per layer, top-16, Zipf 1: with p_i = min(1, c w_i)
    # summing to 16, an independent computation gives 85.5% (draws with replacement said 86.8%).
    e = plan_json(terrace)["experts"]
    assert e["cached_per_layer"] == 338
    w = [1 / (i + 1) for i in range(896)]
    s = sum(w)
    w = [x / s for x in w]
    sat = 0
    while True:
        c = (16 - sat) / sum(w[sat:])
        if c * w[sat] <= 1:
            break
        sat += 1
    p = [1.0] * sat + [min(1.0, c * x) for x in w[sat:]]
    assert e["hit_rate"] == pytest.approx(sum(p[:338]) / 16, rel=1e-9)
    assert e["hit_rate"] == pytest.approx(0.855, abs=0.0005)


def test_trace_hash_ids_mismatch_is_a_json_warning(terrace, tmp_path):
    t = tmp_path / "mism.jsonl"
    row = '{"timestamp":%d,"input_length":10,"output_length":5,"hash_ids":[1,2,3,4,5,6,7,8]}\n'
    t.write_text(row % 0 + row % 1)
    j = plan_json(terrace, "--model", "k3-toy", "--trace", t)
    assert j["trace"]["blocks_not_matching_input_length"] == 2
    assert any("2 requests have a hash_ids count that does not match ceil(input_length / 512)" in w
               for w in j["warnings"]), j["warnings"]
    text = terrace("plan", "--model", "k3-toy", "--trace", t).stdout
    assert "warning: 2 requests have a hash_ids count" in text


def test_a_trace_repeating_a_hash_id_within_a_request_is_warned_about(terrace, tmp_path):
    t = tmp_path / "rep.jsonl"
    row = '{"timestamp":%d,"input_length":2048,"output_length":5,"hash_ids":%s}\n'
    t.write_text(row % (0, "[1,2,3,4]") + row % (1, "[5,5,5,5]") + row % (2, "[1,2,3,4]"))
    j = plan_json(terrace, "--model", "k3-toy", "--trace", t)
    assert j["trace"]["requests_repeating_a_hash_id"] == 1
    assert any("1 request repeats a hash id within its own hash_ids (the first: request 2)" in w
               for w in j["warnings"]), j["warnings"]
    t.write_text(row % (0, "[1,2,3,4]") + row % (1, "[1,2,3,4]"))
    assert plan_json(terrace, "--model", "k3-toy", "--trace", t)["trace"]["requests_repeating_a_hash_id"] == 0
