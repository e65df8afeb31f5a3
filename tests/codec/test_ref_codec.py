"""`terrace ref codec` against independent oracles: ml_dtypes (bfloat16, float8_e4m3fn) and numpy
reimplementations of the scale and rounding rules in docs/kv-codecs.md. Checks the decoded values,
the scales and the payload bytes of the encoded block, bit for bit.

Run by ctest with TERRACE_BIN pointing at the terrace binary. numpy, safetensors and ml_dtypes are in
the entry's NEEDS (tests/codec/CMakeLists.txt): without one ctest reports the whole entry Skipped
(tests/run_pytest.py, exit 77); no test here skips for a missing module.
"""
import json
import os
import struct
import subprocess

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as st

BIN = os.environ.get("TERRACE_BIN")
if not BIN or not os.path.exists(BIN):
    pytest.skip("TERRACE_BIN is not set to the terrace binary", allow_module_level=True)

HEADER = 64
KINDS = {"f32": 0, "bf16": 1, "f16": 2, "fp8": 3, "fp8-block": 3, "int8": 4, "int4-g32": 5, "int4-g64": 5}
F32_MIN_NORMAL = np.float32(2.0 ** -126)


def run_codec(tmp_path, codec, x, expect_rc=0):
    src, dst = tmp_path / "in.safetensors", tmp_path / f"out_{codec}.safetensors"
    st.save_file({"x": x}, str(src))
    p = subprocess.run([BIN, "ref", "codec", "--codec", codec, "--in", str(src), "--out", str(dst)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == expect_rc, p.stderr
    if expect_rc != 0:
        return p.stderr
    out = st.load_file(str(dst))
    assert out["decoded"].dtype == np.float32 and out["decoded"].shape == x.shape
    assert out["encoded"].dtype == np.uint8 and out["encoded"].ndim == 1
    return out["decoded"], out["encoded"].tobytes()


def parse_header(enc):
    assert enc[:4] == b"TKVC"
    version, kind, scales, lossless, group, _, nscales, rows, cols, raw, stored = struct.unpack_from(
        "<BBBBHHIQQQQ", enc, 4)
    assert version == 1
    assert len(enc) == HEADER + 4 * nscales + stored
    return dict(kind=kind, scales=scales, lossless=lossless, group=group, nscales=nscales, rows=rows, cols=cols,
                raw=raw, stored=stored)


def doc_scale(amax, qmax):
    """docs/kv-codecs.md: scale = amax / qmax in fp32; 0 if below 2^-126. inv = 1 / scale, 0 for 0."""
    s = (amax.astype(np.float32) / np.float32(qmax)).astype(np.float32)
    s = np.where(s < F32_MIN_NORMAL, np.float32(0), s).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(s == 0, np.float32(0), np.float32(1) / s).astype(np.float32)
    return s, inv


def make_input(seed=0, rows=48, cols=70):
    """Channels of very different magnitudes, fp8-subnormal values, an all-zero channel, a channel of
    fp32 subnormals (its scale rounds to 0), exact bf16 ties, and negative zeros."""
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.uniform(-20, 20, size=cols)).astype(np.float32)
    x = (rng.standard_normal((rows, cols)) * mag).astype(np.float32)
    x[:, 3] = 0
    x[:, 4] = np.float32(1e-40) * rng.integers(-3, 4, size=rows)
    x[::3, 5] *= np.float32(1e-4)                      # far below the channel's max: fp8 subnormals
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x40A18000], np.uint32).view(np.float32)
    x[: len(ties), 6] = ties
    x[7, 7] = np.float32(-0.0)
    return x


def rows_cols(x):
    return int(np.prod(x.shape[:-1])), x.shape[-1]


@pytest.mark.parametrize("shape", [(48, 70), (2, 3, 40), (1, 1), (5, 1)])
def test_passthrough_bitexact(tmp_path, shape):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 1000).astype(np.float32)
    if x.size >= 2:
        x.flat[0], x.flat[1] = -0.0, 1e-42
    for codec, ref in [("f32", x), ("bf16", x.astype(ml_dtypes.bfloat16)), ("f16", x.astype(np.float16))]:
        dec, enc = run_codec(tmp_path, codec, x)
        h = parse_header(enc)
        assert (h["kind"], h["rows"], h["cols"], h["nscales"]) == ((KINDS[codec],) + rows_cols(x) + (0,))
        assert enc[HEADER:] == np.ascontiguousarray(ref).tobytes(), codec
        np.testing.assert_array_equal(dec.view(np.uint32), ref.astype(np.float32).view(np.uint32))


