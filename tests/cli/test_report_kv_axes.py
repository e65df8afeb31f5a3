"""terrace report on `bench kv` / `verify kv` JSON: token axes tick at binary round numbers (the labels
are exact: 2k is 2048 tokens, never 1.95312k), and the verify kv page says its state codec, context
and evaluation tokens."""
import re

import pytest

from conftest import SVG_NS as NS, render_report as report


def kv_row(p):
    return {"prefix_tokens": p, "restored_tokens": p, "ttft_restore_s": 0.001 * p / 256,
            "ttft_recompute_s": 0.01 * p / 256, "restore_mb_per_s": 100.0, "tier_read_mb_per_s": 200.0,
            "recompute_in_turn1": False}


def x_labels(svg):
    """The x axis' tick labels: the text elements centred under the plot (text-anchor middle, below it)."""
    return [t.text for t in svg.iter(NS + "text")
            if t.get("text-anchor") == "middle" and t.text and re.fullmatch(r"[0-9.]+[kM]?", t.text)]


def tokens(label):
    m = re.fullmatch(r"([0-9.]+)([kM]?)", label)
    return float(m.group(1)) * {"": 1, "k": 1024, "M": 1048576}[m.group(2)]


@pytest.mark.parametrize("prefixes", [[256, 1024, 4096, 8192], [256, 1024, 4096, 16384, 32768], [1024, 1536],
                                      [4096, 65536, 131072], [512, 1048576, 2097152]])
def test_token_axes_tick_at_binary_round_numbers(terrace, tmp_path, prefixes):
    j = {"model": "toy", "tier": "nvme", "kv_codec": "bf16", "state_codec": "f32", "chunk_tokens": 64,
         "rows": [kv_row(p) for p in prefixes]}
    _, charts = report(terrace, tmp_path, j, "kv")
    for name in ("ttft-vs-prefix", "restore-bandwidth"):
        labels = x_labels(charts[name])
        assert len(labels) >= 3, (name, labels)
        values = [tokens(label) for label in labels]
        # Evenly spaced, from 0, every label exact (an integer number of tokens, at most one decimal
        # of its unit: "2.5k", "512", never "1.95312k").
        step = values[1] - values[0]
        assert values[0] == 0 and step > 0, labels
        assert all(v == i * step for i, v in enumerate(values)), labels
        assert all(v == int(v) for v in values), labels
        assert all(re.fullmatch(r"\d+(\.5)?[kM]?", label) for label in labels), labels
        assert values[-1] >= max(prefixes), labels


def test_verify_kv_page_says_its_state_codec_context_and_eval_tokens(terrace, tmp_path):
    j = {"model": "toy", "context_tokens": 4096, "eval_tokens": 64, "chunk_tokens": 256, "state_codec": "bf16",
         "attention_top_k": 8,
         "rows": [{"codec": "f32", "kl_mean": 0, "kl_max": 0, "top1_agreement": 1.0, "compression_ratio": 1.0},
                  {"codec": "bf16", "kl_mean": 1e-9, "kl_max": 2e-9, "top1_agreement": 1.0,
                   "compression_ratio": 1.74}]}
    html, _ = report(terrace, tmp_path, j, "verify")
    head = html[:html.index("<svg")]  # said before the charts, not only in the "All values" table
    assert "State codec <b>bf16</b>, a 4096-token context restored in 256-token chunks, then 64 evaluation tokens" \
        in head
    assert "no pass or fail threshold" in head


def test_bench_kv_report_marks_a_row_whose_writes_failed_and_failed_checks(terrace, tmp_path):
    rows = [dict(kv_row(256), write_failures=0, restorable_tokens=256, failed_checks=[]),
            dict(kv_row(1024), restored_tokens=256, write_failures=71, restorable_tokens=1024,
                 failed_checks=["warm_logits_bitwise_equal"])]
    j = {"model": "toy", "tier": "nvme", "kv_codec": "bf16", "state_codec": "f32", "chunk_tokens": 64, "rows": rows}
    html, _ = report(terrace, tmp_path, j, "kv")
    assert "! prefix 1024: 71 of turn 1's block writes failed" in html
    assert "restored only 256 of the prefix's 1024 tokens" in html
    assert "! prefix 256:" not in html
    assert "prefix 1024: check failed: warm_logits_bitwise_equal" in html
