import json

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from conftest import NP_DTYPES, inspect_json, read_safetensors, write_safetensors

RNG = np.random.default_rng(1234)


def sample_tensors():
    return {
        "f32": RNG.standard_normal((3, 5)).astype(np.float32),
        "f16": RNG.standard_normal((7,)).astype(np.float16),
        "f64": RNG.standard_normal((2, 2)),
        "u8": RNG.integers(0, 256, (5, 3), dtype=np.uint8),   # odd sizes: misaligns later tensors
        "i8": RNG.integers(-128, 128, (9,), dtype=np.int8),
        "i32": RNG.integers(-2**31, 2**31, (4,), dtype=np.int32),
        "i64": RNG.integers(-2**62, 2**62, (3,), dtype=np.int64),
        "u16": RNG.integers(0, 2**16, (3,), dtype=np.uint16),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "scalar": np.array(2.5, dtype=np.float32),
    }


def test_python_written_file_round_trips_through_terrace(terrace, tmp_path):
    tensors = sample_tensors()
    src = tmp_path / "py.safetensors"
    save_file(tensors, str(src), metadata={"format": "np"})
    out = tmp_path / "terrace.safetensors"
    terrace("model", "copy-tensors", "--in", src, "--out", out)
    back = load_file(str(out))  # Terrace's file loads in Python ...
    assert sorted(back) == sorted(tensors)
    for name, value in tensors.items():  # ... with identical bytes, dtypes and shapes
        assert back[name].dtype == value.dtype, name
        assert back[name].shape == value.shape, name
        assert back[name].tobytes() == value.tobytes(), name


def test_bf16_and_f16_values_match_python(terrace, tmp_path):
    vals = np.concatenate([RNG.standard_normal(1000) * 10.0 ** RNG.integers(-6, 6, 1000),
                           [0.0, -0.0, 65504.0, 6.0e-8, 1e-40]]).astype(np.float32)
    with np.errstate(over="ignore"):  # out-of-range values become inf on both sides
        tensors = {"bf": vals.astype(ml_dtypes.bfloat16), "hf": vals.astype(np.float16), "f": vals}
    src = tmp_path / "in.safetensors"
    write_safetensors(src, tensors)
    out = tmp_path / "out.safetensors"
    terrace("model", "copy-tensors", "--in", src, "--out", out, "--f32")
    back = read_safetensors(out)
    for name, value in tensors.items():
        assert back[name].dtype == np.float32
        np.testing.assert_array_equal(back[name], value.astype(np.float32), err_msg=name)


def test_terrace_init_loads_in_python(terrace, tmp_path):
    d = tmp_path / "toy"
    terrace("model", "init", "--preset", "k3-toy", "--out", d, "--seed", "3", "--routing-tokens", "0")
    report = inspect_json(terrace, d, "--tensors")
    assert report["problems"] == []
    tensors = read_safetensors(d / "model.safetensors")  # Rust-validated: back-to-back, in bounds
    listed = {t["name"]: t for t in report["tensors"]}
    assert sorted(listed) == sorted(tensors)
    for name, arr in tensors.items():
        assert list(arr.shape) == listed[name]["shape"], name
        assert np.dtype(NP_DTYPES[listed[name]["dtype"]]) == arr.dtype, name
        if arr.dtype != np.uint8:
            assert np.isfinite(arr.astype(np.float32)).all(), name
    # BF16 values decoded by Terrace equal ml_dtypes' decoding.
    f32 = tmp_path / "f32.safetensors"
    terrace("model", "copy-tensors", "--in", d, "--out", f32, "--f32")
    conv = read_safetensors(f32)
    for name, arr in tensors.items():
        if arr.dtype == ml_dtypes.bfloat16:
            np.testing.assert_array_equal(conv[name], arr.astype(np.float32), err_msg=name)


def test_sharded_python_model_loads_in_terrace(terrace, tmp_path):
    spec = inspect_json(terrace, "--preset", "k3-toy", "--tensors")
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"text_config": spec["config"], "architectures": ["X"]}))
    tensors = {}
    for t in spec["tensors"]:
        shape = tuple(t["shape"])
        if t["dtype"] == "U8":
            tensors[t["name"]] = RNG.integers(0, 255, shape, dtype=np.uint8)
        elif t["dtype"] == "F32":
            tensors[t["name"]] = RNG.standard_normal(shape).astype(np.float32)
        else:
            tensors[t["name"]] = (RNG.standard_normal(shape) * 0.05).astype(ml_dtypes.bfloat16)
    names = sorted(tensors)
    weight_map = {}
    shards = 3
    for i in range(shards):
        part = {n: tensors[n] for n in names[i::shards]}
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        if i == 0:  # one shard through the numpy front end, the others through serialize_file (BF16)
            plain = {n: v for n, v in part.items() if v.dtype != ml_dtypes.bfloat16}
            save_file(plain, str(d / fname))
            rest = {n: v for n, v in part.items() if v.dtype == ml_dtypes.bfloat16}
            fname_b = f"extra-{i}.safetensors"
            write_safetensors(d / fname_b, rest)
            weight_map.update({n: fname for n in plain})
            weight_map.update({n: fname_b for n in rest})
        else:
            write_safetensors(d / fname, part)
            weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    report = inspect_json(terrace, d, "--tensors")
    assert report["problems"] == []
    assert report["shards"] == shards + 1
    out = tmp_path / "all.safetensors"
    terrace("model", "copy-tensors", "--in", d, "--out", out)
    back = read_safetensors(out)
    assert sorted(back) == names
    for n in names:
        assert back[n].dtype == tensors[n].dtype, n
        assert back[n].tobytes() == tensors[n].tobytes(), n


def test_malformed_python_files_are_rejected_cleanly(terrace, tmp_path):
    good = tmp_path / "good.safetensors"
    save_file({"a": np.arange(4, dtype=np.float32)}, str(good))
    raw = good.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    cases = {
        "truncated": raw[:-3],
        "length past eof": (10**6).to_bytes(8, "little") + raw[8:],
        "bad json": n.to_bytes(8, "little") + b"{" + b"x" * (n - 1) + raw[8 + n:],
    }
    bad_header = dict(header, a=dict(header["a"], dtype="F16"))
    text = json.dumps(bad_header).encode()
    cases["wrong dtype size"] = len(text).to_bytes(8, "little") + text + raw[8 + n:]
    for what, data in cases.items():
        p = tmp_path / "bad.safetensors"
        p.write_bytes(data)
        r = terrace("model", "copy-tensors", "--in", p, "--out", tmp_path / "x.safetensors", check=False)
        assert r.returncode == 1, what
        assert "bad.safetensors" in r.stderr and "Corruption" in r.stderr, (what, r.stderr)
