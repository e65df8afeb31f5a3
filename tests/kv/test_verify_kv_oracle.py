"""`terrace verify kv` against an independent recomputation: its KL divergence, KL max and top-1
agreement for a codec equal numpy's over logits taken from two `terrace model run --store` processes
(an exact f32 run, and a run that restores the context stored with the codec and computes the
evaluation tokens on top). The synthetic context is rebuilt here from its documented rule (a
splitmix64 stream from state 17, mod the vocabulary), so a changed rule, a reversed KL, log base 2, a
sum instead of a mean or a top-1 compared against itself all fail.

Run by ctest with TERRACE_BIN pointing at the terrace binary.
"""
import json
import os
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

BIN = os.environ.get("TERRACE_BIN")
if not BIN or not os.path.exists(BIN):
    pytest.skip("TERRACE_BIN is not set to the terrace binary", allow_module_level=True)

CONTEXT, EVAL, CHUNK = 128, 8, 32
SMALL_POOLS = ("--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB")
MASK = (1 << 64) - 1


def splitmix_ids(n, vocab, state=17):
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append((z ^ (z >> 31)) % vocab)
    return out


@pytest.fixture(scope="module")
def toy(make_model):
    return make_model("k3-toy", seed=4)


def eval_logits(toy, tmp_path, tokens, codec):
    """Logits of the evaluation positions, computed over a context restored with `codec`."""
    store, dump = tmp_path / f"s-{codec}", tmp_path / f"{codec}.safetensors"
    run = [BIN, "model", "run", "--model", str(toy), "--store", str(store), *SMALL_POOLS, "--tokens",
           ",".join(map(str, tokens)), "--max-new", "1", "--chunk-tokens", str(CHUNK), "--kv-codec", codec,
           "--state-codec", "f32", "--json"]
    first = subprocess.run(run, capture_output=True, text=True, timeout=300)  # stores the context's chunks
    assert first.returncode == 0, first.stderr
    second = subprocess.run([*run, "--dump-logits", str(dump)], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["restored_tokens"] == CONTEXT
    return load_file(str(dump))["logits"][CONTEXT:].astype(np.float64)


def log_softmax(x):
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def test_verify_kv_figures_equal_an_independent_recomputation(toy, tmp_path):
    vocab = json.loads((toy / "config.json").read_text())["vocab_size"]
    tokens = splitmix_ids(CONTEXT + EVAL, vocab)
    p = subprocess.run([BIN, "verify", "kv", "--model", str(toy), "--context", str(CONTEXT), "--chunk-tokens", str(CHUNK),
                        "--eval-tokens", str(EVAL), "--codecs", "int4-g32,fp8", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = {r["codec"]: r for r in json.loads(p.stdout)["rows"]}
    exact = log_softmax(eval_logits(toy, tmp_path, tokens, "f32"))
    for codec in ("int4-g32", "fp8"):
        lossy = log_softmax(eval_logits(toy, tmp_path, tokens, codec))
        kl = (np.exp(exact) * (exact - lossy)).sum(axis=1)  # KL(exact || codec), nats, per position
        agree = float((exact.argmax(axis=1) == lossy.argmax(axis=1)).mean())
        r = rows[codec]
        assert kl.mean() > 0, codec
        assert r["kl_mean"] == pytest.approx(kl.mean(), rel=1e-6), codec
        assert r["kl_max"] == pytest.approx(kl.max(), rel=1e-6), codec
        assert r["top1_agreement"] == pytest.approx(agree), codec
