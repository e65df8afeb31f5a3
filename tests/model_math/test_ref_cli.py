"""Independent numpy oracles for `terrace ref` (KDA recurrence, LatentMoE with MXFP4 experts, MXFP4).

Run by ctest with TERRACE_BIN pointing at the terrace binary. numpy, safetensors and ml_dtypes are in
the entry's NEEDS (tests/model_math/CMakeLists.txt): without one ctest reports the whole entry Skipped
(tests/run_pytest.py, exit 77); no test here skips for a missing module.
"""
import json
import os
import subprocess

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as st

BIN = os.environ.get("TERRACE_BIN")
if not BIN or not os.path.exists(BIN):
    pytest.skip("TERRACE_BIN is not set to the terrace binary", allow_module_level=True)


def run_ref(tmp_path, mech, tensors, *flags, expect_ok=True):
    src, dst = tmp_path / f"{mech}_in.safetensors", tmp_path / f"{mech}_out.safetensors"
    st.save_file(tensors, str(src))
    if dst.exists():
        dst.unlink()
    p = subprocess.run([BIN, "ref", mech, "--in", str(src), "--out", str(dst), *flags],
                       capture_output=True, text=True, timeout=120)
    if not expect_ok:
        assert p.returncode != 0
        return p.stderr
    assert p.returncode == 0, p.stderr
    return st.load_file(str(dst))


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# ---- KDA -----------------------------------------------------------------------------------------

