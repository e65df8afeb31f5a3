"""`terrace model run` / `inspect` on the checkpoint transformers saved (tests/kimi_linear/), against
transformers' own logits, read here with Python's safetensors (an independent reader)."""
import json
import pathlib
import shutil
import struct

import numpy as np
from safetensors.numpy import load_file

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "kimi_linear"


def test_run_reproduces_transformers_logits(terrace, tmp_path):
    expected = load_file(str(FIXTURE / "expected.safetensors"))
    ids = ",".join(str(int(i)) for i in expected["input_ids"])
    out = tmp_path / "logits.safetensors"
    terrace("model", "run", "--model", FIXTURE / "checkpoint", "--tokens", ids, "--dump-logits", out)
    got = load_file(str(out))["logits"]
    ref = expected["logits"]
    assert got.shape == ref.shape
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-5, rel
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_inspect_lists_config_keys_read_and_ignored(terrace):
    r = terrace("model", "inspect", FIXTURE / "checkpoint", "--json", "--summary")
    j = json.loads(r.stdout)
    assert j["problems"] == []
    assert "hidden_act" in j["config_keys"]["read"]
    assert "layer_types" in j["config_keys"]["read"]
    assert "architectures" in j["config_keys"]["ignored"]
    assert "transformers_version" in j["config_keys"]["ignored"]
    text = terrace("model", "inspect", FIXTURE / "checkpoint", "--summary").stdout
    assert "config keys read" in text and "config keys ignored" in text


def test_broken_checkpoints_fail_with_exit_1(terrace, tmp_path):
    # An unknown activation: refused, naming the key.
    bad = tmp_path / "gelu"
    shutil.copytree(FIXTURE / "checkpoint", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (bad / "config.json").write_text(json.dumps(cfg))
    r = terrace("model", "run", "--model", bad, "--tokens", "1,2,3", check=False)
    assert r.returncode == 1 and "hidden_act" in r.stderr and "gelu" in r.stderr

    # A header length one short: the data section would shift by a byte; refused.
    shifted = tmp_path / "shifted"
    shutil.copytree(FIXTURE / "checkpoint", shifted)
    st = shifted / "model.safetensors"
    data = bytearray(st.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    data[:8] = struct.pack("<Q", n - 1)
    assert data[8 + n - 1:8 + n] == b" "  # the JSON ends in padding, so it still parses at n - 1
    st.write_bytes(bytes(data))
    r = terrace("model", "run", "--model", shifted, "--tokens", "1,2,3", check=False)
    assert r.returncode == 1 and "cover" in r.stderr, r.stderr


def test_inspect_text_counts_parameters_with_decimal_prefixes(terrace):
    """The params column reads as a count (K, M, G, T), never "B" (bytes, as in the next column),
    and agrees with --json's exact counts to its printed precision."""
    j = json.loads(terrace("model", "inspect", "--preset", "kimi-k3", "--json").stdout)
    want = {**{k: v["params"] for k, v in j["components"].items()}, "total": j["total"]["params"]}
    text = terrace("model", "inspect", "--preset", "kimi-k3", "--summary").stdout
    scale = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    seen = set()
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 4 and f[0] in want:
            assert f[3] in scale, line  # a count's prefix, not bytes' "B"
            assert abs(float(f[2]) * scale[f[3]] - want[f[0]]) <= 0.01 * want[f[0]], line
            seen.add(f[0])
    assert seen == set(want)
    assert " 2.78 T " in text  # K3's 2,779 billion parameters


def test_a_per_channel_a_log_is_refused_not_read_as_one_value_per_head(terrace, tmp_path):
    """transformers stores A_log as [1, 1, H, 1] (read, see the logits test); a per-channel [H, 64]
    holds more than H values too, but its first H are head 0's: the loader and inspect refuse it."""
    bad = tmp_path / "per_channel"
    shutil.copytree(FIXTURE / "checkpoint", bad)
    from safetensors.numpy import save_file
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.0.self_attn.A_log"
    heads = tensors[name].size
    tensors[name] = np.repeat(tensors[name].reshape(heads, 1), 64, axis=1)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    r = terrace("model", "run", "--model", bad, "--tokens", "1,2,3", check=False)
    assert r.returncode == 1 and name in r.stderr and f"[{heads}, 64]" in r.stderr, r.stderr
    r = terrace("model", "inspect", bad, check=False)
    assert r.returncode == 1 and name in r.stdout + r.stderr and f"[{heads}, 64]" in r.stdout + r.stderr
