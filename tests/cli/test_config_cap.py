"""A model directory's config.json is read up to the same cap as `plan --model` and `model init
--config` (16 MiB): a larger one is refused naming its size, not read whole (an 8 GB sparse file under
a memory limit was reported as "not valid JSON ... unexpected end of input")."""
import os
import resource


def test_model_dir_with_an_oversized_config_json(terrace, tmp_path):
    d = tmp_path / "toy"
    terrace("model", "init", "--preset", "k3-toy", "--out", d, "--routing-tokens", "0", check=True)
    os.truncate(d / "config.json", 8 << 30)  # sparse: the config, then zeros
    # Under a 4 GiB address-space cap, as the report had it: a reader that reads the file whole fails
    # fast (and reads no 8 GB) instead of passing.
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    soft = 4 << 30 if hard == resource.RLIM_INFINITY else min(4 << 30, hard)
    cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # noqa: E731
    r = terrace("model", "inspect", d, preexec_fn=cap)
    assert r.returncode == 1, r.stderr
    assert f"config file '{d / 'config.json'}' is {8 << 30} bytes, over the limit of {16 << 20} bytes" in r.stderr
    assert "not valid JSON" not in r.stderr and "internal error" not in r.stderr