def kda_numpy(q, k, v, g, beta, scale, s0):
    """S = diag(exp g) S; S += beta k (v - S^T k)^T; o = S^T (scale q), per batch and head, float64."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = s0.astype(np.float64).copy()
    o = np.zeros((B, T, H, V))
    for b in range(B):
        for h in range(H):
            Sh = S[b, h]
            for t in range(T):
                Sh *= np.exp(g[b, t, h].astype(np.float64))[:, None]
                kt = k[b, t, h].astype(np.float64)
                Sh += beta[b, t, h] * np.outer(kt, v[b, t, h] - Sh.T @ kt)
                o[b, t, h] = Sh.T @ (scale * q[b, t, h].astype(np.float64))
    return o, S


def kda_inputs(rng, B, T, H, K, V, with_state):
    def unit(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    t = {
        "q": unit(rng.standard_normal((B, T, H, K))).astype(np.float32),
        "k": unit(rng.standard_normal((B, T, H, K))).astype(np.float32),
        "v": rng.standard_normal((B, T, H, V)).astype(np.float32),
        "g": (-5.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H, K))))).astype(np.float32),
        "beta": (1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32),
    }
    if with_state:
        t["initial_state"] = rng.standard_normal((B, H, K, V)).astype(np.float32)
    return t


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("T,with_state", [(1, False), (65, True), (130, False)])
def test_kda_matches_numpy(tmp_path, chunked, T, with_state):
    rng = np.random.default_rng(T * 2 + with_state)
    B, H, K, V = 2, 2, 16, 12
    t = kda_inputs(rng, B, T, H, K, V, with_state)
    flags = ["--chunked"] if chunked else []
    out = run_ref(tmp_path, "kda", t, *flags)
    s0 = t.get("initial_state", np.zeros((B, H, K, V), np.float32))
    o, S = kda_numpy(t["q"], t["k"], t["v"], t["g"], t["beta"], K ** -0.5, s0)
    assert out["o"].shape == (B, T, H, V) and out["o"].dtype == np.float32
    assert out["final_state"].shape == (B, H, K, V)
    assert rel_err(out["o"], o) < 1e-4
    assert rel_err(out["final_state"], S) < 1e-4


def test_kda_scale_flag(tmp_path):
    rng = np.random.default_rng(5)
    t = kda_inputs(rng, 1, 10, 1, 8, 8, False)
    out = run_ref(tmp_path, "kda", t, "--scale", "0.5")
    o, _ = kda_numpy(t["q"], t["k"], t["v"], t["g"], t["beta"], 0.5, np.zeros((1, 1, 8, 8), np.float32))
    assert rel_err(out["o"], o) < 1e-4


def test_kda_bad_input_names_tensor(tmp_path):
    rng = np.random.default_rng(6)
    t = kda_inputs(rng, 1, 4, 2, 8, 8, False)
    t["k"] = t["k"][:, :, :1]
    err = run_ref(tmp_path, "kda", t, expect_ok=False)
    assert "'k'" in err and "[1, 4, 2, 8]" in err and "[1, 4, 1, 8]" in err
    del t["k"]
    err = run_ref(tmp_path, "kda", t, expect_ok=False)
    assert "'k'" in err and "missing" in err
    t = kda_inputs(rng, 1, 4, 2, 8, 8, False)
    t["beta"] = t["beta"].astype(np.float16)
    err = run_ref(tmp_path, "kda", t, expect_ok=False)
    assert "'beta'" in err and "F16" in err


def write_empty_safetensors(path, shapes):
    """A safetensors file of F32 tensors that all hold no value (some dimension is 0)."""
    hdr = {n: {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]} for n, shape in shapes.items()}
    h = json.dumps(hdr).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h)


@pytest.mark.parametrize("KV", [2**20, 2**31, 2**32])
def test_kda_zero_tokens_with_a_huge_state_is_refused(tmp_path, KV):
    # T = 0: the file holds no value, but the [B, H, K, V] state does not depend on T. K = V = 2^20 once
    # ran out of memory, 2^31 died with "internal error: cannot create std::vector larger than
    # max_size()", and 2^32 (B*H*K*V wraps to 0) wrote a final_state Terrace's own reader refuses.
    src, dst = tmp_path / "kda_in.safetensors", tmp_path / "kda_out.safetensors"
    write_empty_safetensors(src, {"q": [1, 0, 1, KV], "k": [1, 0, 1, KV], "g": [1, 0, 1, KV],
                                  "v": [1, 0, 1, KV], "beta": [1, 0, 1]})
    p = subprocess.run([BIN, "ref", "kda", "--in", str(src), "--out", str(dst)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    err = p.stderr
    assert "internal error" not in err and "out of memory" not in err, err
    assert str(src) in err and f"[1, 1, {KV}, {KV}]" in err and "[B, H, K, V]" in err, err
    assert not dst.exists()


def test_kda_zero_tokens_small_state(tmp_path):
    # T = 0 with a small state is fine: no output tokens, the state passes through (zeros).
    src, dst = tmp_path / "kda_in.safetensors", tmp_path / "kda_out.safetensors"
    write_empty_safetensors(src, {"q": [1, 0, 2, 4], "k": [1, 0, 2, 4], "g": [1, 0, 2, 4],
                                  "v": [1, 0, 2, 3], "beta": [1, 0, 2]})
    p = subprocess.run([BIN, "ref", "kda", "--in", str(src), "--out", str(dst)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = st.load_file(str(dst))
    assert out["o"].shape == (1, 0, 2, 3)
    assert out["final_state"].shape == (1, 2, 4, 3) and not out["final_state"].any()


# ---- MXFP4 and LatentMoE -------------------------------------------------------------------------

def mxfp4_numpy(packed, scales):
    """Decode with ml_dtypes' float4_e2m1fn and float8_e8m0fnu (independent of Terrace)."""
    lo, hi = packed & 0x0F, packed >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1)
    vals = codes.view(np.uint8).astype(np.uint8)
    e2m1 = np.array([np.uint8(c) for c in range(16)], dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    x = e2m1[vals]
    s = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    return x * np.repeat(s, 32, axis=1)


def random_mxfp4(rng, rows, cols):
    packed = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    scales = rng.integers(118, 126, size=(rows, cols // 32), dtype=np.uint8)
    return packed, scales


def test_mxfp4_matches_ml_dtypes(tmp_path):
    rng = np.random.default_rng(1)
    packed, scales = random_mxfp4(rng, 7, 96)
    scales[0, 0] = 0      # 2^-127
    scales[1, 1] = 250    # 2^123 (large but finite at 6 x scale)
    out = run_ref(tmp_path, "mxfp4", {"weight_packed": packed, "weight_scale": scales})
    want = mxfp4_numpy(packed, scales)
    np.testing.assert_array_equal(out["weight"], want)


def situ(g, u, bg=4.0, bu=25.0):
    return (bg * np.tanh(g / bg) / (1.0 + np.exp(-g))) * (bu * np.tanh(u / bu))


def rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def silu_glu(g, u):
    return g / (1.0 + np.exp(-g)) * u


def moe_numpy(t, E, k, scaling, latent_norm, eps=1e-5, act=None):
    act = act or situ
    x = t["hidden_states"].astype(np.float64)
    s = 1.0 / (1.0 + np.exp(-(x @ t["gate.weight"].T.astype(np.float64))))
    biased = s + t["gate.e_score_correction_bias"]
    z = x @ t["routed_expert_down_proj.weight"].T
    y = np.zeros((x.shape[0], z.shape[1]))
    ids = np.zeros((x.shape[0], k), np.int64)
    for i in range(x.shape[0]):
        sel = sorted(range(E), key=lambda e: (-biased[i, e], e))[:k]
        ids[i] = sel
        w = s[i, sel] / s[i, sel].sum() * scaling
        for wt, e in zip(w, sel):
            w1 = mxfp4_numpy(t[f"experts.{e}.w1.weight_packed"], t[f"experts.{e}.w1.weight_scale"])
            w2 = mxfp4_numpy(t[f"experts.{e}.w2.weight_packed"], t[f"experts.{e}.w2.weight_scale"])
            w3 = mxfp4_numpy(t[f"experts.{e}.w3.weight_packed"], t[f"experts.{e}.w3.weight_scale"])
            y[i] += wt * (w2 @ act(w1 @ z[i], w3 @ z[i]))
    if latent_norm:
        y = rmsnorm(y, t["routed_expert_norm.weight"], eps)
    out = y @ t["routed_expert_up_proj.weight"].T
    sg, su, sd = (t[f"shared_experts.{p}_proj.weight"] for p in ("gate", "up", "down"))
    out += act(x @ sg.T, x @ su.T) @ sd.T
    return out, ids


def moe_inputs(rng, T=6, d=64, L=32, E=8, I=64, Is=48):
    f = lambda *s, sc=1.0: (rng.standard_normal(s) * sc).astype(np.float32)
    t = {
        "hidden_states": f(T, d),
        "gate.weight": f(E, d, sc=0.3),
        "gate.e_score_correction_bias": f(E, sc=0.05),
        "routed_expert_down_proj.weight": f(L, d, sc=d ** -0.5),
        "routed_expert_up_proj.weight": f(d, L, sc=L ** -0.5),
        "routed_expert_norm.weight": (1.0 + f(L, sc=0.1)).astype(np.float32),
        "shared_experts.gate_proj.weight": f(Is, d, sc=d ** -0.5),
        "shared_experts.up_proj.weight": f(Is, d, sc=d ** -0.5),
        "shared_experts.down_proj.weight": f(d, Is, sc=Is ** -0.5),
    }
    for e in range(E):
        for w, (r, c) in (("w1", (I, L)), ("w3", (I, L)), ("w2", (L, I))):
            p, s = random_mxfp4(rng, r, c)
            t[f"experts.{e}.{w}.weight_packed"] = p
            t[f"experts.{e}.{w}.weight_scale"] = s
    return t


@pytest.mark.parametrize("scaling", [1.0, 2.5])
def test_moe_matches_numpy(tmp_path, scaling):
    rng = np.random.default_rng(int(scaling * 10))
    t = moe_inputs(rng)
    out = run_ref(tmp_path, "moe", t, "--top-k", "3", "--scaling", str(scaling))
    want, ids = moe_numpy(t, 8, 3, scaling, True)
    np.testing.assert_array_equal(out["topk_ids"], ids)
    assert rel_err(out["output"], want) < 1e-4
    assert out["topk_weights"].sum(axis=1) == pytest.approx(scaling, rel=1e-5)


@pytest.mark.parametrize("hidden_act", ["situ", "silu"])
def test_moe_config_hidden_act_selects_the_activation(tmp_path, hidden_act):
    rng = np.random.default_rng(11)
    t = moe_inputs(rng)
    p = subprocess.run([BIN, "model", "inspect", "--preset", "k3-toy", "--json"], capture_output=True, text=True,
                       timeout=120)
    cfg = json.loads(p.stdout)["config"]
    cfg.update({"hidden_size": 64, "routed_expert_hidden_size": 32, "num_experts": 8, "num_experts_per_token": 3,
                "moe_intermediate_size": 64, "shared_expert_intermediate_size": 48, "routed_scaling_factor": 1.5,
                "hidden_act": hidden_act})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = run_ref(tmp_path, "moe", t, "--config", str(tmp_path / "config.json"))
    want, ids = moe_numpy(t, 8, 3, 1.5, True, act=silu_glu if hidden_act == "silu" else situ)
    np.testing.assert_array_equal(out["topk_ids"], ids)
    assert rel_err(out["output"], want) < 1e-4


def test_moe_bad_expert_shape_names_tensor(tmp_path):
    rng = np.random.default_rng(3)
    t = moe_inputs(rng)
    t["experts.5.w2.weight_scale"] = t["experts.5.w2.weight_scale"][:, :1].copy()
    err = run_ref(tmp_path, "moe", t, "--top-k", "8", expect_ok=False)
    assert "experts.5.w2.weight_scale" in err
    err = run_ref(tmp_path, "moe", moe_inputs(rng), expect_ok=False)
    assert "--top-k" in err


# ---- MLA and AttnRes -----------------------------------------------------------------------------

def mla_numpy(t, H, past, eps=1e-5):
    x = t["hidden_states"].astype(np.float64)
    cq = rmsnorm(x @ t["q_a_proj.weight"].T, t["q_a_layernorm.weight"], eps)
    q = (cq @ t["q_b_proj.weight"].T).reshape(x.shape[0], H, -1)
    R = t["kv_a_layernorm.weight"].shape[0]
    kv = x @ t["kv_a_proj_with_mqa.weight"].T
    lat = np.concatenate([rmsnorm(kv[:, :R], t["kv_a_layernorm.weight"], eps), kv[:, R:]], axis=1)
    cache = np.concatenate([past.astype(np.float64), lat], axis=0)
    rope = cache.shape[1] - R
    kvb = (cache[:, :R] @ t["kv_b_proj.weight"].T).reshape(cache.shape[0], H, -1)
    nope = q.shape[2] - rope
    k_nope, v = kvb[:, :, :nope], kvb[:, :, nope:]
    P, T = past.shape[0], x.shape[0]
    o = np.zeros((T, H, v.shape[2]))
    for h in range(H):
        s = (q[:, h, :nope] @ k_nope[:, h].T + q[:, h, nope:] @ cache[:, R:].T) / np.sqrt(nope + rope)
        for i in range(T):
            s[i, P + i + 1:] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        o[:, h] = p @ v[:, h]
    gate = 1.0 / (1.0 + np.exp(-(x @ t["g_proj.weight"].T)))
    return (gate * o.reshape(T, -1)) @ t["o_proj.weight"].T, cache


@pytest.mark.parametrize("absorbed", [False, True])
def test_mla_matches_numpy(tmp_path, absorbed):
    H, R = 3, 16  # mla_inputs' defaults
    t = mla_inputs(np.random.default_rng(11))
    out = run_ref(tmp_path, "mla", t, "--heads", str(H), *(["--absorbed"] if absorbed else []))
    want, cache = mla_numpy(t, H, t["past_latents"])
    assert rel_err(out["output"], want) < 1e-4
    assert rel_err(out["latents"], cache) < 1e-5
    t["kv_b_proj.weight"] = t["kv_b_proj.weight"][:, :R - 1].copy()
    err = run_ref(tmp_path, "mla", t, "--heads", str(H), expect_ok=False)
    assert "kv_b_proj.weight" in err


def test_attnres_matches_numpy(tmp_path):
    rng = np.random.default_rng(12)
    S, T, d = 3, 4, 32
    src = rng.standard_normal((S, T, d)).astype(np.float32)
    proj = (rng.standard_normal((1, d)) * 0.5).astype(np.float32)
    norm = (1 + rng.standard_normal(d) * 0.1).astype(np.float32)
    out = run_ref(tmp_path, "attnres", {"sources": src, "proj": proj, "norm": norm})
    v = src.astype(np.float64)
    score = (v * (proj[0] * norm)).sum(-1) / np.sqrt((v * v).mean(-1) + 1e-5)   # [S, T]
    p = np.exp(score - score.max(0))
    p /= p.sum(0)
    assert rel_err(out["output"], (p[:, :, None] * v).sum(0)) < 1e-5
    zero = run_ref(tmp_path, "attnres", {"sources": src, "proj": np.zeros_like(proj), "norm": norm})
    assert rel_err(zero["output"], v.mean(0)) < 1e-6


# ---- Refusals: input `terrace ref` cannot compute faithfully is exit 1, naming the tensor ------------

def refused(tmp_path, mech, tensors, *flags):
    src, dst = tmp_path / f"{mech}_bad.safetensors", tmp_path / f"{mech}_bad_out.safetensors"
    st.save_file(tensors, str(src))
    p = subprocess.run([BIN, "ref", mech, "--in", str(src), "--out", str(dst), *flags],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert not dst.exists()
    return p.stderr


def mla_inputs(rng, d=48, H=3, ql=24, R=16, nope=8, rope=4, vd=6, T=5, P=4):
    f = lambda *s, sc=1.0: (rng.standard_normal(s) * sc).astype(np.float32)
    return {
        "hidden_states": f(T, d),
        "q_a_proj.weight": f(ql, d, sc=d ** -0.5), "q_a_layernorm.weight": 1 + f(ql, sc=0.1),
        "q_b_proj.weight": f(H * (nope + rope), ql, sc=ql ** -0.5),
        "kv_a_proj_with_mqa.weight": f(R + rope, d, sc=d ** -0.5), "kv_a_layernorm.weight": 1 + f(R, sc=0.1),
        "kv_b_proj.weight": f(H * (nope + vd), R, sc=R ** -0.5),
        "o_proj.weight": f(d, H * vd, sc=(H * vd) ** -0.5), "g_proj.weight": f(H * vd, d, sc=d ** -0.5),
        "past_latents": f(P, R + rope),
    }


def attnres_inputs(rng, S=3, T=4, d=32):
    return {"sources": rng.standard_normal((S, T, d)).astype(np.float32),
            "proj": (rng.standard_normal((1, d)) * 0.5).astype(np.float32),
            "norm": (1 + rng.standard_normal(d) * 0.1).astype(np.float32)}


def op_inputs(mech, rng):
    """A valid input set and the flags each op needs."""
    if mech == "kda":
        return kda_inputs(rng, 1, 4, 2, 8, 8, True), []
    if mech == "mla":
        return mla_inputs(rng), ["--heads", "3"]
    if mech == "moe":
        return moe_inputs(rng), ["--top-k", "2"]
    if mech == "attnres":
        return attnres_inputs(rng), []
    packed, scales = random_mxfp4(rng, 4, 64)
    return {"weight_packed": packed, "weight_scale": scales, "input": rng.standard_normal((3, 64)).astype(np.float32)}, []


def test_moe_square_latent_projection_is_refused(tmp_path):
    # The MoE treats latent == hidden as "no projection": a square one would be skipped silently.
    t = moe_inputs(np.random.default_rng(20), d=32, L=32)
    err = refused(tmp_path, "moe", t, "--top-k", "2")
    assert "routed_expert_down_proj.weight" in err and "[32, 32]" in err


def test_row_sum_of_squares_overflow_is_refused(tmp_path):
    t, flags = op_inputs("attnres", np.random.default_rng(21))
    x = t["sources"].reshape(-1, t["sources"].shape[-1])
    x[1, :3] = [1e19, -1e20, 3e19]
    err = refused(tmp_path, "attnres", t, *flags)
    assert "'sources'" in err and "row 1" in err and "sum of squares" in err and "e+20" in err


@pytest.mark.parametrize("mech", ["mla", "moe"])
def test_large_input_rows_are_not_refused_where_no_norm_takes_them(tmp_path, mech):
    # mla and moe norm projections of hidden_states, never hidden_states itself: a row whose own
    # sum of squares overflows is valid input there when the weights scale it back down.
    t, flags = op_inputs(mech, np.random.default_rng(21))
    x = t["hidden_states"].reshape(-1, t["hidden_states"].shape[-1])
    x[1, :] = 2e19
    for name in list(t):
        if name.endswith("proj.weight") and name not in ("o_proj.weight",) or name.startswith("experts."):
            if t[name].dtype == np.float32 and not name.startswith("routed_expert_up"):
                t[name] = t[name] * np.float32(1e-21)
    out = run_ref(tmp_path, mech, t, *flags)
    assert np.isfinite(out["output"]).all()


def test_mla_nope_zero_is_accepted(tmp_path):
    # qk_nope_head_dim 0 is a valid config (all of q and k from the rotary part).
    rng = np.random.default_rng(23)
    d, H, R, rope, vd, T = 32, 2, 16, 8, 8, 3
    f = lambda *s, sc=1.0: (rng.standard_normal(s) * sc).astype(np.float32)
    t = {"hidden_states": f(T, d), "q_proj.weight": f(H * rope, d, sc=d ** -0.5),
         "kv_a_proj_with_mqa.weight": f(R + rope, d, sc=d ** -0.5), "kv_a_layernorm.weight": 1 + f(R, sc=0.1),
         "kv_b_proj.weight": f(H * vd, R, sc=R ** -0.5), "o_proj.weight": f(d, H * vd, sc=(H * vd) ** -0.5)}
    out = run_ref(tmp_path, "mla", t, "--heads", str(H))
    assert out["output"].shape == (T, d) and np.isfinite(out["output"]).all()


NON_FINITE = [("kda", n) for n in ("q", "k", "v", "g", "beta", "initial_state")] + [
    ("mla", "hidden_states"), ("mla", "q_b_proj.weight"), ("mla", "past_latents"), ("moe", "hidden_states"),
    ("moe", "gate.weight"), ("moe", "routed_expert_norm.weight"), ("attnres", "sources"), ("attnres", "norm"),
    ("mxfp4", "input")]


@pytest.mark.parametrize("value", [np.nan, -np.inf])
@pytest.mark.parametrize("mech,name", NON_FINITE)
def test_non_finite_input_is_refused(tmp_path, mech, name, value):
    t, flags = op_inputs(mech, np.random.default_rng(22))
    x = t[name].reshape(-1, t[name].shape[-1]) if t[name].ndim > 1 else t[name].reshape(1, -1)
    x[x.shape[0] - 1, 1] = value
    err = refused(tmp_path, mech, t, *flags)
    assert f"'{name}'" in err and f"row {x.shape[0] - 1}, column 1" in err
    assert ("nan" if np.isnan(value) else "-inf") in err


def test_kda_positive_g_is_refused(tmp_path):
    t = kda_inputs(np.random.default_rng(23), 1, 4, 2, 8, 8, False)
    t["g"][0, 2, 1, 3] = 0.25
    err = refused(tmp_path, "kda", t)
    assert "'g'" in err and "row 5, column 3" in err and "<= 0" in err


def test_moe_unrouted_expert_is_checked(tmp_path):
    t = moe_inputs(np.random.default_rng(24))
    t["gate.e_score_correction_bias"][:] = [10, 10, 0, 0, 0, 0, 0, 0]   # every token routes to 0 and 1
    t["experts.6.w3.weight_scale"][2, 0] = 255
    err = refused(tmp_path, "moe", t, "--top-k", "2")
    assert "experts.6.w3.weight_packed" in err
    del t["experts.7.w1.weight_packed"], t["experts.7.w1.weight_scale"]
    t["experts.6.w3.weight_scale"][2, 0] = 127
    err = refused(tmp_path, "moe", t, "--top-k", "2")
    assert "experts.7.w1.weight_packed" in err and "missing" in err


def moe_config(tmp_path, **kw):
    p = subprocess.run([BIN, "model", "inspect", "--preset", "k3-toy", "--json"], capture_output=True, text=True,
                       timeout=120)
    cfg = json.loads(p.stdout)["config"]
    cfg.update({"hidden_size": 64, "routed_expert_hidden_size": 32, "num_experts": 8, "num_experts_per_token": 2,
                "moe_intermediate_size": 64, "shared_expert_intermediate_size": 48, **kw})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return ["--config", str(tmp_path / "config.json")]


def _without(*names):
    return lambda t: [t.pop(n) for n in names]


def _with(name, like):
    return lambda t: t.__setitem__(name, t[like].copy())


UNUSED = [  # (op, change, tensor the error must name, what it says of it)
    ("kda", _with("initial_states", "initial_state"), "initial_states", "not an input"),
    ("attnres", _with("norm.weight", "norm"), "norm.weight", "not an input"),
    ("mla", lambda t: t.__setitem__("q_proj.weight", np.ones((36, 48), np.float32)), "q_proj.weight", "two forms"),
    ("mla", _with("past_latent", "past_latents"), "past_latent", "not an input"),
    ("moe", _without("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"),
     "shared_experts.gate_proj.weight", "missing"),
    ("moe", _without("routed_expert_down_proj.weight"), "routed_expert_down_proj.weight", "missing"),
    ("moe", lambda t: [t.__setitem__(n.replace("experts.0.", "experts.8."), t[n]) for n in list(t)
                       if n.startswith("experts.0.")], "experts.8.w", "not an input"),
    ("moe", lambda t: t.__setitem__("experts.3.w2.weight", np.ones((32, 64), np.float32)), "experts.3.w2.weight",
     "two forms"),
]


@pytest.mark.parametrize("mech,change,name,says", UNUSED)
def test_unused_or_conflicting_tensor_is_refused(tmp_path, mech, change, name, says):
    t, flags = op_inputs(mech, np.random.default_rng(25))
    change(t)
    err = refused(tmp_path, mech, t, *flags)
    assert f"'{name}" in err and says in err
    if says == "not an input":
        assert "it reads" in err


def test_moe_norm_tensor_with_config_without_norm_is_refused(tmp_path):
    t = moe_inputs(np.random.default_rng(26))
    err = refused(tmp_path, "moe", t, *moe_config(tmp_path, latent_moe_use_norm=False))
    assert "'routed_expert_norm.weight'" in err and "latent_moe_use_norm" in err


def test_mla_bad_dims_name_the_tensor(tmp_path):
    rng = np.random.default_rng(27)
    t = mla_inputs(rng)
    t["kv_a_proj_with_mqa.weight"] = t["kv_a_proj_with_mqa.weight"][:14].copy()   # fewer rows than kv_lora 16
    err = refused(tmp_path, "mla", t, "--heads", "3")
    assert "kv_a_proj_with_mqa.weight" in err and "16" in err and "does not divide" not in err
    t = mla_inputs(rng)
    t["q_b_proj.weight"] = t["q_b_proj.weight"][:12].copy()   # 4 rows a head = rope: nope 0
    err = refused(tmp_path, "mla", t, "--heads", "3")
    assert "q_b_proj.weight" in err and "config.json" not in err and "g_proj" not in err
    t = mla_inputs(rng)
    t["kv_b_proj.weight"] = t["kv_b_proj.weight"][:24].copy()   # 8 rows a head = nope: v 0
    err = refused(tmp_path, "mla", t, "--heads", "3")
    assert "kv_b_proj.weight" in err and "config.json" not in err and "g_proj" not in err
    t = mla_inputs(rng)
    t["q_b_proj.weight"] = t["q_b_proj.weight"][:35].copy()
    err = refused(tmp_path, "mla", t, "--heads", "3")
    assert "--heads 3" in err and "q_b_proj.weight" in err and "35" in err and "kv_b_proj" not in err
    t = mla_inputs(rng)
    t["q_b_proj.weight"] = t["q_b_proj.weight"][:30].copy()   # nope 6: v = 14 - 6 = 8, so o_proj needs 24 columns
    err = refused(tmp_path, "mla", t, "--heads", "3")
    assert "'o_proj.weight'" in err and "[48, 24]" in err and "q_b_proj.weight" in err and "config.json" not in err


def test_missing_quantized_tensors_say_dtype_and_shape(tmp_path):
    rng = np.random.default_rng(28)
    t = moe_inputs(rng)
    del t["experts.1.w2.weight_packed"]
    err = refused(tmp_path, "moe", t, "--top-k", "2")
    assert "'experts.1.w2.weight_packed'" in err and "U8 [32, 32]" in err
    for e in (0, 2):   # an expert with no tensors at all is named in the file's MXFP4 form
        t = moe_inputs(rng)
        for n in [n for n in t if n.startswith(f"experts.{e}.")]:
            del t[n]
        err = refused(tmp_path, "moe", t, "--top-k", "2")
        assert f"'experts.{e}.w1.weight_packed'" in err and "missing" in err
    packed, scales = random_mxfp4(rng, 4, 64)
    err = refused(tmp_path, "mxfp4", {"weight_scale": scales})
    assert "'weight_packed'" in err and "missing" in err and "U8 [R, C/2]" in err
    err = refused(tmp_path, "mxfp4", {"weight_packed": packed})
    assert "'weight_scale'" in err and "missing" in err and "U8 [4, 2]" in err


# ---- outputs that overflow fp32 on finite inputs are refused, never written as NaN or inf ------------

def test_kda_output_that_overflows_is_refused_naming_it(tmp_path):
    t = kda_inputs(np.random.default_rng(40), 1, 3, 1, 4, 2, False)
    t["q"] = np.full_like(t["q"], 1e33)
    err = refused(tmp_path, "kda", t, "--scale", "1e6")
    assert "the output 'o' would hold " in err and "at [0, 0, 0, " in err and "left fp32's range" in err, err


def test_moe_whose_router_scores_all_underflow_is_refused_not_nan(tmp_path):
    t = moe_inputs(np.random.default_rng(41))
    # Every router logit -192: each sigmoid is 0 in fp32, and renormalising divided 0 by 0.
    t["hidden_states"] = np.zeros_like(t["hidden_states"])
    t["hidden_states"][:, 0] = 1.0
    t["gate.weight"] = np.zeros_like(t["gate.weight"])
    t["gate.weight"][:, 0] = -192.0
    t["gate.e_score_correction_bias"] = np.zeros_like(t["gate.e_score_correction_bias"])
    err = refused(tmp_path, "moe", t, "--top-k", "2")
    assert "would hold NaN" in err and ("'topk_weights'" in err or "'output'" in err), err


def test_mxfp4_fused_output_that_overflows_is_refused_but_an_inf_weight_is_kept(tmp_path):
    packed = np.full((2, 16), 0x77, np.uint8)  # every code 6.0
    scales = np.full((2, 1), 200, np.uint8)    # 2^73: 6 x 2^73 is finite
    x = np.full((1, 32), 1e30, np.float32)
    err = refused(tmp_path, "mxfp4", {"weight_packed": packed, "weight_scale": scales, "input": x})
    assert "the output 'output' would hold inf" in err, err
    scales[0, 0] = 254  # 6 x 2^127 = inf in the dequantised weight: what the codes say, kept (docs/ref-cli.md)
    out = run_ref(tmp_path, "mxfp4", {"weight_packed": packed, "weight_scale": scales})
    assert np.isinf(out["weight"][0, 0])


def test_mxfp4_refuses_a_tensor_it_does_not_read(tmp_path):
    packed, scales = random_mxfp4(np.random.default_rng(42), 2, 32)
    err = refused(tmp_path, "mxfp4", {"weight_packed": packed, "weight_scale": scales,
                                      "inputs": np.ones((1, 32), np.float32)})
    assert "'inputs'" in err, err


def test_moe_flags_that_change_nothing_are_refused(tmp_path):
    t = moe_inputs(np.random.default_rng(43))
    err = refused(tmp_path, "moe", t, "--situ-beta", "0.5", *moe_config(tmp_path, hidden_act="silu"))
    assert "--situ-beta applies to the SiTU activation" in err, err
    del t["routed_expert_norm.weight"]
    err = refused(tmp_path, "moe", t, "--top-k", "2", "--eps", "0.1")
    assert "--eps is the latent norm's epsilon" in err, err


@pytest.mark.parametrize("key,value,says", [
    ("num_experts", 16, "num_experts is 16, but the file's layer has 8"),
    ("hidden_size", 256, "hidden_size is 256, but the file's layer has 64"),
    ("moe_intermediate_size", 96, "moe_intermediate_size is 96, but the file's layer has 64"),
    ("routed_expert_hidden_size", 64, "routed_expert_hidden_size (the latent width; == hidden_size: no projection) "
                                      "is 64, but the file's layer has 32"),
])
def test_moe_config_of_another_layer_is_refused(tmp_path, key, value, says):
    t = moe_inputs(np.random.default_rng(44))
    err = refused(tmp_path, "moe", t, *moe_config(tmp_path, **{key: value}))
    assert says in err, err