def test_bf16_f16_against_ml_dtypes_numpy(tmp_path):
    x = make_input(2)
    x[:, 4] = 0  # fp32 subnormals are fine for bf16/f16, kept in other tests
    for codec, dt in [("bf16", ml_dtypes.bfloat16), ("f16", np.float16)]:
        x_ok = x.copy()
        if codec == "f16":
            x_ok = np.clip(x_ok, -60000, 60000).astype(np.float32)
        dec, enc = run_codec(tmp_path, codec, x_ok)
        ref = x_ok.astype(dt)
        assert enc[HEADER:] == ref.tobytes(), codec
        np.testing.assert_array_equal(dec.view(np.uint32), ref.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("codec", ["fp8", "fp8-block"])
def test_fp8_e4m3_against_ml_dtypes(tmp_path, codec):
    x = make_input(3)
    dec, enc = run_codec(tmp_path, codec, x)
    h = parse_header(enc)
    amax = np.abs(x).max(axis=0) if codec == "fp8" else np.array([np.abs(x).max()], np.float32)
    s, inv = doc_scale(amax, 448)
    assert h["nscales"] == s.size
    stored_s = np.frombuffer(enc, np.float32, count=s.size, offset=HEADER)
    np.testing.assert_array_equal(stored_s.view(np.uint32), s.view(np.uint32))
    y = np.clip((x * inv).astype(np.float32), -448, 448)
    codes = y.astype(ml_dtypes.float8_e4m3fn)
    payload = np.frombuffer(enc, np.uint8, offset=HEADER + 4 * s.size)
    np.testing.assert_array_equal(payload, codes.view(np.uint8).ravel())
    ref = (codes.astype(np.float32) * s).astype(np.float32)
    np.testing.assert_array_equal(dec.view(np.uint32), ref.view(np.uint32))
    assert np.all(dec[:, 3] == 0) and np.all(dec[:, 4] == 0)
    # Sanity: the codes use the whole range (amax maps to 448 = 0x7E) and some are subnormal.
    assert (payload & 0x7F).max() == 0x7E and np.any((payload & 0x78) == 0) and np.any(payload & 0x07)


def test_int8_against_numpy(tmp_path):
    x = make_input(4)
    dec, enc = run_codec(tmp_path, "int8", x)
    s, inv = doc_scale(np.abs(x).max(axis=0), 127)
    np.testing.assert_array_equal(np.frombuffer(enc, np.float32, count=s.size, offset=HEADER), s)
    q = np.clip(np.rint((x * inv).astype(np.float32)), -127, 127).astype(np.int8)
    payload = np.frombuffer(enc, np.int8, offset=HEADER + 4 * s.size)
    np.testing.assert_array_equal(payload, q.ravel())
    ref = (q.astype(np.float32) * s).astype(np.float32)
    np.testing.assert_array_equal(dec.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("group", [32, 64])
def test_int4_against_numpy(tmp_path, group):
    x = make_input(5, rows=9, cols=70)  # 70 columns: the last group of each row is partial
    dec, enc = run_codec(tmp_path, f"int4-g{group}", x)
    rows, cols = x.shape
    ng = -(-cols // group)
    pad = np.zeros((rows, ng * group), np.float32)
    pad[:, :cols] = x
    amax = np.abs(pad.reshape(rows, ng, group)).max(axis=2)
    s, inv = doc_scale(amax, 7)
    np.testing.assert_array_equal(np.frombuffer(enc, np.float32, count=s.size, offset=HEADER), s.ravel())
    inv_full = np.repeat(inv, group, axis=1)[:, :cols]
    q = np.clip(np.rint((x * inv_full).astype(np.float32)), -7, 7).astype(np.int8).ravel()
    nib = (q.astype(np.uint8) & 0xF)
    if nib.size % 2:
        nib = np.append(nib, 0)
    packed = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)
    payload = np.frombuffer(enc, np.uint8, offset=HEADER + 4 * s.size)
    np.testing.assert_array_equal(payload, packed)
    s_full = np.repeat(s, group, axis=1)[:, :cols]
    ref = (q.reshape(rows, cols).astype(np.float32) * s_full).astype(np.float32)
    np.testing.assert_array_equal(dec.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("base", ["f32", "bf16", "fp8", "int8", "int4-g32"])
def test_lossless_stage_decodes_identically(tmp_path, base):
    x = make_input(6)
    x[:24] = 0  # compressible
    plain, plain_enc = run_codec(tmp_path, base, x)
    for stage, code in [("zstd", 1), ("lz4", 2)]:
        dec, enc = run_codec(tmp_path, f"{base}+{stage}", x)
        h = parse_header(enc)
        assert h["lossless"] == code and h["raw"] == parse_header(plain_enc)["raw"]
        assert h["stored"] < h["raw"]
        np.testing.assert_array_equal(dec.view(np.uint32), plain.view(np.uint32))


def tie_matrix(qmax, ties):
    """Columns whose amax is qmax (scale exactly 1, so x * inv = x): rounding ties reach the codec as
    they are. Each column: qmax, then the ties and their negatives."""
    col = np.array([qmax] + ties + [-t for t in ties], np.float32)
    return np.stack([col, col * np.float32(1)], axis=1).astype(np.float32)


@pytest.mark.parametrize("codec", ["fp8", "fp8-block"])
def test_fp8_ties_to_even(tmp_path, codec):
    # Normal ties (1 + 1/16 -> 1, 1 + 3/16 -> 1.25, 2 + 1/8 -> 2, 12.5 -> 12, 13.5 -> 14, 432 -> 448:
    # between 416 and 448 the even mantissa is 448's) and subnormal ties (2^-10 -> 0, 3 * 2^-10 and
    # 5 * 2^-10 -> 2^-8).
    ties = [1.0625, 1.1875, 2.125, 12.5, 13.5, 432.0, 2.0 ** -10, 3 * 2.0 ** -10, 5 * 2.0 ** -10]
    x = tie_matrix(448.0, ties)
    dec, enc = run_codec(tmp_path, codec, x)
    nscales = parse_header(enc)["nscales"]
    np.testing.assert_array_equal(np.frombuffer(enc, np.float32, count=nscales, offset=HEADER), 1.0)
    ref = x.astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.frombuffer(enc, np.uint8, offset=HEADER + 4 * nscales), ref.view(np.uint8).ravel())
    expect = np.array([448, 1, 1.25, 2, 12, 14, 448, 0, 2.0 ** -8, 2.0 ** -8], np.float32)
    np.testing.assert_array_equal(dec[: len(expect), 0], expect)


@pytest.mark.parametrize("codec,qmax", [("int8", 127.0), ("int4-g32", 7.0)])
def test_int_ties_to_even(tmp_path, codec, qmax):
    ties = [0.5, 1.5, 2.5, 3.5, 4.5, 6.5]
    x = tie_matrix(qmax, ties)
    if codec.startswith("int4"):
        x = np.ascontiguousarray(x.T)  # int4 groups run along rows: put each tie next to its 7
    dec, _ = run_codec(tmp_path, codec, x)
    flat = dec[0] if codec.startswith("int4") else dec[:, 0]
    np.testing.assert_array_equal(flat[: 1 + len(ties)], [qmax, 0, 2, 2, 4, 4, 6])


def test_errors(tmp_path):
    x = make_input(7)
    err = run_codec(tmp_path, "fp9", x, expect_rc=2)
    assert "--codec" in err and "int4-g64" in err
    bad = x.copy()
    bad[1, 2] = np.nan
    err = run_codec(tmp_path, "fp8", bad, expect_rc=1)
    assert "row 1, column 2" in err
    err = run_codec(tmp_path, "bf16", np.full((2, 2), 3.4e38, np.float32), expect_rc=1)
    assert "row 0, column 0" in err and "bf16" in err
    src = tmp_path / "noxs.safetensors"
    st.save_file({"y": x}, str(src))
    p = subprocess.run([BIN, "ref", "codec", "--codec", "f32", "--in", str(src), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "'x'" in p.stderr


def write_empty_x(path, shape):
    """A safetensors file whose F32 'x' has `shape` and no values (numpy cannot make one this big)."""
    header = json.dumps({"x": {"dtype": "F32", "shape": list(shape), "data_offsets": [0, 0]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4-g32", "f32"])
def test_empty_tensor_with_huge_row_count_round_trips_at_once(tmp_path, codec):
    src, dst = tmp_path / "empty.safetensors", tmp_path / "out.safetensors"
    write_empty_x(src, [2 ** 40, 0])
    p = subprocess.run([BIN, "ref", "codec", "--codec", codec, "--in", str(src), "--out", str(dst)],
                       capture_output=True, text=True, timeout=60)  # a loop over the rows takes hours
    assert p.returncode == 0, p.stderr
    hdr = parse_header(st.load_file(str(dst))["encoded"].tobytes())
    assert (hdr["rows"], hdr["cols"], hdr["raw"]) == (2 ** 40, 0, 0)


def test_rows_beyond_int64_are_refused(tmp_path):
    src = tmp_path / "empty.safetensors"
    write_empty_x(src, [2 ** 40, 2 ** 40, 0])
    p = subprocess.run([BIN, "ref", "codec", "--codec", "fp8", "--in", str(src), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=60)
    # The loader refuses it (ref codec multiplies the leading dimensions into an int64 row count).
    assert p.returncode == 1 and "overflows the element count" in p.stderr and "tensor 'x'" in p.stderr, p.stderr
    assert not (tmp_path / "o").exists()


def test_a_tensor_ref_codec_does_not_read_is_refused(tmp_path):
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    st.save_file({"x": np.ones((2, 4), np.float32), "y": np.ones((2, 4), np.float32)}, str(src))
    p = subprocess.run([BIN, "ref", "codec", "--codec", "int8", "--in", str(src), "--out", str(dst)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "tensor 'y' is not read by ref codec" in p.stderr, p.stderr
    assert not dst.exists()
