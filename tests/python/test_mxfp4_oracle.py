import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

RNG = np.random.default_rng(77)


def dequant_commands(terrace):
    """`terrace ref mxfp4` (the reference oracle CLI) when it is implemented, and the hidden
    `terrace model dequant-mxfp4` helper."""
    cmds = [("model", "dequant-mxfp4")]
    probe = terrace("ref", "mxfp4", "--help", check=False)
    if probe.returncode == 0 and "--in" in probe.stdout:
        cmds.append(("ref", "mxfp4"))
    return cmds


def oracle(packed, scales):
    lo = packed & 0x0F
    hi = packed >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1)  # low nibble = even column
    e2m1 = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf in fp32, in Terrace too
        return e2m1 * np.repeat(scale, 32, axis=1)


@pytest.mark.parametrize("rows,cols", [(1, 32), (17, 96), (64, 256)])
def test_dequant_matches_ml_dtypes(terrace, tmp_path, rows, cols):
    packed = RNG.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scales = RNG.integers(90, 160, (rows, cols // 32), dtype=np.uint8)
    scales.flat[0] = 0      # 2^-127
    scales.flat[-1] = 254   # 2^127
    src = tmp_path / "in.safetensors"
    save_file({"weight_packed": packed, "weight_scale": scales}, str(src))
    want = oracle(packed, scales)
    for cmd in dequant_commands(terrace):
        out = tmp_path / "out.safetensors"
        terrace(*cmd, "--in", src, "--out", out)
        got = load_file(str(out))["weight"]
        assert got.dtype == np.float32 and got.shape == (rows, cols)
        np.testing.assert_array_equal(got, want, err_msg=" ".join(cmd))


def test_nan_scale_is_rejected(terrace, tmp_path):
    packed = np.zeros((2, 32), dtype=np.uint8)
    scales = np.full((2, 2), 127, dtype=np.uint8)
    scales[1, 1] = 255
    assert np.isnan(scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)[1, 1])
    src = tmp_path / "nan.safetensors"
    save_file({"weight_packed": packed, "weight_scale": scales}, str(src))
    r = terrace("model", "dequant-mxfp4", "--in", src, "--out", tmp_path / "o.safetensors", check=False)
    assert r.returncode != 0
    assert "row 1, block 1" in r.stderr


def test_quantize_matches_ml_dtypes_rounding(terrace, tmp_path):
    rows, cols = 33, 128
    w = (RNG.standard_normal((rows, cols)) * 10.0 ** RNG.integers(-4, 3, (rows, 1))).astype(np.float32)
    w[0, :32] = 0.0                                   # all-zero block
    w[1, :32] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, dtype=np.float32)  # exact ties
    src = tmp_path / "w.safetensors"
    save_file({"weight": w}, str(src))
    out = tmp_path / "q.safetensors"
    terrace("model", "quantize-mxfp4", "--in", src, "--out", out)
    q = load_file(str(out))
    blocks = w.reshape(rows, cols // 32, 32)
    amax = np.abs(blocks).max(axis=-1)
    # Smallest power of two 2^e with amax <= 6 * 2^e (e = 0 for an all-zero block).
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(amax / 6.0)), 0).astype(np.int32)
    e = e + (amax > 6.0 * np.exp2(e.astype(np.float64))).astype(np.int32)  # guard log2 rounding
    np.testing.assert_array_equal(q["weight_scale"], (e + 127).astype(np.uint8))
    scaled = blocks / np.exp2(e.astype(np.float32))[..., None]
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(rows, cols)  # nearest, ties to even
    want_packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    np.testing.assert_array_equal(q["weight_packed"], want_packed)


@pytest.mark.parametrize("rows,cols,tokens", [(1, 32, 1), (17, 96, 1), (64, 256, 1), (33, 128, 7), (48, 256, 32)])
def test_fused_kernel_matches_ml_dtypes_matmul(terrace, tmp_path, rows, cols, tokens):
    """`terrace ref mxfp4` with an input runs the MoE's fused dequantise-and-multiply kernel; the
    oracle decodes with ml_dtypes and multiplies in float64. Every decoded weight is exact in fp32,
    so the kernel's error is fp32 summation rounding: |y - exact| <= gamma_K * sum_k |w_k x_k|."""
    probe = terrace("ref", "mxfp4", "--help", check=False)
    if probe.returncode != 0 or "input" not in probe.stdout:
        pytest.skip("this terrace build's `ref mxfp4` does not take an input")
    packed = RNG.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scales = RNG.integers(110, 140, (rows, cols // 32), dtype=np.uint8)
    scales.flat[0] = 1  # subnormal weights (2^-126 x 0.5 .. 6)
    x = RNG.standard_normal((tokens, cols)).astype(np.float32)
    x[:, :32] *= np.float32(2.0**100)  # keeps the subnormal block's products normal
    src = tmp_path / "in.safetensors"
    save_file({"weight_packed": packed, "weight_scale": scales, "input": x}, str(src))
    out = tmp_path / "out.safetensors"
    terrace("ref", "mxfp4", "--in", src, "--out", out)
    got = load_file(str(out))
    w = oracle(packed, scales)
    np.testing.assert_array_equal(got["weight"], w)
    prod = x.astype(np.float64)[:, None, :] * w.astype(np.float64)[None, :, :]
    exact = prod.sum(axis=-1)
    u = 2.0**-24
    gamma = cols * u / (1 - cols * u)
    bound = gamma * np.abs(prod).sum(axis=-1)
    y = got["output"].astype(np.float64)
    assert y.shape == (tokens, rows)
    assert np.all(np.abs(y - exact) <= bound), np.max(np.abs(y - exact) / np.maximum(bound, 1e-300))
