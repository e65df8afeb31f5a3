"""Fixtures shared by every pytest suite under tests/ (ctest sets TERRACE_BIN to the built binary)."""
import os
import subprocess

import pytest


@pytest.fixture(scope="session")
def terrace_bin():
    """Path of the built `terrace` binary; the test is skipped (visibly) when TERRACE_BIN is unset."""
    path = os.environ.get("TERRACE_BIN")
    if not path or not os.path.exists(path):
        pytest.skip("TERRACE_BIN is not set to the built terrace binary")
    return path


@pytest.fixture(scope="session")
def make_model(tmp_path_factory, terrace_bin):
    """make_model(preset, seed) -> the folder of a random-weight model made by `terrace model init`
    (no routing calibration), made once per (preset, seed) per session."""
    made = {}

    def make(preset="k3-toy", seed=0):
        if (preset, seed) not in made:
            d = tmp_path_factory.mktemp(f"{preset}-{seed}") / "m"
            p = subprocess.run([terrace_bin, "model", "init", "--preset", preset, "--out", str(d), "--seed", str(seed),
                                "--routing-tokens", "0"], capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, p.stderr
            made[(preset, seed)] = d
        return made[(preset, seed)]

    return make
