"""Checkpoints and configs Terrace must refuse with a message naming the file, the tensor or key and the
fix, instead of loading a different model or calling a valid file damaged. Checkpoints are the
transformers-saved fixture (tests/kimi_linear/) re-split or edited with Python's safetensors."""
import json
import pathlib
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import inspect_json, write_safetensors

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "kimi_linear" / "checkpoint"
INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def fixture_config():
    return json.loads((FIXTURE / "config.json").read_text())


def write_sharded(d, extra_in_second=None, index_edit=None):
    """The fixture in two shards with a matching index; `extra_in_second` is added to shard 2 only
    (not listed in the index), `index_edit` may change the weight_map."""
    d.mkdir()
    shutil.copy(FIXTURE / "config.json", d)
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    names = sorted(tensors)
    parts = [{n: tensors[n] for n in names[:len(names) // 2]}, {n: tensors[n] for n in names[len(names) // 2:]}]
    weight_map = {n: SHARDS[i] for i, part in enumerate(parts) for n in part}
    parts[1].update(extra_in_second or {})
    for part, fname in zip(parts, SHARDS):
        save_file(part, str(d / fname))
    if index_edit:
        index_edit(weight_map)
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def refusal(terrace, d):
    r = terrace("model", "inspect", d, "--summary", check=False)
    assert r.returncode != 0, r.stdout
    return r.stderr


def test_split_fixture_loads(terrace, tmp_path):
    write_sharded(tmp_path / "ok")
    assert inspect_json(terrace, tmp_path / "ok", "--summary")["problems"] == []


def test_shard_tensor_the_index_does_not_list_is_refused(terrace, tmp_path):
    d = tmp_path / "extra"
    write_sharded(d, {"model.layers.1.self_attn.o_proj.bias": np.ones(32, np.float32)})
    err = refusal(terrace, d)
    assert "model.layers.1.self_attn.o_proj.bias" in err
    assert str(d / SHARDS[1]) in err and INDEX in err and "does not list" in err
    r = terrace("model", "run", "--model", d, "--tokens", "1,2,3", check=False)
    assert r.returncode != 0 and "o_proj.bias" in r.stderr


def test_tensor_stored_in_two_shards_is_refused(terrace, tmp_path):
    d = tmp_path / "dup"
    base = load_file(str(FIXTURE / "model.safetensors"))
    write_sharded(d, {"lm_head.weight": base["lm_head.weight"] * 3})
    err = refusal(terrace, d)
    assert "lm_head.weight" in err and SHARDS[0] in err and SHARDS[1] in err and "keep one" in err


def test_index_naming_a_missing_shard_says_which_tensors_and_what_to_do(terrace, tmp_path):
    d = tmp_path / "missing"
    missing = "model-00003-of-00003.safetensors"

    def move_two(weight_map):
        for n in sorted(weight_map)[:2]:
            weight_map[n] = missing
    write_sharded(d, index_edit=move_two)
    err = refusal(terrace, d)
    assert INDEX in err and missing in err
    assert "2 tensor(s)" in err and "lm_head.weight" in err  # the first tensor it maps there
    assert "copy that shard" in err and "regenerate the index" in err


def config_only_dir(d, config):
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture
def k3_text_config(terrace):
    cfg = inspect_json(terrace, "--preset", "k3-toy")["config"]
    cfg["model_type"] = "kimi_linear"  # as K3 ships text_config
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    return cfg


@pytest.mark.parametrize("wrapper_quant,refused", [
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, "describes quant_method 'fp8'"),
    ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "ignore": ["lm_head"]},
     "differs from text_config.quantization_config"),
])
def test_k3_wrapper_quantization_config_is_checked(terrace, tmp_path, k3_text_config, wrapper_quant, refused):
    d = config_only_dir(tmp_path / "w", {"model_type": "kimi_k3", "text_config": k3_text_config,
                                         "quantization_config": wrapper_quant})
    err = refusal(terrace, d)
    assert str(d / "config.json") in err and "field 'quantization_config'" in err and refused in err


def test_k3_wrapper_repeating_text_config_quantization_is_read(terrace, tmp_path, k3_text_config):
    d = config_only_dir(tmp_path / "w", {"model_type": "kimi_k3", "text_config": k3_text_config,
                                         "quantization_config": k3_text_config["quantization_config"]})
    err = refusal(terrace, d)  # the config is fine; only the weights are missing
    assert "neither model.safetensors" in err, err


def test_wrapper_model_type_other_than_kimi_k3_is_refused(terrace, tmp_path, k3_text_config):
    d = config_only_dir(tmp_path / "w", {"model_type": "deepseek_v3", "text_config": k3_text_config})
    err = refusal(terrace, d)
    assert str(d / "config.json") in err and "field 'model_type'" in err and "deepseek_v3" in err
    assert "kimi_k3" in err


@pytest.mark.parametrize("missing", ["activation_situ_beta", "activation_situ_linear_beta"])
def test_kimi_linear_situ_needs_both_betas(terrace, tmp_path, missing):
    cfg = dict(fixture_config(), hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0)
    del cfg[missing]
    d = tmp_path / "situ"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.copy(FIXTURE / "model.safetensors", d)
    err = refusal(terrace, d)
    assert str(d / "config.json") in err and f"field '{missing}' is missing" in err
    assert "the value the checkpoint was trained with" in err
    cfg[missing] = 1.0  # stated: read
    (d / "config.json").write_text(json.dumps(cfg))
    assert inspect_json(terrace, d, "--summary")["problems"] == []


@pytest.mark.parametrize("np_dtype,name", [(ml_dtypes.float8_e4m3fn, "F8_E4M3"), (ml_dtypes.float8_e5m2, "F8_E5M2")])
def test_fp8_tensor_is_refused_as_uncomputable_not_damaged(terrace, tmp_path, np_dtype, name):
    p = tmp_path / "f8.safetensors"
    save_file({"ok": np.zeros(4, np.float32), "w": np.ones((2, 4), np.float32).astype(np_dtype)}, str(p))
    r = terrace("model", "copy-tensors", "--in", p, "--out", tmp_path / "x.safetensors", check=False)
    assert r.returncode == 1
    assert "InvalidArgument" in r.stderr and str(p) in r.stderr and "'w'" in r.stderr
    assert f"cannot compute with {name}" in r.stderr and "damaged" not in r.stderr


def test_unknown_dtype_name_is_still_damage(terrace, tmp_path):
    p = tmp_path / "bad.safetensors"
    write_safetensors(p, {"w": np.ones(4, np.uint8)})
    raw = p.read_bytes().replace(b'"U8"', b'"Q8"')
    p.write_bytes(raw)
    r = terrace("model", "copy-tensors", "--in", p, "--out", tmp_path / "x.safetensors", check=False)
    assert r.returncode == 1 and "Corruption" in r.stderr and "unknown dtype 'Q8'" in r.stderr


def test_init_config_with_experts_not_mxfp4_sized_names_the_key(terrace, tmp_path):
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(fixture_config()))  # moe_intermediate_size 16
    r = terrace("model", "init", "--config", cfg_path, "--out", tmp_path / "out", "--routing-tokens", "0", check=False)
    assert r.returncode == 1
    assert str(cfg_path) in r.stderr and "'moe_intermediate_size' is 16" in r.stderr
    assert "multiple of 32" in r.stderr and "QuantizeMxfp4" not in r.stderr
    assert not (tmp_path / "out").exists()
